//! The event log over HTTP: `GET /api/v1/events` (a page after a cursor) and
//! `GET /api/v1/events/stream` (server-sent events; a reconnecting client resumes from
//! `Last-Event-ID`, so it misses nothing).

use std::convert::Infallible;

use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::sse::{self, KeepAlive, Sse};
use futures_util::Stream;
use serde::Deserialize;

use super::AppState;
use super::error::ApiError;
use super::extract::{Json, Query};
use crate::api::Mac;
use crate::api::event::EventPage;
use crate::events::EventError;

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
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

fn event_error(e: EventError) -> ApiError {
    match e {
        EventError::Invalid(m) => ApiError::BadRequest(m),
        e => ApiError::Internal(e.to_string()),
    }
}

#[utoipa::path(
    get, path = "/events", tag = "events",
    params(EventsQuery),
    responses((status = 200, description = "A page of events after `since`, oldest first", body = EventPage))
)]
pub async fn list(
    State(state): State<AppState>,
    Query(q): Query<EventsQuery>,
) -> Result<Json<EventPage>, ApiError> {
    let mac = node_filter(q.node.as_deref())?;
    state
        .events
        .page(q.since.unwrap_or(0), q.limit.unwrap_or(100), mac.as_ref())
        .await
        .map(Json)
        .map_err(event_error)
}

/// Streams events as they are committed. Starts after `Last-Event-ID`, else after
/// `since`, else at the newest event (only what happens from now on). A stream opened
/// with a named API token ends with that token's revocation (the first-start admin
/// token cannot be revoked).
#[utoipa::path(
    get, path = "/events/stream", tag = "events",
    params(EventsQuery, ("last-event-id" = Option<i64>, Header, description = "Resume after this seq")),
    responses((status = 200, description = "Server-sent events, one per committed event (`id` is its seq)", content_type = "text/event-stream", body = String))
)]
pub async fn stream(
    State(state): State<AppState>,
    axum::Extension(caller): axum::Extension<crate::auth::tokens::Caller>,
    headers: HeaderMap,
    Query(q): Query<EventsQuery>,
) -> Result<Sse<impl Stream<Item = Result<sse::Event, Infallible>>>, ApiError> {
    let last_id = headers
        .get("last-event-id")
        .and_then(|v| v.to_str().ok())
        .map(|v| {
            v.trim()
                .parse::<i64>()
                .map_err(|_| ApiError::BadRequest(format!("Last-Event-ID {v:?} is not a seq")))
        })
        .transpose()?;
    let head = state.events.head().await.map_err(event_error)?;
    // A cursor past the newest event starts at it: nothing committed later is skipped
    // (a revocation among them).
    let cursor = match last_id.or(q.since) {
        Some(c) if c >= 0 => c.min(head),
        Some(c) => return Err(ApiError::BadRequest(format!("cursor {c} is negative"))),
        None => head,
    };
    let mac = node_filter(q.node.as_deref())?;
    let token = (caller.name != crate::auth::tokens::ADMIN_NAME).then_some(caller.name);
    // Revoked between the gate and the cursor, its event is behind the feed: ask again
    // now that the cursor is fixed (a later revocation comes after the cursor).
    if let Some(name) = &token {
        match state.tokens.caller_named(name).await {
            Ok(Ok(_)) => {}
            Ok(Err(_)) => return Err(ApiError::Forbidden),
            Err(e) => return Err(ApiError::from(crate::registry::RegistryError::from(e))),
        }
    }
    let feed = state
        .events
        .feed(cursor, mac, token, state.stopping.clone());
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
