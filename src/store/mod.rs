//! Rows and queries, behind traits a second backend can implement: one trait per area
//! (images, nodes, boots, events, webhooks, leases), `Backend` for all of them, and the
//! row types they read and write. No rule lives here: what a row means is decided by the
//! services above. `sqlite/` is the embedded implementation, `postgres/` the one several
//! servers share; `open` picks one by URL.

pub mod postgres;
pub(crate) mod rows;
pub mod sqlite;

use std::collections::{BTreeMap, HashSet};

use async_trait::async_trait;

use crate::api::event::Event;
use crate::api::image::{Artifact, Image, Tag, TagMove};
use crate::api::node::{Bmc, Node, StateChange};
use crate::api::power::BmcRegistration;
use crate::api::refs::{ImageRef, TagName};
use crate::api::rollout::{RolloutState, StepStatus};
use crate::api::{Digest, Mac, NodeState};

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The database cannot be reached now (connection refused or lost, the pool timed
    /// out, the server shutting down or refusing connections): worth retrying, and the
    /// HTTP layer answers 503 with Retry-After. The prefix is what it recognises.
    #[error("{UNAVAILABLE}: {0}")]
    Unavailable(sqlx::Error),
    #[error("database error: {0}")]
    Db(sqlx::Error),
    #[error("database migration failed: {0}")]
    Migrate(#[from] sqlx::migrate::MigrateError),
    #[error("stored data is corrupt: {0}")]
    Corrupt(String),
    #[error("[store] {0}")]
    Config(String),
    /// Too many writers queued already (admission control): worth retrying soon; the
    /// HTTP layer answers 503 with a short Retry-After. The prefix is what it recognises.
    #[error("{BUSY}: {0} writers queued")]
    Busy(usize),
    /// A shared commit (group commit) failed: every writer in it gets its error.
    #[error("database error: {0}")]
    Batch(std::sync::Arc<sqlx::Error>),
    /// The same, where the database could not be reached (worth retrying: 503).
    #[error("{UNAVAILABLE}: {0}")]
    BatchUnavailable(std::sync::Arc<sqlx::Error>),
}

impl StoreError {
    /// A shared commit's error, as each writer in it gets it.
    pub(crate) fn batch(e: std::sync::Arc<sqlx::Error>) -> Self {
        if unreachable(&e) {
            StoreError::BatchUnavailable(e)
        } else {
            StoreError::Batch(e)
        }
    }
}

/// How a store's refusal of one more queued writer begins, wherever it is passed on.
pub const BUSY: &str = "the store is busy";

tokio::task_local! {
    static OWN_TASK: ();
}

/// Runs `work` as one of the server's own tasks, whose writes the write queue's limit
/// (`[store] max_queued_writes`) never refuses: they are few (one at a time per task),
/// and what they carry (download records, a leader's lease) has no client to retry it.
pub async fn own_task<F: std::future::Future>(work: F) -> F::Output {
    OWN_TASK.scope((), work).await
}

/// Whether the caller runs inside `own_task`.
pub(crate) fn in_own_task() -> bool {
    OWN_TASK.try_with(|_| ()).is_ok()
}

/// How an unreachable store's errors begin, wherever they are passed on as text.
pub const UNAVAILABLE: &str = "the store is unreachable";

impl From<sqlx::Error> for StoreError {
    fn from(e: sqlx::Error) -> Self {
        if unreachable(&e) {
            StoreError::Unavailable(e)
        } else {
            StoreError::Db(e)
        }
    }
}

/// Connection-level failures, as opposed to a statement's own error. SQLSTATE classes:
/// 08 connection exception, 53 insufficient resources (too many connections), 57
/// operator intervention (shutdown, terminated); 55000 is "database is not currently
/// accepting connections".
fn unreachable(e: &sqlx::Error) -> bool {
    match e {
        sqlx::Error::Io(_)
        | sqlx::Error::Tls(_)
        | sqlx::Error::PoolTimedOut
        | sqlx::Error::PoolClosed
        | sqlx::Error::WorkerCrashed => true,
        // SQLSTATEs are PostgreSQL's; SQLite's numeric codes mean other things.
        sqlx::Error::Database(db)
            if db
                .try_downcast_ref::<sqlx::postgres::PgDatabaseError>()
                .is_some() =>
        {
            db.code().is_some_and(|c| {
                c.starts_with("08") || c.starts_with("53") || c.starts_with("57") || c == "55000"
            })
        }
        _ => false,
    }
}

/// Where the store lives: `[store] url`.
#[derive(Clone, PartialEq, Eq)]
pub enum StoreUrl {
    /// `sqlite://PATH` (relative to the working directory) or `sqlite:///abs/path`.
    Sqlite(std::path::PathBuf),
    /// `postgres://` or `postgresql://`, as libpq writes them.
    Postgres(String),
}

impl StoreUrl {
    pub fn parse(url: &str) -> Result<Self, StoreError> {
        if let Some(path) = url.strip_prefix("sqlite://") {
            if path.is_empty() {
                return Err(StoreError::Config("sqlite:// needs a path".into()));
            }
            return Ok(Self::Sqlite(path.into()));
        }
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            return Ok(Self::Postgres(url.to_string()));
        }
        // The URL may hold a password: name only its scheme.
        let scheme = url.split_once(':').map_or("(none)", |(s, _)| s);
        Err(StoreError::Config(format!(
            "url scheme {scheme:?} is not sqlite:// or postgres://"
        )))
    }
}

