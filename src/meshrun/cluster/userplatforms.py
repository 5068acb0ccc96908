"""Platforms the user adds: subclasses of :class:`~meshrun.cluster.platforms.base.Platform`.

Two ways to register one, both naming the class as ``module:Class``:

* the variable ``MESHRUN_PLATFORMS=module:Class[,module:Class...]`` (the module importable
  from ``sys.path``, e.g. through PYTHONPATH);
* an entry point of the group ``meshrun.platforms`` in an installed package's metadata::

      [project.entry-points."meshrun.platforms"]
      borg = "mypkg.platforms:Borg"

User platforms are tried before the built-in ones (except a torchrun worker's own variables,
which are the truth inside any platform): those of MESHRUN_PLATFORMS in the order listed, then
the entry points' by entry-point name. A class registered both ways counts once.
Each name must be new: a user platform named like a built-in one, or like another user
platform, is refused. A bad registration (a module that cannot be imported, no such class, a
class that is not a Platform, a detect() that raises anything but MeshrunError or returns
something else than a Topology or None) is a MeshrunError naming the value and where it came
from, which the CLI prints as one line and exit code 2. The user's code runs contained: what
it raises, ``sys.exit()`` and KeyboardInterrupt included, becomes that line, and what it prints
goes to stderr, so that ``--json`` output stays one JSON document.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
import traceback
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points

from ..errors import MeshrunError, bad_value
from .platforms.base import Platform
from .topology import Topology

VARIABLE = "MESHRUN_PLATFORMS"
ENTRY_POINT_GROUP = "meshrun.platforms"
FORM_HINT = "give module:Class, the class a subclass of meshrun.cluster.platforms.base.Platform"


@contextlib.contextmanager
def contained(error: Callable[[str], MeshrunError]) -> Iterator[None]:
    """Run the user's code (an import, a constructor, detect()) so that whatever it raises,
    sys.exit() and KeyboardInterrupt included, is ``error("raised ...")`` (a MeshrunError of
    its own passes through), and what it prints goes to stderr."""
    with contextlib.redirect_stdout(sys.stderr):
        try:
            yield
        except MeshrunError:
            raise
        except SystemExit as exc:
            raise error(f"called sys.exit({exc.code!r})") from None
        except BaseException as exc:  # KeyboardInterrupt and GeneratorExit too: the user's code, not a Ctrl-C of ours
            raise error(f"raised {describe(exc)}") from None


def describe(exc: BaseException) -> str:
    """``ValueError: bad thing (at mod.py:12)`` in one line: the exception and where it was raised."""
    message = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__)
    if frames:
        text += f" (at {frames[-1].filename}:{frames[-1].lineno})"
    return text


@dataclass(frozen=True)
class Registration:
    """A user platform and where it was registered (``env MESHRUN_PLATFORMS``, an entry point)."""

    platform: Platform
    source: str
    value: str  # module:Class as given

    def error(self, problem: str, hint: str) -> MeshrunError:
        return bad_value(self.source, self.value, problem, hint)

    def detect(self, env: Mapping[str, str], gpus: int) -> Topology | None:
        """The platform's detect(), its own MeshrunErrors passed on, anything else made one line."""
        hint = f"fix {type(self.platform).__name__}.detect, or remove it from {self.source}"
        with contained(lambda what: self.error(f"its detect() {what}", hint)):
            topo = self.platform.detect(env, gpus)
        if topo is not None and not isinstance(topo, Topology):
            raise self.error(f"its detect() returned a {type(topo).__name__}, not a Topology or None",
                             "return None when its variables are absent, else a meshrun.cluster.topology.Topology")
        return topo


def load_class(value: str, source: str) -> type[Platform]:
    """The Platform subclass ``value`` (``module:Class``, or ``module:Outer.Class``) names."""
    module_name, colon, attr = (part.strip() for part in value.partition(":"))
    if not colon or not module_name or not attr:
        raise bad_value(source, value, "is not module:Class", FORM_HINT)
    with contained(lambda what: bad_value(source, value, f"importing module {module_name} {what}", "fix the module")):
        try:
            obj: object = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and (module_name == exc.name or module_name.startswith(exc.name + ".")):
                raise bad_value(source, value, f"module {module_name} is not importable (no module named "
                                f"{exc.name})", "install its package, or put its directory on PYTHONPATH") from None
            raise bad_value(source, value, f"importing module {module_name} raised {describe(exc)}",
                            "fix the module, or install what it imports") from None

    for name in attr.split("."):
        try:
            obj = getattr(obj, name)
        except AttributeError:
            raise bad_value(source, value, f"module {module_name} has no {attr}",
                            "check the class name's spelling") from None
    if not (isinstance(obj, type) and issubclass(obj, Platform)):
        raise bad_value(source, value, f"{attr} is not a subclass of Platform", FORM_HINT)
    return obj


def create(cls: type[Platform], value: str, source: str) -> Platform:
    """One instance of ``cls``, its NAME and MARKERS checked."""
    for member in ("NAME", "MARKERS", "MASTER_HINT"):
        if not isinstance(getattr(cls, member, None), str) or not getattr(cls, member).strip():
            raise bad_value(source, value, f"{cls.__name__}.{member} is not set to a text",
                            f"give the class a {member} string (see Platform's docstring)")
    with contained(lambda what: bad_value(source, value, f"{cls.__name__}() {what}", "a platform is created with "
                                          "no arguments; implement detect(self, env, gpus)")):
        return cls()


@functools.lru_cache(maxsize=1)
def entry_point_values() -> tuple[tuple[str, str], ...]:
    """(name, module:Class) of the group's entry points, by name; read once per process."""
    return tuple(sorted((ep.name, ep.value) for ep in entry_points(group=ENTRY_POINT_GROUP)))


def registered(env: Mapping[str, str]) -> list[tuple[str, str]]:
    """(module:Class, source) of every registration, in the order they are tried."""
    found = [(item.strip(), f"env {VARIABLE}") for item in env.get(VARIABLE, "").split(",") if item.strip()]
    found += [(value, f"entry point {name} (group {ENTRY_POINT_GROUP})") for name, value in entry_point_values()]
    return found


def load(env: Mapping[str, str], builtin: Collection[str]) -> tuple[Registration, ...]:
    """The user platforms, in the order they are tried; ``builtin`` names the built-in ones."""
    out: list[Registration] = []
    seen: dict[type[Platform], Registration] = {}
    for value, source in registered(env):
        cls = load_class(value, source)
        if cls in seen:
            continue
        platform = create(cls, value, source)
        taken = "a built-in platform" if platform.NAME in builtin else next(
            (f"{r.value} from {r.source}" for r in out if r.platform.NAME == platform.NAME), None)
        if taken:
            raise bad_value(source, value, f"its NAME {platform.NAME!r} is already the name of {taken}",
                            "give the class another NAME")
        reg = Registration(platform, source, value)
        seen[cls] = reg
        out.append(reg)
    return tuple(out)
