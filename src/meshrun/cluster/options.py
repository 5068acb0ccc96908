"""User-given topology values, from flags or MESHRUN_<NAME> variables, parsed and checked."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from ..errors import bad_value
from .detect import Overrides

ENV_PREFIX = "MESHRUN_"
# MESHRUN_* variables that are not options: set by meshrun for its workers, or read by its
# internals and tests. A variable of this prefix that is neither one of these nor an option
# of the command being run is warned about (cli/options.py: warn_unknown_env).
INTERNAL_VARIABLES = (
    "MESHRUN_TRAIN_CONFIG", "MESHRUN_ERROR_FILE", "MESHRUN_PREEMPT_FILE", "MESHRUN_CACHE",
    "MESHRUN_SAVE_THREADS",
    "MESHRUN_BENCH_OUT", "MESHRUN_LOCAL_RANK", "MESHRUN_PROCESS_ID", "MESHRUN_NUM_PROCESSES",
    "MESHRUN_TEST_STRICT", "MESHRUN_SKYPILOT_PYTHON", "MESHRUN_JOB_TOKEN", "MESHRUN_OUT_RUN_ID",
    "MESHRUN_CRASH_FILE", "MESHRUN_READY_FILE", "MESHRUN_INTERRUPT_FILE", "MESHRUN_RESULT_FILE",
    "MESHRUN_PLATFORMS",  # the user's platforms, read by detection itself (userplatforms.py)
)
TOPOLOGY_OPTIONS = ("platform", "nnodes", "node_rank", "nproc_per_node", "master_addr",
                    "master_port", "hosts", "run_id")


@dataclass(frozen=True)
class UserTopology:
    platform: str | None
    overrides: Overrides
    elastic: tuple[int, int] | None  # torchrun's MIN:MAX node range, when given


def parse_int(raw: str, source: str, minimum: int = 0) -> int:
    try:
        value = int(raw)
    except ValueError:
        raise bad_value(source, raw, "not an integer", "give a whole number") from None
    if value < minimum:
        raise bad_value(source, raw, f"must be >= {minimum}")
    return value


def collect(flags: Mapping[str, object], env: Mapping[str, str]) -> dict[str, tuple[str, str]]:
    """(raw value, source) per option: the flag first, then its MESHRUN_<NAME> variable."""
    found = {}
    for name in TOPOLOGY_OPTIONS:
        raw = flags.get(name)
        if raw is not None:
            found[name] = (str(raw), f"flag --{name.replace('_', '-')}")
            continue
        var = ENV_PREFIX + name.upper()
        if env.get(var, "").strip() != "":
            found[name] = (env[var].strip(), f"env {var}")
    return found


def user_topology(flags: Mapping[str, object], env: Mapping[str, str]) -> UserTopology:
    vals = collect(flags, env)
    ov: dict[str, object] = {}
    elastic = None
    if "nnodes" in vals:
        raw, src = vals["nnodes"]
        if ":" in raw:
            lo_s, _, hi_s = raw.partition(":")
            lo, hi = parse_int(lo_s, src, 1), parse_int(hi_s, src, 1)
            if lo > hi:
                raise bad_value(src, raw, "MIN is larger than MAX", "write MIN:MAX, e.g. 1:4")
            elastic, ov["nnodes"] = (lo, hi), hi
        else:
            ov["nnodes"] = parse_int(raw, src, 1)
    for name, minimum in (("node_rank", 0), ("nproc_per_node", 1), ("master_port", 1)):
        if name in vals:
            ov[name] = parse_int(vals[name][0], vals[name][1], minimum)
    for name in ("master_addr", "run_id"):
        if name in vals:
            ov[name] = vals[name][0]
    if "hosts" in vals:
        ov["hosts"] = tuple(h.strip() for h in vals["hosts"][0].split(",") if h.strip())
    sources = {k: src for k, (_, src) in vals.items() if k != "platform"}
    platform = vals["platform"][0] if "platform" in vals else None
    return UserTopology(platform, Overrides(sources=sources, **ov), elastic)  # type: ignore[arg-type]
