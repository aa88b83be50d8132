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
mod power;
mod removal;
mod rollouts;

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
    /// None once committed (or handed to the rollback task).
    conn: Option<sqlx::pool::PoolConnection<sqlx::Sqlite>>,
    gate: Option<tokio::sync::OwnedMutexGuard<()>>,
}

// The transaction is ours (BEGIN IMMEDIATE, COMMIT, ROLLBACK as statements), not
// sqlx's `Transaction`: when a COMMIT failed (database or disk full), sqlx's went on
// counting the transaction as open, and the pooled connection refused every later write
// with "non-zero transaction depth" after space came back. Here a connection whose
// transaction did not end cleanly is closed, never handed out again.
impl WriteTx {
    pub(crate) async fn commit(mut self) -> Result<(), sqlx::Error> {
        let mut conn = self.conn.take().expect("a transaction commits once");
        let done = sqlx::query("COMMIT").execute(&mut *conn).await;
        if done.is_err() {
            // A failed COMMIT can leave the transaction open.
            if sqlx::query("ROLLBACK").execute(&mut *conn).await.is_err() {
                conn.close_on_drop();
            }
        }
        drop(conn);
        done.map(|_| ())
    }
}

impl Drop for WriteTx {
    /// Not committed (an early return, an error): rolled back before the write gate is
    /// given up, so the next writer finds the lock free; a connection that cannot roll
    /// back is closed (SQLite rolls back on close).
    fn drop(&mut self) {
        let Some(mut conn) = self.conn.take() else {
            return;
        };
        let gate = self.gate.take();
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    if sqlx::query("ROLLBACK").execute(&mut *conn).await.is_err() {
                        conn.close_on_drop();
                    }
                    drop(conn);
                    drop(gate);
                });
            }
            Err(_) => conn.close_on_drop(),
        }
    }
}

impl std::ops::Deref for WriteTx {
    type Target = sqlx::SqliteConnection;
    fn deref(&self) -> &Self::Target {
        self.conn.as_deref().expect("open until committed")
    }
}

impl std::ops::DerefMut for WriteTx {
    fn deref_mut(&mut self) -> &mut Self::Target {
        self.conn.as_deref_mut().expect("open until committed")
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
        let mut conn = self.pool.acquire().await?;
        if let Err(e) = sqlx::query("BEGIN IMMEDIATE").execute(&mut *conn).await {
            conn.close_on_drop();
            return Err(e.into());
        }
        Ok(WriteTx {
            conn: Some(conn),
            gate: Some(gate),
        })
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
    async fn probe_write(&self, server: &str, now_ms: i64) -> Result<(), StoreError> {
        // A transaction like every other write, so a disk that cannot take one shows here.
        let mut tx = self.write_tx().await?;
        sqlx::query(
            "INSERT INTO write_probes (server, at_ms) VALUES (?1, ?2)
             ON CONFLICT (server) DO UPDATE SET at_ms = excluded.at_ms",
        )
        .bind(server)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
        // Servers that stopped leave a row each; a day on, theirs go.
        sqlx::query("DELETE FROM write_probes WHERE at_ms < ?1")
            .bind(now_ms - 86_400_000)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }
}
