"""Solution packing: kernel sources are real files under solutions/<op_type>/<backend>/; the
Solution JSON beside them (sources embedded) is generated from them by scripts/generate.py.
Python-language solutions of the bundle also embed the shared argument contract
(prefill_bundle/arguments.py, as `arguments.py` beside their entry file), so each stays
self-contained while the rules have one source.

A new backend adds its entries to SOLUTIONS; nothing else needs to change.
The paged definitions' solutions (solutions/gqa_paged/<backend>/*.json) embed the same files as
the ragged ones: one kernel per backend, K/V loading its policy.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flashinfer_bench import Solution

from . import MINI, OP_TYPE, PAGED_FP8, PAGED_PS1, PAGED_PS64, RAGGED, REPO_ROOT, SWA
from .definitions import SPECS as DEFINITION_SPECS
from .generated import GeneratedFile

BASELINE_AUTHOR = "baseline"
BUNDLE_AUTHOR = "gqa-prefill-bundle"
# The CUDA solutions' files (flat, beside each other; attention_kernel.cuh includes the rest).
TRITON_SOURCES = (
    "triton_prefill.py",
    "attention_kernel.py",
    "kv_loops.py",
    "ragged_batch.py",
    "paged_kv.py",
    "split_kv.py",
    "gluon_attention.py",
    "launcher.py",
)
TILELANG_SOURCES = (
    "tilelang_prefill.py",
    "gqa_prefill_kernel.py",
    "gqa_prefill_shapes.py",
    "gqa_prefill_kv.py",
    "gqa_prefill_fp8.py",
    "gqa_prefill_items.py",
    "gqa_prefill_ragged.py",
    "gqa_prefill_steps.py",
    "gqa_prefill_ws.py",
    "gqa_prefill_pipelined.py",
    "gqa_prefill_split.py",
    "gqa_prefill_decode.py",
    "fast_entry.py",
    "fast_entry.cc",
)
CUDA_SOURCES = (
    "prefill_entry.cu",
    "entry_describe.cuh",
    "entry_checks.cuh",
    "entry_launch.cuh",
    "attention_kernel.cuh",
    "kernel_config.cuh",
    "ptx_sm80.cuh",
    "tile_schedule.cuh",
    "mask_softmax.cuh",
    "epilogue.cuh",
    "kernel_portable.cuh",
    "ptx_sm90.cuh",
    "hopper_knobs.cuh",
    "hopper_layout.cuh",
    "kv_contiguous.cuh",
    "kv_paged.cuh",
    "kv_paged_fp8.cuh",
    "kernel_hopper.cuh",
    "split_merge.cuh",
    "decode_fp8.cuh",
)


@dataclass(frozen=True)
class SolutionSpec:
    name: str
    definition: str
    backend: str  # folder under solutions/<op_type>/
    language: str
    entry_point: str  # "<file>::<function>", file relative to the backend folder
    sources: tuple  # files relative to the backend folder, all embedded in the JSON
    description: str
    author: str = BUNDLE_AUTHOR
    destination_passing_style: bool = True
    binding: str | None = None
    dependencies: tuple = ()
    shared_sources: tuple = ()  # files of prefill_bundle/ embedded under the same name

    @property
    def folder(self):
        """Where the sources are: one folder per backend serves every definition (the paged
        solutions are the ragged kernels with a paged K/V loader)."""
        return REPO_ROOT / "solutions" / OP_TYPE / self.backend

    @property
    def json_path(self) -> str:
        op_type = DEFINITION_SPECS[self.definition]["op_type"]
        return f"solutions/{op_type}/{self.backend}/{self.name}.json"


_FLASHINFER = dict(
    backend="flashinfer",
    language="python",
    sources=("flashinfer_prefill.py",),
    author=BASELINE_AUTHOR,
    dependencies=("flashinfer-python",),
)
_SDPA = dict(
    backend="sdpa",
    language="python",
    sources=("sdpa_prefill.py",),
    author=BASELINE_AUTHOR,
    destination_passing_style=False,
)

SOLUTIONS = [
    SolutionSpec(
        name="flashinfer_mini",
        definition=MINI,
        entry_point="flashinfer_prefill.py::run_padded",
        description="Baseline: FlashInfer BatchPrefillWithRaggedKVCacheWrapper (fa3 on Hopper), "
        "the padded batch viewed as a ragged one, plan cached per shape.",
        **_FLASHINFER,
    ),
    SolutionSpec(
        name="flashinfer_ragged",
        definition=RAGGED,
        entry_point="flashinfer_prefill.py::run_ragged",
        description="Baseline: FlashInfer BatchPrefillWithRaggedKVCacheWrapper (fa3 on Hopper), "
        "plan cached per (total_q, total_kv, batch).",
        **_FLASHINFER,
    ),
    SolutionSpec(
        name="sdpa_mini",
        definition=MINI,
        entry_point="sdpa_prefill.py::run_padded",
        description="Baseline: torch scaled_dot_product_attention with GQA, backends in the "
        "order cuDNN, Flash, efficient, math; explicit bottom-right mask when seq_q != seq_kv.",
        **_SDPA,
    ),
    SolutionSpec(
        name="sdpa_ragged",
        definition=RAGGED,
        entry_point="sdpa_prefill.py::run_ragged",
        description="Baseline: the varlen FlashAttention kernel behind torch SDPA "
        "(aten._flash_attention_forward), which also returns the log-sum-exp.",
        **_SDPA,
    ),
    SolutionSpec(
        name="triton_mini",
        definition=MINI,
        backend="triton",
        language="triton",
        entry_point="triton_prefill.py::run_padded",
        sources=TRITON_SOURCES,
        shared_sources=("arguments.py",),
        description="Triton. On sm_90, from 1024 queries and keys a sequence: a Gluon kernel with "
        "FlashAttention-3's structure (TMA producer warp, two consumer warpgroups on asynchronous "
        "wgmma, softmax overlapping P V, persistent). Elsewhere FlashAttention-2 forward, the 4 "
        "query heads of a KV group packed into one tile, causal tiles skipped or masked only on "
        "the diagonal.",
    ),
    SolutionSpec(
        name="triton_ragged",
        definition=RAGGED,
        backend="triton",
        language="triton",
        entry_point="triton_prefill.py::run_ragged",
        sources=TRITON_SOURCES,
        shared_sources=("arguments.py",),
        description="Triton over a ragged batch. On sm_90, from 1024 queries a sequence on "
        "average: the Gluon kernel of triton_mini over flat Q/K/V (sequences found by a binary "
        "search over qo_indptr in the kernel; malformed batches left to the FA-2 kernel). "
        "Elsewhere FlashAttention-2 forward, grid sized from total_q and the batch, sequences "
        "found the same way.",
    ),
    SolutionSpec(
        name="tilelang_mini",
        definition=MINI,
        backend="tilelang",
        language="tilelang",
        entry_point="tilelang_prefill.py::run_padded",
        sources=TILELANG_SOURCES,
        shared_sources=("arguments.py",),
        dependencies=("tilelang",),
        description="TileLang flash attention for Hopper (TMA, wgmma, warp-specialized "
        "pipeline); the padded batch runs as a ragged one, lengths symbolic.",
    ),
    SolutionSpec(
        name="tilelang_ragged",
        definition=RAGGED,
        backend="tilelang",
        language="tilelang",
        entry_point="tilelang_prefill.py::run_ragged",
        sources=TILELANG_SOURCES,
        shared_sources=("arguments.py",),
        dependencies=("tilelang",),
        description="TileLang flash attention for Hopper (TMA, wgmma, warp-specialized "
        "pipeline) over a ragged batch; all query tiles on one grid axis, lengths symbolic.",
    ),
    SolutionSpec(
        name="cuda_mini",
        definition=MINI,
        backend="cuda",
        language="cuda",
        binding="tvm-ffi",
        entry_point="prefill_entry.cu::run_padded",
        sources=CUDA_SOURCES,
        description="CUDA C++ flash attention forward, 32 tokens x the 4 query heads of a KV group "
        "per 128-row tile. Built for sm_90a (TVM_FFI_CUDA_ARCH_LIST=9.0a): warp-specialized, a TMA "
        "producer warp feeding a 2-stage mbarrier ring, two wgmma consumer warpgroups (softmax "
        "beside P V), persistent with a dynamic tile scheduler, 192-key tiles non-causal past 4096 "
        "keys a sequence (with FA3's turns between the consumer warpgroups); "
        "otherwise mma.sync/ldmatrix. Causal tiles skipped or masked.",
    ),
    SolutionSpec(
        name="cuda_ragged",
        definition=RAGGED,
        backend="cuda",
        language="cuda",
        binding="tvm-ffi",
        entry_point="prefill_entry.cu::run_ragged",
        sources=CUDA_SOURCES,
        description="CUDA C++ flash attention forward over a ragged batch (warp-specialized "
        "TMA + wgmma on sm_90a, mma.sync otherwise): work items sized from total_q and the batch "
        "(no host sync), sequences found by a binary search over qo_indptr in the kernel, a "
        "persistent grid drawing items from a per-stream counter; writes the base-2 "
        "log-sum-exp.",
    ),
]


def _paged(backend: str, language: str, entry_file: str, sources: tuple, description: str, **kw):
    """The two paged solutions of a backend (page sizes 1 and 64), one entry point each."""
    return [
        SolutionSpec(
            name=f"{backend}_paged_ps{page_size}",
            definition=definition,
            backend=backend,
            language=language,
            entry_point=f"{entry_file}::run_paged_ps{page_size}",
            sources=sources,
            description=description.format(page_size=page_size),
            **kw,
        )
        for page_size, definition in ((1, PAGED_PS1), (64, PAGED_PS64))
    ]


SOLUTIONS += [
    *_paged(
        "flashinfer",
        "python",
        "flashinfer_prefill.py",
        ("flashinfer_prefill.py",),
        "Baseline: FlashInfer BatchPrefillWithPagedKVCacheWrapper (fa3 on Hopper), page size "
        "{page_size}, causal, plan cached per shape as for ragged.",
        author=BASELINE_AUTHOR,
        dependencies=("flashinfer-python",),
    ),
    *_paged(
        "sdpa",
        "python",
        "sdpa_prefill.py",
        ("sdpa_prefill.py",),
        "Baseline: each sequence's K/V gathered from the pages (page size {page_size}) into a "
        "ragged batch, then the varlen FlashAttention kernel behind torch SDPA.",
        author=BASELINE_AUTHOR,
        destination_passing_style=False,
    ),
    *_paged(
        "triton",
        "triton",
        "triton_prefill.py",
        TRITON_SOURCES,
        "Triton flash attention forward over a paged KV cache (page size {page_size}): the "
        "ragged kernel with page-table lookups in its K/V loads.",
        shared_sources=("arguments.py",),
    ),
    *_paged(
        "tilelang",
        "tilelang",
        "tilelang_prefill.py",
        TILELANG_SOURCES,
        "TileLang flash attention for Hopper over a paged KV cache (page size {page_size}): the "
        "ragged warp-specialized program with a paged K/V load step.",
        shared_sources=("arguments.py",),
        dependencies=("tilelang",),
    ),
    *_paged(
        "cuda",
        "cuda",
        "prefill_entry.cu",
        CUDA_SOURCES,
        "CUDA C++ flash attention forward over a paged KV cache (page size {page_size}): the "
        "ragged kernels with a paged K/V loader (sm_90a: TMA per page of 64, a cp.async gather "
        "for page size 1).",
        binding="tvm-ffi",
    ),
]


def _swa(backend: str, language: str, entry_file: str, sources: tuple, description: str, **kw):
    """A backend's sliding-window solution: its ragged kernel with the band mask."""
    return SolutionSpec(
        name=f"{backend}_swa",
        definition=SWA,
        backend=backend,
        language=language,
        entry_point=f"{entry_file}::run_ragged_swa",
        sources=sources,
        description=description,
        **kw,
    )


