"""Count this node's GPUs without importing torch (importing it costs ~1 s of start-up)."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping

_DEV = re.compile(r"^nvidia\d+$")


def count_visible_gpus(env: Mapping[str, str], dev_dir: str = "/dev") -> int:
    """GPUs this process may use.

    ``CUDA_VISIBLE_DEVICES`` wins when set (an empty value or ``-1`` hides every GPU, as in
    CUDA). Otherwise the ``/dev/nvidiaN`` nodes are counted: a container sees only the
    devices it was given, unlike ``/proc/driver/nvidia``. ``nvidia-smi -L`` is the last
    resort for unusual device layouts.
    """
    visible = env.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        items = [v for v in visible.split(",") if v.strip()]
        if not items or items[0].strip().startswith("-"):
            return 0
        # CUDA stops at the first invalid entry; a negative one ends the list.
        count = 0
        for item in items:
            if item.strip().startswith("-"):
                break
            count += 1
        return count
    try:
        count = sum(1 for name in os.listdir(dev_dir) if _DEV.match(name))
    except OSError:
        count = 0
    if count:
        return count
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=10)
            return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))
        except (OSError, subprocess.SubprocessError):
            return 0
    return 0


def detect_gpu_memory() -> int | None:
    """The first GPU's memory in bytes: from torch when it is installed and sees a GPU, else
    from nvidia-smi; None on a machine without GPUs."""
    try:
        import torch

        if torch.cuda.is_available():
            return int(torch.cuda.get_device_properties(0).total_memory)
    except ImportError:
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"],
                                 capture_output=True, text=True, timeout=20).stdout.split()
            return int(out[0]) * 2**20 if out else None
        except (OSError, subprocess.SubprocessError, ValueError):
            return None
    return None


def detect_gpu_name() -> str | None:
    """The first GPU's name as CUDA reports it ("NVIDIA H100 80GB HBM3"): from torch when it is
    installed and sees a GPU, else from nvidia-smi; None on a machine without GPUs."""
    try:
        import torch

        if torch.cuda.is_available():
            return str(torch.cuda.get_device_name(0))
    except ImportError:
        pass
    if shutil.which("nvidia-smi"):
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20).stdout.splitlines()
            return out[0].strip() or None if out else None
        except (OSError, subprocess.SubprocessError):
            return None
    return None


def count_visible_cpus() -> int:
    """The cores this process may run on (its affinity mask, which a container or a scheduler
    narrows), else the machine's."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def host_memory() -> int | None:
    """This machine's memory in bytes (None where the system does not say)."""
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None
