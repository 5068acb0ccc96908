"""One line for a job whose rank died, whatever it died of.

A training rank that raises writes its own account (``exception_line``: the rank, the
exception's type and the first line of its message, the rank's log, a hint where one is
known) before it exits. A rank that dies of a signal (SIGKILL from the kernel's OOM killer, a
segmentation fault in native code) can write nothing; torchrun then prints its failure report
(a traceback of its own and a "Root Cause" table), which ``TorchrunReport`` holds back from
the terminal and ``parse_root_cause`` reads for the rank and its exit code (``signal_line``).

Pure and torch-free: the launcher's side runs it without importing torch, the worker's side
with the exception in hand.
"""

from __future__ import annotations

import re
import signal
from typing import BinaryIO

from .rdzvwatch import StderrFilter

# What a rank raises when another rank went away in the middle of a collective: an echo of
# that rank's failure, not a cause of its own.
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "DistNetworkError",
              "remote process exited or there was a network error")

# (what to look for in the exception's type, module, message and traceback, the hint), first
# match wins. Compiler failures first: Dynamo and Inductor wrap the error they met (a Triton
# kernel that does not compile, a shape its fake tensors got wrong), so the wrapped type says
# less than where it was raised.
_HINTS: tuple[tuple[tuple[str, ...], str], ...] = (
    (("OutOfMemoryError", "CUDA out of memory"),
     "a smaller --micro-batch, --activation-checkpointing full, or an FSDP2 --strategy"),
    (("liger_kernel",), "--kernels plain (torch's modules instead of Liger Kernel's)"),
    (("torch._dynamo", "torch._inductor", "BackendCompilerFailed", "InductorError", "TorchRuntimeError",
      "triton.compiler"), "--compile off (the run then stays eager)"),
    (("NCCL", "DistBackendError", "ProcessGroupNCCL"),
     "a collective failed: check the network with 'meshrun doctor', and NCCL_DEBUG=INFO for NCCL's account"),
    (_PEER_GONE, "another rank stopped first: its line, or its log, says why"),
    (("CUDA error", "cudaError", "AcceleratorError"),
     "a GPU fault: CUDA_LAUNCH_BLOCKING=1 names the failing kernel; 'nvidia-smi' shows the card's state"),
)

_SIGNAL_HINTS = {
    signal.SIGKILL: "killed: by the kernel's out-of-memory killer (host memory), by a user, or by the scheduler",
    signal.SIGSEGV: "a crash in native code: the log holds each thread's Python stack",
    signal.SIGABRT: "aborted in native code (NCCL's watchdog, a failed CUDA check): see the log",
    signal.SIGBUS: "a bus error: a file mapped into memory changed or a disk is full; see the log",
}


def first_line(message: str, limit: int = 300) -> str:
    """The first non-empty line of ``message``, at most ``limit`` characters."""
    line = next((s.strip() for s in message.splitlines() if s.strip()), "")
    return line if len(line) <= limit else line[:limit - 3] + "..."


def hint_for(text: str) -> str:
    for needles, hint in _HINTS:
        if any(n in text for n in needles):
            return hint
    return ""


def is_echo(text: str) -> bool:
    """Whether a rank's exception only says that another rank went away."""
    return any(n in text for n in _PEER_GONE)


def exception_line(rank: int, type_name: str, module: str, message: str, traceback_text: str,
                   log_path: str | None) -> str:
    """``rank R failed: Type: first line of the message (log: PATH) (hint: ...)``."""
    shown = f"{type_name}: {first_line(message)}" if first_line(message) else type_name
    line = f"rank {rank} failed: {shown}"
    if log_path:
        line += f" (full log: {log_path})"
    hint = hint_for(f"{module}.{type_name}\n{message}\n{traceback_text}")
    return line + (f" (hint: {hint})" if hint else "")


def signal_name(exitcode: int) -> str | None:
    """The signal a process died of: torchrun reports it as a negative exit code, a shell as
    128 + N."""
    number = -exitcode if exitcode < 0 else exitcode - 128 if exitcode > 128 else 0
    try:
        return signal.Signals(number).name if number else None
    except ValueError:
        return None


