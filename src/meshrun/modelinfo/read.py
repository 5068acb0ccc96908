"""Read a model's shape: a preset name, a Hugging Face ``config.json`` (or its folder), or a
user's ``module:factory`` built on the meta device. Nothing is ever downloaded."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from typing import Any

from ..errors import bad_value
from .blocks import find_blocks
from .factory import load_factory
from .spec import PRESETS, ModelSpec, gpt_spec, llama_spec


def resolve_model(text: str, where: str = "--model") -> ModelSpec:
    """A preset name, a Hugging Face model directory or ``config.json``, or ``module:factory``."""
    return resolve_with_module(text, where)[0]


def resolve_with_module(text: str, where: str = "--model") -> tuple[ModelSpec, Any]:
    """``resolve_model``'s spec and the module it was read from, on the meta device (a Hugging
    Face config as transformers builds it, a ``module:factory``), for tracing; the module is
    None for a preset, or where torch or transformers is not installed."""
    from . import hf

    if text in PRESETS:
        return PRESETS[text], None
    if ":" in text and not os.path.exists(text):
        model = _factory_on_meta(text, where)
        return from_module(model, text, f"factory {text} on the meta device"), model
    if os.path.isdir(text) or text.endswith(".json") or hf.looks_like_hub_id(text):
        return _read_hf_config(hf.locate(text, where).config_path, where)
    raise bad_value(where, text, "is not a preset, a model directory, a config.json, or module:factory",
                    f"presets: {', '.join(PRESETS)}")


def _need(cfg: dict[str, Any], where: str, *keys: str) -> int:
    for key in keys:
        value = cfg.get(key)
        if value is not None:
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise bad_value(f"{where} {key}", value, "must be a positive integer")
            return value
    raise bad_value(where, "(missing)", f"has none of {', '.join(keys)}",
                    "give a decoder model's config.json (Llama, Mistral, Qwen, GPT-2, GPT-NeoX ...)")


def from_hf_config(path: str, where: str = "--model") -> ModelSpec:
    """Shape from the config's fields; the exact parameter counts from the model as transformers
    builds it on the meta device, when transformers is installed (nothing is read but the
    config, nothing is downloaded)."""
    return _read_hf_config(path, where)[0]


def _read_hf_config(path: str, where: str) -> tuple[ModelSpec, Any]:
    """from_hf_config's spec and the module it built (None without transformers or torch)."""
    try:
        with open(path) as f:
            cfg = json.load(f)
    except (OSError, ValueError) as exc:
        raise bad_value(where, path, f"cannot read it as JSON ({exc})".replace("\n", " ")) from None
    except RecursionError:  # json's parser recurses once per nesting level
        raise bad_value(where, path, "cannot read it as JSON (it nests deeper than the parser allows)",
                        "give a model's config.json") from None
    if not isinstance(cfg, dict):
        raise bad_value(where, path, "is not a JSON object")
    hidden = _need(cfg, path, "hidden_size", "n_embd", "d_model")
    layers = _need(cfg, path, "num_hidden_layers", "n_layer", "num_layers")
    heads = _need(cfg, path, "num_attention_heads", "n_head")
    vocab = _need(cfg, path, "vocab_size")
    kv_heads = cfg.get("num_key_value_heads") or heads
    act = str(cfg.get("hidden_act") or cfg.get("activation_function") or "")
    gated = act in ("silu", "swiglu") or cfg.get("model_type") in ("llama", "mistral", "qwen2", "qwen3", "gemma")
    ffn = cfg.get("intermediate_size") or cfg.get("n_inner") or 4 * hidden
    seq = cfg.get("max_position_embeddings") or cfg.get("n_positions")
    tied = bool(cfg.get("tie_word_embeddings", not gated))
    name = cfg.get("_name_or_path") or cfg.get("model_type") or os.path.basename(os.path.dirname(os.path.abspath(path)))
    if gated:
        spec = llama_spec(str(name), hidden, layers, heads, kv_heads, ffn, vocab, tied, seq)
    else:
        spec = gpt_spec(str(name), hidden, layers, heads, vocab, seq or 1024, seq, context=seq)
        spec = replace(spec, ffn=ffn)
    spec = replace(spec, source=f"config {path} (parameters counted from its shapes)", block_class=None,
                   bf16_residual=False, learned_positions=0)  # the config's table, whatever the sequence
    module = _hf_on_meta(path, where)
    if module is not None:
        total, block, cls = _count(module)
        spec = replace(spec, params=total, block_params=block, outer_params=max(0, total - layers * block),
                       block_class=cls, source=f"config {path} (transformers on the meta device)",
                       **linear_layout(module))
    return spec, module


def _hf_on_meta(path: str, where: str) -> Any:
    """The model as `meshrun train` builds it from the config, on the meta device
    (modelinfo/hf.py: the same checks, the same errors); None where transformers or torch is
    not installed."""
    import importlib.util

    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("torch") is None:
        return None
    from . import hf

    source = hf.locate(path, where)
    return hf.build_on_meta(hf.load_config(source, where), where, path)


def _adapter_path(path: str) -> bool:
    """A module or parameter path inside a low-rank adapter (PEFT's ``lora_A`` / ``lora_B``):
    not the model's own, so not counted in its shape."""
    return ".lora_A." in f".{path}." or ".lora_B." in f".{path}."


