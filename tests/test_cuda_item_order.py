"""The CUDA Hopper kernels' item order in L2 sections (l2_section_order in
solutions/gqa_ragged/cuda/tile_schedule.cuh) without a GPU: a host program built with nvcc
prints the item each draw takes; checked here against what the order promises.

- Every item is drawn exactly once (a bijection), so no query tile is lost or done twice.
- Each section's draws touch only its units (their K/V is what L2 holds), the last section
  takes the units left over, and a section as large as all units is the order before sections.
- Within a section, levels never go back: the last query tiles (level 0, the heaviest under a
  causal mask) first.

That the outputs do not depend on the order was compared bit for bit on the H100 (cuda/TUNING.md);
tests/test_solutions.py runs the sectioned kernels against the reference on a GPU.
"""

import shutil
import subprocess

import pytest

from prefill_bundle.cuda_build import build_host_driver

NVCC = shutil.which("nvcc")

DRIVER = r"""
#include <cstdio>
#include "tile_schedule.cuh"
using namespace gqa_prefill;
// stdin: "units levels section" lines; stdout: the item of each draw, one line per case.
int main() {
  int units, levels, section;
  while (std::scanf("%d %d %d", &units, &levels, &section) == 3) {
    for (int draw = 0; draw < units * levels; ++draw) {
      std::printf("%d ", l2_section_order(draw, units, levels, section));
    }
    std::printf("\n");
  }
}
"""

# (units, levels, section): padded batches ((sequence, KV head) pairs x query-tile levels),
# ragged sequences (8 KV heads x slots); sections that divide the units and ones that do not.
CASES = [(64, 64, 16), (64, 64, 64), (64, 64, 100), (128, 32, 32), (8, 256, 4), (8, 256, 8),
         (8, 1019, 3), (8, 1, 1), (8, 5, 1), (24, 7, 5), (1, 9, 1), (8, 64, 7)]  # fmt: skip


@pytest.fixture(scope="module")
def orders(tmp_path_factory):
    if NVCC is None:
        pytest.skip("nvcc is not on PATH")
    program = build_host_driver(NVCC, DRIVER, tmp_path_factory.mktemp("item_order"))
    lines = "".join(f"{units} {levels} {section}\n" for units, levels, section in CASES)
    run = subprocess.run([str(program)], input=lines, capture_output=True, text=True, check=True)
    lines = run.stdout.splitlines()
    assert len(lines) == len(CASES)
    return {case: list(map(int, line.split())) for case, line in zip(CASES, lines)}


def test_every_item_is_drawn_once(orders):
    for (units, levels, _), drawn in orders.items():
        assert sorted(drawn) == list(range(units * levels))


def test_sections_touch_only_their_units_and_go_last_tiles_first(orders):
    for (units, levels, section), drawn in orders.items():
        start = 0
        for first_unit in range(0, units, section):
            size = min(section, units - first_unit)
            items = drawn[start : start + size * levels]
            start += size * levels
            assert {item % units for item in items} == set(range(first_unit, first_unit + size))
            level_of = [item // units for item in items]
            assert level_of == sorted(level_of), (units, levels, section)
        if section >= units:
            assert drawn == list(range(units * levels))  # one section: the order before
