"""Detection: each platform's variables -> one Topology, with sources; the probe order."""

import pytest
from platform_envs import (
    GENERIC,
    KUBEFLOW,
    KUBEFLOW_POD,
    LSF_PER_GPU,
    LSF_PER_NODE,
    MPI_PER_GPU,
    MPI_PER_NODE,
    SAGEMAKER,
    SATURN,
    SKYPILOT,
    SLURM,
    SLURM_PER_TASK,
    TORCHRUN_WORKER,
)

from meshrun.cluster.detect import Overrides, resolve
from meshrun.cluster.topology import Topology
from meshrun.errors import MeshrunError

SATURN_HOSTS = ("train-0.jobs.team.svc.cluster.local", "train-1.jobs.team.svc.cluster.local")

# (env, gpus) -> (platform, nnodes, node_rank, nproc, master_addr, master_port, hosts, run_id, local_rank)
CASES = [
    (SATURN, 4, ("saturn", 2, 1, 4, SATURN_HOSTS[0], 29500, SATURN_HOSTS, "train", None)),
    (SKYPILOT, 8, ("skypilot", 2, 1, 8, "10.0.0.5", 29500, ("10.0.0.5", "10.0.0.6"), "sky-2026-11-26-abc", None)),
    (SLURM, 4, ("slurm", 3, 2, 4, "gpu07", 15000 + 123456 % 10000, ("gpu07", "gpu08", "login2"), "123456", None)),
    (SLURM_PER_TASK, 4, ("slurm", 2, 1, 4, "n1", 15077, ("n1", "n2"), "77", 3)),
    (KUBEFLOW, 4, ("kubeflow", 2, 1, 4, "pj-master-0", 23456, (), "kubeflow", None)),
    (KUBEFLOW_POD, 4, ("kubeflow", 3, 2, 4, "pj-master-0", 23456, (), "kubeflow", None)),
    (LSF_PER_NODE, 4, ("lsf", 2, 1, 4, "c01n01", 16234, ("c01n01", "c01n02"), "1234", None)),
    (LSF_PER_GPU, 4, ("lsf", 2, 1, 4, "c01n01", 16234, ("c01n01", "c01n02"), "1234", 2)),
    (TORCHRUN_WORKER, 4, ("torchrun", 2, 1, 4, "10.1.1.1", 29400, (), "none", 1)),
    (MPI_PER_NODE, 2, ("mpi", 2, 1, 2, "10.2.0.1", 20808, (), "137297921", None)),
    (MPI_PER_GPU, 4, ("mpi", 2, 1, 4, "10.2.0.1", 20808, (), "137297921", 2)),
    (SAGEMAKER, 8, ("sagemaker", 2, 1, 8, "algo-1", 29500, ("algo-1", "algo-2"), "sm-job", None)),
    (GENERIC, 2, ("generic", 2, 1, 2, "head.example", 6000, (), "meshrun", None)),
    ({}, 0, ("local", 1, 0, 2, "127.0.0.1", 29500, (), "local", None)),
    ({}, 3, ("local", 1, 0, 3, "127.0.0.1", 29500, (), "local", None)),
]


def shape(t: Topology) -> tuple:
    return (t.platform, t.nnodes, t.node_rank, t.nproc_per_node, t.master_addr, t.master_port,
            t.hosts, t.run_id, t.local_rank)


@pytest.mark.parametrize("env,gpus,expected", CASES)
def test_each_platform_resolves(env, gpus, expected):
    assert shape(resolve(env, gpus)) == expected


def test_worker_mode_rank_is_global():
    t = resolve(MPI_PER_GPU, 4)
    assert t.is_worker and t.rank == 6 and t.world_size == 8
    t = resolve(TORCHRUN_WORKER, 4)
    assert t.rank == 5


def test_sources_name_the_variables():
    t = resolve(SLURM, 4)
    assert t.source("nnodes") == "env SLURM_NNODES"
    assert t.source("node_rank") == "env SLURM_NODEID"
    assert t.source("nproc_per_node") == "env SLURM_GPUS_ON_NODE"
    assert t.source("hosts") == "env SLURM_JOB_NODELIST"
    assert "SLURM_JOB_ID" in t.source("master_port")
    assert t.source("platform") == "detected (SLURM_JOB_ID set)"
    k = resolve(KUBEFLOW, 4)
    assert k.source("node_rank") == "env PET_NODE_RANK"


