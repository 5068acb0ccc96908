"""Execute a Command: write its files, start its processes, forward signals, and return
the job's exit code.

Each child starts in its own session so that signals reach it exactly once, through
meshrun: a Ctrl-C or a scheduler's SIGTERM (or Slurm's SIGUSR1 before the time limit)
is forwarded to the child's whole process group, as a terminal would have delivered it.
When one of several processes (JAX, TensorFlow) fails, the rest are stopped: a
collective would otherwise wait for the dead peer forever.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Callable, Mapping

from ..errors import MeshrunError
from .command import Command

FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
INSTALL_HINT = {
    "torchrun": "pip install torch",
    "accelerate": "pip install 'meshrun[accelerate]'",
    "deepspeed": "pip install 'meshrun[deepspeed]'",
}


def resolve_program(prog: str) -> str:
    """Find a launcher next to this interpreter first (an un-activated venv), then on PATH."""
    if prog == "python":
        return sys.executable
    beside = os.path.join(os.path.dirname(sys.executable), prog)
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which(prog)
    if found is None:
        raise MeshrunError(f"program {prog!r} not found beside {sys.executable} or on PATH "
                           f"(hint: {INSTALL_HINT.get(prog, 'install it')})")
    return found


def resolved_argv(argv: tuple[str, ...]) -> list[str]:
    return [resolve_program(argv[0]), *argv[1:]]


def exit_code(returncode: int) -> int:
    """A child killed by signal N exits like a shell reports it: 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def _relay_stderr(proc: subprocess.Popen, mute: Callable[[], bool] | None, watch: object | None) -> threading.Thread:
    """Copy a child's stderr to ours line by line, dropping lines once ``mute()`` holds, and
    through ``watch`` (a RendezvousWatch) when given. select() with a timeout lets held
    lines out even when the child goes quiet."""
    import select

    def write(lines: list[bytes]) -> None:
        for line in lines:
            if mute is None or not mute():
                sys.stderr.buffer.write(line)
        sys.stderr.buffer.flush()

    def pump() -> None:
        if proc.stderr is None:  # not piped: nothing to relay
            return
        fd, buf = proc.stderr.fileno(), b""
        while True:
            ready, _, _ = select.select([fd], [], [], 0.5)
            if watch is not None:
                write(watch.stale())  # type: ignore[attr-defined]
            if not ready:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            buf += chunk
            *lines, buf = buf.split(b"\n")
            for line in lines:
                line += b"\n"
                write(watch.feed(line) if watch is not None else [line])  # type: ignore[attr-defined]
        tail = [buf] if buf else []
        write((watch.feed(buf) if watch is not None and buf else tail) + (watch.close() if watch is not None else []))

    thread = threading.Thread(target=pump, daemon=True)
    thread.start()
    return thread


def execute(cmd: Command, base_env: Mapping[str, str], grace_s: float = 15.0,
            mute_stderr: Callable[[], bool] | None = None, watch: object | None = None) -> int:
    """Run the command; returns the job's exit code.

    ``mute_stderr``: when given, the children's stderr is relayed through this process and
    dropped once it returns True. `meshrun train` uses it to keep torchrun's own failure
    report (a traceback) off the screen after a rank has explained a bad input in one line.
    ``watch``: a RendezvousWatch the relayed stderr passes through (multi-node torchrun)."""
    for path, text in cmd.files.items():
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    if cmd.note:
        print(f"meshrun: {cmd.note}", file=sys.stderr, flush=True)
    if not cmd.processes:
        return 0
    argvs = [resolved_argv(p.argv) for p in cmd.processes]  # fail before starting anything
    procs: list[subprocess.Popen] = []
    stopping_since: list[float] = []

    def forward(signum: int, _frame: object) -> None:
        if not stopping_since:
            stopping_since.append(time.monotonic())
        for p in procs:
            _signal_group(p, signum)

    previous = {s: signal.signal(s, forward) for s in FORWARDED}
    try:
        for argv, p in zip(argvs, cmd.processes):
            env = {**base_env, **cmd.env, **p.env}
            procs.append(subprocess.Popen(argv, env=env, start_new_session=True,
                                          stderr=subprocess.PIPE if (mute_stderr or watch) else None))
        relays = [_relay_stderr(p, mute_stderr, watch) for p in procs] if (mute_stderr or watch) else []
        code = _supervise(procs, stopping_since, grace_s)
        for relay in relays:
            relay.join(timeout=5)
        return code
    finally:
        for p in procs:
            if p.poll() is None:
                _signal_group(p, signal.SIGKILL)
                p.wait()
        for s, h in previous.items():
            signal.signal(s, h)


def _supervise(procs: list[subprocess.Popen], stopping_since: list[float], grace_s: float) -> int:
    first_failure: int | None = None
    while True:
        codes = [p.poll() for p in procs]
        for code in codes:
            if code not in (None, 0) and first_failure is None:
                first_failure = exit_code(code)
                if len(procs) > 1:
                    print(f"meshrun: a process exited with code {first_failure}; stopping the others",
                          file=sys.stderr, flush=True)
                stopping_since.append(time.monotonic())
                for p in procs:
                    if p.poll() is None:
                        _signal_group(p, signal.SIGTERM)
        if all(c is not None for c in codes):
            if first_failure is not None:
                return first_failure
            return max(exit_code(c) for c in codes if c is not None)
        if stopping_since and time.monotonic() - stopping_since[0] > grace_s:
            for p in procs:
                if p.poll() is None:
                    _signal_group(p, signal.SIGKILL)
        time.sleep(0.05)
