//! SQL for rollouts (`RolloutStore`): every write with its event, in one write
//! transaction; steps and rollouts move by compare-and-set.

use async_trait::async_trait;

use super::SqliteStore;
use super::events::insert_event;
use crate::api::event::kind;
use crate::api::rollout::{RolloutEventData, StepStatus};
use crate::api::{Digest, Mac};
use crate::clock::now_ms;
use crate::store::rows::{self, select_rollout_nodes, select_rollouts};
use crate::store::{
    NewRollout, NodeRecord, ReimageRule, RolloutCreated, RolloutMove, RolloutMoved, RolloutNodeRow,
    RolloutRow, RolloutStore, StepMove, StepReimage, StoreError,
};

/// Holds the rollout at `m.version` and the step at `m.from` for this transaction (on
/// PostgreSQL the rollout's row shared, so an admin's change to the rollout waits for
/// this write or this write sees it, and the step's row for update); the step's wave, or
/// None when either has moved on (nothing to write).
async fn hold_step(
    conn: &mut sqlx::SqliteConnection,
    id: i64,
    m: &StepMove<'_>,
) -> Result<Option<u32>, StoreError> {
    let current: Option<(i64,)> =
        sqlx::query_as("SELECT id FROM rollouts WHERE id = ? AND version = ?")
            .bind(id)
            .bind(m.version)
            .fetch_optional(&mut *conn)
            .await?;
    if current.is_none() {
        return Ok(None);
    }
    let wave: Option<(i64,)> = sqlx::query_as(
        "SELECT wave FROM rollout_nodes WHERE rollout_id = ? AND mac = ? AND status = ?",
    )
    .bind(id)
    .bind(m.mac.to_string())
    .bind(m.from.as_str())
    .fetch_optional(&mut *conn)
    .await?;
    Ok(wave.map(|(w,)| u32::try_from(w).unwrap_or(u32::MAX)))
}

/// Writes a held step's move and its event.
async fn write_step(
    conn: &mut sqlx::SqliteConnection,
    id: i64,
    m: &StepMove<'_>,
    wave: u32,
) -> Result<(), StoreError> {
    let now = now_ms();
    // A forward reimage marks the node as one a rollback may have to return.
    let reimaged = (m.to == StepStatus::Reimaging).then_some(now);
    sqlx::query(
        "UPDATE rollout_nodes SET status = ?, reason = ?,
                started_at_ms = COALESCE(?, started_at_ms), finished_at_ms = COALESCE(?, finished_at_ms),
                reimaged_at_ms = COALESCE(?, reimaged_at_ms)
         WHERE rollout_id = ? AND mac = ?",
    )
    .bind(m.to.as_str())
    .bind(m.reason)
    .bind(m.started_at_ms)
    .bind(m.finished_at_ms)
    .bind(reimaged)
    .bind(id)
    .bind(m.mac.to_string())
    .execute(&mut *conn)
    .await?;
    let data = RolloutEventData {
        rollout: id,
        wave: Some(wave),
        reason: m.reason.to_string(),
    };
    insert_event(conn, m.event_kind, Some(m.mac), &data, now).await
}

/// Claims the nodes rollout `id` reimaged (what a rollback returns) for it; the first node another rollout holds, if
/// any (the caller then drops the transaction).
async fn claim_all(
    conn: &mut sqlx::SqliteConnection,
    id: i64,
) -> Result<Option<(Mac, i64)>, StoreError> {
    sqlx::query(
        "INSERT INTO rollout_claims (mac, rollout_id) SELECT mac, rollout_id FROM rollout_nodes
         WHERE rollout_id = ? AND reimaged_at_ms IS NOT NULL
         ON CONFLICT (mac) DO NOTHING",
    )
    .bind(id)
    .execute(&mut *conn)
    .await?;
    let other: Option<(String, i64)> = sqlx::query_as(
        "SELECT c.mac, c.rollout_id FROM rollout_claims c JOIN rollout_nodes n ON n.mac = c.mac
         WHERE n.rollout_id = ? AND n.reimaged_at_ms IS NOT NULL AND c.rollout_id <> ? LIMIT 1",
    )
    .bind(id)
    .bind(id)
    .fetch_optional(&mut *conn)
    .await?;
    other
        .map(|(mac, rollout)| Ok((rows::mac(&mac)?, rollout)))
        .transpose()
}

