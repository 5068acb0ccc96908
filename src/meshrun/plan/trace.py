"""What a model keeps for backward, traced on the meta device: the planner's activation and
loss terms for any architecture (modelinfo.spec.Traced).

The model runs one forward at micro-batch 1 and 2 of the training sequence length with every
parameter and buffer swapped for a meta tensor (torch.func.functional_call: no memory, no
copy of real weights), then the backward of the part after the last block (final norm, head,
loss), under

* saved_tensors_hooks: every tensor saved for backward, each storage once (views of one
  storage once), attributed to the embeddings, a block, or the tail. Parameters and what is
  derived from one by casts and views alone (autocast's bf16 weight copies, a transposed
  weight) are model states, not activations (the planner counts those copies apart);
* the GPU's numerics: under bf16 autocast (fp32 parameters: single/DDP), CUDA autocast's op
  lists applied at the Python API (the meta device has no autocast); with bf16 parameters
  (FSDP2's MixedPrecisionPolicy, DeepSpeed) no autocast; dropout as CUDA's fused kernel runs
  it (a bool mask saved);
* attention as the GPU's fused kernels save it (q, k, v, the output, an fp32 log-sum-exp):
  SDPA on meta would take the math path and save the whole score matrix. Attention a model
  writes out (eager, soft-capped) is traced as it is. meshrun's Triton head loss and torch's
  grouped_mm (Mixture-of-Experts) are stood in for by functions saving what the GPU's do;
* the tail's peak: a dispatch mode follows the live bytes of every storage made after the
  last block (its saved tensors, the logits' fp32 copies and their gradients).

What torch.compile keeps instead: the first block's forward and backward traced again as one
graph (AOTAutograd with Inductor's decompositions, on the block's inputs from the forward
above), cut by Inductor's min-cut partitioner, which recomputes cheap pointwise ops in backward
rather than keep their outputs; attention there as aten's flash/efficient ops, so that the
partitioner keeps what their backward reads. Its saved bytes over the eager trace's for that
block scale all blocks (``Traced.blocks_compiled``).

Bytes are linear in the micro-batch (``Traced.at``) except where a model chunks its loss,
which the two traced sizes capture. Checked against nvidia-smi's peak and against what one
block keeps on the GPU (docs/decisions.md#traced-memory; the runs: docs/benchmarks.md, "On
models it was not fitted to").

Everything here runs in one thread before training starts; the functions it stands in for
(F.scaled_dot_product_attention, F.grouped_mm, meshrun's head loss, transformers' SDPA entry)
are put back when it ends, also on an error.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Iterator
from typing import Any, cast

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from ..modelinfo.blocks import find_blocks
from ..modelinfo.hf import flex_for_eager
from ..modelinfo.spec import ModelSpec, Traced
from .trace_hooks import autocast_on

BF16, FP32 = torch.bfloat16, torch.float32

# CUDA autocast's op lists (torch/csrc/autograd/autocast_mode.cpp), at the Python API
_LOW = frozenset({"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm",
                  "einsum", "conv1d", "conv2d", "conv3d", "prelu", "chain_matmul", "addmv", "mv",
                  "scaled_dot_product_attention"})
_HIGH = frozenset({"layer_norm", "group_norm", "pow", "__pow__", "__rpow__", "exp", "log", "log2", "log10",
                   "log1p", "expm1", "rsqrt", "reciprocal", "acos", "asin", "cosh", "sinh", "tan", "erfinv",
                   "softplus", "norm", "cosine_similarity", "nll_loss", "cross_entropy", "mse_loss", "l1_loss",
                   "smooth_l1_loss", "huber_loss", "kl_div", "binary_cross_entropy_with_logits", "logsumexp",
                   "cdist", "dist", "renorm"})
_HIGH_UNLESS_DTYPE = frozenset({"softmax", "log_softmax", "cumsum", "cumprod", "prod", "sum"})
_PASS_THROUGH = ("ToCopyBackward", "TBackward", "TransposeBackward", "PermuteBackward", "ViewBackward",
                 "UnsafeViewBackward", "ReshapeAliasBackward", "ExpandBackward", "SelectBackward",
                 "SliceBackward", "AliasBackward", "CloneBackward", "UnsqueezeBackward", "SqueezeBackward")


def trace(model: nn.Module, mode: str, seq: int, blocks_path: str | None = None,
          compiled: bool = True, liger: bool = False, liger_loss: bool = False,
          hf_kernels: bool = False) -> Traced | None:
    """The model's activation bytes in precision ``mode`` at ``seq`` tokens (micro-batch 1
    and 2), with what torch.compile keeps when ``compiled`` (0.1-2 s more on the CPU), or as
    Liger Kernel's fused kernels keep them when ``liger`` (a Hugging Face model Liger patches:
    trace_liger.py; they never run compiled); None when it cannot be traced (no block list, or
    a forward the meta device cannot run: the planner then estimates from the shape);
    ``liger_loss``: Liger's fused loss alone after blocks compiled when ``compiled``. With
    ``hf_kernels`` (and not ``liger``), meshrun's kernels for a Hugging Face model are patched
    in for the trace (kernels/hf.py): its head loss is traced as meshrun's GPT's is."""
    if hf_kernels and not liger:
        from ..kernels.hf import patched

        with patched(model):
            return trace(model, mode, seq, blocks_path, compiled)
    if liger or liger_loss:
        from .trace_liger import liger_twin

        got = None
        with contextlib.suppress(Exception), liger_twin(model, loss_only=not liger) as twin:  # else: unpatched
            got = trace(twin, mode, seq, blocks_path, compiled=compiled and not liger)
        if got is not None:
            return dataclasses.replace(got, liger=True)
    found = find_blocks(model, blocks_path)
    if found is None:
        return None
    blocks = list(found[1])
    first: dict[str, Any] = {}
    with _flex_as_fused(model):
        try:
            one, two = (_trace_once(model, blocks, mode, seq, micro, first if micro == 1 else None)
                        for micro in (1, 2))
        except Exception:  # any model code that needs real values: the estimate stands
            return None
        kept = _compiled_block_bytes(blocks[0], first, mode) if compiled and one["first_block"] else None
    from ..modelinfo.loss import loss_mode

    largest, steepest = _largest_lines(one.pop("tail_made"), two.pop("tail_made"))
    pairs: dict[str, Any] = {k: (one[k], two[k]) for k in one if k != "first_block"}
    traced = Traced(mode=mode, seq=seq, **pairs, tail_largest=largest, tail_steepest=steepest,
                    loss_inside=loss_mode(model) != "logits", eval_logits=loss_mode(model) != "targets")
    if kept is None:
        return traced
    ratio = kept / one["first_block"]
    return dataclasses.replace(traced, blocks_compiled=(int(one["blocks"] * ratio), int(two["blocks"] * ratio)))


_TRACE_FLEX = "meshrun_trace_flex"


@contextlib.contextmanager
def _flex_as_fused(model: nn.Module) -> Iterator[None]:
    """A Hugging Face model the trainer moves off eager attention into FlexAttention on GPUs
    (modelinfo.hf.flex_for_eager) traced as FlexAttention keeps it: queries, keys, values, the
    output and a log-sum-exp, as the fused SDPA kernels (transformers' SDPA entry, causal, no
    mask), not the score matrices eager attention writes out. Soft-capping and sliding
    windows change no saved size. Other models as they are."""
    if not flex_for_eager(model):
        yield
        return
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    def attention(*args: Any, softcap: float | None = None, sliding_window: int | None = None, **kwargs: Any) -> Any:
        return sdpa_attention_forward(*args, **kwargs)

    AttentionInterface.register(_TRACE_FLEX, attention)
    AttentionMaskInterface.register(_TRACE_FLEX, lambda *args, **kwargs: None)
    config: Any = model.config
    config._attn_implementation = _TRACE_FLEX
    try:
        yield
    finally:
        config._attn_implementation = "eager"


def _largest_lines(one: list[int], two: list[int]) -> tuple[tuple[int, int], tuple[int, int]]:
    """(the storage largest at micro-batch 1, the one growing fastest), each as its bytes at
    micro-batch 1 and 2. The tail makes nearly the same storages in the same order at both
    sizes (an op may make one more at one of them): the two lists are aligned as their longest
    common run of tensors whose size stays or doubles, and each pair is one tensor."""
    n, m = len(one), len(two)
    same = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(n - 1, -1, -1):
        for j in range(m - 1, -1, -1):
            if two[j] in (one[i], 2 * one[i]):
                same[i][j] = same[i + 1][j + 1] + 1
            else:
                same[i][j] = max(same[i + 1][j], same[i][j + 1])
    pairs, i, j = [], 0, 0
    while i < n and j < m:
        if two[j] in (one[i], 2 * one[i]) and same[i][j] == same[i + 1][j + 1] + 1:
            pairs.append((one[i], two[j]))
            i, j = i + 1, j + 1
        elif same[i + 1][j] >= same[i][j + 1]:
            i += 1
        else:
            j += 1
    if not pairs:
        return (0, 0), (0, 0)
    return max(pairs), max(pairs, key=lambda ab: (ab[1] - ab[0], ab[1]))


def _trace_once(model: nn.Module, blocks: list[nn.Module], mode: str, seq: int, micro: int,
                first: dict[str, Any] | None) -> dict[str, Any]:
    """The saved bytes by phase at ``micro`` sequences; the first block's inputs into ``first``
    (for _compiled_block_bytes) when given."""
    from ..modelinfo.loss import loss_mode, model_loss

    dtype = BF16 if mode == "bf16" else FP32
    states = _meta_states(model, dtype)
    params = {id(t) for t in states.values()}
    saved, live = _Saved(params, {t.untyped_storage()._cdata for t in states.values()}), _Live()
    cut: dict[str, Any] = {}

    def enter(i: int) -> Callable[..., None]:
        def hook(mod: nn.Module, args: Any) -> None:
            saved.phase = i
        return hook

    def leave(i: int) -> Callable[..., Any]:
        def hook(mod: nn.Module, args: Any, out: Any) -> Any:
            saved.phase = -1 if i < len(blocks) - 1 else len(blocks)
            h = out if isinstance(out, torch.Tensor) else out[0]
            cut.setdefault("input", h.untyped_storage().nbytes())
            if i < len(blocks) - 1:
                return None
            # only the tail runs backward: the graph is cut at the last block's output (kept
            # alive, so storages' identities stay unique) and the live bytes counted from here
            cut["graph"] = h
            g = h.detach().requires_grad_(True)
            live.armed = True
            if isinstance(out, torch.Tensor):
                return g
            return type(out)((g, *out[1:])) if isinstance(out, tuple) else out.__class__(g, *out[1:])
        return hook

    def keep_inputs(mod: nn.Module, args: Any, kwargs: Any) -> None:
        if first is not None:
            first.setdefault("args", (args, kwargs))

    handles = [b.register_forward_pre_hook(enter(i)) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(leave(i)) for i, b in enumerate(blocks)]
    handles.append(blocks[0].register_forward_pre_hook(keep_inputs, with_kwargs=True))
    x = torch.zeros(micro, seq, dtype=torch.long, device="meta")
    try:
        with torch.enable_grad(), _gpu_kernels(), _autocast(mode == "autocast"), live, \
                torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t), _swapped(model, states):
            loss = model_loss(model, loss_mode(model), x, x)
            with _autocast(False):  # autocast does not reach the backward's ops
                loss.backward()
            live.sweep()
    finally:
        for h in handles:
            h.remove()
    per_block = [saved.bytes.get(i, 0) for i in range(len(blocks))]
    return {"embed": saved.bytes.get(-2, 0) + saved.bytes.get(-1, 0), "blocks": sum(per_block),
            "block_max": max(per_block), "block_input": int(cut.get("input", 0)), "tail": live.peak,
            "block_largest": max(saved.largest.get(i, 0) for i in range(len(blocks))),
            "tail_made": live.made, "first_block": per_block[0]}


def _meta_states(model: nn.Module, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """A meta tensor for each parameter (``dtype`` when floating) and buffer, by name; tied
    parameters share one."""
    out: dict[str, torch.Tensor] = {}
    made: dict[int, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in made:
            t = torch.empty(p.shape, dtype=dtype if p.is_floating_point() else p.dtype, device="meta")
            made[id(p)] = t.requires_grad_(p.requires_grad)
        out[name] = made[id(p)]
    for name, b in model.named_buffers(remove_duplicate=False):
        out[name] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    return out


@contextlib.contextmanager
def _swapped(model: nn.Module, states: dict[str, torch.Tensor]) -> Iterator[None]:
    """The model's parameters and buffers replaced by ``states`` for the forward and backward
    (torch.func.functional_call's swap, held open)."""
    from torch.nn.utils._named_member_accessor import NamedMemberAccessor

    accessor = NamedMemberAccessor(model)
    old, _ = accessor.swap_tensors_dict(states, allow_missing=True)
    try:
        yield
    finally:
        accessor.swap_tensors_dict(old, allow_missing=True)


# ---- CUDA autocast on the meta device -------------------------------------------------------

def _cast(obj: Any, to: torch.dtype, only: tuple[torch.dtype, ...]) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(to) if obj.dtype in only and obj.dtype != to else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(o, to, only) for o in obj)
    return obj


