//! The OpenAPI document against the server it describes: Schemathesis (PyPI; the test
//! command installs it into a venv) generates requests from `docs/openapi.json` and sends
//! them to a live server seeded with an image, nodes, a boot and a rollout. Any 5xx, or
//! any answer the document does not describe, fails the test. The server and
//! Schemathesis run in a network namespace of their own with only loopback: operations
//! that reach out on the caller's behalf (a BMC, a registry, with generated addresses)
//! reach nothing.

use std::path::PathBuf;
use std::process::Command;

use super::harness;

fn schemathesis() -> PathBuf {
    harness::venv_tool(
        "schemathesis",
        "schemathesis",
        "schemathesis 4.32.5",
        "BOOTFLEET_SCHEMATHESIS",
    )
}

/// Inside the namespace: loopback up, the server, the seeds, then Schemathesis.
const SCRIPT: &str = r#"
set -euo pipefail
ip link set lo up
U=http://127.0.0.1:8080
"$BIN" serve --listen 127.0.0.1:8080 --data-dir "$DIR/data" >"$DIR/server.log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null || true' EXIT
for _ in $(seq 100); do curl -sf "$U/healthz" >/dev/null && break; sleep 0.1; done
export BOOTFLEET_TOKEN=$(cat "$DIR/data/admin.token")
admin=(-sf -H "Authorization: Bearer $BOOTFLEET_TOKEN")
json=(-H "Content-Type: application/json")
curl "${admin[@]}" --data-binary @"$DIR/bundle.tar" "$U/api/v1/images?tag=demo:stable" >"$DIR/published.json"
export IMAGE_DIGEST=$(grep -o '"digest":"sha256:[0-9a-f]*"' "$DIR/published.json" | head -1 | cut -d'"' -f4)
export NODE_MAC_1=52:54:00:5c:00:01 NODE_MAC_2=52:54:00:5c:00:02 NODE_MAC_3=52:54:00:5c:00:03
for mac in $NODE_MAC_1 $NODE_MAC_2 $NODE_MAC_3; do
  curl -sf "$U/boot/node.ipxe?mac=$mac" >/dev/null
  curl "${admin[@]}" "${json[@]}" -X PUT -d '{"image":"demo:stable"}' "$U/api/v1/nodes/$mac/image" >/dev/null
done
# The agent's node: booting, and apart from the MACs the admin operations are given (a
# generated DELETE would end its boot).
agent_mac=52:54:00:5c:00:04
curl -sf "$U/boot/node.ipxe?mac=$agent_mac" >/dev/null
curl "${admin[@]}" "${json[@]}" -X PUT -d '{"image":"demo:stable"}' "$U/api/v1/nodes/$agent_mac/image" >/dev/null
boot_script=$(curl -sf "$U/boot/node.ipxe?mac=$agent_mac")
export BOOT_TOKEN=$(grep -o 'bootfleet\.token=[^ ]*' <<<"$boot_script" | head -1 | cut -d= -f2)
export BOOT_ID=$(grep -o 'bootfleet\.boot=[^ ]*' <<<"$boot_script" | head -1 | cut -d= -f2)
export AGENT_MAC=$agent_mac
[ -n "$BOOT_TOKEN" ] && [ -n "$BOOT_ID" ] || { echo "no boot token or id in: $boot_script" >&2; exit 1; }
export ROLLOUT_ID=$(curl "${admin[@]}" "${json[@]}" -d "{\"image\":\"demo:1\",\"nodes\":[\"$NODE_MAC_3\"],\"reason\":\"schemathesis seed\"}" \
  "$U/api/v1/rollouts" | grep -o '"id":[0-9]*' | head -1 | cut -d: -f2)
# The server serves the document it was built with, the checked-in one.
curl "${admin[@]}" "$U/api/v1/openapi.json" | cmp - "$DOC"
cd "$DIR"
# The values into the config (Schemathesis substitutes variables in headers only).
"$(dirname "$SCHEMATHESIS")/python3" -c 'import os, sys; sys.stdout.write(os.path.expandvars(open(sys.argv[1]).read()))' \
  "$CONFIG" >"$DIR/schemathesis.toml"
"$SCHEMATHESIS" --config-file "$DIR/schemathesis.toml" run "$DOC" --url "$U" --seed 1 --workers 1 \
  --exclude-path /api/v1/events/stream --no-color
"#;

#[test]
fn schemathesis_finds_no_5xx_and_no_answer_outside_the_document() {
    let st = schemathesis();
    let dir = tempfile::Builder::new()
        .prefix("bootfleet-schemathesis-")
        .tempdir()
        .unwrap();
    std::fs::write(
        dir.path().join("bundle.tar"),
        harness::good_bundle("demo", "1", b"kernel for schemathesis"),
    )
    .unwrap();
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new("unshare")
        .args(["--net", "bash", "-c", SCRIPT])
        .env("BIN", harness::bin())
        .env("DIR", dir.path())
        .env("SCHEMATHESIS", &st)
        .env("CONFIG", format!("{root}/tests/schemathesis.toml"))
        .env("DOC", format!("{root}/docs/openapi.json"))
        .output()
        .expect("unshare runs (util-linux)");
    let stdout = String::from_utf8_lossy(&out.stdout);
    // The whole report, for a failure's details (the message has its tail).
    let report = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("schemathesis.txt");
    std::fs::write(&report, stdout.as_bytes()).unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    let log = std::fs::read_to_string(dir.path().join("server.log")).unwrap_or_default();
    let tail = |s: &str| {
        s.chars()
            .rev()
            .take(6000)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect::<String>()
    };
    assert!(
        out.status.success(),
        "schemathesis found problems ({}; the whole report in {}):\n{}\nstderr:\n{stderr}\nserver log (tail):\n{}",
        out.status,
        report.display(),
        tail(&stdout),
        tail(&log)
    );
    // It ran what it was meant to: every operation but the event stream, with cases.
    let documented = std::fs::read_to_string(format!("{root}/docs/openapi.json")).unwrap();
    let doc: serde_json::Value = serde_json::from_str(&documented).unwrap();
    let operations: usize = doc["paths"]
        .as_object()
        .unwrap()
        .values()
        .map(|item| item.as_object().unwrap().len())
        .sum();
    assert!(
        stdout.contains(&format!("Tested: {}", operations - 1)),
        "expected {} operations tested:\n{}",
        operations - 1,
        tail(&stdout)
    );
    assert!(stdout.contains(" passed"), "{}", tail(&stdout));
}
