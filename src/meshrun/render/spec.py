"""What to render (a RenderSpec), validated. The renderers are in the modules beside this
one; ``meshrun.render.render`` dispatches to them."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass, field

from ..errors import bad_value
from ..vocab import FRAMEWORKS

TARGETS = ("slurm", "skypilot", "kubernetes", "saturn", "hostfile")
SIGNAL_BEFORE_S = 120  # Slurm's warning before the time limit: a step and a snapshot fit in it
_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,50}[a-z0-9])?$")


@dataclass(frozen=True)
class RenderSpec:
    target: str
    command: tuple[str, ...]  # what every node runs (meshrun ... or a script for meshrun launch)
    nodes: int = 2
    gpus_per_node: int = 8
    framework: str = "torch"
    name: str = "meshrun-job"
    image: str | None = None
    accelerator: str = "H100"
    port: int = 29500
    setup: str | None = None
    # Slurm
    partition: str | None = None
    time: str | None = None
    cpus_per_task: int | None = None
    requeue: bool = False  # stop on SIGUSR1 before the time limit, snapshot, requeue the job
    signal_before: int | None = None  # seconds before the time limit; None: SIGNAL_BEFORE_S
    max_restarts: int = 0  # run a failed job step again, up to this many times
    # Kubernetes
    namespace: str | None = None
    pytorchjob: bool = False
    # hostfile
    hosts: tuple[str, ...] = field(default=())

    def node_command(self) -> tuple[str, ...]:
        """``meshrun ...`` as given, else the script wrapped in ``meshrun launch -f FW``."""
        if self.command and self.command[0] == "meshrun":
            return self.command
        head = ("meshrun", "launch") + (("-f", self.framework) if self.framework != "torch" else ())
        return head + self.command

    def shell_command(self) -> str:
        return shlex_join_keep_vars(self.node_command())


def shlex_join_keep_vars(argv: tuple[str, ...]) -> str:
    """Join argv for a shell on the node, quoting what needs it but leaving ``$VAR`` and
    ``${VAR}`` to expand there (double quotes), so per-node variables such as $SLURM_NODEID
    take each node's value, not the submitting host's."""
    out = []
    for arg in argv:
        if re.fullmatch(r"[A-Za-z0-9_@%+=:,./-]+", arg):
            out.append(arg)
        elif "$" in arg:
            out.append('"' + re.sub(r'(["\\`])', r"\\\1", arg) + '"')
        else:
            out.append(shlex.quote(arg))
    return " ".join(out)


def validate(spec: RenderSpec) -> RenderSpec:
    if spec.target not in TARGETS:
        raise bad_value("target", spec.target, "unknown", f"one of {', '.join(TARGETS)}")
    if spec.nodes < 1:
        raise bad_value("--nodes", spec.nodes, "must be >= 1")
    if spec.gpus_per_node < 0:
        raise bad_value("--gpus-per-node", spec.gpus_per_node, "must be >= 0")
    if spec.framework not in FRAMEWORKS:
        raise bad_value("--framework", spec.framework, "unknown", f"one of {', '.join(FRAMEWORKS)}")
    if not 1 <= spec.port <= 65535:
        raise bad_value("--port", spec.port, "must be in 1..65535")
    if spec.target != "hostfile" and not spec.command:
        raise bad_value("command", "", "nothing to run",
                        "put the command after --, e.g. meshrun render slurm -- meshrun train --steps 1000")
    if spec.target == "kubernetes":
        if not _DNS_LABEL.match(spec.name):
            raise bad_value("--name", spec.name, "is not a Kubernetes name (DNS-1123 label: a-z, 0-9, '-')",
                            "e.g. llama-finetune")
        if not spec.image:
            raise bad_value("--image", None, "Kubernetes runs containers: an image is required",
                            "e.g. --image ghcr.io/you/train:latest (with meshrun installed)")
    if spec.target == "saturn" and not spec.image:
        raise bad_value("--image", None, "a Saturn Cloud job needs an image", "e.g. --image saturncloud/saturn-python-pytorch:2024.08.01")
    if spec.requeue and spec.target != "slurm":
        raise bad_value("--requeue", True, f"is for Slurm jobs, not {spec.target}",
                        "drop it: run the same command again and meshrun train resumes from its newest snapshot")
    if spec.signal_before is not None:
        if not spec.requeue:
            raise bad_value("--signal-before", spec.signal_before, "has no effect without --requeue", "add --requeue")
        if spec.signal_before < 1:
            raise bad_value("--signal-before", spec.signal_before, "must be a positive number of seconds",
                            f"e.g. {SIGNAL_BEFORE_S}: time for a step and a snapshot before the time limit")
    if spec.max_restarts and spec.target != "slurm":
        raise bad_value("--max-restarts", spec.max_restarts, f"is for Slurm jobs, not {spec.target}",
                        "meshrun train --max-restarts N restarts the job on any platform")
    if spec.max_restarts < 0:
        raise bad_value("--max-restarts", spec.max_restarts, "must be 0 or more", "e.g. --max-restarts 2")
    if spec.target == "hostfile" and not spec.hosts:
        raise bad_value("--hosts", "", "a hostfile needs the node addresses", "e.g. --hosts 10.0.0.1,10.0.0.2")
    return spec
