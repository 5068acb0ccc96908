"""Peak GPU memory of `meshrun train` with the layout given in full, on models the planner was
never fitted to: the numbers `meshrun plan` must predict (docs/benchmarks.md; the rows go to
tests/data/calibration/).

Each row runs exactly

    python3 -m meshrun train --model SOURCE --data random --steps 4 --log-every 1 --nproc G \\
        --seq-len T --micro-batch B --global-batch B*G --strategy S \\
        --activation-checkpointing none|full --compile on|off

(SOURCE: meshrun's GPT preset by --model-size; a Hugging Face shape of bench/hf_config.py,
random init, its config.json written once into OUT/models/NAME; or a plain torch module of
bench/usermodels.py, module:factory) and records nvidia-smi's peak memory.used of its cards
(sampled every 0.1 s), meshrun's own peak_reserved of its metrics lines, its layout line, the
exit status and whether it ran out of memory. Rows marked held out are kept out of any fitting
and reported apart.

From the repository root, the grid in two calls of under 10 minutes (a 1-GPU host: --gpus 1,
where DDP and FSDP2 run on one rank; their own buffers and states are there all the same):

    python3 bench/memory_grid.py --gpus 1 --part 1/2 --out $OUT/a
    python3 bench/memory_grid.py --gpus 1 --part 2/2 --out $OUT/b

Held-out layouts over two GPUs (DDP, FSDP2, DeepSpeed ZeRO-2/3: DeepSpeed installed), and
meshrun's defaults (no layout, micro-batch, checkpointing or compile flag: the row records what
meshrun chose, its prediction, and whether it ran out of memory):

    python3 bench/memory_grid.py --grid two --gpus 2 --out $OUT/two
    python3 bench/memory_grid.py --grid auto --gpus 2 --out $OUT/auto
    python3 bench/memory_grid.py --grid new --gpus 1 --out $OUT/new   # families never measured before

Rows not started before --deadline-s are printed SKIPPED with the command that runs them
(--rows NAME,NAME). --cpu-check runs tiny stand-ins of every kind on the CPU (2 processes),
to check the suite itself.

Anywhere (the CPU does: the models are built on the meta device), what `meshrun plan`
predicts for each measured row against nvidia-smi's peak, fitted and held-out rows apart:

    python3 bench/memory_grid.py --report tests/data/calibration/unseen-models_h200_2026-11-28.jsonl \
        tests/data/calibration/unseen-models_h200x2_2026-11-29.jsonl \
        tests/data/calibration/defaults-auto_h200x2_2026-11-29.jsonl \
        tests/data/calibration/defaults-auto_h200_2026-11-29.jsonl

The planner's model is built and traced as `meshrun train` builds and traces it; a Hugging Face
model's attention as the measured runs built it (see attention_as_run).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import platform
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

from defaults_matrix import REPO, Job, Model, Suite, count_gpus  # noqa: E402

STEPS = 4  # the optimizer's state exists from the first step; the peak repeats from the second


@dataclass(frozen=True)
class Row:
    model: str  # a key of SOURCES
    seq: int
    micro: int
    strategy: str
    ac: str = "none"
    compiled: bool = False
    held_out: bool = False  # never used to fit the planner's constants

    @property
    def name(self) -> str:
        if self.auto:
            return f"{self.model}-auto-s{self.seq}"
        return (f"{self.model}-{self.strategy}-s{self.seq}-b{self.micro}" + ("-ac" if self.ac != "none" else "")
                + ("-compiled" if self.compiled else ""))

    @property
    def auto(self) -> bool:
        """meshrun's defaults pick the layout, the micro-batch (up to ``micro``), checkpointing
        and compilation: the row checks that they fit."""
        return self.strategy == "auto"


# model -> (kind, what: preset | hf_config shape | usermodels factory, layers kept (None: all), billions)
SOURCES: dict[str, tuple[str, str, int | None, float]] = {
    "gpt-124m": ("gpt", "gpt-124m", None, 0.124),
    "gpt-1.3b": ("gpt", "gpt-1.3b", None, 1.3),
    "hf-gpt2": ("hf", "gpt2", None, 0.124),
    "hf-gpt2-medium": ("hf", "gpt2-medium", None, 0.355),
    "user-gpt-124m": ("user", "gpt_124m", None, 0.124),
    "user-gpt-1.3b": ("user", "gpt_1b3", None, 1.3),
    "user-llama-1b": ("user", "llama_1b", None, 1.1),
    "hf-llama3.2-1b": ("hf", "llama3.2-1b", None, 1.24),
    "hf-qwen2.5-1.5b": ("hf", "qwen2.5-1.5b", None, 1.54),
    "hf-gemma-2-2b": ("hf", "gemma-2-2b", None, 2.61),
    "hf-mistral-8l": ("hf", "mistral-7b", 8, 1.9),
    "hf-mixtral-small": ("hf", "mixtral-small", None, 0.9),
    "hf-qwen3-1.7b": ("hf", "qwen3-1.7b", None, 1.7),
    "hf-phi-3-mini": ("hf", "phi-3-mini", None, 3.8),
    "hf-olmo-2-1b": ("hf", "olmo-2-1b", None, 1.5),
    "hf-granite-3-2b": ("hf", "granite-3-2b", None, 2.5),
    "hf-starcoder2-3b": ("hf", "starcoder2-3b", None, 3.0),
    "hf-qwen3-moe-4l": ("hf", "qwen3-moe-small", None, 2.7),
}

GRID: list[Row] = [
    Row("gpt-124m", 1024, 16, "ddp"), Row("gpt-124m", 1024, 16, "fsdp-full"),
    Row("hf-gpt2", 1024, 16, "ddp"), Row("hf-gpt2", 1024, 16, "fsdp-full"), Row("hf-gpt2", 1024, 16, "fsdp-grad-op"),
    Row("hf-gpt2", 1024, 16, "fsdp-full", ac="full"),
    Row("hf-gpt2-medium", 1024, 8, "ddp", held_out=True), Row("hf-gpt2-medium", 1024, 8, "fsdp-full", held_out=True),
    Row("user-gpt-124m", 1024, 16, "ddp"), Row("user-gpt-124m", 1024, 16, "fsdp-full"),
    Row("user-gpt-1.3b", 1024, 8, "ddp"), Row("user-gpt-1.3b", 1024, 8, "fsdp-full"),
    Row("user-gpt-1.3b", 1024, 8, "fsdp-full", compiled=True),
    Row("user-llama-1b", 2048, 4, "ddp", held_out=True), Row("user-llama-1b", 2048, 4, "fsdp-full", held_out=True),
    Row("user-llama-1b", 2048, 4, "ddp", compiled=True, held_out=True),
    Row("user-llama-1b", 2048, 4, "fsdp-full", ac="full", held_out=True),
    Row("hf-llama3.2-1b", 2048, 4, "ddp"), Row("hf-llama3.2-1b", 2048, 4, "fsdp-full"),
    Row("hf-llama3.2-1b", 2048, 4, "fsdp-grad-op"), Row("hf-llama3.2-1b", 2048, 4, "fsdp-full", ac="full"),
    Row("hf-llama3.2-1b", 2048, 4, "ddp", compiled=True),
    Row("hf-llama3.2-1b", 2048, 2, "single"), Row("hf-llama3.2-1b", 2048, 8, "single"),
    Row("user-llama-1b", 2048, 8, "single", held_out=True), Row("hf-qwen2.5-1.5b", 2048, 8, "single"),
    Row("hf-qwen2.5-1.5b", 2048, 4, "ddp"), Row("hf-qwen2.5-1.5b", 2048, 4, "fsdp-full"),
    Row("hf-qwen2.5-1.5b", 2048, 4, "fsdp-full", ac="full"),
    Row("hf-gemma-2-2b", 2048, 2, "ddp", held_out=True), Row("hf-gemma-2-2b", 2048, 2, "fsdp-full", held_out=True),
    Row("hf-gemma-2-2b", 2048, 2, "fsdp-full", ac="full", held_out=True),
    Row("hf-mistral-8l", 2048, 4, "ddp"), Row("hf-mistral-8l", 2048, 4, "fsdp-full"),
    Row("hf-mixtral-small", 2048, 4, "ddp", held_out=True),
    Row("hf-mixtral-small", 2048, 4, "fsdp-full", held_out=True),
    Row("hf-mixtral-small", 2048, 4, "fsdp-full", ac="full", held_out=True),
]

# Two GPUs (--grid two): layouts whose states are sharded or replicated over 2 ranks; none of
# these rows is fitted to (the planner's constants come from the 1-GPU rows above)
GRID_TWO: list[Row] = [
    Row("gpt-1.3b", 1024, 16, "fsdp-full", compiled=True, held_out=True),
    Row("gpt-1.3b", 1024, 16, "ddp", compiled=True, held_out=True),
    Row("hf-llama3.2-1b", 2048, 4, "ddp", held_out=True), Row("hf-llama3.2-1b", 2048, 4, "fsdp-full", held_out=True),
    Row("hf-llama3.2-1b", 2048, 8, "fsdp-full", ac="full", held_out=True),
    Row("hf-llama3.2-1b", 2048, 4, "zero2", held_out=True), Row("hf-llama3.2-1b", 2048, 4, "zero3", held_out=True),
    Row("hf-qwen2.5-1.5b", 2048, 4, "fsdp-grad-op", held_out=True),
    Row("hf-gemma-2-2b", 2048, 2, "fsdp-full", held_out=True),
    Row("hf-mistral-8l", 2048, 4, "ddp", held_out=True),
    Row("hf-mixtral-small", 2048, 4, "fsdp-full", held_out=True),
    Row("user-llama-1b", 2048, 4, "fsdp-full", compiled=True, held_out=True),
]

# meshrun's defaults (--grid auto): no layout, micro-batch, checkpointing or compile flag; the
# global batch allows micro-batches up to the planner's cap (128K tokens)
GRID_AUTO: list[Row] = [Row(m, seq, 128 * 1024 // seq, "auto", held_out=True) for m, seq in (
    ("gpt-1.3b", 1024), ("hf-llama3.2-1b", 2048), ("hf-qwen2.5-1.5b", 2048), ("hf-gemma-2-2b", 2048),
    ("hf-mixtral-small", 2048), ("user-llama-1b", 2048), ("hf-gpt2-medium", 1024), ("hf-mistral-8l", 2048),
    ("user-gpt-1.3b", 1024), ("hf-gpt2", 1024))]

# families measured nowhere before (--grid new): meshrun's defaults on each, and a given layout
# or two; every row held out
GRID_NEW: list[Row] = [
    *(Row(m, seq, 128 * 1024 // seq, "auto", held_out=True) for m, seq in (
        ("hf-qwen3-1.7b", 2048), ("hf-phi-3-mini", 2048), ("hf-olmo-2-1b", 2048), ("hf-granite-3-2b", 2048),
        ("hf-starcoder2-3b", 2048), ("hf-qwen3-moe-4l", 2048))),
    Row("hf-qwen3-1.7b", 2048, 4, "fsdp-full", held_out=True),
    Row("hf-starcoder2-3b", 2048, 4, "ddp", held_out=True),
    Row("hf-phi-3-mini", 2048, 2, "fsdp-full", ac="full", held_out=True),
    Row("hf-olmo-2-1b", 2048, 4, "ddp", compiled=True, held_out=True),
]

GRIDS = {"one": GRID, "two": GRID_TWO, "auto": GRID_AUTO, "new": GRID_NEW}

# --cpu-check: every kind of source at a size the CPU runs, 2 processes
CPU_SOURCES: dict[str, tuple[str, str, int | None, float]] = {
    "gpt-tiny": ("gpt", "gpt-tiny", None, 0.001),
    "hf-gpt2": ("hf", "gpt2", 1, 0.001),
    "user-llama-tiny": ("user", "llama_tiny", None, 0.001),
}
CPU_GRID = [Row("gpt-tiny", 32, 2, "ddp"), Row("hf-gpt2", 32, 2, "fsdp-full", ac="full"),
            Row("user-llama-tiny", 32, 2, "fsdp-full")]


def estimate_s(row: Row, billions: float) -> float:
    """Rough: start-up and the model's build, compilation, then the steps."""
    return 25.0 + 4.0 * billions + (60.0 if row.compiled else 0.0)


