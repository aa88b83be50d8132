#!/usr/bin/env bash
# Health telemetry: N simulated 8-GPU nodes (8 InfiniBand ports each) heartbeat once an
# interval, first with their facts alone, then with every GPU's and port's readings
# judged by the default [health] rules, in the same run (bootfleet-bench telemetry):
# the server's CPU per heartbeat, its share of a core, and its memory after each phase.
# Goal (issue 22): 10,000 nodes at 10 s, 1,000 heartbeats a second, under half a core.
# Usage: bench/telemetry.sh [N=10000] [EVERY=10s] [ROUNDS=6]
source "$(dirname "$0")/lib.sh"
n=${1:-10000}
every=${2:-10s}
rounds=${3:-6}
build_release
work=$(mktemp -d /var/tmp/bootfleet-bench.XXXXXX)
trap 'stop_server 2>/dev/null; rm -rf "$work"' EXIT
cat >"$work/bootfleet.toml" <<TOML
[lifecycle]
heartbeat_timeout_secs = 3600
TOML
machine
start_server "$work/data" 18193 --config "$work/bootfleet.toml"
"$BENCH" --server http://127.0.0.1:18193 --data-dir "$work/data" telemetry \
  --nodes "$n" --every "$every" --rounds "$rounds" --measure-pid "$SERVER_PID"
echo "server peak RSS: $(awk '/VmHWM/ {printf "%.1f MiB", $2/1024}' /proc/$SERVER_PID/status)"
