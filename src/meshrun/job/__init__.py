"""One `meshrun train` job, from a validated TrainConfig to its result, for the CLI and for
`meshrun.train(...)` alike: the checks made once before any rank starts (the batch
arithmetic, a user's factories importable, a Hugging Face model buildable, the corpus
tokenized and its ids in range), the output directory's lock and history, the launch with its
restarts, and what the run leaves: rank 0's last metrics and the newest snapshot.

Torch-free: the ranks import torch, this process does not. The package is what runs in the
`meshrun train` process: this module, the Python API (api.py), the checks that need the model's
or the data's facts (prelaunch.py) and the dry run's preview of the ranks' decisions
(preview.py). It starts the ranks (meshrun.training.worker) by name.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..cluster.detect import processes_fit
from ..cluster.gpus import count_visible_cpus, count_visible_gpus
from ..cluster.topology import Topology
from ..config import TrainConfig, trackers
from ..config.variables import save_threads
from ..errors import JobFailed, MeshrunError, bad_value, require_packages
from ..launch import direct
from ..launch.build import build
from ..launch.command import Command, LaunchSpec
from ..launch.node import check_ports, rdzv_timeout_s
from ..launch.options import WaitOptions
from ..launch.restart import attempt_topology, run_with_restarts
from ..launch.run import Waits
from ..launch.rundir import RunDir
from ..launch.torchrun import thread_env
from ..options import check_all, option, option_fields, read, where
from ..units import parse_bytes
from . import prelaunch
from .dryrun import DryRun

TRAINER_PACKAGES = ("torch", "numpy", "safetensors")
WORKER = "meshrun.training.worker"  # the module each rank runs


@dataclass(frozen=True)
class JobOptions(WaitOptions):
    """How the job runs, beside what it trains (TrainConfig) and where (Topology); declared as
    the training options are (options.py)."""

    max_restarts: int = option(0, "after a crash, start the job again (a fresh rendezvous) up to N times; it "
                               "resumes (a preempted job, exit 75, is not restarted)", metavar="N", minimum=0,
                               maximum=1000)
    # a flag or a keyword only: a variable or a config file a requeued job starts with again would set the
    # progress so far aside at each start
    overwrite: bool = option(False, "start a new run in OUT, first moving the earlier run's checkpoints/, "
                             "metrics.jsonl, loss.png, tensorboard/ and run.json into OUT/previous-<UTC time>/ "
                             "(nothing is deleted; implies --no-resume). Not for job scripts that requeue: each start "
                             "would set aside the progress so far", everywhere=False)
    dry_run: bool = option(False, "print the launch command and what the ranks will decide (strategy, batch sizes, "
                           "compile, kernels, precision); run nothing")
    json: bool = option(False, "with --dry-run: one JSON object")
    # a flag or a keyword only: MESHRUN_GPU_MEM, which meshrun plan reads, would refuse every run that is not dry
    gpu_mem: str | None = option(None, "with --dry-run: decide for GPUs of this memory (e.g. 80GiB), one per "
                                 "process (default: this machine's GPUs; on a machine without any, CPU processes)",
                                 metavar="SIZE", everywhere=False)
    cpu_mem: str | None = option(None, "with --dry-run: decide for nodes of this memory (e.g. 512GiB), which an "
                                 "optimizer state offloaded to the host must fit (default: this machine's, unless "
                                 "--gpu-mem decides for GPUs elsewhere: then not checked)", metavar="SIZE",
                                 everywhere=False)
    sources: Mapping[str, str] = field(default_factory=dict, compare=False)  # option -> how it was given

    def source(self, name: str) -> str:
        return where(name, self.sources.get(name, "flag"))


JOB_OPTIONS = tuple(f.name for f in option_fields(JobOptions))


def job_options(file_values: Mapping[str, Any], file: str | None, env: Mapping[str, str], given: Mapping[str, Any],
                given_source: str) -> JobOptions:
    """The job's options from every source (options.read), checked."""
    values, sources = read(JobOptions, file_values, file, env, given, given_source)
    check_all(JobOptions, values, sources)
    return JobOptions(**values, sources=sources)


