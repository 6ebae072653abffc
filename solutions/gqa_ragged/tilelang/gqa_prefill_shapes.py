"""The attention shape every TileLang program is built for, and the layout of q, k and v rows."""

import tilelang.language as T

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128
GROUP_SIZE = NUM_HEADS // NUM_KV_HEADS  # query head h reads KV head h // GROUP_SIZE


def token_rows(rows, heads, token_stride, dtype):
    """[rows, heads, 128] with any token stride, heads dense: q, k and v may be slices of a fused
    QKV projection. The kernels read them through TMA descriptors, which take the stride from
    the tensor on each call, so a contiguous tensor gets the same device code."""
    return T.StridedTensor([rows, heads, HEAD_DIM], [token_stride, HEAD_DIM, 1], dtype)


# The paged K/V sources' cp.async copies (gqa_prefill_kv).
# cp.async without TileLang's implicit commit and wait: the copies complete on an mbarrier.
ASYNC_COPY = {"parallel_prefer_async": True, "parallel_async_without_async_commit_wait": True}
# A loop the compiler keeps rolled: unrolled, the loaders' row loops hoist every row's address
# into registers, which the producer's 24 (setmaxnreg) cannot hold.
ROLLED = {"pragma_unroll_factor": 1}
VECTOR = 8  # elements a thread moves per cp.async or store: 16 bytes
# A row copy for the warp-specialized producers (their kernel's prelude: page size 1's gather;
# the ragged source's V tail has its own loop, gqa_prefill_ragged.V_TAIL_COPY): 16 bytes of
# page (or row) `page` into shared memory, the source address one IMAD.WIDE.U32 from page 0's
# (page_bytes: the page stride in bytes, < 2^32 as the stride in elements is an int32; the
# product in 64 bits), or zeros where `read` is 0 (cp.async's ignore-src operand: nothing is
# read). Written out in CUDA because TileLang's indexing sign-extends the page id and the
# stride to 64 bits, multiplies them as such and adds its own bounds test: 17-18 instructions a
# row against 4 (TUNING.md, page size 1). The multiply is PTX's mul.wide.u32: written in C, it
# reached ptxas as a 64-bit multiply (one instruction a row more).
GATHER_ROW = """
__device__ __forceinline__ void tl_gather_row16(void* smem, const void* page0, unsigned int page,
                                                unsigned int page_bytes, unsigned int read) {
  unsigned long long offset;
  asm("mul.wide.u32 %0, %1, %2;" : "=l"(offset) : "r"(page), "r"(page_bytes));
  const char* src = static_cast<const char*>(page0) + offset;
  unsigned int dst = static_cast<unsigned int>(__cvta_generic_to_shared(smem));
  asm volatile("{ .reg .pred ignore; setp.eq.u32 ignore, %2, 0;"
               " cp.async.cg.shared.global [%0], [%1], 16, ignore; }"
               :: "r"(dst), "l"(src), "r"(read));
}
"""


@T.macro
def CopiesArrive(full, stage):
    """The phase of full[stage] completes only once this thread's cp.async copies have landed
    (cp.async.mbarrier.arrive counts one more arrival until they do)."""
    T.call_extern("handle", "tl::mbarrier_cp_async_arrive", full[stage])
