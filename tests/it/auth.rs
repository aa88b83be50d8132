//! Admin API authentication: every admin route needs the bearer token; blobs stay open.

use crate::harness::*;

#[tokio::test]
async fn admin_routes_need_the_token() {
    let server = TestServer::start().await;
    let http = bootfleet::http_client::builder().build().unwrap();
    let routes = [
        (reqwest::Method::GET, "/api/v1/images"),
        (reqwest::Method::POST, "/api/v1/images"),
        (reqwest::Method::GET, "/api/v1/images/n:1"),
        (reqwest::Method::GET, "/api/v1/tags"),
        (reqwest::Method::PUT, "/api/v1/tags/n/stable"),
        (reqwest::Method::GET, "/api/v1/tags/n/stable/history"),
        (reqwest::Method::POST, "/api/v1/blobs/verify"),
        (reqwest::Method::POST, "/api/v1/blobs/gc"),
        (reqwest::Method::GET, "/api/v1/nodes"),
        (reqwest::Method::GET, "/api/v1/nodes/52:54:00:00:00:01"),
        (reqwest::Method::DELETE, "/api/v1/nodes/52:54:00:00:00:01"),
        (
            reqwest::Method::PUT,
            "/api/v1/nodes/52:54:00:00:00:01/image",
        ),
        (
            reqwest::Method::PATCH,
            "/api/v1/nodes/52:54:00:00:00:01/labels",
        ),
    ];
    for (method, path) in routes {
        let r = http
            .request(method.clone(), server.url(path))
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 401, "{method} {path} without a token");
        assert_eq!(r.headers()["www-authenticate"], "Bearer");
        let r = http
            .request(method.clone(), server.url(path))
            .bearer_auth("wrong-token-wrong-token")
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), 403, "{method} {path} with a wrong token");
        let body: serde_json::Value = r.json().await.unwrap();
        assert!(body["error"].as_str().unwrap().contains("not valid"));
    }
    // Nothing was published by the refused POST.
    server.assert_empty().await;
    for open in ["/healthz", "/readyz", "/boot.ipxe"] {
        assert_eq!(
            http.get(server.url(open)).send().await.unwrap().status(),
            200,
            "{open}"
        );
    }
    let ready: serde_json::Value = http
        .get(server.url("/readyz"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(ready["ready"], true);
    server.stop().await;
}

#[tokio::test]
async fn token_file_is_private() {
    use std::os::unix::fs::PermissionsExt;
    let server = TestServer::start().await;
    let path = server.data.path().join("admin.token");
    let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600);
    assert_eq!(std::fs::read_to_string(&path).unwrap().trim(), server.token);
    server.stop().await;
}

/// The bearer scheme is case-insensitive (RFC 7235): `bearer` and `BEARER` work, another
/// scheme or an empty token does not.
#[tokio::test]
async fn the_bearer_scheme_is_case_insensitive() {
    let server = TestServer::start().await;
    let http = bootfleet::http_client::builder().build().unwrap();
    for (header, status) in [
        (format!("bearer {}", server.token), 200),
        (format!("BEARER {}", server.token), 200),
        (format!("Basic {}", server.token), 401),
        ("Bearer ".to_string(), 401),
    ] {
        let r = http
            .get(server.url("/api/v1/nodes"))
            .header("authorization", &header)
            .send()
            .await
            .unwrap();
        assert_eq!(r.status(), status, "{header:?}");
    }
    server.stop().await;
}

/// With `admin_listen` set the admin API answers there only (a management network), and
/// the boot listener keeps what nodes need: scripts, blobs and the agent's calls.
#[tokio::test]
async fn the_admin_api_can_listen_apart_from_the_boot_routes() {
    let server = TestServer::start_configured(|cfg| {
        cfg.admin_listen = Some("127.0.0.1:0".parse().unwrap());
    })
    .await;
    let admin = server.admin_addr.expect("an admin listener");
    let http = bootfleet::http_client::builder().build().unwrap();
    let at = |addr: std::net::SocketAddr, path: &str| format!("http://{addr}{path}");

    // On the boot listener, even the right token reaches no admin route.
    let r = server.get("/api/v1/nodes").send().await.unwrap();
    assert_eq!(r.status(), 404);
    let body = r.text().await.unwrap();
    assert!(body.contains("admin_listen"), "{body}");
    let r = server
        .post("/api/v1/images")
        .body("x")
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 404);
    for open in ["/healthz", "/readyz", "/boot.ipxe"] {
        let r = http.get(server.url(open)).send().await.unwrap();
        assert_eq!(r.status(), 200, "{open} on the boot listener");
    }
    // The agent's calls are still routed there: refused for want of a token, not 404.
    let r = http
        .post(server.url("/api/v1/agent/heartbeat"))
        .json(&serde_json::json!({}))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 401);

    // On the admin listener: the admin API, behind the token, and no boot routes.
    let r = http
        .get(at(admin, "/api/v1/nodes"))
        .bearer_auth(&server.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = http.get(at(admin, "/api/v1/nodes")).send().await.unwrap();
    assert_eq!(r.status(), 401);
    for (path, status) in [("/healthz", 200), ("/readyz", 200), ("/boot.ipxe", 404)] {
        let r = http.get(at(admin, path)).send().await.unwrap();
        assert_eq!(r.status(), status, "{path} on the admin listener");
    }
    server.stop().await;
}
