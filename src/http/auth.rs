//! The admin API's check: the bearer token, or the console's session cookie (with its
//! CSRF header on anything but a read). 401 without either, 403 with a wrong one.

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
        Some(token) if state.token.matches(token) => Ok(next.run(request).await),
        Some(_) => Err(ApiError::Forbidden),
        None => {
            console_session(&state, &request)?;
            Ok(next.run(request).await)
        }
    }
}

/// A request from the console: a valid session cookie; a write also needs the session's
/// CSRF token in its header and, when the browser names an Origin, our own.
fn console_session(state: &AppState, request: &Request) -> Result<(), ApiError> {
    use crate::auth::session;
    let headers = request.headers();
    let Some(cookie) = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(session::from_header)
    else {
        return Err(ApiError::Unauthorized);
    };
    if !session::valid(&state.token, cookie, crate::clock::now_ms()) {
        return Err(ApiError::Unauthorized);
    }
    if request.method().is_safe() {
        return Ok(());
    }
    let csrf = headers
        .get(session::CSRF_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !session::csrf_matches(&state.token, cookie, csrf) || !same_origin(headers) {
        return Err(ApiError::Forbidden);
    }
    Ok(())
}

/// No Origin header, or one whose host is the Host the request was sent to.
pub fn same_origin(headers: &HeaderMap) -> bool {
    let Some(origin) = headers.get(header::ORIGIN).and_then(|v| v.to_str().ok()) else {
        return true;
    };
    let host = headers
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    origin
        .split_once("://")
        .is_some_and(|(_, rest)| !host.is_empty() && rest == host)
}
