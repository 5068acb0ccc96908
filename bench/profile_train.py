"""Where the GPU time of a `meshrun train` step goes, for any model and flags it takes.

    python3 bench/profile_train.py [--at N] -- --model DIR --data random --nproc 1 --global-batch 256 --steps 8

Runs ``python3 -m meshrun train ARGS`` with ``bench/profile_train/`` on the path: its
``sitecustomize`` profiles two optimizer steps of rank 0 from step N (default 4: past the
compile) and prints ``PROFILE`` lines: the wall and device milliseconds per step, the share of
each kernel family (matmuls, attention, Triton-fused kernels, copies, the optimizer) and the
longest kernels with their calls per step. Give ``--steps`` at least N + 1. For meshrun's own
GPT with the trainer in this process, ``profile_step.py`` prints more (idle gaps, DDP's exposed
communication).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--at", type=int, default=4, help="the first profiled step (two are profiled)")
    ap.add_argument("--top", type=int, default=30, help="how many of the longest kernels to list")
    ap.add_argument("train", nargs=argparse.REMAINDER, help="-- then meshrun train's arguments")
    a = ap.parse_args()
    args = a.train[1:] if a.train[:1] == ["--"] else a.train
    if a.at < 1 or not args:
        ap.error("give --at >= 1 and, after --, meshrun train's arguments")
    path = os.pathsep.join(p for p in (os.path.join(HERE, "profile_train"), os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, "PYTHONPATH": path, "PROFILE_TRAIN_AT": str(a.at), "PROFILE_TRAIN_TOP": str(a.top)}
    return subprocess.call([sys.executable, "-m", "meshrun", "train", *args], env=env)


if __name__ == "__main__":
    sys.exit(main())
