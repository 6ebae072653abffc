"""The paged K/V policy of the Triton kernel: where a sequence's keys live in a paged cache, and
what the kernel does with page ids and last-page lengths it cannot use.

Key j of sequence s lies in page kv_indices[kv_indptr[s] + j // PAGE_SIZE], slot
j % PAGE_SIZE; a cache is dense within a page (tokens NUM_KV_HEADS * HEAD_DIM apart) and its
pages PAGE_STRIDE elements apart, an offset taken in 64 bits. Tiles start at multiples of
BLOCK_N, so when PAGE_SIZE is a multiple of BLOCK_N a tile lies in one page: one page id and one
base address per tile, and the tile's addresses are the contiguous kernel's. Smaller pages (page
size 1) read one id per key, once for K and V.

The contract (CONTRACT.md, "Malformed batches"): a page id outside [0, num_pages) is never
dereferenced, and every query row whose visible keys include a key on such a page comes back
NaN; a sequence with pages whose last page length is outside [1, PAGE_SIZE] comes back NaN as a
whole. The kernel finds the sequence's first key on a bad page before its K/V loops, stops them
there (so only good pages are read, whole tiles below that key without a check) and poisons the
rows that see it.
"""

import triton
import triton.language as tl

PAGE_SCAN = tl.constexpr(4096)  # page ids read per step of the bad-page scan
INT32_MIN = tl.constexpr(-(2**31))
INT32_MAX = tl.constexpr(2**31 - 1)


@triton.jit
def sequence_keys(kv_last_page_len, seq, num_seq_pages, PAGE_SIZE: tl.constexpr):
    """(kv_len, poison_from) of sequence seq, which lists num_seq_pages pages: its key count, and
    the key from which on a row that sees it comes back NaN (first_key_on_bad_page lowers it).

    kv_last_page_len None: every page is full (page size 1). A sequence with pages whose last
    page length is out of range gets no keys and poisons every row: INT32_MIN is at most any
    row's last visible key (query_pos + kv_len - q_len >= -q_len)."""
    if kv_last_page_len is None:
        kv_len = num_seq_pages * PAGE_SIZE
        poison_from = tl.full([], INT32_MAX, tl.int32)
    else:
        last = tl.load(kv_last_page_len + seq)
        last_ok = (num_seq_pages == 0) | ((last >= 1) & (last <= PAGE_SIZE))
        kv_len = tl.where(last_ok & (num_seq_pages > 0), (num_seq_pages - 1) * PAGE_SIZE + last, 0)
        poison_from = tl.where(last_ok, INT32_MAX, INT32_MIN)
    return kv_len, poison_from


@triton.jit
def first_key_on_bad_page(pages, kv_end, num_pages, PAGE_SIZE: tl.constexpr):
    """The first of the keys [0, kv_end) that lies on a page id outside [0, num_pages), or
    kv_end when none does. pages: the sequence's page ids (kv_indices + kv_indptr[s])."""
    pages_end = tl.cdiv(kv_end, PAGE_SIZE)
    first_bad_page = pages_end
    for base in range(0, pages_end, PAGE_SCAN):
        i = base + tl.arange(0, PAGE_SCAN)
        listed = i < pages_end
        page = tl.load(pages + i, mask=listed, other=0)
        bad = listed & ((page < 0) | (page >= num_pages))
        first_bad_page = tl.minimum(first_bad_page, tl.min(tl.where(bad, i, pages_end), 0))
    return tl.minimum(first_bad_page * PAGE_SIZE, kv_end)


