//! Admin API for images and tags: extract, call the registry, map errors.

use axum::Json;
use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use futures_util::TryStreamExt;
use serde::Deserialize;
use tokio_util::io::{StreamReader, SyncIoBridge};

use super::AppState;
use super::error::ApiError;
use crate::api::image::{Image, ImageDetail, TagRequest};
use crate::api::refs::{ImageRef, TagName};

#[derive(Deserialize)]
pub struct PublishQuery {
    tag: Option<String>,
}

/// Who moved a tag: what the client says (`X-Bootfleet-Actor`), else "admin".
fn actor(headers: &HeaderMap) -> String {
    headers
        .get("x-bootfleet-actor")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim())
        .filter(|s| !s.is_empty() && s.len() <= 128 && s.chars().all(|c| c.is_ascii_graphic()))
        .map(|s| format!("admin ({s})"))
        .unwrap_or_else(|| "admin".into())
}

fn bad_request(e: impl ToString) -> ApiError {
    ApiError::BadRequest(e.to_string())
}

pub async fn publish(
    State(state): State<AppState>,
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
    let actor = actor(&headers);
    // Run to completion even if the client goes away after the upload: a publish that
    // got all its bytes finishes (or is refused) whole. The tracker joins it at shutdown.
    let outcome = state
        .tasks
        .spawn(async move { registry.publish(reader, tag, &actor).await })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))??;
    let status = if outcome.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(outcome)).into_response())
}

pub async fn list(State(state): State<AppState>) -> Result<Json<Vec<Image>>, ApiError> {
    Ok(Json(state.registry.list().await?))
}

pub async fn show(
    State(state): State<AppState>,
    Path(r): Path<String>,
) -> Result<Json<ImageDetail>, ApiError> {
    let r = ImageRef::parse(&r).map_err(bad_request)?;
    let (image, manifest) = state.registry.show(&r).await?;
    Ok(Json(ImageDetail { image, manifest }))
}

pub async fn put_tag(
    State(state): State<AppState>,
    Path((name, tag)): Path<(String, String)>,
    headers: HeaderMap,
    Json(req): Json<TagRequest>,
) -> Result<Response, ApiError> {
    let tag = TagName::parse(&format!("{name}:{tag}")).map_err(bad_request)?;
    let r = ImageRef::parse(&req.image).map_err(bad_request)?;
    let digest = state.registry.resolve(&r).await?;
    let result = state.registry.tag(&tag, &digest, &actor(&headers)).await?;
    Ok(Json(result).into_response())
}

pub async fn tag_history(
    State(state): State<AppState>,
    Path((name, tag)): Path<(String, String)>,
) -> Result<Response, ApiError> {
    let tag = TagName::parse(&format!("{name}:{tag}")).map_err(bad_request)?;
    Ok(Json(state.registry.tag_history(&tag).await?).into_response())
}

pub async fn list_tags(State(state): State<AppState>) -> Result<Response, ApiError> {
    Ok(Json(state.registry.list_tags().await?).into_response())
}

pub async fn verify(State(state): State<AppState>) -> Result<Response, ApiError> {
    Ok(Json(state.registry.verify().await?).into_response())
}

pub async fn gc(State(state): State<AppState>) -> Result<Response, ApiError> {
    Ok(Json(state.registry.gc().await?).into_response())
}

/// `DELETE /api/v1/images/{reference}`: the removed image; 409 naming what uses it.
pub async fn remove(
    State(state): State<AppState>,
    Path(r): Path<String>,
) -> Result<Response, ApiError> {
    let r = ImageRef::parse(&r).map_err(bad_request)?;
    let runs = |s| !crate::node::state::removable(s);
    Ok(Json(state.registry.remove(&r, runs).await?).into_response())
}

#[derive(Deserialize)]
pub struct ImportQuery {
    /// The `ImportRequest` as JSON, when the body is the archive.
    spec: Option<String>,
}

/// `POST /api/v1/images/import`: a registry pull (JSON body) or an uploaded archive
/// (`?spec=` JSON, the archive as the body).
pub async fn import(
    State(state): State<AppState>,
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
    let actor = actor(&headers);
    // Like a publish: an import that got its bytes finishes (or is refused) whole.
    let outcome = state
        .tasks
        .spawn(async move { registry.import(request, source, &actor).await })
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))??;
    let status = if outcome.publish.created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(outcome)).into_response())
}
