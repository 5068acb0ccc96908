"""What `--dry-run` prints: the command each process would run, with the variables meshrun
sets for it, as shell text or one JSON object; and what the caller adds (`meshrun train`: its
decisions), as comment lines before the commands or keys of the JSON object.

The text is a shell rendition of what this node starts, wrapped to lines of at most WIDTH
columns: one process is one command; several are started together in a subshell (``( ... &
wait )``) that exports the variables they share once, so a 1.5 KB training config is not
repeated per process. A variable's value that is a JSON object is laid out over lines of its
own, the same JSON with line breaks between its members. The text stays a shell command: pasted
into bash it starts the same processes with the same variables (the subshell keeps them out of
the user's shell)."""

from __future__ import annotations

import json
import shlex
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from ..errors import MeshrunError
from .command import Command

WIDTH = 100  # the text's lines are at most this long, but for a word (a path, a JSON member) longer than that
INDENT = "  "  # a continued line's, and a command's inside the subshell


class ProcessPlan(TypedDict):
    """One process this node would start: its argv (the program as found on PATH) and the
    variables meshrun sets for it (on top of the environment it runs in)."""

    argv: list[str]
    env: dict[str, str]


def processes(cmd: Command) -> list[ProcessPlan]:
    """The processes of ``cmd``, each with the program meshrun would really start (its name
    when it is not found)."""
    from .spawn import resolve_program

    def exact(argv: tuple[str, ...]) -> list[str]:
        try:
            return [resolve_program(argv[0]), *argv[1:]]
        except MeshrunError:
            return list(argv)

    return [{"argv": exact(p.argv), "env": cmd.env_of(i)} for i, p in enumerate(cmd.processes)]


def dry_run_dict(cmd: Command, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The JSON object of ``--dry-run --json``: the first process's argv and env (the only
    one's, for a launcher), every process, the files written first, the note, and ``extra``."""
    procs = processes(cmd)
    return {"argv": procs[0]["argv"] if procs else [], "env": procs[0]["env"] if procs else dict(cmd.env),
            "processes": procs, "files": dict(cmd.files), "note": cmd.note, **(extra or {})}


def dry_run_lines(cmd: Command, lines: Sequence[str] = ()) -> list[str]:
    """The text of ``--dry-run``: ``lines`` and the note as comments, the files written first,
    then the processes as shell text."""
    text = [f"# {line}" for line in lines]
    if cmd.note:
        text.append(f"# {cmd.note}")
    for path, body in cmd.files.items():
        text.append(f"# file {path}:")
        text += [f"#   {line}" for line in body.splitlines()]
    return text + shell_lines(processes(cmd))


def dry_run_text(cmd: Command, as_json: bool, extra: Mapping[str, Any] | None = None,
                 lines: Sequence[str] = ()) -> str:
    """The processes of ``cmd`` as text (``lines`` first, as comments), or one JSON object that
    also holds ``extra``'s keys."""
    if as_json:
        return json.dumps(dry_run_dict(cmd, extra), indent=2)
    return "\n".join(dry_run_lines(cmd, lines))


def shell_lines(procs: Sequence[ProcessPlan], width: int = WIDTH) -> list[str]:
    """``procs`` as shell text: one command, or a subshell that exports what all share and
    starts each in the background, then waits for them."""
    if len(procs) <= 1:
        return [command(p["env"], p["argv"], width) for p in procs]
    first = procs[0]["env"]
    shared = {k: v for k, v in first.items() if all(p["env"].get(k) == v for p in procs[1:])}
    out = [f"# the {len(procs)} processes, started together:", "("]
    if shared:
        out.append(_indented(_wrap(["export", *_assignments(shared, width)], width - len(INDENT))))
    for p in procs:
        own = {k: v for k, v in p["env"].items() if k not in shared}
        out.append(_indented(command(own, p["argv"], width - len(INDENT)) + " &"))
    return [*out, f"{INDENT}wait", ")"]


def command(env: Mapping[str, str], argv: Sequence[str], width: int = WIDTH) -> str:
    """One process as a shell command: its variables, then its argv on a line of its own when
    the whole does not fit on one."""
    words = _assignments(env, width)
    program = [shlex.quote(word) for word in argv]
    one = _wrap([*words, *program], width)
    if "\n" not in one or not words:
        return one
    return _wrap(words, width) + " \\\n" + INDENT + _wrap(program, width - len(INDENT)).replace("\n", "\n" + INDENT)


def _assignments(env: Mapping[str, str], width: int) -> list[str]:
    return [f"{k}={shlex.quote(_laid_out(v, width))}" for k, v in sorted(env.items())]


def _laid_out(value: str, width: int) -> str:
    """A JSON object too long for a line, laid out over lines of at most ``width`` columns (the
    same JSON); any other value as it is."""
    if len(value) <= width // 2 or not value.startswith("{"):
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return _json_lines(parsed, width, 2 * INDENT) if isinstance(parsed, dict) else value


def _json_lines(obj: Mapping[str, Any], width: int, indent: str) -> str:
    """``obj`` as JSON, its members packed on lines after ``indent``; a member too long for a
    line whose value is an object is laid out the same way, a level in. The room left on a line
    counts what follows it (the subshell's indent, a closing quote and backslash) and each single
    quote as the five characters it becomes, shell-quoted."""
    room = width - len(indent) - 6
    lines: list[tuple[str, int]] = []  # (text, columns once shell-quoted)
    for key, value in obj.items():
        member = f"{json.dumps(key)}: {json.dumps(value)}"
        size = len(member) + 4 * member.count("'")
        if size > room and isinstance(value, dict) and value:
            lines.append((f"{json.dumps(key)}: " + _json_lines(value, width, indent + 2 * INDENT), 0))
            lines.append(("", 0))  # (nothing joins the line a nested object ends)
        elif lines and lines[-1][0] and lines[-1][1] + 2 + size <= room:
            text, used = lines[-1]
            lines[-1] = (f"{text}, {member}", used + 2 + size)
        else:
            lines.append((member, size))
    return "{\n" + indent + (",\n" + indent).join(text for text, _ in lines if text) + "}"


def _wrap(words: Sequence[str], width: int) -> str:
    """``words`` joined by spaces, a line continued with a backslash where the next word would
    pass ``width`` columns (a word of several lines continues after its last)."""
    text = ""
    for word in words:
        current = len(text) - (text.rfind("\n") + 1)  # the last line's length
        first = len(word.split("\n", 1)[0])
        if text and current + 1 + first + 2 > width:
            text += " \\\n" + INDENT + word
        else:
            text += (" " if text else "") + word
    return text


def _indented(text: str) -> str:
    """``text`` a level in (inside a JSON value too: its line breaks are between members, where
    spaces change nothing)."""
    return "\n".join(INDENT + line for line in text.split("\n"))
