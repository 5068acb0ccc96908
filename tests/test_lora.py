"""LoRA fine-tuning in `meshrun train` (--lora): a tiny Llama saved with save_pretrained here
(nothing downloaded), its weights frozen and read from the directory, adapters trained on one
process, DDP and FSDP2 to the same values; snapshots that hold the adapters alone and resume
bit for bit, and refuse another base model; bad options refused before launch in one line."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
from helpers import clean_env, meshrun_here, require

import meshrun

pytestmark = pytest.mark.framework
VOCAB = 2048  # frozen embeddings and head that outweigh the adapters, as in a real model
STEPS = 4


def _save_llama(directory: str, seed: int) -> None:
    import torch
    import transformers as T

    torch.manual_seed(seed)
    config = T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
    T.LlamaForCausalLM(config).save_pretrained(directory, safe_serialization=True)


def _fine_tune(model_dir: str, out: str | None, overrides: dict) -> dict:
    """A rank of a LoRA run of the model in ``model_dir`` (its weights read from there): the
    losses, the adapters whole (gathered from FSDP2's shards), and the frozen weights that
    differ from the directory's files after training."""
    import glob

    import torch
    from safetensors.torch import load_file

    from meshrun.config import TrainConfig
    from meshrun.modelinfo.hf import build_on_meta, load_config, locate
    from meshrun.training.loader import RandomTokens
    from meshrun.training.lora import is_adapter
    from meshrun.training.trainer import Trainer
    from meshrun.training.weights import Pretrained, clean_name

    model = build_on_meta(load_config(locate(model_dir, "--model"), "--model"))
    files = tuple(sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))))
    options = dict(model=model_dir, lora=4, steps=STEPS, seq_len=16, lr=1e-2, warmup=1, log_every=1,
                   precision="fp32", deterministic=True, out=out, save_every=2, micro_batch=8)
    samples = overrides.pop("samples", 256)
    cfg = TrainConfig(**{**options, **overrides})
    trainer = Trainer(model, RandomTokens(samples, 16, VOCAB), None, cfg, weights=Pretrained(model_dir, files))
    records = trainer.fit()
    on_disk = {}
    for path in files:
        on_disk.update(load_file(path))
    adapters, changed = {}, []
    for name, p in trainer.model.named_parameters():
        whole = p.full_tensor() if hasattr(p, "full_tensor") else p.detach()
        if is_adapter(name):
            adapters[clean_name(name)] = whole.clone()
        elif hasattr(p, "ds_numel"):  # partitioned by DeepSpeed ZeRO-3: no whole tensor on this rank
            continue
        elif type(whole) is torch.Tensor and not torch.equal(whole, on_disk[clean_name(name)]):  # (not NF4's)
            changed.append(clean_name(name))
    trainable = sorted(clean_name(n) for n, p in trainer.model.named_parameters() if p.requires_grad)
    return {"losses": [r["loss"] for r in records], "adapters": adapters, "changed": changed,
            "trainable": trainable, "first_lines": trainer.describe() if trainer.rt.is_main else ""}


def fine_tune(model_dir, out=None, nproc=1, **overrides) -> dict:
    return meshrun.run(_fine_tune, str(model_dir), None if out is None else str(out), overrides, nproc=nproc,
                       timeout_s=300)


def _digests(directory) -> dict[str, str]:
    return {name: hashlib.sha256((directory / name).read_bytes()).hexdigest() for name in os.listdir(directory)}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    """Two tiny Llamas of the same config and other weights."""
    require("transformers")
    require("peft")
    root = tmp_path_factory.mktemp("bases")
    for seed, name in ((0, "a"), (1, "b")):
        _save_llama(str(root / name), seed)
    return root / "a", root / "b"


@pytest.fixture(scope="module")
def one(bases, tmp_path_factory):
    """One process, 4 steps, snapshots at steps 2 and 4; the model directory's files hashed
    before and after."""
    out = tmp_path_factory.mktemp("one")
    before = _digests(bases[0])
    result = fine_tune(bases[0], out)
    return result, out, before


def test_only_the_adapters_train_and_the_base_stays_bit_identical(bases, one):
    result, _, before = one
    assert result["changed"] == []  # every frozen weight in memory equals the file's, bit for bit
    assert _digests(bases[0]) == before  # and the files on disk are untouched
    assert result["trainable"] == sorted(result["adapters"]) and len(result["adapters"]) == 2 * 7 * 2
    lora_b = [t for n, t in result["adapters"].items() if ".lora_B." in n]
    assert all(t.abs().max() > 0 for t in lora_b)  # initialised to zero, trained away from it
    first = result["first_lines"].splitlines()[0]
    assert "LoRA rank 4 (alpha 8) on down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj (14 layers)" \
        in first and "parameters (" in first and "train, the rest frozen" in first
    assert "LoRA rank 4 on 14 layers -> " in result["first_lines"]  # the layout's first step


