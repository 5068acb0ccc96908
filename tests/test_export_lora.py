"""`meshrun export` of a LoRA run's snapshot: the adapter in PEFT's format, which PEFT's own
``PeftModel.from_pretrained`` loads, and with --merge the base model with the adapter merged
into its weights; both give the adapted model's logits. The snapshots are built in the layout a
LoRA run writes (tests/tiny_hf.py), around a two-layer Llama saved here."""

from __future__ import annotations

import json
import os
import re
import shutil

import pytest
from helpers import meshrun_here, require

SPEC_ARGS = (4, 8.0, 0.0, ("q", "v", "down"))


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A base model directory, its adapted model (random lora_B) and a LoRA snapshot of it."""
    require("peft")
    import tiny_hf

    from meshrun.training.lora import LoraSpec

    root = tmp_path_factory.mktemp("lora")
    base = tiny_hf.model_dir(root / "base")
    spec = LoraSpec(*SPEC_ARGS)
    model, targets = tiny_hf.adapted(base, spec)
    snap = tiny_hf.lora_snapshot(str(root / "run"), model, spec, base)
    return {"root": root, "base": base, "spec": spec, "model": model, "targets": targets, "snapshot": snap}


def _ids():
    import torch

    return torch.randint(0, 40, (2, 12), generator=torch.Generator().manual_seed(5))


def _logits(model):
    import torch

    with torch.no_grad():
        return model(_ids()).logits


def test_the_adapter_is_peft_s_format_and_peft_loads_it_to_the_same_logits(lora_run, tmp_path):
    """write_adapter's files hold exactly the keys PEFT's own get_peft_model_state_dict gives for a
    PeftModel of the same model and layers, and PeftModel.from_pretrained(base, DIR) computes
    the adapted model's logits (to 1e-6; the same float operations in the same order: 0.0 on
    torch 2.13 CPU)."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from meshrun.training import adapters, lora

    out = str(tmp_path / "adapter")
    n, moved = adapters.write_adapter(lora.model_state(lora_run["model"]), lora_run["spec"], lora_run["targets"],
                                      lora_run["base"], out)
    assert (n, moved) == (2 * len(lora_run["targets"]), None)
    assert sorted(os.listdir(out)) == ["adapter_config.json", "adapter_model.safetensors"]
    with open(os.path.join(out, "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["peft_type"], config["task_type"], config["r"], config["lora_alpha"], config["lora_dropout"]) == \
        ("LORA", "CAUSAL_LM", 4, 8, 0.0)
    assert config["base_model_name_or_path"] == os.path.abspath(lora_run["base"])
    assert config["target_modules"] == sorted(lora_run["targets"])
    assert len(lora_run["targets"]) == 6  # q, v and down of two layers
    peft_own = get_peft_model(AutoModelForCausalLM.from_pretrained(lora_run["base"]),
                              LoraConfig(r=4, lora_alpha=8, target_modules=lora_run["targets"]))
    with safe_open(os.path.join(out, "adapter_model.safetensors"), "pt") as f:
        assert sorted(f.keys()) == sorted(get_peft_model_state_dict(peft_own))
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(lora_run["base"]), out).eval()
    base_logits = _logits(AutoModelForCausalLM.from_pretrained(lora_run["base"]).eval())
    want = _logits(lora_run["model"])
    assert (want - base_logits).abs().max() > 1e-2  # the adapter changes the output
    torch.testing.assert_close(_logits(loaded), want, atol=1e-6, rtol=0)


def test_the_merged_model_gives_the_adapted_logits(lora_run, tmp_path):
    """merge writes a model directory (the base's config, weight files, generation config and
    tokenizer) that from_pretrained loads to the adapted model's logits (to 1e-5: W + s*B@A
    rounded once, against x@W + s*(x@A)@B; 2.1e-7 measured on torch 2.13 CPU); the weights it
    does not adapt are the base's, bit for bit."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from meshrun.training import adapters, lora

    out = str(tmp_path / "merged")
    n, _ = adapters.merge(lora.model_state(lora_run["model"]), lora_run["spec"], lora_run["base"], out)
    assert n == 6
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= set(os.listdir(out))
    merged = AutoModelForCausalLM.from_pretrained(out).eval()
    torch.testing.assert_close(_logits(merged), _logits(lora_run["model"]), atol=1e-5, rtol=0)
    base = AutoModelForCausalLM.from_pretrained(lora_run["base"]).state_dict()
    mine = merged.state_dict()
    changed = sorted(k for k in base if not torch.equal(base[k], mine[k]))
    assert changed == sorted(f"{t}.weight" for t in lora_run["targets"])
    assert AutoTokenizer.from_pretrained(out)("the cat sat")["input_ids"] == [3, 4, 6]


def test_export_writes_a_lora_snapshot_s_adapter_and_with_merge_the_merged_model(lora_run, tmp_path):
    """`meshrun export SNAPSHOT --to DIR` of a LoRA snapshot writes its adapter (PEFT loads it to
    the adapted logits); with --merge, the merged model; each says what it wrote in one line."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    snap, base = lora_run["snapshot"], lora_run["base"]
    want = _logits(lora_run["model"])
    res = meshrun_here("export", os.path.dirname(snap), "--to", str(tmp_path / "a"))
    assert res.returncode == 0, res.stderr
    assert res.stdout == (f"meshrun export: the rank-4 adapter (12 tensors) for {os.path.abspath(base)} from {snap} "
                          f"-> {tmp_path / 'a'} (PEFT adapter)\n")
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), str(tmp_path / "a")).eval()
    torch.testing.assert_close(_logits(loaded), want, atol=1e-6, rtol=0)
    res = meshrun_here("export", snap, "--to", str(tmp_path / "m"), "--merge")
    assert res.returncode == 0, res.stderr
    assert "6 weights of" in res.stdout and "merged with the rank-4 adapter" in res.stdout
    merged = AutoModelForCausalLM.from_pretrained(str(tmp_path / "m")).eval()
    torch.testing.assert_close(_logits(merged), want, atol=1e-5, rtol=0)


