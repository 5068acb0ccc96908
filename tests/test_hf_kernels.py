"""meshrun's kernels for a Hugging Face causal LM Liger Kernel does not patch (kernels/hf.py):
transformers' tanh-GELU expressions swapped for torch's GELU, and the training loss taken from
the last hidden states with meshrun's head loss. On the CPU the head loss is its plain
expression (its Triton kernel is checked against it in test_head_loss.py), so the patched
model's loss and gradients must be the model's own; models whose logits are scaled or capped,
whose loss adds terms or whose head is not a plain projection keep their own loss; the run
policy and the planner take the path as the trainer does."""

from __future__ import annotations

import copy
import re

import pytest
from helpers import require

GiB = 2**30


def _torch():
    require("torch")
    require("transformers")
    import torch

    return torch


def _gpt2(**kw):
    """A two-layer GPT-2 (gelu_new, its head tied to the embeddings), fp32, without dropout so
    that two forwards compare."""
    torch = _torch()
    import transformers as T

    torch.manual_seed(0)
    shape = dict(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=64)
    config = T.GPT2Config(**{**shape, **kw}, bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                          attn_pdrop=0.0)
    return T.GPT2LMHeadModel(config)


def _on_meta(family: str):
    """A tiny model of ``family`` on the meta device (its structure is all the checks read)."""
    torch = _torch()
    import transformers as T

    config = T.AutoConfig.for_model(family, vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=2)
    with torch.device("meta"):
        return T.AutoModelForCausalLM.from_config(config)


def _loss_and_grads(model, x, labels=None, **extra):
    from meshrun.modelinfo.loss import loss_mode, model_loss

    model.zero_grad(set_to_none=True)
    if labels is None:
        loss = model_loss(model, loss_mode(model), x, x)
    else:
        loss = model_loss(model, loss_mode(model), x, labels, {"labels": labels, "shift_labels": labels, **extra})
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def test_the_patched_gpt2s_loss_and_gradients_are_its_own():
    """The trainer's call (labels = the inputs, shifted inside; use_cache=False from the same
    loss mode), and a context-parallel shard's (targets shifted already, a divisor given):
    the same loss and gradients to fp32 rounding, the tied head and embedding included; the
    strategy line says what was applied."""
    torch = _torch()
    from meshrun.kernels.hf import apply_hf_kernels
    from meshrun.modelinfo.loss import loss_mode

    own = _gpt2()
    patched = copy.deepcopy(own)
    (line,) = apply_hf_kernels(patched)
    assert re.fullmatch(r"meshrun kernels for gpt2 \(tanh GELU, (Triton )?head loss\)", line), line
    assert "forward" in vars(patched) and loss_mode(patched) == loss_mode(own) == "labels-nocache"
    assert patched.lm_head.weight is patched.transformer.wte.weight
    x = torch.randint(0, 256, (2, 16))
    shard = x.clone()
    shard[:, -1] = -100
    shard[0, :5] = -100
    for labels, extra in ((None, {}), (shard, {"num_items_in_batch": 40.0})):
        want, want_grads = _loss_and_grads(own, x, labels, **extra)
        got, got_grads = _loss_and_grads(patched, x, labels, **extra)
        assert torch.allclose(got, want, rtol=1e-5, atol=1e-6), (got, want)
        for name, g in want_grads.items():
            assert torch.allclose(got_grads[name], g, rtol=1e-5, atol=1e-6), name
    # the head loss returns the loss alone: no logits were made
    out = patched(input_ids=x, labels=x, use_cache=False)
    assert out.logits is None and out.loss is not None


