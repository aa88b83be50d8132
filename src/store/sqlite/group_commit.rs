//! Group commit: concurrent writers share one SQLite transaction, and one fsync, each in
//! a savepoint of its own; each is answered only once the shared COMMIT is durable.
//!
//! Why: with `synchronous = FULL` every COMMIT syncs the WAL, and in a boot storm
//! thousands of small writes (boot records, attestations, validations) queued one sync
//! each. Here a writer takes its turn at the gate (FIFO), joins the open batch (or opens
//! one with `BEGIN IMMEDIATE`), writes inside `SAVEPOINT member` and gives up the gate to
//! the next writer, who releases that savepoint in the same round trip as it opens its
//! own (each statement is a hand-off to the connection's thread and back, and the gate
//! is held across them: fewer trips, more writers a second). Each batch has one closer, a
//! task queued at the gate when the batch opens: it gets its turn after every writer that
//! queued before it, commits the batch and tells its members. A writer that fails rolls back to its savepoint only:
//! the others' writes stand, and each writer's own writes commit whole or not at all, as
//! they did with a transaction each. If the COMMIT itself fails, every member hears so.
//!
//! Admission control lives here too: a writer arriving when `max_waiting` are already
//! queued is refused at once with `StoreError::Busy` (the HTTP layer's 503 with
//! Retry-After), so the memory of requests waiting to write stays bounded. The server's
//! own tasks (`store::own_task`) are never refused.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use sqlx::pool::PoolConnection;
use sqlx::{Sqlite, SqlitePool};
use tokio::sync::{Mutex, OwnedMutexGuard, watch};

use super::boot_cache::{BootCache, BootTouch};
use super::kept::Forget;
use super::node_cache::NodeCache;
use crate::api::{Digest, Mac};
use crate::store::{NodeRecord, StoreError};

/// What a batch's members learn when it ends: committed, or the commit's error.
type Outcome = Option<Result<(), Arc<sqlx::Error>>>;

/// The transaction open at the gate, shared by the writers of one batch.
struct Batch {
    id: u64,
    conn: PoolConnection<Sqlite>,
    ended: watch::Sender<Outcome>,
    /// Writers whose writes joined the batch (committed into it, savepoint released or
    /// not yet).
    members: usize,
    /// Nodes whose rows the batch wrote, in the order written, each with its row as
    /// written when the writer had it: once the batch commits, the closer drops each from
    /// the DHCP cache and keeps the row of its last write if that write gave one (so a
    /// writer whose caller went away still leaves no stale entry, and a state change
    /// needs no read after its commit).
    touched: Vec<(Mac, Option<NodeRecord>)>,
    /// What the batch's writers did to boots, in order, for the boot cache (applied by
    /// the closer once the batch commits, like `touched`).
    boots: Vec<BootTouch>,
    /// Values kept in memory that the batch's writers wrote what they are made of: the
    /// closer forgets them once the batch ends, committed or not.
    forgets: Vec<Arc<dyn Forget>>,
    /// The task that commits it. Finished with the batch still open means it was
    /// dropped unrun (its runtime stopping): the next writer starts another.
    closer: tokio::task::JoinHandle<()>,
    /// The last member's savepoint is still open, its writes in the batch: the next
    /// writer releases it in the same round trip as it opens its own, and COMMIT
    /// commits it with the rest. One trip to the connection's thread fewer a writer.
    release_owed: bool,
    /// A writer's rollback to its savepoint is owed (set before the rollback task is
    /// spawned, cleared when it ran): still set when the gate comes back means the task
    /// never ran, and the batch holds writes that must not commit.
    rollback_owed: bool,
}

/// The gate's state: the open batch, if any.
#[derive(Default)]
pub(crate) struct Open(Option<Batch>);

pub(crate) struct GroupCommit {
    gate: Arc<Mutex<Open>>,
    /// Writers queued at the gate now (for admission control and the metric).
    waiting: AtomicUsize,
    max_waiting: usize,
    next_id: AtomicU64,
    node_cache: Arc<NodeCache>,
    boot_cache: Arc<BootCache>,
    /// Batches committed, and writers in them (the mean batch size is their ratio).
    batches: AtomicU64,
    members: AtomicU64,
    refused: AtomicU64,
}

