//! HTTP surface (axum): routes, auth, error mapping. Handlers extract, call, map errors:
//! no SQL and no filesystem decisions here beyond streaming a blob.

mod auth;
pub mod blob_maps;
mod blobs;
mod body;
mod error;
mod events;
mod extract;
mod images;
mod ipxe;
mod metrics;
mod nodes;
mod openapi;
mod power;
pub mod range;
mod rollouts;
pub mod sendfile;
pub mod serve;
mod slots;
pub mod small_blobs;
pub mod tls;
mod tokens;
mod ui;

use axum::extract::{DefaultBodyLimit, State};
use axum::http::StatusCode;
use axum::routing::{get, post};
use axum::{Json, Router, middleware};
use tokio_util::task::TaskTracker;
use utoipa::OpenApi;
use utoipa_axum::router::{OpenApiRouter, UtoipaMethodRouter};
use utoipa_axum::routes;

pub use error::ApiError;
pub use openapi::json as openapi_json;

use crate::auth::AdminToken;
use crate::registry::Registry;

/// What the routes share, behind one `Arc`: axum clones the state for every request, and
/// a clone of the fields was a score of reference counts and three `String`s (about 2%
/// of a small blob request's CPU in `perf`); a clone of this is one.
#[derive(Clone)]
pub struct AppState(std::sync::Arc<Shared>);

impl AppState {
    pub fn new(shared: Shared) -> Self {
        Self(std::sync::Arc::new(shared))
    }
}

impl std::ops::Deref for AppState {
    type Target = Shared;
    fn deref(&self) -> &Shared {
        &self.0
    }
}

/// The fields of `AppState`.
pub struct Shared {
    pub registry: Registry,
    pub token: AdminToken,
    /// Named API tokens, and the admin token, as the gate checks them.
    pub tokens: std::sync::Arc<crate::auth::tokens::Tokens>,
    /// Failed authentications per source.
    pub auth_failures: std::sync::Arc<crate::auth::limiter::FailureLimiter>,
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
        .merge(routes(metrics_routes()))
}

/// The operator's console (`/ui/`), its login and its session: pages, not API, so not
/// in the OpenAPI document.
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
                    "the admin API is not served on this address (the server sets admin_listen, or serves it over HTTPS at [http] tls_listen)"
                        .into(),
                )
            }),
        )
        .with_state(state)
}

/// The OpenAPI document of every documented route (all but the console's pages and the
/// iPXE binaries), from the same declarations the listeners route by.
pub fn openapi() -> utoipa::openapi::OpenApi {
    let mut doc = OpenApiRouter::with_openapi(openapi::ApiDoc::openapi())
        .merge(health_routes())
        .merge(boot_api_routes())
        .nest("/api/v1", admin_routes())
        .merge(metrics_routes())
        .into_openapi();
    openapi::finish(&mut doc);
    doc
}

/// An OpenAPI router's routes, without its document.
fn routes(r: OpenApiRouter<AppState>) -> Router<AppState> {
    r.split_for_parts().0
}

/// A route without the admin body cap: its body is bounded otherwise (a bundle per entry
/// by `[limits]`, an archive by `[images] max_import_bytes`).
fn uncapped(
    (schemas, paths, methods): UtoipaMethodRouter<AppState>,
) -> UtoipaMethodRouter<AppState> {
    (schemas, paths, methods.layer(DefaultBodyLimit::disable()))
}

fn health() -> Router<AppState> {
    routes(health_routes())
}

fn health_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(healthz))
        .routes(routes!(readyz))
}

fn metrics_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(metrics::scrape))
        .routes(routes!(metrics::gpus))
}

/// Boot scripts, blobs, iPXE binaries, the agent's calls.
fn boot_routes() -> Router<AppState> {
    // The iPXE binaries are files by name (the TFTP root), not API.
    routes(boot_api_routes()).route("/ipxe/{*name}", get(ipxe::get))
}

fn boot_api_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(routes!(blobs::get_blob))
        .routes(routes!(nodes::entry))
        .routes(routes!(nodes::node_script))
        .routes(routes!(nodes::overlay))
        .routes(routes!(nodes::attest))
        .routes(routes!(nodes::tpm_challenge))
        .routes(routes!(nodes::heartbeat))
        .routes(routes!(nodes::validate))
}

/// The admin API under `/api/v1`, behind the bearer token.
fn admin_api(state: &AppState) -> Router<AppState> {
    let admin = routes(admin_routes())
        .layer(DefaultBodyLimit::max(ADMIN_BODY_LIMIT))
        .route_layer(middleware::from_fn_with_state(
            state.clone(),
            auth::authorize,
        ));
    Router::new().nest("/api/v1", admin)
}

/// The admin API's routes, relative to `/api/v1`.
fn admin_routes() -> OpenApiRouter<AppState> {
    OpenApiRouter::new()
        .routes(uncapped(routes!(images::publish, images::list)))
        .routes(uncapped(routes!(images::import)))
        .routes(routes!(images::show, images::remove))
        .routes(routes!(images::list_tags))
        .routes(routes!(images::put_tag))
        .routes(routes!(images::tag_history))
        .routes(routes!(images::verify))
        .routes(routes!(images::gc))
        .routes(routes!(nodes::fleet))
        .routes(routes!(nodes::list))
        .routes(routes!(nodes::show, nodes::remove))
        .routes(routes!(nodes::assign))
        .routes(routes!(nodes::label))
        .routes(routes!(nodes::tpm, nodes::enrol_tpm, nodes::forget_tpm))
        .routes(routes!(nodes::reimage))
        .routes(routes!(nodes::revalidate))
        .routes(routes!(nodes::health))
        .routes(routes!(power::set_bmc, power::clear_bmc))
        .routes(routes!(power::status, power::act))
        .routes(routes!(power::registrations, power::register))
        .routes(routes!(power::unregister))
        .routes(routes!(power::act_registered))
        .routes(routes!(rollouts::list, rollouts::start))
        .routes(routes!(rollouts::show))
        .routes(routes!(rollouts::act))
        .routes(routes!(events::list))
        .routes(routes!(events::stream))
        .routes(routes!(openapi::document))
        .routes(routes!(tokens::list, tokens::create))
        .routes(routes!(tokens::revoke))
}

/// `GET /healthz`.
#[utoipa::path(
    get, path = "/healthz", tag = "health",
    security(()),
    responses((status = 200, description = "The process answers", content_type = "text/plain", body = String))
)]
async fn healthz() -> &'static str {
    "ok\n"
}

/// Ready when the database answers and takes a write, and the blob directory is there
/// with the free space a publish keeps back.
#[utoipa::path(
    get, path = "/readyz", tag = "health",
    security(()),
    responses(
        (status = 200, description = "Ready", body = crate::api::Readiness),
        (status = 503, description = "Not ready: what is wrong", body = crate::api::Readiness)
    )
)]
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
