"""One test matrix and one correctness check, shared by every backend's tests.

Cases are small enough for the Triton interpreter on CPU (CPU_*) or large for the GPU (GPU_*).
A solution is always exercised as packed: built by flashinfer-bench from its generated JSON.
"""

from __future__ import annotations

import importlib
import importlib.util
import io
import logging
import math
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path
from unittest import mock

import torch
from flashinfer_bench import Definition, Solution
from flashinfer_bench.compile import BuilderRegistry

from . import (
    HEAD_DIM,
    MINI,
    NUM_HEADS,
    NUM_KV_HEADS,
    PAGED_FP8,
    PAGED_PS1,
    PAGED_PS64,
    RAGGED,
    REPO_ROOT,
    SWA,
)
from .definitions import definition_path
from .workloads import (
    MINI_SHAPES,
    PAGED_BATCHES,
    RAGGED_BATCHES,
    SWA_BATCHES,
    PagedBatch,
    lengths_to_indptr,
)

ATOL = RTOL = 1e-2
# Normwise relative error allowed per output dtype. bf16 keeps 8 bits of mantissa against fp16's
# 11: its rounding alone costs ~1.5e-3, and FlashInfer fa3 measured 2.4e-3 on the H100.
MAX_NORMWISE_ERROR = {torch.float16: 2e-3, torch.bfloat16: 5e-3, torch.float32: 2e-3}


@dataclass(frozen=True)
class PaddedCase:
    batch: int
    seq_q: int
    seq_kv: int
    causal: bool
    dtype: torch.dtype = torch.float16
    definition = MINI

    @property
    def id(self) -> str:
        mask = "causal" if self.causal else "full"
        return f"b{self.batch}_q{self.seq_q}_kv{self.seq_kv}_{mask}_{str(self.dtype)[6:]}"


def padded_case(shape: str, dtype: torch.dtype = torch.float16) -> PaddedCase:
    """The GPU scripts' padded shapes: BATCHxKEYS (seq_q = seq_kv, non-causal) or
    BATCHxKEYS-causal."""
    size, _, mask = shape.partition("-")
    if mask not in ("", "causal") or size.count("x") != 1:
        raise ValueError(f"padded shape {shape!r}: want BATCHxKEYS[-causal]")
    batch, keys = (int(x) for x in size.split("x"))
    return PaddedCase(batch, keys, keys, mask == "causal", dtype)


@dataclass(frozen=True)
class RaggedCase:
    q_lens: tuple
    kv_lens: tuple
    dtype: torch.dtype = torch.bfloat16
    sm_scale: float = 1.0 / math.sqrt(HEAD_DIM)
    window_left: int | None = None  # set: a case of the sliding-window definition

    @property
    def definition(self) -> str:
        return RAGGED if self.window_left is None else SWA

    @property
    def id(self) -> str:
        pairs = "_".join(f"{q}x{kv}" for q, kv in zip(self.q_lens, self.kv_lens))
        scale = "" if self.sm_scale == 1.0 / math.sqrt(HEAD_DIM) else f"_scale{self.sm_scale:g}"
        window = "" if self.window_left is None else f"_window{self.window_left}"
        return f"ragged_{pairs[:60]}_{len(self.q_lens)}seq_{str(self.dtype)[6:]}{scale}{window}"


# Small shapes for the interpreter: lengths off the tile grid, length 1, seq_q != seq_kv both
# ways (seq_q > seq_kv leaves causal rows that see no key), several sequences, both dtypes.
CPU_PADDED_CASES = [
    PaddedCase(1, 1, 1, True),
    PaddedCase(2, 37, 53, True),
    PaddedCase(2, 37, 53, False),
    PaddedCase(1, 70, 19, True),  # 51 query rows see no key
    PaddedCase(1, 64, 64, True, torch.bfloat16),
    PaddedCase(3, 5, 130, False),
]
CPU_RAGGED_CASES = [
    RaggedCase((1,), (1,)),
    RaggedCase((7, 0, 33), (7, 0, 40)),  # an empty sequence
    RaggedCase((16, 5), (16, 0)),  # queries without keys
    RaggedCase((0, 0), (3, 0)),  # no query at all
    RaggedCase((45, 20), (12, 70)),  # seq_q > seq_kv, then seq_q < seq_kv
    RaggedCase((65, 1, 17), (65, 1, 17), torch.float16),
    RaggedCase((9, 20), (9, 33), torch.float16, sm_scale=-0.3),
    RaggedCase((9, 20), (9, 33), sm_scale=0.0),
    RaggedCase((1, 2, 1, 0), (200, 97, 140, 5)),  # decode-like rows: Triton splits the keys
]