impl std::fmt::Debug for GroupCommit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GroupCommit")
            .field("waiting", &self.waiting.load(Ordering::Relaxed))
            .field("max_waiting", &self.max_waiting)
            .finish()
    }
}

/// One writer's part of a batch: open (inside its `SAVEPOINT`) until committed or
/// dropped; holds the gate until then.
pub(crate) struct WriteTx {
    /// None once committed (or handed to the rollback task).
    gate: Option<OwnedMutexGuard<Open>>,
    ended: watch::Receiver<Outcome>,
}

/// Counts a writer as queued while it waits for the gate, dropped or not.
struct Queued<'a>(&'a AtomicUsize);

impl Drop for Queued<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
}

impl GroupCommit {
    pub(crate) fn new(
        max_waiting: usize,
        node_cache: Arc<NodeCache>,
        boot_cache: Arc<BootCache>,
    ) -> Arc<Self> {
        Arc::new(Self {
            gate: Default::default(),
            waiting: AtomicUsize::new(0),
            max_waiting,
            next_id: AtomicU64::new(0),
            node_cache,
            boot_cache,
            batches: AtomicU64::new(0),
            members: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        })
    }

    /// Writers queued at the gate now.
    pub(crate) fn waiting(&self) -> usize {
        self.waiting.load(Ordering::Relaxed)
    }

    pub(crate) fn stats(&self) -> crate::store::WriteStats {
        crate::store::WriteStats {
            queued: self.waiting() as u64,
            commits: self.batches.load(Ordering::Relaxed),
            writes: self.members.load(Ordering::Relaxed),
            refused: self.refused.load(Ordering::Relaxed),
        }
    }

    /// A writer's turn: its own savepoint in the open batch (opening one if none is).
    pub(crate) async fn begin(self: &Arc<Self>, pool: &SqlitePool) -> Result<WriteTx, StoreError> {
        let queued = self.waiting.fetch_add(1, Ordering::Relaxed);
        let counted = Queued(&self.waiting);
        if queued >= self.max_waiting && !crate::store::in_own_task() {
            self.refused.fetch_add(1, Ordering::Relaxed);
            return Err(StoreError::Busy(queued));
        }
        let mut gate = self.gate.clone().lock_owned().await;
        drop(counted);
        if let Some(batch) = gate.0.as_mut() {
            if batch.rollback_owed {
                let batch = gate.0.take().expect("open");
                let _ = end_broken(batch, not_rolled_back());
            } else if batch.closer.is_finished() {
                batch.closer = self.spawn_closer(batch.id);
            }
        }
        if gate.0.is_none() {
            gate.0 = Some(self.open_batch(pool).await?);
        }
        let batch = gate.0.as_mut().expect("opened above");
        // Only the newest member's savepoint is ever open: a failing writer rolls back
        // to its own, never into an earlier member's writes.
        let open = if batch.release_owed {
            "RELEASE member; SAVEPOINT member"
        } else {
            "SAVEPOINT member"
        };
        // Cleared before the trip: a begin dropped mid-way may have run the RELEASE and
        // not the SAVEPOINT, and a RELEASE owed twice would fail and end the batch. Left
        // unreleased instead, the earlier savepoint is an outer one that commits with the
        // batch, and the next writer's rolls back only into its own.
        batch.release_owed = false;
        if let Err(e) = sqlx::query(open).execute(&mut *batch.conn).await {
            // The batch's connection is broken: end it for everyone in it.
            let batch = gate.0.take().expect("open");
            return Err(end_broken(batch, e));
        }
        let ended = batch.ended.subscribe();
        Ok(WriteTx {
            gate: Some(gate),
            ended,
        })
    }

