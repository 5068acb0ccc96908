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

from ..config.outdir import METRICS
from ..errors import MeshrunError
from ..modelinfo.spec import attention_flops
from ..units import clock, fmt_bytes, span
from . import tracking
from .models.hooks import FlopsModel
from .stepline import loss_text, step_line

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
    return 6.0 * _matmul_params(model) + attention_flops(layers, hidden, seq)


def _matmul_params(model: Any) -> int:
    """A Hugging Face model's parameters but its untied input embedding (a lookup, no matmul)."""
    n = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    embed = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if embed is not None and not getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        n -= embed.weight.numel()
    return n


def lora_flops_per_token(model: Any, seq: int, full: float | None, adapters: int) -> float | None:
    """A LoRA run's FLOPs per token: ``full`` (``flops_per_token`` of its base ``model``, taken
    before the adapters went in) with each counted weight at 4, not 6, plus 6 for each of the
    ``adapters`` parameters. A frozen weight's matmul runs forward (2 FLOPs) and for its
    input's gradient (2), never for its own gradient; counting 6 would overstate a LoRA run's
    MFU by half. The attention's 12·L·d·T stays: its backward is all input gradients."""
    if full is None:
        return None
    cfg = getattr(model, "cfg", None) if isinstance(model, FlopsModel) else None
    config = getattr(model, "config", None)
    if cfg is not None:
        attention = attention_flops(cfg.n_layers, cfg.d_model, cfg.seq_len)
    elif config is not None:
        attention = attention_flops(config.num_hidden_layers, config.hidden_size, seq)
    else:
        return None
    return attention + 4.0 * (full - attention) / 6.0 + 6.0 * adapters


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
    CPU seconds and megabytes read, each range one figure where all ranks print alike (on a
    host whose cores the ranks share, wall time grows with the rank count while each rank's
    CPU time and bytes are its own work)."""
    reads = [c[2] / 2**20 for c in costs if c[2] is not None]
    line = f"{span([c[0] for c in costs], '.2f', 's')} a rank ({span([c[1] for c in costs], '.2f', 's')} of CPU"
    if len(reads) == len(costs):
        line += f", {span(reads, '.1f', 'MB')}"
    return line + ")"


class MetricsSink:
    """Rank 0's outputs. Every record goes to metrics.jsonl whole and to stdout as its step
    line (stepline.py); a resumed run's metrics.jsonl first loses the records an interrupted
    start logged after the step it resumes from (``keep_through``), so each step has one."""

    def __init__(self, out: str | None, total_steps: int, enabled: bool, done: int = 0,
                 trackers: tuple[str, ...] = (), params: dict[str, Any] | None = None, rate: str = "tok/s") -> None:
        """``rate``: the step line's throughput unit (``samples/s`` for inputs that are no tokens)."""
        self.enabled = enabled
        self.rate = rate
        self.out = out
        self.records: list[dict[str, Any]] = []
        self.jsonl = None
        self.trackers: list[tracking.Tracker] = []
        self.tracked: dict[str, str] = {}  # each tracker's words for the closing line
        self.progress = None
        self.start = time.monotonic()
        self.total = total_steps
        self.done = done  # steps an earlier run did (a resume): not timed here
        self.closed = False
        if not enabled:
            return
        if out:
            os.makedirs(out, exist_ok=True)
            path = os.path.join(out, METRICS)
            if os.path.exists(path) and not os.path.isfile(path):  # a FIFO would hang the run here
                raise MeshrunError(f"--out={out!r}: {path} is not a regular file, where the run appends its "
                                   "metrics (hint: move it away, or give another --out)")
            keep_through(path, done)
            self.jsonl = open(path, "a", buffering=1)
        try:
            self.trackers = tracking.start(trackers, out, params or {}, done=done)
        except MeshrunError:
            if self.jsonl:
                self.jsonl.close()
            raise
        self.tracked = {t.name: words for t in self.trackers if (words := t.closing())}
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
        elapsed, left = self.timing(record["step"])
        line = step_line(record, self.total, elapsed, left, rate=self.rate)
        if self.progress:
            loss = record.get("loss")
            self.progress.update(self.task, completed=record["step"],
                                 info="" if loss is None else f"loss {loss_text(loss)}")
            self.progress.console.print(line)
        else:
            print(line, flush=True)

    def timing(self, step: int) -> tuple[float, float | None]:
        """How long this run has trained, and how long the steps left take at its pace so far
        (None at the last step, or before a step of this run)."""
        elapsed = time.monotonic() - self.start
        if step > self.done and step < self.total:
            return elapsed, elapsed / (step - self.done) * (self.total - step)
        return elapsed, None

    def finished(self, snapshot: str | None) -> str:
        """The run's closing line: where it ended, its last losses (and on a GPU rank 0's peak
        memory), and what it wrote where, the trackers' runs included."""
        last = self.records[-1] if self.records else {}
        said = [f"{name} {loss_text(last[key])}" for key, name in (("loss", "loss"), ("val_loss", "val loss"))
                if last.get(key) is not None]
        if last.get("peak_reserved_bytes"):
            said.append(f"peak GPU memory {fmt_bytes(last['peak_reserved_bytes'])} on rank 0")
        head = (f"meshrun train: finished step {last.get('step', self.total)}/{self.total} in "
                f"{clock(time.monotonic() - self.start)}" + (f" ({', '.join(said)})" if said else ""))
        trackers = list(self.tracked.values())
        if not self.out:
            return (head + "; nothing written (give --out DIR to keep metrics, the loss plot and snapshots)"
                    + (f"; logged to {', '.join(trackers)}" if trackers else ""))
        wrote = [METRICS]
        wrote += [name for name in ("loss.png", "tensorboard") if os.path.exists(os.path.join(self.out, name))]
        wrote += trackers
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
            plot_losses(read_records(os.path.join(self.out, METRICS)) or self.records,
                        os.path.join(self.out, "loss.png"))


def keep_through(path: str, step: int) -> int:
    """Make the metrics file at ``path`` hold one record for each step up to ``step`` and none
    after: a run resuming from its snapshot of ``step`` trains the later steps again, so the
    records an interrupted start logged of them go (as do a line a kill cut short and a
    step's earlier record where an older meshrun logged it twice). Written to a temporary
    file and renamed over the old one: a kill leaves the old file or the new, never a mix;
    a file already so is not rewritten. Returns the number of lines left out."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return 0
    by_step: dict[int, bytes] = {}
    lines = data.splitlines()
    for line in lines:
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int) and record["step"] <= step:
            by_step[record["step"]] = line  # (a step logged twice: its later record)
    kept = b"".join(by_step[k] + b"\n" for k in sorted(by_step))
    if kept == data:
        return 0
    target = os.path.realpath(path)
    tmp = f"{target}.tmp.{os.getpid()}"
    with open(tmp, "wb") as f:
        f.write(kept)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, target)
    return len(lines) - len(by_step)


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
