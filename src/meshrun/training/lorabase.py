"""What a LoRA run's snapshot records of its adapters and of the frozen model they adapt.

A LoRA run's snapshot holds the adapters and their optimizer state only (snapshot/save.py, load.py
leave the frozen parameters out); the base model comes from where the run read it. state.json's
``"lora"`` entry says which base that was and how the adapters sit on it:

    "lora": {"rank": 16, "alpha": 32.0, "dropout": 0.05,
             "target_modules": ["model.layers.0.self_attn.q_proj", ...],
             "base": {"directory": "/models/llama-3-8b" | null, "fingerprint": "sha256:<hex>",
                      "identity": "what the fingerprint covers, in words"}}

(export and generate read the adapters from the snapshot's shards under ``model.<path>.lora_A
.default.weight`` / ``lora_B``, and the spec and the base from here: snapshot/lora_record.py).

The fingerprint is modelinfo/fingerprint.py's: config.json's hash and each weight file's name,
size, safetensors header and sampled bytes, kilobytes read for a model of any size. A base that
is not read from files (meshrun's GPT, a model initialised at random, a user's factory) is named
by what makes it: the model option, the seed and, for a Hugging Face config, its fingerprint;
such a base has no files to check, export or merge onto.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from ..errors import MeshrunError
from ..modelinfo.fingerprint import fingerprint

FROM_FILES = "config.json, the weight files' names, sizes, headers and sampled bytes"


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def base_identity(cfg: Any, weight_files: tuple[str, ...] | None, name: str) -> dict[str, Any]:
    """The base model's entry: its directory and fingerprint (``weight_files``: the files the
    run reads its weights from, None where it initialises them; ``name``: what the run calls
    the model, about.ModelFacts.name: a preset, a factory, the class of a module given to a
    Trainer)."""
    directory = None
    if cfg.model and ":" not in cfg.model:
        from ..modelinfo.hf import locate

        directory = locate(cfg.model, cfg.source("model")).directory
    if directory is not None and weight_files:
        return {"directory": directory, "fingerprint": fingerprint(directory, weight_files), "identity": FROM_FILES}
    made = {"model": name, "experts": cfg.experts, "seed": cfg.seed, "init": "random"}
    if directory is not None:
        made["config"] = fingerprint(directory, ())
    return {"directory": directory, "fingerprint": _sha(json.dumps(made, sort_keys=True).encode()),
            "identity": "a random initialisation: " + ", ".join(f"{k} {v}" for k, v in made.items())}


def record(spec: Any, target_modules: list[str], base: dict[str, Any]) -> dict[str, Any]:
    """state.json's ``"lora"`` entry."""
    return {"rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout, "target_modules": target_modules,
            "base": base}


def _named(base: dict[str, Any] | None) -> str:
    if not base:
        return "no base recorded"
    where = base.get("directory") or "no directory"
    return f"{where} (fingerprint {str(base.get('fingerprint'))[:12]}: {base.get('identity')})"


def check_resume(path: str, saved: dict[str, Any] | None, current: dict[str, Any] | None) -> None:
    """Refuse, in one line, a resume that would put the snapshot's adapters on another base
    model or on another set of layers, or mix a LoRA snapshot with a run that trains every
    weight. ``saved``: the snapshot's ``"lora"`` entry; ``current``: this run's."""
    if saved is None and current is None:
        return
    if saved is None:
        raise MeshrunError(f"{path}: a snapshot of a run that trained every weight, and this run trains LoRA "
                           "adapters (hint: resume without --lora, or start the LoRA run afresh with --resume none "
                           "or another --out)")
    if current is None:
        raise MeshrunError(f"{path}: a LoRA snapshot (rank {saved.get('rank')}), and this run trains every weight "
                           f"(hint: resume with --lora {saved.get('rank')} and its options, or start afresh with "
                           "--resume none or another --out)")
    if saved.get("base", {}).get("fingerprint") != current["base"]["fingerprint"]:
        raise MeshrunError(f"{path}: its adapters were trained on {_named(saved.get('base'))}, not on this run's "
                           f"base {_named(current['base'])} (hint: resume with the model the snapshot names, or "
                           "start afresh with --resume none or another --out)")
    hint = "(hint: resume with the snapshot's --lora and --lora-targets, or start afresh with --resume none)"
    if saved.get("rank") != current["rank"]:
        raise MeshrunError(f"{path}: its adapters have rank {saved.get('rank')}, this run's {current['rank']} {hint}")
    layers = saved.get("target_modules") or []
    if layers != current["target_modules"]:
        other = next((n for n in layers if n not in current["target_modules"]), None)
        which = f" ({other} is not among this run's)" if other else ""
        raise MeshrunError(f"{path}: its adapters are on {len(layers)} layers, this run's on "
                           f"{len(current['target_modules'])}{which} {hint}")
