"""Reading a snapshot: the marker and every hash verified, DCP's metadata unpickled with an
allow-list, non-tensor values with ``weights_only=True``: no code in a snapshot runs.
Tensors are read by DCP with ``weights_only=True`` as well.

Every file that is parsed or unpickled (``.metadata``, ``state.json``, the RNG files, each
``.distcp`` shard, each of a DeepSpeed engine's own files) is read once into memory, its
SHA-256 compared with the marker's, and parsed from those same bytes: a file swapped on disk
after its check is never what is read. DeepSpeed's files are unpickled with
``weights_only=True`` and an allow-list of the few DeepSpeed classes they hold.

Resuming or exporting a DCP snapshot reads each file once: the shard and RNG files are hashed
as they are read for loading, and only the files no rank read are hashed apart
(``verify_unread``), before any of the loaded state is used. A DeepSpeed snapshot's files
are all hashed before its engine loads them (``check``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
import os
import pickle
from collections.abc import Collection, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from ...errors import MeshrunError
from ..models.hooks import CheckpointingEngine
from .layout import DS_DIR, FORMAT, MARKER, Position, io_threads, listing, sha256
from .parts import float8_unwrapped, shards_as_dtensors, shards_as_local
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


METADATA = ".metadata"  # DCP's metadata, a pickle
STATE = "state.json"
_READ_WHOLE = (METADATA, STATE)  # read whole by every rank, so hashed as they are read


def rng_file(rank: int) -> str:
    return f"rng-rank{rank}.json"


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """A committed snapshot as verified: its marker's digests and world size, state.json, and
    DCP's metadata as the bytes that were hashed (None in a DeepSpeed snapshot)."""

    path: str
    digests: Mapping[str, str]
    world_size: int
    state: dict[str, Any]
    metadata_bytes: bytes | None

    def metadata(self) -> Any:
        """DCP's Metadata, unpickled with the allow-list from the verified bytes (a new object
        on each call: DCP writes into the one it is given)."""
        if self.metadata_bytes is None:
            raise MeshrunError(f"{self.path}: a DeepSpeed snapshot has no {METADATA} "
                               "(hint: resume it with --strategy deepspeed)")
        return unpickle_metadata(self.metadata_bytes, os.path.join(self.path, METADATA))


def unpickle_metadata(data: bytes, source: str) -> Any:
    """DCP's metadata from its bytes, accepting only the classes a real one contains."""
    try:
        return _AllowListUnpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError, TypeError) as exc:
        raise MeshrunError(f"{source}: refused ({exc})") from None


