"""TileLang GQA prefill attention over a ragged batch or a paged KV cache (32 query heads, 8 KV
heads, head dim 128): the variants, their tile configs and compilation.

One kernel serves both ragged definitions: a padded [batch, seq, heads, dim] batch is a ragged
batch of batch * seq rows with indptr = arange(batch + 1) * seq. The paged definitions get the
same program with a paged K/V load step (page size 64 or 1). Lengths, page counts and the token
and page strides are symbolic (total_q, total_kv, len_indptr, q_stride, num_pages, ...), so one
compiled kernel per (dtype, causal, page size, tile config) serves every shape and layout.

The files: gqa_prefill_steps.py builds the steps once per variant (work split, malformed-batch
checks, masks, online softmax, epilogue) around the K/V source gqa_prefill_kv.py gives (the
kernel's K/V arguments and loads, ragged or paged; gqa_prefill_shapes.py holds the head counts
and the q/k/v row layout); two sibling programs are written in them,
gqa_prefill_ws.py (the solutions' kernels: FA3's structure written out, a TMA producer warp, an
mbarrier ring of K/V tiles, two consumer warpgroups issuing wgmma asynchronously so that the
softmax of KV tile k runs beside P V of tile k - 1; the causal one persistent) and
gqa_prefill_pipelined.py (T.Pipelined with cp.async loads: the CPU tests' stand-in and a point
of comparison). Measurements behind the choices: TUNING.md.
"""

import tilelang

from .gqa_prefill_fp8 import FP8_E4M3, bf16_over_fp8
from .gqa_prefill_kv import gather_pages
from .gqa_prefill_pipelined import gqa_prefill_pipelined
from .gqa_prefill_split import PACK_BLOCK_M, decode_like, kv_shares, merge_shares
from .gqa_prefill_steps import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, build_steps
from .gqa_prefill_ws import consumer_threads_of, gqa_prefill_ws

__all__ = [
    "FP8_E4M3", "HEAD_DIM", "NUM_HEADS", "NUM_KV_HEADS", "PACK_PAGE_SIZES", "PACK_VARIANTS",
    "PACK_SPLIT_VARIANTS", "PAGE_SIZES", "SPLIT_PAGE_SIZES", "SPLIT_VARIANTS", "block_config",
    "compile_gather", "compile_merge", "compile_variant", "decode_like", "kv_shares", "pack_config",
]  # fmt: skip

SM90A = {"kind": "cuda", "arch": "sm_90a"}  # wgmma and TMA exist only for sm_90a
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}  # ex2.approx for exp2
# (dtype, causal) of every kernel the entry points launch: run_padded all four, run_ragged the
# causal two.
VARIANTS = [(dtype, causal) for dtype in ("float16", "bfloat16") for causal in (True, False)]
# (dtype, page size) of the paged kernels (causal): run_paged_ps64 and run_paged_ps1.
PAGE_SIZES = (64, 1)
PAGED_VARIANTS = [(dtype, size) for dtype in ("float16", "bfloat16") for size in PAGE_SIZES]
# dtype of the sliding-window kernels (causal, ragged, window_left an argument): run_ragged_swa.
WINDOW_VARIANTS = ["float16", "bfloat16"]
# q's dtype of the FP8-cache kernels (causal, page size 64, float8_e4m3fn caches):
# run_paged_ps64_fp8kv.
FP8_VARIANTS = ["float16", "bfloat16"]
# Split-KV (decode-like paged batches: gqa_prefill_split) runs a split kernel of the page-size-64
# variants, 16-bit and FP8: (dtype, page size, FP8 caches). Page size 1's split program fails
# TileLang 0.1.15's sync planner ("a required shared-memory sync inside a divergent region with
# 209 participating threads"): it does not split yet (TUNING.md).
SPLIT_PAGE_SIZES = (64,)
# Decode-like batches pack (below), so the entry runs no unpacked split program; the 16-bit ones
# stay compiled by the tests. FP8's (184 registers beside two consumer warpgroups) spilled 8
# bytes with the grouped conversion: not a variant.
SPLIT_VARIANTS = [
    (dtype, size, False) for dtype, size in PAGED_VARIANTS if size in SPLIT_PAGE_SIZES
]
# GQA head packing (decode-like paged batches: gqa_prefill_split.decode_like) for the page sizes
# here, 16-bit and FP8 caches (FP8: page size 64), split or not: (dtype, page size, FP8 caches).
# Page size 1's packed split program passes TileLang's sync planner (its unpacked one does not).
PACK_PAGE_SIZES = (64, 1)
PACK_VARIANTS = [
    (dtype, size, False) for dtype, size in PAGED_VARIANTS if size in PACK_PAGE_SIZES
] + [(dtype, 64, True) for dtype in FP8_VARIANTS]
# The packed variants that also split. float16 over FP8 caches fails TileLang 0.1.15's sync
# planner ("a required shared-memory sync inside a divergent region with 110 participating
# threads"; its packed unsplit and unpacked split programs compile): it packs without splitting.
PACK_SPLIT_VARIANTS = [variant for variant in PACK_VARIANTS if variant != ("float16", 64, True)]
# The persistent grid: one block per SM. The entry passes the device's count; this default (an
# H100 SXM's, and an H200's) serves offline compiles. Fewer SMs than blocks: still correct.
DEFAULT_NUM_SMS = 132


