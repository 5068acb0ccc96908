"""`meshrun train` with no flag but the model, the data and a step count, over a matrix of
models and GPU counts, beside the plain FSDP2 peer on the Llama shapes; one table at the end.

Each row runs exactly

    python3 -m meshrun train (--model-size NAME | --model OUT/models/NAME) --data random \
        --steps S --log-every 1 --nproc G

(S: 3 under 3B parameters, 2 for the 7-8B models; --log-every 1 only prints a metrics line per
step). Models: gpt-124m, gpt-1.3b (meshrun's GPT presets), llama3.2-1b, qwen2.5-1.5b,
gemma-2-2b, mistral-7b, llama3-8b (Hugging Face shapes of bench/hf_config.py, random init: only
their config.json is written, once, into OUT/models/NAME). With --peer, each Llama row is
followed by the peer on the same shape:

    torchrun --standalone --nproc_per_node=G PEER --mode fsdp2 --arch llama3-1b|llama3-8b \
        --seq 4096 --batch 4|2 --steps 8 --warmup 3 [--compile (1B)] [--ac (8B)]

On a 2-GPU host, from the repository root with the peer copied into the tree (e.g.
.peer/peerbench.py), one part per call (each stays under 10 minutes), then the table of both:

    python3 bench/defaults_matrix.py --gpus 1 --parallel-1gpu --peer .peer/peerbench.py --out $OUT/g1
    python3 bench/defaults_matrix.py --gpus 2 --peer .peer/peerbench.py --out $OUT/g2
    python3 bench/defaults_matrix.py --report $OUT/g1/matrix.jsonl,$OUT/g2/matrix.jsonl

--parallel-1gpu runs two 1-GPU rows at once, one on card 0 and one on card 1, paired by
expected duration (the shortest pairs first); otherwise rows run one after another on cards
0..G-1. Every run has a time limit, at which its process group is killed. The suite starts no
run after --deadline-s seconds (default 540), nor one whose expected duration no longer fits
before --end-s (580), and prints those rows "SKIPPED (deadline)" with the command that runs
them in another call. Expected durations (rough: start-up and compilation, then the steps at
about 40% MFU) add up to about 9.5 minutes for the first part and 13 for the second, so expect
the 7-8B rows on 2 GPUs (and perhaps on 1) to need another call, e.g.

    python3 bench/defaults_matrix.py --gpus 2 --models mistral-7b,llama3-8b --peer .peer/peerbench.py --out $OUT/g2b

and --report over every part's matrix.jsonl (a row that ran replaces a skipped one). Parts of
both GPU counts can share one call: T=$(date +%s), then each part with --since $T counts its
deadlines from the call's start.

Per row, one `MATRIX {json}` line (also appended to OUT/matrix.jsonl; the run's full output in
OUT/NAME-Ggpu.log, the peer's in OUT/NAME-Ggpu-peer.log): the exit status; whether it ran
(status 0 and a metrics line); meshrun's first line and the reasons under it, and from them
the layout (strategy, micro-batch x accumulation, compiled or eager, kernels) and the
planner's predicted peak; the median tokens/s per GPU and MFU of the metrics lines after the
first (whose interval includes compilation); the largest peak_reserved of the metrics lines;
nvidia-smi's peak memory of the row's cards (sampled every 0.5 s); whether the output holds
"out of memory" (or meshrun's "out of GPU memory", also when it halved a micro-batch and went
on) or a Traceback; its last 3 lines when it did not run.

--paths runs each Hugging Face model's meshrun row once per candidate path, the path's flags
added to the row's command (meshrun's GPT rows run the default path only):

    default           no flag: what meshrun picks
    liger-eager       --compile off: eager, every Liger kernel
    compiled-liger    --compile on: blocks compiled, Liger's fused linear cross-entropy alone
    compiled-plain    --compile on --kernels plain: blocks compiled, the model's own loss
    fp8               --precision fp8: float8 linear layers (tensorwise), compiled, Liger's loss
    fp8-rowwise       --precision fp8-rowwise: the same, rowwise scales

and --train-args adds flags to every meshrun row (e.g. "--global-batch 16 --steps 6" for
shorter steps than the default global batch's). Each row's table line names its path.

--cpu-check runs the same machinery on the CPU with stand-ins, to check the suite itself:
gpt-tiny and a 2-layer Llama, 2 processes, 3 steps of micro-batch 2 x 32 tokens (flags only
this mode adds), and with --peer the peer's llama3-tiny; --parallel-1gpu runs them in pairs.

    python3 bench/defaults_matrix.py --cpu-check --out /tmp/mcheck [--peer PEER] [--parallel-1gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from cli_train import parse_lines, peak_reserved_gib

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SRC = os.path.join(REPO, "src")

# Every child's environment: NVLink SHARP (multicast) off in NCCL, torch and NVSHMEM, as
# bench/gpu_session.sh does; unbuffered output so a killed run's log holds its last lines.
CHILD_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1",
             "PYTHONUNBUFFERED": "1",
             # CUDA numbers the cards in nvidia-smi's order, so CUDA_VISIBLE_DEVICES=1 is the
             # card nvidia-smi samples as index 1
             "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}

# "compiled" as a step of the layout's description: "single: compiled, ..." or "... -> compiled"
_COMPILED = re.compile(r"(^|: |-> )compiled")

GLOBAL_BATCH_TOKENS = 512 * 1024  # meshrun's default global batch on GPUs (src/meshrun/defaults.py)
PEER_SEQ = 4096  # the sequence length meshrun chooses for these HF shapes (their context, at most 4096)
PEER_STEPS, PEER_WARMUP = 8, 3

# Rough expected durations, only to pair 1-GPU rows, to set time limits and to skip a row that
# cannot finish before --end-s: start-up, model build and compilation, then the steps at
# about 40% of an H200's bf16 peak.
SETUP_S = 60.0
EFFECTIVE_FLOPS = 4e14
LIMIT_MIN_S, LIMIT_MAX_S, LIMIT_FACTOR = 240.0, 540.0, 2.5
KILL_GRACE_S = 10.0  # SIGTERM to the process group, then SIGKILL this much later


@dataclass(frozen=True)
class Model:
    """One model of the matrix: meshrun's preset (``gpt``: --model-size), an hf_config.py shape
    (``hf``: --model) or --cpu-check's small Llama (``tiny``: --model)."""

    name: str
    source: str
    params_b: float  # published parameter count, billions
    peer_arch: str | None = None  # peerbench.py's --arch of the same shape
    peer_args: tuple[str, ...] = ()

    @property
    def steps(self) -> int:
        return 3 if self.params_b < 3 else 2