def test_kubeflow_rank_is_pod_index_not_process_rank():
    env = dict(KUBEFLOW)
    del env["PET_NODE_RANK"]
    t = resolve(env, 4)
    assert t.node_rank == 1 and t.world_size == 8  # WORLD_SIZE=2 (pods) is not the world size
    assert "pod index" in t.source("node_rank")


def test_probe_order_torchrun_worker_inside_slurm_wins():
    t = resolve({**SLURM, **TORCHRUN_WORKER}, 4)
    assert t.platform == "torchrun"


def test_probe_order_kubeflow_before_generic():
    assert resolve(KUBEFLOW, 4).platform == "kubeflow"


def test_slurm_master_addr_and_port_from_env_win():
    t = resolve({**SLURM, "MASTER_ADDR": "10.9.9.9", "MASTER_PORT": "31000"}, 4)
    assert (t.master_addr, t.master_port) == ("10.9.9.9", 31000)


def test_slurm_port_outside_ephemeral_range():
    for job in (1, 9999, 123456, 10**9 + 7):
        port = resolve({**SLURM, "SLURM_JOB_ID": str(job)}, 4).master_port
        assert 1024 < port < 32768


def test_mpi_port_and_run_id_come_from_the_job_id_every_rank_shares():
    """Every rank of one mpirun job derives the same port from its job id (two jobs on one
    node get different ones); an older Open MPI's variable, Open MPI 5's PMIx namespace or
    none at all (the fixed default, still the same on every rank) also do."""
    ranks = [resolve({**MPI_PER_GPU, "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(r % 4)}, 4)
             for r in range(8)]
    assert {(t.master_port, t.run_id) for t in ranks} == {(20808, "137297921")}
    assert [t.rank for t in ranks] == list(range(8))
    t = ranks[0]
    assert t.source("master_port") == "derived from env OMPI_MCA_ess_base_jobid (15000 + CRC-32 % 10000)"
    assert t.source("run_id") == "env OMPI_MCA_ess_base_jobid"
    assert resolve({**MPI_PER_GPU, "OMPI_MCA_ess_base_jobid": "137363457"}, 4).master_port != 20808
    env = {k: v for k, v in MPI_PER_GPU.items() if k != "OMPI_MCA_ess_base_jobid"}
    old = resolve({**env, "OMPI_MCA_orte_ess_jobid": "137297921"}, 4)
    assert (old.master_port, old.source("run_id")) == (20808, "env OMPI_MCA_orte_ess_jobid")
    five = resolve({**env, "PMIX_NAMESPACE": "prterun-node0-4242@1"}, 4)
    assert 15000 <= five.master_port < 25000 and five.run_id == "prterun-node0-4242@1"
    assert (resolve(env, 4).master_port, resolve(env, 4).run_id) == (29500, "mpi")
    assert resolve({**MPI_PER_GPU, "MASTER_PORT": "31000"}, 4).master_port == 31000


def test_mpi_workers_on_one_node_share_a_port_not_a_free_one_each():
    """`mpirun -np 2` on one machine: the single-node free-port pick is per process, so a
    worker must not take it; without a job id the ranks agree on the default port."""
    one = {"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2"}
    ports = {resolve({**one, "OMPI_COMM_WORLD_RANK": str(r), "OMPI_COMM_WORLD_LOCAL_RANK": str(r)}, 0,
                     free_port=lambda n, r=r: 40001 + r).master_port for r in range(2)}
    assert ports == {29500}
    assert resolve({**one, "OMPI_COMM_WORLD_RANK": "1", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
                    "OMPI_MCA_ess_base_jobid": "137297921"}, 0, free_port=lambda n: 40001).master_port == 20808


def test_mpi_without_master_addr_says_how_to_pass_it_to_every_rank():
    env = {k: v for k, v in MPI_PER_GPU.items() if k != "MASTER_ADDR"}
    with pytest.raises(MeshrunError, match=r"2-node job on platform mpi.*mpirun -x MASTER_ADDR="):
        resolve(env, 4)
    assert resolve(env, 4, overrides=Overrides(master_addr="n0")).master_addr == "n0"


def test_skypilot_zero_gpus_means_one_cpu_process():
    t = resolve({**SKYPILOT, "SKYPILOT_NUM_GPUS_PER_NODE": "0"}, 0)
    assert t.nproc_per_node == 1


def test_platform_flag_skips_probe():
    t = resolve({**SLURM, **SATURN}, 4, platform="slurm")
    assert t.platform == "slurm" and t.source("platform") == "flag --platform"


def test_flags_override_env_and_record_source():
    ov = Overrides(nproc_per_node=2, master_port=29999, sources={"nproc_per_node": "flag --nproc"})
    t = resolve(SATURN, 4, overrides=ov)
    assert (t.nproc_per_node, t.master_port) == (2, 29999)
    assert t.source("nproc_per_node") == "flag --nproc"
    assert t.source("master_port") == "flag --master-port"
    assert t.source("node_rank") == "env SATURN_JOB_RANK"


def test_hosts_flag_sets_master_to_first_host():
    t = resolve({}, 0, overrides=Overrides(nnodes=2, node_rank=1, hosts=("a", "b")))
    assert t.master_addr == "a" and t.hosts == ("a", "b")


def test_free_port_used_only_for_unchosen_single_node_port():
    asked: list[int] = []
    assert resolve({}, 0, free_port=lambda n: asked.append(n) or 40001).master_port == 40001
    assert asked == [2]  # room for one listener per local process (TensorFlow needs that)
    assert resolve(SATURN, 4, free_port=lambda n: 40001).master_port == 29500
    ov = Overrides(master_port=29600)
    assert resolve({}, 0, overrides=ov, free_port=lambda n: 40001).master_port == 29600


def test_free_port_block_is_bindable():
    from meshrun.cluster.net import free_port, port_is_free

    base = free_port(4)
    assert all(port_is_free(base + i) for i in range(4))


STORE = """
import datetime, sys
import torch.distributed as dist
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), 1, True, timeout=datetime.timedelta(seconds=20))
store.set("k", "v")
print(store.get("k").decode())
"""


def test_a_picked_port_stays_held_for_the_rank_that_listens_there():
    """free_port keeps the ports it picked bound until released: another process's plain bind
    of them fails (so neither its bind to port 0 nor its outgoing connection gets them in the
    seconds before rank 0 listens), while torch's TCPStore, which sets SO_REUSEADDR, listens
    there; once released, anyone may bind them."""
    import socket
    import subprocess
    import sys

    pytest.importorskip("torch")
    from meshrun.cluster.net import free_port, release_port

    def plain_bind(port):
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                return False
        return True

    port = free_port(2)
    assert not plain_bind(port) and not plain_bind(port + 1)
    release_port(port)
    assert plain_bind(port) and plain_bind(port + 1)
    port = free_port()
    try:
        out = subprocess.run([sys.executable, "-c", STORE, str(port)], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0 and out.stdout.strip() == "v", out.stderr[-2000:]
    finally:
        release_port(port)
    # a process that exits holding its ports closes them first: no ResourceWarning at exit
    held = subprocess.run([sys.executable, "-W", "always::ResourceWarning", "-c",
                           "from meshrun.cluster.net import free_port; free_port(2); free_port()"],
                          capture_output=True, text=True, timeout=60)
    assert held.returncode == 0 and held.stderr == "", held.stderr


def test_a_command_run_in_process_lets_go_of_the_ports_it_picked(tmp_path):
    """The CLI's main, run many times in one process (meshrun.train() in a notebook, the suite's
    in-process commands), holds no socket once each command is over: a launch's dry run picks a
    port for its single node, and a refused command may have picked one before its refusal."""
    from helpers import meshrun_here

    from meshrun.cluster import net

    train = ["train", "--model-size", "gpt-tiny", "--data", "random", "--nproc", "2", "--out", str(tmp_path / "r")]
    before = dict(net._held)
    dry = meshrun_here(*train, "--dry-run")
    assert dry.returncode == 0 and "MASTER_PORT=" in dry.stdout, dry.stderr  # it picked one
    assert net._held == before, net._held
    refused = meshrun_here(*train, "--strategy", "single")  # refused after the topology is resolved
    assert refused.returncode == 2 and "--strategy" in refused.stderr, refused.stderr
    assert net._held == before, net._held


BAD = [
    ({**SATURN, "SATURN_JOB_RANK": "2"}, 4, "SATURN_JOB_RANK", "must be in 0..1"),
    ({**SATURN, "SATURN_JOB_RANK": "one"}, 4, "SATURN_JOB_RANK", "not an integer"),
    ({**SKYPILOT, "SKYPILOT_NUM_NODES": "3"}, 8, "SKYPILOT_NUM_NODES", "lists 2 address"),
    ({**SLURM, "SLURM_JOB_NODELIST": "gpu[07-"}, 4, "SLURM_JOB_NODELIST", "cannot parse"),
    ({**SLURM, "SLURM_NNODES": "2"}, 4, "SLURM_NNODES", "lists 3 host"),
    ({**SAGEMAKER, "SM_CURRENT_HOST": "algo-9"}, 8, "SM_CURRENT_HOST", "not in SM_HOSTS"),
    ({**SAGEMAKER, "SM_HOSTS": "algo-1"}, 8, "SM_HOSTS", "JSON list"),
    ({**MPI_PER_GPU, "OMPI_COMM_WORLD_SIZE": "7"}, 4, "OMPI_COMM_WORLD_SIZE", "multiple"),
    # mpirun --map-by node: rank 5 on node 1 as its local rank 2 (by slot it would be 1)
    ({**MPI_PER_GPU, "OMPI_COMM_WORLD_RANK": "5"}, 4, "OMPI_COMM_WORLD_LOCAL_RANK", "not placed node by node"),
    ({"MASTER_ADDR": "h", "NNODES": "2", "NODE_RANK": "-1"}, 0, "NODE_RANK", ">= 0"),
    ({"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": ""}, 0, "master address", "--master-addr"),
    ({**KUBEFLOW, "PET_NNODES": "1:4"}, 4, "PET_NNODES", "elastic"),
    ({**KUBEFLOW_POD, "RANK": "3"}, 4, "RANK", "must be below WORLD_SIZE=3"),
    ({**KUBEFLOW_POD, "WORLD_SIZE": "three"}, 4, "WORLD_SIZE", "not an integer"),
    ({**KUBEFLOW_POD, "WORLD_SIZE": "0"}, 4, "WORLD_SIZE", ">= 1"),
    ({**KUBEFLOW_POD, "MASTER_PORT": "http"}, 4, "MASTER_PORT", "not an integer"),
    ({**LSF_PER_GPU, "JSM_NAMESPACE_SIZE": "eight"}, 4, "JSM_NAMESPACE_SIZE", "not an integer"),
    ({**LSF_PER_GPU, "JSM_NAMESPACE_RANK": "6.0"}, 4, "JSM_NAMESPACE_RANK", "not an integer"),
    ({**LSF_PER_GPU, "JSM_NAMESPACE_LOCAL_RANK": "x"}, 4, "JSM_NAMESPACE_LOCAL_RANK", "not an integer"),
    ({**LSF_PER_GPU, "JSM_NAMESPACE_LOCAL_SIZE": "-4"}, 4, "JSM_NAMESPACE_LOCAL_SIZE", ">= 1"),
    ({**LSF_PER_GPU, "LSB_JOBID": "job7"}, 4, "LSB_JOBID", "not an integer"),
]


@pytest.mark.parametrize("env,gpus,name,words", BAD)
def test_bad_environment_names_variable_and_value(env, gpus, name, words):
    with pytest.raises(MeshrunError) as e:
        resolve(env, gpus)
    msg = str(e.value)
    assert name in msg and words in msg
    assert "\n" not in msg


def test_more_processes_than_gpus_is_refused():
    with pytest.raises(MeshrunError, match=r"--nproc.*3.*2 GPU"):
        resolve({}, 2, overrides=Overrides(nproc_per_node=3, sources={"nproc_per_node": "flag --nproc"}))


def test_node_rank_flag_beyond_nnodes():
    with pytest.raises(MeshrunError, match=r"flag --node-rank=2: node rank must be in 0\.\.1"):
        resolve(SATURN, 4, overrides=Overrides(node_rank=2))


def test_unknown_and_absent_platform():
    with pytest.raises(MeshrunError, match="unknown platform"):
        resolve({}, 0, platform="borg")
    with pytest.raises(MeshrunError, match="SLURM_JOB_ID"):
        resolve({}, 0, platform="slurm")


def test_topology_is_frozen():
    t = resolve({}, 0)
    with pytest.raises(AttributeError):
        t.nnodes = 3  # type: ignore[misc]
    with pytest.raises(TypeError):
        t.sources["nnodes"] = "x"  # type: ignore[index]
