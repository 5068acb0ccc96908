"""The Python API: ``meshrun.detect()`` and ``meshrun.run(fn, nproc=N)``."""

from __future__ import annotations

import os
import pickle
import sys
import time
import traceback
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, Protocol, cast

from .cluster.detect import resolve
from .cluster.gpus import count_visible_gpus
from .cluster.net import free_port, release_port
from .cluster.options import user_topology
from .cluster.topology import Topology
from .errors import MeshrunError, bad_value

if TYPE_CHECKING:
    from multiprocessing.process import BaseProcess
    from multiprocessing.queues import Queue

# What a rank reports: (rank, ok, rank 0's pickled result or None / the traceback, time.time()).
_Report = tuple[int, bool, Any, float]


def detect(env: Mapping[str, str] | None = None, platform: str | None = None) -> Topology:
    """The topology of this node, as ``meshrun env`` shows it (MESHRUN_* values included)."""
    env = dict(os.environ if env is None else env)
    user = user_topology({"platform": platform}, env)
    return resolve(env, count_visible_gpus(env), user.platform, user.overrides)


class RankError(RuntimeError):
    """A rank of ``meshrun.run`` failed; the message carries that rank's traceback."""

    def __init__(self, rank: int, detail: str) -> None:
        super().__init__(f"rank {rank} failed:\n{detail}")
        self.rank = rank


class _Context(Protocol):
    """What ``run`` uses of a multiprocessing context (fork, spawn or forkserver)."""

    def Process(self, *, target: Callable[..., object], args: tuple[Any, ...], daemon: bool) -> BaseProcess: ...

    def Queue(self) -> Queue[_Report]: ...


def _worker(rank: int, nproc: int, port: int, backend: str, fn: Callable[..., Any],
            args: tuple[Any, ...], kwargs: dict[str, Any], queue: Queue[_Report], forked: bool = False) -> None:
    os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(nproc),
                       "LOCAL_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    import torch
    import torch.distributed as dist

    if forked:
        # A forked child inherits OpenMP's thread-pool state but none of its threads: once
        # the parent has run parallel CPU work (any sizeable tensor op), the child's first
        # parallel region waits forever on the missing workers. One intra-op thread runs
        # inline and never touches the pool (torchrun gives multi-process jobs one thread too).
        torch.set_num_threads(1)
        # Inductor's compile thread pool likewise: torch resets its process pool after a fork
        # but not the thread pool, so a child compiling after the parent compiled (cold cache)
        # queues work for threads that do not exist and hangs. A fresh pool on first use.
        async_compile = sys.modules.get("torch._inductor.async_compile")
        pool = getattr(getattr(async_compile, "AsyncCompile", None), "pool", None)
        if pool is not None and hasattr(pool, "cache_clear"):
            pool.cache_clear()

    try:
        if backend == "nccl":
            torch.cuda.set_device(rank)
        dist.init_process_group(backend, rank=rank, world_size=nproc)
        result = fn(*args, **kwargs)
    except BaseException:  # report everything, KeyboardInterrupt included, to the parent
        # Report before tearing down: the teardown makes peers fail too, and the parent
        # must see this root cause first (the timestamp orders near-simultaneous reports).
        detail = traceback.format_exc()
        if forked and "Autograd-and-Fork" in detail:
            detail += ("meshrun.run forked this rank after autograd's device threads started in the parent; "
                       "with fn at the top level of a module and start_method='auto', the ranks are spawned\n")
        queue.put((rank, False, detail, time.time()))
    else:
        # Plain pickle bytes, not the queue's own tensor sharing: that passes file descriptors
        # which vanish when this process exits before the parent has read them.
        queue.put((rank, True, pickle.dumps(result) if rank == 0 else None, time.time()))
    finally:
        if dist.is_initialized():
            import gc

            gc.collect()  # drop DDP reducers in reference cycles before the group (gloo aborts otherwise)
            dist.destroy_process_group()


def _autograd_threads_started() -> bool:
    """Whether autograd's device threads run in this process: a child forked after that refuses
    every backward ("Unable to handle autograd's threading in combination with fork-based
    multiprocessing"). torch 2.15 on a CPU-only machine starts them on the first backward of a
    ``torch.compile``d function (8 threads named ``pt_autograd_N``); torch 2.7 and 2.13 do not.
    Linux names its threads in /proc; elsewhere nothing forks.
    """
    return any(name.startswith("pt_autograd") for name in _thread_names())


def _thread_names() -> list[str]:
    names: list[str] = []
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return names
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue  # the thread ended while we looked
    return names


def _unspawnable(fn: Callable[..., Any]) -> str | None:
    """Why ranks started afresh (spawn, forkserver) could not import ``fn``, or None: they look it
    up by module and name, which a lambda, a nested function or one typed into an interactive
    session does not have."""
    qualname = getattr(fn, "__qualname__", "")
    if "<locals>" in qualname or "<lambda>" in qualname:
        return "is a lambda or a nested function"
    if getattr(fn, "__module__", None) == "__main__" and not _main_is_a_file():
        return "is defined in an interactive session"
    return None


