"""The plan as a rich table, the reasons, the warnings and (with --explain) the formulas."""

from __future__ import annotations

from ..units import fmt_bytes, fmt_count, fmt_seconds
from ..vocab import Engine
from . import float8
from .adapters import of as adapters_of
from .candidate import Candidate
from .cards import ASSUMED
from .memory import BREAKDOWN_KEYS, calibration, layer_activation_bytes
from .recommend import Plan, by_step_time, one_process_first
from .steptime import (
    LORA_FROZEN_SHARE,
    MEASURED_MICRO_TOKENS,
    MEASURED_WIDTH,
    NARROWEST_MEASURED_WIDTH,
    NF4_DEQUANT_BYTES,
    SATURATION_TOKEN_WIDTH,
    measured_matmul_efficiency,
    saturation_tokens,
    work_efficiency,
)
from .strategies import ENGINES

SHORT = {"params": "params", "grads": "grads", "optimizer": "optim", "activations": "activ", "logits": "logits",
         "comm_buffers": "buffers"}
MAX_MODEL_PARALLEL_ROWS = 4  # TP x PP rows shown (all are in --json)
UNITS = (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10))
MEASURED_CARDS = ("assumed", "h100", "h200")  # float8's share measured on an H200 (the H100 SXM's chip)
SMALL = 0.095  # of the table's unit: a size below reads 0.0x, under two figures, and takes a smaller unit


def print_plan(plan: Plan, written: list[str], explain: bool) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=max(124, Console().width))
    m, c = plan.model, plan.cluster
    rows = ordered(plan)
    unit = table_unit([x.memory.peak for x in rows if x.memory is not None])
    lo = adapters_of(m, plan.train.adapters)
    what = f"{fmt_count(m.params)} params"
    if lo is not None:
        what = f"{fmt_count(m.params)} frozen{' nf4' if lo.spec.nf4 else ''} + {fmt_count(lo.params)} LoRA params"
    table = Table(title=f"{m.name} ({what}) on {c.nodes} x {c.gpus_per_node} GPUs "
                        f"of {fmt_bytes(c.gpu_mem)}, seq {plan.train.seq_len}, {plan.train.precision}; "
                        f"memory in {unit[0]} per GPU")
    for col in ("strategy", "mb x acc", *SHORT.values(), "peak", "fits", "step~"):
        table.add_column(col, justify="left" if col in ("strategy", "fits") else "right", no_wrap=True)
    for x in rows:
        s = x.strategy
        mark = "*" if x is plan.recommended else ""
        if x.memory is None or x.batch is None:
            table.add_row(mark + s.label, "-", *["-"] * len(SHORT), "-", "no: batch", "-")
            continue
        style = "bold green" if x is plan.recommended else None
        table.add_row(mark + s.label, f"{x.batch.micro} x {x.batch.accum}",
                      *[cell(x, k, unit) for k in SHORT], size(x.memory.peak, unit),
                      "yes" if x.fits else "no", fmt_seconds(x.step_time_s), style=style)
    con.print(table)
    # the lines under the table are printed whole (soft_wrap): a copied line stays one line
    small = any(0 < x.memory.breakdown[k] < SMALL * unit[1] for x in rows if x.memory for k in SHORT)
    for line in legend(plan, unit[0], small):
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


def ordered(plan: Plan) -> list[Candidate]:
    """The rows in the order the pick is made by, the pick first: by step~ when the pick is the
    shortest (``by_step_time``: --framework's rows that fit, then other engines' that fit, each
    fastest first, then the rest in the flowchart's order), else the flowchart's order. Of the
    TP x PP combinations, the ones that fit (fewest GPUs per model copy first), else the
    smallest footprints; all of them are in --json."""
    mp = [x for x in plan.candidates if x.strategy.engine is Engine.MEGATRON]
    mp_shown = {id(x) for x in sorted(mp, key=lambda x: (not x.fits,
                                                         0 if x.fits else (x.memory.peak if x.memory else 1 << 62)))
                [:MAX_MODEL_PARALLEL_ROWS]}
    rows = [x for x in plan.candidates if x.strategy.engine is not Engine.MEGATRON or id(x) in mp_shown
            or x is plan.recommended]
    pick = plan.recommended
    rest = [x for x in rows if x is not pick]
    if by_step_time(plan.train):
        engines = chosen_from(plan)
        rest = (sorted((x for x in rest if x.fits and x.strategy.engine in engines), key=_last_resort_then_speed)
                + sorted((x for x in rest if x.fits and x.strategy.engine not in engines), key=_last_resort_then_speed)
                + [x for x in rest if not x.fits])
    return ([pick] if pick is not None else []) + rest


