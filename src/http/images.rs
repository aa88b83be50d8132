//! Admin API for images and tags: extract, call the registry, map errors.

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::TryStreamExt;
use serde::Deserialize;
use tokio_util::io::{StreamReader, SyncIoBridge};

use super::AppState;
use super::error::ApiError;
use super::extract::{Json, Path, Query};
use crate::api::image::{Image, ImageDetail, TagRequest};
use crate::api::refs::{ImageRef, TagName};
use crate::auth::tokens::Caller;

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct PublishQuery {
    /// A tag to point at the image once published (`name:tag`).
    tag: Option<String>,
}

/// Who moved a tag, for its history: the token's name, which the gate checked, then
/// who the client says is at the keyboard (`X-Bootfleet-Actor`, unchecked) in brackets.
fn actor(caller: &Caller, headers: &HeaderMap) -> String {
    headers
        .get("x-bootfleet-actor")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim())
        .filter(|s| !s.is_empty() && s.len() <= 128 && s.chars().all(|c| c.is_ascii_graphic()))
        .map(|s| format!("{} ({s})", caller.name))
        .unwrap_or_else(|| caller.name.clone())
}

fn bad_request(e: impl ToString) -> ApiError {
    ApiError::BadRequest(e.to_string())
}

#[utoipa::path(
    post, path = "/images", tag = "images",
    params(PublishQuery, ("x-bootfleet-actor" = Option<String>, Header, description = "Who publishes, for the tag history")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "A bundle: a tar (plain, gzip or zstd) of manifest.json and the artifacts it names; any content type"),
    responses((status = 201, description = "Published", body = crate::api::image::PublishOutcome), (status = 200, description = "Already published: nothing changed", body = crate::api::image::PublishOutcome))
)]
pub async fn publish(
    State(state): State<AppState>,
    axum::Extension(caller): axum::Extension<Caller>,
    Query(q): Query<PublishQuery>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let tag = q
        .tag
        .as_deref()
        .map(TagName::parse)
        .transpose()
        .map_err(bad_request)?;
    let stream = body.into_data_stream().map_err(std::io::Error::other);
    let reader = SyncIoBridge::new(StreamReader::new(stream));
    let registry = state.registry.clone();
    let actor = actor(&caller, &headers);
    // Run to completion even if the client goes away after the upload: a publish that
    // got all its bytes finishes (or is refused) whole. The tracker joins it at shutdown.
    let outcome = state
        .tasks
        .spawn(crate::audit::acting_as(caller.name, async move {
            registry.publish(reader, tag, &actor).await
        }))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))??;
    let status = if outcome.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(outcome)).into_response())
}

#[utoipa::path(
    get, path = "/images", tag = "images",
    responses((status = 200, description = "Every published image", body = Vec<Image>))
)]
pub async fn list(State(state): State<AppState>) -> Result<Json<Vec<Image>>, ApiError> {
    Ok(Json(state.registry.list().await?))
}

#[utoipa::path(
    get, path = "/images/{reference}", tag = "images",
    params(("reference" = String, Path, description = "A digest (`sha256:` and at least 8 of its first hex digits), name:version or name:tag", pattern = "^(sha256:[0-9a-f]{8,64}|[a-z0-9][a-z0-9._-]{0,127}:[A-Za-z0-9][A-Za-z0-9._+-]{0,127})$")),
    responses((status = 200, description = "The image and its manifest", body = ImageDetail))
)]
pub async fn show(
    State(state): State<AppState>,
    Path(r): Path<String>,
) -> Result<Json<ImageDetail>, ApiError> {
    let r = ImageRef::parse(&r).map_err(bad_request)?;
    let (image, manifest) = state.registry.show(&r).await?;
    Ok(Json(ImageDetail { image, manifest }))
}

#[utoipa::path(
    put, path = "/tags/{name}/{tag}", tag = "images",
    params(("name" = String, Path, description = "The image name", pattern = "^[a-z0-9][a-z0-9._-]{0,127}$"), ("tag" = String, Path, pattern = "^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$"), ("x-bootfleet-actor" = Option<String>, Header, description = "Who moves the tag, for its history")),
    request_body = TagRequest,
    responses((status = 200, description = "The tag and what it pointed at before", body = crate::api::image::TagResult))
)]
pub async fn put_tag(
    State(state): State<AppState>,
    axum::Extension(caller): axum::Extension<Caller>,
    Path((name, tag)): Path<(String, String)>,
    headers: HeaderMap,
    Json(req): Json<TagRequest>,
) -> Result<Response, ApiError> {
    let tag = TagName::parse(&format!("{name}:{tag}")).map_err(bad_request)?;
    let r = ImageRef::parse(&req.image).map_err(bad_request)?;
    let digest = state.registry.resolve(&r).await?;
    let result = state
        .registry
        .tag(&tag, &digest, &actor(&caller, &headers))
        .await?;
    Ok(Json(result).into_response())
}

