"""Multi-node jobs on real hosts made of network namespaces (a bridge, one address each),
each node started the way its platform starts it, with that platform's variables:
Saturn Cloud, SkyPilot, Slurm (the rendered sbatch's node command), Kubeflow, the rendered
Kubernetes Indexed Job's env, and plain MASTER_ADDR/NNODES/NODE_RANK. Nobody names the
network interface: meshrun picks the one that routes to the master.

Every process and namespace is removed at the end, whatever happened."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import netns
import pytest
import yaml
from helpers import clean_env, example, lines, meshrun, require, script

pytestmark = pytest.mark.netns

RUN, SUB, NS = "train", "jobs", "team"
SATURN_NAMES = [f"{RUN}-{i}.{SUB}.{NS}.svc.cluster.local" for i in range(3)]
SLURM_NAMES = ["gpu01", "gpu02", "gpu03"]
K8S_NAMES = [f"gpt-{i}.gpt" for i in range(3)]
TRAIN = ["--model-size", "gpt-tiny", "--seq-len", "32", "--micro-batch", "2", "--steps", "6", "--log-every", "1",
         "--deterministic", "--data", "random", "--eval-batches", "1"]


def _make(n: int):
    why = netns.available()
    if why:
        if os.environ.get("MESHRUN_TEST_STRICT") == "1":
            pytest.fail(f"multi-host tests {why} but MESHRUN_TEST_STRICT=1")
        pytest.skip(why)
    tag = str((os.getpid() * 7 + n) % 10000)
    names = {name: i for group in (SATURN_NAMES, SLURM_NAMES, K8S_NAMES) for i, name in enumerate(group[:n])}
    hosts = netns.create_hosts(tag, subnet=(os.getpid() + n) % 200 + 20, n=n, names=names)
    return hosts, f"mr{tag}sw"


@pytest.fixture
def hosts():
    made, switch = _make(2)
    yield made
    netns.destroy(made, switch)


@pytest.fixture
def hosts3():
    made, switch = _make(3)
    yield made
    netns.destroy(made, switch)


def start(host, argv, env):
    return subprocess.Popen(host.command(argv, env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(procs, timeout):
    """Wait (bounded) for every process; [(returncode, stdout, stderr)] in order."""
    outs = []
    deadline = time.monotonic() + timeout
    try:
        for p in procs:
            outs.append(p.communicate(timeout=max(1, deadline - time.monotonic())))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return [(p.returncode, out, err) for p, (out, err) in zip(procs, outs)]


def on_hosts(hosts, argv, env_for, timeout=240, delays=None):
    procs = []
    for i, h in enumerate(hosts):
        if delays and delays[i]:
            time.sleep(delays[i])
        procs.append(start(h, argv(i, h), env_for(i, h)))
    return finish(procs, timeout)


def meshrun_argv(*args):
    return lambda i, h: [sys.executable, "-m", "meshrun", *args]


# ---- each platform's variables, as the platform sets them on node i -------------------------

def saturn_env(n):
    return lambda i, h: clean_env(SATURN_JOB_SCALE=str(n), SATURN_JOB_RANK=str(i), SATURN_JOB_LEADER=SATURN_NAMES[0],
                                  SATURN_JOB_RUN=RUN, SATURN_INTERNAL_SUBDOMAIN=SUB, SATURN_NAMESPACE=NS)


def skypilot_env(hosts):
    ips = "\n".join(h.addr for h in hosts)
    return lambda i, h: clean_env(SKYPILOT_NODE_IPS=ips, SKYPILOT_NUM_NODES=str(len(hosts)), SKYPILOT_NODE_RANK=str(i),
                                  SKYPILOT_NUM_GPUS_PER_NODE="0", SKYPILOT_TASK_ID="sky-task-1")


def slurm_env(n):
    return lambda i, h: clean_env(SLURM_JOB_ID="4242", SLURM_NNODES=str(n), SLURM_NODEID=str(i),
                                  SLURM_JOB_NODELIST=f"gpu[01-0{n}]", SLURM_NTASKS_PER_NODE="1",
                                  SLURM_PROCID=str(i))


def kubeflow_env(n):
    # The training operator's variables; RANK is the pod index there, not a process rank.
    return lambda i, h: clean_env(PET_NNODES=str(n), PET_NODE_RANK=str(i), PET_NPROC_PER_NODE="2", RANK=str(i),
                                  MASTER_ADDR=SATURN_NAMES[0], MASTER_PORT="23456", WORLD_SIZE=str(n))


def generic_env(hosts, port="29400"):
    return lambda i, h: clean_env(MASTER_ADDR=hosts[0].addr, MASTER_PORT=port, NNODES=str(len(hosts)),
                                  NODE_RANK=str(i))


# ---- training across nodes == training on one node -------------------------------------------

def losses(out_dir):
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The same job on one node with 4 processes, per strategy."""
    require("torch")
    out = {}
    for strategy in ("ddp", "fsdp"):
        d = tmp_path_factory.mktemp(f"ref-{strategy}")
        res = meshrun("train", "--nproc", "4", "--strategy", strategy, *TRAIN, "--out", str(d), timeout=300)
        assert res.returncode == 0, res.stderr[-3000:]
        out[strategy] = losses(str(d))
    return out


