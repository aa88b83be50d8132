//! The event log over HTTP: `GET /api/v1/events` (a page after a cursor) and
//! `GET /api/v1/events/stream` (server-sent events; a reconnecting client resumes from
//! `Last-Event-ID`, so it misses nothing).

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::Json;
use axum::extract::{Query, State};
use axum::http::HeaderMap;
use axum::response::sse::{self, KeepAlive, Sse};
use futures_util::Stream;
use serde::Deserialize;

use super::AppState;
use super::error::ApiError;
use crate::api::Mac;
use crate::api::event::{Event, EventPage};
use crate::registry::RegistryError;

/// Largest page; also the batch a stream reads at once.
const MAX_PAGE: i64 = 1000;
/// Other servers sharing the database write events this process is not told about.
const POLL: Duration = Duration::from_secs(2);

#[derive(Deserialize)]
pub struct EventsQuery {
    /// Events after this seq (0: from the start).
    since: Option<i64>,
    limit: Option<i64>,
    /// Only this node's events.
    node: Option<String>,
}

fn node_filter(node: Option<&str>) -> Result<Option<Mac>, ApiError> {
    node.map(|n| {
        n.parse()
            .map_err(|e: crate::api::MacError| ApiError::BadRequest(e.to_string()))
    })
    .transpose()
}

fn store_err(e: crate::store::StoreError) -> ApiError {
    ApiError::from(RegistryError::from(e))
}

pub async fn list(
    State(state): State<AppState>,
    Query(q): Query<EventsQuery>,
) -> Result<Json<EventPage>, ApiError> {
    let since = q.since.unwrap_or(0);
    let limit = q.limit.unwrap_or(100);
    if since < 0 || !(1..=MAX_PAGE).contains(&limit) {
        return Err(ApiError::BadRequest(format!(
            "since must be >= 0 and limit within 1..={MAX_PAGE}"
        )));
    }
    let mac = node_filter(q.node.as_deref())?;
    let events = state
        .registry
        .store
        .events_since(since, limit, mac.as_ref())
        .await
        .map_err(store_err)?;
    let next = events.last().map_or(since, |e| e.seq);
    Ok(Json(EventPage { events, next }))
}

/// Streams events as they are committed. Starts after `Last-Event-ID`, else after
/// `since`, else at the newest event (only what happens from now on).
pub async fn stream(
    State(state): State<AppState>,
    headers: HeaderMap,
    Query(q): Query<EventsQuery>,
) -> Result<Sse<impl Stream<Item = Result<sse::Event, Infallible>>>, ApiError> {
    let store = state.registry.store.clone();
    let last_id = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.trim()
                .parse::<i64>()
                .map_err(|_| ApiError::BadRequest(format!("Last-Event-ID {v:?} is not a seq")))
        })
        .transpose()?;
    let cursor = match last_id.or(q.since) {
        Some(c) if c >= 0 => c,
        Some(c) => return Err(ApiError::BadRequest(format!("cursor {c} is negative"))),
        None => store.events_head().await.map_err(store_err)?,
    };
    let mac = node_filter(q.node.as_deref())?;
    let feed = Feed {
        store: store.clone(),
        cursor,
        mac,
        wake: store.subscribe_events(),
        stopping: state.stopping.clone(),
        buffered: VecDeque::new(),
    };
    let events = futures_util::stream::unfold(feed, |mut feed| async move {
        let event = feed.next().await?;
        let sse = sse::Event::default()
            .id(event.seq.to_string())
            .event(event.kind.clone())
            .json_data(&event)
            .expect("events serialise");
        Some((Ok(sse), feed))
    });
    Ok(Sse::new(events).keep_alive(KeepAlive::default()))
}

/// A cursor over the log that waits for new events.
struct Feed {
    store: crate::store::Store,
    cursor: i64,
    mac: Option<Mac>,
    wake: tokio::sync::watch::Receiver<u64>,
    stopping: tokio_util::sync::CancellationToken,
    buffered: VecDeque<Event>,
}

impl Feed {
    /// The next event; None when the server stops or the database fails (the client
    /// reconnects with its Last-Event-ID).
    async fn next(&mut self) -> Option<Event> {
        loop {
            if let Some(e) = self.buffered.pop_front() {
                return Some(e);
            }
            // Mark seen before reading, so a commit during the read wakes the next wait.
            self.wake.borrow_and_update();
            match self
                .store
                .events_since(self.cursor, MAX_PAGE, self.mac.as_ref())
                .await
            {
                Ok(events) if !events.is_empty() => {
                    self.cursor = events.last().expect("not empty").seq;
                    self.buffered.extend(events);
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
