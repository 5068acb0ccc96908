"""What `meshrun train --dry-run` says the ranks will decide: the run policy (config/policy.py) asked
as the ranks ask it, for the GPUs of this machine or of ``--gpu-mem``, else for processes on
the CPU.

On the CPU the policy reads nothing of the model, and the facts come from the config alone:
torch-free, like the rest of the dry run. For GPUs the model is built on the meta device as
the ranks build it (factories.build_model) and handed to parallel/auto.decide, the ranks' own
front-end, which traces it for the planner: that imports torch. The GPUs are taken to compute
in bf16 (Ampere and newer, as `meshrun plan` assumes).
"""

from __future__ import annotations

from typing import Any

from ..cluster.topology import Topology
from ..config import TrainConfig
from ..config.policy import Choice, Facts, resolve
from ..plan.adapters import Adapters
from ..plan.cards import Card
from .prelaunch import model_kind


def decisions(cfg: TrainConfig, topo: Topology, gpu_mem: int | None, card: Card | None = None,
              adapters: Adapters | None = None, cpu_mem: int | None = None) -> Choice:
    """What the ranks of ``cfg`` on ``topo`` decide, on GPUs of ``gpu_mem`` bytes each (None:
    processes on the CPU) of model ``card`` (None: not known), for a LoRA run of ``adapters`` (None: cfg's own --lora)
    (None: every parameter trains), on nodes of ``cpu_mem`` bytes of host memory (None: not
    known, an offload's need not checked). Raises MeshrunError where the ranks would refuse the run."""
    world, local = topo.world_size, topo.nproc_per_node
    dp = cfg.dp_size(world)
    if gpu_mem is None:
        kind = model_kind(cfg)
        facts = Facts(world=world, local_world=local, dp=dp, gpu_mem=None, bf16=False, hf=kind == "hf",
                      blocks=kind in ("gpt", "hf"), own_kernels=kind == "gpt")
        return resolve(None, cfg, facts)
    import torch

    from ..config import resolve_seq_len
    from ..kernels.hf import hf_kernels_apply
    from ..kernels.liger import liger_knows
    from ..modelinfo.read import context_of
    from ..training.factories import build_model
    from ..training.parallel.auto import decide

    with torch.device("meta"):
        model = build_model(cfg)
    cfg = resolve_seq_len(cfg, context_of(model))
    liger = cfg.kernels == "auto" and cfg.tp == 1 and cfg.pp == 1 and liger_knows(model)
    hf_kernels = cfg.kernels == "auto" and hf_kernels_apply(model, None, cfg.tp, cfg.pp)
    return decide(model, cfg, world, local, dp, gpu_mem, cfg.precision != "fp32", liger, card, adapters,
                  hf_kernels=hf_kernels, cpu_mem=cpu_mem)


def decided(cfg: TrainConfig, topo: Topology, gpu_mem: int | None, gpus: int,
            cpu_mem: int | None = None) -> tuple[dict[str, Any], list[str]]:
    """The dry run's decisions as JSON keys and as its short block of lines: for ``gpu_mem``
    when given, else for this machine's ``gpus`` (their memory read here), else the CPU; on
    nodes of ``cpu_mem`` bytes when given, else of this machine's memory where its own GPUs
    are decided for (with ``gpu_mem``, GPUs elsewhere: an offload's host memory not checked)."""
    where = "CPU processes"
    card = None
    if gpu_mem is None and gpus:
        from ..cluster.gpus import detect_gpu_memory, detect_gpu_name, host_memory
        from ..plan.cards import card_of_device

        gpu_mem = detect_gpu_memory()
        cpu_mem = host_memory() if cpu_mem is None else cpu_mem
        name = detect_gpu_name()  # this machine's card too, as the ranks read it
        card = card_of_device(name) if name else None
        if gpu_mem is None:
            note = "this machine's GPU memory could not be read (hint: --gpu-mem SIZE to decide for it)"
            return {"decided_for": None, "not_decided": note}, [f"not decided: {note}"]
    if gpu_mem is not None:
        from ..units import fmt_bytes

        where = f"{topo.world_size} GPU(s) of {fmt_bytes(gpu_mem)}"
    choice = decisions(cfg, topo, gpu_mem, card, cpu_mem=cpu_mem)
    return {"decided_for": where, **choice.summary()}, [f"decided for {where}:", *choice.lines()]
