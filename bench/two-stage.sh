#!/usr/bin/env bash
# Power-on to ready of a QEMU machine (TCG, 3 GiB; FIRMWARE=bios: QEMU's iPXE ROM with
# its own virtio driver, the fastest path there is; FIRMWARE=uefi: OVMF's PXE, then
# iPXE's snponly.efi moving every byte through the firmware's network driver, as on real
# UEFI machines; FIRMWARE=undi: the BIOS ROM's iPXE chainloads undionly.kpxe, which
# moves every byte through the NIC's PXE ROM (UNDI), as on real BIOS machines) booting a
# >= 512 MiB root: two-stage (iPXE loads the kernel and stage 1; stage 1 fetches the root
# by digest in 4 ranges, checks it, mounts it through dm-verity) against the same root
# loaded by iPXE as one initrd (the single-stage way: the kernel unpacks the whole root
# into RAM and runs its systemd). One server, the same kernel and root, alternating, a
# fresh node per run. "ready" is the server's state (attested and validated by the
# agent, a unit of the image).
# Usage: sudo bench/two-stage.sh [RUNS=2]. Needs what bench/import.sh and bench/boot.sh
# need, and cpio.
source "$(dirname "$0")/lib.sh"
source deploy/lab/vm.sh
runs=${1:-2}
firmware=${FIRMWARE:-bios}
[ "$(id -u)" = 0 ] || { echo "run as root (namespaces, tap devices)" >&2; exit 1; }
build_release
work=$(mktemp -d /var/tmp/bootfleet-twostage.XXXXXX)
NS=bf-twostage
cleanup() {
  ip netns pids "$NS" 2>/dev/null | xargs -r kill 2>/dev/null || true
  sleep 1
  ip netns del "$NS" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT
export VM_MEMORY_MB=3072

# The root: the pinned Debian image and a layer of real libraries (~570 MiB in all).
debian_plus_layer "$work/layout" "$work" usr/lib/llvm-14
# The single-stage image of the same content: its kernel, and the root as one initrd.
umoci raw unpack --image "$work/layout:bench" "$work/root" 2>/dev/null
release=$(ls "$work/root/usr/lib/modules")
root_mib=$(du -sm "$work/root" | cut -f1)
mkdir -p "$work/single"
cp "$work/root/boot/vmlinuz-$release" "$work/single/vmlinuz"
ln -s /sbin/init "$work/root/init" # the kernel runs /init of an initramfs
(cd "$work/root" && find . | LC_ALL=C sort | cpio -o -H newc --quiet) | gzip -1 >"$work/single/root.img"
rm -rf "$work/root"
cat >"$work/single/manifest.toml" <<TOML
name = "single"
version = "1"
[boot]
kernel = "vmlinuz"
initrds = ["root.img"]
cmdline = "console=ttyS0,115200n8 panic=10"
[pins]
kernel = "$release"
[validation]
gpus = 0
TOML

ip netns del "$NS" 2>/dev/null || true
ip netns add "$NS"
ip -n "$NS" link set lo up
ip -n "$NS" link add br0 type bridge
ip -n "$NS" addr add 10.98.0.1/24 dev br0
ip -n "$NS" link set br0 up
ip -n "$NS" tuntap add dev tap0 mode tap
ip -n "$NS" link set tap0 master br0 up
cat >"$work/bootfleet.toml" <<TOML
listen = "10.98.0.1:8080"
[tftp]
listen = "10.98.0.1:69"
ipxe_dir = "/usr/lib/ipxe"
[images]
agent = "$PWD/target/release/bootfleet-agent"
[dhcp]
mode = "authoritative"
interface = "br0"
server_ip = "10.98.0.1"
chainload = "$([ "$firmware" = undi ] && echo always || echo non-ipxe)"
[dhcp.pool]
start = "10.98.0.100"
end = "10.98.0.200"
TOML
ip netns exec "$NS" "$BIN" --data-dir "$work/data" serve --config "$work/bootfleet.toml" >"$work/server.log" 2>&1 &
sleep 1
bf() { ip netns exec "$NS" "$BIN" --server http://10.98.0.1:8080 --data-dir "$work/data" "$@"; }
bf image import "oci:$work/layout:bench" --name two-stage --version 1 --cmdline "console=ttyS0,115200n8 panic=10" >/dev/null
bf image publish "$work/single" >/dev/null
two_bytes=$(bf image show two-stage:1 --output json | python3 -c 'import json,sys; print(sum(a["size"] for a in json.load(sys.stdin)["artifacts"]))')
one_bytes=$(bf image show single:1 --output json | python3 -c 'import json,sys; print(sum(a["size"] for a in json.load(sys.stdin)["artifacts"]))')

# boot IMAGE MAC LOG: power-on to ready, seconds (999 past 600 s).
boot() {
  bf node assign "$2" "$1:1" >/dev/null
  vm_command "$([ "$firmware" = uefi ] && echo uefi || echo bios)" "$3" "$work" "$2"
  local start
  start=$(date +%s.%N)
  ip netns exec "$NS" "${VM_COMMAND[@]}" >/dev/null 2>&1 &
  local vm=$! t=999
  for _ in $(seq 6000); do
    if bf node show "$2" --output json | grep -q '"state": *"ready"'; then
      t=$(echo "$(date +%s.%N) - $start" | bc -l)
      break
    fi
    sleep 0.1
  done
  kill "$vm" 2>/dev/null; wait "$vm" 2>/dev/null || true
  echo "$t"
}

two=() one=()
for i in $(seq "$runs"); do
  two+=("$(boot two-stage "52:54:00:98:01:0$i" "$work/two-$i.log")")
  one+=("$(boot single "52:54:00:98:02:0$i" "$work/one-$i.log")")
done
two_s=$(printf '%s\n' "${two[@]}" | median)
one_s=$(printf '%s\n' "${one[@]}" | median)
machine
echo "QEMU TCG, $firmware, virtio-net, 3 GiB; root ${root_mib} MiB unpacked; median of $runs; runs: two-stage ${two[*]} / single ${one[*]}"
printf 'two-stage (kernel + stage 1 by iPXE, %s bytes of artifacts, root by stage 1): power-on to ready %.1f s\n' "$two_bytes" "$two_s"
printf 'single stage (kernel + the root as one initrd by iPXE, %s bytes): power-on to ready %.1f s\n' "$one_bytes" "$one_s"
printf 'ratio single/two-stage: %.2f (goal >= 3)\n' "$(echo "$one_s / $two_s" | bc -l)"
