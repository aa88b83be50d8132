#!/usr/bin/env bash
# Boot-script renders per second against nginx serving a static file of the same size,
# same run, wrk -t2 -c32. Two bootfleet routes:
#   /boot.ipxe              the entry script: a pure in-memory template render
#   /boot/node.ipxe?mac=... a node's full boot: lookup, REF resolution, a boot record and
#                           a state change written to SQLite (synchronous=FULL), render
# Usage: bench/boot-scripts.sh [SECONDS=10]. Needs: nginx-light wrk curl.
source "$(dirname "$0")/lib.sh"
duration=${1:-10}
for tool in nginx wrk curl; do
  command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install nginx-light wrk curl" >&2; exit 1; }
done
build_release
work=$(mktemp -d /var/tmp/bootfleet-bench.XXXXXX)
NGINX_PID=
trap 'stop_server 2>/dev/null; [ -n "$NGINX_PID" ] && kill "$NGINX_PID" 2>/dev/null; rm -rf "$work"' EXIT
start_server "$work/data" 18184
url=http://127.0.0.1:18184
mkdir -p "$work/www"
make_image "$work/img" 100000
"$BIN" --server "$url" --data-dir "$work/data" image publish "$work/img" --tag bench:stable >/dev/null
"$BIN" --server "$url" --data-dir "$work/data" node assign 52-54-00-00-00-01 bench:stable >/dev/null
curl -fs "$url/boot.ipxe" >"$work/www/entry.ipxe"
curl -fs "$url/boot/node.ipxe?mac=52-54-00-00-00-01" >"$work/www/node.ipxe"
start_nginx "$work/www" 18185 "$work"
rps() { wrk -t2 -c32 -d"${duration}s" "$1" | awk '/Requests\/sec/ {print $2}'; }
machine
echo "entry script: $(stat -c %s "$work/www/entry.ipxe") bytes; node script: $(stat -c %s "$work/www/node.ipxe") bytes; wrk -t2 -c32 -d${duration}s"
n_entry=$(rps "http://127.0.0.1:18185/entry.ipxe")
b_entry=$(rps "$url/boot.ipxe")
n_node=$(rps "http://127.0.0.1:18185/node.ipxe")
b_node=$(rps "$url/boot/node.ipxe?mac=52-54-00-00-00-01")
printf 'entry script: nginx %s req/s, bootfleet %s req/s, ratio %.2f (goal >= 1.0)\n' "$n_entry" "$b_entry" "$(echo "$b_entry / $n_entry" | bc -l)"
printf 'node script (full boot, one SQLite transaction each): nginx %s req/s, bootfleet %s req/s, ratio %.2f\n' "$n_node" "$b_node" "$(echo "$b_node / $n_node" | bc -l)"
echo "bootfleet peak RSS: $(awk '/VmHWM/ {printf "%.1f MiB", $2/1024}' /proc/$SERVER_PID/status)"
