//! Bearer-token check for the admin API: 401 without a token, 403 with a wrong one.

use axum::extract::{Request, State};
use axum::http::{HeaderMap, header};
use axum::middleware::Next;
use axum::response::Response;

use super::AppState;
use super::error::ApiError;

/// The request's bearer token, if it has one. The scheme is case-insensitive (RFC 7235):
/// `bearer` and `BEARER` are `Bearer`.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

pub async fn require_admin(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    match bearer(request.headers()) {
        None => Err(ApiError::Unauthorized),
        Some(token) if state.token.matches(token) => Ok(next.run(request).await),
        Some(_) => Err(ApiError::Forbidden),
    }
}
