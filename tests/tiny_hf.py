"""Tiny Hugging Face models for the LoRA export and generate tests, built here (nothing is
downloaded): a two-layer Llama saved with save_pretrained beside a word-level tokenizer with a
chat template, its adapters added through meshrun's own lora.add_adapters, and a committed
snapshot of a LoRA run holding those adapters alone with state.json's record of them."""

from __future__ import annotations

import hashlib
import json
import os

WORDS = ("the cat dog sat ran on a mat hat red blue big small fast slow and or not is was you I we they it "
         "hello world yes no one two three four five six seven eight nine ten up down left right user "
         "assistant system say what why how").split()
SPECIALS = ("<unk>", "<s>", "</s>")
CHAT_TEMPLATE = ("{% for m in messages %}<s> {{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
                 "{% if add_generation_prompt %}<s> assistant {% endif %}")


def tokenizer(chat: bool = True):
    """A word-level tokenizer over WORDS (split on whitespace, decoded with spaces)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate((*SPECIALS, *WORDS))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   chat_template=CHAT_TEMPLATE if chat else None)


def llama(seed: int = 0):
    """A two-layer Llama over the tokenizer's vocabulary, fp32, its weights drawn from ``seed``."""
    import torch
    import transformers

    torch.manual_seed(seed)
    config = transformers.LlamaConfig(vocab_size=len(SPECIALS) + len(WORDS), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
    return transformers.LlamaForCausalLM(config).eval()


def model_dir(path, seed: int = 0, tokenizer_files: bool = True, chat: bool = True) -> str:
    """save_pretrained of ``llama(seed)`` (and of the tokenizer) into ``path``."""
    llama(seed).save_pretrained(str(path))
    if tokenizer_files:
        tokenizer(chat).save_pretrained(str(path))
    return str(path)


def adapted(base: str, spec, seed: int = 1):
    """The model of ``base`` with adapters (meshrun's lora.add_adapters), lora_A as a run
    initialises it and lora_B random (a run's starts at zero, which would change nothing)."""
    import torch
    import transformers

    from meshrun.training import lora

    model = transformers.AutoModelForCausalLM.from_pretrained(base)
    targets = lora.target_modules(model, spec.targets)
    lora.add_adapters(model, spec)
    lora.init_adapters(model, seed)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    return model.eval(), targets


def lora_snapshot(run: str, model, spec, base: str, step: int = 3, fingerprint: str | None = None,
                  record: bool = True, whole: bool = False, hf_record: bool = True,
                  identity: str | None = None) -> str:
    """A committed snapshot of a LoRA run in meshrun's layout: the adapters alone under "model"
    (DCP), state.json with its "lora" entry as the trainer writes it (lorabase.record; unless not
    ``record``), rank 0's RNG file, and the marker with every file's SHA-256. ``whole``: every
    weight of ``model`` instead, and no "lora" entry, with the
    record of a Hugging Face model's config and source (unless not ``hf_record``: as meshrun's
    own GPT's snapshot, which has none). ``identity``: what the base's fingerprint covers, as
    recorded (default: its files)."""
    import torch.distributed.checkpoint as dcp

    from meshrun.modelinfo.fingerprint import fingerprint as base_fingerprint
    from meshrun.training import lora
    from meshrun.training.snapshot.layout import FORMAT, MARKER, snapshot_name

    snap = os.path.join(run, "checkpoints", snapshot_name(step))
    weights = dict(model.named_parameters()) if whole else lora.model_state(model)
    dcp.save({"model": {k: v.detach().clone() for k, v in weights.items()}}, checkpoint_id=snap, no_dist=True)
    files = {"state.json": {"format": FORMAT, "position": {"step": step, "epoch": 0, "samples": 0,
                                                           "schedule": [[0, step]]},
                            "world_size": 1, "config": {"model": base}},
             "rng-rank0.json": {}}
    if whole and hf_record:  # what a run of a Hugging Face model records for its export
        from meshrun.modelinfo.hf import export_record

        files["state.json"]["model"] = export_record(model, base)
    if record and not whole:
        from meshrun.training.lorabase import FROM_FILES
        from meshrun.training.lorabase import record as lora_entry
        from meshrun.training.weights import clean_name

        layers = [clean_name(name) for name in lora.adapter_modules(model)]  # full paths, as a run records
        files["state.json"]["lora"] = lora_entry(spec, layers, {
            "directory": os.path.abspath(base), "fingerprint": fingerprint or base_fingerprint(base),
            "identity": identity or FROM_FILES})
    for name, value in files.items():
        with open(os.path.join(snap, name), "w") as f:
            json.dump(value, f)
    digests = {}
    for name in sorted(os.listdir(snap)):
        with open(os.path.join(snap, name), "rb") as f:
            digests[name] = hashlib.sha256(f.read()).hexdigest()
    with open(os.path.join(snap, MARKER), "w") as f:
        json.dump({"format": FORMAT, "step": step, "world_size": 1, "files": digests}, f)
    return snap
