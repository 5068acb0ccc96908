"""A model built with its parameters on the meta device gets storage and values only after it
is laid out, so that no rank holds more of it than its layout needs.

``materialize`` gives every parameter storage on the device (a sharded parameter: this rank's
shard), puts back the buffers the model computed when it was built, ties again what was tied,
and then fills the parameters: from a model directory's safetensors files, each rank reading
only the slices it holds (``load_pretrained``), or with a random initialisation that does not
depend on the layout (``init_deterministic``): each module's parameters are drawn whole, from a
seed of the run's seed and the module's name, by the model's own initialiser (transformers'
``_init_weights``, else the module's ``reset_parameters``), and each rank keeps its slice. So one
process and any number of shards start from the very same weights.
"""

from __future__ import annotations

import copy
import hashlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn as nn

from ..errors import MeshrunError, first_line
from ..modelinfo.hf import unreadable_weights

# Names that wrappers put into parameter paths, which the checkpoint files do not have.
_WRAPPERS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.", "module.")


@dataclass(frozen=True)
class Pretrained:
    """The safetensors files to read a model's weights from."""

    directory: str
    files: tuple[str, ...]


def clean_name(name: str) -> str:
    """A parameter's path as the weight files name it: wrappers' parts out, and PEFT's
    ``base_layer.`` (a LoRA layer's frozen original: ``q_proj.base_layer.weight`` is the
    files' ``q_proj.weight``)."""
    for wrapper in _WRAPPERS:
        name = name.replace(wrapper, "")
    name = name.replace(".base_layer.", ".").removeprefix("base_layer.")
    return name.removesuffix(".base_layer") if name != "base_layer" else ""


def on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def _chunks(p: torch.Tensor) -> Iterator[tuple[tuple[slice, ...], torch.Tensor]]:
    """(slices of the whole tensor, the local tensor they go to) for a parameter: a DTensor's
    shard(s) on this rank, or the whole of a plain tensor."""
    if hasattr(p, "__create_chunk_list__") and hasattr(p, "to_local"):
        local = p.to_local()
        chunks = p.__create_chunk_list__()
        if local.numel() == 0 or not chunks:
            return
        for chunk in chunks:
            yield tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes)), local.view(chunk.sizes)
        return
    yield tuple(slice(0, s) for s in p.shape), p.data


def materialize(model: nn.Module, device: torch.device, seed: int, pretrained: Pretrained | None,
                log: bool = False, optional: set[str] | None = None, whole: nn.Module | None = None) -> None:
    """Storage, buffers, ties, then values (see the module's docstring); ``optional``: names
    the weight files may lack (a tied copy the caller fills); ``whole``: the model that
    ``model`` is a part of (a pipeline rank's stages), whose initialiser it takes."""
    buffers = {name: b.detach().clone() for name, b in model.named_buffers() if not b.is_meta}
    names = {id(p): name for name, p in model.named_parameters(remove_duplicate=False)}
    ties = [(name, names[id(p)]) for name, p in model.named_parameters(remove_duplicate=False)
            if names[id(p)] != name]
    model.to_empty(device=device)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in buffers:
                b.copy_(buffers[name])
    for alias, first in ties:  # to_empty gives each name its own storage: one parameter again
        owner, _, attr = alias.rpartition(".")
        target = model.get_parameter(first)
        holder = model.get_submodule(owner) if owner else model
        if getattr(holder, attr) is not target:
            setattr(holder, attr, target)
    if pretrained is not None:
        load_pretrained(model, pretrained, log, optional or set())
    else:
        init_deterministic(model, seed, getattr(whole if whole is not None else model, "_init_weights", None))


def _seed(seed: int, name: str) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{name}".encode()).digest()[:8], "little") & ((1 << 63) - 1)


