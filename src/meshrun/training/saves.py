"""The Trainer's snapshots: which one a run resumes from, the resume itself (weights, optimizer,
data position, learning-rate schedule), and saving, synchronously or with one asynchronous save
in flight. How a snapshot is written, committed and read is the ``snapshot`` package's business;
this is the glue between it and the Trainer's state (state.TrainState).

``Snapshots`` keeps what a save carries from one call to the next: the asynchronous save in
flight and the gloo group its background writer coordinates over, so a save and a non-finite
stop see the same pending save. A resume returns what it found (a TrainState and the
scheduler placed at its step) for the Trainer to put in place.

``snapshot`` is imported where a snapshot is listed, read or written (with --out or
--resume): it imports torch.distributed.checkpoint, which a run without snapshots does not
load.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..config import TrainConfig
from ..config.outdir import RUN_ID_ENV
from ..errors import MeshrunError
from .loader import BatchStream
from .metrics import ReadCost, read_cost_line
from .optim import Schedule, build_scheduler, extend_schedule, lr_factor
from .state import TrainState

if TYPE_CHECKING:
    from .parallel.layouts import Layout
    from .snapshot import PendingSave


def checkpoint_root(cfg: TrainConfig) -> str | None:
    """Where the run's snapshots go: OUT/checkpoints, none without --out."""
    return os.path.join(cfg.out, "checkpoints") if cfg.out else None


def resume_path(cfg: TrainConfig, names: list[str] | None = None) -> str | None:
    """The snapshot to start from: --resume PATH, or the newest committed one under
    --out (``auto``; ``names``: the listing of OUT/checkpoints when the caller has it), or
    none."""
    root = checkpoint_root(cfg)
    if cfg.resume == "none" or (cfg.resume == "auto" and not root):
        return None
    from . import snapshot

    if cfg.resume != "auto":
        if os.path.isfile(os.path.join(cfg.resume, snapshot.MARKER)):
            snapshot.check_name(cfg.resume)
            return cfg.resume
        found = snapshot.latest(cfg.resume) if os.path.isdir(cfg.resume) else None
        if found is None:
            raise MeshrunError(f"--resume={cfg.resume!r}: not a committed snapshot nor a directory of them "
                               "(hint: give OUT/checkpoints/step-N, or --resume none)")
        return found
    return snapshot.latest(root, names)


def starting_point(cfg: TrainConfig, is_main: bool) -> tuple[str | None, list[str] | None]:
    """The snapshot to resume from, and the listing of OUT/checkpoints it was found in. The
    directory is listed once: the same names give the snapshot to resume and, on rank 0, the
    partial saves ``restore`` clears (--resume PATH on another rank needs no listing)."""
    root = checkpoint_root(cfg)
    names = None
    if root and (is_main or cfg.resume == "auto"):
        from . import snapshot

        names = snapshot.entries(root)
    return resume_path(cfg, names), names


