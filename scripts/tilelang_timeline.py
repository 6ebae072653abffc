"""On the GPU: where the TileLang warp-specialized program's time goes around its work items, from
SM clock stamps. The kernel's modules are rewritten (prefill_bundle.testing.rewritten_kernel_module)
so that one thread of each role writes the SM clock at the item hand-overs into shared memory,
copied at the end into a grown Scheduler buffer (2 work counters + SLOTS slots a block); the
causal ragged, the window or a paged program (bfloat16) then runs on a workload's inputs, and
the script prints each event's cycles from the block's start (median / min / max over the
blocks), an item's cost and the fixed cost:

    python scripts/tilelang_timeline.py chunked_prefill_2k_over_16k_window_4096 padded:8,2048
    python scripts/tilelang_timeline.py ps64:prefix_cache_hits_8x256 ps1:prefix_cache_hits_8x256

A ragged or window workload's name (prefill_bundle.workloads), padded:BATCH,SEQ (causal), or
psPAGE_SIZE:NAME, a paged workload on the paged program of that page size (never the
page-size-1 gather into the ragged program). KNOB=VALUE arguments (Python literals) are merged
into block_config: a knob under trial (tilelang/TUNING.md); --consumers leaves the producer
warp's stamps out (they spill its 24 registers beside some knobs).
Events 1-10 are the block's first item and the start of its second. ("Q's buffer freed" is
where the consumers are past the item's last Q K^T; a program that stages its output in Q's
buffer, page size 1's, frees it only after the epilogue.) The stamps cost a few
instructions an item; the script refuses a stamped program that spills registers (the shipped
ones spill none). Until 2026-11-28 (12) they did spill (88-108 bytes: stamps stored to global
memory, one at the producer's exit), so the timelines in tilelang/TUNING.md ("An item's
transitions") before that date timed a slower program than the shipped one.
tests/test_tilelang_compile.py compiles the stamped programs (the anchors still exist, no spills).
"""

import ast
import statistics
import sys
import tempfile

import torch

from prefill_bundle.cuda_build import ptxas_report
from prefill_bundle.testing import (
    PagedCase,
    RaggedCase,
    compile_fresh,
    make_inputs,
    rewritten_kernel_module,
)
from prefill_bundle.workloads import PAGED_BATCHES, ragged_batch_named

SLOTS = 16  # stamp slots a block
MAX_BLOCKS = 132  # an H100's SMs: the persistent grid
EVENTS = [
    "block start",
    "first item drawn (producer)",
    "first item published (producer)",
    "first item received (consumers)",
    "Q landed",
    "K tile 0 landed",
    "Q's buffer freed (q_empty)",
    "epilogue start",
    "epilogue end",
    "next Q issued (producer)",
    "next Q landed",
    "first item's loads issued (producer)",
    "last item end",
    "items",
    "consumers exit",
]
ITEMS = EVENTS.index("items")

# The stamps go to shared memory (a static array of SLOTS ints, one store of the SM clock's low
# word), and the consumers' thread 0 copies them out when it leaves (the producer's last stamp
# is at the block's second item). Stamps written straight to the global buffer, and a stamp or a
# copy at the producer's exit, made the stamped program spill (its producer warp has 24
# registers; 88-108 bytes, 2026-11-28 (12)): it timed a slower program than the shipped one.
# stamped_kernels checks.
PRELUDE = """
__device__ __forceinline__ int* tl_stamp_slots() {
  __shared__ int slots[%d];
  return slots;
}
__device__ __forceinline__ void tl_stamp(int event) { tl_stamp_slots()[event] = (int)clock(); }
__device__ __forceinline__ void tl_stamp_value(int event, int value) {
  tl_stamp_slots()[event] = value;
}
__device__ __forceinline__ void tl_stamp_flush(int* stamps) {
  for (int i = 0; i < %d; ++i) stamps[2 + blockIdx.x * %d + i] = tl_stamp_slots()[i];
}
""" % (SLOTS, SLOTS, SLOTS)


def guarded(call: str, condition: str, indent: int) -> str:
    """Source lines: `call` if condition."""
    pad = " " * indent
    return f"{pad}if {condition}:\n{pad}    {call}\n"


def stamp(event: str, condition: str, indent: int) -> str:
    """Source lines: if condition, write the clock into `event`'s slot."""
    return guarded(f'T.call_extern("handle", "tl_stamp", {EVENTS.index(event)})', condition, indent)


def flush(condition: str, indent: int) -> str:
    """Source lines: if condition, copy the block's slots into Scheduler (after its counters)."""
    call = 'T.call_extern("handle", "tl_stamp_flush", T.access_ptr(Scheduler, "w"))'
    return guarded(call, condition, indent)


