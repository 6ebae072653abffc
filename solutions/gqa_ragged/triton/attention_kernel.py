"""FlashAttention-2 forward for GQA prefill in Triton: one kernel for padded and ragged batches.

A program owns one query tile of one sequence for HEADS_PER_TILE query heads of one KV group:
its rows are (token, head) pairs, token-major, so with HEADS_PER_TILE = 4 the group's four heads
share every K/V tile that the program loads, and a short sequence still fills the rows of a
tl.dot. A tile is one row block of BLOCK_M rows, or on large shapes two, paired so that one's
softmax runs while the tensor cores do the other's P V. The Q tile is loaded once; K/V tiles
stream through an online softmax kept in fp32 with exp2 (the softmax scale times log2(e) is
folded into one multiply) and the accumulator is normalised once at the end. Causal masking is
bottom-right aligned (query i sees key j iff j <= i + seq_kv - seq_q): KV tiles past the tile's
last visible key are never visited, tiles that every row sees fully run without a mask, and only
the tiles on the diagonal pay for one.

Padded batch: lengths are the runtime ints seq_q / seq_kv, sequence s starts at row s * seq_q.
Ragged batch: lengths come from qo_indptr / kv_indptr, read in the kernel (no host sync).
K/V are loaded by a policy, PAGE_SIZE: 0 reads them contiguous (padded and ragged batches), a
page size reads them through the page table of a paged cache (paged_kv.py); everything else is
one code path. A paged cache may be FP8 (e4m3): tiles are converted to q's dtype on load, its
k_scale is folded into qk_scale and its v_scale multiplies the output. The K/V tile loops live
in kv_loops.py.
"""

import triton
import triton.language as tl

from .kv_loops import attend_kv_tiles, attend_kv_tiles_paired, band_start, round_to, split_q_fp8
from .paged_kv import first_key_on_bad_page, poison_rows, sequence_keys
from .ragged_batch import find_sequence, is_partition, poison_uncovered_rows, well_formed


@triton.jit
def _opaque(x, INTERPRETED: tl.constexpr):
    """int32 x through a PTX mov the compiler cannot see through: what is computed from it is
    computed where it is used, not shared with an identical expression computed earlier."""
    if INTERPRETED:
        return x
    return tl.inline_asm_elementwise(
        "mov.b32 $0, $1;", "=r,r", [x], dtype=tl.int32, is_pure=False, pack=1
    )