@dataclass(frozen=True)
class TrainResult:
    """What a finished job leaves on this node."""

    code: int  # 0; 75 (PREEMPTED) after a preemption's snapshot; 130 after Ctrl-C
    metrics: dict[str, Any]  # rank 0's last log record (loss, val_loss, tokens_per_s, ...); {} on other nodes
    snapshot: str | None  # the newest committed snapshot under OUT/checkpoints
    out: str | None
    dry_run: DryRun | None = None  # under dry_run: the job that would start, and its decisions (nothing ran)


def require_trainer_packages() -> None:
    require_packages("train", TRAINER_PACKAGES, "torch")


def waits_line(rdzv_s: int | None, stall_s: float | None, finish_s: float | None) -> str:
    """The run's line of its bounded waits, as sentences: how long the other nodes have to
    join (``rdzv_s``, None when a single node starts every rank itself), how long a rank may
    stop answering, and how long ranks may run on after another finished."""
    parts = [f"the other nodes have {rdzv_s} s to join (--rdzv-timeout)"] if rdzv_s is not None else []
    if stall_s is not None:
        parts.append(f"a rank that stops answering for {stall_s:.0f} s ends the job (--collective-timeout)")
    if finish_s is not None:
        parts.append(f"ranks still running {finish_s:.0f} s after another finished are stopped (--finish-timeout)")
    return "meshrun train: " + "; ".join(parts)


def corpus_ready(cfg: TrainConfig, env: Mapping[str, str], cpus: int) -> TrainConfig:
    """A corpus given by path, ready for the ranks: text tokenized into the cache (with the
    tokenizer named, else the Hugging Face model directory's), token files opened (a prepared
    corpus' structure checked) and every id checked against a prepared corpus' tokenizer and a
    Hugging Face model's vocabulary; the config pointed at the tokens."""
    from ..config import BUILTIN_DATA
    from ..data.sources import data_kind, text_extensions

    data = cfg.data if cfg.data and cfg.data not in BUILTIN_DATA else None
    kind = data_kind(data) if data is not None else None
    if data is None or kind is None:
        if cfg.tokenizer:
            raise bad_value(cfg.source("tokenizer"), cfg.tokenizer, "tokenizes text given with --data",
                            "drop it, or give --data a text corpus")
        return cfg
    if kind == "text":
        from ..data.cache import tokens_for_text

        tokenizer = cfg.tokenizer or _model_tokenizer(cfg)
        if tokenizer is None:
            raise bad_value(cfg.source("data"), cfg.data, "text needs a tokenizer",
                            "--tokenizer DIR|FILE|NAME, --model a Hugging Face directory with tokenizer.json, or "
                            "meshrun data prepare --train-tokenizer VOCAB to train one on the corpus and prepare it")
        data = tokens_for_text(data, tokenizer, cfg.text_field, env, cpus, cfg.source("data"),
                               text_extensions(cfg.ext, cfg.source("ext")),
                               cfg.source("tokenizer") if cfg.tokenizer else f"{cfg.source('model')}'s tokenizer")
        cfg = cfg.replace(data=data, ext=None)  # (the tokens: --ext chose the files they were read from)
    from ..data.store import FULL_CHECK_TOKENS, check_ids, open_tokens

    vocab = None
    if cfg.model and ":" not in cfg.model:  # a Hugging Face model's vocabulary is known here: check before starting
        from ..modelinfo import hf

        vocab = getattr(hf.load_config(hf.locate(cfg.model, cfg.source("model")), cfg.source("model")),
                        "vocab_size", None)
    # Opened (its structure checked) and, up to FULL_CHECK_TOKENS, every id read here once; a
    # larger corpus is sampled here and each sample is checked as the ranks read it (training/loader.py)
    corpus = open_tokens(data, cfg.data_dtype, cfg.source("data"))  # (cfg.data)
    full = sum(len(split) for split in corpus.splits.values()) <= FULL_CHECK_TOKENS
    check_ids(corpus, vocab if isinstance(vocab, int) else None, cfg.source("data"), full=full)
    return cfg