#[async_trait]
impl RolloutStore for SqliteStore {
    async fn create_rollout(&self, new: &NewRollout<'_>) -> Result<RolloutCreated, StoreError> {
        let mut tx = self.write_tx().await?;
        let now = now_ms();
        let (id,): (i64,) = sqlx::query_as(
            "INSERT INTO rollouts (spec, digest, state, state_reason, wave, version, created_at_ms, updated_at_ms)
             VALUES (?, ?, 'running', ?, 0, 0, ?, ?) RETURNING id",
        )
        .bind(new.spec_json)
        .bind(new.digest.to_string())
        .bind(new.reason)
        .bind(now)
        .bind(now)
        .fetch_one(&mut *tx)
        .await?;
        // Claimed in MAC order: two overlapping starts lock claims in one order (on
        // PostgreSQL the second waits for the first, then loses, never a deadlock).
        let mut by_mac: Vec<&RolloutNodeRow> = new.nodes.iter().collect();
        by_mac.sort_by_key(|n| n.mac);
        for n in by_mac {
            let claimed = sqlx::query(
                "INSERT INTO rollout_claims (mac, rollout_id) VALUES (?, ?) ON CONFLICT (mac) DO NOTHING",
            )
            .bind(n.mac.to_string())
            .bind(id)
            .execute(&mut *tx)
            .await?;
            if claimed.rows_affected() == 0 {
                let (other,): (i64,) =
                    sqlx::query_as("SELECT rollout_id FROM rollout_claims WHERE mac = ?")
                        .bind(n.mac.to_string())
                        .fetch_one(&mut *tx)
                        .await?;
                // Dropped uncommitted: the transaction rolls back, nothing is kept.
                tx.abandon().await?;
                return Ok(RolloutCreated::Overlap {
                    mac: n.mac,
                    rollout: other,
                });
            }
            sqlx::query(
                "INSERT INTO rollout_nodes (rollout_id, mac, wave, position, status, previous_assigned, previous_digest, reason)
                 VALUES (?, ?, ?, ?, ?, ?, ?, '')",
            )
            .bind(id)
            .bind(n.mac.to_string())
            .bind(i64::from(n.wave))
            .bind(i64::from(n.position))
            .bind(n.status.as_str())
            .bind(n.previous_assigned.as_deref())
            .bind(n.previous_digest.as_ref().map(Digest::to_string))
            .execute(&mut *tx)
            .await?;
        }
        let data = RolloutEventData {
            rollout: id,
            wave: None,
            reason: new.reason.to_string(),
        };
        insert_event(&mut tx, kind::ROLLOUT_STARTED, None, &data, now).await?;
        tx.commit().await?;
        self.notify_events();
        Ok(RolloutCreated::Created(id))
    }

    async fn rollouts(&self) -> Result<Vec<RolloutRow>, StoreError> {
        let found: Vec<rows::RolloutRowRaw> = sqlx::query_as(select_rollouts!("ORDER BY id DESC"))
            .fetch_all(&self.pool)
            .await?;
        found.into_iter().map(rows::rollout).collect()
    }

    async fn active_rollouts(&self) -> Result<Vec<i64>, StoreError> {
        let found: Vec<(i64,)> = sqlx::query_as(
            "SELECT id FROM rollouts WHERE state NOT IN ('finished', 'aborted', 'rolled-back') ORDER BY id",
        )
        // The read-only pool: the writers' connections stay the writers'.
        .fetch_all(&self.read_pool)
        .await?;
        Ok(found.into_iter().map(|(id,)| id).collect())
    }

