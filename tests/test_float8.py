"""Float8 training's layer rule (--precision fp8, fp8-rowwise; training/parallel/float8.py): which
linear layers torchao's Float8Linear replaces, on models built on the meta device at their
published widths (the rule depends on them), and the refusals that need no GPU. The float8
matmuls themselves run on GPUs only (docs/benchmarks.md)."""

from __future__ import annotations

import os

import pytest
from helpers import meshrun_here, require


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
    from meshrun.training.parallel.float8 import convert

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

    from meshrun.training.models.gpt import GPT, GPTConfig
    from meshrun.training.parallel.float8 import convert

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
    from meshrun.training.parallel.float8 import convert

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    with pytest.raises(MeshrunError, match=r"--precision='fp8': none of the model's 2 linear layers is large "
                                           r"enough to gain from float8 \(hint: --precision bf16\)"):
        convert(model, "fp8", fsdp=False)


def _train_float8(overrides):
    """A GPT wide enough for torchao's rule (512) trained under --precision fp8 on the CPU,
    where torch's _scaled_mm runs float8 matmuls (torch 2.13): meshrun refuses that for users
    (no speed there), so the device check is lifted here; every other piece is the real one."""
    import torch

    from meshrun.config import TrainConfig
    from meshrun.training.loader import RandomTokens
    from meshrun.training.models.gpt import GPT, GPTConfig
    from meshrun.training.parallel import float8
    from meshrun.training.trainer import Trainer

    float8.check_device = lambda *args: None
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq_len=16, d_model=512, n_layers=2, n_heads=8))
    cfg = TrainConfig(seq_len=16, lr=1e-3, warmup=1, log_every=1, micro_batch=4, compile="off", **overrides)
    trainer = Trainer(model, RandomTokens(256, 16, 64), None, cfg)
    weights = [type(p.data._local_tensor if hasattr(p.data, "_local_tensor") else p.data).__name__
               for n, p in trainer.layout.model.named_parameters() if n.endswith("up.weight")]
    return {"losses": {r["step"]: r["loss"] for r in trainer.fit()}, "described": trainer.layout.description,
            "weights": weights}


def test_float8_under_fsdp_snapshots_and_resumes_bit_for_bit(tmp_path):
    """Two ranks, FSDP2 with the weights all-gathered in float8: a snapshot at step 2 holds
    the plain weights (torch.distributed.checkpoint cannot write torchao's wrappers), and the
    run resumed from it takes steps 3-4 exactly as the uninterrupted run; the losses stay
    within 2% of fp32's (bf16 is not run on the CPU)."""
    require("torch")
    require("torchao")
    import meshrun

    out = str(tmp_path / "fp8")
    common = {"strategy": "fsdp", "precision": "fp8", "steps": 4}
    whole = meshrun.run(_train_float8, {**common, "out": out, "save_every": 2}, nproc=2, timeout_s=300)
    assert "float8 tensorwise in 4 of 9 linear layers (all-gathered in float8)" in whole["described"]
    assert whole["weights"] == ["WeightWithDynamicFloat8CastTensor"] * 2
    resumed = meshrun.run(_train_float8, {**common, "out": out, "resume": os.path.join(out, "checkpoints",
                                                                                        "step-00000002")},
                          nproc=2, timeout_s=300)
    assert sorted(resumed["losses"]) == [3, 4]
    assert all(resumed["losses"][s] == whole["losses"][s] for s in (3, 4))
    fp32 = meshrun.run(_train_float8, {"strategy": "fsdp", "precision": "fp32", "steps": 4}, nproc=2, timeout_s=300)
    for step in range(1, 5):
        assert whole["losses"][step] == pytest.approx(fp32["losses"][step], rel=0.02)
    assert whole["losses"] != fp32["losses"]


def test_snapshots_get_the_tensors_inside_the_float8_wrappers():
    """FSDP2's float8 all-gather keeps weights, and optimizer state made like them (empty_like,
    clone), as torchao's wrapper tensors, which torch.distributed.checkpoint cannot write on a GPU: a snapshot's
    state holds the tensors inside them instead, the same storage (a load fills the model)."""
    require("torch")
    require("torchao")
    import torch
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    from meshrun.training.snapshot.parts import float8_unwrapped

    model = torch.nn.Sequential(torch.nn.Linear(64, 64))
    convert_to_float8_training(model, config=Float8LinearConfig(enable_fsdp_float8_all_gather=True))
    weight = model[0].weight
    state = {"exp_avg": torch.empty_like(weight), "step": torch.tensor(3.0)}  # (torchao keeps empty_like's wrapped)
    assert type(weight).__name__ == type(state["exp_avg"]).__name__ == "WeightWithDynamicFloat8CastTensor"
    sd = float8_unwrapped({"model": {"0.weight": weight, "0.bias": model[0].bias},
                           "optim": {"state": {"0.weight": state}, "param_groups": []}})
    plain = [sd["model"]["0.weight"], sd["model"]["0.bias"], *sd["optim"]["state"]["0.weight"].values()]
    assert all(type(t) in (torch.Tensor, torch.nn.Parameter) for t in plain), [type(t) for t in plain]
    assert sd["model"]["0.weight"].data_ptr() == weight._tensor.data_ptr()
    assert sd["optim"]["param_groups"] == []


