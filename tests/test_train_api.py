"""meshrun.train(...): the `meshrun train` job from a Python script, through the same
job/__init__.py the CLI calls; its result is rank 0's last metrics and the newest snapshot."""

import json
import os
import subprocess
import sys

import pytest
from helpers import clean_env, meshrun, meshrun_here, require, started_by_shell

import meshrun as meshrun_pkg

OPTIONS = dict(model_size="gpt-tiny", steps=2, nproc=2, seq_len=32, micro_batch=2, eval_batches=1, data="random")
FLAGS = ["--model-size", "gpt-tiny", "--steps", "2", "--nproc", "2", "--seq-len", "32", "--micro-batch", "2",
         "--eval-batches", "1", "--data", "random"]


def test_a_dry_run_returns_the_job_it_would_start_and_prints_nothing(tmp_path, capsys):
    """meshrun.train(dry_run=True): nothing starts and nothing is printed; the result's dry_run
    holds the resolved config, the topology, the ranks' decisions and each process's command,
    the same as `meshrun train --dry-run --json` says and as its text starts."""
    result = meshrun_pkg.train(dry_run=True, nproc=3, steps=7, model_size="gpt-tiny", env=clean_env())
    assert capsys.readouterr() == ("", "")
    assert (result.code, result.metrics, result.snapshot) == (0, {}, None)
    dry = result.dry_run
    assert (dry.config.steps, dry.config.sources["steps"], dry.topology.nproc_per_node) == (7, "meshrun.train", 3)
    assert (dry.decisions["strategy"], dry.decisions["decided_for"]) == ("ddp", "CPU processes")
    assert dry.summary[:2] == ("decided for CPU processes:", "strategy: ddp (rules)")
    assert len(dry.processes) == 3 and dry.argv[-3:] == ["-u", "-m", "meshrun.training.worker"]
    assert sorted(p["env"]["RANK"] for p in dry.processes) == ["0", "1", "2"]
    assert meshrun_pkg.TrainConfig.from_json(dry.processes[0]["env"]["MESHRUN_TRAIN_CONFIG"]) == dry.config
    assert "strategy='ddp'" in repr(result) and len(repr(result)) < 300
    # the CLI's JSON is this object's (but the port each picks, and --json itself)
    cli = json.loads(meshrun_here("train", "--dry-run", "--json", "--nproc", "3", "--steps", "7", "--model-size",
                                  "gpt-tiny").stdout)
    told = json.loads(json.dumps(dry.to_dict()))
    for d in (told, cli):
        del d["topology"]["master_port"], d["job"]["json"]
    assert {k: told[k] for k in ("job", "topology", *dry.decisions)} == \
        {k: cli[k] for k in ("job", "topology", *dry.decisions)}
    # its text: the decisions, then a shell command of lines of at most 100 columns that starts them
    text = str(dry)
    assert text.splitlines()[:2] == ["# decided for CPU processes:", "# strategy: ddp (rules)"]
    assert max(len(line) for line in text.splitlines()) <= 100, text
    got, want = started_by_shell(text, dry.processes, tmp_path)
    assert got == want and len(got) == 3


