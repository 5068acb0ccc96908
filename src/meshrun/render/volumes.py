"""``--volume NAME:PATH``: a named persistent volume mounted at PATH on every node, and where a
run's ``--out`` lands relative to it, for every target that mounts one.

Kubernetes mounts a PersistentVolumeClaim (kubernetes.py); SkyPilot a volume made with ``sky
volumes apply`` (skypilot.py: the task's ``volumes``). Either outlives the pods or the cluster;
a node's own disk does not, so an ``--out`` elsewhere is warned about (``lost_out_warning``).
Both name the volume by a DNS-1123 subdomain: a claim's name, and SkyPilot's rule for a volume
on Kubernetes, its most restrictive cloud.
"""

from __future__ import annotations

import posixpath
import re
from dataclasses import dataclass

from ..errors import bad_value

SHM_MOUNT = "/dev/shm"  # shared memory: NCCL's and the data loaders' (kubernetes.py mounts it in every pod)
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$")  # a DNS-1123 subdomain


@dataclass(frozen=True)
class VolumeKind:
    """What ``--volume`` mounts on one target, in the words its messages use."""

    metavar: str  # CLAIM or VOLUME
    what: str  # what NAME names
    example: str  # a whole --volume value
    node: str  # what a path on no volume goes with
    root: str  # what / is
    shm: str  # why /dev/shm is not the volume's


KINDS = {
    "kubernetes": VolumeKind("CLAIM", "a PersistentVolumeClaim's name", "runs-pvc:/shared", "its pod",
                             "the container root", "which meshrun mounts itself (shared memory for the loaders)"),
    "skypilot": VolumeKind("VOLUME", "a SkyPilot volume's name (sky volumes apply)", "runs:/shared",
                           "its cluster's nodes", "the node's root directory",
                           "the nodes' shared memory, which NCCL and the loaders use"),
}
VOLUME_TARGETS = tuple(KINDS)


def volume_parts(volume: str) -> tuple[str, str]:
    """NAME:PATH as (name, mount path)."""
    name, _, path = volume.partition(":")
    return name, path


def check_volume(target: str, volume: str | None) -> None:
    """``--volume`` only where a target mounts one, as NAME:PATH with an absolute PATH of its
    own (not ``/`` or ``/dev/shm``); SkyPilot refuses a mount path that ends in '/'."""
    if volume is None:
        return
    kind = KINDS.get(target)
    if kind is None:
        raise bad_value("--volume", volume, f"is for {' and '.join(VOLUME_TARGETS)} specs, not {target}", "drop it")
    name, path = volume_parts(volume)
    if not _NAME.fullmatch(name) or not path.startswith("/") or ":" in path or any(c.isspace() for c in path):
        raise bad_value("--volume", volume, f"is not {kind.metavar}:PATH ({kind.what} and an absolute mount "
                        "path)", f"e.g. --volume {kind.example}")
    mount = posixpath.normpath(path)
    if mount == "/" or mount == SHM_MOUNT or mount.startswith(SHM_MOUNT + "/"):
        over = kind.root if mount == "/" else f"{SHM_MOUNT}, {kind.shm}"
        raise bad_value("--volume", volume, f"mounts over {over}",
                        f"mount the volume at a directory of its own, e.g. --volume {kind.example}")
    if target == "skypilot" and path.endswith("/"):
        raise bad_value("--volume", volume, "ends in '/', which SkyPilot refuses in a mount path",
                        f"--volume {name}:{path.rstrip('/')}")


def out_dir(argv: tuple[str, ...]) -> str | None:
    """The ``--out DIR`` (or ``--out=DIR``) of a node command, the last one where it is given
    twice (as argparse takes it), else None."""
    out = None
    for i, arg in enumerate(argv):
        if arg == "--out" and i + 1 < len(argv):
            out = argv[i + 1]
        elif arg.startswith("--out="):
            out = arg.split("=", 1)[1]
    return out


def out_on_no_volume(target: str, volume: str | None, argv: tuple[str, ...]) -> str | None:
    """The ``--out DIR`` of the node command ``argv`` where it lies on no mounted volume (a
    relative one included: it lies under the run's directory on the node's own disk), else
    None; None too for a target that mounts no volume."""
    out = out_dir(argv)
    if out is None or target not in KINDS:
        return None
    if volume is not None and out.startswith("/"):
        mount = posixpath.normpath(volume_parts(volume)[1])
        where = posixpath.normpath(out)
        if where == mount or where.startswith(mount + "/"):
            return None
    return out


def lost_out_warning(target: str, volume: str | None, argv: tuple[str, ...]) -> str | None:
    """The warning for an ``--out`` that goes with the node (``out_on_no_volume``), else None."""
    out = out_on_no_volume(target, volume, argv)
    if out is None:
        return None
    kind = KINDS[target]
    return (f"--out {out} is on no mounted volume: what the run writes there goes with {kind.node} "
            f"(hint: --volume {kind.metavar}:PATH with PATH above it)")
