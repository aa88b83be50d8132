#!/usr/bin/env bash
# Boot storm: N simulated nodes power on together and boot through the whole protocol
# (bootfleet-bench storm) against bootfleet, then against a reference stack of dnsmasq
# (DHCP + TFTP) and nginx (HTTP) doing the same work up to the downloads, in the same
# run; then the HTTP phase alone against both, and its loopback bound. Each bootfleet run
# (the full boot, then the reference's work only) starts a server on an empty data
# directory, so both begin from the same state; it prints their ratio.
#
# Usage: sudo bench/storm.sh NODES [LOSS_PERCENT=0] [RAMP=10s]
# Two namespaces joined by a veth pair: bfs-srv (the servers, 10.98.0.1) and bfs-sim (the
# nodes, 10.98.0.2) on 10.98.0.0/15; the pool 10.99.0.0/16 (65,530 addresses) is routed to
# the nodes' side so that each node sends from its own leased address. LOSS_PERCENT drops
# that share of UDP in both directions (nftables numgen, on each namespace's input). Needs nftables, dnsmasq-base, nginx-light, ipxe.
# FULL_ONLY=1: the full boot through bootfleet only (the other runs are skipped).
# BOOTFLEET_ONLY=1: bootfleet's two runs and their ratio (dnsmasq, nginx and the HTTP
# phase alone are skipped).
# MAX_CONNECTIONS=N, KEEP_ALIVE=N: bootfleet's [http] max_connections and
# keep_alive_connections (default: the server's).
# METRICS=FILE: the server's /metrics after the full boot, written to FILE.
# HEAPTRACK=FILE: the server runs under heaptrack (apt-get install heaptrack), its
# allocations written to FILE.zst; implies FULL_ONLY.
source "$(dirname "$0")/lib.sh"
nodes=${1:?usage: bench/storm.sh NODES [LOSS_PERCENT] [RAMP]}
loss=${2:-0}
ramp=${3:-10s}
kernel_mib=${KERNEL_MIB:-1}
initrd_mib=${INITRD_MIB:-4}
[ "$nodes" -le 65530 ] || { echo "at most 65,530 nodes (the pool)" >&2; exit 1; }
[ "$(id -u)" = 0 ] || { echo "run as root (namespaces, ports 67 and 69)" >&2; exit 1; }
for tool in nft dnsmasq nginx; do
  command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install nftables dnsmasq-base nginx-light" >&2; exit 1; }
done
[ -f /usr/lib/ipxe/undionly.kpxe ] || { echo "missing /usr/lib/ipxe/undionly.kpxe: apt-get install ipxe" >&2; exit 1; }
build_release
work=$(mktemp -d /var/tmp/bootfleet-storm.XXXXXX)
SRV=bfs-srv SIM=bfs-sim
cleanup() {
  for ns in $SRV $SIM; do ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null || true; done
  sleep 0.5
  ip netns del $SRV 2>/dev/null || true
  ip netns del $SIM 2>/dev/null || true
  [ -n "${KEEP:-}" ] && echo "kept $work" || rm -rf "$work"
}
trap cleanup EXIT
cleanup; work=$(mktemp -d /var/tmp/bootfleet-storm.XXXXXX)
ip netns add $SRV
ip netns add $SIM
ip -n $SRV link set lo up
ip -n $SIM link set lo up
ip link add bfs0 netns $SRV type veth peer name bfs1 netns $SIM
ip -n $SRV addr add 10.98.0.1/15 dev bfs0
ip -n $SIM addr add 10.98.0.2/15 dev bfs1
ip -n $SRV link set bfs0 up
ip -n $SIM link set bfs1 up
# The pool is the nodes' own: one route (and one ARP entry) on the server's side.
ip -n $SRV route add 10.99.0.0/16 via 10.98.0.2
ip -n $SIM route add local 10.99.0.0/16 dev lo
if [ "$loss" != 0 ]; then
  # Dropped where each side receives: a drop on an output hook would fail the sender's
  # sendto with EPERM, which real loss never does.
  for ns in $SIM $SRV; do
    ip netns exec $ns nft -f - <<NFT
