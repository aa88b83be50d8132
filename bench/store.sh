#!/usr/bin/env bash
# Full boots per second (node script: lookup, REF resolution, a boot record and a state
# change committed, render) on SQLite against PostgreSQL, same machine, same run, both
# durable (SQLite synchronous=FULL; PostgreSQL fsync and synchronous_commit on):
# wrk -t2 -cC on /boot/node.ipxe for one node, for each concurrency C.
# Usage: bench/store.sh [SECONDS=10]. Needs: postgresql wrk curl.
source "$(dirname "$0")/lib.sh"
duration=${1:-10}
for tool in wrk curl; do
  command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install wrk curl" >&2; exit 1; }
done
build_release
work=$(mktemp -d /var/tmp/bootfleet-bench.XXXXXX)
chmod 755 "$work"
PG_PID=
trap 'stop_server 2>/dev/null; [ -n "$PG_PID" ] && kill -INT "$PG_PID" 2>/dev/null; sleep 1; rm -rf "$work"' EXIT
mkdir -p "$work/pg"
start_postgres "$work/pg"
make_image "$work/img" 100000
machine
echo "wrk -t2 (-t1 at c=1) -d${duration}s, one node's full boot per request"
for store in sqlite postgres; do
  flags=()
  [ "$store" = postgres ] && flags=(--store-url "$PG_URL")
  start_server "$work/$store" 18186 "${flags[@]}"
  url=http://127.0.0.1:18186
  "$BIN" --server "$url" --data-dir "$work/$store" image publish "$work/img" --tag bench:stable >/dev/null
  "$BIN" --server "$url" --data-dir "$work/$store" node assign 52-54-00-00-00-01 bench:stable >/dev/null
  for c in 1 8 32; do
    t=$(( c < 2 ? 1 : 2 ))
    rps=$(wrk -t"$t" -c"$c" -d"${duration}s" "$url/boot/node.ipxe?mac=52-54-00-00-00-01" | awk '/Requests\/sec/ {print $2}')
    echo "$store c=$c: $rps boots/s"
    eval "rps_${store}_$c=$rps"
  done
  echo "$store peak RSS: $(awk '/VmHWM/ {printf "%.1f MiB", $2/1024}' /proc/$SERVER_PID/status)"
  stop_server
done
for c in 1 8 32; do
  s=$(eval echo "\$rps_sqlite_$c"); p=$(eval echo "\$rps_postgres_$c")
  printf 'c=%s: postgres/sqlite %.2f\n' "$c" "$(echo "$p / $s" | bc -l)"
done
