"""Serve the bundle through flashinfer-bench's apply.

    from prefill_bundle.serving import enable_bundle_apply
    runtime = enable_bundle_apply()              # the bundle's own solutions
    runtime = enable_bundle_apply(["triton_mini", "triton_ragged"])  # restrict the backends

Baselines (author "baseline") do not serve unless named: the FlashInfer baseline calls the very
wrapper that apply's FlashInfer integration reroutes, which would recurse.

Three things stock apply lacks for this op:
- ApplyConfig() admits no trace of ours: its max_rtol=1e-5 is compared with the trace's
  elementwise max relative error, which is in the hundreds for every correct fp16/bf16 kernel
  (tiny |ref| elements). flashinfer-bench already judged correctness (PASSED: allclose at
  atol=rtol=1e-2), so BUNDLE_APPLY_CONFIG ignores the elementwise rtol and only bounds the
  absolute error.
- Its key is the exact tuple of var axes and ignores causal: in a serving loop nearly every call
  misses. BucketedPrefillKeyBuilder keys on powers of two of the lengths and the batch, plus
  causal; per key flashinfer-bench keeps the trace with the best speedup over the reference,
  which is the lowest latency when a bucket holds one workload (true for this bundle's
  workloads); a bucket without traces goes to the definition's best (on_miss_policy).
- A solution that fails to build raises inside apply: enable_bundle_apply builds every solution
  up front and drops the ones that fail, so their buckets go to the next best solution.
- flashinfer-bench's adapter for BatchPrefillWithPagedKVCacheWrapper calls apply with
  (q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sm_scale, page_size): no
  kv_last_page_len, which FlashInfer-Trace's page size 64 definition needs, and a page_size no
  paged definition takes. Its adapters for both prefill wrappers also ignore plan()'s
  window_left, soft cap, custom mask and RoPE mode, and run()'s sinks and scales. The bundle
  installs its own adapters for both wrappers first (flashinfer_adapter.py): each definition's
  own arguments, and FlashInfer's own run() for what no definition computes.
- A call the chosen solution cannot take (another dtype, a layout it does not address, an
  indptr that is not a tensor) raises from it, where the user's own function would have
  served it: BundleApplyRuntime sends such a call to the fallback instead, with a warning the
  first time each argument is the reason. Solutions check their arguments before launching
  anything, so nothing has run when they refuse.
"""

from __future__ import annotations

import logging
import math
import operator
from collections import Counter

import torch
from flashinfer_bench import TraceSet
from flashinfer_bench.apply import ApplyConfig, ApplyConfigRegistry, ApplyRuntime
from flashinfer_bench.apply.key import ApplyKey, ApplyKeyBuilder, ApplyKeyFactory
from flashinfer_bench.apply.table import ApplyTable, _apply_table_dir
from flashinfer_bench.compile import BuilderRegistry
from flashinfer_bench.utils import dtype_str_to_torch_dtype

from . import OP_TYPE, PAGED_OP_TYPE, REPO_ROOT
from .flashinfer_adapter import install_prefill_adapters
from .packing import BASELINE_AUTHOR

logger = logging.getLogger(__name__)

BUNDLE_APPLY_CONFIG = ApplyConfig(
    max_atol=5e-2,  # correct kernels measured at most ~1.6e-2 on these workloads
    max_rtol=math.inf,  # elementwise relative error says nothing here (see above)
    on_miss_policy="use_def_best",
)


def pow2_bucket(n: int) -> int:
    """The smallest power of two >= n (0 stays 0)."""
    return 0 if n <= 0 else 1 << (n - 1).bit_length()


def window_bucket(window_left) -> int:
    """-1 (no window) stays -1; a window w >= 0 goes to the smallest power of two >= w."""
    return -1 if window_left < 0 else pow2_bucket(window_left)


