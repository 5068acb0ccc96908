"""Every wait in launching is bounded, named, and ends in one line: a rank stopped with
SIGSTOP, a rank left running after the others finished, a rendezvous whose first process never
came, a malformed master address, rank variables that contradict each other, and Ctrl-C.
Real `meshrun train` / `meshrun launch` processes on 2 CPU ranks (gloo), with tiny timeouts;
every wait of the tests is bounded and every process they start is ended, stopped ones
continued first."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import clean_env, marked_pids, meshrun, require, wait_for, with_faults

pytestmark = [pytest.mark.framework,
              pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")]
HERE = os.path.dirname(os.path.abspath(__file__))
MARK = "HANGS_TEST_JOB"
ONE_RANK = ["train", "--model-size", "gpt-tiny", "--seq-len", "32", "--micro-batch", "2", "--data", "random",
            "--steps", "1000", "--log-every", "1", "--save-every", "2", "--eval-batches", "1"]
TRAIN = [*ONE_RANK, "--nproc", "2"]
TRACE = ("Traceback", "KeyboardInterrupt", "frame #", "ChildFailedError", "Root Cause")


# ---- processes ---------------------------------------------------------------------------------
def _job_pids(tag: str) -> list[int]:
    """Live processes (zombies left out) whose environment holds MARK=tag."""
    return marked_pids(MARK, tag)


def _rank_pid(tag: str, rank: int) -> int | None:
    for pid in _job_pids(tag):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if b"meshrun.training.worker" in cmd and b"torchrun" not in cmd and f"RANK={rank}".encode() in env:
            return pid
    return None


def _wait_for(condition, timeout: float) -> bool:
    return wait_for(condition, timeout, every=0.2)


def _start(tmp_path, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """meshrun in a process group of its own (as a terminal starts it), its output in a file."""
    env = {**(env if env is not None else clean_env(PYTHONPATH=HERE)), MARK: str(tmp_path)}
    with open(tmp_path / "meshrun.log", "w") as f:
        return subprocess.Popen([sys.executable, "-m", "meshrun", *args], env=env, stdout=f,
                                stderr=subprocess.STDOUT, start_new_session=True)


def _output(tmp_path) -> str:
    return (tmp_path / "meshrun.log").read_text(errors="replace")


def _cleanup(proc: subprocess.Popen, tag: str) -> None:
    """Continue what is stopped, then kill meshrun's group and every process of the job."""
    pids = _job_pids(tag)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)
    for pid in _job_pids(tag):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _last_step(out) -> int:
    try:
        with open(os.path.join(out, "metrics.jsonl")) as f:
            return max((json.loads(line).get("step", -1) for line in f if line.strip()), default=-1)
    except (OSError, ValueError):
        return -1


def _snapshots(out) -> list[str]:
    root = os.path.join(out, "checkpoints")
    return sorted(n for n in os.listdir(root) if n.startswith("step-")) if os.path.isdir(root) else []


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("meshrun: error:")]


def _training_with_rank_1_stopped(tmp_path, timeout_s: int):
    """A training job with a snapshot, and its rank 1 stopped: (meshrun, rank 1's pid, out).
    (Rank 0's first step may lag rank 1's by seconds on a busy machine: no timeout below 15 s.)"""
    out = str(tmp_path / "run")
    proc = _start(tmp_path, *TRAIN, "--out", out, "--collective-timeout", str(timeout_s))
    assert _wait_for(lambda: len(_snapshots(out)) >= 1 or proc.poll() is not None, 120), _output(tmp_path)[-3000:]
    assert proc.poll() is None, _output(tmp_path)[-3000:]
    pid = _rank_pid(str(tmp_path), 1)
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)
    return proc, pid, out


# ---- a rank that stops answering ---------------------------------------------------------------
def test_a_stopped_rank_ends_the_job_in_one_line_naming_it_and_the_snapshot_stays(tmp_path):
    require("torch")
    proc = None
    try:
        proc, pid, out = _training_with_rank_1_stopped(tmp_path, 15)
        kept = _snapshots(out)
        started = time.monotonic()
        assert proc.wait(timeout=60) == 1, _output(tmp_path)[-3000:]
        assert time.monotonic() - started < 40
        text = _output(tmp_path)
        assert "a rank that stops answering for 15 s ends the job (--collective-timeout)" in text.splitlines()[0], \
            text[:500]
        errors = _errors(text)
        assert len(errors) == 1 and errors[0].startswith(f"meshrun: error: rank 1 stopped answering: its process "
                                                         f"(pid {pid}) is stopped"), text[-3000:]
        assert not any(t in text for t in TRACE), text[-3000:]
        assert set(kept) <= set(_snapshots(out)) and kept
    finally:
        if proc is not None:
            _cleanup(proc, str(tmp_path))


