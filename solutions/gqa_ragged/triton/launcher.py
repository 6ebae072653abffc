"""A compiled kernel's launch with less host time than triton's own runner (TUNING.md, "A
launch's host time: triton's C launcher called directly").

flashinfer-bench times each call cold, host included. Through triton's runner a launch reads
the current device and stream through its driver proxy, builds launch metadata, asks for
scratch buffers, and encodes every TMA descriptor argument anew (cuTensorMapEncodeTiled): 18-19
us of host time for a Gluon launch with three descriptors on the H200 machine, cold. Here the
compiled kernel's C launcher is called directly with what a launch fixes (function, metadata)
bound once, the stream read from torch as triton's runner reads it, and each descriptor's
encoding (its CUtensorMap, shape and strides: the address, not the tensor) kept for the
descriptor's address, shape, strides and padding: 6.5 us.

A kernel that needs scratch memory, a triton whose launcher is not built as 3.6's is, and a
launch while a launch hook is set (a profiler's) keep triton's runner.
"""

import torch
import triton
from triton.backends.nvidia import driver as nvidia_driver

DESCRIPTORS_KEPT = 64  # encodings kept a descriptor argument; all dropped when full


def direct_runner(compiled, grid: tuple, constexprs: list):
    """A function of the run-time arguments launching compiled on grid (3 ints) with
    constexprs last, as compiled[grid](*args, *constexprs) does."""
    runner = compiled[grid]
    fallback = lambda *args: runner(*args, *constexprs)  # noqa: E731
    parts = _launcher_parts(compiled)
    if parts is None:
        return fallback
    c_launch, descriptors, fixed = parts
    grid_x, grid_y, grid_z = grid
    current_device, current_stream = torch._C._cuda_getDevice, torch._C._cuda_getCurrentRawStream
    runtime = triton.knobs.runtime
    encodings = {position: {} for position, _ in descriptors}

    def launch(*args):
        if _hooked(runtime.launch_enter_hook) or _hooked(runtime.launch_exit_hook):
            fallback(*args)
            return
        args = (*args, *constexprs)
        if descriptors:
            args = _encoded(args, descriptors, encodings)
        c_launch(grid_x, grid_y, grid_z, current_stream(current_device()), *fixed, *args)

    return launch


def _hooked(hook) -> bool:
    """Whether a launch hook is set: triton 3.6's are chains (HookChain), empty unless a
    profiler adds to them; older ones None or a function."""
    return hook is not None and bool(getattr(hook, "calls", True))


def _launcher_parts(compiled):
    """(the C launcher, [(position, descriptor metadata)] of the TMA descriptor arguments,
    the launcher's fixed arguments after the stream), or None where triton's runner must stay."""
    try:
        launcher = compiled.run
        if launcher.global_scratch_size or launcher.profile_scratch_size:
            return None
        c_launch = launcher.launch
        signature = list(compiled.src.signature.values())
        positions = [i for i, s in enumerate(signature)
                     if isinstance(s, str) and s.startswith("tensordesc")]  # fmt: skip
        metadata = getattr(compiled.metadata, "tensordesc_meta", None)
        if positions:
            # launcher.launch wraps the C launcher to encode the descriptors (triton 3.6's
            # wrap_handle_tensordesc); the encodings need the metadata of each.
            names = c_launch.__code__.co_freevars
            if not metadata or len(metadata) != len(positions) or "launcher" not in names:
                return None
            c_launch = c_launch.__closure__[names.index("launcher")].cell_contents
        fixed = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl, None,
                 None, compiled.packed_metadata, None, None, None)  # fmt: skip
    except AttributeError:
        return None
    return c_launch, list(zip(positions, metadata or ())), fixed


def _encoded(args: tuple, descriptors: list, encodings: dict) -> list:
    """args (all the kernel's, in signature order) with each TMA descriptor argument replaced
    by its encoding (CUtensorMap, shape, strides), kept per address, shape, strides and
    padding."""
    args = list(args)
    for position, metadata in reversed(descriptors):
        descriptor = args[position]
        key = (descriptor.base.data_ptr(), *descriptor.shape, *descriptor.strides,
               descriptor.padding)  # fmt: skip
        kept = encodings[position]
        encoding = kept.get(key)
        if encoding is None:
            if len(kept) >= DESCRIPTORS_KEPT:
                kept.clear()
            encoding = kept[key] = nvidia_driver.make_tensordesc_arg(descriptor, metadata)
        args[position:position + 1] = encoding
    return args