/// Never the URL itself: a PostgreSQL URL may carry a password.
impl std::fmt::Debug for StoreUrl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Sqlite(p) => write!(f, "sqlite://{}", p.display()),
            Self::Postgres(_) => f.write_str("postgres://(redacted)"),
        }
    }
}

/// Opens the store `url` names, migrated; `password` (from `[store] password_file`)
/// overrides one in a PostgreSQL URL; `max_queued_writes` bounds SQLite's write queue
/// (PostgreSQL's writers are bounded by its connection pool).
pub async fn open(
    url: &StoreUrl,
    password: Option<&str>,
    max_queued_writes: Option<usize>,
) -> Result<Store, StoreError> {
    match url {
        StoreUrl::Sqlite(path) => {
            let queue = max_queued_writes.unwrap_or(sqlite::MAX_QUEUED_WRITES);
            if queue == 0 {
                return Err(StoreError::Config("max_queued_writes must be > 0".into()));
            }
            Ok(std::sync::Arc::new(
                sqlite::SqliteStore::open_with(path, queue).await?,
            ))
        }
        StoreUrl::Postgres(url) => postgres::open(url, password).await,
    }
}

/// A bound DHCP lease as stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseRow {
    pub mac: Mac,
    pub ip: std::net::Ipv4Addr,
    pub expires_ms: i64,
}

/// A node as the metrics census counts it.
#[derive(Debug, Clone, PartialEq)]
pub struct CensusRow {
    pub state: NodeState,
    /// When the node entered its state (its last write).
    pub since_ms: i64,
    /// The image of the node's newest boot; None if it never booted.
    pub image: Option<Digest>,
    pub labels: BTreeMap<String, String>,
}

/// A row of `nodes`.
#[derive(Debug, Clone, PartialEq)]
pub struct NodeRecord {
    pub mac: Mac,
    pub uuid: Option<String>,
    pub hostname: Option<String>,
    pub labels: BTreeMap<String, String>,
    /// What the admin assigned (digest, name:version or name:tag), resolved at boot time.
    pub assigned: Option<String>,
    pub state: NodeState,
    pub state_reason: String,
    pub version: i64,
    pub created_at: String,
    pub updated_at: String,
    /// How to reach the node's BMC; filled by the power-control work.
    pub bmc: Option<Bmc>,
    /// A revalidation was asked for and no heartbeat has taken it yet
    /// (`NodeStore::request_revalidate`, `take_revalidate`).
    pub revalidate_requested: bool,
}

impl From<NodeRecord> for Node {
    fn from(n: NodeRecord) -> Self {
        Node {
            mac: n.mac,
            uuid: n.uuid,
            hostname: n.hostname,
            labels: n.labels,
            assigned: n.assigned,
            state: n.state,
            state_reason: n.state_reason,
            version: n.version,
            created_at: n.created_at,
            updated_at: n.updated_at,
            bmc: n.bmc,
        }
    }
}

/// A boot to record with the state change that starts it; the token is stored only as
/// its sha256.
#[derive(Debug, Clone, Copy)]
pub struct NewBoot<'a> {
    pub id: &'a str,
    pub image: &'a Digest,
    pub token_sha256: &'a Digest,
    /// What DHCP and TFTP saw before the script (JSON), when anything.
    pub preboot_json: Option<&'a str>,
}

/// A row written in the transaction of the state change it belongs with.
#[derive(Debug, Clone, Copy)]
pub enum Attached<'a> {
    /// Opens this boot: a boot record exists exactly when its node moved for it.
    Boot(NewBoot<'a>),
    /// The boot's attestation verdict and report; a boot is attested once.
    Attestation {
        boot_id: &'a str,
        /// `verdict_json`'s own `passed`, which it must equal (stored beside it, for the
        /// agent's later calls).
        passed: bool,
        verdict_json: &'a str,
        report_json: &'a str,
    },
    /// The boot's validation verdict (a revalidation replaces it).
    Validation {
        boot_id: &'a str,
        verdict_json: &'a str,
    },
}

/// The outcome of a compare-and-set state change.
#[derive(Debug, PartialEq)]
pub enum CasOutcome {
    Done(Box<NodeRecord>),
    /// Someone else changed the node since `version` was read.
    Stale,
    /// The attached attestation was recorded before: nothing was written.
    AlreadyAttested,
}

/// What removing an image writes over the token hashes of its nodes' older boots: the
/// digest of no known input, so no token matches it. Deleting a node's newest boot would
/// otherwise make the one before it newest again, and that boot's token (up to a day
/// old, and perhaps seen by more than the node since) would be good again.
pub const REVOKED_TOKEN_SHA256: &str =
    "sha256:0000000000000000000000000000000000000000000000000000000000000000";

/// A boot as attestation needs it.
#[derive(Debug, Clone)]
pub struct BootForAttest {
    pub mac: Mac,
    pub image: Digest,
    pub token_sha256: Digest,
    pub created_at_ms: i64,
    /// The node's newest boot: a token from an older one has expired.
    pub latest: bool,
    /// When it attested (a token attests once), and whether the verdict passed.
    pub attestation: Option<Attestation>,
}

impl BootForAttest {
    pub fn attested(&self) -> bool {
        self.attestation.is_some()
    }
    /// Attested, and the verdict passed: what validation and heartbeats may follow.
    pub fn attested_and_passed(&self) -> bool {
        self.attestation.is_some_and(|a| a.passed)
    }
}

