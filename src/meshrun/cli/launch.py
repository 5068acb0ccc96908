"""`meshrun launch`: start a training script on this node, for its framework."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Mapping

from ..cluster.detect import processes_fit
from ..cluster.gpus import count_visible_cpus, count_visible_gpus
from ..errors import bad_value
from ..launch.build import build, per_framework
from ..launch.command import LaunchSpec
from ..launch.dryrun import dry_run_text
from ..launch.node import check_ports, prepare_network, run_job
from ..launch.options import WaitOptions
from ..launch.run import Waits
from ..launch.torchrun import thread_env
from ..vocab import FRAMEWORKS
from .options import (
    add_finish_timeout_option,
    add_option,
    add_rdzv_timeout_option,
    add_topology_options,
    topology_from_args,
    waits_from_args,
)

LAUNCH_HELP = """\
Start a training script on this node, for its framework, on the topology meshrun detects.

Run the same command on every node; meshrun reads where it is (Saturn Cloud, SkyPilot,
Slurm, Kubeflow, MPI, LSF, SageMaker, a torchrun worker, MASTER_ADDR/NNODES/NODE_RANK, or a
plain machine) and builds the launcher command the framework's own guide prescribes:

  torch       torchrun --nproc_per_node=G --nnodes=N --node_rank=R --master_addr=A ...
  deepspeed   the same torchrun line (+ --deepspeed --deepspeed_config FILE for the script),
              or with --deepspeed-launcher native: deepspeed --hostfile on the head node only
  accelerate  accelerate launch --num_processes=N*G (GLOBAL) --num_machines=N ...
  jax         python script.py per process; call meshrun.jax_initialize() in the script
  tensorflow  python script.py per worker with TF_CONFIG; or call meshrun.tf_config()

examples:
  meshrun launch train.py --epochs 10              # all GPUs here (2 CPU processes if none)
  meshrun launch --nproc 4 train.py                # 4 processes on this machine
  meshrun launch --dry-run --json train.py         # show argv and env, run nothing
  meshrun launch -f accelerate train.py            # accelerate launch with global counts
  meshrun launch -f deepspeed --deepspeed-config ds_config.json train.py
  meshrun launch -f jax train.py                   # one JAX process per local device
  meshrun launch --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 train.py
  meshrun launch --nnodes 1:4 --rdzv c10d --master-addr head train.py   # elastic

