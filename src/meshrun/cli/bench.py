"""`meshrun bench comm|matmul|train`: measure this cluster against its physical limits."""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from typing import Any

from ..cluster.gpus import count_visible_gpus
from ..cluster.options import parse_int
from ..errors import bad_value
from ..launch.build import build
from ..launch.command import Command, LaunchSpec
from ..launch.node import check_ports, prepare_network, run_job
from ..units import fmt_bytes, parse_bytes
from ..vocab import GPT_PRESETS
from .options import add_option, add_rdzv_timeout_option, add_topology_options, topology_from_args, waits_from_args

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast")
BENCH_HELP = """\
Measure the cluster, launched on the topology meshrun detects (all GPUs here, or 2 CPU
processes with gloo; on a cluster run it on every node like meshrun launch):

  comm    all_reduce, all_gather, reduce_scatter, broadcast over sizes (default 1 KiB..1 GiB on
          GPUs, ..64 MiB on CPU): time, algorithm and bus bandwidth (nccl-tests' conventions)
  matmul  bf16 and fp32 TFLOP/s of an n x n matmul on every GPU (fp32 on CPU)
  train   a short GPT training run with meshrun's defaults: tokens/s per GPU and MFU

examples:
  meshrun bench comm                              # every collective, every size
  meshrun bench comm --ops all_reduce --sizes 1GiB --json
  meshrun bench matmul --n 8192
  meshrun bench train --model gpt-124m --micro-batch 16
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="collectives, matmul and a training step, against the hardware's limits",
                       description=BENCH_HELP, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kind", metavar="KIND", choices=("comm", "matmul", "train"), help="comm, matmul or train")
    add_topology_options(p)
    g = p.add_argument_group("what to measure")
    add_option(g, "--ops", metavar="OP,OP", help=f"comm: some of {', '.join(OPS)} (default all)")
    add_option(g, "--sizes", metavar="MIN:MAX|S,S", help="comm: 1KiB:1GiB (x4 steps) or a list (default by device)")
    add_option(g, "--min-time", metavar="S", default="0.2", help="seconds of repetitions per measurement (default 0.2)")
    add_option(g, "--n", metavar="N", help="matmul: matrix size (default 8192 on GPU, 1024 on CPU)")
    add_option(g, "--model", metavar="PRESET", help="train: GPT preset (default gpt-124m on GPU, gpt-tiny on CPU)")
    add_option(g, "--seq-len", metavar="T", help="train: sequence length (default 1024 on GPU, 64 on CPU)")
    add_option(g, "--micro-batch", metavar="B", help="train: per-GPU batch (default 16 on GPU, 4 on CPU)")
    add_option(g, "--steps", metavar="N", default="10", help="train: measured steps (default 10)")
    add_option(g, "--json", action="store_true", help="print one JSON object")
    add_rdzv_timeout_option(g)
    p.set_defaults(func=cmd_bench)


def _sizes(text: str | None, gpu: bool) -> list[int]:
    if not text:
        lo, hi = 1024, (2**30 if gpu else 64 * 2**20)
    elif ":" in text:
        a, b = text.split(":", 1)
        lo, hi = parse_bytes(a, "--sizes"), parse_bytes(b, "--sizes")
        if lo > hi:
            raise bad_value("--sizes", text, "min is above max", "e.g. 1KiB:1GiB")
    else:
        return [parse_bytes(s, "--sizes") for s in text.split(",") if s]
    out, size = [], lo
    while size <= hi:
        out.append(size)
        size *= 4
    return out


def _memory(gpu: bool) -> int | None:
    """One GPU's memory (None when it cannot be read), or this machine's."""
    if gpu:
        from ..cluster.gpus import detect_gpu_memory

        return detect_gpu_memory()
    from ..cluster.gpus import host_memory

    return host_memory()


def options(ns: argparse.Namespace, gpu: bool) -> dict[str, Any]:
    def num(name: str, default: int) -> int:
        raw = getattr(ns, name)
        value = default if raw is None else parse_int(str(raw), "--" + name.replace("_", "-"))
        if value < 1:
            raise bad_value("--" + name.replace("_", "-"), raw, "must be >= 1")
        return value

    try:
        min_time = float(ns.min_time)
    except ValueError:
        raise bad_value("--min-time", ns.min_time, "not a number") from None
    if not 0 < min_time <= 60:
        raise bad_value("--min-time", ns.min_time, "must be in (0, 60] seconds")
    common = {"warmup": 3, "min_time": min_time, "max_iters": 1000}
    if ns.kind == "comm":
        ops = [o.strip() for o in (ns.ops or ",".join(OPS)).split(",") if o.strip()]
        bad = [o for o in ops if o not in OPS]
        if bad:
            raise bad_value("--ops", ns.ops, f"unknown collective {bad[0]!r}", f"some of {', '.join(OPS)}")
        sizes = _sizes(ns.sizes, gpu)
        memory = _memory(gpu)
        # a collective holds its buffer and, gathering, one per rank: a quarter of a device's memory
        if memory is not None and max(sizes) > memory // 4:
            raise bad_value("--sizes", ns.sizes, f"{fmt_bytes(max(sizes))} is more than a quarter of "
                            f"{'a GPU' if gpu else 'this machine'}'s {fmt_bytes(memory)}, which a collective of it "
                            "needs at the least", f"at most {fmt_bytes(memory // 4)}")
        return {**common, "ops": ops, "sizes": sizes}
    if ns.kind == "matmul":
        n = num("n", 8192 if gpu else 1024)
        memory = _memory(gpu)
        width = 2 if gpu else 4  # bf16 on GPUs, fp32 on the CPU: three n x n matrices
        if memory is not None and 3 * n * n * width > memory:
            most = math.isqrt(memory // (3 * width))
            raise bad_value("--n", ns.n, f"three {n} x {n} matrices need {fmt_bytes(3 * n * n * width)}, more than "
                            f"{'a GPU' if gpu else 'this machine'}'s {fmt_bytes(memory)}", f"--n {most} or less")
        return {**common, "n": n}
    model = ns.model or ("gpt-124m" if gpu else "gpt-tiny")
    if model not in GPT_PRESETS:
        raise bad_value("--model", model, "not a GPT preset", f"one of {', '.join(GPT_PRESETS)}")
    return {"model": model, "seq": num("seq_len", 1024 if gpu else 64), "micro": num("micro_batch", 16 if gpu else 4),
            "steps": num("steps", 10), "warmup": 3}


def cmd_bench(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    gpus = count_visible_gpus(env)
    opts = options(ns, gpus > 0)
    topo, _ = topology_from_args(ns, env, gpus, fixed_nodes="meshrun bench")
    waits = waits_from_args(ns, env)
    # Rank 0 writes its result into a directory only this user can enter, under a name nobody
    # can guess in advance: a fixed or pid-derived path in a shared /tmp could be planted first.
    private = tempfile.mkdtemp(prefix="meshrun-bench-")
    out = os.path.join(private, "result.json")
    try:
        spec = LaunchSpec(framework="torch", script="meshrun.doctor.benchworker", module=True,
                          script_args=(ns.kind, json.dumps(opts)), rdzv_timeout=waits.rdzv_timeout)
        launch = build(topo, spec)
        cmd = Command(processes=launch.processes, env={**launch.env, "MESHRUN_BENCH_OUT": out}, files=launch.files,
                      note=launch.note)
        check_ports(topo, cmd, spec)
        cmd = prepare_network(topo, cmd, env, waits.rdzv_timeout)
        code = run_job(cmd, env, topo, spec)
        if code or not os.path.exists(out):
            return code or (0 if topo.node_rank else 1)  # only node 0 holds rank 0's result
        with open(out) as f:
            result = json.load(f)
    finally:
        shutil.rmtree(private, ignore_errors=True)
    if ns.json:
        print(json.dumps(result, indent=2))
    else:
        show(result)
    return 0


def show(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    kind = result["kind"]
    if kind == "comm":
        t = Table(title=f"collectives: {result['world']} ranks, {result['backend']}, {result['dtype']}")
        for col in ("op", "size", "time (us)", "algbw (GB/s)", "busbw (GB/s)"):
            t.add_column(col, justify="left" if col == "op" else "right")
        for r in result["rows"]:
            t.add_row(r["op"], fmt_bytes(r["bytes"]), f"{r['time_us']:.1f}", f"{r['algbw_gbps']:.2f}",
                      f"{r['busbw_gbps']:.2f}")
    elif kind == "matmul":
        t = Table(title=f"matmul on {result['world']} x {result['device']}")
        # sustained: over --min-time, what a training step sees; burst: the first 20 calls, at boost clocks
        for col in ("dtype", "n", "TFLOP/s (slowest)", "TFLOP/s (mean)", "burst (slowest)", "of bf16 peak"):
            t.add_column(col, justify="right")
        for r in result["rows"]:
            burst = r.get("burst_tflops_min")
            t.add_row(r["dtype"], str(r["n"]), f"{r['tflops_min']:.3g}", f"{r['tflops_mean']:.3g}",
                      f"{burst:.3g}" if burst else "-", f"{r['of_peak']:.0%}" if r["of_peak"] else "-")
    else:
        t = Table(title=f"training {result['model']} on {result['world']} x {result['device']} ({result['strategy']})")
        for col in ("tokens/s per GPU", "step (s)", "MFU"):
            t.add_column(col, justify="right")
        t.add_row(f"{result['tokens_per_s_per_gpu']:,.0f}", f"{result['step_s']:.3f}",
                  f"{result['mfu']:.1%}" if result["mfu"] else "- (no peak known for this device)")
    con.print(t)
    sys.stdout.flush()
