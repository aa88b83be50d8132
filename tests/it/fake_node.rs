//! A fake node and its agent, driving the boot routes as a real one would: it fetches its
//! script, downloads what the script names (with the `?boot=` the script carries), and
//! posts attestation, validation and heartbeats with its boot token.

use bootfleet::api::Digest;
use serde_json::{Value, json};

use crate::harness::TestServer;

pub struct FakeNode<'a> {
    pub server: &'a TestServer,
    /// aa-bb-cc-dd-ee-ff, as iPXE's ${mac:hexhyp} sends it.
    pub mac: String,
}

/// One boot, as the node saw it.
#[derive(Clone, Debug)]
pub struct Boot {
    pub id: String,
    pub token: String,
    pub script: String,
    /// The kernel's command line as the script passes it.
    pub cmdline: String,
    /// Kernel first, then initrds.
    pub urls: Vec<String>,
}

impl Boot {
    /// The script line that loads the kernel (the first try).
    pub fn kernel_line(&self) -> &str {
        self.script
            .lines()
            .find(|l| l.starts_with("kernel "))
            .unwrap()
    }
}

/// The word of `script` after `key`.
pub fn field<'s>(script: &'s str, key: &str) -> &'s str {
    script
        .split_whitespace()
        .find_map(|w| w.strip_prefix(key))
        .unwrap_or_else(|| panic!("{key} not in {script}"))
}

/// A boot script that boots an image, as a node reads it (panics on any other).
pub fn parse_boot(script: String) -> Boot {
    let first_word_after = |prefix: &str| -> Vec<String> {
        let mut seen = Vec::new();
        for line in script.lines() {
            if let Some(rest) = line.strip_prefix(prefix) {
                let url = rest
                    .split_whitespace()
                    .find(|w| w.starts_with("http://"))
                    .unwrap()
                    .to_string();
                if !seen.contains(&url) {
                    seen.push(url);
                }
            }
        }
        seen
    };
    let mut urls = first_word_after("kernel ");
    urls.extend(first_word_after("initrd "));
    let kernel_line = script.lines().find(|l| l.starts_with("kernel ")).unwrap();
    let cmdline = kernel_line
        .split_whitespace()
        .skip(2)
        .take_while(|w| *w != "&&")
        .collect::<Vec<_>>()
        .join(" ");
    Boot {
        id: field(&script, "bootfleet.boot=").to_string(),
        token: field(&script, "bootfleet.token=").to_string(),
        cmdline,
        urls,
        script,
    }
}

/// A healthy 8-GPU HGX H100 validation report (tests/fixtures/gpu/hgx-h100-healthy.json).
pub fn healthy() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/gpu/hgx-h100-healthy.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// The reason of the node's latest change to validation-failed (panics if there is none).
pub fn validation_failure(node: &Value) -> String {
    node["history"]
        .as_array()
        .unwrap()
        .iter()
        .rev()
        .find(|h| h["to"] == "validation-failed")
        .unwrap_or_else(|| panic!("never validation-failed: {node}"))["reason"]
        .as_str()
        .unwrap()
        .to_string()
}

/// The UUIDs of the first `n` GPUs of `healthy()`.
pub fn gpu_uuids(n: usize) -> Vec<String> {
    healthy()["gpus"].as_array().unwrap()[..n]
        .iter()
        .map(|g| g["uuid"].as_str().unwrap().to_string())
        .collect()
}

impl<'a> FakeNode<'a> {
    pub fn new(server: &'a TestServer, mac: &str) -> Self {
        Self {
            server,
            mac: mac.into(),
        }
    }

    pub fn colons(&self) -> String {
        self.mac.replace('-', ":")
    }

    /// The script for this node: 200 and its text.
    pub async fn script(&self) -> String {
        let r = reqwest::get(
            self.server
                .url(&format!("/boot/node.ipxe?mac={}", self.mac)),
        )
        .await
        .unwrap();
        assert_eq!(r.status(), 200);
        r.text().await.unwrap()
    }

