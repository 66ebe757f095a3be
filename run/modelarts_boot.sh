#!/usr/bin/env bash
# ModelArts training-job entry (boot file): runs once per node.
#
# Usage (set by `naohai submit`): run/modelarts_boot.sh RECIPE STRATEGY [key=value ...]
#
# Reads the platform's variables through `python -m naohai.launch.modelarts_env`:
#   MA_NUM_HOSTS or VC_WORKER_NUM  node count
#   VC_TASK_INDEX                  this node's index (0-based)
#   MA_NUM_GPUS                    devices per node (default 8)
#   VC_WORKER_HOSTS                comma-separated hosts; the first one, resolved to an IP, is the master
# Optional: MASTER_PORT (default 8118), LOG_DIR (default $MA_JOB_DIR/msrun_logs or runs/msrun_logs),
#   NAOHAI_LAUNCH_FLAGS (extra flags, e.g. "--cluster-time-out 1200"), DRY_RUN=1.
# RANK_TABLE_FILE is unset: msrun builds the cluster dynamically.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)
cd "$here"
if [ $# -lt 2 ]; then
  sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2
  exit 2
fi
recipe=$1; strategy=$2; shift 2
# key=value recipe overrides go right after the recipe; anything else is a naohai launch flag
overrides=(); flags=()
for a in "$@"; do
  case $a in -*) flags+=("$a") ;; *=*) overrides+=("$a") ;; *) flags+=("$a") ;; esac
done
if ! command -v naohai >/dev/null 2>&1; then
  python -m pip install --no-deps -e "$here" >/dev/null
fi
unset RANK_TABLE_FILE
env_flags=$(python -m naohai.launch.modelarts_env) || exit 2
mapfile -t node_flags <<<"$env_flags"
log_dir=${LOG_DIR:-${MA_JOB_DIR:+$MA_JOB_DIR/msrun_logs}}
args=(launch "$recipe" "${overrides[@]}" --strategy "$strategy" "${node_flags[@]}"
      --master-port "${MASTER_PORT:-8118}" --log-dir "${log_dir:-runs/msrun_logs}")
# shellcheck disable=SC2206
[ -n "${NAOHAI_LAUNCH_FLAGS:-}" ] && args+=(${NAOHAI_LAUNCH_FLAGS})
[ "${DRY_RUN:-0}" = 1 ] && args+=(--dry-run)
echo "modelarts_boot: naohai ${args[*]} ${flags[*]}"
exec naohai "${args[@]}" "${flags[@]}"