MODELS = {m.name: m for m in (
    Model("gpt-124m", "gpt", 0.124),
    Model("gpt-1.3b", "gpt", 1.3),
    Model("llama3.2-1b", "hf", 1.24, "llama3-1b", ("--batch", "4", "--compile")),
    Model("qwen2.5-1.5b", "hf", 1.54),
    Model("gemma-2-2b", "hf", 2.61),
    Model("mistral-7b", "hf", 7.25),
    Model("llama3-8b", "hf", 8.03, "llama3-8b", ("--batch", "2", "--ac")),
)}

# --cpu-check's stand-ins: the flags beyond the suite's own keep them small on the CPU
CPU_EXTRA = ("--seq-len", "32", "--micro-batch", "2")
CPU_MODELS = {m.name: m for m in (
    Model("gpt-tiny", "gpt", 0.003),
    Model("llama-tiny", "tiny", 0.0001, "llama3-tiny", ("--batch", "2")),
)}
TINY_LLAMA = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, vocab_size=256, max_position_embeddings=128)


# Candidate paths of a Hugging Face model (--paths): each a meshrun row with these flags
PATHS: dict[str, tuple[str, ...]] = {
    "default": (),
    "liger-eager": ("--compile", "off"),
    "compiled-liger": ("--compile", "on"),
    "compiled-plain": ("--compile", "on", "--kernels", "plain"),
    "fp8": ("--precision", "fp8"),
    "fp8-rowwise": ("--precision", "fp8-rowwise"),
}


@dataclass
class Job:
    """One run: a meshrun row (of one candidate path) or a peer row of one model on ``gpus`` GPUs."""

    kind: str  # "meshrun" | "peer"
    model: Model
    gpus: int
    argv: list[str]
    log: str
    estimate_s: float
    limit_s: float
    cards: list[int] = field(default_factory=list)  # the cards it runs on (on the CPU: names only)
    path: str = "default"  # one of PATHS

    @property
    def label(self) -> str:
        path = f" [{self.path}]" if self.path != "default" else ""
        return f"{self.model.name}{path} {'(peer) ' if self.kind == 'peer' else ''}on {self.gpus} GPU(s)"


# ---- what the runs print ----------------------------------------------------------------------

# The strategy line and the batch of today's first lines (training/report.py) ...
_STRATEGY = re.compile(r"meshrun train: strategy (?P<desc>.*), on (?P<procs>\d+) (?:GPUs?|CPU process(?:es)?)"
                       r"(?: of \d+ nodes)?, in \S+$")
_BATCH = re.compile(r"meshrun train: .*each a global batch of .*\(micro-batch (?P<micro>\d+) x (?P<accum>\d+) "
                    r"accumulation steps? x (?P<dp>\d+) data-parallel ranks?\)")