def _rendered_slurm_node_command(tmp_path):
    from meshrun.render import RenderSpec, render
    from meshrun.render.slurm import node_command

    return node_command(render(RenderSpec("slurm", ("meshrun", "train", "--nproc", "2", "--strategy", "ddp",
                                                     *TRAIN, "--out", str(tmp_path / "run-$SLURM_JOB_ID")), nodes=2)))


def _rendered_k8s_env(i):
    """Container env of the rendered Indexed Job, with the completion index resolved."""
    from meshrun.render import RenderSpec, render

    job = list(yaml.safe_load_all(render(RenderSpec("kubernetes", ("meshrun", "train"), nodes=2, name="gpt",
                                                    image="img"))))[1]
    env = {}
    for e in job["spec"]["template"]["spec"]["containers"][0]["env"]:
        env[e["name"]] = str(i) if "valueFrom" in e else e["value"]
    return env


@pytest.mark.parametrize("platform,strategy", [("saturn", "ddp"), ("skypilot", "fsdp"), ("slurm", "ddp"),
                                               ("kubeflow", "fsdp"), ("kubernetes", "ddp")])
def test_train_two_nodes_equals_one_node(hosts, tmp_path, reference, platform, strategy):
    out = tmp_path / "run"
    train = ["train", "--nproc", "2", "--strategy", strategy, *TRAIN, "--out", str(out)]
    if platform == "slurm":
        cmd = _rendered_slurm_node_command(tmp_path).replace("exec meshrun", f"exec {sys.executable} -m meshrun")
        argv = lambda i, h: ["bash", "-c", cmd]  # noqa: E731
        out = tmp_path / "run-$SLURM_JOB_ID"  # the command reaches the node as given: no expansion there
        env_for = slurm_env(2)
    elif platform == "kubernetes":
        argv = meshrun_argv(*train)
        env_for = lambda i, h: clean_env(**_rendered_k8s_env(i))  # noqa: E731
    else:
        argv = meshrun_argv(*train)
        env_for = {"saturn": saturn_env(2), "skypilot": skypilot_env(hosts), "kubeflow": kubeflow_env(2)}[platform]
    results = on_hosts(hosts, argv, env_for)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    got = losses(str(out))
    assert sorted(got) == list(range(1, 7))
    assert got == reference[strategy]  # bit for bit: same ranks, same data, same reductions


# ---- every framework across hosts ---------------------------------------------------------------