/// A boot's attestation as the agent API's checks need it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Attestation {
    pub at_ms: i64,
    pub passed: bool,
}

#[derive(Debug, PartialEq)]
pub enum ReimageOutcome {
    Accepted(NodeRecord),
    /// Nothing was written: what the decision said, with the node as it is.
    Refused(ReimageDecision, NodeRecord),
    UnknownNode,
}

/// What the node service's rule says of a reimage request (`NodeStore::request_reimage`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReimageDecision {
    /// Move the node to this state.
    Move(NodeState),
    /// Already reimaging: nothing changes (requests are idempotent by node too).
    AlreadyReimaging,
    /// The disruption budget is spent, and why.
    OverBudget(String),
    /// The state machine does not allow it, and why.
    NotAllowed(String),
}

/// Where an Idempotency-Key stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeyClaim {
    /// Ours: go ahead, then answer or release it.
    Claimed,
    /// Another try holds it and has not answered yet.
    InProgress { mac: String },
    /// Answered before: this is the answer.
    Answered { mac: String, response: String },
}

/// The rule a reimage request obeys: given the node and every node reimaging now.
pub type ReimageRule<'a> = dyn Fn(&NodeRecord, &[NodeRecord]) -> ReimageDecision + Send + Sync + 'a;

/// One response that sent (part of) a blob for a boot.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fetch {
    pub digest: Digest,
    pub started_at_ms: i64,
    /// None: the connection ended before the last byte.
    pub finished_at_ms: Option<i64>,
    /// Where in the blob the response started (a range's first byte; 0 for the whole).
    pub offset: u64,
    /// Bytes sent, from `offset` on.
    pub bytes: u64,
    /// The whole blob in one response (not a range).
    pub whole: bool,
}

/// A boot with everything recorded about it.
#[derive(Debug, Clone, PartialEq)]
pub struct BootFacts {
    pub id: String,
    pub image: Digest,
    pub created_at_ms: i64,
    pub attested_at_ms: Option<i64>,
    pub verdict: Option<serde_json::Value>,
    pub report: Option<serde_json::Value>,
    pub validated_at_ms: Option<i64>,
    pub validation: Option<serde_json::Value>,
    /// What DHCP and TFTP saw before the script, as the node service wrote it.
    pub preboot: Option<serde_json::Value>,
    pub fetches: Vec<Fetch>,
}

/// A new image to insert.
pub struct NewImage<'a> {
    pub digest: Digest,
    pub name: &'a str,
    pub version: &'a str,
    pub manifest_toml: &'a str,
    pub canonical: &'a [u8],
    pub artifacts: &'a [Artifact],
}

