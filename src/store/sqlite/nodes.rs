//! SQL for nodes, their state history and their boots. State changes are compare-and-set
//! on `version`, so two writers never clobber each other: the loser is told.

use std::collections::BTreeMap;

use async_trait::async_trait;

use super::SqliteStore;
use super::boot_cache::BootTouch;
use crate::api::node::StateChange;
use crate::api::{Mac, NodeState};
use crate::clock::now_ms;
use crate::store::rows::{self, NodeRow, select_nodes};
use crate::store::{
    Attached, Attestation, BootForAttest, CasOutcome, KeyClaim, NewBoot, NodeRecord, NodeStore,
    ReimageDecision, ReimageOutcome, ReimageRule, StoreError,
};

/// Heartbeats written a statement: 2 parameters each, well under SQLite's 32,766. Not
/// kept prepared (`persistent(false)`): a flush's size varies, and each size would be a
/// statement of its own in the connection's cache, pushing out the hot fixed ones.
const HEARTBEATS_A_STATEMENT: usize = 1000;

/// The history row and the event of a state change; always in the transaction of the
/// change itself. Callers notify event readers after committing.
pub(super) async fn insert_history(
    conn: &mut sqlx::SqliteConnection,
    mac: &Mac,
    from: Option<NodeState>,
    to: NodeState,
    reason: &str,
    at_ms: i64,
) -> Result<(), StoreError> {
    insert_histories(conn, mac, &[(from, to, reason)], at_ms).await
}

macro_rules! history_and_event_sql {
    () => {
        concat!(
            "INSERT INTO node_history (mac, from_state, to_state, reason, at_ms, actor) VALUES (?, ?, ?, ?, ?, ?); ",
            super::events::insert_event_sql!(),
            "; "
        )
    };
}

/// The history rows and events of one state change or two in a row, in one statement
/// string: one round trip to the connection's thread, which a storm's state changes wait
/// on inside the write gate.
async fn insert_histories(
    conn: &mut sqlx::SqliteConnection,
    mac: &Mac,
    steps: &[History<'_>],
    at_ms: i64,
) -> Result<(), StoreError> {
    let sql = match steps.len() {
        1 => history_and_event_sql!(),
        2 => concat!(history_and_event_sql!(), history_and_event_sql!()),
        n => return Err(too_many_steps(n)),
    };
    bind_histories(sqlx::query(sql), mac, steps, at_ms)?
        .execute(&mut *conn)
        .await?;
    Ok(())
}

/// A history row: from, to, reason.
type History<'a> = (Option<NodeState>, NodeState, &'a str);

/// Rows each history step writes: its history row and its event.
const ROWS_A_STEP: u64 = 2;

fn too_many_steps(n: usize) -> StoreError {
    StoreError::Corrupt(format!("{n} state changes in one write"))
}

/// Binds `history_and_event_sql!` once for each of `steps`, after what `query` holds.
fn bind_histories<'q>(
    mut query: sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>,
    mac: &Mac,
    steps: &[History<'q>],
    at_ms: i64,
) -> Result<sqlx::query::Query<'q, sqlx::Sqlite, sqlx::sqlite::SqliteArguments>, StoreError> {
    let actor = crate::audit::actor();
    for &(from, to, reason) in steps {
        let data = crate::api::event::NodeStateData {
            from,
            to,
            reason: reason.to_string(),
        };
        query = query
            .bind(mac.to_string())
            .bind(from.map(NodeState::as_str))
            .bind(to.as_str())
            .bind(reason)
            .bind(at_ms)
            .bind(actor.clone())
            .bind(at_ms)
            .bind(crate::api::event::kind::NODE_STATE)
            .bind(mac.to_string())
            .bind(rows::event_data(&data)?)
            .bind(actor.clone());
    }
    Ok(query)
}

/// The statement of each kind of attached row, then the history rows and events of one
/// step or two: all in one statement string.
macro_rules! attached_then_histories {
    ($attached:expr) => {
        [
            concat!($attached, "; ", history_and_event_sql!()),
            concat!(
                $attached,
                "; ",
                history_and_event_sql!(),
                history_and_event_sql!()
            ),
        ]
    };
}

