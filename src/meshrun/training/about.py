"""What a run trains, in facts and in words: the model (a GPT preset, a Hugging Face model's
directory and family, the user's module) and the data (where it comes from, its tokens or
samples, the tokenizer and its vocabulary, document masking). The ranks gather the facts
from what they built (``model_facts``, ``data_facts``); a Trainer built in a user's script
with its own model and data gets them from the objects alone (``given_model``). The words
(``model_line``, ``data_line``) are pure: the run's first lines (report.py) print them, and
the trackers get the facts as parameters."""

from __future__ import annotations

import os
import re
import sysconfig
from dataclasses import dataclass
from typing import Any

from ..config import BUILTIN_DATA, TrainConfig
from ..units import fmt_count
from ..vocab import GPT_PRESETS

STDLIB_WORDS = "the Python standard library's source"  # the default data, as the README names it
RANDOM_WORDS = "random tokens"
_CACHE_KEY = re.compile(r"[0-9a-f]{20}")  # data/cache.py: the name of a text corpus' tokens in the cache


@dataclass(frozen=True)
class ModelFacts:
    name: str  # a tracker's "model": the preset, the Hugging Face directory, module:factory, toy, a class name
    words: str  # the first line's: "gpt-tiny (meshrun's GPT preset: 2 layers of width 64)"
    family: str | None = None  # a Hugging Face model's model_type (llama, gpt2, ...)


@dataclass(frozen=True)
class DataFacts:
    name: str  # a tracker's "data": stdlib, random, toy, the corpus path, module:factory, a class name
    words: str  # the first line's: what it is and where it comes from
    train_tokens: int | None = None  # token data: the training split's tokens
    val_tokens: int | None = None
    train_samples: int | None = None  # samples, where the tokens are not counted (random, toy, a Dataset)
    val_samples: int | None = None
    tokenizer: str | None = None  # "bytes", a prepared corpus' tokenizer; None: not recorded, or no tokens
    vocab: int | None = None  # the token ids' range: the tokenizer's, else the model's
    tokens: bool = True  # samples are token sequences (a sequence length and document masking apply)
    document_mask: bool = False
    validation: bool = True  # a validation set is read (its size may be unknown: an iterable dataset)
    chat: str | None = None  # chat data: its packing (examples, sequences, those cut to the sequence)


def model_facts(cfg: TrainConfig, model: Any, pretrained: bool) -> ModelFacts:
    """The model ``cfg`` names, as factories.build_model built it (``pretrained``: a Hugging
    Face model is filled from its directory's weights)."""
    if cfg.model and ":" in cfg.model:
        return ModelFacts(cfg.model, f"{cfg.model} (your {type(model).__name__})")
    if cfg.model:
        from ..modelinfo import hf

        directory = hf.locate(cfg.model, cfg.source("model")).directory
        family = getattr(getattr(model, "config", None), "model_type", None)
        weights = "its pretrained weights" if pretrained else "randomly initialised"
        kind = f"a Hugging Face {family} model" if family else "a Hugging Face model"
        return ModelFacts(directory, f"{os.path.basename(os.path.normpath(directory))} ({kind} in {directory}, "
                          f"{weights})", family)
    if cfg.example == "toy":
        return ModelFacts("toy", "toy (pytorch/examples' Linear(20 -> 1))")
    preset = GPT_PRESETS[cfg.model_size]
    experts = f", {cfg.experts} experts in each" if cfg.experts else ""
    return ModelFacts(cfg.model_size, f"{cfg.model_size} (meshrun's GPT preset: {preset.n_layers} layers of width "
                      f"{preset.d_model}{experts})")


def given_model(model: Any) -> ModelFacts:
    """A model handed to a Trainer in a user's script: its class is what is known of it."""
    name = type(model).__name__
    return ModelFacts(name, f"{name} (the module given to Trainer)")


def data_facts(train: Any, val: Any, vocab: int | None, cfg: TrainConfig | None = None) -> DataFacts:
    """The data the run reads: with ``cfg``, the data it names as factories.build_data built
    it; without, the datasets handed to a Trainer, known by their kind. ``vocab``: the model's
    vocabulary (the range of token ids a corpus without a tokenizer is read in)."""
    from .loader import PackedExamples, PackedTokens, RandomTokens, TokenChunks, ToyRegression

    name = None if cfg is None else (cfg.data or ("toy" if cfg.example == "toy" else "stdlib"))
    has_val = val is not None
    if isinstance(train, TokenChunks) and name == "stdlib":
        stdlib = sysconfig.get_paths()["stdlib"]
        return DataFacts("stdlib", f"{STDLIB_WORDS} (the .py files under {stdlib})", len(train.tokens),
                         len(val.tokens) if isinstance(val, TokenChunks) else None, tokenizer="bytes", vocab=256,
                         validation=has_val)
    if isinstance(train, PackedTokens):
        path = name if name is not None and name not in BUILTIN_DATA and ":" not in name else None
        tokenizer, words = _corpus(path)
        return DataFacts(path or type(train).__name__, words, len(train.split),
                         len(val.split) if isinstance(val, PackedTokens) else None,
                         tokenizer=tokenizer[0] if tokenizer else None, vocab=tokenizer[1] if tokenizer else vocab,
                         document_mask=train.document_mask, validation=has_val,
                         chat=_packing(train) if isinstance(train, PackedExamples) else None)
    if isinstance(train, RandomTokens):
        return DataFacts("random" if name == "random" else type(train).__name__, RANDOM_WORDS,
                         train_samples=len(train), val_samples=_length(val), vocab=train.vocab, validation=has_val)
    if isinstance(train, ToyRegression) and name in ("toy", None):
        return DataFacts("toy", "toy (pytorch/examples' regression set, 20 features -> 1)", train_samples=len(train),
                         val_samples=_length(val), tokens=False, validation=has_val)
    cls = type(train).__name__
    factory = name is not None and ":" in name
    words = f"{name} (your {cls})" if factory else f"{cls} (the dataset given to Trainer)"
    return DataFacts(name if factory and name else cls, words, train_samples=_length(train), val_samples=_length(val),
                     vocab=vocab, tokens=_holds_tokens(train), validation=has_val)


