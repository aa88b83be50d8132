//! Request bodies read whole, up to a limit: past it the answer is 413, not an allocation.

use axum::body::{Body, Bytes};

use super::error::ApiError;

/// Reads `body` into memory, refusing it with 413 once it passes `limit` bytes (without
/// reading the rest). A body that stalls past `[http] body_timeout_secs` or breaks off is
/// a 400.
pub async fn read_limited(body: Body, limit: usize, what: &str) -> Result<Bytes, ApiError> {
    axum::body::to_bytes(body, limit).await.map_err(|e| {
        let too_large = std::error::Error::source(&e)
            .is_some_and(|s| s.is::<http_body_util::LengthLimitError>());
        if too_large {
            ApiError::TooLarge(format!("{what}: larger than {limit} bytes"))
        } else {
            ApiError::BadRequest(format!("{what}: cannot read the body: {e}"))
        }
    })
}
