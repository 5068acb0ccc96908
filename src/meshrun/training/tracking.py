"""The experiment trackers of one run, on the rank that holds the loss: TensorBoard events in
OUT, a Weights & Biases run, an MLflow run. Each is one small class with the same calls:
start (the run's resolved config as its parameters), ``log`` (a record's numbers at its
step), ``close``, and ``closing`` (what the run's closing line says of it: the run's id, and
for W&B offline the `wandb sync` command that uploads it).

A resume continues the same tracker run: each tracker's run id is kept in ``OUT/trackers.json``
(written when the run starts), and the user's own ``WANDB_RUN_ID`` / ``MLFLOW_RUN_ID`` win
over it. Without an id of its own, the W&B run takes meshrun's run id (``OUT/run.json``),
so a Slurm requeue that lost nothing else still lands in the same run.

A tracker that fails to start ends the run with one line before step 1 (config/trackers.py has
already checked the packages and servers); one that fails later is dropped with one line,
and the run goes on: metrics.jsonl keeps every record.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import sys
import time
import types
from collections.abc import Mapping
from typing import Any, Protocol

from ..config.outdir import RUN_ID_ENV
from ..config.trackers import DELETE_IDS, IDS_FILE, saved_ids
from ..errors import MeshrunError, first_line

PROJECT = "meshrun"  # W&B project and MLflow experiment when WANDB_PROJECT / MLFLOW_EXPERIMENT_NAME are unset
PARAM_CHARS = 6000  # MLflow's longest parameter value


class Tracker(Protocol):
    name: str

    def log(self, metrics: Mapping[str, float], step: int) -> None: ...

    def close(self, finished: bool) -> None: ...

    def closing(self) -> str | None:
        """What the run's closing line says of this tracker's run (None: nothing)."""


def numbers(record: Mapping[str, Any]) -> dict[str, float]:
    """What a tracker logs of a record: its numeric values but the step (None: not measured here)."""
    return {k: float(v) for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}


class TensorBoard:
    name = "tensorboard"

    def __init__(self, out: str, params: Mapping[str, Any], done: int = 0) -> None:
        """``done``: the step the run resumes from; the events an interrupted start logged after
        it are hidden (SummaryWriter's purge_step), as metrics.jsonl drops its records."""
        # torch's SummaryWriter asks tensorboard for its TF-like API on import; where
        # TensorFlow is installed, tensorboard imports it (seconds of CPU per run:
        # docs/decisions.md#tensorboard), for local event files its own stub writes alike.
        # tensorboard takes the stub when a module tensorboard.compat.notf exists: that
        # switch is set here unless TensorFlow is already loaded in this process.
        if "tensorflow" not in sys.modules:
            sys.modules.setdefault("tensorboard.compat.notf", types.ModuleType("tensorboard.compat.notf"))
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(os.path.join(out, "tensorboard"), purge_step=done + 1)
        self.writer.add_text("config", "\n".join(f"    {k}: {v}" for k, v in params.items()))

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)

    def close(self, finished: bool) -> None:
        self.writer.close()

    def closing(self) -> str | None:
        return None  # (the closing line names OUT/tensorboard among the files)


class Wandb:
    """A W&B run: project WANDB_PROJECT (else "meshrun"), entity WANDB_ENTITY, its files in
    WANDB_DIR (else OUT), resumed by id. Charts plot against the ``step`` metric, so steps
    logged again after a resume from an earlier snapshot are kept, not refused as out of order."""

    name = "wandb"

    def __init__(self, out: str | None, run_id: str | None, params: Mapping[str, Any], env: Mapping[str, str]) -> None:
        import wandb

        self.wandb = wandb
        kept = saved(out).get(self.name, {})
        project = env.get("WANDB_PROJECT") or PROJECT
        run_id = env.get("WANDB_RUN_ID") or (kept.get("id") if kept.get("project") == project else None) or run_id
        self.run = wandb.init(project=project, entity=env.get("WANDB_ENTITY") or None, id=run_id, resume="allow",
                              name=os.path.basename(os.path.normpath(out)) if out else None,
                              dir=env.get("WANDB_DIR") or out, config=dict(params), allow_val_change=True,
                              # meshrun's own lines go to stdout and the rank logs as they are
                              settings=wandb.Settings(console="off", silent=True))
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.ids = {"id": self.run.id, "project": project}
        # offline: the directory this start writes, which `wandb sync` uploads
        self.offline_dir = getattr(self.run.settings, "sync_dir", None) if self.run.offline else None

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        self.run.log({"step": step, **metrics})

    def close(self, finished: bool) -> None:
        self.run.finish(exit_code=0 if finished else 1)

    def closing(self) -> str | None:
        return f"wandb run {self.run.id}" + (f" ({sync_command(self.offline_dir, self.run.id)})"
                                             if self.offline_dir else "")


