#!/bin/sh
# A drain hook for Kubernetes ([drain.hook] command), for nodes labelled scheduler=hook:
# cordon, evict with `kubectl drain` (the eviction API: PodDisruptionBudgets are kept, an
# eviction they forbid is retried at the next status), uncordon on resume. The Kubernetes
# node name is the bootfleet label k8s-node, else the node's hostname. Needs kubectl and a
# kubeconfig with rights to cordon and evict (KUBECONFIG in the server's environment).
# bootfleet runs it as: kubectl-hook.sh drain|status|resume, with BOOTFLEET_NODE_MAC,
# BOOTFLEET_NODE_HOSTNAME, BOOTFLEET_NODE_LABELS (JSON) and BOOTFLEET_REASON set.
set -eu
labels=${BOOTFLEET_NODE_LABELS:-"{}"}
node=$(printf '%s' "$labels" |
  python3 -c 'import json,sys; print(json.load(sys.stdin).get("k8s-node", ""))')
[ -n "$node" ] || node=${BOOTFLEET_NODE_HOSTNAME:-}
[ -n "$node" ] || { echo "node ${BOOTFLEET_NODE_MAC:-?} has no k8s-node label and no hostname" >&2; exit 2; }
evict() {
  kubectl drain "$node" --ignore-daemonsets --delete-emptydir-data --timeout=20s >/dev/null 2>&1
}
case "${1:-}" in
  drain)
    kubectl cordon "$node" >/dev/null
    kubectl annotate --overwrite node "$node" "bootfleet/drain-reason=${BOOTFLEET_REASON:-}" >/dev/null
    evict || true ;;
  status)
    if [ "$(kubectl get node "$node" -o jsonpath='{.spec.unschedulable}')" != "true" ]; then
      echo not-draining
    elif evict; then
      echo drained
    else
      echo draining
    fi ;;
  resume)
    kubectl uncordon "$node" >/dev/null
    kubectl annotate node "$node" bootfleet/drain-reason- >/dev/null 2>&1 || true ;;
  *) echo "usage: $0 drain|status|resume" >&2; exit 2 ;;
esac
