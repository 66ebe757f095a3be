#!/usr/bin/env bash
# ModelArts training-job entry (boot file): runs once per node.
#
# Usage: run/modelarts_boot.sh RECIPE STRATEGY [key=value ...] [naohai launch flags]
#    or (as `naohai submit` sets it up; ModelArts passes job parameters and the
#    local paths of inputs/outputs as --name=value):
#        run/modelarts_boot.sh --recipe=R [--strategy=S] [--overrides="k=v k=v"]
#                              [--device=Ascend|GPU|CPU|auto] [--data=LOCAL_DIR] [--output=LOCAL_DIR]
#    --device goes to `naohai launch --device` (and from there to every worker),
#    --data becomes data.prepared_dir=..., --output becomes train.output_dir=...;
#    other --name=value arguments are ignored with a note.
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
usage() { sed -n '2,20p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }
if [ "${1:-}" != "${1#--}" ]; then
  # --name=value form (ModelArts boot file)
  recipe=""; strategy=""; device=""; pairs=()
  for a in "$@"; do
    case $a in
      --recipe=*) recipe=${a#--recipe=} ;;
      --strategy=*) strategy=${a#--strategy=} ;;
      --device=*) device=${a#--device=} ;;
      # shellcheck disable=SC2206
      --overrides=*) pairs+=(${a#--overrides=}) ;;
      --data=*) pairs+=("data.prepared_dir=${a#--data=}") ;;
      --output=*) pairs+=("train.output_dir=${a#--output=}") ;;
      *) echo "modelarts_boot: ignoring argument $a" >&2 ;;
    esac
  done
  [ -n "$recipe" ] || usage
  set -- "${pairs[@]}"
else
  [ $# -ge 2 ] || usage
  recipe=$1; strategy=$2; device=""; shift 2
fi
# key=value recipe overrides go right after the recipe; anything else is a naohai launch flag
overrides=(); flags=()
for a in "$@"; do
  case $a in -*) flags+=("$a") ;; *=*) overrides+=("$a") ;; *) flags+=("$a") ;; esac
done
# workers run `python -m naohai.cli train`: the uploaded code is importable without installing it
export PYTHONPATH="$here${PYTHONPATH:+:$PYTHONPATH}"
unset RANK_TABLE_FILE
env_flags=$(python -m naohai.launch.modelarts_env) || exit 2
mapfile -t node_flags <<<"$env_flags"
log_dir=${LOG_DIR:-${MA_JOB_DIR:+$MA_JOB_DIR/msrun_logs}}
args=(launch "$recipe" "${overrides[@]}" ${strategy:+--strategy "$strategy"} ${device:+--device "$device"}
      "${node_flags[@]}"
      --master-port "${MASTER_PORT:-8118}" --log-dir "${log_dir:-runs/msrun_logs}")
# shellcheck disable=SC2206
[ -n "${NAOHAI_LAUNCH_FLAGS:-}" ] && args+=(${NAOHAI_LAUNCH_FLAGS})
[ "${DRY_RUN:-0}" = 1 ] && args+=(--dry-run)
echo "modelarts_boot: naohai ${args[*]} ${flags[*]}"
exec python -m naohai.cli "${args[@]}" "${flags[@]}"
