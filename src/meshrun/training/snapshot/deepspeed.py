"""A DeepSpeed engine's load of a snapshot's own files (its ``deepspeed/`` directory), safely:
DeepSpeed's engine unpickles its files with ``weights_only=False``, so for one load it reads
them through a stand-in for its checkpoint engine that reads each file once, compares its
SHA-256 with the marker's (integrity.py) and unpickles those bytes with ``weights_only=True`` and
an allow-list of the few DeepSpeed classes they hold; every other ``torch.load`` in the process
is weights-only while the load lasts. ``check`` hashes all of a DeepSpeed snapshot's files
before its engine loads them.
"""

from __future__ import annotations

import io
import os
import pickle
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from ...errors import MeshrunError
from .integrity import Snapshot, gist, read_verified
from .layout import DS_DIR


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
                               f"{gist(exc)}); no object in it was run (hint: resume from another snapshot)") from None

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


def load_deepspeed(snapshot: Snapshot, engine: Any, adapters_only: bool = False) -> None:
    """A DeepSpeed engine's ``load_checkpoint`` of the snapshot's DeepSpeed files, each read
    through ``_VerifiedDeepSpeedFiles``. A DeepSpeed whose engine is not built the way this
    relies on (its files read through a ``TorchCheckpointEngine`` held as
    ``engine.checkpoint_engine``, no universal checkpoint, no NVMe offload, which read files
    themselves) is refused before anything is read. ``adapters_only``: a LoRA run's snapshot,
    which holds no frozen parameter (its module state is loaded not strictly)."""
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
                                               load_lr_scheduler_states=False, load_module_strict=not adapters_only)
    except pickle.UnpicklingError as exc:  # a file DeepSpeed read around the verified reader
        raise MeshrunError(f"{path}: DeepSpeed read a file of it around meshrun's verified reader and it was "
                           f"refused ({gist(exc)}); no object in it was run (hint: resume from another "
                           "snapshot)") from None
    finally:
        engine.checkpoint_engine = inner
    if loaded is None or not verified.served:
        raise MeshrunError(f"{path}: DeepSpeed loaded none of its files through meshrun's verified reader; "
                           f"refusing the snapshot {hint}")
