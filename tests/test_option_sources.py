"""A training option's value gets the same answer from every source a user has: the flag, its
MESHRUN_<NAME> variable, a config file's key and a ``meshrun.train(...)`` keyword. Either all
accept it, with the same value in the run's config, or all refuse it for the same reason, each
naming its own source. Every option, through the real CLI and API in dry runs."""

import json
import re

import pytest
import yaml

import meshrun
from meshrun.cli import main
from meshrun.train.config import TrainConfig
from meshrun.train.options import env_var, flag, kind, option_fields, spec

BASE = {"model_size": "gpt-tiny", "data": "random", "steps": "1"}
FIELDS = {f.name: f for f in option_fields(TrainConfig)}


def probes(name: str) -> list[str]:
    """Values as a user types them: good ones, and ones each kind of check refuses."""
    f = FIELDS[name]
    k, s = kind(f), spec(f)
    if s.choices:
        return [s.choices[0], s.choices[-1], "bogus"]
    return {"int": ["-1", "0", "2", "abc", "1.5"], "float": ["-1", "0", "0.5", "nan", "abc"],
            "bool": ["yes", "off", "maybe"]}.get(k, ["2", "nowhere-xyz"])


def _answer(code: int, out: str, err: str, name: str) -> tuple[str, object]:
    if code == 0:
        cfg = json.loads(json.loads(out)["env"]["MESHRUN_TRAIN_CONFIG"])
        return "accepted", cfg[name]
    line = err.strip().splitlines()[-1].removeprefix("meshrun: error: ")
    return "refused", _without_source(line)


def _without_source(line: str) -> str:
    """The reason of a refusal, less where the value came from and how the source spelled it."""
    line = re.sub(r" \(from (env MESHRUN_\w+|config [^)]*|meshrun\.train)\)", "", line)
    return re.sub(r"^(--[\w-]+)=.*?: ", r"\1: ", line)


def _cli(args: list[str], env: dict[str, str], capsys: pytest.CaptureFixture[str], name: str) -> tuple[str, object]:
    base = [a for k, v in BASE.items() if k != name for a in (flag(k), v)]
    code = main(["train", *base, "--nproc", "1", *args, "--dry-run", "--json"], env=env)
    out, err = capsys.readouterr()
    return _answer(code, out, err, name)


def _api(value: object, env: dict[str, str], capsys: pytest.CaptureFixture[str], name: str) -> tuple[str, object]:
    given = {k: v for k, v in BASE.items() if k != name}
    try:
        meshrun.train(env=env, nproc=1, dry_run=True, json=True, **{**given, name: value})
    except meshrun.MeshrunError as exc:
        capsys.readouterr()
        return "refused", _without_source(str(exc))
    return _answer(0, capsys.readouterr().out, "", name)


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_every_source_of_an_option_gets_the_same_answer(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    env = {k: v for k, v in __import__("os").environ.items() if not k.startswith("MESHRUN_")}
    bare = kind(FIELDS[name]) == "bool" and FIELDS[name].default is False  # a bare flag: --deterministic
    for text in probes(name):
        native = yaml.safe_load(text)  # what a config file's `key: text` holds, and a keyword passes
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump({name: native}))
        answers = {
            "env": _cli([], {**env, env_var(name): text}, capsys, name),
            "config": _cli(["--config", str(config)], env, capsys, name),
            "keyword": _api(native, env, capsys, name),
        }
        if not bare:
            answers["flag"] = _cli([flag(name), text], env, capsys, name)
        elif native is True:
            answers["flag"] = _cli([flag(name)], env, capsys, name)
        assert len({json.dumps(a, default=str) for a in answers.values()}) == 1, (text, answers)
        assert list(tmp_path.iterdir()) == [config], (text, "a dry run created files")
