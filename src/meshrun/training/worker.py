"""The per-rank program that `meshrun train` launches: `python -m meshrun.training.worker`.

It reads the validated TrainConfig from MESHRUN_TRAIN_CONFIG, and reports to the launching
`meshrun train` through the run directory it names (launch/rundir.py: MESHRUN_RUN_DIR). A
MeshrunError (bad factory, out of memory at step 1, ...) is an ``error`` record, which
`meshrun train` prints as its one-line error, and the rank exits with code 2. Any other
exception (in the model, the compiler, a collective) is written in full to the rank's log
(ranklog.py, in MESHRUN_LOG_DIR) and as one line (launch/failure.py: rank, type, message,
log, hint) in a ``crash`` record, and the rank exits with code 1; `meshrun train` prints the
first such line. SIGTERM and SIGUSR1 stop the run after a step all ranks agree on, with a
snapshot (preempt.py): the rank exits with PREEMPTED (75), and the local rank 0 writes the
one-line account as a ``preempt`` record for `meshrun train` to print.

Once past its rendezvous a rank writes ``ready.RANK`` in the run directory: until then a
stopping signal ends the job at once. Collectives wait at most the config's
``collective_timeout``; a rank whose collective timed out says so in its line (the launcher
names a peer it finds stopped). Ctrl-C (SIGINT, which `meshrun train` sends the workers
alone) ends the rank with code 130, also when it surfaces as another error (a snapshot write
it cut short, a collective its peer left); the first rank to see it writes the step as an
``interrupt`` record at once.
"""

from __future__ import annotations

import gc
import json
import os
import signal
import sys
from typing import Any

from ..errors import INTERRUPTED, PREEMPTED, MeshrunError
from ..launch.rundir import CRASH, ERROR, INTERRUPT, PREEMPT, Report, ReportReader, RunDir
from ..quiet import quiet_library_notices
from . import preempt
from .ranklog import redirect

# What a rank's exception says when a collective waited out its timeout (gloo: "Timed out
# waiting 10000ms for recv operation to complete"; NCCL's blocking wait: "timed out").
_TIMED_OUT = ("Timed out", "timed out", "Timeout", "timeout")


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _report(exc: MeshrunError) -> None:
    print(f"meshrun: error: {exc}", file=sys.stderr, flush=True)  # (the rank's log, when it has one)
    run_dir = RunDir.from_env(os.environ)
    if run_dir is not None:  # `meshrun train` prints it once, as its last line
        run_dir.report(Report(ERROR, _rank(), str(exc)))


def _report_crash(exc: BaseException, log: str | None, timeout_s: int | None = None) -> None:
    """The full traceback to the rank's log (its stderr), one line for `meshrun train`."""
    import traceback

    from ..launch.failure import exception_line, is_echo, timeout_line

    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    sys.stderr.write(tb)
    sys.stderr.flush()
    rank = _rank()
    line = exception_line(rank, type(exc).__name__, type(exc).__module__, str(exc), tb, log)
    timed_out = False
    if timeout_s is not None and any(n in str(exc) for n in _TIMED_OUT):
        line, timed_out = timeout_line(rank, timeout_s, log), True
    run_dir = RunDir.from_env(os.environ)
    if run_dir is not None:
        # an echo: another rank went first, and its line, or torchrun's account of it, is the cause
        run_dir.report(Report(CRASH, rank, line, echo=is_echo(f"{type(exc).__name__}: {exc}"), timed_out=timed_out))
    else:
        print(f"meshrun: error: {line}", file=sys.__stderr__, flush=True)


def _report_preempted(stop: preempt.Preempted) -> None:
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    run_dir = RunDir.from_env(os.environ)
    if run_dir is not None:
        run_dir.report(Report(PREEMPT, _rank(), stop.message()))
    elif _rank() == 0:
        print(f"meshrun: {stop.message()}", file=sys.stderr, flush=True)


_interrupted = False  # this rank received SIGINT
_trainer: Any = None  # the run's Trainer once it exists: the step a Ctrl-C stops at


def _on_sigint(_signum: int, _frame: Any) -> None:
    global _interrupted
    if not _interrupted:  # once: a second one must not break the handling of the first
        _interrupted = True
        # Said before anything unwinds: the interrupt may cut a snapshot's write short, and
        # once any rank exits torchrun stops the others, maybe before an except clause runs.
        _say_interrupted()
        raise KeyboardInterrupt


def _say_interrupted() -> None:
    """Where Ctrl-C stopped the run: its step (each rank knows it: the ranks step together).
    The first rank to stop says it; `meshrun train` adds the last snapshot once all ended."""
    run_dir = RunDir.from_env(os.environ)
    if run_dir is None or ReportReader(run_dir).first(INTERRUPT) is not None:
        return
    line = "interrupted during start-up" if _trainer is None else f"interrupted at step {_trainer.step}"
    run_dir.report(Report(INTERRUPT, _rank(), line))


