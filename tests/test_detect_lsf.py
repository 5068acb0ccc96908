"""Detection of IBM LSF jobs (jsrun's job steps), Kubeflow pods without PET_* variables, mpirun
ranks on one host agreeing on a port, and host lists with blanks; cases follow Lightning's LSF
and Kubeflow cluster-environment tests where they apply."""

import json
import os
import re
import subprocess
import sys

import pytest
from helpers import clean_env, meshrun
from platform_envs import KUBEFLOW, KUBEFLOW_POD, LSF_PER_GPU, MPI_PER_NODE, SKYPILOT, SLURM, TORCHRUN_WORKER

from meshrun.cluster.detect import Overrides, resolve
from meshrun.cluster.platforms import lsf, mpi
from meshrun.errors import MeshrunError

# Lightning's rankfile: the launch node "batch", then one slot on each of four compute hosts.
LIGHTNING_RANKFILE = "batch\n10.10.10.0\n10.10.10.1\n10.10.10.2\n10.10.10.3"
JSM = ("JSM_NAMESPACE_SIZE", "JSM_NAMESPACE_RANK", "JSM_NAMESPACE_LOCAL_RANK", "JSM_NAMESPACE_LOCAL_SIZE")


def rankfile(tmp_path, text: str) -> str:
    path = tmp_path / "lsb_djob_rankfile"
    path.write_text(text)
    return str(path)


def jsm(size: int, rank: int, local_rank: int, local_size: int | None = None) -> dict[str, str]:
    env = {"JSM_NAMESPACE_SIZE": str(size), "JSM_NAMESPACE_RANK": str(rank),
           "JSM_NAMESPACE_LOCAL_RANK": str(local_rank)}
    if local_size is not None:
        env["JSM_NAMESPACE_LOCAL_SIZE"] = str(local_size)
    return env


def one_line_error(env, gpus=4, platform=None) -> str:
    with pytest.raises(MeshrunError) as e:
        resolve(env, gpus, platform)
    msg = str(e.value)
    assert "\n" not in msg
    return msg


# ---- LSF: the host list ------------------------------------------------------------------------

# rankfile text -> compute hosts (the first slot, the launch node's, dropped; each host once, in order)
RANKFILES = [
    (LIGHTNING_RANKFILE, ("10.10.10.0", "10.10.10.1", "10.10.10.2", "10.10.10.3")),
    ("batch1\nc1\nc1\nc1\nc2\nc2\nc2\n", ("c1", "c2")),  # one line per slot
    ("  batch1 \n\n c1\t\nc2  \n\n", ("c1", "c2")),  # blanks around names and empty lines
    ("h1\nh1\nh1\nh1\nh2\nh2\n", ("h1", "h2")),  # the job script runs on h1, which has more slots
    ("c1\nc2\nc1\nc2\n", ("c2", "c1")),  # hosts in the order of their first slot after the launch node's
    ("h1\n", ("h1",)),  # a one-slot job keeps its host
]


@pytest.mark.parametrize("text,hosts", RANKFILES)
def test_rankfile_hosts_drop_the_launch_node_slot(tmp_path, text, hosts):
    assert lsf.compute_hosts(lsf.slots_of(lsf.read_rankfile(rankfile(tmp_path, text)))) == hosts


# LSB_MCPU_HOSTS -> compute hosts, by the same rule
MCPU_HOSTS = [
    ("batch1 1 c01n01 42 c01n02 42", ("c01n01", "c01n02")),
    ("h1 4 h2 4", ("h1", "h2")),
    ("  h1\t4   h2 4 ", ("h1", "h2")),
    ("h1 1 h2 1 h3 1", ("h2", "h3")),
    ("h1 1", ("h1",)),
    ("h1 8", ("h1",)),
]


@pytest.mark.parametrize("text,hosts", MCPU_HOSTS)
def test_mcpu_hosts_drop_the_launch_node_slot(text, hosts):
    assert lsf.compute_hosts(lsf.parse_mcpu_hosts(text)) == hosts


