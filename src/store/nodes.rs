//! SQL for nodes, their state history and their boots. State changes are compare-and-set
//! on `version`, so two writers never clobber each other: the loser is told.

use std::collections::BTreeMap;

use super::{Store, StoreError, format_ms, now_ms, parse_digest};
use crate::api::Digest;
use crate::api::Mac;
use crate::api::NodeState;
use crate::api::node::{Bmc, Node, StateChange};

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
}

/// The outcome of a compare-and-set state change.
#[derive(Debug, PartialEq)]
pub enum CasOutcome {
    Done(Box<NodeRecord>),
    /// Someone else changed the node since `version` was read.
    Stale,
}

type NodeRow = (
    String,
    Option<String>,
    Option<String>,
    String,
    Option<String>,
    String,
    String,
    i64,
    i64,
    i64,
    Option<String>,
);

/// `SELECT` of every node column; static SQL, so sqlx needs no audit escape.
macro_rules! select_nodes {
    ($rest:literal) => {
        concat!(
            "SELECT mac, uuid, hostname, labels, assigned_ref, state, state_reason, version, created_at_ms, updated_at_ms, bmc FROM nodes ",
            $rest
        )
    };
}

fn node_from_row(r: NodeRow) -> Result<NodeRecord, StoreError> {
    let corrupt = |m: String| StoreError::Corrupt(m);
    Ok(NodeRecord {
        mac: r
            .0
            .parse()
            .map_err(|e: crate::api::MacError| corrupt(e.to_string()))?,
        uuid: r.1,
        hostname: r.2,
        labels: serde_json::from_str(&r.3).map_err(|e| corrupt(format!("labels: {e}")))?,
        assigned: r.4,
        state: NodeState::parse(&r.5).ok_or_else(|| corrupt(format!("state {:?}", r.5)))?,
        state_reason: r.6,
        version: r.7,
        created_at: format_ms(r.8),
        updated_at: format_ms(r.9),
        bmc: r
            .10
            .map(|b| serde_json::from_str(&b))
            .transpose()
            .map_err(|e| corrupt(format!("bmc: {e}")))?,
    })
}

/// The history row and the event of a state change; always in the transaction of the
/// change itself. Callers notify event readers after committing.
async fn insert_history(
    conn: &mut sqlx::SqliteConnection,
    mac: &Mac,
    from: Option<NodeState>,
    to: NodeState,
    reason: &str,
    at_ms: i64,
) -> Result<(), StoreError> {
    sqlx::query("INSERT INTO node_history (mac, from_state, to_state, reason, at_ms) VALUES (?, ?, ?, ?, ?)")
        .bind(mac.to_string())
        .bind(from.map(NodeState::as_str))
        .bind(to.as_str())
        .bind(reason)
        .bind(at_ms)
        .execute(&mut *conn)
        .await?;
    let data = crate::api::event::NodeStateData {
        from,
        to,
        reason: reason.to_string(),
    };
    super::events::insert_event(
        conn,
        crate::api::event::kind::NODE_STATE,
        Some(mac),
        &data,
        at_ms,
    )
    .await
}

async fn node_on(pool: &sqlx::SqlitePool, mac: &Mac) -> Result<Option<NodeRecord>, StoreError> {
    let row: Option<NodeRow> = sqlx::query_as(select_nodes!("WHERE mac = ?"))
        .bind(mac.to_string())
        .fetch_optional(pool)
        .await?;
    row.map(node_from_row).transpose()
}

impl Store {
    pub async fn node(&self, mac: &Mac) -> Result<Option<NodeRecord>, StoreError> {
        node_on(&self.pool, mac).await
    }

    /// `node`, from memory when no write to it committed since it was last read: the
    /// DHCP server's lookup, one per packet, which must not queue behind writers.
    /// A miss reads on the read-only pool, which writers never hold.
    pub async fn node_for_dhcp(&self, mac: &Mac) -> Result<Option<NodeRecord>, StoreError> {
        match self.node_cache.get(mac) {
            Some(node) => Ok(Some(node)),
            None => self.read_into_cache(&self.read_pool, mac).await,
        }
    }

