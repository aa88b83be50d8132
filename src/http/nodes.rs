//! Boot routes (open: nodes fetch them) and the admin node API.

use axum::Extension;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Deserialize;

use super::AppState;
use super::error::ApiError;
use super::extract::{Json, Path, Query};
use crate::api::Mac;
use crate::api::node::{AssignRequest, LabelRequest, Node, NodeDetail, NodeQuery, ReimageRequest};
use crate::node::boot_guard::Refusal;
use crate::node::service::BootError;
use crate::node::service::admin::AdminError;

/// The URL nodes reach us by: the one this request came to, over TLS if it came so.
fn server_url(
    headers: &HeaderMap,
    tls: Option<Extension<super::serve::OverTls>>,
    state: &AppState,
) -> String {
    let scheme = if tls.is_some() { "https" } else { "http" };
    match headers.get(header::HOST).and_then(|h| h.to_str().ok()) {
        Some(host) if !host.is_empty() && !host.contains(['/', ' ']) => {
            format!("{scheme}://{host}")
        }
        _ => state.fallback_url.clone(),
    }
}

fn script(text: String) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/plain; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
        ],
        text,
    )
        .into_response()
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::Internal(e.to_string())
}

#[utoipa::path(
    get, path = "/boot.ipxe", tag = "boot",
    security(()),
    responses((status = 200, description = "The iPXE script every node chains first: it fetches its own script by MAC", content_type = "text/plain", body = String))
)]
pub async fn entry(
    State(state): State<AppState>,
    headers: HeaderMap,
    tls: Option<Extension<super::serve::OverTls>>,
) -> Result<Response, ApiError> {
    Ok(script(
        state
            .nodes
            .entry(&server_url(&headers, tls, &state))
            .map_err(internal)?,
    ))
}

/// What iPXE sends of itself (`${mac:hexhyp}`, `${uuid}`).
#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ScriptQuery {
    mac: Option<String>,
    uuid: Option<String>,
}

#[utoipa::path(
    get, path = "/boot/node.ipxe", tag = "boot",
    security(()),
    params(ScriptQuery),
    responses((status = 200, description = "The node's iPXE script: its image, or a refusal that the node shows and retries", content_type = "text/plain", body = String))
)]
pub async fn node_script(
    State(state): State<AppState>,
    headers: HeaderMap,
    peer: Option<Extension<super::serve::Peer>>,
    tls: Option<Extension<super::serve::OverTls>>,
    Query(q): Query<ScriptQuery>,
) -> Result<Response, ApiError> {
    let mac: Mac = q
        .mac
        .as_deref()
        .ok_or_else(|| ApiError::BadRequest("mac is required (?mac=aa-bb-cc-dd-ee-ff)".into()))?
        .parse()
        .map_err(|e: crate::api::MacError| ApiError::BadRequest(e.to_string()))?;
    // iPXE sends an empty or all-zero UUID when the firmware has none; anything but the
    // 8-4-4-4-12 hex form is not a UUID either.
    let uuid = q
        .uuid
        .filter(|u| is_uuid(u))
        .and_then(|u| crate::node::controller::meaningful_uuid(Some(&u)));
    let from = peer.map(|Extension(p)| p.0.ip());
    match state
        .nodes
        .node_script(
            &server_url(&headers, tls, &state),
            &mac,
            uuid.as_deref(),
            from,
            crate::node::service::Loader::Ipxe,
        )
        .await
    {
        Ok(text) => Ok(script(text)),
        Err(BootError::Refused(refusal)) => Ok(refused(&refusal)),
        Err(e) => Err(internal(e)),
    }
}

/// A boot the guard refused: 403 (wrong address) or 429 with Retry-After. Not logged
/// here: the node service counts refusals, which unauthenticated clients can flood.
fn refused(refusal: &Refusal) -> Response {
    let error = refusal.to_string();
    let body = Json(crate::api::ErrorBody { error });
    match refusal {
        Refusal::Elsewhere { .. } => (StatusCode::FORBIDDEN, body).into_response(),
        Refusal::TooSoon {
            retry_after_secs, ..
        } => (
            StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, retry_after_secs.to_string())],
            body,
        )
            .into_response(),
    }
}

/// The 8-4-4-4-12 hex form firmware reports (SMBIOS system UUID).
fn is_uuid(u: &str) -> bool {
    u.len() == 36
        && u.char_indices().all(|(i, c)| match i {
            8 | 13 | 18 | 23 => c == '-',
            _ => c.is_ascii_hexdigit(),
        })
}