def _bad_exports(lora_run, tmp):
    """(arguments, what the one line says) for each refused export."""
    import tiny_hf

    spec, model = lora_run["spec"], lora_run["model"]
    moved = tiny_hf.model_dir(tmp / "moved-base")
    gone = tiny_hf.lora_snapshot(str(tmp / "gone"), model, spec, moved)
    shutil.rmtree(moved)
    other = tiny_hf.lora_snapshot(str(tmp / "other"), model, spec, lora_run["base"], fingerprint="sha256:" + "0" * 64)
    whole = tiny_hf.lora_snapshot(str(tmp / "whole"), tiny_hf.llama(), spec, lora_run["base"], whole=True)
    bare = tiny_hf.lora_snapshot(str(tmp / "bare"), model, spec, lora_run["base"], record=False)
    drawn = tiny_hf.lora_snapshot(str(tmp / "drawn"), model, spec, lora_run["base"],
                                  identity="a random initialisation: model llama, seed 0")
    snap = lora_run["snapshot"]
    return [
        ([gone, "--to", str(tmp / "o1")], f"{gone}: its base model {os.path.abspath(moved)} is no longer there"),
        ([other, "--to", str(tmp / "o2")], f"{other}: its base model {os.path.abspath(lora_run['base'])} has "
                                           "fingerprint sha256:"),
        ([other, "--to", str(tmp / "o2")], "the run trained on sha256:0000000000000000…: not the weights the adapters"),
        ([whole, "--to", str(tmp / "o3"), "--merge"], f"--merge: {whole} is a snapshot of a whole model, not of "
                                                      "a LoRA run"),
        ([drawn, "--to", str(tmp / "o6")], f"{drawn}: its adapters were trained on a base model not read from files "
                                           "(a random initialisation: model llama, seed 0)"),
        ([bare, "--to", str(tmp / "o4")],
         f"{bare}: its model weights are LoRA adapters but its state.json names no base model"),
        ([snap, "--to", str(tmp / "o5.safetensors")],
         f"--to='{tmp / 'o5.safetensors'}': {snap} is a snapshot of a LoRA run, exported as a directory"),
    ]


