"""What one run owns in its output directory, settled before the workers start.

A run is named by a run id (``uuid4().hex``) kept in ``OUT/run.json`` and written into every
snapshot's ``state.json`` (``run_id``), so that snapshots of two runs never mix in one OUT:

- a fresh start (``--no-resume``, or no snapshot to resume) takes a new run id; on an OUT
  holding snapshots it is refused unless ``--overwrite`` first moves the earlier run's files
  into ``OUT/previous-<UTC time>/`` (nothing is deleted);
- a resume reads the snapshot's run id: one that differs from ``run.json`` is refused (a
  snapshot without one, written before run ids existed, is accepted);
- a snapshot's step is the one its marker records: a ``step-N`` directory whose name says
  another step (renamed by hand) is refused, never trusted by its name;
- a resume of an older snapshot of OUT's own (a rollback) moves the newer snapshots, and the
  metrics records of the steps after it, into ``OUT/previous-<UTC time>/``: the abandoned
  branch is kept, and neither a later resume nor the loss curve mixes it with the new one;
- a run already at or past ``--steps`` has nothing to do, and OUT is left as it was.

Every name OUT holds must be of the kind a run writes there (a directory or a regular file,
a symlink to one counting as one): a FIFO, a socket or a file where a directory belongs is
refused before anything starts, not met at the first write.

The launching `meshrun train` of node rank 0 does this under the directory's lock
(runlock.py); the workers get the run id in MESHRUN_OUT_RUN_ID. Torch-free: it reads only names
and JSON. The snapshot names are training/snapshot/layout.py's (that package imports torch).
"""

from __future__ import annotations

import json
import os
import stat
import time
import uuid
from dataclasses import dataclass

from ..errors import MeshrunError, bad_value
from ..fsio import file_kind
from ..units import span

RUN_FILE = "run.json"
RUN_ID_ENV = "MESHRUN_OUT_RUN_ID"  # (MESHRUN_RUN_ID is --run-id, the rendezvous id)
PREVIOUS_PREFIX = "previous-"
CHECKPOINTS = "checkpoints"
SNAPSHOT_PREFIX = "step-"  # layout.PREFIX
MARKER = "COMMITTED.json"  # layout.MARKER
# What a run writes into OUT (metrics.py, trainer.py, this module): what --overwrite moves aside.
# (trackers.json: trackers.IDS_FILE, the tracker runs a resume continues; wandb: W&B's files)
RUN_FILES = (CHECKPOINTS, "metrics.jsonl", "loss.png", "tensorboard", "trackers.json", "wandb", RUN_FILE)
METRICS = "metrics.jsonl"
LOCK_NAME = ".meshrun.lock"  # runlock.LOCK_NAME
# The kind each name in OUT must be, when it exists: True a directory, False a regular file.
KINDS = {CHECKPOINTS: True, "tensorboard": True, "logs": True, "wandb": True, METRICS: False, "loss.png": False,
         "trackers.json": False, RUN_FILE: False, LOCK_NAME: False}


@dataclass(frozen=True)
class Prepared:
    """The outcome: the run id the workers write into snapshots, the resume mode they use
    (``none`` after --overwrite), and a line for the user when files were moved."""

    run_id: str
    resume: str
    note: str | None = None
    done: int | None = None  # the step OUT is already at, when it is at or past --steps: nothing to do


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


def marker_step(path: str) -> int | None:
    """The step a committed snapshot's marker records (None: no readable marker; loading
    refuses it later with its own line)."""
    try:
        with open(os.path.join(path, MARKER)) as f:
            step = json.load(f).get("step")
    except (OSError, ValueError, AttributeError, RecursionError):
        return None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def check_name(path: str) -> int | None:
    """A snapshot's step from its marker, refusing one whose name says another step."""
    step = marker_step(path)
    name = os.path.basename(os.path.normpath(path))
    named = name[len(SNAPSHOT_PREFIX):] if name.startswith(SNAPSHOT_PREFIX) else ""
    if step is not None and named.isdigit() and int(named) != step:
        raise MeshrunError(f"snapshot {path}: its name says step {int(named)}, but its {MARKER} says step {step}: "
                           f"it was renamed (hint: rename it back to {SNAPSHOT_PREFIX}{step:08d}, or move it out "
                           "of the directory)")
    return step


