//! Webhook delivery: the event log, in order, to each configured URL, at least once.
//! One sender per URL keeps a cursor in the database; it posts the events after the
//! cursor as one batch, and moves the cursor only when the receiver answered 2xx, so a
//! failure is retried (with back-off) and a restart resumes where delivery stopped.
//! Order is the log's order, hence in order per node; a receiver must accept a batch it
//! has seen (after a lost answer) and can drop events by `seq`.
//!
//! Each request is signed: `X-Bootfleet-Signature: t=<unix seconds>,v1=<hex>` where
//! hex = HMAC-SHA256(secret, "<t>.<body>"). The time stamp lets a receiver refuse old
//! replays; `verify` is what a receiver does.

use std::path::PathBuf;
use std::time::Duration;

use hmac::{Hmac, Mac as _};
use serde::Deserialize;
use sha2::Sha256;
use tokio_util::sync::CancellationToken;

use crate::api::event::Event;
use crate::store::Store;

pub const SIGNATURE_HEADER: &str = "x-bootfleet-signature";
/// Events per request.
const BATCH: i64 = 100;
const FIRST_RETRY: Duration = Duration::from_millis(500);
const MAX_RETRY: Duration = Duration::from_secs(60);
const REQUEST_TIMEOUT: Duration = Duration::from_secs(10);
/// Other servers sharing the database write events this process is not told about.
const POLL: Duration = Duration::from_secs(2);

/// `[[webhooks]]` in the settings file.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct WebhookConfig {
    /// `https://` (or `http://`, where the signature alone protects the events).
    pub url: String,
    /// A file holding the shared secret (one line; surrounding whitespace is ignored).
    pub secret_file: PathBuf,
    /// PEM file of the CA that signed the receiver's certificate, for an `https://` url
    /// [default: the system's roots].
    #[serde(default)]
    pub ca_file: Option<PathBuf>,
}

#[derive(Debug, thiserror::Error)]
pub enum WebhookError {
    #[error("webhook url {0:?} must be https://host[:port]/path or http://host[:port]/path")]
    Url(String),
    #[error("webhook ca_file {path}: {reason}")]
    Ca { path: PathBuf, reason: String },
    #[error("webhook secret file {path}: {reason}")]
    Secret { path: PathBuf, reason: String },
}

/// A checked webhook, ready to run.
#[derive(Clone)]
pub struct Webhook {
    pub url: String,
    secret: Vec<u8>,
    /// The CA certificates to trust (PEM), when `ca_file` is set.
    ca: Option<String>,
}

impl Webhook {
    pub fn load(cfg: &WebhookConfig) -> Result<Self, WebhookError> {
        let url = reqwest::Url::parse(&cfg.url).map_err(|_| WebhookError::Url(cfg.url.clone()))?;
        if !matches!(url.scheme(), "http" | "https") || url.host().is_none() {
            return Err(WebhookError::Url(cfg.url.clone()));
        }
        let secret_err = |reason: String| WebhookError::Secret {
            path: cfg.secret_file.clone(),
            reason,
        };
        let secret = std::fs::read_to_string(&cfg.secret_file)
            .map_err(|e| secret_err(e.to_string()))?
            .trim()
            .as_bytes()
            .to_vec();
        if secret.len() < 16 {
            return Err(secret_err(
                "the secret must be at least 16 characters".into(),
            ));
        }
        let ca = match &cfg.ca_file {
            Some(path) => {
                let ca_err = |reason: String| WebhookError::Ca {
                    path: path.clone(),
                    reason,
                };
                let pem = std::fs::read_to_string(path).map_err(|e| ca_err(e.to_string()))?;
                crate::http_client::ca_roots(&pem).map_err(ca_err)?;
                Some(pem)
            }
            None => None,
        };
        Ok(Self {
            url: cfg.url.clone(),
            secret,
            ca,
        })
    }

    fn client(&self) -> reqwest::Client {
        let builder = match &self.ca {
            Some(pem) => crate::http_client::trusting(pem).expect("checked at load"),
            None => crate::http_client::builder(),
        };
        builder
            .timeout(REQUEST_TIMEOUT)
            .build()
            .expect("HTTP client builds")
    }
}

fn mac_of(secret: &[u8], timestamp: u64, body: &[u8]) -> Hmac<Sha256> {
    let mut mac = Hmac::<Sha256>::new_from_slice(secret).expect("HMAC takes any key length");
    mac.update(timestamp.to_string().as_bytes());
    mac.update(b".");
    mac.update(body);
    mac
}

/// The signature header's value for `body` sent at `timestamp` (unix seconds).
pub fn sign(secret: &[u8], timestamp: u64, body: &[u8]) -> String {
    let tag = mac_of(secret, timestamp, body).finalize().into_bytes();
    format!("t={timestamp},v1={}", hex::encode(tag))
}

/// What a receiver checks: a well-formed header whose HMAC matches (in constant time).
/// Returns the signed time stamp, for the receiver's own freshness rule.
pub fn verify(secret: &[u8], header: &str, body: &[u8]) -> Option<u64> {
    let mut timestamp = None;
    let mut tag = None;
    for part in header.split(',') {
        match part.trim().split_once('=') {
            Some(("t", t)) => timestamp = t.parse::<u64>().ok(),
            Some(("v1", h)) => tag = hex::decode(h).ok(),
            _ => {}
        }
    }
    let timestamp = timestamp?;
    mac_of(secret, timestamp, body)
        .verify_slice(&tag?)
        .ok()
        .map(|()| timestamp)
}

