import math

import torch


@torch.no_grad()
def run(q, k, v, causal):
    """GQA attention over a padded batch, in fp32, one (sequence, KV head) at a time.

    q: [batch, seq_q, 32, 128] float16; k, v: [batch, seq_kv, 8, 128] float16; causal: bool.
    Returns out: [batch, seq_q, 32, 128] float16.
    """
    batch, seq_q, num_heads, head_dim = q.shape
    seq_kv, num_kv_heads = k.shape[1], k.shape[2]
    assert num_heads == 32 and num_kv_heads == 8 and head_dim == 128
    assert k.shape == (batch, seq_kv, num_kv_heads, head_dim) and v.shape == k.shape
    group_size = num_heads // num_kv_heads  # query head h reads KV head h // group_size
    scale = 1.0 / math.sqrt(head_dim)

    # Bottom-right aligned causal mask: query i sees key j iff j <= i + (seq_kv - seq_q).
    query_pos = torch.arange(seq_q, device=q.device)[:, None]
    key_pos = torch.arange(seq_kv, device=q.device)[None, :]
    if causal:
        visible = key_pos <= query_pos + (seq_kv - seq_q)
    else:
        visible = torch.ones(seq_q, seq_kv, dtype=torch.bool, device=q.device)

    out = torch.zeros(batch, seq_q, num_heads, head_dim, dtype=torch.float32, device=q.device)
    for b in range(batch):
        for kv_head in range(num_kv_heads):
            heads = slice(kv_head * group_size, (kv_head + 1) * group_size)
            q_group = q[b, :, heads, :].float().transpose(0, 1)  # [group, seq_q, head_dim]
            keys = k[b, :, kv_head, :].float()  # [seq_kv, head_dim]
            values = v[b, :, kv_head, :].float()

            logits = (q_group @ keys.T) * scale  # [group, seq_q, seq_kv]
            logits = logits.masked_fill(~visible, float("-inf"))
            row_max = logits.amax(dim=-1, keepdim=True)
            # A row that sees no key has max -inf; use 0 so exp() gives 0 instead of NaN.
            row_max = torch.where(torch.isinf(row_max), torch.zeros_like(row_max), row_max)
            weights = torch.exp(logits - row_max)
            denom = weights.sum(dim=-1, keepdim=True)
            probs = torch.where(denom > 0, weights / denom, torch.zeros_like(weights))
            out[b, :, heads, :] = (probs @ values).transpose(0, 1)
    return out.to(q.dtype)
