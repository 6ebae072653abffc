"""A prefill serving loop with Llama-3.1-8B attention geometry (32 query heads, 8 KV heads,
head_dim 128, hidden 4096), random weights, attention through flashinfer-bench's apply.

On the GPU, from the repository root (traces/ must hold the bundle's traces):
    python scripts/inference_loop.py [--layers 4] [--batches 24]

Prints: which solution serves each bucket; end-to-end time of the stream with the bundle, with
each backend alone, fallback-only (torch SDPA) and FlashInfer-only; apply's per-call dispatch
overhead; the FlashInfer drop-in (BatchPrefillWithRaggedKVCacheWrapper served by the bundle);
and a prefix-cache chat (a shared system prompt in a paged cache, multi-turn follow-ups) through
FlashInfer's BatchPrefillWithPagedKVCacheWrapper, with and without the bundle behind it (its
adapters defer FlashInfer's plan() to a fallback), and with the bundle and FlashInfer's plan()
run at once (PREFILL_BUNDLE_DEFER_PLAN=0).
"""

import argparse
import io
import math
import os
import statistics
import time
from collections import Counter
from contextlib import contextmanager, redirect_stdout
from unittest import mock

import flashinfer
import torch
from flashinfer_bench.apply import apply, disable_apply
from flashinfer_bench.integration.patch_manager import get_manager

from prefill_bundle import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, RAGGED
from prefill_bundle.gpu_timing import host_us
from prefill_bundle.serving import (
    allocate_outputs,
    dispatch_table,
    enable_bundle_apply,
    output_allocation,
)
from prefill_bundle.testing import build_solution, load_definition, normwise_error
from prefill_bundle.workloads import lengths_to_indptr

HIDDEN = NUM_HEADS * HEAD_DIM
SM_SCALE = 1.0 / math.sqrt(HEAD_DIM)
SDPA = build_solution("sdpa_ragged")  # the fallback: torch's own varlen flash kernel


@apply(RAGGED)
def ragged_attention(q, k, v, qo_indptr, kv_indptr, sm_scale):
    return SDPA(q, k, v, qo_indptr, kv_indptr, sm_scale)


def prompt_stream(batches: int, seed: int = 0):
    """Batches of 1-16 prompts, lengths log-uniform in [1, 4096]."""
    gen = torch.Generator().manual_seed(seed)
    stream = []
    for _ in range(batches):
        size = int(torch.randint(1, 17, (1,), generator=gen))
        lengths = torch.exp(torch.rand(size, generator=gen) * math.log(4096)).long().clamp(1)
        stream.append(lengths.tolist())
    return stream


class Model:
    def __init__(self, layers: int):
        gen = torch.Generator(device="cuda").manual_seed(1)
        kv = NUM_KV_HEADS * HEAD_DIM

        def weight(rows, cols):
            w = torch.randn(rows, cols, generator=gen, device="cuda") / math.sqrt(rows)
            return w.to(torch.bfloat16)

        self.layers = [
            (weight(HIDDEN, HIDDEN + 2 * kv), weight(HIDDEN, HIDDEN)) for _ in range(layers)
        ]

    def forward(self, x, attention):
        kv = NUM_KV_HEADS * HEAD_DIM
        for w_qkv, w_out in self.layers:
            qkv = x @ w_qkv
            q = qkv[:, :HIDDEN].reshape(-1, NUM_HEADS, HEAD_DIM)
            k = qkv[:, HIDDEN : HIDDEN + kv].reshape(-1, NUM_KV_HEADS, HEAD_DIM).contiguous()
            v = qkv[:, HIDDEN + kv :].reshape(-1, NUM_KV_HEADS, HEAD_DIM).contiguous()
            out = attention(q.contiguous(), k, v)
            x = x + out.reshape(-1, HIDDEN) @ w_out
        return x


def run_stream(model, stream, make_attention):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for lengths in stream:
        indptr = lengths_to_indptr(lengths).cuda()
        x = torch.randn(sum(lengths), HIDDEN, device="cuda", dtype=torch.bfloat16)
        model.forward(x, make_attention(indptr))
    torch.cuda.synchronize()
    return time.perf_counter() - start