@triton.jit
def _store_rows(
    acc,
    m_i,
    l_i,
    out,
    lse,
    row0,
    tokens_left,
    first_head,
    v_scale,
    BLOCK_M: tl.constexpr,
    HEADS_PER_TILE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Normalise a row block once and write its rows (and their LSE): BLOCK_M rows of
    HEADS_PER_TILE heads from first_head on, tokens from flat row row0 on, of which the first
    tokens_left lie inside the sequence. v_scale (FP8 caches, else None): V's scale, which
    multiplies the output (the LSE does not see it).

    The addresses are computed here from an opaque first_head: otherwise the compiler reuses
    the Q tile's load addresses, and keeps them in registers through the K/V loops.
    """
    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_token = rows // HEADS_PER_TILE
    row_head = _opaque(first_head, INTERPRETED) + rows % HEADS_PER_TILE
    row_in_seq = row_token < tokens_left
    # A row that saw no key has acc = 0 and l_i = 0: divide by 1 so that it writes 0, not NaN.
    # (!= 0, not > 0: a NaN key (a bad page id, gathered) makes l_i NaN, and the lse too.)
    saw_key = l_i != 0.0
    if v_scale is None:
        acc = acc / tl.where(saw_key, l_i, 1.0)[:, None]
    else:  # v_scale joins the row's divisor: one divide a row
        acc = acc * (v_scale / tl.where(saw_key, l_i, 1.0))[:, None]
    offsets = (row0 + row_token)[:, None] * (NUM_HEADS * HEAD_DIM) + row_head[:, None] * HEAD_DIM
    tl.store(
        out + offsets + dims[None, :],
        round_to(acc, out.dtype.element_ty, INTERPRETED),
        mask=row_in_seq[:, None],
    )
    if WRITE_LSE:
        # log2(sum_j exp(sm_scale * q.k_j)) = m_i + log2(l_i); log of an empty sum is -inf.
        row_lse = tl.where(saw_key, m_i + tl.math.log2(tl.where(saw_key, l_i, 1.0)), float("-inf"))
        tl.store(lse + (row0 + row_token) * NUM_HEADS + row_head, row_lse, mask=row_in_seq)


@triton.jit(do_not_specialize=["num_seqs", "seq_q", "seq_kv", "num_pages", "window_left"])
def gqa_prefill_fwd(
    q,  # [tokens, NUM_HEADS, HEAD_DIM], tokens Q_TOKEN_STRIDE apart (a padded batch flattened)
    k,  # [kv tokens, NUM_KV_HEADS, HEAD_DIM], tokens K_TOKEN_STRIDE apart; v likewise
    v,  # (paged: [num_pages, PAGE_SIZE, NUM_KV_HEADS, HEAD_DIM], pages *_PAGE_STRIDE apart;
    # q's dtype, or FP8 e4m3 with v_scale given)
    out,  # [tokens, NUM_HEADS, HEAD_DIM], contiguous
    lse,  # [tokens, NUM_HEADS] fp32, base-2; only read when WRITE_LSE
    qo_indptr,  # [num_seqs + 1] int32; only read when RAGGED
    kv_indptr,  # (paged: offsets into kv_indices)
    kv_indices,  # paged only (else None): [seq_kv] int32 page ids
    kv_last_page_len,  # paged only, None for page size 1: [num_seqs] int32
    num_seqs,
    seq_q,  # padded: rows per sequence; ragged: total_q and total_kv, the rows of q and k
    seq_kv,  # (paged: the length of kv_indices)
    num_pages,  # paged only (else None): pages in the caches
    qk_scale,  # sm_scale * log2(e) (FP8 caches: times k_scale)
    v_scale,  # FP8 caches only (else None): the output's factor
    window_left,  # WINDOW only (else None): a query sees the keys [p - window_left, p]
    Q_TOKEN_STRIDE: tl.constexpr,  # elements between consecutive tokens (fused QKV: 6144)
    K_TOKEN_STRIDE: tl.constexpr,  # (paged: inside a page, NUM_KV_HEADS * HEAD_DIM)
    V_TOKEN_STRIDE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,  # the K/V policy: 0 contiguous, else paged (paged_kv.py)
    K_PAGE_STRIDE: tl.constexpr,  # paged: elements between consecutive pages of k, of v
    V_PAGE_STRIDE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PER_TILE: tl.constexpr,  # query heads of one KV group packed into a tile's rows
    BLOCK_M: tl.constexpr,  # rows of a row block: (BLOCK_M // HEADS_PER_TILE) tokens x heads
    BLOCK_N: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,  # row blocks per tile: 1, or 2 paired (attend_kv_tiles_paired)
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,  # the sliding window: only the key tiles that meet the band are read
    RAGGED: tl.constexpr,
    WRITE_LSE: tl.constexpr,
    INTERPRETED: tl.constexpr,  # Triton's CPU interpreter: work around its bf16 dot and cast
    KV_SPLITS: tl.constexpr,  # > 1: split-KV (decode-like batches, see below); 1: off
    # FP8 caches with bf16 q: Q K^T as two e4m3 products on K as read (split_q_fp8)
    FP8_QK: tl.constexpr = False,
    # Ragged: run only when the indptr arrays are not a partition (after the Gluon kernel,
    # which computes well-formed batches and leaves the others to this one), on one wave.
    MALFORMED_ONLY: tl.constexpr = False,
):
    GROUP_SIZE: tl.constexpr = NUM_HEADS // NUM_KV_HEADS
    BLOCK_TOKENS: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    TOKENS_PER_TILE: tl.constexpr = ROW_BLOCKS * BLOCK_TOKENS

    slot = tl.program_id(0)
    head_block = tl.program_id(1)
    first_head = head_block * HEADS_PER_TILE
    kv_head = first_head // GROUP_SIZE
    if KV_SPLITS > 1:
        # Split-KV: program (slot, head block, split) takes the split-th of its tile's key tiles
        # and writes that part's normalised output and LSE into slice `split` of out and lse,
        # [KV_SPLITS, rows, NUM_HEADS, HEAD_DIM] and [KV_SPLITS, rows, NUM_HEADS] fp32
        # workspaces, which merge_kv_splits combines (every write of the program goes there,
        # malformed-batch poison included).
        tl.static_assert(RAGGED and ROW_BLOCKS == 1 and not WINDOW, "split-KV: ragged, 1 block")
        split = tl.program_id(2).to(tl.int64)
        out += split * seq_q * (NUM_HEADS * HEAD_DIM)
        lse += split * seq_q * NUM_HEADS

    if MALFORMED_ONLY:
        # A grid of one wave (_malformed_only_grid), decided first: on a partition (every call
        # but a malformed one) this scan is the launch's whole cost. Otherwise each program
        # runs the full grid's slots pid, pid + nprog, ..., each as that grid's program did.
        tl.static_assert(RAGGED and KV_SPLITS == 1, "malformed only: ragged, no split-KV")
        if is_partition(qo_indptr, kv_indptr, num_seqs, seq_q, seq_kv):
            return
        num_slots = seq_q // TOKENS_PER_TILE + num_seqs
        for own_slot in range(slot, num_slots, tl.num_programs(0)):
            first_token, q_len, q_start, kv_start, kv_len, poison_from = _slot_tile(
                own_slot, num_slots, out, lse, qo_indptr, kv_indptr, kv_last_page_len, num_seqs,
                seq_q, seq_kv, first_head, PAGE_SIZE=PAGE_SIZE, NUM_HEADS=NUM_HEADS,
                HEAD_DIM=HEAD_DIM, HEADS_PER_TILE=HEADS_PER_TILE, TOKENS_PER_TILE=TOKENS_PER_TILE,
                CAUSAL=CAUSAL, RAGGED=RAGGED, WRITE_LSE=WRITE_LSE,
            )  # fmt: skip
            if first_token < q_len and first_token >= 0:  # as the return below
                _attend_tile(
                    first_token, q_len, q_start, kv_start, kv_len, poison_from, first_head,
                    kv_head, q, k, v, out, lse, kv_indices, num_pages, qk_scale, v_scale,
                    window_left, Q_TOKEN_STRIDE, K_TOKEN_STRIDE, V_TOKEN_STRIDE, PAGE_SIZE,
                    K_PAGE_STRIDE, V_PAGE_STRIDE, NUM_HEADS, HEAD_DIM, HEADS_PER_TILE, BLOCK_M,
                    BLOCK_N, ROW_BLOCKS, CAUSAL, WINDOW, RAGGED, WRITE_LSE, INTERPRETED, KV_SPLITS,
                    FP8_QK,
                )  # fmt: skip
        return
    first_token, q_len, q_start, kv_start, kv_len, poison_from = _slot_tile(
        slot, tl.num_programs(0), out, lse, qo_indptr, kv_indptr, kv_last_page_len, num_seqs,
        seq_q, seq_kv, first_head, PAGE_SIZE=PAGE_SIZE, NUM_HEADS=NUM_HEADS, HEAD_DIM=HEAD_DIM,
        HEADS_PER_TILE=HEADS_PER_TILE, TOKENS_PER_TILE=TOKENS_PER_TILE, CAUSAL=CAUSAL,
        RAGGED=RAGGED, WRITE_LSE=WRITE_LSE,
    )  # fmt: skip
    if first_token >= q_len or first_token < 0:  # a spare slot, or a malformed sequence
        return
    _attend_tile(
        first_token, q_len, q_start, kv_start, kv_len, poison_from, first_head, kv_head, q, k, v,
        out, lse, kv_indices, num_pages, qk_scale, v_scale, window_left, Q_TOKEN_STRIDE,
        K_TOKEN_STRIDE, V_TOKEN_STRIDE, PAGE_SIZE, K_PAGE_STRIDE, V_PAGE_STRIDE, NUM_HEADS,
        HEAD_DIM, HEADS_PER_TILE, BLOCK_M, BLOCK_N, ROW_BLOCKS, CAUSAL, WINDOW, RAGGED, WRITE_LSE,
        INTERPRETED, KV_SPLITS, FP8_QK,
    )  # fmt: skip


@triton.jit
def _slot_tile(
    slot, num_slots, out, lse, qo_indptr, kv_indptr, kv_last_page_len, num_seqs, seq_q, seq_kv,
    first_head, PAGE_SIZE: tl.constexpr, NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HEADS_PER_TILE: tl.constexpr, TOKENS_PER_TILE: tl.constexpr, CAUSAL: tl.constexpr,
    RAGGED: tl.constexpr, WRITE_LSE: tl.constexpr,
):  # fmt: skip
    """(first_token, q_len, q_start, kv_start, kv_len, poison_from) of the query tile that grid
    slot `slot` of num_slots owns: its first token in its sequence, which has q_len queries
    (0 if not computed) from flat row q_start and kv_len keys from kv_start (int64), from key
    poison_from on poisoned (paged K/V; else kv_len, none). A malformed batch's rows that no
    well-formed sequence covers are poisoned here. gqa_prefill_fwd's other arguments."""
    # Which sequence and which query tile of it this program owns. Under a causal mask the last
    # tiles of a sequence see the most keys, so slots run backwards: the longest programs start
    # first instead of straggling in the last wave.
    if RAGGED:
        if CAUSAL:
            slot = num_slots - 1 - slot
        seq = find_sequence(qo_indptr, slot, num_seqs, TOKENS_PER_TILE=TOKENS_PER_TILE)
        # Malformed indptr (see ragged_batch.py): rows no well-formed sequence covers become
        # NaN, and only well-formed sequences are computed, so nothing is read out of bounds.
        batch_ok = is_partition(qo_indptr, kv_indptr, num_seqs, seq_q, seq_kv)
        if not batch_ok:
            poison_uncovered_rows(
                out, lse, qo_indptr, kv_indptr, num_seqs, seq_q, seq_kv, slot, first_head,
                TOKENS_PER_TILE=TOKENS_PER_TILE, HEADS_PER_TILE=HEADS_PER_TILE,
                NUM_HEADS=NUM_HEADS, HEAD_DIM=HEAD_DIM, WRITE_LSE=WRITE_LSE,
            )  # fmt: skip
            seq_ok = well_formed(
                qo_indptr, kv_indptr, seq + tl.zeros([1], tl.int32), num_seqs, seq_q, seq_kv
            )
            batch_ok = tl.max(seq_ok.to(tl.int32), 0) == 1
        q_start = tl.load(qo_indptr + seq)
        q_len = tl.load(qo_indptr + seq + 1) - q_start
        kv_start = tl.load(kv_indptr + seq)
        kv_len = tl.load(kv_indptr + seq + 1) - kv_start
        if PAGE_SIZE > 0:  # kv_indptr counts pages
            kv_len, poison_from = sequence_keys(kv_last_page_len, seq, kv_len, PAGE_SIZE)
        tile = slot - (q_start // TOKENS_PER_TILE + seq)
        q_len = tl.where(batch_ok, q_len, 0)  # not well-formed: compute nothing
        q_start = q_start.to(tl.int64)
        kv_start = kv_start.to(tl.int64)
    else:
        tiles_per_seq = tl.cdiv(seq_q, TOKENS_PER_TILE)
        seq = slot // tiles_per_seq
        tile = slot % tiles_per_seq
        if CAUSAL:
            tile = tiles_per_seq - 1 - tile
        q_len = seq_q
        kv_len = seq_kv
        q_start = seq.to(tl.int64) * seq_q
        kv_start = seq.to(tl.int64) * seq_kv
    if PAGE_SIZE == 0:
        poison_from = kv_len  # unused
    return tile * TOKENS_PER_TILE, q_len, q_start, kv_start, kv_len, poison_from


@triton.jit
def _attend_tile(
    first_token, q_len, q_start, kv_start, kv_len, poison_from, first_head, kv_head, q, k, v,
    out, lse, kv_indices, num_pages, qk_scale, v_scale, window_left,
    Q_TOKEN_STRIDE: tl.constexpr, K_TOKEN_STRIDE: tl.constexpr, V_TOKEN_STRIDE: tl.constexpr,
    PAGE_SIZE: tl.constexpr, K_PAGE_STRIDE: tl.constexpr, V_PAGE_STRIDE: tl.constexpr,
    NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HEADS_PER_TILE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROW_BLOCKS: tl.constexpr, CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr, RAGGED: tl.constexpr, WRITE_LSE: tl.constexpr,
    INTERPRETED: tl.constexpr, KV_SPLITS: tl.constexpr, FP8_QK: tl.constexpr,
):  # fmt: skip
    """The attention of one query tile (_slot_tile's, first_token < q_len) for HEADS_PER_TILE
    query heads from first_head on, of KV head kv_head. gqa_prefill_fwd's other arguments."""
    BLOCK_TOKENS: tl.constexpr = BLOCK_M // HEADS_PER_TILE
    TOKENS_PER_TILE: tl.constexpr = ROW_BLOCKS * BLOCK_TOKENS

    rows = tl.arange(0, BLOCK_M)
    dims = tl.arange(0, HEAD_DIM)
    row_token = rows // HEADS_PER_TILE  # token of a row, relative to its row block's first
    row_head = first_head + rows % HEADS_PER_TILE
    q_offsets = row_token[:, None] * Q_TOKEN_STRIDE + row_head[:, None] * HEAD_DIM + dims[None, :]
    tile_row0 = q_start + first_token  # int64: first token of the tile in the flat layout
    query_pos = first_token + row_token  # position of a row's token in its sequence
    row_in_seq = query_pos < q_len
    q_tile = tl.load(
        q + tile_row0 * Q_TOKEN_STRIDE + q_offsets, mask=row_in_seq[:, None], other=0.0
    )
    q_lo = None
    qk_scale_a = qk_scale
    if FP8_QK:
        q_tile, q_lo, qk_scale_a = split_q_fp8(q_tile, qk_scale, INTERPRETED)

    if PAGE_SIZE == 0:
        k_seq = k + kv_start * K_TOKEN_STRIDE + kv_head * HEAD_DIM
        v_seq = v + kv_start * V_TOKEN_STRIDE + kv_head * HEAD_DIM
        pages = kv_indices  # None
    else:
        k_seq = k + kv_head * HEAD_DIM  # each tile adds its page's offset
        v_seq = v + kv_head * HEAD_DIM
        pages = kv_indices + kv_start

    # Keys [0, kv_full_end) are visible to every row of the tile and need no mask; keys
    # [kv_full_end, kv_end) are the diagonal (and the sequence's ragged end) of a row block; keys
    # from its kv_end on are hidden from every row of the block and never loaded.
    if CAUSAL:
        causal_shift = kv_len - q_len
        last_token = tl.minimum(first_token + BLOCK_TOKENS, q_len) - 1
        kv_end = tl.maximum(tl.minimum(last_token + causal_shift + 1, kv_len), 0)
        kv_all_rows_end = tl.maximum(tl.minimum(first_token + causal_shift + 1, kv_len), 0)
        kv_full_end = kv_all_rows_end // BLOCK_N * BLOCK_N
    else:
        causal_shift = 0
        kv_end = kv_len
        kv_full_end = kv_len // BLOCK_N * BLOCK_N
    if PAGE_SIZE > 0:
        tl.static_assert(CAUSAL and RAGGED, "paged K/V: causal ragged batches only")
        # The loops stop before the first key on a bad page (never read); the rows that see it
        # are poisoned at the end.
        tile_last_token = tl.minimum(first_token + TOKENS_PER_TILE, q_len) - 1
        tile_kv_end = tl.maximum(tl.minimum(tile_last_token + causal_shift + 1, kv_len), 0)
        bad_key = first_key_on_bad_page(pages, tile_kv_end, num_pages, PAGE_SIZE)
        poison_from = tl.minimum(poison_from, bad_key)
        kv_end = tl.minimum(kv_end, bad_key)
        kv_full_end = tl.minimum(kv_full_end, bad_key // BLOCK_N * BLOCK_N)
    # The sliding window's left edge: keys below kv_lo are hidden from every row of the tile
    # (never loaded), keys [kv_lo, kv_band_full) from some (masked). Without a window both are 0.
    kv_lo = 0
    kv_band_full = 0
    if WINDOW:
        tl.static_assert(CAUSAL and PAGE_SIZE == 0, "sliding window: causal contiguous K/V only")
        tile_last_token = tl.minimum(first_token + TOKENS_PER_TILE, q_len) - 1
        kv_lo, kv_band_full = band_start(first_token + causal_shift, tile_last_token + causal_shift,
                                         window_left, kv_full_end, BLOCK_N)  # fmt: skip

    if KV_SPLITS > 1:
        # The split's keys [split_lo, split_hi): an equal share of the tile's key tiles
        # [0, kv_end), then each loop's range clipped to it (starts stay tile-aligned).
        per_split = tl.cdiv(tl.cdiv(kv_end, BLOCK_N), KV_SPLITS) * BLOCK_N
        split_lo = tl.program_id(2) * per_split
        split_hi = tl.minimum(split_lo + per_split, kv_end)
        kv_band_full = tl.maximum(kv_band_full, split_lo)
        kv_full_end = tl.maximum(tl.minimum(kv_full_end, split_hi), kv_band_full)
        kv_end = tl.minimum(kv_end, split_hi)
        kv_diag_lo = tl.maximum(kv_full_end, split_lo)
    else:
        kv_diag_lo = kv_full_end

    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    if ROW_BLOCKS == 2:
        # The tile's second row block: the next BLOCK_TOKENS tokens, the same heads.
        query_pos_b = query_pos + BLOCK_TOKENS
        row_in_seq_b = query_pos_b < q_len
        q_tile_b = tl.load(
            q + (tile_row0 + BLOCK_TOKENS) * Q_TOKEN_STRIDE + q_offsets,
            mask=row_in_seq_b[:, None],
            other=0.0,
        )
        q_lo_b = None
        qk_scale_b = qk_scale
        if FP8_QK:
            q_tile_b, q_lo_b, qk_scale_b = split_q_fp8(q_tile_b, qk_scale, INTERPRETED)
        if CAUSAL:
            last_token_b = tl.minimum(first_token + 2 * BLOCK_TOKENS, q_len) - 1
            kv_end_b = tl.maximum(tl.minimum(last_token_b + causal_shift + 1, kv_len), 0)
        else:
            kv_end_b = kv_len
        if PAGE_SIZE > 0:
            kv_end_b = tl.minimum(kv_end_b, bad_key)
        acc_b = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        m_b = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_b = tl.zeros([BLOCK_M], dtype=tl.float32)
        # The masked tiles first (the online softmax takes tiles in any order), both blocks at
        # once: b's diagonal covers a's (b's tokens come later). Then nothing but the output
        # rows' addresses stays live across the unmasked loop, which needs every register it
        # can get (255, spilling otherwise).
        acc, m_i, l_i, acc_b, m_b, l_b = attend_kv_tiles_paired(
            acc, m_i, l_i, acc_b, m_b, l_b, q_tile, q_tile_b, q_lo, q_lo_b, k_seq, v_seq,
            query_pos, query_pos_b, kv_full_end, kv_end_b, kv_len, causal_shift, window_left,
            qk_scale_a, qk_scale_b, pages, num_pages, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
            K_TOKEN_STRIDE=K_TOKEN_STRIDE, V_TOKEN_STRIDE=V_TOKEN_STRIDE, PAGE_SIZE=PAGE_SIZE,
            K_PAGE_STRIDE=K_PAGE_STRIDE, V_PAGE_STRIDE=V_PAGE_STRIDE, CAUSAL=CAUSAL, WINDOW=WINDOW,
            MASKED=True, INTERPRETED=INTERPRETED,
        )  # fmt: skip
        if WINDOW:  # the band's left edge, masked, before the unmasked loop too
            acc, m_i, l_i, acc_b, m_b, l_b = attend_kv_tiles_paired(
                acc, m_i, l_i, acc_b, m_b, l_b, q_tile, q_tile_b, q_lo, q_lo_b, k_seq, v_seq,
                query_pos, query_pos_b, kv_lo, kv_band_full, kv_len, causal_shift, window_left,
                qk_scale_a, qk_scale_b, pages, num_pages, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
                K_TOKEN_STRIDE=K_TOKEN_STRIDE, V_TOKEN_STRIDE=V_TOKEN_STRIDE, PAGE_SIZE=PAGE_SIZE,
                K_PAGE_STRIDE=K_PAGE_STRIDE, V_PAGE_STRIDE=V_PAGE_STRIDE, CAUSAL=CAUSAL,
                WINDOW=WINDOW, MASKED=True, INTERPRETED=INTERPRETED,
            )  # fmt: skip
        acc, m_i, l_i, acc_b, m_b, l_b = attend_kv_tiles_paired(
            acc, m_i, l_i, acc_b, m_b, l_b, q_tile, q_tile_b, q_lo, q_lo_b, k_seq, v_seq,
            query_pos, query_pos_b, kv_band_full, kv_full_end, kv_len, causal_shift, window_left,
            qk_scale_a, qk_scale_b, pages, num_pages, BLOCK_N=BLOCK_N, HEAD_DIM=HEAD_DIM,
            K_TOKEN_STRIDE=K_TOKEN_STRIDE, V_TOKEN_STRIDE=V_TOKEN_STRIDE, PAGE_SIZE=PAGE_SIZE,
            K_PAGE_STRIDE=K_PAGE_STRIDE, V_PAGE_STRIDE=V_PAGE_STRIDE, CAUSAL=CAUSAL, WINDOW=WINDOW,
            MASKED=False, INTERPRETED=INTERPRETED,
        )  # fmt: skip
        if PAGE_SIZE > 0:
            acc_b, m_b, l_b = poison_rows(acc_b, m_b, l_b, query_pos_b, causal_shift, poison_from)
        _store_rows(
            acc_b, m_b, l_b, out, lse, tile_row0 + BLOCK_TOKENS,
            q_len - first_token - BLOCK_TOKENS, first_head, v_scale, BLOCK_M=BLOCK_M,
            HEADS_PER_TILE=HEADS_PER_TILE, HEAD_DIM=HEAD_DIM, NUM_HEADS=NUM_HEADS,
            WRITE_LSE=WRITE_LSE, INTERPRETED=INTERPRETED,
        )  # fmt: skip
    else:
        if WINDOW:  # the band's left edge, masked
            acc, m_i, l_i = attend_kv_tiles(
                acc, m_i, l_i, q_tile, q_lo, k_seq, v_seq, query_pos, kv_lo, kv_band_full, kv_len,
                causal_shift, window_left, qk_scale_a, pages, num_pages, BLOCK_N=BLOCK_N,
                HEAD_DIM=HEAD_DIM, K_TOKEN_STRIDE=K_TOKEN_STRIDE, V_TOKEN_STRIDE=V_TOKEN_STRIDE,
                PAGE_SIZE=PAGE_SIZE, K_PAGE_STRIDE=K_PAGE_STRIDE, V_PAGE_STRIDE=V_PAGE_STRIDE,
                CAUSAL=CAUSAL, WINDOW=WINDOW, MASKED=True, INTERPRETED=INTERPRETED,
            )  # fmt: skip
        acc, m_i, l_i = attend_kv_tiles(
            acc, m_i, l_i, q_tile, q_lo, k_seq, v_seq, query_pos, kv_band_full, kv_full_end, kv_len,
            causal_shift, window_left, qk_scale_a, pages, num_pages, BLOCK_N=BLOCK_N,
            HEAD_DIM=HEAD_DIM, K_TOKEN_STRIDE=K_TOKEN_STRIDE, V_TOKEN_STRIDE=V_TOKEN_STRIDE,
            PAGE_SIZE=PAGE_SIZE, K_PAGE_STRIDE=K_PAGE_STRIDE, V_PAGE_STRIDE=V_PAGE_STRIDE,
            CAUSAL=CAUSAL, WINDOW=WINDOW, MASKED=False, INTERPRETED=INTERPRETED,
        )  # fmt: skip
        acc, m_i, l_i = attend_kv_tiles(
            acc, m_i, l_i, q_tile, q_lo, k_seq, v_seq, query_pos, kv_diag_lo, kv_end, kv_len,
            causal_shift, window_left, qk_scale_a, pages, num_pages, BLOCK_N=BLOCK_N,
            HEAD_DIM=HEAD_DIM, K_TOKEN_STRIDE=K_TOKEN_STRIDE, V_TOKEN_STRIDE=V_TOKEN_STRIDE,
            PAGE_SIZE=PAGE_SIZE, K_PAGE_STRIDE=K_PAGE_STRIDE, V_PAGE_STRIDE=V_PAGE_STRIDE,
            CAUSAL=CAUSAL, WINDOW=WINDOW, MASKED=True, INTERPRETED=INTERPRETED,
        )  # fmt: skip
    if PAGE_SIZE > 0:
        acc, m_i, l_i = poison_rows(acc, m_i, l_i, query_pos, causal_shift, poison_from)
    _store_rows(
        acc, m_i, l_i, out, lse, tile_row0, q_len - first_token, first_head, v_scale,
        BLOCK_M=BLOCK_M, HEADS_PER_TILE=HEADS_PER_TILE, HEAD_DIM=HEAD_DIM, NUM_HEADS=NUM_HEADS,
        WRITE_LSE=WRITE_LSE, INTERPRETED=INTERPRETED,
    )  # fmt: skip
