"""A model's shape as the planner uses it, and the presets: meshrun's GPT sizes and the
Llama families' published shapes."""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..vocab import GPT_PRESETS

# Tokens per chunk of meshrun's chunked loss (its GPT's ``fused_loss``): the chunk's fp32
# logits stay near 1 GB at a 50K vocabulary, while each chunk's matmuls stay large enough to
# run at full speed. The planner counts one chunk's logits.
LOSS_CHUNK_TOKENS = 4096


@dataclass(frozen=True)
class Traced:
    """Bytes autograd keeps in one training step, traced on the meta device
    (plan/trace.py) in one precision ``mode`` (autocast: fp32 parameters under bf16
    autocast; bf16: bf16 parameters; fp32) at ``seq`` tokens, each as (at micro-batch 1, at 2).
    ``embed``: saved before the first block and between blocks; ``blocks``: by all blocks;
    ``block_max``: by the largest one; ``block_input``: one block's input (what activation
    checkpointing keeps per block); ``tail``: the peak of live bytes from the last block's
    output through the loss's forward and backward (the loss spike). ``blocks_compiled``: what
    all blocks keep when torch.compile compiles them (Inductor's partition of the first block's
    forward and backward, scaled to all blocks); None where that could not be traced.
    ``loss_inside``: the model's forward computes the loss (meshrun's GPT; a Hugging Face model
    given labels); else meshrun takes it from the logits outside the model.
    ``block_largest``: the largest single tensor a block saves; ``tail_largest`` and
    ``tail_steepest``: the tail's tensor largest at micro-batch 1 and its fastest-growing one
    (what the allocator's cached blocks can serve later is as large as the largest of them). ``eval_logits``:
    validation computes the whole logits (all but meshrun's GPT, whose loss is chunked).
    ``liger``: traced with Liger Kernel's fused kernels patched in."""

    mode: str
    seq: int
    embed: tuple[int, int]
    blocks: tuple[int, int]
    block_max: tuple[int, int]
    block_input: tuple[int, int]
    tail: tuple[int, int]
    blocks_compiled: tuple[int, int] | None = None
    loss_inside: bool = True  # the model's forward takes the loss (compiling the model compiles it too)
    block_largest: tuple[int, int] = (0, 0)
    tail_largest: tuple[int, int] = (0, 0)
    tail_steepest: tuple[int, int] = (0, 0)
    eval_logits: bool = False
    liger: bool = False

    def at(self, term: str, micro: int) -> float:
        """``term`` at ``micro`` sequences: linear through the two traced sizes."""
        one, two = getattr(self, term)
        return float(one + (two - one) * (micro - 1))


@dataclass(frozen=True)
class ModelSpec:
    """A decoder-style model's shape. ``params`` counts each parameter once (tied embeddings
    once); ``block_params`` is one repeated block (the unit FSDP gathers and AC recomputes);
    ``outer_params`` is everything outside the blocks (embeddings, final norm, head)."""

    name: str
    params: int
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    block_params: int
    outer_params: int
    gated_mlp: bool = False  # SwiGLU (Llama): three MLP matrices, two f-wide activations more
    tied: bool = True
    max_seq: int | None = None  # the most positions the model can take (None: no limit)
    context: int | None = None  # the sequence length it is made for: the default seq len
    source: str = "preset"
    block_class: str | None = None  # the class FSDP wraps (accelerate's transformer_layer_cls_to_wrap)
    experts: int = 0  # mixture of experts: experts per block (their parameters are in params)
    top_k: int = 2
    # meshrun's GPT casts its residual stream to the autocast dtype (training/models/gpt.py); other
    # models under autocast keep it fp32 (type promotion from the fp32 embeddings).
    bf16_residual: bool = False
    # meshrun's GPT with fused_loss: the loss taken chunk by chunk (training/models/losses.py)
    fused_loss: bool = False
    # Rows of a learned position table that meshrun's GPT builds at the training sequence
    # length (training/models/gpt.py), counted in params and outer_params; 0: none, or a table of
    # fixed size (a Hugging Face config's n_positions). at_seq() resizes it.
    learned_positions: int = 0
    # What a block and the loss keep for backward, traced from the module itself for the
    # training sequence length; empty: estimated from the shape (layer_activation_bytes)
    traced: tuple[Traced, ...] = ()
    # (out, in) of each nn.Linear in one block, read from the built module; None: from the shape
    linears: tuple[tuple[int, int], ...] | None = None
    # the module name (its last part: q_proj, up ...) of each of ``linears``, read with them
    linear_names: tuple[str, ...] | None = None
    # (name, out, in) of each nn.Linear outside the blocks but the output head, read from the
    # built module (low-rank adapters' all-linear takes them too)
    outer_linears: tuple[tuple[str, int, int], ...] = ()

    def traced_for(self, mode: str, seq: int) -> Traced | None:
        return next((t for t in self.traced if t.mode == mode and t.seq == seq), None)

    def at_seq(self, seq: int) -> ModelSpec:
        """The model as meshrun's GPT builds it for ``seq`` tokens: at 512K tokens GPT 1.3B's
        position table is 1.07B parameters, as many as the rest of the model (leaving them out
        under-predicts long-sequence runs: docs/decisions.md#position-table)."""
        if not self.learned_positions or seq == self.learned_positions:
            return self
        extra = (seq - self.learned_positions) * self.hidden
        return replace(self, params=self.params + extra, outer_params=self.outer_params + extra,
                       learned_positions=seq)

    @property
    def expert_params(self) -> int:
        """Parameters inside the experts (what expert parallelism splits)."""
        return self.layers * self.experts * (2 * self.hidden * self.ffn + self.ffn + self.hidden) if self.experts else 0

    @property
    def kv_dim(self) -> int:
        return self.hidden // self.heads * self.kv_heads

    def flops_per_token(self, seq: int) -> float:
        """6N + 12·L·h·s: forward + backward matmul FLOPs per token, attention included; for a
        mixture of experts N counts the top-k experts a token visits, not all of them."""
        active = self.params - self.expert_params * (1 - self.top_k / self.experts) if self.experts else self.params
        # a position table the sequence sizes is looked up, not multiplied: beyond the
        # 1024-token table of the benchmarks' convention it adds no FLOPs
        active -= max(self.learned_positions - 1024, 0) * self.hidden
        return 6 * active + attention_flops(self.layers, self.hidden, seq)

    def work_flops_per_token(self, seq: int) -> float:
        """What the kernels compute: 6N + 6·L·h·s. Causal attention needs half of the score
        and value products, and fused attention kernels skip the masked blocks; the MFU
        convention above counts them whole (the benchmarks' formula, PaLM's). At 1024 tokens the
        two differ by 3-7%; at 256K tokens by 1.9x (what a long-sequence step time follows)."""
        return self.flops_per_token(seq) - attention_flops(self.layers, self.hidden, seq) / 2


