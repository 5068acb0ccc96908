"""meshrun: detect the cluster, launch the right framework, run on many GPUs.

Importing meshrun is cheap (no torch, no framework): the helpers below import their
framework only when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

__all__ = ["Topology", "MeshrunError", "Trainer", "TrainConfig", "TrainResult", "DryRun", "detect", "run", "train",
           "tf_config", "jax_initialize", "__version__"]

if TYPE_CHECKING:
    from .api import detect, run
    from .cluster.topology import Topology
    from .config import TrainConfig
    from .errors import MeshrunError
    from .integrations.jax import jax_initialize
    from .integrations.tensorflow import tf_config
    from .job import TrainResult
    from .job.api import train
    from .job.dryrun import DryRun
    from .training.trainer import Trainer

_LAZY = {
    "Topology": ("meshrun.cluster.topology", "Topology"),
    "MeshrunError": ("meshrun.errors", "MeshrunError"),
    "detect": ("meshrun.api", "detect"),
    "run": ("meshrun.api", "run"),
    "tf_config": ("meshrun.integrations.tensorflow", "tf_config"),
    "jax_initialize": ("meshrun.integrations.jax", "jax_initialize"),
    "Trainer": ("meshrun.training.trainer", "Trainer"),
    "TrainConfig": ("meshrun.config", "TrainConfig"),
    "TrainResult": ("meshrun.job", "TrainResult"),
    "DryRun": ("meshrun.job.dryrun", "DryRun"),
    "train": ("meshrun.job.api", "train"),
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'meshrun' has no attribute {name!r}")
