"""DCP's reader over a snapshot ``check`` verified (integrity.py): the metadata is the allow-listed
one unpickled from the verified bytes, each ``.distcp`` shard file is read once and hash-checked
before DCP deserializes it, and tensors and non-tensor values are unpickled with
``weights_only=True`` (DCP's default planner unpickles values with ``weights_only=False``).
``load_shards`` is ``dcp.load`` through it, a failure on any rank one line on every rank.
"""

from __future__ import annotations

import dataclasses
import io
import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemReader

from ...errors import MeshrunError
from .integrity import Snapshot, gist, read_verified


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner unpickles non-tensor values with weights_only=False."""

    def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
        loaded = torch.load(value, weights_only=True)
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._nested_dict import set_element  # noqa: PLC0415

            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


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
                raise MeshrunError(f"{full}: refused while reading it ({type(exc).__name__}: {gist(exc)}); "
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
    return MeshrunError(f"{path}: the snapshot could not be loaded ({type(first).__name__}: {gist(first)}) "
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
