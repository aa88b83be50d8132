//! Named API tokens: every admin route against every role (a table kept apart from the
//! server's own), revocation at once, the audit trail naming the token for each write,
//! and failed authentications limited per source.

use std::collections::BTreeSet;

use crate::fake_node::FakeNode;
use crate::harness::*;

const MAC: &str = "52:54:00:00:00:01";

/// Each admin route (as the OpenAPI document names it) and the roles that may call it:
/// A admin, O operator, F fleet-controller, R read-only. Written out here, not derived
/// from `auth::roles`, so a change to the server's table has to change this one too.
const TABLE: &[(&str, &str, &str)] = &[
    ("GET", "/fleet", "AOFR"),
    ("GET", "/events", "AOFR"),
    ("GET", "/events/stream", "AOFR"),
    ("GET", "/nodes", "AOFR"),
    ("GET", "/nodes/{mac}", "AOFR"),
    ("GET", "/nodes/{mac}/health", "AOFR"),
    ("GET", "/openapi.json", "AOFR"),
    ("GET", "/images", "AOR"),
    ("GET", "/images/{reference}", "AOR"),
    ("GET", "/tags", "AOR"),
    ("GET", "/tags/{name}/{tag}/history", "AOR"),
    ("GET", "/bmcs", "AOR"),
    ("GET", "/nodes/{mac}/power", "AOR"),
    ("GET", "/rollouts", "AOR"),
    ("GET", "/rollouts/{id}", "AOR"),
    ("GET", "/tokens", "A"),
    ("POST", "/blobs/gc", "AO"),
    ("POST", "/blobs/verify", "AO"),
    ("POST", "/bmcs", "A"),
    ("DELETE", "/bmcs/{id}", "A"),
    ("POST", "/bmcs/{id}/power", "AO"),
    ("POST", "/images", "AO"),
    ("POST", "/images/import", "AO"),
    ("DELETE", "/images/{reference}", "AO"),
    ("DELETE", "/nodes/{mac}", "AO"),
    ("PUT", "/nodes/{mac}/bmc", "A"),
    ("DELETE", "/nodes/{mac}/bmc", "A"),
    ("PUT", "/nodes/{mac}/image", "AO"),
    ("PATCH", "/nodes/{mac}/labels", "AO"),
    ("GET", "/nodes/{mac}/tpm", "AOR"),
    ("PUT", "/nodes/{mac}/tpm", "A"),
    ("DELETE", "/nodes/{mac}/tpm", "A"),
    ("POST", "/nodes/{mac}/power", "AO"),
    ("POST", "/nodes/{mac}/reimage", "AOF"),
    ("POST", "/nodes/{mac}/revalidate", "AOF"),
    ("POST", "/rollouts", "AO"),
    ("POST", "/rollouts/{id}/{action}", "AO"),
    ("PUT", "/tags/{name}/{tag}", "AO"),
    ("POST", "/tokens", "A"),
    ("DELETE", "/tokens/{name}", "A"),
];

/// A path to send for a template: placeholders filled with things that do not exist,
/// so an allowed request is answered (4xx or 2xx) without changing anything that matters.
fn concrete(template: &str) -> String {
    template
        .replace("{mac}", MAC)
        .replace("{reference}", "nothing:1")
        .replace("{id}", "999")
        .replace("{name}", "nothing")
        .replace("{tag}", "t")
        .replace("{action}", "pause")
}

/// Creates a token as the admin; returns its secret.
async fn create(server: &TestServer, name: &str, role: &str) -> String {
    let r = server
        .post("/api/v1/tokens")
        .json(&serde_json::json!({ "name": name, "role": role }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201, "create {name}");
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["role"], role);
    let secret = body["token"].as_str().unwrap().to_string();
    assert!(secret.starts_with("bft_"), "{secret}");
    secret
}

