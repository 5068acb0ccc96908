"""The CLI as a user meets it: help, env, dry runs, and one-line errors with exit code 2."""

import json
import os
import re
import socket
import subprocess
import sys

import pytest
from helpers import clean_env, meshrun, meshrun_here, script, started_by_shell
from platform_envs import SATURN, SKYPILOT, SLURM

TRAIN = script("torch_allreduce.py")


def test_help_teaches_with_examples():
    top = meshrun("--help")
    assert top.returncode == 0 and "meshrun launch" in top.stdout and "MESHRUN_" in top.stdout
    launch = meshrun("launch", "--help")
    assert launch.returncode == 0
    for words in ("examples:", "--num_processes=N*G (GLOBAL)", "--dry-run", "jax_initialize", "--nnodes 1:4"):
        assert words in launch.stdout
    assert "examples:" in meshrun("env", "--help").stdout


def _commands(parser, path=()):
    """Every command and subcommand of ``parser``, as the words that name it."""
    import argparse

    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield (*path, name)
                yield from _commands(sub, (*path, name))


def _all_commands():
    from meshrun.cli import make_parser

    return list(_commands(make_parser()))


# reST and Markdown that would show as such in a terminal: ``literal``, `code`, :func:`x`,
# **bold**, [text](link)
MARKUP = re.compile(r"`|:[a-z]+:`|\*\*\w|\]\(")


@pytest.mark.parametrize("words", [(), *_all_commands(), ("train", "--help-all")],
                         ids=lambda words: " ".join(words) or "meshrun")
def test_no_help_shows_markup(words, monkeypatch):
    monkeypatch.setenv("COLUMNS", "80")
    args = list(words) if "--help-all" in words else [*words, "--help"]
    out = meshrun_here(*args)
    assert out.returncode == 0 and out.stdout.startswith("usage: meshrun"), out.stderr
    marked = [line for line in out.stdout.splitlines() if MARKUP.search(line)]
    assert not marked, marked


def test_top_help_names_every_command_platform_and_render_target(monkeypatch):
    from meshrun.cli import COMMANDS
    from meshrun.cluster.detect import PLATFORMS
    from meshrun.render import TARGETS

    monkeypatch.setenv("COLUMNS", "80")
    text = meshrun_here("--help").stdout
    for name in COMMANDS:
        assert f"\n  meshrun {name} " in text, name
    render = text.split("\n  meshrun render ", 1)[1].split("\n  meshrun doctor ", 1)[0]
    assert set(TARGETS) <= set(re.findall(r"[\w-]+", render)), render
    assert "LSF" in render
    platforms = text.split("\nplatforms", 1)[1].split("\n\n", 1)[0]
    assert set(PLATFORMS) <= set(re.findall(r"[\w-]+", platforms)), platforms
    assert "COMMAND ..." in text.splitlines()[0]


def test_train_help_lists_the_common_options_and_help_all_every_one(monkeypatch):
    from meshrun.cli import command_parser, make_parser

    monkeypatch.setenv("COLUMNS", "80")
    short, full = meshrun_here("train", "--help"), meshrun_here("train", "--help-all")
    assert short.returncode == full.returncode == 0
    lines = short.stdout.splitlines()
    listed = [line.split()[0] for line in lines if line.startswith("  --")]
    assert 15 <= len(listed) <= 30 and len(lines) <= 60, short.stdout
    assert "meshrun train --help-all" in short.stdout and "docs/guide.md" in short.stdout
    # every option: in --help-all, and in the guide's reference of them
    guide = open(os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "guide.md")).read()
    reference = guide.split("#### Every option of `meshrun train`", 1)[1].split("\n### ", 1)[0]
    rows = [line for line in reference.splitlines() if line.startswith("| `--")]
    parser = command_parser(make_parser("train"), "train")
    options = [a for a in parser._actions if a.option_strings and not {"-h", "--help-all"} & set(a.option_strings)]
    assert len(options) > 50 and len(rows) == len(options)
    for action in options:
        first, *others = [name for name in action.option_strings if "_" not in name]
        assert re.search(rf"(?m)^  {first}\b", full.stdout), first
        assert any(re.match(rf"\| `{first}[ `]", row) for row in rows), first
        for other in others:
            assert f", {other}" in full.stdout and any(f"`{other}`" in row for row in rows), other
    assert set(listed) <= {name for a in options for name in a.option_strings}


