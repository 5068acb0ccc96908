"""Errors meant for the user.

Every problem with the user's input ends up as a :class:`MeshrunError`. The CLI prints
``meshrun: error: <message>`` and exits 2; the library lets it propagate. They are plain
exceptions raised by real checks, never ``assert``, so they survive ``python -O``.
"""

from __future__ import annotations

import importlib.util


class MeshrunError(Exception):
    """A problem with what the user asked for; its message is one self-contained line."""

    exit_code = 2


class JobFailed(MeshrunError):
    """A job that ran and failed (a rank raised, or died of a signal): not the user's input, so
    exit code 1; the message is still one line (the rank, the cause, its log, a hint)."""

    exit_code = 1


def bad_value(name: str, value: object, problem: str, hint: str = "") -> MeshrunError:
    """Build the standard message: which setting, its value, what is wrong, what to do.

    ``name`` names where the value came from (``--nnodes``, ``env SLURM_NODEID``) so the
    user knows which knob to turn. A value of None is one the user did not give: the line
    says so instead of printing ``None``.
    """
    msg = f"{name} is not given: {problem}" if value is None else f"{name}={shown(value)}: {problem}"
    if hint:
        msg += f" (hint: {hint})"
    return MeshrunError(msg)


SHOWN_CHARS = 200  # of a value in an error line: a pasted file or a YAML bomb stays one short line


def shown(value: object) -> str:
    """The value's repr, cut to SHOWN_CHARS with "…"; a container's repr is bounded as it is
    built (reprlib), so a huge or self-repeating structure costs no time."""
    import reprlib

    if isinstance(value, str):
        text = repr(value[:SHOWN_CHARS + 1])
    else:
        limits = reprlib.Repr()
        limits.maxstring = limits.maxother = limits.maxlong = SHOWN_CHARS
        limits.maxlist = limits.maxtuple = limits.maxdict = limits.maxset = 12
        try:
            text = limits.repr(value)
        except ValueError:  # an int past Python's 4300-digit conversion limit
            text = f"<an integer of {value.bit_length() if isinstance(value, int) else '?'} bits>"
    return text if len(text) <= SHOWN_CHARS else text[:SHOWN_CHARS] + "…"



CLOSERS = {"(": ")", "[": "]", "{": "}"}


def first_line(text: str, limit: int = 300) -> str:
    """The first non-blank line of another library's message, for one of meshrun's lines: at most
    ``limit`` characters, a longer one cut after a whole word and before any quote or bracket it
    would leave open (a host name is shown whole or not at all), marked with "…"."""
    line = next((ln.strip() for ln in text.splitlines() if ln.strip()), "")
    if len(line) <= limit:
        return line
    cut = line[:limit]
    if not line[limit].isspace() and " " in cut:  # a word the limit splits goes whole
        cut = cut[:cut.rindex(" ")]
    opened: list[int] = []
    quote: tuple[str, int] | None = None
    for i, ch in enumerate(cut):
        if quote is not None:
            if ch == quote[0]:
                quote = None
        elif ch in "'\"" and (i == 0 or not cut[i - 1].isalnum()):  # (the ' of "don't" opens nothing)
            quote = (ch, i)
        elif ch in CLOSERS:
            opened.append(i)
        elif ch in CLOSERS.values() and opened and CLOSERS[cut[opened[-1]]] == ch:
            opened.pop()
    starts = opened + ([quote[1]] if quote else [])
    if starts and min(starts) > 0:
        cut = cut[:min(starts)]
    return cut.rstrip(" ,:;=") + " …"

# The exit code of a `meshrun train` run stopped by a preemption signal after writing its
# snapshot: EX_TEMPFAIL of sysexits.h ("try again later"). Running the same command again
# resumes; a job script requeues on it, and `--max-restarts` does not count it as a crash.
PREEMPTED = 75
# The exit code of a process ended by Ctrl-C: 128 + SIGINT, as a shell reports it.
INTERRUPTED = 130
# The exit codes of a rank that did not fail: done, stopped at a step by a preemption signal
# after its snapshot (its peers stop at the same step), ended by Ctrl-C.
RANK_STOPPED = (0, PREEMPTED, INTERRUPTED)


def require_packages(command: str, modules: tuple[str, ...], extra: str) -> None:
    """A one-line error naming what to install when a command's packages are missing."""
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        raise MeshrunError(f"meshrun {command} needs {', '.join(missing)}, not installed here "
                           f"(hint: pip install 'meshrun[{extra}]')")
