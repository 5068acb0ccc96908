"""What a Hugging Face model keeps with Liger Kernel's fused kernels, traced on the meta device
(plan/trace_liger.py), and the planner's terms that come with it: the fused loss's
gradients instead of the logits, the fused Mixture-of-Experts' backward buffers, the
allocator's new segments when validation computes whole logits, and `meshrun plan` choosing
the kernels as `meshrun train` would."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import subprocess
import sys
from collections.abc import Iterator

import pytest
from helpers import clean_env, require

GiB = 2**30


def _liger():
    require("torch")
    require("transformers")
    require("liger_kernel")
    import torch

    return torch


@pytest.fixture(autouse=True)
def _llamas_module_is_transformers_own() -> Iterator[None]:
    """Every test here leaves transformers' Llama module as it found it: ranks forked later in
    this process (the TP tests) would otherwise run Liger's Triton norm on the CPU."""
    yield
    if "transformers.models.llama.modeling_llama" in sys.modules:
        modeling = sys.modules["transformers.models.llama.modeling_llama"]
        names = (modeling.LlamaRMSNorm, modeling.LlamaMLP, modeling.apply_rotary_pos_emb,
                 modeling.LlamaForCausalLM.forward)
        assert all(n.__module__ == modeling.__name__ for n in names), [n.__module__ for n in names]


@contextlib.contextmanager
def _put_back(*modules) -> Iterator[None]:
    """Liger patches an architecture's module for the whole process (its norm, MLP and rotary
    names, the causal LM's forward, torch's cross-entropy): the names of ``modules`` and of the
    classes defined there are put back afterwards, so a later test in this process (and the
    ranks it forks) runs transformers' own code."""
    kept = [(m, dict(vars(m))) for m in modules]
    kept += [(c, dict(vars(c))) for m in modules for c in list(vars(m).values())
             if inspect.isclass(c) and c.__module__ == m.__name__]
    try:
        yield
    finally:
        for owner, names in kept:
            for name in set(vars(owner)) - set(names):
                delattr(owner, name)
            for name, value in names.items():
                if vars(owner).get(name, object()) is not value:
                    setattr(owner, name, value)


def _llama(vocab: int = 4096, hidden: int = 64, layers: int = 2):
    torch = _liger()
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      tie_word_embeddings=False)
    with torch.device("meta"):
        return LlamaForCausalLM(cfg)


def test_liger_keeps_the_fused_losss_gradients_not_the_logits_and_leaves_everything_as_it_was():
    """With Liger's kernels the tail holds the head weight's fp32 gradient (its largest tensor),
    autocast's two bf16 copies of the weight, the input's gradient, and no fp32 logits; the
    blocks keep less (SwiGLU keeps its two inputs, RMSNorm its input and an fp32 scale). The
    model is not patched, and transformers' and Liger's modules are as they were."""
    _liger()
    import transformers.models.llama.modeling_llama as modeling
    from liger_kernel.ops import LigerFusedLinearCrossEntropyFunction, LigerRMSNormFunction

    from meshrun.plan.trace import trace

    vocab, hidden, seq = 4096, 64, 64
    model = _llama(vocab, hidden)
    before = (modeling.LlamaForCausalLM.forward, modeling.apply_rotary_pos_emb, modeling.LlamaRMSNorm,
              modeling.LlamaMLP)
    plain = trace(model, "autocast", seq, compiled=False)
    liger = trace(model, "autocast", seq, compiled=False, liger=True)
    assert plain is not None and liger is not None
    assert liger.tail_largest[0] == vocab * hidden * 4  # the head weight's fp32 gradient
    fp32_logits = seq * vocab * 4
    assert plain.tail_steepest[1] - plain.tail_steepest[0] >= fp32_logits  # eager: logits per sequence
    assert liger.tail_steepest[1] - liger.tail_steepest[0] < fp32_logits
    # the loss's gradients (weight fp32 and input), two bf16 copies of the weight, one chunk of logits
    assert liger.tail[0] >= vocab * hidden * 4 + 2 * vocab * hidden * 2 + seq * hidden * 4
    assert liger.tail[0] < plain.tail[0]
    assert liger.blocks[0] < plain.blocks[0]
    assert liger.eval_logits and liger.loss_inside and liger.liger and not plain.liger
    after = (modeling.LlamaForCausalLM.forward, modeling.apply_rotary_pos_emb, modeling.LlamaRMSNorm,
             modeling.LlamaMLP)
    assert after == before
    assert "forward" not in vars(model.model.norm) and "forward" not in vars(model.model.layers[0].mlp)
    assert "apply" not in vars(LigerRMSNormFunction) and "apply" not in vars(LigerFusedLinearCrossEntropyFunction)


