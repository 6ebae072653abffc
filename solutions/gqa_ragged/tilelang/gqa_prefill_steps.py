"""The steps every TileLang GQA prefill program shares, built once per variant (build_steps).

Work split: work items are (query head, query tile of one sequence). The tiles of all sequences
are laid out on one axis without a host sync: sequence s owns the slots
[s + qo_indptr[s] // block_M, s + 1 + qo_indptr[s + 1] // block_M), at least
ceil(seq_q / block_M) of them and at most one more, so there are batch + total_q // block_M
slots and an item finds its sequence by a binary search over qo_indptr. A padding grid
(cdiv(total_q, block_M) tiles x batch) would instead launch batch times too many blocks, each
holding a full block's shared memory just to exit.

Malformed batches: the indptr values are read on the GPU only. The batch is valid when both
arrays run non-decreasing from 0 to their row counts (total_q, kv_rows: key rows, or page-table
entries for a paged cache) and, paged with page size 64, every sequence with pages has a
last-page length in [1, 64]; every block tests that once, and in a valid batch nothing else
changes. Otherwise sequence s is well-formed when, in both arrays, 0 <= a[s] <= a[s + 1] <=
rows, no earlier entry exceeds a[s] and no later one is below a[s + 1] (and its last-page
length is in range): its rows are computed as usual (the search still finds its slots, and no two
well-formed sequences share a row), no other tile computes anything, and each item also writes
NaN into the rows of its slot's row range [slot * block_M, (slot + 1) * block_M) that no
well-formed sequence covers, output and lse of its head. The slots' ranges cover every row, and
nothing reads or writes outside the tensors (TMA loads are bounded, stores fall in well-formed
sequences' rows or in [0, total_q)).
"""

import math
from types import SimpleNamespace

import tilelang.language as T
from tilelang import tvm

from .gqa_prefill_fp8 import bf16_over_fp8
from .gqa_prefill_kv import ASYNC_COPY, build_kv
from .gqa_prefill_shapes import GROUP_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, token_rows

__all__ = ["GROUP_SIZE", "HEAD_DIM", "NUM_HEADS", "NUM_KV_HEADS", "build_steps", "token_rows"]

LOG2_E = 1.0 / math.log(2.0)
MAX_BATCH_BITS = 31  # binary search depth: any int32 batch size (idle steps cost a compare)
# Item sections for long paged sequences (build_steps' DrawItem): from this many keys a
# sequence on average, sections of this many query heads.
SECTION_MIN_KEYS = 8192
SECTION_HEADS = 8  # 2 KV heads: 4 sections

# A work item is a local int32 array `tile`; Locate fills its first TILE_FIELDS entries.
Q_START = 0  # the sequence's first query row
SEQ_Q = 1  # its query rows
KV_START = 2  # its first key row
SEQ_KV = 3  # its key rows
Q_TILE = 4  # the tile's first query row, relative to Q_START
HEAD = 5  # the query head
TILE_FIELDS = 6
# The warp-specialized program hands items on with two more entries (ITEM_FIELDS in all):
HAS_ITEM = 6  # 1: an item, 0: the block is done
POISON_SLOT = 7  # in a malformed batch the slot whose rows the item poisons, else -1
ITEM_FIELDS = 8
# Split-KV variants (split=True) give an item two more (SPLIT_FIELDS in all). After
# POISON_SLOT: with the share fields before it (one read-back loop) TileLang's sync planner
# failed on the FP8 split program ("a required shared-memory sync inside a divergent region").
SHARE = 8  # the item's key share, 0 .. shares - 1
SHARE_TILES = 9  # the share's key tiles: bounds caps the item's loop there
SPLIT_FIELDS = 10


