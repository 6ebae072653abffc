"""The analysis scripts that need no GPU: issue_bars.py (which workloads each issue's bar
covers, and the ratios it judges, read from the committed traces the way report.md's are) and
item_balance.py (how the Gluon kernels' item orders load the CTAs), and the CPU-side pieces of
the GPU scripts."""

import json
import os
from collections import Counter
from unittest import mock

import pytest
import torch
from flashinfer_bench import TraceSet

from prefill_bundle import MINI, PAGED_FP8, PAGED_PS1, PAGED_PS64, RAGGED, REPO_ROOT, SWA
from prefill_bundle.report import with_run
from prefill_bundle.testing import PaddedCase, load_script, padded_case

bars_script = load_script("issue_bars")


def test_each_bar_covers_the_workloads_its_issue_names():
    bars = bars_script.bars
    # 16: every backend >= 0.8 everywhere; >= 4096 KV tokens, CUDA / TileLang 1.1, Triton 0.9.
    assert bars(PAGED_PS1, "chunked_prefill_2k_over_8k_ps1", "triton") == [(16, 0.8), (16, 0.9)]
    assert bars(PAGED_PS64, "prefix_cache_hits_8x256_ps64", "tilelang") == [(16, 0.8), (16, 1.1)]
    assert bars(PAGED_PS64, "prefix_cache_hits_8x256_ps64", "sdpa") == [(16, 0.8)]
    # 18: 1.3 and 1.0 on the long workloads (16 single-token rows over 4-16K keys are long).
    assert bars(PAGED_FP8, "single_token_rows_16_fp8kv", "cuda") == [(18, 0.8), (18, 1.3)]
    assert bars(PAGED_FP8, "fresh_prompt_8k_fp8kv", "triton") == [(18, 0.8), (18, 1.0)]
    # 17: every window workload, whatever its length.
    assert bars(SWA, "mixed_short_and_long_window_128", "cuda") == [(17, 1.0)]
    assert bars(SWA, "prompt_8k_window_1024", "triton") == [(17, 0.8)]
    # 19: 2K or more tokens a sequence (padded), 4096 or more tokens (ragged); Triton on the
    # three big padded configurations only; nothing on the short shapes or the FA-2 baselines.
    assert bars(MINI, "long_b1_q16384_kv16384_noncausal", "tilelang") == [(19, 1.05)]
    assert bars(MINI, "long_b1_q8192_kv8192_causal", "triton") == [(19, 0.9)]
    assert bars(MINI, "asymmetric_b4_q128_kv2048_causal", "cuda") == []
    assert bars(MINI, "medium_b4_q512_kv512_causal", "triton") == []
    assert bars(RAGGED, "prompt_8k", "cuda") == [(19, 1.05)]
    assert bars(RAGGED, "prompt_8k", "triton") == []
    assert bars(RAGGED, "chunked_prefill_with_prefix", "cuda") == []  # 3328 keys


def test_ratios_are_report_mds():
    """Every ratio judged is the one report.md prints for that workload and solution (both from
    traces/, by separate code), and a FAIL is a ratio under its bar."""
    found, _ = bars_script.checks(TraceSet.from_path(str(REPO_ROOT)))
    assert {c.issue for c in found} == {16, 17, 18, 19}
    report = (REPO_ROOT / "report.md").read_text()
    tables = {}
    for section in report.split("\n## ")[1:]:
        title, *lines = section.split("\n")
        rows = [line.split(" | ") for line in lines if line.startswith("| ")]
        if rows:
            header = [cell.strip("| ") for cell in rows[0]]
            tables[title] = {r[0].strip("| "): dict(zip(header, r)) for r in rows[1:]}
    for c in found:
        cell = tables[c.definition][c.workload][c.solution]
        assert f"**{c.ratio:.2f}×**" in cell, (c, cell)
        assert c.ok == (c.ratio >= c.bar)