def test_liger_loss_alone_keeps_the_compiled_blocks_and_no_logits():
    """Compiled blocks with Liger's fused loss alone (``liger_loss``): the blocks keep what
    torch.compile keeps of the model's own blocks, the tail no fp32 logits; nothing stays patched."""
    _liger()
    import transformers.models.llama.modeling_llama as modeling

    from meshrun.plan.trace import trace

    vocab, hidden, seq = 4096, 64, 64
    model = _llama(vocab, hidden)
    forward, norm = modeling.LlamaForCausalLM.forward, modeling.LlamaRMSNorm
    plain = trace(model, "autocast", seq, compiled=True)
    loss = trace(model, "autocast", seq, compiled=True, liger_loss=True)
    assert plain is not None and loss is not None and loss.liger
    assert loss.blocks == plain.blocks and loss.blocks_compiled == plain.blocks_compiled is not None
    assert loss.tail_steepest[1] - loss.tail_steepest[0] < seq * vocab * 4 <= plain.tail_steepest[1] - \
        plain.tail_steepest[0]
    assert (modeling.LlamaForCausalLM.forward, modeling.LlamaRMSNorm) == (forward, norm)


def test_liger_loss_alone_patches_the_forward_and_nothing_in_the_blocks():
    """The patch a compiled run takes (``apply_liger(loss_only=True)``): the causal LM's forward
    becomes Liger's fused loss; norms, MLPs and rotary stay transformers' own, which compile."""
    torch = _liger()
    import transformers.models.llama.modeling_llama as modeling

    from meshrun.kernels.liger import apply_liger

    norm, mlp, rotary = modeling.LlamaRMSNorm, modeling.LlamaMLP, modeling.apply_rotary_pos_emb
    with torch.device("meta"):
        real = _llama()
    with _put_back(modeling):
        assert apply_liger(real, loss_only=True) == ["Liger's fused linear cross-entropy for llama"]
        assert real.forward.__func__.__module__.startswith("liger_kernel")
        assert (modeling.LlamaRMSNorm, modeling.LlamaMLP, modeling.apply_rotary_pos_emb) == (norm, mlp, rotary)
        assert type(real.model.norm) is norm and type(real.model.layers[0].mlp) is mlp


def test_a_liger_function_without_a_stand_in_traces_the_model_unpatched(monkeypatch):
    """A kernel the trace cannot stand in for (here: RMSNorm's stand-in taken away) makes the
    Liger trace fail: the model is traced as it is, which keeps more, and the architecture's
    module is put back all the same."""
    _liger()
    import transformers.models.llama.modeling_llama as modeling

    from meshrun.plan import trace_liger
    from meshrun.plan.trace import trace

    model = _llama()
    forward = modeling.LlamaForCausalLM.forward
    monkeypatch.delitem(trace_liger.STAND_INS, "LigerRMSNormFunction")
    assert trace(model, "autocast", 32, compiled=False, liger=True) == trace(model, "autocast", 32, compiled=False)
    assert modeling.LlamaForCausalLM.forward is forward


def test_a_mixture_of_experts_keeps_its_own_experts_in_training_and_in_the_trace():
    """meshrun patches a Mixture-of-Experts model with Liger's norm, rotary and fused loss but
    not its fused MoE kernel (it failed to compile for Qwen3-MoE's experts on the GPU): the
    trainer's patch and the planner's twin take the same options and the experts stay the
    model's own; the trace with Liger runs on its norm and loss; a dense model keeps
    Liger's SwiGLU."""
    torch = _liger()
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    from meshrun.kernels.liger import apply_liger, liger_options
    from meshrun.plan.trace import trace
    from meshrun.plan.trace_liger import liger_twin

    cfg = MixtralConfig(vocab_size=256, hidden_size=64, intermediate_size=512, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                        max_position_embeddings=256)
    with torch.device("meta"):
        moe = MixtralForCausalLM(cfg)
        dense = LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                                             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))
    assert liger_options(moe) == {"swiglu": False} and liger_options(dense) == {}
    experts = type(moe.model.layers[0].mlp.experts)
    with liger_twin(moe) as twin:
        assert type(twin.model.layers[0].mlp.experts) is experts
        assert twin.forward.__func__.__module__.startswith("liger_kernel")  # the fused loss's forward
    tr = trace(moe, "autocast", 32, compiled=False, liger=True)
    assert tr is not None and tr.liger
    plain = trace(moe, "autocast", 32, compiled=False)
    assert plain is not None and tr.blocks != plain.blocks and tr.tail != plain.tail  # Liger's norm and loss
    with torch.device("meta"):
        real = MixtralForCausalLM(cfg)
    import transformers.models.mixtral.modeling_mixtral as modeling

    with _put_back(modeling):
        assert "the model's own experts" in apply_liger(real)[0]
        assert type(real.model.layers[0].mlp.experts) is experts