    /// Reads every node into the DHCP cache (at DHCP start: the first packets of a
    /// power-on then find their nodes in memory). Returns how many.
    pub async fn warm_node_cache(&self) -> Result<usize, StoreError> {
        let epoch = self.node_cache.epoch();
        let rows: Vec<NodeRow> = sqlx::query_as(select_nodes!("ORDER BY mac"))
            .fetch_all(&self.read_pool)
            .await?;
        let n = rows.len();
        for row in rows {
            self.node_cache.fill(epoch, &node_from_row(row)?);
        }
        Ok(n)
    }

    /// `mac`'s row read after a write to it committed, replacing what the DHCP cache held:
    /// the cache stays warm through a storm's state changes.
    async fn node_after_write(&self, mac: &Mac) -> Result<Option<NodeRecord>, StoreError> {
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

    pub async fn nodes(&self) -> Result<Vec<NodeRecord>, StoreError> {
        let rows: Vec<NodeRow> = sqlx::query_as(select_nodes!("ORDER BY mac"))
            .fetch_all(&self.pool)
            .await?;
        rows.into_iter().map(node_from_row).collect()
    }

    /// Records `mac` as discovered unless known; returns the node and whether it is new.
    pub async fn discover(
        &self,
        mac: &Mac,
        uuid: Option<&str>,
        reason: &str,
    ) -> Result<(NodeRecord, bool), StoreError> {
        let mut tx = self.write_tx().await?;
        let now = now_ms();
        let inserted = sqlx::query(
            "INSERT INTO nodes (mac, uuid, labels, state, state_reason, version, created_at_ms, updated_at_ms)
             VALUES (?, ?, '{}', ?, ?, 1, ?, ?) ON CONFLICT (mac) DO NOTHING",
        )
        .bind(mac.to_string())
        .bind(uuid)
        .bind(NodeState::Discovered.as_str())
        .bind(reason)
        .bind(now)
        .bind(now)
        .execute(&mut *tx)
        .await?
        .rows_affected()
            == 1;
        if inserted {
            insert_history(&mut tx, mac, None, NodeState::Discovered, reason, now).await?;
        } else if let Some(uuid) = uuid {
            // Firmware may send the UUID only on some boots; keep the latest we saw.
            sqlx::query("UPDATE nodes SET uuid = ? WHERE mac = ? AND (uuid IS NULL OR uuid != ?)")
                .bind(uuid)
                .bind(mac.to_string())
                .bind(uuid)
                .execute(&mut *tx)
                .await?;
        }
        tx.commit().await?;
        if inserted {
            self.notify_events();
        }
        let node = self
            .node_after_write(mac)
            .await?
            .ok_or_else(|| StoreError::Corrupt(format!("node {mac} vanished")))?;
        Ok((node, inserted))
    }

    /// Sets what `mac` boots; the node is recorded first if it was unknown.
    pub async fn assign(&self, mac: &Mac, reference: &str) -> Result<NodeRecord, StoreError> {
        self.discover(mac, None, "registered by an admin").await?;
        // Autocommit writes queue at the gate too (Store::write_gate).
        let _gate = self.write_gate().await;
        sqlx::query("UPDATE nodes SET assigned_ref = ?, version = version + 1, updated_at_ms = ? WHERE mac = ?")
            .bind(reference)
            .bind(now_ms())
            .bind(mac.to_string())
            .execute(&self.pool)
            .await?;
        self.node_after_write(mac)
            .await?
            .ok_or_else(|| StoreError::Corrupt(format!("node {mac} vanished")))
    }

    /// Sets and removes labels in one write; None if the node is unknown.
    pub async fn label(
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
        tx.commit().await?;
        self.node_after_write(mac).await
    }

    /// Moves `mac` to `to` if it is still at `version`, with a history row; opens `boot`
    /// in the same transaction when given (one commit, one fsync, per boot).
    pub async fn set_state(
        &self,
        mac: &Mac,
        version: i64,
        from: NodeState,
        to: NodeState,
        reason: &str,
        boot: Option<&NewBoot<'_>>,
    ) -> Result<CasOutcome, StoreError> {
        let mut tx = self.write_tx().await?;
        let now = now_ms();
        let changed = sqlx::query(
            "UPDATE nodes SET state = ?, state_reason = ?, version = version + 1, updated_at_ms = ?
             WHERE mac = ? AND version = ?",
        )
        .bind(to.as_str())
        .bind(reason)
        .bind(now)
        .bind(mac.to_string())
        .bind(version)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        if changed == 0 {
            return Ok(CasOutcome::Stale);
        }
        if let Some(boot) = boot {
            sqlx::query("INSERT INTO boots (id, mac, image_digest, token_sha256, created_at_ms) VALUES (?, ?, ?, ?, ?)")
                .bind(boot.id)
                .bind(mac.to_string())
                .bind(boot.image.to_string())
                .bind(boot.token_sha256.to_string())
                .bind(now)
                .execute(&mut *tx)
                .await?;
        }
        insert_history(&mut tx, mac, Some(from), to, reason, now).await?;
        tx.commit().await?;
        self.notify_events();
        let node = self
            .node_after_write(mac)
            .await?
            .ok_or_else(|| StoreError::Corrupt(format!("node {mac} vanished")))?;
        Ok(CasOutcome::Done(Box::new(node)))
    }

    pub async fn node_history(&self, mac: &Mac) -> Result<Vec<StateChange>, StoreError> {
        let rows: Vec<(Option<String>, String, String, i64)> =
            sqlx::query_as("SELECT from_state, to_state, reason, at_ms FROM node_history WHERE mac = ? ORDER BY id")
                .bind(mac.to_string())
                .fetch_all(&self.pool)
                .await?;
        let state = |s: &str| {
            NodeState::parse(s).ok_or_else(|| StoreError::Corrupt(format!("state {s:?}")))
        };
        rows.into_iter()
            .map(|(from, to, reason, at)| {
                Ok(StateChange {
                    from: from.as_deref().map(state).transpose()?,
                    to: state(&to)?,
                    reason,
                    at: format_ms(at),
                })
            })
            .collect()
    }
}

/// A boot as attestation needs it.
#[derive(Debug, Clone)]
pub struct BootForAttest {
    pub mac: Mac,
    pub image: Digest,
    pub token_sha256: Digest,
    pub created_at_ms: i64,
    /// The node's newest boot: a token from an older one has expired.
    pub latest: bool,
}

impl Store {
    pub async fn boot_for_attest(&self, id: &str) -> Result<Option<BootForAttest>, StoreError> {
        let row: Option<(String, String, String, i64, String)> = sqlx::query_as(
            "SELECT b.mac, b.image_digest, b.token_sha256, b.created_at_ms,
                    (SELECT id FROM boots WHERE mac = b.mac ORDER BY created_at_ms DESC, rowid DESC LIMIT 1)
             FROM boots b WHERE b.id = ?",
        )
        .bind(id)
        .fetch_optional(&self.pool)
        .await?;
        row.map(|(mac, image, token, at, latest)| {
            Ok(BootForAttest {
                mac: mac
                    .parse()
                    .map_err(|e: crate::api::MacError| StoreError::Corrupt(e.to_string()))?,
                image: parse_digest(&image)?,
                token_sha256: parse_digest(&token)?,
                created_at_ms: at,
                latest: latest == id,
            })
        })
        .transpose()
    }

