"""Write the config.json of a published Hugging Face model shape, for benchmarks that train
one from a random initialisation (nothing is downloaded: the shapes are written here).

    python3 bench/hf_config.py llama3-8b /tmp/llama3-8b [--layers 4] [--seq 8192] [--weights]
    meshrun train --model /tmp/llama3-8b --data random ...

Shapes: llama3-8b (Llama-3-8B: 4096 wide, 32 layers, 32 heads of which 8 key/value heads,
SwiGLU 14336, vocabulary 128256, rotary theta 5e5, untied), llama3.2-1b (2048, 16 layers, 32/8
heads, 8192, tied), qwen2.5-0.5b (896, 24 layers, 14/2 heads, 4864, tied, q/k/v biases),
qwen2.5-1.5b (1536, 28 layers, 12/2 heads, 8960, vocabulary 151936, theta 1e6, tied, q/k/v
biases, 32K context), mistral-7b (Mistral-7B v0.3: 4096, 32 layers, 32/8 heads, 14336,
vocabulary 32768, theta 1e6, untied, no sliding window, 32K context), gemma-2-2b (2304, 26
layers, 8/4 heads of 256, GeGLU 9216, vocabulary 256000, tied, sliding window 4096 in every
other layer, attention and final logits soft-capped at 50 and 30, 8K context), gpt2 and
gpt2-medium (GPT-2 124M and 355M: 768/1024 wide, 12/24 layers, vocabulary 50257, 1024
positions, tied), mixtral-small (Mixtral's block at a small size: 1024 wide, 8 layers, 16/8
heads, 8 experts of 3584 with 2 per token, vocabulary 32000, untied). Families the planner never
saw, as published: qwen3-1.7b (2048, 28 layers, 16/8 heads of 128, q/k norms, 6144, vocabulary
151936, tied), phi-3-mini (3.8B: 3072, 32 layers, 32 heads, fused qkv and gate/up, vocabulary
32064, untied), olmo-2-1b (2048, 16 layers, 16 heads, norms after attention and MLP, q/k norms,
vocabulary 100352, untied), granite-3-2b (2048, 40 layers, 32/8 heads, embedding, residual,
attention and logit multipliers, vocabulary 49155, tied), starcoder2-3b (3072, 30 layers, 24/2
heads, LayerNorm and biases, a GELU MLP of 12288, vocabulary 49152, tied; a family Liger Kernel
does not patch), qwen3-moe-small (Qwen3-30B-A3B's block, 4 layers: 128 experts of 768 with 8 per
token, vocabulary 151936).
``--seq`` sets max_position_embeddings (default: the shape's published context where it states
one here, else 8192); ``--layers`` keeps the shape with fewer layers (memory tests of a large
model on a small host); ``--weights`` also writes random bf16 weights as save_pretrained lays
them out (5-GB safetensors shards and their index), drawn on a GPU where there is one (from
``--seed`` when given): a pretrained model to load.
"""

from __future__ import annotations

import argparse
from typing import Any