impl NewImage<'_> {
    /// What its `image.published` event says.
    pub fn event_data(&self) -> crate::api::event::ImageEventData {
        crate::api::event::ImageEventData {
            image: self.digest,
            name: self.name.to_string(),
            version: self.version.to_string(),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum InsertOutcome {
    Inserted,
    /// The same content was published before: nothing changed.
    AlreadyPresent,
    /// `name:version` is taken by other content.
    VersionTaken {
        existing: Digest,
    },
    /// `name:version` would shadow a tag of the same spelling.
    ClashesWithTag,
}

#[derive(Debug, PartialEq, Eq)]
pub enum TagOutcome {
    Moved {
        from: Option<Digest>,
    },
    Unchanged,
    /// A version of that name has this spelling; a tag may not shadow it.
    ClashesWithVersion,
    /// The image's name differs from the tag's name.
    NameMismatch {
        image_name: String,
    },
}

/// Images, their artifacts, tags and tag history.
#[async_trait]
pub trait ImageStore: Send + Sync {
    /// Whether `img` could be inserted now, without inserting it.
    async fn precheck(&self, img: &NewImage<'_>) -> Result<InsertOutcome, StoreError>;
    async fn insert_image(&self, img: &NewImage<'_>) -> Result<InsertOutcome, StoreError>;
    /// Resolves a REF: a digest, else `name:version`, else `name:tag`; a digest prefix
    /// when exactly one image's digest begins so.
    async fn resolve(&self, r: &ImageRef) -> Result<Option<Digest>, StoreError>;
    /// Up to `limit` image digests beginning `sha256:<prefix>`, in order.
    async fn digests_with_prefix(
        &self,
        prefix: &str,
        limit: i64,
    ) -> Result<Vec<Digest>, StoreError>;
    async fn image(&self, digest: &Digest) -> Result<Option<Image>, StoreError>;
    async fn manifest_toml(&self, digest: &Digest) -> Result<Option<String>, StoreError>;
    async fn list_images(&self) -> Result<Vec<Image>, StoreError>;
    /// Points `tag` at `digest`, recording the move. Idempotent.
    async fn set_tag(
        &self,
        tag: &TagName,
        digest: &Digest,
        actor: &str,
    ) -> Result<TagOutcome, StoreError>;
    async fn tag_history(&self, tag: &TagName) -> Result<Vec<TagMove>, StoreError>;
    async fn list_tags(&self) -> Result<Vec<Tag>, StoreError>;
    /// Every blob digest that some image needs.
    async fn referenced_blobs(&self) -> Result<HashSet<Digest>, StoreError>;
    /// Marks blobs broken (damaged or missing), with an `image.broken` event for each
    /// image that needs one, in one transaction. A blob already marked is left as it is
    /// (no second event). Returns the events written.
    async fn mark_blobs_broken(&self, blobs: &[(Digest, String)]) -> Result<usize, StoreError>;
    /// The blob is whole again (a re-publish restored it).
    async fn clear_broken_blobs(&self, blobs: &[Digest]) -> Result<(), StoreError>;
    /// Every blob marked broken, and why.
    async fn broken_blobs(&self) -> Result<Vec<(Digest, String)>, StoreError>;
}

/// Nodes, their state history, revalidation requests, heartbeats, reimage requests.
#[async_trait]
pub trait NodeStore: Send + Sync {
    async fn node(&self, mac: &Mac) -> Result<Option<NodeRecord>, StoreError>;
    /// The node as this store keeps it in memory, current as of the last commit, if it
    /// keeps one (SQLite's DHCP node cache; None: read it). Where a state change starts
    /// deciding: the compare-and-set catches a record that fell behind.
    fn node_in_memory(&self, _mac: &Mac) -> Option<NodeRecord> {
        None
    }
    /// `node`, from memory when no write to it committed since it was last read: the
    /// DHCP server's lookup, one per packet, which must not queue behind writers.
    /// A miss reads on the read-only pool, which writers never hold.
    async fn node_for_dhcp(&self, mac: &Mac) -> Result<Option<NodeRecord>, StoreError>;
    /// Reads every node into the DHCP cache (at DHCP start: the first packets of a
    /// power-on then find their nodes in memory). Returns how many.
    async fn warm_node_cache(&self) -> Result<usize, StoreError>;
    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError>;
    /// Every node's state, labels and the image of its newest boot, in one read.
    async fn census(&self) -> Result<Vec<CensusRow>, StoreError>;
    /// Records `mac` as discovered unless known; returns the node and whether it is new.
    async fn discover(
        &self,
        mac: &Mac,
        uuid: Option<&str>,
        reason: &str,
    ) -> Result<(NodeRecord, bool), StoreError> {
        self.discover_within(mac, uuid, reason, None)
            .await?
            .ok_or_else(|| StoreError::Corrupt(format!("node {mac} was not recorded")))
    }
    /// As `discover`, but a new MAC is not recorded (None) while `cap` or more nodes are
    /// discovered and unassigned.
    async fn discover_within(
        &self,
        mac: &Mac,
        uuid: Option<&str>,
        reason: &str,
        cap: Option<i64>,
    ) -> Result<Option<(NodeRecord, bool)>, StoreError>;
    /// Sets what `mac` boots; the node is recorded first if it was unknown.
    async fn assign(&self, mac: &Mac, reference: &str) -> Result<NodeRecord, StoreError>;
    /// Sets and removes labels in one write; None if the node is unknown.
    async fn label(
        &self,
        mac: &Mac,
        set: &BTreeMap<String, String>,
        remove: &[String],
    ) -> Result<Option<NodeRecord>, StoreError>;
    /// Moves `mac` to `to` if it is still at `version`, with a history row and its event,
    /// and writes `with` in the same transaction (one commit, one fsync): a verdict is
    /// never stored without its transition, nor a transition without its verdict.
    async fn set_state(
        &self,
        mac: &Mac,
        version: i64,
        from: NodeState,
        to: NodeState,
        reason: &str,
        with: Option<&Attached<'_>>,
    ) -> Result<CasOutcome, StoreError>;
    /// `set_state` from `from` through `via` (its reason `via_reason`) to `to`: two
    /// changes, each with its history row and event, `with` written with the second, all
    /// in one transaction (both or neither). For a request that passes a state on its way
    /// (a first validation report: booted, validating, ready).
    #[allow(clippy::too_many_arguments)]
    async fn set_state_via(
        &self,
        mac: &Mac,
        version: i64,
        from: NodeState,
        via: (NodeState, &str),
        to: NodeState,
        reason: &str,
        with: Option<&Attached<'_>>,
    ) -> Result<CasOutcome, StoreError>;
    async fn node_history(&self, mac: &Mac) -> Result<Vec<StateChange>, StoreError>;
    /// Reads the node and every node reimaging now, asks `rule`, and writes what it
    /// decides (state, history, event), all in one write transaction, so two concurrent
    /// requests cannot both take the last slot of the disruption budget.
    async fn request_reimage(
        &self,
        mac: &Mac,
        reason: &str,
        rule: &ReimageRule<'_>,
    ) -> Result<ReimageOutcome, StoreError>;
    /// Claims an Idempotency-Key for a request about `mac`, in one statement, so that of
    /// overlapping tries with one key exactly one goes ahead. A claim older than
    /// `stale_ms` with no answer (its server died) may be taken over.
    async fn claim_idempotency_key(
        &self,
        key: &str,
        mac: &Mac,
        stale_ms: i64,
    ) -> Result<KeyClaim, StoreError>;
    /// Stores the claimed request's answer: every later try with the key gets it.
    async fn answer_idempotency_key(&self, key: &str, response: &str) -> Result<(), StoreError>;
    /// Gives a claim back unanswered (the request failed): the next try goes ahead.
    async fn release_idempotency_key(&self, key: &str) -> Result<(), StoreError>;
    /// Stores when each node was last heard, in one write (`node::liveness` gathers
    /// them); a time never moves back (another server may have heard it later).
    async fn record_heartbeats(&self, heard: &[(Mac, i64)]) -> Result<(), StoreError>;
    /// Asks for revalidation; false when the node is unknown.
    async fn request_revalidate(&self, mac: &Mac) -> Result<bool, StoreError>;
    /// The node as a heartbeat needs it, with whether a revalidation request waits for
    /// it (a heartbeat writes only when one does); a backend may answer from memory
    /// what it knows to be current. This default reads it.
    async fn node_for_heartbeat(&self, mac: &Mac) -> Result<Option<NodeRecord>, StoreError> {
        self.node(mac).await
    }
    /// Clears a pending revalidation request; true if there was one (answered once).
    async fn take_revalidate(&self, mac: &Mac) -> Result<bool, StoreError>;
    /// Nodes and when we last heard from them: the later of their last heartbeat and
    /// their last state change (a new boot must not inherit an old boot's silence).
    async fn last_seen(&self) -> Result<Vec<(Mac, NodeState, i64)>, StoreError>;
}

/// Boots: records with token hashes, attested reports, verdicts, blob fetches.
#[async_trait]
pub trait BootStore: Send + Sync {
    async fn boot_for_attest(&self, id: &str) -> Result<Option<BootForAttest>, StoreError>;
    /// Records `fetches` in one transaction, one fsync for the lot: a boot storm's
    /// thousands of downloads, written one transaction each, kept attestation waiting
    /// seconds for the writer (measured with the boot-storm simulator). A fetch for a boot
    /// that does not exist is skipped (a URL with a made-up boot id writes nothing);
    /// returns how many were recorded.
    async fn record_fetches(&self, fetches: &[(String, Fetch)]) -> Result<usize, StoreError>;
    async fn fetches(&self, boot_id: &str) -> Result<Vec<Fetch>, StoreError>;
    /// The node's last `limit` boots, newest first, with their fetches.
    async fn boot_facts(&self, mac: &Mac, limit: i64) -> Result<Vec<BootFacts>, StoreError>;
    /// One boot's facts, by id.
    async fn boot_by_id(&self, id: &str) -> Result<Option<BootFacts>, StoreError>;
    /// How many times the node failed validation since it was last ready (or ever).
    async fn validation_failures_since_ready(&self, mac: &Mac) -> Result<u32, StoreError>;
}

/// The event log, in commit order; readers are woken after each commit that wrote events.
#[async_trait]
pub trait EventStore: Send + Sync {
    /// Records one event on its own (a refusal: nothing else is written with it).
    async fn record_event(
        &self,
        kind: &str,
        mac: Option<&Mac>,
        data: &serde_json::Value,
    ) -> Result<(), StoreError>;
    /// Events after `since`, oldest first, at most `limit`; only `mac`'s when given.
    async fn events_since(
        &self,
        since: i64,
        limit: i64,
        mac: Option<&Mac>,
    ) -> Result<Vec<Event>, StoreError>;
    /// The newest event's seq (0 when there is none).
    async fn events_head(&self) -> Result<i64, StoreError>;
    /// Deletes up to `batch` of the oldest events that are older than `before_ms` or
    /// past the newest `keep` ones; never the newest event, so numbering never restarts.
    /// Returns how many went.
    async fn prune_events(&self, before_ms: i64, keep: i64, batch: i64) -> Result<u64, StoreError>;
    /// Changes whenever this process commits events. Other servers sharing the database
    /// are not seen here: readers also poll.
    fn subscribe_events(&self) -> tokio::sync::watch::Receiver<u64>;
}

/// How far each webhook has been delivered.
#[async_trait]
pub trait WebhookStore: Send + Sync {
    async fn webhook_cursor(&self, url: &str) -> Result<Option<i64>, StoreError>;
    async fn set_webhook_cursor(&self, url: &str, seq: i64) -> Result<(), StoreError>;
}

/// Bound DHCP leases, saved in batches.
#[async_trait]
pub trait LeaseStore: Send + Sync {
    async fn load_leases(&self) -> Result<Vec<LeaseRow>, StoreError>;
    /// Writes a batch of lease changes in one transaction.
    /// Upserts `keep` by MAC; deletes each of `gone` only while its row names that
    /// address (another server may have bound the client to another since).
    async fn save_leases(&self, keep: &[LeaseRow], gone: &[LeaseRow]) -> Result<(), StoreError>;
}

/// Roles exactly one server plays at a time (the webhook sender, the sweeper): a lease
/// in the shared store, renewed by its holder and taken over once it lapses, so a
/// server that dies (kill -9, power) hands its roles on within one lease.
#[async_trait]
pub trait LeaderStore: Send + Sync {
    /// Takes or renews `role` for `holder` until `now_ms + ttl_ms` when it is free,
    /// lapsed or already `holder`'s; true while `holder` holds it.
    async fn lead(
        &self,
        role: &str,
        holder: &str,
        now_ms: i64,
        ttl_ms: i64,
    ) -> Result<bool, StoreError>;
    /// Gives `role` up at once if `holder` holds it (a clean shutdown).
    async fn resign(&self, role: &str, holder: &str) -> Result<(), StoreError>;
    /// Every role some server holds at `now_ms` (not lapsed).
    async fn held_roles(&self, now_ms: i64) -> Result<Vec<String>, StoreError>;
}

/// What removing a node came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Removed {
    Done,
    /// The node changed since it was read (its version moved): read and decide again.
    Stale,
    Missing,
}

/// What refers to an image: the tags that point at it, the nodes assigned it by digest
/// or `name:version`, and the nodes whose newest boot ran it, with their states.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ImageUsers {
    pub tags: Vec<String>,
    pub assigned: Vec<Mac>,
    pub last_booted: Vec<(Mac, NodeState)>,
}

/// Removing nodes and images. A node: the row, its history, boots and their downloads,
/// and its reimage keys go in one transaction with a `node.removed` event. An image: its
/// rows and the boot records that ran it (with their downloads), in one transaction
/// that also revokes the tokens of those nodes' older boots (`REVOKED_TOKEN_SHA256`);
/// its blobs become unreferenced for `gc`. Events stay (the log is history).
#[async_trait]
pub trait RemovalStore: Send + Sync {
    async fn remove_node(
        &self,
        mac: &Mac,
        version: i64,
        data: &crate::api::event::NodeRemovedData,
    ) -> Result<Removed, StoreError>;
    /// What refers to `digest` (named `name:version`).
    async fn image_users(
        &self,
        digest: &Digest,
        name_version: &str,
    ) -> Result<ImageUsers, StoreError>;
    async fn remove_image(&self, digest: &Digest) -> Result<Removed, StoreError>;
}

/// One power action as stored (`power_actions`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PowerRow {
    pub at_ms: i64,
    pub action: String,
    pub reason: String,
    /// `ok`, or the BMC's error.
    pub outcome: String,
    pub took_ms: i64,
}

/// A reimage that has not begun (`PowerStore::pending_reimages`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingReimage {
    pub mac: Mac,
    /// When the node last became reimaging.
    pub since_ms: i64,
    /// The state it was in before.
    pub from: Option<NodeState>,
    pub state: NodeState,
}