# Every workload's shape plus the edges, at sizes that matter on the GPU.
GPU_PADDED_CASES = [PaddedCase(s.batch, s.seq_q, s.seq_kv, s.causal) for s in MINI_SHAPES] + [
    PaddedCase(2, 1000, 300, True),  # seq_q > seq_kv: 700 rows per sequence see no key
    PaddedCase(3, 129, 257, True),
    PaddedCase(1, 1, 4097, True),
    PaddedCase(2, 333, 777, False, torch.bfloat16),
    PaddedCase(1, 32768, 32768, True),
    PaddedCase(1, 5000, 3000, True),  # big enough for Triton's paired row blocks; 2000 rows blind
]
GPU_RAGGED_CASES = [RaggedCase(b.q_lens, b.kv_lens) for b in RAGGED_BATCHES] + [
    RaggedCase((1000, 0, 77), (300, 0, 77)),
    RaggedCase((129, 3, 511), (257, 0, 2049)),
    RaggedCase((32768,), (32768,)),
    RaggedCase((4500, 37), (3000, 4000)),  # paired row blocks (Triton) with keyless rows
    RaggedCase((100, 200), (500, 400), torch.float16),
    # sm_scale is the caller's: zero (uniform weights) and negative are valid floats too.
    RaggedCase((100, 37), (100, 300), sm_scale=0.0),
    RaggedCase((100, 37), (100, 300), torch.float16, sm_scale=-0.3),
]

# Sliding windows: 0 (a query sees only its own position), 1, shorter and longer than the
# sequence, -1 (none); seq_q != seq_kv both ways, empty sequences, rows that see no key. Lengths
# off the tile grid, so the band's edges cut tiles anywhere.
_BF16 = torch.bfloat16
CPU_SWA_CASES = [
    RaggedCase((1,), (1,), window_left=0),
    RaggedCase((37, 0, 70), (37, 0, 70), window_left=0),
    RaggedCase((70, 9), (70, 20), window_left=1),
    RaggedCase((130, 5), (130, 100), window_left=17),  # the band crosses several key tiles
    RaggedCase((45, 20), (12, 70), window_left=5),  # seq_q > seq_kv: 33 rows see no key
    RaggedCase((16, 5), (16, 0), window_left=3),  # queries without keys
    RaggedCase((65, 1, 17), (65, 1, 17), torch.float16, window_left=200),  # longer than all
    RaggedCase((33, 40), (33, 90), window_left=-1),  # no window: plain causal
    RaggedCase((9, 20), (9, 33), torch.float16, sm_scale=-0.3, window_left=7),
]
GPU_SWA_CASES = [
    RaggedCase(b.q_lens, b.kv_lens, window_left=b.window_left) for b in SWA_BATCHES
] + [
    RaggedCase((1000, 0, 77), (300, 0, 77), window_left=64),  # 700 rows see no key
    RaggedCase((129, 3, 511), (257, 0, 2049), window_left=0),
    RaggedCase((129, 3, 511), (257, 0, 2049), window_left=1),
    RaggedCase((4500, 37), (3000, 4000), window_left=300),
    RaggedCase((3000, 2048), (3000, 9000), window_left=127),  # band edges inside key tiles
    RaggedCase((3000, 2048), (3000, 9000), torch.float16, window_left=128),
    RaggedCase((8192,), (8192,), window_left=-1),
    RaggedCase((100, 200), (500, 400), torch.float16, window_left=1 << 30),
    RaggedCase((100, 37), (100, 300), sm_scale=0.0, window_left=50),
    RaggedCase((2048, 1), (16384, 5000), _BF16, sm_scale=-0.3, window_left=1000),
]


@dataclass(frozen=True)
class PagedCase:
    """A batch over a paged cache (workloads.PagedBatch's allocator: shuffled pages, spare
    pages, shared_prefix tokens shared page for page). Unused cache slots are NaN."""

    q_lens: tuple
    kv_lens: tuple
    page_size: int
    dtype: torch.dtype = torch.bfloat16
    shared_prefix: tuple = ()
    sm_scale: float = 1.0 / math.sqrt(HEAD_DIM)
    fp8_scales: tuple = ()  # (k_scale, v_scale): the caches in float8_e4m3fn (page size 64)
    kv_magnitude: float = 1.0  # FP8: cache values randn x this, clamped to e4m3's +-448

    @property
    def definition(self) -> str:
        if self.fp8_scales:
            return PAGED_FP8
        return PAGED_PS1 if self.page_size == 1 else PAGED_PS64

    @property
    def batch(self) -> PagedBatch:
        return PagedBatch("case", self.q_lens, self.kv_lens, self.shared_prefix)

    @property
    def id(self) -> str:
        pairs = "_".join(f"{q}x{kv}" for q, kv in zip(self.q_lens, self.kv_lens))
        shared = "_shared" if self.shared_prefix else ""
        scale = "" if self.sm_scale == 1.0 / math.sqrt(HEAD_DIM) else f"_scale{self.sm_scale:g}"
        fp8 = "_fp8kv{:g}x{:g}".format(*self.fp8_scales) if self.fp8_scales else ""
        fp8 += f"_magnitude{self.kv_magnitude:g}" if self.kv_magnitude != 1.0 else ""
        return f"paged{self.page_size}_{pairs[:60]}{shared}_{str(self.dtype)[6:]}{scale}{fp8}"


