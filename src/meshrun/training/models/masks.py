"""Document masks (``--document-mask``): in a sequence packed from several documents each
token attends to the earlier tokens of its own document only. A document begins where its
position id is 0; the data restarts position ids at every document and at each sample's
first token (training/loader.py).

On a GPU the mask is FlexAttention's block mask: ``flex_attention`` skips the blocks no query
sees and runs as one fused kernel, where SDPA given a dense (t x t) boolean mask leaves its
flash kernel for the masked one. On the CPU it is the dense mask: torch's CPU FlexAttention
has no backward (torch 2.13). Both give the same attention (tests/test_data.py compares
them on the CPU, forward only)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from ...errors import MeshrunError
from ..loaded import compiler_loaded

Mask = Any  # a dense boolean tensor (batch, 1, queries, keys) or FlexAttention's BlockMask


def uses_flex(device: torch.device) -> bool:
    """Whether masks on ``device`` are FlexAttention's: on CUDA (see the module's docstring)."""
    return device.type == "cuda"


def document_ids(positions: torch.Tensor) -> torch.Tensor:
    """(batch, t) int32: each token's document, numbered from 1 along its row (a new one at
    every position id 0)."""
    return torch.cumsum((positions == 0).to(torch.int32), dim=-1)


def _build(docs: torch.Tensor, q_start: int = 0, q_len: int | None = None, kv_len: int | None = None) -> Mask:
    """The mask of the queries at positions [q_start, q_start + q_len) against the keys at
    [0, kv_len) of rows whose tokens are in documents ``docs`` (batch, t): query i sees key j
    when j <= i and both are in one document. Defaults: every query, every key."""
    t = docs.shape[-1]
    q_len = t - q_start if q_len is None else q_len
    kv_len = t if kv_len is None else kv_len
    if uses_flex(docs.device):
        return _block_mask(docs, q_start, q_len, kv_len)
    queries = torch.arange(q_start, q_start + q_len, device=docs.device)
    causal = queries[:, None] >= torch.arange(kv_len, device=docs.device)[None, :]
    same = docs[:, q_start:q_start + q_len, None] == docs[:, None, :kv_len]
    return (same & causal)[:, None]


if TYPE_CHECKING:
    build = _build
else:
    def __getattr__(name: str) -> Any:
        """``build``: ``_build`` kept out of compiled graphs (the mask is built once per
        forward, outside the compiled graphs of the blocks) by ``torch.compiler.disable``. The
        decorator imports torch._dynamo (with DTensor and FSDP, seconds of CPU:
        docs/decisions.md#no-compiler-import): applied at import, it made every import of
        meshrun's models and Trainer pay that. It is applied once torch._dynamo is loaded, as it
        is before anything compiles: a compiled caller reads ``masks.build`` while tracing and
        gets the decorated function (cached from then on); before that nothing compiles, and the
        plain function does the same."""
        if name != "build":
            raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
        if not compiler_loaded():
            return _build
        fn = globals()["build"] = torch.compiler.disable(_build)
        return fn


def _block_mask(docs: torch.Tensor, q_start: int, q_len: int, kv_len: int) -> Mask:
    from torch.nn.attention.flex_attention import create_block_mask

    def same_document_causal(b: Any, h: Any, q: Any, kv: Any) -> Any:
        i = q + q_start
        return (docs[b, i] == docs[b, kv]) & (i >= kv)

    # compiled: eager, it evaluates the mask at every (query, key) pair of the batch first
    # (2 x 8192 x 8192 at seq 8192, gigabytes of intermediates)
    make = _compiled("create_block_mask", create_block_mask) if docs.device.type == "cuda" else create_block_mask
    with _compiled_stance():
        return make(same_document_causal, docs.shape[0], None, q_len, kv_len, device=docs.device)


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Mask, scale: float | None = None,
           dropout: float = 0.0) -> torch.Tensor:
    """Attention of (batch, heads, t, head_dim) queries, keys and values under ``mask``
    (``build``'s); keys and values may have fewer heads (grouped-query attention)."""
    if isinstance(mask, torch.Tensor):
        if k.shape[1] != q.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout, scale=scale)
    if dropout:
        raise MeshrunError(f"--document-mask: attention dropout {dropout} does not run in FlexAttention "
                           "(hint: set the model's attention dropout to 0 for training)")
    from torch.nn.attention.flex_attention import flex_attention

    gqa = k.shape[1] != q.shape[1]
    if q.device.type != "cuda" or torch.compiler.is_compiling():
        # inside a compiled block torch.compile traces flex_attention into the block's graph
        return flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    with _compiled_stance():  # eager, it materialises every score: compiled also in an eager model
        return _compiled("flex_attention", flex_attention)(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)


_cache: dict[str, Callable[..., Any]] = {}


def _compiled(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    if name not in _cache:
        _cache[name] = torch.compile(fn, dynamic=False)
    return _cache[name]


def _compiled_stance() -> Any:
    """Compiled functions run compiled here, also where the trainer validates with compiling
    off (``torch.compiler.set_stance("force_eager")``)."""
    return torch.compiler.set_stance("default")


FLEX_HF = "meshrun_flex"  # transformers' attention and mask functions under meshrun's name

# FlexAttention's kernels for heads wider than 128 on an H100/H200 (sm_90): 8 warps for the
# backward and 128 x 64 query x key blocks at 8 warps for the forward, where Inductor's defaults
# give 4 warps. At Gemma-2-2B's shapes (4 x 4,096 tokens, 8 query and 4 key/value heads of 256,
# soft-capped, causal) the backward took 5.72 ms against 7.31, the forward 1.41 against 2.01
# (1 x H200, torch 2.11; docs/decisions.md#softcap-attention). Narrower heads keep the defaults.
WIDE_HEAD_OPTIONS = {"bwd_num_warps": 8, "fwd_BLOCK_M": 128, "fwd_BLOCK_N": 64, "fwd_num_warps": 8,
                     "fwd_num_stages": 2}


def kernel_options(head_width: int, capability: tuple[int, int] | None) -> dict[str, Any] | None:
    """FlexAttention's kernel options for heads ``head_width`` wide on a GPU of compute
    ``capability`` (None: no GPU): the measured ones for heads wider than 128 on sm_90, else None
    (Inductor's defaults)."""
    return dict(WIDE_HEAD_OPTIONS) if capability == (9, 0) and head_width > 128 else None


def use_flex_in_transformers(model: Any) -> None:
    """A Hugging Face model's attention as transformers' FlexAttention, which builds its block
    mask from the restarting position ids, registered under meshrun's own name: so its
    flex_attention and block mask run compiled also in the trainer's validation, which turns
    compiling off (eager, both materialise the (t x t) scores or mask: 17 GB a layer for the
    scores of 2 x 8192 tokens and 32 heads). Raises ValueError for a family without it."""
    from transformers import AttentionInterface
    from transformers.integrations.flex_attention import flex_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flex_attention_mask

    if not getattr(model, "_supports_flex_attn", False):
        raise ValueError(f"{type(model).__name__} has no FlexAttention in transformers")

    # (asked once here: inside a compiled block the query's width is a constant)
    capability = torch.cuda.get_device_capability() if torch.cuda.is_available() else None

    def attention(module: Any, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        options = kernel_options(query.shape[-1], capability)
        if options:
            kwargs.setdefault("kernel_options", options)
        if torch.compiler.is_compiling():
            return flex_attention_forward(module, query, *args, **kwargs)
        with _compiled_stance():
            return flex_attention_forward(module, query, *args, **kwargs)

    def mask(*args: Any, **kwargs: Any) -> Any:
        if torch.compiler.is_compiling():
            return flex_attention_mask(*args, **kwargs)
        with _compiled_stance():
            return flex_attention_mask(*args, **kwargs)

    AttentionInterface.register(FLEX_HF, attention)
    AttentionMaskInterface.register(FLEX_HF, mask)
    model.config._attn_implementation = FLEX_HF
