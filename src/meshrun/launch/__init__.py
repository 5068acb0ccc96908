"""Turn a Topology and a LaunchSpec into the exact command(s) for this node, then run them."""

from .command import Command, LaunchSpec, Process
from .build import FRAMEWORKS, build

__all__ = ["Command", "LaunchSpec", "Process", "FRAMEWORKS", "build"]
