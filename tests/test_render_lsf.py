"""meshrun render lsf: the bsub script in LSF's grammar for each launcher (no bsub installs here:
each #BSUB option and the launch line are parsed and every value checked), and the script run
by bash under LSF's variables, with stand-ins for blaunch and mpirun that start the tasks as
they do; each task's environment then resolves, through meshrun's own detection, to its own
node of the job."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys

import pytest
from helpers import meshrun

from meshrun.cluster.detect import resolve
from meshrun.render import RenderSpec, render
from meshrun.render import lsf as lsf_render

TRAIN = ("meshrun", "train", "--out", "/gpfs/run1", "--steps", "10")

# #BSUB option -> the pattern of its value (bsub(1)); -n, -nnodes, -R and -gpu also checked
# against the job below
BSUB = {
    "-J": r"[A-Za-z0-9][A-Za-z0-9_.-]*",
    "-n": r"[1-9][0-9]*",
    "-nnodes": r"[1-9][0-9]*",
    "-R": r"span\[ptile=[1-9][0-9]*\]",
    "-gpu": r"num=[1-9][0-9]*/host",
    "-o": r"[A-Za-z0-9_.-]+-%J\.out",
    "-W": r"([0-9]+:)?[0-9]+",
    "-q": r"[A-Za-z0-9_.-]+",
    "-P": r"[A-Za-z0-9_.-]+",
}


def bsub_options(text: str) -> dict[str, str]:
    """The #BSUB lines as bsub reads them (each one option and its value, shell-quoted),
    all before the script's first command, no option twice."""
    lines = text.splitlines()
    assert lines[0] == "#!/bin/bash"
    first_cmd = next(i for i, line in enumerate(lines) if line and not line.startswith("#"))
    options: dict[str, str] = {}
    for i, line in enumerate(lines):
        if not line.startswith("#BSUB"):
            continue
        assert i < first_cmd, line  # bsub stops reading #BSUB lines at the first command
        words = shlex.split(line)
        assert len(words) == 3 and words[0] == "#BSUB", line
        option, value = words[1], words[2]
        assert option in BSUB and option not in options, line
        assert re.fullmatch(BSUB[option], value), line
        options[option] = value
    return options


def launch_argv(text: str) -> list[str]:
    """The launch line (its continuation joined) as the shell splits it, with its command
    substitution left as written."""
    lines = text.splitlines()
    i = next(i for i, line in enumerate(lines) if line.startswith(("blaunch ", "jsrun ", "mpirun ")))
    assert lines[i].endswith(" \\") and lines[i + 1].startswith("  bash -c ")
    return shlex.split(lines[i][:-2] + " " + lines[i + 1].strip())


def check_blaunch(argv: list[str], spec: RenderSpec) -> list[str]:
    """blaunch [-n] [-u host_file | -z host ... | host] [-use-login-shell | -no-shell] command ..."""
    assert argv[0] == "blaunch"
    assert argv[1:3] == ["-u", "$hostfile"]  # the one form that names every host, each once
    return argv[3:]


def check_jsrun(argv: list[str], spec: RenderSpec) -> list[str]:
    """jsrun's resource-set options, each with a value: -n sets, -r per host, -a tasks each,
    -c CPUs (a count or ALL_CPUS), -g GPUs."""
    assert argv[0] == "jsrun"
    values = {}
    i = 1
    while argv[i].startswith("-"):
        option, value = argv[i], argv[i + 1]
        assert option in ("-n", "-r", "-a", "-c", "-g") and option not in values, argv
        assert re.fullmatch(r"[1-9][0-9]*" + ("|ALL_CPUS" if option == "-c" else ""), value), argv
        values[option] = value
        i += 2
    assert values["-n"] == str(spec.nodes) and values["-r"] == "1" and values["-a"] == "1"
    assert values.get("-g") == (str(spec.gpus_per_node) if spec.gpus_per_node else None)
    return argv[i:]


