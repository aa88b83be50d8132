#!/usr/bin/env bash
# Shared helpers for the benchmark scripts: build, start/stop a server, timing.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
# BIN and BENCH may name other builds (a before-and-after comparison); NO_BUILD=1 then
# skips the build of this checkout.
BIN=${BIN:-$PWD/target/release/bootfleet}
# The load generators and the storm simulator: a binary of their own, not in the server.
BENCH=${BENCH:-$PWD/target/release/bootfleet-bench}

build_release() {
  [ -n "${NO_BUILD:-}" ] || cargo build --release --quiet
}

# start_server DATA_DIR PORT [SERVE FLAGS...]: starts bootfleet in the background; sets
# SERVER_PID. RUN_IN (an array) may name a command that runs it (e.g. in a cgroup).
RUN_IN=()
start_server() {
  local data=$1 port=$2
  shift 2
  "${RUN_IN[@]}" "$BIN" --data-dir "$data" serve --listen "127.0.0.1:$port" --log-format json "$@" 2>"$data.log" &
  SERVER_PID=$!
  for _ in $(seq 100); do
    curl -fs "http://127.0.0.1:$port/healthz" >/dev/null 2>&1 && return 0
    sleep 0.1
  done
  echo "server did not start; see $data.log" >&2
  return 1
}

stop_server() {
  kill "$SERVER_PID" 2>/dev/null || true
  wait "$SERVER_PID" 2>/dev/null || true
}

# seconds CMD...: wall-clock seconds of one run of CMD (stdout discarded).
seconds() {
  local start end
  start=$(date +%s.%N)
  "$@" >/dev/null
  end=$(date +%s.%N)
  echo "$end - $start" | bc -l
}

median() { sort -g | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

machine() {
  echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs), $(free -g | awk '/Mem:/ {print $2}') GiB RAM, $(uname -r); date: $(date -u +%F)"
}

# make_image DIR KERNEL_BYTES [ROOTFS_BYTES]: a bundle directory of random artifacts.
make_image() {
  mkdir -p "$1"
  head -c "$2" /dev/urandom >"$1/vmlinuz"
  echo initrd >"$1/initrd.img"
  printf 'name = "bench"\nversion = "1"\n[boot]\nkernel = "vmlinuz"\ninitrds = ["initrd.img"]\ncmdline = "console=ttyS0 quiet"\n' >"$1/manifest.toml"
  if [ -n "${3:-}" ]; then
    head -c "$3" /dev/urandom >"$1/rootfs"
    echo 'rootfs = "rootfs"' >>"$1/manifest.toml"
  fi
}

# start_nginx ROOT PORT WORKDIR: nginx (sendfile, no access log) serving ROOT on
# 127.0.0.1:PORT in the background; sets NGINX_PID.
start_nginx() {
  cat >"$3/nginx.conf" <<NGINX
user root;
worker_processes auto;
daemon off;
pid $3/nginx.pid;
error_log $3/nginx.err;
events { worker_connections 1024; }
http {
  access_log off;
  sendfile on;
  tcp_nopush on;
  server { listen 127.0.0.1:$2; root $1; }
}
NGINX
  "${RUN_IN[@]}" nginx -c "$3/nginx.conf" &
  NGINX_PID=$!
  sleep 1
}

# start_postgres DIR: Debian's PostgreSQL in DIR (initdb, then the server on a Unix
# socket in DIR only), as the postgres user when run as root, with its durable defaults
# (fsync and synchronous_commit on, as SQLite's synchronous=FULL). Sets PG_URL (database
# "bootfleet") and PG_PID.
start_postgres() {
  local bin
  bin=$(ls -d /usr/lib/postgresql/*/bin | sort -V | tail -1)
  [ -x "$bin/initdb" ] || { echo "missing PostgreSQL: apt-get install postgresql" >&2; return 1; }
  local as=()
  if [ "$(id -u)" = 0 ]; then as=(runuser -u postgres --); chown postgres "$1"; fi
  "${as[@]}" "$bin/initdb" -A trust -U postgres -D "$1/data" >/dev/null
  "${as[@]}" "$bin/postgres" -D "$1/data" -k "$1" -c listen_addresses= -c max_connections=200 >"$1/log" 2>&1 &
  PG_PID=$!
  for _ in $(seq 100); do [ -S "$1/.s.PGSQL.5432" ] && break; sleep 0.1; done
  "${as[@]}" "$bin/psql" -h "$1" -U postgres -qc 'CREATE DATABASE bootfleet' postgres
  PG_URL="postgres://postgres@localhost/bootfleet?host=$1"
}

# debian_plus_layer OUT WORK DIR...: an OCI layout at OUT named "bench": the pinned Debian
# root of images/debian/build.sh (with the release agent), then one more gzip layer of
# the host's DIRs (relative to /) under opt/bench/, as a GPU image's libraries would be.
debian_plus_layer() {
  local out=$1 work=$2
  shift 2
  images/debian/build.sh "$work/debian" "$PWD/target/release/bootfleet-agent" >/dev/null
  mkdir -p "$out/blobs/sha256"
  cp "$work/debian"/blobs/sha256/* "$out/blobs/sha256/"
  tar -C / --sort=name --numeric-owner --transform 's,^usr/lib,opt/bench,' \
    -cf "$work/extra.tar" "$@" 2>/dev/null || true
  local diff blob
  diff=$(sha256sum "$work/extra.tar" | cut -d' ' -f1)
  gzip -n -1 -c "$work/extra.tar" >"$work/extra.tar.gz"
  blob=$(sha256sum "$work/extra.tar.gz" | cut -d' ' -f1)
  mv "$work/extra.tar.gz" "$out/blobs/sha256/$blob"
  rm -f "$work/extra.tar"
  python3 - "$work/debian" "$out" "$diff" "$blob" <<'PY'
import hashlib, json, os, sys
src, out, extra_diff, extra_blob = sys.argv[1:]
blobs = os.path.join(out, "blobs", "sha256")
def blob(digest): return os.path.join(src, "blobs", "sha256", digest.split(":")[1])
index = json.load(open(os.path.join(src, "index.json")))
manifest = json.load(open(blob(index["manifests"][0]["digest"])))
config = json.load(open(blob(manifest["config"]["digest"])))
config["rootfs"]["diff_ids"].append("sha256:" + extra_diff)
def put(doc):
    data = json.dumps(doc, separators=(",", ":")).encode()
    digest = hashlib.sha256(data).hexdigest()
    open(os.path.join(blobs, digest), "wb").write(data)
    return {"digest": "sha256:" + digest, "size": len(data)}
manifest["config"].update(put(config))
manifest["layers"].append({"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
    "digest": "sha256:" + extra_blob, "size": os.path.getsize(os.path.join(blobs, extra_blob))})
m = put(manifest)
json.dump({"schemaVersion": 2, "manifests": [{"mediaType": "application/vnd.oci.image.manifest.v1+json",
    **m, "annotations": {"org.opencontainers.image.ref.name": "bench"}}]}, open(os.path.join(out, "index.json"), "w"))
open(os.path.join(out, "oci-layout"), "w").write('{"imageLayoutVersion":"1.0.0"}')
PY
  rm -rf "$work/debian"
}