class _CudaAutocast(TorchFunctionMode):
    """torch.autocast("cuda", torch.bfloat16)'s casts, when ``enabled``; and always dropout as
    CUDA runs it (its fused kernel saves a bool mask; elsewhere F.dropout keeps a noise tensor)."""

    def __init__(self, enabled: bool) -> None:
        super().__init__()
        self.enabled = enabled

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if func is F.dropout:
            x = args[0] if args else kwargs["input"]
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            training = args[2] if len(args) > 2 else kwargs.get("training", True)
            if training and 0 < p < 1 and x.is_floating_point():
                return torch.native_dropout(x, p, True)[0]
            return x
        if not self.enabled:
            return func(*args, **kwargs)
        if name in _LOW or name in _HIGH:
            to, only = (BF16, (FP32, torch.float16)) if name in _LOW else (FP32, (BF16, torch.float16))
            args = _cast(args, to, only)
            kwargs = {k: _cast(v, to, only) for k, v in kwargs.items()}
        elif name in _HIGH_UNLESS_DTYPE and kwargs.get("dtype") is None:
            first = args[0] if args else kwargs.get("input")
            if isinstance(first, torch.Tensor) and first.dtype in (BF16, torch.float16):
                kwargs = {**kwargs, "dtype": FP32}
                if func is F.softmax and len(args) > 3:  # F.softmax(x, dim, _stacklevel, dtype)
                    args = args[:3]
        return func(*args, **kwargs)