# ... and the one first line of earlier versions, the GPU runs recorded before them
_FIRST = re.compile(r"meshrun train: strategy (?P<desc>.*?), (?P<procs>\d+) process\(es\), .*?"
                    r"global batch (?P<micro>\d+) x (?P<accum>\d+) x (?P<dp>\d+)")
# "planner: ddp predicted 45.2 GiB per GPU of 126 GiB usable", or when nothing fits
# "planner: nothing fits; fsdp-full needs the least, 150 GiB of 126 GiB ..." (units: fmt_bytes')
_PLANNER = re.compile(r"planner: (?:(?P<fit>\S+) predicted|nothing fits; (?P<least>\S+) needs the least,) "
                      r"(?P<value>[0-9.]+) (?P<unit>TiB|GiB|MiB|KiB|B)\b")
_GIB = {"TiB": 1024.0, "GiB": 1.0, "MiB": 2.0**-10, "KiB": 2.0**-20, "B": 2.0**-30}
_AC = re.compile(r"\b(\w+) activation checkpointing\b")
_KERNEL_WORDS = ("kernel", "Triton", "cuBLASLt", "Liger", "FlexAttention")
# torch's "CUDA out of memory", and meshrun's line when it halves a micro-batch that did not fit
_OOM = re.compile(r"out of (gpu )?memory", re.IGNORECASE)
_REFIT = "meshrun train: out of GPU memory"


def split_top(text: str) -> list[str]:
    """``text`` cut at " -> " and at ", " outside parentheses: the layout description's steps
    ("DDP, buckets of 100 MB -> compiled") and the kernels appended to it, each alone."""
    parts, depth, cur = [], 0, ""
    i = 0
    while i < len(text):
        ch = text[i]
        depth += (ch == "(") - (ch == ")")
        for sep in (" -> ", ", "):
            if depth == 0 and text.startswith(sep, i):
                parts.append(cur)
                cur, i = "", i + len(sep)
                break
        else:
            cur += ch
            i += 1
    return [p.strip() for p in parts + [cur] if p.strip()]


def short_kernel(part: str) -> str:
    if "FlexAttention" in part:
        return "FlexAttention"
    if "Liger's fused linear cross-entropy" in part:
        return "Liger loss"
    if "Liger" in part:
        return "Liger"
    if "Triton" in part and "loss" in part:
        return "Triton loss"
    if "cuBLASLt" in part:
        return "cuBLASLt GELU"
    return part[:24]


def parse_meshrun(lines: list[str]) -> dict[str, Any]:
    """The layout meshrun chose, the planner's prediction and the figures of its metrics lines."""
    out: dict[str, Any] = {}
    first_i = next((i for i, line in enumerate(lines) if line.startswith("meshrun train: strategy")), None)
    if first_i is not None:
        first = lines[first_i]
        reasons = []
        for line in lines[first_i + 1:]:  # the indented reason lines right under it
            if not line.startswith("  "):
                break
            reasons.append(line.strip())
        out.update(first_line=first, reasons=reasons)
        m = _FIRST.match(first) or _STRATEGY.match(first)
        batch = m if m is not None and "micro" in m.groupdict() else next(
            (b for b in map(_BATCH.match, lines) if b), None)
        if m and batch:
            parts = split_top(m.group("desc"))
            strategy = re.match(r"[\w.+-]+", m.group("desc"))
            ac = _AC.search(m.group("desc"))
            out.update(strategy=strategy.group(0) if strategy else "?", micro=int(batch.group("micro")),
                       accum=int(batch.group("accum")), dp=int(batch.group("dp")),
                       compiled=any(_COMPILED.search(p) for p in parts),
                       ac=ac.group(1) if ac else None,
                       kernels=[short_kernel(p) for p in parts if any(w in p for w in _KERNEL_WORDS)])
        for reason in reasons:
            p = _PLANNER.search(reason)
            if p:
                out.update(planner_predicted_gib=round(float(p.group("value")) * _GIB[p.group("unit")], 2),
                           planner_fits=p.group("fit") is not None,
                           planner_strategy=p.group("fit") or p.group("least"))
                break
    refits = [line for line in lines if line.startswith(_REFIT)]
    if refits:
        out["refits"] = refits
    rows = parse_lines(lines)
    out["metrics_lines"] = len(rows)
    timed = rows[1:]  # the first line's interval includes compilation
    if timed:
        per_gpu = [r["tokens_per_s_per_gpu"] for r in timed if "tokens_per_s_per_gpu" in r]  # (GPUs only)
        out["tokens_per_s_per_gpu"] = round(statistics.median(per_gpu)) if per_gpu else None
        mfus = [r["mfu"] for r in timed if "mfu" in r]
        out["mfu"] = round(statistics.median(mfus), 4) if mfus else None
        out["steps_timed"] = [int(r.get("step", 0)) for r in timed]
        out["all_tokens_per_s_per_gpu"] = [round(r["tokens_per_s_per_gpu"]) for r in rows
                                           if "tokens_per_s_per_gpu" in r]
    reserved = peak_reserved_gib(lines, rows)
    if reserved is not None:
        out["peak_reserved_gib"] = reserved
    return out


