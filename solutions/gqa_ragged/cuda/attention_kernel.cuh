// GQA prefill attention forward for head_dim 128, 32 query heads and 8 KV heads, fp16 or bf16
// in, fp32 accumulate. Two kernels: the portable one (FlashAttention-2 style: mma.sync m16n8k16,
// ldmatrix and cp.async; any sm_90 build), described here, and a Hopper one (FlashAttention-3
// style: TMA, wgmma, warp-specialized; sm_90a builds only), described at
// gqa_prefill_wgmma_kernel below; the host picks one.
//
// A work item = one query tile of one KV head (both kernels): BLOCK_M = 128 rows = 32 query
// tokens x the 4 query heads of the KV group (row r is token r / 4, head 4 * kv_head + r % 4).
// The 4 heads are contiguous in memory, so K/V tiles are loaded once for the group and a row of
// the tile is one contiguous 256-byte row of q / out. Portable kernel: one CTA per item, 8 warps,
// each owning 16 rows. K/V tiles of BLOCK_N = 64 keys stream through shared memory (one K and
// one V buffer): V[n] loads while S = Q K[n]^T is computed, K[n+1] loads while O += P V[n] is.
//
// Causal masks are bottom-right aligned per sequence: query i sees key j iff
// j <= i + seq_kv - seq_q. A row that sees no key ends with output 0 and lse -inf.
//
// q, k and v may be token-strided (any token stride, heads dense); out and lse are contiguous.
//
// Paged batches (the gqa_paged definitions, causal): the same kernels with K/V rows found
// through page tables (kv_paged.cuh); the host reads no page id either.
//
// Ragged batches: the host never reads indptr values. Each CTA checks that the batch is valid
// (both indptr arrays non-decreasing from 0 to their totals: batch_part_ok); if it is not, only
// well-formed sequences are computed and every other row comes back NaN (poison_slab).
//
// The code, one concern a file, in reading order:
//   kernel_config.cuh    constants, the portable kernel's tile sizes, Params
//   ptx_sm80.cuh         mma.sync / ldmatrix / cp.async wrappers, ElementOps
//   tile_schedule.cuh    TileCoords, malformed-batch checks, poison_slab, locate_tile
//   mask_softmax.cuh     mask_tile, scale_and_mask, softmax_tile, rescale_rows
//   epilogue.cuh         poison_rows, normalize_rows, copy_rows_out, write_output
//   ptx_sm90.cuh         mbarrier, TMA, wgmma wrappers, smem descriptors (sm_90a only)
//   hopper_knobs.cuh     tuning knobs: HopperKnobs, shipped_knobs, BuildKnobs, HopperTiles
//   hopper_layout.cuh    HopperParams, WorkItem, HopperSmem, RingSlot, next_item
//   kv_contiguous.cuh    K/V source ContiguousKv (k, v tensors): the interface both kernels
//                        load K/V through, its portable RowLoader and Hopper TileLoader
//   kv_paged.cuh         K/V source PagedKv<page size> (paged caches, kv_indices)
//   kv_paged_fp8.cuh     K/V source PagedFp8Kv (FP8 e4m3 caches, page size 64) and its kernels
//   kernel_portable.cuh  gqa_prefill_kernel, gqa_prefill_paged_kernel
//   kernel_hopper.cuh    gqa_prefill_wgmma_kernel, gqa_prefill_paged_wgmma_kernel
//   split_merge.cuh      split-KV's merge of key shares (merge_shares_kernel, share_weights)
//   decode_fp8.cuh       gqa_decode_fp8_kernel: decode-like batches over FP8 caches
#pragma once

#include "kernel_config.cuh"
#include "ptx_sm80.cuh"
#include "tile_schedule.cuh"
#include "mask_softmax.cuh"
#include "epilogue.cuh"
#include "ptx_sm90.cuh"
#include "hopper_knobs.cuh"
#include "hopper_layout.cuh"
#include "kv_contiguous.cuh"
#include "kv_paged.cuh"
#include "kernel_portable.cuh"
#include "kernel_hopper.cuh"
#include "kv_paged_fp8.cuh"
#include "split_merge.cuh"
#include "decode_fp8.cuh"
