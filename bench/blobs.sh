#!/usr/bin/env bash
# Blob serving, bootfleet against nginx (sendfile on) serving the same files on loopback,
# same run, alternating rounds:
#   small: the image's 7-byte initrd, wrk -t2 -c16: requests a second and server CPU a
#          request (the fixed cost of a blob request);
#   large: a 256 MiB blob, wrk -t2 -c16: MB/s and server CPU per GB.
# Each server runs in a cgroup of its own (v1 memory + cpuacct, made and removed here):
# CPU is the cgroup's (nginx's master and workers together), memory its peak charge
# (anonymous and any page cache it brought in) and the process's peak RSS (VmHWM, which
# counts a mapped file's pages too; nginx: the largest worker's).
# Usage: bench/blobs.sh [SECONDS=10] [ROUNDS=2]. Needs: nginx-light wrk bc curl; root.
source "$(dirname "$0")/lib.sh"
duration=${1:-10}
rounds=${2:-2}
for tool in nginx wrk bc curl; do
  command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install nginx-light wrk bc curl" >&2; exit 1; }
done
[ -d /sys/fs/cgroup/memory ] && [ -d /sys/fs/cgroup/cpuacct ] ||
  { echo "needs cgroup v1 memory and cpuacct hierarchies (run as root)" >&2; exit 1; }
build_release
work=$(mktemp -d /var/tmp/bootfleet-bench.XXXXXX)
NGINX_PID=
groups="bf-bench-bootfleet bf-bench-nginx"
cleanup() {
  stop_server 2>/dev/null
  [ -n "$NGINX_PID" ] && kill "$NGINX_PID" 2>/dev/null && wait "$NGINX_PID" 2>/dev/null
  for g in $groups; do for h in memory cpuacct; do rmdir "/sys/fs/cgroup/$h/$g" 2>/dev/null; done; done
  rm -rf "$work"
}
trap cleanup EXIT
for g in $groups; do for h in memory cpuacct; do mkdir -p "/sys/fs/cgroup/$h/$g"; done; done
# in_group NAME CMD...: becomes CMD inside cgroup NAME (so every charge is its own);
# only as RUN_IN, in a background job (it replaces the shell that runs it).
in_group() {
  local g=$1
  shift
  exec sh -c 'for h in memory cpuacct; do echo $$ >"/sys/fs/cgroup/$h/'"$g"'/cgroup.procs"; done; exec "$@"' sh "$@"
}
cpu_ns() { cat "/sys/fs/cgroup/cpuacct/$1/cpuacct.usage"; }

make_image "$work/img" 2 256M
# Published by a server outside the cgroups (the page cache it writes is charged there),
# then served by one inside.
start_server "$work/data" 18182
"$BIN" --server http://127.0.0.1:18182 --data-dir "$work/data" image publish "$work/img" >/dev/null
stop_server
RUN_IN=(in_group bf-bench-bootfleet)
start_server "$work/data" 18182
big=$(sha256sum "$work/img/rootfs" | cut -d' ' -f1)
small=$(sha256sum "$work/img/initrd.img" | cut -d' ' -f1)
cat "$work/data/blobs/sha256/$big" >/dev/null

RUN_IN=(in_group bf-bench-nginx)
start_nginx "$work/data" 18183 "$work"
for hex in $big $small; do
  curl -fs "http://127.0.0.1:18183/blobs/sha256/$hex" | sha256sum | grep -q "$hex" || { echo "nginx serves the wrong bytes" >&2; exit 1; }
  curl -fs "http://127.0.0.1:18182/blobs/sha256/$hex" | sha256sum | grep -q "$hex" || { echo "bootfleet serves the wrong bytes" >&2; exit 1; }
done

