"""A snapshot's model weights, consolidated from its shards: as one safetensors file, or as a
Hugging Face model directory that ``AutoModelForCausalLM.from_pretrained`` loads with no
meshrun installed."""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

import torch

from ...errors import MeshrunError
from ...fsio import write_dir, write_file_with
from .integrity import Snapshot, check, verify_unread
from .reader import load_shards

NONEMPTY_HINT = "give a new or empty directory, or --overwrite to move its files aside first"


def read_weights(path: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The snapshot's model weights, whole, on the CPU (one process, no process group), and its
    state.json (verified first: marker, metadata, state.json; each shard file hash-checked as
    it is read, then the files it did not read hashed: each file is read once)."""
    return read_checked(check(path, defer_hashes=True))


def read_checked(snapshot: Snapshot) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``read_weights`` of a snapshot ``check`` (with ``defer_hashes``) already verified."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    path = snapshot.path
    meta = snapshot.metadata()  # allow-listed, from the bytes check() hashed
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
          if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    if not sd:
        raise MeshrunError(f"{path}: the snapshot holds no model weights")
    import warnings

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        read = load_shards(snapshot, sd, no_dist=True)
    verify_unread(snapshot, read)
    return {k[len("model."):]: t.contiguous() for k, t in sd.items()}, snapshot.state


def export_safetensors(path: str, target: str, overwrite: bool = False) -> tuple[int, str | None]:
    """Consolidate a snapshot's model weights into one safetensors file, written through
    meshrun.fsio (whole or not at all; a file already there is moved aside under
    ``overwrite``); returns the number of tensors written and where the old file went."""
    from safetensors.torch import save_file

    tensors, _ = read_weights(path)
    metadata = {"format": "pt", "source": os.path.abspath(path)}
    written = write_file_with(target, lambda tmp: _io(save_file, tensors, tmp, metadata=metadata),
                              source="--to", set_aside=overwrite)
    return len(tensors), written.moved_aside


def _io(write: Any, *args: Any, **kwargs: Any) -> None:
    """Call a writer, turning safetensors' own error for a failed system call ("... (os error
    28)") into the OSError it stands for, so that a full disk reads as one."""
    try:
        write(*args, **kwargs)
    except OSError:
        raise
    except Exception as exc:
        found = re.search(r"os error (\d+)", str(exc))
        if found is None:
            raise
        code = int(found.group(1))
        raise OSError(code, os.strerror(code)) from None


def export_hf(path: str, target: str, max_shard_size: str = "5GB", overwrite: bool = False) -> tuple[int, str | None]:
    """A Hugging Face model directory from a snapshot of one: ``config.json`` (the weights' dtype,
    fp32 as trained, recorded in it), ``generation_config.json``, sharded safetensors with their
    index (transformers' own ``save_pretrained``, which also leaves tied weights stored once),
    and the tokenizer's files when the model's source directory still has them. The directory
    is filled whole or not at all (meshrun.fsio.write_dir); one holding files is refused, or
    under ``overwrite`` has them moved aside first, so no stale shard or index stays beside
    the new ones. Returns the number of tensors written and where the old files went."""
    from ...modelinfo import hf

    model, source, n = hf_model(path)

    def fill(stage: str) -> None:
        _io(model.save_pretrained, stage, max_shard_size=max_shard_size, safe_serialization=True)
        if source and os.path.isdir(source):
            for name in hf.SIDE_FILES:
                src = os.path.join(source, name)
                if os.path.isfile(src) and not os.path.exists(os.path.join(stage, name)):
                    shutil.copyfile(src, os.path.join(stage, name))

    written = write_dir(target, fill, source="--to", set_aside=overwrite, nonempty_hint=NONEMPTY_HINT)
    return n, written.moved_aside


def hf_model(path: str, purpose: str = "--format hf",
             not_hf_hint: str = "--format safetensors writes its weights as one file") -> tuple[Any, str | None, int]:
    """The Hugging Face model a snapshot holds, built on the CPU from its recorded config with the
    snapshot's weights (fp32, as trained): the model, the directory it was trained from (for
    its tokenizer's files; None when unknown) and the number of tensors read. ``purpose`` and
    ``not_hf_hint`` word the errors for the command that asks."""
    from ...modelinfo import hf

    tensors, state = read_weights(path)
    record = state.get("model") or {}
    if not record.get("hf_config"):
        raise MeshrunError(f"{path}: not a snapshot of a Hugging Face model (hint: {not_hf_hint})")
    try:
        import transformers
    except ImportError:
        raise MeshrunError(f"{purpose} needs transformers, not installed here (hint: pip install 'meshrun[hf]')") \
            from None
    values = dict(record["hf_config"])
    config = transformers.AutoConfig.for_model(**values)
    for key in ("dtype", "torch_dtype"):  # what the weights are: from_pretrained keeps them exactly
        if hasattr(config, key):  # (the newer name only: setting the older one warns)
            setattr(config, key, torch.float32)
            break
    with hf.parameters_on_meta():
        model = transformers.AutoModelForCausalLM.from_config(config)
    names = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    unknown = sorted(set(tensors) - names)
    if unknown:
        raise MeshrunError(f"{path}: the snapshot's tensor {unknown[0]} is not in the {config.model_type} model "
                           "its config builds (hint: export with the transformers version that trained it)")
    model.load_state_dict(tensors, strict=False, assign=True)
    model.tie_weights()
    missing = sorted(n for n, p in model.named_parameters() if p.is_meta)
    if missing:
        raise MeshrunError(f"{path}: the snapshot lacks {missing[0]} of the model")
    return model, record.get("source"), len(tensors)
