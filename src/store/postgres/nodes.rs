//! SQL for nodes, their state history and their boots. State changes compare-and-set on
//! `version`: under READ COMMITTED a second writer waits for the first's row lock, then
//! finds the version moved and changes nothing, on whichever server it runs.

use std::collections::BTreeMap;

use async_trait::async_trait;

use super::{PgStore, lock};
use crate::api::node::StateChange;
use crate::api::{Mac, NodeState};
use crate::clock::now_ms;
use crate::store::rows::{self, NodeRow, select_nodes};
use crate::store::{
    Attached, CasOutcome, KeyClaim, NewBoot, NodeRecord, NodeStore, ReimageDecision,
    ReimageOutcome, ReimageRule, StoreError,
};

/// The history row and the event of a state change, in the change's transaction.
async fn insert_history(
    conn: &mut sqlx::PgConnection,
    mac: &Mac,
    from: Option<NodeState>,
    to: NodeState,
    reason: &str,
    at_ms: i64,
) -> Result<(), StoreError> {
    insert_histories(conn, mac, &[(from, to, reason)], at_ms).await
}

/// The history rows and events of `steps` (from, to, reason), in order, in the change's
/// transaction, in two round trips to the database: the event lock (see `events`), then
/// the rows, the numbered events and the wake-up of other servers' readers in one
/// statement (each its own statement would cost a round trip each).
async fn insert_histories(
    conn: &mut sqlx::PgConnection,
    mac: &Mac,
    steps: &[(Option<NodeState>, NodeState, &str)],
    at_ms: i64,
) -> Result<(), StoreError> {
    let data = steps
        .iter()
        .map(|&(from, to, reason)| {
            rows::event_data(&crate::api::event::NodeStateData {
                from,
                to,
                reason: reason.to_string(),
            })
        })
        .collect::<Result<Vec<String>, StoreError>>()?;
    super::events::lock_events(conn).await?;
    sqlx::query(
        "WITH steps AS (
             SELECT * FROM UNNEST($2::text[], $3::text[], $4::text[], $5::text[])
                 WITH ORDINALITY AS s(from_state, to_state, reason, data, n)
         ), history AS (
             INSERT INTO node_history (mac, from_state, to_state, reason, at_ms, actor)
             SELECT $1, from_state, to_state, reason, $6, $7 FROM steps ORDER BY n
         ), numbered AS (
             INSERT INTO events (seq, at_ms, kind, mac, data, actor)
             SELECT last.seq + steps.n, $6, $8, $1, steps.data, $7
             FROM steps, (SELECT COALESCE(MAX(seq), 0) AS seq FROM events) last
         )
         SELECT pg_notify($9, '')",
    )
    .bind(mac.to_string())
    .bind(
        steps
            .iter()
            .map(|s| s.0.map(|f| f.as_str().to_string()))
            .collect::<Vec<_>>(),
    )
    .bind(
        steps
            .iter()
            .map(|s| s.1.as_str().to_string())
            .collect::<Vec<_>>(),
    )
    .bind(steps.iter().map(|s| s.2.to_string()).collect::<Vec<_>>())
    .bind(data)
    .bind(at_ms)
    .bind(crate::audit::actor())
    .bind(crate::api::event::kind::NODE_STATE)
    .bind(super::EVENTS_CHANNEL)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