def source_args(kind: str, what: str, layers: int | None, out: str, name: str) -> list[str]:
    if kind == "gpt":
        return ["--model-size", what]
    if kind == "user":
        return ["--model", f"usermodels:{what}"]
    path = os.path.join(out, "models", name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        from hf_config import write_config

        write_config(what, path, layers=layers)
    return ["--model", path]


class GridSuite(Suite):
    """The matrix suite's runner, each row's record completed with the grid's own fields."""

    def __init__(self, *args: Any, meta: dict[str, dict[str, Any]], **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.meta = meta
        self.smi_every = 0.1

    def record(self, row: dict[str, Any]) -> dict[str, Any]:
        row.update(self.meta.get(row["log"], {}))
        return super().record(row)

    def env(self, job: Job, parallel: bool) -> dict[str, str]:
        env = super().env(job, parallel)
        env["PYTHONPATH"] = env["PYTHONPATH"] + os.pathsep + BENCH  # usermodels
        return env


def jobs_for(rows: list[Row], sources: dict[str, tuple[str, str, int | None, float]], gpus: int, out: str,
             cpu: bool, host: dict[str, Any]) -> tuple[list[Job], dict[str, dict[str, Any]]]:
    jobs, meta = [], {}
    for row in rows:
        kind, what, layers, billions = sources[row.model]
        argv = [sys.executable, "-m", "meshrun", "train", *source_args(kind, what, layers, out, row.model),
                "--data", "random", "--steps", str(STEPS), "--log-every", "1", "--nproc", str(gpus),
                "--seq-len", str(row.seq), "--global-batch", str(row.micro * gpus)]
        if not row.auto:
            argv += ["--micro-batch", str(row.micro), "--strategy", row.strategy, "--activation-checkpointing", row.ac,
                     "--compile", "on" if row.compiled else "off"]
        log = os.path.join(out, f"{row.name}.log")
        est = 30.0 if cpu else estimate_s(row, billions) + (60.0 if row.auto else 0.0)
        jobs.append(Job("meshrun", Model(row.name, kind, billions), gpus, argv, log, est, max(180.0, 3 * est)))
        meta[log] = {"row": row.name, "source": f"{kind}:{what}" + (f" ({layers} layers)" if layers else ""),
                     "seq": row.seq, "micro_batch": row.micro, "strategy_asked": row.strategy, "ac_asked": row.ac,
                     "compile_asked": row.compiled, "held_out": row.held_out, "steps": STEPS, **host}
    return jobs, meta


def host_facts(cpu: bool) -> dict[str, Any]:
    facts: dict[str, Any] = {"date": time.strftime("%Y-%m-%d", time.gmtime()), "python": platform.python_version()}
    try:
        facts["torch"] = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__)"],
                                        capture_output=True, text=True, timeout=120).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        facts["torch"] = None
    if not cpu:
        try:
            text = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version",
                                   "--format=csv,noheader"], capture_output=True, text=True, timeout=30).stdout
            name, total, driver = (p.strip() for p in text.splitlines()[0].split(","))
            facts.update(card=name, card_memory=total, driver=driver)
        except (OSError, subprocess.TimeoutExpired, IndexError, ValueError):
            pass
    return facts


