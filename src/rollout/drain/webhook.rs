//! A scheduler behind an HTTP endpoint of the operator's: every call a POST of
//! `{"action": "drain"|"status"|"resume", "node": {mac, hostname, labels}, "reason"}`,
//! signed as event webhooks are (`X-Bootfleet-Signature: t=<unix>,v1=<hex HMAC-SHA256(
//! secret, "<t>.<body>")>`, `events::webhook::sign`), so the receiver knows the drain
//! request is ours. `status` is answered `{"state": "drained"|"draining"|"not-draining"}`;
//! any answer but a 2xx is an error with its status.

use std::path::PathBuf;
use std::time::Duration;

use async_trait::async_trait;
use serde::{Deserialize, Serialize};

use super::{Drain, DrainError, Scheduler, Target};

/// `[drain.webhook]`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookSettings {
    /// The endpoint: http:// or https://.
    pub url: String,
    /// A file holding the shared secret (one line; surrounding whitespace is ignored).
    pub secret_file: PathBuf,
    #[serde(default = "default_timeout_secs")]
    pub timeout_secs: u64,
}

fn default_timeout_secs() -> u64 {
    30
}

pub struct Webhook {
    url: reqwest::Url,
    secret: Vec<u8>,
    http: reqwest::Client,
}

/// Never the secret.
impl std::fmt::Debug for Webhook {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Webhook")
            .field("url", &shown(&self.url))
            .finish()
    }
}

#[derive(Serialize)]
struct Call<'a> {
    action: &'a str,
    node: NodeOf<'a>,
    reason: &'a str,
}

#[derive(Serialize)]
struct NodeOf<'a> {
    mac: String,
    hostname: Option<&'a str>,
    labels: &'a std::collections::BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct StatusAnswer {
    state: String,
}

impl Webhook {
    /// Checks the URL and reads the secret: a bad setting stops the server at start.
    pub fn load(s: &WebhookSettings) -> Result<Self, DrainError> {
        let url = reqwest::Url::parse(&s.url)
            .ok()
            .filter(|u| matches!(u.scheme(), "http" | "https") && u.host().is_some())
            .ok_or_else(|| {
                // Not quoted: a URL may carry a login.
                DrainError("[drain.webhook] url is not http(s)://host/path".into())
            })?;
        let secret = std::fs::read_to_string(&s.secret_file).map_err(|e| {
            DrainError(format!(
                "[drain.webhook] secret_file {}: {e}",
                s.secret_file.display()
            ))
        })?;
        let secret = secret.trim();
        if secret.is_empty() {
            return Err(DrainError(format!(
                "[drain.webhook] secret_file {} is empty",
                s.secret_file.display()
            )));
        }
        let http = crate::http_client::builder()
            .timeout(Duration::from_secs(s.timeout_secs.max(1)))
            .build()
            .map_err(|e| DrainError(format!("[drain.webhook] client: {e}")))?;
        Ok(Self {
            url,
            secret: secret.as_bytes().to_vec(),
            http,
        })
    }

    async fn call(&self, action: &str, node: &Target, reason: &str) -> Result<String, DrainError> {
        let body = serde_json::to_vec(&Call {
            action,
            node: NodeOf {
                mac: node.mac.to_string(),
                hostname: node.hostname.as_deref(),
                labels: &node.labels,
            },
            reason,
        })
        .expect("a call serialises");
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let signature = crate::events::webhook::sign(&self.secret, now, &body);
        let what = format!("drain webhook {} {action}", shown(&self.url));
        let r = self
            .http
            .post(self.url.clone())
            .header("Content-Type", "application/json")
            .header(crate::events::webhook::SIGNATURE_HEADER, signature)
            .body(body)
            .send()
            .await
            // reqwest's error text quotes the whole URL: only its kind is passed on.
            .map_err(|e| {
                let kind = if e.is_timeout() {
                    "no answer in time"
                } else if e.is_connect() {
                    "cannot connect"
                } else {
                    "request failed"
                };
                DrainError(format!("{what}: {kind}"))
            })?;
        let status = r.status();
        let text = r.text().await.unwrap_or_default();
        if !status.is_success() {
            let cut: String = text.chars().take(200).collect();
            return Err(DrainError(format!("{what}: {status} ({cut})")));
        }
        Ok(text)
    }
}

/// The URL as errors and logs show it: scheme, host, port and path, never a login or a
/// query (either may carry a token).
fn shown(url: &reqwest::Url) -> String {
    let port = url.port().map(|p| format!(":{p}")).unwrap_or_default();
    format!(
        "{}://{}{port}{}",
        url.scheme(),
        url.host_str().unwrap_or(""),
        url.path()
    )
}

/// The answer to `status`.
pub fn parse_status(text: &str) -> Result<Drain, DrainError> {
    let state = serde_json::from_str::<StatusAnswer>(text)
        .map(|a| a.state)
        .unwrap_or_default();
    match Drain::from_word(&state) {
        Some(drain) => Ok(drain),
        None => Err(DrainError(format!(
            "drain webhook status answered {:?}, not {{\"state\": drained|draining|not-draining}}",
            text.chars().take(100).collect::<String>()
        ))),
    }
}

#[async_trait]
impl Scheduler for Webhook {
    async fn drain(&self, node: &Target, reason: &str) -> Result<(), DrainError> {
        self.call("drain", node, reason).await.map(drop)
    }
    async fn state(&self, node: &Target) -> Result<Drain, DrainError> {
        parse_status(&self.call("status", node, "").await?)
    }
    async fn resume(&self, node: &Target, reason: &str) -> Result<(), DrainError> {
        self.call("resume", node, reason).await.map(drop)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn status_answers() {
        assert_eq!(
            parse_status(r#"{"state":"drained"}"#).unwrap(),
            Drain::Drained
        );
        assert_eq!(
            parse_status(r#"{"state":"draining","pods":3}"#).unwrap(),
            Drain::Draining
        );
        assert_eq!(
            parse_status(r#"{"state":"not-draining"}"#).unwrap(),
            Drain::NotDraining
        );
        assert!(parse_status("drained").is_err());
        assert!(parse_status(r#"{"state":"done"}"#).is_err());
    }

    #[test]
    fn a_bad_url_or_an_empty_secret_is_refused_at_load() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("s");
        std::fs::write(&secret, " \n").unwrap();
        let s = |url: &str| WebhookSettings {
            url: url.into(),
            secret_file: secret.clone(),
            timeout_secs: 5,
        };
        assert!(
            Webhook::load(&s("ftp://x/"))
                .unwrap_err()
                .0
                .contains("not http")
        );
        assert!(
            Webhook::load(&s("http://127.0.0.1:9/drain"))
                .unwrap_err()
                .0
                .contains("empty")
        );
        std::fs::write(&secret, "k3y\n").unwrap();
        let w = Webhook::load(&s("http://u:pw@127.0.0.1:9/drain?token=t0k")).unwrap();
        let shown = format!("{w:?}");
        assert!(
            !shown.contains("k3y") && !shown.contains("pw") && !shown.contains("t0k"),
            "{shown}"
        );
    }
}