fn parse_mac(s: &str) -> Result<Mac, ApiError> {
    s.parse()
        .map_err(|e: crate::api::MacError| ApiError::BadRequest(e.to_string()))
}

fn admin_error(e: AdminError) -> ApiError {
    match e {
        AdminError::BadRequest(m) => ApiError::BadRequest(m),
        AdminError::NotFound(m) => ApiError::NotFound(m),
        AdminError::Conflict(m) => ApiError::Conflict(m),
        AdminError::Internal(m) => ApiError::Internal(m),
    }
}

/// `GET /api/v1/nodes?state=&image=&selector=`.
/// `GET /api/v1/fleet`: counts by state, image and label group; nodes that need a look.
#[utoipa::path(
    get, path = "/fleet", tag = "nodes",
    responses((status = 200, description = "Counts by state, image and label group, and the nodes that need a look", body = crate::api::node::FleetSummary))
)]
pub async fn fleet(
    State(state): State<AppState>,
) -> Result<Json<crate::api::node::FleetSummary>, ApiError> {
    let groups = &state.scrape.group_labels;
    state
        .nodes
        .fleet(groups)
        .await
        .map(Json)
        .map_err(admin_error)
}

/// The matching nodes (a page of them with `limit`/`offset`); `X-Total-Count` says how
/// many match in all.
#[utoipa::path(
    get, path = "/nodes", tag = "nodes",
    params(NodeQuery),
    responses((status = 200, description = "The matching nodes, by MAC", body = Vec<Node>, headers(("x-total-count" = u64, description = "How many nodes match in all"))))
)]
pub async fn list(
    State(state): State<AppState>,
    Query(q): Query<NodeQuery>,
) -> Result<([(&'static str, String); 1], Json<Vec<Node>>), ApiError> {
    let (page, total) = state.nodes.list(&q).await.map_err(admin_error)?;
    Ok(([("x-total-count", total.to_string())], Json(page)))
}

#[utoipa::path(
    get, path = "/nodes/{mac}", tag = "nodes",
    params(("mac" = Mac, Path, description = "The node's MAC address")),
    responses((status = 200, description = "The node with its state history, boots and last validation", body = NodeDetail))
)]
pub async fn show(
    State(state): State<AppState>,
    Path(mac): Path<String>,
) -> Result<Json<NodeDetail>, ApiError> {
    let mac = parse_mac(&mac)?;
    state.nodes.show(&mac).await.map(Json).map_err(admin_error)
}

/// `GET /api/v1/nodes/{mac}/health`: the current boot's readings and the verdicts that
/// hold, as this server heard them.
#[utoipa::path(
    get, path = "/nodes/{mac}/health", tag = "nodes",
    params(("mac" = Mac, Path, description = "The node's MAC address")),
    responses((status = 200, description = "The node's recent readings and health verdicts", body = crate::api::health::NodeHealth))
)]
pub async fn health(
    State(state): State<AppState>,
    Path(mac): Path<String>,
) -> Result<Json<crate::api::health::NodeHealth>, ApiError> {
    let mac = parse_mac(&mac)?;
    let health = state.nodes.health_of(&mac).await.map_err(admin_error)?;
    health.map(Json).ok_or_else(|| {
        ApiError::NotFound(format!(
            "no readings of {mac} on this server yet: its agent's heartbeats bring them"
        ))
    })
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct RemoveQuery {
    /// Remove even a node that runs a boot.
    #[serde(default)]
    force: bool,
    /// Recorded in the `node.removed` event.
    reason: Option<String>,
}

/// `DELETE /api/v1/nodes/{mac}?force=&reason=`: the removed node.
#[utoipa::path(
    delete, path = "/nodes/{mac}", tag = "nodes",
    params(("mac" = Mac, Path, description = "The node's MAC address"), RemoveQuery),
    responses((status = 200, description = "The removed node", body = Node))
)]
pub async fn remove(
    State(state): State<AppState>,
    Path(mac): Path<String>,
    Query(q): Query<RemoveQuery>,
) -> Result<Json<Node>, ApiError> {
    let mac = parse_mac(&mac)?;
    let reason = q.reason.unwrap_or_else(|| "removed by an admin".into());
    state
        .nodes
        .remove(&mac, &reason, q.force)
        .await
        .map(Json)
        .map_err(admin_error)
}