class BucketedPrefillKeyBuilder(ApplyKeyBuilder):
    """Key = powers of two of (batch or sequences, query tokens, key tokens), causal, and for the
    sliding-window definition the window's power of two (an unseen window goes to its bucket).

    Paged definitions count key tokens as pages x page size (the last pages' fill would need a
    host read). Keys are memoised per raw shape so that a call pays a dict lookup, not a
    pydantic model."""

    def __init__(self, definition) -> None:
        super().__init__(definition)
        self._padded = "batch" in definition.var_axes
        page_size = definition.axes.get("page_size")
        self._page_size = page_size.value if page_size is not None else 0
        self._windowed = "window_left" in definition.inputs  # the argument after kv_indptr
        self._names = ("batch", "seq_q", "seq_kv") if self._padded else ("seqs", "q", "kv")
        self._memo: dict = {}
        self._read_raw = self._raw_reader()

    def _raw_reader(self):
        """The definition's own reader of the raw key, chosen once: a call's key costs its
        shape reads and no branches (every served call pays it)."""
        page_size = self._page_size
        if self._padded:

            def read(args):
                q_shape = args[0].shape
                return (q_shape[0], q_shape[1], args[1].shape[1], bool(args[3]))
        elif page_size:

            def read(args):
                return (args[3].shape[0] - 1, args[0].shape[0], args[5].shape[0] * page_size, True)
        else:

            def read(args):
                return (args[3].shape[0] - 1, args[0].shape[0], args[1].shape[0], True)

        if not self._windowed:
            return read
        return lambda args: (*read(args), operator.index(args[5]))

    def raw_key(self, args):
        """The key's raw values (shapes, causal, window) read off the arguments, or None when
        they are not the definition's arguments (the solution will say why)."""
        try:
            return self._read_raw(args)
        except (AttributeError, IndexError, TypeError, RuntimeError, ValueError):
            return None

    def build_from_args(self, args) -> ApplyKey:
        raw = self.raw_key(args)
        return UNSERVABLE_KEY if raw is None else self.key_of(raw)

    def key_of(self, raw) -> ApplyKey:
        key = self._memo.get(raw)
        if key is None:
            if len(self._memo) > 65536:
                self._memo.clear()
            key = self._memo[raw] = self._key(*raw)
        return key

    def build_from_workload(self, workload) -> ApplyKey:
        axes = workload.axes
        if self._padded:
            causal = bool(workload.inputs["causal"].value)
            return self._key(axes["batch"], axes["seq_q"], axes["seq_kv"], causal)
        if self._page_size:
            kv_tokens = axes["num_kv_indices"] * self._page_size
            return self._key(axes["len_indptr"] - 1, axes["total_q"], kv_tokens, True)
        window = (int(workload.inputs["window_left"].value),) if self._windowed else ()
        return self._key(axes["len_indptr"] - 1, axes["total_q"], axes["total_kv"], True, *window)

    def features(self, args):
        return ()

    def _key(self, sequences: int, q_tokens: int, kv_tokens: int, causal: bool,
             *window) -> ApplyKey:  # fmt: skip
        buckets = map(pow2_bucket, (sequences, q_tokens, kv_tokens))
        feats = (("causal", causal),) + tuple(("window", window_bucket(w)) for w in window)
        return ApplyKey(axes=tuple(zip(self._names, buckets)), feats=feats)


def output_allocation(definition) -> tuple | None:
    """(ndim, dtype) of each output when every output is shaped as the first ndim axes of q
    (these definitions: output as q, lse as q without head_dim), else None."""
    q_axes = definition.inputs["q"].shape
    outputs = tuple(definition.outputs.values())
    if not all(o.shape == q_axes[: len(o.shape)] for o in outputs):
        return None
    return tuple((len(o.shape), dtype_str_to_torch_dtype(o.dtype)) for o in outputs)


def allocate_outputs(allocation: tuple, q: torch.Tensor) -> list:
    """Empty outputs of a value-returning call, shaped off q by output_allocation's (ndim, dtype)
    (flashinfer-bench's generic allocation reads every axis first)."""
    return [torch.empty(q.shape[:ndim], dtype=dtype, device=q.device) for ndim, dtype in allocation]


