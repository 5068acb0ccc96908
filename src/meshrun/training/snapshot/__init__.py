"""Snapshots: sharded, atomic, verified, resumable on another world size.

layout.py says where they live and what commits one; save.py writes (and commits); integrity.py
checks a snapshot's integrity, reader.py reads its shards through DCP, deepspeed.py through a
DeepSpeed engine, load.py restores it into a model and optimizer; export.py consolidates the
weights into safetensors, staging.py keeps the CPU buffers of asynchronous saves.
"""

from .export import export_hf, export_safetensors
from .integrity import verify
from .layout import MARKER, Position, check_name, clear_partial, committed, entries, latest, prune, wait_pruned
from .load import load
from .save import PendingSave, begin_save, commit, save, slow_writer_advice

__all__ = ["MARKER", "PendingSave", "Position", "begin_save", "check_name", "clear_partial", "commit", "committed",
           "entries", "export_hf", "export_safetensors", "latest", "load", "prune", "save", "slow_writer_advice",
           "verify", "wait_pruned"]
