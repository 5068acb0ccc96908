"""A SkyPilot task YAML as in the SkyPilot document: num_nodes, resources.accelerators, network_tier: best.

SkyPilot runs ``run`` on every node with SKYPILOT_NODE_IPS / NUM_NODES / NODE_RANK /
NUM_GPUS_PER_NODE set, which meshrun reads; the DeepSpeed native launcher's head-only rule
and its hostfile are meshrun's to handle (``meshrun launch -f deepspeed --deepspeed-launcher
native``).

What reaches the nodes: nothing local unless ``--workdir DIR`` is given (SkyPilot then uploads
DIR whole to ~/sky_workdir, where ``run`` starts, leaving out what DIR's .skyignore, else its
.gitignore, lists); meshrun, installed by ``setup`` on every node (this meshrun's version, with
its framework's extras; ``--setup`` replaces it, and an ``--image`` is taken to hold it); and
``--volume NAME:PATH``, a SkyPilot volume (``sky volumes apply``) mounted at PATH, where a run's
``--out`` outlives the cluster (volumes.py).
"""

from __future__ import annotations

import shlex
from typing import Any

import yaml

from .. import __version__
from .spec import RenderSpec
from .volumes import volume_parts

# meshrun's extras a node needs for each framework (pyproject.toml's optional dependencies)
EXTRAS = {"torch": "torch", "deepspeed": "torch,deepspeed", "accelerate": "torch,accelerate", "jax": "jax",
          "tensorflow": "tensorflow"}


class _Literal(str):
    pass


class _Dumper(yaml.SafeDumper):
    """safe_dump's dumper, writing _Literal strings as ``|`` blocks."""


_Dumper.add_representer(_Literal, lambda d, v: d.represent_scalar("tag:yaml.org,2002:str", v, style="|"))


def default_setup(spec: RenderSpec) -> str | None:
    """``setup`` when --setup is not given: this meshrun from PyPI with the framework's
    extras; none with an --image, which holds meshrun already."""
    if spec.image:
        return None
    return "pip install " + shlex.quote(f"meshrun[{EXTRAS[spec.framework]}]=={__version__}")


def render(spec: RenderSpec) -> str:
    # (validate() allows NAME:COUNT only where COUNT is gpus_per_node)
    gpu = spec.accelerator.split(":", 1)[0]
    resources: dict[str, Any] = {"accelerators": f"{gpu}:{spec.gpus_per_node}"} if spec.gpus_per_node else {}
    if spec.nodes > 1:
        resources["network_tier"] = "best"  # InfiniBand / EFA / GPUDirect-TCPX: the SkyPilot document
    if spec.image:
        resources["image_id"] = f"docker:{spec.image}"
    task: dict[str, Any] = {"name": spec.name, "num_nodes": spec.nodes, "resources": resources}
    if spec.workdir is not None:
        task["workdir"] = spec.workdir
    if spec.volume is not None:
        name, path = volume_parts(spec.volume)
        task["volumes"] = {path: name}
    setup = spec.setup if spec.setup is not None else default_setup(spec)
    if setup:  # (--setup '' runs none)
        task["setup"] = _Literal(setup.rstrip() + "\n")
    task["run"] = _Literal(spec.shell_command() + "\n")
    if spec.workdir is not None:
        uploads = f"# Uploads {spec.workdir} to ~/sky_workdir, where run starts, without what its .skyignore " \
            "(else its .gitignore) lists"
    else:
        uploads = "# Uploads nothing local (--workdir DIR would upload DIR)"
    if setup:
        installs = "# setup runs on every node before run"
    elif spec.image:
        installs = "# No setup: the image holds meshrun"
    else:
        installs = "# No setup (--setup ''): the nodes hold meshrun"
    head = ["# Rendered by `meshrun render skypilot`: sky launch -c NAME this.yaml", uploads, installs]
    body: str = yaml.dump(task, Dumper=_Dumper, sort_keys=False)
    return "\n".join(head) + "\n" + body
