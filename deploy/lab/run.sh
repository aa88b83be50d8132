#!/usr/bin/env bash
# One command from a clone to a network-booted machine (as root, on Debian 12):
# builds bootfleet and the demo image, starts `bootfleet serve` with DHCP and TFTP in a
# network namespace with a bridge and a tap device, powers on one QEMU machine that
# network-boots from it, waits until the node is ready, prints its boot timeline, and
# tears everything down (also on Ctrl-C).
# Usage: sudo deploy/lab/run.sh [bios|uefi]
set -euo pipefail
cd "$(dirname "$0")/../.."
source deploy/lab/vm.sh
firmware=${1:-bios}
[ "$(id -u)" = 0 ] || { echo "run as root: network namespaces and tap devices" >&2; exit 1; }
need=(qemu-system-x86 ipxe-qemu ipxe ovmf busybox-static cpio binutils iproute2 curl)
missing=()
for p in "${need[@]}"; do dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p"); done
if [ ${#missing[@]} -gt 0 ]; then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
echo "== building bootfleet and the demo image"
cargo build --release --quiet
work=$(mktemp -d /var/tmp/bootfleet-lab.XXXXXX)
NS=bootfleet-lab
cleanup() {
  ip netns pids "$NS" 2>/dev/null | xargs -r kill 2>/dev/null || true
  sleep 1
  ip netns del "$NS" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT INT TERM
images/demo/build.sh "$work/demo" 1 target/release/bootfleet-agent
ip netns del "$NS" 2>/dev/null || true
ip netns add "$NS"
ip -n "$NS" link set lo up
ip -n "$NS" link add br0 type bridge
ip -n "$NS" addr add 10.99.99.1/24 dev br0
ip -n "$NS" link set br0 up
ip -n "$NS" tuntap add dev tap0 mode tap
ip -n "$NS" link set tap0 master br0 up
cat >"$work/bootfleet.toml" <<TOML
listen = "10.99.99.1:8080"
[tftp]
listen = "10.99.99.1:69"
ipxe_dir = "/usr/lib/ipxe"
[dhcp]
mode = "authoritative"
interface = "br0"
server_ip = "10.99.99.1"
[dhcp.pool]
start = "10.99.99.100"
end = "10.99.99.200"
TOML
bf() { ip netns exec "$NS" target/release/bootfleet --server http://10.99.99.1:8080 --data-dir "$work/data" "$@"; }
echo "== starting bootfleet serve in namespace $NS (log: $work/server.log)"
ip netns exec "$NS" target/release/bootfleet --data-dir "$work/data" serve --config "$work/bootfleet.toml" >"$work/server.log" 2>&1 &
for _ in $(seq 50); do ip netns exec "$NS" curl -fs http://10.99.99.1:8080/healthz >/dev/null 2>&1 && break; sleep 0.2; done
bf image publish "$work/demo" --tag demo:stable
mac=52:54:00:99:99:01
bf node assign "$mac" demo:stable
echo "== powering on a $firmware machine (serial console: $work/serial.log)"
vm_command "$firmware" "$work/serial.log" "$work" "$mac"
ip netns exec "$NS" "${VM_COMMAND[@]}" >/dev/null 2>&1 &
start=$(date +%s)
state=
while [ "$state" != ready ]; do
  sleep 2
  state=$(bf node show "$mac" --output json | grep -o '"state": *"[a-z-]*"' | head -1 | sed 's/.*"\([a-z-]*\)"$/\1/')
  echo "  $(( $(date +%s) - start )) s: $state"
  [ $(( $(date +%s) - start )) -lt 300 ] || { echo "not ready in 300 s; serial console:"; tail -30 "$work/serial.log"; exit 1; }
done
echo "== the node's boot, as bootfleet saw it"
bf node show "$mac"
