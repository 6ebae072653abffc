"""The warp-specialized TileLang program, the one the solutions ship: FA3's structure written
out from the shared steps (gqa_prefill_steps.build_steps).
"""

import tilelang.language as T
from tilelang.layout import make_swizzled_layout

from .gqa_prefill_items import item_steps
from .gqa_prefill_steps import (
    HAS_ITEM,
    HEAD,
    HEAD_DIM,
    KV_START,
    LOG2_E,
    Q_START,
    Q_TILE,
    SEQ_KV,
    SEQ_Q,
    SHARE,
)

PINGPONG_BARRIER = 12  # named barriers 12.. (TileLang's own partial syncs count up from 3)


def consumer_threads_of(block_M: int) -> int:
    """One consumer warpgroup per 64 query rows."""
    assert block_M % 64 == 0, "one consumer warpgroup per 64 query rows"
    return 128 * (block_M // 64)


def gqa_prefill_ws(
    steps, num_stages: int, pingpong: bool, persistent: bool, num_sms: int,
    output_in_q: bool = False,
):  # fmt: skip
    """FA3's structure written out (gqa_prefill(ws=True)): the program gqa_prefill documents.

    Warpgroups 0 .. block_M // 64 - 1 consume (64 query rows each, as one 128-row wgmma tile);
    the last warpgroup produces: it gives its registers away (setmaxnreg) and one warp issues the
    TMA loads, Q once per tile, then K and V of every KV tile into a num_stages ring, each slot
    guarded by a full mbarrier (TMA bytes landed) and an empty one (all consumer threads done
    reading). The consumers issue Q K^T of tile k and P V of tile k - 1 asynchronously, wait for
    Q K^T only, run the softmax of tile k while P V still runs, then wait for it. pingpong: the
    warpgroups take turns issuing their GEMMs (named barriers), so one's softmax hides the other's
    GEMMs.

    The producer warp takes the work items and hands each to the consumers through a 2-slot
    shared buffer (item_full / item_empty barriers), so the consumers never wait for the sequence
    search: the loader warps fetch an item and produce its loads (FetchItem, ProduceItem), the
    consumers receive it, checked, and consume it (ReceiveItem, ConsumeItem); the hand-over
    steps are gqa_prefill_items'. persistent: a grid of num_sms blocks; each producer starts
    on its block's own item and takes each later one from Scheduler[0] by atomic add (items
    run heaviest first, and the first block to ask gets the next: it balances unequal items
    better than a static round robin), the last
    block to finish zeroes Scheduler again for the next launch on that stream. The ring and Q's
    barriers run on across items, so the producer loads the next item's Q, K and V while the
    consumers finish the last P V and store the output (staged in its own shared buffer, so
    that Q's can refill early; FP8 caches: stored from registers, the buffer's room stages
    K/V; output_in_q: staged in Q's buffer, whose next Q then loads after the epilogue).
    Otherwise one block per item, and Scheduler is unused.
    Why persistent and dynamic: TUNING.md.

    K and V come through the steps' K/V source (gqa_prefill_kv): the producer warp's TMA boxes
    for ragged K/V and pages of 64, a gather by all four producer warps (loader_warps) for pages
    of 1. The other loader warps then read each item back from item_tile as the consumers do
    (and release it on item_empty with them); the first still takes the items and loads Q.

    Malformed batches: the first consumer warp checks the batch (CheckBatch, once per block, on
    its first turn) while the producer searches for its first item, so a valid batch pays no
    latency for it; the producer waits for the verdict (batch_checked) before it loads anything.
    In a malformed batch only, the producer passes each item's slot in item_tile[., POISON_SLOT] (-1
    otherwise) and the first consumer warp checks the item's tile (CheckTile, its 32 lanes
    sharing the scan), marks it in item_tile if it computes nothing and tells the others
    (item_checked): the producer waits for that before it loads anything for the item, the other
    consumers before they read the item. Consumer threads 0 .. block_M - 1 poison a row of the
    item's slot each, every item, spare ones included. The register budgets (producer 24,
    consumers 240; 56 and 224 beside the gathering warpgroup) leave no room: these checks sit
    where ptxas does not spill (found by trying; tests/test_tilelang_compile.py and
    test_tilelang_paged.py check every variant). What a valid batch pays per item: a
    named barrier for the consumers and one for the producer warp, which TileLang inserts as
    item_tile entries they read may have been written by one of them.
    """
    dtype, block_M, block_N, kv_source = steps.dtype, steps.block_M, steps.block_N, steps.kv
    num_slots, accum_dtype, neg_inf = steps.num_slots, steps.accum_dtype, steps.neg_inf
    bounds, Mask, MaskTile, Softmax, Rescale, Epilogue = (
        steps.bounds, steps.Mask, steps.MaskTile, steps.Softmax, steps.Rescale, steps.Epilogue
    )  # fmt: skip
    window, position, left_end = steps.window, steps.position, steps.left_end
    consumer_threads = consumer_threads_of(block_M)
    num_consumers = consumer_threads // 128
    threads = consumer_threads + 128  # the producer warpgroup
    # The producer warps that load K and V (the first also takes the items and loads Q); the
    # others of the warpgroup idle.
    loader_warps = kv_source.loader_warps
    loader_threads = 32 * loader_warps
    # FA3's register split: the producer warpgroup keeps 24 (32 beside three consumers).
    producer_regs, consumer_regs = (24, 240) if num_consumers <= 2 else (32, 160)
    if kv_source.loader_warps > 1:
        # FA3's split for 2 consumer warpgroups beside a cp.async producer warpgroup is 40 /
        # 232; the gathering warps here spill below 56 (ptxas; tests check it), the FP8
        # converting ones below 64 (its source's producer_regs and consumer_regs).
        # (GQA packing's one consumer warpgroup: the pool only grows.)
        assert num_consumers == 2 or steps.pack, "the loader warps' split is for 2 consumers"
        producer_regs = getattr(kv_source, "producer_regs", 56)
        consumer_regs = getattr(kv_source, "consumer_regs", 224)
    if steps.pack:
        # One consumer warpgroup: a pool of 256 a thread. The producer warp gathers Q too
        # (cp.async: 64-bit row addresses), which spilled at 24; beside page size 1's gather
        # (its rows' page ids held a tile) it spilled 20 bytes at 56, beside FP8's grouped
        # conversion 284 bytes at 72 (its source's packed_producer_regs).
        producer_regs = max(
            producer_regs,
            getattr(kv_source, "packed_producer_regs", 56 if loader_warps == 1 else 72),
        )  # fmt: skip
    # setmaxnreg moves registers within the block's own pool, what the launch gave it: ptxas's
    # count per thread (65536 / threads down to a multiple of 8: 168 for 384 threads) times the
    # threads. A split over it never returns from the consumers' setmaxnreg.inc (the FP8 split
    # 64 / 224 asked 1024 registers more than 3 x 168: the kernel hung on the H100).
    launch_regs = 65536 // threads // 8 * 8
    assert producer_regs * 128 + consumer_regs * consumer_threads <= launch_regs * threads, (
        f"register split {producer_regs} / {consumer_regs} over the block's {launch_regs}"
    )
    # Split, packed and FP8 programs store the output from registers: no staging buffer.
    stages_output = not (steps.split or steps.pack or not getattr(kv_source, "output_buffer", True))
    # The output staged in Q's buffer by a block that runs more than one item: Q's buffer is
    # released after the epilogue, not after the item's last Q K^T. (A block per item stages
    # it there anyway, with no next Q to wait: output_in_q changes nothing for it.)
    q_holds_output = persistent and output_in_q and stages_output
    # split: a (slot, head)'s shares; pack: a head is a KV head
    num_items = steps.item_heads * num_slots * steps.shares
    grid = T.min(num_items, num_sms) if persistent else num_items
    policy = T.GemmWarpPolicy.FullRow
    # A K/V source that reads ahead (page size 64: the first window of page ids; FP8: staged
    # tiles) starts each item.
    StartItem = getattr(kv_source, "StartItem", None)
    LoadQ, FetchItem, ReceiveItem = item_steps(
        steps, consumer_threads, loader_warps, persistent, num_items, grid, num_sms
    )  # fmt: skip

    # FP8 caches with fp8_split_q (gqa_prefill_fp8): Q K^T in e4m3, Q as two terms (Q_hi, Q_lo)
    # against the ring's e4m3 K, both into acc_s; the softmax takes a scale per row.
    split_q = getattr(kv_source, "split_q", False)

    # wgmma reads shared memory through the async proxy, and what cp.async wrote there is the
    # generic proxy's: the PTX memory model wants a proxy fence between the two (TMA writes
    # are the async proxy's already; the FP8 loaders fence their own writes). The consumers
    # fence after the wait on the slot: page size 1 (gathered) every K and V slot, the ragged
    # and page-size-64 sources the item's last V (a tail or a partial page, copied), packed
    # programs Q (gathered). As CUDA's kernels (kGenericProxyWrites), where the fence was
    # measured free (cuda/TUNING.md, page size 1).
    ring_fence = getattr(kv_source, "generic_ring", False)
    tail_fence = ring_fence or getattr(kv_source, "generic_v_tail", False)
    q_fence = steps.pack and not split_q  # split_q reads Q with generic loads (SplitQ)

    def q_operand(Q_shared, q_split):
        """Q K^T's first operand: Q's buffer, or split_q's (Q_hi, Q_lo)."""
        return Q_shared if q_split is None else q_split[:2]

    def softmax_scale(scale_log2, q_split):
        """The softmax's scale: scale_log2, or split_q's per-row fragment."""
        return scale_log2 if q_split is None else q_split[2]

    def alloc_q_split():
        """split_q: Q's two e4m3 terms (16 KB each) and the rows' softmax scales; else None."""
        if not split_q:
            return None
        return (
            T.alloc_shared([block_M, HEAD_DIM], kv_source.k_ring_dtype),
            T.alloc_shared([block_M, HEAD_DIM], kv_source.k_ring_dtype),
            T.alloc_fragment([block_M], accum_dtype),
        )

    @T.macro
    def QKT(Q_shared, K_slot, acc_s):
        """acc_s = Q K^T of a ring slot, issued (Q_shared: Q's buffer, or split_q's two e4m3
        terms: two wgmmas into the same accumulator, hi then lo)."""
        if split_q:
            T.wgmma_gemm(
                Q_shared[0], K_slot, acc_s, transpose_B=True, clear_accum=True, policy=policy
            )  # fmt: skip
            T.wgmma_gemm(Q_shared[1], K_slot, acc_s, transpose_B=True, policy=policy)
        else:
            T.wgmma_gemm(
                Q_shared, K_slot, acc_s, transpose_B=True, clear_accum=True, policy=policy
            )  # fmt: skip

    @T.macro
    def Step(
        k, ring, masked, Q_shared, K_shared, V_shared, acc_s, acc_s_cast, acc_o, stats, bars,
        seq_kv, q_pos0, scale_log2,
    ):  # fmt: skip
        """Consumer iteration k >= 1 of an item whose KV tile 0 sits at position `ring` of the
        ring: Q K^T of tile k and P V of tile k - 1 in flight together, the softmax of tile k
        while P V runs. stats: the softmax's row vectors; bars: the K and V ring's barriers and
        the ping-pong barrier ids.

        The wait for P V (k - 2) opens the iteration instead of closing the previous one: ptxas
        hoists a wgmma wait within a basic block up to the first write of a softmax register,
        which would put the exponentials behind P V again; across the loop's back edge it cannot.
        """
        scores_max, scores_max_prev, max_scaled, scores_scale, scores_sum, logsum = stats
        k_full, v_full, k_empty, v_empty, my_barrier, next_barrier = bars
        g = ring + k
        stage = g % num_stages
        prev = (g - 1) % num_stages
        T.wait_wgmma(0)  # P V of tile k - 2 done: its V slot and P's registers are free
        if k >= 2:
            T.mbarrier_arrive(v_empty[(g - 2) % num_stages])
        T.copy(acc_s, acc_s_cast)  # P of tile k - 1
        T.mbarrier_wait_parity(k_full[stage], (g // num_stages) & 1)
        if ring_fence:
            T.fence_proxy_async()
        if pingpong:
            T.sync_threads(my_barrier, 256)
        QKT(Q_shared, K_shared[stage, :, :], acc_s)
        # The running max of tile k - 1 moved: rescale before its P V adds on.
        Rescale(acc_o, scores_scale)
        T.mbarrier_wait_parity(v_full[prev], ((g - 1) // num_stages) & 1)
        if ring_fence:
            T.fence_proxy_async()
        T.wgmma_gemm(acc_s_cast, V_shared[prev, :, :], acc_o, policy=policy)
        if pingpong:
            T.named_barrier_arrive(next_barrier, 256)
        T.wait_wgmma(1)  # Q K^T of tile k done, P V of tile k - 1 runs on
        T.mbarrier_arrive(k_empty[stage])
        if masked:
            MaskTile(acc_s, k, seq_kv, q_pos0)
        Softmax(acc_s, *stats, scale_log2)

    @T.macro
    def LoadItem(q_start, q_tile, kv_start, seq_kv, head, kv_head, loop_range, load):
        """Producer: Q of one item with query rows (the first loader warp), then its KV tiles
        into the ring (every loader warp). load: inputs, buffers, q_bars, bars, items_done,
        ring, scratch, tx; inputs: Q and the K/V source's arguments; buffers:
        the shared buffers of Q, K and V; q_bars: Q's full and empty barriers; bars: the ring's
        k_full, k_empty, v_full, v_empty; items_done and ring: the block's counters, advanced
        here; scratch: the K/V source's."""
        inputs, buffers, q_bars, bars, items_done, ring, scratch, tx = load
        Q, kv = inputs
        Q_shared, K_shared, V_shared = buffers
        q_full, q_empty = q_bars
        k_full, k_empty, v_full, v_empty = bars

        if StartItem is not None:  # before Q's wait for the last item's Q K^T
            StartItem(kv, scratch, ring[0], loop_range, kv_start, seq_kv, kv_head)
        if loader_warps == 1:
            LoadQ(Q, Q_shared, q_full, q_empty, q_start, q_tile, head, items_done)
        else:
            if tx < consumer_threads + 32:
                LoadQ(Q, Q_shared, q_full, q_empty, q_start, q_tile, head, items_done)
        for k in T.serial(loop_range):
            g = ring[0] + k
            bufs = (K_shared, V_shared, k_full, k_empty, v_full, v_empty)
            if StartItem is None:
                kv_source.LoadTile(
                    kv, bufs, num_stages, g, k, kv_start, seq_kv, kv_head, scratch, items_done[0]
                )  # fmt: skip
            else:  # it stages tiles ahead: it takes the item's tile count
                kv_source.LoadTile(
                    kv, bufs, num_stages, g, k, kv_start, seq_kv, kv_head, scratch,
                    items_done[0], loop_range,
                )  # fmt: skip
        items_done[0] = items_done[0] + 1
        ring[0] = ring[0] + loop_range

    @T.macro
    def ConsumeItem(
        q_start, seq_q, seq_kv, q_tile, head, q_pos0, full_end, loop_range, buffers, stats, lse,
        q_split,
        bars, q_full, q_empty, items_done, ring, Output, LSE, scale_log2, poisoned, out_scale,
    ):  # fmt: skip
        """Consumer: one item with query rows, from Q K^T of its KV tile 0 to its stores.
        buffers: Q, K, V and O's shared buffers and the accumulators; stats: the softmax's row
        vectors; bars: as Step's; items_done and ring: the block's counters, advanced here.
        q_split (split_q; else None): Q_hi, Q_lo and the per-row scale fragment."""
        Q_shared, K_shared, V_shared, O_shared, acc_s, acc_s_cast, acc_o = buffers
        scores_max, scores_max_prev, max_scaled, scores_scale, scores_sum, logsum = stats
        k_full, v_full, k_empty, v_empty, my_barrier, next_barrier = bars

        r = ring[0]
        T.fill(acc_o, 0)
        T.fill(logsum, 0)
        T.fill(scores_max, neg_inf)
        T.fill(max_scaled, 0)
        T.mbarrier_wait_parity(q_full[0], items_done[0] & 1)
        if q_fence:
            T.fence_proxy_async()
        if split_q:
            # Q's two e4m3 terms and the rows' scales (scores_sum: scratch for the rows' max);
            # from here on Q K^T's operand (q_operand) and the softmax's scale (softmax_scale).
            # (Inline calls, not names bound to their results: TileLang would rename Q_shared.)
            kv_source.SplitQ(Q_shared, q_split, acc_s, scores_sum, scale_log2)

        # Tile 0: Q K^T and softmax; its P V runs beside tile 1's softmax.
        T.mbarrier_wait_parity(k_full[r % num_stages], (r // num_stages) & 1)
        if ring_fence:
            T.fence_proxy_async()
        if pingpong:
            T.sync_threads(my_barrier, 256)
        QKT(q_operand(Q_shared, q_split), K_shared[r % num_stages, :, :], acc_s)
        if pingpong:
            T.named_barrier_arrive(next_barrier, 256)
        T.wait_wgmma(0)
        T.mbarrier_arrive(k_empty[r % num_stages])
        Mask(acc_s, 0, seq_kv, full_end, q_pos0)
        Softmax(acc_s, *stats, softmax_scale(scale_log2, q_split))

        # Tiles 1 .. mask_from - 1 are fully visible: their loop has no mask.
        mask_from = T.max(T.min(full_end // block_N, loop_range), 1)
        bars = (k_full, v_full, k_empty, v_empty, my_barrier, next_barrier)
        bufs = (
            q_operand(Q_shared, q_split), K_shared, V_shared, acc_s, acc_s_cast, acc_o, stats,
            bars,
        )  # fmt: skip
        if window:
            # The band's left edge first (masked), then its interior (unmasked).
            interior = T.max(T.min(left_end(q_pos0), mask_from), 1)
            for k in T.serial(1, interior):
                Step(k, r, True, *bufs, seq_kv, q_pos0, softmax_scale(scale_log2, q_split))
            for k in T.serial(interior, mask_from):
                Step(k, r, False, *bufs, seq_kv, q_pos0, softmax_scale(scale_log2, q_split))
        else:
            for k in T.serial(1, mask_from):
                Step(k, r, False, *bufs, seq_kv, q_pos0, softmax_scale(scale_log2, q_split))
        for k in T.serial(mask_from, loop_range):
            Step(k, r, True, *bufs, seq_kv, q_pos0, softmax_scale(scale_log2, q_split))
        if not q_holds_output:
            T.mbarrier_arrive(q_empty[0])  # every Q K^T of the item is done

        g_last = r + loop_range - 1
        last = g_last % num_stages
        T.wait_wgmma(0)
        if loop_range >= 2:
            T.mbarrier_arrive(v_empty[(g_last - 1) % num_stages])
        T.copy(acc_s, acc_s_cast)
        Rescale(acc_o, scores_scale)
        T.mbarrier_wait_parity(v_full[last], (g_last // num_stages) & 1)
        if tail_fence:
            T.fence_proxy_async()
        T.wgmma_gemm(acc_s_cast, V_shared[last, :, :], acc_o, policy=policy)
        T.wait_wgmma(0)
        T.mbarrier_arrive(v_empty[last])

        # TileLang puts a consumer barrier before the copy into O_shared:
        # every consumer is past its last Q K^T (one item per block: Q's buffer
        # is free) and past the stores of the previous item (persistent: O's
        # buffer is free).
        Epilogue(
            acc_o, logsum, max_scaled, scores_scale, lse, O_shared, Output, LSE,
            q_start, q_tile, seq_q, head, poisoned, out_scale,
        )  # fmt: skip
        if q_holds_output:
            # The output staged in Q's buffer is read out: the next Q may land there (a TMA
            # write after generic ones: the proxy fence first).
            T.fence_proxy_async()
            T.mbarrier_arrive(q_empty[0])
        items_done[0] = items_done[0] + 1
        ring[0] = ring[0] + loop_range

    @T.macro
    def ProduceItem(tile, load):
        """Loader warps: the loads of the item in tile, if it has query rows."""
        q_start, seq_q, kv_start, q_tile, head = (
            tile[Q_START], tile[SEQ_Q], tile[KV_START], tile[Q_TILE], tile[HEAD]
        )  # fmt: skip
        kv_head = steps.kv_head_of(head)
        _, _, loop_range = bounds(tile)
        if q_tile < seq_q:  # a spare slot has no row: nothing to load
            LoadItem(q_start, q_tile, kv_start, tile[SEQ_KV], head, kv_head, loop_range, load)

    @T.macro
    def Body(Q, kv, qo_indptr, sm_scale, Output, LSE, Scheduler, window_left=None):
        with T.Kernel(grid, threads=threads, prelude=getattr(kv_source, "prelude", None)) as block:
            Q_shared = T.alloc_shared([block_M, HEAD_DIM], dtype)
            if split_q:
                # Read by SplitQ's copy, no wgmma operand: swizzled as the operand would be
                # (TMA boxes as before, and the copy's 4-byte reads of 8 rows a warp without
                # bank conflicts).
                T.annotate_layout({Q_shared: make_swizzled_layout(Q_shared)})
            K_shared = T.alloc_shared(
                [num_stages, block_N, HEAD_DIM], getattr(kv_source, "k_ring_dtype", dtype)
            )  # fmt: skip
            # P V's operands: q's dtype, or the K/V source's (FP8's fp8_f16_pv: float16).
            pv_dtype = getattr(kv_source, "v_ring_dtype", dtype)
            V_shared = T.alloc_shared([num_stages, block_N, HEAD_DIM], pv_dtype)
            # Persistent: the output gets its own buffer, so the next item's Q can load while
            # this one's output is stored. One item per block: it reuses Q's (as FA3 does).
            # A K/V source may take the output buffer's room (FP8: a staging tile): O goes out
            # from registers (O_shared None).
            # Split: the shares' fp32 outputs go out from registers too.
            if not stages_output:
                O_shared = None
            else:
                own = persistent and not output_in_q
                O_shared = T.alloc_shared([block_M, HEAD_DIM], dtype) if own else Q_shared
                if own:
                    # Swizzled: unswizzled 256-byte rows put the 8 rows of each stmatrix in the
                    # same banks (32-way conflicts, ~6% of 8x2048 causal under ncu). Q's buffer
                    # is swizzled already (a wgmma operand).
                    T.annotate_layout({O_shared: make_swizzled_layout(O_shared)})
            acc_s = T.alloc_fragment([block_M, block_N], accum_dtype)
            acc_s_cast = T.alloc_fragment([block_M, block_N], pv_dtype)
            acc_o = T.alloc_fragment([block_M, HEAD_DIM], accum_dtype)
            scores_max = T.alloc_fragment([block_M], accum_dtype)
            scores_max_prev = T.alloc_fragment([block_M], accum_dtype)
            max_scaled = T.alloc_fragment([block_M], accum_dtype)
            scores_scale = T.alloc_fragment([block_M], accum_dtype)
            scores_sum = T.alloc_fragment([block_M], accum_dtype)
            logsum = T.alloc_fragment([block_M], accum_dtype)
            lse = T.alloc_fragment([block_M], accum_dtype)
            stats = (scores_max, scores_max_prev, max_scaled, scores_scale, scores_sum, logsum)
            q_split = alloc_q_split()
            # full: the producer warp's 32 threads arrive, TMA's bytes complete the phase;
            # empty: every consumer thread arrives once it is done with the slot.
            q_full = T.alloc_barrier(32)
            q_empty = T.alloc_barrier(consumer_threads)
            k_full = T.alloc_barrier([loader_threads] * num_stages)
            v_full = T.alloc_barrier([loader_threads] * num_stages)
            k_empty = T.alloc_barrier([consumer_threads] * num_stages)
            v_empty = T.alloc_barrier([consumer_threads] * num_stages)
            seq = T.alloc_local([1], T.int32)
            # The current item: Locate's result, then whether there is one, then the slot whose
            # rows it poisons (-1: none, the batch is valid).
            tile = T.alloc_local([steps.item_fields], T.int32)
            fetch = T.alloc_local([1], T.int32)
            ok = T.alloc_local([1], T.int32)
            # The producer warp hands each item to the consumers through a 2-slot buffer.
            item_tile = T.alloc_shared([2, steps.item_fields], T.int32)
            item_full = T.alloc_barrier([32, 32])
            # Released by every thread that reads the item: the consumers and the loader warps
            # past the first (which takes the items).
            readers = consumer_threads + loader_threads - 32
            item_empty = T.alloc_barrier([readers, readers])
            # The first consumer warp's verdict on the batch (1 if valid) and, in a malformed
            # batch, on each item (its entries of item_tile updated). One barrier per item_tile
            # slot, as item_full: nobody can then lag a whole phase behind.
            batch_ok = T.alloc_shared([1], T.int32)
            batch_checked = T.alloc_barrier(32)
            item_checked = T.alloc_barrier([32, 32])
            indptr = (qo_indptr, kv_source.kv_indptr(kv), kv_source.kv_rows(kv), kv)
            scratch = kv_source.alloc_scratch()
            # Items fetched by this block so far (the terminating one included), items with a
            # query row, and KV tiles through the ring: the phases of the barriers and the
            # ring's position carry over between items.
            fetched = T.alloc_local([1], T.int32)
            items_done = T.alloc_local([1], T.int32)
            ring = T.alloc_local([1], T.int32)
            fetched[0] = 0
            items_done[0] = 0
            ring[0] = 0
            tx = T.get_thread_binding()
            scale_log2 = sm_scale * LOG2_E

            # The item hand-over's state (gqa_prefill_items).
            hand = (
                tile, seq, ok, fetch, fetched, item_tile, item_empty, item_full, item_checked,
                batch_checked, batch_ok, qo_indptr, kv, Scheduler, block, tx, window_left,
            )  # fmt: skip

            if tx >= consumer_threads:
                T.set_max_nreg(producer_regs, 0)
                if kv_source.InitScratch is not None:
                    if tx == consumer_threads:
                        kv_source.InitScratch(scratch)
                load = (
                    (Q, kv), (Q_shared, K_shared, V_shared), (q_full, q_empty),
                    (k_full, k_empty, v_full, v_empty), items_done, ring, scratch, tx,
                )  # fmt: skip
                if loader_warps == 1:
                    if tx < consumer_threads + 32:  # the other producer warps idle
                        while fetched[0] >= 0:
                            FetchItem(hand, lambda: ProduceItem(tile, load))
                else:
                    while fetched[0] >= 0:
                        FetchItem(hand, lambda: ProduceItem(tile, load))
            else:
                T.set_max_nreg(consumer_regs, 1)
                warpgroup = tx // 128
                my_barrier = PINGPONG_BARRIER + warpgroup
                next_barrier = PINGPONG_BARRIER + (warpgroup + 1) % num_consumers
                if pingpong:
                    if warpgroup == num_consumers - 1:
                        T.named_barrier_arrive(PINGPONG_BARRIER, 256)  # warpgroup 0 first
                while fetched[0] >= 0:
                    ReceiveItem(hand, indptr, Output, LSE)
                    q_start, seq_q = tile[Q_START], tile[SEQ_Q]
                    seq_kv, q_tile = tile[SEQ_KV], tile[Q_TILE]
                    head = tile[HEAD]
                    q_pos0, full_end, loop_range = bounds(tile)
                    # The rows the epilogue writes start there (split: in the share's rows).
                    out_start = q_start if not steps.split else (
                        q_start + steps.out_row0(tile[SHARE])
                    )
                    if tile[HAS_ITEM] == 1 and q_tile < seq_q:
                        ConsumeItem(
                            out_start, seq_q, seq_kv, q_tile, head, position(q_pos0, window_left),
                            full_end, loop_range,
                            (Q_shared, K_shared, V_shared, O_shared, acc_s, acc_s_cast, acc_o),
                            stats, lse, q_split,
                            (k_full, v_full, k_empty, v_empty, my_barrier, next_barrier),
                            q_full, q_empty, items_done, ring, Output, LSE, scale_log2,
                            kv_source.item_poisoned(scratch, items_done),
                            kv_source.out_scale(kv),
                        )  # fmt: skip

    return steps.kernel(Body)