def block_config(
    dtype: str, causal: bool, contiguous: bool = True, gathered: bool = False,
    short_keys: bool = False,
) -> dict:  # fmt: skip
    """Tile sizes and schedule per variant (measured with scripts/tune_tilelang.py: TUNING.md).
    Causal items are short, so each block's prologue and epilogue weigh: the causal kernel is
    persistent. The non-causal one too, its output staged in Q's buffer (output_in_q: an output
    buffer of its own would make 240 KB with 128 x 176 tiles).
    contiguous: K/V in ragged rows without a window. Only there do the causal warpgroups take
    turns (pingpong: +1-3% on causal padded and ragged batches; the window, paged and FP8
    programs lost up to 10% with it: TUNING.md, "An item's transitions"). fp8_split_q: over FP8
    caches with bfloat16 q, Q K^T as two e4m3 wgmmas on the cache's K (+7-17% on an H200,
    TUNING.md, FP8); the programs it does not apply to ignore it (bf16_over_fp8).
    fp8_f16_pv: over FP8 caches with bfloat16 q, P V in float16 (V converted by the hardware
    cvt, one a pair: TUNING.md, FP8).
    gathered: K/V rows gathered one by one (page size 1): a third ring stage, which fits with
    the output staged in Q's buffer (output_in_q): more gathered rows in flight (+2-6% on six
    of the seven page-size-1 workloads on an H200; TUNING.md, page size 1).
    short_keys: a non-causal launch of up to SHORT_KEYS_MAX keys a sequence
    (tilelang_prefill.short_keys_launch): the causal config's 128-key tiles with an output
    buffer of their own (4x512 0.77 -> 0.98 of FlashInfer's kernel time on an H200, 8x1024
    0.89 -> 1.03; 176-key tiles ahead from 16K keys: TUNING.md, "Short non-causal sequences")."""
    del dtype  # the measurements do not separate the dtypes
    if causal:
        return dict(
            block_M=128, block_N=128, num_stages=3 if gathered else 2, ws=True, persistent=True,
            pingpong=contiguous, fp8_split_q=True, fp8_f16_pv=True, output_in_q=gathered,
        )  # fmt: skip
    if short_keys:
        return dict(block_M=128, block_N=128, num_stages=2, ws=True, persistent=True)
    return dict(block_M=128, block_N=176, num_stages=2, ws=True, persistent=True, output_in_q=True)


