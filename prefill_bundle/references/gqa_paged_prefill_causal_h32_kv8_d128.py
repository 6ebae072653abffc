"""The paged definitions' reference: pages gathered, then the ragged reference. definitions.py
prepends gqa_ragged_prefill_causal_h32_kv8_d128.py to this file's body (below the imports) to
make one self-contained reference."""

import math

import torch

from .gqa_ragged_prefill_causal_h32_kv8_d128 import ragged_attention


def gather_sequence_kv(cache, page_ids, kv_len):
    """A sequence's keys (or values) in order, [kv_len, 8, 128]: its pages back to back, the
    last one cut at kv_len."""
    return cache[page_ids].flatten(0, 1)[:kv_len]


@torch.no_grad()
def paged_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                    sm_scale):  # fmt: skip
    """Causal GQA attention over a paged KV cache in fp32: each sequence's keys and values
    gathered out of its pages, then the ragged reference (ragged_attention) on them.

    q: [total_q, 32, 128]; k_cache, v_cache: [num_pages, page_size, 8, 128] of q's dtype;
    qo_indptr, kv_indptr: [batch + 1] int32 (sequence s owns query rows qo_indptr[s]:[s + 1] and
    the pages kv_indices[kv_indptr[s]:kv_indptr[s + 1]]); kv_indices: int32 page ids;
    kv_last_page_len: [batch] int32, the tokens in each sequence's last page (None: every page
    full, page size 1). Returns (output [total_q, 32, 128] of q's dtype, lse [total_q, 32] fp32).
    """
    num_pages, page_size = k_cache.shape[:2]
    if tuple(k_cache.shape[2:]) != (8, 128) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache, v_cache: expected [num_pages, page_size, 8, 128], got "
            f"{list(k_cache.shape)} and {list(v_cache.shape)}"
        )
    kv_bounds = kv_indptr.tolist()
    if len(kv_bounds) != qo_indptr.shape[0] or len(kv_bounds) < 1:
        raise ValueError(
            f"kv_indptr: expected qo_indptr's shape [batch + 1], got {list(kv_indptr.shape)} "
            f"and {list(qo_indptr.shape)}"
        )
    total = kv_indices.shape[0]
    if (
        kv_bounds[0] != 0
        or kv_bounds[-1] != total
        or any(a > b for a, b in zip(kv_bounds, kv_bounds[1:]))
    ):
        raise ValueError(f"kv_indptr: expected non-decreasing values from 0 to {total}, got "
                         f"{kv_bounds}")  # fmt: skip
    page_ids = kv_indices.long()
    if page_ids.numel() and not (0 <= int(page_ids.min()) and int(page_ids.max()) < num_pages):
        raise ValueError(f"kv_indices: expected page ids in [0, {num_pages})")
    batch = len(kv_bounds) - 1
    last_lens = [page_size] * batch if kv_last_page_len is None else kv_last_page_len.tolist()
    keys, values, kv_lens = [], [], []
    for seq in range(batch):
        pages = page_ids[kv_bounds[seq] : kv_bounds[seq + 1]]
        if len(pages) and not 1 <= last_lens[seq] <= page_size:
            raise ValueError(
                f"kv_last_page_len: expected values in [1, {page_size}], got "
                f"kv_last_page_len[{seq}] = {last_lens[seq]}"
            )
        kv_lens.append(0 if len(pages) == 0 else (len(pages) - 1) * page_size + last_lens[seq])
        keys.append(gather_sequence_kv(k_cache, pages, kv_lens[-1]))  # [kv_len, 8, 128]
        values.append(gather_sequence_kv(v_cache, pages, kv_lens[-1]))
    kv_tokens = torch.zeros(batch + 1, dtype=torch.int64)
    kv_tokens[1:] = torch.tensor(kv_lens, dtype=torch.int64).cumsum(0)
    no_keys = k_cache.new_zeros(0, 8, 128)
    return ragged_attention(
        q, torch.cat(keys) if keys else no_keys, torch.cat(values) if values else no_keys,
        qo_indptr, kv_tokens, sm_scale,
    )  # fmt: skip


def run_ps1(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sm_scale):
    """Page size 1: every page holds one token, so a sequence's key count is its page count."""
    return paged_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, None, sm_scale)


def run_ps64(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale):
    return paged_attention(
        q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale
    )


def run_ps64_fp8kv(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                   k_scale, v_scale, sm_scale):  # fmt: skip
    """float8_e4m3fn caches with one scale per tensor: the real K is k_cache * k_scale (V alike).
    Dequantized to fp32 first, then the same attention."""
    for name, scale in (("k_scale", k_scale), ("v_scale", v_scale)):
        if (
            isinstance(scale, bool)
            or not isinstance(scale, (int, float))
            or not math.isfinite(scale)
        ):
            raise ValueError(f"{name}: expected a finite float, got {scale!r}")
    for name, cache in (("k_cache", k_cache), ("v_cache", v_cache)):
        if cache.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{name}: expected float8_e4m3fn, got {cache.dtype}")
    keys, values = k_cache.float() * k_scale, v_cache.float() * v_scale
    return paged_attention(
        q, keys, values, qo_indptr, kv_indptr, kv_indices, kv_last_page_len, sm_scale
    )
