// Where a CTA's work lies: TileCoords, the malformed-ragged-batch checks (indptr values are
// read only here, never on the host), poisoning of uncovered rows, and locate_tile, which maps
// a tile slot to its sequence. Shared by both kernels.
#pragma once

#include "kernel_config.cuh"

namespace gqa_prefill {

// ---- Shared by both kernels: tile placement, masking, online softmax, epilogue -------------

// Where a CTA's query tile lies.
struct TileCoords {
  int q_row0;         // the tile's first token among q's rows
  int kv_start;       // the sequence's first row of k / v (paged: its first kv_indices entry)
  int seq_kv;         // keys in the sequence; -1: a paged sequence with a malformed last-page
                      // length, whose rows come back NaN (kv_len is 0 then)
  int tok0;           // the tile's first token within its sequence
  int tile_tokens;    // tokens in the tile (fewer than 32 only in a sequence's last tile)
  int causal_offset;  // seq_kv - seq_q: bottom-right alignment
  int kv_len;         // keys [0, kv_len) are visible to at least one row of the tile
};

// ---- Ragged batches with malformed indptr values (read only here, never on the host) ---------
//
// The batch is valid iff both arrays are non-decreasing from 0 to their totals; then every
// sequence is well-formed. Otherwise sequence s is well-formed iff, in both arrays,
// 0 <= a[s] <= a[s + 1] <= total, no earlier boundary lies after a[s] and no later one before
// a[s + 1]: well-formed sequences are computed as usual, every other row of q gets NaN in
// output and lse. The binary searches below find every well-formed sequence whatever the other
// values (each probe before s is <= a[s], each one after s is >= a[s + 1]).

// This thread's part of the validity test (all parts together: the batch is valid).
__device__ __forceinline__ bool indptr_part_ok(const int* a, int n, int total, int thread,
                                               int num_threads) {
  bool ok = thread != 0 || (__ldg(a) == 0 && __ldg(a + n) == total);
#pragma unroll 1
  for (int i = thread; i < n; i += num_threads) ok &= __ldg(a + i) <= __ldg(a + i + 1);
  return ok;
}
// Both arrays' loads in flight at once (& rather than &&): one memory round trip, not two.
__device__ __forceinline__ bool batch_part_ok(const Params& p, int thread, int num_threads) {
  return indptr_part_ok(p.qo_indptr, p.batch, p.total_q, thread, num_threads) &
         indptr_part_ok(p.kv_indptr, p.batch, p.total_kv, thread, num_threads);
}

__device__ __forceinline__ bool sequence_well_formed(const Params& p, int s) {
  const int q_begin = __ldg(p.qo_indptr + s), q_end = __ldg(p.qo_indptr + s + 1);
  const int kv_begin = __ldg(p.kv_indptr + s), kv_end = __ldg(p.kv_indptr + s + 1);
  bool ok = 0 <= q_begin && q_begin <= q_end && q_end <= p.total_q && 0 <= kv_begin &&
            kv_begin <= kv_end && kv_end <= p.total_kv;
  // Boundaries 0 .. s must not lie after the sequence's start, s + 1 .. n not before its end.
#pragma unroll 1
  for (int i = 0; i <= p.batch; ++i) {
    const int q = __ldg(p.qo_indptr + i), kv = __ldg(p.kv_indptr + i);
    ok &= i <= s ? q <= q_begin && kv <= kv_begin : q >= q_end && kv >= kv_end;
  }
  return ok;
}

// Whether query row r belongs to a well-formed sequence: the last one starting at or before r.
__device__ __forceinline__ bool row_covered(const Params& p, int r) {
  int lo = 0, hi = p.batch - 1;
#pragma unroll 1
  while (lo < hi) {
    const int mid = (lo + hi + 1) / 2;
    if (__ldg(p.qo_indptr + mid) <= r) {
      lo = mid;
    } else {
      hi = mid - 1;
    }
  }
  return __ldg(p.qo_indptr + lo) <= r && r < __ldg(p.qo_indptr + lo + 1) &&
         sequence_well_formed(p, lo);
}

// Malformed batches only: NaN in output and lse (the 4 heads of kv_head) for the rows of
// slot * 32 .. slot * 32 + 31 that no well-formed sequence covers. The slabs of all slots
// cover q's rows; each (slot, KV head) item's slab is poisoned by whoever takes the item,
// kThreads threads together (thread: 0 .. kThreads - 1). Computed rows are never poisoned.
template <typename T, int kThreads>
__device__ __forceinline__ void poison_slab(const Params& p, int slot, int kv_head, int thread) {
  static_assert(kThreads == 1 || kThreads % kTokensPerTile == 0, "whole rows per pass");
  constexpr int kThreadsPerRow = kThreads == 1 ? 1 : kThreads / kTokensPerTile;
  constexpr int kChunks = kGroupSize * kChunksPerRow;  // a row's 4 heads: 1 KiB, contiguous
  // 0x7fff is a NaN both as float16 and as bfloat16.
  const uint4 nan_pairs = make_uint4(0x7fff7fffu, 0x7fff7fffu, 0x7fff7fffu, 0x7fff7fffu);
  const float nan = __int_as_float(0x7fffffff);
#pragma unroll 1
  for (int token = thread / kThreadsPerRow; token < kTokensPerTile;
       token += kThreads / kThreadsPerRow) {
    const int64_t row = int64_t(slot) * kTokensPerTile + token;
    if (row >= p.total_q || row_covered(p, int(row))) continue;
    uint4* out = reinterpret_cast<uint4*>(static_cast<T*>(p.out) +
                                          (row * kNumHeads + kv_head * kGroupSize) * kHeadDim);
#pragma unroll 1
    for (int chunk = thread % kThreadsPerRow; chunk < kChunks; chunk += kThreadsPerRow) {
      out[chunk] = nan_pairs;
    }
    if (thread % kThreadsPerRow == 0) {
      *reinterpret_cast<float4*>(p.lse + row * kNumHeads + kv_head * kGroupSize) =
          make_float4(nan, nan, nan, nan);
    }
  }
}

// Keys of ragged sequence `seq`, whose K/V entries are kv_indptr[seq] .. kv_indptr[seq + 1]:
// one key an entry (rows of k and v). A paged batch lists pages there (PagedKeys, kv_paged.cuh).
struct RowsAreKeys {
  __device__ __forceinline__ int operator()(int /*seq*/, int entries) const { return entries; }
};

// The order in which items are drawn, in L2 sections. Items are numbered level * units + unit:
// each level (query tiles at the same place from the end: level 0, the last tiles, the
// heaviest under a causal mask) over every unit ((sequence, KV head) pairs of a padded batch,
// the KV heads of a ragged sequence) before the next level. All items of a unit read its K/V,
// so drawn in that order the items in flight touch every unit's K/V at once: 8x2048's 64 MB of
// K/V missed L2 (DRAM 65% busy against FlashInfer's 17% under ncu; cuda/TUNING.md). Drawn
// instead in sections of `section` units whose K/V fit L2 (the host's l2_section_pairs and
// l2_section_keys), each section level by level: draw `item` takes the item returned (in the
// numbering above; a bijection of [0, levels * units)).
__host__ __device__ __forceinline__ int l2_section_order(int item, int units, int levels,
                                                         int section) {
  const int s = item / (section * levels);
  const int within = item - s * section * levels;
  const int size = section < units - s * section ? section : units - s * section;  // last: fewer
  return within / size * units + s * section + within % size;
}

// Padded batches: the item drawn `item`-th, as locate_tile numbers them (slot * kNumKvHeads +
// kv_head, slot = local * batch + seq: the units are (seq, kv head) pairs).
__device__ __forceinline__ int padded_item(const Params& p, int section_pairs, int item) {
  return l2_section_order(item, p.batch * kNumKvHeads, p.tiles_per_seq, section_pairs);
}

// The query tile of CTA slot `slot` (blockIdx.x / 8); false for a spare slot (uniform over
// the CTA, which then returns) and, in a malformed batch (!batch_ok), for a slot of a sequence
// that is not well-formed.
//
// Ragged batches go sequence by sequence. With section_keys > 0 (the Hopper kernels: keys of
// one KV head whose K/V fit the L2 budget, l2_section_keys on the host) a sequence of seq_kv
// keys draws its items in sections of section_keys / seq_kv KV heads (1 to 8; the units of
// l2_section_order, its slots the levels): kv_head (in: the drawn item's) and the slot become
// those of the item drawn there, a bijection of the sequence's items.
template <bool kCausal, bool kRagged, typename SequenceKeys = RowsAreKeys>
__device__ __forceinline__ bool locate_tile(const Params& p, int slot, bool batch_ok,
                                            TileCoords& t, const SequenceKeys& keys = {},
                                            int* kv_head = nullptr, int section_keys = 0) {
  // Row indices fit in 32 bits (the host checks batch * seq_q and batch * seq_kv); element
  // offsets are 64-bit.
  int q_start, seq_q, local;
  if constexpr (kRagged) {
    // Sequence s owns slots [qo_indptr[s] / 32 + s, qo_indptr[s + 1] / 32 + s + 1): at least
    // cdiv(q_len, 32) of them, and the grid has total_q / 32 + batch slots in all. Find the
    // last sequence whose first slot is <= slot (first slots increase strictly with s).
    int lo = 0, hi = p.batch - 1;
    while (lo < hi) {
      const int mid = (lo + hi + 1) / 2;
      if (__ldg(p.qo_indptr + mid) / kTokensPerTile + mid <= slot) {
        lo = mid;
      } else {
        hi = mid - 1;
      }
    }
    if (!batch_ok && !sequence_well_formed(p, lo)) return false;
    const int qo_begin = __ldg(p.qo_indptr + lo);
    // Clamped so that an inconsistent indptr cannot address outside the tensors.
    const int q_begin = min(max(qo_begin, 0), p.total_q);
    const int q_end = min(max(__ldg(p.qo_indptr + lo + 1), q_begin), p.total_q);
    const int kv_begin = min(max(__ldg(p.kv_indptr + lo), 0), p.total_kv);
    const int kv_end = min(max(__ldg(p.kv_indptr + lo + 1), kv_begin), p.total_kv);
    q_start = q_begin;
    t.kv_start = kv_begin;
    seq_q = q_end - q_begin;
    t.seq_kv = keys(lo, kv_end - kv_begin);
    const int first_slot = qo_begin / kTokensPerTile + lo;
    local = slot - first_slot;
    if (section_keys > 0 && t.seq_kv > 0 && section_keys / t.seq_kv < kNumKvHeads) {
      const int slots = __ldg(p.qo_indptr + lo + 1) / kTokensPerTile + lo + 1 - first_slot;
      const int item = l2_section_order(local * kNumKvHeads + *kv_head, kNumKvHeads, slots,
                                        max(1, section_keys / t.seq_kv));
      local = item / kNumKvHeads;
      *kv_head = item % kNumKvHeads;
    }
  } else {
    // Every sequence's last tiles first (the heaviest under a causal mask): the persistent
    // Hopper kernel takes slots in this order.
    const int seq = slot % p.batch;
    local = slot / p.batch;
    seq_q = p.seq_q;
    t.seq_kv = p.seq_kv;
    q_start = seq * seq_q;
    t.kv_start = seq * p.seq_kv;
  }
  const int num_q_tiles = (seq_q + kTokensPerTile - 1) / kTokensPerTile;
  if (local < 0 || local >= num_q_tiles) return false;  // a spare slot
  // Last tiles first: under a causal mask they see the most keys, so they start earliest.
  const int tile = num_q_tiles - 1 - local;
  t.tok0 = tile * kTokensPerTile;
  t.tile_tokens = min(kTokensPerTile, seq_q - t.tok0);
  t.causal_offset = t.seq_kv - seq_q;
  t.q_row0 = q_start + t.tok0;
  t.kv_len = t.seq_kv;
  if constexpr (kCausal) {
    t.kv_len = max(0, min(t.seq_kv, t.tok0 + t.tile_tokens - 1 + t.causal_offset + 1));
  }
  return true;
}

}  // namespace gqa_prefill