def _model_tokenizer(cfg: TrainConfig) -> str | None:
    if cfg.model and ":" not in cfg.model:
        from ..modelinfo import hf

        directory = hf.locate(cfg.model, cfg.source("model")).directory
        if os.path.isfile(os.path.join(directory, "tokenizer.json")):
            return directory
    return None




def check(cfg: TrainConfig, topo: Topology, job: JobOptions, gpus: int | None = None) -> None:
    """What can be known wrong before anything starts, refused in one line each (``gpus``:
    this node's visible GPUs, 0 for ranks on the CPU, None when not known)."""
    if cfg.tp > 1 or cfg.pp > 1 or cfg.cp > 1:  # the split by the layout's rule (no torch imported)
        from ..training.parallel.dims import make_dims

        world = topo.world_size
        make_dims(world, tp=cfg.tp, pp=cfg.pp, cp=cfg.cp, source=f"--tp {cfg.tp} --pp {cfg.pp} --cp {cfg.cp} on "
                  f"{world} processes")
    cfg.accumulation(cfg.dp_size(topo.world_size))  # the batch arithmetic
    for name in ("model", "data"):
        value = getattr(cfg, name)
        if value and ":" in value and not os.path.exists(value):
            from ..modelinfo.factory import load_factory

            load_factory(value, f"--{name}")  # import errors now, not in every rank
    if cfg.model and ":" not in cfg.model:  # a Hugging Face model: read and built (on meta) now, not in every rank
        from ..modelinfo import hf

        source = hf.locate(cfg.model, cfg.source("model"))
        meta = hf.build_on_meta(hf.load_config(source, cfg.source("model")), cfg.source("model"), cfg.model)
        if cfg.lora is not None:  # targets that match no layer: refused now, as the ranks would
            from ..training import lora

            lora.target_modules(meta, lora.spec_of(cfg).targets, cfg.source("lora_targets"))
        if not cfg.data:
            raise bad_value("--data", "stdlib", "the default data is the standard library's source as bytes, not "
                            "text in this model's vocabulary", "--data random (random tokens of its vocabulary), "
                            "or --data pkg.mod:factory for your Dataset of token ids")
        if cfg.init != "random":
            hf.check_weight_files(source.weight_files)  # a truncated copy: refused now, not after loading
    if job.max_restarts and not cfg.out:
        raise MeshrunError(f"{job.source('max_restarts')}: a restarted job resumes from its snapshots, which need "
                           "--out DIR (hint: add --out)")
    if job.overwrite and not cfg.out:
        raise MeshrunError(f"{job.source('overwrite')}: sets aside an earlier run's files in --out, and there is "
                           "no --out (hint: add --out DIR, or drop --overwrite)")
    if cfg.collective_timeout < 1:
        raise bad_value(cfg.source("collective_timeout"), cfg.collective_timeout, "must be >= 1 second")
    if topo.local_rank is None:  # (a platform that started this process as one rank chose the count itself)
        processes_fit(topo, gpus, count_visible_cpus())
    prelaunch.check_layout(cfg, topo, gpus)  # what the ranks would refuse of this config, refused now


def gpu_bytes(job: JobOptions) -> int | None:
    """--gpu-mem in bytes; None when not given."""
    return None if job.gpu_mem is None else parse_bytes(job.gpu_mem, job.source("gpu_mem"))


def host_bytes(job: JobOptions) -> int | None:
    """--cpu-mem in bytes; None when not given."""
    return None if job.cpu_mem is None else parse_bytes(job.cpu_mem, job.source("cpu_mem"))


