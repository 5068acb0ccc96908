"""Saturn Cloud (the Saturn Cloud document): a Job resource whose command is the same on every instance and
whose instance count is the number of nodes. Saturn sets SATURN_JOB_SCALE, SATURN_JOB_RANK,
SATURN_JOB_LEADER and the pieces of every peer's DNS name, which meshrun reads.

Rendered as a resource recipe (YAML) holding exactly the settings of the Job form: name,
image, command, instance count, start script. There is no published schema package to
check it against; the tests check its fields and that the command is meshrun's."""

from __future__ import annotations

from typing import Any

import yaml

from .spec import RenderSpec


def render(spec: RenderSpec) -> str:
    job: dict[str, Any] = {"type": "job", "spec": {
        "name": spec.name,
        "image": spec.image,
        "command": spec.shell_command(),
        "instance_count": spec.nodes,  # the Job's "instance count": SATURN_JOB_SCALE on every pod
        "gpus_per_instance": spec.gpus_per_node,
    }}
    if spec.setup:
        job["spec"]["start_script"] = spec.setup
    head = ("# Rendered by `meshrun render saturn`: the settings of a Saturn Cloud Job resource.\n"
            "# In the Job form: Command and Instance Count as below; pick an instance type with\n"
            f"# {spec.gpus_per_node} GPU(s). All pod-to-pod ports are open; meshrun uses {spec.port}.\n")
    body: str = yaml.safe_dump(job, sort_keys=False)
    return head + body
