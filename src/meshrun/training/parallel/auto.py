"""What a rank gets that the user left to meshrun, asked once, before anything is built: the
run policy (config/policy.py, shared with `meshrun plan` and `meshrun train --dry-run`) given
what the live model and this rank's devices tell. Its reasons are printed under the run's strategy line."""

from __future__ import annotations

from typing import Any

from ...config import TrainConfig
from ...config.policy import GATHERED_COPY_SHARE, Choice, Facts, compile_and_kernels, fsdp_flavour, resolve
from ...modelinfo.blocks import find_blocks
from ...modelinfo.read import from_module
from ...plan.adapters import Adapters
from ...plan.cards import Card

__all__ = ["GATHERED_COPY_SHARE", "Choice", "compile_and_kernels", "decide", "fsdp_flavour"]


def decide(model: Any, cfg: TrainConfig, world: int, local_world: int, dp: int, gpu_mem: int | None,
           bf16: bool, liger: bool = False, card: Card | None = None, adapters: Adapters | None = None,
           hf_kernels: bool = False, cpu_mem: int | None = None) -> Choice:
    """The choice for ``model`` trained with ``cfg`` on ``world`` processes (``local_world``
    per node) whose data-parallel size is ``dp``; ``gpu_mem`` is one GPU's memory (None on
    the CPU); ``bf16``: the run computes in bf16; ``liger``: Liger Kernel can patch the model
    here; ``hf_kernels``: meshrun's kernels for a Hugging Face model can (kernels/hf.py);
    ``card``: the GPU model, for its peaks (None: not known); ``adapters``: a LoRA run's
    (plan/adapters.py: rank, targets, quantize, dropout; None: those of cfg's --lora),
    planned with its frozen weights stored without gradients or optimizer state (the model
    may already hold PEFT's adapters: the planner reads the base model's shape either way);
    ``cpu_mem``: a node's host memory, which an offloaded optimizer state must fit (None: not
    checked; the trainer gives this node's, ``host_memory``).
    Pure: no process group, no device (the model may live on the meta device)."""
    from ...kernels.liger import mixture_of_experts
    from ..models.hf import is_transformers_model
    from ..models.hooks import KernelModel

    blocks = find_blocks(model, cfg.blocks) is not None
    facts = Facts(world=world, local_world=local_world, dp=dp, gpu_mem=gpu_mem, bf16=bf16, liger=liger,
                  hf_kernels=hf_kernels,
                  hf=is_transformers_model(model), experts=mixture_of_experts(model),
                  blocks=blocks, own_kernels=isinstance(model, KernelModel),
                  params=sum(p.numel() for p in model.parameters()), card=card, cpu_mem=cpu_mem)
    if gpu_mem is None:  # the CPU: the policy reads nothing of the model
        return resolve(None, cfg, facts)
    spec = from_module(model, type(model).__name__, "the model")

    def traced(compiled: bool, with_liger: bool, liger_loss: bool, with_hf_kernels: bool) -> Any:
        from ...plan.trace import with_trace  # (torch: imported when a GPU run plans)

        # what the model keeps for backward, traced on the meta device
        return with_trace(spec, model, cfg.seq, ("autocast", "bf16") if bf16 else ("fp32",), cfg.blocks, compiled,
                          with_liger, liger_loss, with_hf_kernels)

    return resolve(spec, cfg, facts, traced, adapters)