def init_deterministic(model: nn.Module, seed: int, hf_init: Callable[[nn.Module], None] | None = None) -> None:
    """Each module's own parameters drawn whole by the model's initialiser (``hf_init``:
    transformers' ``_init_weights``, else the module's ``reset_parameters``), seeded by the
    module's name, and sliced into this rank's shards. A value the initialiser leaves unset
    (a parameter it does not know) is drawn from N(0, 0.02), or set to zero for a vector."""
    device = next(iter(model.parameters())).device
    done: set[int] = set()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad():
        for mod_name, module in model.named_modules():
            params = {n: p for n, p in module._parameters.items() if p is not None}
            own = {n: p for n, p in params.items() if id(p) not in done}
            if not own:
                continue
            torch.manual_seed(_seed(seed, clean_name(mod_name)))
            # every parameter of the proxy is a fresh whole tensor (one initialised already, a tied
            # one, gets a throwaway); the None entries (no bias) stay as the initialiser expects
            full = {n: torch.full(p.shape, float("nan"), dtype=p.dtype, device=device) if p.is_floating_point()
                    else torch.zeros(p.shape, dtype=p.dtype, device=device) for n, p in params.items()}
            proxy = copy.copy(module)
            proxy._parameters = {n: (nn.Parameter(full[n], requires_grad=False) if n in full else None)
                                 for n in module._parameters}
            proxy._modules = {}
            if hf_init is not None:
                hf_init(proxy)
            elif hasattr(proxy, "reset_parameters"):
                proxy.reset_parameters()
            for n, p in own.items():
                whole = proxy._parameters[n].data
                if whole.is_floating_point() and torch.isnan(whole).any():
                    whole.copy_(torch.nan_to_num(whole, nan=0.0) if whole.dim() < 2 else torch.where(
                        torch.isnan(whole), torch.randn_like(whole) * 0.02, whole))
                for slices, local in _chunks(p):
                    local.copy_(whole[slices])
                done.add(id(p))


def load_pretrained(model: nn.Module, weights: Pretrained, log: bool = False,
                    optional: set[str] | None = None) -> None:
    """Fill every parameter from the files: each rank reads, tensor by tensor, only the slices
    its shards hold (safetensors reads a slice from the file without the rest of the tensor).
    A tensor the model has and the files lack is an error; one the files have and the model
    lacks is left (buffers such as rotary frequencies, kept by some checkpoints)."""
    from safetensors import safe_open

    params: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        params.setdefault(clean_name(name), p)
    filled: set[int] = set()
    total, start = 0, time.perf_counter()
    resident = _reset_peak_rss()
    for i, path in enumerate(weights.files):
        try:
            with safe_open(path, framework="pt", device="cpu") as f, torch.no_grad():
                for key in f.keys():
                    p = params.get(key)
                    if p is None:
                        continue
                    view = f.get_slice(key)
                    shape = tuple(view.get_shape())
                    if shape != tuple(p.shape):
                        raise MeshrunError(f"{path}: {key} has shape {shape}, the model's is {tuple(p.shape)} "
                                           "(hint: the weights are not this config's; check config.json)")
                    if id(p) in filled:
                        continue
                    for slices, local in _chunks(p):
                        part = view[slices]
                        local.copy_(part)
                        total += part.numel() * part.element_size()
                    filled.add(id(p))
        except MeshrunError:
            raise
        except Exception as exc:  # a truncated or corrupt file: safetensors' own words
            said = str(exc).strip()
            raise unreadable_weights(path, f"{type(exc).__name__}: {first_line(said, 160)}"
                                     ) from None
        if log and sys.stderr.isatty():
            print(f"\rmeshrun train: weights {i + 1}/{len(weights.files)} files", end="", file=sys.stderr, flush=True)
    # (LoRA's adapters are no part of the model's files: initialised after, lora.init_adapters)
    missing = sorted(n for n, p in params.items() if id(p) not in filled and n not in (optional or set())
                     and not (".lora_A." in n or ".lora_B." in n))
    if missing:
        raise MeshrunError(f"{weights.directory}: the weight files lack {len(missing)} of the model's tensors, "
                           f"{missing[0]} first (hint: the weights are not this config's, or transformers renames "
                           "them on load for this architecture: convert them with save_pretrained)")
    if log:
        peak = _peak_rss()
        grew = f", its CPU memory peaking {(peak - resident) / 2**30:.2f} GiB above where it started" \
            if peak is not None and resident is not None else ""
        print(f"{chr(13) if sys.stderr.isatty() else ''}meshrun train: rank 0 read {total / 2**30:.2f} GiB of weights "
              f"from {len(weights.files)} file(s) in {os.path.basename(weights.directory) or '.'} in "
              f"{time.perf_counter() - start:.1f} s{grew}", file=sys.stderr, flush=True)


def _status(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            return next((int(line.split()[1]) * 1024 for line in f if line.startswith(field)), None)
    except OSError:  # not Linux
        return None


def _reset_peak_rss() -> int | None:
    """This process's resident bytes now, its peak counter reset to them (Linux's clear_refs),
    so that the peak read after loading is the loading's own."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    return _status("VmRSS:")


def _peak_rss() -> int | None:
    return _status("VmHWM:")