# ---- the planner against the measurements ----------------------------------------------------

def build_module(row: dict[str, Any], where: str) -> Any:
    """A measured row's model on the meta device, built as `meshrun train` built it (meshrun's
    GPT with its GPU kernels; a Hugging Face shape from its config.json, written into ``where``
    once; a user's module from its factory)."""
    import torch

    kind, _, what = row["source"].partition(":")
    what, _, layers_text = what.partition(" (")
    if kind == "gpt":  # as meshrun train builds it on GPUs (--kernels auto)
        from meshrun.training.models.gpt import gpt

        with torch.device("meta"):
            return gpt(what, seq_len=row["seq"], head_loss=True, fused_mlp="auto")
    if kind == "user":
        import usermodels

        with torch.device("meta"):
            return getattr(usermodels, what)()
    from hf_config import write_config

    from meshrun.modelinfo import hf

    path = os.path.join(where, row["source"].replace(":", "-").replace(" ", ""))
    layers = int(layers_text.split()[0]) if layers_text else None
    if not os.path.isfile(os.path.join(path, "config.json")):
        with contextlib.redirect_stdout(io.StringIO()):  # (its "wrote ..." line is no part of the table)
            write_config(what, path, layers=layers)
    return hf.build_on_meta(hf.load_config(hf.locate(path, "--model"), "--model"), "--model", path)


