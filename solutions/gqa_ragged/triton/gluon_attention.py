"""FlashAttention-3's structure for the padded batch on Hopper, in Gluon (triton.experimental.gluon,
shipped in the triton package): what plain Triton cannot express (warp specialization, TMA,
mbarriers, asynchronous wgmma with waits that leave one group in flight). Used by run_padded on
sm_90 when the tensors suit TMA (triton_prefill.py); elsewhere the FlashAttention-2 kernel of
attention_kernel.py runs.

A CTA owns 128 query rows of one head: a 1-warp producer partition loads Q once and streams K/V
tiles of 128 keys by TMA through a 2-stage ring (mbarriers full / empty), and two consumer
partitions of one warpgroup each own 64 of the rows: S[i + 1] = Q K^T is issued before
O += P[i] V[i], and the online softmax of S[i + 1] runs while P[i] V[i] is on the tensor cores.
Each consumer releases a ring slot on its own (the empty barriers count both), so the
warpgroups never wait on each other. FA3's turns between them (its warp scheduler barrier: one
issues its products while the other runs its softmax) are here as the run-time flag `pingpong`,
off: on, they measured 3-6% slower; but the kernel without their code measured 3-4% slower
than with it switched off (ptxas schedules the loop's issue differently; TUNING.md).
Causal masking is bottom-right aligned; key tiles every row of a warpgroup sees whole run
without a mask, only the diagonal's and the last partial tile pay for one. Each CTA runs the
items the plan's table gives it (padded_schedule: CUDA's order, (sequence, KV head) units in L2
sections, the last row blocks first, each item to the CTA with the least work; a round robin
left 3-6% of the CTAs idle and re-read K / V from DRAM). Rows that see no key give 0.

The ragged batch (gluon_ragged_fwd, run_ragged's kernel for long sequences) has the same
structure over flat Q / K / V: items found by a binary search over qo_indptr (the producer's,
its numbers handed to the consumers in shared memory; the window kernel's partitions search
each for themselves), the output's LSE stored, a sequence's partial last V tile copied with
zeros past its keys, and batches whose indptr arrays are not a partition left to the FA-2
kernel launched after it. With WINDOW it serves the sliding window (run_ragged_swa's wider
windows): an item reads only the key tiles its rows' bands meet, masked on the band's left
edge and on the diagonal. gluon_paged_fwd is the ragged kernel over a paged cache of page
size 64 (run_paged_ps64's kernel for long sequences): each key tile two TMA boxes of one page
from a flat view of the cache, a page id out of range read as NaN keys (so the rows that see
it come out NaN), a bad last-page length poisoning its sequence's rows.

Measured on the H100 against FlashInfer fa3 (triton/TUNING.md, "Gluon").
"""