def test_the_tanh_gelu_swap_computes_the_same_function():
    """NewGELUActivation (gelu_new), FastGELUActivation and GELUTanh's Python expression against
    torch's tanh GELU, fp32; GELUTanh on torch's op already is left as it is; the swapped
    GPT-2's logits are its own."""
    torch = _torch()
    from transformers import activations

    from meshrun.kernels.hf import TanhGELU, patch, tanh_gelus

    x = torch.randn(4096) * 4
    for act in (activations.NewGELUActivation(), activations.FastGELUActivation(),
                activations.GELUTanh(use_gelu_tanh_python=True)):
        assert torch.allclose(TanhGELU()(x), act(x), rtol=1e-6, atol=1e-6), type(act).__name__
    assert tanh_gelus(_on_meta("starcoder2")) == []  # gelu_pytorch_tanh: torch's GELU already

    own = _gpt2()
    swapped = copy.deepcopy(own)
    done = patch(swapped)
    assert len(done.gelus) == 2 and all(type(b.mlp.act) is TanhGELU for b in swapped.transformer.h)
    ids = torch.randint(0, 256, (2, 16))
    assert torch.allclose(swapped(input_ids=ids).logits, own(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    done.undo(swapped)
    assert "forward" not in vars(swapped)
    assert all(type(b.mlp.act) is activations.NewGELUActivation for b in swapped.transformer.h)


def test_eval_mode_and_a_call_without_labels_get_the_logits():
    """Validation (eval mode, labels given) and a call without labels run the model's own
    forward: its logits, and in eval its own loss."""
    torch = _torch()
    from meshrun.kernels.hf import apply_hf_kernels

    own = _gpt2()
    patched = copy.deepcopy(own)
    apply_hf_kernels(patched)
    x = torch.randint(0, 256, (2, 16))
    assert torch.allclose(patched(input_ids=x).logits, own(input_ids=x).logits, atol=1e-5)
    own.eval()
    patched.eval()
    got, want = patched(input_ids=x, labels=x), own(input_ids=x, labels=x)
    assert got.logits.shape == (2, 16, 256) and torch.allclose(got.logits, want.logits, atol=1e-5)
    assert torch.allclose(got.loss, want.loss, atol=1e-6)


@pytest.mark.parametrize(("family", "why"), [
    ("gemma2", "its config scales or caps the logits (final_logit_softcapping=30.0)"),
    ("cohere", "its config scales or caps the logits (logit_scale=0.0625)"),
    ("granite", "its config scales or caps the logits (logits_scaling=1.0)"),
    ("olmoe", "its forward changes loss (loss += self.router_aux_loss_coef * aux_loss.to(loss.device))"),
    ("phi", "its head is Linear with a bias, not a linear projection without bias"),
    ("opt", "its logits are not the head's projection of the hidden states alone "
            "(logits = self.lm_head(hidden_states).contiguous())"),
])
def test_a_model_whose_head_is_not_a_plain_projection_keeps_its_own_loss(family, why):
    """Capped or scaled logits, a loss with more terms, a head with a bias, logits changed after
    the head: refused with the reason, the forward left alone (its GELU may still be swapped)."""
    _torch()
    from meshrun.kernels.hf import head_loss_refusal, patch

    model = _on_meta(family)
    assert head_loss_refusal(model) == why
    assert patch(model).loss is False and "forward" not in vars(model)


def test_where_the_path_applies():
    """A GPT-2 (GELU and loss), a StarCoder2 (its loss) and a Phi (its GELU) on GPUs; not on the
    CPU, nor under --tp/--pp; not a model Liger knows (Llama: Liger's kernels), nor one with
    nothing to patch (Cohere: SiLU, scaled logits)."""
    torch = _torch()
    require("liger_kernel")
    from meshrun.kernels.hf import hf_kernels_apply

    gpt2 = _gpt2()
    cuda = torch.device("cuda", 0)
    assert hf_kernels_apply(gpt2) and hf_kernels_apply(gpt2, cuda)
    assert not hf_kernels_apply(gpt2, torch.device("cpu"))
    assert not hf_kernels_apply(gpt2, cuda, tp=2) and not hf_kernels_apply(gpt2, cuda, pp=2)
    assert hf_kernels_apply(_on_meta("starcoder2")) and hf_kernels_apply(_on_meta("phi"))
    assert not hf_kernels_apply(_on_meta("llama")) and not hf_kernels_apply(_on_meta("cohere"))


def test_the_policy_and_the_planner_take_the_path_as_the_trainer_does():
    """--kernels auto on GPUs: kernels "meshrun", compiled per block, and planned with the head
    loss (no fp32 logits or log-softmax at the loss: a larger micro-batch fits); --kernels plain
    or a ZeRO-3 run: not. The trace patches the model for its forward and leaves it as it was."""
    torch = _torch()
    from meshrun.config import TrainConfig, validate
    from meshrun.plan.trace import trace
    from meshrun.training.parallel.auto import decide

    with torch.device("meta"):
        model = _gpt2()
    vocab, seq = model.config.vocab_size, 64
    plain = trace(model, "autocast", seq, compiled=False)
    fused = trace(model, "autocast", seq, compiled=False, hf_kernels=True)
    assert "forward" not in vars(model) and plain is not None and fused is not None
    # torch's loss holds bf16 logits, their fp32 copy and log-softmax's fp32 output at once; the
    # head loss the bf16 logits (their gradient in place)
    assert plain.tail[0] - fused.tail[0] >= 4 * seq * vocab
    # the MLP's GELU in bf16, not fp32, under autocast
    assert fused.blocks[0] < plain.blocks[0]

    with torch.device("meta"):  # GPT-2's vocabulary and context on 8-GiB GPUs: the logits weigh
        model = _gpt2(vocab_size=50257, n_positions=1024)
    cfg = validate(TrainConfig(seq_len=1024))
    auto = decide(model, cfg, 2, 2, 2, 8 * GiB, True, hf_kernels=True)
    assert (auto.kernels, auto.hf_kernels, auto.liger, auto.compile_mode) == ("meshrun", True, False, "per-block")
    off = decide(model, cfg, 2, 2, 2, 8 * GiB, True, hf_kernels=False)
    assert (off.kernels, off.hf_kernels) == ("plain", False)
    assert auto.largest_micro is not None and off.largest_micro is not None
    assert auto.largest_micro > off.largest_micro
    by_hand = decide(model, validate(TrainConfig(seq_len=1024, kernels="plain")), 2, 2, 2, 141 * GiB, True,
                     hf_kernels=True)
    assert (by_hand.kernels, by_hand.hf_kernels) == ("plain", False)
    zero3 = decide(model, validate(TrainConfig(seq_len=1024, strategy="zero3")), 2, 2, 2, 141 * GiB, True,
                   hf_kernels=True)
    assert zero3.hf_kernels is False
