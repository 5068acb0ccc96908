"""A Hugging Face family left on eager attention (no SDPA path: Gemma-2's soft-capping) runs
in FlexAttention on GPUs (models/masks.py ``flex_for_eager``): the logits and gradients must be
eager attention's, soft-capping and sliding windows included. Checked on the CPU in fp32,
forward only: torch's CPU FlexAttention has no backward (torch 2.13); the backward is the
kernel's own, the same function's gradient."""

from __future__ import annotations

import copy

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from meshrun.modelinfo.hf import build_on_meta, flex_for_eager  # noqa: E402
from meshrun.training.models.masks import FLEX_HF, use_flex_in_transformers  # noqa: E402


def _gemma2(softcap: float | None = 5.0, window: int = 8) -> object:
    """A 2-layer Gemma-2 (one sliding-window layer, one global) as transformers builds it
    with the attention it picks itself."""
    cfg = transformers.Gemma2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                    head_dim=16, intermediate_size=128, vocab_size=256, max_position_embeddings=64,
                                    sliding_window=window, attn_logit_softcapping=softcap,
                                    final_logit_softcapping=30.0, query_pre_attn_scalar=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    # scores large enough that the soft-capping bends them (at initialisation they are tiny)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(8.0)
    return model


def _logits(model: object, ids: object) -> object:
    with torch.no_grad():
        return model(input_ids=ids).logits


def test_gemma2_is_left_on_eager_attention_and_is_flagged_for_flex():
    model = build_on_meta(_gemma2().config)
    assert model.config._attn_implementation == "eager"
    assert flex_for_eager(model)
    llama = build_on_meta(transformers.LlamaConfig(hidden_size=64, num_hidden_layers=1, num_attention_heads=4,
                                                   num_key_value_heads=2, intermediate_size=128, vocab_size=256))
    assert llama.config._attn_implementation == "sdpa" and not flex_for_eager(llama)


@pytest.mark.parametrize("softcap", [5.0, None], ids=["softcapped", "plain"])
def test_flex_attention_gives_eager_attentions_logits(softcap):
    eager = _gemma2(softcap)
    assert eager.config._attn_implementation == "eager"
    flex = copy.deepcopy(eager)
    use_flex_in_transformers(flex)
    assert flex.config._attn_implementation == FLEX_HF
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))  # 24 > the window of 8
    want = _logits(eager, ids)
    torch.testing.assert_close(_logits(flex, ids), want, atol=2e-5, rtol=1e-4)
    # the soft-capping and the window matter at these scores: without either the logits differ
    for other in (_gemma2(None if softcap else 5.0), _gemma2(softcap, window=64)):
        other.load_state_dict(eager.state_dict())
        assert (_logits(other, ids) - want).abs().max() > 1e-3


def test_the_planner_traces_what_flex_attention_keeps_not_eagers_scores():
    """What a block keeps grows linearly in the sequence under FlexAttention (no score matrix
    is kept), where eager attention's saved scores grow with its square; the model is given
    back on eager attention."""
    from meshrun.plan.trace import trace

    model = build_on_meta(_gemma2(window=4096).config)
    short, long = (trace(model, "autocast", seq, compiled=False) for seq in (256, 1024))
    assert short is not None and long is not None
    assert long.blocks[0] / short.blocks[0] == pytest.approx(4.0, rel=0.05)
    assert model.config._attn_implementation == "eager"
