"""Misuse of `meshrun train --out`: two runs on one directory, a fresh run over another run's
snapshots, a snapshot of another run, a resume on another world size. Real processes, the
documents' toy model; each refusal is exit code 2 and one line that names the value."""

import filecmp
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
from helpers import clean_env, require
from helpers import meshrun as run_cli

pytestmark = pytest.mark.framework
TOY = ["--example", "toy", "--nproc", "1", "--log-every", "1", "--eval-batches", "1"]


def one_line_error(res):
    """The refusal: exit 2, a single stderr line, no traceback; returns the line."""
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshrun: error: "), res.stderr[-3000:]
    return lines[0]


def snapshot_files(out):
    """{relative path: bytes} of everything under OUT/checkpoints but its lock (whose text
    names the run that last held it)."""
    root = os.path.join(out, "checkpoints")
    files = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name == ".meshrun.lock":
                continue
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, root)] = f.read()
    return files


def state(snapshot):
    with open(os.path.join(snapshot, "state.json")) as f:
        return json.load(f)


def run_id(out):
    with open(os.path.join(out, "run.json")) as f:
        return json.load(f)["run_id"]


def snapshot_dirs(out):
    root = os.path.join(out, "checkpoints")
    return sorted(os.path.join(root, n) for n in os.listdir(root) if n.startswith("step-"))


@pytest.fixture(scope="module")
def contested(tmp_path_factory):
    """A toy run (snapshots at steps 3 and 6) and, while it runs, a second one on its --out:
    (OUT, the first's pid and its result, the second's result)."""
    require("torch")
    out = str(tmp_path_factory.mktemp("trained") / "out")
    first = start_train(*TOY, "--steps", "6", "--save-every", "3", "--out", out)
    try:
        wait_for_lock(out, first.pid)
        second = run_cli("train", *TOY, "--steps", "6", "--out", out, timeout=120)
        still_running = first.poll() is None
        stdout, stderr = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    assert still_running, "the first run ended before the second was refused"
    return out, first.pid, subprocess.CompletedProcess(first.args, first.returncode, stdout, stderr), second


@pytest.fixture(scope="module")
def trained(contested):
    """The first run's finished OUT: two snapshots (steps 3 and 6); tests copy it."""
    out, _, first, _ = contested
    assert first.returncode == 0, first.stderr[-3000:]
    return out


def copy_of(trained, tmp_path):
    out = str(tmp_path / "out")
    shutil.copytree(trained, out)
    return out


def wait_for_lock(out, pid, deadline_s=60.0):
    """Until OUT's lock file names ``pid`` as its holder."""
    path = os.path.join(out, ".meshrun.lock")
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        try:
            with open(path) as f:
                if json.loads(f.read() or "{}").get("pid") == pid:
                    return
        except (OSError, ValueError):
            pass
        time.sleep(0.05)
    raise AssertionError(f"{path} never named pid {pid}")


def start_train(*args, new_session=False):
    return subprocess.Popen([sys.executable, "-m", "meshrun", "train", *args], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=new_session)


# ---- one run per output directory -------------------------------------------------------

def test_a_second_run_on_the_same_out_is_refused_and_the_first_is_intact(contested, tmp_path):
    from meshrun.training.snapshot import verify

    out, pid, first, second = contested
    line = one_line_error(second)
    assert f"--out={out!r}" in line and f"pid {pid}" in line and "another meshrun train" in line, line
    assert "hint: " in line
    assert first.returncode == 0, first.stderr[-3000:]
    snaps = snapshot_dirs(out)
    assert [os.path.basename(s) for s in snaps] == ["step-00000003", "step-00000006"]
    ours = run_id(out)
    for snap in snaps:  # every snapshot whole, and the first run's
        assert verify(snap)["run_id"] == ours
    assert not [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith(".tmp")]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4, 5, 6]  # one run's records
    # (resumed by the next test's runs, in a copy)


