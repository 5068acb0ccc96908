"""A rank that dies says so in one line, every rank's output is in OUT/logs, and a micro-batch
meshrun chose that runs out of memory is halved before training. Real `meshrun train` runs on
2 CPU processes (gloo); the models of tests/userpkg raise what a GPU would."""

from __future__ import annotations

import json
import os

import pytest
from helpers import clean_env, meshrun, with_faults

pytestmark = pytest.mark.framework

TESTS = os.path.dirname(os.path.abspath(__file__))
REGRESSION = ("--model", "userpkg.factories:fails_on_rank", "--data", "userpkg.factories:regression",
              "--nproc", "2", "--steps", "3")


def _env(**extra: str) -> dict[str, str]:
    return clean_env(PYTHONPATH=TESTS, **extra)


def _terminal(proc) -> list[str]:
    """What the terminal shows after the run's own first lines (strategy and reasons)."""
    text = proc.stdout + proc.stderr
    return [line for line in text.splitlines() if line.strip() and not line.startswith(("meshrun train:", "  "))]


def test_an_exception_on_rank_1_is_one_line_naming_rank_cause_and_log(tmp_path):
    out = tmp_path / "run"
    proc = meshrun("train", *REGRESSION, "--out", str(out), env=_env(USERPKG_FAIL="raise"), timeout=240)
    assert proc.returncode == 1, proc.stderr
    shown = _terminal(proc)
    assert len(shown) <= 3, shown
    assert "Traceback" not in proc.stdout + proc.stderr
    assert "ChildFailedError" not in proc.stderr and "Root Cause" not in proc.stderr  # torchrun's dump held back
    line = proc.stderr.strip().splitlines()[-1]
    log = out / "logs" / "rank-1.log"
    assert line == (f"meshrun: error: rank 1 failed: ValueError: shapes (8, 20) and (21, 1) do not match "
                    f"(full log: {log})"), line
    # the rank's whole output: its traceback with the exception's every line
    text = log.read_text()
    assert "Traceback (most recent call last)" in text and "second line of the message" in text
    assert (out / "logs" / "rank-0.log").exists() and (out / "logs" / "ranks-node-0.log").exists()


def test_a_rank_killed_by_a_signal_is_named_from_its_exit_status(tmp_path):
    out = tmp_path / "run"
    proc = meshrun("train", *REGRESSION, "--out", str(out), env=_env(USERPKG_FAIL="kill"), timeout=240)
    assert proc.returncode == 1, proc.stderr
    assert len(_terminal(proc)) <= 3, proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"meshrun: error: rank 1 died of SIGKILL (full log: {out / 'logs' / 'rank-1.log'})"), line
    assert "out-of-memory killer" in line
    assert "Traceback" not in proc.stderr
    # the survivor was ended at once, not left to echo the failure: rank 1's line is the only one
    assert "rank 0" not in proc.stderr and (out / "logs" / "ranks-node-0.log").exists()


def test_without_out_the_logs_of_a_failed_run_are_kept_and_named(tmp_path):
    proc = meshrun("train", *REGRESSION, env=_env(USERPKG_FAIL="raise"), timeout=240, cwd=str(tmp_path))
    assert proc.returncode == 1
    line = proc.stderr.strip().splitlines()[-1]
    path = line.split("(full log: ")[1].split(")")[0]
    assert os.path.isfile(path) and "ValueError" in open(path).read()


def test_every_ranks_output_goes_to_its_log_and_the_terminal_shows_rank_0(tmp_path):
    out = tmp_path / "run"
    proc = meshrun("train", "--model-size", "gpt-tiny", "--nproc", "2", "--steps", "2", "--seq-len", "32",
                   "--micro-batch", "2", "--out", str(out), env=_env(), timeout=240)
    assert proc.returncode == 0, proc.stderr
    logs = out / "logs"
    rank0, rank1 = (logs / "rank-0.log").read_text(), (logs / "rank-1.log").read_text()
    assert rank0.startswith("==== meshrun train: rank 0 of 2") and rank1.startswith("==== meshrun train: rank 1 of 2")
    assert "step 2/2 | loss" in rank0 and "step 2/2 | loss" in proc.stdout  # rank 0's progress: both places
    assert "OMP_NUM_THREADS" not in proc.stderr  # torchrun's banner: meshrun set the variable itself


def test_a_warning_repeated_on_every_rank_is_shown_once(tmp_path):
    out = tmp_path / "run"
    proc = meshrun("train", "--model", "userpkg.factories:warns_every_step", "--data", "userpkg.factories:regression",
                   "--nproc", "2", "--steps", "4", "--out", str(out), env=_env(), timeout=240)
    assert proc.returncode == 0, proc.stderr
    shown = [line for line in (proc.stdout + proc.stderr).splitlines() if "kernel fell back" in line]
    assert shown == ["meshrun: warning (rank 0, shown once): UserWarning: kernel fell back to the slow path"], shown
    assert (out / "logs" / "rank-1.log").read_text().count("kernel fell back") >= 4  # every time, in full


def _losses(out) -> list[float]:
    return [json.loads(line)["loss"] for line in open(os.path.join(out, "metrics.jsonl"))]


def test_a_micro_batch_meshrun_chose_that_runs_out_of_memory_is_halved_and_trains_alike(tmp_path):
    common = ("--model", "userpkg.factories:oom_above", "--data", "userpkg.factories:regression", "--nproc", "2",
              "--steps", "6", "--log-every", "2")
    # micro-batch 8 (meshrun's default on the CPU) does not fit; 2 does. The ranks' memory
    # counts as a GPU's, so the try runs (on the CPU nothing can catch running out)
    env = with_faults(_env(USERPKG_MAX_MICRO="2"), device_memory=1)
    halved = meshrun("train", *common, "--out", str(tmp_path / "a"), env=env, timeout=240)
    assert halved.returncode == 0, halved.stderr
    said = [line for line in halved.stdout.splitlines() if "out of GPU memory" in line]
    assert said == [
        "meshrun train: out of GPU memory at micro-batch 8 in a first micro-step; micro-batch 4 x 2 accumulation "
        "instead (global batch 16 unchanged, so the loss curve is the same)",
        "meshrun train: out of GPU memory at micro-batch 4 in a first micro-step; micro-batch 2 x 4 accumulation "
        "instead (global batch 16 unchanged, so the loss curve is the same)"], said
    assert "global batch of 16 samples (micro-batch 2 x 4 accumulation steps x 2 data-parallel ranks)" \
        in halved.stdout
    started_small = meshrun("train", *common, "--micro-batch", "2", "--global-batch", "16",
                            "--out", str(tmp_path / "b"), env=env, timeout=240)
    assert started_small.returncode == 0, started_small.stderr
    assert _losses(tmp_path / "a") == _losses(tmp_path / "b")  # the same samples per step, the same order


def test_a_micro_batch_the_user_set_that_runs_out_of_memory_stops_in_one_line(tmp_path):
    proc = meshrun("train", "--model", "userpkg.factories:oom_above", "--data", "userpkg.factories:regression",
                   "--nproc", "2", "--steps", "3", "--micro-batch", "8", env=_env(USERPKG_MAX_MICRO="2"), timeout=240)
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("meshrun: error: out of GPU memory at the first step with strategy ddp, micro-batch 8"), line
    assert "(hint: a smaller --micro-batch" in line
    assert "Traceback" not in proc.stderr