/// Nodes' BMCs and the power actions taken through them.
#[async_trait]
pub trait PowerStore: Send + Sync {
    /// Sets (or, with None, forgets) how `mac`'s BMC is reached, with a `node.bmc` event,
    /// in one transaction; None when there is no such node.
    async fn set_bmc(&self, mac: &Mac, bmc: Option<&Bmc>)
    -> Result<Option<NodeRecord>, StoreError>;
    /// Records a power action and its `node.power` event in one transaction.
    async fn record_power(&self, mac: &Mac, row: &PowerRow) -> Result<(), StoreError>;
    /// `mac`'s last `limit` power actions, newest first.
    async fn power_actions(&self, mac: &Mac, limit: i64) -> Result<Vec<PowerRow>, StoreError>;
    /// Reimages asked for and not yet begun: nodes reimaging (or gone unreachable since)
    /// with no boot started after their last move to reimaging.
    async fn pending_reimages(&self) -> Result<Vec<PendingReimage>, StoreError>;
    /// Registers a machine known only by its BMC, with a `bmc.registered` event.
    async fn register_bmc(
        &self,
        bmc: &Bmc,
        uuid: Option<&str>,
        macs: &[Mac],
    ) -> Result<BmcRegistration, StoreError>;
    /// Machines registered by their BMC and not matched yet, oldest first.
    async fn bmc_registrations(&self) -> Result<Vec<BmcRegistration>, StoreError>;
    async fn bmc_registration(&self, id: i64) -> Result<Option<BmcRegistration>, StoreError>;
    /// Forgets a registration; whether there was one.
    async fn remove_bmc_registration(&self, id: i64) -> Result<bool, StoreError>;
    /// Records a power action on a registered machine as a `bmc.power` event.
    async fn record_bmc_power(&self, data: &serde_json::Value) -> Result<(), StoreError>;
    /// Gives `mac` (a node without a BMC) the BMC of the registration that lists `mac`
    /// among its NICs or has `uuid`, removes the registration and records `bmc.matched`,
    /// in one transaction; the registration's id, or None when none matches.
    async fn match_bmc_registration(
        &self,
        mac: &Mac,
        uuid: Option<&str>,
    ) -> Result<Option<i64>, StoreError>;
}

