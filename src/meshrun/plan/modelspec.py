"""What the planner needs to know about a model, from a preset, a HuggingFace config.json,
or any ``module:factory`` built on the meta device. Never downloads anything."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from ..errors import bad_value
from ..train.config import GPT_PRESETS


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
    max_seq: int | None = None
    source: str = "preset"
    block_class: str | None = None  # the class FSDP wraps (accelerate's transformer_layer_cls_to_wrap)
    experts: int = 0  # mixture of experts: experts per block (their parameters are in params)
    top_k: int = 2
    # meshrun's GPT casts its residual stream to the autocast dtype (train/models.py); other
    # models under autocast keep it fp32 (type promotion from the fp32 embeddings).
    bf16_residual: bool = False
    # meshrun's GPT with fused_loss: the loss taken chunk by chunk (train/losses.py)
    fused_loss: bool = False
    # Rows of a learned position table that meshrun's GPT builds at the training sequence
    # length (train/models.py), counted in params and outer_params; 0: none, or a table of
    # fixed size (a Hugging Face config's n_positions). at_seq() resizes it.
    learned_positions: int = 0

    def at_seq(self, seq: int) -> ModelSpec:
        """The model as meshrun's GPT builds it for ``seq`` tokens: at 512K tokens GPT 1.3B's
        position table is 1.07B parameters, as many as the rest of the model (measured: the
        planner left them out and under-predicted FSDP2 x CP4 by 17-18%, eighth session)."""
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
        return 6 * active + 12 * self.layers * self.hidden * seq

    def work_flops_per_token(self, seq: int) -> float:
        """What the kernels compute: 6N + 6·L·h·s. Causal attention needs half of the score
        and value products, and fused attention kernels skip the masked blocks; the MFU
        convention above counts them whole (the issue's formula, PaLM's). At 1024 tokens the
        two differ by 3-7%; at 256K tokens by 1.9x (what a long-sequence step time follows)."""
        return self.flops_per_token(seq) - 6 * self.layers * self.hidden * seq


def gpt_spec(name: str, hidden: int, layers: int, heads: int, vocab: int = 50304, seq: int = 1024,
             max_seq: int | None = None) -> ModelSpec:
    """meshrun's GPT (train/models.py): learned positions, biases, LayerNorm, GELU 4x, tied head."""
    block = 12 * hidden * hidden + 13 * hidden
    outer = vocab * hidden + seq * hidden + 2 * hidden
    return ModelSpec(name, layers * block + outer, layers, hidden, heads, heads, 4 * hidden, vocab,
                     block, outer, gated_mlp=False, tied=True, max_seq=max_seq, block_class="Block",
                     bf16_residual=True, learned_positions=seq)


def llama_spec(name: str, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int, vocab: int,
               tied: bool = False, seq: int | None = None) -> ModelSpec:
    """Llama-style: RMSNorm, no biases, grouped-query attention, SwiGLU MLP, rotary positions."""
    kv = hidden // heads * kv_heads
    block = 2 * hidden * hidden + 2 * hidden * kv + 3 * hidden * ffn + 2 * hidden
    outer = vocab * hidden * (1 if tied else 2) + hidden
    return ModelSpec(name, layers * block + outer, layers, hidden, heads, kv_heads, ffn, vocab, block, outer,
                     gated_mlp=True, tied=tied, max_seq=seq, block_class="LlamaDecoderLayer")


_EXTRA_GPT = {"gpt-2.7b": (2560, 32, 32), "gpt-6.7b": (4096, 32, 32), "gpt-13b": (5120, 40, 40),
              "gpt-175b": (12288, 96, 96)}
PRESETS: dict[str, ModelSpec] = {
    **{n: gpt_spec(n, d["d_model"], d["n_layers"], d["n_heads"]) for n, d in GPT_PRESETS.items()},
    **{n: gpt_spec(n, *dims) for n, dims in _EXTRA_GPT.items()},
    # 8 experts (top-2) in each of gpt-1.3b's 24 blocks: ~7B parameters, ~2.1B active per token
    "gpt-moe-8x1.3b": replace(gpt_spec("gpt-moe-8x1.3b", 2048, 24, 16), experts=8,
                              params=gpt_spec("x", 2048, 24, 16).params + 7 * 24 * (2 * 2048 * 8192 + 8192 + 2048),
                              block_params=gpt_spec("x", 2048, 24, 16).block_params + 7 * (2 * 2048 * 8192 + 8192 + 2048)),
    "llama-7b": llama_spec("llama-7b", 4096, 32, 32, 32, 11008, 32000, seq=4096),
    "llama-13b": llama_spec("llama-13b", 5120, 40, 40, 40, 13824, 32000, seq=4096),
    "llama-70b": llama_spec("llama-70b", 8192, 80, 64, 8, 28672, 32000, seq=4096),
    "llama3-8b": llama_spec("llama3-8b", 4096, 32, 32, 8, 14336, 128256, seq=8192),
    "llama3-70b": llama_spec("llama3-70b", 8192, 80, 64, 8, 28672, 128256, seq=8192),
    "llama3-405b": llama_spec("llama3-405b", 16384, 126, 128, 8, 53248, 128256, seq=8192),
}


def resolve_model(text: str, where: str = "--model") -> ModelSpec:
    """A preset name, a path to a HuggingFace ``config.json`` (or its folder), or ``module:factory``."""
    if text in PRESETS:
        return PRESETS[text]
    path = os.path.join(text, "config.json") if os.path.isdir(text) else text
    if path.endswith(".json"):
        if not os.path.isfile(path):
            raise bad_value(where, text, "no such file", "give a preset, a config.json path, or module:factory")
        return from_hf_config(path, where)
    if ":" in text and not os.path.exists(text):
        return from_factory(text, where)
    raise bad_value(where, text, "is not a preset, a config.json, or module:factory",
                    f"presets: {', '.join(PRESETS)}")


