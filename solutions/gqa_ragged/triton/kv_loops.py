"""The K/V tile loops of the attention kernel (attention_kernel.py): the online softmax over one
row block's key tiles (attend_kv_tiles) or two paired row blocks' (attend_kv_tiles_paired, one's
softmax beside the other's P V), masked or not, K/V loaded contiguous or through the page table
(of q's dtype or FP8, converted on load); and where a sliding window's band starts (band_start).
"""

import triton
import triton.language as tl

from .paged_kv import load_tile_pages, paged_tile_ptrs


@triton.jit
def round_to(x, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 x cast to dtype (fp16 or bf16), rounded to nearest even like the GPU's cast.

    The interpreter (tests only) keeps bf16 as raw bits: its fp32 -> bf16 cast truncates and its
    tl.dot multiplies the bit patterns. There the rounding is done on the fp32 bits and the value
    stays fp32 (the callers then use an fp32 tl.dot).
    """
    if INTERPRETED:
        if dtype == tl.bfloat16:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            return bits.to(tl.float32, bitcast=True)
        return x.to(dtype).to(tl.float32)
    return x.to(dtype)


@triton.jit
def _dot_kt(q, k, INTERPRETED: tl.constexpr):
    """q @ k^T in fp32 (the interpreter's bf16 dot is wrong: it multiplies in fp32 there)."""
    if INTERPRETED:
        return tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)))
    return tl.dot(q, tl.trans(k))


@triton.jit
def _scores(q, q_lo, k, INTERPRETED: tl.constexpr):
    """q @ k^T in fp32; with q_lo (split_q_fp8's second term; else None), (q + q_lo) @ k^T: two
    e4m3 products on the FP8 cache's own K."""
    # One return: the compiler generates the code after a constexpr `if` that returns too.
    if q_lo is None:
        scores = _dot_kt(q, k, INTERPRETED)
    elif INTERPRETED:
        scores = _dot_kt(q, k, INTERPRETED) + _dot_kt(q_lo, k, INTERPRETED)
    else:
        scores = tl.dot(q_lo, tl.trans(k), tl.dot(q, tl.trans(k)))
    return scores


@triton.jit
def _load_v_tile(ptrs, in_seq, q, q_lo, MASKED: tl.constexpr, INTERPRETED: tl.constexpr):
    """A V tile in q's dtype; float16 when q is split (q_lo not None: an FP8 cache under bf16
    q): e4m3 -> f16 is one hardware cvt a pair (the bit-level bf16 conversion takes four), and
    P V then runs in f16 (P <= 1 keeps 11 significant bits, bf16's 8; |V| <= 448)."""
    if q_lo is None:
        v = _load_kv_tile(ptrs, in_seq, q.dtype, MASKED, INTERPRETED)
    else:
        v = _load_kv_tile(ptrs, in_seq, tl.float16, MASKED, INTERPRETED)
    return v


@triton.jit
def _round_e4m3(x):
    """fp32 x rounded to the nearest even e4m3 value, kept fp32 (the interpreter's own cast
    drops the carry when rounding reaches the next power of two: 1.94 -> 1.0). Normal values
    keep 3 mantissa bits; below 2^-6 e4m3 steps by 2^-9 (adding 1.5 x 2^14 rounds there). No
    saturation: split_q_fp8's values stay below 256."""
    bits = x.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    subnormal = (x + 24576.0) - 24576.0
    return tl.where(tl.abs(x) < 0.015625, subnormal, normal)


