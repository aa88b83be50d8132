//! Blobs in an S3-compatible object store (`[blobs] url = "s3://bucket/prefix"`), shared
//! by every server: one object per blob, `<prefix>sha256/<hex>`. Requests are signed with
//! rusty-s3 (SigV4 presigned URLs; it does no I/O) and sent with reqwest, the HTTP
//! client the server already has. An object is only ever read into a temp blob, hashed
//! as it arrives: a blob whose bytes do not hash to its name is refused, never served.

use std::path::{Path, PathBuf};
use std::time::Duration;

use rusty_s3::{Bucket, Credentials, S3Action as _, UrlStyle};
use serde::Deserialize;

use super::blobstore::{BlobStore, TempBlob};
use crate::api::Digest;

/// How long a signed URL is valid: one request, sent at once.
const SIGNED_FOR: Duration = Duration::from_secs(300);
/// Connecting and each request's wait for the first byte; a body streams for as long as
/// it keeps moving.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// `[blobs]` in the settings file.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ObjectsConfig {
    /// `s3://BUCKET[/PREFIX]`; unset: blobs live only in the data directory.
    pub url: Option<String>,
    /// The S3 endpoint, `http://host:port` (path-style requests; this build has no TLS
    /// client, so keep it on the storage network).
    pub endpoint: Option<String>,
    /// [default: us-east-1]
    pub region: Option<String>,
    /// A TOML file with `access_key_id` and `secret_access_key`.
    pub credentials_file: Option<PathBuf>,
    /// Bound on the local cache of blobs (the data directory's `blobs/`), in bytes; the
    /// oldest filled are evicted past it. Unset: unbounded.
    pub cache_max_bytes: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct CredentialsFile {
    access_key_id: String,
    secret_access_key: String,
}

#[derive(Debug, thiserror::Error)]
pub enum ObjectError {
    #[error("[blobs] {0}")]
    Config(String),
    /// The object store cannot be reached or answered 5xx: try again later.
    #[error("the object store is unreachable: {0}")]
    Unreachable(String),
    #[error("no object for blob {0} in the object store")]
    Missing(Digest),
    /// The object's bytes hash to something else: refused, nothing kept.
    #[error(
        "the object store's copy of {expected} is damaged (its bytes hash to {actual}); not served"
    )]
    Damaged { expected: Digest, actual: Digest },
    #[error("the object store refused the request: {0}")]
    Refused(String),
    #[error("local blob storage: {0}")]
    Io(#[from] std::io::Error),
}

/// A bucket and prefix on an S3-compatible store.
pub struct Objects {
    bucket: Bucket,
    credentials: Credentials,
    prefix: String,
    http: reqwest::Client,
}

impl std::fmt::Debug for Objects {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Objects")
            .field("bucket", &self.bucket.name())
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

fn unreachable(e: reqwest::Error) -> ObjectError {
    ObjectError::Unreachable(e.without_url().to_string())
}

impl Objects {
    /// The store `cfg` names; None when `url` is unset.
    pub fn open(cfg: &ObjectsConfig) -> Result<Option<Self>, ObjectError> {
        let Some(url) = &cfg.url else {
            return Ok(None);
        };
        let config = |m: &str| ObjectError::Config(m.to_string());
        let rest = url
            .strip_prefix("s3://")
            .ok_or_else(|| config("url must be s3://BUCKET[/PREFIX]"))?;
        let (name, prefix) = rest.split_once('/').unwrap_or((rest, ""));
        if name.is_empty() {
            return Err(config("url names no bucket"));
        }
        let prefix = match prefix.trim_matches('/') {
            "" => String::new(),
            p => format!("{p}/"),
        };
        let endpoint: url::Url = cfg
            .endpoint
            .as_deref()
            .ok_or_else(|| config("endpoint is required with url"))?
            .parse()
            .map_err(|e| ObjectError::Config(format!("endpoint: {e}")))?;
        if endpoint.scheme() != "http" {
            return Err(config(
                "endpoint must be http:// (this build has no TLS client)",
            ));
        }
        let region = cfg.region.clone().unwrap_or_else(|| "us-east-1".into());
        let bucket = Bucket::new(endpoint, UrlStyle::Path, name.to_string(), region)
            .map_err(|e| ObjectError::Config(format!("endpoint: {e}")))?;
        let path = cfg
            .credentials_file
            .as_deref()
            .ok_or_else(|| config("credentials_file is required with url"))?;
        let text = std::fs::read_to_string(path).map_err(|e| {
            ObjectError::Config(format!("credentials_file {}: {e}", path.display()))
        })?;
        // The parse error may quote the file: name the file only.
        let creds: CredentialsFile = toml::from_str(&text).map_err(|_| {
            ObjectError::Config(format!(
                "credentials_file {}: expected access_key_id and secret_access_key",
                path.display()
            ))
        })?;
        let http = crate::http_client::builder()
            .connect_timeout(CONNECT_TIMEOUT)
            .read_timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| ObjectError::Config(e.to_string()))?;
        Ok(Some(Self {
            bucket,
            credentials: Credentials::new(creds.access_key_id, creds.secret_access_key),
            prefix,
            http,
        }))
    }