/// Writes the row that belongs with a state change, and the change's history rows and
/// events, in one round trip; answers what the row did to its boot (for the boot cache),
/// or `Replayed` when the attestation was recorded before (the caller rolls back, the
/// history with it). A boot or verdict row that cannot be written (no such boot) is an
/// error, not a replay.
async fn write_attached_and_histories(
    conn: &mut sqlx::SqliteConnection,
    mac: &Mac,
    with: &Attached<'_>,
    steps: &[History<'_>],
    now: i64,
) -> Result<AttachedWritten, StoreError> {
    let which = match steps.len() {
        1 | 2 => steps.len() - 1,
        n => return Err(too_many_steps(n)),
    };
    let query = match *with {
        // A node's newest boot is the one inserted last (rowid), which is the one the boot
        // cache keeps, whatever the clock did between them.
        Attached::Boot(ref boot) => sqlx::query(
            attached_then_histories!(
                "INSERT INTO boots (id, mac, image_digest, token_sha256, created_at_ms, preboot)
                 VALUES (?, ?, ?, ?, ?, ?)"
            )[which],
        )
        .bind(boot.id)
        .bind(mac.to_string())
        .bind(boot.image.to_string())
        .bind(boot.token_sha256.to_string())
        .bind(now)
        .bind(boot.preboot_json),
        Attached::Attestation {
            boot_id,
            verdict_json,
            report_json,
            passed,
        } => sqlx::query(attached_then_histories!(
            "UPDATE boots SET attested_at_ms = ?, attest_passed = ?, verdict = ?, report = ? WHERE id = ? AND attested_at_ms IS NULL"
        )[which])
            .bind(now)
            .bind(passed)
            .bind(verdict_json)
            .bind(report_json)
            .bind(boot_id),
        Attached::Validation {
            boot_id,
            verdict_json,
        } => sqlx::query(
            attached_then_histories!(
                "UPDATE boots SET validated_at_ms = ?, validation = ? WHERE id = ?"
            )[which],
        )
        .bind(now)
        .bind(verdict_json)
        .bind(boot_id),
    };
    let total = bind_histories(query, mac, steps, now)?
        .execute(&mut *conn)
        .await?
        .rows_affected();
    // The history rows and events always go in; the rest is the attached row's.
    let attached = total.checked_sub(ROWS_A_STEP * steps.len() as u64);
    match (with, attached) {
        (Attached::Boot(boot), Some(1)) => {
            Ok(AttachedWritten::Touched(Some(began(mac, boot, now))))
        }
        (
            Attached::Attestation {
                boot_id, passed, ..
            },
            Some(1),
        ) => Ok(AttachedWritten::Touched(Some(BootTouch::Attested(
            boot_id.to_string(),
            Attestation {
                at_ms: now,
                passed: *passed,
            },
        )))),
        (_, Some(1)) => Ok(AttachedWritten::Touched(None)),
        (Attached::Attestation { .. }, Some(0)) => Ok(AttachedWritten::Replayed),
        _ => Err(StoreError::Corrupt(format!(
            "{total} rows written for a state change's attached row and {} history steps",
            steps.len()
        ))),
    }
}

/// What writing a state change's attached row did.
enum AttachedWritten {
    /// Written; what it did to its boot, for the boot cache (a boot began, or was
    /// attested; a validation leaves the cached boot as it is).
    Touched(Option<BootTouch>),
    /// The attestation was recorded before.
    Replayed,
}

/// The boot cache's entry for a boot just inserted, created at `created_at_ms`.
fn began(mac: &Mac, boot: &NewBoot<'_>, created_at_ms: i64) -> BootTouch {
    BootTouch::Began(
        boot.id.to_string(),
        BootForAttest {
            mac: *mac,
            image: *boot.image,
            token_sha256: *boot.token_sha256,
            created_at_ms,
            latest: true,
            attestation: None,
        },
    )
}

/// One state change, or two in a row (`steps`, each from, to and reason), inside the
/// caller's write transaction: the compare-and-set on `version` (the row as written
/// comes back with it: no read after the commit; one version a step), the row `with`
/// that belongs with the last step, the history rows and their events; with what the
/// row did to its boot. Anything but `Done` leaves the caller to abandon the transaction.
async fn change_in(
    conn: &mut sqlx::SqliteConnection,
    mac: &Mac,
    version: i64,
    steps: &[(NodeState, NodeState, &str)],
    with: Option<&Attached<'_>>,
    now: i64,
) -> Result<(CasOutcome, Option<BootTouch>), StoreError> {
    let Some(&(_, to, reason)) = steps.last() else {
        return Err(StoreError::Corrupt("a state change of no step".into()));
    };
    let written: Option<NodeRow> = sqlx::query_as(concat!(
        "UPDATE nodes SET state = ?, state_reason = ?, version = version + ?, updated_at_ms = ?
         WHERE mac = ? AND version = ? RETURNING ",
        rows::node_columns!()
    ))
    .bind(to.as_str())
    .bind(reason)
    .bind(steps.len() as i64)
    .bind(now)
    .bind(mac.to_string())
    .bind(version)
    .fetch_optional(&mut *conn)
    .await?;
    let Some(written) = written else {
        return Ok((CasOutcome::Stale, None));
    };
    let node = rows::node(written)?;
    let history: Vec<History<'_>> = steps
        .iter()
        .map(|&(from, to, reason)| (Some(from), to, reason))
        .collect();
    let touch = match with {
        None => {
            insert_histories(conn, mac, &history, now).await?;
            None
        }
        Some(with) => match write_attached_and_histories(conn, mac, with, &history, now).await? {
            AttachedWritten::Touched(touch) => touch,
            AttachedWritten::Replayed => return Ok((CasOutcome::AlreadyAttested, None)),
        },
    };
    Ok((CasOutcome::Done(Box::new(node)), touch))
}

async fn node_on(pool: &sqlx::SqlitePool, mac: &Mac) -> Result<Option<NodeRecord>, StoreError> {
    let row: Option<NodeRow> = sqlx::query_as(select_nodes!("WHERE mac = ?"))
        .bind(mac.to_string())
        .fetch_optional(pool)
        .await?;
    row.map(rows::node).transpose()
}

/// A reimage request's decision and, when `rule` moves the node, its writes (state,
/// history, event; `assign` too when given), inside the caller's write transaction.
/// None: the node moved and the caller commits; else what to answer, nothing written.
pub(super) async fn reimage_in(
    conn: &mut sqlx::SqliteConnection,
    mac: &Mac,
    reason: &str,
    rule: &ReimageRule<'_>,
    assign: Option<&str>,
) -> Result<Option<ReimageOutcome>, StoreError> {
    let row: Option<NodeRow> = sqlx::query_as(select_nodes!("WHERE mac = ?"))
        .bind(mac.to_string())
        .fetch_optional(&mut *conn)
        .await?;
    let Some(node) = row.map(rows::node).transpose()? else {
        return Ok(Some(ReimageOutcome::UnknownNode));
    };
    let rows: Vec<NodeRow> = sqlx::query_as(select_nodes!("WHERE state = ?"))
        .bind(NodeState::Reimaging.as_str())
        .fetch_all(&mut *conn)
        .await?;
    let reimaging = rows::nodes(rows)?;
    let to = match rule(&node, &reimaging) {
        ReimageDecision::Move(to) => to,
        refused => return Ok(Some(ReimageOutcome::Refused(refused, node))),
    };
    let now = now_ms();
    sqlx::query("UPDATE nodes SET state = ?, state_reason = ?, assigned_ref = COALESCE(?, assigned_ref), version = version + 1, updated_at_ms = ? WHERE mac = ?")
        .bind(to.as_str())
        .bind(reason)
        .bind(assign)
        .bind(now)
        .bind(mac.to_string())
        .execute(&mut *conn)
        .await?;
    insert_history(conn, mac, Some(node.state), to, reason, now).await?;
    Ok(None)
}

#[async_trait]
impl NodeStore for SqliteStore {
    async fn node(&self, mac: &Mac) -> Result<Option<NodeRecord>, StoreError> {
        node_on(&self.pool, mac).await
    }
    fn node_in_memory(&self, mac: &Mac) -> Option<NodeRecord> {
        self.node_cache.get(mac)
    }
    /// `node`, from memory when no write to it committed since it was last read: the
    /// DHCP server's lookup, one per packet, which must not queue behind writers.
    /// A miss reads on the read-only pool, which writers never hold.
    async fn node_for_dhcp(&self, mac: &Mac) -> Result<Option<NodeRecord>, StoreError> {
        match self.node_cache.get(mac) {
            Some(node) => Ok(Some(node)),
            None => self.read_into_cache(&self.read_pool, mac).await,
        }
    }
    /// Reads every node into the DHCP cache (at DHCP start: the first packets of a
    /// power-on then find their nodes in memory). Returns how many.
    async fn warm_node_cache(&self) -> Result<usize, StoreError> {
        let epoch = self.node_cache.epoch();
        let rows: Vec<NodeRow> = sqlx::query_as(select_nodes!("ORDER BY mac"))
            .fetch_all(&self.read_pool)
            .await?;
        let n = rows.len();
        for row in rows {
            self.node_cache.fill(epoch, &rows::node(row)?);
        }
        Ok(n)
    }
    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        let rows: Vec<NodeRow> = sqlx::query_as(select_nodes!("ORDER BY mac"))
            .fetch_all(&self.pool)
            .await?;
        rows::nodes(rows)
    }
    async fn census(&self) -> Result<Vec<crate::store::CensusRow>, StoreError> {
        let rows: Vec<rows::CensusTuple> = sqlx::query_as(rows::CENSUS_SQLITE)
            .fetch_all(&self.read_pool)
            .await?;
        rows::census(rows)
    }
    async fn discover_within(
        &self,
        mac: &Mac,
        uuid: Option<&str>,
        reason: &str,
        cap: Option<i64>,
    ) -> Result<Option<(NodeRecord, bool)>, StoreError> {
        // A node already known, whose UUID is kept or not offered, would be written to
        // for nothing: every DHCP exchange and boot script of a known node asks.
        let cached = self.node_cache.get(mac);
        if let Some(node) = &cached
            && (uuid.is_none() || node.uuid.is_some())
        {
            return Ok(Some((node.clone(), false)));
        }
        // A node known here whose first UUID this is (registered by MAC, then booted):
        // one statement, not the general path's four.
        if let (Some(uuid), Some(_)) = (uuid, cached)
            && let Some(node) = self.first_uuid(mac, uuid).await?
        {
            return Ok(Some((node, false)));
        }
        let mut tx = self.write_tx().await?;
        let now = now_ms();
        if let Some(cap) = cap {
            let known: Option<(i64,)> = sqlx::query_as("SELECT 1 FROM nodes WHERE mac = ?")
                .bind(mac.to_string())
                .fetch_optional(&mut *tx)
                .await?;
            if known.is_none() {
                let (unassigned,): (i64,) = sqlx::query_as(
                    "SELECT COUNT(*) FROM nodes WHERE state = 'discovered' AND assigned_ref IS NULL",
                )
                .fetch_one(&mut *tx)
                .await?;
                if unassigned >= cap {
                    tx.abandon().await?;
                    return Ok(None);
                }
            }
        }
        let inserted: Option<NodeRow> = sqlx::query_as(concat!(
            "INSERT INTO nodes (mac, uuid, labels, state, state_reason, version, created_at_ms, updated_at_ms)
             VALUES (?, ?, '{}', ?, ?, 1, ?, ?) ON CONFLICT (mac) DO NOTHING RETURNING ",
            rows::node_columns!()
        ))
        .bind(mac.to_string())
        .bind(uuid)
        .bind(NodeState::Discovered.as_str())
        .bind(reason)
        .bind(now)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        let (row, is_new) = match inserted {
            Some(row) => {
                insert_history(&mut tx, mac, None, NodeState::Discovered, reason, now).await?;
                (row, true)
            }
            None => {
                if let Some(uuid) = uuid {
                    // Firmware may send the UUID only on some boots: the first one seen is
                    // kept. Anyone on the boot network can ask for a script, so a later,
                    // different one is not the node's word (the service logs it).
                    sqlx::query("UPDATE nodes SET uuid = ? WHERE mac = ? AND uuid IS NULL")
                        .bind(uuid)
                        .bind(mac.to_string())
                        .execute(&mut *tx)
                        .await?;
                }
                let row: NodeRow = sqlx::query_as(select_nodes!("WHERE mac = ?"))
                    .bind(mac.to_string())
                    .fetch_one(&mut *tx)
                    .await?;
                (row, false)
            }
        };
        let node = rows::node(row)?;
        tx.commit_writing(&node, None).await?;
        if is_new {
            self.notify_events();
        }
        Ok(Some((node, is_new)))
    }
    /// Sets what `mac` boots; the node is recorded first if it was unknown.
    async fn assign(&self, mac: &Mac, reference: &str) -> Result<NodeRecord, StoreError> {
        self.discover(mac, None, "registered by an admin").await?;
        let mut tx = self.write_tx().await?;
        sqlx::query("UPDATE nodes SET assigned_ref = ?, version = version + 1, updated_at_ms = ? WHERE mac = ?")
            .bind(reference)
            .bind(now_ms())
            .bind(mac.to_string())
            .execute(&mut *tx)
            .await?;
        let data = crate::api::event::NodeAssignedData {
            image: reference.to_string(),
        };
        super::events::insert_event(
            &mut tx,
            crate::api::event::kind::NODE_ASSIGNED,
            Some(mac),
            &data,
            now_ms(),
        )
        .await?;
        tx.commit_touching(mac).await?;
        self.notify_events();
        self.node_after_write(mac)
            .await?
            .ok_or_else(|| StoreError::Corrupt(format!("node {mac} vanished")))
    }
    /// Sets and removes labels in one write; None if the node is unknown.
    async fn label(
        &self,
        mac: &Mac,
        set: &BTreeMap<String, String>,
        remove: &[String],
    ) -> Result<Option<NodeRecord>, StoreError> {
        let mut tx = self.write_tx().await?;
        let row: Option<(String,)> = sqlx::query_as("SELECT labels FROM nodes WHERE mac = ?")
            .bind(mac.to_string())
            .fetch_optional(&mut *tx)
            .await?;
        let Some((labels,)) = row else {
            tx.abandon().await?;
            return Ok(None);
        };
        let mut labels: BTreeMap<String, String> = serde_json::from_str(&labels)
            .map_err(|e| StoreError::Corrupt(format!("labels: {e}")))?;
        labels.extend(set.iter().map(|(k, v)| (k.clone(), v.clone())));
        for k in remove {
            labels.remove(k);
        }
        sqlx::query(
            "UPDATE nodes SET labels = ?, version = version + 1, updated_at_ms = ? WHERE mac = ?",
        )
        .bind(serde_json::to_string(&labels).expect("string map serialises"))
        .bind(now_ms())
        .bind(mac.to_string())
        .execute(&mut *tx)
        .await?;
        let data = crate::api::event::NodeLabelledData { labels };
        super::events::insert_event(
            &mut tx,
            crate::api::event::kind::NODE_LABELLED,
            Some(mac),
            &data,
            now_ms(),
        )
        .await?;
        tx.commit_touching(mac).await?;
        self.notify_events();
        self.node_after_write(mac).await
    }
    /// Moves `mac` to `to` if it is still at `version`, with a history row; opens `boot`
    /// in the same transaction when given (one commit, one fsync, per boot).
    async fn set_state(
        &self,
        mac: &Mac,
        version: i64,
        from: NodeState,
        to: NodeState,
        reason: &str,
        with: Option<&Attached<'_>>,
    ) -> Result<CasOutcome, StoreError> {
        let mut tx = self.write_tx().await?;
        let steps = [(from, to, reason)];
        let changed = change_in(&mut tx, mac, version, &steps, with, now_ms()).await?;
        self.end_change(tx, changed).await
    }
    /// Both changes in one writer's transaction (one trip through the write gate, one
    /// commit to wait for) and in one row update (the node moves straight to `to`, its
    /// version counting both steps; the history has each).
    async fn set_state_via(
        &self,
        mac: &Mac,
        version: i64,
        from: NodeState,
        (via, via_reason): (NodeState, &str),
        to: NodeState,
        reason: &str,
        with: Option<&Attached<'_>>,
    ) -> Result<CasOutcome, StoreError> {
        let mut tx = self.write_tx().await?;
        let now = now_ms();
        let steps = [(from, via, via_reason), (via, to, reason)];
        let changed = change_in(&mut tx, mac, version, &steps, with, now).await?;
        self.end_change(tx, changed).await
    }
    async fn node_history(&self, mac: &Mac) -> Result<Vec<StateChange>, StoreError> {
        let rows: Vec<rows::HistoryRow> =
            sqlx::query_as("SELECT from_state, to_state, reason, at_ms, actor FROM node_history WHERE mac = ? ORDER BY id")
                .bind(mac.to_string())
                .fetch_all(&self.pool)
                .await?;
        rows::history(rows)
    }
    /// Checks the budget and moves the node to reimaging in one write transaction, so two
    /// concurrent requests cannot both take the last slot.
    async fn request_reimage(
        &self,
        mac: &Mac,
        reason: &str,
        rule: &ReimageRule<'_>,
    ) -> Result<ReimageOutcome, StoreError> {
        let mut tx = self.write_tx().await?;
        if let Some(refused) = reimage_in(&mut tx, mac, reason, rule, None).await? {
            tx.abandon().await?;
            return Ok(refused);
        }
        tx.commit_touching(mac).await?;
        self.notify_events();
        let node = self
            .node_after_write(mac)
            .await?
            .ok_or_else(|| StoreError::Corrupt(format!("node {mac} vanished")))?;
        Ok(ReimageOutcome::Accepted(node))
    }
    async fn claim_idempotency_key(
        &self,
        key: &str,
        mac: &Mac,
        stale_ms: i64,
    ) -> Result<KeyClaim, StoreError> {
        let mut tx = self.write_tx().await?;
        let now = now_ms();
        // An empty response marks a claim not yet answered. The insert, or the takeover
        // of a stale claim, is one statement: two tries cannot both win it.
        let claimed = sqlx::query(
            "INSERT INTO reimage_requests (key, mac, response, at_ms) VALUES (?, ?, '', ?)
             ON CONFLICT (key) DO UPDATE SET mac = excluded.mac, at_ms = excluded.at_ms
             WHERE reimage_requests.response = '' AND reimage_requests.at_ms < ?",
        )
        .bind(key)
        .bind(mac.to_string())
        .bind(now)
        .bind(now - stale_ms)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        if claimed {
            tx.commit().await?;
            return Ok(KeyClaim::Claimed);
        }
        let (mac, response): (String, String) =
            sqlx::query_as("SELECT mac, response FROM reimage_requests WHERE key = ?")
                .bind(key)
                .fetch_one(&mut *tx)
                .await?;
        tx.commit().await?;
        Ok(if response.is_empty() {
            KeyClaim::InProgress { mac }
        } else {
            KeyClaim::Answered { mac, response }
        })
    }
    async fn answer_idempotency_key(&self, key: &str, response: &str) -> Result<(), StoreError> {
        let mut tx = self.write_tx().await?;
        sqlx::query("UPDATE reimage_requests SET response = ? WHERE key = ?")
            .bind(response)
            .bind(key)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }
    async fn release_idempotency_key(&self, key: &str) -> Result<(), StoreError> {
        let mut tx = self.write_tx().await?;
        sqlx::query("DELETE FROM reimage_requests WHERE key = ? AND response = ''")
            .bind(key)
            .execute(&mut *tx)
            .await?;
        tx.commit().await?;
        Ok(())
    }
    async fn record_heartbeats(&self, heard: &[(Mac, i64)]) -> Result<(), StoreError> {
        if heard.is_empty() {
            return Ok(());
        }
        let mut tx = self.write_tx().await?;
        for part in heard.chunks(HEARTBEATS_A_STATEMENT) {
            // A MAC given twice counts its latest (an UPDATE ... FROM would take any one).
            let mut update = sqlx::QueryBuilder::new(
                "UPDATE nodes SET last_heartbeat_ms = MAX(COALESCE(last_heartbeat_ms, 0), heard.at)
                 FROM (SELECT column1 AS mac, MAX(column2) AS at FROM (",
            );
            update.push_values(part, |mut row, (mac, at_ms)| {
                row.push_bind(mac.to_string()).push_bind(*at_ms);
            });
            update.push(") GROUP BY column1) AS heard WHERE nodes.mac = heard.mac");
            update.build().persistent(false).execute(&mut *tx).await?;
        }
        tx.commit().await?;
        Ok(())
    }
    /// From the node cache, which the node's validation left holding its row, else read
    /// (and not kept: a heartbeat is no reason to hold a row the DHCP path may not need).
    async fn node_for_heartbeat(&self, mac: &Mac) -> Result<Option<NodeRecord>, StoreError> {
        match self.node_cache.get(mac) {
            Some(node) => Ok(Some(node)),
            None => node_on(&self.pool, mac).await,
        }
    }
    /// Asks for revalidation; false when the node is unknown.
    async fn request_revalidate(&self, mac: &Mac) -> Result<bool, StoreError> {
        let mut tx = self.write_tx().await?;
        let n = sqlx::query("UPDATE nodes SET revalidate_requested = 1 WHERE mac = ?")
            .bind(mac.to_string())
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if n == 0 {
            tx.abandon().await?;
            return Ok(false);
        }
        let data = serde_json::json!({});
        super::events::insert_event(
            &mut tx,
            crate::api::event::kind::REVALIDATE_REQUESTED,
            Some(mac),
            &data,
            now_ms(),
        )
        .await?;
        // The flag is in the node's row: its cached copy goes.
        tx.commit_touching(mac).await?;
        self.notify_events();
        Ok(true)
    }
    /// Clears a pending revalidation request; true if there was one (answered once).
    async fn take_revalidate(&self, mac: &Mac) -> Result<bool, StoreError> {
        let mut tx = self.write_tx().await?;
        let n = sqlx::query(
            "UPDATE nodes SET revalidate_requested = 0 WHERE mac = ? AND revalidate_requested = 1",
        )
        .bind(mac.to_string())
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if n == 0 {
            tx.abandon().await?;
            return Ok(false);
        }
        tx.commit_touching(mac).await?;
        Ok(true)
    }
    /// Nodes and when we last heard from them: the later of their last heartbeat and
    /// their last state change (a new boot must not inherit an old boot's silence).
    async fn last_seen(&self) -> Result<Vec<(Mac, NodeState, i64)>, StoreError> {
        let rows: Vec<(String, String, i64)> = sqlx::query_as(
            "SELECT mac, state, MAX(COALESCE(last_heartbeat_ms, 0), updated_at_ms) FROM nodes
             WHERE state NOT IN ('discovered', 'unreachable', 'quarantined')",
        )
        .fetch_all(&self.pool)
        .await?;
        rows::last_seen(rows)
    }
}
impl SqliteStore {
    /// Keeps `uuid` as known node `mac`'s first; None when the node is gone or has a
    /// UUID already (the general path then answers).
    async fn first_uuid(&self, mac: &Mac, uuid: &str) -> Result<Option<NodeRecord>, StoreError> {
        let mut tx = self.write_tx().await?;
        let updated: Option<NodeRow> = sqlx::query_as(concat!(
            "UPDATE nodes SET uuid = ? WHERE mac = ? AND uuid IS NULL RETURNING ",
            rows::node_columns!()
        ))
        .bind(uuid)
        .bind(mac.to_string())
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = updated else {
            tx.abandon().await?;
            return Ok(None);
        };
        let node = rows::node(row)?;
        tx.commit_writing(&node, None).await?;
        Ok(Some(node))
    }
    /// Ends a state change's transaction: committed with its node's row (kept in the
    /// cache) and what its attached row did to its boot (kept in the boot cache) when it
    /// was done, else abandoned; answers the outcome once durable.
    async fn end_change(
        &self,
        tx: super::WriteTx,
        (outcome, touch): (CasOutcome, Option<BootTouch>),
    ) -> Result<CasOutcome, StoreError> {
        let CasOutcome::Done(node) = outcome else {
            tx.abandon().await?;
            return Ok(outcome);
        };
        tx.commit_writing(&node, touch).await?;
        self.notify_events();
        Ok(CasOutcome::Done(node))
    }
    /// `mac`'s row read after a write to it committed, replacing what the DHCP cache held
    /// (for writes that do not return their row; a state change's row is kept by the
    /// batch's closer).
    pub(super) async fn node_after_write(
        &self,
        mac: &Mac,
    ) -> Result<Option<NodeRecord>, StoreError> {
        self.node_cache.invalidate(mac);
        self.read_into_cache(&self.pool, mac).await
    }
    /// Reads `mac` on `pool` and keeps it in the DHCP cache unless a write raced the read.
    async fn read_into_cache(
        &self,
        pool: &sqlx::SqlitePool,
        mac: &Mac,
    ) -> Result<Option<NodeRecord>, StoreError> {
        let epoch = self.node_cache.epoch();
        let node = node_on(pool, mac).await?;
        if let Some(node) = &node {
            self.node_cache.fill(epoch, node);
        }
        Ok(node)
    }
}
