"""``meshrun.jax_initialize()``: ``jax.distributed.initialize`` wired from the topology."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any


def jax_arguments(env: Mapping[str, str]) -> dict[str, Any]:
    """coordinator_address, num_processes and process_id for this process.

    Under ``meshrun launch -f jax`` they come from the variables it set. Started another way
    (``python train.py`` once per node, the Saturn Cloud document's layout), from the detected topology: one
    process per node, unless the platform started one per device (worker mode).
    """
    if env.get("MESHRUN_PROCESS_ID") and env.get("MESHRUN_NUM_PROCESSES"):
        return {
            "coordinator_address": env.get("JAX_COORDINATOR_ADDRESS")
            or f"{env['MESHRUN_MASTER_ADDR']}:{env['MESHRUN_MASTER_PORT']}",
            "num_processes": int(env["MESHRUN_NUM_PROCESSES"]),
            "process_id": int(env["MESHRUN_PROCESS_ID"]),
        }
    from ..api import detect

    topo = detect(dict(env))
    if topo.is_worker:
        num, pid = topo.world_size, topo.rank
    else:
        num, pid = topo.nnodes, topo.node_rank
    return {"coordinator_address": f"{topo.master_addr}:{topo.master_port}",
            "num_processes": num, "process_id": pid}


def jax_initialize(**overrides: Any) -> dict[str, Any]:
    """Call ``jax.distributed.initialize`` with this process's place in the job.

    On a machine without GPUs, cross-process collectives on CPU need gloo
    (``jax_cpu_collectives_implementation``), which is set first. Keyword arguments override
    the computed ones. Returns the arguments used.
    """
    import jax

    kwargs = {**jax_arguments(os.environ), **overrides}
    if os.environ.get("JAX_PLATFORMS", "") == "cpu" or not _has_gpu_backend():
        jax.config.update("jax_cpu_collectives_implementation", "gloo")  # type: ignore[no-untyped-call]  # jax: unannotated
        _gloo_on_interface(os.environ.get("GLOO_SOCKET_IFNAME"))
    jax.distributed.initialize(**kwargs)
    return kwargs


def _gloo_on_interface(ifname: str | None) -> None:
    """JAX builds its gloo transport without an interface, so gloo binds to the address the
    machine's hostname resolves to, which on a multi-homed node may be the wrong network
    and where the hostname does not resolve fails outright ("device.cc:99 rv == 0"). Hand it
    the interface meshrun chose (or the user's GLOO_SOCKET_IFNAME), as torch's gloo gets it.
    jaxlib's factory takes ``interface=``; JAX's caller does not pass it, so wrap the
    factory where JAX looks it up (a private name: left alone if it is not there)."""
    if not ifname:
        return
    try:
        from jax._src import xla_bridge
    except ImportError:
        return
    lib = getattr(xla_bridge, "_jax", None)
    factory = getattr(lib, "make_gloo_tcp_collectives", None)
    if lib is None or factory is None or getattr(factory, "_meshrun_interface", None):
        return

    def on_interface(*args: Any, **kw: Any) -> Any:
        kw.setdefault("interface", ifname)
        return factory(*args, **kw)

    on_interface._meshrun_interface = ifname  # type: ignore[attr-defined]  # a mark on the wrapper
    try:
        lib.make_gloo_tcp_collectives = on_interface
    except (AttributeError, TypeError):
        pass


def _has_gpu_backend() -> bool:
    from ..cluster.gpus import count_visible_gpus

    return count_visible_gpus(os.environ) > 0
