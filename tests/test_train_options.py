"""`meshrun train`'s options come from one declaration each (config/sections.py): the flag and
its help, MESHRUN_<NAME>, the config-file key (flat or in its section) and the keyword of
meshrun.train() all follow from a field, and so do its checks."""

import dataclasses
import json
import os
import shutil
import subprocess
import sys

import pytest
from helpers import clean_env, meshrun

import meshrun as meshrun_pkg
from meshrun.config import TrainConfig, load_file, option_names
from meshrun.config.sections import SECTIONS
from meshrun.options import Option, kind, option_fields, spec

SRC = os.path.dirname(os.path.dirname(os.path.abspath(meshrun_pkg.__file__)))

# One line added to a section: nothing else of the package is touched
DECLARATION = ('    probe_depth: int = option(7, "a probe option that exists only in this test (default {default})", '
               'metavar="D", minimum=2)\n')


def _package_with_a_new_option(tmp_path) -> str:
    root = tmp_path / "pkg"
    shutil.copytree(os.path.join(SRC, "meshrun"), root / "meshrun", ignore=shutil.ignore_patterns("__pycache__"))
    sections = root / "meshrun" / "config" / "sections.py"
    text = sections.read_text()
    anchor = '    TITLE: ClassVar[str] = "schedule"\n\n'
    assert text.count(anchor) == 1
    sections.write_text(text.replace(anchor, anchor + DECLARATION))
    return str(root)


def _config_of(stdout: str) -> dict:
    return json.loads(json.loads(stdout)["env"]["MESHRUN_TRAIN_CONFIG"])


