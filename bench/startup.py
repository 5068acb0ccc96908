"""What a `meshrun train` run costs beyond its training: the seconds before the first step and
after the last, against the cost of importing torch, measured in one call on one machine.

For each process count it runs ``meshrun train --model-size gpt-tiny --steps 1 --nproc N
--data random`` (no --out, as a first try is run) as ``meshrun.train(...)`` in a process of its
own, which prints the run's last record (the same job: the CLI and the function share
meshrun/job), and reads the step's and validation's own seconds from it (the log line rounds
them); what is left of the wall time is the start-up and shut-down overhead, given as a ratio
to ``python -c "import torch, torch.distributed"`` timed in the same call (median of
``--runs``, runs alternated so drift hits both). It also times gpt-tiny's
forward pass at the run's micro-batch (8 x 256 tokens, no gradient) in a process of its own,
with the threads a rank has (all cores for one process; one each for several, as torchrun and
meshrun set OMP_NUM_THREADS), and compares validation's 8 micro-batches with 8 of those.

    python bench/startup.py --runs 3            # prints one STARTUP {json} line per case
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

TRAIN = {"model_size": "gpt-tiny", "steps": 1, "data": "random"}
# meshrun train TRAIN --nproc N, printing its last record (the step's and validation's seconds in full)
JOB = """
import json, sys
import meshrun
print("RECORD " + json.dumps(meshrun.train(**json.loads(sys.argv[1])).metrics))
"""
FORWARD = """
import time, torch
from meshrun.config import TrainConfig
from meshrun.training.factories import build_model
torch.manual_seed(0)
model = build_model(TrainConfig(model_size="gpt-tiny", data="random", seq_len=256)).eval()
x = torch.randint(0, 50304, (8, 256))
with torch.no_grad():
    model(x, x)  # warm
    t = []
    for _ in range(5):
        t0 = time.perf_counter(); model(x, x); t.append(time.perf_counter() - t0)
print(sorted(t)[2])
"""


def timed(argv: list[str], env: dict[str, str]) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(argv)} exited {out.returncode}:\n{out.stderr[-3000:]}")
    return wall, out.stdout


def seconds(stdout: str, key: str) -> float:
    """A figure of the record the job printed."""
    for line in stdout.splitlines():
        if line.startswith("RECORD "):
            value = json.loads(line[len("RECORD "):]).get(key)
            if isinstance(value, (int, float)):
                return float(value)
    raise SystemExit(f"no {key} in the run's record:\n{stdout[-2000:]}")


def _threads(nproc: int) -> tuple[tuple[str, str], ...]:
    """A rank's OMP_NUM_THREADS when the caller left it unset: one each for several ranks."""
    return (("OMP_NUM_THREADS", "1"),) if nproc > 1 and "OMP_NUM_THREADS" not in os.environ else ()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--nproc", default="1,2", help="process counts, comma-separated")
    args = ap.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHRUN_")}
    imports: list[float] = []
    runs: dict[int, list[tuple[float, float, float]]] = {int(n): [] for n in args.nproc.split(",")}
    for _ in range(args.runs):
        imports.append(timed([sys.executable, "-c", "import torch, torch.distributed"], env)[0])
        for nproc, rows in runs.items():
            wall, stdout = timed([sys.executable, "-c", JOB, json.dumps({**TRAIN, "nproc": nproc})], env)
            rows.append((wall, seconds(stdout, "step_time_s"), seconds(stdout, "val_time_s")))
    forwards = {threads: float(timed([sys.executable, "-c", FORWARD], {**env, **dict(threads)})[1].strip())
                for threads in map(_threads, {min(n, 2) for n in runs})}
    import_s = statistics.median(imports)
    for nproc, rows in runs.items():
        forward = forwards[_threads(nproc)]
        overheads = [wall - step - val for wall, step, val in rows]
        val = statistics.median(r[2] for r in rows)
        print("STARTUP " + json.dumps({
            "nproc": nproc, "runs": args.runs, "import_torch_s": round(import_s, 3),
            "wall_s": round(statistics.median(r[0] for r in rows), 3),
            "step_s": round(statistics.median(r[1] for r in rows), 3), "val_s": round(val, 3),
            "overhead_s": round(statistics.median(overheads), 3),
            "overhead_over_import": round(statistics.median(overheads) / import_s, 2),
            "forward_s": round(forward, 3), "val_over_8_forwards": round(val / (8 * forward), 2),
        }), flush=True)


if __name__ == "__main__":
    main()
