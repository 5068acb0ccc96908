"""LoRA fine-tuning speed: `meshrun train --lora` against Hugging Face's Trainer with PEFT, on
the same model, the same packed chat sequences in the same order, the same GPUs, in one call.

On a GPU host, from the repository root (Llama-3-8B's shape, 100 steps of 2 sequences of 4,096
tokens per GPU); by the rough estimates below each GPU count's part takes about 7 minutes (the
weights written, the data made, each trainer's start and steps), so each gets a call of its own:

    python3 bench/lora_bench.py --gpus 1 --out $OUT/g1
    python3 bench/lora_bench.py --gpus 2 --out $OUT/g2
    python3 bench/lora_bench.py --report $OUT/g1/lora.jsonl,$OUT/g2/lora.jsonl
    python3 bench/lora_bench.py --cpu-check --out /tmp/lbcheck       # the machinery, on the CPU

What one call does, in OUT:

1. ``chat.jsonl``: synthetic conversations (bench/chat_corpus.py: from the seed alone, a system
   prompt and one to four tasks on lists of made-up words with their exact answers), as many as
   the run reads in one epoch; ``model/``: a byte-level BPE trained on them (``--vocab``) with
   Llama-3's header tokens and a chat template, and the model: ``--arch``'s config.json
   (bench/hf_config.py; ``--layers`` cuts it) and random bf16 weights (norms 1, the rest
   N(0, 0.02)), written once, so both trainers start from the same base (the tokenizer's ids are
   a subset of the model's vocabulary).
2. ``data/``: ``meshrun data prepare chat.jsonl --tokenizer model --val-fraction 0``, what
   ``meshrun train --data chat.jsonl`` prepares into its cache, without the 1% it would hold out
   for a validation the peer has no counterpart of. ``rows.npz``: the peer's rows
   (bench/lora_rows.py): the conversations tokenized and masked by transformers'
   ``apply_chat_template``, packed by meshrun's documented rule, in the order meshrun's sampler
   reads them, and checked equal, row for row, to what meshrun's loader serves from ``data/``
   (the ``DATA`` line).
3. For each GPU count G of ``--gpus``: meshrun, then the peer, on cards 0..G-1:

       python3 -m meshrun train --model OUT/model --data OUT/data --lora 16 --lora-targets all-linear \\
           --seq-len 4096 --steps 100 --global-batch 2G --nproc G --save-every 0 --log-every 1 \\
           --lr 1e-4 --warmup 5 --min-lr-ratio 1 --weight-decay 0 --out OUT/runs/meshrun-gG

   and otherwise meshrun's defaults (strategy, micro-batch, activation checkpointing, compile and
   kernels its own). It has no switch against the final snapshot: with LoRA that holds the
   adapters and their optimizer state only, written after the last timed step. Then
   bench/lora_peer.py (Trainer, PEFT ``LoraConfig(r=16, lora_alpha=32,
   target_modules="all-linear", task_type="CAUSAL_LM")``, bf16, SDPA (``--peer-attn``) with the
   document mask transformers builds from the position ids, the same global batch as micro-batches of
   ``--micro-batch`` per GPU, the same learning rate, warmup, clipping and Adam betas (0.9, 0.95),
   no weight decay): as ``python3 bench/lora_peer.py`` on one GPU, under
   ``accelerate launch --config_file OUT/accelerate-gG.yaml`` on several (FSDP2 where the
   installed accelerate has it, else FSDP1 with use_orig_params: auto wrap of
   LlamaDecoderLayer, full shard, bf16 mixed precision). The peer checkpoints activations
   (Trainer's gradient checkpointing on one GPU, FSDP's on several) exactly when meshrun's
   layout does.
4. One ``LORA {json}`` line per run (also in OUT/lora.jsonl; each run's output in
   OUT/NAME.log): who, GPUs, the median tokens/s per GPU of the steps after ``--skip`` (meshrun's
   metrics.jsonl records, the peer's step times), MFU (meshrun's own; the peer's by meshrun's
   FLOPs per token, so in proportion to their speeds), the peak memory of process 0's GPU
   (allocated and reserved), the first and last step's loss, the layout; then a table with
   meshrun / peer per GPU count.

The losses start from the same base on the same first batch and are both the mean over every
trained token of the global batch, so the first step's losses agree to bf16 rounding. Trainer's
warmup starts at a learning rate of 0, meshrun's at 1/warmup of it.

Every run has a time limit (2.5 x its expected duration, 240-540 s; ``--limit-s`` sets it), at
which its process group is killed. No run starts after ``--deadline-s`` (540) nor when its
expected duration no longer fits before ``--end-s`` (580); those print ``SKIPPED`` and the
command that runs them in another call.

``--cpu-check`` runs the same machinery on the CPU: a 2-layer Llama 64 wide, a tokenizer of 512,
sequences of 64 tokens, 3 steps of one sequence per process on 2 processes (``--gpus 1,2``: on 1,
then 2), both in fp32. meshrun runs DDP; the peer runs under ``accelerate launch`` with the same
FSDP config, which accelerate runs on the CPU as DDP on gloo (MULTI_CPU; the peer's line says
what accelerate made of it).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from typing import Any

import chat_corpus
from defaults_matrix import CHILD_ENV, count_gpus, end_group, parse_meshrun

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
SRC = os.path.join(REPO, "src")
PEER = os.path.join(BENCH, "lora_peer.py")

ARCHES = ("llama3-8b", "llama3.2-1b")  # Llama shapes of hf_config.py: the peer wraps LlamaDecoderLayer
TINY_LLAMA: dict[str, Any] = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=128, max_position_embeddings=128)

# Rough expected durations, to set time limits and skip what cannot finish: loading the
# model, then the steps at about 40% of an H200's bf16 peak; a LoRA step costs the frozen
# weights' forward and input gradients (4 FLOPs per parameter per token), 6 with the forward
# again under activation checkpointing.
SETUP_S = 90.0
EFFECTIVE_FLOPS = 4e14
LIMIT_MIN_S, LIMIT_MAX_S, LIMIT_FACTOR = 240.0, 540.0, 2.5
KILL_GRACE_S = 10.0
TOKENS_PER_CONVERSATION = 200  # fewer than the corpus averages with a 4,096-token BPE (about 290)


@dataclass(frozen=True)
class Settings:
    """What one call runs (the flags, or --cpu-check's stand-ins)."""

    gpus: tuple[int, ...]
    steps: int
    seq: int
    micro: int
    lora_r: int
    lr: float
    warmup: int
    skip: int
    cpu: bool
    params: float  # the model's parameters, for the estimates
    peer_attn: str = "sdpa"  # the peer's attn_implementation

    def global_batch(self, g: int) -> int:
        return g * self.micro


# ---- the model, the corpus, the rows ----------------------------------------------------------

def write_model(out: str, arch: str, layers: int | None, seq: int, vocab: int, cpu: bool,
                seed: int) -> tuple[str, float]:
    """config.json and random bf16 weights drawn from ``seed`` in OUT/model, unless the same are
    there; (directory, parameters). The shapes' weights are drawn by bench/hf_config.py in a
    process of its own, so that this one holds no GPU memory while the runs do. --cpu-check's
    model: the tiny Llama with the tokenizer's vocabulary."""
    import torch
    import transformers
    from hf_config import write_weights

    path = os.path.join(out, "model")
    marker = os.path.join(path, "bench-model.json")
    want = {"arch": "tiny" if cpu else arch, "layers": layers, "seq": seq, "vocab": vocab if cpu else None,
            "seed": seed}
    if os.path.isfile(marker) and json.load(open(marker)) == want:
        config = transformers.AutoConfig.from_pretrained(path)
        print(f"lora_bench: {path} holds the model already", flush=True)
    else:
        shutil.rmtree(path, ignore_errors=True)
        t0 = time.perf_counter()
        # the same seed, the same base in every call: --report's parts compare
        if cpu:
            config = transformers.LlamaConfig(**TINY_LLAMA, vocab_size=vocab)
            config.save_pretrained(path)
            torch.manual_seed(seed)
            write_weights(config, path)
        else:
            cmd = [sys.executable, os.path.join(BENCH, "hf_config.py"), arch, path, "--seq", str(max(seq, 8192)),
                   "--weights", "--seed", str(seed), *(["--layers", str(layers)] if layers else [])]
            res = subprocess.run(cmd, env=child_env(None), timeout=LIMIT_MAX_S)
            if res.returncode:
                raise SystemExit(f"lora_bench: {shlex.join(cmd)} failed (exit {res.returncode})")
            config = transformers.AutoConfig.from_pretrained(path)
        print(f"lora_bench: weights written in {time.perf_counter() - t0:.0f} s", flush=True)
        with open(marker, "w") as f:
            json.dump(want, f)
    from meshrun.modelinfo.hf import build_on_meta

    params = float(sum(p.numel() for p in build_on_meta(config).parameters()))
    return path, params


def write_data(out: str, model: str, s: Settings, vocab: int, seed: int, conversations: int | None,
               limit_s: float) -> dict[str, Any]:
    """chat.jsonl, the tokenizer into ``model``, meshrun's prepared data/ and the peer's
    rows.npz, enough for the largest GPU count's run; the DATA line's facts. More conversations
    are made (twice as many each time) until they pack into enough sequences."""
    import lora_rows
    import numpy as np

    corpus, data, rows_file = (os.path.join(out, name) for name in ("chat.jsonl", "data", "rows.npz"))
    count = s.steps * s.global_batch(max(s.gpus))
    # one epoch holds every row the run reads; a sequence more per rank for meshrun's last partial batch
    need = count + max(s.gpus) * s.micro
    n = conversations or max(400, math.ceil(need * s.seq / TOKENS_PER_CONVERSATION * 1.1))
    while True:
        chars = chat_corpus.write_corpus(corpus, n, seed)
        chat_corpus.write_tokenizer(model, corpus, vocab, max(s.seq, 8192))
        from transformers import AutoTokenizer

        pad = AutoTokenizer.from_pretrained(model).eos_token_id  # meshrun pads with the end-of-document token
        try:
            rows = lora_rows.build(model, corpus, s.seq, pad, count, seed)
        except ValueError as exc:
            if conversations:
                raise SystemExit(f"lora_bench: --conversations {conversations}: {exc} "
                                 "(hint: more conversations)") from None
            print(f"lora_bench: {exc}; making {2 * n} conversations", flush=True)
            n *= 2
            continue
        if rows["sequences"] >= need:
            break
        n *= 2
    np.savez(rows_file, **{key: rows[key] for key in ("input_ids", "labels", "position_ids")})
    shutil.rmtree(data, ignore_errors=True)
    cmd = [sys.executable, "-m", "meshrun", "data", "prepare", corpus, "--tokenizer", model, "--out", data,
           "--val-fraction", "0"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=child_env(None), timeout=limit_s)
    if res.returncode:
        raise SystemExit(f"lora_bench: {shlex.join(cmd)} failed (exit {res.returncode}):\n{res.stdout}{res.stderr}")
    check = lora_rows.compare(rows, data, s.seq)
    return {"conversations": n, "characters": chars, "examples": rows["examples"], "sequences": rows["sequences"],
            "rows": count, "trained_tokens_in_rows": rows["trained_tokens"], **check,
            "prepared": next((line for line in (res.stdout + res.stderr).splitlines()
                              if line.startswith("meshrun data: wrote")), None)}


def write_accelerate_config(out: str, g: int, ac: bool, cpu: bool) -> tuple[str, int]:
    """OUT/accelerate-gG.yaml, FSDP as Hugging Face's guides set it up for PEFT: FSDP2 where
    this accelerate has it (else FSDP1 with use_orig_params, which PEFT's frozen weights need),
    auto wrap of LlamaDecoderLayer, full shard, bf16 mixed precision (fp32 on the CPU), the model
    read on process 0 and sent to the others; activation checkpointing by FSDP when ``ac``."""
    import yaml
    from accelerate.utils import FullyShardedDataParallelPlugin

    version = 2 if "fsdp_version" in getattr(FullyShardedDataParallelPlugin, "__dataclass_fields__", {}) else 1
    fsdp: dict[str, Any] = {"fsdp_version": version, "fsdp_auto_wrap_policy": "TRANSFORMER_BASED_WRAP",
                            "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
                            "fsdp_state_dict_type": "SHARDED_STATE_DICT", "fsdp_cpu_ram_efficient_loading": True,
                            "fsdp_offload_params": False, "fsdp_activation_checkpointing": ac}
    if version == 2:
        fsdp["fsdp_reshard_after_forward"] = True  # full shard
    else:
        fsdp.update(fsdp_sharding_strategy="FULL_SHARD", fsdp_use_orig_params=True, fsdp_sync_module_states=True,
                    fsdp_backward_prefetch="BACKWARD_PRE", fsdp_forward_prefetch=False)
    config = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "FSDP",
              "mixed_precision": "no" if cpu else "bf16", "num_machines": 1, "num_processes": g, "machine_rank": 0,
              "main_training_function": "main", "use_cpu": cpu, "fsdp_config": fsdp}
    path = os.path.join(out, f"accelerate-g{g}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f, sort_keys=False)
    return path, version


# ---- running ----------------------------------------------------------------------------------

def child_env(gpus: int | None, cpu: bool = False) -> dict[str, str]:
    """A run's environment: src/ and bench/ first on PYTHONPATH, CHILD_ENV, cards 0..G-1 (none
    for the CPU check, on a GPU host too)."""
    env = dict(os.environ, **CHILD_ENV)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (SRC, BENCH, env.get("PYTHONPATH")) if p)
    if cpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    elif gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, range(gpus)))
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def estimate_s(s: Settings, ac: bool) -> float:
    """A run's expected duration on an H200 (see SETUP_S); the CPU check: a flat guess."""
    if s.cpu:
        return 40.0
    tokens = s.steps * s.micro * s.seq  # per GPU
    return SETUP_S + (6 if ac else 4) * s.params * tokens / EFFECTIVE_FLOPS


