"""Platforms users add (tests/userpkg/platforms.py): registered with MESHRUN_PLATFORMS or the entry-point
group meshrun.platforms, tried before the built-in ones; a bad registration is one line, exit 2."""

import json
import os
import subprocess
import sys

import pytest
from helpers import clean_env, meshrun, script
from platform_envs import SLURM

from meshrun.cluster.detect import resolve
from meshrun.errors import MeshrunError

TESTS = os.path.dirname(os.path.abspath(__file__))
BORG = {"BORG_TASK_COUNT": "2", "BORG_TASK_INDEX": "1", "BORG_HOSTS": "b0.cell,b1.cell", "BORG_JOB": "j42"}
USER = {"MESHRUN_PLATFORMS": "userpkg.platforms:Borg"}


def user_env(**extra: str) -> dict[str, str]:
    """A clean environment in which tests/ (hence userpkg) is importable."""
    return clean_env(PYTHONPATH=os.pathsep.join(p for p in (TESTS, os.environ.get("PYTHONPATH", "")) if p), **extra)


def test_user_platform_is_detected_by_meshrun_env():
    out = meshrun("env", "--json", env=user_env(**USER, **BORG))
    assert out.returncode == 0, out.stderr
    assert out.stderr == ""  # no warning about MESHRUN_PLATFORMS
    data = json.loads(out.stdout)
    assert (data["platform"], data["nnodes"], data["node_rank"], data["nproc_per_node"]) == ("borg", 2, 1, 1)
    assert (data["master_addr"], data["master_port"], data["hosts"], data["run_id"]) == (
        "b0.cell", 29777, ["b0.cell", "b1.cell"], "j42")
    assert data["sources"]["platform"] == "detected (BORG_TASK_COUNT and BORG_TASK_INDEX set)"
    assert data["sources"]["node_rank"] == "env BORG_TASK_INDEX"
    assert data["sources"]["hosts"] == "env BORG_HOSTS"
    table = meshrun("env", env=user_env(**USER, **BORG))
    assert table.returncode == 0 and "meshrun topology (borg)" in table.stdout and "BORG_TASK_INDEX" in table.stdout


