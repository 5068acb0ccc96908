"""A Hugging Face causal language model from a local directory or `config.json`: its config
read by transformers (nothing is ever downloaded), checked to be a causal decoder, and built
with its parameters on the meta device (no memory, no initialisation), which `meshrun plan`
reads and `meshrun train` shards and then fills (with the directory's weights, or a random
initialisation). One path for both commands, so they read the same model the same way."""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ..errors import MeshrunError, bad_value, first_line
from ..quiet import quiet_library_notices

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
# Files of a model directory that describe the model or its tokenizer: copied beside exported weights.
SIDE_FILES = ("generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
              "tokenizer.model", "vocab.json", "merges.txt", "vocab.txt", "added_tokens.json", "chat_template.jinja")
# Encoders that transformers can also build as a causal LM (``is_decoder=True``): without that
# flag their attention is bidirectional, and a causal LM would train on the future.
ENCODER_TYPES = ("bert", "roberta", "xlm-roberta", "camembert", "electra", "ernie", "rembert", "roc_bert",
                 "megatron-bert", "big_bird", "data2vec-text", "xmod", "bert-generation", "markuplm")


@dataclass(frozen=True)
class HFModel:
    """Where a Hugging Face model comes from: its directory, the config file, and the weight
    files the directory holds (empty: a config alone)."""

    directory: str
    config_path: str
    weight_files: tuple[str, ...]

    @property
    def has_weights(self) -> bool:
        return bool(self.weight_files)


def is_hf_path(text: str) -> bool:
    """A model directory (it holds config.json) or a path to a ``.json`` config."""
    return os.path.isfile(os.path.join(text, CONFIG)) or (text.endswith(".json") and os.path.isfile(text))


def looks_like_hub_id(text: str) -> bool:
    """``org/name``: what a Hugging Face Hub id looks like, when no such path exists here."""
    parts = text.split("/")
    return len(parts) == 2 and all(p and not p.startswith(".") for p in parts) and ":" not in text \
        and not os.path.exists(text)


def locate(text: str, where: str = "--model") -> HFModel:
    """The model at ``text`` (a directory or a config file), or a one-line error that says what
    is there instead: a hub id (download it first), no config, not a directory."""
    if os.path.isdir(text):
        config = os.path.join(text, CONFIG)
        if not os.path.isfile(config):
            raise bad_value(where, text, f"a directory without {CONFIG}",
                            "give a Hugging Face model directory (save_pretrained's output) or its config.json")
        directory = text
    elif text.endswith(".json") and os.path.isfile(text):
        config, directory = text, os.path.dirname(os.path.abspath(text))
    elif looks_like_hub_id(text):
        raise bad_value(where, text, "looks like a Hugging Face Hub id; meshrun never downloads",
                        f"download it first (huggingface-cli download {text} --local-dir DIR) and give DIR")
    else:
        raise bad_value(where, text, "no such file or directory", "give a model directory, a config.json, "
                        "a preset or module:factory")
    weights = weight_files(directory) if os.path.samefile(os.path.dirname(os.path.abspath(config)), directory) \
        else ()
    return HFModel(directory, config, weights)


