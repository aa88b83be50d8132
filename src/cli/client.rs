//! The admin HTTP client: base URL, bearer token, and server errors turned into messages.

use std::path::Path;

use anyhow::{Context, bail};
use reqwest::{RequestBuilder, Response, StatusCode};
use serde::de::DeserializeOwned;

use crate::auth::{AdminToken, TOKEN_FILE_NAME};
use crate::config::DEFAULT_DATA_DIR;

pub struct Client {
    pub http: reqwest::Client,
    base: String,
    token: Option<String>,
}

impl Client {
    /// The admin token found, if any.
    pub fn token(&self) -> Option<&str> {
        self.token.as_deref()
    }

    /// Token: `--token`/`BOOTFLEET_TOKEN`, else `<data-dir>/admin.token` if readable.
    pub fn new(
        server: &str,
        token: Option<String>,
        data_dir: Option<&Path>,
    ) -> anyhow::Result<Self> {
        let token = token.or_else(|| {
            let dir = data_dir.unwrap_or(Path::new(DEFAULT_DATA_DIR));
            AdminToken::read(&dir.join(TOKEN_FILE_NAME))
                .ok()
                .map(|t| t.secret().to_string())
        });
        let base = server.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            bail!("--server must be an http:// URL, got {server:?}");
        }
        let http = reqwest::Client::builder()
            .user_agent(concat!("bootfleet-cli/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(Self { http, base, token })
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
        Self::decode(response).await
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
        let hint = match status {
            StatusCode::UNAUTHORIZED => {
                " (pass --token, set BOOTFLEET_TOKEN, or point --data-dir at the server's data directory)"
            }
            _ => "",
        };
        bail!("server refused ({status}): {reason}{hint}")
    }
}