def run(cfg: TrainConfig, topo: Topology, job: JobOptions, env: Mapping[str, str]) -> TrainResult:
    """Check, then run the job on this node (under ``job.dry_run``: start nothing, and return
    what would start in the result's ``dry_run``)."""
    require_trainer_packages()
    gpus = count_visible_gpus(env)
    if gpu_bytes(job) is not None:
        if not job.dry_run:
            raise bad_value(job.source("gpu_mem"), job.gpu_mem, "sets the GPUs a dry run decides for; the ranks "
                            "read their own", "add --dry-run, or drop it")
        gpus = topo.nproc_per_node  # (a GPU per process, as the dry run decides for)
    if host_bytes(job) is not None and not job.dry_run:
        raise bad_value(job.source("cpu_mem"), job.cpu_mem, "sets the host memory a dry run decides for; the ranks "
                        "read their own", "add --dry-run, or drop it")
    check(cfg, topo, job, gpus)
    save_threads(env)  # a variable the ranks read at their first snapshot: checked now
    if topo.node_rank == 0 and not job.dry_run:  # (rank 0 logs: its node checks the trackers' servers)
        trackers.preflight(trackers.parse(cfg.log_with, cfg.source("log_with")), env)
        trackers.saved_ids(cfg.out)  # the tracker runs a resume continues: a damaged file refused now
    # Node rank 0 owns OUT for the run's whole life, restarts included (on shared storage
    # every node names the same OUT; the other nodes leave it to node 0). With one process per
    # task (Slurm, mpirun), node 0's first process owns it.
    lock = None
    if cfg.out and topo.node_rank == 0 and (topo.local_rank or 0) == 0 and not job.dry_run:
        from ..config.runlock import OutputLock

        lock = OutputLock(cfg.out, cfg.source("out"))
        lock.acquire()
    try:
        if not job.dry_run:  # (a dry run tokenizes nothing: its command names the corpus as given)
            cfg = corpus_ready(cfg, env, count_visible_cpus())
        run_id = None
        if lock is not None:
            from ..config import outdir

            prepared = outdir.prepare(lock.out, cfg.resume, job.overwrite, cfg.source("resume"), cfg.steps)
            if prepared.note:
                print(prepared.note, flush=True)
            if prepared.done is not None and topo.nnodes == 1 and topo.local_rank is None:
                # (with other nodes or tasks waiting to meet this one, the ranks say it: Trainer.fit)
                print(f"meshrun train: {lock.out} is already at step {prepared.done}"
                      + (f" of {cfg.steps}" if prepared.done == cfg.steps else f", past --steps {cfg.steps}")
                      + "; nothing to do (hint: pass a larger --steps to train on)", flush=True)
                return TrainResult(0, last_metrics(lock.out), _newest_snapshot(cfg.out), cfg.out)
            lock.hold_snapshots()
            cfg, run_id = cfg.replace(resume=prepared.resume), prepared.run_id
        elif job.overwrite:  # the other nodes start afresh, as node 0 does
            cfg = cfg.replace(resume="none")
        # The ranks report to a directory of this run's own (launch/rundir.py; mkdtemp: a fresh
        # name, mode 0700), so no file another user planted, or an earlier run left behind, can
        # stand in for their reports; it is removed when the run ends, however it ends. Each
        # rank's whole output goes to LOGS/rank-N.log (training/ranklog.py): OUT/logs, or without
        # --out the run directory's own, kept only when the job fails (its line names it).
        root = tempfile.mkdtemp(prefix="meshrun-train-")
        run_dir = RunDir(root, os.path.join(cfg.out, "logs") if cfg.out else None)
        keep = False
        try:
            code = _launch(job, env, cfg, topo, run_dir, run_id)
            if isinstance(code, DryRun):
                return TrainResult(0, {}, None, cfg.out, dry_run=code)
            return TrainResult(code, _last_record(run_dir), _newest_snapshot(cfg.out), cfg.out)
        except JobFailed:
            # without --out the ranks' logs live here: kept when a rank failed (its line names them)
            keep = not cfg.out and os.path.isdir(run_dir.log_dir)
            raise
        finally:
            for name in os.listdir(root) if keep else ():
                if name != os.path.basename(run_dir.log_dir):
                    os.unlink(os.path.join(root, name))
            if not keep:
                shutil.rmtree(root, ignore_errors=True)
    finally:
        if lock is not None:
            lock.release()


