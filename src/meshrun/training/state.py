"""TrainState: where a run is and how each step reads its data. The Trainer holds one; a
resume (saves.py) returns the one it found in the snapshot, the batch fit (batchfit.py)
the micro-batch it settled on, and the Trainer puts them in place. A snapshot records the
step, the schedule and the data position (``checkpoint.Position``, whose format on disk is
its own); the micro-batch and accumulation are the config's, which the snapshot carries too.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from .optim import Schedule


@dataclass(frozen=True)
class TrainState:
    """Frozen: a change is another TrainState that the Trainer assigns, so no other module
    changes the Trainer's in place."""

    micro_batch: int  # samples per rank per micro-step
    accum: int  # micro-steps per optimizer step: global batch = micro_batch x accum x data-parallel size
    # (from step, to step) pieces of the learning-rate schedule (optim.lr_factor); a resume
    # whose --steps differs from the snapshot's adds a piece
    schedule: Schedule
    step: int = 0  # optimizer steps done
    # Where the data stream starts: the epoch, and the global samples read in it (all ranks)
    epoch: int = 0
    samples: int = 0
    # Iterable data, which cannot seek: samples per rank its loader skips to reach a resumed
    # position (the stream then counts from 0 within the epoch)
    loader_skip: int = 0

    def replace(self, **changes: Any) -> TrainState:
        return dataclasses.replace(self, **changes)
