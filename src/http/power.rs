//! The admin API of power control: a node's BMC settings, its power status, and power
//! actions. Handlers extract, call `power::service`, map its errors.

use axum::Json;
use axum::extract::{Path, State};

use super::AppState;
use super::error::ApiError;
use crate::api::node::{Bmc, Node};
use crate::api::power::{
    BmcRegistration, PowerDone, PowerRequest, PowerStatus, RegisteredPowerDone,
};
use crate::node::reimage::ReimageError;
use crate::power::service::ActionError;

fn mac(s: &str) -> Result<crate::api::Mac, ApiError> {
    s.parse()
        .map_err(|e: crate::api::MacError| ApiError::BadRequest(e.to_string()))
}

fn mapped(e: ActionError) -> ApiError {
    match e {
        ActionError::BadRequest(m) => ApiError::BadRequest(m),
        e @ ActionError::UnknownNode(_) => ApiError::NotFound(e.to_string()),
        e @ ActionError::UnknownRegistration(_) => ApiError::NotFound(e.to_string()),
        e @ ActionError::NoBmc(_) => ApiError::Conflict(e.to_string()),
        ActionError::Bmc(e) => ApiError::BadGateway(e.to_string()),
        ActionError::Reimage(e @ ReimageError::OverBudget(_)) => ApiError::TooMany(e.to_string()),
        ActionError::Reimage(e @ ReimageError::Conflict(_)) => ApiError::Conflict(e.to_string()),
        ActionError::Reimage(e @ ReimageError::UnknownNode(_)) => ApiError::NotFound(e.to_string()),
        ActionError::Reimage(e) => ApiError::Internal(e.to_string()),
        ActionError::Store(e) => ApiError::Internal(e.to_string()),
    }
}

/// `PUT /api/v1/nodes/{mac}/bmc`.
pub async fn set_bmc(
    State(state): State<AppState>,
    Path(m): Path<String>,
    Json(bmc): Json<Bmc>,
) -> Result<Json<Node>, ApiError> {
    let mac = mac(&m)?;
    state
        .power
        .set_bmc(&mac, Some(&bmc))
        .await
        .map(Json)
        .map_err(mapped)
}

/// `DELETE /api/v1/nodes/{mac}/bmc`.
pub async fn clear_bmc(
    State(state): State<AppState>,
    Path(m): Path<String>,
) -> Result<Json<Node>, ApiError> {
    let mac = mac(&m)?;
    state
        .power
        .set_bmc(&mac, None)
        .await
        .map(Json)
        .map_err(mapped)
}

/// `GET /api/v1/nodes/{mac}/power`: what the BMC says, now.
pub async fn status(
    State(state): State<AppState>,
    Path(m): Path<String>,
) -> Result<Json<PowerStatus>, ApiError> {
    let mac = mac(&m)?;
    state.power.status(&mac).await.map(Json).map_err(mapped)
}

/// `POST /api/v1/nodes/{mac}/power`: carried out before the answer.
pub async fn act(
    State(state): State<AppState>,
    Path(m): Path<String>,
    Json(req): Json<PowerRequest>,
) -> Result<Json<PowerDone>, ApiError> {
    let mac = mac(&m)?;
    state
        .power
        .act(&mac, req.action, &req.reason, req.netboot)
        .await
        .map(Json)
        .map_err(mapped)
}

/// `POST /api/v1/bmcs`: a machine known only by its BMC.
pub async fn register(
    State(state): State<AppState>,
    Json(bmc): Json<Bmc>,
) -> Result<(axum::http::StatusCode, Json<BmcRegistration>), ApiError> {
    let r = state.power.register(&bmc).await.map_err(mapped)?;
    Ok((axum::http::StatusCode::CREATED, Json(r)))
}

/// `GET /api/v1/bmcs`: the machines registered by their BMC and not matched yet.
pub async fn registrations(
    State(state): State<AppState>,
) -> Result<Json<Vec<BmcRegistration>>, ApiError> {
    state.power.registrations().await.map(Json).map_err(mapped)
}

/// `DELETE /api/v1/bmcs/{id}`: answers `{"removed": id}`.
pub async fn unregister(
    State(state): State<AppState>,
    Path(id): Path<i64>,
) -> Result<Json<serde_json::Value>, ApiError> {
    state.power.unregister(id).await.map_err(mapped)?;
    Ok(Json(serde_json::json!({ "removed": id })))
}

/// `POST /api/v1/bmcs/{id}/power`.
pub async fn act_registered(
    State(state): State<AppState>,
    Path(id): Path<i64>,
    Json(req): Json<PowerRequest>,
) -> Result<Json<RegisteredPowerDone>, ApiError> {
    state
        .power
        .act_registered(id, req.action, &req.reason)
        .await
        .map(Json)
        .map_err(mapped)
}
