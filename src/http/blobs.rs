//! `GET`/`HEAD /blobs/sha256/<hex>`: immutable artifacts, streamed from disk in 1 MiB chunks.

use axum::body::Body;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderMap, HeaderValue, Method, StatusCode, header};
use axum::response::Response;
use bytes::Bytes;

use super::AppState;
use super::error::ApiError;
use super::range::{RangeDecision, decide_range, none_match};
use crate::digest::Digest;

/// Large enough that per-chunk overhead vanishes on multi-GiB rootfs images, small enough
/// that 16 concurrent downloads stay within a few tens of MiB.
const CHUNK: u64 = 1 << 20;

#[derive(serde::Deserialize)]
pub struct BlobQuery {
    /// The boot this download belongs to (boot scripts add it): recorded, never required.
    boot: Option<String>,
}

pub async fn get_blob(
    State(state): State<AppState>,
    Path(hex_digits): Path<String>,
    Query(query): Query<BlobQuery>,
    method: Method,
    headers: HeaderMap,
) -> Result<Response, ApiError> {
    let digest = Digest::from_hex(&hex_digits).map_err(|e| ApiError::BadRequest(e.to_string()))?;
    let path = state.registry.blobs.path_of(&digest);
    let opened = tokio::task::spawn_blocking(move || {
        let file = std::fs::File::open(path)?;
        let len = file.metadata()?.len();
        Ok::<_, std::io::Error>((file, len))
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?;
    let (file, len) = match opened {
        Ok(v) => v,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(ApiError::NotFound(format!("no blob {digest}")));
        }
        Err(e) => return Err(ApiError::Internal(e.to_string())),
    };
    let etag = format!("\"{digest}\"");
    let header_str = |name| {
        headers
            .get(name)
            .and_then(|v: &HeaderValue| v.to_str().ok())
    };

    let mut response = Response::builder()
        .header(header::ETAG, &etag)
        .header(header::CACHE_CONTROL, "public, max-age=31536000, immutable")
        .header(header::ACCEPT_RANGES, "bytes");
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
    let body = if method == Method::HEAD || count == 0 {
        Body::empty()
    } else {
        let chunks = Box::pin(file_chunks(file, start, count));
        match query
            .boot
            .filter(|b| crate::boot::fetches::plausible_boot_id(b))
        {
            Some(boot) => Body::from_stream(state.boot.fetches.track(
                boot,
                digest,
                status == StatusCode::OK,
                count,
                chunks,
            )),
            None => Body::from_stream(chunks),
        }
    };
    Ok(response
        .status(status)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, count)
        .body(body)
        .expect("valid response"))
}

/// Streams `count` bytes from `start` as 1 MiB memory-mapped windows, each unmapped as
/// soon as the socket has taken it. Why mmap: `read` + `write` copies every byte twice
/// (page cache -> buffer -> socket); a mapped window is copied once, as nginx's sendfile
/// does, and hyper cannot sendfile. Windows are mapped (and populated) on the blocking
/// pool, since a page-cache miss is disk I/O; resident memory stays a few windows per
/// download, whatever the blob's size.
fn file_chunks(
    file: std::fs::File,
    start: u64,
    count: u64,
) -> impl futures_util::Stream<Item = std::io::Result<Bytes>> {
    let file = std::sync::Arc::new(file);
    futures_util::stream::try_unfold(
        (file, start, count),
        |(file, offset, remaining)| async move {
            if remaining == 0 {
                return Ok(None);
            }
            let want = remaining.min(CHUNK);
            let f = file.clone();
            let chunk = tokio::task::spawn_blocking(move || map_window(&f, offset, want))
                .await
                .map_err(std::io::Error::other)??;
            let n = chunk.len() as u64;
            Ok(Some((chunk, (file, offset + n, remaining - n))))
        },
    )
}

const PAGE: u64 = 4096;

fn map_window(file: &std::fs::File, offset: u64, len: u64) -> std::io::Result<Bytes> {
    let aligned = offset - offset % PAGE;
    let skip = (offset - aligned) as usize;
    // SAFETY: blobs are immutable once visible: they are only ever renamed (quarantine)
    // or unlinked (gc), both of which leave a mapping valid. Nothing in bootfleet writes
    // or truncates a visible blob, which is what could make a mapping fault.
    let map = unsafe {
        memmap2::MmapOptions::new()
            .offset(aligned)
            .len(skip + len as usize)
            .populate()
            .map(file)?
    };
    Ok(Bytes::from_owner(map).slice(skip..))
}
