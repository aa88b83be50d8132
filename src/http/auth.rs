//! Bearer-token check for the admin API: 401 without a token, 403 with a wrong one.

use axum::extract::{Request, State};
use axum::http::header;
use axum::middleware::Next;
use axum::response::Response;

use super::AppState;
use super::error::ApiError;

pub async fn require_admin(
    State(state): State<AppState>,
    request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let presented = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.strip_prefix("Bearer "))
        .map(str::trim)
        .filter(|t| !t.is_empty());
    match presented {
        None => Err(ApiError::Unauthorized),
        Some(token) if state.token.matches(token) => Ok(next.run(request).await),
        Some(_) => Err(ApiError::Forbidden),
    }
}