/// A rollout's row (`rollouts`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolloutRow {
    pub id: i64,
    /// `api::rollout::RolloutRequest` as JSON.
    pub spec_json: String,
    pub digest: Digest,
    pub state: RolloutState,
    pub state_reason: String,
    /// The wave in progress.
    pub wave: u32,
    pub version: i64,
    pub created_at_ms: i64,
    pub updated_at_ms: i64,
}

/// One node of a rollout (`rollout_nodes`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RolloutNodeRow {
    pub mac: Mac,
    pub wave: u32,
    /// The order within the rollout.
    pub position: u32,
    pub status: StepStatus,
    pub previous_assigned: Option<String>,
    pub previous_digest: Option<Digest>,
    pub reason: String,
    /// When the current step began (drain, reimage, rollback).
    pub started_at_ms: Option<i64>,
    pub finished_at_ms: Option<i64>,
}

/// A rollout to create, with its nodes (all pending) and the `rollout.started` reason.
pub struct NewRollout<'a> {
    pub spec_json: &'a str,
    pub digest: &'a Digest,
    pub nodes: &'a [RolloutNodeRow],
    pub reason: &'a str,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RolloutCreated {
    Created(i64),
    /// A node is held by another rollout that has not ended: nothing was written.
    Overlap {
        mac: Mac,
        rollout: i64,
    },
}

/// A rollout's change of state (compare-and-set on its version), with the nodes that
/// move with it (a rollback's) and its event, in one transaction. A state that holds
/// no nodes gives the rollout's claims back.
pub struct RolloutMove<'a> {
    pub state: RolloutState,
    pub reason: &'a str,
    pub wave: u32,
    /// Steps at these statuses that were reimaged by the rollout go to rollback-pending
    /// with it (a rollback's nodes), chosen in the transaction.
    pub queue_rollback: &'a [StepStatus],
    pub event_kind: &'a str,
    /// Claim the rollout's nodes again (rolling back a rollout that had ended).
    pub reclaim: bool,
}

