//! SQL for rollouts (`RolloutStore`) on PostgreSQL: every write with its event, in one
//! transaction; steps and rollouts move by compare-and-set, claims by the primary key
//! (`ON CONFLICT DO NOTHING` waits for a concurrent claimer's commit, then loses).

use async_trait::async_trait;

use super::PgStore;
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
    conn: &mut sqlx::PgConnection,
    id: i64,
    m: &StepMove<'_>,
) -> Result<Option<u32>, StoreError> {
    let current: Option<(i64,)> =
        sqlx::query_as("SELECT id FROM rollouts WHERE id = $1 AND version = $2 FOR SHARE")
            .bind(id)
            .bind(m.version)
            .fetch_optional(&mut *conn)
            .await?;
    if current.is_none() {
        return Ok(None);
    }
    let wave: Option<(i64,)> = sqlx::query_as(
        "SELECT wave FROM rollout_nodes WHERE rollout_id = $1 AND mac = $2 AND status = $3 FOR UPDATE",
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
    conn: &mut sqlx::PgConnection,
    id: i64,
    m: &StepMove<'_>,
    wave: u32,
) -> Result<(), StoreError> {
    let now = now_ms();
    // A forward reimage marks the node as one a rollback may have to return.
    let reimaged = (m.to == StepStatus::Reimaging).then_some(now);
    sqlx::query(
        "UPDATE rollout_nodes SET status = $1, reason = $2,
                started_at_ms = COALESCE($3, started_at_ms), finished_at_ms = COALESCE($4, finished_at_ms),
                reimaged_at_ms = COALESCE($5, reimaged_at_ms)
         WHERE rollout_id = $6 AND mac = $7",
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
    conn: &mut sqlx::PgConnection,
    id: i64,
) -> Result<Option<(Mac, i64)>, StoreError> {
    sqlx::query(
        "INSERT INTO rollout_claims (mac, rollout_id) SELECT mac, rollout_id FROM rollout_nodes
         WHERE rollout_id = $1 AND reimaged_at_ms IS NOT NULL
         ON CONFLICT (mac) DO NOTHING",
    )
    .bind(id)
    .execute(&mut *conn)
    .await?;
    let other: Option<(String, i64)> = sqlx::query_as(
        "SELECT c.mac, c.rollout_id FROM rollout_claims c JOIN rollout_nodes n ON n.mac = c.mac
         WHERE n.rollout_id = $1 AND n.reimaged_at_ms IS NOT NULL AND c.rollout_id <> $2 LIMIT 1",
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
impl RolloutStore for PgStore {
    async fn create_rollout(&self, new: &NewRollout<'_>) -> Result<RolloutCreated, StoreError> {
        let mut tx = self.tx().await?;
        let now = now_ms();
        let (id,): (i64,) = sqlx::query_as(
            "INSERT INTO rollouts (spec, digest, state, state_reason, wave, version, created_at_ms, updated_at_ms)
             VALUES ($1, $2, 'running', $3, 0, 0, $4, $5) RETURNING id",
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
                "INSERT INTO rollout_claims (mac, rollout_id) VALUES ($1, $2) ON CONFLICT (mac) DO NOTHING",
            )
            .bind(n.mac.to_string())
            .bind(id)
            .execute(&mut *tx)
            .await?;
            if claimed.rows_affected() == 0 {
                let (other,): (i64,) =
                    sqlx::query_as("SELECT rollout_id FROM rollout_claims WHERE mac = $1")
                        .bind(n.mac.to_string())
                        .fetch_one(&mut *tx)
                        .await?;
                // Dropped uncommitted: the transaction rolls back, nothing is kept.
                return Ok(RolloutCreated::Overlap {
                    mac: n.mac,
                    rollout: other,
                });
            }
            sqlx::query(
                "INSERT INTO rollout_nodes (rollout_id, mac, wave, position, status, previous_assigned, previous_digest, reason)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, '')",
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
        .fetch_all(&self.pool)
        .await?;
        Ok(found.into_iter().map(|(id,)| id).collect())
    }

    async fn rollout(
        &self,
        id: i64,
    ) -> Result<Option<(RolloutRow, Vec<RolloutNodeRow>)>, StoreError> {
        // One snapshot: the rollout and its nodes as of one moment (READ COMMITTED would
        // give each statement its own).
        let mut conn = self.tx().await?;
        sqlx::query("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ, READ ONLY")
            .execute(&mut *conn)
            .await?;
        let row: Option<rows::RolloutRowRaw> = sqlx::query_as(select_rollouts!("WHERE id = $1"))
            .bind(id)
            .fetch_optional(&mut *conn)
            .await?;
        let nodes: Vec<rows::RolloutNodeRaw> = sqlx::query_as(select_rollout_nodes!(
            "WHERE rollout_id = $1 ORDER BY position"
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
        let mut tx = self.tx().await?;
        let now = now_ms();
        let done = sqlx::query(
            "UPDATE rollouts SET state = $1, state_reason = $2, wave = $3, version = version + 1, updated_at_ms = $4
             WHERE id = $5 AND version = $6",
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
            return Ok(RolloutMoved::Stale);
        }
        if m.reclaim
            && let Some((mac, rollout)) = claim_all(&mut tx, id).await?
        {
            // Dropped uncommitted: nothing of the move is kept.
            return Ok(RolloutMoved::Overlap { mac, rollout });
        }
        if !m.queue_rollback.is_empty() {
            // Chosen here, under the rollout's row lock: a step the controller settled
            // a moment ago is seen.
            let statuses: Vec<&str> = m.queue_rollback.iter().map(|s| s.as_str()).collect();
            sqlx::query(
                "UPDATE rollout_nodes SET status = 'rollback-pending', reason = $1, finished_at_ms = NULL
                 WHERE rollout_id = $2 AND reimaged_at_ms IS NOT NULL AND status = ANY($3)",
            )
            .bind(m.reason)
            .bind(id)
            .bind(statuses)
            .execute(&mut *tx)
            .await?;
        }
        if !m.state.holds_nodes() {
            sqlx::query("DELETE FROM rollout_claims WHERE rollout_id = $1")
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
        let mut tx = self.tx().await?;
        let Some(wave) = hold_step(&mut tx, id, m).await? else {
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
        let mut tx = self.tx().await?;
        // Rollout, step, then the budget's lock and the node (`reimage_in`), then the
        // events: the order every writer takes them in.
        let Some(wave) = hold_step(&mut tx, id, m).await? else {
            return Ok(StepReimage::StaleStep);
        };
        if let Some(refused) =
            super::nodes::reimage_in(&mut tx, m.mac, reason, rule, Some(assign)).await?
        {
            // Dropped uncommitted: nothing is written.
            return Ok(StepReimage::Refused(Box::new(refused)));
        }
        write_step(&mut tx, id, m, wave).await?;
        tx.commit().await?;
        self.notify_events();
        Ok(StepReimage::Moved)
    }

    async fn claimed_by(&self, mac: &Mac) -> Result<Option<i64>, StoreError> {
        let found: Option<(i64,)> =
            sqlx::query_as("SELECT rollout_id FROM rollout_claims WHERE mac = $1")
                .bind(mac.to_string())
                .fetch_optional(&self.pool)
                .await?;
        Ok(found.map(|(id,)| id))
    }

    async fn nodes_in(&self, macs: &[Mac]) -> Result<Vec<NodeRecord>, StoreError> {
        let list: Vec<String> = macs.iter().map(Mac::to_string).collect();
        let found: Vec<rows::NodeRow> = sqlx::query_as(rows::select_nodes!("WHERE mac = ANY($1)"))
            .bind(list)
            .fetch_all(&self.pool)
            .await?;
        rows::nodes(found)
    }

    async fn latest_boot(&self, mac: &Mac) -> Result<Option<(Digest, i64)>, StoreError> {
        let found: Option<(String, i64)> = sqlx::query_as(
            "SELECT image_digest, created_at_ms FROM boots WHERE mac = $1 ORDER BY seq DESC LIMIT 1",
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
            "SELECT to_state, reason FROM node_history WHERE mac = $1
               AND to_state IN ('attestation-failed', 'validation-failed', 'quarantined')
               AND at_ms >= (SELECT MIN(created_at_ms) FROM boots WHERE mac = $1 AND created_at_ms >= $2)
             ORDER BY id LIMIT 1",
        )
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
            "SELECT at_ms, kind, data FROM events WHERE mac = $1 AND kind LIKE 'rollout.node-%'
             ORDER BY seq DESC LIMIT $2",
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
