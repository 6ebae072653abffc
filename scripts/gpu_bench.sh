#!/usr/bin/env bash
# The GPU main job: benchmark every solution on every workload with flashinfer-bench, writing
# traces/ afresh (all solutions of a definition in one run, so each workload's ratios come from
# the same window), then print the summary. Run from the repository root on an H100 with the
# bundle installed:
#     bash scripts/gpu_bench.sh                          # everything, traces/ rewritten
#     bash scripts/gpu_bench.sh --definitions NAME ...   # only these definitions' traces
# Extra args go to `flashinfer-bench run`.
set -euo pipefail
# flashinfer-bench's CUDA builder targets sm_90, not sm_90a, unless told: the wgmma path needs 90a.
export TVM_FFI_CUDA_ARCH_LIST="${TVM_FFI_CUDA_ARCH_LIST:-9.0a}"
export FLASHINFER_CUDA_ARCH_LIST="${FLASHINFER_CUDA_ARCH_LIST:-9.0a}"
# Check for a GPU before touching the committed traces/: without one the run would fail after
# deleting them.
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  echo "gpu_bench.sh: no CUDA GPU here (torch.cuda.is_available() is False); traces/ left as is" >&2
  exit 1
fi
clocks() { nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader; }
echo "gpu at start: $(clocks)"
definitions=()
for arg in "$@"; do  # the names after --definitions, up to the next option
  case "$arg" in
    --definitions) collecting=1 ;;
    --*) collecting=0 ;;
    *) [[ "${collecting:-0}" == 1 ]] && definitions+=("$arg") ;;
  esac
done
if [[ ${#definitions[@]} -eq 0 ]]; then
  rm -rf traces
else
  for name in "${definitions[@]}"; do rm -f traces/*/"$name".jsonl; done
fi
mkdir -p traces
flashinfer-bench run --local . "$@"
echo "gpu at end: $(clocks)"
flashinfer-bench report summary --local .
# 0.1.2 logs the summary at INFO, which report does not show: print it directly too.
python3 -c "from flashinfer_bench import TraceSet; print(TraceSet.from_path('.').summary())"