    fn key(&self, digest: &Digest) -> String {
        format!("{}sha256/{}", self.prefix, digest.hex())
    }

    /// Creates the bucket if it does not exist (a first start against an empty store).
    pub async fn ensure_bucket(&self) -> Result<(), ObjectError> {
        let head = self
            .bucket
            .head_bucket(Some(&self.credentials))
            .sign(SIGNED_FOR);
        let r = self.http.head(head).send().await.map_err(unreachable)?;
        if r.status().is_success() {
            return Ok(());
        }
        let create = self
            .bucket
            .create_bucket(&self.credentials)
            .sign(SIGNED_FOR);
        let r = self.http.put(create).send().await.map_err(unreachable)?;
        check(r, None).await.map(|_| ())
    }

    /// Whether the store holds `digest`.
    pub async fn has(&self, digest: &Digest) -> Result<bool, ObjectError> {
        let key = self.key(digest);
        let url = self
            .bucket
            .head_object(Some(&self.credentials), &key)
            .sign(SIGNED_FOR);
        let r = self.http.head(url).send().await.map_err(unreachable)?;
        if r.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(false);
        }
        check(r, Some(digest)).await.map(|_| true)
    }

    /// Uploads the local blob at `path` as `digest`, unless the store holds it already.
    pub async fn put_file(&self, digest: &Digest, path: &Path) -> Result<(), ObjectError> {
        if self.has(digest).await? {
            return Ok(());
        }
        let file = tokio::fs::File::open(path).await?;
        let len = file.metadata().await?.len();
        let key = self.key(digest);
        let url = self
            .bucket
            .put_object(Some(&self.credentials), &key)
            .sign(SIGNED_FOR);
        let body =
            reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::with_capacity(file, 1 << 20));
        let r = self
            .http
            .put(url)
            .header(reqwest::header::CONTENT_LENGTH, len)
            .body(body)
            .send()
            .await
            .map_err(unreachable)?;
        check(r, Some(digest)).await.map(|_| ())
    }

    /// Downloads `digest` into a temp blob of `blobs`, hashing as it arrives; the temp
    /// blob is returned only if its bytes are `digest`'s.
    pub async fn fetch(&self, digest: &Digest, blobs: &BlobStore) -> Result<TempBlob, ObjectError> {
        use futures_util::StreamExt as _;
        use std::io::Write as _;
        let key = self.key(digest);
        let url = self
            .bucket
            .get_object(Some(&self.credentials), &key)
            .sign(SIGNED_FOR);
        let r = self.http.get(url).send().await.map_err(unreachable)?;
        let r = check(r, Some(digest)).await?;
        let mut writer = blobs.temp_writer()?;
        let mut body = r.bytes_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(unreachable)?;
            // Disk writes off the async threads, a chunk at a time.
            writer = tokio::task::spawn_blocking(move || writer.write_all(&chunk).map(|()| writer))
                .await
                .map_err(|e| std::io::Error::other(e.to_string()))??;
        }
        let temp = tokio::task::spawn_blocking(move || writer.finish())
            .await
            .map_err(|e| std::io::Error::other(e.to_string()))??;
        if temp.digest != *digest {
            return Err(ObjectError::Damaged {
                expected: *digest,
                actual: temp.digest,
            });
        }
        Ok(temp)
    }
}

/// The response if it is a success; else what went wrong, by status.
async fn check(
    r: reqwest::Response,
    digest: Option<&Digest>,
) -> Result<reqwest::Response, ObjectError> {
    let status = r.status();
    if status.is_success() {
        return Ok(r);
    }
    if status == reqwest::StatusCode::NOT_FOUND
        && let Some(d) = digest
    {
        return Err(ObjectError::Missing(*d));
    }
    // S3 error bodies are small XML documents; keep the code, drop the rest.
    let body = r.text().await.unwrap_or_default();
    let code = body
        .split_once("<Code>")
        .and_then(|(_, rest)| rest.split_once("</Code>"))
        .map_or("", |(code, _)| code);
    let what = format!("{status} {code}");
    if status.is_server_error() {
        Err(ObjectError::Unreachable(what))
    } else {
        Err(ObjectError::Refused(what))
    }
}