    /// `BEGIN IMMEDIATE` takes the write lock up front (a deferred transaction that reads
    /// and then writes fails with SQLITE_BUSY, without waiting, when another connection
    /// wrote in between), and its closer queues at the gate behind the writers already
    /// there.
    async fn open_batch(self: &Arc<Self>, pool: &SqlitePool) -> Result<Batch, StoreError> {
        // Closed rather than given back to the pool unless it makes it into the batch: a
        // caller that goes away while BEGIN is in flight (a client disconnecting) would
        // otherwise leave a connection in the pool inside a transaction, holding SQLite's
        // write lock, and every later BEGIN IMMEDIATE waiting out the busy timeout.
        let mut opening = Opening(Some(pool.acquire().await?));
        let conn = opening.0.as_mut().expect("set above");
        sqlx::query("BEGIN IMMEDIATE").execute(&mut **conn).await?;
        let conn = opening.0.take().expect("set above");
        let id = self.next_id.fetch_add(1, Ordering::Relaxed);
        Ok(Batch {
            id,
            conn,
            ended: watch::Sender::new(None),
            members: 0,
            touched: Vec::new(),
            boots: Vec::new(),
            forgets: Vec::new(),
            closer: self.spawn_closer(id),
            release_owed: false,
            rollback_owed: false,
        })
    }

    fn spawn_closer(self: &Arc<Self>, id: u64) -> tokio::task::JoinHandle<()> {
        let group = self.clone();
        tokio::spawn(async move { group.close(id).await })
    }

    /// The closer of batch `id`: commits it when its turn at the gate comes.
    async fn close(self: Arc<Self>, id: u64) {
        let mut gate = self.gate.clone().lock_owned().await;
        if gate.0.as_ref().is_none_or(|b| b.id != id) {
            return; // Ended already (its connection broke).
        }
        if gate.0.as_ref().is_some_and(|b| b.rollback_owed) {
            let batch = gate.0.take().expect("open");
            let _ = end_broken(batch, not_rolled_back());
            return;
        }
        let Batch {
            mut conn,
            ended,
            members,
            touched,
            boots,
            forgets,
            ..
        } = gate.0.take().expect("checked above");
        let done = sqlx::query("COMMIT").execute(&mut *conn).await;
        for kept in forgets {
            kept.forget();
        }
        if done.is_err() {
            // A failed COMMIT can leave the transaction open; a connection that cannot
            // end it is closed (SQLite rolls back on close), never handed out again.
            if sqlx::query("ROLLBACK").execute(&mut *conn).await.is_err() {
                conn.close_on_drop();
            }
        } else {
            keep_written(&self.node_cache, touched);
            for touch in boots {
                self.boot_cache.apply(touch);
            }
            self.batches.fetch_add(1, Ordering::Relaxed);
            self.members.fetch_add(members as u64, Ordering::Relaxed);
        }
        drop(conn);
        drop(gate);
        ended.send_replace(Some(done.map(|_| ()).map_err(Arc::new)));
    }
}

/// After a commit, under the gate (no other batch commits meanwhile): every node the
/// batch wrote leaves the cache, then the row of each node's last write comes back where
/// that write gave one. A reader that raced the commit cannot fill over it: the
/// invalidations moved the epoch its read started at.
fn keep_written(cache: &NodeCache, touched: Vec<(Mac, Option<NodeRecord>)>) {
    let mut last: std::collections::HashMap<Mac, Option<NodeRecord>> =
        std::collections::HashMap::with_capacity(touched.len());
    for (mac, row) in touched {
        cache.invalidate(&mac);
        last.insert(mac, row);
    }
    let epoch = cache.epoch();
    for row in last.into_values().flatten() {
        cache.fill(epoch, &row);
    }
}

