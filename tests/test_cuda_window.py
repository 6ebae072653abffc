"""The CUDA sliding window's tile range (KeyBand in solutions/gqa_ragged/cuda/mask_softmax.cuh)
without a GPU: a host program built with nvcc places query tiles as locate_tile does, clips them
to the band and prints what the kernels then visit and mask; checked here against brute force.

- The clipped key range is exactly the keys the tile's rows see, so every visited key tile
  meets the band (no tile outside it), for the Hopper (128-key) and portable (64-key) tiles.
- The window's left edge crosses only the band's first tile, which alone gets the window's mask;
  every tile where some row sees only part of the keys is masked (left edge, diagonal, end).
- The schedule's order (each sequence's last query tile first) is heaviest first by band tiles.

The arithmetic on a GPU: pytest -m gpu tests/test_solutions.py -k cuda_swa.
"""

import shutil
import subprocess

import pytest

from prefill_bundle.cuda_build import build_host_driver

NVCC = shutil.which("nvcc")
TOKENS_PER_TILE = 32

DRIVER = r"""
#include <cstdio>
#include "mask_softmax.cuh"
using namespace gqa_prefill;
// stdin: "seq_q seq_kv window" lines; stdout per query tile: tok0 tile_tokens, the clipped
// kv_start seq_kv causal_offset kv_len, then crosses_left_edge for each 64-key tile.
int main() {
  int seq_q, seq_kv, window;
  while (std::scanf("%d %d %d", &seq_q, &seq_kv, &window) == 3) {
    for (int tok0 = 0; tok0 < seq_q; tok0 += kTokensPerTile) {
      TileCoords t{};
      t.tok0 = tok0;
      t.tile_tokens = seq_q - tok0 < kTokensPerTile ? seq_q - tok0 : kTokensPerTile;
      t.seq_kv = seq_kv;
      t.causal_offset = seq_kv - seq_q;
      const int end = tok0 + t.tile_tokens + t.causal_offset;
      t.kv_len = end < 0 ? 0 : end < seq_kv ? end : seq_kv;
      const KeyBand<true> band{window};
      band.clip(t);
      std::printf("%d %d %d %d %d %d %d %d", seq_q, seq_kv, window, t.tok0, t.tile_tokens,
                  t.kv_start, t.causal_offset, t.kv_len);
      std::printf(" %d", t.seq_kv);
      for (int key0 = 0; key0 < t.kv_len; key0 += 64) {
        std::printf(" %d", int(band.crosses_left_edge(t, key0)));
      }
      std::printf("\n");
    }
  }
}
"""

# (seq_q, seq_kv): equal, more keys (chunked prefill), more queries (rows without keys).
SHAPES = [(1, 1), (31, 31), (33, 33), (100, 100), (300, 300), (37, 300), (130, 500),
          (200, 70), (64, 0), (257, 1000)]  # fmt: skip
WINDOWS = [0, 1, 5, 31, 32, 33, 63, 64, 100, 127, 128, 129, 300, 999]


@pytest.fixture(scope="module")
def tiles(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    program = build_host_driver(NVCC, DRIVER, tmp_path_factory.mktemp("key_band"))
    # The host runs the causal kernels for windows as long as every sequence's keys.
    cases = [(q, kv, w) for q, kv in SHAPES for w in WINDOWS if w < max(kv, 1)]
    run = subprocess.run([str(program)], input="".join(f"{q} {kv} {w}\n" for q, kv, w
                         in cases), capture_output=True, text=True, check=True)  # fmt: skip
    rows = [list(map(int, line.split())) for line in run.stdout.splitlines()]
    assert {tuple(r[:3]) for r in rows} == {c for c in cases if c[0] > 0}
    return rows


def visible(seq_q, seq_kv, window, token):
    """Keys query `token` sees: [max(0, p - window), min(p, seq_kv - 1)], p = bottom-right."""
    p = token + seq_kv - seq_q
    return max(0, p - window), min(p, seq_kv - 1)


def test_the_clipped_range_is_the_bands_keys(tiles):
    for seq_q, seq_kv, window, tok0, tile_tokens, start, offset, kv_len, seq_end, *_ in tiles:
        spans = [visible(seq_q, seq_kv, window, tok0 + r) for r in range(tile_tokens)]
        spans = [(a, b) for a, b in spans if a <= b]
        case = (seq_q, seq_kv, window, tok0)
        if not spans:
            assert kv_len == 0, case
            continue
        first, last = min(a for a, _ in spans), max(b for _, b in spans)
        assert (start, start + kv_len - 1) == (first, last), case
        assert offset == seq_kv - seq_q - start and seq_end == seq_kv - start, case


def test_only_the_first_tile_crosses_the_left_edge_and_masks_cover_every_partial_tile(tiles):
    for seq_q, seq_kv, window, tok0, tile_tokens, start, offset, kv_len, seq_end, *crosses in tiles:
        case = (seq_q, seq_kv, window, tok0)
        assert not any(crosses[1:]), case
        for block in (64, 128):
            for key0 in range(0, kv_len, block):
                keys = range(start + key0, start + min(key0 + block, seq_end))
                rows = [visible(seq_q, seq_kv, window, tok0 + r) for r in range(tile_tokens)]
                left_partial = any(a > keys[0] for a, b in rows if a <= b)
                # mask_tile's test (clipped coordinates): end, diagonal, left edge.
                diagonal = key0 + block > seq_end or key0 + block - 1 > tok0 + offset
                left = key0 == 0 and bool(crosses and crosses[0])
                assert left == left_partial, (case, block, key0)
                partial = any(not (a <= keys[0] and keys[-1] <= b) for a, b in rows if a <= b)
                assert not partial or diagonal or left, (case, block, key0)


def test_last_query_tiles_first_is_heaviest_first(tiles):
    """Items go each sequence's last query tile first; under the band a tile's key tiles never
    fall behind an earlier tile's by more than the rounding of one tile."""
    by_case = {}
    for seq_q, seq_kv, window, tok0, _, _, _, kv_len, *_ in tiles:
        by_case.setdefault((seq_q, seq_kv, window), []).append((tok0, kv_len))
    for case, items in by_case.items():
        for block in (64, 128):
            weights = [-(-kv_len // block) for _, kv_len in sorted(items)]
            for i, later in enumerate(weights):
                assert all(later >= earlier - 1 for earlier in weights[:i]), (case, block)
            assert max(weights) <= -(-(case[2] + TOKENS_PER_TILE) // block), (case, block)
