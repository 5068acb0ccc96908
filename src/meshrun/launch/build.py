"""Pick the builder for a framework. Every builder is a pure function of its inputs."""

from __future__ import annotations

from ..cluster.topology import Topology
from ..errors import bad_value
from ..vocab import FRAMEWORKS
from . import accelerate, deepspeed, direct, jax, tensorflow, torchrun
from .command import Command, LaunchSpec
from .common import deepspeed_script_args


def _used_by(spec: LaunchSpec) -> list[tuple[str, object, tuple[str, ...]]]:
    """(flag, value, frameworks that use it) for every launcher option that was set."""
    native = spec.framework == "deepspeed" and spec.deepspeed_launcher == "native"
    rows: list[tuple[str, object, tuple[str, ...]]] = [
        ("--deepspeed-config", spec.deepspeed_config, ("deepspeed", "accelerate")),
        ("--accelerate-config", spec.accelerate_config, ("accelerate",)),
        ("--use-fsdp", spec.use_fsdp or None, ("accelerate",)),
        ("--fsdp-sharding-strategy", spec.fsdp_sharding_strategy, ("accelerate",)),
        ("--mixed-precision", spec.mixed_precision, ("accelerate",)),
        ("--hostfile", spec.hostfile, ("deepspeed",)),
        ("--max-restarts", spec.max_restarts or None, () if native else ("torch", "deepspeed", "accelerate")),
        ("--rdzv", None if spec.rdzv == "static" else spec.rdzv,
         () if native else ("torch", "deepspeed", "accelerate")),
    ]
    if spec.deepspeed_launcher != "torchrun":
        rows.append(("--deepspeed-launcher", spec.deepspeed_launcher, ("deepspeed",)))
    return rows


def check_spec(spec: LaunchSpec) -> None:
    """An option the chosen launcher would ignore is an error, not a silent no-op."""
    for flag, value, frameworks in _used_by(spec):
        if value is not None and spec.framework not in frameworks:
            where = (f"-f {' or -f '.join(frameworks)}" if frameworks
                     else "the torchrun path, not DeepSpeed's native launcher")
            raise bad_value(flag, value, f"has no effect with -f {spec.framework}"
                            + (" --deepspeed-launcher native" if spec.framework == "deepspeed" else ""),
                            f"it is for {where}")
    if spec.hostfile and spec.deepspeed_launcher != "native":
        raise bad_value("--hostfile", spec.hostfile, "is only written for DeepSpeed's native launcher",
                        "add --deepspeed-launcher native")


def is_user_given(source: str) -> bool:
    return source.startswith(("flag ", "env MESHRUN_"))


def per_framework(topo: Topology, framework: str, gpus: int) -> Topology:
    """JAX and TensorFlow default to one process per node that drives all its GPUs, as the
    documents launch them (``python train.py`` on every pod); torchrun-style frameworks use
    one process per GPU. A process count the user chose, or a platform's worker layout, is
    kept; so are the CPU processes of a GPU-less machine."""
    if (framework in ("jax", "tensorflow") and gpus > 0 and not topo.is_worker
            and topo.nproc_per_node > 1 and not is_user_given(topo.source("nproc_per_node"))):
        return topo.replace(nproc_per_node=1, sources={
            "nproc_per_node": f"default for {framework}: one process drives all local GPUs"})
    return topo


def build(topo: Topology, spec: LaunchSpec, visible_devices: str | None = None) -> Command:
    """The command this node runs. ``visible_devices`` is the parent's CUDA_VISIBLE_DEVICES,
    needed where meshrun itself pins one device per process (JAX, TensorFlow)."""
    fw = spec.framework
    if fw not in FRAMEWORKS:
        raise bad_value("--framework", fw, "unknown framework", f"choose one of {', '.join(FRAMEWORKS)}")
    check_spec(spec)
    if spec.nnodes_range is not None and (fw not in ("torch", "deepspeed") or spec.deepspeed_launcher == "native"):
        raise bad_value("--nnodes", f"{spec.nnodes_range[0]}:{spec.nnodes_range[1]}",
                        f"an elastic node range needs torchrun's rendezvous; {fw} cannot use it",
                        "give a fixed node count")
    if fw in ("torch", "deepspeed") and topo.is_worker:
        if spec.framework == "deepspeed" and spec.deepspeed_launcher == "native":
            return deepspeed.build(topo, spec)  # raises the worker-mode error
        extra = deepspeed_script_args(spec) if fw == "deepspeed" else []
        return direct.build(topo, spec, extra)
    if fw == "torch":
        return torchrun.build(topo, spec)
    if fw == "deepspeed":
        return deepspeed.build(topo, spec)
    if fw == "accelerate":
        return accelerate.build(topo, spec)
    if fw == "jax":
        return jax.build(topo, spec, visible_devices)
    return tensorflow.build(topo, spec, visible_devices)