CPU_PAGED_CASES = [
    PagedCase((1,), (1,), 1),
    PagedCase((1,), (1,), 64),  # last page length 1
    PagedCase((7, 0, 33), (7, 0, 40), 64),  # an empty sequence (no pages)
    PagedCase((16, 5), (16, 0), 64),  # queries without keys
    PagedCase((45, 20), (12, 70), 1),  # seq_q > seq_kv, then seq_q < seq_kv
    # Shared prefix pages; last pages of 1, 64 (full) and 1 tokens.
    PagedCase((20, 20, 5), (129, 128, 65), 64, shared_prefix=(64, 64, 0)),
    PagedCase((9, 20, 3), (40, 33, 40), 1, torch.float16, shared_prefix=(30, 0, 30)),
    PagedCase((65, 1, 17), (130, 1, 17), 64, torch.float16),
    PagedCase((9, 20), (9, 33), 64, sm_scale=-0.3),
    # Decode-like rows (Triton splits the keys), shared pages, a part-filled last page.
    PagedCase((1, 1, 3), (200, 64, 130), 64, shared_prefix=(64, 64, 0)),
    PagedCase((1, 2), (90, 41), 1),
]
GPU_PAGED_CASES = (
    [
        PagedCase(b.q_lens, b.kv_lens, page_size, shared_prefix=b.shared_prefix)
        for b in PAGED_BATCHES
        for page_size in (1, 64)
    ]
    + [
        PagedCase((1000, 0, 77), (300, 0, 77), page_size)  # 700 rows see no key
        for page_size in (1, 64)
    ]
    + [
        PagedCase((129, 3, 511), (257, 0, 2049), 64, shared_prefix=(128, 0, 128)),
        PagedCase((4500, 37), (3000, 4000), 64),
        PagedCase((4500, 37), (3000, 4000), 1),
        PagedCase((100, 200, 64), (500, 400, 64), 64, torch.float16),
        PagedCase((100, 200, 1), (500, 401, 64), 1, torch.float16, shared_prefix=(400, 400, 0)),
        PagedCase((2048,), (32768,), 64, torch.float16),
        PagedCase((100, 37), (100, 300), 64, sm_scale=0.0),
    ]
)


# FP8 (e4m3) caches with per-tensor scales that are not 1; values near e4m3's limit (448) with
# a small scale; NaN in unused slots as above.
_FP8 = (0.5, 1.25)
CPU_FP8_CASES = [
    PagedCase((1,), (1,), 64, fp8_scales=_FP8),
    PagedCase((7, 0, 33), (7, 0, 40), 64, fp8_scales=_FP8),
    PagedCase((20, 20, 5), (129, 128, 65), 64, shared_prefix=(64, 64, 0), fp8_scales=_FP8),
    PagedCase((45, 20), (12, 70), 64, fp8_scales=(1 / 256, 1 / 128), kv_magnitude=300.0),
    PagedCase((1, 1), (150, 70), 64, fp8_scales=_FP8),  # decode-like: split keys (Triton)
]
GPU_FP8_CASES = [
    PagedCase(b.q_lens, b.kv_lens, 64, shared_prefix=b.shared_prefix, fp8_scales=_FP8)
    for b in PAGED_BATCHES
] + [
    PagedCase((1000, 0, 77), (300, 0, 77), 64, fp8_scales=_FP8),  # 700 rows see no key
    PagedCase((129, 3, 511), (257, 0, 2049), 64, shared_prefix=(128, 0, 128), fp8_scales=_FP8),
    PagedCase((2048,), (32768,), 64, fp8_scales=(1 / 256, 1 / 128), kv_magnitude=300.0),
    PagedCase((100, 37), (100, 300), 64, sm_scale=-0.3, fp8_scales=(2.0, 0.25)),
]


# q, k, v sliced out of one fused QKV projection (or padded to its token stride).
CPU_FUSED_CASES = [
    PaddedCase(2, 37, 37, True),
    PaddedCase(1, 20, 45, False, torch.bfloat16),
    RaggedCase((7, 0, 33), (7, 0, 33)),
    RaggedCase((16, 5), (40, 3), torch.float16),
]
GPU_FUSED_CASES = [
    PaddedCase(4, 512, 512, True),
    PaddedCase(1, 8192, 8192, True),
    PaddedCase(2, 300, 1000, False),
    PaddedCase(1, 16384, 16384, False),
    RaggedCase((1000, 1, 0, 2048), (1000, 1, 0, 2048)),
    RaggedCase((4500, 37), (3000, 4000)),
]


