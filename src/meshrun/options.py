"""One declaration per option: a dataclass field made with ``option()``. Training options
(config/sections.py), the job's (job/__init__.py), a launch's waits (launch/options.py) and the
topology's (cluster/options.py) are all declared so.

From that field alone come the command-line flag (``--name-with-dashes`` and its help), the
``MESHRUN_<NAME>`` variable, the key of a ``--config`` file, the keyword of ``meshrun.train()``,
the conversion of a loosely typed value (text from a variable, a number from YAML) and the
checks every option of its kind gets: a choice among ``choices``, a bound, a finite number.
``read`` is the one reader of those sources, for the CLI and the Python API alike. What
concerns several options at once is checked by whoever declares them (a section's ``check``).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import bad_value
from .paths import check_path_text
from .vocab import yes_no

ENV_PREFIX = "MESHRUN_"
# MESHRUN_* variables that are not options: set by meshrun for its workers, or read by its
# internals and tests. A variable of this prefix that is neither one of these nor an option
# of the command being run is warned about (``unknown_variables``).
INTERNAL_VARIABLES = (
    "MESHRUN_TRAIN_CONFIG", "MESHRUN_RUN_DIR", "MESHRUN_LOG_DIR", "MESHRUN_CACHE",
    "MESHRUN_SAVE_THREADS",
    "MESHRUN_BENCH_OUT", "MESHRUN_LOCAL_RANK", "MESHRUN_PROCESS_ID", "MESHRUN_NUM_PROCESSES",
    "MESHRUN_TEST_STRICT", "MESHRUN_SKYPILOT_PYTHON", "MESHRUN_JOB_TOKEN", "MESHRUN_OUT_RUN_ID",
    "MESHRUN_PLATFORMS",  # the user's platforms, read by detection itself (userplatforms.py)
)
SPEC = "meshrun_option"  # the field metadata key that holds an Option
KINDS = ("bool", "int", "float", "str")
# Every whole number ends in a 64-bit integer somewhere (torch's tensors and generators, the
# snapshot's records): a larger one is refused here rather than overflowing inside a rank.
INT_MAX = 2**63 - 1


@dataclass(frozen=True)
class Option:
    """How a field is given and checked. ``help`` may name ``{default}``."""

    help: str
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    minimum: float | None = None
    maximum: float | None = None
    everywhere: bool = True  # False: a flag or a keyword only, no MESHRUN_<NAME> nor config key
    cli: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # extra argparse keywords (nargs, const)
    path: bool = False  # a path the user names (paths.check_path_text); also a str or os.PathLike from Python
    listed: bool = False  # a comma list: a list of names from a config file or Python is taken too
    on_off: bool = False  # on/off words: YAML's true/false (which it reads from on/off) taken as on/off


def option(default: Any, help: str, *, metavar: str | None = None, choices: tuple[str, ...] | None = None,
           minimum: float | None = None, maximum: float | None = None, everywhere: bool = True, path: bool = False,
           listed: bool = False, on_off: bool = False, **cli: Any) -> Any:
    """A config field with everything meshrun needs to offer it (see the module's docstring)."""
    spec = Option(help, metavar, tuple(choices) if choices is not None else None, minimum, maximum, everywhere, cli,
                  path, listed, on_off)
    return dataclasses.field(default=default, metadata={SPEC: spec})


def spec(f: dataclasses.Field[Any]) -> Option:
    found = f.metadata.get(SPEC)
    if not isinstance(found, Option):
        raise TypeError(f"config field {f.name} is not declared with option()")
    return found


def option_fields(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of ``cls`` declared with ``option()``, in declaration order."""
    return [f for f in dataclasses.fields(cls) if SPEC in f.metadata]


def kind(f: dataclasses.Field[Any]) -> str:
    """bool, int, float or str: the field's type without ``| None`` (annotations are strings here)."""
    name = str(f.type).replace(" | None", "").strip()
    if name not in KINDS:
        raise TypeError(f"config field {f.name}: type {f.type} is not one of {', '.join(KINDS)} (or | None)")
    return name


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def anywhere(cls: type) -> list[str]:
    """The options of ``cls`` a MESHRUN_<NAME> variable and a config file's key may set too."""
    return [f.name for f in option_fields(cls) if spec(f).everywhere]


def env_var(name: str) -> str:
    return ENV_PREFIX + name.upper()


def help_text(f: dataclasses.Field[Any]) -> str:
    return spec(f).help.format(default=f.default)


def argparse_keywords(f: dataclasses.Field[Any]) -> dict[str, Any]:
    """What ``add_argument`` takes for the field's flag. Its default is always None, so that a
    value not given on the command line can come from MESHRUN_<NAME>, the config file or the
    field's default, in that order. A yes/no option that is off by default is a bare flag; one
    that is on takes on|off. The value stays text: ``coerce`` and ``check`` judge it, as they
    judge one from a variable, a config file or ``meshrun.train(...)``, in one line naming the
    source (argparse's own type errors said it another way, for flags alone)."""
    s, k = spec(f), kind(f)
    kw: dict[str, Any] = {"default": None, "help": help_text(f).replace("%", "%%")}
    if k == "bool" and f.default is False:
        kw.update(action="store_const", const=True)
    else:
        kw["metavar"] = s.metavar or ("on|off" if k == "bool" else "|".join(s.choices) if s.choices else "X")
    kw.update(s.cli)
    return kw


def coerce(f: dataclasses.Field[Any], value: Any, where: str) -> Any:
    """A value from a config file, a variable or Python, as the field's type; one line when it
    is not one."""
    k = kind(f)
    try:
        if k == "bool":
            if isinstance(value, str):
                answer = yes_no(value)
                if answer is None:
                    raise ValueError
                return answer
            if not isinstance(value, (bool, int)):
                raise ValueError
            return bool(value)
        if k == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if k == "float":
            if isinstance(value, bool) or not isinstance(value, (int, float, str)):
                raise ValueError
            return float(value)
        return _text(spec(f), value, where)
    except (TypeError, ValueError, OverflowError):  # OverflowError: int() of an infinite float
        if k == "str":
            raise bad_value(where, value, f"expected {_text_kind(spec(f))}, not {type(value).__name__}",
                            _text_hint(spec(f))) from None
        hint = {"bool": "true or false (1/0, yes/no, on/off)", "int": "a whole number", "float": "a number"}[k]
        raise bad_value(where, value, f"expected {k}", hint) from None


def _text(s: Option, value: Any, where: str) -> str:
    """A text option's value: text; a path or bytes for a path (decoded as the file system
    decodes names); a list of names for a comma list; on/off for YAML's booleans where the
    option takes on/off; a whole number as its digits (``nnodes: 2``, ``out: 2024``). A list, a
    mapping, a boolean or a float anywhere else raises ValueError."""
    if s.path and isinstance(value, (os.PathLike, bytes)):
        value = os.fsdecode(value)
    if s.listed and isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        value = ",".join(v.strip() for v in value)
    if isinstance(value, bool):
        if not s.on_off:
            raise ValueError
        value = "on" if value else "off"
    if isinstance(value, int):
        value = str(value)
    if not isinstance(value, str):
        raise ValueError
    if s.path:
        check_path_text(value, where)
    return value


def _text_kind(s: Option) -> str:
    return "a path" if s.path else "a comma list of names" if s.listed else "text"


def _text_hint(s: Option) -> str:
    if s.path:
        return "give the path as text; quote it in YAML or TOML"
    if s.listed:
        return "names separated by commas, or a list of names"
    return "quote it in YAML or TOML" + (": on or off" if s.on_off else "")


def check(f: dataclasses.Field[Any], value: Any, where: str) -> None:
    """The checks an option's declaration asks for: a choice, a finite number, a bound."""
    s = spec(f)
    if value is None:
        return
    if s.choices is not None and value not in s.choices:
        raise bad_value(where, value, "unknown value", f"choose one of {', '.join(s.choices)}")
    if isinstance(value, float) and not math.isfinite(value):  # NaN compares false with every bound
        raise bad_value(where, value, "must be a finite number")
    lo, hi = s.minimum, s.maximum
    if lo is not None and hi is not None and not lo <= value <= hi:
        raise bad_value(where, value, f"must be between {_bound(lo)} and {_bound(hi)}")
    if lo is not None and value < lo:
        raise bad_value(where, value, f"must be at least {_bound(lo)}")
    if hi is not None and value > hi:
        raise bad_value(where, value, f"must be at most {_bound(hi)}")
    if isinstance(value, int) and not isinstance(value, bool) and not -INT_MAX - 1 <= value <= INT_MAX:
        raise bad_value(where, value, f"must be at most {INT_MAX} (a 64-bit integer)")


def _bound(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def where(name: str, source: str) -> str:
    """How an error names a value: its flag, and the source when that is not the command line
    (``--steps (from env MESHRUN_STEPS)``)."""
    return flag(name) if source == "flag" else f"{flag(name)} (from {source})"


def env_values(names: list[str], env: Mapping[str, str]) -> tuple[dict[str, str], dict[str, str]]:
    """The options among ``names`` that MESHRUN_<NAME> variables of ``env`` set, and their
    sources ("env VAR"). A variable set to nothing (``MESHRUN_STEPS=``) sets nothing, as an
    unset one: a job script's ``export MESHRUN_X=$MAYBE`` leaves the default in place."""
    values: dict[str, str] = {}
    sources: dict[str, str] = {}
    for name in names:
        var = env_var(name)
        if env.get(var, "").strip():
            values[name], sources[name] = env[var], f"env {var}"
    return values, sources


def read(cls: type, file_values: Mapping[str, Any], file_name: str | None, env: Mapping[str, str],
         given: Mapping[str, Any], given_source: str) -> tuple[dict[str, Any], dict[str, str]]:
    """The options of ``cls`` that a user set, from every source, in one way for the CLI and
    ``meshrun.train(...)``: a config file's keys < MESHRUN_<NAME> < ``given`` (the flags, or
    the keywords: ``given_source`` says which). Each value is converted to its option's type
    (``coerce``) whatever it came from, an error naming that source; (values, sources). The
    declared checks are the caller's to run (``check_all``), once the options that depend on
    each other are known."""
    by_name = {f.name: f for f in option_fields(cls)}
    everywhere = anywhere(cls)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, value in file_values.items():
        if name in everywhere and value is not None:  # `name: null` in a file: the default, as if not there
            values[name], sources[name] = value, f"config {file_name}"
    env_vals, env_sources = env_values(everywhere, env)
    values.update(env_vals)
    sources.update(env_sources)
    for name, value in given.items():
        if name in by_name and value is not None:
            values[name], sources[name] = value, given_source
    return {name: coerce(by_name[name], value, where(name, sources[name])) for name, value in values.items()}, sources


def check_all(cls: type, values: Mapping[str, Any], sources: Mapping[str, str]) -> None:
    """Every declared check of the options of ``cls`` in ``values``."""
    for f in option_fields(cls):
        if f.name in values:
            check(f, values[f.name], where(f.name, sources.get(f.name, "flag")))


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


def unknown_variables(env: Mapping[str, str], known: set[str], command: str) -> list[str]:
    """One warning line per MESHRUN_* variable of ``env`` that is neither in ``known`` (what
    ``command`` reads) nor one of meshrun's own: a misspelled variable would otherwise be
    ignored without a word. The CLI and ``meshrun.train(...)`` print the same lines."""
    lines = []
    for var in sorted(env):
        if not var.startswith(ENV_PREFIX) or var in known or var in INTERNAL_VARIABLES:
            continue
        near = nearest_variable(var, known)
        hint = f"did you mean {near}?" if near else f"see 'meshrun {command} --help' for its options"
        lines.append(f"meshrun: warning: {var} is not a variable of meshrun {command}; ignored ({hint})")
    return lines