@pytest.mark.parametrize("text", ["h1 4 h2", "h1 x", "h1 0", "h1 -1 h2 4", "4 h1", "h1 4.0"])
def test_bad_mcpu_hosts_is_one_line_naming_it(text):
    msg = one_line_error({"LSB_JOBID": "1234", "LSB_MCPU_HOSTS": text})
    assert msg.startswith(f"env LSB_MCPU_HOSTS={text!r}: is not pairs of a host and its slot count")
    assert "hint: LSF sets it like 'host1 4 host2 4'" in msg


def test_rankfile_wins_over_mcpu_hosts(tmp_path):
    env = {"LSB_JOBID": "1234", "LSB_DJOB_RANKFILE": rankfile(tmp_path, "batch\na\nb\n"),
           "LSB_MCPU_HOSTS": "batch 1 x 1 y 1", **jsm(2, 0, 0)}
    t = resolve(env, 1)
    assert t.hosts == ("a", "b") and t.master_addr == "a"
    assert t.source("hosts") == "env LSB_DJOB_RANKFILE (its first slot, the launch node, dropped)"
    assert t.source("master_addr") == "first compute host of env LSB_DJOB_RANKFILE"


# ---- LSF: Lightning's cases --------------------------------------------------------------------

def test_lightning_attributes_from_environment_variables(tmp_path):
    """Lightning's case, made consistent: its fixture puts ranks 0-3 on four one-slot hosts yet
    gives rank 3 local rank 1 (refused below); here each host gives two slots, as jsrun -a 2
    places four tasks on two nodes. Lightning's port is 10000 + id % 1000 (10234); meshrun's,
    like Slurm's, 15000 + id % 10000."""
    text = "batch\n10.10.10.0\n10.10.10.0\n10.10.10.1\n10.10.10.1"
    t = resolve({"LSB_JOBID": "1234", "LSB_DJOB_RANKFILE": rankfile(tmp_path, text), **jsm(4, 3, 1)}, 2)
    assert (t.platform, t.master_addr, t.master_port, t.world_size, t.rank, t.local_rank, t.node_rank) == \
        ("lsf", "10.10.10.0", 16234, 4, 3, 1, 1)
    assert t.is_worker and t.hosts == ("10.10.10.0", "10.10.10.1")
    assert t.source("master_port") == "derived from env LSB_JOBID (15000 + id % 10000)"
    assert t.source("local_rank") == "env JSM_NAMESPACE_LOCAL_RANK"
    assert t.source("nproc_per_node") == "env JSM_NAMESPACE_SIZE / compute hosts of env LSB_DJOB_RANKFILE"


def test_lightning_fixture_with_uneven_tasks_is_refused(tmp_path):
    """Four tasks on four hosts is one per host, where rank 3's local rank must be 0."""
    env = {"LSB_JOBID": "1234", "LSB_DJOB_RANKFILE": rankfile(tmp_path, LIGHTNING_RANKFILE), **jsm(4, 3, 1)}
    msg = one_line_error(env)
    assert msg.startswith("env JSM_NAMESPACE_LOCAL_RANK=1: but one task per node") and "hint: " in msg


def test_lightning_node_rank_with_one_task_per_node(tmp_path):
    """jsrun -r 1 -a 1: each task is its node's launcher; its namespace rank is the node rank."""
    path = rankfile(tmp_path, LIGHTNING_RANKFILE)
    ranks = [resolve({"LSB_JOBID": "1234", "LSB_DJOB_RANKFILE": path, **jsm(4, r, 0)}, 4) for r in range(4)]
    assert [t.node_rank for t in ranks] == [0, 1, 2, 3]
    assert {(t.nnodes, t.nproc_per_node, t.master_addr, t.master_port, t.local_rank) for t in ranks} == \
        {(4, 4, "10.10.10.0", 16234, None)}
    assert ranks[2].source("node_rank") == "env JSM_NAMESPACE_RANK"