def make_inputs(case, device, seed: int = 0) -> list:
    """Fresh random inputs in the definition's argument order."""
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=case.dtype)

    if isinstance(case, PagedCase):
        return paged_inputs(case, device, randn)
    if isinstance(case, PaddedCase):
        q = randn(case.batch, case.seq_q, NUM_HEADS, HEAD_DIM)
        k = randn(case.batch, case.seq_kv, NUM_KV_HEADS, HEAD_DIM)
        v = randn(case.batch, case.seq_kv, NUM_KV_HEADS, HEAD_DIM)
        return [q, k, v, case.causal]
    total_q, total_kv = sum(case.q_lens), sum(case.kv_lens)
    return [
        randn(total_q, NUM_HEADS, HEAD_DIM),
        randn(total_kv, NUM_KV_HEADS, HEAD_DIM),
        randn(total_kv, NUM_KV_HEADS, HEAD_DIM),
        lengths_to_indptr(case.q_lens).to(device),
        lengths_to_indptr(case.kv_lens).to(device),
        *(() if case.window_left is None else (case.window_left,)),
        case.sm_scale,
    ]


def nan_slots_to_zero(inputs: list) -> list:
    """make_inputs' tensors with NaN (a paged cache's unused slots) as 0: for timing scripts
    that run FlashInfer too, which reads those slots. float8 has no nan_to_num: through fp32."""
    return [
        (x.nan_to_num() if x.element_size() > 1 else x.float().nan_to_num().to(x.dtype))
        if torch.is_tensor(x) and x.is_floating_point() else x
        for x in inputs
    ]  # fmt: skip


# A NaN in one sequence's K/V must stay in that sequence: sequence 0 ends mid-tile, so its last
# K/V tile runs into sequence 1, whose first 200 keys these cases make NaN.
CPU_NAN_CASES = [PaddedCase(2, 40, 70, True), RaggedCase((30, 20), (50, 60))]


def nan_neighbour_inputs(case, device, seed: int = 0) -> tuple:
    """Inputs with sequence 1's first 200 (or all its) keys and values NaN, the reference outputs
    of the same inputs without them, and the output rows that belong to sequence 0 (padded: batch
    index 0; ragged: its query rows), which must match."""
    expected = reference_outputs(case, make_inputs(case, device, seed))
    inputs = make_inputs(case, device, seed)
    if isinstance(case, PaddedCase):
        for x in inputs[1:3]:
            x[1, :200] = float("nan")
        return inputs, expected, slice(0, 1)
    first = case.kv_lens[0]
    for x in inputs[1:3]:
        x[first : first + 200] = float("nan")
    return inputs, expected, slice(0, case.q_lens[0])


def paged_inputs(case: PagedCase, device, randn) -> list:
    """q, the caches (NaN in every slot no sequence owns: past each last page's length, and the
    spare pages), the page table, then kv_last_page_len for page size 64, and sm_scale."""
    table = case.batch.page_table(case.page_size)
    shape = (table["num_pages"], case.page_size, NUM_KV_HEADS, HEAD_DIM)
    q, k_cache, v_cache = randn(sum(case.q_lens), NUM_HEADS, HEAD_DIM), randn(*shape), randn(*shape)
    if case.fp8_scales:  # drawn in fp32, NaN set, then rounded to e4m3 (NaN stays NaN)
        k_cache, v_cache = ((x.float() * case.kv_magnitude).clamp(-448, 448)
                            for x in (k_cache, v_cache))  # fmt: skip
    owned = torch.zeros(shape[:2], dtype=torch.bool)
    kv_indptr, kv_indices = table["kv_indptr"].tolist(), table["kv_indices"].tolist()
    for s, kv_len in enumerate(case.kv_lens):
        for i, page in enumerate(kv_indices[kv_indptr[s] : kv_indptr[s + 1]]):
            owned[page, : min(case.page_size, kv_len - i * case.page_size)] = True
    for cache in (k_cache, v_cache):
        cache[~owned.to(device)] = float("nan")
    if case.fp8_scales:
        k_cache, v_cache = k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn)
    inputs = [q, k_cache, v_cache] + [table[k].to(device) for k in ("qo_indptr", "kv_indptr",
                                                                    "kv_indices")]  # fmt: skip
    if case.page_size > 1:
        inputs.append(table["kv_last_page_len"].to(device))
    return inputs + list(case.fp8_scales) + [case.sm_scale]


