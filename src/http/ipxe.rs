//! `GET /ipxe/<name>`: the iPXE binaries over HTTP, for UEFI HTTP-boot clients (DHCP
//! hands them `http://<server>/ipxe/snponly.efi`). Same directory and the same name
//! checks as TFTP, so no request names a file outside it.

use axum::body::Body;
use axum::extract::State;

use super::extract::Path;
use axum::http::header;
use axum::response::Response;

use super::AppState;
use super::error::ApiError;
use crate::tftp::files::{Content, check_name};

pub async fn get(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> Result<Response, ApiError> {
    let name = check_name(&name).map_err(|e| ApiError::BadRequest(format!("{name:?}: {e}")))?;
    if name.starts_with("blobs/") {
        return Err(ApiError::NotFound(format!("no iPXE binary {name}")));
    }
    let files = state.ipxe_files.clone();
    let opened = tokio::task::spawn_blocking(move || {
        let opened = files.open(&name)?;
        match opened.content {
            Content::Memory(bytes) => Ok(bytes),
            Content::File(file) => {
                let mut buf = Vec::new();
                std::io::Read::read_to_end(&mut &*file, &mut buf)?;
                Ok::<_, std::io::Error>(bytes::Bytes::from(buf))
            }
        }
    })
    .await
    .map_err(|e| ApiError::Internal(e.to_string()))?;
    match opened {
        Ok(bytes) => Ok(Response::builder()
            .header(header::CONTENT_TYPE, "application/efi")
            .header(header::CONTENT_LENGTH, bytes.len())
            .body(Body::from(bytes))
            .expect("valid response")),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(ApiError::NotFound(
            "no such iPXE binary (apt-get install ipxe)".into(),
        )),
        Err(e) => Err(ApiError::Internal(e.to_string())),
    }
}
