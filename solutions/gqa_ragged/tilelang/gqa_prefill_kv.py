"""Where the programs' keys and values come from: one K/V source per cache layout, built by
gqa_prefill_steps.build_steps (build_kv). A source gives

- kernel(body): the prim_func with the layout's arguments; its body is the program's macro
  body(Q, kv, qo_indptr, sm_scale, Output, LSE, Scheduler), kv the tuple of the source's own
  arguments (K/V tensors first, then kv_indptr and kv_rows, then the rest);
- seq_kv(kv, s, kv_start): the key count of sequence s, whose K/V entries start at kv_start =
  kv_indptr[s]; kv_rows: the entry count kv_indptr must end at; entry_bad / sequence_ok: what
  the layout adds to the malformed-batch rules (None: nothing);
- the loads of KV tile k (the sequence's keys k * block_N ...) into shared memory, in the two
  forms the programs use: LoadTile, the warp-specialized producer's asynchronous loads into a
  ring slot, completing the slot's full barriers (loader_warps producer warps run it, their
  full barriers count loader_warps * 32 arrivals), and CopyK / CopyV, the pipelined program's
  copies; alloc_scratch / InitScratch / item_poisoned: what the loads keep, and the mark the
  epilogue reads (paged only);
- prelude: CUDA code heading the warp-specialized kernel's source (page size 1's row copy,
  page size 64's page-id window, FP8's conversion), or None;
- page size 64's (16-bit and FP8): StartItem, the producer's start of an item, before its
  wait for Q's buffer (LoadTile then takes the item's tile count); FP8's only
  (gqa_prefill_fp8): output_buffer (False: no output buffer).

The layouts:
- ragged: K and V [total_kv, 8, 128] at any token stride; kv_indptr indexes key rows. A tile is
  one TMA box of block_N rows. Rows past the sequence (the next sequence's keys, or TMA's zero
  fill past the tensor) are finite; their scores are masked after Q K^T.
- paged: k_cache and v_cache [num_pages, page_size, 8, 128] at any page stride (a multiple of 8
  elements; offsets in 64 bits); kv_indptr indexes kv_indices (page ids); with page size 64,
  kv_last_page_len says how many slots of a sequence's last page are keys. Page size 64: a tile
  is block_N // 64 pages, one TMA box each (two: head_dim is two 128-byte swizzle rows), read
  by the producer warp (the cache a 4-d tensor, so the page stride reaches the TMA descriptor
  as the token stride does). Page size 1: a tile is a gather of block_N rows by page id,
  cp.async from the whole producer warpgroup (loader_warps 4).

Paged slots past a sequence's keys may hold anything, NaN included. K there does no harm (the
mask selects -inf for those scores whatever Q K^T gave), but P V with V = NaN is NaN even where
P = 0, so V rows past the keys are zero: page size 64 gathers the V of a page that is not whole
(the sequence's last, partly filled page, or a bad one) with cp.async's zero fill instead of a
TMA box, once per item at most; page size 1 zero-fills those rows of every gathered tile. A page
id outside [0, page_count) is never dereferenced: its rows are not loaded (V zero-filled) and the
item (a query tile of one sequence) is marked, so that its epilogue writes NaN output and lse into
every row: the rows that see a key on that page must be NaN, the other rows of the sequence
may be. The marks cost the consumers one shared-memory read per item and the loaders nothing
while every id is good.
"""

import math
from functools import reduce
from types import SimpleNamespace

import tilelang.language as T

from .gqa_prefill_fp8 import fp8_paged_kv
from .gqa_prefill_ragged import ragged_kv
from .gqa_prefill_shapes import (
    ASYNC_COPY,
    GATHER_ROW,
    HEAD_DIM,
    NUM_HEADS,
    NUM_KV_HEADS,
    ROLLED,
    VECTOR,
    CopiesArrive,
    token_rows,
)