Exit code: the job's (128+N if it died of signal N); 2 for bad input; 1 when ranks are still
running --finish-timeout seconds (default 300) after another rank finished: they are named
in one line and stopped.
SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 are forwarded to the job; the first three go to
the script's processes, not to torchrun: a script that handles one and exits 0 ends the job with 0.
"""

def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("launch", help="start a training script on this node for its framework",
                       description=LAUNCH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option(p, "--framework", "-f", metavar="NAME", default="torch",
               help=f"one of {', '.join(FRAMEWORKS)} (default torch)")
    add_topology_options(p)
    g = p.add_argument_group("launcher")
    add_option(g, "--rdzv", choices=("static", "c10d"), default="static",
               help="torchrun rendezvous: static (fixed nodes, default) or c10d (needed for elastic)")
    add_option(g, "--max-restarts", type=int, default=0, metavar="N", help="torchrun worker-group restarts")
    add_rdzv_timeout_option(g)
    add_finish_timeout_option(g)
    add_option(g, "--module", "-m", action="store_true", help="run the script argument as a module (python -m)")
    g = p.add_argument_group("framework options")
    add_option(g, "--deepspeed-launcher", choices=("torchrun", "native"), default="torchrun",
               help="torchrun on every node (default), or deepspeed --hostfile on the head node only")
    add_option(g, "--deepspeed-config", metavar="FILE",
               help="ds_config.json: passed to the script as --deepspeed --deepspeed_config FILE, "
                    "or to accelerate as --use_deepspeed --deepspeed_config_file FILE")
    add_option(g, "--hostfile", metavar="FILE", help="where the native DeepSpeed launcher's hostfile is written")
    add_option(g, "--accelerate-config", metavar="FILE", help="accelerate config YAML (--config_file)")
    add_option(g, "--use-fsdp", action="store_true", help="accelerate: --use_fsdp")
    add_option(g, "--fsdp-sharding-strategy", metavar="S",
               choices=("FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD", "HYBRID_SHARD_ZERO2"),
               help="accelerate: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or HYBRID_SHARD_ZERO2")
    add_option(g, "--mixed-precision", choices=("no", "fp16", "bf16", "fp8"), help="accelerate: --mixed_precision")
    g = p.add_argument_group("output")
    add_option(g, "--dry-run", action="store_true", help="print the command and environment; run nothing")
    add_option(g, "--json", action="store_true", help="with --dry-run: one JSON object with argv and env")
    p.add_argument("script", help="the training script (or module with -m)")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.set_defaults(func=cmd_launch)


def launch_spec(ns: argparse.Namespace, elastic: tuple[int, int] | None, waits: WaitOptions) -> LaunchSpec:
    if not ns.module and not os.path.isfile(ns.script):
        raise bad_value("script", ns.script, "no such file",
                        "give the path of your training script, or -m for a module")
    if ns.deepspeed_config and not os.path.isfile(ns.deepspeed_config):
        raise bad_value("--deepspeed-config", ns.deepspeed_config, "no such file")
    if ns.accelerate_config and not os.path.isfile(ns.accelerate_config):
        raise bad_value("--accelerate-config", ns.accelerate_config, "no such file")
    if ns.max_restarts < 0:
        raise bad_value("--max-restarts", ns.max_restarts, "must be >= 0")
    return LaunchSpec(
        framework=ns.framework,
        script=ns.script,
        script_args=tuple(ns.script_args),
        module=ns.module,
        rdzv=ns.rdzv,
        max_restarts=ns.max_restarts,
        nnodes_range=elastic,
        deepspeed_launcher=ns.deepspeed_launcher,
        deepspeed_config=ns.deepspeed_config,
        hostfile=ns.hostfile,
        accelerate_config=ns.accelerate_config,
        use_fsdp=ns.use_fsdp or bool(ns.fsdp_sharding_strategy),
        fsdp_sharding_strategy=ns.fsdp_sharding_strategy,
        mixed_precision=ns.mixed_precision,
        rdzv_timeout=waits.rdzv_timeout,
    )


def cmd_launch(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    fw = ns.framework
    if fw not in FRAMEWORKS:
        raise bad_value("--framework", fw, "unknown framework", f"choose one of {', '.join(FRAMEWORKS)}")
    gpus = count_visible_gpus(env)
    topo, elastic = topology_from_args(ns, env, gpus)
    topo = per_framework(topo, fw, gpus)
    if topo.local_rank is None:  # (a platform that started this process as one rank chose the count itself)
        processes_fit(topo, gpus, count_visible_cpus())
    waits = waits_from_args(ns, env)
    spec = launch_spec(ns, elastic, waits)
    cmd = build(topo, spec, env.get("CUDA_VISIBLE_DEVICES"))
    threads = thread_env(topo.nproc_per_node, env) if cmd.argv[:1] == ("torchrun",) else {}
    if threads:
        note = (f"OMP_NUM_THREADS=1 in each of the {topo.nproc_per_node} processes, as torchrun sets it "
                "(set OMP_NUM_THREADS to choose)")
        cmd = dataclasses.replace(cmd, env={**cmd.env, **threads}, note="; ".join(filter(None, (cmd.note, note))))
    if ns.dry_run:
        print(dry_run_text(cmd, ns.json))
        return 0
    check_ports(topo, cmd, spec)
    cmd = prepare_network(topo, cmd, env, waits.rdzv_timeout)
    # torchrun and Accelerate answer a stopping signal with their own traceback whatever the
    # script does: it goes to their workers (the native DeepSpeed launcher's children are ssh
    # sessions to other nodes, which it stops itself)
    stop_workers = cmd.argv[:1] in (("torchrun",), ("accelerate",))
    return run_job(cmd, env, topo, spec, waits=Waits(finish_s=waits.finish_timeout), stop_workers=stop_workers)
