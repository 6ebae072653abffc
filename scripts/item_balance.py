"""How evenly the Triton ragged and paged Gluon kernels' item orders load the CTAs (no GPU):
per workload, the busiest CTA's work over the mean CTA's, with items handed out round robin
(what gluon_ragged_fwd / gluon_paged_fwd do: CTA c runs items c, c + 132, ...) and with each
item to the CTA that frees first (a dynamic counter, CUDA's next_item), in the same order (a
sequence's last row blocks first, the 32 heads of a slot together). An item's work: its key
tiles + 1 (its Q, first S and epilogue), as padded_schedule counts it. The prediction behind
triton/TUNING.md's "Items by a counter" (the gain of the counter: the first column over the
second).

    python scripts/item_balance.py [--ctas 132]
"""

import argparse
import heapq

from prefill_bundle.workloads import PAGED_BATCHES, RAGGED_BATCHES

BLOCK_M = BLOCK_N = 128
HEADS = 32


def item_work(q_lens, kv_lens) -> list:
    """Each item's work (0: a spare slot) in the kernels' numbering: slots last first, a
    sequence s owning slots qo_indptr[s] // 128 + s on (gluon_attention._ragged_item)."""
    owner = {}
    for s, q in enumerate(q_lens):
        start = sum(q_lens[:s]) // BLOCK_M + s
        owner.update({start + b: (s, b) for b in range(-(-q // BLOCK_M))})
    num_slots = sum(q_lens) // BLOCK_M + len(q_lens)
    work = []
    for item in range(num_slots * HEADS):
        slot = num_slots - 1 - item // HEADS
        if slot not in owner:
            work.append(0)
            continue
        s, block = owner[slot]
        last_key = block * BLOCK_M + BLOCK_M - 1 + kv_lens[s] - q_lens[s]  # causal
        tiles = max(min(-(-kv_lens[s] // BLOCK_N), (last_key + BLOCK_N) // BLOCK_N), 0)
        work.append(tiles + 1)
    return work


def round_robin(work: list, ctas: int) -> float:
    loads = [0] * ctas
    for i, w in enumerate(work):
        loads[i % ctas] += w
    return max(loads)


def first_free(work: list, ctas: int) -> float:
    loads = [(0, c) for c in range(ctas)]
    for w in work:
        load, c = heapq.heappop(loads)
        heapq.heappush(loads, (load + w, c))
    return max(load for load, _ in loads)


def balance(q_lens, kv_lens, ctas: int) -> tuple:
    """(round robin, first free): the busiest CTA's work over the mean's."""
    work = item_work(q_lens, kv_lens)
    mean = sum(work) / ctas
    return round_robin(work, ctas) / mean, first_free(work, ctas) / mean


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--ctas", type=int, default=132, help="the persistent grid (SMs)")
    args = parser.parse_args()
    print(f"{'workload':34s} {'queries a seq':>13s} {'round robin':>11s} {'first free':>10s}")
    for batch in RAGGED_BATCHES + PAGED_BATCHES:
        q_lens, kv_lens = batch.q_lens, batch.kv_lens
        if sum(q_lens) < BLOCK_M:
            continue
        rr, ff = balance(q_lens, kv_lens, args.ctas)
        print(f"{batch.name:34s} {sum(q_lens) / len(q_lens):13.0f} {rr:11.3f} {ff:10.3f}")


if __name__ == "__main__":
    main()
