"""The refusals the configuration alone decides, made by `meshrun train` before any process
starts and before anything is written to --out: the ranks would make each of them only after
starting, 10-20 s later, with the output directory already laid out.

Each rule is the rank's own, read from the code that refuses there, and no stricter: a
configuration is refused here only where every rank would refuse it, in the rank's words (the
tests match them). What only the built model can tell (a user's ``module:factory``, the block
classes of a Hugging Face model) and what depends on the GPUs' model (float8's compute
capability, the planner's micro-batch) is left to the ranks, whose checks stay: they also
guard a Trainer built in a user's script.

Torch-free: the numbers come from the config, the GPT presets (vocab.GPT_PRESETS) and the
data's files. A Hugging Face model's come from its config.json as transformers reads it, which
imports torch; job.check has read it, and built the model on the meta device, just before.
"""

from __future__ import annotations

import os
from typing import Any

from ..cluster.topology import Topology
from ..config import TrainConfig, resolve_seq_len
from ..errors import MeshrunError, bad_value
from ..training.factories import RANDOM_SAMPLES, TOY_SAMPLES, data_name, stdlib_train_bytes
from ..vocab import FLOAT8_PRECISIONS, GPT_PRESETS, LLAMA_LIKE, STRATEGIES


def check_layout(cfg: TrainConfig, topo: Topology, gpus: int | None) -> None:
    """Refuse, in the rank's one line, what the ranks would refuse of ``cfg`` on ``topo``:
    the sequence length, the precision (``gpus``: this node's visible GPUs, 0 when the ranks
    run on the CPU, None when unknown), a one-process strategy on a larger world, the model's
    split under --ep, --pp and --tp, and a global batch larger than the training data. In the
    order the ranks check them (worker.main, then Trainer.__init__ and parallelize)."""
    model = model_kind(cfg)
    config = _hf_config(cfg.model, cfg.source("model")) if model == "hf" and cfg.model else None
    seq = resolved_seq_len(cfg, model, config)
    check_precision(cfg, gpus)
    world = topo.world_size
    check_strategy(cfg, world)
    kind = STRATEGIES.get(cfg.strategy)
    if kind is None or kind.engine != "deepspeed":  # (DeepSpeed lays itself out: no --ep/--pp/--tp)
        if cfg.ep > 1:
            check_experts(cfg, world, model)
        elif cfg.pp > 1:
            check_pipeline(cfg, model, config, seq)
        elif cfg.tp > 1:
            check_tensor_parallel(cfg, model, seq)
    check_data(cfg, world, gpus, seq)


def model_kind(cfg: TrainConfig) -> str:
    """What the ranks build (factories.build_model): ``hf`` (a Hugging Face directory or
    config), ``factory`` (a user's ``module:function``), else the example: ``gpt`` or ``toy``."""
    if cfg.model:
        return "factory" if ":" in cfg.model else "hf"
    return cfg.example


def _hf_config(model: str, where: str) -> Any:
    """transformers' config of a Hugging Face model (modelinfo/hf.py: local files only)."""
    from ..modelinfo import hf

    return hf.load_config(hf.locate(model, where), where)


def resolved_seq_len(cfg: TrainConfig, model: str, config: Any) -> int | None:
    """The sequence length the ranks train at (worker.main: the one given, else the model's
    context), checked as they check it (config.resolve_seq_len: under --cp it must cut into
    2 x cp chunks); None where only the built model tells (a user's factory)."""
    if cfg.seq_len is not None:
        return cfg.seq_len
    if model == "factory":
        return None
    context = None
    if config is not None:  # modelinfo.read.context_of of the built model, from its config
        from types import SimpleNamespace

        from ..modelinfo.read import context_of

        context = context_of(SimpleNamespace(config=config))
    return resolve_seq_len(cfg, context).seq


def check_precision(cfg: TrainConfig, gpus: int | None) -> None:
    """bf16 and float8 on the CPU (Trainer.__init__, parallel/float8.check_device). On the
    CPU meshrun trains in fp32, the hint of both."""
    if gpus != 0:
        return
    if cfg.precision in FLOAT8_PRECISIONS:
        raise MeshrunError(f"{cfg.source('precision')}={cfg.precision!r}: float8 matmuls need a GPU of compute "
                           "capability 8.9 or newer (Ada, Hopper, Blackwell); this run is on the CPU "
                           "(hint: --precision auto or fp32)")
    if cfg.precision == "bf16":
        raise MeshrunError("--precision='bf16': this run is on CPU, where meshrun trains in fp32 "
                           "(hint: use --precision auto or fp32)")


