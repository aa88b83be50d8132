#!/usr/bin/env bash
# Import of a ~1.3 GiB OCI image (the pinned Debian root of images/debian plus a layer of
# real shared libraries, as a GPU image's CUDA libraries are) against the peer pipeline
# that produces the same thing by hand: `skopeo copy` of the archive into an OCI layout,
# `umoci raw unpack` of its layers into a directory, `mksquashfs` of that directory with
# the same compressor, `veritysetup format`. Same machine, same run, alternating.
# Usage: sudo bench/import.sh [RUNS=2]. Needs: skopeo umoci squashfs-tools cryptsetup-bin
# mmdebstrap bc curl (as root: umoci and mmdebstrap write owners).
source "$(dirname "$0")/lib.sh"
runs=${1:-2}
build_release
work=$(mktemp -d /var/tmp/bootfleet-bench.XXXXXX)
trap 'stop_server 2>/dev/null; rm -rf "$work"' EXIT

# The image: images/debian/build.sh's layer, then a layer of real libraries.
debian_plus_layer "$work/layout" "$work" usr/lib/x86_64-linux-gnu usr/lib/llvm-14
skopeo --insecure-policy copy --quiet "oci:$work/layout:bench" "oci-archive:$work/image.tar"
rm -rf "$work/layout"
archive_bytes=$(stat -c %s "$work/image.tar")
cat "$work/image.tar" >/dev/null # page cache, for both contenders

peer() {
  rm -rf "$work/peer"
  mkdir -p "$work/peer"
  skopeo --insecure-policy copy --quiet "oci-archive:$work/image.tar" "oci:$work/peer/layout:bench"
  umoci raw unpack --image "$work/peer/layout:bench" "$work/peer/root" 2>/dev/null
  mksquashfs "$work/peer/root" "$work/peer/root.sqfs" -comp zstd -Xcompression-level 6 \
    -noappend -quiet -no-progress >/dev/null
  veritysetup format --no-superblock --salt=- \
    --hash-offset="$(stat -c %s "$work/peer/root.sqfs")" "$work/peer/root.sqfs" "$work/peer/root.sqfs" >/dev/null
}

ours=()
theirs=()
rss=()
for i in $(seq "$runs"); do
  theirs+=("$(seconds peer)")
  peer_bytes=$(stat -c %s "$work/peer/root.sqfs")
  rm -rf "$work/peer"
  rm -rf "$work/data" "$work/data.log"
  start_server "$work/data" 18191
  ours+=("$(seconds "$BIN" --server http://127.0.0.1:18191 --data-dir "$work/data" --output json \
    image import "oci-archive:$work/image.tar" --name bench --version "$i")")
  rss+=("$(awk '/VmHWM/ {print $2}' "/proc/$SERVER_PID/status")")
  info=$("$BIN" --server http://127.0.0.1:18191 --data-dir "$work/data" --output json image show "bench:$i")
  stop_server
done
ours_s=$(printf '%s\n' "${ours[@]}" | median)
theirs_s=$(printf '%s\n' "${theirs[@]}" | median)
rootfs_bytes=$(echo "$info" | python3 -c 'import json,sys; print(next(a["size"] for a in json.load(sys.stdin)["artifacts"] if a["role"]=="rootfs"))')
machine
echo "image: oci-archive of $archive_bytes bytes (2 layers, gzip); runs: $runs (median)"
printf 'peer: skopeo copy + umoci raw unpack + mksquashfs (zstd 6) + veritysetup: %.1f s -> %s bytes\n' "$theirs_s" "$peer_bytes"
printf 'bootfleet image import (upload, spool, both passes, mksquashfs -tar, verity, stage 1, publish): %.1f s -> rootfs %s bytes\n' "$ours_s" "$rootfs_bytes"
printf 'bootfleet server peak RSS: %s MiB (median of runs: %s KiB)\n' "$(( $(printf '%s\n' "${rss[@]}" | median) / 1024 ))" "$(printf '%s\n' "${rss[@]}" | median)"
printf 'ratio import/peer time: %.2f (goal <= 1.0)\n' "$(echo "$ours_s / $theirs_s" | bc -l)"
