"""The attention shape every TileLang program is built for, and the layout of q, k and v rows."""

import tilelang.language as T

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
GROUP_SIZE = NUM_HEADS // NUM_KV_HEADS  # query head h reads KV head h // GROUP_SIZE


def token_rows(rows, heads, token_stride, dtype):
    """[rows, heads, 128] with any token stride, heads dense: q, k and v may be slices of a fused
    QKV projection. The kernels read them through TMA descriptors, which take the stride from
    the tensor on each call, so a contiguous tensor gets the same device code."""
    return T.StridedTensor([rows, heads, HEAD_DIM], [token_stride, HEAD_DIM, 1], dtype)
