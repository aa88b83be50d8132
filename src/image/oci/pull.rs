//! Pulling an image from a registry over the OCI distribution API (`docker://`): the
//! manifest (an index picks linux/amd64), the config and every layer, each streamed into
//! the staging directory and checked against the digest and size its descriptor gives
//! (a truncated or altered blob is refused, never kept). Registries that answer 401 with
//! a `Bearer` challenge get the token dance (anonymous, or with the credential given);
//! `Basic` challenges get the credential itself.

use std::fmt;

use futures_util::StreamExt;
use reqwest::header::{ACCEPT, AUTHORIZATION, HeaderValue, WWW_AUTHENTICATE};
use reqwest::{Client, Response, StatusCode};

use super::archive::Staging;
use super::spec::{DOCKER_LIST, DOCKER_MANIFEST, OCI_INDEX, OCI_MANIFEST};
use super::{OciError, OciImage};
use crate::api::Digest;

/// `docker://HOST[:PORT]/REPOSITORY[:TAG|@sha256:HEX]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PullSource {
    pub host: String,
    pub repository: String,
    /// A tag or a digest (`sha256:...`).
    pub reference: String,
    /// Speak HTTP instead of HTTPS (a registry on a trusted local network).
    pub plain_http: bool,
}

/// A registry login, for the one registry it names. Never printed.
#[derive(Clone)]
pub struct Credentials {
    /// HOST[:PORT]: the login is sent for this registry only.
    pub registry: String,
    pub user: String,
    pub password: String,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Credentials({}, <redacted>)", self.user)
    }
}

impl PullSource {
    pub fn parse(source: &str, plain_http: bool) -> Result<Self, OciError> {
        let bad = |why: &str| {
            OciError::Refused(format!(
                "source {source:?}: {why} (docker://HOST[:PORT]/REPOSITORY[:TAG|@sha256:HEX])"
            ))
        };
        let rest = source
            .strip_prefix("docker://")
            .ok_or_else(|| bad("not a docker:// reference"))?;
        let (host, path) = rest.split_once('/').ok_or_else(|| bad("no repository"))?;
        if host.is_empty()
            || !host
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || ".-:[]".contains(c))
        {
            return Err(bad("the registry host is not a host name"));
        }
        let (repository, reference) = if let Some((repo, digest)) = path.split_once('@') {
            digest
                .parse::<Digest>()
                .map_err(|_| bad("the digest is not sha256:<64 hex digits>"))?;
            (repo, digest.to_string())
        } else {
            // A ':' after the last '/' starts the tag.
            match path.rsplit_once(':') {
                Some((repo, tag)) if !tag.contains('/') => (repo, tag.to_string()),
                _ => (path, "latest".to_string()),
            }
        };
        let component_ok = |c: &str| {
            !c.is_empty()
                && c.chars()
                    .all(|ch| ch.is_ascii_lowercase() || ch.is_ascii_digit() || "._-".contains(ch))
        };
        if !repository.split('/').all(component_ok) {
            return Err(bad("the repository must be lowercase path components"));
        }
        if reference.is_empty()
            || reference.len() > 128
            || !reference
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || "._-:".contains(c))
        {
            return Err(bad("the tag is not valid"));
        }
        Ok(Self {
            host: host.to_string(),
            repository: repository.to_string(),
            reference,
            plain_http,
        })
    }

    fn url(&self, kind: &str, reference: &str) -> String {
        let scheme = if self.plain_http { "http" } else { "https" };
        format!(
            "{scheme}://{}/v2/{}/{kind}/{reference}",
            self.host, self.repository
        )
    }
}

/// The client pulls use: redirects followed (registries send blobs from storage
/// elsewhere), no overall timeout (a layer can take minutes), a connect timeout.
pub fn client() -> Result<Client, OciError> {
    crate::http_client::builder()
        .connect_timeout(std::time::Duration::from_secs(10))
        .read_timeout(std::time::Duration::from_secs(60))
        .build()
        .map_err(|e| OciError::Unreachable(format!("cannot build an HTTP client: {e}")))
}

/// The most layers an image may have (Docker's own limit is 127).
const MAX_LAYERS: usize = 256;

/// A registry session: the client and the authorization the registry asked for.
struct Session<'a> {
    client: &'a Client,
    source: &'a PullSource,
    credentials: Option<&'a Credentials>,
    authorization: Option<HeaderValue>,
}