def parse_peer(lines: list[str]) -> dict[str, Any]:
    """The peer's one ``RESULT {json}`` line: tokens/s per GPU, MFU, peak memory."""
    for line in reversed(lines):
        if line.startswith("RESULT {"):
            try:
                r = json.loads(line[len("RESULT "):])
            except ValueError:
                break
            return {"peer_result": r, "tokens_per_s_per_gpu": r.get("tok_s_gpu"), "mfu": r.get("mfu"),
                    "peak_allocated_gib": r.get("peak_gib"), "peak_reserved_gib": r.get("reserved_gib"),
                    "micro": r.get("batch"), "accum": 1, "compiled": bool(r.get("compile")), "strategy": "fsdp2"}
    return {}


# ---- running ----------------------------------------------------------------------------------

class SmiSampler:
    """Peak memory.used (MiB) of some cards from nvidia-smi every ``every`` seconds, in a
    thread; peaks stay None where nvidia-smi is absent."""

    def __init__(self, cards: list[int], every: float = 0.5) -> None:
        self.cards, self.every = cards, every
        self.stop = threading.Event()
        self.sampled: dict[str, float] = {}
        self.thread: threading.Thread | None = None
        if cards and shutil.which("nvidia-smi"):
            self.thread = threading.Thread(target=self._loop, daemon=True)

    @property
    def peak(self) -> dict[str, float] | None:
        """MiB per card index; None without a sample (no nvidia-smi, or it never answered)."""
        return dict(self.sampled) or None

    def __enter__(self) -> SmiSampler:
        if self.thread:
            self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        if self.thread:
            self.thread.join(timeout=10)

    def _loop(self) -> None:
        cmd = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
               "-i", ",".join(map(str, self.cards))]
        while True:
            try:
                text = subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.TimeoutExpired):
                text = ""
            for line in text.splitlines():
                index, _, used = line.partition(",")
                try:
                    value = float(used)
                except ValueError:
                    continue
                key = index.strip()
                self.sampled[key] = max(self.sampled.get(key, 0.0), value)
            if self.stop.wait(self.every):
                return