@triton.jit
def split_q_fp8(q, qk_scale, INTERPRETED: tl.constexpr):
    """A bf16 Q tile as two e4m3 terms and the rows' softmax scales: q_hi + q_lo = q * 2^e_row
    with e_row = 7 - floor(log2(max |q_row|)), so the row's largest value lands in [128, 256)
    (e4m3 reaches 448), q_hi holds a value's top 4 significant bits and q_lo the next 4: bf16's
    8 bits, exact for values from 1/4 up once scaled, within 2^-10 below (e4m3's subnormals).
    Q K^T then runs as two FP8 products on an FP8 cache's K as it is read, no conversion, as
    accurate as bf16 q (triton/TUNING.md: one e4m3 term alone was 8-35x the normwise error);
    qk_scale * 2^-e_row undoes the scaling in the softmax's one FMA. Exponents clamp to
    [-100, 100] (an all-zero row: any scale; a bf16 row's largest is below 2^128). A row
    holding inf is scaled by NaN: e4m3's saturating cast would make inf finite, and the row's
    output must be NaN as with bf16 q (a NaN value stays NaN through the casts; the row max
    ignores it). The interpreter keeps both terms as fp32 values (_round_e4m3; _scores'
    fp32 dots)."""
    values = q.to(tl.float32)
    top = tl.max(tl.abs(values), 1).to(tl.int32, bitcast=True)
    biased = (top >> 23) & 0xFF
    exponent = tl.minimum(tl.maximum(biased - 127, -100), 100)
    scale = ((127 + 7 - exponent) << 23).to(tl.float32, bitcast=True)
    scale = tl.where(biased == 0xFF, float("nan"), scale)
    unscale = ((127 - 7 + exponent) << 23).to(tl.float32, bitcast=True)
    scaled = values * scale[:, None]
    if INTERPRETED:
        q_hi = _round_e4m3(scaled)
        q_lo = _round_e4m3(scaled - q_hi)
    else:
        q_hi = scaled.to(tl.float8e4nv)
        q_lo = (scaled - q_hi.to(tl.float32)).to(tl.float8e4nv)
    return q_hi, q_lo, qk_scale * unscale


@triton.jit
def _accumulate(acc, alpha, p, v, INTERPRETED: tl.constexpr):
    """acc * alpha + p @ v, p rounded to v's dtype (the second tl.dot takes the input dtype)."""
    p = round_to(p, v.dtype, INTERPRETED)
    if INTERPRETED:
        return tl.dot(p.to(tl.float32), v.to(tl.float32), acc * alpha[:, None])
    return tl.dot(p, v, acc * alpha[:, None])


@triton.jit
def _softmax_unmasked(qk, m_i, l_i, qk_scale, ROW_SCALED: tl.constexpr):
    """The online-softmax step of a tile that every row sees completely: m_new is finite, so no
    -inf guard; the scale is folded into one FMA per element. Returns p, alpha, m_new, l_new.
    ROW_SCALED: qk_scale is a vector, each row's own (split_q_fp8)."""
    m_new = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
    if ROW_SCALED:
        p = tl.math.exp2(qk * qk_scale[:, None] - m_new[:, None])
    else:
        p = tl.math.exp2(qk * qk_scale - m_new[:, None])
    alpha = tl.math.exp2(m_i - m_new)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _softmax_masked(qk, m_i, l_i, qk_scale, key_pos, in_seq, query_pos, causal_shift,
                    window_left, CAUSAL: tl.constexpr, WINDOW: tl.constexpr,
                    ROW_SCALED: tl.constexpr):  # fmt: skip
    """The online-softmax step of a tile that some rows see only in part (the causal diagonal,
    the sliding window's left edge, or keys past the sequence's end): hidden logits are -inf.
    Returns p, alpha, m_new, l_new."""
    visible = in_seq[None, :]
    if CAUSAL:
        visible = visible & (key_pos[None, :] <= query_pos[:, None] + causal_shift)
    if WINDOW:  # (causal_shift - window_left cannot overflow: the host keeps window_left < kv)
        visible = visible & (
            key_pos[None, :] >= (query_pos + (causal_shift - window_left))[:, None]
        )
    if ROW_SCALED:
        logits = tl.where(visible, qk * qk_scale[:, None], float("-inf"))
    else:
        logits = tl.where(visible, qk * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(logits, 1))
    # A row that has seen no key yet keeps max -inf; subtract 0 instead so that exp2 gives 0
    # rather than NaN (-inf - -inf).
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.math.exp2(logits - m_shift[:, None])
    alpha = tl.math.exp2(m_i - m_shift)
    return p, alpha, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def band_start(first_pos, last_pos, window_left, kv_full_end, BLOCK_N: tl.constexpr):
    """The left edge of the sliding window of query positions [first_pos, last_pos] (position p
    sees the keys [p - window_left, p]), in BLOCK_N tiles: (kv_lo, kv_band_full), the first
    tile that any of them sees, and the first from which on all of them see every key of every
    tile (at most kv_full_end, where the causal diagonal's tiles begin). The tiles before
    kv_lo are never visited; [kv_lo, kv_band_full) are the band's masked left edge."""
    kv_lo = tl.maximum(first_pos - window_left, 0) // BLOCK_N * BLOCK_N
    kv_band_full = tl.cdiv(tl.maximum(last_pos - window_left, 0), BLOCK_N) * BLOCK_N
    return kv_lo, tl.maximum(tl.minimum(kv_band_full, kv_full_end), kv_lo)


