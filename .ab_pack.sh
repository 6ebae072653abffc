#!/bin/bash
# TileLang GQA head packing (branch wip/tilelang-gqa-pack) on an H100, from the branch root,
# environment set (source .device-wheels/setup.sh: TVM_FFI_CUDA_ARCH_LIST=9.0a,
# flashinfer-bench on PATH). ~6 minutes at most.
set -u
SOL="tilelang_paged_ps1 tilelang_paged_ps64 tilelang_fp8kv"
clk() { nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,temperature.gpu,power.draw --format=csv,noheader; }
echo "== gpu: $(clk)"
echo "== 1. build: the paged kernels (unsplit, packed split, packed unsplit, FP8) and the merge,"
echo "      one process each, then the solutions' warm-up (cache hits)"
PYTHONPATH=.:tests timeout 150 python .ab_pack_warm.py
timeout 60 python scripts/prebuild_gpu.py $SOL
echo "== 2. GPU tests (-m gpu: split and packed batches, paged, fp8, solution matrix)"
timeout 120 python -m pytest -q -p no:cacheprovider -x -m gpu tests/test_split_kv_gpu.py \
  tests/test_tilelang_paged.py tests/test_tilelang_fp8.py tests/test_solutions.py \
  -k "tilelang and (paged or fp8 or split)" 2>&1 | tail -25
echo "== 3. memcheck on the packed split path (bad page id through the shares and the merge)"
timeout 60 compute-sanitizer --tool memcheck python -m pytest -q -p no:cacheprovider -m gpu \
  tests/test_split_kv_gpu.py -k tilelang 2>&1 | tail -15
echo "== 4. kernel time: single_token_rows_16 (packed, 8 shares) and mixed_batch (not packed),"
echo "      bf16 ps64 and fp8; TileLang and FlashInfer"
echo "   gpu: $(clk)"
timeout 90 python scripts/fp8_vs_bf16.py --backends tilelang flashinfer \
  --workloads single_token_rows_16 mixed_batch 2>&1 | tail -12
echo "   gpu: $(clk)"
