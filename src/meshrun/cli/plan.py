"""`meshrun plan`: which strategy fits, how much memory each needs, and the config files."""

from __future__ import annotations

import argparse
import json
from collections.abc import Mapping
from typing import Any

from ..cluster.gpus import count_visible_gpus, detect_gpu_memory, detect_gpu_name
from ..cluster.topology import MAX_GPUS_PER_NODE, MAX_NODES
from ..config import TrainConfig
from ..config.policy import Facts, Settings, resolve, settings
from ..config.sections import STRATEGY_CHOICES
from ..defaults import COMPILE_CHOICES, KERNELS, seq_len_for
from ..errors import MeshrunError, bad_value
from ..modelinfo.read import resolve_with_module
from ..modelinfo.spec import PRESETS, ModelSpec
from ..paths import check_output_dir
from ..plan import ClusterSpec, TrainSpec, check_inputs, make_plan
from ..plan.adapters import Adapters
from ..plan.advice import check_choice, named, verdict
from ..plan.cards import CARDS, Card, card_of_device
from ..plan.spec import INTER_NODE, INTRA_NODE, OPTIMIZERS
from ..plan.steptime import MAX_MICRO_TOKENS
from ..units import parse_bytes
from ..vocab import (
    AC_MODES,
    FLOAT8_PRECISIONS,
    GPT_PRESETS,
    LORA_ALL_LINEAR,
    LORA_KINDS,
    PRECISIONS,
    QUANTIZE_CHOICES,
)
from .options import add_option, int_option

