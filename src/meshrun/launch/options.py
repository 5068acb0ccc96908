"""The bounds of a launch's waits, declared with ``option()`` (options.py) as every option is:
`meshrun launch`, `meshrun bench` and `meshrun train` read them the same way."""

from __future__ import annotations

from dataclasses import dataclass

from ..cluster.reach import DEFAULT_TIMEOUT_S
from ..defaults import FINISH_TIMEOUT_S
from ..options import option


@dataclass(frozen=True)
class WaitOptions:
    rdzv_timeout: int | None = option(
        None, "multi-node: seconds to wait for the master and the other nodes before a one-line error saying why "
        f"(default {DEFAULT_TIMEOUT_S})", metavar="S", minimum=1, maximum=7 * 24 * 3600)
    finish_timeout: int = option(
        FINISH_TIMEOUT_S, "seconds the other ranks of a node may keep running once one has finished; then the "
        "launcher names them in one line, stops them and exits 1 (default {default})", metavar="S", minimum=1,
        maximum=7 * 24 * 3600)
