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
mod metrics;
mod nodes;
mod power;
pub mod range;
mod rollouts;
pub mod serve;
mod ui;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::routing::{delete, get, patch, post, put};
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
    /// This server among those sharing a store (`leader::holder_id`): who holds roles,
    /// whose write probe a row is.
    pub server_id: String,
    /// Power control through nodes' BMCs.
    pub power: std::sync::Arc<crate::power::service::PowerService>,
    /// Rollouts: the admin's requests (the controller runs as a task of its own).
    pub rollouts: std::sync::Arc<crate::rollout::service::RolloutService>,
    /// Counters and timings for `/metrics`, shared with DHCP, TFTP and the services.
    pub metrics: crate::metrics::Metrics,
    /// What `/metrics` reads besides the counters, and who may read it.
    pub scrape: std::sync::Arc<crate::metrics::Scrape>,
}

/// The most an admin JSON body may be (bundles have their own limits): a label request
/// or a reimage reason is a few hundred bytes.
pub const ADMIN_BODY_LIMIT: usize = 1024 * 1024;

/// Every route on one listener.
pub fn router(state: AppState) -> Router {
    counted(boot_routes().merge(operators(&state)), &state).with_state(state)
}

/// What operators reach: health checks, the admin API, the console and the metrics.
fn operators(state: &AppState) -> Router<AppState> {
    health()
        .merge(admin_api(state))
        .merge(console())
        .route("/metrics", get(metrics::scrape))
        .route("/metrics/gpus", get(metrics::gpus))
}

/// The operator's console (`/ui/`), its login and its session.
fn console() -> Router<AppState> {
    Router::new()
        .route(
            "/ui",
            get(|| async { axum::response::Redirect::permanent("/ui/") }),
        )
        .route("/ui/", get(ui::index))
        .route("/ui/app.js", get(ui::script))
        .route("/ui/style.css", get(ui::style))
        .route(
            "/ui/login",
            post(ui::login).layer(DefaultBodyLimit::max(4096)),
        )
        .route("/ui/session", get(ui::current))
        .route("/ui/logout", post(ui::logout))
}

/// The admin API with health checks, the console and metrics, for a listener of its own.
pub fn admin_router(state: AppState) -> Router {
    counted(operators(&state), &state).with_state(state)
}

/// Every routed request counted and timed by its route template.
fn counted(routes: Router<AppState>, state: &AppState) -> Router<AppState> {
    routes.route_layer(middleware::from_fn_with_state(
        state.metrics.clone(),
        crate::metrics::http::track,
    ))
}

/// What nodes reach, for a listener without the admin API: its routes answer 404 with
/// where to look.
pub fn boot_router(state: AppState) -> Router {
    counted(health().merge(boot_routes()), &state)
        .route(
            "/api/v1/{*rest}",
            axum::routing::any(|| async {
                ApiError::NotFound(
                    "the admin API is not served on this address (the server sets admin_listen)"
                        .into(),
                )
            }),
        )
        .with_state(state)
}

fn health() -> Router<AppState> {
    Router::new()
        .route("/healthz", get(healthz))
        .route("/readyz", get(readyz))
}

/// Boot scripts, blobs, iPXE binaries, the agent's calls.
fn boot_routes() -> Router<AppState> {
    Router::new()
        .route("/blobs/sha256/{hex}", get(blobs::get_blob))
        .route("/boot.ipxe", get(nodes::entry))
        .route("/ipxe/{*name}", get(ipxe::get))
        .route("/boot/node.ipxe", get(nodes::node_script))
        .route("/boot/overlay", get(nodes::overlay))
        .route("/api/v1/agent/attest", post(nodes::attest))
        .route("/api/v1/agent/heartbeat", post(nodes::heartbeat))
        .route("/api/v1/agent/validate", post(nodes::validate))
}

/// The admin API under `/api/v1`, behind the bearer token.
fn admin_api(state: &AppState) -> Router<AppState> {
    let admin = Router::new()
        // Bundle size is bounded per entry by `[limits]`, not by a body cap.
        .route(
            "/images",
            post(images::publish)
                .layer(DefaultBodyLimit::disable())
                .get(images::list),
        )
        // An archive's size is bounded by `[images] max_import_bytes`, not a body cap.
        .route(
            "/images/import",
            post(images::import).layer(DefaultBodyLimit::disable()),
        )
        .route(
            "/images/{reference}",
            get(images::show).delete(images::remove),
        )
        .route("/tags", get(images::list_tags))
        .route("/tags/{name}/{tag}", put(images::put_tag))
        .route("/tags/{name}/{tag}/history", get(images::tag_history))
        .route("/blobs/verify", post(images::verify))
        .route("/blobs/gc", post(images::gc))
        .route("/fleet", get(nodes::fleet))
        .route("/nodes", get(nodes::list))
        .route("/nodes/{mac}", get(nodes::show).delete(nodes::remove))
        .route("/nodes/{mac}/image", put(nodes::assign))
        .route("/nodes/{mac}/labels", patch(nodes::label))
        .route("/nodes/{mac}/reimage", post(nodes::reimage))
        .route("/nodes/{mac}/revalidate", post(nodes::revalidate))
        .route(
            "/nodes/{mac}/bmc",
            put(power::set_bmc).delete(power::clear_bmc),
        )
        .route("/nodes/{mac}/power", get(power::status).post(power::act))
        .route("/bmcs", get(power::registrations).post(power::register))
        .route("/bmcs/{id}", delete(power::unregister))
        .route("/bmcs/{id}/power", post(power::act_registered))
        .route("/rollouts", get(rollouts::list).post(rollouts::start))
        .route("/rollouts/{id}", get(rollouts::show))
        .route("/rollouts/{id}/{action}", post(rollouts::act))
        .route("/events", get(events::list))
        .route("/events/stream", get(events::stream))
        .layer(DefaultBodyLimit::max(ADMIN_BODY_LIMIT))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::require_admin,
        ));
    Router::new().nest("/api/v1", admin)
}

async fn healthz() -> &'static str {
    "ok\n"
}

/// Ready when the database answers and takes a write, and the blob directory is there
/// with the free space a publish keeps back.
async fn readyz(State(state): State<AppState>) -> (StatusCode, Json<crate::api::Readiness>) {
    let ok = || "ok".to_string();
    let db = state.registry.ping().await;
    let writes = match &db {
        Ok(()) => state
            .registry
            .probe_write(&state.server_id)
            .await
            .map(|()| ok())
            .unwrap_or_else(|e| e.to_string()),
        Err(_) => "not tried: the database does not answer".into(),
    };
    let blobs = state.registry.blob_readiness();
    let database = db.map(|()| ok()).unwrap_or_else(|e| e.to_string());
    let ready = [&database, &writes, &blobs].iter().all(|s| *s == "ok");
    let status = if ready {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let body = crate::api::Readiness {
        ready,
        database,
        writes,
        blobs,
    };
    (status, Json(body))
}
