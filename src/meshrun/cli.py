"""meshrun: take a training script from one GPU to many nodes, on any cluster.

  meshrun env [--json]                 show the topology meshrun detects here, and why
  meshrun launch [options] script.py   start the script on this node for its framework
  meshrun train [options]              train with meshrun's trainer (default: a small GPT
                                       on the Python standard library's source)
  meshrun plan [options]               per-GPU memory of each strategy, the one that fits,
                                       and its ds_config.json / accelerate / train configs
  meshrun render TARGET -- COMMAND     a Slurm / SkyPilot / Kubernetes / Saturn Cloud job spec
                                       (or a DeepSpeed hostfile) that runs COMMAND via meshrun
  meshrun doctor [--json]              check GPUs, versions, the master, interfaces, NCCL settings
  meshrun bench comm|matmul|train      collectives' bus bandwidth, matmul TFLOP/s, training MFU
  meshrun export SNAPSHOT --to FILE    a snapshot's weights as one safetensors file

Run ``meshrun COMMAND --help`` for each command's manual. Every option accepts dashes or
underscores (--master-port, --master_port) and can also be set through the environment as
MESHRUN_<NAME> (MESHRUN_MASTER_PORT=29600); a flag wins over its variable, and either wins
over what the platform says.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from dataclasses import dataclass
import os
import sys
from typing import Mapping, Sequence

from . import __version__
from .cluster.detect import PLATFORMS, resolve
from .cluster.gpus import count_visible_gpus
from .cluster.net import free_port, port_is_free
from .cluster.reach import DEFAULT_TIMEOUT_S, route_interface, wait_reachable
from .cluster.reach import resolve as resolve_host
from .cluster.options import ENV_PREFIX, parse_int, user_topology
from .cluster.topology import FIELDS, Topology
from .errors import MeshrunError, bad_value
from .launch.build import FRAMEWORKS, build, per_framework
from .launch.command import Command, LaunchSpec

# The seed's NCCL table: set the socket interface, but never override what the user set.
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")

LAUNCH_HELP = """\
Start a training script on this node, for its framework, on the topology meshrun detects.

Run the same command on every node; meshrun reads where it is (Saturn Cloud, SkyPilot,
Slurm, Kubeflow, MPI, SageMaker, a torchrun worker, MASTER_ADDR/NNODES/NODE_RANK, or a
plain machine) and builds the launcher command the documents prescribe:

  torch       torchrun --nproc_per_node=G --nnodes=N --node_rank=R --master_addr=A ...
  deepspeed   the same torchrun line (+ --deepspeed --deepspeed_config FILE for the script),
              or with --deepspeed-launcher native: `deepspeed --hostfile` on the head node only
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

Exit code: the job's (128+N if it died of signal N); 2 for bad input.
SIGINT, SIGTERM, SIGHUP, SIGUSR1 and SIGUSR2 are forwarded to the job.
"""

ENV_HELP = """\
Show the topology meshrun resolves on this node and where each value came from.

examples:
  meshrun env                         # a table: value and source of each field
  meshrun env --json                  # one JSON object (platform, nnodes, node_rank, ...)
  SLURM_JOB_ID=7 SLURM_NNODES=2 SLURM_NODEID=1 SLURM_JOB_NODELIST='gpu[1-2]' meshrun env
