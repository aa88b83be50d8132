//! The admin API of rollouts: start, list, show, and pause, resume, abort or roll back.
//! Handlers extract, call `rollout::service`, map its errors.

use axum::extract::State;

use super::extract::{Json, Path};

use super::AppState;
use super::error::ApiError;
use crate::api::rollout::{Rollout, RolloutAction, RolloutRequest, RolloutSummary};
use crate::rollout::service::{AdminAction, RolloutError};

fn mapped(e: RolloutError) -> ApiError {
    match e {
        RolloutError::BadRequest(m) => ApiError::BadRequest(m),
        e @ RolloutError::NotFound(_) => ApiError::NotFound(e.to_string()),
        RolloutError::Conflict(m) => ApiError::Conflict(m),
        RolloutError::Registry(e) => e.into(),
        RolloutError::Store(e) => ApiError::Internal(e.to_string()),
    }
}

/// `POST /api/v1/rollouts`: 201 with the rollout.
#[utoipa::path(
    post, path = "/rollouts", tag = "rollouts",
    request_body = RolloutRequest,
    responses((status = 201, description = "Started", body = Rollout))
)]
pub async fn start(
    State(state): State<AppState>,
    Json(req): Json<RolloutRequest>,
) -> Result<(axum::http::StatusCode, Json<Rollout>), ApiError> {
    let r = state.rollouts.start(req).await.map_err(mapped)?;
    Ok((axum::http::StatusCode::CREATED, Json(r)))
}

/// `GET /api/v1/rollouts`, newest first.
#[utoipa::path(
    get, path = "/rollouts", tag = "rollouts",
    responses((status = 200, description = "Every rollout, newest first", body = Vec<RolloutSummary>))
)]
pub async fn list(State(state): State<AppState>) -> Result<Json<Vec<RolloutSummary>>, ApiError> {
    state.rollouts.list().await.map(Json).map_err(mapped)
}

/// `GET /api/v1/rollouts/{id}`.
#[utoipa::path(
    get, path = "/rollouts/{id}", tag = "rollouts",
    params(("id" = i64, Path)),
    responses((status = 200, description = "The rollout with its nodes and waves", body = Rollout))
)]
pub async fn show(
    State(state): State<AppState>,
    Path(id): Path<i64>,
) -> Result<Json<Rollout>, ApiError> {
    state.rollouts.show(id).await.map(Json).map_err(mapped)
}

/// `POST /api/v1/rollouts/{id}/{pause|resume|abort|rollback}`.
#[utoipa::path(
    post, path = "/rollouts/{id}/{action}", tag = "rollouts",
    params(("id" = i64, Path), ("action" = String, Path, description = "pause, resume, abort or rollback")),
    request_body = RolloutAction,
    responses((status = 200, description = "The rollout after the action", body = Rollout))
)]
pub async fn act(
    State(state): State<AppState>,
    Path((id, action)): Path<(i64, String)>,
    Json(req): Json<RolloutAction>,
) -> Result<Json<Rollout>, ApiError> {
    let action = AdminAction::parse(&action).ok_or_else(|| {
        ApiError::NotFound(format!(
            "no action {action:?}: pause, resume, abort or rollback"
        ))
    })?;
    state
        .rollouts
        .act(id, action, &req.reason)
        .await
        .map(Json)
        .map_err(mapped)
}
