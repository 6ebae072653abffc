import math

import torch

QUERY_CHUNK = 4096  # query rows per step: bounds the fp32 logits to 4 x 4096 x seq_kv


@torch.no_grad()
def run(q, k, v, causal):
    """GQA attention over a padded batch in fp32, one (sequence, KV head, query chunk) at a time.

    q: [batch, seq_q, 32, 128] float16; k, v: [batch, seq_kv, 8, 128] float16; causal: bool.
    Returns out: [batch, seq_q, 32, 128] float16.
    """
    batch, seq_q, num_heads, head_dim = q.shape
    seq_kv, num_kv_heads = k.shape[1], k.shape[2]
    if (num_heads, head_dim) != (32, 128):
        raise ValueError(f"q: expected [batch, seq_q, 32, 128], got {list(q.shape)}")
    if k.shape != (batch, seq_kv, 8, 128):
        raise ValueError(f"k: expected [{batch}, seq_kv, 8, 128], got {list(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v: expected k's shape {list(k.shape)}, got {list(v.shape)}")
    if type(causal) is not bool:
        raise ValueError(f"causal: expected a bool, got {causal!r}")
    group_size = num_heads // num_kv_heads  # query head h reads KV head h // group_size
    scale = 1.0 / math.sqrt(head_dim)

    out = torch.zeros(batch, seq_q, num_heads, head_dim, dtype=torch.float32, device=q.device)
    if seq_kv == 0:
        return out.to(q.dtype)  # no key: every row is zeros
    key_pos = torch.arange(seq_kv, device=q.device)[None, :]
    for start in range(0, seq_q, QUERY_CHUNK):
        rows = slice(start, min(start + QUERY_CHUNK, seq_q))
        query_pos = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
        # Bottom-right aligned causal mask: query i sees key j iff j <= i + (seq_kv - seq_q).
        if causal:
            visible = key_pos <= query_pos + (seq_kv - seq_q)
        else:
            visible = torch.ones(rows.stop - rows.start, seq_kv, dtype=torch.bool, device=q.device)
        for b in range(batch):
            for kv_head in range(num_kv_heads):
                heads = slice(kv_head * group_size, (kv_head + 1) * group_size)
                q_group = q[b, rows, heads, :].float().transpose(0, 1)  # [group, rows, head_dim]
                keys = k[b, :, kv_head, :].float()  # [seq_kv, head_dim]
                values = v[b, :, kv_head, :].float()

                logits = (q_group @ keys.T) * scale  # [group, rows, seq_kv]
                logits = logits.masked_fill(~visible, float("-inf"))
                row_max = logits.amax(dim=-1, keepdim=True)
                # A row that sees no key has max -inf; use 0 so exp() gives 0 instead of NaN.
                row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
                weights = torch.exp(logits - row_max)
                denom = weights.sum(dim=-1, keepdim=True)
                probs = torch.where(denom > 0, weights / denom, torch.zeros_like(weights))
                out[b, rows, heads, :] = (probs @ values).transpose(0, 1)
    return out.to(q.dtype)
