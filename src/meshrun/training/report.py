"""What the Trainer says about its run: the first line (what runs, and what was chosen and why),
each log line's metrics, and the run's config as a tracker's parameters. Where they go
(stdout, metrics.jsonl, the trackers) is ``metrics.MetricsSink``'s business."""

from __future__ import annotations

import json
from typing import Any, Protocol

import torch
import torch.distributed as dist

from . import run
from .metrics import mfu, peak_flops


class Run(run.Run, Protocol):
    """What the report reads of the run (the Trainer, trainer.py) besides what every helper
    reads (run.py)."""

    scheduler: Any
    n_params: int
    flops_per_token: float | None
    bf16: bool
    data_s: float  # host seconds spent reading batches since the last log line


def describe(trainer: Run) -> str:
    """The run's first line: what runs, and what was chosen for the user and why."""
    cfg, rt, accum, dp_size = trainer.cfg, trainer.rt, trainer.state.accum, trainer.dp_size
    batch = cfg.micro * accum * dp_size
    line = (f"meshrun train: strategy {trainer.layout.description}, {rt.world_size} process(es), "
            f"{trainer.n_params / 1e6:.2f}M parameters, global batch {cfg.micro} x {accum} x {dp_size} = "
            f"{batch}" + (f" of {cfg.seq} tokens" if trainer.flops_per_token else "")
            + f", {'bf16' if trainer.bf16 else 'fp32'}")
    return line + "".join(f"\n  {reason}" for reason in trainer.choice.reasons)


def params(trainer: Run) -> dict[str, Any]:
    """The run's resolved config as a tracker's parameters: every option as it ran (the
    defaults resolved: sequence length, micro-batch), and what meshrun chose for it."""
    cfg, rt = trainer.cfg, trainer.rt
    options = {k: v for k, v in json.loads(cfg.to_json()).items() if k != "sources"}
    return {**options, "micro_batch": cfg.micro, "seq_len": cfg.seq, "layout": trainer.layout.description,
            "world_size": rt.world_size, "dp_size": trainer.dp_size, "accumulation": trainer.state.accum,
            "global_batch": cfg.micro * trainer.state.accum * trainer.dp_size,
            "precision": "bf16" if trainer.bf16 else "fp32", "parameters": trainer.n_params,
            "device": rt.device.type, "torch": torch.__version__}


def record(trainer: Run, step: int, loss_sum: torch.Tensor, steps: int, tokens: int, elapsed: float,
           norm: torch.Tensor | None) -> dict[str, Any]:
    """One log line's metrics over the last ``steps`` steps, ``elapsed`` seconds of training
    (snapshots and validation not counted). The loss is the mean over the whole global
    batch from every rank: one all-reduce per log line, not per step."""
    rt, layout = trainer.rt, trainer.layout
    dist.all_reduce(loss_sum)
    per_gpu = tokens / elapsed / layout.token_share
    return {
        "step": step,
        "loss": loss_sum.item() / (layout.loss_ranks * steps),
        "lr": trainer.scheduler.get_last_lr()[0],
        "grad_norm": None if norm is None else float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm),
        "step_time_s": elapsed / steps,
        # the loader's share: while the device computes, the host reads ahead; this is what it took
        "data_time_s": trainer.data_s / steps,
        "tokens_per_s": per_gpu * rt.world_size,
        "tokens_per_s_per_gpu": per_gpu if rt.cuda else None,  # (on the CPU a process is no GPU)
        "mfu": mfu(per_gpu, trainer.flops_per_token, peak_flops(rt.device)),
        "peak_mem_bytes": torch.cuda.max_memory_allocated(rt.device) if rt.cuda else None,
        # what the allocator holds: what nvidia-smi shows and what runs out
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(rt.device) if rt.cuda else None,
    }
