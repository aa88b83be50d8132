//! HTTP surface (axum): routes, auth, error mapping. Handlers extract, call, map errors:
//! no SQL and no filesystem decisions here beyond streaming a blob.

mod auth;
pub mod blob_maps;
mod blobs;
mod body;
mod error;
mod events;
mod images;
mod ipxe;
mod nodes;
pub mod range;
pub mod serve;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::routing::{get, patch, post, put};
use axum::{Json, Router, middleware};
use tokio_util::task::TaskTracker;

pub use error::ApiError;

use crate::auth::AdminToken;
use crate::registry::Registry;

#[derive(Clone)]
pub struct AppState {
    pub registry: Registry,
    pub token: AdminToken,
    /// Work that must finish even if its request is dropped (publishes); joined at shutdown.
    pub tasks: TaskTracker,
    /// The node service: boots, the agent's calls, the admin node API.
    pub nodes: std::sync::Arc<crate::node::service::NodeService>,
    /// The event log: pages and live feeds.
    pub events: crate::events::EventLog,
    /// Our URL for boot scripts when a request carries no Host header.
    pub fallback_url: String,
    /// The iPXE binaries (the TFTP root), also served over HTTP for UEFI HTTP boot.
    pub ipxe_files: std::sync::Arc<crate::tftp::files::FileSource>,
    /// Cancelled when the server starts shutting down: ends event streams, which would
    /// otherwise hold graceful shutdown open forever.
    pub stopping: tokio_util::sync::CancellationToken,
    /// Blobs being served, each mapped once for all its downloads.
    pub blob_maps: std::sync::Arc<blob_maps::BlobMaps>,
}

/// The most an admin JSON body may be (bundles have their own limits): a label request
/// or a reimage reason is a few hundred bytes.
pub const ADMIN_BODY_LIMIT: usize = 1024 * 1024;

pub fn router(state: AppState) -> Router {
    let admin = Router::new()
        // Bundle size is bounded per entry by `[limits]`, not by a body cap.
        .route(
            "/images",
            post(images::publish)
                .layer(DefaultBodyLimit::disable())
                .get(images::list),
        )
        .route("/images/{reference}", get(images::show))
        .route("/tags", get(images::list_tags))
        .route("/tags/{name}/{tag}", put(images::put_tag))
        .route("/tags/{name}/{tag}/history", get(images::tag_history))
        .route("/blobs/verify", post(images::verify))
        .route("/blobs/gc", post(images::gc))
        .route("/nodes", get(nodes::list))
        .route("/nodes/{mac}", get(nodes::show))
        .route("/nodes/{mac}/image", put(nodes::assign))
        .route("/nodes/{mac}/labels", patch(nodes::label))
        .route("/nodes/{mac}/reimage", post(nodes::reimage))
        .route("/nodes/{mac}/revalidate", post(nodes::revalidate))
        .route("/events", get(events::list))
        .route("/events/stream", get(events::stream))
        .layer(DefaultBodyLimit::max(ADMIN_BODY_LIMIT))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_admin,
        ));
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
        .route("/blobs/sha256/{hex}", get(blobs::get_blob))
        .route("/boot.ipxe", get(nodes::entry))
        .route("/ipxe/{*name}", get(ipxe::get))
        .route("/boot/node.ipxe", get(nodes::node_script))
        .route("/api/v1/agent/attest", post(nodes::attest))
        .route("/api/v1/agent/heartbeat", post(nodes::heartbeat))
        .route("/api/v1/agent/validate", post(nodes::validate))
        .nest("/api/v1", admin)
        .with_state(state)
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// Ready when the database answers and the blob directory is there.
async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<crate::api::Readiness>) {
    let db = state.registry.ping().await;
    let blobs = state.registry.blobs.dir().is_dir();
    let ready = db.is_ok() && blobs;
    let body = crate::api::Readiness {
        ready,
        database: db
            .map(|_| "ok".to_string())
            .unwrap_or_else(|e| e.to_string()),
        blobs: if blobs {
            "ok"
        } else {
            "blob directory missing"
        }
        .into(),
    };
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    (status, Json(body))
}