    /// Gets a boot script that boots an image (panics on any other).
    pub async fn boot(&self) -> Boot {
        parse_boot(self.script().await)
    }

    /// Downloads everything the script names, as iPXE does; returns their digests.
    pub async fn fetch_all(&self, boot: &Boot) -> Vec<Digest> {
        let mut digests = Vec::new();
        for url in &boot.urls {
            let r = reqwest::get(url).await.unwrap();
            assert_eq!(r.status(), 200, "{url}");
            // iPXE drops its pooled connections silently on `boot`: the server ends them.
            assert_eq!(
                r.headers().get("connection").map(|v| v.as_bytes()),
                Some(&b"close"[..]),
                "a boot's download ends its connection: {url}"
            );
            digests.push(Digest::of(&r.bytes().await.unwrap()));
        }
        digests
    }

    /// A faithful attestation report for `boot` of `image`.
    pub fn report(&self, boot: &Boot, image: &Value, artifacts: &[Digest]) -> Value {
        json!({
            "image_digest": image["digest"],
            "kernel_release": "6.1.0-28-cloud-amd64",
            "cmdline": boot.cmdline,
            "versions": { "nvidia-driver": "550.127.05" },
            "modules": { "nvidia": "550.127.05" },
            "artifacts": artifacts.iter().map(|d| d.to_string()).collect::<Vec<_>>(),
        })
    }

    pub(crate) async fn agent_post(&self, route: &str, token: &str, body: Value) -> (u16, Value) {
        let r = self
            .server
            .http
            .post(self.server.url(route))
            .bearer_auth(token)
            .json(&body)
            .send()
            .await
            .unwrap();
        let status = r.status().as_u16();
        let text = r.text().await.unwrap();
        (
            status,
            serde_json::from_str(&text).unwrap_or(Value::String(text)),
        )
    }

    pub async fn attest(&self, boot: &Boot, report: Value) -> (u16, Value) {
        let body = json!({ "boot_id": boot.id, "mac": self.colons(), "report": report });
        self.agent_post("/api/v1/agent/attest", &boot.token, body)
            .await
    }

    pub async fn validate(&self, boot: &Boot, report: Value) -> (u16, Value) {
        let body = json!({ "boot_id": boot.id, "mac": self.colons(), "report": report });
        self.agent_post("/api/v1/agent/validate", &boot.token, body)
            .await
    }

    pub async fn heartbeat(&self, boot: &Boot, facts: Option<Value>) -> (u16, Value) {
        let mut body = json!({ "boot_id": boot.id, "mac": self.colons() });
        if let Some(f) = facts {
            body["facts"] = f;
        }
        self.agent_post("/api/v1/agent/heartbeat", &boot.token, body)
            .await
    }

    /// Boots `image` all the way to ready with 8 healthy GPUs; returns the boot.
    pub async fn boot_to_ready(&self, image: &Value) -> Boot {
        let boot = self.boot().await;
        let artifacts = self.fetch_all(&boot).await;
        let (status, verdict) = self
            .attest(&boot, self.report(&boot, image, &artifacts))
            .await;
        assert_eq!(
            (status, &verdict["passed"]),
            (200, &json!(true)),
            "{verdict}"
        );
        let (status, verdict) = self.validate(&boot, healthy()).await;
        assert_eq!(
            (status, &verdict["passed"]),
            (200, &json!(true)),
            "{verdict}"
        );
        assert_eq!(self.state().await, "ready");
        boot
    }

    pub async fn node(&self) -> Value {
        let (status, node) = self
            .server
            .json(&format!("/api/v1/nodes/{}", self.mac))
            .await;
        assert_eq!(status, 200);
        node
    }

    pub async fn state(&self) -> String {
        self.node().await["state"].as_str().unwrap().to_string()
    }
}
