// The Hopper kernel (FlashAttention-3 style: TMA, wgmma, warp-specialized; sm_90a only),
// described below, over either K/V source (kv_contiguous.cuh, kv_paged.cuh); its tile sizes,
// shared-memory layout and schedule are in hopper_layout.cuh.
#pragma once

#include <type_traits>

#include "epilogue.cuh"
#include "hopper_layout.cuh"
#include "kernel_config.cuh"
#include "kv_contiguous.cuh"
#include "kv_paged.cuh"
#include "mask_softmax.cuh"
#include "ptx_sm80.cuh"
#include "ptx_sm90.cuh"
#include "tile_schedule.cuh"

namespace gqa_prefill {

// ---- The Hopper kernel (TMA, wgmma, warp-specialized; sm_90a only) ------------------------
//
// FlashAttention-3's structure, with the same 128-row query tiles, row order and tile placement
// as the portable kernel. 384 threads in three warpgroups:
//   producer (warpgroup 0; thread 0 leads): takes work items (query tile, KV head), finds
//     their sequence (locate_tile; in a malformed ragged batch it also poisons every item's
//     slab, spare ones included) and hands them to the consumers through a 2-slot item buffer,
//     then loads Q with TMA; the K/V source's TileLoader (one thread issuing TMA boxes, or the
//     warpgroup gathering paged rows) streams K/V tiles into a ring (2 stages shipped), each load
//     completing on an mbarrier (full), each stage reused once the consumers release it (empty),
//     for paged K/V, K one tile ahead of V as in FA3;
//   consumers (warpgroups 1 and 2, 64 rows each): S = Q K^T (wgmma, A and B from shared
//     memory), the online softmax in registers, O += P V (wgmma, A = P from registers),
//     with S[n + 1] issued before P[n] V[n] so that the softmax of one tile runs while the
//     tensor cores work on the other, O's rescale done before P V while Q K^T runs, and the
//     scale folded into the exponentials (one FFMA per logit; the host runs the portable
//     kernel for a scale <= 0); then the epilogue (normalize, lse, stage the rows in shared
//     memory, 16-byte coalesced stores).
// setmaxnreg moves registers from the producer warpgroup to the consumers.
//
// With the shipped knobs (hopper_knobs.cuh), the kernels are persistent: the grid is one CTA per
// SM, and the producer takes the next item with an atomic add on a per-stream counter (next_item),
// items ordered heaviest first, so that SMs that drew short items take more. The last CTA to draw
// past the end zeroes the counter, so the next launch on the stream finds it at 0 without a memset.
// While the consumers finish an item, the producer already loads the next one's K/V, and its Q
// where the output has a buffer of its own (causal tiles). Non-causal tiles have 192 keys
// (FlashInfer fa3's choice for head_dim 128), which leave no room for an output buffer: the
// output is staged in Q's buffer, so the next item's Q waits for the epilogue.
//
// Shared-memory tiles are stored as two 64-column halves of rows of 128 bytes with the
// 128-byte swizzle (16-byte chunk c of row r at chunk c ^ (r % 8)), 1024-byte aligned: what
// TMA writes with CU_TENSOR_MAP_SWIZZLE_128B and what a wgmma descriptor of layout type
// SWIZZLE_128B reads, K-major for Q and K, MN-major for V. The Q tile comes from a 3-D view
// of q (dim, head, token), box (64, 4 heads, 32 tokens): row r = (token r / 4, head r % 4).
// K/V tiles come from the K/V source (contiguous: boxes (64, 1, kBlockN) of (dim, kv head,
// token)). Keys past a sequence's end are masked to -inf, and the sources make sure that the V
// rows there are finite (0 * NaN would be NaN).
//
// Only an sm_90a build compiles the body (wgmma, setmaxnreg); elsewhere the kernel is a stub
// that traps. The host cannot see __CUDA_ARCH_FEAT_SM90_ALL, so the two versions declare
// different maximum block sizes (__launch_bounds__): the host reads the loaded version's
// value with cudaFuncGetAttributes (maxThreadsPerBlock) and runs this kernel only where it is
// kWgmmaThreads (see prefill_entry.cu).

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GQA_WGMMA_BOUNDS __launch_bounds__(kWgmmaThreads, 1)
#else
#define GQA_WGMMA_BOUNDS __launch_bounds__(kWgmmaStubThreads, 1)
#endif

// Whether a TileLoader uses the output buffer for itself (kUsesOutputBuffer; the FP8 loader's
// staging): then the consumers write O from registers.
// Whether a K/V source's items may be split into key shares (the paged ones: they name the keys
// an entry of kv_start holds, kKeysPerEntry). Contiguous K/V never splits: its kernels keep
// their code.
template <typename K, typename = void>
struct KvSplitsKeys : std::false_type {};
template <typename K>
struct KvSplitsKeys<K, std::void_t<decltype(K::kKeysPerEntry)>> : std::true_type {};

// Whether a TileLoader loads K as e4m3 for an e4m3 Q K^T with q split in two terms (kSplitQ;
// the FP8 loader under Knobs::kFp8SplitQ): the consumers then split Q (Loader::split_q).
template <typename L, typename = void>
struct LoaderSplitsQ : std::false_type {};
template <typename L>
struct LoaderSplitsQ<L, std::void_t<decltype(L::kSplitQ)>> : std::bool_constant<L::kSplitQ> {};

// The element type of a TileLoader's V tiles and so of P V's operands (PvElement; the FP8
// loader's under Knobs::kFp8F16Pv), else q's.
template <typename L, typename T, typename = void>
struct LoaderPvElement {
  using type = T;
};
template <typename L, typename T>
struct LoaderPvElement<L, T, std::void_t<typename L::PvElement>> {
  using type = typename L::PvElement;
};

template <typename L, typename = void>
struct LoaderUsesOutputBuffer : std::false_type {};
template <typename L>
struct LoaderUsesOutputBuffer<L, std::void_t<decltype(L::kUsesOutputBuffer)>>
    : std::bool_constant<L::kUsesOutputBuffer> {};

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// The kernel body for K/V source Kv (its Args: what the source needs beyond HopperParams) with
// knobs Tiles (a HopperKnobs: hopper_knobs.cuh); kWindow: the causal mask's band is a sliding
// window of p.window_left keys (KeyBand): the producer clips each item's keys to the band
// (consumers and loader see the clipped item), the consumers mask its left edge too.
template <typename T, bool kCausal, typename Kv, typename Tiles, bool kWindow = false>
__device__ __forceinline__ void hopper_attention(const HopperParams& hp,
                                                 const typename Kv::Args& args) {
  constexpr bool kRagged = Kv::kRagged;
  using Loader = typename Kv::TileLoader;
  using Smem = HopperSmem<Tiles>;
  using RingSlot = gqa_prefill::RingSlot<Tiles::kKvStages>;
  constexpr int kBlockN = Tiles::kBlockN;
  constexpr bool kFoldScale = Tiles::kFoldScale;
  constexpr int kProducerRegisters = Loader::template producer_registers<Tiles>();
  static_assert(kProducerRegisters >= 24 && kProducerRegisters % 8 == 0 &&
                    kProducerRegisters * 128 + Tiles::kConsumerRegisters * 256 <= 64 * 1024,
                "the loader's producer registers and the consumers' exceed 64 K or setmaxnreg");
  const Params& p = hp.p;
  const KeyBand<kWindow> band{p.window_left};
  extern __shared__ __align__(1024) unsigned char wgmma_smem[];
  // 1024-byte alignment (the swizzle pattern repeats every 8 rows of 128 bytes).
  const uint32_t raw_base = smem_addr(wgmma_smem);
  const uint32_t base = (raw_base + 1023) & ~1023u;
  const uint32_t sQ = base + Smem::kQ;
  const uint32_t sK = base + Smem::kK;
  const uint32_t sV = base + Smem::kV;
  const uint32_t sO = base + Smem::kO;
  // mbarriers (8 bytes each): full = data landed, empty = the consumers are done with it.
  const uint32_t q_full = base + Smem::kQFull, q_empty = base + Smem::kQEmpty;
  const uint32_t k_full = base + Smem::kKFull, k_empty = base + Smem::kKEmpty;  // + 8 * stage
  const uint32_t v_full = base + Smem::kVFull, v_empty = base + Smem::kVEmpty;
  const uint32_t item_full = base + Smem::kItemFull;  // + 8 * slot
  const uint32_t item_empty = base + Smem::kItemEmpty;
  const uint32_t kv_flags = base + Smem::kKvFlags;  // + 4 * stage
  WorkItem* items = reinterpret_cast<WorkItem*>(wgmma_smem + (base - raw_base) + Smem::kItems);

  const int tid = threadIdx.x;
  if (tid == 0) {
    mbarrier_init(q_full, 1);
    mbarrier_init(q_empty, kConsumerThreads);
    for (int s = 0; s < Tiles::kKvStages; ++s) {
      mbarrier_init(k_full + 8 * s, Loader::kKFullArrivals);
      mbarrier_init(k_empty + 8 * s, kConsumerThreads);
      mbarrier_init(v_full + 8 * s, Loader::kVFullArrivals);
      mbarrier_init(v_empty + 8 * s, kConsumerThreads);
    }
    for (int slot = 0; slot < Smem::kItemSlots; ++slot) {
      mbarrier_init(item_full + 8 * slot, 1);
      // Read by the consumers and by the loader's threads other than the leader.
      mbarrier_init(item_empty + 8 * slot, kConsumerThreads + Loader::kThreads - 1);
    }
    asm volatile("fence.mbarrier_init.release.cluster;\n" ::: "memory");
  }
  // Ragged: whether the batch is valid, checked once by all threads together (the producer
  // alone uses it).
  bool batch_ok = true;
  if constexpr (kRagged) {
    batch_ok = __syncthreads_and(batch_part_ok(p, tid, kWgmmaThreads));
  } else {
    __syncthreads();
  }

  if (tid < 128) {
    // ---- Producer warpgroup: the loader's threads work, the others leave. Thread 0 (the
    // leader) draws the items and loads Q; the loader's other threads read each item.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegisters));
    if (Loader::kThreads == 1 ? tid != 0 : tid >= Loader::kThreads) return;
    const bool leader = Loader::kThreads == 1 || tid == 0;
    Loader loader(hp, args, tid);
    if (leader) tma_prefetch_descriptor(hp.q_map);
    loader.prefetch_descriptors();
    uint32_t tile_count = 0;
    int item = blockIdx.x;
#pragma unroll 1
    for (uint32_t n_item = 0;; ++n_item) {
      WorkItem w;
      // Fields a spare slot leaves unset would otherwise stay live from item to item.
      if constexpr (Loader::kThreads > 1) w = WorkItem{};
      if (leader) {
        w.valid = 0;
        while (item < hp.num_items) {
          int item_of_tile = item;  // item = (tile slot x KV head) x shares + share
          w.share = 0;
          if constexpr (KvSplitsKeys<Kv>::value) {
            if (hp.kv_shares > 1) {
              w.share = item % hp.kv_shares;
              item_of_tile = item / hp.kv_shares;
            }
          }
          if constexpr (!kRagged) item_of_tile = padded_item(p, hp.section_pairs, item_of_tile);
          w.kv_head = item_of_tile % kNumKvHeads;
          const int tile_slot = item_of_tile / kNumKvHeads;
          // Every item this thread draws passes here once, spare ones included.
          if (kRagged && !batch_ok) poison_slab<T, 1>(p, tile_slot, w.kv_head, 0);
          if (Kv::template locate<kCausal>(p, args, tile_slot, batch_ok, w.t, &w.kv_head,
                                           hp.section_keys)) {
            if constexpr (kWindow) band.clip(w.t);  // keys from the band's first on
            if constexpr (KvSplitsKeys<Kv>::value) {
              if (hp.kv_shares > 1) {
                clip_to_share<kBlockN, Kv::kKeysPerEntry>(w.t, w.share, hp.kv_shares);
              }
            }
            w.valid = 1;
            break;
          }
          item = next_item(hp, item);  // a spare or malformed sequence's slot of a ragged batch
        }
        const uint32_t slot = n_item % 2;
        mbarrier_wait(item_empty + 8 * slot, ((n_item / 2) & 1) ^ 1);
        items[slot] = w;
        mbarrier_arrive(item_full + 8 * slot);
      } else {
        const uint32_t slot = n_item % 2;
        mbarrier_wait(item_full + 8 * slot, (n_item / 2) & 1);
        w = items[slot];
        mbarrier_arrive(item_empty + 8 * slot);
      }
      if (!w.valid) return;

      if (leader) {
        mbarrier_wait(q_empty, (n_item & 1) ^ 1);
        mbarrier_arrive_expect_tx(q_full, kQTileBytes);
        for (int half = 0; half < 2; ++half) {
          tma_load_3d(sQ + half * kQHalfBytes, hp.q_map, q_full, half * 64,
                      w.kv_head * kGroupSize, w.t.q_row0);
        }
      }
      loader.start_item(w);
      const int num_kv_tiles = (w.t.kv_len + kBlockN - 1) / kBlockN;
      auto load_k = [&](int n, const RingSlot& ring) {
        loader.template start_tile<Tiles>(w, n);
        mbarrier_wait(k_empty + 8 * ring.stage, ring.parity ^ 1);
        loader.template load_k<Tiles>(sK + ring.stage * Tiles::kKvTileBytes,
                                      k_full + 8 * ring.stage, w);
      };
      auto load_v = [&](const RingSlot& ring) {
        mbarrier_wait(v_empty + 8 * ring.stage, ring.parity ^ 1);
        loader.template load_v<Tiles>(sV + ring.stage * Tiles::kKvTileBytes,
                                      v_full + 8 * ring.stage, kv_flags + 4 * ring.stage, w);
      };
      if constexpr (Loader::kKAhead) {
        // FA3's order, K of tile n + 1 before V of tile n: K's stage is free once S[n - 1] is
        // done, V's only once P V[n - 1] is, so K no longer queues behind V's wait and its
        // loads get half a tile more time to land (TUNING.md, K ahead).
        if (num_kv_tiles > 0) load_k(0, RingSlot(tile_count));
#pragma unroll 1
        for (int n = 0; n < num_kv_tiles; ++n, ++tile_count) {
          loader.keep_for_v();
          if (n + 1 < num_kv_tiles) load_k(n + 1, RingSlot(tile_count + 1));
          load_v(RingSlot(tile_count));
        }
      } else {
#pragma unroll 1
        for (int n = 0; n < num_kv_tiles; ++n, ++tile_count) {
          const RingSlot ring(tile_count);
          load_k(n, ring);
          load_v(ring);
        }
      }
      if (leader) item = next_item(hp, item);
    }
  }

  // ---- Consumer warpgroups.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(Tiles::kConsumerRegisters));
  using Pv = typename LoaderPvElement<Loader, T>::type;  // P's packing, V's tiles
  using Ops = ElementOps<Pv>;
  using WgmmaS = WgmmaSS<T, kBlockN>;
  constexpr bool kSplitQ = LoaderSplitsQ<Loader>::value;
  static_assert(!kSplitQ || (kBlockN == 128 && kFoldScale),
                "the e4m3 Q K^T: 128-key tiles (m64n128k32), the scale folded per row");
  using WgmmaPV = WgmmaRS<Pv>;
  constexpr int kSB = kBlockN / 8;   // n8 blocks of a score tile
  constexpr int kPK = kBlockN / 16;  // k16 steps of P V
  const int ctid = tid - 128;        // 0 .. 255
  const int warp = ctid / 32;        // owns rows 16 warp .. 16 warp + 15 of the tile
  const int warpgroup = warp / 4;    // owns rows 64 warpgroup .. + 63
  const int lane = ctid % 32;
  const int group = lane / 4;
  const int quad_lane = lane % 4;

  // Descriptors. A (Q): this warpgroup's 64 rows; k step ks (16 columns) is 32 bytes further
  // within a 64-column half (the hardware applies the swizzle to the computed addresses).
  // B (K): all kBlockN keys, the same k steps. B (V): k step ks = keys 16 ks .. 16 ks + 15,
  // 16 rows of 128 bytes further.
  const uint64_t q_desc = smem_desc(sQ + warpgroup * 64 * 128, 16);
  const uint64_t k_desc = smem_desc(sK, 16);
  const uint64_t v_desc = smem_desc(sV, Tiles::kKvHalfBytes);
  constexpr uint64_t kStageStep = Tiles::kKvTileBytes >> 4;  // descriptor units (16 bytes)

  // FA3's turns (Tiles::kPingpong): a warpgroup issues a tile's GEMMs after the other has issued
  // its own (barrier kTurn + warpgroup, which the other arrives on), so one's softmax runs under
  // the other's GEMMs. Warpgroup 0 goes first: it arrives on its own barrier once. Each
  // warpgroup takes and passes a turn once a tile of every item (both see the same tiles), the
  // last tile's P V aside.
  constexpr int kTurn = 5;  // and 6 (1 + warpgroup: the epilogue, 3: both, 4: the FP8 loader)
  auto take_turn = [&]() {
    if constexpr (Tiles::kPingpong) named_barrier_sync(kTurn + warpgroup, kConsumerThreads);
  };
  auto pass_turn = [&]() {
    if constexpr (Tiles::kPingpong) named_barrier_arrive(kTurn + 1 - warpgroup, kConsumerThreads);
  };
  if constexpr (Tiles::kPingpong) {
    if (warpgroup == 0) named_barrier_arrive(kTurn, kConsumerThreads);
  }

  uint32_t tile_count = 0;
#pragma unroll 1
  for (uint32_t n_item = 0;; ++n_item) {
    const uint32_t slot = n_item % 2;
    mbarrier_wait(item_full + 8 * slot, (n_item / 2) & 1);
    const WorkItem w = items[slot];
    mbarrier_arrive(item_empty + 8 * slot);
    if (!w.valid) return;
    const TileCoords& t = w.t;
    const int num_kv_tiles = (t.kv_len + kBlockN - 1) / kBlockN;
    const int row_token = t.tok0 + (warp * 16 + group) / kGroupSize;

    // S = Q K^T of ring tile i (64 rows x kBlockN keys per warpgroup), issued and committed.
    // kSplitQ: e4m3 rows of 128 bytes, q_hi's where Q's first half was, q_lo's where its second
    // was, K's e4m3 tile at the stage: 4 k32 steps of 32 bytes for each term.
    auto issue_s = [&](float (&s)[kSB][4], const RingSlot& ring) {
      wgmma_fence();
      if constexpr (kSplitQ) {
#pragma unroll
        for (int ks = 0; ks < 8; ++ks) {
          const uint64_t q_step = ((ks / 4) * kQHalfBytes + (ks % 4) * 32) >> 4;
          const uint64_t k_step = ((ks % 4) * 32) >> 4;
          wgmma_e4m3_ss_n128(s, q_desc + q_step, k_desc + ring.stage * kStageStep + k_step,
                             ks > 0);
        }
      } else {
#pragma unroll
        for (int ks = 0; ks < kHeadDim / 16; ++ks) {
          const uint64_t q_step = ((ks / 4) * kQHalfBytes + (ks % 4) * 32) >> 4;
          const uint64_t k_step = ((ks / 4) * Tiles::kKvHalfBytes + (ks % 4) * 32) >> 4;
          WgmmaS::run(s, q_desc + q_step, k_desc + ring.stage * kStageStep + k_step, ks > 0);
        }
      }
      wgmma_commit();
    };
    float acc[kHeadDim / 8][4];
#pragma unroll
    for (int i = 0; i < kHeadDim / 8; ++i) {
#pragma unroll
      for (int j = 0; j < 4; ++j) acc[i][j] = 0.f;
    }
    // O += P V of ring tile i, issued and committed.
    uint32_t pa[kPK][4];
    auto issue_pv = [&](const RingSlot& ring) {
      fence_operands(acc);
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kPK; ++ks) {
        WgmmaPV::run(acc, pa[ks], v_desc + ring.stage * kStageStep + ((ks * 16 * 128) >> 4));
      }
      wgmma_commit();
    };
    auto pack_p = [&](const float (&s)[kSB][4]) {
#pragma unroll
      for (int ks = 0; ks < kPK; ++ks) {
        pa[ks][0] = Ops::pack(s[2 * ks][0], s[2 * ks][1]);
        pa[ks][1] = Ops::pack(s[2 * ks][2], s[2 * ks][3]);
        pa[ks][2] = Ops::pack(s[2 * ks + 1][0], s[2 * ks + 1][1]);
        pa[ks][3] = Ops::pack(s[2 * ks + 1][2], s[2 * ks + 1][3]);
      }
    };
    // Q's buffer is free for the next item once the last S of this one is done (causal), or
    // once the output staged in it has been written out (non-causal).
    auto release_q = [&]() {
      if constexpr (!Tiles::kOwnOutputBuffer) fence_proxy_async();  // generic use -> TMA
      mbarrier_arrive(q_empty);
    };
    // The item's last tile: keys of the sequence, then rows (the next sequence's keys, the rest
    // of a page) that may hold NaN or inf, which 0 x NaN would carry into O. Where the loader
    // leaves them to the consumers, both warpgroups zero them before the last P V.
    auto zero_v_tail = [&](const RingSlot& last) {
      if constexpr (Loader::kZeroesVTail) {
        const int rows = t.seq_kv - (num_kv_tiles - 1) * kBlockN;
        if (rows < kBlockN &&
            Loader::template zero_v_tail<Tiles>(sV + last.stage * Tiles::kKvTileBytes, rows,
                                                ctid)) {
          named_barrier_sync(3, kConsumerThreads);  // both warpgroups' zeros, before P V
        }
      }
    };
    float row_max[2] = {-INFINITY, -INFINITY};
    float row_sum[2] = {0.f, 0.f};
    bool poisoned = false;  // the K/V source met a page id out of range (paged sources)

    mbarrier_wait(q_full, n_item & 1);
    if constexpr (Knobs::kIdleWarpgroupWaits && !Tiles::kPingpong) {
      // No token of the item in this warpgroup's rows (a decode-like item's are warpgroup
      // 0's): nothing to compute or store. It keeps its part of every barrier the working
      // warpgroup's loop meets: each stage freed once loaded (its arrival counted with the
      // other's, which comes after its GEMMs), the V tail zeroed with it, Q's buffer freed.
      // Through a shuffle, the compiler knows the branch is warp-uniform: without it the ring
      // counter, updated under the branch, would look divergent and every descriptor computed
      // from it would leave the uniform datapath (an R2UR pair before each wgmma).
      if (__shfl_sync(0xffffffffu, 16 * warpgroup >= t.tile_tokens, 0)) {
#pragma unroll 1
        for (int n = 0; n < num_kv_tiles; ++n) {
          const RingSlot ring(tile_count + n);
          mbarrier_wait(k_full + 8 * ring.stage, ring.parity);
          mbarrier_arrive(k_empty + 8 * ring.stage);
          mbarrier_wait(v_full + 8 * ring.stage, ring.parity);
          if (n + 1 == num_kv_tiles) zero_v_tail(ring);
          mbarrier_arrive(v_empty + 8 * ring.stage);
        }
        tile_count += num_kv_tiles;
        mbarrier_arrive(q_empty);  // Q is never read here (release_q's fence not needed)
        continue;
      }
    }
    // kSplitQ: Q as two e4m3 terms, each row's scale (2^-e_row) folded into its softmax scale.
    [[maybe_unused]] float split_scale[2];
    if constexpr (kSplitQ) {
      Loader::split_q(sQ, warpgroup, warp % 4, group, quad_lane, split_scale);
      split_scale[0] *= p.scale_log2;
      split_scale[1] *= p.scale_log2;
    }
    // O's rescale factors for the softmax of the latest score tile, applied before the next
    // P V (while the tensor cores run Q K^T).
    float rescale[2] = {1.f, 1.f};
    if (num_kv_tiles > 0) {
      // Prologue: P[0].
      const RingSlot first(tile_count);
      mbarrier_wait(k_full + 8 * first.stage, first.parity);
      if constexpr (Loader::kGenericProxyWrites) fence_proxy_async();  // cp.async -> wgmma
      float s[kSB][4];
      take_turn();
      issue_s(s, first);
      pass_turn();
      wgmma_wait<0>();
      fence_operands(s);
      mbarrier_arrive(k_empty + 8 * first.stage);
      if (Tiles::kOwnOutputBuffer && num_kv_tiles == 1) release_q();
      // Only the band's first tile crosses a window's left edge (KeyBand).
      if constexpr (kFoldScale) {
        mask_tile<kCausal>(s, t, 0, row_token, quad_lane, band);
      } else {
        scale_and_mask<kCausal>(s, p.scale_log2, t, 0, row_token, quad_lane, band);
      }
      if constexpr (kSplitQ) {
        softmax_tile(s, row_max, row_sum, rescale, split_scale);  // O is 0
      } else {
        softmax_tile(s, row_max, row_sum, rescale, kFoldScale ? p.scale_log2 : 1.f);  // O is 0
      }
      pack_p(s);
    }
    // Iteration n: O += P[n] V[n] runs on the tensor cores while the softmax of S[n + 1]
    // (issued just before it) runs on the CUDA cores. The last tile's P V runs after the loop.
    // Unrolled twice over contiguous K/V in 128-key tiles (causal, window, full128: 0.7-2.3%
    // fewer cycles on the H200, as the Gluon kernel's loop: TUNING.md); the 192-key full family
    // spills unrolled, the paged loaders gain nothing from it (page size 64 0.0%, page size 1's
    // in-loop gather +0.2% on prefix hits, +3.5% on single-token rows; FP8 +0.5%).
    constexpr int kLoopUnroll =
        kBlockN <= 128 && std::is_same_v<Kv, ContiguousKv<kRagged>> ? 2 : 1;
#pragma unroll kLoopUnroll
    for (int n = 0; n + 1 < num_kv_tiles; ++n) {
      const RingSlot current(tile_count + n), next(tile_count + n + 1);
      mbarrier_wait(k_full + 8 * next.stage, next.parity);
      mbarrier_wait(v_full + 8 * current.stage, current.parity);
      if constexpr (Loader::kGenericProxyWrites) fence_proxy_async();
      float s[kSB][4];
      take_turn();
      issue_s(s, next);
      rescale_rows(acc, rescale);
      issue_pv(current);
      pass_turn();
      wgmma_wait<1>();  // S[n + 1] is done; P[n] V[n] may still run
      fence_operands(s);
      mbarrier_arrive(k_empty + 8 * next.stage);
      if (Tiles::kOwnOutputBuffer && n + 2 == num_kv_tiles) release_q();
      if constexpr (kFoldScale) {
        mask_tile<kCausal>(s, t, (n + 1) * kBlockN, row_token, quad_lane);
      } else {
        scale_and_mask<kCausal>(s, p.scale_log2, t, (n + 1) * kBlockN, row_token, quad_lane);
      }
      if constexpr (kSplitQ) {
        softmax_tile(s, row_max, row_sum, rescale, split_scale);
      } else {
        softmax_tile(s, row_max, row_sum, rescale, kFoldScale ? p.scale_log2 : 1.f);
      }
      wgmma_wait<0>();
      fence_operands(acc);
      mbarrier_arrive(v_empty + 8 * current.stage);
      pack_p(s);
    }
    if (num_kv_tiles > 0) {
      const RingSlot last(tile_count + num_kv_tiles - 1);
      mbarrier_wait(v_full + 8 * last.stage, last.parity);
      if constexpr (Loader::kGenericProxyWrites) fence_proxy_async();
      if constexpr (Kv::kMayPoison) poisoned = ld_shared_u32(kv_flags + 4 * last.stage) != 0;
      zero_v_tail(last);
      rescale_rows(acc, rescale);
      issue_pv(last);
      wgmma_wait<0>();
      fence_operands(acc);
      mbarrier_arrive(v_empty + 8 * last.stage);
    } else if (Tiles::kOwnOutputBuffer) {
      release_q();  // no key visible: Q was never read
    }
    tile_count += num_kv_tiles;

    if constexpr (Kv::kMayPoison) {
      if (poisoned || t.seq_kv < 0) poison_rows(acc, row_max, row_sum);
    }
    if constexpr (Kv::kScalesOutput) scale_output(acc, args.v_scale);
    // A key share's rows go to its slice of the shares' output and lse (p.out and p.lse are
    // then [kv_shares x total_q] rows; merge_shares combines them).
    TileCoords out_t = t;
    if constexpr (KvSplitsKeys<Kv>::value) out_t.q_row0 += w.share * p.total_q;

    if constexpr (LoaderUsesOutputBuffer<Loader>::value) {
      // The loader stages in the output buffer: each lane writes its packed pairs (4 bytes)
      // straight from registers, as the portable kernel's threads would without staging.
      T* out_tile = static_cast<T*>(p.out) +
                    (int64_t(out_t.q_row0) * kNumHeads + w.kv_head * kGroupSize) * kHeadDim;
      normalize_rows<T>(p, out_t, w.kv_head, acc, row_max, row_sum, warp, lane,
                        [&](int row, int db, uint32_t pair) {
                          const int token = row / kGroupSize;
                          if (token < out_t.tile_tokens) {
                            *reinterpret_cast<uint32_t*>(
                                out_tile + (int64_t(token) * kNumHeads + row % kGroupSize) *
                                               kHeadDim +
                                db * 8 + quad_lane * 2) = pair;
                          }
                        });
      continue;
    }
    // Epilogue: each warpgroup stages its own 64 rows (swizzled, conflict-free) and writes
    // them out; the barriers keep its threads from overwriting rows still being read.
    // Its addresses are computed here from opaque copies: hoisted out of the item loop, they
    // would be kept live through the main loop (and spilled).
    uint32_t stage = sO;
    int epilogue_tid = ctid;
    asm volatile("" : "+r"(stage), "+r"(epilogue_tid));
    const int epilogue_lane = epilogue_tid % 32;
    normalize_rows<T>(p, out_t, w.kv_head, acc, row_max, row_sum, epilogue_tid / 32,
                      epilogue_lane,
                      [&](int row, int db, uint32_t pair) {
                        const uint32_t addr = stage + swizzled_offset(row, db, kQHalfBytes) +
                                              (epilogue_lane % 4) * 4;
                        asm volatile("st.shared.b32 [%0], %1;\n" ::"r"(addr), "r"(pair)
                                     : "memory");
                      });
    named_barrier_sync(1 + warpgroup, 128);
    copy_rows_out<T, 64, 128>(p, out_t, w.kv_head, (epilogue_tid / 128) * 64, epilogue_tid % 128,
                              [&](int row, int chunk) {
                                uint4 v;
                                asm volatile("ld.shared.v4.b32 {%0, %1, %2, %3}, [%4];\n"
                                             : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                                             : "r"(stage + swizzled_offset(row, chunk,
                                                                           kQHalfBytes))
                                             : "memory");
                                return v;
                              });
    named_barrier_sync(1 + warpgroup, 128);
    if constexpr (!Tiles::kOwnOutputBuffer) release_q();
  }
}
#endif  // __CUDA_ARCH_FEAT_SM90_ALL

