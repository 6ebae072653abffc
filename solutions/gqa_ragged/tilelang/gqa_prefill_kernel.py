"""TileLang GQA prefill attention over a ragged batch (32 query heads, 8 KV heads, head dim 128).

One kernel serves both definitions: a padded [batch, seq, heads, dim] batch is a ragged batch of
batch * seq rows with indptr = arange(batch + 1) * seq. Lengths and the token strides of q, k
and v are symbolic (total_q, total_kv, len_indptr, q_stride, ...), so one compiled kernel per
(dtype, causal, tile config) serves every shape and layout.

Work split: work items are (query head, query tile of one sequence). The tiles of all sequences
are laid out on one axis without a host sync: sequence s owns the slots
[s + qo_indptr[s] // block_M, s + 1 + qo_indptr[s + 1] // block_M), at least
ceil(seq_q / block_M) of them and at most one more, so there are batch + total_q // block_M
slots and an item finds its sequence by a binary search over qo_indptr. A padding grid
(cdiv(total_q, block_M) tiles x batch) would instead launch batch times too many blocks, each
holding a full block's shared memory just to exit.

Malformed batches: the indptr values are read on the GPU only. The batch is valid when both
arrays run non-decreasing from 0 to their row counts (total_q, kv_rows); every block tests that
once, and in a valid batch nothing else changes. Otherwise sequence s is well-formed when, in
both arrays, 0 <= a[s] <= a[s + 1] <= rows, no earlier entry exceeds a[s] and no later one is
below a[s + 1]: its rows are computed as usual (the search still finds its slots, and no two
well-formed sequences share a row), no other tile computes anything, and each item also writes
NaN into the rows of its slot's row range [slot * block_M, (slot + 1) * block_M) that no
well-formed sequence covers, output and lse of its head. The slots' ranges cover every row, and
nothing reads or writes outside the tensors (TMA loads are bounded, stores fall in well-formed
sequences' rows or in [0, total_q)).

The solution's kernels (block_config) are FA3's structure written out (gqa_prefill_ws): a TMA
producer warp, an mbarrier ring of K/V tiles, two consumer warpgroups of 64 query rows issuing
wgmma asynchronously so that the softmax of KV tile k runs beside P V of tile k - 1. The causal
one is persistent: one block per SM takes items from an atomic counter, heaviest first, and its
producer loads the next item while the consumers store the last. gqa_prefill's T.Pipelined
program (FA3's schedule declared on the loop, cp.async loads) is the CPU tests' stand-in and a
point of comparison: 0.7x FlashInfer against the hand-written 0.9x (block_config).
"""

import math

import tilelang
import tilelang.language as T

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
GROUP_SIZE = NUM_HEADS // NUM_KV_HEADS  # query head h reads KV head h // GROUP_SIZE
LOG2_E = 1.0 / math.log(2.0)
MAX_BATCH_BITS = 31  # binary search depth: any int32 batch size (idle steps cost a compare)

SM90A = {"kind": "cuda", "arch": "sm_90a"}  # wgmma and TMA exist only for sm_90a
PASS_CONFIGS = {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}  # ex2.approx for exp2
# (dtype, causal) of every kernel the entry points launch: run_padded all four, run_ragged the
# causal two.
VARIANTS = [(dtype, causal) for dtype in ("float16", "bfloat16") for causal in (True, False)]


def block_config(dtype: str, causal: bool) -> dict:
    """Tile sizes and schedule per variant. Measured with scripts/tune_tilelang.py, fp16, ratio
    to FlashInfer fa3 in the same call (kernel time, do_bench) on 8x2048 causal / 1x8192 causal
    / 1x16384 full:
    - H100, 2026-11-24, ws (FA3 written out: TMA producer warp, mbarrier ring, softmax beside
      P V): 128 x 128 0.81 / 0.92 / 0.91; 128 x 176 0.76 / 0.92 / 0.95 (0.79 / 0.93 / 0.93 on a
      second call); 128 x 128 with 3 stages 0.80 / 0.92 / 0.84; 128 x 176 ping-pong 0.78 / 0.92
      / 0.88; 128 x 128 persistent with a dynamic schedule 0.91 / 0.95 / 0.94 (the default for
      causal; 128 x 176 does not fit persistent: its output buffer would make 240 KB);
    - H200, 2026-11-23: ws 128 x 128 0.85 / 0.94 / 0.91, with ping-pong 0.85 / 0.94 / 0.89;
      the schedule declared on T.Pipelined (cp.async loads) 0.67 / 0.74 / 0.70; TileLang's own
      schedule (TMA, warp-specialized, no overlap, H100) 0.35 / 0.36 / 0.30.
    Causal items are short (8x2048: 8.5 KV tiles on average), so each block's prologue and
    epilogue weigh: the causal kernel is persistent (see gqa_prefill_ws).
    """
    del dtype  # the measurements do not separate the dtypes
    if causal:
        return dict(block_M=128, block_N=128, num_stages=2, threads=384, ws=True, persistent=True)
    return dict(block_M=128, block_N=176, num_stages=2, threads=384, ws=True)