def check_kinds(out: str) -> None:
    """Refuse, before anything starts, a name in OUT that is not the kind a run writes there:
    a FIFO at metrics.jsonl would hang the run at its first log line, a file at checkpoints
    would fail its first snapshot."""
    for name, is_dir in KINDS.items():
        path = os.path.join(out, name)
        if not os.path.lexists(path):
            continue
        if name != CHECKPOINTS:  # (snapshots may live on another disk: the lock holds their real path)
            _inside(out, path)
        try:
            mode = os.stat(path).st_mode
        except OSError as exc:  # a dangling symlink, a loop: nothing could be written through it
            raise bad_value("--out", out, f"{path} cannot be used ({exc.strerror})",
                            "remove it, or give another --out") from None
        if is_dir and not stat.S_ISDIR(mode):
            raise bad_value("--out", out, f"{path} is {file_kind(mode)}, where the run keeps a directory",
                            "move it away, or give another --out")
        if not is_dir and not stat.S_ISREG(mode):
            raise bad_value("--out", out, f"{path} is {file_kind(mode)}, where the run writes a regular file",
                            "move it away, or give another --out")
    logs = os.path.join(out, "logs")
    for name in sorted(os.listdir(logs)) if os.path.isdir(logs) else ():  # each rank's log is appended to
        path = os.path.join(logs, name)
        if name.endswith(".log"):
            _inside(out, path)
        if name.endswith(".log") and os.path.exists(path) and not os.path.isfile(path):
            raise bad_value("--out", out, f"{path} is {file_kind(os.stat(path).st_mode)}, where a rank writes its log",
                            "move it away, or give another --out")


def _inside(out: str, path: str) -> None:
    """``path``, a name a run writes in OUT, is not a link out of OUT: the run would append its
    logs or metrics to (or replace) a file elsewhere. A link inside OUT is harmless."""
    if not os.path.islink(path):
        return
    real, root = os.path.realpath(path), os.path.realpath(out)
    if os.path.commonpath([real, root]) != root:
        raise bad_value("--out", out, f"{path} is a link to {real}, outside OUT, where the run writes",
                        "remove the link: meshrun writes nothing through a link out of OUT "
                        "(OUT/checkpoints alone may be one)")