class Suite:
    """The clock, the running process groups and where results go."""

    def __init__(self, out: str, deadline_s: float, end_s: float, cpu: bool, since: float) -> None:
        self.out, self.deadline_s, self.end_s, self.cpu = out, deadline_s, end_s, cpu
        self.t0 = since  # the Unix time the deadlines count from
        self.lock = threading.Lock()
        self.running: dict[int, subprocess.Popen] = {}
        self.results: list[dict[str, Any]] = []
        self.smi_every = 0.5  # seconds between nvidia-smi samples

    def elapsed(self) -> float:
        return time.time() - self.t0

    def say(self, text: str) -> None:
        with self.lock:
            print(f"[{self.elapsed():5.0f} s] {text}", flush=True)

    def limit_for(self, job: Job) -> tuple[float | None, str]:
        """The time limit ``job`` gets now, or None and why it must not start."""
        now = self.elapsed()
        if now > self.deadline_s:
            return None, f"started past --deadline-s {self.deadline_s:.0f} s"
        left = self.end_s - now - KILL_GRACE_S
        if left < min(job.estimate_s, job.limit_s):
            return None, f"{left:.0f} s left before --end-s, expected {job.estimate_s:.0f} s"
        return min(job.limit_s, left), ""

    def env(self, job: Job, parallel: bool) -> dict[str, str]:
        env = dict(os.environ, **CHILD_ENV)
        env["PYTHONPATH"] = SRC + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        if job.cards and not self.cpu:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, job.cards))
            if parallel:  # two compilations side by side: a cache directory each, as gpu_session.sh does
                env["TORCHINDUCTOR_CACHE_DIR"] = f"/tmp/inductor-card{job.cards[0]}"
        return env

    def run(self, job: Job, parallel: bool = False) -> dict[str, Any]:
        """Run ``job`` to its end or its limit; its row."""
        row: dict[str, Any] = {"kind": job.kind, "model": job.model.name, "gpus": job.gpus, "path": job.path,
                               "cards": [] if self.cpu else job.cards,
                               "cmd": shlex.join(job.argv), "log": job.log}
        limit, why = self.limit_for(job)
        if limit is None:
            row.update(status="skipped", ran=False, skipped=why)
            return self.record(row)
        where = "the CPU" if self.cpu else f"card(s) {','.join(map(str, job.cards))}"
        self.say(f"start {job.label} on {where}, limit {limit:.0f} s: {row['cmd']}")
        t0 = time.monotonic()
        timed_out = False
        with open(job.log, "w") as fh, SmiSampler([] if self.cpu else job.cards, self.smi_every) as smi:
            proc = subprocess.Popen(job.argv, stdout=fh, stderr=subprocess.STDOUT, env=self.env(job, parallel),
                                    cwd=REPO, start_new_session=True)
            with self.lock:
                self.running[proc.pid] = proc
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
                rc = end_group(proc)
            finally:
                end_group(proc, grace=0)  # anything it left behind would hold the next row's GPU memory
                with self.lock:
                    self.running.pop(proc.pid, None)
        wall = time.monotonic() - t0
        with open(job.log, errors="replace") as fh:
            lines = fh.read().splitlines()
        parsed = parse_meshrun(lines) if job.kind == "meshrun" else parse_peer(lines)
        if job.kind == "peer" and parsed:
            parsed["ac"] = "full" if "--ac" in job.argv else None
        text = "\n".join(lines)
        ran = rc == 0 and (parsed.get("metrics_lines", 0) > 0 if job.kind == "meshrun" else bool(parsed))
        peaks = smi.peak
        row.update(status="ran" if ran else "failed", ran=ran, rc=rc, timed_out=timed_out, limit_s=round(limit),
                   wall_s=round(wall, 1), **parsed,
                   smi_peak_mib=peaks,
                   smi_peak_gib=round(max(peaks.values()) / 1024, 2) if peaks else None,
                   oom=bool(_OOM.search(text)), traceback="Traceback" in text)
        if not ran:
            row["tail"] = [line[:400] for line in lines[-3:]]
        return self.record(row)

    def record(self, row: dict[str, Any]) -> dict[str, Any]:
        line = json.dumps(row)
        with self.lock:
            print("MATRIX " + line, flush=True)
            with open(os.path.join(self.out, "matrix.jsonl"), "a") as fh:
                fh.write(line + "\n")
            self.results.append(row)
        return row

    def end_all(self) -> None:
        """End every running run (from a signal handler: no lock, which the main thread may hold)."""
        for proc in list(self.running.values()):
            end_group(proc)


def end_group(proc: subprocess.Popen, grace: float = KILL_GRACE_S) -> int:
    """End the process group ``proc`` leads: SIGTERM (torchrun and meshrun's launcher pass it on
    to their workers) and ``grace`` seconds for the leader to exit, then SIGKILL to whatever of
    the group is left; the leader's exit status."""
    if grace:
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    _signal_group(proc, signal.SIGKILL)
    try:
        return proc.wait(timeout=5)
    except subprocess.TimeoutExpired:
        return -signal.SIGKILL


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):  # the group has ended
        pass


# ---- the matrix -------------------------------------------------------------------------------

def _flag(args: tuple[str, ...], name: str) -> int | None:
    """The integer value of ``name`` in ``args`` (``--name V`` or ``--name=V``), else None."""
    for i, arg in enumerate(args):
        if arg == name and i + 1 < len(args) and args[i + 1].isdigit():
            return int(args[i + 1])
        if arg.startswith(name + "=") and arg.split("=", 1)[1].isdigit():
            return int(arg.split("=", 1)[1])
    return None


def estimate_s(kind: str, model: Model, gpus: int, cpu: bool, train_args: tuple[str, ...] = ()) -> float:
    """A run's expected duration (see SETUP_S), a meshrun row's from the steps and global batch
    its --train-args set (else the matrix's steps and meshrun's default batch); the CPU
    stand-ins: a flat guess."""
    if cpu:
        return 30.0
    n = model.params_b * 1e9
    if kind == "meshrun":
        steps, batch = _flag(train_args, "--steps") or model.steps, _flag(train_args, "--global-batch")
        seq = _flag(train_args, "--seq-len") or PEER_SEQ
        tokens = steps * (batch * seq if batch else GLOBAL_BATCH_TOKENS) / gpus
        return SETUP_S + 6 * n * tokens / EFFECTIVE_FLOPS
    batch = _flag(model.peer_args, "--batch")
    if batch is None:
        raise ValueError(f"{model.name}: its peer arguments {model.peer_args} name no --batch")
    recompute = 4 / 3 if "--ac" in model.peer_args else 1.0
    return SETUP_S + 6 * n * (PEER_STEPS + PEER_WARMUP) * batch * PEER_SEQ * recompute / EFFECTIVE_FLOPS


