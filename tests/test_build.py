"""Exact commands per platform x framework: argv and the variables meshrun sets.

The expected lines follow each platform's own guide: Saturn Cloud's multi-node guide (torchrun,
deepspeed on the torchrun path, accelerate with a GLOBAL --num_processes, JAX one process per
pod, TF_CONFIG), SkyPilot's distributed-training guide (torchrun, c10d, the native deepspeed launcher on the head
node with a hostfile), pytorch/examples' Slurm script (torchrun, one launcher per
node).
"""

import json

import pytest
from platform_envs import KUBEFLOW, MPI_PER_GPU, SAGEMAKER, SATURN, SKYPILOT, SLURM, SLURM_PER_TASK, TORCHRUN_WORKER

from meshrun.cluster.detect import Overrides, resolve
from meshrun.errors import MeshrunError
from meshrun.launch import LaunchSpec, build
from meshrun.launch.build import per_framework

LEAD = "train-0.jobs.team.svc.cluster.local"
PEER = "train-1.jobs.team.svc.cluster.local"
ARGS = ("train.py", "--epochs", "3")


def command(env, gpus, framework, visible=None, **spec):
    topo = per_framework(resolve(env, gpus), framework, gpus)
    return build(topo, LaunchSpec(framework=framework, script="train.py", script_args=ARGS[1:], **spec), visible)


def topo_env(nnodes, rank, nproc, addr, port, run_id, hosts=None):
    env = {"MESHRUN_NNODES": str(nnodes), "MESHRUN_NODE_RANK": str(rank), "MESHRUN_NPROC_PER_NODE": str(nproc),
           "MESHRUN_MASTER_ADDR": addr, "MESHRUN_MASTER_PORT": str(port), "MESHRUN_RUN_ID": run_id}
    if hosts:
        env["MESHRUN_HOSTS"] = ",".join(hosts)
    return env


# ---- Saturn Cloud document, 4 GPUs per pod --------------------------------------------------

SATURN_ENV = topo_env(2, 1, 4, LEAD, 29500, "train", [LEAD, PEER])


def test_saturn_torch():
    cmd = command(SATURN, 4, "torch")
    assert cmd.argv == ("torchrun", "--nnodes=2", "--node_rank=1", "--nproc_per_node=4",
                        f"--master_addr={LEAD}", "--master_port=29500", *ARGS)
    assert cmd.env_of(0) == SATURN_ENV


def test_saturn_deepspeed_torchrun_path():
    cmd = command(SATURN, 4, "deepspeed", deepspeed_config="ds_config.json")
    assert cmd.argv == ("torchrun", "--nnodes=2", "--node_rank=1", "--nproc_per_node=4",
                        f"--master_addr={LEAD}", "--master_port=29500", *ARGS,
                        "--deepspeed", "--deepspeed_config", "ds_config.json")
    assert cmd.env_of(0) == SATURN_ENV


def test_saturn_accelerate_num_processes_is_global():
    cmd = command(SATURN, 4, "accelerate")
    assert cmd.argv == ("accelerate", "launch", "--num_machines=2", "--machine_rank=1", "--num_processes=8",
                        f"--main_process_ip={LEAD}", "--main_process_port=29500", "--multi_gpu", *ARGS)


def test_saturn_accelerate_deepspeed_and_fsdp_passthrough():
    ds = command(SATURN, 4, "accelerate", deepspeed_config="ds.json")
    assert ds.argv[7:] == ("--use_deepspeed", "--deepspeed_config_file=ds.json", *ARGS)
    fsdp = command(SATURN, 4, "accelerate", use_fsdp=True, fsdp_sharding_strategy="FULL_SHARD")
    assert fsdp.argv[7:] == ("--use_fsdp", "--fsdp_sharding_strategy=FULL_SHARD", *ARGS)


def test_saturn_jax_one_process_per_pod():
    cmd = command(SATURN, 4, "jax")
    assert len(cmd.processes) == 1
    assert cmd.argv == ("python", *ARGS)
    assert cmd.env_of(0) == {**topo_env(2, 1, 1, LEAD, 29500, "train", [LEAD, PEER]),
                             "JAX_COORDINATOR_ADDRESS": f"{LEAD}:29500",
                             "MESHRUN_LOCAL_RANK": "0", "MESHRUN_PROCESS_ID": "1", "MESHRUN_NUM_PROCESSES": "2"}


def test_saturn_tensorflow_tf_config():
    cmd = command(SATURN, 4, "tensorflow")
    assert cmd.argv == ("python", *ARGS)
    env = cmd.env_of(0)
    assert json.loads(env.pop("TF_CONFIG")) == {
        "cluster": {"worker": [f"{LEAD}:29500", f"{PEER}:29500"]}, "task": {"type": "worker", "index": 1}}
    assert env == {**topo_env(2, 1, 1, LEAD, 29500, "train", [LEAD, PEER]),
                   "MESHRUN_LOCAL_RANK": "0", "MESHRUN_PROCESS_ID": "1", "MESHRUN_NUM_PROCESSES": "2"}


