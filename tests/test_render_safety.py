"""meshrun render passes the user's command to every node byte for byte, and refuses fields
that would break out of their place in the spec.

Each node's command is run the way its platform runs it (bash for the Slurm script, the
SkyPilot ``run`` script and the Saturn command; Kubernetes' own ``$(VAR)`` expansion and no
shell for a container's command), with a fake ``meshrun`` on PATH that prints its argv."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

import pytest
import yaml
from helpers import meshrun

from meshrun.errors import MeshrunError
from meshrun.render import RenderSpec, render
from meshrun.render.slurm import node_command

FAKE_MESHRUN = f"""#!{sys.executable}
import json, sys
print(json.dumps(sys.argv[1:]))
"""
# srun, blaunch: run the command after the launcher's own options, as each node would
FAKE_SRUN = f"""#!{sys.executable}
import os, sys
argv = sys.argv[1:]
i = argv.index("bash")
os.execvp(argv[i], argv[i:])
"""


@pytest.fixture
def pwned(tmp_path):
    return f"/tmp/PWNED_{uuid.uuid4().hex}"


def _args(pwned: str) -> list[str]:
    return ["--x=$HOME", "price=$5", f"$(touch {pwned})", f"`touch {pwned}`", "a'b", '"q"', "back`tick",
            "${HOME}", "$(NODE_RANK)", "$$", "a b", "", "it's \"$HOME\"", "\\$HOME", "--out=/runs/$SLURM_JOB_ID"]


@pytest.fixture
def bin_dir(tmp_path):
    d = tmp_path / "bin"
    d.mkdir()
    for name, text in (("meshrun", FAKE_MESHRUN), ("srun", FAKE_SRUN), ("blaunch", FAKE_SRUN)):
        (d / name).write_text(text)
        (d / name).chmod(0o755)
    return d


def _env(bin_dir) -> dict[str, str]:
    return {"PATH": f"{bin_dir}:{os.environ['PATH']}", "HOME": "/root-of-the-node", "SLURM_JOB_ID": "4242",
            "NODE_RANK": "1", "LSB_JOBID": "4242", "LSB_MCPU_HOSTS": "h1 8 h2 8"}


def _argv(res: subprocess.CompletedProcess) -> list[str]:
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


def _bash(cmd: str, bin_dir) -> list[str]:
    return _argv(subprocess.run(["bash", "-c", cmd], env=_env(bin_dir), capture_output=True, text=True, timeout=30))


def _k8s_expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of a container's command and args: ``$$`` is ``$``, ``$(VAR)``
    is VAR's value where the container defines VAR, anything else stays as written."""
    out, i = [], 0
    while i < len(arg):
        if arg[i] == "$" and i + 1 < len(arg):
            if arg[i + 1] == "$":
                out.append("$")
                i += 2
                continue
            if arg[i + 1] == "(":
                end = arg.find(")", i + 2)
                if end != -1:
                    name = arg[i + 2:end]
                    out.append(env[name] if name in env else arg[i:end + 1])
                    i = end + 1
                    continue
        out.append(arg[i])
        i += 1
    return "".join(out)