def test_lightning_manual_main_port_and_address(tmp_path):
    env = {"LSB_JOBID": "1234", "LSB_DJOB_RANKFILE": rankfile(tmp_path, LIGHTNING_RANKFILE), **jsm(4, 3, 0),
           "MASTER_PORT": "4321", "MASTER_ADDR": "10.10.10.9"}
    t = resolve(env, 4)
    assert (t.master_port, t.master_addr) == (4321, "10.10.10.9")
    assert (t.source("master_port"), t.source("master_addr")) == ("env MASTER_PORT", "env MASTER_ADDR")


@pytest.mark.parametrize("extra", [{}, {"LSB_DJOB_RANKFILE": ""}, {"LSB_DJOB_RANKFILE": "  "}])
def test_lightning_missing_or_empty_rankfile(extra):
    """No rankfile (unset or empty) and no LSB_MCPU_HOSTS: the hosts are unknown."""
    msg = one_line_error({"LSB_JOBID": "1234", **jsm(4, 3, 1), **extra})
    assert msg.startswith("env LSB_DJOB_RANKFILE='': is unset, and LSB_MCPU_HOSTS too") and "hint: " in msg


def test_lightning_missing_job_id_is_not_lsf(tmp_path):
    env = {"LSB_DJOB_RANKFILE": rankfile(tmp_path, LIGHTNING_RANKFILE), **jsm(4, 3, 0)}
    assert resolve(env, 4).platform == "local"
    assert "lsf is recognised by LSB_JOBID" in one_line_error(env, platform="lsf")


def test_lightning_detect_empty_values_are_unset():
    env = {"LSB_DJOB_RANKFILE": "", "LSB_JOBID": "", "JSM_NAMESPACE_SIZE": "", "JSM_NAMESPACE_LOCAL_RANK": ""}
    assert resolve(env, 0).platform == "local"


# ---- LSF: jsrun's task layouts and the job script ----------------------------------------------

def test_every_worker_of_a_job_step_agrees():
    """jsrun -r 1 -a 4 on two nodes: ranks 0-7 each derive one layout, one master and one port."""
    ts = [resolve({**LSF_PER_GPU, **jsm(8, r, r % 4, 4)}, 4) for r in range(8)]
    assert [t.rank for t in ts] == list(range(8)) and [t.node_rank for t in ts] == [0] * 4 + [1] * 4
    assert {(t.nnodes, t.nproc_per_node, t.master_addr, t.master_port, t.hosts) for t in ts} == \
        {(2, 4, "c01n01", 16234, ("c01n01", "c01n02"))}
    assert ts[0].source("nnodes") == "env JSM_NAMESPACE_SIZE / JSM_NAMESPACE_LOCAL_SIZE"


def test_tasks_per_node_from_the_host_count_without_local_size():
    env = {k: v for k, v in LSF_PER_GPU.items() if k != "JSM_NAMESPACE_LOCAL_SIZE"}
    t = resolve(env, 4)
    assert (t.nnodes, t.node_rank, t.nproc_per_node, t.local_rank) == (2, 1, 4, 2)
    assert t.source("nnodes") == "count of compute hosts of env LSB_MCPU_HOSTS"


def test_job_script_on_its_only_host_is_one_node():
    """bsub -n 8 meshrun train on a cluster without launch nodes: the script's host is the node."""
    t = resolve({"LSB_JOBID": "99", "LSB_MCPU_HOSTS": "h1 8"}, 0)
    assert (t.platform, t.nnodes, t.node_rank, t.nproc_per_node, t.master_addr, t.hosts, t.local_rank) == \
        ("lsf", 1, 0, 1, "h1", ("h1",), None)
    assert t.master_port == 15099 and t.source("node_rank") == "default (one node)"


@pytest.mark.parametrize("hosts,count", [("batch1 1 c01n01 42 c01n02 42", 2), ("batch1 1 c01n01 42", 1),
                                         ("h1 4 h2 4", 2)])
def test_job_script_outside_a_job_step_is_refused(hosts, count):
    """Without JSM_* the process is the job script: on a launch node, or on one of several nodes
    with nothing to say which; either would start processes on the wrong machine."""
    msg = one_line_error({"LSB_JOBID": "1234", "LSB_MCPU_HOSTS": hosts})
    assert msg.startswith("env JSM_NAMESPACE_RANK='': is unset: this is the job script on the launch node")
    assert f"{count} compute host(s) of env LSB_MCPU_HOSTS" in msg and "jsrun -n <nodes> -r 1 -a 1" in msg


