//! `GET /metrics`: the admin token or the scrape-only token (`[metrics] token_file`).

use axum::extract::State;
use axum::http::{HeaderMap, header};
use axum::response::{IntoResponse, Response};

use super::AppState;
use super::auth::bearer;
use super::error::ApiError;

pub async fn scrape(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let Some(token) = bearer(&headers) else {
        return Err(ApiError::Unauthorized);
    };
    let scrape_token = state
        .scrape
        .token
        .as_ref()
        .is_some_and(|t| t.matches(token));
    if !state.token.matches(token) && !scrape_token {
        return Err(ApiError::Forbidden);
    }
    let census = crate::metrics::census::gather(&state.registry.store, &state.scrape)
        .await
        .map_err(|e| ApiError::from(crate::registry::RegistryError::from(e)))?;
    let queue = state.nodes.fetches.queued();
    let text = crate::metrics::expose::encode(&state.metrics, &census, queue);
    Ok((
        [(header::CONTENT_TYPE, crate::metrics::expose::CONTENT_TYPE)],
        text,
    )
        .into_response())
}
