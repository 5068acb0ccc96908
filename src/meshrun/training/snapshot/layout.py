"""Where snapshots live and what makes one committed.

Layout under ``OUT/checkpoints``::

    .tmp-step-00000100/      being written; ignored (and cleared) by readers
    step-00000100/           committed: renamed from .tmp-* after COMMITTED.json was written
        .metadata, __*_*.distcp   torch.distributed.checkpoint (model + optimizer, each rank its shards)
        state.json                step, data position, config, format version
        rng-rank<R>.json          each rank's Python, NumPy, torch and CUDA RNG states
        COMMITTED.json            written last by rank 0: format, step, world size, SHA-256 of every file
    .trash-step-00000050/    pruned, being deleted

Commit protocol (save.py): every rank writes into the temporary directory; a barrier; rank 0
hashes and fsyncs every file, writes the marker (fsync), renames the directory (atomic) and
fsyncs the parent. A crash at any point leaves either the previous snapshot as the newest
committed one, or the new one complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ...config.outdir import check_name
from ...config.variables import save_threads
from ...errors import MeshrunError

FORMAT = 1
MARKER = "COMMITTED.json"
PREFIX = "step-"
TMP_PREFIX = ".tmp-step-"
TRASH_PREFIX = ".trash-step-"  # pruned snapshots on their way out
DS_DIR = "deepspeed"  # a DeepSpeed engine's own checkpoint files, inside the snapshot


@dataclass(frozen=True)
class Position:
    """Where training is: optimizer steps done, and the data read in the current epoch
    (global samples, all ranks together, so it maps onto any world size)."""

    step: int = 0
    epoch: int = 0
    samples: int = 0
    # The learning-rate schedule the run follows: (from step, to step) pieces, the first from
    # step 0 (optim.lr_factor). Empty in a snapshot written before pieces were recorded: its
    # run's --steps then gives the one piece.
    schedule: tuple[tuple[int, int], ...] = ()


def snapshot_name(step: int) -> str:
    return f"{PREFIX}{step:08d}"


def entries(root: str) -> list[str]:
    """The names in the snapshot directory ``root`` (none when it is not one yet): one listing
    that ``committed``, ``latest`` and ``clear_partial`` can share."""
    return os.listdir(root) if os.path.isdir(root) else []


def committed(root: str, names: Sequence[str] | None = None) -> list[tuple[int, str]]:
    """(step, path) of committed snapshots, oldest first, from ``names`` (``entries(root)``,
    listed now when not given). A ``step-*`` directory without its marker is not a partial
    save (those stay under ``.tmp-*``): it was damaged."""
    out = []
    for name in entries(root) if names is None else names:
        if not name.startswith(PREFIX):
            continue
        path = os.path.join(root, name)
        if not os.path.isfile(os.path.join(path, MARKER)):
            raise MeshrunError(f"snapshot {path} has no {MARKER}: it was damaged or edited "
                               "(hint: move it away, or pass --resume with another snapshot)")
        try:
            step = int(name[len(PREFIX):])
        except ValueError:
            continue
        check_name(path)  # (a renamed directory would otherwise be resumed, and pruned, as another step)
        out.append((step, path))
    return sorted(out)


def latest(root: str, names: Sequence[str] | None = None) -> str | None:
    snaps = committed(root, names)
    return snaps[-1][1] if snaps else None


def fsync_file(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def write_json(path: str, data: Any) -> None:
    with open(path, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())


def listing(path: str) -> list[str]:
    """Files of a snapshot directory, those of its DeepSpeed subdirectory as ``deepspeed/NAME``."""
    names = [n for n in os.listdir(path) if n != DS_DIR]
    sub = os.path.join(path, DS_DIR)
    if os.path.isdir(sub):
        names += [f"{DS_DIR}/{n}" for n in os.listdir(sub)]
    return names


def io_threads() -> int:
    """Writer and hasher threads per rank: DCP writes one file per thread, and hashlib and
    file I/O release the GIL, so a rank uses several cores. MESHRUN_SAVE_THREADS overrides (the
    job checked it before the ranks started)."""
    given = save_threads(os.environ)
    if given is not None:
        return given
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    return max(1, min(8, (os.cpu_count() or 1) // local))


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


def clear_partial(root: str, names: Sequence[str] | None = None) -> None:
    """Remove ``.tmp-*`` directories left by a save that was killed, and ``.trash-*`` ones
    left by a deletion that was, found among ``names`` (``entries(root)``, listed now when
    not given)."""
    for name in entries(root) if names is None else names:
        if name.startswith((TMP_PREFIX, TRASH_PREFIX)):
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
