"""Snapshots: sharded, atomic, verified, resumable on another world size.

Layout under ``OUT/checkpoints``::

    .tmp-step-00000100/      being written; ignored (and cleared) by readers
    step-00000100/           committed: renamed from .tmp-* after COMMITTED.json was written
        .metadata, __*_*.distcp   torch.distributed.checkpoint (model + optimizer, each rank its shards)
        state.json                step, data position, config, format version
        rng-rank<R>.json          each rank's Python, NumPy, torch and CUDA RNG states
        COMMITTED.json            written last by rank 0: format, step, world size, SHA-256 of every file

Commit protocol: every rank writes into the temporary directory; a barrier; rank 0 hashes
and fsyncs every file, writes the marker (fsync), renames the directory (atomic) and fsyncs
the parent. A crash at any point leaves either the previous snapshot as the newest
committed one, or the new one complete. Loading verifies the marker and every hash (a
truncated or altered file is refused, naming it), unpickles DCP's metadata with an
allow-list, and reads non-tensor values with ``weights_only=True``: no code in a snapshot
runs. Tensors are read by DCP with ``weights_only=True`` as well.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
import pickle
import random
import shutil
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ..errors import MeshrunError
from .staging import Stager

FORMAT = 1
MARKER = "COMMITTED.json"
_IMPLEMENTATION = ("fused", "foreach", "capturable", "differentiable")  # optimizer switches a resume keeps
PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
TRASH_PREFIX = ".trash-step-"  # pruned snapshots on their way out


@dataclass(frozen=True)
class Position:
    """Where training is: optimizer steps done, and the data read in the current epoch
    (global samples, all ranks together, so it maps onto any world size)."""

    step: int = 0
    epoch: int = 0
    samples: int = 0


def snapshot_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def committed(root: str) -> list[tuple[int, str]]:
    """(step, path) of committed snapshots, oldest first. A ``step-*`` directory without
    its marker is not a partial save (those stay under ``.tmp-*``): it was damaged."""
    out = []
    if not os.path.isdir(root):
        return out
    for name in os.listdir(root):
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(root, name)
        if not os.path.isfile(os.path.join(path, MARKER)):
            raise MeshrunError(f"snapshot {path} has no {MARKER}: it was damaged or edited "
                               "(hint: move it away, or pass --resume with another snapshot)")
        try:
            out.append((int(name[len(PREFIX):]), path))
        except ValueError:
            continue
    return sorted(out)


def latest(root: str) -> str | None:
    snaps = committed(root)
    return snaps[-1][1] if snaps else None


# ---- saving -----------------------------------------------------------------------------

def _fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def rng_state() -> dict[str, Any]:
    np_state = np.random.get_state()
    return {
        "python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
        "numpy": [np_state[0], np_state[1].tolist(), *np_state[2:]],
        "torch": torch.get_rng_state().tolist(),
        "cuda": [s.tolist() for s in torch.cuda.get_rng_state_all()] if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict[str, Any]) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([torch.tensor(s, dtype=torch.uint8) for s in state["cuda"]])


@dataclass
class PendingSave:
    """A snapshot whose shards are (being) written but which is not committed yet."""

    root: str
    tmp: str
    final: str
    position: Position
    config_json: str
    keep_last: int
    hasher: Any = None  # an asynchronous save's background thread: wait for the writes, hash them
    error: str | None = None  # what stopped that thread, if anything
    # where the training loop's time went (seconds), for benchmarks: state_dict_s, stage_s
    timings: dict[str, float] = field(default_factory=dict)
    commit_s: float = 0.0  # how long commit() took
    wait_s: float = 0.0  # of which waiting for the background write to finish
    started: float = 0.0  # perf_counter() when begin_save started, and when its background write ended
    written: float = 0.0


def begin_save(root: str, position: Position, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
               config_json: str, keep_last: int, async_group: Any = None, local_shards: Any = None) -> PendingSave:
    """Every rank writes its shards and RNG state into the temporary directory. With
    ``async_group`` (a gloo group), the tensors are staged to CPU memory now and written by
    a background thread while training goes on. ``local_shards(fqn)`` gives (mesh,
    placements) for plain parameters that hold only this rank's part of a larger tensor (the
    experts under expert parallelism): without it DCP would take them for replicas and keep
    one rank's part."""
    rank = dist.get_rank()
    tmp = os.path.join(root, TMP_PREFIX + f"{position.step:08d}")
    pending = PendingSave(root, tmp, os.path.join(root, snapshot_name(position.step)), position, config_json,
                          keep_last, started=time.perf_counter())
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # a previous attempt's leftovers
        os.makedirs(tmp)
    dist.barrier()
    _write_json(os.path.join(tmp, f"rng-rank{rank}.json"), rng_state())
    if hasattr(model, "save_checkpoint"):  # a DeepSpeed engine: its format, inside this commit protocol
        model.save_checkpoint(tmp, tag=DS_DIR, save_latest=False)
        dist.barrier()  # every rank's DeepSpeed files are written before rank 0 hashes them
        _hash_own_files(tmp, rank)
        return pending
    t0 = time.perf_counter()
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = _shards_as_dtensors({"model": model_sd, "optim": optim_sd}, local_shards)
    pending.timings["state_dict_s"] = time.perf_counter() - t0
    writer = dcp.FileSystemWriter(tmp, thread_count=io_threads())
    if async_group is None:
        from torch.distributed.checkpoint.api import CheckpointException

        try:
            dcp.save(state, storage_writer=writer)  # DCP raises the same failure on every rank
        except CheckpointException as exc:
            raise _write_failed(tmp, f"the write failed ({_describe(exc)})") from None
        _hash_own_files(tmp, rank)
        return pending
    t0 = time.perf_counter()
    staged = _STAGER.stage(state)  # into reused CPU buffers; training may change the weights after this
    pending.timings["stage_s"] = time.perf_counter() - t0

    def finish() -> None:
        try:
            delay = float(os.environ.get("MESHRUN_WRITE_DELAY_S") or 0)
            if delay:  # a debugging aid: a slow disk (tests of the slow-writer advice)
                time.sleep(delay)
            dcp.save(staged, storage_writer=writer, process_group=async_group)
            _hash_own_files(tmp, rank)
            pending.written = time.perf_counter()
        # BaseException: DCP's CheckpointException is not an Exception. Reported to every rank
        # by commit(), which then seals nothing.
        except BaseException as exc:  # noqa: BLE001
            pending.error = _describe(exc)

    pending.hasher = threading.Thread(target=finish, name="meshrun-snapshot", daemon=True)
    pending.hasher.start()
    return pending


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