/// Pulls `source` into `staging` and returns the image found there.
pub async fn pull(
    client: &Client,
    source: &PullSource,
    credentials: Option<&Credentials>,
    staging: &mut Staging,
) -> Result<OciImage, OciError> {
    if let Some(c) = credentials
        && c.registry != source.host
    {
        return Err(OciError::Refused(format!(
            "the registry login is for {}, not {}: a login is sent to its own registry only",
            c.registry, source.host
        )));
    }
    if let Some(c) = credentials
        && c.registry != source.host
    {
        return Err(OciError::Refused(format!(
            "the registry login is for {}, not {}: a login is sent to its own registry only",
            c.registry, source.host
        )));
    }
    let mut session = Session {
        client,
        source,
        credentials,
        authorization: None,
    };
    let accept = [OCI_MANIFEST, OCI_INDEX, DOCKER_MANIFEST, DOCKER_LIST].join(", ");
    let (digest, size, media_type) = session
        .fetch_manifest(staging, &source.reference, &accept)
        .await?;
    // An index names its platforms' manifests by digest: fetch the one we boot.
    let (digest, size, media_type) = if media_type == OCI_INDEX || media_type == DOCKER_LIST {
        let index: super::spec::Index = read_json(staging, &digest)?;
        let chosen = index
            .manifests
            .iter()
            .find(|d| {
                d.platform
                    .as_ref()
                    .is_some_and(super::spec::is_wanted_platform)
            })
            .ok_or_else(|| {
                OciError::Refused(format!("{} has no linux/amd64 image", source.reference))
            })?
            .clone();
        let fetched = session
            .fetch_manifest(staging, &chosen.digest.to_string(), &accept)
            .await?;
        if fetched.0 != chosen.digest || fetched.1 != chosen.size {
            return Err(OciError::Refused(format!(
                "the registry's manifest {} does not match the index's {}",
                fetched.0, chosen.digest
            )));
        }
        fetched
    } else {
        (digest, size, media_type)
    };
    let manifest: super::spec::ImageManifest = read_json(staging, &digest)?;
    // Bounded before anything is fetched: a layer count no builder makes, a config
    // larger than any document is read.
    if manifest.layers.len() > MAX_LAYERS {
        return Err(OciError::Refused(format!(
            "the image has {} layers; an import takes at most {MAX_LAYERS}",
            manifest.layers.len()
        )));
    }
    if manifest.config.size > staging.limits.max_json_bytes {
        return Err(OciError::Refused(format!(
            "the image config is {} bytes, over the {} a document may have",
            manifest.config.size, staging.limits.max_json_bytes
        )));
    }
    for (what, desc) in std::iter::once(("the config".to_string(), &manifest.config)).chain(
        manifest
            .layers
            .iter()
            .enumerate()
            .map(|(i, d)| (format!("layer {} ({})", i + 1, d.digest), d)),
    ) {
        session
            .fetch_blob(staging, &what, &desc.digest, desc.size)
            .await?;
    }
    staging.image_from_descriptor(&digest, size, &media_type)
}

fn read_json<T: serde::de::DeserializeOwned>(
    staging: &Staging,
    digest: &Digest,
) -> Result<T, OciError> {
    let bytes = std::fs::read(staging.blob_path(digest))?;
    serde_json::from_slice(&bytes)
        .map_err(|e| OciError::Refused(format!("the registry's manifest is not valid: {e}")))
}

