"""On the GPU: power draw of L2 -> shared-memory bulk copies with and without TMA multicast, at
several delivered bandwidths (scripts/multicast_power.cu; cuda/TUNING.md, "What multicast would
save in power"), sampled as power_cap.py samples, two rounds in ABBA order.

    nvcc -O3 -gencode arch=compute_90a,code=sm_90a -std=c++17 -o multicast_power \\
        scripts/multicast_power.cu
    python scripts/multicast_power.py ./multicast_power [--delays 0 1000 2000 3000]
"""

import argparse
import subprocess

from power_cap import sampled

MODES = {0: "each CTA copies its chunk", 1: "multicast, half a CTA"}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("binary", help="multicast_power.cu built")
    parser.add_argument("--delays", nargs="+", type=int, default=[0, 1000, 1500, 2000, 3000],
                        help="spin cycles a stage")  # fmt: skip
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    print("| mode | delay (cycles) | the probe's line | SM MHz | W | power-capped samples | C |\n"
          "|---|---|---|---|---|---|---|")  # fmt: skip
    for round_ in range(2):
        for delay in args.delays:
            for mode in (0, 1) if round_ == 0 else (1, 0):
                command = [args.binary, str(mode), str(delay), str(args.seconds)]
                result = {}

                def run():
                    result["out"] = subprocess.run(command, capture_output=True, text=True)

                mhz, watts, temperature, capped, samples = sampled(run)
                line = (result["out"].stdout + result["out"].stderr).strip()
                print(f"| {MODES[mode]} | {delay} | {line} | {mhz:.0f} | {watts:.0f} | "
                      f"{capped}/{samples} | {temperature} |", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
