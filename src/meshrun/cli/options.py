"""The argument machinery every command shares: one-line errors, options spelled with dashes
or underscores whose defaults may come from MESHRUN_<NAME>, the topology options, and small
parsers for numeric option values."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..cluster.detect import resolve
from ..cluster.net import free_port
from ..cluster.options import TopologyOptions, parse_int, user_topology
from ..cluster.topology import Topology
from ..errors import MeshrunError, bad_value
from ..launch.options import WaitOptions
from ..options import (
    ENV_PREFIX,
    anywhere,
    argparse_keywords,
    check_all,
    env_var,
    flag,
    option_fields,
    read,
    unknown_variables,
    where,
)
from ..vocab import yes_no


class Parser(argparse.ArgumentParser):
    """argparse that reports errors as one line and exit code 2, as meshrun does everywhere."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise MeshrunError(f"{message} (see '{self.prog} --help')")


# A command's common options, as its short --help lists them: (group title, ((flag, one-line
# summary), ...)) in order. The flag's metavar comes from the command's own option.
ShortGroups = tuple[tuple[str, tuple[tuple[str, str], ...]], ...]


@dataclass(frozen=True)
class ShortHelp:
    """What a command with many options prints for -h/--help: ``intro``, its common options
    (``groups``), then ``outro`` (where the rest are: --help-all prints argparse's whole help)."""

    intro: str
    groups: ShortGroups
    outro: str

    def text(self, parser: argparse.ArgumentParser) -> str:
        """The help text, formatted by argparse as ``parser``'s own (its prog, usage, width)."""
        by_flag = {name: action for action in parser._actions for name in action.option_strings}
        short = argparse.ArgumentParser(prog=parser.prog, usage=parser.usage, description=self.intro,
                                        epilog=self.outro, add_help=False,
                                        formatter_class=argparse.RawDescriptionHelpFormatter)
        for title, options in self.groups:
            group = short.add_argument_group(title)
            for name, summary in options:
                action = by_flag[name]  # (a KeyError here: a listed flag the command lacks)
                if action.nargs == 0:
                    group.add_argument(name, action="store_true", help=summary.replace("%", "%%"))
                else:
                    group.add_argument(name, nargs=action.nargs, metavar=action.metavar or action.dest.upper(),
                                       help=summary.replace("%", "%%"))
        return short.format_help()


class _ShortHelpAction(argparse.Action):
    def __init__(self, option_strings: Sequence[str], dest: str, short: ShortHelp, **kw: Any) -> None:
        super().__init__(option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, nargs=0, **kw)
        self.short = short

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: object,
                 option_string: str | None = None) -> None:
        parser._print_message(self.short.text(parser), sys.stdout)
        parser.exit()


def add_short_help(p: argparse.ArgumentParser, short: ShortHelp) -> None:
    """-h/--help: ``short``'s text; --help-all: every option, grouped, and the whole
    description (argparse's help). ``p`` is made with ``add_help=False``."""
    p.add_argument("-h", "--help", action=_ShortHelpAction, short=short,
                   help="the common options only (--help-all: all of them)")
    p.add_argument("--help-all", action="help", help="every option, grouped, with the whole manual")


@dataclass(frozen=True)
class EnvDefault:
    """An option whose default may come from MESHRUN_<DEST> before its built-in default."""

    flag: str
    default: object
    kind: str  # "bool" | "int" | "str"
    choices: tuple[str, ...] | None


# add_option hangs an EnvDefault on each action it creates (as ``meshrun_env``), so that
# commands sharing an option name (--model, --precision, --framework) keep their own
# defaults and choices. An option declared with ``option()`` (options.py) has none: the one
# reader of its sources (``options.read``) takes its variable; the action names that variable
# (``meshrun_var``) for warn_unknown_env.


def add_option(p: argparse._ActionsContainer, name: str, *aliases: str, from_env: bool = True,
               **kw: object) -> argparse.Action:
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
    vars(action)["meshrun_env"] = env_default  # (a field argparse.Action does not declare)
    return action


