"""`meshrun generate`: the completion it prints is transformers' own generate on the same model
(greedy at --temperature 0: the same text on every call), for a model directory, an adapter
directory in PEFT's format, a LoRA run's snapshot and a whole model's snapshot; bad inputs are
one line each. The models are tiny Llamas with a word-level tokenizer built here (tests/tiny_hf.py)."""

from __future__ import annotations

import os

import pytest
from helpers import meshrun_here, require

PROMPT = "the cat sat on a"


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A base model directory, an exported adapter of it, a LoRA snapshot and a whole-model snapshot."""
    require("peft")
    import tiny_hf

    from meshrun.training import adapters, lora

    root = tmp_path_factory.mktemp("generate")
    base = tiny_hf.model_dir(root / "base")
    spec = lora.LoraSpec(4, 8.0, 0.0, ("all-linear",))
    model, targets = tiny_hf.adapted(base, spec)
    adapters.write_adapter(lora.model_state(model), spec, targets, base, str(root / "adapter"))
    snap = tiny_hf.lora_snapshot(str(root / "run"), model, spec, base)
    return {"root": root, "base": base, "model": model, "adapter": str(root / "adapter"), "run": str(root / "run"),
            "snapshot": snap}


def _transformers_greedy(model, directory: str, new: int, chat: bool = False) -> str:
    import torch
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(directory)
    if chat:
        text = tok.apply_chat_template([{"role": "user", "content": PROMPT}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    else:
        ids = tok(PROMPT, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False,
                             pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, ids.shape[-1]:], skip_special_tokens=True)


def _generate(source, *more):
    res = meshrun_here("generate", str(source), "--prompt", PROMPT, "--temperature", "0", "--max-new-tokens", "8",
                       *more)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_greedy_text_from_a_model_directory_is_transformers_own(models):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(models["base"]).eval()
    want = _transformers_greedy(base, models["base"], 8)
    assert want.strip() and _generate(models["base"]) == want + "\n"
    assert _generate(models["base"]) == want + "\n"  # greedy: the same text again
    chat = _transformers_greedy(base, models["base"], 8, chat=True)
    assert _generate(models["base"], "--chat") == chat + "\n"


def test_greedy_text_from_an_adapter_and_a_lora_snapshot_is_the_adapted_model_s(models):
    """An adapter directory (base from its adapter_config.json) and the LoRA snapshot (base from its
    state.json's record) both give the adapted model's greedy text, which differs from the base's."""
    from transformers import AutoModelForCausalLM

    want = _transformers_greedy(models["model"], models["base"], 8)
    base = _transformers_greedy(AutoModelForCausalLM.from_pretrained(models["base"]).eval(), models["base"], 8)
    assert want != base
    assert _generate(models["adapter"]) == want + "\n"
    assert _generate(models["run"]) == want + "\n"  # the run's directory: its newest snapshot


def test_greedy_text_from_a_whole_model_snapshot_is_its_model_s(models, tmp_path):
    """A snapshot of a whole Hugging Face model (other weights than the base's) is built in memory
    from its recorded config; the tokenizer is that of the directory the run read."""
    import tiny_hf

    trained = tiny_hf.llama(seed=7)
    snap = tiny_hf.lora_snapshot(str(tmp_path / "whole"), trained, None, models["base"], whole=True)
    want = _transformers_greedy(trained, models["base"], 8)
    assert want != _transformers_greedy(tiny_hf.llama(seed=0), models["base"], 8)
    assert _generate(snap) == want + "\n"


def test_sampling_follows_the_seed(models):
    """At a temperature above 0 the text is sampled: the same seed, the same text."""
    args = ("generate", models["base"], "--prompt", PROMPT, "--temperature", "1.5", "--max-new-tokens", "12")
    first, again = meshrun_here(*args, "--seed", "3"), meshrun_here(*args, "--seed", "3")
    assert first.returncode == 0 and first.stdout == again.stdout, first.stderr
    others = {meshrun_here(*args, "--seed", str(s)).stdout for s in (4, 5, 6)}
    assert len(others | {first.stdout}) > 1


def _bad(models, tmp):
    import tiny_hf

    plain = tiny_hf.model_dir(tmp / "no-tokenizer", tokenizer_files=False)
    no_chat = tmp / "no-chat"
    tiny_hf.tokenizer(chat=False).save_pretrained(str(no_chat))
    (tmp / "empty").mkdir()
    base = models["base"]
    gpt = tiny_hf.lora_snapshot(str(tmp / "gpt"), tiny_hf.llama(), None, base, whole=True, hf_record=False)
    return [
        (["generate", base], "the following arguments are required: --prompt"),
        (["generate", base, "--prompt", ""], "--prompt='': is empty"),
        (["generate", str(tmp / "empty"), "--prompt", "hi"], f"SOURCE='{tmp / 'empty'}': holds no model, adapter nor "
                                                             "snapshot"),
        (["generate", str(tmp / "nowhere"), "--prompt", "hi"], "no such file or directory"),
        (["generate", plain, "--prompt", "hi"], "no tokenizer in"),
        (["generate", str(tmp / "gpt"), "--prompt", "hi"], f"SOURCE='{gpt}': a snapshot of meshrun's own model"),
        (["generate", base, "--prompt", "hi", "--chat", "--tokenizer", str(no_chat)], "--chat: the tokenizer"),
        (["generate", base, "--prompt", "hi", "--temperature", "-1"], "--temperature='-1': must be a finite"),
        (["generate", base, "--prompt", "hi", "--max-new-tokens", "0"], "--max-new-tokens='0': must be >= 1"),
    ]


def test_bad_generate_inputs_are_one_line_each(models, tmp_path):
    for args, said in _bad(models, tmp_path):
        res = meshrun_here(*args)
        assert res.returncode == 2 and res.stderr.count("\n") == 1, (args, res.stderr)
        assert said in res.stderr, (args, res.stderr)
        assert not res.stdout, args


def test_a_lora_snapshot_whose_base_changed_is_refused_in_one_line(models, tmp_path):
    import tiny_hf

    other = tiny_hf.lora_snapshot(str(tmp_path / "other"), models["model"], tiny_hf_spec(), models["base"],
                                  fingerprint="sha256:" + "1" * 64)
    res = meshrun_here("generate", other, "--prompt", PROMPT)
    assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr
    assert f"its base model {os.path.abspath(models['base'])} has fingerprint" in res.stderr


def tiny_hf_spec():
    from meshrun.training import lora

    return lora.LoraSpec(4, 8.0, 0.0, ("all-linear",))


def test_generate_s_options_are_read_and_checked_without_torch(tmp_path):
    """The command's parse and checks import neither torch nor transformers: --help and a bad
    option answer at once."""
    import subprocess
    import sys

    from helpers import clean_env

    code = ("import sys\nfrom meshrun.cli import main\n"
            f"code = main(['generate', {str(tmp_path / 'nowhere')!r}, '--prompt', 'hi'])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'peft')))\n"
            "sys.exit(code)\n")
    res = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "no such file or directory" in res.stderr, res.stderr
    assert res.stdout.strip() == "[]"
    assert "examples:" in meshrun_here("generate", "--help").stdout
