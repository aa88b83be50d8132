//! SQL for the event log (ordered by `seq`) and webhook delivery cursors. Events are
//! written in the transaction of what they report, so the log never misses a transition
//! and never shows one that was rolled back.

use async_trait::async_trait;

use super::SqliteStore;
use crate::api::Mac;
use crate::api::event::Event;
use crate::clock::now_ms;
use crate::store::rows;
use crate::store::{EventStore, StoreError, WebhookStore};

/// The event insert's SQL, a literal so that other writes can send it in one statement
/// string with theirs (`nodes::insert_history`). Binds: at_ms, kind, mac, data, actor.
macro_rules! insert_event_sql {
    () => {
        "INSERT INTO events (at_ms, kind, mac, data, actor) VALUES (?, ?, ?, ?, ?)"
    };
}
pub(super) use insert_event_sql;

pub(crate) async fn insert_event(
    conn: &mut sqlx::SqliteConnection,
    kind: &str,
    mac: Option<&Mac>,
    data: &(impl serde::Serialize + Sync),
    at_ms: i64,
) -> Result<(), StoreError> {
    sqlx::query(insert_event_sql!())
        .bind(at_ms)
        .bind(kind)
        .bind(mac.map(|m| m.to_string()))
        .bind(rows::event_data(data)?)
        .bind(crate::audit::actor())
        .execute(conn)
        .await?;
    Ok(())
}

#[async_trait]
impl EventStore for SqliteStore {
    /// Records one event on its own (a refusal: nothing else is written with it).
    async fn record_event(
        &self,
        kind: &str,
        mac: Option<&Mac>,
        data: &serde_json::Value,
    ) -> Result<(), StoreError> {
        let mut tx = self.write_tx().await?;
        insert_event(&mut tx, kind, mac, data, now_ms()).await?;
        tx.commit().await?;
        self.notify_events();
        Ok(())
    }
    /// Events after `since`, oldest first, at most `limit`; only `mac`'s when given.
    async fn events_since(
        &self,
        since: i64,
        limit: i64,
        mac: Option<&Mac>,
    ) -> Result<Vec<Event>, StoreError> {
        let rows: Vec<rows::EventRow> = match mac {
            Some(mac) => sqlx::query_as(
                "SELECT seq, at_ms, kind, mac, data, actor FROM events WHERE seq > ? AND mac = ? ORDER BY seq LIMIT ?",
            )
            .bind(since)
            .bind(mac.to_string())
            .bind(limit)
            .fetch_all(&self.pool)
            .await?,
            None => sqlx::query_as(
                "SELECT seq, at_ms, kind, mac, data, actor FROM events WHERE seq > ? ORDER BY seq LIMIT ?",
            )
            .bind(since)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?,
        };
        rows::events(rows)
    }
    /// The newest event's seq (0 when there is none).
    async fn prune_events(&self, before_ms: i64, keep: i64, batch: i64) -> Result<u64, StoreError> {
        let mut tx = self.write_tx().await?;
        // The oldest first, so the scan stops early; the newest row always stays.
        let gone = sqlx::query(
            "DELETE FROM events WHERE seq IN (
                 SELECT seq FROM events
                 WHERE (at_ms < ? OR seq <= (SELECT MAX(seq) FROM events) - ?)
                   AND seq < (SELECT MAX(seq) FROM events)
                 ORDER BY seq LIMIT ?)",
        )
        .bind(before_ms)
        .bind(keep)
        .bind(batch)
        .execute(&mut *tx)
        .await?
        .rows_affected();
        tx.commit().await?;
        Ok(gone)
    }
    async fn events_head(&self) -> Result<i64, StoreError> {
        let (head,): (Option<i64>,) = sqlx::query_as("SELECT MAX(seq) FROM events")
            .fetch_one(&self.pool)
            .await?;
        Ok(head.unwrap_or(0))
    }
    /// Changes whenever this process commits events. Other servers sharing the database
    /// are not seen here: readers also poll.
    fn subscribe_events(&self) -> tokio::sync::watch::Receiver<u64> {
        self.events_written.subscribe()
    }
}
#[async_trait]
impl WebhookStore for SqliteStore {
    async fn webhook_cursor(&self, url: &str) -> Result<Option<i64>, StoreError> {
        let row: Option<(i64,)> = sqlx::query_as("SELECT seq FROM webhook_cursors WHERE url = ?")
            .bind(url)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|r| r.0))
    }
    async fn set_webhook_cursor(&self, url: &str, seq: i64) -> Result<(), StoreError> {
        let mut tx = self.write_tx().await?;
        sqlx::query(
            "INSERT INTO webhook_cursors (url, seq) VALUES (?, ?)
             ON CONFLICT (url) DO UPDATE SET seq = excluded.seq",
        )
        .bind(url)
        .bind(seq)
        .execute(&mut *tx)
        .await?;
        tx.commit().await?;
        Ok(())
    }
}
impl SqliteStore {
    /// Wakes SSE streams and webhook senders; call after committing events.
    pub(crate) fn notify_events(&self) {
        self.events_written.send_modify(|n| *n = n.wrapping_add(1));
    }
}