def test_user_platform_drives_a_dry_run_without_torch():
    code = ("import sys\nfrom meshrun.cli import main\n"
            f"code = main(['launch', '--dry-run', '--json', {script('torch_allreduce.py')!r}])\n"
            "print('torch' in sys.modules)\nsys.exit(code)\n")
    res = subprocess.run([sys.executable, "-c", code], env=user_env(**USER, **BORG), capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    *plan, torch_loaded = res.stdout.strip().splitlines()
    assert torch_loaded == "False"
    data = json.loads("\n".join(plan))
    assert "--nnodes=2" in data["argv"] and "--node_rank=1" in data["argv"]
    assert "--master_addr=b0.cell" in data["argv"] and "--master_port=29777" in data["argv"]
    assert data["env"]["MESHRUN_HOSTS"] == "b0.cell,b1.cell"


def test_without_its_marker_the_built_ins_detect():
    out = meshrun("env", "--json", env=user_env(**USER, **SLURM))
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["platform"] == "slurm"
    assert json.loads(meshrun("env", "--json", env=user_env(**USER)).stdout)["platform"] == "local"


def test_user_platforms_come_before_the_built_ins_and_answer_to_platform():
    env = {**USER, **BORG, **SLURM}
    assert resolve(env, 0).platform == "borg"
    assert resolve(env, 0, platform="slurm").platform == "slurm"
    t = resolve({**USER, **SLURM, **BORG}, 0, platform="borg")
    assert (t.platform, t.source("platform")) == ("borg", "flag --platform")
    with pytest.raises(MeshrunError, match="choose one of torchrun, borg, lsf"):
        resolve(USER, 0, platform="nope")
    with pytest.raises(MeshrunError, match="borg is recognised by BORG_TASK_COUNT and BORG_TASK_INDEX"):
        resolve(USER, 0, platform="borg")


def test_a_torchrun_workers_own_variables_win_over_a_user_platform():
    """Inside a worker torchrun started on the user's cluster, both sets of variables are there;
    the worker's are the truth for it (its rank, its world)."""
    worker = {"TORCHELASTIC_RUN_ID": "r1", "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2",
              "GROUP_RANK": "1", "MASTER_ADDR": "b0.cell", "MASTER_PORT": "29777"}
    t = resolve({**USER, **BORG, **worker}, 0)
    assert (t.platform, t.is_worker, t.local_rank) == ("torchrun", True, 1)


def test_user_platform_gives_its_master_hint():
    with pytest.raises(MeshrunError, match=r"platform borg \(hint: set BORG_HOSTS to every task's host"):
        resolve({**USER, "BORG_TASK_COUNT": "2", "BORG_TASK_INDEX": "1"}, 0)
    with pytest.raises(MeshrunError, match=r"hint: pass --master-addr \(or set MASTER_ADDR\)"):
        resolve({"NNODES": "2", "NODE_RANK": "1"}, 0)  # the base's default (generic sets none)


BAD = [
    ("userpkg.nosuch:Borg", "module userpkg.nosuch is not importable"),
    ("userpkg.platforms:Nope", "module userpkg.platforms has no Nope"),
    ("userpkg.platforms:NotAPlatform", "NotAPlatform is not a subclass of Platform"),
    ("userpkg.platforms:Exploding", "its detect() raised RuntimeError: quota service unreachable second line"),
    ("userpkg.platforms:Exiting", "its detect() called sys.exit(0)"),
    ("userpkg.platforms:Interrupting", "its detect() raised KeyboardInterrupt"),
    ("userpkg.platforms", "is not module:Class"),
    ("userpkg.platforms:SlurmAgain", "its NAME 'slurm' is already the name of a built-in platform"),
]


@pytest.mark.parametrize("value,problem", BAD, ids=[v for v, _ in BAD])
def test_bad_registration_is_one_line_and_exit_2(value, problem):
    out = meshrun("env", env=user_env(MESHRUN_PLATFORMS=f"userpkg.platforms:Borg,{value}"))
    assert out.returncode == 2, out.stdout
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith(f"meshrun: error: env MESHRUN_PLATFORMS={value!r}: {problem}"), lines[0]
    assert "(hint: " in lines[0] and out.stdout == ""


def test_what_a_platform_prints_leaves_json_output_whole():
    """`meshrun env --json` and `meshrun train --dry-run --json` print one JSON document, whatever
    a user platform prints while it detects (its lines go to stderr)."""
    env = user_env(MESHRUN_PLATFORMS="userpkg.platforms:Chatty")
    for args in (["env", "--json"], ["train", "--dry-run", "--json", "--nproc", "1"]):
        out = meshrun(*args, env=env)
        assert out.returncode == 0, out.stderr
        json.loads(out.stdout)
        assert "chatty: looking for my variables" in out.stderr


def test_bad_registration_in_the_library_is_a_meshrun_error():
    with pytest.raises(MeshrunError, match="env MESHRUN_PLATFORMS='userpkg.platforms:Exploding'"):
        resolve({"MESHRUN_PLATFORMS": "userpkg.platforms:Exploding"}, 0)


def dist_info(root, entry_points: str) -> str:
    """An installed-looking distribution (metadata only) under ``root``: importlib.metadata finds
    a *.dist-info directory in any sys.path entry, no network or pip needed."""
    info = root / "borg_platform-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: borg-platform\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(f"[meshrun.platforms]\n{entry_points}\n")
    return str(root)


def test_entry_point_registers_a_platform(tmp_path):
    path = os.pathsep.join((dist_info(tmp_path, "borg = userpkg.platforms:Borg"), TESTS))
    env = clean_env(PYTHONPATH=path, **BORG)
    out = meshrun("env", "--json", env=env)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert (data["platform"], data["nnodes"], data["node_rank"], data["master_addr"]) == ("borg", 2, 1, "b0.cell")
    assert json.loads(meshrun("env", "--json", env=clean_env(PYTHONPATH=path, **SLURM)).stdout)["platform"] == "slurm"
    # registered both ways, the class counts once
    both = meshrun("env", "--json", env={**env, **USER})
    assert both.returncode == 0 and json.loads(both.stdout)["platform"] == "borg", both.stderr


def test_bad_entry_point_names_itself(tmp_path):
    path = os.pathsep.join((dist_info(tmp_path, "plain = userpkg.platforms:NotAPlatform"), TESTS))
    out = meshrun("env", env=clean_env(PYTHONPATH=path))
    assert out.returncode == 2
    lines = out.stderr.splitlines()
    assert len(lines) == 1, out.stderr
    assert lines[0].startswith("meshrun: error: entry point plain (group meshrun.platforms)="
                               "'userpkg.platforms:NotAPlatform': NotAPlatform is not a subclass of Platform"), lines[0]