/// Rolls the gate holder's writes back to its savepoint. `rollback_owed` is set until
/// that is done: a caller dropped mid-way leaves it set, and the batch is then rolled back
/// whole rather than commit what this writer gave up. A batch that cannot roll back to
/// the savepoint ends for everyone (its connection closed, rolling back).
async fn roll_back_member(gate: &mut OwnedMutexGuard<Open>) {
    let batch = gate.0.as_mut().expect("open while a member holds the gate");
    batch.rollback_owed = true;
    let undone = async {
        sqlx::query("ROLLBACK TO member")
            .execute(&mut *batch.conn)
            .await?;
        sqlx::query("RELEASE member")
            .execute(&mut *batch.conn)
            .await
    };
    match undone.await {
        Ok(_) => batch.rollback_owed = false,
        Err(e) => {
            let batch = gate.0.take().expect("open");
            let _ = end_broken(batch, e);
        }
    }
}

/// A connection on its way into a batch: closed (SQLite rolls back on close) if dropped
/// before it got there.
struct Opening(Option<PoolConnection<Sqlite>>);

impl Drop for Opening {
    fn drop(&mut self) {
        if let Some(conn) = self.0.as_mut() {
            conn.close_on_drop();
        }
    }
}

fn not_rolled_back() -> sqlx::Error {
    sqlx::Error::Protocol("a failed writer's rollback did not run; the batch is rolled back".into())
}

/// Ends a batch whose connection failed mid-way: rolled back (by closing), every member
/// told.
fn end_broken(mut batch: Batch, e: sqlx::Error) -> StoreError {
    batch.conn.close_on_drop();
    for kept in batch.forgets.drain(..) {
        kept.forget();
    }
    let e = Arc::new(e);
    batch.ended.send_replace(Some(Err(e.clone())));
    StoreError::Batch(e)
}

impl WriteTx {
    /// Leaves this writer's writes in the batch (its savepoint released by the next
    /// writer, or committed with the batch), gives the gate to the next writer and waits
    /// until the batch is durable (or its commit failed, or the release did: either ends
    /// the batch for every member).
    pub(crate) async fn commit(mut self) -> Result<(), StoreError> {
        let mut gate = self.gate.take().expect("a transaction commits once");
        let batch = gate.0.as_mut().expect("open while a member holds the gate");
        batch.release_owed = true;
        batch.members += 1;
        drop(gate);
        outcome(&mut self.ended).await
    }

    /// `commit`, and `mac`'s entries in the DHCP node cache and the boot cache dropped
    /// when the batch commits (by the batch's closer, whatever becomes of this caller).
    pub(crate) async fn commit_touching(mut self, mac: &Mac) -> Result<(), StoreError> {
        self.touch(*mac, None);
        self.touch_boot(BootTouch::Forget(*mac));
        self.commit().await
    }

    /// `commit_touching` for a writer that has its node's row as it wrote it (`RETURNING`):
    /// the cache keeps that row once the batch commits, unless a later writer in the
    /// batch wrote the node too; `boot` is what the writer did to its boot, if anything.
    pub(crate) async fn commit_writing(
        mut self,
        node: &NodeRecord,
        boot: Option<BootTouch>,
    ) -> Result<(), StoreError> {
        self.touch(node.mac, Some(node.clone()));
        if let Some(boot) = boot {
            self.touch_boot(boot);
        }
        self.commit().await
    }

    /// `commit` of an image's removal: the boot cache forgets its boots once the batch
    /// commits.
    pub(crate) async fn commit_removing_image(mut self, image: Digest) -> Result<(), StoreError> {
        self.touch_boot(BootTouch::ForgetImage(image));
        self.commit().await
    }

    /// `kept` is made of what this writer wrote: forgotten when the batch ends (by its
    /// closer, whatever becomes of this caller). Called on the way to commit; a writer
    /// that gives up its writes after it only costs a read.
    pub(crate) fn forget_on_commit(&mut self, kept: Arc<dyn Forget>) {
        self.batch().forgets.push(kept);
    }

    fn touch(&mut self, mac: Mac, row: Option<NodeRecord>) {
        self.batch().touched.push((mac, row));
    }

    /// What this writer did to boots, for the boot cache once the batch commits; only
    /// on the way to commit (a writer that rolls back to its savepoint did nothing).
    fn touch_boot(&mut self, touch: BootTouch) {
        self.batch().boots.push(touch);
    }