def test_another_runs_traces_are_judged_in_place_of_the_committed_ones(tmp_path):
    """issue_bars.py --traces (report.with_run): the definitions a run's folder holds are judged
    on its traces alone (here the committed window traces with FlashInfer's latencies doubled,
    so every ratio of that definition doubles), every other definition on the committed ones;
    a folder with a trace twice, with an unknown definition, or with no traces is refused."""
    committed = TraceSet.from_path(str(REPO_ROOT))
    before = {(c.definition, c.workload, c.solution, c.bar): c.ratio
              for c in bars_script.checks(committed)[0]}  # fmt: skip
    lines = []
    for t in committed.traces[SWA]:
        record = t.model_dump(mode="json")
        if record["solution"] == "flashinfer_swa":
            record["evaluation"]["performance"]["latency_ms"] *= 2
        lines.append(json.dumps(record))
    (tmp_path / "gqa_ragged").mkdir()
    (tmp_path / "gqa_ragged" / f"{SWA}.jsonl").write_text("\n".join(lines) + "\n")
    run = with_run(TraceSet.from_path(str(REPO_ROOT)), tmp_path)
    after = {(c.definition, c.workload, c.solution, c.bar): c.ratio
             for c in bars_script.checks(run)[0]}  # fmt: skip
    assert after.keys() == before.keys()
    for key, ratio in after.items():
        expected = 2 * before[key] if key[0] == SWA else before[key]
        assert abs(ratio - expected) < 1e-9 * expected, key
    (tmp_path / "again.jsonl").write_text(lines[0] + "\n")
    with pytest.raises(ValueError, match="twice"):
        with_run(TraceSet.from_path(str(REPO_ROOT)), tmp_path)
    (tmp_path / "again.jsonl").write_text(lines[0].replace(SWA, "no_such_definition") + "\n")
    with pytest.raises(ValueError, match="unknown definitions"):
        with_run(TraceSet.from_path(str(REPO_ROOT)), tmp_path)
    with pytest.raises(ValueError, match="no .jsonl traces"):
        with_run(TraceSet.from_path(str(REPO_ROOT)), tmp_path / "gqa_paged")


