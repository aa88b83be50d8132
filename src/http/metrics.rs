//! `GET /metrics` and `GET /metrics/gpus`: the admin token, the scrape-only token
//! (`[metrics] token_file`), or any named token that is not revoked (every role reads).

use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::auth::bearer;
use super::error::ApiError;

/// The scrape-only token, the admin token or a named one; failures count against the
/// source like the API's.
async fn allowed(
    state: &AppState,
    headers: &HeaderMap,
    peer: Option<axum::Extension<super::serve::Peer>>,
) -> Result<(), ApiError> {
    let Some(token) = bearer(headers) else {
        return Err(ApiError::Unauthorized);
    };
    let source = peer.map(|axum::Extension(p)| p.0.ip());
    super::auth::not_limited(state, source)?;
    if state
        .scrape
        .token
        .as_ref()
        .is_some_and(|t| t.matches(token))
    {
        return Ok(());
    }
    match state.tokens.authenticate(token).await {
        Ok(Ok(_)) => Ok(()),
        Ok(Err(refusal)) => {
            super::auth::refused_token(state, source, refusal);
            Err(ApiError::Forbidden)
        }
        Err(e) => Err(crate::registry::RegistryError::from(e).into()),
    }
}

fn text(body: String) -> Response {
    let content_type = [(header::CONTENT_TYPE, crate::metrics::expose::CONTENT_TYPE)];
    (content_type, body).into_response()
}

#[utoipa::path(
    get, path = "/metrics", tag = "metrics",
    security(("admin" = []), ("scrape" = [])),
    responses((status = 200, description = "Prometheus text format 0.0.4", content_type = "text/plain", body = String))
)]
pub async fn scrape(
    State(state): State<AppState>,
    headers: HeaderMap,
    peer: Option<axum::Extension<super::serve::Peer>>,
) -> Result<Response, ApiError> {
    allowed(&state, &headers, peer).await?;
    let census = crate::metrics::census::gather(&state.registry.store, &state.scrape)
        .await
        .map_err(|e| ApiError::from(crate::registry::RegistryError::from(e)))?;
    let queue = state.nodes.fetches.queued();
    Ok(text(crate::metrics::expose::encode(
        &state.metrics,
        &census,
        queue,
        state.registry.store.write_stats(),
    )))
}

/// Each GPU's newest heartbeat readings, apart from `/metrics` because it grows with the
/// fleet (a scrape job of its own, which may run less often).
#[utoipa::path(
    get, path = "/metrics/gpus", tag = "metrics",
    security(("admin" = []), ("scrape" = [])),
    responses((status = 200, description = "Each GPU's newest heartbeat readings, Prometheus text format 0.0.4", content_type = "text/plain", body = String))
)]
pub async fn gpus(
    State(state): State<AppState>,
    headers: HeaderMap,
    peer: Option<axum::Extension<super::serve::Peer>>,
) -> Result<Response, ApiError> {
    allowed(&state, &headers, peer).await?;
    let snapshot = state.metrics.gpus().snapshot(crate::clock::now_ms());
    // Tens of milliseconds for a large fleet: off the async workers.
    let body = tokio::task::spawn_blocking(move || crate::metrics::gpus::encode(snapshot))
        .await
        .map_err(|e| ApiError::Internal(format!("encoding GPU metrics: {e}")))?;
    Ok(text(body))
}