def _holds_tokens(data: Any) -> bool:
    """Whether a dataset's inputs are token ids (integers; the trainer counts their tokens), by
    its first sample; an iterable dataset, whose samples are not at hand, is taken not to."""
    import torch

    try:
        sample = data[0]
    except Exception:  # noqa: BLE001 (no indexing, or a dataset that fails on it: the run says so itself)
        return False
    x = sample[0] if isinstance(sample, (tuple, list)) and sample else sample
    return isinstance(x, torch.Tensor) and not x.is_floating_point()


def _length(data: Any) -> int | None:
    try:
        return len(data)
    except TypeError:  # an iterable dataset: no length
        return None


def _packing(train: Any) -> str:
    """Chat data's sentence: the examples packed, into how many sequences, and those cut."""
    from ..data.chat import EXAMPLE_WORDS
    from ..data.packing import cut_line

    words = EXAMPLE_WORDS.get(train.split.chat_kind, ("example", "examples"))
    n = len(train.packing.kept)
    line = f"{n:,} {words[0] if n == 1 else words[1]} packed into {len(train):,} sequences, loss on the replies only"
    cut = cut_line(train.packing, train.seq_len, words)
    return line + (f" ({cut})" if cut else "")


def _corpus(path: str | None) -> tuple[tuple[str, int] | None, str]:
    """A token corpus' (tokenizer, vocabulary) when its index records one, and its words: a
    prepared corpus names what it was prepared from; text `meshrun train` tokenized into its
    cache is named by the text, the cache after it."""
    if path is None:
        return None, "a token corpus"
    from ..data import INDEX
    from ..data.store import read_index

    if not os.path.isfile(os.path.join(path, INDEX)):  # flat token files (nanoGPT's train.bin)
        return None, f"{path} (token files)"
    index = read_index(path)
    identity = index.get("identity") if isinstance(index.get("identity"), dict) else {}
    paths = [p for p in identity.get("paths", []) if isinstance(p, str)]  # (the first few input files)
    files = identity.get("files") if isinstance(identity.get("files"), int) else len(paths)
    tokenizer = (str(index["tokenizer"]["name"]), int(index["tokenizer"]["vocab_size"]))
    cached = os.path.basename(os.path.dirname(os.path.normpath(path))) == "tokens" \
        and _CACHE_KEY.fullmatch(os.path.basename(os.path.normpath(path))) is not None
    if not paths:
        return tokenizer, f"{path} (prepared)"
    where = paths[0] if len(paths) == 1 else os.path.commonpath(paths)
    if cached:
        info = index.get("chat")
        kind = f"{info['kind']} records" if isinstance(info, dict) else "text"
        what = kind if files == 1 else f"{files:,} text files" if kind == "text" else f"{files:,} files of {kind}"
        return tokenizer, f"{where} ({what}, tokenized into {path})"
    return tokenizer, f"{path} (prepared from " + (where if files == 1 else f"{files:,} files in {where}") + ")"


def model_line(model: ModelFacts, n_params: int, trains: str | None = None) -> str:
    """The first line's sentence about the model; ``trains``: what of it trains, where not all
    of it does (a LoRA run's adapters: lora.describe)."""
    return f"model {model.words}, {fmt_count(n_params)} parameters" + (f"; {trains}" if trains else "")


def data_line(data: DataFacts, seq: int | None) -> str:
    """The first line's sentence about the data: where it comes from, how much of it there is
    for training and validation, its tokenizer and vocabulary, and document masking."""
    if data.train_tokens is not None:
        train, val = f"{fmt_count(data.train_tokens)} tokens", data.val_tokens and fmt_count(data.val_tokens)
    else:
        unit = f" of {seq} tokens" if data.tokens and seq else ""
        train = f"{data.train_samples:,} samples{unit}" if data.train_samples is not None else "samples"
        val = data.val_samples and f"{data.val_samples:,}"
    amount = f"{train} for training, " + (f"{val} for validation" if val else
                                          "a validation set" if data.validation and data.val_samples is None
                                          and data.val_tokens is None else "no validation set")
    parts = [f"data {data.words}: {amount}"]
    if data.tokens:
        vocab = f"vocabulary {data.vocab:,}" if data.vocab else "the model's vocabulary"
        if data.tokenizer == "bytes":
            parts.append(f"one token per byte ({vocab})")
        elif data.tokenizer:
            parts.append(f"tokenizer {data.tokenizer} ({vocab})")
        elif data.words == RANDOM_WORDS:
            parts.append(vocab)
        else:
            parts.append(f"no tokenizer recorded ({vocab})")
        parts.append(f"document masking {'on' if data.document_mask else 'off'}")
    if data.chat:
        parts.append(data.chat)
    return "; ".join(parts)
