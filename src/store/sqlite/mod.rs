//! The embedded store: SQLite in WAL mode, the only code that speaks SQL. One file per
//! area (`images`, `nodes`, `boots`, `events`, `leases`); writers queue in process at a
//! write gate before SQLite's own lock, and a read-only pool serves the DHCP path.

mod boot_cache;
mod boots;
mod events;
mod group_commit;
mod images;
mod kept;
mod leaders;
mod leases;
mod node_cache;
mod nodes;
mod power;
mod removal;
mod revalidations;
mod rollouts;
mod tokens;
mod tpm;

use std::path::Path;
use std::time::Duration;

use async_trait::async_trait;
use sqlx::sqlite::{
    SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions, SqliteSynchronous,
};

use crate::store::{Backend, Store, StoreError};

/// The database's name in the data directory, when `[store] url` names none.
pub const DATABASE_FILE: &str = "bootfleet.db";

/// Writers that may queue for their turn; one more is refused (`StoreError::Busy`). A
/// queued writer holds its request (a few KiB); 4,096 of them bound that memory to a few
/// MiB, and at a batch's pace (a few ms for hundreds) none waits long.
pub const MAX_QUEUED_WRITES: usize = 4096;

/// Takes `<path>.lock` for this process, or says which server holds it: a SQLite database
/// has one server process (its write gate and its caches of nodes and boots are in that
/// process; another's writes would leave them stale). Several servers share PostgreSQL.
/// The lock goes with the returned file, and with the process.
pub fn lock_for_one_server(path: &Path) -> Result<std::fs::File, StoreError> {
    let mut name = path.as_os_str().to_owned();
    name.push(".lock");
    let lock_path = std::path::PathBuf::from(name);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| StoreError::Config(format!("cannot open {}: {e}", lock_path.display())))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => Err(StoreError::Config(format!(
            "another bootfleet server has {} open (it holds {}): a SQLite database has one \
             server; several servers share a PostgreSQL store ([store] url)",
            path.display(),
            lock_path.display()
        ))),
        Err(std::fs::TryLockError::Error(e)) => Err(StoreError::Config(format!(
            "cannot lock {}: {e}",
            lock_path.display()
        ))),
    }
}

/// Opens (creating) the database at `path`, migrated.
pub async fn open(path: &Path) -> Result<Store, StoreError> {
    Ok(std::sync::Arc::new(SqliteStore::open(path).await?))
}

#[derive(Clone, Debug)]
pub struct SqliteStore {
    pool: SqlitePool,
    read_pool: SqlitePool,
    /// Every write in this process queues here, and shares its commit (`group_commit`).
    writes: std::sync::Arc<group_commit::GroupCommit>,
    /// Bumped after every commit that wrote events (see `events`).
    events_written: std::sync::Arc<tokio::sync::watch::Sender<u64>>,
    /// Node records for DHCP (`node_for_dhcp`), the controller's first try and the
    /// heartbeat (`node_for_heartbeat`); every write to `nodes` refreshes or drops its own.
    node_cache: std::sync::Arc<node_cache::NodeCache>,
    /// Each node's newest boot for the agent API's token check (`boot_for_attest`);
    /// kept by the write gate's closer.
    boot_cache: std::sync::Arc<boot_cache::BootCache>,
    /// The broken-blob list every boot script checks; forgotten when a batch that wrote it
    /// ends.
    broken_blobs: std::sync::Arc<kept::Kept<Vec<(crate::api::Digest, String)>>>,
    /// The image each REF named when last resolved (every boot script resolves its
    /// node's); forgotten when a batch that wrote an image or a tag ends.
    resolved: std::sync::Arc<kept::KeptMap<crate::api::ImageRef, Option<crate::api::Digest>>>,
}

/// REFs whose resolution is kept: a fleet boots a handful of images.
const RESOLVED_KEPT: usize = 1024;

pub(crate) use group_commit::WriteTx;

impl SqliteStore {
    /// Opens (creating) `path`, in WAL mode, and applies the embedded migrations.
    pub async fn open(path: &Path) -> Result<Self, StoreError> {
        Self::open_with(path, MAX_QUEUED_WRITES).await
    }
    /// `open`, with at most `max_queued_writes` writers waiting for their turn.
    pub async fn open_with(path: &Path, max_queued_writes: usize) -> Result<Self, StoreError> {
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            // Image and tag writes are rare and must survive power loss.
            .synchronous(SqliteSynchronous::Full)
            .busy_timeout(Duration::from_secs(10))
            .foreign_keys(true);
        // No ping before each acquire: a local file has no far end to hang up, and for
        // SQLite each ping is a round trip to the connection's thread (two context
        // switches) on every query (sqlx still pings once on release).
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .test_before_acquire(false)
            .connect_with(options)
            .await?;
        sqlx::migrate!("./migrations/sqlite").run(&pool).await?;
        // Readers that never wait for a connection held by a writer queued on the write
        // lock (WAL lets them read alongside it); for the DHCP path.
        let read_pool = SqlitePoolOptions::new()
            .max_connections(2)
            .test_before_acquire(false)
            .connect_with(
                SqliteConnectOptions::new()
                    .filename(path)
                    .read_only(true)
                    .busy_timeout(Duration::from_secs(10)),
            )
            .await?;
        let node_cache: std::sync::Arc<node_cache::NodeCache> = Default::default();
        let boot_cache: std::sync::Arc<boot_cache::BootCache> = Default::default();
        Ok(Self {
            pool,
            read_pool,
            writes: group_commit::GroupCommit::new(
                max_queued_writes,
                node_cache.clone(),
                boot_cache.clone(),
            ),
            events_written: std::sync::Arc::new(tokio::sync::watch::Sender::new(0)),
            node_cache,
            boot_cache,
            broken_blobs: Default::default(),
            resolved: std::sync::Arc::new(kept::KeptMap::new(RESOLVED_KEPT)),
        })
    }
    /// A write transaction: this writer's part of a shared commit (`group_commit`).
    /// Writers queue in process, in order: SQLite's own wait for its write lock is a
    /// sleep of 1 to 100 ms between tries, during which the lock often sits free.
    pub(crate) async fn write_tx(&self) -> Result<WriteTx, StoreError> {
        self.writes.begin(&self.pool).await
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
    fn write_stats(&self) -> Option<crate::store::WriteStats> {
        Some(self.writes.stats())
    }
}
