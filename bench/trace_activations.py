"""What autograd keeps for backward, traced on the meta device: a PROTOTYPE for the memory
planner's activation and loss terms (src/meshrun/plan/memory.py), checked against the measured
rows of bench/memory_grid.py. Nothing is allocated: every tensor is a meta tensor.

For a measured row (its model built as bench/memory_grid.py's model_spec builds it, the module
kept), one forward of the whole model at the row's (micro_batch, seq), then the backward of
the part after the last block (final norm, head, loss), under

* torch.autograd.graph.saved_tensors_hooks: every tensor saved for backward, each storage
  counted once (views of one storage once; keyed by the storage's identity), attributed to the
  phase that first saved it: the embeddings, block i, or the tail (norm + head + loss).
  Parameters, and tensors derived from a parameter by casts and views only (autocast's bf16
  weight copies, a transposed weight, an expert's slice), are not activations: counted apart
  (the planner's cast_copies);
* bf16 semantics of the real run. single/DDP: fp32 parameters under CUDA's bf16 autocast,
  which does not exist on the meta device, so a TorchFunctionMode (CudaAutocast below) applies
  CUDA autocast's op lists at the Python API: matmuls (linear, matmul, mm, bmm, addmm, baddbmm,
  einsum, SDPA) cast their floating inputs to bf16; layer_norm, pow, exp, log, rsqrt and the
  losses to fp32; softmax, log_softmax, cumsum and sum without a dtype get dtype=fp32; and
  torch.is_autocast_enabled says True (meshrun's GPT asks it). Ops autocast reaches inside
  C++ composites are covered through their Python entry point; grouped_mm is not autocast (as
  on CUDA). FSDP2: parameters cast to bf16, no autocast (FSDP2's MixedPrecisionPolicy);
* SDPA replaced by a custom autograd Function that saves what the GPU's fused kernels save
  (q, k, v as given, the output, an fp32 log-sum-exp of (b, heads, t); with a mask, the mask):
  on meta (and CPU) torch would take the math path and save the whole attention matrix.
  Eager attention (Gemma-2's, with its soft-capping) is traced as it is;
* meshrun's GPT: its Triton loss (kernels/head_loss.py) stood in for by a function saving what
  _HeadCrossEntropy saves (h, weight, the bf16 logits that hold their gradient, targets).

The tail's backward also runs on meta under a TorchDispatchMode that follows the live bytes of
every storage created after the last block (its saved tensors, the transient logits copies
and their gradients): its peak is the loss spike. The graph is cut at the last block's output,
so only the tail runs backward.

    python bench/trace_activations.py --report tests/data/calibration/unseen-models_h200_2026-11-28.jsonl
    python bench/trace_activations.py --report FILE --rows hf-llama3.2-1b-ddp-s2048-b4 -v
    python bench/trace_activations.py --source hf:llama3.2-1b --seq 2048 --micro 4 --strategy ddp -v
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(BENCH)
sys.path.insert(0, BENCH)
sys.path.insert(0, os.path.join(REPO, "src"))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.overrides import TorchFunctionMode  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

GIB = 2**30
HF_ATTN = "built"  # --hf-attn
BF16, FP32 = torch.bfloat16, torch.float32


# ---- the model, as the training run builds it ---------------------------------------------

def build_module(row: dict[str, Any], where: str) -> tuple[nn.Module, str]:
    """(module on meta, kind: gpt | user | hf), built by bench/memory_grid.py as the run built it."""
    from memory_grid import build_module as built_as_run

    kind = row["source"].partition(":")[0]
    model = built_as_run(row, where)
    if kind == "hf":
        model.to("meta")  # the rotary tables too: their values do not matter here
        if HF_ATTN != "built" and model.config._attn_implementation != HF_ATTN:
            # transformers 5.17 (the measured runs') built Gemma-2 with SDPA, which ignored its
            # attention soft-capping; 5.24 refuses SDPA for it and builds eager attention
            model.config._attn_implementation = HF_ATTN
    model.train()
    return model, kind


def blocks_of(model: nn.Module) -> list[nn.Module]:
    from meshrun.modelinfo.read import find_blocks

    found = find_blocks(model)
    if not found:
        raise SystemExit(f"no block list found in {type(model).__name__}")
    return list(found[1])


def cast_params(model: nn.Module, dtype: torch.dtype) -> None:
    """Floating parameters to ``dtype`` in place (tied ones stay tied), buffers untouched:
    what FSDP2's MixedPrecisionPolicy(param_dtype=bf16) hands the forward."""
    for p in model.parameters():
        if p.is_floating_point():
            p.data = p.data.to(dtype)