class Snapshots:
    """A run's snapshots, under ``checkpoint_root(cfg)`` (none without --out), and the
    asynchronous save in flight, one at a time."""

    def __init__(self, is_main: bool) -> None:
        self.is_main = is_main
        self.pending: PendingSave | None = None  # the asynchronous save in flight
        self.async_group: Any = None  # the gloo group its background writer coordinates over

    def restore(self, path: str | None, names: list[str] | None, cfg: TrainConfig, layout: Layout,
                state: TrainState, seekable: bool, lora: Any = None) -> tuple[TrainState, Any]:
        """Load the snapshot at ``path`` (``starting_point``'s; ``names``: the listing it was
        found in) into the layout's model and optimizer, if there is one; returns the state it
        resumes at and the learning-rate scheduler placed at its step (a fresh start: ``state``
        and None). ``seekable``: whether the training loader starts at a sample (a map-style
        dataset's sampler); iterable data skips its share instead (``TrainState.loader_skip``).
        ``lora``: a LoRA run's record (lorabase.py), which the snapshot's must match."""
        root = checkpoint_root(cfg)
        if root and self.is_main:
            from . import snapshot

            snapshot.clear_partial(root, names)  # a save killed halfway
        dist.barrier()
        if not path:  # a fresh start: the data from its beginning
            return state, None
        from . import snapshot

        cost = ReadCost()
        position, saved_world = snapshot.load(path, layout.model, layout.optimizer, layout.local_shards(),
                                                layout.ties(), lora)
        # Each rank's cost, for the line below: each reads its own shards (and hashes a
        # share of the files), so a rank far above the others shows a slow disk or a rank
        # that read more than its share.
        costs: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(costs, cost.took())
        if self.is_main:
            print(f"meshrun train: resumed from {path} at step {position.step} (epoch {position.epoch}, "
                  f"{position.samples} samples into it; saved on {saved_world} rank(s); read in "
                  f"{read_cost_line(costs)})", flush=True)
        schedule = self._place_schedule(cfg, position.step, position.schedule)
        scheduler = build_scheduler(layout.optimizer, cfg.warmup_steps, schedule, cfg.min_lr_ratio, position.step)
        state = state.replace(step=position.step, schedule=schedule, epoch=position.epoch, samples=position.samples)
        if position.samples and not seekable:  # iterable data: its loader skips this rank's share
            state = state.replace(loader_skip=position.samples // layout.dp_size, samples=0)
        return state, scheduler

    def _place_schedule(self, cfg: TrainConfig, step: int, recorded: Schedule) -> Schedule:
        """The schedule at a resumed ``step``: the learning rate is a pure function of the step
        and of the schedule the snapshot records; a --steps that differs from where that
        schedule ends adds a piece that goes on from the current rate (optim.lr_factor), said
        in one line."""
        saved = recorded or ((0, cfg.steps),)
        schedule = extend_schedule(saved, step, cfg.steps, cfg.warmup_steps)
        if schedule != saved and step < cfg.steps and self.is_main:
            lr, floor = (cfg.lr * lr_factor(step, cfg.warmup_steps, schedule, cfg.min_lr_ratio),
                         cfg.lr * cfg.min_lr_ratio)
            goes = (f"stays at its floor {floor:.3g} through step {cfg.steps}" if lr <= floor * (1 + 1e-6) else
                    f"goes on from {lr:.3g} and decays to {floor:.3g} at step {cfg.steps}")
            print(f"meshrun train: --steps {cfg.steps} changes the learning-rate schedule, which ended at step "
                  f"{saved[-1][1]}: from step {step} the rate {goes}, never back up "
                  "(docs/decisions.md#lr-schedule-resume)", flush=True)
        return schedule

    def check_finite(self, layout: Layout, step: int) -> None:
        """Stop at a non-finite step (the layout's check); a snapshot still in flight holds
        the last good step and is committed first, so the run resumes from it."""
        try:
            layout.check_finite(step)
        except MeshrunError:
            if self.pending is not None:
                from . import snapshot

                pending, self.pending = self.pending, None
                snapshot.commit(pending)
            raise

    def save(self, cfg: TrainConfig, state: TrainState, data: BatchStream, layout: Layout, model_record: Any,
             final: bool = False, lora: Any = None) -> str | None:
        """Snapshot ``state`` at the data position of ``data`` now; returns its path (committed
        on return unless it is an asynchronous save still in flight). Asynchronous saves commit
        the previous snapshot first (one in flight at a time, so two never interleave), and the
        last one before returning."""
        root = checkpoint_root(cfg)
        if root is None:
            return None
        from . import snapshot

        if self.pending is not None:
            previous = self.pending
            apart = time.perf_counter() - previous.started  # training time between the two saves
            snapshot.commit(previous)
            self.pending = None
            advice = snapshot.slow_writer_advice(previous.wait_s, previous.written - previous.started, apart,
                                                   cfg.save_every)
            if advice and self.is_main:
                print(advice, flush=True)
        group = None
        if cfg.async_save and not final:
            if self.async_group is None:  # the background writer coordinates over gloo
                self.async_group = dist.new_group(backend="gloo")
            group = self.async_group
        position = snapshot.Position(state.step, data.epoch, data.samples, state.schedule)
        pending = snapshot.begin_save(root, position, layout.model, layout.optimizer, cfg.to_json(),
                                        cfg.keep_last, group, layout.local_shards(), model_record,
                                        run_id=os.environ.get(RUN_ID_ENV), lora=lora)
        if group is None:
            return snapshot.commit(pending)
        self.pending = pending
        return pending.final
