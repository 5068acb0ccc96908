"""meshrun's GPT MLP with its GELU in cuBLASLt's matmul epilogues (``GPTConfig.fused_mlp``:
by default "auto", on CUDA wherever nvmath-python is installed).

Why: in the compiled GPT 124M step the GELU's forward and backward and the up-projection's
bias gradient are Inductor kernels that take a noticeable share of the step, all
memory-bound passes over the (tokens, 4d) activations, which no Inductor setting can fuse into
cuBLAS's matmuls. cuBLASLt can:

- forward, ``GELU_AUX_BIAS``: the up-projection's matmul adds the bias, applies GELU (the tanh
  approximation, which is the GPT's) and writes both GELU's output and its input (the "aux",
  kept for the backward): one read of the pre-activation less than matmul + GELU kernel;
- backward, ``DGELU``: the down-projection's input-gradient matmul multiplies by GELU's
  derivative at the saved aux, so the (tokens, 4d) gradient is written once; the
  up-projection's bias gradient is a torch sum over it.

Measured: the MLP's forward + backward faster than Inductor's, and a faster GPT step at 124M
and 1.3B, alone and beside the head loss (docs/decisions.md#gelu-epilogues; the epilogues that
also sum the bias gradients ran as separate kernels and were no faster). torch exposes neither
epilogue; NVIDIA's nvmath-python binds cuBLASLt's, and is imported only here, only when used.

The matmuls and the epilogues run in opaque custom ops (``meshrun::gelu_mlp`` and
``meshrun::gelu_mlp_backward``), so torch.compile calls them from inside its graphs. The same
ops compute the same thing with plain torch operations where the cuBLASLt path does not apply
(the CPU, fp32, widths that are not multiples of 8, nvmath-python missing or refusing a shape):
what the tests check on the CPU. ``PATHS`` counts the calls of each path and ``FALLBACK`` says
why the cuBLASLt one was not taken, so a benchmark can tell which one it measured.
"""

from __future__ import annotations

import functools
from collections import Counter
from typing import Any

import torch
import torch.nn as nn
import torch.nn.functional as F

PATHS: Counter[str] = Counter()  # calls per path: "cublaslt" or "torch"
FALLBACK: dict[str, str] = {}  # why the cuBLASLt path was not taken, first reason per cause


@functools.lru_cache(maxsize=1)
def _nvmath() -> Any:
    """nvmath.linalg.advanced, or the reason it is not there (a str)."""
    try:
        from nvmath.linalg import advanced
    except Exception as e:  # not installed, or its CUDA libraries not found
        return f"nvmath-python not usable ({type(e).__name__}: {e})"
    return advanced


def available() -> bool:
    """Whether nvmath-python's cuBLASLt binding imports (GPTConfig.fused_mlp="auto" uses it)."""
    return not isinstance(_nvmath(), str)


def _cublaslt_reason(x: torch.Tensor, w_up: torch.Tensor) -> str | None:
    """Why the cuBLASLt path cannot run these operands (None: it can)."""
    if not x.is_cuda:
        return "not on a GPU"
    if x.dtype not in (torch.bfloat16, torch.float16):
        return f"dtype {x.dtype} (the epilogues run in bf16/fp16)"
    if any(n % 8 for n in (*w_up.shape, x.shape[0])):
        return f"widths {tuple(w_up.shape)} and {x.shape[0]} tokens not multiples of 8"
    mod = _nvmath()
    return mod if isinstance(mod, str) else None


