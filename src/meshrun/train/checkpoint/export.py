"""A snapshot's model weights consolidated into one safetensors file."""

from __future__ import annotations

import os

import torch
import torch.distributed.checkpoint as dcp

from ...errors import MeshrunError
from .load import SafeLoadPlanner, verify


def export_safetensors(path: str, target: str) -> int:
    """Consolidate a snapshot's model weights into one safetensors file (one process, no
    process group); returns the number of tensors written."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    verify(path)
    meta = FileSystemReader(path).read_metadata()  # safe: verify() vetted its classes
    sd = {k: torch.empty(v.size, dtype=v.properties.dtype) for k, v in meta.state_dict_metadata.items()
          if k.startswith("model.") and isinstance(v, TensorStorageMetadata)}
    if not sd:
        raise MeshrunError(f"{path}: the snapshot holds no model weights")
    import warnings

    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(sd, checkpoint_id=path, planner=SafeLoadPlanner(), no_dist=True)
    tensors = {k[len("model."):]: t.contiguous() for k, t in sd.items()}
    os.makedirs(os.path.dirname(os.path.abspath(target)), exist_ok=True)
    save_file(tensors, target, metadata={"format": "pt", "source": os.path.abspath(path)})
    return len(tensors)
