"""`meshrun train`: its options, parsed into a TrainConfig, a topology and JobOptions for train/job.py."""

from __future__ import annotations

import argparse
from collections.abc import Mapping

from ..cluster.gpus import count_visible_gpus
from ..defaults import GLOBAL_BATCH_TOKENS
from ..errors import MeshrunError
from ..train.config import EXAMPLES, STRATEGY_CHOICES, TrainConfig, build_config, load_file
from ..train.job import JobOptions, require_trainer_packages, run
from ..vocab import AC_MODES, GPT_PRESETS, PRECISIONS, STRATEGIES
from .options import (
    add_finish_timeout_option,
    add_option,
    add_rdzv_timeout_option,
    add_topology_options,
    int_option,
    topology_from_args,
)

_STRATEGY_LINES = "".join(f"  {name:<14s}  {kind.about}\n" for name, kind in STRATEGIES.items())

TRAIN_HELP = f"""\
Train with meshrun's PyTorch trainer, launched on the topology meshrun detects (all GPUs
here, or 2 CPU processes when there is none; on a cluster, run it on every node).

With no arguments: a small GPT-style byte-level decoder trained on the source of this
Python's standard library (nothing to download), with a held-out validation split.

A Hugging Face model (--model DIR or its config.json: any causal LM transformers builds) is
built on the meta device and filled after it is sharded: each rank reads only its slices of
the directory's safetensors files, or draws a random initialisation that is the same under
every layout (--init). Its decoder layers are the blocks every strategy shards, checkpoints
and compiles; on GPUs Liger Kernel's fused kernels run when it is installed (the liger extra).
`meshrun export SNAPSHOT --to DIR` writes a trained one back as save_pretrained does.

strategies (--strategy; the names meshrun plan uses):
  auto            (the default) on GPUs, the planner's pick among single, ddp and the FSDP2
                  flavours: the fastest whose predicted memory fits, with activation
                  checkpointing on when it is needed to fit (unless you set it); single for
                  one process and ddp on the CPU
  fsdp            FSDP2: fsdp-grad-op when a bf16 copy of the parameters is small, else fsdp-full
{_STRATEGY_LINES}\
They compose with --tp/--pp/--cp (an FSDP2 strategy) and --ep (ddp or FSDP2), applied in this
order: tensor parallel -> context parallel -> activation checkpointing -> compile -> FSDP2/DDP.

defaults meshrun chooses (the run's first lines say what it chose and why):
  --seq-len       the model's context (gpt-124m, gpt-1.3b: 1024; gpt-small: 256), at most 4096
  --compile       auto: compiled on GPUs, eager on the CPU and for a Hugging Face model that
                  Liger Kernel patches (its kernels run eager: compiling adds nothing to them)
  batch sizes     on GPUs with none given: a global batch of about {GLOBAL_BATCH_TOKENS // 1024}K tokens and the
                  largest micro-batch that fits (the planner's); --global-batch alone: the
                  planner sizes the micro-batch; on the CPU: micro-batch 8, no accumulation
  global batch = micro-batch x accumulation x data-parallel size; one that does not split is
  refused with the nearest valid sizes

one run per --out: a second meshrun train on the same directory is refused while the first
runs (OUT/.meshrun.lock). Each run has an id (OUT/run.json, and in every snapshot): a
resume continues only a snapshot of OUT's run, --no-resume is refused where OUT holds
snapshots (--overwrite moves them aside first), and a resume on another number of processes
keeps the snapshot's global batch by changing the gradient accumulation.

when something fails: each rank's whole output is in OUT/logs/rank-N.log (torchrun's in
OUT/logs/torchrun-node-N.log; without --out, in a directory the error line names), and a rank
that raises or dies ends the job with one line: the rank, the cause, its log and a hint (exit
code 1). A micro-batch meshrun chose that runs out of GPU memory is halved before training,
with the accumulation doubled so the global batch stays; a model nothing fits is refused.

preemption: SIGTERM or SIGUSR1 (Slurm's --signal, scontrol requeue, Kubernetes, SkyPilot) stops
every rank after the same step; with --out that step's snapshot is written, and meshrun train
exits with code 75. The same command resumes it (meshrun render slurm --requeue requeues on 75).

examples:
  meshrun train                                    # the default job
  meshrun train --steps 50 --out runs/a            # metrics.jsonl, TensorBoard, loss.png in runs/a
  meshrun train --model-size gpt-124m --data random   # on GPUs: compiled, batch sized for you
  meshrun train --example toy                      # pytorch/examples' Linear(20 -> 1)
  meshrun train --model-size gpt-1.3b --strategy fsdp-full --activation-checkpointing full
  meshrun train --model mypkg.models:build --data mypkg.data:train_set --global-batch 256
  meshrun train --model ~/models/Llama-3.2-1B --data random --out runs/llama   # its weights, sharded in
  meshrun export runs/llama/checkpoints --to llama-trained   # a directory from_pretrained loads
  meshrun train --config train.yaml --lr 3e-4      # flags override the file's keys
"""


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train with meshrun's trainer (a small GPT on stdlib text by default)",
                       description=TRAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("what to train")
    add_option(g, "--config", metavar="FILE", help="YAML or TOML with the same keys as these flags")
    add_option(g, "--example", choices=EXAMPLES, default=None, help="built-in job: gpt (default) or toy")
    add_option(g, "--model", metavar="DIR|CONFIG|MODULE:FACTORY", default=None,
               help="a Hugging Face model directory (save_pretrained's: config.json, *.safetensors) or config.json "
                    "(any causal LM transformers knows; local paths only, nothing is downloaded), or your nn.Module "
                    "factory")
    add_option(g, "--init", metavar="auto|pretrained|random", default=None,
               help="a Hugging Face model's weights: auto (default: the directory's *.safetensors when it has "
                    "them, else a random initialisation), pretrained, random")
    add_option(g, "--data", metavar="PATH|NAME|MODULE:FACTORY", default=None,
               help="a corpus: a directory meshrun data prepare wrote, token files (nanoGPT's train.bin/val.bin, "
                    "or a folder of .bin), or text (.txt, .jsonl, .parquet, a folder of them, a saved dataset: "
                    "tokenized once into a cache); or stdlib (default for gpt), random (tokens), toy, or your "
                    "Dataset factory (or (train, val))")
    add_option(g, "--tokenizer", metavar="DIR|FILE|NAME", default=None,
               help="text data: a tokenizer directory, tokenizer.json or tiktoken encoding (default: the "
                    "Hugging Face model directory's)")
    add_option(g, "--text-field", metavar="NAME", default=None, help="text data: the field of .jsonl, .parquet and "
               "saved datasets (default text)")
    add_option(g, "--data-dtype", metavar="uint16|uint32", default=None,
               help="flat token files: the token type (default uint16, nanoGPT's)")
    add_option(g, "--document-mask", action="store_const", const=True, default=None,
               help="attend and predict within documents: position ids restart at each document and a target "
                    "across a document's end is ignored (a prepared corpus or text; default: sequences cut "
                    "across documents)")
    add_option(g, "--model-size", metavar="PRESET", default=None, help=f"GPT preset: {', '.join(GPT_PRESETS)} "
               "(default gpt-small)")
    add_option(g, "--blocks", metavar="ATTR.PATH", default=None,
               help="the model's block list, when meshrun does not find it (e.g. model.layers)")
    g = p.add_argument_group("how")
    add_option(g, "--strategy", metavar="S", default=None, help=f"{', '.join(STRATEGY_CHOICES)} (default auto; "
               "see above)")
    add_option(g, "--fsdp-shard-size", type=int, metavar="N", default=None,
               help="fsdp-hybrid: ranks per shard group (default: processes per node)")
    add_option(g, "--tp", type=int, metavar="N", default=None,
               help="tensor-parallel degree (DTensor, Megatron-style); FSDP2 shards over the remaining ranks")
    add_option(g, "--sequence-parallel", metavar="on|off", choices=("on", "off"), default=None,
               help="with --tp: keep the residual stream sharded along the sequence between the "
                    "tensor-parallel layers (meshrun's GPT and Llama-style blocks, without --pp; default on)")
    add_option(g, "--pp", type=int, metavar="N", default=None,
               help="pipeline stages (torch.distributed.pipelining; meshrun's GPT and Hugging Face models of the "
                    "Llama, Mistral, Mixtral and Qwen2/3 families)")
    add_option(g, "--pp-schedule", metavar="S", default=None, help="1f1b (default), gpipe, interleaved")
    add_option(g, "--pp-microbatches", type=int, metavar="N", default=None,
               help="pieces each micro-batch is cut into for the pipeline (default: --pp)")
    add_option(g, "--experts", type=int, metavar="E", default=None,
               help="built-in GPT: a mixture of E experts (top-2, dropless) in every block")
    add_option(g, "--ep", type=int, metavar="N", default=None,
               help="expert parallel: experts sharded over N ranks, tokens exchanged by all-to-all; the rest "
                    "replicated, or sharded by FSDP2 with an FSDP2 --strategy")
    add_option(g, "--cp", type=int, metavar="N", default=None,
               help="context parallel: each sequence sharded over N ranks (zig-zag, all-gathered K/V; "
                    "meshrun's GPT and Hugging Face models with causal SDPA attention)")
    add_option(g, "--precision", metavar="P", default=None, help=f"auto, {', '.join(PRECISIONS)} (default auto: bf16 "
               "on GPUs that have it)")
    add_option(g, "--compile", metavar="auto|on|off", nargs="?", const="on", default=None,
               help="torch.compile (per block under FSDP2): auto (default: on GPUs, but not with Liger's kernels), on "
                    "(a Hugging Face model then gets torch.compile's kernels, not Liger's), off; --compile alone: on")
    add_option(g, "--compile-tune", action="store_const", const=True, default=None,
               help="Inductor's coordinate-descent tuning of the compiled kernels: a step up to 2%% faster "
                    "(H200: GPT 124M +1.0-1.9%%, 1.3B +0.3-0.7%%) for ~4 minutes more compiling; for runs of hours")
    add_option(g, "--activation-checkpointing", metavar="MODE", default=None, help=f"{', '.join(AC_MODES)}")
    add_option(g, "--ddp-bucket-mb", type=int, metavar="MB", default=None,
               help="DDP gradient bucket size (default: 1000 compiled on one host, else 100)")
    add_option(g, "--reduce-precision", metavar="P", default=None,
               help="gradient reduction across ranks: fp32 (default) or bf16 (half the bytes, less exact)")
    add_option(g, "--fused-loss", action="store_const", const=True, default=None,
               help="built-in GPT: the loss chunk by chunk, never holding all logits (for long sequences)")
    add_option(g, "--kernels", metavar="K", default=None,
               help="built-in GPT on GPUs: auto (default: the loss with its gradient in the forward, by Triton; "
                    "the MLP's GELU in cuBLASLt's epilogues where nvmath-python is installed; together "
                    "+6%% at 124M on H200s) or plain (torch's modules only)")
    add_option(g, "--attention", metavar="K", default=None,
               help="attention kernel SDPA tries first: auto (torch's order), cudnn, flash, efficient, math "
                    "(the others stay as fallbacks)")
    g = p.add_argument_group("schedule")
    add_option(g, "--steps", type=int, metavar="N", default=None, help="optimizer steps (default 200)")
    add_option(g, "--micro-batch", type=int, metavar="B", default=None,
               help="samples per process per micro-step (default: the largest that fits on GPUs; 8 on the CPU)")
    add_option(g, "--global-batch", type=int, metavar="B", default=None,
               help=f"samples per optimizer step, all ranks (default on GPUs: about {GLOBAL_BATCH_TOKENS // 1024}K "
                    "tokens' worth)")
    add_option(g, "--seq-len", type=int, metavar="T", default=None,
               help="tokens per sample (default: the model's context, at most 4096)")
    add_option(g, "--lr", type=float, metavar="LR", default=None, help="peak learning rate (default 1e-3)")
    add_option(g, "--warmup", type=int, metavar="N", default=None, help="warmup steps (default 10%% of steps, <= 100)")
    add_option(g, "--min-lr-ratio", type=float, metavar="R", default=None, help="final lr / peak lr (default 0.1)")
    add_option(g, "--weight-decay", type=float, metavar="W", default=None, help="AdamW weight decay (default 0.1)")
    add_option(g, "--grad-clip", type=float, metavar="C", default=None, help="global gradient norm clip (0: off)")
    add_option(g, "--seed", type=int, metavar="S", default=None, help="seed for weights and data order")
    g = p.add_argument_group("metrics")
    add_option(g, "--out", metavar="DIR", default=None, help="write metrics.jsonl, TensorBoard events, loss.png")
    add_option(g, "--log-every", type=int, metavar="N", default=None, help="steps between log lines (default 10)")
    add_option(g, "--eval-every", type=int, metavar="N", default=None, help="steps between validations (0: at the end)")
    add_option(g, "--eval-batches", type=int, metavar="N", default=None, help="validation micro-batches per rank")
    g = p.add_argument_group("snapshots and restarts (with --out)")
    add_option(g, "--save-every", type=int, metavar="N", default=None,
               help="snapshot every N steps and at the end (default 100; 0: only at the end)")
    add_option(g, "--keep-last", type=int, metavar="K", default=None,
               help="committed snapshots kept (default 3; 0: all)")
    add_option(g, "--resume", metavar="auto|none|PATH", default=None,
               help="auto (default): continue from the newest snapshot in OUT/checkpoints; none; or a snapshot")
    add_option(g, "--no-resume", action="store_const", const="none", dest="resume", from_env=False,
               help="start a new run instead of resuming; refused where OUT holds snapshots (see --overwrite)")
    add_option(g, "--overwrite", action="store_true", from_env=False,
               help="start a new run in OUT, first moving the earlier run's checkpoints/, metrics.jsonl, "
                    "loss.png, tensorboard/ and run.json into OUT/previous-<UTC time>/ (nothing is deleted; "
                    "implies --no-resume). Not for job scripts that requeue: each start would set aside the "
                    "progress so far")
    add_rdzv_timeout_option(g)
    add_finish_timeout_option(g)
    add_option(g, "--collective-timeout", type=int, metavar="S", default=None,
               help=f"seconds a collective waits for a rank that does not answer (stopped, hung); then the job ends "
                    f"in one line naming that rank, its last snapshot kept (default {TrainConfig.collective_timeout})")
    add_option(g, "--max-restarts", type=int, metavar="N", default=0,
               help="after a crash, start the job again (a fresh rendezvous) up to N times; it resumes "
                    "(a preempted job, exit 75, is not restarted)")
    add_option(g, "--async-save", action="store_const", const=True, default=None,
               help="write snapshots in the background while training continues (one in flight)")
    add_option(g, "--deterministic", action="store_const", const=True, default=None,
               help="deterministic kernels: reruns and resumes reproduce the loss bit for bit")
    g = p.add_argument_group("output")
    add_option(g, "--dry-run", action="store_true", help="print the launch command; run nothing")
    add_option(g, "--json", action="store_true", help="with --dry-run: one JSON object")
    add_topology_options(p)
    p.set_defaults(func=cmd_train)



