"""The job never outlives its launcher: meshrun killed by SIGKILL takes torchrun and every worker
with it (also across its restart loop), and a SIGUSR1 to `meshrun launch` reaches the user's
workers without killing torchrun. Real processes, found through /proc by a variable that every
process of the job inherits from the meshrun the test starts."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import clean_env, marked_pids, require, wait_for

pytestmark = [pytest.mark.framework,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]
HERE = os.path.dirname(__file__)
MARK = "MISUSE_TEST_JOB"
TRAIN = ["train", "--nproc", "2", "--model-size", "gpt-tiny", "--seq-len", "32", "--micro-batch", "4",
         "--steps", "200", "--save-every", "5", "--log-every", "1", "--eval-batches", "1",
         "--data", "userpkg.factories:slow_tokens"]
SLEEPER = """import os, signal, sys, time
out = sys.argv[1]
rank = os.environ["RANK"]
signal.signal(signal.SIGUSR1, lambda *a: open(os.path.join(out, "usr1." + rank), "w").close())
with open(os.path.join(out, "pid." + rank), "w") as f:
    f.write(str(os.getpid()))
while True:
    time.sleep(0.1)
"""


def job_pids(tag: str) -> list[int]:
    """Live processes (zombies left out) whose environment holds MARK=tag."""
    return marked_pids(MARK, tag)


def cmdline(pid: int) -> bytes:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def workers_of(tag: str) -> list[int]:
    return [p for p in job_pids(tag) if b"meshrun.training.worker" in cmdline(p) and b"torchrun" not in cmdline(p)]


def last_step(out: str) -> int:
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return max((json.loads(line).get("step", -1) for line in f if line.strip()), default=-1)
    except (OSError, ValueError):
        return -1


def outputs(out: str) -> tuple[list[str], int]:
    """(everything under the checkpoint directory, lines in metrics.jsonl)."""
    found = sorted(os.path.relpath(os.path.join(d, n), out)
                   for d, dirs, files in os.walk(os.path.join(out, "checkpoints")) for n in dirs + files)
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return found, sum(1 for _ in f)
    except OSError:
        return found, 0


def start(tmp_path, *args: str, **env: str) -> subprocess.Popen:
    with open(tmp_path / "meshrun.log", "w") as f:  # a file, not a pipe: a process left behind keeps a pipe open
        return subprocess.Popen([sys.executable, "-m", "meshrun", *args],
                                env=clean_env(PYTHONPATH=HERE, **{MARK: str(tmp_path)}, **env),
                                stdout=f, stderr=subprocess.STDOUT)


def log(tmp_path) -> str:
    return (tmp_path / "meshrun.log").read_text()[-3000:]


def cleanup(proc: subprocess.Popen, tag: str) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
    for pid in job_pids(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def kill_and_check(proc: subprocess.Popen, tmp_path, out: str | None) -> None:
    """SIGKILL meshrun alone; within 10 s no process of the job is left, and (``out``) no
    snapshot or metrics line appears in the 3 s after."""
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    tag = str(tmp_path)
    assert wait_for(lambda: not job_pids(tag), 10), \
        [cmdline(p).replace(b"\0", b" ")[:200] for p in job_pids(tag)]
    if out is not None:
        before = outputs(out)
        time.sleep(3)
        assert outputs(out) == before


def test_sigkill_of_meshrun_train_ends_the_workers(tmp_path):
    """One node: meshrun starts the ranks itself (no torchrun between); SIGKILL of meshrun
    ends them all and no snapshot appears afterwards."""
    require("torch")
    out = str(tmp_path / "run")
    proc = start(tmp_path, *TRAIN, "--out", out, USERPKG_ITEM_DELAY_S="0.02")
    try:
        assert wait_for(lambda: last_step(out) >= 3 or proc.poll() is not None, 60), log(tmp_path)
        assert proc.poll() is None, log(tmp_path)
        pids = job_pids(str(tmp_path))
        assert not any(b"torchrun" in cmdline(p) for p in pids), pids
        assert len(workers_of(str(tmp_path))) == 2, pids
        kill_and_check(proc, tmp_path, out)
    finally:
        cleanup(proc, str(tmp_path))


def test_sigkill_during_a_restarted_attempt_ends_that_attempt_too(tmp_path):
    """A worker killed once the job runs makes meshrun restart it (--max-restarts 1); meshrun
    killed while the restarted attempt trains leaves nothing of it behind."""
    require("torch")
    out = str(tmp_path / "run")
    proc = start(tmp_path, *TRAIN, "--out", out, "--max-restarts", "1", USERPKG_ITEM_DELAY_S="0.02")
    tag = str(tmp_path)
    try:
        assert wait_for(lambda: last_step(out) >= 3 or proc.poll() is not None, 60), log(tmp_path)
        first = workers_of(tag)
        assert len(first) == 2, log(tmp_path)
        os.kill(max(first), signal.SIGKILL)
        step = last_step(out)

        def restarted() -> bool:
            workers = workers_of(tag)
            return len(workers) == 2 and not set(workers) & set(first) and last_step(out) > step

        assert wait_for(lambda: restarted() or proc.poll() is not None, 60), log(tmp_path)
        assert proc.poll() is None and "restart 1 of 1" in log(tmp_path), log(tmp_path)
        kill_and_check(proc, tmp_path, out)
    finally:
        cleanup(proc, tag)


def _launch_sleepers(tmp_path) -> tuple[subprocess.Popen, list[int]]:
    script = tmp_path / "sleeper.py"
    script.write_text(SLEEPER)
    proc = start(tmp_path, "launch", "--nproc", "2", str(script), str(tmp_path))
    pid_files = [tmp_path / "pid.0", tmp_path / "pid.1"]
    assert wait_for(lambda: all(p.exists() and p.read_text() for p in pid_files) or proc.poll() is not None, 60), \
        log(tmp_path)
    assert proc.poll() is None, log(tmp_path)
    return proc, [int(p.read_text()) for p in pid_files]


def test_sigkill_of_meshrun_launch_ends_the_user_workers(tmp_path):
    require("torch")
    proc, workers = _launch_sleepers(tmp_path)
    try:
        assert set(workers) <= set(job_pids(str(tmp_path)))
        kill_and_check(proc, tmp_path, None)
    finally:
        cleanup(proc, str(tmp_path))


def test_sigusr1_to_meshrun_launch_reaches_the_workers_and_torchrun_survives(tmp_path):
    require("torch")
    proc, workers = _launch_sleepers(tmp_path)
    tag = str(tmp_path)
    try:
        torchrun = [p for p in job_pids(tag) if b"torchrun" in cmdline(p)]
        assert len(torchrun) == 1
        proc.send_signal(signal.SIGUSR1)
        assert wait_for(lambda: (tmp_path / "usr1.0").exists() and (tmp_path / "usr1.1").exists(), 10), log(tmp_path)
        time.sleep(1)
        assert proc.poll() is None, log(tmp_path)
        assert set(torchrun + workers) <= set(job_pids(tag)), log(tmp_path)
        kill_and_check(proc, tmp_path, None)
    finally:
        cleanup(proc, tag)


def test_sigusr1_to_every_process_while_the_workers_start_preempts_the_job(tmp_path):
    """A scheduler may signal every process of a job step (Slurm's proctrack/linuxproc does),
    torchrun and workers still starting included: torchrun survives it, the workers stop after
    a step with a snapshot once they handle it, meshrun exits 75 and nothing is left behind."""
    require("torch")
    out = str(tmp_path / "run")
    proc = start(tmp_path, *TRAIN, "--out", out, USERPKG_ITEM_DELAY_S="0.02")
    tag = str(tmp_path)
    try:
        assert wait_for(lambda: len(workers_of(tag)) == 2 or proc.poll() is not None, 60), log(tmp_path)
        for pid in [proc.pid, *job_pids(tag)]:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        assert proc.wait(timeout=60) == 75, log(tmp_path)
        assert "meshrun: preempted by SIGUSR1 at step" in log(tmp_path), log(tmp_path)
        assert wait_for(lambda: not job_pids(tag), 5), job_pids(tag)
    finally:
        cleanup(proc, tag)


def test_the_job_is_its_token_holders_and_their_sessions(tmp_path):
    """A process of the job that runs a program with an environment of its own (no token) is
    still found, through the session it shares; an unrelated process is not."""
    from meshrun.launch import guard

    token = guard.new_token()
    program = ("import subprocess, sys, time\n"
               "child = subprocess.Popen(['sleep', '30'], env={})\n"
               "print(child.pid, flush=True)\ntime.sleep(30)")
    holder = subprocess.Popen([sys.executable, "-c", program], env={**os.environ, guard.TOKEN_VAR: token},
                              stdout=subprocess.PIPE, text=True, start_new_session=True)
    stranger = subprocess.Popen(["sleep", "30"])
    try:
        child = int(holder.stdout.readline())
        assert guard.job_processes(token) == sorted([holder.pid, child])
        assert guard.stop_job(token) == 2
        assert holder.wait(timeout=5) == -signal.SIGKILL and not guard.job_processes(token)
        assert stranger.poll() is None
    finally:
        for p in (holder, stranger):
            p.kill()
            p.wait()