class Clock:
    """The call's clock, the running process group, and the limits runs get."""

    def __init__(self, deadline_s: float, end_s: float, limit_s: float | None) -> None:
        self.t0, self.deadline_s, self.end_s, self.limit_s = time.time(), deadline_s, end_s, limit_s
        self.running: subprocess.Popen | None = None

    def elapsed(self) -> float:
        return time.time() - self.t0

    def say(self, text: str) -> None:
        print(f"[{self.elapsed():5.0f} s] {text}", flush=True)

    def limit(self, estimate: float) -> tuple[float | None, str]:
        """The time limit a run expected to take ``estimate`` s gets now, or None and why not."""
        now = self.elapsed()
        if now > self.deadline_s:
            return None, f"started past --deadline-s {self.deadline_s:.0f} s"
        left = self.end_s - now - KILL_GRACE_S
        limit = self.limit_s or min(LIMIT_MAX_S, max(LIMIT_MIN_S, LIMIT_FACTOR * estimate))
        if left < min(estimate, limit):
            return None, f"{left:.0f} s left before --end-s, expected {estimate:.0f} s"
        return min(limit, left), ""

    def run(self, argv: list[str], env: dict[str, str], log: str, limit: float) -> tuple[int, bool, float]:
        """``argv`` in a process group of its own to its end or ``limit``: (exit status, timed
        out, wall seconds)."""
        t0 = time.monotonic()
        timed_out = False
        with open(log, "w") as fh:
            proc = subprocess.Popen(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=REPO,
                                    start_new_session=True)
            self.running = proc
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                timed_out = True
                rc = end_group(proc, KILL_GRACE_S)
            finally:
                end_group(proc, grace=0)  # what it left behind would hold the next run's GPU memory
                self.running = None
        return rc, timed_out, time.monotonic() - t0


