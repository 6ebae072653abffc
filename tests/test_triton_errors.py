"""The Triton solutions reject bad arguments at the boundary, before any launch, with a
ValueError that names the argument. Runs on CPU under Triton's interpreter (see conftest.py)."""

import math
import sys

import pytest
import torch

from prefill_bundle.testing import build_solution

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


def entry_module(name: str):
    """The built solution's module, to reach its module-level switches."""
    return sys.modules[build_solution(name).metadata.misc["module_name"]]


def tensor(*shape, dtype=F16):
    return torch.zeros(*shape, dtype=dtype, device=DEVICE)


def transposed(*shape, dtype=F16):
    """A tensor of the given shape whose last two dimensions are swapped in memory."""
    return tensor(*shape[:-2], shape[-1], shape[-2], dtype=dtype).transpose(-1, -2)


def padded_args(batch=2, seq_q=3, seq_kv=5, dtype=F16, **changes):
    args = dict(
        q=tensor(batch, seq_q, 32, 128, dtype=dtype),
        k=tensor(batch, seq_kv, 8, 128, dtype=dtype),
        v=tensor(batch, seq_kv, 8, 128, dtype=dtype),
        causal=True,
        out=tensor(batch, seq_q, 32, 128, dtype=dtype),
    )
    args.update(changes)
    return args


def ragged_args(total_q=4, total_kv=6, batch=2, dtype=BF16, **changes):
    indptr = torch.zeros(batch + 1, dtype=torch.int32, device=DEVICE)
    args = dict(
        q=tensor(total_q, 32, 128, dtype=dtype),
        k=tensor(total_kv, 8, 128, dtype=dtype),
        v=tensor(total_kv, 8, 128, dtype=dtype),
        qo_indptr=indptr,
        kv_indptr=indptr.clone(),
        sm_scale=1.0 / math.sqrt(128),
        output=tensor(total_q, 32, 128, dtype=dtype),
        lse=tensor(total_q, 32, dtype=F32),
    )
    args.update(changes)
    return args


def int32(*shape):
    return torch.zeros(*shape, dtype=torch.int32, device=DEVICE)


PADDED_ERRORS = {
    "q_float32": ("q", dict(q=tensor(2, 3, 32, 128, dtype=F32))),
    "q_rank_3": ("q", dict(q=tensor(6, 32, 128))),
    "q_16_heads": ("q", dict(q=tensor(2, 3, 16, 128), out=tensor(2, 3, 16, 128))),
    "q_head_dim_64": ("q", dict(q=tensor(2, 3, 32, 64), out=tensor(2, 3, 32, 64))),
    "q_not_a_tensor": ("q", dict(q=[[0.0]])),
    "k_dtype_differs_from_q": ("k", dict(k=tensor(2, 5, 8, 128, dtype=BF16))),
    "k_4_heads": ("k", dict(k=tensor(2, 5, 4, 128), v=tensor(2, 5, 4, 128))),
    "k_head_dim_64": ("k", dict(k=tensor(2, 5, 8, 64), v=tensor(2, 5, 8, 64))),
    "k_batch_differs_from_q": ("k", dict(k=tensor(3, 5, 8, 128), v=tensor(3, 5, 8, 128))),
    "v_seq_differs_from_k": ("v", dict(v=tensor(2, 4, 8, 128))),
    "v_rank_3": ("v", dict(v=tensor(10, 8, 128))),
    "causal_tensor": ("causal", dict(causal=torch.tensor(True))),
    "causal_2": ("causal", dict(causal=2)),
    "out_wrong_shape": ("out", dict(out=tensor(2, 4, 32, 128))),
    "out_wrong_dtype": ("out", dict(out=tensor(2, 3, 32, 128, dtype=BF16))),
    "q_not_contiguous": ("q", dict(q=transposed(2, 3, 32, 128))),
    "k_not_contiguous": ("k", dict(k=transposed(2, 5, 8, 128))),
    "out_not_contiguous": ("out", dict(out=transposed(2, 3, 32, 128))),
    "k_on_another_device": ("k", dict(k=tensor(2, 5, 8, 128).to("meta"))),
}