def read_verified(path: str, name: str, digests: Mapping[str, str]) -> bytes:
    """The bytes of the snapshot's file ``name``, read once and checked against the marker's
    SHA-256: the caller parses these bytes, never the file again."""
    full = os.path.join(path, name)
    want = digests.get(name)
    if want is None:
        raise MeshrunError(f"{full}: not listed in the snapshot's {MARKER}; refusing to read it "
                           "(hint: the snapshot was edited: resume from another one)")
    try:
        with open(full, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise MeshrunError(f"{full}: cannot be read ({exc.strerror}); refusing the snapshot") from None
    if hashlib.sha256(data).hexdigest() != want:
        raise MeshrunError(f"{full} does not match the checksum in its marker: truncated or altered; "
                           "refusing to load it")
    return data


def required_files(world_size: int, metadata: Any, deepspeed: bool) -> set[str]:
    """The files a committed snapshot must hold: state.json and every rank's RNG state; for DCP
    also ``.metadata`` and each shard file its ``storage_data`` refers to (``metadata`` None:
    those not known yet). A DeepSpeed snapshot's own files follow DeepSpeed's rules."""
    names = {STATE, *(rng_file(r) for r in range(world_size))}
    if deepspeed:
        return names
    names.add(METADATA)
    if metadata is not None:
        storage = getattr(metadata, "storage_data", None)
        if not isinstance(storage, Mapping):
            raise MeshrunError(f"{METADATA}: its storage_data is {type(storage).__name__}, not a mapping of "
                               "shards; refusing the snapshot (hint: it was not written by DCP)")
        names.update(str(getattr(info, "relative_path", "")) for info in storage.values())
    return names


def missing_files(names: Collection[str], world_size: int, metadata: Any, deepspeed: bool) -> list[str]:
    """Which of ``required_files`` are not among ``names`` (sorted)."""
    return sorted(required_files(world_size, metadata, deepspeed) - set(names))


def _require(path: str, digests: Mapping[str, str], world_size: int, metadata: Any) -> None:
    missing = missing_files(digests, world_size, metadata, _is_deepspeed(digests))
    if missing:
        raise MeshrunError(f"{path}: the snapshot lacks {missing}, which its layout requires (state.json, "
                           f".metadata, each of its {world_size} ranks' RNG file and every shard file its "
                           ".metadata names); refusing it (hint: it was not written whole: resume from another "
                           "snapshot)")


def _is_deepspeed(names: Collection[str]) -> bool:
    return any(n.startswith(DS_DIR + "/") for n in names)


def _read_marker(path: str) -> tuple[dict[str, str], int]:
    """The marker's {file: SHA-256} and world size."""
    marker_path = os.path.join(path, MARKER)
    if not os.path.isfile(marker_path):
        raise MeshrunError(f"{marker_path} is missing: {path} is not a committed snapshot")
    try:
        with open(marker_path) as f:
            marker = json.load(f)
        files, world = marker["files"], marker["world_size"]
        if not (isinstance(files, dict) and all(isinstance(v, str) for v in files.values())
                and isinstance(world, int) and world >= 1):
            raise TypeError
    except (ValueError, KeyError, TypeError, RecursionError):
        raise MeshrunError(f"{marker_path} is not a valid snapshot marker (truncated or edited)") from None
    if marker.get("format") != FORMAT:
        raise MeshrunError(f"{marker_path}: snapshot format {marker.get('format')!r}, this meshrun reads {FORMAT}")
    return files, world


def _hash_share(path: str, digests: Mapping[str, str], part: int, parts: int) -> None:
    """Hash files ``part::parts`` of those in ``digests`` not read whole by every rank anyway
    (.metadata, state.json), over several threads."""
    from concurrent.futures import ThreadPoolExecutor

    mine = sorted((n, d) for n, d in digests.items() if n not in _READ_WHOLE)[part::parts]
    with ThreadPoolExecutor(max_workers=io_threads()) as pool:
        actual = list(pool.map(lambda item: sha256(os.path.join(path, item[0])), mine))
    for (name, digest), got in zip(mine, actual):
        if got != digest:
            raise MeshrunError(f"{os.path.join(path, name)} does not match the checksum in its marker: "
                               "truncated or altered; refusing to load it")


def _parse_state(data: bytes, source: str) -> dict[str, Any]:
    try:
        state = json.loads(data)
        if not (isinstance(state, dict) and isinstance(state.get("position"), dict)
                and isinstance(state.get("world_size"), int)):
            raise TypeError
        _position(state)  # (its fields, no others)
    except (ValueError, TypeError, RecursionError):  # (UnicodeDecodeError is a ValueError)
        raise MeshrunError(f"{source}: not a snapshot state (JSON with position and world_size), though its "
                           "checksum matches the marker; refusing it (hint: resume from another snapshot)") from None
    return state


def check(path: str, part: int = 0, parts: int = 1, defer_hashes: bool = False) -> Snapshot:
    """Check the marker, that the files on disk are exactly those it lists, that the layout's
    required files are all there, the hashes of files ``part::parts`` (all by default), and
    the metadata's classes; ``.metadata`` and state.json are read once and kept as verified.
    ``defer_hashes``: a DCP snapshot's other files are not hashed here but as they are read
    (``load_shards``, ``read_verified``), and those no rank read by ``verify_unread``: each
    file is read once. A DeepSpeed snapshot's are hashed here all the same: its engine loads
    them between collectives, where one rank's refusal would leave the others waiting."""
    digests, world = _read_marker(path)
    on_disk = set(listing(path)) - {MARKER}
    if on_disk != set(digests):
        extra, missing = sorted(on_disk - set(digests)), sorted(set(digests) - on_disk)
        raise MeshrunError(f"{path}: files differ from its marker (missing {missing}, unexpected {extra})")
    _require(path, digests, world, None)
    if not defer_hashes or _is_deepspeed(digests):
        _hash_share(path, digests, part, parts)
    metadata_bytes = None
    if not _is_deepspeed(digests):
        metadata_bytes = read_verified(path, METADATA, digests)
        _require(path, digests, world, unpickle_metadata(metadata_bytes, os.path.join(path, METADATA)))
    state = _parse_state(read_verified(path, STATE, digests), os.path.join(path, STATE))
    if state["world_size"] != world:
        raise MeshrunError(f"{os.path.join(path, STATE)}: world_size={state['world_size']}, its marker says {world}; "
                           "refusing the snapshot (hint: it was edited: resume from another one)")
    return Snapshot(path, digests, world, state, metadata_bytes)


def verify(path: str, part: int = 0, parts: int = 1) -> dict[str, Any]:
    """``check`` the snapshot; return its state.json."""
    return check(path, part, parts).state


def verify_unread(snapshot: Snapshot, read: Collection[str], part: int = 0, parts: int = 1) -> None:
    """After a load from a snapshot checked with ``defer_hashes``: hash files ``part::parts``
    of those not in ``read`` (the files the ranks read through ``read_verified``, each hashed
    as it was read), so that a damaged file is refused as ``check`` alone would refuse it,
    and no file is read twice."""
    _hash_share(snapshot.path, {n: d for n, d in snapshot.digests.items() if n not in read}, part, parts)


class _VerifiedFiles(FileSystem):
    """DCP's file system, for reading a verified snapshot: each file is read once into memory
    and its SHA-256 compared with the marker's before DCP sees any of it, so what DCP
    deserializes is what was checked (one shard file, a writer thread's part of a rank's
    shards, is held in memory at a time). Records the files it served."""

    def __init__(self, snapshot: Snapshot) -> None:
        super().__init__()
        self.snapshot = snapshot
        self.served: set[str] = set()

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        root = self.snapshot.path
        if mode != "rb":
            raise MeshrunError(f"{path}: meshrun opens snapshot files read-only, not with mode {mode!r}")
        name = os.path.relpath(os.fspath(path), root)
        data = read_verified(root, name, self.snapshot.digests)
        self.served.add(name)
        yield io.BytesIO(data)


class SnapshotReader(FileSystemReader):
    """DCP's FileSystemReader over a snapshot ``check`` verified: the metadata is the allow-listed
    one unpickled from the verified bytes, and each shard file's bytes are read once and
    hash-checked before DCP deserializes them (tensors and values with ``weights_only=True``).
    A shard file DCP fails to read is refused in one line naming it."""

    def __init__(self, snapshot: Snapshot) -> None:
        super().__init__(snapshot.path)
        self.snapshot = snapshot
        self.verified = _VerifiedFiles(snapshot)
        self.fs = self.verified  # DCP opens every shard file through self.fs

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("rank") is not None:  # (a per-rank .metadata is no part of meshrun's layout)
            raise MeshrunError(f"{self.snapshot.path}: has no per-rank metadata to read")
        metadata = self.snapshot.metadata()
        if hasattr(self, "load_id"):  # what FileSystemReader itself records (torch 2.4 and later)
            from torch.distributed.checkpoint.metadata import StorageMeta

            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: Any, planner: Any) -> Any:
        """DCP's own reading, one shard file at a time: a failure names its file. A file that
        DCP read without going through ``self.fs`` (a torch whose reader opens files itself)
        was not hash-checked as read: the load is refused (no code ran: both tensors and
        values are unpickled with ``weights_only=True``)."""
        from torch.futures import Future

        for name, items in self._by_file(plan).items():
            full = os.path.join(self.snapshot.path, name)
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except MeshrunError:
                raise
            except Exception as exc:  # noqa: BLE001  (DCP's and torch.load's failures on a shard's contents)
                raise MeshrunError(f"{full}: refused while reading it ({type(exc).__name__}: {_gist(exc)}); "
                                   "no object in it was run (hint: resume from another snapshot)") from None
            if name not in self.verified.served:
                raise MeshrunError(f"{full}: this torch read it around meshrun's verified reader, so its checksum "
                                   "was not checked as it was read; refusing the load (hint: use torch 2.6 to 2.14)")
        done: Any = Future()
        done.set_result(None)
        return done

    def _by_file(self, plan: Any) -> dict[str, list[Any]]:
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            per_file.setdefault(str(self.storage_data[item.storage_index].relative_path), []).append(item)
        return per_file


