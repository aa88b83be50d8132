//! The admin HTTP client: base URL, bearer token, and server errors turned into messages.

use std::path::{Path, PathBuf};

use anyhow::Context;
use reqwest::{RequestBuilder, Response, StatusCode};
use serde::de::DeserializeOwned;

use crate::auth::{AdminToken, TOKEN_FILE_NAME};
use crate::config::{DEFAULT_DATA_DIR, DEFAULT_SERVER_URL, FileConfig};

pub struct Client {
    pub http: reqwest::Client,
    base: String,
    token: Option<String>,
    /// Where the token came from, named when the server refuses it.
    token_source: String,
}

/// The server an admin command talks to and the token it presents, each from a flag or
/// the environment, else from the server's settings file (`--config`), else defaults.
pub struct Target {
    pub server: String,
    pub token: Option<String>,
    pub token_source: String,
    /// PEM file of the CA that signed the server's HTTPS certificate (else the
    /// system's roots).
    pub ca_file: Option<PathBuf>,
}

impl Target {
    pub fn resolve(
        server: Option<String>,
        token: Option<String>,
        data_dir: Option<PathBuf>,
        config: Option<&Path>,
        ca_file: Option<PathBuf>,
    ) -> anyhow::Result<Self> {
        let file = match config {
            Some(path) => FileConfig::load(path)?,
            None => FileConfig::default(),
        };
        // With HTTPS configured the admin API is reached over it alone.
        let https = file.http.tls_cert_file.is_some();
        let admin_at = if https {
            file.admin_listen.or(file.http.tls_listen)
        } else {
            file.admin_listen.or(file.listen)
        };
        let server = server
            .or_else(|| admin_at.map(|a| url_of(a, https)))
            .unwrap_or_else(|| DEFAULT_SERVER_URL.to_string());
        if let Some(token) = token {
            return Ok(Self {
                server,
                token: Some(token),
                token_source: "--token or BOOTFLEET_TOKEN".into(),
                ca_file,
            });
        }
        let path = match file.admin_token_file {
            Some(path) => path,
            None => data_dir
                .or(file.data_dir)
                .unwrap_or_else(|| PathBuf::from(DEFAULT_DATA_DIR))
                .join(TOKEN_FILE_NAME),
        };
        let (token, token_source) = match AdminToken::read(&path) {
            Ok(t) => (Some(t.secret().to_string()), format!("{}", path.display())),
            Err(e) => (None, format!("none: cannot read {}: {e}", path.display())),
        };
        Ok(Self {
            server,
            token,
            token_source,
            ca_file,
        })
    }
}

/// Where a server listening on `addr` is reached from this machine.
fn url_of(addr: std::net::SocketAddr, https: bool) -> String {
    let ip = match addr.ip() {
        std::net::IpAddr::V4(ip) if ip.is_unspecified() => "127.0.0.1".to_string(),
        std::net::IpAddr::V6(ip) if ip.is_unspecified() => "[::1]".to_string(),
        std::net::IpAddr::V6(ip) => format!("[{ip}]"),
        ip => ip.to_string(),
    };
    let scheme = if https { "https" } else { "http" };
    format!("{scheme}://{ip}:{}", addr.port())
}

impl Client {
    /// The admin token found, if any.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    pub fn new(target: Target) -> anyhow::Result<Self> {
        let base = target.server.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(UsageError(format!(
                "--server must be an http:// or https:// URL, got {:?}",
                target.server
            ))
            .into());
        }
        let builder = match &target.ca_file {
            Some(path) => {
                let pem = std::fs::read_to_string(path)
                    .with_context(|| format!("cannot read --ca-file {}", path.display()))?;
                crate::http_client::trusting(&pem)
                    .map_err(|e| UsageError(format!("--ca-file {}: {e}", path.display())))?
            }
            None => crate::http_client::builder(),
        };
        let http = builder
            .user_agent(concat!("bootfleet-cli/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(Self {
            http,
            base,
            token: target.token,
            token_source: target.token_source,
        })
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    /// A request to `path` carrying the token and who is acting.
    pub fn request(&self, method: reqwest::Method, path: &str) -> RequestBuilder {
        let mut req = self.http.request(method, self.url(path));
        if let Some(t) = &self.token {
            req = req.bearer_auth(t);
        }
        let who = std::env::var("USER").unwrap_or_else(|_| "unknown".into());
        let host = std::fs::read_to_string("/etc/hostname").unwrap_or_default();
        req.header("x-bootfleet-actor", format!("{who}@{}", host.trim()))
    }

    /// Sends, and decodes a success body as `T`; an error status becomes the server's reason.
    pub async fn send<T: DeserializeOwned>(&self, req: RequestBuilder) -> anyhow::Result<T> {
        let response = req
            .send()
            .await
            .with_context(|| format!("cannot reach the bootfleet server at {}", self.base))?;
        self.decode_here(response).await
    }

    pub async fn decode<T: DeserializeOwned>(response: Response) -> anyhow::Result<T> {
        let status = response.status();
        let bytes = response
            .bytes()
            .await
            .context("reading the server's answer")?;
        if status.is_success() {
            return serde_json::from_slice(&bytes)
                .context("the server's answer is not the JSON expected");
        }
        let reason = serde_json::from_slice::<serde_json::Value>(&bytes)
            .ok()
            .and_then(|v| v.get("error").and_then(|e| e.as_str()).map(String::from))
            .unwrap_or_else(|| String::from_utf8_lossy(&bytes).into_owned());
        Err(ServerError {
            status: status.as_u16(),
            reason,
            hint: String::new(),
        }
        .into())
    }

    /// As `decode`, naming where the token came from when the server refuses it.
    pub async fn decode_here<T: DeserializeOwned>(&self, response: Response) -> anyhow::Result<T> {
        Self::decode(response)
            .await
            .map_err(|e| self.with_token_hint(e))
    }

    fn with_token_hint(&self, e: anyhow::Error) -> anyhow::Error {
        match e.downcast::<ServerError>() {
            Ok(mut refused)
                if refused.status == StatusCode::UNAUTHORIZED.as_u16()
                    || refused.status == StatusCode::FORBIDDEN.as_u16() =>
            {
                refused.hint = format!(
                    " (token: {}; pass --token, set BOOTFLEET_TOKEN, or give the server's --config or --data-dir)",
                    self.token_source
                );
                refused.into()
            }
            Ok(other) => other.into(),
            Err(e) => e,
        }
    }
}

/// The server answered with an error status.
#[derive(Debug, thiserror::Error)]
#[error("server refused ({status}): {reason}{hint}")]
pub struct ServerError {
    pub status: u16,
    pub reason: String,
    pub hint: String,
}

/// The command line asked for something that cannot be done as asked.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct UsageError(pub String);

/// What kind of failure an admin command ended with: its exit status and its name in a
/// JSON error.
pub fn classify(e: &anyhow::Error) -> (u8, &'static str, Option<u16>) {
    if let Some(refused) = e.downcast_ref::<ServerError>() {
        return match refused.status {
            404 => (3, "not-found", Some(404)),
            s if s >= 500 => (5, "unavailable", Some(s)),
            s => (4, "refused", Some(s)),
        };
    }
    if e.downcast_ref::<UsageError>().is_some() {
        return (2, "usage", None);
    }
    let unreachable = e.chain().any(|cause| {
        cause
            .downcast_ref::<reqwest::Error>()
            .is_some_and(|r| r.is_connect() || r.is_timeout())
    });
    if unreachable {
        return (5, "unreachable", None);
    }
    (1, "failed", None)
}
