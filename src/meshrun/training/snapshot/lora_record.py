"""What a LoRA run's snapshot records of its adapters and of the model they adapt: ``lora.json``
in the snapshot directory, listed and hashed in its marker like every file of it, with the
adapters' rank, alpha, dropout and targets, the base model's directory and its fingerprint
(modelinfo/fingerprint.py). The snapshot's model weights are the adapters alone; the base is
read from that directory, and only while its fingerprint is still the recorded one."""

from __future__ import annotations

import json
import os
from typing import Any, NamedTuple

from ...errors import MeshrunError
from ..lora import LoraSpec, is_adapter
from .integrity import Snapshot, check, read_verified

RECORD = "lora.json"


class LoraRecord(NamedTuple):
    """A LoRA snapshot's record: the spec, its targets, the base model's directory and fingerprint."""

    spec: LoraSpec
    targets: tuple[str, ...]
    base_model: str
    fingerprint: str


def holds_adapters(snapshot: Snapshot) -> bool:
    """Whether the snapshot's model weights are LoRA adapters (read from DCP's metadata, no shard)."""
    if snapshot.metadata_bytes is None:  # a DeepSpeed snapshot: a whole model's engine state
        return False
    keys = snapshot.metadata().state_dict_metadata
    return any(k.startswith("model.") and is_adapter(k[len("model."):]) for k in keys)


def lora_record(snapshot: Snapshot) -> LoraRecord | None:
    """The snapshot's ``lora.json`` (checked against its marker's checksum), or None when it has
    none; a record that is not one is one line."""
    if RECORD not in snapshot.digests:
        return None
    source = os.path.join(snapshot.path, RECORD)
    data = read_verified(snapshot.path, RECORD, snapshot.digests)
    try:
        values = json.loads(data)
        return _parse(values)
    except (ValueError, TypeError, KeyError, RecursionError):
        raise MeshrunError(f"{source}: not a LoRA record (JSON with rank, alpha, dropout, targets, base_model and "
                           "fingerprint), though its checksum matches the marker (hint: export another snapshot)"
                           ) from None


def _parse(values: Any) -> LoraRecord:
    if not isinstance(values, dict):
        raise TypeError
    rank, alpha, dropout = values["rank"], values["alpha"], values["dropout"]
    targets, base, fingerprint = values["targets"], values["base_model"], values["fingerprint"]
    numbers_ok = (isinstance(rank, int) and not isinstance(rank, bool) and rank > 0
                  and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in (alpha, dropout)))
    texts_ok = (isinstance(targets, list) and targets and all(isinstance(t, str) for t in targets)
                and isinstance(base, str) and base and isinstance(fingerprint, str) and fingerprint)
    if not (numbers_ok and texts_ok):
        raise TypeError
    spec = LoraSpec(rank, float(alpha), float(dropout), tuple(targets))
    return LoraRecord(spec, spec.targets, base, fingerprint)


def read_record(path: str) -> tuple[Snapshot, LoraRecord | None]:
    """Check the snapshot at ``path`` (marker, state.json, metadata; its shards are hashed as they
    are read) and read its LoRA record: None for a snapshot of a whole model. A snapshot whose
    weights are adapters but that has no record is one line."""
    snapshot = check(path, defer_hashes=True)
    record = lora_record(snapshot)
    if record is None and holds_adapters(snapshot):
        raise MeshrunError(f"{path}: its model weights are LoRA adapters but it has no {RECORD} naming their base "
                           "model (hint: export a snapshot written by a LoRA run of this meshrun)")
    return snapshot, record


def check_base(record: LoraRecord, where: str) -> None:
    """The base model is still where the record says, with the fingerprint recorded: else one line
    naming both (an adapter applied to other weights would be silently wrong)."""
    from ...modelinfo.fingerprint import fingerprint
    from ...modelinfo.hf import CONFIG

    base = record.base_model
    if not os.path.isfile(os.path.join(base, CONFIG)):
        raise MeshrunError(f"{where}: its base model {base} is no longer there (no {CONFIG}) "
                           "(hint: put the base model back at that path; the adapters need its weights)")
    found = fingerprint(base)
    if found != record.fingerprint:
        raise MeshrunError(f"{where}: its base model {base} has fingerprint {found[:23]}…, the run trained on "
                           f"{record.fingerprint[:23]}…: not the weights the adapters were trained on "
                           "(hint: restore the base model the run used at that path)")
