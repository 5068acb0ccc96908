"""meshrun: take a training script from one GPU to many nodes, on any cluster.

commands:
  meshrun env [--json]                 show the topology meshrun detects here, and why
  meshrun launch [options] script.py   start the script on this node for its framework
                                       (torch, deepspeed, accelerate, jax, tensorflow)
  meshrun train [options]              train with meshrun's trainer (default: a small GPT
                                       on the Python standard library's source)
  meshrun data prepare IN --tokenizer T --out DIR
                                       tokenize a text corpus once into token shards
                                       (--train-tokenizer VOCAB: train one on it)
  meshrun plan [options]               per-GPU memory of each strategy, the one that fits,
                                       and its ds_config.json / accelerate / train configs
  meshrun render TARGET -- COMMAND     a job spec whose nodes run COMMAND through meshrun;
                                       TARGET: slurm (sbatch), lsf (IBM Spectrum LSF bsub),
                                       skypilot, kubernetes, saturn (Saturn Cloud), or
                                       hostfile (DeepSpeed's)
  meshrun doctor [--json]              check GPUs, versions, the master, interfaces, NCCL settings
  meshrun bench comm|matmul|train      collectives' bus bandwidth, matmul TFLOP/s, training MFU
  meshrun export SNAPSHOT --to DIR     a snapshot's weights as a Hugging Face model directory
                                       (or --to FILE.safetensors: one file); a LoRA run's
                                       adapter in PEFT's format (--merge: merged into its base)
  meshrun generate SOURCE --prompt TEXT
                                       sample a completion from a run, a snapshot, an exported
                                       model or adapter

platforms, detected from their variables in this order (--platform NAME skips detection;
MESHRUN_PLATFORMS adds your own):
  torchrun (a worker torchrun started), lsf (IBM Spectrum LSF), mpi (mpirun), skypilot,
  saturn (Saturn Cloud), kubeflow (Kubeflow, or Kubernetes pods), sagemaker, slurm,
  generic (MASTER_ADDR, NNODES, NODE_RANK), local (this machine alone)

Run 'meshrun COMMAND --help' for each command's manual. Every option accepts dashes or
underscores (--master-port, --master_port) and can also be set through the environment as
MESHRUN_<NAME> (MESHRUN_MASTER_PORT=29600); a flag wins over its variable, and either wins
over what the platform says.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import TextIO

from .. import __version__
from ..cluster.net import ports_released_after
from ..errors import MeshrunError
from .options import Parser, fill_env_defaults, warn_unknown_env

# Each command -> the module of this package that registers its parser. Only the module of the
# command given is imported: `meshrun launch` starts on every node of a job, and importing every
# command's module (the planner, the renderers, YAML) would cost CPU on every node before the
# launcher started (docs/decisions.md#the-launchers-supervision).
COMMANDS = {"env": "env", "launch": "launch", "train": "train", "export": "export", "data": "data",
            "plan": "plan", "render": "render", "doctor": "doctor", "bench": "bench", "generate": "generate"}


def make_parser(command: str | None = None) -> Parser:
    """The parser of ``command`` alone when it names one (others are then unknown to it), else
    of every command (for ``meshrun --help`` and a misspelt command's error)."""
    parser = Parser(prog="meshrun", usage="meshrun [-h] [--version] COMMAND ...", description=__doc__,
                    formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"meshrun {__version__}")
    # help=SUPPRESS: the description lists the commands with their synopses, and argparse's
    # list of them would repeat it (prog: a command's usage starts "meshrun COMMAND")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser, help=argparse.SUPPRESS,
                                prog="meshrun")
    modules = [COMMANDS[command]] if command in COMMANDS else list(dict.fromkeys(COMMANDS.values()))
    for name in modules:
        importlib.import_module(f"{__name__}.{name}").register(sub)
    return parser


def command_parser(parser: argparse.ArgumentParser, command: str) -> argparse.ArgumentParser:
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    found: argparse.ArgumentParser = sub.choices[command]
    return found


def joined_option_values(args: list[str], names: tuple[str, ...]) -> list[str]:
    """``NAME VALUE`` as ``NAME=VALUE`` for options whose values are themselves options
    (``--sbatch-arg --exclusive``), which argparse would otherwise read as a flag of its own."""
    out: list[str] = []
    i = 0
    while i < len(args):
        if args[i] in names and i + 1 < len(args):
            out.append(f"{args[i]}={args[i + 1]}")
            i += 2
        else:
            out.append(args[i])
            i += 1
    return out


def main(argv: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    environ = dict(os.environ if env is None else env)
    try:
        args = list(sys.argv[1:] if argv is None else argv)
        parser = make_parser(args[0] if args else None)
        tail = None
        if args and args[0] == "render" and "--" in args:  # argparse mangles `--` inside subcommands
            cut = args.index("--")
            args, tail = args[:cut], args[cut + 1:]
        if args and args[0] == "render":
            args = joined_option_values(args, ("--sbatch-arg", "--sbatch_arg"))
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
        command = command_parser(parser, ns.command)
        fill_env_defaults(ns, environ, command._actions)
        warn_unknown_env(environ, command, ns.command)
        with ports_released_after():
            return int(ns.func(ns, environ))
    except MeshrunError as exc:
        print(f"meshrun: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        return 130


def entry() -> None:
    if hasattr(signal, "SIGXFSZ"):
        # Past a file-size limit (ulimit -f) a write then fails with EFBIG, which meshrun reports
        # in one line, instead of the signal killing the process with a half-written file
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    closed = [name for name, stream in (("output", sys.stdout), ("error", sys.stderr)) if stream is None]
    if closed:  # (`meshrun train >&-`: Python leaves sys.stdout None, and every print would fail)
        _say(f"meshrun: error: its standard {' and '.join(closed)} stream is closed (hint: redirect it to a file, "
             "or to /dev/null to discard it)")
        sys.exit(2)
    try:
        code = main()
        sys.stdout.flush()  # a closed pipe shows here, not at interpreter exit
    except BrokenPipeError:
        # The reader went away (`meshrun env --json | head -2`): what it wanted it got. As
        # Python's signal documentation advises, the rest of the output goes to devnull, so that
        # the flush at exit does not fail again, and the exit code is 1.
        _discard_output()
        sys.exit(1)
    except OSError as exc:
        if exc.errno not in FULL and not _output_fails():
            raise
        # a write failed for want of space (a full disk behind `> out.log`, /dev/full, a quota):
        # one line on whichever stream still works, and exit code 1: what the command did is not known
        _say(f"meshrun: error: a write failed: {exc.strerror or exc} (hint: free space on the disk its output "
             "or files go to, or redirect its output elsewhere)")
        _discard_output()  # (what stdout still buffers would fail again at exit)
        sys.exit(1)
    sys.exit(code)


FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, over quota, past the file-size limit


def _output_fails() -> bool:
    """Whether stdout or stderr fails now: what a full disk refused stays buffered, and the
    flush fails again."""
    return _fails(sys.stdout) or _fails(sys.stderr)


def _fails(stream: TextIO) -> bool:
    try:
        stream.flush()
    except OSError:
        return True
    return False


def _discard_output() -> None:
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())


def _say(line: str) -> None:
    """``line`` on stderr, else on stdout when stderr is closed or fails."""
    for stream in (sys.__stderr__, sys.__stdout__):
        if stream is None:
            continue
        try:
            stream.write(line + "\n")
            stream.flush()
            return
        except (OSError, ValueError):
            continue
