"""Compile the Triton solutions' Gluon kernel (solutions/gqa_ragged/triton/gluon_attention.py)
for sm_90a without a GPU and print its SASS (tests/test_triton_gluon.py reads it; also how to
look at what ptxas made of a change).

    python scripts/gluon_sass.py fp16|bf16 [ragged|window|paged] > kernel.sass

Run with TRITON_INTERPRET unset: in the interpreter, triton's own jit functions (gl.max,
gl.cdiv, ...) are interpreted ones that a compiled Gluon kernel cannot call.
"""

import importlib.util
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
from triton.backends.compiler import GPUTarget
from triton.experimental.gluon import language as gl
from triton.experimental.gluon._runtime import GluonASTSource

SOURCE = Path(__file__).resolve().parents[1] / "solutions/gqa_ragged/triton/gluon_attention.py"
CUOBJDUMP = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"


def load_kernel_module():
    spec = importlib.util.spec_from_file_location("gluon_attention", SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def compile_sm90a(dtype: str, ragged: bool = False, window: bool = False, paged: bool = False):
    """The compiled kernel for q / k / v / out of dtype ("fp16" or "bf16"): gluon_padded_fwd, or
    gluon_ragged_fwd (ragged; window: with WINDOW, the sliding window's), or gluon_paged_fwd
    (paged: page size 64)."""
    ragged = ragged or window or paged
    ga = load_kernel_module()
    element = {"fp16": gl.float16, "bf16": gl.bfloat16}[dtype]
    q_layout = gl.NVMMASharedLayout.get_default_for([ga.BLOCK_M // 2, ga.HEAD_DIM], element)
    kv_shape = ([ga.PAGE_SIZE, ga.HEAD_DIM] if paged else [ga.BLOCK_N, ga.HEAD_DIM] if ragged
                else [1, ga.BLOCK_N, ga.HEAD_DIM])  # fmt: skip
    kv_layout = gl.NVMMASharedLayout.get_default_for(kv_shape, element)
    kv_block = f"{dtype}[{', '.join(map(str, kv_shape))}]"
    signature = {
        "q_desc": f"tensordesc<{dtype}[{ga.BLOCK_M // 2}, {ga.HEAD_DIM}],{q_layout!r}>",
        "k_desc": f"tensordesc<{kv_block},{kv_layout!r}>",
        "v_desc": f"tensordesc<{kv_block},{kv_layout!r}>",
    }  # fmt: skip
    if paged:
        signature.update({
            "v_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "lse_ptr": "*fp32", "qo_indptr": "*i32",
            "kv_indptr": "*i32", "kv_indices": "*i32", "kv_last_page_len": "*i32",
            "num_seqs": "i32", "total_q": "i32", "num_entries": "i32", "num_pages": "i32",
            "k_rows_per_page": "i32", "v_rows_per_page": "i32", "out_row_stride": "i32",
            "qk_scale": "fp32", "pingpong": "i32", "counter": "*i32",
        })  # fmt: skip
    elif ragged:
        signature.update({
            "v_ptr": f"*{dtype}", "out_ptr": f"*{dtype}", "lse_ptr": "*fp32", "qo_indptr": "*i32",
            "kv_indptr": "*i32", "num_seqs": "i32", "total_q": "i32", "total_kv": "i32",
            "v_row_stride": "i32", "out_row_stride": "i32", "qk_scale": "fp32", "causal": "i32",
            "pingpong": "i32", "window_left": "i32", "counter": "*i32",
        })  # fmt: skip
    else:
        signature.update({
            "out_ptr": f"*{dtype}", "schedule": "*i32", "seq_q": "i32", "seq_kv": "i32",
            "out_row_stride": "i32",
            "qk_scale": "fp32", "causal": "i32", "pingpong": "i32",
        })  # fmt: skip
    constexprs = dict(NUM_HEADS=ga.NUM_HEADS, NUM_KV_HEADS=ga.NUM_KV_HEADS, BLOCK_M=ga.BLOCK_M,
                      BLOCK_N=ga.BLOCK_N, HEAD_DIM=ga.HEAD_DIM, STAGES=ga.STAGES,
                      CONSUMER_REGISTERS=ga.CONSUMER_REGISTERS,
                      PRODUCER_REGISTERS=ga.PRODUCER_REGISTERS)  # fmt: skip
    if window:
        constexprs["WINDOW"] = True
    signature.update({name: "constexpr" for name in constexprs})
    kernel = ga.gluon_paged_fwd if paged else ga.gluon_ragged_fwd if ragged else ga.gluon_padded_fwd
    # What the JIT specializes at run time on a ragged call: 16-byte pointers (check_placement)
    # and strides that are multiples of 16 elements (TMA-readable rows).
    aligned = ("v_ptr", "out_ptr", "lse_ptr", "qo_indptr", "kv_indptr", "v_row_stride",
               "out_row_stride", "kv_indices", "kv_last_page_len") if ragged else ()  # fmt: skip
    aligned = tuple(name for name in aligned if name in signature)
    names = list(signature)
    attrs = {(names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    source = GluonASTSource(kernel, signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def sass(compiled) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp) / "kernel.cubin"
        cubin.write_bytes(compiled.asm["cubin"])
        return subprocess.run([str(CUOBJDUMP), "-sass", str(cubin)], check=True,
                              capture_output=True, text=True).stdout  # fmt: skip


if __name__ == "__main__":
    dtype = sys.argv[1] if len(sys.argv) > 1 else "fp16"
    print(sass(compile_sm90a(dtype, ragged="ragged" in sys.argv[2:],
                             window="window" in sys.argv[2:], paged="paged" in sys.argv[2:])))