# ---- LSF: blaunch tasks -------------------------------------------------------------------------

# the job's slots -> each blaunch task's hosts: every host once, in order, the first included (a
# plain LSF cluster has no launch node: the job script's host computes too)
BLAUNCH_JOBS = [
    ("h1 4 h2 4", ("h1", "h2")),
    ("h1 1 h2 1 h3 1", ("h1", "h2", "h3")),  # span[ptile=1]: the first host's one slot is its node
    ("h1 8", ("h1",)),
    ("h2 2 h1 2 h2 2", ("h2", "h1")),
]


@pytest.mark.parametrize("mcpu,hosts", BLAUNCH_JOBS)
def test_blaunch_task_n_is_node_n_minus_1_of_all_the_jobs_hosts(mcpu, hosts):
    tops = [resolve({"LSB_JOBID": "321", "LSB_MCPU_HOSTS": mcpu, "LSF_PM_TASKID": str(task)}, 4)
            for task in range(1, len(hosts) + 1)]
    assert [t.node_rank for t in tops] == list(range(len(hosts)))
    assert {(t.platform, t.nnodes, t.nproc_per_node, t.master_addr, t.hosts, t.master_port, t.local_rank)
            for t in tops} == {("lsf", len(hosts), 4, hosts[0], hosts, 15321, None)}
    assert tops[-1].source("node_rank") == "env LSF_PM_TASKID - 1"
    assert tops[-1].source("hosts") == "env LSB_MCPU_HOSTS (each host once, the first included)"


def test_a_blaunch_tasks_hosts_come_from_the_rankfile_first(tmp_path):
    env = {"LSB_JOBID": "321", "LSB_DJOB_RANKFILE": rankfile(tmp_path, "a\na\nb\nb\n"),
           "LSB_MCPU_HOSTS": "x 2 y 2", "LSF_PM_TASKID": "2"}
    t = resolve(env, 2)
    assert (t.hosts, t.node_rank, t.master_addr) == (("a", "b"), 1, "a")
    assert t.source("nnodes") == "count of hosts of env LSB_DJOB_RANKFILE"


@pytest.mark.parametrize("task,words", [
    ("3", "env LSF_PM_TASKID=3: is past the 2 host(s) of env LSB_MCPU_HOSTS: blaunch started more than one task "
          "per host (hint: start one task on each host: blaunch -u FILE"),
    ("0", "env LSF_PM_TASKID='0': must be >= 1"),
    ("x", "env LSF_PM_TASKID='x': not an integer"),
])
def test_a_bad_blaunch_task_number_is_one_line(task, words):
    msg = one_line_error({"LSB_JOBID": "321", "LSB_MCPU_HOSTS": "h1 4 h2 4", "LSF_PM_TASKID": task})
    assert msg.startswith(words), msg


def test_jsrun_and_mpirun_variables_win_over_a_blaunch_task_number():
    """jsrun's job steps and Open MPI's ranks (whose daemons LSF starts as tasks, so they inherit
    LSF_PM_TASKID) are placed by jsrun and mpirun: their own variables say which node."""
    assert resolve({**LSF_PER_GPU, "LSF_PM_TASKID": "1"}, 4).source("node_rank") == \
        "env JSM_NAMESPACE_RANK // tasks per node"
    no_jsm = {k: v for k, v in LSF_PER_GPU.items() if k not in JSM}
    assert resolve({**no_jsm, **MPI_PER_NODE, "LSF_PM_TASKID": "1"}, 2).platform == "mpi"


def test_job_array_elements_get_their_own_port_and_run_id():
    a = resolve({**LSF_PER_GPU, "LSB_JOBINDEX": "3"}, 4)
    b = resolve({**LSF_PER_GPU, "LSB_JOBINDEX": "4"}, 4)
    assert (a.run_id, a.master_port, b.run_id, b.master_port) == ("1234[3]", 16237, "1234[4]", 16238)
    assert a.source("master_port") == "derived from env LSB_JOBID + LSB_JOBINDEX (15000 + sum % 10000)"
    assert resolve({**LSF_PER_GPU, "LSB_JOBINDEX": "0"}, 4).run_id == "1234"


