"""DeepSpeed ZeRO as a strategy of meshrun's trainer: the planner's ZeRO block, meshrun's
AdamW, DeepSpeed's own accumulation and clipping."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from ...plan.configs import zero_section
from ...vocab import StrategyKind
from ..models.hooks import ConfiguredModel
from ..optim import build_optimizer


def deepspeed_engine(model: nn.Module, kind: StrategyKind, micro: int, accum: int, dp: int, bf16: bool,
                     grad_clip: float, lr: float, weight_decay: float, cuda: bool) -> tuple[Any, Any]:
    """(the engine, the AdamW it wraps: the schedule drives its param groups, which
    DeepSpeed's optimizer shares)."""
    import deepspeed

    hidden = getattr(model.cfg, "d_model", 1024) if isinstance(model, ConfiguredModel) else 1024
    ds = {
        "train_batch_size": micro * accum * dp,
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        "bf16": {"enabled": bf16},
        "zero_optimization": zero_section(kind.zero, hidden, kind.offload != "none", kind.offload == "all"),
        "gradient_clipping": grad_clip,
        "steps_per_print": 10**9,
        # meshrun's AdamW also when the optimizer is offloaded (DeepSpeed's CPU Adam needs
        # a compiled extension; torch's runs everywhere, more slowly)
        "zero_force_ds_cpu_optimizer": False,
    }
    optimizer = build_optimizer(model, lr, weight_decay, fused=cuda, torchs=True)
    engine, _, _, _ = deepspeed.initialize(model=model, optimizer=optimizer, config=ds, dist_init_required=False)
    return engine, optimizer
