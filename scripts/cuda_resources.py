"""Write solutions/gqa_ragged/cuda/ptxas_resources.md (registers, spills, shared memory of every
CUDA kernel for sm_90a), which report.md includes.   python scripts/cuda_resources.py

tests/test_cuda_build.py checks the file against resources_markdown() of a fresh compile.
"""

import re
import shutil
import sys
import tempfile
from pathlib import Path

from prefill_bundle import cuda_build

_ENTRY = r"ptxas info\s+: Compiling entry function "
_PAGED = re.compile(r"(gqa_prefill_paged(?:_wgmma)?_kernel)I\d+(\w+?)Li(\d+)E")
# The sliding-window kernels (gqa_prefill_swa*_kernel<dtype>) are the ragged causal ones.
_SWA = re.compile(r"(gqa_prefill_swa(?:_wgmma)?_kernel)I\d+(\w+?)EEv")
# The padded non-causal kernel of short sequences (gqa_prefill_full128_wgmma_kernel<dtype>): the
# causal family's tiles under the full mask.
_FULL128 = re.compile(r"(gqa_prefill_full128_wgmma_kernel)I\d+(\w+?)EEv")
# The FP8 paged kernels (gqa_prefill_paged_fp8*_kernel<dtype>): page size 64, FP8 staging.
_FP8 = re.compile(r"(gqa_prefill_paged_fp8(?:_wgmma)?_kernel)I\d+(\w+?)EEv")
_FP8_NOTES = {
    "gqa_prefill_paged_fp8_kernel": ("", cuda_build.PORTABLE_SMEM),
    "gqa_prefill_paged_fp8_wgmma_kernel": (
        " (producer 40, consumers 232)",
        "225 KiB (Q, 2 K + 2 V stages of 128 keys, FP8 staging of 2 K + 2 V tiles,"
        " one pair in the output buffer)",
    ),
}
# The paged kernels are the causal kernels' layouts; their Hopper producers' registers differ.
# Split-KV's merge of key shares (merge_shares_kernel<dtype>, split_merge.cuh).
_MERGE = re.compile(r"(merge_shares_kernel)I\d+(\w+?)EEv")
_GATHER = re.compile(r"(gather_pages_kernel)I\d+(\w+?)EEv")  # page size 1's page gather
# Decode-like FP8 batches' kernel (gqa_decode_fp8_kernel<dtype, tokens a group>, decode_fp8.cuh).
_DECODE = re.compile(r"(gqa_decode_fp8_kernel)I\d+(\w+?)Li(\d)EEEv")
_DECODE_SMEM = "72 KiB (2 K + 2 V stages of 32 FP8 keys a warp, 4 warps)"
_PAGED_NOTES = {
    ("gqa_prefill_paged_kernel", "64"): ("", cuda_build.PORTABLE_SMEM),
    ("gqa_prefill_paged_kernel", "1"): ("", cuda_build.PORTABLE_SMEM),
    ("gqa_prefill_paged_wgmma_kernel", "64"): (
        " (producer 40, consumers 232)",
        cuda_build.DYNAMIC_SMEM[("gqa_prefill_wgmma_kernel", "causal")],
    ),
    ("gqa_prefill_paged_wgmma_kernel", "1"): (
        " (producer 40, consumers 232)",
        cuda_build.DYNAMIC_SMEM[("gqa_prefill_wgmma_kernel", "causal")],
    ),
}


def resources_markdown(output: str) -> str:
    """cuda_build.resources_markdown's table of the padded and ragged kernels (whose names it
    reads), then a row for each paged kernel (gqa_prefill_paged*_kernel<dtype, page size>),
    each sliding-window kernel (gqa_prefill_swa*_kernel<dtype, causal window>) and each padded
    non-causal kernel on 128-key tiles (gqa_prefill_full128_wgmma_kernel<dtype, full, padded>)."""
    head, *blocks = re.split(f"({_ENTRY})", output)
    kept, paged = [head], {}
    for marker, block in zip(blocks[::2], blocks[1::2]):
        name = block.split("'")[1]
        match = _PAGED.search(name)
        causal_tiles = _SWA.search(name) or _FULL128.search(name)
        fp8 = _FP8.search(name)
        merge = _MERGE.search(name) or _GATHER.search(name)
        decode = _DECODE.search(name)
        if decode is not None:
            kernel, dtype, tokens = decode.groups()
            dtype = {"__half": "half", "__nv_bfloat16": "bfloat16"}.get(dtype, dtype)
            paged[f"{kernel}<{dtype}, {tokens} token{'s' if tokens != '1' else ''} a group>"] = (
                cuda_build.ptxas_report(marker + block).popitem()[1], ("", _DECODE_SMEM)
            )
            continue
        if merge is not None:
            kernel, dtype = merge.groups()
            dtype = {"__half": "half", "__nv_bfloat16": "bfloat16"}.get(dtype, dtype)
            paged[f"{kernel}<{dtype}>"] = (
                cuda_build.ptxas_report(marker + block).popitem()[1], ("", "none")
            )
            continue
        if fp8 is not None:
            kernel, dtype = fp8.groups()
            dtype = {"__half": "half", "__nv_bfloat16": "bfloat16"}.get(dtype, dtype)
            paged[f"{kernel}<{dtype}, FP8 page size 64>"] = (
                cuda_build.ptxas_report(marker + block).popitem()[1], _FP8_NOTES[kernel]
            )
            continue
        if causal_tiles is not None:
            kernel, dtype = causal_tiles.groups()
            dtype = {"__half": "half", "__nv_bfloat16": "bfloat16"}.get(dtype, dtype)
            causal_kernel = kernel.replace("_swa", "").replace("_full128", "")
            causal = (cuda_build.DYNAMIC_SMEM[(causal_kernel, "causal")],
                      cuda_build.SETMAXNREG.get((causal_kernel, "causal"), ""))
            mask = "full, padded" if "_full128" in kernel else "causal window"
            paged[f"{kernel}<{dtype}, {mask}>"] = (
                cuda_build.ptxas_report(marker + block).popitem()[1], (causal[1], causal[0])
            )
            continue
        if match is None:
            kept += [marker, block]
            continue
        kernel, dtype, page_size = match.groups()
        dtype = {"__half": "half", "__nv_bfloat16": "bfloat16"}.get(dtype, dtype)
        paged[f"{kernel}<{dtype}, page size {page_size}>"] = (
            cuda_build.ptxas_report(marker + block).popitem()[1],
            _PAGED_NOTES[(kernel, page_size)],
        )
    lines = [cuda_build.resources_markdown("".join(kept)).rstrip("\n")]
    for name, ((registers, stores, loads, stack), (split, smem)) in sorted(paged.items()):
        lines.append(f"| `{name}` | {registers}{split} | {stores} / {loads} | {stack} | {smem} |")
    return "\n".join(lines) + "\n"


def main():
    with tempfile.TemporaryDirectory() as tmp:
        returncode, output = cuda_build.compile_entry(
            shutil.which("nvcc"), "90a", Path(tmp) / "e.o", True
        )
    if returncode:
        sys.exit(output)
    cuda_build.RESOURCES_MD.write_text(resources_markdown(output))
    print(f"wrote {cuda_build.RESOURCES_MD}; now run python scripts/report.py")


if __name__ == "__main__":
    main()