def gathered_ragged_inputs(case: PagedCase, inputs: list) -> list:
    """The ragged definition's inputs holding the same keys and values as the paged `inputs`:
    each sequence's pages gathered in order, its last page cut at its length (q, k, v,
    qo_indptr, kv_indptr in tokens, sm_scale)."""
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices = inputs[:6]
    bounds, ids = kv_indptr.tolist(), kv_indices.tolist()
    k, v = [], []
    for s, kv_len in enumerate(case.kv_lens):
        pages = torch.tensor(ids[bounds[s] : bounds[s + 1]], dtype=torch.long, device=q.device)
        k.append(k_cache[pages].flatten(0, 1)[:kv_len])
        v.append(v_cache[pages].flatten(0, 1)[:kv_len])
    kv_tokens = lengths_to_indptr(case.kv_lens).to(q.device)
    return [q, torch.cat(k), torch.cat(v), qo_indptr, kv_tokens, inputs[-1]]


@lru_cache(maxsize=None)
def load_definition(name: str) -> Definition:
    path = REPO_ROOT / definition_path(name)
    return Definition.model_validate_json(path.read_text())


@lru_cache(maxsize=None)
def reference(name: str):
    """The definition's own reference `run`, executed from its JSON (the contract)."""
    namespace: dict = {}
    exec(compile(load_definition(name).reference, f"<reference {name}>", "exec"), namespace)
    return namespace["run"]


def reference_outputs(case, inputs) -> list:
    out = reference(case.definition)(*inputs)
    return list(out) if isinstance(out, tuple) else [out]


def poisoned_outputs(case, inputs) -> list:
    """Output buffers full of NaN, so that an element the kernel never writes shows."""
    q = inputs[0]  # maybe token-strided: the outputs are contiguous all the same
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=q.device)
    if isinstance(case, PaddedCase):
        return [out]
    return [out, torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)]


def poisoned_call(case, device: str = "cuda", seed: int = 0) -> list:
    """A destination-passing call's arguments: fresh inputs, then outputs full of NaN."""
    inputs = make_inputs(case, device, seed)
    return inputs + poisoned_outputs(case, inputs)


@lru_cache(maxsize=None)
def load_solution(name: str) -> Solution:
    for path in (REPO_ROOT / "solutions").rglob(f"{name}.json"):
        return Solution.model_validate_json(path.read_text())
    raise KeyError(f"no solution named {name!r} under solutions/")


def build_solution_object(solution: Solution):
    """Build a Solution (an earlier version, a variant) exactly as flashinfer-bench does. Build a
    variant from model_validate, not model_copy: a copy keeps the memoized hash the builder
    caches builds by, and gets the original's build back."""
    return BuilderRegistry.get_instance().build(load_definition(solution.definition), solution)


@lru_cache(maxsize=None)
def build_solution(name: str):
    """Build the packed solution exactly as flashinfer-bench does."""
    return build_solution_object(load_solution(name))


def entry_module(name_or_runnable):
    """The entry module of a packed Python solution (a name, or one already built), as
    flashinfer-bench imports it."""
    runnable = name_or_runnable
    if isinstance(name_or_runnable, str):
        runnable = build_solution(name_or_runnable)
    return sys.modules[runnable.metadata.misc["module_name"]]


@contextmanager
def tilelang_python_entry(module):
    """Every call of the TileLang entry `module` (entry_module's) in the block takes its Python
    entry: the C++ fast path (fast_entry.py), built first if it is to be, is set aside and put
    back after. It would serve a planned shape from the plan it registered, past anything
    patched into the Python entry's kernels or plans since."""
    fast_entry = module.fast_entry
    built = fast_entry.module()
    fast_entry._module = None
    try:
        yield
    finally:
        fast_entry._module = built


@contextmanager
def page_gather(mode: str, solution: str):
    """PREFILL_BUNDLE_PAGE_GATHER=mode ("0": page size 1 gathers rows in the attention loop, "1":
    it gathers the pages first, then runs the ragged kernel: arguments.gathers_pages) while in
    the block. A Python entry decides once per shape and keeps the verdict in its plan: its page
    size 1 plans are dropped on entry and on exit. The CUDA entry reads the variable per call."""
    runnable = build_solution(solution)
    plans = None
    if runnable.metadata.misc.get("module_name") in sys.modules:
        plans = getattr(entry_module(runnable), "_paged_plans", {}).get(1)
    with mock.patch.dict(os.environ, {"PREFILL_BUNDLE_PAGE_GATHER": mode}):
        try:
            if plans is not None:
                plans.clear()
            yield runnable
        finally:
            if plans is not None:
                plans.clear()


