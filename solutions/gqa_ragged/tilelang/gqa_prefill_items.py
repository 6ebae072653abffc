"""The warp-specialized program's work-item steps (gqa_prefill_ws): the producer warp's Q load,
the hand-over of each item from the loader warps to the consumers through the 2-slot buffer
item_tile, the malformed-batch checks on the consumers' side of it, and the scheduler's reset by
the last block.

The hand-over state (hand, one tuple the program builds): tile, the current item (Locate's
fields, HAS_ITEM, POISON_SLOT); seq and ok, scratch for the search and the checks; fetch, the
scheduler's answer; fetched, the items this block fetched so far (the terminating one included;
-1 once it is done), whose count gives each item's slot (fetched % 2) and the phase of the slot's
barriers ((fetched // 2) & 1); item_tile and its barriers item_empty, item_full, item_checked;
batch_checked and batch_ok, the verdict on the batch; then the kernel's qo_indptr, K/V arguments
and Scheduler, the block index, the thread index and window_left (None without a window).
"""

import tilelang.language as T

from .gqa_prefill_steps import HAS_ITEM, HEAD, POISON_SLOT, Q_TILE, SEQ_Q, SHARE


def item_steps(
    steps, consumer_threads: int, loader_warps: int, persistent: bool, num_items, grid,
    num_sms: int,
) -> tuple:  # fmt: skip
    """(LoadQ, FetchItem, ReceiveItem) of gqa_prefill_ws's program (its docstring: the
    schedule); consumer_threads: the producer warpgroup's first thread; loader_warps: the
    producer warps that load K and V (the first takes the items); grid: min(num_items,
    num_sms) blocks if persistent."""
    block_M, slot_of, Locate = steps.block_M, steps.slot_of, steps.Locate
    sectioned, DrawItem = steps.sectioned, steps.DrawItem
    # The fields read back from item_tile: Locate's and HAS_ITEM (not POISON_SLOT), and a
    # split variant's share fields.
    item_fields, split_fields = steps.item_fields, steps.split_fields

    @T.macro
    def ReadItem(tile, item_tile, slot):
        for i in T.serial(HAS_ITEM + 1):  # not POISON_SLOT
            tile[i] = item_tile[slot, i]
        for field in split_fields:
            tile[field] = item_tile[slot, field]
    CheckBatch, CheckTile, Poison = steps.CheckBatch, steps.CheckTile, steps.Poison

    @T.macro
    def LoadQ(Q, Q_shared, q_full, q_empty, q_start, q_tile, head, items_done):
        """Producer warp: Q of one item into Q_shared once the last item's Q K^T are done (pack:
        gathered by the warp with cp.async, on q_full; head is the KV head)."""
        T.mbarrier_wait_parity(q_empty[0], (items_done[0] & 1) ^ 1)
        if steps.pack:
            steps.GatherQ(Q, Q_shared, q_start + q_tile, head, 32, True)
            T.call_extern("handle", "tl::mbarrier_cp_async_arrive", q_full[0])
        else:
            T.tma_copy(
                Q[q_start + q_tile : q_start + q_tile + block_M, head, :],
                Q_shared,
                barrier=q_full[0],
            )
        T.mbarrier_arrive(q_full[0])

    @T.macro
    def TakeItem(slot, hand):
        """First loader warp: the block's next item into tile (Locate) and, once the readers
        of its last use are done, into item_tile[slot] (item_full[slot]); returns its index
        (num_items: the block is done)."""
        (
            tile, seq, ok, fetch, fetched, item_tile, item_empty, item_full, item_checked,
            batch_checked, batch_ok, qo_indptr, kv, Scheduler, block, tx, window_left,
        ) = hand  # fmt: skip
        T.mbarrier_wait_parity(item_empty[slot], ((fetched[0] // 2) & 1) ^ 1)
        if persistent:
            # Dynamic schedule: the grid's first items are its blocks' own (no atomic on a
            # block's start, as CUDA's and Gluon's next_item); each later one goes to the
            # first block that asks (heaviest first), which balances unequal items. One lane
            # asks, a shuffle tells the warp.
            # The counter's draws count from num_sms, a constant: with fewer items than SMs
            # (grid = num_items) every draw is past the last item anyway.
            fetch[0] = 0
            if tx == consumer_threads:
                if fetched[0] == 0:
                    fetch[0] = block
                else:
                    fetch[0] = num_sms + T.atomic_add(Scheduler[0], 1, return_prev=True)
                if sectioned:
                    DrawItem(fetch, kv)
            item = T.shfl_sync(fetch[0], 0)
        else:
            fetch[0] = T.if_then_else(fetched[0] == 0, block, num_items)
            if sectioned:
                DrawItem(fetch, kv)
            item = fetch[0]
        tile[HAS_ITEM] = T.if_then_else(item < num_items, 1, 0)
        tile[POISON_SLOT] = -1
        if item < num_items:
            Locate(item, qo_indptr, kv, seq, tile, window_left)
            # Completed once, so a wait past the first item returns at once.
            T.mbarrier_wait_parity(batch_checked[0], 0)
            if batch_ok[0] == 0:
                tile[POISON_SLOT] = slot_of(item)
        if tx == consumer_threads:  # one writer: no barrier within the warp
            for i in T.serial(item_fields):
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

    @T.macro
    def FetchItem(hand, produce):
        """Loader warps: the block's next item into tile (fetched advanced, -1 once the block
        is done), then produce() if it is one. One loader warp takes it (TakeItem) and, in a
        malformed batch, waits for the consumers' verdict on it (an item that computes nothing
        comes back with seq_q = q_tile = 0). Several: the first takes it, every one reads it
        back from item_tile as the consumers do, once checked, and the others release it."""
        (
            tile, seq, ok, fetch, fetched, item_tile, item_empty, item_full, item_checked,
            batch_checked, batch_ok, qo_indptr, kv, Scheduler, block, tx, window_left,
        ) = hand  # fmt: skip
        slot = fetched[0] % 2
        if loader_warps == 1:
            item = TakeItem(slot, hand)
            if item < num_items:
                if batch_ok[0] == 0:  # the consumers check the item
                    T.mbarrier_wait_parity(item_checked[slot], (fetched[0] // 2) & 1)
                    tile[SEQ_Q] = item_tile[slot, SEQ_Q]
                    tile[Q_TILE] = item_tile[slot, Q_TILE]
                produce()
                fetched[0] = fetched[0] + 1
            else:
                fetched[0] = -1  # done
                if persistent:
                    ResetScheduler(Scheduler, tx)
        else:
            if tx < consumer_threads + 32:
                item = TakeItem(slot, hand)
                if persistent:
                    if item >= num_items:
                        ResetScheduler(Scheduler, tx)
            T.mbarrier_wait_parity(item_full[slot], (fetched[0] // 2) & 1)
            if item_tile[slot, POISON_SLOT] >= 0:  # the consumers check the item
                T.mbarrier_wait_parity(item_checked[slot], (fetched[0] // 2) & 1)
            ReadItem(tile, item_tile, slot)
            if tx >= consumer_threads + 32:
                T.mbarrier_arrive(item_empty[slot])
            fetched[0] = T.if_then_else(tile[HAS_ITEM] == 1, fetched[0] + 1, -1)
            if tile[HAS_ITEM] == 1:
                produce()

    @T.macro
    def ReceiveItem(hand, indptr, Output, LSE):
        """Consumers: the next item from item_tile into tile (fetched advanced, -1 once the
        block is done), released on item_empty. The first warp checks the batch on its first
        turn (batch_checked) and, in a malformed batch, the item's tile: it marks an item that
        computes nothing in item_tile (seq_q = q_tile = 0, as a spare slot) and tells everyone
        (item_checked), the producer included; every consumer thread poisons a row of the
        item's slot, then waits for the verdict."""
        (
            tile, seq, ok, fetch, fetched, item_tile, item_empty, item_full, item_checked,
            batch_checked, batch_ok, qo_indptr, kv, Scheduler, block, tx, window_left,
        ) = hand  # fmt: skip
        slot = fetched[0] % 2
        if (fetched[0] == 0) & (tx < 32):
            CheckBatch(indptr, tx, 32, ok)
            verdict = T.all_sync(ok[0])
            if tx == 0:
                batch_ok[0] = verdict
            T.mbarrier_arrive(batch_checked[0])
        T.mbarrier_wait_parity(item_full[slot], (fetched[0] // 2) & 1)
        if item_tile[slot, POISON_SLOT] >= 0:  # a malformed batch
            if tx < 32:
                CheckTile(item_tile[slot, POISON_SLOT], indptr, seq, tx, 32, ok, T.all_sync)
                if (tx == 0) & (ok[0] == 0):  # seq_q = q_tile = 0, as for a spare slot
                    item_tile[slot, SEQ_Q] = 0
                    item_tile[slot, Q_TILE] = 0
                T.mbarrier_arrive(item_checked[slot])
            share_row0 = steps.out_row0(item_tile[slot, SHARE]) if steps.split else None
            Poison(
                indptr, Output, LSE, item_tile[slot, POISON_SLOT], item_tile[slot, HEAD],
                tx, consumer_threads, seq, ok, share_row0,
            )  # fmt: skip
            T.mbarrier_wait_parity(item_checked[slot], (fetched[0] // 2) & 1)
        ReadItem(tile, item_tile, slot)
        T.mbarrier_arrive(item_empty[slot])
        fetched[0] = T.if_then_else(tile[HAS_ITEM] == 1, fetched[0] + 1, -1)

    return LoadQ, FetchItem, ReceiveItem
