#!/usr/bin/env bash
# Train on several machines with msrun: run this same script on every node.
#
# Usage: run/msrun_multi_node.sh RECIPE STRATEGY [key=value ...] [extra naohai launch flags]
#
# Environment:
#   NODES              number of nodes (required)
#   NODE_RANK          this node's index, 0..NODES-1 (required; node 0 hosts the scheduler)
#   MASTER_ADDR        IP or host name of node 0, identical on every node (required)
#   DEVICES_PER_NODE   worker processes per node (default: strategy mesh / NODES, else 8)
#   MASTER_PORT        scheduler port on node 0 (default 8118)
#   LOG_DIR            msrun logs (default runs/msrun_logs)
#   CLUSTER_TIME_OUT   seconds to wait for all nodes to join (default 600)
#   DRY_RUN=1          print the msrun command only
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
# workers run `python -m naohai.cli train`: make the package importable without installing it
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
if [ $# -lt 2 ]; then
  sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
: "${NODES:?set NODES to the number of nodes}"
: "${NODE_RANK:?set NODE_RANK to this node index (0-based)}"
: "${MASTER_ADDR:?set MASTER_ADDR to the IP or host name of node 0}"
recipe=$1; strategy=$2; shift 2
# key=value recipe overrides go right after the recipe; anything else is a naohai launch flag
overrides=(); flags=()
for a in "$@"; do
  case $a in -*) flags+=("$a") ;; *=*) overrides+=("$a") ;; *) flags+=("$a") ;; esac
done
args=(launch "$recipe" "${overrides[@]}" --strategy "$strategy" --nodes "$NODES" --node-rank "$NODE_RANK"
      --master-addr "$MASTER_ADDR" --master-port "${MASTER_PORT:-8118}"
      --log-dir "${LOG_DIR:-runs/msrun_logs}" --cluster-time-out "${CLUSTER_TIME_OUT:-600}")
[ -n "${DEVICES_PER_NODE:-}" ] && args+=(--devices-per-node "$DEVICES_PER_NODE")
[ "${DRY_RUN:-0}" = 1 ] && args+=(--dry-run)
exec python -m naohai.cli "${args[@]}" "${flags[@]}"