/// Writes the row that belongs with a state change; false when the attestation was
/// recorded before (the caller rolls back). A boot or verdict row that cannot be written
/// is an error, not a replay.
async fn write_attached(
    conn: &mut sqlx::PgConnection,
    mac: &Mac,
    with: &Attached<'_>,
    now: i64,
) -> Result<bool, StoreError> {
    let written = match *with {
        Attached::Boot(NewBoot {
            id,
            image,
            token_sha256,
            preboot_json,
        }) => sqlx::query("INSERT INTO boots (id, mac, image_digest, token_sha256, created_at_ms, preboot) VALUES ($1, $2, $3, $4, $5, $6)")
            .bind(id)
            .bind(mac.to_string())
            .bind(image.to_string())
            .bind(token_sha256.to_string())
            .bind(now)
            .bind(preboot_json)
            .execute(&mut *conn)
            .await?,
        Attached::Attestation {
            boot_id,
            verdict_json,
            report_json,
            passed,
        } => sqlx::query("UPDATE boots SET attested_at_ms = $1, attest_passed = $2, verdict = $3, report = $4 WHERE id = $5 AND attested_at_ms IS NULL")
            .bind(now)
            .bind(passed)
            .bind(verdict_json)
            .bind(report_json)
            .bind(boot_id)
            .execute(&mut *conn)
            .await?,
        Attached::Validation {
            boot_id,
            verdict_json,
        } => sqlx::query("UPDATE boots SET validated_at_ms = $1, validation = $2 WHERE id = $3")
            .bind(now)
            .bind(verdict_json)
            .bind(boot_id)
            .execute(&mut *conn)
            .await?,
    };
    match (with, written.rows_affected()) {
        (_, 1) => Ok(true),
        (Attached::Attestation { .. }, _) => Ok(false),
        (_, n) => Err(StoreError::Corrupt(format!(
            "{n} rows written for a state change's attached row"
        ))),
    }
}

async fn node_on(
    conn: impl sqlx::PgExecutor<'_>,
    mac: &Mac,
) -> Result<Option<NodeRecord>, StoreError> {
    let row: Option<NodeRow> = sqlx::query_as(select_nodes!("WHERE mac = $1"))
        .bind(mac.to_string())
        .fetch_optional(conn)
        .await?;
    row.map(rows::node).transpose()
}

/// `node`, for callers that just wrote it.
pub(super) async fn written(pool: &sqlx::PgPool, mac: &Mac) -> Result<NodeRecord, StoreError> {
    node_on(pool, mac)
        .await?
        .ok_or_else(|| StoreError::Corrupt(format!("node {mac} vanished")))
}

