//! The operator's console in a real browser: Debian's Chromium, headless, driven through
//! chromedriver (WebDriver). An operator logs in, sees the fleet, opens the node that
//! failed validation and reads the failing GPU and check, reimages it with a reason and
//! watches its state change without a reload, then rolls a tag back. A screenshot of
//! each page is written to `target/ui-screenshots/`. Without a session, or across sites,
//! the admin API refuses.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fantoccini::{Client, ClientBuilder, Locator};
use serde_json::{Value, json};

use crate::fake_node::{FakeNode, healthy};
use crate::harness::*;
use crate::oci::port_for_a_child as free_port;

const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// chromedriver on a port of its own, killed when dropped.
struct Driver {
    child: Child,
    url: String,
    _profile: tempfile::TempDir,
}

impl Drop for Driver {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Driver {
    async fn start() -> Driver {
        for tool in [CHROMIUM, CHROMEDRIVER] {
            assert!(
                Path::new(tool).exists(),
                "{tool} is missing: apt-get install chromium chromium-driver"
            );
        }
        let http = reqwest::Client::new();
        for _ in 0..3 {
            let port = free_port();
            let child = Command::new(CHROMEDRIVER)
                .arg(format!("--port={port}"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap();
            let mut driver = Driver {
                child,
                url: format!("http://127.0.0.1:{port}"),
                _profile: tempfile::tempdir().unwrap(),
            };
            for _ in 0..100 {
                if driver.child.try_wait().unwrap().is_some() {
                    break;
                }
                let up = http.get(format!("{}/status", driver.url)).send().await;
                if up.is_ok_and(|r| r.status().is_success()) {
                    return driver;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
        panic!("chromedriver did not start");
    }

    /// A headless Chromium that reaches nothing but loopback.
    async fn browser(&self) -> Client {
        let args = [
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--window-size=1400,1000",
        ]
        .map(String::from)
        .into_iter()
        .chain([format!(
            "--user-data-dir={}",
            self._profile.path().display()
        )])
        .collect::<Vec<_>>();
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            json!({ "binary": CHROMIUM, "args": args }),
        );
        let connector = hyper_util::client::legacy::connect::HttpConnector::new();
        ClientBuilder::new(connector)
            .capabilities(caps)
            .connect(&self.url)
            .await
            .expect("a WebDriver session")
    }
}

fn screenshots() -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("target/ui-screenshots");
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

async fn shot(c: &Client, name: &str) {
    let png = c.screenshot().await.unwrap();
    assert!(png.starts_with(b"\x89PNG"), "a PNG");
    std::fs::write(screenshots().join(format!("{name}.png")), png).unwrap();
}

async fn click(c: &Client, id: &str) {
    c.find(Locator::Id(id))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
}

async fn type_into(c: &Client, id: &str, text: &str) {
    let e = c.find(Locator::Id(id)).await.unwrap();
    e.clear().await.unwrap();
    e.send_keys(text).await.unwrap();
}

/// Waits until `css` is on the page and its text satisfies `ok`; returns the text.
async fn text_when(c: &Client, css: &str, ok: impl Fn(&str) -> bool) -> String {
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let mut last = String::new();
    while std::time::Instant::now() < deadline {
        if let Ok(e) = c.find(Locator::Css(css)).await
            && let Ok(t) = e.text().await
        {
            if ok(&t) {
                return t;
            }
            last = t;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{css}: never as wanted; last seen {last:?}");
}

async fn publish_tagged(server: &TestServer, version: &str, seed: u64) -> Value {
    let (status, image) = server
        .publish_query(
            good_bundle("demo", version, &noise(10_000, seed)),
            "?tag=demo:stable",
        )
        .await;
    assert_eq!(status, 201, "{image}");
    image
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operator_finds_a_failed_gpu_reimages_the_node_and_rolls_a_tag_back() {
    let server = TestServer::start_configured(|cfg| {
        cfg.lifecycle.validation_reimages = 0;
        cfg.budget.max_total = 10;
        cfg.metrics.group_labels = vec!["rack".into()];
    })
    .await;
    let v1 = publish_tagged(&server, "1.0", 1).await;
    // Three healthy nodes and one whose GPU 7 is missing.
    for i in 1..=4 {
        let mac = format!("52-54-00-00-50-0{i}");
        let node = FakeNode::new(&server, &mac);
        node.script().await;
        server.assign(&mac, "demo:stable").await;
        if i < 4 {
            node.boot_to_ready(&v1).await;
            continue;
        }
        let boot = node.boot().await;
        let artifacts = node.fetch_all(&boot).await;
        node.attest(&boot, node.report(&boot, &v1, &artifacts))
            .await;
        let mut seven = healthy();
        seven["gpus"].as_array_mut().unwrap().pop();
        let (status, verdict) = node.validate(&boot, seven).await;
        assert_eq!((status, &verdict["passed"]), (200, &json!(false)));
        // The failure policy (no reimage attempts here) holds it for a human.
        assert_eq!(node.state().await, "quarantined");
    }
    let v2 = publish_tagged(&server, "2.0", 2).await;

    let driver = Driver::start().await;
    let c = driver.browser().await;
    let base = format!("http://{}", server.addr);

    // Log in: the token goes in a form, never in the URL.
    c.goto(&format!("{base}/ui/")).await.unwrap();
    let token = c.wait().for_element(Locator::Id("token")).await.unwrap();
    shot(&c, "0-login").await;
    token.send_keys("not-the-token-at-all").await.unwrap();
    click(&c, "login").await;
    text_when(&c, "#login-error", |t| t.contains("refused")).await;
    type_into(&c, "token", &server.token).await;
    click(&c, "login").await;
    text_when(&c, "#whoami", |t| t == "admin (admin)").await;
    assert!(
        !c.current_url()
            .await
            .unwrap()
            .as_str()
            .contains(&server.token)
    );

    // The fleet: three ready, one quarantined after failing validation, listed as not
    // ready with why.
    text_when(&c, "#state-ready .n", |t| t == "3").await;
    text_when(&c, "#state-quarantined .n", |t| t == "1").await;
    let why = text_when(&c, "#not-ready", |t| t.contains("52:54:00:00:50:04")).await;
    assert!(why.contains("failed validation"), "{why}");
    shot(&c, "1-fleet").await;

    // The node list, filtered server-side.
    c.goto(&format!("{base}/ui/#/nodes?state=ready"))
        .await
        .unwrap();
    let count = text_when(&c, "#node-count", |t| t.contains("of 3")).await;
    assert_eq!(count, "1-3 of 3");
    shot(&c, "2-nodes").await;

    // The failed node: its failing GPU and check.
    c.goto(&format!("{base}/ui/#/node/52:54:00:00:50:04"))
        .await
        .unwrap();
    text_when(&c, "#node-state", |t| t == "quarantined").await;
    let failure = text_when(&c, "#validation", |t| t.contains("gpu-count")).await;
    assert!(
        failure.contains("node") || failure.contains("GPU"),
        "{failure}"
    );
    shot(&c, "3-node-failed").await;

    // Assign: a REF that does not resolve is refused with the server's reason; one that
    // does is recorded for the next boot.
    type_into(&c, "assign-ref", "nope:9").await;
    click(&c, "assign").await;
    text_when(&c, "#status", |t| t.starts_with("assign:")).await;
    type_into(&c, "assign-ref", "demo:2.0").await;
    click(&c, "assign").await;
    text_when(&c, "#status", |t| t.contains("assigned demo:2.0")).await;
    let (_, node) = server.json("/api/v1/nodes/52:54:00:00:50:04").await;
    assert_eq!(node["assigned"], "demo:2.0");

    // Reimage without a reason: refused in the page. With one: the state changes live.
    click(&c, "reimage").await;
    text_when(&c, "#status", |t| t.contains("needs a reason")).await;
    type_into(&c, "reimage-reason", "GPU 7 missing from the bus").await;
    // The page must not reload: a marker set now survives only without one.
    c.execute("window.__still_here = true;", vec![])
        .await
        .unwrap();
    click(&c, "reimage").await;
    text_when(&c, "#node-state", |t| t == "reimaging").await;
    let (_, node) = server.json("/api/v1/nodes/52:54:00:00:50:04").await;
    assert_eq!(node["state"], "reimaging");
    let reason = node["history"].as_array().unwrap().last().unwrap()["reason"].clone();
    assert!(
        reason.as_str().unwrap().contains("GPU 7 missing"),
        "{reason}"
    );
    // Then the node boots again (as its agent would after the reboot) and the page
    // follows over the event stream.
    let node = FakeNode::new(&server, "52-54-00-00-50-04");
    node.boot_to_ready(&v2).await;
    text_when(&c, "#node-state", |t| t == "ready").await;
    let kept = c
        .execute("return window.__still_here === true;", vec![])
        .await
        .unwrap();
    assert_eq!(kept, json!(true), "the page reloaded");
    shot(&c, "4-node-ready-live").await;

    // Images: demo:stable points at 2.0; roll it back to 1.0.
    c.goto(&format!("{base}/ui/#/images")).await.unwrap();
    let current = text_when(&c, "td.tag-digest", |t| t.starts_with("sha256:")).await;
    assert_eq!(current, v2["digest"].as_str().unwrap());
    shot(&c, "5-images").await;
    c.find(Locator::Css("button.rollback[data-version='1.0']"))
        .await
        .unwrap()
        .click()
        .await
        .unwrap();
    let v1_digest = v1["digest"].as_str().unwrap().to_string();
    text_when(&c, "td.tag-digest", |t| t == v1_digest).await;
    let (_, tags) = server.json("/api/v1/tags").await;
    assert_eq!(tags[0]["digest"], v1["digest"], "{tags}");
    c.goto(&format!("{base}/ui/#/rollouts")).await.unwrap();
    text_when(&c, "#view", |t| t.contains("No rollout yet")).await;
    shot(&c, "6-rollouts").await;

    // Logging out ends the page's session.
    click(&c, "logout").await;
    c.wait().for_element(Locator::Id("token")).await.unwrap();
    c.close().await.unwrap();
}

/// The API with the console's session: reads need only the cookie; a write needs the
/// CSRF header too, and a request from another site (its Origin) is refused, as is a
/// forged or expired cookie. The console's page forbids framing and inline script.
#[tokio::test]
async fn the_console_session_is_safe_against_csrf() {
    let server = TestServer::start().await;
    let http = reqwest::Client::new();
    let url = |p: &str| format!("http://{}{p}", server.addr);
    let page = http.get(url("/ui/")).send().await.unwrap();
    assert_eq!(page.status(), 200);
    let csp = page.headers()["content-security-policy"]
        .to_str()
        .unwrap()
        .to_string();
    assert!(
        csp.contains("frame-ancestors 'none'") && csp.contains("script-src 'self'"),
        "{csp}"
    );

    let bad = http
        .post(url("/ui/login"))
        .json(&json!({ "token": "wrong-token-but-long" }))
        .send()
        .await
        .unwrap();
    assert_eq!(bad.status(), 403);
    assert!(bad.headers().get("set-cookie").is_none());
    let r = http
        .post(url("/ui/login"))
        .json(&json!({ "token": server.token }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let set = r.headers()["set-cookie"].to_str().unwrap().to_string();
    assert!(
        set.contains("HttpOnly") && set.contains("SameSite=Strict"),
        "{set}"
    );
    assert!(!set.contains(&server.token), "the cookie is not the token");
    let cookie = set.split(';').next().unwrap().to_string();
    let csrf = r.json::<Value>().await.unwrap()["csrf"]
        .as_str()
        .unwrap()
        .to_string();

    let get = |c: &str| http.get(url("/api/v1/nodes")).header("cookie", c).send();
    assert_eq!(get(&cookie).await.unwrap().status(), 200);
    assert_eq!(get("bootfleet_session=1.00").await.unwrap().status(), 401);
    let expired = cookie.replacen('=', "=1.", 1);
    assert_eq!(get(&expired).await.unwrap().status(), 401);
    assert_eq!(
        http.get(url("/api/v1/nodes"))
            .send()
            .await
            .unwrap()
            .status(),
        401
    );

    let revalidate = |headers: Vec<(&'static str, String)>| {
        let mut r = http.post(url("/api/v1/nodes/52:54:00:00:60:01/revalidate"));
        for (k, v) in headers {
            r = r.header(k, v);
        }
        r.send()
    };
    // A cross-site form post: the cookie (were it sent) but no CSRF header.
    let form = revalidate(vec![
        ("cookie", cookie.clone()),
        ("origin", "http://evil.example".into()),
        ("content-type", "application/x-www-form-urlencoded".into()),
    ]);
    assert_eq!(form.await.unwrap().status(), 403);
    let other_site = revalidate(vec![
        ("cookie", cookie.clone()),
        ("x-bootfleet-csrf", csrf.clone()),
        ("origin", "http://evil.example".into()),
    ]);
    assert_eq!(other_site.await.unwrap().status(), 403);
    let wrong_csrf = revalidate(vec![
        ("cookie", cookie.clone()),
        ("x-bootfleet-csrf", "00".into()),
    ]);
    assert_eq!(wrong_csrf.await.unwrap().status(), 403);
    // Ours: past the check (the node does not exist).
    let ours = revalidate(vec![
        ("cookie", cookie.clone()),
        ("x-bootfleet-csrf", csrf.clone()),
        ("origin", format!("http://{}", server.addr)),
    ]);
    assert_eq!(ours.await.unwrap().status(), 404);
    let session = http
        .get(url("/ui/session"))
        .header("cookie", &cookie)
        .send()
        .await
        .unwrap();
    assert_eq!(
        session.json::<Value>().await.unwrap()["csrf"],
        csrf.as_str()
    );
    let out = http.post(url("/ui/logout")).send().await.unwrap();
    assert!(
        out.headers()["set-cookie"]
            .to_str()
            .unwrap()
            .contains("Max-Age=0")
    );
}
