//! The shared store: PostgreSQL, for several servers on one state. Same tables as
//! SQLite (`migrations/postgres`), same row decoders (`store::rows`); what differs is how
//! invariants hold across processes. SQLite serialises every write in one process;
//! here each one names what it serialises on:
//! - node state changes compare-and-set on `version` (a row update under the row's lock);
//! - the disruption budget, image inserts and tag moves take a transaction-scoped
//!   advisory lock (`lock::REIMAGE`, `lock::IMAGES`), so two servers cannot both take the
//!   last slot or both publish `name:version`;
//! - events are numbered under `lock::EVENTS` (see `events`), so `seq` follows commit
//!   order with no gaps, and every commit with events sends a NOTIFY that wakes SSE
//!   streams and webhook senders on every server.

mod boots;
mod events;
mod images;
mod leaders;
mod leases;
mod nodes;
mod power;
mod removal;
mod revalidations;
mod rollouts;
mod tokens;
mod tpm;

use std::time::Duration;

use async_trait::async_trait;
use sqlx::postgres::{PgConnectOptions, PgListener, PgPool, PgPoolOptions};

use crate::store::{Backend, Store, StoreError};

/// Advisory lock keys (`pg_advisory_xact_lock`), one per thing serialised across servers.
pub(crate) mod lock {
    /// Event numbering: held from an event's insert to its commit.
    pub const EVENTS: i64 = 0x626f_6f74_0001;
    /// The disruption budget: every reimage decision.
    pub const REIMAGE: i64 = 0x626f_6f74_0002;
    /// Image inserts and tag moves (rare; `name:version` and tag clashes are read first).
    pub const IMAGES: i64 = 0x626f_6f74_0003;
}

/// The channel every commit with events notifies.
const EVENTS_CHANNEL: &str = "bootfleet_events";

/// Connections per server: a boot storm's writers and SSE polls.
const MAX_CONNECTIONS: u32 = 16;
/// Connections of the control pool: DHCP's node reads and the role leases. A storm's
/// writers holding all of the shared pool must not make DHCP packets wait past the
/// firmware's retransmit timers (a 10,000-node storm on two servers lost 2,764 iPXE DHCP
/// exchanges so), nor a role's renewal wait until its lease lapses.
const CONTROL_CONNECTIONS: u32 = 4;

/// Opens the database at `url` (`postgres://user@host/db`, or with `?host=/socket/dir`),
/// migrated, with a listener for other servers' events.
pub async fn open(url: &str, password: Option<&str>) -> Result<Store, StoreError> {
    Ok(std::sync::Arc::new(PgStore::open(url, password).await?))
}

#[derive(Clone, Debug)]
pub struct PgStore {
    pool: PgPool,
    /// For `node_for_dhcp` and the role leases (`leaders.rs`) only; connected lazily,
    /// on first use (DHCP's reads come from DHCP's own runtime).
    control_pool: PgPool,
    /// Bumped when any server commits events (LISTEN, see `events`).
    events_written: std::sync::Arc<tokio::sync::watch::Sender<u64>>,
    /// Stops the listener task at `close`.
    stop: tokio_util::sync::CancellationToken,
}