def test_saturn_deepspeed_native_worker_node_waits():
    cmd = command(SATURN, 4, "deepspeed", deepspeed_launcher="native")
    assert cmd.processes == () and "over SSH" in cmd.note


# ---- SkyPilot document, 8 GPUs per node -----------------------------------------------------

SKY_HEAD = {**SKYPILOT, "SKYPILOT_NODE_RANK": "0"}


def test_skypilot_torch_static_and_c10d():
    assert command(SKYPILOT, 8, "torch").argv == (
        "torchrun", "--nnodes=2", "--node_rank=1", "--nproc_per_node=8",
        "--master_addr=10.0.0.5", "--master_port=29500", *ARGS)
    assert command(SKYPILOT, 8, "torch", rdzv="c10d").argv == (
        "torchrun", "--nnodes=2", "--nproc_per_node=8", "--rdzv_id=sky-2026-11-26-abc",
        "--rdzv_backend=c10d", "--rdzv_endpoint=10.0.0.5:29500", *ARGS)


def test_skypilot_deepspeed_native_head_writes_hostfile():
    cmd = command(SKY_HEAD, 8, "deepspeed", deepspeed_launcher="native", hostfile="/tmp/hf",
                  deepspeed_config="ds_config.json")
    assert cmd.argv == ("deepspeed", "--hostfile=/tmp/hf", "--master_addr=10.0.0.5", "--master_port=29500",
                        *ARGS, "--deepspeed", "--deepspeed_config", "ds_config.json")
    assert cmd.files == {"/tmp/hf": "10.0.0.5 slots=8\n10.0.0.6 slots=8\n"}
    assert cmd.env_of(0) == topo_env(2, 0, 8, "10.0.0.5", 29500, "sky-2026-11-26-abc", ["10.0.0.5", "10.0.0.6"])


def test_skypilot_accelerate_jax_tensorflow():
    assert command(SKYPILOT, 8, "accelerate").argv == (
        "accelerate", "launch", "--num_machines=2", "--machine_rank=1", "--num_processes=16",
        "--main_process_ip=10.0.0.5", "--main_process_port=29500", "--multi_gpu", *ARGS)
    jax = command(SKYPILOT, 8, "jax")
    assert jax.env_of(0)["JAX_COORDINATOR_ADDRESS"] == "10.0.0.5:29500"
    assert (jax.env_of(0)["MESHRUN_PROCESS_ID"], jax.env_of(0)["MESHRUN_NUM_PROCESSES"]) == ("1", "2")
    tf = json.loads(command(SKYPILOT, 8, "tensorflow").env_of(0)["TF_CONFIG"])
    assert tf == {"cluster": {"worker": ["10.0.0.5:29500", "10.0.0.6:29500"]}, "task": {"type": "worker", "index": 1}}


# ---- Slurm (pytorch/examples' sbatch script), one task per node, 4 GPUs ----------------------

def test_slurm_all_frameworks():
    port = 15000 + 123456 % 10000
    assert command(SLURM, 4, "torch").argv == (
        "torchrun", "--nnodes=3", "--node_rank=2", "--nproc_per_node=4", "--master_addr=gpu07",
        f"--master_port={port}", *ARGS)
    assert command(SLURM, 4, "torch", rdzv="c10d").argv == (
        "torchrun", "--nnodes=3", "--nproc_per_node=4", "--rdzv_id=123456", "--rdzv_backend=c10d",
        f"--rdzv_endpoint=gpu07:{port}", *ARGS)
    assert command(SLURM, 4, "accelerate").argv == (
        "accelerate", "launch", "--num_machines=3", "--machine_rank=2", "--num_processes=12",
        "--main_process_ip=gpu07", f"--main_process_port={port}", "--multi_gpu", *ARGS)
    assert command(SLURM, 4, "jax").env_of(0)["MESHRUN_PROCESS_ID"] == "2"
    tf = json.loads(command(SLURM, 4, "tensorflow").env_of(0)["TF_CONFIG"])
    assert tf["cluster"]["worker"] == [f"gpu07:{port}", f"gpu08:{port}", f"login2:{port}"]
    assert tf["task"] == {"type": "worker", "index": 2}


def test_slurm_task_per_gpu_runs_script_directly_as_worker():
    cmd = command(SLURM_PER_TASK, 4, "torch")
    assert cmd.argv == ("python", *ARGS)
    assert cmd.env_of(0) == {**topo_env(2, 1, 4, "n1", 15077, "77", ["n1", "n2"]),
                             "RANK": "7", "LOCAL_RANK": "3", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
                             "GROUP_RANK": "1", "MASTER_ADDR": "n1", "MASTER_PORT": "15077"}
    with pytest.raises(MeshrunError, match="accelerate launch starts its own processes"):
        command(SLURM_PER_TASK, 4, "accelerate")
    tf = command(SLURM_PER_TASK, 4, "tensorflow")
    assert len(tf.processes) == 1 and json.loads(tf.env_of(0)["TF_CONFIG"])["task"]["index"] == 7


# ---- Kubeflow PyTorchJob, torchrun workers, MPI, SageMaker ----------------------------------

