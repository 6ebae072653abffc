"""Split-KV in the Triton kernels (split_kv.py): which plans split, and that a split plan's
shares merge to the unsplit kernel's result. The shared matrix (tests/test_solutions.py) runs the
decode-like cases of prefill_bundle/testing.py through it against the reference, and
tests/test_malformed.py its malformed decode-like batches."""

import pytest
import torch
from test_triton_paged import triton_module

from prefill_bundle.testing import PagedCase, make_inputs, poisoned_outputs

SMS = 132  # an H100's


@pytest.mark.parametrize(
    "tokens_per_seq,batch,kv_tokens,expected",
    [
        (1.0, 16, 136_546 * 1, 16),  # single_token_rows_16 (ps1): 128 tiles, 4 waves
        (1.0, 16, 2134 * 64, 16),  # the same rows over pages of 64
        (1.0, 1, 8192, 16),  # one row over 8K keys: capped
        (1.0, 64, 64 * 4096, 4),  # 512 tiles fill one wave already: 4 waves
        (1.0, 256, 256 * 4096, 1),  # 2048 tiles: 4 waves unsplit
        (1.0, 4, 4 * 600, 1),  # short contexts: shares under 8 tiles of 64
        (5.0, 16, 16 * 8192, 1),  # more than 4 tokens a sequence: prefill tiles
    ],
)
def test_which_plans_split(tokens_per_seq, batch, kv_tokens, expected):
    """The GPU's plan (decode tiles of 64 keys, shares of at least 8 tiles) for the workloads'
    decode-like shapes and the limits around them."""
    module = triton_module()
    assert module._kv_splits(tokens_per_seq, batch, kv_tokens, 64, SMS, min_tiles=8) == expected


def test_interpreter_bar_splits_the_decode_cases():
    """Under the interpreter the shared matrix's decode-like cases get split plans (else the
    matrix would only ever run the unsplit kernel). The GPU's bar is test_which_plans_split's."""
    module = triton_module()
    if not module.INTERPRET:
        pytest.skip("the interpreter's bar; on the GPU shares are at least 8 tiles")
    assert module.MIN_TILES_PER_SPLIT == 2
    assert module._kv_splits(1.0, 4, 442, 16, SMS) == 3  # RaggedCase((1, 2, 1, 0), ...)
    assert module._kv_splits(1.0, 2, 131, 16, SMS) == 2  # PagedCase((1, 2), (90, 41), 1)


@pytest.mark.parametrize("splits", [2, 5])
def test_shares_merge_to_the_unsplit_result(splits):
    """The same paged batch planned with and without splits: outputs agree to fp32 rounding of
    the merge (the unsplit kernel is checked against the reference by the matrix). On the GPU
    where there is one (the split plan is forced: the GPU's own bar splits only long contexts)."""
    module = triton_module()
    case = PagedCase((1, 1, 2), (300, 65, 200), 64, shared_prefix=(64, 0, 64))
    inputs = make_inputs(case, "cuda" if torch.cuda.is_available() else "cpu", seed=3)
    results = []
    for kv_splits in (1, splits):
        config = dict(HEADS_PER_TILE=4, BLOCK_M=16, BLOCK_N=16, ROW_BLOCKS=1, num_warps=4,
                      num_stages=1, KV_SPLITS=kv_splits)  # fmt: skip
        outputs = poisoned_outputs(case, inputs)
        tensors = (*inputs[:7], *outputs)
        plan = module._plan_paged(64, tensors, config=config)
        assert plan[1]["KV_SPLITS"] == kv_splits and len(plan[0]) == (3 if kv_splits > 1 else 2)
        module.launch_paged(plan, *inputs[:7], inputs[7], *outputs)
        results.append(outputs)
    (out1, lse1), (out2, lse2) = results
    assert not out2.isnan().any() and not lse2.isnan().any()
    torch.testing.assert_close(out2.float(), out1.float(), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(lse2, lse1, atol=1e-4, rtol=1e-5)
