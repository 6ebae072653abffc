import math
import operator

import torch

QUERY_CHUNK = 4096  # query rows per step: bounds the fp32 logits to 4 x 4096 x seq_kv
# With a window, a chunk of r rows reads at most r + window_left keys: chunks of about a window
# (at least this many rows) keep that near twice the window instead of the whole sequence.
MIN_WINDOW_CHUNK = 256


@torch.no_grad()
def ragged_attention(q, k, v, qo_indptr, kv_indptr, sm_scale, window_left=-1):
    """Causal GQA attention over a ragged batch in fp32, one (sequence, KV head, query chunk) at
    a time; with window_left >= 0, a sliding window too.

    q: [total_q, 32, 128] bfloat16; k, v: [total_kv, 8, 128] bfloat16;
    qo_indptr, kv_indptr: [len_indptr] int32 (sequence s owns rows indptr[s]:indptr[s + 1]);
    sm_scale: float; window_left: int, -1 for no window. Returns (output [total_q, 32, 128]
    bfloat16, lse [total_q, 32] float32).
    """
    try:
        window = -2 if isinstance(window_left, bool) else operator.index(window_left)
    except TypeError:
        window = -2
    if window < -1:
        raise ValueError(f"window_left: expected an int >= -1 (-1: no window), got {window_left!r}")
    window_left = window
    total_q, num_heads, head_dim = q.shape
    total_kv, num_kv_heads = k.shape[0], k.shape[1]
    if (num_heads, head_dim) != (32, 128):
        raise ValueError(f"q: expected [total_q, 32, 128], got {list(q.shape)}")
    if tuple(k.shape[1:]) != (8, 128):
        raise ValueError(f"k: expected [total_kv, 8, 128], got {list(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected k's shape {list(k.shape)}, got {list(v.shape)}")
    if qo_indptr.dim() != 1 or qo_indptr.shape != kv_indptr.shape or len(qo_indptr) < 1:
        raise ValueError(
            f"kv_indptr: expected qo_indptr's shape [batch + 1], got {list(kv_indptr.shape)} "
            f"and {list(qo_indptr.shape)}"
        )
    for name, indptr, total in (
        ("qo_indptr", qo_indptr, total_q),
        ("kv_indptr", kv_indptr, total_kv),
    ):
        bounds = indptr.tolist()
        if bounds[0] != 0 or bounds[-1] != total or any(a > b for a, b in zip(bounds, bounds[1:])):
            raise ValueError(
                f"{name}: expected non-decreasing values from 0 to {total}, got {bounds}"
            )
    group_size = num_heads // num_kv_heads  # query head h reads KV head h // group_size
    log2_e = 1.0 / math.log(2.0)

    output = torch.zeros(total_q, num_heads, head_dim, dtype=torch.float32, device=q.device)
    lse = torch.full((total_q, num_heads), float("-inf"), dtype=torch.float32, device=q.device)
    qo_bounds, kv_bounds = qo_indptr.tolist(), kv_indptr.tolist()
    chunk_rows = QUERY_CHUNK
    if window_left >= 0:
        chunk_rows = min(QUERY_CHUNK, max(MIN_WINDOW_CHUNK, window_left + 1))
    for seq in range(len(qo_bounds) - 1):
        q_start, q_end = qo_bounds[seq], qo_bounds[seq + 1]
        kv_start, kv_end = kv_bounds[seq], kv_bounds[seq + 1]
        seq_q, seq_kv = q_end - q_start, kv_end - kv_start
        if seq_q == 0 or seq_kv == 0:
            continue  # output stays 0 and lse -inf
        for chunk in range(0, seq_q, chunk_rows):
            chunk_end = min(chunk + chunk_rows, seq_q)
            rows = slice(q_start + chunk, q_start + chunk_end)
            # Bottom-right aligned causal mask: query i sees key j iff j <= p, p = i + seq_kv -
            # seq_q; a window also needs j >= p - window_left (FlashInfer's window_left). Only
            # the keys some row of the chunk sees are read: [begin, end).
            first_key = chunk + seq_kv - seq_q  # p of the chunk's first row
            end = min(seq_kv, first_key + (chunk_end - chunk))
            begin = max(0, first_key - window_left) if window_left >= 0 else 0
            if end <= begin:
                continue  # no row of the chunk sees a key: output stays 0 and lse -inf
            query_pos = torch.arange(chunk, chunk_end, device=q.device)[:, None]
            key_pos = torch.arange(begin, end, device=q.device)[None, :]
            last_key = query_pos + (seq_kv - seq_q)
            visible = key_pos <= last_key
            if window_left >= 0:
                visible &= key_pos >= last_key - window_left
            for kv_head in range(num_kv_heads):
                heads = slice(kv_head * group_size, (kv_head + 1) * group_size)
                q_group = q[rows, heads, :].float().transpose(0, 1)  # [group, rows, head_dim]
                keys = k[kv_start + begin : kv_start + end, kv_head, :].float()  # [keys, dim]
                values = v[kv_start + begin : kv_start + end, kv_head, :].float()

                logits = (q_group @ keys.T) * sm_scale  # [group, rows, keys]
                logits = logits.masked_fill(~visible, float("-inf"))
                row_max = logits.amax(dim=-1, keepdim=True)
                # A row that sees no key has max -inf; use 0 so exp() gives 0 instead of NaN.
                row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
                weights = torch.exp(logits - row_max)
                denom = weights.sum(dim=-1, keepdim=True)
                probs = torch.where(denom > 0, weights / denom, torch.zeros_like(weights))
                output[rows, heads, :] = (probs @ values).transpose(0, 1)
                # Base-2 log-sum-exp of the scaled logits, log2(sum_j exp(logit_j)); -inf if no
                # key is visible (log of a zero denominator).
                lse[rows, heads] = ((row_max + torch.log(denom)) * log2_e).squeeze(-1).T
    return output.to(q.dtype), lse
