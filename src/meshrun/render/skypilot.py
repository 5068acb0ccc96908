"""A SkyPilot task YAML as in the SkyPilot document: num_nodes, resources.accelerators, network_tier: best.

SkyPilot runs ``run`` on every node with SKYPILOT_NODE_IPS / NUM_NODES / NODE_RANK /
NUM_GPUS_PER_NODE set, which meshrun reads; the DeepSpeed native launcher's head-only rule
and its hostfile are meshrun's to handle (``meshrun launch -f deepspeed --deepspeed-launcher
native``)."""

from __future__ import annotations

from typing import Any

import yaml

from .spec import RenderSpec


class _Literal(str):
    pass


def _literal(dumper: yaml.SafeDumper, value: _Literal) -> yaml.Node:
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|")


def render(spec: RenderSpec) -> str:
    # (validate() allows NAME:COUNT only where COUNT is gpus_per_node)
    gpu = spec.accelerator.split(":", 1)[0]
    resources: dict[str, Any] = {"accelerators": f"{gpu}:{spec.gpus_per_node}"} if spec.gpus_per_node else {}
    if spec.nodes > 1:
        resources["network_tier"] = "best"  # InfiniBand / EFA / GPUDirect-TCPX: the SkyPilot document
    if spec.image:
        resources["image_id"] = f"docker:{spec.image}"
    task: dict[str, Any] = {"name": spec.name, "num_nodes": spec.nodes, "resources": resources, "workdir": "."}
    if spec.setup:
        task["setup"] = _Literal(spec.setup.rstrip() + "\n")
    task["run"] = _Literal(spec.shell_command() + "\n")
    dumper = yaml.SafeDumper
    dumper.add_representer(_Literal, _literal)
    head = "# Rendered by `meshrun render skypilot`: sky launch -c NAME this.yaml\n"
    body: str = yaml.dump(task, Dumper=dumper, sort_keys=False)
    return head + body
