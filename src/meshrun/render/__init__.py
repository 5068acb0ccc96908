"""Job specs for Slurm, IBM LSF, SkyPilot, Kubernetes and Saturn Cloud, each a pure function of a RenderSpec.

The entry point of every spec is ``meshrun``: detection happens on the nodes, from the
variables each platform sets, so a spec never hard-codes ranks or addresses it cannot know.
"""

from __future__ import annotations

from collections.abc import Callable

from . import hostfile, kubernetes, lsf, saturn, skypilot, slurm
from .spec import TARGETS, RenderSpec, validate

RENDERERS: dict[str, Callable[[RenderSpec], str]] = {
    "slurm": slurm.render, "skypilot": skypilot.render, "kubernetes": kubernetes.render, "saturn": saturn.render,
    "hostfile": hostfile.render, "lsf": lsf.render,
}


def render(spec: RenderSpec) -> str:
    """The spec's text for its target (validated first)."""
    validate(spec)
    return RENDERERS[spec.target](spec)


__all__ = ["RENDERERS", "RenderSpec", "TARGETS", "render"]
