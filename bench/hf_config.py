"""Write the config.json of a published Hugging Face model shape, for benchmarks that train
one from a random initialisation (nothing is downloaded: the shapes are written here).

    python3 bench/hf_config.py llama3-8b /tmp/llama3-8b [--layers 4] [--seq 8192] [--weights]
    meshrun train --model /tmp/llama3-8b --data random ...

Shapes: llama3-8b (Llama-3-8B: 4096 wide, 32 layers, 32 heads of which 8 key/value heads,
SwiGLU 14336, vocabulary 128256, rotary theta 5e5, untied), llama3.2-1b (2048, 16 layers, 32/8
heads, 8192, tied), qwen2.5-0.5b (896, 24 layers, 14/2 heads, 4864, tied, q/k/v biases).
``--layers`` keeps the shape with fewer layers (memory tests of a large model on a small host);
``--weights`` also writes random bf16 weights as save_pretrained lays them out (5-GB safetensors
shards and their index), drawn on a GPU where there is one: a pretrained model to load.
"""

from __future__ import annotations

import argparse

SHAPES = {
    "llama3-8b": ("llama", dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                                num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False)),
    "llama3.2-1b": ("llama", dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                                  num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=True)),
    "qwen2.5-0.5b": ("qwen2", dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0,
                                   tie_word_embeddings=True)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("shape", choices=list(SHAPES))
    ap.add_argument("out", help="the directory to write config.json into")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--seq", type=int, default=8192, help="max_position_embeddings (default 8192)")
    ap.add_argument("--weights", action="store_true", help="also write random bf16 weights, sharded")
    a = ap.parse_args()
    import transformers

    family, values = SHAPES[a.shape]
    values = {**values, "max_position_embeddings": a.seq}
    if a.layers:
        values["num_hidden_layers"] = a.layers
    config = transformers.AutoConfig.for_model(family, **values)
    config.save_pretrained(a.out)
    print(f"wrote {a.out}/config.json ({a.shape}, {values['num_hidden_layers']} layers)")
    if a.weights:
        write_weights(config, a.out)


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