SOLUTIONS += [
    _swa(
        "flashinfer",
        "python",
        "flashinfer_prefill.py",
        ("flashinfer_prefill.py",),
        "Baseline: FlashInfer BatchPrefillWithRaggedKVCacheWrapper (fa3 on Hopper) planned with "
        "window_left, plan cached per shape and window.",
        author=BASELINE_AUTHOR,
        dependencies=("flashinfer-python",),
    ),
    _swa(
        "sdpa",
        "python",
        "sdpa_prefill.py",
        ("sdpa_prefill.py",),
        "Baseline: the varlen FlashAttention kernel behind torch SDPA with its own sliding window "
        "(window_size_left = window_left, window_size_right = 0).",
        author=BASELINE_AUTHOR,
        destination_passing_style=False,
    ),
]


SOLUTIONS += [
    _swa(
        "triton",
        "triton",
        "triton_prefill.py",
        TRITON_SOURCES,
        "Triton flash attention forward over a ragged batch with a sliding window: only the key "
        "tiles that meet the band are visited, masks only on its two edges.",
        shared_sources=("arguments.py",),
    ),
    _swa(
        "tilelang",
        "tilelang",
        "tilelang_prefill.py",
        TILELANG_SOURCES,
        "TileLang flash attention for Hopper with a sliding window: the ragged warp-specialized "
        "program visiting only the key tiles that meet the band, work weighed by band size.",
        shared_sources=("arguments.py",),
        dependencies=("tilelang",),
    ),
    _swa(
        "cuda",
        "cuda",
        "prefill_entry.cu",
        CUDA_SOURCES,
        "CUDA C++ flash attention forward with a sliding window: the ragged kernels visiting only "
        "the key tiles that meet the band (masks on its two edges), the persistent schedule "
        "weighing work by band size.",
        binding="tvm-ffi",
    ),
]

