"""Per-card clock and power while a card is busy, from nvidia-smi's sampling.

    nvidia-smi --query-gpu=index,utilization.gpu,clocks.sm,clocks.max.sm,power.draw,power.limit,\
clocks_event_reasons.active --format=csv,noheader,nounits -lms 1000 > smi.csv
    python3 bench/smi_summary.py smi.csv

Why: a step whose memory-bound kernels get shorter can see its matmuls get slower, which a
card held at its power limit does: it lowers the SM clock as the average power rises
(docs/benchmarks/throughput_4xH200_2026-11-27.md, "The cards run at their power limit").
Only samples with the card at least ``--busy`` percent utilized count (compiling and loading
are not the step).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass

# nvidia-smi's clock-event reason bits (nvml.h, nvmlClocksEventReasons)
REASONS = {0x4: "sw-power-cap", 0x8: "hw-slowdown", 0x20: "sw-thermal", 0x40: "hw-thermal", 0x80: "hw-power-brake"}


@dataclass(frozen=True)
class Sample:
    gpu: int
    util: float
    clock_mhz: float
    max_clock_mhz: float
    power_w: float
    limit_w: float
    reasons: int


def parse(lines: list[str]) -> list[Sample]:
    """Rows of the query above; lines that are not (headers, errors, '[N/A]') are skipped."""
    out = []
    for line in lines:
        f = [x.strip() for x in line.split(",")]
        if len(f) != 7:
            continue
        try:
            out.append(Sample(int(f[0]), float(f[1]), float(f[2]), float(f[3]), float(f[4]), float(f[5]),
                              int(f[6], 16)))
        except ValueError:
            continue
    return out


def summarize(samples: list[Sample], busy: float = 90.0) -> list[str]:
    lines = []
    for gpu in sorted({s.gpu for s in samples}):
        mine = [s for s in samples if s.gpu == gpu and s.util >= busy]
        if not mine:
            lines.append(f"SMI gpu {gpu}: never >= {busy:.0f}% busy")
            continue
        clocks = [s.clock_mhz for s in mine]
        held = {name: sum(1 for s in mine if s.reasons & bit) / len(mine) for bit, name in REASONS.items()}
        why = ", ".join(f"{name} {frac:.0%}" for name, frac in held.items() if frac) or "no limiting reason"
        lines.append(f"SMI gpu {gpu}: {len(mine)} busy samples, SM clock median {statistics.median(clocks):.0f} MHz "
                     f"(min {min(clocks):.0f}, max {max(clocks):.0f}, card max {mine[0].max_clock_mhz:.0f}), "
                     "power median "
                     f"{statistics.median(s.power_w for s in mine):.0f} W of {mine[0].limit_w:.0f} W; {why}")
    return lines


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("csv")
    ap.add_argument("--busy", type=float, default=90.0, help="least utilization (%%) of a sample that counts")
    args = ap.parse_args()
    try:
        with open(args.csv) as fh:
            samples = parse(fh.read().splitlines())
    except OSError as e:
        print(f"smi_summary: cannot read {args.csv}: {e.strerror}", file=sys.stderr)
        return 2
    if not samples:
        print(f"smi_summary: no samples in {args.csv} (nvidia-smi's own message is its first line)", file=sys.stderr)
        return 2
    print("\n".join(summarize(samples, args.busy)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