table inet storm {
  chain in { type filter hook input priority 0; meta l4proto udp numgen random mod 100 < $loss drop; }
}
NFT
  done
fi
sim() { ip netns exec $SIM "$BENCH" "$@"; }
# summary REPORT.json: the storm's figures, one phase a line.
summary() {
  python3 - "$1" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
s = r.get('server') or {}
print(f"completed {r['completed']}/{r['nodes']} in {r['wall_secs']:.1f} s; server cpu {s.get('cpu_secs', 0):.1f} s, peak rss {s.get('peak_rss_mib', 0):.1f} MiB (with mapped blob pages), peak anonymous {s.get('peak_anon_mib', 0):.1f} MiB")
for p, v in r['phases'].items():
    print(f"  {p:<11} p50 {v['p50_ms']:9.1f} ms  p90 {v['p90_ms']:9.1f}  p99 {v['p99_ms']:9.1f}  max {v['max_ms']:9.1f}")
for k, v in r['failures'].items(): print(f"  failed: {v} x {k}")
for k, v in r['retries'].items(): print(f"  retries: {k} {v}")
PY
}
srv() { ip netns exec $SRV "$@"; }
# udp_drops: datagrams each namespace's kernel dropped for a full receive or send buffer
# since the namespaces were made (Udp: InErrors RcvbufErrors SndbufErrors), and the
# server's TCP connections dropped for a full accept queue (TcpExt).
udp_drops() {
  for ns in $SRV $SIM; do
    ip netns exec "$ns" awk -v ns="$ns" '/^Udp:/ { if (!h) { for (i = 1; i <= NF; i++) k[i] = $i; h = 1 } else for (i = 1; i <= NF; i++) if (k[i] ~ /InErrors|RcvbufErrors|SndbufErrors/) printf "%s%s %s=%s", (n++ ? "," : "  udp drops " ns ":"), "", k[i], $i } END { print "" }' /proc/net/snmp
  done
  # Connections the server's kernel refused for a full accept queue (each costs its node
  # a SYN retransmission: 1 s, 3 s, 7 s, 15 s, 31 s after the first).
  ip netns exec $SRV awk '/^TcpExt:/ { if (!h) { for (i = 1; i <= NF; i++) k[i] = $i; h = 1 } else for (i = 1; i <= NF; i++) if (k[i] ~ /^(ListenOverflows|ListenDrops|TCPReqQFullDrop)$/) printf "%s%s=%s", (n++ ? ", " : "  tcp listen drops " ns ": "), k[i], $i } END { print "" }' ns=$SRV /proc/net/netstat
}

# --- bootfleet -------------------------------------------------------------------------
cat >"$work/bootfleet.toml" <<TOML
listen = "10.98.0.1:8080"
[tftp]
listen = "10.98.0.1:69"
ipxe_dir = "/usr/lib/ipxe"
max_transfers = 60000
[dhcp]
mode = "authoritative"
interface = "bfs0"
server_ip = "10.98.0.1"
subnet_mask = "255.254.0.0"
[dhcp.pool]
start = "10.99.0.1"
end = "10.99.255.250"
lease_secs = 3600
TOML
if [ -n "${MAX_CONNECTIONS:-}${KEEP_ALIVE:-}" ]; then
  echo "[http]" >>"$work/bootfleet.toml"
  if [ -n "${MAX_CONNECTIONS:-}" ]; then echo "max_connections = $MAX_CONNECTIONS" >>"$work/bootfleet.toml"; fi
  if [ -n "${KEEP_ALIVE:-}" ]; then echo "keep_alive_connections = $KEEP_ALIVE" >>"$work/bootfleet.toml"; fi
