"""HuggingFace ``accelerate launch``.

Its ``--num_processes`` is the GLOBAL process count (nodes x processes per node), unlike
torchrun's per-node count: the mistake the Saturn Cloud document warns about. ``--multi_gpu`` selects its
torchrun-based multi-process launcher, which also runs CPU processes with gloo.
"""

from __future__ import annotations

from ..cluster.topology import Topology
from ..errors import bad_value
from .command import Command, LaunchSpec, Process
from .common import script_argv, topology_env


def build(topo: Topology, spec: LaunchSpec) -> Command:
    if topo.is_worker:
        raise bad_value("--framework", "accelerate",
                        f"accelerate launch starts its own processes, but platform {topo.platform} already "
                        f"started this one as local rank {topo.local_rank}",
                        "run one task per node (e.g. srun --ntasks-per-node=1)")
    argv = ["accelerate", "launch"]
    if spec.accelerate_config:
        argv.append(f"--config_file={spec.accelerate_config}")
    argv += [
        f"--num_machines={topo.nnodes}",
        f"--machine_rank={topo.node_rank}",
        f"--num_processes={topo.world_size}",
    ]
    if topo.nnodes > 1:
        argv.append(f"--main_process_ip={topo.master_addr}")
    argv.append(f"--main_process_port={topo.master_port}")
    if spec.deepspeed_config:
        argv += ["--use_deepspeed", f"--deepspeed_config_file={spec.deepspeed_config}"]
    elif spec.use_fsdp:
        argv.append("--use_fsdp")
        if spec.fsdp_sharding_strategy:
            argv.append(f"--fsdp_sharding_strategy={spec.fsdp_sharding_strategy}")
    elif topo.world_size > 1:
        argv.append("--multi_gpu")
    if spec.mixed_precision:
        argv.append(f"--mixed_precision={spec.mixed_precision}")
    if spec.rdzv == "c10d":
        argv.append("--rdzv_backend=c10d")
    if spec.max_restarts:
        argv.append(f"--max_restarts={spec.max_restarts}")
    argv += script_argv(spec)
    return Command(processes=(Process(tuple(argv)),), env=topology_env(topo))