def meshrun_argv(s: Settings, g: int, model: str, data: str, run_dir: str) -> list[str]:
    argv = [sys.executable, "-m", "meshrun", "train", "--model", model, "--data", data, "--lora", str(s.lora_r),
            "--lora-targets", "all-linear", "--seq-len", str(s.seq), "--steps", str(s.steps),
            "--global-batch", str(s.global_batch(g)), "--nproc", str(g), "--save-every", "0", "--log-every", "1",
            "--lr", str(s.lr), "--warmup", str(s.warmup), "--min-lr-ratio", "1", "--weight-decay", "0",
            "--out", run_dir]
    if s.cpu:  # on the CPU meshrun's micro-batch is 8 unless given
        argv += ["--micro-batch", str(s.micro)]
    return argv


def peer_argv(s: Settings, g: int, model: str, rows: str, result: str, trainer_dir: str, trainer_ac: bool,
              accelerate_yaml: str | None) -> list[str]:
    """The peer's command: alone on one GPU, under ``accelerate launch`` on several;
    ``trainer_ac``: Trainer's gradient checkpointing (FSDP's is the config's)."""
    args = [PEER, "--model", model, "--rows", rows, "--steps", str(s.steps), "--micro-batch", str(s.micro),
            "--lora-r", str(s.lora_r), "--lora-alpha", str(2 * s.lora_r), "--lr", str(s.lr),
            "--warmup", str(s.warmup), "--skip", str(s.skip), "--attn", s.peer_attn, "--out", trainer_dir,
            "--result", result, *(["--activation-checkpointing"] if trainer_ac else [])]
    if accelerate_yaml is None:
        return [sys.executable, *args]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", accelerate_yaml,
            "--num_processes", str(g), "--main_process_port", str(free_port()), *args]


