"""On the GPU: what bounds the decode-like rows (single_token_rows_16: 16 single-token rows over
4.6K-14.5K keys, 2142 pages of 64), measured with two probes that are not solutions:

1. `read_pages`: the HBM read rate of the workload's cache by access pattern. A program reads,
   K and V, the 128-byte rows (1 KiB apart in a page) of one, two or all eight KV heads of a
   few pages; launched head-fastest or not.
2. `lean_decode`: a split-KV decode kernel with nothing but the arithmetic. A program is (key
   share, KV head, sequence): its 4 query heads in a 16-row tl.dot, plain loads, no argument or
   page-id checks, single-token rows only. FP8 caches convert by triton's cast to bf16 (a cvt
   and two F2F a pair), the solution's bit-level bf16 conversion (kv_loops._e4m3_to_bf16), the
   cast to f16 (q in f16 too), or two prmt only (wrong values: the conversion's floor); its
   shares merged by the solution's merge_kv_splits.

Each beside the shipped Triton solution and FlashInfer, kernel time (do_bench, L2 flushed).
What it found: triton/TUNING.md, "The decode rows' ceiling".

    python scripts/decode_ceiling.py [--quick]
"""

import argparse
import functools
import sys

import torch
import triton
import triton.language as tl

LOG2_E = 1.4426950408889634
# The workload's page size (a page holds PAGE tokens x 8 KV heads x 128) and one token's row of
# every KV head, in elements; constexpr objects so that the kernels may read them.
PAGE = tl.constexpr(64)
ROW = tl.constexpr(8 * 128)

CAST_BF16, BITS_BF16, CAST_F16, PRMT_ONLY = 0, 1, 2, 3
CONVERSIONS = {CAST_BF16: "cast to bf16", BITS_BF16: "bit-level bf16", CAST_F16: "cast to f16",
               PRMT_ONLY: "two prmt (wrong values)"}  # fmt: skip

_e4m3_to_bf16 = None  # the Triton solution's kv_loops._e4m3_to_bf16, set by solution_modules


@triton.jit
def read_pages(k, v, pages, out, n_pages, PAGES_A_PROGRAM: tl.constexpr,
               HEADS_A_PROGRAM: tl.constexpr, HEADS_FASTEST: tl.constexpr):  # fmt: skip
    """Sum K and V over PAGES_A_PROGRAM pages of the page table, HEADS_A_PROGRAM KV heads (one
    [PAGE, 128] tile each) a program; out[program] = the sum (so nothing is dead code)."""
    pid = tl.program_id(0)
    head_groups = 8 // HEADS_A_PROGRAM
    if HEADS_FASTEST:
        group = pid % head_groups
        chunk = pid // head_groups
    else:
        chunks = tl.cdiv(n_pages, PAGES_A_PROGRAM)
        chunk = pid % chunks
        group = pid // chunks
    rows = tl.arange(0, PAGE)[:, None] * ROW
    dims = tl.arange(0, 128)[None, :]
    total = tl.zeros([PAGE, 128], tl.float32)
    for i in range(PAGES_A_PROGRAM):
        slot = chunk * PAGES_A_PROGRAM + i
        live = slot < n_pages
        page = tl.load(pages + slot, mask=live, other=0).to(tl.int64)
        for h in tl.static_range(HEADS_A_PROGRAM):
            offsets = page * (PAGE * ROW) + rows + (group * HEADS_A_PROGRAM + h) * 128 + dims
            total += tl.load(k + offsets, mask=live, other=0.0).to(tl.float32)
            total += tl.load(v + offsets, mask=live, other=0.0).to(tl.float32)
    tl.store(out + pid, tl.sum(total))


@triton.jit
def _convert(x, CONVERSION: tl.constexpr, INTERPRETED: tl.constexpr):
    if CONVERSION == 2:  # CAST_F16
        y = x.to(tl.float16)
    elif CONVERSION == 3 and not INTERPRETED:  # PRMT_ONLY: bytes spread, no arithmetic
        y = tl.inline_asm_elementwise(
            asm="prmt.b32 $0, $2, 0, 0x5140; prmt.b32 $1, $2, 0, 0x7362;",
            constraints="=r,=r,r",
            args=[x.to(tl.uint8, bitcast=True)],
            dtype=tl.float16,
            is_pure=True,
            pack=4,
        )
    elif CONVERSION == 1 and not INTERPRETED:  # BITS_BF16
        y = _e4m3_to_bf16(x)
    else:  # CAST_BF16 (and the interpreter's stand-in for the GPU-only ones)
        y = x.to(tl.bfloat16)
    return y