def test_a_lora_snapshot_holds_the_adapters_and_names_its_base(bases, one):
    from torch.distributed.checkpoint import FileSystemReader

    result, out, _ = one
    snap = out / "checkpoints" / "step-00000004"
    keys = FileSystemReader(str(snap)).read_metadata().state_dict_metadata
    weights = {k.removeprefix("model.") for k in keys if k.startswith("model.")}
    assert weights == set(result["adapters"])  # no frozen weight
    assert all(any(f".{n}." in k for n in weights) for k in keys if k.startswith("optim.state."))
    held = sum(f.stat().st_size for f in snap.iterdir() if f.suffix == ".distcp")
    base = sum(f.stat().st_size for f in bases[0].glob("*.safetensors"))
    assert held < base / 3, (held, base)  # adapters and their two moments: a few percent of the model
    state = json.loads((snap / "state.json").read_text())
    lora = state["lora"]
    assert (lora["rank"], lora["alpha"], lora["dropout"]) == (4, 8.0, 0.0)
    assert lora["target_modules"][0] == "model.layers.0.self_attn.q_proj" and len(lora["target_modules"]) == 14
    assert lora["base"]["directory"] == str(bases[0]) and lora["base"]["fingerprint"].startswith("sha256:")


def test_resume_from_a_lora_snapshot_is_bit_exact(bases, one, tmp_path):
    result, out, _ = one
    resumed = fine_tune(bases[0], tmp_path, resume=str(out / "checkpoints" / "step-00000002"))
    assert resumed["losses"] == result["losses"][2:]
    assert resumed["adapters"].keys() == result["adapters"].keys()
    for name, t in result["adapters"].items():
        assert resumed["adapters"][name].equal(t), name


def test_resume_onto_another_base_is_refused_in_one_line(bases, one, tmp_path):
    _, out, _ = one
    with pytest.raises(meshrun.api.RankError) as info:
        fine_tune(bases[1], tmp_path, resume=str(out / "checkpoints" / "step-00000002"))
    line = next(ln for ln in str(info.value).splitlines() if ln.startswith("meshrun.errors.MeshrunError: "))
    assert f"its adapters were trained on {bases[0]} (fingerprint " in line, line
    assert f"not on this run's base {bases[1]} (fingerprint " in line and "(hint: resume with the model" in line


