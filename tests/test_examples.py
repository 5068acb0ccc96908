"""The pytorch/examples DDP tutorial's Trainer (examples/ddp_snapshot.py), the README's main job:
trains, snapshots, and resumes."""

import pytest
from helpers import example, lines, meshrun, require

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


@pytest.mark.parametrize("how", ["python", "meshrun launch", "torchrun"])
def test_trainer_in_a_user_script_runs_three_ways(how):
    import subprocess
    import sys

    from helpers import clean_env

    require("torch")
    script = example("trainer_script.py")
    if how == "python":
        argv = [sys.executable, script]
    elif how == "torchrun":
        argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", script]
    else:
        argv = [sys.executable, "-m", "meshrun", "launch", script]
    out = subprocess.run(argv, env=clean_env(), capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    world = "on 1 CPU process," if how == "python" else "on 2 CPU processes,"
    assert world in out.stdout
    final = [line for line in out.stdout.splitlines() if line.startswith("final loss")]
    assert len(final) == 1  # only rank 0 reports
    loss, val = float(final[0].split()[2].rstrip(",")), float(final[0].split()[-1])
    assert loss < 0.1 and val < 0.1


def test_seed_model_parallel_example_learns():
    require("torch")
    import subprocess
    import sys

    out = subprocess.run([sys.executable, example("model_parallel.py"), "3"], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    (row,) = lines(out.stdout, "MODELPARALLEL")
    assert float(row["last"]) < 0.05 * float(row["first"])
