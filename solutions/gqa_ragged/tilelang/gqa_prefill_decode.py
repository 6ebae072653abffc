"""Decode-like batches over FP8 caches (run_paged_ps64_fp8kv, at most DECODE_TOKENS query tokens
a sequence on average): a lean split-KV program (decode_fp8) in place of the packed
warp-specialized one, whose 64-row wgmma tiles hold 4-16 useful rows here, and its merge
(merge_decode). TUNING.md, "A lean decode program for FP8 caches".

A block is one warp: (key share, KV head, sequence), share fastest. Its rows are a group of up
to 4 query tokens x the KV head's 4 query heads (one m16 row tile: row i is token i // 4 of the
group, query head 4 * kv_head + i % 4; a 1-token group leaves rows 4-15 without keys); a
sequence with more tokens runs its groups in turn. The group's visible keys (up to its last
token's causal end) are cut into 32-key tiles (half a page) and the tiles into `shares` equal
runs, one a block. The warp walks its run through a ring of NUM_STAGES FP8 K and V tiles filled
by cp.async (the page id read from kv_indices; the pipeline written by hand, constant wait
counts: T.Pipelined over a dynamic trip count fails in TileLang 0.1.15's codegen), then

- K converted from shared e4m3 into a float16 B fragment (cvt f16x2.e4m3x2, exact) and
  S = Q K^T by mma.sync (T.gemm, Q float16 from shared), fp32 accumulators;
- the causal mask per row (token t of a sequence with q_len tokens and kv_len keys sees keys
  j <= t + kv_len - q_len) as a select, so NaN in K past a row's keys never reaches P;
- the online softmax in base 2, a row that has seen no key yet kept at max 0 (no inf - inf);
- V rows past the group's keys zeroed in shared memory (0 x NaN is NaN), V converted like K,
  and O += P V by mma.sync, P straight from the S accumulators (one warp: T.gemm's gemm_rr).

q goes to float16 as CUDA's decode kernel does it (cuda/decode_fp8.cuh): each row scaled by a
power of two 2^(14 - e) (e = floor(log2 of its largest |q|), clamped to [-112, 127]) so its
largest value lands in [2^14, 2^15): exact for every bf16 value down to 2^-24 of the row's
largest; the row's softmax scale takes 2^(e - 14).

Arguments: the packed split FP8 program's (gqa_prefill_fp8's kernel: q, caches, indptr arrays,
kv_indices, kv_last_page_len, kv_rows, page_count, sm_scale, v_scale, Output and LSE fp32
workspaces of shares * total_q rows, Scheduler unused), so that the entry calls either the same
way; the share count is out_rows // total_q, the grid's first dimension. Each block writes its
share's normalised output (times v_scale) and base-2 LSE; a share without a visible key writes
0 and -inf (the merge weighs it 0).

Malformed batches, as the other programs (gqa_prefill_steps: CheckBatch, CheckSequence,
Poison, built for 4-token slots): every block checks the batch; in a malformed one the share-0
blocks of sequence s write NaN into the rows [4 s, 4 s + 4) of their KV head that no
well-formed sequence covers (the entry launches decode-like batches only, total_q <= 4 batch,
so these ranges cover every row), and only a well-formed sequence's blocks compute. A page id
outside [0, page_count) is never dereferenced (clamped: a valid page is read instead) and makes
the share's rows NaN, output and lse (the merge then makes the row NaN); a last-page length
outside [1, 64] (a sequence with pages) reads no key and makes the sequence's rows NaN. Indices
into kv_indices and the caches are clamped into range, so nothing reads or writes outside the
tensors. A batch of more than DECODE_MAX_BATCH sequences (the grid's third dimension) takes the
packed split program.
"""

import math

import tilelang
import tilelang.language as T

from .gqa_prefill_fp8 import FP8_E4M3
from .gqa_prefill_shapes import GROUP_SIZE, HEAD_DIM, NUM_HEADS, NUM_KV_HEADS
from .gqa_prefill_split import DECODE_TOKENS, decode_like
from .gqa_prefill_steps import build_steps

