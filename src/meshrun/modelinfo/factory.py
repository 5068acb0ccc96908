"""Import a user's ``module:factory`` (a model or a dataset builder) by name."""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Callable
from typing import Any

from ..errors import bad_value


def load_factory(spec: str, flag: str) -> Callable[[], Any]:
    """Import ``module:attr`` (the working directory first on sys.path, as `python -m` does)
    and return the callable; a one-line error naming ``flag`` otherwise."""
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module itself failing to import
        raise bad_value(flag, spec, f"cannot import module {module_name!r} ({type(exc).__name__}: {exc})",
                        "run from the directory that holds it, or set PYTHONPATH") from None
    factory: object = getattr(module, attr, None)
    if not callable(factory):
        raise bad_value(flag, spec, f"module {module_name!r} has no callable {attr!r}")
    return factory


def call_factory(spec: str, flag: str) -> Any:
    """Load and call a factory; what it raises becomes a one-line error naming ``flag``."""
    factory = load_factory(spec, flag)
    try:
        return factory()
    except Exception as exc:
        raise bad_value(flag, spec, f"the factory raised {type(exc).__name__}: {exc}".replace("\n", " ")) from None
