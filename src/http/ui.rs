//! The operator's console: one page and its script, served by the server itself (no
//! build step), and the login that turns the admin token into a session cookie. The
//! token is sent once, in a POST body; it never appears in a URL, and the script never
//! keeps it.

use super::extract::Json;
use axum::Extension;
use axum::extract::State;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::{Deserialize, Serialize};

use super::AppState;
use super::error::ApiError;
use crate::auth::session;

const INDEX: &str = include_str!("ui/index.html");
const SCRIPT: &str = include_str!("ui/app.js");
const STYLE: &str = include_str!("ui/style.css");

/// Only our own script and style; nothing inline, nothing framed.
const POLICY: &str = "default-src 'self'; script-src 'self'; style-src 'self'; \
    img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; \
    form-action 'self'";

fn asset(content_type: &'static str, body: &'static str) -> Response {
    let mut r = (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response();
    r.headers_mut().insert(
        header::CONTENT_SECURITY_POLICY,
        HeaderValue::from_static(POLICY),
    );
    r.headers_mut()
        .insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    r
}

pub async fn index() -> Response {
    asset("text/html; charset=utf-8", INDEX)
}

pub async fn script() -> Response {
    asset("text/javascript; charset=utf-8", SCRIPT)
}

pub async fn style() -> Response {
    asset("text/css; charset=utf-8", STYLE)
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Login {
    token: String,
}

/// What the script keeps: the CSRF token for its writes, and who it acts as.
#[derive(Serialize)]
pub struct SessionAnswer {
    csrf: String,
    /// The API token that logged in (`admin` for the admin token).
    name: String,
    role: crate::api::token::Role,
}

/// The session cookie; Secure when the console is reached over TLS, so a browser never
/// sends it to the plain boot listener (cookies do not tell ports or schemes apart).
fn cookie(value: &str, max_age_secs: i64, tls: bool) -> HeaderValue {
    let secure = if tls { "; Secure" } else { "" };
    HeaderValue::from_str(&format!(
        "{}={value}; HttpOnly; SameSite=Strict; Path=/; Max-Age={max_age_secs}{secure}",
        session::COOKIE
    ))
    .expect("a session value is ASCII")
}

/// `POST /ui/login` `{"token": ...}`: the admin token for a session cookie.
pub async fn login(
    State(state): State<AppState>,
    headers: HeaderMap,
    peer: Option<Extension<super::serve::Peer>>,
    tls: Option<Extension<super::serve::OverTls>>,
    Json(req): Json<Login>,
) -> Result<Response, ApiError> {
    if !super::auth::same_origin(&headers) {
        return Err(ApiError::Forbidden);
    }
    // Guesses at the admin token here count like the API's.
    let source = peer.map(|Extension(p)| p.0.ip());
    super::auth::not_limited(&state, source)?;
    let caller = match state.tokens.authenticate(req.token.trim()).await {
        Ok(Ok(caller)) => caller,
        Ok(Err(refusal)) => {
            tracing::warn!(
                security = true,
                reason = refusal.as_str(),
                "console login refused"
            );
            super::auth::refused_token(&state, source, refusal);
            return Err(ApiError::Forbidden);
        }
        Err(e) => return Err(ApiError::from(crate::registry::RegistryError::from(e))),
    };
    let expires_ms = crate::clock::now_ms() + session::LIFETIME_MS;
    let value = session::issue(&state.token, &caller.name, expires_ms);
    let csrf = session::csrf(&state.token, &value);
    let answer = SessionAnswer {
        csrf,
        name: caller.name,
        role: caller.role,
    };
    let mut r = Json(answer).into_response();
    r.headers_mut().insert(
        header::SET_COOKIE,
        cookie(&value, session::LIFETIME_MS / 1000, tls.is_some()),
    );
    Ok(r)
}

/// `GET /ui/session`: the CSRF token of the session the cookie carries (a reloaded page
/// asks again); 401 without a valid one.
pub async fn current(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Json<SessionAnswer>, ApiError> {
    let value = headers
        .get_all(header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find_map(session::from_header)
        .ok_or(ApiError::Unauthorized)?;
    let name = session::valid(&state.token, value, crate::clock::now_ms())
        .ok_or(ApiError::Unauthorized)?;
    let caller = super::auth::session_caller(&state, name).await?;
    Ok(Json(SessionAnswer {
        csrf: session::csrf(&state.token, value),
        name: caller.name,
        role: caller.role,
    }))
}

/// `POST /ui/logout`: the browser forgets the cookie. The session itself is signed, not
/// stored: it stays valid until it expires or the admin token changes.
pub async fn logout(tls: Option<Extension<super::serve::OverTls>>) -> Response {
    let mut r = StatusCode::NO_CONTENT.into_response();
    r.headers_mut()
        .insert(header::SET_COOKIE, cookie("", 0, tls.is_some()));
    r
}
