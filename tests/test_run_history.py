"""A run's directory keeps its history whole: snapshots reached through a symlink are locked by
their real path, names of the wrong kind in OUT are refused before anything starts, a renamed
snapshot is refused, a rollback moves the abandoned branch aside, a finished run run again
changes nothing, and a resume with another --steps goes on from the learning rate it had.
Real `meshrun train` processes on CPU."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from helpers import meshrun as run_cli
from helpers import require

import meshrun

TINY = ("--model-size", "gpt-tiny", "--nproc", "1", "--seq-len", "32", "--micro-batch", "2", "--data", "random")


def _train(out, *args, steps=4, save_every=2):
    return run_cli("train", *TINY, "--steps", str(steps), "--save-every", str(save_every), "--log-every", "1",
                   "--out", str(out), *args, timeout=240)


def _one_line(res, code=2):
    lines = res.stderr.strip().splitlines()
    assert res.returncode == code, res.stdout[-2000:] + res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "Traceback" not in res.stdout
    return lines[-1]


def _steps(path):
    with open(path) as f:
        return [json.loads(line)["step"] for line in f]


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A run of 4 steps with a snapshot every 2, all kept, and its files."""
    require("torch")
    out = tmp_path_factory.mktemp("finished")
    res = _train(out, "--keep-last", "0")
    assert res.returncode == 0, res.stderr[-3000:]
    return out


def _copy(src, dst):
    subprocess.run(["cp", "-a", str(src), str(dst)], check=True)
    return dst


def test_a_symlinked_checkpoints_directory_of_a_live_run_is_refused(tmp_path, finished):
    """Run B's checkpoints/ is a symlink into run A's: while A holds its directory, B is
    refused in one line naming the real directory, and A's snapshots are untouched."""
    from meshrun.config.runlock import OutputLock

    a = _copy(finished, tmp_path / "a")
    b = tmp_path / "b"
    b.mkdir()
    os.symlink(a / "checkpoints", b / "checkpoints")
    before = sorted(os.listdir(a / "checkpoints"))
    with OutputLock(str(a)) as lock:  # run A's launcher, as `meshrun train` holds it
        assert lock.snapshots_fd is not None
        line = _one_line(_train(b, steps=8))
    assert "its snapshot directory" in line and str(a / "checkpoints") in line, line
    assert sorted(os.listdir(a / "checkpoints")) == before
    assert not (b / "run.json").exists()


@pytest.mark.parametrize("name,make", [
    ("metrics.jsonl", os.mkfifo),
    ("run.json", os.mkdir),
    (".meshrun.lock", os.mkdir),
    ("checkpoints", lambda p: open(p, "w").close()),
    ("tensorboard", lambda p: open(p, "w").close()),
    ("logs/rank-0.log", os.mkfifo),
], ids=["fifo-metrics", "dir-run-json", "dir-lock", "file-checkpoints", "file-tensorboard", "fifo-rank-log"])
def test_a_name_of_the_wrong_kind_in_out_is_refused_before_the_run(tmp_path, name, make):
    (tmp_path / "logs").mkdir()
    make(str(tmp_path / name))
    line = _one_line(_train(tmp_path))
    assert line.startswith("meshrun: error: --out=") and name in line, line
    assert not any(n.startswith("rank-") and n.endswith(".log") and os.path.isfile(tmp_path / "logs" / n)
                   for n in os.listdir(tmp_path / "logs"))  # refused before any rank started


def test_overwrite_refuses_a_mount_point_in_one_line(tmp_path, finished):
    if os.geteuid() != 0:
        if os.environ.get("MESHRUN_TEST_STRICT") == "1":
            pytest.fail("mounting a tmpfs needs root")
        pytest.skip("mounting a tmpfs needs root")
    out = _copy(finished, tmp_path / "out")
    mnt = out / "checkpoints"
    subprocess.run(["rm", "-rf", str(mnt)], check=True)
    mnt.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], check=True)
    try:
        line = _one_line(_train(out, "--overwrite"))
        assert "mount point" in line and "--overwrite" in line, line
        assert (out / "metrics.jsonl").exists() and not any(n.startswith("previous-") for n in os.listdir(out))
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_renamed_snapshot_is_refused_not_trusted_by_its_name(tmp_path, finished):
    out = _copy(finished, tmp_path / "out")
    os.rename(out / "checkpoints" / "step-00000002", out / "checkpoints" / "step-00000099")
    line = _one_line(_train(out, steps=200))
    assert "its name says step 99, but its COMMITTED.json says step 2" in line, line
    line = _one_line(_train(out, "--resume", str(out / "checkpoints" / "step-00000099"), steps=200))
    assert "renamed" in line, line


