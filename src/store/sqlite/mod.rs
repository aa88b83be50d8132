//! The embedded store: SQLite in WAL mode, the only code that speaks SQL. One file per
//! area (`images`, `nodes`, `boots`, `events`, `leases`); writers queue in process at a
//! write gate before SQLite's own lock, and a read-only pool serves the DHCP path.

mod boots;
mod events;
mod images;
mod leaders;
mod leases;
mod node_cache;
mod nodes;

use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use crate::store::{Backend, Store, StoreError};

/// The database's name in the data directory, when `[store] url` names none.
pub const DATABASE_FILE: &str = "bootfleet.db";

/// Opens (creating) the database at `path`, migrated.
pub async fn open(path: &Path) -> Result<Store, StoreError> {
    Ok(std::sync::Arc::new(SqliteStore::open(path).await?))
}

#[derive(Clone, Debug)]
pub struct SqliteStore {
    pool: SqlitePool,
    read_pool: SqlitePool,
    /// Every write in this process queues here (see `write_gate`).
    write_gate: std::sync::Arc<tokio::sync::Mutex<()>>,
    /// Bumped after every commit that wrote events (see `events`).
    events_written: std::sync::Arc<tokio::sync::watch::Sender<u64>>,
    /// Node records for DHCP (`node_for_dhcp`); every write to `nodes` invalidates.
    node_cache: std::sync::Arc<node_cache::NodeCache>,
}

/// A write transaction holding its turn at the write gate until it ends.
pub(crate) struct WriteTx {
    tx: sqlx::Transaction<'static, sqlx::Sqlite>,
    _gate: tokio::sync::OwnedMutexGuard<()>,
}

impl WriteTx {
    pub(crate) async fn commit(self) -> Result<(), sqlx::Error> {
        self.tx.commit().await
    }
}

impl std::ops::Deref for WriteTx {
    type Target = sqlx::SqliteConnection;
    fn deref(&self) -> &Self::Target {
        &self.tx
    }
}

impl std::ops::DerefMut for WriteTx {
    fn deref_mut(&mut self) -> &mut Self::Target {
        &mut self.tx
    }
}

impl SqliteStore {
    /// Opens (creating) `path`, in WAL mode, and applies the embedded migrations.
    pub async fn open(path: &Path) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // Image and tag writes are rare and must survive power loss.
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true);
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await?;
        sqlx::migrate!("./migrations/sqlite").run(&pool).await?;
        // Readers that never wait for a connection held by a writer queued on the write
        // lock (WAL lets them read alongside it); for the DHCP path.
        let read_pool = SqlitePoolOptions::new()
            .max_connections(2)
            .connect_with(
                SqliteConnectOptions::new()
                    .filename(path)
                    .read_only(true)
                    .busy_timeout(Duration::from_secs(10)),
            )
            .await?;
        Ok(Self {
            pool,
            read_pool,
            write_gate: Default::default(),
            events_written: std::sync::Arc::new(tokio::sync::watch::Sender::new(0)),
            node_cache: Default::default(),
        })
    }
    /// A write transaction. `BEGIN IMMEDIATE` takes the write lock up front: a deferred
    /// transaction that reads and then writes fails with SQLITE_BUSY, without waiting,
    /// when another writer committed in between. Writers queue on `write_gate` first.
    pub(crate) async fn write_tx(&self) -> Result<WriteTx, StoreError> {
        let gate = self.write_gate().await;
        let tx = self.pool.begin_with("BEGIN IMMEDIATE").await?;
        Ok(WriteTx { tx, _gate: gate })
    }
    /// Our turn to write. SQLite's own wait for its write lock is a sleep of 1 to 100 ms
    /// between tries, during which the lock often sits free: with a few writers at once
    /// (a boot storm's boot records, attestations, validations) most of the time went to
    /// those sleeps. Queued here, writers take the lock one after another, in order.
    pub(crate) async fn write_gate(&self) -> tokio::sync::OwnedMutexGuard<()> {
        self.write_gate.clone().lock_owned().await
    }
}

#[async_trait]
impl Backend for SqliteStore {
    async fn close(&self) {
        self.read_pool.close().await;
        self.pool.close().await;
    }
    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }
}