def weight_files(directory: str) -> tuple[str, ...]:
    """The safetensors files of a model directory: those its index names (a sharded save), else
    every ``*.safetensors`` in it."""
    index = os.path.join(directory, INDEX)
    if os.path.isfile(index):
        try:
            with open(index) as f:
                names = sorted(set(json.load(f)["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as exc:
            raise bad_value("--model", index, f"is not a safetensors index ({type(exc).__name__})",
                            "save the model again with save_pretrained") from None
        missing = [n for n in names if not os.path.isfile(os.path.join(directory, n))]
        if missing:
            raise bad_value(index, missing[0], "names a weight file that is not in the directory",
                            "copy every model-*.safetensors file the index lists")
        return tuple(os.path.join(directory, n) for n in names)
    return tuple(sorted(glob.glob(os.path.join(directory, "*.safetensors"))))


HEADER_MAX = 100 * 2**20  # a safetensors header past this is not one (safetensors' own limit)


def check_weight_files(files: tuple[str, ...]) -> None:
    """Each file is whole as its safetensors header describes it: an 8-byte length, that much
    JSON, then the tensors' bytes up to the largest end offset the header names. Reads the
    headers only (kilobytes), so ``meshrun train`` refuses a truncated or foreign file before
    any rank starts, in the words the ranks' loader (weights.load_pretrained) uses."""
    for path in files:
        why = _unreadable(path)
        if why:
            raise unreadable_weights(path, why)


def unreadable_weights(path: str, why: str) -> MeshrunError:
    """The one line for a weight file that is not whole safetensors, before launch or in a rank."""
    return MeshrunError(f"{path}: cannot read it as safetensors ({why}) "
                        "(hint: copy the file again; save_pretrained writes it)")


def _unreadable(path: str) -> str | None:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if not 0 < n <= min(HEADER_MAX, size - 8):
                return f"no header: {size} bytes"
            header = json.loads(f.read(n))
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    except (ValueError, RecursionError):
        return "its header is not JSON"
    if not isinstance(header, dict):
        return "its header is not a JSON object"
    ends = []
    for key, entry in header.items():
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if key != "__metadata__" and not (isinstance(offsets, list) and len(offsets) == 2
                                          and all(isinstance(o, int) and o >= 0 for o in offsets)):
            return f"its header's entry {key[:80]!r} has no data offsets"
        if offsets:
            ends.append(offsets[1])
    end = 8 + n + max(ends, default=0)
    if end > size:
        return f"truncated: {size} bytes, its header places tensors up to byte {end}"
    return None


def load_config(model: HFModel, where: str = "--model") -> Any:
    """transformers' config of the model (local files only), checked to be a causal decoder."""
    quiet_library_notices()  # (transformers imports torchao where it is installed)
    try:
        import transformers
    except ImportError:
        raise bad_value(where, model.config_path, "a Hugging Face model needs transformers, not installed here",
                        "pip install 'meshrun[hf]'") from None
    try:
        config = transformers.AutoConfig.from_pretrained(model.config_path, local_files_only=True)
    except Exception as exc:  # an unknown model_type, a malformed file: transformers' own words
        raise bad_value(where, model.config_path, f"transformers cannot read it ({_first_line(exc)})",
                        "a config.json of an architecture this transformers knows") from None
    check_causal(config, model.config_path, where)
    check_sizes(config, model.config_path, where)
    return config


# Upper bounds on a config's sizes, each far past any published model's (Llama-3.1-405B: 126
# layers of 16,384, a vocabulary of 128,256; Llama-4-Scout: a 10M-token context): a size past
# one is a typo or a hostile file, refused before transformers spends minutes building it.
SIZE_BOUNDS = {"num_hidden_layers": 4096, "hidden_size": 1 << 17, "intermediate_size": 1 << 20,
               "num_attention_heads": 4096, "num_key_value_heads": 4096, "head_dim": 1 << 14, "vocab_size": 1 << 24,
               "max_position_embeddings": 1 << 24, "num_local_experts": 4096, "num_experts": 4096}


def check_sizes(config: Any, path: str, where: str = "--model") -> None:
    """Each of the config's sizes (SIZE_BOUNDS, read as transformers names them) is within its bound."""
    for name, bound in SIZE_BOUNDS.items():
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > bound:
            raise bad_value(where, path, f"{name} is {value}, past meshrun's bound of {bound:,} for it",
                            "check the config: no published model comes near that size")


def check_causal(config: Any, path: str, where: str = "--model") -> None:
    """A causal decoder: not an encoder-decoder, not an encoder without ``is_decoder``, and a
    type transformers maps to a causal LM."""
    kind = getattr(config, "model_type", "?")
    if getattr(config, "is_encoder_decoder", False):
        raise bad_value(where, path, f"an encoder-decoder model ({kind}); meshrun trains causal decoders",
                        "give a decoder-only model (Llama, Mistral, Qwen, Gemma, Phi, GPT-2, GPT-NeoX ...)")
    if kind in ENCODER_TYPES and not getattr(config, "is_decoder", False):
        raise bad_value(where, path, f"an encoder ({kind}): its attention sees the whole sequence, so a "
                        "causal LM head would learn from the tokens it predicts",
                        "give a decoder-only model, or set is_decoder: true in the config")
    from transformers import AutoModelForCausalLM

    mapping = getattr(AutoModelForCausalLM, "_model_mapping", None)
    if mapping is not None and type(config) not in mapping:
        raise bad_value(where, path, f"transformers has no causal-LM model for {kind}",
                        "give a decoder-only model (Llama, Mistral, Qwen, Gemma, Phi, GPT-2, GPT-NeoX ...)")


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Modules built inside get their parameters on the meta device and keep their buffers
    real: the rotary embeddings' frequencies and similar tables are computed at construction
    and not recomputed later, so they must hold values (they are small)."""
    import torch
    import torch.nn as nn

    register = nn.Module.register_parameter

    def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        register(module, name, param)
        registered = module._parameters[name]  # (param, or what a registration hook made of it)
        if param is not None and registered is not None and param.device.type != "meta":
            kind = type(registered)
            attrs = dict(registered.__dict__)
            meta = kind(registered.to("meta"), requires_grad=param.requires_grad)
            meta.__dict__.update(attrs)
            module._parameters[name] = meta

    # (a patch of the class for the duration; mypy also reads a function stored on a class as taking another self)
    nn.Module.register_parameter = on_meta  # type: ignore[method-assign, assignment]
    try:
        with torch.device("cpu"):
            yield
    finally:
        nn.Module.register_parameter = register  # type: ignore[method-assign]  # the patch undone


def is_transformers_model(model: Any) -> bool:
    """Whether ``model`` is a transformers model (it has a config with an attention switch)."""
    return hasattr(model, "config") and hasattr(model.config, "_attn_implementation")


def soft_capped(config: Any) -> bool:
    """Whether ``config``'s attention soft-caps its scores (Gemma-2's ``attn_logit_softcapping``):
    torch's SDPA has no soft-capping, and transformers 5.17 built Gemma-2 on SDPA all the same,
    which drops it without a word (a different model); 5.24 refuses SDPA for it. So such a
    model is built on eager attention, which soft-caps."""
    return getattr(config, "attn_logit_softcapping", None) is not None


def flex_for_eager(model: Any) -> bool:
    """Whether ``model`` is a Hugging Face model left on transformers' eager attention (no SDPA
    path, or soft-capped scores: ``soft_capped``) that has FlexAttention: there it trains on
    GPUs in FlexAttention, which takes the soft-capping as a score modification and sliding
    windows as block masks in one fused kernel, where eager attention writes out the (t x t)
    scores of every head."""
    config = getattr(model, "config", None)
    return (getattr(config, "_attn_implementation", None) == "eager"
            and bool(getattr(model, "_supports_flex_attn", False)))


def build_on_meta(config: Any, where: str = "--model", path: str = "") -> Any:
    """transformers' causal LM of ``config`` with its parameters on the meta device, attention
    through torch's SDPA where the architecture has it and its scores are not soft-capped."""
    import copy

    quiet_library_notices()
    import transformers

    errors = []
    for attn in ("eager",) if soft_capped(config) else ("sdpa", None, "eager"):
        try:
            with parameters_on_meta():
                kwargs = {"attn_implementation": attn} if attn else {}
                # a fresh copy each time: a refused attempt leaves its choice in the config
                # (Gemma-2 refuses SDPA, then the default kept asking for it, transformers 5.24)
                # (transformers leaves from_config unannotated)
                return transformers.AutoModelForCausalLM.from_config(  # type: ignore[no-untyped-call]
                    copy.deepcopy(config), **kwargs)
        except Exception as exc:  # an architecture without SDPA, or one transformers cannot build
            errors.append(_first_line(exc))
    raise bad_value(where, path or getattr(config, "model_type", "?"), f"transformers cannot build it ({errors[-1]})",
                    "a config this transformers version knows, with consistent sizes")


def _first_line(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {first_line(str(exc), 160)}"


def export_record(model: Any, source: str | None) -> dict[str, Any] | None:
    """What a snapshot keeps to export a Hugging Face model again (state.json's "model"): its
    config, and the directory it came from (for the tokenizer's files); None for other models."""
    config = getattr(model, "config", None)
    if config is None or not hasattr(config, "to_json_string") or not getattr(config, "model_type", None):
        return None
    return {"hf_config": json.loads(config.to_json_string(use_diff=False)),
            "source": os.path.abspath(source) if source and is_hf_path(source) else None}
