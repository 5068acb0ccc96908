"""Reading a snapshot: the marker and every hash verified, DCP's metadata unpickled with an
allow-list, non-tensor values with ``weights_only=True``: no code in a snapshot runs.
Tensors are read by DCP with ``weights_only=True`` as well."""

from __future__ import annotations

import io
import json
import os
import pickle
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ...errors import MeshrunError
from .layout import DS_DIR, FORMAT, MARKER, Position, io_threads, listing, sha256
from .parts import shards_as_dtensors, shards_as_local
from .rng import set_rng_state

_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")  # optimizer switches a resume keeps


_SAFE_BUILTINS = {"dict", "list", "tuple", "set", "frozenset", "int", "float", "str", "bytes", "bool",
                  "complex", "slice", "NoneType"}
_TORCH_DTYPES = {str(d).split(".")[-1] for d in (torch.float32, torch.float16, torch.bfloat16, torch.float64,
                                                  torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
                                                  torch.bool, torch.complex64)}
# Exactly what a DCP metadata pickle refers to (read off real ones, torch 2.6-2.13).
_SAFE_GLOBALS = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"),
    ("collections", "OrderedDict"),
    ("torch", "Size"), ("torch", "device"), ("torch", "layout"), ("torch", "memory_format"),
}


class _AllowListUnpickler(pickle.Unpickler):
    """DCP's .metadata is a pickle; accept only the classes a real one contains."""

    def find_class(self, module: str, name: str) -> Any:
        ok = ((module, name) in _SAFE_GLOBALS
              or (module == "builtins" and name in _SAFE_BUILTINS)
              or (module == "torch" and name in _TORCH_DTYPES)
              # the metadata dataclasses and enums (no methods run when they are rebuilt)
              or (module == "torch.distributed.checkpoint.metadata"
                  and (name[:1].isupper() or name == "_MEM_FORMAT_ENCODING")))
        if not ok:
            raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")
        return super().find_class(module, name)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor values with weights_only=False."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def verify(path: str, part: int = 0, parts: int = 1) -> dict[str, Any]:
    """Check the marker, the hashes of files ``part::parts`` (all by default) and the
    metadata's classes; return state.json."""
    marker_path = os.path.join(path, MARKER)
    if not os.path.isfile(marker_path):
        raise MeshrunError(f"{marker_path} is missing: {path} is not a committed snapshot")
    try:
        with open(marker_path) as f:
            marker = json.load(f)
        files = marker["files"]
    except (ValueError, KeyError, TypeError):
        raise MeshrunError(f"{marker_path} is not a valid snapshot marker (truncated or edited)") from None
    if marker.get("format") != FORMAT:
        raise MeshrunError(f"{marker_path}: snapshot format {marker.get('format')!r}, this meshrun reads {FORMAT}")
    on_disk = set(listing(path)) - {MARKER}
    if on_disk != set(files):
        extra, missing = sorted(on_disk - set(files)), sorted(set(files) - on_disk)
        raise MeshrunError(f"{path}: files differ from its marker (missing {missing}, unexpected {extra})")
    from concurrent.futures import ThreadPoolExecutor

    mine = sorted(files.items())[part::parts]
    with ThreadPoolExecutor(max_workers=io_threads()) as pool:
        actual = list(pool.map(lambda item: sha256(os.path.join(path, item[0])), mine))
    for (name, digest), got in zip(mine, actual):
        if got != digest:
            raise MeshrunError(f"{os.path.join(path, name)} does not match the checksum in its marker: "
                               "truncated or altered; refusing to load it")
    try:
        if os.path.exists(os.path.join(path, ".metadata")):  # (a DeepSpeed snapshot has its own format)
            with open(os.path.join(path, ".metadata"), "rb") as f:
                _AllowListUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError) as exc:
        raise MeshrunError(f"{os.path.join(path, '.metadata')}: refused ({exc})") from None
    with open(os.path.join(path, "state.json")) as f:
        return json.load(f)


def _saved_keys(path: str) -> set[str]:
    with open(os.path.join(path, ".metadata"), "rb") as f:
        return set(_AllowListUnpickler(f).load().state_dict_metadata)


def _borrow_tied_state(path: str, optim_sd: dict[str, Any], ties: dict[str, str]) -> dict[str, str]:
    """A tied parameter held under another of its names here (a pipeline's last stage holds
    the head, tied to the first stage's embedding) reads its optimizer state from the name the
    snapshot keeps it under, where the snapshot has it under that name only (a layout that held
    the model whole). Returns {the name read: this rank's name}, to put back after loading."""
    if not ties or not optim_sd.get("state"):
        return {}
    saved = _saved_keys(path)
    moved = {}
    for mine, theirs in ties.items():
        if mine in optim_sd["state"] and not any(k.startswith(f"optim.state.{mine}.") for k in saved):
            optim_sd["state"][theirs] = optim_sd["state"].pop(mine)
            moved[theirs] = mine
    return moved


def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         local_shards: Any = None, ties: dict[str, str] | None = None) -> tuple[Position, int]:
    """Load a snapshot collectively; returns the position and the world size it was saved
    with. The ranks verify a share of the files each; any failure stops every rank.
    ``local_shards`` as for ``begin_save``; ``ties``: {this rank's name of a tied parameter:
    the name the whole model gives it first}."""
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        state: Any = verify(path, rank, world)
    except MeshrunError as exc:
        state = f"error: {exc}"
    outcomes: list[Any] = [None] * world
    dist.all_gather_object(outcomes, state)
    for outcome in outcomes:
        if isinstance(outcome, str):
            raise MeshrunError(outcome[len("error: "):])
    saved_world = int(state["world_size"])
    if hasattr(model, "load_checkpoint"):  # a DeepSpeed engine
        if not os.path.isdir(os.path.join(path, DS_DIR)):
            raise MeshrunError(f"{path}: not a DeepSpeed snapshot (hint: resume it with the strategy that wrote it)")
        if saved_world != world:
            raise MeshrunError(f"{path}: a DeepSpeed snapshot of {saved_world} ranks cannot be resumed on {world} "
                               "(ZeRO partitions are per rank; hint: resume on the same world size)")
        model.load_checkpoint(path, tag=DS_DIR, load_optimizer_states=True, load_lr_scheduler_states=False)
    else:
        if os.path.isdir(os.path.join(path, DS_DIR)):
            raise MeshrunError(f"{path}: a DeepSpeed snapshot (hint: resume it with --strategy deepspeed)")
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        model_sd, optim_sd = get_state_dict(model, optimizer)
        moved = _borrow_tied_state(path, optim_sd, ties or {})
        sd = shards_as_dtensors({"model": model_sd, "optim": optim_sd}, local_shards)
        dcp.load(sd, checkpoint_id=path, planner=SafeLoadPlanner())  # into the wrapped local tensors, in place
        sd = shards_as_local(sd)
        for theirs, mine in moved.items():
            sd["optim"]["state"][mine] = sd["optim"]["state"].pop(theirs)
        set_state_dict(model, optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
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
    rng_path = os.path.join(path, f"rng-rank{rank}.json")
    if saved_world == dist.get_world_size() and os.path.isfile(rng_path):
        with open(rng_path) as f:
            set_rng_state(json.load(f))
    return Position(**state["position"]), saved_world
