//! `GET`/`HEAD /blobs/sha256/<hex>`: immutable artifacts, streamed from disk in 1 MiB chunks.

use std::io::{Read, Seek, SeekFrom};

use axum::body::Body;
use axum::extract::{Path, State};
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

pub async fn get_blob(
    State(state): State<AppState>,
    Path(hex_digits): Path<String>,
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
        Body::from_stream(file_chunks(file, start, count))
    };
    Ok(response
        .status(status)
        .header(header::CONTENT_TYPE, "application/octet-stream")
        .header(header::CONTENT_LENGTH, count)
        .body(body)
        .expect("valid response"))
}

/// Reads `count` bytes from `start` on the blocking pool, one chunk at a time, so memory
/// per download is one chunk whatever the blob's size. Reads into uninitialised capacity
/// (`read_to_end`), avoiding a memset per chunk.
fn file_chunks(
    file: std::fs::File,
    start: u64,
    count: u64,
) -> impl futures_util::Stream<Item = std::io::Result<Bytes>> {
    futures_util::stream::try_unfold(
        (Some(file), start, count, false),
        |(file, offset, remaining, seeked)| async move {
            if remaining == 0 {
                return Ok(None);
            }
            let mut file = file.expect("file present while bytes remain");
            let want = remaining.min(CHUNK);
            let (file, buf) = tokio::task::spawn_blocking(move || {
                if !seeked {
                    file.seek(SeekFrom::Start(offset))?;
                }
                let mut buf = Vec::with_capacity(want as usize);
                (&mut file).take(want).read_to_end(&mut buf)?;
                Ok::<_, std::io::Error>((file, buf))
            })
            .await
            .map_err(std::io::Error::other)??;
            if buf.is_empty() {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "blob shorter than its recorded length",
                ));
            }
            let n = buf.len() as u64;
            Ok(Some((
                Bytes::from(buf),
                (Some(file), offset + n, remaining - n, true),
            )))
        },
    )
}
