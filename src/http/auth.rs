//! The admin API's check: a bearer token (the admin's or a named one), or the console's
//! session cookie (with its CSRF header on anything but a read). 401 without either, 403
//! with a wrong one or a role that does not allow the route, 429 for a source that has
//! failed too often.

use std::time::Instant;

use axum::extract::{MatchedPath, Request, State};
use axum::http::{HeaderMap, header};
use axum::middleware::Next;
use axum::response::Response;

use super::AppState;
use super::error::ApiError;
use crate::auth::roles;
use crate::auth::tokens::{Caller, Refusal};

/// The request's bearer token, if it has one. The scheme is case-insensitive (RFC 7235):
/// `bearer` and `BEARER` are `Bearer`.
pub fn bearer(headers: &HeaderMap) -> Option<&str> {
    let value = headers.get(header::AUTHORIZATION)?.to_str().ok()?;
    let (scheme, token) = value.split_once(' ')?;
    let token = token.trim();
    (scheme.eq_ignore_ascii_case("bearer") && !token.is_empty()).then_some(token)
}

/// The admin API's gate: who the caller is (a token, or the console's session, which
/// acts as the token that logged in), whether their role allows this route, and then the request runs
/// on their behalf (`audit`), so every event and history row it writes names them.
/// Sources that fail too often are refused before their token is even looked at.
pub async fn authorize(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let source = request
        .extensions()
        .get::<super::serve::Peer>()
        .map(|p| p.0.ip());
    not_limited(&state, source)?;
    let caller = match bearer(request.headers()) {
        Some(token) => match state.tokens.authenticate(token).await {
            Ok(Ok(caller)) => caller,
            Ok(Err(refusal)) => {
                refused_token(&state, source, refusal);
                return Err(ApiError::Forbidden);
            }
            Err(e) => return Err(ApiError::from(crate::registry::RegistryError::from(e))),
        },
        None => match console_session(&state, &request) {
            Ok(name) => session_caller(&state, &name).await?,
            Err(e) => {
                if matches!(e, ApiError::Forbidden) {
                    failed(&state, source, crate::metrics::AUTH_SESSION);
                }
                return Err(e);
            }
        },
    };
    let route = request
        .extensions()
        .get::<MatchedPath>()
        .map(|m| m.as_str().trim_start_matches("/api/v1").to_string())
        .unwrap_or_default();
    if !roles::allows(caller.role, request.method(), &route) {
        state.metrics.auth_failed(crate::metrics::AUTH_NOT_ALLOWED);
        return Err(ApiError::Refused(format!(
            "the token {:?} has the role {}, which may not {} /api/v1{route}",
            caller.name,
            caller.role,
            request.method()
        )));
    }
    let name = caller.name.clone();
    request.extensions_mut().insert(caller);
    Ok(crate::audit::acting_as(name, next.run(request)).await)
}

/// Refuses a source that has failed too often of late (429 with when to come back).
/// Past the limit even good credentials wait: the limiter cannot tell a guess that
/// succeeded from a user's token.
pub fn not_limited(state: &AppState, source: Option<std::net::IpAddr>) -> Result<(), ApiError> {
    if let Some(ip) = source
        && let Err(wait) = state.auth_failures.check(ip, Instant::now())
    {
        state.metrics.auth_failed(crate::metrics::AUTH_RATE_LIMITED);
        return Err(ApiError::TooManyFailures(wait.as_secs().max(1)));
    }
    Ok(())
}

/// Counts a refused guess from `source`, in the metrics and against the source.
pub fn failed(state: &AppState, source: Option<std::net::IpAddr>, reason: &'static str) {
    state.metrics.auth_failed(reason);
    if let Some(ip) = source {
        state.auth_failures.failed(ip, Instant::now());
    }
}

/// Counts a refused bearer token: a revoked one in the metrics only, not against its
/// source (a job not yet told is not guessing); an unknown one as a guess.
pub fn refused_token(state: &AppState, source: Option<std::net::IpAddr>, refusal: Refusal) {
    match refusal {
        Refusal::Revoked => state.metrics.auth_failed(refusal.as_str()),
        Refusal::Unknown => failed(state, source, refusal.as_str()),
    }
}

/// The caller a console session names; 401 once its token is revoked (log in again).
pub async fn session_caller(state: &AppState, name: &str) -> Result<Caller, ApiError> {
    match state.tokens.caller_named(name).await {
        Ok(Ok(caller)) => Ok(caller),
        Ok(Err(_)) => Err(ApiError::Unauthorized),
        Err(e) => Err(ApiError::from(crate::registry::RegistryError::from(e))),
    }
}

/// A request from the console: a valid session cookie (the name of the token that logged
/// in); a write also needs the session's CSRF token in its header and, when the browser
/// names an Origin, our own.
fn console_session(state: &AppState, request: &Request) -> Result<String, ApiError> {
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
    let Some(name) = session::valid(&state.token, cookie, crate::clock::now_ms()) else {
        return Err(ApiError::Unauthorized);
    };
    if request.method().is_safe() {
        return Ok(name.to_string());
    }
    let csrf = headers
        .get(session::CSRF_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    if !session::csrf_matches(&state.token, cookie, csrf) || !same_origin(headers) {
        return Err(ApiError::Forbidden);
    }
    Ok(name.to_string())
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