def job_processes(out):
    """pids of the processes whose environment names OUT (torchrun, the workers)."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                if out.encode() in f.read():
                    pids.append(int(pid))
        except OSError:
            continue
    return pids


def last_step(out):
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return max(json.loads(line)["step"] for line in f)
    except (OSError, ValueError):
        return 0


def test_a_lock_left_by_a_killed_run_is_taken_over(trained, tmp_path):
    """The first test's run resumes (twice), and a SIGKILLed run's lock is taken over."""
    out = copy_of(trained, tmp_path)
    resumed = f"resumed from {out}/checkpoints/step-00000006 at step 6"
    killed = start_train(*TOY, "--steps", "100000", "--save-every", "0", "--out", out, new_session=True)
    try:
        wait_for_lock(out, killed.pid)
        end = time.monotonic() + 120
        while last_step(out) <= 6 and time.monotonic() < end:
            time.sleep(0.1)  # until the workers train (and share the lock)
    finally:
        os.killpg(killed.pid, signal.SIGKILL)  # the launcher; its watchdog ends the workers
        stdout, _ = killed.communicate(timeout=60)
    assert resumed in stdout, stdout
    end = time.monotonic() + 60
    while job_processes(out) and time.monotonic() < end:
        time.sleep(0.1)
    assert not job_processes(out)
    with open(os.path.join(out, ".meshrun.lock")) as f:
        assert json.load(f)["pid"] == killed.pid  # the file stays; its flock went with the processes
    res = run_cli("train", *TOY, "--steps", "7", "--out", out)
    assert res.returncode == 0 and resumed in res.stdout, res.stderr[-3000:]
    assert snapshot_dirs(out)[-1].endswith("step-00000007")


def test_processes_of_a_dead_launcher_still_hold_the_directory(tmp_path):
    """A training process shares the lock: OUT is not free while one outlives its launcher."""
    from meshrun.config import runlock

    out = str(tmp_path / "out")
    os.makedirs(out)
    with open(os.path.join(out, ".meshrun.lock"), "w") as f:
        json.dump({"host": os.uname().nodename, "pid": 2**22 + 1, "started": "2026-01-01T00:00:00Z"}, f)
    runlock.share(out)  # this test process stands for an orphaned worker
    try:
        line = one_line_error(run_cli("train", *TOY, "--steps", "3", "--out", out))
    finally:
        os.close(runlock._SHARED.pop())
    assert f"pid {2**22 + 1}, since 2026-01-01T00:00:00Z, gone, but training processes it started still run" in line
    assert "run.json" not in os.listdir(out)  # refused before touching OUT


# ---- --no-resume, --overwrite and run ids -------------------------------------------------

def test_no_resume_over_snapshots_is_refused_naming_them(trained, tmp_path):
    out = copy_of(trained, tmp_path)
    before = snapshot_files(out)
    line = one_line_error(run_cli("train", *TOY, "--steps", "6", "--out", out, "--no-resume"))
    assert os.path.join(out, "checkpoints") in line and "2 snapshot(s)" in line and "newest: step 6" in line, line
    assert line.startswith("meshrun: error: --no-resume: ") and "--overwrite" in line
    assert snapshot_files(out) == before  # nothing touched


def test_overwrite_moves_the_earlier_run_aside_byte_for_byte(trained, tmp_path):
    out = copy_of(trained, tmp_path)
    old_id = run_id(out)
    res = run_cli("train", *TOY, "--steps", "3", "--save-every", "3", "--out", out, "--overwrite")
    assert res.returncode == 0, res.stderr[-3000:]
    assert "--overwrite moved the earlier run's" in res.stdout and "resumed" not in res.stdout
    previous = [n for n in os.listdir(out) if n.startswith("previous-")]
    assert len(previous) == 1
    aside = os.path.join(out, previous[0])
    assert snapshot_files(aside) == snapshot_files(trained)  # every old file, byte for byte
    for name in ("metrics.jsonl", "run.json", "loss.png"):
        assert filecmp.cmp(os.path.join(trained, name), os.path.join(aside, name), shallow=False), name
    new_id = run_id(out)
    assert new_id != old_id
    assert [os.path.basename(s) for s in snapshot_dirs(out)] == ["step-00000003"]
    assert state(snapshot_dirs(out)[0])["run_id"] == new_id
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3]  # the new run's records only


def test_resuming_another_runs_snapshot_is_refused(trained, tmp_path):
    out = copy_of(trained, tmp_path)
    theirs = run_id(out)
    with open(os.path.join(out, "run.json"), "w") as f:
        json.dump({"run_id": "0" * 32}, f)
    line = one_line_error(run_cli("train", *TOY, "--steps", "8", "--out", out))
    assert f"belongs to run {theirs}" in line and f"names run {'0' * 32}" in line, line
    assert "step-00000006" in line and "hint: " in line


def test_run_ids_settled_before_launching(tmp_path):
    """prepare(): a fresh start takes a new id; a snapshot without one (older meshrun) is
    accepted; a fresh OUT resuming another directory's snapshot continues its run."""
    from meshrun.config import outdir
    from meshrun.errors import MeshrunError

    out = str(tmp_path / "out")
    snap = os.path.join(out, "checkpoints", "step-00000004")
    os.makedirs(snap)
    for name, data in (("COMMITTED.json", {}), ("state.json", {"format": 1})):
        with open(os.path.join(snap, name), "w") as f:
            json.dump(data, f)
    first = outdir.prepare(out, "auto", False)  # no run.json yet, an id-less snapshot: adopted with a new id
    assert first.resume == "auto" and run_id(out) == first.run_id
    assert outdir.prepare(out, "auto", False).run_id == first.run_id
    with pytest.raises(MeshrunError, match=r"--resume \(from env MESHRUN_RESUME\)=none: .* 1 snapshot"):
        outdir.prepare(out, "none", False, "--resume (from env MESHRUN_RESUME)")
    with pytest.raises(MeshrunError, match="--overwrite=True: starts a new run"):
        outdir.prepare(out, snap, True)
    with open(os.path.join(snap, "state.json"), "w") as f:
        json.dump({"run_id": "a" * 32}, f)
    other = str(tmp_path / "other")
    assert outdir.prepare(other, snap, False).run_id == "a" * 32  # continues that run
    assert run_id(other) == "a" * 32


