"""Split-KV for decode-like batches (a few query tokens per sequence over long contexts): the
attention kernel's programs each take a share of a tile's keys (KV_SPLITS > 1, a third grid
axis) and write that share's normalised output and base-2 LSE into fp32 workspaces; this kernel
merges the shares into the definition's output and LSE.

Without it such a batch has one program per sequence and KV head: 16 sequences over 4K-16K
keys give 128 programs, each streaming its whole context, and the longest one sets the time.

Merging: with L_s the shares' LSE and M their maximum, lse = M + log2(sum_s 2^(L_s - M)) and
out = sum_s 2^(L_s - lse) out_s. A share that saw no key has L_s = -inf and weighs 0; a row no
share saw a key for (M = -inf) gets output 0 and LSE -inf, as the unsplit kernel writes; a
share's NaN (a poisoned row: bad page id, malformed batch) makes the row NaN.
"""

import triton
import triton.language as tl

from .kv_loops import round_to


@triton.jit
def merge_kv_splits(
    part_out,  # [KV_SPLITS, rows, HEAD_DIM] fp32: each share's normalised output
    part_lse,  # [KV_SPLITS, rows] fp32, base 2; -inf: the share saw no key
    out,  # [rows, HEAD_DIM] (rows: tokens x heads), the definition's output dtype
    lse,  # [rows] fp32
    rows,
    HEAD_DIM: tl.constexpr,
    KV_SPLITS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    row = tl.program_id(0) * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
    in_range = row < rows
    dims = tl.arange(0, HEAD_DIM)
    top = tl.full([BLOCK_ROWS], float("-inf"), tl.float32)
    nan_seen = tl.zeros([BLOCK_ROWS], tl.int1)
    for s in tl.static_range(KV_SPLITS):
        share = tl.load(part_lse + s * rows + row, mask=in_range, other=float("-inf"))
        nan_seen |= share != share
        top = tl.maximum(top, tl.where(share != share, float("-inf"), share))
    saw_key = top > float("-inf")
    base = tl.where(saw_key, top, 0.0)
    total = tl.zeros([BLOCK_ROWS], tl.float32)
    acc = tl.zeros([BLOCK_ROWS, HEAD_DIM], tl.float32)
    for s in tl.static_range(KV_SPLITS):
        share = tl.load(part_lse + s * rows + row, mask=in_range, other=float("-inf"))
        weight = tl.where(share != share, 0.0, tl.math.exp2(share - base))
        part = tl.load(
            part_out + (s * rows + row).to(tl.int64)[:, None] * HEAD_DIM + dims[None, :],
            mask=in_range[:, None],
            other=0.0,
        )
        acc += weight[:, None] * part
        total += weight
    merged_lse = tl.where(saw_key, top + tl.math.log2(tl.where(saw_key, total, 1.0)), float("-inf"))
    acc = acc / tl.where(saw_key, total, 1.0)[:, None]
    merged_lse = tl.where(nan_seen, float("nan"), merged_lse)
    acc = tl.where(nan_seen[:, None], float("nan"), acc)
    tl.store(
        out + row.to(tl.int64)[:, None] * HEAD_DIM + dims[None, :],
        round_to(acc, out.dtype.element_ty, INTERPRETED),
        mask=in_range[:, None],
    )
    tl.store(lse + row, merged_lse, mask=in_range)