def check_mpirun(argv: list[str], spec: RenderSpec) -> list[str]:
    """Open MPI's mpirun: -n count, --map-by ppr:N:node, --hostfile FILE, -x NAME=VALUE."""
    assert argv[0] == "mpirun"
    values: dict[str, str] = {}
    i = 1
    while argv[i].startswith("-"):
        option, value = argv[i], argv[i + 1]
        assert option in ("-n", "--map-by", "--hostfile", "-x") and option not in values, argv
        values[option] = value
        i += 2
    assert values["-n"] == str(spec.nodes) and values["--map-by"] == "ppr:1:node"
    assert values["--hostfile"] == "$hostfile"
    assert values["-x"] == "MASTER_ADDR=$master"  # node 0's address to every rank (run below)
    return argv[i:]


CHECK = {"blaunch": check_blaunch, "jsrun": check_jsrun, "mpirun": check_mpirun}
JOBS = [dict(nodes=4, gpus_per_node=8), dict(nodes=2, gpus_per_node=0), dict(nodes=1, gpus_per_node=1),
        dict(nodes=3, gpus_per_node=6, time="4:00", partition="gpu", account="ml-team", name="gpt.1")]


@pytest.mark.parametrize("launcher", ["blaunch", "jsrun", "mpirun"])
@pytest.mark.parametrize("job", JOBS, ids=lambda job: "-".join(f"{k}={v}" for k, v in job.items()))
def test_bsub_lines_and_launch_line_in_lsfs_grammar(tmp_path, launcher, job):
    spec = RenderSpec("lsf", TRAIN, launcher=launcher, **job)
    text = render(spec)
    path = tmp_path / "job.bsub"
    path.write_text(text)
    assert subprocess.run(["bash", "-n", str(path)], capture_output=True).returncode == 0
    opts = bsub_options(text)
    assert opts["-J"] == spec.name and opts["-o"] == f"{spec.name}-%J.out"
    if launcher == "jsrun":  # IBM CSM: whole nodes; jsrun divides them
        assert opts["-nnodes"] == str(spec.nodes)
        assert not {"-n", "-R", "-gpu"} & set(opts)
    else:  # a slot for each GPU, as many on every host, and the host's GPUs
        per_host = max(1, spec.gpus_per_node)
        assert "-nnodes" not in opts
        assert (opts["-n"], opts["-R"]) == (str(spec.nodes * per_host), f"span[ptile={per_host}]")
        assert opts.get("-gpu") == (f"num={spec.gpus_per_node}/host" if spec.gpus_per_node else None)
    assert (opts.get("-W"), opts.get("-q"), opts.get("-P")) == (spec.time, spec.partition, spec.account)
    command = CHECK[launcher](launch_argv(text), spec)
    assert command == ["bash", "-c", "exec " + shlex.join(TRAIN)]
    assert lsf_render.node_command(text) == "exec " + shlex.join(TRAIN)


# ---- the script as LSF runs it -----------------------------------------------------------------

# blaunch -u FILE COMMAND...: one task per line of FILE, LSF_PM_TASKID = its line number from 1;
# each task's environment and argv are recorded, as the task on that host would have them
FAKE_BLAUNCH = f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
assert args[0] == "-u", args
hosts = open(args[1]).read().split()
for i, host in enumerate(hosts):
    env = dict(os.environ, LSF_PM_TASKID=str(i + 1))
    print(json.dumps({{"host": host, "env": env, "argv": args[2:]}}))
"""
# mpirun -n N --map-by ppr:1:node --hostfile FILE -x NAME=VALUE COMMAND...: rank i on the
# file's host i (one per node, in the file's order), with Open MPI's variables and -x's
FAKE_MPIRUN = f"""#!{sys.executable}
import json, os, sys
args = sys.argv[1:]
opts = {{}}
while args[0].startswith("-"):
    opts[args[0]] = args[1]
    args = args[2:]
assert opts["--map-by"] == "ppr:1:node", opts
hosts = open(opts["--hostfile"]).read().split()[:int(opts["-n"])]
name, _, value = opts["-x"].partition("=")
for i, host in enumerate(hosts):
    env = dict(os.environ, OMPI_COMM_WORLD_SIZE=str(len(hosts)), OMPI_COMM_WORLD_RANK=str(i),
               OMPI_COMM_WORLD_LOCAL_SIZE="1", OMPI_COMM_WORLD_LOCAL_RANK="0",
               OMPI_MCA_ess_base_jobid="12345", **{{name: value}})
    print(json.dumps({{"host": host, "env": env, "argv": args}}))
