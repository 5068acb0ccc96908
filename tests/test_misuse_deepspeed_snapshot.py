"""A DeepSpeed snapshot altered on disk: DeepSpeed's own files inside it are read once,
hash-checked and unpickled weights-only with an allow-list of DeepSpeed's few classes, so a
planted pickle with a forged marker is refused in one line and never runs; a DeepSpeed
engine built otherwise than meshrun relies on is refused before anything is read."""

import json
import os
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


STEP2 = os.path.join("checkpoints", "step-00000002")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """One real ZeRO-2 snapshot of the toy model at step 2, on 1 rank."""
    require("deepspeed")
    out = tmp_path_factory.mktemp("zero2")
    res = run_cli("train", "--strategy", "zero2", "--nproc", "1", "--example", "toy", "--steps", "2",
                  "--save-every", "2", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    assert (out / STEP2 / "deepspeed").is_dir()
    return out


@pytest.fixture
def out(trained, tmp_path):
    """A copy of the trained run's output directory, to alter."""
    copy = tmp_path / "run"
    shutil.copytree(trained, copy)
    return copy


def _resume(out, steps=3):
    return run_cli("train", "--strategy", "zero2", "--nproc", "1", "--example", "toy", "--steps", str(steps),
                   "--out", str(out), "--resume", str(out / STEP2))


def _plant(snap, name, witness):
    """Add a payload to DeepSpeed's file ``name`` (its own dict, re-saved with torch.save) and
    rewrite the marker's hash of it: every hash matches."""
    import torch

    from meshrun.training.snapshot.layout import sha256

    path = snap / name
    state = torch.load(path, weights_only=False)  # (the file as DeepSpeed wrote it, before the plant)
    state["planted"] = _Payload(witness)
    torch.save(state, path)
    marker = snap / "COMMITTED.json"
    data = json.loads(marker.read_text())
    data["files"][name] = sha256(str(path))
    marker.write_text(json.dumps(data))
    return str(path)


def test_a_deepspeed_snapshot_resumes(out):
    res = _resume(out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resumed from" in res.stderr + res.stdout
    assert (out / "checkpoints" / "step-00000003" / "COMMITTED.json").is_file()


@pytest.mark.parametrize("name", ["deepspeed/mp_rank_00_model_states.pt",
                                  "deepspeed/zero_pp_rank_0_mp_rank_00_optim_states.pt"],
                         ids=["model_states", "optim_states"])
def test_a_payload_in_a_deepspeed_file_with_a_forged_marker_is_refused(out, tmp_path, name):
    witness = tmp_path / "pwned"
    planted = _plant(out / STEP2, name, witness)
    res = _resume(out)
    assert res.returncode == 2, res.stderr[-3000:]
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("meshrun: error: "), last
    assert planted in last and "refused while reading it" in last and "posix.system" in last, last
    assert not witness.exists()
    # the plant is live: DeepSpeed's stock checkpoint engine (weights_only=False) runs it
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
        TorchCheckpointEngine,
    )

    TorchCheckpointEngine().load(planted, map_location="cpu")
    assert witness.exists()


class _Engine:
    """Just enough of a DeepSpeed engine for load_deepspeed's checks; its load_checkpoint
    reads the planted file itself with weights_only=False, around the checkpoint engine."""

    def __init__(self, checkpoint_engine, planted):
        self.checkpoint_engine, self.planted = checkpoint_engine, planted

    def load_universal_checkpoint(self):
        return False

    def zero_nvme_offload_optimizer(self):
        return False

    def load_checkpoint(self, *args, **kwargs):
        import torch

        torch.load(self.planted, weights_only=False)
        return "loaded", {}


def test_deepspeed_reading_around_its_checkpoint_engine_is_refused(out, tmp_path):
    """An engine that holds another checkpoint engine is refused before any read; one that
    reads a file itself with weights_only=False gets weights-only and a one-line refusal."""
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import (
        TorchCheckpointEngine,
    )

    from meshrun.errors import MeshrunError
    from meshrun.training.snapshot.deepspeed import load_deepspeed
    from meshrun.training.snapshot.integrity import check

    witness = tmp_path / "pwned"
    planted = _plant(out / STEP2, "deepspeed/mp_rank_00_model_states.pt", witness)
    forced = os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD")
    snapshot = check(str(out / STEP2))
    with pytest.raises(MeshrunError, match="not the TorchCheckpointEngine"):
        load_deepspeed(snapshot, _Engine(object(), planted))
    inner = TorchCheckpointEngine()
    engine = _Engine(inner, planted)
    with pytest.raises(MeshrunError, match="around meshrun's verified reader") as refused:
        load_deepspeed(snapshot, engine)
    assert "\n" not in str(refused.value)
    assert not witness.exists()
    assert engine.checkpoint_engine is inner  # (put back for the engine's own saves)
    assert os.environ.get("TORCH_FORCE_WEIGHTS_ONLY_LOAD") == forced
