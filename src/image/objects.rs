//! Blobs in an S3-compatible object store (`[blobs] url = "s3://bucket/prefix"`), shared
//! by every server: one object per blob, `<prefix>sha256/<hex>`. Requests are signed with
//! rusty-s3 (SigV4 presigned URLs; it does no I/O) and sent with reqwest, the HTTP
//! client the server already has (plain HTTP or HTTPS). An object is only ever read into
//! a temp blob, hashed as it arrives: a blob whose bytes do not hash to its name is
//! refused, never served. Objects larger than one part (64 MiB) are uploaded in parts:
//! S3 takes at most 5 GiB in one PUT, and a root image may be larger.

use std::path::{Path, PathBuf};
use std::time::Duration;

use instant_xml::FromXml;
use rusty_s3::{Bucket, Credentials, S3Action as _, UrlStyle};
use serde::Deserialize;

use super::blobstore::{BlobStore, TempBlob};
use crate::api::Digest;

/// How long a signed URL is valid: one request, sent at once.
const SIGNED_FOR: Duration = Duration::from_secs(300);
/// Connecting and each request's wait for the first byte; a body streams for as long as
/// it keeps moving.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// S3's smallest part (all but the last) and its most parts in one upload.
const MIN_PART_BYTES: u64 = 5 << 20;
const MAX_PARTS: u64 = 10_000;
/// S3's largest part, and its largest single PUT.
const MAX_PART_BYTES: u64 = 5 << 30;
const DEFAULT_PART_BYTES: u64 = 64 << 20;
const DEFAULT_GC_GRACE_SECS: u64 = 86_400;

/// `[blobs]` in the settings file.
#[derive(Debug, Clone, Default, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct ObjectsConfig {
    /// `s3://BUCKET[/PREFIX]`; unset: blobs live only in the data directory.
    pub url: Option<String>,
    /// The S3 endpoint, `https://host:port` or `http://host:port` (path-style requests;
    /// plain HTTP only on a storage network you trust: the signature covers the request,
    /// not the bytes' privacy).
    pub endpoint: Option<String>,
    /// A PEM file of the CA that signed an `https` endpoint's certificate (a private CA;
    /// then only it is trusted). Unset: the system's roots.
    pub ca_file: Option<PathBuf>,
    /// [default: us-east-1]
    pub region: Option<String>,
    /// A TOML file with `access_key_id` and `secret_access_key`.
    pub credentials_file: Option<PathBuf>,
    /// Bound on the local cache of blobs (the data directory's `blobs/`), in bytes; the
    /// least recently served are evicted past it. Unset: unbounded.
    pub cache_max_bytes: Option<u64>,
    /// Objects larger than this are uploaded in parts of this size, at least 5 MiB.
    /// [default: 67108864]
    pub part_bytes: Option<u64>,
    /// `image gc` removes an object no image needs only once it is this old: another
    /// server's publish uploads its blobs before it writes its row, so a publish must end
    /// within half of this (a blob it reuses is uploaded again when older than that).
    /// [default: 86400]
    pub gc_grace_secs: Option<u64>,
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
    part_bytes: u64,
    gc_grace: Duration,
}