/// What a rollout's move came to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RolloutMoved {
    Moved,
    /// It changed since its version was read: nothing written.
    Stale,
    /// Reclaiming: a node is held by another rollout that has not ended.
    Overlap {
        mac: Mac,
        rollout: i64,
    },
}

/// One node's change of step (compare-and-set on its status, and on the rollout's
/// version: an admin's change since the read makes it stale), with its event. `None`
/// times are left as they are.
pub struct StepMove<'a> {
    /// The rollout's version as read.
    pub version: i64,
    pub mac: &'a Mac,
    pub from: StepStatus,
    pub to: StepStatus,
    pub reason: &'a str,
    pub started_at_ms: Option<i64>,
    pub finished_at_ms: Option<i64>,
    pub event_kind: &'a str,
}

/// What a step's reimage came to (`RolloutStore::reimage_step`).
#[derive(Debug, PartialEq)]
pub enum StepReimage {
    /// The node moved to reimaging, assigned the image, and the step moved, together.
    Moved,
    /// The step was not at `from` any more: nothing written.
    StaleStep,
    /// The reimage rule refused (or the node is gone): nothing written.
    Refused(Box<ReimageOutcome>),
}

/// Rollouts, their nodes and the claims that keep two rollouts off one node.
#[async_trait]
pub trait RolloutStore: Send + Sync {
    /// Creates the rollout, its nodes and their claims, with its `rollout.started` event,
    /// in one transaction; refused whole when a node is claimed by a rollout not ended.
    async fn create_rollout(&self, new: &NewRollout<'_>) -> Result<RolloutCreated, StoreError>;
    /// Every rollout, newest first.
    async fn rollouts(&self) -> Result<Vec<RolloutRow>, StoreError>;
    /// The rollouts that have not ended (they hold their nodes), oldest first: what the
    /// controller looks at.
    async fn active_rollouts(&self) -> Result<Vec<i64>, StoreError>;
    async fn rollout(
        &self,
        id: i64,
    ) -> Result<Option<(RolloutRow, Vec<RolloutNodeRow>)>, StoreError>;
    async fn move_rollout(
        &self,
        id: i64,
        version: i64,
        m: &RolloutMove<'_>,
    ) -> Result<RolloutMoved, StoreError>;
    /// False when the step was not at `m.from` (nothing written).
    async fn move_step(&self, id: i64, m: &StepMove<'_>) -> Result<bool, StoreError>;
    /// The reimage of a step: the step still at `m.from`, the node assigned `assign` and
    /// moved to reimaging under `rule` (the disruption budget), the step moved to `m.to`,
    /// and their events, all in one transaction: a step is reimaging exactly when its
    /// node was sent to reimage for it, so a restart never sends it twice.
    async fn reimage_step(
        &self,
        id: i64,
        m: &StepMove<'_>,
        assign: &str,
        reason: &str,
        rule: &ReimageRule<'_>,
    ) -> Result<StepReimage, StoreError>;
    /// `mac`'s newest `limit` rollout events (`rollout.node-*`): time, kind and data,
    /// newest first; its boots' timelines show them.
    async fn node_rollout_events(
        &self,
        mac: &Mac,
        limit: i64,
    ) -> Result<Vec<(i64, String, serde_json::Value)>, StoreError>;
    /// The rollout that holds `mac` now, if one does.
    async fn claimed_by(&self, mac: &Mac) -> Result<Option<i64>, StoreError>;
    /// The nodes of `macs` that exist, in one read (a rollout's look at its nodes).
    async fn nodes_in(&self, macs: &[Mac]) -> Result<Vec<NodeRecord>, StoreError>;
    /// The image and start time of `mac`'s newest boot.
    async fn latest_boot(&self, mac: &Mac) -> Result<Option<(Digest, i64)>, StoreError>;
    /// The first failure (attestation, validation, quarantine) in `mac`'s history since
    /// its first boot begun at or after `since_ms`, with its reason: a failure of what it
    /// was given then, which the failure policy's own reimage would hide from a look at
    /// the node's state alone.
    async fn failure_since(
        &self,
        mac: &Mac,
        since_ms: i64,
    ) -> Result<Option<(NodeState, String)>, StoreError>;
}

/// A named API token as stored (its secret's hash is looked up, never read back).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenRow {
    pub name: String,
    pub role: crate::api::token::Role,
    pub created_at_ms: i64,
    pub created_by: String,
    pub revoked_at_ms: Option<i64>,
    pub revoked_by: Option<String>,
}

/// Named API tokens: each write with its event (`token.created`, `token.revoked`).
#[async_trait]
pub trait TokenStore: Send + Sync {
    /// Records a token under the SHA-256 of its secret; false when the name is taken,
    /// by a revoked token too.
    async fn create_token(&self, row: &TokenRow, secret_sha256: &str) -> Result<bool, StoreError>;
    /// The token whose secret hashes to `secret_sha256`, revoked or not.
    async fn token_by_hash(&self, secret_sha256: &str) -> Result<Option<TokenRow>, StoreError>;
    /// The token named `name`, revoked or not.
    async fn token_named(&self, name: &str) -> Result<Option<TokenRow>, StoreError>;
    /// Every token, by name.
    async fn tokens(&self) -> Result<Vec<TokenRow>, StoreError>;
    /// Revokes `name`: None when there is no such token; else the token as it stands
    /// and whether this call revoked it (false: it was revoked already, nothing written).
    async fn revoke_token(
        &self,
        name: &str,
        by: &str,
        at_ms: i64,
    ) -> Result<Option<(TokenRow, bool)>, StoreError>;
}

/// A revalidation waiting on the node's workload scheduler (`revalidation_drains`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RevalidationDrain {
    pub mac: Mac,
    pub reason: String,
    pub queued_at_ms: i64,
    /// When its drain was asked; None while it waits its turn.
    pub asked_at_ms: Option<i64>,
    /// When it was drained and sent to validate; None while draining.
    pub validating_at_ms: Option<i64>,
}