def _write_whole(path: str, text: str) -> None:
    """Whole or not at all: `meshrun train` never reads half a record. The temporary name is
    this process's own."""
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


_ready = False


def _mark_ready() -> None:
    """Past the rendezvous: from here a stopping signal is this rank's to handle, at a step."""
    global _ready
    _ready = True
    run_dir = RunDir.from_env(os.environ)
    if run_dir is not None:
        with open(run_dir.ready(_rank()), "w"):
            pass


def _is_ready() -> bool:
    return _ready


def main() -> int:
    # No cyclic garbage collection while the rank imports its modules, then what they made
    # frozen: the collector's passes over torch's objects are a part of its import, and of
    # torch._dynamo's that DDP, FSDP2 and tensor parallelism make later
    # (docs/decisions.md#no-compiler-import). Only modules and what they hold are frozen: no
    # model or data exists yet.
    gc.disable()
    preempt.install()  # first: from here on a preemption signal stops the run at a step boundary
    signal.signal(signal.SIGINT, _on_sigint)
    quiet_library_notices()  # before torch and torchao are imported
    from ..config import TrainConfig, resolve_seq_len
    from ..modelinfo.read import context_of
    from .about import data_facts, model_facts
    from .factories import build_data, build_model, pretrained_weights, vocab_size
    from .runtime import init_runtime, teardown
    from .trainer import Trainer

    gc.freeze()
    gc.enable()

    cfg = TrainConfig.from_json(os.environ["MESHRUN_TRAIN_CONFIG"])
    log = None
    run_dir = RunDir.from_env(os.environ)
    if run_dir is not None:  # every rank's output in LOGS/rank-N.log (ranklog.py)
        try:
            log = redirect(run_dir.log_dir, _rank(), int(os.environ.get("WORLD_SIZE", "1")))
        except OSError as exc:  # the run goes on, its output on the terminal
            print(f"meshrun: warning: no log in {run_dir.log_dir} ({exc.strerror}); output stays "
                  "on the terminal", file=sys.stderr, flush=True)
    global _trainer
    try:
        rt = init_runtime(cfg.collective_timeout)
        _mark_ready()
        if cfg.out:  # OUT stays locked while this process may write there (config/runlock.py)
            from ..config.runlock import share

            # After the rendezvous: it needs rank 0, whose launcher holds OUT by now. (With one
            # process per task, Slurm's or mpirun's, other ranks may start before it locks.)
            share(cfg.out)
        model = build_model(cfg)
        cfg = resolve_seq_len(cfg, context_of(model))  # (a user's model states its own context)
        train, val = build_data(cfg, vocab_size(model))
        weights = pretrained_weights(cfg)
        _trainer = Trainer(model, train, val, cfg, rt, weights=weights,
                           model_facts=model_facts(cfg, model, pretrained=weights is not None),
                           data_facts=data_facts(train, val, vocab_size(model), cfg))
        records = _trainer.fit()
        preempt.settle()  # done: its last snapshot is committed
        if records and run_dir is not None:  # rank 0's last record, for meshrun.train(...)
            _write_whole(run_dir.result, json.dumps(records[-1]))
    except preempt.Preempted as stop:  # every rank stopped at the same step, past the snapshot's commit
        preempt.settle()
        _report_preempted(stop)
        teardown()
        return PREEMPTED
    except (KeyboardInterrupt, Exception) as exc:  # noqa: BLE001 (any failure becomes one line)
        if isinstance(exc, KeyboardInterrupt) or _interrupted:
            # Ctrl-C: `meshrun train` says the one line. It may reach this rank as another
            # error: a write it cut short, a collective its peer left.
            _say_interrupted()
            return INTERRUPTED
        if isinstance(exc, MeshrunError):
            _report(exc)
            return 2  # no teardown barrier: the peers may be stuck elsewhere; the launcher stops them
        # (a timeout before the rendezvous formed is the store's, said as it is)
        _report_crash(exc, log, cfg.collective_timeout if _is_ready() else None)
        return 1
    teardown()
    return 0


def exit_now(code: int) -> None:
    """End the rank as Python's exit would, but for its teardown of every module and object:
    other threads finished (as the interpreter waits for them), the exit handlers run (the
    trackers', torch's), the streams flushed, then ``os._exit``. The teardown alone takes more
    than a second of every run's end with torch and Dynamo loaded, after the run's files were
    all closed (docs/decisions.md#direct-ranks).

    Threads end through ``threading._shutdown``, the interpreter's own first step of exit: it
    runs the threading exit hooks before it joins, and one of them tells idle thread-pool
    workers (Inductor's compile pool) to stop; joining them without it waits forever."""
    import atexit
    import threading

    getattr(threading, "_shutdown")()  # noqa: B009 (private: typeshed leaves it out)
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        try:
            if stream is not None:
                stream.flush()
        except (OSError, ValueError):  # a closed or broken stream: nothing more to say there
            pass
    os._exit(code)


if __name__ == "__main__":
    exit_now(main())