UNSERVABLE_KEY = ApplyKey(axes=(), feats=(("unservable", True),))
ApplyKeyFactory.register(OP_TYPE, BucketedPrefillKeyBuilder)
ApplyKeyFactory.register(PAGED_OP_TYPE, BucketedPrefillKeyBuilder)


class BundleApplyRuntime(ApplyRuntime):
    """ApplyRuntime whose solutions never raise where the fallback would have served the call:
    a solution's argument error (ValueError or TypeError, raised before it launches anything)
    sends the call to the fallback, with a warning the first time per definition and argument.

    Calls of the bundle's definitions take a route remembered per raw key (shapes, causal,
    window): the bucket's runnable, found once as flashinfer-bench's dispatch finds it (table,
    then the definition's best), then a dict lookup a call instead of its key model, table and
    registry lookups (issue 19: apply's per-call overhead). `served` counts the solution each
    routed call ran. Anything else (another definition, a miss, arguments the key builder cannot
    read) goes through flashinfer-bench's dispatch."""

    def __init__(self, *args, **kwargs) -> None:
        install_prefill_adapters()  # before flashinfer-bench's, which would then skip
        super().__init__(*args, **kwargs)
        self.refusals: dict = {}  # (definition, argument) -> first message, for the warning
        self.served: Counter = Counter()
        # definition -> (definition, input count, output count, key builder, output_allocation)
        # or None (not routed here)
        self._plans: dict = {}
        self._routes: dict = {}  # (definition, raw key) -> (solution name, runnable) or None

    def _plan(self, def_name):
        definition = self._trace_set.definitions.get(def_name)
        if definition is None or self._config_registry.get(def_name) is None:
            return None
        builder = ApplyKeyFactory.specialize(definition)
        if not isinstance(builder, BucketedPrefillKeyBuilder):
            return None
        inputs, outputs = len(definition.inputs), len(definition.outputs)
        return definition, inputs, outputs, builder, output_allocation(definition)

    def _resolve(self, def_name, definition, key):
        """(solution name, runnable) for key, as ApplyRuntime.dispatch chooses it, or None."""
        registry = BuilderRegistry.get_instance()
        names = [self._table.match_solution(def_name, key)]
        if self._config_registry.get(def_name).on_miss_policy == "use_def_best":
            names.append(self._table.def_best.get(def_name))
        for name in names:
            solution = self._trace_set.get_solution(name) if name else None
            if solution is not None:
                return name, registry.build(definition, solution)
        return None

    def _route(self, def_name, args, kwargs):
        """(solution name, runnable, arguments in order, destination passing) or None."""
        plan = self._plans.get(def_name, False)
        if plan is False:
            plan = self._plans[def_name] = self._plan(def_name)
        if plan is None:
            return None
        definition, num_inputs, num_outputs, builder, outputs = plan
        merged = definition.merge_kwargs_to_args(args, kwargs) if kwargs else args
        if len(merged) not in (num_inputs, num_inputs + num_outputs):
            return None  # flashinfer-bench's dispatch raises its error
        raw = builder.raw_key(merged[:num_inputs])
        if raw is None:
            return None
        route = self._routes.get((def_name, raw), False)
        if route is False:
            if len(self._routes) > 65536:  # raw keys are exact lengths: bound the memory
                self._routes.clear()
            route = self._routes[(def_name, raw)] = self._resolve(
                def_name, definition, builder.key_of(raw)
            )
        if route is None:
            return None
        return (*route, merged, len(merged) != num_inputs, outputs)

    def dispatch(self, def_name, args, kwargs, fallback):
        route = self._route(def_name, args, kwargs)
        if route is None:
            return self._dispatch_unrouted(def_name, args, kwargs, fallback)
        # A routed call runs the solution alone (it never calls the fallback), so unlike the
        # unrouted path there is nothing to track: a refusal is the solution's. Inline and
        # closure-free, as this is every served call's overhead (issue 19's 5 us bar).
        name, runnable, merged, destination_passing, outputs = route
        self.served[name] += 1
        try:
            if destination_passing:
                runnable.call_destination_passing(*merged)
                return None
            if outputs is None or not runnable.metadata.destination_passing_style:
                return runnable.call_value_returning(*merged)
            # Value-returning call of a destination-passing solution: the outputs made here.
            tensors = allocate_outputs(outputs, merged[0])
            runnable.call_destination_passing(*merged, *tensors)
            return tensors[0] if len(tensors) == 1 else tuple(tensors)
        except (ValueError, TypeError) as error:
            if fallback is None:
                raise
            return self._refused(def_name, error, args, kwargs, fallback)

    def _dispatch_unrouted(self, def_name, args, kwargs, fallback):
        """flashinfer-bench's dispatch, with a refusal of its solution sent to the fallback (an
        error of the fallback itself is raised)."""
        if fallback is None:
            return super().dispatch(def_name, args, kwargs, fallback)
        fallback_ran = False

        def tracked_fallback(*fallback_args, **fallback_kwargs):
            nonlocal fallback_ran
            fallback_ran = True
            return fallback(*fallback_args, **fallback_kwargs)

        try:
            return super().dispatch(def_name, args, kwargs, tracked_fallback)
        except (ValueError, TypeError) as error:
            if fallback_ran:
                raise  # the user's own function failed: that error is theirs to see
            return self._refused(def_name, error, args, kwargs, fallback)

    def _refused(self, def_name, error, args, kwargs, fallback):
        """The fallback's result for a call a solution refused, warning once per argument."""
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        argument = reason.split(":")[0]
        if (def_name, argument) not in self.refusals:
            self.refusals[(def_name, argument)] = reason
            logger.warning("apply: %s falls back for this call: %s", def_name, reason)
        return fallback(*args, **kwargs)