"""


class Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line and exit code 2, as meshrun does everywhere."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise MeshrunError(f"{message} (see '{self.prog} --help')")


@dataclass(frozen=True)
class EnvDefault:
    """An option whose default may come from MESHRUN_<DEST> before its built-in default."""

    flag: str
    default: object
    kind: str  # "bool" | "int" | "str"
    choices: tuple[str, ...] | None


# add_option hangs an EnvDefault on each action it creates (as ``meshrun_env``), so that
# commands sharing an option name (--model, --precision, --framework) keep their own
# defaults and choices. Topology options have none: cluster/options.py reads their variables
# itself, so that their sources can be reported separately.


def add_option(p: argparse._ActionsContainer, name: str, *aliases: str, from_env: bool = True,
               **kw: object) -> None:
    """Register --a-b and --a_b (torchrun's convention) plus any aliases.

    With ``from_env`` the option's default is looked up in MESHRUN_<DEST> first, so that
    every flag can be set from the environment (a flag on the command line still wins)."""
    spellings = []
    for n in (name, *aliases):
        if n.startswith("--"):
            dash, under = n.replace("_", "-"), "--" + n[2:].replace("-", "_")
            spellings += [dash] + ([under] if under != dash else [])
        else:
            spellings.append(n)
    kw.setdefault("dest", name[2:].replace("-", "_"))
    env_default = None
    if from_env:
        kind = "bool" if kw.get("action") == "store_true" else "int" if kw.get("type") is int else "str"
        choices = tuple(kw["choices"]) if "choices" in kw else None  # type: ignore[call-overload]
        env_default = EnvDefault(name, kw.pop("default", False if kind == "bool" else None), kind, choices)
        kw["default"] = None
    action = p.add_argument(*spellings, **kw)  # type: ignore[arg-type]
    action.meshrun_env = env_default  # type: ignore[attr-defined]


_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def fill_env_defaults(ns: argparse.Namespace, env: Mapping[str, str],
                      actions: Sequence[argparse.Action]) -> None:
    """Give every option of the command (its parser's ``actions``) left unset on the command
    line its MESHRUN_<DEST> value or default."""
    for action in actions:
        opt: EnvDefault | None = getattr(action, "meshrun_env", None)
        dest = action.dest
        if opt is None or not hasattr(ns, dest) or getattr(ns, dest) is not None:
            continue
        var = ENV_PREFIX + dest.upper()
        raw = env.get(var)
        if raw is None:
            setattr(ns, dest, opt.default)
            continue
        src = f"env {var}"
        env_sourced = getattr(ns, "_env_sources", {})
        env_sourced[dest] = src
        ns._env_sources = env_sourced
        if opt.kind == "bool":
            if raw.strip().lower() not in _TRUE + _FALSE:
                raise bad_value(src, raw, "not a yes/no value", "use 1 or 0")
            value: object = raw.strip().lower() in _TRUE
        elif opt.kind == "int":
            value = parse_int(raw, src)
        else:
            value = raw
        if opt.choices and value not in opt.choices:
            raise bad_value(src, raw, f"not one of {', '.join(opt.choices)}", f"see {opt.flag} in --help")
        setattr(ns, dest, value)


def add_topology_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("topology (override what the platform says)")
    add_option(g, "--platform", from_env=False, metavar="NAME", help=f"skip detection: one of {', '.join(PLATFORMS)}")
    add_option(g, "--nnodes", from_env=False, metavar="N|MIN:MAX", help="number of nodes; MIN:MAX for an elastic job")
    add_option(g, "--node-rank", from_env=False, metavar="R", help="this node's rank, 0..nnodes-1")
    add_option(g, "--nproc", "--nproc-per-node", from_env=False, metavar="G", dest="nproc_per_node",
               help="processes on this node (default: one per visible GPU; 2 on a CPU-only machine)")
    add_option(g, "--master-addr", from_env=False, metavar="HOST", help="node 0's address (rendezvous host)")
    add_option(g, "--master-port", from_env=False, metavar="PORT", help="rendezvous port (default 29500)")
    add_option(g, "--hosts", from_env=False, metavar="H0,H1,..", help="every node's address in node-rank order")
    add_option(g, "--run-id", from_env=False, metavar="ID", help="rendezvous id shared by the job's nodes")


def add_rdzv_timeout_option(g: argparse._ActionsContainer) -> None:
    add_option(g, "--rdzv-timeout", type=int, metavar="S",
               help=f"multi-node: seconds to wait for the master and the other nodes before a one-line "
                    f"error saying why (default {DEFAULT_TIMEOUT_S})")


def prepare_network(topo: Topology, cmd: Command, env: Mapping[str, str], timeout_s: int | None) -> Command:
    """Multi-node only, before anything starts: the master's name must resolve; a node other
    than 0 waits (bounded) until the master's port answers; and the interface that routes to
    the master becomes GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, unless the user set them."""
    if topo.nnodes == 1 or not cmd.processes:
        return cmd
    timeout = timeout_s if timeout_s is not None else DEFAULT_TIMEOUT_S
    if timeout < 1:
        raise bad_value("--rdzv-timeout", timeout, "must be >= 1 second")
    source = topo.source("master_addr")
    addr = resolve_host(topo.master_addr, timeout, source)
    if topo.node_rank != 0 or (topo.local_rank or 0) != 0:
        wait_reachable(topo.master_addr, topo.master_port, timeout, source)
    extra = dict(cmd.env)
    ifname = route_interface(addr)
    if ifname:
        for var in IFNAME_VARS:
            if var not in env:
                extra[var] = ifname
    return dataclasses.replace(cmd, env=extra)


def topology_from_args(ns: argparse.Namespace, env: Mapping[str, str],
                       gpus: int) -> tuple[Topology, tuple[int, int] | None]:
    user = user_topology(vars(ns), env)
    topo = resolve(env, gpus, user.platform, user.overrides, free_port=free_port)
    return topo, user.elastic


def check_ports(topo: Topology, cmd: Command, spec: LaunchSpec) -> None:
    """Refuse to start when a port this node must listen on is taken: the rendezvous would
    otherwise fail late, after every other node has started and waited."""
    if "--standalone" in cmd.argv or not cmd.processes:
        return
    ports: list[int] = []
    if spec.framework == "tensorflow":
        ports = [topo.master_port + lr for lr in range(topo.nproc_per_node)
                 if topo.local_rank in (None, lr)]
    elif topo.node_rank == 0 and topo.local_rank in (None, 0):
        ports = [topo.master_port]
    for port in ports:
        if not port_is_free(port):
            raise bad_value(topo.source("master_port"), port,
                            f"port {port} is already in use on this node (the rendezvous master)",
                            "choose another with --master-port, or stop what holds it")


# ---- commands ---------------------------------------------------------------------------

def socket_interface(topo: Topology, env: Mapping[str, str]) -> tuple[str | None, str]:
    """(interface, where it comes from) for `meshrun env`: the user's variable, else the
    interface that routes to the master (multi-node only)."""
    for var in IFNAME_VARS:
        if env.get(var):
            return env[var], f"env {var}"
    if topo.nnodes == 1:
        return None, "single node: not needed"
    try:
        addr = resolve_host(topo.master_addr, 5, topo.source("master_addr"))
    except MeshrunError:
        return None, f"{topo.master_addr} does not resolve here"
    ifname = route_interface(addr)
    return ifname, f"routes to {topo.master_addr}" if ifname else "no route found"


def cmd_env(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    topo, _ = topology_from_args(ns, env, count_visible_gpus(env))
    ifname, if_source = socket_interface(topo, env)
    if ns.json:
        out = topo.to_dict()
        out["socket_ifname"] = ifname
        out.setdefault("sources", {})["socket_ifname"] = if_source
        print(json.dumps(out, indent=2))
        return 0
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"meshrun topology ({topo.platform})")
    table.add_column("field")
    table.add_column("value")
    table.add_column("source")
    for name in FIELDS + ("world_size",):
        value = getattr(topo, name)
        if name == "hosts":
            value = ", ".join(value) if value else "(not given by the platform)"
        if name == "local_rank" and value is None:
            value = "(launcher mode: meshrun starts the node's processes)"
        src = "nnodes x nproc_per_node" if name == "world_size" else topo.source(name)
        table.add_row(name, str(value), src)
    table.add_row("socket interface", ifname or "-", if_source + (" (GLOO/NCCL_SOCKET_IFNAME)" if ifname and
                                                                   not if_source.startswith("env") else ""))
    Console().print(table)
    return 0


def launch_spec(ns: argparse.Namespace, elastic: tuple[int, int] | None) -> LaunchSpec:
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
        rdzv_timeout=ns.rdzv_timeout,
    )


def cmd_launch(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    fw = ns.framework
    if fw not in FRAMEWORKS:
        raise bad_value("--framework", fw, "unknown framework", f"choose one of {', '.join(FRAMEWORKS)}")
    gpus = count_visible_gpus(env)
    topo, elastic = topology_from_args(ns, env, gpus)
    topo = per_framework(topo, fw, gpus)
    spec = launch_spec(ns, elastic)
    cmd = build(topo, spec, env.get("CUDA_VISIBLE_DEVICES"))
    if ns.dry_run:
        print_dry_run(cmd, ns.json)
        return 0
    check_ports(topo, cmd, spec)
    cmd = prepare_network(topo, cmd, env, ns.rdzv_timeout)
    return run_multinode_aware(cmd, env, topo, spec)


def run_multinode_aware(cmd: Command, env: Mapping[str, str], topo: Topology, spec: LaunchSpec,
                        **kw: object) -> int:
    """Execute; on a multi-node torchrun job, turn a rendezvous timeout into one line."""
    from .launch.rdzvwatch import RendezvousWatch
    from .launch.run import execute

    uses_torchrun = bool(cmd.processes) and cmd.processes[0].argv[0] == "torchrun"
    watch = RendezvousWatch() if topo.nnodes > 1 and uses_torchrun else None
    code = execute(cmd, env, watch=watch, **kw)  # type: ignore[arg-type]
    if code and watch is not None and watch.timed_out:
        print(f"meshrun: error: {watch.message(topo.master_addr, topo.master_port, topo.nnodes, spec.rdzv_timeout)}",
              file=sys.stderr, flush=True)
    return code


def print_dry_run(cmd: Command, as_json: bool) -> None:
    from .launch.run import resolve_program

    def exact(argv: tuple[str, ...]) -> list[str]:
        # Show the program meshrun would really start; fall back to its name if missing.
        try:
            return [resolve_program(argv[0]), *argv[1:]]
        except MeshrunError:
            return list(argv)

    procs = [{"argv": exact(p.argv), "env": cmd.env_of(i)} for i, p in enumerate(cmd.processes)]
    if as_json:
        out = {"argv": procs[0]["argv"] if procs else [], "env": procs[0]["env"] if procs else dict(cmd.env),
               "processes": procs, "files": dict(cmd.files), "note": cmd.note}
        print(json.dumps(out, indent=2))
        return
    import shlex
    if cmd.note:
        print(f"# {cmd.note}")
    for path, text in cmd.files.items():
        print(f"# file {path}:\n" + "".join(f"#   {line}\n" for line in text.splitlines()), end="")
    for p in procs:
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(p["env"].items()))  # type: ignore[union-attr]
        print(f"{assigns} {shlex.join(p['argv'])}".strip())  # type: ignore[arg-type]


def make_parser() -> Parser:
    parser = Parser(prog="meshrun", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"meshrun {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)

    p_env = sub.add_parser("env", help="show the detected topology and where each value came from",
                           description=ENV_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_topology_options(p_env)
    p_env.add_argument("--json", action="store_true", help="print one JSON object")
    p_env.set_defaults(func=cmd_env)

    p = sub.add_parser("launch", help="start a training script on this node for its framework",
                       description=LAUNCH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_option(p, "--framework", "-f", metavar="NAME", default="torch", help=f"one of {', '.join(FRAMEWORKS)} (default torch)")
    add_topology_options(p)
    g = p.add_argument_group("launcher")
    add_option(g, "--rdzv", choices=("static", "c10d"), default="static",
               help="torchrun rendezvous: static (fixed nodes, default) or c10d (needed for elastic)")
    add_option(g, "--max-restarts", type=int, default=0, metavar="N", help="torchrun worker-group restarts")
    add_rdzv_timeout_option(g)
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

    from .bench_cli import add_bench_parser
    from .doctor_cli import add_doctor_parser
    from .plan_cli import add_plan_parser
    from .render_cli import add_render_parser
    from .train_cli import add_train_parser

    add_train_parser(sub)
    add_plan_parser(sub)
    add_render_parser(sub)
    add_doctor_parser(sub)
    add_bench_parser(sub)
    return parser


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    parser = make_parser()
    environ = dict(os.environ if env is None else env)
    try:
        args = list(sys.argv[1:] if argv is None else argv)
        tail = None
        if args and args[0] == "render" and "--" in args:  # argparse mangles `--` inside subcommands
            cut = args.index("--")
            args, tail = args[:cut], args[cut + 1:]
        ns, extra = parser.parse_known_args(args)
        if extra:
            hint = ("put the command after --, e.g. meshrun render slurm -- meshrun train"
                    if ns.command == "render" else f"see 'meshrun {ns.command or ''} --help'")
            raise MeshrunError(f"unrecognized arguments: {' '.join(extra)} (hint: {hint})")
        if tail is not None:
            ns.cmd = tail
        if ns.command is None:
            parser.print_help()
            return 0
        fill_env_defaults(ns, environ, command_parser(parser, ns.command)._actions)
        return int(ns.func(ns, environ))
    except MeshrunError as exc:
        print(f"meshrun: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    sys.exit(main())