def test_kubeflow():
    assert command(KUBEFLOW, 4, "torch").argv == (
        "torchrun", "--nnodes=2", "--node_rank=1", "--nproc_per_node=4", "--master_addr=pj-master-0",
        "--master_port=23456", *ARGS)
    assert command(KUBEFLOW, 4, "accelerate").argv[2:5] == (
        "--num_machines=2", "--machine_rank=1", "--num_processes=8")
    assert command(KUBEFLOW, 4, "jax").env_of(0)["JAX_COORDINATOR_ADDRESS"] == "pj-master-0:23456"
    with pytest.raises(MeshrunError, match="needs every node's address"):
        command(KUBEFLOW, 4, "tensorflow")  # Kubeflow gives only the master's address


def test_inside_torchrun_worker_runs_directly():
    cmd = command(TORCHRUN_WORKER, 4, "torch")
    assert cmd.argv == ("python", *ARGS)
    assert {k: cmd.env_of(0)[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE")} == {
        "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8"}
    jax = command(TORCHRUN_WORKER, 4, "jax")
    assert (jax.env_of(0)["MESHRUN_PROCESS_ID"], jax.env_of(0)["MESHRUN_NUM_PROCESSES"]) == ("5", "8")


def test_mpi_per_gpu_and_sagemaker():
    assert command(MPI_PER_GPU, 4, "torch").env_of(0)["RANK"] == "6"
    assert command(SAGEMAKER, 8, "torch").argv[:6] == (
        "torchrun", "--nnodes=2", "--node_rank=1", "--nproc_per_node=8", "--master_addr=algo-1",
        "--master_port=29500")


# ---- local machine --------------------------------------------------------------------------

def test_local_cpu_standalone_and_multi_process_frameworks():
    assert command({}, 0, "torch").argv == ("torchrun", "--standalone", "--nproc_per_node=2", *ARGS)
    assert "MESHRUN_MASTER_PORT" not in command({}, 0, "torch").env_of(0)
    jax = command({}, 0, "jax")
    assert [p.env["MESHRUN_PROCESS_ID"] for p in jax.processes] == ["0", "1"]
    tf = command({}, 0, "tensorflow")
    workers = json.loads(tf.env_of(1)["TF_CONFIG"])
    assert workers == {"cluster": {"worker": ["127.0.0.1:29500", "127.0.0.1:29501"]},
                       "task": {"type": "worker", "index": 1}}
    ds = command({}, 0, "deepspeed", deepspeed_launcher="native")
    assert ds.argv == ("deepspeed", "--num_gpus=2", "--master_port=29500", *ARGS)


def test_jax_several_processes_pin_one_visible_device_each():
    topo = resolve({}, 4, overrides=Overrides(nproc_per_node=2, sources={"nproc_per_node": "flag --nproc"}))
    cmd = build(per_framework(topo, "jax", 4), LaunchSpec("jax", "train.py"), visible_devices="4,5,6,7")
    assert [p.env["CUDA_VISIBLE_DEVICES"] for p in cmd.processes] == ["4", "5"]


def test_elastic_range_uses_c10d():
    topo = resolve({}, 0, overrides=Overrides(nnodes=4, master_addr="head"))
    cmd = build(topo, LaunchSpec("torch", "train.py", nnodes_range=(1, 4), max_restarts=3))
    assert cmd.argv == ("torchrun", "--nnodes=1:4", "--nproc_per_node=2", "--rdzv_id=local", "--rdzv_backend=c10d",
                        "--rdzv_endpoint=head:29500", "--max_restarts=3", "train.py")
    with pytest.raises(MeshrunError, match="elastic node range"):
        build(topo, LaunchSpec("jax", "train.py", nnodes_range=(1, 4)))


def test_module_script():
    cmd = build(resolve({}, 0), LaunchSpec("torch", "pkg.train", script_args=("--x",), module=True))
    assert cmd.argv[-3:] == ("-m", "pkg.train", "--x")


@pytest.mark.parametrize("framework,spec,message", [
    ("torch", {"deepspeed_config": "ds.json"}, "--deepspeed-config='ds.json': has no effect with -f torch"),
    ("jax", {"max_restarts": 2}, "--max-restarts=2: has no effect with -f jax"),
    ("tensorflow", {"rdzv": "c10d"}, "--rdzv='c10d': has no effect with -f tensorflow"),
    ("torch", {"use_fsdp": True}, "--use-fsdp=True: has no effect with -f torch"),
    ("deepspeed", {"deepspeed_launcher": "native", "max_restarts": 1}, "DeepSpeed's native launcher"),
    ("deepspeed", {"hostfile": "/tmp/h"}, "add --deepspeed-launcher native"),
    ("torch", {"deepspeed_launcher": "native"}, "--deepspeed-launcher='native': has no effect with -f torch"),
])
def test_options_the_launcher_would_ignore_are_errors(framework, spec, message):
    with pytest.raises(MeshrunError) as err:
        build(resolve({}, 0), LaunchSpec(framework, "train.py", **spec))
    assert message in str(err.value)