def check_strategy(cfg: TrainConfig, world: int) -> None:
    """A one-process strategy on a world of more (parallel/auto.decide)."""
    kind = STRATEGIES.get(cfg.strategy)
    if kind is not None and kind.one_process and world > 1:
        raise bad_value(cfg.source("strategy"), cfg.strategy, f"runs one process, but the world has {world}",
                        "use --nproc 1, or --strategy ddp/fsdp")


def check_experts(cfg: TrainConfig, world: int, model: str) -> None:
    """--ep: the world split into expert groups (parallel/apply.layout_dims), then the experts
    shared out (apply.Build.expert_parallel, expert.shard_experts, models/moe.MoE): a model
    on the meta device (a Hugging Face one), a model without experts, experts that do not
    split. A user's factory is left to the ranks: only the built model says what it holds."""
    from ..training.parallel.dims import make_dims

    make_dims(world, ep=cfg.ep, source=f"--ep {cfg.ep} on {world} processes")
    if model == "hf":
        raise MeshrunError(f"--ep={cfg.ep}: expert parallelism is built for meshrun's GPT with --experts "
                           "(hint: an FSDP2 strategy for this model)")
    if model == "toy" or (model == "gpt" and not cfg.experts):
        raise MeshrunError(f"--ep={cfg.ep}: the model has no experts (hint: --experts E with meshrun's GPT)")
    if model == "gpt" and cfg.experts % cfg.ep:
        raise MeshrunError(f"--ep={cfg.ep}: {cfg.experts} experts do not split over {cfg.ep} ranks "
                           f"(hint: an --ep that divides {cfg.experts})")


def _gpt_heads(cfg: TrainConfig) -> None:
    """meshrun's GPT's attention heads split over --tp (parallel/tp.apply_tp)."""
    heads = GPT_PRESETS[cfg.model_size].n_heads
    if heads % cfg.tp:
        raise bad_value("--tp", cfg.tp, f"the model's {heads} attention heads do not split over {cfg.tp} ranks",
                        f"a --tp that divides {heads}")


def check_pipeline(cfg: TrainConfig, model: str, config: Any, seq: int | None) -> None:
    """--pp (apply.Build.pipelined): meshrun's GPT's heads over --tp first, then at least one
    block per stage (parallel/pipeline.split_layers; the interleaved schedule has two stages a
    rank). For a Hugging Face model of the families pipelines cut, whose layers attend to the
    whole prefix (pipeline.stage_kind's other refusals come first: left to the ranks), the
    same from its config's layer count, without --tp (whose plan needs the built blocks)."""
    if cfg.blocks is not None:  # (another block list than the one found: the ranks' to read)
        return
    stages = cfg.pp * (2 if cfg.pp_schedule == "interleaved" else 1)
    if model == "gpt":
        if cfg.tp > 1:
            if cfg.experts:  # (a mixture-of-experts block has no tensor-parallel plan: the ranks say so)
                return
            _gpt_heads(cfg)
        layers: int | None = GPT_PRESETS[cfg.model_size].n_layers
    elif model == "hf" and cfg.tp == 1 and seq is not None and _whole_prefix_family(config, seq):
        layers = getattr(config, "num_hidden_layers", None)
    else:
        return
    if isinstance(layers, int) and layers < stages:
        raise MeshrunError(f"--pp: the model has {layers} blocks, fewer than the {stages} pipeline stages "
                           "(hint: a smaller --pp, or the 1f1b schedule: interleaved uses two stages per rank)")


def _whole_prefix_family(config: Any, seq: int) -> bool:
    """A Hugging Face model that pipeline.stage_kind cuts into stages without a refusal of its
    own: one of the LLAMA_LIKE families, attending to the whole prefix at ``seq`` (no sliding
    window shorter than it, no capped logits: models/hf.check_whole_prefix)."""
    if str(getattr(config, "model_type", "")) not in LLAMA_LIKE:
        return False
    window = getattr(config, "sliding_window", None)
    if window and getattr(config, "use_sliding_window", True) and window < seq:
        return False
    return not getattr(config, "attn_logit_softcapping", None)


