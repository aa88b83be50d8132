#!/usr/bin/env bash
# Power-on to initramfs, and to attested, of a QEMU machine (TCG) network-booting the
# demo image from bootfleet, against the same kernel and initrd served by a reference
# chain of dnsmasq (DHCP + TFTP) and nginx (HTTP), in the same run. "initramfs" is the
# moment the serial console prints "starting bootfleet-agent" (network up, DHCP done);
# "attested" is when bootfleet records the attestation (bootfleet chain only).
# Usage: sudo bench/boot.sh [RUNS=3]. FIRMWARES="uefi" runs one firmware only; STEPS=1 prints,
# per run, when each boot step reached the serial console (seconds from power-on). Needs what deploy/lab/run.sh needs, plus dnsmasq-base
# and nginx-light.
source "$(dirname "$0")/lib.sh"
source deploy/lab/vm.sh
runs=${1:-3}
[ "$(id -u)" = 0 ] || { echo "run as root (namespaces, tap devices)" >&2; exit 1; }
for tool in qemu-system-x86_64 dnsmasq nginx; do
  command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install qemu-system-x86 dnsmasq-base nginx-light" >&2; exit 1; }
done
build_release
work=$(mktemp -d /var/tmp/bootfleet-bootbench.XXXXXX)
NS=bf-bootbench
cleanup() {
  ip netns pids "$NS" 2>/dev/null | xargs -r kill 2>/dev/null || true
  sleep 1
  ip netns del "$NS" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
images/demo/build.sh "$work/demo" 1 target/release/bootfleet-agent >/dev/null
ip netns del "$NS" 2>/dev/null || true
ip netns add "$NS"
ip -n "$NS" link set lo up
ip -n "$NS" link add br0 type bridge
ip -n "$NS" addr add 10.97.0.1/24 dev br0
ip -n "$NS" link set br0 up
ip -n "$NS" tuntap add dev tap0 mode tap
ip -n "$NS" link set tap0 master br0 up
mac=52:54:00:97:00:01

# power_on FIRMWARE LOG: starts the VM in the background; sets VM_PID.
power_on() {
  vm_command "$1" "$2" "$work" "$mac"
  ip netns exec "$NS" "${VM_COMMAND[@]}" >/dev/null 2>&1 &
  VM_PID=$!
}

# until_marker LOG START: seconds from START until the serial log shows the marker. Also
# writes LOG.sizes: "seconds size" whenever the log grew, for steps().
until_marker() {
  local last=-1 size
  for _ in $(seq 3600); do
    size=$(stat -c %s "$1" 2>/dev/null || echo 0)
    [ "$size" != "$last" ] && { echo "$(echo "$(date +%s.%N) - $2" | bc -l) $size" >>"$1.sizes"; last=$size; }
    grep -q "starting bootfleet-agent" "$1" 2>/dev/null && { echo "$(date +%s.%N) - $2" | bc -l; return; }
    sleep 0.05
  done
  echo 999
}

# steps LOG: when (seconds from power-on, to 0.05 s) each boot step's line reached the log.
steps() {
  [ "${STEPS:-0}" = 1 ] || return 0
  local pattern line offset
  for pattern in "Start PXE" "NBP filename" "iPXE initialising" "Configuring" "boot.ipxe" \
      "node.ipxe" "vmlinuz\|blobs/sha256" "Command line" "udhcpc: started" "starting bootfleet-agent"; do
    line=$(tr -d '\033' <"$1" | grep -a -b -m1 "$pattern") || continue
    offset=${line%%:*}
    awk -v o="$offset" -v p="$pattern" '$2 > o { printf "  %6.2f s  %s\n", $1, p; exit }' "$1.sizes"
  done
}

# bootfleet chain
cat >"$work/bootfleet.toml" <<TOML
listen = "10.97.0.1:8080"
[tftp]
listen = "10.97.0.1:69"
ipxe_dir = "/usr/lib/ipxe"
[dhcp]
mode = "authoritative"
interface = "br0"
server_ip = "10.97.0.1"
[dhcp.pool]
start = "10.97.0.100"
end = "10.97.0.200"
TOML
ip netns exec "$NS" "$BIN" --data-dir "$work/data" serve --config "$work/bootfleet.toml" >"$work/server.log" 2>&1 &
BF_PID=$!
sleep 1
bf() { ip netns exec "$NS" "$BIN" --server http://10.97.0.1:8080 --data-dir "$work/data" "$@"; }
bf image publish "$work/demo" --tag demo:stable >/dev/null
bf node assign "$mac" demo:stable >/dev/null
declare -A result
firmwares=${FIRMWARES:-bios uefi}
for fw in $firmwares; do
  init=() attested=()
  for i in $(seq "$runs"); do
    log="$work/bf-$fw-$i.log"
    start=$(date +%s.%N)
    power_on "$fw" "$log"
    init+=("$(until_marker "$log" "$start")")
    [ "${STEPS:-0}" = 1 ] && { echo "bootfleet $fw run $i:"; steps "$log"; }
    # attested: the newest boot's attestation time, relative to power-on.
    for _ in $(seq 300); do
      at=$(bf node show "$mac" --output json | tr -d ' \n' | sed 's/},{"id":.*//' | grep -o '"step":"attested","at":"[^"]*"' | head -1 | sed 's/.*"at":"\([^"]*\)"/\1/' || true)
      [ -n "$at" ] && break; sleep 0.1
    done
    attested+=("$(echo "$(date -d "$at" +%s.%N) - $start" | bc -l)")
    kill "$VM_PID" 2>/dev/null; wait "$VM_PID" 2>/dev/null || true
  done
  result[bf-$fw-init]=$(printf '%s\n' "${init[@]}" | median)
  result[bf-$fw-attested]=$(printf '%s\n' "${attested[@]}" | median)
done
kill "$BF_PID"; wait "$BF_PID" 2>/dev/null || true

# reference chain: dnsmasq (DHCP + TFTP) and nginx, the same kernel, initrd and command line
mkdir -p "$work/www"
cp "$work/demo/vmlinuz" "$work/demo/initrd.img" "$work/www/"
cmdline=$(sed -n 's/^cmdline = "\(.*\)"/\1/p' "$work/demo/manifest.toml")
cat >"$work/www/boot.ipxe" <<IPXE
#!ipxe
kernel http://10.97.0.1:8081/vmlinuz initrd=initrd.img $cmdline bootfleet.server=http://10.97.0.1:8081 bootfleet.boot=0000000000000000 bootfleet.token=x
initrd http://10.97.0.1:8081/initrd.img
boot
IPXE
cat >"$work/nginx.conf" <<NGINX
user root;
worker_processes 1;
daemon off;
pid $work/nginx.pid;
error_log $work/nginx.err;
events { worker_connections 256; }
http { access_log off; sendfile on; server { listen 10.97.0.1:8081; root $work/www; } }
NGINX
ip netns exec "$NS" nginx -c "$work/nginx.conf" &
ip netns exec "$NS" dnsmasq --keep-in-foreground --port=0 --interface=br0 --bind-interfaces \
  --dhcp-range=10.97.0.100,10.97.0.200,1h --dhcp-leasefile="$work/dnsmasq.leases" --no-ping \
  --enable-tftp --tftp-root=/usr/lib/ipxe --dhcp-userclass=set:ipxe,iPXE \
  --dhcp-match=set:efi,option:client-arch,7 --dhcp-match=set:efi,option:client-arch,9 \
  "--dhcp-boot=tag:ipxe,http://10.97.0.1:8081/boot.ipxe" "--dhcp-boot=tag:!ipxe,tag:efi,snponly.efi" \
  "--dhcp-boot=tag:!ipxe,tag:!efi,undionly.kpxe" 2>"$work/dnsmasq.log" &
sleep 1
for fw in $firmwares; do
  init=()
  for i in $(seq "$runs"); do
    log="$work/ref-$fw-$i.log"
    start=$(date +%s.%N)
    power_on "$fw" "$log"
    init+=("$(until_marker "$log" "$start")")
    [ "${STEPS:-0}" = 1 ] && { echo "dnsmasq+nginx $fw run $i:"; steps "$log"; }
    kill "$VM_PID" 2>/dev/null; wait "$VM_PID" 2>/dev/null || true
  done
  result[ref-$fw-init]=$(printf '%s\n' "${init[@]}" | median)
done

machine
echo "QEMU TCG, 512 MiB, virtio-net; demo image $(du -h "$work/demo/vmlinuz" | cut -f1) kernel + $(du -h "$work/demo/initrd.img" | cut -f1) initrd; median of $runs"
for fw in $firmwares; do
  printf '%-4s power-on to initramfs: bootfleet %.1f s, dnsmasq+nginx %.1f s, ratio %.2f (goal <= 1.0); bootfleet to attested %.1f s\n' \
    "$fw" "${result[bf-$fw-init]}" "${result[ref-$fw-init]}" \
    "$(echo "${result[bf-$fw-init]} / ${result[ref-$fw-init]}" | bc -l)" "${result[bf-$fw-attested]}"
done
