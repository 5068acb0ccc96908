"""Snapshots altered on disk: what is read is what was hash-checked, nothing in a snapshot runs,
and an incomplete snapshot can be neither committed nor loaded. Each refusal is one line."""

import io
import json
import os
import pickle
import shutil

import pytest
from helpers import meshrun as run_cli
from helpers import require


class _Payload:
    """What an attacker plants: unpickling it runs a command that leaves the witness file."""

    def __init__(self, witness):
        self.witness = str(witness)

    def __reduce__(self):
        return (os.system, (f"touch {self.witness}",))


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One real snapshot of the toy model on 2 ranks (DDP: rank 1 holds its shards)."""
    require("torch")
    out = tmp_path_factory.mktemp("trained")
    res = run_cli("train", "--example", "toy", "--steps", "2", "--save-every", "2", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.fixture
def out(trained, tmp_path):
    """A copy of the trained run's output directory, to alter."""
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def _snap(out):
    return out / "checkpoints" / "step-00000002"


def _forge_marker(snap, *names):
    """Rewrite the marker's hashes of ``names`` (an attacker who can write the snapshot can
    write its marker), and drop the files no longer there."""
    from meshrun.training.snapshot.layout import sha256

    marker = snap / "COMMITTED.json"
    data = json.loads(marker.read_text())
    for name in names:
        if (snap / name).exists():
            data["files"][name] = sha256(str(snap / name))
        else:
            del data["files"][name]
    marker.write_text(json.dumps(data))


def _metadata(snap):
    from meshrun.training.snapshot.integrity import unpickle_metadata

    return unpickle_metadata((snap / ".metadata").read_bytes(), ".metadata")


def _torch_saved(obj):
    import torch

    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _plant_in_shard(snap, witness):
    """Append a torch.save'd payload to the shard file holding model.linear.bias, point the
    metadata's entry for that tensor at it and forge the marker: every hash matches."""
    meta = _metadata(snap)
    index = next(i for i in meta.storage_data if i.fqn == "model.linear.bias")
    info = meta.storage_data[index]
    shard = snap / info.relative_path
    data = shard.read_bytes()
    planted = _torch_saved(_Payload(witness))
    shard.write_bytes(data + planted)
    info.offset, info.length = len(data), len(planted)
    (snap / ".metadata").write_bytes(pickle.dumps(meta))
    _forge_marker(snap, info.relative_path, ".metadata")
    return shard.name


def _one_line_refusal(res, *needles):
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("meshrun: error: "), last
    for needle in needles:
        assert needle in last, last
    return last


def test_files_swapped_after_their_check_are_never_read(out, tmp_path, monkeypatch):
    """Right after each file's bytes are read and hash-checked, the file on disk is replaced by
    a planted payload (.metadata by a pickle, each shard by a torch.save'd one). The export
    still reads the verified bytes: the same weights, and the payload never runs. The stock
    DCP reader, given the swapped .metadata, would run it."""
    import importlib

    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from meshrun.training.snapshot import export, reader

    verify = importlib.import_module("meshrun.training.snapshot.integrity")
    snap = _snap(out)
    reference, _ = export.read_weights(str(snap))
    witness = tmp_path / "pwned"
    read_verified = verify.read_verified
    swapped = []

    def read_then_swap(path, name, digests):
        data = read_verified(path, name, digests)
        if name == ".metadata":
            (snap / name).write_bytes(pickle.dumps(_Payload(witness)))
        elif name.endswith(".distcp"):
            (snap / name).write_bytes(_torch_saved(_Payload(witness)))
        swapped.append(name)
        return data

    monkeypatch.setattr(verify, "read_verified", read_then_swap)  # .metadata and state.json, as checked
    monkeypatch.setattr(reader, "read_verified", read_then_swap)  # each shard, as DCP reads it
    tensors, state = export.read_weights(str(snap))
    assert ".metadata" in swapped and any(n.endswith(".distcp") for n in swapped), swapped
    assert not witness.exists()
    assert state["position"]["step"] == 2
    assert sorted(tensors) == sorted(reference)
    assert all(torch.equal(tensors[k], reference[k]) for k in reference)
    with pytest.raises(AttributeError):  # the swap itself is live: a plain pickle.load runs it (an int comes back)
        FileSystemReader(str(snap)).read_metadata()
    assert witness.exists()


