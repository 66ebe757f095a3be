#!/usr/bin/env bash
# Train on this machine with msrun: one process per device.
#
# Usage: run/msrun_single_node.sh RECIPE STRATEGY [key=value ...] [extra naohai launch flags]
#
# Environment (all optional):
#   DEVICES      worker processes (default: product of the strategy's mesh sizes, else 8)
#   MASTER_PORT  scheduler port (default 8118)
#   LOG_DIR      msrun logs, one worker_<rank>.log per rank (default runs/msrun_logs)
#   DRY_RUN=1    print the msrun command only
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
# workers run `python -m naohai.cli train`: make the package importable without installing it
export PYTHONPATH="$repo${PYTHONPATH:+:$PYTHONPATH}"
if [ $# -lt 2 ]; then
  sed -n '2,11p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
recipe=$1; strategy=$2; shift 2
# key=value recipe overrides go right after the recipe; anything else is a naohai launch flag
overrides=(); flags=()
for a in "$@"; do
  case $a in -*) flags+=("$a") ;; *=*) overrides+=("$a") ;; *) flags+=("$a") ;; esac
done
args=(launch "$recipe" "${overrides[@]}" --strategy "$strategy" --nodes 1
      --master-port "${MASTER_PORT:-8118}" --log-dir "${LOG_DIR:-runs/msrun_logs}")
[ -n "${DEVICES:-}" ] && args+=(--devices-per-node "$DEVICES")
[ "${DRY_RUN:-0}" = 1 ] && args+=(--dry-run)
exec python -m naohai.cli "${args[@]}" "${flags[@]}"
