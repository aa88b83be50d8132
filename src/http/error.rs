//! The one place where errors become HTTP statuses: `{"error": "<reason>"}` bodies.

use axum::Json;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};

use crate::image::bundle::BundleError;
use crate::image::objects::ObjectError;
use crate::registry::RegistryError;

#[derive(Debug, thiserror::Error)]
pub enum ApiError {
    #[error("{0}")]
    BadRequest(String),
    #[error("missing bearer token: send `Authorization: Bearer <admin token>`")]
    Unauthorized,
    #[error("the bearer token is not valid for this server")]
    Forbidden,
    /// Authenticated, but not allowed: a 403 with its reason.
    #[error("{0}")]
    Refused(String),
    #[error("{0}")]
    NotFound(String),
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    TooLarge(String),
    /// A body without the content type the route reads (JSON): 415.
    #[error("{0}")]
    UnsupportedMediaType(String),
    #[error("internal error: {0}")]
    Internal(String),
    /// The disk cannot take what was sent: 507.
    #[error("{0}")]
    InsufficientStorage(String),
    /// A dependency (the object store) is unreachable or handed back damaged bytes:
    /// 503 with Retry-After, so the client tries again or elsewhere.
    #[error("{0}")]
    Unavailable(String),
    /// Something we called on the client's behalf (a node's BMC) failed: 502.
    #[error("{0}")]
    BadGateway(String),
    /// Over a limit that lifts with time (the disruption budget): 429 with Retry-After.
    #[error("{0}")]
    TooMany(String),
    /// This source failed to authenticate too often: 429, retry after these seconds.
    #[error("too many failed authentications from this address: retry in {0} s")]
    TooManyFailures(u64),
}

impl From<RegistryError> for ApiError {
    fn from(e: RegistryError) -> Self {
        match e {
            RegistryError::Bundle(
                BundleError::TooLarge { .. }
                | BundleError::TooManyEntries(_)
                | BundleError::BundleTooLarge(_),
            ) => ApiError::TooLarge(e.to_string()),
            RegistryError::Bundle(BundleError::NoSpace { .. }) => {
                ApiError::InsufficientStorage(e.to_string())
            }
            RegistryError::Bundle(BundleError::Storage(_)) => ApiError::Internal(e.to_string()),
            RegistryError::Bundle(b) => ApiError::BadRequest(format!("bundle refused: {b}")),
            RegistryError::Import(i) => {
                use crate::image::import::ImportError;
                use crate::image::oci::OciError;
                match i {
                    ImportError::Oci(OciError::Unreachable(m)) => ApiError::BadGateway(m),
                    ImportError::Io(_) | ImportError::Oci(OciError::Io(_)) => {
                        ApiError::Internal(format!("import failed: {i}"))
                    }
                    refused => ApiError::BadRequest(format!("import refused: {refused}")),
                }
            }
            RegistryError::Conflict(m) => ApiError::Conflict(m),
            RegistryError::NotFound(m) => ApiError::NotFound(m),
            RegistryError::Invalid(m) => ApiError::BadRequest(m),
            RegistryError::Store(_) | RegistryError::Io(_) => ApiError::Internal(e.to_string()),
            RegistryError::Objects(o) => match o {
                ObjectError::Missing(_) => ApiError::NotFound(o.to_string()),
                ObjectError::Unreachable(_) | ObjectError::Damaged { .. } => {
                    ApiError::Unavailable(o.to_string())
                }
                _ => ApiError::Internal(o.to_string()),
            },
        }
    }
}

/// The most of an error's text that goes into a response or a log line. Errors can quote
/// what a client sent (a bundle's entry name, a parse error's context); a client must
/// not be able to make either as large as it likes.
pub const ERROR_TEXT_LIMIT: usize = 2048;

/// Retry-After, in seconds, when the store's write queue is full. iPXE honours a 503's
/// Retry-After by itself (its HTTP core waits and fetches again); the agent adds jitter.
pub const BUSY_RETRY_AFTER: &str = "1";

fn capped(mut text: String) -> String {
    if text.len() > ERROR_TEXT_LIMIT {
        let mut end = ERROR_TEXT_LIMIT;
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        text.truncate(end);
        text.push_str("... (cut)");
    }
    text
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = match &self {
            ApiError::BadRequest(_) => StatusCode::BAD_REQUEST,
            ApiError::Unauthorized => StatusCode::UNAUTHORIZED,
            ApiError::Forbidden | ApiError::Refused(_) => StatusCode::FORBIDDEN,
            ApiError::NotFound(_) => StatusCode::NOT_FOUND,
            ApiError::Conflict(_) => StatusCode::CONFLICT,
            ApiError::TooLarge(_) => StatusCode::PAYLOAD_TOO_LARGE,
            ApiError::UnsupportedMediaType(_) => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            // Errors cross the services as text; an unreachable store's keeps its
            // prefix, so that clients (and load balancers) retry another server.
            ApiError::Internal(m)
                if m.contains(crate::registry::STORE_UNAVAILABLE)
                    || m.contains(crate::registry::STORE_BUSY) =>
            {
                StatusCode::SERVICE_UNAVAILABLE
            }
            ApiError::Internal(_) => StatusCode::INTERNAL_SERVER_ERROR,
            ApiError::Unavailable(_) => StatusCode::SERVICE_UNAVAILABLE,
            ApiError::InsufficientStorage(_) => StatusCode::INSUFFICIENT_STORAGE,
            ApiError::BadGateway(_) => StatusCode::BAD_GATEWAY,
            ApiError::TooMany(_) | ApiError::TooManyFailures(_) => StatusCode::TOO_MANY_REQUESTS,
        };
        let error = capped(self.to_string());
        // Too many writers queued: a short wait, as the queue drains in milliseconds.
        let busy = error.contains(crate::registry::STORE_BUSY);
        if status.is_server_error() {
            tracing::error!(error, "request failed");
        } else {
            tracing::info!(status = status.as_u16(), error, "request refused");
        }
        let mut response = (status, Json(crate::api::ErrorBody { error })).into_response();
        if status == StatusCode::SERVICE_UNAVAILABLE {
            let after = if busy { BUSY_RETRY_AFTER } else { "5" };
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static(after));
        }
        if let ApiError::TooManyFailures(secs) = self {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, secs.into());
        } else if status == StatusCode::TOO_MANY_REQUESTS {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("60"));
        }
        if status == StatusCode::UNAUTHORIZED {
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        response
    }
}
