"""The bundle's drop-ins for FlashInfer's prefill wrappers under apply: plan() is recorded
(FlashInfer's own plan() deferred until a run() falls back: below), run() calls apply with a
definition's own arguments when the planned attention is one a definition computes, else
FlashInfer's own run().

flashinfer-bench 0.1.2 has adapters for both wrappers. Two things make the bundle install its
own (first: flashinfer-bench's patch manager then skips the methods already patched):
- Its paged adapter calls apply with (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices,
  sm_scale, page_size). It drops the kv_last_page_len given to plan() and adds a page_size, so
  no call matches FlashInfer-Trace's paged definitions (page size 64 takes kv_last_page_len;
  neither takes page_size), and partly filled last pages would be read as full.
- Both adapters read only the shapes, causal and sm_scale from plan(). A plan with a sliding
  window, a logits soft cap, a custom mask, RoPE applied in the kernel, attention sinks or
  k/v scales at run() would be served a plain causal kernel: wrong results, silently.

Served here:
- BatchPrefillWithPagedKVCacheWrapper, causal, page size 1 or 64: the paged definitions, and
  the FP8 one (page size 64, float8_e4m3fn caches, run()'s k_scale and v_scale as its scales);
- BatchPrefillWithRaggedKVCacheWrapper, causal: the ragged definition, or the sliding-window
  one when plan()'s window_left >= 0.
Anything else (`unserved_plan`, `unserved_run`) runs FlashInfer's own kernel, MLA's ragged
prefill too (head_dim_vo != head_dim_qk), which flashinfer-bench's ragged adapter sends to apply
but no definition of this bundle covers.

CUDA graphs stay FlashInfer's too: a wrapper made with use_cuda_graph=True, or any run() while
the stream is being captured. FlashInfer's graph mode copies each plan()'s indptr and page
table into the wrapper's fixed buffers, which its captured kernel reads at every replay; a
bundle call captured here would keep reading the tensors of the plan() before the capture.

FlashInfer's own plan() is deferred (PREFILL_BUNDLE_DEFER_PLAN unset or 1, read at every
plan(); 0 runs it at once; any other value makes plan() raise): a plan() that a definition
computes is recorded, and FlashInfer's plan() (host copies of the indptr, its scheduler's plan:
1.6-2.3 ms of the 10-17 ms chat of scripts/inference_loop.py on the H200) runs only when a run()
of that plan falls back to FlashInfer's kernel, once, with the arguments plan() was given
(tensors changed in place since then are read as they are now, as FlashInfer's run() reads
them). A served plan costs no FlashInfer plan at all: the chat ran 1.12-1.36x as fast as
FlashInfer end to end, against 0.86-1.15x with the plan run at once (H200, 2026-12-02 (50)).
Never deferred: use_cuda_graph=True wrappers and a plan() inside a capture. A wrapper whose
run() is captured while its plan() was not must set PREFILL_BUNDLE_DEFER_PLAN=0: FlashInfer's
plan() cannot run inside a capture, so such a fallback raises and says so.
"""

from __future__ import annotations

import os

import torch
from flashinfer_bench.apply import apply
from flashinfer_bench.integration.flashinfer.common import (
    infer_kv_layout_from_args,
    infer_paged_kv_layout_from_tensors,
    infer_ragged_kv_layout_from_tensors,
    normalize_paged_kv_to_nhd,
    normalize_ragged_kv_to_nhd,
    pick_sm_scale_gqa,
    write_back_outputs,
)
from flashinfer_bench.integration.patch_manager import PatchSpec, get_manager
from flashinfer_bench.integration.utils import ArgBinder, ContextStore

SERVED_PAGE_SIZES = (1, 64)  # FlashInfer-Trace's paged prefill definitions
FP8_PAGE_SIZE = 64  # the FP8 definition's

# plan() arguments that change what FlashInfer computes, with the values under which it
# computes what the definitions do (None: the argument's absence). head_dim_vo may also equal
# head_dim_qk, logits_soft_cap be 0 (FlashInfer's "no cap").
PLAN_AS_DEFINED = {
    "custom_mask": None,
    "packed_custom_mask": None,
    "pos_encoding_mode": "NONE",
    "logits_soft_cap": None,
    "head_dim_vo": None,
    "prefix_len_ptr": None,  # prefix-shared ("POD") item masks
    "token_pos_in_items_ptr": None,
    "max_item_len_ptr": None,
    "v_indptr": None,  # ragged: V or O rows laid out apart from K's and Q's
    "o_indptr": None,
}
# run() keyword arguments likewise (k_scale and v_scale: only an FP8 cache's scales).
RUN_AS_DEFINED = {"sinks": None, "skip_softmax_threshold_scale_factor": None, "args": ()}