def keep_only(trace_set: TraceSet, solution_names) -> None:
    """Drop every solution (and its traces) not named."""
    keep = set(solution_names)
    for def_name in list(trace_set.solutions):
        trace_set.solutions[def_name] = [s for s in trace_set.solutions[def_name] if s.name in keep]
    for def_name in list(trace_set.traces):
        trace_set.traces[def_name] = [t for t in trace_set.traces[def_name] if t.solution in keep]


def buildable_solutions(trace_set: TraceSet) -> list:
    """Names of the solutions that build here; a failure is logged, not raised."""
    registry = BuilderRegistry.get_instance()
    names = []
    for def_name, solutions in trace_set.solutions.items():
        for solution in solutions:
            try:
                registry.build(trace_set.definitions[def_name], solution)
                names.append(solution.name)
            except Exception as error:  # a missing toolchain, a compile error, an import error
                logger.warning("apply: dropping %s, its build failed: %s", solution.name, error)
    return names


def enable_bundle_apply(
    solutions=None, root=REPO_ROOT, config=BUNDLE_APPLY_CONFIG
) -> BundleApplyRuntime:
    """Start apply over this bundle's traces; `solutions` restricts which solutions may serve
    (unknown names raise ValueError, naming the known ones)."""
    trace_set = TraceSet.from_path(str(root))
    every = [s for sols in trace_set.solutions.values() for s in sols]
    if solutions is None:
        solutions = [s.name for s in every if s.author != BASELINE_AUTHOR]
    unknown = sorted(set(solutions) - {s.name for s in every})
    if unknown:
        known = ", ".join(sorted(s.name for s in every))
        raise ValueError(f"solutions: expected names among {known}, got unknown {unknown}")
    keep_only(trace_set, solutions)
    keep_only(trace_set, buildable_solutions(trace_set))
    # flashinfer-bench caches the table on disk by a digest of traces and config only: one built
    # earlier with another key builder would be reused and miss every call. Build it afresh.
    digest = ApplyTable._digest(trace_set, ApplyConfigRegistry(default=config))
    (_apply_table_dir() / f"{digest}.json").unlink(missing_ok=True)
    runtime = BundleApplyRuntime(trace_set, config)
    runtime.start()
    return runtime


def dispatch_table(runtime: ApplyRuntime) -> dict:
    """{definition: {bucket key: solution}} as apply will dispatch (read from its table)."""
    table = runtime._table  # flashinfer-bench exposes no getter for it
    return {name: dict(index) for name, index in table.index.items()}
