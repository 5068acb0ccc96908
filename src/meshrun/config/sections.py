"""The sections of `meshrun train`'s configuration: model, data, parallelism, schedule,
optimizer, snapshots, metrics, runtime. Each is a small dataclass whose fields are the
section's options, declared once with ``option()`` (options.py), and whose ``check`` holds
the rules that tie its options to others. TrainConfig (at the end) is every section at once,
so a rule reads ``cfg.tp`` wherever the option lives; config/__init__.py reads it from a config file,
MESHRUN_* variables and flags or keywords.

Adding an option is adding a field to a section: the flag, its help, MESHRUN_<NAME>, the
config-file key, the keyword of ``meshrun.train()`` and the checks of its declaration follow.

Torch-free: the CLI validates a config before launching anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Protocol

from ..data.sources import chat_kind, check_regular, data_kind, text_extensions
from ..defaults import COMPILE_CHOICES, GLOBAL_BATCH_TOKENS, KERNELS, compile_choice, compile_enabled
from ..errors import MeshrunError, bad_value
from ..modelinfo.hf import is_hf_path, locate
from ..options import option, where
from ..paths import check_output_dir
from ..vocab import (
    AC_MODES,
    FLOAT8_PRECISIONS,
    GPT_ATTENTION_LINEARS,
    GPT_EXPERT_LINEARS,
    GPT_MLP_LINEARS,
    GPT_PRESETS,
    POLICIES,
    PP_SCHEDULES,
    PRECISIONS,
    QUANTIZE_CHOICES,
    STRATEGIES,
    Engine,
    lora_target_matches,
    strategy_hint,
    yes_no,
)
from . import trackers

STRATEGY_CHOICES = (*POLICIES, *STRATEGIES)
REDUCE_PRECISIONS = ("fp32", "bf16")
ATTENTION = ("auto", "cudnn", "flash", "efficient", "math")  # SDPA kernel first in line (models/attention.py)
INITS = ("auto", "pretrained", "random")
EXAMPLES = ("gpt", "toy")
BUILTIN_DATA = ("stdlib", "random", "toy")
TOKEN_TYPES = ("uint16", "uint32")


class Section(Protocol):
    """A section: a frozen dataclass of options, the title --help shows it under, and the
    rules that tie its options to the others."""

    TITLE: ClassVar[str]
    __dataclass_fields__: ClassVar[dict[str, Any]]

    @staticmethod
    def check(cfg: TrainConfig) -> TrainConfig: ...


@dataclass(frozen=True)
class ModelOptions:
    TITLE: ClassVar[str] = "model"

    example: str = option("gpt", "built-in job: gpt (default) or toy (pytorch/examples' Linear(20 -> 1))",
                          choices=EXAMPLES)
    model: str | None = option(
        None, "a Hugging Face model directory (save_pretrained's: config.json, *.safetensors) or config.json (any "
        "causal LM transformers knows; local paths only, nothing is downloaded), or your nn.Module factory",
        metavar="DIR|CONFIG|MODULE:FACTORY", path=True)
    init: str = option("auto", "a Hugging Face model's weights: auto (default: the directory's *.safetensors when it "
                       "has them, else a random initialisation), pretrained, random", choices=INITS)
    model_size: str = option("gpt-small", f"GPT preset: {', '.join(GPT_PRESETS)} (default {{default}})",
                             metavar="PRESET")
    blocks: str | None = option(None, "the model's block list, when meshrun does not find it (e.g. model.layers)",
                                metavar="ATTR.PATH")
    experts: int = option(0, "built-in GPT: a mixture of E experts (top-2, dropless) in every block", metavar="E",
                          minimum=0)
    kernels: str = option(
        "auto", "built-in GPT on GPUs: auto (default: the loss with its gradient in the forward, by Triton; the MLP's "
        "GELU in cuBLASLt's epilogues where nvmath-python is installed; together +6% at 124M on H200s) or plain "
        "(torch's modules only)", metavar="K", choices=KERNELS)
    attention: str = option("auto", "attention kernel SDPA tries first: auto (torch's order), cudnn, flash, "
                            "efficient, math (the others stay as fallbacks)", metavar="K", choices=ATTENTION)
    fused_loss: bool = option(False, "built-in GPT: the loss chunk by chunk, never holding all logits (for long "
                              "sequences)")

    @staticmethod
    def check(cfg: TrainConfig) -> TrainConfig:
        hf_model = cfg.model is not None and is_hf_path(cfg.model)
        if cfg.kernels != "auto" and ((cfg.model is not None and not hf_model) or cfg.example != "gpt"):
            raise bad_value(cfg.source("kernels"), cfg.kernels, "chooses the kernels of meshrun's built-in GPT and "
                            "of Hugging Face models", "drop it with a module:factory model or --example toy")
        if cfg.fused_loss and (cfg.model is not None or cfg.example != "gpt"):
            raise bad_value(cfg.source("fused_loss"), True, "is a loss of meshrun's built-in GPT",
                            "drop it, or compute your model's loss in chunks "
                            "(e.g. Liger-Kernel's fused linear cross-entropy)")
        if cfg.model is None and cfg.example == "gpt" and cfg.model_size not in GPT_PRESETS:
            raise bad_value(cfg.source("model_size"), cfg.model_size, "unknown GPT preset",
                            f"choose one of {', '.join(GPT_PRESETS)}")
        if cfg.model is not None and ":" not in cfg.model:
            model = locate(cfg.model, cfg.source("model"))  # a Hugging Face directory or config, or a clear error
            if cfg.init == "pretrained" and not model.has_weights:
                raise bad_value(cfg.source("init"), "pretrained", f"{model.directory} holds no *.safetensors "
                                "weights", "--init random to train from a random initialisation, or give the "
                                "directory with weights")
            if os.path.abspath(cfg.model) != cfg.model:  # the workers may start elsewhere
                cfg = cfg.replace(model=os.path.abspath(cfg.model))
        elif cfg.init != "auto":
            raise bad_value(cfg.source("init"), cfg.init, "chooses the weights of a Hugging Face model directory",
                            "drop it, or give --model a model directory")
        return cfg


LORA_MAX_RANK = 4096  # past the width of every layer meshrun trains: a typo, not a low rank


@dataclass(frozen=True)
class LoraOptions:
    """Low-rank adapters (training/lora.py): the model frozen, adapters on its linear layers
    trained. What a rank cannot do with them is refused here, before anything starts."""

    TITLE: ClassVar[str] = "fine-tuning (LoRA)"

    lora: int | None = option(None, "train low-rank adapters of rank R on the model's linear layers, the model "
                              "itself frozen (PEFT's LoRA; default: off, every weight trains)", metavar="R")
    lora_alpha: float | None = option(None, "with --lora: the adapters' scale is alpha / rank (default: 2 x rank)",
                                      metavar="A")
    lora_dropout: float = option(0.0, "with --lora: dropout on the adapters' input, 0 <= p < 1 (default {default})",
                                 metavar="P")
    lora_targets: str = option("all-linear", "with --lora: the layers that get adapters, a comma list of kinds "
                               "(q, k, v, o, gate, up, down) or of module names' last part (qkv, proj), or "
                               "all-linear (default: every linear layer but the output head)", metavar="LIST",
                               listed=True)
    quantize: str = option("none", "with --lora: nf4 stores the frozen weights of the adapted layers in 4-bit "
                           "NF4 (QLoRA, torchao), a quarter of bf16's bytes, on one process or DDP; none (default)",
                           choices=QUANTIZE_CHOICES)

    @staticmethod
    def check(cfg: TrainConfig) -> TrainConfig:
        if cfg.lora is None:
            given = [n for n in ("lora_alpha", "lora_dropout", "lora_targets") if n in cfg.sources]
            if cfg.quantize != "none":
                given.append("quantize")
            if given:
                raise bad_value(cfg.source(given[0]), getattr(cfg, given[0]), "is an option of --lora runs, and "
                                "there is no --lora: it would be ignored", "add --lora RANK, or drop it")
            return cfg
        where = cfg.source("lora")
        if not 1 <= cfg.lora <= LORA_MAX_RANK:
            raise bad_value(where, cfg.lora, f"the adapters' rank must be between 1 and {LORA_MAX_RANK}",
                            "8 to 64 is usual; drop --lora to train every weight")
        if cfg.lora_alpha is not None and not (math.isfinite(cfg.lora_alpha) and cfg.lora_alpha > 0):
            raise bad_value(cfg.source("lora_alpha"), cfg.lora_alpha, "must be a finite number > 0",
                            f"e.g. {2 * cfg.lora} (2 x rank, the default)")
        if not (math.isfinite(cfg.lora_dropout) and 0 <= cfg.lora_dropout < 1):
            raise bad_value(cfg.source("lora_dropout"), cfg.lora_dropout, "must be at least 0 and below 1",
                            "e.g. 0.05, or 0 for none")
        names = lora_targets(cfg)
        _lora_composes(cfg, where)
        if cfg.model is None and cfg.example == "gpt":
            _gpt_targets(cfg, names)
        if cfg.quantize != "none":
            _quantize_composes(cfg)
        if cfg.lora_alpha is None:
            cfg = cfg.replace(lora_alpha=float(2 * cfg.lora))
        return cfg


def lora_targets(cfg: TrainConfig) -> tuple[str, ...]:
    """--lora-targets as names: all-linear alone, or kinds and module-name endings."""
    names = tuple(n.strip() for n in cfg.lora_targets.split(","))
    where = cfg.source("lora_targets")
    if not names or any(not n for n in names):
        raise bad_value(where, cfg.lora_targets, "has an empty name", "a comma list such as q,k,v,o, or all-linear")
    if "all-linear" in names and len(names) > 1:
        raise bad_value(where, cfg.lora_targets, "all-linear already names every linear layer",
                        "all-linear alone, or a list of kinds such as q,v")
    odd = next((n for n in names if not all(c.isalnum() or c == "_" or c == "-" for c in n)), None)
    if odd is not None:
        raise bad_value(where, odd, "is not a layer kind nor the last part of a module name",
                        "q, k, v, o, gate, up, down, a name such as qkv, or all-linear")
    return names


def unmatched_target(source: str, target: str, leaves: list[str]) -> MeshrunError:
    """--lora-targets' name that matches no linear layer (``leaves``: their paths' last parts)."""
    names = sorted(set(leaves))
    return bad_value(source, target, "matches no linear layer of the model",
                     f"its linear layers end in {', '.join(names[:12]) or 'nothing'}; or all-linear")


def _gpt_targets(cfg: TrainConfig, names: tuple[str, ...]) -> None:
    """meshrun's GPT's linear layers are known by name before it is built: a target that
    matches none of them is refused before launch, as the ranks would refuse it."""
    leaves = list(GPT_ATTENTION_LINEARS) + list(GPT_EXPERT_LINEARS if cfg.experts else GPT_MLP_LINEARS)
    for target in names:
        if target != "all-linear" and not any(lora_target_matches(target, leaf) for leaf in leaves):
            raise unmatched_target(cfg.source("lora_targets"), target, leaves)


def _lora_composes(cfg: TrainConfig, where: str) -> None:
    """What --lora does not run with: each refused in one line, before anything starts."""
    degrees = (("tp", cfg.tp, "tensor parallelism shards the linear layers the adapters wrap"),
               ("pp", cfg.pp, "the pipeline's stages are cut from the model before the adapters go in"),
               ("ep", cfg.ep, "expert parallelism is meshrun's GPT's experts, which take no adapters"))
    for name, degree, why in degrees:
        if degree > 1:
            raise bad_value(cfg.source(name), degree, f"does not combine with --lora: {why}",
                            "data parallelism (DDP, FSDP2, DeepSpeed ZeRO) for a LoRA run")
    if cfg.precision in FLOAT8_PRECISIONS:
        raise bad_value(cfg.source("precision"), cfg.precision, "does not combine with --lora: float8 converts "
                        "the linear layers the adapters wrap", "--precision auto (bf16 on GPUs)")
    if cfg.model is None and cfg.example == "toy":
        raise bad_value(where, cfg.lora, "adapts a model's linear layers; the toy regression is one linear layer",
                        "--model DIR, or meshrun's GPT (--example gpt)")


def _quantize_composes(cfg: TrainConfig) -> None:
    """--quantize nf4 runs on one process or DDP: FSDP2 and DeepSpeed would shard or partition
    the NF4 tensors, which they do not know (a strategy ``auto`` picks is checked by the ranks)."""
    kind = STRATEGIES.get(cfg.strategy)
    if cfg.strategy == "fsdp" or (kind is not None and not (kind.one_process or kind.uses_ddp)):
        raise bad_value(cfg.source("strategy"), cfg.strategy, "does not combine with --quantize nf4: its sharding "
                        "does not know NF4 weights", "--strategy ddp (each rank holds the 4-bit base whole)")
    if cfg.cp > 1:
        raise bad_value(cfg.source("cp"), cfg.cp, "does not combine with --quantize nf4: context parallelism runs "
                        "with FSDP2", "--strategy ddp without --cp")


@dataclass(frozen=True)
class DataOptions:
    TITLE: ClassVar[str] = "data"

    data: str | None = option(
        None, "a corpus: a directory meshrun data prepare wrote, token files (nanoGPT's train.bin/val.bin, or a "
        "folder of .bin), or text (.txt, .jsonl, .parquet, a folder of them, a saved dataset: tokenized once into a "
        "cache); or stdlib (default for gpt), random (tokens), toy, or your Dataset factory (or (train, val))",
        metavar="PATH|NAME|MODULE:FACTORY", path=True)
    tokenizer: str | None = option(None, "text data: a tokenizer directory, tokenizer.json or tiktoken encoding "
                                   "(default: the Hugging Face model directory's)", metavar="DIR|FILE|NAME",
                                   path=True)
    text_field: str = option("text", "text data: the field of .jsonl, .parquet and saved datasets (default "
                             "{default})", metavar="NAME")
    ext: str | None = option(None, "text data: read files of this extension too, a document a file (e.g. .py; "
                             "repeat it or give a comma list; .txt .md .text are read anyway)", metavar="EXT",
                             listed=True, action="append")
    data_dtype: str = option("uint16", "flat token files: the token type (default {default}, nanoGPT's)",
                             choices=TOKEN_TYPES)
    document_mask: bool = option(False, "attend and predict within documents: position ids restart at each "
                                 "document and a target across a document's end is ignored (a prepared corpus or "
                                 "text; default: sequences cut across documents; always on for chat data)")
    seq_len: int | None = option(None, "tokens per sample (default: the model's context, at most 4096)",
                                 metavar="T", minimum=1)

    @staticmethod
    def check(cfg: TrainConfig) -> TrainConfig:
        form = data_kind(cfg.data) if cfg.data is not None and cfg.data not in BUILTIN_DATA else None
        if form is not None and cfg.data is not None:  # a path: absolute, for workers that start elsewhere
            if os.path.abspath(os.path.expanduser(cfg.data)) != cfg.data:
                cfg = cfg.replace(data=os.path.abspath(os.path.expanduser(cfg.data)))
        elif cfg.data is not None and ":" not in cfg.data and cfg.data not in BUILTIN_DATA:
            if os.path.exists(cfg.data):  # a FIFO, a socket, a device: named as what it is
                check_regular(cfg.data, cfg.source("data"), "give a corpus file or a directory of them")
            raise bad_value(cfg.source("data"), cfg.data, "no such file or directory, and not module:factory",
                            f"a corpus path, module:factory, or one of {', '.join(BUILTIN_DATA)}")
        if cfg.ext is not None:
            text_extensions(cfg.ext, cfg.source("ext"))
            if form != "text":
                raise bad_value(cfg.source("ext"), cfg.ext, "chooses the files of a text corpus that are read",
                                "drop it, or give --data a directory of text files")
        kind = chat_kind(cfg.data, cfg.text_field, cfg.source("data"), text_extensions(cfg.ext)) \
            if form is not None and cfg.data is not None else None
        if kind is not None:  # examples are packed whole, each attending to itself only (data/packing.py)
            if "document_mask" in cfg.sources and not cfg.document_mask:
                raise bad_value(cfg.source("document_mask"), False, "chat data are packed with document masks, so "
                                "that no example attends to another", "drop it: document masking is on for chat "
                                "data")
            if cfg.pp > 1:
                raise bad_value(cfg.source("data"), cfg.data, f"chat data ({kind}) are packed with document masks, "
                                "which do not combine with --pp", "FSDP2, TP or CP with chat data")
            cfg = cfg.replace(document_mask=True)
        if cfg.document_mask and form not in ("tokens", "text"):
            raise bad_value(cfg.source("document_mask"), True, "needs document boundaries: a corpus given by path",
                            "--data DIR prepared by meshrun data prepare, or text")
        return cfg


@dataclass(frozen=True)
class ParallelOptions:
    TITLE: ClassVar[str] = "parallelism"

    strategy: str = option("auto", f"{', '.join(STRATEGY_CHOICES)} (default auto; see above)", metavar="S",
                           choices=STRATEGY_CHOICES)
    fsdp_shard_size: int | None = option(None, "fsdp-hybrid: ranks per shard group (default: processes per node)",
                                         metavar="N", minimum=1)
    tp: int = option(1, "tensor-parallel degree (DTensor, Megatron-style); FSDP2 shards over the remaining ranks",
                     metavar="N", minimum=1)
    sequence_parallel: bool = option(True, "with --tp: keep the residual stream sharded along the sequence between "
                                     "the tensor-parallel layers (meshrun's GPT and Llama-style blocks, without "
                                     "--pp; default on)")
    pp: int = option(1, "pipeline stages (torch.distributed.pipelining; meshrun's GPT and Hugging Face models of the "
                     "Llama, Mistral, Mixtral and Qwen2/3 families)", metavar="N", minimum=1)
    pp_schedule: str = option("1f1b", "1f1b (default), gpipe, interleaved (two stages per rank)", metavar="S",
                              choices=PP_SCHEDULES)
    pp_microbatches: int | None = option(None, "pieces each micro-batch is cut into for the pipeline (default: "
                                         "--pp)", metavar="N", minimum=1)
    ep: int = option(1, "expert parallel: experts sharded over N ranks, tokens exchanged by all-to-all; the rest "
                     "replicated, or sharded by FSDP2 with an FSDP2 --strategy", metavar="N", minimum=1)
    cp: int = option(1, "context parallel: each sequence sharded over N ranks (zig-zag, all-gathered K/V; meshrun's "
                     "GPT and Hugging Face models with causal SDPA attention)", metavar="N", minimum=1)
    activation_checkpointing: str = option("none", ", ".join(AC_MODES), metavar="MODE", choices=AC_MODES)
    ddp_bucket_mb: int | None = option(None, "DDP gradient bucket size (default: 1000 compiled on one host, else "
                                       "100)", metavar="MB", minimum=1)
    reduce_precision: str = option("fp32", "gradient reduction across ranks: fp32 (default) or bf16 (half the "
                                   "bytes, less exact)", metavar="P", choices=REDUCE_PRECISIONS)

    @staticmethod
    def check(cfg: TrainConfig) -> TrainConfig:
        kind = STRATEGIES.get(cfg.strategy)
        if cfg.ep > 1 and (cfg.tp > 1 or cfg.pp > 1 or cfg.cp > 1 or (kind is not None and "ep" not in kind.composes)):
            raise bad_value(cfg.source("ep"), cfg.ep, "runs with data parallelism (DDP-style or FSDP2) for the rest",
                            f"{strategy_hint({'ep'})}, without --tp/--pp/--cp")
        degrees = (("tp", cfg.tp), ("pp", cfg.pp), ("cp", cfg.cp))
        used = {k for k, v in degrees if v > 1}
        if used and kind is not None and not used <= kind.composes:
            what = " and ".join(f"--{k}={v}" for k, v in degrees if v > 1)
            if not kind.hybrid:
                raise bad_value(cfg.source("strategy"), cfg.strategy, f"does not compose with {what}: tensor, "
                                "pipeline and context parallelism run with FSDP2 over the data-parallel ranks",
                                strategy_hint(used))
            raise bad_value(cfg.source("strategy"), cfg.strategy, f"does not compose with {what} yet",
                            strategy_hint(used, policies=False))
        if cfg.cp > 1 and (cfg.tp > 1 or cfg.pp > 1):
            raise bad_value(cfg.source("cp"), cfg.cp, "does not combine with --tp/--pp yet",
                            "context parallel with FSDP2")
        if cfg.cp > 1 and cfg.seq_len is not None and cfg.seq_len % (2 * cfg.cp):
            raise bad_value(cfg.source("seq_len"), cfg.seq_len, f"context parallelism over {cfg.cp} ranks cuts "
                            f"sequences into {2 * cfg.cp} equal chunks", f"a multiple of {2 * cfg.cp}")
        if cfg.pp > 1 and cfg.micro % (cfg.pp_microbatches or cfg.pp):
            n = cfg.pp_microbatches or cfg.pp
            raise bad_value(cfg.source("micro_batch"), cfg.micro, f"does not split into {n} pipeline micro-batches",
                            f"a micro-batch that is a multiple of {n}, or set --pp-microbatches")
        if cfg.fused_loss and (cfg.tp > 1 or cfg.pp > 1):
            raise bad_value(cfg.source("fused_loss"), True, "does not combine with --tp/--pp (their loss is "
                            "vocabulary-parallel or per stage)", "drop --fused-loss: under --tp each rank holds "
                            "1/tp of the logits")
        if cfg.document_mask and cfg.pp > 1:
            raise bad_value(cfg.source("document_mask"), True, "does not combine with --pp",
                            "FSDP2, TP or CP with document masking")
        return cfg


@dataclass(frozen=True)
class ScheduleOptions:
    TITLE: ClassVar[str] = "schedule"

    steps: int = option(200, "optimizer steps (default {default})", metavar="N", minimum=1)
    # Neither batch given, on GPUs: a global batch of defaults.GLOBAL_BATCH_TOKENS and the
    # largest micro-batch that fits (the planner's); on the CPU: micro-batch 8 (32 for toy)
    micro_batch: int | None = option(None, "samples per process per micro-step (default: the largest that fits on "
                                     "GPUs; 8 on the CPU)", metavar="B", minimum=1)
    global_batch: int | None = option(None, "samples per optimizer step, all ranks (default on GPUs: about "
                                      f"{GLOBAL_BATCH_TOKENS // 1024}K tokens' worth)", metavar="B", minimum=1)
    warmup: int | None = option(None, "warmup steps (default 10% of steps, at most 100)", metavar="N", minimum=0)
    min_lr_ratio: float = option(0.1, "final lr / peak lr (default {default})", metavar="R", minimum=0, maximum=1)

    @staticmethod
    def check(cfg: TrainConfig) -> TrainConfig:
        return cfg


@dataclass(frozen=True)
class OptimOptions:
    TITLE: ClassVar[str] = "optimizer (AdamW)"

    lr: float = option(1e-3, "peak learning rate (default {default:g})", metavar="LR")
    weight_decay: float = option(0.1, "weight decay (default {default})", metavar="W", minimum=0)
    grad_clip: float = option(1.0, "global gradient norm clip (default {default}; 0: off)", metavar="C", minimum=0)

    @staticmethod
    def check(cfg: TrainConfig) -> TrainConfig:
        if cfg.lr <= 0:
            raise bad_value(cfg.source("lr"), cfg.lr, "must be a finite number > 0", "e.g. 3e-4")
        return cfg


@dataclass(frozen=True)
class CheckpointOptions:
    TITLE: ClassVar[str] = "snapshots and restarts (with --out)"

    save_every: int = option(100, "snapshot every N steps and at the end (default {default}; 0: only at the end)",
                             metavar="N", minimum=0)
    keep_last: int = option(3, "committed snapshots kept (default {default}; 0: all)", metavar="K", minimum=0)
    resume: str = option("auto", "auto (default): continue from the newest snapshot in OUT/checkpoints; none; or a "
                         "snapshot", metavar="auto|none|PATH", path=True)
    async_save: bool = option(False, "write snapshots in the background while training continues (one in flight)")

    @staticmethod
    def check(cfg: TrainConfig) -> TrainConfig:
        return cfg


@dataclass(frozen=True)
class MetricsOptions:
    TITLE: ClassVar[str] = "metrics"

    out: str | None = option(None, "write metrics.jsonl, TensorBoard events, loss.png (and snapshots) here",
                             metavar="DIR", path=True)
    log_every: int = option(10, "steps between log lines (default {default})", metavar="N", minimum=1)
    eval_every: int = option(0, "steps between validations (default {default}: at the end)", metavar="N", minimum=0)
    eval_batches: int = option(8, "validation micro-batches per rank (default {default})", metavar="N", minimum=1)
    log_with: str = option(trackers.DEFAULT, "experiment trackers that get every metric and the run's config: a "
                           "comma list of tensorboard (in OUT), wandb, mlflow; all (those installed); none (default "
                           "{default}, where installed). W&B and MLflow read their own WANDB_* and MLFLOW_* "
                           "variables; a resume continues the same tracker run (its id is kept in OUT)",
                           metavar="LIST", listed=True)

    @staticmethod
    def check(cfg: TrainConfig) -> TrainConfig:
        if cfg.out is not None:
            check_output_dir(cfg.out, cfg.source("out"))
        names = trackers.parse(cfg.log_with, cfg.source("log_with"), given="log_with" in cfg.sources)
        if "tensorboard" in names and cfg.out is None:  # (named: an error; by "all" or the default: left out)
            if "log_with" in cfg.sources and "tensorboard" in cfg.log_with.lower():
                raise bad_value(cfg.source("log_with"), cfg.log_with, "TensorBoard's events are written into "
                                "--out", "add --out DIR")
            names = tuple(n for n in names if n != "tensorboard")
        return cfg.replace(log_with=",".join(names) or "none")  # "all" and the default, resolved once


@dataclass(frozen=True)
class RuntimeOptions:
    TITLE: ClassVar[str] = "runtime"

    precision: str = option("auto", f"auto, {', '.join(PRECISIONS)} (default auto: bf16 on GPUs that have it); fp8: "
                            "bf16 with the large linear layers' matmuls in float8 (torchao; GPUs of compute "
                            "capability 8.9+, compiled), fp8-rowwise: the same with a scale per row",
                            metavar="P", choices=("auto", *PRECISIONS, *FLOAT8_PRECISIONS))
    # auto: compiled on GPUs (defaults.compile_enabled); True/False and yes/no words are taken too
    compile: str = option("auto", "torch.compile (per block under FSDP2): auto (default: on GPUs, but not with "
                          "Liger's kernels, which a --lora run leaves for compiling), on (a Hugging Face model "
                          "then gets torch.compile's kernels, not Liger's), off; --compile alone: on",
                          metavar="auto|on|off", nargs="?", const="on",
                          on_off=True)
    # Inductor's coordinate-descent tuning of its kernels (implies compile on): a slightly faster
    # step for minutes more compiling (kernels/inductor.py: compile_options;
    # docs/decisions.md#rejected-coordinate-descent-tuning)
    compile_tune: bool = option(False, "Inductor's coordinate-descent tuning of the compiled kernels: a step up to "
                                "2% faster (H200: GPT 124M +1.0-1.9%, 1.3B +0.3-0.7%) for ~4 minutes more "
                                "compiling; for runs of hours")
    deterministic: bool = option(False, "deterministic kernels: reruns and resumes reproduce the loss bit for bit")
    collective_timeout: int = option(300, "seconds a collective waits for a rank that does not answer (stopped, "
                                     "hung); then the job ends in one line naming that rank, its last snapshot "
                                     "kept (default {default})", metavar="S", minimum=1, maximum=604800)
    # torch's generators take 64-bit seeds; the data order seeds each epoch with seed + epoch
    seed: int = option(0, "seed for weights and data order (default {default})", metavar="S", minimum=0,
                       maximum=2**63 - 1)

    @staticmethod
    def check(cfg: TrainConfig) -> TrainConfig:
        if isinstance(cfg.compile, bool) or yes_no(str(cfg.compile)) is not None:
            cfg = cfg.replace(compile="on" if (cfg.compile if isinstance(cfg.compile, bool)
                                               else yes_no(str(cfg.compile))) else "off")
        if cfg.compile not in COMPILE_CHOICES:
            raise bad_value(cfg.source("compile"), cfg.compile, "unknown value",
                            f"choose one of {', '.join(COMPILE_CHOICES)}")
        if cfg.compile_tune and cfg.compile == "off":
            raise bad_value(cfg.source("compile_tune"), True, "tunes compiled kernels, but --compile is off",
                            "drop one of them")
        if cfg.precision in FLOAT8_PRECISIONS:
            cfg = _float8(cfg)
        return cfg


def _float8(cfg: TrainConfig) -> TrainConfig:
    """--precision fp8: compiled unless --compile off says otherwise (float8's casts and scales
    pay only fused into their neighbours: eager is for debugging), and on the layouts whose
    linear layers it converts as they are."""
    where = cfg.source("precision")
    kind = STRATEGIES.get(cfg.strategy)
    if kind is not None and kind.engine is Engine.DEEPSPEED:
        raise bad_value(where, cfg.precision, f"does not combine with DeepSpeed's engine (--strategy {cfg.strategy})",
                        "--strategy fsdp (its weights are all-gathered in float8)")
    if cfg.tp > 1:
        raise bad_value(where, cfg.precision, "does not combine with --tp (its sharded linear layers are not "
                        "converted)", "FSDP2 alone or with --cp")
    # compiled also instead of Liger's eager kernels (policy.py: compile_and_kernels)
    return cfg.replace(compile=compile_choice(cfg.compile, cfg.precision))


# In the order --help shows them and validate() checks them
SECTIONS: tuple[type[Section], ...] = (ModelOptions, LoraOptions, DataOptions, ParallelOptions, ScheduleOptions,
                                       OptimOptions, CheckpointOptions, MetricsOptions, RuntimeOptions)


def section_names() -> dict[str, type[Section]]:
    """Each section by the name a config file's table gives it (``[parallel]``, ``schedule:``)."""
    return {s.__name__.removesuffix("Options").lower(): s for s in SECTIONS}


