"""meshrun plan for LoRA runs: the adapters counted as PEFT makes them, the frozen weights'
bytes (bf16, torchao's NF4) without gradients or optimizer state, the step's work without the
frozen weights' gradients, and the run policy planning the same numbers."""

from __future__ import annotations

import json

import pytest
from helpers import meshrun_here, require

from meshrun.modelinfo.spec import PRESETS, llama_spec
from meshrun.plan import ClusterSpec, TrainSpec, make_plan
from meshrun.plan.adapters import Adapters, layout, nf4_bytes
from meshrun.plan.batch import Batch
from meshrun.plan.memory import Strategy, model_states
from meshrun.plan.steptime import compute_time
from meshrun.plan.strategies import comm_bytes
from meshrun.vocab import STRATEGIES

GiB = 2**30
# a small Llama shape: hidden 256, 4 blocks, 8 heads of which 2 key/value heads, MLP 768
TINY = llama_spec("tiny", 256, 4, 8, 2, 768, 1000)


def _adapter_params(rank: int, kinds: tuple[str, ...]) -> int:
    """By hand: r·(in + out) for each adapted layer of TINY's 4 blocks (k/v project 256 -> 64)."""
    shapes = {"q": (256, 256), "k": (256, 64), "v": (256, 64), "o": (256, 256), "gate": (256, 768),
              "up": (256, 768), "down": (768, 256)}
    return 4 * sum(rank * (i + o) for i, o in (shapes[k] for k in kinds))


@pytest.mark.parametrize("strategy,dp,shard", [("ddp", 2, 1), ("fsdp-full", 4, 4), ("fsdp-grad-op", 4, 4),
                                               ("zero2", 4, 4), ("zero3", 4, 4)])
def test_states_are_the_frozen_weights_and_the_adapters_states(strategy, dp, shard):
    """The frozen weights in bf16 (2 bytes each, sharded by FSDP and ZeRO-3 only), no
    gradients or optimizer state for them; the adapters' fp32 weights, gradients and AdamW
    moments (torch: 4 + 4 + 8, sharded like a full model's), or DeepSpeed's bf16 weights and
    gradients with a 12-byte master copy and moments; autocast's bf16 copy of the adapters
    under DDP. Against a count by hand."""
    a = _adapter_params(8, ("q", "k", "v", "o", "gate", "up", "down"))
    n = TINY.params
    t = TrainSpec(512, 1, None, adapters=Adapters(8))
    states = model_states(TINY, t, Strategy(STRATEGIES[strategy], dp, shard))[0]
    frozen_sharded = strategy in ("fsdp-full", "fsdp-grad-op", "zero3")
    frozen = 2 * n / (shard if frozen_sharded else 1)
    if strategy == "ddp":
        expected = {"params": frozen + 4 * a + 2 * a, "grads": 4 * a, "optimizer": 8 * a}
    elif strategy.startswith("fsdp"):
        expected = {"params": frozen + 4 * a / shard, "grads": 4 * a / shard, "optimizer": 8 * a / shard}
    else:
        expected = {"params": frozen + 2 * a / (shard if strategy == "zero3" else 1), "grads": 2 * a / shard,
                    "optimizer": 12 * a / shard}
    assert {k: states[k] for k in expected} == {k: int(v) for k, v in expected.items()}


def test_targets_name_the_layers_adapted():
    """Kinds map to the Hugging Face names (q -> q_proj); all-linear is every block linear."""
    assert layout(TINY, Adapters(16)).params == _adapter_params(16, ("q", "k", "v", "o", "gate", "up", "down"))
    qv = layout(TINY, Adapters(16, ("q", "v")))
    assert qv.params == _adapter_params(16, ("q", "v"))
    assert qv.kinds == ["q_proj", "v_proj"]


def _tiny_llama_dir(tmp_path):
    require("transformers")
    import transformers

    config = transformers.LlamaConfig(hidden_size=128, intermediate_size=352, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
                                      max_position_embeddings=256)
    config.save_pretrained(tmp_path)
    return str(tmp_path / "config.json"), config


