"""`meshrun train` as a user runs it, timed from its own log lines.

    python3 bench/cli_train.py --label defaults -- --model-size gpt-124m --data random --steps 60
    python3 bench/cli_train.py --label before --src /path/to/other/meshrun/src -- --model-size gpt-124m ...

Runs ``python3 -m meshrun train ARGS`` (with ``--src`` first on PYTHONPATH: another version of
meshrun, to compare two in the same call), keeps its output in ``--log``, and prints one line
``CLI {json}``: the run's strategy line (what it chose), and the median tokens/s per GPU and MFU
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
# today's step line's figures without a key in front (training/stepline.py)
_TOKENS = re.compile(r"([0-9,]+) tok/s")
_STEP_TIME = re.compile(r"([0-9.]+) (s|ms|µs)/step")
_SECONDS = {"s": 1.0, "ms": 1e-3, "µs": 1e-6}
# the strategy line's processes: "..., on 4 GPUs, in bf16" ("on 8 GPUs of 2 nodes", "on 2 CPU processes")
_WORLD = re.compile(r", on (?P<n>\d+) (?P<what>GPUs?|CPU process(?:es)?)(?: of \d+ nodes)?, in \S+$")
# the closing line's "peak GPU memory 56.3 GiB on rank 0" (units: meshrun.units.fmt_bytes')
_PEAK = re.compile(r"peak GPU memory ([0-9.]+) (TiB|GiB|MiB|KiB|B) on rank 0")
_GIB = {"TiB": 1024.0, "GiB": 1.0, "MiB": 2.0**-10, "KiB": 2.0**-20, "B": 2.0**-30}


def parse_line(line: str) -> dict[str, float] | None:
    """A metrics line as numbers; None for any other line. Today's line ("step 10/200 | loss
    4.7 | lr 6e-4 | 4,616,528 tok/s | mfu 50.2% | 423 ms/step | elapsed 0:07 | left 2:13")
    and the lines of earlier versions ("step 10 | loss 4.7 | ... | tokens_per_s_per_gpu
    577,066 | mfu 50.2% | peak_reserved 56.30 GiB") alike."""
    if not line.startswith("step "):
        return None
    out: dict[str, float] = {}
    head = line.split(" | ", 1)[0]  # "step 10/200" (the run's total after the slash)
    if re.fullmatch(r"step \d+(/\d+)?", head):
        out["step"] = float(head.split()[1].split("/")[0])
    for part in line.split(" | "):
        part = part.strip()
        m = _FIELD.fullmatch(part.replace("val loss ", "val_loss "))
        tokens, step_time = _TOKENS.fullmatch(part), _STEP_TIME.fullmatch(part)
        if m:
            value = float(m.group(2).replace(",", ""))
            unit = m.group(3) or ""
            out[m.group(1) + ("_gib" if unit == " GiB" else "")] = value / 100 if unit == "%" else value
        elif tokens:
            out["tokens_per_s"] = float(tokens.group(1).replace(",", ""))
        elif step_time:
            out["step_time_s"] = float(step_time.group(1)) * _SECONDS[step_time.group(2)]
    return out if "tokens_per_s" in out or "tokens_per_s_per_gpu" in out else None  # (per GPU only on GPUs)


def gpus_of(lines: list[str]) -> int | None:
    """The GPUs the run's strategy line names; None on CPU processes, or without the line."""
    for line in lines:
        m = _WORLD.search(line) if line.startswith("meshrun train: strategy") else None
        if m:
            return int(m.group("n")) if m.group("what").startswith("GPU") else None
    return None


def parse_lines(lines: list[str]) -> list[dict[str, float]]:
    """The run's metrics lines as numbers, each with tokens/s per GPU: as an earlier version
    printed it, else today's tokens/s over the GPUs of the strategy line."""
    rows = [r for r in map(parse_line, lines) if r]
    gpus = gpus_of(lines)
    for r in rows:
        if "tokens_per_s_per_gpu" not in r and gpus and "tokens_per_s" in r:
            r["tokens_per_s_per_gpu"] = r["tokens_per_s"] / gpus
    return rows


def peak_reserved_gib(lines: list[str], rows: list[dict[str, float]]) -> float | None:
    """Rank 0's peak reserved GPU memory: the largest of earlier versions' metrics lines, or
    today's closing line."""
    reserved = [r["peak_reserved_gib"] for r in rows if "peak_reserved_gib" in r]
    for line in lines:
        m = _PEAK.search(line) if line.startswith("meshrun train: finished") else None
        if m:
            reserved.append(round(float(m.group(1)) * _GIB[m.group(2)], 2))
    return max(reserved) if reserved else None


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
    rows = parse_lines(text)
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
        reserved = peak_reserved_gib(text, rows)
        if reserved is not None:
            result["peak_reserved_gib"] = reserved
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