to_bytes() { # wrk prints e.g. 1.23GB, 950.00MB
  local v=$1
  case "$v" in
    *GB) echo "${v%GB} * 1073741824" | bc -l ;;
    *MB) echo "${v%MB} * 1048576" | bc -l ;;
    *KB) echo "${v%KB} * 1024" | bc -l ;;
    *B) echo "${v%B}" ;;
  esac
}
# round NAME GROUP PORT HEX: one wrk run; prints "requests bytes seconds cpu_ns".
round() {
  local before after out
  before=$(cpu_ns "$2")
  out=$(wrk -t2 -c16 -d"${duration}s" "http://127.0.0.1:$3/blobs/sha256/$4")
  after=$(cpu_ns "$2")
  echo "$out" | awk -v cpu=$((after - before)) '
    / requests in / {req=$1; secs=$4; sub(/s,/, "", secs); read=$5}
    END {print req, read, secs, cpu}'
}
declare -A req bytes secs cpu
for r in $(seq "$rounds"); do
  for kind in small large; do
    hex=$small; [ "$kind" = large ] && hex=$big
    for who in nginx bootfleet; do
      port=18183; [ "$who" = bootfleet ] && port=18182
      read -r n b s c < <(round "$who" "bf-bench-$who" "$port" "$hex")
      k="$who.$kind"
      req[$k]=$(( ${req[$k]:-0} + n ))
      bytes[$k]=$(echo "${bytes[$k]:-0} + $(to_bytes "$b")" | bc -l)
      secs[$k]=$(echo "${secs[$k]:-0} + $s" | bc -l)
      cpu[$k]=$(( ${cpu[$k]:-0} + c ))
    done
  done
done
bf_rss=$(awk '/VmHWM/ {print $2}' "/proc/$SERVER_PID/status")
ng_rss=$(for p in $(pgrep -P "$NGINX_PID") "$NGINX_PID"; do awk '/VmHWM/ {print $2}' "/proc/$p/status"; done | sort -n | tail -1)
peak() { echo "$(cat "/sys/fs/cgroup/memory/$1/memory.max_usage_in_bytes") / 1048576" | bc -l; }

machine
echo "wrk -t2 -c16 -d${duration}s, $rounds alternating rounds; CPU and memory from each server's cgroup"
for who in nginx bootfleet; do
  s="$who.small" l="$who.large"
  printf '%-10s 7-byte blob: %8.0f req/s, %5.1f us CPU a request | 256 MiB blob: %5.0f MB/s, %5.2f s CPU per GB\n' "$who" \
    "$(echo "${req[$s]} / ${secs[$s]}" | bc -l)" "$(echo "${cpu[$s]} / ${req[$s]} / 1000" | bc -l)" \
    "$(echo "${bytes[$l]} / ${secs[$l]} / 1000000" | bc -l)" "$(echo "${cpu[$l]} / (${bytes[$l]} / 1073741824) / 1000000000" | bc -l)"
done
ratio() { echo "(${1}) / (${2})" | bc -l; }
printf 'bootfleet/nginx rate: small %.2f, large %.2f (goal >= 1.0)\n' \
  "$(ratio "${req[bootfleet.small]} / ${secs[bootfleet.small]}" "${req[nginx.small]} / ${secs[nginx.small]}")" \
  "$(ratio "${bytes[bootfleet.large]} / ${secs[bootfleet.large]}" "${bytes[nginx.large]} / ${secs[nginx.large]}")"
printf 'bootfleet/nginx CPU: a small request %.2f, per GB %.2f (goal <= 1.0)\n' \
  "$(ratio "${cpu[bootfleet.small]} / ${req[bootfleet.small]}" "${cpu[nginx.small]} / ${req[nginx.small]}")" \
  "$(ratio "${cpu[bootfleet.large]} / ${bytes[bootfleet.large]}" "${cpu[nginx.large]} / ${bytes[nginx.large]}")"
printf 'peak RSS: bootfleet %.1f MiB, nginx %.1f MiB (its largest worker) (goal < 64 MiB)\n' "$(echo "$bf_rss / 1024" | bc -l)" "$(echo "$ng_rss / 1024" | bc -l)"
printf 'peak cgroup charge: bootfleet %.1f MiB, nginx %.1f MiB\n' "$(peak bf-bench-bootfleet)" "$(peak bf-bench-nginx)"