@pytest.mark.parametrize("targets", [("all-linear",), ("q", "v"), ("gate", "up", "down")])
def test_the_planner_counts_the_adapters_peft_makes(tmp_path, targets):
    """A Hugging Face config the planner reads (the model built on the meta device): its
    adapter count is what training/lora.py's PEFT injection makes trainable, and with the
    adapters in the model the planner reads the same base shape."""
    require("peft")
    from meshrun.modelinfo.hf import build_on_meta
    from meshrun.modelinfo.read import from_hf_config, from_module
    from meshrun.training.lora import LoraSpec, add_adapters, counts

    path, config = _tiny_llama_dir(tmp_path)
    spec = from_hf_config(path)
    planned = layout(spec, Adapters(8, targets))
    model = add_adapters(build_on_meta(config), LoraSpec(8, 16.0, 0.0, targets))
    trainable, total = counts(model)
    assert planned.params == trainable
    assert spec.params == total - trainable
    seen = from_module(model, "tiny", "the model")
    assert (seen.params, seen.linears, seen.linear_names) == (spec.params, spec.linears, spec.linear_names)


def test_nf4_bytes_are_torchaos():
    """nf4_bytes is what torchao's NF4Tensor holds: 4-bit indices, an int8 scaler per 64
    weights, a bf16 factor per 256 scalers, the scalers' mean and the 16 levels."""
    require("torchao")
    import torch
    from torchao.quantization import to_nf4

    for shape in ((128, 256), (512, 1024)):
        w = to_nf4(torch.randn(shape, dtype=torch.bfloat16))
        held = sum(t.untyped_storage().nbytes() for t in (w.quantized_data, w.quantized_scalers,
                                                          w.quantization_factor, w.scaler_mean, w.nf4))
        assert nf4_bytes(shape[0] * shape[1], 2) == held


def test_nf4_stores_the_adapted_weights_in_4_bits():
    """--quantize nf4: the adapted layers' weights at nf4_bytes, the rest (embeddings, head,
    norms) still bf16."""
    lo = layout(TINY, Adapters(8, quantize="nf4"))
    block = [(256, 256), (64, 256), (64, 256), (256, 256), (768, 256), (768, 256), (256, 768)]
    adapted = 4 * sum(o * i for o, i in block)
    expected = 2 * (TINY.params - adapted) + 4 * sum(nf4_bytes(o * i) for o, i in block)
    assert lo.frozen_bytes(TINY.params, False, 2) == pytest.approx(expected)
    t = TrainSpec(512, 1, None, adapters=Adapters(8, quantize="nf4"))
    states = model_states(TINY, t, Strategy(STRATEGIES["fsdp-full"], 4, 4))[0]
    assert states["params"] == int((expected + 4 * lo.params) / 4)


def _plan(*args: str) -> dict:
    out = meshrun_here("plan", "--model", "llama3-8b", "--gpus-per-node", "1", "--gpu-mem", "140GiB", "--json", *args)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_an_8b_lora_run_fits_one_gpu_where_full_fine_tuning_does_not():
    """Llama-3-8B on one 140 GiB GPU: a full fine-tune's single-GPU rows do not fit (16 bytes
    a parameter is 120 GiB before activations), a LoRA run's do, and the run policy (what
    meshrun train would do) plans the same: single."""
    full, lora = _plan(), _plan("--lora", "16")
    singles = [x for x in full["candidates"] if x["strategy"] in ("single", "single+ac")]
    assert singles and not any(x["fits"] for x in singles)
    assert lora["recommended"]["strategy"] in ("single", "single+ac") and lora["recommended"]["fits"]
    assert lora["run"]["strategy"] == "single"
    assert "refused" in full["run"] or full["run"]["strategy"] != "single"
    info = lora["train"]["lora"]
    assert info["adapter_params"] == 32 * 16 * (2 * (4096 + 4096) + 2 * (4096 + 1024) + 3 * (4096 + 14336))
    assert info["frozen_params"] == PRESETS["llama3-8b"].params


def test_the_plan_says_what_trains():
    out = meshrun_here("plan", "--model", "llama3-8b", "--gpus-per-node", "1", "--gpu-mem", "140GiB", "--lora", "16",
                       "--lora-targets", "q,v", "--quantize", "nf4")
    assert out.returncode == 0, out.stderr
    text = " ".join(out.stdout.split())
    assert "LoRA rank 16 on q_proj, v_proj (64 layers): 6.82M of 8.04B parameters (0.08%) train" in text
    assert "llama3-8b (8.03B frozen nf4 + 6.82M LoRA params)" in text
    assert "grads, optim(izer state): the adapters' alone" in text


