"""Which of this node's ranks are alive, stopped or finished, read from /proc, so that a job
whose ranks wait on each other ends in one line that names the rank at fault.

The workers are the launched processes themselves, or a launcher's (torchrun's) children;
each one's rank is the RANK in its environment. ``RankWatch.tick()`` runs in the launcher's
supervision loop and says when the job must end:

- a rank stopped (``kill -STOP``, a debugger, state T in /proc) for longer than the
  collective timeout: its peers wait on it in a collective, and it will not answer;
- a rank still running ``finish_timeout_s`` after another rank of this node finished: it
  waits on a peer that is gone (a collective only some ranks reach), or never ends.

``stopped()`` names stopped ranks at any moment: when another rank's collective timed out
and it wrote its line, the stopped one is the cause, not the rank that waited.
Without /proc (not Linux) nothing is watched.
"""

from __future__ import annotations

import os
import subprocess
import time

SCAN_S = 2.0  # between scans of the workers: a few reads of /proc, bounds what a tick costs


def process_state(pid: int) -> str | None:
    """The state letter of /proc/PID/stat (R, S, D, T, t, Z, ...), None when gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return None


def is_stopped(pid: int) -> bool:
    """Stopped by a signal (T) or by a tracer (t)."""
    return process_state(pid) in ("T", "t")


def ranks_of(pid: int) -> tuple[int | None, list[int]]:
    """(RANK, the ranks of its node) from a process's environment: the node's ranks are
    RANK - LOCAL_RANK + 0..LOCAL_WORLD_SIZE-1, as torchrun numbers them; (None, []) when it
    has no RANK or cannot be read."""
    found: dict[bytes, int] = {}
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for entry in f.read().split(b"\0"):
                name, _, value = entry.partition(b"=")
                if name in (b"RANK", b"LOCAL_RANK", b"LOCAL_WORLD_SIZE"):
                    found[name] = int(value)
    except (OSError, ValueError):
        return None, []
    rank = found.get(b"RANK")
    if rank is None or b"LOCAL_RANK" not in found or b"LOCAL_WORLD_SIZE" not in found:
        return rank, []
    first = rank - found[b"LOCAL_RANK"]
    return rank, list(range(first, first + found[b"LOCAL_WORLD_SIZE"]))


def children(pid: int) -> list[int]:
    """The live processes whose parent is ``pid``, read from /proc."""
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:  # gone meanwhile
            continue
        fields = stat.rpartition(")")[2].split()  # after "pid (command name)": state, ppid, ...
        if len(fields) > 1 and fields[1] == str(pid):
            out.append(int(name))
    return out


def child_pids(pid: int) -> list[int]:
    """The children of ``pid``: from /proc/PID/task/*/children where the kernel has it (a
    read per thread), else from a scan of every process's parent."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
        found: list[int] = []
        for task in tasks:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found += [int(c) for c in f.read().split()]
        return found
    except (OSError, ValueError):
        return children(pid)


def ranks_text(ranks: list[int]) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(r) for r in ranks)


def _seconds(s: float) -> str:
    return f"{s:.0f} s"


class RankWatch:
    """The workers of this node's launched processes, by rank (see the module's docstring).
    ``stall_s``: how long a rank may stay stopped (the collective timeout); ``finish_s``: how
    long ranks may run after another one finished; None: not watched."""

    def __init__(self, procs: list[subprocess.Popen[bytes]], launchers: list[bool], stall_s: float | None,
                 finish_s: float | None) -> None:
        self.procs, self.launchers = procs, launchers
        self.stall_s, self.finish_s = stall_s, finish_s
        self.live: dict[int, int | None] = {}  # pid -> rank
        self.node_ranks: set[int] = set()  # the ranks this node's launchers start, as their workers say
        self.finished: dict[int, float] = {}  # rank (or -pid) -> when it was seen gone
        self.stopped_since: dict[int, float] = {}  # pid -> when it was first seen stopped
        self.last_scan = 0.0
        self.enabled = os.path.isdir("/proc")

    def _scan(self, now: float) -> None:
        seen: dict[int, int | None] = {}
        for p, launcher in zip(self.procs, self.launchers):
            if p.poll() is not None:
                if not launcher and p.returncode == 0 and p.pid in self.live:
                    self.finished.setdefault(self._key(p.pid, self.live[p.pid]), now)
                continue
            for pid in child_pids(p.pid) if launcher else [p.pid]:
                if pid in self.live:
                    seen[pid] = self.live[pid]
                    continue
                rank, node = ranks_of(pid)
                self.node_ranks.update(node if launcher else ())
                if rank is not None or not launcher:  # (a launcher's helper process is no worker)
                    seen[pid] = rank
        self.live = seen
        for rank in seen.values():  # missing before because not started yet, or started again
            if rank is not None:
                self.finished.pop(rank, None)
        if any(p.poll() is None for p, launcher in zip(self.procs, self.launchers) if launcher):
            # a worker gone while its launcher runs on has finished (a failed one ends the launcher)
            for rank in self.node_ranks - {r for r in seen.values() if r is not None}:
                self.finished.setdefault(rank, now)
        for pid in list(self.stopped_since):
            if pid not in seen or not is_stopped(pid):
                del self.stopped_since[pid]
        for pid in seen:
            if pid not in self.stopped_since and is_stopped(pid):
                self.stopped_since[pid] = now
        self.last_scan = now

    @staticmethod
    def _key(pid: int, rank: int | None) -> int:
        return rank if rank is not None else -pid

    def _name(self, pid: int) -> str:
        rank = self.live.get(pid)
        return f"rank {rank}" if rank is not None else f"process {pid}"

    def stopped(self) -> list[tuple[str, int]]:
        """(name, pid) of every worker stopped now (scanned afresh)."""
        if not self.enabled:
            return []
        self._scan(time.monotonic())
        return [(self._name(pid), pid) for pid in sorted(self.stopped_since)]

    def stopped_line(self, ended: str = "the job was ended") -> str | None:
        """The line for a job whose peers waited on a stopped rank (``ended``: how the job
        ended), or None when no rank is stopped."""
        found = self.stopped()
        if not found:
            return None
        name, pid = found[0]
        seen_s = time.monotonic() - self.stopped_since[pid]
        seen = f" for {_seconds(seen_s)}" if seen_s >= 1 else ""
        return (f"{name} stopped answering: its process (pid {pid}) is stopped{seen} (SIGSTOP or a debugger: "
                f"state T) and its peers wait on it in a collective; {ended} (hint: --collective-timeout sets "
                "how long the peers wait; a run with --out resumes from its newest snapshot)")

    def tick(self) -> str | None:
        """A line when the job must end now (a rank stopped too long, ranks left running after
        the others finished), else None."""
        now = time.monotonic()
        if not self.enabled or now - self.last_scan < SCAN_S:
            return None
        self._scan(now)
        if self.stall_s is not None:
            if any(now - since >= self.stall_s for since in self.stopped_since.values()):
                return self.stopped_line()
        if self.finish_s is not None and self.finished and self.live:
            first = min(self.finished.values())
            if now - first >= self.finish_s:
                return self._finish_line(now - first)
        return None

    def _finish_line(self, waited_s: float) -> str:
        running = [rank if rank is not None else -pid for pid, rank in self.live.items()]
        done = list(self.finished)
        who = ranks_text(running) if all(r >= 0 for r in running) else f"{len(running)} process(es)"
        after = ranks_text(done) if all(r >= 0 for r in done) else "other processes"
        return (f"{who} still running {_seconds(waited_s)} after {after} finished; stopped (hint: a rank that waits "
                "on a peer that has finished, such as a collective only some ranks call, or a script that does not "
                "end; --finish-timeout sets this bound)")
