"""A Hugging Face model directory's fingerprint: what a LoRA run records of its base model, and
checks again before an adapter is exported, merged or sampled from, so that adapters are never
put on other weights than those they were trained on.

Reading every weight would cost as long as a copy of the model (16 GB for an 8B model in
bf16), so the fingerprint is the SHA-256 of the config file's bytes and, for each weight file,
its name, its size, its safetensors header (every tensor's name, dtype, shape and offsets) and
SAMPLES blocks of SAMPLE_BYTES spread evenly over its bytes: another model of the same layout
(a fine-tune saved in place of its base) differs in every block sampled. Kilobytes are read,
not gigabytes; a copy of the directory elsewhere has the same fingerprint.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence

from ..errors import MeshrunError
from .hf import CONFIG, weight_files

SAMPLES = 16
SAMPLE_BYTES = 1 << 16
HEADER_MAX = 100 * 2**20  # safetensors' own bound on a header


def fingerprint(directory: str, files: Sequence[str] | None = None) -> str:
    """``sha256:<hex>`` of the model directory (module docstring); ``files``: the weight files
    to cover (default: those the directory's index or listing names, ``hf.weight_files``; ``()``:
    the config alone, for a model initialised from it). A file that cannot be read is one line
    naming it."""
    digest = hashlib.sha256()
    config = os.path.join(directory, CONFIG)
    try:
        with open(config, "rb") as f:
            digest.update(b"config\0" + f.read())
        for path in sorted(weight_files(directory) if files is None else files, key=os.path.basename):
            _weights(digest, path)
    except OSError as exc:
        where = exc.filename or directory
        raise MeshrunError(f"{where}: cannot be read to fingerprint the model ({exc.strerror or exc}) "
                           "(hint: check the model directory and its permissions)") from None
    return "sha256:" + digest.hexdigest()


def _weights(digest: hashlib._Hash, path: str) -> None:
    size = os.path.getsize(path)
    digest.update(f"file\0{os.path.basename(path)}\0{size}\0".encode())
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        digest.update(head + f.read(min(n, HEADER_MAX)))
        start = f.tell()
        span = max(size - start - SAMPLE_BYTES, 0)
        for i in range(SAMPLES):
            f.seek(start + span * i // max(SAMPLES - 1, 1))
            digest.update(f.read(SAMPLE_BYTES))
