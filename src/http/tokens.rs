//! The admin API of named tokens: create (the secret shown once), list, revoke. Only an
//! admin reaches these routes (`auth::roles`).

use axum::Extension;
use axum::extract::State;
use axum::http::StatusCode;

use super::AppState;
use super::error::ApiError;
use super::extract::{Json, Path};
use crate::api::token::{TokenCreated, TokenInfo, TokenList, TokenRequest};
use crate::auth::tokens::{Caller, ManageError};

fn mapped(e: ManageError) -> ApiError {
    match e {
        ManageError::BadRequest(m) => ApiError::BadRequest(m),
        ManageError::Conflict(m) => ApiError::Conflict(m),
        ManageError::NotFound(m) => ApiError::NotFound(m),
        ManageError::Store(e) => crate::registry::RegistryError::from(e).into(),
    }
}

/// `POST /api/v1/tokens`: 201 with the token's secret, which is never shown again.
#[utoipa::path(
    post, path = "/tokens", tag = "tokens",
    request_body = TokenRequest,
    responses(
        (status = 201, description = "Created: the secret is in this answer only", body = TokenCreated),
        (status = 409, description = "The name is taken (names are never reused)", body = crate::api::ErrorBody)
    )
)]
pub async fn create(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Json(req): Json<TokenRequest>,
) -> Result<(StatusCode, Json<TokenCreated>), ApiError> {
    let created = state.tokens.create(&req, &caller).await.map_err(mapped)?;
    Ok((StatusCode::CREATED, Json(created)))
}

/// `GET /api/v1/tokens`: every token by name, revoked ones too; never a secret.
#[utoipa::path(
    get, path = "/tokens", tag = "tokens",
    responses((status = 200, description = "Every token, by name", body = TokenList))
)]
pub async fn list(State(state): State<AppState>) -> Result<Json<TokenList>, ApiError> {
    let tokens = state
        .tokens
        .list()
        .await
        .map_err(|e| mapped(ManageError::Store(e)))?;
    Ok(Json(TokenList { tokens }))
}

/// `DELETE /api/v1/tokens/{name}`: revoked at once, on every server sharing the store.
#[utoipa::path(
    delete, path = "/tokens/{name}", tag = "tokens",
    params(("name" = String, Path, description = "The token's name")),
    responses((status = 200, description = "Revoked (or revoked already)", body = TokenInfo))
)]
pub async fn revoke(
    State(state): State<AppState>,
    Extension(caller): Extension<Caller>,
    Path(name): Path<String>,
) -> Result<Json<TokenInfo>, ApiError> {
    state
        .tokens
        .revoke(&name, &caller)
        .await
        .map(Json)
        .map_err(mapped)
}
