#!/usr/bin/env bash
# Blob serving: one 256 MiB blob, 16 connections (wrk), bootfleet against nginx (sendfile)
# serving the same file, same run; plus bootfleet's peak RSS.
# Usage: bench/blobs.sh [SECONDS=10]. Needs: nginx-light wrk bc curl (apt-get install ...).
source "$(dirname "$0")/lib.sh"
duration=${1:-10}
for tool in nginx wrk bc curl; do
  command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install nginx-light wrk bc curl" >&2; exit 1; }
done
build_release
work=$(mktemp -d /var/tmp/bootfleet-bench.XXXXXX)
NGINX_PID=
trap 'stop_server 2>/dev/null; [ -n "$NGINX_PID" ] && kill "$NGINX_PID" 2>/dev/null; rm -rf "$work"' EXIT
make_image "$work/img" 2 256M
start_server "$work/data" 18182
"$BIN" --server http://127.0.0.1:18182 --data-dir "$work/data" image publish "$work/img" >/dev/null
hex=$(sha256sum "$work/img/rootfs" | cut -d' ' -f1)
cat "$work/data/blobs/sha256/$hex" >/dev/null

start_nginx "$work/data" 18183 "$work"

run_wrk() { wrk -t2 -c16 -d"${duration}s" "$1" | awk '/Transfer\/sec/ {print $2}'; }
to_mbs() { # wrk prints e.g. 1.23GB or 950.00MB
  local v=$1
  case "$v" in
    *GB) echo "${v%GB} * 1073.741824" | bc -l ;;
    *MB) echo "${v%MB} * 1.048576" | bc -l ;;
    *KB) echo "${v%KB} * 0.001024" | bc -l ;;
  esac
}
path="/blobs/sha256/$hex"
curl -fs "http://127.0.0.1:18183$path" | sha256sum | grep -q "$hex" || { echo "nginx serves the wrong bytes" >&2; exit 1; }
nginx_rate=$(run_wrk "http://127.0.0.1:18183$path")
bf_rate=$(run_wrk "http://127.0.0.1:18182$path")
nginx_rate2=$(run_wrk "http://127.0.0.1:18183$path")
bf_rate2=$(run_wrk "http://127.0.0.1:18182$path")
rss_kib=$(awk '/VmHWM/ {print $2}' "/proc/$SERVER_PID/status")
machine
echo "256 MiB blob, wrk -t2 -c16 -d${duration}s, two alternating rounds"
for pair in "nginx $nginx_rate $nginx_rate2" "bootfleet $bf_rate $bf_rate2"; do
  set -- $pair
  printf '%-10s %s, %s  (%.0f / %.0f MB/s)\n' "$1" "$2" "$3" "$(to_mbs "$2")" "$(to_mbs "$3")"
done
printf 'ratio bootfleet/nginx (sum of both rounds): %.2f (goal >= 1.0)\n' \
  "$(echo "($(to_mbs "$bf_rate") + $(to_mbs "$bf_rate2")) / ($(to_mbs "$nginx_rate") + $(to_mbs "$nginx_rate2"))" | bc -l)"
printf 'bootfleet peak RSS: %.1f MiB (goal < 64 MiB)\n' "$(echo "$rss_kib / 1024" | bc -l)"
