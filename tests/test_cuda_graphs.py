"""CUDA graphs: a call captured once, then replayed on other batches of the same shapes.

Serving engines capture their decode (and often prefill) steps in CUDA graphs and replay them
with new token ids, lengths and page tables written into the same buffers. A solution serves
that only if (1) its call can be captured (no host sync, no cudaMalloc, no read of a tensor's
values on the host) and (2) a replay computes from the buffers' values at replay time, not from
values seen at capture time: lengths, page ids and the persistent schedule's counters.

The flow is torch's documented one: a warm-up call on a side stream, capture on the graph's
own stream, then fresh inputs copied into the captured tensors before each replay, outputs
poisoned with NaN. The second replay reverses the batch's sequences (the same totals, so the
same shapes, but every indptr entry and page id moves). The bundle's solutions only: the
baselines plan on the host (FlashInfer's wrapper copies indptr to the host, SDPA reads the
lengths), as FlashInfer's own wrappers do outside their cuda-graph mode.
"""

from dataclasses import replace

import pytest
import torch

from prefill_bundle.packing import BUNDLE_AUTHOR, SOLUTIONS
from prefill_bundle.testing import (
    PaddedCase,
    PagedCase,
    RaggedCase,
    build_solution,
    check_outputs,
    make_inputs,
    poisoned_outputs,
    reference_outputs,
)

HAS_CUDA = torch.cuda.is_available()
_FP8 = (0.5, 1.25)
_DECODE_LENS = (4000, 9000, 130, 64, 1, 16000, 777, 5000)  # one key, a full page, ragged

# Per definition: a prefill-like batch (an empty sequence, a single row, lengths off the tile
# grid) and a decode-like one (one query row a sequence: the split-KV and decode paths).
GRAPH_CASES = [
    PaddedCase(2, 333, 777, True),
    PaddedCase(1, 1, 4097, False),
    RaggedCase((1000, 1, 0, 300), (1500, 1, 0, 4000)),
    RaggedCase((1,) * 8, _DECODE_LENS),
    RaggedCase((1000, 1, 0, 300), (1500, 1, 0, 4000), window_left=200),
    RaggedCase((1,) * 8, _DECODE_LENS, window_left=1000),
    *(
        case
        for page_size in (1, 64)
        for case in (
            PagedCase((1000, 1, 0, 300), (1500, 65, 0, 4000), page_size),
            PagedCase((1500, 600), (3000, 2000), page_size),  # page size 1: pages gathered first
            PagedCase((1,) * 8, _DECODE_LENS, page_size),
        )
    ),
    PagedCase((1000, 1, 0, 300), (1500, 65, 0, 4000), 64, fp8_scales=_FP8),
    PagedCase((1,) * 8, _DECODE_LENS, 64, fp8_scales=_FP8),
    PagedCase((4,) * 8, _DECODE_LENS, 64, fp8_scales=_FP8),
]


def reversed_case(case):
    """The same totals (so tensors of the same shapes) with the sequences in reverse order."""
    if isinstance(case, PaddedCase):
        return case
    return replace(case, q_lens=case.q_lens[::-1], kv_lens=case.kv_lens[::-1])


def graph_params():
    params = []
    for spec in SOLUTIONS:
        if spec.author != BUNDLE_AUTHOR:
            continue
        for case in GRAPH_CASES:
            if case.definition == spec.definition:
                params.append(pytest.param(spec.name, case, id=f"{spec.name}-{case.id}"))
    return params


def test_every_bundle_definition_has_graph_cases():
    definitions = {spec.definition for spec in SOLUTIONS if spec.author == BUNDLE_AUTHOR}
    assert definitions == {case.definition for case in GRAPH_CASES}
    for case in GRAPH_CASES:  # a reversed batch must fit the captured tensors
        a, b = (make_inputs(c, "cpu") for c in (case, reversed_case(case)))
        assert [tuple(x.shape) for x in a if torch.is_tensor(x)] == [
            tuple(x.shape) for x in b if torch.is_tensor(x)
        ]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("solution,case", graph_params())
def test_captured_call_replays_other_batches(solution, case):
    runnable = build_solution(solution)
    static = make_inputs(case, "cuda", seed=0)
    outputs = poisoned_outputs(case, static) if runnable.metadata.destination_passing_style else []

    def call():
        result = runnable(*static, *outputs)
        return outputs or (list(result) if isinstance(result, (tuple, list)) else [result])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up: builds, plans, compiles
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    torch.cuda.synchronize()

    for seed, batch in ((1, case), (2, reversed_case(case))):
        fresh = make_inputs(batch, "cuda", seed=seed)
        for into, value in zip(static, fresh):
            if torch.is_tensor(into):
                into.copy_(value)
            else:
                assert into == value  # scalars are captured with the call
        for out in captured:
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        check_outputs(captured, reference_outputs(batch, fresh))


def fill_free_cached_blocks(stream, value: float) -> list:
    """A tensor of `value` over every free block the caching allocator keeps for `stream`
    (best fit: a request of a free block's exact size gets that block or one like it), so
    memory a call freed is surely handed out again before the replay."""
    filler = []
    for segment in torch.cuda.memory_snapshot():
        if segment["stream"] != stream.cuda_stream or tuple(segment["segment_pool_id"]) != (0, 0):
            continue  # another stream's, or a graph's private pool
        for block in segment["blocks"]:
            if block["state"] == "inactive":
                filler.append(torch.full((block["size"] // 4,), value, device="cuda"))
    return filler


# Solutions whose decode-like batches use a workspace kept per stream (split-KV shares).
WORKSPACE_SOLUTIONS = [
    f"{language}_{name}"
    for language in ("cuda", "triton", "tilelang")
    for name in ("paged_ps64", "fp8kv")
]


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("solution", WORKSPACE_SOLUTIONS)
def test_graph_keeps_its_memory_when_an_eager_call_grows_the_streams_workspace(solution):
    """Eager calls keep one workspace per stream and grow it. A graph captured on that stream
    must not write the kept buffer: an eager call with a larger batch frees it, and the memory
    goes to other tensors (here, filler of 7s) that the graph's replay would then overwrite."""
    fp8 = _FP8 if solution.endswith("fp8kv") else ()
    small = PagedCase((1,) * 8, _DECODE_LENS, 64, fp8_scales=fp8)
    # Larger batches, each growing some backend's workspace past the small batch's (TileLang's
    # page-size-64 program splits 24 rows 3 ways: 72 workspace rows against 64; 64 rows not at all)
    larger = [PagedCase((1,) * n, _DECODE_LENS * (n // 8), 64, fp8_scales=fp8) for n in (24, 64)]
    runnable = build_solution(solution)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        static = make_inputs(small, "cuda", seed=0)
        outputs = poisoned_outputs(small, static)
        runnable(*static, *outputs)  # the stream's workspace, sized for the small batch
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            runnable(*static, *outputs)
        for seed, large in enumerate(larger, 1):
            big = make_inputs(large, "cuda", seed=seed)
            runnable(*big, *poisoned_outputs(large, big))  # grows the workspace: the old one freed
        filler = fill_free_cached_blocks(stream, 7.0)
        fresh = make_inputs(small, "cuda", seed=2)
        for into, value in zip(static, fresh):
            if torch.is_tensor(into):
                into.copy_(value)
        for out in outputs:
            out.fill_(float("nan"))
        graph.replay()
    stream.synchronize()
    check_outputs(outputs, reference_outputs(small, fresh))
    assert all(bool((x == 7.0).all()) for x in filler), "the replay wrote freed memory"
