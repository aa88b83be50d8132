//! HTTPS: the API, the console and blobs over TLS with a test CA (openssl); the CLI and
//! the agent trusting that CA and refusing another; the plain listener keeping only what
//! firmware needs; a renewed certificate taken up without a restart.

use std::path::Path;
use std::process::Command;

use crate::harness::*;

/// Makes `<name>-ca.pem` and a leaf for 127.0.0.1 it signed (`<name>.pem`, `<name>.key`).
fn issue(dir: &Path, name: &str) {
    let script = format!(
        "openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout {name}-ca.key -out {name}-ca.pem -days 2 -subj /CN={name}-ca 2>/dev/null && \
         openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -keyout {name}.key -out {name}.csr -subj /CN=127.0.0.1 2>/dev/null && \
         printf 'subjectAltName=IP:127.0.0.1,DNS:localhost\\nbasicConstraints=CA:FALSE\\n' > {name}.ext && \
         openssl x509 -req -in {name}.csr -CA {name}-ca.pem -CAkey {name}-ca.key -CAcreateserial -out {name}.pem -days 2 -extfile {name}.ext 2>/dev/null"
    );
    let status = Command::new("sh")
        .args(["-c", &script])
        .current_dir(dir)
        .status()
        .expect("openssl (the test command installs it)");
    assert!(status.success(), "openssl could not issue {name}");
}

fn client(dir: &Path, ca: &str) -> reqwest::Client {
    let pem = std::fs::read_to_string(dir.join(format!("{ca}-ca.pem"))).unwrap();
    bootfleet::http_client::trusting(&pem)
        .unwrap()
        .build()
        .unwrap()
}