def test_a_lora_step_does_two_thirds_of_the_frozen_weights_work():
    """The same batch and layout: a LoRA step's compute is the full step's with the weights'
    matmul work at 2/3 (forward and input gradients; no weight gradients) plus the adapters'
    6 FLOPs per parameter, attention (6·L·h·s a token) unchanged."""
    m = PRESETS["llama3-8b"]
    c = ClusterSpec(1, 1, 140 * GiB)
    s = Strategy(STRATEGIES["single"], 1, 1)
    b = Batch(1, 1, 1)
    full = compute_time(m, c, TrainSpec(4096, 1, None), s, b)
    lora = compute_time(m, c, TrainSpec(4096, 1, None, adapters=Adapters(16)), s, b)
    attention = 6 * m.layers * m.hidden * 4096
    matmuls = m.work_flops_per_token(4096) - attention
    a = layout(m, Adapters(16)).params
    # (at micro-batch 1 the matmuls' efficiency scales matmuls and adapters alike, not attention)
    from meshrun.plan.steptime import matmul_efficiency, measured_matmul_efficiency

    slower = measured_matmul_efficiency() / matmul_efficiency(4096, m.hidden)
    expected = ((2 / 3 * matmuls + 6 * a) * slower + attention) / (matmuls * slower + attention)
    assert lora / full == pytest.approx(expected, rel=1e-9)
    assert 0.66 < lora / full < 0.75
    # with checkpointing each block's forward runs again: the matmuls' 2 FLOPs a weight, the
    # adapters' 2 a parameter, a third of attention
    ac = Strategy(STRATEGIES["single"], 1, 1, ac=True)
    checkpointed = compute_time(m, c, TrainSpec(4096, 1, None, adapters=Adapters(16)), ac, b)
    forward = (matmuls / 3 + 2 * a) * slower + attention / 3
    work = (2 / 3 * matmuls + 6 * a) * slower + attention
    assert checkpointed / lora == pytest.approx((work + forward) / work, rel=1e-9)


def test_only_the_adapters_gradients_are_reduced():
    """DDP all-reduces the adapters' fp32 gradients alone; FSDP2 still all-gathers every weight
    (the frozen ones in bf16) and reduce-scatters the adapters' gradients."""
    m = PRESETS["llama3-8b"]
    a = layout(m, Adapters(16)).params
    t = TrainSpec(4096, 1, None, adapters=Adapters(16))
    ring = 7 / 8
    ddp, _ = comm_bytes(m, t, Strategy(STRATEGIES["ddp"], 8, 1), 1, 1)
    assert ddp == pytest.approx(2 * ring * 4 * a)
    fsdp, _ = comm_bytes(m, t, Strategy(STRATEGIES["fsdp-full"], 8, 8), 1, 2)
    assert fsdp == pytest.approx(ring * (2 * (2 * m.params + 2 * a) * 2 + 4 * a))
    full, _ = comm_bytes(m, TrainSpec(4096, 1, None), Strategy(STRATEGIES["ddp"], 8, 1), 1, 1)
    assert ddp < full / 100


def test_a_lora_plan_has_only_data_parallel_rows():
    """No TP x PP, context or expert parallelism under LoRA, even where nothing else fits."""
    plan = make_plan(PRESETS["llama3-70b"], ClusterSpec(1, 8, 16 * GiB), TrainSpec(4096, 1, None,
                                                                                   adapters=Adapters(16)))
    assert plan.candidates and all(x.strategy.data_parallel_only for x in plan.candidates)


