"""The plan as a rich table, the reasons, the warnings and (with --explain) the formulas."""

from __future__ import annotations

from ..units import fmt_bytes, fmt_count, fmt_seconds
from ..vocab import Engine
from .candidate import Candidate
from .memory import BREAKDOWN_KEYS, calibration, layer_activation_bytes
from .recommend import ASSUMED_MFU, Plan, work_efficiency

SHORT = {"params": "params", "grads": "grads", "optimizer": "optim", "activations": "activ", "logits": "logits",
         "comm_buffers": "buffers"}
MAX_MODEL_PARALLEL_ROWS = 4  # TP x PP rows shown (all are in --json)


def print_plan(plan: Plan, written: list[str], explain: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(124, Console().width))
    m, c = plan.model, plan.cluster
    table = Table(title=f"{m.name} ({fmt_count(m.params)} params) on {c.nodes} x {c.gpus_per_node} GPUs "
                        f"of {fmt_bytes(c.gpu_mem)}, seq {plan.train.seq_len}, {plan.train.precision}; "
                        "memory in GiB per GPU")
    for col in ("strategy", "mb x acc", *SHORT.values(), "peak", "fits", "step~"):
        table.add_column(col, justify="left" if col in ("strategy", "fits") else "right", no_wrap=True)
    mp = [x for x in plan.candidates if x.strategy.engine is Engine.MEGATRON]
    # Of the TP x PP combinations, the ones that fit (fewest GPUs per model copy first),
    # else the smallest footprints; all of them are in --json.
    mp_shown = {id(x) for x in sorted(mp, key=lambda x: (not x.fits,
                                                         0 if x.fits else (x.memory.peak if x.memory else 1 << 62)))
                [:MAX_MODEL_PARALLEL_ROWS]}
    for x in plan.candidates:
        s = x.strategy
        if s.engine is Engine.MEGATRON and id(x) not in mp_shown and x is not plan.recommended:
            continue
        mark = "*" if x is plan.recommended else ""
        if x.memory is None or x.batch is None:
            table.add_row(mark + s.label, "-", *["-"] * len(SHORT), "-", "no: batch", "-")
            continue
        style = "bold green" if x is plan.recommended else None
        table.add_row(mark + s.label, f"{x.batch.micro} x {x.batch.accum}",
                      *[cell(x, k) for k in SHORT], gib(x.memory.peak),
                      "yes" if x.fits else "no", fmt_seconds(x.step_time_s), style=style)
    con.print(table)
    # the lines under the table are printed whole (soft_wrap): a copied line stays one line
    for line in legend(plan):
        con.print(f"  {line}", highlight=False, soft_wrap=True)
    for line in plan.reasons:
        con.print(f"  {line}", highlight=False, soft_wrap=True)
    for line in plan.warnings:
        con.print(f"  [yellow]warning:[/] {line}", highlight=False, soft_wrap=True)
    if plan.recommended and plan.recommended.memory and plan.recommended.memory.cpu_bytes_per_node:
        con.print(f"  CPU memory per node for offload: {fmt_bytes(plan.recommended.memory.cpu_bytes_per_node)}")
    for path in written:
        con.print(f"  wrote {path}")
    if explain:
        con.print(explanation(plan), highlight=False)


def gib(n: float) -> str:
    """Bytes as GiB with two decimals: the table's one unit."""
    return f"{n / 2**30:.2f}"


def cell(x: Candidate, key: str) -> str:
    """A term of a row's peak, or why it is zero there: ``-`` not alive at that moment (the
    gradients, freed between steps, before the backward that makes them; the loss spike, over
    by the end of backward), ``cpu`` held on the CPU (offloaded optimizer state)."""
    if x.memory is None:
        return "-"
    value = x.memory.breakdown[key]
    if value:
        return gib(value)
    if key == "optimizer" and x.strategy.offload_optimizer:
        return "cpu"
    return "-" if key in ("grads", "logits") else "0"


def legend(plan: Plan) -> list[str]:
    """What the table's marks, columns and estimates mean, in the words of this plan."""
    c = plan.cluster
    return [
        "* recommended; engines: zero* DeepSpeed, ddp/fsdp* torch, tp*-pp* Megatron-style",
        "each row at its peak: the start of backward (activations, the loss's spike) or its end (all gradients)",
        "grads -: none alive at that peak (freed between steps, made in backward); logits -: the spike is over",
        *(["optim cpu: offloaded; logits: Liger's fused loss (the head weight's and the input's gradients, "
           "a chunk of logits)"] if any(t.liger for t in plan.model.traced) else [
            "optim cpu: offloaded; logits: bf16 logits, their fp32 copy, log-softmax and its gradient at once",
            *(["  (a model compiled whole, single or ddp, fuses most of that)"] if plan.train.whole_compile else [])]),
        f"step~: for GPUs of {c.gpu_flops / 1e12:.0f} TFLOP/s dense bf16 (H100/H200 SXM) at {ASSUMED_MFU:.0%} MFU "
        "x the layout's measured efficiency, + unhidden communication",
    ]