# ---- CUDA autocast, emulated at the Python API ----------------------------------------------

_LOW = {"linear", "matmul", "__matmul__", "__rmatmul__", "mm", "bmm", "addmm", "baddbmm", "addbmm", "einsum",
        "conv1d", "conv2d", "conv3d", "prelu", "chain_matmul", "addmv", "mv", "scaled_dot_product_attention"}
_FP32 = {"layer_norm", "group_norm", "pow", "__pow__", "__rpow__", "exp", "log", "log2", "log10", "log1p",
         "expm1", "rsqrt", "reciprocal", "acos", "asin", "cosh", "sinh", "tan", "erfinv", "softplus", "norm",
         "cosine_similarity", "nll_loss", "cross_entropy", "mse_loss", "l1_loss", "smooth_l1_loss",
         "huber_loss", "kl_div", "binary_cross_entropy_with_logits", "logsumexp", "cdist", "dist", "renorm"}
_FP32_OPT_DTYPE = {"softmax", "log_softmax", "cumsum", "cumprod", "prod", "sum"}


def _cast(obj: Any, to: torch.dtype, only: tuple[torch.dtype, ...]) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(to) if obj.dtype in only and obj.dtype != to else obj
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(o, to, only) for o in obj)
    return obj


class CudaAutocast(TorchFunctionMode):
    """torch.autocast("cuda", torch.bfloat16)'s casts for tensors on any device (here meta),
    when ``enabled``; and, always, dropout as CUDA runs it: its fused kernel, which saves a
    bool mask (off CUDA, F.dropout multiplies by a noise tensor of the input's dtype)."""

    def __init__(self, enabled: bool = True) -> None:
        super().__init__()
        self.enabled = enabled

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name == "dropout" and func is F.dropout:
            x = args[0] if args else kwargs["input"]
            p = args[1] if len(args) > 1 else kwargs.get("p", 0.5)
            train = args[2] if len(args) > 2 else kwargs.get("training", True)
            if train and 0 < p < 1 and x.is_floating_point():
                return torch.native_dropout(x, p, True)[0]
            return x
        if not self.enabled:
            return func(*args, **kwargs)
        if name in _LOW:
            args, kwargs = _cast(args, BF16, (FP32, torch.float16)), {k: _cast(v, BF16, (FP32, torch.float16))
                                                                       for k, v in kwargs.items()}
        elif name in _FP32:
            args, kwargs = _cast(args, FP32, (BF16, torch.float16)), {k: _cast(v, FP32, (BF16, torch.float16))
                                                                       for k, v in kwargs.items()}
        elif name in _FP32_OPT_DTYPE and kwargs.get("dtype") is None:
            first = args[0] if args else kwargs.get("input")
            if isinstance(first, torch.Tensor) and first.dtype in (BF16, torch.float16):
                kwargs = {**kwargs, "dtype": FP32}
                if name == "softmax" and func is F.softmax and len(args) > 3:  # F.softmax(x, dim, _stacklevel, dtype)
                    args = args[:3]
        return func(*args, **kwargs)


@contextlib.contextmanager
def autocast_emulated(on: bool):
    """CudaAutocast when ``on``; and torch.is_autocast_enabled answers ``on`` for any device
    (it raises for meta, and meshrun's GPT asks it)."""
    enabled, dtype = torch.is_autocast_enabled, torch.get_autocast_dtype
    torch.is_autocast_enabled = lambda *a: on  # type: ignore[assignment]
    torch.get_autocast_dtype = lambda *a: BF16  # type: ignore[assignment]
    try:
        with CudaAutocast(on):
            yield
    finally:
        torch.is_autocast_enabled, torch.get_autocast_dtype = enabled, dtype  # type: ignore[assignment]


