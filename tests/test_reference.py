"""Each definition's reference (executed from its JSON) against an independent fp64 attention."""

import math

import pytest
import torch

from prefill_bundle import MINI, PAGED_FP8, PAGED_PS1, PAGED_PS64, RAGGED, SWA
from prefill_bundle.testing import (
    CPU_FP8_CASES,
    PaddedCase,
    PagedCase,
    RaggedCase,
    gathered_ragged_inputs,
    load_definition,
    make_inputs,
    reference,
)


def attention_fp64(q, k, v, q_lens, kv_lens, scale, causal, window_left=-1):
    """Written differently on purpose: KV heads repeated, an additive mask, torch.logsumexp.
    A window (window_left >= 0) is a second additive mask: keys more than window_left before
    the query's bottom-right position j - i = kv_len - q_len.

    q: [total_q, H, D]; k, v: [total_kv, KV, D]. Returns (out [total_q, H, D], lse2 [total_q, H]).
    """
    q, k, v = q.double(), k.double(), v.double()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    out = torch.zeros_like(q)
    lse = torch.full(q.shape[:2], -math.inf, dtype=torch.float64)
    q_off = kv_off = 0
    for q_len, kv_len in zip(q_lens, kv_lens):
        qs = q[q_off : q_off + q_len]
        ks, vs = k[kv_off : kv_off + kv_len], v[kv_off : kv_off + kv_len]
        logits = torch.einsum("qhd,khd->hqk", qs, ks) * scale
        if causal:
            i = torch.arange(q_len)[:, None]
            j = torch.arange(kv_len)[None, :]
            logits = logits + torch.where(j - i <= kv_len - q_len, 0.0, -math.inf)
            if window_left >= 0:
                too_far = j - i < kv_len - q_len - window_left
                logits = logits + torch.where(too_far, -math.inf, 0.0)
        seq_lse = torch.logsumexp(logits, dim=-1)  # [H, q_len], -inf where no key is visible
        probs = torch.exp(logits - seq_lse[..., None]).nan_to_num(0.0)
        out[q_off : q_off + q_len] = torch.einsum("hqk,khd->qhd", probs, vs)
        lse[q_off : q_off + q_len] = (seq_lse / math.log(2.0)).T
        q_off, kv_off = q_off + q_len, kv_off + kv_len
    return out, lse


PADDED = [
    PaddedCase(1, 1, 1, True),
    PaddedCase(2, 9, 9, True),
    PaddedCase(2, 9, 9, False),
    PaddedCase(1, 5, 23, True),  # seq_q < seq_kv: bottom-right alignment matters
    PaddedCase(2, 23, 5, True),  # seq_q > seq_kv: 18 rows per sequence see no key
    PaddedCase(1, 7, 3, False),
]
RAGGED_CASES = [
    RaggedCase((1,), (1,)),
    RaggedCase((4, 0, 11), (4, 0, 11)),  # an empty sequence
    RaggedCase((3, 8), (10, 2)),  # seq_q < seq_kv, then seq_q > seq_kv
    RaggedCase((5, 2), (0, 2)),  # queries with no key at all
]


def padded_fp64(case, q, k, v):
    b, sq, skv = case.batch, case.seq_q, case.seq_kv
    out, _ = attention_fp64(
        q.flatten(0, 1),
        k.flatten(0, 1),
        v.flatten(0, 1),
        [sq] * b,
        [skv] * b,
        1 / math.sqrt(q.shape[-1]),
        case.causal,
    )
    return out.view(q.shape)