def activation_lines(plan: Plan) -> list[str]:
    """What --explain says of activations traced from the model itself."""
    m, t = plan.model, plan.train
    cal = calibration()
    out = [f"  activations and the loss spike: traced from the model on the meta device at seq {t.seq_len}",
           "    (every tensor autograd saves, each storage once; attention as the fused kernels save it"
           + ("; Liger Kernel's kernels as their Triton functions keep tensors" if any(tr.liger for tr in m.traced)
              else "") + "):"]
    for tr in m.traced:
        compiled = "" if tr.blocks_compiled is None else f" ({fmt_bytes(tr.at('blocks_compiled', 1))} compiled)"
        out.append(f"    {tr.mode:8} per sequence: blocks {fmt_bytes(tr.at('blocks', 1))}{compiled}, a block's input "
                   f"{fmt_bytes(tr.at('block_input', 1))}, loss spike {fmt_bytes(tr.at('tail', 1))}")
    out += ["    (autocast: fp32 parameters under bf16 autocast, single/DDP; bf16: FSDP2's and DeepSpeed's)",
            "    x micro-batch / (tp·cp);",
            "    with checkpointing: each block's input + the largest block's recomputation + "
            f"{cal['ac_unexplained_share']} x the blocks' (measured, not traced);",
            "    compiled: what Inductor's partitioner keeps of a block (traced) x "
            + ", ".join(f"{k} {v}" for k, v in cal["traced_partition_factor"].items()) + " (measured);",
            f"    a loss compiled with the model x {cal['traced_tail_factor']['compiled']} (measured); the spike's "
            f"allocator overhead x {cal['traced_spike_fragmentation']}"]
    return out


def explanation(plan: Plan) -> str:
    m, t = plan.model, plan.train
    cal = calibration()
    lines = [
        "",
        "formulas (bytes per GPU; P = parameters on this GPU = N / (tp·pp), n = ranks sharding the states):",
        "  torch (meshrun, DDP, FSDP2): fp32 params 4P, fp32 grads 4P, optimizer k·P "
        f"(k = {t.optimizer_bytes} for {t.optimizer}); FSDP shards all three over n, grad_op keeps a bf16 copy 2P;",
        "    under bf16 autocast (single/DDP) matmuls keep bf16 weight copies for backward: +2P",
        "  DeepSpeed ZeRO (mixed): 2P bf16 params + 2P bf16 grads + (4 + k)·P master and moments;",
        "    ZeRO-1 shards the last, ZeRO-2 also the grads, ZeRO-3 everything: 2P + 2P + (4+k)P/n ... (2+2+4+k)P/n;",
        "    as DeepSpeed runs it: ZeRO-1/2 grads and buckets arrive as backward frees activations, ZeRO-3 keeps",
        f"    its grad partitions in fp32 (4P/n), and the step takes {cal['deepspeed_step_bytes_per_param']}P/n "
        "of fresh segments (counted as fragmentation)",
        *(activation_lines(plan) if m.traced else [
            "  activations per layer per token (eager, flash attention), estimated from the shape: "
            f"{layer_activation_bytes(m, t.dtype):.0f} B here =",
            "    2·(r·h + a·h) norms + a·(h + 2·kv) qkv [+ a·(h + kv) rotary] + a·h attention out + 2·a·f MLP "
            "(4·a·f gated) + 4·heads",
            "    a = 2 (bf16) or 4; r = 4 under autocast (fp32 residual), else a; with checkpointing: r·h per layer",
            f"  x layers x micro-batch x seq / tp; compiled blocks x {cal['act_factor']['compiled']}",
            f"  logits spike: {cal['logits_vocab_bytes']['eager']} B x vocab x tokens eager (bf16 logits, fp32 copy, "
            f"log-softmax and its gradient), {cal['logits_vocab_bytes']['compiled']} B compiled with the loss"]),
        "  peak = max(start of backward: states + activations + spike, end of backward: states + all grads)",
        "    accumulating micro-batches on one GPU (or a whole model compiled under DDP): the earlier",
        "    micro-batches' fp32 grads (4P) are alive at the start of backward too",
        *(["  validating (meshrun train does at the end) in smaller micro-batches: their logits (bf16) and two",
           "    fp32 copies take new segments wherever larger than every tensor training held (in fragmentation)"]
          if any(tr.eval_logits for tr in m.traced) else []),
        f"  + workspace {fmt_bytes(cal['workspace_bytes'])}, x {cal['reserved_over_allocated']} allocator "
        f"fragmentation (reserved / allocated), + CUDA context {fmt_bytes(cal['cuda_context_bytes'])}",
        f"    (+ {fmt_bytes(cal['nccl_buffer_bytes'])} of NCCL's buffers on more than one GPU, + "
        f"{fmt_bytes(cal['deepspeed_outside_bytes'])} under DeepSpeed: measured outside torch's allocator);",
        "    FSDP2 with its peak at the start of backward also reserves its gradient shards (4P/n) in the",
        "    reduce-scatter stream's cache (one stream's free blocks never serve another)",
        "  communication per step (ring): all-reduce 2(n-1)/n·B, all-gather / reduce-scatter (n-1)/n·B;",
        "    DDP fp32 grads; FSDP bf16 all-gathers (x2 for full shard) + fp32 reduce-scatter; TP 4 activation",
        "    all-reduces per layer",
        "  step time = causal work (6N + 6·L·h·s per token: half of MFU's 12·L·h·s attention; / tp·pp·cp; x 4/3",
        f"    with checkpointing) / (peak x {work_efficiency():.1%} x the layout's measured efficiency)",
        "    + communication not hidden (80% overlap) + the optimizer step + offload; measured efficiencies: "
        + ", ".join(f"{k} {v}" for k, v in cal.get("layout_efficiency", {}).items() if not k.endswith("about")),
    ]
    r = plan.recommended
    if r is not None and r.memory is not None:
        lines.append(f"  this plan's pick, {r.strategy.label}:")
        for key in BREAKDOWN_KEYS:
            lines.append(f"    {key:14} {fmt_bytes(r.memory.breakdown[key]):>10}")
        lines.append(f"    {'peak':14} {fmt_bytes(r.memory.peak):>10}")
    return "\n".join(lines)
