"""The Triton sliding-window kernel reads only the key tiles that meet each query tile's band
(interpreter on CPU, the GPU when there is one), in both tile layouts, and windows that hide no
key run as plain causal."""


import pytest
import torch

from prefill_bundle.testing import (
    RaggedCase,
    build_solution,
    check_outputs,
    entry_module,
    make_inputs,
    poisoned_outputs,
    reference_outputs,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_BLOCKS = dict(HEADS_PER_TILE=4, BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
CONFIGS = {
    "one_row_block": dict(ROW_BLOCKS=1, **SMALL_BLOCKS),  # 8 tokens a tile
    "paired_row_blocks": dict(ROW_BLOCKS=2, **SMALL_BLOCKS),  # 16 tokens a tile
}
# Short query chunks over long key sequences: the band is a small part of the keys. Windows of
# 0 (the diagonal alone), edges inside tiles, several unmasked tiles inside the band.
CASES = [
    RaggedCase((20, 9), (150, 61), window_left=17),
    RaggedCase((13, 3), (130, 97), window_left=0),
    RaggedCase((24,), (200,), window_left=45),
]


def triton_swa():
    runnable = build_solution("triton_swa")
    return runnable, entry_module(runnable)


def tiles_read(q_len, kv_len, window_left, tokens_per_tile, block_n) -> set:
    """Keys of a sequence that some query tile may load: from the first tile its first row's
    band meets to the end of the tile that holds its last row's last key."""
    keys = set()
    shift = kv_len - q_len
    for first in range(0, q_len, tokens_per_tile):
        first_pos, last_pos = first + shift, min(first + tokens_per_tile, q_len) - 1 + shift
        lo = max(first_pos - window_left, 0) // block_n * block_n
        hi = -(-min(last_pos + 1, kv_len) // block_n) * block_n
        keys.update(range(lo, min(hi, kv_len)))
    return keys


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_keys_outside_the_band_tiles_are_never_read(config, case):
    """Every key outside the band's tiles is NaN in K and V (a read of one shows: an unmasked
    tile's logit or a masked tile's 0 * NaN); the outputs still match the clean reference."""
    inputs = make_inputs(case, DEVICE, seed=11)
    expected = reference_outputs(case, inputs)
    q, k, v, qo_indptr, kv_indptr, window_left, sm_scale = inputs
    meta = CONFIGS[config]
    tokens_per_tile = meta["ROW_BLOCKS"] * meta["BLOCK_M"] // meta["HEADS_PER_TILE"]
    k, v = k.clone(), v.clone()
    kv_start = 0
    for q_len, kv_len in zip(case.q_lens, case.kv_lens):
        read = tiles_read(q_len, kv_len, window_left, tokens_per_tile, meta["BLOCK_N"])
        unread = [kv_start + j for j in range(kv_len) if j not in read]
        # The window, not the length, bounds what is read: most keys stay unread.
        assert len(unread) > kv_len // 2, (q_len, kv_len, len(read))
        k[unread] = float("nan")
        v[unread] = float("nan")
        kv_start += kv_len
    _, module = triton_swa()
    outputs = poisoned_outputs(case, inputs)
    plan = module._plan_ragged(q, k, v, qo_indptr, kv_indptr, *outputs, config=meta, window=True)
    module.launch_ragged(plan, q, k, v, qo_indptr, kv_indptr, sm_scale, *outputs, window_left)
    check_outputs(outputs, expected)


def test_windows_that_hide_no_key_run_plain_causal():
    """-1, total_kv and the largest int32 window give the ragged definition's outputs bit for
    bit (no int32 overflow in p - window_left); total_kv - 1, the widest window the window
    kernel gets, matches the reference."""
    case = RaggedCase((9, 14), (12, 30), window_left=-1)
    inputs = make_inputs(case, DEVICE, seed=3)
    q, k, v, qo_indptr, kv_indptr, _, sm_scale = inputs
    runnable, module = triton_swa()
    total_kv = k.shape[0]
    causal = poisoned_outputs(case, inputs)
    module.run_ragged(q, k, v, qo_indptr, kv_indptr, sm_scale, *causal)
    for window_left in (-1, total_kv, 2**31 - 1):
        outputs = poisoned_outputs(case, inputs)
        runnable(q, k, v, qo_indptr, kv_indptr, window_left, sm_scale, *outputs)
        for got, want in zip(outputs, causal):
            assert torch.equal(got, want), window_left
    longest = RaggedCase(case.q_lens, case.kv_lens, window_left=total_kv - 1)
    outputs = poisoned_outputs(longest, inputs)
    runnable(q, k, v, qo_indptr, kv_indptr, total_kv - 1, sm_scale, *outputs)
    check_outputs(outputs, reference_outputs(longest, [*inputs[:5], total_kv - 1, sm_scale]))
