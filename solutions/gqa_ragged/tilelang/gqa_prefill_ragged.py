"""The ragged K/V source (gqa_prefill_kv.build_kv documents what a source gives): K and V
[total_kv, 8, 128] at any token stride, kv_indptr indexing their rows; a tile is one TMA box of
block_N rows.
"""

from types import SimpleNamespace

import tilelang.language as T

from .gqa_prefill_shapes import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, token_rows


def ragged_kv(dims) -> SimpleNamespace:
    dtype, block_N, total_q = dims.dtype, dims.block_N, dims.total_q
    total_kv = T.dynamic("total_kv")
    k_stride, v_stride = T.dynamic("k_stride"), T.dynamic("v_stride")  # in elements

    def kernel(body):
        """K, V [total_kv, 8, 128] (token_rows), kv_indptr int32 [batch + 1] indexing their rows,
        kv_rows: the key rows kv_indptr indexes (total_kv, or 0 when K and V are a 1-row
        stand-in, as a TMA descriptor needs a row)."""

        @T.prim_func
        def main(
            Q: token_rows(total_q, NUM_HEADS, dims.q_stride, dtype),
            K: token_rows(total_kv, NUM_KV_HEADS, k_stride, dtype),
            V: token_rows(total_kv, NUM_KV_HEADS, v_stride, dtype),
            qo_indptr: T.Tensor([dims.len_indptr], T.int32),
            kv_indptr: T.Tensor([dims.len_indptr], T.int32),
            kv_rows: T.int32,
            sm_scale: T.float32,
            Output: T.Tensor([total_q, NUM_HEADS, HEAD_DIM], dtype),
            LSE: T.Tensor([total_q, NUM_HEADS], dims.accum_dtype),
            Scheduler: T.Tensor([2], T.int32),
        ):
            body(Q, (K, V, kv_indptr, kv_rows), qo_indptr, sm_scale, Output, LSE, Scheduler)

        return main

    @T.macro
    def LoadRing(source, shared, full, empty, g, kv_row, kv_head, num_stages):
        """The g-th K or V tile (counted over the CTA's items) into its ring slot, once the
        consumers have released the slot's previous tile."""
        stage = g % num_stages
        T.mbarrier_wait_parity(empty[stage], ((g // num_stages) & 1) ^ 1)
        T.tma_copy(
            source[kv_row : kv_row + block_N, kv_head, :], shared[stage, :, :], barrier=full[stage]
        )
        T.mbarrier_arrive(full[stage])

    @T.macro
    def LoadTile(kv, ring, num_stages, g, k, kv_start, seq_kv, kv_head, scratch, item):
        """Producer warp: K and V of KV tile k, the g-th through the ring. ring: K_shared,
        V_shared and their k_full, k_empty, v_full, v_empty barriers."""
        K, V = kv[0], kv[1]
        K_shared, V_shared, k_full, k_empty, v_full, v_empty = ring
        kv_row = kv_start + k * block_N
        LoadRing(K, K_shared, k_full, k_empty, g, kv_row, kv_head, num_stages)
        LoadRing(V, V_shared, v_full, v_empty, g, kv_row, kv_head, num_stages)

    @T.macro
    def CopyK(kv, K_shared, k, kv_start, seq_kv, kv_head, scratch):
        T.copy(kv[0][kv_start + k * block_N : kv_start + (k + 1) * block_N, kv_head, :], K_shared)

    @T.macro
    def CopyV(kv, V_shared, k, kv_start, seq_kv, kv_head, scratch):
        T.copy(kv[1][kv_start + k * block_N : kv_start + (k + 1) * block_N, kv_head, :], V_shared)

    return SimpleNamespace(
        page_size=None, kernel=kernel, loader_warps=1, alloc_scratch=lambda: None,
        InitScratch=None, item_poisoned=lambda scratch, items: None,
        kv_indptr=lambda kv: kv[2], kv_rows=lambda kv: kv[3],
        seq_kv=lambda kv, s, kv_start: kv[2][s + 1] - kv_start,
        entry_bad=lambda kv, i: None, sequence_ok=lambda kv, s: None,
        LoadTile=LoadTile, CopyK=CopyK, CopyV=CopyV, out_scale=lambda kv: None,
    )  # fmt: skip