def meshrun_figures(lines: list[str], run_dir: str, s: Settings, g: int) -> dict[str, Any]:
    """The layout of meshrun's first lines, and from its metrics.jsonl the losses, the median
    tokens/s per process of the steps after ``skip`` and process 0's peak memory."""
    out: dict[str, Any] = {}
    first = parse_meshrun(lines)
    for key in ("first_line", "strategy", "micro", "accum", "compiled", "ac", "kernels"):
        if key in first:
            out[key] = first[key]
    path = os.path.join(run_dir, "metrics.jsonl")
    records = []
    if os.path.isfile(path):
        with open(path) as f:
            records = [r for r in map(json.loads, f) if "loss" in r and "tokens_per_s" in r]
    if not records:
        return out
    timed = records[s.skip:] or records[-1:]
    per_process = [r["tokens_per_s"] / g for r in timed]
    mfus = [r["mfu"] for r in timed if r.get("mfu") is not None]
    allocated = [r["peak_mem_bytes"] for r in records if r.get("peak_mem_bytes")]
    reserved = [r["peak_reserved_bytes"] for r in records if r.get("peak_reserved_bytes")]
    out.update(losses=[r["loss"] for r in records], steps_logged=len(records),
               step_tokens_per_s=[round(r["tokens_per_s"] / g) for r in records],
               tokens_per_s_per_process=round(statistics.median(per_process)),
               mfu=round(statistics.median(mfus), 4) if mfus else None,
               peak_allocated_gib=round(max(allocated) / 2**30, 2) if allocated else None,
               peak_reserved_gib=round(max(reserved) / 2**30, 2) if reserved else None)
    return out