def _gist(exc: BaseException) -> str:
    """The telling line of a failure: torch.load's weights-only refusal names the global it
    refused several lines in."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    telling = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (telling or lines or [""])[0]


def dcp_failure(exc: BaseException, path: str) -> MeshrunError:
    """One line for a failed ``dcp.load``: its CheckpointException carries every rank's
    exception with a traceback; the first rank's MeshrunError, else its first failure's gist."""
    failures = getattr(exc, "failures", None)
    inner: list[BaseException] = []
    if isinstance(failures, dict):
        for rank in sorted(failures):
            wrapped = failures[rank]
            inner.append(wrapped[0] if isinstance(wrapped, tuple) else wrapped)
    for one in inner:
        if isinstance(one, MeshrunError):
            return MeshrunError(str(one))
    first = inner[0] if inner else exc
    return MeshrunError(f"{path}: the snapshot could not be loaded ({type(first).__name__}: {_gist(first)}) "
                        "(hint: resume it with the model and strategy that wrote it)")


def load_shards(snapshot: Snapshot, state_dict: dict[str, Any], no_dist: bool = False) -> set[str]:
    """``dcp.load`` through the verified reader, its failures as one line (DCP gathers every
    rank's, so a shard refused on one rank is refused on all); returns the names of the shard
    files it read, each hash-checked as it was read."""
    from torch.distributed.checkpoint.api import CheckpointException

    reader = SnapshotReader(snapshot)
    try:
        dcp.load(state_dict, storage_reader=reader, planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as exc:
        raise dcp_failure(exc, snapshot.path) from None
    return set(reader.verified.served)


def _deepspeed_safe_globals() -> list[Any]:
    """The non-tensor classes a DeepSpeed engine's own snapshot files hold besides what
    ``weights_only=True`` accepts anyway (read off real ZeRO-1, -2, -3 and offloaded files,
    DeepSpeed 0.19, fp32). The weights-only unpickler rebuilds each from plain values: it
    calls the class with the pickled arguments (each constructor only stores them) and sets
    the instance's ``__dict__`` (none of them defines ``__setstate__``)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [
        LossScaler,  # the ZeRO optimizer's "loss_scaler": a static loss scale, plain numbers in its __dict__
        ZeroStageEnum,  # the optimizer file's "zero_stage": an int enum, rebuilt from its value
        fragment_address,  # ZeRO-1/2's "param_slice_mappings": a dataclass of two ints (numel, start)
    ]