def test_a_payload_in_a_shard_with_a_forged_marker_is_refused_by_export_and_resume(out, tmp_path):
    witness = tmp_path / "pwned"
    shard = _plant_in_shard(_snap(out), witness)
    res = run_cli("export", str(out / "checkpoints"), "--to", str(tmp_path / "m.safetensors"))
    _one_line_refusal(res, shard, "refused while reading it", "posix.system")
    assert not witness.exists() and not (tmp_path / "m.safetensors").exists()
    res = run_cli("train", "--example", "toy", "--steps", "4", "--out", str(out))
    _one_line_refusal(res, shard, "refused while reading it")
    assert not witness.exists()


def test_a_state_json_with_a_matching_hash_but_not_json_is_one_line(out, tmp_path):
    snap = _snap(out)
    (snap / "state.json").write_bytes(b'{"format": 1, "position": ')
    _forge_marker(snap, "state.json")
    res = run_cli("export", str(snap), "--to", str(tmp_path / "m.safetensors"))
    _one_line_refusal(res, "state.json: not a snapshot state", "checksum matches")


@pytest.mark.parametrize("name", ["__1_0.distcp", "rng-rank1.json", ".metadata"])
def test_a_snapshot_missing_a_required_file_is_refused_naming_it(out, name):
    from meshrun.errors import MeshrunError
    from meshrun.training.snapshot import verify

    snap = _snap(out)
    (snap / name).unlink()
    _forge_marker(snap, name)
    with pytest.raises(MeshrunError, match=rf"lacks \['{name}'\], which its layout requires") as err:
        verify(str(snap))
    assert "\n" not in str(err.value)


def test_a_shard_file_missing_from_the_cli_is_one_line(out, tmp_path):
    snap = _snap(out)
    (snap / "__1_0.distcp").unlink()
    _forge_marker(snap, "__1_0.distcp")
    res = run_cli("export", str(snap), "--to", str(tmp_path / "m.safetensors"))
    _one_line_refusal(res, "lacks ['__1_0.distcp']")


def _staged(snap, tmp, ranks_hashed):
    """A temporary snapshot directory as the commit sees it: the shards, RNG files and
    .metadata written, and the hash lists of the ranks in ``ranks_hashed``."""
    from meshrun.training.snapshot.layout import sha256

    tmp.mkdir()
    for path in snap.iterdir():
        if path.name not in ("COMMITTED.json", "state.json"):
            shutil.copy(path, tmp / path.name)
    for rank in ranks_hashed:
        own = [n for n in os.listdir(tmp) if n.startswith(f"__{rank}_") or n == f"rng-rank{rank}.json"]
        (tmp / f".hashes-rank{rank}.json").write_text(json.dumps({n: sha256(str(tmp / n)) for n in own}))
    return str(tmp)


def test_commit_refuses_a_snapshot_missing_a_ranks_files(out, tmp_path):
    """The marker would list what the ranks hashed: rank 1's shard and RNG file missing from
    it is refused before anything is sealed, on every rank (here a gloo world of one)."""
    import torch.distributed as dist

    from meshrun.errors import MeshrunError
    from meshrun.training.snapshot.save import _incomplete, _refuse_incomplete

    assert _incomplete(_staged(_snap(out), tmp_path / "whole", [0, 1]), 2) is None
    tmp = _staged(_snap(out), tmp_path / "partial", [0])
    assert _incomplete(tmp, 2) == "it lacks ['__1_0.distcp', 'rng-rank1.json'], which every snapshot needs"
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with pytest.raises(MeshrunError, match=r"lacks \['__1_0.distcp'\].*it is not committed"):
            _refuse_incomplete(tmp)  # a world of one needs rank 0's files, and the shards .metadata names
    finally:
        dist.destroy_process_group()
    assert not os.path.exists(os.path.join(tmp, "COMMITTED.json"))


# Put first on a job's PYTHONPATH: every rank records, through an audit hook, each open of a
# file in the snapshot TEST_READS_SNAPSHOT names and each listing of its parent directory,
# made within saves.py's restore (the resume), one JSON line each, into
# TEST_READS_LOG/rank<R>-<pid>.jsonl.
# Audit events see every open (builtins.open, io.open, os.open, pathlib) and every listing
# (os.listdir, os.scandir), whoever makes them.
_READS_HOOK = '''
import json, os, sys

_log, _snap, _rank = os.environ.get("TEST_READS_LOG"), os.environ.get("TEST_READS_SNAPSHOT"), os.environ.get("RANK")
if _log and _snap and _rank is not None:
    _root = os.path.dirname(_snap)
    _out = open(os.path.join(_log, f"rank{_rank}-{os.getpid()}.jsonl"), "a", buffering=1)

    def _where(path):
        try:
            return os.path.abspath(os.fsdecode(os.fspath(path)))
        except TypeError:  # a file descriptor
            return None

    def _in_resume():  # finding the snapshot (starting_point) or loading it (restore)
        frame = sys._getframe(2)
        while frame is not None:
            code = frame.f_code
            if code.co_name in ("starting_point", "restore") and \
                    code.co_filename.endswith(os.path.join("training", "saves.py")):
                return True
            frame = frame.f_back
        return False

    def _hook(event, args):
        if event == "open":
            path = _where(args[0])
            if path is not None and os.path.dirname(path) == _snap and _in_resume():
                _out.write(json.dumps({"open": os.path.basename(path)}) + "\\n")
        elif event in ("os.listdir", "os.scandir") and args[0] is not None:
            if _where(args[0]) == _root and _in_resume():
                _out.write(json.dumps({"list": event}) + "\\n")

    sys.addaudithook(_hook)
'''


