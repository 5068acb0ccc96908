"""Turn a Topology and a LaunchSpec into the exact command(s) for this node, then run them."""

from .build import FRAMEWORKS, build
from .command import Command, LaunchSpec, Process

__all__ = ["Command", "LaunchSpec", "Process", "FRAMEWORKS", "build"]
