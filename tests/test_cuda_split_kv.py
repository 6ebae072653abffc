"""The CUDA split-KV for decode-like paged batches without a GPU: a host program built with nvcc
runs the producer's clip of an item to its key share (clip_to_share, mask_softmax.cuh), the
merge's weights (share_weights) and the host's plan (kv_shares, split_merge.cuh); checked here
against brute force.

- The shares of a query tile cover its keys exactly once, in order, each from a key tile's
  start (an entry's: a page of 64, or a key), shares past the keys empty.
- A clipped share's tile goes unmasked only where every row of the tile sees every key of it:
  the masks the consumers apply (mask_tile) stay right after the shift.
- The merge weighs each share by 2^(lse - max), NaN anywhere makes the row NaN, no key at all
  gives lse -inf and weights 0.
- The plan splits only decode-like batches, into shares of at least 4 key tiles, at most 16.

The kernels themselves on a GPU: tests/test_split_kv_gpu.py, pytest -m gpu
tests/test_solutions.py -k cuda_paged (the decode-like workloads split) and
scripts/sanitize_malformed.py.
"""

import math
import random
import shutil
import subprocess

import pytest

from prefill_bundle.cuda_build import build_host_driver

NVCC = shutil.which("nvcc")
BLOCK_N = 128  # the Hopper kernels' key tile
TOKENS_PER_TILE = 32

DRIVER = r"""
#include <cstdio>
#include <cstring>
#include "hopper_knobs.cuh"
#include "mask_softmax.cuh"
#include "split_merge.cuh"
#include "decode_fp8.cuh"
using namespace gqa_prefill;
// stdin lines:
//   clip tok0 tile_tokens seq_q seq_kv shares entry -> per share: kv_start seq_kv causal_offset
//        kv_len, then needs_mask of each of its key tiles (mask_tile's test)
//   merge shares lse... -> merged lse, then the weights
//   plan total_q batch keys items sms -> kv_shares (the shipped build's share_waves)
//   decode batch keys sms -> decode_shares (the FP8 decode kernel's plan)
int main() {
  char mode[8];
  while (std::scanf("%7s", mode) == 1) {
    if (!std::strcmp(mode, "clip")) {
      int tok0, tile_tokens, seq_q, seq_kv, shares, entry;
      std::scanf("%d %d %d %d %d %d", &tok0, &tile_tokens, &seq_q, &seq_kv, &shares, &entry);
      for (int share = 0; share < shares; ++share) {
        TileCoords t{};
        t.tok0 = tok0;
        t.tile_tokens = tile_tokens;
        t.seq_kv = seq_kv;
        t.causal_offset = seq_kv - seq_q;
        const int end = tok0 + tile_tokens + t.causal_offset;
        t.kv_len = end < 0 ? 0 : end < seq_kv ? end : seq_kv;
        if (entry == 64) {
          clip_to_share<128, 64>(t, share, shares);
        } else {
          clip_to_share<128, 1>(t, share, shares);
        }
        std::printf("%d %d %d %d", t.kv_start, t.seq_kv, t.causal_offset, t.kv_len);
        for (int key0 = 0; key0 < t.kv_len; key0 += 128) {
          const bool needs_mask = key0 + 128 > t.seq_kv || key0 + 127 > t.tok0 + t.causal_offset;
          std::printf(" %d", int(needs_mask));
        }
        std::printf("\n");
      }
    } else if (!std::strcmp(mode, "merge")) {
      int shares;
      std::scanf("%d", &shares);
      float lse[kMaxKvShares], weights[kMaxKvShares];
      for (int s = 0; s < shares; ++s) std::scanf("%f", &lse[s]);
      const float merged = share_weights(lse, 1, shares, weights);
      std::printf("%.9g", merged);
      for (int s = 0; s < shares; ++s) std::printf(" %.9g", weights[s]);
      std::printf("\n");
    } else if (!std::strcmp(mode, "decode")) {
      long long batch, keys;
      int sms;
      std::scanf("%lld %lld %d", &batch, &keys, &sms);
      std::printf("%d\n", decode_shares(batch, keys, sms));
    } else {
      long long total_q, batch, keys, items;
      int sms;
      std::scanf("%lld %lld %lld %lld %d", &total_q, &batch, &keys, &items, &sms);
      std::printf("%d\n", kv_shares(total_q, batch, keys, items, sms, 128, Knobs::kShareWaves));
    }
  }
}
"""