def test_sigterm_while_a_rank_is_stopped_ends_the_job_within_seconds(tmp_path):
    require("torch")
    proc = None
    try:
        proc, _, _ = _training_with_rank_1_stopped(tmp_path, 300)
        time.sleep(1)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 1, _output(tmp_path)[-3000:]
        errors = _errors(_output(tmp_path))
        assert len(errors) == 1 and "rank 1 stopped answering" in errors[0] and "ended on SIGTERM" in errors[0], errors
        assert _wait_for(lambda: not _job_pids(str(tmp_path)), 10)
    finally:
        if proc is not None:
            _cleanup(proc, str(tmp_path))


HANGS_ON_RANK_1 = """import os, time
import torch


class HangsOnRank1(torch.nn.Module):
    \"\"\"A regression model whose rank 1 stops answering at its 4th forward: it loops forever,
    alive, in no collective.\"\"\"

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(20, 1)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        while os.environ.get("RANK") == "1" and self.calls >= 4:
            time.sleep(0.1)
        return self.linear(x)


def build():
    return HangsOnRank1()
"""


def test_a_rank_alive_but_silent_is_named_when_the_others_collective_times_out(tmp_path):
    require("torch")
    (tmp_path / "hangmod.py").write_text(HANGS_ON_RANK_1)
    proc = _start(tmp_path, "train", "--model", "hangmod:build", "--data", "userpkg.factories:regression",
                  "--nproc", "2", "--steps", "100", "--collective-timeout", "15",
                  env=clean_env(PYTHONPATH=f"{HERE}{os.pathsep}{tmp_path}"))
    try:
        assert proc.wait(timeout=90) == 1, _output(tmp_path)[-3000:]
        errors = _errors(_output(tmp_path))
        assert len(errors) == 1 and errors[0].startswith("meshrun: error: rank 1 stopped answering: rank 0 waited 15 s "
                                                         "for it in a collective"), _output(tmp_path)[-3000:]
        assert "rank-1.log" in errors[0]
        assert not any(t in _output(tmp_path) for t in TRACE)
    finally:
        _cleanup(proc, str(tmp_path))


# ---- a rank left running after the others finished ---------------------------------------------
FINISH_ONE = """import os, sys, time
if os.environ["RANK"] == "1":
    time.sleep(120)
"""


def test_a_rank_still_running_after_the_other_finished_is_named_and_stopped(tmp_path):
    require("torch")
    script = tmp_path / "finish_one.py"
    script.write_text(FINISH_ONE)
    proc = _start(tmp_path, "launch", "--nproc", "2", "--finish-timeout", "3", str(script))
    try:
        assert proc.wait(timeout=60) == 1, _output(tmp_path)[-3000:]
        errors = _errors(_output(tmp_path))
        assert len(errors) == 1 and errors[0].startswith("meshrun: error: rank 1 still running ") \
            and "after rank 0 finished" in errors[0], _output(tmp_path)[-3000:]
        assert _wait_for(lambda: not _job_pids(str(tmp_path)), 10)
    finally:
        _cleanup(proc, str(tmp_path))


# ---- a rendezvous whose first process never comes ----------------------------------------------
def _slurm_task_1_of_2(port: int) -> dict[str, str]:
    """srun --ntasks-per-node=2, task 1's environment; task 0 is never started."""
    return clean_env(PYTHONPATH=HERE, SLURM_JOB_ID="77", SLURM_NNODES="1", SLURM_NODEID="0",
                     SLURM_JOB_NODELIST="localhost", SLURM_NTASKS_PER_NODE="2", SLURM_LOCALID="1",
                     SLURM_PROCID="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


@pytest.mark.parametrize("command", ["launch", "train"])
def test_a_missing_task_0_ends_at_the_rendezvous_timeout_in_one_line(tmp_path, command):
    require("torch")
    from meshrun.cluster.net import free_port

    port = free_port()
    args = (["launch", "--rdzv-timeout", "4", os.path.join(HERE, "scripts", "torch_allreduce.py")]
            if command == "launch" else [*ONE_RANK, "--rdzv-timeout", "4"])
    proc = _start(tmp_path, *args, env=_slurm_task_1_of_2(port))
    try:
        assert proc.wait(timeout=40) == 2, _output(tmp_path)[-3000:]
        errors = _errors(_output(tmp_path))
        assert len(errors) == 1, _output(tmp_path)[-3000:]
        assert errors[0].startswith("meshrun: error: rank 0 (node 0's first slurm task or process) did not come: "
                                    f"rendezvous at 127.0.0.1:{port}: connection refused for 4 s"), errors
        assert not any(t in _output(tmp_path) for t in TRACE)
    finally:
        _cleanup(proc, str(tmp_path))


def test_sigterm_during_the_rendezvous_ends_train_at_once_without_a_stack(tmp_path):
    require("torch")
    from meshrun.cluster.net import free_port

    proc = _start(tmp_path, *ONE_RANK, "--rdzv-timeout", "60", env=_slurm_task_1_of_2(free_port()))
    try:
        assert _wait_for(lambda: _rank_pid(str(tmp_path), 1) is not None or proc.poll() is not None, 60)
        time.sleep(2)  # in init_process_group, waiting for rank 0's store
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=8) == 75, _output(tmp_path)[-3000:]
        text = _output(tmp_path)
        assert "meshrun: stopped by SIGTERM during start-up" in text and not any(t in text for t in TRACE), text
    finally:
        _cleanup(proc, str(tmp_path))