def tilelang_kernels(name_or_runnable="tilelang_ragged"):
    """The gqa_prefill_kernel module of a packed TileLang solution (a name, or one already
    built), as flashinfer-bench imports it (compile_variant, block_config, the variant lists)."""
    entry = entry_module(name_or_runnable)
    return importlib.import_module(entry.__name__.rpartition(".")[0] + ".gqa_prefill_kernel")


def rewritten_kernel_module(folder: Path, name: str, replacements: list):
    """The TileLang solution's gqa_prefill_kernel.py and its sibling modules with their source
    text rewritten ((pattern, replacement) pairs; each pattern must occur in one of them), as
    package `name` under folder; returns its gqa_prefill_kernel (which imports the other
    gqa_prefill_*.py modules relatively; the entry, tilelang_prefill.py, is left out)."""
    source = Path(importlib.util.find_spec(tilelang_kernels().__name__).origin).parent
    texts = {f.name: f.read_text() for f in sorted(source.glob("gqa_prefill_*.py"))}
    for pattern, replacement in replacements:
        assert any(pattern in text for text in texts.values()), (
            f"the kernel no longer contains {pattern!r}"
        )
        texts = {f: text.replace(pattern, replacement) for f, text in texts.items()}
    # TileLang parses the kernel's source text: the modules must live in real files.
    package = Path(folder) / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    for f, text in texts.items():
        (package / f).write_text(text)
    spec = importlib.util.spec_from_file_location(
        name, package / "__init__.py", submodule_search_locations=[str(package)]
    )
    sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sys.modules[name])
    return importlib.import_module(f"{name}.gqa_prefill_kernel")


def compile_fresh(kernels, dtype: str, causal: bool, **config):
    """(kernel, ptxas's verbose report) of a variant of a TileLang kernel module (config:
    compile_variant's), compiled past TileLang's caches."""
    import tilelang

    report = io.StringIO()
    handler = logging.StreamHandler(report)
    logging.getLogger("tilelang").addHandler(handler)  # TILELANG_VERBOSE: ptxas's report
    tilelang.disable_cache()  # really compile, whatever an earlier run left on disk
    try:
        start = time.perf_counter()
        with mock.patch.dict(os.environ, {"TILELANG_VERBOSE": "1"}):
            kernel = kernels.compile_variant(dtype, causal, target=kernels.SM90A, **config)
        print(f"compiled {dtype} causal={causal} {config} in {time.perf_counter() - start:.1f} s")
    finally:
        tilelang.enable_cache()
        logging.getLogger("tilelang").removeHandler(handler)
    return kernel, report.getvalue()


def normwise_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """||actual - expected|| / ||expected|| in fp32: the GPU scripts' accuracy figure (nan or
    inf where actual is not finite)."""
    actual, expected = actual.float(), expected.float()
    return ((actual - expected).norm() / expected.norm()).item()


def load_script(name: str):
    """scripts/NAME.py as a module (the scripts are not a package)."""
    spec = importlib.util.spec_from_file_location(name, REPO_ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_solution_or_file(name: str):
    """The packed solution NAME, or the one in the Solution JSON file NAME (*.json)."""
    if not name.endswith(".json"):
        return build_solution(name)
    return build_solution_object(Solution.model_validate_json(Path(name).read_text()))


def run_solution(name: str, case, inputs) -> list:
    return run_runnable(build_solution(name), case, inputs)


def call_arguments(runnable, case, inputs) -> list:
    """A built solution's call arguments: the inputs, then poisoned outputs if it writes into
    them (destination-passing), so that an unwritten element shows."""
    if runnable.metadata.destination_passing_style:
        return [*inputs, *poisoned_outputs(case, inputs)]
    return list(inputs)


def run_runnable(runnable, case, inputs) -> list:
    """The outputs of a built solution on `inputs` (destination-passing ones into poisoned
    buffers)."""
    if runnable.metadata.destination_passing_style:
        outputs = poisoned_outputs(case, inputs)
        runnable(*inputs, *outputs)
        return outputs
    result = runnable(*inputs)
    return list(result) if isinstance(result, (tuple, list)) else [result]


def check_outputs(actual: list, expected: list, names=("out", "lse")) -> None:
    """The one correctness check: no NaN, allclose at 1e-2, normwise error <= 2e-3 (5e-3 bf16).

    -inf is allowed only where the reference has -inf (an lse row that sees no key)."""
    assert len(actual) == len(expected)
    for name, got, want in zip(names, actual, expected):
        assert got.shape == want.shape, f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}"
        assert got.dtype == want.dtype, f"{name}: dtype {got.dtype} != {want.dtype}"
        max_error = MAX_NORMWISE_ERROR[want.dtype]
        got, want = got.float().cpu(), want.float().cpu()
        assert not got.isnan().any(), f"{name}: {int(got.isnan().sum())} NaN (unwritten?)"
        want_inf = want.isinf()
        assert torch.equal(got.isinf(), want_inf), f"{name}: inf where the reference has none"
        assert torch.equal(got[want_inf], want[want_inf]), f"{name}: wrong sign of inf"
        got, want = got[~want_inf], want[~want_inf]
        torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL, msg=lambda m: f"{name}: {m}")
        if want.numel():
            error = (got - want).norm() / want.norm().clamp_min(1e-30)
            assert error <= max_error, f"{name}: normwise error {error:.2e} > {max_error:.0e}"


