"""The Trainer's snapshots: which one a run resumes from, the resume itself (weights, optimizer,
data position, learning-rate schedule), and saving, synchronously or with one asynchronous save
in flight. How a snapshot is written, committed and read is ``checkpoint``'s business; this is
the glue between it and the Trainer's state.

The Trainer keeps the state a save carries from one call to the next (``_pending``, the
asynchronous save in flight, and ``_async_group``, its gloo group): these functions read and
set it there, so ``Trainer.save`` and a non-finite stop see the same pending save.

``checkpoint`` is imported where a snapshot is listed, read or written (with --out or
--resume): it imports torch.distributed.checkpoint, which a run without snapshots does not
load.
"""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING, Any

import torch.distributed as dist

from ..errors import MeshrunError
from .config import TrainConfig
from .data import BatchStream, make_loader
from .metrics import ReadCost, read_cost_line
from .optim import build_scheduler, extend_schedule, lr_factor
from .outdir import RUN_ID_ENV

if TYPE_CHECKING:
    from .checkpoint import Position
    from .trainer import Trainer


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
    from . import checkpoint

    if cfg.resume != "auto":
        if os.path.isfile(os.path.join(cfg.resume, checkpoint.MARKER)):
            checkpoint.check_name(cfg.resume)
            return cfg.resume
        found = checkpoint.latest(cfg.resume) if os.path.isdir(cfg.resume) else None
        if found is None:
            raise MeshrunError(f"--resume={cfg.resume!r}: not a committed snapshot nor a directory of them "
                               "(hint: give OUT/checkpoints/step-N, or --resume none)")
        return found
    return checkpoint.latest(root, names)


def starting_point(cfg: TrainConfig, is_main: bool) -> tuple[str | None, list[str] | None]:
    """The snapshot to resume from, and the listing of OUT/checkpoints it was found in. The
    directory is listed once: the same names give the snapshot to resume and, on rank 0, the
    partial saves ``restore`` clears (--resume PATH on another rank needs no listing)."""
    root = checkpoint_root(cfg)
    names = None
    if root and (is_main or cfg.resume == "auto"):
        from . import checkpoint

        names = checkpoint.entries(root)
    return resume_path(cfg, names), names


def restore(trainer: Trainer) -> BatchStream:
    """Load the snapshot to resume from (``Trainer.resume_from``), if any, and return the data
    stream positioned where it stopped."""
    rt, root = trainer.rt, checkpoint_root(trainer.cfg)
    path, names = trainer.resume_from, trainer.checkpoint_names
    if root and rt.is_main:
        from . import checkpoint

        checkpoint.clear_partial(root, names)  # a save killed halfway
    dist.barrier()
    if not path:  # a fresh start: the data from its beginning
        return BatchStream(trainer.train_loader, trainer.cfg.micro, trainer.dp_size, 0, 0)
    from . import checkpoint

    cost = ReadCost()
    position, saved_world = checkpoint.load(path, trainer.model, trainer.optimizer,
                                            trainer.layout.local_shards(), trainer.layout.ties())
    # Each rank's cost, for the line below: each reads its own shards (and hashes a
    # share of the files), so a rank far above the others shows a slow disk or a rank
    # that read more than its share.
    costs: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(costs, cost.took())
    trainer.step = position.step
    if rt.is_main:
        print(f"meshrun train: resumed from {path} at step {position.step} (epoch {position.epoch}, "
              f"{position.samples} samples into it; saved on {saved_world} rank(s); read in "
              f"{read_cost_line(costs)})", flush=True)
    _place_schedule(trainer, position)
    if position.samples and not hasattr(trainer.train_loader.sampler, "set_start"):  # iterable data
        trainer.loader_skip = position.samples // trainer.dp_size
        trainer.train_loader = make_loader(trainer.train_data, trainer.loader_spec, skip=trainer.loader_skip)
        position = checkpoint.Position(position.step, position.epoch, 0)
    return BatchStream(trainer.train_loader, trainer.cfg.micro, trainer.dp_size, position.epoch, position.samples)


def _place_schedule(trainer: Trainer, position: Position) -> None:
    """The learning rate at a resumed step: a pure function of the step and of the
    schedule the snapshot records; a --steps that differs from where that schedule ends
    adds a piece that goes on from the current rate (optim.lr_factor), said in one line."""
    cfg = trainer.cfg
    saved = position.schedule or ((0, cfg.steps),)
    trainer.schedule = extend_schedule(saved, position.step, cfg.steps, cfg.warmup_steps)
    if trainer.schedule != saved and position.step < cfg.steps and trainer.rt.is_main:
        lr, floor = (cfg.lr * lr_factor(position.step, cfg.warmup_steps, trainer.schedule, cfg.min_lr_ratio),
                     cfg.lr * cfg.min_lr_ratio)
        goes = (f"stays at its floor {floor:.3g} through step {cfg.steps}" if lr <= floor * (1 + 1e-6) else
                f"goes on from {lr:.3g} and decays to {floor:.3g} at step {cfg.steps}")
        print(f"meshrun train: --steps {cfg.steps} changes the learning-rate schedule, which ended at step "
              f"{saved[-1][1]}: from step {position.step} the rate {goes}, never back up "
              "(docs/decisions.md#lr-schedule-resume)", flush=True)
    trainer.scheduler = build_scheduler(trainer.layout.optimizer, cfg.warmup_steps, trainer.schedule,
                                        cfg.min_lr_ratio, position.step)


def check_finite(trainer: Trainer) -> None:
    """Stop at a non-finite step (the layout's check); a snapshot still in flight holds
    the last good step and is committed first, so the run resumes from it."""
    try:
        trainer.layout.check_finite(trainer.step)
    except MeshrunError:
        if trainer._pending is not None:
            from . import checkpoint

            pending, trainer._pending = trainer._pending, None
            checkpoint.commit(pending)
        raise


def save(trainer: Trainer, data: BatchStream, final: bool = False) -> str | None:
    """Snapshot now; returns its path (committed on return unless it is an asynchronous
    save still in flight). Asynchronous saves commit the previous snapshot first (one in
    flight at a time, so two never interleave), and the last one before returning."""
    cfg = trainer.cfg
    root = checkpoint_root(cfg)
    if root is None:
        return None
    from . import checkpoint

    if trainer._pending is not None:
        previous = trainer._pending
        apart = time.perf_counter() - previous.started  # training time between the two saves
        checkpoint.commit(previous)
        trainer._pending = None
        advice = checkpoint.slow_writer_advice(previous.wait_s, previous.written - previous.started, apart,
                                               cfg.save_every)
        if advice and trainer.rt.is_main:
            print(advice, flush=True)
    group = None
    if cfg.async_save and not final:
        if trainer._async_group is None:  # the background writer coordinates over gloo
            trainer._async_group = dist.new_group(backend="gloo")
        group = trainer._async_group
    pending = checkpoint.begin_save(root, checkpoint.Position(trainer.step, data.epoch, data.samples, trainer.schedule),
                                    trainer.model, trainer.optimizer, cfg.to_json(), cfg.keep_last, group,
                                    trainer.layout.local_shards(), trainer.model_record,
                                    run_id=os.environ.get(RUN_ID_ENV))
    if group is None:
        return checkpoint.commit(pending)
    trainer._pending = pending
    return pending.final
