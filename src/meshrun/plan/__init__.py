"""meshrun plan: the usual decision guide (DDP, then FSDP/ZeRO, then TP/PP) as a
memory and communication calculator.

Pure in the middle: ``ModelSpec`` + ``ClusterSpec`` + ``TrainSpec`` -> candidates (each a
per-GPU memory breakdown, CPU memory, communication volume and an estimated step time) ->
a recommendation with its reasons and warnings -> config files. Nothing here touches a GPU
or starts a process. A model's shape comes from ``meshrun.modelinfo``.
"""

from ..modelinfo.read import resolve_model
from ..modelinfo.spec import ModelSpec
from .recommend import Plan, check_inputs, make_plan
from .spec import ClusterSpec, TrainSpec

__all__ = ["ClusterSpec", "ModelSpec", "Plan", "TrainSpec", "check_inputs", "make_plan", "resolve_model"]
