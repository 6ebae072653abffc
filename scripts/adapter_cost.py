"""Host time of a served run() through FlashInfer's paged prefill wrapper's adapters: the
bundle's (prefill_bundle/flashinfer_adapter.py) against flashinfer-bench's own, on CPU tensors
with apply stubbed (it returns a fixed result) and FlashInfer's plan/run replaced by stubs of
their signatures, so only the adapters' Python is timed. Needs no GPU.

    python scripts/adapter_cost.py            # best of 5 rounds of 5000 calls each
"""

import argparse
import functools
import time

import torch
from flashinfer.prefill import BatchPrefillWithPagedKVCacheWrapper
from flashinfer_bench.integration.flashinfer.adapters import gqa_paged_prefill as stock_module
from flashinfer_bench.integration.flashinfer.adapters.gqa_paged_prefill import (
    GQAPagedPrefillAdapter,
)
from flashinfer_bench.integration.patch_manager import get_manager

from prefill_bundle import flashinfer_adapter as bundle_module
from prefill_bundle.testing import PagedCase, make_inputs


def flashinfer_method(name: str):
    """FlashInfer's own plan or run: once apply has been enabled in this process, the class
    holds an adapter's wrapper (flashinfer-bench never unpatches), and the patch manager the
    original."""
    cls = BatchPrefillWithPagedKVCacheWrapper
    return get_manager()._originals.get((cls, name), getattr(cls, name))


def run_cost_us(adapter, inputs, calls: int, rounds: int) -> float:
    """Best per-call microseconds of the adapter's run() over `rounds` rounds of `calls`."""
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, last = inputs[:7]
    specs = {spec.name.rpartition("_")[2]: spec for spec in adapter.targets()}
    plan_stub = functools.wraps(flashinfer_method("plan"))(lambda *a, **k: None)
    run_stub = functools.wraps(flashinfer_method("run"))(lambda *a, **k: None)
    plan = adapter.make_wrapper(specs["plan"], plan_stub)
    run = adapter.make_wrapper(specs["run"], run_stub)
    wrapper = object.__new__(BatchPrefillWithPagedKVCacheWrapper)
    wrapper._kv_layout, wrapper._use_cuda_graph = "NHD", False
    plan(wrapper, qo_indptr, kv_indptr, kv_indices, last, 32, 8, 128, 64, causal=True)
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        for _ in range(calls):
            run(wrapper, q, (k_cache, v_cache), return_lse=True)
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e6


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args(argv)
    inputs = make_inputs(PagedCase((3, 5), (70, 5), 64), "cpu")
    result = (torch.zeros_like(inputs[0]), torch.zeros(inputs[0].shape[:2]))
    applied = []

    def stub_apply(*_, **__):
        applied.append(1)
        return result

    costs = {}
    for name, module, adapter in (("flashinfer-bench", stock_module, GQAPagedPrefillAdapter()),
                                  ("bundle", bundle_module,
                                   bundle_module.PagedPrefillAdapter())):  # fmt: skip
        original, module.apply = module.apply, stub_apply
        try:
            applied.clear()
            costs[name] = run_cost_us(adapter, inputs, args.calls, args.rounds)
            assert applied, f"{name}'s adapter never called apply"
        finally:
            module.apply = original
        print(f"{name:16s} {costs[name]:6.2f} us a served run()")
    return costs


if __name__ == "__main__":
    main()