def _k8s_commands(text: str) -> list[tuple[list[str], dict[str, str]]]:
    out = []
    for doc in yaml.safe_load_all(text):
        if doc["kind"] == "Job":
            pods = [doc["spec"]["template"]["spec"]]
        elif doc["kind"] == "PyTorchJob":
            pods = [r["template"]["spec"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
        elif doc["kind"] == "JobSet":
            pods = [r["template"]["spec"]["template"]["spec"] for r in doc["spec"]["replicatedJobs"]]
        elif doc["kind"] == "TrainJob":
            pods = [{"containers": [doc["spec"]["trainer"]]}]
        else:
            continue
        for pod in pods:
            (c,) = pod["containers"]
            env = {e["name"]: e.get("value", "1") for e in c.get("env", [])}
            env.update(PET_NODE_RANK="1", MASTER_ADDR="head")  # what the training operator adds
            out.append((c["command"] + c.get("args", []), env))
    return out


def _exec(argv: list[str], bin_dir) -> list[str]:
    env = _env(bin_dir)
    return _argv(subprocess.run(argv, env=env, capture_output=True, text=True, timeout=30,
                                executable=os.path.join(str(bin_dir), argv[0])))


COMMANDS = [  # (command as given, the argv of meshrun it means)
    (lambda a: ("meshrun", "train", *a), lambda a: ["train", *a]),
    (lambda a: ("train.py", *a), lambda a: ["launch", "train.py", *a]),
]


@pytest.mark.parametrize("target", ["slurm", "slurm-requeue", "slurm-restarts", "skypilot", "saturn",
                                    "kubernetes", "pytorchjob", "trainjob", "jobset", "lsf-blaunch", "lsf-jsrun",
                                    "lsf-mpirun"])
@pytest.mark.parametrize("form", [0, 1], ids=["meshrun", "script"])
def test_every_node_runs_the_command_byte_for_byte(tmp_path, bin_dir, pwned, target, form):
    args = _args(pwned)
    command, expected = COMMANDS[form][0](args), COMMANDS[form][1](args)
    kw = {"image": "img:1", "name": "gpt"}
    if target.startswith("slurm"):
        kw.update(requeue=target == "slurm-requeue", max_restarts=2 if target == "slurm-restarts" else 0)
        text = render(RenderSpec("slurm", command, **kw))
        assert _bash(node_command(text), bin_dir) == expected
        script = tmp_path / "job.sbatch"
        script.write_text(text)
        # the whole script, as the batch host runs it: srun starts the node command
        res = subprocess.run(["bash", str(script)], env=_env(bin_dir), capture_output=True, text=True, timeout=30)
        assert _argv(res) == expected
    elif target.startswith("lsf"):
        from meshrun.render import lsf

        text = render(RenderSpec("lsf", command, name="gpt", launcher=target.split("-")[1]))
        assert _bash(lsf.node_command(text), bin_dir) == expected
        if target == "lsf-blaunch":  # the whole script, as the first execution host runs it
            script = tmp_path / "job.bsub"
            script.write_text(text)
            res = subprocess.run(["bash", str(script)], env=_env(bin_dir), capture_output=True, text=True, timeout=30)
            assert _argv(res) == expected
    elif target == "skypilot":
        task = yaml.safe_load(render(RenderSpec("skypilot", command, workdir=".", **kw)))
        assert _bash(task["run"], bin_dir) == expected
    elif target == "saturn":
        job = yaml.safe_load(render(RenderSpec("saturn", command, **kw)))
        assert _bash(job["spec"]["command"], bin_dir) == expected
    else:
        text = render(RenderSpec("kubernetes", command, kind="job" if target == "kubernetes" else target, **kw))
        runs = _k8s_commands(text)
        assert runs
        for argv, env in runs:
            argv = [_k8s_expand(a, env) for a in argv]
            assert argv[0] == "meshrun"
            assert _exec(argv, bin_dir) == expected
    assert not os.path.exists(pwned)


def test_the_cli_keeps_the_command_byte_for_byte(tmp_path, bin_dir, pwned):
    args = _args(pwned)
    out = meshrun("render", "slurm", "-o", str(tmp_path / "job.sbatch"), "--", "meshrun", "train", *args)
    assert out.returncode == 0, out.stderr
    assert _bash(node_command((tmp_path / "job.sbatch").read_text()), bin_dir) == ["train", *args]
    assert not os.path.exists(pwned)


def test_hostfile_lines_are_the_hosts():
    assert render(RenderSpec("hostfile", (), gpus_per_node=2, hosts=("10.0.0.1", "node-2", "fe80::1"))) == \
        "10.0.0.1 slots=2\nnode-2 slots=2\nfe80::1 slots=2\n"


# ---- fields that would escape their place in the spec --------------------------------------

CONTROL = ["x\ny", "x\ry", "x\ty", "x\x00y", "x\x1by", "x\x7fy", "x\u2028y", "x\x85y"]
FIELDS = [  # (target, RenderSpec field, its option)
    ("slurm", "name", "--name"), ("slurm", "partition", "--partition"), ("slurm", "time", "--time"),
    ("slurm", "image", "--image"), ("skypilot", "accelerator", "--accelerator"), ("skypilot", "name", "--name"),
    ("kubernetes", "namespace", "--namespace"), ("kubernetes", "name", "--name"), ("kubernetes", "image", "--image"),
    ("saturn", "name", "--name"), ("saturn", "image", "--image"), ("slurm", "setup", "--setup"),
    ("skypilot", "workdir", "--workdir"), ("skypilot", "volume", "--volume"), ("lsf", "launcher", "--launcher"),
]


def _spec(target: str, **kw) -> RenderSpec:
    base = {"image": "img:1", "name": "gpt"} if target in ("kubernetes", "saturn") else {}
    if target == "hostfile":
        base["hosts"] = ("a", "b")
    return RenderSpec(target, kw.pop("command", ("meshrun", "train")), **{**base, **kw})


# A setup is a script: its newlines and tabs are its own (test_setup_keeps_its_lines)
FIELD_CASES = [pytest.param(target, field, flag, bad, id=f"{target}-{field}-{bad!r}")
               for target, field, flag in FIELDS for bad in CONTROL
               if not (field == "setup" and bad in ("x\ny", "x\ty"))]


@pytest.mark.parametrize("target,field,flag,bad", FIELD_CASES)
def test_control_characters_are_refused_in_every_field(target, field, flag, bad):
    with pytest.raises(MeshrunError) as e:
        render(_spec(target, **{field: bad}))
    msg = str(e.value)
    assert msg.startswith(f"{flag}={bad!r}: contains a control character") and "(hint: " in msg
    assert "\n" not in msg


@pytest.mark.parametrize("target", ["slurm", "skypilot", "kubernetes", "saturn"])
def test_control_characters_are_refused_in_the_command(target):
    with pytest.raises(MeshrunError) as e:
        render(_spec(target, command=("meshrun", "train", "--out", "a\nb")))
    assert str(e.value).startswith("command='a\\nb': contains a control character")


def test_control_characters_are_refused_in_hosts():
    with pytest.raises(MeshrunError, match=r"^--hosts='b\\nc': contains a control character"):
        render(_spec("hostfile", hosts=("a", "b\nc")))


def test_setup_keeps_its_lines():
    text = render(_spec("slurm", setup="pip install a\n\tpip install b"))
    assert "pip install a\n\tpip install b\n" in text


@pytest.mark.parametrize("value", ["60", "90:30", "04:00:00", "2-12", "2-12:30", "2-12:30:00", "UNLIMITED", "0"])
def test_slurm_time_formats(value):
    assert f"#SBATCH --time={value}\n" in render(_spec("slurm", time=value))


@pytest.mark.parametrize("target,kw,message", [
    ("slurm", {"time": "1:2:3:4"}, "--time='1:2:3:4': is not a Slurm time limit"),
    ("slurm", {"time": "4h"}, "--time='4h': is not a Slurm time limit"),
    ("slurm", {"time": "1-"}, "--time='1-': is not a Slurm time limit"),
    ("slurm", {"time": ""}, "--time='': is not a Slurm time limit"),
    ("slurm", {"cpus_per_task": 0}, "--cpus-per-task=0: must be >= 1"),
    ("slurm", {"cpus_per_task": -3}, "--cpus-per-task=-3: must be >= 1"),
    ("slurm", {"partition": "gpu debug"}, "--partition='gpu debug': is not a Slurm partition name"),
    ("slurm", {"name": "my job"}, "--name='my job': is not a job name"),
    ("slurm", {"name": "a%j/b"}, "--name='a%j/b': is not a job name"),
    ("slurm", {"image": "img:1 --x"}, "--image='img:1 --x': is not a container image reference"),
    ("slurm", {"image": "$(id)"}, "--image='$(id)': is not a container image reference"),
    ("kubernetes", {"namespace": "my team"}, "--namespace='my team': is not a Kubernetes namespace"),
    ("kubernetes", {"namespace": "ML"}, "--namespace='ML': is not a Kubernetes namespace"),
    ("skypilot", {"accelerator": "H100:x"}, "--accelerator='H100:x': is not an accelerator"),
    ("skypilot", {"accelerator": "H100:0"}, "--accelerator='H100:0': is not an accelerator"),
    ("skypilot", {"accelerator": "H 100"}, "--accelerator='H 100': is not an accelerator"),
    ("skypilot", {"accelerator": "H100:4"},
     "--accelerator='H100:4': asks for 4 GPUs per node but --gpus-per-node is 8"),
    ("hostfile", {"gpus_per_node": 0}, "--gpus-per-node=0: a hostfile needs at least one slot per host"),
    ("hostfile", {"hosts": ("a", "", "b")}, "--hosts='a,,b': has an empty host name"),
    ("hostfile", {"hosts": ("a b",)}, "--hosts='a b': is not a host name or IP address"),
    ("hostfile", {"hosts": ("$(id)",)}, "--hosts='$(id)': is not a host name or IP address"),
])
def test_fields_in_their_target_syntax(target, kw, message):
    with pytest.raises(MeshrunError) as e:
        render(_spec(target, **kw))
    assert str(e.value).startswith(message) and "(hint: " in str(e.value)


def test_cpus_per_task_and_accelerator_as_given():
    assert "#SBATCH --cpus-per-task=2\n" in render(_spec("slurm", cpus_per_task=2))
    task = yaml.safe_load(render(_spec("skypilot", accelerator="A100:4", gpus_per_node=4)))
    assert task["resources"]["accelerators"] == "A100:4"


@pytest.mark.parametrize("args,message", [
    (["slurm", "--time", "1:2:3:4"], "--time='1:2:3:4': is not a Slurm time limit (hint: "),
    (["slurm", "--name", "x\n#SBATCH --x"], "--name='x\\n#SBATCH --x': contains a control character"),
    (["slurm", "--partition", "gpu\nrm -rf /"], "--partition='gpu\\nrm -rf /': contains a control character"),
    (["slurm", "--cpus-per-task", "0"], "--cpus-per-task=0: must be >= 1"),
    (["hostfile", "--hosts", "a,,b"], "--hosts='a,,b': has an empty host name"),
    (["hostfile", "--hosts", "a,b", "--gpus-per-node", "0"], "--gpus-per-node=0: a hostfile needs"),
    (["skypilot", "--accelerator", "H100:x"], "--accelerator='H100:x': is not an accelerator"),
    (["kubernetes", "--image", "i", "--namespace", "a b"], "--namespace='a b': is not a Kubernetes namespace"),
])
def test_cli_refuses_with_one_line(args, message):
    cmd = [] if args[0] == "hostfile" else ["--", "meshrun", "train"]
    out = meshrun("render", *args, *cmd)
    assert out.returncode == 2
    err = out.stderr.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("meshrun: error: " + message), out.stderr
