"""The Definitions of this bundle. Their references live as real files in references/.

The paged definitions are FlashInfer-Trace's (flashinfer-ai/flashinfer-bench at tag v0.1.2,
flashinfer_trace/definitions/gqa_paged/): flashinfer_trace/ holds them verbatim without their
reference, which is this project's (references/gqa_paged_prefill_causal_h32_kv8_d128.py: one
file for both page sizes, its `run` bound per definition).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from flashinfer_bench import Definition

from . import (
    HEAD_DIM,
    MINI,
    NUM_HEADS,
    NUM_KV_HEADS,
    OP_TYPE,
    PAGE_SIZES,
    PAGED_FP8,
    PAGED_PS64,
    RAGGED,
    SWA,
)
from .generated import GeneratedFile

REFERENCES_DIR = Path(__file__).parent / "references"
FLASHINFER_TRACE_DIR = Path(__file__).parent / "flashinfer_trace"
PAGED_REFERENCE = "gqa_paged_prefill_causal_h32_kv8_d128"
# Definitions whose reference file is shared: the file, and the `run` it is given (by inputs).
SHARED_REFERENCES = {
    RAGGED: (RAGGED, "ragged_attention(q, k, v, qo_indptr, kv_indptr, sm_scale)"),
    SWA: (RAGGED, "ragged_attention(q, k, v, qo_indptr, kv_indptr, sm_scale, window_left)"),
    **{name: (PAGED_REFERENCE, None) for name in PAGE_SIZES},
    PAGED_FP8: (PAGED_REFERENCE, "run_ps64_fp8kv({params})"),
}

_CONST_AXES = {
    "num_heads": {"type": "const", "value": NUM_HEADS, "description": "Query heads."},
    "num_kv_heads": {
        "type": "const",
        "value": NUM_KV_HEADS,
        "description": "Key/value heads; query head h reads KV head h // 4 (GQA group of 4).",
    },
    "head_dim": {"type": "const", "value": HEAD_DIM, "description": "Head dimension."},
}

_MASK_RULE = (
    "The causal mask is bottom-right aligned (as FlashInfer and the TileLang tutorial): query i "
    "of a sequence sees key j iff j <= i + seq_kv - seq_q. A query row that sees no key returns "
    "zeros (not NaN)."
)

SPECS = {
    MINI: {
        "name": MINI,
        "op_type": OP_TYPE,
        "description": (
            "GQA prefill attention over a padded batch (32 query heads, 8 KV heads, head_dim "
            "128), float16 in and out, fp32 math. Scale 1/sqrt(head_dim); query head h reads KV "
            "head h // 4. With causal=true, " + _MASK_RULE + " With causal=false every query sees "
            "every key."
        ),
        "tags": ["stage:prefill", "attention:flash"],
        "axes": {
            "batch": {"type": "var", "description": "Sequences in the batch."},
            "seq_q": {"type": "var", "description": "Query tokens per sequence."},
            "seq_kv": {"type": "var", "description": "Key/value tokens per sequence."},
            **_CONST_AXES,
        },
        "inputs": {
            "q": {"shape": ["batch", "seq_q", "num_heads", "head_dim"], "dtype": "float16"},
            "k": {"shape": ["batch", "seq_kv", "num_kv_heads", "head_dim"], "dtype": "float16"},
            "v": {"shape": ["batch", "seq_kv", "num_kv_heads", "head_dim"], "dtype": "float16"},
            "causal": {
                "shape": None,
                "dtype": "bool",
                "description": "Apply the bottom-right aligned causal mask.",
            },
        },
        "outputs": {
            "out": {"shape": ["batch", "seq_q", "num_heads", "head_dim"], "dtype": "float16"}
        },
    },
    RAGGED: {
        "name": RAGGED,
        "op_type": OP_TYPE,
        "description": (
            "Causal GQA prefill attention over a ragged batch (Llama-3.1-8B geometry: 32 query "
            "heads, 8 KV heads, head_dim 128), bfloat16 in and out, fp32 math. Sequence s owns "
            "query rows qo_indptr[s]:qo_indptr[s+1] and key/value rows "
            "kv_indptr[s]:kv_indptr[s+1]. Logits are scaled by sm_scale; query head h reads KV "
            "head h // 4. " + _MASK_RULE + " lse is the base-2 log-sum-exp of the scaled logits, "
            "log2(sum_j exp(sm_scale * q.k_j)), as FlashInfer returns it. A sequence with no query "
            "or no key, and any query row that sees no key, leaves output 0 and lse -inf."
        ),
        "tags": ["stage:prefill", "attention:flash", "model:llama-3.1-8b"],
        "axes": {
            "total_q": {"type": "var", "description": "Query tokens of all sequences."},
            "total_kv": {"type": "var", "description": "Key/value tokens of all sequences."},
            "len_indptr": {"type": "var", "description": "Sequences in the batch plus one."},
            "num_qo_heads": _CONST_AXES["num_heads"],
            "num_kv_heads": _CONST_AXES["num_kv_heads"],
            "head_dim": _CONST_AXES["head_dim"],
        },
        "constraints": ["total_q == qo_indptr[-1]", "total_kv == kv_indptr[-1]"],
        "inputs": {
            "q": {"shape": ["total_q", "num_qo_heads", "head_dim"], "dtype": "bfloat16"},
            "k": {"shape": ["total_kv", "num_kv_heads", "head_dim"], "dtype": "bfloat16"},
            "v": {"shape": ["total_kv", "num_kv_heads", "head_dim"], "dtype": "bfloat16"},
            "qo_indptr": {
                "shape": ["len_indptr"],
                "dtype": "int32",
                "description": "Query row offsets: non-decreasing, starts at 0, ends at total_q.",
            },
            "kv_indptr": {
                "shape": ["len_indptr"],
                "dtype": "int32",
                "description": "Key/value row offsets: non-decreasing, from 0 to total_kv.",
            },
            "sm_scale": {
                "shape": None,
                "dtype": "float32",
                "description": "Softmax scale, usually 1/sqrt(head_dim).",
            },
        },
        "outputs": {
            "output": {"shape": ["total_q", "num_qo_heads", "head_dim"], "dtype": "bfloat16"},
            "lse": {
                "shape": ["total_q", "num_qo_heads"],
                "dtype": "float32",
                "description": "Base-2 log-sum-exp of the scaled logits; -inf with no key.",
            },
        },
    },
}


_SWA_INPUTS = dict(SPECS[RAGGED]["inputs"])
_SWA_SCALE = _SWA_INPUTS.pop("sm_scale")
SPECS[SWA] = {
    **SPECS[RAGGED],
    "name": SWA,
    "description": (
        "Causal sliding-window GQA prefill attention over a ragged batch (Mistral, Gemma 3's local "
        "layers, gpt-oss), otherwise exactly gqa_ragged_prefill_causal_h32_kv8_d128. With p = i + "
        "seq_kv - seq_q the bottom-right aligned position of query i of a sequence, it sees key j "
        "iff p - window_left <= j <= p (FlashInfer's window_left); window_left = -1 means no "
        "window (plain causal). A query row that sees no key returns zeros and lse -inf; so does a "
        "sequence with no query or no key. lse is the base-2 log-sum-exp of the scaled logits of "
        "the keys it sees."
    ),
    "tags": ["stage:prefill", "attention:flash", "attention:sliding-window"],
    "inputs": {
        **_SWA_INPUTS,
        "window_left": {
            "shape": None,
            "dtype": "int32",
            "description": "Keys a query sees to its left (0: only itself); -1: no window.",
        },
        "sm_scale": _SWA_SCALE,
    },
}

SPECS.update(
    {name: json.loads((FLASHINFER_TRACE_DIR / f"{name}.json").read_text()) for name in PAGE_SIZES}
)


def _fp8_spec(ps64: dict) -> dict:
    """The page size 64 definition with float8_e4m3fn caches and their two scales."""
    inputs = {}
    for key, value in ps64["inputs"].items():
        if key in ("k_cache", "v_cache"):
            what = "keys" if key == "k_cache" else "values"
            value = {**value, "dtype": "float8_e4m3fn",
                     "description": f"Paged {what} cache, float8_e4m3fn; the real {what} are "
                                    f"{key} * {key[0]}_scale."}  # fmt: skip
        if key == "sm_scale":
            for name in ("k_scale", "v_scale"):
                inputs[name] = {
                    "shape": None,
                    "dtype": "float32",
                    "description": f"Per-tensor dequantization scale of {name[0]}_cache.",
                }
        inputs[key] = value
    return {
        **ps64,
        "name": PAGED_FP8,
        "description": (
            "Batched GQA prefill over a paged KV cache (page_size=64) stored in FP8 (e4m3, one "
            "scale per tensor: K = k_cache * k_scale, V = v_cache * v_scale), bfloat16 query and "
            "output; otherwise exactly gqa_paged_prefill_causal_h32_kv8_d128_ps64 (causal, bottom-"
            "right aligned; lse base 2 of the scaled logits of the dequantized keys)."
        ),
        "tags": ["stage:prefill", "attention:flash", "kv_cache:fp8_e4m3", "model:llama-3.1-8b"],
        "inputs": inputs,
    }


SPECS[PAGED_FP8] = _fp8_spec(SPECS[PAGED_PS64])


def reference_path(name: str) -> Path:
    return REFERENCES_DIR / f"{SHARED_REFERENCES.get(name, (name,))[0]}.py"


def composed_source(path: Path) -> str:
    """A reference file made self-contained: each `from .other import ...` line of it replaced
    by the other reference file's text, placed first."""
    text = path.read_text()
    others = re.findall(r"^from \.(\w+) import .*$", text, flags=re.M)
    body = re.sub(r"^from \.\w+ import .*\n", "", text, flags=re.M)
    return "".join(composed_source(REFERENCES_DIR / f"{o}.py") + "\n\n" for o in others) + body


def reference_source(name: str) -> str:
    """The reference file; a shared one gets this definition's `run`, taking its inputs."""
    source = composed_source(reference_path(name))
    if name in SHARED_REFERENCES:
        params = ", ".join(SPECS[name]["inputs"])
        call = (SHARED_REFERENCES[name][1] or f"run_ps{PAGE_SIZES.get(name)}({{params}})").format(
            params=params
        )
        source += f"\n\ndef run({params}):\n    return {call}\n"
    return source


def build_definition(name: str) -> Definition:
    return Definition.model_validate({**SPECS[name], "reference": reference_source(name)})


def definition_path(name: str) -> str:
    return f"definitions/{SPECS[name]['op_type']}/{name}.json"


def definition_files() -> list[GeneratedFile]:
    return [GeneratedFile(definition_path(name), build_definition(name)) for name in SPECS]
