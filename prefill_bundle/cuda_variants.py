"""Variants of the CUDA solution: knob values (solutions/gqa_ragged/cuda/hopper_knobs.cuh) that
instantiate its kernel templates. A variant is the packed solution with lines before
prefill_entry.cu: GQA_PREFILL_KNOBS naming its BuildKnobs<...> type (the one hook), and its own
namespace (modules loaded into one process may share kernel symbols, and a variant must never
launch another build's kernel). Every build is checked against the knobs it reports
(built_knobs), so a hook the sources ignore cannot build the shipped kernels unnoticed. Used by
scripts/tune_cuda.py and tests/test_cuda_knobs.py."""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, astuple, dataclass
from pathlib import Path


@dataclass(frozen=True)
class HopperKnobs:
    """One kernel family's knobs, in HopperKnobs<...>'s template parameter order."""

    block_n: int  # keys per K/V tile
    kv_stages: int  # K/V ring depth
    producer_registers: int  # setmaxnreg (the paged gather and FP8 loaders set their own)
    consumer_registers: int
    fold_scale: bool  # scale folded into the exponentials, else the logits scaled first
    own_output_buffer: bool  # output staged in a buffer of its own, else in Q's
    persistent: bool  # one CTA per SM drawing items, else one CTA per item
    pingpong: bool  # the consumer warpgroups take turns issuing their GEMMs (FA3's)

    def cpp(self) -> str:
        values = (str(v).lower() if isinstance(v, bool) else str(v) for v in astuple(self))
        return f"HopperKnobs<{', '.join(values)}>"


# hopper_knobs.cuh's shipped_knobs(), checked against the shipped build's built_knobs.
SHIPPED_CAUSAL = HopperKnobs(128, 2, 32, 232, True, True, True, False)
SHIPPED_FULL = HopperKnobs(192, 2, 24, 240, True, False, True, True)
SHIPPED_PAGED = SHIPPED_CAUSAL


@dataclass(frozen=True)
class BuildKnobs:
    """Every knob of a build: the kernel families causal (ragged, padded, sliding window), full
    (padded non-causal) and paged (page sizes 64 and 1, FP8), and the FP8 bf16 conversion."""

    causal: HopperKnobs = SHIPPED_CAUSAL
    full: HopperKnobs = SHIPPED_FULL
    paged: HopperKnobs = SHIPPED_PAGED
    fp8_bf16_bits: bool = True  # integer ops and a bf16x2 multiply, else the hardware cvt
    fp8_split_q: bool = True  # FP8 Q K^T on the cache's K, bf16 q in two e4m3 terms
    fp8_f16_pv: bool = True  # FP8 P V in float16 (V by the hardware cvt), else in q's dtype
    idle_warpgroup_waits: bool = True  # a warpgroup without the item's tokens computes nothing
    share_waves: int = 8  # decode-like paged batches: key shares for this many items an SM

    def cpp(self) -> str:
        families = ", ".join(k.cpp() for k in (self.causal, self.full, self.paged))
        flags = ", ".join(
            str(f).lower()
            for f in (self.fp8_bf16_bits, self.fp8_split_q, self.fp8_f16_pv,
                      self.idle_warpgroup_waits)  # fmt: skip
        )
        return f"BuildKnobs<{families}, {flags}, {self.share_waves}>"

    def as_built(self) -> dict:
        """What built_knobs() returns for a build of these knobs."""
        return asdict(self)


SHIPPED = BuildKnobs()
ENTRY = "prefill_entry.cu"


def variant_header(variant: str, knobs: BuildKnobs) -> str:
    if not re.fullmatch(r"[A-Za-z0-9_]+", variant):
        raise ValueError(f"{variant!r}: a variant's name becomes a C++ identifier")
    # The arch list as a comment: flashinfer-bench's cache is keyed by the sources, not the arch.
    arch = os.environ.get("TVM_FFI_CUDA_ARCH_LIST", "")
    header = (
        f"// variant {variant}, TVM_FFI_CUDA_ARCH_LIST={arch}\n"
        f"#define gqa_prefill gqa_prefill_{variant}\n"
    )
    if variant != "default":  # else the sources' own knobs (shipped_knobs), checked: SHIPPED
        header += f"#define GQA_PREFILL_KNOBS {knobs.cpp()}\n"
    return header


def set_cuda_home() -> None:
    """tvm-ffi takes CUDA_HOME from nvcc's grandparent folder; a wrapper script on PATH
    (/usr/local/bin/nvcc) leaves it without lib64 for -lcudart (tests/conftest.py, tune_cuda.py)."""
    nvcc = shutil.which("nvcc")
    if nvcc and "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ:
        if not (Path(nvcc).resolve().parent.parent / "lib64").exists():
            if Path("/usr/local/cuda/lib64").exists():
                os.environ["CUDA_HOME"] = "/usr/local/cuda"


def built_knobs(runnable) -> dict:
    """The knobs a built solution reports (its built_knobs export, JSON)."""
    import tvm_ffi

    module = tvm_ffi.load_module(runnable.metadata.misc["binary"])
    return json.loads(str(module.built_knobs()))


def check_knobs(runnable, knobs: BuildKnobs, variant: str) -> None:
    built = built_knobs(runnable)
    if built != knobs.as_built():
        raise RuntimeError(
            f"variant {variant}: built with knobs {built}, asked for {knobs.as_built()}"
        )


def variant_solution(solution_name: str, variant: str, knobs: BuildKnobs):
    """The packed solution with these knobs ("default": with the sources' own, which must be
    SHIPPED) under its own name and namespace, e.g. for `compare_gpu.py --old` as JSON."""
    from .testing import load_solution

    header = variant_header(variant, knobs)
    solution = load_solution(solution_name)
    fields = solution.model_dump()
    for source in fields["sources"]:
        if source["path"] == ENTRY:
            source["content"] = header + source["content"]
    # Validated anew: model_copy would keep the original's memoized hash, under which
    # flashinfer-bench's registry hands back the build it already has (the shipped one).
    return type(solution).model_validate({**fields, "name": f"{solution_name}_{variant}"})


def build_variant(solution_name: str, variant: str, knobs: BuildKnobs):
    """variant_solution's, built by flashinfer-bench, its knobs checked."""
    from .testing import build_solution_object

    runnable = build_solution_object(variant_solution(solution_name, variant, knobs))
    check_knobs(runnable, knobs, variant)
    return runnable