def model_dir(out: str, model: Model) -> str:
    """Write the model's config.json into OUT/models/NAME unless it is there; the directory."""
    path = os.path.join(out, "models", model.name)
    if not os.path.isfile(os.path.join(path, "config.json")):
        if model.source == "tiny":
            import transformers

            transformers.LlamaConfig(**TINY_LLAMA).save_pretrained(path)
        else:
            from hf_config import write_config

            write_config(model.name, path)
    return path


def jobs_for(models: list[Model], gpus: int, out: str, peer: str | None, cpu: bool,
             limit_s: float | None, paths: tuple[str, ...] = ("default",),
             train_args: tuple[str, ...] = ()) -> list[Job]:
    """Each model's meshrun rows (one per path of ``paths`` for a Hugging Face model, the
    default path for meshrun's GPT), then its peer row where it has one and --peer is given."""
    jobs = []
    for model in models:
        source = ["--model-size", model.name] if model.source == "gpt" else ["--model", model_dir(out, model)]
        steps = 3 if cpu else model.steps
        argv = [sys.executable, "-m", "meshrun", "train", *source, "--data", "random", "--steps", str(steps),
                "--log-every", "1", "--nproc", str(gpus), *(CPU_EXTRA if cpu else ()), *train_args]
        runs = [("meshrun", [*argv, *PATHS[p]], f"{model.name}-{gpus}gpu{'' if p == 'default' else '-' + p}.log", p)
                for p in (paths if model.source != "gpt" else ("default",))]
        if peer and model.peer_arch:
            seq, steps, warmup = ("32", "3", "1") if cpu else (str(PEER_SEQ), str(PEER_STEPS), str(PEER_WARMUP))
            # torchrun as a module: the same program, run by the interpreter that runs this
            argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={gpus}", peer,
                    "--mode", "fsdp2", "--arch", model.peer_arch, "--seq", seq, *model.peer_args,
                    "--steps", steps, "--warmup", warmup]
            runs.append(("peer", argv, f"{model.name}-{gpus}gpu-peer.log", "default"))
        for kind, argv, log, path in runs:
            est = estimate_s(kind, model, gpus, cpu, train_args if kind == "meshrun" else ())
            limit = limit_s or min(LIMIT_MAX_S, max(LIMIT_MIN_S, LIMIT_FACTOR * est))
            jobs.append(Job(kind, model, gpus, argv, os.path.join(out, log), est, limit, path=path))
    return jobs


def pairs_by_duration(jobs: list[Job]) -> list[list[Job]]:
    """1-GPU jobs two at a time, neighbours in expected duration (the two 7-8B models
    together, ...), the shortest pairs first: the rows most likely to finish run first, and
    what runs last gets the most of the time left."""
    ranked = sorted(jobs, key=lambda j: -j.estimate_s)
    pairs = [ranked[i:i + 2] for i in range(0, len(ranked), 2)]
    return sorted(pairs, key=lambda p: max(j.estimate_s for j in p))


def run_matrix(suite: Suite, jobs: list[Job], gpus: int, parallel: bool) -> None:
    if not parallel:
        for job in jobs:
            suite.say(f"row: {job.label} (~{job.estimate_s:.0f} s, limit {job.limit_s:.0f} s)")
        for job in jobs:
            job.cards = list(range(gpus))  # (on the CPU only names: no CUDA_VISIBLE_DEVICES, no sampling)
            suite.run(job)
        return
    plan = pairs_by_duration(jobs)
    for pair in plan:
        suite.say("pair: " + " | ".join(f"card {i}: {j.label} (~{j.estimate_s:.0f} s, limit {j.limit_s:.0f} s)"
                                        for i, j in enumerate(pair)))
    for pair in plan:
        threads = []
        for card, job in enumerate(pair):
            job.cards = [card]  # (on the CPU only a name: no CUDA_VISIBLE_DEVICES, no sampling)
            threads.append(threading.Thread(target=suite.run, args=(job, True)))
        for i, t in enumerate(threads):
            if i:
                time.sleep(2)  # the second launcher picks its ports after the first has bound its own
            t.start()
        for t in threads:
            t.join()


# ---- the table --------------------------------------------------------------------------------