#[utoipa::path(
    get, path = "/tags/{name}/{tag}/history", tag = "images",
    params(("name" = String, Path, description = "The image name", pattern = "^[a-z0-9][a-z0-9._-]{0,127}$"), ("tag" = String, Path, pattern = "^[A-Za-z0-9][A-Za-z0-9._+-]{0,127}$")),
    responses((status = 200, description = "Every move of the tag, newest first", body = Vec<crate::api::image::TagMove>))
)]
pub async fn tag_history(
    State(state): State<AppState>,
    Path((name, tag)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let tag = TagName::parse(&format!("{name}:{tag}")).map_err(bad_request)?;
    Ok(Json(state.registry.tag_history(&tag).await?).into_response())
}

#[utoipa::path(
    get, path = "/tags", tag = "images",
    responses((status = 200, description = "Every tag and the image it names", body = Vec<crate::api::image::Tag>))
)]
pub async fn list_tags(State(state): State<AppState>) -> Result<Response, ApiError> {
    Ok(Json(state.registry.list_tags().await?).into_response())
}

#[utoipa::path(
    post, path = "/blobs/verify", tag = "images",
    responses((status = 200, description = "Every blob re-hashed: what was quarantined or is missing", body = crate::api::image::VerifyReport))
)]
pub async fn verify(State(state): State<AppState>) -> Result<Response, ApiError> {
    Ok(Json(state.registry.verify().await?).into_response())
}

#[utoipa::path(
    post, path = "/blobs/gc", tag = "images",
    responses((status = 200, description = "Blobs that no image names, removed", body = crate::api::image::GcReport))
)]
pub async fn gc(State(state): State<AppState>) -> Result<Response, ApiError> {
    Ok(Json(state.registry.gc().await?).into_response())
}

/// `DELETE /api/v1/images/{reference}`: the removed image; 409 naming what uses it.
#[utoipa::path(
    delete, path = "/images/{reference}", tag = "images",
    params(("reference" = String, Path, description = "A digest (`sha256:` and at least 8 of its first hex digits), name:version or name:tag", pattern = "^(sha256:[0-9a-f]{8,64}|[a-z0-9][a-z0-9._-]{0,127}:[A-Za-z0-9][A-Za-z0-9._+-]{0,127})$")),
    responses((status = 200, description = "The removed image", body = Image), (status = 409, description = "Nodes or tags use the image: named in the reason", body = crate::api::ErrorBody))
)]
pub async fn remove(
    State(state): State<AppState>,
    Path(r): Path<String>,
) -> Result<Response, ApiError> {
    let r = ImageRef::parse(&r).map_err(bad_request)?;
    let runs = |s| !crate::node::state::removable(s);
    Ok(Json(state.registry.remove(&r, runs).await?).into_response())
}

#[derive(Deserialize, utoipa::IntoParams)]
#[into_params(parameter_in = Query)]
pub struct ImportQuery {
    /// The `ImportRequest` as JSON, when the body is the archive.
    spec: Option<String>,
}

/// `POST /api/v1/images/import`: a registry pull (JSON body) or an uploaded archive
/// (`?spec=` JSON, the archive as the body).
#[utoipa::path(
    post, path = "/images/import", tag = "images",
    params(ImportQuery, ("x-bootfleet-actor" = Option<String>, Header, description = "Who imports, for the tag history")),
    request_body(content = crate::api::image::ImportRequest, description = "A registry pull; or, with `?spec=`, an OCI or Docker archive as the body"),
    responses((status = 201, description = "Imported and published", body = crate::api::image::ImportOutcome), (status = 200, description = "Already published: nothing changed", body = crate::api::image::ImportOutcome))
)]
pub async fn import(
    State(state): State<AppState>,
    axum::Extension(caller): axum::Extension<Caller>,
    Query(q): Query<ImportQuery>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    use crate::api::image::ImportRequest;
    use crate::registry::ImportSource;
    let (request, source) = match q.spec {
        Some(spec) => {
            let request: ImportRequest =
                serde_json::from_str(&spec).map_err(|e| bad_request(format!("spec: {e}")))?;
            let stream = body.into_data_stream().map_err(std::io::Error::other);
            let reader = SyncIoBridge::new(StreamReader::new(stream));
            (request, ImportSource::Archive(Box::new(reader)))
        }
        None => {
            let bytes =
                super::body::read_limited(body, super::ADMIN_BODY_LIMIT, "an import request")
                    .await?;
            let request: ImportRequest = serde_json::from_slice(&bytes).map_err(bad_request)?;
            let credentials = match &request.registry_credential {
                Some(name) => {
                    let login = state
                        .power
                        .secrets()
                        .registry_login(name)
                        .map_err(bad_request)?;
                    Some(crate::image::oci::pull::Credentials {
                        registry: login.registry,
                        user: login.username,
                        password: login.password,
                    })
                }
                None => None,
            };
            (request, ImportSource::Registry(credentials))
        }
    };
    let registry = state.registry.clone();
    let actor = actor(&caller, &headers);
    // Like a publish: an import that got its bytes finishes (or is refused) whole.
    let outcome = state
        .tasks
        .spawn(crate::audit::acting_as(caller.name, async move {
            registry.import(request, source, &actor).await
        }))
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))??;
    let status = if outcome.publish.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(outcome)).into_response())
}