def test_liger_cross_entropy_on_granites_scaled_logits_is_traced_and_put_back():
    """Granite scales its logits, so Liger patches torch's cross-entropy (for the whole process)
    instead of fusing the loss: the trace runs it stood in for, keeping the fp32 logits (which
    take their gradient in place) and no log-softmax beside them, and puts torch's function
    back, so a model traced after it is traced as before."""
    torch = _liger()
    import torch.nn.functional as F
    from transformers import GPT2Config, GPT2LMHeadModel, GraniteConfig, GraniteForCausalLM

    from meshrun.plan.trace import trace

    vocab, seq = 4096, 64
    with torch.device("meta"):
        granite = GraniteForCausalLM(GraniteConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                   logits_scaling=8.0, tie_word_embeddings=True))
        gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=vocab, n_embd=64, n_layer=2, n_head=4, n_positions=seq))
    cross_entropy = F.cross_entropy
    before = trace(gpt2, "autocast", seq, compiled=False)
    patched = trace(granite, "autocast", seq, compiled=False, liger=True)
    plain = trace(granite, "autocast", seq, compiled=False)
    assert F.cross_entropy is cross_entropy
    assert trace(gpt2, "autocast", seq, compiled=False) == before
    assert patched is not None and patched.liger and plain is not None
    # torch's loss holds fp32 logits and log-softmax's fp32 output at once; Liger's, the logits alone
    assert plain.tail[0] - patched.tail[0] >= 4 * seq * vocab
    # the run's first line names the loss Liger gives it
    from meshrun.kernels.liger import apply_liger

    with torch.device("meta"):
        real = GraniteForCausalLM(granite.config)
    import transformers.models.granite.modeling_granite as modeling

    with _put_back(modeling, F):
        assert apply_liger(real) == ["Liger kernels for granite (RMSNorm, SwiGLU, rotary, cross-entropy)"]


def test_validation_adds_the_segments_its_logits_cannot_find_in_the_cache():
    """Validation computes whole logits (bf16), their fp32 copy and log-softmax's fp32 output;
    each larger than every tensor training held is a new segment on top of training's reserved
    bytes. With the fused loss nothing logits-sized was held: all three are new; eager, the
    training loss held fp32 logits as large: none; a model with a chunked loss (eval_logits
    False): none."""
    _liger()
    from meshrun.defaults import val_micro
    from meshrun.modelinfo.read import from_module
    from meshrun.plan import ClusterSpec, TrainSpec
    from meshrun.plan.memory import estimate, validation_growth
    from meshrun.plan.strategies import named
    from meshrun.plan.trace import with_trace

    vocab, seq, micro = 4096, 64, 8
    model = _llama(vocab)
    single = named("single", 1, 1, False)
    train = TrainSpec(seq_len=seq, micro_batch=micro, global_batch=micro, compile=False)
    entries = val_micro(micro, seq, vocab, "logits") * seq * vocab
    fused = with_trace(from_module(model, "llama", "test"), model, seq, ("autocast",), compiled=False, liger=True)
    assert validation_growth(fused, train, single, micro) == 10 * entries
    eager = with_trace(from_module(model, "llama", "test"), model, seq, ("autocast",), compiled=False)
    assert validation_growth(eager, train, single, micro) == 0
    chunked = dataclasses.replace(fused, traced=tuple(dataclasses.replace(t, eval_logits=False) for t in fused.traced))
    assert validation_growth(chunked, train, single, micro) == 0
    cluster = ClusterSpec(1, 1, 80 * GiB)
    assert (estimate(fused, cluster, train, single, micro).breakdown["fragmentation"]
            - estimate(chunked, cluster, train, single, micro).breakdown["fragmentation"]) == 10 * entries