def test_bad_lora_exports_are_one_line_each(lora_run, tmp_path):
    for args, said in _bad_exports(lora_run, tmp_path):
        res = meshrun_here("export", *args)
        assert res.returncode == 2 and res.stderr.count("\n") == 1, (args, res.stderr)
        assert said in res.stderr, (args, res.stderr)
        assert "(hint: " in res.stderr
        assert not os.path.exists(args[2]), args


def test_merging_into_a_sharded_bf16_base_rewrites_only_the_adapted_weights(lora_run, tmp_path):
    """A base saved in bf16 across several files: each file keeps its header, the index is
    copied, and each adapted weight is exactly bf16(fp32(W) + alpha/rank * B @ A); every other
    tensor is the base's, bit for bit."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from meshrun.modelinfo.hf import weight_files
    from meshrun.training import adapters, lora

    base = str(tmp_path / "bf16")
    AutoModelForCausalLM.from_pretrained(lora_run["base"], dtype=torch.bfloat16).save_pretrained(
        base, max_shard_size="20KB")
    files = weight_files(base)
    assert len(files) > 2
    weights = lora.model_state(lora_run["model"])
    out = str(tmp_path / "merged")
    adapters.merge(weights, lora_run["spec"], base, out)
    assert sorted(os.listdir(out)) == sorted(os.listdir(base))
    scale = lora_run["spec"].scale
    for path in files:
        before, after = load_file(path), load_file(os.path.join(out, os.path.basename(path)))
        with open(path, "rb") as f, open(os.path.join(out, os.path.basename(path)), "rb") as g:
            head = f.read(8)
            n = int.from_bytes(head, "little")
            assert head + f.read(n) == g.read(8 + n)  # the header, byte for byte
        for key, tensor in before.items():
            module = key[: -len(".weight")]
            if module in lora_run["targets"]:
                a = weights[f"{module}.lora_A.default.weight"].float()
                b = weights[f"{module}.lora_B.default.weight"].float()
                assert torch.equal(after[key], (tensor.float() + scale * (b @ a)).to(torch.bfloat16)), key
            else:
                assert torch.equal(after[key], tensor), key
    assert AutoModelForCausalLM.from_pretrained(out).dtype == torch.bfloat16


def test_the_fingerprint_sees_other_weights_and_not_a_copy(lora_run, tmp_path):
    """The same layout with one value changed has another fingerprint (a file this small is
    sampled whole; a larger one in 16 blocks of 64 KiB, where another model's values differ in
    every block); a copy of the directory elsewhere has the same."""
    from safetensors.torch import load_file, save_file

    from meshrun.modelinfo.fingerprint import fingerprint

    copy = shutil.copytree(lora_run["base"], tmp_path / "copy")
    assert fingerprint(str(copy)) == fingerprint(lora_run["base"])
    path = os.path.join(copy, "model.safetensors")
    tensors = load_file(path)
    tensors["model.layers.1.mlp.down_proj.weight"][3, 5] += 1
    save_file(tensors, path, metadata={"format": "pt"})
    assert os.path.getsize(path) == os.path.getsize(os.path.join(lora_run["base"], "model.safetensors"))
    assert fingerprint(str(copy)) != fingerprint(lora_run["base"])


@pytest.mark.parametrize("names,shapes,said", [
    (["model.layers.0.mlp.up_proj.weight"], [(8, 4)], "is not a LoRA adapter's weight"),
    (["m.q_proj.lora_A.other.weight", "m.q_proj.lora_B.other.weight"], [(4, 8), (8, 4)], "belongs to adapter 'other'"),
    (["m.q_proj.lora_A.default.weight"], [(4, 8)], "the layer m.q_proj has no lora_B"),
    (["m.q_proj.lora_A.default.weight", "m.q_proj.lora_B.default.weight"], [(2, 8), (8, 2)],
     "has shapes (2, 8) and (8, 2), not those of rank 4"),
    ([], [], "holds no LoRA adapter"),
])
def test_tensors_that_are_not_one_adapter_of_the_run_s_rank_are_one_line(names, shapes, said):
    import torch

    from meshrun.errors import MeshrunError
    from meshrun.training.adapters import layers
    from meshrun.training.lora import LoraSpec

    with pytest.raises(MeshrunError, match=re.escape(said)):
        layers({n: torch.zeros(s) for n, s in zip(names, shapes)}, LoraSpec(4, 8.0))