    fn batch(&mut self) -> &mut Batch {
        let gate = self.gate.as_mut().expect("open until committed");
        gate.0.as_mut().expect("open while a member holds the gate")
    }

    /// Gives up this writer's writes (back to its savepoint) and waits for the batch
    /// it read from: an answer drawn from what earlier writers in the batch wrote (a
    /// name taken, a version moved) is given only once that is durable.
    pub(crate) async fn abandon(self) -> Result<(), StoreError> {
        // Rolled back by `drop`, in a task of its own: a caller that went away with the
        // rollback in flight (a client disconnecting) would leave it owed, and the closer
        // would then roll back the whole batch, every other member's writes with it.
        let mut ended = self.ended.clone();
        drop(self);
        outcome(&mut ended).await
    }
}

/// A batch's outcome, once its closer has it.
async fn outcome(ended: &mut watch::Receiver<Outcome>) -> Result<(), StoreError> {
    let ended = ended
        .wait_for(Option::is_some)
        .await
        .map(|o| o.clone().expect("waited for"));
    match ended {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(StoreError::batch(e)),
        // The closer was dropped (the runtime is stopping): nothing of it committed.
        Err(_) => Err(StoreError::Unavailable(sqlx::Error::PoolClosed)),
    }
}

impl Drop for WriteTx {
    /// Not committed (an early return, an error): this writer's savepoint is rolled back
    /// before the gate is given up, so the batch goes on without its writes. A batch that
    /// cannot roll back to it ends for everyone (its connection closed, rolling back).
    fn drop(&mut self) {
        let Some(mut gate) = self.gate.take() else {
            return;
        };
        if let Some(batch) = gate.0.as_mut() {
            // Owed from here, not from the spawned task's first step: a task dropped
            // unrun leaves it set for the next writer to see.
            batch.rollback_owed = true;
        }
        match tokio::runtime::Handle::try_current() {
            Ok(runtime) => {
                runtime.spawn(async move {
                    roll_back_member(&mut gate).await;
                    drop(gate);
                });
            }
            Err(_) => {
                let batch = gate.0.take().expect("open");
                let _ = end_broken(batch, sqlx::Error::PoolClosed);
            }
        }
    }
}

impl std::ops::Deref for WriteTx {
    type Target = sqlx::SqliteConnection;
    fn deref(&self) -> &Self::Target {
        let gate = self.gate.as_ref().expect("open until committed");
        &gate
            .0
            .as_ref()
            .expect("open while a member holds the gate")
            .conn
    }
}

impl std::ops::DerefMut for WriteTx {
    fn deref_mut(&mut self) -> &mut Self::Target {
        let gate = self.gate.as_mut().expect("open until committed");
        &mut gate
            .0
            .as_mut()
            .expect("open while a member holds the gate")
            .conn
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePoolOptions};

    fn record(mac: &str, version: i64) -> NodeRecord {
        super::super::node_cache::record(mac, crate::api::NodeState::Discovered, version)
    }

    #[test]
    fn a_commit_keeps_each_nodes_last_written_row_and_drops_the_rest() {
        let cache = NodeCache::default();
        let (a, b) = (
            record("02:00:00:00:00:0a", 1),
            record("02:00:00:00:00:0b", 1),
        );
        cache.fill(cache.epoch(), &a);
        cache.fill(cache.epoch(), &b);
        // A reader that started before the commit and read the old rows.
        let raced = cache.epoch();
        let (a2, a3) = (
            record("02:00:00:00:00:0a", 2),
            record("02:00:00:00:00:0a", 3),
        );
        let b2 = record("02:00:00:00:00:0b", 2);
        keep_written(
            &cache,
            vec![
                (a.mac, Some(a2)),
                (b.mac, Some(b2)),
                (a.mac, Some(a3.clone())),
                // A later write without its row: b's row is no longer known.
                (b.mac, None),
            ],
        );
        assert_eq!(cache.get(&a.mac), Some(a3.clone()));
        assert_eq!(cache.get(&b.mac), None);
        cache.fill(raced, &a);
        cache.fill(raced, &b);
        assert_eq!(cache.get(&a.mac), Some(a3));
        assert_eq!(cache.get(&b.mac), None);
    }

