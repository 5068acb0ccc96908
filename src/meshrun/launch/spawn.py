"""The programs a Command's processes run: each found beside this interpreter first (an
un-activated virtual environment), then on PATH, with the line that installs one that is
missing; and which of them are launchers (torchrun, Accelerate, DeepSpeed), whose children are
the workers: the worker signals (signals.py) and the rank checks (liveness.py) go to those.
"""

from __future__ import annotations

import os
import shutil
import sys

from ..errors import MeshrunError

INSTALL_HINT = {
    "torchrun": "pip install torch",
    "accelerate": "pip install 'meshrun[accelerate]'",
    "deepspeed": "pip install 'meshrun[deepspeed]'",
}


def resolve_program(prog: str) -> str:
    """Find a launcher next to this interpreter first (an un-activated venv), then on PATH."""
    if prog == "python":
        return sys.executable
    beside = os.path.join(os.path.dirname(sys.executable), prog)
    if os.access(beside, os.X_OK):
        return beside
    found = shutil.which(prog)
    if found is None:
        raise MeshrunError(f"program {prog!r} not found beside {sys.executable} or on PATH "
                           f"(hint: {INSTALL_HINT.get(prog, 'install it')})")
    return found


def resolved_argv(argv: tuple[str, ...]) -> list[str]:
    return [resolve_program(argv[0]), *argv[1:]]


LAUNCHERS = ("torchrun", "accelerate", "deepspeed")  # programs whose children are the workers


def is_launcher(argv: list[str]) -> bool:
    return os.path.basename(argv[0]) in LAUNCHERS
