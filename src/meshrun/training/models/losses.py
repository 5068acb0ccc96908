"""Cross-entropy over a vocabulary-wide output layer without materialising the logits.

The plain recipe, ``F.cross_entropy(head(x).float(), y)``, writes every token's logits in
bf16, an fp32 copy and fp32 log-probabilities that autograd keeps for the backward: at GPT
124M with 128 x 1024 tokens per micro-step that is 13 + 26 + 26 GB of HBM traffic and
memory: Inductor's two cross-entropy kernels take a sizeable share of the compiled step
(docs/decisions.md#head-loss).

Because the loss is the last operation of the forward, its gradient with respect to the
logits is known during the forward: ``softmax(logits) - onehot(target)``, over the number of
counted tokens. :func:`linear_cross_entropy` walks the tokens in chunks, computes each
chunk's logits, their log-sum-exp and that gradient, and turns it straight into the
gradients of the hidden states and of the output weight; no chunk's logits outlive its
iteration. The backward only scales the two stored gradients by the incoming one. Same
matmul FLOPs as the plain recipe (one forward, two backward), but per token only the bf16
logits and their bf16 gradient touch memory, and peak memory holds one chunk.

Compiled at 1024 tokens it is no faster: GPT 124M runs slower than the plain recipe, which
Inductor already fuses, and holds more memory (the unrolled chunks;
docs/decisions.md#chunked-loss). What it is for is the eager long-sequence case, where
the whole logits would be most of the memory (``GPTConfig.fused_loss``, ``--fused-loss``).

Numerics match the plain recipe under autocast: matmuls in the compute dtype with fp32
accumulation, log-sum-exp and softmax in fp32, the logits' gradient rounded to the compute
dtype before the weight-gradient matmul (as autocast's backward does), and the weight
gradient summed over chunks in fp32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...modelinfo.spec import LOSS_CHUNK_TOKENS

# Tokens per chunk: the chunk's fp32 logits stay near 1 GB at a 50K vocabulary in eager mode
# (compiled, the fp32 copy is fused away), while each chunk's matmuls stay large enough to
# run at full speed. The planner counts the same chunk.
CHUNK_TOKENS = LOSS_CHUNK_TOKENS
MAX_CHUNKS = 32  # compiled, every chunk is unrolled into the graph: bound the graph's size


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    if torch.is_autocast_enabled(dev):
        return torch.get_autocast_dtype(dev)
    return x.dtype


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,  # type: ignore[override]
                ignore_index: int, dtype: torch.dtype) -> torch.Tensor:
        n = x.shape[0]
        xs = x.to(dtype)
        w = weight.to(dtype)
        counted = targets != ignore_index
        count = counted.sum().to(torch.float32)  # 0 when every token is ignored: a nan loss, as torch gives
        grad_x = torch.empty_like(xs)
        grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        total = torch.zeros((), dtype=torch.float32, device=x.device)
        # compiled, the loop is unrolled: fewer, larger chunks keep the graph small
        chunk = max(CHUNK_TOKENS, -(-n // MAX_CHUNKS)) if torch.compiler.is_compiling() else CHUNK_TOKENS
        for s in range(0, n, chunk):
            xc, tc, keep = xs[s:s + chunk], targets[s:s + chunk], counted[s:s + chunk]
            logits = (xc @ w.t()).float()
            lse = torch.logsumexp(logits, dim=-1)
            safe = torch.where(keep, tc, torch.zeros_like(tc)).unsqueeze(1)
            picked = logits.gather(1, safe).squeeze(1)
            total = total + torch.where(keep, lse - picked, torch.zeros_like(lse)).sum()
            # d(loss)/d(logits) = (softmax - onehot) / count, zero on ignored tokens
            scale = torch.where(keep, 1.0 / count, torch.zeros_like(lse)).unsqueeze(1)
            g = torch.exp(logits - lse.unsqueeze(1)).scatter_add(1, safe, -torch.ones_like(lse).unsqueeze(1))
            g = (g * scale).to(dtype)
            grad_x[s:s + chunk] = g @ w
            grad_w += (g.t() @ xc).float()
        ctx.save_for_backward(grad_x, grad_w)
        ctx.x_dtype, ctx.w_dtype = x.dtype, weight.dtype
        return total / count

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):  # type: ignore[override]
        grad_x, grad_w = ctx.saved_tensors
        return (grad_x * grad_out).to(ctx.x_dtype), (grad_w * grad_out).to(ctx.w_dtype), None, None, None


def linear_cross_entropy(x: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                         ignore_index: int = -100) -> torch.Tensor:
    """Mean cross-entropy of ``x @ weight.T`` against ``targets`` (ignoring ``ignore_index``).

    ``x``: (tokens, d); ``weight``: (vocab, d); ``targets``: (tokens,). Equal to
    ``F.cross_entropy((x @ weight.T).float(), targets)`` up to summation order.
    """
    if x.shape[0] == 0:
        return F.cross_entropy(x @ weight.t(), targets)  # torch's own answer (nan) for no tokens
    dtype = _compute_dtype(x)
    # The function manages its own dtypes; autocast inside would re-cast each matmul.
    with torch.autocast(x.device.type, enabled=False):
        return _LinearCrossEntropy.apply(x, weight, targets, ignore_index, dtype)