def paged_definition_name(q, k_cache, page_size: int) -> str:
    fp8 = "_fp8kv" if k_cache.dtype == torch.float8_e4m3fn else ""
    return (
        f"gqa_paged_prefill_causal{fp8}_h{q.shape[1]}_kv{k_cache.shape[2]}_d{q.shape[2]}"
        f"_ps{page_size}"
    )


def ragged_definition_name(q, k, window_left: int) -> str:
    swa = "_swa" if window_left >= 0 else ""
    return f"gqa_ragged_prefill_causal{swa}_h{q.shape[1]}_kv{k.shape[1]}_d{q.shape[2]}"


def unserved_plan(plan: dict):
    """The first plan() argument no definition computes (its name), or None."""
    if not plan.get("causal"):
        return "not causal"
    for name, value in PLAN_AS_DEFINED.items():
        given = plan.get(name)
        if given is value:
            continue
        if torch.is_tensor(given) or given != value:
            if name == "logits_soft_cap" and given == 0:
                continue
            if name == "head_dim_vo" and given == plan.get("head_dim_qk"):
                continue
            return name
    return None


def unserved_run(bound: dict):
    """The first run() argument no definition computes (its name), or None."""
    for name, value in RUN_AS_DEFINED.items():
        given = bound.get(name)
        if not (given is value or (name == "args" and len(given or ()) == 0)):
            return name
    return None


def capturing(q) -> bool:
    """Whether q's device's current stream is being captured into a CUDA graph."""
    return q.is_cuda and torch.cuda.is_current_stream_capturing()


def heads_match(q, plan: dict) -> bool:
    return q.dim() == 3 and q.shape[1] == plan["num_qo_heads"] and q.shape[2] == plan["head_dim_qk"]


def deferral_enabled() -> bool:
    """PREFILL_BUNDLE_DEFER_PLAN: unset or 1 defers, 0 does not; anything else is refused."""
    value = os.environ.get("PREFILL_BUNDLE_DEFER_PLAN", "1")
    if value not in ("0", "1"):
        raise ValueError(
            f"PREFILL_BUNDLE_DEFER_PLAN={value!r}: expected 1 (defer FlashInfer's plan() until "
            "a run() falls back, the default) or 0 (run it at plan())"
        )
    return value == "1"


def defers_plan(inst, plan: dict) -> bool:
    """A plan a definition computes, outside CUDA graphs, unless PREFILL_BUNDLE_DEFER_PLAN=0."""
    return (
        deferral_enabled()
        and plan["unserved"] is None
        and not getattr(inst, "_use_cuda_graph", False)
        and not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
    )


def planned_by_flashinfer(plan: dict, args: tuple, kwargs: dict) -> None:
    """Before FlashInfer's run(): its plan() if the adapter deferred it (once a plan)."""
    if not plan or "flashinfer_plan" not in plan:
        return
    q = args[0] if args else kwargs.get("q")
    if torch.is_tensor(q) and capturing(q):  # the plan stays deferred for a run() outside
        raise RuntimeError(
            "this run() falls back to FlashInfer's kernel inside a CUDA graph capture, but its "
            "plan() was deferred (the bundle's default) and cannot run there; set "
            "PREFILL_BUNDLE_DEFER_PLAN=0 for wrappers run under capture, or use FlashInfer's "
            "use_cuda_graph=True wrappers (never deferred)"
        )
    plan.pop("flashinfer_plan")()


class BundleAdapter:
    """plan() recorded per wrapper instance (every argument, defaults applied, sm_scale resolved,
    and whether a definition computes it: `unserved`); run() served by `serve` (a subclass's:
    apply's result, or None for FlashInfer's own run)."""

    wrapper = ""  # the FlashInfer class under flashinfer.prefill
    key = ""  # the patch specs' ctx_key
    positional = ()  # run()'s parameters before *args; the rest are keyword-only

    def __init__(self) -> None:
        self._plans = ContextStore()

    def targets(self) -> list:
        path = f"flashinfer.prefill.{self.wrapper}"
        return [
            PatchSpec(path=f"{path}.{method}", kind="method", name=f"{self.key}_{method}",
                      ctx_key=self.key)  # fmt: skip
            for method in ("plan", "run")
        ]

    def make_wrapper(self, spec: PatchSpec, orig):
        if spec.name.endswith("_plan"):
            binder = ArgBinder.from_callable(orig)

            def plan_wrapper(inst, *args, **kwargs):
                plan = self._plans.get(inst)
                plan.clear()
                plan.update(binder.bind((inst, *args), kwargs))
                plan["kv_layout"] = infer_kv_layout_from_args(inst)
                plan["unserved"] = unserved_plan(plan)
                plan["sm_scale"] = pick_sm_scale_gqa(plan["head_dim_qk"], plan["sm_scale"])
                if defers_plan(inst, plan):
                    plan["flashinfer_plan"] = lambda: orig(inst, *args, **kwargs)
                    return None
                return orig(inst, *args, **kwargs)  # FlashInfer's run() will need it

            return plan_wrapper

        def run_wrapper(inst, *args, **kwargs):
            plan = self._plans.get(inst)
            bound = self.run_arguments(args, kwargs)

            def flashinfer_run(**_):
                planned_by_flashinfer(plan, args, kwargs)
                return orig(inst, *args, **kwargs)

            served = None
            if (
                plan
                and bound is not None
                and plan["unserved"] is None
                and unserved_run(bound) is None
                and heads_match(bound["q"], plan)
                and not getattr(inst, "_use_cuda_graph", False)
                and not capturing(bound["q"])
            ):
                served = self.serve(plan, bound, flashinfer_run)
            if served is None:
                return flashinfer_run()
            output, lse = served if isinstance(served, tuple) else (served, None)
            return write_back_outputs(
                output=output, lse=lse, want_lse=bool(bound.get("return_lse", False)),
                out_buf=bound.get("out"), lse_buf=bound.get("lse"),
            )  # fmt: skip

        return run_wrapper

    def run_arguments(self, args: tuple, kwargs: dict):
        """run()'s arguments by name (extra positional ones under "args"), without
        inspect.signature's bind (~10 us a call): the parameters after *args are keyword-only.
        None when a positional one is missing (FlashInfer's own run() then says so)."""
        bound = dict(zip(self.positional, args))
        bound["args"] = args[len(self.positional):]
        bound.update(kwargs)
        return bound if all(name in bound for name in self.positional) else None

    def serve(self, plan: dict, bound: dict, fallback):
        raise NotImplementedError


