"""Expand Slurm's compressed host lists (``gpu[01-04,07],login2``) without calling scontrol.

Slurm's grammar: comma-separated items at the top level; an item is a prefix followed by
optional bracketed range lists, possibly several (``rack[1-2]-node[01-02]``), and a suffix.
Zero padding in a range is kept (``[08-10]`` -> 08, 09, 10).
"""

from __future__ import annotations

import itertools
import re

from ..errors import bad_value

_TOKEN = re.compile(r"\[([^\[\]]*)\]")


def _split_top_level(text: str) -> list[str]:
    items, depth, cur = [], 0, []
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


def _expand_ranges(spec: str) -> list[str]:
    out: list[str] = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise ValueError("empty range")
        if "-" in part:
            lo, hi = part.split("-", 1)
            if not (lo.isdigit() and hi.isdigit()):
                raise ValueError(f"bad range {part!r}")
            if int(hi) < int(lo):
                raise ValueError(f"descending range {part!r}")
            width = len(lo) if lo.startswith("0") else 0
            out.extend(str(i).zfill(width) for i in range(int(lo), int(hi) + 1))
        else:
            if not part.isdigit():
                raise ValueError(f"bad index {part!r}")
            out.append(part)
    return out


def _expand_item(item: str) -> list[str]:
    pieces: list[list[str]] = []
    pos = 0
    for m in _TOKEN.finditer(item):
        pieces.append([item[pos:m.start()]])
        pieces.append(_expand_ranges(m.group(1)))
        pos = m.end()
    pieces.append([item[pos:]])
    if "[" in item[pos:] or "]" in item[pos:]:
        raise ValueError("stray bracket")
    return ["".join(p) for p in itertools.product(*pieces)]


def expand_nodelist(text: str, source: str = "SLURM_JOB_NODELIST") -> list[str]:
    """Return host names in the order Slurm lists them (that order defines node ranks)."""
    hosts: list[str] = []
    try:
        for item in _split_top_level(text.strip()):
            if not item:
                raise ValueError("empty host name")
            hosts.extend(_expand_item(item))
    except ValueError as exc:
        raise bad_value(f"env {source}", text, f"cannot parse Slurm node list ({exc})",
                        "expected a form like 'gpu[01-04,07],login2'") from None
    return hosts
