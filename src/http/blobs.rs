//! `GET`/`HEAD /blobs/sha256/<hex>`: immutable artifacts, small ones from memory, larger
//! ones streamed from disk in 1 MiB windows.

use axum::body::Body;
use axum::extract::State;

use super::extract::{Path, Query};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;

use super::AppState;
use super::blob_maps::{Mapped, SMALL};
use super::error::ApiError;
use super::range::{RangeDecision, decide_range, none_match};
use crate::api::Digest;
use futures_util::stream::BoxStream;

/// Large enough that per-chunk overhead vanishes on multi-GiB rootfs images, small enough
/// that 16 concurrent downloads stay within a few tens of MiB; the mapping's unit of
/// release, so that a window holds at most two slots.
const CHUNK: u64 = super::blob_maps::SLOT as u64;

#[derive(serde::Deserialize)]
pub struct BlobQuery {
    /// The boot this download belongs to (boot scripts add it): recorded, never required.
    boot: Option<String>,
}

/// A blob's bytes as they are served.
enum Content {
    /// A small blob, whole in memory (empty included: an empty file cannot be mapped).
    Small(Bytes),
    /// A larger one's shared mapping, and its length.
    Mapped(Mapped, u64),
}

impl Content {
    fn len(&self) -> u64 {
        match self {
            Content::Small(bytes) => bytes.len() as u64,
            Content::Mapped(_, len) => *len,
        }
    }
}

/// The blob's content: a small blob kept in memory and read since the store's last
/// removal as it is, else its file read whole (small) or mapped, on the blocking pool.
/// The caller saw the blob in the store with the store's removal count at `removals`
/// before it looked.
async fn open(
    state: &AppState,
    digest: Digest,
    removals: u64,
) -> Result<std::io::Result<Content>, ApiError> {
    if let Some(bytes) = state.blob_maps.small_unremoved(&digest, removals) {
        return Ok(Ok(Content::Small(bytes)));
    }
    let path = state.registry.blobs.path_of(&digest);
    let maps = state.blob_maps.clone();
    tokio::task::spawn_blocking(move || {
        let file = std::fs::File::open(path)?;
        let len = file.metadata()?.len();
        Ok(if len <= SMALL {
            Content::Small(maps.read_small(&digest, &file, len, removals)?)
        } else {
            Content::Mapped(maps.map(&digest, &file, len)?, len)
        })
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))
}

#[utoipa::path(
    get, path = "/blobs/sha256/{hex}", tag = "boot",
    security(()),
    params(("hex" = String, Path, description = "The blob's SHA-256, 64 lower-case hex digits", pattern = "^[0-9a-f]{64}$"), ("range" = Option<String>, Header, description = "One byte range")),
    responses((status = 200, description = "The blob", content_type = "application/octet-stream", body = Vec<u8>), (status = 206, description = "The range asked for", content_type = "application/octet-stream", body = Vec<u8>))
)]
pub async fn get_blob(
    State(state): State<AppState>,
    Path(hex_digits): Path<String>,
    Query(query): Query<BlobQuery>,
    method: Method,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let digest = Digest::from_hex(&hex_digits).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let content = match kept_small(&state, &digest) {
        Some(bytes) => Content::Small(bytes),
        None => look_up(&state, digest).await?,
    };
    let len = content.len();
    let etag = format!("\"{digest}\"");
    let header_str = |name| {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
    };

    let mut response = about(&etag);
    if header_str(header::IF_NONE_MATCH).is_some_and(|v| none_match(v, &etag)) {
        return Ok(response
            .status(StatusCode::NOT_MODIFIED)
            .body(Body::empty())
            .expect("valid response"));
    }
    let (status, start, count) = match decide_range(
        header_str(header::RANGE),
        header_str(header::IF_RANGE),
        &etag,
        len,
    ) {
        RangeDecision::Full => (StatusCode::OK, 0, len),
        RangeDecision::Partial { start, end } => {
            response = response.header(header::CONTENT_RANGE, format!("bytes {start}-{end}/{len}"));
            (StatusCode::PARTIAL_CONTENT, start, end - start + 1)
        }
        RangeDecision::Unsatisfiable => {
            return Ok(response
                .status(StatusCode::RANGE_NOT_SATISFIABLE)
                .header(header::CONTENT_RANGE, format!("bytes */{len}"))
                .body(Body::empty())
                .expect("valid response"));
        }
    };
    let boot = query
        .boot
        .filter(|b| crate::node::service::fetches::plausible_boot_id(b));
    let boot_download = boot.is_some();
    let part = |bytes: Bytes| bytes.slice(start as usize..(start + count) as usize);
    let body = match (content, boot) {
        _ if method == Method::HEAD || count == 0 => Body::empty(),
        // Whole, so that hyper writes it with the head.
        (Content::Small(bytes), None) => Body::from(part(bytes)),
        (Content::Mapped(mapped, _), None) => Body::from_stream(file_chunks(mapped, start, count)),
        // A boot's download: each response's bytes and end are recorded for the boot.
        (content, Some(boot)) => {
            let chunks: BoxStream<'static, std::io::Result<Bytes>> = match content {
                Content::Small(bytes) => Box::pin(futures_util::stream::once(std::future::ready(
                    Ok(part(bytes)),
                ))),
                Content::Mapped(mapped, _) => Box::pin(file_chunks(mapped, start, count)),
            };
            let full = status == StatusCode::OK;
            let fetches = &state.nodes.fetches;
            Body::from_stream(fetches.track(boot, digest, full, start, count, chunks))
        }
    };
    if boot_download {
        // A boot's download ends its connection: iPXE keeps its HTTP connections in a
        // pool and, on `boot`, drops them without a FIN or RST (tcp_shutdown), so the
        // connection of its last initrd would hold one of `[http] max_connections` for
        // the whole keep-alive timeout while other nodes wait. iPXE opens the next file
        // on a new connection.
        response = response.header(header::CONNECTION, "close");
    }
    Ok(finish(response, status, count, body))
}