class _VerifiedDeepSpeedFiles:
    """Stands in for a DeepSpeed engine's ``checkpoint_engine`` while the engine loads a
    snapshot: DeepSpeed's own engine unpickles its files with ``weights_only=False``; this one
    reads each file once, compares its SHA-256 with the marker's and unpickles those bytes
    with ``weights_only=True`` and the allow-list. Anything else the engine asks of it goes to
    the engine it stands in for. Records the files it served."""

    def __init__(self, snapshot: Snapshot, inner: Any, allowed: list[Any]) -> None:
        self._snapshot, self._inner, self._allowed = snapshot, inner, allowed
        self.served: set[str] = set()

    def load(self, path: str, map_location: Any = None) -> Any:
        root = self._snapshot.path
        name = os.path.relpath(os.path.abspath(path), os.path.abspath(root))  # (outside it: "../...", unlisted)
        data = read_verified(root, name, self._snapshot.digests)
        self.served.add(name)
        try:
            with torch.serialization.safe_globals(self._allowed):
                return torch.load(io.BytesIO(data), map_location=map_location, weights_only=True)
        except Exception as exc:  # noqa: BLE001  (torch.load's failures on the file's contents)
            raise MeshrunError(f"{os.path.join(root, name)}: refused while reading it ({type(exc).__name__}: "
                               f"{_gist(exc)}); no object in it was run (hint: resume from another snapshot)") from None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextmanager
