//! The admin API of power control: a node's BMC settings, its power status, and power
//! actions. Handlers extract, call `power::service`, map its errors.

use axum::extract::State;

use super::extract::{Json, Path};

use super::AppState;
use super::error::ApiError;
use crate::api::node::{Bmc, Node};
use crate::api::power::{
    BmcRegistration, BmcRemoved, PowerDone, PowerRequest, PowerStatus, RegisteredPowerDone,
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
#[utoipa::path(
    put, path = "/nodes/{mac}/bmc", tag = "power",
    params(("mac" = crate::api::Mac, Path, description = "The node's MAC address")),
    request_body = Bmc,
    responses((status = 200, description = "The node with its BMC", body = Node))
)]
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
#[utoipa::path(
    delete, path = "/nodes/{mac}/bmc", tag = "power",
    params(("mac" = crate::api::Mac, Path, description = "The node's MAC address")),
    responses((status = 200, description = "The node without a BMC", body = Node))
)]
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
#[utoipa::path(
    get, path = "/nodes/{mac}/power", tag = "power",
    params(("mac" = crate::api::Mac, Path, description = "The node's MAC address")),
    responses((status = 200, description = "What the BMC says, now", body = PowerStatus))
)]
pub async fn status(
    State(state): State<AppState>,
    Path(m): Path<String>,
) -> Result<Json<PowerStatus>, ApiError> {
    let mac = mac(&m)?;
    state.power.status(&mac).await.map(Json).map_err(mapped)
}

/// `POST /api/v1/nodes/{mac}/power`: carried out before the answer.
#[utoipa::path(
    post, path = "/nodes/{mac}/power", tag = "power",
    params(("mac" = crate::api::Mac, Path, description = "The node's MAC address")),
    request_body = PowerRequest,
    responses((status = 200, description = "Carried out", body = PowerDone))
)]
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
#[utoipa::path(
    post, path = "/bmcs", tag = "power",
    request_body = Bmc,
    responses((status = 201, description = "Registered: a machine known only by its BMC", body = BmcRegistration))
)]
pub async fn register(
    State(state): State<AppState>,
    Json(bmc): Json<Bmc>,
) -> Result<(axum::http::StatusCode, Json<BmcRegistration>), ApiError> {
    let r = state.power.register(&bmc).await.map_err(mapped)?;
    Ok((axum::http::StatusCode::CREATED, Json(r)))
}

/// `GET /api/v1/bmcs`: the machines registered by their BMC and not matched yet.
#[utoipa::path(
    get, path = "/bmcs", tag = "power",
    responses((status = 200, description = "Machines registered by their BMC and not matched to a node yet", body = Vec<BmcRegistration>))
)]
pub async fn registrations(
    State(state): State<AppState>,
) -> Result<Json<Vec<BmcRegistration>>, ApiError> {
    state.power.registrations().await.map(Json).map_err(mapped)
}

/// `DELETE /api/v1/bmcs/{id}`.
#[utoipa::path(
    delete, path = "/bmcs/{id}", tag = "power",
    params(("id" = i64, Path)),
    responses((status = 200, description = "`{\"removed\": id}`", body = BmcRemoved))
)]
pub async fn unregister(
    State(state): State<AppState>,
    Path(id): Path<i64>,
) -> Result<Json<BmcRemoved>, ApiError> {
    state.power.unregister(id).await.map_err(mapped)?;
    Ok(Json(BmcRemoved { removed: id }))
}

/// `POST /api/v1/bmcs/{id}/power`.
#[utoipa::path(
    post, path = "/bmcs/{id}/power", tag = "power",
    params(("id" = i64, Path)),
    request_body = PowerRequest,
    responses((status = 200, description = "Carried out", body = RegisteredPowerDone))
)]
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
