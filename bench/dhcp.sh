#!/usr/bin/env bash
# DHCP DORA exchanges per second, perfdhcp against bootfleet (authoritative, leases saved
# in batches), Kea kea-dhcp4 (memfile, persisted) and dnsmasq (lease file), in the same
# run, same pool (10.99.0.10-10.99.255.250), each server alone in a network namespace
# pinned to CPU 1, perfdhcp in another namespace pinned to CPU 0, joined by a veth pair.
# Reports the rate perfdhcp measured, drops, and server CPU per exchange.
# Usage: sudo bench/dhcp.sh [RATE=20000] [SECONDS=10] [CLIENTS=50000].
# Needs: kea-admin (perfdhcp) kea-dhcp4-server dnsmasq-base iproute2 util-linux (taskset).
source "$(dirname "$0")/lib.sh"
rate=${1:-20000}
secs=${2:-10}
clients=${3:-50000}
for tool in perfdhcp kea-dhcp4 dnsmasq taskset; do
  command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install kea-admin kea-dhcp4-server dnsmasq-base util-linux" >&2; exit 1; }
done
[ "$(id -u)" = 0 ] || { echo "run as root (network namespaces)" >&2; exit 1; }
build_release
work=$(mktemp -d /var/tmp/bootfleet-dhcp.XXXXXX)
SRV_PID=
cleanup() {
  [ -n "$SRV_PID" ] && kill "$SRV_PID" 2>/dev/null
  ip netns del bfd-srv 2>/dev/null
  ip netns del bfd-cli 2>/dev/null
  rm -rf "$work"
}
trap cleanup EXIT
ip netns del bfd-srv 2>/dev/null || true
ip netns del bfd-cli 2>/dev/null || true
ip netns add bfd-srv
ip netns add bfd-cli
ip link add name eth0 netns bfd-srv type veth peer name eth0 netns bfd-cli
for ns in bfd-srv bfd-cli; do ip -n $ns link set lo up; ip -n $ns link set eth0 up; done
ip -n bfd-srv addr add 10.99.0.1/16 dev eth0
ip -n bfd-cli addr add 10.99.0.2/16 dev eth0
tck=$(getconf CLK_TCK)

cat >"$work/bootfleet.toml" <<TOML
listen = "10.99.0.1:18190"
[dhcp]
mode = "authoritative"
interface = "eth0"
server_ip = "10.99.0.1"
subnet_mask = "255.255.0.0"
[dhcp.pool]
start = "10.99.0.10"
end = "10.99.255.250"
lease_secs = 3600
TOML
cat >"$work/kea.json" <<JSON
{ "Dhcp4": {
  "interfaces-config": { "interfaces": ["eth0"] },
  "lease-database": { "type": "memfile", "persist": true, "name": "$work/kea.leases", "lfc-interval": 0 },
  "valid-lifetime": 3600,
  "subnet4": [ { "id": 1, "subnet": "10.99.0.0/16", "pools": [ { "pool": "10.99.0.10 - 10.99.255.250" } ] } ],
  "loggers": [ { "name": "kea-dhcp4", "severity": "ERROR", "output_options": [ { "output": "$work/kea.log" } ] } ]
} }
JSON

# start NAME CMD...: runs CMD in the server namespace on CPU 1; sets SRV_PID.
start() {
  local name=$1; shift
  ip netns exec bfd-srv taskset -c 1 "$@" >"$work/$name.out" 2>&1 &
  SRV_PID=$!
  sleep 2
  kill -0 "$SRV_PID" 2>/dev/null || { echo "$name did not start:"; cat "$work/$name.out"; exit 1; }
}

stop() {
  kill "$SRV_PID" 2>/dev/null || true
  wait "$SRV_PID" 2>/dev/null || true
  SRV_PID=
}

ticks() { awk '{print $14 + $15}' "/proc/$1/stat"; }

# measure NAME: perfdhcp against the running server; prints one result line.
measure() {
  local name=$1 before after out
  before=$(ticks "$SRV_PID")
  out=$(ip netns exec bfd-cli taskset -c 0 perfdhcp -4 -l eth0 -r "$rate" -R "$clients" -p "$secs" -W 2000000 2>&1 || true)
  after=$(ticks "$SRV_PID")
  echo "$out" >"$work/$name.perfdhcp"
  local measured sent_do recv_do sent_ra recv_ra
  measured=$(echo "$out" | awk '/^Rate:/ {print $2; exit}')
  read -r sent_do recv_do sent_ra recv_ra < <(echo "$out" | awk '/sent packets:/ {s[++i]=$3} /received packets:/ {r[++j]=$3} END {print s[1]+0, r[1]+0, s[2]+0, r[2]+0}')
  local exchanges=$recv_ra
  local cpu_us
  cpu_us=$(echo "($after - $before) / $tck * 1000000 / ($exchanges + 0.000001)" | bc -l)
  printf '%-9s %10.0f exchanges/s  DO %s/%s  RA %s/%s  server CPU %6.1f us/exchange\n' \
    "$name" "${measured:-0}" "$recv_do" "$sent_do" "$recv_ra" "$sent_ra" "$cpu_us"
  echo "${measured:-0} $cpu_us" >"$work/$name.result"
}

machine
echo "perfdhcp -r $rate -R $clients -p ${secs}s; pool 10.99.0.10-10.99.255.250; server on CPU 1, perfdhcp on CPU 0"
start bootfleet "$BIN" --data-dir "$work/bf-data" serve --config "$work/bootfleet.toml" --log-format json
measure bootfleet
stop
start kea env KEA_PIDFILE_DIR="$work" KEA_LOCKFILE_DIR="$work" kea-dhcp4 -c "$work/kea.json"
measure kea
stop
start dnsmasq dnsmasq --keep-in-foreground --port=0 --interface=eth0 --bind-interfaces \
  --dhcp-range=10.99.0.10,10.99.255.250,255.255.0.0,1h --dhcp-leasefile="$work/dnsmasq.leases" \
  --dhcp-lease-max=70000 --no-ping
measure dnsmasq
stop
read -r bf_rate bf_cpu <"$work/bootfleet.result"
read -r kea_rate kea_cpu <"$work/kea.result"
read -r dm_rate dm_cpu <"$work/dnsmasq.result"
printf 'rate vs Kea: %.2fx (goal >= 1.0); CPU per exchange vs Kea: %.2fx (goal <= 0.5); rate vs dnsmasq: %.1fx\n' \
  "$(echo "$bf_rate / $kea_rate" | bc -l)" "$(echo "$bf_cpu / $kea_cpu" | bc -l)" "$(echo "$bf_rate / $dm_rate" | bc -l)"