# ---- bad input: one line, at once --------------------------------------------------------------
@pytest.mark.parametrize("addr", ["a..b", "x" * 64 + ".cluster", b"node\xff1"])
def test_a_malformed_master_address_is_refused_in_one_line(tmp_path, addr):
    arg = os.fsdecode(addr) if isinstance(addr, bytes) else addr
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "meshrun", "launch", "--nnodes", "2", "--node-rank", "1",
                           "--master-addr", arg, "--rdzv-timeout", "30", os.path.join(HERE, "scripts", "sleeper.py")],
                          env=clean_env(), capture_output=True, timeout=30, check=False)
    stderr = proc.stderr.decode(errors="replace")
    assert proc.returncode == 2 and time.monotonic() - started < 20, stderr
    assert stderr.count("\n") == 1 and stderr.startswith("meshrun: error: flag --master-addr="), stderr


@pytest.mark.parametrize("variables", [{"RANK": "5", "WORLD_SIZE": "2"}, {"LOCAL_RANK": "2", "LOCAL_WORLD_SIZE": "2"},
                                       {"GROUP_RANK": "2", "NNODES": "2"}, {"RANK": "-1"}])
def test_rank_variables_that_contradict_each_other_are_refused(tmp_path, variables):
    proc = meshrun("launch", "--nproc", "2", os.path.join(HERE, "scripts", "sleeper.py"), str(tmp_path),
                   env=clean_env(**variables), timeout=30)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshrun: error: env "), lines
    assert all(name in lines[0] for name in variables), lines
    assert not os.path.exists(tmp_path / "pid.0")  # nothing started


# ---- Ctrl-C ------------------------------------------------------------------------------------
def test_ctrl_c_during_training_is_one_line_with_the_step_and_the_snapshot(tmp_path):
    require("torch")
    out = str(tmp_path / "run")
    proc = _start(tmp_path, *TRAIN, "--out", out)
    try:
        assert _wait_for(lambda: len(_snapshots(out)) >= 1 or proc.poll() is not None, 120), _output(tmp_path)[-3000:]
        os.killpg(proc.pid, signal.SIGINT)  # as a terminal's Ctrl-C: to the foreground process group
        assert proc.wait(timeout=20) == 130, _output(tmp_path)[-3000:]
        text = _output(tmp_path)
        last = text.strip().splitlines()[-1]
        assert last.startswith("meshrun: interrupted at step ") and "; the last snapshot is " in last, text[-3000:]
        assert last.split("the last snapshot is ")[1] in [os.path.join(out, "checkpoints", s) for s in _snapshots(out)]
        assert not any(t in text for t in TRACE), text[-3000:]
    finally:
        _cleanup(proc, str(tmp_path))


def test_ctrl_c_that_cuts_a_snapshot_write_short_is_still_the_interrupt_line(tmp_path):
    """Ctrl-C in the middle of a snapshot's write surfaces in the rank as the writer's own error
    (torch's C++ writer: "unexpected pos"), which the save reports as a failed write on every
    rank. It is still an interrupt: the step, the last committed snapshot, code 130."""
    require("torch")
    out = str(tmp_path / "run")
    ckpt = os.path.join(out, "checkpoints")
    env = with_faults(clean_env(PYTHONPATH=HERE), slow_write=4)
    proc = _start(tmp_path, *TRAIN, "--out", out, env=env)
    try:
        def writing_after_a_commit() -> bool:
            names = os.listdir(ckpt) if os.path.isdir(ckpt) else []
            return (bool(_snapshots(out)) and any(n.startswith(".tmp-step-") for n in names)) or proc.poll() is not None

        assert _wait_for(writing_after_a_commit, 120), _output(tmp_path)[-3000:]
        time.sleep(1)  # inside the slowed write
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=30) == 130, _output(tmp_path)[-3000:]
        text = _output(tmp_path)
        last = text.strip().splitlines()[-1]
        assert last == f"meshrun: interrupted at step 4; the last snapshot is {os.path.join(ckpt, 'step-00000002')}", \
            text[-3000:]
        assert not any(t in text for t in (*TRACE, "error:")), text[-3000:]
    finally:
        _cleanup(proc, str(tmp_path))


def test_ctrl_c_during_start_up_is_one_line(tmp_path):
    require("torch")
    from meshrun.cluster.net import free_port

    proc = _start(tmp_path, *ONE_RANK, "--rdzv-timeout", "60", env=_slurm_task_1_of_2(free_port()))
    try:
        assert _wait_for(lambda: _rank_pid(str(tmp_path), 1) is not None or proc.poll() is not None, 60)
        time.sleep(2)
        os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=8) == 130, _output(tmp_path)[-3000:]
        text = _output(tmp_path)
        assert text.strip().splitlines()[-1] == "meshrun: interrupted during start-up", text
        assert not any(t in text for t in TRACE), text
    finally:
        _cleanup(proc, str(tmp_path))