def _json_field(path: str, key: str) -> str | None:
    try:
        with open(path) as f:
            value = json.load(f).get(key)
    except (OSError, ValueError, AttributeError, RecursionError):
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
    returns that folder and the names moved, or None when there was nothing. A mount point
    cannot be renamed: it is refused before anything moves."""
    present = [name for name in RUN_FILES if os.path.lexists(os.path.join(out, name))]
    if not present:
        return None
    for name in present:
        path = os.path.join(out, name)
        if not os.path.islink(path) and os.path.ismount(path):
            raise bad_value("--overwrite", True, f"{path} is a mount point, which cannot be moved aside",
                            "move its contents yourself, or give another --out")
    target = _previous_dir(out)
    for name in present:  # renames within one directory: nothing is copied, nothing deleted
        _rename(os.path.join(out, name), os.path.join(target, name), "--overwrite")
    return target, present


def _previous_dir(out: str) -> str:
    """A new ``OUT/previous-<UTC time>[-n]/``."""
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    target = os.path.join(out, PREVIOUS_PREFIX + stamp)
    n = 1
    while os.path.lexists(target):  # two within one second
        n += 1
        target = os.path.join(out, f"{PREVIOUS_PREFIX}{stamp}-{n}")
    os.makedirs(target)
    return target


def _rename(src: str, dst: str, source: str) -> None:
    try:
        os.rename(src, dst)
    except OSError as exc:
        raise bad_value(source, True, f"could not move {src} to {dst} ({exc.strerror})",
                        "move it yourself, or give another --out") from None


def roll_back(out: str, snapshot: str, step: int) -> str | None:
    """Resuming ``snapshot`` (step ``step``) of OUT's own checkpoints while newer ones exist:
    move those, and the metrics records of the steps after ``step``, into a new
    ``OUT/previous-<UTC time>/``; returns the line that says so, or None when nothing was newer."""
    root = os.path.join(out, CHECKPOINTS)
    if os.path.realpath(os.path.dirname(os.path.normpath(snapshot))) != os.path.realpath(root):
        return None  # another directory's snapshot: OUT's own history is not rolled back
    newer = [(s, path) for s, path in snapshots(root) if s > step]
    if not newer:
        return None
    target = _previous_dir(out)
    os.makedirs(os.path.join(target, CHECKPOINTS))
    for _, path in newer:
        _rename(path, os.path.join(target, CHECKPOINTS, os.path.basename(path)), "--resume")
    moved = _split_metrics(os.path.join(out, METRICS), os.path.join(target, METRICS), step)
    steps = ("step " if len(newer) == 1 else "steps ") + span([s for s, _ in newer], "d")
    return (f"meshrun train: resuming step {step} rolls {out} back: the newer snapshot(s) ({steps}) and {moved} "
            f"metrics record(s) after step {step} moved to {target}")


def _split_metrics(path: str, aside: str, step: int) -> int:
    """Keep the records of steps up to ``step`` in ``path``; those after it go to ``aside``."""
    if not os.path.isfile(path):
        return 0
    keep: list[bytes] = []
    later: list[bytes] = []
    with open(path, "rb") as f:
        for line in f:
            try:
                record_step = json.loads(line).get("step")
            except (ValueError, AttributeError, RecursionError):
                record_step = None
            (later if isinstance(record_step, int) and record_step > step else keep).append(line)
    if later:
        with open(aside, "wb") as f:
            f.writelines(later)
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.writelines(keep)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    return len(later)


def _resume_target(resume: str) -> str | None:
    """The snapshot --resume PATH names (a snapshot, or the newest of a directory of them)."""
    if os.path.isfile(os.path.join(resume, MARKER)):
        return resume
    found = snapshots(resume)
    return found[-1][1] if found else None


def prepare(out: str, resume: str, overwrite: bool, resume_source: str = "--resume",
            steps: int | None = None) -> Prepared:
    """Settle OUT for a run that resumes as ``resume`` says (auto, none or a snapshot path)
    and trains to ``steps``: refuse a fresh start over another run's snapshots, move them
    aside under ``overwrite``, refuse to resume a snapshot of another run or one renamed, roll
    back to an older snapshot of OUT's own; write run.json. Call it holding OUT's lock."""
    os.makedirs(out, exist_ok=True)
    check_kinds(out)
    root = os.path.join(out, CHECKPOINTS)
    notes = []
    if overwrite:
        if resume not in ("auto", "none"):
            raise bad_value("--overwrite", True, f"starts a new run in {out}, but {resume_source} asks to resume "
                            f"{resume!r}", "drop one of them")
        resume = "none"
        moved = move_aside(out)
        if moved:
            target, names = moved
            notes.append(f"meshrun train: --overwrite moved the earlier run's {', '.join(names)} to {target}; a new "
                         f"run starts in {out}")
    found = snapshots(root)
    for _, name in found:
        check_name(name)
    note = "\n".join(notes) or None
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
    step = check_name(path) if path else None
    if steps is not None and step is not None and step >= steps:
        return Prepared(current or "", resume, note, done=step)  # nothing to do: OUT stays as it was
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
    if resume != "auto" and path and step is not None:
        rolled = roll_back(out, path, step)
        if rolled:
            note = "\n".join([*notes, rolled])
    return Prepared(current, resume, note)