def test_lsf_probe_order():
    """jsrun also sets Open MPI's variables: with JSM_* the job step is LSF's; mpirun inside an
    LSF job (no JSM_*) is MPI's; a torchrun worker inside either is torchrun's."""
    ompi = {"OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_RANK": "6", "OMPI_COMM_WORLD_LOCAL_SIZE": "4",
            "OMPI_COMM_WORLD_LOCAL_RANK": "2"}
    assert resolve({**LSF_PER_GPU, **ompi}, 4).platform == "lsf"
    no_jsm = {k: v for k, v in LSF_PER_GPU.items() if k not in JSM}
    assert resolve({**no_jsm, **MPI_PER_NODE}, 2).platform == "mpi"
    assert resolve({**LSF_PER_GPU, **TORCHRUN_WORKER}, 4).platform == "torchrun"
    assert resolve({**LSF_PER_GPU, **SLURM}, 4).platform == "lsf"


def test_flags_override_lsf_values():
    ov = Overrides(master_port=29999, nproc_per_node=2, sources={"nproc_per_node": "flag --nproc"})
    t = resolve({**LSF_PER_GPU, "JSM_NAMESPACE_LOCAL_SIZE": "1", **jsm(2, 1, 0)}, 4, overrides=ov)
    assert (t.master_port, t.nproc_per_node, t.node_rank) == (29999, 2, 1)


BAD_RANKFILES = [
    (None, "cannot be read (No such file or directory)"),
    ("", "lists no host"),
    ("\n  \n", "lists no host"),
    ("batch\nc1 slots=4\n", "has a line that is not one host name: 'c1 slots=4'"),
    (b"\xff\xfe\x00\x01", "is not a text file of host names"),
]


@pytest.mark.parametrize("content,words", BAD_RANKFILES)
def test_unreadable_rankfile_is_one_line_naming_it(tmp_path, content, words):
    path = tmp_path / "rankfile"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    msg = one_line_error({"LSB_JOBID": "1234", "LSB_DJOB_RANKFILE": str(path), **jsm(2, 0, 0)})
    assert msg.startswith(f"env LSB_DJOB_RANKFILE={str(path)!r}: {words}") and "hint: " in msg


def test_a_directory_as_rankfile_is_refused(tmp_path):
    msg = one_line_error({"LSB_JOBID": "1234", "LSB_DJOB_RANKFILE": str(tmp_path), **jsm(2, 0, 0)})
    assert msg.startswith(f"env LSB_DJOB_RANKFILE={str(tmp_path)!r}: cannot be read (Is a directory)")


def test_a_rankfile_larger_than_the_bound_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(lsf, "MAX_RANKFILE_BYTES", 16)
    path = rankfile(tmp_path, "batch\n" + "c1\n" * 10)
    assert "is larger than" in one_line_error({"LSB_JOBID": "1", "LSB_DJOB_RANKFILE": path, **jsm(1, 0, 0)})