fi
ulimit -n "$(ulimit -Hn)"
profile=()
[ -n "${HEAPTRACK:-}" ] && profile=(heaptrack -o "$HEAPTRACK")
# start_bootfleet DATA_DIR: a server on an empty data directory, with the storm's image
# published and assigned to every node. Each bootfleet run starts from one: the same state
# (no node has a lease or a boot yet), so that the runs differ only in the work asked.
export BOOTFLEET_SERVER=http://10.98.0.1:8080 BOOTFLEET_TOKEN
start_bootfleet() {
  local data=$1
  srv "${profile[@]}" "$BIN" --data-dir "$data" serve --config "$work/bootfleet.toml" >>"$work/server.log" 2>&1 &
  SERVER_JOB=$!
  for _ in $(seq 300); do srv curl -fs http://10.98.0.1:8080/healthz >/dev/null 2>&1 && break; sleep 0.1; done
  # The newest: under heaptrack, its wrapper script names the same command.
  BF_PID=$(srv pgrep -n -f "bootfleet --data-dir $data serve")
  BOOTFLEET_TOKEN=$(cat "$data/admin.token")
  mapfile -t urls < <(srv "$BENCH" storm-setup --nodes "$nodes" --kernel-mib "$kernel_mib" \
    --initrd-mib "$initrd_mib" --reference-dir "$work/www")
}
stop_bootfleet() {
  kill "$BF_PID" 2>/dev/null || true
  wait "$SERVER_JOB" || true # heaptrack writes its file once the server is gone
}
start_bootfleet "$work/data"
machine
echo "nodes $nodes, UDP loss ${loss}%, power-on spread over $ramp, kernel ${kernel_mib} MiB + initrd ${initrd_mib} MiB, every 10th kernel download cut and resumed"
echo "== bootfleet: DHCP -> TFTP undionly.kpxe -> DHCP (iPXE) -> scripts -> kernel, initrd -> attest -> validate (8 GPUs) -> 2 heartbeats"
sim storm --nodes "$nodes" --interface bfs1 --ramp "$ramp" --bind-leased --measure-pid "$BF_PID" \
  --output json >"$work/bf.json"
summary "$work/bf.json"
udp_drops
if [ -n "${METRICS:-}" ]; then
  srv curl -fsS -H "Authorization: Bearer $BOOTFLEET_TOKEN" http://10.98.0.1:8080/metrics >"$METRICS"
fi
stop_bootfleet
if [ -n "${HEAPTRACK:-}${FULL_ONLY:-}" ]; then
  exit 0
fi
start_bootfleet "$work/data-noagent"
echo "== bootfleet, the reference's work only (no agent API): DHCP -> TFTP -> DHCP (iPXE) -> scripts -> kernel, initrd"
sim storm --nodes "$nodes" --interface bfs1 --ramp "$ramp" --bind-leased --no-agent --measure-pid "$BF_PID" \
  --output json >"$work/bf-noagent.json"
summary "$work/bf-noagent.json"
udp_drops # counted since the namespaces were made: less the full run's above
python3 - "$work/bf.json" "$work/bf-noagent.json" <<'PY'
import json, sys
full, ref = (json.load(open(p))['phases'] for p in sys.argv[1:3])
if all(p in full and p in ref and ref[p]['p99_ms'] > 0 for p in ('ready', 'dhcp-pxe')):
    r = lambda phase, q: full[phase][q] / ref[phase][q]
    print(f"full boot / the reference's work only: ready p50 {r('ready', 'p50_ms'):.2f}x, p99 {r('ready', 'p99_ms'):.2f}x (goal <= 1.2); PXE DHCP p99 {r('dhcp-pxe', 'p99_ms'):.2f}x (goal <= 2)")
else:
    print("full boot / the reference's work only: no ratio (a run readied no node)")
PY
stop_bootfleet
[ -z "${BOOTFLEET_ONLY:-}" ] || exit 0