    async fn pool(dir: &tempfile::TempDir) -> SqlitePool {
        let options = SqliteConnectOptions::new()
            .filename(dir.path().join("t.db"))
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal);
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .connect_with(options)
            .await
            .unwrap();
        sqlx::query("CREATE TABLE t (n INTEGER PRIMARY KEY)")
            .execute(&pool)
            .await
            .unwrap();
        pool
    }

    async fn insert(group: &Arc<GroupCommit>, pool: &SqlitePool, n: i64) -> Result<(), StoreError> {
        let mut tx = group.begin(pool).await?;
        sqlx::query("INSERT INTO t (n) VALUES (?)")
            .bind(n)
            .execute(&mut *tx)
            .await?;
        tx.commit().await
    }

    async fn rows(pool: &SqlitePool) -> Vec<i64> {
        sqlx::query_as::<_, (i64,)>("SELECT n FROM t ORDER BY n")
            .fetch_all(pool)
            .await
            .unwrap()
            .into_iter()
            .map(|r| r.0)
            .collect()
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_writers_share_commits_and_each_sees_its_write_durable() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir).await;
        let group = GroupCommit::new(10_000, Default::default(), Default::default());
        let writers: Vec<_> = (0..300)
            .map(|n| {
                let (group, pool) = (group.clone(), pool.clone());
                tokio::spawn(async move {
                    insert(&group, &pool, n).await.unwrap();
                    // Answered only once durable: another connection sees it now.
                    let seen: Option<(i64,)> = sqlx::query_as("SELECT n FROM t WHERE n = ?")
                        .bind(n)
                        .fetch_optional(&pool)
                        .await
                        .unwrap();
                    assert_eq!(seen, Some((n,)), "writer {n} answered before its commit");
                })
            })
            .collect();
        for w in writers {
            w.await.unwrap();
        }
        assert_eq!(rows(&pool).await, (0..300).collect::<Vec<_>>());
        let stats = group.stats();
        assert_eq!(stats.writes, 300);
        let commits = stats.commits;
        assert!(
            commits < 300,
            "no commit was shared: {commits} commits for 300 writers"
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_writer_loses_only_its_own_writes() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir).await;
        let group = GroupCommit::new(10_000, Default::default(), Default::default());
        // Holding the gate, so that the writers below queue into one batch with it.
        let mut first = group.begin(&pool).await.unwrap();
        sqlx::query("INSERT INTO t (n) VALUES (1)")
            .execute(&mut *first)
            .await
            .unwrap();
        let good = {
            let (group, pool) = (group.clone(), pool.clone());
            tokio::spawn(async move { insert(&group, &pool, 3).await })
        };
        let bad = {
            let (group, pool) = (group.clone(), pool.clone());
            tokio::spawn(async move {
                let mut tx = group.begin(&pool).await?;
                sqlx::query("INSERT INTO t (n) VALUES (2)")
                    .execute(&mut *tx)
                    .await?;
                // A duplicate key: this writer fails after one good statement.
                sqlx::query("INSERT INTO t (n) VALUES (1)")
                    .execute(&mut *tx)
                    .await?;
                tx.commit().await
            })
        };
        while group.waiting() < 2 {
            tokio::task::yield_now().await;
        }
        first.commit().await.unwrap();
        good.await.unwrap().unwrap();
        let refused = bad.await.unwrap().unwrap_err();
        assert!(refused.to_string().contains("UNIQUE"), "{refused}");
        assert_eq!(rows(&pool).await, vec![1, 3]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn an_abandoning_writer_loses_its_writes_and_answers_once_the_batch_is_durable() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir).await;
        let group = GroupCommit::new(10_000, Default::default(), Default::default());
        let mut first = group.begin(&pool).await.unwrap();
        sqlx::query("INSERT INTO t (n) VALUES (1)")
            .execute(&mut *first)
            .await
            .unwrap();
        let second = {
            let (group, pool) = (group.clone(), pool.clone());
            tokio::spawn(async move {
                let mut tx = group.begin(&pool).await.unwrap();
                // It reads what the first writer wrote, not yet committed...
                let seen: (i64,) = sqlx::query_as("SELECT COUNT(*) FROM t")
                    .fetch_one(&mut *tx)
                    .await
                    .unwrap();
                sqlx::query("INSERT INTO t (n) VALUES (2)")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                tx.abandon().await.unwrap();
                // ...and answers only once that is durable.
                let durable: (i64,) = sqlx::query_as("SELECT COUNT(*) FROM t WHERE n = 1")
                    .fetch_one(&pool)
                    .await
                    .unwrap();
                (seen.0, durable.0)
            })
        };
        while group.waiting() < 1 {
            tokio::task::yield_now().await;
        }
        first.commit().await.unwrap();
        assert_eq!(second.await.unwrap(), (1, 1));
        assert_eq!(rows(&pool).await, vec![1]);
    }

    /// Callers going away at any point (clients disconnecting) while writers and readers
    /// share the pool: the gate must keep moving. A writer cancelled while its batch's
    /// BEGIN was in flight had left a connection in the pool inside a transaction, and
    /// every later BEGIN IMMEDIATE waited out the busy timeout.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn writers_going_away_at_any_point_never_wedge_the_gate() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir).await;
        let group = GroupCommit::new(100_000, Default::default(), Default::default());
        let next = Arc::new(AtomicU64::new(1000));
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
        let tasks: Vec<_> = (0..64)
            .map(|t| {
                let (group, pool, next) = (group.clone(), pool.clone(), next.clone());
                tokio::spawn(async move {
                    let mut i = 0u64;
                    while std::time::Instant::now() < deadline {
                        i += 1;
                        let n = next.fetch_add(1, Ordering::Relaxed) as i64;
                        let cancel_after = std::time::Duration::from_micros((i * 37 + t) % 400);
                        let work = async {
                            let _ = insert(&group, &pool, n).await;
                            // Readers on the same pool, as node_after_write does.
                            let _: Option<(i64,)> = sqlx::query_as("SELECT n FROM t WHERE n = ?")
                                .bind(n)
                                .fetch_optional(&pool)
                                .await
                                .unwrap();
                        };
                        if i.is_multiple_of(4) {
                            let _ = tokio::time::timeout(cancel_after, work).await;
                        } else {
                            work.await;
                        }
                    }
                })
            })
            .collect();
        for t in tasks {
            if tokio::time::timeout(std::time::Duration::from_secs(20), t)
                .await
                .is_err()
            {
                let gate = group.gate.try_lock();
                panic!(
                    "a writer wedged: gate held {}, open batch {:?}, waiting {}, pool size {} idle {}",
                    gate.is_err(),
                    gate.as_ref().ok().map(|g| g.0.as_ref().map(|b| (
                        b.id,
                        b.members,
                        b.release_owed,
                        b.rollback_owed,
                        b.closer.is_finished()
                    ))),
                    group.waiting(),
                    pool.size(),
                    pool.num_idle()
                );
            }
        }
        tokio::time::timeout(std::time::Duration::from_secs(10), insert(&group, &pool, 1))
            .await
            .expect("the gate wedged")
            .unwrap();
        // No connection was left inside a transaction: with the gate idle, another
        // connection takes the write lock at once.
        assert!(group.gate.lock().await.0.is_none(), "a batch left open");
        use sqlx::ConnectOptions;
        let mut other = SqliteConnectOptions::new()
            .filename(dir.path().join("t.db"))
            .busy_timeout(std::time::Duration::ZERO)
            .connect()
            .await
            .unwrap();
        sqlx::query("BEGIN IMMEDIATE")
            .execute(&mut other)
            .await
            .expect("a pooled connection holds the write lock");
        sqlx::query("ROLLBACK").execute(&mut other).await.unwrap();
    }

    /// Counts its forgets.
    #[derive(Default)]
    struct Forgets(AtomicUsize);

    impl Forget for Forgets {
        fn forget(&self) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// A writer that goes away once its commit is handed to the batch still has what it
    /// wrote forgotten when the batch ends. On one thread, so that the batch's closer
    /// cannot run (and answer) before the caller is dropped.
    #[tokio::test]
    async fn a_kept_value_is_forgotten_when_the_batch_ends_whatever_the_caller_does() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir).await;
        let group = GroupCommit::new(10_000, Default::default(), Default::default());
        let kept = Arc::new(Forgets::default());
        let mut tx = group.begin(&pool).await.unwrap();
        sqlx::query("INSERT INTO t (n) VALUES (1)")
            .execute(&mut *tx)
            .await
            .unwrap();
        tx.forget_on_commit(kept.clone());
        // Handed to the batch on its first poll, then dropped while waiting for the commit
        // (polled once, in place: a timeout's timer fires only when the runtime turns, by
        // which time the closer may have answered).
        use futures_util::FutureExt;
        let gone = tx.commit().now_or_never();
        assert!(
            gone.is_none(),
            "answered before its batch could commit: {gone:?}"
        );
        // A later writer's commit is answered once every batch before it has ended.
        insert(&group, &pool, 2).await.unwrap();
        assert_eq!(rows(&pool).await, vec![1, 2]);
        assert_eq!(kept.0.load(Ordering::Relaxed), 1);
    }

    /// A writer that goes away while its abandon's rollback is in flight costs the batch
    /// nothing: the other members' writes commit. On one thread, so that the rollback
    /// cannot finish before the caller is dropped.
    #[tokio::test]
    async fn a_writer_going_away_mid_abandon_leaves_the_batch_whole() {
        use futures_util::FutureExt;
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir).await;
        let group = GroupCommit::new(10_000, Default::default(), Default::default());
        // Holding the gate, with its batch's closer queued behind it: the two writers
        // below queue behind that, and share the next batch.
        let holder = group.begin(&pool).await.unwrap();
        let kept = {
            let (group, pool) = (group.clone(), pool.clone());
            tokio::spawn(async move { insert(&group, &pool, 1).await })
        };
        while group.waiting() < 1 {
            tokio::task::yield_now().await;
        }
        let gone = {
            let (group, pool) = (group.clone(), pool.clone());
            tokio::spawn(async move {
                let mut tx = group.begin(&pool).await.unwrap();
                sqlx::query("INSERT INTO t (n) VALUES (2)")
                    .execute(&mut *tx)
                    .await
                    .unwrap();
                // Polled once, in place: the rollback is in flight when it is dropped.
                tx.abandon().now_or_never().is_none()
            })
        };
        while group.waiting() < 2 {
            tokio::task::yield_now().await;
        }
        holder.commit().await.unwrap();
        assert!(gone.await.unwrap(), "answered before its batch ended");
        kept.await
            .unwrap()
            .expect("the batch was rolled back for a writer that went away");
        assert_eq!(rows(&pool).await, vec![1]);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn past_the_queue_limit_a_writer_is_refused_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let pool = pool(&dir).await;
        let group = GroupCommit::new(2, Default::default(), Default::default());
        let holder = group.begin(&pool).await.unwrap();
        let queued: Vec<_> = (10..12)
            .map(|n| {
                let (group, pool) = (group.clone(), pool.clone());
                tokio::spawn(async move { insert(&group, &pool, n).await })
            })
            .collect();
        while group.waiting() < 2 {
            tokio::task::yield_now().await;
        }
        let refused = insert(&group, &pool, 99).await.unwrap_err();
        assert!(matches!(refused, StoreError::Busy(2)), "{refused}");
        assert!(refused.to_string().starts_with(crate::store::BUSY));
        assert_eq!(group.stats().refused, 1);
        holder.commit().await.unwrap();
        for q in queued {
            q.await.unwrap().unwrap();
        }
        assert_eq!(rows(&pool).await, vec![10, 11]);
    }
}
