"""Split-KV for decode-like paged batches (a few query tokens a sequence over long contexts): the
host's plan (kv_shares) and the program that merges the key shares (merge_shares).

Without a split, 16 single-token sequences over ~8.5K keys each make 32 x 16 = 512 items (query
head, query tile) for 132 SMs, each walking its sequence's 36-114 key tiles alone: the SMs that
draw the last long items set the call's time (TUNING.md, split-KV). With `shares` shares each
(slot, head) becomes `shares` items over consecutive key ranges (gqa_prefill_steps.ClipToShare),
writing its normalised output and base-2 LSE into fp32 workspaces of shares * total_q rows;
merge_shares then combines them into the definition's output and lse.

Merging row r (a token and head): with L_s the shares' LSE and M their maximum, lse = M +
log2(sum_s 2^(L_s - M)) and out = sum_s 2^(L_s - M) out_s / sum_s 2^(L_s - M). A share that saw
no key has L_s = -inf and weighs 0; a row no share saw a key for gets output 0 and LSE -inf, as
the unsplit kernel writes; a NaN share (a poisoned row: malformed batch, page id out of range)
makes the row NaN, output and lse.
"""

import math

import tilelang.language as T

from .gqa_prefill_shapes import GROUP_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS

DECODE_TOKENS = 4  # query tokens a sequence (on average) up to which a batch is decode-like
SHARE_WAVES = 4  # items an SM the shares aim for (4 of 1-8: TUNING.md, split-KV)
MIN_SHARE_TILES = 4  # key tiles of the average sequence a share holds at least
MAX_SHARES = 16
MERGE_ROWS = 4  # rows (token x head) a merge block takes: 4 x 128 elements over 128 threads
MERGE_THREADS = 128
PACK_BLOCK_M = 64  # GQA head packing's tile rows: 16 tokens x 4 query heads


def decode_like(total_q: int, batch: int) -> bool:
    """Whether a paged batch is decode-like (at most DECODE_TOKENS query tokens a sequence on
    average), from shapes only: such a batch splits its keys (kv_shares) and packs the query
    heads of a KV head into one tile (gqa_prefill_steps, pack)."""
    return batch >= 1 and total_q <= DECODE_TOKENS * batch


def kv_shares(total_q: int, batch: int, keys: int, num_sms: int, block_M: int = 128,
              block_N: int = 128, min_tiles: int = MIN_SHARE_TILES,
              pack: bool = False) -> int:  # fmt: skip
    """Key shares an item takes for a paged batch, from shapes only (no host sync): 1 unless the
    batch is decode-like (at most DECODE_TOKENS query tokens a sequence on average); then
    enough items for SHARE_WAVES an SM, but no share shorter than min_tiles key tiles of the
    average sequence, at most MAX_SHARES. keys: the page table's entries x page size (an upper
    bound of the batch's keys). Items (unsplit): 32 heads x (batch + total_q // block_M)
    slots; pack: 8 KV heads x (batch + total_q // (block_M // 4)) slots."""
    if not decode_like(total_q, batch):
        return 1
    if pack:
        items = NUM_KV_HEADS * (batch + total_q // (block_M // GROUP_SIZE))
    else:
        items = NUM_HEADS * (batch + total_q // block_M)
    by_occupancy = math.ceil(SHARE_WAVES * num_sms / items)
    by_length = keys // batch // (min_tiles * block_N)
    return max(1, min(by_occupancy, by_length, MAX_SHARES))


def merge_shares(dtype: str, rows_per_block: int = MERGE_ROWS, threads: int = MERGE_THREADS):
    """The T.prim_func merging the shares: Parts [shares * total_q, 32, 128] and PartLSE
    [shares * total_q, 32] fp32, the split kernel's workspaces (share s's token t at row
    s * total_q + t) -> Output [total_q, 32, 128] (dtype) and LSE [total_q, 32] fp32, the
    definition's. The share count is part_rows // total_q. A block takes rows_per_block rows
    (token x head, token-major: row r is token r // 32, head r % 32).

    Each element (row, column) keeps its row's running max, weight sum and NaN flag itself
    (every thread reads its rows' LSE values, from L1): no per-row vector shared between
    threads, so no layout to agree on and no barrier."""
    total_q = T.dynamic("total_q")
    part_rows = T.dynamic("part_rows")
    rows = total_q * NUM_HEADS
    accum = T.float32
    neg_inf = -T.infinity(accum)
    nan = T.float32(math.nan)

    @T.prim_func
    def main(
        Parts: T.Tensor([part_rows, NUM_HEADS, HEAD_DIM], accum),
        PartLSE: T.Tensor([part_rows, NUM_HEADS], accum),
        Output: T.Tensor([total_q, NUM_HEADS, HEAD_DIM], dtype),
        LSE: T.Tensor([total_q, NUM_HEADS], accum),
    ):
        with T.Kernel(T.ceildiv(rows, rows_per_block), threads=threads) as block:
            shares = part_rows // T.max(total_q, 1)
            top = T.alloc_fragment([rows_per_block, HEAD_DIM], accum)
            total = T.alloc_fragment([rows_per_block, HEAD_DIM], accum)
            poisoned = T.alloc_fragment([rows_per_block, HEAD_DIM], accum)
            acc = T.alloc_fragment([rows_per_block, HEAD_DIM], accum)
            for i, j in T.Parallel(rows_per_block, HEAD_DIM):
                top[i, j] = neg_inf
                total[i, j] = 0.0
                poisoned[i, j] = 0.0
                acc[i, j] = 0.0
            for s in T.serial(shares):
                for i, j in T.Parallel(rows_per_block, HEAD_DIM):
                    row = block * rows_per_block + i
                    if row < rows:
                        share = PartLSE[s * total_q + row // NUM_HEADS, row % NUM_HEADS]
                        # NaN compares false: a NaN share leaves the max alone, sets the flag.
                        top[i, j] = T.if_then_else(share > top[i, j], share, top[i, j])
                        poisoned[i, j] = T.if_then_else(T.isnan(share), 1.0, poisoned[i, j])
            for s in T.serial(shares):
                for i, j in T.Parallel(rows_per_block, HEAD_DIM):
                    row = block * rows_per_block + i
                    if row < rows:
                        token, head = s * total_q + row // NUM_HEADS, row % NUM_HEADS
                        share = PartLSE[token, head]
                        # 0 for a share without keys (and for every share when none saw one).
                        weight = T.if_then_else(
                            (share > neg_inf) & (top[i, j] > neg_inf),
                            T.exp2(share - top[i, j]),
                            0.0,
                        )
                        total[i, j] = total[i, j] + weight
                        acc[i, j] = acc[i, j] + T.if_then_else(
                            weight > 0.0, weight * Parts[token, head, j], 0.0
                        )
            for i, j in T.Parallel(rows_per_block, HEAD_DIM):
                row = block * rows_per_block + i
                if row < rows:
                    saw_key = top[i, j] > neg_inf
                    Output[row // NUM_HEADS, row % NUM_HEADS, j] = T.Cast(
                        dtype,
                        T.if_then_else(
                            poisoned[i, j] > 0.0,
                            nan,
                            T.if_then_else(saw_key, acc[i, j] / total[i, j], 0.0),
                        ),
                    )
                    if j == 0:
                        LSE[row // NUM_HEADS, row % NUM_HEADS] = T.if_then_else(
                            poisoned[i, j] > 0.0,
                            nan,
                            T.if_then_else(saw_key, top[i, j] + T.log2(total[i, j]), neg_inf),
                        )

    return main