def test_a_script_trains_with_meshrun_train_and_gets_what_the_cli_run_leaves(tmp_path):
    require("torch")
    api_out, cli_out = str(tmp_path / "api"), str(tmp_path / "cli")
    script = tmp_path / "job.py"
    script.write_text("import json, meshrun\n"
                      f"r = meshrun.train(**{OPTIONS!r}, out={api_out!r})\n"
                      # the same call again: the run is done, and its result is the same
                      f"again = meshrun.train(**{OPTIONS!r}, out={api_out!r})\n"
                      "print('RESULT', json.dumps({'code': r.code, 'metrics': r.metrics, 'snapshot': r.snapshot,\n"
                      "                            'again': [again.code, again.metrics, again.snapshot]}))\n")
    # a misspelt variable is warned about as `meshrun train` warns about it
    res = subprocess.run([sys.executable, str(script)], env=clean_env(MESHRUN_STEPPS="3"), capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert ("meshrun: warning: MESHRUN_STEPPS is not a variable of meshrun train; ignored (did you mean "
            "MESHRUN_STEPS?)") in res.stderr.splitlines()
    result = json.loads(res.stdout.split("RESULT ", 1)[1])
    assert result["code"] == 0 and result["metrics"]["step"] == 2
    assert result["again"] == [0, result["metrics"], result["snapshot"]]
    assert result["snapshot"] == os.path.join(api_out, "checkpoints", "step-00000002")
    assert os.path.isfile(os.path.join(result["snapshot"], "COMMITTED.json"))
    cli = meshrun("train", *FLAGS, "--out", cli_out, env=clean_env(), timeout=300)
    assert cli.returncode == 0, cli.stderr[-3000:]
    with open(os.path.join(cli_out, "metrics.jsonl")) as f:
        last = [json.loads(line) for line in f if line.strip()][-1]
    # the same job: the same losses to the bit (same seed, same data, same layout)
    assert (last["loss"], last["val_loss"]) == (result["metrics"]["loss"], result["metrics"]["val_loss"])


def test_without_out_the_metrics_come_back_and_no_snapshot(tmp_path):
    require("torch")
    code = ("import json, meshrun\n"
            f"r = meshrun.train(**{dict(OPTIONS, nproc=1)!r})\n"
            "print('RESULT', json.dumps([r.code, r.metrics['step'], r.snapshot, r.out]))\n")
    res = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    assert json.loads(res.stdout.split("RESULT ", 1)[1]) == [0, 2, None, None]
    assert os.listdir(tmp_path) == []  # nothing written where it ran


@pytest.mark.parametrize("options,message", [
    (dict(model_sise="gpt-tiny"), "meshrun.train() option='model_sise': unknown option (hint: did you mean "
                                  "model_size?)"),
    (dict(steps="many"), "--steps (from meshrun.train)='many': expected int"),
    (dict(nproc=2, nproc_per_node=2), "meshrun.train() option='nproc_per_node': given twice"),
    (dict(strategy="fsdp-hybrid", tp=2, nproc=2), "--strategy (from meshrun.train)='fsdp-hybrid': does not compose"),
    (dict(max_restarts=2), "--max-restarts (from meshrun.train): a restarted job resumes from its snapshots"),
])
def test_a_bad_option_raises_the_clis_one_line_error_before_anything_starts(tmp_path, options, message):
    with pytest.raises(meshrun_pkg.MeshrunError) as err:
        meshrun_pkg.train(**options, env=clean_env())
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


IN_WORKER = """
import json, os, meshrun
r = meshrun.train(model_size="gpt-tiny", steps=1, data="random", seq_len=16, micro_batch=2)
# one write per line: the ranks share torchrun's stdout, and print() writes its pieces apart
os.write(1, f'RESULT {os.environ["RANK"]} {json.dumps({"code": r.code, "step": r.metrics.get("step")})}\\n'.encode())
"""


def test_meshrun_train_inside_torchruns_workers_trains_as_their_ranks(tmp_path):
    """Called in each of torchrun's workers, meshrun.train() is one rank of torchrun's job: it
    does not take the port torchrun's agent holds for its store as a port in use."""
    require("torch")
    script = tmp_path / "in_worker.py"
    script.write_text(IN_WORKER)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    out = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", str(script)], capture_output=True,
                         text=True, timeout=240, env=clean_env(), cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "already in use" not in out.stderr and "on 2 CPU processes" in out.stdout + out.stderr, out.stderr[-3000:]
    results = sorted(line.split(" ", 2)[1:] for line in out.stdout.splitlines() if line.startswith("RESULT"))
    # rank 0 reads the run's metrics (its log lines); every rank's call returns the job's code
    assert [(rank, json.loads(r)) for rank, r in results] == [("0", {"code": 0, "step": 1}),
                                                              ("1", {"code": 0, "step": None})]
