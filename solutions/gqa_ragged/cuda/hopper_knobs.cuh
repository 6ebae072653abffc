// The tuning knobs, as template parameters (FlashAttention-3's tile_size.h: tile sizes from one
// small function): HopperKnobs (one Hopper kernel family's tiles, ring, register split, softmax
// and schedule), shipped_knobs (the defaults per family), BuildKnobs (every knob of a build).
// A variant is another BuildKnobs named by GQA_PREFILL_KNOBS before the includes
// (scripts/tune_cuda.py); the entry exports the knobs it was built with (built_knobs).
#pragma once

#include <cstdint>
#include <type_traits>

#include "kernel_config.cuh"

#if defined(GQA_PREFILL_FOLD_SCALE) || defined(GQA_PREFILL_FP8_BF16_BITS)
#error "knob macros are gone: name a BuildKnobs<...> in GQA_PREFILL_KNOBS (scripts/tune_cuda.py)"
#endif

namespace gqa_prefill {

// The Hopper kernel's knobs for one kernel family. kBlockN: keys per K/V tile; kKvStages: K/V
// ring depth (each of K and V); producer / consumer registers after setmaxnreg (the paged
// gather and FP8 loaders set their producer's own: kv_paged*.cuh); kFoldScale: the softmax
// scale folded into the exponentials (one FFMA a logit) or applied to the logits first (one
// FMUL each); kOwnOutputBuffer: the output is staged in a buffer of its own (the producer loads
// the next item's Q during the epilogue), else in Q's; kPersistent: one CTA per SM drawing items
// from a counter, else one CTA per item; kPingpong: FA3's turns, the consumer warpgroups issue
// their GEMMs of a tile one after the other (named barriers), so one's softmax runs under the
// other's GEMMs. Every bound is checked here (shared memory: HopperSmem), so a variant that
// cannot work fails to compile.
template <int kBlockN_, int kKvStages_, int kProducerRegisters_, int kConsumerRegisters_,
          bool kFoldScale_, bool kOwnOutputBuffer_, bool kPersistent_, bool kPingpong_>
struct HopperKnobs {
  static constexpr int kBlockN = kBlockN_;
  static constexpr int kKvStages = kKvStages_;
  static constexpr int kProducerRegisters = kProducerRegisters_;
  static constexpr int kConsumerRegisters = kConsumerRegisters_;
  static constexpr bool kFoldScale = kFoldScale_;
  static constexpr bool kOwnOutputBuffer = kOwnOutputBuffer_;
  static constexpr bool kPersistent = kPersistent_;
  static constexpr bool kPingpong = kPingpong_;
  static constexpr uint32_t kKvTileBytes = kBlockN * kHeadDim * 2;
  static constexpr uint32_t kKvHalfBytes = kKvTileBytes / 2;