impl PgStore {
    pub async fn open(url: &str, password: Option<&str>) -> Result<Self, StoreError> {
        // sqlx's parse error quotes nothing of the URL, so a password cannot leak here.
        let mut options: PgConnectOptions = url.parse()?;
        if let Some(password) = password {
            options = options.password(password);
        }
        // A server cut off mid-transaction must not hold a row or an advisory lock (the
        // event lock stalls every server's state changes) until TCP gives up: the
        // database ends such sessions itself.
        options = options.options([
            ("idle_in_transaction_session_timeout", "15s"),
            ("lock_timeout", "30s"),
            ("statement_timeout", "60s"),
        ]);
        let pool = PgPoolOptions::new()
            .max_connections(MAX_CONNECTIONS)
            // A request waits this long for a connection before it fails with 503: a
            // server whose database is gone says so quickly, and nodes retry elsewhere.
            .acquire_timeout(Duration::from_secs(5))
            .connect_with(options.clone())
            .await?;
        let control_pool = PgPoolOptions::new()
            .max_connections(CONTROL_CONNECTIONS)
            // Under a firmware's first retransmit: a packet not answered by then is
            // better dropped (another server answers, or the retransmit does); and well
            // under a role's renewal period.
            .acquire_timeout(Duration::from_secs(2))
            .connect_lazy_with(options);
        // Several servers starting at once on an empty database: one migrates, the
        // others wait on sqlx's own advisory lock and find the work done.
        sqlx::migrate!("./migrations/postgres").run(&pool).await?;
        let store = Self {
            pool,
            control_pool,
            events_written: std::sync::Arc::new(tokio::sync::watch::Sender::new(0)),
            stop: Default::default(),
        };
        // Listening before the store is handed out: a commit by another server right
        // after open wakes this one's readers (the LISTEN used to race the first NOTIFY).
        let mut listener = PgListener::connect_with(&store.pool).await?;
        listener.listen(EVENTS_CHANNEL).await?;
        tokio::spawn(listen(
            listener,
            store.events_written.clone(),
            store.stop.clone(),
        ));
        Ok(store)
    }

    /// A transaction; READ COMMITTED, so every write that depends on what it read locks
    /// what it read (a row, or an advisory lock).
    ///
    /// Begun in a task of its own. sqlx 0.9.0's `Pool::begin` is not cancel-safe on
    /// PostgreSQL (transact-rs/sqlx#4393, fixed upstream after 0.9.0): a caller that goes
    /// away while BEGIN's round trip is in flight (a client disconnecting) leaves the
    /// session inside a transaction nothing ends, and the pool hands that connection out
    /// again. Statements meant to commit on their own then run inside it, hold their
    /// locks and are never committed; a later rollback on it would take them. Spawned,
    /// the begin always finishes, and a caller gone by then drops a transaction sqlx
    /// knows of, which it rolls back. `callers_going_away_mid_write_leave_every_change_whole`
    /// in the store battery catches it.
    pub(crate) async fn tx(
        &self,
    ) -> Result<sqlx::Transaction<'static, sqlx::Postgres>, StoreError> {
        let pool = self.pool.clone();
        match tokio::spawn(async move { pool.begin().await }).await {
            Ok(begun) => Ok(begun?),
            Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
            // The runtime is stopping: nothing will be written.
            Err(_) => Err(StoreError::Unavailable(sqlx::Error::PoolClosed)),
        }
    }

    /// Wakes this server's readers at once (other servers hear the NOTIFY).
    pub(crate) fn notify_events(&self) {
        self.events_written.send_modify(|n| *n = n.wrapping_add(1));
    }
}

/// Wakes event readers whenever any server commits events. A lost connection is
/// reconnected by sqlx's listener; readers poll as well, so a wakeup missed while it
/// reconnects costs at most one poll interval.
async fn listen(
    mut listener: PgListener,
    woken: std::sync::Arc<tokio::sync::watch::Sender<u64>>,
    stop: tokio_util::sync::CancellationToken,
) {
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            got = listener.try_recv() => match got {
                Ok(_) => woken.send_modify(|n| *n = n.wrapping_add(1)),
                Err(e) => {
                    tracing::warn!(error = %e, "event listener failed; readers poll");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            },
        }
    }
}

#[async_trait]
impl Backend for PgStore {
    async fn close(&self) {
        self.stop.cancel();
        self.pool.close().await;
        self.control_pool.close().await;
    }
    async fn ping(&self) -> Result<(), StoreError> {
        sqlx::query("SELECT 1").execute(&self.pool).await?;
        Ok(())
    }
    async fn probe_write(&self, server: &str, now_ms: i64) -> Result<(), StoreError> {
        let mut tx = self.tx().await?;
        sqlx::query(
            "INSERT INTO write_probes (server, at_ms) VALUES ($1, $2)
             ON CONFLICT (server) DO UPDATE SET at_ms = excluded.at_ms",
        )
        .bind(server)
        .bind(now_ms)
        .execute(&mut *tx)
        .await?;
        // Servers that stopped leave a row each; a day on, theirs go.
        sqlx::query("DELETE FROM write_probes WHERE at_ms < $1")
            .bind(now_ms - 86_400_000)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }
}
