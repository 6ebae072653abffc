"""TileLang GQA prefill attention over a ragged batch (32 query heads, 8 KV heads, head dim 128).

One kernel serves both definitions: a padded [batch, seq, heads, dim] batch is a ragged batch of
batch * seq rows with indptr = arange(batch + 1) * seq. Lengths are symbolic (total_q, total_kv,
len_indptr), so one compiled kernel per (dtype, causal, tile config) serves every shape.

Work split: one block per (query head, query tile of one sequence). The tiles of all sequences
are laid out on one grid axis without a host sync: sequence s owns the slots
[s + qo_indptr[s] // block_M, s + 1 + qo_indptr[s + 1] // block_M), at least
ceil(seq_q / block_M) of them and at most one more, so the grid is batch + total_q // block_M
slots and a block finds its sequence by a binary search over qo_indptr. A padding grid
(cdiv(total_q, block_M) tiles x batch) would instead launch batch times too many blocks, each
holding a full block's shared memory just to exit.

Per block: Q tile in shared memory, then T.Pipelined over the KV tiles the tile can see (causal:
fully masked tiles skipped; only boundary tiles masked), with FA3's schedule declared (overlap):
Q K^T and the softmax of tile k are issued beside the rescale and P V of tile k - 1, so the
tensor cores work while the softmax runs. On sm_90a TileLang lowers it to cp.async loads of K and
V (double-buffered) and wgmma for Q K^T (both operands in shared memory) and P V (P from
registers), two warpgroups of 64 query rows each (read the generated source:
kernel.get_kernel_source()). Left to itself TileLang warp-specializes the loop with TMA loads but
does not overlap the softmax: 2x slower on the H100 (block_config).
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
    """Tile sizes and schedule per variant, measured on the H100 (scripts/tune_tilelang.py,
    2026-11-23, fp16, ratio to FlashInfer fa3 on 8x2048 causal / 1x8192 causal / 1x16384 full):
    128 x 128 tiles with FA3's overlap schedule 0.69 / 0.75 / 0.68; the same tiles with the
    schedule left to TileLang (TMA, warp-specialized, no overlap) 0.35 / 0.36 / 0.30; 128 x 64
    0.20; one stage 0.35; 64 x 128 with 128 threads 0.31.
    """
    del dtype, causal  # one config until a measurement says otherwise
    return dict(block_M=128, block_N=128, num_stages=2, threads=256, overlap=True)


def gqa_prefill(
    dtype: str,
    causal: bool,
    block_M: int,
    block_N: int,
    num_stages: int,
    threads: int,
    overlap: bool = False,
):
    """Build the T.prim_func of one variant.

    Q [total_q, 32, 128], K/V [total_kv, 8, 128] (dtype), qo_indptr/kv_indptr int32
    [batch + 1], sm_scale float32 -> Output [total_q, 32, 128] (dtype) and LSE [total_q, 32]
    float32, the base-2 log-sum-exp of the scaled logits. Causal is bottom-right aligned: query
    i of a sequence sees key j iff j <= i + seq_kv - seq_q. A row that sees no key gets 0 and -inf.

    overlap declares FA3's schedule for the loop body instead of leaving it to TileLang: Q K^T
    and the softmax of tile k run in stage 0, the rescale and P V of tile k - 1 in stage 1,
    issued between them, so the tensor cores work while the softmax runs.
    """
    total_q = T.dynamic("total_q")
    total_kv = T.dynamic("total_kv")
    len_indptr = T.dynamic("len_indptr")
    batch = len_indptr - 1
    num_slots = batch + total_q // block_M
    accum_dtype = T.float32
    neg_inf = -T.infinity(accum_dtype)

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
        # Masking after the GEMM, not by pre-filling the accumulator, overwrites whatever the
        # rows past the sequence's keys gave (the next sequence's keys, TMA's zero fill). Only
        # the tiles that reach past full_end need it.
        if (k + 1) * block_N > full_end:
            for i, j in T.Parallel(block_M, block_N):
                key = k * block_N + j
                if causal:
                    acc_s[i, j] = T.if_then_else(
                        (key < seq_kv) & (key <= q_pos0 + i), acc_s[i, j], neg_inf
                    )
                else:
                    acc_s[i, j] = T.if_then_else(key < seq_kv, acc_s[i, j], neg_inf)

    @T.macro
    def Softmax(
        acc_s,
        acc_s_cast,
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
        T.copy(acc_s, acc_s_cast)

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

    @T.prim_func
    def main(
        Q: T.Tensor([total_q, NUM_HEADS, HEAD_DIM], dtype),
        K: T.Tensor([total_kv, NUM_KV_HEADS, HEAD_DIM], dtype),
        V: T.Tensor([total_kv, NUM_KV_HEADS, HEAD_DIM], dtype),
        qo_indptr: T.Tensor([len_indptr], T.int32),
        kv_indptr: T.Tensor([len_indptr], T.int32),
        sm_scale: T.float32,
        Output: T.Tensor([total_q, NUM_HEADS, HEAD_DIM], dtype),
        LSE: T.Tensor([total_q, NUM_HEADS], accum_dtype),
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

            # Last slots first: under causal the last tiles of a sequence see the most keys, and
            # starting the heaviest blocks first shortens the tail of the launch.
            head = block % NUM_HEADS
            slot = num_slots - 1 - block // NUM_HEADS
            seq = T.alloc_var(T.int32, init=0)
            for bit in T.unroll(MAX_BATCH_BITS):
                probe = seq + (1 << (MAX_BATCH_BITS - 1 - bit))
                if probe < batch:
                    if probe + qo_indptr[probe] // block_M <= slot:
                        seq = probe

            q_start = qo_indptr[seq]
            seq_q = qo_indptr[seq + 1] - q_start
            kv_start = kv_indptr[seq]
            seq_kv = kv_indptr[seq + 1] - kv_start
            q_tile = (slot - seq - q_start // block_M) * block_M  # first query row of the tile
            kv_head = head // GROUP_SIZE
            scale_log2 = sm_scale * LOG2_E

            # Row i of the tile sees keys j < seq_kv and, if causal, j <= q_pos0 + i.
            q_pos0 = q_tile + seq_kv - seq_q
            if causal:
                # Keys past the last row's limit are never seen: skip those tiles.
                kv_stop = T.max(T.min(seq_kv, q_pos0 + block_M), 0)
                full_end = T.min(seq_kv, q_pos0 + 1)  # tiles below this are fully visible
            else:
                kv_stop = seq_kv
                full_end = seq_kv
            # At least one iteration, even for a tile that sees no key (its mask then hides every
            # key): the pipeline waits for the Q load only inside the loop, and a block must not
            # exit while a TMA load into its shared memory is in flight.
            loop_range = T.max(T.ceildiv(kv_stop, block_N), 1)

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
                    Softmax(
                        acc_s,
                        acc_s_cast,
                        scores_max,
                        scores_max_prev,
                        max_scaled,
                        scores_scale,
                        scores_sum,
                        logsum,
                        scale_log2,
                    )
                    Rescale(acc_o, scores_scale)
                    MMA1(V, V_shared, acc_s_cast, acc_o, k, kv_start, kv_head)

            # A row that saw no key has logsum 0: output 0 and lse -inf, never 0/0 or log2(0).
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

    return main


def compile_variant(dtype: str, causal: bool, target=SM90A, **config):
    """Lower and compile one variant; config defaults to block_config(dtype, causal)."""
    config = config or block_config(dtype, causal)
    func = gqa_prefill(dtype, causal, **config)
    return tilelang.compile(func, target=target, pass_configs=PASS_CONFIGS)
