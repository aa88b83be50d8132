//! axum's `Json`, `Query` and `Path` with their refusals as every other refusal of the
//! API: `{"error": "<reason>"}` with a 4xx, not axum's plain text (which the OpenAPI
//! document's error answer would not describe). Handlers use these, never axum's own.

use axum::extract::{FromRequest, FromRequestParts, Request};
use axum::http::StatusCode;
use axum::http::request::Parts;
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;

use super::error::ApiError;

/// A JSON body in, a JSON answer out.
pub struct Json<T>(pub T);

/// A query string, parsed into `T`.
pub struct Query<T>(pub T);

/// The route's path parameters, parsed into `T`.
pub struct Path<T>(pub T);

/// axum's refusal, kept by its status class: 415 stays 415 (no JSON content type), a
/// body too large stays 413, a fault of ours (a route without the parameter) is a 500,
/// and anything the client sent wrong is a 400 (axum's 422 for a body of the wrong
/// shape included: our own body checks answer 400 too).
fn refused(status: StatusCode, reason: String) -> ApiError {
    match status {
        StatusCode::UNSUPPORTED_MEDIA_TYPE => ApiError::UnsupportedMediaType(reason),
        StatusCode::PAYLOAD_TOO_LARGE => ApiError::TooLarge(reason),
        s if s.is_server_error() => ApiError::Internal(reason),
        _ => ApiError::BadRequest(reason),
    }
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for Json<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match axum::Json::<T>::from_request(req, state).await {
            Ok(axum::Json(value)) => Ok(Json(value)),
            Err(r) => Err(refused(r.status(), r.body_text())),
        }
    }
}

impl<T: Serialize> IntoResponse for Json<T> {
    fn into_response(self) -> Response {
        axum::Json(self.0).into_response()
    }
}

impl<S: Send + Sync, T: DeserializeOwned> FromRequestParts<S> for Query<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Query::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Query(value)) => Ok(Query(value)),
            Err(r) => Err(refused(r.status(), r.body_text())),
        }
    }
}

impl<S: Send + Sync, T: DeserializeOwned + Send> FromRequestParts<S> for Path<T> {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match axum::extract::Path::<T>::from_request_parts(parts, state).await {
            Ok(axum::extract::Path(value)) => Ok(Path(value)),
            Err(r) => Err(refused(r.status(), r.body_text())),
        }
    }
}