SM90A = {"kind": "cuda", "arch": "sm_90a"}
# ex2.approx for exp2; no bounds tests of TileLang's own (every index is clamped), which would
# turn the paged copies into guarded plain loads instead of cp.async.
PASS_CONFIGS = {
    tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True,
    tilelang.PassConfigKey.TL_DISABLE_SAFE_MEMORY_ACCESS: True,
}
LOG2_E = 1.0 / math.log(2.0)
PAGE = 64  # the FP8 definition's page size
ROWS = 16  # the m16 row tile: DECODE_GROUP tokens x the KV head's 4 query heads
DECODE_GROUP = ROWS // GROUP_SIZE  # query tokens a block takes at once
BLOCK_N = 32  # keys a tile: half a page (the H200 probe's best with one warp)
THREADS = 32  # one warp a block: P V straight from the S accumulators
NUM_STAGES = 2
PAD = 16  # bytes after each 128-byte FP8 row in shared memory: no bank conflicts
Q_TOP = 14  # a row's largest |q| into [2^14, 2^15)
E_MIN, E_MAX = -112, 127  # the exponent's clamp: both powers of two stay normal floats
# The plan (decode_shares): ~DECODE_BLOCKS_PER_SM one-warp blocks an SM (shared memory: ~23
# KB a block) for DECODE_WAVES waves over the (sequence, KV head) pairs; a share holds at least
# DECODE_MIN_SHARE_KEYS keys of the average sequence; at most DECODE_MAX_SHARES (merge_decode
# issues that many shares' loads at once).
DECODE_WAVES = 4
DECODE_BLOCKS_PER_SM = 8
DECODE_MIN_SHARE_KEYS = 256
DECODE_MAX_SHARES = 32
# The grid's third dimension is the batch (at most 65535 blocks there): a larger decode-like
# batch takes the packed split program (tilelang_prefill._plan_paged).
DECODE_MAX_BATCH = 65535
MERGE_THREADS = 128  # merge_decode: 4 rows (token x head) a block, 32 threads a row
MERGE_VECTOR = HEAD_DIM // 32  # columns a merge thread takes

# A block's scalars (decode_fp8's seq_info, registers).
Q_BEGIN, Q_LEN, FIRST, KV_LEN, SHARES, LIVE_KEYS, TILE_LO, COUNT, BAD_LAST = range(9)
SEQ_FIELDS = 9

assert DECODE_GROUP == DECODE_TOKENS, "the host's bound on rows a sequence: one group's"


def decode_shares(total_q: int, batch: int, keys: int, num_sms: int) -> int:
    """Key shares of decode_fp8 for a decode-like batch, from shapes only (no host sync):
    DECODE_WAVES waves of DECODE_BLOCKS_PER_SM blocks an SM over the batch's (sequence, KV head)
    pairs, no share under DECODE_MIN_SHARE_KEYS keys of the average sequence, at most
    DECODE_MAX_SHARES; at least 1. keys: the page table's entries x 64 (a bound on the batch's
    keys). single_token_rows_16 on an H200 (132 SMs, 16 sequences, 2142 pages): 32 shares (the
    probe's best with its merge, 113.5 us)."""
    if not decode_like(total_q, batch):
        return 1
    pairs = batch * NUM_KV_HEADS
    by_occupancy = math.ceil(DECODE_WAVES * DECODE_BLOCKS_PER_SM * num_sms / pairs)
    by_length = keys // batch // DECODE_MIN_SHARE_KEYS
    return max(1, min(by_occupancy, by_length, DECODE_MAX_SHARES))