# env -> (the variable named, the words of the message)
BAD_JSM = [
    ({**LSF_PER_GPU, "JSM_NAMESPACE_RANK": ""}, "env JSM_NAMESPACE_RANK=''", "is required here"),
    ({**LSF_PER_GPU, "JSM_NAMESPACE_LOCAL_RANK": ""}, "env JSM_NAMESPACE_LOCAL_RANK=''", "is required here"),
    ({**LSF_PER_GPU, "JSM_NAMESPACE_RANK": "8"}, "env JSM_NAMESPACE_RANK=8", "must be below JSM_NAMESPACE_SIZE=8"),
    ({**LSF_PER_GPU, "JSM_NAMESPACE_SIZE": "0"}, "env JSM_NAMESPACE_SIZE='0'", "must be >= 1"),
    ({**LSF_PER_GPU, "JSM_NAMESPACE_SIZE": "7", "JSM_NAMESPACE_RANK": "5", "JSM_NAMESPACE_LOCAL_SIZE": ""},
     "env JSM_NAMESPACE_SIZE=7", "is not a multiple of the 2 compute host(s) of env LSB_MCPU_HOSTS"),
    ({**LSF_PER_GPU, "JSM_NAMESPACE_SIZE": "6", "JSM_NAMESPACE_RANK": "5"},
     "env JSM_NAMESPACE_SIZE=6", "is not a multiple of JSM_NAMESPACE_LOCAL_SIZE=4"),
    ({**LSF_PER_GPU, "JSM_NAMESPACE_SIZE": "4", "JSM_NAMESPACE_RANK": "3", "JSM_NAMESPACE_LOCAL_RANK": "3"},
     "env JSM_NAMESPACE_SIZE=4", "is 1 node(s) of 4 task(s), but env LSB_MCPU_HOSTS lists 2 compute host(s)"),
    # jsrun -d cyclic: rank 5 on node 1 as its local rank 2 (packed, it would be local rank 1)
    ({**LSF_PER_GPU, "JSM_NAMESPACE_RANK": "5"}, "env JSM_NAMESPACE_LOCAL_RANK=2", "ranks are not packed node by node"),
]


@pytest.mark.parametrize("env,name,words", BAD_JSM)
def test_bad_job_step_variables_are_one_line(env, name, words):
    msg = one_line_error(env)
    assert msg.startswith(f"{name}: ") and words in msg


# ---- Kubeflow pods without PET_* ---------------------------------------------------------------

def test_kubeflow_pod_is_one_node_of_world_size_pods():
    """Lightning's KubeflowEnvironment reads MASTER_ADDR, MASTER_PORT, WORLD_SIZE and RANK; here
    they count pods, so each pod is a node and meshrun starts one process per visible GPU."""
    pods = [resolve({**KUBEFLOW_POD, "RANK": str(r)}, 4) for r in range(3)]
    assert [t.node_rank for t in pods] == [0, 1, 2]
    assert {(t.platform, t.nnodes, t.nproc_per_node, t.master_addr, t.master_port, t.local_rank) for t in pods} == \
        {("kubeflow", 3, 4, "pj-master-0", 23456, None)}
    t = pods[2]
    assert t.world_size == 12 and not t.is_worker
    assert t.source("nnodes") == "env WORLD_SIZE (the pod count under Kubeflow without PET_NNODES)"
    assert t.source("node_rank") == "env RANK (the pod index under Kubeflow)"
    assert t.source("platform") == "detected (MASTER_ADDR, WORLD_SIZE and RANK in a Kubernetes pod, no PET_*)"


def test_kubeflow_pod_on_a_cpu_node_and_without_a_port():
    env = {k: v for k, v in KUBEFLOW_POD.items() if k not in ("MASTER_PORT", "KUBERNETES_SERVICE_HOST")}
    t = resolve(env, 0)  # KUBERNETES_PORT alone marks the pod
    assert (t.platform, t.nproc_per_node, t.master_port, t.source("master_port")) == ("kubeflow", 1, 29500, "default")


def test_kubeflow_pod_variables_outside_kubernetes_or_under_a_launcher_are_not_kubeflow():
    """Outside a pod the same variables are a hand-made env:// setup (generic); with
    LOCAL_RANK, LOCAL_WORLD_SIZE or GROUP_RANK a launcher started one process per device and
    WORLD_SIZE counts processes; NNODES and NODE_RANK, when set, name the nodes themselves."""
    outside = {k: v for k, v in KUBEFLOW_POD.items() if not k.startswith("KUBERNETES_")}
    assert resolve(outside, 4).platform == "generic"
    for name, value in (("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1"), ("GROUP_RANK", "0")):
        assert resolve({**KUBEFLOW_POD, name: value}, 4).platform == "generic"
    t = resolve({**KUBEFLOW_POD, "NNODES": "2", "NODE_RANK": "1"}, 4)  # explicit node variables win
    assert (t.platform, t.nnodes, t.node_rank) == ("generic", 2, 1)
    assert "MASTER_ADDR, WORLD_SIZE and RANK in a Kubernetes pod" in one_line_error(outside, platform="kubeflow")


