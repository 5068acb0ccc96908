"""`meshrun.train(...)`: the `meshrun train` job from Python (a script, a notebook).

The options are the command's, spelled as Python names: every option of the config's
sections (``model_size="gpt-tiny"``, ``steps=2``, ``out="runs/a"``, ...: train/sections.py),
the topology options (``nproc``/``nproc_per_node``, ``nnodes``, ``node_rank``,
``master_addr``, ...), the job options (``max_restarts``, ``overwrite``, ``rdzv_timeout``,
``finish_timeout``, ``dry_run``, ``json``) and ``config`` (a YAML or TOML file). As on the
command line, a keyword wins over a MESHRUN_<NAME> variable of ``env``, and a variable over the
file. The ranks run in processes of their
own, as under the CLI, which calls the same train/job.py. A bad value raises MeshrunError with
the CLI's one-line message; a failed rank raises JobFailed (a MeshrunError) naming it.
"""

from __future__ import annotations

import difflib
import os
import signal
from collections.abc import Mapping
from dataclasses import fields
from typing import Any

from ..cluster.detect import resolve
from ..cluster.gpus import count_visible_gpus
from ..cluster.net import free_port
from ..cluster.options import TOPOLOGY_OPTIONS, user_topology
from ..errors import PREEMPTED, MeshrunError, bad_value
from .config import config_from, option_names
from .job import JobOptions, TrainResult, run

SOURCE = "meshrun.train"  # how a value given here is named in an error
ALIASES = {"nproc": "nproc_per_node"}
JOB_OPTIONS = tuple(f.name for f in fields(JobOptions) if f.name != "sources")


def train(config: str | None = None, env: Mapping[str, str] | None = None, **options: Any) -> TrainResult:
    """Run a training job on this node and return its TrainResult (exit code, rank 0's last
    metrics, the newest snapshot). ``env``: the environment to read the platform from and to
    start the ranks with (default: this process's)."""
    env = dict(os.environ if env is None else env)
    train_keys = option_names()
    values: dict[str, Any] = {}
    for name, value in options.items():
        key = ALIASES.get(name, name)
        if key not in (*train_keys, *TOPOLOGY_OPTIONS, *JOB_OPTIONS):
            near = difflib.get_close_matches(name, [*train_keys, *TOPOLOGY_OPTIONS, *JOB_OPTIONS, *ALIASES], n=1)
            raise bad_value(f"{SOURCE}() option", name, "unknown option",
                            f"did you mean {near[0]}?" if near else "the options of `meshrun train --help`, "
                            "with underscores")
        if key in values:
            raise bad_value(f"{SOURCE}() option", name, f"given twice (as {key} too)", "give it once")
        values[key] = value
    cfg = config_from(config, env, {k: v for k, v in values.items() if k in train_keys}, SOURCE)
    user = user_topology({k: v for k, v in values.items() if k in TOPOLOGY_OPTIONS}, env)
    if user.elastic is not None:
        raise bad_value(f"{SOURCE} nnodes", values.get("nnodes"), "meshrun train takes a fixed node count",
                        "give N, not MIN:MAX")
    topo = resolve(env, count_visible_gpus(env), user.platform, user.overrides, free_port=free_port)
    job_values = {k: v for k, v in values.items() if k in JOB_OPTIONS}
    for name, value in job_values.items():
        want = bool if name in ("overwrite", "dry_run", "json") else int
        if value is not None and (not isinstance(value, want) or (want is int and isinstance(value, bool))):
            raise bad_value(f"{SOURCE} {name}", value, f"expected {want.__name__}")
    if job_values.get("finish_timeout") is not None and job_values["finish_timeout"] < 1:
        raise bad_value(f"{SOURCE} finish_timeout", job_values["finish_timeout"], "must be >= 1")
    job = JobOptions(**job_values, sources={k: f"{SOURCE} {k}" for k in job_values})
    result = run(cfg, topo, job, env)
    if result.code == 128 + signal.SIGINT:  # Ctrl-C: its line is said; Python's own way on from here
        raise KeyboardInterrupt
    if result.code not in (0, PREEMPTED):  # (preempted: stopped at a step with its snapshot; the same call resumes)
        raise MeshrunError(f"the job ended with exit code {result.code}")
    return result