def _launch(job: JobOptions, env: Mapping[str, str], cfg: TrainConfig, topo: Topology, run_dir: RunDir,
            run_id: str | None = None) -> int | DryRun:
    """Launch the workers reporting to ``run_dir`` (under --dry-run: what would start, started
    not); ``run_id``: the run the snapshots belong to (node rank 0 knows it)."""
    extra = run_dir.env()
    waits = Waits(stall_s=cfg.collective_timeout, finish_s=job.finish_timeout)
    extra.update(thread_env(topo.nproc_per_node, env))  # torchrun's own choice, without its banner
    if run_id:
        from ..config.outdir import RUN_ID_ENV

        extra[RUN_ID_ENV] = run_id

    def command(attempt: int) -> tuple[Command, LaunchSpec, Topology]:
        t = attempt_topology(topo, attempt)
        spec = LaunchSpec(framework="torch", script=WORKER, module=True, rdzv_timeout=job.rdzv_timeout)
        # one node: meshrun starts every rank itself; torchrun where its rendezvous is the
        # contract (several nodes) or the platform started this process as one rank
        launch = direct.build_node(t, WORKER) if t.nnodes == 1 and t.local_rank is None else build(t, spec)
        # a restart continues this run: from its own snapshots, even when it started afresh
        attempt_cfg = cfg.replace(resume="auto") if attempt and cfg.resume == "none" else cfg
        return Command(processes=launch.processes, env={**launch.env, "MESHRUN_TRAIN_CONFIG": attempt_cfg.to_json(),
                                                        **extra}, files=launch.files, note=launch.note), spec, t

    cmd, spec, _ = command(0)
    if job.dry_run:
        from .preview import decided  # (torch-free on the CPU)

        keys, lines = decided(cfg, topo, gpu_bytes(job), count_visible_gpus(env), host_bytes(job))
        return DryRun(cfg, topo, {name: getattr(job, name) for name in JOB_OPTIONS}, keys, tuple(lines), cmd)
    check_ports(topo, cmd, spec)
    if topo.node_rank == 0 and (topo.local_rank or 0) == 0:
        rdzv = rdzv_timeout_s(job.rdzv_timeout) if topo.nnodes > 1 or topo.local_rank is not None else None
        print(waits_line(rdzv, waits.stall_s, waits.finish_s), flush=True)
    from ..training.preempt import SIGNALS  # (signal numbers only: no torch import here)

    return run_with_restarts(command, env, job.max_restarts, job.rdzv_timeout, run_dir, SIGNALS, waits=waits,
                             last_snapshot=lambda: _last_snapshot(cfg.out))


LAST_RECORD_BYTES = 1 << 20  # a log record is a line of a few hundred bytes: the file's end is read, not all of it


def last_metrics(out: str) -> dict[str, Any]:
    """The last record of OUT/metrics.jsonl (a finished run's last metrics), {} without one.
    Only the file's last LAST_RECORD_BYTES are read: a long run's file is not loaded whole."""
    path = os.path.join(out, "metrics.jsonl")
    try:
        with open(path, "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                return {}
            f.seek(max(0, os.fstat(f.fileno()).st_size - LAST_RECORD_BYTES))
            tail = f.read(LAST_RECORD_BYTES)
    except OSError:
        return {}
    for line in reversed(tail.splitlines()):
        try:
            record = json.loads(line)
        except ValueError:  # a line cut at the window's start, or one a crash left half-written
            continue
        if isinstance(record, dict) and isinstance(record.get("step"), int):  # (as metrics.read_records)
            return record
    return {}


def _newest_snapshot(out: str | None) -> str | None:
    if not out:
        return None
    from ..config.outdir import snapshots

    found = snapshots(os.path.join(out, "checkpoints"))
    return found[-1][1] if found else None


def _last_snapshot(out: str | None) -> str:
    """Where a run stopped by Ctrl-C resumes from, in words."""
    if not out:
        return "no snapshot without --out"
    newest = _newest_snapshot(out)
    return f"the last snapshot is {newest}" if newest else "no snapshot yet"


def _last_record(run_dir: RunDir) -> dict[str, Any]:
    """Rank 0's last log record, when rank 0 ran on this node and trained."""
    try:
        with open(run_dir.result) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return {}
    return record if isinstance(record, dict) else {}