def test_item_balance_counts_the_kernels_items():
    """scripts/item_balance.py: one work entry per item the Gluon kernels number (slots x 32
    heads, spare slots 0), key tiles + 1 each; equal items balance alike either way, and a
    first-free hand-out is never worse than the round robin on the committed workloads."""
    balance = load_script("item_balance")
    # Two sequences of 200 and 56 queries over 300 and 56 keys: slots 0-1 (sequence 0) and 2
    # (sequence 1, starting at token 200 // 128 + 1), 3 slots x 32 heads, the last slot first.
    work = balance.item_work((200, 56), (300, 56))
    assert len(work) == (256 // 128 + 2) * 32
    # slot 3: spare; slot 2: sequence 1 (1 tile); slot 1: sequence 0's block 1 (rows 128-199
    # see up to key 299: 3 tiles); slot 0: its block 0 (rows 0-127 see up to key 227: 2 tiles).
    assert work == [0] * 32 + [2] * 32 + [4] * 32 + [3] * 32
    assert balance.balance((1024,) * 4, (1024,) * 4, 132)[1] <= 1.1
    equal = balance.item_work((128,) * 33, (128,) * 33)  # 33 slots of one tile + 1 spare
    assert balance.round_robin(equal, 4) == balance.first_free(equal, 4)
    from prefill_bundle.workloads import PAGED_BATCHES, RAGGED_BATCHES

    for batch in RAGGED_BATCHES + PAGED_BATCHES:
        rr, ff = balance.balance(batch.q_lens, batch.kv_lens, 132)
        assert 1.0 <= ff <= rr, batch.name


def test_compare_gpu_names_each_case_by_its_workload():
    """compare_gpu.py --workloads: every ragged, window and paged case carries its workload's
    name (the padded shapes have none), one case per workload of each definition."""
    compare = load_script("compare_gpu")
    for definition, (_, cases) in compare.CASES.items():
        names = [compare.WORKLOAD_OF.get(case.id) for case in cases]
        if definition == MINI:
            assert names == [None] * len(cases)
            continue
        assert None not in names and len(set(names)) == len(cases), definition
    fp8 = [compare.WORKLOAD_OF[case.id] for case in compare.CASES[PAGED_FP8][1]]
    assert "single_token_rows_16" in fp8


def test_padded_shapes_of_the_gpu_scripts():
    """compare_gpu.py --padded and short_key_tiles.py --shapes: BATCHxKEYS is non-causal with
    seq_q = seq_kv, -causal makes it causal; anything else is refused by name."""
    assert padded_case("4x512") == PaddedCase(4, 512, 512, False)
    assert padded_case("1x8192-causal") == PaddedCase(1, 8192, 8192, True)
    assert padded_case("2x64", torch.bfloat16) == PaddedCase(2, 64, 64, False, torch.bfloat16)
    for bad in ("4x512-full", "4by512", "4x5x12", "x512"):
        with pytest.raises(ValueError):
            padded_case(bad)
    assert load_script("compare_gpu").padded_case is padded_case


def test_fp8_quantized_products_emulates_what_it_says():
    """scripts/fp8_quantized_products.py: its exact mode is the softmax reference, its one-term
    q is e4m3 per element (rows scaled into [128, 256)), and P in e4m3 fails flashinfer-bench's
    check on a row of two keys where the exact products pass."""
    emulation = load_script("fp8_quantized_products")
    torch.manual_seed(0)
    q, k, v = torch.randn(5, 4, 128), torch.randn(9, 128), torch.randn(9, 128)
    last_key = torch.tensor([4, 5, 6, 7, 8])
    scores = torch.einsum("rhd,nd->rhn", q, k) * 0.1
    hidden = torch.arange(9)[None, :] > last_key[:, None]
    probs = scores.masked_fill(hidden[:, None, :], float("-inf")).softmax(-1)
    expected = torch.einsum("rhn,nd->rhd", probs, v)
    torch.testing.assert_close(emulation.attend(q, k, v, last_key, 0.1, "exact"), expected)

    rounded = emulation.q_one_e4m3_term(q.reshape(20, 128))
    scale = torch.exp2(7 - torch.floor(torch.log2(q.reshape(20, 128).abs().amax(-1))))[:, None]
    assert torch.equal((rounded * scale).to(torch.float8_e4m3fn).float(), rounded * scale)
    assert ((rounded * scale).abs().amax(-1) >= 128).all()
    assert ((rounded * scale).abs().amax(-1) <= 256).all()
    assert not torch.equal(rounded, q.reshape(20, 128))

    # Two keys: P = (1, 0.55), e4m3 holds 0.5625; V = -2.5 and 2.5: O moves by 0.02 (2.8%).
    k2 = torch.zeros(2, 128)
    k2[1, 0] = torch.log(torch.tensor(0.55))
    q2 = torch.zeros(1, 1, 128)
    q2[0, 0, 0] = 1.0
    v2 = torch.stack([torch.full((128,), -2.5), torch.full((128,), 2.5)])
    row = torch.tensor([1])
    ref = emulation.attend(q2, k2, v2, row, 1.0, "exact")
    assert emulation.flashinfer_bench_fails(ref.bfloat16().float(), ref) == 0
    p8 = emulation.attend(q2, k2, v2, row, 1.0, "p8").bfloat16().float()
    assert emulation.flashinfer_bench_fails(p8, ref) == 128


def test_nan_slots_to_zero_clears_every_float_input_and_keeps_the_rest():
    """The timing scripts' inputs for FlashInfer (which reads a paged cache's unused slots):
    NaN becomes 0 in 16-bit and float8 caches alike, values and index tensors are kept."""
    from prefill_bundle.testing import PagedCase, make_inputs, nan_slots_to_zero

    for scales in ((), (0.5, 1.25)):
        case = PagedCase((3, 1), (70, 200), 64, torch.bfloat16, fp8_scales=scales)
        inputs = make_inputs(case, "cpu", seed=0)
        cleared = nan_slots_to_zero(inputs)
        caches = [x for x in inputs if torch.is_tensor(x) and x.dim() == 4]
        assert any(x.float().isnan().any() for x in caches)  # the unused slots, to clear
        for before, after in zip(inputs, cleared):
            if not torch.is_tensor(before):
                assert after == before
                continue
            assert after.dtype == before.dtype and after.shape == before.shape
            if before.is_floating_point():
                assert not after.float().isnan().any()
                kept = ~before.float().isnan()
                assert torch.equal(after.float()[kept], before.float()[kept])
            else:
                assert torch.equal(after, before)


def test_decode_ceiling_probes_compute_what_they_say():
    """scripts/decode_ceiling.py on the CPU (the interpreter): read_pages sums exactly the K and
    V rows of the page table's pages, whatever the heads a program or the launch order, and the
    lean split-KV decode probe matches the reference on single-token rows over FP8 and bf16
    caches (3 shares, empty ones included: a 1-key sequence; 1 share: three tiles in one
    program's loop), with triton's casts to bf16 and f16."""
    import triton

    from prefill_bundle.testing import (
        PagedCase,
        make_inputs,
        nan_slots_to_zero,
        normwise_error,
        poisoned_outputs,
        reference_outputs,
    )

    probe = load_script("decode_ceiling")
    for scales in ((0.5, 2.0), ()):
        case = PagedCase((1, 1, 1), (150, 1, 97), 64, fp8_scales=scales)
        inputs = make_inputs(case, "cpu", seed=3)
        k, v, pages = nan_slots_to_zero(inputs)[1:3] + [inputs[5]]  # the unused slots hold NaN
        expected_sum = (k[pages.long()].float() + v[pages.long()].float()).sum()
        for heads, fastest in ((1, False), (2, True), (8, False)):
            grid = triton.cdiv(pages.numel(), 2) * (8 // heads)
            out = torch.full((grid,), float("nan"))
            probe.read_pages[(grid,)](k, v, pages, out, pages.numel(), PAGES_A_PROGRAM=2,
                                      HEADS_A_PROGRAM=heads, HEADS_FASTEST=fastest)  # fmt: skip
            torch.testing.assert_close(out.sum(), expected_sum, rtol=1e-5, atol=1e-2)
        expected = reference_outputs(case, inputs)
        conversions = (probe.CAST_BF16, probe.CAST_F16) if scales else (probe.CAST_BF16,)
        for conversion, shares in zip(conversions, (3, 1)):  # 1: a program's tiles in a loop
            outputs = poisoned_outputs(case, inputs)
            probe.lean_call(inputs, shares, 64, conversion, outputs)
            assert normwise_error(outputs[0], expected[0]) < 1e-2
            torch.testing.assert_close(outputs[1], expected[1], rtol=0, atol=1e-3)


def test_decode_sweep_builds_decode_like_fp8_batches(monkeypatch):
    """decode_sweep.py's grid: FP8 page-64 batches of at most 4 query tokens a sequence (the
    decode paths' batches), ragged context lengths in [mean / 2, 3 mean / 2], larger batches
    than --max-keys left out."""
    monkeypatch.syspath_prepend(str(REPO_ROOT / "scripts"))  # it imports compare_gpu
    sweep = load_script("decode_sweep")
    labelled = sweep.sweep_cases([1, 4, 64], [1024, 16384], [1, 4], max_keys=1 << 18)
    assert [label for label, _ in labelled] == [
        (b, m, t) for b in (1, 4, 64) for m in (1024, 16384) for t in (1, 4) if b * m <= 1 << 18
    ]
    for (batch, mean, tokens), case in labelled:
        assert case.definition == PAGED_FP8 and case.page_size == 64
        assert case.q_lens == (tokens,) * batch
        assert all(mean // 2 <= keys <= mean * 3 // 2 for keys in case.kv_lens)
        assert batch == 1 or len(set(case.kv_lens)) > 1  # ragged, as a server's batches are


def test_adapter_cost_times_both_adapters_serving():
    costs = load_script("adapter_cost").main(["--calls", "20", "--rounds", "1"])
    assert set(costs) == {"flashinfer-bench", "bundle"}
    assert all(0 < cost < 1e5 for cost in costs.values())


def test_short_key_tiles_forces_each_call_and_tabulates():
    """scripts/short_key_tiles.py: each timed call sets PREFILL_BUNDLE_SHORT_KEY_TILES itself
    (the CUDA entry reads it per call, and the calls alternate), and the table shows the rows."""
    script = load_script("short_key_tiles")
    seen = []
    calls = {t: script.forced(lambda: seen.append(os.environ["PREFILL_BUNDLE_SHORT_KEY_TILES"]),
                              mode) for t, mode in script.TILES.items()}  # fmt: skip
    with mock.patch.dict(os.environ):
        for tiles in ("128", "192", "128"):
            calls[tiles]()
    assert seen == ["1", "0", "1"]
    row = ("4x512", 0.047, {"192": 0.0514, "128": 0.0417}, {"192": 0.913, "128": 1.118},
           {"192": 3.2e-4, "128": 3.3e-4})  # fmt: skip
    text = script.table([row])
    assert "| 4x512 | 47.0 | 51.4 | 41.7 | 0.913 | 1.118 | 3.2e-04 / 3.3e-04 |" in text


def test_call_arguments_poison_only_what_the_solution_writes_into():
    from types import SimpleNamespace

    from prefill_bundle.testing import RaggedCase, call_arguments, make_inputs

    for case in (PaddedCase(1, 5, 7, True), RaggedCase((3, 0), (4, 2))):
        inputs = make_inputs(case, "cpu", seed=0)
        writer = SimpleNamespace(metadata=SimpleNamespace(destination_passing_style=True))
        returner = SimpleNamespace(metadata=SimpleNamespace(destination_passing_style=False))
        assert call_arguments(returner, case, inputs) == inputs
        args = call_arguments(writer, case, inputs)
        assert args[: len(inputs)] == inputs
        outputs = args[len(inputs) :]
        assert len(outputs) == (1 if isinstance(case, PaddedCase) else 2)  # output (and lse)
        assert outputs[0].shape == inputs[0].shape and outputs[0].isnan().all()


def test_inference_loop_chat_rotates_its_arms_and_plans_at_once_in_one(monkeypatch):
    """prefix_cache_chat: every arm once a round, the order rotated; apply on around the two
    bundle arms and FlashInfer's own methods for the other; PREFILL_BUNDLE_DEFER_PLAN=0 in the
    plan-at-once arm only (and restored after it); medians of end to end, plan and run."""
    loop = load_script("inference_loop")
    log, arm = [], {}

    class Chat:
        def __init__(self, model, page_size):
            pass

        def run(self, wrapper_for_step):
            log.append(("chat", arm["label"], os.environ.get("PREFILL_BUNDLE_DEFER_PLAN")))
            if isinstance(wrapper_for_step, loop.TimedSteps):
                wrapper_for_step.times.update(plan=[0.5], run=[1.5])
            return torch.ones(2)

    def enable(names=None):
        arm["label"] = "bundle-ish"
        log.append(("on",))
        return object()  # the runtime

    def plain():
        arm["label"] = "flashinfer"
        log.append(("plain",))

    monkeypatch.setattr(loop, "PagedChat", Chat)
    monkeypatch.setattr(loop, "enable_bundle_apply", enable)
    monkeypatch.setattr(loop, "disable_apply", lambda: log.append(("off",)))
    monkeypatch.setattr(loop, "without_adapters", plain)
    monkeypatch.setattr(loop, "record_dispatches", lambda runtime: (Counter(), lambda: None))
    monkeypatch.setattr(loop.torch.cuda, "synchronize", lambda: None)
    monkeypatch.delenv("PREFILL_BUNDLE_DEFER_PLAN", raising=False)
    medians, e2e, _, errors = loop.prefix_cache_chat(None, 64, rounds=3)
    assert "PREFILL_BUNDLE_DEFER_PLAN" not in os.environ
    assert set(medians) == set(loop.CHAT_ARMS) and all(len(v) == 3 for v in e2e.values())
    assert all(m[1:] == (0.5, 1.5) for m in medians.values())
    assert set(errors) == {"bundle", loop.AT_ONCE} and errors["bundle"] == 0.0
    # Three chats an arm (warm-up, timed end to end, timed steps), arms rotated a place a round.
    chats = [entry for entry in log if entry[0] == "chat"]
    assert len(chats) == 3 * 3 * 3
    defer = [entry[2] for entry in chats]
    firsts = [defer[i] for i in range(0, 27, 9)]  # each round's first arm
    assert firsts == ["1", "1", "0"]  # flashinfer, bundle, plan at once: rotated
    assert defer.count("0") == 9 and all(e[1] == "bundle-ish" for e in chats if e[2] == "0")
    assert log.count(("on",)) == 6 and log.count(("off",)) == 6 and log.count(("plain",)) == 3


def test_inference_loop_rotates_the_stream_arms_and_takes_medians(monkeypatch):
    """stream_times: each arm warmed up once, then each round every arm once, the order rotated
    a place a round; apply enabled (the whole bundle or the arm's solutions) only around its
    own arms' runs, FlashInfer's unpatched methods for the others; medians of the rounds."""
    loop = load_script("inference_loop")
    log, seconds = [], {"fi": iter([9, 3, 1, 2]), "bundle": iter([9, 5, 4, 6]),
                        "cuda": iter([9, 7, 8, 9])}  # fmt: skip
    attention = {"fi": object(), "bundle": object(), "cuda": object()}
    label_of = {id(fn): label for label, fn in attention.items()}

    def run_stream(model, stream, make_attention):
        log.append(("run", label_of[id(make_attention)]))
        return next(seconds[label_of[id(make_attention)]])

    monkeypatch.setattr(loop, "run_stream", run_stream)
    monkeypatch.setattr(loop, "enable_bundle_apply", lambda names=None: log.append(("on", names)))
    monkeypatch.setattr(loop, "disable_apply", lambda: log.append(("off",)))
    monkeypatch.setattr(loop, "without_adapters", lambda: log.append(("plain",)))
    arms = {"fi": (attention["fi"], None), "bundle": (attention["bundle"], "every"),
            "cuda": (attention["cuda"], ["cuda_mini", "cuda_ragged"])}  # fmt: skip
    medians = loop.stream_times(None, [], arms, rounds=3)
    assert medians == {"fi": 2, "bundle": 5, "cuda": 8}
    runs = [entry[1] for entry in log if entry[0] == "run"]
    assert runs == ["fi", "bundle", "cuda"] + ["fi", "bundle", "cuda"] + \
        ["bundle", "cuda", "fi"] + ["cuda", "fi", "bundle"]  # fmt: skip
    # Around every run of an apply arm: on (its solutions) before, off after; FlashInfer's own
    # methods restored before every run of the arm without apply.
    for i, entry in enumerate(log):
        if entry == ("run", "bundle"):
            assert log[i - 1] == ("on", None) and log[i + 1] == ("off",)
        elif entry == ("run", "cuda"):
            assert log[i - 1] == ("on", ["cuda_mini", "cuda_ragged"]) and log[i + 1] == ("off",)
        elif entry == ("run", "fi"):
            assert log[i - 1] == ("plain",) and log[i + 1 : i + 2] != [("off",)]