/// Revalidations behind a drain, each with its `health.drain` event in its transaction.
#[async_trait]
pub trait RevalidationStore: Send + Sync {
    /// Queues one for `mac`; false (nothing written) when the node has one already.
    async fn queue_revalidation_drain(
        &self,
        mac: &Mac,
        reason: &str,
        now_ms: i64,
        event: &crate::api::event::HealthDrainData,
    ) -> Result<bool, StoreError>;
    /// Every queued one, oldest first.
    async fn revalidation_drains(&self) -> Result<Vec<RevalidationDrain>, StoreError>;
    /// Marks its drain asked; false when it is not queued (or was asked already).
    async fn revalidation_asked(
        &self,
        mac: &Mac,
        now_ms: i64,
        event: &crate::api::event::HealthDrainData,
    ) -> Result<bool, StoreError>;
    /// Marks it sent to validate; false when it is not queued (or is validating already).
    async fn revalidation_validating(
        &self,
        mac: &Mac,
        now_ms: i64,
        event: &crate::api::event::HealthDrainData,
    ) -> Result<bool, StoreError>;
    /// Ends it; false when it was not queued.
    async fn end_revalidation_drain(
        &self,
        mac: &Mac,
        event: &crate::api::event::HealthDrainData,
    ) -> Result<bool, StoreError>;
}

/// The EK a node's TPM is enrolled with (`tpm_enrolments`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpmEnrolment {
    pub mac: Mac,
    /// The EK's TPM Name, hex.
    pub ek_name: String,
    /// Its certificate chained to a configured EK CA when it was enrolled.
    pub certified: bool,
    pub enrolled_at_ms: i64,
}

/// A boot's TPM challenge (`tpm_challenges`): the AK the credential was made for and
/// the hash of the secret it carries; the secret itself is never stored.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TpmChallengeRow {
    pub boot_id: String,
    pub mac: Mac,
    /// The AK's TPM2B_PUBLIC, hex.
    pub ak_public: String,
    pub ek_name: String,
    /// SHA-256 of the secret, hex.
    pub secret_sha256: String,
    pub issued_at_ms: i64,
}

/// TPM enrolments and challenges.
#[async_trait]
pub trait TpmStore: Send + Sync {
    /// Enrols `enrolment` when its node has none and `enrol` says so (with its
    /// `tpm.enrolled` event), then records `challenge` (replacing the boot's earlier one)
    /// only if the node's enrolment names the challenge's EK; returns the enrolment as
    /// stored (None: the node has none).
    async fn put_tpm_challenge(
        &self,
        challenge: &TpmChallengeRow,
        enrolment: &TpmEnrolment,
        enrol: bool,
    ) -> Result<Option<TpmEnrolment>, StoreError>;
    /// An operator's registration: sets the node's enrolment (replacing any), with its
    /// `tpm.enrolled` event.
    async fn set_tpm_enrolment(&self, enrolment: &TpmEnrolment) -> Result<(), StoreError>;
    /// Removes the node's enrolment, with a `tpm.forgotten` event; false when it had none.
    async fn forget_tpm_enrolment(&self, mac: &Mac) -> Result<bool, StoreError>;
    async fn tpm_challenge(&self, boot_id: &str) -> Result<Option<TpmChallengeRow>, StoreError>;
    /// Removes a boot's challenge once the boot has attested.
    async fn end_tpm_challenge(&self, boot_id: &str) -> Result<(), StoreError>;
    async fn tpm_enrolment(&self, mac: &Mac) -> Result<Option<TpmEnrolment>, StoreError>;
}

/// A whole store: every area, behind one handle the services share. SQLite is one
/// implementation (`sqlite`), PostgreSQL the other (`postgres`).
#[async_trait]
pub trait Backend:
    ImageStore
    + NodeStore
    + BootStore
    + EventStore
    + WebhookStore
    + LeaseStore
    + LeaderStore
    + RemovalStore
    + PowerStore
    + RolloutStore
    + TokenStore
    + RevalidationStore
    + TpmStore
{
    async fn close(&self);
    async fn ping(&self) -> Result<(), StoreError>;
    /// Writes and commits `server`'s row in `write_probes`: proof that writes go through.
    async fn probe_write(&self, server: &str, now_ms: i64) -> Result<(), StoreError>;
    /// This process's write path, where the store queues writers itself (SQLite's group
    /// commit); None where the database does (PostgreSQL).
    fn write_stats(&self) -> Option<WriteStats> {
        None
    }
}

/// Writers queued, commits made and the writes they carried, refusals at the queue's
/// limit: counted since start.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WriteStats {
    pub queued: u64,
    pub commits: u64,
    pub writes: u64,
    pub refused: u64,
}

/// The store as the services hold it.
pub type Store = std::sync::Arc<dyn Backend>;
