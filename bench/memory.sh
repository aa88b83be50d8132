#!/usr/bin/env bash
# Memory after a load: does the server give back what a burst took? 20,000 nodes are
# discovered (unauthenticated boot requests), then 32 clients list them all 10 times each
# at once (about 8 MB of JSON per answer); RssAnon is read idle, at its peak, and 15 s
# after the load ended. BIN=path/to/bootfleet compares another build in the same run.
# Usage: bench/memory.sh [BIN...]   Needs python3, curl.
source "$(dirname "$0")/lib.sh"
bins=("$@")
if [ ${#bins[@]} -eq 0 ]; then
  build_release
  bins=("$BIN")
fi
work=$(mktemp -d /var/tmp/bootfleet-mem.XXXXXX)
trap 'stop_server 2>/dev/null; rm -rf "$work"' EXIT
anon() { awk '/^RssAnon/ {print int($2/1024)}' "/proc/$1/status"; }
machine
for bin in "${bins[@]}"; do
  BIN=$bin
  rm -rf "$work/data"; mkdir -p "$work/data"
  start_server "$work/data" 18930
  token=$(cat "$work/data/admin.token")
  python3 - "$token" <<'PY'
import sys, threading, http.client
def discover(lo, hi):
    c = http.client.HTTPConnection("127.0.0.1", 18930)
    for i in range(lo, hi):
        c.request("GET", f"/boot/node.ipxe?mac=52-54-00-{i>>16&255:02x}-{i>>8&255:02x}-{i&255:02x}")
        c.getresponse().read()
ts = [threading.Thread(target=discover, args=(k * 1250, (k + 1) * 1250)) for k in range(16)]
[t.start() for t in ts]; [t.join() for t in ts]
PY
  sleep 2
  idle=$(anon "$SERVER_PID")
  peak=$idle
  python3 - "$token" <<'PY' &
import sys, threading, http.client
token = sys.argv[1]
def lister():
    c = http.client.HTTPConnection("127.0.0.1", 18930)
    for _ in range(10):
        c.request("GET", "/api/v1/nodes", headers={"Authorization": f"Bearer {token}"})
        body = c.getresponse().read()
        assert len(body) > 1_000_000, len(body)
ts = [threading.Thread(target=lister) for _ in range(32)]
[t.start() for t in ts]; [t.join() for t in ts]
PY
  load=$!
  while kill -0 "$load" 2>/dev/null; do
    now=$(anon "$SERVER_PID"); [ "$now" -gt "$peak" ] && peak=$now
    sleep 0.1
  done
  wait "$load"
  sleep 15
  after=$(anon "$SERVER_PID")
  echo "$(basename "$(dirname "$(dirname "$(dirname "$bin")")")")/$(basename "$bin"): RssAnon idle ${idle} MiB, peak ${peak} MiB, 15 s after the load ${after} MiB"
  stop_server
done
