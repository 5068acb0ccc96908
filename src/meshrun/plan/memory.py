"""Per-GPU memory of one training step, term by term (pure arithmetic, bytes).

Model states (the ZeRO paper's accounting, Rajbhandari et al. 2020, section 3): with mixed
precision and Adam, 2 bytes of bf16 parameters + 2 of bf16 gradients + K = 12 of fp32 master
weights and moments per parameter; ZeRO-1 shards the 12, ZeRO-2 also the gradients, ZeRO-3
everything over the N data-parallel ranks. PyTorch-native training (meshrun's trainer, DDP,
FSDP2 with a MixedPrecisionPolicy) keeps fp32 parameters and fp32 gradients instead: 4 + 4 +
8 (Adam's moments), the same 16 bytes, sharded the same way by FSDP2.

Activations and the loss spike are traced from the model itself when there is one to trace
(plan/trace.py: a Hugging Face config, a user's module, meshrun's GPT; the Traced
terms of a ModelSpec; under torch.compile, what Inductor's partitioner keeps), with factors
measured on GPUs for what is not traced (a loss compiled with the model, the GPU's extra under
activation checkpointing, a compiled model's accumulated gradients). Otherwise (a published
shape with no module), activations per layer per token follow Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models", section 4.1), redone for
what PyTorch's autograd actually saves with flash attention under bf16 autocast (no s² term;
an fp32 residual stream and LayerNorm inputs when the parameters are fp32, unless the model
casts its residual stream to bf16 as meshrun's GPT does), then scaled by calibrated factors
for torch.compile (calibration.json, fitted on GPUs by bench/plan_accuracy.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any

from ..defaults import val_micro
from ..modelinfo.spec import LOSS_CHUNK_TOKENS, ModelSpec, Traced
from ..vocab import Engine, StrategyKind
from . import float8
from .adapters import AdapterLayout
from .adapters import of as adapters_of
from .spec import ClusterSpec, TrainSpec


@lru_cache(maxsize=1)
def calibration() -> dict[str, Any]:
    # Package data (pyproject.toml's package-data ships it in the wheel), read through
    # importlib.resources so it is found however the package is installed.
    data: dict[str, Any] = json.loads(resources.files(__package__).joinpath("calibration.json")
                                      .read_text(encoding="utf-8"))
    return data


@dataclass(frozen=True)
class Strategy:
    """One way to lay the model over the GPUs: a kind of vocab.KINDS at these degrees.

    shard (the kind's): what the data-parallel group shards: none (DDP), optimizer (ZeRO-1),
    grads (ZeRO-2, FSDP SHARD_GRAD_OP), params (ZeRO-3, FSDP FULL_SHARD).
    """

    kind: StrategyKind
    dp: int  # data-parallel replicas x shards: the batch is split dp ways
    shard_group: int  # ranks one copy of the states is sharded over
    tp: int = 1
    pp: int = 1
    ac: bool = False
    cp: int = 1  # context parallel: each sequence over cp ranks (activations / cp, K/V gathered)
    sac: bool = False  # selective activation checkpointing: each block keeps its matmuls' outputs
    ep: int = 1  # expert parallel: experts over ep ranks

    @property
    def name(self) -> str:
        """The kind's name (or its layout's degrees), then any context- and expert-parallel degree."""
        base = self.kind.named_as.format(name=self.kind.name, tp=self.tp, pp=self.pp, dp=self.dp)
        return base + "".join(f"-{d}{n}" for d, n in (("cp", self.cp), ("ep", self.ep)) if n > 1)

    @property
    def engine(self) -> Engine:
        return self.kind.engine

    @property
    def shard(self) -> str:
        return self.kind.shard

    @property
    def offload_optimizer(self) -> bool:
        return self.kind.offload_optimizer

    @property
    def offload_params(self) -> bool:
        return self.kind.offload_params

    @property
    def keep_gathered(self) -> bool:  # FSDP2 reshard_after_forward=False: bf16 params live fwd -> bwd
        return self.kind.keep_gathered

    @property
    def data_parallel_only(self) -> bool:
        """No tensor, pipeline, context or expert parallelism beside the data parallelism."""
        return self.tp == self.pp == self.cp == self.ep == 1

    @property
    def label(self) -> str:
        return self.name + ("+ac" if self.ac else "+sac" if self.sac else "")


# meshrun's AdamW with its moments on the host (training/offload.py) steps them through two
# device buffers of this many fp32 values (the first and second moment of a slice: 256 MiB
# each); a slice is one fused kernel call (tensors longer are cut).
OFFLOAD_SLICE_ELEMENTS = 1 << 26


BREAKDOWN_KEYS = ("params", "grads", "optimizer", "activations", "logits", "comm_buffers", "workspace",
                  "fragmentation", "cuda_context")


@dataclass(frozen=True)
class Memory:
    breakdown: dict[str, int]
    cpu_bytes_per_node: int = 0
    notes: tuple[str, ...] = field(default=())

    @property
    def peak(self) -> int:
        return sum(self.breakdown.values())

    @property
    def allocator_peak(self) -> int:
        """What ``torch.cuda.max_memory_reserved`` would show: everything but the context."""
        return self.peak - self.breakdown["cuda_context"]


def autocast(t: TrainSpec, s: Strategy) -> bool:
    """fp32 parameters under bf16 autocast (meshrun's single/DDP); FSDP2's MixedPrecisionPolicy,
    DeepSpeed and Megatron run the model in bf16 outright."""
    return t.dtype == "bf16" and s.engine is Engine.TORCH and s.shard == "none"


def layer_activation_bytes(m: ModelSpec, precision: str, fp32_residual: bool = True) -> float:
    """Bytes autograd keeps per token per layer, eager, flash attention (checked against the
    tensors autograd saves on CPU: tests/test_plan.py).

    bf16 autocast: the residual stream and LayerNorm inputs stay fp32 (r = 4) unless the model
    casts them (meshrun's GPT: r = 2); matmul inputs
    and outputs are bf16 (a = 2). Saved: norm input (r·h) and its bf16 cast for the next
    matmul (a·h), twice (a model run in bf16 outright: r = 2); the q/k/v projection
    (a·(h + 2·kv)); with rotary embeddings the rotated q and k (a·(h + kv)); the attention
    output (a·h); the MLP's hidden (a·f for up and a·f for the activation; a gated MLP keeps
    gate, up, act(gate) and their product: 4·a·f);
    flash attention's log-sum-exp (4 bytes per head). fp32: a = r = 4.
    """
    h, f, kv = m.hidden, m.ffn, m.kv_dim
    a, r = (2, 4 if fp32_residual else 2) if precision == "bf16" else (4, 4)
    norms = 2 * (r * h + a * h)
    attn = a * (h + 2 * kv) + (a * (h + kv) if m.gated_mlp else 0) + a * h + 4 * m.heads
    mlp = 4 * a * f if m.gated_mlp else 2 * a * f
    if m.experts:  # each token through top_k experts, plus its dispatched and combined copies
        mlp = mlp * m.top_k + 2 * a * h * m.top_k
    return norms + attn + mlp


def selective_layer_bytes(m: ModelSpec, precision: str, fp32_residual: bool = True) -> float:
    """Bytes per token per layer under selective checkpointing (training/parallel/apply.py's
    policy): the block's input (its norm is recomputed from it), the outputs of every matmul
    (q/k/v, attention-out, the MLP's up and gate, down) and of attention with its log-sum-exp;
    norms, activations, rotary embeddings and their products are recomputed."""
    h, f, kv = m.hidden, m.ffn, m.kv_dim
    a, r = (2, 4 if fp32_residual else 2) if precision == "bf16" else (4, 4)
    mlp = (2 * a * f if m.gated_mlp else a * f) + a * h
    if m.experts:
        mlp = mlp * m.top_k + 2 * a * h * m.top_k
    return r * h + a * (h + 2 * kv) + a * h + 4 * m.heads + a * h + mlp


def precision_mode(t: TrainSpec, s: Strategy) -> str:
    """How the step runs the model: fp32 parameters under bf16 ``autocast``, ``bf16``
    parameters, or ``fp32`` throughout (the modes a ModelSpec's traces are made in)."""
    return "autocast" if autocast(t, s) else t.dtype


def traced(m: ModelSpec, t: TrainSpec, s: Strategy) -> Traced | None:
    """The model's traced activations for this layout's precision and sequence length, if
    traced (selective checkpointing keeps the estimate: its policy is not traced)."""
    return None if s.sac else m.traced_for(precision_mode(t, s), t.seq_len)


def activations(m: ModelSpec, t: TrainSpec, s: Strategy, micro: int) -> tuple[int, int]:
    """(stored for backward over all of this GPU's layers, transient of one layer's backward
    or recomputation). Tensor parallelism with sequence parallelism divides everything by tp;
    1F1B pipelining keeps pp micro-batches of L/pp layers on the first stage: L layers' worth."""
    mode = "compiled" if t.compile and s.engine is Engine.TORCH else "eager"
    tr = traced(m, t, s)
    if tr is not None:
        return traced_activations(tr, m, t, s, micro, mode)
    fp32_residual = autocast(t, s) and not m.bf16_residual
    per_layer = layer_activation_bytes(m, t.dtype, fp32_residual) * calibration()["act_factor"][mode]
    kept = selective_layer_bytes(m, t.dtype, fp32_residual) * calibration()["act_factor"][mode]
    tokens = micro * t.seq_len / s.cp  # context parallel: this rank's shard of each sequence
    layers = m.layers  # L/pp layers x pp in-flight micro-batches on the first stage
    one_layer = per_layer * tokens / s.tp
    if s.cp > 1:  # the gathered keys and values of the whole sequence, one layer at a time
        one_layer += 2 * 2 * m.kv_dim * micro * t.seq_len
    if s.ac:
        stored = (4 if fp32_residual or t.dtype == "fp32" else 2) * m.hidden * tokens * layers / s.tp
        return int(stored), int(one_layer)
    if s.sac:  # the kept outputs, and one layer's recomputed rest in its backward
        stored = kept * tokens * layers / s.tp
        return int(stored), int(one_layer - kept * tokens / s.tp)
    return int(one_layer * layers), int(one_layer / 4)


def traced_activations(tr: Traced, m: ModelSpec, t: TrainSpec, s: Strategy, micro: int,
                       mode: str) -> tuple[int, int]:
    """activations() from the traced bytes: all blocks' saved tensors; compiled (``mode``), what
    Inductor's partitioner keeps of them (traced, ``Traced.blocks_compiled``) times a measured
    factor (1.16 under autocast, 1.07 with bf16 parameters: the largest ratio of the GPU's
    bytes to the traced partition's over the models measured). The transient of one block's
    backward: a quarter of what the largest block saves. Under full checkpointing:
    each block's input, the largest block's recomputation, and a calibrated share (0.2) of what
    the blocks would save un-checkpointed: the measured checkpointed runs hold that much more
    on the GPU than the trace, while on the CPU a real FSDP2 + checkpointed step holds what the
    trace says (docs/decisions.md#traced-memory)."""
    cal = calibration()
    split = s.tp * s.cp  # sequence parallelism and context parallelism split the tokens
    gathered_kv = 2 * 2 * m.kv_dim * micro * t.seq_len if s.cp > 1 else 0
    largest = tr.at("block_max", micro) / split
    if s.ac:
        stored = (tr.at("embed", micro) + m.layers * tr.at("block_input", micro)
                  + cal["ac_unexplained_share"] * tr.at("blocks", micro)) / split
        return int(stored), int(largest + gathered_kv)
    blocks = tr.at("blocks", micro)
    if mode == "compiled" and tr.blocks_compiled is not None:
        blocks = tr.at("blocks_compiled", micro) * cal["traced_partition_factor"][tr.mode]
    stored = (tr.at("embed", micro) + blocks) / split
    return int(stored), int(largest / 4 + gathered_kv)


def accumulation_grads(t: TrainSpec, s: Strategy, micro: int, states: dict[str, int]) -> int:
    """Gradients alive at the start of backward when the step accumulates over micro-batches:
    from the second micro-batch on, the earlier ones' gradients are kept while its forward
    saves its activations. Counted where the layout's gradients are not already persistent
    (one GPU), and for a whole model compiled in one graph, which under DDP holds one set
    beyond its buckets. Measured: single-GPU runs accumulating over micro-batches peaked at
    the start of backward plus exactly the fp32 gradients, and whole models compiled under DDP
    on one rank as counted here (docs/decisions.md#traced-memory)."""
    if t.global_batch is None or t.global_batch <= micro * s.dp:
        return 0
    one_gpu = s.engine is Engine.TORCH and s.shard == "none" and not persistent_grads(s)
    return states["grads"] if one_gpu or whole_model_compiled(t, s) else 0


def whole_model_compiled(t: TrainSpec, s: Strategy) -> bool:
    """meshrun compiles the whole model under single/DDP (its loss too where the model's
    forward takes it), but each block on its own under FSDP (so FSDP's hooks stay outside the
    graphs) and for a Hugging Face model on every layout: there the loss runs eager."""
    return t.compile and t.whole_compile and s.engine is Engine.TORCH and s.shard == "none"


def logits_bytes(m: ModelSpec, t: TrainSpec, s: Strategy, micro: int) -> int:
    """The loss spike: logits for the whole micro-batch, their fp32 copy, log-softmax's output
    and its gradient (eager: about 12 bytes per vocabulary entry per token at the start of
    backward); a compiled loss fuses most of it away. Vocabulary-parallel under TP."""
    mode = "compiled" if whole_model_compiled(t, s) else "eager"
    tr = traced(m, t, s)
    if tr is not None:  # the traced live peak of the final norm, head and loss
        mode = mode if tr.loss_inside else "eager"  # a loss taken outside the model is not compiled with it
        return int(tr.at("tail", micro) * calibration()["traced_tail_factor"][mode] / (s.tp * s.cp))
    tokens = micro * t.seq_len / (s.tp * s.cp)
    if m.fused_loss and s.tp == 1 and mode == "eager":
        # one chunk at a time: its fp32 logits, their exponentials, the fp32 and bf16 gradient
        return int(14 * m.vocab * min(tokens, LOSS_CHUNK_TOKENS))
    return int(calibration()["logits_vocab_bytes"][mode] * m.vocab * tokens)


def model_states(m: ModelSpec, t: TrainSpec, s: Strategy) -> tuple[dict[str, int], int, list[str]]:
    """(params, grads, optimizer, comm_buffers) bytes per GPU, CPU bytes per GPU, notes."""
    lo = adapters_of(m, t.adapters)
    if lo is not None:
        return adapter_states(m, t, s, lo)
    p = params_per_gpu(m, s)
    block = m.block_params / s.tp
    n = s.shard_group
    k = t.optimizer_bytes
    notes: list[str] = []
    mixed = t.dtype == "bf16"
    cpu = 0.0
    if s.engine is Engine.DEEPSPEED:
        # bf16 weights and grads on the GPU, fp32 master copy + moments in the optimizer
        # (the paper's accounting; what DeepSpeed adds at the peak is in estimate())
        pw, gw, master = (2, 2, 4 + k) if mixed else (4, 4, k)
        params = pw * p / (n if s.shard == "params" else 1)
        grads = gw * p / (n if s.shard in ("grads", "params") else 1)
        opt = master * p / (n if s.shard != "none" else 1)
        # reduce/allgather buckets (5e8 elements), never more than the gradients they hold
        bucket = 2 * min(5e8, p) if s.shard in ("optimizer", "grads") else 0
        if s.shard == "params":
            bucket = 2 * (2 * 0.9 * m.hidden**2 + 1e9 / max(1, m.layers))  # prefetch buckets + live params
            bucket += 2 * m.outer_params  # embeddings/head gathered while in use
        if s.offload_optimizer:
            cpu += opt + 4 * p / n  # master weights, moments and the fp32 gradient partition
            opt = 0
            notes.append("optimizer state and its step on the CPU (DeepSpeed's CPU Adam)")
        if s.offload_params:
            cpu += params
            params = 2 * 2 * block  # only the gathered block(s) in use
        return {"params": int(params), "grads": int(grads), "optimizer": int(opt),
                "comm_buffers": int(bucket)}, int(cpu), notes
    # torch / megatron-style: fp32 params and grads (or bf16 everything for megatron's
    # distributed optimizer, whose 2 + 4 + 12/dp we use for TP x PP).
    if s.engine is Engine.MEGATRON:
        params, grads = 2 * p, 4 * p
        opt = (4 + k) * p / s.dp
        return {"params": int(params), "grads": int(grads), "optimizer": int(opt),
                "comm_buffers": int(2 * 4 * block)}, 0, notes
    # FSDP2 shards the fp32 parameters in both flavours; grad_op only keeps the bf16 copy.
    params = 4 * p / (n if s.shard in ("grads", "params") else 1) + cast_copies(m, t, s)
    grads = 4 * p / (n if s.shard in ("grads", "params") else 1)
    opt = k * p / (n if s.shard != "none" else 1)
    buffers = 0.0
    if s.shard == "params":
        # FSDP2: the root (embeddings, head) stays gathered in bf16 through the step, the
        # last block too, plus the next block's prefetch and one block's unsharded fp32 grads.
        gathered = 2 if mixed else 4
        buffers = gathered * (m.outer_params + 2 * block) + 4 * block - 2 * float8.gathered_saving(m, t.precision, s.tp)
    if s.keep_gathered:
        buffers = ((2 if mixed else 4) * (m.outer_params + m.layers * block) + 4 * block
                   - m.layers * float8.gathered_saving(m, t.precision, s.tp))
    if s.offload_optimizer:  # the moments in host memory, a slice of them in two GPU buffers at a time
        cpu += opt
        opt = 0
        buffers += 2 * 4 * OFFLOAD_SLICE_ELEMENTS
        notes.append("AdamW's moments in host memory, streamed through the GPU for each step")
    return {"params": int(params), "grads": int(grads), "optimizer": int(opt),
            "comm_buffers": int(buffers)}, int(cpu), notes


def adapter_states(m: ModelSpec, t: TrainSpec, s: Strategy, lo: AdapterLayout) -> tuple[dict[str, int], int, list[str]]:
    """model_states() of a LoRA run (data-parallel layouts: plan/recommend.py plans no other).
    The frozen weights are stored in the precision the run computes in (bf16: 2 bytes; the
    adapted layers' weights in NF4 under --quantize nf4, plan/adapters.py) with no gradients
    and no optimizer state; FSDP2 and ZeRO-3 shard them, DDP and ZeRO-1/2 replicate them. The
    adapters (A) are trainable parameters as the engine keeps them: torch fp32 weights, fp32
    gradients and the optimizer's k bytes (16 with Adam), DeepSpeed bf16 weights and
    gradients with an fp32 master copy and moments, sharded as the full model's states are.
    What is gathered is the frozen weights as stored and the adapters in the compute dtype."""
    n, k, a = s.shard_group, t.optimizer_bytes, lo.params
    wide = 2 if t.dtype == "bf16" else 4  # bytes of a parameter in the compute dtype
    frozen = lo.frozen_bytes(m.params, False, wide)
    block = lo.frozen_bytes(m.block_params, True, wide) + wide * lo.block_params  # one block, gathered
    outer = frozen - m.layers * lo.frozen_bytes(m.block_params, True, wide)
    notes: list[str] = []
    cpu = 0.0
    if s.engine is Engine.DEEPSPEED:
        params = (frozen + wide * a) / (n if s.shard == "params" else 1)
        grads = wide * a / (n if s.shard in ("grads", "params") else 1)
        opt = ((4 + k) if wide == 2 else k) * a / (n if s.shard != "none" else 1)
        bucket = 2 * min(5e8, a) if s.shard in ("optimizer", "grads") else 0
        if s.shard == "params":  # prefetch buckets, live parameters and the gathered embeddings/head
            bucket = 2 * (2 * 0.9 * m.hidden**2 + 1e9 / max(1, m.layers)) + outer
        if s.offload_optimizer:
            cpu += opt + 4 * a / n
            opt = 0
            notes.append("the adapters' optimizer state and its step on the CPU (DeepSpeed's CPU Adam)")
        if s.offload_params:
            cpu += params
            params = 2 * block
        return {"params": int(params), "grads": int(grads), "optimizer": int(opt),
                "comm_buffers": int(bucket)}, int(cpu), notes
    sharded = s.shard in ("grads", "params")
    params = (frozen + 4 * a) / (n if sharded else 1) + cast_copies(m, t, s)
    grads = 4 * a / (n if sharded else 1)
    opt = k * a / (n if s.shard != "none" else 1)
    buffers = 0.0
    if s.shard == "params":  # the root gathered, the last block and the next one's prefetch, a block's grads
        buffers = outer + 2 * block + 4 * lo.block_params
    if s.keep_gathered:
        buffers = outer + m.layers * block + 4 * lo.block_params
    if s.offload_optimizer:  # the adapters' moments in host memory (training/offload.py)
        cpu += opt
        opt = 0
        buffers += 2 * 4 * OFFLOAD_SLICE_ELEMENTS
        notes.append("the adapters' AdamW moments in host memory, streamed through the GPU for each step")
    return {"params": int(params), "grads": int(grads), "optimizer": int(opt),
            "comm_buffers": int(buffers)}, int(cpu), notes


def adapter_activations(m: ModelSpec, t: TrainSpec, s: Strategy, micro: int) -> tuple[int, int]:
    """What low-rank adapters add to activations() (stored, transient): each adapted layer's
    A output (r wide, in the compute dtype), which B keeps for its backward, and with dropout
    the dropped copy of the layer's input (compute dtype) and its bool mask; under full
    checkpointing one block's worth, recomputed in its backward. The frozen layers' inputs
    stay counted as the full model's: the adapters keep the same tensors (without dropout),
    and the ops around them keep theirs. Under NF4, one adapted weight dequantized to the
    compute dtype at a time (torchao's linear dequantizes in forward and again in backward)."""
    lo = adapters_of(m, t.adapters)
    if lo is None:
        return 0, 0
    a = 2 if t.dtype == "bf16" else 4
    per_token = a * lo.rank * len(lo.block) + ((a + 1) * lo.block_inputs if lo.spec.dropout > 0 else 0)
    one_block = per_token * micro * t.seq_len / s.cp
    dequantized = a * lo.largest if lo.spec.nf4 else 0
    if s.ac:
        return 0, int(one_block + dequantized)
    return int(one_block * m.layers), int(dequantized)


def trainable_per_gpu(m: ModelSpec, t: TrainSpec, s: Strategy) -> float:
    """The parameters this GPU trains before sharding: the adapters of a LoRA run, else all."""
    lo = adapters_of(m, t.adapters)
    return lo.params if lo is not None else params_per_gpu(m, s)


def cast_copies(m: ModelSpec, t: TrainSpec, s: Strategy) -> float:
    """autocast's bf16 weight copies, saved by each matmul for its backward: alive from
    forward until that matmul's backward, so gone by the end of backward (as the measured
    rows whose peak is there show: docs/decisions.md#autocast-copies).
    The input embedding lookup is not cast; a tied head is. A float8 layer keeps a float8
    copy instead (1 byte)."""
    if not autocast(t, s):
        return 0.0
    lo = adapters_of(m, t.adapters)
    if lo is not None:  # frozen weights are stored in bf16: only the adapters are cast
        return 2.0 * lo.params
    fp8 = float8.converted_block_params(m, t.precision) * m.layers / (s.tp * s.pp)
    return 2 * (params_per_gpu(m, s) - (0 if m.tied else m.vocab * m.hidden)) - fp8


def params_per_gpu(m: ModelSpec, s: Strategy) -> float:
    """Parameters a GPU holds before sharding: a 1/(tp x pp) slice, and 1/ep of the experts."""
    return (m.params - m.expert_params * (1 - 1 / s.ep)) / (s.tp * s.pp)


def persistent_grads(s: Strategy) -> bool:
    """DDP's gradient buckets (gradient_as_bucket_view), ZeRO-3's gradient partitions and
    Megatron's gradient buffers live through the whole step; single-device and FSDP2
    gradients are freed by ``zero_grad(set_to_none=True)`` and appear only during backward,
    and so do ZeRO-1/2's reduce buckets and gradient partitions (those rows' measured peak is
    the start of backward with neither: docs/decisions.md#deepspeed-gradients)."""
    if s.engine is Engine.DEEPSPEED:
        return s.shard == "params"
    return s.engine is not Engine.TORCH or s.kind.uses_ddp or (s.shard == "none" and s.dp > 1)


def deepspeed_step_bytes(m: ModelSpec, t: TrainSpec, s: Strategy) -> float:
    """Reserved beyond the allocated peak by DeepSpeed's optimizer step: the flat gradient
    partition, its fp32 copy and the Adam step's temporaries are allocated after backward
    freed the activations, in blocks too large for the activations' cached ones, so they
    take new segments (calibrated bytes per parameter of this rank's partition; 0 when the
    step runs on the CPU)."""
    if s.engine is not Engine.DEEPSPEED or s.offload_optimizer:
        return 0.0
    per_param: float = calibration()["deepspeed_step_bytes_per_param"]
    return per_param * trainable_per_gpu(m, t, s) / s.shard_group


def side_stream_grads(s: Strategy, grads: float) -> float:
    """Reserved, not allocated, at a peak reached with the activations: FSDP2 reduce-scatters
    the gradients on its own stream, into blocks that stream's cache keeps once zero_grad frees
    them, and the caching allocator never lends one stream's free blocks to another. The sharded
    fp32 gradients' bytes (measured: about the shards' size cached on the reduce-scatter
    stream; docs/decisions.md#reserved-over-allocated)."""
    return grads if s.engine is Engine.TORCH and s.shard in ("grads", "params") else 0.0


def outside_allocator(c: ClusterSpec, s: Strategy) -> int:
    """What nvidia-smi shows beyond torch's reserved memory: the CUDA context (with cuBLAS's and
    cuDNN's handles), NCCL's communicator buffers where there is more than one rank, and what
    DeepSpeed's engine allocates outside torch's allocator (calibrated)."""
    cal = calibration()
    extra = cal["nccl_buffer_bytes"] if c.world > 1 else 0
    if s.engine is Engine.DEEPSPEED:
        extra += cal["deepspeed_outside_bytes"]
    return int(cal["cuda_context_bytes"] + extra)


def spike_fragmentation(m: ModelSpec, t: TrainSpec, s: Strategy, spike: float) -> float:
    """Reserved beyond the allocated peak by the loss spike: its logits-sized blocks come and go
    in an order the cache cannot always reuse (a calibrated share of the traced spike; the
    estimated spike's fitted bytes per vocabulary entry already hold it). A model compiled
    whole in one graph with its loss (one GPU: no DDP cutting the graph) leaves far more of
    them reserved than eager, by a share that varies with the model
    (docs/decisions.md#traced-memory): a fitted 0.33, over rather than under."""
    tr = traced(m, t, s)
    if tr is None:
        return 0.0
    cal = calibration()
    one_graph = whole_model_compiled(t, s) and not s.kind.uses_ddp and tr.loss_inside
    share = float(cal["compiled_graph_spike_fragmentation" if one_graph else "traced_spike_fragmentation"])
    return share * spike


def validation_growth(m: ModelSpec, t: TrainSpec, s: Strategy, micro: int) -> int:
    """The allocator's new segments when the run validates (meshrun train does at the end): a
    model whose eval computes its whole logits (a Hugging Face model or a user's module; not
    meshrun's GPT) validates in smaller micro-batches (defaults.val_micro), whose logits, their
    fp32 copy and log-softmax's fp32 output are new segments wherever larger than every tensor
    training held: the cache serves a request only from a free block as large, and what
    training freed stays reserved. Where training holds logits of its own (no fused loss) they
    fit in those. With Liger's fused loss nvidia-smi's peak rose over training's reserved
    bytes while validating, as this predicts, and not where training held tensors larger than
    the validation's (a Mixtral shape's experts; docs/decisions.md#traced-memory)."""
    tr = traced(m, t, s)
    if tr is None or not tr.eval_logits or s.pp > 1:
        return 0
    entries = val_micro(micro, t.seq_len, m.vocab, "logits") * t.seq_len * m.vocab / s.tp
    logits = (4 if t.dtype == "fp32" else 2) * entries
    made = [logits, 4 * entries, 4 * entries] if t.dtype != "fp32" else [logits, 4 * entries]
    held = max(tr.at("block_largest", micro) / (s.tp * s.cp),
               max(tr.at("tail_largest", micro), tr.at("tail_steepest", micro)) / s.tp)
    return int(sum(x for x in made if x > held))


def estimate(m: ModelSpec, c: ClusterSpec, t: TrainSpec, s: Strategy, micro: int) -> Memory:
    """The larger of two moments: the start of backward (all activations and the loss spike
    alive) and the end of backward (all gradients alive, activations gone)."""
    cal = calibration()
    states, cpu_per_gpu, notes = model_states(m, t, s)
    if s.engine is Engine.DEEPSPEED and s.shard == "params" and t.dtype == "bf16":
        # DeepSpeed's ZeRO-3 accumulates the gradient partitions in fp32, not the paper's
        # 2 bytes, as its measured rows show (docs/decisions.md#deepspeed-gradients)
        states = dict(states, grads=int(4 * trainable_per_gpu(m, t, s) / s.shard_group))
    acts, transient = activations(m, t, s, micro)
    extra_acts, extra_transient = adapter_activations(m, t, s, micro)
    acts, transient = acts + extra_acts, transient + extra_transient
    transient += float8.cast_bytes(m, t.precision, micro * t.seq_len / s.cp, s.tp)
    logits = logits_bytes(m, t, s, micro)
    spike = max(logits, transient)  # the loss spike and one layer's backward do not overlap
    # ZeRO-1/2's reduce buckets are allocated during backward, with the gradients
    late_buffers = states["comm_buffers"] if s.engine is Engine.DEEPSPEED and not persistent_grads(s) else 0
    fixed = states["params"] + states["optimizer"] + states["comm_buffers"] - late_buffers + cal["workspace_bytes"]
    grads_early = (states["grads"] if persistent_grads(s) else 0) + accumulation_grads(t, s, micro, states)
    start = fixed + grads_early + acts + spike
    end = fixed - cast_copies(m, t, s) + states["grads"] + late_buffers + transient
    if start >= end:
        parts = {"grads": grads_early, "activations": acts, "logits": spike,
                 "comm_buffers": states["comm_buffers"] - late_buffers}
    else:
        parts = {"grads": states["grads"], "activations": transient, "logits": 0,
                 "comm_buffers": states["comm_buffers"]}
    allocated = max(start, end)
    frag = int(allocated * (cal["reserved_over_allocated"] - 1) + deepspeed_step_bytes(m, t, s)
               + (side_stream_grads(s, states["grads"]) + spike_fragmentation(m, t, s, spike) if start >= end else 0)
               + validation_growth(m, t, s, micro))
    breakdown = {"params": states["params"], "grads": parts["grads"], "optimizer": states["optimizer"],
                 "activations": parts["activations"], "logits": parts["logits"],
                 "comm_buffers": parts["comm_buffers"], "workspace": cal["workspace_bytes"],
                 "fragmentation": frag, "cuda_context": outside_allocator(c, s)}
    return Memory(breakdown, cpu_per_gpu * c.gpus_per_node, tuple(notes))
