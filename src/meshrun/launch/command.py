"""Commands as data: builders return them, the runner executes them, tests compare them."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class LaunchSpec:
    """What the user wants run, independent of where.

    ``nnodes_range`` is torchrun's elastic ``MIN:MAX`` (nodes may join and leave); it needs
    the c10d rendezvous. ``deepspeed_launcher`` picks between the torchrun path (one
    launcher per node, no SSH, as DeepSpeed's own guide for Kubernetes and Slurm allows) and DeepSpeed's own launcher,
    which the head node runs with a hostfile and which reaches the others over SSH.
    """

    framework: str
    script: str
    script_args: tuple[str, ...] = ()
    module: bool = False  # run ``python -m script`` instead of a file
    rdzv: str = "static"  # static | c10d
    max_restarts: int = 0
    nnodes_range: tuple[int, int] | None = None
    deepspeed_launcher: str = "torchrun"  # torchrun | native
    deepspeed_config: str | None = None
    hostfile: str | None = None
    accelerate_config: str | None = None
    use_fsdp: bool = False
    fsdp_sharding_strategy: str | None = None
    mixed_precision: str | None = None
    rdzv_timeout: int | None = None  # seconds a multi-node rendezvous may take; None: torchrun's 600


@dataclass(frozen=True)
class Process:
    """One OS process to start: its argv and the variables to add to the parent env.

    ``rank``: the global rank of a training process meshrun starts itself, with no launcher
    between (`meshrun train` on one node). Such a process starts with SIGUSR1 and SIGUSR2
    ignored, as a launcher does, until it installs its own handlers; a rank that fails is
    named from its exit status; and the job's other ranks are stopped at once, since none can
    finish a step without it."""

    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    rank: int | None = None


@dataclass(frozen=True)
class Command:
    """Everything this node does for the job.

    ``processes`` is usually one launcher (torchrun, accelerate, deepspeed) but is one per
    local device for JAX and TensorFlow, which have no launcher of their own; it is empty on
    a node that only waits (DeepSpeed's native launcher reaches it over SSH). ``files`` are
    written before anything starts (the DeepSpeed hostfile). ``note`` is said to the user.
    """

    processes: tuple[Process, ...]
    env: Mapping[str, str] = field(default_factory=dict)
    files: Mapping[str, str] = field(default_factory=dict)
    note: str = ""

    @property
    def argv(self) -> tuple[str, ...]:
        return self.processes[0].argv if self.processes else ()

    def env_of(self, index: int = 0) -> dict[str, str]:
        """The variables meshrun sets for one process (shared ones plus its own)."""
        merged = dict(self.env)
        if self.processes:
            merged.update(self.processes[index].env)
        return merged
