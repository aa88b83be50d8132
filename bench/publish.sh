#!/usr/bin/env bash
# Publish throughput of a 1 GiB bundle, as a ratio to sha256sum of the same bytes.
# Usage: bench/publish.sh [SIZE_MIB=1024] [RUNS=3]. Needs: bc, curl (apt-get install bc curl).
source "$(dirname "$0")/lib.sh"
size_mib=${1:-1024}
runs=${2:-3}
build_release
work=$(mktemp -d /var/tmp/bootfleet-bench.XXXXXX)
trap 'stop_server 2>/dev/null; rm -rf "$work"' EXIT
make_image "$work/img" "${size_mib}M"
tar -C "$work/img" -cf "$work/bundle.tar" .
rm -rf "$work/img"
bytes=$(stat -c %s "$work/bundle.tar")
cat "$work/bundle.tar" >/dev/null # page cache, for both contenders

sha=()
pub=()
ossl=()
ddw=()
for i in $(seq "$runs"); do
  sha+=("$(seconds sha256sum "$work/bundle.tar")")
  ossl+=("$(seconds openssl dgst -sha256 "$work/bundle.tar")")
  ddw+=("$(seconds dd if="$work/bundle.tar" of="$work/copy" bs=1M conv=fsync status=none)")
  rm -f "$work/copy"
  rm -rf "$work/data" "$work/data.log"
  start_server "$work/data" 18181
  pub+=("$(seconds "$BIN" --server http://127.0.0.1:18181 --data-dir "$work/data" image publish "$work/bundle.tar")")
  stop_server
done
sha_s=$(printf '%s\n' "${sha[@]}" | median)
pub_s=$(printf '%s\n' "${pub[@]}" | median)
machine
echo "bundle: $bytes bytes; runs: $runs (median)"
printf 'sha256sum: %.2f s (%.0f MB/s)\n' "$sha_s" "$(echo "$bytes / $sha_s / 1000000" | bc -l)"
printf 'bootfleet publish (upload, hash, write, fsync, commit): %.2f s (%.0f MB/s)\n' "$pub_s" "$(echo "$bytes / $pub_s / 1000000" | bc -l)"
ossl_s=$(printf '%s\n' "${ossl[@]}" | median)
dd_s=$(printf '%s\n' "${ddw[@]}" | median)
printf 'for context: openssl dgst -sha256 (SHA-NI): %.2f s; dd conv=fsync (copy to disk): %.2f s\n' "$ossl_s" "$dd_s"
printf 'ratio publish/sha256sum throughput: %.2f (goal >= 0.8)\n' "$(echo "$sha_s / $pub_s" | bc -l)"
