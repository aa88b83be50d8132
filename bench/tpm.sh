#!/usr/bin/env bash
# TPM quote verification (issue 20): bootfleet's server-side check of one boot's
# evidence (RSA signature, nonce, PCR digest, replay of an OVMF-sized event log, the
# PCR 4 policy) on one thread, against tpm2-tools' tpm2_checkquote (the reference
# verifier Keylime-style scripts call, one process per quote; it checks signature, nonce
# and PCR digest only, no event log) over a quote from the same TPM, in the same run.
# Goal: >= 1,000 verifications a second on one core.
# Usage: bench/tpm.sh [SECONDS=5] [CHECKQUOTE_RUNS=200]. Needs: swtpm swtpm-tools tpm2-tools.
source "$(dirname "$0")/lib.sh"
seconds=${1:-5}
runs=${2:-200}
for tool in swtpm swtpm_setup tpm2_checkquote; do
  command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install swtpm swtpm-tools tpm2-tools" >&2; exit 1; }
done
build_release
work=$(mktemp -d /var/tmp/bootfleet-bench.XXXXXX)
trap '[ -n "${TPM_PID:-}" ] && kill "$TPM_PID" 2>/dev/null; rm -rf "$work"' EXIT
mkdir -p "$work/state"
XDG_CONFIG_HOME=$work swtpm_setup --tpm2 --tpmstate "$work/state" --createek --pcr-banks sha256 \
  --config /dev/null >/dev/null
swtpm socket --tpm2 --tpmstate dir="$work/state" --flags startup-clear \
  --server type=unixio,path="$work/sock" --ctrl type=unixio,path="$work/sock.ctrl" &
TPM_PID=$!
for _ in $(seq 100); do [ -S "$work/sock.ctrl" ] && break; sleep 0.05; done
export TPM2TOOLS_TCTI="swtpm:path=$work/sock"
machine
# bootfleet: one thread, pinned to one core.
taskset -c 0 "$BENCH" quote-verify --tcti "$TPM2TOOLS_TCTI" --seconds "$seconds" | tee "$work/ours"
ours=$(sed -n 's/.* = \([0-9]*\)\/s .*/\1/p' "$work/ours")
# tpm2_checkquote over a quote of the same PCRs (its own AK; tpm2-tools' PCR file).
cd "$work"
tpm2_createek -c ek.ctx -G rsa -u ek.pub >/dev/null
tpm2_flushcontext -t
tpm2_createak -C ek.ctx -c ak.ctx -G rsa -g sha256 -s rsassa -u ak.pub -n ak.name -f pem >/dev/null
tpm2_flushcontext -t
nonce=$(head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n')
tpm2_quote -c ak.ctx -l sha256:0,1,2,3,4,5,6,7,9 -q "$nonce" -m quote.msg -s quote.sig -o pcrs.out -g sha256 >/dev/null
tpm2_flushcontext -t
start=$(date +%s.%N)
for _ in $(seq "$runs"); do
  taskset -c 0 tpm2_checkquote -u ak.pub -m quote.msg -s quote.sig -f pcrs.out -g sha256 -q "$nonce" >/dev/null
done
end=$(date +%s.%N)
peer=$(echo "$runs / ($end - $start)" | bc -l)
printf 'tpm2_checkquote, one process per quote, one core: %d in %.2f s = %.0f/s\n' "$runs" "$(echo "$end - $start" | bc -l)" "$peer"
printf 'ratio bootfleet / tpm2_checkquote: %.0fx\n' "$(echo "$ours / $peer" | bc -l)"