    async fn rollout(
        &self,
        id: i64,
    ) -> Result<Option<(RolloutRow, Vec<RolloutNodeRow>)>, StoreError> {
        // One read transaction: the rollout and its nodes as of one moment.
        let mut conn = self.pool.begin().await?;
        let row: Option<rows::RolloutRowRaw> = sqlx::query_as(select_rollouts!("WHERE id = ?"))
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
        let nodes: Vec<rows::RolloutNodeRaw> = sqlx::query_as(select_rollout_nodes!(
            "WHERE rollout_id = ? ORDER BY position"
        ))
        .bind(id)
        .fetch_all(&mut *conn)
        .await?;
        conn.commit().await?;
        let Some(row) = row else { return Ok(None) };
        let nodes = nodes
            .into_iter()
            .map(rows::rollout_node)
            .collect::<Result<_, _>>()?;
        Ok(Some((rows::rollout(row)?, nodes)))
    }

    async fn move_rollout(
        &self,
        id: i64,
        version: i64,
        m: &RolloutMove<'_>,
    ) -> Result<RolloutMoved, StoreError> {
        let mut tx = self.write_tx().await?;
        let now = now_ms();
        let done = sqlx::query(
            "UPDATE rollouts SET state = ?, state_reason = ?, wave = ?, version = version + 1, updated_at_ms = ?
             WHERE id = ? AND version = ?",
        )
        .bind(m.state.as_str())
        .bind(m.reason)
        .bind(i64::from(m.wave))
        .bind(now)
        .bind(id)
        .bind(version)
        .execute(&mut *tx)
        .await?;
        if done.rows_affected() == 0 {
            tx.abandon().await?;
            return Ok(RolloutMoved::Stale);
        }
        if m.reclaim
            && let Some((mac, rollout)) = claim_all(&mut tx, id).await?
        {
            // Dropped uncommitted: nothing of the move is kept.
            tx.abandon().await?;
            return Ok(RolloutMoved::Overlap { mac, rollout });
        }
        if !m.queue_rollback.is_empty() {
            // Chosen here, in the write transaction: a step the controller settled a
            // moment ago is seen.
            let statuses: Vec<&str> = m.queue_rollback.iter().map(|s| s.as_str()).collect();
            sqlx::query(
                "UPDATE rollout_nodes SET status = 'rollback-pending', reason = ?, finished_at_ms = NULL
                 WHERE rollout_id = ? AND reimaged_at_ms IS NOT NULL
                   AND status IN (SELECT value FROM json_each(?))",
            )
            .bind(m.reason)
            .bind(id)
            .bind(serde_json::to_string(&statuses).expect("strings serialise"))
            .execute(&mut *tx)
            .await?;
        }
        if !m.state.holds_nodes() {
            sqlx::query("DELETE FROM rollout_claims WHERE rollout_id = ?")
                .bind(id)
                .execute(&mut *tx)
                .await?;
        }
        let data = RolloutEventData {
            rollout: id,
            wave: Some(m.wave),
            reason: m.reason.to_string(),
        };
        insert_event(&mut tx, m.event_kind, None, &data, now).await?;
        tx.commit().await?;
        self.notify_events();
        Ok(RolloutMoved::Moved)
    }

    async fn move_step(&self, id: i64, m: &StepMove<'_>) -> Result<bool, StoreError> {
        let mut tx = self.write_tx().await?;
        let Some(wave) = hold_step(&mut tx, id, m).await? else {
            tx.abandon().await?;
            return Ok(false);
        };
        write_step(&mut tx, id, m, wave).await?;
        tx.commit().await?;
        self.notify_events();
        Ok(true)
    }