class Mlflow:
    """An MLflow run in MLFLOW_TRACKING_URI's store, in experiment MLFLOW_EXPERIMENT_NAME (else
    "meshrun"); a resumed run is set running again and gets only the parameters it lacks
    (MLflow refuses to change one: a resume with a larger --steps keeps the first value)."""

    name = "mlflow"

    def __init__(self, out: str | None, run_id: str | None, params: Mapping[str, Any], env: Mapping[str, str]) -> None:
        # A tracking server that stops answering mid-run holds the training loop through each
        # retry: fewer and shorter ones than MLflow's own (7, up to 120 s each), unless set
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "2")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "20")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self.Metric = Metric
        self.client = MlflowClient()
        uri = self.client.tracking_uri
        kept = saved(out).get(self.name, {})
        resume = env.get("MLFLOW_RUN_ID") or (kept.get("run_id") if kept.get("tracking_uri") == uri else None)
        if resume:
            try:
                run = self.client.get_run(resume)
            except Exception as e:  # (MLflow's errors: a store wiped or moved since)
                where = "MLFLOW_RUN_ID" if env.get("MLFLOW_RUN_ID") else f"{os.path.join(out or '', IDS_FILE)}"
                raise MeshrunError(f"--log-with mlflow: the run {resume} that {where} continues is not in the store "
                                   f"{uri} ({_first_line(e)}) (hint: "
                                   + ("unset MLFLOW_RUN_ID" if env.get("MLFLOW_RUN_ID") else f"{where}: {DELETE_IDS}")
                                   + ")") from None
            self.client.update_run(resume, status="RUNNING")
        else:
            experiment = env.get("MLFLOW_EXPERIMENT_NAME") or PROJECT
            found = self.client.get_experiment_by_name(experiment)
            experiment_id = found.experiment_id if found else self.client.create_experiment(experiment)
            run = self.client.create_run(experiment_id, run_name=os.path.basename(os.path.normpath(out)) if out
                                         else None, tags={"meshrun.run_id": run_id} if run_id else None)
        self.run_id = run.info.run_id
        have = run.data.params
        self.client.log_batch(self.run_id, params=[Param(k, str(v)[:PARAM_CHARS]) for k, v in params.items()
                                                   if k not in have])
        self.ids = {"run_id": self.run_id, "tracking_uri": uri}

    def log(self, metrics: Mapping[str, float], step: int) -> None:
        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[self.Metric(k, v, now, step) for k, v in metrics.items()])

    def close(self, finished: bool) -> None:
        self.client.set_terminated(self.run_id, "FINISHED" if finished else "FAILED")

    def closing(self) -> str | None:
        return f"mlflow run {self.run_id}"


def sync_command(offline_dir: str, run_id: str) -> str:
    """How to upload an offline W&B run: `wandb sync` of its directory, or, where earlier
    starts of the same run (a resume) left theirs beside it, of all of them by a pattern."""
    parent = os.path.dirname(os.path.normpath(offline_dir))
    starts = glob.glob(os.path.join(glob.escape(parent), f"offline-run-*-{glob.escape(run_id)}"))
    if len(starts) > 1:
        return f"offline: wandb sync {shlex.quote(parent)}/offline-run-*-{shlex.quote(run_id)}"
    return f"offline: wandb sync {shlex.quote(offline_dir)}"


def saved(out: str | None) -> dict[str, dict[str, str]]:
    """OUT/trackers.json's ids, or {} (no OUT, no file); a damaged file is refused
    (config/trackers.py: saved_ids, which the job checked before the ranks started)."""
    return saved_ids(out)


def _keep(out: str, ids: dict[str, dict[str, str]]) -> None:
    """OUT/trackers.json, whole or not at all."""
    tmp = os.path.join(out, f".{IDS_FILE}.tmp")
    with open(tmp, "w") as f:
        json.dump(ids, f, indent=1)
    os.replace(tmp, os.path.join(out, IDS_FILE))


def start(names: tuple[str, ...], out: str | None, params: Mapping[str, Any],
          env: Mapping[str, str] | None = None, done: int = 0) -> list[Tracker]:
    """Start the named trackers (in that order) and keep their run ids in OUT; one that cannot
    start is a MeshrunError naming it and why. ``done``: the step the run resumes from."""
    env = os.environ if env is None else env
    run_id = env.get(RUN_ID_ENV)
    started: list[Tracker] = []
    ids: dict[str, dict[str, str]] = {}
    for name in names:
        try:
            if name == "tensorboard":
                if out:
                    started.append(TensorBoard(out, params, done))
                continue
            tracker: Wandb | Mlflow = (Wandb if name == "wandb" else Mlflow)(out, run_id, params, env)
        except MeshrunError:  # its own line, which says what to do
            for t in started:
                t.close(finished=False)
            raise
        except Exception as e:  # each package has its own errors; any of them means this tracker is unusable
            for t in started:
                t.close(finished=False)
            raise MeshrunError(f"--log-with {name}: could not start its run: {_first_line(e)} (hint: check the "
                               f"{name.upper()}_* variables, or drop {name} from --log-with)") from None
        started.append(tracker)
        ids[name] = tracker.ids
    if out and ids:
        _keep(out, {**saved(out), **ids})
    return started


def log(trackers: list[Tracker], record: Mapping[str, Any]) -> None:
    """Log a record to each tracker; one that fails is dropped with one line (the rest go on)."""
    metrics = numbers(record)
    for tracker in list(trackers):
        try:
            tracker.log(metrics, record["step"])
        except Exception as e:  # a tracker's failure must not end the training it records
            trackers.remove(tracker)
            print(f"meshrun train: {tracker.name} stopped logging at step {record['step']}: {_first_line(e)}; "
                  "metrics.jsonl keeps every record", file=sys.stderr, flush=True)


def close(trackers: list[Tracker], finished: bool) -> None:
    for tracker in trackers:
        try:
            tracker.close(finished)
        except Exception as e:  # (as in log: the run's own outputs are already written)
            print(f"meshrun train: {tracker.name} did not close cleanly: {_first_line(e)}", file=sys.stderr,
                  flush=True)
    trackers.clear()


def _first_line(e: BaseException) -> str:
    return first_line(str(e)) or type(e).__name__