    /// Stores the verdict and report of boot `id`; false if it was attested before (a
    /// replay).
    pub async fn record_attestation(
        &self,
        id: &str,
        verdict_json: &str,
        report_json: &str,
    ) -> Result<bool, StoreError> {
        // Autocommit writes queue at the gate too (Store::write_gate).
        let _gate = self.write_gate().await;
        let changed = sqlx::query("UPDATE boots SET attested_at_ms = ?, verdict = ?, report = ? WHERE id = ? AND attested_at_ms IS NULL")
            .bind(now_ms())
            .bind(verdict_json)
            .bind(report_json)
            .bind(id)
            .execute(&self.pool)
            .await?
            .rows_affected();
        Ok(changed == 1)
    }
}

/// How many nodes may be reimaging at once: overall, and per value of one label.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DisruptionBudget {
    pub max_total: i64,
    /// The label that groups nodes (for example "rack"), and how many of one group at once.
    pub group_label: Option<String>,
    pub max_per_group: i64,
}

impl Default for DisruptionBudget {
    fn default() -> Self {
        Self {
            max_total: 10,
            group_label: Some("rack".into()),
            max_per_group: 2,
        }
    }
}

#[derive(Debug, PartialEq)]
pub enum ReimageOutcome {
    Accepted(NodeRecord),
    /// Already reimaging: nothing changed (requests are idempotent by node too).
    AlreadyReimaging(NodeRecord),
    OverBudget(String),
    NotAllowed(crate::node::state::TransitionError),
    UnknownNode,
}

