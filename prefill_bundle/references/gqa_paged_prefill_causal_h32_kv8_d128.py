import math

import torch

QUERY_CHUNK = 4096  # query rows per step: bounds the fp32 logits to 4 x 4096 x kv_len


def gather_sequence_kv(cache, page_ids, kv_len):
    """A sequence's keys (or values) in order, [kv_len, 8, 128]: its pages back to back, the
    last one cut at kv_len."""
    return cache[page_ids].flatten(0, 1)[:kv_len]


@torch.no_grad()
def paged_attention(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                    sm_scale):  # fmt: skip
    """Causal GQA attention over a paged KV cache in fp32, one (sequence, KV head, query chunk)
    at a time.

    q: [total_q, 32, 128]; k_cache, v_cache: [num_pages, page_size, 8, 128] of q's dtype;
    qo_indptr, kv_indptr: [batch + 1] int32 (sequence s owns query rows qo_indptr[s]:[s + 1] and
    the pages kv_indices[kv_indptr[s]:kv_indptr[s + 1]]); kv_indices: int32 page ids;
    kv_last_page_len: [batch] int32, the tokens in each sequence's last page (None: every page
    full, page size 1). Returns (output [total_q, 32, 128] of q's dtype, lse [total_q, 32] fp32).
    """
    total_q, num_heads, head_dim = q.shape
    num_pages, page_size, num_kv_heads = k_cache.shape[:3]
    if (num_heads, head_dim) != (32, 128):
        raise ValueError(f"q: expected [total_q, 32, 128], got {list(q.shape)}")
    if tuple(k_cache.shape[2:]) != (8, 128) or v_cache.shape != k_cache.shape:
        raise ValueError(
            f"k_cache, v_cache: expected [num_pages, page_size, 8, 128], got "
            f"{list(k_cache.shape)} and {list(v_cache.shape)}"
        )
    qo_bounds, kv_bounds = qo_indptr.tolist(), kv_indptr.tolist()
    if len(qo_bounds) != len(kv_bounds) or len(qo_bounds) < 1:
        raise ValueError(
            f"kv_indptr: expected qo_indptr's shape [batch + 1], got {list(kv_indptr.shape)} "
            f"and {list(qo_indptr.shape)}"
        )
    for name, bounds, total in (
        ("qo_indptr", qo_bounds, total_q),
        ("kv_indptr", kv_bounds, kv_indices.shape[0]),
    ):
        if bounds[0] != 0 or bounds[-1] != total or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(
                f"{name}: expected non-decreasing values from 0 to {total}, got {bounds}"
            )
    page_ids = kv_indices.long()
    if page_ids.numel() and not (0 <= int(page_ids.min()) and int(page_ids.max()) < num_pages):
        raise ValueError(f"kv_indices: expected page ids in [0, {num_pages})")
    batch = len(qo_bounds) - 1
    last_lens = [page_size] * batch if kv_last_page_len is None else kv_last_page_len.tolist()
    group_size = num_heads // num_kv_heads  # query head h reads KV head h // group_size
    log2_e = 1.0 / math.log(2.0)

    output = torch.zeros(total_q, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((total_q, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    for seq in range(batch):
        q_start, q_end = qo_bounds[seq], qo_bounds[seq + 1]
        pages = page_ids[kv_bounds[seq] : kv_bounds[seq + 1]]
        if len(pages) and not 1 <= last_lens[seq] <= page_size:
            raise ValueError(
                f"kv_last_page_len: expected values in [1, {page_size}], got "
                f"kv_last_page_len[{seq}] = {last_lens[seq]}"
            )
        seq_q = q_end - q_start
        seq_kv = 0 if len(pages) == 0 else (len(pages) - 1) * page_size + last_lens[seq]
        if seq_q == 0 or seq_kv == 0:
            continue  # output stays 0 and lse -inf
        keys_all = gather_sequence_kv(k_cache, pages, seq_kv)  # [seq_kv, 8, 128]
        values_all = gather_sequence_kv(v_cache, pages, seq_kv)
        key_pos = torch.arange(seq_kv, device=q.device)[None, :]
        for chunk in range(0, seq_q, QUERY_CHUNK):
            chunk_end = min(chunk + QUERY_CHUNK, seq_q)
            rows = slice(q_start + chunk, q_start + chunk_end)
            query_pos = torch.arange(chunk, chunk_end, device=q.device)[:, None]
            # Bottom-right aligned causal mask: query i sees key j iff j <= i + (seq_kv - seq_q).
            visible = key_pos <= query_pos + (seq_kv - seq_q)
            for kv_head in range(num_kv_heads):
                heads = slice(kv_head * group_size, (kv_head + 1) * group_size)
                q_group = q[rows, heads, :].float().transpose(0, 1)  # [group, rows, head_dim]
                keys = keys_all[:, kv_head, :].float()  # [seq_kv, head_dim]
                values = values_all[:, kv_head, :].float()

                logits = (q_group @ keys.T) * sm_scale  # [group, rows, seq_kv]
                logits = logits.masked_fill(~visible, float("-inf"))
                row_max = logits.amax(dim=-1, keepdim=True)
                # A row that sees no key has max -inf; use 0 so exp() gives 0 instead of NaN.
                row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
                weights = torch.exp(logits - row_max)
                denom = weights.sum(dim=-1, keepdim=True)
                probs = torch.where(denom > 0, weights / denom, torch.zeros_like(weights))
                output[rows, heads, :] = (probs @ values).transpose(0, 1)
                # Base-2 log-sum-exp of the scaled logits; -inf if no key is visible.
                lse[rows, heads] = ((row_max + torch.log(denom)) * log2_e).squeeze(-1).T
    return output.to(q.dtype), lse


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
