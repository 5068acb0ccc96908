"""meshrun under a real Slurm: jobs submitted with sbatch (the script `meshrun render slurm`
writes), steps started by srun inside salloc, `meshrun doctor` in a job step, a node lost
mid-job, and preemption (scontrol requeue, a time limit's warning signal) that resumes
bit for bit. The cluster (tests/slurm_cluster.py) is two slurmd "nodes" and a slurmctld,
each in its own network namespace, started once for this module and torn down after it.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import slurm_cluster
from helpers import clean_env, lines, meshrun, require, script
from test_checkpoint import losses

pytestmark = pytest.mark.netns

JOB = ["--model-size", "gpt-tiny", "--seq-len", "32", "--micro-batch", "4", "--steps", "24", "--save-every", "6",
       "--log-every", "1", "--deterministic", "--lr", "3e-3", "--eval-batches", "2"]
HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.dirname(sys.executable)  # meshrun, torchrun of the test's venv, on the jobs' PATH


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    require("torch")
    why = slurm_cluster.available()
    if why:
        if os.environ.get("MESHRUN_TEST_STRICT") == "1":
            pytest.fail(f"Slurm tests {why} but MESHRUN_TEST_STRICT=1")
        pytest.skip(why)
    root = tmp_path_factory.mktemp("slurm")
    tag = f"s{os.getpid() % 1000}"
    env = clean_env(PATH=f"{BIN}:{os.environ.get('PATH', '/usr/bin:/bin')}", PYTHONPATH=HERE)
    c = slurm_cluster.start(root, tag, subnet=os.getpid() % 20 + 225, base_env=env)
    yield c
    slurm_cluster.stop(c)


@pytest.fixture(scope="module")
def one_node(tmp_path_factory):
    """The reference: the same job as 4 processes on one node, no Slurm."""
    require("torch")
    out = tmp_path_factory.mktemp("one-node")
    res = meshrun("train", "--nproc", "4", *JOB, "--out", str(out), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return losses(out)


def render(tmp_path: Path, *options: str, command: list[str]) -> Path:
    path = tmp_path / "job.sbatch"
    res = meshrun("render", "slurm", "--nodes", "2", "--gpus-per-node", "0", "--cpus-per-task", "2",
                  "--name", "mr", *options, "-o", str(path), "--", *command)
    assert res.returncode == 0, res.stderr
    return path


def job_output(tmp_path: Path, job_id: int) -> str:
    path = tmp_path / f"mr-{job_id}.out"
    return path.read_text(errors="replace") if path.exists() else ""


def test_sbatch_two_nodes_train_like_one_node(cluster, one_node, tmp_path):
    """`meshrun render slurm` -> sbatch -> both nodes run `meshrun train` (2 processes
    each): the job completes, sacct records COMPLETED, and every loss equals the one-node
    4-process run's bit for bit."""
    out = tmp_path / "run"
    # the cluster's own job options, as sbatch reads them from the rendered #SBATCH lines
    job = render(tmp_path, "--account", "ml-team", "--mem", "0", "--sbatch-arg", "--comment=meshrun-render",
                 command=["meshrun", "train", "--nproc", "2", *JOB, "--out", str(out)])
    job_id = cluster.sbatch(str(job), str(tmp_path))
    info = cluster.wait(job_id, timeout=400)
    log = job_output(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert info["NodeList"] == "node[1-2]"
    assert info["Account"] == "ml-team" and info["Comment"] == "meshrun-render", info
    assert cluster.accounting(job_id) == ["COMPLETED"]
    assert losses(out) == one_node


@pytest.mark.parametrize("mode", ["task-per-process", "task-per-node"])
def test_launch_in_salloc_srun(cluster, mode):
    """`meshrun launch` under `salloc ... srun`: one Slurm task per process (each task is
    a worker, ranks from SLURM_PROCID/SLURM_LOCALID) or one task per node (meshrun starts
    torchrun with --nproc processes there). Four ranks over two hosts meet and all-reduce."""
    if mode == "task-per-process":
        argv = ["salloc", "-N2", "--ntasks-per-node=2", "srun", "meshrun", "launch", script("torch_allreduce.py")]
    else:
        argv = ["salloc", "-N2", "srun", "--ntasks-per-node=1", "meshrun", "launch", "--nproc", "2",
                script("torch_allreduce.py")]
    res = cluster.run(argv, timeout=180)
    assert res.returncode == 0, res.stderr[-3000:] + cluster.logs()
    rows = lines(res.stdout, "ALLREDUCE")
    assert sorted(int(r["rank"]) for r in rows) == [0, 1, 2, 3]
    assert all(r["world"] == "4" and r["sum"] == "10" and r["ok"] == "True" for r in rows)


def test_doctor_in_a_job_step_reports_both_nodes(cluster):
    """`meshrun launch -m meshrun doctor` in a two-node job step: one set of findings per
    node, the rendezvous met on the first node, versions compared across both."""
    res = cluster.run(["salloc", "-N2", "srun", "--ntasks-per-node=1", "meshrun", "launch", "--nproc", "1",
                       "-m", "meshrun", "doctor", "--json"], timeout=180)
    assert res.returncode in (0, 1), res.stderr[-3000:]  # 1: some check failed (none expected to)
    report = json.loads(res.stdout[res.stdout.index("{"):])
    findings = report["findings"]
    assert {f.get("node") for f in findings if "node" in f} == {0, 1}
    met = [f["reason"] for f in findings if f["check"] == "master"]
    assert len(met) == 2 and all(r.startswith("the job met at node1:") for r in met), met
    assert any(f["check"] == "versions" and "all 2 nodes" in f["reason"] for f in findings)
    assert not [f for f in findings if f["status"] == "fail"], findings


# One process per node (see one_node_long), one thread each as torchrun gives the reference's two.
ONE_PER_NODE = {"OMP_NUM_THREADS": "1"}
# A user's map-style dataset whose items are slow on a job's first run (none after a requeue:
# USERPKG_ITEM_DELAY_S, USERPKG_DELAY_AFTER), so that a kill or a signal finds the job mid-run.
LONG = [*JOB[:JOB.index("--steps")], "--steps", "60", *JOB[JOB.index("--steps") + 2:],
        "--data", "userpkg.factories:slow_tokens"]


@pytest.fixture(scope="module")
def one_node_long(tmp_path_factory):
    """The reference for the interrupted jobs: 2 processes on one node.

    The interrupted jobs run one process per node. With more than two data-parallel ranks a
    resumed run is not bit for bit the uninterrupted one: DDP lays its gradient bucket out in
    parameter order for the first step after it is built and in gradient-ready order from
    then on, so the first step after a resume sums each gradient over the ranks in another
    order (a few float32 ulps). Two ranks' sum does not depend on the order."""
    require("torch")
    out = tmp_path_factory.mktemp("one-node-long")
    res = meshrun("train", "--nproc", "2", *LONG, "--out", str(out), env=clean_env(PYTHONPATH=HERE), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return losses(out)


def wait_for_step(out: Path, step: int, job_id: int, cluster, timeout: float) -> None:
    """Bounded wait until the job in ``out`` has logged ``step``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            if max(losses(out)) >= step:
                return
        except (OSError, ValueError):
            pass
        if cluster.job(job_id).get("JobState") not in ("PENDING", "RUNNING", "CONFIGURING"):
            raise AssertionError(f"job {job_id} ended before step {step}: {cluster.job(job_id)}")
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not reached in {timeout:.0f} s")


def kill_node_step(cluster, node: int) -> list[int]:
    """SIGKILL every process of the job step on node ``node`` (1 or 2) — meshrun, torchrun
    and the workers — as if the node had died under it; Slurm's daemons (slurmd, and the
    step's slurmstepd, which reports the loss to srun) stay."""
    out = subprocess.run(["ip", "netns", "pids", cluster.hosts[node].netns], capture_output=True, text=True,
                         timeout=30)
    killed = []
    for pid in map(int, out.stdout.split()):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                argv0 = os.path.basename(f.read().split(b"\0")[0]).decode()
        except OSError:
            continue
        if argv0 not in ("slurmd", "sh", "nsenter", "unshare") and not argv0.startswith("slurmstepd"):
            try:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            except ProcessLookupError:
                pass
    return killed


def test_a_lost_node_restarts_the_job_step_and_resumes_bit_for_bit(cluster, one_node_long, tmp_path):
    """Every process of node2's job step is SIGKILLed after the step-6 snapshot; srun ends
    the step on node1 too; the script rendered with --max-restarts 1 starts the step again,
    which resumes from the last committed snapshot: every loss equals the uninterrupted
    run's, and the job ends COMPLETED."""
    out = tmp_path / "run"
    job = render(tmp_path, "--max-restarts", "1",
                 command=["meshrun", "train", "--nproc", "1", *LONG, "--out", str(out)])
    job_id = cluster.sbatch(str(job), str(tmp_path), env={**ONE_PER_NODE, "USERPKG_ITEM_DELAY_S": "0.02"})
    wait_for_step(out, 9, job_id, cluster, timeout=300)
    assert kill_node_step(cluster, 2)
    info = cluster.wait(job_id, timeout=400)
    log = job_output(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED", log[-3000:]
    assert "restart 1 of 1" in log, log[-3000:]
    assert "resumed from" in log, log[-3000:]
    assert losses(out) == one_node_long


def test_scontrol_requeue_snapshots_and_the_requeued_job_resumes(cluster, one_node_long, tmp_path):
    """`scontrol requeue` mid-run: Slurm sends SIGTERM to the job's steps; meshrun train on
    both nodes stops after an agreed step, writes a snapshot and exits 75; the requeued
    job (same id, SLURM_RESTART_COUNT=1) resumes from it and its losses equal the
    uninterrupted run's."""
    out = tmp_path / "run"
    job = render(tmp_path, "--requeue", command=["meshrun", "train", "--nproc", "1", *LONG, "--out", str(out)])
    job_id = cluster.sbatch(str(job), str(tmp_path), env={**ONE_PER_NODE, "USERPKG_ITEM_DELAY_S": "0.02"})
    wait_for_step(out, 9, job_id, cluster, timeout=300)
    res = cluster.run(["scontrol", "requeue", str(job_id)], timeout=30)
    assert res.returncode == 0, res.stderr
    info = cluster.wait(job_id, timeout=400, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"))
    log = job_output(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1", log[-3000:]
    assert "preempted by SIGTERM" in log and "resumed from" in log, log[-3000:]
    assert losses(out) == one_node_long


@pytest.mark.timeout(900)  # above the job's bound below, whose error says what the job was doing
def test_time_limit_signal_snapshots_requeues_and_resumes(cluster, one_node_long, tmp_path):
    """A job with a two-minute --time and --requeue: Slurm sends SIGUSR1 before the limit
    (`--signal=USR1@S`), meshrun train snapshots and exits 75, the script requeues the
    job, and the requeued run resumes; the losses equal the uninterrupted run's. Slurm
    checks time limits every 30 s, so S=60 puts the warning 60-90 s into each run, the
    requeued one's too: what is left for it must take well under 60 s on a host busy with
    the rest of the suite. So the first run's loader stalls after step 48 of 60 (8 s a step
    from there: the 12 steps left would take 96 s, so only the warning can end it), and the
    requeued run, its loader no longer slow, has at most 12 steps to run. On a host too slow
    to reach step 48 by the warning, the requeued run may be warned too: it then stops
    again and the next requeue resumes from a newer snapshot."""
    out = tmp_path / "run"
    job = render(tmp_path, "--requeue", "--time", "2", "--signal-before", "60",
                 command=["meshrun", "train", "--nproc", "1", *LONG, "--out", str(out)])
    job_id = cluster.sbatch(str(job), str(tmp_path), env={**ONE_PER_NODE, "USERPKG_DELAY_AFTER": str(48 * 4),
                                                          "USERPKG_ITEM_DELAY_S": "2"})
    info = cluster.wait(job_id, timeout=780, until=("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL"),
                        output=tmp_path / f"mr-{job_id}.out")
    log = job_output(tmp_path, job_id)
    assert info["JobState"] == "COMPLETED" and int(info["Restarts"]) >= 1, log[-3000:]
    assert "preempted by SIGUSR1" in log and "resumed from" in log, log[-3000:]
    assert losses(out) == one_node_long
