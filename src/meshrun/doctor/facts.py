"""What a node looks like, read once (side effects live here; the checks are pure)."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, field

from ..cluster.gpus import count_visible_gpus
from ..paths import nearest_existing


@dataclass(frozen=True)
class Facts:
    hostname: str
    gpus_visible: int
    torch: str | None = None
    cuda: str | None = None
    nccl: str | None = None
    driver: str | None = None
    gpu_names: tuple[str, ...] = ()
    interfaces: Mapping[str, str] = field(default_factory=dict)  # name -> IPv4 ('' when none)
    ib_devices: tuple[str, ...] = ()
    topology: str | None = None  # `nvidia-smi topo -m`
    gpu_health: tuple[Mapping[str, str], ...] = ()
    disk_path: str = "."
    disk_free: int = 0
    # when disk_path does not exist yet: the closest existing ancestor, where disk_free was measured
    disk_base: str = ""

    def versions(self) -> dict[str, str | None]:
        return {"torch": self.torch, "cuda": self.cuda, "nccl": self.nccl, "driver": self.driver}


def _smi(*args: str) -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    try:
        out = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout if out.returncode == 0 else None


GPU_QUERY = ("name,driver_version,clocks_event_reasons.active,ecc.errors.uncorrected.volatile.total,temperature.gpu,"
             "power.limit,power.default_limit")
_GPU_FIELDS = ("name", "driver", "throttle", "ecc_uncorrected", "temperature", "power_limit", "power_default")


def parse_gpu_query(text: str) -> list[dict[str, str]]:
    """One dict per GPU from ``nvidia-smi --query-gpu=GPU_QUERY --format=csv,noheader``."""
    out = []
    for line in text.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == len(_GPU_FIELDS):
            out.append(dict(zip(_GPU_FIELDS, parts)))
    return out


def interfaces() -> dict[str, str]:
    from ..cluster.reach import _ipv4_of

    return {name: _ipv4_of(name) or "" for _, name in socket.if_nameindex()}


def gather(env: Mapping[str, str], disk_path: str = ".") -> Facts:
    gpus = count_visible_gpus(env)
    torch_v = cuda_v = nccl_v = None
    try:
        import torch

        torch_v = torch.__version__
        cuda_v = torch.version.cuda
        if torch.cuda.is_available():
            nccl = torch.cuda.nccl.version()  # type: ignore[no-untyped-call]  # torch: unannotated
            nccl_v = ".".join(map(str, nccl)) if isinstance(nccl, tuple) else str(nccl)
    except ImportError:
        pass
    q = _smi(f"--query-gpu={GPU_QUERY}", "--format=csv,noheader")
    if q is None:  # drivers before 535 call the reasons 'throttle' reasons
        q = _smi(f"--query-gpu={GPU_QUERY.replace('clocks_event_reasons', 'clocks_throttle_reasons')}",
                 "--format=csv,noheader")
    health = parse_gpu_query(q or "")
    names = tuple(h["name"] for h in health)
    driver = health[-1]["driver"] if health else None
    ib = tuple(sorted(os.listdir("/sys/class/infiniband"))) if os.path.isdir("/sys/class/infiniband") else ()
    base = "" if os.path.isdir(disk_path) else nearest_existing(disk_path)
    measured = base or disk_path
    free = shutil.disk_usage(measured).free if os.path.isdir(measured) else 0
    return Facts(socket.gethostname(), gpus, torch_v, cuda_v, nccl_v, driver, names, interfaces(), ib,
                 _smi("topo", "-m") if gpus else None, tuple(health), disk_path, free, base)