/// `GET /api/v1/nodes/{mac}/tpm`: the EK the node's TPM is enrolled with.
#[utoipa::path(
    get, path = "/nodes/{mac}/tpm", tag = "nodes",
    params(("mac" = Mac, Path, description = "The node's MAC address")),
    responses((status = 200, description = "The node's TPM enrolment", body = crate::api::node::TpmEnrolment))
)]
pub async fn tpm(
    State(state): State<AppState>,
    Path(mac): Path<String>,
) -> Result<Json<crate::api::node::TpmEnrolment>, ApiError> {
    let mac = parse_mac(&mac)?;
    state
        .nodes
        .tpm_enrolment(&mac)
        .await
        .map(Json)
        .map_err(admin_error)
}

/// `PUT /api/v1/nodes/{mac}/tpm`: registers the EK the node's TPM must present.
#[utoipa::path(
    put, path = "/nodes/{mac}/tpm", tag = "nodes",
    params(("mac" = Mac, Path, description = "The node's MAC address")),
    request_body = crate::api::node::TpmEnrolRequest,
    responses((status = 200, description = "The node's TPM enrolment", body = crate::api::node::TpmEnrolment))
)]
pub async fn enrol_tpm(
    State(state): State<AppState>,
    Path(mac): Path<String>,
    Json(req): Json<crate::api::node::TpmEnrolRequest>,
) -> Result<Json<crate::api::node::TpmEnrolment>, ApiError> {
    let mac = parse_mac(&mac)?;
    state
        .nodes
        .enrol_tpm(&mac, &req)
        .await
        .map(Json)
        .map_err(admin_error)
}

/// `DELETE /api/v1/nodes/{mac}/tpm`: forgets the node's EK (a new board).
#[utoipa::path(
    delete, path = "/nodes/{mac}/tpm", tag = "nodes",
    params(("mac" = Mac, Path, description = "The node's MAC address")),
    responses((status = 200, description = "The enrolment forgotten: the node's next TPM boot enrols again, or needs a registration", body = crate::api::node::TpmEnrolment))
)]
pub async fn forget_tpm(
    State(state): State<AppState>,
    Path(mac): Path<String>,
) -> Result<Json<crate::api::node::TpmEnrolment>, ApiError> {
    let mac = parse_mac(&mac)?;
    state
        .nodes
        .forget_tpm(&mac)
        .await
        .map(Json)
        .map_err(admin_error)
}

/// `PUT /api/v1/nodes/{mac}/image`.
#[utoipa::path(
    put, path = "/nodes/{mac}/image", tag = "nodes",
    params(("mac" = Mac, Path, description = "The node's MAC address")),
    request_body = AssignRequest,
    responses((status = 200, description = "The node with its new assignment, used from its next boot", body = Node))
)]
pub async fn assign(
    State(state): State<AppState>,
    Path(mac): Path<String>,
    Json(req): Json<AssignRequest>,
) -> Result<Json<Node>, ApiError> {
    let mac = parse_mac(&mac)?;
    state
        .nodes
        .assign(&mac, &req.image)
        .await
        .map(Json)
        .map_err(admin_error)
}

/// `PATCH /api/v1/nodes/{mac}/labels`.
#[utoipa::path(
    patch, path = "/nodes/{mac}/labels", tag = "nodes",
    params(("mac" = Mac, Path, description = "The node's MAC address")),
    request_body = LabelRequest,
    responses((status = 200, description = "The node with its labels changed", body = Node))
)]
pub async fn label(
    State(state): State<AppState>,
    Path(mac): Path<String>,
    Json(req): Json<LabelRequest>,
) -> Result<Json<Node>, ApiError> {
    let mac = parse_mac(&mac)?;
    state
        .nodes
        .label(&mac, &req)
        .await
        .map(Json)
        .map_err(admin_error)
}

