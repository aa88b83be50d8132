#!/usr/bin/env bash
# Builds a real Debian bookworm root for a two-stage boot and packs it as an OCI image
# layout: systemd as /sbin/init, udev, kmod, iproute2, systemd-networkd (DHCP on every
# ethernet link, keeping the address stage 1 configured) with systemd-resolved, the pinned
# cloud kernel in /boot with its modules in /lib/modules (no initramfs: stage 1 is
# bootfleet's), and bootfleet-agent with its unit, enabled. No docs, man pages or locales,
# no recommends, no apt; /etc/machine-id is empty (each boot gets its own).
# `bootfleet image import` packs it into a squashfs with dm-verity and boots it.
#
# Usage: images/debian/build.sh OUT_DIR [AGENT=target/release/bootfleet-agent]
#        images/debian/build.sh --relock [OUT_DIR [AGENT]]
# Writes OUT_DIR/{oci-layout,index.json,blobs/sha256/*}, one image named "bookworm"
# (index.json is rewritten); check it with `skopeo inspect oci:OUT_DIR:bookworm`.
#
# Pinned: images/debian/packages.lock (name=version, sorted) is exactly what gets
# installed: every version is pinned for apt, and the build fails when the installed set
# differs from it. The Debian mirror keeps only current versions: when one has moved on
# the build names the package; `--relock` resolves the current versions of the package
# list below, rewrites the lock (commit it), then builds if OUT_DIR is given. Relock
# after changing the package list or the kernel pin too.
# Reproducible: the same script, lock, agent binary and unit give the same bytes, hence
# the same manifest digest (SOURCE_DATE_EPOCH below, sorted tar with clamped mtimes and no
# atime/ctime, gzip -n, JSON written by hand).
# Cached: the result lies in ${BOOTFLEET_IMAGE_CACHE:-/var/cache/bootfleet-images}/
# debian-<hash of the inputs>/ and is copied to OUT_DIR; the Debian root before the agent
# is added lies in debian-root-<hash of script and lock>/, so a new agent binary only
# repacks (delete either to rebuild). Concurrent builds wait on one lock.
# Needs: root, mmdebstrap, GNU tar, gzip, sha256sum, flock; network to the Debian mirror.
set -euo pipefail
umask 022

relock=0
if [ "${1:-}" = --relock ]; then
  relock=1
  shift
  out=${1:-}
else
  out=${1:?usage: build.sh OUT_DIR [AGENT] | build.sh --relock [OUT_DIR [AGENT]]}
fi
agent=${2:-target/release/bootfleet-agent}

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
script="$here/$(basename "${BASH_SOURCE[0]}")"
lock="$here/packages.lock"
unit="$(cd "$here/../.." && pwd)/deploy/systemd/bootfleet-agent.service"
cache=${BOOTFLEET_IMAGE_CACHE:-/var/cache/bootfleet-images}

# The kernel pin, the same as images/demo/build.sh: update both together, then --relock.
KERNEL_PKG=linux-image-6.1.0-57-cloud-amd64
KERNEL_PKG_VERSION=6.1.192-3
KERNEL_RELEASE=6.1.0-57-cloud-amd64
# What the root is made of (with their dependencies, and Debian's essential set).
PACKAGES="systemd systemd-sysv systemd-resolved dbus udev kmod iproute2 $KERNEL_PKG=$KERNEL_PKG_VERSION"
SUITE=bookworm
MIRRORS=("deb http://deb.debian.org/debian bookworm main"
  "deb http://deb.debian.org/debian bookworm-updates main"
  "deb http://deb.debian.org/debian-security bookworm-security main")
REF_NAME=bookworm
# Every time in the image is at most this (2026-12-01); must lie in the past.
export SOURCE_DATE_EPOCH=1796083200

