#!/usr/bin/env bash
# The boot storm across two servers sharing PostgreSQL and an S3 object store, against
# one server on SQLite with its local blob directory: same machine, same run, same
# simulated nodes (bootfleet-bench storm: DHCP -> TFTP -> DHCP (iPXE) -> scripts ->
# kernel, initrd -> attest -> validate -> 2 heartbeats).
#
# Usage: sudo bench/cluster.sh NODES [RAMP=0s]
# Namespaces on one bridge (bfc0, in the root namespace, no address): bfc-a (server A,
# 10.98.0.1, and s3s-fs on :9000), bfc-b (server B, 10.98.0.3), bfc-sim (the nodes,
# 10.98.0.2; the pool 10.98.128.0/17 is routed to it, each node sends from its lease).
# Two servers: DHCP authoritative with [dhcp] slices = 2 (each answers from its half),
# PostgreSQL over its Unix socket, blobs in s3s-fs (each server's blobs/ a cache of it).
# Needs: postgresql, s3s-fs (cargo install s3s-fs --version 0.14.1 --features binary),
# ipxe, curl.
source "$(dirname "$0")/lib.sh"
nodes=${1:?usage: bench/cluster.sh NODES [RAMP]}
ramp=${2:-0s}
[ "$(id -u)" = 0 ] || { echo "run as root (namespaces, ports 67 and 69)" >&2; exit 1; }
S3FS=$(command -v s3s-fs || echo "${CARGO_HOME:-$HOME/.cargo}/bin/s3s-fs")
[ -x "$S3FS" ] || { echo "missing s3s-fs: cargo install s3s-fs --version 0.14.1 --features binary --locked" >&2; exit 1; }
[ -f /usr/lib/ipxe/undionly.kpxe ] || { echo "missing /usr/lib/ipxe/undionly.kpxe: apt-get install ipxe" >&2; exit 1; }
build_release
A=bfc-a B=bfc-b SIM=bfc-sim
PG_PID=
cleanup() {
  for ns in $A $B $SIM; do ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true; done
  [ -n "$PG_PID" ] && kill -INT "$PG_PID" 2>/dev/null || true
  sleep 1
  for ns in $A $B $SIM; do ip netns del "$ns" 2>/dev/null || true; done
  ip link del bfc0 2>/dev/null || true
  if [ -n "${work:-}" ]; then rm -rf "$work"; fi
}
trap cleanup EXIT
cleanup
work=$(mktemp -d /var/tmp/bootfleet-cluster.XXXXXX)
chmod 755 "$work"
ip link add bfc0 type bridge
ip link set bfc0 up
join() { # join NS VETH ADDRESS
  ip netns add "$1"
  ip -n "$1" link set lo up
  ip link add "$2" type veth peer name eth0 netns "$1"
  ip link set "$2" master bfc0 up
  ip -n "$1" addr add "$3/16" dev eth0
  ip -n "$1" link set eth0 up
}
join $A bfcv-a 10.98.0.1
join $B bfcv-b 10.98.0.3
join $SIM bfcv-s 10.98.0.2
for ns in $A $B; do ip -n $ns route add 10.98.128.0/17 via 10.98.0.2; done
ip -n $SIM route add local 10.98.128.0/17 dev lo
sim() { ip netns exec $SIM "$BENCH" "$@"; }
ulimit -n "$(ulimit -Hn)"

mkdir -p "$work/pg" "$work/s3"
start_postgres "$work/pg"
printf 'access_key_id = "bench-access"\nsecret_access_key = "bench-secret-0123456789"\n' >"$work/s3.credentials"
ip netns exec $A "$S3FS" --host 10.98.0.1 --port 9000 --access-key bench-access \
  --secret-key bench-secret-0123456789 "$work/s3" >"$work/s3.log" 2>&1 &
echo "cluster-bench-admin-token-0123456789" >"$work/admin.token"