#[tokio::test]
async fn the_api_is_served_over_https_and_a_renewed_certificate_is_taken_up() {
    let certs = tempfile::tempdir().unwrap();
    let dir = certs.path();
    issue(dir, "first");
    issue(dir, "second");
    std::fs::copy(dir.join("first.pem"), dir.join("server.pem")).unwrap();
    std::fs::copy(dir.join("first.key"), dir.join("server.key")).unwrap();
    let server = TestServer::start_configured(|cfg| {
        cfg.http.tls_cert_file = Some(dir.join("server.pem"));
        cfg.http.tls_key_file = Some(dir.join("server.key"));
        cfg.http.tls_listen = Some("127.0.0.1:0".parse().unwrap());
    })
    .await;
    let https = format!("https://{}", server.tls_addr.unwrap());

    // The API over HTTPS, for a client that trusts the CA.
    let trusting = client(dir, "first");
    let r = trusting
        .get(format!("{https}/api/v1/nodes"))
        .bearer_auth(&server.token)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = trusting.get(format!("{https}/ui/")).send().await.unwrap();
    assert_eq!(r.status(), 200, "the console");
    // The console's cookie never travels to the plain listener.
    let r = trusting
        .post(format!("{https}/ui/login"))
        .json(&serde_json::json!({ "token": server.token }))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200);
    let cookie = r.headers()["set-cookie"].to_str().unwrap().to_string();
    assert!(cookie.contains("; Secure"), "{cookie}");
    // Firmware that speaks TLS is sent on over TLS.
    let entry = trusting
        .get(format!("{https}/boot.ipxe"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    assert!(entry.contains(&https), "{entry}");
    // A client that trusts another CA does not get through the handshake.
    let other = client(dir, "second");
    let refused = other
        .get(format!("{https}/healthz"))
        .send()
        .await
        .unwrap_err();
    assert!(refused.is_connect(), "{refused:?}");

    // The plain listener keeps the boot routes only: no admin token crosses in clear.
    let r = server.get("/api/v1/nodes").send().await.unwrap();
    assert_eq!(r.status(), 404);
    assert!(r.text().await.unwrap().contains("tls_listen"));
    let r = server
        .http
        .get(server.url("/boot.ipxe"))
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), 200, "firmware without TLS still boots");

    // The CLI: trusts the CA it is given, refuses the server under another.
    let cli = |ca: &str| {
        let mut cmd = tokio::process::Command::new(bin());
        cmd.args(["node", "list", "--server", &https])
            .arg("--ca-file")
            .arg(dir.join(format!("{ca}-ca.pem")))
            .env("BOOTFLEET_TOKEN", &server.token);
        async move { cmd.output().await.unwrap() }
    };
    let out = cli("first").await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = cli("second").await;
    assert_eq!(out.status.code(), Some(5), "unreachable under the wrong CA");
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(said.contains("cannot reach"), "{said}");

    // Renewed in place (written aside and renamed, as certificate managers do): served
    // within a few seconds, without a restart.
    std::fs::copy(dir.join("second.key"), dir.join("server.key.new")).unwrap();
    std::fs::copy(dir.join("second.pem"), dir.join("server.pem.new")).unwrap();
    std::fs::rename(dir.join("server.key.new"), dir.join("server.key")).unwrap();
    std::fs::rename(dir.join("server.pem.new"), dir.join("server.pem")).unwrap();
    let mut renewed = false;
    for _ in 0..100 {
        // A fresh client each try: no connection kept from before the renewal.
        if client(dir, "second")
            .get(format!("{https}/healthz"))
            .send()
            .await
            .is_ok()
        {
            renewed = true;
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert!(
        renewed,
        "the renewed certificate was not served within 10 s"
    );
    server.stop().await;
}

/// The agent reports over HTTPS when it is given the CA, and cannot without it.
#[tokio::test]
async fn the_agent_reports_over_https_with_the_ca_it_is_given() {
    let certs = tempfile::tempdir().unwrap();
    let dir = certs.path();
    issue(dir, "node-ca");
    let mut server = TestServer::start_configured(|cfg| {
        cfg.http.tls_cert_file = Some(dir.join("node-ca.pem"));
        cfg.http.tls_key_file = Some(dir.join("node-ca.key"));
        cfg.http.tls_listen = Some("127.0.0.1:0".parse().unwrap());
    })
    .await;
    server.use_https(client(dir, "node-ca"));
    let https = format!("https://{}", server.tls_addr.unwrap());
    server
        .publish_query(good_bundle("demo", "1", b"kernel"), "?tag=demo:stable")
        .await;
    let mac = "52-54-00-31-00-01";
    // The boot itself over plain HTTP, as firmware does.
    let node = crate::fake_node::FakeNode::new(&server, mac);
    server.assign(mac, "demo:stable").await;
    let boot = node.boot().await;
    node.fetch_all(&boot).await;
    let root = tempfile::tempdir().unwrap();
    let proc = root.path().join("proc");
    std::fs::create_dir_all(&proc).unwrap();
    std::fs::write(proc.join("cmdline"), format!("{}\n", boot.cmdline)).unwrap();
    let agent = |ca: Option<&Path>, secs: u64| {
        let mut cmd = tokio::process::Command::new(env!("CARGO_BIN_EXE_bootfleet-agent"));
        cmd.arg("--root")
            .arg(root.path())
            .args(["--once", "--server", &https])
            .kill_on_drop(true);
        if let Some(ca) = ca {
            cmd.arg("--ca-file").arg(ca);
        }
        async move {
            let out =
                tokio::time::timeout(std::time::Duration::from_secs(secs), cmd.output()).await;
            out.map(|o| o.unwrap())
        }
    };
    // Without the CA the agent cannot attest (it retries forever: the timeout ends it).
    match agent(None, 5).await {
        Err(_) => {}
        Ok(out) => assert!(!out.status.success(), "{out:?}"),
    }
    assert_eq!(node.state().await, "provisioning");
    let out = agent(Some(&dir.join("node-ca-ca.pem")), 60)
        .await
        .expect("the agent finishes");
    let said =
        String::from_utf8_lossy(&out.stderr).to_string() + &String::from_utf8_lossy(&out.stdout);
    assert!(said.contains(r#""step":"attest""#), "{said}");
    assert_ne!(node.state().await, "provisioning", "{said}");
    server.stop().await;
}