/// A reimage request's decision and, when `rule` moves the node, its writes (state,
/// history, event; `assign` too when given), inside the caller's transaction, under the
/// REIMAGE lock (the disruption budget across servers). None: the node moved and the
/// caller commits; else what to answer, nothing written.
pub(super) async fn reimage_in(
    conn: &mut sqlx::PgConnection,
    mac: &Mac,
    reason: &str,
    rule: &ReimageRule<'_>,
    assign: Option<&str>,
) -> Result<Option<ReimageOutcome>, StoreError> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(lock::REIMAGE)
        .execute(&mut *conn)
        .await?;
    // FOR UPDATE: the node's own state change (its attestation, say) waits for this
    // decision rather than being overwritten by it.
    let row: Option<NodeRow> = sqlx::query_as(select_nodes!("WHERE mac = $1 FOR UPDATE"))
        .bind(mac.to_string())
        .fetch_optional(&mut *conn)
        .await?;
    let Some(node) = row.map(rows::node).transpose()? else {
        return Ok(Some(ReimageOutcome::UnknownNode));
    };
    let rows: Vec<NodeRow> = sqlx::query_as(select_nodes!("WHERE state = $1"))
        .bind(NodeState::Reimaging.as_str())
        .fetch_all(&mut *conn)
        .await?;
    let reimaging = rows::nodes(rows)?;
    let to = match rule(&node, &reimaging) {
        ReimageDecision::Move(to) => to,
        refused => return Ok(Some(ReimageOutcome::Refused(refused, node))),
    };
    let now = now_ms();
    sqlx::query("UPDATE nodes SET state = $1, state_reason = $2, assigned_ref = COALESCE($3, assigned_ref), version = version + 1, updated_at_ms = $4 WHERE mac = $5")
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
impl NodeStore for PgStore {
    async fn node(&self, mac: &Mac) -> Result<Option<NodeRecord>, StoreError> {
        node_on(&self.pool, mac).await
    }
    /// Read through, not cached: another server may have written the node, and a
    /// primary-key read on PostgreSQL does not wait for writers. On DHCP's own pool.
    async fn node_for_dhcp(&self, mac: &Mac) -> Result<Option<NodeRecord>, StoreError> {
        node_on(&self.control_pool, mac).await
    }
    /// Nothing to warm (see `node_for_dhcp`): counts the nodes.
    async fn warm_node_cache(&self) -> Result<usize, StoreError> {
        let (n,): (i64,) = sqlx::query_as("SELECT COUNT(*) FROM nodes")
            .fetch_one(&self.pool)
            .await?;
        Ok(n.max(0) as usize)
    }
    async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        let rows: Vec<NodeRow> = sqlx::query_as(select_nodes!("ORDER BY mac COLLATE \"C\""))
            .fetch_all(&self.pool)
            .await?;
        rows::nodes(rows)
    }
    async fn census(&self) -> Result<Vec<crate::store::CensusRow>, StoreError> {
        let rows: Vec<rows::CensusTuple> = sqlx::query_as(rows::CENSUS_POSTGRES)
            .fetch_all(&self.pool)
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
        let mut tx = self.tx().await?;
        let now = now_ms();
        if let Some(cap) = cap {
            let known: Option<(i64,)> =
                sqlx::query_as("SELECT 1::BIGINT FROM nodes WHERE mac = $1")
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
                    return Ok(None);
                }
            }
        }
        // The row as inserted; none when the node is known (a conflict returns nothing).
        let row: Option<NodeRow> = sqlx::query_as(concat!(
            "INSERT INTO nodes (mac, uuid, labels, state, state_reason, version, created_at_ms, updated_at_ms)
             VALUES ($1, $2, '{}', $3, $4, 1, $5, $5) ON CONFLICT (mac) DO NOTHING RETURNING ",
            rows::node_columns!()
        ))
        .bind(mac.to_string())
        .bind(uuid)
        .bind(NodeState::Discovered.as_str())
        .bind(reason)
        .bind(now)
        .fetch_optional(&mut *tx)
        .await?;
        if let Some(row) = row {
            insert_history(&mut tx, mac, None, NodeState::Discovered, reason, now).await?;
            tx.commit().await?;
            self.notify_events();
            return Ok(Some((rows::node(row)?, true)));
        }
        if let Some(uuid) = uuid {
            // Firmware may send the UUID only on some boots: the first one seen is kept
            // (see the SQLite store).
            sqlx::query("UPDATE nodes SET uuid = $1 WHERE mac = $2 AND uuid IS NULL")
                .bind(uuid)
                .bind(mac.to_string())
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        Ok(Some((written(&self.pool, mac).await?, false)))
    }
    async fn assign(&self, mac: &Mac, reference: &str) -> Result<NodeRecord, StoreError> {
        self.discover(mac, None, "registered by an admin").await?;
        let mut tx = self.tx().await?;
        let row: Option<NodeRow> = sqlx::query_as(concat!(
            "UPDATE nodes SET assigned_ref = $1, version = version + 1, updated_at_ms = $2 WHERE mac = $3 RETURNING ",
            rows::node_columns!()
        ))
        .bind(reference)
        .bind(now_ms())
        .bind(mac.to_string())
        .fetch_optional(&mut *tx)
        .await?;
        // Removed since its discovery just above.
        let row = row.ok_or_else(|| StoreError::Corrupt(format!("node {mac} vanished")))?;
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
        tx.commit().await?;
        self.notify_events();
        rows::node(row)
    }
    async fn label(
        &self,
        mac: &Mac,
        set: &BTreeMap<String, String>,
        remove: &[String],
    ) -> Result<Option<NodeRecord>, StoreError> {
        let mut tx = self.tx().await?;
        // FOR UPDATE: a label write on another server waits, then reads ours.
        let row: Option<(String,)> =
            sqlx::query_as("SELECT labels FROM nodes WHERE mac = $1 FOR UPDATE")
                .bind(mac.to_string())
                .fetch_optional(&mut *tx)
                .await?;
        let Some((labels,)) = row else {
            return Ok(None);
        };
        let mut labels: BTreeMap<String, String> = serde_json::from_str(&labels)
            .map_err(|e| StoreError::Corrupt(format!("labels: {e}")))?;
        labels.extend(set.iter().map(|(k, v)| (k.clone(), v.clone())));
        for k in remove {
            labels.remove(k);
        }
        // Locked above: the row is there.
        let row: NodeRow = sqlx::query_as(concat!(
            "UPDATE nodes SET labels = $1, version = version + 1, updated_at_ms = $2 WHERE mac = $3 RETURNING ",
            rows::node_columns!()
        ))
        .bind(serde_json::to_string(&labels).expect("string map serialises"))
        .bind(now_ms())
        .bind(mac.to_string())
        .fetch_one(&mut *tx)
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
        tx.commit().await?;
        self.notify_events();
        Ok(Some(rows::node(row)?))
    }
    async fn set_state(
        &self,
        mac: &Mac,
        version: i64,
        from: NodeState,
        to: NodeState,
        reason: &str,
        with: Option<&Attached<'_>>,
    ) -> Result<CasOutcome, StoreError> {
        self.change(mac, version, &[(from, to, reason)], with).await
    }
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
        let steps = [(from, via, via_reason), (via, to, reason)];
        self.change(mac, version, &steps, with).await
    }
    async fn node_history(&self, mac: &Mac) -> Result<Vec<StateChange>, StoreError> {
        let rows: Vec<rows::HistoryRow> = sqlx::query_as(
            "SELECT from_state, to_state, reason, at_ms, actor FROM node_history WHERE mac = $1 ORDER BY id",
        )
        .bind(mac.to_string())
        .fetch_all(&self.pool)
        .await?;
        rows::history(rows)
    }
    /// Decides under `lock::REIMAGE`, held to the commit: a second request, on any
    /// server, reads the reimaging set only after this one's move is visible.
    async fn request_reimage(
        &self,
        mac: &Mac,
        reason: &str,
        rule: &ReimageRule<'_>,
    ) -> Result<ReimageOutcome, StoreError> {
        let mut tx = self.tx().await?;
        if let Some(refused) = reimage_in(&mut tx, mac, reason, rule, None).await? {
            return Ok(refused);
        }
        tx.commit().await?;
        self.notify_events();
        Ok(ReimageOutcome::Accepted(written(&self.pool, mac).await?))
    }
    async fn claim_idempotency_key(
        &self,
        key: &str,
        mac: &Mac,
        stale_ms: i64,
    ) -> Result<KeyClaim, StoreError> {
        let now = now_ms();
        // An empty response marks a claim not yet answered. The insert, or the takeover
        // of a stale claim, is one statement: two tries cannot both win it.
        let claimed = sqlx::query(
            "INSERT INTO reimage_requests (key, mac, response, at_ms) VALUES ($1, $2, '', $3)
             ON CONFLICT (key) DO UPDATE SET mac = excluded.mac, at_ms = excluded.at_ms
             WHERE reimage_requests.response = '' AND reimage_requests.at_ms < $4",
        )
        .bind(key)
        .bind(mac.to_string())
        .bind(now)
        .bind(now - stale_ms)
        .execute(&self.pool)
        .await?
        .rows_affected()
            == 1;
        if claimed {
            return Ok(KeyClaim::Claimed);
        }
        let (mac, response): (String, String) =
            sqlx::query_as("SELECT mac, response FROM reimage_requests WHERE key = $1")
                .bind(key)
                .fetch_one(&self.pool)
                .await?;
        Ok(if response.is_empty() {
            KeyClaim::InProgress { mac }
        } else {
            KeyClaim::Answered { mac, response }
        })
    }
    async fn answer_idempotency_key(&self, key: &str, response: &str) -> Result<(), StoreError> {
        sqlx::query("UPDATE reimage_requests SET response = $1 WHERE key = $2")
            .bind(response)
            .bind(key)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
    async fn release_idempotency_key(&self, key: &str) -> Result<(), StoreError> {
        sqlx::query("DELETE FROM reimage_requests WHERE key = $1 AND response = ''")
            .bind(key)
            .execute(&self.pool)
            .await?;
        Ok(())
    }
    async fn record_heartbeats(&self, heard: &[(Mac, i64)]) -> Result<(), StoreError> {
        let macs: Vec<String> = heard.iter().map(|(m, _)| m.to_string()).collect();
        let at: Vec<i64> = heard.iter().map(|(_, at)| *at).collect();
        // The rows locked in MAC order first (an UPDATE ... FROM takes them in the plan's
        // order): two servers flushing overlapping sets cannot deadlock. A MAC given twice
        // counts its latest (an UPDATE ... FROM would take any one).
        sqlx::query(
            "WITH h(mac, at) AS (SELECT mac, MAX(at) FROM UNNEST($1::TEXT[], $2::BIGINT[]) AS u(mac, at) GROUP BY mac),
                  locked AS (SELECT mac FROM nodes WHERE mac = ANY($1::TEXT[]) ORDER BY mac FOR UPDATE)
             UPDATE nodes SET last_heartbeat_ms = GREATEST(COALESCE(nodes.last_heartbeat_ms, 0), h.at)
             FROM h WHERE nodes.mac = h.mac AND nodes.mac IN (SELECT mac FROM locked)",
        )
        .bind(macs)
        .bind(at)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
    async fn request_revalidate(&self, mac: &Mac) -> Result<bool, StoreError> {
        let mut tx = self.tx().await?;
        let n = sqlx::query("UPDATE nodes SET revalidate_requested = TRUE WHERE mac = $1")
            .bind(mac.to_string())
            .execute(&mut *tx)
            .await?
            .rows_affected();
        if n == 0 {
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
        tx.commit().await?;
        self.notify_events();
        Ok(true)
    }
    /// Clears a pending revalidation request; true for exactly one caller, on any server.
    async fn take_revalidate(&self, mac: &Mac) -> Result<bool, StoreError> {
        let n = sqlx::query(
            "UPDATE nodes SET revalidate_requested = FALSE WHERE mac = $1 AND revalidate_requested",
        )
        .bind(mac.to_string())
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(n == 1)
    }
    async fn last_seen(&self) -> Result<Vec<(Mac, NodeState, i64)>, StoreError> {
        let rows: Vec<(String, String, i64)> = sqlx::query_as(
            "SELECT mac, state, GREATEST(COALESCE(last_heartbeat_ms, 0), updated_at_ms) FROM nodes
             WHERE state NOT IN ('discovered', 'unreachable', 'quarantined')",
        )
        .fetch_all(&self.pool)
        .await?;
        rows::last_seen(rows)
    }
}

impl PgStore {
    /// Moves `mac` through `steps` (each a change with its history row and event) in one
    /// transaction and one row update: the node goes straight to the last step's state,
    /// its version counting every step; `with` is written with them.
    async fn change(
        &self,
        mac: &Mac,
        version: i64,
        steps: &[(NodeState, NodeState, &str)],
        with: Option<&Attached<'_>>,
    ) -> Result<CasOutcome, StoreError> {
        let Some(&(_, to, reason)) = steps.last() else {
            return Err(StoreError::Corrupt("a state change of no step".into()));
        };
        let mut tx = self.tx().await?;
        let now = now_ms();
        // The row as this change wrote it (not read back after the commit, when another
        // writer may have moved it on).
        let row: Option<NodeRow> = sqlx::query_as(concat!(
            "UPDATE nodes SET state = $1, state_reason = $2, version = version + $3, updated_at_ms = $4
             WHERE mac = $5 AND version = $6 RETURNING ",
            rows::node_columns!()
        ))
        .bind(to.as_str())
        .bind(reason)
        .bind(steps.len() as i64)
        .bind(now)
        .bind(mac.to_string())
        .bind(version)
        .fetch_optional(&mut *tx)
        .await?;
        let Some(row) = row else {
            return Ok(CasOutcome::Stale);
        };
        let node = rows::node(row)?;
        if let Some(with) = with
            && !write_attached(&mut tx, mac, with, now).await?
        {
            return Ok(CasOutcome::AlreadyAttested);
        }
        let history: Vec<_> = steps
            .iter()
            .map(|&(from, to, reason)| (Some(from), to, reason))
            .collect();
        insert_histories(&mut tx, mac, &history, now).await?;
        tx.commit().await?;
        self.notify_events();
        Ok(CasOutcome::Done(Box::new(node)))
    }
}
