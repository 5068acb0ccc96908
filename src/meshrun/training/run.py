"""What the Trainer's helpers read of the run they serve: the fields every one of them reads
(its runtime, config, the strategy chosen and why, the layout, the state, its data-parallel
size). The batch fit (batchfit.py) and the report (report.py) each extend it with what they
read besides, so that a helper sees the Trainer (trainer.py) only through what it uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ..config import TrainConfig
    from .parallel.auto import Choice
    from .parallel.layouts import Layout
    from .runtime import Runtime
    from .state import TrainState


class Run(Protocol):
    """What every helper of the Trainer reads of the run (the Trainer, trainer.py)."""

    rt: Runtime
    cfg: TrainConfig
    choice: Choice
    layout: Layout
    state: TrainState

    @property
    def dp_size(self) -> int: ...