def _weights_only_everywhere() -> Iterator[None]:
    """Every ``torch.load`` in this process unpickles weights-only while the context lasts,
    even one that asks for ``weights_only=False``: a DeepSpeed that reads a file around its
    checkpoint engine is refused instead of running what the file holds."""
    saved = {k: os.environ.get(k) for k in ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    os.environ.pop("TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD", None)  # (both set: torch.load refuses every file)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def load_deepspeed(snapshot: Snapshot, engine: Any) -> None:
    """A DeepSpeed engine's ``load_checkpoint`` of the snapshot's DeepSpeed files, each read
    through ``_VerifiedDeepSpeedFiles``. A DeepSpeed whose engine is not built the way this
    relies on (its files read through a ``TorchCheckpointEngine`` held as
    ``engine.checkpoint_engine``, no universal checkpoint, no NVMe offload, which read files
    themselves) is refused before anything is read."""
    path = os.path.join(snapshot.path, DS_DIR)
    hint = "(hint: use DeepSpeed 0.19 with meshrun's own DeepSpeed configuration)"
    try:
        from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
            TorchCheckpointEngine,
        )

        allowed = _deepspeed_safe_globals()
    except ImportError as exc:
        raise MeshrunError(f"{path}: this DeepSpeed lacks {exc.name or exc}, which meshrun's safe loading of its "
                           f"files relies on; refusing to load them {hint}") from None
    inner = getattr(engine, "checkpoint_engine", None)
    if type(inner) is not TorchCheckpointEngine:
        raise MeshrunError(f"{path}: the DeepSpeed engine reads its files with {type(inner).__name__}, not the "
                           f"TorchCheckpointEngine meshrun loads them safely through; refusing to load them {hint}")
    for reads_itself in ("load_universal_checkpoint", "zero_nvme_offload_optimizer"):
        probe = getattr(engine, reads_itself, None)
        if not callable(probe) or probe():
            raise MeshrunError(f"{path}: the DeepSpeed engine's {reads_itself} is "
                               f"{'missing' if not callable(probe) else 'on'}: its files would be read around "
                               f"meshrun's verified reader; refusing to load them {hint}")
    verified = _VerifiedDeepSpeedFiles(snapshot, inner, allowed)
    engine.checkpoint_engine = verified
    try:
        with _weights_only_everywhere(), torch.serialization.safe_globals(allowed):
            loaded, _ = engine.load_checkpoint(snapshot.path, tag=DS_DIR, load_optimizer_states=True,
                                               load_lr_scheduler_states=False)
    except pickle.UnpicklingError as exc:  # a file DeepSpeed read around the verified reader
        raise MeshrunError(f"{path}: DeepSpeed read a file of it around meshrun's verified reader and it was "
                           f"refused ({_gist(exc)}); no object in it was run (hint: resume from another "
                           "snapshot)") from None
    finally:
        engine.checkpoint_engine = inner
    if loaded is None or not verified.served:
        raise MeshrunError(f"{path}: DeepSpeed loaded none of its files through meshrun's verified reader; "
                           f"refusing the snapshot {hint}")


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
         local_shards: Any = None, ties: dict[str, str] | None = None) -> tuple[Position, int]:
    """Load a snapshot collectively; returns the position and the world size it was saved
    with. The ranks verify a share of the files each; any failure stops every rank.
    ``local_shards`` as for ``begin_save``; ``ties``: {this rank's name of a tied parameter:
    the name the whole model gives it first}."""
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
    saved_world = int(state["world_size"])
    same_world = saved_world == world
    rng: Any = None
    if isinstance(model, CheckpointingEngine):  # a DeepSpeed engine
        if not os.path.isdir(os.path.join(path, DS_DIR)):
            raise MeshrunError(f"{path}: not a DeepSpeed snapshot (hint: resume it with the strategy that wrote it)")
        if saved_world != world:
            raise MeshrunError(f"{path}: a DeepSpeed snapshot of {saved_world} ranks cannot be resumed on {world} "
                               "(ZeRO partitions are per rank; hint: resume on the same world size)")
        load_deepspeed(snapshot, model)
        rng = _rng_state(snapshot, rank) if same_world else None  # (every file was hashed by check)
    else:
        if os.path.isdir(os.path.join(path, DS_DIR)):
            raise MeshrunError(f"{path}: a DeepSpeed snapshot (hint: resume it with --strategy deepspeed)")
        hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
        model_sd, optim_sd = get_state_dict(model, optimizer)
        moved = _borrow_tied_state(snapshot, optim_sd, ties or {})
        sd = shards_as_dtensors(float8_unwrapped({"model": model_sd, "optim": optim_sd}), local_shards)
        read = load_shards(snapshot, sd)  # into the wrapped local tensors, in place
        rng = _rng_and_unread(snapshot, read, same_world)  # before any of it is used
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
    if same_world:
        set_rng_state(rng)
    return _position(state), saved_world


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


def _position(state: dict[str, Any]) -> Position:
    """The snapshot's position; its learning-rate schedule as (from, to) step pairs, or for a
    snapshot that records none, the one piece its run's --steps made."""
    fields = dict(state["position"])
    schedule = fields.pop("schedule", None)
    if schedule is None:
        steps = state.get("config", {}).get("steps") if isinstance(state.get("config"), dict) else None
        schedule = [[0, steps]] if isinstance(steps, int) else []
    if not (isinstance(schedule, list) and all(isinstance(p, list) and len(p) == 2 and all(
            isinstance(v, int) and not isinstance(v, bool) for v in p) for p in schedule)):
        raise TypeError("schedule")
    return Position(**fields, schedule=tuple((a, b) for a, b in schedule))


def _rng_state(snapshot: Snapshot, rank: int) -> Any:
    source = os.path.join(snapshot.path, rng_file(rank))
    try:
        return json.loads(read_verified(snapshot.path, rng_file(rank), snapshot.digests))
    except ValueError:
        raise MeshrunError(f"{source}: not JSON, though its checksum matches the marker; refusing it "
                           "(hint: resume from another snapshot)") from None