# ---- resuming on another world size -------------------------------------------------------

def test_resize_keeps_the_global_batch_or_refuses(tmp_path):
    require("torch")
    out = str(tmp_path / "out")
    two = ["--example", "toy", "--log-every", "1", "--eval-batches", "1", "--micro-batch", "4"]
    res = run_cli("train", *two, "--nproc", "2", "--steps", "4", "--save-every", "4", "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "global batch of 8 samples (micro-batch 4 x 1 accumulation step x 2 data-parallel ranks)" in res.stdout, \
        res.stdout
    snap = snapshot_dirs(out)[-1]
    # Micro-batch 3 on one rank cannot make 8: refused, with sizes that fit.
    line = one_line_error(run_cli("train", *two[:-1], "3", "--nproc", "1", "--steps", "8", "--out", out))
    assert "global batch of 8 samples (micro-batch 4 x 1 x 2 data-parallel ranks)" in line, line
    assert "not a multiple of 3" in line and "--micro-batch 2 on 1 rank(s)" in line, line
    res = run_cli("train", *two, "--nproc", "1", "--steps", "6", "--out", out)
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("resuming on 1 data-parallel rank(s) instead of 2: micro-batch 4 x gradient accumulation 2 (was 4 x 1) "
            "keeps the snapshot's global batch of 8 samples") in res.stdout, res.stdout
    assert "steps 5-6 of 6, each a global batch of 8 samples (micro-batch 4 x 2 accumulation steps x 1 " \
        "data-parallel rank)" in res.stdout and f"resumed from {snap} at step 4" in res.stdout
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 3, 4, 5, 6]


@pytest.mark.parametrize("name", ["logs/rank-0.log", "metrics.jsonl", "logs", "loss.png"])
def test_a_link_out_of_out_is_refused_before_anything_starts(name, tmp_path, capsys):
    """A name the run writes in OUT that links out of OUT (its log appended, its metrics
    written, elsewhere): refused in one line before any rank starts, the target untouched."""
    from meshrun.cli import main

    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    (out / "logs").mkdir(parents=True)
    target = elsewhere / ("dir" if name == "logs" else "file")
    target.parent.mkdir()
    if name == "logs":
        (out / "logs").rmdir()
        target.mkdir()
    else:
        target.write_text("mine\n")
    (out / name).symlink_to(target)
    code = main(["train", *TOY, "--steps", "1", "--out", str(out)], env=clean_env())
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{out / name} is a link to {target}, outside OUT, where the run writes" in err[0]
    assert (target.read_text() == "mine\n") if name != "logs" else os.listdir(target) == []
    left = sorted(n for n in os.listdir(out) if n != ".meshrun.lock")  # (the lock file stays, as after any run)
    assert left == (["logs"] if name == "logs" else sorted({"logs", name.split("/")[0]}))