def _last_resort_then_speed(x: Candidate) -> tuple[bool, float]:
    """Rows that keep the optimizer state on the GPU before those that offload it (the pick's
    last resort: recommend.choose), each fastest first."""
    return x.strategy.offload_optimizer, x.step_time_s


def chosen_from(plan: Plan) -> tuple[Engine, ...]:
    """The engines whose rows the pick was chosen from: --framework's, or every engine's when
    none of --framework's fits."""
    engines = ENGINES[plan.framework]
    pick = plan.recommended
    return engines if pick is None or pick.strategy.engine in engines else tuple(Engine)


def table_unit(peaks: list[int]) -> tuple[str, int]:
    """The table's unit: the largest in which the largest peak reads 1 or more."""
    top = max(peaks, default=0)
    return next(((name, size) for name, size in UNITS if top >= size), UNITS[-1])


def size(n: float, unit: tuple[str, int]) -> str:
    """Bytes in the table's unit with two decimals; a size that would read 0.00 or 0.0x there
    (less than two figures), in a smaller unit that shows it, by its initial: ``12.5M`` is
    12.5 MiB (the legend says so)."""
    if not 0 < n < SMALL * unit[1]:
        return f"{n / unit[1]:.2f}"
    name, scale = next(((name, scale) for name, scale in UNITS if n >= scale), ("B", 1))
    value = n / scale
    return f"{value:.3g}{name[0]}" if value < 100 else f"{value:.0f}{name[0]}"


def cell(x: Candidate, key: str, unit: tuple[str, int] = UNITS[0]) -> str:
    """A term of a row's peak, or why it is zero there: ``-`` not alive at that moment (the
    gradients, freed between steps, before the backward that makes them; the loss spike, over
    by the end of backward), ``cpu`` held on the CPU (offloaded optimizer state)."""
    if x.memory is None:
        return "-"
    value = x.memory.breakdown[key]
    if value:
        return size(value, unit)
    if key == "optimizer" and x.strategy.offload_optimizer:
        return "cpu"
    return "-" if key in ("grads", "logits") else "0"


def legend(plan: Plan, unit: str, small: bool = False) -> list[str]:
    """What the order, the columns and step~ mean, in the words of this plan."""
    c, t = plan.cluster, plan.train
    if any(tr.liger for tr in plan.model.traced):
        logits = "Liger's fused loss (the head weight's and the input's gradients, a chunk of logits)"
    else:
        logits = ("the loss's bf16 logits, fp32 copy, log-softmax and its gradient"
                  + (" (fused when a model is compiled whole: single, ddp)" if t.whole_compile else ""))
    lo = adapters_of(plan.model, t.adapters)
    if lo is None:
        states = "params, grads, optim(izer state) as the layout keeps them"
    else:
        frozen = "the adapted layers' in NF4, the rest in " if lo.spec.nf4 else ""
        states = (f"params: the frozen weights ({frozen}{t.dtype}) and the adapters; grads, optim(izer state): "
                  "the adapters' alone; as the layout keeps them")
    return [
        *order_rule(plan),
        "strategy +ac: with activation checkpointing (zero* DeepSpeed, ddp/fsdp* torch, tp*-pp* Megatron-style); "
        "mb x acc: micro-batch per GPU x accumulation steps",
        f"{unit} per GPU" + (f" ({small_units(unit)}: where {unit} would show less than 0.1)" if small else "")
        + f" at the row's peak (the start of backward, or its end): {states}",
        f"  (-: none alive then; cpu: offloaded); activ: saved for backward; logits: {logits};",
        "  buffers: gathered parameters, communication buckets; peak: these + workspace, allocator fragmentation, "
        f"CUDA context; fits: peak <= {fmt_bytes(c.gpu_mem * (1 - plan.margin))}",
        *step_lines(plan),
    ]


def small_units(unit: str) -> str:
    """How the cells too small for the table's unit name theirs: ``12.5M`` 12.5 MiB."""
    smaller = [name for name, _ in UNITS][[name for name, _ in UNITS].index(unit) + 1:]
    return ", ".join(f"{name[0]} {name}" for name in smaller) + ", B bytes"