/// One blob's object, as a listing shows it.
#[derive(Debug, Clone, PartialEq)]
pub struct ObjectEntry {
    pub digest: Digest,
    pub size: u64,
    /// Seconds since the Unix epoch.
    pub modified_secs: i64,
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
        let builder = match (endpoint.scheme(), &cfg.ca_file) {
            ("https", Some(path)) => {
                let pem = std::fs::read_to_string(path)
                    .map_err(|e| ObjectError::Config(format!("ca_file {}: {e}", path.display())))?;
                crate::http_client::trusting(&pem)
                    .map_err(|e| ObjectError::Config(format!("ca_file {}: {e}", path.display())))?
            }
            ("https", None) => crate::http_client::builder(),
            ("http", None) => crate::http_client::builder(),
            ("http", Some(_)) => return Err(config("ca_file needs an https:// endpoint")),
            _ => return Err(config("endpoint must be https:// or http://")),
        };
        let part_bytes = cfg.part_bytes.unwrap_or(DEFAULT_PART_BYTES);
        if !(MIN_PART_BYTES..=MAX_PART_BYTES).contains(&part_bytes) {
            return Err(config(
                "part_bytes must be from 5 MiB (5242880) to 5 GiB (5368709120), S3's bounds",
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
        let http = builder
            .connect_timeout(CONNECT_TIMEOUT)
            .read_timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| ObjectError::Config(e.to_string()))?;
        Ok(Some(Self {
            bucket,
            credentials: Credentials::new(creds.access_key_id, creds.secret_access_key),
            prefix,
            http,
            part_bytes,
            gc_grace: Duration::from_secs(cfg.gc_grace_secs.unwrap_or(DEFAULT_GC_GRACE_SECS)),
        }))
    }

    /// How old an unreferenced object must be before `image gc` removes it.
    pub fn gc_grace(&self) -> Duration {
        self.gc_grace
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

    /// When the store's object of `digest` was last written (seconds since the epoch;
    /// 0 when the store does not say), or None when it holds none.
    pub async fn modified(&self, digest: &Digest) -> Result<Option<i64>, ObjectError> {
        let key = self.key(digest);
        let url = self
            .bucket
            .head_object(Some(&self.credentials), &key)
            .sign(SIGNED_FOR);
        let r = self.http.head(url).send().await.map_err(unreachable)?;
        if r.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(None);
        }
        let r = check(r, Some(digest)).await?;
        let modified = r
            .headers()
            .get(reqwest::header::LAST_MODIFIED)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| {
                jiff::fmt::rfc2822::DateTimeParser::new()
                    .parse_timestamp(v)
                    .ok()
            })
            .map_or(0, |t| t.as_second());
        Ok(Some(modified))
    }

    /// Uploads the local blob at `path` as `digest`, unless the store holds it already,
    /// written within half the GC grace (an older copy is written again, so that a
    /// publish that reuses it is not raced by another server's `image gc`).
    pub async fn put_file(&self, digest: &Digest, path: &Path) -> Result<(), ObjectError> {
        if let Some(modified) = self.modified(digest).await?
            && !older_than(modified, now_secs(), self.gc_grace / 2)
        {
            return Ok(());
        }
        let len = tokio::fs::metadata(path).await?.len();
        let key = self.key(digest);
        if len > self.part_bytes {
            return self.put_parts(digest, &key, path, len).await;
        }
        let url = self
            .bucket
            .put_object(Some(&self.credentials), &key)
            .sign(SIGNED_FOR);
        let r = self.put_range(url, path, 0, len).await?;
        check(r, Some(digest)).await.map(|_| ())
    }

