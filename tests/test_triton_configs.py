"""Every launch config the Triton plans can pick computes the same function (interpreter on CPU,
the GPU when there is one): block shapes and query heads packed per tile."""


import pytest
import torch

from prefill_bundle.testing import (
    PaddedCase,
    PagedCase,
    RaggedCase,
    build_solution,
    check_outputs,
    entry_module,
    make_inputs,
    poisoned_outputs,
    reference_outputs,
    run_runnable,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_BLOCKS = dict(BLOCK_M=32, BLOCK_N=16, num_warps=4, num_stages=1)
CONFIGS = {
    "four_heads_per_tile": dict(HEADS_PER_TILE=4, **SMALL_BLOCKS),
    "two_heads_per_tile": dict(HEADS_PER_TILE=2, **SMALL_BLOCKS),
    "one_head_per_tile": dict(HEADS_PER_TILE=1, **SMALL_BLOCKS),
    "wide_key_tiles": dict(HEADS_PER_TILE=4, BLOCK_M=16, BLOCK_N=32, num_warps=4, num_stages=1),
    # Two paired row blocks per tile (the big shapes' layout): 16 tokens a tile, so the cases'
    # last tiles have an empty or partial second block, and causal diagonals cross both blocks.
    "paired_row_blocks": dict(HEADS_PER_TILE=4, ROW_BLOCKS=2, **SMALL_BLOCKS),
    "paired_row_blocks_two_heads": dict(HEADS_PER_TILE=2, ROW_BLOCKS=2, **SMALL_BLOCKS),
}
CASES = [
    PaddedCase(2, 37, 53, True),
    PaddedCase(1, 45, 20, False),
    RaggedCase((21, 0, 40), (30, 0, 40)),
    RaggedCase((9, 17), (3, 17)),  # rows without keys under the TMA path too
]


def triton_module(solution):
    return entry_module(solution)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_config_matches_reference(config, case):
    inputs = make_inputs(case, DEVICE, seed=7)
    outputs = poisoned_outputs(case, inputs)
    if isinstance(case, PaddedCase):
        module = triton_module("triton_mini")
        plan = module._plan_padded(*inputs, *outputs, config=CONFIGS[config])
        module.launch_padded(plan, *inputs[:3], *outputs)
    else:
        module = triton_module("triton_ragged")
        q, k, v, qo, kv, scale = inputs
        plan = module._plan_ragged(q, k, v, qo, kv, *outputs, config=CONFIGS[config])
        module.launch_ragged(plan, *inputs, *outputs)
    check_outputs(outputs, reference_outputs(case, inputs))


@pytest.mark.parametrize(
    "batch, seq, causal, paired",
    [(8, 2048, True, True), (1, 8192, True, True), (1, 16384, False, True), (4, 512, False, True),
     (4, 512, True, False), (1, 128, True, False), (15, 65, True, False)],
)  # fmt: skip
def test_plans_pair_row_blocks_on_big_shapes(monkeypatch, batch, seq, causal, paired):
    """The GPU plan (as on an H100's 132 SMs) runs paired row blocks where they were measured
    to pay (see _launch_config), and tiles fit the sequence's tokens."""
    module = triton_module("triton_mini")
    monkeypatch.setattr(module, "INTERPRET", False)
    meta = module._launch_config(seq, lambda t: batch * -(-seq // t), 132, causal)
    assert (meta["ROW_BLOCKS"] == 2) == paired, meta
    assert module._tokens_per_tile(meta) <= max(seq, 16), meta


@pytest.mark.parametrize(
    "tokens, keys, batch, paired",
    [
        (2048, 8131, 1, True),  # chunked_prefill_2k_over_8k: 33 paired slots, 2 waves
        (2048, 32611, 1, True),  # chunked_prefill_2k_over_32k
        (2048, 2048, 1, False),  # the same chunk without a long context: 64-row tiles
        (1000, 16384, 1, False),  # 16 paired slots: under one wave
        (384, 1664, 2, False),  # chunked_prefill_with_prefix: short contexts
    ],
)  # fmt: skip
def test_plans_pair_row_blocks_over_long_keys(monkeypatch, tokens, keys, batch, paired):
    """Below four waves of 32-token tiles, paired row blocks only where every tile reads a long
    context and paired tiles fill the GPU at least once (ragged slots: total_q // T + batch)."""
    module = triton_module("triton_ragged")
    monkeypatch.setattr(module, "INTERPRET", False)
    meta = module._launch_config(tokens, lambda t: batch * tokens // t + batch, 132, True,
                                 keys_per_seq=keys)  # fmt: skip
    assert (meta["ROW_BLOCKS"] == 2) == paired, meta


PLAN_CASES = [
    ("triton_mini", PaddedCase(2, 37, 53, True)),
    ("triton_mini", PaddedCase(1, 45, 20, False)),
    ("triton_ragged", RaggedCase((21, 0, 40), (30, 0, 40))),
    ("triton_swa", RaggedCase((21, 40), (30, 40), window_left=8)),
    ("triton_paged_ps64", PagedCase((9, 3), (70, 3), 64)),
    ("triton_paged_ps1", PagedCase((9, 3), (70, 3), 1)),
    ("triton_fp8kv", PagedCase((9, 3), (70, 3), 64, fp8_scales=(2.0, 0.5))),
    ("triton_fp8kv", PagedCase((9, 3), (70, 3), 64, torch.float16, fp8_scales=(1.0, 1.0))),
]


@pytest.mark.parametrize("solution, case", PLAN_CASES, ids=lambda x: getattr(x, "id", x))
def test_every_plan_gives_the_compiled_kernel_each_constexpr(monkeypatch, solution, case):
    """Off the interpreter a plan's compiled kernel is launched with its constexprs listed in
    signature order (_cached_launch), a path the CPU tests never take: every plan must give each
    one a value, or the kernel's default (a plan without FP8_QK, which only the paged plans
    set, once failed every other Triton solution on the GPU). FP8_QK: FP8 caches, bf16 q."""
    module = triton_module(solution)
    plans = []
    monkeypatch.setattr(module, "_launch", lambda grid, meta, runners, args: plans.append(meta))
    run_runnable(build_solution(solution), case, make_inputs(case, DEVICE, seed=3))
    (meta,) = plans
    kernel = module.gqa_prefill_fwd
    values = module.compiled_constexprs(kernel, module._attention_constexprs(meta))
    names = [name for name, _ in module._constexpr_parameters(kernel)]
    assert len(values) == len(names) and "FP8_QK" in names
    fp8_qk = solution == "triton_fp8kv" and case.dtype == torch.bfloat16
    assert dict(zip(names, values))["FP8_QK"] == fp8_qk
    without_default = module._attention_constexprs(meta)
    del without_default["HEAD_DIM"]
    with pytest.raises(KeyError, match="HEAD_DIM"):
        module.compiled_constexprs(kernel, without_default)
