#!/usr/bin/env bash
# Start a GPU session's runs on the device machine, detached, from a steps file:
#   source .device/env/activate.sh && source .device/env/torch.sh && bash tools/device/plan.sh STEPS
# then read progress with `bash tools/device/watch.sh SECONDS` (each call within the
# machine's idle release of the last). The tree is copied to /opt/bytree first, so later
# calls need carry only .device/env. Logs: /opt/bylogs/<name>.log, .rc; progress.txt.
#
# STEPS, one step a line ('#' comments, blank lines ignored):
#   NAME TORCH LIMIT_S [VAR=VALUE ...] -- COMMAND ...
# TORCH is 2.14.1 (the staged one, first on PYTHONPATH) or 2.11 (the machine's own).
# A line starting with '&' runs at the same time as the &-lines next to it; the
# next plain line, or a line 'wait', waits for all of them. Every step gets BRANCHYARD_CACHE_DIR of its own.
# PLAN_LOGS, PLAN_TREE, PLAN_CACHES move /opt/bylogs, /opt/bytree, /opt/bycache.
set -euo pipefail
steps=${1:?usage: plan.sh STEPS}
root=$PWD logs=${PLAN_LOGS:-/opt/bylogs} tree=${PLAN_TREE:-/opt/bytree} caches=${PLAN_CACHES:-/opt/bycache}
site=/opt/bydev/site:/opt/bydev/site/nvidia_cutlass_dsl/dsl_packages
mkdir -p "$logs" "$tree"
tar --exclude=./.device --exclude=./.git -cf - . | (cd "$tree" && tar xf -)
cp "$steps" "$logs/steps.txt"
(set +e  # what is missing is recorded, not fatal
  # commit.txt first: a device copy's .git, if any, may be older than its files
  cat "$root/.device/env/commit.txt" 2>/dev/null || git -C "$root" rev-parse --short HEAD 2>/dev/null || echo "commit unknown"
  date -u
  for pp in "/opt/bydev/torch:$tree:$site" "$tree:$site"; do
    PYTHONPATH=$pp python3 -c "import sys, torch; print('torch', torch.__version__, 'python', sys.version.split()[0], torch.cuda.get_device_name())" 2>&1 | tail -1
  done
  PYTHONPATH="$tree:$site" python3 -c "import cutlass, triton; print('cutedsl', getattr(cutlass, '__version__', '?'), 'triton', triton.__version__)" 2>&1 | tail -1
  python3 -c "import cuda.bindings; print('cuda-bindings', cuda.bindings.__version__)" 2>&1 | tail -1
  nvidia-smi --query-gpu=name,driver_version,power.limit,clocks.max.sm,clocks.max.mem --format=csv; true
) > "$logs/versions.txt" 2>&1

quote() { printf '%q ' "$@"; }
step() { # NAME TORCH LIMIT [VAR=VALUE ...] -- COMMAND ...
  local name=$1 torch=$2 limit=$3 pp; shift 3
  case $torch in
    2.14.1) pp="/opt/bydev/torch:$tree:$site" ;;
    2.11) pp="$tree:$site" ;;
    *) echo "plan.sh: step $name: torch must be 2.14.1 or 2.11, not '$torch'" >&2; return 2 ;;
  esac
  local env=(PYTHONPATH="$pp" BRANCHYARD_CACHE_DIR="$caches/$name")
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do env+=("$1"); shift; done
  [ "${1:-}" = "--" ] || { echo "plan.sh: step $name: no '--' before the command" >&2; return 2; }
  shift
  echo "mark $name; s=\$(date +%s); env $(quote "${env[@]}") timeout -k 10 $limit $(quote "$@") > $logs/$name.log 2>&1; echo \$? > $logs/$name.rc; echo wall=\$((\$(date +%s)-s)) >> $logs/$name.log"
}

script=$logs/plan.sh
{
  echo "cd $tree"
  echo "mark() { echo \"\$(date +%H:%M:%S) \$*\" >> $logs/progress.txt; }"
  open=0
  while IFS= read -r line || [ -n "$line" ]; do
    line=${line%%#*}; [ -n "${line// }" ] || continue
    if [ "${line// }" = "wait" ]; then  # ends an &-group before the next one
      if [ $open = 1 ]; then echo wait; open=0; fi; continue
    fi
    if [ "${line:0:1}" = "&" ]; then
      cmd=$(eval "step ${line:1}"); echo "( $cmd ) &"; open=1
    else
      if [ $open = 1 ]; then echo wait; open=0; fi
      eval "step $line"
    fi
  done < "$steps"
  if [ $open = 1 ]; then echo wait; fi
  echo "mark done; touch $logs/plan.done"
} > "$script"
bash -n "$script"
if [ -n "${PLAN_DRY:-}" ]; then cat "$script"; exit 0; fi
setsid nohup bash "$script" > "$logs/plan.out" 2>&1 < /dev/null &
echo "plan started: $(( $(grep -c '^mark \|^( mark ' "$script") - 1 )) steps"
