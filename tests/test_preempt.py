"""Preemption, with real processes and real signals: SIGUSR1 or SIGTERM sent to `meshrun
train` (as srun, a kubelet or SkyPilot would) stops both ranks after the same step with a
committed snapshot of it and exit code 75; the same command resumes, and the losses equal an
uninterrupted run's bit for bit. And the requeue that `meshrun render slurm --requeue` writes,
run with a fake srun and scontrol."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest
from helpers import clean_env, meshrun, require, with_faults
from test_checkpoint import losses

JOB = ["--model-size", "gpt-tiny", "--seq-len", "32", "--micro-batch", "4", "--steps", "16", "--save-every", "5",
       "--log-every", "1", "--deterministic", "--lr", "3e-3", "--eval-batches", "2", "--nproc", "2"]
MESSAGE = re.compile(r"meshrun: preempted by (SIG\w+) at step (\d+); snapshot (\S+) written; "
                     r"the same command resumes it")


def logged(out_dir):
    try:
        return max(losses(out_dir))
    except (OSError, ValueError):
        return 0


def signalled(out, first, at_step, second=None, extra=(), env=None):
    """Run the job; once step ``at_step`` is logged, send ``first`` to the meshrun process,
    and ``second`` while the snapshot after it is being written (before its commit)."""
    proc = subprocess.Popen([sys.executable, "-m", "meshrun", "train", *JOB, "--out", out, *extra],
                            env=env or clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sent = []
    ckpt = os.path.join(out, "checkpoints")

    def saving_after(step):
        names = os.listdir(ckpt) if os.path.isdir(ckpt) else []
        return any(n.startswith(".tmp-step-") and int(n[len(".tmp-step-"):]) > step for n in names)

    def watch():
        end = time.monotonic() + 240
        while proc.poll() is None and time.monotonic() < end:
            if not sent and logged(out) >= at_step:
                proc.send_signal(first)
                sent.append(first)
            elif sent and second is not None and len(sent) == 1 and saving_after(at_step):
                proc.send_signal(second)
                sent.append(second)
            time.sleep(0.005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    stdout, stderr = proc.communicate(timeout=300)
    watcher.join(timeout=5)
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), sent


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    require("torch")
    out = str(tmp_path_factory.mktemp("uninterrupted"))
    res = meshrun("train", *JOB, "--out", out, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return losses(out)


def check_preempted(res, out, name, at_step):
    """Exit 75 and the message; the snapshot it names is committed, the newest, and of the
    last step logged, which is after the signal and before the end. Returns that step."""
    assert res.returncode == 75, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    found = MESSAGE.fullmatch(last)
    assert found, last
    step, path = int(found[2]), found[3]
    assert found[1] == name
    assert at_step < step < 16
    assert path == os.path.join(out, "checkpoints", f"step-{step:08d}")
    assert os.path.isfile(os.path.join(path, "COMMITTED.json"))
    assert max(n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith("step-")) == \
        os.path.basename(path)
    assert not [n for n in os.listdir(os.path.join(out, "checkpoints")) if n.startswith(".tmp-")]
    assert logged(out) == step  # both ranks stopped there: the snapshot is of the step last trained
    return step


def check_resumes(out, step, uninterrupted, extra=(), env=None):
    res = meshrun("train", *JOB, "--out", out, *extra, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert f"at step {step} " in res.stdout and "resumed from" in res.stdout
    after = losses(out)
    assert sorted(after) == list(range(1, 17))
    for s in range(1, 17):
        assert after[s] == uninterrupted[s], s  # bit for bit: the same float


def test_sigusr1_stops_at_an_agreed_step_with_a_snapshot_and_resumes_bit_for_bit(tmp_path, uninterrupted):
    out = str(tmp_path)
    res, sent = signalled(out, signal.SIGUSR1, 6)
    assert sent == [signal.SIGUSR1], res.stderr[-3000:]
    step = check_preempted(res, out, "SIGUSR1", 6)
    check_resumes(out, step, uninterrupted)


def test_sigterm_is_not_restarted_and_a_second_signal_during_the_save_changes_nothing(tmp_path, uninterrupted):
    """--max-restarts 1: a preempted job is not a crash to restart. The save is held between
    its shards and its commit (tests/faults) while a second signal arrives."""
    out = str(tmp_path)
    env = with_faults(clean_env(), save_pause=1)
    res, sent = signalled(out, signal.SIGTERM, 6, second=signal.SIGUSR1, extra=("--max-restarts", "1"), env=env)
    assert sent == [signal.SIGTERM, signal.SIGUSR1], res.stderr[-3000:]
    step = check_preempted(res, out, "SIGTERM", 6)
    assert "restart 1 of 1" not in res.stderr
    check_resumes(out, step, uninterrupted, extra=("--max-restarts", "1"), env=env)


def test_a_signal_while_meshrun_starts_is_kept_and_stops_the_first_steps(tmp_path, uninterrupted):
    """SIGUSR1 sent the moment meshrun can take it, before any worker exists (a time limit's
    warning that falls into the job's first second): meshrun keeps it, hands it to the
    workers once they handle it, and they stop after an early step with its snapshot."""
    from meshrun.launch.liveness import children
    from meshrun.launch.signals import catches

    out = str(tmp_path)
    proc = subprocess.Popen([sys.executable, "-m", "meshrun", "train", *JOB, "--out", out], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 60
    starting = False  # SIGUSR1 taken, SIGHUP not yet: before the launcher's own handlers
    while proc.poll() is None and time.monotonic() < end:
        if catches(proc.pid, signal.SIGUSR1):
            starting = not catches(proc.pid, signal.SIGHUP)
            break
        time.sleep(0.0005)
    assert starting and not children(proc.pid), "meshrun took no SIGUSR1 before it launched the job"
    proc.send_signal(signal.SIGUSR1)
    stdout, stderr = proc.communicate(timeout=300)
    step = check_preempted(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr), out, "SIGUSR1", 0)
    check_resumes(out, step, uninterrupted)


def test_the_worker_signals_reach_only_processes_that_handle_them(tmp_path):
    """meshrun sends a preemption signal to a worker once it has its handler: one that is
    still starting would die of it."""
    from meshrun.launch.liveness import children
    from meshrun.launch.signals import catches

    program = "import signal, time\nsignal.signal(signal.SIGUSR1, lambda *a: None)\nprint('ready', flush=True)\n" \
              "time.sleep(30)"
    handles = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    plain = subprocess.Popen(["sleep", "30"])
    try:
        assert handles.stdout.readline().strip() == "ready"
        assert catches(handles.pid, signal.SIGUSR1) and not catches(handles.pid, signal.SIGTERM)
        assert not catches(plain.pid, signal.SIGUSR1)
        assert {handles.pid, plain.pid} <= set(children(os.getpid()))
    finally:
        handles.kill()
        plain.kill()
        handles.wait()
        plain.wait()


# ---- the Slurm script ---------------------------------------------------------------------

FAKE = """#!/bin/sh
echo "$0 $*" >> "$CALLS"
exit ${STATUS:-0}
"""


def _script(tmp_path, *args):
    path = tmp_path / "job.sbatch"
    res = meshrun("render", "slurm", "--nodes", "2", "--time", "04:00:00", *args, "-o", str(path), "--",
                  "meshrun", "train", "--out", "/shared/run1")
    assert res.returncode == 0, res.stderr
    return path


@pytest.mark.parametrize("settled", [True, False], ids=["settled", "still-handled"])
def test_a_finished_rank_outlives_a_late_preemption_signal(settled):
    """Once a rank's run is over (its last snapshot committed), a scheduler's SIGUSR1 or SIGTERM
    that reaches it while it shuts down changes nothing. Python puts a handled signal's default
    action (the end of the process) back as it finalises; an ignored one stays ignored at the
    OS level, as an exec shows: the process that replaces the rank survives both signals once
    ``settle()`` ran, and dies of the first without it."""
    code = ("import os, sys\n"
            "from meshrun.training import preempt\n"
            "preempt.install()\n"
            + ("preempt.settle()\n" if settled else "")
            + "os.execvp('sleep', ['sleep', '3'])\n")
    proc = subprocess.Popen([sys.executable, "-c", code])
    time.sleep(1.5)  # past the exec
    proc.send_signal(signal.SIGUSR1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == (0 if settled else -signal.SIGUSR1)


def test_render_slurm_requeue_lines_and_valid_bash(tmp_path):
    path = _script(tmp_path, "--requeue")
    text = path.read_text()
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    sbatch = [line for line in text.splitlines() if line.startswith("#SBATCH")]
    assert {"#SBATCH --requeue", "#SBATCH --signal=USR1@120", "#SBATCH --open-mode=append"} <= set(sbatch)
    assert 'scontrol requeue "$SLURM_JOB_ID"' in text
    assert "#SBATCH --signal=USR1@300" in _script(tmp_path, "--requeue", "--signal-before", "300").read_text()
    plain = _script(tmp_path).read_text()
    assert "requeue" not in plain and "--signal" not in plain
    # a preempted job's nodes exit 75 a moment apart: srun lets them all end (30 s at most after
    # the first) rather than kill the later ones, which would hide the 75; without requeue a
    # node that fails ends the step at once
    srun = [line for line in text.splitlines() if line.lstrip().startswith("srun ")]
    assert srun == ["srun --nodes 2 --ntasks-per-node=1 --kill-on-bad-exit=0 --wait=30 \\"]
    assert [line for line in plain.splitlines() if line.startswith("srun ")] == [
        "srun --nodes 2 --ntasks-per-node=1 --kill-on-bad-exit=1 \\"]


@pytest.mark.parametrize("status,requeued", [(75, True), (0, False), (1, False), (137, False)])
def test_the_script_requeues_only_on_the_preempted_code(tmp_path, status, requeued):
    """The whole rendered script under bash, with srun and scontrol replaced by fakes that
    record their calls and srun exiting with ``status``."""
    path = _script(tmp_path, "--requeue")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name in ("srun", "scontrol"):
        (bin_dir / name).write_text(FAKE)
        (bin_dir / name).chmod(0o755)
    calls = tmp_path / "calls"
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "CALLS": str(calls), "SLURM_JOB_ID": "4242",
           "STATUS": str(status)}
    res = subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=30)
    lines = calls.read_text().splitlines()
    assert lines[0].startswith(f"{bin_dir}/srun --nodes 2 ") and "exec meshrun train --out /shared/run1" in lines[0]
    # (the fake scontrol exits with STATUS too: the script ends with its code after a requeue)
    assert lines[1:] == ([f"{bin_dir}/scontrol requeue 4242"] if requeued else [])
    assert res.returncode == status, res.stderr


@pytest.mark.parametrize("args,message", [
    (["--requeue", "--signal-before", "0"], "--signal-before='0': must be a positive whole number of seconds"),
    (["--requeue", "--signal-before", "2m"], "--signal-before='2m': must be a positive whole number of seconds"),
    (["--signal-before", "300"], "--signal-before=300: has no effect without --requeue (hint: add --requeue)"),
])
def test_bad_requeue_options_are_one_line(args, message):
    res = meshrun("render", "slurm", *args, "--", "meshrun", "train", "--out", "/shared/run1")
    assert res.returncode == 2
    err = res.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshrun: error: ") and message in err[0], res.stderr


def test_requeue_is_for_slurm_only():
    res = meshrun("render", "kubernetes", "--image", "i", "--requeue", "--", "meshrun", "train")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        ("meshrun: error: --requeue=True: is for Slurm jobs, not kubernetes (hint: drop it: run the same command "
         "again and meshrun train resumes from its newest snapshot)")]


def test_a_finished_launcher_outlives_a_late_preemption_signal(tmp_path):
    """The same for `meshrun train`'s own process, which every node of a Slurm step runs and
    which also gets the step's signals: once its job has ended, a late SIGUSR1 or SIGTERM
    leaves it alone (through an exec, as above: without the fix the process dies of SIGUSR1)."""
    code = ("import os, sys\n"
            f"sys.argv = ['meshrun', 'train', '--model-size', 'gpt-tiny', '--steps', '1', '--nproc', '1', "
            f"'--seq-len', '16', '--data', 'random', '--out', {str(tmp_path / 'run')!r}]\n"
            "from meshrun.cli import main\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print('EXEC', flush=True)\n"
            "os.execvp('sleep', ['sleep', '3'])\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line or line.strip() == "EXEC":
            break
    assert line.strip() == "EXEC", "the run did not end"
    time.sleep(1.0)  # past the exec
    proc.send_signal(signal.SIGUSR1)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