def test_a_trained_run_exports_an_adapter_peft_loads_and_a_merged_model_to_meshrun_s_logits(bases, one, tmp_path):
    """The run's last snapshot, exported: PeftModel.from_pretrained(base, adapter) and the merged
    model both give the logits of the base with the run's trained adapters (fp32; PEFT runs the
    same operations: to 1e-6; merging rounds W + s * B @ A once: to 1e-5 on torch 2.13 CPU)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from meshrun.training import lora

    result, out, _ = one
    snap = str(out / "checkpoints" / "step-00000004")
    for args in (["--to", str(tmp_path / "adapter")], ["--to", str(tmp_path / "merged"), "--merge"]):
        res = meshrun_here("export", snap, *args)
        assert res.returncode == 0, res.stderr
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))
    ours = AutoModelForCausalLM.from_pretrained(str(bases[0]))
    lora.add_adapters(ours, lora.LoraSpec(4, 8.0, 0.0, ("all-linear",)))
    _, unexpected = ours.load_state_dict(result["adapters"], strict=False)
    assert unexpected == []
    peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(str(bases[0])), str(tmp_path / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged"))
    plain = AutoModelForCausalLM.from_pretrained(str(bases[0]))
    with torch.no_grad():
        want, base = ours.eval()(ids).logits, plain.eval()(ids).logits
        assert (want - base).abs().max() > 1e-4  # the trained adapters change the output
        torch.testing.assert_close(peft.eval()(ids).logits, want, atol=1e-6, rtol=0)
        torch.testing.assert_close(merged.eval()(ids).logits, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("strategy", ["ddp", "fsdp-full", "zero3"])
def test_two_ranks_train_the_adapters_of_one_process(bases, one, strategy):
    """The same global batch of 8 over two gloo ranks: the adapters of one process to fp32
    rounding (the gradients' sums run in another order; 4 AdamW steps at lr 1e-2). Under
    DeepSpeed ZeRO-3 the adapters stay whole on each rank (below its persistence threshold)."""
    import torch

    if strategy == "zero3":
        require("deepspeed")
    result, _, _ = one
    two = fine_tune(bases[0], nproc=2, strategy=strategy, micro_batch=4)
    assert two["changed"] == []
    assert two["losses"] == pytest.approx(result["losses"], rel=1e-5)
    for name, t in result["adapters"].items():
        torch.testing.assert_close(two["adapters"][name], t, rtol=1e-4, atol=1e-5, msg=name)


def test_qlora_trains_a_tiny_model_on_an_nf4_base(bases):
    """--quantize nf4: the adapted layers' frozen weights in NF4, the loss of 8 samples seen
    again and again going down (random tokens: memorised, not learnt); two DDP ranks train
    as one process."""
    require("torchao")
    result = fine_tune(bases[0], quantize="nf4", steps=8, lr=3e-2, samples=8)
    losses = result["losses"]
    assert losses[-1] < losses[0] - 0.2 and all(b < a for a, b in zip(losses[:4], losses[1:5])), losses
    assert "pretrained weights read -> NF4 base in 14 layers" in result["first_lines"]
    ddp = fine_tune(bases[0], nproc=2, strategy="ddp", micro_batch=4, quantize="nf4", steps=8, lr=3e-2, samples=8)
    # the same 4-bit base on each rank; the gradients summed in another order, grown by 8 steps at lr 3e-2
    assert ddp["losses"] == pytest.approx(losses, rel=5e-4)


def test_the_nf4_block_rule():
    from meshrun.training.quantize import scaler_block

    assert scaler_block(4096 * 4096) == 256  # torchao's default
    assert scaler_block(64 * 64) == 64 and scaler_block(176 * 64) == 16  # the tiny model's layers
    assert scaler_block(64 * 3) is None and scaler_block(100) is None  # odd blocks, not in blocks of 64


# ---- refused before launch, one line each ----------------------------------------------------------

BAD = [
    (["--lora", "0"], "--lora=0: the adapters' rank must be between 1 and 4096"),
    (["--lora", "8", "--lora-targets", "q,nope"], "--lora-targets='nope': matches no linear layer of the model"),
    (["--lora", "8", "--tp", "2", "--nproc", "2"], "--tp=2: does not combine with --lora"),
    (["--lora-alpha", "16"], "--lora-alpha=16.0: is an option of --lora runs, and there is no --lora"),
    (["--lora", "8", "--lora-dropout", "1"], "--lora-dropout=1.0: must be at least 0 and below 1"),
    (["--lora", "8", "--precision", "fp8"], "--precision='fp8': does not combine with --lora"),
    (["--quantize", "nf4"], "--quantize='nf4': is an option of --lora runs, and there is no --lora"),
    (["--lora", "8", "--quantize", "nf4", "--strategy", "fsdp", "--nproc", "2"],
     "--strategy='fsdp': does not combine with --quantize nf4"),
    (["--lora", "8", "--quantize", "nf4", "--strategy", "zero2", "--nproc", "2"],
     "--strategy='zero2': does not combine with --quantize nf4"),
]


@pytest.mark.parametrize("args,expected", BAD, ids=[" ".join(a) for a, _ in BAD])
def test_bad_lora_options_are_one_line_before_launch(bases, tmp_path, args, expected):
    out = tmp_path / "out"
    res = meshrun_here("train", "--model", str(bases[0]), "--data", "random", "--out", str(out), *args,
                       env=clean_env())
    assert res.returncode == 2, res.stderr
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshrun: error: ") and expected in lines[0], lines
    assert "(hint: " in lines[0]
    assert not out.exists()


# ---- the base model's fingerprint and the resume check (pure) ----------------------------------------

def test_the_fingerprint_tells_other_weights_and_configs_apart_but_not_a_copy(bases, tmp_path):
    import shutil

    from meshrun.modelinfo.fingerprint import fingerprint

    a, b = bases
    copy = tmp_path / "copy"
    shutil.copytree(a, copy)
    assert fingerprint(copy) == fingerprint(a) != fingerprint(b)  # same architecture, other weights
    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-5}))
    assert fingerprint(copy) != fingerprint(a)


def test_a_resume_between_lora_and_full_runs_or_other_adapters_is_refused():
    from meshrun.errors import MeshrunError
    from meshrun.training.lorabase import check_resume

    base = {"directory": "/m", "fingerprint": "f" * 64, "identity": "x"}
    saved = {"rank": 8, "alpha": 16.0, "dropout": 0.0, "target_modules": ["a.q_proj", "a.v_proj"], "base": base}
    check_resume("S", None, None)
    check_resume("S", saved, dict(saved))
    cases = [(None, saved, "S: a snapshot of a run that trained every weight, and this run trains LoRA adapters"),
             (saved, None, "S: a LoRA snapshot (rank 8), and this run trains every weight (hint: resume with --lora 8"),
             (saved, {**saved, "rank": 4}, "S: its adapters have rank 8, this run's 4"),
             (saved, {**saved, "target_modules": ["a.q_proj"]}, "S: its adapters are on 2 layers, this run's on 1 "
              "(a.v_proj is not among this run's)")]
    for old, new, expected in cases:
        with pytest.raises(MeshrunError) as info:
            check_resume("S", old, new)
        assert str(info.value).startswith(expected) and "(hint: " in str(info.value), str(info.value)


def test_targets_meshrun_s_gpt_lacks_are_refused_before_launch(tmp_path):
    """meshrun's GPT is checked by the names its blocks give their linear layers, which the
    built model must have (with experts: attention's and the router)."""
    from meshrun.training import lora
    from meshrun.training.models.gpt import gpt
    from meshrun.vocab import GPT_ATTENTION_LINEARS, GPT_EXPERT_LINEARS, GPT_MLP_LINEARS

    for experts, names in ((0, GPT_ATTENTION_LINEARS + GPT_MLP_LINEARS),
                           (4, GPT_ATTENTION_LINEARS + GPT_EXPERT_LINEARS)):
        model = gpt("gpt-tiny", seq_len=32, vocab=256, n_experts=experts)
        assert {n.rsplit(".", 1)[-1] for n in lora._linears(model)} == set(names)
    for args, expected in ((["--lora-targets", "q"], "--lora-targets='q': matches no linear layer of the model "
                            "(hint: its linear layers end in down, proj, qkv, up; or all-linear)"),
                           (["--lora-targets", "qkv,up", "--experts", "4"], "--lora-targets='up': matches no "
                            "linear layer of the model (hint: its linear layers end in proj, qkv, router; or "
                            "all-linear)")):
        res = meshrun_here("train", "--lora", "4", "--out", str(tmp_path / "out"), *args, env=clean_env())
        assert res.returncode == 2 and res.stderr.strip() == f"meshrun: error: {expected}", res.stderr
        assert not (tmp_path / "out").exists()


def test_a_lora_run_counts_four_flops_a_token_for_each_frozen_weight():
    """MFU's FLOPs of a LoRA run: a frozen weight's matmul runs forward and for its input's
    gradient (4 FLOPs a token), an adapter's for its own gradient too (6); attention's 12·L·d·T
    is unchanged."""
    import transformers as T

    from meshrun.training.metrics import flops_per_token, lora_flops_per_token

    config = T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2)
    model = T.LlamaForCausalLM(config)
    n = sum(p.numel() for p in model.parameters()) - VOCAB * 64  # but the untied input embedding
    attention = 12 * 2 * 64 * 16
    full = flops_per_token(model, 16)
    assert full == 6 * n + attention
    assert lora_flops_per_token(model, 16, full, 1000) == 4 * n + attention + 6 * 1000


def test_frozen_linear_weights_held_in_bf16_compute_the_same_under_autocast():
    """Under bf16 autocast a frozen linear layer's fp32 weight is cast to bf16 at each use, so
    holding it in bf16 gives the same logits and adapter gradients bit for bit; embeddings,
    norms, a head tied to the embedding and the adapters keep their dtype."""
    import copy

    import torch
    import transformers as T

    from meshrun.training import lora
    from meshrun.training.quantize import frozen_linears_to_bf16

    require("peft")
    config = T.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=176, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    torch.manual_seed(0)
    model = T.LlamaForCausalLM(config)
    lora.add_adapters(model, lora.LoraSpec(4, 8.0))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_()
    held = copy.deepcopy(model)
    assert frozen_linears_to_bf16(held) == 14  # the adapted layers; the head is the embedding's
    ids = torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for m in (model, held):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = m(ids).logits
        logits.float().square().mean().backward()
        results.append((logits, {n: p.grad for n, p in m.named_parameters() if p.requires_grad}))
    assert torch.equal(results[0][0], results[1][0])
    assert results[0][1].keys() == results[1][1].keys() and all(
        torch.equal(g, results[1][1][n]) for n, g in results[0][1].items())
    dtypes = {n: p.dtype for n, p in held.named_parameters()}
    assert dtypes["model.layers.0.self_attn.q_proj.base_layer.weight"] == torch.bfloat16
    assert dtypes["model.embed_tokens.weight"] == dtypes["model.norm.weight"] == torch.float32
    assert all(d == torch.float32 for n, d in dtypes.items() if lora.is_adapter(n))