def test_a_field_added_to_a_section_is_a_flag_a_variable_a_config_key_and_a_keyword(tmp_path):
    pkg = _package_with_a_new_option(tmp_path)
    env = clean_env(PYTHONPATH=pkg)

    # --help-all: under its section, with its metavar and its help (the default filled in)
    help_text = meshrun("train", "--help-all", env=env).stdout
    schedule = " ".join(help_text.split("\nschedule:\n", 1)[1].split("\n\n", 1)[0].split())  # (unwrapped)
    assert "--probe-depth D" in schedule and "a probe option that exists only in this test (default 7)" in schedule

    # the flag, and its declared bound checked with the flag named
    out = meshrun("train", "--dry-run", "--json", "--probe-depth", "3", env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert _config_of(out.stdout)["probe_depth"] == 3
    out = meshrun("train", "--dry-run", "--probe-depth", "1", env=env)
    assert out.returncode == 2 and out.stderr.strip().splitlines()[-1] == \
        "meshrun: error: --probe-depth=1: must be at least 2"

    # MESHRUN_PROBE_DEPTH, converted and checked, its source named
    out = meshrun("train", "--dry-run", "--json", env={**env, "MESHRUN_PROBE_DEPTH": "5"})
    cfg = _config_of(out.stdout)
    assert (cfg["probe_depth"], cfg["sources"]["probe_depth"]) == (5, "env MESHRUN_PROBE_DEPTH")
    out = meshrun("train", "--dry-run", env={**env, "MESHRUN_PROBE_DEPTH": "deep"})
    assert out.returncode == 2 and "--probe-depth (from env MESHRUN_PROBE_DEPTH)='deep': expected int" in out.stderr

    # a --config key, flat and in its section's table
    flat, table = tmp_path / "flat.yaml", tmp_path / "table.toml"
    flat.write_text("probe-depth: 9\n")
    table.write_text("[schedule]\nprobe_depth = 11\nsteps = 3\n")
    for path, want in ((flat, 9), (table, 11)):
        out = meshrun("train", "--dry-run", "--json", "--config", str(path), env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        assert _config_of(out.stdout)["probe_depth"] == want

    # meshrun.train(probe_depth=...), through the same job (a dry run returns its launch)
    code = "import json, meshrun\nprint(json.dumps(meshrun.train(probe_depth=4, dry_run=True).dry_run.to_dict()))\n"
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    cfg = _config_of(res.stdout)
    assert (cfg["probe_depth"], cfg["sources"]["probe_depth"]) == (4, "meshrun.train")


def test_every_option_is_declared_with_help_a_type_and_a_section():
    names = option_names()
    assert len(names) == len(set(names)) == len(dataclasses.fields(TrainConfig)) - 1  # (sources)
    seen: list[str] = []
    for section in SECTIONS:
        own = [f.name for f in option_fields(section)]
        assert own and section.TITLE and callable(section.check)
        seen += own
    assert sorted(seen) == sorted(names)  # each option in exactly one section
    for f in option_fields(TrainConfig):
        s = spec(f)
        assert isinstance(s, Option) and s.help.strip() and kind(f) in ("bool", "int", "float", "str")
        if s.choices is not None:
            assert f.default in s.choices, f.name  # a default its own check would refuse is a declaration bug


def test_config_sections_and_their_errors(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("parallel:\n  tp: 2\nschedule:\n  steps: 4\nlr: 0.01\n")
    assert load_file(str(good)) == {"tp": 2, "steps": 4, "lr": 0.01}
    misplaced = tmp_path / "misplaced.toml"
    misplaced.write_text("[parallel]\nsteps = 4\n")
    out = meshrun("train", "--dry-run", "--config", str(misplaced))
    last = out.stderr.strip().splitlines()[-1]
    assert out.returncode == 2 and f"--config {misplaced} [parallel]='steps': unknown key in this section" in last
    assert "its keys are strategy, fsdp_shard_size, tp," in last
    twice = tmp_path / "twice.yaml"
    twice.write_text("steps: 3\nschedule:\n  steps: 4\n")
    out = meshrun("train", "--dry-run", "--config", str(twice))
    assert out.returncode == 2 and "duplicate key: the same option as 'steps'" in out.stderr


@pytest.mark.parametrize("value,said", [
    ("nan", "--lr (from env MESHRUN_LR)=nan: must be a finite number"),
    ("0", "--lr (from env MESHRUN_LR)=0.0: must be a finite number > 0"),
], ids=["nan", "zero"])
def test_a_float_from_a_variable_is_converted_and_checked(value, said):
    out = meshrun("train", "--dry-run", env=clean_env(MESHRUN_LR=value))
    assert out.returncode == 2 and said in out.stderr.strip().splitlines()[-1], out.stderr[-1000:]


def test_meshrun_train_reads_the_variables_under_its_keywords():
    """As on the command line: a keyword wins over MESHRUN_<NAME>, which wins over the default."""
    code = ("import json, meshrun\n"
            "print(json.dumps(meshrun.train(steps=6, dry_run=True).dry_run.to_dict()))\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env=clean_env(MESHRUN_STEPS="9", MESHRUN_LOG_EVERY="3"))
    assert res.returncode == 0, res.stderr[-2000:]
    cfg = _config_of(res.stdout)
    assert (cfg["steps"], cfg["log_every"]) == (6, 3)
    assert cfg["sources"]["log_every"] == "env MESHRUN_LOG_EVERY" and cfg["sources"]["steps"] == "meshrun.train"


def test_the_default_micro_batch_divides_a_small_global_batch():
    """With --global-batch and no --micro-batch, the rules' micro-batch is the default cut to
    the largest divisor of each rank's share: 2 sequences on one rank train as one micro-batch
    of 2, not a refusal for missing a micro-batch of 8."""
    from meshrun.config import TrainConfig

    cases = [(2, 1, 2, 1), (6, 2, 3, 1), (24, 2, 6, 2), (64, 2, 8, 4), (7, 1, 7, 1), (13, 1, 1, 13)]
    for global_batch, dp, micro, accum in cases:
        cfg = TrainConfig(global_batch=global_batch)
        assert (cfg.micro_for(dp), cfg.accumulation(dp)) == (micro, accum), (global_batch, dp)
    assert TrainConfig(global_batch=6, micro_batch=2).micro_for(1) == 2  # the user's stays
    assert TrainConfig().micro_for(4) == 8  # no --global-batch: the default
