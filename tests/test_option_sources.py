"""An option's value gets the same answer from every source a user has: the flag, its
MESHRUN_<NAME> variable, a config file's key and a ``meshrun.train(...)`` keyword. Either all
accept it, with the same value in the run, or all refuse it for the same reason, each naming
its own source. Every option of `meshrun train` (the training options, the job's and the
topology's), through the real CLI and API in dry runs."""

import json
import os
import re
from dataclasses import Field

import pytest
import yaml

import meshrun
from meshrun.cli import main
from meshrun.cluster.options import TopologyOptions
from meshrun.config import TrainConfig, _unique_key_loader
from meshrun.job import JobOptions
from meshrun.options import env_var, flag, kind, option_fields, spec

BASE = {"model_size": "gpt-tiny", "data": "random", "steps": "1", "nproc_per_node": "1"}
# where the dry run's JSON shows each declaration's accepted values
SHOWN = {TrainConfig: "config", JobOptions: "job", TopologyOptions: "topology"}
# --dry-run and --json are how this test runs the job without running it: their bad values are
# refused in tests/test_bad_input.py
HOW_IT_RUNS = ("dry_run", "json")
FIELDS: dict[str, tuple[type, Field]] = {f.name: (cls, f) for cls in SHOWN for f in option_fields(cls)
                                         if f.name not in HOW_IT_RUNS}
PROBES = {"platform": ["local", "generic", "bogus"], "nnodes": ["1", "2", "0", "x", "1:2"]}


def probes(name: str) -> list[str]:
    """Values as a user types them: good ones, and ones each kind of check refuses."""
    f = FIELDS[name][1]
    k, s = kind(f), spec(f)
    if name in PROBES:
        return PROBES[name]
    if s.choices:
        return [s.choices[0], s.choices[-1], "bogus"]
    return {"int": ["-1", "0", "2", "abc", "1.5"], "float": ["-1", "0", "0.5", "nan", "abc"],
            "bool": ["yes", "off", "maybe"]}.get(k, ["2", "nowhere-xyz"])


def _answer(code: int, out: str, err: str, name: str) -> tuple[str, object]:
    if code == 0:
        told = json.loads(out)
        cls = FIELDS[name][0]
        shown = json.loads(told["env"]["MESHRUN_TRAIN_CONFIG"]) if cls is TrainConfig else told[SHOWN[cls]]
        return "accepted", shown[name]
    line = err.strip().splitlines()[-1].removeprefix("meshrun: error: ")
    return "refused", _without_source(line)


def _without_source(line: str) -> str:
    """The reason of a refusal, less where the value came from and how the source spelled it:
    ``--x (from env MESHRUN_X)=v``, ``env MESHRUN_X=v`` and ``flag --x=v`` all read ``--x: ``."""
    line = re.sub(r" \(from (env MESHRUN_\w+|config [^)]*|meshrun\.train)\)", "", line)
    line = re.sub(r"^env MESHRUN_(\w+)", lambda m: "--" + m[1].lower().replace("_", "-"), line)
    line = line.removeprefix("flag ")
    return re.sub(r"^(--[\w-]+)=.*?: ", r"\1: ", line)


def _cli(args: list[str], env: dict[str, str], capsys: pytest.CaptureFixture[str], name: str) -> tuple[str, object]:
    base = [a for k, v in BASE.items() if k != name for a in (flag(k), v)]
    code = main(["train", *base, *args, "--dry-run", "--json"], env=env)
    out, err = capsys.readouterr()
    return _answer(code, out, err, name)


def _api(value: object, env: dict[str, str], capsys: pytest.CaptureFixture[str], name: str) -> tuple[str, object]:
    given = {k: v for k, v in BASE.items() if k != name}
    try:
        meshrun.train(env=env, dry_run=True, json=True, **{**given, name: value})
    except meshrun.MeshrunError as exc:
        capsys.readouterr()
        return "refused", _without_source(str(exc))
    return _answer(0, capsys.readouterr().out, "", name)


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_every_source_of_an_option_gets_the_same_answer(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHRUN_")}
    f = FIELDS[name][1]
    bare = kind(f) == "bool" and f.default is False  # a bare flag: --deterministic
    for text in probes(name):
        config = tmp_path / "run.yaml"
        config.write_text(f"{name}: {text}\n")  # as a user writes it
        # what the config file holds, and what a keyword passes: text for a text option
        native = text if kind(f) == "str" else yaml.load(text, Loader=_unique_key_loader(yaml))
        answers = {"keyword": _api(native, env, capsys, name)}
        if spec(f).everywhere:
            answers["env"] = _cli([], {**env, env_var(name): text}, capsys, name)
            answers["config"] = _cli(["--config", str(config)], env, capsys, name)
        if not bare:
            answers["flag"] = _cli([flag(name), text], env, capsys, name)
        elif native is True:
            answers["flag"] = _cli([flag(name)], env, capsys, name)
        assert len({json.dumps(a, default=str) for a in answers.values()}) == 1, (text, answers)
        assert list(tmp_path.iterdir()) == [config], (text, "a dry run created files")


@pytest.mark.parametrize("name", [n for n, (_, f) in FIELDS.items() if not spec(f).everywhere])
def test_an_option_for_flags_and_keywords_alone_is_no_variable_and_no_key(name, tmp_path, capsys):
    """--overwrite from a variable or a config file would set a run aside at every start of a
    job that requeues, and MESHRUN_GPU_MEM, which meshrun plan reads, would refuse every run that
    is not dry: such a variable is warned about and left unread, the key refused."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHRUN_")}
    assert _cli([], {**env, env_var(name): "1"}, capsys, name) == ("accepted", FIELDS[name][1].default)
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({name: True}))
    assert main(["train", "--config", str(config), "--dry-run"], env=env) == 2
    assert f"'{name}': is an option for the command line alone" in capsys.readouterr().err
