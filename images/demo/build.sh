#!/usr/bin/env bash
# Builds the demo image bundle: a pinned Debian cloud kernel, and an initramfs with
# busybox-static, the virtio network modules, bootfleet-agent (and the shared libraries
# it links) and an /init that brings the network up with DHCP and runs the agent.
# Reproducible: the same inputs give the same bytes, hence the same image digest
# (fixed mtimes, sorted cpio, gzip -n; the bundle's tar order does not enter the digest).
#
# Usage: images/demo/build.sh OUT_DIR [VERSION=1] [AGENT=target/release/bootfleet-agent]
# With LATE_MODULE=<name> (a module of the kernel, e.g. dummy), /init loads it 20 s after
# the agent starts: a node that drifts from what it attested, for the drift test.
# With TPM=1, the initramfs carries tpm2-tools (the `tpm2` multi-call binary, its
# libraries and the device TCTI): the agent attests with the node's TPM where it has one.
# With HANG_AFTER=<secs>, /init stops the agent (SIGSTOP) that long after it starts: the
# kernel stays up but no heartbeat or reboot comes, a hung node for the BMC test.
# Writes OUT_DIR/{manifest.toml,vmlinuz,initrd.img}; publish with
#   bootfleet image publish OUT_DIR --tag demo:stable
# Needs: apt-get (to download the pinned kernel package), dpkg-deb, busybox-static, cpio,
# gzip, binutils (strip).
set -euo pipefail
out=${1:?usage: build.sh OUT_DIR [VERSION] [AGENT]}
version=${2:-1}
agent=${3:-target/release/bootfleet-agent}

# The pins. Debian keeps a kernel ABI's package while it is current; when the mirror has
# moved on, update both lines together (apt-cache depends linux-image-cloud-amd64).
KERNEL_PKG=linux-image-6.1.0-57-cloud-amd64
KERNEL_PKG_VERSION=6.1.192-3
KERNEL_RELEASE=6.1.0-57-cloud-amd64
BUSYBOX=/bin/busybox
cache=${BOOTFLEET_IMAGE_CACHE:-/var/cache/bootfleet-images}

for tool in apt-get dpkg-deb cpio gzip strip; do
  command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install apt dpkg cpio gzip binutils" >&2; exit 1; }
done
[ -x "$BUSYBOX" ] || { echo "missing $BUSYBOX: apt-get install busybox-static" >&2; exit 1; }
[ -x "$agent" ] || { echo "missing agent binary $agent: cargo build --release --bin bootfleet-agent" >&2; exit 1; }
busybox_version=$(dpkg-query -W -f='${Version}' busybox-static)

deb="$cache/${KERNEL_PKG}_${KERNEL_PKG_VERSION}_amd64.deb"
mkdir -p "$cache"
exec 9>"$cache/.lock"
flock 9 # concurrent builds share one download
if [ ! -f "$deb" ]; then
  mkdir -p "$cache"
  download() { (cd "$cache" && apt-get download -q "$KERNEL_PKG=$KERNEL_PKG_VERSION" 2>&1 | grep -v "^W: Download is performed unsandboxed" >&2; [ -f "$deb" ]); }
  download || { apt-get update -qq && download; } || {
    echo "cannot download $KERNEL_PKG=$KERNEL_PKG_VERSION (apt-get update? a newer kernel ABI?)" >&2
    exit 1
  }
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
dpkg-deb -x "$deb" "$work/kernel"
mods="$work/kernel/lib/modules/$KERNEL_RELEASE/kernel"
root="$work/root"
mkdir -p "$root"/{bin,dev,etc,lib/modules,proc,sys,tmp,run}
cp "$BUSYBOX" "$root/bin/busybox"
# virtio-net as modules, in dependency order (the `depends=` of each .ko; the cloud
# kernel has no e1000).
order=""
for m in drivers/virtio/virtio_ring.ko drivers/virtio/virtio.ko \
  drivers/virtio/virtio_pci_modern_dev.ko drivers/virtio/virtio_pci_legacy_dev.ko \
  drivers/virtio/virtio_pci.ko net/core/failover.ko drivers/net/net_failover.ko \
  drivers/net/virtio_net.ko; do
  cp "$mods/$m" "$root/lib/modules/"
  order="$order $(basename "$m")"
