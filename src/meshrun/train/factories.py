"""Build the model and data a TrainConfig names: built-in examples or the user's factories."""

from __future__ import annotations

import importlib
import os
import sys
from typing import Any, Callable

from ..errors import bad_value
from .config import TrainConfig


def load_factory(spec: str, flag: str) -> Callable[[], Any]:
    """Import ``module:attr`` (the working directory first on sys.path, like `python -m`)."""
    module_name, _, attr = spec.partition(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # ImportError, or the module itself failing to import
        raise bad_value(flag, spec, f"cannot import module {module_name!r} ({type(exc).__name__}: {exc})",
                        "run from the directory that holds it, or set PYTHONPATH") from None
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise bad_value(flag, spec, f"module {module_name!r} has no callable {attr!r}")
    return factory


def _call(spec: str, flag: str) -> Any:
    factory = load_factory(spec, flag)
    try:
        return factory()
    except Exception as exc:
        raise bad_value(flag, spec, f"the factory raised {type(exc).__name__}: {exc}".replace("\n", " ")) from None


def data_name(cfg: TrainConfig) -> str:
    return cfg.data or ("toy" if cfg.example == "toy" else "stdlib")


def build_model(cfg: TrainConfig) -> Any:
    import torch

    from .models import Toy, gpt

    torch.manual_seed(cfg.seed)  # the same initial weights on every rank
    if cfg.model:
        model = _call(cfg.model, "--model")
        if not isinstance(model, torch.nn.Module):
            raise bad_value("--model", cfg.model, f"returned {type(model).__name__}, not a torch.nn.Module")
        return model
    if cfg.example == "toy":
        return Toy()
    vocab = 256 if data_name(cfg) == "stdlib" else 50304  # bytes, or GPT-2's padded vocabulary
    auto = cfg.kernels == "auto"
    return gpt(cfg.model_size, seq_len=cfg.seq_len, vocab=vocab, n_experts=cfg.experts, fused_loss=cfg.fused_loss,
               head_loss=auto, fused_mlp="auto" if auto else False)


def build_data(cfg: TrainConfig, vocab: int | None) -> tuple[Any, Any]:
    """(train, validation); validation may be None."""
    from .data import RandomTokens, ToyRegression, stdlib_splits

    name = data_name(cfg)
    if name == "stdlib":
        return stdlib_splits(cfg.seq_len)
    if name == "random":
        return RandomTokens(1 << 20, cfg.seq_len, vocab or 50304), RandomTokens(256, cfg.seq_len, vocab or 50304)
    if name == "toy":
        return ToyRegression(2048, seed=1234), ToyRegression(256, seed=99)
    result = _call(name, "--data")
    if isinstance(result, tuple) and len(result) == 2:
        return result
    return result, None
