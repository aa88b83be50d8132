#!/usr/bin/env bash
# TFTP: bootfleet against tftpd-hpa and dnsmasq, same run, same client (`bootfleet-bench
# tftp`), in a network namespace of its own (dnsmasq only listens on port 69), server
# pinned to core 0 and clients to core 1. Scenarios:
#   A. 200 concurrent clients x 1 MiB, blksize 1468 (and again asking windowsize 16)
#   B. one 64 MiB fetch asking blksize 1468 and windowsize 16
#   C. 200 x 1 MiB under 5% random UDP loss (nftables numgen in the namespace)
# Usage (root): bench/tftp.sh. Needs: tftpd-hpa dnsmasq-base nftables iproute2.
source "$(dirname "$0")/lib.sh"
[ "$(id -u)" = 0 ] || { echo "run as root (network namespace)" >&2; exit 1; }
for tool in in.tftpd dnsmasq nft ip; do
  command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install tftpd-hpa dnsmasq-base nftables iproute2" >&2; exit 1; }
done
build_release
ns=bf-tftp-bench-$$
work=$(mktemp -d /var/tmp/bootfleet-bench.XXXXXX)
cleanup() { ip netns pids "$ns" 2>/dev/null | xargs -r kill 2>/dev/null; sleep 0.3; ip netns del "$ns" 2>/dev/null; rm -rf "$work"; }
trap cleanup EXIT
ip netns add "$ns"
ip -n "$ns" link set lo up
inns() { ip netns exec "$ns" "$@"; }
mkdir "$work/root"
head -c 1M /dev/urandom >"$work/root/1m.bin"
head -c 64M /dev/urandom >"$work/root/64m.bin"
d1=sha256:$(sha256sum "$work/root/1m.bin" | cut -c1-64)
d64=sha256:$(sha256sum "$work/root/64m.bin" | cut -c1-64)

inns taskset -c 0 "$BIN" --data-dir "$work/data" serve --listen 127.0.0.1:8080 \
  --tftp-listen 127.0.0.1:7000 --ipxe-dir "$work/root" 2>"$work/bootfleet.log" &
# in.tftpd cannot resolve 127.0.0.1 in a namespace with only loopback (glibc
# AI_ADDRCONFIG); the wildcard address is the same thing here.
inns taskset -c 0 in.tftpd --foreground --listen --address :6969 --secure --user root "$work/root" &
inns taskset -c 0 dnsmasq --keep-in-foreground --port=0 --enable-tftp --tftp-root="$work/root" \
  --listen-address=127.0.0.1 --bind-interfaces --tftp-max=1000 --user=root \
  --pid-file="$work/dnsmasq.pid" --log-facility="$work/dnsmasq.log" &
sleep 1.5
servers=("bootfleet 127.0.0.1:7000" "tftpd-hpa 127.0.0.1:6969" "dnsmasq 127.0.0.1:69")
declare -A pids=(
  [bootfleet]=$(pgrep -f "tftp-listen 127.0.0.1:7000" | head -1)
  [tftpd-hpa]=$(pgrep -f "in.tftpd --foreground" | head -1)
  [dnsmasq]=$(pgrep -f "dnsmasq --keep-in-foreground" | head -1)
)
# CPU seconds of a server, its reaped children included (tftpd-hpa forks per transfer).
cpu_s() { awk '{printf "%.2f", ($14+$15+$16+$17)/100}' "/proc/$1/stat"; }

bench() { # NAME ADDR ARGS... -> one summary line
  local name=$1 addr=$2; shift 2
  local out before after
  before=$(cpu_s "${pids[$name]}")
  out=$(inns taskset -c 1 "$BENCH" tftp --target "$addr" "$@" 2>&1 || true)
  after=$(cpu_s "${pids[$name]}")
  printf '  %-10s %s; server CPU %.2f s\n' "$name" "${out%%$'\n'*}" "$(echo "$after - $before" | bc -l)"
}

machine
echo "A. 200 concurrent clients x 1 MiB, blksize 1468"
for s in "${servers[@]}"; do bench $s --file 1m.bin --clients 200 --blksize 1468 --expect "$d1"; done
echo "A'. same, clients also asking windowsize 16 (only bootfleet implements RFC 7440)"
for s in "${servers[@]}"; do bench $s --file 1m.bin --clients 200 --blksize 1468 --windowsize 16 --expect "$d1"; done
echo "B. one 64 MiB fetch, blksize 1468, windowsize 16"
for s in "${servers[@]}"; do bench $s --file 64m.bin --clients 1 --blksize 1468 --windowsize 16 --expect "$d64"; done
inns nft -f - <<NFT
table inet loss {
  chain input {
    type filter hook input priority 0;
    meta l4proto udp numgen random mod 20 == 0 counter drop
  }
}
NFT
echo "C. 200 x 1 MiB under 5% random UDP loss, blksize 1468 windowsize 16, client timeout 1 s"
for s in "${servers[@]}"; do bench $s --file 1m.bin --clients 200 --blksize 1468 --windowsize 16 --expect "$d1"; done
echo "   datagrams dropped by the loss rule: $(inns nft list table inet loss | grep -o 'packets [0-9]*' | cut -d' ' -f2)"
pid=$(pgrep -f "tftp-listen 127.0.0.1:7000" | head -1)
echo "bootfleet peak RSS: $(awk '/VmHWM/ {printf "%.1f MiB", $2/1024}' /proc/$pid/status)"