def _leaf(path: str) -> str:
    """A linear layer's name, the last part of its path; a layer PEFT gave an adapter is
    named by its wrapper (``q_proj.base_layer`` is ``q_proj``)."""
    parts = path.split(".")
    return parts[-2] if parts[-1] == "base_layer" and len(parts) > 1 else parts[-1]


def linear_layout(model: Any) -> dict[str, Any]:
    """ModelSpec's ``linears`` (out, in) and ``linear_names`` of each nn.Linear in the model's
    first block (None: no block list), and its ``outer_linears``: the ones outside the blocks
    but the output head. What float8 can convert (plan/float8.py; GPT-2's Conv1D layers, for
    one, are not among them) and what low-rank adapters can target (plan/adapters.py)."""
    import torch.nn as nn

    found = find_blocks(model)
    getter = getattr(model, "get_output_embeddings", None)
    head = getter() if callable(getter) else None
    outer = tuple((_leaf(n), m.out_features, m.in_features) for n, m in model.named_modules()
                  if isinstance(m, nn.Linear) and not _adapter_path(n) and m is not head
                  and _leaf(n) not in ("lm_head", "head")
                  and not (found and (n == found[0] or n.startswith(found[0] + "."))))
    if not found:
        return {"linears": None, "linear_names": None, "outer_linears": outer}
    inner = [(n, m) for n, m in found[1][0].named_modules() if isinstance(m, nn.Linear) and not _adapter_path(n)]
    return {"linears": tuple((m.out_features, m.in_features) for _, m in inner),
            "linear_names": tuple(_leaf(n) for n, _ in inner), "outer_linears": outer}


def _count(model: Any) -> tuple[int, int, str | None]:
    """(the model's parameters, its largest block's, the block's class), adapters left out."""
    named = {id(p): (n, p) for n, p in model.named_parameters()}.values()
    total = sum(p.numel() for n, p in named if not _adapter_path(n))
    found = find_blocks(model)
    block = max((sum(p.numel() for n, p in b.named_parameters() if not _adapter_path(n)) for b in found[1]),
                default=0) if found else 0
    return total, block, type(found[1][0]).__name__ if found else None


def _factory_on_meta(text: str, where: str) -> Any:
    import torch
    import torch.nn as nn

    factory = load_factory(text, where)
    try:
        with torch.device("meta"):
            model = factory()
    except Exception as exc:  # not a model factory (it wants arguments), or a factory that fails
        raise bad_value(where, text, f"the factory raised {type(exc).__name__}: {exc}".replace("\n", " "),
                        "give a callable that takes no arguments and returns an nn.Module") from None
    if not isinstance(model, nn.Module):
        raise bad_value(where, text, f"returned {type(model).__name__}, not an nn.Module")
    return model


def from_module(model: Any, name: str, source: str) -> ModelSpec:
    """Count a module's parameters, find its block list and read the widths from the first
    block's Linear layers (hidden = the first one's input; MLP width = the widest output; a
    gated MLP has two Linears of that width). meshrun's own GPT is read exactly."""
    import torch.nn as nn

    cfg = getattr(model, "cfg", None)
    if cfg is not None and all(hasattr(cfg, k) for k in ("d_model", "n_layers", "n_heads", "vocab", "seq_len")):
        spec = gpt_spec(name, cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.vocab, cfg.seq_len, context=cfg.seq_len)
        return replace(spec, source=source, bf16_residual=bool(getattr(cfg, "low_precision_residual", False)),
                       fused_loss=bool(getattr(cfg, "fused_loss", False)),
                       learned_positions=0)  # built: its table stays the size the factory gave it
    total, block, cls = _count(model)
    found = find_blocks(model)
    layers = len(found[1]) if found else 1
    first = found[1][0] if found else model
    linears = [m for n, m in first.named_modules() if isinstance(m, nn.Linear) and not _adapter_path(n)]
    hidden = linears[0].in_features if linears else max(1, int((total / 12) ** 0.5))
    ffn = max((m.out_features for m in linears), default=4 * hidden)
    gated = sum(1 for m in linears if m.out_features == ffn) >= 2 and ffn != 3 * hidden
    embeds = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    vocab = max((e.num_embeddings for e in embeds), default=0)
    tied = any(isinstance(m, nn.Linear) and any(m.weight is e.weight for e in embeds) for m in model.modules())
    heads = next((int(getattr(m, a)) for m in first.modules() for a in ("n_heads", "num_heads", "num_attention_heads")
                  if isinstance(getattr(m, a, None), int)), max(1, hidden // 64))
    return ModelSpec(name, total, layers, hidden, heads, heads, ffn, vocab, block or total, total - layers * block,
                     gated_mlp=gated, tied=tied, block_class=cls, **linear_layout(model),
                     source=f"{source} (activations estimated as a transformer with hidden {hidden}, MLP {ffn})")


def context_of(model: Any) -> int | None:
    """The sequence length a live model is made for: meshrun's GPT's ``cfg.seq_len``, a
    Hugging Face model's ``config.max_position_embeddings`` (or ``n_positions``); None when it
    states none."""
    for holder, keys in ((getattr(model, "cfg", None), ("seq_len",)),
                         (getattr(model, "config", None), ("max_position_embeddings", "n_positions"))):
        for key in keys:
            value = getattr(holder, key, None)
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None
