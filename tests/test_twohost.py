"""A two-node `meshrun train --max-restarts` on two network-namespace hosts survives a
killed worker and resumes bit for bit (the other multi-host tests: test_cluster.py)."""

import os
import subprocess
import sys

import netns
import pytest
from helpers import clean_env, require

pytestmark = pytest.mark.netns

RUN, SUB, NS = "train", "jobs", "team"
NAMES = [f"{RUN}-{i}.{SUB}.{NS}.svc.cluster.local" for i in range(2)]


@pytest.fixture
def hosts():
    why = netns.available()
    if why:
        if os.environ.get("MESHRUN_TEST_STRICT") == "1":
            pytest.fail(f"two-host tests {why} but MESHRUN_TEST_STRICT=1")
        pytest.skip(why)
    tag = "t" + str(os.getpid() % 10000)  # (test_cluster's tags are digits: it may run beside this file)
    pair = netns.create_hosts(tag, subnet=os.getpid() % 200 + 20, n=2, names={NAMES[0]: 0, NAMES[1]: 1})
    yield pair
    netns.destroy(pair, f"mr{tag}sw")


def run_on_hosts(hosts, argv, env_for, timeout):
    """Start ``meshrun ARGV`` on every host at once; wait (bounded) for all; return
    [(returncode, stdout, stderr)] in host order. Whatever still runs at the end is killed."""
    procs = [subprocess.Popen(host.command([sys.executable, "-m", "meshrun", *argv], env_for(rank, host)),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank, host in enumerate(hosts)]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def test_two_nodes_survive_a_killed_rank_and_resume_bit_for_bit(hosts, tmp_path):
    """`meshrun train --max-restarts 1` on both nodes; one worker on node 1 is SIGKILLed
    mid-run; both nodes start a fresh rendezvous (port + 1) and resume from the snapshot
    in the shared output directory; every loss after the resume equals an uninterrupted
    run's."""
    require("torch")
    from helpers import meshrun as run_cli
    from test_checkpoint import JOB, kill_when, losses, reached

    reference = tmp_path / "reference"
    res = run_cli("train", *JOB, "--out", str(reference), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    expected = losses(str(reference))

    out = str(tmp_path / "two-nodes")
    watcher, killed = kill_when(reached(out, 15), out, deadline_s=300)

    def env_for(rank, host):
        # One process per node: torchrun leaves OMP_NUM_THREADS alone then, and a different
        # thread count changes the order of CPU float sums; match the reference's 1.
        return clean_env(MASTER_ADDR=hosts[0].addr, MASTER_PORT="29400", NNODES="2", NODE_RANK=str(rank),
                         OMP_NUM_THREADS="1")

    results = run_on_hosts(hosts, ["train", "--nproc", "1", *JOB, "--out", out, "--max-restarts", "1"],
                           env_for, 400)
    watcher.join(timeout=1)
    assert killed, "the job ended before a worker could be killed"
    for code, _, stderr in results:
        assert code == 0, stderr[-3000:]
        assert "restart 1 of 1" in stderr
    assert "resumed from" in results[0][1] and "at step 12" in results[0][1]
    after = losses(out)
    assert sorted(after) == list(range(1, 61))
    assert all(after[s] == expected[s] for s in range(13, 61))
