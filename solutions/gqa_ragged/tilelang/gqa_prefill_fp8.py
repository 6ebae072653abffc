"""The FP8 (e4m3) policy of the page-size-64 paged K/V source (gqa_prefill_kv.paged_kv with
cache_dtype FP8_E4M3): k_cache and v_cache [num_pages, 64, 8, 128] float8_e4m3fn, and the
kernel's scalar v_scale after sm_scale (the entry folds k_scale into sm_scale; v_scale scales
the output in the epilogue: out_scale).

The consumers run the 16-bit paged program unchanged (wgmma reads 16-bit K and V from the
ring) but for v_scale in the epilogue and their output, stored from registers (the output
buffer's 32 KB hold the second staging tile). The producer warpgroup's four warps
(loader_warps 4: the consumers are the bottleneck, the producer warps idle) turn each tile
into the ring, two tiles ahead:

1. the first warp loads a tile's pages as FP8 by TMA, one box per page (64 slots x 128 bytes,
   no swizzle), K (pages in the cache) into K8[b] and V (whole pages) into V8[b], on the
   staging barriers k8_full[b] / v8_full[b]: tile g (counted over the block's items, as the
   ring counts them) in staging buffer b = g % 2, phase (g // 2) & 1. An item's first two
   tiles are staged when the item starts (StartItem, before its Q), tile k + 2 as soon as
   tile k is converted;
2. all four warps convert K8[b] into the ring slot K_shared[stage] (once the consumers
   released it), exact, fence the shared writes for the async proxy (wgmma reads the slot) and
   arrive on k_full[stage] (128 arrivals); then V8[b] into V_shared[stage] and arrive on
   consumed[b] (the staging buffer is read: 128 arrivals, which the first warp waits for
   before it stages tile g + 2 there); the V of a page that is not whole (a sequence's last
   page, a bad page, a page past the sequence) is then read from the cache directly with zero
   past the keys (once per item at most), and they arrive on v_full[stage].

Conversions: float16 TileLang's cvt.rn.f16x2.e4m3x2 (one a pair); bfloat16 bit-level
(FP8_TO_BF16, the kernel's prelude: a byte permute with sign extension, a shift and a mask put
two e4m3 values in bf16x2 bit positions as value x 2^-120, one bf16x2 multiply by 2^120 makes
them exact; every finite e4m3 value, subnormals included; NaN reads as +-480) instead of the
cvt to f16x2 and two cvt f16 -> bf16.

Shared memory: the 16-bit program's ring (128 KB) and Q (32 KB), and two staging buffers of
32 KB (K8 and V8 [2, 128, 128]) in place of the output buffer: 224 KB.

Knob fp8_split_q (on in the shipped causal config and, for bfloat16 q over FP8 caches, in
pack_config; every bfloat16 FP8 program: bf16_over_fp8): Q K^T in e4m3 on the cache's own K,
as the CUDA and Triton kernels'.
The ring's K slots are e4m3 [2, 128, 128] (16 KB a stage, 128-byte swizzled, as the e4m3
wgmma reads them: K-major); the loader warps wait for a slot's release and the first issues
K's pages by TMA straight into it (a box of 64 slots x 128 bytes a page in the cache), then
all four arrive on k_full; only V is staged and converted, as above. The consumers split Q
once an item after q_full (SplitQ): a row scaled by 2^e (its largest |value| into [128, 256))
is exactly q_hi + q_lo, q_hi = e4m3(row), q_lo = e4m3(row - q_hi) (bf16's 8 significant bits
in two terms of 4; values under 1/4 once scaled within 2^-10), written into Q_hi and Q_lo
(e4m3 [128, 128], 16 KB each); Q K^T is two e4m3 wgmmas into the same accumulator and the
softmax takes scale x 2^-e per row. Shared memory 192 KB (ring 96 KB, Q 32 KB, V8 32 KB, Q_hi
and Q_lo 32 KB).

Knob fp8_f16_pv (bfloat16 q, every FP8 program: bf16_over_fp8; on in the shipped configs):
P V in float16. V's ring slots are float16, converted by the hardware cvt.rn.f16x2.e4m3x2
(FP8_TO_F16: one a pair, the bit-level bf16 conversion's four), and P is rounded to float16
(11 significant bits, bf16's 8; P <= 1, |V| <= 448); the output stays bfloat16.
"""