_SPECS: dict[tuple[Any, ...], Any] = {}  # model_spec's answers: rows of one model and layout share a trace


def model_spec(row: dict[str, Any], where: str) -> Any:
    """The planner's ModelSpec of a measured row's model, read and traced from the model as
    `meshrun train` reads and traces it (training/parallel/auto.py). The trace depends on the
    model, the sequence length, the precision mode, compilation and Liger Kernel alone: rows
    that differ only in micro-batch or GPU count reuse it (44 traces for the 67 predictions of
    tests/test_plan_trace.py's accuracy test, instead of 67: 57.8 s against 78.7 s on 2 cores)."""
    modes = ("autocast",) if row["strategy_asked"] in ("single", "ddp") else ("bf16",)
    liger = any("Liger" in k for k in row.get("kernels") or ())  # the run patched Liger Kernel's kernels in
    compiled = bool(row.get("compile_asked"))
    key = (row["source"], row["seq"], modes, compiled, liger, where)
    if key not in _SPECS:
        from meshrun.modelinfo.read import from_module
        from meshrun.plan.trace import with_trace

        what = row["source"].partition(":")[2].partition(" (")[0]
        module = build_module(row, where)
        spec = from_module(module, what, "the model")
        with attention_as_run(module):
            _SPECS[key] = with_trace(spec, module, row["seq"], modes, compiled=compiled, liger=liger)
    return _SPECS[key]