def test_a_model_holding_adapters_is_traced_as_its_base_model(tmp_path):
    """auto.decide may get the model with PEFT's adapters already in it: the planner traces it
    as the base model (adapters off, every weight trainable), the same bytes as before the
    adapters went in, and leaves the model as it was."""
    require("peft")
    from meshrun.modelinfo.hf import build_on_meta
    from meshrun.modelinfo.read import from_module
    from meshrun.plan.trace import with_trace
    from meshrun.training.lora import LoraSpec, add_adapters, is_adapter

    _, config = _tiny_llama_dir(tmp_path)
    base = build_on_meta(config)
    spec = from_module(base, "tiny", "the model")
    before = with_trace(spec, base, 64, ("autocast",), compiled=False).traced
    model = add_adapters(build_on_meta(config), LoraSpec(8, 16.0, 0.0, ("all-linear",)))
    after = with_trace(spec, model, 64, ("autocast",), compiled=False).traced
    assert before and after == before
    assert all(p.requires_grad == is_adapter(n) for n, p in model.named_parameters())
    assert not any(getattr(m, "disable_adapters", None) is True for m in model.modules())


def test_the_written_train_config_is_the_lora_run_planned():
    from meshrun.plan.configs import train_config

    t = TrainSpec(4096, None, 128, adapters=Adapters(16, ("q", "v"), "nf4", 0.05))
    plan = make_plan(PRESETS["llama3-8b"], ClusterSpec(1, 1, 140 * GiB), t)
    assert plan.recommended is not None
    written = train_config(plan, plan.recommended, plan.model)
    assert {k: written[k] for k in ("lora", "lora_targets", "quantize", "lora_dropout")} == \
        {"lora": 16, "lora_targets": "q,v", "quantize": "nf4", "lora_dropout": 0.05}
    assert "lora" not in train_config(make_plan(PRESETS["llama3-8b"], ClusterSpec(1, 8, 80 * GiB),
                                                TrainSpec(4096, None, 128)), plan.recommended, plan.model)


@pytest.mark.parametrize("compiled,ac", [(True, False), (False, False), (False, True)])
def test_nf4_adds_the_dequantization_of_every_adapted_weight(compiled, ac):
    """--quantize nf4: a micro-step dequantizes every adapted weight in forward and in backward
    (and once more under checkpointing): 2.5 bytes a weight compiled, 29 eager, at the card's
    memory bandwidth (an H200: 4.8 TB/s); the rest of the step as bf16 LoRA's."""
    from meshrun.plan.cards import CARDS

    m = PRESETS["llama3-8b"]
    c = ClusterSpec(1, 1, 140 * GiB, card=CARDS["h200"])
    s = Strategy(STRATEGIES["single"], 1, 1, ac=ac)
    b = Batch(2, 4, 1)
    plain = compute_time(m, c, TrainSpec(4096, 2, 8, compile=compiled, adapters=Adapters(16)), s, b)
    nf4 = compute_time(m, c, TrainSpec(4096, 2, 8, compile=compiled, adapters=Adapters(16, quantize="nf4")), s, b)
    adapted = 32 * (2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 14336)
    per_weight = 2.5 if compiled else 29
    assert nf4 - plain == pytest.approx(4 * (3 if ac else 2) * adapted * per_weight / 4.8e12, rel=1e-9)


def test_train_plans_an_8b_lora_run_on_one_gpu_where_a_full_fine_tune_offloads(tmp_path):
    """`meshrun train --dry-run` decides as the ranks do (the run policy with the config's
    --lora): Llama-3-8B's shape on one 140 GiB GPU is planned with AdamW's moments in host
    memory for a full fine-tune (a GPU of 40 GiB refuses it in one line) and as one process
    for a LoRA run."""
    require("transformers")
    import transformers as T

    T.LlamaConfig(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                  num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192,
                  rope_theta=500000.0).save_pretrained(str(tmp_path))
    args = ("train", "--model", str(tmp_path), "--data", "random", "--dry-run", "--gpu-mem", "140GiB", "--nproc", "1",
            "--seq-len", "4096")
    full = meshrun_here(*args)
    assert full.returncode == 0 and "# strategy: fsdp-offload (planner)" in full.stdout, full.stderr
    small = meshrun_here(*[a if a != "140GiB" else "40GiB" for a in args])
    assert small.returncode == 2 and "does not fit 1 GPU(s) of 40 GiB" in small.stderr, small.stderr
    lora = meshrun_here(*args, "--lora", "16")
    assert lora.returncode == 0, lora.stderr
    assert "# strategy: single (planner)" in lora.stdout, lora.stdout
