"""A run resumed on another number of data-parallel ranks keeps its snapshot's global batch:
the optimizer's steps, the learning-rate schedule and the data position (counted in global
samples) all assume it. Gradient accumulation absorbs the change when the batch splits evenly
over the new ranks; otherwise the run is refused with sizes that fit. Torch-free."""

from __future__ import annotations

import json
import os

from ..errors import MeshrunError
from ..plan.batch import Batch
from . import TrainConfig


def keep_global_batch(cfg: TrainConfig, path: str | None, dp: int) -> tuple[TrainConfig, Batch | None]:
    """A resume on another data-parallel size keeps the snapshot's global batch (the
    optimizer's steps, the learning rate and the data position all assume it), unless the
    user names a --global-batch. Returns the config with it, and how the snapshot made it
    (None: nothing to keep). Reads state.json (world size, resolved micro-batch and global
    batch, tp/pp/cp); loading verifies the snapshot afterwards."""
    if path is None or cfg.global_batch is not None:
        return cfg, None
    try:
        with open(os.path.join(path, "state.json")) as f:
            state = json.load(f)
        saved = state["config"]
        saved_dp = int(state["world_size"]) // (saved.get("tp", 1) * saved.get("pp", 1) * saved.get("cp", 1))
        micro = int(saved["micro_batch"])
        batch = int(saved.get("global_batch") or micro * saved_dp)
    except (OSError, ValueError, KeyError, TypeError, ZeroDivisionError, RecursionError):
        return cfg, None  # loading it reports what is wrong with it
    if saved_dp == dp or saved_dp < 1 or micro < 1 or batch % (micro * saved_dp):
        return cfg, None
    kept = Batch(micro, batch // (micro * saved_dp), saved_dp)
    return cfg.replace(global_batch=batch, sources={**cfg.sources, "global_batch": f"snapshot {path}"}), kept


def resized_line(saved: Batch, path: str, micro: int, dp: int) -> str:
    """The global batch of the snapshot at ``path`` on ``dp`` data-parallel ranks of ``micro``: the line that
    says how accumulation keeps it when it splits evenly; else a one-line refusal naming
    sizes that fit."""
    batch = saved.global_batch
    if batch % (micro * dp) == 0:
        return (f"resuming on {dp} data-parallel rank(s) instead of {saved.dp}: micro-batch "
                f"{micro} x gradient accumulation {batch // (micro * dp)} (was {saved.micro} x {saved.accum}) "
                f"keeps the snapshot's global batch of {batch} samples")
    micros = [m for m in range(1, batch // dp + 1) if batch % (m * dp) == 0]
    sizes = [d for d in range(1, batch // micro + 1) if batch % (micro * d) == 0]
    fits = []
    if micros:
        fits.append(f"--micro-batch {max([m for m in micros if m <= micro] or micros)} on {dp} rank(s)")
    if sizes:
        fits.append(f"{', '.join(map(str, sizes))} data-parallel rank(s) (--nproc) with micro-batch {micro}")
    fits.append("--global-batch N to train on another global batch")
    raise MeshrunError(
        f"resume from {path}: its global batch of {batch} samples (micro-batch {saved.micro} x "
        f"{saved.accum} x {saved.dp} data-parallel ranks) does not split over {dp} data-parallel rank(s) of "
        f"micro-batch {micro} ({batch} is not a multiple of {micro * dp}) (hint: {'; or '.join(fits)})")
