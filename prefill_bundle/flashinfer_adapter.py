"""The bundle's drop-in for FlashInfer's BatchPrefillWithPagedKVCacheWrapper under apply.

flashinfer-bench 0.1.2's own adapter for that wrapper calls apply with (q, k_cache, v_cache,
qo_indptr, kv_indptr, kv_indices, sm_scale, page_size): it drops the kv_last_page_len given to
plan() and adds a page_size, so no call matches FlashInfer-Trace's paged definitions (page size
64 takes kv_last_page_len; neither takes page_size) and partly filled last pages would be read
as full. This adapter keeps the stock one's plan/run bookkeeping and calls apply with each
definition's own arguments. It patches the same two methods; installed first, it wins
(flashinfer-bench's patch manager skips a method already patched).

CUDA graphs stay FlashInfer's: a wrapper made with use_cuda_graph=True, or any run() while the
stream is being captured, runs FlashInfer's own kernel. FlashInfer's graph mode copies each
plan()'s page table into the wrapper's fixed buffers, which its captured kernel reads at every
replay; a bundle call captured here would keep reading the tensors of the plan() before the
capture, and give a replay after the next plan() the old page table: wrong results, silently.
"""

from __future__ import annotations

import torch
from flashinfer_bench.apply import apply
from flashinfer_bench.integration.flashinfer.adapters.gqa_paged_prefill import (
    GQAPagedPrefillAdapter,
)
from flashinfer_bench.integration.flashinfer.common import (
    infer_paged_kv_layout_from_tensors,
    normalize_paged_kv_to_nhd,
    write_back_outputs,
)
from flashinfer_bench.integration.patch_manager import get_manager
from flashinfer_bench.integration.utils import ArgBinder

SERVED_PAGE_SIZES = (1, 64)  # FlashInfer-Trace's paged prefill definitions


def paged_definition_name(q, k_cache, page_size: int) -> str:
    return (
        f"gqa_paged_prefill_causal_h{q.shape[1]}_kv{k_cache.shape[2]}_d{q.shape[2]}_ps{page_size}"
    )


def capturing(q) -> bool:
    """Whether q's device's current stream is being captured into a CUDA graph."""
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


class PagedPrefillAdapter(GQAPagedPrefillAdapter):
    def make_wrapper(self, spec, orig):
        if spec.name == "gqa_paged_prefill_plan":
            stock_plan = super().make_wrapper(spec, orig)
            binder = ArgBinder.from_callable(orig)

            def plan_wrapper(inst, *args, **kwargs):
                bound = binder.bind((inst, *args), kwargs)
                result = stock_plan(inst, *args, **kwargs)  # records the rest, plans
                self._store.get(inst)["kv_last_page_len"] = bound["paged_kv_last_page_len"]
                return result

            return plan_wrapper
        if spec.name == "gqa_paged_prefill_run":
            return self._run_wrapper(orig)
        return orig

    def _run_wrapper(self, orig):
        binder = ArgBinder.from_callable(orig)

        def run_wrapper(inst, *args, **kwargs):
            ctx = self._store.get(inst)
            bound = binder.bind((inst, *args), kwargs)
            q, cache = bound["q"], bound["paged_kv_cache"]
            page_size = ctx.get("page_size") if ctx else None
            if not ctx or not ctx.get("causal") or page_size not in SERVED_PAGE_SIZES:
                return orig(inst, *args, **kwargs)
            if getattr(inst, "_use_cuda_graph", False) or capturing(q):
                return orig(inst, *args, **kwargs)  # the module's docstring says why
            if q.dim() != 3 or q.shape[1] != ctx["num_qo_heads"] or q.shape[2] != ctx["head_dim"]:
                return orig(inst, *args, **kwargs)
            layout = ctx.get("kv_layout") or infer_paged_kv_layout_from_tensors(
                cache, ctx["num_kv_heads"]
            )
            if not layout:
                return orig(inst, *args, **kwargs)
            k_cache, v_cache = normalize_paged_kv_to_nhd(cache, layout)
            arguments = {
                "q": q,
                "k_cache": k_cache,
                "v_cache": v_cache,
                "qo_indptr": ctx["qo_indptr"],
                "kv_indptr": ctx["kv_indptr"],
                "kv_indices": ctx["kv_indices"],
            }
            if page_size > 1:  # the page size 1 definition has no kv_last_page_len
                arguments["kv_last_page_len"] = ctx["kv_last_page_len"]
            arguments["sm_scale"] = ctx["sm_scale"]

            def fallback(**_):
                return orig(inst, *args, **kwargs)

            name = paged_definition_name(q, k_cache, page_size)
            result = apply(name, kwargs=arguments, fallback=fallback)
            output, lse = result if isinstance(result, tuple) else (result, None)
            return write_back_outputs(
                output=output,
                lse=lse,
                want_lse=bool(bound.get("return_lse", False)),
                out_buf=bound.get("out"),
                lse_buf=bound.get("lse"),
            )

        return run_wrapper


def install_paged_prefill_adapter() -> None:
    """Patch BatchPrefillWithPagedKVCacheWrapper.plan/run with PagedPrefillAdapter (once; a
    no-op where FlashInfer is missing)."""
    adapter = PagedPrefillAdapter()
    for spec in adapter.targets():
        get_manager().patch(spec, adapter.make_wrapper)