    /// PUTs `len` bytes of the file at `path` from `offset`.
    async fn put_range(
        &self,
        url: url::Url,
        path: &Path,
        offset: u64,
        len: u64,
    ) -> Result<reqwest::Response, ObjectError> {
        use tokio::io::{AsyncReadExt as _, AsyncSeekExt as _};
        let mut file = tokio::fs::File::open(path).await?;
        file.seek(std::io::SeekFrom::Start(offset)).await?;
        let reader = file.take(len);
        let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::with_capacity(
            reader,
            1 << 20,
        ));
        self.http
            .put(url)
            .header(reqwest::header::CONTENT_LENGTH, len)
            .body(body)
            .send()
            .await
            .map_err(unreachable)
    }

    /// A multipart upload: parts in order, then the completion; a failure aborts the
    /// upload (best effort). A publish cancelled mid-upload (its client went away) leaves
    /// its parts: give the bucket a lifecycle rule that aborts incomplete multipart
    /// uploads (AbortIncompleteMultipartUpload, a day).
    async fn put_parts(
        &self,
        digest: &Digest,
        key: &str,
        path: &Path,
        len: u64,
    ) -> Result<(), ObjectError> {
        let parts = len.div_ceil(self.part_bytes);
        if parts > MAX_PARTS {
            return Err(ObjectError::Config(format!(
                "blob {digest} ({len} bytes) needs {parts} parts of part_bytes; S3 takes at most {MAX_PARTS}: raise part_bytes"
            )));
        }
        let create = self
            .bucket
            .create_multipart_upload(Some(&self.credentials), key)
            .sign(SIGNED_FOR);
        let r = self.http.post(create).send().await.map_err(unreachable)?;
        let text = check(r, None).await?.text().await.map_err(unreachable)?;
        let created = rusty_s3::actions::CreateMultipartUpload::parse_response(&text)
            .map_err(|e| ObjectError::Refused(format!("CreateMultipartUpload answer: {e}")))?;
        let upload_id = created.upload_id();
        let result = self.upload_parts(key, upload_id, path, len, parts).await;
        if result.is_err() {
            let abort = self
                .bucket
                .abort_multipart_upload(Some(&self.credentials), key, upload_id)
                .sign(SIGNED_FOR);
            if let Err(e) = self.http.delete(abort).send().await {
                tracing::warn!(%digest, error = %e.without_url(), "could not abort a failed multipart upload");
            }
        }
        result
    }

    async fn upload_parts(
        &self,
        key: &str,
        upload_id: &str,
        path: &Path,
        len: u64,
        parts: u64,
    ) -> Result<(), ObjectError> {
        let mut etags = Vec::with_capacity(parts as usize);
        for index in 0..parts {
            let offset = index * self.part_bytes;
            let number = u16::try_from(index + 1).expect("at most MAX_PARTS parts");
            let url = self
                .bucket
                .upload_part(Some(&self.credentials), key, number, upload_id)
                .sign(SIGNED_FOR);
            let r = self
                .put_range(url, path, offset, self.part_bytes.min(len - offset))
                .await?;
            let r = check(r, None).await?;
            let etag = r
                .headers()
                .get(reqwest::header::ETAG)
                .and_then(|v| v.to_str().ok())
                .ok_or_else(|| ObjectError::Refused(format!("part {number} answered no ETag")))?;
            etags.push(etag.to_string());
        }
        let complete = self.bucket.complete_multipart_upload(
            Some(&self.credentials),
            key,
            upload_id,
            etags.iter().map(String::as_str),
        );
        let url = complete.sign(SIGNED_FOR);
        let r = self
            .http
            .post(url)
            .body(complete.body())
            .send()
            .await
            .map_err(unreachable)?;
        let text = check(r, None).await?.text().await.map_err(unreachable)?;
        // S3 may answer 200 and still have failed: the error is then in the body.
        if text.contains("<Error>") {
            return Err(ObjectError::Refused(format!(
                "CompleteMultipartUpload failed: {}",
                error_code(&text)
            )));
        }
        Ok(())
    }

    /// Every blob object under the prefix (keys that are not `sha256/<hex>` are not ours
    /// and are left out), a page of up to 1,000 at a time.
    pub async fn list(&self) -> Result<Vec<ObjectEntry>, ObjectError> {
        let prefix = format!("{}sha256/", self.prefix);
        let mut entries = Vec::new();
        let mut token: Option<String> = None;
        loop {
            let mut action = self.bucket.list_objects_v2(Some(&self.credentials));
            action.with_prefix(prefix.as_str());
            if let Some(t) = &token {
                action.with_continuation_token(t.clone());
            }
            let url = action.sign(SIGNED_FOR);
            let r = self.http.get(url).send().await.map_err(unreachable)?;
            let text = check(r, None).await?.text().await.map_err(unreachable)?;
            let page: ListPage = instant_xml::from_str(&text)
                .map_err(|e| ObjectError::Refused(format!("ListObjectsV2 answer: {e}")))?;
            entries.extend(page.contents.iter().filter_map(|c| {
                let digest = blob_of_key(&c.key)?;
                let modified_secs = c
                    .last_modified
                    .parse::<jiff::Timestamp>()
                    .map_or(0, |t| t.as_second());
                Some(ObjectEntry {
                    digest,
                    size: c.size,
                    modified_secs,
                })
            }));
            match page.next_continuation_token {
                Some(t) if !page.contents.is_empty() => token = Some(t),
                _ => return Ok(entries),
            }
        }
    }

    /// Removes `digest`'s object (gone already is fine).
    pub async fn delete(&self, digest: &Digest) -> Result<(), ObjectError> {
        let key = self.key(digest);
        let url = self
            .bucket
            .delete_object(Some(&self.credentials), &key)
            .sign(SIGNED_FOR);
        let r = self.http.delete(url).send().await.map_err(unreachable)?;
        if r.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(());
        }
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
    let body = r.text().await.unwrap_or_default();
    let what = format!("{status} {}", error_code(&body));
    if status.is_server_error() {
        Err(ObjectError::Unreachable(what))
    } else {
        Err(ObjectError::Refused(what))
    }
}

/// A ListObjectsV2 page, as much of it as we read. rusty-s3's own parser requires each
/// entry's ETag, which some S3 servers (s3s-fs among them) leave out.
#[derive(Debug, FromXml)]
#[xml(
    rename = "ListBucketResult",
    ns("http://s3.amazonaws.com/doc/2006-03-01/")
)]
struct ListPage {
    contents: Vec<ListEntry>,
    #[xml(rename = "NextContinuationToken")]
    next_continuation_token: Option<String>,
}

