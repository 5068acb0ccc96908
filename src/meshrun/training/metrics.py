"""Throughput, MFU, and where metrics go: stdout lines, a rich progress bar, metrics.jsonl,
a loss-curve PNG (when matplotlib is installed) and the experiment trackers (tracking.py:
TensorBoard, W&B, MLflow)."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any

import torch

from ..errors import MeshrunError
from ..units import clock
from . import tracking
from .models.hooks import FlopsModel

# Dense bf16 tensor-core peak per GPU, FLOP/s (vendor datasheets; sparsity excluded).
PEAK_BF16 = (
    ("H200", 989.4e12),
    ("H100 NVL", 835e12),
    ("H100 PCIe", 756e12),
    ("H100", 989.4e12),  # SXM
    ("GH200", 989.4e12),
    ("B200", 2250e12),
    ("A100", 312e12),
    ("A10G", 70e12),  # AWS's A10G is clocked lower than the A10
    ("A10", 125e12),
    ("L40S", 362e12),
    ("L4", 121e12),
    ("RTX 4090", 165e12),
    ("RTX 3090", 71e12),
)


def peak_for_name(name: str) -> float | None:
    """First table entry whose key is in the device name (more specific keys come first)."""
    for key, value in PEAK_BF16:
        if key in name:
            return value
    return None


def peak_flops(device: torch.device) -> float | None:
    """The card's bf16 peak, or None on CPU or an unknown card (MFU is then reported null)."""
    if device.type != "cuda":
        return None
    return peak_for_name(torch.cuda.get_device_name(device))


def flops_per_token(model: Any, seq: int) -> float | None:
    """Training FLOPs per token for MFU: the model's own count when it has one (meshrun's GPT:
    6N + 12·L·d·T); for a Hugging Face causal LM torchtitan's count, 6 x the parameters but the
    input embedding (when untied: a lookup, no matmul) + 12·L·d·T; else None (MFU not reported)."""
    if isinstance(model, FlopsModel):
        return float(model.flops_per_token())
    config = getattr(model, "config", None)
    layers, hidden = getattr(config, "num_hidden_layers", None), getattr(config, "hidden_size", None)
    if not (isinstance(layers, int) and isinstance(hidden, int)):
        return None
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is not None and not getattr(config, "tie_word_embeddings", False):
        n -= embed.weight.numel()
    return 6.0 * n + 12.0 * layers * hidden * seq