def token_rows(rows, heads, token_stride, dtype):
    """[rows, heads, 128] with any token stride, heads dense: q, k and v may be slices of a fused
    QKV projection. The kernels read them through TMA descriptors, which take the stride from
    the tensor on each call, so a contiguous tensor gets the same device code."""
    return T.StridedTensor([rows, heads, HEAD_DIM], [token_stride, HEAD_DIM, 1], dtype)


def gqa_prefill(
    dtype: str,
    causal: bool,
    block_M: int,
    block_N: int,
    num_stages: int,
    threads: int,
    overlap: bool = False,
    ws: bool = False,
    pingpong: bool = False,
    persistent: bool = False,
):
    """Build the T.prim_func of one variant.

    Q [total_q, 32, 128], K/V [total_kv, 8, 128] (dtype, any token stride: token_rows),
    qo_indptr/kv_indptr int32 [batch + 1], kv_rows (the key rows kv_indptr indexes: total_kv,
    or 0 when K and V are a 1-row stand-in, as a TMA descriptor needs a row), sm_scale float32
    (> 0) -> Output [total_q, 32, 128] (dtype) and LSE [total_q, 32] float32, the base-2
    log-sum-exp of the scaled logits; rows that a malformed batch leaves undefined get NaN.
    Causal is bottom-right aligned: query i of a sequence sees key j iff j <= i + seq_kv - seq_q.
    A row that sees no key gets 0 and -inf.
    Scheduler int32 [2]: the persistent kernel's work counters, zero before a launch and zero
    again after it (one per stream); the other programs ignore it.

    overlap declares FA3's schedule for the loop body instead of leaving it to TileLang: Q K^T
    and the softmax of tile k run in stage 0, the rescale and P V of tile k - 1 in stage 1,
    issued between them, so the tensor cores work while the softmax runs.

    ws builds FA3's structure by hand instead (gqa_prefill_ws): a producer warp issuing TMA loads
    of K and V into a num_stages ring guarded by mbarriers, block_M // 64 consumer warpgroups with
    asynchronous wgmma (softmax of tile k while P V of tile k - 1 runs); pingpong adds FA3's
    inter-warpgroup schedule (named barriers: one warpgroup's GEMMs run during the other's
    softmax). threads must then be 128 * (block_M // 64 + 1); overlap is ignored.
    """
    total_q = T.dynamic("total_q")
    total_kv = T.dynamic("total_kv")
    len_indptr = T.dynamic("len_indptr")
    q_stride, k_stride, v_stride = (T.dynamic(f"{x}_stride") for x in "qkv")  # in elements
    batch = len_indptr - 1
    num_slots = batch + total_q // block_M
    accum_dtype = T.float32
    neg_inf = -T.infinity(accum_dtype)
    nan = T.float32(math.nan)

    def slot_of(item):
        """The slot of work item `item`: the last slots (under causal the heaviest tiles) first,
        the 32 heads of a slot side by side (4 of them on each KV tile they load: L2)."""
        return num_slots - 1 - item // NUM_HEADS

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
        Search(lambda s: s + qo_indptr[s] // block_M, slot, seq)

    @T.macro
    def Locate(item, qo_indptr, kv_indptr, seq, tile):
        """tile[0:6] = (q_start, seq_q, kv_start, seq_kv, q_tile, head) of work item `item`.
        seq: scratch for the search over indptr."""
        slot = slot_of(item)
        Find(slot, qo_indptr, seq)
        tile[0] = qo_indptr[seq[0]]
        tile[1] = qo_indptr[seq[0] + 1] - tile[0]
        tile[2] = kv_indptr[seq[0]]
        tile[3] = kv_indptr[seq[0] + 1] - tile[2]
        tile[4] = (slot - seq[0] - tile[0] // block_M) * block_M  # first query row of the tile
        tile[5] = item % NUM_HEADS

    # Malformed batches (indptr values that are not a partition: see the module docstring).
    # indptr = (qo_indptr, kv_indptr, kv_rows); each Check gives one lane's share of a test in
    # ok[0] (the lanes AND them together). Lane `lane` of `lanes` takes the indices i = lane
    # (mod lanes): T.serial(lane, stop, lanes) would do, but TileLang drops its bound when the
    # trip count can only be 0 or 1.

    @T.macro
    def CheckBatch(indptr, lane, lanes, ok):
        """Whether the batch is valid: both arrays non-decreasing, from 0 to total_q and
        kv_rows."""
        qo_indptr, kv_indptr, kv_rows = indptr
        ok[0] = T.if_then_else(
            (qo_indptr[0] == 0) & (qo_indptr[batch] == total_q) & (kv_indptr[0] == 0)
            & (kv_indptr[batch] == kv_rows), 1, 0,
        )  # fmt: skip
        for k in T.serial(T.ceildiv(batch, lanes)):
            i = k * lanes + lane
            if i < batch:
                if (qo_indptr[i] > qo_indptr[i + 1]) | (kv_indptr[i] > kv_indptr[i + 1]):
                    ok[0] = 0

    @T.macro
    def CheckSequence(indptr, s, lane, lanes, ok):
        """Whether sequence s is well-formed: in both arrays its range lies in [0, rows] and
        runs forward, no earlier entry exceeds its start and no later entry is below its end."""
        qo_indptr, kv_indptr, kv_rows = indptr
        ok[0] = T.if_then_else(
            (0 <= qo_indptr[s]) & (qo_indptr[s] <= qo_indptr[s + 1])
            & (qo_indptr[s + 1] <= total_q) & (0 <= kv_indptr[s])
            & (kv_indptr[s] <= kv_indptr[s + 1]) & (kv_indptr[s + 1] <= kv_rows), 1, 0,
        )  # fmt: skip
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
        first_slot = seq[0] + indptr[0][seq[0]] // block_M
        ok[0] = T.if_then_else((all_lanes(ok[0]) != 0) & (slot >= first_slot), 1, 0)

    @T.macro
    def Poison(indptr, Output, LSE, slot, head, lane, lanes, seq, ok):
        """NaN into the rows [slot * block_M, (slot + 1) * block_M) of `head` that no
        well-formed sequence covers (this lane's share of the rows). The slots' rows cover
        [0, total_q), and a well-formed sequence's rows are written by its own tiles alone."""
        qo_indptr = indptr[0]
        for k in T.serial(T.ceildiv(block_M, lanes)):
            row = slot * block_M + k * lanes + lane
            if (k * lanes + lane < block_M) & (row < total_q):
                # The last t with qo_indptr[t] <= row: the sequence that covers the row if a
                # well-formed one does (it steers the search as in Locate).
                Search(lambda t: qo_indptr[t], row, seq)
                CheckSequence(indptr, seq[0], 0, 1, ok)
                if (ok[0] == 0) | (row >= qo_indptr[seq[0] + 1]) | (row < qo_indptr[seq[0]]):
                    for j in T.vectorized(HEAD_DIM):
                        Output[row, head, j] = T.Cast(dtype, nan)
                    LSE[row, head] = nan

    def bounds(tile):
        """(q_pos0, full_end, loop_range): row i sees keys j < seq_kv and, if causal,
        j <= q_pos0 + i; tiles below full_end // block_N are fully visible; loop_range tiles are
        visited, at least one even when no row sees a key (its mask then hides every key)."""
        seq_kv = tile[3]
        q_pos0 = tile[4] + seq_kv - tile[1]
        if causal:
            kv_stop = T.max(T.min(seq_kv, q_pos0 + block_M), 0)
            full_end = T.min(seq_kv, q_pos0 + 1)
        else:
            kv_stop = seq_kv
            full_end = seq_kv
        return q_pos0, full_end, T.max(T.ceildiv(kv_stop, block_N), 1)

    @T.macro
    def MaskTile(acc_s, k, seq_kv, q_pos0):
        """The keys a row of KV tile k may not see set to -inf."""
        # Masking after the GEMM, not by pre-filling the accumulator, overwrites whatever the
        # rows past the sequence's keys gave (the next sequence's keys, TMA's zero fill).
        for i, j in T.Parallel(block_M, block_N):
            key = k * block_N + j
            if causal:
                acc_s[i, j] = T.if_then_else(
                    (key < seq_kv) & (key <= q_pos0 + i), acc_s[i, j], neg_inf
                )
            else:
                acc_s[i, j] = T.if_then_else(key < seq_kv, acc_s[i, j], neg_inf)

    @T.macro
    def Mask(acc_s, k, seq_kv, full_end, q_pos0):
        """MaskTile, for the tiles that reach past full_end only."""
        if (k + 1) * block_N > full_end:
            MaskTile(acc_s, k, seq_kv, q_pos0)

    @T.macro
    def MMA0(K, Q_shared, K_shared, acc_s, k, kv_start, kv_head, seq_kv, full_end, q_pos0):
        """acc_s = Q K^T of KV tile k, the keys a row may not see set to -inf."""
        T.copy(K[kv_start + k * block_N : kv_start + (k + 1) * block_N, kv_head, :], K_shared)
        T.gemm(
            Q_shared,
            K_shared,
            acc_s,
            transpose_B=True,
            clear_accum=True,
            policy=T.GemmWarpPolicy.FullRow,
        )
        Mask(acc_s, k, seq_kv, full_end, q_pos0)

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
        """Online softmax in base 2: scale * log2(e) folded into one FMA per logit."""
        T.copy(scores_max, scores_max_prev)
        T.fill(scores_max, neg_inf)
        T.reduce_max(acc_s, scores_max, dim=1, clear=False)
        for i in T.Parallel(block_M):
            scores_max[i] = T.max(scores_max[i], scores_max_prev[i])
            # A row with no visible key so far has max -inf: subtract 0 instead, so that
            # exp2(-inf - -inf) = NaN never happens and its weights stay 0.
            max_scaled[i] = T.if_then_else(
                scores_max[i] == neg_inf, 0.0, scores_max[i] * scale_log2
            )
            scores_scale[i] = T.exp2(scores_max_prev[i] * scale_log2 - max_scaled[i])
        for i, j in T.Parallel(block_M, block_N):
            acc_s[i, j] = T.exp2(acc_s[i, j] * scale_log2 - max_scaled[i])
        T.reduce_sum(acc_s, scores_sum, dim=1)
        for i in T.Parallel(block_M):
            logsum[i] = logsum[i] * scores_scale[i] + scores_sum[i]

    @T.macro
    def Rescale(acc_o, scores_scale):
        """acc_o rows times scores_scale: the running max moved, or the final 1 / logsum."""
        for i, j in T.Parallel(block_M, HEAD_DIM):
            acc_o[i, j] *= scores_scale[i]

    @T.macro
    def MMA1(V, V_shared, acc_s_cast, acc_o, k, kv_start, kv_head):
        """acc_o += P V of KV tile k."""
        T.copy(V[kv_start + k * block_N : kv_start + (k + 1) * block_N, kv_head, :], V_shared)
        T.gemm(acc_s_cast, V_shared, acc_o, policy=T.GemmWarpPolicy.FullRow)

    @T.macro
    def Epilogue(
        acc_o, logsum, max_scaled, scores_scale, lse, O_shared, Output, LSE, q_start, q_tile,
        seq_q, head,
    ):  # fmt: skip
        """acc_o / logsum to Output through O_shared, and the base-2 LSE, for the tile's rows.
        A row that saw no key has logsum 0: output 0 and lse -inf, never 0/0 or log2(0)."""
        for i in T.Parallel(block_M):
            lse[i] = T.if_then_else(logsum[i] > 0, T.log2(logsum[i]) + max_scaled[i], neg_inf)
            scores_scale[i] = T.if_then_else(logsum[i] > 0, 1.0 / logsum[i], 0.0)
        Rescale(acc_o, scores_scale)
        T.copy(acc_o, O_shared)
        # Rows past the sequence's end belong to the next sequence (or to no one): skip.
        for i, j in T.Parallel(block_M, HEAD_DIM):
            if q_tile + i < seq_q:
                Output[q_start + q_tile + i, head, j] = O_shared[i, j]
        for i in T.Parallel(block_M):
            if q_tile + i < seq_q:
                LSE[q_start + q_tile + i, head] = lse[i]

    if ws:
        assert threads == 128 * (block_M // 64 + 1), "ws: one producer, block_M // 64 consumers"
        return gqa_prefill_ws(
            dtype, causal, block_M, block_N, num_stages, pingpong, persistent,
            (total_q, total_kv, len_indptr, q_stride, k_stride, v_stride), slot_of, Locate,
            CheckBatch, CheckTile, Poison, bounds, Mask, MaskTile, Softmax, Rescale, Epilogue,
        )  # fmt: skip

    @T.prim_func
    def main(
        Q: token_rows(total_q, NUM_HEADS, q_stride, dtype),
        K: token_rows(total_kv, NUM_KV_HEADS, k_stride, dtype),
        V: token_rows(total_kv, NUM_KV_HEADS, v_stride, dtype),
        qo_indptr: T.Tensor([len_indptr], T.int32),
        kv_indptr: T.Tensor([len_indptr], T.int32),
        kv_rows: T.int32,
        sm_scale: T.float32,
        Output: T.Tensor([total_q, NUM_HEADS, HEAD_DIM], dtype),
        LSE: T.Tensor([total_q, NUM_HEADS], accum_dtype),
        Scheduler: T.Tensor([2], T.int32),
    ):
        # One flat grid axis (no 65535 limit), heads fastest: the 32 heads of a query tile run
        # side by side, 4 of them on each KV tile they load (L2).
        with T.Kernel(NUM_HEADS * num_slots, threads=threads) as block:
            Q_shared = T.alloc_shared([block_M, HEAD_DIM], dtype)
            K_shared = T.alloc_shared([block_N, HEAD_DIM], dtype)
            V_shared = T.alloc_shared([block_N, HEAD_DIM], dtype)
            O_shared = T.alloc_shared([block_M, HEAD_DIM], dtype)
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
            tile = T.alloc_local([6], T.int32)
            ok = T.alloc_local([1], T.int32)
            batch_ok = T.alloc_local([1], T.int32)
            indptr = (qo_indptr, kv_indptr, kv_rows)
            # Every thread runs the malformed-batch tests whole (this program is the CPU tests'
            # stand-in; gqa_prefill_ws shares them out).
            CheckBatch(indptr, 0, 1, batch_ok)
            Locate(block, qo_indptr, kv_indptr, seq, tile)
            if batch_ok[0] == 0:
                CheckTile(slot_of(block), indptr, seq, 0, 1, ok, lambda x: x)
                if ok[0] == 0:  # seq_q = q_tile = 0: no row to compute, as for a spare slot
                    tile[1] = 0
                    tile[4] = 0
                Poison(indptr, Output, LSE, slot_of(block), tile[5], 0, 1, seq, ok)
            q_start, seq_q, kv_start, seq_kv, q_tile, head = (
                tile[0], tile[1], tile[2], tile[3], tile[4], tile[5]
            )  # fmt: skip
            kv_head = head // GROUP_SIZE
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
                T.copy(Q[q_start + q_tile : q_start + q_tile + block_M, head, :], Q_shared)
                # One entry per statement of the body: K copy, Q K^T, mask, softmax (8),
                # rescale, V copy, P V. Emitted as: K and V copies, Q K^T and mask of tile k,
                # rescale and P V of tile k - 1, softmax of tile k.
                schedule = (
                    dict(
                        order=[0, 2, 3, *range(6, 14), 4, 1, 5],
                        stage=[0, 0, 0, *[0] * 8, 1, 0, 1],
                    )
                    if overlap
                    else dict(num_stages=num_stages)
                )
                for k in T.Pipelined(loop_range, **schedule):
                    MMA0(
                        K, Q_shared, K_shared, acc_s, k, kv_start, kv_head, seq_kv, full_end, q_pos0
                    )
                    Softmax(acc_s, *stats, scale_log2)
                    T.copy(acc_s, acc_s_cast)
                    Rescale(acc_o, scores_scale)
                    MMA1(V, V_shared, acc_s_cast, acc_o, k, kv_start, kv_head)

            Epilogue(
                acc_o, logsum, max_scaled, scores_scale, lse, O_shared, Output, LSE, q_start,
                q_tile, seq_q, head,
            )  # fmt: skip

    return main


PERSISTENT_CTAS = 132  # an H100 SXM's SMs: one persistent block each (fewer SMs: still correct)
PINGPONG_BARRIER = 12  # named barriers 12.. (TileLang's own partial syncs count up from 3)


def gqa_prefill_ws(
    dtype, causal, block_M, block_N, num_stages, pingpong, persistent, dims, slot_of, Locate,
    CheckBatch, CheckTile, Poison, bounds, Mask, MaskTile, Softmax, Rescale, Epilogue,
):  # fmt: skip
    """FA3's structure written out (gqa_prefill(ws=True)); same arguments and results.

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
    search. persistent: a grid of PERSISTENT_CTAS blocks; each producer takes the next item from
    Scheduler[0] by atomic add (items run heaviest first, and the first block to ask gets the
    next: a static round robin lost 3% on 8x2048 causal and 6% on 1x8192 in a simulation), the
    last block to finish zeroes Scheduler again for the next launch on that stream. The ring and
    Q's barriers run on across items, so the producer loads the next item's Q, K and V while
    the consumers finish the last P V and store the output (staged in its own shared buffer, so
    that Q's can refill early). Otherwise one block per item, and Scheduler is unused.
    Measured on the H100 (kernel time, 8x2048 / 1x8192 causal): one block per item 0.82 / 0.93
    of FlashInfer, persistent round robin 0.86 / 0.91, persistent dynamic 0.91 / 0.95.

    Malformed batches: the first consumer warp checks the batch (CheckBatch, once per block, on
    its first turn) while the producer searches for its first item, so a valid batch pays no
    latency for it; the producer waits for the verdict (batch_checked) before it loads anything.
    In a malformed batch only, the producer passes each item's slot in item_tile[., 7] (-1
    otherwise) and the first consumer warp checks the item's tile (CheckTile, its 32 lanes
    sharing the scan), marks it in item_tile if it computes nothing and tells the others
    (item_checked): the producer waits for that before it loads anything for the item, the other
    consumers before they read the item. Consumer threads 0 .. block_M - 1 poison a row of the
    item's slot each, every item, spare ones included. The register budgets (producer 24,
    consumers 240) leave no room: these checks sit where ptxas does not spill (found by trying;
    tests/test_tilelang_compile.py checks every variant). What a valid batch pays per item: a
    named barrier for the consumers and one for the producer warp, which TileLang inserts as
    item_tile entries they read may have been written by one of them.
    """
    assert block_M % 64 == 0, "one consumer warpgroup per 64 query rows"
    num_consumers = block_M // 64
    consumer_threads = 128 * num_consumers
    threads = consumer_threads + 128
    # FA3's register split: the producer warpgroup keeps 24 (32 beside three consumers).
    producer_regs, consumer_regs = (24, 240) if num_consumers <= 2 else (32, 160)
    # gqa_prefill's symbolic lengths (which its macros use) and token strides
    total_q, total_kv, len_indptr, q_stride, k_stride, v_stride = dims
    batch = len_indptr - 1
    num_slots = batch + total_q // block_M
    num_items = NUM_HEADS * num_slots
    grid = T.min(num_items, PERSISTENT_CTAS) if persistent else num_items
    accum_dtype = T.float32
    neg_inf = -T.infinity(accum_dtype)
    policy = T.GemmWarpPolicy.FullRow

    @T.macro
    def LoadTile(source, shared, full, empty, g, kv_row, kv_head):
        """Producer: the g-th K or V tile (counted over the CTA's items) into its ring slot, once
        the consumers have released the slot's previous tile."""
        stage = g % num_stages
        T.mbarrier_wait_parity(empty[stage], ((g // num_stages) & 1) ^ 1)
        T.tma_copy(
            source[kv_row : kv_row + block_N, kv_head, :], shared[stage, :, :], barrier=full[stage]
        )
        T.mbarrier_arrive(full[stage])

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
        if pingpong:
            T.sync_threads(my_barrier, 256)
        T.wgmma_gemm(
            Q_shared, K_shared[stage, :, :], acc_s, transpose_B=True, clear_accum=True,
            policy=policy,
        )  # fmt: skip
        # The running max of tile k - 1 moved: rescale before its P V adds on.
        Rescale(acc_o, scores_scale)
        T.mbarrier_wait_parity(v_full[prev], ((g - 1) // num_stages) & 1)
        T.wgmma_gemm(acc_s_cast, V_shared[prev, :, :], acc_o, policy=policy)
        if pingpong:
            T.named_barrier_arrive(next_barrier, 256)
        T.wait_wgmma(1)  # Q K^T of tile k done, P V of tile k - 1 runs on
        T.mbarrier_arrive(k_empty[stage])
        if masked:
            MaskTile(acc_s, k, seq_kv, q_pos0)
        Softmax(acc_s, *stats, scale_log2)

    @T.prim_func
    def main(
        Q: token_rows(total_q, NUM_HEADS, q_stride, dtype),
        K: token_rows(total_kv, NUM_KV_HEADS, k_stride, dtype),
        V: token_rows(total_kv, NUM_KV_HEADS, v_stride, dtype),
        qo_indptr: T.Tensor([len_indptr], T.int32),
        kv_indptr: T.Tensor([len_indptr], T.int32),
        kv_rows: T.int32,
        sm_scale: T.float32,
        Output: T.Tensor([total_q, NUM_HEADS, HEAD_DIM], dtype),
        LSE: T.Tensor([total_q, NUM_HEADS], accum_dtype),
        Scheduler: T.Tensor([2], T.int32),
    ):
        with T.Kernel(grid, threads=threads) as block:
            Q_shared = T.alloc_shared([block_M, HEAD_DIM], dtype)
            K_shared = T.alloc_shared([num_stages, block_N, HEAD_DIM], dtype)
            V_shared = T.alloc_shared([num_stages, block_N, HEAD_DIM], dtype)
            # Persistent: the output gets its own buffer, so the next item's Q can load while
            # this one's output is stored. One item per block: it reuses Q's (as FA3 does).
            O_shared = T.alloc_shared([block_M, HEAD_DIM], dtype) if persistent else Q_shared
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
            # full: the producer warp's 32 threads arrive, TMA's bytes complete the phase;
            # empty: every consumer thread arrives once it is done with the slot.
            q_full = T.alloc_barrier(32)
            q_empty = T.alloc_barrier(consumer_threads)
            k_full = T.alloc_barrier([32] * num_stages)
            v_full = T.alloc_barrier([32] * num_stages)
            k_empty = T.alloc_barrier([consumer_threads] * num_stages)
            v_empty = T.alloc_barrier([consumer_threads] * num_stages)
            seq = T.alloc_local([1], T.int32)
            # The current item: Locate's result, then whether there is one, then the slot whose
            # rows it poisons (-1: none, the batch is valid).
            tile = T.alloc_local([8], T.int32)
            fetch = T.alloc_local([1], T.int32)
            ok = T.alloc_local([1], T.int32)
            # The producer warp hands each item to the consumers through a 2-slot buffer.
            item_tile = T.alloc_shared([2, 8], T.int32)
            item_full = T.alloc_barrier([32, 32])
            item_empty = T.alloc_barrier([consumer_threads, consumer_threads])
            # The first consumer warp's verdict on the batch (1 if valid) and, in a malformed
            # batch, on each item (its entries of item_tile updated). One barrier per item_tile
            # slot, as item_full: nobody can then lag a whole phase behind.
            batch_ok = T.alloc_shared([1], T.int32)
            batch_checked = T.alloc_barrier(32)
            item_checked = T.alloc_barrier([32, 32])
            indptr = (qo_indptr, kv_indptr, kv_rows)
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

            if tx >= consumer_threads:
                T.set_max_nreg(producer_regs, 0)
                if tx < consumer_threads + 32:
                    while fetched[0] >= 0:
                        slot = fetched[0] % 2
                        T.mbarrier_wait_parity(item_empty[slot], ((fetched[0] // 2) & 1) ^ 1)
                        if persistent:
                            # Dynamic schedule: the next item goes to the first block that
                            # asks (heaviest first), which balances unequal items. One lane
                            # asks, a shuffle tells the warp.
                            fetch[0] = 0
                            if tx == consumer_threads:
                                fetch[0] = T.atomic_add(Scheduler[0], 1, return_prev=True)
                            item = T.shfl_sync(fetch[0], 0)
                        else:
                            item = T.if_then_else(fetched[0] == 0, block, num_items)
                        tile[6] = T.if_then_else(item < num_items, 1, 0)
                        tile[7] = -1
                        if item < num_items:
                            Locate(item, qo_indptr, kv_indptr, seq, tile)
                            # Completed once, so a wait past the first item returns at once.
                            T.mbarrier_wait_parity(batch_checked[0], 0)
                            if batch_ok[0] == 0:
                                tile[7] = slot_of(item)
                        if tx == consumer_threads:  # one writer: no barrier within the warp
                            for i in T.serial(8):
                                item_tile[slot, i] = tile[i]
                        T.mbarrier_arrive(item_full[slot])
                        if item < num_items:
                            if batch_ok[0] == 0:  # the consumers check the item
                                T.mbarrier_wait_parity(item_checked[slot], (fetched[0] // 2) & 1)
                                tile[1] = item_tile[slot, 1]
                                tile[4] = item_tile[slot, 4]
                            q_start, seq_q, kv_start, q_tile, head = (
                                tile[0], tile[1], tile[2], tile[4], tile[5]
                            )  # fmt: skip
                            kv_head = head // GROUP_SIZE
                            _, _, loop_range = bounds(tile)
                            if q_tile < seq_q:  # a spare slot has no row: nothing to load
                                T.mbarrier_wait_parity(q_empty[0], (items_done[0] & 1) ^ 1)
                                T.tma_copy(
                                    Q[q_start + q_tile : q_start + q_tile + block_M, head, :],
                                    Q_shared,
                                    barrier=q_full[0],
                                )
                                T.mbarrier_arrive(q_full[0])
                                for k in T.serial(loop_range):
                                    g = ring[0] + k
                                    kv_row = kv_start + k * block_N
                                    LoadTile(K, K_shared, k_full, k_empty, g, kv_row, kv_head)
                                    LoadTile(V, V_shared, v_full, v_empty, g, kv_row, kv_head)
                                items_done[0] = items_done[0] + 1
                                ring[0] = ring[0] + loop_range
                            fetched[0] = fetched[0] + 1
                        else:
                            fetched[0] = -1  # done
                            if persistent:
                                # The last block to finish fetching resets the scheduler for the
                                # next launch on this stream (no other block touches it now).
                                if tx == consumer_threads:
                                    if (
                                        T.atomic_add(
                                            Scheduler[1], 1, memory_order="acq_rel",
                                            return_prev=True,
                                        )
                                        == grid - 1
                                    ):  # fmt: skip
                                        Scheduler[0] = 0
                                        Scheduler[1] = 0
            else:
                T.set_max_nreg(consumer_regs, 1)
                warpgroup = tx // 128
                my_barrier = PINGPONG_BARRIER + warpgroup
                next_barrier = PINGPONG_BARRIER + (warpgroup + 1) % num_consumers
                if pingpong:
                    if warpgroup == num_consumers - 1:
                        T.named_barrier_arrive(PINGPONG_BARRIER, 256)  # warpgroup 0 first
                while fetched[0] >= 0:
                    slot = fetched[0] % 2
                    if (fetched[0] == 0) & (tx < 32):
                        CheckBatch(indptr, tx, 32, ok)
                        verdict = T.all_sync(ok[0])
                        if tx == 0:
                            batch_ok[0] = verdict
                        T.mbarrier_arrive(batch_checked[0])
                    T.mbarrier_wait_parity(item_full[slot], (fetched[0] // 2) & 1)
                    if item_tile[slot, 7] >= 0:  # a malformed batch
                        # The first warp checks the item's tile and marks it in item_tile for
                        # everyone, the producer included, who all wait for that.
                        if tx < 32:
                            CheckTile(item_tile[slot, 7], indptr, seq, tx, 32, ok, T.all_sync)
                            if (tx == 0) & (ok[0] == 0):  # seq_q = q_tile = 0, as for a spare slot
                                item_tile[slot, 1] = 0
                                item_tile[slot, 4] = 0
                            T.mbarrier_arrive(item_checked[slot])
                        Poison(
                            indptr, Output, LSE, item_tile[slot, 7], item_tile[slot, 5], tx,
                            consumer_threads, seq, ok,
                        )  # fmt: skip
                        T.mbarrier_wait_parity(item_checked[slot], (fetched[0] // 2) & 1)
                    for i in T.serial(7):
                        tile[i] = item_tile[slot, i]
                    T.mbarrier_arrive(item_empty[slot])
                    fetched[0] = T.if_then_else(tile[6] == 1, fetched[0] + 1, -1)
                    q_start, seq_q, seq_kv, q_tile = tile[0], tile[1], tile[3], tile[4]
                    head = tile[5]
                    q_pos0, full_end, loop_range = bounds(tile)
                    if tile[6] == 1 and q_tile < seq_q:
                        r = ring[0]
                        T.fill(acc_o, 0)
                        T.fill(logsum, 0)
                        T.fill(scores_max, neg_inf)
                        T.fill(max_scaled, 0)
                        T.mbarrier_wait_parity(q_full[0], items_done[0] & 1)

                        # Tile 0: Q K^T and softmax; its P V runs beside tile 1's softmax.
                        T.mbarrier_wait_parity(k_full[r % num_stages], (r // num_stages) & 1)
                        if pingpong:
                            T.sync_threads(my_barrier, 256)
                        T.wgmma_gemm(
                            Q_shared, K_shared[r % num_stages, :, :], acc_s, transpose_B=True,
                            clear_accum=True, policy=policy,
                        )  # fmt: skip
                        if pingpong:
                            T.named_barrier_arrive(next_barrier, 256)
                        T.wait_wgmma(0)
                        T.mbarrier_arrive(k_empty[r % num_stages])
                        Mask(acc_s, 0, seq_kv, full_end, q_pos0)
                        Softmax(acc_s, *stats, scale_log2)

                        # Tiles 1 .. mask_from - 1 are fully visible: their loop has no mask.
                        mask_from = T.max(T.min(full_end // block_N, loop_range), 1)
                        bars = (k_full, v_full, k_empty, v_empty, my_barrier, next_barrier)
                        bufs = (
                            Q_shared, K_shared, V_shared, acc_s, acc_s_cast, acc_o, stats, bars
                        )  # fmt: skip
                        for k in T.serial(1, mask_from):
                            Step(k, r, False, *bufs, seq_kv, q_pos0, scale_log2)
                        for k in T.serial(mask_from, loop_range):
                            Step(k, r, True, *bufs, seq_kv, q_pos0, scale_log2)
                        T.mbarrier_arrive(q_empty[0])  # every Q K^T of the item is done

                        g_last = r + loop_range - 1
                        last = g_last % num_stages
                        T.wait_wgmma(0)
                        if loop_range >= 2:
                            T.mbarrier_arrive(v_empty[(g_last - 1) % num_stages])
                        T.copy(acc_s, acc_s_cast)
                        Rescale(acc_o, scores_scale)
                        T.mbarrier_wait_parity(v_full[last], (g_last // num_stages) & 1)
                        T.wgmma_gemm(acc_s_cast, V_shared[last, :, :], acc_o, policy=policy)
                        T.wait_wgmma(0)
                        T.mbarrier_arrive(v_empty[last])

                        # TileLang puts a consumer barrier before the copy into O_shared:
                        # every consumer is past its last Q K^T (one item per block: Q's buffer
                        # is free) and past the stores of the previous item (persistent: O's
                        # buffer is free).
                        Epilogue(
                            acc_o, logsum, max_scaled, scores_scale, lse, O_shared, Output, LSE,
                            q_start, q_tile, seq_q, head,
                        )  # fmt: skip
                        items_done[0] = items_done[0] + 1
                        ring[0] = ring[0] + loop_range

    return main


def compile_variant(dtype: str, causal: bool, target=SM90A, **config):
    """Lower and compile one variant; config defaults to block_config(dtype, causal)."""
    config = config or block_config(dtype, causal)
    func = gqa_prefill(dtype, causal, **config)
    return tilelang.compile(func, target=target, pass_configs=PASS_CONFIGS)