#[tokio::test]
async fn every_admin_route_is_checked_against_every_role() {
    let server = TestServer::start().await;
    // The table covers every admin route the server documents.
    let doc: serde_json::Value = server.json("/api/v1/openapi.json").await.1;
    let mut documented = BTreeSet::new();
    for (path, item) in doc["paths"].as_object().unwrap() {
        let Some(route) = path.strip_prefix("/api/v1") else {
            continue;
        };
        if route.starts_with("/agent/") {
            continue;
        }
        for method in item.as_object().unwrap().keys() {
            documented.insert((method.to_uppercase(), route.to_string()));
        }
    }
    let tabled: BTreeSet<(String, String)> = TABLE
        .iter()
        .map(|(m, r, _)| (m.to_string(), r.to_string()))
        .collect();
    assert_eq!(documented, tabled, "the role table and the API differ");

    let mut tokens = vec![('A', server.token.clone())];
    for (letter, name, role) in [
        ('O', "ops", "operator"),
        ('F', "fleet-ctl", "fleet-controller"),
        ('R', "viewer", "read-only"),
    ] {
        tokens.push((letter, create(&server, name, role).await));
    }
    // The admin last: nothing the others may do changes what the admin's calls find.
    tokens.rotate_left(1);
    let mut wrong = Vec::new();
    for (letter, secret) in &tokens {
        for (method, template, allowed) in TABLE {
            let method: reqwest::Method = method.parse().unwrap();
            let r = server
                .http
                .request(
                    method.clone(),
                    server.url(&format!("/api/v1{}", concrete(template))),
                )
                .bearer_auth(secret)
                .json(&serde_json::json!({}))
                .send()
                .await
                .unwrap();
            let status = r.status().as_u16();
            // The event stream answers 200 and goes on: its body is not read.
            let body = if template.ends_with("/stream") {
                String::new()
            } else {
                r.text().await.unwrap()
            };
            let refused = status == 403 && body.contains("may not");
            if allowed.contains(*letter) == refused || status == 401 {
                wrong.push(format!("{letter} {method} {template}: {status} {body}"));
            }
        }
    }
    assert!(
        wrong.is_empty(),
        "roles not as the table says:\n{}",
        wrong.join("\n")
    );
    // Each refusal was counted once (the series starts at 0).
    let refused = server.text("/metrics").await;
    let not_allowed: u64 = refused
        .lines()
        .find_map(|l| l.strip_prefix("bootfleet_auth_failures_total{reason=\"not-allowed\"} "))
        .expect("the refusals are exported")
        .parse()
        .unwrap();
    let forbidden_cells: usize = TABLE.iter().map(|(_, _, allowed)| 4 - allowed.len()).sum();
    assert_eq!(not_allowed, forbidden_cells as u64, "{refused}");
    server.stop().await;
}