def without_adapters():
    """FlashInfer's wrappers as a process without the bundle has them. The adapters an earlier
    enable_bundle_apply() installed on their plan() and run() stay after disable_apply()
    (flashinfer-bench never unpatches; with apply off they fall back to FlashInfer's own
    methods, ~0.1 ms of Python a batch): an arm of FlashInfer alone restores the originals
    first, and the next enable_bundle_apply() installs the adapters again."""
    get_manager().unpatch_all()


@contextmanager
def apply_for_arm(solutions):
    """An arm's runs: solutions None: apply off and FlashInfer's own methods
    (without_adapters); "every": apply over the whole bundle; a list: over those solutions.
    Yields apply's runtime (None when off); apply is disabled after. flashinfer-bench prints a
    line each time it installs its integrations; the arms' installs are kept quiet (main's first
    one prints it)."""
    if solutions is None:
        without_adapters()
        yield None
        return
    with redirect_stdout(io.StringIO()):
        runtime = enable_bundle_apply(None if solutions == "every" else solutions)
    try:
        yield runtime
    finally:
        disable_apply()


def rotated(labels, round_):
    """labels rotated a place a round, so no arm always runs first or after the same one."""
    shift = round_ % len(labels)
    return labels[shift:] + labels[:shift]


STREAM_ROUNDS = 5  # the stream's arms run in rotated order this many times; medians


def stream_times(model, stream, arms, rounds=STREAM_ROUNDS):
    """Median end-to-end seconds of the stream per arm. arms: label -> (make_attention, the
    solutions apply may route to: apply_for_arm's). Each arm is warmed up once (JIT, plans,
    builds), then every round runs each arm once, the order rotated."""

    def run(make_attention, solutions):
        with apply_for_arm(solutions):
            return run_stream(model, stream, make_attention)

    labels = list(arms)
    for label in labels:
        run(*arms[label])
    times = {label: [] for label in labels}
    for round_ in range(rounds):
        for label in rotated(labels, round_):
            times[label].append(run(*arms[label]))
    return {label: statistics.median(seconds) for label, seconds in times.items()}


def through_apply(indptr):
    return lambda q, k, v: ragged_attention(q, k, v, indptr, indptr, SM_SCALE)[0]


_wrappers = {}


def flashinfer_wrapper(cls):
    """The one wrapper of FlashInfer class `cls` this process keeps, as a server does (built
    once with its workspace; planned per batch)."""
    if cls not in _wrappers:
        workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
        _wrappers[cls] = cls(workspace, "NHD", backend="fa3")
    return _wrappers[cls]


def flashinfer_only(indptr):
    """What a FlashInfer user runs: plan once per batch, run once per layer."""
    wrapper = flashinfer_wrapper(flashinfer.BatchPrefillWithRaggedKVCacheWrapper)
    wrapper.plan(indptr, indptr, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, causal=True,
                 sm_scale=SM_SCALE, q_data_type=torch.bfloat16)  # fmt: skip
    return lambda q, k, v: wrapper.run(q, k, v)


def record_dispatches(runtime):
    """(served, stop): stop() fills served with the solution each call through the runtime ran
    since (its `served` counter); nothing when runtime is None (apply off)."""
    before = Counter(runtime.served) if runtime is not None else Counter()
    served = Counter()

    def stop():
        if runtime is not None:
            served.update(runtime.served - before)

    return served, stop