import functools
import heapq
import itertools

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import async_copy, mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
BLOCK_M, BLOCK_N, STAGES = 128, 128, 2
PAGE_SIZE = 64  # gluon_paged_fwd's: a key tile is two pages
CONSUMER_REGISTERS, PRODUCER_REGISTERS = 240, 24
# Worker partitions take no constexpr arguments: the tile sizes they need are the module's.
HALF_M = gl.constexpr(BLOCK_M // 2)  # rows a consumer warpgroup owns
KV_BLOCK = gl.constexpr(BLOCK_N)
Q_HEADS = gl.constexpr(NUM_HEADS)
KV_HEADS = gl.constexpr(NUM_KV_HEADS)
DIM = gl.constexpr(HEAD_DIM)
RING = gl.constexpr(STAGES)
PAGE = gl.constexpr(PAGE_SIZE)


@gluon.jit
def _item(item, num_m_blocks, batch_heads, seq_q, seq_kv, causal):
    """Work item `item`: (batch, head, first query row, key tiles). Items run the last row
    block first (the longest rows when causal), all sequences and heads of a row block
    together."""
    m_block = num_m_blocks - 1 - item // batch_heads
    batch = (item % batch_heads) // Q_HEADS
    head = item % Q_HEADS
    m0 = m_block * (2 * HALF_M)
    num_tiles = (seq_kv + KV_BLOCK - 1) // KV_BLOCK
    if causal != 0:  # bottom-right: the block's last row sees keys up to m0 + 127 + shift
        last_key = m0 + 2 * HALF_M - 1 + seq_kv - seq_q
        num_tiles = gl.maximum(gl.minimum(num_tiles, (last_key + KV_BLOCK) // KV_BLOCK), 0)
    return batch, head, m0, num_tiles


@gluon.jit
def _producer(q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty,
              v_full, v_empty, seq_q, seq_kv, causal, num_m_blocks, batch_heads, schedule):
    """For each of the CTA's items: Q's two halves (once both consumers are done with the last
    item's), then K and V of each key tile into the ring, whose slots and phases run on across
    items. K / V are described per sequence ([batch, seq_kv, columns]): a tile's keys past the
    sequence's end arrive as zeros, not as the next sequence's (a NaN there would reach P V
    through 0 x NaN)."""
    tile = 0
    count = 0
    first = gl.load(schedule + gl.program_id(0))
    item = gl.load(schedule + first)
    for k in range(first, gl.load(schedule + gl.program_id(0) + 1)):
        next_item = gl.load(schedule + k + 1)  # read an item ahead (the table ends in a pad)
        batch, head, m0, num_tiles = _item(item, num_m_blocks, batch_heads, seq_q, seq_kv,
                                           causal)
        q_row = batch * seq_q + m0
        mbarrier.wait(q_empty, (count & 1) ^ 1)
        mbarrier.expect(q_full, 2 * q_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(q_desc, [q_row, head * DIM], q_full, q_smem.index(0))
        tma.async_copy_global_to_shared(q_desc, [q_row + HALF_M, head * DIM], q_full,
                                        q_smem.index(1))
        kv_col = (head // (Q_HEADS // KV_HEADS)) * DIM
        for i in range(num_tiles):
            stage = (tile + i) % RING
            phase = ((tile + i) // RING) & 1
            mbarrier.wait(k_empty.index(stage), phase ^ 1)
            mbarrier.expect(k_full.index(stage), k_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(k_desc, [batch, i * KV_BLOCK, kv_col],
                                            k_full.index(stage), k_smem.index(stage))
            mbarrier.wait(v_empty.index(stage), phase ^ 1)
            mbarrier.expect(v_full.index(stage), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [batch, i * KV_BLOCK, kv_col],
                                            v_full.index(stage), v_smem.index(stage))
        tile += num_tiles
        count += 1
        item = next_item


@gluon.jit
def _tile(ring, stage):
    """Ring slot stage as a [KV_BLOCK, DIM] tile (TMA fills it as [1, KV_BLOCK, DIM])."""
    return ring.index(stage).reshape([KV_BLOCK, DIM])


@gluon.jit
def _order_after(x):
    """What follows stays after x is computed, in the SASS. ptxas places a wgmma.wait_group
    right after the barrier or mbarrier instruction before it, above the arithmetic in between:
    P V's wait landed just after S's, and the softmax no longer overlapped P V (every loop).
    An mbarrier arrive predicated on x needs x; x is a row sum (>= 0 or NaN): never taken."""
    gl.inline_asm_elementwise(
        "{ .reg .pred p; .reg .b32 a; setp.lt.f32 p, $1, 0f00000000; mov.u32 a, 0; "
        "@p mbarrier.arrive.shared::cta.b64 _, [a]; mov.b32 $0, $1; }",
        "=r,r", [x], dtype=gl.float32, is_pure=False, pack=1)


@gluon.jit
def _softmax_step(scores, m_i, l_i, i, seq_kv, qk_scale, cols, last_key, causal,
                  MASKED: gl.constexpr, first_key=None, WINDOW: gl.constexpr = False):
    """The online softmax of key tile i (exp2; qk_scale holds log2(e)). MASKED: keys past
    seq_kv and, when causal, past a row's last visible key (last_key) are -inf (WINDOW: before
    its first, first_key, too), and a row that has seen no key keeps max -inf and subtracts 0
    (exp2(-inf - -inf) would be NaN). Unmasked tiles are whole for every row: no select, every
    row's max finite."""
    if MASKED:
        keys = i * KV_BLOCK + cols
        visible = (keys < seq_kv)[None, :] & ((causal == 0) | (keys[None, :] <= last_key[:, None]))
        if WINDOW:
            visible = visible & (keys[None, :] >= first_key[:, None])
        scores = gl.where(visible, scores, -float("inf"))
    m_new = gl.maximum(m_i, gl.max(scores, axis=1) * qk_scale)
    if MASKED:
        m_use = gl.where(m_new == -float("inf"), 0.0, m_new)
    else:
        m_use = m_new
    p = gl.exp2(scores * qk_scale - m_use[:, None])
    alpha = gl.exp2(m_i - m_use)
    l_i = l_i * alpha + gl.sum(p, axis=1)
    return p, alpha, m_new, l_i


@gluon.jit
def _kv_tiles(q_half, k_smem, v_smem, k_full, k_empty, v_full, v_empty, turns, acc, p, alpha,
              m_i, l_i, base, begin, end, seq_kv, qk_scale, cols, last_key, causal, wg,
              pingpong, MASKED: gl.constexpr, first_key=None, WINDOW: gl.constexpr = False):
    """Key tiles begin + 1 .. end of the item whose key tile i is the ring's tile base + i:
    S[i + 1] issued before P[i] V[i], S waited for alone, its softmax while P[i] V[i] runs.
    pingpong: the warpgroups take turns issuing, a turn a tile (turns[wg] waited, the other's
    arrived). first_key, WINDOW: _softmax_step's."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KV_BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    for i in range(begin, end):
        stage = (base + i) % RING
        next_stage = (base + i + 1) % RING
        mbarrier.wait(k_full.index(next_stage), ((base + i + 1) // RING) & 1)
        if pingpong != 0:
            mbarrier.wait(turns.index(wg), ((base + i + 1) & 1) ^ (wg ^ 1))
        scores = hopper.warpgroup_mma(q_half, _tile(k_smem, next_stage).permute((1, 0)),
                                      gl.zeros([HALF_M, KV_BLOCK], gl.float32, s_layout),
                                      use_acc=False, is_async=True)
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p16 = gl.convert_layout(p.to(q_half.dtype), p_layout)
        mbarrier.wait(v_full.index(stage), ((base + i) // RING) & 1)
        acc = hopper.warpgroup_mma(p16, _tile(v_smem, stage), acc, is_async=True)
        if pingpong != 0:
            mbarrier.arrive(turns.index(wg ^ 1))
        scores = hopper.warpgroup_mma_wait(num_outstanding=1, deps=[scores])
        mbarrier.arrive(k_empty.index(next_stage))
        p, alpha, m_i, l_i = _softmax_step(scores, m_i, l_i, i + 1, seq_kv, qk_scale, cols,
                                           last_key, causal, MASKED, first_key, WINDOW)
        _order_after(l_i)
        acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(v_empty.index(stage))
    return acc, p, alpha, m_i, l_i


@gluon.jit
def _index_ranges():
    """A consumer's index vectors: key columns of S, rows of O."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KV_BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DIM, 16])
    cols = gl.arange(0, KV_BLOCK, layout=gl.SliceLayout(0, s_layout))
    rows = gl.arange(0, HALF_M, layout=gl.SliceLayout(1, o_layout))
    return cols, rows


@gluon.jit
def _store_rows(out_ptr, acc, row0, m0, seq_q, head, out_row_stride):
    """A consumer warpgroup's output rows m0 .. m0 + 63 (token 0 at out row row0), those below
    seq_q, in 16-byte stores: the accumulator's layout gives each thread pairs of 2 elements
    (4-byte stores, 32 a thread, each register's reuse waiting for its store), so the tile goes
    through shared memory (convert_layout) into rows of 8 elements a thread first."""
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    out = gl.convert_layout(acc.to(out_ptr.dtype.element_ty), store_layout)
    rows = gl.arange(0, HALF_M, layout=gl.SliceLayout(1, store_layout))
    dims = gl.arange(0, DIM, layout=gl.SliceLayout(0, store_layout))
    offsets = (row0 + m0 + rows)[:, None] * out_row_stride + head * DIM + dims[None, :]
    gl.store(out_ptr + offsets, out, mask=(m0 + rows < seq_q)[:, None])


@gluon.jit
def _consume_item(q_half, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                  turns, out_ptr, lse_ptr, out_row0, m0, seq_q, seq_kv, shift, num_tiles, head,
                  tile, count, qk_scale, out_row_stride, causal, pingpong, wg, cols, rows,
                  RAGGED: gl.constexpr, first_tile=0, window_left=-1,
                  WINDOW: gl.constexpr = False, poisoned=None):
    """One consumer warpgroup's part of an item: query rows m0 .. m0 + 63 of a sequence of
    seq_q queries and seq_kv keys (its token 0 at out row out_row0), head `head`, num_tiles key
    tiles from the ring's tile `tile`, the item's Q the count-th. Tile 0 and the tiles from the
    first one a row of it does not see whole run masked, those before without. Q is released
    (q_empty) after the item's last S, before the last P V and the output's stores, so the
    producer loads the next item's meanwhile. shift: seq_kv - seq_q (bottom-right: query row r
    sees keys up to r + shift); cols, rows: _index_ranges (the caller's, hoisted out of its
    item loop). RAGGED: the last tile's V may come from cp.async (a fence before its P V), and
    the rows' LSE (base 2) are stored. WINDOW (causal): a row sees the keys from its last one
    minus window_left; the item's num_tiles key tiles start at first_tile (the band's first),
    and the tiles some row of the warpgroup sees only in part on the band's left edge run
    masked too. poisoned (paged; None elsewhere): non-zero, every row's output and LSE NaN."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KV_BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    m_i = gl.full([HALF_M], -float("inf"), gl.float32, row_s)
    l_i = gl.zeros([HALF_M], gl.float32, row_s)
    acc = gl.zeros([HALF_M, DIM], gl.float32, o_layout)
    last_key = m0 + gl.arange(0, HALF_M, layout=row_s) + shift  # causal: a row's last key
    whole_tiles = seq_kv // KV_BLOCK
    if causal != 0:
        whole_tiles = gl.minimum(whole_tiles, gl.maximum(m0 + shift + 1, 0) // KV_BLOCK)
    if WINDOW:
        first_key = last_key - window_left
        # Key tile i is the ring's tile base + i: base = tile - first_tile, moved up by a
        # multiple of 2 x RING (stage and phase alike) to stay >= 0.
        base = tile + (2 * RING - first_tile % (2 * RING)) % (2 * RING)
        # From this tile on, every row of the warpgroup sees whole tiles on the left.
        left_whole = (gl.maximum(m0 + HALF_M - 1 + shift - window_left, 0) + KV_BLOCK - 1
                      ) // KV_BLOCK  # fmt: skip
        last_tile = first_tile + num_tiles - 1
        edge = gl.minimum(gl.maximum(left_whole - 1, first_tile), last_tile)
    else:
        first_key = None
        base = tile
    mbarrier.wait(q_full, count & 1)
    if num_tiles > 0:
        stage = tile % RING
        mbarrier.wait(k_full.index(stage), (tile // RING) & 1)
        if pingpong != 0:
            mbarrier.wait(turns.index(wg), (tile & 1) ^ (wg ^ 1))
        scores = hopper.warpgroup_mma(q_half, _tile(k_smem, stage).permute((1, 0)),
                                      gl.zeros([HALF_M, KV_BLOCK], gl.float32, s_layout),
                                      use_acc=False, is_async=True)
        if pingpong != 0:
            mbarrier.arrive(turns.index(wg ^ 1))
        scores = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[scores])
        mbarrier.arrive(k_empty.index(stage))
        if WINDOW:
            p, alpha, m_i, l_i = _softmax_step(scores, m_i, l_i, first_tile, seq_kv, qk_scale,
                                               cols, last_key, causal, True, first_key, True)
            # Masked up to the left edge's last tile, unmasked inside the band, masked from the
            # diagonal's first tile (as below, after the edge).
            acc, p, alpha, m_i, l_i = _kv_tiles(q_half, k_smem, v_smem, k_full, k_empty, v_full,
                                                v_empty, turns, acc, p, alpha, m_i, l_i, base,
                                                first_tile, edge, seq_kv, qk_scale, cols,
                                                last_key, causal, wg, pingpong, True, first_key,
                                                True)  # fmt: skip
            split = gl.minimum(gl.maximum(whole_tiles - 1, edge), last_tile)
            acc, p, alpha, m_i, l_i = _kv_tiles(q_half, k_smem, v_smem, k_full, k_empty, v_full,
                                                v_empty, turns, acc, p, alpha, m_i, l_i, base,
                                                edge, split, seq_kv, qk_scale, cols, last_key,
                                                causal, wg, pingpong, False)  # fmt: skip
            acc, p, alpha, m_i, l_i = _kv_tiles(q_half, k_smem, v_smem, k_full, k_empty, v_full,
                                                v_empty, turns, acc, p, alpha, m_i, l_i, base,
                                                split, last_tile, seq_kv, qk_scale, cols,
                                                last_key, causal, wg, pingpong, True, first_key,
                                                True)  # fmt: skip
        else:
            p, alpha, m_i, l_i = _softmax_step(scores, m_i, l_i, 0, seq_kv, qk_scale, cols,
                                               last_key, causal, True)
            split = gl.maximum(whole_tiles - 1, 0)
            acc, p, alpha, m_i, l_i = _kv_tiles(q_half, k_smem, v_smem, k_full, k_empty, v_full,
                                                v_empty, turns, acc, p, alpha, m_i, l_i, tile, 0,
                                                split, seq_kv, qk_scale, cols, last_key, causal,
                                                wg, pingpong, False)
            acc, p, alpha, m_i, l_i = _kv_tiles(q_half, k_smem, v_smem, k_full, k_empty, v_full,
                                                v_empty, turns, acc, p, alpha, m_i, l_i, tile,
                                                split, num_tiles - 1, seq_kv, qk_scale, cols,
                                                last_key, causal, wg, pingpong, True)
        mbarrier.arrive(q_empty)  # the item's last S is done: Q is free
        last = (tile + num_tiles - 1) % RING
        acc = acc * gl.convert_layout(alpha, row_o)[:, None]
        p16 = gl.convert_layout(p.to(q_half.dtype), p_layout)
        mbarrier.wait(v_full.index(last), ((tile + num_tiles - 1) // RING) & 1)
        if RAGGED:  # written by the producer's cp.async (generic proxy), read by wgmma
            hopper.fence_async_shared()
        acc = hopper.warpgroup_mma(p16, _tile(v_smem, last), acc, is_async=True)
        acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
        mbarrier.arrive(v_empty.index(last))
    else:
        mbarrier.arrive(q_empty)
    # A row without keys: 0 (a NaN among its keys stays NaN: l_o is NaN, not 0).
    l_o = gl.convert_layout(l_i, row_o)
    acc = gl.where((l_o == 0)[:, None], 0.0, acc / l_o[:, None])
    if poisoned is not None:
        acc = gl.where(poisoned != 0, float("nan"), acc)
    _store_rows(out_ptr, acc, out_row0, m0, seq_q, head, out_row_stride)
    in_seq = m0 + rows < seq_q
    if RAGGED:  # base 2, -inf where a row saw no key
        m_o = gl.convert_layout(m_i, row_o)
        lse = gl.where(l_o == 0, -float("inf"), m_o + gl.log2(l_o))
        if poisoned is not None:
            lse = gl.where(poisoned != 0, float("nan"), lse)
        gl.store(lse_ptr + (out_row0 + m0 + rows) * Q_HEADS + head, lse, mask=in_seq)


@gluon.jit
def _consumer(q_half, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty, turns,
              out_ptr, seq_q, seq_kv, qk_scale, out_row_stride, causal, pingpong, num_m_blocks,
              batch_heads, schedule, wg):
    """One consumer warpgroup: for each of the CTA's items, query rows wg x 64 .. wg x 64 + 63
    of its row block, as _consume_item (whose docstring says how). The item body is written
    out here, not a call of _consume_item, to keep the SASS that was measured: calling it,
    ptxas scheduled the loop otherwise and 8x2048 causal measured 0.89 of FlashInfer against
    0.92 (session 8, call 2)."""
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, KV_BLOCK, 16])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DIM, 16])
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=2)
    row_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    row_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    cols = gl.arange(0, KV_BLOCK, layout=gl.SliceLayout(0, s_layout))
    shift = seq_kv - seq_q  # bottom-right: query row r sees keys up to r + shift
    tile = 0
    count = 0
    first = gl.load(schedule + gl.program_id(0))
    item = gl.load(schedule + first)
    for k in range(first, gl.load(schedule + gl.program_id(0) + 1)):
        # Read an item ahead (ptxas spills it at 240 registers and reloads it at the next
        # item's start: TUNING.md, "The padded Gluon kernel's items by a plan-time table").
        next_item = gl.load(schedule + k + 1)
        batch, head, m0, num_tiles = _item(item, num_m_blocks, batch_heads, seq_q, seq_kv,
                                           causal)
        m0 += wg * HALF_M
        m_i = gl.full([HALF_M], -float("inf"), gl.float32, row_s)
        l_i = gl.zeros([HALF_M], gl.float32, row_s)
        acc = gl.zeros([HALF_M, DIM], gl.float32, o_layout)
        last_key = m0 + gl.arange(0, HALF_M, layout=row_s) + shift  # causal: a row's last key
        whole_tiles = seq_kv // KV_BLOCK
        if causal != 0:
            whole_tiles = gl.minimum(whole_tiles, gl.maximum(m0 + shift + 1, 0) // KV_BLOCK)
        mbarrier.wait(q_full, count & 1)
        if num_tiles > 0:
            stage = tile % RING
            mbarrier.wait(k_full.index(stage), (tile // RING) & 1)
            if pingpong != 0:
                mbarrier.wait(turns.index(wg), (tile & 1) ^ (wg ^ 1))
            scores = hopper.warpgroup_mma(q_half, _tile(k_smem, stage).permute((1, 0)),
                                          gl.zeros([HALF_M, KV_BLOCK], gl.float32, s_layout),
                                          use_acc=False, is_async=True)
            if pingpong != 0:
                mbarrier.arrive(turns.index(wg ^ 1))
            scores = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[scores])
            mbarrier.arrive(k_empty.index(stage))
            p, alpha, m_i, l_i = _softmax_step(scores, m_i, l_i, 0, seq_kv, qk_scale, cols,
                                               last_key, causal, True)
            split = gl.maximum(whole_tiles - 1, 0)
            acc, p, alpha, m_i, l_i = _kv_tiles(q_half, k_smem, v_smem, k_full, k_empty, v_full,
                                                v_empty, turns, acc, p, alpha, m_i, l_i, tile, 0,
                                                split, seq_kv, qk_scale, cols, last_key, causal,
                                                wg, pingpong, False)
            acc, p, alpha, m_i, l_i = _kv_tiles(q_half, k_smem, v_smem, k_full, k_empty, v_full,
                                                v_empty, turns, acc, p, alpha, m_i, l_i, tile,
                                                split, num_tiles - 1, seq_kv, qk_scale, cols,
                                                last_key, causal, wg, pingpong, True)
            mbarrier.arrive(q_empty)  # the item's last S is done: Q is free
            last = (tile + num_tiles - 1) % RING
            acc = acc * gl.convert_layout(alpha, row_o)[:, None]
            p16 = gl.convert_layout(p.to(q_half.dtype), p_layout)
            mbarrier.wait(v_full.index(last), ((tile + num_tiles - 1) // RING) & 1)
            acc = hopper.warpgroup_mma(p16, _tile(v_smem, last), acc, is_async=True)
            acc = hopper.warpgroup_mma_wait(num_outstanding=0, deps=[acc])
            mbarrier.arrive(v_empty.index(last))
        else:
            mbarrier.arrive(q_empty)
        # A row without keys: 0 (a NaN among its keys stays NaN: l_o is NaN, not 0).
        l_o = gl.convert_layout(l_i, row_o)
        acc = gl.where((l_o == 0)[:, None], 0.0, acc / l_o[:, None])
        _store_rows(out_ptr, acc, batch * seq_q, m0, seq_q, head, out_row_stride)
        tile += num_tiles
        count += 1
        item = next_item


# One entry a consumer warpgroup: a partition's function takes no constexpr, and its warpgroup
# index as a run-time argument would change the SASS measured above (TUNING.md).
@gluon.jit
def _consumer_0(q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                turns, out_ptr, seq_q, seq_kv, qk_scale, out_row_stride, causal, pingpong,
                num_m_blocks, batch_heads, schedule):
    _consumer(q_smem.index(0), k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
              v_empty, turns, out_ptr, seq_q, seq_kv, qk_scale, out_row_stride, causal, pingpong,
              num_m_blocks, batch_heads, schedule, 0)


@gluon.jit
def _consumer_1(q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                turns, out_ptr, seq_q, seq_kv, qk_scale, out_row_stride, causal, pingpong,
                num_m_blocks, batch_heads, schedule):
    _consumer(q_smem.index(1), k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
              v_empty, turns, out_ptr, seq_q, seq_kv, qk_scale, out_row_stride, causal, pingpong,
              num_m_blocks, batch_heads, schedule, 1)


@gluon.jit
def gluon_padded_fwd(q_desc, k_desc, v_desc, out_ptr, schedule, seq_q, seq_kv, out_row_stride,
                     qk_scale, causal, pingpong, NUM_HEADS: gl.constexpr,
                     NUM_KV_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                     CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr):
    """Persistent: grid (CTAs,), at most one an SM; CTA c runs the items schedule[schedule[c] ..
    schedule[c + 1] - 1] (_item's numbering; padded_schedule).
    num_warps=4: the default partition is consumer 0; consumer 1 and the producer warp are
    worker partitions. q_desc views q as [tokens, heads x HEAD_DIM] (sequence b's token t at
    row b x seq_q + t), k_desc / v_desc view k / v as [batch, seq_kv, heads x HEAD_DIM]."""
    gl.static_assert(BLOCK_M == 2 * HALF_M)
    gl.static_assert(BLOCK_N == KV_BLOCK)
    gl.static_assert(NUM_HEADS == Q_HEADS and NUM_KV_HEADS == KV_HEADS)
    num_m_blocks = (seq_q + BLOCK_M - 1) // BLOCK_M
    batch_heads = k_desc.shape[0] * NUM_HEADS
    q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty, turns = _ring(
        q_desc, k_desc, v_desc, True)
    consumer_args = (q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                     turns, out_ptr, seq_q, seq_kv, qk_scale, out_row_stride, causal, pingpong,
                     num_m_blocks, batch_heads, schedule)
    gl.warp_specialize(
        [
            (_consumer_0, consumer_args),
            (_consumer_1, consumer_args),
            (_producer, (q_desc, k_desc, v_desc, q_smem, k_smem, v_smem, q_full, q_empty, k_full,
                         k_empty, v_full, v_empty, seq_q, seq_kv, causal, num_m_blocks,
                         batch_heads, schedule)),
        ],
        [4, 1],
        [CONSUMER_REGISTERS, PRODUCER_REGISTERS],
    )


# ---- The ragged batch -------------------------------------------------------------------------
# Sequence s owns the item slots [first(s), first(s + 1)), first(s) = qo_indptr[s] // 128 + s: at
# least its cdiv(q_len, 128) row blocks (one spare at most), num_slots = total_q // 128 +
# num_seqs in all (the FA-2 kernel's ragged_batch.find_sequence, with 128-token tiles). Q, K and
# V are described flat ([rows, heads x HEAD_DIM]): a row block may run into the next sequence's
# queries (never stored) and a key tile into its keys (masked), but not its values: a last tile
# that ends inside the next sequence's V comes in by cp.async, zeros past its keys (0 x NaN in P V
# would carry a NaN over).


@gluon.jit
def _item_rows(item, num_slots, qo_indptr, num_seqs):
    """Work item `item`'s (head, sequence, q_start, q_len, m0): its row block m0 .. m0 + 127 of
    the sequence's q_len queries from row q_start. Slots run last first (a sequence's last row
    blocks see the most keys when causal), the 32 heads of a slot together; the sequence is the
    last s with first(s) <= slot."""
    slot = num_slots - 1 - item // Q_HEADS
    head = item % Q_HEADS
    lo = 0
    hi = num_seqs
    while lo + 1 < hi:
        mid = (lo + hi) // 2
        if gl.load(qo_indptr + mid) // (2 * HALF_M) + mid <= slot:
            lo = mid
        else:
            hi = mid
    q_start = gl.load(qo_indptr + lo)
    q_len = gl.load(qo_indptr + lo + 1) - q_start
    m0 = (slot - (q_start // (2 * HALF_M) + lo)) * (2 * HALF_M)
    return head, lo, q_start, q_len, m0


@gluon.jit
def _key_tiles(m0, q_len, kv_len, causal):
    """The key tiles row block m0 of q_len queries over kv_len keys reads (causal: up to its
    last row's last key; 0 for a spare slot)."""
    num_tiles = (kv_len + KV_BLOCK - 1) // KV_BLOCK
    if causal != 0:
        last_key = m0 + 2 * HALF_M - 1 + kv_len - q_len
        num_tiles = gl.maximum(gl.minimum(num_tiles, (last_key + KV_BLOCK) // KV_BLOCK), 0)
    if m0 >= q_len:
        num_tiles = 0
    return num_tiles


@gluon.jit
def _ragged_item(item, num_slots, qo_indptr, kv_indptr, num_seqs, causal, window_left=-1,
                 WINDOW: gl.constexpr = False):
    """Work item `item`: (head, q_start, q_len, kv_start, kv_len, m0, num_tiles, first_tile)
    (_item_rows): num_tiles key tiles from first_tile (0 tiles: a spare slot). WINDOW
    (causal): the tiles from the one that holds the block's first row's first key (its
    position minus window_left)."""
    head, seq, q_start, q_len, m0 = _item_rows(item, num_slots, qo_indptr, num_seqs)
    kv_start = gl.load(kv_indptr + seq)
    kv_len = gl.load(kv_indptr + seq + 1) - kv_start
    num_tiles = _key_tiles(m0, q_len, kv_len, causal)
    if WINDOW:
        first_tile = gl.maximum(m0 + kv_len - q_len - window_left, 0) // KV_BLOCK
        num_tiles = gl.maximum(num_tiles - first_tile, 0)
    else:
        first_tile = 0
    return head, q_start, q_len, kv_start, kv_len, m0, num_tiles, first_tile


@gluon.jit
def _put_item(item_smem, head, q_start, q_len, kv_len, m0, num_tiles, first_tile, poisoned=0):
    """The ragged producer warp: an item's numbers into shared memory for the consumers, one a
    lane (written before the item's Q is armed: they read them once its barrier completes).
    poisoned (paged): the item's rows come out NaN."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    i = gl.arange(0, 32, layout=layout)
    numbers = gl.where(i == 0, head, gl.where(i == 1, q_start, gl.where(i == 2, q_len, gl.where(
        i == 3, kv_len, gl.where(i == 4, m0, gl.where(i == 5, num_tiles, gl.where(
            i == 6, first_tile, poisoned)))))))
    item_smem.store(numbers)


@gluon.jit
def _get_item(item_smem):
    """A ragged consumer warpgroup: the numbers _put_item wrote, every thread all of them."""
    layout: gl.constexpr = gl.BlockedLayout([8], [32], [4], [0])
    i = gl.arange(0, 8, layout=layout)
    numbers = item_smem.slice(0, 8).load(layout)
    head = gl.sum(gl.where(i == 0, numbers, 0), axis=0)
    q_start = gl.sum(gl.where(i == 1, numbers, 0), axis=0)
    q_len = gl.sum(gl.where(i == 2, numbers, 0), axis=0)
    kv_len = gl.sum(gl.where(i == 3, numbers, 0), axis=0)
    m0 = gl.sum(gl.where(i == 4, numbers, 0), axis=0)
    num_tiles = gl.sum(gl.where(i == 5, numbers, 0), axis=0)
    first_tile = gl.sum(gl.where(i == 6, numbers, 0), axis=0)
    poisoned = gl.sum(gl.where(i == 7, numbers, 0), axis=0)
    return head, q_start, q_len, kv_len, m0, num_tiles, first_tile, poisoned


@gluon.jit
def _gather_v(v_ptr, v_row_stride, v_tile, row0, keys, kv_col):
    """The producer warp's cp.async of V rows row0 .. row0 + keys - 1 into v_tile, zeros in its
    rows from `keys` on (nothing read there), 8 rows a step (one swizzle atom)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
    r = gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, DIM, layout=gl.SliceLayout(0, layout))
    for r0 in gl.static_range(0, KV_BLOCK, 8):
        rows = r0 + r
        ptrs = v_ptr + ((row0 + rows).to(gl.int64) * v_row_stride + kv_col)[:, None] + c[None, :]
        async_copy.async_copy_global_to_shared(v_tile.slice(r0, 8), ptrs,
                                               mask=(rows < keys)[:, None])


@gluon.jit
def _load_q(q_desc, q_smem, q_full, q_row, head):
    """The producer's load of an item's Q: rows q_row .. q_row + 127 of head `head`, two halves."""
    mbarrier.expect(q_full, 2 * q_desc.block_type.nbytes)
    tma.async_copy_global_to_shared(q_desc, [q_row, head * DIM], q_full, q_smem.index(0))
    tma.async_copy_global_to_shared(q_desc, [q_row + HALF_M, head * DIM], q_full, q_smem.index(1))


@gluon.jit
def _next_item(counter, num_items):
    """The producer warp's next item: the grid's first items are its CTAs' own, the rest go to
    whichever CTA asks first (an atomic add on counter[0]; lane 0 adds, the warp reads its
    result). Each CTA, its first draw past the end, counts itself on counter[1], and the last
    one zeroes both: the next launch on the stream finds 0 (CUDA's next_item)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [1], [0])
    lane = gl.arange(0, 32, layout=layout)
    first = lane == 0
    drawn = gl.atomic_add(counter + lane * 0, 1 + lane * 0, mask=first)
    item = gl.num_programs(0) + gl.sum(gl.where(first, drawn, 0), axis=0)
    if item >= num_items:
        done = gl.atomic_add(counter + 1 + lane * 0, 1 + lane * 0, mask=first)
        if gl.sum(gl.where(first, done, 0), axis=0) == gl.num_programs(0) - 1:
            gl.atomic_xchg(counter + lane, lane * 0, mask=lane < 2)  # counter[0], [1] = 0
    return item


@gluon.jit
def _end_of_work(q_empty, q_full, item_smem, count):
    """The producer's last hand-over: an item of head -1, which ends the consumers' loops."""
    mbarrier.wait(q_empty, (count & 1) ^ 1)
    _put_item(item_smem, -1, 0, 0, 0, 0, 0, 0)
    mbarrier.arrive(q_full)

@gluon.jit
def _hand_over(q_desc, q_smem, q_full, q_empty, item_smem, count, batch_ok, head, q_start, q_len,
               kv_len, m0, num_tiles, first_tile, poisoned=0):
    """The producer's start of its count-th item, once Q's buffer is free: the item's numbers
    for the consumers (_put_item), then its Q, whose barrier releases them. Not batch_ok (the
    indptr arrays are not a partition): the consumers get an empty item (no rows, no key tiles:
    they store nothing). Returns the key tiles to load."""
    if not batch_ok:  # m0 + r < q_len never holds: no row stored
        q_start = 0
        q_len = 0
        m0 = 0
        num_tiles = 0
    mbarrier.wait(q_empty, (count & 1) ^ 1)
    _put_item(item_smem, head, q_start, q_len, kv_len, m0, num_tiles, first_tile, poisoned)
    if batch_ok:
        _load_q(q_desc, q_smem, q_full, q_start + m0, head)
    else:
        mbarrier.arrive(q_full)
    return num_tiles

@gluon.jit
def _load_kv_tiles(k_desc, v_desc, v_ptr, v_row_stride, k_smem, v_smem, k_full, k_empty, v_full,
                   v_empty, tile, head, kv_start, kv_len, num_tiles, first_tile, total_kv):
    """The producer's loads of an item's num_tiles key tiles from first_tile, through the ring
    from its tile `tile`, at flat coordinates; V's last tile of a sequence that is not the
    batch's last by _gather_v when it is partial."""
    kv_col = (head // (Q_HEADS // KV_HEADS)) * DIM
    # Rows past the sequence's keys are another sequence's (or past V: TMA's zeros).
    shares_v = kv_start + kv_len < total_kv
    for i in range(num_tiles):
        stage = (tile + i) % RING
        phase = ((tile + i) // RING) & 1
        kv_row = kv_start + (first_tile + i) * KV_BLOCK
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        mbarrier.expect(k_full.index(stage), k_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(k_desc, [kv_row, kv_col], k_full.index(stage),
                                        k_smem.index(stage))
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        keys = kv_len - (first_tile + i) * KV_BLOCK
        if shares_v and keys < KV_BLOCK:
            _gather_v(v_ptr, v_row_stride, v_smem.index(stage), kv_row, keys, kv_col)
            async_copy.mbarrier_arrive(v_full.index(stage))
            mbarrier.arrive(v_full.index(stage))
        else:
            mbarrier.expect(v_full.index(stage), v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [kv_row, kv_col], v_full.index(stage),
                                            v_smem.index(stage))


@gluon.jit
def _ragged_producer(q_desc, k_desc, v_desc, v_ptr, v_row_stride, q_smem, k_smem, v_smem, q_full,
                     q_empty, k_full, k_empty, v_full, v_empty, item_smem, qo_indptr, kv_indptr,
                     num_seqs, num_slots, total_q, total_kv, causal, counter):
    """The padded producer's loads for ragged items (_ragged_item), and each item's numbers for
    the consumers (_put_item: the search over indptr done once an item, not in every
    partition). If the indptr arrays are not a partition, every item goes to the consumers
    empty (no rows, no key tiles: they store nothing) and the FA-2 kernel launched after this
    one takes the batch."""
    _produce_ragged(q_desc, k_desc, v_desc, v_ptr, v_row_stride, q_smem, k_smem, v_smem, q_full,
                    q_empty, k_full, k_empty, v_full, v_empty, item_smem, qo_indptr, kv_indptr,
                    num_seqs, num_slots, total_q, total_kv, causal, counter)  # fmt: skip


@gluon.jit
def _window_producer(q_desc, k_desc, v_desc, v_ptr, v_row_stride, q_smem, k_smem, v_smem, q_full,
                     q_empty, k_full, k_empty, v_full, v_empty, item_smem, qo_indptr, kv_indptr,
                     num_seqs, num_slots, total_q, total_kv, causal, counter, window_left):
    """_ragged_producer with the sliding window: an item's key tiles from its band's first."""
    _produce_ragged(q_desc, k_desc, v_desc, v_ptr, v_row_stride, q_smem, k_smem, v_smem, q_full,
                    q_empty, k_full, k_empty, v_full, v_empty, item_smem, qo_indptr, kv_indptr,
                    num_seqs, num_slots, total_q, total_kv, causal, counter, window_left,
                    True)  # fmt: skip


@gluon.jit
def _produce_ragged(q_desc, k_desc, v_desc, v_ptr, v_row_stride, q_smem, k_smem, v_smem, q_full,
                    q_empty, k_full, k_empty, v_full, v_empty, item_smem, qo_indptr, kv_indptr,
                    num_seqs, num_slots, total_q, total_kv, causal, counter, window_left=-1,
                    WINDOW: gl.constexpr = False):
    batch_ok = _is_partition(qo_indptr, kv_indptr, num_seqs, total_q, total_kv, 1)
    tile = 0
    count = 0
    num_items = num_slots * Q_HEADS
    item = gl.program_id(0)
    while item < num_items:
        head, q_start, q_len, kv_start, kv_len, m0, num_tiles, first_tile = _ragged_item(
            item, num_slots, qo_indptr, kv_indptr, num_seqs, causal, window_left, WINDOW)
        num_tiles = _hand_over(q_desc, q_smem, q_full, q_empty, item_smem, count, batch_ok, head,
                               q_start, q_len, kv_len, m0, num_tiles, first_tile)  # fmt: skip
        _load_kv_tiles(k_desc, v_desc, v_ptr, v_row_stride, k_smem, v_smem, k_full, k_empty,
                       v_full, v_empty, tile, head, kv_start, kv_len, num_tiles, first_tile,
                       total_kv)  # fmt: skip
        tile += num_tiles
        count += 1
        item = _next_item(counter, num_items)
    _end_of_work(q_empty, q_full, item_smem, count)


@gluon.jit
def _ragged_consumer(q_half, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                     turns, item_smem, out_ptr, lse_ptr, qk_scale, out_row_stride, causal,
                     pingpong, wg, window_left=-1, WINDOW: gl.constexpr = False):
    """One consumer warpgroup of the ragged kernel: rows wg x 64 .. wg x 64 + 63 of each item's
    row block (_consume_item), its output and LSE; the item's numbers from the producer.
    WINDOW: the sliding window's (the item's tiles from first_tile)."""
    cols, rows = _index_ranges()
    tile = 0
    count = 0
    mbarrier.wait(q_full, 0)  # the item's numbers are written
    head, q_start, q_len, kv_len, m0, num_tiles, first_tile, _ = _get_item(item_smem)
    while head >= 0:  # until the producer's end of work
        _consume_item(q_half, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                      turns, out_ptr, lse_ptr, q_start, m0 + wg * HALF_M, q_len, kv_len,
                      kv_len - q_len, num_tiles, head, tile, count, qk_scale, out_row_stride,
                      causal, pingpong, wg, cols, rows, True, first_tile, window_left,
                      WINDOW)  # fmt: skip
        tile += num_tiles
        count += 1
        mbarrier.wait(q_full, count & 1)
        head, q_start, q_len, kv_len, m0, num_tiles, first_tile, _ = _get_item(item_smem)


@gluon.jit
def _ragged_consumer_0(q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                       turns, item_smem, out_ptr, lse_ptr, qk_scale, out_row_stride, causal,
                       pingpong):
    _ragged_consumer(q_smem.index(0), k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
                     v_empty, turns, item_smem, out_ptr, lse_ptr, qk_scale, out_row_stride,
                     causal, pingpong, 0)


@gluon.jit
def _ragged_consumer_1(q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                       turns, item_smem, out_ptr, lse_ptr, qk_scale, out_row_stride, causal,
                       pingpong):
    _ragged_consumer(q_smem.index(1), k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
                     v_empty, turns, item_smem, out_ptr, lse_ptr, qk_scale, out_row_stride,
                     causal, pingpong, 1)


@gluon.jit
def _window_consumer_0(q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                       turns, item_smem, out_ptr, lse_ptr, qk_scale, out_row_stride, causal,
                       pingpong, window_left):
    _ragged_consumer(q_smem.index(0), k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
                     v_empty, turns, item_smem, out_ptr, lse_ptr, qk_scale, out_row_stride,
                     causal, pingpong, 0, window_left, True)


@gluon.jit
def _window_consumer_1(q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                       turns, item_smem, out_ptr, lse_ptr, qk_scale, out_row_stride, causal,
                       pingpong, window_left):
    _ragged_consumer(q_smem.index(1), k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
                     v_empty, turns, item_smem, out_ptr, lse_ptr, qk_scale, out_row_stride,
                     causal, pingpong, 1, window_left, True)


# ---- Page size 64 (gluon_paged_fwd) --------------------------------------------------------------
# The ragged kernel over a paged cache [pages, 64, 8, 128]: kv_indptr counts kv_indices entries
# (pages), a sequence's keys are (pages - 1) x 64 + kv_last_page_len[s], and a key tile is two
# pages, each one TMA box of 64 rows from a flat view of the cache ([rows, 8 x 128], page p from
# row p x rows_per_page: page strides that are whole tokens). A page id outside [0, num_pages)
# (or a tile's second page past the sequence) is read from row -64, outside the view: TMA fills
# K with NaN (the K descriptor's padding), so every row that sees a key there comes out NaN,
# and V with zeros. A sequence's last V tile, when partial, comes in by cp.async from its pages
# (zeros past its keys: the slots past the last page's length may hold anything). A sequence
# with pages whose last length is outside [1, 64] computes nothing and its rows come out NaN.


@gluon.jit
def _paged_item(item, num_slots, qo_indptr, kv_indptr, kv_last_page_len, num_seqs):
    """_ragged_item's numbers for a causal paged batch, kv_start the sequence's first
    kv_indices entry, and poisoned (1: a bad last-page length, no key tiles)."""
    head, seq, q_start, q_len, m0 = _item_rows(item, num_slots, qo_indptr, num_seqs)
    kv_start = gl.load(kv_indptr + seq)
    pages = gl.load(kv_indptr + seq + 1) - kv_start
    last = gl.load(kv_last_page_len + seq)
    last_ok = (pages == 0) | ((last >= 1) & (last <= PAGE))
    kv_len = gl.where(last_ok & (pages > 0), (pages - 1) * PAGE + last, 0)
    num_tiles = _key_tiles(m0, q_len, kv_len, 1)
    return head, q_start, q_len, kv_start, kv_len, m0, num_tiles, gl.where(last_ok, 0, 1)


@gluon.jit
def _page_row(kv_indices, entry, listed, num_pages, rows_per_page):
    """The flat view's row of page kv_indices[entry]'s first slot, or -PAGE (nothing read) when
    the entry is not listed or holds an id outside [0, num_pages)."""
    page = -1
    if listed:
        page = gl.load(kv_indices + entry)
    return gl.where((page >= 0) & (page < num_pages), page * rows_per_page, -PAGE)


@gluon.jit
def _gather_paged_v(v_ptr, v_tile, row0, row1, keys, kv_col):
    """The producer warp's cp.async of a last V tile of `keys` < KV_BLOCK keys from its two
    pages (their flat rows row0, row1: _page_row), zeros in its rows from `keys` on and in a
    page not read, 8 rows a step (one swizzle atom)."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [1, 1], [1, 0])
    r = gl.arange(0, 8, layout=gl.SliceLayout(1, layout))
    c = gl.arange(0, DIM, layout=gl.SliceLayout(0, layout))
    for r0 in gl.static_range(0, KV_BLOCK, 8):
        rows = r0 + r
        if r0 < PAGE:
            page_row = row0
        else:
            page_row = row1
        read = (rows < keys) & (page_row >= 0)
        flat_rows = (page_row + rows % PAGE).to(gl.int64)
        ptrs = v_ptr + (flat_rows * (KV_HEADS * DIM) + kv_col)[:, None] + c[None, :]
        async_copy.async_copy_global_to_shared(v_tile.slice(r0, 8), ptrs, mask=read[:, None])


@gluon.jit
def _load_paged_tiles(k_desc, v_desc, v_ptr, kv_indices, k_smem, v_smem, k_full, k_empty,
                      v_full, v_empty, tile, head, kv_start, kv_len, num_tiles, num_pages,
                      k_rows_per_page, v_rows_per_page):
    """The producer's loads of an item's num_tiles key tiles through the ring from its tile
    `tile`: two page boxes for each of K and V; a partial last V tile by _gather_paged_v."""
    kv_col = (head // (Q_HEADS // KV_HEADS)) * DIM
    pages = (kv_len + PAGE - 1) // PAGE
    for i in range(num_tiles):
        stage = (tile + i) % RING
        phase = ((tile + i) // RING) & 1
        entry = kv_start + 2 * i
        second = 2 * i + 1 < pages
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        mbarrier.expect(k_full.index(stage), 2 * k_desc.block_type.nbytes)
        k_tile = k_smem.index(stage)
        row0 = _page_row(kv_indices, entry, True, num_pages, k_rows_per_page)
        row1 = _page_row(kv_indices, entry + 1, second, num_pages, k_rows_per_page)
        tma.async_copy_global_to_shared(k_desc, [row0, kv_col], k_full.index(stage),
                                        k_tile.slice(0, PAGE))
        tma.async_copy_global_to_shared(k_desc, [row1, kv_col], k_full.index(stage),
                                        k_tile.slice(PAGE, PAGE))
        if v_rows_per_page != k_rows_per_page:
            row0 = _page_row(kv_indices, entry, True, num_pages, v_rows_per_page)
            row1 = _page_row(kv_indices, entry + 1, second, num_pages, v_rows_per_page)
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        v_tile = v_smem.index(stage)
        keys = kv_len - i * KV_BLOCK
        if keys < KV_BLOCK:
            _gather_paged_v(v_ptr, v_tile, row0, row1, keys, kv_col)
            async_copy.mbarrier_arrive(v_full.index(stage))
            mbarrier.arrive(v_full.index(stage))
        else:
            mbarrier.expect(v_full.index(stage), 2 * v_desc.block_type.nbytes)
            tma.async_copy_global_to_shared(v_desc, [row0, kv_col], v_full.index(stage),
                                            v_tile.slice(0, PAGE))
            tma.async_copy_global_to_shared(v_desc, [row1, kv_col], v_full.index(stage),
                                            v_tile.slice(PAGE, PAGE))


@gluon.jit
def _paged_producer(q_desc, k_desc, v_desc, v_ptr, q_smem, k_smem, v_smem, q_full, q_empty,
                    k_full, k_empty, v_full, v_empty, item_smem, qo_indptr, kv_indptr,
                    kv_indices, kv_last_page_len, num_seqs, num_slots, total_q, num_entries,
                    num_pages, k_rows_per_page, v_rows_per_page, counter):
    """_ragged_producer over a paged batch (_paged_item, _load_paged_tiles). If the indptr
    arrays are not a partition (kv_indptr's of num_entries kv_indices entries), every item goes
    to the consumers empty and the FA-2 kernel launched after this one takes the batch."""
    batch_ok = _is_partition(qo_indptr, kv_indptr, num_seqs, total_q, num_entries, 1)
    tile = 0
    count = 0
    num_items = num_slots * Q_HEADS
    item = gl.program_id(0)
    while item < num_items:
        head, q_start, q_len, kv_start, kv_len, m0, num_tiles, poisoned = _paged_item(
            item, num_slots, qo_indptr, kv_indptr, kv_last_page_len, num_seqs)
        num_tiles = _hand_over(q_desc, q_smem, q_full, q_empty, item_smem, count, batch_ok, head,
                               q_start, q_len, kv_len, m0, num_tiles, 0, poisoned)  # fmt: skip
        _load_paged_tiles(k_desc, v_desc, v_ptr, kv_indices, k_smem, v_smem, k_full, k_empty,
                          v_full, v_empty, tile, head, kv_start, kv_len, num_tiles, num_pages,
                          k_rows_per_page, v_rows_per_page)  # fmt: skip
        tile += num_tiles
        count += 1
        item = _next_item(counter, num_items)
    _end_of_work(q_empty, q_full, item_smem, count)


@gluon.jit
def _paged_consumer(q_half, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                    turns, item_smem, out_ptr, lse_ptr, qk_scale, out_row_stride,
                    pingpong, wg):
    """_ragged_consumer over a paged batch: causal, and an item's poison flag honoured."""
    cols, rows = _index_ranges()
    tile = 0
    count = 0
    mbarrier.wait(q_full, 0)  # the item's numbers are written
    head, q_start, q_len, kv_len, m0, num_tiles, _, poisoned = _get_item(item_smem)
    while head >= 0:  # until the producer's end of work
        _consume_item(q_half, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                      turns, out_ptr, lse_ptr, q_start, m0 + wg * HALF_M, q_len, kv_len,
                      kv_len - q_len, num_tiles, head, tile, count, qk_scale, out_row_stride,
                      1, pingpong, wg, cols, rows, True, poisoned=poisoned)  # fmt: skip
        tile += num_tiles
        count += 1
        mbarrier.wait(q_full, count & 1)
        head, q_start, q_len, kv_len, m0, num_tiles, _, poisoned = _get_item(item_smem)


@gluon.jit
def _paged_consumer_0(q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                      turns, item_smem, out_ptr, lse_ptr, qk_scale, out_row_stride,
                      pingpong):
    _paged_consumer(q_smem.index(0), k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
                    v_empty, turns, item_smem, out_ptr, lse_ptr, qk_scale,
                    out_row_stride, pingpong, 0)


@gluon.jit
def _paged_consumer_1(q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                      turns, item_smem, out_ptr, lse_ptr, qk_scale, out_row_stride,
                      pingpong):
    _paged_consumer(q_smem.index(1), k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full,
                    v_empty, turns, item_smem, out_ptr, lse_ptr, qk_scale,
                    out_row_stride, pingpong, 1)


@gluon.jit
def _is_partition(qo_indptr, kv_indptr, num_seqs, total_q, total_kv, WARPS: gl.constexpr):
    """Both indptr arrays start at 0, end at their row count and never decrease (ragged_batch.
    is_partition), read by WARPS warps. Not: the kernel computes nothing, and the FA-2 kernel
    launched after it takes the malformed batch (its own checks and NaN rows)."""
    layout: gl.constexpr = gl.BlockedLayout([1], [32], [WARPS], [0])
    ok = (gl.load(qo_indptr) == 0) & (gl.load(qo_indptr + num_seqs) == total_q)
    ok = ok & (gl.load(kv_indptr) == 0) & (gl.load(kv_indptr + num_seqs) == total_kv)
    for base in range(0, num_seqs, 128):
        i = base + gl.arange(0, 128, layout=layout)
        in_batch = i < num_seqs
        q_step = gl.load(qo_indptr + i + 1, mask=in_batch, other=0) - gl.load(
            qo_indptr + i, mask=in_batch, other=0)
        kv_step = gl.load(kv_indptr + i + 1, mask=in_batch, other=0) - gl.load(
            kv_indptr + i, mask=in_batch, other=0)
        ok = ok & (gl.min(gl.minimum(q_step, kv_step), axis=0) >= 0)
    return ok


@gluon.jit
def _ring(q_desc, k_desc, v_desc, PER_SEQUENCE: gl.constexpr = False):
    """Every kernel's shared memory: Q's two halves, the K / V ring of [KV_BLOCK, DIM] tiles
    (PER_SEQUENCE: [1, KV_BLOCK, DIM], as the padded kernel's descriptors give them; the
    descriptors' layouts), and their barriers, initialized (full: the producer's one arrival
    and its bytes; empty: one arrival a consumer warpgroup; turns: pingpong's)."""
    dtype: gl.constexpr = q_desc.dtype
    q_smem = gl.allocate_shared_memory(dtype, [2, HALF_M, DIM], q_desc.layout)
    if PER_SEQUENCE:
        k_smem = gl.allocate_shared_memory(dtype, [RING, 1, KV_BLOCK, DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [RING, 1, KV_BLOCK, DIM], v_desc.layout)
    else:
        k_smem = gl.allocate_shared_memory(dtype, [RING, KV_BLOCK, DIM], k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [RING, KV_BLOCK, DIM], v_desc.layout)
    bar_layout: gl.constexpr = mbarrier.MBarrierLayout()
    q_full = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    q_empty = gl.allocate_shared_memory(gl.int64, [1], bar_layout)
    k_full = gl.allocate_shared_memory(gl.int64, [RING, 1], bar_layout)
    k_empty = gl.allocate_shared_memory(gl.int64, [RING, 1], bar_layout)
    v_full = gl.allocate_shared_memory(gl.int64, [RING, 1], bar_layout)
    v_empty = gl.allocate_shared_memory(gl.int64, [RING, 1], bar_layout)
    mbarrier.init(q_full, count=1)
    mbarrier.init(q_empty, count=2)  # one arrive a consumer warpgroup
    turns = gl.allocate_shared_memory(gl.int64, [2, 1], bar_layout)
    mbarrier.init(turns.index(0), count=1)
    mbarrier.init(turns.index(1), count=1)
    for s in gl.static_range(RING):
        mbarrier.init(k_full.index(s), count=1)
        mbarrier.init(k_empty.index(s), count=2)
        mbarrier.init(v_full.index(s), count=1)
        mbarrier.init(v_empty.index(s), count=2)
    return q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty, turns


# window_left changes from call to call under one plan (its compiled kernel cached): not
# specialized (a first call's 1 or multiple of 16 would be compiled in).
@gluon.jit(do_not_specialize=["window_left"])
def gluon_ragged_fwd(q_desc, k_desc, v_desc, v_ptr, out_ptr, lse_ptr, qo_indptr, kv_indptr,
                     num_seqs, total_q, total_kv, v_row_stride, out_row_stride, qk_scale, causal,
                     pingpong, window_left, counter, NUM_HEADS: gl.constexpr,
                     NUM_KV_HEADS: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                     HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                     CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr,
                     WINDOW: gl.constexpr = False):
    """gluon_padded_fwd's structure over a ragged batch: q_desc views q as [total_q, heads x
    HEAD_DIM] in 64-row halves, k_desc / v_desc view k / v as [total_kv, heads x HEAD_DIM] in
    tiles of BLOCK_N keys; v_ptr is v itself, for the tail copies (v_row_stride elements a
    token). Writes out [total_q, 32, 128] (out_row_stride a token) and lse [total_q, 32].
    WINDOW (causal): the sliding window, window_left >= 0 (unread otherwise); an item loads
    and computes only the key tiles that meet its rows' bands."""
    gl.static_assert(BLOCK_M == 2 * HALF_M)
    gl.static_assert(BLOCK_N == KV_BLOCK)
    gl.static_assert(NUM_HEADS == Q_HEADS and NUM_KV_HEADS == KV_HEADS)
    num_slots = total_q // BLOCK_M + num_seqs
    q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty, turns = (
        _ring(q_desc, k_desc, v_desc))
    # The current item's numbers (_put_item), from the producer to the consumers.
    item_smem = gl.allocate_shared_memory(gl.int32, [32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    consumer_args = (q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                     turns, item_smem, out_ptr, lse_ptr, qk_scale, out_row_stride, causal,
                     pingpong)  # fmt: skip
    producer_args = (q_desc, k_desc, v_desc, v_ptr, v_row_stride, q_smem, k_smem, v_smem, q_full,
                     q_empty, k_full, k_empty, v_full, v_empty, item_smem, qo_indptr, kv_indptr,
                     num_seqs, num_slots, total_q, total_kv, causal, counter)  # fmt: skip
    # Partitions take no constexpr: the window's are their own functions.
    if WINDOW:
        gl.warp_specialize([(_window_consumer_0, consumer_args + (window_left,)),
                            (_window_consumer_1, consumer_args + (window_left,)),
                            (_window_producer, producer_args + (window_left,))],
                           [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])  # fmt: skip
    else:
        gl.warp_specialize([(_ragged_consumer_0, consumer_args),
                            (_ragged_consumer_1, consumer_args),
                            (_ragged_producer, producer_args)],
                           [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])  # fmt: skip


@gluon.jit
def gluon_paged_fwd(q_desc, k_desc, v_desc, v_ptr, out_ptr, lse_ptr, qo_indptr, kv_indptr,
                    kv_indices, kv_last_page_len, num_seqs, total_q, num_entries, num_pages,
                    k_rows_per_page, v_rows_per_page, out_row_stride, qk_scale, pingpong, counter,
                    NUM_HEADS: gl.constexpr, NUM_KV_HEADS: gl.constexpr, BLOCK_M: gl.constexpr,
                    BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, STAGES: gl.constexpr,
                    CONSUMER_REGISTERS: gl.constexpr, PRODUCER_REGISTERS: gl.constexpr):
    """gluon_ragged_fwd's structure over a causal paged batch of page size 64 (the section
    above): q_desc as the ragged kernel's, k_desc / v_desc view the caches flat ([rows, 8 x
    HEAD_DIM], boxes of one page: 64 rows; K's padding NaN, V's zeros); v_ptr is v_cache, for
    the last tiles' copies. kv_indptr indexes kv_indices (num_entries entries) of page ids
    below num_pages, page p at flat row p x k_rows_per_page (v_rows_per_page). Writes out and
    lse as the ragged kernel does."""
    gl.static_assert(BLOCK_M == 2 * HALF_M)
    gl.static_assert(BLOCK_N == KV_BLOCK and BLOCK_N == 2 * PAGE)
    gl.static_assert(NUM_HEADS == Q_HEADS and NUM_KV_HEADS == KV_HEADS)
    num_slots = total_q // BLOCK_M + num_seqs
    q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty, turns = (
        _ring(q_desc, k_desc, v_desc))
    item_smem = gl.allocate_shared_memory(gl.int32, [32], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    consumer_args = (q_smem, k_smem, v_smem, q_full, q_empty, k_full, k_empty, v_full, v_empty,
                     turns, item_smem, out_ptr, lse_ptr, qk_scale, out_row_stride,
                     pingpong)  # fmt: skip
    producer_args = (q_desc, k_desc, v_desc, v_ptr, q_smem, k_smem, v_smem, q_full, q_empty,
                     k_full, k_empty, v_full, v_empty, item_smem, qo_indptr, kv_indptr,
                     kv_indices, kv_last_page_len, num_seqs, num_slots, total_q, num_entries,
                     num_pages, k_rows_per_page, v_rows_per_page, counter)  # fmt: skip
    gl.warp_specialize([(_paged_consumer_0, consumer_args),
                        (_paged_consumer_1, consumer_args),
                        (_paged_producer, producer_args)],
                       [4, 1], [CONSUMER_REGISTERS, PRODUCER_REGISTERS])  # fmt: skip


def tma_readable(x) -> bool:
    """Whether TMA can read x [batch, seq, heads, HEAD_DIM] as [batch, seq, heads x HEAD_DIM]
    with x's own strides (a slice of a fused QKV projection keeps its token stride): unit steps
    within a token, 16-byte token and batch steps and base (the base is checked on every call
    by check_placement)."""
    size = x.element_size()
    return (x.stride(3) == 1 and x.stride(2) == HEAD_DIM and (x.stride(1) * size) % 16 == 0
            and (x.stride(0) * size) % 16 == 0)  # fmt: skip


# The kernel's constexprs and launch options (triton_prefill launches the compiled kernel
# directly once warm: its _cached_launch).
CONSTEXPRS = dict(NUM_HEADS=NUM_HEADS, NUM_KV_HEADS=NUM_KV_HEADS, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
                  HEAD_DIM=HEAD_DIM, STAGES=STAGES, CONSUMER_REGISTERS=CONSUMER_REGISTERS,
                  PRODUCER_REGISTERS=PRODUCER_REGISTERS, num_warps=4)  # fmt: skip
# The ragged kernel's, without and with the sliding window (run_ragged_swa). Every constexpr
# named: _cached_launch passes a compiled kernel all of them, defaults included.
RAGGED_CONSTEXPRS = dict(CONSTEXPRS, WINDOW=False)
WINDOW_CONSTEXPRS = dict(CONSTEXPRS, WINDOW=True)
PAGED_CONSTEXPRS = CONSTEXPRS


@functools.lru_cache(maxsize=None)
def _layouts(dtype: torch.dtype) -> tuple:
    """The shared-memory layouts of Q's half tiles and of K / V tiles (the descriptors')."""
    element = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[dtype]
    return (gl.NVMMASharedLayout.get_default_for([BLOCK_M // 2, HEAD_DIM], element),
            gl.NVMMASharedLayout.get_default_for([1, BLOCK_N, HEAD_DIM], element))


@functools.lru_cache(maxsize=None)
def _paged_layouts(dtype: torch.dtype) -> tuple:
    """The paged kernel's: Q's half tiles and one page's K / V box (64 rows)."""
    element = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[dtype]
    return (gl.NVMMASharedLayout.get_default_for([BLOCK_M // 2, HEAD_DIM], element),
            gl.NVMMASharedLayout.get_default_for([PAGE_SIZE, HEAD_DIM], element))


@functools.lru_cache(maxsize=None)
def _ragged_layouts(dtype: torch.dtype) -> tuple:
    """The ragged kernel's: Q's half tiles and flat K / V tiles."""
    element = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16}[dtype]
    return (gl.NVMMASharedLayout.get_default_for([BLOCK_M // 2, HEAD_DIM], element),
            gl.NVMMASharedLayout.get_default_for([BLOCK_N, HEAD_DIM], element))


def _descriptor(base, shape, strides, block_shape, layout, padding="zero") -> TensorDescriptor:
    """A TensorDescriptor without the checks of its constructor (a third of launch_args' host
    time): run_padded's plan and check_placement made them (tma_readable, 16-byte bases,
    positive sizes). padding: what TMA writes for rows outside the view ("zero", "nan")."""
    descriptor = object.__new__(TensorDescriptor)
    descriptor.base, descriptor.shape, descriptor.strides = base, shape, strides
    descriptor.block_shape, descriptor.layout, descriptor.padding = block_shape, layout, padding
    return descriptor


def grid(batch: int, seq_q: int, num_sms: int) -> tuple:
    """The persistent grid (plan time): one CTA an SM, at most one an item."""
    items = (seq_q + BLOCK_M - 1) // BLOCK_M * batch * NUM_HEADS
    return (min(items, num_sms),)


# Items drawn in sections of (sequence, KV head) units whose K and V fit this much of L2 (CUDA's
# kL2SectionBytes, measured there: cuda/TUNING.md, "Items in L2 sections").
L2_SECTION_BYTES = 16 << 20


def padded_schedule(batch: int, seq_q: int, seq_kv: int, causal: bool, ctas: int) -> list:
    """The padded kernel's items per CTA (plan time), as one int32 table: CTA c runs items
    table[table[c]] .. table[table[c + 1] - 1] in that order, and a pad ends the table (each
    partition reads an item ahead).

    The order the items are handed out is CUDA's (l2_section_order): (sequence, KV head) units
    in sections whose K / V fit L2_SECTION_BYTES, each section row block by row block, the last
    first (the heaviest when causal), so the items in flight share their K / V in L2 (level by
    level over every unit, 8 x 2048 re-read K / V from DRAM at each level: 627 MB read against
    210 MB for CUDA's, ncu). Each item goes to the CTA with the least work so far (key tiles + 1
    an item, the + 1 for its Q, first S and epilogue), as a counter drawn by free CTAs would,
    so the CTAs' sums differ by at most an item's (a round robin: 3-6% idle on 8 x 2048 and
    1 x 8192 causal, from the count of items a CTA gets)."""
    num_m_blocks = (seq_q + BLOCK_M - 1) // BLOCK_M
    batch_heads = batch * NUM_HEADS
    kv_tiles = (seq_kv + BLOCK_N - 1) // BLOCK_N
    group = NUM_HEADS // NUM_KV_HEADS
    units = batch * NUM_KV_HEADS
    unit_bytes = 2 * seq_kv * HEAD_DIM * 2  # K and V of one (sequence, KV head), 16-bit
    section = max(1, min(units, L2_SECTION_BYTES // max(unit_bytes, 1)))
    per_cta = [[] for _ in range(ctas)]
    loads = [(0, c) for c in range(ctas)]
    for first_unit in range(0, units, section):
        for m_block in reversed(range(num_m_blocks)):
            tiles = kv_tiles
            if causal:  # as _item: the block's last row sees keys up to m0 + 127 + seq_kv - seq_q
                last_key = m_block * BLOCK_M + BLOCK_M - 1 + seq_kv - seq_q
                tiles = max(min(kv_tiles, (last_key + BLOCK_N) // BLOCK_N), 0)
            level = (num_m_blocks - 1 - m_block) * batch_heads  # _item's numbering
            for unit in range(first_unit, min(first_unit + section, units)):
                for head in range(unit * group, unit * group + group):  # (batch x 32 + head)
                    load, cta = heapq.heappop(loads)
                    per_cta[cta].append(level + head)
                    heapq.heappush(loads, (load + tiles + 1, cta))
    starts = itertools.accumulate(map(len, per_cta), initial=ctas + 1)
    return [*starts, *itertools.chain.from_iterable(per_cta), 0]


def launch_args(q, k, v, out, seq_q, seq_kv, qk_scale, causal, schedule,
                pingpong=False) -> tuple:  # fmt: skip
    """The run-time arguments of gluon_padded_fwd (every call: the descriptors hold the data
    pointers) for q [batch, seq_q, 32, 128] and k / v [batch, seq_kv, 8, 128] (tma_readable;
    q's batch step seq_q token steps) into out [batch, seq_q, 32, 128] (out.stride(0) == seq_q
    x out.stride(1)). Q is described as [batch x seq_q, columns] in 64-row halves (a row block
    may run into the next sequence: those rows are never stored), K / V per sequence ([batch,
    seq_kv, columns]) in tiles of BLOCK_N keys. qk_scale holds log2(e); schedule: the plan's
    padded_schedule on q's device; pingpong: the module docstring."""
    q_layout, kv_layout = _layouts(q.dtype)
    batch, columns = q.shape[0], NUM_KV_HEADS * HEAD_DIM
    q_desc = _descriptor(q, [batch * seq_q, NUM_HEADS * HEAD_DIM], [q.stride(1), 1],
                         [BLOCK_M // 2, HEAD_DIM], q_layout)  # fmt: skip
    k_desc = _descriptor(k, [batch, seq_kv, columns], [k.stride(0), k.stride(1), 1],
                         [1, BLOCK_N, HEAD_DIM], kv_layout)  # fmt: skip
    v_desc = _descriptor(v, [batch, seq_kv, columns], [v.stride(0), v.stride(1), 1],
                         [1, BLOCK_N, HEAD_DIM], kv_layout)  # fmt: skip
    return (q_desc, k_desc, v_desc, out, schedule, seq_q, seq_kv, out.stride(1), qk_scale,
            int(causal), int(pingpong))  # fmt: skip


def ragged_grid(batch: int, total_q: int, num_sms: int) -> tuple:
    """The ragged kernel's persistent grid (plan time)."""
    items = (total_q // BLOCK_M + batch) * NUM_HEADS
    return (min(items, num_sms),)


def ragged_launch_args(q, k, v, out, lse, qo_indptr, kv_indptr, batch, qk_scale,
                       pingpong=False, window_left=None) -> tuple:  # fmt: skip
    """The run-time arguments of gluon_ragged_fwd for q [total_q, 32, 128], k / v [total_kv, 8,
    128] (tma_readable rows), out [total_q, 32, 128], lse [total_q, 32] and the indptr arrays
    of `batch` sequences. qk_scale holds log2(e); window_left: an int >= 0 for the WINDOW
    kernel, None (passed as -1) for the other."""
    q_layout, kv_layout = _ragged_layouts(q.dtype)
    total_q, total_kv, columns = q.shape[0], k.shape[0], NUM_KV_HEADS * HEAD_DIM
    q_desc = _descriptor(q, [total_q, NUM_HEADS * HEAD_DIM], [q.stride(0), 1],
                         [BLOCK_M // 2, HEAD_DIM], q_layout)  # fmt: skip
    k_desc = _descriptor(k, [total_kv, columns], [k.stride(0), 1], [BLOCK_N, HEAD_DIM],
                         kv_layout)  # fmt: skip
    v_desc = _descriptor(v, [total_kv, columns], [v.stride(0), 1], [BLOCK_N, HEAD_DIM],
                         kv_layout)  # fmt: skip
    return (q_desc, k_desc, v_desc, v, out, lse, qo_indptr, kv_indptr, batch, total_q, total_kv,
            v.stride(0), out.stride(0), qk_scale, 1, int(pingpong),
            -1 if window_left is None else window_left, item_counter(q.device))  # fmt: skip


def page_rows(cache) -> int:
    """Rows of the flat view ([rows, 8 x HEAD_DIM]) between two pages of a [pages, 64, 8, 128]
    cache, or 0 when its page stride is not whole tokens (the paged kernel cannot view it)."""
    token = NUM_KV_HEADS * HEAD_DIM
    return cache.stride(0) // token if cache.stride(0) % token == 0 else 0


def paged_suits(k_cache, v_cache) -> bool:
    """Whether gluon_paged_fwd can read these caches: tokens dense within a page (the layout
    check), page strides of whole tokens, and every flat row index below 2**31."""
    num_pages = k_cache.shape[0]
    return all(
        page_rows(cache) > 0 and (num_pages - 1) * page_rows(cache) + PAGE_SIZE < 2**31
        for cache in (k_cache, v_cache)
    )


def paged_launch_args(q, k_cache, v_cache, out, lse, qo_indptr, kv_indptr, kv_indices,
                      kv_last_page_len, batch, qk_scale, pingpong=False) -> tuple:  # fmt: skip
    """The run-time arguments of gluon_paged_fwd for q [total_q, 32, 128] (tma_readable rows),
    caches [pages, 64, 8, 128] (paged_suits), out [total_q, 32, 128], lse [total_q, 32], the
    indptr arrays of `batch` sequences, kv_indices and kv_last_page_len. The caches are viewed
    flat, down to the last page's last row; K's rows outside the view read as NaN, V's as 0."""
    q_layout, kv_layout = _paged_layouts(q.dtype)
    total_q, num_pages, columns = q.shape[0], k_cache.shape[0], NUM_KV_HEADS * HEAD_DIM
    q_desc = _descriptor(q, [total_q, NUM_HEADS * HEAD_DIM], [q.stride(0), 1],
                         [BLOCK_M // 2, HEAD_DIM], q_layout)  # fmt: skip
    k_rows, v_rows = page_rows(k_cache), page_rows(v_cache)
    k_desc = _descriptor(k_cache, [(num_pages - 1) * k_rows + PAGE_SIZE, columns], [columns, 1],
                         [PAGE_SIZE, HEAD_DIM], kv_layout, "nan")  # fmt: skip
    v_desc = _descriptor(v_cache, [(num_pages - 1) * v_rows + PAGE_SIZE, columns], [columns, 1],
                         [PAGE_SIZE, HEAD_DIM], kv_layout)  # fmt: skip
    return (q_desc, k_desc, v_desc, v_cache, out, lse, qo_indptr, kv_indptr, kv_indices,
            kv_last_page_len, batch, total_q, kv_indices.shape[0], num_pages, k_rows, v_rows,
            out.stride(0), qk_scale, int(pingpong), item_counter(q.device))  # fmt: skip


_counters = {}


def item_counter(device) -> torch.Tensor:
    """The ragged and paged kernels' item counter (int32[2], zero between launches: the last
    CTA of a launch zeroes it) for the current stream of `device`: kernels on two streams may
    run at once, each drawing from its own. A call captured into a CUDA graph gets a counter of
    its own (the graph's, zeroed at each replay), so a replay on any stream shares none."""
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return torch.zeros(2, dtype=torch.int32, device=device)
    # The raw stream handle, as triton's own launcher reads it: torch.cuda.current_stream builds
    # a Stream object (~3 us of host time a call on the H200 machine).
    stream = torch._C._cuda_getCurrentRawStream(device.index) if device.type == "cuda" else None
    key = (device.type, device.index, stream)
    counter = _counters.get(key)
    if counter is None:
        counter = _counters[key] = torch.zeros(2, dtype=torch.int32, device=device)
    return counter