def test_kubeflow_pet_variables_still_win_in_a_pod():
    t = resolve({**KUBEFLOW_POD, **KUBEFLOW}, 4)
    assert (t.nnodes, t.node_rank, t.nproc_per_node) == (2, 1, 4)
    assert t.source("platform") == "detected (PET_NNODES set)"


# ---- mpirun -np 2 on one host: one port for both ranks -----------------------------------------

@pytest.mark.parametrize("name,value", [("OMPI_MCA_ess_base_jobid", "137297921"),
                                        ("OMPI_MCA_orte_ess_jobid", "137297921"),
                                        ("PMIX_NAMESPACE", "prterun-node0-4242@1")])
def test_two_ranks_of_one_mpirun_job_on_one_host_derive_one_port(name, value):
    """Each rank runs its own detection (and would pick a different free port): both must
    derive the port from the job id mpirun gives every rank."""
    ranks = [resolve({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "OMPI_COMM_WORLD_RANK": str(r),
                      "OMPI_COMM_WORLD_LOCAL_RANK": str(r), name: value}, 0, free_port=lambda n, r=r: 40001 + r)
             for r in range(2)]
    assert ranks[0].master_port == ranks[1].master_port == mpi.port_from_job_id(value)
    assert [t.rank for t in ranks] == [0, 1] and {t.master_addr for t in ranks} == {"127.0.0.1"}
    assert ranks[1].source("master_port") == f"derived from env {name} (15000 + CRC-32 % 10000)"


# ---- host lists with blanks --------------------------------------------------------------------

def test_host_lists_with_blanks_give_bare_names():
    t = resolve({**SLURM, "SLURM_JOB_NODELIST": "gpu07, gpu08 ,  login2 "}, 4)
    assert t.hosts == ("gpu07", "gpu08", "login2") and t.master_addr == "gpu07"
    t = resolve({**SKYPILOT, "SKYPILOT_NODE_IPS": " 10.0.0.5 \n\n\t10.0.0.6  \n"}, 8)
    assert t.hosts == ("10.0.0.5", "10.0.0.6") and t.master_addr == "10.0.0.5"
    t = resolve({**LSF_PER_GPU, "LSB_MCPU_HOSTS": " batch1  1\tc01n01 42  c01n02   42 "}, 4)
    assert t.hosts == ("c01n01", "c01n02") and t.master_addr == "c01n01"


# ---- meshrun env -------------------------------------------------------------------------------

def test_meshrun_env_shows_lsf_and_where_each_value_came_from(tmp_path):
    env = clean_env(LSB_JOBID="1234", LSB_DJOB_RANKFILE=rankfile(tmp_path, "batch1\nc1\nc1\nc2\nc2\n"),
                    **jsm(4, 3, 1, 2), CUDA_VISIBLE_DEVICES="")
    out = meshrun("env", "--json", env=env)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert (data["platform"], data["nnodes"], data["node_rank"], data["nproc_per_node"], data["rank"]) == \
        ("lsf", 2, 1, 2, 3)
    assert (data["master_addr"], data["master_port"], data["hosts"], data["run_id"]) == \
        ("c1", 16234, ["c1", "c2"], "1234")
    assert data["sources"] == {**data["sources"], "platform": "detected (LSB_JOBID set)",
                               "hosts": "env LSB_DJOB_RANKFILE (its first slot, the launch node, dropped)",
                               "master_addr": "first compute host of env LSB_DJOB_RANKFILE",
                               "master_port": "derived from env LSB_JOBID (15000 + id % 10000)",
                               "node_rank": "env JSM_NAMESPACE_RANK // tasks per node",
                               "nproc_per_node": "env JSM_NAMESPACE_LOCAL_SIZE",
                               "local_rank": "env JSM_NAMESPACE_LOCAL_RANK", "run_id": "env LSB_JOBID"}
    table = meshrun("env", env=env)
    assert table.returncode == 0, table.stderr
    assert "meshrun topology (lsf)" in table.stdout and "JSM_NAMESPACE_RANK" in table.stdout
    assert "c1, c2" in table.stdout