@triton.jit
def _e4m3_to_bf16(x):
    """e4m3 -> bfloat16, exact, four values a step off the conversion pipe: prmt's sign mode
    spreads two e4m3 bytes into 16-bit lanes sign-extended, shifted left by 4 a lane holds the
    sign at bit 15 and exponent and mantissa at bits 4 .. 10 (the mask drops the sign's
    copies), the bf16 of value x 2^-120 (subnormals too), which one bf16x2 multiply by 2^120
    makes exact; NaN reads as +-480, as in the CUDA and TileLang kernels (the constants:
    tests/test_tilelang_fp8.py checks them on every e4m3 value). Triton's own cast is a cvt to
    f16x2 and two F2F f16 -> bf16 a pair, all on the 16-a-clock pipe the softmax's exp2 needs."""
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 lo, hi, scale;
        mov.b32 scale, 0x7B807B80;
        prmt.b32 lo, $2, 0, 0x9180;
        prmt.b32 hi, $2, 0, 0xB3A2;
        shl.b32 lo, lo, 4;
        shl.b32 hi, hi, 4;
        and.b32 lo, lo, 0x87F087F0;
        and.b32 hi, hi, 0x87F087F0;
        mul.rn.bf16x2 $0, lo, scale;
        mul.rn.bf16x2 $1, hi, scale;
        }""",
        constraints="=r,=r,r",
        args=[x.to(tl.uint8, bitcast=True)],
        dtype=tl.bfloat16,
        is_pure=True,
        pack=4,
    )


@triton.jit
def _load_kv_tile(ptrs, in_seq, dtype: tl.constexpr, MASKED: tl.constexpr,
                  INTERPRETED: tl.constexpr):  # fmt: skip
    """One K or V tile, in dtype (q's). Masked: keys past the sequence belong to another one or
    lie out of bounds, so they load as zeros (p is 0 there, but 0 * NaN would not be).

    An FP8 cache's tile is read as FP8 (half the bytes) and converted on chip, exactly: every
    e4m3 value is a bf16 and an fp16 value (to bf16 by _e4m3_to_bf16 on the GPU; the
    interpreter casts). A cache of q's dtype casts nothing (the same code)."""
    if MASKED:
        tile = tl.load(ptrs, mask=in_seq[:, None], other=0.0)
    else:
        tile = tl.load(ptrs)
    if tile.dtype == tl.float8e4nv and dtype == tl.bfloat16 and not INTERPRETED:
        return _e4m3_to_bf16(tile)
    return tile.to(dtype)


@triton.jit
def attend_kv_tiles(
    acc,
    m_i,
    l_i,
    q,
    q_lo,
    k_seq,
    v_seq,
    query_pos,
    kv_lo,
    kv_hi,
    kv_len,
    causal_shift,
    window_left,
    qk_scale,
    pages,
    num_pages,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    K_TOKEN_STRIDE: tl.constexpr,
    V_TOKEN_STRIDE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    K_PAGE_STRIDE: tl.constexpr,
    V_PAGE_STRIDE: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    MASKED: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """Fold the keys [kv_lo, kv_hi) of one sequence into the running (acc, m_i, l_i).

    Logits are kept in base 2: qk * qk_scale = sm_scale * q.k * log2(e), so exp2 of them is
    exp of the scaled logit and exp2 maps to one hardware instruction. m_i is their running row
    max, l_i the running sum of exp2(logit - m_i). MASKED is False only for tiles that every row
    sees completely and that lie inside the sequence: those skip the bounds and causal masks.
    PAGE_SIZE > 0: k_seq and v_seq are paged caches at the KV head, pages the sequence's page
    ids (paged_kv.py). q_lo (None, or an FP8 cache's q split in two: split_q_fp8): q is q_hi,
    qk_scale the rows' scales, K stays e4m3 for the products and V is converted to float16
    (_load_v_tile).
    """
    key_offsets = tl.arange(0, BLOCK_N)
    dims = tl.arange(0, HEAD_DIM)[None, :]
    if PAGE_SIZE == 0:
        k_ptrs = k_seq + (kv_lo + key_offsets)[:, None] * K_TOKEN_STRIDE + dims
        v_ptrs = v_seq + (kv_lo + key_offsets)[:, None] * V_TOKEN_STRIDE + dims
    else:
        k_offsets = key_offsets[:, None] * K_TOKEN_STRIDE + dims  # inside a page: V's too
        next_pages = load_tile_pages(pages, kv_lo, kv_hi, kv_len, num_pages, BLOCK_N, PAGE_SIZE,
                                     MASKED)  # fmt: skip
    for tile_start in range(kv_lo, kv_hi, BLOCK_N):
        key_pos = tile_start + key_offsets
        in_seq = key_pos < kv_len  # only used when MASKED
        if PAGE_SIZE > 0:
            # Page ids a tile ahead (see attend_kv_tiles_paired).
            tile_pages = next_pages
            next_pages = load_tile_pages(pages, tile_start + BLOCK_N, kv_hi, kv_len, num_pages,
                                         BLOCK_N, PAGE_SIZE, MASKED)  # fmt: skip
            k_ptrs, v_ptrs = paged_tile_ptrs(
                k_seq, v_seq, tile_pages, tile_start, k_offsets, k_offsets, BLOCK_N=BLOCK_N,
                HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, TOKEN_STRIDE=K_TOKEN_STRIDE,
                K_PAGE_STRIDE=K_PAGE_STRIDE, V_PAGE_STRIDE=V_PAGE_STRIDE,
            )  # fmt: skip
        k = _load_kv_tile(k_ptrs, in_seq, q.dtype, MASKED, INTERPRETED)
        qk = _scores(q, q_lo, k, INTERPRETED)
        if MASKED:
            p, alpha, m_new, l_i = _softmax_masked(
                qk,
                m_i,
                l_i,
                qk_scale,
                key_pos,
                in_seq,
                query_pos,
                causal_shift,
                window_left,
                CAUSAL,
                WINDOW,
                q_lo is not None,
            )
        else:
            p, alpha, m_new, l_i = _softmax_unmasked(qk, m_i, l_i, qk_scale, q_lo is not None)
        v = _load_v_tile(v_ptrs, in_seq, q, q_lo, MASKED, INTERPRETED)
        acc = _accumulate(acc, alpha, p, v, INTERPRETED)
        m_i = m_new
        if PAGE_SIZE == 0:
            k_ptrs += BLOCK_N * K_TOKEN_STRIDE
            v_ptrs += BLOCK_N * V_TOKEN_STRIDE
    return acc, m_i, l_i


@triton.jit
def attend_kv_tiles_paired(
    acc_a,
    m_a,
    l_a,
    acc_b,
    m_b,
    l_b,
    q_a,
    q_b,
    q_lo_a,
    q_lo_b,
    k_seq,
    v_seq,
    query_pos_a,
    query_pos_b,
    kv_lo,
    kv_hi,
    kv_len,
    causal_shift,
    window_left,
    qk_scale,
    qk_scale_b,
    pages,
    num_pages,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    K_TOKEN_STRIDE: tl.constexpr,
    V_TOKEN_STRIDE: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    K_PAGE_STRIDE: tl.constexpr,
    V_PAGE_STRIDE: tl.constexpr,
    CAUSAL: tl.constexpr,
    WINDOW: tl.constexpr,
    MASKED: tl.constexpr,
    INTERPRETED: tl.constexpr,
):
    """attend_kv_tiles for two row blocks a and b that share every K/V tile (qk_scale_b: b's
    rows' scales when q is split, else qk_scale again).

    The order is the point (FA3's intra-warpgroup overlap, by hand): Triton 3.6 waits for a
    Q K^T dot at once, but leaves a P V dot whose result is only carried in flight until the
    next wait. So both Q K^T are issued first, then a's softmax, a's P V, b's softmax (while the
    tensor cores run a's P V) and b's P V. One row block alone leaves the tensor cores idle
    for its whole softmax.
    """
    key_offsets = tl.arange(0, BLOCK_N)
    # Scalar tile pointers and one int32 offset tensor that K and V share (when their token
    # strides agree, as in a fused QKV projection), in place of the 64-bit pointer tensors of
    # attend_kv_tiles: this loop needs every register.
    k_offsets = key_offsets[:, None] * K_TOKEN_STRIDE + tl.arange(0, HEAD_DIM)[None, :]
    if V_TOKEN_STRIDE == K_TOKEN_STRIDE:
        v_offsets = k_offsets
    else:
        v_offsets = key_offsets[:, None] * V_TOKEN_STRIDE + tl.arange(0, HEAD_DIM)[None, :]
    if PAGE_SIZE == 0:
        k_tile = k_seq + kv_lo * K_TOKEN_STRIDE
        v_tile = v_seq + kv_lo * V_TOKEN_STRIDE
    else:
        next_pages = load_tile_pages(pages, kv_lo, kv_hi, kv_len, num_pages, BLOCK_N, PAGE_SIZE,
                                     MASKED)  # fmt: skip
    for tile_start in range(kv_lo, kv_hi, BLOCK_N):
        key_pos = tile_start + key_offsets
        in_seq = key_pos < kv_len  # only used when MASKED
        if PAGE_SIZE == 0:
            k = _load_kv_tile(k_tile + k_offsets, in_seq, q_a.dtype, MASKED, INTERPRETED)
        else:
            # The page ids are read a tile ahead: Triton's pipeliner would otherwise make the
            # id load a stage of its own and wait for all copies in flight, K/V included, at
            # every tile (one tile of prefetch instead of num_stages - 1).
            tile_pages = next_pages
            next_pages = load_tile_pages(pages, tile_start + BLOCK_N, kv_hi, kv_len, num_pages,
                                         BLOCK_N, PAGE_SIZE, MASKED)  # fmt: skip
            k_ptrs, v_ptrs = paged_tile_ptrs(
                k_seq, v_seq, tile_pages, tile_start, k_offsets, v_offsets, BLOCK_N=BLOCK_N,
                HEAD_DIM=HEAD_DIM, PAGE_SIZE=PAGE_SIZE, TOKEN_STRIDE=K_TOKEN_STRIDE,
                K_PAGE_STRIDE=K_PAGE_STRIDE, V_PAGE_STRIDE=V_PAGE_STRIDE,
            )  # fmt: skip
            k = _load_kv_tile(k_ptrs, in_seq, q_a.dtype, MASKED, INTERPRETED)
        qk_a = _scores(q_a, q_lo_a, k, INTERPRETED)
        qk_b = _scores(q_b, q_lo_b, k, INTERPRETED)
        if MASKED:
            p_a, alpha_a, m_a, l_a = _softmax_masked(
                qk_a,
                m_a,
                l_a,
                qk_scale,
                key_pos,
                in_seq,
                query_pos_a,
                causal_shift,
                window_left,
                CAUSAL,
                WINDOW,
                q_lo_a is not None,
            )
        else:
            p_a, alpha_a, m_a, l_a = _softmax_unmasked(qk_a, m_a, l_a, qk_scale,
                                                       q_lo_a is not None)  # fmt: skip
        if PAGE_SIZE == 0:
            v = _load_kv_tile(v_tile + v_offsets, in_seq, q_a.dtype, MASKED, INTERPRETED)
        else:
            v = _load_v_tile(v_ptrs, in_seq, q_a, q_lo_a, MASKED, INTERPRETED)
        acc_a = _accumulate(acc_a, alpha_a, p_a, v, INTERPRETED)
        if MASKED:
            p_b, alpha_b, m_b, l_b = _softmax_masked(
                qk_b,
                m_b,
                l_b,
                qk_scale_b,
                key_pos,
                in_seq,
                query_pos_b,
                causal_shift,
                window_left,
                CAUSAL,
                WINDOW,
                q_lo_b is not None,
            )
        else:
            p_b, alpha_b, m_b, l_b = _softmax_unmasked(qk_b, m_b, l_b, qk_scale_b,
                                                       q_lo_b is not None)  # fmt: skip
        acc_b = _accumulate(acc_b, alpha_b, p_b, v, INTERPRETED)
        if PAGE_SIZE == 0:
            k_tile += BLOCK_N * K_TOKEN_STRIDE
            v_tile += BLOCK_N * V_TOKEN_STRIDE
    return acc_a, m_a, l_a, acc_b, m_b, l_b
