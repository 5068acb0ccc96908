"""A LoRA run's adapters written for others to use: in PEFT's own format (``adapter_config.json``
and ``adapter_model.safetensors``, which ``PeftModel.from_pretrained(base, DIR)`` loads), or
merged into a copy of the base model's weights (a whole Hugging Face model directory).

The adapters come by parameter path as the run holds them (``lora.model_state``:
``model.layers.0.self_attn.q_proj.lora_A.default.weight``); PEFT's files name them as its
``PeftModel`` does, under ``base_model.model.`` and without the adapter's name
(``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``), which is what PEFT's
own ``save_pretrained`` writes for the same model (peft 0.21).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import MeshrunError
from ..fsio import write_dir
from .lora import ADAPTER, LoraSpec, is_adapter
from .weights import clean_name

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # where PeftModel holds the model it adapts
_PATH = re.compile(r"^(?P<module>.+)\.lora_(?P<part>[AB])\.(?P<adapter>[^.]+)\.weight$")
# safetensors' names of the dtypes a merged weight may have (a quantized base is not merged)
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


@dataclass(frozen=True)
class Layer:
    """One adapted linear layer: its module path and its adapter's matrices, A (rank x in) and
    B (out x rank)."""

    module: str
    a: torch.Tensor
    b: torch.Tensor


def layers(adapters: Mapping[str, torch.Tensor], spec: LoraSpec, source: str = "the snapshot") -> list[Layer]:
    """The adapted layers, by module path, each with both matrices of the run's rank; anything
    else among ``adapters`` is one line naming it."""
    parts: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in adapters.items():
        path = clean_name(name)
        found = _PATH.match(path)
        if found is None or not is_adapter(path):
            raise MeshrunError(f"{source}: its tensor {path} is not a LoRA adapter's weight, and a LoRA run's "
                               "snapshot holds its adapters alone (hint: export it with the meshrun that wrote it)")
        if found["adapter"] != ADAPTER:
            raise MeshrunError(f"{source}: its tensor {path} belongs to adapter {found['adapter']!r}, not "
                               f"{ADAPTER!r}, the one a meshrun run trains")
        parts.setdefault(found["module"], {})[found["part"]] = tensor
    if not parts:
        raise MeshrunError(f"{source}: holds no LoRA adapter")
    out = []
    for module in sorted(parts):
        a, b = parts[module].get("A"), parts[module].get("B")
        if a is None or b is None:
            lacking = "lora_A" if a is None else "lora_B"
            raise MeshrunError(f"{source}: the layer {module} has no {lacking} (hint: export a whole snapshot)")
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != spec.rank or b.shape[1] != spec.rank:
            raise MeshrunError(f"{source}: the adapter of {module} has shapes {tuple(a.shape)} and "
                               f"{tuple(b.shape)}, not those of rank {spec.rank}")
        out.append(Layer(module, a, b))
    return out


def peft_key(module: str, part: str) -> str:
    """PEFT's name for an adapter matrix (``part``: ``A`` or ``B``) of the layer at ``module``."""
    return f"{PEFT_PREFIX}{module}.lora_{part}.weight"


def adapter_config(spec: LoraSpec, target_modules: list[str], base_model_dir: str) -> dict[str, Any]:
    """``adapter_config.json`` as PEFT writes it: ``LoraConfig(...).to_dict()`` (every field of the
    installed peft, so that its ``from_pretrained`` reads each as it expects), with sets as
    sorted lists. ``target_modules`` are the adapted layers' full paths: PEFT matches a full
    path to that layer alone."""
    from peft import LoraConfig

    # an integer alpha as PEFT writes one; another as it is (PEFT annotates int, and scales by any number)
    alpha: Any = int(spec.alpha) if float(spec.alpha).is_integer() else spec.alpha
    config = LoraConfig(r=spec.rank, lora_alpha=alpha, lora_dropout=spec.dropout, target_modules=list(target_modules),
                        bias="none", task_type="CAUSAL_LM", inference_mode=True,
                        base_model_name_or_path=os.path.abspath(base_model_dir))
    values = config.to_dict()
    return json.loads(json.dumps(values, default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))