def _need(cfg: dict, where: str, *keys: str) -> int:
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise bad_value(f"{where} {key}", value, "must be a positive integer")
            return value
    raise bad_value(where, "(missing)", f"has none of {', '.join(keys)}",
                    "give a decoder model's config.json (Llama, Mistral, Qwen, GPT-2, GPT-NeoX ...)")


def from_hf_config(path: str, where: str = "--model") -> ModelSpec:
    """Shape from the config's fields; the exact parameter count from transformers on the
    meta device when transformers is installed (no weights are read or downloaded)."""
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise bad_value(where, path, f"cannot read it as JSON ({exc})".replace("\n", " ")) from None
    if not isinstance(cfg, dict):
        raise bad_value(where, path, "is not a JSON object")
    hidden = _need(cfg, path, "hidden_size", "n_embd", "d_model")
    layers = _need(cfg, path, "num_hidden_layers", "n_layer", "num_layers")
    heads = _need(cfg, path, "num_attention_heads", "n_head")
    vocab = _need(cfg, path, "vocab_size")
    kv_heads = cfg.get("num_key_value_heads") or heads
    act = str(cfg.get("hidden_act") or cfg.get("activation_function") or "")
    gated = act in ("silu", "swiglu") or cfg.get("model_type") in ("llama", "mistral", "qwen2", "qwen3", "gemma")
    ffn = cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * hidden
    seq = cfg.get("max_position_embeddings") or cfg.get("n_positions")
    tied = bool(cfg.get("tie_word_embeddings", not gated))
    name = cfg.get("_name_or_path") or cfg.get("model_type") or os.path.basename(os.path.dirname(os.path.abspath(path)))
    if gated:
        spec = llama_spec(str(name), hidden, layers, heads, kv_heads, ffn, vocab, tied, seq)
    else:
        spec = gpt_spec(str(name), hidden, layers, heads, vocab, seq or 1024, seq)
        spec = replace(spec, ffn=ffn)
    spec = replace(spec, source=f"config {path} (parameters counted from its shapes)", block_class=None,
                   bf16_residual=False, learned_positions=0)  # the config's table, whatever the sequence
    exact = _count_with_transformers(cfg)
    if exact is not None:
        total, block, cls = exact
        spec = replace(spec, params=total, block_params=block, outer_params=max(0, total - layers * block),
                       block_class=cls, source=f"config {path} (transformers on the meta device)")
    return spec


def _count_with_transformers(cfg: dict) -> tuple[int, int, str | None] | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    try:
        conf = transformers.AutoConfig.for_model(**cfg)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(conf)
    except Exception:  # an architecture this transformers does not know: the formula stands
        return None
    return _count(model)


def _count(model) -> tuple[int, int, str | None]:
    from ..train.parallelize import find_blocks

    total = sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())
    found = find_blocks(model)
    block = max((sum(p.numel() for p in b.parameters()) for b in found[1]), default=0) if found else 0
    return total, block, type(found[1][0]).__name__ if found else None


def from_factory(text: str, where: str = "--model") -> ModelSpec:
    """Build the user's model on the meta device (no memory, no init cost) and read it."""
    import torch
    import torch.nn as nn

    from ..train.factories import load_factory

    factory = load_factory(text, where)
    with torch.device("meta"):
        model = factory()
    if not isinstance(model, nn.Module):
        raise bad_value(where, text, f"returned {type(model).__name__}, not an nn.Module")
    return from_module(model, text, f"factory {text} on the meta device")


def from_module(model, name: str, source: str) -> ModelSpec:
    """Count a module's parameters, find its block list and read the widths from the first
    block's Linear layers (hidden = the first one's input; MLP width = the widest output; a
    gated MLP has two Linears of that width). meshrun's own GPT is read exactly."""
    import torch.nn as nn

    from ..train.parallelize import find_blocks

    cfg = getattr(model, "cfg", None)
    if all(hasattr(cfg, k) for k in ("d_model", "n_layers", "n_heads", "vocab", "seq_len")):
        spec = gpt_spec(name, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.vocab, cfg.seq_len)
        return replace(spec, source=source, bf16_residual=bool(getattr(cfg, "low_precision_residual", False)),
                       fused_loss=bool(getattr(cfg, "fused_loss", False)),
                       learned_positions=0)  # built: its table stays the size the factory gave it
    total, block, cls = _count(model)
    found = find_blocks(model)
    layers = len(found[1]) if found else 1
    first = found[1][0] if found else model
    linears = [m for m in first.modules() if isinstance(m, nn.Linear)]
    hidden = linears[0].in_features if linears else max(1, int((total / 12) ** 0.5))
    ffn = max((m.out_features for m in linears), default=4 * hidden)
    gated = sum(1 for m in linears if m.out_features == ffn) >= 2 and ffn != 3 * hidden
    embeds = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab = max((e.num_embeddings for e in embeds), default=0)
    tied = any(isinstance(m, nn.Linear) and any(m.weight is e.weight for e in embeds) for m in model.modules())
    heads = next((int(getattr(m, a)) for m in first.modules() for a in ("n_heads", "num_heads", "num_attention_heads")
                  if isinstance(getattr(m, a, None), int)), max(1, hidden // 64))
    return ModelSpec(name, total, layers, hidden, heads, heads, ffn, vocab, block or total, total - layers * block,
                     gated_mlp=gated, tied=tied, block_class=cls,
                     source=f"{source} (activations estimated as a transformer with hidden {hidden}, MLP {ffn})")
