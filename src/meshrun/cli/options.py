"""The argument machinery every command shares: one-line errors, options spelled with dashes
or underscores whose defaults may come from MESHRUN_<NAME>, the topology options, and small
parsers for numeric option values."""

from __future__ import annotations

import argparse
import difflib
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ..cluster.detect import PLATFORMS, resolve
from ..cluster.net import free_port
from ..cluster.options import ENV_PREFIX, INTERNAL_VARIABLES, TOPOLOGY_OPTIONS, parse_int, user_topology
from ..cluster.reach import DEFAULT_TIMEOUT_S
from ..cluster.topology import Topology
from ..defaults import FINISH_TIMEOUT_S
from ..errors import MeshrunError, bad_value
from ..vocab import yes_no


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
        listed = kw.get("choices")
        choices = tuple(str(c) for c in listed) if isinstance(listed, (list, tuple)) else None
        env_default = EnvDefault(name, kw.pop("default", False if kind == "bool" else None), kind, choices)
        kw["default"] = None
    action = p.add_argument(*spellings, **kw)  # type: ignore[arg-type]
    action.meshrun_env = env_default  # type: ignore[attr-defined]


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
            answer = yes_no(raw) if raw.strip() else False  # (set but empty: no)
            if answer is None:
                raise bad_value(src, raw, "not a yes/no value", "use 1 or 0")
            value: object = answer
        elif opt.kind == "int":
            value = parse_int(raw, src)
        else:
            value = raw
        if opt.choices and value not in opt.choices:
            raise bad_value(src, raw, f"not one of {', '.join(opt.choices)}", f"see {opt.flag} in --help")
        setattr(ns, dest, value)


def option_variables(parser: argparse.ArgumentParser) -> set[str]:
    """The MESHRUN_<NAME> variables a command reads: its options' (those of its own
    subcommands too) and the topology options' (which meshrun also exports to the workers
    it launches, so a command run inside one sees them)."""
    names = {ENV_PREFIX + name.upper() for name in TOPOLOGY_OPTIONS}
    for action in parser._actions:
        if getattr(action, "meshrun_env", None) is not None:
            names.add(ENV_PREFIX + action.dest.upper())
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                names |= option_variables(sub)
    return names


def nearest_variable(var: str, known: set[str]) -> str | None:
    """The known variable ``var`` most likely meant: one it abbreviates (MESHRUN_NPROC for
    MESHRUN_NPROC_PER_NODE), else the closest spelling of the name after the prefix (the
    shared prefix would make every short name look close)."""
    name = var[len(ENV_PREFIX):]
    by_name = {k[len(ENV_PREFIX):]: k for k in known}
    longer = sorted(n for n in by_name if n.startswith(name + "_"))
    if longer:
        return by_name[min(longer, key=len)]
    close = difflib.get_close_matches(name, sorted(by_name), n=1)
    return by_name[close[0]] if close else None


def warn_unknown_env(env: Mapping[str, str], parser: argparse.ArgumentParser, command: str) -> None:
    """One warning line per MESHRUN_* variable that no option of ``command`` reads and that is
    not one of meshrun's own: a misspelled variable would otherwise be ignored without a word."""
    known = option_variables(parser)
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in known or var in INTERNAL_VARIABLES:
            continue
        near = nearest_variable(var, known)
        hint = f"did you mean {near}?" if near else f"see 'meshrun {command} --help' for its options"
        print(f"meshrun: warning: {var} is not a variable of meshrun {command}; ignored ({hint})", file=sys.stderr)


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




def add_finish_timeout_option(g: argparse._ActionsContainer) -> None:
    add_option(g, "--finish-timeout", type=int, metavar="S", default=FINISH_TIMEOUT_S,
               help="seconds the other ranks of a node may keep running once one has finished; then the "
                    f"launcher names them in one line, stops them and exits 1 (default {FINISH_TIMEOUT_S})")


def topology_from_args(ns: argparse.Namespace, env: Mapping[str, str],
                       gpus: int) -> tuple[Topology, tuple[int, int] | None]:
    user = user_topology(vars(ns), env)
    topo = resolve(env, gpus, user.platform, user.overrides, free_port=free_port)
    return topo, user.elastic


def int_option(ns: argparse.Namespace, name: str, minimum: int = 0) -> int | None:
    """An option given as text (or from MESHRUN_<NAME>) as an integer >= ``minimum``, or None
    when unset; a bad value names where it came from."""
    raw = getattr(ns, name)
    if raw is None:
        return None
    src = getattr(ns, "_env_sources", {}).get(name, "--" + name.replace("_", "-"))
    value = parse_int(str(raw), src)
    if value < minimum:
        raise bad_value(src, raw, f"must be >= {minimum}")
    return value