def add_declared(g: argparse._ActionsContainer, cls: type, *, aliases: Mapping[str, tuple[str, ...]] | None = None,
                 only: tuple[str, ...] | None = None) -> None:
    """The flags of the options ``cls`` declares (all, or ``only`` these), from their
    declarations; ``aliases``: other spellings by option name, listed first (--nproc)."""
    everywhere = anywhere(cls)
    for f in option_fields(cls):
        if only is not None and f.name not in only:
            continue
        names = (*(aliases or {}).get(f.name, ()), flag(f.name))
        action = add_option(g, *names, from_env=False, dest=f.name, **argparse_keywords(f))
        vars(action)["meshrun_var"] = env_var(f.name) if f.name in everywhere else None


def read_declared(cls: type, ns: argparse.Namespace, env: Mapping[str, str]) -> dict[str, Any]:
    """The options of ``cls`` a command was given (its flags, over MESHRUN_<NAME>), checked by
    their declarations: the values set, by name."""
    values, sources = read(cls, {}, None, env, {f.name: getattr(ns, f.name, None) for f in option_fields(cls)}, "flag")
    check_all(cls, values, sources)
    return values


def read_one(cls: type, name: str, ns: argparse.Namespace, env: Mapping[str, str]) -> tuple[Any, str]:
    """One option that ``cls`` declares, for a command that takes it alone of them: its value
    (the flag, over MESHRUN_<NAME>; None when unset), checked by its declaration, and where it
    came from (for the errors of later checks)."""
    var = env_var(name)
    values, sources = read(cls, {}, None, {var: env[var]} if var in env else {}, {name: getattr(ns, name, None)},
                           "flag")
    check_all(cls, values, sources)
    return values.get(name), where(name, sources.get(name, "flag"))


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
    names = {env_var(name) for name in anywhere(TopologyOptions)}
    for action in parser._actions:
        if getattr(action, "meshrun_env", None) is not None:
            names.add(env_var(action.dest))
        var = getattr(action, "meshrun_var", None)
        if var is not None:
            names.add(var)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                names |= option_variables(sub)
    return names


def warn_unknown_env(env: Mapping[str, str], parser: argparse.ArgumentParser, command: str) -> None:
    """One warning line per MESHRUN_* variable that no option of ``command`` reads and that is
    not one of meshrun's own: a misspelled variable would otherwise be ignored without a word."""
    for line in unknown_variables(env, option_variables(parser), command):
        print(line, file=sys.stderr)


def add_topology_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("topology (override what the platform says)")
    add_declared(g, TopologyOptions, aliases={"nproc_per_node": ("--nproc",)})


def add_rdzv_timeout_option(g: argparse._ActionsContainer) -> None:
    add_declared(g, WaitOptions, only=("rdzv_timeout",))


def add_finish_timeout_option(g: argparse._ActionsContainer) -> None:
    add_declared(g, WaitOptions, only=("finish_timeout",))


def waits_from_args(ns: argparse.Namespace, env: Mapping[str, str]) -> WaitOptions:
    """--rdzv-timeout and --finish-timeout, where the command has them, over their variables."""
    return WaitOptions(**read_declared(WaitOptions, ns, env))


def topology_from_args(ns: argparse.Namespace, env: Mapping[str, str], gpus: int,
                       fixed_nodes: str | None = None) -> tuple[Topology, tuple[int, int] | None]:
    """The topology: what the platform says, under the topology options the command was given
    (``fixed_nodes``: the command, when it takes no node range)."""
    user = user_topology(vars(ns), env, fixed_nodes=fixed_nodes)
    topo = resolve(env, gpus, user.platform, user.overrides, free_port=free_port)
    return topo, user.elastic


def int_option(ns: argparse.Namespace, name: str, minimum: int = 0,
               maximum: tuple[int, str] | None = None) -> int | None:
    """An option given as text (or from MESHRUN_<NAME>) as an integer >= ``minimum`` (and at most
    ``maximum``: the bound, and why), or None when unset; a bad value names where it came from."""
    raw = getattr(ns, name)
    if raw is None:
        return None
    src = getattr(ns, "_env_sources", {}).get(name, "--" + name.replace("_", "-"))
    value = parse_int(str(raw), src)
    if value < minimum:
        raise bad_value(src, raw, f"must be >= {minimum}")
    if maximum is not None and value > maximum[0]:
        raise bad_value(src, raw, f"must be at most {maximum[0]:,} ({maximum[1]})")
    return value