def build_steps(
    dtype: str,
    causal: bool,
    block_M: int,
    block_N: int,
    page_size: int = None,
    window: bool = False,
    cache_dtype: str = None,
    split: bool = False,
    pack: bool = False,
    fp8_split_q: bool = False,
    fp8_f16_pv: bool = False,
    long_keys: bool = False,
) -> SimpleNamespace:
    """The symbolic lengths, strides and constants of one variant and the steps (T.macro and
    plain helpers) its programs are written in, for K/V in a ragged batch (page_size None) or
    a paged cache (page_size 64 or 1): kv, the K/V source (gqa_prefill_kv), gives the kernel's
    arguments and the K/V loads. See gqa_prefill_kernel.gqa_prefill for the arguments. Each
    program unpacks what it uses under the same names.

    window (causal, ragged): a sliding window, the kernel's scalar argument window_left in
    [0, kv_rows) (the entry routes -1 and longer windows to the causal kernel). Row i of a tile
    sees key j iff q_pos0 + i - window_left <= j <= q_pos0 + i (and j < seq_kv). An item skips
    the key tiles left of its band (SkipToBand: its keys then start at the band's first tile, so
    the loops, loads, bounds and schedule see the band alone) and masks only the band's edges:
    the tiles below left_end (some row's band starts inside or past them) and the diagonal
    ones, as causal; the tiles between run unmasked.

    cache_dtype (page size 64): FP8 caches (gqa_prefill_fp8.FP8_E4M3), the kernel's v_scale
    scaling the output in the epilogue. fp8_split_q (FP8 caches, bfloat16 q; ignored
    elsewhere: gqa_prefill_fp8.bf16_over_fp8): Q K^T in e4m3 on the cache's K, Q split in two
    e4m3 terms by the consumers, a per-row softmax scale. fp8_f16_pv (the same programs): V's
    ring and P in float16 (kv.v_ring_dtype).

    split (causal, paged): split-KV. Output and LSE are fp32 workspaces of shares * total_q
    rows (the symbolic out_rows; share s writes rows s * total_q ...), each share's normalised
    output and base-2 LSE, for gqa_prefill_split's merge. A work item is (slot, share, head):
    each (slot, head) of the unsplit kernel becomes `shares` items, share s taking key tiles
    [s * n // shares, (s + 1) * n // shares) of the n its tile visits (ClipToShare).

    pack (causal, paged; decode-like batches: gqa_prefill_pack): GQA head packing. A work item
    is (slot, KV head) (split: (slot, share, KV head)) and its tile's block_M rows are
    (token, query head) pairs of block_M // 4 tokens: row i is token i // 4 of the tile and
    query head 4 * kv_head + i % 4, so the 4 query heads of a KV head go through its key tiles
    together. The slots count tokens in blocks of block_M // 4 (tokens, below), HEAD holds the
    KV head, the masks take row i's position q_pos0 + i // 4, and the epilogue stores from
    registers (Q is gathered: GatherQ).
    """
    assert not window or (causal and page_size is None), "a window is causal, over ragged K/V"
    assert not split or (causal and page_size is not None), "split-KV: causal, paged K/V"
    assert not pack or (causal and page_size is not None), "head packing: causal, paged K/V"
    # Query tokens a tile holds (pack: block_M // 4 tokens x 4 query heads), and the items a
    # (slot, share) makes: one per query head, or per KV head.
    tokens = block_M // GROUP_SIZE if pack else block_M
    item_heads = NUM_KV_HEADS if pack else NUM_HEADS
    total_q = T.dynamic("total_q")
    len_indptr = T.dynamic("len_indptr")
    q_stride = T.dynamic("q_stride")  # in elements
    batch = len_indptr - 1
    num_slots = batch + total_q // tokens
    accum_dtype = T.float32
    # Split: the workspaces' rows, shares * total_q (the entry launches only with total_q >= 1).
    out_rows = T.dynamic("out_rows") if split else total_q
    shares = out_rows // T.max(total_q, 1) if split else 1
    dims = SimpleNamespace(
        dtype=dtype, block_N=block_N, accum_dtype=accum_dtype, total_q=total_q,
        q_stride=q_stride, len_indptr=len_indptr, out_rows=out_rows,
        out_dtype=accum_dtype if split else dtype,
    )  # fmt: skip
    fp8_knobs_apply = bf16_over_fp8(dtype, cache_dtype)
    split_q, f16_pv = fp8_split_q and fp8_knobs_apply, fp8_f16_pv and fp8_knobs_apply
    kv_source = build_kv(page_size, dims, cache_dtype, split_q, f16_pv)
    neg_inf = -T.infinity(accum_dtype)
    nan = T.float32(math.nan)

    def slot_of(item):
        """The slot of work item `item`: the last slots (under causal the heaviest tiles) first,
        the 32 heads of a slot side by side (4 of them on each KV tile they load: L2). Under a
        window an item's work is its band (loop_range counts the band's key tiles), which grows
        along a sequence's tiles up to the window's width: still heaviest first within each
        sequence, the light tiles (band cut by key 0) last. Split: a slot's shares side by
        side, the 32 heads of a share side by side within them."""
        if split:
            return num_slots - 1 - item // (item_heads * shares)
        return num_slots - 1 - item // item_heads

    # Long sequences: one KV head's K/V is 512 bytes a key (K and V, 16-bit), so at 16K keys a
    # sequence's 8 KV heads are 64 MB, past the L2's 50 MB, and items of all 32 heads in flight
    # read it from DRAM again at every wave. Where a paged batch's keys average
    # SECTION_MIN_KEYS or more (measured from 8K on: +1-4%; shorter batches lost up to 10%), the
    # items are drawn in sections of SECTION_HEADS query heads (2 KV heads), every slot of a
    # section before the next (TUNING.md, "Items in L2 sections for long paged sequences").
    # The paged programs decide per launch (from kv_rows); the contiguous ones spilled the
    # loader warp's 24 registers doing so, so there the entry picks a program that always draws
    # in sections (long_keys) for launches of long sequences. Not for split or packed items
    # (decode-like: each KV tile is read once anyway), nor under a window (its band is short).
    sectioned = (page_size is not None or long_keys) and not (split or pack or window)

    def long_launch(kv):
        """Whether a launch draws in sections: True in a long_keys program (the entry chose it,
        tilelang_prefill.long_keys_launch), else whether kv_rows (page slots) average
        SECTION_MIN_KEYS a sequence. Plain Python on purpose: inside a T.macro `page_size or 1`
        evaluated to True (1), which left page size 64 unsectioned until 2026-11-30 (28)."""
        if long_keys:
            return True
        return kv_source.kv_rows(kv) // max(SECTION_MIN_KEYS // (page_size or 1), 1) >= batch

    @T.macro
    def DrawItem(count, kv):
        """count[0] becomes the work item drawn count[0]-th (the scheduler's count, or the
        block): itself, or for long sequences the item of the count-th (section, slot, head),
        each section's slots the last first and its heads side by side. At most 4 sections,
        counted by comparisons, before the item is located (a division, or the sections'
        numbers kept through Locate's search, spilled the loader warp's registers). A bijection
        of [0, num_items) that leaves counts past it past it (the block's last draw)."""
        if long_launch(kv):
            run = count[0] // SECTION_HEADS  # the runs of SECTION_HEADS heads
            sections = range(1, NUM_HEADS // SECTION_HEADS)
            section = sum(T.if_then_else(run >= k * num_slots, 1, 0) for k in sections)
            count[0] = (
                (run - section * num_slots) * item_heads + section * SECTION_HEADS
                + count[0] % SECTION_HEADS
            )  # fmt: skip

    def bounds(tile, share_clipped=True):
        """(q_pos0, full_end, loop_range): row i sees keys j < seq_kv and, if causal,
        j <= q_pos0 + i; tiles below full_end // block_N are fully visible; loop_range tiles are
        visited, at least one even when no row sees a key (its mask then hides every key).
        Split: at most the share's SHARE_TILES (share_clipped False: before ClipToShare)."""
        seq_kv = tile[SEQ_KV]
        q_pos0 = tile[Q_TILE] + seq_kv - tile[SEQ_Q]
        if causal:
            kv_stop = T.max(T.min(seq_kv, q_pos0 + tokens), 0)
            full_end = T.min(seq_kv, q_pos0 + 1)
        else:
            kv_stop = seq_kv
            full_end = seq_kv
        loop_range = T.max(T.ceildiv(kv_stop, block_N), 1)
        if split and share_clipped:
            loop_range = T.min(loop_range, tile[SHARE_TILES])
        return q_pos0, full_end, loop_range

    @T.macro
    def Search(first, target, seq):
        """seq[0] = the last s in [0, batch) with first(s) <= target (0 if none): a binary
        search that also steers right around a well-formed sequence of a malformed batch."""
        seq[0] = 0
        for bit in T.unroll(MAX_BATCH_BITS):
            probe = seq[0] + (1 << (MAX_BATCH_BITS - 1 - bit))
            if probe < batch:
                if first(probe) <= target:
                    seq[0] = probe

    @T.macro
    def Find(slot, qo_indptr, seq):
        """seq[0] = the sequence that owns slot `slot`."""
        Search(lambda s: s + qo_indptr[s] // tokens, slot, seq)

    @T.macro
    def SkipToBand(tile, window_left):
        """Window: the item's keys start at the key tile that holds its first row's first
        visible key (no row of the tile sees a key before it): KV_START and SEQ_KV move by
        whole key tiles, so q_pos0 (bounds) moves with them and the masks hold as they are."""
        skip = (
            T.max(tile[Q_TILE] + tile[SEQ_KV] - tile[SEQ_Q] - window_left, 0) // block_N * block_N
        )
        tile[KV_START] = tile[KV_START] + skip
        tile[SEQ_KV] = tile[SEQ_KV] - skip

    keys_per_entry = page_size or 1  # of kv_indptr's entries: a key row, or a page

    @T.macro
    def ClipToShare(tile, share):
        """Split: the item's keys cut to its share of the n key tiles its tile visits, as
        SkipToBand cuts them to a band: KV_START and SEQ_KV move by whole tiles (whole pages),
        so q_pos0 (bounds) and the masks hold as they are, and SHARE_TILES caps the loop. An
        empty share (n < shares) keeps no key (SEQ_KV 0): its one masked tile writes output 0
        and lse -inf, which the merge weighs 0."""
        _, _, n = bounds(tile, share_clipped=False)
        first = share * n // shares
        stop = (share + 1) * n // shares
        tile[SHARE] = share
        if stop > first:
            skip = first * block_N
            tile[KV_START] = tile[KV_START] + skip // keys_per_entry
            tile[SEQ_KV] = tile[SEQ_KV] - skip
            tile[SHARE_TILES] = stop - first
        else:
            tile[SEQ_KV] = 0
            tile[SHARE_TILES] = 1

    @T.macro
    def Locate(item, qo_indptr, kv, seq, tile, window_left=None):
        """tile[Q_START:TILE_FIELDS] = the fields of work item `item` (Q_START ...).
        kv: the K/V source's arguments; seq: scratch for the search over indptr; window_left:
        the window variant's argument (its item covers the band's key tiles only)."""
        slot = slot_of(item)
        Find(slot, qo_indptr, seq)
        tile[Q_START] = qo_indptr[seq[0]]
        tile[SEQ_Q] = qo_indptr[seq[0] + 1] - tile[Q_START]
        tile[KV_START] = kv_source.kv_indptr(kv)[seq[0]]
        tile[SEQ_KV] = kv_source.seq_kv(kv, seq[0], tile[KV_START])
        # the tile's first query row
        tile[Q_TILE] = (slot - seq[0] - tile[Q_START] // tokens) * tokens
        tile[HEAD] = item % item_heads  # pack: the KV head
        if window:
            SkipToBand(tile, window_left)
        if split:
            ClipToShare(tile, item // item_heads % shares)

    # Malformed batches (indptr values that are not a partition: see the module docstring).
    # indptr = (qo_indptr, kv_indptr, kv_rows, kv), kv_rows the entries kv_indptr runs to and kv
    # the K/V source's arguments (a paged cache adds its rules); each Check gives one lane's
    # share of a test in
    # ok[0] (the lanes AND them together). Lane `lane` of `lanes` takes the indices i = lane
    # (mod lanes): T.serial(lane, stop, lanes) would do, but TileLang drops its bound when the
    # trip count can only be 0 or 1.

    def entry_bad(indptr, i):
        """Entry i (< batch) breaks the batch's rules: an array decreases past it, or the K/V
        source's own rule."""
        qo_indptr, kv_indptr, _, kv = indptr
        bad = (qo_indptr[i] > qo_indptr[i + 1]) | (kv_indptr[i] > kv_indptr[i + 1])
        extra = kv_source.entry_bad(kv, i)
        return bad if extra is None else bad | extra

    def range_ok(indptr, s):
        """Sequence s's ranges lie in [0, rows] and run forward (and the K/V source's rule)."""
        qo_indptr, kv_indptr, kv_rows, kv = indptr
        ok = (
            (0 <= qo_indptr[s]) & (qo_indptr[s] <= qo_indptr[s + 1])
            & (qo_indptr[s + 1] <= total_q) & (0 <= kv_indptr[s])
            & (kv_indptr[s] <= kv_indptr[s + 1]) & (kv_indptr[s + 1] <= kv_rows)
        )  # fmt: skip
        extra = kv_source.sequence_ok(kv, s)
        return ok if extra is None else ok & extra

    @T.macro
    def CheckBatch(indptr, lane, lanes, ok):
        """Whether the batch is valid: both arrays non-decreasing, from 0 to total_q and
        kv_rows (and the K/V source's rules)."""
        qo_indptr, kv_indptr, kv_rows = indptr[0], indptr[1], indptr[2]
        ok[0] = T.if_then_else(
            (qo_indptr[0] == 0) & (qo_indptr[batch] == total_q) & (kv_indptr[0] == 0)
            & (kv_indptr[batch] == kv_rows), 1, 0,
        )  # fmt: skip
        for k in T.serial(T.ceildiv(batch, lanes)):
            i = k * lanes + lane
            if i < batch:
                if entry_bad(indptr, i):
                    ok[0] = 0

    @T.macro
    def CheckSequence(indptr, s, lane, lanes, ok):
        """Whether sequence s is well-formed: in both arrays its range lies in [0, rows] and
        runs forward, no earlier entry exceeds its start and no later entry is below its end."""
        qo_indptr, kv_indptr = indptr[0], indptr[1]
        ok[0] = T.if_then_else(range_ok(indptr, s), 1, 0)
        for k in T.serial(T.ceildiv(batch + 1, lanes)):
            i = k * lanes + lane
            if i <= batch:
                early = (i < s) & ((qo_indptr[i] > qo_indptr[s]) | (kv_indptr[i] > kv_indptr[s]))
                late = (i > s + 1) & (
                    (qo_indptr[i] < qo_indptr[s + 1]) | (kv_indptr[i] < kv_indptr[s + 1])
                )
                if early | late:
                    ok[0] = 0

    @T.macro
    def CheckTile(slot, indptr, seq, lane, lanes, ok, all_lanes):
        """In a malformed batch only: ok[0] = whether the tile of slot `slot` is computed, that is
        the sequence Locate finds for the slot is well-formed and owns it (a sequence 0 that
        starts past row block_M is also the search's answer for the slots before it); all_lanes
        ANDs the lanes' shares. seq: scratch."""
        Find(slot, indptr[0], seq)
        CheckSequence(indptr, seq[0], lane, lanes, ok)
        first_slot = seq[0] + indptr[0][seq[0]] // tokens
        ok[0] = T.if_then_else((all_lanes(ok[0]) != 0) & (slot >= first_slot), 1, 0)

    @T.macro
    def Poison(indptr, Output, LSE, slot, head, lane, lanes, seq, ok, out_row0=None):
        """NaN into the rows [slot * tokens, (slot + 1) * tokens) of `head` (pack: of the KV
        head's 4 query heads) that no well-formed sequence covers (this lane's share of the
        rows). The slots' rows cover [0, total_q), and a well-formed sequence's rows are
        written by its own tiles alone. out_row0 (split): the item's share's first row in the
        workspaces."""
        qo_indptr = indptr[0]
        for k in T.serial(T.ceildiv(tokens, lanes)):
            row = slot * tokens + k * lanes + lane
            if (k * lanes + lane < tokens) & (row < total_q):
                # The last t with qo_indptr[t] <= row: the sequence that covers the row if a
                # well-formed one does (it steers the search as in Locate).
                Search(lambda t: qo_indptr[t], row, seq)
                CheckSequence(indptr, seq[0], 0, 1, ok)
                if (ok[0] == 0) | (row >= qo_indptr[seq[0] + 1]) | (row < qo_indptr[seq[0]]):
                    out_row = row if out_row0 is None else out_row0 + row
                    if pack:
                        for h in T.serial(GROUP_SIZE):
                            for j in T.vectorized(HEAD_DIM):
                                Output[out_row, head * GROUP_SIZE + h, j] = T.Cast(
                                    Output.dtype, nan
                                )
                            LSE[out_row, head * GROUP_SIZE + h] = nan
                    else:
                        for j in T.vectorized(HEAD_DIM):
                            Output[out_row, head, j] = T.Cast(Output.dtype, nan)
                        LSE[out_row, head] = nan

    def token_of(row):
        """The token of a tile's row, relative to the tile's first (pack: row // 4)."""
        return row // GROUP_SIZE if pack else row

    def head_of(head, row):
        """The query head of a tile's row of item head `head` (pack: a KV head)."""
        return head * GROUP_SIZE + row % GROUP_SIZE if pack else head

    def kv_head_of(head):
        """The KV head of item head `head`."""
        return head if pack else head // GROUP_SIZE

    @T.macro
    def GatherQ(Q, Q_shared, token0, kv_head, threads, copy_async):
        """Pack: the tile's Q rows (token token0 + i // 4, query head 4 * kv_head + i % 4:
        per token the group's 4 heads are 4 x 128 contiguous elements) into Q_shared by
        `threads` threads, 16 bytes each; rows past total_q zero (not read). Rows past the
        sequence read the next sequence's Q, as the unpacked TMA box does: finite, and never
        stored. copy_async (the producer warp): cp.async, in flight when it returns, 16 threads a
        row and a pass's rows one token (the token's index clamped in 32 bits, before the 64-bit
        offset, as gqa_prefill_kv's GatherHeldRows)."""
        rows = threads * 8 // HEAD_DIM
        # The entry sees to these (a TMA descriptor's 16-byte strides; it launches with rows):
        # 16-byte rows for cp.async, and a clamped row index in bounds.
        T.assume(q_stride % 8 == 0)
        T.assume(total_q >= 1)
        if copy_async:
            assert GROUP_SIZE % rows == 0, "a pass's rows: heads of one token"
            row = T.alloc_local([1], T.int32)  # the pass's token, clamped into Q
            # Pinned: left to layout inference, the loop got a thread a column (scalar copies).
            layout = T.Fragment(
                [rows, HEAD_DIM],
                forward_thread_fn=lambda r, c: r * (HEAD_DIM // 8) + c // 8,
                forward_index_fn=lambda r, c: c % 8,
            )
            for i in T.unroll(block_M // rows, annotations={"pragma_unroll_factor": 1}):
                row[0] = T.max(T.min(token0 + token_of(i * rows), total_q - 1), 0)
                for r, c in T.Parallel(
                    rows, HEAD_DIM, loop_layout=layout, annotations=ASYNC_COPY
                ):  # fmt: skip
                    # Indices TileLang sees in bounds (KV head mod 8, row clamped): it then adds
                    # no test of its own, which would keep the copy from cp.async.
                    Q_shared[i * rows + r, c] = T.if_then_else(
                        token0 + token_of(i * rows) < total_q,
                        Q[row[0], head_of(kv_head % NUM_KV_HEADS, i * rows + r), c],
                        T.Cast(dtype, 0),
                    )
        else:
            for r, c in T.Parallel(block_M, HEAD_DIM):
                Q_shared[r, c] = T.if_then_else(
                    token0 + token_of(r) < total_q,
                    Q[T.min(token0 + token_of(r), total_q - 1), head_of(kv_head, r), c],
                    T.Cast(dtype, 0),
                )

    def position(q_pos0, window_left):
        """What the masks take for the rows' visible keys (pos): q_pos0, or with a window
        (q_pos0, q_pos0 - window_left: the first key row 0 sees)."""
        return (q_pos0, q_pos0 - window_left) if window else q_pos0

    def left_end(pos):
        """Window: the tiles k < left_end(pos) hold a key left of some row's band (its left
        edge), the last row's first key q_pos0 + block_M - 1 - window_left past their start."""
        return T.ceildiv(T.max(pos[1] + block_M - 1, 0), block_N)

    @T.macro
    def MaskTile(acc_s, k, seq_kv, q_pos0):
        """The keys a row of KV tile k may not see set to -inf (q_pos0: position's pos)."""
        # Masking after the GEMM, not by pre-filling the accumulator, overwrites whatever the
        # rows past the sequence's keys gave (the next sequence's keys, TMA's zero fill).
        for i, j in T.Parallel(block_M, block_N):
            key = k * block_N + j
            if window:
                acc_s[i, j] = T.if_then_else(
                    (key < seq_kv) & (key <= q_pos0[0] + i) & (key >= q_pos0[1] + i),
                    acc_s[i, j],
                    neg_inf,
                )
            elif causal:
                acc_s[i, j] = T.if_then_else(
                    (key < seq_kv) & (key <= q_pos0 + token_of(i)), acc_s[i, j], neg_inf
                )
            else:
                acc_s[i, j] = T.if_then_else(key < seq_kv, acc_s[i, j], neg_inf)

    @T.macro
    def Mask(acc_s, k, seq_kv, full_end, q_pos0):
        """MaskTile, for the tiles that reach past full_end only (window: or below left_end)."""
        if window:
            if ((k + 1) * block_N > full_end) | (k < left_end(q_pos0)):
                MaskTile(acc_s, k, seq_kv, q_pos0)
        else:
            if (k + 1) * block_N > full_end:
                MaskTile(acc_s, k, seq_kv, q_pos0)

    @T.macro
    def MMA0(
        kv, Q_shared, K_shared, acc_s, k, kv_start, kv_head, seq_kv, full_end, q_pos0, scratch
    ):
        """acc_s = Q K^T of KV tile k, the keys a row may not see set to -inf. scratch: the K/V
        source's alloc_scratch."""
        kv_source.CopyK(kv, K_shared, k, kv_start, seq_kv, kv_head, scratch)
        T.gemm(
            Q_shared,
            K_shared,
            acc_s,
            transpose_B=True,
            clear_accum=True,
            policy=T.GemmWarpPolicy.FullRow,
        )
        Mask(acc_s, k, seq_kv, full_end, q_pos0)

    def row_scale(scale_log2, i):
        """Row i's scale: scale_log2 itself, or its row's entry (a per-row fragment: FP8's
        split Q, each row scaled by its own power of two)."""
        return scale_log2[i] if isinstance(scale_log2, tvm.tirx.Buffer) else scale_log2

    @T.macro
    def Softmax(
        acc_s,
        scores_max,
        scores_max_prev,
        max_scaled,
        scores_scale,
        scores_sum,
        logsum,
        scale_log2,
    ):
        """Online softmax in base 2: scale * log2(e) folded into one FMA per logit (scale_log2:
        a scalar, or a fragment of one per row: row_scale)."""
        T.copy(scores_max, scores_max_prev)
        T.fill(scores_max, neg_inf)
        T.reduce_max(acc_s, scores_max, dim=1, clear=False)
        for i in T.Parallel(block_M):
            scores_max[i] = T.max(scores_max[i], scores_max_prev[i])
            # A row with no visible key so far has max -inf: subtract 0 instead, so that
            # exp2(-inf - -inf) = NaN never happens and its weights stay 0.
            max_scaled[i] = T.if_then_else(
                scores_max[i] == neg_inf, 0.0, scores_max[i] * row_scale(scale_log2, i)
            )
            scores_scale[i] = T.exp2(scores_max_prev[i] * row_scale(scale_log2, i) - max_scaled[i])
        for i, j in T.Parallel(block_M, block_N):
            acc_s[i, j] = T.exp2(acc_s[i, j] * row_scale(scale_log2, i) - max_scaled[i])
        T.reduce_sum(acc_s, scores_sum, dim=1)
        for i in T.Parallel(block_M):
            logsum[i] = logsum[i] * scores_scale[i] + scores_sum[i]

    @T.macro
    def Rescale(acc_o, scores_scale):
        """acc_o rows times scores_scale: the running max moved, or the final 1 / logsum."""
        for i, j in T.Parallel(block_M, HEAD_DIM):
            acc_o[i, j] *= scores_scale[i]

    @T.macro
    def MMA1(kv, V_shared, acc_s_cast, acc_o, k, kv_start, kv_head, seq_kv, scratch):
        """acc_o += P V of KV tile k."""
        kv_source.CopyV(kv, V_shared, k, kv_start, seq_kv, kv_head, scratch)
        T.gemm(acc_s_cast, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)

    def scaled(out_scale, logsum):
        """The output's factor for a row's logsum: 1 / logsum, or out_scale / logsum."""
        return 1.0 / logsum if out_scale is None else out_scale / logsum

    def poison(poisoned, value):
        return value if poisoned is None else T.if_then_else(poisoned(), nan, value)

    @T.macro
    def Epilogue(
        acc_o, logsum, max_scaled, scores_scale, lse, O_shared, Output, LSE, q_start, q_tile,
        seq_q, head, poisoned, out_scale=None,
    ):  # fmt: skip
        """acc_o / logsum to Output through O_shared, and the base-2 LSE, for the tile's rows.
        A row that saw no key has logsum 0: output 0 and lse -inf, never 0/0 or log2(0); a
        row whose logsum is NaN (a NaN key: page size 1's gathered bad page) gets NaN for both
        (!= 0, not > 0). poisoned (None: never): a function giving a test whether the item met
        a bad page id; then every row gets NaN output and lse. out_scale (None: 1): the
        output's factor (FP8 caches' v_scale), lse unchanged. Split: q_start is the share's
        row in the workspaces, and O_shared None (fp32 from registers)."""
        for i in T.Parallel(block_M):
            lse[i] = poison(
                poisoned,
                T.if_then_else(logsum[i] != 0, T.log2(logsum[i]) + max_scaled[i], neg_inf),
            )
            scores_scale[i] = poison(
                poisoned, T.if_then_else(logsum[i] != 0, scaled(out_scale, logsum[i]), 0.0)
            )
        Rescale(acc_o, scores_scale)
        if O_shared is None:  # from registers
            for i, j in T.Parallel(block_M, HEAD_DIM):
                if q_tile + token_of(i) < seq_q:
                    Output[q_start + q_tile + token_of(i), head_of(head, i), j] = T.Cast(
                        Output.dtype, acc_o[i, j]
                    )
        else:
            T.copy(acc_o, O_shared)
            # Rows past the sequence's end belong to the next sequence (or to no one): skip.
            for i, j in T.Parallel(block_M, HEAD_DIM):
                if q_tile + i < seq_q:
                    Output[q_start + q_tile + i, head, j] = O_shared[i, j]
        for i in T.Parallel(block_M):
            if q_tile + token_of(i) < seq_q:
                LSE[q_start + q_tile + token_of(i), head_of(head, i)] = lse[i]

    def out_row0(share):
        """Split: the first workspace row of share `share` (None unsplit: the output's rows)."""
        return share * total_q if split else None

    def kernel(body):
        """The prim_func: the K/V source's; a window variant's, the ragged one's arguments with
        window_left before sm_scale (its body takes window_left last)."""
        if not window:
            return kv_source.kernel(body)
        total_kv = T.dynamic("total_kv")
        k_stride, v_stride = T.dynamic("k_stride"), T.dynamic("v_stride")  # in elements

        @T.prim_func
        def main(
            Q: token_rows(total_q, NUM_HEADS, q_stride, dtype),
            K: token_rows(total_kv, NUM_KV_HEADS, k_stride, dtype),
            V: token_rows(total_kv, NUM_KV_HEADS, v_stride, dtype),
            qo_indptr: T.Tensor([len_indptr], T.int32),
            kv_indptr: T.Tensor([len_indptr], T.int32),
            kv_rows: T.int32,
            window_left: T.int32,
            sm_scale: T.float32,
            Output: T.Tensor([total_q, NUM_HEADS, HEAD_DIM], dtype),
            LSE: T.Tensor([total_q, NUM_HEADS], accum_dtype),
            Scheduler: T.Tensor([2], T.int32),
        ):
            kv = (K, V, kv_indptr, kv_rows)
            body(Q, kv, qo_indptr, sm_scale, Output, LSE, Scheduler, window_left)

        return main

    return SimpleNamespace(
        dtype=dtype, causal=causal, window=window, block_M=block_M, block_N=block_N,
        pack=pack, tokens=tokens, item_heads=item_heads, kv_head_of=kv_head_of,
        split_q=split_q,
        GatherQ=GatherQ,
        kv=kv_source, kernel=kernel, position=position, left_end=left_end, split=split,
        shares=shares, item_fields=SPLIT_FIELDS if split else ITEM_FIELDS, out_row0=out_row0,
        split_fields=(SHARE, SHARE_TILES) if split else (),
        tile_fields=SPLIT_FIELDS if split else TILE_FIELDS,
        total_q=total_q, len_indptr=len_indptr, q_stride=q_stride, batch=batch,
        num_slots=num_slots, accum_dtype=accum_dtype, neg_inf=neg_inf, slot_of=slot_of,
        sectioned=sectioned, DrawItem=DrawItem,
        Locate=Locate,
        CheckBatch=CheckBatch, CheckSequence=CheckSequence, CheckTile=CheckTile, Poison=Poison,
        bounds=bounds, Mask=Mask,
        MaskTile=MaskTile, MMA0=MMA0, Softmax=Softmax, Rescale=Rescale, MMA1=MMA1,
        Epilogue=Epilogue,
    )  # fmt: skip
