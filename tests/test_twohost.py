"""A two-node job on two network-namespace hosts, each running `meshrun launch` with the
variables Saturn Cloud sets: 2 nodes x 2 processes, all 4 ranks agree on an all-reduce."""

import os
import subprocess
import sys

import pytest

import netns
from helpers import clean_env, lines, require, script

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
    tag = str(os.getpid() % 10000)
    pair = netns.create_pair(tag, subnet=os.getpid() % 200 + 20, names={NAMES[0]: 0, NAMES[1]: 1})
    yield pair
    netns.destroy(pair)


def test_saturn_two_nodes_torch_allreduce(hosts):
    require("torch")
    procs = []
    for rank, host in enumerate(hosts):
        env = clean_env(
            SATURN_JOB_SCALE="2", SATURN_JOB_RANK=str(rank), SATURN_JOB_LEADER=NAMES[0],
            SATURN_JOB_RUN=RUN, SATURN_INTERNAL_SUBDOMAIN=SUB, SATURN_NAMESPACE=NS,
            # Until meshrun picks the interface itself, name it as a user would.
            GLOO_SOCKET_IFNAME=host.ifname,
        )
        argv = host.command([sys.executable, "-m", "meshrun", "launch", "--nproc", "2",
                             script("torch_allreduce.py")], env)
        procs.append(subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=180))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-3000:]
    rows = [r for out, _ in outs for r in lines(out, "ALLREDUCE")]
    assert sorted(int(r["rank"]) for r in rows) == [0, 1, 2, 3]
    assert all(r["world"] == "4" and r["sum"] == "10" for r in rows)