def _recorded_reads(log):
    """{rank: (opens per file name, listings of the root while resuming)} from the hook's logs."""
    from collections import Counter

    out = {}
    for path in log.iterdir():
        rank = int(path.name[len("rank"):].split("-")[0])
        opens, listed = out.setdefault(rank, (Counter(), Counter()))
        for record in map(json.loads, path.read_text().splitlines()):
            if "open" in record:
                opens[record["open"]] += 1
            else:
                listed[record["list"]] += 1
    return out


def test_a_resume_reads_each_hashed_file_once_and_lists_the_root_once(out, tmp_path):
    """A real resume of the 2-rank DDP snapshot on 2 ranks: while restoring, each rank opens
    each shard file, .metadata, state.json and its own RNG file once (its hash checked as it
    is read), no other rank's RNG file, and lists OUT/checkpoints once to find the snapshot
    and clear partial saves. (The marker is not among the hashed files: finding the snapshot
    reads it for its step, the check for its hashes.)"""
    from helpers import clean_env

    snap = _snap(out)
    hook, log = tmp_path / "hook", tmp_path / "log"
    hook.mkdir()
    log.mkdir()
    (hook / "sitecustomize.py").write_text(_READS_HOOK)
    env = clean_env(PYTHONPATH=str(hook), TEST_READS_LOG=str(log), TEST_READS_SNAPSHOT=str(snap))
    res = run_cli("train", "--example", "toy", "--steps", "3", "--out", str(out), env=env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"resumed from {snap} at step 2" in res.stdout, res.stdout[-2000:]
    hashed = sorted(n for n in json.loads((snap / "COMMITTED.json").read_text())["files"])
    assert sum(n.endswith(".distcp") for n in hashed) == 2, hashed
    reads = _recorded_reads(log)
    assert sorted(reads) == [0, 1], reads
    for rank, (opens, listed) in reads.items():
        mine = {n: 1 for n in hashed if n.endswith(".distcp") or n in (".metadata", "state.json",
                                                                       f"rng-rank{rank}.json")}
        assert {n: c for n, c in opens.items() if n in hashed} == mine, (rank, opens)
        assert sum(listed.values()) == 1, (rank, listed)


def _damage(path):
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(("name", "nproc"), [("__1_0.distcp", "2"), ("rng-rank1.json", "2"), ("rng-rank1.json", "1")])
def test_a_damaged_file_is_refused_on_resume_in_one_line(out, name, nproc):
    """A shard (read, and hashed as it is read, by every rank), rank 1's RNG file (read by
    rank 1 alone) and, on 1 rank, that same file which no rank reads (hashed apart): each
    altered, the resume is refused in one line naming it, and nothing is saved."""
    snap = _snap(out)
    _damage(snap / name)
    res = run_cli("train", "--example", "toy", "--nproc", nproc, "--steps", "4", "--save-every", "1", "--out",
                  str(out))
    _one_line_refusal(res, f"{snap / name} does not match the checksum in its marker: truncated or altered; "
                      "refusing to load it")
    assert "resumed from" not in res.stdout
    assert sorted(os.listdir(out / "checkpoints")) == ["step-00000002"]


def test_an_export_hashes_the_files_it_does_not_read(out):
    """An export reads the shards holding the weights (each hashed as it is read), never the
    RNG files: a damaged one is refused all the same."""
    from meshrun.errors import MeshrunError
    from meshrun.training.snapshot.export import read_weights

    snap = _snap(out)
    tensors, _ = read_weights(str(snap))
    assert sorted(tensors) == ["linear.bias", "linear.weight"]
    _damage(snap / "rng-rank0.json")
    with pytest.raises(MeshrunError, match="rng-rank0.json does not match the checksum in its marker"):
        read_weights(str(snap))
