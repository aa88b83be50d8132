#!/usr/bin/env bash
# The console with N nodes: the fleet page and the node list's first page loaded in
# headless Chromium, navigation to figures on screen, against the JSON they draw from
# and the whole node list (examples/ui-bench.rs). Needs chromium, chromium-driver.
# Usage: bench/ui.sh [N=10000] [ROUNDS=10]
source "$(dirname "$0")/lib.sh"
n=${1:-10000}
rounds=${2:-10}
build_release
cargo build --release --quiet --example ui-bench
work=$(mktemp -d /var/tmp/bootfleet-bench.XXXXXX)
driver_port=18195
trap 'stop_server 2>/dev/null; kill $DRIVER_PID 2>/dev/null; rm -rf "$work"' EXIT
machine
start_server "$work/data" 18194
"$BENCH" --server http://127.0.0.1:18194 --data-dir "$work/data" storm-setup --nodes "$n" >/dev/null
chromedriver --port=$driver_port >/dev/null 2>&1 &
DRIVER_PID=$!
sleep 1
echo "$n nodes registered and assigned"
target/release/examples/ui-bench --server http://127.0.0.1:18194 \
  --token-file "$work/data/admin.token" --driver "http://127.0.0.1:$driver_port" --rounds "$rounds"