DS_DIR = "deepspeed"  # a DeepSpeed engine's own checkpoint files, inside the snapshot


def _listing(path: str) -> list[str]:
    """Files of a snapshot directory, those of its DeepSpeed subdirectory as ``deepspeed/NAME``."""
    names = [n for n in os.listdir(path) if n != DS_DIR]
    sub = os.path.join(path, DS_DIR)
    if os.path.isdir(sub):
        names += [f"{DS_DIR}/{n}" for n in os.listdir(sub)]
    return names


def _own_files(tmp: str, rank: int) -> list[str]:
    """The files this rank wrote: its DCP shards (``__<rank>_<i>.distcp``) and RNG state;
    rank 0 also takes a DeepSpeed engine's files (their names follow DeepSpeed's rules)."""
    own = [n for n in os.listdir(tmp) if n.startswith(f"__{rank}_") or n == f"rng-rank{rank}.json"]
    if rank == 0 and os.path.isdir(os.path.join(tmp, DS_DIR)):
        # DeepSpeed's files, and the recovery scripts it copies beside them (zero_to_fp32.py)
        own += [n for n in _listing(tmp) if n.startswith(DS_DIR + "/") or n.endswith(".py")]
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


def io_threads() -> int:
    """Writer and hasher threads per rank: DCP writes one file per thread, and hashlib and
    file I/O release the GIL, so a rank uses several cores. MESHRUN_SAVE_THREADS overrides."""
    if os.environ.get("MESHRUN_SAVE_THREADS"):
        return max(1, int(os.environ["MESHRUN_SAVE_THREADS"]))
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(8, (os.cpu_count() or 1) // local))


def _hash_own_files(tmp: str, rank: int) -> None:
    """Each rank fsyncs and hashes what it wrote, in parallel with the other ranks and over
    several threads (rank 0 alone would take world-size times longer on a large snapshot)."""
    from concurrent.futures import ThreadPoolExecutor

    names = _own_files(tmp, rank)

    def one(name: str) -> str:
        _fsync_file(os.path.join(tmp, name))
        return _sha256(os.path.join(tmp, name))

    with ThreadPoolExecutor(max_workers=io_threads()) as pool:
        hashes = dict(zip(names, pool.map(one, names)))
    _write_json(os.path.join(tmp, f".hashes-rank{rank}.json"), hashes)


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
    pause = float(os.environ.get("MESHRUN_SAVE_PAUSE_S") or 0)
    if pause:  # a debugging aid: hold a save between its shards and its commit (crash tests)
        time.sleep(pause)
    dist.barrier()  # every rank's shards and RNG file are on disk
    if dist.get_rank() == 0:
        _write_json(os.path.join(p.tmp, "state.json"), {"format": FORMAT, "position": asdict(p.position),
                                                       "world_size": dist.get_world_size(),
                                                       "config": json.loads(p.config_json)})
        files = {}
        for name in sorted(os.listdir(p.tmp)):
            if name.startswith(".hashes-rank"):
                with open(os.path.join(p.tmp, name)) as f:
                    files.update(json.load(f))
                os.unlink(os.path.join(p.tmp, name))
        for name in (".metadata", "state.json"):  # rank 0's own (no .metadata in a DeepSpeed snapshot)
            if os.path.exists(os.path.join(p.tmp, name)):
                _fsync_file(os.path.join(p.tmp, name))
                files[name] = _sha256(os.path.join(p.tmp, name))
        _write_json(os.path.join(p.tmp, MARKER), {"format": FORMAT, "step": p.position.step,
                                                   "world_size": dist.get_world_size(), "files": files})
        _fsync_dir(p.tmp)
        if os.path.exists(p.final):  # the same step saved again (a restart that redid it)
            shutil.rmtree(p.final)
        os.replace(p.tmp, p.final)
        _fsync_dir(p.root)
        prune(p.root, p.keep_last, background=p.hasher is not None)  # async: off training's path
    dist.barrier()
    return p.final


def save(root: str, position: Position, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         config_json: str, keep_last: int, local_shards: Any = None) -> str:
    """Write and commit a snapshot (collective); returns its path."""
    return commit(begin_save(root, position, model, optimizer, config_json, keep_last, local_shards=local_shards))


def _shards_as_dtensors(sd: dict[str, Any], local_shards: Any) -> dict[str, Any]:
    """The model and optimizer entries of per-rank parts, wrapped (no copy) as DTensors of
    their global tensor, so DCP saves every rank's part and can reshard them on load."""
    if local_shards is None:
        return sd
    from torch.distributed.tensor import DTensor

    def wrap(fqn: str, t: Any, param_shape: Any) -> Any:
        spec = local_shards(fqn)
        if spec is None or not isinstance(t, torch.Tensor) or isinstance(t, DTensor) or t.shape != param_shape:
            return t  # not a part, or a scalar optimizer entry (Adam's step)
        mesh, placements = spec
        d = DTensor.from_local(t, mesh, placements, run_check=False)
        d._meshrun_part = True  # type: ignore[attr-defined]  # ours to unwrap after a load
        return d

    shapes = {k: getattr(v, "shape", None) for k, v in sd["model"].items()}
    model_sd = {k: wrap(k, v, shapes[k]) for k, v in sd["model"].items()}
    optim = dict(sd["optim"])
    optim["state"] = {k: {n: wrap(k, v, shapes.get(k)) for n, v in st.items()} for k, st in optim["state"].items()}
    return {**sd, "model": model_sd, "optim": optim}


def _shards_as_local(sd: dict[str, Any]) -> dict[str, Any]:
    """Undo ``_shards_as_dtensors`` after a load: the parts, now holding the snapshot's values."""
    def unwrap(v: Any) -> Any:
        return v.to_local() if getattr(v, "_meshrun_part", False) else v

    optim = dict(sd["optim"])
    optim["state"] = {k: {n: unwrap(v) for n, v in st.items()} for k, st in optim["state"].items()}
    return {**sd, "model": {k: unwrap(v) for k, v in sd["model"].items()}, "optim": optim}


def prune(root: str, keep_last: int, background: bool = False) -> None:
    """Delete all but the ``keep_last`` newest committed snapshots (0 keeps all). Only
    committed ones are candidates, so a snapshot being written is never touched, and the
    newest committed one always stays. Each goes out of ``committed()`` at once by an atomic
    rename to ``.trash-*``; with ``background`` the files are deleted by a thread, so an
    asynchronous save's commit does not hold training while a large snapshot is unlinked
    (``wait_pruned`` joins it; a killed process's leftovers go with ``clear_partial``)."""
    if keep_last <= 0:
        return
    doomed = []
    for _, path in committed(root)[:-keep_last]:
        trash = os.path.join(root, TRASH_PREFIX + os.path.basename(path)[len(PREFIX):])
        if os.path.exists(trash):  # the same step pruned before (a restart redid it)
            shutil.rmtree(trash, ignore_errors=True)
        os.replace(path, trash)
        doomed.append(trash)
    if not doomed:
        return

    def delete() -> None:
        for path in doomed:
            shutil.rmtree(path, ignore_errors=True)

    if background:
        thread = threading.Thread(target=delete, name="meshrun-prune", daemon=True)
        thread.start()
        _PRUNING.append(thread)
    else:
        delete()


_PRUNING: list[threading.Thread] = []  # background deletions of pruned snapshots


def wait_pruned() -> None:
    """Join the background deletions: at the end of a run no pruned snapshot is left behind."""
    while _PRUNING:
        _PRUNING.pop().join()


def clear_partial(root: str) -> None:
    """Remove ``.tmp-*`` directories left by a save that was killed, and ``.trash-*`` ones
    left by a deletion that was."""
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith((TMP_PREFIX, TRASH_PREFIX)):
                shutil.rmtree(os.path.join(root, name), ignore_errors=True)


# ---- loading ----------------------------------------------------------------------------

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
    on_disk = set(_listing(path)) - {MARKER}
    if on_disk != set(files):
        extra, missing = sorted(on_disk - set(files)), sorted(set(files) - on_disk)
        raise MeshrunError(f"{path}: files differ from its marker (missing {missing}, unexpected {extra})")
    from concurrent.futures import ThreadPoolExecutor

    mine = sorted(files.items())[part::parts]
    with ThreadPoolExecutor(max_workers=io_threads()) as pool:
        actual = list(pool.map(lambda item: _sha256(os.path.join(path, item[0])), mine))
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


def load(path: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
         local_shards: Any = None) -> tuple[Position, int]:
    """Load a snapshot collectively; returns the position and the world size it was saved
    with. The ranks verify a share of the files each; any failure stops every rank.
    ``local_shards`` as for ``begin_save``."""
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
        sd = _shards_as_dtensors({"model": model_sd, "optim": optim_sd}, local_shards)
        dcp.load(sd, checkpoint_id=path, planner=SafeLoadPlanner())  # into the wrapped local tensors, in place
        sd = _shards_as_local(sd)
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


def export_safetensors(path: str, target: str) -> int:
    """Consolidate a snapshot's model weights into one safetensors file (one process, no
    process group); returns the number of tensors written."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    verify(path)
    meta = FileSystemReader(path).read_metadata()  # safe: verify() vetted its classes
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
          if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    if not sd:
        raise MeshrunError(f"{path}: the snapshot holds no model weights")
    import warnings

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=path, planner=SafeLoadPlanner(), no_dist=True)
    tensors = {k[len("model."):]: t.contiguous() for k, t in sd.items()}
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    save_file(tensors, target, metadata={"format": "pt", "source": os.path.abspath(path)})
    return len(tensors)