def pack_config(dtype: str = None, cache_dtype: str = None) -> dict:
    """GQA head packing's tiles: 64 rows (16 tokens x 4 query heads), one consumer warpgroup
    (a decode-like tile has 4-16 useful rows: a 128-row tile's second warpgroup would compute
    padding only; TUNING.md, GQA head packing). fp8_f16_pv as in block_config. bfloat16 q over
    FP8 caches: fp8_split_q too (K not converted, 48 KB a ring stage), which leaves room for a
    third stage (single-token rows +18% kernel time on an H200: TUNING.md, GQA head packing)."""
    config = dict(
        block_M=PACK_BLOCK_M, block_N=128, num_stages=2, ws=True, persistent=True, fp8_f16_pv=True
    )  # fmt: skip
    if bf16_over_fp8(dtype, cache_dtype):
        config.update(fp8_split_q=True, num_stages=3)
    return config


def gqa_prefill(
    dtype: str,
    causal: bool,
    block_M: int,
    block_N: int,
    num_stages: int,
    threads: int = None,
    overlap: bool = False,
    ws: bool = False,
    pingpong: bool = False,
    persistent: bool = False,
    num_sms: int = DEFAULT_NUM_SMS,
    page_size: int = None,
    window: bool = False,
    cache_dtype: str = None,
    split: bool = False,
    pack: bool = False,
    fp8_split_q: bool = False,
    fp8_f16_pv: bool = False,
    output_in_q: bool = False,
    long_keys: bool = False,
):
    """Build the T.prim_func of one variant.

    Q [total_q, 32, 128], K/V [total_kv, 8, 128] (dtype, any token stride: token_rows),
    qo_indptr/kv_indptr int32 [batch + 1], kv_rows (the key rows kv_indptr indexes: total_kv,
    or 0 when K and V are a 1-row stand-in, as a TMA descriptor needs a row), sm_scale float32
    (> 0) -> Output [total_q, 32, 128] (dtype) and LSE [total_q, 32] float32, the base-2
    log-sum-exp of the scaled logits; rows that a malformed batch leaves undefined get NaN.
    Causal is bottom-right aligned: query i of a sequence sees key j iff j <= i + seq_kv - seq_q.
    A row that sees no key gets 0 and -inf.
    Scheduler int32 [2]: the persistent kernel's work counters, zero before a launch and zero
    again after it (one per stream); the other programs ignore it.

    page_size (64 or 1): K and V come from a paged cache instead, and the kernel takes
    k_cache/v_cache, kv_indices, kv_last_page_len (page size 64 only), kv_rows and page_count
    in their place (gqa_prefill_kv.paged_kv); a row that sees a key on a page id outside the
    cache gets NaN (so does every row of its tile).

    window (causal, ragged K/V): a sliding window, the kernel's argument window_left (int32,
    after kv_rows) in [0, kv_rows): query i also needs j >= i + seq_kv - seq_q - window_left.
    Each item visits only the key tiles of its band (gqa_prefill_steps.build_steps).

    cache_dtype FP8_E4M3 (page size 64, ws): FP8 caches, the kernel's float32 v_scale after
    sm_scale multiplying the output (gqa_prefill_fp8).

    split (paged, causal): split-KV, Output and LSE fp32 workspaces of shares * total_q rows,
    each share's normalised output and LSE (gqa_prefill_steps.build_steps), which
    gqa_prefill_split's merge program combines into the definition's output and lse.

    pack (paged, causal): GQA head packing, items (token block, KV head), a tile's rows the
    (token, query head) pairs of block_M // 4 tokens (gqa_prefill_steps.build_steps).

    fp8_split_q (a knob, on in the causal block_config and pack_config: TUNING.md, FP8): over
    FP8 caches with bfloat16 q (split, packed or not), Q K^T as two e4m3 wgmmas on the cache's
    K (Q split in two e4m3 terms, K not converted; gqa_prefill_fp8); every other program
    ignores it.
    fp8_f16_pv (a knob, on in block_config and pack_config): over FP8 caches with bfloat16 q
    (every such program: split, packed or not), V's ring and P in float16, V converted by the
    hardware cvt (gqa_prefill_fp8).

    threads: derived from block_M when left out (one warpgroup per 64 query rows, at least one;
    ws adds the producer warpgroup); ws takes no other count.

    overlap declares FA3's schedule for the loop body instead of leaving it to TileLang: Q K^T
    and the softmax of tile k run in stage 0, the rescale and P V of tile k - 1 in stage 1,
    issued between them, so the tensor cores work while the softmax runs.

    ws builds FA3's structure by hand instead (gqa_prefill_ws): a producer warp issuing TMA loads
    of K and V into a num_stages ring guarded by mbarriers, block_M // 64 consumer warpgroups with
    asynchronous wgmma (softmax of tile k while P V of tile k - 1 runs); pingpong adds FA3's
    inter-warpgroup schedule (named barriers: one warpgroup's GEMMs run during the other's
    softmax); persistent runs num_sms blocks that take items from a counter. overlap is ignored.
    output_in_q (persistent ws): the output is staged in Q's buffer instead of one of its own
    (which 128 x 176 tiles leave no room for), so the next item's Q loads after the epilogue;
    a block-per-item program stages it there anyway.
    """
    steps = build_steps(
        dtype, causal, block_M, block_N, page_size, window, cache_dtype, split, pack,
        fp8_split_q, fp8_f16_pv, long_keys,
    )  # fmt: skip
    assert ws or cache_dtype is None, "FP8 caches: the warp-specialized program"
    if ws:
        ws_threads = consumer_threads_of(block_M) + 128
        assert threads in (None, ws_threads), "ws: one producer, block_M // 64 consumers"
        return gqa_prefill_ws(steps, num_stages, pingpong, persistent, num_sms, output_in_q)
    threads = threads or 128 * max(block_M // 64, 1)
    return gqa_prefill_pipelined(steps, num_stages, threads, overlap)


def compile_variant(
    dtype: str,
    causal: bool,
    target=SM90A,
    num_sms: int = DEFAULT_NUM_SMS,
    page_size: int = None,
    window: bool = False,
    cache_dtype: str = None,
    split: bool = False,
    pack: bool = False,
    long_keys: bool = False,
    short_keys: bool = False,
    **config,
):
    """Lower and compile one variant (K/V paged with page_size, else ragged; window: the
    sliding-window kernel; cache_dtype: FP8 caches; split: split-KV's shares into fp32
    workspaces; pack: GQA head packing; long_keys: contiguous K/V, items drawn in L2 sections
    for launches of long sequences; short_keys: block_config's for short non-causal ones);
    config defaults to block_config (page size 1: gathered), packed to pack_config(dtype,
    cache_dtype)."""
    contiguous = page_size is None and not window
    if not config and pack:
        config = pack_config(dtype, cache_dtype)
    elif not config:
        config = block_config(dtype, causal, contiguous, page_size == 1, short_keys)
    func = gqa_prefill(
        dtype, causal, num_sms=num_sms, page_size=page_size, window=window,
        cache_dtype=cache_dtype, split=split, pack=pack, long_keys=long_keys, **config,
    )  # fmt: skip
    return tilelang.compile(func, target=target, pass_configs=PASS_CONFIGS)


def compile_merge(dtype: str, target=SM90A):
    """Lower and compile split-KV's merge (gqa_prefill_split.merge_shares) for q's dtype."""
    return tilelang.compile(merge_shares(dtype), target=target, pass_configs=PASS_CONFIGS)


def compile_gather(dtype: str, target=SM90A):
    """Lower and compile page size 1's page gather (gqa_prefill_kv.gather_pages) for q's dtype."""
    return tilelang.compile(gather_pages(dtype), target=target, pass_configs=PASS_CONFIGS)
