"""Byte sizes as users write them (80GiB, 80GB, 1.5TiB) and as tables show them; counts,
durations, clock times and ranges as meshrun's lines show them."""

from __future__ import annotations

import re

from .errors import bad_value

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_bytes(text: str | int | float, where: str) -> int:
    """``80GiB`` -> 85899345920. A bare number is refused unless it is a plain byte count
    above a megabyte: ``80`` almost always means 80 GiB and silently taking 80 bytes would
    make every strategy "not fit"."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value, unit = float(text), ""
    else:
        m = _SIZE.match(str(text))
        if not m or m.group(2).lower() not in _UNITS:
            raise bad_value(where, text, "is not a size", "write it with a unit, e.g. 80GiB, 40GB or 512MiB")
        value, unit = float(m.group(1)), m.group(2).lower()
    if value <= 0:
        raise bad_value(where, text, "must be positive", "e.g. 80GiB")
    if unit in ("", "b") and value < 2**20:
        raise bad_value(where, text, "has no unit, and is too small to be bytes", f"did you mean {text}GiB?")
    return int(value * _UNITS[unit])


def fmt_bytes(n: float) -> str:
    """Binary units, 3 significant digits: 1.23 GiB, 512 MiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            v = n / size
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{n:.0f} B"


def fmt_count(n: float) -> str:
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if abs(n) >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:.0f}"


def fmt_seconds(s: float) -> str:
    """A duration with 3 significant figures in the unit that reads best: 293 µs, 4.75 ms, 3.78 s."""
    if s >= 1:
        return f"{s:.3g} s"
    if s >= 1e-3:
        return f"{s * 1e3:.3g} ms"
    return f"{s * 1e6:.3g} µs"


def clock(seconds: float) -> str:
    """Seconds as a clock reads: H:MM:SS, or M:SS under an hour."""
    whole = int(round(seconds))
    hours, rest = divmod(whole, 3600)
    return f"{hours}:{rest // 60:02d}:{rest % 60:02d}" if hours else f"{rest // 60}:{rest % 60:02d}"


def span(values: list[float], fmt: str = ".2f", unit: str = "") -> str:
    """The smallest and largest of ``values`` as a range, ``0.25-0.31 s``; one figure when the
    two print alike (``0.28 s``, not ``0.28-0.28 s``). ``fmt`` is a format spec (``.2f``,
    ``,.0f``), ``unit`` follows after a space."""
    lo, hi = format(min(values), fmt), format(max(values), fmt)
    figure = lo if lo == hi else f"{lo}-{hi}"
    return f"{figure} {unit}" if unit else figure
