//! The event log as a service: pages after a cursor, a feed that waits for new events
//! (what the SSE stream sends), and delivery to webhooks (`webhook`). Events are written
//! by the services, in the transaction of the change they report; this only reads them.

pub mod retention;
pub mod webhook;

use std::collections::VecDeque;
use std::time::Duration;

use crate::api::Mac;
use crate::api::event::{Event, EventPage};
use crate::store::{Store, StoreError};

/// Largest page; also the batch a feed reads at once.
pub const MAX_PAGE: i64 = 1000;
/// Other servers sharing the database write events this process is not told about.
const POLL: Duration = Duration::from_secs(2);

#[derive(Debug, thiserror::Error)]
pub enum EventError {
    #[error("{0}")]
    Invalid(String),
    #[error(transparent)]
    Store(#[from] StoreError),
}

#[derive(Clone)]
pub struct EventLog {
    store: Store,
}

impl EventLog {
    pub fn new(store: Store) -> Self {
        Self { store }
    }

    /// Events after `since`, oldest first, at most `limit` (1..=`MAX_PAGE`); only `mac`'s
    /// when given.
    pub async fn page(
        &self,
        since: i64,
        limit: i64,
        mac: Option<&Mac>,
    ) -> Result<EventPage, EventError> {
        if since < 0 || !(1..=MAX_PAGE).contains(&limit) {
            return Err(EventError::Invalid(format!(
                "since must be >= 0 and limit within 1..={MAX_PAGE}"
            )));
        }
        let events = self.store.events_since(since, limit, mac).await?;
        let next = events.last().map_or(since, |e| e.seq);
        Ok(EventPage { events, next })
    }

    /// The newest event's seq (0 when there is none).
    pub async fn head(&self) -> Result<i64, EventError> {
        Ok(self.store.events_head().await?)
    }

    /// A feed of events after `cursor` (only `mac`'s when given) that ends when
    /// `stopping` is cancelled, or, with `token`, when that API token is revoked (its
    /// `token.revoked` event, committed through any server, is the last it gives).
    /// Such a feed reads every node's events and keeps `mac`'s: a revocation names no
    /// node.
    pub fn feed(
        &self,
        cursor: i64,
        mac: Option<Mac>,
        token: Option<String>,
        stopping: tokio_util::sync::CancellationToken,
    ) -> Feed {
        Feed {
            store: self.store.clone(),
            cursor,
            mac,
            token,
            revoked: false,
            wake: self.store.subscribe_events(),
            stopping,
            buffered: VecDeque::new(),
        }
    }
}

/// A cursor over the log that waits for new events.
pub struct Feed {
    store: Store,
    cursor: i64,
    mac: Option<Mac>,
    /// The API token the feed is read with, when it can be revoked.
    token: Option<String>,
    /// Its revocation was given: nothing more is.
    revoked: bool,
    wake: tokio::sync::watch::Receiver<u64>,
    stopping: tokio_util::sync::CancellationToken,
    buffered: VecDeque<Event>,
}

/// Whether `event` is the revocation of the API token `token`.
fn revokes(event: &Event, token: Option<&str>) -> bool {
    token.is_some_and(|name| {
        event.kind == crate::api::event::kind::TOKEN_REVOKED && event.data["name"] == name
    })
}

impl Feed {
    /// Whether the feed's token is revoked (or gone) as the store has it now; a store
    /// that cannot answer ends the feed too (the client reconnects through the gate).
    async fn token_gone(&self) -> bool {
        let Some(name) = &self.token else {
            return false;
        };
        match self.store.token_named(name).await {
            Ok(Some(row)) => row.revoked_at_ms.is_some(),
            Ok(None) => true,
            Err(e) => {
                tracing::warn!(error = %e, "event stream ends: cannot ask its token");
                true
            }
        }
    }

    /// The next event; None when the server stops or the database fails (the client
    /// reconnects with its Last-Event-ID).
    pub async fn next(&mut self) -> Option<Event> {
        loop {
            if self.revoked {
                return None;
            }
            if let Some(e) = self.buffered.pop_front() {
                self.revoked = revokes(&e, self.token.as_deref());
                return Some(e);
            }
            // Mark seen before reading, so a commit during the read wakes the next wait.
            self.wake.borrow_and_update();
            // A revocation names no node: a feed that watches for one reads them all.
            let read_mac = self.mac.as_ref().filter(|_| self.token.is_none());
            match self
                .store
                .events_since(self.cursor, MAX_PAGE, read_mac)
                .await
            {
                Ok(events) if !events.is_empty() => {
                    // Numbers have no gaps: one here is events pruned under a feed that
                    // fell behind, its token's revocation perhaps among them. Ask the
                    // token itself.
                    if events[0].seq > self.cursor + 1 && self.token_gone().await {
                        self.revoked = true;
                        return None;
                    }
                    self.cursor = events.last().expect("not empty").seq;
                    let (mac, token) = (self.mac.as_ref(), self.token.as_deref());
                    self.buffered.extend(
                        events.into_iter().filter(|e| {
                            mac.is_none() || e.node.as_ref() == mac || revokes(e, token)
                        }),
                    );
                }
                Ok(_) => {
                    tokio::select! {
                        changed = self.wake.changed() => changed.ok()?,
                        () = tokio::time::sleep(POLL) => {}
                        () = self.stopping.cancelled() => return None,
                    }
                }
                Err(e) => {
                    tracing::warn!(error = %e, "event stream ends: cannot read events");
                    return None;
                }
            }
        }
    }
}
