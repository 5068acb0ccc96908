"""How much start-up time `meshrun launch` adds over calling torchrun directly.

Both start the same no-op script with the same process count, alternating runs so drift
hits both equally; reports medians. The target is at most 0.3 s added.

    python bench/launch_overhead.py --runs 15 --nproc 1
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def timed(argv: list[str], env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=15)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    bindir = os.path.dirname(sys.executable)
    with tempfile.TemporaryDirectory() as tmp:
        noop = os.path.join(tmp, "noop.py")
        with open(noop, "w") as f:
            f.write("pass\n")
        env = dict(os.environ, OMP_NUM_THREADS="1")
        cases = {
            "torchrun": [os.path.join(bindir, "torchrun"), "--standalone", f"--nproc_per_node={args.nproc}", noop],
            "meshrun launch": [sys.executable, "-m", "meshrun", "launch", "--nproc", str(args.nproc), noop],
            "meshrun launch --dry-run": [sys.executable, "-m", "meshrun", "launch", "--dry-run",
                                         "--nproc", str(args.nproc), noop],
            "python (interpreter start)": [sys.executable, "-c", "pass"],
        }
        for argv in cases.values():  # warm the page cache
            timed(argv, env)
        times: dict[str, list[float]] = {k: [] for k in cases}
        for _ in range(args.runs):
            for name, argv in cases.items():
                times[name].append(timed(argv, env))
    med = {k: statistics.median(v) for k, v in times.items()}
    # Paired differences (run i of each, taken back to back) cancel slow drift on the host;
    # torchrun's own start-up varies by hundreds of ms, far more than meshrun adds.
    paired = [m - t for m, t in zip(times["meshrun launch"], times["torchrun"])]
    result = {
        "runs": args.runs, "nproc": args.nproc,
        "median_s": {k: round(v, 4) for k, v in med.items()},
        "added_s": round(statistics.median(paired), 4),
        "meshrun_own_s": round(med["meshrun launch --dry-run"] - med["python (interpreter start)"], 4),
    }
    if args.json:
        print(json.dumps(result))
        return
    for k, v in med.items():
        print(f"{k:28s} median {v:.3f} s  (min {min(times[k]):.3f}, max {max(times[k]):.3f})")
    print(f"added by meshrun launch over torchrun (median of paired differences): {result['added_s']:+.3f} s"
          " (target <= 0.300 s)")
    print(f"meshrun's own work before starting torchrun (dry run minus interpreter start): "
          f"{result['meshrun_own_s']:.3f} s")


if __name__ == "__main__":
    main()
