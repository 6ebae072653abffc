"""The FP8 (e4m3) policy of the page-size-64 paged K/V source (gqa_prefill_kv.paged_kv with
cache_dtype FP8_E4M3): k_cache and v_cache [num_pages, 64, 8, 128] float8_e4m3fn, and the
kernel's scalar v_scale after sm_scale (the entry folds k_scale into sm_scale; v_scale scales
the output in the epilogue: out_scale).

The consumers run the 16-bit paged program unchanged (wgmma reads 16-bit K and V from the
ring) but for v_scale in the epilogue. The producer warpgroup's four warps (loader_warps 4: the
consumers are the bottleneck, the producer warps idle) turn each tile into the ring:

1. the first warp loads the tile's pages as FP8 by TMA, one box per page (64 slots x 128 bytes:
   one 128-byte swizzle row a slot), K (pages in the cache) into K8 and V (whole pages) into
   V8, on the staging barriers k8_full / v8_full (one phase per tile);
2. all four warps convert K8 into the ring slot K_shared[stage] (once the consumers released
   it), exact (every e4m3 value is a float16 and a bfloat16), fence the shared writes for the
   async proxy (wgmma reads the slot) and arrive on k_full[stage] (128 arrivals); then V8 into
   V_shared[stage], the V of a page that is not whole (a sequence's last page, a bad page, a
   page past the sequence) read from the cache directly with zero past the keys (once per
   item at most), and arrive on v_full[stage];
3. before the next tile's boxes, the four warps meet at a named barrier (the staging buffers
   are free).

Shared memory: the 16-bit program's 192 KB and the two 16 KB staging buffers.
"""

from types import SimpleNamespace

import tilelang.language as T

from .gqa_prefill_shapes import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, token_rows

FP8_E4M3 = "float8_e4m3fn"  # torch.float8_e4m3fn
# The loader warps' named barrier (TileLang's own partial syncs count up from 3, the ping-pong
# barriers from 12).
FP8_BARRIER = 11
LOADER_THREADS = 128  # the producer warpgroup
GATHER_ROWS = LOADER_THREADS * 8 // HEAD_DIM  # rows a pass of the V gather moves
ROLLED = {"pragma_unroll_factor": 1}


def fp8_paged_kv(dims, source, helpers, cache_dtype) -> SimpleNamespace:
    """The FP8 source: the 16-bit page-size-64 source (source, helpers: gqa_prefill_kv's) with
    its own kernel arguments, scratch and producer loads."""
    assert cache_dtype == FP8_E4M3, "FP8 caches are float8_e4m3fn"
    dtype, block_N, total_q = dims.dtype, dims.block_N, dims.total_q
    page_size, pages_per_tile = source.page_size, helpers.pages_per_tile
    in_cache, page_is_whole, clamp = helpers.in_cache, helpers.page_is_whole, helpers.clamp

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
            Output: T.Tensor([total_q, NUM_HEADS, HEAD_DIM], dtype),
            LSE: T.Tensor([total_q, NUM_HEADS], dims.accum_dtype),
            Scheduler: T.Tensor([2], T.int32),
        ):
            kv = (
                K_cache, V_cache, kv_indptr, kv_rows, kv_indices, page_count, kv_last_page_len,
                v_scale,
            )  # fmt: skip
            helpers.Body(body, Q, kv, qo_indptr, sm_scale, Output, LSE, Scheduler)

        return main

    def alloc_scratch():
        """The 16-bit source's (pages, bad), then the staging buffers K8, V8 [block_N, 128]
        FP8 and their barriers (the first loader warp's 32 arrivals and the TMA bytes)."""
        pages, bad = source.alloc_scratch()
        K8 = T.alloc_shared([block_N, HEAD_DIM], cache_dtype)
        V8 = T.alloc_shared([block_N, HEAD_DIM], cache_dtype)
        return pages, bad, K8, V8, T.alloc_barrier(32), T.alloc_barrier(32)

    @T.macro
    def Stage(cache, staged, full, pages, kv_head, boxed):
        """First loader warp: the tile's pages p with boxed(p) into staged by TMA, a box each,
        on full (completed by the warp's arrival even when no page is boxed)."""
        for p in T.unroll(pages_per_tile):
            if boxed(p):
                T.tma_copy(
                    cache[pages[p], 0:page_size, kv_head, :],
                    staged[p * page_size : (p + 1) * page_size, :],
                    barrier=full[0],
                )
        T.mbarrier_arrive(full[0])

    @T.macro
    def Convert(staged, shared, stage):
        """staged into the ring slot shared[stage], the whole tile: a thread converts 8
        consecutive values (an 8-byte shared load, a 16-byte store into the swizzled slot)."""
        for r, c in T.Parallel(block_N, HEAD_DIM):
            shared[stage, r, c] = T.Cast(dtype, staged[r, c])

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
                        V_shared[stage, p * page_size + slot, c] = T.if_then_else(
                            slot < keys,
                            T.Cast(dtype, kv[1][clamp(pages[p]), slot, kv_head % NUM_KV_HEADS, c]),
                            T.Cast(dtype, 0),
                        )  # fmt: skip

    @T.macro
    def LoadTile(kv, ring, num_stages, g, k, kv_start, seq_kv, kv_head, scratch, item):
        """The producer warpgroup (all four warps): K and V of KV tile k, the g-th through the
        ring, staged as FP8 and converted into the ring slots (module docstring)."""
        K_shared, V_shared, k_full, k_empty, v_full, v_empty = ring
        pages, K8, V8, k8_full, v8_full = scratch[0], scratch[2], scratch[3], scratch[4], scratch[5]
        stage = g % num_stages
        phase = ((g // num_stages) & 1) ^ 1
        helpers.FindPages(kv, scratch, k, kv_start, seq_kv, item, True)
        T.sync_threads(FP8_BARRIER, LOADER_THREADS)  # K8 and V8 are free
        if T.get_thread_binding() % 128 < 32:
            Stage(kv[0], K8, k8_full, pages, kv_head, lambda p: in_cache(kv, pages[p]))
            Stage(
                kv[1], V8, v8_full, pages, kv_head,
                lambda p: page_is_whole(kv, pages, k, seq_kv, p),
            )  # fmt: skip
        T.mbarrier_wait_parity(k8_full[0], g & 1)
        T.mbarrier_wait_parity(k_empty[stage], phase)
        Convert(K8, K_shared, stage)
        T.fence_proxy_async()  # the generic proxy's writes, before wgmma reads them
        T.mbarrier_arrive(k_full[stage])
        T.mbarrier_wait_parity(v8_full[0], g & 1)
        T.mbarrier_wait_parity(v_empty[stage], phase)
        Convert(V8, V_shared, stage)
        if ~helpers.tile_is_whole(kv, pages, k, seq_kv):
            GatherV(kv, V_shared, stage, pages, k, seq_kv, kv_head)
        T.fence_proxy_async()
        T.mbarrier_arrive(v_full[stage])

    fp8 = SimpleNamespace(**vars(source))
    fp8.kernel, fp8.alloc_scratch, fp8.LoadTile = kernel, alloc_scratch, LoadTile
    fp8.loader_warps = LOADER_THREADS // 32
    # setmaxnreg within the launch's 168 a thread: 72 + 2 x 216 = 504 = 3 x 168 (64 / 224 asked
    # 512: the consumers' setmaxnreg.inc never returned, the kernel hung). 0 spills both dtypes.
    fp8.producer_regs, fp8.consumer_regs = 72, 216
    fp8.out_scale = lambda kv: kv[7]
    fp8.CopyK = fp8.CopyV = None  # the warp-specialized program only
    return fp8
