"""A snapshot's integrity: its marker, every file's SHA-256, the files its layout requires,
state.json's shape, and DCP's metadata unpickled with an allow-list: no code in a snapshot runs.

Every file that is parsed or unpickled (``.metadata``, ``state.json``, the RNG files, each
``.distcp`` shard, each of a DeepSpeed engine's own files) is read once into memory, its
SHA-256 compared with the marker's, and parsed from those same bytes (``read_verified``): a
file swapped on disk after its check is never what is read. The readers of the shards
(reader.py) and of DeepSpeed's files (deepspeed.py) go through it.

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
from collections.abc import Collection, Mapping
from typing import Any

import torch

from ...errors import MeshrunError
from .layout import DS_DIR, FORMAT, MARKER, Position, io_threads, listing, sha256

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
        position(state)  # (its fields, no others)
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


def gist(exc: BaseException) -> str:
    """The telling line of a failure: torch.load's weights-only refusal names the global it
    refused several lines in."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    telling = [line for line in lines if "GLOBAL" in line or "Unsupported" in line]
    return (telling or lines or [""])[0]


def position(state: dict[str, Any]) -> Position:
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
