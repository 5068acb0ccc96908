"""The peer of bench/lora_bench.py: LoRA fine-tuning as the Hugging Face stack does it, with
transformers' ``Trainer`` and PEFT's ``LoraConfig(r, lora_alpha, target_modules="all-linear",
task_type="CAUSAL_LM")`` on a model directory, over rows bench/lora_rows.py wrote.

    python3 bench/lora_peer.py --model DIR --rows ROWS.npz --steps 100 --micro-batch 2 --result R.json
    accelerate launch --num_processes 2 --config_file FSDP.yaml bench/lora_peer.py ...   # several GPUs

One process, or one per GPU under ``accelerate launch`` (FSDP or DDP as its config says). The
model is read in bf16 on GPUs (fp32 on the CPU) with ``--attn`` (default sdpa; given
position ids and no attention mask, transformers builds the document mask from where they
restart), the adapters added by PEFT, and Trainer runs ``--steps`` steps of ``--micro-batch``
rows per process, no accumulation, the rows in the file's order (a sequential sampler; under
``accelerate launch`` process r takes micro-batches r, r + G, ...: step k trains on rows
[k x B, (k + 1) x B) of the global batch B). AdamW (Trainer's default) with betas (0.9,
``--beta2``), no weight decay, the gradient norm clipped at 1, the learning rate constant after
``--warmup`` steps. ``--activation-checkpointing`` turns on Trainer's gradient checkpointing
(non-reentrant); under FSDP, checkpointing is the accelerate config's instead.

A callback times each step (the device synchronised at each step's end) and keeps each step's
loss as Trainer logs it. Process 0 prints one line ``PEER {json}`` and writes it to
``--result``: the tokens/s per process of each step and their median after ``--skip`` steps,
the losses, the peak memory of process 0's device (allocated and reserved), the layout and the
versions."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import time
from typing import Any


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a Hugging Face model directory")
    ap.add_argument("--rows", required=True, help="the .npz of input_ids, labels, position_ids (lora_rows.py)")
    ap.add_argument("--steps", type=int, required=True)
    ap.add_argument("--micro-batch", type=int, required=True, help="rows per process per step")
    ap.add_argument("--lora-r", type=int, default=16)
    ap.add_argument("--lora-alpha", type=float, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=5, help="learning-rate warmup steps")
    ap.add_argument("--beta2", type=float, default=0.95)
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="Trainer's gradient checkpointing (not under FSDP: its config says)")
    ap.add_argument("--attn", default="sdpa", help="attn_implementation (default sdpa)")
    ap.add_argument("--skip", type=int, default=5, help="steps left out of the median tokens/s (default 5)")
    ap.add_argument("--out", default=None, help="Trainer's output_dir (nothing is saved there)")
    ap.add_argument("--result", default=None, help="a file for the PEER line's JSON")
    a = ap.parse_args()

    import numpy as np
    import peft
    import torch
    import transformers
    from torch.utils.data import Dataset, SequentialSampler

    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    cuda = torch.cuda.is_available()

    with np.load(a.rows) as f:
        arrays = {key: torch.from_numpy(f[key]) for key in ("input_ids", "labels", "position_ids")}
    count = a.steps * a.micro_batch * world
    if len(arrays["input_ids"]) < count:
        print(f"lora_peer: {a.rows} holds {len(arrays['input_ids'])} rows, fewer than the {count} of "
              f"{a.steps} steps x {a.micro_batch} x {world} processes", file=sys.stderr)
        return 2

    class Rows(Dataset):
        def __len__(self) -> int:
            return count

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            return {key: value[i] for key, value in arrays.items()}

    dtype = torch.bfloat16 if cuda else torch.float32
    transformers.set_seed(0)  # PEFT draws lora_A before Trainer seeds anything
    model: Any = transformers.AutoModelForCausalLM.from_pretrained(a.model, dtype=dtype, attn_implementation=a.attn)
    # no KV cache in training: with one, transformers builds no document mask from position ids
    model.config.use_cache = False
    lora = peft.LoraConfig(r=a.lora_r, lora_alpha=a.lora_alpha, target_modules="all-linear", lora_dropout=0.0,
                           task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, lora)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)

    fields = {f.name for f in dataclasses.fields(transformers.TrainingArguments)}
    # transformers renamed gradient_checkpointing to activation_checkpointing (the old name an alias)
    ac_name = "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing"
    ac: dict[str, Any] = {}
    if a.activation_checkpointing:
        ac = {ac_name: True, f"{ac_name}_kwargs": {"use_reentrant": False}}
    args = transformers.TrainingArguments(
        output_dir=a.out or os.path.join(os.path.dirname(os.path.abspath(a.rows)), "peer-trainer"),
        max_steps=a.steps, per_device_train_batch_size=a.micro_batch, gradient_accumulation_steps=1,
        learning_rate=a.lr, lr_scheduler_type="constant_with_warmup", warmup_steps=a.warmup, weight_decay=0.0,
        adam_beta2=a.beta2, max_grad_norm=1.0, bf16=cuda, logging_strategy="steps", logging_steps=1,
        save_strategy="no", report_to="none", disable_tqdm=True, remove_unused_columns=False,
        label_names=["labels"], dataloader_num_workers=0, seed=0, use_cpu=not cuda,
        ddp_find_unused_parameters=False, **ac)

    class Timer(transformers.TrainerCallback):
        """Each step's wall time (from the previous step's end, the device synchronised) and loss."""

        def __init__(self) -> None:
            self.ends: list[float] = []
            self.losses: list[float] = []
            self.grad_norms: list[float] = []

        def _now(self) -> float:
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter()

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.ends = [self._now()]

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.ends.append(self._now())

        def on_log(self, args: Any, state: Any, control: Any, logs: Any = None, **kw: Any) -> None:
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))
                if logs.get("grad_norm") is not None:
                    self.grad_norms.append(float(logs["grad_norm"]))

    class InOrder(transformers.Trainer):
        """Trainer reading the rows in the file's order (meshrun's, lora_rows.py)."""

        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> SequentialSampler:
            return SequentialSampler(self.train_dataset)  # type: ignore[arg-type]

    timer = Timer()
    trainer = InOrder(model=model, args=args, train_dataset=Rows(), data_collator=transformers.default_data_collator,
                      callbacks=[timer])
    # what accelerate made of its config (on the CPU it runs an FSDP config as MULTI_CPU: DDP on gloo)
    fsdp = bool(trainer.is_fsdp_enabled)
    plugin = trainer.accelerator.state.fsdp_plugin if fsdp else None
    fsdp_ac = bool(plugin is not None and plugin.activation_checkpointing)
    if fsdp and a.activation_checkpointing:
        print("lora_peer: --activation-checkpointing under FSDP: set fsdp_activation_checkpointing in the "
              "accelerate config instead", file=sys.stderr)
        return 2
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - t0
    if rank != 0:
        return 0
    seq = arrays["input_ids"].shape[1]
    per_step = [a.micro_batch * seq / (end - start) for start, end in zip(timer.ends, timer.ends[1:])]
    timed = per_step[a.skip:] or per_step[-1:]
    layout = f"fsdp{getattr(plugin, 'fsdp_version', 1)}" if fsdp else ("ddp" if world > 1 else "single")
    sharded = sum(_is_fsdp(m) for m in trainer.model_wrapped.modules()) if fsdp else None
    result = {
        "who": "peer", "processes": world, "layout": layout,
        "distributed_type": str(trainer.accelerator.distributed_type).split(".")[-1], "attn": a.attn,
        "dtype": str(dtype).split(".")[-1],
        "activation_checkpointing": "fsdp" if fsdp_ac else ("trainer" if a.activation_checkpointing else None),
        "fsdp_units": sharded, "micro_batch": a.micro_batch, "seq": seq, "steps": a.steps,
        "trainable_params": trainable,
        "tokens_per_s_per_process": round(statistics.median(timed)) if timed else None,
        "step_tokens_per_s": [round(x) for x in per_step], "skipped": a.skip,
        "losses": timer.losses, "grad_norms": timer.grad_norms, "train_wall_s": round(wall, 1),
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if cuda else None,
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__,
                     "peft": peft.__version__, **_accelerate_version()},
    }
    line = json.dumps(result)
    print("PEER " + line, flush=True)
    if a.result:
        with open(a.result, "w") as f:
            f.write(line + "\n")
    return 0


def _is_fsdp(module: Any) -> bool:
    """Whether ``module`` is a unit FSDP2 (``fully_shard``) or FSDP1 wraps."""
    from torch.distributed.fsdp import FSDPModule, FullyShardedDataParallel

    return isinstance(module, (FSDPModule, FullyShardedDataParallel))


def _accelerate_version() -> dict[str, str]:
    try:
        import accelerate
    except ImportError:
        return {}
    return {"accelerate": accelerate.__version__}


if __name__ == "__main__":
    sys.exit(main())