impl Store {
    /// Checks the budget and moves the node to reimaging in one write transaction, so two
    /// concurrent requests cannot both take the last slot.
    pub async fn request_reimage(
        &self,
        mac: &Mac,
        reason: &str,
        budget: &DisruptionBudget,
    ) -> Result<ReimageOutcome, StoreError> {
        use crate::node::state::{NodeEvent, transition};
        let mut tx = self.write_tx().await?;
        let row: Option<NodeRow> = sqlx::query_as(select_nodes!("WHERE mac = ?"))
            .bind(mac.to_string())
            .fetch_optional(&mut *tx)
            .await?;
        let Some(node) = row.map(node_from_row).transpose()? else {
            return Ok(ReimageOutcome::UnknownNode);
        };
        if node.state == NodeState::Reimaging {
            return Ok(ReimageOutcome::AlreadyReimaging(node));
        }
        let to = match transition(node.state, NodeEvent::ReimageRequested) {
            Ok(to) => to,
            Err(e) => return Ok(ReimageOutcome::NotAllowed(e)),
        };
        let (total,): (i64,) =
            sqlx::query_as("SELECT COUNT(*) FROM nodes WHERE state = 'reimaging'")
                .fetch_one(&mut *tx)
                .await?;
        if total >= budget.max_total {
            return Ok(ReimageOutcome::OverBudget(format!(
                "{total} nodes are reimaging, the most allowed at once is {}",
                budget.max_total
            )));
        }
        if let Some(key) = &budget.group_label
            && let Some(group) = node.labels.get(key)
        {
            let (in_group,): (i64,) = sqlx::query_as(
                "SELECT COUNT(*) FROM nodes WHERE state = 'reimaging' AND json_extract(labels, '$.' || ?) = ?",
            )
            .bind(format!("\"{}\"", key.replace('"', "")))
            .bind(group)
            .fetch_one(&mut *tx)
            .await?;
            if in_group >= budget.max_per_group {
                return Ok(ReimageOutcome::OverBudget(format!(
                    "{in_group} nodes with {key}={group} are reimaging, the most allowed at once is {}",
                    budget.max_per_group
                )));
            }
        }
        let now = now_ms();
        sqlx::query("UPDATE nodes SET state = ?, state_reason = ?, version = version + 1, updated_at_ms = ? WHERE mac = ?")
            .bind(to.as_str())
            .bind(reason)
            .bind(now)
            .bind(mac.to_string())
            .execute(&mut *tx)
            .await?;
        insert_history(&mut tx, mac, Some(node.state), to, reason, now).await?;
        tx.commit().await?;
        self.notify_events();
        let node = self
            .node_after_write(mac)
            .await?
            .ok_or_else(|| StoreError::Corrupt(format!("node {mac} vanished")))?;
        Ok(ReimageOutcome::Accepted(node))
    }

    /// The stored answer to an Idempotency-Key, if it was seen before.
    pub async fn idempotent_response(
        &self,
        key: &str,
    ) -> Result<Option<(String, String)>, StoreError> {
        Ok(
            sqlx::query_as("SELECT mac, response FROM reimage_requests WHERE key = ?")
                .bind(key)
                .fetch_optional(&self.pool)
                .await?,
        )
    }

    pub async fn save_idempotent_response(
        &self,
        key: &str,
        mac: &Mac,
        response: &str,
    ) -> Result<(), StoreError> {
        // Autocommit writes queue at the gate too (Store::write_gate).
        let _gate = self.write_gate().await;
        sqlx::query("INSERT INTO reimage_requests (key, mac, response, at_ms) VALUES (?, ?, ?, ?) ON CONFLICT (key) DO NOTHING")
            .bind(key)
            .bind(mac.to_string())
            .bind(response)
            .bind(now_ms())
            .execute(&self.pool)
            .await?;
        Ok(())
    }

    pub async fn record_heartbeat(&self, mac: &Mac) -> Result<(), StoreError> {
        // Autocommit writes queue at the gate too (Store::write_gate).
        let _gate = self.write_gate().await;
        sqlx::query("UPDATE nodes SET last_heartbeat_ms = ? WHERE mac = ?")
            .bind(now_ms())
            .bind(mac.to_string())
            .execute(&self.pool)
            .await?;
        Ok(())
    }
}
