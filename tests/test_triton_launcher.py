"""The Triton solutions' direct launches (solutions/gqa_ragged/triton/launcher.py): triton's C
launcher called with the TMA descriptors' encodings kept per address, shape and strides.

Without a GPU: the encodings are kept and reused by key, and a kernel the direct launch cannot
take (scratch memory, a launcher built otherwise) keeps triton's runner.
On a GPU: a Gluon launch through it writes what triton's runner writes, bit for bit, also once
its descriptors' addresses change; with a launch hook set (a profiler's) triton's runner runs.
"""

import sys
from types import SimpleNamespace

import pytest
import torch
import triton

from prefill_bundle.testing import (
    RaggedCase,
    build_solution,
    check_outputs,
    entry_module,
    poisoned_call,
    poisoned_outputs,
    reference_outputs,
)

HAS_CUDA = torch.cuda.is_available()


def launcher_module():
    entry = entry_module("triton_ragged")
    return sys.modules[entry.direct_runner.__module__]


class Descriptor(SimpleNamespace):
    pass


def descriptor(address: int, rows: int) -> Descriptor:
    base = SimpleNamespace(data_ptr=lambda: address)
    return Descriptor(base=base, shape=[rows, 1024], strides=[1024, 1], padding="zero")


def test_descriptor_encodings_are_kept_by_address_and_shape(monkeypatch):
    launcher = launcher_module()
    made = []

    def encode(d, metadata):
        made.append((d.base.data_ptr(), d.shape[0], metadata))
        return [f"map{len(made)}", *d.shape, *d.strides]

    monkeypatch.setattr(launcher.nvidia_driver, "make_tensordesc_arg", encode)
    descriptors = [(0, "meta q"), (2, "meta k")]
    encodings = {0: {}, 2: {}}
    args = (descriptor(4096, 10), 7, descriptor(8192, 20), 3.5)
    first = launcher._encoded(args, descriptors, encodings)
    # Each descriptor in its place as (map, shape, strides), encoded with its own metadata.
    assert first == ["map2", 10, 1024, 1024, 1, 7, "map1", 20, 1024, 1024, 1, 3.5]
    assert sorted(made) == [(4096, 10, "meta q"), (8192, 20, "meta k")]
    # The same addresses and shapes: no new encoding, the same arguments.
    assert launcher._encoded(args, descriptors, encodings) == first
    assert len(made) == 2
    # Another address, or another shape at the same address: encoded anew.
    moved = (descriptor(4096 + 2048, 10), 7, descriptor(8192, 21), 3.5)
    again = launcher._encoded(moved, descriptors, encodings)
    assert len(made) == 4
    assert again == ["map4", 10, 1024, 1024, 1, 7, "map3", 21, 1024, 1024, 1, 3.5]
    # Full: dropped, then kept again.
    monkeypatch.setattr(launcher, "DESCRIPTORS_KEPT", 2)
    launcher._encoded((descriptor(1 << 20, 10), 7, descriptor(8192, 20), 3.5), descriptors,
                      encodings)  # fmt: skip
    assert len(encodings[0]) == 1


def test_a_launch_hook_is_set_only_when_one_is_added():
    launcher = launcher_module()
    chain = triton.knobs.HookChain()
    assert not launcher._hooked(None) and not launcher._hooked(chain)
    chain.add(print)
    assert launcher._hooked(chain) and launcher._hooked(print)
    # triton's own chains are empty unless a profiler adds to them: the direct launches run.
    assert not launcher._hooked(triton.knobs.runtime.launch_enter_hook)


def test_kernels_it_cannot_take_keep_tritons_runner():
    launcher = launcher_module()
    calls = []

    class Compiled:
        def __getitem__(self, grid):
            return lambda *args: calls.append((grid, args))

    scratch = Compiled()
    scratch.run = SimpleNamespace(global_scratch_size=128, profile_scratch_size=0)
    assert launcher._launcher_parts(scratch) is None
    run = launcher.direct_runner(scratch, (2, 1, 1), [64])
    run("q", 5)
    assert calls == [((2, 1, 1), ("q", 5, 64))]
    # Descriptor arguments, but a launcher not wrapped as triton 3.6 wraps it: the runner.
    plain = Compiled()
    plain.run = SimpleNamespace(global_scratch_size=0, profile_scratch_size=0,
                                launch=lambda *args: None)  # fmt: skip
    plain.src = SimpleNamespace(signature={"q": "tensordesc<bf16[64, 128]>", "n": "i32"})
    plain.metadata = SimpleNamespace(tensordesc_meta=[{"swizzle": 128}])
    assert launcher._launcher_parts(plain) is None
    # No attribute a launch needs: the runner.
    assert launcher._launcher_parts(object()) is None


@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.gpu
def test_direct_gluon_launches_match_tritons_runner(monkeypatch):
    """A ragged batch the Gluon kernel runs (512 or more queries a sequence)."""
    case = RaggedCase((700, 600), (700, 900))
    fn = build_solution("triton_ragged")
    entry = entry_module(fn)
    first = poisoned_call(case)
    fn(*first)
    torch.cuda.synchronize()
    plan = entry._ragged_plans[next(reversed(entry._ragged_plans))]
    assert isinstance(plan, entry.GluonRaggedPlan), "not the Gluon kernel's plan"
    check_outputs(first[-2:], reference_outputs(case, first[:-2]))
    # New tensors (new addresses: new descriptors), then the first ones again (kept ones).
    second = poisoned_call(case, seed=1)
    fn(*second)
    check_outputs(second[-2:], reference_outputs(case, second[:-2]))
    for args in (first, second):
        direct = poisoned_outputs(case, args)
        fn(*args[:-2], *direct)
        # Triton's runner: a launch hook set makes the direct launch hand over to it.
        hooked = []
        triton.knobs.runtime.launch_enter_hook.add(hooked.append)
        runner = poisoned_outputs(case, args)
        try:
            fn(*args[:-2], *runner)
        finally:
            triton.knobs.runtime.launch_enter_hook.remove(hooked.append)
        torch.cuda.synchronize()
        assert hooked, "triton's runner did not run"
        for a, b in zip(direct, runner):
            assert torch.equal(a, b)
