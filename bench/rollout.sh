#!/usr/bin/env bash
# A rollout over N simulated nodes (bootfleet-bench rollout: nodes that boot over HTTP,
# heartbeat like the agent, and on "reboot" wait BOOT_DELAY, a machine's firmware and
# kernel start, then boot again): waves of WAVE, MAX_UNAVAILABLE at once, the disruption
# budget opened to match. Reports the time from the rollout's start to its end against
# the sum of its waves' own durations (first node reimaged to last node ready): the rest
# is the controller's overhead (goal: <= 5 %), and the server's CPU during it.
# Usage: bench/rollout.sh [N=5000] [WAVE=10%] [MAX_UNAVAILABLE=500] [BOOT_DELAY=20s]
source "$(dirname "$0")/lib.sh"
n=${1:-5000}
wave=${2:-10%}
unavailable=${3:-500}
delay=${4:-20s}
build_release
work=$(mktemp -d /var/tmp/bootfleet-bench.XXXXXX)
trap 'stop_server 2>/dev/null; rm -rf "$work"' EXIT
cat >"$work/bootfleet.toml" <<TOML
[reimage]
max_total = $unavailable
max_per_group = $unavailable

[boots]
burst = 5
every_secs = 1

[lifecycle]
heartbeat_timeout_secs = 600
TOML
machine
start_server "$work/data" 18191 --config "$work/bootfleet.toml"
"$BENCH" --server http://127.0.0.1:18191 --data-dir "$work/data" rollout --nodes "$n" \
  --wave "$wave" --max-unavailable "$unavailable" --boot-delay "$delay" --measure-pid "$SERVER_PID"
echo "server peak RSS: $(awk '/VmHWM/ {printf "%.1f MiB", $2/1024}' /proc/$SERVER_PID/status)"