# FP8 (e4m3) paged caches (page size 64): the paged kernels with an FP8 K/V loader.
SOLUTIONS += [
    SolutionSpec(
        name="flashinfer_fp8kv",
        definition=PAGED_FP8,
        backend="flashinfer",
        language="python",
        entry_point="flashinfer_prefill.py::run_paged_ps64_fp8kv",
        sources=("flashinfer_prefill.py",),
        description="Baseline: FlashInfer BatchPrefillWithPagedKVCacheWrapper with kv_data_type "
        "float8_e4m3fn, page size 64, causal, backend chosen by FlashInfer (fa3 has no bf16-query "
        "FP8-KV kernel); k_scale folded into the softmax scale, v_scale applied after the kernel.",
        author=BASELINE_AUTHOR,
        dependencies=("flashinfer-python",),
    ),
    SolutionSpec(
        name="sdpa_fp8kv",
        definition=PAGED_FP8,
        backend="sdpa",
        language="python",
        entry_point="sdpa_prefill.py::run_paged_ps64_fp8kv",
        sources=("sdpa_prefill.py",),
        description="Baseline: the FP8 pages gathered and dequantized to bfloat16, then the varlen "
        "FlashAttention kernel behind torch SDPA.",
        author=BASELINE_AUTHOR,
        destination_passing_style=False,
    ),
]