def order_rule(plan: Plan) -> list[str]:
    """The pick's rule, and so the rows' order."""
    if plan.recommended is None:
        return ["nothing fits: the rows in the flowchart's order"]
    ours = "" if chosen_from(plan) == tuple(Engine) else f" {plan.framework}"
    fits = [x for x in plan.candidates if x.fits]
    one_gpu = (["  one GPU: FSDP2 on its one rank (fsdp-full) only where single does not fit with the same "
                "checkpointing"] if one_process_first(fits) != fits else [])
    if any(x.strategy.offload_optimizer for x in fits) and not all(x.strategy.offload_optimizer for x in fits):
        one_gpu.append("  offload (the optimizer state in host memory) only where nothing else fits: those rows "
                       "after the others")
    if by_step_time(plan.train):
        others = "" if not ours else " (other engines' after them: --framework any weighs them)"
        return [f"* the pick, first: the shortest step~ of the{ours} rows that fit (a tie within 1% goes to the "
                "flowchart's simpler layout);",
                f"  then the others that fit, fastest first{others}; then those that do not fit", *one_gpu]
    return [f"* the pick, first: with the micro-batch given, the first of the{ours} rows that fits in the flowchart's "
            "order (ddp and fsdp-grad-op swapped",
            "  when the other's step~ is 1% shorter); then the rest in that order: replicas, sharded states, "
            "with checkpointing, offload, TP x PP", *one_gpu]


def step_lines(plan: Plan) -> list[str]:
    """What step~ assumes: the card and its peak for the precision planned, the efficiencies."""
    c, t = plan.cluster, plan.train
    card = c.card or ASSUMED
    if c.card is None:
        whose = f"assumed: an {ASSUMED.title}'s, the card is not known; --gpu NAME sets it"
    else:
        here = c.source("gpu")
        whose = f"the {card.title}'s" + (f", {here}" if here != "flag" else "")
    if t.dtype == "fp32":
        peak = (f"{card.fp32_tflops:g} TFLOP/s fp32 ({whose}; no tensor cores: TF32 stays off; the efficiency "
                "assumed bf16's)")
    else:
        peak = f"{card.bf16_tflops:g} TFLOP/s dense bf16 ({whose})"
    out = [f"step~: estimated seconds per optimizer step: the work at {peak}",
           f"  x {work_efficiency():.0%} x the layout's measured efficiency x the micro-batch's matmul efficiency "
           f"T/(T + {saturation_tokens(plan.model.hidden):,.0f}) for T tokens (width {plan.model.hidden}"
           + (f", as {NARROWEST_MEASURED_WIDTH})" if plan.model.hidden < NARROWEST_MEASURED_WIDTH else ")"),
           f"  over the measured {measured_matmul_efficiency():.0%} ({MEASURED_MICRO_TOKENS:,} tokens, width "
           f"{MEASURED_WIDTH}), + communication backward does not hide, FSDP2's cost per micro-step, "
           "the optimizer step"]
    if lo_line := lora_step_line(plan):
        out.append(lo_line)
    if t.float8 and card.fp8_tflops is not None:
        share = float8.converted_share(plan.model, t.precision, t.seq_len)
        out.append(f"  {t.precision}: the float8 matmuls ({share:.0%} of a block's work) at {card.fp8_tflops:g} "
                   f"TFLOP/s dense x {float8.matmul_efficiency(t.precision):.0%} of bf16's efficiency (measured: "
                   f"{float8.MEASURED_BLOCK_SPEEDUP[t.precision]}x bf16 on Llama-3-8B's blocks, one H200)"
                   + (f"; the same share assumed on the {card.title}" if card.name not in MEASURED_CARDS else ""))
    return out


def lora_step_line(plan: Plan) -> str:
    """What step~ counts of a LoRA run (empty: not one)."""
    t = plan.train
    lo = adapters_of(plan.model, t.adapters)
    if lo is None:
        return ""
    card = plan.cluster.card or ASSUMED
    line = (f"  LoRA: the frozen weights' matmuls at {LORA_FROZEN_SHARE:.0%} of a full fine-tune's (forward and input "
            "gradients, no weight gradients), the adapters' 6 FLOPs per parameter per token; only the adapters' "
            "gradients reduced, FSDP/ZeRO-3 still gather every weight")
    if lo.spec.nf4:
        line += (f"; NF4 dequantized in forward and backward, {NF4_DEQUANT_BYTES['eager']:g} bytes a weight eager, "
                 f"{NF4_DEQUANT_BYTES['compiled']:g} compiled, at {card.bandwidth_tbs:g} TB/s")
    return line


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