@pytest.mark.parametrize("precision", ["fp8", "fp8-rowwise"])
@pytest.mark.parametrize("shape", ["llama3-8b", "qwen2.5-1.5b", "gpt2"])
def test_the_planner_converts_the_layers_the_trainer_converts(precision, shape, tmp_path):
    """The planner's copy of the layer rule (plan/float8.py, torch-free) picks, on each
    published shape, as many block matrices as torchao's Float8Linear replaces in the built
    model: the two cannot drift apart."""
    require("torch")
    require("transformers")
    require("torchao")
    import subprocess
    import sys

    import torch
    import transformers

    from meshrun.modelinfo.read import resolve_with_module
    from meshrun.plan.float8 import converted
    from meshrun.training.parallel.float8 import convert

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, os.path.join(root, "bench", "hf_config.py"), shape, str(tmp_path), "--layers", "2"],
                   check=True, capture_output=True)
    spec, _ = resolve_with_module(str(tmp_path), "--model")
    config = transformers.AutoConfig.from_pretrained(str(tmp_path))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    try:
        convert(model, precision, fsdp=False)
    except Exception as exc:  # none large enough: the trainer refuses, the planner converts none
        assert "none of the model's" in str(exc)
        made = 0
    else:
        made = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
    assert len(converted(spec, precision)) * spec.layers == made


def test_the_planner_counts_float8_and_plans_only_what_trains_it(tmp_path):
    """`meshrun plan --precision fp8`: the layouts meshrun train runs float8 on (no DeepSpeed,
    no tensor parallelism), FSDP2's weights gathered in float8 (less than bf16's), the casts of
    one layer in the transient, and the written config asks for fp8."""
    require("torch")
    require("transformers")
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, os.path.join(root, "bench", "hf_config.py"), "llama3-8b", str(tmp_path / "m"),
                    "--layers", "4"], check=True, capture_output=True)

    def plan(precision: str, *extra: str) -> dict:
        out = meshrun_here("plan", "--model", str(tmp_path / "m"), "--gpus-per-node", "2", "--gpu-mem", "80GiB",
                           "--seq-len", "4096", "--micro-batch", "1", "--global-batch", "2", "--precision", precision,
                           "--json", *extra)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    bf16, fp8 = plan("bf16", "--compile", "on"), plan("fp8", "--write", str(tmp_path / "cfg"))
    assert "deepspeed" in {c["engine"] for c in bf16["candidates"]}
    assert {c["engine"] for c in fp8["candidates"]} == {"torch"}
    assert all(c["tp"] == 1 for c in fp8["candidates"])
    rows = {c["strategy"]: c["breakdown"] for c in bf16["candidates"] if c.get("breakdown")}
    rows8 = {c["strategy"]: c["breakdown"] for c in fp8["candidates"] if c.get("breakdown")}
    full = next(name for name in rows8 if name.startswith("fsdp-full"))
    assert rows8[full]["comm_buffers"] < rows[full]["comm_buffers"]  # the blocks gathered in float8
    assert fp8["train"]["precision"] == "fp8"
    assert [os.path.basename(f) for f in fp8["written"]] == ["train.yaml"]  # no DeepSpeed or Accelerate route
    assert "precision: fp8" in open(fp8["written"][0]).read()


def test_torchaos_enum_notices_are_kept_off_a_runs_output():
    """torchao's import logs two deprecation lines through torch's pytree logger (torch
    2.13-2.15); transformers imports torchao wherever it is installed. meshrun's filter drops
    exactly those lines."""
    require("torch")
    require("torchao")
    import subprocess
    import sys

    probe = "import torch, torchao.float8; import logging; logging.getLogger('torch.utils._pytree').warning('kept')"
    plain = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    quieted = "from meshrun.quiet import quiet_library_notices as q; q(); " + probe
    quiet = subprocess.run([sys.executable, "-c", quieted], capture_output=True, text=True, timeout=120)
    assert quiet.returncode == 0, quiet.stderr
    assert "Enum subclass" not in quiet.stderr
    assert "kept" in quiet.stderr  # the logger's other messages still show
    if "Enum subclass" not in plain.stderr:
        pytest.skip("this torch and torchao log no such notice")


@pytest.mark.timeout(700)  # Inductor compiles on 2 cores shared with the rest of the suite
def test_a_hugging_face_model_compiles_block_by_block(tmp_path):
    """A Hugging Face model is compiled one decoder layer at a time on one process too: its
    forward, which builds the attention mask, stays eager, so SDPA gets is_causal (under a
    whole-model compile transformers before torch 2.14 builds a dense mask: no flash)."""
    require("torch")
    require("transformers")
    import subprocess
    import sys

    from meshrun.training.parallel.apply import Build

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    subprocess.run([sys.executable, os.path.join(root, "bench", "hf_config.py"), "llama3.2-1b", str(tmp_path / "m"),
                    "--layers", "2"], check=True, capture_output=True)
    assert Build._blocks_only.__doc__
    config = tmp_path / "m" / "config.json"
    import json

    c = json.loads(config.read_text())
    c.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, vocab_size=256,
             head_dim=16)
    config.write_text(json.dumps(c))
    out = subprocess.run([sys.executable, "-m", "meshrun", "train", "--model", str(tmp_path / "m"), "--data", "random",
                          "--steps", "2", "--nproc", "1", "--seq-len", "32", "--compile", "on"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    first = next(line for line in out.stdout.splitlines() if line.startswith("meshrun train: strategy"))
    assert "compiled per block" in first, first
    assert "Enum subclass" not in out.stdout + out.stderr
