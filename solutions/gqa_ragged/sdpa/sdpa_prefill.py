"""Baseline: PyTorch's own attention kernels.

Padded batches go through scaled_dot_product_attention with GQA, letting torch take the first
backend that supports the call in the order cuDNN, FlashAttention, memory-efficient, math (cuDNN
has no kernel for one-token sequences). SDPA's is_causal is top-left aligned, so a causal call with
seq_q != seq_kv passes an explicit bottom-right mask instead. The ragged definition also needs the
log-sum-exp, which SDPA does not return: it calls the varlen FlashAttention kernel behind SDPA
(aten._flash_attention_forward, bottom-right causal, GQA native), which needs the longest lengths
on the host, one small device-to-host copy per call. Both return their outputs (no out= in SDPA,
so destination passing would cost an extra copy).

The sliding-window definition passes the window to the same varlen kernel (FlashAttention's
window_size_left, with window_size_right 0: FlashInfer's meaning, bottom-right aligned): the
band without materialising a mask, and the log-sum-exp with it.

The paged definitions gather each sequence's K/V out of the pages into a ragged batch (torch
indexing; the token map needs the lengths on the host, one more small copy), then run the
ragged path.
"""

import math

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

_BACKENDS = [
    SDPBackend.CUDNN_ATTENTION,
    SDPBackend.FLASH_ATTENTION,
    SDPBackend.EFFICIENT_ATTENTION,
    SDPBackend.MATH,
]
_LOG2_E = 1.0 / math.log(2.0)
_masks = {}


def _bottom_right_mask(seq_q, seq_kv, device):
    key = (seq_q, seq_kv, device)
    if key not in _masks:
        query_pos = torch.arange(seq_q, device=device)[:, None]
        key_pos = torch.arange(seq_kv, device=device)[None, :]
        _masks[key] = key_pos <= query_pos + (seq_kv - seq_q)
    return _masks[key]


def run_padded(q, k, v, causal):
    seq_q, seq_kv = q.shape[1], k.shape[1]
    mask = _bottom_right_mask(seq_q, seq_kv, q.device) if causal and seq_q != seq_kv else None
    with sdpa_kernel(_BACKENDS, set_priority=True):
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),  # [batch, heads, seq, head_dim] views, no copy
            k.transpose(1, 2),
            v.transpose(1, 2),
            attn_mask=mask,
            is_causal=bool(causal) and mask is None,
            enable_gqa=True,
        )
    return out.transpose(1, 2)


def run_ragged(q, k, v, qo_indptr, kv_indptr, sm_scale):
    # Exactly the definition's inputs: flashinfer-bench refuses an entry with any other count.
    return _varlen_flash(q, k, v, qo_indptr, kv_indptr, sm_scale, -1)


def run_ragged_swa(q, k, v, qo_indptr, kv_indptr, window_left, sm_scale):
    return _varlen_flash(q, k, v, qo_indptr, kv_indptr, sm_scale, int(window_left))


def _varlen_flash(q, k, v, qo_indptr, kv_indptr, sm_scale, window_left):
    """The varlen FlashAttention kernel behind SDPA, causal (bottom-right), its own window
    (window_left >= 0) or none (-1); output and base-2 LSE."""
    lengths = torch.stack([qo_indptr.diff(), kv_indptr.diff()]).amax(dim=1).tolist()
    window = {} if window_left < 0 else {"window_size_left": window_left, "window_size_right": 0}
    output, lse, *_ = torch.ops.aten._flash_attention_forward(
        q,
        k,
        v,
        qo_indptr,
        kv_indptr,
        lengths[0],
        lengths[1],
        0.0,
        True,
        False,
        scale=sm_scale,
        **window,
    )
    if lse.dim() == 2:  # [heads, total_q], natural log
        lse = lse.T
    else:  # padded per sequence: [batch, heads, max_q]
        rows = torch.arange(q.shape[0], device=q.device)
        seq = torch.searchsorted(qo_indptr, rows, right=True) - 1
        lse = lse[seq, :, rows - qo_indptr[seq]]
    return output, lse * _LOG2_E


def _gather_paged(cache, kv_indptr, kv_indices, last_page_len):
    """[total_kv, 8, 128]: every sequence's tokens in order, pages cut at their last length;
    and the token kv_indptr."""
    page_size = cache.shape[1]
    pages = kv_indptr.diff()
    kv_lens = torch.where(pages > 0, (pages - 1) * page_size + last_page_len, 0)
    token_indptr = torch.zeros_like(kv_indptr)
    token_indptr[1:] = kv_lens.cumsum(0)
    total_kv = int(token_indptr[-1])
    token = torch.arange(total_kv, device=cache.device)
    seq = torch.searchsorted(token_indptr, token, right=True) - 1
    within = token - token_indptr[seq]
    page = kv_indices[kv_indptr[seq] + within // page_size].long()
    if cache.element_size() == 1:  # FP8: gathered as bytes (indexing has no float8 kernels)
        return cache.view(torch.uint8)[page, within % page_size].view(cache.dtype), token_indptr
    return cache[page, within % page_size], token_indptr


def run_paged_ps64(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                   sm_scale):  # fmt: skip
    k, kv_tokens = _gather_paged(k_cache, kv_indptr, kv_indices, kv_last_page_len)
    v, _ = _gather_paged(v_cache, kv_indptr, kv_indices, kv_last_page_len)
    return run_ragged(q, k, v, qo_indptr, kv_tokens, sm_scale)


def run_paged_ps64_fp8kv(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, kv_last_page_len,
                         k_scale, v_scale, sm_scale):  # fmt: skip
    """Gathered, then dequantized to q's dtype (K * k_scale, V * v_scale), then the ragged path."""
    k, kv_tokens = _gather_paged(k_cache, kv_indptr, kv_indices, kv_last_page_len)
    v, _ = _gather_paged(v_cache, kv_indptr, kv_indices, kv_last_page_len)
    k, v = (k.float() * k_scale).to(q.dtype), (v.float() * v_scale).to(q.dtype)
    return run_ragged(q, k, v, qo_indptr, kv_tokens, sm_scale)


def run_paged_ps1(q, k_cache, v_cache, qo_indptr, kv_indptr, kv_indices, sm_scale):
    k, v = k_cache[kv_indices.long(), 0], v_cache[kv_indices.long(), 0]
    return run_ragged(q, k, v, qo_indptr, kv_indptr, sm_scale)
