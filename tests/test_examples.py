"""The seed 002 Trainer example, the README's main job: trains, snapshots, and resumes."""

import pytest

from helpers import example, meshrun, require

pytestmark = pytest.mark.framework


def test_ddp_snapshot_trains_then_resumes(tmp_path):
    require("torch")
    snap = str(tmp_path / "snapshot.pt")
    first = meshrun("launch", example("ddp_snapshot.py"), "4", "2", "--snapshot_path", snap, timeout=300)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Epoch 3 | Training snapshot saved" in first.stdout
    assert "| world 2" in first.stdout
    losses = [float(line.split("loss ")[1].split()[0]) for line in first.stdout.splitlines() if "| loss" in line]
    assert len(losses) == 4 and losses[-1] < losses[0] / 10
    second = meshrun("launch", example("ddp_snapshot.py"), "6", "2", "--snapshot_path", snap, timeout=300)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "Resuming training from snapshot at epoch 4" in second.stdout
    assert "Epoch 0 |" not in second.stdout and "Epoch 5 | Training snapshot saved" in second.stdout
    assert not (tmp_path / "snapshot.pt.tmp").exists()