def peer_figures(result: str) -> dict[str, Any]:
    if not os.path.isfile(result):
        return {}
    with open(result) as f:
        r = json.loads(f.read())
    keep = ("layout", "distributed_type", "fsdp_units", "attn", "activation_checkpointing",
            "tokens_per_s_per_process", "step_tokens_per_s", "losses", "peak_allocated_gib", "peak_reserved_gib",
            "trainable_params", "versions", "train_wall_s")
    return {k: r[k] for k in keep if k in r}


def one_run(clock: Clock, who: str, g: int, cpu: bool, argv: list[str], log: str, estimate: float,
            figures: Any) -> dict[str, Any]:
    """Run ``argv`` on cards 0..G-1 (or skip it) and its row: the figures ``figures(lines)``
    reads, and the run's facts."""
    row: dict[str, Any] = {"who": who, "gpus": g, "cmd": shlex.join(argv), "log": log}
    limit, why = clock.limit(estimate)
    if limit is None:
        clock.say(f"SKIPPED {who} on {g}: {why}")
        return {**row, "status": "skipped", "ran": False, "skipped": why}
    clock.say(f"start {who} on {g} (expected {estimate:.0f} s, limit {limit:.0f} s): {row['cmd']}")
    rc, timed_out, wall = clock.run(argv, child_env(g, cpu), log, limit)
    with open(log, errors="replace") as f:
        lines = f.read().splitlines()
    row.update(figures(lines))
    ran = rc == 0 and bool(row.get("losses"))
    row.update(status="ran" if ran else "failed", ran=ran, rc=rc, timed_out=timed_out, wall_s=round(wall, 1),
               limit_s=round(limit))
    if not ran:
        row["tail"] = [line[:400] for line in lines[-4:]]
    return row


def finish(row: dict[str, Any], s: Settings, data: dict[str, Any], out: str) -> dict[str, Any]:
    """The row's summary fields, its LORA line and its line in OUT/lora.jsonl."""
    losses = row.get("losses") or []
    row.update(cpu=s.cpu, steps=s.steps, seq=s.seq, micro_batch_per_gpu=s.micro,
               global_batch=s.global_batch(row["gpus"]), lora_r=s.lora_r, skip=s.skip,
               loss_first=losses[0] if losses else None, loss_last=losses[-1] if losses else None,
               same_rows=data.get("same"))
    if not s.cpu:
        row["tokens_per_s_per_gpu"] = row.get("tokens_per_s_per_process")
    line = json.dumps(row)
    print("LORA " + line, flush=True)
    with open(os.path.join(out, "lora.jsonl"), "a") as f:
        f.write(line + "\n")
    return row