def after(line: str, *added: str) -> tuple:
    """A (pattern, replacement) pair: source lines added after `line`."""
    return line, line + "".join(added)


def replacements(producer: bool = True) -> list:
    """(pattern, replacement) pairs of the stamped program (gqa_prefill_ws, gqa_prefill_items);
    producer False: without the producer warp's stamps (its 24 registers may not hold them
    beside a knob under trial)."""
    first, second = "(tx == 0) & (items_done[0] == 0)", "(tx == 0) & (items_done[0] == 1)"
    grown = f"Scheduler: T.Tensor([2 + {MAX_BLOCKS * SLOTS}], T.int32),"
    epilogue = "        # TileLang puts a consumer barrier before the copy into O_shared:\n"
    load_q = "            LoadQ(Q, Q_shared, q_full, q_empty, q_start, q_tile, head, items_done)\n"
    consume_end = "                            kv_source.out_scale(kv),\n"
    items = f'T.call_extern("handle", "tl_stamp_value", {ITEMS}, items_done[0])'
    loads_end = "                )  # fmt: skip\n        items_done[0] = items_done[0] + 1\n"
    pairs = [
        ("Scheduler: T.Tensor([2], T.int32),", grown),
        # the prelude: the K/V source's and the stamp
        ("    @T.macro\n    def Body(Q, kv,",
         "    stamp_prelude = (getattr(kv_source, 'prelude', None) or '') + "
         f"{PRELUDE!r}\n\n    @T.macro\n    def Body(Q, kv,"),
        ('prelude=getattr(kv_source, "prelude", None)) as block:',
         "prelude=stamp_prelude) as block:"),
        after("            scale_log2 = sm_scale * LOG2_E\n", stamp("block start", "tx == 0", 12)),
        # the producer: the first take, the next Q
        after("                    fetch[0] = block\n",
              stamp("first item drawn (producer)", "fetched[0] == 0", 20)),
        ("        T.mbarrier_arrive(item_full[slot])\n        return item\n",
         "        T.mbarrier_arrive(item_full[slot])\n"
         + stamp("first item published (producer)",
                 "(tx == consumer_threads) & (fetched[0] == 0)", 8)
         + "        return item\n"),
        after("        if loader_warps == 1:\n" + load_q,
              stamp("next Q issued (producer)",
                    "(tx == consumer_threads) & (items_done[0] == 1)", 12)),
        after("            if tx < consumer_threads + 32:\n    " + load_q,
              stamp("next Q issued (producer)",
                    "(tx == consumer_threads) & (items_done[0] == 1)", 16)),
        # the consumers: tx reaches ConsumeItem as an argument
        ("ring, Output, LSE, scale_log2, poisoned, out_scale,\n    ):  # fmt: skip",
         "ring, Output, LSE, scale_log2, poisoned, out_scale, tx,\n    ):  # fmt: skip"),
        after("        T.mbarrier_wait_parity(q_full[0], items_done[0] & 1)\n",
              stamp("Q landed", first, 8), stamp("next Q landed", second, 8)),
        after("        T.mbarrier_wait_parity(k_full[r % num_stages], (r // num_stages) & 1)\n",
              stamp("K tile 0 landed", first, 8)),
        after("        T.mbarrier_arrive(q_empty[0])  # every Q K^T of the item is done\n",
              stamp("Q's buffer freed (q_empty)", first, 8)),
        (epilogue, stamp("epilogue start", first, 8) + epilogue),
        after("            q_start, q_tile, seq_q, head, poisoned, out_scale,\n"
              "        )  # fmt: skip\n",
              stamp("epilogue end", first, 8)),
        after("                    ReceiveItem(hand, indptr, Output, LSE)\n",
              stamp("first item received (consumers)", first, 20)),
        (loads_end, "                )  # fmt: skip\n"
         + stamp("first item's loads issued (producer)",
                 "(tx == consumer_threads) & (items_done[0] == 0)", 8)
         + "        items_done[0] = items_done[0] + 1\n"),
        (consume_end + "                        )  # fmt: skip\n",
         "                            kv_source.out_scale(kv), tx,\n"
         "                        )  # fmt: skip\n"
         + stamp("last item end", "tx == 0", 24)
         + guarded(items, "tx == 0", 24)
         + stamp("consumers exit", "tx == 0", 16) + flush("tx == 0", 16)),
    ]  # fmt: skip
    if producer:
        return pairs
    mine = [f'"tl_stamp", {EVENTS.index(e)})' for e in EVENTS if "(producer)" in e]
    return [(p, r) for p, r in pairs if not any(call in r for call in mine)]


