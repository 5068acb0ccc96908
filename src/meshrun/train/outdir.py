"""What one run owns in its output directory, settled before the workers start.

A run is named by a run id (``uuid4().hex``) kept in ``OUT/run.json`` and written into every
snapshot's ``state.json`` (``run_id``), so that snapshots of two runs never mix in one OUT:

- a fresh start (``--no-resume``, or no snapshot to resume) takes a new run id; on an OUT
  holding snapshots it is refused unless ``--overwrite`` first moves the earlier run's files
  into ``OUT/previous-<UTC time>/`` (nothing is deleted);
- a resume reads the snapshot's run id: one that differs from ``run.json`` is refused (a
  snapshot without one, written before run ids existed, is accepted).

The launching `meshrun train` of node rank 0 does this under the directory's lock
(runlock.py); the workers get the run id in MESHRUN_OUT_RUN_ID. Torch-free: it reads only names
and JSON. The snapshot names are checkpoint/layout.py's (that package imports torch).
"""

from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass

from ..errors import MeshrunError, bad_value

RUN_FILE = "run.json"
RUN_ID_ENV = "MESHRUN_OUT_RUN_ID"  # (MESHRUN_RUN_ID is --run-id, the rendezvous id)
PREVIOUS_PREFIX = "previous-"
CHECKPOINTS = "checkpoints"
SNAPSHOT_PREFIX = "step-"  # layout.PREFIX
MARKER = "COMMITTED.json"  # layout.MARKER
# What a run writes into OUT (metrics.py, trainer.py, this module): what --overwrite moves aside.
RUN_FILES = (CHECKPOINTS, "metrics.jsonl", "loss.png", "tensorboard", RUN_FILE)


@dataclass(frozen=True)
class Prepared:
    """The outcome: the run id the workers write into snapshots, the resume mode they use
    (``none`` after --overwrite), and a line for the user when files were moved."""

    run_id: str
    resume: str
    note: str | None = None


def snapshots(root: str) -> list[tuple[int, str]]:
    """(step, path) of the ``step-N`` directories under ``root``, oldest first."""
    out = []
    if os.path.isdir(root):
        for name in os.listdir(root):
            if name.startswith(SNAPSHOT_PREFIX) and name[len(SNAPSHOT_PREFIX):].isdigit():
                out.append((int(name[len(SNAPSHOT_PREFIX):]), os.path.join(root, name)))
    return sorted(out)


def read_run_id(out: str) -> str | None:
    """OUT's run id, or None when it has no readable run.json."""
    return _json_field(os.path.join(out, RUN_FILE), "run_id")


def snapshot_run_id(path: str) -> str | None:
    """The run id in a snapshot's state.json (None: written before run ids, or unreadable;
    loading verifies the file later)."""
    return _json_field(os.path.join(path, "state.json"), "run_id")


def _json_field(path: str, key: str) -> str | None:
    try:
        with open(path) as f:
            value = json.load(f).get(key)
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) and value else None


def write_run_id(out: str, run_id: str) -> None:
    """OUT/run.json, whole or not at all."""
    tmp = os.path.join(out, f".{RUN_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump({"run_id": run_id, "created": _utc_now()}, f)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, os.path.join(out, RUN_FILE))


def _utc_now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def move_aside(out: str) -> tuple[str, list[str]] | None:
    """Move what an earlier run wrote in OUT (RUN_FILES) into ``OUT/previous-<UTC time>/``;
    returns that folder and the names moved, or None when there was nothing."""
    present = [name for name in RUN_FILES if os.path.lexists(os.path.join(out, name))]
    if not present:
        return None
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = os.path.join(out, PREVIOUS_PREFIX + stamp)
    n = 1
    while os.path.lexists(target):  # two overwrites within one second
        n += 1
        target = os.path.join(out, f"{PREVIOUS_PREFIX}{stamp}-{n}")
    os.makedirs(target)
    for name in present:  # renames within one directory: nothing is copied, nothing deleted
        os.rename(os.path.join(out, name), os.path.join(target, name))
    return target, present


def _resume_target(resume: str) -> str | None:
    """The snapshot --resume PATH names (a snapshot, or the newest of a directory of them)."""
    if os.path.isfile(os.path.join(resume, MARKER)):
        return resume
    found = snapshots(resume)
    return found[-1][1] if found else None


def prepare(out: str, resume: str, overwrite: bool, resume_source: str = "--resume") -> Prepared:
    """Settle OUT for a run that resumes as ``resume`` says (auto, none or a snapshot path):
    refuse a fresh start over another run's snapshots, move them aside under ``overwrite``,
    refuse to resume a snapshot of another run; write run.json. Call it holding OUT's lock."""
    os.makedirs(out, exist_ok=True)
    root = os.path.join(out, CHECKPOINTS)
    note = None
    if overwrite:
        if resume not in ("auto", "none"):
            raise bad_value("--overwrite", True, f"starts a new run in {out}, but {resume_source} asks to resume "
                            f"{resume!r}", "drop one of them")
        resume = "none"
        moved = move_aside(out)
        if moved:
            target, names = moved
            note = (f"meshrun train: --overwrite moved the earlier run's {', '.join(names)} to {target}; a new run "
                    f"starts in {out}")
    found = snapshots(root)
    if resume == "none" and found:
        source = "--no-resume" if resume_source == "--resume" else f"{resume_source}=none"
        raise MeshrunError(f"{source}: {root} holds {len(found)} snapshot(s) of an earlier run (newest: step "
                           f"{found[-1][0]}); a new run there would mix with them (hint: --overwrite moves them "
                           f"into {os.path.join(out, PREVIOUS_PREFIX)}<UTC time>/ first, or give another --out)")
    current = read_run_id(out)
    if resume == "none" or (resume == "auto" and not found):
        run_id = uuid.uuid4().hex
        write_run_id(out, run_id)
        return Prepared(run_id, resume, note)
    path = found[-1][1] if resume == "auto" else _resume_target(resume)
    theirs = snapshot_run_id(path) if path else None
    if current is None or (theirs is not None and theirs != current and resume != "auto" and not found):
        # OUT names no run yet (or none of its own snapshots): it continues the snapshot's run
        run_id = theirs or current or uuid.uuid4().hex
        if run_id != current:
            write_run_id(out, run_id)
        return Prepared(run_id, resume, note)
    if theirs is not None and theirs != current:
        raise MeshrunError(f"snapshot {path}: belongs to run {theirs}, but {os.path.join(out, RUN_FILE)} names run "
                           f"{current}: resuming it would mix two runs in {out} (hint: move that snapshot away, "
                           "--overwrite to start a new run, or give another --out)")
    return Prepared(current, resume, note)
