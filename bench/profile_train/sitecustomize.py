"""Imported by every Python process that has this directory on its path (``bench/profile_train.py``
puts it there): in the rank-0 training process of ``meshrun train``, two optimizer steps from
step PROFILE_TRAIN_AT on run under torch.profiler, and their kernels are printed by family and
by time (bench/profile_step.py's families). Nothing happens where PROFILE_TRAIN_AT is unset."""

import builtins
import os
import sys

_AT = os.environ.get("PROFILE_TRAIN_AT")
_import = builtins.__import__


def _patch_trainer() -> None:
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import profile_step

    from meshrun.training import trainer

    original = trainer.Trainer.train_step
    at, steps, cuda = int(_AT or 4), 2, torch.cuda.is_available()
    state: dict = {"n": 0}

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    def train_step(self, data):  # type: ignore[no-untyped-def]
        state["n"] += 1
        if state["n"] == at:
            sync()
            state["prof"] = profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else []))
            state["prof"].__enter__()
            state["t"] = time.perf_counter()
        out = original(self, data)
        if state["n"] == at + steps - 1:
            sync()
            wall = (time.perf_counter() - state["t"]) / steps * 1e3
            prof = state["prof"]
            prof.__exit__(None, None, None)
            _report(prof, wall, steps, cuda, profile_step)
        return out

    trainer.Trainer.train_step = train_step


def _report(prof, wall: float, steps: int, cuda: bool, ps) -> None:  # type: ignore[no-untyped-def]
    events = [e for e in prof.key_averages() if ps.is_kernel(e, cuda)]
    attr = "self_device_time_total" if cuda else "self_cpu_time_total"
    total = sum(getattr(e, attr) for e in events) or 1
    families: dict = {}
    for e in events:
        fam = ps.family(e.key)
        families[fam] = families.get(fam, 0) + getattr(e, attr)
    print(f"PROFILE wall {wall:.1f} ms/step, device {total / steps / 1e3:.1f} ms/step", flush=True)
    print("PROFILE families " + ", ".join(f"{k} {100 * v / total:.1f}%"
                                          for k, v in sorted(families.items(), key=lambda kv: -kv[1])), flush=True)
    for e in sorted(events, key=lambda e: -getattr(e, attr))[:int(os.environ.get("PROFILE_TRAIN_TOP", "30"))]:
        t = getattr(e, attr)
        print(f"PROFILE {100 * t / total:5.1f}% {e.count // steps:5d}/step {t / steps / 1e3:8.2f} ms  {e.key[:110]}",
              flush=True)


def _hook(name, *args, **kwargs):  # type: ignore[no-untyped-def]
    module = _import(name, *args, **kwargs)
    # (the module is in sys.modules while it runs; patched once its class exists)
    if hasattr(sys.modules.get("meshrun.training.trainer"), "Trainer"):
        builtins.__import__ = _import
        _patch_trainer()
    return module


if _AT and os.environ.get("RANK", "0") == "0":
    builtins.__import__ = _hook
