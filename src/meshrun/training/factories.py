"""Build the model and data a TrainConfig names: built-in examples or the user's factories."""

from __future__ import annotations

import os
from typing import Any

from ..config import BUILTIN_DATA, TrainConfig
from ..data.sources import STDLIB_VAL_FRACTION, data_kind, stdlib_files
from ..errors import bad_value
from ..modelinfo.factory import call_factory

# The built-in data's training samples, known without building it: `meshrun train` checks a
# global batch against them before any rank starts (job/prelaunch.py)
RANDOM_SAMPLES = 1 << 20  # --data random
TOY_SAMPLES = 2048  # --data toy


def data_name(cfg: TrainConfig) -> str:
    return cfg.data or ("toy" if cfg.example == "toy" else "stdlib")


def build_model(cfg: TrainConfig) -> Any:
    """The model: a Hugging Face model directory's (parameters on the meta device, filled once
    laid out: ``pretrained_weights``), the user's factory's, or a built-in one."""
    import torch

    from .models.gpt import gpt
    from .models.toy import Toy

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    if cfg.model and ":" not in cfg.model:
        from ..modelinfo import hf

        source = hf.locate(cfg.model, cfg.source("model"))
        return hf.build_on_meta(hf.load_config(source, cfg.source("model")), cfg.source("model"), cfg.model)
    if cfg.model:
        model = call_factory(cfg.model, "--model")
        if not isinstance(model, torch.nn.Module):
            raise bad_value("--model", cfg.model, f"returned {type(model).__name__}, not a torch.nn.Module")
        return model
    if cfg.example == "toy":
        return Toy()
    vocab = 256 if data_name(cfg) == "stdlib" else corpus_vocab(cfg) or 50304  # bytes, the data's, GPT-2's padded
    auto = cfg.kernels == "auto"
    # (the fused MLP reads its layers' weights itself: a LoRA run's adapted layers run as modules)
    return gpt(cfg.model_size, seq_len=cfg.seq, vocab=vocab, n_experts=cfg.experts, fused_loss=cfg.fused_loss,
               head_loss=auto, fused_mlp="auto" if auto and cfg.lora is None else False)


def corpus_vocab(cfg: TrainConfig) -> int | None:
    """The built-in GPT's vocabulary for a prepared corpus: its tokenizer's, rounded up to a
    multiple of 64 (matmul-friendly rows; the extra ids are never seen)."""
    name = data_name(cfg)
    if name in BUILTIN_DATA or data_kind(name) != "tokens":
        return None
    from ..data.store import open_tokens

    size = open_tokens(name, cfg.data_dtype, cfg.source("data")).vocab_size
    return None if size is None else -(-size // 64) * 64


def pretrained_weights(cfg: TrainConfig) -> Any:
    """The weight files to fill a Hugging Face model from: the directory's unless --init
    random or it has none (then a random initialisation)."""
    if not cfg.model or ":" in cfg.model or cfg.init == "random":
        return None
    from ..modelinfo import hf
    from .weights import Pretrained

    source = hf.locate(cfg.model, cfg.source("model"))
    return Pretrained(source.directory, source.weight_files) if source.has_weights else None


def vocab_size(model: Any) -> int | None:
    """The number of token ids a model takes: its input embedding's rows (a Hugging Face
    model's ``get_input_embeddings()``, else its first nn.Embedding), else ``cfg.vocab``."""
    import torch.nn as nn

    from .models.hooks import ConfiguredModel

    getter = getattr(model, "get_input_embeddings", None)
    embedding = getter() if callable(getter) else None
    if not isinstance(embedding, nn.Embedding):
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
    if isinstance(embedding, nn.Embedding):
        return int(embedding.num_embeddings)
    vocab = getattr(model.cfg, "vocab", None) if isinstance(model, ConfiguredModel) else None
    return int(vocab) if isinstance(vocab, int) else None


def build_data(cfg: TrainConfig, vocab: int | None) -> tuple[Any, Any]:
    """(train, validation); validation may be None."""
    from .loader import RandomTokens, ToyRegression, stdlib_splits

    name = data_name(cfg)
    kind = None if name in BUILTIN_DATA else data_kind(name)
    if kind == "tokens":
        from .loader import corpus_splits

        return corpus_splits(name, cfg.seq, cfg.document_mask, cfg.data_dtype, vocab)
    if kind == "text":  # `meshrun train` tokenizes text into its cache before it starts the ranks
        raise bad_value(cfg.source("data"), name, "text, not tokens",
                        "meshrun data prepare it, and give that directory")
    if name == "stdlib":
        if vocab is not None and vocab < 256:
            raise bad_value(cfg.source("data"), "stdlib", f"bytes (0-255) do not fit the model's vocabulary of {vocab}",
                            "--data random, or your Dataset factory")
        return stdlib_splits(cfg.seq)
    if name == "random":
        return RandomTokens(RANDOM_SAMPLES, cfg.seq, vocab or 50304), RandomTokens(256, cfg.seq, vocab or 50304)
    if name == "toy":
        return ToyRegression(TOY_SAMPLES, seed=1234), ToyRegression(256, seed=99)
    result = call_factory(name, "--data")
    if isinstance(result, tuple) and len(result) == 2:
        return result
    return result, None


def stdlib_train_bytes() -> int:
    """The bytes of the default corpus' training split (data.stdlib_splits), from its files'
    sizes, nothing read: the files joined by newlines, less the last STDLIB_VAL_FRACTION."""
    paths = stdlib_files()
    total = sum(os.path.getsize(p) for p in paths) + max(0, len(paths) - 1)
    return int(total * (1 - STDLIB_VAL_FRACTION))
