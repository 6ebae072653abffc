"""The warp-specialized program's work-item steps (gqa_prefill_ws): the producer warp's Q load,
its taking of the next item (Locate, the persistent schedule's counter, the hand-over through
item_tile) and the scheduler's reset by the last block.
"""

import tilelang.language as T

from .gqa_prefill_steps import HAS_ITEM, ITEM_FIELDS, POISON_SLOT


def item_steps(steps, consumer_threads: int, persistent: bool, num_items, grid) -> tuple:
    """(LoadQ, TakeItem, ResetScheduler) of gqa_prefill_ws's program (its docstring: the
    schedule); consumer_threads: the producer warpgroup's first thread."""
    block_M, slot_of, Locate = steps.block_M, steps.slot_of, steps.Locate

    @T.macro
    def LoadQ(Q, Q_shared, q_full, q_empty, q_start, q_tile, head, items_done):
        """Producer warp: Q of one item into Q_shared once the last item's Q K^T are done."""
        T.mbarrier_wait_parity(q_empty[0], (items_done[0] & 1) ^ 1)
        T.tma_copy(
            Q[q_start + q_tile : q_start + q_tile + block_M, head, :],
            Q_shared,
            barrier=q_full[0],
        )
        T.mbarrier_arrive(q_full[0])

    @T.macro
    def TakeItem(slot, args):
        """First loader warp: the block's next item into tile (Locate) and, once the readers
        of its last use are done, into item_tile[slot] (item_full[slot]); returns its index
        (num_items: the block is done)."""
        (
            tile, seq, fetch, fetched, item_tile, item_empty, item_full, batch_checked, batch_ok,
            qo_indptr, kv, Scheduler, block, tx, window_left,
        ) = args  # fmt: skip
        T.mbarrier_wait_parity(item_empty[slot], ((fetched[0] // 2) & 1) ^ 1)
        if persistent:
            # Dynamic schedule: the next item goes to the first block that asks (heaviest
            # first), which balances unequal items. One lane asks, a shuffle tells the warp.
            fetch[0] = 0
            if tx == consumer_threads:
                fetch[0] = T.atomic_add(Scheduler[0], 1, return_prev=True)
            item = T.shfl_sync(fetch[0], 0)
        else:
            item = T.if_then_else(fetched[0] == 0, block, num_items)
        tile[HAS_ITEM] = T.if_then_else(item < num_items, 1, 0)
        tile[POISON_SLOT] = -1
        if item < num_items:
            Locate(item, qo_indptr, kv, seq, tile, window_left)
            # Completed once, so a wait past the first item returns at once.
            T.mbarrier_wait_parity(batch_checked[0], 0)
            if batch_ok[0] == 0:
                tile[POISON_SLOT] = slot_of(item)
        if tx == consumer_threads:  # one writer: no barrier within the warp
            for i in T.serial(ITEM_FIELDS):
                item_tile[slot, i] = tile[i]
        T.mbarrier_arrive(item_full[slot])
        return item

    @T.macro
    def ResetScheduler(Scheduler, tx):
        """The last block to finish fetching resets the scheduler for the next launch on this
        stream (no other block touches it now)."""
        if tx == consumer_threads:
            if (
                T.atomic_add(Scheduler[1], 1, memory_order="acq_rel", return_prev=True)
                == grid - 1
            ):  # fmt: skip
                Scheduler[0] = 0
                Scheduler[1] = 0

    return LoadQ, TakeItem, ResetScheduler
