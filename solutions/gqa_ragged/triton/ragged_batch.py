"""Ragged-batch bookkeeping of the Triton kernel: which sequence a grid slot owns, and what the
kernel does when the indptr arrays are not a partition (read in the kernel: no host sync).

The contract (README, "Malformed batches"): sequence s is well-formed when, in both arrays a
with row count A, 0 <= a[s] <= a[s+1] <= A, no earlier entry exceeds a[s] and no later entry
is below a[s+1]. Its rows are computed as usual; every other query row comes back NaN (output
and lse). Nothing is read or written outside the tensors, whatever the values.

A valid batch (both arrays non-decreasing from 0 to their row count) costs one scan of the
arrays per program; the per-sequence and per-row tests run only when that scan fails.
"""

import triton
import triton.language as tl

CHUNK = tl.constexpr(64)  # indptr entries read per step of a scan


@triton.jit
def find_sequence(qo_indptr, slot, num_seqs, TOKENS_PER_TILE: tl.constexpr):
    """The sequence that owns grid slot `slot` of a ragged batch.

    Sequence s owns the slots [first(s), first(s + 1)) with first(s) = qo_indptr[s] // T + s:
    that is at least cdiv(q_len, T) slots whatever the alignment of its first row (at most one
    spare), and first(num_seqs) = total_q // T + num_seqs is the grid size. first() rises
    strictly, so the owner is the last s with first(s) <= slot: a binary search over indptr.
    In a malformed batch the search still finds every slot of a well-formed sequence: entries
    before it are <= its start and entries after it >= its end, so every probe steers right.
    """
    lo = num_seqs * 0
    hi = num_seqs
    while lo + 1 < hi:  # invariant: first(lo) <= slot < first(hi)
        mid = (lo + hi) // 2
        owns = tl.load(qo_indptr + mid) // TOKENS_PER_TILE + mid <= slot
        lo = tl.where(owns, mid, lo)
        hi = tl.where(owns, hi, mid)
    return lo


@triton.jit
def is_partition(qo_indptr, kv_indptr, num_seqs, total_q, total_kv):
    """Both arrays start at 0, end at their row count and never decrease. One loop over both,
    so that their loads share one memory round trip."""
    ok = (tl.load(qo_indptr) == 0) & (tl.load(qo_indptr + num_seqs) == total_q)
    ok = ok & (tl.load(kv_indptr) == 0) & (tl.load(kv_indptr + num_seqs) == total_kv)
    for base in range(0, num_seqs, CHUNK):
        i = base + tl.arange(0, CHUNK)
        in_batch = i < num_seqs
        q_start = tl.load(qo_indptr + i, mask=in_batch, other=0)
        q_end = tl.load(qo_indptr + i + 1, mask=in_batch, other=0)
        kv_start = tl.load(kv_indptr + i, mask=in_batch, other=0)
        kv_end = tl.load(kv_indptr + i + 1, mask=in_batch, other=0)
        decreasing = (q_end < q_start) | (kv_end < kv_start)
        ok = ok & (tl.max(decreasing.to(tl.int32), 0) == 0)
    return ok


@triton.jit
def _bounds_well_formed(indptr, seq, num_seqs, rows):
    """Per element of seq (any shape [R]): the sequence's range in this indptr is in [0, rows],
    forward, and ordered against every other entry (see the module docstring)."""
    start = tl.load(indptr + seq)
    end = tl.load(indptr + seq + 1)
    ok = (0 <= start) & (start <= end) & (end <= rows)
    for base in range(0, num_seqs + 1, CHUNK):
        i = base + tl.arange(0, CHUNK)
        entry = tl.load(indptr + i, mask=i <= num_seqs, other=0)[None, :]
        before = i[None, :] < seq[:, None]
        after = (i[None, :] > seq[:, None] + 1) & (i[None, :] <= num_seqs)
        bad = (before & (entry > start[:, None])) | (after & (entry < end[:, None]))
        ok = ok & (tl.max(bad.to(tl.int32), 1) == 0)
    return ok


@triton.jit
def well_formed(qo_indptr, kv_indptr, seq, num_seqs, total_q, total_kv):
    """Whether each sequence of seq (a 1-d tensor of indices) is well-formed in both arrays."""
    q_ok = _bounds_well_formed(qo_indptr, seq, num_seqs, total_q)
    kv_ok = _bounds_well_formed(kv_indptr, seq, num_seqs, total_kv)
    return q_ok & kv_ok


@triton.jit
def poison_uncovered_rows(
    out,
    lse,
    qo_indptr,
    kv_indptr,
    num_seqs,
    total_q,
    total_kv,
    slot,
    first_head,
    TOKENS_PER_TILE: tl.constexpr,
    HEADS_PER_TILE: tl.constexpr,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    WRITE_LSE: tl.constexpr,
):
    """Malformed batches only: NaN into the rows [slot * T, slot * T + T) (this program's heads)
    that no well-formed sequence covers. The grid's total_q // T + num_seqs slots cover every
    row, and a row of a well-formed sequence is written by that sequence's program alone."""
    row = slot * TOKENS_PER_TILE + tl.arange(0, TOKENS_PER_TILE)
    # The last sequence t with qo_indptr[t] <= row: the one that covers it if any well-formed
    # sequence does (the same steering argument as find_sequence).
    lo = tl.zeros([TOKENS_PER_TILE], dtype=tl.int32)
    hi = lo + num_seqs
    steps = num_seqs
    while steps > 0:  # floor(log2(num_seqs)) + 1 halvings: enough for [0, num_seqs)
        mid = (lo + hi) // 2
        active = lo + 1 < hi
        owns = tl.load(qo_indptr + mid, mask=active, other=0) <= row
        lo = tl.where(active & owns, mid, lo)
        hi = tl.where(active & ~owns, mid, hi)
        steps = steps // 2
    covered = (tl.load(qo_indptr + lo) <= row) & (row < tl.load(qo_indptr + lo + 1))
    covered = covered & well_formed(qo_indptr, kv_indptr, lo, num_seqs, total_q, total_kv)
    poison = ~covered & (row < total_q)
    nan = tl.full([TOKENS_PER_TILE, HEAD_DIM], float("nan"), tl.float32).to(out.dtype.element_ty)
    for h in tl.static_range(HEADS_PER_TILE):  # one head at a time: few registers
        row_head = row.to(tl.int64) * NUM_HEADS + first_head + h
        dims = tl.arange(0, HEAD_DIM)
        tl.store(out + row_head[:, None] * HEAD_DIM + dims[None, :], nan, mask=poison[:, None])
        if WRITE_LSE:
            tl.store(lse + row_head, tl.full([TOKENS_PER_TILE], float("nan"), tl.float32),
                     mask=poison)  # fmt: skip
