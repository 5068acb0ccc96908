"""What export and generate read of a LoRA run's snapshot: the ``"lora"`` entry of its
state.json (written by the run, lorabase.record; checked with state.json against the marker),
with the adapters' rank, alpha, dropout and layers, the base model's directory and its
fingerprint (modelinfo/fingerprint.py). The snapshot's model weights are the adapters alone; the
base is read from that directory, and only while its fingerprint is still the recorded one."""

from __future__ import annotations

import os
from typing import Any, NamedTuple

from ...errors import MeshrunError
from ..lora import LoraSpec, is_adapter
from ..lorabase import FROM_FILES
from .integrity import STATE, Snapshot, check

ENTRY = "lora"


class LoraRecord(NamedTuple):
    """A LoRA snapshot's record: the spec (its targets the adapted layers' full paths), the base
    model's directory (None for a base initialised at random), fingerprint and what that covers."""

    spec: LoraSpec
    base_model: str | None
    fingerprint: str
    identity: str


def holds_adapters(snapshot: Snapshot) -> bool:
    """Whether the snapshot's model weights are LoRA adapters (read from DCP's metadata, no shard)."""
    if snapshot.metadata_bytes is None:  # a DeepSpeed snapshot: the engine's files, no DCP metadata
        return False
    keys = snapshot.metadata().state_dict_metadata
    return any(k.startswith("model.") and is_adapter(k[len("model."):]) for k in keys)


def lora_record(snapshot: Snapshot) -> LoraRecord | None:
    """The snapshot's LoRA entry, or None when it has none; an entry that is not one is one line."""
    values = snapshot.state.get(ENTRY)
    if values is None:
        return None
    try:
        return _parse(values)
    except (ValueError, TypeError, KeyError):
        raise MeshrunError(f"{os.path.join(snapshot.path, STATE)}: its \"{ENTRY}\" entry is not a LoRA record "
                           "(rank, alpha, dropout, target_modules, base), though its checksum matches the marker "
                           "(hint: export another snapshot)") from None


def _parse(values: Any) -> LoraRecord:
    if not isinstance(values, dict) or not isinstance(values["base"], dict):
        raise TypeError
    rank, alpha, dropout, targets = values["rank"], values["alpha"], values["dropout"], values["target_modules"]
    base = values["base"]
    directory, fingerprint, identity = base.get("directory"), base["fingerprint"], base.get("identity", "")
    numbers_ok = (isinstance(rank, int) and not isinstance(rank, bool) and rank > 0
                  and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (alpha, dropout)))
    texts_ok = (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)
                and (directory is None or (isinstance(directory, str) and directory))
                and isinstance(fingerprint, str) and fingerprint and isinstance(identity, str))
    if not (numbers_ok and texts_ok):
        raise TypeError
    return LoraRecord(LoraSpec(rank, float(alpha), float(dropout), tuple(targets)), directory, fingerprint, identity)


def read_record(path: str) -> tuple[Snapshot, LoraRecord | None]:
    """Check the snapshot at ``path`` (marker, state.json, metadata; its shards are hashed as they
    are read) and read its LoRA record: None for a snapshot of a whole model. A snapshot whose
    weights are adapters but whose state.json names no base is one line."""
    snapshot = check(path, defer_hashes=True)
    record = lora_record(snapshot)
    if record is None and holds_adapters(snapshot):
        raise MeshrunError(f"{path}: its model weights are LoRA adapters but its {STATE} names no base model "
                           "(hint: export a snapshot written by a LoRA run of this meshrun)")
    return snapshot, record


def check_base(record: LoraRecord, where: str) -> str:
    """The base model's directory, once it is found where the record says with the fingerprint
    recorded: else one line naming both (an adapter applied to other weights would be silently
    wrong). A base initialised at random has no files to find: one line too."""
    from ...modelinfo.fingerprint import fingerprint
    from ...modelinfo.hf import CONFIG

    base = record.base_model
    if base is None or record.identity != FROM_FILES:
        raise MeshrunError(f"{where}: its adapters were trained on a base model not read from files "
                           f"({record.identity or 'none recorded'}): there are no weights to put them on "
                           "(hint: train the adapters on a model directory with pretrained weights, --model DIR)")
    if not os.path.isfile(os.path.join(base, CONFIG)):
        raise MeshrunError(f"{where}: its base model {base} is no longer there (no {CONFIG}) "
                           "(hint: put the base model back at that path; the adapters need its weights)")
    found = fingerprint(base)
    if found != record.fingerprint:
        raise MeshrunError(f"{where}: its base model {base} has fingerprint {found[:23]}…, the run trained on "
                           f"{record.fingerprint[:23]}…: not the weights the adapters were trained on "
                           "(hint: restore the base model the run used at that path)")
    return base
