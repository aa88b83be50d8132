//! SQL for the event log and webhook cursors. An event is numbered MAX(seq) + 1 under
//! `lock::EVENTS`, held to the commit of the transaction that writes it: two servers'
//! events can never commit out of number order, so a reader that has seen `seq` n has
//! seen every event up to n, and the numbers have no gaps. The lock is taken last in each
//! transaction (every row it changes is changed first, but for a state change's history
//! rows, written in its events' statement), so it is held only for that insert and the
//! commit.

use async_trait::async_trait;

use super::{EVENTS_CHANNEL, PgStore, lock};
use crate::api::Mac;
use crate::api::event::Event;
use crate::clock::now_ms;
use crate::store::{EventStore, StoreError, WebhookStore, rows};

/// Takes the event lock, held to the commit. Its own statement: a statement's snapshot
/// is taken when it starts, and the next one must see every event committed by whoever
/// held the lock before.
pub(crate) async fn lock_events(conn: &mut sqlx::PgConnection) -> Result<(), StoreError> {
    sqlx::query("SELECT pg_advisory_xact_lock($1)")
        .bind(lock::EVENTS)
        .execute(&mut *conn)
        .await?;
    Ok(())
}

pub(crate) async fn insert_event(
    conn: &mut sqlx::PgConnection,
    kind: &str,
    mac: Option<&Mac>,
    data: &(impl serde::Serialize + Sync),
    at_ms: i64,
) -> Result<(), StoreError> {
    lock_events(conn).await?;
    // Numbered, and readers on every server woken at commit (not at all on rollback), in
    // one round trip.
    sqlx::query(
        "WITH numbered AS (
             INSERT INTO events (seq, at_ms, kind, mac, data, actor)
             SELECT COALESCE(MAX(seq), 0) + 1, $1, $2, $3, $4, $5 FROM events
         )
         SELECT pg_notify($6, '')",
    )
    .bind(at_ms)
    .bind(kind)
    .bind(mac.map(|m| m.to_string()))
    .bind(rows::event_data(data)?)
    .bind(crate::audit::actor())
    .bind(EVENTS_CHANNEL)
    .execute(&mut *conn)
    .await?;
    Ok(())
}

#[async_trait]
impl EventStore for PgStore {
    async fn record_event(
        &self,
        kind: &str,
        mac: Option<&Mac>,
        data: &serde_json::Value,
    ) -> Result<(), StoreError> {
        let mut tx = self.tx().await?;
        insert_event(&mut tx, kind, mac, data, now_ms()).await?;
        tx.commit().await?;
        self.notify_events();
        Ok(())
    }
    async fn events_since(
        &self,
        since: i64,
        limit: i64,
        mac: Option<&Mac>,
    ) -> Result<Vec<Event>, StoreError> {
        let rows: Vec<rows::EventRow> = match mac {
            Some(mac) => sqlx::query_as(
                "SELECT seq, at_ms, kind, mac, data, actor FROM events WHERE seq > $1 AND mac = $2 ORDER BY seq LIMIT $3",
            )
            .bind(since)
            .bind(mac.to_string())
            .bind(limit)
            .fetch_all(&self.pool)
            .await?,
            None => sqlx::query_as(
                "SELECT seq, at_ms, kind, mac, data, actor FROM events WHERE seq > $1 ORDER BY seq LIMIT $2",
            )
            .bind(since)
            .bind(limit)
            .fetch_all(&self.pool)
            .await?,
        };
        rows::events(rows)
    }
    async fn prune_events(&self, before_ms: i64, keep: i64, batch: i64) -> Result<u64, StoreError> {
        // The oldest first, so the scan stops early; the newest row always stays.
        let gone = sqlx::query(
            "DELETE FROM events WHERE seq IN (
                 SELECT seq FROM events
                 WHERE (at_ms < $1 OR seq <= (SELECT MAX(seq) FROM events) - $2)
                   AND seq < (SELECT MAX(seq) FROM events)
                 ORDER BY seq LIMIT $3)",
        )
        .bind(before_ms)
        .bind(keep)
        .bind(batch)
        .execute(&self.pool)
        .await?
        .rows_affected();
        Ok(gone)
    }
    async fn events_head(&self) -> Result<i64, StoreError> {
        let (head,): (Option<i64>,) = sqlx::query_as("SELECT MAX(seq) FROM events")
            .fetch_one(&self.pool)
            .await?;
        Ok(head.unwrap_or(0))
    }
    /// Changes whenever any server sharing the database commits events.
    fn subscribe_events(&self) -> tokio::sync::watch::Receiver<u64> {
        self.events_written.subscribe()
    }
}

#[async_trait]
impl WebhookStore for PgStore {
    async fn webhook_cursor(&self, url: &str) -> Result<Option<i64>, StoreError> {
        let row: Option<(i64,)> = sqlx::query_as("SELECT seq FROM webhook_cursors WHERE url = $1")
            .bind(url)
            .fetch_optional(&self.pool)
            .await?;
        Ok(row.map(|r| r.0))
    }
    async fn set_webhook_cursor(&self, url: &str, seq: i64) -> Result<(), StoreError> {
        sqlx::query(
            "INSERT INTO webhook_cursors (url, seq) VALUES ($1, $2)
             ON CONFLICT (url) DO UPDATE SET seq = excluded.seq",
        )
        .bind(url)
        .bind(seq)
        .execute(&self.pool)
        .await?;
        Ok(())
    }
}