def stamped_kernels(folder, programs, knobs=None, producer=True) -> dict:
    """(window, page_size) -> the stamped module's compiled program (bfloat16, causal; (False,
    None): the ragged one), for the programs asked only: each compile is ~40 s. knobs: merged
    into block_config (a knob under trial); producer False: the consumers' stamps only.
    Refused if ptxas spills registers in it (the shipped programs spill none: the stamps would
    time another program)."""
    module = rewritten_kernel_module(folder, "gqa_prefill_timeline", replacements(producer))
    kernels = {}
    for window, page_size in set(programs):
        contiguous = page_size is None and not window
        config = {
            **module.block_config("bfloat16", True, contiguous, page_size == 1),
            **(knobs or {}),
        }
        kernel, ptxas = compile_fresh(
            module, "bfloat16", True, window=window, page_size=page_size, **config
        )  # fmt: skip
        spills = {name: r[1:] for name, r in ptxas_report(ptxas).items() if any(r[1:])}
        if spills:
            sys.exit(f"the stamped program spills (stores, loads, stack bytes): {spills}")
        kernels[window, page_size] = kernel
    return kernels


def case_of(name: str):
    """(a RaggedCase or PagedCase, its program's (window, page_size))."""
    if name.startswith("padded:"):
        batch, seq = map(int, name.split(":")[1].split(","))
        return RaggedCase((seq,) * batch, (seq,) * batch), (False, None)
    if name.startswith("ps"):
        size, name = name[2:].split(":")
        batch = next((b for b in PAGED_BATCHES if b.name == name), None)
        assert batch is not None, f"no paged workload {name!r}"
        case = PagedCase(batch.q_lens, batch.kv_lens, int(size), shared_prefix=batch.shared_prefix)
        return case, (False, int(size))
    batch = ragged_batch_named(name)
    assert batch is not None, f"no ragged or window workload {name!r}"
    case = RaggedCase(batch.q_lens, batch.kv_lens, window_left=batch.window_left)
    return case, (batch.window_left is not None, None)


def launch_arguments(case) -> tuple:
    """(q, the kernel's arguments before sm_scale, sm_scale), as the entry passes them."""
    args = make_inputs(case, "cuda", seed=0)
    if isinstance(case, PagedCase):
        # q, caches, qo_indptr, kv_indptr, kv_indices[, kv_last_page_len], sm_scale
        kv_indices, k_cache = args[5], args[1]
        return args[0], (*args[:-1], kv_indices.shape[0], k_cache.shape[0]), args[-1]
    window = () if case.window_left is None else (args[5],)
    return args[0], (*args[:5], args[1].shape[0], *window), args[-1]


def timeline(kernels: dict, name: str, producer: bool = True) -> None:
    case, program = case_of(name)
    q, head, sm_scale = launch_arguments(case)
    output = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    stamps = torch.zeros(2 + MAX_BLOCKS * SLOTS, dtype=torch.int32, device=q.device)
    for _ in range(3):  # the last launch's stamps are read
        kernels[program](*head, sm_scale, output, lse, stamps)
    torch.cuda.synchronize()
    blocks = min(torch.cuda.get_device_properties(0).multi_processor_count, MAX_BLOCKS)
    table = stamps[2 : 2 + blocks * SLOTS].view(blocks, SLOTS).cpu().long()
    since = lambda e: ((table[:, e] - table[:, 0]) % (1 << 32)).tolist()  # noqa: E731
    items = table[:, ITEMS].tolist()
    print(f"== {name}: cycles from the block's start, median / min / max over {blocks}")
    for event, label in enumerate(EVENTS):
        if event not in (0, ITEMS) and (producer or "(producer)" not in label):
            xs = since(event)
            print(f"  {label:38s} {statistics.median(xs):10.0f} {min(xs):10.0f} {max(xs):10.0f}")
    print(f"  items a block: {dict(sorted((n, items.count(n)) for n in set(items)))}")
    end, first_end = since(EVENTS.index("last item end")), since(EVENTS.index("epilogue end"))
    later = [(e - f) / (n - 1) for e, f, n in zip(end, first_end, items) if n > 1]
    if later:
        item = statistics.median(later)
        fixed = statistics.median(e - n * item for e, n in zip(end, items) if n > 0)
        print(f"  a later item (mean over each block's): {item:.0f}; fixed: {fixed:.0f}")


def main():
    with tempfile.TemporaryDirectory() as folder:
        producer = "--consumers" not in sys.argv
        args = [arg for arg in sys.argv[1:] if arg != "--consumers"]
        names = [arg for arg in args if "=" not in arg]
        knobs = dict(arg.split("=", 1) for arg in args if "=" in arg)
        knobs = {key: ast.literal_eval(value) for key, value in knobs.items()}
        programs = [case_of(name)[1] for name in names]
        kernels = stamped_kernels(folder, programs, knobs, producer)
        for name in names:
            timeline(kernels, name, producer)


if __name__ == "__main__":
    main()
