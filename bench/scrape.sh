#!/usr/bin/env bash
# /metrics and /metrics/gpus with N nodes booted (each with 8 GPUs reporting in a
# heartbeat), against the JSON node list for the same fleet: median and worst time of
# ROUNDS fetches each, and sizes (bootfleet-bench scrape). Goal: /metrics under 100 ms.
# Usage: bench/scrape.sh [N=10000] [ROUNDS=20]
source "$(dirname "$0")/lib.sh"
n=${1:-10000}
rounds=${2:-20}
build_release
work=$(mktemp -d /var/tmp/bootfleet-bench.XXXXXX)
trap 'stop_server 2>/dev/null; rm -rf "$work"' EXIT
cat >"$work/bootfleet.toml" <<TOML
[metrics]
group_labels = ["rack"]

[lifecycle]
heartbeat_timeout_secs = 3600
TOML
machine
start_server "$work/data" 18192 --config "$work/bootfleet.toml"
"$BENCH" --server http://127.0.0.1:18192 --data-dir "$work/data" scrape --nodes "$n" --rounds "$rounds"
echo "server RSS after: $(awk '/VmRSS/ {printf "%.1f MiB", $2/1024}' /proc/$SERVER_PID/status), peak $(awk '/VmHWM/ {printf "%.1f MiB", $2/1024}' /proc/$SERVER_PID/status)"