  // wgmma n <= 256 and a TMA box <= 256 rows; P V steps over k16 blocks of keys.
  static_assert(kBlockN >= 16 && kBlockN <= 256 && kBlockN % 16 == 0,
                "kBlockN: a multiple of 16 in [16, 256]");
  static_assert(kKvHalfBytes % 1024 == 0, "swizzle atoms stay 1024-byte aligned");
  static_assert(kKvStages >= 2, "kKvStages: the producer loads at least a tile ahead");
  static_assert(kProducerRegisters >= 24 && kProducerRegisters <= 256 &&
                    kProducerRegisters % 8 == 0 && kConsumerRegisters >= 24 &&
                    kConsumerRegisters <= 256 && kConsumerRegisters % 8 == 0,
                "setmaxnreg takes a multiple of 8 in [24, 256]");
  // 128 producer + 256 consumer threads share 64 K registers.
  static_assert(kProducerRegisters * 128 + kConsumerRegisters * 256 <= 64 * 1024,
                "registers: 128 x producer + 256 x consumer exceeds 64 K");
};

// The Hopper kernel families, each with knobs of its own: causal (ragged, padded and the
// sliding window), full (padded non-causal) and paged (page sizes 64 and 1, FP8 caches; their
// tiles are two pages of 64 keys).
enum class KernelFamily { kCausal, kFull, kPaged };

struct KnobValues {
  int block_n, kv_stages, producer_registers, consumer_registers;
  bool fold_scale, own_output_buffer, persistent, pingpong;
};

// The shipped knobs (the measurements: TUNING.md). Causal: 128-key tiles, persistent, an output
// buffer of its own; the producer keeps 32 registers (its ragged sequence search spills at 24).
// Full: 192-key tiles (FlashInfer fa3's; against FA3's 176: +0.4-2% one call at a time and
// +1.2% back to back on 16K and 2x8192 keys, TUNING.md; sequences of up to 4096 keys take the
// causal family's tiles instead), which need 240 registers per consumer thread and leave no
// room for an output buffer; persistent too (items cost the same, but a CTA
// per item paid its setup and first loads each time: +2-7% on 4x512, TUNING.md), with FA3's
// turns between the warpgroups (4x512 +5%; the causal and paged kernels gained nothing or lost
// with them: TUNING.md). Paged: the causal knobs (the gather and FP8 loaders keep 40 producer
// registers).
constexpr KnobValues shipped_knobs(KernelFamily family) {
  return family == KernelFamily::kFull ? KnobValues{192, 2, 24, 240, true, false, true, true}
                                       : KnobValues{128, 2, 32, 232, true, true, true, false};
}

// (C++17 takes no class-type template parameters: each field is passed on.)
template <KernelFamily kFamily>
using ShippedKnobs =
    HopperKnobs<shipped_knobs(kFamily).block_n, shipped_knobs(kFamily).kv_stages,
                shipped_knobs(kFamily).producer_registers,
                shipped_knobs(kFamily).consumer_registers, shipped_knobs(kFamily).fold_scale,
                shipped_knobs(kFamily).own_output_buffer, shipped_knobs(kFamily).persistent,
                shipped_knobs(kFamily).pingpong>;

// Every knob of a build: the three families' HopperKnobs, and two of the FP8 caches' kernels
// (kv_paged_fp8.cuh): kFp8Bf16Bits, their bf16 conversion (both FP8 kernels): true with integer
// ops and a bf16x2 multiply, false with the hardware cvt e4m3x2 -> f16x2, then f16 -> f32 ->
// bf16x2; kFp8SplitQ (the Hopper kernel, bf16 q): Q K^T as two e4m3 products on the cache's K
// as TMA loads it (q split into two exact e4m3 terms per item), V alone converted (shipped:
// 1.18-1.26x the conversion of both on an H200); false: K and V converted (TUNING.md, FP8: the
// split); kFp8F16Pv (the Hopper kernel, bf16 q): P V in float16, V converted with the hardware
// cvt e4m3x2 -> f16x2 (one instruction a pair) and P packed as f16 (11 significant bits, bf16's
// 8; P <= 1 and |V| <= 448 fit), the output still bf16; false: V and P in bf16 (TUNING.md, FP8:
// P V in float16). kIdleWarpgroupWaits (every Hopper kernel without turns): a consumer
// warpgroup whose 64 rows hold no token of the item (a decode-like item's 4-16 rows are all
// warpgroup 0's) computes nothing for it, only frees each ring stage once loaded and Q's
// buffer (TUNING.md, decode-like rows: the idle warpgroup; FP8 single-token rows 1.25x).
// kShareWaves (host plan, kv_shares in split_merge.cuh): decode-like paged batches split each
// item's keys into enough shares for this many items an SM.
template <typename Causal, typename Full, typename Paged, bool kFp8Bf16Bits_,
          bool kFp8SplitQ_ = false, bool kFp8F16Pv_ = false, bool kIdleWarpgroupWaits_ = false,
          int kShareWaves_ = 8>
struct BuildKnobs {
  using CausalTiles = Causal;
  using FullTiles = Full;
  using PagedTiles = Paged;
  static constexpr bool kFp8Bf16Bits = kFp8Bf16Bits_;
  static constexpr bool kFp8SplitQ = kFp8SplitQ_;
  static constexpr bool kFp8F16Pv = kFp8F16Pv_;
  static constexpr bool kIdleWarpgroupWaits = kIdleWarpgroupWaits_;
  static constexpr int kShareWaves = kShareWaves_;
};

// Every flag named: a template default flipped alone does not change the shipped build.
using ShippedBuildKnobs = BuildKnobs<ShippedKnobs<KernelFamily::kCausal>,
                                     ShippedKnobs<KernelFamily::kFull>,
                                     ShippedKnobs<KernelFamily::kPaged>, true, true, true, true, 8>;

// The one hook: a variant defines GQA_PREFILL_KNOBS as a BuildKnobs<...> type.
#ifndef GQA_PREFILL_KNOBS
#define GQA_PREFILL_KNOBS ShippedBuildKnobs
#endif
using Knobs = GQA_PREFILL_KNOBS;

template <bool kCausal>
using HopperTiles = std::conditional_t<kCausal, Knobs::CausalTiles, Knobs::FullTiles>;
using PagedHopperTiles = Knobs::PagedTiles;
// The FP8 kernels keep the shipped paged knobs whatever a variant asks of the paged family:
// their staging buffer 0 lives in the output buffer of a two-stage ring (kv_paged_fp8.cuh).
using Fp8HopperTiles = ShippedKnobs<KernelFamily::kPaged>;
static_assert(Fp8HopperTiles::kBlockN == PagedHopperTiles::kBlockN &&
                  Fp8HopperTiles::kPersistent == PagedHopperTiles::kPersistent,
              "the paged launch schedules FP8's items with the paged family's tiles");

}  // namespace gqa_prefill