    async fn reimage_step(
        &self,
        id: i64,
        m: &StepMove<'_>,
        assign: &str,
        reason: &str,
        rule: &ReimageRule<'_>,
    ) -> Result<StepReimage, StoreError> {
        let mut tx = self.write_tx().await?;
        // Rollout, step, then the budget's lock and the node (`reimage_in`), then the
        // events: the order every writer takes them in.
        let Some(wave) = hold_step(&mut tx, id, m).await? else {
            tx.abandon().await?;
            return Ok(StepReimage::StaleStep);
        };
        if let Some(refused) =
            super::nodes::reimage_in(&mut tx, m.mac, reason, rule, Some(assign)).await?
        {
            // Dropped uncommitted: nothing is written.
            tx.abandon().await?;
            return Ok(StepReimage::Refused(Box::new(refused)));
        }
        write_step(&mut tx, id, m, wave).await?;
        tx.commit_touching(m.mac).await?;
        self.notify_events();
        self.node_after_write(m.mac).await?;
        Ok(StepReimage::Moved)
    }

    async fn claimed_by(&self, mac: &Mac) -> Result<Option<i64>, StoreError> {
        let found: Option<(i64,)> =
            sqlx::query_as("SELECT rollout_id FROM rollout_claims WHERE mac = ?")
                .bind(mac.to_string())
                .fetch_optional(&self.pool)
                .await?;
        Ok(found.map(|(id,)| id))
    }

    async fn nodes_in(&self, macs: &[Mac]) -> Result<Vec<NodeRecord>, StoreError> {
        let list: Vec<String> = macs.iter().map(Mac::to_string).collect();
        let found: Vec<rows::NodeRow> = sqlx::query_as(rows::select_nodes!(
            "WHERE mac IN (SELECT value FROM json_each(?))"
        ))
        .bind(serde_json::to_string(&list).expect("strings serialise"))
        .fetch_all(&self.read_pool)
        .await?;
        rows::nodes(found)
    }

    async fn latest_boot(&self, mac: &Mac) -> Result<Option<(Digest, i64)>, StoreError> {
        let found: Option<(String, i64)> = sqlx::query_as(
            "SELECT image_digest, created_at_ms FROM boots WHERE mac = ? ORDER BY rowid DESC LIMIT 1",
        )
        .bind(mac.to_string())
        .fetch_optional(&self.pool)
        .await?;
        found
            .map(|(d, at)| Ok((rows::parse_digest(&d)?, at)))
            .transpose()
    }

    async fn failure_since(
        &self,
        mac: &Mac,
        since_ms: i64,
    ) -> Result<Option<(crate::api::NodeState, String)>, StoreError> {
        let found: Option<(String, String)> = sqlx::query_as(
            "SELECT to_state, reason FROM node_history WHERE mac = ?
               AND to_state IN ('attestation-failed', 'validation-failed', 'quarantined')
               AND at_ms >= (SELECT MIN(created_at_ms) FROM boots WHERE mac = ? AND created_at_ms >= ?)
             ORDER BY id LIMIT 1",
        )
        .bind(mac.to_string())
        .bind(mac.to_string())
        .bind(since_ms)
        .fetch_optional(&self.pool)
        .await?;
        found
            .map(|(state, reason)| {
                let state = crate::api::NodeState::parse(&state)
                    .ok_or_else(|| StoreError::Corrupt(format!("history state {state:?}")))?;
                Ok((state, reason))
            })
            .transpose()
    }

    async fn node_rollout_events(
        &self,
        mac: &Mac,
        limit: i64,
    ) -> Result<Vec<(i64, String, serde_json::Value)>, StoreError> {
        let found: Vec<(i64, String, String)> = sqlx::query_as(
            "SELECT at_ms, kind, data FROM events WHERE mac = ? AND kind LIKE 'rollout.node-%'
             ORDER BY seq DESC LIMIT ?",
        )
        .bind(mac.to_string())
        .bind(limit)
        .fetch_all(&self.pool)
        .await?;
        found
            .into_iter()
            .map(|(at, kind, data)| {
                let data = serde_json::from_str(&data)
                    .map_err(|e| StoreError::Corrupt(format!("event data: {e}")))?;
                Ok((at, kind, data))
            })
            .collect()
    }
}
