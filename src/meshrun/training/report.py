"""What the Trainer says about its run: the first lines (what it trains, on what data, in what
steps and batches, with what strategy, and what was chosen and why), each log line's metrics,
and the run's resolved configuration as a tracker's parameters. Where they go (stdout,
metrics.jsonl, the trackers) is ``metrics.MetricsSink``'s business."""

from __future__ import annotations

import json
from typing import Any, Protocol

import torch
import torch.distributed as dist

from ..config import TrainConfig
from ..vocab import FLOAT8_PRECISIONS
from . import run
from .about import DataFacts, ModelFacts, data_line, model_line
from .metrics import mfu, peak_flops
from .stepline import rate_text


class Run(run.Run, Protocol):
    """What the report reads of the run (the Trainer, trainer.py) besides what every helper
    reads (run.py)."""

    scheduler: Any
    n_params: int
    flops_per_token: float | None
    bf16: bool
    data_s: float  # host seconds spent reading batches since the last log line
    model_facts: ModelFacts
    data_facts: DataFacts
    given: TrainConfig  # the config as the Trainer was given it, before it resolved what was left open
    resume_from: str | None

    @property
    def step(self) -> int: ...


def describe(trainer: Run) -> str:
    """The run's first lines, as sentences: the model, the data, the steps and their batch,
    the strategy on its processes and precision; then, indented, what was chosen for the
    user and why."""
    cfg, rt, data = trainer.cfg, trainer.rt, trainer.data_facts
    seq = cfg.seq if data.tokens else None
    trains = None
    if cfg.lora is not None:  # the adapters and the frozen rest, counted on the laid-out model
        from . import lora

        trains = lora.describe(lora.spec_of(cfg), trainer.layout.model)
    lines = [model_line(trainer.model_facts, trainer.n_params, trains), data_line(data, seq),
             steps_line(trainer.step, cfg.steps, cfg.micro, trainer.state.accum, trainer.dp_size, seq,
                        cfg.lr, cfg.warmup_steps, cfg.min_lr_ratio),
             strategy_line(trainer.layout.description, rt.world_size, rt.local_world_size, rt.cuda,
                           precision(cfg, trainer.bf16))]
    return "\n".join(f"meshrun train: {line}" for line in lines) + "".join(
        f"\n  {reason}" for reason in trainer.choice.reasons)


def precision(cfg: TrainConfig, bf16: bool) -> str:
    """What the run computes in: bf16, fp32, or the float8 precision asked for (bf16 around it)."""
    return cfg.precision if cfg.precision in FLOAT8_PRECISIONS else "bf16" if bf16 else "fp32"


def _plural(n: int, word: str, many: str | None = None) -> str:
    return f"{n:,} {word if n == 1 else many or word + 's'}"


def steps_line(done: int, steps: int, micro: int, accum: int, dp: int, seq: int | None, lr: float, warmup: int,
               min_lr_ratio: float) -> str:
    """The steps this run trains (``done``: those a resumed snapshot already did) and each
    one's batch: the global batch as micro-batch x accumulation x data-parallel ranks, of
    sequences of ``seq`` tokens (None: samples of another kind); then the learning rate's
    schedule."""
    which = _plural(steps, "step") if not done else f"steps {done + 1}-{steps} of {steps}"
    batch = micro * accum * dp
    what = f"{_plural(batch, 'sequence')} of {seq:,} tokens" if seq else _plural(batch, "sample")
    lr_words = f"lr {rate_text(lr)}" + (f" after {_plural(warmup, 'warmup step')}" if warmup else "") \
        + f", cosine to {rate_text(lr * min_lr_ratio)}"
    return (f"{which}, each a global batch of {what} (micro-batch {micro} x {_plural(accum, 'accumulation step')} "
            f"x {_plural(dp, 'data-parallel rank')}); {lr_words}")


def strategy_line(layout: str, world: int, local_world: int, cuda: bool, precision: str) -> str:
    """The strategy and its layout (parallel/apply.py's description), on what and in what precision."""
    where = _plural(world, "GPU") if cuda else _plural(world, "CPU process", "CPU processes")
    if local_world and world > local_world:
        where += f" of {world // local_world} nodes"
    return f"strategy {layout}, on {where}, in {precision}"


def params(trainer: Run) -> dict[str, Any]:
    """The run's configuration as it runs, for the trackers: every option with what was left
    open resolved (the strategy chosen, the data read, the warmup, the batch sizes, the
    sequence length, precision, compile, kernels, the snapshot resumed), what the run is
    (parameters, layout, world size, vocabulary, tokens), and under ``given.`` each option
    whose value as given differs from the one that runs (``given.strategy: auto``)."""
    cfg, rt, choice = trainer.cfg, trainer.rt, trainer.choice
    model, data = trainer.model_facts, trainer.data_facts
    options = _options(cfg)
    resolved = {**{k: v for k, v in options.items() if k not in ("example", "model_size")},
                "model": model.name, "data": data.name, "strategy": choice.strategy, "warmup": cfg.warmup_steps,
                "precision": precision(cfg, trainer.bf16), "compile": choice.compile_mode,
                "activation_checkpointing": choice.activation_checkpointing, "kernels": choice.kernels,
                "micro_batch": cfg.micro, "global_batch": cfg.micro * trainer.state.accum * trainer.dp_size,
                "seq_len": cfg.seq, "pp_microbatches": cfg.pp_microbatches or cfg.pp, "tokenizer": data.tokenizer,
                "resume": trainer.resume_from or "none"}
    facts = {"model_family": model.family, "vocab_size": data.vocab, "train_tokens": data.train_tokens,
             "val_tokens": data.val_tokens, "train_samples": data.train_samples, "val_samples": data.val_samples,
             "layout": trainer.layout.description, "world_size": rt.world_size, "dp_size": trainer.dp_size,
             "accumulation": trainer.state.accum, "parameters": trainer.n_params, "device": rt.device.type,
             "torch": torch.__version__}
    given = {f"given.{k}": v for k, v in _options(trainer.given).items() if k in resolved and resolved[k] != v}
    return {**resolved, **{k: v for k, v in facts.items() if v is not None}, **given}


def _options(cfg: TrainConfig) -> dict[str, Any]:
    return {k: v for k, v in json.loads(cfg.to_json()).items() if k != "sources"}


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