def test_tensorflow_two_hosts_saturn(hosts, tmp_path):
    require("tensorflow")
    results = on_hosts(hosts, meshrun_argv("launch", "-f", "tensorflow", "--nproc", "1", example("tf_train.py"),
                                           "loop", str(tmp_path)), saturn_env(2), timeout=300)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    rows = [r for _, out, _ in results for r in lines(out, "TFTRAIN")]
    assert sorted(r["index"] for r in rows) == ["0", "1"] and all(r["workers"] == "2" for r in rows)
    assert rows[0]["checksum"] == rows[1]["checksum"]


def test_jax_two_hosts_skypilot(hosts):
    require("jax")
    results = on_hosts(hosts, meshrun_argv("launch", "-f", "jax", "--nproc", "1", example("jax_train.py")),
                       skypilot_env(hosts), timeout=300)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    rows = [r for _, out, _ in results for r in lines(out, "JAXTRAIN")]
    assert sorted(r["process"] for r in rows) == ["0", "1"] and all(r["count"] == "2" for r in rows)
    assert rows[0]["checksum"] == rows[1]["checksum"]


def test_deepspeed_two_hosts_kubeflow(hosts):
    require("deepspeed")
    env = kubeflow_env(2)
    results = on_hosts(hosts, meshrun_argv("launch", "-f", "deepspeed", "--nproc", "1", "--deepspeed-config",
                                           example("ds_config.json"), example("deepspeed_train.py")),
                       lambda i, h: {**env(i, h), "PET_NPROC_PER_NODE": "1"}, timeout=400)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    rows = [r for _, out, _ in results for r in lines(out, "DSTRAIN")]
    assert sorted(r["rank"] for r in rows) == ["0", "1"] and all(r["world"] == "2" for r in rows)
    assert rows[0]["checksum"] == rows[1]["checksum"]


def test_accelerate_two_hosts_generic(hosts):
    require("accelerate")
    results = on_hosts(hosts, meshrun_argv("launch", "-f", "accelerate", "--nproc", "1",
                                           example("accelerate_train.py")), generic_env(hosts), timeout=300)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    rows = [r for _, out, _ in results for r in lines(out, "ACCEL")]
    assert sorted(r["index"] for r in rows) == ["0", "1"] and all(r["num"] == "2" for r in rows)
    assert rows[0]["checksum"] == rows[1]["checksum"]


def test_three_hosts_slurm_allreduce(hosts3):
    require("torch")
    results = on_hosts(hosts3, meshrun_argv("launch", "--nproc", "1", script("torch_allreduce.py")), slurm_env(3))
    for code, _, err in results:
        assert code == 0, err[-3000:]
    rows = [r for _, out, _ in results for r in lines(out, "ALLREDUCE")]
    assert sorted(int(r["rank"]) for r in rows) == [0, 1, 2] and all(r["sum"] == "6" for r in rows)


# ---- the network: interface choice, late nodes, missing nodes -----------------------------------

def test_env_shows_the_interface_that_routes_to_the_master(hosts):
    env = generic_env(hosts)(1, hosts[1])
    out = subprocess.run(hosts[1].command([sys.executable, "-m", "meshrun", "env", "--json"], env),
                         capture_output=True, text=True, timeout=60)
    d = json.loads(out.stdout)
    assert d["socket_ifname"] == hosts[1].ifname and d["sources"]["socket_ifname"] == f"routes to {hosts[0].addr}"
    env["GLOO_SOCKET_IFNAME"] = "lo"  # the user's choice stands
    out = subprocess.run(hosts[1].command([sys.executable, "-m", "meshrun", "env", "--json"], env),
                         capture_output=True, text=True, timeout=60)
    d = json.loads(out.stdout)
    assert d["socket_ifname"] == "lo" and d["sources"]["socket_ifname"] == "env GLOO_SOCKET_IFNAME"