def test_launch_imports_only_what_it_runs():
    """`meshrun launch` starts on every node of a job at once: it imports its own command's
    modules, not the planner's, the renderers', the trainer's or torch (each host would pay
    for them before its launcher starts)."""
    code = ("import sys\nfrom meshrun.cli import main\n"
            f"code = main(['launch', '--dry-run', '--nproc', '2', {TRAIN!r}])\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('meshrun', 'torch', 'yaml')))\n"
            "sys.exit(code)\n")
    res = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    loaded = res.stdout.strip().splitlines()[-1]
    assert "'meshrun.cli.launch'" in loaded and "'meshrun.launch.build'" in loaded
    for module in ("torch", "yaml", "meshrun.plan", "meshrun.render", "meshrun.cli.train", "meshrun.cli.plan",
                   "meshrun.cli.bench", "meshrun.cli.render", "meshrun.modelinfo"):
        assert f"'{module}'" not in loaded, module
    # the other commands still register, and a misspelt one is still named with a hint
    assert "doctor" in meshrun("--help").stdout
    typo = meshrun("lanch", "x.py")
    assert typo.returncode == 2 and "lanch" in typo.stderr


def test_env_json_has_the_documented_keys():
    out = meshrun("env", "--json", env=clean_env(**SATURN))
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    for key in ("platform", "nnodes", "node_rank", "nproc_per_node", "world_size", "master_addr",
                "master_port", "hosts"):
        assert key in data
    assert (data["platform"], data["nnodes"], data["node_rank"]) == ("saturn", 2, 1)
    assert data["sources"]["node_rank"] == "env SATURN_JOB_RANK"


def test_env_table_shows_sources():
    out = meshrun("env", env=clean_env(**SLURM))
    assert out.returncode == 0
    assert "SLURM_NODEID" in out.stdout and "gpu07" in out.stdout


def test_dry_run_json_is_exact():
    out = meshrun("launch", "--dry-run", "--json", "--nproc", "4", "--nnodes=2", "--node_rank", "1",
                  "--master-addr", "10.0.0.1", "--master_port", "29511", TRAIN, "--lr", "0.1")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["argv"][0].endswith("torchrun")
    assert data["argv"][1:] == ["--nnodes=2", "--node_rank=1", "--nproc_per_node=4", "--master_addr=10.0.0.1",
                                "--master_port=29511", TRAIN, "--lr", "0.1"]
    assert data["env"]["MESHRUN_MASTER_PORT"] == "29511"


def test_meshrun_variables_act_as_flag_defaults_and_flags_win():
    env = clean_env(MESHRUN_NNODES="2", MESHRUN_NODE_RANK="1", MESHRUN_MASTER_ADDR="h0", MESHRUN_FRAMEWORK="accelerate")
    data = json.loads(meshrun("launch", "--dry-run", "--json", "--node-rank", "0", TRAIN, env=env).stdout)
    assert data["argv"][0].endswith("accelerate")
    assert "--machine_rank=0" in data["argv"] and "--num_machines=2" in data["argv"]
    src = json.loads(meshrun("env", "--json", env=env).stdout)["sources"]
    assert src["nnodes"] == "env MESHRUN_NNODES"


@pytest.mark.parametrize("framework,count", [("tensorflow", 2), ("torch", 1)])
def test_dry_run_text_is_the_shell_command_of_what_starts(framework, count, tmp_path):
    """The processes (TensorFlow: one per device, meshrun starts each; torch: torchrun) as shell
    text of lines of at most 100 columns, which bash runs into the processes the JSON lists."""
    args = ["launch", "--dry-run", "-f", framework, "--nnodes", "1", "--master-addr", "127.0.0.1", "--master-port",
            "29555"]
    text, told = meshrun_here(*args, TRAIN).stdout, json.loads(meshrun_here(*args, "--json", TRAIN).stdout)
    assert len(told["processes"]) == count and max(len(line) for line in text.splitlines()) <= 100, text
    got, want = started_by_shell(text, told["processes"], tmp_path)
    assert got == want and len(got) == count


