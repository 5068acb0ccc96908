"""Writing a snapshot: every rank its shards (now, or staged to CPU memory and written by a
background thread), then the commit: rank 0 hashes, marks and renames (layout.py)."""

from __future__ import annotations

import json
import math
import os
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

from ...errors import MeshrunError
from ..models.hooks import CheckpointingEngine
from .integrity import METADATA, STATE, missing_files, unpickle_metadata
from .layout import (
    DS_DIR,
    FORMAT,
    MARKER,
    TMP_PREFIX,
    Position,
    fsync_dir,
    fsync_file,
    io_threads,
    listing,
    prune,
    sha256,
    snapshot_name,
    write_json,
)
from .parts import float8_unwrapped, shards_as_dtensors
from .rng import rng_state
from .staging import Stager


@dataclass
class PendingSave:
    """A snapshot whose shards are (being) written but which is not committed yet."""

    root: str
    tmp: str
    final: str
    position: Position
    config_json: str
    keep_last: int
    model_meta: Any = None  # what an export needs to rebuild the model (a Hugging Face config), in state.json
    hasher: Any = None  # an asynchronous save's background thread: wait for the writes, hash them
    error: str | None = None  # what stopped that thread, if anything
    # where the training loop's time went (seconds), for benchmarks: state_dict_s, stage_s
    timings: dict[str, float] = field(default_factory=dict)
    commit_s: float = 0.0  # how long commit() took
    wait_s: float = 0.0  # of which waiting for the background write to finish
    started: float = 0.0  # perf_counter() when begin_save started, and when its background write ended
    written: float = 0.0
    run_id: str | None = None  # the run the snapshot belongs to (config/outdir.py), in state.json
    lora: Any = None  # a LoRA run's adapters and base model (lorabase.py), in state.json


def begin_save(root: str, position: Position, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               config_json: str, keep_last: int, async_group: Any = None, local_shards: Any = None,
               model_meta: Any = None, run_id: str | None = None, lora: Any = None) -> PendingSave:
    """Every rank writes its shards and RNG state into the temporary directory. With
    ``async_group`` (a gloo group), the tensors are staged to CPU memory now and written by
    a background thread while training goes on. ``local_shards(fqn)`` gives (mesh,
    placements) for plain parameters that hold only this rank's part of a larger tensor (the
    experts under expert parallelism): without it DCP would take them for replicas and keep
    one rank's part. ``lora``: a LoRA run's record (lorabase.record): the snapshot then holds
    the adapters and their optimizer state, none of the frozen parameters."""
    rank = dist.get_rank()
    tmp = os.path.join(root, TMP_PREFIX + f"{position.step:08d}")
    pending = PendingSave(root, tmp, os.path.join(root, snapshot_name(position.step)), position, config_json,
                          keep_last, model_meta, started=time.perf_counter(), run_id=run_id, lora=lora)
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a previous attempt's leftovers
        os.makedirs(tmp)
    dist.barrier()
    write_json(os.path.join(tmp, f"rng-rank{rank}.json"), rng_state())
    if isinstance(model, CheckpointingEngine):  # a DeepSpeed engine: its format, inside this commit protocol
        model.save_checkpoint(tmp, tag=DS_DIR, save_latest=False, exclude_frozen_parameters=lora is not None)
        dist.barrier()  # every rank's DeepSpeed files are written before rank 0 hashes them
        _hash_own_files(tmp, rank)
        return pending
    t0 = time.perf_counter()
    frozen_out = StateDictOptions(ignore_frozen_params=lora is not None)
    model_sd, optim_sd = get_state_dict(model, optimizer, options=frozen_out)
    state = shards_as_dtensors(float8_unwrapped({"model": model_sd, "optim": optim_sd}), local_shards)
    pending.timings["state_dict_s"] = time.perf_counter() - t0
    writer = dcp.FileSystemWriter(tmp, thread_count=io_threads())
    planner = _planner(state)
    if async_group is None:
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.save(state, storage_writer=writer, planner=planner)  # DCP raises the same failure on every rank
        except CheckpointException as exc:
            raise _write_failed(tmp, f"the write failed ({_describe(exc)})") from None
        _hash_own_files(tmp, rank)
        return pending
    t0 = time.perf_counter()
    staged = _STAGER.stage(state)  # into reused CPU buffers; training may change the weights after this
    pending.timings["stage_s"] = time.perf_counter() - t0

    def finish() -> None:
        try:
            dcp.save(staged, storage_writer=writer, planner=planner, process_group=async_group)
            _hash_own_files(tmp, rank)
            pending.written = time.perf_counter()
        # BaseException: DCP's CheckpointException is not an Exception. Reported to every rank
        # by commit(), which then seals nothing.
        except BaseException as exc:  # noqa: BLE001
            pending.error = _describe(exc)

    pending.hasher = threading.Thread(target=finish, name="meshrun-snapshot", daemon=True)
    pending.hasher.start()
    return pending