# config NAME IP STORE: a server's settings; STORE "shared" adds PostgreSQL, S3, slices.
config() {
  local name=$1 ip=$2 store=$3
  cat <<TOML
listen = "$ip:8080"
admin_token_file = "$work/admin.token"
[tftp]
listen = "$ip:69"
ipxe_dir = "/usr/lib/ipxe"
max_transfers = 60000
[dhcp]
mode = "authoritative"
interface = "eth0"
server_ip = "$ip"
subnet_mask = "255.255.0.0"
$([ "$store" = shared ] && echo "slices = 2")
[dhcp.pool]
start = "10.98.128.1"
end = "10.98.255.250"
lease_secs = 3600
TOML
  if [ "$store" = shared ]; then
    cat <<TOML
[store]
url = "$PG_URL"
[blobs]
url = "s3://bench/fleet"
endpoint = "http://10.98.0.1:9000"
credentials_file = "$work/s3.credentials"
[cluster]
servers = ["http://10.98.0.1:8080", "http://10.98.0.3:8080"]
TOML
  fi
}
PIDS=()
serve() { # serve NS NAME IP STORE
  config "$2" "$3" "$4" >"$work/$2.toml"
  ip netns exec "$1" "$BIN" --data-dir "$work/$2" serve --config "$work/$2.toml" >"$work/$2.log" 2>&1 &
  for _ in $(seq 300); do ip netns exec "$1" curl -fs "http://$3:8080/healthz" >/dev/null 2>&1 && break; sleep 0.1; done
  PIDS+=("$(ip netns exec "$1" pgrep -n -f "bootfleet --data-dir $work/$2 serve")")
}
stop_all() {
  for p in "${PIDS[@]}"; do kill "$p" 2>/dev/null || true; done
  for p in "${PIDS[@]}"; do while kill -0 "$p" 2>/dev/null; do sleep 0.1; done; done
  PIDS=()
}
summary() {
  python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
s = r.get('server') or {}
print(f"completed {r['completed']}/{r['nodes']} in {r['wall_secs']:.1f} s; servers' cpu {s.get('cpu_secs', 0):.1f} s, peak anonymous {s.get('peak_anon_mib', 0):.1f} MiB")
for p, v in r['phases'].items():
    print(f"  {p:<11} p50 {v['p50_ms']:9.1f} ms  p90 {v['p90_ms']:9.1f}  p99 {v['p99_ms']:9.1f}  max {v['max_ms']:9.1f}")
for k, v in r['failures'].items(): print(f"  failed: {v} x {k}")
for k, v in r['retries'].items(): print(f"  retries: {k} {v}")
PY
}
storm() { # storm NAME: sets up the image through the first server, runs the storm
  export BOOTFLEET_SERVER=http://10.98.0.1:8080 BOOTFLEET_TOKEN
  BOOTFLEET_TOKEN=$(cat "$work/admin.token")
  ip netns exec $A "$BENCH" storm-setup --nodes "$nodes" --kernel-mib 1 --initrd-mib 4 >/dev/null
  local pids
  pids=$(IFS=,; echo "${PIDS[*]}")
  sim storm --nodes "$nodes" --interface eth0 --ramp "$ramp" --bind-leased --measure-pid "$pids" \
    --output json >"$work/$1.json"
  summary "$work/$1.json"
}

machine
echo "nodes $nodes, power-on spread over $ramp, kernel 1 MiB + initrd 4 MiB"
echo "== one server, SQLite and its local blob directory"
serve $A one 10.98.0.1 local
storm one
stop_all
echo "== two servers, PostgreSQL and S3 (s3s-fs), DHCP slices = 2"
serve $A two-a 10.98.0.1 shared
serve $B two-b 10.98.0.3 shared
storm two
stop_all
python3 - "$work/one.json" "$work/two.json" <<'PY'
import json, sys
one, two = (json.load(open(p)) for p in sys.argv[1:3])
print("two servers / one server (lower is better for time):")
print(f"  completion  {two['wall_secs']/one['wall_secs']:.2f}x  ({one['wall_secs']:.1f} s -> {two['wall_secs']:.1f} s)")
for p in ['script', 'attest', 'validate', 'ready']:
    if p in one['phases'] and p in two['phases']:
        a, b = one['phases'][p], two['phases'][p]
        print(f"  {p:<10} p50 {b['p50_ms']/a['p50_ms']:5.2f}x  p99 {b['p99_ms']/a['p99_ms']:5.2f}x")
print(f"  failures   one {sum(one['failures'].values())}, two {sum(two['failures'].values())}")
PY
