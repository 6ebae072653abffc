"""A prefill serving loop with Llama-3.1-8B attention geometry (32 query heads, 8 KV heads,
head_dim 128, hidden 4096), random weights, attention through flashinfer-bench's apply.

On the GPU, from the repository root (traces/ must hold the bundle's traces):
    python scripts/inference_loop.py [--layers 4] [--batches 24]

Prints: which solution serves each bucket; end-to-end time of the stream with the bundle, with
each backend alone, fallback-only (torch SDPA) and FlashInfer-only; apply's per-call dispatch
overhead; and the FlashInfer drop-in (BatchPrefillWithRaggedKVCacheWrapper served by the bundle).
"""

import argparse
import math
import time
from collections import Counter

import flashinfer
import torch
from flashinfer_bench.apply import apply, disable_apply
from flashinfer_bench.compile import BuilderRegistry

from prefill_bundle import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, RAGGED
from prefill_bundle.serving import dispatch_table, enable_bundle_apply
from prefill_bundle.testing import build_solution
from prefill_bundle.workloads import lengths_to_indptr

HIDDEN = NUM_HEADS * HEAD_DIM
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)
SDPA = build_solution("sdpa_ragged")  # the fallback: torch's own varlen flash kernel


@apply(RAGGED)
def ragged_attention(q, k, v, qo_indptr, kv_indptr, sm_scale):
    return SDPA(q, k, v, qo_indptr, kv_indptr, sm_scale)


def prompt_stream(batches: int, seed: int = 0):
    """Batches of 1-16 prompts, lengths log-uniform in [1, 4096]."""
    gen = torch.Generator().manual_seed(seed)
    stream = []
    for _ in range(batches):
        size = int(torch.randint(1, 17, (1,), generator=gen))
        lengths = torch.exp(torch.rand(size, generator=gen) * math.log(4096)).long().clamp(1)
        stream.append(lengths.tolist())
    return stream


class Model:
    def __init__(self, layers: int):
        gen = torch.Generator(device="cuda").manual_seed(1)
        kv = NUM_KV_HEADS * HEAD_DIM

        def weight(rows, cols):
            w = torch.randn(rows, cols, generator=gen, device="cuda") / math.sqrt(rows)
            return w.to(torch.bfloat16)

        self.layers = [
            (weight(HIDDEN, HIDDEN + 2 * kv), weight(HIDDEN, HIDDEN)) for _ in range(layers)
        ]

    def forward(self, x, attention):
        kv = NUM_KV_HEADS * HEAD_DIM
        for w_qkv, w_out in self.layers:
            qkv = x @ w_qkv
            q = qkv[:, :HIDDEN].reshape(-1, NUM_HEADS, HEAD_DIM)
            k = qkv[:, HIDDEN : HIDDEN + kv].reshape(-1, NUM_KV_HEADS, HEAD_DIM).contiguous()
            v = qkv[:, HIDDEN + kv :].reshape(-1, NUM_KV_HEADS, HEAD_DIM).contiguous()
            out = attention(q.contiguous(), k, v)
            x = x + out.reshape(-1, HIDDEN) @ w_out
        return x


def run_stream(model, stream, make_attention):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for lengths in stream:
        indptr = lengths_to_indptr(lengths).cuda()
        x = torch.randn(sum(lengths), HIDDEN, device="cuda", dtype=torch.bfloat16)
        model.forward(x, make_attention(indptr))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def through_apply(indptr):
    return lambda q, k, v: ragged_attention(q, k, v, indptr, indptr, SM_SCALE)[0]


_workspace = None


def flashinfer_only(indptr):
    """What a FlashInfer user runs: plan once per batch, run once per layer."""
    global _workspace
    if _workspace is None:
        _workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(_workspace, "NHD", backend="fa3")
    wrapper.plan(indptr, indptr, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, causal=True,
                 sm_scale=SM_SCALE, q_data_type=torch.bfloat16)  # fmt: skip
    return lambda q, k, v: wrapper.run(q, k, v)


def record_dispatches():
    """Count which solution apply builds (i.e. runs) for each call."""
    registry = BuilderRegistry.get_instance()
    original = registry.build
    served = Counter()

    def build(definition, solution):
        served[solution.name] += 1
        return original(definition, solution)

    registry.build = build
    return served, lambda: setattr(registry, "build", original)