def _planner(state: dict[str, Any]) -> DefaultSavePlanner:
    """DCP's planner. What every rank holds alike is written once, and DCP's default spreads
    those items over the ranks' files to balance the writes. With sharded weights (DTensors:
    FSDP, tensor or expert parallelism) what is alike is small (step counts, hyperparameters,
    buffers), but spread it made every rank read every file on resume, since a rank reads each
    file it needs whole to check its hash; written by rank 0 it costs each rank about half as
    much (docs/decisions.md#what-every-rank-holds-alike). Replicated weights (DDP) stay spread:
    every rank reads all of them anyway, and the writes stay balanced."""
    from torch.distributed.tensor import DTensor

    sharded = any(isinstance(v, DTensor) for v in state["model"].values())
    return DefaultSavePlanner(dedup_save_to_lowest_rank=sharded)


def _write_failed(tmp: str, what: str) -> MeshrunError:
    return MeshrunError(f"snapshot {tmp}: {what}; it is not committed and the previous snapshot stays the newest "
                        "(hint: check the disk under --out: free space, permissions)")


def _describe(exc: BaseException) -> str:
    """One line for a failed write: DCP's CheckpointException carries each rank's exception
    (and a traceback we do not want in an error line)."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        wrapped = failures[min(failures)]
        exc = wrapped[0] if isinstance(wrapped, tuple) else wrapped
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0] if text else ''}"


_STAGER = Stager()  # this process's staging buffers for asynchronous snapshots, reused by every save


def _own_files(tmp: str, rank: int) -> list[str]:
    """The files this rank wrote: its DCP shards (``__<rank>_<i>.distcp``) and RNG state;
    rank 0 also takes a DeepSpeed engine's files (their names follow DeepSpeed's rules)."""
    own = [n for n in os.listdir(tmp) if n.startswith(f"__{rank}_") or n == f"rng-rank{rank}.json"]
    if rank == 0 and os.path.isdir(os.path.join(tmp, DS_DIR)):
        # DeepSpeed's files, and the recovery scripts it copies beside them (zero_to_fp32.py)
        own += [n for n in listing(tmp) if n.startswith(DS_DIR + "/") or n.endswith(".py")]
    return sorted(own)


def slow_writer_advice(wait_s: float, write_s: float, interval_s: float, save_every: int) -> str | None:
    """One line when training had to wait for the previous asynchronous snapshot: its write
    (dominated by the disk: every shard is fsynced before the commit) took longer than the
    steps between two saves. Names a --save-every that leaves the writer 20% headroom."""
    if wait_s < 1.0 or interval_s <= 0 or save_every <= 0:
        return None
    steps = math.ceil(save_every * 1.2 * write_s / interval_s)
    return (f"snapshots: training waited {wait_s:.1f} s for the previous snapshot's background write, which "
            f"took {write_s:.1f} s while snapshots are {interval_s:.1f} s ({save_every} steps) apart "
            f"(hint: --save-every {steps} or more, or a faster disk under --out)")


def _hash_own_files(tmp: str, rank: int) -> None:
    """Each rank fsyncs and hashes what it wrote, in parallel with the other ranks and over
    several threads (rank 0 alone would take world-size times longer on a large snapshot)."""
    from concurrent.futures import ThreadPoolExecutor

    names = _own_files(tmp, rank)

    def one(name: str) -> str:
        fsync_file(os.path.join(tmp, name))
        return sha256(os.path.join(tmp, name))

    with ThreadPoolExecutor(max_workers=io_threads()) as pool:
        hashes = dict(zip(names, pool.map(one, names)))
    write_json(os.path.join(tmp, f".hashes-rank{rank}.json"), hashes)


def _refuse_incomplete(tmp: str) -> None:
    """Collective: rank 0 checks that the marker about to be written lists every file the
    layout requires (each rank's RNG file, .metadata and every shard file it names); if not,
    every rank raises the same line, so nothing is committed and no rank waits for another."""
    error: list[str | None] = [None]
    if dist.get_rank() == 0:
        try:
            error[0] = _incomplete(tmp, dist.get_world_size())
        except MeshrunError as exc:
            error[0] = str(exc)
    dist.broadcast_object_list(error, src=0)
    if error[0]:
        raise _write_failed(tmp, error[0])


def _incomplete(tmp: str, world_size: int) -> str | None:
    """What the marker would lack, as a phrase (None: nothing). It lists every rank's hashed
    files, .metadata and state.json (which the commit writes itself)."""
    listed = {STATE}
    for name in os.listdir(tmp):
        if name.startswith(".hashes-rank"):
            with open(os.path.join(tmp, name)) as f:
                listed.update(json.load(f))
    deepspeed = os.path.isdir(os.path.join(tmp, DS_DIR))
    metadata = None
    if not deepspeed and os.path.isfile(os.path.join(tmp, METADATA)):
        listed.add(METADATA)
        with open(os.path.join(tmp, METADATA), "rb") as f:
            metadata = unpickle_metadata(f.read(), os.path.join(tmp, METADATA))
    missing = missing_files(listed, world_size, metadata, deepspeed)
    return f"it lacks {missing}, which every snapshot needs" if missing else None


def commit(p: PendingSave) -> str:
    """Collective: wait for this rank's writes, then rank 0 seals the snapshot (hashes,
    marker, atomic rename) once every rank is done."""
    start = time.perf_counter()
    try:
        return _commit(p)
    finally:
        p.commit_s = time.perf_counter() - start


def _commit(p: PendingSave) -> str:
    if p.hasher is not None:
        t0 = time.perf_counter()
        p.hasher.join()
        p.wait_s = time.perf_counter() - t0
        errors: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(errors, p.error)  # every rank learns of a failed write, and none seals it
        failed = [(r, e) for r, e in enumerate(errors) if e]
        if failed:
            rank, why = failed[0]
            raise _write_failed(p.tmp, f"rank {rank}'s background write failed ({why})")
    dist.barrier()  # every rank's shards and RNG file are on disk
    _refuse_incomplete(p.tmp)
    if dist.get_rank() == 0:
        write_json(os.path.join(p.tmp, "state.json"), {"format": FORMAT, "position": asdict(p.position),
                                                       "world_size": dist.get_world_size(),
                                                       "config": json.loads(p.config_json),
                                                       **({"model": p.model_meta} if p.model_meta else {}),
                                                       **({"run_id": p.run_id} if p.run_id else {}),
                                                       **({"lora": p.lora} if p.lora else {})})
        files = {}
        for name in sorted(os.listdir(p.tmp)):
            if name.startswith(".hashes-rank"):
                with open(os.path.join(p.tmp, name)) as f:
                    files.update(json.load(f))
                os.unlink(os.path.join(p.tmp, name))
        for name in (".metadata", "state.json"):  # rank 0's own (no .metadata in a DeepSpeed snapshot)
            if os.path.exists(os.path.join(p.tmp, name)):
                fsync_file(os.path.join(p.tmp, name))
                files[name] = sha256(os.path.join(p.tmp, name))
        write_json(os.path.join(p.tmp, MARKER), {"format": FORMAT, "step": p.position.step,
                                                   "world_size": dist.get_world_size(), "files": files})
        fsync_dir(p.tmp)
        if os.path.exists(p.final):  # the same step saved again (a restart that redid it)
            shutil.rmtree(p.final)
        os.replace(p.tmp, p.final)
        fsync_dir(p.root)
        prune(p.root, p.keep_last, background=p.hasher is not None)  # async: off training's path
    dist.barrier()
    return p.final


def save(root: str, position: Position, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         config_json: str, keep_last: int, local_shards: Any = None, model_meta: Any = None) -> str:
    """Write and commit a snapshot (collective); returns its path."""
    return commit(begin_save(root, position, model, optimizer, config_json, keep_last, local_shards=local_shards,
                             model_meta=model_meta))