/// `POST /api/v1/agent/attest`: authenticated by the boot token, not the admin token.
#[utoipa::path(
    post, path = "/api/v1/agent/attest", tag = "agent",
    security(("boot" = [])),
    request_body = crate::api::agent::AttestRequest,
    responses((status = 200, description = "The verdict: whether the node runs exactly what its boot fetched", body = crate::api::agent::Verdict))
)]
pub async fn attest(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Json<crate::api::agent::Verdict>, ApiError> {
    let (caller, req) = agent_request::<crate::api::agent::AttestRequest>(
        &state,
        &headers,
        body,
        "attestation report",
    )
    .await?;
    state
        .nodes
        .attest(&caller, &req)
        .await
        .map(Json)
        .map_err(agent_error)
}

/// `POST /api/v1/agent/tpm/challenge`: the node's TPM keys for a credential that only
/// the enrolled TPM can open (boot token). Refused (403) when the EK is not the one the
/// node is enrolled with, its certificate does not chain to a configured EK CA, or the
/// keys are not an EK's and an AK's; 409 when the node's TPM policy is off.
#[utoipa::path(
    post, path = "/api/v1/agent/tpm/challenge", tag = "agent",
    security(("boot" = [])),
    request_body = crate::api::agent::TpmChallengeRequest,
    responses((status = 200, description = "The credential and the PCRs to quote", body = crate::api::agent::TpmChallengeAnswer))
)]
pub async fn tpm_challenge(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Json<crate::api::agent::TpmChallengeAnswer>, ApiError> {
    let (caller, req) = agent_request::<crate::api::agent::TpmChallengeRequest>(
        &state,
        &headers,
        body,
        "TPM challenge request",
    )
    .await?;
    state
        .nodes
        .tpm_challenge(&caller, &req)
        .await
        .map(Json)
        .map_err(agent_error)
}

/// The most an agent call's body may be: a validation report of a few dozen GPUs is a
/// few KiB. Bounds what any caller costs in memory, whatever it sends.
pub const AGENT_BODY_LIMIT: usize = 256 * 1024;

/// An agent call's caller and body. The token first, from the header alone: an
/// unauthenticated caller gets nothing read of its body and learns nothing, not even
/// parse errors.
async fn agent_request<R: serde::de::DeserializeOwned>(
    state: &AppState,
    headers: &HeaderMap,
    body: axum::body::Body,
    what: &str,
) -> Result<(crate::node::service::attest::Caller, R), ApiError> {
    let token = boot_token(headers)?;
    let caller = state.nodes.caller(token).await.map_err(agent_error)?;
    let bytes = super::body::read_limited(body, AGENT_BODY_LIMIT, what).await?;
    let req =
        serde_json::from_slice(&bytes).map_err(|e| ApiError::BadRequest(format!("{what}: {e}")))?;
    Ok((caller, req))
}

fn boot_token(headers: &HeaderMap) -> Result<&str, ApiError> {
    super::auth::bearer(headers).ok_or(ApiError::Unauthorized)
}

fn agent_error(e: crate::node::service::attest::AttestError) -> ApiError {
    use crate::node::service::attest::{AttestError, Refusal};
    match e {
        AttestError::Refused(r @ Refusal::NotAttested) => ApiError::Conflict(r.to_string()),
        AttestError::Refused(r) => ApiError::Refused(r.to_string()),
        AttestError::NotNow(why) => ApiError::Conflict(why),
        AttestError::Boot(e) => internal(e),
    }
}

/// `GET /boot/overlay`: a two-stage boot's per-node files, for stage 1 (boot token).
#[utoipa::path(
    get, path = "/boot/overlay", tag = "boot",
    security(("boot" = [])),
    responses((status = 200, description = "A two-stage boot's per-node files, as a tar archive", content_type = "application/x-tar", body = Vec<u8>))
)]
pub async fn overlay(
    State(state): State<AppState>,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let caller = state
        .nodes
        .caller(boot_token(&headers)?)
        .await
        .map_err(agent_error)?;
    let tar = state.nodes.overlay(&caller).await.map_err(agent_error)?;
    Ok((
        [(axum::http::header::CONTENT_TYPE, "application/x-tar")],
        tar,
    )
        .into_response())
}