@contextlib.contextmanager
def attention_as_run(module: Any) -> Any:
    """A Hugging Face model's attention as the measured runs built it: transformers 5.17 built
    Gemma-2 with SDPA and let it drop the soft-capping (newer versions refuse SDPA for it and
    build eager attention, whose score matrices the run never held)."""
    config = getattr(module, "config", None)
    if config is None or getattr(config, "_attn_implementation", "sdpa") == "sdpa":
        yield
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    built, sdpa = config._attn_implementation, ALL_ATTENTION_FUNCTIONS["sdpa"]
    config._attn_implementation = "sdpa"
    ALL_ATTENTION_FUNCTIONS["sdpa"] = lambda *a, softcap=None, **k: sdpa(*a, **k)
    try:
        yield
    finally:
        config._attn_implementation = built
        ALL_ATTENTION_FUNCTIONS["sdpa"] = sdpa


def predicted_gib(row: dict[str, Any], where: str) -> dict[str, float]:
    """The planner's peak for the row's layout (nvidia-smi's view: the CUDA context included)
    and its terms, in GiB. The layout is estimated as asked, also where the planner would
    not list it (DDP or FSDP2 on one GPU)."""
    from meshrun.plan import ClusterSpec, TrainSpec
    from meshrun.plan.memory import estimate
    from meshrun.plan.strategies import named

    gpus = int(row["gpus"])
    card = int(str(row.get("card_memory", "143771 MiB")).split()[0]) * 2**20
    accumulation = int(row.get("accum") or 1)  # meshrun's defaults accumulate
    train = TrainSpec(seq_len=row["seq"], micro_batch=row["micro_batch"],
                      global_batch=row["micro_batch"] * accumulation * gpus,
                      precision="bf16", compile=row["compile_asked"], activation_checkpointing=row["ac_asked"])
    strategy = named(row["strategy_asked"], gpus, gpus, row["ac_asked"] == "full")
    memory = estimate(model_spec(row, where), ClusterSpec(nodes=1, gpus_per_node=gpus, gpu_mem=card), train,
                      strategy, row["micro_batch"])
    return {"peak": memory.peak / GIB, **{k: v / GIB for k, v in memory.breakdown.items()}}


