//! Counts and times every routed HTTP request by its route template (`/nodes/{mac}`, not
//! the MAC): a `route_layer`, so requests no route matched are not counted here.

use axum::body::HttpBody as _;
use axum::extract::{MatchedPath, Request, State};
use axum::middleware::Next;
use axum::response::Response;

use super::Metrics;

pub async fn track(State(metrics): State<Metrics>, req: Request, next: Next) -> Response {
    // MatchedPath holds its template in an Arc: cloned, not copied.
    let route = req.extensions().get::<MatchedPath>().cloned();
    let method = req.method().clone();
    let started = std::time::Instant::now();
    let response = next.run(req).await;
    // The length hyper will announce: a body of known size (a JSON answer, a blob or a
    // range of one) says so; a stream of unknown length (events) counts 0.
    let bytes = response
        .headers()
        .get(axum::http::header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok())
        .or_else(|| response.body().size_hint().exact())
        .unwrap_or(0);
    metrics.http_request(
        route.as_ref().map_or("unmatched", MatchedPath::as_str),
        method.as_str(),
        response.status().as_u16(),
        bytes,
        started.elapsed().as_secs_f64(),
    );
    response
}
