"""`meshrun render`: write a ready-to-submit job spec whose entry point is meshrun."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping

from ..cluster.options import parse_int
from ..errors import bad_value
from ..fsio import write_file
from ..paths import check_output_file
from ..render import TARGETS, render
from ..render.spec import K8S_KINDS, LSF_LAUNCHERS, SIGNAL_BEFORE_S, RenderSpec
from ..render.volumes import lost_out_warning
from ..vocab import FRAMEWORKS
from .options import add_option

RENDER_HELP = """\
Write a job spec for a platform; every node runs the command after -- through meshrun,
which detects its rank, the head node and the port from the platform's own variables.

  slurm       sbatch script: one task per node, srun, head node rendezvous
  lsf         bsub script: one task per node through blaunch, or --launcher jsrun | mpirun
  skypilot    task YAML: num_nodes, resources.accelerators, network_tier: best, meshrun installed by setup
  kubernetes  Indexed Job + headless Service, or --as pytorchjob | trainjob (Kubeflow) | jobset
  saturn      Saturn Cloud Job settings: command and instance count
  hostfile    DeepSpeed hostfile from --hosts

A command that does not start with meshrun is a script: it is run as
meshrun launch [-f FRAMEWORK] SCRIPT ARGS.

examples:
  meshrun render slurm --nodes 4 --gpus-per-node 8 -- meshrun train --model-size gpt-1.3b --out /shared/run1
  meshrun render slurm --nodes 4 --time 04:00:00 --requeue -- meshrun train --out /shared/run1   # runs until done
  meshrun render slurm --account ml --qos high --mem 0 --sbatch-arg=--exclusive -- meshrun train --out /shared/r
  meshrun render lsf --nodes 4 --gpus-per-node 8 --time 4:00 -o job.bsub -- meshrun train --out /gpfs/run1
  meshrun render lsf --launcher jsrun --nodes 4 --gpus-per-node 6 -o job.bsub -- meshrun train --out /gpfs/r1
  meshrun render skypilot --nodes 2 --volume runs:/shared -o task.yaml -- meshrun train --out /shared/run1
  meshrun render skypilot --nodes 2 --workdir src -o task.yaml -- train.py --epochs 3
  meshrun render kubernetes --nodes 2 --image ghcr.io/me/train:1 --name gpt -- meshrun train --steps 500
  meshrun render kubernetes --as trainjob --image img:1 --volume runs:/shared -- meshrun train --out /shared/r1
  meshrun render saturn --nodes 2 --image saturncloud/saturn-python-pytorch:2024.08.01 -f deepspeed -- train.py
  meshrun render hostfile --hosts 10.0.0.1,10.0.0.2 --gpus-per-node 8 -o hostfile
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("render", help="write a Slurm / LSF / SkyPilot / Kubernetes / Saturn Cloud job spec or a "
                       "hostfile", description=RENDER_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("target", metavar="TARGET", help=f"one of {', '.join(TARGETS)}")
    g = p.add_argument_group("the job")
    add_option(g, "--nodes", "--nnodes", metavar="N", default="2", help="nodes (default 2; --nnodes is the same)")
    add_option(g, "--gpus-per-node", metavar="G", default="8", help="GPUs per node (default 8)")
    add_option(g, "--framework", "-f", metavar="NAME", default="torch",
               help=f"for a script command: {', '.join(FRAMEWORKS)} (default torch)")
    add_option(g, "--name", metavar="NAME", default="meshrun-job", help="job name (default meshrun-job)")
    add_option(g, "--image", metavar="IMAGE", help="container image with meshrun installed")
    add_option(g, "--port", metavar="PORT", default="29500", help="rendezvous port where the spec sets one")
    add_option(g, "--setup", metavar="CMD",
               help="shell command run before the job (pip install ...); SkyPilot runs it on every node, and "
                    "without it installs this meshrun with the framework's extras unless --image is given "
                    "(--setup '' installs nothing)")
    g = p.add_argument_group("platform options")
    add_option(g, "--accelerator", metavar="GPU", default="H100", help="SkyPilot accelerator name (default H100)")
    add_option(g, "--partition", metavar="P", help="Slurm partition (LSF: the queue, bsub -q)")
    add_option(g, "--time", metavar="HH:MM:SS", help="Slurm time limit (LSF: [hours:]minutes, bsub -W)")
    add_option(g, "--cpus-per-task", metavar="C",
               help="Slurm CPUs per node task (sbatch --cpus-per-task); without it the script asks for none, and "
                    "each node's task gets the partition's default (its DefCpuPerGPU, else one CPU; the whole node "
                    "with --sbatch-arg=--exclusive)")
    add_option(g, "--requeue", action="store_true",
               help="Slurm: before the time limit, have Slurm send SIGUSR1 to meshrun on every node; meshrun "
                    "train then stops after a step all ranks agree on, writes a snapshot and exits with 75, and "
                    "the job requeues itself; the requeued job runs the same command, which resumes (give "
                    "meshrun train --out on a shared filesystem)")
    add_option(g, "--signal-before", metavar="SECONDS",
               help=f"with --requeue: how long before the time limit SIGUSR1 comes (default {SIGNAL_BEFORE_S}; "
                    "enough for a step and a snapshot)")
    add_option(g, "--max-restarts", metavar="N",
               help="Slurm: when the job step fails (a node lost, a process killed), run it again in the same "
                    "allocation, up to N times; meshrun train resumes from its newest snapshot (default 0)")
    add_option(g, "--account", metavar="A", help="Slurm account to charge (sbatch --account; LSF: the project, "
                                                  "bsub -P)")
    add_option(g, "--qos", metavar="Q", help="Slurm quality of service (sbatch --qos)")
    add_option(g, "--mem", metavar="SIZE", help="Slurm memory per node, e.g. 500G; 0 takes all of it (sbatch --mem)")
    add_option(g, "--constraint", metavar="FEATURES", help="Slurm node features, e.g. 'h100&ib' (sbatch --constraint)")
    add_option(g, "--sbatch-arg", metavar="OPTION", action="append", from_env=False,
               help="Slurm: one more #SBATCH option, as sbatch takes it (repeatable), e.g. "
                    "--sbatch-arg=--exclusive --sbatch-arg=--mail-type=END")
    add_option(g, "--namespace", metavar="NS", help="Kubernetes namespace")
    add_option(g, "--as", metavar="KIND", dest="kind", default="job",
               help=f"Kubernetes: what to write, one of {', '.join(K8S_KINDS)}: an Indexed Job + headless Service "
                    "(default), a Kubeflow PyTorchJob (Training Operator v1), a Kubeflow Trainer v2 TrainJob, or a "
                    "JobSet")
    add_option(g, "--pytorchjob", action="store_true", help="Kubernetes: the same as --as pytorchjob")
    add_option(g, "--runtime", metavar="NAME", default="torch-distributed",
               help="Kubernetes --as trainjob: the ClusterTrainingRuntime to run on (default torch-distributed)")
    add_option(g, "--volume", metavar="NAME:PATH",
               help="Kubernetes: mount the PersistentVolumeClaim NAME at PATH on every pod; SkyPilot: the volume "
                    "NAME (sky volumes apply) on every node; for meshrun train --out, as a node's own disk goes "
                    "with it")
    add_option(g, "--workdir", metavar="DIR",
               help="SkyPilot: upload this local directory to ~/sky_workdir, where run starts (without what its "
                    ".skyignore, else its .gitignore, lists); without it nothing local is uploaded")
    add_option(g, "--launcher", metavar="NAME", default="blaunch",
               help=f"LSF: what starts meshrun on each host, one of {', '.join(LSF_LAUNCHERS)}: blaunch on a plain "
                    "LSF cluster (default), jsrun on an IBM CSM cluster (the job asks for whole nodes, -nnodes), "
                    "Open MPI's mpirun")
    add_option(g, "--hosts", metavar="H0,H1,..", help="hostfile: node addresses in node-rank order")
    add_option(p, "--output", "-o", metavar="FILE", help="write here (default: standard output)")
    # nargs="*" rather than REMAINDER: options may sit anywhere before `--`, and everything
    # after it is the command, options and all.
    p.add_argument("cmd", nargs="*", metavar="-- COMMAND", help="what every node runs (after --)")
    p.set_defaults(func=cmd_render)


def _int(ns: argparse.Namespace, name: str, flag: str) -> int | None:
    raw = getattr(ns, name)
    return None if raw is None else parse_int(str(raw), flag)


def _seconds(ns: argparse.Namespace, name: str) -> int | None:
    """A positive whole number of seconds, or None when unset; a bad one names its source."""
    raw = getattr(ns, name)
    if raw is None:
        return None
    source = getattr(ns, "_env_sources", {}).get(name, "--" + name.replace("_", "-"))
    try:
        value = int(str(raw))
    except ValueError:
        value = 0
    if value < 1:
        raise bad_value(source, raw, "must be a positive whole number of seconds",
                        f"e.g. {SIGNAL_BEFORE_S}: time for a step and a snapshot before the time limit")
    return value


def _kind(ns: argparse.Namespace) -> str:
    """--as, with --pytorchjob as its older spelling (the two must agree)."""
    if ns.pytorchjob and ns.kind not in ("job", "pytorchjob"):
        raise bad_value("--pytorchjob", True, f"contradicts --as {ns.kind}", "give one of the two")
    return "pytorchjob" if ns.pytorchjob else str(ns.kind)


def cmd_render(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    if ns.target not in TARGETS:
        raise bad_value("target", ns.target, "unknown", f"one of {', '.join(TARGETS)}")
    cmd = list(ns.cmd)
    if cmd and cmd[0] == "--":
        cmd = cmd[1:]
    spec = RenderSpec(
        target=ns.target, command=tuple(cmd), nodes=_int(ns, "nodes", "--nodes") or 0,
        gpus_per_node=_int(ns, "gpus_per_node", "--gpus-per-node") or 0, framework=ns.framework,
        name=ns.name, image=ns.image, accelerator=ns.accelerator, port=_int(ns, "port", "--port") or 0,
        setup=ns.setup, partition=ns.partition, time=ns.time,
        cpus_per_task=_int(ns, "cpus_per_task", "--cpus-per-task"),
        namespace=ns.namespace, kind=_kind(ns), runtime=ns.runtime, volume=ns.volume, requeue=ns.requeue,
        signal_before=_seconds(ns, "signal_before"), max_restarts=_int(ns, "max_restarts", "--max-restarts") or 0,
        account=ns.account, qos=ns.qos, mem=ns.mem, constraint=ns.constraint,
        sbatch_args=tuple(ns.sbatch_arg or ()), launcher=ns.launcher, workdir=ns.workdir,
        # (an empty name between commas is kept, for validate() to refuse)
        hosts=tuple(h.strip() for h in ns.hosts.split(",")) if ns.hosts and ns.hosts.strip() else ())
    if ns.output:
        check_output_file(ns.output, "-o")
    text = render(spec)
    lost = lost_out_warning(spec.target, spec.volume, spec.node_command())
    if lost is not None:
        print(f"meshrun render: warning: {lost}", file=sys.stderr)
    if ns.output:
        write_file(ns.output, text, source="-o", mode=0o755 if spec.target in ("slurm", "lsf") else 0o644)
        print(f"wrote {ns.output}", file=sys.stderr)
    else:
        sys.stdout.write(text)
    return 0

