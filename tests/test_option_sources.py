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
# a path with a space at an end or a control character: refused from every source
BAD_PATHS = [" lead", "trail ", "a\tb"]


def probes(name: str) -> list[str]:
    """Values as a user types them: good ones, and ones each kind of check refuses."""
    f = FIELDS[name][1]
    k, s = kind(f), spec(f)
    if name in PROBES:
        return PROBES[name]
    if s.choices:
        return [s.choices[0], s.choices[-1], "bogus"]
    return {"int": ["-1", "0", "2", "abc", "1.5"], "float": ["-1", "0", "0.5", "nan", "abc"],
            "bool": ["yes", "off", "maybe"]}.get(k, ["2", "nowhere-xyz", *(BAD_PATHS if s.path else [])])


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
        result = meshrun.train(env=env, dry_run=True, **{**given, name: value})
    except meshrun.MeshrunError as exc:
        capsys.readouterr()
        return "refused", _without_source(str(exc))
    return _answer(0, json.dumps(result.dry_run.to_dict()), "", name)


@pytest.mark.parametrize("name", sorted(FIELDS))
def test_every_source_of_an_option_gets_the_same_answer(name, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHRUN_")}
    f = FIELDS[name][1]
    bare = kind(f) == "bool" and f.default is False  # a bare flag: --deterministic
    for text in probes(name):
        config = tmp_path / "run.yaml"
        # as a user writes it (quoted where YAML would strip the spaces or read the tab)
        config.write_text(f"{name}: {json.dumps(text) if text in BAD_PATHS else text}\n")
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


# Values a config file (YAML) or a keyword gives that are not text: each source gets the
# same answer; (option, the file's YAML, the keyword's value, the answer).
NATIVE = [
    ("out", "null", None, ("accepted", None)),  # null: the default, as if not there
    ("micro_batch", "null", None, ("accepted", None)),
    ("out", "[runs, a]", ["runs", "a"], ("refused", "--out: expected a path, not list (hint: give the path as "
                                          "text; quote it in YAML or TOML)")),
    ("tokenizer", "1.5", 1.5, ("refused", "--tokenizer: expected a path, not float (hint: give the path as text; "
                               "quote it in YAML or TOML)")),
    ("text_field", "[a, b]", ["a", "b"], ("refused", "--text-field: expected text, not list (hint: quote it in "
                                          "YAML or TOML)")),
    ("text_field", "yes", True, ("refused", "--text-field: expected text, not bool (hint: quote it in YAML or "
                                 "TOML)")),
    ("log_with", "[none]", ["none"], ("accepted", "none")),  # a comma list takes a list
    ("compile", "on", True, ("accepted", "on")),  # YAML reads on as true: an on/off option takes it
    ("compile", "off", False, ("accepted", "off")),
    ("seed", "true", True, ("refused", "--seed: expected int (hint: a whole number)")),
    ("steps", "[1]", [1], ("refused", "--steps: expected int (hint: a whole number)")),
    ("lr", "[0.1]", [0.1], ("refused", "--lr: expected float (hint: a number)")),
    ("hosts", "[h0, h1]", ["h0", "h1"], ("accepted", ["h0", "h1"])),
]


@pytest.mark.parametrize("name,text,native,expected", NATIVE, ids=[f"{n}={t}" for n, t, _, _ in NATIVE])
def test_a_value_that_is_not_text_gets_the_same_answer_from_a_file_and_a_keyword(name, text, native, expected,
                                                                                 tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHRUN_")}
    config = tmp_path / "run.yaml"
    config.write_text(f"{name}: {text}\n")
    extra = {"nnodes": "2", "node_rank": "0", "master_addr": "h0"} if name == "hosts" else {}
    given = {**extra, name: native} if native is not None else extra
    keyword = _api_with(given, env, capsys, name)
    from_file = _cli(["--config", str(config), *[a for k, v in extra.items() for a in (flag(k), v)]], env, capsys, name)
    assert keyword == from_file == expected


def _api_with(given: dict, env: dict[str, str], capsys: pytest.CaptureFixture[str], name: str) -> tuple[str, object]:
    base = {k: v for k, v in BASE.items() if k != name}
    try:
        result = meshrun.train(env=env, dry_run=True, **{**base, **given})
    except meshrun.MeshrunError as exc:
        capsys.readouterr()
        return "refused", _without_source(str(exc))
    return _answer(0, json.dumps(result.dry_run.to_dict()), "", name)


def test_a_path_object_or_bytes_from_python_is_the_path(tmp_path, monkeypatch, capsys):
    """``meshrun.train(out=Path(...))`` or bytes (a name as the file system spells it) is the
    same run as the text; the dry run shows the same path."""
    import pathlib

    monkeypatch.chdir(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHRUN_")}
    answers = {_api_with({"out": v}, env, capsys, "out") for v in ("runs/a", pathlib.Path("runs/a"), b"runs/a")}
    assert len(answers) == 1 and next(iter(answers))[0] == "accepted", answers


def test_the_api_reads_meshrun_config_as_the_cli_does(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    config = tmp_path / "run.yaml"
    config.write_text("steps: 7\n")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MESHRUN_")}, "MESHRUN_CONFIG": str(config)}
    given = {k: v for k, v in BASE.items() if k != "steps"}
    from_api = json.loads(meshrun.train(env=env, dry_run=True, **given).dry_run.processes[0]["env"]
                          ["MESHRUN_TRAIN_CONFIG"])
    assert main(["train", *[a for k, v in given.items() for a in (flag(k), v)], "--dry-run", "--json"], env=env) == 0
    from_cli = json.loads(json.loads(capsys.readouterr().out)["env"]["MESHRUN_TRAIN_CONFIG"])
    assert from_api["steps"] == from_cli["steps"] == 7
    assert from_api["sources"]["steps"] == from_cli["sources"]["steps"] == f"config {config}"


def test_the_api_from_a_thread_is_refused_in_one_line_before_anything_starts(tmp_path, monkeypatch):
    """A job relays Ctrl-C and preemption signals to its ranks, which Python allows from the
    main thread only: from another thread the call is refused before it reads or starts anything."""
    import threading

    monkeypatch.chdir(tmp_path)
    raised: list[BaseException] = []

    def call() -> None:
        try:
            meshrun.train(out=str(tmp_path / "run"), **{k: v for k, v in BASE.items()})
        except BaseException as exc:  # (what the thread would otherwise print and drop)
            raised.append(exc)

    worker = threading.Thread(target=call, name="trainer")
    worker.start()
    worker.join(timeout=60)
    assert not worker.is_alive()
    assert len(raised) == 1 and isinstance(raised[0], meshrun.MeshrunError), raised
    assert str(raised[0]).startswith("meshrun.train() was called from thread 'trainer': a job relays signals")
    assert os.listdir(tmp_path) == []


def test_the_api_takes_a_config_path_and_refuses_a_mapping(tmp_path, monkeypatch, capsys):
    import pathlib

    monkeypatch.chdir(tmp_path)
    (tmp_path / "run.yaml").write_text("steps: 3\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MESHRUN_")}
    given = {k: v for k, v in BASE.items() if k != "steps"}
    assert meshrun.train(pathlib.Path("run.yaml"), env=env, dry_run=True, **given).dry_run.config.steps == 3
    with pytest.raises(meshrun.MeshrunError, match=r"^meshrun.train\(\) option config=\{'steps': 3\}: expected the "
                       "path of a YAML or TOML file, not dict"):
        meshrun.train(config={"steps": 3}, env=env, dry_run=True, **given)


def test_meshrun_dry_run_makes_the_api_dry_run_as_it_does_the_cli(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("MESHRUN_")}, "MESHRUN_DRY_RUN": "1",
           "MESHRUN_JSON": "1"}
    result = meshrun.train(env=env, out=str(tmp_path / "run"), **BASE)
    assert capsys.readouterr().out == ""  # (the API prints nothing: the result holds the dry run)
    told = result.dry_run.to_dict()
    assert result.code == 0 and told["job"]["dry_run"] is True and "MESHRUN_TRAIN_CONFIG" in told["env"]
    assert os.listdir(tmp_path) == []  # nothing ran, nothing written