die() { echo "build.sh: $*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || die "run as root (mmdebstrap --mode=root)"
for tool in mmdebstrap tar gzip sha256sum flock strip; do
  command -v "$tool" >/dev/null || die "missing $tool: apt-get install mmdebstrap tar gzip coreutils util-linux binutils"
done
[ -f "$unit" ] || die "missing $unit"
grep -qx 'WantedBy=multi-user.target' "$unit" || die "$unit: expected WantedBy=multi-user.target (enabled by hand below)"
if [ -n "$out" ]; then
  [ -f "$agent" ] || die "missing agent binary $agent: cargo build --release --bin bootfleet-agent"
fi

mkdir -p "$cache"
exec 9>"$cache/.debian.lock"
flock 9 # one build at a time; a waiting build then finds the cached result
work=$(mktemp -d "$cache/.debian-work.XXXXXX")
# --one-file-system: never into a /dev or /proc that a failed mmdebstrap left mounted.
trap 'rm -rf --one-file-system "$work"' EXIT
export BOOTFLEET_WORK="$work"

# Hooks run by mmdebstrap, with the root directory as $1 (see its man page).
mkdir "$work/hooks"
# No initramfs in the image: divert update-initramfs while the kernel installs (it would
# take a minute and 30 MB for nothing), and put it back afterwards.
cat >"$work/hooks/no-initramfs" <<'HOOK'
#!/bin/sh
set -eu
chroot "$1" dpkg-divert --quiet --local --rename --divert /usr/sbin/update-initramfs.bootfleet --add /usr/sbin/update-initramfs
printf '#!/bin/sh\n# bootfleet image build: no initramfs\nexit 0\n' >"$1/usr/sbin/update-initramfs"
chmod 0755 "$1/usr/sbin/update-initramfs"
HOOK
# Every pinned version must still be on the mirror (apt would pick another silently for
# the essential set): name the missing ones. Runs once the package lists are in.
cat >"$work/hooks/check-lock" <<'HOOK'
#!/bin/sh
set -eu
cd "$BOOTFLEET_WORK"
cut -d= -f1 lock | APT_CONFIG=$MMDEBSTRAP_APT_CONFIG xargs apt-cache madison 2>/dev/null |
  awk -F'|' '{ gsub(/ /, "", $1); gsub(/ /, "", $2); print $1 "=" $2 }' | LC_ALL=C sort -u >available
LC_ALL=C comm -23 lock available >missing
if [ -s missing ]; then
  {
    echo "packages.lock pins versions the Debian mirror no longer has:"
    sed 's/^/  /' missing
    echo "relock (and commit images/debian/packages.lock): images/debian/build.sh --relock [OUT_DIR]"
  } | tee error >&2
  exit 1
fi
HOOK
# The installed set; then, unless relocking, the set must be the lock, and the root is
# configured.
cat >"$work/hooks/customize" <<'HOOK'
#!/bin/sh
set -eu
root=$1
chroot "$root" dpkg-query -W -f '${db:Status-Status} ${Package}=${Version}\n' |
  awk '$1 == "installed" { print $2 }' | LC_ALL=C sort >"$BOOTFLEET_WORK/installed"
[ "$BOOTFLEET_RELOCK" = 1 ] && exit 0
if ! cmp -s "$BOOTFLEET_WORK/lock" "$BOOTFLEET_WORK/installed"; then
  {
    echo "the installed packages differ from packages.lock (- locked, + installed):"
    diff -U0 "$BOOTFLEET_WORK/lock" "$BOOTFLEET_WORK/installed" | grep '^[-+][^-+]' || true
    echo "the package list in build.sh changed? relock: images/debian/build.sh --relock [OUT_DIR]"
  } | tee "$BOOTFLEET_WORK/error" >&2
  exit 1
fi
rm "$root/etc/apt/preferences.d/bootfleet-lock"

rm "$root/usr/sbin/update-initramfs"
chroot "$root" dpkg-divert --quiet --local --rename --remove /usr/sbin/update-initramfs
rm -f "$root/initrd.img" "$root/initrd.img.old" # would dangle: no initramfs

# Network after switch_root: stage 1 leaves the boot NIC down and without an address
# (so udev can give it its predictable name), and systemd-networkd does DHCP on every
# ethernet link, with the MAC as client identifier: the same lease stage 1 had. Waiting
# for it is bounded so that a node with a dead extra port still boots.
cat >"$root/etc/systemd/network/90-bootfleet-ethernet.network" <<'EOF'
# images/debian/build.sh: DHCP on every ethernet link (the shipped 80-container-*.network
# match first).
[Match]
Type=ether

[Network]
DHCP=yes

[DHCPv4]
ClientIdentifier=mac
EOF
mkdir -p "$root/etc/systemd/system/systemd-networkd-wait-online.service.d"
cat >"$root/etc/systemd/system/systemd-networkd-wait-online.service.d/bootfleet.conf" <<'EOF'
# images/debian/build.sh: network-online once any link is up, and never wait past 60 s.
[Service]
ExecStart=
ExecStart=/lib/systemd/systemd-networkd-wait-online --any --timeout=60
EOF
chroot "$root" systemctl --quiet enable systemd-networkd.service systemd-resolved.service

# Identity: one image serves the whole fleet. An empty machine-id makes systemd generate
# one per boot; "localhost" counts as no static hostname, so a DHCP-given name applies.
: >"$root/etc/machine-id"
echo localhost >"$root/etc/hostname"
printf '127.0.0.1\tlocalhost\n::1\t\tlocalhost ip6-localhost ip6-loopback\nff02::1\t\tip6-allnodes\nff02::2\t\tip6-allrouters\n' >"$root/etc/hosts"
echo "# / is the bootfleet image (squashfs through dm-verity, a tmpfs overlay on top), mounted by stage 1" >"$root/etc/fstab"
find "$root/var/log" -type f -delete
HOOK
chmod 0755 "$work/hooks/"*

# mmdebstrap ROOT_DIR [--setup-hook etc.]: the essential set, then $PACKAGES, into ROOT_DIR.
# Merged /usr the debootstrap way (symlinks and the usr-is-merged package), not through
# the usrmerge package, which drags perl in (50 MB).
mmdebstrap_root() {
  local root=$1
  shift
  mmdebstrap --variant=essential --mode=root --format=directory \
    --logfile="$work/mmdebstrap.log" \
    --include="$PACKAGES" \
    --dpkgopt='path-exclude=/usr/share/man/*' \
    --dpkgopt='path-exclude=/usr/share/info/*' \
    --dpkgopt='path-exclude=/usr/share/lintian/*' \
    --dpkgopt='path-exclude=/usr/share/locale/*' \
    --dpkgopt='path-include=/usr/share/locale/locale.alias' \
    --dpkgopt='path-exclude=/usr/share/doc/*' \
    --dpkgopt='path-include=/usr/share/doc/*/copyright' \
    --hook-dir=/usr/share/mmdebstrap/hooks/merged-usr \
    --essential-hook="$work/hooks/no-initramfs" \
    "$@" \
    --customize-hook="$work/hooks/customize" \
    "$SUITE" "$root" "${MIRRORS[@]}" || {
    cp "$work/mmdebstrap.log" "$cache/debian-last.log"
    rm -rf --one-file-system "$root"
    if [ -s "$work/error" ]; then cat "$work/error" >&2; else tail -n 30 "$work/mmdebstrap.log" >&2; fi
    die "mmdebstrap failed (log: $cache/debian-last.log)"
  }
  cp "$work/mmdebstrap.log" "$cache/debian-last.log"
}

if [ "$relock" = 1 ]; then
  echo "resolving the current versions of: $PACKAGES"
  export BOOTFLEET_RELOCK=1
  mmdebstrap_root "$work/relock-root"
  touch "$lock"
  if cmp -s "$lock" "$work/installed"; then
    echo "packages.lock: $(wc -l <"$lock") packages, unchanged"
  else
    diff -U0 "$lock" "$work/installed" | grep '^[-+][^-+]' || true
    cp "$work/installed" "$lock"
    echo "packages.lock: $(wc -l <"$lock") packages, rewritten (commit it)"
  fi
  rm -rf --one-file-system "$work/relock-root"
  [ -n "$out" ] || exit 0
fi

[ -s "$lock" ] || die "no $lock: images/debian/build.sh --relock"
grep -qx "$KERNEL_PKG=$KERNEL_PKG_VERSION" "$lock" ||
  die "packages.lock does not pin $KERNEL_PKG=$KERNEL_PKG_VERSION (the pin above changed?): --relock"
LC_ALL=C sort -c "$lock" 2>/dev/null || die "packages.lock is not sorted (LC_ALL=C sort)"
cp "$lock" "$work/lock"

sha() { sha256sum "$1" | cut -d' ' -f1; }
base_key=$(printf '%s\n' "$(sha "$script")" "$(sha "$lock")" | sha256sum | cut -c1-16)
key=$(printf '%s\n' "$(sha "$script")" "$(sha "$lock")" "$(sha "$agent")" "$(sha "$unit")" | sha256sum | cut -c1-16)
entry="$cache/debian-$key"
base="$cache/debian-root-$base_key"

if [ -f "$entry/index.json" ]; then
  echo "cached: $entry"
  touch "$entry" # most recently used: kept by the pruning below
else
  # Leftovers of an interrupted build (this one holds the lock).
  rm -rf --one-file-system "$entry" "$cache"/debian-root-*.partial
  if [ ! -d "$base" ]; then
    echo "building the Debian root with mmdebstrap (log: $cache/debian-last.log)"
    # apt takes the locked version of every package, the essential set included.
    sed 's/^\([^=]*\)=\(.*\)$/Package: \1\nPin: version \2\nPin-Priority: 1001\n/' "$lock" >"$work/preferences"
    export BOOTFLEET_RELOCK=0
    mmdebstrap_root "$base.partial" \
      --setup-hook='cp "$BOOTFLEET_WORK/preferences" "$1/etc/apt/preferences.d/bootfleet-lock"' \
      --extract-hook="$work/hooks/check-lock"
    ! mountpoint -q "$base.partial/dev" || die "$base.partial/dev is still mounted"
    find "$base.partial/dev" -mindepth 1 -delete # devtmpfs is mounted there at boot
    rm -r "$base.partial/var/lib/apt" "$base.partial/var/cache/apt" # apt's state; no apt here
    [ -f "$base.partial/boot/vmlinuz-$KERNEL_RELEASE" ] && [ -d "$base.partial/lib/modules/$KERNEL_RELEASE" ] ||
      die "no /boot/vmlinuz-$KERNEL_RELEASE or /lib/modules/$KERNEL_RELEASE in the root"
    mv "$base.partial" "$base"
  fi

  # The agent and its unit, enabled (what `systemctl enable` makes of WantedBy=).
  root="$work/root"
  cp -a "$base" "$root"
  # Stripped, as images/demo does: a debug build of the agent is 100 MB.
  strip --strip-all -o "$root/usr/local/bin/bootfleet-agent" "$agent" && chmod 0755 "$root/usr/local/bin/bootfleet-agent"
  install -m 0644 "$unit" "$root/etc/systemd/system/bootfleet-agent.service"
  mkdir -p "$root/etc/systemd/system/multi-user.target.wants"
  ln -s /etc/systemd/system/bootfleet-agent.service "$root/etc/systemd/system/multi-user.target.wants/"
  chroot "$root" /usr/local/bin/bootfleet-agent --version >/dev/null ||
    die "$agent does not run in the image (linked against a newer glibc than bookworm's 2.36?)"

  # One layer: a reproducible tar (sorted, numeric owners, mtimes clamped, PAX without
  # atime/ctime and without the PID in header names). xattrs in the namespaces squashfs
  # keeps (file capabilities are security.capability); not POSIX ACLs (system.posix_acl_*,
  # which systemd puts on /var/log/journal and sets again at boot): the import refuses them.
  tar --create --file="$work/layer.tar" --directory="$root" --one-file-system \
    --format=pax --pax-option='exthdr.name=%d/PaxHeaders/%f,delete=atime,delete=ctime' \
    --sort=name --numeric-owner --mtime="@$SOURCE_DATE_EPOCH" --clamp-mtime \
    --xattrs --xattrs-include='security.*' --xattrs-include='user.*' --xattrs-include='trusted.*' .
  rm -rf --one-file-system "$root"
  layout="$work/layout"
  mkdir -p "$layout/blobs/sha256"
  blob() { # FILE: moves it into the layout; prints its digest and size
    local d s
    d=$(sha "$1")
    s=$(stat -c %s "$1")
    mv "$1" "$layout/blobs/sha256/$d"
    echo "$d $s"
  }
  diff_id=$(sha "$work/layer.tar")
  tar_size=$(stat -c %s "$work/layer.tar")
  gzip -n <"$work/layer.tar" >"$work/layer.tar.gz"
  rm "$work/layer.tar"
  read -r layer_digest layer_size < <(blob "$work/layer.tar.gz")
  created=$(date -u -d "@$SOURCE_DATE_EPOCH" +%Y-%m-%dT%H:%M:%SZ)
  printf '{"architecture":"amd64","os":"linux","created":"%s","config":{"Env":["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],"Cmd":["/sbin/init"]},"rootfs":{"type":"layers","diff_ids":["sha256:%s"]},"history":[{"created":"%s","created_by":"images/debian/build.sh"}]}' \
    "$created" "$diff_id" "$created" >"$work/config.json"
  read -r config_digest config_size < <(blob "$work/config.json")
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.manifest.v1+json","config":{"mediaType":"application/vnd.oci.image.config.v1+json","digest":"sha256:%s","size":%s},"layers":[{"mediaType":"application/vnd.oci.image.layer.v1.tar+gzip","digest":"sha256:%s","size":%s}]}' \
    "$config_digest" "$config_size" "$layer_digest" "$layer_size" >"$work/manifest.json"
  read -r manifest_digest manifest_size < <(blob "$work/manifest.json")
  printf '{"schemaVersion":2,"mediaType":"application/vnd.oci.image.index.v1+json","manifests":[{"mediaType":"application/vnd.oci.image.manifest.v1+json","digest":"sha256:%s","size":%s,"platform":{"architecture":"amd64","os":"linux"},"annotations":{"org.opencontainers.image.ref.name":"%s"}}]}\n' \
    "$manifest_digest" "$manifest_size" "$REF_NAME" >"$layout/index.json"
  printf '{"imageLayoutVersion":"1.0.0"}\n' >"$layout/oci-layout"
  printf 'manifest=sha256:%s\nlayer_bytes=%s\nroot_tar_bytes=%s\n' "$manifest_digest" "$layer_size" "$tar_size" >"$layout/build-info"
  chmod 0444 "$layout/blobs/sha256/"*
  mv "$layout" "$entry"
fi

# Every new agent binary makes a new entry (a few hundred MiB): without pruning, a machine
# that runs the tests on each change fills its disk. Kept: the two most recently used
# entries and the root this build used; the lock is held, so nobody is copying from them.
prune() { # GLOB KEEP: removes all but the KEEP most recently modified matches
  find "$cache" -mindepth 1 -maxdepth 1 -type d -name "$1" -printf '%T@ %p\n' |
    sort -rn | tail -n +"$(($2 + 1))" | cut -d' ' -f2- |
    while read -r old; do rm -rf --one-file-system "$old"; done
}
touch "$base" 2>/dev/null || true
prune 'debian-root-*' 1
prune 'debian-[0-9a-f]*' 2

# Copies, not hard links: a test that damages a blob in OUT_DIR must not damage the cache.
mkdir -p "$out/blobs/sha256"
cp -f --reflink=auto "$entry/blobs/sha256/"* "$out/blobs/sha256/"
cp "$entry/oci-layout" "$entry/index.json" "$out/"
# shellcheck disable=SC1091
. "$entry/build-info"
mib() { echo "$(($1 / 1048576)) MiB"; }
echo "built debian:$REF_NAME in $out: layer $(mib "$layer_bytes") gzip ($(mib "$root_tar_bytes") as tar), manifest $manifest, ${SECONDS}s"