class PagedPrefillAdapter(BundleAdapter):
    wrapper, key = "BatchPrefillWithPagedKVCacheWrapper", "gqa_paged_prefill"
    positional = ("q", "paged_kv_cache")

    def serve(self, plan, bound, fallback):
        page_size = plan["page_size"]
        if page_size not in SERVED_PAGE_SIZES or plan["window_left"] != -1:
            return None
        if bound.get("window_left") not in (None, -1):
            return None
        q, cache = bound["q"], bound["paged_kv_cache"]
        layout = plan["kv_layout"] or infer_paged_kv_layout_from_tensors(
            cache, plan["num_kv_heads"]
        )
        if not layout:
            return None
        k_cache, v_cache = normalize_paged_kv_to_nhd(cache, layout)
        scales = (bound.get("k_scale"), bound.get("v_scale"))
        fp8 = k_cache.dtype == torch.float8_e4m3fn
        if fp8 and page_size != FP8_PAGE_SIZE:
            return None
        if any(not (scale is None or isinstance(scale, (int, float))) for scale in scales):
            return None  # a tensor scale: reading it would sync the host
        if not fp8 and any(scale not in (None, 1.0) for scale in scales):
            return None
        arguments = {
            "q": q,
            "k_cache": k_cache,
            "v_cache": v_cache,
            "qo_indptr": plan["qo_indptr"],
            "kv_indptr": plan["paged_kv_indptr"],
            "kv_indices": plan["paged_kv_indices"],
        }
        if page_size > 1:  # the page size 1 definition has no kv_last_page_len
            arguments["kv_last_page_len"] = plan["paged_kv_last_page_len"]
        if fp8:
            arguments["k_scale"], arguments["v_scale"] = (
                1.0 if scale is None else float(scale) for scale in scales
            )
        arguments["sm_scale"] = plan["sm_scale"]
        return apply(paged_definition_name(q, k_cache, page_size), kwargs=arguments,
                     fallback=fallback)  # fmt: skip


class RaggedPrefillAdapter(BundleAdapter):
    wrapper, key = "BatchPrefillWithRaggedKVCacheWrapper", "gqa_ragged_prefill"
    positional = ("q", "k", "v")

    def serve(self, plan, bound, fallback):
        q, k, v = bound["q"], bound["k"], bound["v"]
        layout = plan["kv_layout"] or infer_ragged_kv_layout_from_tensors(k, plan["num_kv_heads"])
        if not layout:
            return None
        k, v = normalize_ragged_kv_to_nhd(k, layout), normalize_ragged_kv_to_nhd(v, layout)
        window_left = int(plan["window_left"])
        arguments = {"q": q, "k": k, "v": v, "qo_indptr": plan["qo_indptr"],
                     "kv_indptr": plan["kv_indptr"]}  # fmt: skip
        if window_left >= 0:
            arguments["window_left"] = window_left
        arguments["sm_scale"] = plan["sm_scale"]
        return apply(ragged_definition_name(q, k, window_left), kwargs=arguments,
                     fallback=fallback)  # fmt: skip


def install_prefill_adapters() -> None:
    """Patch both prefill wrappers' plan/run with the bundle's adapters (once; a no-op where
    FlashInfer is missing)."""
    for adapter in (PagedPrefillAdapter(), RaggedPrefillAdapter()):
        for spec in adapter.targets():
            get_manager().patch(spec, adapter.make_wrapper)
