"""Turn torchrun's rendezvous timeout (a 40-line traceback ending in "Timed out after N
seconds waiting for clients. 1/2 clients joined.") into one line that says what happened.

A filter on the relayed stderr: tracebacks are held back briefly; one that ends in a
rendezvous timeout is dropped and remembered, any other is passed on unchanged (within
``hold_s``, or at once when more output follows)."""

from __future__ import annotations

import re
import time
from typing import Protocol

_STATIC = re.compile(rb"Timed out after (\d+) seconds waiting for clients\. (\d+)/(\d+) clients joined")
_C10D = re.compile(rb"RendezvousTimeoutError")


class StderrFilter(Protocol):
    """A filter on a child's relayed stderr (``run.execute``'s ``watch``): this RendezvousWatch,
    failure.TorchrunReport, node.HeldUntilReached. Each call returns the lines to write now.
    A filter may also have ``stopping()``, called when a signal stops the job."""

    def feed(self, line: bytes) -> list[bytes]: ...

    def stale(self) -> list[bytes]: ...

    def close(self) -> list[bytes]: ...


class RendezvousWatch:
    def __init__(self, hold_s: float = 2.0) -> None:
        self.hold_s = hold_s
        self.held: list[bytes] = []
        self.since = 0.0
        self.joined: tuple[int, int] | None = None
        self.timed_out = False

    def feed(self, line: bytes) -> list[bytes]:
        """Lines to write now."""
        if self.held:
            self.held.append(line)
            m = _STATIC.search(line)
            if m or _C10D.search(line):
                self.timed_out = True
                if m:
                    self.joined = (int(m.group(2)), int(m.group(3)))
                self.held = []
                return []
            return []
        if line.startswith(b"Traceback (most recent call last)") or b"] Traceback (most recent call last)" in line:
            self.held, self.since = [line], time.monotonic()
            return []
        return [line]

    def stale(self) -> list[bytes]:
        """Held lines older than hold_s: not a rendezvous failure after all, let them out."""
        if self.held and time.monotonic() - self.since > self.hold_s:
            out, self.held = self.held, []
            return out
        return []

    def close(self) -> list[bytes]:
        out, self.held = self.held, []
        return out

    def message(self, host: str, port: int, nnodes: int, timeout_s: int | None) -> str:
        joined = (f"{self.joined[0]} of {self.joined[1]} nodes joined" if self.joined
                  else f"not all {nnodes} nodes joined")
        after = f" within {timeout_s} s" if timeout_s else ""
        return (f"rendezvous at {host}:{port} timed out{after}: {joined} (hint: start meshrun on every node "
                "with the same master address and port, or raise --rdzv-timeout)")
