"""Write TileLang Solution JSONs whose kernels take other arguments of gqa_prefill (num_stages,
block_N, persistent, a new knob under trial: tilelang/TUNING.md) on top of the shipped
block_config, to time them beside the shipped solutions on the workloads:

    python scripts/tilelang_variant.py num_stages=3 --out .ab/v1
    python scripts/compare_gpu.py tilelang_ragged tilelang_paged_ps1 --old .ab/v1/*.json

Each variant is its own solution (named NAME__KNOB_VALUE_...): flashinfer-bench builds it into a
module of its own, with its own kernel and plan caches, so compare_gpu.py interleaves it with
the shipped one. The embedded gqa_prefill_kernel.py gets the knobs merged into block_config
(the packed decode-like programs keep pack_config; a knob a program does not have is ignored
there: gqa_prefill_kernel.gqa_prefill). With --pack, into pack_config instead (named
NAME__pack_KNOB_VALUE_...): the decode-like batches' programs only.

    python scripts/tilelang_variant.py --pack block_N=64 num_stages=3 --out .ab/v2 \
        --solutions tilelang_fp8kv
"""

import argparse
import ast
import re
from pathlib import Path

from flashinfer_bench import Solution

from prefill_bundle.testing import load_solution

TILELANG = ["tilelang_mini", "tilelang_ragged", "tilelang_swa", "tilelang_paged_ps64",
            "tilelang_paged_ps1", "tilelang_fp8kv"]  # fmt: skip
# Appended to the embedded gqa_prefill_kernel.py: the config function `config` (block_config,
# or pack_config with --pack) with the variant's knobs merged into what it returns.
OVERRIDE = '''

# Variant knobs (scripts/tilelang_variant.py): merged into every {config}.
_VARIANT_KNOBS = {knobs!r}
_shipped_{config} = {config}


def {config}(*args, **kwargs):
    return {{**_shipped_{config}(*args, **kwargs), **_VARIANT_KNOBS}}
'''


def variant(name: str, knobs: dict, pack: bool = False):
    """The Solution `name` with `knobs` merged into its kernels' block_config (pack: into the
    packed programs' pack_config)."""
    solution = load_solution(name)
    tag = re.sub(r"\W", "_", "_".join(f"{key}_{value}" for key, value in knobs.items()))
    data = solution.model_dump(mode="json")
    for source in data["sources"]:
        if Path(source["path"]).name == "gqa_prefill_kernel.py":
            config = "pack_config" if pack else "block_config"
            source["content"] += OVERRIDE.format(knobs=knobs, config=config)
    data["name"] = f"{name}__pack_{tag}" if pack else f"{name}__{tag}"
    return Solution.model_validate(data)  # not model_copy: testing.build_solution_object


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("knobs", nargs="+", help="KNOB=VALUE (a Python literal)")
    parser.add_argument("--out", required=True, help="folder for the variant JSONs")
    parser.add_argument("--solutions", nargs="*", default=TILELANG)
    parser.add_argument("--pack", action="store_true", help="knobs of the packed programs")
    options = parser.parse_args()
    knobs = {}
    for item in options.knobs:
        key, _, value = item.partition("=")
        knobs[key] = ast.literal_eval(value)
    out = Path(options.out)
    out.mkdir(parents=True, exist_ok=True)
    for name in options.solutions:
        path = out / f"{name}.json"
        path.write_text(variant(name, knobs, options.pack).model_dump_json(indent=2))
        print(path)


if __name__ == "__main__":
    main()