/// An operator's writes and a fleet controller's reimage are each recorded under the
/// token's name; a fleet controller cannot choose the image; a revoked token is refused
/// on its next request; names are never reused; no secret is ever shown again.
#[tokio::test]
async fn the_audit_trail_names_the_token_and_revocation_is_immediate() {
    let server = TestServer::start().await;
    let ops = create(&server, "night-ops", "operator").await;
    let fc = create(&server, "fleet-ctl", "fleet-controller").await;
    let as_ops = |m: reqwest::Method, path: &str| {
        server
            .http
            .request(m, server.url(path))
            .bearer_auth(&ops)
            .header("x-bootfleet-actor", "alice@laptop")
    };

    // Publish with a tag, assign, label: each as the operator.
    let r = as_ops(reqwest::Method::POST, "/api/v1/images?tag=demo:stable")
        .body(good_bundle("demo", "1", b"k1"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let image: serde_json::Value = r.json().await.unwrap();
    let r = as_ops(reqwest::Method::PUT, &format!("/api/v1/nodes/{MAC}/image"))
        .json(&serde_json::json!({ "image": "demo:stable" }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = as_ops(
        reqwest::Method::PATCH,
        &format!("/api/v1/nodes/{MAC}/labels"),
    )
    .json(&serde_json::json!({ "set": { "rack": "12" } }))
    .send()
    .await
    .unwrap();
    assert_eq!(r.status(), 200);
    // A second version published, removed, and its blob collected: each the operator's.
    let r = as_ops(reqwest::Method::POST, "/api/v1/images")
        .body(good_bundle("demo", "2", b"k2"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 201);
    let r = as_ops(reqwest::Method::DELETE, "/api/v1/images/demo:2")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "{}", r.text().await.unwrap());
    let r = as_ops(reqwest::Method::POST, "/api/v1/blobs/gc")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let (_, history) = server.json("/api/v1/tags/demo/stable/history").await;
    let moves = history.as_array().unwrap();
    assert_eq!(moves.len(), 1, "{history}");
    assert_eq!(moves[0]["actor"], "night-ops (alice@laptop)");

    // The node boots and attests; then the fleet controller reimages it.
    let fake = FakeNode::new(&server, MAC);
    let boot = fake.boot().await;
    let digests = fake.fetch_all(&boot).await;
    let (status, verdict) = fake
        .attest(&boot, fake.report(&boot, &image, &digests))
        .await;
    assert_eq!(status, 200, "{verdict}");
    let reimage = |body: serde_json::Value| {
        server
            .http
            .post(server.url(&format!("/api/v1/nodes/{MAC}/reimage")))
            .bearer_auth(&fc)
            .json(&body)
            .send()
    };
    let r = reimage(serde_json::json!({ "reason": "GPU 3 fell off the bus", "image": "demo:1" }))
        .await
        .unwrap();
    assert_eq!(
        r.status(),
        403,
        "a fleet controller does not choose the image"
    );
    let r = reimage(serde_json::json!({ "reason": "GPU 3 fell off the bus" }))
        .await
        .unwrap();
    assert_eq!(r.status(), 202, "{}", r.text().await.unwrap());
    let r = server
        .http
        .post(server.url(&format!("/api/v1/nodes/{MAC}/revalidate")))
        .bearer_auth(&fc)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 202);

    // The event log names who did each write, and the server's own work names nobody.
    let (_, page) = server.json("/api/v1/events?limit=1000").await;
    let events = page["events"].as_array().unwrap();
    let actor_of = |kind: &str| -> Vec<Option<String>> {
        events
            .iter()
            .filter(|e| e["kind"] == kind)
            .map(|e| e["actor"].as_str().map(String::from))
            .collect()
    };
    assert_eq!(
        actor_of("token.created"),
        [Some("admin".into()), Some("admin".into())]
    );
    let ops_did = |n: usize| vec![Some("night-ops".to_string()); n];
    assert_eq!(actor_of("image.published"), ops_did(2));
    assert_eq!(actor_of("image.removed"), ops_did(1));
    assert_eq!(actor_of("blobs.collected"), ops_did(1));
    assert_eq!(actor_of("node.assigned"), [Some("night-ops".into())]);
    assert_eq!(actor_of("node.labelled"), [Some("night-ops".into())]);
    assert_eq!(
        actor_of("node.revalidate-requested"),
        [Some("fleet-ctl".into())]
    );
    let reimaged: Vec<&serde_json::Value> = events
        .iter()
        .filter(|e| e["kind"] == "node.state" && e["data"]["to"] == "reimaging")
        .collect();
    assert_eq!(reimaged.len(), 1, "{page}");
    assert_eq!(reimaged[0]["actor"], "fleet-ctl");
    let booted = events
        .iter()
        .find(|e| e["kind"] == "node.state" && e["data"]["to"] == "booted")
        .expect("the attestation's state change");
    assert!(
        booted.get("actor").is_none(),
        "the node's own report: {booted}"
    );
    // And so does the node's history.
    let (_, node) = server.json(&format!("/api/v1/nodes/{MAC}")).await;
    let last = node["history"].as_array().unwrap().last().unwrap().clone();
    assert_eq!(last["to"], "reimaging");
    assert_eq!(last["actor"], "fleet-ctl");

    // Revoked: refused on the very next request, counted, listed with who revoked it.
    let r = server
        .http
        .delete(server.url("/api/v1/tokens/night-ops"))
        .bearer_auth(&server.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    // A job not yet told keeps trying: refused each time, never locking its source out.
    for _ in 0..bootfleet::auth::limiter::MAX_FAILURES + 5 {
        let r = as_ops(reqwest::Method::GET, "/api/v1/images")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403);
    }
    let metrics = server.text("/metrics").await;
    assert!(
        metrics.contains("bootfleet_auth_failures_total{reason=\"revoked\"} 25"),
        "{metrics}"
    );
    let (_, list) = server.json("/api/v1/tokens").await;
    let listed = list["tokens"].as_array().unwrap();
    assert_eq!(listed.len(), 2);
    let revoked = listed.iter().find(|t| t["name"] == "night-ops").unwrap();
    assert_eq!(revoked["revoked_by"], "admin");
    assert_eq!(revoked["created_by"], "admin");
    // No secret comes back from the list or the events.
    let everything = format!(
        "{list}{page}{}",
        server.json("/api/v1/events?limit=1000").await.1
    );
    assert!(!everything.contains(&ops) && !everything.contains(&fc));
    assert!(!everything.contains("bft_"), "{everything}");
    // A name is never given to a second token; a bad name or role is refused.
    for (body, status) in [
        (
            serde_json::json!({ "name": "night-ops", "role": "read-only" }),
            409,
        ),
        (
            serde_json::json!({ "name": "admin", "role": "read-only" }),
            400,
        ),
        (
            serde_json::json!({ "name": "Night Ops", "role": "read-only" }),
            400,
        ),
        (serde_json::json!({ "name": "x", "role": "root" }), 400),
    ] {
        let r = server
            .post("/api/v1/tokens")
            .json(&body)
            .send()
            .await
            .unwrap();
        let got = r.status().as_u16();
        assert!(
            got == status || (status == 400 && got == 422),
            "{body}: {got} {}",
            r.text().await.unwrap()
        );
    }
    server.stop().await;
}

/// Twenty wrong tokens from one address, then even the right one is refused for a while
/// (429 with Retry-After): guessing runs at twenty tries a minute, not the network's speed.
#[tokio::test]
async fn failed_authentications_are_limited_per_source() {
    let server = TestServer::start().await;
    for i in 0..bootfleet::auth::limiter::MAX_FAILURES {
        let r = server
            .http
            .get(server.url("/api/v1/nodes"))
            .bearer_auth(format!("bft_{i:064}"))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "try {i}");
    }
    let r = server.get("/api/v1/nodes").send().await.unwrap();
    assert_eq!(r.status(), 429);
    let wait: u64 = r.headers()["retry-after"]
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    assert!((1..=60).contains(&wait), "{wait}");
    let body = r.text().await.unwrap();
    assert!(body.contains("too many failed authentications"), "{body}");
    // The console's login and the scrape count and wait the same.
    let r = server
        .http
        .post(server.url("/ui/login"))
        .json(&serde_json::json!({ "token": server.token }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429, "the console login is limited too");
    let r = server
        .http
        .get(server.url("/metrics"))
        .bearer_auth("guess-guess-guess")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 429, "the scrape is limited too");
    // Blobs, scripts and health stay open: the limit is the admin API's.
    let r = server
        .http
        .get(server.url("/healthz"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    server.stop().await;
}

/// `bootfleet token create|list|revoke`: the secret printed once (stdout, alone, for a
/// pipe), the list without it, a revoked token refused; a read-only token's write exits 4.
#[tokio::test]
async fn the_cli_creates_lists_and_revokes_tokens() {
    let server = TestServer::start().await;
    let cli = |token: &str, args: &[&str]| {
        let mut cmd = tokio::process::Command::new(bin());
        cmd.args(args)
            .args(["--server", &server.url("")])
            .env("BOOTFLEET_TOKEN", token);
        async move { cmd.output().await.unwrap() }
    };
    let out = cli(
        &server.token,
        &["token", "create", "viewer", "--role", "read-only"],
    )
    .await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let secret = String::from_utf8(out.stdout).unwrap().trim().to_string();
    assert!(
        secret.starts_with("bft_"),
        "stdout is the secret alone: {secret:?}"
    );
    let out = cli(&secret, &["node", "list", "--output", "json"]).await;
    assert!(out.status.success(), "a read-only token reads");
    let out = cli(&secret, &["node", "label", MAC, "rack=1"]).await;
    assert_eq!(
        out.status.code(),
        Some(4),
        "a read-only token's write is refused"
    );
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("read-only"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cli(&server.token, &["token", "list"]).await;
    let listed = String::from_utf8(out.stdout).unwrap();
    assert!(
        listed.contains("viewer") && listed.contains("read-only"),
        "{listed}"
    );
    assert!(!listed.contains(&secret));
    let out = cli(&server.token, &["token", "revoke", "viewer"]).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cli(&secret, &["node", "list"]).await;
    assert_eq!(out.status.code(), Some(4), "revoked");
    server.stop().await;
}

/// The event kinds of a server-sent event stream, read until it ends (or until `until`
/// names one, when given); fails after 20 s.
async fn sse_kinds(response: reqwest::Response, until: Option<&str>) -> Vec<String> {
    use futures_util::StreamExt;
    let mut body = response.bytes_stream();
    let mut text = String::new();
    let mut kinds = Vec::new();
    let read = async {
        while let Some(chunk) = body.next().await {
            text.push_str(std::str::from_utf8(&chunk.unwrap()).unwrap());
            while let Some(end) = text.find("\n\n") {
                let frame: String = text.drain(..end + 2).collect();
                if let Some(kind) = frame.lines().find_map(|l| l.strip_prefix("event: ")) {
                    kinds.push(kind.to_string());
                    if until == Some(kind) {
                        return;
                    }
                }
            }
        }
        assert!(
            until.is_none(),
            "the stream ended before {until:?}: {kinds:?}"
        );
    };
    tokio::time::timeout(std::time::Duration::from_secs(20), read)
        .await
        .expect("the stream neither ended nor gave the event in 20 s");
    kinds
}

/// A stream opened with a named token ends once the token is revoked (seen through the
/// event log, so whichever server revoked it), even one filtered to a node, whose
/// events never name the token; the admin's stream goes on.
#[tokio::test]
async fn an_event_stream_ends_when_its_token_is_revoked() {
    let server = TestServer::start().await;
    let (status, _) = server.publish(good_bundle("demo", "1", b"k1")).await;
    assert_eq!(status, 201);
    let reader = create(&server, "dashboards", "read-only").await;
    let open = |token: String, since: &str| {
        server
            .http
            .get(server.url(&format!("/api/v1/events/stream?node={MAC}{since}")))
            .bearer_auth(token)
            .send()
    };
    let named = open(reader, "").await.unwrap();
    assert_eq!(named.status(), 200);
    // A cursor past the newest event starts at it: what comes next is still given.
    let admin = open(server.token.clone(), "&since=999999999")
        .await
        .unwrap();
    assert_eq!(admin.status(), 200);

    server.assign(MAC, "demo:1").await;
    let r = server
        .http
        .delete(server.url("/api/v1/tokens/dashboards"))
        .bearer_auth(&server.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let kinds = sse_kinds(named, None).await;
    assert!(kinds.contains(&"node.assigned".to_string()), "{kinds:?}");
    assert_eq!(
        kinds.last().map(String::as_str),
        Some("token.revoked"),
        "the revocation ends the stream: {kinds:?}"
    );
    assert!(
        !kinds.contains(&"token.created".to_string()),
        "other tokens' events are not the node's"
    );

    // The admin's stream of the node still gives the node's events, and only them.
    let r = server
        .http
        .patch(server.url(&format!("/api/v1/nodes/{MAC}/labels")))
        .bearer_auth(&server.token)
        .json(&serde_json::json!({ "set": { "rack": "12" } }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let kinds = sse_kinds(admin, Some("node.labelled")).await;
    assert!(!kinds.contains(&"token.revoked".to_string()), "{kinds:?}");
    server.stop().await;
}

/// A console session has the role of the token that logged in: a read-only token's
/// session reads and may not write, an operator's writes are recorded as theirs, and a
/// revoked token's session ends at once.
#[tokio::test]
async fn a_console_session_acts_as_the_token_that_logged_in() {
    let server = TestServer::start().await;
    let viewer = create(&server, "viewer", "read-only").await;
    let ops = create(&server, "ops.night", "operator").await;
    let http = reqwest::Client::new();
    let url = |p: &str| format!("http://{}{p}", server.addr);
    let login = |token: String| {
        let http = http.clone();
        let url = url("/ui/login");
        async move {
            let r = http
                .post(url)
                .json(&serde_json::json!({ "token": token }))
                .send()
                .await
                .unwrap();
            assert_eq!(r.status(), 200);
            let set = r.headers()["set-cookie"].to_str().unwrap().to_string();
            let cookie = set.split(';').next().unwrap().to_string();
            let answer: serde_json::Value = r.json().await.unwrap();
            (cookie, answer)
        }
    };
    let read = |cookie: &str, path: &str| {
        let r = http.get(url(path)).header("cookie", cookie).send();
        async move { r.await.unwrap().status() }
    };
    let write = |cookie: &str, csrf: &serde_json::Value| {
        http.post(url("/api/v1/images"))
            .header("cookie", cookie)
            .header("x-bootfleet-csrf", csrf.as_str().unwrap())
            .body(good_bundle("demo", "1", b"k1"))
            .send()
    };

    let (viewing, answer) = login(viewer).await;
    assert_eq!(answer["name"], "viewer");
    assert_eq!(answer["role"], "read-only");
    assert_eq!(read(&viewing, "/api/v1/nodes").await, 200);
    let r = write(&viewing, &answer["csrf"]).await.unwrap();
    assert_eq!(r.status(), 403, "a read-only session does not publish");

    let (operating, answer) = login(ops.clone()).await;
    assert_eq!(answer["role"], "operator");
    let r = write(&operating, &answer["csrf"]).await.unwrap();
    assert_eq!(r.status(), 201, "{}", r.text().await.unwrap());
    let (_, page) = server.json("/api/v1/events?limit=100").await;
    let published = page["events"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["kind"] == "image.published")
        .expect("the publish is an event")
        .clone();
    assert_eq!(published["actor"], "ops.night", "{published}");

    // Revoked: the session ends with it, in the API and the console's own check.
    let r = server
        .http
        .delete(server.url("/api/v1/tokens/ops.night"))
        .bearer_auth(&server.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    for path in ["/api/v1/nodes", "/ui/session"] {
        assert_eq!(read(&operating, path).await, 401, "{path}");
    }
    // And a revoked token cannot log in again.
    let r = http
        .post(url("/ui/login"))
        .json(&serde_json::json!({ "token": ops }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 403);
    server.stop().await;
}
