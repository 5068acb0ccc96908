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

from ..errors import MeshrunError
from ..modelinfo.hf import export_record
from ..modelinfo.read import context_of
from . import checkpoint, preempt
from .batchfit import fit_micro_batch, oom_line
from .checkpoint import Position
from .config import TrainConfig, resolve_seq_len, validate
from .data import BatchStream, LoaderSpec, make_loader, val_micro
from .factories import vocab_size
from .kernels.liger import liger_applies
from .metrics import MetricsSink, ReadCost, flops_per_token, mfu, peak_flops, read_cost_line
from .optim import Schedule, build_scheduler, extend_schedule, lr_factor
from .outdir import RUN_ID_ENV
from .parallel.apply import parallelize
from .parallel.auto import Choice, decide
from .parallel.dims import make_dims
from .parallel.layouts import Batch
from .resize import keep_global_batch, resized_line
from .runtime import Runtime, init_runtime
from .weights import Pretrained

# A non-finite step is found at the next log line or snapshot, and at least this often: one
# host sync per 50 steps costs nothing measurable, and a run with rare log lines stops soon.
FINITE_CHECK_EVERY = 50


class Trainer:
    def __init__(self, model: torch.nn.Module, train_data: Dataset, val_data: Dataset | None = None,
                 config: TrainConfig | None = None, runtime: Runtime | None = None,
                 weights: Pretrained | None = None) -> None:
        """``model`` may have its parameters on the meta device (a Hugging Face model built from
        its config): it is then filled once laid out, from ``weights`` or a random initialisation."""
        cfg = validate(config or TrainConfig())
        if runtime is None:
            from .runtime import teardown_at_exit

            runtime = init_runtime()
            teardown_at_exit()  # this Trainer made the process group: it also ends it cleanly
        self.rt = rt = runtime
        self.bf16 = cfg.precision == "bf16" or (cfg.precision == "auto" and rt.cuda and torch.cuda.is_bf16_supported())
        if cfg.precision == "bf16" and not rt.cuda:
            raise MeshrunError("--precision='bf16': this run is on CPU, where meshrun trains in fp32 "
                               "(hint: use --precision auto or fp32)")
        cfg = resolve_seq_len(cfg, context_of(model))
        self.flops_per_token = flops_per_token(model, cfg.seq)
        self.model_record = export_record(model, cfg.model)  # for `meshrun export --format hf`
        self.n_params = sum(p.numel() for p in model.parameters())
        self.vocab = vocab_size(model)
        dp = make_dims(rt.world_size, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp,
                       source=f"--tp {cfg.tp} --pp {cfg.pp} --cp {cfg.cp} on {rt.world_size} processes").dp
        self.cfg = cfg  # (resume_path reads it)
        resume_from = self.resume_path()
        cfg, resized = keep_global_batch(cfg, resume_from, dp)
        gpu_mem = torch.cuda.get_device_properties(rt.device).total_memory if rt.cuda else None
        liger = cfg.kernels == "auto" and rt.cuda and liger_applies(model, rt.device, cfg.tp, cfg.pp)
        self.choice: Choice = decide(model, cfg, rt.world_size, rt.local_world_size, dp, gpu_mem, self.bf16, liger)
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
        self.accum = cfg.accumulation(dp)
        self.layout = parallelize(model, cfg, rt, self.choice, self.accum, self.bf16, weights)
        self.schedule: Schedule = ((0, cfg.steps),)  # a resume may add pieces (restore)
        self.scheduler = build_scheduler(self.layout.optimizer, cfg.warmup_steps, self.schedule, cfg.min_lr_ratio)
        self.train_data = train_data
        self.loader_spec = LoaderSpec(cfg.micro, self.dp_rank, self.dp_size, cfg.seed, pin_memory=rt.cuda)
        self.train_loader = make_loader(train_data, self.loader_spec)
        self.val_data = val_data
        self.val_loader = self.make_val_loader()
        if not isinstance(train_data, IterableDataset) and len(train_data) < cfg.micro * self.accum * self.dp_size:
            raise MeshrunError(
                f"the training data has {len(train_data)} samples" + (f" of {cfg.seq} tokens" if cfg.example == "gpt"
                                                                      else "")
                + f": fewer than one global batch of {cfg.micro * self.accum * self.dp_size} (micro-batch {cfg.micro} "
                f"x {self.accum} x {self.dp_size} data-parallel ranks) (hint: a smaller --global-batch or "
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

    step = 0  # optimizer steps done
    loader_skip = 0  # iterable data: samples per rank the loader skips (a resume's position)
    data_s = 0.0  # host seconds spent reading batches and starting their copies, since the last log line

    # ---- the step -----------------------------------------------------------------------
    def _to_device(self, batch: Any) -> Batch:
        """(inputs, targets, document positions or None) on the device, this rank's part."""
        x, y, *positions = (t.to(self.rt.device, non_blocking=True) for t in batch)
        return self.layout.batch(x, y, positions[0] if positions else None)

    def train_step(self, data: Iterator) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """One optimizer step over ``accum`` micro-batches. Returns this rank's mean loss (a
        device tensor: no host sync here), the gradient norm (None when not clipping) and the
        tokens this rank processed."""
        loss_sum = torch.zeros((), device=self.rt.device)
        tokens = 0
        for micro in range(self.accum):
            t0 = time.perf_counter()
            x, y, positions = self._to_device(next(data))
            self.data_s += time.perf_counter() - t0
            tokens += x.numel() if not x.is_floating_point() else x.shape[0]
            loss_sum += self.layout.micro_step(x, y, last=micro == self.accum - 1, positions=positions)
        norm = self.layout.step(self.step + 1, loss_sum)
        self.scheduler.step()
        self.step += 1
        return loss_sum, (norm if self.cfg.grad_clip > 0 else None), tokens

    def _guarded_step(self, data: Iterator, first: bool) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """A step; out of memory on the run's first step becomes advice, not a traceback."""
        try:
            return self.train_step(data)
        except torch.cuda.OutOfMemoryError:
            if not first:
                raise
            raise MeshrunError(oom_line(self.cfg.micro, self.strategy, self.rt.device, self.choice.predicted_peak,
                                        self.choice.largest_micro, "at the first step")) from None

    @torch.no_grad()
    def evaluate(self) -> float | None:
        """The mean validation loss over ``eval_batches`` micro-batches' samples per rank."""
        if self.val_loader is None:
            return None
        self.model.eval()
        total = torch.zeros(2, device=self.rt.device)
        one = torch.ones((), device=self.rt.device)
        batches = -(-self.cfg.eval_batches * self.cfg.micro // self.val_micro)  # the samples of eval_batches micro-batches
        for i, batch in enumerate(self.val_loader):
            if i >= batches:
                break
            x, y, positions = self._to_device(batch)
            loss = self.layout.eval_loss(x, y, positions)
            if loss is not None:  # (a pipeline's loss is on its last stage only)
                total += torch.stack([loss.float(), one])
        self.model.train()
        dist.all_reduce(total)
        return (total[0] / total[1]).item() if total[1] > 0 else None

    # ---- the loop -----------------------------------------------------------------------
    def describe(self) -> str:
        """The run's first line: what runs, and what was chosen for the user and why."""
        cfg, rt = self.cfg, self.rt
        batch = cfg.micro * self.accum * self.dp_size
        line = (f"meshrun train: strategy {self.layout.description}, {rt.world_size} process(es), "
                f"{self.n_params / 1e6:.2f}M parameters, global batch {cfg.micro} x {self.accum} x {self.dp_size} = "
                f"{batch}" + (f" of {cfg.seq} tokens" if self.flops_per_token else "")
                + f", {'bf16' if self.bf16 else 'fp32'}")
        return line + "".join(f"\n  {reason}" for reason in self.choice.reasons)

    def _record(self, step: int, loss_sum: torch.Tensor, steps: int, tokens: int, elapsed: float,
                norm: torch.Tensor | None) -> dict[str, Any]:
        """One log line's metrics over the last ``steps`` steps, ``elapsed`` seconds of training
        (snapshots and validation not counted). The loss is the mean over the whole global
        batch from every rank: one all-reduce per log line, not per step."""
        rt = self.rt
        dist.all_reduce(loss_sum)
        per_gpu = tokens / elapsed / self.layout.token_share
        return {
            "step": step,
            "loss": loss_sum.item() / (self.layout.loss_ranks * steps),
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": None if norm is None else float(norm.full_tensor() if hasattr(norm, "full_tensor") else norm),
            "step_time_s": elapsed / steps,
            # the loader's share: while the device computes, the host reads ahead; this is what it took
            "data_time_s": self.data_s / steps,
            "tokens_per_s": per_gpu * rt.world_size,
            "tokens_per_s_per_gpu": per_gpu,
            "mfu": mfu(per_gpu, self.flops_per_token, peak_flops(rt.device)),
            "peak_mem_bytes": torch.cuda.max_memory_allocated(rt.device) if rt.cuda else None,
            # what the allocator holds: what nvidia-smi shows and what runs out
            "peak_reserved_bytes": torch.cuda.max_memory_reserved(rt.device) if rt.cuda else None,
        }

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
        data = fit_micro_batch(self, stream)  # (a micro-batch of meshrun's may be halved: batchfit.py)
        sink = MetricsSink(cfg.out, cfg.steps, enabled=rt.is_main)
        if rt.is_main:
            print(self.describe(), flush=True)
        loss_sum = torch.zeros((), device=rt.device)
        tokens, steps, start, paused = 0, 0, time.perf_counter(), 0.0
        vote, stop, saved = preempt.StopVote(rt.device), 0, None
        try:
            first_step = self.step + 1
            for step in range(first_step, cfg.steps + 1):
                loss, norm, n = self._guarded_step(data, step == first_step)
                loss_sum += loss
                tokens, steps = tokens + n, steps + 1
                last = step == cfg.steps
                stop = 0 if last else vote()  # a run at its last step finishes instead
                snapshot = (cfg.save_every and step % cfg.save_every == 0) or last or stop
                log = step % cfg.log_every == 0 or last or stop
                if not (log or snapshot or step % FINITE_CHECK_EVERY == 0):
                    continue
                self._check_finite()  # a host sync: the device has done the steps so far
                trained = time.perf_counter() - start - paused
                extra: dict[str, Any] = {}
                if snapshot and self.checkpoint_root:
                    t0 = time.perf_counter()
                    saved = self.save(data, final=last or bool(stop))
                    extra["snapshot_time_s"] = time.perf_counter() - t0
                    paused += extra["snapshot_time_s"]
                if not log:
                    continue
                record = self._record(step, loss_sum, steps, tokens, trained, norm)
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
        finally:
            sink.close()
            checkpoint.wait_pruned()
        return sink.records

    # ---- snapshots ----------------------------------------------------------------------
    @property
    def checkpoint_root(self) -> str | None:
        return os.path.join(self.cfg.out, "checkpoints") if self.cfg.out else None

    def resume_path(self) -> str | None:
        """The snapshot to start from: --resume PATH, or the newest committed one under
        --out (``auto``), or none."""
        cfg, root = self.cfg, self.checkpoint_root
        if cfg.resume == "none":
            return None
        if cfg.resume != "auto":
            if os.path.isfile(os.path.join(cfg.resume, checkpoint.MARKER)):
                checkpoint.check_name(cfg.resume)
                return cfg.resume
            found = checkpoint.latest(cfg.resume) if os.path.isdir(cfg.resume) else None
            if found is None:
                raise MeshrunError(f"--resume={cfg.resume!r}: not a committed snapshot nor a directory of them "
                                   "(hint: give OUT/checkpoints/step-N, or --resume none)")
            return found
        return checkpoint.latest(root) if root else None

    def restore(self) -> BatchStream:
        """Load the snapshot to resume from, if any, and return the data stream positioned
        where it stopped."""
        rt, path = self.rt, self.resume_path()
        if self.checkpoint_root and rt.is_main:
            checkpoint.clear_partial(self.checkpoint_root)  # a save killed halfway
        dist.barrier()
        position = Position()
        if path:
            cost = ReadCost()
            position, saved_world = checkpoint.load(path, self.model, self.optimizer, self.layout.local_shards(),
                                                      self.layout.ties())
            # Each rank's cost, for the line below: each reads its own shards (and hashes a
            # share of the files), so a rank far above the others shows a slow disk or a rank
            # that read more than its share.
            costs: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(costs, cost.took())
            self.step = position.step
            if rt.is_main:
                print(f"meshrun train: resumed from {path} at step {position.step} (epoch {position.epoch}, "
                      f"{position.samples} samples into it; saved on {saved_world} rank(s); read in "
                      f"{read_cost_line(costs)})", flush=True)
            self._place_schedule(position)
        if position.samples and not hasattr(self.train_loader.sampler, "set_start"):  # iterable data
            self.loader_skip = position.samples // self.dp_size
            self.train_loader = make_loader(self.train_data, self.loader_spec, skip=self.loader_skip)
            position = Position(position.step, position.epoch, 0)
        return BatchStream(self.train_loader, self.cfg.micro, self.dp_size, position.epoch, position.samples)

    def _place_schedule(self, position: Position) -> None:
        """The learning rate at a resumed step: a pure function of the step and of the
        schedule the snapshot records; a --steps that differs from where that schedule ends
        adds a piece that goes on from the current rate (optim.lr_factor), said in one line."""
        cfg = self.cfg
        saved = position.schedule or ((0, cfg.steps),)
        self.schedule = extend_schedule(saved, position.step, cfg.steps, cfg.warmup_steps)
        if self.schedule != saved and position.step < cfg.steps and self.rt.is_main:
            lr, floor = (cfg.lr * lr_factor(position.step, cfg.warmup_steps, self.schedule, cfg.min_lr_ratio),
                         cfg.lr * cfg.min_lr_ratio)
            goes = (f"stays at its floor {floor:.3g} through step {cfg.steps}" if lr <= floor * (1 + 1e-6) else
                    f"goes on from {lr:.3g} and decays to {floor:.3g} at step {cfg.steps}")
            print(f"meshrun train: --steps {cfg.steps} changes the learning-rate schedule, which ended at step "
                  f"{saved[-1][1]}: from step {position.step} the rate {goes}, never back up "
                  "(docs/decisions.md#lr-schedule-resume)", flush=True)
        self.scheduler = build_scheduler(self.layout.optimizer, cfg.warmup_steps, self.schedule, cfg.min_lr_ratio,
                                         position.step)

    def _check_finite(self) -> None:
        """Stop at a non-finite step (the layout's check); a snapshot still in flight holds
        the last good step and is committed first, so the run resumes from it."""
        try:
            self.layout.check_finite(self.step)
        except MeshrunError:
            if self._pending is not None:
                pending, self._pending = self._pending, None
                checkpoint.commit(pending)
            raise

    _pending: checkpoint.PendingSave | None = None
    _async_group: Any = None

    def save(self, data: BatchStream, final: bool = False) -> str | None:
        """Snapshot now; returns its path (committed on return unless it is an asynchronous
        save still in flight). Asynchronous saves commit the previous snapshot first (one in
        flight at a time, so two never interleave), and the last one before returning."""
        root = self.checkpoint_root
        if root is None:
            return None
        if self._pending is not None:
            previous = self._pending
            apart = time.perf_counter() - previous.started  # training time between the two saves
            checkpoint.commit(previous)
            self._pending = None
            advice = checkpoint.slow_writer_advice(previous.wait_s, previous.written - previous.started, apart,
                                                   self.cfg.save_every)
            if advice and self.rt.is_main:
                print(advice, flush=True)
        group = None
        if self.cfg.async_save and not final:
            if self._async_group is None:  # the background writer coordinates over gloo
                self._async_group = dist.new_group(backend="gloo")
            group = self._async_group
        pending = checkpoint.begin_save(root, Position(self.step, data.epoch, data.samples, self.schedule), self.model,
                                        self.optimizer, self.cfg.to_json(), self.cfg.keep_last, group,
                                        self.layout.local_shards(), self.model_record,
                                        run_id=os.environ.get(RUN_ID_ENV))
        if group is None:
            return checkpoint.commit(pending)
        self._pending = pending
        return pending.final