def lora_lines(plan: Plan) -> list[str]:
    """What --explain says of a LoRA plan's states (none: not one)."""
    t = plan.train
    lo = adapters_of(plan.model, t.adapters)
    if lo is None:
        return []
    wide = 2 if t.dtype == "bf16" else 4
    return [f"  LoRA (rank r = {lo.rank}): A = r·(in + out) per adapted layer = {lo.params:,} adapter parameters train "
            "and take the states above in P's place;",
            f"    the N frozen parameters are stored, {wide}N (no grads, no optimizer state), sharded by FSDP/ZeRO-3, "
            "replicated by DDP/ZeRO-1/2"
            + ("; the adapted layers' weights in NF4: n/2 + n/64 + 2n/16384 + 34 bytes per weight of n "
               "(torchao's block 64, scalers per 256 blocks)" if lo.spec.nf4 else ""),
            "    activations + per adapted layer and token: r-wide A output (a·r)"
            + (", the dropped input copy and its mask ((a + 1)·in)" if lo.spec.dropout > 0 else "")]


def explanation(plan: Plan) -> str:
    m, t = plan.model, plan.train
    cal = calibration()
    lines = [
        "",
        "formulas (bytes per GPU; P = parameters on this GPU = N / (tp·pp), n = ranks sharding the states):",
        "  torch (meshrun, DDP, FSDP2): fp32 params 4P, fp32 grads 4P, optimizer k·P "
        f"(k = {t.optimizer_bytes} for {t.optimizer}); FSDP shards all three over n, grad_op keeps a bf16 copy 2P;",
        "    under bf16 autocast (single/DDP) matmuls keep bf16 weight copies for backward: +2P",
        *lora_lines(plan),
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
        "  step time = work per token x tokens (/ tp·pp·cp; x 4/3 with checkpointing) / (peak x "
        f"{work_efficiency():.1%} x the layout's measured efficiency);",
        "    work = matmuls 6N (active parameters) / (e(T) / e(measured)) + causal attention 6·L·h·s (half of MFU's "
        "12·L·h·s);",
        f"    e(T) = T / (T + {SATURATION_TOKEN_WIDTH:.2g} / max(h, {NARROWEST_MEASURED_WIDTH})): the matmul "
        "efficiency of a micro-batch of T tokens, "
        f"e(measured) = {measured_matmul_efficiency():.1%}",
        f"    ({MEASURED_MICRO_TOKENS:,} tokens of GPT 1.3B, h = {MEASURED_WIDTH}, where {work_efficiency():.1%} "
        "was measured);",
        *([f"    {t.precision}: the float8 layers' part of 6N at the fp8 peak x "
           f"{float8.matmul_efficiency(t.precision):.1%} of bf16's efficiency (fitted to "
           f"{float8.MEASURED_BLOCK_SPEEDUP[t.precision]}x on four Llama-3-8B blocks, one H200)"] if t.float8 else []),
        "    + communication not hidden (80% overlap) + FSDP2's cost per micro-step "
        f"({cal.get('fsdp_microstep_s', 0.0) * 1e3:.0f} ms) + the optimizer step or offload; measured efficiencies: "
        + ", ".join(f"{k} {v}" for k, v in cal.get("layout_efficiency", {}).items() if not k.endswith("about")),
    ]
    r = plan.recommended
    if r is not None and r.memory is not None:
        lines.append(f"  this plan's pick, {r.strategy.label}:")
        for key in BREAKDOWN_KEYS:
            lines.append(f"    {key:14} {fmt_bytes(r.memory.breakdown[key]):>10}")
        lines.append(f"    {'peak':14} {fmt_bytes(r.memory.peak):>10}")
        if r.step is not None:
            parts = ", ".join(f"{k} {fmt_seconds(v) if v else '0 s'}" for k, v in vars(r.step).items())
            lines.append(f"    step: {parts} = {fmt_seconds(r.step_time_s)}")
    return "\n".join(lines)
