//! Server assembly: open the data directory, bind, serve until cancelled, shut down cleanly.

use std::path::Path;

use anyhow::Context;
use axum::serve::ListenerExt;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::auth::AdminToken;
use crate::config::ServerConfig;
use crate::http::{AppState, router};
use crate::image::blobstore::BlobStore;
use crate::registry::Registry;
use crate::store::Store;

pub const DATABASE_FILE: &str = "bootfleet.db";

/// Opens everything under the data directory: blob store (sweeping crash leftovers),
/// database (migrated), admin token (generated on first start).
pub async fn open_state(cfg: &ServerConfig) -> anyhow::Result<AppState> {
    let data_dir: &Path = &cfg.data_dir;
    std::fs::create_dir_all(data_dir)
        .with_context(|| format!("cannot create data directory {}", data_dir.display()))?;
    let blobs = BlobStore::open(data_dir)
        .with_context(|| format!("cannot open blob store in {}", data_dir.display()))?;
    let store = Store::open(&data_dir.join(DATABASE_FILE))
        .await
        .context("cannot open the database")?;
    let token = AdminToken::load_or_create(cfg.admin_token_file.as_deref(), data_dir)?;
    Ok(AppState {
        registry: Registry::new(store, blobs, cfg.limits),
        token,
        tasks: TaskTracker::new(),
    })
}

/// Serves on an already-bound listener until `shutdown` is cancelled; then lets in-flight
/// requests and owned tasks finish and closes the database.
pub async fn run(
    listener: TcpListener,
    state: AppState,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let app = router(state.clone());
    let listener = listener.tap_io(|tcp| {
        // Small responses (scripts, API) must not wait on Nagle.
        let _ = tcp.set_nodelay(true);
    });
    axum::serve(listener, app)
        .with_graceful_shutdown(shutdown.cancelled_owned())
        .await
        .context("HTTP server failed")?;
    state.tasks.close();
    state.tasks.wait().await;
    state.registry.store.close().await;
    tracing::info!("shut down cleanly");
    Ok(())
}
