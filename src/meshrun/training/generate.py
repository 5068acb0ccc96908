"""`meshrun generate`: a model loaded from what meshrun trains or exports, and text sampled from it
with transformers' ``generate``.

What can be read: a Hugging Face model directory (``config.json``, as ``meshrun export``
writes one), an adapter directory in PEFT's format (``adapter_config.json``; the base model
from its ``base_model_name_or_path``), a snapshot of a run (or the run's directory, or its
``checkpoints``: the newest snapshot): a whole Hugging Face model's weights, built in memory
from the config the snapshot records, or a LoRA run's adapters on the base model its
state.json's ``"lora"`` entry names, once that base is found unchanged. The tokenizer comes from the model's
directory (the base's, the run's source), or ``--tokenizer DIR``.

Models without a tokenizer of their own (meshrun's GPT, trained on bytes) are refused:
sampling them would need meshrun's model classes rebuilt from the run's configuration, and
their bytes are not a tokenizer transformers' ``generate`` can pair with.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import MeshrunError, bad_value
from ..modelinfo import hf

ADAPTER_CONFIG = "adapter_config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
WHAT = "SOURCE"  # the positional argument, as the errors name it
KINDS_HINT = ("give a model directory (config.json), an adapter directory (adapter_config.json), a run's "
              "directory or one of its snapshots")


@dataclass(frozen=True)
class Loaded:
    """A model ready to sample from, its tokenizer, and what it is."""

    model: Any
    tokenizer: Any
    described: str


def has_tokenizer(directory: str | None) -> bool:
    return bool(directory) and any(os.path.isfile(os.path.join(str(directory), n)) for n in TOKENIZER_FILES)


def load(source: str, given_tokenizer: str | None = None) -> Loaded:
    """The model at ``source`` (module docstring), on the CPU, in eval mode, and its tokenizer
    (``given_tokenizer``'s, else the model's own), which is read first: a missing tokenizer
    is refused before any weight is read. transformers' progress bars and notices are kept off
    the output meanwhile."""
    with _quiet_transformers():
        if os.path.isdir(source) and os.path.isfile(os.path.join(source, ADAPTER_CONFIG)):
            return _adapter_dir(source, given_tokenizer)
        if os.path.isdir(source) and os.path.isfile(os.path.join(source, hf.CONFIG)):
            what = f"the model in {source}"
            tok = tokenizer(source, given_tokenizer, what)
            return Loaded(_from_pretrained(source, WHAT), tok, what)
        snapshot = _snapshot_path(source)
        if snapshot is None:
            problem = "is not a directory" if not os.path.isdir(source) else "holds no model, adapter nor snapshot"
            raise bad_value(WHAT, source, problem, KINDS_HINT)
        return _snapshot(snapshot, given_tokenizer)


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """transformers' loading progress bars and its warnings off while a model loads and samples
    (what it says of generation flags is no concern of the user's), as they were after."""
    quiet()
    from transformers.utils import logging as hf_logging

    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()


def _snapshot_path(source: str) -> str | None:
    from .snapshot import MARKER, latest

    if not os.path.isdir(source):
        return None
    if os.path.isfile(os.path.join(source, MARKER)):
        return source
    for root in (os.path.join(source, "checkpoints"), source):
        if os.path.isdir(root):
            found = latest(root)
            if found is not None:
                return found
    return None


def _from_pretrained(directory: str, where: str) -> Any:
    quiet()
    import transformers

    config = hf.load_config(hf.locate(directory, where), where)  # a causal decoder, sizes in bounds
    try:
        return transformers.AutoModelForCausalLM.from_pretrained(directory, config=config,
                                                                 local_files_only=True).eval()
    except (OSError, ValueError, RuntimeError) as exc:
        raise bad_value(where, directory, f"transformers cannot load it ({type(exc).__name__}: "
                        f"{_first_line(exc)})", "check the model directory's files") from None


def _adapter_dir(directory: str, given_tokenizer: str | None) -> Loaded:
    """A PEFT adapter on the base model its config names."""
    path = os.path.join(directory, ADAPTER_CONFIG)
    try:
        with open(path) as f:
            values = json.load(f)
        base = values["base_model_name_or_path"] if isinstance(values, dict) else None
    except (OSError, ValueError, KeyError, RecursionError):
        raise bad_value(WHAT, directory, f"its {ADAPTER_CONFIG} is not PEFT's adapter config",
                        "export the adapter again with meshrun export") from None
    if not isinstance(base, str) or not os.path.isfile(os.path.join(base, hf.CONFIG)):
        raise bad_value(WHAT, directory, f"its {ADAPTER_CONFIG} names base model {base!r}, which is not a model "
                        "directory here", f"put the base model at that path, or set base_model_name_or_path in "
                        f"{path}") from None
    from peft import PeftModel

    what = f"the adapter in {directory} on {base}"
    tok = tokenizer(directory if has_tokenizer(directory) else base, given_tokenizer, what)
    model = PeftModel.from_pretrained(_from_pretrained(base, f"{path}: base_model_name_or_path"), directory).eval()
    return Loaded(model, tok, what)


def _snapshot(path: str, given_tokenizer: str | None) -> Loaded:
    from .snapshot.export import hf_model, read_checked
    from .snapshot.lora_record import check_base, read_record

    checked, record = read_record(path)
    if record is None:
        state = checked.state.get("model") or {}
        if not state.get("hf_config"):
            raise bad_value(WHAT, path, "a snapshot of meshrun's own model, which has no tokenizer transformers "
                            "can sample with", "meshrun generate samples Hugging Face models: train one with "
                            "--model DIR") from None
        what = f"the model of snapshot {path}"
        source = state.get("source")
        tok = tokenizer(source if isinstance(source, str) else None, given_tokenizer, what)
        model, _, _ = hf_model(path, "meshrun generate", "train a Hugging Face model with --model DIR")
        return Loaded(model.eval(), tok, what)
    base = check_base(record, path)
    what = f"the LoRA snapshot {path} on {base}"
    tok = tokenizer(base, given_tokenizer, what)
    weights, _ = read_checked(checked)
    model = _from_pretrained(base, f"{path}: its base model")
    from .lora import add_adapters

    add_adapters(model, record.spec)
    _, unexpected = model.load_state_dict(weights, strict=False)
    missing = sorted(n for n, _ in model.named_parameters() if ".lora_" in n and n not in weights)
    if unexpected or missing:
        name = (unexpected or missing)[0]
        raise MeshrunError(f"{path}: its adapter does not fit the base model {base} ({name}) "
                           "(hint: export it and apply it with PEFT to see which layers differ)")
    return Loaded(model.eval(), tok, what)


def tokenizer(own: str | None, given: str | None, described: str) -> Any:
    """The tokenizer of ``given`` (--tokenizer) or else of the model's directory ``own``; one
    line when there is none."""
    directory = given or own
    where = "--tokenizer" if given else WHAT
    if not has_tokenizer(directory):
        shown = directory if directory else "the run's source (not recorded)"
        raise MeshrunError(f"{where}: no tokenizer in {shown} (no {', '.join(TOKENIZER_FILES[:3])}) for "
                           f"{described} (hint: --tokenizer DIR names a directory that holds one)")
    import transformers

    try:
        return transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except (OSError, ValueError, RuntimeError, TypeError, KeyError) as exc:
        raise bad_value(where, directory, f"transformers cannot read its tokenizer ({type(exc).__name__}: "
                        f"{_first_line(exc)})", "give a directory save_pretrained wrote a tokenizer into") from None


def prompt_ids(tok: Any, prompt: str, chat: bool) -> Any:
    """The prompt's token ids (1 x n); under ``chat`` as one user turn of the tokenizer's chat
    template, ready for the assistant's answer."""
    if chat:
        if not getattr(tok, "chat_template", None):
            raise MeshrunError(f"--chat: the tokenizer ({getattr(tok, 'name_or_path', '?')}) has no chat template "
                               "(hint: leave out --chat, or give --tokenizer DIR of one with a chat template)")
        text = tok.apply_chat_template([{"role": "user", "content": prompt}], tokenize=False,
                                       add_generation_prompt=True)
        ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    else:
        ids = tok(prompt, return_tensors="pt")["input_ids"]
    if ids.shape[-1] == 0:
        raise bad_value("--prompt", prompt, "makes no token with this tokenizer", "give some text")
    return ids


def sample(model: Any, tok: Any, prompt: str, max_new_tokens: int, temperature: float, seed: int,
           chat: bool = False) -> str:
    """The completion of ``prompt`` (its text alone, special tokens left out): greedy at
    temperature 0, else sampled at ``temperature`` from the whole distribution (no top-k or
    top-p), seeded by ``seed``; on the GPU when there is one."""
    import torch

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ids = prompt_ids(tok, prompt, chat).to(device)
    model = model.to(device)
    torch.manual_seed(seed)
    options: dict[str, Any] = {"do_sample": False} if temperature == 0 else {
        "do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    with torch.no_grad(), _quiet_transformers():
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                             pad_token_id=pad, **options)
    return str(tok.decode(out[0, ids.shape[-1]:], skip_special_tokens=True))


def quiet() -> None:
    from ..quiet import quiet_library_notices

    quiet_library_notices()


def _first_line(exc: BaseException) -> str:
    from ..errors import first_line

    return first_line(str(exc), 160)