@triton.jit
def load_tile_pages(
    pages,
    tile_start,
    kv_hi,
    kv_len,
    num_pages,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The page ids of the K/V tile at tile_start, read once for K and V: one id when the tile
    lies in one page, else one per key. Nothing is read for a tile at or past kv_hi (the
    loop's end) nor for keys past kv_len.

    Only keys below the sequence's first key on a bad page are visited, but a masked tile may
    also hold keys past it: their ids are clamped to page 0. Unmasked tiles lie wholly below
    it."""
    if PAGE_SIZE % BLOCK_N == 0:
        page = tl.load(pages + tile_start // PAGE_SIZE, mask=tile_start < kv_hi, other=0)
    else:
        key_pos = tile_start + tl.arange(0, BLOCK_N)
        listed = (key_pos < kv_len) & (tile_start < kv_hi)
        page = tl.load(pages + key_pos // PAGE_SIZE, mask=listed, other=0)
        if MASKED:
            page = tl.where((page >= 0) & (page < num_pages), page, 0)
    return page


@triton.jit
def paged_tile_ptrs(
    k_seq,
    v_seq,
    page,
    tile_start,
    k_offsets,
    v_offsets,
    BLOCK_N: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
    TOKEN_STRIDE: tl.constexpr,
    K_PAGE_STRIDE: tl.constexpr,
    V_PAGE_STRIDE: tl.constexpr,
):
    """The K and V addresses of the keys [tile_start, tile_start + BLOCK_N), from their page
    ids (load_tile_pages). k_seq, v_seq: the caches offset to the KV head; k_offsets,
    v_offsets: a tile's offsets inside one page (key * TOKEN_STRIDE + dim)."""
    if PAGE_SIZE % BLOCK_N == 0:
        page = page.to(tl.int64)
        slot = tile_start % PAGE_SIZE * TOKEN_STRIDE
        k_ptrs = k_seq + (page * K_PAGE_STRIDE + slot) + k_offsets
        v_ptrs = v_seq + (page * V_PAGE_STRIDE + slot) + v_offsets
    else:
        page = page.to(tl.int64)
        slot = (tile_start + tl.arange(0, BLOCK_N)) % PAGE_SIZE * TOKEN_STRIDE
        dims = tl.arange(0, HEAD_DIM)[None, :]
        k_rows = page * K_PAGE_STRIDE + slot
        k_ptrs = k_seq + k_rows[:, None] + dims
        if V_PAGE_STRIDE == K_PAGE_STRIDE:
            v_ptrs = v_seq + k_rows[:, None] + dims
        else:
            v_ptrs = v_seq + (page * V_PAGE_STRIDE + slot)[:, None] + dims
    return k_ptrs, v_ptrs


@triton.jit
def poison_rows(acc, m_i, l_i, query_pos, causal_shift, poison_from):
    """Rows whose last visible key (query_pos + causal_shift) is at or past poison_from come
    out NaN: acc and m_i NaN, l_i 1 (so that the store divides and takes log2 of a positive
    number, NaN either way, even for a row whose keys were all cut off)."""
    poisoned = query_pos + causal_shift >= poison_from
    acc = tl.where(poisoned[:, None], float("nan"), acc)
    m_i = tl.where(poisoned, float("nan"), m_i)
    l_i = tl.where(poisoned, 1.0, l_i)
    return acc, m_i, l_i


@triton.jit
def gather_pages(k_cache, v_cache, kv_indices, k_out, v_out, num_rows, num_pages,
                 K_PAGE_STRIDE, V_PAGE_STRIDE, ROW: tl.constexpr, ROWS: tl.constexpr):  # fmt: skip
    """Page size 1 before the ragged kernel (arguments.gathers_pages): rows r of k_out and v_out
    (ROW elements: the key's 8 heads) are page kv_indices[r] of k_cache and v_cache, so
    kv_indptr indexes them as it indexes kv_indices. An id outside [0, num_pages) is never
    read: its K row is NaN, so exactly the query rows that see the key come back NaN (as the
    in-loop gather's poison), and its V row zero."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    listed = rows < num_rows
    page = tl.load(kv_indices + rows, mask=listed, other=0)
    good = listed & (page >= 0) & (page < num_pages)
    page = tl.where(good, page, 0).to(tl.int64)[:, None]
    cols = tl.arange(0, ROW)[None, :]
    k = tl.load(k_cache + page * K_PAGE_STRIDE + cols, mask=good[:, None], other=float("nan"))
    v = tl.load(v_cache + page * V_PAGE_STRIDE + cols, mask=good[:, None], other=0.0)
    out = rows.to(tl.int64)[:, None] * ROW + cols
    tl.store(k_out + out, k, mask=listed[:, None])
    tl.store(v_out + out, v, mask=listed[:, None])