impl Session<'_> {
    /// Fetches a manifest into the staging directory: its digest, size and media type.
    async fn fetch_manifest(
        &mut self,
        staging: &mut Staging,
        reference: &str,
        accept: &str,
    ) -> Result<(Digest, u64, String), OciError> {
        let url = self.source.url("manifests", reference);
        let response = self.get(&url, Some(accept)).await?;
        let media_type = response
            .headers()
            .get(reqwest::header::CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .map(|v| v.split(';').next().unwrap_or(v).trim().to_string())
            .unwrap_or_default();
        let limit = staging.limits.max_json_bytes;
        let expected = reference.parse::<Digest>().ok();
        let mut spool = staging.begin_blob(None, "the manifest")?;
        let mut size = 0u64;
        let mut body = response.bytes_stream();
        while let Some(chunk) = body.next().await {
            let chunk = chunk.map_err(|e| unreachable(&url, e))?;
            size += chunk.len() as u64;
            if size > limit {
                return Err(OciError::Refused(format!(
                    "the manifest of {reference} passes {limit} bytes"
                )));
            }
            spool.write(&chunk)?;
        }
        let digest = staging.finish_blob(spool)?;
        if let Some(want) = expected
            && want != digest
        {
            return Err(OciError::Refused(format!(
                "the registry answered {reference} with a manifest hashing to {digest}"
            )));
        }
        let media_type = if media_type.is_empty() {
            // Older registries send no type: the document's own field says.
            let doc: serde_json::Value = read_json(staging, &digest)?;
            doc.get("mediaType")
                .and_then(|v| v.as_str())
                .unwrap_or(OCI_MANIFEST)
                .to_string()
        } else {
            media_type
        };
        Ok((digest, size, media_type))
    }

    /// Streams a blob into the staging directory, checked against `digest` and `size`.
    async fn fetch_blob(
        &mut self,
        staging: &mut Staging,
        what: &str,
        digest: &Digest,
        size: u64,
    ) -> Result<(), OciError> {
        let url = self.source.url("blobs", &digest.to_string());
        let response = self.get(&url, None).await?;
        let mut spool = staging.begin_blob(Some((*digest, size)), what)?;
        let mut body = response.bytes_stream();
        let mut received = 0u64;
        while let Some(chunk) = body.next().await {
            // A broken connection is the network's fault, not the image's: say so.
            let chunk = chunk.map_err(|e| {
                OciError::Unreachable(format!(
                    "{url}: the download broke off after {received} of {size} bytes: {e}"
                ))
            })?;
            received += chunk.len() as u64;
            spool.write(&chunk)?;
        }
        staging.finish_blob(spool)?;
        Ok(())
    }

    /// GET with the session's authorization; on a 401, authenticate as the challenge
    /// says and try once more.
    async fn get(&mut self, url: &str, accept: Option<&str>) -> Result<Response, OciError> {
        for attempt in 0..2 {
            let mut request = self.client.get(url);
            if let Some(a) = accept {
                request = request.header(ACCEPT, a);
            }
            if let Some(auth) = &self.authorization {
                request = request.header(AUTHORIZATION, auth.clone());
            }
            let response = request.send().await.map_err(|e| unreachable(url, e))?;
            match response.status() {
                s if s.is_success() => return Ok(response),
                StatusCode::UNAUTHORIZED if attempt == 0 => {
                    let challenge = response
                        .headers()
                        .get(WWW_AUTHENTICATE)
                        .and_then(|v| v.to_str().ok())
                        .unwrap_or_default()
                        .to_string();
                    self.authorization = Some(self.authenticate(&challenge).await?);
                }
                StatusCode::NOT_FOUND => {
                    return Err(OciError::Refused(format!(
                        "{url}: the registry has no such image or blob (404)"
                    )));
                }
                s if s == StatusCode::UNAUTHORIZED || s == StatusCode::FORBIDDEN => {
                    return Err(OciError::Refused(format!(
                        "{url}: the registry refused access ({s}); give a registry credential"
                    )));
                }
                s => {
                    return Err(OciError::Unreachable(format!(
                        "{url}: the registry answered {s}"
                    )));
                }
            }
        }
        unreachable!("the loop returns on its second attempt")
    }

    /// The login goes where the registry says, over HTTPS; in clear text only to the
    /// registry's own host, and only when plain HTTP was asked for.
    fn check_realm(&self, realm: &str) -> Result<(), OciError> {
        let url = url::Url::parse(realm).map_err(|_| {
            OciError::Refused(format!("the registry's token realm {realm:?} is not a URL"))
        })?;
        // The host, not the port: a registry's token service often listens beside it.
        let registry_host = self
            .source
            .host
            .rsplit_once(':')
            .filter(|(_, port)| port.bytes().all(|b| b.is_ascii_digit()))
            .map_or(self.source.host.as_str(), |(h, _)| h);
        let same_host = url.host_str() == Some(registry_host);
        match url.scheme() {
            "https" => Ok(()),
            "http" if self.source.plain_http && same_host => Ok(()),
            _ => Err(OciError::Refused(format!(
                "the registry asks for the login at {realm}; it is sent only over HTTPS, or in clear to the registry itself with plain_http"
            ))),
        }
    }

    /// The Authorization header a challenge asks for.
    async fn authenticate(&self, challenge: &str) -> Result<HeaderValue, OciError> {
        let (scheme, params) = challenge.split_once(' ').unwrap_or((challenge, ""));
        let basic = || {
            let c = self.credentials.ok_or_else(|| {
                OciError::Refused(
                    "the registry asks for a login; give a registry credential".into(),
                )
            })?;
            header(&format!(
                "Basic {}",
                base64(format!("{}:{}", c.user, c.password).as_bytes())
            ))
        };
        if scheme.eq_ignore_ascii_case("basic") {
            return basic();
        }
        if !scheme.eq_ignore_ascii_case("bearer") {
            return Err(OciError::Refused(format!(
                "the registry asks for {scheme:?} authentication, which is not spoken"
            )));
        }
        let params = challenge_params(params);
        let realm = params.get("realm").ok_or_else(|| {
            OciError::Refused("the registry's Bearer challenge names no realm".into())
        })?;
        if self.credentials.is_some() {
            self.check_realm(realm)?;
        }
        let mut request = self.client.get(realm.as_str());
        let mut query = Vec::new();
        if let Some(service) = params.get("service") {
            query.push(("service", service.clone()));
        }
        query.push((
            "scope",
            params
                .get("scope")
                .cloned()
                .unwrap_or_else(|| format!("repository:{}:pull", self.source.repository)),
        ));
        request = request.query(&query);
        if let Some(c) = self.credentials {
            request = request.basic_auth(&c.user, Some(&c.password));
        }
        let response = request.send().await.map_err(|e| unreachable(realm, e))?;
        if !response.status().is_success() {
            return Err(OciError::Refused(format!(
                "the registry's token service refused the login ({})",
                response.status()
            )));
        }
        #[derive(serde::Deserialize)]
        struct Token {
            token: Option<String>,
            access_token: Option<String>,
        }
        let t: Token = response
            .json()
            .await
            .map_err(|e| OciError::Refused(format!("the token service's answer: {e}")))?;
        let token = t
            .token
            .or(t.access_token)
            .ok_or_else(|| OciError::Refused("the token service sent no token".into()))?;
        header(&format!("Bearer {token}"))
    }
}

