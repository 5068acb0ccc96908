"""`meshrun export`: a snapshot's weights as a Hugging Face model directory or one safetensors
file, or a LoRA run's adapter in PEFT's format (or, with --merge, merged into its base model),
written where nothing is lost: never into the run it reads, never over an existing model
without --overwrite (which moves it aside first)."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from typing import Any

from ..errors import MeshrunError, bad_value, require_packages
from ..paths import check_path_text
from .options import add_option

EXPORT_PACKAGES = ("torch", "numpy", "safetensors")


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    e = sub.add_parser("export", help="write a snapshot's weights as a Hugging Face model or one safetensors file",
                       description="Consolidate the model weights of a meshrun train snapshot (sharded or not):\n"
                                   "  hf           a Hugging Face model directory (config.json, sharded safetensors "
                                   "and their index,\n               the tokenizer's files) that "
                                   "AutoModelForCausalLM.from_pretrained loads\n"
                                   "  safetensors  one .safetensors file of the weights\n"
                                   "A snapshot of a LoRA run (--lora) is written as its adapter in PEFT's format "
                                   "(adapter_config.json,\nadapter_model.safetensors), which "
                                   "PeftModel.from_pretrained(base, DIR) loads, or with --merge as the\nbase model "
                                   "with the adapter merged into its weights; the base model must still be where "
                                   "the run\nread it, unchanged.\n\n"
                                   "examples:\n  meshrun export runs/a/checkpoints --to exported/       # the newest "
                                   "snapshot of a Hugging Face model\n"
                                   "  meshrun export runs/a/checkpoints/step-00000200 --to model.safetensors\n"
                                   "  meshrun export runs/lora/checkpoints --to adapter/          # a LoRA run: "
                                   "its adapter\n"
                                   "  meshrun export runs/lora/checkpoints --to merged/ --merge   # the base model "
                                   "with it merged",
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    e.add_argument("snapshot", help="a committed snapshot directory (OUT/checkpoints/step-N), or OUT/checkpoints")
    add_option(e, "--to", required=True, metavar="DIR|FILE", from_env=False,
               help="where to write: a directory (--format hf) or a .safetensors file")
    add_option(e, "--format", choices=("auto", "hf", "safetensors"), default="auto", from_env=False,
               help="auto (default: safetensors for a --to ending in .safetensors, else hf), hf, safetensors")
    add_option(e, "--merge", action="store_true", from_env=False,
               help="a LoRA run's snapshot: write the base model with the adapter merged into its weights (a "
                    "Hugging Face model directory) instead of the adapter")
    add_option(e, "--overwrite", action="store_true", from_env=False,
               help="when --to holds files (or is a file), move them into DIR.old-<UTC time> beside it first")
    e.set_defaults(func=cmd_export)


def cmd_export(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    check_path_text(ns.snapshot, "SNAPSHOT")
    check_path_text(ns.to, "--to")
    require_packages("export", EXPORT_PACKAGES, "torch")
    fmt = ns.format if ns.format != "auto" else "safetensors" if ns.to.endswith(".safetensors") else "hf"
    # the target is checked before the snapshot is read (reading a large one takes minutes)
    # and before torch is imported (seconds)
    _check_export_kind(ns.to, fmt)
    from ..training import snapshot

    path = ns.snapshot
    if not os.path.isfile(os.path.join(path, snapshot.MARKER)):
        found = snapshot.latest(path) if os.path.isdir(path) else None
        if found is None:
            raise bad_value("snapshot", path, "not a committed snapshot nor a directory of them")
        path = found
    _check_outside_run(ns.to, path)
    _check_export_empty(ns.to, fmt, ns.overwrite)
    from ..training.snapshot.lora_record import read_record

    checked, record = read_record(path)
    if record is not None:
        return _export_lora(ns, fmt, checked, record)
    if ns.merge:
        raise MeshrunError(f"--merge: {path} is a snapshot of a whole model, not of a LoRA run: there is no adapter "
                           "to merge (hint: leave out --merge; the export is the whole model)")
    export = snapshot.export_hf if fmt == "hf" else snapshot.export_safetensors
    n, moved = export(path, ns.to, overwrite=ns.overwrite)
    if moved:
        print(f"meshrun export: moved what was at {ns.to} aside to {moved}")
    print(f"meshrun export: {n} tensors from {path} -> {ns.to} ({fmt})")
    return 0


def _export_lora(ns: argparse.Namespace, fmt: str, checked: Any, record: Any) -> int:
    """A LoRA snapshot: its adapter in PEFT's format, or under --merge the base model with it merged,
    once the base model is found where the run read it, with the fingerprint it had then."""
    from ..training import adapters
    from ..training.snapshot.export import read_checked
    from ..training.snapshot.lora_record import check_base

    path = checked.path
    if fmt == "safetensors":
        name, value = ("--format", "safetensors") if ns.format == "safetensors" else ("--to", ns.to)
        raise bad_value(name, value, f"{path} is a snapshot of a LoRA run, exported as a directory: "
                        "its adapter in PEFT's format, or the merged model with --merge",
                        "give a directory as --to, without --format")
    base = check_base(record, path)
    weights, _ = read_checked(checked)
    if ns.merge:
        n, moved = adapters.merge(weights, record.spec, base, ns.to, overwrite=ns.overwrite)
        what = f"{n} weights of {base} merged with the rank-{record.spec.rank} adapter"
    else:
        n, moved = adapters.write_adapter(weights, record.spec, None, base, ns.to,
                                          overwrite=ns.overwrite)
        what = f"the rank-{record.spec.rank} adapter ({n} tensors) for {base}"
    if moved:
        print(f"meshrun export: moved what was at {ns.to} aside to {moved}")
    kind = "hf, merged" if ns.merge else "PEFT adapter"
    print(f"meshrun export: {what} from {path} -> {ns.to} ({kind})")
    return 0


def _check_export_kind(to: str, fmt: str) -> None:
    """A directory (or a path that can be made one) for --format hf; for safetensors, a path
    meshrun.fsio writes: a regular file, a FIFO or a device, or one that can be created."""
    from ..fsio import check_dir_target, check_file_target

    if fmt == "hf":
        if os.path.isfile(to):
            raise bad_value("--to", to, "a file; --format hf writes a directory",
                            "give a directory, or --format safetensors")
        check_dir_target(to, "--to")
    else:
        check_file_target(to, "--to")


def _check_outside_run(to: str, snapshot: str) -> None:
    """--to is outside the snapshot and the checkpoints directory holding it (a file written
    there breaks a resume's hash checks), by real path, and does not hold them either
    (--overwrite would move the run aside)."""
    real, snap = os.path.realpath(os.path.expanduser(to)), os.path.realpath(snapshot)
    guarded = os.path.dirname(snap) if os.path.basename(snap).startswith("step-") else snap
    for root, what in ((snap, "the snapshot being exported"), (guarded, "the checkpoints directory of that snapshot")):
        if _within(real, root):
            raise bad_value("--to", to, f"is inside {root}, {what}: the run's snapshots must stay as they "
                            "were committed (their hashes are checked on resume)",
                            "write the export outside the run's checkpoints directory")
    if _within(guarded, real):
        raise bad_value("--to", to, f"holds {guarded}, the checkpoints of the snapshot being exported",
                        "write the export to a directory of its own")


def _check_export_empty(to: str, fmt: str, overwrite: bool) -> None:
    """Without --overwrite, nothing is there to lose: an empty or new directory for hf, no
    regular file for safetensors (a FIFO or a device is written in place)."""
    from ..fsio import check_dir_target, check_file_target
    from ..training.snapshot.export import NONEMPTY_HINT

    if overwrite:
        return
    if fmt == "hf":
        check_dir_target(to, "--to", NONEMPTY_HINT)
    else:
        check_file_target(to, "--to", "give a new file name, or --overwrite to move the file aside first")


def _within(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)