ERRORS = [
    (["launch", "--platform", "borg", TRAIN], {}, "--platform='borg': unknown platform"),
    (["launch", "-f", "mxnet", TRAIN], {}, "--framework='mxnet': unknown framework"),
    (["launch", "missing_script.py"], {}, "script='missing_script.py': no such file"),
    (["launch", "--nnodes", "2", "--node-rank", "2", "--master-addr", "h", TRAIN], {},
     "flag --node-rank=2: node rank must be in 0..1"),
    (["launch", "--node-rank", "x", TRAIN], {}, "--node-rank='x': expected int"),
    (["env"], {**SATURN, "SATURN_JOB_RANK": "one"}, "env SATURN_JOB_RANK='one': not an integer"),
    (["env"], {**SKYPILOT, "SKYPILOT_NUM_NODES": "3"}, "env SKYPILOT_NUM_NODES=3: but SKYPILOT_NODE_IPS lists 2"),
    (["env"], {**SLURM, "SLURM_JOB_NODELIST": "gpu[1-"}, "env SLURM_JOB_NODELIST='gpu[1-': cannot parse"),
    (["launch", "--nproc", "3", TRAIN], {"CUDA_VISIBLE_DEVICES": "0,1"},
     "flag --nproc-per-node=3: is more processes than the 2 GPU(s)"),
    (["launch", "--nnodes", "0:2", TRAIN], {}, "must be >= 1"),
    (["launch", "--bogus", TRAIN], {}, "unrecognized arguments"),
    (["launch", "-f", "deepspeed", "--deepspeed-config", "nope.json", TRAIN], {}, "--deepspeed-config='nope.json'"),
    (["launch", "-f", "tensorflow", "--nnodes", "2", "--master-addr", "h", TRAIN], {},
     "TensorFlow's TF_CONFIG needs every node's address"),
]


@pytest.mark.parametrize("args,env,message", ERRORS)
def test_bad_input_is_one_line_exit_2(args, env, message):
    out = meshrun(*args, env=clean_env(**env))
    assert out.returncode == 2, out
    assert out.stderr.startswith("meshrun: error: ")
    assert message in out.stderr
    assert out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_port_in_use_on_master_is_refused():
    with socket.socket() as s:
        s.bind(("", 0))
        s.listen()
        port = s.getsockname()[1]
        out = meshrun("launch", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                      "--master-port", str(port), TRAIN)
    assert out.returncode == 2
    assert f"flag --master-port={port}: port {port} is already in use" in out.stderr


def test_missing_launcher_program_is_named():
    from meshrun.errors import MeshrunError
    from meshrun.launch.spawn import resolve_program

    with pytest.raises(MeshrunError, match="program 'deepspeed-nope' not found"):
        resolve_program("deepspeed-nope")


def test_every_launch_option_can_come_from_the_environment():
    env = clean_env(MESHRUN_RDZV="c10d", MESHRUN_MAX_RESTARTS="2", MESHRUN_DRY_RUN="1", MESHRUN_JSON="yes")
    out = meshrun("launch", "--nnodes", "2", "--master-addr", "h0", TRAIN, env=env)
    assert out.returncode == 0, out.stderr
    argv = json.loads(out.stdout)["argv"]
    assert "--rdzv_backend=c10d" in argv and "--max_restarts=2" in argv
    bad = meshrun("launch", TRAIN, env=clean_env(MESHRUN_RDZV="etcd"))
    assert bad.returncode == 2 and "env MESHRUN_RDZV='etcd': not one of static, c10d" in bad.stderr
    bad = meshrun("launch", TRAIN, env=clean_env(MESHRUN_MAX_RESTARTS="many"))
    assert bad.returncode == 2 and "env MESHRUN_MAX_RESTARTS='many': not an integer" in bad.stderr


def test_missing_script_argument_is_one_line():
    out = meshrun("launch")
    assert out.returncode == 2 and out.stderr.count("\n") == 1
    assert "required: script" in out.stderr