#[derive(Debug, FromXml)]
#[xml(rename = "Contents", ns("http://s3.amazonaws.com/doc/2006-03-01/"))]
struct ListEntry {
    #[xml(rename = "Key")]
    key: String,
    #[xml(rename = "LastModified")]
    last_modified: String,
    #[xml(rename = "Size")]
    size: u64,
}

/// The blob a listed key names: `...sha256/<hex>` (the `/` percent-encoded when the
/// listing asked for url encoding, as rusty-s3 does).
fn blob_of_key(key: &str) -> Option<Digest> {
    let (rest, hex) = key.split_at_checked(key.len().checked_sub(64)?)?;
    let named = rest.ends_with("sha256/") || rest.to_ascii_lowercase().ends_with("sha256%2f");
    named.then(|| Digest::from_hex(hex).ok()).flatten()
}

/// An S3 error body's `<Code>` (they are small XML documents; the rest is dropped).
fn error_code(body: &str) -> &str {
    body.split_once("<Code>")
        .and_then(|(_, rest)| rest.split_once("</Code>"))
        .map_or("", |(code, _)| code)
}

pub(crate) fn now_secs() -> i64 {
    jiff::Timestamp::now().as_second()
}

/// Whether something written at `modified` (epoch seconds; 0 = unknown, so old) is
/// older than `age` at `now`.
pub fn older_than(modified: i64, now: i64, age: Duration) -> bool {
    now.saturating_sub(modified) >= i64::try_from(age.as_secs()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn age_counts_from_the_write_and_unknown_is_old() {
        let day = Duration::from_secs(86_400);
        assert!(!older_than(1_000_000, 1_000_000 + 86_399, day));
        assert!(older_than(1_000_000, 1_000_000 + 86_400, day));
        assert!(older_than(0, 1_000_000, day));
    }

    #[test]
    fn listings_are_read_without_etags_and_name_only_blobs() {
        let hex = "ab".repeat(32);
        let xml = format!(
            r#"<?xml version="1.0" encoding="UTF-8"?><ListBucketResult xmlns="http://s3.amazonaws.com/doc/2006-03-01/"><Name>b</Name><KeyCount>2</KeyCount><Contents><Key>fleet/sha256/{hex}</Key><LastModified>2026-12-06T19:00:00.000Z</LastModified><Size>7</Size></Contents><Contents><Key>fleet/sha256%2F{hex}</Key><LastModified>2026-12-06T19:00:00Z</LastModified><ETag>"x"</ETag><Size>8</Size><StorageClass>STANDARD</StorageClass></Contents><NextContinuationToken>t1</NextContinuationToken></ListBucketResult>"#
        );
        let page: ListPage = instant_xml::from_str(&xml).unwrap();
        assert_eq!(page.contents.len(), 2);
        assert_eq!(page.next_continuation_token.as_deref(), Some("t1"));
        assert_eq!(page.contents[1].size, 8);
        for c in &page.contents {
            assert_eq!(blob_of_key(&c.key).unwrap().hex(), hex);
        }
        assert!(blob_of_key(&format!("fleet/other/{hex}")).is_none());
        assert!(blob_of_key("short").is_none());
        let t: jiff::Timestamp = page.contents[0].last_modified.parse().unwrap();
        assert_eq!(t.as_second(), 1_796_583_600);
    }

    #[test]
    fn error_codes_are_read_from_s3_bodies() {
        assert_eq!(
            error_code("<Error><Code>NoSuchUpload</Code><Message>x</Message></Error>"),
            "NoSuchUpload"
        );
        assert_eq!(error_code("not xml"), "");
    }

    #[test]
    fn parts_below_s3s_least_are_refused() {
        let cfg = ObjectsConfig {
            url: Some("s3://b".into()),
            endpoint: Some("http://127.0.0.1:9".into()),
            credentials_file: Some("/nonexistent".into()),
            part_bytes: Some(1 << 20),
            ..Default::default()
        };
        let e = Objects::open(&cfg).unwrap_err().to_string();
        assert!(e.contains("part_bytes"), "{e}");
        let cfg = ObjectsConfig {
            ca_file: Some("/nonexistent".into()),
            part_bytes: None,
            ..cfg
        };
        let e = Objects::open(&cfg).unwrap_err().to_string();
        assert!(e.contains("https"), "{e}");
    }
}