def _run(what: str, cublaslt: Any, plain: Any, *args: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """``cublaslt(*args)`` where the epilogues can run and accept the operands, else
    ``plain(*args)``; counted in PATHS, with the reason in FALLBACK. ``args`` start with x, w_up."""
    x, w_up = args[0], args[1]
    reason = _cublaslt_reason(x, w_up)
    if reason is None:
        try:
            out = cublaslt(*args)
        except Exception as e:  # a shape or type cuBLASLt's heuristics refuse: plain torch
            reason = f"cuBLASLt refused the {what} ({type(e).__name__}: {e})"
        else:
            PATHS["cublaslt"] += 1
            return out
    FALLBACK.setdefault(reason.split(" (")[0], reason)
    PATHS["torch"] += 1
    return plain(*args)


# One planned (and autotuned) nvmath Matmul per operand layout and epilogue, reused: the stateless
# nvmath ``matmul`` plans, executes and frees a Matmul each call, milliseconds of host time per
# MLP forward + backward where plain torch takes a fraction of one, and the MLP was slower than
# Inductor's at large batches (docs/decisions.md#direct-cublaslt-calls). All layers of a model
# share the shapes: two plans per model (forward, backward), planned at the first step
_PLANS: dict[tuple, Any] = {}
PLANNED: Counter[str] = Counter()  # plans made per epilogue
AUTOTUNE_ITERATIONS = 5  # per candidate algorithm, once per plan (0: cuBLASLt's heuristic's first)
# nvmath's ``Matmul.execute`` runs a plan only in the call that makes it; every later call runs
# through _Direct, because execute costs host time per call even planned (an event, logging
# checks, its workspace's stream bookkeeping): the same bits, less host time per MLP forward +
# backward; it matters where the host bounds the step (small batches).
# docs/decisions.md#direct-cublaslt-calls
EXECUTED: Counter[str] = Counter()  # calls per way: "direct" or "nvmath"


def _align(t: torch.Tensor) -> int:
    p = t.data_ptr()
    return min(p & -p, 256) if p else 256


def _cublaslt_matmul() -> Any:
    from nvmath.bindings import cublasLt

    return cublasLt.matmul


class _Direct:
    """One cuBLASLt call with a planned nvmath Matmul's descriptors, layouts and chosen algorithm,
    from nvmath's own binding (``nvmath.bindings.cublasLt.matmul``, its public low-level API):
    what ``Matmul.execute`` does for CUDA operands, with the result, the epilogue's outputs and
    the workspace from torch's caching allocator on the current stream, so they are ordered on it
    like any torch tensor. Built from the plan's attributes after its first ``execute``; an nvmath
    without them raises AttributeError there and the plan keeps using ``execute``."""

    def __init__(self, mm: Any, device: torch.device):
        if mm.num_operands != 2 or float(mm.beta[0]) != 0.0:
            raise AttributeError("only a @ b without c is called directly")
        self._call = _cublaslt_matmul()
        self._mm, self._device = mm, device  # the plan keeps the descriptors and alpha/beta alive
        self._algo = mm.cached_best_algorithm_struct  # the autotuned choice, as execute() takes it
        traits = mm.result_traits
        self._result = (tuple(traits.result_shape), tuple(traits.result_strides), getattr(torch, mm.d_dtype_name))
        self._outputs = []
        for h in mm.epilog_output_handlers:
            shape, strides, dtype = h.attributes()
            self._outputs.append((h.name, h, tuple(shape), tuple(strides), getattr(torch, dtype)))
        self._inputs = dict(mm.epilog_input_name_to_handler)
        self._ws = int(mm.workspace.size)
        self._args = (mm.handle, mm.mm_desc, mm.alpha.ctypes.data, mm.a_layout_ptr, mm.b_layout_ptr,
                      mm.beta.ctypes.data, mm.c_layout_ptr, mm.d_layout_ptr, self._algo.ctypes.data)

    def __call__(self, a: torch.Tensor, b: torch.Tensor, inputs: dict[str, torch.Tensor], stream: Any) -> Any:
        mm, dev = self._mm, self._device
        for name, t in inputs.items():  # the epilogue's inputs (bias, GELU's saved input) by pointer
            self._inputs[name].update_pointer(mm.mm_desc_ifc, t.data_ptr())
        outs = {}
        for name, h, shape, strides, dtype in self._outputs:
            outs[name] = out = torch.empty_strided(shape, strides, dtype=dtype, device=dev)
            h.update_pointer(mm.mm_desc_ifc, out.data_ptr())
        shape, strides, dtype = self._result
        d = torch.empty_strided(shape, strides, dtype=dtype, device=dev)
        ws = torch.empty(self._ws, dtype=torch.uint8, device=dev) if self._ws else None
        handle, desc, alpha, a_layout, b_layout, beta, c_layout, d_layout, algo = self._args
        self._call(handle, desc, alpha, a.data_ptr(), a_layout, b.data_ptr(), b_layout, beta, 0, c_layout,
                   d.data_ptr(), d_layout, algo, ws.data_ptr() if ws is not None else 0, self._ws,
                   stream.cuda_stream)
        return (d, outs) if self._outputs else d


def _matmul(a: torch.Tensor, b: torch.Tensor, epilog: str, inputs: dict[str, torch.Tensor]) -> Any:
    """a @ b with cuBLASLt's ``epilog`` on the current stream, through a cached plan."""
    adv = _nvmath()
    stream = torch.cuda.current_stream(a.device)
    # cuBLASLt's choice of algorithm depends on the pointers' alignment too (up to 256 bytes)
    key = (epilog, a.device.index, a.dtype, *((t.shape, t.stride(), t.dtype, _align(t)) for t in (a, b)),
           *((k, v.shape, v.stride(), v.dtype, _align(v)) for k, v in inputs.items()))
    plan = _PLANS.get(key)
    if isinstance(plan, Exception):  # refused before: not planned again at every call
        raise plan
    if plan is None:
        try:
            mm = adv.Matmul(a, b, stream=stream)
            mm.plan(epilog=getattr(adv.MatmulEpilog, epilog), epilog_inputs=inputs, stream=stream)
            if AUTOTUNE_ITERATIONS:
                mm.autotune(iterations=AUTOTUNE_ITERATIONS, stream=stream)
        except Exception as e:
            _PLANS[key] = e
            raise
        PLANNED[epilog] += 1  # more than once per epilogue and shape: the keys vary (alignment)
    else:
        mm, direct = plan
        if direct is not None:
            EXECUTED["direct"] += 1
            return direct(a, b, inputs, stream)
        mm.reset_operands_unchecked(a=a, b=b, epilog_inputs=inputs, stream=stream)
    try:
        out = mm.execute(stream=stream)
    finally:  # the plan must not keep this step's activations alive until the next call
        mm.release_operands()
    EXECUTED["nvmath"] += 1
    if plan is None:
        try:
            direct = _Direct(mm, a.device)
        except AttributeError:  # another nvmath's internals: execute() at every call
            direct = None
        _PLANS[key] = (mm, direct)
    return out


def _forward_torch(x, w_up, b_up, w_down, b_down):
    h = torch.addmm(b_up, x, w_up.t())
    g = F.gelu(h, approximate="tanh")
    return torch.addmm(b_down, g, w_down.t()), g, h


def _forward_cublaslt(x, w_up, b_up, w_down, b_down):
    # cuBLASLt's epilogues want the (4d, tokens) result in column order, which is the
    # (tokens, 4d) row-major tensor transposed: computed as w_up @ x^T, read back as .t()
    # (a view, no copy). The bias runs along the 4d rows.
    gt, aux = _matmul(w_up, x.t(), "GELU_AUX_BIAS", {"bias": b_up})
    g, h = gt.t(), aux["gelu_aux"].t()
    return torch.addmm(b_down, g, w_down.t()), g, h


def _grads(dy, x, w_up, g, dh, db_up):
    """The gradients of x, w_up, b_up, w_down and b_down from GELU's input gradient ``dh``."""
    return dh @ w_up, dh.t() @ x, db_up, dy.t() @ g, dy.sum(0)


def _backward_plain(x, w_up, dy, w_down, g, h):
    dh = torch.ops.aten.gelu_backward(dy @ w_down, h, approximate="tanh")
    return _grads(dy, x, w_up, g, dh, dh.sum(0))


def _backward_cublaslt(x, w_up, dy, w_down, g, h):
    # dh^T = w_down^T @ dy^T, times GELU's derivative at the saved pre-activation (h^T, the
    # column-order aux the forward wrote); the up-projection's bias gradient a sum over tokens
    dht = _matmul(w_down.t(), dy.t(), "DGELU", {"gelu_aux": h.t()})
    return _grads(dy, x, w_up, g, dht.t(), dht.sum(1))


def _register_ops() -> None:
    from torch.library import custom_op, register_fake

    @custom_op("meshrun::gelu_mlp", mutates_args=())
    def forward(x: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor, w_down: torch.Tensor,
                b_down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """y = down(gelu(up(x))), and GELU's output and input (saved for the backward)."""
        out = _run("forward", _forward_cublaslt, _forward_torch, x, w_up, b_up, w_down, b_down)
        return tuple(t.contiguous() for t in out)  # the epilogues' are transposed views, contiguous

    @register_fake("meshrun::gelu_mlp")
    def _forward_shapes(x, w_up, b_up, w_down, b_down):
        n, f = x.shape[0], w_up.shape[0]
        return x.new_empty(n, w_down.shape[0]), x.new_empty(n, f), x.new_empty(n, f)

    # (an op's name must change with its arguments: Inductor's on-disk cache keys a compiled
    # graph by the op's name, not its schema, so a graph cached against other arguments would
    # be reused)
    @custom_op("meshrun::gelu_mlp_backward", mutates_args=())
    def backward(dy: torch.Tensor, x: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, g: torch.Tensor,
                 h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The gradients of x, w_up, b_up, w_down and b_down."""
        grads = _run("backward", _backward_cublaslt, _backward_plain, x, w_up, dy.contiguous(), w_down, g, h)
        return tuple(t.contiguous() for t in grads)  # as the shapes below promise

    @register_fake("meshrun::gelu_mlp_backward")
    def _backward_shapes(dy, x, w_up, w_down, g, h):
        return (torch.empty_like(x), torch.empty_like(w_up), w_up.new_empty(w_up.shape[0]),
                torch.empty_like(w_down), w_down.new_empty(w_down.shape[0]))


_register_ops()


class _GeluMLP(torch.autograd.Function):
    # GELU's output and input are saved, not returned: outputs of a function nobody uses would
    # get zero-filled gradients in the backward, two (tokens, 4d) tensors per layer. Saving the
    # output too (the down-projection's weight gradient needs it) may hold one (tokens, 4d)
    # tensor per layer more than Inductor, which can recompute GELU in the backward instead
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w_up: torch.Tensor, b_up: torch.Tensor, w_down: torch.Tensor,
                b_down: torch.Tensor) -> torch.Tensor:
        y, g, h = torch.ops.meshrun.gelu_mlp(x, w_up, b_up, w_down, b_down)
        ctx.save_for_backward(x, w_up, w_down, g, h)
        return y

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, w_up, w_down, g, h = ctx.saved_tensors
        return torch.ops.meshrun.gelu_mlp_backward(dy, x, w_up, w_down, g, h)


def gelu_mlp(x: torch.Tensor, up: nn.Linear, down: nn.Linear) -> torch.Tensor:
    """``down(gelu(up(x), approximate="tanh"))`` through the ops above. Under autocast the
    operands are cast to its dtype here (autocast does not reach into custom ops), as it would
    cast them for ``F.linear``; the fp32 parameters get fp32 gradients through the casts."""
    dev = x.device.type
    dt = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
    params = [p.to(dt) for p in (up.weight, up.bias, down.weight, down.bias)]
    with torch.autocast(dev, enabled=False):
        y = _GeluMLP.apply(x.to(dt).reshape(-1, x.shape[-1]), *params)
    return y.view(*x.shape[:-1], y.shape[-1])
