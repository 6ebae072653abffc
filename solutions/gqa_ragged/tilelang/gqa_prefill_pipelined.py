"""The pipelined TileLang program (T.Pipelined, cp.async loads): the CPU tests' stand-in for the
warp-specialized program, from the same steps, and a point of comparison on the GPU (TUNING.md).
"""

import tilelang.language as T

from .gqa_prefill_steps import (
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


def gqa_prefill_pipelined(steps, num_stages: int, threads: int, overlap: bool):
    """One block per work item. overlap declares FA3's schedule for the loop body instead of
    leaving it to TileLang (see gqa_prefill; ragged K/V only: a paged tile's copies are several
    statements)."""
    dtype, block_M, block_N, kv_source = steps.dtype, steps.block_M, steps.block_N, steps.kv
    num_slots, accum_dtype, neg_inf = steps.num_slots, steps.accum_dtype, steps.neg_inf
    slot_of, Locate, CheckBatch, CheckTile, Poison = (
        steps.slot_of, steps.Locate, steps.CheckBatch, steps.CheckTile, steps.Poison
    )  # fmt: skip
    bounds, MMA0, Softmax, Rescale, MMA1, Epilogue = (
        steps.bounds, steps.MMA0, steps.Softmax, steps.Rescale, steps.MMA1, steps.Epilogue
    )  # fmt: skip

    @T.macro
    def Body(Q, kv, qo_indptr, sm_scale, Output, LSE, Scheduler, window_left=None):
        # One flat grid axis (no 65535 limit), heads fastest: the 32 heads of a query tile run
        # side by side, 4 of them on each KV tile they load (L2).
        # Split: a (slot, head)'s shares side by side (steps.slot_of).
        with T.Kernel(steps.item_heads * num_slots * steps.shares, threads=threads) as block:
            Q_shared = T.alloc_shared([block_M, HEAD_DIM], dtype)
            K_shared = T.alloc_shared([block_N, HEAD_DIM], dtype)
            V_shared = T.alloc_shared([block_N, HEAD_DIM], dtype)
            # Split: the shares' fp32 outputs go out from registers.
            # Pack: each row's output goes to its own query head, from registers too.
            O_shared = (
                None if steps.split or steps.pack else T.alloc_shared([block_M, HEAD_DIM], dtype)
            )
            acc_s = T.alloc_fragment([block_M, block_N], accum_dtype)
            acc_s_cast = T.alloc_fragment([block_M, block_N], dtype)
            acc_o = T.alloc_fragment([block_M, HEAD_DIM], accum_dtype)
            scores_max = T.alloc_fragment([block_M], accum_dtype)
            scores_max_prev = T.alloc_fragment([block_M], accum_dtype)
            max_scaled = T.alloc_fragment([block_M], accum_dtype)
            scores_scale = T.alloc_fragment([block_M], accum_dtype)
            scores_sum = T.alloc_fragment([block_M], accum_dtype)
            logsum = T.alloc_fragment([block_M], accum_dtype)
            lse = T.alloc_fragment([block_M], accum_dtype)
            stats = (scores_max, scores_max_prev, max_scaled, scores_scale, scores_sum, logsum)

            seq = T.alloc_local([1], T.int32)
            tile = T.alloc_local([steps.tile_fields], T.int32)
            ok = T.alloc_local([1], T.int32)
            batch_ok = T.alloc_local([1], T.int32)
            indptr = (qo_indptr, kv_source.kv_indptr(kv), kv_source.kv_rows(kv), kv)
            scratch = kv_source.alloc_scratch()
            if kv_source.InitScratch is not None:
                kv_source.InitScratch(scratch)
            # Every thread runs the malformed-batch tests whole (this program is the CPU tests'
            # stand-in; gqa_prefill_ws shares them out).
            CheckBatch(indptr, 0, 1, batch_ok)
            item = block
            if steps.sectioned:
                drawn = T.alloc_local([1], T.int32)
                drawn[0] = block
                steps.DrawItem(drawn, kv)
                item = drawn[0]
            Locate(item, qo_indptr, kv, seq, tile, window_left)
            if batch_ok[0] == 0:
                CheckTile(slot_of(item), indptr, seq, 0, 1, ok, lambda x: x)
                if ok[0] == 0:  # seq_q = q_tile = 0: no row to compute, as for a spare slot
                    tile[SEQ_Q] = 0
                    tile[Q_TILE] = 0
                share_row0 = steps.out_row0(tile[SHARE]) if steps.split else None
                Poison(
                    indptr, Output, LSE, slot_of(item), tile[HEAD], 0, 1, seq, ok, share_row0
                )  # fmt: skip
            q_start, seq_q, kv_start, seq_kv, q_tile, head = (
                tile[Q_START], tile[SEQ_Q], tile[KV_START], tile[SEQ_KV], tile[Q_TILE], tile[HEAD]
            )  # fmt: skip
            kv_head = steps.kv_head_of(head)
            scale_log2 = sm_scale * LOG2_E
            # The pipeline waits for the Q load only inside the loop, and a block must not exit
            # while a TMA load into its shared memory is in flight: at least one iteration.
            q_pos0, full_end, loop_range = bounds(tile)

            T.fill(acc_o, 0)
            T.fill(logsum, 0)
            T.fill(scores_max, neg_inf)
            T.fill(max_scaled, 0)
            # A slot past the sequence's last tile (one per sequence at most) loads nothing.
            if q_tile < seq_q:
                if steps.pack:
                    steps.GatherQ(Q, Q_shared, q_start + q_tile, head, threads, False)
                else:
                    T.copy(Q[q_start + q_tile : q_start + q_tile + block_M, head, :], Q_shared)
                # One entry per statement of the body: K copy, Q K^T, mask, softmax (8),
                # rescale, V copy, P V. Emitted as: K and V copies, Q K^T and mask of tile k,
                # rescale and P V of tile k - 1, softmax of tile k.
                schedule = (
                    dict(
                        order=[0, 2, 3, *range(6, 14), 4, 1, 5],
                        stage=[0, 0, 0, *[0] * 8, 1, 0, 1],
                    )
                    if overlap and kv_source.page_size is None
                    else dict(num_stages=num_stages)
                )
                for k in T.Pipelined(loop_range, **schedule):
                    MMA0(
                        kv, Q_shared, K_shared, acc_s, k, kv_start, kv_head, seq_kv, full_end,
                        steps.position(q_pos0, window_left), scratch,
                    )  # fmt: skip
                    Softmax(acc_s, *stats, scale_log2)
                    T.copy(acc_s, acc_s_cast)
                    Rescale(acc_o, scores_scale)
                    MMA1(kv, V_shared, acc_s_cast, acc_o, k, kv_start, kv_head, seq_kv, scratch)

            out_start = q_start + steps.out_row0(tile[SHARE]) if steps.split else q_start
            Epilogue(
                acc_o, logsum, max_scaled, scores_scale, lse, O_shared, Output, LSE, out_start,
                q_tile, seq_q, head, kv_source.item_poisoned(scratch, (0,)),
            )  # fmt: skip

    return steps.kernel(Body)