"""


@pytest.fixture
def bin_dir(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    for name, text in (("blaunch", FAKE_BLAUNCH), ("mpirun", FAKE_MPIRUN)):
        (d / name).write_text(text)
        (d / name).chmod(0o755)
    return d


def run_job(tmp_path, bin_dir, launcher: str, nodes: int, lsf_env: dict[str, str]) -> subprocess.CompletedProcess:
    path = tmp_path / "job.bsub"
    path.write_text(render(RenderSpec("lsf", TRAIN, launcher=launcher, nodes=nodes, gpus_per_node=4)))
    (tmp_path / "tmp").mkdir()
    env = {"PATH": f"{bin_dir}:{os.environ['PATH']}", "TMPDIR": str(tmp_path / "tmp"), "LSB_JOBID": "4242", **lsf_env}
    return subprocess.run(["bash", str(path)], env=env, capture_output=True, text=True, timeout=30)


# what LSF gives a job of -n 12 span[ptile=4] on three hosts (the script runs on the first)
MCPU = {"LSB_MCPU_HOSTS": "gpu07 4 gpu02 4 gpu11 4"}
ONE_SLOT_EACH = {"LSB_MCPU_HOSTS": "gpu07 1 gpu02 1 gpu11 1"}  # ptile=1: no host is dropped


def rankfile_env(tmp_path) -> dict[str, str]:
    path = tmp_path / "rankfile"
    path.write_text("".join(f"{h}\n" * 4 for h in ("gpu07", "gpu02", "gpu11")))
    return {"LSB_DJOB_RANKFILE": str(path), "LSB_MCPU_HOSTS": "stale 4 list 4 here 4"}  # the rankfile wins


@pytest.mark.parametrize("launcher", ["blaunch", "mpirun"])
@pytest.mark.parametrize("case", ["mcpu", "one-slot-each", "rankfile"])
def test_each_host_runs_one_node_of_the_job(tmp_path, bin_dir, launcher, case):
    """The script starts one task per host, and each task resolves (meshrun's lsf platform for a
    blaunch task, its mpi platform for an mpirun rank) to that host's node: node ranks in LSF's
    host order, three nodes, the first host the master, one port."""
    lsf_env = {"mcpu": MCPU, "one-slot-each": ONE_SLOT_EACH, "rankfile": rankfile_env(tmp_path)}[case]
    res = run_job(tmp_path, bin_dir, launcher, 3, lsf_env)
    assert res.returncode == 0, res.stderr
    tasks = [json.loads(line) for line in res.stdout.splitlines()]
    assert [t["host"] for t in tasks] == ["gpu07", "gpu02", "gpu11"]
    for rank, task in enumerate(tasks):
        assert task["argv"] == ["bash", "-c", "exec " + shlex.join(TRAIN)]
        topo = resolve(task["env"], gpus=4)
        assert topo.platform == ("lsf" if launcher == "blaunch" else "mpi")
        assert (topo.nnodes, topo.node_rank, topo.nproc_per_node, topo.master_addr) == (3, rank, 4, "gpu07"), topo
        if launcher == "blaunch":
            assert topo.hosts == ("gpu07", "gpu02", "gpu11")
    assert len({resolve(t["env"], gpus=4).master_port for t in tasks}) == 1
    assert os.listdir(tmp_path / "tmp") == []  # the host file is gone with the script


@pytest.mark.parametrize("launcher", ["blaunch", "mpirun"])
def test_a_job_with_other_hosts_than_asked_stops_before_launching(tmp_path, bin_dir, launcher):
    res = run_job(tmp_path, bin_dir, launcher, 2, MCPU)
    assert res.returncode == 1 and res.stdout == ""
    assert res.stderr.strip() == "meshrun: the job has 3 host(s), not 2: gpu07 gpu02 gpu11"


def test_the_cli_writes_an_executable_script_per_launcher(tmp_path):
    for launcher in ("blaunch", "jsrun", "mpirun"):
        path = tmp_path / f"{launcher}.bsub"
        res = meshrun("render", "lsf", "--launcher", launcher, "-o", str(path), "--", *TRAIN)
        assert res.returncode == 0, res.stderr
        assert os.access(path, os.X_OK) and launch_argv(path.read_text())[0] == launcher