def baselines_apply(case) -> bool:
    """Whether the baselines (FlashInfer, SDPA) are expected to be right: every query row sees a
    key (else they return non-zero rows) and the softmax scale is positive (else they do not
    follow it)."""
    return every_row_sees_a_key(case) and getattr(case, "sm_scale", 1.0) > 0


def every_row_sees_a_key(case) -> bool:
    """False when some query row has no visible key (only meaningful under a causal mask)."""
    if isinstance(case, PaddedCase):
        return not case.causal or case.seq_q <= case.seq_kv
    return all(q == 0 or kv >= q for q, kv in zip(case.q_lens, case.kv_lens))


# ---- Malformed batches (the input contract: README, "Malformed batches") --------------------

INT32_MIN, INT32_MAX = -(2**31), 2**31 - 1


@dataclass(frozen=True)
class MalformedBatch:
    """A ragged batch of 3 sequences whose indptr values are not a partition of the rows."""

    name: str
    qo_indptr: tuple
    kv_indptr: tuple
    total_q: int = 100
    total_kv: int = 120
    dtype: torch.dtype = torch.bfloat16
    window_left: int | None = None  # set: a batch of the sliding-window definition

    @property
    def definition(self) -> str:
        return RAGGED if self.window_left is None else SWA

    @property
    def id(self) -> str:
        return self.name if self.window_left is None else f"{self.name}_window{self.window_left}"


_QO, _KV = (0, 30, 70, 100), (0, 40, 80, 120)
MALFORMED_BATCHES = [
    MalformedBatch("kv_end_past_total", _QO, (0, 40, 80, 200)),
    MalformedBatch("kv_end_far_past_total", _QO, (0, 40, 80, 1 << 30)),
    MalformedBatch("qo_end_past_total", (0, 30, 70, 150), _KV),
    MalformedBatch("qo_end_far_past_total", (0, 30, 70, INT32_MAX), _KV),
    MalformedBatch("qo_negative_length", (0, 50, 30, 100), _KV),
    MalformedBatch("kv_negative_length", _QO, (0, 60, 40, 120)),
    MalformedBatch("qo_negative_start", (-20, 30, 70, 100), _KV),
    MalformedBatch("kv_negative_start", _QO, (-1000, 40, 80, 120)),
    MalformedBatch("kv_int32_min", _QO, (0, 40, INT32_MIN, 120)),
    MalformedBatch("qo_non_monotonic", (0, 70, 30, 100), _KV),
    MalformedBatch("qo_not_starting_at_0", (10, 30, 70, 100), _KV),
    MalformedBatch("kv_not_starting_at_0", _QO, (5, 40, 80, 120)),
    MalformedBatch("qo_last_value_short", (0, 30, 70, 90), _KV),
    MalformedBatch("kv_last_value_short", _QO, (0, 40, 80, 100)),
    MalformedBatch("all_garbage", (7, -3, 1 << 30, 5), (99, 7, -8, INT32_MAX)),
    # The slots before a late first sequence fall back to sequence 0 with a negative tile.
    MalformedBatch("qo_start_past_a_tile", (40, 60, 80, 100), _KV),
]
# The same with a sliding window narrower than the sequences: the band's first key moves with
# the (malformed) lengths, so it must not move a kernel outside k and v either.
MALFORMED_SWA_BATCHES = [replace(b, window_left=7) for b in MALFORMED_BATCHES]


def well_formed_sequences(qo_indptr, kv_indptr, total_q: int, total_kv: int) -> list:
    """The sequences a kernel must still compute in a malformed batch: in both arrays, its range
    lies in [0, rows], runs forward, no earlier entry exceeds its start and no later entry is
    below its end (so no two of them share a row)."""

    def ordered(a, rows, s):
        start, end = a[s], a[s + 1]
        return (
            0 <= start <= end <= rows
            and all(x <= start for x in a[:s])
            and all(x >= end for x in a[s + 2 :])
        )

    return [
        s
        for s in range(len(qo_indptr) - 1)
        if ordered(qo_indptr, total_q, s) and ordered(kv_indptr, total_kv, s)
    ]


