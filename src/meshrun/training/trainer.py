"""The Trainer: the training loop, and only the loop.

    from meshrun import Trainer, TrainConfig
    Trainer(model, train_dataset, val_dataset, TrainConfig(strategy="fsdp", steps=1000)).fit()

Launch the script with `meshrun launch` or torchrun, or run it as one process. One optimizer
step reads ``global_batch`` samples: micro-batch x accumulation x data-parallel size. What the
user left open (strategy, batch sizes, checkpointing) is decided once by ``parallel.auto``;
how the model is laid out over the ranks is the layout's business (``parallel.apply``); the
loop below calls the same few methods of the layout whatever the strategy.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset

from ..cluster.gpus import host_memory
from ..config import TrainConfig, resolve_seq_len, trackers, validate
from ..config.resize import keep_global_batch, resized_line
from ..defaults import val_micro
from ..errors import MeshrunError
from ..kernels.hf import hf_kernels_apply
from ..kernels.liger import liger_applies
from ..modelinfo.hf import export_record
from ..modelinfo.read import context_of
from ..plan.cards import card_of_device
from ..vocab import FLOAT8_PRECISIONS
from . import preempt, report, saves
from .about import DataFacts, ModelFacts, given_model
from .about import data_facts as about_data
from .batchfit import Resized, fit_micro_batch, guarded_step
from .factories import vocab_size
from .loaded import eager
from .loader import BatchStream, LoaderSpec, make_loader
from .metrics import MetricsSink, flops_per_token, lora_flops_per_token
from .optim import build_scheduler
from .parallel.apply import parallelize
from .parallel.auto import Choice, decide
from .parallel.layouts import Batch, target_weights
from .runtime import Runtime, init_runtime
from .saves import Snapshots
from .state import TrainState
from .weights import Pretrained

# A non-finite step is found at the next log line or snapshot, and at least this often: one
# host sync per 50 steps costs nothing measurable, and a run with rare log lines stops soon.
FINITE_CHECK_EVERY = 50


class Trainer:
    def __init__(self, model: torch.nn.Module, train_data: Dataset, val_data: Dataset | None = None,
                 config: TrainConfig | None = None, runtime: Runtime | None = None,
                 weights: Pretrained | None = None, model_facts: ModelFacts | None = None,
                 data_facts: DataFacts | None = None) -> None:
        """``model`` may have its parameters on the meta device (a Hugging Face model built from
        its config): it is then filled once laid out, from ``weights`` or a random initialisation.
        ``model_facts``/``data_facts``: what the model and data are, for the first lines and the
        trackers (about.py; `meshrun train`'s ranks know it from the config that built them),
        else what the objects themselves tell."""
        cfg = validate(config or TrainConfig())
        self.given = cfg  # as given: the trackers get what differs from the resolved config too
        if runtime is None:
            from .runtime import teardown_at_exit

            runtime = init_runtime()
            teardown_at_exit()  # this Trainer made the process group: it also ends it cleanly
        self.rt = rt = runtime
        self.bf16 = cfg.precision in ("bf16", *FLOAT8_PRECISIONS) or (cfg.precision == "auto" and rt.cuda
                                                                     and torch.cuda.is_bf16_supported())
        if cfg.precision in FLOAT8_PRECISIONS:
            from .parallel.float8 import check_device

            check_device(cfg.precision, rt.device, cfg.source("precision"))
        if cfg.precision == "bf16" and not rt.cuda:
            raise MeshrunError("--precision='bf16': this run is on CPU, where meshrun trains in fp32 "
                               "(hint: use --precision auto or fp32)")
        cfg = resolve_seq_len(cfg, context_of(model))
        self.flops_per_token = flops_per_token(model, cfg.seq)
        self.model_record = export_record(model, cfg.model)  # for `meshrun export --format hf`
        self.n_params = sum(p.numel() for p in model.parameters())
        self.vocab = vocab_size(model)
        self.model_facts = model_facts or given_model(model)
        self.data_facts = data_facts or about_data(train_data, val_data, self.vocab)
        dp = cfg.dp_size(rt.world_size)
        # the snapshot to start from, and the listing of OUT/checkpoints it was found in
        resume_from, self.checkpoint_names = saves.starting_point(cfg, rt.is_main)
        self.resume_from = resume_from
        cfg, resized = keep_global_batch(cfg, resume_from, dp)
        if resized is not None and resume_from is not None and cfg.micro_batch is not None:
            resized_line(resized, resume_from, cfg.micro, dp)  # a batch that does not split: refused, sizes that fit
        gpu_mem = torch.cuda.get_device_properties(rt.device).total_memory if rt.cuda else None
        liger = cfg.kernels == "auto" and rt.cuda and liger_applies(model, rt.device, cfg.tp, cfg.pp)
        hf_kernels = cfg.kernels == "auto" and rt.cuda and hf_kernels_apply(model, rt.device, cfg.tp, cfg.pp)
        card = card_of_device(torch.cuda.get_device_name(rt.device)) if rt.cuda else None  # its peaks, as plan's
        self.choice: Choice = decide(model, cfg, rt.world_size, rt.local_world_size, dp, gpu_mem, self.bf16, liger,
                                     card, hf_kernels=hf_kernels, cpu_mem=host_memory())
        sources = dict(cfg.sources)
        self.micro_is_ours = cfg.micro_batch is None  # meshrun's to change if it does not fit (batchfit.py)
        if cfg.micro_batch is None and self.choice.micro_batch != cfg.micro:
            sources["micro_batch"] = "planner"
        self.cfg = cfg = cfg.replace(micro_batch=self.choice.micro_batch, global_batch=self.choice.global_batch,
                                     sources=sources)
        if cfg.deterministic:
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # cuBLAS needs it for determinism
            torch.use_deterministic_algorithms(True)
        if resized is not None and resume_from is not None:
            line = resized_line(resized, resume_from, cfg.micro, dp)
            if rt.is_main:
                print(f"meshrun train: {line}", flush=True)
        accum = cfg.accumulation(dp)
        self.layout = parallelize(model, cfg, rt, self.choice, accum, self.bf16, weights)
        self.lora_record = lora_record(cfg, self.layout.model, weights, self.model_facts.name)  # (None: no --lora)
        if cfg.lora is not None:  # the frozen base's weights get no gradient: fewer FLOPs a token
            from .lora import counts

            self.flops_per_token = lora_flops_per_token(model, cfg.seq, self.flops_per_token,
                                                        counts(self.layout.model)[0])
        # where the run is; a resume (restore) and the batch fit (fit) return the changes to it
        self.state = TrainState(cfg.micro, accum, schedule=((0, cfg.steps),))
        self.scheduler = build_scheduler(self.layout.optimizer, cfg.warmup_steps, self.state.schedule,
                                         cfg.min_lr_ratio)
        self.snapshots = Snapshots(rt.is_main)  # (with the asynchronous save in flight)
        self.train_data = train_data
        self.loader_spec = LoaderSpec(cfg.micro, self.dp_rank, self.dp_size, cfg.seed, pin_memory=rt.cuda)
        self.train_loader = make_loader(train_data, self.loader_spec)
        self.val_data = val_data
        self.val_loader = self.make_val_loader()
        if not isinstance(train_data, IterableDataset) and len(train_data) < cfg.micro * accum * self.dp_size:
            raise MeshrunError(
                f"the training data has {len(train_data)} samples" + (f" of {cfg.seq} tokens" if cfg.example == "gpt"
                                                                      else "")
                + f": fewer than one global batch of {cfg.micro * accum * self.dp_size} (micro-batch {cfg.micro} "
                f"x {accum} x {self.dp_size} data-parallel ranks) (hint: a smaller --global-batch or "
                "--seq-len, or more data)")

    def make_val_loader(self) -> Any:
        """The validation loader, None without validation data. Its micro-batch is the run's,
        but smaller for a validation set smaller than a micro-batch per rank, and for a model
        that computes its vocabulary-wide logits in eval mode (``val_micro``). A pipeline's
        schedule is cut for the run's micro-batch: it keeps it."""
        cfg, val = self.cfg, self.val_data
        self.val_micro = cfg.micro
        if val is None:
            return None
        if cfg.pp == 1:
            self.val_micro = val_micro(cfg.micro, cfg.seq_len, self.vocab, self.layout.loss_mode)
            if not isinstance(val, IterableDataset):
                self.val_micro = max(1, min(self.val_micro, len(val) // self.dp_size))  # type: ignore[arg-type]
        return make_loader(val, LoaderSpec(self.val_micro, self.dp_rank, self.dp_size, cfg.seed, self.rt.cuda,
                                           shuffle=False))

    @property
    def model(self) -> torch.nn.Module:
        return self.layout.model

    @property
    def optimizer(self) -> Any:
        return self.layout.optimizer

    @property
    def strategy(self) -> str:
        return self.choice.strategy

    @property
    def dp_rank(self) -> int:
        return self.layout.dp_rank

    @property
    def dp_size(self) -> int:
        return self.layout.dp_size

    @property
    def step(self) -> int:
        """Optimizer steps done."""
        return self.state.step

    data_s = 0.0  # host seconds spent reading batches and starting their copies, since the last log line

    # ---- the step -----------------------------------------------------------------------
    def to_device(self, batch: Any) -> Batch:
        """(inputs, targets, document positions or None) on the device, this rank's part."""
        x, y, *positions = (t.to(self.rt.device, non_blocking=True) for t in batch)
        return self.layout.batch(x, y, positions[0] if positions else None)

    def train_step(self, data: Iterator) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """One optimizer step over ``accum`` micro-batches. Returns this rank's mean loss (a
        device tensor: no host sync here), the gradient norm (None when not clipping) and the
        tokens this rank processed."""
        loss_sum = torch.zeros((), device=self.rt.device)
        tokens = 0
        accum = self.state.accum
        t0 = time.perf_counter()
        # chat data trains only the replies: the step's loss is the mean over all of its targets
        # (layouts.target_weights), which needs every micro-batch's count before the first backward
        ahead = [next(data) for _ in range(accum)] if self.data_facts.chat else None
        self.data_s += time.perf_counter() - t0
        weights = None if ahead is None else target_weights([b[1] for b in ahead], self.rt.world_size,
                                                              self.rt.device)
        for micro in range(accum):
            t0 = time.perf_counter()
            x, y, positions = self.to_device(next(data) if ahead is None else ahead[micro])
            self.data_s += time.perf_counter() - t0
            tokens += x.numel() if not x.is_floating_point() else x.shape[0]
            loss_sum += self.layout.micro_step(x, y, last=micro == accum - 1, positions=positions,
                                               weight=None if weights is None else weights[micro])
        norm = self.layout.step(self.step + 1, loss_sum)
        self.scheduler.step()
        self.state = self.state.replace(step=self.step + 1)
        return loss_sum, (norm if self.cfg.grad_clip > 0 else None), tokens

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """The mean validation loss over ``eval_batches`` micro-batches' samples per rank (over
        their targets for chat data). A
        compiled model validates eager: compiling its eval graph at the validation micro-batch
        takes over a minute at the end of a 3B model's run, where validating eager takes
        seconds (docs/decisions.md#liger)."""
        if self.val_loader is None:
            return None
        with eager():
            return self._evaluate(self.val_loader)

    def _evaluate(self, loader: Any) -> float | None:
        self.model.eval()
        total = torch.zeros(2, device=self.rt.device)
        one = torch.ones((), device=self.rt.device)
        # the samples of eval_batches micro-batches, in validation micro-batches (rounded up)
        batches = -(-self.cfg.eval_batches * self.cfg.micro // self.val_micro)
        for i, batch in enumerate(loader):
            if i >= batches:
                break
            # chat data: each micro-batch weighs by its targets (the replies), as in training
            n = batch[1].ne(-100).sum().to(self.rt.device, torch.float32) if self.data_facts.chat else one
            x, y, positions = self.to_device(batch)
            loss = self.layout.eval_loss(x, y, positions)
            if loss is not None:  # (a pipeline's loss is on its last stage only)
                total += torch.stack([torch.where(n > 0, loss.float(), 0.0) * n, n])
        self.model.train()
        dist.all_reduce(total)
        return (total[0] / total[1]).item() if total[1] > 0 else None

    # ---- the loop -----------------------------------------------------------------------
    def describe(self) -> str:
        """The run's first lines: the model, the data, the steps and batch, the strategy, and
        what was chosen for the user and why (report.py)."""
        return report.describe(self)

    def fit(self) -> list[dict[str, Any]]:
        """Train to ``cfg.steps`` optimizer steps, resuming from a snapshot when there is one;
        with --out, snapshot every ``save_every`` steps and at the end. Returns rank 0's log
        records (other ranks: []). A preemption signal (``preempt.install()``) stops every
        rank after the same step, with a snapshot and a log line of that step, and raises
        ``preempt.Preempted``."""
        cfg, rt = self.cfg, self.rt
        stream = self.restore()
        if self.step >= cfg.steps:  # a finished run run again: its files stay as they were
            if rt.is_main:
                print(f"meshrun train: already at step {self.step}"
                      + (f" of {cfg.steps}" if self.step == cfg.steps else f", past --steps {cfg.steps}")
                      + "; nothing to do (hint: pass a larger --steps to train on)", flush=True)
            return []
        data, resized = fit_micro_batch(self, stream)  # (a micro-batch of meshrun's may be halved: batchfit.py)
        if resized is not None:
            self._resize(resized)
        sink = MetricsSink(cfg.out, cfg.steps, enabled=rt.is_main, done=self.step,
                           trackers=trackers.parse(cfg.log_with, cfg.source("log_with")),
                           params=report.params(self) if rt.is_main else None,
                           rate="tok/s" if self.data_facts.tokens else "samples/s")
        if rt.is_main:
            print(self.describe(), flush=True)
        loss_sum = torch.zeros((), device=rt.device)
        tokens, steps, start, paused = 0, 0, time.perf_counter(), 0.0
        vote, stop, saved = preempt.StopVote(rt.device), 0, None
        try:
            first_step = self.step + 1
            for step in range(first_step, cfg.steps + 1):
                loss, norm, n = guarded_step(self, data, step == first_step)  # (out of memory: advice, batchfit.py)
                loss_sum += loss
                tokens, steps = tokens + n, steps + 1
                last = step == cfg.steps
                stop = 0 if last else vote()  # a run at its last step finishes instead
                snapshot = (cfg.save_every and step % cfg.save_every == 0) or last or stop
                log = step % cfg.log_every == 0 or last or stop
                if not (log or snapshot or step % FINITE_CHECK_EVERY == 0):
                    continue
                self.snapshots.check_finite(self.layout, self.step)  # a host sync: the device has done the steps so far
                trained = time.perf_counter() - start - paused
                extra: dict[str, Any] = {}
                if snapshot and self.checkpoint_root:
                    t0 = time.perf_counter()
                    saved = self.save(data, final=last or bool(stop))
                    extra["snapshot_time_s"] = time.perf_counter() - t0
                    paused += extra["snapshot_time_s"]
                if not log:
                    continue
                record = report.record(self, step, loss_sum, steps, tokens, trained, norm)
                if last or (cfg.eval_every and step % cfg.eval_every == 0):
                    t0 = time.perf_counter()
                    record["val_loss"] = self.evaluate()
                    extra["val_time_s"] = time.perf_counter() - t0
                sink.log({**record, "epoch": data.epoch, **extra})
                loss_sum.zero_()
                self.data_s = 0.0
                tokens, steps, start, paused = 0, 0, time.perf_counter(), 0.0
                if stop:
                    raise preempt.Preempted(stop, self.step, saved)  # saved: this step's snapshot
            vote.close()
            sink.close(finished=True)  # (the loss plot written: the closing line names it)
            if rt.is_main:
                print(sink.finished(saved), flush=True)
        finally:
            sink.close()
            if self.checkpoint_root:  # (snapshots, and so prunes, only with --out)
                from . import snapshot

                snapshot.wait_pruned()
        return sink.records

    def _resize(self, resized: Resized) -> None:
        """Train at the smaller micro-batch the batch fit settled on, global batch unchanged."""
        self.cfg, self.loader_spec, self.train_loader = resized.cfg, resized.loader_spec, resized.train_loader
        self.state = self.state.replace(micro_batch=resized.cfg.micro, accum=resized.accum)
        self.layout.set_accum(resized.accum)
        self.val_loader = self.make_val_loader()

    # ---- snapshots (saves.py) -------------------------------------------------------------
    @property
    def checkpoint_root(self) -> str | None:
        return saves.checkpoint_root(self.cfg)

    def restore(self) -> BatchStream:
        """Load the snapshot to resume from, if any, put the state it holds in place, and
        return the data stream positioned where it stopped."""
        seekable = hasattr(self.train_loader.sampler, "set_start")  # else iterable data: skipped to its place
        self.state, scheduler = self.snapshots.restore(self.resume_from, self.checkpoint_names, self.cfg,
                                                       self.layout, self.state, seekable, self.lora_record)
        if scheduler is not None:  # (None: a fresh start, the schedule as built)
            self.scheduler = scheduler
        if self.state.loader_skip:
            self.train_loader = make_loader(self.train_data, self.loader_spec, skip=self.state.loader_skip)
        return BatchStream(self.train_loader, self.cfg.micro, self.dp_size, self.state.epoch, self.state.samples)

    def save(self, data: BatchStream, final: bool = False) -> str | None:
        """Snapshot now; returns its path (committed on return unless it is an asynchronous
        save still in flight, one at a time)."""
        return self.snapshots.save(self.cfg, self.state, data, self.layout, self.model_record, final,
                                   self.lora_record)


def lora_record(cfg: TrainConfig, model: torch.nn.Module, weights: Pretrained | None,
                name: str) -> dict[str, Any] | None:
    """What a LoRA run's snapshots record of its adapters and base model (lorabase.py;
    torch-free, and without torch.distributed.checkpoint's import); None without --lora."""
    if cfg.lora is None:
        return None
    from . import lora
    from .lorabase import base_identity, record
    from .weights import clean_name

    targets = [clean_name(name) for name in lora.adapter_modules(model)]
    return record(lora.spec_of(cfg), targets, base_identity(cfg, weights.files if weights else None, name))