def merged(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (kind, model, GPUs): a later row replaces an earlier one, except that a
    skipped row never replaces one that was run."""
    keep: dict[tuple[str, str, int, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["kind"], row["model"], row["gpus"], row.get("path", "default"))
        if key in keep and row.get("status") == "skipped" and keep[key].get("status") != "skipped":
            continue
        keep[key] = row
    order = {name: i for i, name in enumerate([*MODELS, *CPU_MODELS])}
    paths = {name: i for i, name in enumerate(PATHS)}
    return sorted(keep.values(), key=lambda r: (r["gpus"], order.get(r["model"], len(order)), r["kind"] != "meshrun",
                                                paths.get(r.get("path", "default"), len(paths))))


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def ran_cell(row: dict[str, Any]) -> str:
    if row.get("status") == "skipped":
        return "SKIPPED (deadline)"
    if row.get("ran"):
        return "yes (micro-batch halved after OOM)" if row.get("refits") else "yes"
    why = ["timeout" if row.get("timed_out") else f"rc {row.get('rc')}"]
    if row.get("oom"):
        why.append("OOM")
    elif row.get("traceback"):
        why.append("Traceback")
    return "no (" + ", ".join(why) + ")"


def layout_cell(row: dict[str, Any]) -> str:
    if "strategy" not in row:
        return "-"
    micro = f"micro {row['micro']} x {row['accum']}" if row["kind"] == "meshrun" else f"batch {row['micro']}"
    compiled = row.get("compiled") or _COMPILED.search(row.get("first_line", "").split(", 1 process")[0]
                                                      .split(", 2 process")[0])
    parts = [row["strategy"], micro, "compiled" if compiled else "eager"]
    if row.get("ac"):
        parts.append(f"AC {row['ac']}")
    parts.extend(row.get("kernels") or [])
    return ", ".join(parts)


def table(rows: list[dict[str, Any]]) -> str:
    rows = merged(rows)
    peers = {(r["model"], r["gpus"]): r for r in rows if r["kind"] == "peer"}
    out = ["| model | GPUs | ran | layout chosen | tok/s/GPU | MFU | peak reserved GiB | nvidia-smi peak GiB "
           "| planner predicted GiB | peer tok/s/GPU | ratio to peer |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        tps, peer_tps, ratio = r.get("tokens_per_s_per_gpu"), None, None
        if r["kind"] == "meshrun":
            peer = peers.get((r["model"], r["gpus"]))
            peer_tps = peer.get("tokens_per_s_per_gpu") if peer else None
            ratio = tps / peer_tps if tps and peer_tps else None
        mfu = r.get("mfu")
        predicted = r.get("planner_predicted_gib")
        if predicted is not None and r.get("planner_fits") is False:
            predicted = f"{predicted:.1f} (nothing fits)"
        elif predicted is not None:
            predicted = f"{predicted:.1f}"
        path = r.get("path", "default")
        name = r["model"] + (" (peer)" if r["kind"] == "peer" else f" [{path}]" if path != "default" else "")
        out.append(f"| {name} | {r['gpus']} | {ran_cell(r)} | {layout_cell(r)} | {_num(tps, ',.0f')} "
                   f"| {_num(None if mfu is None else 100 * mfu, '.1f')}{'%' if mfu is not None else ''} "
                   f"| {_num(r.get('peak_reserved_gib'), '.1f')} | {_num(r.get('smi_peak_gib'), '.1f')} "
                   f"| {predicted or '-'} | {_num(peer_tps, ',.0f')} | {_num(ratio, '.2f')}{'x' if ratio else ''} |")
    notes = []
    for r in rows:
        if r.get("status") == "failed":
            notes.append(f"{r['model']}{' (peer)' if r['kind'] == 'peer' else ''} on {r['gpus']} GPU(s), "
                         f"{ran_cell(r)}, {r.get('log')}:")
            notes.extend(f"    {line}" for line in r.get("tail", []))
    return "\n".join(out + ([""] + notes if notes else []))


def rerun_hint(rows: list[dict[str, Any]], a: argparse.Namespace) -> str | None:
    """The command that runs this call's skipped rows in another call."""
    skipped = [r["model"] for r in merged(rows) if r.get("status") == "skipped"]
    if not skipped:
        return None
    models = ",".join(dict.fromkeys(skipped))
    cmd = ["python3", "bench/defaults_matrix.py", "--gpus", str(a.gpus), "--models", models]
    cmd += ["--parallel-1gpu"] if a.parallel_1gpu else []
    cmd += ["--peer", a.peer_given] if a.peer_given else []
    cmd += ["--cpu-check"] if a.cpu_check else []
    return "skipped rows, for another call: " + shlex.join(cmd + ["--out", a.out + "-rest"])


# ---- main -------------------------------------------------------------------------------------

def count_gpus() -> int | None:
    """The cards nvidia-smi lists; None without nvidia-smi."""
    try:
        text = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return sum(line.startswith("GPU ") for line in text.splitlines())


def read_rows(files: str) -> list[dict[str, Any]]:
    rows = []
    for path in files.split(","):
        with open(path) as fh:
            rows.extend(json.loads(line) for line in fh if line.strip())
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=int, choices=(1, 2), default=None, help="GPUs per row (--nproc)")
    ap.add_argument("--models", default=None, help=f"comma-separated, default all: {','.join(MODELS)}")
    ap.add_argument("--peer", default=None, help="peerbench.py: also run the plain FSDP2 peer on the Llama shapes")
    ap.add_argument("--out", default="/tmp/meshrun-matrix", help="logs, model configs, matrix.jsonl")
    ap.add_argument("--deadline-s", type=float, default=540, help="start no run after this many seconds (540)")
    ap.add_argument("--end-s", type=float, default=580,
                    help="every run ends by this many seconds: limits are cut to it, and a run whose expected "
                         "duration no longer fits is not started (580)")
    ap.add_argument("--limit-s", type=float, default=None,
                    help=f"every run's time limit (default: {LIMIT_FACTOR} x its expected duration, "
                         f"{LIMIT_MIN_S:.0f}-{LIMIT_MAX_S:.0f} s)")
    ap.add_argument("--parallel-1gpu", action="store_true", help="with --gpus 1: two rows at once, on cards 0 and 1")
    ap.add_argument("--report", default=None, metavar="FILE[,FILE]", help="print the table of matrix.jsonl files")
    ap.add_argument("--paths", default="default", metavar="PATH[,PATH]",
                    help=f"the candidate paths each Hugging Face model runs: {','.join(PATHS)} (default: default)")
    ap.add_argument("--train-args", default="", metavar="FLAGS", help="flags added to every meshrun row")
    ap.add_argument("--cpu-check", action="store_true", help="the suite's machinery on the CPU with tiny stand-ins")
    ap.add_argument("--since", type=float, default=None, metavar="UNIX_TIME",
                    help="count --deadline-s and --end-s from this time (several parts in one call share "
                         "its budget: T=$(date +%%s); ... --since $T; ... --since $T); default: now")
    a = ap.parse_args()
    start = time.time()
    if a.report:
        print(table(read_rows(a.report)))
        return 0
    if a.cpu_check:
        a.gpus = 2  # the stand-ins run 2 processes
        catalogue = CPU_MODELS
    else:
        if a.gpus is None:
            ap.error("--gpus 1|2 is required (or --report, --cpu-check)")
        catalogue = MODELS
    if a.parallel_1gpu and a.gpus != 1 and not a.cpu_check:
        ap.error("--parallel-1gpu runs 1-GPU rows: give --gpus 1")
    names = a.models.split(",") if a.models else list(catalogue)
    unknown = [n for n in names if n not in catalogue]
    if unknown:
        ap.error(f"unknown model(s) {','.join(unknown)}; known: {','.join(catalogue)}")
    paths = tuple(a.paths.split(","))
    if any(p not in PATHS for p in paths):
        ap.error(f"--paths {a.paths}: known paths are {','.join(PATHS)}")
    a.peer_given = a.peer
    peer = os.path.abspath(a.peer) if a.peer else None
    if peer and not os.path.isfile(peer):
        ap.error(f"--peer {a.peer}: no such file")
    if not a.cpu_check:
        needed = 2 if a.parallel_1gpu else a.gpus
        found = count_gpus()
        if found is None:
            print("defaults_matrix: no nvidia-smi here; memory peaks will be missing", flush=True)
        elif found < needed:
            ap.error(f"{needed} GPUs needed, nvidia-smi lists {found}")
    a.out = os.path.abspath(a.out)
    os.makedirs(a.out, exist_ok=True)

    suite = Suite(a.out, a.deadline_s, a.end_s, cpu=a.cpu_check, since=a.since or start)

    def on_signal(signum: int, _frame: Any) -> None:  # the suite's own time is up: end the runs first
        suite.end_all()
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    jobs = jobs_for([catalogue[n] for n in names], a.gpus, a.out, peer, a.cpu_check, a.limit_s, paths,
                    tuple(shlex.split(a.train_args)))
    run_matrix(suite, jobs, a.gpus, a.parallel_1gpu)
    print(f"\n{len(suite.results)} row(s) in {suite.elapsed():.0f} s; {a.out}/matrix.jsonl\n", flush=True)
    print(table(suite.results), flush=True)
    hint = rerun_hint(suite.results, a)
    if hint:
        print("\n" + hint, flush=True)
    return 0 if all(r.get("ran") for r in suite.results) else 1


if __name__ == "__main__":
    sys.exit(main())