@pytest.mark.parametrize("case", PADDED, ids=lambda c: c.id)
def test_padded_reference_matches_fp64(case):
    q, k, v, causal = make_inputs(case, "cpu", seed=1)
    out = reference(MINI)(q, k, v, causal)
    assert out.dtype == torch.float16 and out.shape == q.shape
    torch.testing.assert_close(out.double(), padded_fp64(case, q, k, v), atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("case", RAGGED_CASES, ids=lambda c: c.id)
def test_ragged_reference_matches_fp64(case):
    q, k, v, qo_indptr, kv_indptr, sm_scale = make_inputs(case, "cpu", seed=2)
    output, lse = reference(RAGGED)(q, k, v, qo_indptr, kv_indptr, sm_scale)
    want_out, want_lse = attention_fp64(q, k, v, case.q_lens, case.kv_lens, sm_scale, True)
    assert output.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(output.double(), want_out, atol=1e-2, rtol=1e-2)
    assert torch.equal(lse.isinf(), want_lse.isinf())  # -inf exactly where no key is visible
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


SWA_CASES = [
    RaggedCase((1,), (1,), window_left=0),
    RaggedCase((9, 0, 11), (9, 0, 11), window_left=0),  # only the query's own position
    RaggedCase((9, 4), (9, 12), window_left=1),
    RaggedCase((12, 3), (20, 2), window_left=4),  # seq_q < seq_kv, then seq_q > seq_kv
    RaggedCase((7, 6), (7, 6), window_left=100),  # longer than the sequences
    RaggedCase((8, 5), (8, 9), window_left=-1),  # no window
    RaggedCase((5, 2), (0, 2), window_left=2),  # queries with no key at all
]


@pytest.mark.parametrize("case", SWA_CASES, ids=lambda c: c.id)
def test_sliding_window_reference_matches_fp64(case):
    q, k, v, qo_indptr, kv_indptr, window_left, sm_scale = make_inputs(case, "cpu", seed=7)
    output, lse = reference(SWA)(q, k, v, qo_indptr, kv_indptr, window_left, sm_scale)
    want = attention_fp64(q, k, v, case.q_lens, case.kv_lens, sm_scale, True, window_left)
    torch.testing.assert_close(output.double(), want[0], atol=1e-2, rtol=1e-2)
    assert torch.equal(lse.isinf(), want[1].isinf())
    torch.testing.assert_close(lse.double(), want[1], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window_left", [-1, 0, 5, 40])
@pytest.mark.parametrize("q_lens, kv_lens", [((70, 0, 33), (70, 9, 90)), ((60,), (20,))])
def test_reference_query_chunks_read_only_the_keys_they_see(q_lens, kv_lens, window_left):
    """A sequence longer than a query chunk (4096 rows, with a window about the window's length;
    16 and 6 here): each chunk reads only the keys its rows may see, and a chunk whose rows see
    none (60 queries over 20 keys) is skipped."""
    run = reference(SWA)
    run.__globals__.update(QUERY_CHUNK=16, MIN_WINDOW_CHUNK=4)
    case = RaggedCase(q_lens, kv_lens, window_left=window_left)
    q, k, v, qo_indptr, kv_indptr, window_left, sm_scale = make_inputs(case, "cpu", seed=9)
    output, lse = run(q, k, v, qo_indptr, kv_indptr, window_left, sm_scale)
    want = attention_fp64(q, k, v, q_lens, kv_lens, sm_scale, True, window_left)
    torch.testing.assert_close(output.double(), want[0], atol=1e-2, rtol=1e-2)
    assert torch.equal(lse.isinf(), want[1].isinf())
    torch.testing.assert_close(lse.double(), want[1], atol=1e-5, rtol=1e-5)


def test_sliding_window_of_0_is_each_rows_own_value():
    """window_left 0: a query sees only the key at its own position, so it returns that value."""
    case = RaggedCase((5,), (8,), window_left=0)
    q, k, v, qo, kv, window_left, scale = make_inputs(case, "cpu", seed=8)
    output, _ = reference(SWA)(q, k, v, qo, kv, window_left, scale)
    expected = v[3:8].repeat_interleave(4, dim=1)  # query i sits at key position i + 3
    torch.testing.assert_close(output, expected, atol=0, rtol=0)


@pytest.mark.parametrize("bad", [-2, 1.5, True, "4096", torch.tensor(3.0)])
def test_sliding_window_reference_rejects_bad_windows(bad):
    inputs = make_inputs(RaggedCase((3,), (3,), window_left=1), "cpu")
    inputs[5] = bad
    with pytest.raises((ValueError, TypeError), match="window_left"):
        reference(SWA)(*inputs)


def test_rows_without_keys_are_zero_not_nan():
    case = RaggedCase((6,), (2,))
    output, lse = reference(RAGGED)(*make_inputs(case, "cpu", seed=3))
    assert torch.all(output[:4] == 0) and torch.all(lse[:4] == -math.inf)
    assert torch.all(lse[4:].isfinite()) and not output.isnan().any()


def test_gqa_maps_query_head_to_kv_head_h_div_4():
    # Only KV head 5 carries a distinctive value; exactly query heads 20..23 must see it.
    case = PaddedCase(1, 4, 4, False)
    q, k, v, causal = make_inputs(case, "cpu", seed=4)
    v = torch.zeros_like(v)
    v[:, :, 5, :] = 1.0
    out = reference(MINI)(q, k, v, causal)
    heads_seeing_it = (out[0, 0, :, 0] == 1.0).nonzero().flatten().tolist()
    assert heads_seeing_it == [20, 21, 22, 23]


def test_lse_is_base_2():
    # One key: lse = log2(exp(scaled logit)) = logit / ln 2.
    case = RaggedCase((1,), (1,))
    q, k, v, qo, kv, scale = make_inputs(case, "cpu", seed=5)
    _, lse = reference(RAGGED)(q, k, v, qo, kv, scale)
    logit = (q[0].float() * k[0].float().repeat_interleave(4, dim=0)).sum(-1) * scale
    torch.testing.assert_close(lse[0], logit / math.log(2.0), atol=1e-5, rtol=1e-5)


# The fp64 comparison must catch a broken reference: each mutation below is a plausible bug.
MUTATIONS = {
    "top-left causal mask": ("query_pos + (seq_kv - seq_q)", "query_pos"),
    "natural-log lse": ("* log2_e).squeeze", "* 1.0).squeeze"),
    "wrong GQA mapping": ("heads = slice(kv_head * group_size", "heads = slice(0 * group_size"),
    "window one key short": ("last_key - window_left", "last_key - window_left + 1"),
    "window ignored": ("if window_left >= 0:", "if window_left >= 1 << 40:"),
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_fp64_check_rejects_a_broken_reference(mutation):
    old, new = MUTATIONS[mutation]
    source = load_definition(RAGGED).reference
    assert old in source
    namespace = {}
    exec(source.replace(old, new), namespace)
    case = RaggedCase((3, 8), (10, 8))
    q, k, v, qo, kv, scale = make_inputs(case, "cpu", seed=6)
    output, lse = namespace["ragged_attention"](q, k, v, qo, kv, scale, 2)
    want_out, want_lse = attention_fp64(q, k, v, case.q_lens, case.kv_lens, scale, True, 2)
    with pytest.raises(AssertionError):
        torch.testing.assert_close(output.double(), want_out, atol=1e-2, rtol=1e-2)
        torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


def test_padded_reference_without_keys_returns_zeros():
    case = PaddedCase(2, 5, 0, True)
    q, k, v, causal = make_inputs(case, "cpu", seed=2)
    out = reference(MINI)(q, k, v, causal)
    assert out.shape == q.shape and torch.all(out == 0)


@pytest.mark.parametrize(
    "definition, position, bad, argument",
    [
        (MINI, 3, "False", "causal"),
        (MINI, 3, 1, "causal"),
        (MINI, 1, torch.zeros(2, 7, 4, 128, dtype=torch.float16), "k"),
        (RAGGED, 3, torch.tensor([0, 5, 3], dtype=torch.int32), "qo_indptr"),
        (RAGGED, 4, torch.tensor([0, 3, 9], dtype=torch.int32), "kv_indptr"),
        (RAGGED, 2, torch.zeros(7, 8, 128, dtype=torch.bfloat16), "v"),
    ],
)
def test_references_reject_bad_arguments_by_name(definition, position, bad, argument):
    """ValueError, not assert: the checks hold under python -O too."""
    if definition == MINI:
        inputs = make_inputs(PaddedCase(2, 3, 7, True), "cpu")
    else:
        inputs = make_inputs(RaggedCase((1, 2), (3, 3)), "cpu")
    inputs[position] = bad
    with pytest.raises(ValueError, match=rf"^{argument}: expected"):
        reference(definition)(*inputs)


# ---- Paged definitions ---------------------------------------------------------------------

PAGED_CASES = [
    PagedCase((1,), (1,), 1),
    PagedCase((4, 0, 11), (4, 0, 70), 64),  # a sequence with no pages; last page of 6
    PagedCase((3, 8), (10, 2), 1),  # seq_q < seq_kv, then seq_q > seq_kv
    PagedCase((5, 2, 9), (129, 128, 65), 64, shared_prefix=(64, 64, 0)),  # last pages 1, 64, 1
    PagedCase((6, 2), (40, 33), 1, torch.float16, shared_prefix=(30, 30)),
]


def gathered_fp64(case, inputs):
    """The sequences' keys and values token by token (key j on page ids[j // page_size], slot
    j % page_size), then the fp64 attention."""
    q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices = inputs[:6]
    rows = []
    for s, kv_len in enumerate(case.kv_lens):
        ids = kv_indices[kv_indptr[s] : kv_indptr[s + 1]].tolist()
        rows += [(ids[j // case.page_size], j % case.page_size) for j in range(kv_len)]
    k = torch.stack([k_cache[p, t] for p, t in rows]) if rows else k_cache[:0, 0]
    v = torch.stack([v_cache[p, t] for p, t in rows]) if rows else v_cache[:0, 0]
    return attention_fp64(q, k, v, case.q_lens, case.kv_lens, inputs[-1], True)


@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: c.id)
def test_paged_reference_matches_fp64_on_gathered_pages(case):
    inputs = make_inputs(case, "cpu", seed=7)
    assert inputs[1].isnan().any()  # unused slots are NaN: the reference must not read them
    output, lse = reference(case.definition)(*inputs)
    want_out, want_lse = gathered_fp64(case, inputs)
    assert output.dtype == case.dtype and lse.dtype == torch.float32
    torch.testing.assert_close(output.double(), want_out, atol=1e-2, rtol=1e-2)
    assert torch.equal(lse.isinf(), want_lse.isinf())
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("case", PAGED_CASES, ids=lambda c: c.id)
def test_gathered_ragged_inputs_are_the_pages_keys_in_order(case):
    """testing.gathered_ragged_inputs (the ragged side of scripts/paged_vs_ragged.py): each
    sequence's keys, no unowned slot, and the ragged reference on them is the paged one's."""
    inputs = make_inputs(case, "cpu", seed=7)
    q, k, v, qo_indptr, kv_tokens, sm_scale = gathered_ragged_inputs(case, inputs)
    assert k.shape[0] == v.shape[0] == sum(case.kv_lens) and kv_tokens[-1] == k.shape[0]
    assert not k.isnan().any() and not v.isnan().any()
    paged_out, paged_lse = reference(case.definition)(*inputs)
    out, lse = reference(RAGGED)(q, k, v, qo_indptr, kv_tokens, sm_scale)
    torch.testing.assert_close(out, paged_out, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(lse, paged_lse, atol=1e-5, rtol=1e-5)


def test_paged_definitions_take_flashinfer_traces_inputs():
    """ps64 has kv_last_page_len, ps1 none (as FlashInfer-Trace v0.1.2 defines them)."""
    common = ["q", "k_cache", "v_cache", "qo_indptr", "kv_indptr", "kv_indices"]
    assert list(load_definition(PAGED_PS1).inputs) == common + ["sm_scale"]
    assert list(load_definition(PAGED_PS64).inputs) == common + ["kv_last_page_len", "sm_scale"]


@pytest.mark.parametrize(
    "position, bad, argument",
    [
        (5, torch.tensor([0, 1, 99], dtype=torch.int32), "kv_indices"),
        (6, torch.tensor([1, 65], dtype=torch.int32), "kv_last_page_len"),
        (6, torch.tensor([0, 3], dtype=torch.int32), "kv_last_page_len"),
        (4, torch.tensor([0, 2, 1], dtype=torch.int32), "kv_indptr"),
    ],
)
def test_paged_reference_rejects_bad_page_tables_by_name(position, bad, argument):
    inputs = make_inputs(PagedCase((2, 3), (64, 70), 64), "cpu")  # pages: 1 and 2
    inputs[position] = bad
    with pytest.raises(ValueError, match=rf"^{argument}: expected"):
        reference(PAGED_PS64)(*inputs)


# ---- FP8 (e4m3) paged caches -------------------------------------------------------------


@pytest.mark.parametrize("case", CPU_FP8_CASES, ids=lambda c: c.id)
def test_fp8_reference_matches_fp64_on_dequantized_pages(case):
    """The reference against fp64 attention over K = k_cache * k_scale, V = v_cache * v_scale
    (exact: every e4m3 value is a double), gathered token by token."""
    inputs = make_inputs(case, "cpu", seed=9)
    assert inputs[1].dtype == torch.float8_e4m3fn and inputs[1].float().isnan().any()
    k_scale, v_scale = case.fp8_scales
    output, lse = reference(PAGED_FP8)(*inputs)
    dequantized = [inputs[0], inputs[1].double() * k_scale, inputs[2].double() * v_scale,
                   *inputs[3:7], inputs[-1]]  # fmt: skip
    want_out, want_lse = gathered_fp64(case, dequantized)
    assert output.dtype == torch.bfloat16 and lse.dtype == torch.float32
    torch.testing.assert_close(output.double(), want_out, atol=1e-2, rtol=1e-2)
    assert torch.equal(lse.isinf(), want_lse.isinf())
    torch.testing.assert_close(lse.double(), want_lse, atol=1e-5, rtol=1e-5)
    # The scales matter: unit scales give another answer.
    unscaled, _ = reference(PAGED_FP8)(*inputs[:7], 1.0, 1.0, inputs[-1])
    assert not torch.allclose(unscaled.float(), output.float(), atol=1e-2, rtol=1e-2)


def test_fp8_definition_is_ps64_with_float8_caches_and_scales():
    fp8, ps64 = load_definition(PAGED_FP8), load_definition(PAGED_PS64)
    assert list(fp8.inputs) == ["q", "k_cache", "v_cache", "qo_indptr", "kv_indptr",
                                "kv_indices", "kv_last_page_len", "k_scale", "v_scale",
                                "sm_scale"]  # fmt: skip
    for name in ("k_cache", "v_cache"):
        assert fp8.inputs[name].dtype.value == "float8_e4m3fn"
        assert fp8.inputs[name].shape == ps64.inputs[name].shape
    assert fp8.outputs == ps64.outputs and fp8.axes == ps64.axes


@pytest.mark.parametrize(
    "position, bad, argument",
    [(7, float("nan"), "k_scale"), (8, "1.0", "v_scale"), (1, "bf16 cache", "k_cache")],
)
def test_fp8_reference_rejects_bad_scales_and_caches(position, bad, argument):
    inputs = make_inputs(CPU_FP8_CASES[0], "cpu")
    if bad == "bf16 cache":
        bad = inputs[1].to(torch.bfloat16)
    inputs[position] = bad
    with pytest.raises(ValueError, match=rf"^{argument}: expected"):
        reference(PAGED_FP8)(*inputs)


@pytest.mark.parametrize(
    "seq_q, seq_kv, window_left",
    [(100, 100, -1), (100, 100, 0), (37, 300, 5), (300, 40, -1), (64, 64, 64), (70, 200, 130)],
)
@pytest.mark.parametrize("tile_tokens, tile_keys", [(32, 128), (64, 64), (16, 64)])
def test_tiled_pairs_counts_the_key_tiles_a_mask_touches(seq_q, seq_kv, window_left, tile_tokens,
                                                         tile_keys):  # fmt: skip
    """tiled_pairs against the mask itself: every (query tile, key tile) with a visible pair."""
    from prefill_bundle.report import tiled_pairs, visible_pairs

    position = torch.arange(seq_q)[:, None] + seq_kv - seq_q
    key = torch.arange(seq_kv)[None, :]
    mask = key <= position
    if window_left >= 0:
        mask &= key >= position - window_left
    expected = 0
    for first in range(0, seq_q, tile_tokens):
        for k0 in range(0, seq_kv, tile_keys):
            if mask[first : first + tile_tokens, k0 : k0 + tile_keys].any():
                expected += tile_tokens * tile_keys
    got = tiled_pairs(seq_q, seq_kv, tile_tokens, tile_keys, window_left)
    assert got == expected
    assert int(mask.sum()) == visible_pairs(seq_q, seq_kv, True, window_left) <= got