def signal_line(rank: int | None, exitcode: int, log_path: str | None) -> str:
    """The account of a rank that wrote none: died of a signal, or exited with a code."""
    who = f"rank {rank}" if rank is not None else "a rank"
    name = signal_name(exitcode)
    line = f"{who} died of {name}" if name else f"{who} exited with code {exitcode}"
    if log_path:
        line += f" (full log: {log_path})"
    hint = _SIGNAL_HINTS.get(getattr(signal, name), "") if name else ""
    return line + (f" (hint: {hint})" if hint else "")


_ROOT_CAUSE = re.compile(r"Root Cause.*?rank\s*:\s*(\d+)\s*\(local_rank:\s*(\d+)\).*?exitcode\s*:\s*(-?\d+)",
                         re.DOTALL)
_FAILED = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)")


def parse_root_cause(text: str) -> tuple[int | None, int] | None:
    """(global rank or None, exit code) of the first failure in torchrun's report: its "Root
    Cause" table (torch 1.10 to 2.15), else its "failed (exitcode: N) local_rank: L" line
    (the local rank only); None when the text holds neither."""
    m = _ROOT_CAUSE.search(text)
    if m:
        return int(m.group(1)), int(m.group(3))
    m = _FAILED.search(text)
    if m:
        return None, int(m.group(1))
    return None


# What starts torchrun's failure report: the agent's log line for the failed worker, its
# closing signal to the others, its own traceback.
_REPORT_START = (b"failed (exitcode:", b"closing signal", b"Traceback (most recent call last)",
                 b"ChildFailedError", b"FAILED\n")


class TorchrunReport:
    """A filter on torchrun's relayed stderr (``run.execute``'s ``watch``): lines up to its
    failure report pass; the report is held back (kept in ``held``) for ``parse_root_cause``,
    and every line is also written to ``log`` (a binary file) when one is given, so nothing
    torchrun said is lost. Wraps another filter (``inner``: multi-node rendezvous handling)."""

    def __init__(self, inner: StderrFilter | None = None, log: BinaryIO | None = None) -> None:
        self.inner, self.log = inner, log
        self.held: list[bytes] = []

    def _pass(self, lines: list[bytes]) -> list[bytes]:
        out = []
        for line in lines:
            if self.log is not None:
                self.log.write(line)
                self.log.flush()
            if self.held or any(s in line for s in _REPORT_START):
                self.held.append(line)
            else:
                out.append(line)
        return out

    def feed(self, line: bytes) -> list[bytes]:
        return self._pass(self.inner.feed(line) if self.inner is not None else [line])

    def stale(self) -> list[bytes]:
        return self._pass(self.inner.stale() if self.inner is not None else [])

    def close(self) -> list[bytes]:
        return self._pass(self.inner.close() if self.inner is not None else [])

    def text(self) -> str:
        return b"".join(self.held).decode(errors="replace")

    def release(self) -> list[bytes]:
        """The held report, for when it says what no line of meshrun's can."""
        out, self.held = self.held, []
        return out


def timeout_line(rank: int, timeout_s: int, log_path: str | None) -> str:
    """The line of a rank whose collective waited out the collective timeout: it knows that a
    peer did not answer, not which one (``silent_line`` says that from the launcher)."""
    return (f"rank {rank}: a collective waited {timeout_s} s (--collective-timeout) for a rank that did not answer"
            + (f" (full log: {log_path})" if log_path else "")
            + " (hint: a rank that stopped or hangs; a step slower than that, such as a long snapshot, needs a larger "
              "--collective-timeout)")


def silent_line(silent: list[int], waited: list[int], timeout_s: int, log_dir: str | None) -> str:
    """The line of a job whose ranks ``waited`` out a collective on ranks ``silent``: alive,
    but neither in that collective nor failed (a loop that never ends, a deadlock, a stall
    in I/O)."""
    who = ", ".join(str(r) for r in sorted(silent))
    line = (f"rank{'s' if len(silent) > 1 else ''} {who} stopped answering: rank"
            f"{'s' if len(waited) > 1 else ''} {', '.join(str(r) for r in sorted(waited))} waited {timeout_s} s for it "
            "in a collective (--collective-timeout); the job was ended")
    if log_dir:
        line += f" (full log: {log_dir}/rank-{min(silent)}.log)"
    return line + (" (hint: the log's last lines say where it was; a step slower than the timeout, such as a long "
                   "snapshot, needs a larger --collective-timeout)")