# --- reference: dnsmasq (DHCP + TFTP) and nginx, the same bytes --------------------------
cat >"$work/www/boot.ipxe" <<IPXE
#!ipxe
kernel http://10.98.0.1:8081/vmlinuz initrd=initrd.img console=ttyS0 quiet
initrd http://10.98.0.1:8081/initrd.img
boot
IPXE
cat >"$work/nginx.conf" <<NGINX
user root;
worker_processes 1;
worker_rlimit_nofile 65536;
daemon off;
pid $work/nginx.pid;
error_log $work/nginx.err;
events { worker_connections 30000; }
http { access_log off; sendfile on; keepalive_requests 1000; server { listen 10.98.0.1:8081 backlog=8192; root $work/www; } }
NGINX
srv nginx -c "$work/nginx.conf" &
srv dnsmasq --keep-in-foreground --port=0 --interface=bfs0 --bind-interfaces \
  --dhcp-range=10.99.0.1,10.99.255.250,255.254.0.0,1h --dhcp-lease-max=70000 \
  --dhcp-leasefile="$work/dnsmasq.leases" --no-ping --enable-tftp --tftp-root=/usr/lib/ipxe \
  --tftp-max=20000 --dhcp-userclass=set:ipxe,iPXE \
  "--dhcp-boot=tag:ipxe,http://10.98.0.1:8081/boot.ipxe" "--dhcp-boot=tag:!ipxe,undionly.kpxe" \
  2>"$work/dnsmasq.log" &
sleep 1
REF_PIDS=$(srv pgrep -d, -f "dnsmasq --keep-in-foreground|nginx -c $work/nginx.conf|nginx: worker")
echo "== dnsmasq + nginx: DHCP -> TFTP undionly.kpxe -> DHCP (iPXE) -> script -> kernel, initrd (no agent API)"
# Without --bind-leased: dnsmasq 2.90 answered every TFTP request from a pool address routed
# to the simulator with "unsupported request"; here all nodes send from 10.98.0.2.
sim storm --nodes "$nodes" --interface bfs1 --ramp "$ramp" --no-agent \
  --measure-pid "$REF_PIDS" --output json >"$work/ref.json"
summary "$work/ref.json"
python3 - "$work/ref.json" "$work/bf-noagent.json" <<'PY'
import json, sys
ref, bf = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
print("dnsmasq+nginx latency / bootfleet latency, same work (higher: bootfleet faster; goal >= 2 for DHCP and TFTP):")
for p in ['dhcp-pxe', 'tftp', 'dhcp-ipxe', 'script', 'kernel', 'initrd', 'ready']:
    if p in ref['phases'] and p in bf['phases']:
        a, b = ref['phases'][p], bf['phases'][p]
        print(f"  {p:<10} p50 {a['p50_ms']/b['p50_ms']:6.2f}x  p99 {a['p99_ms']/b['p99_ms']:6.2f}x")
PY
srv pkill -f "dnsmasq --keep-in-foreground" || true

# --- the HTTP phase alone, and its bound (inside bfs-srv: to a local address, over loopback)
srv "$BIN" --data-dir "$work/data-noagent" serve --config "$work/bootfleet.toml" >>"$work/server.log" 2>&1 &
for _ in $(seq 100); do srv curl -fs http://10.98.0.1:8080/healthz >/dev/null 2>&1 && break; sleep 0.1; done
bytes=$(( $(stat -c %s "$work/www/vmlinuz") + $(stat -c %s "$work/www/initrd.img") ))
echo "== HTTP phase alone: $nodes clients at once, each on its own connection, kernel + initrd ($bytes bytes), every 10th cut and resumed"
srv "$BENCH" http --nodes "$nodes" --url "${urls[0]}" --url "${urls[1]}" --output json >"$work/http-bf.json"
srv "$BENCH" http --nodes "$nodes" --url http://10.98.0.1:8081/vmlinuz --url http://10.98.0.1:8081/initrd.img --output json >"$work/http-ref.json"
srv "$BENCH" bound --connections "$nodes" --bytes "$bytes" --output json >"$work/bound.json"
python3 - "$work" <<'PY'
import json, sys
w = sys.argv[1]
bf, ref, bound = (json.load(open(f"{w}/{n}.json")) for n in ("http-bf", "http-ref", "bound"))
for name, r in (("bootfleet", bf), ("nginx", ref), ("loopback bound", bound)):
    print(f"  {name:<15} {r['gib_per_sec']:6.2f} GiB/s  ({r['wall_secs']:.2f} s, {r['failures']} failed)")
print(f"bootfleet time / bound time: {bf['wall_secs']/bound['wall_secs']:.2f} (goal <= 1.2); nginx: {ref['wall_secs']/bound['wall_secs']:.2f}")
PY