@triton.jit
def lean_decode(q, k, v, kv_indptr, pages, last_page_len, part_out, part_lse, qk_scale, v_scale,
                batch, SHARES: tl.constexpr, KEYS: tl.constexpr, CONVERSION: tl.constexpr,
                INTERPRETED: tl.constexpr):  # fmt: skip
    """One (share, KV head, sequence): its share of the sequence's KEYS-key tiles for its 4 query
    heads (rows 0-3 of 16), the share's normalised output and base-2 LSE into the fp32 parts
    ([SHARES * batch * 32] rows). Single-token sequences, well-formed tables only."""
    share = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = tl.program_id(2)
    first_page = tl.load(kv_indptr + seq)
    n_pages = tl.load(kv_indptr + seq + 1) - first_page
    kv_len = (n_pages - 1) * PAGE + tl.load(last_page_len + seq)
    per_share = tl.cdiv(tl.cdiv(kv_len, KEYS), SHARES)
    tile_lo = share * per_share
    tile_hi = tl.minimum(tile_lo + per_share, tl.cdiv(kv_len, KEYS))
    rows = tl.arange(0, 16)
    dims = tl.arange(0, 128)
    head = kv_head * 4 + rows
    q_tile = tl.load(q + seq * 4096 + head[:, None] * 128 + dims[None, :],
                     mask=(rows < 4)[:, None], other=0.0)  # fmt: skip
    if CONVERSION == 2 or CONVERSION == 3:
        q_tile = q_tile.to(tl.float16)  # (a probe: no scaling, the workload's q is randn)
    m_i = tl.full([16], float("-inf"), tl.float32)
    l_i = tl.zeros([16], tl.float32)
    acc = tl.zeros([16, 128], tl.float32)
    for tile in range(tile_lo, tile_hi):
        key = tile * KEYS + tl.arange(0, KEYS)
        live = key < kv_len
        page = tl.load(pages + first_page + key // PAGE, mask=live, other=0).to(tl.int64)
        offsets = (page * (PAGE * ROW) + (key % PAGE) * ROW)[:, None] + kv_head * 128 + dims
        k_tile = tl.load(k + offsets)
        if k_tile.dtype == tl.float8e4nv:
            k_tile = _convert(k_tile, CONVERSION, INTERPRETED)
        if INTERPRETED:  # its bf16 dot multiplies bit patterns
            s = tl.dot(q_tile.to(tl.float32), tl.trans(k_tile.to(tl.float32)))
        else:
            s = tl.dot(q_tile, tl.trans(k_tile))
        s = tl.where(live[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v_tile = tl.load(v + offsets)
        if v_tile.dtype == tl.float8e4nv:
            v_tile = _convert(v_tile, CONVERSION, INTERPRETED)
        v_tile = tl.where(live[:, None], v_tile, 0.0)  # a cache's unused slots may hold NaN
        if INTERPRETED:
            pv = tl.dot(p.to(v_tile.dtype).to(tl.float32), v_tile.to(tl.float32))
        else:
            pv = tl.dot(p.to(v_tile.dtype), v_tile)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
    out_row = (share * batch + seq) * 32 + head
    tl.store(part_out + out_row[:, None] * 128 + dims[None, :], acc, mask=(rows < 4)[:, None])
    tl.store(part_lse + out_row, m_i + tl.math.log2(l_i), mask=rows < 4)


def solution_modules():
    """The packed Triton solution's kv_loops and split_kv modules (the code the solution runs):
    sets _e4m3_to_bf16, which lean_decode calls, and returns split_kv (merge_kv_splits)."""
    global _e4m3_to_bf16
    from prefill_bundle.testing import entry_module

    package = entry_module("triton_fp8kv").__name__.rpartition(".")[0]
    _e4m3_to_bf16 = sys.modules[package + ".kv_loops"]._e4m3_to_bf16
    return sys.modules[package + ".split_kv"]


def lean_call(inputs, shares: int, keys: int, conversion: int, outputs, num_warps=4,
              num_stages=2):  # fmt: skip
    """The probe on one paged case's inputs (the definition's order; FP8: the scales after the
    page table): launches lean_decode, then the solution's merge_kv_splits into outputs;
    returns the launch."""
    merge = solution_modules().merge_kv_splits
    q, k, v, _, kv_indptr, pages, last_page_len = inputs[:7]
    k_scale, v_scale = inputs[7:9] if len(inputs) == 10 else (1.0, 1.0)
    batch = q.shape[0]
    parts = (torch.empty(shares * batch * 32, 128, device=q.device),
             torch.empty(shares * batch * 32, device=q.device))  # fmt: skip
    qk_scale = float(inputs[-1]) * float(k_scale) * LOG2_E
    interpreted = q.device.type == "cpu"

    def launch():
        lean_decode[(shares, 8, batch)](
            q, k, v, kv_indptr, pages, last_page_len, *parts, qk_scale, float(v_scale), batch,
            SHARES=shares, KEYS=keys, CONVERSION=conversion, INTERPRETED=interpreted,
            num_warps=num_warps, num_stages=num_stages)  # fmt: skip
        rows = batch * 32
        merge[(triton.cdiv(rows, 4),)](*parts, *outputs, rows, HEAD_DIM=128, KV_SPLITS=shares,
                                       BLOCK_ROWS=4, INTERPRETED=interpreted)  # fmt: skip

    launch()
    return launch


def read_rates(k, v, pages, quick: bool) -> list:
    """(TB/s, heads a program, head-fastest, pages a program, warps, us) by pattern, best first."""
    out = torch.empty(1 << 16, device=k.device)
    n = pages.numel()
    rows = []
    for heads in (1, 2, 8):
        for heads_fastest in (False, True) if heads < 8 else (False,):
            for pages_a_program in (4,) if quick else (4, 16, 64):
                for warps in (4, 8):
                    grid = (triton.cdiv(n, pages_a_program) * (8 // heads),)
                    fn = functools.partial(
                        read_pages[grid], k, v, pages, out, n, PAGES_A_PROGRAM=pages_a_program,
                        HEADS_A_PROGRAM=heads, HEADS_FASTEST=heads_fastest, num_warps=warps,
                    )  # fmt: skip
                    ms = triton.testing.do_bench(fn, warmup=20, rep=200)
                    tb_s = 2 * n * PAGE.value * ROW.value * k.element_size() / ms / 1e9
                    rows.append((tb_s, heads, heads_fastest, pages_a_program, warps, ms * 1e3))
    return sorted(rows, reverse=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer patterns and tiles")
    options = parser.parse_args()
    from compare_gpu import CASES

    from prefill_bundle import PAGED_FP8, PAGED_PS64
    from prefill_bundle.gpu_timing import clocks
    from prefill_bundle.testing import (
        build_solution,
        make_inputs,
        normwise_error,
        poisoned_outputs,
        reference_outputs,
    )

    solution_modules()
    print("gpu at start:", clocks())
    for definition in (PAGED_FP8, PAGED_PS64):
        baseline, cases = CASES[definition]
        case = next(c for c in cases if "1x7969" in c.id)  # single_token_rows_16
        inputs = make_inputs(case, "cuda", seed=0)
        expected = reference_outputs(case, inputs)
        k, v, pages = inputs[1], inputs[2], inputs[5]
        print(f"\n{definition}: read rate of the cache's {pages.numel()} pages by pattern")
        print("TB/s  heads a program  head-fastest  pages a program  warps  us")
        for row in read_rates(k, v, pages, options.quick)[:10]:
            print("%.2f  %d  %s  %d  %d  %.1f" % row)
        timed = []
        for name in (baseline, "triton_fp8kv" if definition == PAGED_FP8 else "triton_paged_ps64"):
            fn = build_solution(name)
            args = inputs + poisoned_outputs(case, inputs)
            timed.append((triton.testing.do_bench(lambda: fn(*args), warmup=10, rep=100), name))
        fp8 = k.dtype == torch.float8_e4m3fn
        conversions = (CAST_BF16, BITS_BF16, CAST_F16, PRMT_ONLY) if fp8 else (CAST_BF16,)
        for shares in (16,) if options.quick else (16, 32):
            for keys in (64, 128):
                for conversion in conversions:
                    outputs = poisoned_outputs(case, inputs)
                    launch = lean_call(inputs, shares, keys, conversion, outputs)
                    error = normwise_error(outputs[0], expected[0])
                    ms = triton.testing.do_bench(launch, warmup=10, rep=100)
                    label = f"lean {shares} shares, {keys} keys, {CONVERSIONS[conversion]}"
                    timed.append((ms, label + ("" if error < 1e-2 else " (wrong)")))
        print(f"\n{definition}: single_token_rows_16, kernel us (merge included)")
        for ms, label in sorted(timed):
            print(f"{ms * 1e3:8.1f}  {label}")
    print("\ngpu at end:", clocks())


if __name__ == "__main__":
    main()