def test_the_tails_tensors_are_paired_across_sizes_even_when_one_size_makes_one_more():
    """The tail's storages in making order at micro-batch 1 and 2 are aligned (an op may make one
    more at one size): the largest at 1 and the fastest-growing are each one tensor's sizes."""
    require("torch")
    from meshrun.plan.trace import _largest_lines

    one = [32, 8, 1000, 256, 4, 4, 256]
    two = [64, 16, 1000, 7, 512, 4, 4, 512]
    assert _largest_lines(one, two) == ((1000, 1000), (256, 512))
    assert _largest_lines([], [5]) == ((0, 0), (0, 0))


@pytest.mark.parametrize("flags,liger,fused", [((), False, True), (("--kernels", "plain"), False, False),
                                               (("--compile", "off"), True, True)])
def test_plan_chooses_liger_as_train_would(tmp_path, flags, liger, fused):
    """`meshrun plan` on a Hugging Face config Liger knows, with Liger installed, plans compiled
    blocks with Liger's fused loss alone and says so, as `meshrun train` would run it;
    --compile off every Liger kernel eager; --kernels plain none of Liger's kernels."""
    _liger()
    cfg = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
           "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
           "vocab_size": 4096, "max_position_embeddings": 512, "rms_norm_eps": 1e-5, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = subprocess.run([sys.executable, "-m", "meshrun", "plan", "--model", str(tmp_path), "--gpus-per-node", "1",
                          "--gpu-mem", "80GiB", "--seq-len", "128", *flags], capture_output=True, text=True,
                         timeout=300, env=clean_env())
    assert out.returncode == 0, out.stderr[-2000:]
    assert ("Liger Kernel's fused kernels (installed here), eager" in out.stdout) is liger, out.stdout[-1500:]
    assert ("with Liger Kernel's fused linear cross-entropy for the loss" in out.stdout) is (fused and not liger)
    assert ("logits: Liger's fused loss" in out.stdout) is fused  # the table's legend says what the column holds


def test_a_liger_patched_model_is_called_with_return_dict_so_transformers_logs_no_deprecation():
    # Liger's forward leaves return_dict None to read config.use_return_dict, which
    # transformers 5 logs as deprecated on every rank; meshrun passes it
    _liger()
    import transformers.models.llama.modeling_llama as modeling

    from meshrun.kernels.liger import apply_liger
    from meshrun.modelinfo.loss import LABELS_KWARGS, loss_mode

    model = _llama()
    assert loss_mode(model) == "labels-nocache"  # transformers' own forward: no return_dict to give
    with _put_back(modeling):
        apply_liger(model)
    mode = loss_mode(model)
    assert mode == "labels-nocache-dict" and LABELS_KWARGS[mode] == {"use_cache": False, "return_dict": True}


def test_model_loss_passes_what_the_forward_names():
    torch = _liger()
    from meshrun.modelinfo.loss import loss_mode, model_loss

    class Forward(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.ones(()))
            self.calls = []

        def forward(self, input_ids, labels=None, use_cache=None, return_dict=None):
            self.calls.append({"use_cache": use_cache, "return_dict": return_dict})
            return {"loss": self.w * input_ids.float().mean()}

    model = Forward()
    loss = model_loss(model, loss_mode(model), torch.ones(2, 4, dtype=torch.long), torch.ones(2, 4, dtype=torch.long))
    assert loss.item() == 1.0 and model.calls == [{"use_cache": False, "return_dict": True}]


def test_transformers_renamed_cache_line_about_ligers_code_is_dropped_and_no_other():
    _liger()
    import logging

    import transformers.models.llama.modeling_llama as modeling

    from meshrun.kernels.liger import apply_liger

    with _put_back(modeling):
        apply_liger(_llama())
        assert modeling.LlamaRMSNorm.__module__.startswith("liger_kernel")
    assert modeling.LlamaRMSNorm.__module__ == modeling.__name__  # transformers' own again

    class Kept(logging.Handler):
        def __init__(self) -> None:
            super().__init__(logging.WARNING)
            self.lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    generic, kept = logging.getLogger("transformers.utils.generic"), Kept()
    generic.addHandler(kept)  # the logger's own filters run before its handlers
    try:
        generic.warning("`past_key_values`/`cache_params` are deprecated. Use `cache` instead.")
        generic.warning("another line")
    finally:
        generic.removeHandler(kept)
    assert kept.lines == ["another line"]
