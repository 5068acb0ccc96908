"""Errors meant for the user.

Every problem with the user's input ends up as a :class:`MeshrunError`. The CLI prints
``meshrun: error: <message>`` and exits 2; the library lets it propagate. They are plain
exceptions raised by real checks, never ``assert``, so they survive ``python -O``.
"""

from __future__ import annotations


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
    user knows which knob to turn.
    """
    msg = f"{name}={value!r}: {problem}"
    if hint:
        msg += f" (hint: {hint})"
    return MeshrunError(msg)


# The exit code of a `meshrun train` run stopped by a preemption signal after writing its
# snapshot: EX_TEMPFAIL of sysexits.h ("try again later"). Running the same command again
# resumes; a job script requeues on it, and `--max-restarts` does not count it as a crash.
PREEMPTED = 75