SHAPES = {
    "llama3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                rope_theta=500000.0, tie_word_embeddings=False)),
    "llama3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                  num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                  rope_theta=500000.0, tie_word_embeddings=True)),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                                   num_attention_heads=14, num_key_value_heads=2, vocab_size=151936,
                                   rope_theta=1000000.0, tie_word_embeddings=True)),
    "qwen2.5-1.5b": ("qwen2", dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                                   num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                                   rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=32768)),
    "mistral-7b": ("mistral", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                   num_attention_heads=32, num_key_value_heads=8, vocab_size=32768,
                                   rope_theta=1000000.0, tie_word_embeddings=False, sliding_window=None,
                                   max_position_embeddings=32768)),
    "gemma-2-2b": ("gemma2", dict(hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
                                  num_key_value_heads=4, head_dim=256, vocab_size=256000, tie_word_embeddings=True,
                                  query_pre_attn_scalar=256, sliding_window=4096, attn_logit_softcapping=50.0,
                                  final_logit_softcapping=30.0, hidden_activation="gelu_pytorch_tanh",
                                  rope_theta=10000.0, max_position_embeddings=8192)),
    "gpt2": ("gpt2", dict(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024,
                          tie_word_embeddings=True)),
    "gpt2-medium": ("gpt2", dict(n_embd=1024, n_layer=24, n_head=16, vocab_size=50257, n_positions=1024,
                                 tie_word_embeddings=True)),
    "mixtral-small": ("mixtral", dict(hidden_size=1024, intermediate_size=3584, num_hidden_layers=8,
                                      num_attention_heads=16, num_key_value_heads=8, num_local_experts=8,
                                      num_experts_per_tok=2, vocab_size=32000, rope_theta=1000000.0,
                                      tie_word_embeddings=False, sliding_window=None)),
    # families the planner was never fitted to or measured on before (bench/memory_grid.py --grid new)
    "qwen3-1.7b": ("qwen3", dict(hidden_size=2048, intermediate_size=6144, num_hidden_layers=28,
                                 num_attention_heads=16, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                 rope_theta=1000000.0, tie_word_embeddings=True, max_position_embeddings=40960)),
    "phi-3-mini": ("phi3", dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
                                num_attention_heads=32, num_key_value_heads=32, vocab_size=32064,
                                rope_theta=10000.0, tie_word_embeddings=False, max_position_embeddings=4096,
                                pad_token_id=32000, bos_token_id=1, eos_token_id=32000)),
    "olmo-2-1b": ("olmo2", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                num_attention_heads=16, num_key_value_heads=16, vocab_size=100352,
                                rope_theta=500000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
                                max_position_embeddings=4096, pad_token_id=100277, bos_token_id=None,
                                eos_token_id=100257)),
    "granite-3-2b": ("granite", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=40,
                                     num_attention_heads=32, num_key_value_heads=8, vocab_size=49155,
                                     rope_theta=5000000.0, tie_word_embeddings=True, embedding_multiplier=12.0,
                                     logits_scaling=8.0, residual_multiplier=0.22, attention_multiplier=0.015625,
                                     max_position_embeddings=131072, pad_token_id=0, bos_token_id=0,
                                     eos_token_id=0)),
    "starcoder2-3b": ("starcoder2", dict(hidden_size=3072, intermediate_size=12288, num_hidden_layers=30,
                                         num_attention_heads=24, num_key_value_heads=2, vocab_size=49152,
                                         rope_theta=999999.4420358813, tie_word_embeddings=True,
                                         hidden_act="gelu_pytorch_tanh", norm_epsilon=1e-5, use_bias=True,
                                         sliding_window=4096, max_position_embeddings=16384, bos_token_id=0,
                                         eos_token_id=0)),
    "qwen3-moe-small": ("qwen3_moe", dict(hidden_size=2048, moe_intermediate_size=768, intermediate_size=6144,
                                          num_hidden_layers=4, num_attention_heads=32, num_key_value_heads=4,
                                          head_dim=128, num_experts=128, num_experts_per_tok=8,
                                          decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                                          vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=False,
                                          max_position_embeddings=40960)),
}
# max_position_embeddings of a shape that states no context of its own here
DEFAULT_SEQ = 8192


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=list(SHAPES))
    ap.add_argument("out", help="the directory to write config.json into")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None,
                    help=f"max_position_embeddings (default: the shape's published context, else {DEFAULT_SEQ})")
    ap.add_argument("--weights", action="store_true", help="also write random bf16 weights, sharded")
    ap.add_argument("--seed", type=int, default=None, help="with --weights: draw them from this seed")
    a = ap.parse_args()
    config = write_config(a.shape, a.out, layers=a.layers, seq=a.seq)
    if a.weights:
        if a.seed is not None:
            import torch

            torch.manual_seed(a.seed)
        write_weights(config, a.out)


def write_config(shape: str, out: str, layers: int | None = None, seq: int | None = None) -> Any:
    """Write ``shape``'s config.json into ``out`` (``layers``, ``seq``: as --layers, --seq) and
    return the config."""
    import transformers

    family, values = SHAPES[shape]
    positions, depth = ("n_positions", "n_layer") if family == "gpt2" else ("max_position_embeddings",
                                                                              "num_hidden_layers")
    values = {**values, positions: seq or values.get(positions, DEFAULT_SEQ)}
    if layers:
        values[depth] = layers
    config = transformers.AutoConfig.for_model(family, **values)
    config.save_pretrained(out)
    print(f"wrote {out}/config.json ({shape}, {values[depth]} layers, {values[positions]} positions)")
    return config


def write_weights(config, out: str, shard_bytes: int = 5 * 10**9) -> None:
    """Random bf16 weights (norms 1, the rest N(0, 0.02)) in save_pretrained's layout."""
    import json
    import os

    import torch
    from safetensors.torch import save_file

    from meshrun.modelinfo.hf import INDEX, build_on_meta

    model = build_on_meta(config)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    params = dict(model.named_parameters())  # tied weights once
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, p in params.items():
        t = torch.ones(p.shape, dtype=torch.bfloat16, device=device) if p.dim() == 1 else \
            (torch.randn(p.shape, device=device) * 0.02).to(torch.bfloat16)
        if size + t.nbytes > shard_bytes and shards[-1]:
            shards.append({})
            size = 0
        shards[-1][name] = t.cpu()
        size += t.nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, os.path.join(out, file), metadata={"format": "pt"})
        weight_map.update({k: file for k in shard})
    total = sum(t.nbytes for s in shards for t in s.values())
    with open(os.path.join(out, INDEX), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    print(f"wrote {len(shards)} weight file(s), {total / 2**30:.1f} GiB, to {out}")


if __name__ == "__main__":
    main()
