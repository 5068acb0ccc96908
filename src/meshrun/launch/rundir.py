"""The files `meshrun train` and its ranks exchange, named in one place for both sides.

The launcher makes a directory of the run's own (``RunDir.root``) and hands it to the ranks
in ``env()``; each rank finds it again with ``RunDir.from_env``. In it:

- ``reports.jsonl``: what a rank has to tell the launcher, one JSON record a line, appended
  whole (one ``os.write`` of one line on an ``O_APPEND`` descriptor, so lines of ranks that
  write at once never interleave): ``{"kind": KIND, "rank": R, "message": TEXT}``, with
  ``"echo": true`` or ``"timed_out": true`` on a crash that only saw another rank go or whose
  collective waited out its timeout. The kinds: ``error`` (a bad input or a non-finite loss:
  the job's one-line error), ``crash`` (a rank raised: its one line, launch/failure.py),
  ``preempt`` (the ranks stopped on a preemption signal after their snapshot), ``interrupt``
  (the step Ctrl-C stopped the ranks at). The launcher reads the records by kind
  (``ReportReader``), first written first.
- ``ready.RANK``: written by each rank once past its rendezvous; until then a stopping signal
  ends the job at once.
- ``result.json``: rank 0's last log record, for ``meshrun.train(...)``.

Each rank's log goes to ``log_dir`` (training/ranklog.py): OUT/logs, or without --out a
directory inside the root.

Torch-free and stdlib-only: the launcher reads it without importing torch, the ranks write
it before torch is imported.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

RUN_DIR_ENV = "MESHRUN_RUN_DIR"  # the run directory's root, set by `meshrun train` for its workers
LOG_DIR_ENV = "MESHRUN_LOG_DIR"  # where each rank writes its log, set by `meshrun train` for its workers

ERROR, CRASH, PREEMPT, INTERRUPT = "error", "crash", "preempt", "interrupt"
KINDS = (ERROR, CRASH, PREEMPT, INTERRUPT)

_READY = "ready."


@dataclass(frozen=True)
class Report:
    """One record of the report file: what rank ``rank`` said, of kind ``kind``."""

    kind: str
    rank: int
    message: str
    echo: bool = False  # a crash that only saw another rank go: another line is the cause
    timed_out: bool = False  # a crash whose collective waited out --collective-timeout

    @property
    def line(self) -> str:
        """The message's first line, stripped: what the launcher prints."""
        lines = self.message.splitlines()
        return lines[0].strip() if lines else ""

    def to_json(self) -> str:
        record: dict[str, Any] = {"kind": self.kind, "rank": self.rank, "message": self.message}
        if self.echo:
            record["echo"] = True
        if self.timed_out:
            record["timed_out"] = True
        return json.dumps(record)

    @classmethod
    def from_json(cls, text: str) -> Report | None:
        """The record of one line; None for a line that is not one (nothing a rank wrote)."""
        try:
            record = json.loads(text)
        except ValueError:
            return None
        if not isinstance(record, dict) or record.get("kind") not in KINDS:
            return None
        rank, message = record.get("rank"), record.get("message")
        if not isinstance(rank, int) or not isinstance(message, str):
            return None
        return cls(record["kind"], rank, message, record.get("echo") is True, record.get("timed_out") is True)


@dataclass(frozen=True)
class RunDir:
    """A run's directory of exchanged files (``root``, the launcher's own, mode 0700) and the
    directory of its ranks' logs (``logs``; default ROOT/logs)."""

    root: str
    logs: str | None = None

    @property
    def log_dir(self) -> str:
        return self.logs or os.path.join(self.root, "logs")

    @property
    def reports(self) -> str:
        return os.path.join(self.root, "reports.jsonl")

    @property
    def result(self) -> str:
        return os.path.join(self.root, "result.json")

    def ready(self, rank: int) -> str:
        return os.path.join(self.root, f"{_READY}{rank}")

    def env(self) -> dict[str, str]:
        """The variables the launcher sets for its ranks."""
        return {RUN_DIR_ENV: self.root, LOG_DIR_ENV: self.log_dir}

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> RunDir | None:
        """The run directory a rank was given; None for a rank `meshrun train` did not start."""
        root = env.get(RUN_DIR_ENV)
        return cls(root, env.get(LOG_DIR_ENV) or None) if root else None

    def report(self, report: Report) -> None:
        """Append one record, whole: one write of one line on a descriptor opened to append."""
        data = (report.to_json() + "\n").encode()
        fd = os.open(self.reports, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)

    def ready_ranks(self) -> set[int]:
        """The ranks of this node that wrote ``ready.RANK``."""
        try:
            names = os.listdir(self.root)
        except OSError:
            return set()
        return {int(name[len(_READY):]) for name in names
                if name.startswith(_READY) and name[len(_READY):].isdigit()}

    def clear_ready(self) -> None:
        """Remove every ``ready.RANK``: the next attempt has a rendezvous of its own."""
        for rank in self.ready_ranks():
            try:
                os.unlink(self.ready(rank))
            except FileNotFoundError:
                pass


class ReportReader:
    """The launcher's view of the report file: the records appended so far, read as they
    come (only whole lines: a line being written is read once it ends)."""

    def __init__(self, run_dir: RunDir) -> None:
        self.path = run_dir.reports
        self._offset = 0
        self._records: list[Report] = []

    def records(self, kind: str) -> list[Report]:
        """The records of ``kind``, in the order they were written."""
        self._read()
        return [r for r in self._records if r.kind == kind]

    def first(self, kind: str) -> Report | None:
        found = self.records(kind)
        return found[0] if found else None

    def any(self) -> bool:
        """Whether a rank has said anything but an echo of another rank's failure."""
        self._read()
        return any(not r.echo for r in self._records)

    def clear(self) -> None:
        """Forget every record and remove the file: the next attempt's reports are its own."""
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self._offset, self._records = 0, []

    def _read(self) -> None:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return
        end = data.rfind(b"\n") + 1
        if not end:
            return
        self._offset += end
        for raw in data[:end].splitlines():
            report = Report.from_json(raw.decode(errors="replace"))
            if report is not None:
                self._records.append(report)