def write_adapter(adapters: Mapping[str, torch.Tensor], spec: LoraSpec, target_modules: list[str] | None,
                  base_model_dir: str, out_dir: str, overwrite: bool = False) -> tuple[int, str | None]:
    """Write the adapters into ``out_dir`` in PEFT's format, whole or not at all (a directory
    holding files is refused, or under ``overwrite`` has them moved aside). ``target_modules``,
    when given, must be the layers the adapters are on. Returns the number of tensors written
    and where old files went."""
    from safetensors.torch import save_file

    from .snapshot.export import NONEMPTY_HINT, _io

    found = layers(adapters, spec)
    modules = [layer.module for layer in found]
    if target_modules is not None and sorted(target_modules) != modules:
        extra = sorted(set(target_modules) ^ set(modules))
        raise MeshrunError(f"the adapters and their target layers disagree on {extra[0]} "
                           "(hint: give the layers the adapters were added to)")
    tensors = {}
    for layer in found:
        tensors[peft_key(layer.module, "A")] = layer.a.detach().to("cpu").contiguous()
        tensors[peft_key(layer.module, "B")] = layer.b.detach().to("cpu").contiguous()
    config = adapter_config(spec, modules, base_model_dir)

    def fill(stage: str) -> None:
        _io(save_file, tensors, os.path.join(stage, WEIGHTS_FILE), metadata={"format": "pt"})
        with open(os.path.join(stage, CONFIG_FILE), "w") as f:
            json.dump(config, f, indent=2, sort_keys=True)
            f.write("\n")

    written = write_dir(out_dir, fill, source="--to", set_aside=overwrite, nonempty_hint=NONEMPTY_HINT)
    return len(tensors), written.moved_aside


def merge(adapters: Mapping[str, torch.Tensor], spec: LoraSpec, base_model_dir: str, out_dir: str,
          overwrite: bool = False) -> tuple[int, str | None]:
    """Write the base model with the adapters merged (``W + alpha/rank * B @ A``, computed in
    fp32 and stored in W's own dtype) as a Hugging Face model directory: the base's config, its
    weight files and their index, and its generation config and tokenizer files.

    Merging changes no tensor's name, dtype or shape, so each weight file keeps its header
    byte for byte: it is copied, then each adapted weight's bytes are overwritten in place with
    the merged values. Memory holds one weight and its adapter at a time, whatever the size of
    the model or of its files. Returns the number of weights merged and where old files went."""
    from ..modelinfo import hf
    from .snapshot.export import NONEMPTY_HINT

    found = {f"{layer.module}.weight": layer for layer in layers(adapters, spec)}
    files = hf.weight_files(base_model_dir)
    if not files:
        raise MeshrunError(f"{base_model_dir}: the base model has no safetensors weights to merge into "
                           "(hint: export the adapter alone, without --merge)")
    hf.check_weight_files(files)

    def fill(stage: str) -> None:
        merged: set[str] = set()
        for path in files:
            target = os.path.join(stage, os.path.basename(path))
            shutil.copyfile(path, target)
            merged |= _merge_file(target, path, found, spec.scale)
        missing = sorted(set(found) - merged)
        if missing:
            raise MeshrunError(f"{base_model_dir}: its weight files hold no {missing[0]}, which the adapter "
                               "changes (hint: merge with the base model the run trained on)")
        for name in (hf.CONFIG, hf.INDEX, *hf.SIDE_FILES):
            src = os.path.join(base_model_dir, name)
            if os.path.isfile(src) and not os.path.exists(os.path.join(stage, name)):
                shutil.copyfile(src, os.path.join(stage, name))

    written = write_dir(out_dir, fill, source="--to", set_aside=overwrite, nonempty_hint=NONEMPTY_HINT)
    return len(found), written.moved_aside


def _merge_file(target: str, source: str, found: Mapping[str, Layer], scale: float) -> set[str]:
    """Overwrite, in the copy ``target`` of the weight file ``source``, each adapted weight it
    holds with its merged values; returns their names."""
    with open(target, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        start = 8 + n
        done = set()
        for key, entry in header.items():
            layer = found.get(key)
            if layer is None or key == "__metadata__":
                continue
            dtype = _DTYPES.get(entry.get("dtype"))
            shape = tuple(entry.get("shape") or ())
            if dtype is None:
                raise MeshrunError(f"{source}: {key} is stored as {entry.get('dtype')}, which meshrun does not merge "
                                   "into (hint: export the adapter alone and apply it with PEFT)")
            expected = (layer.b.shape[0], layer.a.shape[1])
            if shape != expected:
                raise MeshrunError(f"{source}: {key} has shape {shape}, its adapter makes {expected} "
                                   "(hint: merge with the base model the run trained on)")
            begin, end = entry["data_offsets"]
            f.seek(start + begin)
            weight = torch.frombuffer(bytearray(f.read(end - begin)), dtype=dtype).reshape(shape)
            delta = layer.b.detach().to("cpu", torch.float32) @ layer.a.detach().to("cpu", torch.float32)
            out = (weight.to(torch.float32) + scale * delta).to(dtype).contiguous()
            f.seek(start + begin)
            f.write(out.view(torch.uint8).numpy().tobytes())
            done.add(key)
    return done