# ---- fused attention and meshrun's Triton loss, as the GPU runs them --------------------------

class FusedSDPA(torch.autograd.Function):
    """What flash / cuDNN / memory-efficient attention save: q, k, v, out, an fp32 log-sum-exp."""

    @staticmethod
    def forward(ctx, q, k, v, mask):  # type: ignore[override]
        # the kernels write (b, t, heads, d) and return it transposed, so the caller's
        # transpose(1, 2).contiguous() / reshape before the output projection copies nothing
        b, heads, t = q.shape[:-1]
        out = q.new_empty(b, t, heads, v.shape[-1]).transpose(1, 2)
        lse = q.new_empty(b, heads, t, dtype=FP32)
        ctx.save_for_backward(q, k, v, out, lse, *(() if mask is None else (mask,)))
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        q, k, v = ctx.saved_tensors[:3]
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), None


def _autocast_on(t: torch.Tensor) -> bool:
    try:
        return bool(torch.is_autocast_enabled(t.device.type))  # (patched to True under the emulation)
    except RuntimeError:
        return False


def fused_sdpa(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if _autocast_on(q):  # SDPA is on autocast's bf16 list
        q, k, v = (t.to(BF16) if t.dtype == FP32 else t for t in (q, k, v))
    return FusedSDPA.apply(q, k, v, attn_mask)


class GroupedMM(torch.autograd.Function):
    """torch's grouped_mm as CUDA runs it (its meta kernel takes bf16 alone; the measured DDP
    run gave it fp32, which CUDA took): saves both operands, as aten's derivative does."""

    @staticmethod
    def forward(ctx, a, b):  # type: ignore[override]
        ctx.save_for_backward(a, b)
        return a.new_empty(a.shape[0], b.shape[-1])

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        a, b = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(b)


def grouped_mm(mat_a, mat_b, *, offs=None, bias=None, out_dtype=None):
    return GroupedMM.apply(mat_a, mat_b)


class _StandInHeadLoss(torch.autograd.Function):
    """meshrun's _HeadCrossEntropy: the bf16 logits, overwritten by their gradient, kept."""

    @staticmethod
    def forward(ctx, h, w, targets):  # type: ignore[override]
        logits = h @ w.t()
        rows = h.new_empty(h.shape[0], dtype=FP32)
        ctx.save_for_backward(h, w, logits, targets)
        return rows

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        h, w, dlogits, _ = ctx.saved_tensors
        return dlogits @ w, dlogits.t() @ h, None


def stand_in_head_cross_entropy(h, weight, targets, ignore_index=-100):
    dt = BF16 if _autocast_on(h) else h.dtype
    rows = _StandInHeadLoss.apply(h.to(dt), weight.to(dt), targets)
    return rows.sum() / targets.numel()


@contextlib.contextmanager
def gpu_kernels():
    from meshrun.train.kernels import head_loss

    sdpa, ce, gmm = F.scaled_dot_product_attention, head_loss.head_cross_entropy, getattr(F, "grouped_mm", None)
    F.scaled_dot_product_attention = fused_sdpa  # type: ignore[assignment]
    F.grouped_mm = grouped_mm  # type: ignore[attr-defined]
    head_loss.head_cross_entropy = stand_in_head_cross_entropy  # type: ignore[assignment]
    try:
        import transformers.masking_utils as masking
    except ImportError:
        masking = None
    try:
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
        hf_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]
        # (as transformers 5.17's did: a soft-capping model's softcap ignored, not refused)
        ALL_ATTENTION_FUNCTIONS["sdpa"] = lambda *a, softcap=None, **k: hf_sdpa(*a, **k)
    except (ImportError, KeyError):
        hf_sdpa = None
    if masking is not None and hasattr(masking, "find_packed_sequence_indices"):
        # its test for packed sequences reads values (meta has none); the run's are unpacked
        packed = masking.find_packed_sequence_indices
        masking.find_packed_sequence_indices = lambda position_ids: None
    try:
        yield
    finally:
        F.scaled_dot_product_attention = sdpa  # type: ignore[assignment]
        if gmm is None:
            del F.grouped_mm  # type: ignore[attr-defined]
        else:
            F.grouped_mm = gmm  # type: ignore[attr-defined]
        head_loss.head_cross_entropy = ce  # type: ignore[assignment]
        if masking is not None and hasattr(masking, "find_packed_sequence_indices"):
            masking.find_packed_sequence_indices = packed
        if hf_sdpa is not None:
            ALL_ATTENTION_FUNCTIONS["sdpa"] = hf_sdpa