def decode_fp8(dtype: str):
    """The T.prim_func of the decode program for q's dtype (float16 or bfloat16): the arguments
    of the packed split FP8 program (module docstring)."""
    # The steps of a packed split FP8 program with 4-token slots: its prim_func (arguments,
    # symbolic lengths and strides) and its malformed-batch checks and poison.
    steps = build_steps(dtype, True, ROWS, PAGE, page_size=PAGE, cache_dtype=FP8_E4M3,
                        split=True, pack=True)  # fmt: skip
    assert steps.tokens == DECODE_GROUP, "a slot is a group's 4 tokens"
    CheckBatch, CheckSequence, Poison = steps.CheckBatch, steps.CheckSequence, steps.Poison
    total_q, batch, shares = steps.total_q, steps.batch, steps.shares
    row_bytes = HEAD_DIM + PAD
    tiles_per_page = PAGE // BLOCK_N
    groups = 2  # commit groups a tile: K's, V's
    f16, accum = "float16", "float32"
    neg_inf = -T.infinity(accum)
    nan = T.float32(math.nan)

    @T.macro
    def Issue(kv, K8, V8, first, kv_head, tile_lo, k, stage, count, bad):
        """cp.async of the share's tile k into `stage`: K's half page, then V's, a commit group
        each (empty groups past the share). A page id outside the cache is not read (its index
        clamped: a valid page is read instead) and sets bad[0]."""
        K_cache, V_cache, kv_indices, page_count = kv[0], kv[1], kv[4], kv[5]
        tile = tile_lo + k
        slot = (tile % tiles_per_page) * BLOCK_N
        if k < count:
            page = kv_indices[T.min(T.max(first + tile // tiles_per_page, 0),
                                    kv_indices.shape[0] - 1)]  # fmt: skip
            if (page < 0) | (page >= page_count):
                bad[0] = 1
            page = T.min(T.max(page, 0), K_cache.shape[0] - 1)
            T.async_copy(
                K_cache[page, slot : slot + BLOCK_N, kv_head, :],
                K8[stage, 0:BLOCK_N, 0:HEAD_DIM],
            )
            T.async_copy(
                V_cache[page, slot : slot + BLOCK_N, kv_head, :],
                V8[stage, 0:BLOCK_N, 0:HEAD_DIM],
            )
        else:
            for _ in T.unroll(groups):
                T.ptx_commit_group()

    @T.macro
    def body(Q, kv, qo_indptr, sm_scale, Output, LSE, Scheduler):
        K_cache, V_cache, kv_indptr, kv_rows = kv[0], kv[1], kv[2], kv[3]
        kv_last_page_len, v_scale = kv[6], kv[7]
        del Scheduler  # the warp-specialized programs' work counters
        indptr = (qo_indptr, kv_indptr, kv_rows, kv)
        with T.Kernel(shares, NUM_KV_HEADS, batch, threads=THREADS) as (share, kv_head, seq):
            Q_shared = T.alloc_shared([ROWS, HEAD_DIM], f16)
            scale_shared = T.alloc_shared([ROWS], accum)
            K8 = T.alloc_shared([NUM_STAGES, BLOCK_N, row_bytes], FP8_E4M3)
            V8 = T.alloc_shared([NUM_STAGES, BLOCK_N, row_bytes], FP8_E4M3)
            K16 = T.alloc_fragment([BLOCK_N, HEAD_DIM], f16)
            V16 = T.alloc_fragment([BLOCK_N, HEAD_DIM], f16)
            q_f32 = T.alloc_fragment([ROWS, HEAD_DIM], accum)
            q_top = T.alloc_fragment([ROWS], accum)
            acc_s = T.alloc_fragment([ROWS, BLOCK_N], accum)
            acc_p = T.alloc_fragment([ROWS, BLOCK_N], f16)
            acc_o = T.alloc_fragment([ROWS, HEAD_DIM], accum)
            row_scale = T.alloc_fragment([ROWS], accum)
            last_key = T.alloc_fragment([ROWS], T.int32)
            m_prev = T.alloc_fragment([ROWS], accum)
            m_cur = T.alloc_fragment([ROWS], accum)
            m_base = T.alloc_fragment([ROWS], accum)
            alpha = T.alloc_fragment([ROWS], accum)
            l_sum = T.alloc_fragment([ROWS], accum)
            p_sum = T.alloc_fragment([ROWS], accum)
            ok = T.alloc_local([1], T.int32)
            scratch = T.alloc_local([1], T.int32)
            bad = T.alloc_local([1], T.int32)
            seq_info = T.alloc_local([SEQ_FIELDS], T.int32)
            tx = T.get_thread_binding()

            # The entry sees to these (1-entry / 1-page stand-ins, 16-byte FP8 page strides):
            # clamped indices are in range, and cp.async moves 16 bytes.
            T.assume(K_cache.strides[0] % 16 == 0)
            T.assume(V_cache.strides[0] % 16 == 0)
            T.assume(total_q >= 1)
            scale_log2 = sm_scale * LOG2_E

            # The batch's verdict (every block: a few loads a lane); in a malformed batch the
            # share-0 blocks poison their 4-token slot's uncovered rows, and only well-formed
            # sequences go on.
            CheckBatch(indptr, tx, THREADS, ok)
            ok[0] = T.all_sync(ok[0])
            if ok[0] == 0:
                if share == 0:
                    Poison(indptr, Output, LSE, seq, kv_head, tx, THREADS, scratch, ok,
                           steps.out_row0(0))  # fmt: skip
                CheckSequence(indptr, seq, tx, THREADS, ok)
                ok[0] = T.all_sync(ok[0])
            if ok[0] != 0:
                # The sequence's and the group's scalars, computed once into registers
                # (as expressions TileLang would repeat them at every use).
                seq_info[Q_BEGIN] = qo_indptr[seq]
                seq_info[Q_LEN] = qo_indptr[seq + 1] - seq_info[Q_BEGIN]
                seq_info[FIRST] = kv_indptr[seq]
                pages = kv_indptr[seq + 1] - seq_info[FIRST]
                # A last-page length outside [1, 64] (with pages): no key read, rows NaN.
                last = kv_last_page_len[seq]
                malformed_last = (pages > 0) & ((last < 1) | (last > PAGE))
                seq_info[BAD_LAST] = T.if_then_else(malformed_last, 1, 0)
                seq_info[KV_LEN] = T.if_then_else(
                    (pages > 0) & (seq_info[BAD_LAST] == 0), (pages - 1) * PAGE + last, 0
                )
                seq_info[SHARES] = shares
                q_begin, q_len, first = seq_info[Q_BEGIN], seq_info[Q_LEN], seq_info[FIRST]
                kv_len = seq_info[KV_LEN]
                causal_offset = kv_len - q_len  # token t sees keys j <= t + causal_offset
                for group in T.serial(T.ceildiv(q_len, DECODE_GROUP)):
                    tok0 = group * DECODE_GROUP
                    group_end = T.min(tok0 + DECODE_GROUP, q_len)
                    seq_info[LIVE_KEYS] = T.max(T.min(kv_len, group_end + causal_offset), 0)
                    live_keys = seq_info[LIVE_KEYS]
                    per_share = T.ceildiv(T.ceildiv(live_keys, BLOCK_N), seq_info[SHARES])
                    seq_info[TILE_LO] = share * per_share
                    seq_info[COUNT] = T.max(
                        T.min(seq_info[TILE_LO] + per_share, T.ceildiv(live_keys, BLOCK_N))
                        - seq_info[TILE_LO],
                        0,
                    )
                    tile_lo, count = seq_info[TILE_LO], seq_info[COUNT]
                    bad[0] = seq_info[BAD_LAST]

                    # q: the group's rows, each scaled by 2^(Q_TOP - e) into float16; a row
                    # past the group's tokens is zero and sees no key (last_key -1).
                    for i, j in T.Parallel(ROWS, HEAD_DIM):
                        token = T.min(tok0 + i // GROUP_SIZE, q_len - 1)
                        q_f32[i, j] = T.if_then_else(
                            tok0 + i // GROUP_SIZE < q_len,
                            T.Cast(accum, Q[q_begin + token, kv_head * GROUP_SIZE
                                            + i % GROUP_SIZE, j]),  # fmt: skip
                            0.0,
                        )
                    T.reduce_absmax(q_f32, q_top, dim=1)
                    for i in T.Parallel(ROWS):
                        biased = T.shift_right(T.reinterpret(q_top[i], T.int32), 23) & 0xFF
                        e = T.min(T.max(biased - 127, E_MIN), E_MAX)
                        scale_shared[i] = scale_log2 * T.reinterpret(
                            T.shift_left(127 - Q_TOP + e, 23), T.float32
                        )
                        q_top[i] = T.reinterpret(T.shift_left(127 + Q_TOP - e, 23), T.float32)
                    for i, j in T.Parallel(ROWS, HEAD_DIM):
                        Q_shared[i, j] = T.Cast(f16, q_f32[i, j] * q_top[i])
                    for i in T.Parallel(ROWS):
                        row_scale[i] = scale_shared[i]
                        last_key[i] = T.if_then_else(
                            tok0 + i // GROUP_SIZE < q_len,
                            T.min(kv_len - 1, tok0 + i // GROUP_SIZE + causal_offset),
                            -1,
                        )
                    T.fill(acc_o, 0.0)
                    T.fill(l_sum, 0.0)
                    T.fill(m_cur, neg_inf)

                    # The pipeline by hand: tile k + NUM_STAGES - 1 is issued at tile k, K's
                    # group before V's, a tile's groups committed even past the share (empty),
                    # so that the wait counts are constants.
                    for s in T.unroll(NUM_STAGES - 1):
                        Issue(kv, K8, V8, first, kv_head, tile_lo, s, s, count, bad)
                    for k in T.serial(count):
                        tile = tile_lo + k
                        stage = k % NUM_STAGES
                        Issue(kv, K8, V8, first, kv_head, tile_lo, k + NUM_STAGES - 1,
                              (k + NUM_STAGES - 1) % NUM_STAGES, count, bad)  # fmt: skip
                        T.ptx_wait_group(groups * (NUM_STAGES - 1) + 1)  # K of tile k
                        T.sync_threads()
                        for r, c in T.Parallel(BLOCK_N, HEAD_DIM):
                            K16[r, c] = T.Cast(f16, K8[stage, r, c])
                        T.gemm(Q_shared, K16, acc_s, transpose_B=True, clear_accum=True,
                               policy=T.GemmWarpPolicy.FullCol)  # fmt: skip
                        # The causal mask as a select: NaN in K past a row's keys is dropped.
                        for i, j in T.Parallel(ROWS, BLOCK_N):
                            acc_s[i, j] = T.if_then_else(
                                tile * BLOCK_N + j <= last_key[i], acc_s[i, j], neg_inf
                            )
                        T.copy(m_cur, m_prev)
                        T.reduce_max(acc_s, m_cur, dim=1, clear=False)
                        for i in T.Parallel(ROWS):
                            # A row that has seen no key yet: max 0, so no -inf - -inf.
                            m_base[i] = T.if_then_else(m_cur[i] == neg_inf, 0.0, m_cur[i])
                            alpha[i] = T.exp2((m_prev[i] - m_base[i]) * row_scale[i])
                        for i, j in T.Parallel(ROWS, BLOCK_N):
                            acc_s[i, j] = T.exp2(
                                acc_s[i, j] * row_scale[i] - m_base[i] * row_scale[i]
                            )
                        T.reduce_sum(acc_s, p_sum, dim=1)
                        for i in T.Parallel(ROWS):
                            l_sum[i] = l_sum[i] * alpha[i] + p_sum[i]
                        for i, j in T.Parallel(ROWS, HEAD_DIM):
                            acc_o[i, j] *= alpha[i]
                        T.copy(acc_s, acc_p)
                        T.ptx_wait_group(groups * (NUM_STAGES - 1))  # V of tile k
                        T.sync_threads()
                        # V rows past the group's keys zeroed in shared memory: P there is 0,
                        # V may be NaN (the last tile of a share only).
                        if (tile + 1) * BLOCK_N > live_keys:
                            for r, c in T.Parallel(BLOCK_N, HEAD_DIM):
                                if tile * BLOCK_N + r >= live_keys:
                                    V8[stage, r, c] = T.Cast(FP8_E4M3, 0)
                            T.sync_threads()
                        for r, c in T.Parallel(BLOCK_N, HEAD_DIM):
                            V16[r, c] = T.Cast(f16, V8[stage, r, c])
                        T.gemm(acc_p, V16, acc_o, policy=T.GemmWarpPolicy.FullCol)
                        T.sync_threads()  # the stage is refilled by the next tile's Issue

                    # The share's normalised rows: 0 and -inf without a visible key, NaN
                    # (output and lse) where a page id was out of range; NaN from q or a
                    # visible key stays NaN.
                    out_row = share * total_q + q_begin + tok0
                    for i, j in T.Parallel(ROWS, HEAD_DIM):
                        if tok0 + i // GROUP_SIZE < q_len:
                            Output[out_row + i // GROUP_SIZE, kv_head * GROUP_SIZE
                                   + i % GROUP_SIZE, j] = T.if_then_else(  # fmt: skip
                                bad[0] != 0,
                                nan,
                                T.if_then_else(
                                    l_sum[i] != 0.0, acc_o[i, j] * v_scale / l_sum[i], 0.0
                                ),
                            )
                    for i in T.Parallel(ROWS):
                        if tok0 + i // GROUP_SIZE < q_len:
                            LSE[out_row + i // GROUP_SIZE, kv_head * GROUP_SIZE
                                + i % GROUP_SIZE] = T.if_then_else(  # fmt: skip
                                bad[0] != 0,
                                nan,
                                T.if_then_else(
                                    l_sum[i] != 0.0,
                                    m_base[i] * row_scale[i] + T.log2(l_sum[i]),
                                    neg_inf,
                                ),
                            )
                    T.sync_threads()  # Q_shared and the ring are the next group's

    return steps.kernel(body)


def merge_decode(dtype: str, max_shares: int = DECODE_MAX_SHARES):
    """The T.prim_func merging decode_fp8's shares (gqa_prefill_split.merge_shares' formulas and
    arguments: Parts [shares * total_q, 32, 128] and PartLSE [shares * total_q, 32] fp32 ->
    Output [total_q, 32, 128] (dtype) and LSE [total_q, 32] fp32), for shares <= max_shares.
    merge_shares walks the shares in a loop twice, a chain of dependent loads; here every
    share's loads are issued at once: the shares unrolled to max_shares, each load's share
    index clamped into [0, shares) (no predicate: a share past the count reads the last one
    again and weighs 0). A warp takes a row (token x head), a thread 4 columns (one 16-byte
    load a share)."""
    total_q = T.dynamic("total_q")
    part_rows = T.dynamic("part_rows")
    rows = total_q * NUM_HEADS
    rows_per_block = MERGE_THREADS // 32
    accum = T.float32

    @T.prim_func
    def main(
        Parts: T.Tensor([part_rows, NUM_HEADS, HEAD_DIM], accum),
        PartLSE: T.Tensor([part_rows, NUM_HEADS], accum),
        Output: T.Tensor([total_q, NUM_HEADS, HEAD_DIM], dtype),
        LSE: T.Tensor([total_q, NUM_HEADS], accum),
    ):
        with T.Kernel(T.ceildiv(rows, rows_per_block), threads=MERGE_THREADS) as block:
            neg_inf = -T.infinity(accum)
            nan = T.float32(math.nan)
            shares = part_rows // T.max(total_q, 1)
            lse = T.alloc_local([max_shares], accum)
            part = T.alloc_local([max_shares, MERGE_VECTOR], accum)
            acc = T.alloc_local([MERGE_VECTOR], accum)
            out = T.alloc_local([MERGE_VECTOR], dtype)
            stats = T.alloc_local([3], accum)  # top, total, poisoned
            tx = T.get_thread_binding()
            row = block * rows_per_block + tx // 32
            col = (tx % 32) * MERGE_VECTOR
            token = T.min(row, rows - 1) // NUM_HEADS
            head = T.min(row, rows - 1) % NUM_HEADS
            for s in T.unroll(max_shares):
                lse[s] = PartLSE[T.min(s, shares - 1) * total_q + token, head]
            for s in T.unroll(max_shares):
                for c in T.vectorized(MERGE_VECTOR):
                    part[s, c] = Parts[T.min(s, shares - 1) * total_q + token, head, col + c]
            stats[0] = neg_inf
            stats[1] = 0.0
            stats[2] = 0.0
            for s in T.unroll(max_shares):
                if s < shares:
                    # NaN compares false: a NaN share leaves the max alone, sets the flag.
                    stats[0] = T.if_then_else(lse[s] > stats[0], lse[s], stats[0])
                    # T.isnan, not lse != lse: TVM's simplifier folds x != x to false.
                    stats[2] = T.if_then_else(T.isnan(lse[s]), 1.0, stats[2])
            for c in T.unroll(MERGE_VECTOR):
                acc[c] = 0.0
            for s in T.unroll(max_shares):
                # 0 for a share without keys (and for every share when none saw one).
                weight = T.if_then_else(
                    (s < shares) & (lse[s] > neg_inf) & (stats[0] > neg_inf),
                    T.exp2(lse[s] - stats[0]),
                    0.0,
                )
                stats[1] = stats[1] + weight
                for c in T.unroll(MERGE_VECTOR):
                    acc[c] = acc[c] + T.if_then_else(weight > 0.0, weight * part[s, c], 0.0)
            if row < rows:
                saw_key = stats[0] > neg_inf
                for c in T.unroll(MERGE_VECTOR):
                    out[c] = T.Cast(
                        dtype,
                        T.if_then_else(
                            stats[2] > 0.0,
                            nan,
                            T.if_then_else(saw_key, acc[c] / stats[1], 0.0),
                        ),
                    )
                for c in T.vectorized(MERGE_VECTOR):
                    Output[token, head, col + c] = out[c]
                if tx % 32 == 0:
                    LSE[token, head] = T.if_then_else(
                        stats[2] > 0.0,
                        nan,
                        T.if_then_else(saw_key, stats[0] + T.log2(stats[1]), neg_inf),
                    )

    return main


def compile_decode(dtype: str, target=SM90A):
    """Lower and compile the decode program (decode_fp8) for q's dtype."""
    return tilelang.compile(decode_fp8(dtype), target=target, pass_configs=PASS_CONFIGS)


def compile_merge_decode(dtype: str, target=SM90A):
    """Lower and compile its merge (merge_decode) for q's dtype."""
    return tilelang.compile(merge_decode(dtype), target=target, pass_configs=PASS_CONFIGS)
