"""Expand Slurm's compressed host lists (``gpu[01-04,07],login2``) without calling scontrol.

Slurm's grammar: comma-separated items at the top level; an item is a prefix followed by
optional bracketed range lists, possibly several (``rack[1-2]-node[01-02]``), and a suffix.
Zero padding in a range is kept (``[08-10]`` -> 08, 09, 10). Blanks around an item or a
range are dropped (``a, b`` is the two hosts ``a`` and ``b``).

The host count is computed from the parsed ranges before anything is expanded, and a list
of more than MAX_HOSTS hosts is refused: ``gpu[0-99999999]`` would otherwise take minutes
and gigabytes to expand into names no job has.
"""

from __future__ import annotations

import itertools
import re

from ..errors import bad_value

_TOKEN = re.compile(r"\[([^\[\]]*)\]")
_DIGITS = re.compile(r"[0-9]+")
MAX_HOSTS = 100_000  # far above any real allocation; the bound keeps expansion cheap


def _split_top_level(text: str) -> list[str]:
    items: list[str] = []
    cur: list[str] = []
    depth = 0
    for ch in text:
        if ch == "[":
            depth += 1
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ValueError("unbalanced ']'")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth != 0:
        raise ValueError("unbalanced '['")
    items.append("".join(cur))
    return items


def _parse_ranges(spec: str) -> list[tuple[int, int, int]]:
    """``01-04,07`` -> [(1, 4, 2), (7, 7, 0)]: inclusive bounds and the zero-padded width."""
    out: list[tuple[int, int, int]] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise ValueError("empty range")
        if "-" in part:
            lo, hi = (x.strip() for x in part.split("-", 1))
            if not (_DIGITS.fullmatch(lo) and _DIGITS.fullmatch(hi)):
                raise ValueError(f"bad range {part!r}")
            if int(hi) < int(lo):
                raise ValueError(f"descending range {part!r}")
            out.append((int(lo), int(hi), len(lo) if lo.startswith("0") else 0))
        else:
            if not _DIGITS.fullmatch(part):
                raise ValueError(f"bad index {part!r}")
            out.append((int(part), int(part), len(part) if part.startswith("0") else 0))
    return out


def _parse_item(item: str) -> list[str | list[tuple[int, int, int]]]:
    """An item as literal text pieces and bracketed range lists, in order."""
    pieces: list[str | list[tuple[int, int, int]]] = []
    pos = 0
    for m in _TOKEN.finditer(item):
        pieces.append(item[pos:m.start()])
        pieces.append(_parse_ranges(m.group(1)))
        pos = m.end()
    if "[" in item[pos:] or "]" in item[pos:]:
        raise ValueError("stray bracket")
    pieces.append(item[pos:])
    return pieces


def _count(pieces: list[str | list[tuple[int, int, int]]]) -> int:
    n = 1
    for p in pieces:
        if not isinstance(p, str):
            n *= sum(hi - lo + 1 for lo, hi, _ in p)
    return n


def _expand(pieces: list[str | list[tuple[int, int, int]]]) -> list[str]:
    choices = [[p] if isinstance(p, str) else [str(i).zfill(w) for lo, hi, w in p for i in range(lo, hi + 1)]
               for p in pieces]
    return ["".join(c) for c in itertools.product(*choices)]


def expand_nodelist(text: str, source: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Return host names in the order Slurm lists them (that order defines node ranks)."""
    try:
        items = []
        for item in _split_top_level(text.strip()):
            item = item.strip()
            if not item:
                raise ValueError("empty host name")
            items.append(_parse_item(item))
    except ValueError as exc:
        raise bad_value(f"env {source}", text, f"cannot parse Slurm node list ({exc})",
                        "expected a form like 'gpu[01-04,07],login2'") from None
    total = sum(_count(pieces) for pieces in items)
    if total > MAX_HOSTS:
        shown = text if len(text) <= 200 else text[:200] + "..."
        raise bad_value(f"env {source}", shown, f"names {total} hosts, more than the {MAX_HOSTS} meshrun accepts",
                        "check the variable: a Slurm job's node list has one entry per allocated node")
    hosts: list[str] = []
    for pieces in items:
        hosts.extend(_expand(pieces))
    return hosts