fn header(value: &str) -> Result<HeaderValue, OciError> {
    let mut v = HeaderValue::from_str(value)
        .map_err(|_| OciError::Refused("the registry's token is not a header value".into()))?;
    v.set_sensitive(true);
    Ok(v)
}

fn unreachable(url: &str, e: reqwest::Error) -> OciError {
    OciError::Unreachable(format!("{url}: {e}"))
}

/// `realm="https://...",service="registry",scope="repository:x:pull"`.
fn challenge_params(text: &str) -> std::collections::BTreeMap<String, String> {
    let mut out = std::collections::BTreeMap::new();
    let mut rest = text.trim();
    while let Some((key, after)) = rest.split_once('=') {
        let key = key
            .trim()
            .trim_start_matches(',')
            .trim()
            .to_ascii_lowercase();
        let (value, next) = if let Some(quoted) = after.strip_prefix('"') {
            match quoted.split_once('"') {
                Some((v, n)) => (v.to_string(), n),
                None => (quoted.to_string(), ""),
            }
        } else {
            match after.split_once(',') {
                Some((v, n)) => (v.trim().to_string(), n),
                None => (after.trim().to_string(), ""),
            }
        };
        out.insert(key, value);
        rest = next.trim_start_matches(',').trim();
    }
    out
}

/// Standard base64 (for a Basic header), which nothing else here needs a crate for.
fn base64(bytes: &[u8]) -> String {
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut out = String::with_capacity(bytes.len().div_ceil(3) * 4);
    for chunk in bytes.chunks(3) {
        let b = [
            chunk[0],
            *chunk.get(1).unwrap_or(&0),
            *chunk.get(2).unwrap_or(&0),
        ];
        let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(ALPHABET[(n >> (18 - 6 * i)) as usize & 63] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sources_parse_with_tags_digests_and_ports() {
        let s = PullSource::parse("docker://127.0.0.1:5000/gpu/node:2026.12.0", true).unwrap();
        assert_eq!(s.host, "127.0.0.1:5000");
        assert_eq!(s.repository, "gpu/node");
        assert_eq!(s.reference, "2026.12.0");
        assert_eq!(
            s.url("manifests", &s.reference),
            "http://127.0.0.1:5000/v2/gpu/node/manifests/2026.12.0"
        );
        let d = format!("sha256:{}", "a".repeat(64));
        let s = PullSource::parse(&format!("docker://reg.example/x@{d}"), false).unwrap();
        assert_eq!(s.reference, d);
        assert_eq!(
            PullSource::parse("docker://reg.example:5000/x", false)
                .unwrap()
                .reference,
            "latest"
        );
        for bad in [
            "oci:dir",
            "docker://",
            "docker://host",
            "docker://ho st/x",
            "docker://host/X",
            "docker://host/x@sha256:1",
            "docker://host/x:t%ag",
        ] {
            assert!(PullSource::parse(bad, false).is_err(), "{bad}");
        }
    }

    #[test]
    fn bearer_challenges_and_basic_headers() {
        let p = challenge_params(
            r#"realm="https://auth.example/token",service="registry.example",scope="repository:a/b:pull""#,
        );
        assert_eq!(p["realm"], "https://auth.example/token");
        assert_eq!(p["service"], "registry.example");
        assert_eq!(p["scope"], "repository:a/b:pull");
        assert_eq!(base64(b"user:pass"), "dXNlcjpwYXNz");
        assert_eq!(base64(b"ab"), "YWI=");
        let c = Credentials {
            registry: "r:5000".into(),
            user: "u".into(),
            password: "secret".into(),
        };
        assert!(!format!("{c:?}").contains("secret"));
    }
}