import math
from types import SimpleNamespace

import tilelang.language as T

from .gqa_prefill_shapes import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, token_rows

FP8_E4M3 = "float8_e4m3fn"  # torch.float8_e4m3fn
# fp8_split_q (SplitQ): a row of q scaled by 2^(SPLIT_Q_TOP - p), p = floor(log2 of its largest
# |value|), puts that value in [2^7, 2^8) = [128, 256), under e4m3's 448; p within [-E_CLAMP,
# E_CLAMP], so that both powers of two stay normal floats (CUDA's and Triton's bound).
SPLIT_Q_TOP = 7
E_CLAMP = 100
LOADER_THREADS = 128  # the producer warpgroup
GATHER_ROWS = LOADER_THREADS * 8 // HEAD_DIM  # rows a pass of the V gather moves
ROLLED = {"pragma_unroll_factor": 1}
STAGING = 2  # staging buffers: tiles staged ahead of the conversion
VECTOR = 8  # FP8 values a thread converts per step: an 8-byte load, a 16-byte store
# e4m3 -> bfloat16, 8 values: prmt's sign mode spreads two e4m3 bytes into 16-bit lanes
# sign-extended (BF16_SELECTORS: bytes 0, 1 and bytes 2, 3); shifted left by 4 a lane holds the
# sign at bit 15, exponent and mantissa at bits 4 .. 10 (BF16_MASK drops the sign's copies): the
# bf16 of value x 2^-120 (subnormals too), which one bf16x2 multiply by 2^120 (BF16_2_POW_120)
# makes exact. tests/test_tilelang_fp8.py checks the constants on every e4m3 value.
BF16_SELECTORS = (0x9180, 0xB3A2)
BF16_MASK = 0x87F087F0
BF16_2_POW_120 = 0x7B80
GROUP = 8  # conversion steps a call (tl_e4m3x8_to_bf16x8_x8): their loads in flight together
SOURCES = ", ".join(f"const void* s{u}" for u in range(GROUP))
DESTINATIONS = ", ".join(f"void* d{u}" for u in range(GROUP))


def load_line(u: int) -> str:
    """Step u's 8-byte shared load in the grouped conversions."""
    return f"  const uint2 a{u} = *reinterpret_cast<const uint2*>(s{u});"


LOADS = "\n".join(load_line(u) for u in range(GROUP))
STORES = "\n".join(f"  tl_e4m3x8_store_bf16x8(a{u}, d{u});" for u in range(GROUP))
FP8_TO_BF16 = f"""
__device__ __forceinline__ unsigned int tl_e4m3x2_bf16x2(unsigned int x, unsigned int sel) {{
  unsigned int d;
  asm("prmt.b32 %0, %1, 0, %2;" : "=r"(d) : "r"(x), "r"(sel));
  d = (d << 4) & {BF16_MASK:#x}u;
  asm("mul.rn.bf16x2 %0, %0, %1;" : "+r"(d) : "r"({BF16_2_POW_120 * 0x10001:#x}u));
  return d;
}}
__device__ __forceinline__ void tl_e4m3x8_store_bf16x8(uint2 in, void* dst) {{
  uint4 out;
  out.x = tl_e4m3x2_bf16x2(in.x, {BF16_SELECTORS[0]:#x}u);
  out.y = tl_e4m3x2_bf16x2(in.x, {BF16_SELECTORS[1]:#x}u);
  out.z = tl_e4m3x2_bf16x2(in.y, {BF16_SELECTORS[0]:#x}u);
  out.w = tl_e4m3x2_bf16x2(in.y, {BF16_SELECTORS[1]:#x}u);
  *reinterpret_cast<uint4*>(dst) = out;
}}
// {GROUP} steps of 8 values: every 8-byte load before the first store. One step a call kept a
// single load in flight: ptxas cannot move a shared load above the previous step's store (they
// may alias), so each conversion waited the load's full latency (ncu: the producer's top stall).
__device__ __forceinline__ void tl_e4m3x8_to_bf16x8_x{GROUP}({SOURCES}, {DESTINATIONS}) {{
{LOADS}
{STORES}
}}
"""


