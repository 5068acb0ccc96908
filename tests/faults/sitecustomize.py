"""Fault injection for the tests, never part of the product.

A test that puts this directory first on PYTHONPATH and sets TEST_FAULTS (``name=value``
pairs, comma-separated) makes every Python process of the job (meshrun, torchrun, each rank)
run this file at start-up. It patches the named meshrun functions as their modules are
imported, so the product carries no switch for them:

- ``save_pause=S``: a snapshot waits S seconds between its written shards and its commit.
- ``write_delay=S``: an asynchronous snapshot's background write takes S seconds longer (a
  slow disk).
- ``slow_write=S``: a snapshot's shard write takes S seconds longer; an interrupt in that
  time surfaces as the RuntimeError that torch's own writer raises for a write cut short.
- ``prepare_pause=S``: `meshrun data prepare` waits S seconds after each resumable point.
- ``device_memory=1``: a CPU rank's memory counts as one that can run out the way a GPU's does
  (``batchfit.can_run_out_of_memory``), so the micro-batch try runs: the models of
  tests/userpkg raise CUDA's out-of-memory error as a GPU would.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

FAULTS = dict(item.split("=", 1) for item in os.environ.get("TEST_FAULTS", "").split(",") if "=" in item)


def _seconds(name: str) -> float:
    return float(FAULTS[name])


def _patch_save(module: Any) -> None:
    if "save_pause" in FAULTS:
        commit = module._commit

        def paused_commit(p: Any) -> str:
            time.sleep(_seconds("save_pause"))
            return commit(p)

        module._commit = paused_commit
    if "write_delay" in FAULTS:
        hash_own = module._hash_own_files

        def slow_hash(*args: Any) -> Any:
            if threading.current_thread().name != threading.main_thread().name:  # the background writer
                time.sleep(_seconds("write_delay"))
            return hash_own(*args)

        module._hash_own_files = slow_hash
    if "slow_write" in FAULTS:
        base = module.dcp.FileSystemWriter

        class SlowWriter(base):  # type: ignore[misc, valid-type]
            def write_data(self, plan: Any, planner: Any) -> Any:
                try:
                    time.sleep(_seconds("slow_write"))
                except KeyboardInterrupt as exc:  # as torch's C++ writer reports it
                    raise RuntimeError("[enforce fail at inline_container.cc] unexpected pos "
                                       "(a write cut short)") from exc
                return super().write_data(plan, planner)

        module.dcp.FileSystemWriter = SlowWriter


def _patch_prepare(module: Any) -> None:
    if "prepare_pause" in FAULTS:
        write_json = module._write_json

        def paused_write_json(path: str, value: Any) -> None:
            write_json(path, value)
            if os.path.basename(path) == module.PROGRESS:
                time.sleep(_seconds("prepare_pause"))

        module._write_json = paused_write_json


def _patch_batchfit(module: Any) -> None:
    if "device_memory" in FAULTS:
        module.can_run_out_of_memory = lambda device: True


PATCHES: dict[str, Callable[[Any], None]] = {
    "meshrun.training.batchfit": _patch_batchfit,
    "meshrun.training.snapshot.save": _patch_save,
    "meshrun.data.prepare": _patch_prepare,
}


def _patching(exec_module: Callable[[Any], None], name: str) -> Callable[[Any], None]:
    """A loader's exec_module that runs the real one, then the patch of the module called name."""

    def patched_exec(module: Any) -> None:
        exec_module(module)
        PATCHES[name](module)

    return patched_exec


class _Patcher(importlib.abc.MetaPathFinder):
    """Finds nothing itself: wraps the real loader of a patched module to patch it once loaded."""

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name not in PATCHES:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            spec = finder.find_spec(name, path, target) if hasattr(finder, "find_spec") else None
            if spec is not None and spec.loader is not None:
                loader = spec.loader
                loader.exec_module = _patching(loader.exec_module, name)  # type: ignore[method-assign]
                return spec
        return None


if FAULTS:
    unknown = set(FAULTS) - {"save_pause", "write_delay", "slow_write", "prepare_pause", "device_memory"}
    if unknown:
        raise SystemExit(f"TEST_FAULTS: unknown fault(s) {sorted(unknown)}")
    sys.meta_path.insert(0, _Patcher())