template <typename T, bool kCausal, bool kRagged>
__global__ void GQA_WGMMA_BOUNDS gqa_prefill_wgmma_kernel(const __grid_constant__ HopperParams hp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  hopper_attention<T, kCausal, ContiguousKv<kRagged>, HopperTiles<kCausal>>(hp, {});
#else
  __trap();  // never launched: the host runs the portable kernel where this stub is loaded
#endif
}

// Padded non-causal batches of short sequences (uses_short_key_tiles in entry_launch.cuh): the
// full mask on the causal family's tiles (128 keys, the output in a buffer of its own).
template <typename T>
__global__ void GQA_WGMMA_BOUNDS
gqa_prefill_full128_wgmma_kernel(const __grid_constant__ HopperParams hp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  hopper_attention<T, false, ContiguousKv<false>, HopperTiles<true>>(hp, {});
#else
  __trap();
#endif
}

// Paged K/V (causal only: the paged definitions are).
template <typename T, int kPageSize>
__global__ void GQA_WGMMA_BOUNDS
gqa_prefill_paged_wgmma_kernel(const __grid_constant__ PagedHopperParams params) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  hopper_attention<T, true, PagedKv<kPageSize>, PagedHopperTiles>(params.hp, params.pages);
#else
  __trap();
#endif
}

// The sliding window (gqa_ragged_prefill_causal_swa): the ragged causal kernel over the band's
// key tiles only; hp.p.window_left in [0, total_kv).
template <typename T>
__global__ void GQA_WGMMA_BOUNDS
gqa_prefill_swa_wgmma_kernel(const __grid_constant__ HopperParams hp) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  hopper_attention<T, true, ContiguousKv<true>, HopperTiles<true>, true>(hp, {});
#else
  __trap();
#endif
}

}  // namespace gqa_prefill