@dataclass(frozen=True)
class TrainConfig(RuntimeOptions, MetricsOptions, CheckpointOptions, OptimOptions, ScheduleOptions,
                  ParallelOptions, DataOptions, LoraOptions, ModelOptions):
    """Every option of `meshrun train`: the sections above at once (``cfg.tp``,
    ``cfg.steps``), and where each value came from (``sources``: option -> "flag",
    "env MESHRUN_X", "config FILE", ...), so that an error names it."""

    TITLE: ClassVar[str] = "meshrun train"
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    @staticmethod
    def check(cfg: TrainConfig) -> TrainConfig:
        """Every section's rules, in SECTIONS' order (each section's ``check`` covers its own
        options; config.validate runs them after each option's own checks)."""
        for section in SECTIONS:
            cfg = section.check(cfg)
        return cfg

    # ---- derived ------------------------------------------------------------------------
    @property
    def micro(self) -> int:
        if self.micro_batch is not None:
            return self.micro_batch
        return 32 if self.example == "toy" else 8

    def micro_for(self, dp_size: int) -> int:
        """The micro-batch on ``dp_size`` data-parallel ranks by the rules: the user's, else the
        default (``micro``) cut to the largest divisor of each rank's share of --global-batch, so
        that a small --global-batch (2 sequences of an 8B model) needs no --micro-batch beside it."""
        if self.micro_batch is not None or self.global_batch is None or self.global_batch % dp_size:
            return self.micro
        share = self.global_batch // dp_size
        return max(d for d in range(1, min(self.micro, share) + 1) if share % d == 0)

    @property
    def seq(self) -> int:
        """The sequence length; resolved (``resolve_seq_len``) before training starts."""
        if self.seq_len is None:
            raise MeshrunError("the sequence length is not resolved yet (hint: set --seq-len)")
        return self.seq_len

    def compiles(self, cuda: bool) -> bool:
        return compile_enabled(self.compile, cuda) or self.compile_tune

    @property
    def warmup_steps(self) -> int:
        return self.warmup if self.warmup is not None else min(100, self.steps // 10)

    def dp_size(self, world: int) -> int:
        """The data-parallel ranks of ``world`` processes: those left after --tp, --pp and --cp.
        The launcher checks the split with the layout's own rule before any rank starts
        (job.check); the layout's ParallelDims is built once, by ``parallelize``."""
        model_parallel = self.tp * self.pp * self.cp
        if world % model_parallel:
            raise bad_value(f"--tp {self.tp} --pp {self.pp} --cp {self.cp}", model_parallel,
                            f"model-parallel ranks do not divide the {world} processes",
                            "degrees whose product divides the number of processes")
        return world // model_parallel

    def accumulation(self, dp_size: int) -> int:
        """Micro-steps per optimizer step: global = micro x accumulation x data-parallel size
        (the micro-batch ``micro_for`` gives)."""
        if self.global_batch is None:
            return 1
        if self.micro_batch is None and self.global_batch % dp_size:
            lo = self.global_batch // dp_size * dp_size
            near = f"{lo} or {lo + dp_size}" if lo else str(dp_size)
            raise bad_value(self.source("global_batch"), self.global_batch,
                            f"does not split over {dp_size} data-parallel ranks",
                            f"use a multiple of {dp_size}, e.g. {near}")
        per_step = self.micro_for(dp_size) * dp_size
        if self.global_batch % per_step:
            lo = self.global_batch // per_step * per_step
            near = f"{lo} or {lo + per_step}" if lo else str(per_step)
            raise bad_value(self.source("global_batch"), self.global_batch,
                            f"is not a multiple of micro-batch {self.micro} x data-parallel size {dp_size} "
                            f"= {per_step}", f"use a multiple of {per_step}, e.g. {near}")
        return self.global_batch // per_step

    def source(self, name: str) -> str:
        return where(name, self.sources.get(name, "flag"))

    def to_json(self) -> str:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["sources"] = dict(self.sources)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        return cls(**json.loads(text))

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)