# The pipelined program's page-size-1 gathers, unrolled by 4: four passes' page id loads in
# flight at once.
UNROLLED_BY_4 = {"pragma_unroll_factor": 4}
# Page size 64's window of page ids (HoldWindow): lane l reads ids[first + l] if l < count, else
# -1 (nothing read). Written out in CUDA because TileLang's indexing widens the lane's index to
# 64 bits and adds its own bounds test: the producer's 24 registers then spilled.
PAGE_WINDOW = """
__device__ __forceinline__ int tl_page_window(const int* ids, int first, int count) {
  const int lane = static_cast<int>(threadIdx.x & 31);
  return lane < count ? __ldg(ids + first + lane) : -1;
}
"""
TMA_BOX_COLS = 64  # a 128-byte swizzled box row: the ring's layout takes head_dim in two boxes


def build_kv(page_size, dims, cache_dtype=None, split_q=False, f16_pv=False) -> SimpleNamespace:
    """The K/V source of one variant: ragged (page_size None) or paged. dims: the variant's
    dtype, block_N, accum_dtype and the symbolic total_q, q_stride and len_indptr; cache_dtype:
    the paged caches' dtype where it is not q's (FP8_E4M3: gqa_prefill_fp8); split_q: FP8's
    e4m3 Q K^T (gqa_prefill_fp8.bf16_over_fp8); f16_pv: its P V in float16."""
    if page_size is None:
        assert cache_dtype is None, "FP8 caches are paged"
        return ragged_kv(dims)
    return paged_kv(dims, page_size, cache_dtype, split_q, f16_pv)


def cache_tensor(num_pages, page_size: int, page_stride, element):
    """A cache argument: [num_pages, page_size, 8, 128], dense within a page, any page stride."""
    cache_shape = [num_pages, page_size, NUM_KV_HEADS, HEAD_DIM]
    slot_stride = NUM_KV_HEADS * HEAD_DIM
    return T.StridedTensor(cache_shape, [page_stride, slot_stride, HEAD_DIM, 1], element)