@pytest.mark.parametrize("late", [0, 1])
def test_a_node_that_starts_late_still_forms_the_job(hosts, late):
    require("torch")
    delays = [0, 0]
    delays[late] = 6
    results = on_hosts(hosts, meshrun_argv("launch", "--nproc", "1", "--rdzv-timeout", "60",
                                           script("torch_allreduce.py")), generic_env(hosts), delays=delays)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    rows = [r for _, out, _ in results for r in lines(out, "ALLREDUCE")]
    assert sorted(int(r["rank"]) for r in rows) == [0, 1]


def test_a_node_that_never_comes_is_a_clear_timeout_on_node_0(hosts):
    require("torch")
    begin = time.monotonic()
    (code, _, err), = finish([start(hosts[0], [sys.executable, "-m", "meshrun", "launch", "--nproc", "1",
                                               "--rdzv-timeout", "8", script("torch_allreduce.py")],
                                    generic_env(hosts)(0, hosts[0]))], timeout=90)
    assert code != 0 and time.monotonic() - begin < 60
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"meshrun: error: rendezvous at {hosts[0].addr}:29400 timed out within 8 s: "
                           "1 of 2 nodes joined"), err[-2000:]
    assert "Traceback" not in err


@pytest.mark.parametrize("case", ["refused", "unreachable", "dns"])
def test_a_node_that_cannot_reach_the_master_says_why_in_time(hosts, case):
    env = generic_env(hosts)(1, hosts[1])
    if case == "unreachable":
        env["MASTER_ADDR"] = hosts[0].addr.rsplit(".", 1)[0] + ".250"  # on the subnet, nobody there
    if case == "dns":
        env["MASTER_ADDR"] = "node-zero.nowhere.invalid"
    begin = time.monotonic()
    (code, _, err), = finish([start(hosts[1], [sys.executable, "-m", "meshrun", "launch", "--nproc", "1",
                                               "--rdzv-timeout", "6", script("torch_allreduce.py")], env)], timeout=90)
    took = time.monotonic() - begin
    assert code == 2 and took < 45, (took, err)
    (line,) = err.strip().splitlines()
    expected = {"refused": "connection refused for 6 s, nothing listens there",
                "unreachable": "unreachable (", "dns": "the name does not resolve"}[case]
    assert expected in line, line


def test_doctor_on_a_node_whose_master_is_unreachable(hosts):
    env = generic_env(hosts)(1, hosts[1])
    env["MASTER_ADDR"] = hosts[0].addr.rsplit(".", 1)[0] + ".250"  # on the subnet, nobody there
    out = subprocess.run(hosts[1].command([sys.executable, "-m", "meshrun", "doctor", "--json"], env),
                         capture_output=True, text=True, timeout=120)
    report = json.loads(out.stdout)
    (port,) = [f for f in report["findings"] if f["check"] == "master port"]
    assert out.returncode == 1 and port["status"] == "fail", report
    assert "unreachable" in port["reason"] or "did not answer" in port["reason"]
    (iface,) = [f for f in report["findings"] if f["check"] == "interface"]
    assert iface["status"] == "ok" and iface["reason"].startswith(hosts[1].ifname)


def test_doctor_across_every_rank_of_a_two_host_job(hosts):
    """`meshrun launch -m meshrun doctor` on both hosts: one report from rank 0 with each
    node's findings and the cross-node version check."""
    require("torch")
    results = on_hosts(hosts, meshrun_argv("launch", "--nproc", "1", "-m", "meshrun", "doctor", "--json"),
                       generic_env(hosts), timeout=180)
    for code, _, err in results:
        assert code == 0, err[-3000:]
    report = json.loads(results[0][1])
    nodes = {f.get("node") for f in report["findings"]}
    assert {0, 1} <= nodes
    assert any(f["reason"] == "torch, CUDA, NCCL and driver agree on all 2 nodes" for f in report["findings"])
    assert results[1][1].strip() == ""  # only rank 0 reports
