"""tests/conftest.py's change to Triton's interpreter (helper calls inside a launch skip
re-patching triton.language): installed where it applies, and a kernel whose helpers reach both
triton.language and triton's own helpers (tl.max, tl.sum: triton.language.core) computes what
torch computes, launch after launch."""

import os

import pytest
import torch
import triton
import triton.language as tl

INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _row_softmax(x):
    x = x - tl.max(x, axis=1)[:, None]
    p = tl.exp(x)
    return p / tl.sum(p, axis=1)[:, None]


@triton.jit
def _softmax_kernel(x_ptr, out_ptr, ROWS: tl.constexpr, COLS: tl.constexpr):
    offsets = tl.arange(0, ROWS)[:, None] * COLS + tl.arange(0, COLS)[None, :]
    tl.store(out_ptr + offsets, _row_softmax(tl.load(x_ptr + offsets)))


@pytest.mark.skipif(not INTERPRETED, reason="the interpreter's patch: CPU runs only")
def test_interpreter_patch_is_installed_for_triton_3_6():
    from triton.runtime import interpreter

    installed = interpreter.InterpretedFunction.__call__.__name__ == "helper_in_launch"
    assert installed == (triton.__version__ == "3.6.0")


def test_helpers_compute_what_torch_computes():
    device = "cpu" if INTERPRETED else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs the interpreter or a GPU")
    for seed in range(3):  # several launches: each patches and restores the language
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(seed)).to(device)
        out = torch.full_like(x, float("nan"))
        _softmax_kernel[(1,)](x, out, 16, 32)
        torch.testing.assert_close(out, torch.softmax(x, dim=1))