def paged_kv(
    dims, page_size: int, cache_dtype=None, split_q=False, f16_pv=False
) -> SimpleNamespace:
    dtype, block_N, total_q = dims.dtype, dims.block_N, dims.total_q
    assert page_size in (1, 64), "page size 64 (a TMA box per page) or 1 (a gather)"
    assert block_N % page_size == 0, "a tile holds whole pages"
    pages_per_tile = block_N // page_size
    gather = page_size == 1
    loader_threads = 128 if gather else 32
    num_pages = T.dynamic("num_pages")
    num_kv_indices = T.dynamic("num_kv_indices")
    k_page_stride, v_page_stride = T.dynamic("k_page_stride"), T.dynamic("v_page_stride")


    def cache(page_stride):
        return cache_tensor(num_pages, page_size, page_stride, cache_dtype or dtype)

    @T.macro
    def Body(body, Q, kv, qo_indptr, sm_scale, Output, LSE, Scheduler):
        # The entry sees to these: 16-byte rows (a gathered row moves in 16-byte cp.async), and
        # a page and a page id at least (1-entry stand-ins), so clamped indices are in bounds.
        T.assume(k_page_stride % 8 == 0)
        T.assume(v_page_stride % 8 == 0)
        T.assume(num_pages >= 1)
        T.assume(num_kv_indices >= 1)
        body(Q, kv, qo_indptr, sm_scale, Output, LSE, Scheduler)

    def kernel(body):
        """k_cache, v_cache [num_pages, page_size, 8, 128] (any page stride, a multiple of 8),
        kv_indptr int32 [batch + 1] indexing kv_indices int32 [num_kv_indices] (page ids),
        kv_last_page_len int32 [batch] (page size 64 only), kv_rows: the entries kv_indptr
        indexes (num_kv_indices, or 0 when kv_indices is a 1-entry stand-in), page_count: the
        pages a page id may name (num_pages, or 0 when the caches are a 1-page stand-in)."""
        if gather:

            @T.prim_func
            def main(
                Q: token_rows(total_q, NUM_HEADS, dims.q_stride, dtype),
                K_cache: cache(k_page_stride),
                V_cache: cache(v_page_stride),
                qo_indptr: T.Tensor([dims.len_indptr], T.int32),
                kv_indptr: T.Tensor([dims.len_indptr], T.int32),
                kv_indices: T.Tensor([num_kv_indices], T.int32),
                kv_rows: T.int32,
                page_count: T.int32,
                sm_scale: T.float32,
                Output: T.Tensor([dims.out_rows, NUM_HEADS, HEAD_DIM], dims.out_dtype),
                LSE: T.Tensor([dims.out_rows, NUM_HEADS], dims.accum_dtype),
                Scheduler: T.Tensor([2], T.int32),
            ):
                kv = (K_cache, V_cache, kv_indptr, kv_rows, kv_indices, page_count, None)
                Body(body, Q, kv, qo_indptr, sm_scale, Output, LSE, Scheduler)

            return main

        @T.prim_func
        def main(
            Q: token_rows(total_q, NUM_HEADS, dims.q_stride, dtype),
            K_cache: cache(k_page_stride),
            V_cache: cache(v_page_stride),
            qo_indptr: T.Tensor([dims.len_indptr], T.int32),
            kv_indptr: T.Tensor([dims.len_indptr], T.int32),
            kv_indices: T.Tensor([num_kv_indices], T.int32),
            kv_last_page_len: T.Tensor([dims.len_indptr - 1], T.int32),
            kv_rows: T.int32,
            page_count: T.int32,
            sm_scale: T.float32,
            Output: T.Tensor([dims.out_rows, NUM_HEADS, HEAD_DIM], dims.out_dtype),
            LSE: T.Tensor([dims.out_rows, NUM_HEADS], dims.accum_dtype),
            Scheduler: T.Tensor([2], T.int32),
        ):
            kv = (K_cache, V_cache, kv_indptr, kv_rows, kv_indices, page_count, kv_last_page_len)
            Body(body, Q, kv, qo_indptr, sm_scale, Output, LSE, Scheduler)

        return main

    def seq_kv(kv, s, kv_start):
        pages = kv[2][s + 1] - kv_start
        if gather:
            return pages
        return T.if_then_else(pages > 0, (pages - 1) * page_size + kv[6][s], 0)

    def entry_bad(kv, i):
        """Page size 64: sequence i has pages, and its last page's length is not 1 .. 64."""
        if gather:
            return None
        kv_indptr, last = kv[2], kv[6]
        return (kv_indptr[i] < kv_indptr[i + 1]) & ((last[i] < 1) | (last[i] > page_size))

    def sequence_ok(kv, s):
        if gather:
            return None
        kv_indptr, last = kv[2], kv[6]
        return (kv_indptr[s] >= kv_indptr[s + 1]) | ((1 <= last[s]) & (last[s] <= page_size))

    def clamp(page):
        """A page id made a valid index (of a page that is then not read: zero fill), so that
        TileLang adds no bounds test of its own to the copy."""
        return T.min(T.max(page, 0), num_pages - 1)

    def in_cache(kv, page):
        return (0 <= page) & (page < kv[5])

    def page_id(kv, kv_start, seq_kv, j):
        """The id of the sequence's page j, or -1 (not in the cache) if it has no key."""
        return T.if_then_else(j * page_size < seq_kv, kv[4][kv_start + j], -1)

    def alloc_scratch():
        """(pages, bad): pages holds the tile's page ids (page size 64; registers) or the held
        row's (page size 1, warp-specialized).
        bad[item % 2] = item + 1 marks an item (counted over the block's items with query
        rows) that met a bad page id: two items are in flight at most (the producer takes the
        next item's Q only once the consumers are past this one's Q K^T)."""
        bad = T.alloc_shared([2], T.int32)
        # Page size 1: this loader thread's held row's page and its half warp's read bits
        # (HoldPageIds).
        return T.alloc_local([2 if gather else pages_per_tile], T.int32), bad

    def alloc_held_scratch():
        """Page size 64, warp-specialized: alloc_scratch's (pages, bad), then the producer
        warp's held window of page ids (HoldWindow: this lane's id)."""
        return (*alloc_scratch(), T.alloc_local([1], T.int32))

    @T.macro
    def InitScratch(scratch):
        """No item marked: before any item is loaded, by one thread."""
        scratch[1][0] = 0
        scratch[1][1] = 0

    def item_poisoned(scratch, items):
        """A test whether the item items[0] met a bad page id, to evaluate once its last V
        tile has landed."""
        return lambda: scratch[1][items[0] % 2] == items[0] + 1

    @T.macro
    def MarkBad(scratch, item, ws):
        if ws:
            # Atomic: TileLang then adds no barrier for the loaders that may all write it.
            T.atomic_max(scratch[1][item % 2], item + 1)
        else:
            scratch[1][item % 2] = item + 1

    def rows_per_pass(threads):
        """Rows that `threads` threads move at once, a 16-byte vector each."""
        return threads * VECTOR // HEAD_DIM

    # Page size 64 ---------------------------------------------------------------------------

    @T.macro
    def CheckPages(kv, scratch, k, seq_kv, item, ws):
        """A bad id among scratch's tile (tile k's page ids) marks the item."""
        pages = scratch[0]
        for p in T.unroll(pages_per_tile):
            if ((k * pages_per_tile + p) * page_size < seq_kv) & ~in_cache(kv, pages[p]):
                MarkBad(scratch, item, ws)

    @T.macro
    def FindPages(kv, scratch, k, kv_start, seq_kv, item, ws):
        """scratch's tile = the ids of tile k's pages (-1 past the sequence's pages); a bad
        one marks the item."""
        pages = scratch[0]
        for p in T.unroll(pages_per_tile):
            pages[p] = page_id(kv, kv_start, seq_kv, k * pages_per_tile + p)
        CheckPages(kv, scratch, k, seq_kv, item, ws)

    def page_is_whole(kv, pages, k, seq_kv, p):
        """Every slot of the tile's page p is a key, on a page in the cache: its V may come in
        a box."""
        return in_cache(kv, pages[p]) & ((k * pages_per_tile + p + 1) * page_size <= seq_kv)

    @T.macro
    def LoadPages(cache, shared, full, stage, pages, kv, kv_head, ws, boxed):
        """The tile's pages p with boxed(p), a box each (ws: TMA on the full barrier)."""
        for p in T.unroll(pages_per_tile):
            if boxed(p):
                if ws:
                    for half in T.unroll(HEAD_DIM // TMA_BOX_COLS):
                        cols = slice(half * TMA_BOX_COLS, (half + 1) * TMA_BOX_COLS)
                        T.tma_copy(
                            cache[pages[p], 0:page_size, kv_head, cols],
                            shared[stage, p * page_size : (p + 1) * page_size, cols],
                            barrier=full[stage],
                        )
                else:
                    T.copy(
                        cache[pages[p], 0:page_size, kv_head, :],
                        shared[stage, p * page_size : (p + 1) * page_size, :],
                    )

    @T.macro
    def GatherPages(cache, shared, stage, pages, kv, k, seq_kv, kv_head, threads):
        """The key rows of the tile's pages that are not whole into shared[stage] (the
        sequence's last page, if it ends in the tile), the other rows of those pages zero
        (cp.async's zero fill; also a bad page's and a page past the sequence's): the copies
        are in flight when it returns. (A loop per page: a row index split by the page size
        keeps TileLang from cp.async.)"""
        for p in T.unroll(pages_per_tile):
            if ~page_is_whole(kv, pages, k, seq_kv, p):
                # The page's slots that are keys to read (none on a bad page).
                keys = T.if_then_else(
                    in_cache(kv, pages[p]), seq_kv - (k * block_N + p * page_size), 0
                )
                rows = rows_per_pass(threads)
                for i in T.unroll(page_size // rows, annotations=ROLLED):
                    for r, c in T.Parallel(rows, HEAD_DIM, annotations=ASYNC_COPY):
                        slot = i * rows + r
                        shared[stage, p * page_size + slot, c] = T.if_then_else(
                            slot < keys,
                            cache[clamp(pages[p]), slot, kv_head % NUM_KV_HEADS, c],
                            T.Cast(dtype, 0),
                        )  # fmt: skip

    def tile_is_whole(kv, pages, k, seq_kv):
        whole = [page_is_whole(kv, pages, k, seq_kv, p) for p in range(pages_per_tile)]
        return reduce(lambda a, b: a & b, whole)

    @T.macro
    def LoadPagedK(kv, K_shared, k_full, stage, kv_head, pages, ws):
        """Page size 64, K of tile k into K_shared[stage]: a box per page in the cache (ws: TMA
        on k_full[stage]). Slots past the keys come along: their scores are masked."""
        LoadPages(
            kv[0], K_shared, k_full, stage, pages, kv, kv_head, ws,
            lambda p: in_cache(kv, pages[p]),
        )  # fmt: skip

    @T.macro
    def LoadPagedV(kv, V_shared, v_full, stage, k, seq_kv, kv_head, pages, ws, threads):
        """Page size 64, V of tile k into V_shared[stage]: a box per whole page, the others
        gathered with zero fill (ws: on v_full[stage], before the thread's arrival), once per
        item at most."""
        LoadPages(
            kv[1], V_shared, v_full, stage, pages, kv, kv_head, ws,
            lambda p: page_is_whole(kv, pages, k, seq_kv, p),
        )  # fmt: skip
        if ~tile_is_whole(kv, pages, k, seq_kv):
            GatherPages(kv[1], V_shared, stage, pages, kv, k, seq_kv, kv_head, threads)
            if ws:
                CopiesArrive(v_full, stage)

    # Page size 1 ----------------------------------------------------------------------------

    def row_page(kv, kv_start, key):
        """The page id kv_indices gives key `key` of the sequence (any entry past its keys: the
        index is kept inside kv_indices, and the caller masks the row)."""
        return kv[4][T.max(T.min(kv_start + key, num_kv_indices - 1), 0)]

    def gathered(cache, kv, key, seq_kv, page, kv_head, c):
        """Element c of key `key`'s row on page `page`: zero past the keys and on a bad page
        (cp.async's zero fill, no read)."""
        return T.if_then_else(
            (key < seq_kv) & in_cache(kv, page),
            cache[clamp(page), 0, kv_head % NUM_KV_HEADS, c], T.Cast(dtype, 0),
        )  # fmt: skip

    # The pipelined program's (one block of block_N threads): a check pass, then the gathers
    # reading each row's id from global memory (L1).
    @T.macro
    def CheckPageIds(kv, scratch, k, kv_start, seq_kv, item):
        """Marks the item if a key of tile k lies on a bad page id: one coalesced read of the
        tile's kv_indices, which leaves them in L1 for the gathers."""
        for r in T.Parallel(block_N):
            key = k * block_N + r
            if (key < seq_kv) & ~in_cache(kv, row_page(kv, kv_start, key)):
                MarkBad(scratch, item, False)

    @T.macro
    def GatherRows(cache, shared, stage, kv, k, kv_start, seq_kv, kv_head):
        """Tile k's keys into shared[stage] by page id (gathered): the copies are in flight when
        it returns. Read from shared memory, the ids would cost a barrier per pass."""
        rows = rows_per_pass(block_N)
        for i in T.unroll(block_N // rows, annotations=UNROLLED_BY_4):
            for r, c in T.Parallel(rows, HEAD_DIM, annotations=ASYNC_COPY):
                key = k * block_N + i * rows + r
                page = row_page(kv, kv_start, key)
                shared[stage, i * rows + r, c] = gathered(cache, kv, key, seq_kv, page, kv_head, c)

    # The warp-specialized gather: 16 threads copy a row (16 bytes each), 8 rows a pass, 16
    # passes a tile, and warp w copies rows 2w + h of each pass (h = lane // 16: lanes 0-15 and
    # 16-31). Over a tile warp w copies the 32 rows 2w + h + 8i (i the pass), so each lane reads
    # one of their ids a tile (lane l: row 2w + h + 8 (l % 16), pass l % 16's) and pass i takes
    # its row's id from lane 16h + i: a shuffle within each half warp (width 16), its source
    # lane a constant. One id load a thread and tile instead of one a pass for K, one for V and
    # one for the check (the producer's instructions per tile were 2.3x ragged's, and it ran at
    # 0.46x ragged's speed: TUNING.md).
    def held_row(tx):
        assert (block_N, loader_threads, HEAD_DIM) == (128, 128, 128), "16 passes of 8 rows"
        lane = tx % 32
        return 2 * (tx % 128 // 32) + lane // 16 + 8 * (lane % 16)

    @T.macro
    def HoldPageIds(kv, scratch, k, kv_start, seq_kv, item):
        """scratch[0] = (the page of this thread's held row of tile k, 0 where nothing is read;
        bit i: pass i's row is read, for this lane's half warp); a key on a bad page marks the
        item. The loads are one coalesced read of the tile's kv_indices."""
        tx = T.get_thread_binding()
        key = k * block_N + held_row(tx)
        page = row_page(kv, kv_start, key)
        read = (key < seq_kv) & in_cache(kv, page)
        held = scratch[0]
        # A row not read keeps an address in the cache: page 0 (a cache without pages gets a
        # 1-page stand-in). A read page is < page_count <= num_pages.
        held[0] = T.if_then_else(read, page, 0)
        # The half warp's bits: lane 16h + i holds pass i's row (held_row).
        held[1] = T.Cast("int32", T.ballot_sync(read) >> T.Cast("uint64", tx % 32 // 16 * 16))
        if (key < seq_kv) & ~in_cache(kv, page):
            MarkBad(scratch, item, True)

    @T.macro
    def GatherHeldRows(cache, shared, stage, kv_head, held):
        """Tile k's keys into shared[stage] by the producer warpgroup, from HoldPageIds' held
        pages (shuffled) and read bits: the copies are in flight when it returns. A row costs a
        shuffle, a bit test, the address's IMAD.WIDE.U32 and the cp.async (fully unrolled: the
        shared address is an immediate offset, the shuffle's source lane a constant)."""
        tx = T.get_thread_binding()
        rows = rows_per_pass(loader_threads)
        chunks = HEAD_DIM // VECTOR  # threads a row
        row, col = tx % loader_threads // chunks, tx % chunks * VECTOR
        assert cache_dtype is None, "16-bit caches: 2 bytes an element"
        page_bytes = T.Cast("uint32", cache.strides[0]) * T.uint32(2)
        for i in T.unroll(block_N // rows):
            T.call_extern(
                "handle", "tl_gather_row16",
                T.access_ptr(shared[stage, i * rows + row, col], "w", VECTOR),
                T.access_ptr(cache[0, 0, kv_head % NUM_KV_HEADS, col], "r", VECTOR),
                T.Cast("uint32", T.shfl_sync(held[0], i, 16)), page_bytes,
                T.Cast("uint32", T.bitwise_and(held[1], T.shift_left(1, i))),
            )  # fmt: skip

    # Both page sizes ------------------------------------------------------------------------

    # Page size 64: the warp-specialized producer warp holds its item's page ids 32 at a time
    # (a window: 16 tiles), lane l the id of the window's page l, and each tile shuffles its
    # pages' ids from their lanes; a window's last tile reads the next one (one coalesced load)
    # before its waits, so the load's latency passes under them. Read and used per tile, the
    # id sat in a uniform register, its R2UR right behind the load: the latency was exposed
    # before every tile's checks and boxes (ncu: the producer's top stall). A lane's own id
    # cannot live in a uniform register; ptxas kept one read a tile ahead there, R2UR again
    # right behind the load. Two windows held (one read a window ahead) spilled at 24.
    window_tiles = 32 // pages_per_tile

    @T.macro
    def HoldWindow(kv, held, w, tiles, kv_start, seq_kv):
        """held[0] = this lane's id of the item's page 32 w + lane, -1 past the pages its tiles
        load that hold keys (the ids read per tile before) and outside kv_indices."""
        first = kv_start + w * 32
        pages = T.min(tiles * pages_per_tile, (seq_kv + page_size - 1) // page_size)
        count = T.min(pages - w * 32, num_kv_indices - first)
        held[0] = T.call_extern(
            "int32", "tl_page_window", T.access_ptr(kv[4], "r"), first,
            T.if_then_else(first >= 0, count, 0),
        )  # fmt: skip

    @T.macro
    def StartItem(kv, scratch, ring, tiles, kv_start, seq_kv, kv_head):
        """Page size 64, the producer warp at an item (tiles >= 1), before its wait for Q's
        buffer: its first window of page ids."""
        HoldWindow(kv, scratch[2], 0, tiles, kv_start, seq_kv)

    @T.macro
    def LoadTile(kv, ring, num_stages, g, k, kv_start, seq_kv, kv_head, scratch, item, tiles=None):
        """Producer (loader_warps warps): K and V of KV tile k, the g-th through the ring, each
        once the consumers have released its slot; the page ids are read before the wait.
        ring: K_shared, V_shared and their k_full, k_empty, v_full, v_empty barriers; scratch:
        alloc_scratch's; item: the item's index for the bad-page mark. Page size 64: tiles,
        the item's tile count; tile k's ids come from the held window (StartItem's, then the
        one its last tile read), the same ids as read per tile before, so the same marks."""
        K_shared, V_shared, k_full, k_empty, v_full, v_empty = ring
        stage = g % num_stages
        phase = ((g // num_stages) & 1) ^ 1
        if gather:
            HoldPageIds(kv, scratch, k, kv_start, seq_kv, item)
        else:
            pages, held = scratch[0], scratch[2]
            for p in T.unroll(pages_per_tile):
                pages[p] = T.shfl_sync(held[0], k % window_tiles * pages_per_tile + p)
            if (k % window_tiles == window_tiles - 1) & (k + 1 < tiles):
                HoldWindow(kv, held, (k + 1) // window_tiles, tiles, kv_start, seq_kv)
            CheckPages(kv, scratch, k, seq_kv, item, True)
        T.mbarrier_wait_parity(k_empty[stage], phase)
        if gather:
            GatherHeldRows(kv[0], K_shared, stage, kv_head, scratch[0])
            CopiesArrive(k_full, stage)
        else:
            LoadPagedK(kv, K_shared, k_full, stage, kv_head, scratch[0], True)
        T.mbarrier_arrive(k_full[stage])
        T.mbarrier_wait_parity(v_empty[stage], phase)
        if gather:
            GatherHeldRows(kv[1], V_shared, stage, kv_head, scratch[0])
            CopiesArrive(v_full, stage)
        else:
            LoadPagedV(
                kv, V_shared, v_full, stage, k, seq_kv, kv_head, scratch[0], True, loader_threads
            )
        T.mbarrier_arrive(v_full[stage])

    # The pipelined program's copies (one item per block): K and V find their page ids each, as
    # the pipeline may reorder the copies of two tiles; the [block_N, 128] buffers are viewed as
    # a ring of one stage.
    @T.macro
    def CopyK(kv, K_shared, k, kv_start, seq_kv, kv_head, scratch):
        ring = T.reshape(K_shared, [1, block_N, HEAD_DIM])
        if gather:
            CheckPageIds(kv, scratch, k, kv_start, seq_kv, 0)
            GatherRows(kv[0], ring, 0, kv, k, kv_start, seq_kv, kv_head)
        else:
            FindPages(kv, scratch, k, kv_start, seq_kv, 0, False)
            LoadPagedK(kv, ring, None, 0, kv_head, scratch[0], False)

    @T.macro
    def CopyV(kv, V_shared, k, kv_start, seq_kv, kv_head, scratch):
        ring = T.reshape(V_shared, [1, block_N, HEAD_DIM])
        if gather:
            GatherRows(kv[1], ring, 0, kv, k, kv_start, seq_kv, kv_head)
        else:
            FindPages(kv, scratch, k, kv_start, seq_kv, 0, False)
            LoadPagedV(kv, ring, None, 0, k, seq_kv, kv_head, scratch[0], False, block_N)

    source = SimpleNamespace(
        page_size=page_size, kernel=kernel, loader_warps=loader_threads // 32,
        alloc_scratch=alloc_scratch if gather else alloc_held_scratch,
        InitScratch=InitScratch, item_poisoned=item_poisoned,
        kv_indptr=lambda kv: kv[2], kv_rows=lambda kv: kv[3],
        seq_kv=seq_kv, entry_bad=entry_bad, sequence_ok=sequence_ok, LoadTile=LoadTile,
        CopyK=CopyK, CopyV=CopyV, out_scale=lambda kv: None,
        prelude=GATHER_ROW if gather else PAGE_WINDOW,
        # cp.async writes (gqa_prefill_ws fences them): every row, or a page that is not whole
        generic_ring=gather, generic_v_tail=not gather,
    )  # fmt: skip
    if not gather:
        source.StartItem = StartItem  # LoadTile then takes the item's tile count
    if cache_dtype is None:
        return source
    # The FP8 policy (page size 64): its own arguments, scratch and producer loads, on these
    # helpers.
    assert page_size == 64, "FP8 caches: page size 64"
    helpers = SimpleNamespace(
        cache=cache, Body=Body, CheckPages=CheckPages, page_is_whole=page_is_whole,
        alloc_scratch=alloc_scratch, tile_is_whole=tile_is_whole,
        in_cache=in_cache, clamp=clamp, page_id=page_id, pages_per_tile=pages_per_tile,
        k_page_stride=k_page_stride, v_page_stride=v_page_stride, num_kv_indices=num_kv_indices,
    )  # fmt: skip
    return fp8_paged_kv(dims, source, helpers, cache_dtype, split_q, f16_pv)


GATHER_ROWS = 8  # keys a gather_pages block copies: 8 x 2 KB of K and as much of V
GATHER_THREADS = 128


def gather_pages(dtype: str, rows_per_block: int = GATHER_ROWS, threads: int = GATHER_THREADS):
    """The T.prim_func page size 1 runs before the ragged program on prefill-like batches
    (arguments.gathers_pages): K [num_kv_indices, 8, 128] and V (contiguous) get row r = page
    kv_indices[r] of K_cache and V_cache, so kv_indptr indexes them as it indexes kv_indices.
    An id outside [0, page_count) reads page 0 instead (the entry passes a 1-page stand-in when
    the cache has none) and writes a NaN K row and a zero V row: exactly the query rows that see
    the key come back NaN, as the in-loop gather's item mark makes them (and its lse, since the
    ragged epilogue's row sum is NaN). Every element is a 16-byte vector of a row: a block copies
    rows_per_block keys of both caches."""
    num_pages = T.dynamic("num_pages")
    num_kv_indices = T.dynamic("num_kv_indices")
    k_page_stride, v_page_stride = T.dynamic("k_page_stride"), T.dynamic("v_page_stride")
    rows = [num_kv_indices, NUM_KV_HEADS, HEAD_DIM]
    nan = T.cast(math.nan, dtype)

    @T.prim_func
    def main(
        K_cache: cache_tensor(num_pages, 1, k_page_stride, dtype),
        V_cache: cache_tensor(num_pages, 1, v_page_stride, dtype),
        kv_indices: T.Tensor([num_kv_indices], T.int32),
        page_count: T.int32,
        K: T.Tensor(rows, dtype),
        V: T.Tensor(rows, dtype),
    ):
        T.assume(k_page_stride % 8 == 0)
        T.assume(v_page_stride % 8 == 0)
        T.assume(num_pages >= 1)
        with T.Kernel(T.ceildiv(num_kv_indices, rows_per_block), threads=threads) as block:
            for i, h, d in T.Parallel(rows_per_block, NUM_KV_HEADS, HEAD_DIM):
                r = block * rows_per_block + i
                if r < num_kv_indices:
                    page = kv_indices[r]
                    good = (page >= 0) & (page < page_count)
                    read = T.if_then_else(good, page, 0)
                    K[r, h, d] = T.if_then_else(good, K_cache[read, 0, h, d], nan)
                    V[r, h, d] = T.if_then_else(good, V_cache[read, 0, h, d], T.cast(0, dtype))

    return main