def check_tensor_parallel(cfg: TrainConfig, model: str, seq: int | None) -> None:
    """--tp without --pp (apply.Build._tensor_parallel) for meshrun's GPT: its heads split over
    the ranks, then, with sequence parallelism (on for its blocks unless --sequence-parallel
    off), the sequence. A Hugging Face model's tensor-parallel plan is chosen from its built
    blocks' modules: left to the ranks."""
    if model != "gpt" or cfg.experts or cfg.blocks is not None:
        return
    _gpt_heads(cfg)
    if cfg.sequence_parallel and seq is not None and seq % cfg.tp:
        raise bad_value(cfg.source("seq_len"), seq, f"does not split over --tp {cfg.tp} for sequence parallelism",
                        f"a multiple of {cfg.tp}, or --sequence-parallel off")


def check_data(cfg: TrainConfig, world: int, gpus: int | None, seq: int | None) -> None:
    """At least one global batch of training samples (Trainer.__init__), where both are known
    before the ranks start: the built-in data and a token corpus given by path (not text,
    tokenized after this check, nor a user's Dataset factory), a known sequence length, and a
    batch the ranks take as configured: not sized by the planner on GPUs, nor kept from a
    snapshot a resume starts from (resize.keep_global_batch)."""
    if seq is None or not _batch_as_configured(cfg, gpus):
        return
    samples = train_samples(cfg, seq)
    if samples is None:
        return
    dp = cfg.dp_size(world)
    accum, micro = cfg.accumulation(dp), cfg.micro_for(dp)
    batch = micro * accum * dp
    if samples < batch:
        raise MeshrunError(
            f"the training data has {samples} samples" + (f" of {seq} tokens" if cfg.example == "gpt" else "")
            + f": fewer than one global batch of {batch} (micro-batch {micro} x {accum} x {dp} data-parallel "
            "ranks) (hint: a smaller --global-batch or --seq-len, or more data)")


def _batch_as_configured(cfg: TrainConfig, gpus: int | None) -> bool:
    """Whether the ranks train at the config's micro-batch and global batch (parallel/auto
    decide): on the CPU, with --micro-batch given, or under --tp/--pp/--cp/--ep; on GPUs the
    planner sizes an open micro-batch. A resume may keep its snapshot's global batch instead
    when none is given."""
    if cfg.global_batch is None and _may_resume(cfg):
        return False
    return cfg.micro_batch is not None or max(cfg.tp, cfg.pp, cfg.cp, cfg.ep) > 1 or gpus == 0


def _may_resume(cfg: TrainConfig) -> bool:
    """Whether the ranks may start from a snapshot (snapshots.resume_path): --resume PATH, or
    auto with snapshots under OUT/checkpoints."""
    if cfg.resume == "none":
        return False
    if cfg.resume != "auto":
        return True
    return cfg.out is not None and os.path.isdir(os.path.join(cfg.out, "checkpoints"))


def train_samples(cfg: TrainConfig, seq: int) -> int | None:
    """The samples of the training split the ranks build (factories.build_data), where they
    are known without torch: the built-in data's, and a token corpus' ``seq``-token windows
    (data.PackedTokens); None for text and a user's factory."""
    name = data_name(cfg)
    if name == "stdlib":  # data.stdlib_splits: windows of bytes
        return max(0, (stdlib_train_bytes() - 1) // seq)
    if name == "random":
        return RANDOM_SAMPLES
    if name == "toy":
        return TOY_SAMPLES
    from ..data.sources import chat_kind, data_kind

    if data_kind(name) != "tokens":
        return None
    if chat_kind(name):  # examples packed whole (data/packing.py)
        from ..data.packing import pack
        from ..data.store import open_tokens

        return len(pack(open_tokens(name, cfg.data_dtype, cfg.source("data")).splits["train"], seq))
    tokens = _corpus_train_tokens(name, cfg.data_dtype, cfg.source("data"), cfg.document_mask)
    return None if tokens is None else max(0, (tokens - 1) // seq)


def _corpus_train_tokens(path: str, dtype: str, where: str, document_mask: bool) -> int | None:
    """The training split's tokens of a token corpus: a prepared corpus' index says it (its
    shards are checked against it when job.corpus_ready opens it), flat token files' sizes.
    None for fewer than 2 (corpus_ready refuses an empty corpus), and for flat files under
    --document-mask, which the ranks refuse first (data.corpus_splits)."""
    from ..data import INDEX
    from ..data.store import open_tokens, read_index

    if os.path.isdir(path) and os.path.isfile(os.path.join(path, INDEX)):
        tokens = int(read_index(path, where)["splits"]["train"]["tokens"])
    elif document_mask:
        return None
    else:
        tokens = len(open_tokens(path, dtype, where).splits["train"])  # (memory-mapped: nothing read)
    return tokens if tokens >= 2 else None