def run_gpu_count(clock: Clock, s: Settings, g: int, model: str, out: str, data: dict[str, Any]) -> list[dict]:
    """meshrun then the peer on G GPUs (on the CPU: G processes)."""
    where = f"{g} CPU processes" if s.cpu else f"{g} GPU(s)"
    rows = []
    run_dir = os.path.join(out, "runs", f"meshrun-g{g}")
    shutil.rmtree(run_dir, ignore_errors=True)  # a new run, not a resume of an earlier call's
    argv = meshrun_argv(s, g, model, os.path.join(out, "data"), run_dir)
    mesh = one_run(clock, "meshrun", g, s.cpu, argv, os.path.join(out, f"meshrun-g{g}.log"), estimate_s(s, False),
                   lambda lines: meshrun_figures(lines, run_dir, s, g))
    rows.append(finish(mesh, s, data, out))
    # the peer checkpoints activations where meshrun's layout does (a failed run's layout unknown: none)
    ac = bool(mesh.get("ac")) and mesh.get("ac") != "no"
    result = os.path.join(out, f"peer-g{g}.json")
    if os.path.exists(result):
        os.remove(result)
    # on the CPU accelerate runs the FSDP config as DDP (MULTI_CPU): checkpointing is then Trainer's
    fsdp_ac = ac and g > 1 and not s.cpu
    yaml_path, version = write_accelerate_config(out, g, fsdp_ac, s.cpu) if g > 1 else (None, None)
    argv = peer_argv(s, g, model, os.path.join(out, "rows.npz"), result, os.path.join(out, "runs", f"peer-g{g}"),
                     ac and not fsdp_ac, yaml_path)
    peer = one_run(clock, "peer", g, s.cpu, argv, os.path.join(out, f"peer-g{g}.log"), estimate_s(s, ac),
                   lambda lines: peer_figures(result))
    peer["activation_checkpointing_as_meshrun"] = ac
    if version is not None:
        peer["accelerate_fsdp_version"] = version
    if mesh.get("mfu") and mesh.get("tokens_per_s_per_process") and peer.get("tokens_per_s_per_process"):
        peer["mfu"] = round(mesh["mfu"] * peer["tokens_per_s_per_process"] / mesh["tokens_per_s_per_process"], 4)
    rows.append(finish(peer, s, data, out))
    clock.say(f"done on {where}")
    return rows


# ---- the table --------------------------------------------------------------------------------

