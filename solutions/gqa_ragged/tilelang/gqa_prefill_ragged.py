"""The ragged K/V source (gqa_prefill_kv.build_kv documents what a source gives): K and V
[total_kv, 8, 128] at any token stride, kv_indptr indexing their rows; a tile is one TMA box of
block_N rows.

A sequence's last tile runs on into the next sequence's rows (or past the tensor, which TMA
reads as zeros). K there does no harm: those scores are masked whatever Q K^T gave. V does: P V
with P = 0 is still NaN where V is NaN or inf, and the next sequence's V may hold NaN (a
malformed or poisoned batch must not reach its neighbour). So a tile that ends past its
sequence takes its V rows with cp.async's zero fill instead of a TMA box: the keys' rows read,
the others zero (once per item at most: its last tile; not for the batch's last sequence, whose
rows past its keys are past V: TMA's zeros).
"""

from types import SimpleNamespace

import tilelang.language as T

from .gqa_prefill_shapes import (
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    VECTOR,
    CopiesArrive,
    token_rows,
)

# The producer warp's copy of a tile's V (kernel prelude): lane l moves 16-byte chunk l % 16 of
# rows l / 16, + 2, + 4, ..., rows below `readable` read from v0 + row x row_bytes, the others
# zero (cp.async's ignore-src: nothing read). d0: where TileLang's layout puts the lane's first
# chunk. The buffer is 128-byte swizzled (TileLang's for a wgmma operand: 16-byte chunk c of row
# r of a 64-column half at c ^ (r % 8), 1024-byte aligned 8-row atoms), so the chunk's place in
# any row follows from d0's address bits. A running address a row: ~7 instructions a copy where
# TileLang's indexing of each row took 16.5 (TUNING.md).
V_TAIL_COPY = """
__device__ __forceinline__ void tl_copy_v_row(unsigned int dst, const char* src, int row,
                                              int readable) {
  asm volatile("{ .reg .pred ignore; setp.ge.s32 ignore, %2, %3;"
               " cp.async.cg.shared.global [%0], [%1], 16, ignore; }"
               :: "r"(dst), "l"(src), "r"(row), "r"(readable));
}

template <int kBlockN, bool kGroups>
__device__ __forceinline__ void tl_copy_v_tail(void* d0, const void* v0, unsigned int first_row,
                                               unsigned int row_bytes, int lane_row,
                                               int readable) {
  const unsigned int dst0 = static_cast<unsigned int>(__cvta_generic_to_shared(d0));
  const unsigned int chunk = dst0 & 0x70;  // (c ^ lane_row) << 4
  unsigned int row0 = dst0 - chunk;         // the lane's row, chunk 0
  unsigned long long offset;
  asm("mul.wide.u32 %0, %1, %2;" : "=l"(offset) : "r"(first_row), "r"(row_bytes));
  const char* src = static_cast<const char*>(v0) + offset;
  const unsigned int step = 2 * row_bytes;
  readable -= lane_row;
  if constexpr (kGroups) {  // an 8-row group unrolled: rows 2 j apart, chunk c ^ 2 j
#pragma unroll 1
    for (int r = 0; r < kBlockN; r += 8, row0 += 1024) {
#pragma unroll
      for (int j = 0; j < 4; ++j, src += step) {
        tl_copy_v_row(row0 + 256 * j + (chunk ^ (32 * j)), src, r + 2 * j, readable);
      }
    }
  } else {  // a row at a time (fewer registers)
#pragma unroll 1
    for (int r = 0; r < kBlockN; r += 2, src += step) {
      tl_copy_v_row(row0 + (r >> 3) * 1024 + (r & 7) * 128 + (chunk ^ ((r & 7) << 4)), src, r,
                    readable);
    }
  }
}
"""


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

    def tail_keys(k, seq_kv):
        """The keys of tile k (block_N while the tile is whole)."""
        return T.min(seq_kv - k * block_N, block_N)

    # The copy's 8-row groups unrolled: 7.75 instructions a copy; the non-causal program's
    # producer (176-key tiles) spilled 32 bytes so at its 24 registers, and copies a row at a
    # time.
    TAIL_GROUPS = "true" if block_N <= 128 else "false"

    def zero_filled(V, kv_row, keys, slot, kv_head, c):
        """V of the tile's row `slot`, or zero past its `keys` keys (not read)."""
        row = T.max(T.min(kv_row + slot, V.shape[0] - 1), 0)  # inside V all the same
        return T.if_then_else(
            slot < keys, V[row, kv_head % NUM_KV_HEADS, c], T.Cast(dtype, 0)
        )  # fmt: skip

    @T.macro
    def GatherTail(V, V_shared, stage, kv_row, keys, kv_head):
        """The producer warp's copy of a tile's `keys` first rows of V into V_shared[stage],
        zeros in the others (cp.async, in flight when it returns; V_TAIL_COPY). A row past V
        (a malformed batch's sequence may claim rows V lacks) is not read either."""
        lane = T.get_thread_binding() % 32
        chunks = HEAD_DIM // VECTOR  # lanes a row
        row, col = lane // chunks, lane % chunks * VECTOR
        readable = T.if_then_else(kv_row >= 0, T.min(keys, V.shape[0] - kv_row), 0)
        row_bytes = T.Cast("uint32", V.strides[0]) * T.uint32(2)
        T.call_extern(
            "handle", f"tl_copy_v_tail<{block_N}, {TAIL_GROUPS}>",
            T.access_ptr(V_shared[stage, row, col], "w", VECTOR),
            T.access_ptr(V[0, kv_head % NUM_KV_HEADS, col], "r", VECTOR),
            T.Cast("uint32", kv_row + row), row_bytes, row, readable,
        )  # fmt: skip

    @T.macro
    def WaitSlot(empty, g, num_stages):
        """The ring slot of the g-th tile, once the consumers have released its last tile."""
        T.mbarrier_wait_parity(empty[g % num_stages], ((g // num_stages) & 1) ^ 1)

    @T.macro
    def LoadTile(kv, ring, num_stages, g, k, kv_start, seq_kv, kv_head, scratch, item):
        """Producer warp: K and V of KV tile k, the g-th through the ring. ring: K_shared,
        V_shared and their k_full, k_empty, v_full, v_empty barriers."""
        K, V = kv[0], kv[1]
        K_shared, V_shared, k_full, k_empty, v_full, v_empty = ring
        stage = g % num_stages
        kv_row = kv_start + k * block_N
        WaitSlot(k_empty, g, num_stages)
        T.tma_copy(
            K[kv_row : kv_row + block_N, kv_head, :], K_shared[stage, :, :], barrier=k_full[stage]
        )
        T.mbarrier_arrive(k_full[stage])
        WaitSlot(v_empty, g, num_stages)
        keys = tail_keys(k, seq_kv)
        # A whole tile, or one whose rows past the keys are past V (the batch's last sequence:
        # TMA reads them as zeros), takes its box.
        if (keys == block_N) | (kv_start + seq_kv >= V.shape[0]):
            T.tma_copy(
                V[kv_row : kv_row + block_N, kv_head, :], V_shared[stage, :, :],
                barrier=v_full[stage],
            )  # fmt: skip
        else:
            GatherTail(V, V_shared, stage, kv_row, keys, kv_head)
            CopiesArrive(v_full, stage)
        T.mbarrier_arrive(v_full[stage])

    @T.macro
    def CopyK(kv, K_shared, k, kv_start, seq_kv, kv_head, scratch):
        T.copy(kv[0][kv_start + k * block_N : kv_start + (k + 1) * block_N, kv_head, :], K_shared)

    @T.macro
    def CopyV(kv, V_shared, k, kv_start, seq_kv, kv_head, scratch):
        kv_row = kv_start + k * block_N
        keys = tail_keys(k, seq_kv)
        for slot, c in T.Parallel(block_N, HEAD_DIM):
            V_shared[slot, c] = zero_filled(kv[1], kv_row, keys, slot, kv_head, c)

    return SimpleNamespace(
        page_size=None, kernel=kernel, loader_warps=1, alloc_scratch=lambda: None,
        InitScratch=None, item_poisoned=lambda scratch, items: None,
        kv_indptr=lambda kv: kv[2], kv_rows=lambda kv: kv[3],
        seq_kv=lambda kv, s, kv_start: kv[2][s + 1] - kv_start,
        entry_bad=lambda kv, i: None, sequence_ok=lambda kv, s: None,
        LoadTile=LoadTile, CopyK=CopyK, CopyV=CopyV, out_scale=lambda kv: None,
        prelude=V_TAIL_COPY,
        generic_v_tail=True,  # the tail's cp.async (gqa_prefill_ws fences it)
    )  # fmt: skip