/// `POST /api/v1/agent/heartbeat`: the answer carries the node's next action.
#[utoipa::path(
    post, path = "/api/v1/agent/heartbeat", tag = "agent",
    security(("boot" = [])),
    request_body = crate::api::agent::HeartbeatRequest,
    responses((status = 200, description = "The node's next action", body = crate::api::agent::HeartbeatAnswer))
)]
pub async fn heartbeat(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Json<crate::api::agent::HeartbeatAnswer>, ApiError> {
    let (caller, req) =
        agent_request::<crate::api::agent::HeartbeatRequest>(&state, &headers, body, "heartbeat")
            .await?;
    state
        .nodes
        .heartbeat(&caller, &req)
        .await
        .map(Json)
        .map_err(agent_error)
}

/// `POST /api/v1/nodes/{mac}/reimage`. Over the disruption budget the answer is 429 with
/// `Retry-After` (refused, not queued: the caller, often a fleet controller, retries and
/// stays in charge). The same `Idempotency-Key` gets the first answer again.
#[utoipa::path(
    post, path = "/nodes/{mac}/reimage", tag = "nodes",
    params(("mac" = Mac, Path, description = "The node's MAC address"), ("idempotency-key" = Option<String>, Header, description = "The same key gets the first answer again")),
    request_body = ReimageRequest,
    responses((status = 202, description = "Accepted: the node reboots into a new boot", body = crate::api::node::ReimageAccepted), (status = 429, description = "Over the disruption budget: refused, not queued; retry after `Retry-After`", body = crate::api::ErrorBody, headers(("retry-after" = u64, description = "Seconds to wait"))))
)]
pub async fn reimage(
    State(state): State<AppState>,
    Extension(caller): Extension<crate::auth::tokens::Caller>,
    Path(mac): Path<String>,
    headers: HeaderMap,
    Json(req): Json<ReimageRequest>,
) -> Result<Response, ApiError> {
    use crate::node::reimage::ReimageError;
    let mac = parse_mac(&mac)?;
    // Choosing what a node runs is an operator's call; a fleet controller repairs a
    // node with the image it is assigned.
    if caller.role == crate::api::token::Role::FleetController && req.image.is_some() {
        return Err(ApiError::Refused(format!(
            "the token {:?} (fleet-controller) reimages into the node's assigned image only: leave out \"image\"",
            caller.name
        )));
    }
    let key = headers.get("idempotency-key").and_then(|v| v.to_str().ok());
    match state
        .nodes
        .reimage
        .request(&mac, &req.reason, req.image.as_deref(), key)
        .await
    {
        Ok(body) => Ok((
            axum::http::StatusCode::ACCEPTED,
            [(header::CONTENT_TYPE, "application/json")],
            body,
        )
            .into_response()),
        Err(e @ ReimageError::OverBudget(_)) => Ok((
            axum::http::StatusCode::TOO_MANY_REQUESTS,
            [(header::RETRY_AFTER, "60")],
            Json(crate::api::ErrorBody {
                error: e.to_string(),
            }),
        )
            .into_response()),
        Err(e @ ReimageError::BadRequest(_)) => Err(ApiError::BadRequest(e.to_string())),
        Err(e @ ReimageError::UnknownNode(_)) => Err(ApiError::NotFound(e.to_string())),
        Err(e @ ReimageError::Conflict(_)) => Err(ApiError::Conflict(e.to_string())),
        Err(ReimageError::Registry(e)) => Err(e.into()),
        Err(ReimageError::Store(e)) => Err(internal(e)),
    }
}

/// `POST /api/v1/nodes/{mac}/revalidate`: the node's next heartbeat answers "revalidate".
#[utoipa::path(
    post, path = "/nodes/{mac}/revalidate", tag = "nodes",
    params(("mac" = Mac, Path, description = "The node's MAC address")),
    responses((status = 202, description = "The node's next heartbeat answers revalidate", body = crate::api::node::RevalidateAccepted))
)]
pub async fn revalidate(
    State(state): State<AppState>,
    Path(mac): Path<String>,
) -> Result<Response, ApiError> {
    let mac = parse_mac(&mac)?;
    let answer = state.nodes.revalidate(&mac).await.map_err(admin_error)?;
    Ok((axum::http::StatusCode::ACCEPTED, Json(answer)).into_response())
}

/// `POST /api/v1/agent/validate`: the post-boot validation report, by boot token.
#[utoipa::path(
    post, path = "/api/v1/agent/validate", tag = "agent",
    security(("boot" = [])),
    request_body = crate::api::agent::ValidateRequest,
    responses((status = 200, description = "The server's judgement of the validation report", body = crate::api::agent::ValidationVerdict))
)]
pub async fn validate(
    State(state): State<AppState>,
    headers: HeaderMap,
    body: axum::body::Body,
) -> Result<Json<crate::api::agent::ValidationVerdict>, ApiError> {
    let (caller, req) = agent_request::<crate::api::agent::ValidateRequest>(
        &state,
        &headers,
        body,
        "validation report",
    )
    .await?;
    state
        .nodes
        .validate(&caller, &req)
        .await
        .map(Json)
        .map_err(agent_error)
}
