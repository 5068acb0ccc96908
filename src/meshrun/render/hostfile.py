"""DeepSpeed's hostfile: one ``host slots=G`` line per node, in node-rank order."""

from __future__ import annotations

from .spec import RenderSpec


def render(spec: RenderSpec) -> str:
    return "".join(f"{h} slots={spec.gpus_per_node}\n" for h in spec.hosts)
