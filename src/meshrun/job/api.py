"""`meshrun.train(...)`: the `meshrun train` job from Python (a script, a notebook).

The options are the command's, spelled as Python names: every option of the config's
sections (``model_size="gpt-tiny"``, ``steps=2``, ``out="runs/a"``, ...: config/sections.py),
the topology options (``nproc``/``nproc_per_node``, ``nnodes``, ``node_rank``,
``master_addr``, ...), the job options (``max_restarts``, ``overwrite``, ``rdzv_timeout``,
``finish_timeout``, ``dry_run``, ``json``, ``gpu_mem``) and ``config`` (a YAML or TOML file). As on the
command line, a keyword wins over a MESHRUN_<NAME> variable of ``env``, and a variable over the
file. The ranks run in processes of their
own, as under the CLI, which calls the same job/__init__.py. A bad value raises MeshrunError with
the CLI's one-line message; a failed rank raises JobFailed (a MeshrunError) naming it. Under
``dry_run`` nothing starts and nothing is printed: the result's ``dry_run`` (a DryRun) holds the
resolved config, the topology, what the ranks will decide and the processes' command lines;
``print(result.dry_run)`` shows the text of `meshrun train --dry-run`.
"""

from __future__ import annotations

import difflib
import os
import signal
import sys
import threading
from collections.abc import Mapping
from typing import Any

from ..cluster.detect import resolve
from ..cluster.gpus import count_visible_gpus
from ..cluster.net import free_port, ports_released_after
from ..cluster.options import TOPOLOGY_OPTIONS, TopologyOptions, UserTopology, user_topology
from ..config import TrainConfig, config_from, load_file, option_names
from ..config.sections import SECTIONS
from ..errors import PREEMPTED, MeshrunError, bad_value
from ..options import anywhere, env_var, unknown_variables
from . import JOB_OPTIONS, JobOptions, TrainResult, job_options, run

SOURCE = "meshrun.train"  # how a value given here is named in an error
CONFIG_VAR = "MESHRUN_CONFIG"  # --config's variable
ALIASES = {"nproc": "nproc_per_node"}


def job_from(file: str | None, env: Mapping[str, str], given: Mapping[str, Any],
             given_source: str) -> tuple[TrainConfig, JobOptions, UserTopology]:
    """Everything a `meshrun train` job is told, from every source, read the same way for the
    CLI (``given``: its flags) and ``meshrun.train(...)`` (its keywords): the config file <
    MESHRUN_<NAME> < ``given``, each value judged by its option's declaration."""
    others = (*anywhere(JobOptions), *anywhere(TopologyOptions))
    flags_only = tuple(name for name in JOB_OPTIONS if name not in others)
    file_values = load_file(file, others, flags_only) if file else {}
    cfg = config_from(file_values, file, env, given, given_source)
    job = job_options(file_values, file, env, given, given_source)
    return cfg, job, user_topology(given, env, given_source, file_values, file, fixed_nodes="meshrun train")


def variables() -> set[str]:
    """The MESHRUN_<NAME> variables a `meshrun train` job reads, the CLI's and this API's alike."""
    names = (*anywhere(JobOptions), *anywhere(TopologyOptions), *(n for s in SECTIONS for n in anywhere(s)))
    return {env_var(name) for name in names} | {CONFIG_VAR}


def train(config: str | os.PathLike[str] | None = None, env: Mapping[str, str] | None = None,
          **options: Any) -> TrainResult:
    """Run a training job on this node and return its TrainResult (exit code, rank 0's last
    metrics, the newest snapshot; under ``dry_run=True``, the job that would start, in its
    ``dry_run``, with nothing started or printed). ``env``: the environment to read the platform
    from and to start the ranks with (default: this process's)."""
    if threading.current_thread() is not threading.main_thread():
        # the job relays Ctrl-C and preemption signals to its ranks: Python sets handlers in the main thread only
        raise MeshrunError(f"{SOURCE}() was called from thread {threading.current_thread().name!r}: a job relays "
                           "signals to its ranks, which Python allows from the main thread only (hint: call it "
                           "from the main thread, e.g. in a subprocess: multiprocessing, or `meshrun train`)")
    env = dict(os.environ if env is None else env)
    if config is None:  # as `meshrun train` reads it
        config = env.get(CONFIG_VAR, "").strip() or None
    elif isinstance(config, os.PathLike):
        config = os.fspath(config)
    if config is not None and not isinstance(config, str):
        raise bad_value(f"{SOURCE}() option config", config, f"expected the path of a YAML or TOML file, not "
                        f"{type(config).__name__}", "give the options themselves as keywords: "
                        "meshrun.train(**options)")
    for line in unknown_variables(env, variables(), "train"):
        print(line, file=sys.stderr)
    known = (*option_names(), *TOPOLOGY_OPTIONS, *JOB_OPTIONS)
    values: dict[str, Any] = {}
    for name, value in options.items():
        key = ALIASES.get(name, name)
        if key not in known:
            near = difflib.get_close_matches(name, [*known, *ALIASES], n=1)
            raise bad_value(f"{SOURCE}() option", name, "unknown option",
                            f"did you mean {near[0]}?" if near else "the options of `meshrun train --help`, "
                            "with underscores")
        if key in values:
            raise bad_value(f"{SOURCE}() option", name, f"given twice (as {key} too)", "give it once")
        values[key] = value
    cfg, job, user = job_from(config, env, values, SOURCE)
    with ports_released_after():
        topo = resolve(env, count_visible_gpus(env), user.platform, user.overrides, free_port=free_port)
        result = run(cfg, topo, job, env)
    if result.code == 128 + signal.SIGINT:  # Ctrl-C: its line is said; Python's own way on from here
        raise KeyboardInterrupt
    if result.code not in (0, PREEMPTED):  # (preempted: stopped at a step with its snapshot; the same call resumes)
        raise MeshrunError(f"the job ended with exit code {result.code}")
    return result