GIB = 2**30


def report(files: list[str]) -> None:
    import statistics
    import tempfile

    rows = [json.loads(line) for path in files for line in open(path) if line.strip()]
    auto = [r for r in rows if r.get("strategy_asked") == "auto"]
    rows = [r for r in rows if r.get("ran") and r.get("smi_peak_gib") and r.get("strategy_asked") != "auto"]
    where = tempfile.mkdtemp(prefix="memory-grid-")
    if rows:
        print("| row | GPUs | held out | planned GiB | nvidia-smi GiB | error |")
        print("|---|---|---|---|---|---|")
    errors: dict[bool, list[float]] = {False: [], True: []}
    for r in rows:
        got = predicted_gib(r, where)
        err = got["peak"] / r["smi_peak_gib"] - 1
        errors[bool(r["held_out"])].append(err)
        print(f"| {r['row']} | {r['gpus']} | {'yes' if r['held_out'] else ''} | {got['peak']:.2f} | "
              f"{r['smi_peak_gib']:.2f} | {err:+.1%} |")
    print()
    for held, errs in errors.items():
        if errs:
            print(f"{'held-out' if held else 'fitted-side'} rows: {len(errs)}, median |error| "
                  f"{statistics.median(abs(e) for e in errs):.1%}, worst {max(errs, key=abs):+.1%}, "
                  f"under by more than 5%: {sum(e < -0.05 for e in errs)}")
    if auto:
        print("\nmeshrun's defaults: the layout and micro-batch it chose, what it predicted then, what this "
              "planner predicts for that choice now")
        print("\n| row | GPUs | layout it chose | micro x accumulation | predicted at the run GiB | predicted now GiB "
              "| nvidia-smi GiB | error now | out of memory |")
        print("|---|---|---|---|---|---|---|---|---|")
        now_errors = []
        for r in auto:
            planned, smi = r.get("planner_predicted_gib"), r.get("smi_peak_gib")
            layout = (r.get("strategy", "?") + ("+ac" if r.get("ac") == "full" else "")
                      + (" compiled" if r.get("compiled") else ""))
            oom = "yes" if r.get("oom") or r.get("refits") else "no" if r.get("ran") else f"did not run ({r['status']})"
            now = err = "-"
            if r.get("ran") and smi:
                chosen = dict(r, strategy_asked=r["strategy"], micro_batch=r["micro"], compile_asked=r["compiled"],
                              ac_asked="full" if r.get("ac") == "full" else "none")
                got = predicted_gib(chosen, where)["peak"]
                now, err = f"{got:.2f}", f"{got / smi - 1:+.1%}"
                now_errors.append(got / smi - 1)
            print(f"| {r['row']} | {r['gpus']} | {layout} | {r.get('micro', '?')} x {r.get('accum', '?')} | "
                  f"{planned if planned is not None else '-'} | {now} | {smi if smi is not None else '-'} | {err} | "
                  f"{oom} |")
        if now_errors:
            print(f"\ndefaults rows: {len(now_errors)}, median |error| "
                  f"{statistics.median(abs(e) for e in now_errors):.1%}, worst {max(now_errors, key=abs):+.1%}, "
                  f"under by more than 5%: {sum(e < -0.05 for e in now_errors)}, out of memory: "
                  f"{sum(bool(r.get('oom') or r.get('refits')) for r in auto)}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, default=2, help="processes (GPUs) per row (default 2)")
    ap.add_argument("--grid", default="one", choices=tuple(GRIDS),
                    help="one: the fitted and held-out rows (run on one GPU); two: held-out layouts over 2 GPUs; "
                         "auto: meshrun's defaults, which must not run out of memory; new: defaults and layouts on "
                         "families measured nowhere before (default one)")
    ap.add_argument("--part", default="1/1", metavar="K/N", help="every N-th row from the K-th (default 1/1)")
    ap.add_argument("--rows", default=None, help="only these rows, by name (comma-separated), in this order")
    ap.add_argument("--out", default="/tmp/meshrun-memory-grid", help="logs, model configs, matrix.jsonl")
    ap.add_argument("--deadline-s", type=float, default=500, help="start no row after this many seconds (500)")
    ap.add_argument("--end-s", type=float, default=560, help="every row ends by this many seconds (560)")
    ap.add_argument("--list", action="store_true", help="print the rows and their commands; run nothing")
    ap.add_argument("--cpu-check", action="store_true", help="tiny stand-ins of every kind on the CPU")
    ap.add_argument("--report", nargs="+", default=None, metavar="JSONL",
                    help="the planner's prediction for each measured row against nvidia-smi's peak")
    a = ap.parse_args()
    if a.report:
        sys.path.insert(0, os.path.join(REPO, "src"))
        report(a.report)
        return 0
    start = time.time()
    try:
        k, n = (int(x) for x in a.part.split("/"))
        if not 1 <= k <= n:
            raise ValueError
    except ValueError:
        ap.error(f"--part {a.part!r}: give K/N with 1 <= K <= N")
    grid, sources = (CPU_GRID, CPU_SOURCES) if a.cpu_check else (GRIDS[a.grid], SOURCES)
    rows = grid[k - 1::n]
    if a.rows:
        wanted = a.rows.split(",")
        unknown = sorted(set(wanted) - {r.name for r in grid})
        if unknown:
            ap.error(f"unknown row(s) {','.join(unknown)}; --list shows them")
        by_name = {r.name: r for r in grid}
        rows = [by_name[name] for name in dict.fromkeys(wanted)]  # in the order given
    gpus = 2 if a.cpu_check else a.gpus
    if not a.cpu_check and not a.list:
        found = count_gpus()
        if found is not None and found < gpus:
            ap.error(f"{gpus} GPUs needed, nvidia-smi lists {found}")
    a.out = os.path.abspath(a.out)
    os.makedirs(a.out, exist_ok=True)
    jobs, meta = jobs_for(rows, sources, gpus, a.out, a.cpu_check, {} if a.list else host_facts(a.cpu_check))
    if a.list:
        for job in jobs:
            print(f"{job.model.name}: {' '.join(job.argv[1:])}")
        return 0
    suite = GridSuite(a.out, a.deadline_s, a.end_s, cpu=a.cpu_check, since=start, meta=meta)

    def on_signal(signum: int, _frame: Any) -> None:
        suite.end_all()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    for job in jobs:
        job.cards = list(range(gpus))
        suite.run(job)
    print(f"\n{len(suite.results)} row(s) in {suite.elapsed():.0f} s; {a.out}/matrix.jsonl", flush=True)
    for r in suite.results:
        smi = r.get("smi_peak_gib")
        print(f"{r['row']:<45s} {r['status']:<8s} smi {smi if smi is not None else '-':>6} GiB  reserved "
              f"{r.get('peak_reserved_gib', '-')} GiB{'  OOM' if r.get('oom') else ''}", flush=True)
    skipped = [r["row"] for r in suite.results if r["status"] == "skipped"]
    if skipped:
        print(f"\nSKIPPED: python3 bench/memory_grid.py --rows {','.join(skipped)} --out OUT", flush=True)
    return 0 if all(r.get("ran") for r in suite.results) else 1


if __name__ == "__main__":
    os.chdir(REPO)
    sys.exit(main())