PLAN_HELP = f"""\
Plan a training run before it wastes a cluster: the per-GPU memory of every strategy
(parameters, gradients, optimizer state, activations, the loss's logits spike, buffers,
CUDA context), whether it fits, the communication per step and an estimated step time at
the card's peak; the recommendation first, with the rule it was picked by and its reasons:

  does a replica fit?           -> DDP (or gradient accumulation on one GPU)
  with optimizer + grads sharded -> ZeRO-2 / FSDP grad_op
  with everything sharded       -> ZeRO-3 / FSDP full shard
  still out of memory           -> + activation checkpointing, CPU offload, or TP x PP

Models: a preset ({', '.join(PRESETS)}), a HuggingFace config.json (or its folder; nothing is
downloaded), or module:factory for any nn.Module (built on the meta device: no memory used).

examples:
  meshrun plan --model llama-7b --gpus-per-node 8 --gpu h100
  meshrun plan --model llama3-8b --gpus-per-node 8 --gpu l4 --precision fp8
  meshrun plan --model gpt-1.3b --gpu-mem 80GiB --gpus-per-node 4 --global-batch 256 --write plans/
  meshrun plan --model ./llama/config.json --nnodes 4 --gpus-per-node 8 --gpu-mem 80GiB --inter ib
  meshrun plan --model llama-70b --gpus-per-node 8 --gpu-mem 80GiB --framework deepspeed --json
  meshrun plan --model llama-13b --gpu-mem 40GiB --strategy zero3-offload   # check a choice
  meshrun plan --explain                                   # the formulas, with this plan's numbers
  meshrun plan --model ./llama3-8b --lora 16 --gpus-per-node 1 --gpu h200   # LoRA: adapters train, the rest frozen
  meshrun plan --model llama3-70b --lora 16 --quantize nf4 --gpus-per-node 2 --gpu h100   # QLoRA

The GPU's model, memory and count are read from this machine when it has GPUs; elsewhere give
--gpu (its peak and memory) or --gpu-mem (an H100/H200 SXM's peak is then assumed, and said).
Memory predictions are calibrated against measured runs (docs/decisions.md#planner-constants).
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plan", help="per-GPU memory of each strategy, the one to use, and its config files",
                       description=PLAN_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    g = p.add_argument_group("model")
    add_option(g, "--model", "--model-size", metavar="PRESET|CONFIG.JSON|MODULE:FACTORY", default="gpt-small",
               help="what to plan for (default gpt-small, meshrun train's default job)")
    g = p.add_argument_group("cluster")
    add_option(g, "--nnodes", "--nodes", metavar="N", help="nodes (default 1; --nodes is the same)")
    add_option(g, "--gpus-per-node", metavar="G", help="GPUs per node (default: this machine's, else 8)")
    add_option(g, "--gpu", metavar="NAME", help=f"the GPU model, for its peak TFLOP/s and memory: {', '.join(CARDS)} "
               "(default: this machine's GPU; with --gpu-mem alone, an H100/H200 SXM's peaks are assumed, and said)")
    add_option(g, "--gpu-mem", metavar="SIZE", help="memory per GPU, e.g. 80GiB (default: --gpu's, else this "
               "machine's GPU)")
    add_option(g, "--cpu-mem", metavar="SIZE", help="CPU memory per node, for offload (e.g. 1TiB)")
    add_option(g, "--intra", metavar="nvlink|pcie|GB/s", default="nvlink",
               help="GPU-to-GPU within a node (default nvlink)")
    add_option(g, "--inter", metavar="ib|efa|ethernet|GB/s", default="ib", help="between nodes, per GPU (default ib)")
    g = p.add_argument_group("training")
    add_option(g, "--seq-len", metavar="T", help="tokens per sample (default: the model's context, at most 4096, "
               "as meshrun train)")
    add_option(g, "--micro-batch", metavar="B", help="per-GPU batch (default: the largest that fits, as meshrun train)")
    add_option(g, "--global-batch", metavar="B", help="samples per optimizer step over all GPUs (default: about 512K "
               "tokens' worth when no batch size is given, as meshrun train; a micro-batch alone: no accumulation)")
    add_option(g, "--precision", choices=(*PRECISIONS, *FLOAT8_PRECISIONS), default="bf16",
               help="bf16 (mixed, default), fp32, or fp8 / fp8-rowwise (bf16 with torchao's float8 matmuls in the "
                    "large linear layers, compiled, as meshrun train --precision fp8)")
    add_option(g, "--optimizer", choices=tuple(OPTIMIZERS), default="adamw", help="adamw (default), sgd, adam8bit")
    add_option(g, "--activation-checkpointing", choices=("auto", *AC_MODES), default="auto",
               help="auto: plan with and without (default), none, full")
    add_option(g, "--compile", choices=COMPILE_CHOICES, default="auto",
               help="plan for compiled training: auto (default: on, as meshrun train on GPUs), on, off (eager)")
    add_option(g, "--kernels", choices=KERNELS, default="auto",
               help="auto (default, as meshrun train): a Hugging Face model Liger Kernel knows, with Liger "
               "installed here, is planned with Liger's fused kernels, eager (--compile on: compiled instead); "
               "plain: without them")
    g = p.add_argument_group("fine-tuning (as meshrun train's options)")
    add_option(g, "--lora", metavar="RANK", help="plan a LoRA run: adapters of this rank train, every other weight is "
               "frozen (stored, no gradients or optimizer state)")
    add_option(g, "--lora-alpha", metavar="A", help="the adapters' scale numerator (checked; the plan does not depend "
               "on it)")
    add_option(g, "--lora-dropout", metavar="P", help="dropout on the adapters' inputs (default 0: with it, a dropped "
               "copy of each adapted layer's input and its mask are kept for backward)")
    add_option(g, "--lora-targets", metavar="KINDS", help=f"the layers that get adapters: {LORA_ALL_LINEAR} (default: "
               f"every linear layer but the output head), kinds {','.join(LORA_KINDS)}, or module names")
    add_option(g, "--quantize", choices=QUANTIZE_CHOICES, help="how the frozen weights are stored (with --lora): none "
               "(default: in the precision the run computes in), nf4 (QLoRA: the adapted layers' weights in "
               "torchao's NF4, 4.13 bits a weight)")
    g = p.add_argument_group("choice and output")
    add_option(g, "--framework", choices=("torch", "deepspeed", "any"), default="torch", dest="plan_framework",
               help="recommend among torch-native strategies (default), DeepSpeed's, or any")
    add_option(g, "--strategy", metavar="NAME", help="check this strategy (a table name): fits? needed?")
    add_option(g, "--margin", metavar="F", default="0.1", help="fraction of GPU memory kept free (default 0.1)")
    add_option(g, "--json", action="store_true", help="print one JSON object")
    add_option(g, "--explain", action="store_true", help="show the formulas, with this plan's numbers")
    add_option(g, "--write", metavar="DIR", help="write ds_config.json, accelerate.yaml and train.yaml there")
    p.set_defaults(func=cmd_plan)


def _bandwidth(text: str, table: Mapping[str, float], where: str) -> float:
    if text in table:
        return table[text]
    try:
        value = float(text.lower().removesuffix("gb/s")) * 1e9
    except ValueError:
        raise bad_value(where, text, "unknown", f"one of {', '.join(table)}, or a number of GB/s") from None
    if value <= 0:
        raise bad_value(where, text, "must be positive")
    return value


def cluster_from_args(ns: argparse.Namespace, env: Mapping[str, str]) -> ClusterSpec:
    gpus_here = count_visible_gpus(env)
    sources = []
    gpn = int_option(ns, "gpus_per_node", 1, (MAX_GPUS_PER_NODE, "more is past any machine built"))
    if gpn is None:
        gpn = gpus_here or 8
        sources.append(("gpus_per_node", "this machine" if gpus_here else "assumed: an 8-GPU node"))
    card = gpu_option(ns)
    if ns.gpu_mem is not None:
        mem = parse_bytes(ns.gpu_mem, "--gpu-mem")
    elif card is not None:
        mem = card.memory
        sources.append(("gpu_mem", f"the {card.title}'s datasheet"))
    else:
        found = detect_gpu_memory() if gpus_here else None
        if found is None:
            raise bad_value("--gpu-mem", None, "no GPU on this machine to read it from",
                            "give the GPUs you plan for, e.g. --gpu h100 or --gpu-mem 80GiB")
        mem = found
        sources.append(("gpu_mem", "this machine's GPU 0"))
        name = detect_gpu_name()  # the card too: the plan is for this machine's GPUs
        card = card_of_device(name) if name else None
        if name:
            sources.append(("gpu", f"this machine's {name}" + ("" if card else ", not a card meshrun knows")))
    cpu = parse_bytes(ns.cpu_mem, "--cpu-mem") if ns.cpu_mem is not None else None
    nodes = int_option(ns, "nnodes", 1, (MAX_NODES, "more is past any cluster built")) or 1
    return ClusterSpec(nodes=nodes, gpus_per_node=gpn, gpu_mem=mem, cpu_mem=cpu,
                       intra_bw=_bandwidth(ns.intra, INTRA_NODE, "--intra"),
                       inter_bw=_bandwidth(ns.inter, INTER_NODE, "--inter"), card=card, sources=tuple(sources))


def gpu_option(ns: argparse.Namespace) -> Card | None:
    """The card --gpu names (None when not given); a name not in plan/cards.py is refused."""
    if ns.gpu is None:
        return None
    card = CARDS.get(ns.gpu.strip().lower())
    if card is None:
        where = getattr(ns, "_env_sources", {}).get("gpu", "--gpu")
        leave = f"unset {where.removeprefix('env ')}" if where.startswith("env ") else "drop --gpu"
        raise bad_value(where, ns.gpu, "not a GPU meshrun plan knows",
                        f"one of {', '.join(CARDS)}; for another card {leave} and give --gpu-mem SIZE: step~ then "
                        "assumes an H100/H200 SXM's peaks")
    return card


def _number(ns: argparse.Namespace, name: str, low: float, high: float | None, hint: str) -> float | None:
    """A number option given as text: None when unset; a bad value a one-line error."""
    raw = getattr(ns, name)
    if raw is None:
        return None
    flag = getattr(ns, "_env_sources", {}).get(name, "--" + name.replace("_", "-"))
    try:
        value = float(raw)
    except ValueError:
        raise bad_value(flag, raw, "not a number", hint) from None
    if not (low <= value < high if high is not None else value > low):  # (NaN fails both)
        span = f"in [{low:g}, {high:g})" if high is not None else f"> {low:g}"
        raise bad_value(flag, raw, f"must be {span}", hint)
    return value


def adapters_from_args(ns: argparse.Namespace) -> Adapters | None:
    """The LoRA run --lora and its options describe (None: a full fine-tune); each of its
    options given without --lora is refused (it would plan nothing)."""
    rank = int_option(ns, "lora", 1, (1 << 16, "no adapted layer is that wide"))
    if rank is None:
        given = [n for n in ("lora_alpha", "lora_dropout", "lora_targets") if getattr(ns, n) is not None]
        if ns.quantize == "nf4":
            raise bad_value("--quantize", "nf4", "quantizes the frozen weights of a LoRA run; --lora is not given",
                            "add --lora RANK (e.g. --lora 16), or drop --quantize")
        if given:
            flag = "--" + given[0].replace("_", "-")
            raise bad_value(flag, getattr(ns, given[0]), "configures adapters; --lora is not given",
                            f"add --lora RANK (e.g. --lora 16), or drop {flag}")
        return None
    _number(ns, "lora_alpha", 0.0, None, "a positive number, e.g. 32")
    dropout = _number(ns, "lora_dropout", 0.0, 1.0, "e.g. 0.05, or 0 for none")
    targets: tuple[str, ...] = (LORA_ALL_LINEAR,)
    if ns.lora_targets is not None:
        targets = tuple(x.strip() for x in str(ns.lora_targets).split(","))
        if not all(targets):
            raise bad_value("--lora-targets", ns.lora_targets, "has an empty name",
                            f"kinds separated by commas, e.g. q,k,v,o, or {LORA_ALL_LINEAR}")
    return Adapters(rank, targets, ns.quantize or "none", dropout or 0.0)


def run_config(ns: argparse.Namespace, context: int | None) -> TrainConfig:
    """The `meshrun train` config of what this plan was given, for the run policy: the same
    options, read as meshrun train reads them (a strategy it does not take by name: auto)."""
    given: dict[str, Any] = {"micro_batch": int_option(ns, "micro_batch", 1),
                             "global_batch": int_option(ns, "global_batch", 1), "precision": ns.precision,
                             "compile": ns.compile, "kernels": ns.kernels,
                             "strategy": ns.strategy if ns.strategy in STRATEGY_CHOICES else None,
                             "activation_checkpointing": None if ns.activation_checkpointing == "auto"
                             else ns.activation_checkpointing,
                             # a LoRA run's compile and kernels are its own (policy.compile_and_kernels)
                             "lora": int_option(ns, "lora", 1), "quantize": ns.quantize}
    seq = int_option(ns, "seq_len", 1)
    sources = {k: "flag" for k, v in given.items() if v is not None}
    if seq is None:
        seq, sources["seq_len"] = seq_len_for(context), "the model's context"
    else:
        sources["seq_len"] = "flag"
    return TrainConfig(seq_len=seq, sources=sources, **{k: v for k, v in given.items() if v is not None})


def run_facts(cluster: ClusterSpec, precision: str, module: Any, builtin_gpt: bool) -> Facts:
    """What the run policy needs to know of the GPUs and the model: ``module``, the model as
    resolve_with_module built it on the meta device (None for a preset of published shapes);
    ``builtin_gpt``: meshrun's GPT, with its own kernels. bf16 as the GPUs meshrun plans for
    (Ampere and newer) compute it."""
    hf = liger = hf_kernels = experts = False
    blocks = True
    if module is not None:
        from ..kernels.hf import hf_kernels_apply
        from ..kernels.liger import liger_knows, mixture_of_experts
        from ..modelinfo.blocks import find_blocks
        from ..training.models.hf import is_transformers_model

        hf, blocks = is_transformers_model(module), find_blocks(module) is not None
        liger = hf and liger_knows(module)
        hf_kernels = hf and hf_kernels_apply(module)
        experts = mixture_of_experts(module)
    return Facts(world=cluster.world, local_world=cluster.gpus_per_node, dp=cluster.world, gpu_mem=cluster.gpu_mem,
                 bf16=precision != "fp32", liger=liger, hf_kernels=hf_kernels, hf=hf, experts=experts,
                 blocks=blocks,
                 own_kernels=builtin_gpt, card=cluster.card)


def train_spec(ns: argparse.Namespace, cfg: TrainConfig, s: Settings, hf: bool) -> TrainSpec:
    """The training settings the plan's table is made for: the run policy's compile setting
    and default global batch (``s``), and the plan's own optimizer and checkpointing choice."""
    ac = None if ns.activation_checkpointing == "auto" else ns.activation_checkpointing
    return TrainSpec(seq_len=cfg.seq, micro_batch=cfg.micro_batch, global_batch=s.global_batch,
                     precision=ns.precision, optimizer=ns.optimizer, activation_checkpointing=ac, compile=s.compile,
                     max_micro_batch=max(1, MAX_MICRO_TOKENS // cfg.seq) if cfg.micro_batch is None else None,
                     whole_compile=not hf, adapters=adapters_from_args(ns))


def traced(model: ModelSpec, module: Any, text: str, train: TrainSpec, liger: bool, kernels: str,
           liger_loss: bool = False, hf_kernels: bool = False) -> ModelSpec:
    """``model`` with what it keeps for backward traced at the plan's sequence length, when
    torch can build it on the meta device: meshrun's GPT as `meshrun train` builds it on GPUs
    (with ``kernels`` auto, its Triton loss and fused MLP), a Hugging Face config or a
    ``module:factory`` (``module``, as resolve_with_module built it), with Liger Kernel's
    kernels when ``liger`` (its fused loss alone after compiled blocks: ``liger_loss``),
    meshrun's (kernels/hf.py) when ``hf_kernels``. Other presets (published shapes with no
    module here) keep the estimate from their shape."""
    import importlib.util

    from ..vocab import GPT_PRESETS

    if text in GPT_PRESETS and importlib.util.find_spec("torch") is not None:
        import torch

        from ..training.models.gpt import gpt

        own = kernels == "auto"
        with torch.device("meta"):
            module = gpt(text, seq_len=train.seq_len, head_loss=own, fused_mlp="auto" if own else False)
    if module is None:
        return model
    from ..plan.trace import with_trace

    modes = ("fp32",) if train.precision == "fp32" else ("autocast", "bf16")
    return with_trace(model, module, train.seq_len, modes, compiled=train.compile, liger=liger,
                      liger_loss=liger_loss, hf_kernels=hf_kernels)


def cmd_plan(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    try:
        margin = float(ns.margin)
    except ValueError:
        raise bad_value("--margin", ns.margin, "not a number", "e.g. 0.1 keeps 10% of GPU memory free") from None
    if not 0 <= margin < 1:
        raise bad_value("--margin", ns.margin, "must be in [0, 1)", "e.g. 0.1")
    if ns.write:
        check_output_dir(ns.write, "--write")
    model, module = resolve_with_module(ns.model, "--model")
    cluster = cluster_from_args(ns, env)
    cfg = run_config(ns, model.context)
    facts = run_facts(cluster, ns.precision, module, ns.model in GPT_PRESETS)
    s = settings(cfg, facts)  # the run policy's compile, kernels and default batch, as meshrun train's
    train = train_spec(ns, cfg, s, facts.hf)
    check_inputs(model, cluster, train)  # before the trace: a refusal in under a second
    if ns.strategy:
        named(ns.strategy, make_plan(model, cluster, train, ns.plan_framework, margin).candidates)
    shape = model
    model = traced(model, module, ns.model, train, s.liger, ns.kernels, s.liger_loss, s.hf_kernels)
    plan = make_plan(model, cluster, train, ns.plan_framework, margin)
    if s.liger:
        plan.reasons.append("Liger Kernel's fused kernels (installed here), eager, as meshrun train runs this model "
                            "with --compile off")
    elif s.liger_loss:
        plan.reasons.append("compiled per block, with Liger Kernel's fused linear cross-entropy for the loss, as "
                            "meshrun train runs this model (--kernels plain to plan without it)")
    if s.hf_kernels:
        plan.reasons.append("meshrun's tanh GELU and head loss where they apply to this model (kernels/hf.py), "
                            "as meshrun train runs it (--kernels plain to plan without them)")
    if ns.strategy:
        plan.reasons.append(verdict(ns.strategy, plan.candidates, plan.recommended))
        plan.warnings.extend(check_choice(ns.strategy, plan.candidates, plan.recommended))
    written = []
    if ns.write:
        from ..plan.configs import write_all

        written = write_all(plan, ns.write)
    if ns.json:
        out = plan.to_dict()
        out["written"] = written
        out["run"] = run_summary(shape, model, cfg, facts, train.adapters)
        print(json.dumps(out, indent=2))
    else:
        from ..plan.show import print_plan

        print_plan(plan, written, ns.explain)
    return 0


def run_summary(shape: ModelSpec, traced_model: ModelSpec, cfg: TrainConfig, facts: Facts,
                adapters: Adapters | None = None) -> dict[str, Any]:
    """What `meshrun train` with these options does on this cluster (the run policy, as
    `meshrun train --dry-run` prints it), or the line it refuses the run with."""
    try:
        return resolve(shape, cfg, facts, lambda compiled, liger, liger_loss, hf_kernels: traced_model,
                       adapters).summary()
    except MeshrunError as exc:
        return {"refused": str(exc)}