@pytest.fixture(scope="module")
def driver(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    program = build_host_driver(NVCC, DRIVER, tmp_path_factory.mktemp("split_kv"), "sm_90")

    def run(lines: list) -> list:
        out = subprocess.run([str(program)], input="".join(f"{x}\n" for x in lines),
                             capture_output=True, text=True, check=True).stdout  # fmt: skip
        return [line.split() for line in out.splitlines()]

    return run


# (query tokens of the sequence, keys): single-token rows, up to 4 tokens, short and long.
SEQUENCES = [(1, 1), (1, 127), (1, 128), (1, 129), (1, 8131), (3, 4613), (4, 14516), (2, 64),
             (4, 3), (1, 0)]  # fmt: skip


@pytest.mark.parametrize("entry", [64, 1])
def test_shares_cover_each_key_once_and_mask_where_needed(driver, entry):
    cases, expected = [], []
    for seq_q, seq_kv in SEQUENCES:
        for shares in (2, 3, 8, 16):
            cases.append(f"clip 0 {seq_q} {seq_q} {seq_kv} {shares} {entry}")
            expected.append((seq_q, seq_kv, shares))
    rows = iter(driver(cases))
    for seq_q, seq_kv, shares in expected:
        shift = seq_kv - seq_q
        kv_len = max(min(seq_q + shift, seq_kv), 0)
        covered = 0
        for share in range(shares):
            kv_start, share_seq_kv, offset, length, *masks = map(int, next(rows))
            first = kv_start * entry
            if length == 0:
                assert covered == kv_len or kv_len == 0, (seq_q, seq_kv, shares, share)
                continue
            assert first == covered and first % BLOCK_N == 0, (seq_q, seq_kv, shares, share)
            assert share_seq_kv == seq_kv - first and offset == shift - first
            covered += length
            for tile, needs_mask in enumerate(masks):
                keys = range(first + tile * BLOCK_N, first + (tile + 1) * BLOCK_N)
                hidden = any(key >= seq_kv or key > token + shift
                             for key in keys for token in range(seq_q))  # fmt: skip
                assert needs_mask or not hidden, (seq_q, seq_kv, shares, share, tile)
        assert covered == kv_len, (seq_q, seq_kv, shares)


def test_merge_weights(driver):
    inf, nan = math.inf, math.nan
    rng = random.Random(0)
    cases = [[3.0], [1.0, 2.0], [-inf, 5.0, 4.5], [-inf, -inf], [2.0, nan, 1.0],
             [rng.uniform(-40, 40) for _ in range(16)], [100.0, -100.0]]  # fmt: skip
    rows = driver([f"merge {len(lse)} " + " ".join(str(x) for x in lse) for lse in cases])
    for lse, row in zip(cases, rows):
        merged, *weights = map(float, row)
        if any(math.isnan(x) for x in lse):
            assert math.isnan(merged) and all(math.isnan(w) for w in weights)
        elif max(lse) == -inf:
            assert merged == -inf and weights == [0.0] * len(lse)
        else:
            m = max(lse)
            total = sum(2 ** (x - m) for x in lse)
            assert merged == pytest.approx(m + math.log2(total), abs=1e-5)
            assert weights == pytest.approx([2 ** (x - m) / total for x in lse], abs=1e-6)


@pytest.mark.parametrize(
    "total_q, batch, keys, expected",
    [
        (16, 16, 136_546, 8),  # single_token_rows_16 (ps1): 128 items, 8 an SM
        (16, 16, 2143 * 64, 8),  # the same rows over pages of 64
        (1, 1, 8192, 16),  # one row: capped at 16
        (1, 1, 1000, 1),  # shares would be under 4 key tiles
        (64, 16, 16 * 8192, 7),  # 4 tokens a sequence: still decode-like (144 items)
        (80, 16, 16 * 8192, 1),  # 5 tokens a sequence: prefill tiles
        (2048, 1, 8131, 1),  # a prefill chunk
    ],
)
def test_plan_splits_decode_like_batches(driver, total_q, batch, keys, expected):
    items = (total_q // TOKENS_PER_TILE + batch) * 8
    assert driver([f"plan {total_q} {batch} {keys} {items} 132"]) == [[str(expected)]]


@pytest.mark.parametrize(
    "batch, keys, expected",
    [
        (16, 2142 * 64, 13),  # single_token_rows_16: 128 (sequence, KV head) pairs, ~4 waves
        (1, 1 << 20, 16),  # one long row: capped at kMaxKvShares
        (4, 4 * 600, 1),  # shares would be under 512 keys
        (1000, 1000 * 2048, 1),  # a large batch fills the GPU unsplit
        (40, 40 * 3000, 5),  # 320 pairs: 1584 CTAs
    ],
)
def test_decode_kernel_plan(driver, batch, keys, expected):
    """decode_shares (decode_fp8.cuh): about 4 waves of 3 CTAs an SM, shares of >= 512 keys."""
    assert driver([f"decode {batch} {keys} 132"]) == [[str(expected)]]
