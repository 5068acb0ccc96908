"""Variables that tune a run without being one of its options, read by the ranks and checked
by the job before any rank starts: a bad value is one line then, not a failure inside a rank at
its first snapshot."""

from __future__ import annotations

from collections.abc import Mapping

from ..errors import bad_value

SAVE_THREADS = "MESHRUN_SAVE_THREADS"  # writer and hasher threads per rank (snapshot/layout.py: io_threads)
MAX_SAVE_THREADS = 64  # one file per thread: past the cores of any one host, more only adds files


def save_threads(env: Mapping[str, str]) -> int | None:
    """MESHRUN_SAVE_THREADS as a number of threads, None when unset or empty."""
    text = env.get(SAVE_THREADS, "").strip()
    if not text:
        return None
    try:
        n = int(text)
    except ValueError:
        raise bad_value(f"env {SAVE_THREADS}", text, "expected a whole number of threads",
                        f"1 to {MAX_SAVE_THREADS}, or unset it for meshrun's choice") from None
    if not 1 <= n <= MAX_SAVE_THREADS:
        raise bad_value(f"env {SAVE_THREADS}", text, f"must be between 1 and {MAX_SAVE_THREADS}",
                        "or unset it for meshrun's choice")
    return n
