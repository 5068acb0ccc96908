"""Loading a snapshot into a model and its optimizer (``load``), collectively: every rank checks
it (integrity.py, a share of the hashes each), reads it through DCP's verified reader (reader.py)
or its DeepSpeed engine (deepspeed.py), hashes the files no rank read before any of the loaded
state is used, keeps this run's optimizer implementation switches, restores the RNG state and
returns the position to resume from. A failure on any rank stops every rank with the same line.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ...errors import MeshrunError
from ..lorabase import check_resume
from ..models.hooks import CheckpointingEngine
from .deepspeed import load_deepspeed
from .integrity import Snapshot, check, position, read_verified, rng_file, verify_unread
from .layout import DS_DIR, Position
from .parts import float8_unwrapped, shards_as_dtensors, shards_as_local
from .reader import load_shards
from .rng import set_rng_state

_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")  # optimizer switches a resume keeps


def _saved_keys(snapshot: Snapshot) -> set[str]:
    return set(snapshot.metadata().state_dict_metadata)


def _borrow_tied_state(snapshot: Snapshot, optim_sd: dict[str, Any], ties: dict[str, str]) -> dict[str, str]:
    """A tied parameter held under another of its names here (a pipeline's last stage holds
    the head, tied to the first stage's embedding) reads its optimizer state from the name the
    snapshot keeps it under, where the snapshot has it under that name only (a layout that held
    the model whole). Returns {the name read: this rank's name}, to put back after loading."""
    if not ties or not optim_sd.get("state"):
        return {}
    saved = _saved_keys(snapshot)
    moved = {}
    for mine, theirs in ties.items():
        if mine in optim_sd["state"] and not any(k.startswith(f"optim.state.{mine}.") for k in saved):
            optim_sd["state"][theirs] = optim_sd["state"].pop(mine)
            moved[theirs] = mine
    return moved


def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         local_shards: Any = None, ties: dict[str, str] | None = None,
         lora: dict[str, Any] | None = None) -> tuple[Position, int]:
    """Load a snapshot collectively; returns the position and the world size it was saved
    with. The ranks verify a share of the files each; any failure stops every rank.
    ``local_shards`` as for ``begin_save``; ``ties``: {this rank's name of a tied parameter:
    the name the whole model gives it first}; ``lora``: a LoRA run's record (lorabase.record),
    which the snapshot's must match (the same base model, rank and layers): only the adapters
    and their optimizer state are loaded, the frozen base stays as the run read it."""
    rank, world = dist.get_rank(), dist.get_world_size()
    snapshot: Snapshot | None = None
    error: str | None = None
    try:
        snapshot = check(path, rank, world, defer_hashes=True)  # (a DCP snapshot's files: as they are read)
    except MeshrunError as exc:
        error = str(exc)
    failed = _first_failure(error)
    if failed or snapshot is None:  # (this rank's own failure is among them)
        raise MeshrunError(failed or str(error))
    state = snapshot.state
    check_resume(path, state.get("lora"), lora)  # (the same verified state.json on every rank: all refuse)
    saved_world = int(state["world_size"])
    same_world = saved_world == world
    rng: Any = None
    if isinstance(model, CheckpointingEngine):  # a DeepSpeed engine
        if not os.path.isdir(os.path.join(path, DS_DIR)):
            raise MeshrunError(f"{path}: not a DeepSpeed snapshot (hint: resume it with the strategy that wrote it)")
        if saved_world != world:
            raise MeshrunError(f"{path}: a DeepSpeed snapshot of {saved_world} ranks cannot be resumed on {world} "
                               "(ZeRO partitions are per rank; hint: resume on the same world size)")
        load_deepspeed(snapshot, model, adapters_only=lora is not None)
        rng = _rng_state(snapshot, rank) if same_world else None  # (every file was hashed by check)
    else:
        if os.path.isdir(os.path.join(path, DS_DIR)):
            raise MeshrunError(f"{path}: a DeepSpeed snapshot (hint: resume it with --strategy deepspeed)")
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        adapters = StateDictOptions(ignore_frozen_params=True, strict=False) if lora is not None else None
        model_sd, optim_sd = get_state_dict(model, optimizer, options=adapters)
        moved = _borrow_tied_state(snapshot, optim_sd, ties or {})
        sd = shards_as_dtensors(float8_unwrapped({"model": model_sd, "optim": optim_sd}), local_shards)
        read = load_shards(snapshot, sd)  # into the wrapped local tensors, in place
        rng = _rng_and_unread(snapshot, read, same_world)  # before any of it is used
        sd = shards_as_local(sd)
        for theirs, mine in moved.items():
            sd["optim"]["state"][mine] = sd["optim"]["state"].pop(theirs)
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"], options=adapters)
        # Under pipeline parallelism (torch 2.13) the groups come back without the
        # hyperparameters DCP keys by parameter name (lr, betas, eps, weight decay): they
        # are the config's anyway, and the lr schedule is recomputed from the step. The
        # implementation switches are this run's, never the snapshot's: AdamW's
        # __setstate__ fills a missing "fused" with None, which would resume unfused.
        for group, before in zip(optimizer.param_groups, hyper):
            for key, value in before.items():
                if key in _IMPLEMENTATION:
                    group[key] = value
                else:
                    group.setdefault(key, value)
    if same_world:
        set_rng_state(rng)
    return position(state), saved_world


def _first_failure(error: str | None) -> str | None:
    """Collective: the first rank's failure (None: no rank failed), the same on every rank."""
    outcomes: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, error)
    return next((outcome for outcome in outcomes if outcome), None)


def _rng_and_unread(snapshot: Snapshot, read: set[str], same_world: bool) -> Any:
    """Collective, after ``load_shards`` of a DCP snapshot: this rank's RNG state (on the
    world size that saved it; its file hash-checked as it is read), then the files no rank
    read hashed, a share on each rank. A failure on any rank is raised on every rank."""
    rank, world = dist.get_rank(), dist.get_world_size()
    rng, error = None, None
    if same_world:
        try:
            rng = _rng_state(snapshot, rank)
            read = read | {rng_file(rank)}
        except MeshrunError as exc:
            error = str(exc)
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, (sorted(read), error))
    failed = next((failure for _, failure in everyone if failure), None)
    if failed is None:  # (the same on every rank: all of them go on to this collective, or none)
        try:
            verify_unread(snapshot, {name for names, _ in everyone for name in names}, rank, world)
        except MeshrunError as exc:
            error = str(exc)
        failed = _first_failure(error)
    if failed:
        raise MeshrunError(failed)
    return rng


def _rng_state(snapshot: Snapshot, rank: int) -> Any:
    source = os.path.join(snapshot.path, rng_file(rank))
    try:
        return json.loads(read_verified(snapshot.path, rng_file(rank), snapshot.digests))
    except ValueError:
        raise MeshrunError(f"{source}: not JSON, though its checksum matches the marker; refusing it "
                           "(hint: resume from another snapshot)") from None