@contextlib.contextmanager
def _autocast(on: bool) -> Iterator[None]:
    """_CudaAutocast, with torch.is_autocast_enabled answering ``on`` for any device (models ask
    it; for the meta device it raises)."""
    enabled, dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
    torch.is_autocast_enabled = lambda *a: on
    torch.get_autocast_dtype = lambda *a: BF16
    try:
        with _CudaAutocast(on):
            yield
    finally:
        torch.is_autocast_enabled, torch.get_autocast_dtype = enabled, dtype


# ---- the GPU's fused kernels, as what they save ---------------------------------------------

class _FusedSDPA(torch.autograd.Function):
    """What flash, cuDNN and memory-efficient attention save: q, k, v, out, an fp32 log-sum-exp
    (and a mask, when given)."""

    @staticmethod
    def forward(ctx: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                mask: torch.Tensor | None) -> torch.Tensor:
        b, heads, t = q.shape[:-1]
        # the kernels write (b, t, heads, d) and return it transposed: the caller's
        # transpose(1, 2) before the output projection copies nothing
        out = q.new_empty(b, t, heads, v.shape[-1]).transpose(1, 2)
        lse = q.new_empty(b, heads, t, dtype=FP32)
        ctx.save_for_backward(q, k, v, out, lse, *(() if mask is None else (mask,)))
        return out

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def _as_autocast(*ts: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``ts`` as SDPA sees them: under autocast (SDPA is on its bf16 list) fp32 cast to bf16."""
    return tuple(t.to(BF16) if autocast_on() and t.dtype == FP32 else t for t in ts)


def _fused_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False) -> torch.Tensor:
    q, k, v = _as_autocast(q, k, v)
    out: torch.Tensor = _FusedSDPA.apply(q, k, v, attn_mask)
    return out


class _GroupedMM(torch.autograd.Function):
    """torch's grouped_mm as CUDA runs it (its meta kernel takes bf16 alone): both operands saved."""

    @staticmethod
    def forward(ctx: Any, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(a, b)
        # the output computed from a and b (at a's precision) as on the GPU, for a partitioner to see
        return torch.ops.aten.mm.default(a, b[0].to(a.dtype))

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # what the GPU's backward reads (g, a and b: so that a partitioner keeps them), at the
        # gradients' shapes; the values are never looked at
        a, b = ctx.saved_tensors
        grad_a = g @ b[0].to(g.dtype).transpose(-1, -2)
        return grad_a, (a.transpose(0, 1) @ g).to(b.dtype).expand_as(b)


def _grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, *, offs: Any = None, bias: Any = None,
                out_dtype: Any = None) -> torch.Tensor:
    out: torch.Tensor = _GroupedMM.apply(mat_a, mat_b)
    return out


class _HeadLoss(torch.autograd.Function):
    """meshrun's Triton head loss (kernels/head_loss.py): h, the weight, the targets and
    the bf16 logits (overwritten by their gradient in place) kept for backward."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, w: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = h @ w.t()
        ctx.save_for_backward(h, w, logits, targets)
        return h.new_empty(h.shape[0], dtype=FP32)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        h, w, dlogits, _ = ctx.saved_tensors
        return dlogits @ w, dlogits.t() @ h, None


def _head_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100) -> torch.Tensor:
    dt = BF16 if autocast_on() else h.dtype
    rows: torch.Tensor = _HeadLoss.apply(h.to(dt), weight.to(dt), targets)
    return rows.sum() / targets.numel()


def _flash_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None = None,
                dropout_p: float = 0.0, is_causal: bool = False, scale: float | None = None,
                enable_gqa: bool = False) -> torch.Tensor:
    """SDPA as the kernels torch.compile's graphs call on the GPU (flash attention; with a mask,
    memory-efficient attention): aten's ops, whose meta kernels and backward formulas make the
    partitioner keep what the GPU's backward reads."""
    q, k, v = _as_autocast(q, k, v)
    if attn_mask is None:
        out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, False, scale=scale)
    else:
        out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, attn_mask, True, dropout_p,
                                                                    is_causal, scale=scale)
    return out[0]


