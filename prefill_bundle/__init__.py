"""Shared pieces of the GQA prefill attention bundle: definitions, workloads, packing, testing."""

from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
OP_TYPE = "gqa_ragged"
MINI = "mini_flash_attention_prefill"
RAGGED = "gqa_ragged_prefill_causal_h32_kv8_d128"
SWA = "gqa_ragged_prefill_causal_swa_h32_kv8_d128"  # RAGGED plus a sliding window
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
PAGED_OP_TYPE = "gqa_paged"
PAGED_PS1 = "gqa_paged_prefill_causal_h32_kv8_d128_ps1"
PAGED_PS64 = "gqa_paged_prefill_causal_h32_kv8_d128_ps64"
PAGE_SIZES = {PAGED_PS1: 1, PAGED_PS64: 64}
PAGED_FP8 = "gqa_paged_prefill_causal_fp8kv_h32_kv8_d128_ps64"  # PAGED_PS64, float8_e4m3fn K/V
