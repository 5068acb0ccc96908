"""A micro-batch meshrun chose that does not fit is halved before training, not a crash.

The micro-batch the planner sizes ("the largest that fits") rests on a memory model that can
be wrong for a model it never saw. So before the first step, a run on GPUs whose micro-batch was
meshrun's tries one micro-step (forward and backward, no update) at the micro-batch it will
train with. Every rank votes; if any ran out of GPU memory, all halve the micro-batch and
double the gradient accumulation, so the global batch, the samples of every step and so the
loss curve stay those of a run started at the smaller micro-batch, say so in one line, and
try again, down to a micro-batch of 1. Accelerate's ``find_executable_batch_size`` does the
same by calling the user's function again; here the layout, the compiled graphs and the
optimizer stay as they are.

The try changes nothing a run keeps: its gradients are dropped, the random state and the data
position are put back. It runs without the data-parallel gradient exchange where the layout
allows (DDP), so a rank that ran out mid-backward leaves no collective half-done; under FSDP2
every rank gathers the same blocks, and a rank out of memory before its peers is bounded by
the collectives' timeout. A micro-batch the user set is not changed: running out of memory
then stops the run with the peak it reached, the planner's prediction and the largest
micro-batch the planner thinks fits (``oom_line``). Out of memory at the run's first step,
whoever chose the micro-batch, ends the same way: that line, not a traceback (``guarded_step``).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..errors import MeshrunError
from ..units import fmt_bytes
from . import run
from .loader import BatchStream, LoaderSpec, make_loader

if TYPE_CHECKING:
    from torch.utils.data import Dataset

    from .parallel.layouts import Batch


class Run(run.Run, Protocol):
    """What the batch fit reads of the run it fits (the Trainer, trainer.py) besides what every
    helper reads (run.py)."""

    micro_is_ours: bool  # the micro-batch is meshrun's to change (the user left it open)
    train_data: Dataset
    loader_spec: LoaderSpec

    @property
    def strategy(self) -> str: ...

    def to_device(self, batch: Any) -> Batch: ...

    def train_step(self, data: Iterator) -> tuple[torch.Tensor, torch.Tensor | None, int]: ...


@dataclass(frozen=True)
class Resized:
    """A smaller micro-batch the run trains with, for the Trainer to put in place: the config
    that records it (and where it came from), the accumulation that keeps the global batch,
    and the training loader at that micro-batch."""

    cfg: TrainConfig
    accum: int
    loader_spec: LoaderSpec
    train_loader: Any


def _peak(device: torch.device) -> int | None:
    return torch.cuda.max_memory_reserved(device) if device.type == "cuda" else None


def oom_line(micro: int, strategy: str, device: torch.device, predicted: int | None, largest: int | None,
             what: str) -> str:
    """The one line of a run out of memory: where, the peak, the prediction, what would fit."""
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None
    peak = _peak(device)
    parts = [f"out of GPU memory {what} with strategy {strategy}, micro-batch {micro}"]
    if peak is not None and total is not None:
        parts.append(f"peak {fmt_bytes(peak)} reserved of {fmt_bytes(total)}")
    if predicted is not None:
        parts.append(f"the planner predicted {fmt_bytes(predicted)}")
    fit = (f"--micro-batch {largest} (the largest the planner thinks fits), " if largest and largest < micro
           else "a smaller --micro-batch, ")
    return "; ".join(parts) + f" (hint: {fit}--activation-checkpointing full, or an FSDP2 --strategy)"


def _try_micro_step(trainer: Run, data: BatchStream) -> bool:
    """One micro-step at the run's micro-batch; whether this rank ran out of memory. Leaves
    no gradient, random state or data position behind."""
    device = trainer.rt.device
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    failed = False
    try:
        x, y, positions = trainer.to_device(next(data))
        trainer.layout.try_micro_step(x, y, positions)
    except torch.cuda.OutOfMemoryError:
        failed = True
    trainer.layout.drop_gradients()
    if failed:  # (outside the handler: the traceback's frames hold the step's tensors)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    torch.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state(cuda_rng, device)
    return failed


def can_run_out_of_memory(device: torch.device) -> bool:
    """Whether a micro-step on ``device`` can run out of memory in a way torch reports: a
    GPU's allocator raises OutOfMemoryError. On the CPU the host's memory runs out as a plain
    RuntimeError or the kernel's out-of-memory killer, which no try can catch, so there is
    nothing to try: it would cost a forward and backward at every start
    (docs/decisions.md#oom-fallback)."""
    return device.type == "cuda"


def fit_micro_batch(trainer: Run, data: BatchStream) -> tuple[BatchStream, Resized | None]:
    """The data stream to train from, at a micro-batch every rank has run one micro-step of
    (module docstring), and the smaller micro-batch the run then trains with (None: it keeps
    its own). Returns ``data`` itself, unread, when the micro-batch is the user's, the layout
    cannot change it (pipelines, DeepSpeed: their schedules are cut for it) or the device
    cannot run out of memory in a way a try would see (``can_run_out_of_memory``)."""
    if (not trainer.micro_is_ours or not trainer.layout.resizable_batch
            or not can_run_out_of_memory(trainer.rt.device)):
        return data, None
    epoch, samples = data.epoch, data.samples
    resized: Resized | None = None
    cfg, accum, loader = trainer.cfg, trainer.state.accum, data.loader
    while True:
        failed = torch.tensor(float(_try_micro_step(trainer, data)), device=trainer.rt.device)
        dist.all_reduce(failed, op=dist.ReduceOp.MAX)
        if not failed.item():
            return BatchStream(loader, cfg.micro, trainer.dp_size, epoch, samples), resized
        what = "in a first micro-step"
        if cfg.micro == 1:
            raise MeshrunError(oom_line(1, trainer.strategy, trainer.rt.device, trainer.choice.predicted_peak, None,
                                        what).replace(" (hint: a smaller --micro-batch, ", " (hint: "))
        global_batch = cfg.micro * accum * trainer.dp_size
        half = cfg.micro // 2 if cfg.micro % 2 == 0 else (cfg.micro + 1) // 2
        while global_batch % (half * trainer.dp_size):  # a micro-batch that divides the global batch
            half -= 1
        before = cfg.micro
        resized = _resize(trainer, cfg, half, global_batch)
        cfg, accum, loader = resized.cfg, resized.accum, resized.train_loader
        data = BatchStream(loader, half, trainer.dp_size, epoch, samples)
        if trainer.rt.is_main:
            print(f"meshrun train: out of GPU memory at micro-batch {before} in a first micro-step; micro-batch "
                  f"{half} x {accum} accumulation instead (global batch {global_batch} unchanged, so the "
                  "loss curve is the same)", flush=True)


def _resize(trainer: Run, cfg: TrainConfig, micro: int, global_batch: int) -> Resized:
    """Train at ``micro`` with the accumulation that keeps ``global_batch``."""
    sources: dict[str, Any] = {**cfg.sources, "micro_batch": "halved after running out of memory"}
    cfg = cfg.replace(micro_batch=micro, global_batch=global_batch, sources=sources)
    spec = trainer.loader_spec
    spec = LoaderSpec(micro, spec.dp_rank, spec.dp_size, spec.seed, spec.pin_memory, spec.shuffle)
    loader = make_loader(trainer.train_data, spec, skip=trainer.state.loader_skip)
    return Resized(cfg, cfg.accumulation(trainer.dp_size), spec, loader)


def guarded_step(trainer: Run, data: Iterator, first: bool) -> tuple[torch.Tensor, torch.Tensor | None, int]:
    """``trainer.train_step``; out of memory on the run's first step becomes advice, not a traceback."""
    try:
        return trainer.train_step(data)
    except torch.cuda.OutOfMemoryError:
        if not first:
            raise
        raise MeshrunError(oom_line(trainer.cfg.micro, trainer.strategy, trainer.rt.device,
                                    trainer.choice.predicted_peak, trainer.choice.largest_micro,
                                    "at the first step")) from None
