"""Two command-line checks: `meshrun data prepare --val-fraction` outside [0, 1) is refused in
one line before anything is written, and `meshrun bench` hands its workers a result path in a
private directory that nobody can know in advance, removed afterwards."""

import json
import os
import stat

import pytest
from helpers import clean_env, meshrun

from meshrun.cli import bench, main
from meshrun.errors import MeshrunError


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_text("hello world\n")
    return str(tmp_path / "corpus")


def test_val_fraction_of_two_exits_2_with_one_line(tmp_path, corpus):
    out = tmp_path / "shards"
    run = meshrun("data", "prepare", corpus, "--tokenizer", "gpt2", "--out", str(out), "--val-fraction", "2")
    assert run.returncode == 2 and run.stdout == ""
    assert run.stderr.strip().splitlines() == [
        "meshrun: error: --val-fraction=2.0: must be in [0, 1) (hint: e.g. 0.01)"]
    assert not out.exists()


@pytest.mark.parametrize("value,shown", [("1", "1.0"), ("1.5", "1.5"), ("-0.1", "-0.1"), ("nan", "nan"),
                                         ("inf", "inf")])
def test_val_fraction_outside_zero_to_one_is_refused(tmp_path, corpus, capsys, value, shown):
    out = tmp_path / "shards"
    code = main(["data", "prepare", corpus, "--tokenizer", "gpt2", "--out", str(out), "--val-fraction", value],
                env=clean_env())
    err = capsys.readouterr().err
    assert code == 2
    assert err.strip().splitlines() == [f"meshrun: error: --val-fraction={shown}: must be in [0, 1) (hint: e.g. 0.01)"]
    assert not out.exists()


def fake_bench_job(seen: dict, write: bool = True, raise_error: bool = False):
    """Stands in for the launched benchmark: records the result path's directory as rank 0
    would find it, then writes a result (or fails) as rank 0 would."""

    def run_job(cmd, env, topo, spec):
        out = cmd.env["MESHRUN_BENCH_OUT"]
        info = os.stat(os.path.dirname(out))
        seen.setdefault("paths", []).append(out)
        seen.update(mode=stat.S_IMODE(info.st_mode), uid=info.st_uid, listing=os.listdir(os.path.dirname(out)))
        if raise_error:
            raise MeshrunError("rendezvous failed")
        if write:
            with open(out, "w") as f:
                json.dump({"kind": "matmul", "world": 2}, f)
        return 0 if write else 1

    return run_job


def test_bench_result_path_is_private_and_removed(monkeypatch, capsys):
    seen: dict = {}
    monkeypatch.setattr(bench, "run_job", fake_bench_job(seen))
    for _ in range(2):
        assert main(["bench", "matmul", "--n", "64", "--json"], env=clean_env()) == 0
        assert json.loads(capsys.readouterr().out) == {"kind": "matmul", "world": 2}
    first, second = seen["paths"]
    assert os.path.dirname(first) != os.path.dirname(second)  # a fresh random directory per run
    assert os.path.basename(os.path.dirname(first)).startswith("meshrun-bench-")
    assert os.path.basename(os.path.dirname(first)) != f"meshrun-bench-{os.getpid()}"
    assert (seen["mode"], seen["uid"], seen["listing"]) == (0o700, os.getuid(), [])
    assert not os.path.exists(os.path.dirname(first)) and not os.path.exists(os.path.dirname(second))


@pytest.mark.parametrize("write,raise_error,code", [(False, False, 1), (False, True, 2)])
def test_bench_private_directory_is_removed_when_the_job_fails(monkeypatch, capsys, write, raise_error, code):
    seen: dict = {}
    monkeypatch.setattr(bench, "run_job", fake_bench_job(seen, write=write, raise_error=raise_error))
    assert main(["bench", "matmul", "--n", "64", "--json"], env=clean_env()) == code
    assert not os.path.exists(os.path.dirname(seen["paths"][0]))
    if raise_error:
        assert capsys.readouterr().err.strip().splitlines() == ["meshrun: error: rendezvous failed"]