@contextlib.contextmanager
def _gpu_kernels(compiled: bool = False) -> Iterator[None]:
    from ..kernels import head_loss

    sdpa = _flash_sdpa if compiled else _fused_sdpa
    swaps: list[tuple[Any, str, Any]] = [(F, "scaled_dot_product_attention", sdpa),
                                         (F, "grouped_mm", _grouped_mm), (head_loss, "head_cross_entropy", _head_loss)]
    with contextlib.suppress(ImportError):
        import transformers.masking_utils as masking

        if hasattr(masking, "find_packed_sequence_indices"):  # it reads position values, which meta has not
            swaps.append((masking, "find_packed_sequence_indices", lambda position_ids: None))
    missing = object()
    old = [(obj, name, getattr(obj, name, missing)) for obj, name, _ in swaps]
    try:
        for obj, name, new in swaps:
            setattr(obj, name, new)
        yield
    finally:
        for obj, name, was in old:
            if was is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, was)


# ---- what torch.compile keeps ------------------------------------------------------------

def _compiled_block_bytes(block: nn.Module, first: dict[str, Any], mode: str) -> int | None:
    """What ``block`` keeps for backward when torch.compile compiles it: its forward and backward
    traced as one graph (AOTAutograd, with Inductor's decompositions) on the block's inputs of the
    eager trace (``first``), cut by Inductor's min-cut partitioner, which recomputes cheap
    pointwise ops in backward rather than keep their outputs. The bytes of the saved values that
    depend on the block's input, each storage once; None when it cannot be traced."""
    import torch.utils._pytree as pytree
    from torch._functorch.aot_autograd import aot_function
    from torch._functorch.partitioners import min_cut_rematerialization_partition
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table

    from ..kernels.inductor import compile_options

    if "args" not in first:
        return None
    flat, tree = pytree.tree_flatten(first["args"])
    where = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
    states = _meta_states(block, BF16 if mode == "bf16" else FP32)
    inputs = [flat[i].detach().requires_grad_(flat[i].is_floating_point() and flat[i].requires_grad) for i in where]
    graphs: dict[str, Any] = {}

    def run(states: dict[str, torch.Tensor], *tensors: torch.Tensor) -> torch.Tensor:
        args = list(flat)
        for i, t in zip(where, tensors):
            args[i] = t
        a, kw = pytree.tree_unflatten(args, tree)
        out = torch.func.functional_call(block, states, a, kw)
        return out if isinstance(out, torch.Tensor) else out[0]

    def partition(gm: Any, joint_inputs: Any, **kwargs: Any) -> Any:
        graphs["fw"], graphs["bw"] = min_cut_rematerialization_partition(gm, joint_inputs, compiler="inductor",
                                                                         **kwargs)
        return graphs["fw"], graphs["bw"]

    try:
        # (under the trainer's Inductor settings: with dropout's masks saved, its partition keeps them)
        with _warnings_off(), _gpu_kernels(compiled=True), _autocast(mode == "autocast"), \
                inductor_config.patch(compile_options(False)):
            f = aot_function(run, fw_compiler=cast(Any, _as_is), partition_fn=partition,
                             decompositions=select_decomp_table())
            f(states, *inputs)
    except Exception:  # a block the tracer cannot run on meta: the planner keeps the eager bytes
        return None
    return _saved_bytes(graphs["fw"], graphs["bw"], n_states=len(pytree.tree_leaves(states)))


