"""`meshrun train` as a user runs it, timed from its own log lines.

    python3 bench/cli_train.py --label defaults -- --model-size gpt-124m --data random --steps 60
    python3 bench/cli_train.py --label before --src /path/to/other/meshrun/src -- --model-size gpt-124m ...

Runs ``python3 -m meshrun train ARGS`` (with ``--src`` first on PYTHONPATH: another version of
meshrun, to compare two in the same call), keeps its output in ``--log``, and prints one line
``CLI {json}``: the run's first line (what it chose), and the median tokens/s per GPU and MFU
of its log lines after the first ``--skip`` (compilation and warm-up) and before the last (which
may hold the final validation), with every line's figures beside. Appends the line to --jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

_FIELD = re.compile(r"(\w+) ([-0-9.,e+]+)(%| GiB)?")


def parse_line(line: str) -> dict[str, float] | None:
    """A metrics line ("step 10 | loss 4.7 | ... | tokens_per_s_per_gpu 577,066 | mfu 50.2%") as
    numbers; None for any other line."""
    if not line.startswith("step "):
        return None
    out: dict[str, float] = {}
    head = line.split(" | ", 1)[0]  # "step 10/200" (the run's total after the slash)
    if re.fullmatch(r"step \d+(/\d+)?", head):
        out["step"] = float(head.split()[1].split("/")[0])
    for part in line.split(" | "):
        m = _FIELD.fullmatch(part.strip())
        if m:
            value = float(m.group(2).replace(",", ""))
            unit = m.group(3) or ""
            out[m.group(1) + ("_gib" if unit == " GiB" else "")] = value / 100 if unit == "%" else value
    return out if "tokens_per_s" in out or "tokens_per_s_per_gpu" in out else None  # (per GPU only on GPUs)


def steady(rows: list[dict[str, float]], skip: int) -> list[dict[str, float]]:
    """The log lines after the first ``skip`` and before the last."""
    return rows[skip:-1] if len(rows) > skip + 1 else rows[-1:]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--label", required=True)
    ap.add_argument("--src", default=None, help="a meshrun source tree to run instead of the installed one")
    ap.add_argument("--skip", type=int, default=2, help="log lines left out at the start (default 2)")
    ap.add_argument("--log", default=None, help="where the run's output goes (default: <label>.log here)")
    ap.add_argument("--jsonl", default=None)
    ap.add_argument("--timeout", type=float, default=600)
    ap.add_argument("args", nargs=argparse.REMAINDER, help="-- then meshrun train's arguments")
    a = ap.parse_args()
    args = a.args[1:] if a.args[:1] == ["--"] else a.args
    env = dict(os.environ)
    if a.src:
        env["PYTHONPATH"] = os.path.abspath(a.src) + os.pathsep + env.get("PYTHONPATH", "")
    log = a.log or f"{a.label}.log"
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        try:
            rc = subprocess.run([sys.executable, "-m", "meshrun", "train", *args], env=env, stdout=fh,
                                stderr=subprocess.STDOUT, timeout=a.timeout).returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.perf_counter() - t0
    text = open(log, errors="replace").read().splitlines()
    rows = [r for r in map(parse_line, text) if r]
    first = next((line for line in text if line.startswith("meshrun train: strategy")), "")
    chosen = [line.strip() for line in text[text.index(first) + 1:] if line.startswith("  ")][:4] if first else []
    kept = steady(rows, a.skip)
    result = {"label": a.label, "args": args, "rc": rc, "wall_s": round(wall, 1), "first_line": first,
              "chosen": chosen, "lines": len(rows)}
    if kept:
        per_gpu = [r["tokens_per_s_per_gpu"] for r in kept if "tokens_per_s_per_gpu" in r]
        result.update(tokens_per_s_per_gpu=round(statistics.median(per_gpu)) if per_gpu else None,
                      mfu=round(statistics.median(r.get("mfu", 0.0) for r in kept), 4),
                      steps_timed=[int(r["step"]) for r in kept],
                      all_tokens_per_s_per_gpu=[round(r["tokens_per_s_per_gpu"]) for r in rows
                                                if "tokens_per_s_per_gpu" in r])
        reserved = [r["peak_reserved_gib"] for r in rows if "peak_reserved_gib" in r]
        if reserved:
            result["peak_reserved_gib"] = max(reserved)
    else:
        result["tail"] = text[-8:]
    line = json.dumps(result)
    print("CLI " + line, flush=True)
    if a.jsonl:
        with open(a.jsonl, "a") as fh:
            fh.write(line + "\n")
    return 0 if rc == 0 and kept else 1


if __name__ == "__main__":
    sys.exit(main())
