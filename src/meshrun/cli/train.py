"""`meshrun train`: its options, parsed into a TrainConfig, a topology and JobOptions for job/__init__.py."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping

from ..cluster.detect import resolve
from ..cluster.gpus import count_visible_gpus
from ..cluster.net import free_port
from ..config.sections import SECTIONS
from ..defaults import GLOBAL_BATCH_TOKENS
from ..job import JobOptions, require_trainer_packages, run
from ..job.api import job_from
from ..vocab import STRATEGIES
from .options import ShortHelp, add_declared, add_option, add_short_help, add_topology_options

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
meshrun export SNAPSHOT --to DIR writes a trained one back as save_pretrained does.

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
                  Liger Kernel patches (its kernels run eager: compiling adds nothing to them),
                  but for a --lora run, compiled per block (+25% on an 8B model)
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

when something fails: each rank's whole output is in OUT/logs/rank-N.log (what the ranks wrote
before their logs opened in OUT/logs/ranks-node-N.log, torchrun's on several nodes in
OUT/logs/torchrun-node-N.log; without --out, in a directory the error line names), and a rank
that raises or dies ends the job with one line: the rank, the cause, its log and a hint (exit
code 1). A micro-batch meshrun chose that runs out of GPU memory is halved before training,
with the accumulation doubled so the global batch stays; a model nothing fits is refused.

preemption: SIGTERM or SIGUSR1 (Slurm's --signal, scontrol requeue, Kubernetes, SkyPilot) stops
every rank after the same step; with --out that step's snapshot is written, and meshrun train
exits with code 75. The same command resumes it (meshrun render slurm --requeue requeues on 75).

every option below may also be given as MESHRUN_<NAME> (MESHRUN_STEPS=50), as a key of a
--config file (steps: 50, or in its section: schedule: {{steps: 50}}) and, from Python, as
meshrun.train(steps=50); a flag wins over a variable, a variable over the file.

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


# `meshrun train --help`: what a first run needs; --help-all has every option and TRAIN_HELP.
SHORT_HELP = ShortHelp(
    intro="""\
Train with meshrun's PyTorch trainer on the topology meshrun detects (all GPUs here, or 2 CPU
processes when there is none; on a cluster, run the same command on every node). With no
options: a small GPT on this Python's standard library source, nothing to download.""",
    groups=(  # (one line each at 80 columns: a summary of at most 54 characters)
        ("model and data", (
            ("--model", "a Hugging Face model directory, or your factory"),
            ("--model-size", "GPT preset, gpt-tiny to gpt-1.3b (default gpt-small)"),
            ("--data", "a corpus, text, random, or your Dataset factory"),
            ("--seq-len", "tokens per sample (default: the model's context)"),
        )),
        ("how it is spread", (
            ("--strategy", "auto (default), ddp, fsdp, zero1-3, ... (--help-all)"),
            ("--tp", "tensor-parallel degree (--pp, --cp, --ep: --help-all)"),
            ("--activation-checkpointing", "none, full, selective (default: when needed to fit)"),
            ("--precision", "auto (default: bf16 on GPUs), bf16, fp32, fp8"),
        )),
        ("how long and how big", (
            ("--steps", "optimizer steps (default 200)"),
            ("--micro-batch", "per-process batch (default: the largest that fits)"),
            ("--global-batch", f"samples per step, all ranks (GPUs: ~{GLOBAL_BATCH_TOKENS // 1024}K tokens)"),
            ("--lr", "peak learning rate (default 0.001)"),
        )),
        ("output and restarts", (
            ("--out", "metrics, loss.png and snapshots here; a rerun resumes"),
            ("--resume", "auto (default), none, or a snapshot's path"),
            ("--save-every", "a snapshot every N steps (default 100)"),
            ("--log-with", "trackers: tensorboard (default), wandb, mlflow"),
            ("--max-restarts", "restart a crashed job up to N times (needs --out)"),
        )),
        ("where (the platform says; these override it)", (
            ("--nproc", "processes on this node (default: one per GPU)"),
            ("--nnodes", "number of nodes"),
            ("--master-addr", "node 0's address"),
        )),
        ("the command", (
            ("--config", "a YAML or TOML file of these options"),
            ("--dry-run", "show what would start and be decided (--json)"),
        )),
    ),
    outro="""\
examples:
  meshrun train --steps 50 --out runs/a            # metrics.jsonl, TensorBoard, loss.png in runs/a
  meshrun train --model ~/models/Llama-3.2-1B --data data/corpus --out runs/llama
  meshrun train --nproc 2 --strategy fsdp --dry-run   # what it would start, and the choices made
  meshrun train --config train.yaml --lr 3e-4      # flags override the file's keys

Every option (all of them also MESHRUN_<NAME> variables, --config keys and meshrun.train()
keywords), the strategies and the defaults meshrun chooses: meshrun train --help-all; and
docs/guide.md, "meshrun train's options".""",
)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("train", help="train with meshrun's trainer (a small GPT on stdlib text by default)",
                       description=TRAIN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter,
                       usage="%(prog)s [options]", add_help=False)
    add_short_help(p, SHORT_HELP)
    add_option(p, "--config", metavar="FILE", help="YAML or TOML whose keys are these options (underscores or "
               "dashes), flat or in tables named by the sections below ([parallel] tp = 2); flags and "
               "MESHRUN_<NAME> variables override it")
    for section in SECTIONS:  # every option of a section, from its declaration (config/sections.py)
        add_declared(p.add_argument_group(section.TITLE), section)
    g = p.add_argument_group("the job")
    add_option(g, "--no-resume", action="store_const", const="none", dest="resume", from_env=False,
               help="start a new run instead of resuming; refused where OUT holds snapshots (see --overwrite)")
    add_declared(g, JobOptions)
    add_topology_options(p)
    p.set_defaults(func=cmd_train)


def cmd_train(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    """Read every option as `meshrun.train(...)` reads its keywords (job/api.py: job_from),
    then run the job (job/__init__.py)."""
    require_trainer_packages()
    flags = {k: v for k, v in vars(ns).items() if v is not None}
    cfg, job, user = job_from(ns.config, env, flags, "flag")
    topo = resolve(env, count_visible_gpus(env), user.platform, user.overrides, free_port=free_port)
    result = run(cfg, topo, job, env)
    if result.dry_run is not None:
        print(json.dumps(result.dry_run.to_dict(), indent=2) if job.json else result.dry_run.text())
    return result.code
