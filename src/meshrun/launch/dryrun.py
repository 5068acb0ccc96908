"""What `--dry-run` prints: the command each process would run, with the variables meshrun
sets for it, as shell lines or one JSON object; and what the caller adds (`meshrun train`: its
decisions), as comment lines before the commands or keys of the JSON object."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from ..errors import MeshrunError
from .command import Command


class _Process(TypedDict):
    argv: list[str]
    env: dict[str, str]


def dry_run_text(cmd: Command, as_json: bool, extra: Mapping[str, Any] | None = None,
                 lines: Sequence[str] = ()) -> str:
    """The processes of ``cmd`` as shell lines (``lines`` first, as comments), or one JSON
    object that also holds ``extra``'s keys."""
    from .spawn import resolve_program

    def exact(argv: tuple[str, ...]) -> list[str]:
        # Show the program meshrun would really start; fall back to its name if missing.
        try:
            return [resolve_program(argv[0]), *argv[1:]]
        except MeshrunError:
            return list(argv)

    procs: list[_Process] = [{"argv": exact(p.argv), "env": cmd.env_of(i)} for i, p in enumerate(cmd.processes)]
    if as_json:
        out = {"argv": procs[0]["argv"] if procs else [], "env": procs[0]["env"] if procs else dict(cmd.env),
               "processes": procs, "files": dict(cmd.files), "note": cmd.note, **(extra or {})}
        return json.dumps(out, indent=2)
    text = [f"# {line}" for line in lines]
    if cmd.note:
        text.append(f"# {cmd.note}")
    for path, body in cmd.files.items():
        text.append(f"# file {path}:")
        text += [f"#   {line}" for line in body.splitlines()]
    for p in procs:
        assigns = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(p["env"].items()))
        text.append(f"{assigns} {shlex.join(p['argv'])}".strip())
    return "\n".join(text)