def malformed_inputs(batch: MalformedBatch, device, seed: int = 0) -> list:
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=batch.dtype)

    return [
        randn(batch.total_q, NUM_HEADS, HEAD_DIM),
        randn(batch.total_kv, NUM_KV_HEADS, HEAD_DIM),
        randn(batch.total_kv, NUM_KV_HEADS, HEAD_DIM),
        torch.tensor(batch.qo_indptr, dtype=torch.int32, device=device),
        torch.tensor(batch.kv_indptr, dtype=torch.int32, device=device),
        *(() if batch.window_left is None else (batch.window_left,)),
        1.0 / math.sqrt(HEAD_DIM),
    ]


def malformed_expected(batch: MalformedBatch, inputs) -> list:
    """Rows of well-formed sequences as the reference computes them alone; every other row NaN."""
    q, k, v, qo_indptr, kv_indptr, *window, sm_scale = inputs
    output = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    qo, kv = batch.qo_indptr, batch.kv_indptr
    for s in well_formed_sequences(qo, kv, batch.total_q, batch.total_kv):
        rows, keys = slice(qo[s], qo[s + 1]), slice(kv[s], kv[s + 1])
        seq_q, seq_kv = qo[s + 1] - qo[s], kv[s + 1] - kv[s]
        one = [q[rows], k[keys], v[keys], lengths_to_indptr([seq_q]).to(q.device),
               lengths_to_indptr([seq_kv]).to(q.device), *window, sm_scale]  # fmt: skip
        output[rows], lse[rows] = reference(batch.definition)(*one)
    return [output, lse]


def check_malformed_outputs(actual: list, expected: list) -> None:
    """NaN exactly where expected; everywhere else the one correctness check."""
    for name, got, want in zip(("output", "lse"), actual, expected):
        got_nan, want_nan = got.isnan().cpu(), want.isnan().cpu()
        if got.dim() == 3:  # a row is NaN as a whole, for every head
            got_nan, want_nan = got_nan.all(-1), want_nan.all(-1)
        assert torch.equal(got_nan, want_nan), (
            f"{name}: NaN rows {got_nan.any(-1).nonzero().flatten().tolist()[:20]}, expected "
            f"{want_nan.any(-1).nonzero().flatten().tolist()[:20]}"
        )
    keep = ~expected[1].isnan().all(-1)
    if keep.any():
        check_outputs([actual[0][keep], actual[1][keep]], [expected[0][keep], expected[1][keep]])


# ---- Token-strided inputs: q, k, v sliced out of one fused QKV projection -------------------


def strided_caches(k_cache, v_cache, k_slots=2, v_slots=3):
    """k_cache and v_cache as views [:, 0] and [:, 1] of NaN buffers [num_pages, slots, ...]:
    page strides of k_slots and v_slots pages (2 and 2: FlashInfer's combined K/V cache)."""
    views = []
    for cache, slots, index in ((k_cache, k_slots, 0), (v_cache, v_slots, 1)):
        shape = (cache.shape[0], slots) + tuple(cache.shape[1:])
        buffer = torch.full(shape, float("nan"), dtype=cache.dtype, device=cache.device)
        buffer[:, index] = cache
        views.append(buffer[:, index])
    return views


def fused_qkv_inputs(inputs: list) -> list:
    """The same values, with q, k and v as views into one [tokens, (32 + 2 * 8) * 128] tensor
    (equal lengths) or into per-tensor buffers padded to that token stride."""
    q, k, v = inputs[:3]
    width = (NUM_HEADS + 2 * NUM_KV_HEADS) * HEAD_DIM
    lead = q.shape[:-2]

    def strided(x, offset):
        buffer = torch.full((*x.shape[:-2], width), float("nan"), dtype=x.dtype, device=x.device)
        view = buffer[..., offset : offset + x.shape[-2] * HEAD_DIM].unflatten(-1, x.shape[-2:])
        view.copy_(x)
        return view

    if k.shape[:-2] == lead:
        qkv = torch.cat([q.flatten(-2), k.flatten(-2), v.flatten(-2)], dim=-1)
        q_heads, kv_heads = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM
        views = [
            qkv[..., :q_heads].unflatten(-1, (NUM_HEADS, HEAD_DIM)),
            qkv[..., q_heads : q_heads + kv_heads].unflatten(-1, (NUM_KV_HEADS, HEAD_DIM)),
            qkv[..., q_heads + kv_heads :].unflatten(-1, (NUM_KV_HEADS, HEAD_DIM)),
        ]
    else:
        offset = NUM_HEADS * HEAD_DIM
        views = [strided(q, 0), strided(k, offset), strided(v, offset + NUM_KV_HEADS * HEAD_DIM)]
    assert all(not x.is_contiguous() or x.shape[-3] <= 1 for x in views)
    return views + list(inputs[3:])