def mfu(tokens_per_s_per_gpu: float, flops_per_token: float | None, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the card's peak."""
    if not flops_per_token or not peak:
        return None
    return tokens_per_s_per_gpu * flops_per_token / peak


class ReadCost:
    """What one piece of work cost this process: wall seconds, CPU seconds (all its threads)
    and bytes read (/proc/self/io's rchar: every read(2) and its kin, files and sockets alike;
    None without /proc). Started at construction; ``took()`` gives the three."""

    def __init__(self) -> None:
        self.wall, self.cpu, self.read = time.perf_counter(), time.process_time(), _rchar()

    def took(self) -> tuple[float, float, int | None]:
        after = _rchar()
        read = after - self.read if after is not None and self.read is not None else None
        return time.perf_counter() - self.wall, time.process_time() - self.cpu, read


def _rchar() -> int | None:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def read_cost_line(costs: list[tuple[float, float, int | None]]) -> str:
    """The ranks' costs as one phrase: the fastest and slowest rank's wall seconds, then their
    CPU seconds and megabytes read (on a host whose cores the ranks share, wall time grows
    with the rank count while each rank's CPU time and bytes are its own work)."""
    walls, cpus = [c[0] for c in costs], [c[1] for c in costs]
    reads = [c[2] for c in costs if c[2] is not None]
    line = f"{min(walls):.2f}-{max(walls):.2f} s a rank ({min(cpus):.2f}-{max(cpus):.2f} s of CPU"
    if len(reads) == len(costs):
        line += f", {min(reads) / 2**20:.1f}-{max(reads) / 2**20:.1f} MB"
    return line + ")"


class MetricsSink:
    """Rank 0's outputs. Every record goes to stdout as one line and to metrics.jsonl."""

    def __init__(self, out: str | None, total_steps: int, enabled: bool, done: int = 0,
                 trackers: tuple[str, ...] = (), params: dict[str, Any] | None = None) -> None:
        self.enabled = enabled
        self.out = out
        self.records: list[dict[str, Any]] = []
        self.jsonl = None
        self.trackers: list[tracking.Tracker] = []
        self.tracked = trackers
        self.progress = None
        self.start = time.monotonic()
        self.total = total_steps
        self.done = done  # steps an earlier run did (a resume): not timed here
        self.closed = False
        if not enabled:
            return
        if out:
            os.makedirs(out, exist_ok=True)
            path = os.path.join(out, "metrics.jsonl")
            if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would hang the run here
                raise MeshrunError(f"--out={out!r}: {path} is not a regular file, where the run appends its "
                                   "metrics (hint: move it away, or give another --out)")
            self.jsonl = open(path, "a", buffering=1)
        try:
            self.trackers = tracking.start(trackers, out, params or {})
        except MeshrunError:
            if self.jsonl:
                self.jsonl.close()
            raise
        self.start = time.monotonic()  # (the trackers' start-up is no training time)
        if sys.stderr.isatty():
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.progress = Progress(TextColumn("train"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                                     TextColumn("{task.fields[info]}"), TimeRemainingColumn(), transient=True)
            self.task = self.progress.add_task("train", total=total_steps, info="")
            self.progress.start()

    def log(self, record: dict[str, Any]) -> None:
        if not self.enabled:
            return
        self.records.append(record)
        if self.jsonl:
            self.jsonl.write(json.dumps(record) + "\n")
        tracking.log(self.trackers, record)
        line = " | ".join([f"step {record['step']}/{self.total}",
                           *(_fmt(k, v) for k, v in record.items() if v is not None and k != "step"),
                           *self.timing(record["step"])])
        if self.progress:
            self.progress.update(self.task, completed=record["step"], info=_fmt("loss", record.get("loss")))
            self.progress.console.print(line)
        else:
            print(line, flush=True)

    def timing(self, step: int) -> list[str]:
        """How long this run has trained, and how long the steps left take at its pace so far."""
        elapsed = time.monotonic() - self.start
        parts = [f"elapsed {clock(elapsed)}"]
        if step > self.done and step < self.total:
            parts.append(f"left {clock(elapsed / (step - self.done) * (self.total - step))}")
        return parts

    def finished(self, snapshot: str | None) -> str:
        """The run's closing line: where it ended, its last losses, and what it wrote where."""
        last = self.records[-1] if self.records else {}
        losses = ", ".join(_fmt(k, last[k]) for k in ("loss", "val_loss") if last.get(k) is not None)
        head = (f"meshrun train: finished step {last.get('step', self.total)}/{self.total} in "
                f"{clock(time.monotonic() - self.start)}" + (f" ({losses})" if losses else ""))
        if not self.out:
            return head + "; nothing written (give --out DIR to keep metrics, the loss plot and snapshots)"
        wrote = ["metrics.jsonl"]
        wrote += [name for name in ("loss.png", "tensorboard") if os.path.exists(os.path.join(self.out, name))]
        wrote += [f"{name} run {run.get('id') or run.get('run_id')}"
                  for name, run in tracking.saved(self.out).items() if name in self.tracked]
        if snapshot:
            wrote.append(f"snapshot {os.path.relpath(snapshot, self.out)}")
        return head + f"; in {self.out}: " + ", ".join(wrote)

    def close(self, finished: bool = False) -> None:
        """Close every output; ``finished``: the run reached its last step (a tracker's run is
        then marked finished, else failed)."""
        if not self.enabled or self.closed:
            return
        self.closed = True
        if self.progress:
            self.progress.stop()
        if self.jsonl:
            self.jsonl.close()
        tracking.close(self.trackers, finished)
        if self.out and self.records:  # the whole run's curve, earlier attempts' steps included
            plot_losses(read_records(os.path.join(self.out, "metrics.jsonl")) or self.records,
                        os.path.join(self.out, "loss.png"))


def read_records(path: str) -> list[dict[str, Any]]:
    """The records of a metrics.jsonl, a step's latest record where a restart logged it again
    (a line cut short by a kill is skipped)."""
    by_step: dict[int, dict[str, Any]] = {}
    try:
        with open(path, "rb") as f:
            for line in f:
                try:
                    record = json.loads(line)
                except (ValueError, RecursionError):
                    continue
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    by_step[record["step"]] = record
    except OSError:
        return []
    return [by_step[k] for k in sorted(by_step)]


def _fmt(key: str, value: Any) -> str:
    if value is None:
        return f"{key} -"
    if key in ("tokens_per_s", "tokens_per_s_per_gpu"):
        return f"{key} {value:,.0f}"
    if key == "mfu":
        return f"mfu {100 * value:.1f}%"
    if key in ("peak_mem_bytes", "peak_reserved_bytes"):
        return f"{key[:-6]} {value / 2**30:.2f} GiB"
    if isinstance(value, float):
        return f"{key} {value:.4g}"
    return f"{key} {value}"


def plot_losses(records: list[dict[str, Any]], path: str) -> bool:
    """Training (and validation) loss against step; skipped without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    train = [(r["step"], r["loss"]) for r in records if r.get("loss") is not None]
    val = [(r["step"], r["val_loss"]) for r in records if r.get("val_loss") is not None]
    if not train and not val:  # a run that logged nothing: an earlier plot stays as it was
        plt.close("all")
        return False
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True