def _as_is(gm: Any, example: Any) -> Any:
    return gm


def _saved_bytes(fw: Any, bw: Any, n_states: int) -> int:
    """The bytes of the forward graph's outputs that the backward graph reads (its inputs other
    than the incoming gradients), counting only values that depend on an input past the first
    ``n_states`` (the parameters and buffers): a weight's bf16 copy is a model state."""
    saved_count = sum(1 for n in bw.graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents"))
    out = next(n for n in fw.graph.nodes if n.op == "output").args[0]
    saved = list(out)[len(out) - saved_count:] if saved_count else []
    placeholders = [n for n in fw.graph.nodes if n.op == "placeholder"]
    activation = {n for n in placeholders[n_states:]}
    for n in fw.graph.nodes:
        if n.op == "call_function" and any(a in activation for a in n.all_input_nodes):
            activation.add(n)
    seen: set[int] = set()
    total = 0
    for n in saved:
        val = getattr(n, "meta", {}).get("val")
        if n not in activation or not isinstance(val, torch.Tensor):
            continue
        storage = val.untyped_storage()
        if storage._cdata not in seen:
            seen.add(storage._cdata)
            total += storage.nbytes()
    return total


@contextlib.contextmanager
def _warnings_off() -> Iterator[None]:
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


# ---- what is saved, and what is live --------------------------------------------------------

def _weight_derived(t: torch.Tensor, params: set[int]) -> bool:
    """A parameter, or one seen through casts and views alone (autograd's chain back to it)."""
    if id(t) in params:
        return True
    fn = t.grad_fn
    for _ in range(8):
        if fn is None:
            return False
        if type(fn).__name__ == "AccumulateGrad":
            return id(getattr(fn, "variable", None)) in params
        if not type(fn).__name__.startswith(_PASS_THROUGH):
            return False
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return False


class _Saved:
    """saved_tensors_hooks' pack: each storage's bytes once, to the phase that saved it first
    (-2 the embeddings, i block i, -1 between blocks, L the tail)."""

    def __init__(self, params: set[int], state_storages: set[int]) -> None:
        self.params, self.state_storages = params, state_storages
        self.seen: set[int] = set()
        self.phase = -2
        self.bytes: dict[int, int] = {}
        self.largest: dict[int, int] = {}  # the largest storage each phase saves

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        key = t.untyped_storage()._cdata
        if key in self.seen:
            return t
        self.seen.add(key)  # (autograd holds it until backward: the identity is not reused)
        if key not in self.state_storages and not _weight_derived(t, self.params):
            nbytes = t.untyped_storage().nbytes()
            self.bytes[self.phase] = self.bytes.get(self.phase, 0) + nbytes
            self.largest[self.phase] = max(self.largest.get(self.phase, 0), nbytes)
        return t


class _Live(TorchDispatchMode):
    """The peak of the bytes of storages made while armed that are still alive."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.live: dict[int, tuple[Any, int]] = {}
        self.peak = 0
        self.made: list[int] = []  # the bytes of each storage made while armed, in order

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        out = func(*args, **(kwargs or {}))
        if self.armed:
            from torch.multiprocessing.reductions import StorageWeakRef

            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    if st._cdata not in self.live:
                        self.live[st._cdata] = (StorageWeakRef(st), st.nbytes())
                        self.made.append(st.nbytes())
            self.sweep()
        return out

    def sweep(self) -> None:
        for k in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[k]
        self.peak = max(self.peak, sum(n for _, n in self.live.values()))


@contextlib.contextmanager
def _as_base_model(model: nn.Module) -> Iterator[None]:
    """A model that holds PEFT's low-rank adapters traced as its base model, fully trainable:
    the adapters switched off (PEFT's ``enable_adapters(False)``) and every floating-point
    parameter requiring its gradient. The planner adds the adapters' own terms and takes the
    frozen weights' gradients out itself (plan/adapters.py, memory.adapter_activations); traced
    frozen, nothing before the first adapter would be kept, and under autocast the frozen
    weights' bf16 copies would count as activations. Everything is put back when it ends."""
    layers = [m for m in model.modules() if callable(getattr(m, "enable_adapters", None))
              and isinstance(getattr(m, "disable_adapters", None), bool)]
    if not layers:
        yield
        return
    wanted = {id(p): p.requires_grad for p in model.parameters()}
    off = {id(m): m.disable_adapters for m in layers}
    try:
        for m in layers:
            cast(Any, m).enable_adapters(False)
        for p in model.parameters():
            if p.is_floating_point():
                p.requires_grad_(True)
        yield
    finally:
        for m in layers:
            cast(Any, m).enable_adapters(not off[id(m)])
        for p in model.parameters():
            p.requires_grad_(wanted[id(p)])


def with_trace(spec: ModelSpec, model: nn.Module, seq: int, modes: tuple[str, ...],
               blocks_path: str | None = None, compiled: bool = True, liger: bool = False,
               liger_loss: bool = False, hf_kernels: bool = False) -> ModelSpec:
    """``spec`` with what ``model`` keeps for backward traced in each of ``modes`` at ``seq``
    tokens (unchanged where it cannot be traced); torch.compile's too when ``compiled``; as
    Liger Kernel's kernels keep it when ``liger`` (its fused loss alone: ``liger_loss``), or
    meshrun's for a Hugging Face model when ``hf_kernels``. A model holding low-rank adapters
    is traced as its base model (``_as_base_model``)."""
    with _as_base_model(model):
        got = tuple(t for t in (trace(model, m, seq, blocks_path, compiled, liger, liger_loss, hf_kernels)
                                for m in modes)
                    if t is not None)
    return dataclasses.replace(spec, traced=got) if got else spec