/// The answer to a plain `GET` of the whole of small blob `digest` whose bytes are kept
/// in memory, as `get_blob` gives it: for `http::small_blobs`, which answers before
/// routing.
pub(super) fn whole_small(digest: &Digest, bytes: Bytes) -> Response {
    let etag = format!("\"{digest}\"");
    let count = bytes.len() as u64;
    finish(about(&etag), StatusCode::OK, count, Body::from(bytes))
}

/// The headers of every answer about the blob whose ETag is `etag`. Constant values are
/// static: a `&str` value is copied and checked for every response.
fn about(etag: &str) -> axum::http::response::Builder {
    Response::builder()
        .header(header::ETAG, etag)
        .header(
            header::CACHE_CONTROL,
            HeaderValue::from_static("public, max-age=31536000, immutable"),
        )
        .header(header::ACCEPT_RANGES, HeaderValue::from_static("bytes"))
}

/// `response` as a `status` answer carrying `count` bytes of the blob (none in `body`
/// for HEAD).
fn finish(
    response: axum::http::response::Builder,
    status: StatusCode,
    count: u64,
    body: Body,
) -> Response {
    response
        .status(status)
        .header(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/octet-stream"),
        )
        .header(header::CONTENT_LENGTH, count)
        .body(body)
        .expect("valid response")
}

/// A small blob kept in memory and read since the store's last removal: no filesystem
/// call. Only without an object store, whose cache also marks each blob it serves (its
/// eviction order) on disk.
fn kept_small(state: &AppState, digest: &Digest) -> Option<Bytes> {
    if state.registry.shared.is_some() {
        return None;
    }
    let removals = state.registry.blobs.removals();
    state.blob_maps.small_unremoved(digest, removals)
}

/// The blob from the store: filled first from the object store, if there is one and this
/// server has not served it before.
async fn look_up(state: &AppState, digest: Digest) -> Result<Content, ApiError> {
    let removals = state.registry.blobs.removals();
    if !state.registry.local_blob(&digest).await? {
        return Err(ApiError::NotFound(format!("no blob {digest}")));
    }
    let mut opened = open(state, digest, removals).await?;
    // Evicted from the cache (or collected) between the fill and the open: fill again.
    if matches!(&opened, Err(e) if e.kind() == std::io::ErrorKind::NotFound)
        && state.registry.shared.is_some()
    {
        let removals = state.registry.blobs.removals();
        if state.registry.local_blob(&digest).await? {
            opened = open(state, digest, removals).await?;
        }
    }
    match opened {
        Ok(content) => Ok(content),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            Err(ApiError::NotFound(format!("no blob {digest}")))
        }
        Err(e) => Err(ApiError::Internal(e.to_string())),
    }
}

/// Streams `count` bytes from `start` of a blob's shared mapping in 1 MiB windows, each
/// made sure of in the page cache on the blocking pool (a miss is disk I/O) just before
/// it is sent, unless it was seen there within the last second. On a plain connection
/// the window's bytes go out with sendfile from the blob's file (`http::sendfile`), as
/// nginx sends them; over TLS they are read through the mapping (one copy, into
/// rustls). Either way no byte is copied into a buffer of ours, and a window's pages
/// leave the process once it is sent (`blob_maps`).
fn file_chunks(
    mapped: Mapped,
    start: u64,
    count: u64,
) -> impl futures_util::Stream<Item = std::io::Result<Bytes>> {
    futures_util::stream::try_unfold(
        (mapped, start, count),
        |(mapped, offset, remaining)| async move {
            if remaining == 0 {
                return Ok(None);
            }
            let (at, want) = (offset as usize, remaining.min(CHUNK) as usize);
            let chunk = match mapped.cached_window(at, want) {
                Some(chunk) => chunk,
                None => {
                    let m = mapped.clone();
                    tokio::task::spawn_blocking(move || m.window(at, want))
                        .await
                        .map_err(std::io::Error::other)?
                }
            };
            let n = chunk.len() as u64;
            Ok(Some((chunk, (mapped, offset + n, remaining - n))))
        },
    )
}