def attention_flops(layers: int, hidden: int, seq: int) -> float:
    """The attention's training FLOPs per token in the MFU convention (PaLM's, the
    benchmarks'): 12·L·h·T, the score and value products forward and backward counted whole,
    causal masking ignored. Every MFU figure meshrun reports adds this to 6N."""
    return 12.0 * layers * hidden * seq


def gpt_spec(name: str, hidden: int, layers: int, heads: int, vocab: int = 50304, seq: int = 1024,
             max_seq: int | None = None, context: int | None = None) -> ModelSpec:
    """meshrun's GPT (training/models/gpt.py): learned positions, biases, LayerNorm, GELU 4x, tied head."""
    block = 12 * hidden * hidden + 13 * hidden
    outer = vocab * hidden + seq * hidden + 2 * hidden
    return ModelSpec(name, layers * block + outer, layers, hidden, heads, heads, 4 * hidden, vocab,
                     block, outer, gated_mlp=False, tied=True, max_seq=max_seq, context=context, block_class="Block",
                     bf16_residual=True, learned_positions=seq)


def llama_spec(name: str, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int,
               tied: bool = False, seq: int | None = None) -> ModelSpec:
    """Llama-style: RMSNorm, no biases, grouped-query attention, SwiGLU MLP, rotary positions."""
    kv = hidden // heads * kv_heads
    block = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden
    outer = vocab * hidden * (1 if tied else 2) + hidden
    return ModelSpec(name, layers * block + outer, layers, hidden, heads, kv_heads, ffn, vocab, block, outer,
                     gated_mlp=True, tied=tied, max_seq=seq, context=seq, block_class="LlamaDecoderLayer")


_EXTRA_GPT = {"gpt-2.7b": (2560, 32, 32), "gpt-6.7b": (4096, 32, 32), "gpt-13b": (5120, 40, 40),
              "gpt-175b": (12288, 96, 96)}
PRESETS: dict[str, ModelSpec] = {
    **{n: gpt_spec(n, p.d_model, p.n_layers, p.n_heads, context=p.context) for n, p in GPT_PRESETS.items()},
    **{n: gpt_spec(n, *dims) for n, dims in _EXTRA_GPT.items()},
    # 8 experts (top-2) in each of gpt-1.3b's 24 blocks: ~7B parameters, ~2.1B active per token
    "gpt-moe-8x1.3b": replace(gpt_spec("gpt-moe-8x1.3b", 2048, 24, 16), experts=8,
                              params=gpt_spec("x", 2048, 24, 16).params + 7 * 24 * (2 * 2048 * 8192 + 8192 + 2048),
                              block_params=gpt_spec("x", 2048, 24, 16).block_params
                              + 7 * (2 * 2048 * 8192 + 8192 + 2048)),
    "llama-7b": llama_spec("llama-7b", 4096, 32, 32, 32, 11008, 32000, seq=4096),
    "llama-13b": llama_spec("llama-13b", 5120, 40, 40, 40, 13824, 32000, seq=4096),
    "llama-70b": llama_spec("llama-70b", 8192, 80, 64, 8, 28672, 32000, seq=4096),
    "llama3-8b": llama_spec("llama3-8b", 4096, 32, 32, 8, 14336, 128256, seq=8192),
    "llama3-70b": llama_spec("llama3-70b", 8192, 80, 64, 8, 28672, 128256, seq=8192),
    "llama3-405b": llama_spec("llama3-405b", 16384, 126, 128, 8, 53248, 128256, seq=8192),
}