def dispatch_overhead(runtime, rounds=40, burst=100):
    """Host microseconds per 1-token call through apply, and calling the solution apply routes
    it to directly, its outputs allocated as apply's route allocates them. Measured in bursts of
    `burst` calls after a synchronize (gpu_timing.host_us), short enough that the launch queue
    never fills, so the host's time is what is on the clock whatever the kernel's; the two
    interleaved burst by burst, medians over `rounds`. (Timing thousands of calls back to back
    measures the GPU instead once the queue is full, and both arms then read the kernel's
    time.)"""
    q = torch.randn(1, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(1, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    indptr = lengths_to_indptr([1]).cuda()
    args = (q, k, k, indptr, indptr, SM_SCALE)
    served, restore = record_dispatches(runtime)
    ragged_attention(*args)
    restore()
    name = next(iter(served))
    runnable = build_solution(name)
    allocation = output_allocation(load_definition(RAGGED))

    def direct(*arguments):
        outputs = allocate_outputs(allocation, arguments[0])
        runnable.call_destination_passing(*arguments, *outputs)
        return outputs

    timings = {"apply": [], "direct": []}
    for _ in range(rounds):
        for label, fn in (("apply", ragged_attention), ("direct", direct)):
            timings[label].append(host_us(lambda fn=fn: fn(*args), calls=burst))
    return name, statistics.median(timings["apply"]), statistics.median(timings["direct"])


def drop_in(stream):
    """FlashInfer's own wrapper, plan + run, transparently served by the bundle under apply."""
    lengths = stream[0]
    indptr = lengths_to_indptr(lengths).cuda()
    total = sum(lengths)
    q = torch.randn(total, NUM_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(total, NUM_KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
    v = torch.randn_like(k)
    without_adapters()
    reference = flashinfer_only(indptr)(q, k, v)
    runtime = enable_bundle_apply()
    served, restore = record_dispatches(runtime)
    try:
        workspace = torch.empty(128 * 1024 * 1024, dtype=torch.uint8, device="cuda")
        wrapper = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(workspace, "NHD", backend="fa3")
        wrapper.plan(indptr, indptr, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, causal=True,
                     sm_scale=SM_SCALE, q_data_type=torch.bfloat16)  # fmt: skip
        out = wrapper.run(q, k, v)
    finally:
        restore()
        disable_apply()
    del runtime
    error = normwise_error(out, reference)
    return lengths, dict(served), error


class PagedChat:
    """Conversations over one paged KV cache per layer, FlashInfer's layout [pages, 2, page_size,
    8, 128] (k_cache and v_cache are its strided halves). A system prompt is prefilled once and
    its pages (whole pages: 2048 tokens) shared by every conversation; each turn appends every
    conversation's new message and runs prefill over its whole history, through
    BatchPrefillWithPagedKVCacheWrapper."""

    def __init__(self, model, page_size, conversations=6, system_prompt=2048, seed=2):
        self.model, self.page_size = model, page_size
        gen = torch.Generator().manual_seed(seed)
        self.turns = [torch.randint(24, 400, (conversations,), generator=gen).tolist()
                      for _ in range(3)]  # fmt: skip
        tokens = system_prompt + sum(map(sum, self.turns))
        num_pages = tokens // page_size + conversations + 4
        self.free = torch.randperm(num_pages, generator=gen).tolist()  # an allocator's pool
        shape = (num_pages, 2, page_size, NUM_KV_HEADS, HEAD_DIM)
        self.caches = [
            torch.zeros(shape, device="cuda", dtype=torch.bfloat16) for _ in model.layers
        ]
        self.system_prompt, self.conversations = system_prompt, conversations

    def run(self, wrapper_for_step):
        """Prefill the system prompt once, then every turn; returns the last turn's output."""
        system = self._grow([[]], [self.system_prompt])[0]
        histories = [(list(system), self.system_prompt) for _ in range(self.conversations)]
        gen = torch.Generator(device="cuda").manual_seed(3)
        outputs = self._step([(list(system), 0)], [self.system_prompt], wrapper_for_step, gen)
        for lengths in self.turns:
            outputs = self._step(histories, lengths, wrapper_for_step, gen)
        return outputs

    def _grow(self, pages_of, new_tokens, used=None):
        """Pages for new tokens after `used` tokens already cached (shared full pages stay)."""
        used = used or [0] * len(pages_of)
        grown = []
        for pages, n, u in zip(pages_of, new_tokens, used):
            pages = list(pages)
            while len(pages) * self.page_size < u + n:
                pages.append(self.free.pop())
            grown.append(pages)
        return grown

    def _step(self, histories, lengths, wrapper_for_step, gen):
        pages = self._grow([p for p, _ in histories], lengths, [u for _, u in histories])
        kv_lens = [u + n for (_, u), n in zip(histories, lengths)]
        # Where each new token goes: (page, slot) of its position in its sequence.
        slots = [
            (pg[pos // self.page_size], pos % self.page_size)
            for pg, (_, used), n in zip(pages, histories, lengths)
            for pos in range(used, used + n)
        ]
        page_idx = torch.tensor([p for p, _ in slots], device="cuda")
        slot_idx = torch.tensor([t for _, t in slots], device="cuda")
        qo_indptr = lengths_to_indptr(lengths).cuda()
        kv_indptr = lengths_to_indptr([len(p) for p in pages]).cuda()
        kv_indices = torch.tensor([i for p in pages for i in p], dtype=torch.int32, device="cuda")
        last = torch.tensor([n - (len(p) - 1) * self.page_size for n, p in zip(kv_lens, pages)],
                            dtype=torch.int32, device="cuda")  # fmt: skip
        wrapper = wrapper_for_step(qo_indptr, kv_indptr, kv_indices, last, self.page_size)
        x = torch.randn(sum(lengths), HIDDEN, generator=gen, device="cuda", dtype=torch.bfloat16)
        kv = NUM_KV_HEADS * HEAD_DIM
        for (w_qkv, w_out), cache in zip(self.model.layers, self.caches):
            qkv = x @ w_qkv
            q = qkv[:, :HIDDEN].reshape(-1, NUM_HEADS, HEAD_DIM)
            cache[page_idx, 0, slot_idx] = qkv[:, HIDDEN : HIDDEN + kv].reshape(-1, 8, HEAD_DIM)
            cache[page_idx, 1, slot_idx] = qkv[:, HIDDEN + kv :].reshape(-1, 8, HEAD_DIM)
            out = wrapper.run(q.contiguous(), cache)
            x = x + out.reshape(-1, HIDDEN) @ w_out
        histories[:] = [(p, n) for p, n in zip(pages, kv_lens)]
        return x


def paged_wrapper(qo_indptr, kv_indptr, kv_indices, last, page_size):
    """What a FlashInfer user runs: plan once per step, run once per layer."""
    wrapper = flashinfer_wrapper(flashinfer.BatchPrefillWithPagedKVCacheWrapper)
    wrapper.plan(qo_indptr, kv_indptr, kv_indices, last, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM,
                 page_size, causal=True, sm_scale=SM_SCALE, q_data_type=torch.bfloat16)  # fmt: skip
    return wrapper


class TimedSteps:
    """The chat's wrapper_for_step with plan() and every run() synchronized before and after and
    timed into times["plan"] and times["run"] (the attention's host and GPU time; the chat's
    other work is not on these clocks)."""

    def __init__(self, times: dict) -> None:
        self.times, self.wrapper = times, None

    def _timed(self, label, fn, *args):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = fn(*args)
        torch.cuda.synchronize()
        self.times.setdefault(label, []).append(time.perf_counter() - start)
        return result

    def __call__(self, *plan_arguments):
        self.wrapper = self._timed("plan", paged_wrapper, *plan_arguments)
        return self

    def run(self, q, cache):
        return self._timed("run", self.wrapper.run, q, cache)


AT_ONCE = "bundle, plan at once"  # the bundle with PREFILL_BUNDLE_DEFER_PLAN=0
CHAT_ARMS = ("flashinfer", "bundle", AT_ONCE)
CHAT_ROUNDS = 6  # every arm once a round, the order rotated a place a round


def prefix_cache_chat(model, page_size, rounds=CHAT_ROUNDS):
    """The chat through FlashInfer alone, with the bundle behind the same wrapper calls
    (FlashInfer's plan() deferred to a fallback, flashinfer_adapter's default), and with the
    bundle and FlashInfer's plan() run at once (PREFILL_BUNDLE_DEFER_PLAN=0), every arm once a
    round, the order rotated, each after a warm-up (JIT, plans, builds): its end-to-end time,
    unsynchronized; then the same chat again with plan() and every run() synchronized and timed
    apart. Every arm uses the process's one paged wrapper (constructed once, planned per step).
    Returns medians over the rounds (end to end, plan, run), the end-to-end time of every round,
    who served, and each bundle arm's normwise difference of the final outputs to FlashInfer's."""
    e2e, timed, outputs = {}, {}, {}
    served = Counter()
    for round_ in range(rounds):
        for label in rotated(CHAT_ARMS, round_):
            defer = {"PREFILL_BUNDLE_DEFER_PLAN": "0" if label == AT_ONCE else "1"}
            with (
                apply_for_arm(None if label == "flashinfer" else "every") as runtime,
                mock.patch.dict(os.environ, defer),
            ):
                PagedChat(model, page_size).run(paged_wrapper)  # warm-up
                counted, restore = record_dispatches(runtime)
                torch.cuda.synchronize()
                start = time.perf_counter()
                outputs[label] = PagedChat(model, page_size).run(paged_wrapper)
                torch.cuda.synchronize()
                e2e.setdefault(label, []).append(time.perf_counter() - start)
                times = {}
                PagedChat(model, page_size).run(TimedSteps(times))
                restore()
            for part, seconds in times.items():
                timed.setdefault((label, part), []).append(sum(seconds))
            served.update(counted)
    errors = {label: normwise_error(outputs[label], outputs["flashinfer"])
              for label in CHAT_ARMS[1:]}  # fmt: skip
    medians = {
        label: tuple(
            statistics.median(v) for v in (e2e[label], timed[label, "plan"], timed[label, "run"])
        )  # fmt: skip
        for label in e2e
    }
    return medians, e2e, dict(served), errors


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batches", type=int, default=24)
    args = parser.parse_args()
    model = Model(args.layers)
    stream = prompt_stream(args.batches)
    print(f"stream: {len(stream)} batches, {sum(map(sum, stream))} tokens, {args.layers} layers")

    runtime = enable_bundle_apply()
    table = dispatch_table(runtime).get(RAGGED, {})
    served, restore = record_dispatches(runtime)
    run_stream(model, stream, through_apply)  # first use compiles each solution's variants
    restore()
    name, via_apply, direct = dispatch_overhead(runtime)
    disable_apply()

    arms = {
        "flashinfer only": (flashinfer_only, None),
        "fallback only (torch SDPA)": (through_apply, None),
        "bundle (apply)": (through_apply, "every"),
    }
    for backend in sorted({s.split("_")[0] for s in table.values()}):
        arms[f"{backend} only (apply)"] = (through_apply, [f"{backend}_mini", f"{backend}_ragged"])
    results = stream_times(model, stream, arms)

    lengths, drop_in_served, drop_in_error = drop_in(stream)
    chats = {page_size: prefix_cache_chat(model, page_size) for page_size in (64, 1)}

    print("\napply's choice per bucket (ragged definition):")
    for key, solution in sorted(table.items(), key=lambda kv: str(kv[0].axes)):
        print(f"  {dict(key.axes)} causal={dict(key.feats)['causal']}: {solution}")
    print(f"calls served during the bundle stream: {dict(served)}")
    print(f"\nend-to-end time of the stream (attention + projections; medians of {STREAM_ROUNDS}"
          " rounds, the arms' order rotated):")  # fmt: skip
    base = results["flashinfer only"]
    for label, seconds in results.items():
        print(
            f"  {label:28s} {seconds * 1e3:9.1f} ms   FlashInfer-only / this = {base / seconds:.2f}"
        )
    print(f"\napply dispatch overhead (1-token call, {name}; host us a call, median of bursts): "
          f"{via_apply:.1f} through apply, {direct:.1f} calling the solution directly -> "
          f"{via_apply - direct:.1f} us per call")  # fmt: skip
    print(f"\nFlashInfer drop-in on a batch of {lengths}: served by {drop_in_served}, "
          f"normwise difference to FlashInfer's own output {drop_in_error:.1e}")  # fmt: skip
    print(
        "\nprefix-cache chat (2048-token system prompt shared by 6 conversations, 3 turns) "
        "through BatchPrefillWithPagedKVCacheWrapper:"
    )
    for page_size, (medians, rounds, served, errors) in chats.items():
        fi_e2e, fi_plan, fi_run = medians["flashinfer"]
        print(f"  page size {page_size:2d}: FlashInfer alone: end to end {fi_e2e * 1e3:.1f} ms, "
              f"plan() calls {fi_plan * 1e3:.2f} ms, run() calls {fi_run * 1e3:.2f} ms; "
              f"served by {served}")  # fmt: skip
        for label in CHAT_ARMS[1:]:
            b_e2e, b_plan, b_run = medians[label]
            print(f"    {label}: end to end {b_e2e * 1e3:.1f} ms ({fi_e2e / b_e2e:.2f}), plan() "
                  f"calls {b_plan * 1e3:.2f} ms, run() calls {b_run * 1e3:.2f} ms "
                  f"({fi_run / b_run:.2f}); final hidden states differ by {errors[label]:.1e} "
                  "(normwise)")  # fmt: skip
        for label, seconds in rounds.items():
            print(f"    {label} end to end per round: "
                  + ", ".join(f"{x * 1e3:.1f}" for x in seconds) + " ms")  # fmt: skip
    print(f"  (medians of {CHAT_ROUNDS} rounds, the arms' order rotated; ratios FlashInfer / "
          "the arm)")


if __name__ == "__main__":
    main()
