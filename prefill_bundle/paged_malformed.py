"""Malformed paged batches (the input contract: README, "Malformed batches"), shared by
tests/test_malformed.py and scripts/sanitize_malformed.py.

Three sequences over a cache of 12 pages of 64 (or 140 pages of 1); the FP8 definition's
batches are page size 64's with float8_e4m3fn caches. A sequence whose indptr
entries break the ragged rule (testing.well_formed_sequences, kv_indptr over kv_indices) or,
page size 64, whose last-page length is outside [1, 64] comes back NaN; a page id outside
[0, num_pages) turns NaN every row that sees a key on it, and the sequence's other rows may be
computed or NaN.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from . import HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, PAGED_FP8, PAGED_PS1, PAGED_PS64
from .testing import INT32_MAX, INT32_MIN, check_outputs, reference, well_formed_sequences

Q_INDPTR = (0, 20, 50, 100)  # 20, 30 and 50 query rows
# Page size 64: 2, 3 and 4 pages, last pages of 10, 64 and 1 tokens (74, 192, 193 keys).
PS64 = dict(kv_indptr=(0, 2, 5, 9), kv_indices=(7, 2, 11, 0, 5, 3, 9, 1, 6), last=(10, 64, 1))
# Page size 1: 30, 40 and 60 pages of one token out of 140.
_IDS = tuple(torch.randperm(140, generator=torch.Generator().manual_seed(1))[:130].tolist())
PS1 = dict(kv_indptr=(0, 30, 70, 130), kv_indices=_IDS, last=None)


@dataclass(frozen=True)
class MalformedPagedBatch:
    name: str
    page_size: int
    qo_indptr: tuple = Q_INDPTR
    kv_indptr: tuple | None = None  # None: the page size's well-formed table
    kv_indices: tuple | None = None
    kv_last_page_len: tuple | None = None
    dtype: torch.dtype = torch.bfloat16
    fp8: bool = False  # float8_e4m3fn caches with k_scale, v_scale (page size 64)
    pages: int | None = None  # the cache's pages; None: 140 of 1 token or 12 of 64
    q_rows: int | None = None  # q's rows; None: Q_INDPTR's 100

    @property
    def definition(self) -> str:
        if self.fp8:
            return PAGED_FP8
        return PAGED_PS1 if self.page_size == 1 else PAGED_PS64

    @property
    def id(self) -> str:
        return f"{self.name}_{'fp8kv' if self.fp8 else f'ps{self.page_size}'}"

    @property
    def num_pages(self) -> int:
        return self.pages or (140 if self.page_size == 1 else 12)

    def table(self) -> tuple:
        base = PS1 if self.page_size == 1 else PS64
        last = self.kv_last_page_len or base["last"]
        return (self.kv_indptr or base["kv_indptr"], self.kv_indices or base["kv_indices"], last)


def _with(ids: tuple, position: int, value: int) -> tuple:
    return ids[:position] + (value,) + ids[position + 1 :]


def _batches(page_size: int, fp8: bool = False) -> list:
    base = PS1 if page_size == 1 else PS64
    ids, starts = base["kv_indices"], base["kv_indptr"]
    pages = 140 if page_size == 1 else 12

    def batch(name, **changes):
        return MalformedPagedBatch(name, page_size, fp8=fp8, **changes)

    batches = [
        batch("valid"),
        # Page ids: the first page of sequence 1 (every row of it sees a key there), the last
        # page of sequence 2 (only its last row does), the first id of the table.
        batch("page_id_num_pages", kv_indices=_with(ids, starts[1], pages)),
        batch("page_id_negative", kv_indices=_with(ids, starts[3] - 1, -1)),
        batch("page_id_int32_max", kv_indices=_with(ids, starts[1], INT32_MAX)),
        batch("page_id_int32_min", kv_indices=_with(ids, 0, INT32_MIN)),
        # Page offsets that are not a partition of kv_indices.
        batch("kv_indptr_past_indices", kv_indptr=starts[:3] + (starts[3] + 5,)),
        batch("kv_indptr_far_past_indices", kv_indptr=starts[:3] + (1 << 30,)),
        batch("kv_indptr_negative_length", kv_indptr=(0, starts[2], starts[1], starts[3])),
        batch("qo_end_far_past_total", qo_indptr=(0, 20, 50, INT32_MAX)),
        batch("all_garbage", qo_indptr=(7, -3, 1 << 30, 5), kv_indptr=(99, 7, -8, INT32_MAX)),
    ]
    # Decode-like rows (one query token a sequence): under the interpreter the Triton kernels
    # split each sequence's keys over several programs here (split_kv.py), each writing the
    # poison of its share. On the GPU these contexts are too short to split (shares of >= 8
    # tiles of 64 keys): the split kernels' bounds there are not shown by these batches.
    decode = (0, 1, 2, 3)
    swapped = (0, starts[2], starts[1], starts[3])  # sequence 1 of negative length
    batches += [
        batch("decode_rows", qo_indptr=decode),
        batch("decode_rows_bad_page", qo_indptr=decode, kv_indices=_with(ids, starts[2], pages)),
        batch("decode_rows_bad_kv_indptr", qo_indptr=decode, kv_indptr=swapped),
    ]
    # Decode-like batches (at most 4 query rows a sequence on average, q no longer than that):
    # CUDA's FP8 decode kernel (decode_fp8.cuh) and the split paths take them. One token a
    # sequence; then 4 and 1 tokens; then 7 (two groups of 4 in the decode kernel) and 1 and 1.
    one, four, seven = dict(qo_indptr=decode, q_rows=3), dict(qo_indptr=(0, 4, 5, 9), q_rows=9), \
        dict(qo_indptr=(0, 7, 8, 9), q_rows=9)  # fmt: skip
    batches += [
        batch("decode_batch", **one),
        batch("decode_batch_bad_page", kv_indices=_with(ids, starts[1], pages), **one),
        batch("decode_batch_bad_kv_indptr", kv_indptr=swapped, **one),
        batch("decode_batch_qo_non_monotonic", qo_indptr=(0, 2, 1, 3), q_rows=3),
        batch("decode_batch_qo_end_past_total", qo_indptr=(0, 1, 2, 7), q_rows=3),
        batch("decode_batch_garbage", qo_indptr=(7, -3, 1 << 30, 5), kv_indptr=(99, 7, -8, 0),
              q_rows=3),
        batch("decode_tokens", **four),
        batch("decode_tokens_bad_page", kv_indices=_with(ids, starts[3] - 1, pages), **four),
        batch("decode_tokens_seven", **seven),
    ]
    if page_size > 1:
        batches += [
            batch("decode_batch_last_page_len_zero", kv_last_page_len=(10, 0, 1), **one),
            batch("last_page_len_zero", kv_last_page_len=(10, 0, 1)),
            batch("last_page_len_past_page", kv_last_page_len=(10, 64, 65)),
            batch("last_page_len_negative", kv_last_page_len=(-5, 64, 1)),
            batch("last_page_len_int32_max", kv_last_page_len=(10, INT32_MAX, 1)),
        ]
    return batches


MALFORMED_PAGED_BATCHES = _batches(64) + _batches(1)
MALFORMED_FP8_BATCHES = _batches(64, fp8=True)


def long_batches(page_size: int, fp8: bool = False) -> list:
    """Batches whose first sequence has 9000 keys, so that CUDA's Hopper kernels draw its KV
    heads in L2 sections (locate_tile), and (long_keys_*) whose keys average 8192 or more a
    sequence, so that TileLang's do (DrawItem), each valid and with a bad page id in the middle
    of the first sequence: for compute-sanitizer (scripts/sanitize_malformed.py); too long for
    the CPU tests. Pages shuffled over a cache a few pages larger than the table."""
    batches = []
    for name, keys in (("long", (9000, 300, 700)), ("long_keys", (20000, 300, 7000))):
        pages = [-(-n // page_size) for n in keys]
        last = None  # page size 1's definition has none
        if page_size > 1:
            last = tuple(n - (p - 1) * page_size for n, p in zip(keys, pages))
        num_pages = sum(pages) + 16
        gen = torch.Generator().manual_seed(3)
        ids = tuple(torch.randperm(num_pages, generator=gen)[: sum(pages)].tolist())
        indptr = (0, pages[0], pages[0] + pages[1], sum(pages))
        valid = MalformedPagedBatch(f"{name}_valid", page_size, kv_indptr=indptr, kv_indices=ids,
                                    kv_last_page_len=last, fp8=fp8, pages=num_pages)  # fmt: skip
        bad_ids = _with(ids, pages[0] // 2, num_pages)
        batches += [valid, replace(valid, name=f"{name}_bad_page", kv_indices=bad_ids)]
        # One query row a sequence: the decode-like paths split these keys into shares.
        decode = replace(valid, name=f"{name}_decode", qo_indptr=(0, 1, 2, 3), q_rows=3)
        batches += [decode, replace(decode, name=f"{name}_decode_bad_page", kv_indices=bad_ids)]
    return batches


FP8_SCALES = (0.5, 1.25)  # k_scale, v_scale of the FP8 batches


def malformed_paged_inputs(batch: MalformedPagedBatch, device, seed: int = 0) -> list:
    gen = torch.Generator(device="cpu").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=batch.dtype)

    kv_indptr, kv_indices, last = batch.table()
    cache = (batch.num_pages, batch.page_size, NUM_KV_HEADS, HEAD_DIM)
    q_rows = Q_INDPTR[-1] if batch.q_rows is None else batch.q_rows
    inputs = [randn(q_rows, NUM_HEADS, HEAD_DIM), randn(*cache), randn(*cache)]
    if batch.fp8:
        inputs[1:3] = [x.to(torch.float8_e4m3fn) for x in inputs[1:3]]
    for values in (batch.qo_indptr, kv_indptr, kv_indices) + ((last,) if last else ()):
        inputs.append(torch.tensor(values, dtype=torch.int32, device=device))
    return inputs + list(FP8_SCALES if batch.fp8 else ()) + [1.0 / math.sqrt(HEAD_DIM)]


def malformed_paged_expected(batch: MalformedPagedBatch, inputs) -> tuple:
    """(output, lse, either): rows of well-formed sequences as the reference computes them alone,
    NaN elsewhere; `either` marks rows that may be NaN or computed (rows of a sequence with an
    out-of-range page id that see no key on it)."""
    q, k_cache, v_cache = inputs[:3]
    scalars = inputs[-3:] if batch.fp8 else inputs[-1:]  # (k_scale, v_scale,) sm_scale
    kv_indptr, kv_indices, last = batch.table()
    qo, ps = batch.qo_indptr, batch.page_size
    output = torch.full_like(q, float("nan"))
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=q.device)
    either = torch.zeros(q.shape[0], dtype=torch.bool)
    for s in well_formed_sequences(qo, kv_indptr, q.shape[0], len(kv_indices)):
        ids = list(kv_indices[kv_indptr[s] : kv_indptr[s + 1]])
        last_len = last[s] if last else 1
        if ids and not 1 <= last_len <= ps:
            continue
        bad = [i for i, page in enumerate(ids) if not 0 <= page < batch.num_pages]
        seq_q, seq_kv = qo[s + 1] - qo[s], (len(ids) - 1) * ps + last_len if ids else 0
        device = q.device
        one = [
            q[qo[s] : qo[s + 1]],
            k_cache,
            v_cache,
            torch.tensor([0, seq_q], dtype=torch.int32, device=device),
            torch.tensor([0, len(ids)], dtype=torch.int32, device=device),
            torch.tensor(
                [0 if i in bad else p for i, p in enumerate(ids)], dtype=torch.int32, device=device
            ),
        ] + ([torch.tensor([last_len], dtype=torch.int32, device=device)] if last else [])
        rows = slice(qo[s], qo[s + 1])
        output[rows], lse[rows] = reference(batch.definition)(*one, *scalars)
        for i in range(seq_q):  # row i sees keys 0 .. i + seq_kv - seq_q
            last_key = i + seq_kv - seq_q
            if bad and last_key >= 0 and min(bad) * ps <= last_key:
                output[qo[s] + i], lse[qo[s] + i] = float("nan"), float("nan")
            elif bad:
                either[qo[s] + i] = True
    return output, lse, either


def check_malformed_paged_outputs(actual: list, expected: tuple) -> None:
    """NaN exactly where expected (rows marked `either` may be NaN); every other row the one
    correctness check."""
    want_out, want_lse, either = expected
    got_nan = actual[0].isnan().all(-1).all(-1).cpu()
    want_nan = want_out.isnan().all(-1).all(-1).cpu()
    mismatch = (got_nan != want_nan) & ~either
    assert not mismatch.any(), (
        f"NaN rows {got_nan.nonzero().flatten().tolist()[:20]}, expected "
        f"{want_nan.nonzero().flatten().tolist()[:20]} (either: {either.sum()} rows)"
    )
    assert torch.equal(actual[1].isnan().all(-1).cpu(), got_nan), "lse NaN rows != output's"
    keep = (~got_nan).to(actual[0].device)
    if keep.any():
        check_outputs([actual[0][keep], actual[1][keep]], [want_out[keep], want_lse[keep]])
