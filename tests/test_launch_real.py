"""Real jobs through `meshrun launch`: every framework's processes really talk to each other.

Each script prints one line per rank that the test parses, so the assertions are on what
the ranks computed (sums, synchronised weights), not on exit codes alone.
"""

import os
import signal
import subprocess
import sys
import time

import pytest
from helpers import clean_env, example, lines, meshrun, require, script

pytestmark = pytest.mark.framework


def test_torch_gloo_allreduce_two_processes():
    require("torch")
    out = meshrun("launch", "--nproc", "2", script("torch_allreduce.py"))
    assert out.returncode == 0, out.stderr[-2000:]
    rows = lines(out.stdout, "ALLREDUCE")
    assert sorted(r["rank"] for r in rows) == ["0", "1"]
    assert all(r["sum"] == "3" and r["ok"] == "True" for r in rows)
    # torchrun's four-line banner about the thread count is not shown; meshrun says it once
    assert "Setting OMP_NUM_THREADS" not in out.stderr, out.stderr
    assert out.stderr.count("meshrun: OMP_NUM_THREADS=1 in each of the 2 processes") == 1, out.stderr


def test_a_thread_count_the_user_set_reaches_every_process(tmp_path):
    require("torch")
    probe = tmp_path / "threads.py"
    # one write per line: the ranks share the pipe, unbuffered (PYTHONUNBUFFERED), and print's
    # separate writes of each word interleave between processes
    probe.write_text("import os\n"
                     "os.write(1, f\"THREADS {os.environ['RANK']} {os.environ['OMP_NUM_THREADS']}\\n\".encode())\n")
    out = meshrun("launch", "--nproc", "2", str(probe), env=clean_env(OMP_NUM_THREADS="3"))
    assert out.returncode == 0, out.stderr[-2000:]
    assert sorted(line.split()[1:] for line in out.stdout.splitlines() if line.startswith("THREADS")) == \
        [["0", "3"], ["1", "3"]]
    assert "OMP_NUM_THREADS" not in out.stderr, out.stderr


@pytest.mark.parametrize("mode", ["fit", "loop"])
def test_tensorflow_multiworker_two_workers(tmp_path, mode):
    require("tensorflow")
    if mode == "fit":
        require("tf_keras")
    out = meshrun("launch", "-f", "tensorflow", "--nproc", "2", example("tf_train.py"), mode, str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = lines(out.stdout, "TFTRAIN")
    assert sorted(r["index"] for r in rows) == ["0", "1"]
    assert all(r["workers"] == "2" for r in rows)
    assert rows[0]["checksum"] == rows[1]["checksum"]  # mirrored variables stayed in sync
    assert float(rows[0]["last"]) < float(rows[0]["first"])  # it trained
    # Chief-only checkpointing: the chief writes to the shared dir, the other to its own.
    assert (tmp_path / "chief" / "final.weights.h5").is_file()
    assert (tmp_path / "tmp-worker-1" / "final.weights.h5").is_file()


def test_jax_two_processes_cross_process_sum_and_sharded_training():
    require("jax")
    out = meshrun("launch", "-f", "jax", "--nproc", "2", example("jax_train.py"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = lines(out.stdout, "JAXTRAIN")
    assert sorted(r["process"] for r in rows) == ["0", "1"]
    assert all(r["count"] == "2" and r["devices"] == "2" and r["sum"] == "3" for r in rows)
    assert rows[0]["checksum"] == rows[1]["checksum"]
    assert float(rows[0]["last"]) < 0.01 * float(rows[0]["first"])


@pytest.mark.parametrize("launcher", ["torchrun", "native"])
def test_deepspeed_zero2_two_processes(launcher, tmp_path):
    require("deepspeed")
    out = meshrun("launch", "-f", "deepspeed", "--deepspeed-launcher", launcher, "--nproc", "2",
                  "--deepspeed-config", example("ds_config.json"), example("deepspeed_train.py"),
                  "--save_dir", str(tmp_path), timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    rows = lines(out.stdout, "DSTRAIN")
    assert sorted(r["rank"] for r in rows) == ["0", "1"]
    assert all(r["world"] == "2" and r["stage"] == "2" for r in rows)
    assert rows[0]["checksum"] == rows[1]["checksum"]
    shards = sorted(p.name for p in (tmp_path / "final").iterdir())
    assert "mp_rank_00_model_states.pt" in shards
    assert sum("optim_states" in name for name in shards) == 2  # one optimizer shard per rank


def test_accelerate_two_processes_global_count():
    require("accelerate")
    out = meshrun("launch", "-f", "accelerate", "--nproc", "2", example("accelerate_train.py"))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = lines(out.stdout, "ACCEL")
    assert sorted(r["index"] for r in rows) == ["0", "1"]
    assert all(r["num"] == "2" and r["counted"] == "2" for r in rows)
    assert rows[0]["checksum"] == rows[1]["checksum"]


# ---- supervision: exit codes, failed peers, signals -----------------------------------------

def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _pids(d) -> list[int]:
    return [int(p.read_text()) for p in d.glob("pid.*")]


def test_failed_process_stops_its_peer_and_sets_exit_code(tmp_path):
    start = time.monotonic()
    out = meshrun("launch", "-f", "jax", "--nproc", "2", script("sleeper.py"), str(tmp_path), "1", "7",
                  timeout=60)
    assert out.returncode == 7
    assert "stopping the others" in out.stderr
    assert time.monotonic() - start < 30
    assert len(_pids(tmp_path)) == 2 and not any(_alive(p) for p in _pids(tmp_path))


def test_torchrun_job_failure_is_nonzero(tmp_path):
    require("torch")
    out = meshrun("launch", "--nproc", "2", script("sleeper.py"), str(tmp_path), "0", "3", timeout=120)
    assert out.returncode != 0
    assert not any(_alive(p) for p in _pids(tmp_path))


@pytest.mark.parametrize("framework", ["jax", "torch"])
def test_sigterm_reaches_every_process(tmp_path, framework):
    if framework == "torch":
        require("torch")
    proc = subprocess.Popen([sys.executable, "-m", "meshrun", "launch", "-f", framework, "--nproc", "2",
                             script("sleeper.py"), str(tmp_path)], env=clean_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_pids(tmp_path)) == 2, proc.communicate(timeout=5)
    proc.send_signal(signal.SIGTERM)
    code = proc.wait(timeout=60)
    assert code == 128 + signal.SIGTERM  # torchrun's 1 says only that a worker failed
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in _pids(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in _pids(tmp_path))


@pytest.mark.parametrize("sig", [signal.SIGHUP, signal.SIGINT])
def test_a_signal_the_workers_handle_gives_their_exit_code_not_torchruns(tmp_path, sig):
    """A stopping signal to `meshrun launch` goes to torchrun's workers, not to torchrun (which
    answers it with its own SignalException, 30 lines, and exit 1 whatever the workers do):
    workers that handle it and exit 0 make the job exit 0, with nothing but their own lines."""
    require("torch")
    proc = subprocess.Popen([sys.executable, "-m", "meshrun", "launch", "--nproc", "2", script("sleeper.py"),
                             str(tmp_path)], env=clean_env(SLEEPER_HANDLE="1"), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while len(_pids(tmp_path)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(_pids(tmp_path)) == 2, proc.communicate(timeout=5)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert sorted(out.splitlines()) == [f"rank {r} handled {sig.name}" for r in (0, 1)], out
    assert "Traceback" not in err and "SignalException" not in err, err