def test_a_rollback_moves_the_abandoned_branch_aside(tmp_path, finished):
    """Resume step 2 while step 4 exists: step 4 and the metrics of steps 3-4 move into
    OUT/previous-*/; the new branch's snapshots are the only ones a later resume sees."""
    out = _copy(finished, tmp_path / "out")
    assert _steps(out / "metrics.jsonl") == [1, 2, 3, 4]
    res = _train(out, "--resume", str(out / "checkpoints" / "step-00000002"), steps=3, save_every=1)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "resuming step 2 rolls" in res.stdout, res.stdout
    [previous] = [n for n in os.listdir(out) if n.startswith("previous-")]
    assert os.listdir(out / previous / "checkpoints") == ["step-00000004"]
    assert _steps(out / previous / "metrics.jsonl") == [3, 4]
    assert _steps(out / "metrics.jsonl") == [1, 2, 3]
    assert sorted(n for n in os.listdir(out / "checkpoints") if n.startswith("step-")) == [
        "step-00000002", "step-00000003"]
    res = _train(out, steps=4, save_every=1)  # a plain resume continues the new branch
    assert res.returncode == 0 and "resumed from" in res.stdout and "step-00000003" in res.stdout, res.stdout


def test_a_finished_run_run_again_changes_nothing(tmp_path, finished):
    out = _copy(finished, tmp_path / "out")
    files = ("metrics.jsonl", "loss.png", "run.json")
    before = {n: (out / n).read_bytes() for n in files}
    events = sorted(os.listdir(out / "tensorboard"))
    res = _train(out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "is already at step 4 of 4; nothing to do (hint: pass a larger --steps" in res.stdout, res.stdout
    res = _train(out, steps=3)
    assert res.returncode == 0 and "already at step 4, past --steps 3; nothing to do" in res.stdout, res.stdout
    assert {n: (out / n).read_bytes() for n in files} == before
    assert sorted(os.listdir(out / "tensorboard")) == events


def test_a_resume_with_more_steps_goes_on_from_its_learning_rate(tmp_path, finished):
    """4 steps decayed the rate to its floor; --steps 6 keeps it there (never back to the
    peak), says so in one line, and torch's scheduler warning is not printed by any rank."""
    out = _copy(finished, tmp_path / "out")
    res = _train(out, steps=6)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "--steps 6 changes the learning-rate schedule, which ended at step 4" in res.stdout, res.stdout
    records = [json.loads(line) for line in open(out / "metrics.jsonl")]
    lrs = {r["step"]: r["lr"] for r in records}
    assert lrs[5] == pytest.approx(lrs[4]) and lrs[6] == pytest.approx(lrs[4])
    logs = "".join(open(out / "logs" / n).read() for n in os.listdir(out / "logs") if n.startswith("rank-"))
    assert "lr_scheduler.step()" not in logs + res.stderr


def test_the_schedule_goes_on_from_where_it_was():
    """Pieces added by a resume start at the rate reached and decay to the floor: continuous,
    never rising, at the floor at the new end; within the warmup only the length changes."""
    require("torch")
    from meshrun.training.optim import extend_schedule, lr_factor

    longer = extend_schedule(((0, 100),), 50, 200, 10)
    assert longer == ((0, 100), (50, 200))
    at = [lr_factor(s, 10, longer, 0.1) for s in range(10, 201)]
    assert at[40] == pytest.approx(lr_factor(50, 10, 100, 0.1))  # the same rate at the resumed step
    assert all(b <= a + 1e-12 for a, b in zip(at, at[1:]))
    assert at[-1] == pytest.approx(0.1) and lr_factor(120, 10, longer, 0.1) > lr_factor(120, 10, 100, 0.1)
    shorter = extend_schedule(longer, 150, 160, 10)
    assert lr_factor(160, 10, shorter, 0.1) == pytest.approx(0.1)
    assert lr_factor(150, 10, shorter, 0.1) == pytest.approx(lr_factor(150, 10, longer, 0.1))
    assert extend_schedule(((0, 100),), 5, 300, 10) == ((0, 300),)
    assert extend_schedule(longer, 70, 200, 10) == longer


def test_the_loss_curve_is_drawn_from_the_whole_metrics_file(tmp_path):
    """A step a restart logged again counts once (its latest record); a line cut short by a
    kill is skipped."""
    require("torch")
    from meshrun.training.metrics import read_records

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "loss": 3.0}\n{"step": 2, "loss": 2.5}\n{"step": 2, "loss": 2.4}\n'
                    '{"step": 3, "lo')
    assert read_records(str(path)) == [{"step": 1, "loss": 3.0}, {"step": 2, "loss": 2.4}]


def _nan_at_step_three_async(out):
    from test_checkpoint import _nan_at_step_three

    return _nan_at_step_three(out, "ddp", async_save=True)


def test_async_save_keeps_the_last_good_snapshot_when_a_step_is_not_finite(tmp_path):
    """Step 2's snapshot is still being written in the background when step 3's NaN is found
    at step 4: it is committed before the run stops, as without --async-save."""
    require("torch")
    message, finite, _, _ = meshrun.run(_nan_at_step_three_async, str(tmp_path), nproc=2, timeout_s=180)
    assert message is not None and message.startswith("non-finite loss or gradients at step 3;"), message
    assert finite
    assert sorted(n for n in os.listdir(tmp_path / "checkpoints") if n.startswith("step-")) == ["step-00000002"]
