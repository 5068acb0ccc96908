"""Float8 training's layer rule (--precision fp8, fp8-rowwise; train/parallel/float8.py): which
linear layers torchao's Float8Linear replaces, on models built on the meta device at their
published widths (the rule depends on them), and the refusals that need no GPU. The float8
matmuls themselves run on GPUs only (docs/benchmarks.md)."""

from __future__ import annotations

import pytest
from helpers import require


def _llama_8b(layers: int = 2):
    import torch
    import transformers

    config = transformers.LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=layers,
                                      num_attention_heads=32, num_key_value_heads=8, vocab_size=128256,
                                      tie_word_embeddings=False)
    with torch.device("meta"):
        return transformers.LlamaForCausalLM(config)


def _float8_names(model) -> list[str]:
    return sorted(name for name, m in model.named_modules() if type(m).__name__ == "Float8Linear")


@pytest.mark.parametrize("precision,fsdp", [("fp8", True), ("fp8", False), ("fp8-rowwise", True)])
def test_the_large_projections_of_a_llama_compute_in_float8(precision, fsdp):
    """Llama-3-8B's widths: q, o, gate, up and down in float8; k and v (4096 -> 1024, under
    torchao's measured break-even) and the output head stay bf16. Tensorwise under FSDP2
    all-gathers in float8 and gives the scales' update to run after each step."""
    require("torch")
    require("transformers")
    require("torchao")
    from meshrun.train.parallel.float8 import convert

    model = _llama_8b()
    what, after = convert(model, precision, fsdp=fsdp)
    per_layer = ["mlp.down_proj", "mlp.gate_proj", "mlp.up_proj", "self_attn.o_proj", "self_attn.q_proj"]
    assert _float8_names(model) == [f"model.layers.{i}.{p}" for i in range(2) for p in per_layer]
    gathers = precision == "fp8" and fsdp
    recipe = "tensorwise" if precision == "fp8" else "rowwise"
    assert what == f"float8 {recipe} in 10 of 15 linear layers" + (" (all-gathered in float8)" if gathers else "")
    assert (after is not None) == gathers
    # parameter names stay the bf16 model's: snapshots and pretrained weights load as they are
    assert {n for n, _ in model.named_parameters()} == {n for n, _ in _llama_8b().named_parameters()}


def test_a_tied_output_head_stays_out_and_the_fused_mlp_gives_way():
    """meshrun's GPT at 1.3B's widths (2048): its head is the embedding's weight, never
    converted; the MLP's up projection is, so the fused MLP (which reads the weights without
    calling the layers) is turned off in those blocks."""
    require("torch")
    require("torchao")
    import torch

    from meshrun.train.models.gpt import GPT, GPTConfig
    from meshrun.train.parallel.float8 import convert

    with torch.device("meta"):
        model = GPT(GPTConfig(vocab=50304, seq_len=128, d_model=2048, n_layers=2, n_heads=16, fused_mlp=True))
    assert all(block.fused_mlp for block in model.blocks)
    convert(model, "fp8", fsdp=False)
    assert _float8_names(model) == [f"blocks.{i}.{p}" for i in range(2) for p in ("down", "proj", "qkv", "up")]
    assert type(model.head).__name__ == "Linear" and model.head.weight is model.tok.weight
    assert not any(block.fused_mlp for block in model.blocks)


def test_a_model_too_small_for_float8_is_one_line():
    require("torch")
    require("torchao")
    import torch

    from meshrun.errors import MeshrunError
    from meshrun.train.parallel.float8 import convert

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    with pytest.raises(MeshrunError, match=r"--precision='fp8': none of the model's 2 linear layers is large "
                                           r"enough to gain from float8 \(hint: --precision bf16\)"):
        convert(model, "fp8", fsdp=False)