# e4m3 -> float16, 8 values (fp8_f16_pv): two cvt.rn.f16x2.e4m3x2 a word, on its two halves.
# GROUP steps a call in two halves of loads, then stores: all eight loads first spilled a
# 64-bit pointer (8 bytes) in the 72-register producer.
F16_STEPS = "\n".join(
    line
    for half in (range(GROUP // 2), range(GROUP // 2, GROUP))
    for line in [load_line(u) for u in half]
    + [f"  tl_e4m3x8_store_f16x8(a{u}, d{u});" for u in half]
)
FP8_TO_F16 = f"""
__device__ __forceinline__ void tl_e4m3x4_f16x4(unsigned int x, unsigned int& lo,
                                                unsigned int& hi) {{
  asm("{{\\n.reg .b16 a, b;\\nmov.b32 {{a, b}}, %2;\\n"
      "cvt.rn.f16x2.e4m3x2 %0, a;\\ncvt.rn.f16x2.e4m3x2 %1, b;\\n}}\\n"
      : "=r"(lo), "=r"(hi) : "r"(x));
}}
__device__ __forceinline__ void tl_e4m3x8_store_f16x8(uint2 in, void* dst) {{
  uint4 out;
  tl_e4m3x4_f16x4(in.x, out.x, out.y);
  tl_e4m3x4_f16x4(in.y, out.z, out.w);
  *reinterpret_cast<uint4*>(dst) = out;
}}
__device__ __forceinline__ void tl_e4m3x8_to_f16x8_x{GROUP}({SOURCES}, {DESTINATIONS}) {{
{F16_STEPS}
}}
"""


def bf16_over_fp8(dtype: str, cache_dtype) -> bool:
    """Whether knobs fp8_split_q and fp8_f16_pv change the program: FP8 caches under bfloat16 q
    (float16's 11 bits do not fit two e4m3 terms, and its P V is float16 already), split,
    packed or not."""
    return cache_dtype == FP8_E4M3 and dtype == "bfloat16"


def fp8_paged_kv(
    dims, source, helpers, cache_dtype, split_q=False, f16_pv=False
) -> SimpleNamespace:
    """The FP8 source: the 16-bit page-size-64 source (source, helpers: gqa_prefill_kv's) with
    its own kernel arguments, scratch and producer loads. split_q (knob fp8_split_q, bfloat16
    q: bf16_over_fp8): K goes by TMA straight into an e4m3 ring and the consumers split Q in
    two e4m3 terms (SplitQ); only V is staged and converted. f16_pv (knob fp8_f16_pv, bfloat16
    q: bf16_over_fp8): V converted to float16 (FP8_TO_F16) and P V in float16."""
    assert cache_dtype == FP8_E4M3, "FP8 caches are float8_e4m3fn"
    dtype, block_N, total_q = dims.dtype, dims.block_N, dims.total_q
    page_size, pages_per_tile = source.page_size, helpers.pages_per_tile
    in_cache, page_is_whole, clamp = helpers.in_cache, helpers.page_is_whole, helpers.clamp
    page_id = helpers.page_id
    bits = dtype == "bfloat16"  # the bit-level conversion (float16: the cvt)
    assert not split_q or bits, "fp8_split_q: bfloat16 q"
    assert not f16_pv or bits, "fp8_f16_pv: bfloat16 q"
    v_dtype = "float16" if f16_pv else dtype  # V's ring slots, P V's operands

    def kernel(body):
        """The page-size-64 arguments (gqa_prefill_kv.paged_kv), k_cache and v_cache FP8, and
        v_scale float32 after sm_scale."""

        @T.prim_func
        def main(
            Q: token_rows(total_q, NUM_HEADS, dims.q_stride, dtype),
            K_cache: helpers.cache(helpers.k_page_stride),
            V_cache: helpers.cache(helpers.v_page_stride),
            qo_indptr: T.Tensor([dims.len_indptr], T.int32),
            kv_indptr: T.Tensor([dims.len_indptr], T.int32),
            kv_indices: T.Tensor([helpers.num_kv_indices], T.int32),
            kv_last_page_len: T.Tensor([dims.len_indptr - 1], T.int32),
            kv_rows: T.int32,
            page_count: T.int32,
            sm_scale: T.float32,
            v_scale: T.float32,
            Output: T.Tensor([dims.out_rows, NUM_HEADS, HEAD_DIM], dims.out_dtype),
            LSE: T.Tensor([dims.out_rows, NUM_HEADS], dims.accum_dtype),
            Scheduler: T.Tensor([2], T.int32),
        ):
            kv = (
                K_cache, V_cache, kv_indptr, kv_rows, kv_indices, page_count, kv_last_page_len,
                v_scale,
            )  # fmt: skip
            helpers.Body(body, Q, kv, qo_indptr, sm_scale, Output, LSE, Scheduler)

        return main

    def alloc_scratch():
        """The 16-bit source's (pages, bad), then the staging buffers K8, V8 [2, block_N, 128]
        FP8, their barriers k8_full, v8_full (the first loader warp's 32 arrivals and the TMA
        bytes) and consumed (the 128 converting threads), and the staged tile's page ids (the
        first loader warp's registers), then the next tile's page ids (every loader thread's
        registers: LoadTile reads them a tile ahead)."""
        pages, bad = helpers.alloc_scratch()
        # split_q: K is not staged (K8 and k8_full None).
        K8 = None if split_q else T.alloc_shared([STAGING, block_N, HEAD_DIM], cache_dtype)
        V8 = T.alloc_shared([STAGING, block_N, HEAD_DIM], cache_dtype)
        k8_full = None if split_q else T.alloc_barrier([32] * STAGING)
        v8_full = T.alloc_barrier([32] * STAGING)
        consumed = T.alloc_barrier([LOADER_THREADS] * STAGING)
        staged_pages = T.alloc_local([pages_per_tile], T.int32)
        next_pages = T.alloc_local([pages_per_tile], T.int32)
        return pages, bad, K8, V8, k8_full, v8_full, consumed, staged_pages, next_pages

    @T.macro
    def Stage(cache, staged, full, b, pages, kv_head, boxed):
        """First loader warp: the tile's pages p with boxed(p) into staged[b] by TMA, a box
        each, on full[b] (completed by the warp's arrival even when no page is boxed)."""
        for p in T.unroll(pages_per_tile):
            if boxed(p):
                T.tma_copy(
                    cache[pages[p], 0:page_size, kv_head, :],
                    staged[b, p * page_size : (p + 1) * page_size, :],
                    barrier=full[b],
                )
        T.mbarrier_arrive(full[b])

    @T.macro
    def StageTile(kv, scratch, t, gt, kv_start, seq_kv, kv_head, ids_read=False):
        """First loader warp: the item's tile t, the block's gt-th, into staging buffer gt % 2
        once the converting threads are done with its last tile there (gt - 2: consumed's
        phase before this use; a buffer's first use waits for the phase before the first,
        which counts as complete). ids_read: staged_pages holds tile t's page ids already."""
        K8, V8, k8_full, v8_full, consumed, staged_pages = scratch[2:8]
        b = gt % STAGING
        T.mbarrier_wait_parity(consumed[b], ((gt // STAGING) & 1) ^ 1)
        if not ids_read:
            for p in T.unroll(pages_per_tile):
                staged_pages[p] = page_id(kv, kv_start, seq_kv, t * pages_per_tile + p)
        if not split_q:  # split_q: K goes into the ring at its turn (LoadTile)
            Stage(
                kv[0], K8, k8_full, b, staged_pages, kv_head,
                lambda p: in_cache(kv, staged_pages[p]),
            )  # fmt: skip
        Stage(
            kv[1], V8, v8_full, b, staged_pages, kv_head,
            lambda p: page_is_whole(kv, staged_pages, t, seq_kv, p),
        )  # fmt: skip

    @T.macro
    def StartItem(kv, scratch, ring, tiles, kv_start, seq_kv, kv_head):
        """Loader warps, at an item with tiles >= 1 tiles whose tile 0 is the block's ring-th:
        the first warp stages tiles 0 and 1; every thread reads tile 0's page ids
        (ReadPageIds)."""
        for p in T.unroll(pages_per_tile):
            scratch[8][p] = page_id(kv, kv_start, seq_kv, p)
        if T.get_thread_binding() % LOADER_THREADS < 32:
            StageTile(kv, scratch, 0, ring, kv_start, seq_kv, kv_head)
            if tiles > 1:
                StageTile(kv, scratch, 1, ring + 1, kv_start, seq_kv, kv_head)

    @T.macro
    def Convert(staged, b, shared, stage, to_dtype):
        """staged[b] into the ring slot shared[stage], the whole tile: a thread converts 8
        consecutive values a step (an 8-byte shared load, a 16-byte store into the swizzled
        slot), GROUP steps a call (their loads first). A warp reads two contiguous 128-byte
        rows, each quarter warp stores 8 distinct 16-byte chunks of one swizzled row: no bank
        conflict either way. to_dtype: the slot's (float16 by the cvt, bfloat16 by the bits)."""
        if to_dtype == "bfloat16" or f16_pv:  # the prelude's grouped conversions
            convert = "bf16" if to_dtype == "bfloat16" else "f16"
            lane = T.get_thread_binding() % LOADER_THREADS
            steps = block_N * HEAD_DIM // (VECTOR * LOADER_THREADS)
            assert steps % GROUP == 0, f"{steps} conversion steps in groups of {GROUP}"
            c = lane % (HEAD_DIM // VECTOR) * VECTOR
            for j in T.unroll(steps // GROUP):
                rows = [
                    (j * GROUP + u) * (LOADER_THREADS * VECTOR // HEAD_DIM)
                    + lane // (HEAD_DIM // VECTOR)
                    for u in range(GROUP)
                ]  # fmt: skip
                # The staged sources with access mask 0: their TMA landing (v8_full) and the
                # staging's next load (consumed) are ordered by mbarriers, and TileLang's
                # planner would put a 128-thread barrier before each conversion (the loader
                # warps waiting there for the first one's staging: TUNING.md, FP8).
                T.call_extern(
                    "handle", f"tl_e4m3x8_to_{convert}x8_x{GROUP}",
                    *[T.access_ptr(staged[b, r, c], 0, VECTOR) for r in rows],
                    *[T.address_of(shared[stage, r, c]) for r in rows],
                )  # fmt: skip
        else:
            for r, c in T.Parallel(block_N, HEAD_DIM):
                shared[stage, r, c] = T.Cast(to_dtype, staged[b, r, c])

    @T.macro
    def GatherV(kv, V_shared, stage, pages, k, seq_kv, kv_head):
        """The V of the tile's pages that are not whole, from the cache, zero past the keys
        (none on a page outside the cache: clamp makes the index valid, the select keeps the
        value unused), over what Convert left there (the same thread converts the same
        values)."""
        for p in T.unroll(pages_per_tile):
            if ~page_is_whole(kv, pages, k, seq_kv, p):
                keys = T.if_then_else(
                    in_cache(kv, pages[p]), seq_kv - (k * block_N + p * page_size), 0
                )
                # Rolled (the producer's 72 registers): 8 rows a pass, 8 values a thread.
                for i in T.unroll(page_size // GATHER_ROWS, annotations=ROLLED):
                    for r, c in T.Parallel(GATHER_ROWS, HEAD_DIM):
                        slot = i * GATHER_ROWS + r
                        value = kv[1][clamp(pages[p]), slot, kv_head % NUM_KV_HEADS, c]
                        V_shared[stage, p * page_size + slot, c] = T.if_then_else(
                            slot < keys, T.Cast(v_dtype, value), T.Cast(v_dtype, 0)
                        )  # fmt: skip

    @T.macro
    def ReadPageIds(kv, scratch, k, kv_start, seq_kv):
        """Tile k's page ids into pages (read at tile k - 1, or by StartItem), and
        the loads of tile k + 1's (next_pages) and, for the first warp's staging, tile k + 2's
        (staged_pages) issued: their latency passes under this tile's waits and conversion
        instead of leading the next one's (read at each tile's start, ncu had the loader
        warps wait a page-id load twice a tile: TUNING.md, FP8)."""
        pages, staged_pages, next_pages = scratch[0], scratch[7], scratch[8]
        for p in T.unroll(pages_per_tile):
            pages[p] = next_pages[p]
            next_pages[p] = page_id(kv, kv_start, seq_kv, (k + 1) * pages_per_tile + p)
        for p in T.unroll(pages_per_tile):  # every thread (a guard here breaks TileLang's sync)
            staged_pages[p] = page_id(kv, kv_start, seq_kv, (k + STAGING) * pages_per_tile + p)

    @T.macro
    def LoadTile(kv, ring, num_stages, g, k, kv_start, seq_kv, kv_head, scratch, item, tiles):
        """The producer warpgroup (all four warps): K and V of KV tile k of an item of `tiles`
        tiles, the g-th through the ring and the staging buffers, converted into the ring
        slots; then the first warp stages tile k + 2 (module docstring)."""
        K_shared, V_shared, k_full, k_empty, v_full, v_empty = ring
        pages, K8, V8, k8_full, v8_full, consumed = scratch[0], *scratch[2:7]
        stage = g % num_stages
        phase = ((g // num_stages) & 1) ^ 1
        b = g % STAGING
        staged = (g // STAGING) & 1
        ReadPageIds(kv, scratch, k, kv_start, seq_kv)
        helpers.CheckPages(kv, scratch, k, seq_kv, item, True)
        if split_q:
            # K's pages in the cache by TMA into the e4m3 ring slot, a box each (64 slots x 128
            # bytes: one 128-byte swizzle row), from the first warp; the slot's other rows keep
            # what they held (masked, as the 16-bit program's). k_full: 128 arrivals, the bytes.
            T.mbarrier_wait_parity(k_empty[stage], phase)
            if T.get_thread_binding() % LOADER_THREADS < 32:
                for p in T.unroll(pages_per_tile):
                    if in_cache(kv, pages[p]):
                        T.tma_copy(
                            kv[0][pages[p], 0:page_size, kv_head, :],
                            K_shared[stage, p * page_size : (p + 1) * page_size, :],
                            barrier=k_full[stage],
                        )
            T.mbarrier_arrive(k_full[stage])
        else:
            T.mbarrier_wait_parity(k8_full[b], staged)
            T.mbarrier_wait_parity(k_empty[stage], phase)
            Convert(K8, b, K_shared, stage, dtype)
            T.fence_proxy_async()  # the generic proxy's writes, before wgmma reads them
            T.mbarrier_arrive(k_full[stage])
        T.mbarrier_wait_parity(v8_full[b], staged)
        T.mbarrier_wait_parity(v_empty[stage], phase)
        Convert(V8, b, V_shared, stage, v_dtype)
        T.mbarrier_arrive(consumed[b])  # K8[b] and V8[b] are read
        if ~helpers.tile_is_whole(kv, pages, k, seq_kv):
            GatherV(kv, V_shared, stage, pages, k, seq_kv, kv_head)
        T.fence_proxy_async()
        T.mbarrier_arrive(v_full[stage])
        if T.get_thread_binding() % LOADER_THREADS < 32:
            if k + STAGING < tiles:
                StageTile(kv, scratch, k + STAGING, g + STAGING, kv_start, seq_kv, kv_head, True)

    @T.macro
    def SplitQ(Q_shared, q_split, acc_s, top, scale_log2):
        """split_q, the consumers (once an item, once Q landed): Q's rows as two e4m3 terms,
        q_split = (Q_hi, Q_lo, row_scale), and each row's softmax scale scale_log2 x 2^-e
        (SPLIT_Q_TOP, E_CLAMP; tests/test_tilelang_fp8.py models it in torch). Q goes through
        acc_s (free between items; its layout is the accumulator's, so top and row_scale share
        the softmax's row layout); each thread writes the terms of its accumulator rows, fenced
        for wgmma's async proxy (the barrier before the first Q K^T is TileLang's)."""
        Q_hi, Q_lo, row_scale = q_split
        T.copy(Q_shared, acc_s)
        T.reduce_absmax(acc_s, top, dim=1)
        for i in T.Parallel(top.shape[0]):
            # floor(log2(the row's largest |q|)) from its float bits; 0 or a subnormal: the
            # row is scaled by 1 (it rounds to zero terms either way); inf (0xFF): by NaN.
            biased = T.shift_right(T.reinterpret(top[i], T.int32), 23) & 0xFF
            exponent = T.if_then_else(
                biased == 0, SPLIT_Q_TOP, T.min(T.max(biased - 127, -E_CLAMP), E_CLAMP)
            )  # fmt: skip
            row_scale[i] = scale_log2 * T.reinterpret(
                T.shift_left(127 - SPLIT_Q_TOP + exponent, 23), T.float32
            )  # fmt: skip
            top[i] = T.if_then_else(
                biased == 0xFF, T.float32(math.nan),
                T.reinterpret(T.shift_left(127 + SPLIT_Q_TOP - exponent, 23), T.float32),
            )  # fmt: skip
        for i, j in T.Parallel(top.shape[0], HEAD_DIM):
            scaled = acc_s[i, j] * top[i]
            Q_hi[i, j] = T.Cast(cache_dtype, scaled)
            # The same cast again, not a read of Q_hi (nvcc shares the conversion).
            Q_lo[i, j] = T.Cast(
                cache_dtype, scaled - T.Cast(T.float32, T.Cast(cache_dtype, scaled))
            )
        T.fence_proxy_async()

    fp8 = SimpleNamespace(**vars(source))
    fp8.kernel, fp8.alloc_scratch, fp8.LoadTile = kernel, alloc_scratch, LoadTile
    # split_q: the ring's K is e4m3, and the consumers split Q (SplitQ) into two [block_M, 128]
    # e4m3 buffers (the program allocates them) for two e4m3 Q K^T.
    fp8.split_q = split_q
    fp8.generic_ring = fp8.generic_v_tail = False  # its loaders fence their own writes
    fp8.k_ring_dtype = cache_dtype if split_q else dtype
    fp8.v_ring_dtype = v_dtype
    fp8.SplitQ = SplitQ
    fp8.StartItem = StartItem
    fp8.loader_warps = LOADER_THREADS // 32
    # The consumers store the output from registers: the output buffer's room stages a tile.
    fp8.output_buffer = False
    fp8.prelude = (FP8_TO_BF16 + (FP8_TO_F16 if f16_pv else "")) if bits else None
    # setmaxnreg within the launch's 168 a thread: 72 + 2 x 216 = 504 = 3 x 168 (64 / 224 asked
    # 512: the consumers' setmaxnreg.inc never returned, the kernel hung). 0 spills both dtypes.
    fp8.producer_regs, fp8.consumer_regs = 72, 216
    # GQA packing's one consumer warpgroup leaves room: the grouped conversion beside the Q
    # gather spilled at 72.
    fp8.packed_producer_regs = 96
    fp8.out_scale = lambda kv: kv[7]
    fp8.CopyK = fp8.CopyV = None  # the warp-specialized program only
    return fp8