def _main_is_a_file() -> bool:
    """Whether ``__main__`` was read from a file that a spawned interpreter can run again: not
    an interactive session nor a notebook kernel, whose ``__main__`` inspect finds no file for."""
    import inspect

    try:
        inspect.getfile(sys.modules["__main__"])
    except (TypeError, KeyError):
        return False
    return True


def _start_method(mp: Any, cuda_initialized: bool, spawnable: bool) -> str:
    """``auto``: fork where a forked rank works, so notebook functions run; else spawn.

    Not after CUDA is initialised (a forked child cannot use it), and not after autograd started
    its device threads (a forked child refuses every backward) unless the function could not be
    spawned: then fork is the only way, and works for a function without a backward pass.
    """
    if "fork" not in mp.get_all_start_methods() or cuda_initialized:
        return "spawn"
    if spawnable and _autograd_threads_started():
        return "spawn"
    return "fork"


def run(fn: Callable[..., Any], *args: Any, nproc: int | None = None, backend: str | None = None,
        start_method: str = "auto", timeout_s: float | None = None, **kwargs: Any) -> Any:
    """Run ``fn(*args, **kwargs)`` on ``nproc`` local processes with the process group ready.

    Returns rank 0's result. If a rank raises, the others are stopped and ``RankError`` is
    raised with the first failing rank's traceback. ``nproc`` defaults to the visible GPUs
    (NCCL), or 2 CPU processes (gloo). ``start_method="auto"`` forks where that is safe (Linux,
    CUDA not yet initialised here, autograd's device threads not started), so functions defined
    in a notebook work; else spawns.
    """
    import queue as queue_mod

    import torch
    import torch.multiprocessing as mp

    gpus = count_visible_gpus(os.environ)
    nproc = nproc if nproc is not None else (gpus or 2)
    if nproc < 1:
        raise bad_value("nproc", nproc, "must be at least 1")
    if backend is None:
        backend = "nccl" if gpus else "gloo"
    if backend == "nccl" and nproc > gpus:
        raise bad_value("nproc", nproc, f"exceeds the {gpus} visible GPU(s) for the nccl backend",
                        "lower nproc or use backend='gloo'")
    unspawnable = _unspawnable(fn)
    if start_method == "auto":
        cuda_initialized = torch.cuda.is_initialized()  # type: ignore[no-untyped-call]  # torch: unannotated
        start_method = _start_method(mp, cuda_initialized, spawnable=unspawnable is None)
    if start_method != "fork" and unspawnable is not None:
        raise bad_value("fn", getattr(fn, "__qualname__", repr(fn)),
                        f"{unspawnable}, which ranks started by {start_method!r} cannot import",
                        "define it at the top level of a module or script, or leave start_method='auto' "
                        "to fork where this process allows")
    # Every context has a Process class; typeshed's BaseContext, what get_context of a str returns, declares none.
    ctx = cast(_Context, mp.get_context(start_method))
    results = ctx.Queue()
    port = free_port()
    forked = start_method == "fork"
    procs = [ctx.Process(target=_worker, args=(r, nproc, port, backend, fn, args, kwargs, results, forked),
                         daemon=True) for r in range(nproc)]
    for p in procs:
        p.start()
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    reports: dict[int, tuple[bool, Any, float]] = {}
    failure: tuple[int, str] | None = None
    settle_until: float | None = None  # after a failure, wait briefly for earlier ones
    try:
        while len(reports) < nproc and (settle_until is None or time.monotonic() < settle_until):
            try:
                rank, ok, payload, stamp = results.get(timeout=0.2)
                reports[rank] = (ok, payload, stamp)
                if not ok and settle_until is None:
                    settle_until = time.monotonic() + 1.0
                continue
            except queue_mod.Empty:
                pass
            for r, p in enumerate(procs):
                if r not in reports and not p.is_alive() and p.exitcode not in (None, 0):
                    reports[r] = (False, f"process exited with code {p.exitcode} before reporting", time.time())
                    settle_until = settle_until or time.monotonic() + 1.0
            if deadline is not None and time.monotonic() > deadline:
                failure = (-1, f"timed out after {timeout_s} s")
                break
        failed = sorted((stamp, r, payload) for r, (ok, payload, stamp) in reports.items() if not ok)
        if failure is None and failed:
            failure = (failed[0][1], failed[0][2])
    finally:
        for p in procs:
            if failure is not None and p.is_alive():
                p.terminate()
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join()
        release_port(port)
    if failure is not None:
        raise RankError(*failure)
    return pickle.loads(reports[0][1])


__all__ = ["detect", "run", "RankError", "MeshrunError"]
