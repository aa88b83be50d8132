#!/usr/bin/env bash
# Power status of N IPMI BMCs (OpenIPMI's ipmi_sim, one process a BMC, on loopback UDP)
# through bootfleet (`node power status --selector`, bounded concurrency; each answer also
# carries the system GUID) against ipmitool over the same BMCs in the same run: in a shell
# loop (what scripts around MAAS and Ironic do), and 64 at once through xargs -P. Every
# BMC's chassis is a file, odd ones on; every answer is checked against it.
# Usage: bench/power.sh [N=500] [CONCURRENCY=64]. Needs: openipmi ipmitool python3 curl.
source "$(dirname "$0")/lib.sh"
n=${1:-500}
width=${2:-64}
for tool in ipmi_sim ipmitool python3 curl; do
  command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install openipmi ipmitool python3 curl" >&2; exit 1; }
done
build_release
work=$(mktemp -d /var/tmp/bootfleet-bench.XXXXXX)
password=bench-ipmi-pw
trap 'stop_server 2>/dev/null; [ -f "$work/pids" ] && xargs -r kill <"$work/pids" 2>/dev/null; sleep 0.5; rm -rf "$work"' EXIT
cat >"$work/chassis" <<'SH'
#!/bin/sh
D=$1; op=$2; shift 2
if [ "$op" = get ]; then
  for p; do case $p in
    power) echo "power:$(cat "$D/power")" ;;
    boot) echo "boot:none" ;;
  esac; done
fi
SH
chmod 755 "$work/chassis"
port() { echo $((21000 + $1)); }
for i in $(seq 0 $((n - 1))); do
  d=$work/bmc$i
  mkdir -p "$d/state"
  echo $((i % 2)) >"$d/power"
  cat >"$d/lan.conf" <<EOF
name "bmc$i"
set_working_mc 0x20
  startlan 1
    addr 127.0.0.1 $(port "$i")
    priv_limit admin
    allowed_auths_callback none md2 md5 straight
    allowed_auths_user none md2 md5 straight
    allowed_auths_operator none md2 md5 straight
    allowed_auths_admin none md2 md5 straight
    guid a123456789abcdefa123456789abcdef
  endlan
  chassis_control "$work/chassis $d"
  user 2 true "admin" "$password" admin 10 none md2 md5 straight
EOF
  printf 'mc_setbmc 0x20\nmc_add 0x20 0 no-device-sdrs 0x23 9 8 0x9f 0x1291 0xf02\nmc_enable 0x20\n' >"$d/bmc.emu"
  setsid ipmi_sim -c "$d/lan.conf" -f "$d/bmc.emu" -s "$d/state" -n </dev/null >/dev/null 2>&1 &
  echo $! >>"$work/pids"
done
export IPMI_PASSWORD=$password
ipmi() { ipmitool -I lanplus -C 3 -N 1 -R 1 -H 127.0.0.1 -p "$(port "$1")" -U admin -E chassis power status 2>&1; }
for _ in $(seq 100); do ipmi $((n - 1)) | grep -q "Power is" && break; sleep 0.2; done
machine
echo "$n ipmi_sim BMCs: $(awk '/VmRSS/ {s+=$2} END {printf "%.0f MiB RSS in all", s/1024}' $(sed 's|.*|/proc/&/status|' "$work/pids"))"

mkdir -p "$work/data/secrets"
chmod 700 "$work/data/secrets"
printf 'username = "admin"\npassword = "%s"\n' "$password" >"$work/data/secrets/bmc"
chmod 600 "$work/data/secrets/bmc"
printf '[power]\nmax_concurrent = %s\ntimeout_secs = 5\n' "$width" >"$work/bootfleet.toml"
start_server "$work/data" 18190 --config "$work/bootfleet.toml"
cli() { "$BIN" --server http://127.0.0.1:18190 --data-dir "$work/data" "$@"; }
mac() { printf '52:54:00:ee:%02x:%02x' $(($1 / 256)) $(($1 % 256)); }
{
  echo "mac,labels,bmc,bmc_credential"
  for i in $(seq 0 $((n - 1))); do echo "$(mac "$i"),bench=power,ipmi://127.0.0.1:$(port "$i"),bmc"; done
} >"$work/bmcs.csv"
cli node import "$work/bmcs.csv" >/dev/null

# The truth, by MAC, for the checks below.
for i in $(seq 0 $((n - 1))); do
  [ $((i % 2)) = 1 ] && echo "$(mac "$i") on" || echo "$(mac "$i") off"
done >"$work/truth"
check_bootfleet() {
  python3 - "$1" "$work/truth" <<'PY'
import json, sys
answers = json.load(open(sys.argv[1]))
truth = dict(l.split() for l in open(sys.argv[2]))
got = {a["mac"]: (a.get("answer") or {}).get("state") for a in answers}
print(sum(1 for m, s in truth.items() if got.get(m) != s))
PY
}
runs=3
for run in $(seq $runs); do
  t=$(seconds cli --output json node power status -l bench=power --concurrency "$width")
  cli --output json node power status -l bench=power --concurrency "$width" >"$work/answers.json" || true
  echo "bootfleet run $run: ${t} s, wrong answers: $(check_bootfleet "$work/answers.json")"
  echo "$t" >>"$work/t_bootfleet"
done

loop() {
  for i in $(seq 0 $((n - 1))); do
    case "$(ipmi "$i")" in
      *"Power is on"*) echo "$(mac "$i") on" ;;
      *"Power is off"*) echo "$(mac "$i") off" ;;
      *) echo "$(mac "$i") ?" ;;
    esac
  done
}
export -f ipmi port mac
parallel() {
  seq 0 $((n - 1)) | xargs -P "$width" -I{} bash -c 'case "$(ipmi {})" in *"Power is on"*) echo "$(mac {}) on";; *"Power is off"*) echo "$(mac {}) off";; *) echo "$(mac {}) ?";; esac'
}
for peer in loop parallel; do
  for run in $(seq $runs); do
    start=$(date +%s.%N)
    $peer >"$work/$peer.out"
    t=$(echo "$(date +%s.%N) - $start" | bc -l)
    wrong=$(join -a 1 <(sort "$work/truth") <(sort "$work/$peer.out") | awk '$2 != $3' | wc -l)
    echo "ipmitool $peer run $run: ${t} s, wrong answers: $wrong"
    echo "$t" >>"$work/t_$peer"
  done
done
b=$(median <"$work/t_bootfleet")
l=$(median <"$work/t_loop")
p=$(median <"$work/t_parallel")
printf 'median of %s: bootfleet %.2f s (%.0f BMCs/s), ipmitool loop %.2f s, ipmitool xargs -P%s %.2f s\n' \
  "$runs" "$b" "$(echo "$n / $b" | bc -l)" "$l" "$width" "$p"
printf 'bootfleet is %.1fx the ipmitool loop and %.1fx ipmitool %s at once\n' \
  "$(echo "$l / $b" | bc -l)" "$(echo "$p / $b" | bc -l)" "$width"
echo "server peak RSS: $(awk '/VmHWM/ {printf "%.1f MiB", $2/1024}' /proc/$SERVER_PID/status)"