def merged(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (who, GPUs): a later row replaces an earlier one, but a skipped row never
    replaces one that ran."""
    keep: dict[tuple[str, int], dict[str, Any]] = {}
    for row in rows:
        key = (row["who"], row["gpus"])
        if key in keep and row.get("status") == "skipped" and keep[key].get("status") != "skipped":
            continue
        keep[key] = row
    return sorted(keep.values(), key=lambda r: (r["gpus"], r["who"] != "meshrun"))


def _num(value: Any, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def layout_cell(row: dict[str, Any]) -> str:
    if row["who"] == "meshrun":
        if "strategy" not in row:
            return "-"
        parts = [row["strategy"], f"micro {row.get('micro')} x {row.get('accum')}",
                 "compiled" if row.get("compiled") else "eager"]
        if row.get("ac"):
            parts.append(f"AC {row['ac']}")
        return ", ".join(parts + list(row.get("kernels") or []))
    if "layout" not in row:
        return "-"
    parts = [row["layout"], f"micro {row.get('micro_batch_per_gpu')}", f"attn {row.get('attn')}"]
    if row.get("activation_checkpointing"):
        parts.append(f"AC ({row['activation_checkpointing']})")
    return ", ".join(parts)


def ran_cell(row: dict[str, Any]) -> str:
    if row.get("status") == "skipped":
        return "SKIPPED"
    if row.get("ran"):
        return "yes"
    return "no (" + ("timeout" if row.get("timed_out") else f"rc {row.get('rc')}") + ")"


def table(rows: list[dict[str, Any]]) -> str:
    rows = merged(rows)
    cpu = any(r.get("cpu") for r in rows)
    speed, gpus = ("tok/s per process", "processes (CPU)") if cpu else ("tok/s/GPU", "GPUs")
    out = [f"| {gpus} | who | ran | layout | {speed} | MFU | peak alloc GiB | peak reserved GiB | loss first "
           "| loss last |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        mfu = r.get("mfu")
        out.append(f"| {r['gpus']} | {r['who']} | {ran_cell(r)} | {layout_cell(r)} "
                   f"| {_num(r.get('tokens_per_s_per_process'), ',.0f')} "
                   f"| {_num(None if mfu is None else 100 * mfu, '.1f')}{'%' if mfu is not None else ''} "
                   f"| {_num(r.get('peak_allocated_gib'), '.1f')} | {_num(r.get('peak_reserved_gib'), '.1f')} "
                   f"| {_num(r.get('loss_first'), '.4f')} | {_num(r.get('loss_last'), '.4f')} |")
    by = {(r["who"], r["gpus"]): r for r in rows}
    out += ["", f"| {gpus} | meshrun {speed} | peer {speed} | meshrun / peer | same rows |", "|---|---|---|---|---|"]
    for g in sorted({r["gpus"] for r in rows}):
        mesh, peer = by.get(("meshrun", g), {}), by.get(("peer", g), {})
        a, b = mesh.get("tokens_per_s_per_process"), peer.get("tokens_per_s_per_process")
        ratio = a / b if a and b else None
        same = mesh.get("same_rows", peer.get("same_rows"))
        out.append(f"| {g} | {_num(a, ',.0f')} | {_num(b, ',.0f')} | {_num(ratio, '.2f')}{'x' if ratio else ''} "
                   f"| {'-' if same is None else 'yes' if same else 'NO'} |")
    notes = []
    for r in rows:
        if r.get("status") == "failed":
            notes.append(f"{r['who']} on {r['gpus']}: {ran_cell(r)}, {r.get('log')}:")
            notes.extend(f"    {line}" for line in r.get("tail", []))
        elif r.get("status") == "skipped":
            notes.append(f"{r['who']} on {r['gpus']} skipped ({r.get('skipped')})")
    return "\n".join(out + ([""] + notes if notes else []))


def read_rows(files: str) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for path in files.split(","):
        with open(path) as fh:
            rows.extend(json.loads(line) for line in fh if line.strip())
    return rows


# ---- main -------------------------------------------------------------------------------------

def parse_gpus(text: str) -> tuple[int, ...]:
    try:
        gpus = tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma list of GPU counts, e.g. 1,2") from None
    if not gpus or any(g < 1 for g in gpus):
        raise argparse.ArgumentTypeError(f"{text!r}: GPU counts are 1 or more")
    return gpus


def rerun(args: list[str], g: int, out: str) -> str:
    """The command that runs this call's G-GPU part in another call, into OUT-gG."""
    kept, drop = [], False
    for arg in args:
        if drop:
            drop = False
        elif arg in ("--gpus", "--out"):
            drop = True
        elif not arg.startswith(("--gpus=", "--out=")):
            kept.append(arg)
    return shlex.join(["python3", "bench/lora_bench.py", *kept, "--gpus", str(g), "--out", f"{out}-g{g}"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gpus", type=parse_gpus, default=None, help="GPU counts, run in turn (e.g. 1,2)")
    ap.add_argument("--arch", choices=ARCHES, default="llama3-8b", help="the model's shape (default llama3-8b)")
    ap.add_argument("--layers", type=int, default=None, help="keep the shape with fewer layers")
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--micro-batch", type=int, default=2, help="sequences per GPU per step (default 2)")
    ap.add_argument("--lora-r", type=int, default=16, help="LoRA rank (alpha: twice it)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--warmup", type=int, default=5, help="learning-rate warmup steps, both trainers (default 5)")
    ap.add_argument("--skip", type=int, default=5, help="steps left out of the median tokens/s (default 5)")
    ap.add_argument("--peer-attn", default="sdpa",
                    help="the peer's attn_implementation: sdpa (default), flash_attention_2 (needs flash-attn), "
                         "flex_attention")
    ap.add_argument("--vocab", type=int, default=4096, help="the tokenizer's vocabulary (default 4096)")
    ap.add_argument("--conversations", type=int, default=None, help="default: enough for the run's rows")
    ap.add_argument("--seed", type=int, default=0, help="the corpus' and meshrun's data order's seed (default 0)")
    ap.add_argument("--out", default="/tmp/meshrun-lora", help="model, data, logs, lora.jsonl")
    ap.add_argument("--deadline-s", type=float, default=540, help="start no run after this many seconds (540)")
    ap.add_argument("--end-s", type=float, default=580, help="every run ends by this many seconds (580)")
    ap.add_argument("--limit-s", type=float, default=None, help="every run's time limit (default: 2.5 x its "
                    f"expected duration, {LIMIT_MIN_S:.0f}-{LIMIT_MAX_S:.0f} s)")
    ap.add_argument("--report", default=None, metavar="FILE[,FILE]", help="print the table of lora.jsonl files")
    ap.add_argument("--cpu-check", action="store_true",
                    help="the machinery on the CPU with a tiny stand-in (--gpus: processes, default 2)")
    a = ap.parse_args()
    if a.report:
        missing = [path for path in a.report.split(",") if not os.path.isfile(path)]
        if missing:
            ap.error(f"--report {a.report}: no file {', '.join(missing)} (hint: the lora.jsonl of each call's --out)")
        print(table(read_rows(a.report)))
        return 0
    if a.cpu_check:
        s = Settings(gpus=a.gpus or (2,), steps=3, seq=64, micro=1, lora_r=a.lora_r, lr=a.lr, warmup=1, skip=1,
                     cpu=True, params=0.0, peer_attn=a.peer_attn)
        vocab = 512
    else:
        if a.gpus is None:
            ap.error("--gpus is required (e.g. --gpus 1), or --report, --cpu-check")
        found = count_gpus()
        if not found or found < max(a.gpus):
            ap.error(f"--gpus {','.join(map(str, a.gpus))}: nvidia-smi lists {found or 'no'} GPU(s) here "
                     "(hint: --cpu-check runs the machinery on the CPU)")
        s = Settings(gpus=a.gpus, steps=a.steps, seq=a.seq, micro=a.micro_batch, lora_r=a.lora_r, lr=a.lr,
                     warmup=a.warmup, skip=a.skip, cpu=False, params=0.0, peer_attn=a.peer_attn)
        vocab = a.vocab
    for name, value in (("--steps", s.steps), ("--seq", s.seq), ("--micro-batch", s.micro), ("--lora-r", s.lora_r),
                        ("--layers", 1 if a.layers is None else a.layers)):
        if value < 1:
            ap.error(f"{name} {value}: must be 1 or more")
    if s.skip >= s.steps:
        ap.error(f"--skip {s.skip}: leaves none of the {s.steps} steps to time (hint: fewer than --steps)")
    out = os.path.abspath(a.out)
    os.makedirs(os.path.join(out, "runs"), exist_ok=True)
    clock = Clock(a.deadline_s, a.end_s, a.limit_s)

    def on_signal(signum: int, _frame: Any) -> None:  # the call's own time is up: end the run first
        if clock.running is not None:
            end_group(clock.running)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    model, params = write_model(out, a.arch, a.layers, s.seq, vocab, s.cpu, a.seed)
    s = replace(s, params=params)
    clock.say(f"model {model}: {params / 1e6:,.1f}M parameters")
    data = write_data(out, model, s, vocab, a.seed, a.conversations, LIMIT_MAX_S)
    print("DATA " + json.dumps(data), flush=True)
    if not data["same"]:
        print("lora_bench: the peer's rows differ from meshrun's (DATA's rows_differing): the two trainers do not "
              "train on the same sequences", flush=True)
    results: list[dict[str, Any]] = []
    for g in s.gpus:
        results += run_gpu_count(clock, s, g, model, out, data)
    print(f"\n{len(results)} run(s) in {clock.elapsed():.0f} s; {out}/lora.jsonl\n", flush=True)
    print(table(results), flush=True)
    skipped = sorted({r["gpus"] for r in results if r.get("status") == "skipped"})
    if skipped:
        print("\nskipped, for another call: " + " ; ".join(rerun(sys.argv[1:], g, out) for g in skipped), flush=True)
    return 0 if all(r.get("ran") for r in results) and data["same"] else 1


if __name__ == "__main__":
    sys.exit(main())
