"""TrainConfig: every knob of `meshrun train`, validated with errors that name their source.

This module does not import torch: the CLI validates a config before launching anything.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

from ..data.sources import data_kind
from ..defaults import COMPILE_CHOICES, compile_enabled, seq_len_for
from ..errors import MeshrunError, bad_value
from ..modelinfo.hf import is_hf_path, locate
from ..paths import check_output_dir
from ..vocab import AC_MODES, GPT_PRESETS, POLICIES, PP_SCHEDULES, PRECISIONS, STRATEGIES, strategy_hint, yes_no

if TYPE_CHECKING:
    from .parallel.dims import ParallelDims

STRATEGY_CHOICES = (*POLICIES, *STRATEGIES)
REDUCE_PRECISIONS = ("fp32", "bf16")
ATTENTION = ("auto", "cudnn", "flash", "efficient", "math")  # SDPA kernel first in line (models/attention.py)
KERNELS = ("auto", "plain")  # the built-in GPT's own kernels (Liger's for a Hugging Face model) where they run, or none
INITS = ("auto", "pretrained", "random")
EXAMPLES = ("gpt", "toy")
BUILTIN_DATA = ("stdlib", "random", "toy")


@dataclass(frozen=True)
class TrainConfig:
    example: str = "gpt"
    model: str | None = None  # "module:factory" returning an nn.Module, or a Hugging Face model directory
    init: str = "auto"  # a Hugging Face model's weights: auto (the directory's when it has them), pretrained, random
    # built-in name, a path (token files, a prepared corpus, text, a saved dataset), or
    # "module:factory" returning a Dataset or (train, val)
    data: str | None = None
    tokenizer: str | None = None  # text data: a tokenizer directory or file, or a tiktoken name (default: the model's)
    text_field: str = "text"  # the text of .jsonl, .parquet and saved datasets
    data_dtype: str = "uint16"  # flat token files (nanoGPT's train.bin): uint16 or uint32
    document_mask: bool = False  # attention and targets within documents (position ids restart per document)
    model_size: str = "gpt-small"
    strategy: str = "auto"  # auto, fsdp (flavour by size) or a name of vocab.STRATEGIES
    fsdp_shard_size: int | None = None  # fsdp-hybrid: ranks per shard group (default: processes per node)
    tp: int = 1  # tensor-parallel degree (DTensor); data parallel takes the rest of the world
    sequence_parallel: bool = True  # under --tp: norms on a sequence shard (meshrun's GPT, without --pp)
    pp: int = 1  # pipeline stages (torch.distributed.pipelining), meshrun's GPT
    pp_schedule: str = "1f1b"  # 1f1b | gpipe | interleaved (two stages per rank)
    pp_microbatches: int | None = None  # pieces each micro-batch is cut into (default: pp)
    experts: int = 0  # built-in GPT: a mixture of this many experts (top-2) in every block
    ep: int = 1  # expert-parallel degree: each rank of an ep group holds experts/ep experts
    cp: int = 1  # context-parallel degree: each sequence sharded over cp ranks (meshrun's GPT)
    steps: int = 200
    # Neither given, on GPUs: a global batch of defaults.GLOBAL_BATCH_TOKENS and the largest
    # micro-batch that fits (the planner's); on the CPU: micro-batch 8 (32 for toy), no accumulation
    micro_batch: int | None = None
    global_batch: int | None = None  # given without micro_batch: the planner sizes the micro-batch on GPUs
    seq_len: int | None = None  # None: the model's context (defaults.seq_len_for)
    lr: float = 1e-3
    warmup: int | None = None  # default: 10% of steps, at most 100
    min_lr_ratio: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0  # 0 disables clipping
    precision: str = "auto"  # bf16 on GPUs that have it, fp32 elsewhere
    compile: str = "auto"  # auto (on GPUs, defaults.compile_enabled) | on | off; True/False taken too
    # Inductor's coordinate-descent tuning of its kernels (implies compile on): a step up to 2%
    # faster for minutes more compiling (parallel/apply.py: compile_options)
    compile_tune: bool = False
    activation_checkpointing: str = "none"
    # None: 1000 MB compiled on one host, else 100 MB (parallel/ddp.py: ddp_bucket_mb)
    ddp_bucket_mb: int | None = None
    reduce_precision: str = "fp32"  # gradients' data-parallel reduction: fp32, or bf16 (half the bytes)
    fused_loss: bool = False  # built-in GPT: the loss chunk by chunk, the logits never whole (long sequences)
    attention: str = "auto"  # SDPA kernel tried first: auto (torch's order), cudnn, flash, efficient, math
    # built-in GPT: auto, meshrun's kernels where they run (on CUDA the loss that writes its
    # gradient in the forward, with Triton; the MLP's GELU in cuBLASLt's epilogues, with
    # nvmath-python); plain, torch's modules only (to compare, or to rule the kernels out)
    kernels: str = "auto"
    blocks: str | None = None  # attribute path of the block list, e.g. "model.layers"
    out: str | None = None
    save_every: int = 100  # with --out: snapshot every N steps (and at the end); 0: only at the end
    keep_last: int = 3  # committed snapshots to keep (0: all)
    collective_timeout: int = 300  # seconds a collective (or the process group's start) waits for a peer
    resume: str = "auto"  # auto (newest snapshot in OUT/checkpoints), none, or a snapshot path
    async_save: bool = False  # write snapshots in the background while training continues
    deterministic: bool = False  # deterministic kernels: bit-identical reruns and resumes
    log_every: int = 10
    eval_every: int = 0  # 0: evaluate once, at the end
    eval_batches: int = 8
    seed: int = 0
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)

    # ---- derived ------------------------------------------------------------------------
    @property
    def micro(self) -> int:
        if self.micro_batch is not None:
            return self.micro_batch
        return 32 if self.example == "toy" else 8

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

    def dims(self, world: int) -> ParallelDims:
        """The parallel dimensions of ``world`` processes under --tp, --pp and --cp (validated)."""
        from .parallel.dims import make_dims  # no torch at import: the CLI stays torch-free

        return make_dims(world, tp=self.tp, pp=self.pp, cp=self.cp,
                         source=f"--tp {self.tp} --pp {self.pp} --cp {self.cp} on {world} processes")

    def accumulation(self, dp_size: int) -> int:
        """Micro-steps per optimizer step: global = micro x accumulation x data-parallel size."""
        per_step = self.micro * dp_size
        if self.global_batch is None:
            return 1
        if self.global_batch % per_step:
            lo = self.global_batch // per_step * per_step
            near = f"{lo} or {lo + per_step}" if lo else str(per_step)
            raise bad_value(self.source("global_batch"), self.global_batch,
                            f"is not a multiple of micro-batch {self.micro} x data-parallel size {dp_size} "
                            f"= {per_step}", f"use a multiple of {per_step}, e.g. {near}")
        return self.global_batch // per_step

    def source(self, name: str) -> str:
        src = self.sources.get(name)
        flag = "--" + name.replace("_", "-")
        return flag if src is None or src == "flag" else f"{flag} (from {src})"

    def to_json(self) -> str:
        d = {f.name: getattr(self, f.name) for f in fields(self)}
        d["sources"] = dict(self.sources)
        return json.dumps(d)

    @classmethod
    def from_json(cls, text: str) -> TrainConfig:
        return cls(**json.loads(text))

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def _check_choice(cfg: TrainConfig, name: str, choices: tuple[str, ...]) -> None:
    value = getattr(cfg, name)
    if value not in choices:
        raise bad_value(cfg.source(name), value, "unknown value", f"choose one of {', '.join(choices)}")


def validate(cfg: TrainConfig) -> TrainConfig:
    """Checks that need no torch and no process group (the batch arithmetic needs the world
    size and is checked by ``accumulation``)."""
    if isinstance(cfg.compile, bool) or yes_no(str(cfg.compile)) is not None:
        cfg = dataclasses.replace(cfg, compile=_compile_word(cfg.compile))
    _check_choice(cfg, "compile", COMPILE_CHOICES)
    _check_choice(cfg, "example", EXAMPLES)
    _check_choice(cfg, "strategy", STRATEGY_CHOICES)
    _check_choice(cfg, "precision", ("auto", *PRECISIONS))
    _check_choice(cfg, "reduce_precision", REDUCE_PRECISIONS)
    _check_choice(cfg, "attention", ATTENTION)
    _check_choice(cfg, "kernels", KERNELS)
    _check_choice(cfg, "init", INITS)
    _check_choice(cfg, "activation_checkpointing", AC_MODES)
    _check_choice(cfg, "pp_schedule", PP_SCHEDULES)
    kind = STRATEGIES.get(cfg.strategy)
    if cfg.experts < 0:
        raise bad_value(cfg.source("experts"), cfg.experts, "must be >= 0")
    if cfg.ep > 1 and (cfg.tp > 1 or cfg.pp > 1 or cfg.cp > 1 or (kind is not None and "ep" not in kind.composes)):
        raise bad_value(cfg.source("ep"), cfg.ep, "runs with data parallelism (DDP-style or FSDP2) for the rest",
                        f"{strategy_hint({'ep'})}, without --tp/--pp/--cp")
    used = {k for k, v in (("tp", cfg.tp), ("pp", cfg.pp), ("cp", cfg.cp)) if v > 1}
    if used and kind is not None and not used <= kind.composes:
        what = " and ".join(f"--{k}={v}" for k, v in (("tp", cfg.tp), ("pp", cfg.pp), ("cp", cfg.cp)) if v > 1)
        if not kind.hybrid:
            raise bad_value(cfg.source("strategy"), cfg.strategy, f"does not compose with {what}: tensor, "
                            "pipeline and context parallelism run with FSDP2 over the data-parallel ranks",
                            strategy_hint(used))
        raise bad_value(cfg.source("strategy"), cfg.strategy, f"does not compose with {what} yet",
                        strategy_hint(used, policies=False))
    if cfg.cp > 1 and (cfg.tp > 1 or cfg.pp > 1):
        raise bad_value(cfg.source("cp"), cfg.cp, "does not combine with --tp/--pp yet", "context parallel with FSDP2")
    if cfg.cp > 1 and cfg.seq_len is not None and cfg.seq_len % (2 * cfg.cp):
        raise bad_value(cfg.source("seq_len"), cfg.seq_len, f"context parallelism over {cfg.cp} ranks cuts sequences "
                        f"into {2 * cfg.cp} equal chunks", f"a multiple of {2 * cfg.cp}")
    if cfg.pp > 1 and cfg.micro % (cfg.pp_microbatches or cfg.pp):
        n = cfg.pp_microbatches or cfg.pp
        raise bad_value(cfg.source("micro_batch"), cfg.micro, f"does not split into {n} pipeline micro-batches",
                        f"a micro-batch that is a multiple of {n}, or set --pp-microbatches")
    hf_model = cfg.model is not None and is_hf_path(cfg.model)
    if cfg.kernels != "auto" and ((cfg.model is not None and not hf_model) or cfg.example != "gpt"):
        raise bad_value(cfg.source("kernels"), cfg.kernels, "chooses the kernels of meshrun's built-in GPT and "
                        "of Hugging Face models", "drop it with a module:factory model or --example toy")
    if cfg.fused_loss and (cfg.model is not None or cfg.example != "gpt"):
        raise bad_value(cfg.source("fused_loss"), True, "is a loss of meshrun's built-in GPT",
                        "drop it, or compute your model's loss in chunks "
                        "(e.g. Liger-Kernel's fused linear cross-entropy)")
    if cfg.fused_loss and (cfg.tp > 1 or cfg.pp > 1):
        raise bad_value(cfg.source("fused_loss"), True, "does not combine with --tp/--pp (their loss is vocabulary-"
                        "parallel or per stage)", "drop --fused-loss: under --tp each rank holds 1/tp of the logits")
    if cfg.model is None and cfg.example == "gpt" and cfg.model_size not in GPT_PRESETS:
        raise bad_value(cfg.source("model_size"), cfg.model_size, "unknown GPT preset",
                        f"choose one of {', '.join(GPT_PRESETS)}")
    if cfg.model is not None and ":" not in cfg.model:
        model = locate(cfg.model, cfg.source("model"))  # a Hugging Face directory or config, or a clear error
        if cfg.init == "pretrained" and not model.has_weights:
            raise bad_value(cfg.source("init"), "pretrained", f"{model.directory} holds no *.safetensors weights",
                            "--init random to train from a random initialisation, or give the directory with weights")
        if os.path.abspath(cfg.model) != cfg.model:  # the workers may start elsewhere
            cfg = dataclasses.replace(cfg, model=os.path.abspath(cfg.model))
    elif cfg.init != "auto":
        raise bad_value(cfg.source("init"), cfg.init, "chooses the weights of a Hugging Face model directory",
                        "drop it, or give --model a model directory")
    data_form = data_kind(cfg.data) if cfg.data is not None and cfg.data not in BUILTIN_DATA else None
    if data_form is not None and cfg.data is not None:  # (a form only of a path given)
        if os.path.abspath(os.path.expanduser(cfg.data)) != cfg.data:
            cfg = dataclasses.replace(cfg, data=os.path.abspath(os.path.expanduser(cfg.data)))
    elif cfg.data is not None and ":" not in cfg.data and cfg.data not in BUILTIN_DATA:
        raise bad_value(cfg.source("data"), cfg.data, "no such file or directory, and not module:factory",
                        f"a corpus path, module:factory, or one of {', '.join(BUILTIN_DATA)}")
    if cfg.data_dtype not in ("uint16", "uint32"):
        raise bad_value(cfg.source("data_dtype"), cfg.data_dtype, "unknown token type", "uint16 or uint32")
    if cfg.document_mask:
        if data_form != "tokens" and data_form != "text":
            raise bad_value(cfg.source("document_mask"), True, "needs document boundaries: a corpus given by path",
                            "--data DIR prepared by meshrun data prepare, or text")
        if cfg.cp > 1 or cfg.pp > 1:
            raise bad_value(cfg.source("document_mask"), True, "does not combine with --cp/--pp",
                            "FSDP2 or TP with document masking")
    positive = ("steps", "seq_len", "log_every", "eval_batches", "ddp_bucket_mb")
    optional = ("micro_batch", "global_batch", "fsdp_shard_size", "tp", "pp", "pp_microbatches", "cp", "ep")
    for name in positive + optional:
        value = getattr(cfg, name)
        if value is not None and value < 1:
            raise bad_value(cfg.source(name), value, "must be at least 1")
    for name in ("warmup", "eval_every", "save_every", "keep_last"):
        value = getattr(cfg, name)
        if value is not None and value < 0:
            raise bad_value(cfg.source(name), value, "must be >= 0")
    # NaN compares false with everything, so finiteness is checked first, explicitly
    if not math.isfinite(cfg.lr) or cfg.lr <= 0:
        raise bad_value(cfg.source("lr"), cfg.lr, "must be a finite number > 0", "e.g. 3e-4")
    if not math.isfinite(cfg.min_lr_ratio) or not 0 <= cfg.min_lr_ratio <= 1:
        raise bad_value(cfg.source("min_lr_ratio"), cfg.min_lr_ratio, "must be between 0 and 1")
    if not math.isfinite(cfg.weight_decay) or cfg.weight_decay < 0:
        raise bad_value(cfg.source("weight_decay"), cfg.weight_decay, "must be a finite number >= 0",
                        "e.g. 0.1, or 0 for none")
    if not math.isfinite(cfg.grad_clip) or cfg.grad_clip < 0:
        raise bad_value(cfg.source("grad_clip"), cfg.grad_clip, "must be a finite number >= 0 (0 disables clipping)")
    if cfg.out is not None:
        check_output_dir(cfg.out, cfg.source("out"))
    if cfg.compile_tune and cfg.compile == "off":
        raise bad_value(cfg.source("compile_tune"), True, "tunes compiled kernels, but --compile is off",
                        "drop one of them")
    if cfg.seq_len is None and cfg.model is None and cfg.example == "gpt":  # a preset's own context
        cfg = dataclasses.replace(cfg, seq_len=seq_len_for(GPT_PRESETS[cfg.model_size].context),
                                  sources={**cfg.sources, "seq_len": "the preset's context"})
    return cfg


def _compile_word(value: object) -> str:
    return "on" if (value if isinstance(value, bool) else yes_no(str(value))) else "off"


def resolve_seq_len(cfg: TrainConfig, context: int | None) -> TrainConfig:
    """The config with its sequence length: the one given, else the model's ``context``
    (defaults.seq_len_for); checked again now that it is known."""
    if cfg.seq_len is not None:
        return cfg
    src = "the model's context" if context else "the default for a model that states no context"
    return validate(dataclasses.replace(cfg, seq_len=seq_len_for(context), sources={**cfg.sources, "seq_len": src}))


def load_file(path: str) -> dict[str, Any]:
    """Read a YAML or TOML config whose keys are the flag names (dashes or underscores)."""
    if not os.path.isfile(path):
        raise bad_value("--config", path, "no such file")
    try:
        if path.endswith(".toml"):
            import tomllib

            with open(path, "rb") as f:
                raw = tomllib.load(f)
        else:
            import yaml

            with open(path) as text:
                raw = yaml.load(text, Loader=_unique_key_loader(yaml)) or {}
    except ImportError:
        raise bad_value("--config", path, "YAML needs PyYAML", "pip install pyyaml, or use a .toml file") from None
    except MeshrunError:
        raise
    except Exception as exc:  # a parse error of either format
        raise bad_value("--config", path, f"cannot parse ({type(exc).__name__}: {exc})".replace("\n", " ")) from None
    if not isinstance(raw, dict):
        raise bad_value("--config", path, "must hold a mapping of option: value")
    known = {f.name for f in fields(TrainConfig)} - {"sources"}
    out: dict[str, Any] = {}
    spelled: dict[str, object] = {}  # each option's key as the file spells it
    for key, value in raw.items():
        name = str(key).replace("-", "_")
        if name not in known:
            raise bad_value(f"--config {path}", key, "unknown key", "keys are the flag names of meshrun train")
        if name in out:  # the same option spelled with dashes and with underscores
            raise bad_value(f"--config {path}", key, f"duplicate key: the same option as {spelled[name]!r}",
                            "keep one of them")
        out[name], spelled[name] = value, key
    return out


def _unique_key_loader(yaml: Any) -> Any:
    """PyYAML's safe loader, except that a key given twice in one mapping is refused (the
    plain loader keeps the last value without a word, silently dropping a setting), and so
    is any anchor (&) or alias (*): a config of flag values needs none, and aliases nested
    in aliases ("billion laughs") expand a few lines into gigabytes."""

    class UniqueKeyLoader(yaml.SafeLoader):
        def compose_node(self, parent: Any, index: Any) -> Any:
            event = self.peek_event()
            if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None) is not None:
                line = event.start_mark.line + 1
                raise bad_value("--config", self.name, f"uses a YAML anchor or alias (line {line})",
                                "write each value out: meshrun config files take no & anchors or * aliases")
            return super().compose_node(parent, index)

        def construct_mapping(self, node: Any, deep: bool = False) -> Any:
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    line = key_node.start_mark.line + 1
                    raise bad_value(f"--config {self.name}", key, f"duplicate key (line {line})", "keep one of them")
                seen.add(key)
            return super().construct_mapping(node, deep)

    return UniqueKeyLoader


def build_config(file_values: Mapping[str, Any], flag_values: Mapping[str, Any],
                 file_name: str | None = None, flag_sources: Mapping[str, str] | None = None) -> TrainConfig:
    """Defaults < config file < flags; each value remembers where it came from.
    ``flag_sources``: where a flag's value came from when not the command line (e.g.
    "env MESHRUN_STEPS"), so that an error about it names the variable."""
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, value in file_values.items():
        values[name], sources[name] = value, f"config {file_name}"
    for name, value in flag_values.items():
        if value is not None:
            values[name], sources[name] = value, (flag_sources or {}).get(name, "flag")
    types = {f.name: f.type for f in fields(TrainConfig)}
    for name, value in list(values.items()):
        values[name] = _coerce(name, value, str(types[name]), sources[name])
    try:
        return validate(TrainConfig(sources=sources, **values))
    except TypeError as exc:  # should not happen: keys are checked above
        raise MeshrunError(f"bad configuration: {exc}") from None


def _coerce(name: str, value: Any, type_name: str, source: str) -> Any:
    """Config files give strings or numbers loosely; turn them into the field's type."""
    where = f"--{name.replace('_', '-')} (from {source})" if source != "flag" else f"--{name.replace('_', '-')}"
    try:
        if "bool" in type_name:
            if isinstance(value, str):
                answer = yes_no(value)
                if answer is None:
                    raise ValueError
                return answer
            return bool(value)
        if "int" in type_name:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if "float" in type_name:
            return float(value)
        return str(value)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int() of an infinite float
        kind = type_name.replace(" | None", "")
        hint = {"bool": "true or false (1/0, yes/no, on/off)", "int": "a whole number",
                "float": "a number"}.get(kind, "")
        raise bad_value(where, value, f"expected {kind}", hint) from None