RAGGED_ERRORS = {
    "q_float32": ("q", dict(q=tensor(4, 32, 128, dtype=F32))),
    "q_rank_4": ("q", dict(q=tensor(1, 4, 32, 128, dtype=BF16))),
    "q_16_heads": ("q", dict(q=tensor(4, 16, 128, dtype=BF16))),
    "q_head_dim_64": ("q", dict(q=tensor(4, 32, 64, dtype=BF16))),
    "k_dtype_differs_from_q": ("k", dict(k=tensor(6, 8, 128, dtype=F16))),
    "k_32_heads": ("k", dict(k=tensor(6, 32, 128, dtype=BF16), v=tensor(6, 32, 128, dtype=BF16))),
    "v_length_differs_from_k": ("v", dict(v=tensor(7, 8, 128, dtype=BF16))),
    "qo_indptr_int64": (
        "qo_indptr",
        dict(qo_indptr=torch.zeros(3, dtype=torch.int64, device=DEVICE)),
    ),
    "qo_indptr_rank_2": ("qo_indptr", dict(qo_indptr=int32(1, 3))),
    "qo_indptr_empty": ("qo_indptr", dict(qo_indptr=int32(0), kv_indptr=int32(0))),
    "qo_indptr_without_sequence": ("qo_indptr", dict(qo_indptr=int32(1), kv_indptr=int32(1))),
    "kv_indptr_int64": (
        "kv_indptr",
        dict(kv_indptr=torch.zeros(3, dtype=torch.int64, device=DEVICE)),
    ),
    "kv_indptr_length_differs": ("kv_indptr", dict(kv_indptr=int32(4))),
    "sm_scale_tensor": ("sm_scale", dict(sm_scale=torch.tensor(0.1))),
    "sm_scale_string": ("sm_scale", dict(sm_scale="0.1")),
    "sm_scale_nan": ("sm_scale", dict(sm_scale=float("nan"))),
    "sm_scale_inf": ("sm_scale", dict(sm_scale=float("inf"))),
    "output_wrong_shape": ("output", dict(output=tensor(5, 32, 128, dtype=BF16))),
    "output_wrong_dtype": ("output", dict(output=tensor(4, 32, 128, dtype=F16))),
    "lse_wrong_dtype": ("lse", dict(lse=tensor(4, 32, dtype=BF16))),
    "lse_wrong_shape": ("lse", dict(lse=tensor(4, 8, dtype=F32))),
    "q_not_contiguous": ("q", dict(q=transposed(4, 32, 128, dtype=BF16))),
    "lse_not_contiguous": ("lse", dict(lse=transposed(4, 32, dtype=F32))),
    "kv_indptr_not_contiguous": ("kv_indptr", dict(kv_indptr=int32(6)[::2])),
    "v_on_another_device": ("v", dict(v=tensor(6, 8, 128, dtype=BF16).to("meta"))),
}


@pytest.mark.parametrize("argument, changes", PADDED_ERRORS.values(), ids=PADDED_ERRORS.keys())
def test_run_padded_rejects(argument, changes):
    with pytest.raises(ValueError, match=rf"^{argument}: expected "):
        build_solution("triton_mini")(*padded_args(**changes).values())


@pytest.mark.parametrize("argument, changes", RAGGED_ERRORS.values(), ids=RAGGED_ERRORS.keys())
def test_run_ragged_rejects(argument, changes):
    with pytest.raises(ValueError, match=rf"^{argument}: expected "):
        build_solution("triton_ragged")(*ragged_args(**changes).values())


def test_layout_and_device_are_checked_on_every_call():
    """Shapes and dtypes are checked once per shape; layout and device still on every call."""
    run = build_solution("triton_mini")
    args = padded_args(batch=1, seq_q=1, seq_kv=1)
    run(*args.values())  # plans (and launches) this shape
    with pytest.raises(ValueError, match=r"^out: expected a contiguous tensor"):
        run(*padded_args(batch=1, seq_q=1, seq_kv=1, out=transposed(1, 1, 32, 128)).values())
    with pytest.raises(ValueError, match=r"^v: expected a tensor on "):
        run(*dict(args, v=args["v"].to("meta")).values())

    run = build_solution("triton_ragged")
    args = ragged_args(total_q=0, total_kv=0)  # planned, but no query row: nothing to launch
    run(*args.values())
    with pytest.raises(ValueError, match=r"^qo_indptr: expected a tensor on "):
        run(*dict(args, qo_indptr=args["qo_indptr"].to("meta")).values())
    with pytest.raises(ValueError, match=r"^sm_scale: expected "):
        run(*dict(args, sm_scale=None).values())


@pytest.mark.parametrize("name", ["triton_mini", "triton_ragged"])
def test_cpu_tensors_are_rejected_without_the_interpreter(name, monkeypatch):
    monkeypatch.setattr(entry_module(name), "INTERPRET", False)
    args = padded_args() if name == "triton_mini" else ragged_args()
    args = {key: x.cpu() if isinstance(x, torch.Tensor) else x for key, x in args.items()}
    with pytest.raises(ValueError, match=r"^q: expected a CUDA tensor"):
        build_solution(name)(*args.values())