/// Delivers to one webhook until `stop`.
/// Delivers while this server holds the webhook role (`leader::WEBHOOKS`): among servers
/// sharing a store, one sends, in order, and another takes over if it dies.
pub async fn run(
    hook: Webhook,
    store: Store,
    mut leading: tokio::sync::watch::Receiver<bool>,
    stop: CancellationToken,
) {
    let client = hook.client();
    let mut wake = store.subscribe_events();
    let mut retry = FIRST_RETRY;
    loop {
        if stop.is_cancelled() || !crate::leader::until_leading(&mut leading, &stop).await {
            return;
        }
        wake.borrow_and_update();
        let wait = match deliver_next(&hook, &store, &client).await {
            Ok(true) => {
                retry = FIRST_RETRY;
                continue;
            }
            Ok(false) => POLL,
            Err(reason) => {
                tracing::warn!(url = %hook.url, %reason, retry_in = ?retry, "webhook delivery failed");
                let wait = retry;
                retry = (retry * 2).min(MAX_RETRY);
                // A failure waits its back-off in full: a new event must not hammer a
                // receiver that is down.
                tokio::select! {
                    () = tokio::time::sleep(wait) => continue,
                    () = stop.cancelled() => return,
                }
            }
        };
        tokio::select! {
            _ = wake.changed() => {}
            () = tokio::time::sleep(wait) => {}
            () = stop.cancelled() => return,
        }
    }
}

/// Sends the next batch; Ok(false) when there was nothing to send.
async fn deliver_next(
    hook: &Webhook,
    store: &Store,
    client: &reqwest::Client,
) -> Result<bool, String> {
    let cursor = match store
        .webhook_cursor(&hook.url)
        .await
        .map_err(|e| e.to_string())?
    {
        Some(c) => c,
        None => {
            // A new webhook starts with what happens from now on, not the whole history.
            let head = store.events_head().await.map_err(|e| e.to_string())?;
            store
                .set_webhook_cursor(&hook.url, head)
                .await
                .map_err(|e| e.to_string())?;
            head
        }
    };
    let events: Vec<Event> = store
        .events_since(cursor, BATCH, None)
        .await
        .map_err(|e| e.to_string())?;
    let Some(last) = events.last().map(|e| e.seq) else {
        return Ok(false);
    };
    let body =
        serde_json::to_vec(&crate::api::event::WebhookDelivery { events }).expect("serialises");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let response = client
        .post(&hook.url)
        .header(reqwest::header::CONTENT_TYPE, "application/json")
        .header(SIGNATURE_HEADER, sign(&hook.secret, now, &body))
        .body(body)
        .send()
        .await
        .map_err(|e| e.to_string())?;
    if !response.status().is_success() {
        return Err(format!("receiver answered {}", response.status()));
    }
    store
        .set_webhook_cursor(&hook.url, last)
        .await
        .map_err(|e| e.to_string())?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_signature_verifies_and_any_change_breaks_it() {
        let secret = b"0123456789abcdef";
        let header = sign(secret, 1_700_000_000, b"{\"events\":[]}");
        assert!(header.starts_with("t=1700000000,v1="));
        assert_eq!(
            verify(secret, &header, b"{\"events\":[]}"),
            Some(1_700_000_000)
        );
        assert_eq!(verify(secret, &header, b"{\"events\":[1]}"), None);
        assert_eq!(
            verify(b"another secret!!", &header, b"{\"events\":[]}"),
            None
        );
        let moved = header.replace("t=1700000000", "t=1700000001");
        assert_eq!(verify(secret, &moved, b"{\"events\":[]}"), None);
        assert_eq!(verify(secret, "garbage", b""), None);
    }

    /// The RFC 4231 test case 2 vector, through our framing: HMAC-SHA256("Jefe", data).
    #[test]
    fn the_hmac_is_standard_hmac_sha256() {
        let mut mac = Hmac::<Sha256>::new_from_slice(b"Jefe").unwrap();
        mac.update(b"what do ya want for nothing?");
        assert_eq!(
            hex::encode(mac.finalize().into_bytes()),
            "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843"
        );
    }

    #[test]
    fn only_http_and_https_urls_and_real_secrets_are_accepted() {
        let dir = tempfile::tempdir().unwrap();
        let secret = dir.path().join("s");
        std::fs::write(&secret, "  a-long-enough-secret\n").unwrap();
        let cfg = |url: &str| WebhookConfig {
            url: url.into(),
            secret_file: secret.clone(),
            ca_file: None,
        };
        let hook = Webhook::load(&cfg("http://127.0.0.1:9/hook")).unwrap();
        assert_eq!(hook.secret, b"a-long-enough-secret");
        assert!(Webhook::load(&cfg("https://x/hook")).is_ok());
        for bad in ["ftp://x", "not a url", "http://"] {
            assert!(
                matches!(Webhook::load(&cfg(bad)), Err(WebhookError::Url(_))),
                "{bad}"
            );
        }
        std::fs::write(&secret, "short").unwrap();
        assert!(matches!(
            Webhook::load(&cfg("http://x/")),
            Err(WebhookError::Secret { .. })
        ));
    }
}
