"""On the GPU: kernel time of variants of the CUDA solution against FlashInfer fa3 on the big
padded shapes and two ragged batches, interleaved (A B A B; the card heats up within a call),
each checked against FlashInfer's output first. A variant is the packed solution with knob
macros defined at the top of prefill_entry.cu, built under its own name and namespace. Prints a
table.

    TVM_FFI_CUDA_ARCH_LIST=9.0a python scripts/tune_cuda.py [variant ...]
"""

import sys

import torch
import triton.testing
from flashinfer_bench.compile import BuilderRegistry

from prefill_bundle.gpu_timing import clocks
from prefill_bundle.testing import (
    PaddedCase,
    RaggedCase,
    build_solution,
    load_definition,
    load_solution,
    make_inputs,
    poisoned_outputs,
)

ENTRY = "prefill_entry.cu"
# name: {knob macro: value}, defined at the top of prefill_entry.cu (before the includes);
# "default" is the sources as they are. Measurements of earlier variants:
# solutions/gqa_ragged/cuda/TUNING.md.
VARIANTS = {
    "default": {},
    "unfolded_scale": {"GQA_PREFILL_FOLD_SCALE": "0"},  # scale the logits first, then exp2(s - max)
}
CASES = [
    PaddedCase(8, 2048, 2048, True),
    PaddedCase(1, 8192, 8192, True),
    PaddedCase(1, 16384, 16384, False),
    PaddedCase(4, 512, 512, True),
    RaggedCase((2048, 512, 1024, 4096), (2048, 512, 1024, 4096)),
    RaggedCase((64,) * 16, (1024,) * 16),
]


def build_variant(solution_name: str, variant: str):
    if variant == "default":
        return build_solution(solution_name)
    # Every variant's kernels in a namespace of their own: modules loaded into one process may
    # share symbols, and a variant must never launch another build's kernel.
    defines = {"gqa_prefill": f"gqa_prefill_{variant}", **VARIANTS[variant]}
    header = "".join(f"#define {name} {value}\n" for name, value in defines.items())
    solution = load_solution(solution_name)
    sources = []
    for source in solution.sources:
        content = header + source.content if source.path == ENTRY else source.content
        sources.append(source.model_copy(update={"content": content}))
    copy = solution.model_copy(update={"name": f"{solution_name}_{variant}", "sources": sources})
    return BuilderRegistry.get_instance().build(load_definition(solution.definition), copy)


def main():
    variants = sys.argv[1:] or list(VARIANTS)
    print("gpu at start:", clocks())
    rows = []
    for case in CASES:
        suffix = "mini" if isinstance(case, PaddedCase) else "ragged"
        solutions = {"flashinfer": build_solution(f"flashinfer_{suffix}")}
        for variant in variants:
            solutions[variant] = build_variant(f"cuda_{suffix}", variant)
        inputs = make_inputs(case, "cuda", seed=0)
        outputs = {name: poisoned_outputs(case, inputs) for name in solutions}
        for name, fn in solutions.items():
            fn(*inputs, *outputs[name])
        torch.cuda.synchronize()
        expected = outputs["flashinfer"][0].float()
        errors = {}
        for name in variants:
            actual = outputs[name][0].float()
            err = ((actual - expected).norm() / expected.norm()).item()
            errors[name] = err if bool(torch.isfinite(actual).all()) else float("nan")
        best = {name: float("inf") for name in solutions}
        for _ in range(2):
            for name, fn in solutions.items():
                ms = triton.testing.do_bench(
                    lambda: fn(*inputs, *outputs[name]), warmup=25, rep=150
                )
                best[name] = min(best[name], ms)
        for name in variants:
            rows.append((case.id[:52], name, best["flashinfer"], best[name], errors[name]))
    print("gpu at end:", clocks())
    header = f"{'shape':52s} {'variant':16s} {'FI ms':>8s} {'ms':>8s} {'FI/x':>6s}"
    print(f"\n{header} {'err vs FI':>9s}")
    for shape, name, fi, ms, err in rows:
        flag = "" if err < 5e-3 else " WRONG"
        print(f"{shape:52s} {name:16s} {fi:8.4f} {ms:8.4f} {fi / ms:6.2f} {err:9.1e}{flag}")


if __name__ == "__main__":
    main()
