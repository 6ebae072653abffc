"""What FP8 tensor-core products would cost in accuracy (no GPU): issue 18's pairing bar asks
each FP8 kernel to run at least as fast as its own bf16 one, which on compute-bound prefill
needs fewer tensor-core cycles than bf16's, so q or P in one e4m3 term (FlashAttention-3's FP8).
This emulates both on the FP8 workloads' shapes with flashinfer-bench's random data (q randn,
K / V randn clamped to [-2, 2] then e4m3, scales 0.5 / 1.25) against the fp32 reference:

- exact: the shipped kernels' arithmetic (q as two e4m3 terms = bf16 q; P V in fp32 here),
- q8:    q rounded to one e4m3 term per element (each row scaled by a power of two so its
         largest |q| lands in [128, 256), as split_q scales it),
- p8:    P = exp(s - m) rounded to e4m3 before P V (the row sum stays fp32),
- q8p8:  both (FlashAttention-3's FP8 forward),
- p8diag: p8, but the keys of the row's own 128-key tile exact (the masked diagonal tile in
         q's dtype, a guard for rows that see few keys).

Prints, per workload and mode, the elements flashinfer-bench would fail (|err| > 1e-2 and
|err| / |ref| > 1e-2; the output rounded to bf16 first) and the normwise error. Each sequence
is one KV head's 4 query heads; long sequences check their first 256 rows and 128 others.

    python scripts/fp8_quantized_products.py [WORKLOAD ...]     # ~25 s on two cores
"""

import argparse

import torch

from prefill_bundle.workloads import FP8_K_SCALE, FP8_V_SCALE, PAGED_BATCHES

E4M3 = torch.float8_e4m3fn
MODES = ("exact", "q8", "p8", "q8p8", "p8diag")
TILE = 128


def q_one_e4m3_term(q: torch.Tensor) -> torch.Tensor:
    """q rounded to e4m3 per element, each row's largest |q| scaled into [128, 256) first."""
    top = q.abs().amax(-1, keepdim=True).clamp_min(1e-30)
    scale = torch.exp2(7 - torch.floor(torch.log2(top)))
    return (q * scale).to(E4M3).float() / scale


def attend(q, k, v, last_key, sm_scale: float, mode: str) -> torch.Tensor:
    """q [rows, heads, d] fp32; k, v [keys, d] fp32; row r sees keys 0 .. last_key[r]."""
    scores = torch.einsum("rhd,nd->rhn", q_one_e4m3_term(q) if "q8" in mode else q, k)
    keys = torch.arange(k.shape[0])
    hidden = keys[None, :] > last_key[:, None]
    scores = (scores * sm_scale).masked_fill(hidden[:, None, :], float("-inf"))
    p = torch.exp(scores - scores.amax(-1, keepdim=True))
    row_sum = p.sum(-1, keepdim=True)
    if "p8" in mode:
        rounded = p.to(E4M3).float()
        if mode == "p8diag":
            own_tile = keys[None, :] >= (last_key // TILE * TILE)[:, None]
            rounded = torch.where(own_tile[:, None, :], p, rounded)
        p = rounded
    return torch.einsum("rhn,nd->rhd", p, v) / row_sum


def flashinfer_bench_fails(out: torch.Tensor, ref: torch.Tensor) -> int:
    err = (out - ref).abs()
    return int(((err > 1e-2) & (err > 1e-2 * ref.abs())).sum())


def workload_rows(batch, seed: int = 0):
    """Per sequence: (q, k, v, last_key) as flashinfer-bench draws them, rows sampled."""
    generator = torch.Generator().manual_seed(seed)
    for q_len, kv_len in zip(batch.q_lens, batch.kv_lens):
        q = torch.randn(q_len, 4, 128, generator=generator).bfloat16().float()
        k, v = (torch.randn(kv_len, 128, generator=generator).clamp(-2, 2).to(E4M3).float()
                for _ in range(2))  # fmt: skip
        rows = torch.arange(q_len)
        if q_len > 384:
            rest = torch.randperm(q_len - 256, generator=generator)[:128] + 256
            rows = torch.cat([rows[:256], rest])
        yield q[rows], k * FP8_K_SCALE, v * FP8_V_SCALE, kv_len - q_len + rows


def accuracy(batch, modes=MODES) -> dict:
    """mode -> (elements failing flashinfer-bench's check, elements, normwise error)."""
    totals = {mode: [0, 0, 0.0, 0.0] for mode in modes}
    for q, k, v, last_key in workload_rows(batch):
        for r in range(0, len(last_key), 64):
            rows = slice(r, r + 64)
            ref = attend(q[rows], k, v, last_key[rows], 128**-0.5, "exact")
            for mode in modes:
                exact = mode == "exact"  # the reference itself
                out = ref if exact else attend(q[rows], k, v, last_key[rows], 128**-0.5, mode)
                out = out.bfloat16().float()
                t = totals[mode]
                t[0] += flashinfer_bench_fails(out, ref)
                t[1] += out.numel()
                t[2] += float(((out - ref) ** 2).sum())
                t[3] += float((ref**2).sum())
    return {mode: (t[0], t[1], (t[2] / t[3]) ** 0.5) for mode, t in totals.items()}


def main():
    parser = argparse.ArgumentParser()
    names = [b.name for b in PAGED_BATCHES]
    parser.add_argument("workloads", nargs="*", default=names, choices=names, metavar="WORKLOAD")
    options = parser.parse_args()
    print("| workload | " + " | ".join(MODES) + " |")
    print("|---" * (len(MODES) + 1) + "|")
    for batch in PAGED_BATCHES:
        if batch.name in options.workloads:
            found = accuracy(batch)
            cells = [f"{f} / {n} fail, {e:.1e}" for f, n, e in found.values()]
            print(f"| {batch.name} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