done
# The agent, stripped, with the shared libraries it links (glibc), at the same paths.
strip -o "$root/bin/bootfleet-agent" "$agent"
for lib in $(ldd "$agent" | awk '$3 ~ /^\// {print $3} $1 ~ /^\// {print $1}'); do
  mkdir -p "$root$(dirname "$lib")"
  cp -L "$lib" "$root$lib"
done
if [ -n "${TPM:-}" ]; then
  [ -x /usr/bin/tpm2 ] || { echo "missing /usr/bin/tpm2: apt-get install tpm2-tools" >&2; exit 1; }
  cp /usr/bin/tpm2 "$root/bin/tpm2"
  for t in createek nvread createak startauthsession policysecret activatecredential \
    flushcontext quote pcrread; do
    ln -s tpm2 "$root/bin/tpm2_$t"
  done
  # tctildr opens the device TCTI with dlopen: ldd does not name it.
  tcti=$(readlink -f /usr/lib/x86_64-linux-gnu/libtss2-tcti-device.so.0)
  for lib in $(ldd /usr/bin/tpm2 "$tcti" | awk '$3 ~ /^\// {print $3}') "$tcti"; do
    mkdir -p "$root$(dirname "$lib")"
    cp -L "$lib" "$root$lib"
  done
  ln -sf "$(basename "$tcti")" "$root/usr/lib/x86_64-linux-gnu/libtss2-tcti-device.so.0"
fi
hang=""
if [ -n "${HANG_AFTER:-}" ]; then
  hang="(sleep $HANG_AFTER; kill -STOP \$(pidof bootfleet-agent) && echo 'bootfleet demo: agent stopped (hung node)') &"
fi
late=""
if [ -n "${LATE_MODULE:-}" ]; then
  cp "$(find "$mods" -name "$LATE_MODULE.ko")" "$root/lib/modules/late-$LATE_MODULE.ko"
  late="(sleep 20; insmod /lib/modules/late-$LATE_MODULE.ko && echo loaded $LATE_MODULE) &"
fi
cat >"$root/etc/udhcpc.script" <<'SCRIPT'
#!/bin/busybox sh
case "$1" in
  bound|renew) ip addr flush dev "$interface"; ip addr add "$ip/${mask:-24}" dev "$interface"
               [ -n "$router" ] && ip route add default via "${router%% *}" ;;
  deconfig) ip addr flush dev "$interface" ;;
esac
SCRIPT
cat >"$root/init" <<INIT
#!/bin/busybox sh
/bin/busybox --install -s /bin
mount -t proc proc /proc
mount -t sysfs sys /sys
mount -t devtmpfs dev /dev
echo "bootfleet demo image $version: loading network modules"
for m in$order; do insmod /lib/modules/\$m || echo "insmod \$m failed"; done
ip link set lo up
ip link set eth0 up
udhcpc -i eth0 -s /etc/udhcpc.script -q -t 20 -T 1 || echo "no DHCP lease"
echo "bootfleet demo image $version: starting bootfleet-agent"
$late
$hang
/bin/bootfleet-agent --heartbeat-secs 5
echo "bootfleet-agent exited (\$?); powering off in 5 s"
sleep 5
poweroff -f
INIT
chmod 755 "$root/init" "$root/etc/udhcpc.script"
find "$root" -exec touch -h -d @0 {} +
mkdir -p "$out"
(cd "$root" && find . | LC_ALL=C sort | cpio -o -H newc --reproducible --quiet --owner=0:0) | gzip -9n >"$out/initrd.img"
cp "$work/kernel/boot/vmlinuz-$KERNEL_RELEASE" "$out/vmlinuz"
cat >"$out/manifest.toml" <<TOML
# Built by images/demo/build.sh from Debian packages:
#   $KERNEL_PKG $KERNEL_PKG_VERSION
#   busybox-static $busybox_version
name = "demo"
version = "$version"

[boot]
kernel = "vmlinuz"
initrds = ["initrd.img"]
cmdline = "console=ttyS0 panic=10 demo.version=$version"

[pins]
kernel = "$KERNEL_RELEASE"

[validation]
gpus = 0
TOML
echo "built demo:$version in $out ($(du -sh "$out/initrd.img" | cut -f1) initrd)"