SOLUTIONS += [
    SolutionSpec(
        name="triton_fp8kv",
        definition=PAGED_FP8,
        backend="triton",
        language="triton",
        entry_point="triton_prefill.py::run_paged_ps64_fp8kv",
        sources=TRITON_SOURCES,
        shared_sources=("arguments.py",),
        description="Triton flash attention forward over an FP8 (e4m3) paged cache: K/V tiles "
        "loaded as FP8 and converted to the query's dtype on chip for the tensor-core products; "
        "k_scale folded into the softmax scale, v_scale into the epilogue.",
    ),
    SolutionSpec(
        name="tilelang_fp8kv",
        definition=PAGED_FP8,
        backend="tilelang",
        language="tilelang",
        entry_point="tilelang_prefill.py::run_paged_ps64_fp8kv",
        sources=TILELANG_SOURCES,
        shared_sources=("arguments.py",),
        dependencies=("tilelang",),
        description="TileLang flash attention for Hopper over an FP8 (e4m3) paged cache: the "
        "paged warp-specialized kernel with an FP8 K/V policy; pages loaded as FP8 by TMA (one box "
        "per page) and converted exactly to the query's dtype in shared memory by the producer "
        "warps for wgmma; k_scale folded into the softmax scale, v_scale into the epilogue.",
    ),
    SolutionSpec(
        name="cuda_fp8kv",
        definition=PAGED_FP8,
        backend="cuda",
        language="cuda",
        binding="tvm-ffi",
        entry_point="prefill_entry.cu::run_paged_ps64_fp8kv",
        sources=CUDA_SOURCES,
        description="CUDA C++ flash attention forward over an FP8 (e4m3) paged cache: the paged "
        "causal kernels with an FP8 K/V loader. On sm_90a pages are staged by TMA as FP8 and the "
        "producer warpgroup converts them to the query's dtype into the swizzled shared-memory "
        "layout wgmma reads; otherwise mma.sync with FP8 rows converted in registers. k_scale "
        "folded into the softmax scale, v_scale into the output.",
    ),
]


def build_solution(spec: SolutionSpec) -> Solution:
    sources = [{"path": path, "content": (spec.folder / path).read_text()} for path in spec.sources]
    shared = Path(__file__).parent
    sources += [{"path": p, "content": (shared / p).read_text()} for p in spec.shared_sources]
    build = {
        "language": spec.language,
        "target_hardware": ["cuda"],
        "entry_point": spec.entry_point,
        "dependencies": list(spec.dependencies),
        "destination_passing_style": spec.destination_passing_style,
    }
    if spec.binding:
        build["binding"] = spec.binding
    return Solution.model_validate(
        {
            "name": spec.name,
            "definition": spec.definition,
            "author": spec.author,
            "description": spec.description,
            "spec": build,
            "sources": sources,
        }
    )


def solution_files() -> list[GeneratedFile]:
    return [GeneratedFile(spec.json_path, build_solution(spec)) for spec in SOLUTIONS]