TRAIN_KEYS = [f for f in TrainConfig.__dataclass_fields__ if f != "sources"]


def config_from_args(ns: argparse.Namespace) -> TrainConfig:
    file_values = load_file(ns.config) if ns.config else {}
    flags = {k: getattr(ns, k, None) for k in TRAIN_KEYS}
    env_sources = {k: v for k, v in getattr(ns, "_env_sources", {}).items() if k in TRAIN_KEYS}
    return build_config(file_values, flags, ns.config, env_sources)


def job_from_args(ns: argparse.Namespace) -> JobOptions:
    return JobOptions(max_restarts=ns.max_restarts, overwrite=ns.overwrite, dry_run=ns.dry_run, json=ns.json,
                      rdzv_timeout=ns.rdzv_timeout, finish_timeout=int_option(ns, "finish_timeout", minimum=1))


def cmd_train(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    """Parse, then run the job as `meshrun.train(...)` does (train/job.py)."""
    require_trainer_packages()
    cfg = config_from_args(ns)
    topo, elastic = topology_from_args(ns, env, count_visible_gpus(env))
    if elastic is not None:
        raise MeshrunError("--nnodes: meshrun train takes a fixed node count (hint: give N, not MIN:MAX)")
    return run(cfg, topo, job_from_args(ns), env).code