# ---- what is saved, and what is live -------------------------------------------------------

_PASS_THROUGH = ("ToCopyBackward", "TBackward", "TransposeBackward", "PermuteBackward", "ViewBackward",
                 "UnsafeViewBackward", "ReshapeAliasBackward", "ExpandBackward", "SelectBackward",
                 "SliceBackward", "AliasBackward", "CloneBackward", "UnsqueezeBackward", "SqueezeBackward")


def weight_derived(t: torch.Tensor, params: set[int]) -> bool:
    """A parameter, or a parameter seen through casts and views only (autograd's chain)."""
    if id(t) in params:
        return True
    fn = t.grad_fn
    for _ in range(8):
        if fn is None:
            return False
        if type(fn).__name__ == "AccumulateGrad":
            return isinstance(fn.variable, nn.Parameter)
        if not type(fn).__name__.startswith(_PASS_THROUGH):
            return False
        nxt = [f for f, _ in fn.next_functions if f is not None]
        if len(nxt) != 1:
            return False
        fn = nxt[0]
    return False


class Saved:
    """saved_tensors_hooks' pack: each storage once, to the phase that saved it first."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {id(p) for p in model.parameters()}
        self.param_storages = {p.untyped_storage()._cdata for p in model.parameters()}
        self.param_storages |= {b.untyped_storage()._cdata for b in model.buffers()}
        self.seen: dict[int, str] = {}
        self.phase = "embed"
        self.bytes: dict[str, int] = defaultdict(int)
        self.weights: dict[str, int] = defaultdict(int)
        self.items: dict[str, list[tuple[int, str]]] = defaultdict(list)

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        key = st._cdata
        if key in self.seen:
            return t
        self.seen[key] = self.phase  # (autograd holds it until backward: the identity is not reused)
        if key in self.param_storages:
            return t
        n = st.nbytes()
        if weight_derived(t, self.params):
            self.weights[self.phase] += n
            return t
        self.bytes[self.phase] += n
        producer = type(t.grad_fn).__name__ if t.grad_fn is not None else ("leaf" if t.requires_grad else "no-grad")
        self.items[self.phase].append((n, f"{str(t.dtype)[6:]:>8} {tuple(t.shape)} from {producer}"))
        return t


class Live(TorchDispatchMode):
    """Bytes of the storages created while armed that are still alive: their peak."""

    def __init__(self) -> None:
        super().__init__()
        self.armed = False
        self.live: dict[int, tuple[Any, int]] = {}
        self.now = self.peak = 0
        self.exclude: set[int] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self.armed:
            from torch.multiprocessing.reductions import StorageWeakRef

            for t in (out if isinstance(out, (tuple, list)) else (out,)):
                if isinstance(t, torch.Tensor):
                    st = t.untyped_storage()
                    if st._cdata not in self.live:
                        self.live[st._cdata] = (StorageWeakRef(st), st.nbytes())
            self.sweep()
        return out

    def sweep(self) -> None:
        for k in [k for k, (ref, _) in self.live.items() if ref.expired()]:
            del self.live[k]
        self.now = sum(n for k, (_, n) in self.live.items() if k not in self.exclude)
        self.peak = max(self.peak, self.now)


# ---- one trace ------------------------------------------------------------------------------

def _hidden(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def _replace_hidden(out: Any, new: torch.Tensor) -> Any:
    if isinstance(out, torch.Tensor):
        return new
    return type(out)((new, *out[1:])) if isinstance(out, tuple) else out.__class__(new, *out[1:])


def run_loss(model: nn.Module, kind: str, x: torch.Tensor) -> torch.Tensor:
    """meshrun's model_loss (train/parallel/layouts.py): the model's own loss for ``targets``
    (its GPT) and ``labels`` (Hugging Face: the inputs as labels, no cache), else
    F.cross_entropy over the logits made fp32."""
    if kind == "gpt":
        return model(x, x)
    if kind == "hf":
        return model(input_ids=x, labels=x, use_cache=False).loss
    out = model(x)
    return F.cross_entropy(out.float().view(-1, out.shape[-1]), x.reshape(-1))


def trace(row: dict[str, Any], where: str, verbose: bool = False) -> dict[str, Any]:
    autocast = row["strategy_asked"] in ("single", "ddp")
    t0 = time.perf_counter()
    model, kind = build_module(row, where)
    if not autocast:
        cast_params(model, BF16)
    blocks = blocks_of(model)
    built_s = time.perf_counter() - t0
    saved, live = Saved(model), Live()
    captured: dict[str, Any] = {}

    def pre(i: int):
        def hook(mod, args, kwargs):
            saved.phase = f"block {i}"
            if i == 0 and "args" not in captured:
                captured.update(args=args, kwargs=kwargs)
        return hook

    def post(i: int):
        def hook(mod, args, kwargs, out):
            saved.phase = "between" if i < len(blocks) - 1 else "tail"
            if i == len(blocks) - 1:  # cut the graph here: only the tail runs backward
                h = _hidden(out)
                captured["last_out"] = h.numel() * h.element_size()
                captured["graph"] = h  # the blocks' graph stays alive (and their storages' identities unique)
                cut = h.detach().requires_grad_(True)
                live.armed = True
                return _replace_hidden(out, cut)
            return None
        return hook

    handles = [b.register_forward_pre_hook(pre(i), with_kwargs=True) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(post(i), with_kwargs=True) for i, b in enumerate(blocks)]
    x = torch.zeros(row["micro_batch"], row["seq"], dtype=torch.long, device="meta")
    t1 = time.perf_counter()
    with gpu_kernels(), autocast_emulated(autocast), live, \
            torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        loss = run_loss(model, kind, x)
        fwd_s = time.perf_counter() - t1
        live.sweep()
        tail_saved_live = live.now
        with autocast_emulated(False):  # (autocast does not reach the backward's ops)
            loss.backward()
        live.sweep()
    live.armed = False
    for h in handles:
        h.remove()
    grads_in_tail = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
    # one block on its own, as the planner would trace it (timed; its saved bytes checked)
    one = Saved(model)
    times = []
    for _ in range(3):
        one = Saved(model)
        one.phase = "block"
        t2 = time.perf_counter()
        with gpu_kernels(), autocast_emulated(autocast), \
                torch.autograd.graph.saved_tensors_hooks(one.pack, lambda t: t):
            blocks[0](*captured["args"], **captured["kwargs"])
        times.append(time.perf_counter() - t2)
    per_block = [saved.bytes[f"block {i}"] for i in range(len(blocks))]
    result = {
        "row": row.get("row", "adhoc"), "kind": kind, "layers": len(blocks), "autocast": autocast,
        "embed": saved.bytes["embed"], "blocks_sum": sum(per_block), "block_first": per_block[0],
        "block_typical": int(statistics.median(per_block)), "block_alone": one.bytes["block"],
        "block_weight_copies": one.weights["block"], "weight_copies": sum(saved.weights.values()),
        "between": saved.bytes["between"], "tail_saved": saved.bytes["tail"], "tail_saved_live": tail_saved_live,
        "tail_peak": live.peak, "tail_param_grads": grads_in_tail, "block_input": captured.get("last_out", 0),
        "params": sum(p.numel() for p in model.parameters()),
        "build_s": built_s, "forward_s": fwd_s, "block_s": min(times), "items": dict(saved.items),
        "one_items": one.items["block"],
    }
    if verbose:
        show_items(result)
    return result


def show_items(r: dict[str, Any]) -> None:
    print(f"  one block alone: {r['block_alone'] / GIB:.3f} GiB saved (weights' copies apart: "
          f"{r['block_weight_copies'] / GIB:.3f} GiB), traced in {r['block_s'] * 1e3:.1f} ms")
    for n, what in sorted(r["one_items"], key=lambda z: -z[0]):
        print(f"    {n / 2**20:10.1f} MiB  {what}")
    print(f"  tail (final norm, head, loss) saved: {r['tail_saved'] / GIB:.3f} GiB")
    for n, what in sorted(r["items"].get("tail", []), key=lambda z: -z[0]):
        print(f"    {n / 2**20:10.1f} MiB  {what}")


# ---- the same on a GPU, to check the emulation ---------------------------------------------

def gpu_check(row: dict[str, Any], where: str) -> dict[str, Any]:
    """The row's model materialised on CUDA (random weights), one forward under the real
    torch.autocast / bf16 parameters with the real SDPA, grouped_mm and Triton loss, the
    same saved-tensor accounting; the allocator's growth over each block; the tail's peak
    allocated above the moment of the cut (its forward and backward). Beside the meta trace of
    the same row on this machine (same torch, same transformers)."""
    import transformers

    dev = os.environ.get("TRACE_DEVICE", "cuda")  # (cpu: a smoke test of this function alone)
    meta = trace(row, where)
    autocast = row["strategy_asked"] in ("single", "ddp")
    model, kind = build_module(row, where)
    model.to_empty(device=dev)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0 if "norm" in name or "ln" in name else 0.0)
    if hasattr(model, "config") and hasattr(model, "model") and hasattr(model.model, "rotary_emb"):
        rot = model.model.rotary_emb  # its tables: to_empty left them uninitialised
        try:
            inv, _ = rot.compute_default_rope_parameters(model.config, dev)
            rot.inv_freq.copy_(inv)
        except Exception:  # values only: the bytes do not depend on them
            rot.inv_freq.fill_(0.01)
    if not autocast:
        cast_params(model, BF16)
    blocks = blocks_of(model)
    saved = Saved(model)
    mem: dict[str, Any] = {"pre": [], "post": []}

    def allocated() -> int:
        if dev != "cuda":
            return 0
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()

    def pre(i):
        def hook(mod, args):
            saved.phase = f"block {i}"
            mem["pre"].append(allocated())
        return hook

    def post(i):
        def hook(mod, args, out):
            mem["post"].append(allocated())
            saved.phase = "between" if i < len(blocks) - 1 else "tail"
            if i == len(blocks) - 1:
                h = _hidden(out)
                mem["graph"] = h  # the blocks' graph stays alive, as in the real step
                cut = h.detach().requires_grad_(True)
                mem["cut"] = allocated()
                if dev == "cuda":
                    torch.cuda.reset_peak_memory_stats()
                return _replace_hidden(out, cut)
            return None
        return hook

    handles = [b.register_forward_pre_hook(pre(i)) for i, b in enumerate(blocks)]
    handles += [b.register_forward_hook(post(i)) for i, b in enumerate(blocks)]
    x = torch.randint(0, 1000, (row["micro_batch"], row["seq"]), device=dev)
    with torch.autocast(dev, dtype=BF16, enabled=autocast), \
            torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        loss = run_loss(model, kind, x)
        mem["end_fwd"] = allocated()
        loss.backward()
    tail_peak = (torch.cuda.max_memory_allocated() if dev == "cuda" else 0) - mem["cut"]
    for h in handles:
        h.remove()
    growth = [b - a for a, b in zip(mem["pre"], mem["post"])]
    per_block = [saved.bytes[f"block {i}"] for i in range(len(blocks))]
    cfg = getattr(model, "config", None)
    out = {"row": row["row"], "torch": torch.__version__, "transformers": transformers.__version__,
           "attn": getattr(cfg, "_attn_implementation", None),
           "experts": getattr(cfg, "_experts_implementation", None),
           "meta_block": meta["block_typical"] / GIB, "meta_block_weight_copies": meta["block_weight_copies"] / GIB,
           "gpu_block_saved": statistics.median(per_block) / GIB,
           "gpu_block_alloc_growth": statistics.median(growth) / GIB,
           "meta_tail_saved": meta["tail_saved"] / GIB, "gpu_tail_saved": saved.bytes["tail"] / GIB,
           "meta_tail_peak": meta["tail_peak"] / GIB, "gpu_tail_peak": tail_peak / GIB,
           "meta_embed": meta["embed"] / GIB, "gpu_embed": saved.bytes["embed"] / GIB}
    if os.environ.get("TRACE_ITEMS"):
        print("  gpu block 1:")
        for n, what in sorted(saved.items.get("block 1", []), key=lambda z: -z[0]):
            print(f"    {n / 2**20:10.1f} MiB  {what}")
        print("  meta block 1:")
        for n, what in sorted(meta["items"].get("block 1", []), key=lambda z: -z[0]):
            print(f"    {n / 2**20:10.1f} MiB  {what}")
    # (the saved tensors and their graph form reference cycles: collected before the next row,
    # which otherwise ran out of memory on the 9th row on one H200)
    mem.clear()
    saved.items.clear()
    del model, loss
    import gc

    gc.collect()
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


# ---- against the planner and the measurement ------------------------------------------------

def planner(row: dict[str, Any], where: str) -> dict[str, float]:
    import memory_grid

    from meshrun.plan.memory import calibration

    got = memory_grid.predicted_gib(row, where)
    got["roa"] = calibration()["reserved_over_allocated"]
    return got


def compare(row: dict[str, Any], where: str, verbose: bool) -> dict[str, Any]:
    p = planner(row, where)
    r = trace(row, where, verbose)
    ac = row["ac_asked"] == "full"
    L = r["layers"]
    if ac:  # checkpointed: each block's input kept, one block's activations during its recompute
        acts = L * r["block_input"] + r["block_typical"]
    else:
        acts = r["embed"] + r["blocks_sum"]
    acts_gib = acts / GIB
    spike_gib = max(r["tail_peak"], 0) / GIB
    roa = p["roa"]
    states = p["params"] + p["grads"] + p["optimizer"] + p["comm_buffers"] + p["workspace"]
    frag_fixed = p["fragmentation"] - (p["peak"] - p["cuda_context"] - p["fragmentation"]) * (roa - 1)
    implied = (row["smi_peak_gib"] - p["cuda_context"] - frag_fixed) / roa - states
    traced_peak = (states + acts_gib + spike_gib) * roa + frag_fixed + p["cuda_context"]
    if p["logits"] == 0 and not ac:  # the planner's end-of-backward moment: leave it
        traced_peak = p["peak"]
    # DDP's gradient buckets (gradient_as_bucket_view: fp32, allocated when DDP wraps the model,
    # alive all step), which the planner counts only where dp > 1; these rows ran DDP on one GPU
    buckets = 4 * r["params"] / GIB if row["strategy_asked"] == "ddp" and p["grads"] == 0 else 0.0
    # what nvidia-smi shows beyond torch's reserved peak (context, NCCL, cuBLAS handles): measured
    # 1.29-1.30 GiB on every row of the grid, against the planner's 0.5
    ctx = row["smi_peak_gib"] - row["peak_reserved_gib"] if row.get("peak_reserved_gib") else p["cuda_context"]
    return {**r, "buckets": buckets, "traced_peak_buckets": traced_peak + buckets * roa,
            "traced_peak_ctx": traced_peak + buckets * roa + ctx - p["cuda_context"],
            "planned_acts": p["activations"], "planned_logits": p["logits"], "traced_acts": acts_gib,
            "traced_spike": spike_gib, "implied": implied, "smi": row["smi_peak_gib"], "planned_peak": p["peak"],
            "traced_peak": traced_peak, "states": states}


def report(files: list[str], only: list[str] | None, verbose: bool) -> None:
    rows = [json.loads(line) for path in files for line in open(path) if line.strip()]
    rows = [r for r in rows if r.get("ran") and r.get("smi_peak_gib")]
    if only:
        rows = [r for r in rows if any(o in r["row"] for o in only)]
    where = tempfile.mkdtemp(prefix="trace-activations-")
    print("GiB; plan = the planner's term, trace = traced here; implied = what acts + logits must be for the "
          "planner's other terms to meet nvidia-smi's peak")
    print("| row | plan acts | plan logits | trace acts | trace block x L | trace loss saved | trace loss peak | "
          "implied | plan err | traced err | + DDP buckets | + measured context | block ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    errs: dict[str, list[float]] = {"plan": [], "traced": [], "traced + DDP buckets": [],
                                    "traced + DDP buckets + measured context": []}
    for row in rows:
        if verbose:
            print(f"\n== {row['row']}")
        c = compare(row, where, verbose)
        e_plan, e_tr = c["planned_peak"] / c["smi"] - 1, c["traced_peak"] / c["smi"] - 1
        e_b = c["traced_peak_buckets"] / c["smi"] - 1
        e_c = c["traced_peak_ctx"] / c["smi"] - 1
        errs["traced + DDP buckets + measured context"].append(e_c)
        errs["plan"].append(e_plan)
        errs["traced"].append(e_tr)
        errs["traced + DDP buckets"].append(e_b)
        print(f"| {c['row']} | {c['planned_acts']:.2f} | {c['planned_logits']:.2f} | {c['traced_acts']:.2f} | "
              f"{c['block_alone'] * c['layers'] / GIB:.2f} | {c['tail_saved'] / GIB:.2f} | {c['traced_spike']:.2f} | "
              f"{c['implied']:.2f} | {e_plan:+.1%} | {e_tr:+.1%} | {e_b:+.1%} | {e_c:+.1%} | "
              f"{c['block_s'] * 1e3:.0f} |", flush=True)
    names = [r["row"] for r in rows]
    for k, v in errs.items():
        plain = [e for e, n in zip(v, names) if not n.endswith(("-ac", "-compiled"))]
        print(f"{k}: median |error| {statistics.median(abs(e) for e in v):.1%}, worst {max(v, key=abs):+.1%}; "
              f"without -ac and -compiled rows ({len(plain)}): median {statistics.median(abs(e) for e in plain):.1%}, "
              f"worst {max(plain, key=abs):+.1%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--report", nargs="+", metavar="JSONL", help="measured rows (bench/memory_grid.py's)")
    ap.add_argument("--rows", default=None, help="only rows whose name contains one of these (comma-separated)")
    ap.add_argument("--source", help="ad hoc: gpt:gpt-124m, user:llama_1b, hf:llama3.2-1b, 'hf:mistral-7b (8 layers)'")
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--strategy", default="ddp", choices=("single", "ddp", "fsdp-full", "fsdp-grad-op"))
    ap.add_argument("-v", "--verbose", action="store_true", help="list what is saved")
    ap.add_argument("--hf-attn", default="built", choices=("built", "sdpa", "eager"),
                    help="a Hugging Face model's attention: as this transformers builds it (default), or forced "
                         "(sdpa: what transformers 5.17, the measured runs', built for Gemma-2)")
    ap.add_argument("--gpu-check", action="store_true",
                    help="with --report: each row also traced for real on CUDA (random weights), beside the meta trace")
    a = ap.parse_args()
    torch.set_grad_enabled(True)
    global HF_ATTN
    HF_ATTN = a.hf_attn
    if a.report and a.gpu_check:
        rows = [json.loads(line) for path in a.report for line in open(path) if line.strip()]
        wanted = a.rows.split(",") if a.rows else None
        where = tempfile.mkdtemp(prefix="trace-activations-")
        for row in rows:
            if row.get("ran") and (not wanted or any(w in row["row"] for w in wanted)):
                t = time.time()
                print(json.dumps({**gpu_check(row, where), "s": round(time.time() - t, 1)}), flush=True)
        return 0
    if a.report:
        report(a.report, a.rows.split(",") if a.rows else None, a.verbose)
        return 0
    if not a.source:
        ap.error("give --report FILE or --source")
    row = {"row": "adhoc", "source": a.source, "seq": a.seq, "micro_batch": a.micro, "strategy_asked": a.strategy,
           "ac_asked": "none", "compile_asked": False}
    r = trace(row, tempfile.mkdtemp(prefix="trace-activations-"), verbose=True)
    counts = ("layers", "params", "autocast")
    print(json.dumps({k: (v / GIB if isinstance(v, int) and k not in counts else v) for k, v in r.items()
                      if k not in ("items", "one_items")}, indent=1, default=str))  # bytes in GiB
    return 0


if __name__ == "__main__":
    sys.exit(main())