@pytest.mark.parametrize("extra,words", [
    ({"JSM_NAMESPACE_SIZE": "four"}, "env JSM_NAMESPACE_SIZE='four': not an integer"),
    ({"LSB_DJOB_RANKFILE": "/nonexistent/rankfile"}, "env LSB_DJOB_RANKFILE='/nonexistent/rankfile': cannot be read"),
])
def test_meshrun_env_bad_lsf_value_exits_2_with_one_line(extra, words):
    env = clean_env(**{**LSF_PER_GPU, **extra})
    out = meshrun("env", env=env)
    assert out.returncode == 2 and out.stdout == ""
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("meshrun: error: ") and words in lines[0]


def test_meshrun_env_platform_list_names_lsf():
    out = meshrun("env", "--platform", "borg", env=clean_env())
    assert out.returncode == 2 and "lsf" in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_clean_env_drops_lsf_and_kubernetes_variables(monkeypatch):
    monkeypatch.setenv("LSB_JOBID", "1")
    monkeypatch.setenv("JSM_NAMESPACE_RANK", "0")
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.96.0.1")
    assert not {"LSB_JOBID", "JSM_NAMESPACE_RANK", "KUBERNETES_SERVICE_HOST"} & set(clean_env())
    assert os.environ["LSB_JOBID"] == "1"


FAKE_JSRUN = """#!/bin/bash
# jsrun -n N -r 1 -a 1 ...: N tasks, one per host, each with jsrun's namespace variables
n=0
while [ $# -gt 0 ]; do
  case "$1" in
    -n) n=$2; shift 2;;
    -r|-a|-c|-g) shift 2;;
    *) break;;
  esac
done
for i in $(seq 0 $((n - 1))); do
  JSM_NAMESPACE_SIZE=$n JSM_NAMESPACE_RANK=$i JSM_NAMESPACE_LOCAL_RANK=0 JSM_NAMESPACE_LOCAL_SIZE=1 "$@" || exit $?
done
"""


def test_the_rendered_bsub_script_runs_meshrun_as_lsf_detection_reads_it(tmp_path):
    """`meshrun render lsf --launcher jsrun` -> the script, run as LSF would (its variables, a rankfile with the
    launch node first, jsrun starting one task per node): each task's meshrun resolves the same
    nodes, its own node rank and the first compute host as master."""
    script = tmp_path / "job.bsub"
    res = meshrun("render", "lsf", "--launcher", "jsrun", "--nodes", "3", "--gpus-per-node", "4", "--time", "30",
                  "--partition", "batch", "--account", "proj1", "-o", str(script), "--", "meshrun", "env", "--json")
    assert res.returncode == 0, res.stderr
    text = script.read_text()
    assert subprocess.run(["bash", "-n", str(script)], capture_output=True).returncode == 0
    for line in ("#BSUB -nnodes 3", "#BSUB -W 30", "#BSUB -q batch", "#BSUB -P proj1"):
        assert line in text.splitlines(), text
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "jsrun").write_text(FAKE_JSRUN)
    (bin_dir / "jsrun").chmod(0o755)
    (bin_dir / "meshrun").write_text(f"#!/bin/sh\nexec {sys.executable} -m meshrun \"$@\"\n")
    (bin_dir / "meshrun").chmod(0o755)
    hosts = "batch\n" + "".join(f"node{i}\n" * 4 for i in range(3))  # 4 slots a compute node
    env = clean_env(PATH=f"{bin_dir}:{os.environ['PATH']}", LSB_JOBID="77",
                    LSB_DJOB_RANKFILE=rankfile(tmp_path, hosts), CUDA_VISIBLE_DEVICES="0,1,2,3")
    run = subprocess.run(["bash", str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    tops = [json.loads(doc) for doc in re.findall(r"^\{.*?^\}", run.stdout, re.M | re.S)]
    assert [(t["platform"], t["nnodes"], t["node_rank"], t["master_addr"]) for t in tops] == \
        [("lsf", 3, i, "node0") for i in range(3)]
    assert len({t["master_port"] for t in tops}) == 1