def dispatch_overhead(runtime, calls=3000):
    """Host time per call through apply minus a direct call of the same solution (1 token)."""
    q = torch.randn(1, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    indptr = lengths_to_indptr([1]).cuda()
    args = (q, k, k, indptr, indptr, SM_SCALE)
    served, restore = record_dispatches()
    ragged_attention(*args)
    restore()
    name = next(iter(served))
    runnable = build_solution(name)
    timings = {"apply": [], "direct": []}
    for _ in range(3):  # interleaved rounds
        for label, fn in (("apply", ragged_attention), ("direct", runnable.call_value_returning)):
            fn(*args)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                fn(*args)
            timings[label].append((time.perf_counter() - start) / calls * 1e6)
            torch.cuda.synchronize()
    return name, min(timings["apply"]), min(timings["direct"])


def drop_in(stream):
    """FlashInfer's own wrapper, plan + run, transparently served by the bundle under apply."""
    lengths = stream[0]
    indptr = lengths_to_indptr(lengths).cuda()
    total = sum(lengths)
    q = torch.randn(total, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    reference = flashinfer_only(indptr)(q, k, v)
    runtime = enable_bundle_apply()
    served, restore = record_dispatches()
    try:
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(_workspace, "NHD", backend="fa3")
        wrapper.plan(indptr, indptr, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, causal=True,
                     sm_scale=SM_SCALE, q_data_type=torch.bfloat16)  # fmt: skip
        out = wrapper.run(q, k, v)
    finally:
        restore()
        disable_apply()
    del runtime
    error = ((out.float() - reference.float()).norm() / reference.float().norm()).item()
    return lengths, dict(served), error


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", type=int, default=24)
    args = parser.parse_args()
    model = Model(args.layers)
    stream = prompt_stream(args.batches)
    print(f"stream: {len(stream)} batches, {sum(map(sum, stream))} tokens, {args.layers} layers")

    results = {}
    run_stream(model, stream, flashinfer_only)  # JIT and warm-up
    results["flashinfer only"] = run_stream(model, stream, flashinfer_only)
    run_stream(model, stream, through_apply)
    results["fallback only (torch SDPA)"] = run_stream(model, stream, through_apply)

    runtime = enable_bundle_apply()
    table = dispatch_table(runtime).get(RAGGED, {})
    served, restore = record_dispatches()
    run_stream(model, stream, through_apply)  # first use compiles each solution's variants
    restore()
    results["bundle (apply)"] = run_stream(model, stream, through_apply)
    name, via_apply, direct = dispatch_overhead(runtime)
    disable_apply()

    backends = sorted({s.split("_")[0] for s in table.values()})
    for backend in backends:
        enable_bundle_apply([f"{backend}_mini", f"{backend}_ragged"])
        run_stream(model, stream, through_apply)
        results[f"{backend} only (apply)"] = run_stream(model, stream, through_apply)
        disable_apply()

    lengths, drop_in_served, drop_in_error = drop_in(stream)

    print("\napply's choice per bucket (ragged definition):")
    for key, solution in sorted(table.items(), key=lambda kv: str(kv[0].axes)):
        print(f"  {dict(key.axes)} causal={dict(key.feats)['causal']}: {solution}")
    print(f"calls served during the bundle stream: {dict(served)}")
    print("\nend-to-end time of the stream (attention + projections):")
    base = results["flashinfer only"]
    for label, seconds in results.items():
        print(
            f"  {label:28s} {seconds * 1e3:9.1f} ms   FlashInfer-only / this = {base / seconds:.2f}"
        )
    print(f"\napply dispatch overhead (1-token call, {name}): {via_apply:.1f} us through apply, "
          f"{direct:.1f} us direct -> {via_apply - direct:.1f} us per call")  # fmt: skip
    print(f"\nFlashInfer drop-in on a batch of {lengths}: served by {drop_in_served}, "
          f"normwise difference to FlashInfer's own output {drop_in_error:.1e}")  # fmt: skip


if __name__ == "__main__":
    main()
