"""Snapshots and fault tolerance, with real processes and real kills."""

import json
import os
import pickle
import shutil
import signal
import threading
import time

import pytest
from helpers import clean_env, require, with_faults
from helpers import meshrun as run_cli

import meshrun

pytestmark = pytest.mark.framework
HERE = os.path.dirname(__file__)
JOB = ["--model-size", "gpt-tiny", "--seq-len", "32", "--micro-batch", "4", "--steps", "60", "--save-every", "6",
       "--log-every", "1", "--deterministic", "--lr", "3e-3", "--eval-batches", "2"]


def losses(out_dir):
    """step -> loss, keeping the last line logged for each step (after a restart, the
    resumed run's)."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def steps_logged(out_dir):
    """The step of every record in metrics.jsonl, in the file's order."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return [json.loads(line)["step"] for line in f]


def worker_pids(out_dir):
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read()
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read()
        except OSError:
            continue
        if b"meshrun.training.worker" in cmd and out_dir.encode() in env:
            pids.append(int(pid))
    return pids


def kill_when(condition, out_dir, deadline_s=120):
    """In a thread: once condition() holds, SIGKILL one worker of the job in out_dir."""
    killed = []

    def watch():
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if condition():
                pids = worker_pids(out_dir)
                if pids:
                    os.kill(max(pids), signal.SIGKILL)
                    killed.append(max(pids))
                    return
            time.sleep(0.01)

    t = threading.Thread(target=watch, daemon=True)
    t.start()
    return t, killed


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    require("torch")
    out = str(tmp_path_factory.mktemp("uninterrupted"))
    res = run_cli("train", *JOB, "--out", out, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return losses(out)


def reached(out_dir, step):
    def check():
        try:
            return max(losses(out_dir)) >= step
        except (OSError, ValueError):
            return False
    return check


def test_sigkill_a_rank_restarts_and_resumes_bit_for_bit(tmp_path, uninterrupted):
    out = str(tmp_path)
    watcher, killed = kill_when(reached(out, 15), out)
    res = run_cli("train", *JOB, "--out", out, "--max-restarts", "1", timeout=600)
    watcher.join(timeout=1)
    assert killed, "the job ended before a worker could be killed"
    assert res.returncode == 0, res.stderr[-3000:]
    assert "restart 1 of 1" in res.stderr
    assert "resumed from" in res.stdout and "at step 12" in res.stdout
    # one record a step: the killed start's steps after 12 (it logged 15 at least) were trained and logged again
    assert steps_logged(out) == list(range(1, 61))
    after = losses(out)
    for step in range(13, 61):
        assert after[step] == uninterrupted[step], step  # bit for bit: the same float


def test_sigkill_during_a_save_falls_back_to_the_previous_snapshot(tmp_path, uninterrupted):
    out = str(tmp_path)
    ckpt = os.path.join(out, "checkpoints")

    def saving_step_12():
        return os.path.isdir(os.path.join(ckpt, ".tmp-step-00000012"))

    watcher, killed = kill_when(saving_step_12, out)
    env = with_faults(clean_env(), save_pause=2)
    res = run_cli("train", *JOB[:-4], "--steps", "18", "--log-every", "1", "--eval-batches", "2", "--out", out,
                  "--max-restarts", "1", env=env, timeout=600)
    watcher.join(timeout=1)
    assert killed and res.returncode == 0, res.stderr[-3000:]
    assert "at step 6" in res.stdout  # step 12's half-written snapshot was ignored
    assert steps_logged(out) == list(range(1, 19))  # steps 7-12 once, though the killed start logged them
    assert sorted(os.listdir(ckpt)) == ["step-00000006", "step-00000012", "step-00000018"]


def test_a_slow_disk_under_async_snapshots_gets_a_save_every_hint(tmp_path):
    """When the background write of one snapshot outlasts the steps to the next, training
    waits: rank 0 says so once per save with a --save-every that would leave the writer
    headroom. The slow disk is a 3-s delay in the writer thread (tests/faults)."""
    require("torch")
    res = run_cli("train", "--example", "toy", "--steps", "6", "--save-every", "2", "--async-save", "--nproc", "2",
                  "--out", str(tmp_path), env=with_faults(clean_env(), write_delay=3), timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    hints = [line for line in res.stdout.splitlines() if line.startswith("snapshots: training waited")]
    assert len(hints) == 2, res.stdout  # the saves at steps 4 and 6 waited for those at 2 and 4
    steps = int(hints[0].split("--save-every ")[1].split()[0])
    assert steps > 2 and "(2 steps) apart" in hints[0]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000002", "step-00000004", "step-00000006"]


def test_slow_writer_advice_only_when_training_waited():
    from meshrun.training.snapshot import slow_writer_advice

    assert slow_writer_advice(0.2, 30.0, 26.0, 50) is None  # a short wait is not worth a line
    line = slow_writer_advice(5.5, 32.0, 26.5, 50)
    assert line is not None and "--save-every 73 or more" in line  # 50 x 1.2 x 32 / 26.5 = 72.5


@pytest.mark.parametrize("mode", [[], ["--async-save"]], ids=["sync", "async"])
def test_keep_last_leaves_the_two_newest(tmp_path, mode):
    """Asynchronous saves delete pruned snapshots on a thread (renamed out of the way first):
    by the end of the run nothing else is left either, no .trash-* directory included."""
    require("torch")
    res = run_cli("train", "--example", "toy", "--steps", "10", "--save-every", "2", "--keep-last", "2", *mode,
                  "--out", str(tmp_path))
    assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000008", "step-00000010"]


def test_pruning_renames_first_so_no_listing_sees_a_half_deleted_snapshot(tmp_path):
    """committed() refuses a step-* directory without its marker (damage). A pruned snapshot
    leaves that name atomically before any of its files is deleted, and leftovers of a
    deletion that was killed are cleared at the next start."""
    require("torch")
    from meshrun.training import snapshot as checkpoint

    for step in (2, 4, 6):
        d = tmp_path / f"step-{step:08d}"
        d.mkdir()
        (d / "COMMITTED.json").write_text("{}")
        (d / "__0_0.distcp").write_bytes(b"x" * 1000)
    checkpoint.prune(str(tmp_path), 1, background=True)
    assert [s for s, _ in checkpoint.committed(str(tmp_path))] == [6]  # at once, whatever the thread's progress
    checkpoint.wait_pruned()
    assert sorted(os.listdir(tmp_path)) == ["step-00000006"]
    (tmp_path / ".trash-step-00000004").mkdir()  # a deletion killed halfway
    checkpoint.clear_partial(str(tmp_path))
    assert sorted(os.listdir(tmp_path)) == ["step-00000006"]


def test_non_finite_loss_stops_the_run_in_one_line_and_saves_nothing(tmp_path):
    require("torch")
    res = run_cli("train", "--example", "toy", "--data", "userpkg.factories:nan_data", "--steps", "5",
                  "--out", str(tmp_path), env=clean_env(PYTHONPATH=HERE))
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1].startswith("meshrun: error: non-finite loss or gradients")
    assert not os.listdir(tmp_path / "checkpoints") if (tmp_path / "checkpoints").exists() else True


def _nan_at_step_three(out, strategy, steps=6, log_every=5, save_every=2, async_save=False):
    """Steps whose third loss is NaN (the model poisons its third forward); by default six,
    a snapshot every 2 steps and a log line every 5: the bad step falls between two checks."""
    import torch

    from meshrun.config import TrainConfig
    from meshrun.errors import MeshrunError
    from meshrun.training.loader import RandomTokens
    from meshrun.training.models.gpt import GPT, GPTConfig
    from meshrun.training.trainer import Trainer

    class Poisoned(GPT):
        def forward(self, idx, targets=None):
            self.calls = getattr(self, "calls", 0) + 1
            loss = super().forward(idx, targets)
            return loss * float("nan") if self.calls == 3 else loss

    torch.manual_seed(0)
    model = Poisoned(GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=2, n_heads=4))
    cfg = TrainConfig(strategy=strategy, steps=steps, seq_len=16, micro_batch=4, log_every=log_every,
                      save_every=save_every, out=out, precision="fp32", async_save=async_save)
    trainer = Trainer(model, RandomTokens(512, 16, 64), None, cfg)
    try:
        trainer.fit()
        message = None
    except MeshrunError as e:
        message = str(e)
    finite = all(torch.isfinite(p.full_tensor() if hasattr(p, "full_tensor") else p).all().item()
                 for p in trainer.model.parameters())
    adam_steps = {float(s["step"]) for s in trainer.optimizer.state.values()}
    return message, finite, adam_steps, trainer.optimizer.defaults["fused"]


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_non_finite_step_between_checks_is_skipped_on_the_device(tmp_path, strategy):
    """The step does not wait for the GPU to learn whether its gradients are finite: fused
    AdamW skips a non-finite update on the device (found_inf), and the trainer stops at the
    next log line or snapshot, naming the bad step; the weights and every committed
    snapshot are clean. Real processes, DTensor parameters under FSDP2."""
    require("torch")
    message, finite, adam_steps, fused = meshrun.run(_nan_at_step_three, str(tmp_path), strategy, nproc=2,
                                                     timeout_s=180)
    assert fused
    assert message is not None and message.startswith("non-finite loss or gradients at step 3;"), message
    assert "stopped at step 4" in message
    assert finite
    assert adam_steps == {3.0}  # steps 1, 2 and 4 updated; 3 was skipped on the device
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step-00000002"]


def test_a_non_finite_step_is_found_within_fifty_steps_without_log_lines(tmp_path):
    """No log line and no snapshot before step 60: the device-side flag is still read every
    50 steps (FINITE_CHECK_EVERY), so the run stops at step 50, not at its end."""
    require("torch")
    message, finite, adam_steps, _ = meshrun.run(_nan_at_step_three, str(tmp_path), "ddp", 60, 10**6, 0,
                                                 nproc=2, timeout_s=180)
    assert message is not None and message.startswith("non-finite loss or gradients at step 3;"), message
    assert "stopped at step 50" in message
    assert finite and adam_steps == {49.0}


# ---- resharding, export and tampering -----------------------------------------------------

def _fsdp_state(out, steps, resume):
    import torch
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from meshrun.config import TrainConfig
    from meshrun.training.loader import RandomTokens
    from meshrun.training.models.gpt import GPT, GPTConfig
    from meshrun.training.trainer import Trainer

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=2, n_heads=4))
    cfg = TrainConfig(strategy="fsdp", steps=steps, seq_len=16, micro_batch=2, global_batch=12, precision="fp32",
                      out=out, save_every=steps, log_every=100, resume=resume)
    trainer = Trainer(model, RandomTokens(512, 16, 64), None, cfg)
    if resume == "none":
        trainer.fit()
    else:
        trainer.restore()
    msd, osd = get_state_dict(trainer.model, trainer.optimizer,
                              options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {"model": msd, "optim": osd.get("state", {}), "step": trainer.step,  # full dicts: rank 0 only
            "fused": {g["fused"] for g in trainer.optimizer.param_groups}}


def test_fsdp_snapshot_from_2_ranks_loads_on_1_and_3(tmp_path):
    require("torch")
    import torch

    out = str(tmp_path)
    saved = meshrun.run(_fsdp_state, out, 4, "none", nproc=2, timeout_s=300)
    assert len(saved["model"]) > 5 and len(saved["optim"]) == len(saved["model"]) - 1  # tied head: one param
    for nproc in (1, 3):
        loaded = meshrun.run(_fsdp_state, out, 4, "auto", nproc=nproc, timeout_s=300)
        assert loaded["step"] == 4
        assert loaded["fused"] == {True}  # the resumed optimizer is still the fused one
        assert saved["model"].keys() == loaded["model"].keys()
        for key in saved["model"]:
            assert torch.equal(saved["model"][key], loaded["model"][key]), key
        for key, state in saved["optim"].items():
            for name in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(state[name], loaded["optim"][key][name]), (nproc, key, name)


@pytest.fixture(scope="module")
def trained_toy(tmp_path_factory):
    """One real run of the toy model with a snapshot at step 4; tests alter copies of it."""
    require("torch")
    out = tmp_path_factory.mktemp("toy")
    res = run_cli("train", "--example", "toy", "--steps", "4", "--save-every", "4", "--out", str(out))
    assert res.returncode == 0, res.stderr[-3000:]
    return out


@pytest.fixture
def snapshot(trained_toy, tmp_path):
    """The step-4 snapshot in a copy of the trained run's OUT (tmp_path/run), this test's own."""
    shutil.copytree(trained_toy, tmp_path / "run")
    return tmp_path / "run" / "checkpoints" / "step-00000004"


def test_export_safetensors_matches_the_snapshot(snapshot, tmp_path):
    from safetensors.torch import load_file

    target = tmp_path / "model.safetensors"
    res = run_cli("export", str(snapshot.parent), "--to", str(target))
    assert res.returncode == 0, res.stderr
    tensors = load_file(str(target))
    assert sorted(tensors) == ["linear.bias", "linear.weight"] and tensors["linear.weight"].shape == (1, 20)


def _rewrite_marker(snap, name):
    from meshrun.training.snapshot.layout import sha256 as _sha256

    marker = snap / "COMMITTED.json"
    data = json.loads(marker.read_text())
    data["files"][name] = _sha256(str(snap / name))
    marker.write_text(json.dumps(data))


def test_altered_shard_is_refused_naming_it(snapshot):
    from meshrun.errors import MeshrunError
    from meshrun.training.snapshot import verify

    shard = sorted(p for p in snapshot.iterdir() if p.suffix == ".distcp")[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(MeshrunError, match=f"{shard.name} does not match the checksum"):
        verify(str(snapshot))


def test_truncated_metadata_is_refused(snapshot):
    from meshrun.errors import MeshrunError
    from meshrun.training.snapshot import verify

    meta = snapshot / ".metadata"
    meta.write_bytes(meta.read_bytes()[:40])
    with pytest.raises(MeshrunError, match=r"\.metadata does not match the checksum"):
        verify(str(snapshot))
    _rewrite_marker(snapshot, ".metadata")  # even with a consistent marker it cannot load
    with pytest.raises(MeshrunError, match=r"\.metadata: refused"):
        verify(str(snapshot))


def test_malicious_pickle_is_refused_without_running(snapshot, tmp_path):
    from meshrun.errors import MeshrunError
    from meshrun.training.snapshot import verify

    witness = tmp_path / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {witness}",))

    (snapshot / ".metadata").write_bytes(pickle.dumps(Payload()))
    _rewrite_marker(snapshot, ".metadata")  # an attacker who also rewrote the marker
    with pytest.raises(MeshrunError, match="system is not allowed"):
        verify(str(snapshot))
    assert not witness.exists()
    # And the CLI refuses to resume from it, in one line.
    res = run_cli("train", "--example", "toy", "--steps", "8", "--out", str(snapshot.parent.parent))
    assert res.returncode == 2 and "is not allowed in checkpoint metadata" in res.stderr.splitlines()[-1]
    assert not witness.exists()


def test_missing_marker_is_an_error_not_a_fresh_start(snapshot):
    (snapshot / "COMMITTED.json").unlink()
    res = run_cli("train", "--example", "toy", "--steps", "8", "--out", str(snapshot.parent.parent))
    assert res.returncode == 2
    assert "has no COMMITTED.json" in res.stderr.splitlines()[-1]


def test_async_save_writes_the_same_snapshots_and_resumes(tmp_path):
    require("torch")
    from safetensors.torch import load_file

    args = ["--example", "toy", "--steps", "12", "--save-every", "4", "--deterministic", "--log-every", "4"]
    sync, asy = tmp_path / "sync", tmp_path / "async"
    for out, extra in ((sync, []), (asy, ["--async-save"])):
        res = run_cli("train", *args, *extra, "--out", str(out))
        assert res.returncode == 0, res.stderr[-3000:]
    assert sorted(os.listdir(asy / "checkpoints")) == ["step-00000004", "step-00000008", "step-00000012"]
    for step in ("step-00000008", "step-00000012"):
        weights = []
        for out in (sync, asy):
            target = tmp_path / f"{out.name}-{step}.safetensors"
            assert run_cli("export", str(out / "checkpoints" / step), "--to", str(target)).returncode == 0
            weights.append(load_file(str(target)))
        assert all(weights[0][k].equal(weights[1][k]) for k in weights[0])
    # Resuming from an asynchronously written snapshot continues like the synchronous run.
    res = run_cli("train", *args[:2], "--steps", "16", *args[4:], "--out", str(asy), "--async-save")
    assert res.returncode == 0 and "at step 12" in res.stdout


def test_async_fsdp_snapshots_equal_sync_ones(tmp_path):
    """FSDP2 on 2 ranks (DTensor shards): the snapshots written in the background from the
    reused staging buffers hold the same weights as synchronous ones at every step."""
    require("torch")
    from safetensors.torch import load_file

    args = ["--model-size", "gpt-tiny", "--seq-len", "32", "--micro-batch", "4", "--steps", "9", "--save-every", "3",
            "--deterministic", "--strategy", "fsdp", "--nproc", "2", "--log-every", "3", "--keep-last", "5"]
    sync, asy = tmp_path / "sync", tmp_path / "async"
    for out, extra in ((sync, []), (asy, ["--async-save"])):
        res = run_cli("train", *args, *extra, "--out", str(out))
        assert res.returncode == 0, res.stderr[-3000:]
    for step in ("step-00000003", "step-00000006"):  # both written asynchronously, the second from reused buffers
        weights = []
        for out in (sync, asy):
            target = tmp_path / f"{out.name}-{step}.safetensors"
            assert run_cli("export", str(out / "checkpoints" / step), "--to", str(target)).returncode == 0
            weights.append(load_file(str(target)))
        assert weights[0].keys() == weights[1].keys()
        assert all(weights[0][k].equal(weights[1][k]) for k in weights[0])


def _stage_twice():
    """Stage an FSDP2 model's state, change the weights, stage again: the second staging
    reuses the first one's buffers, and a staged copy never follows later changes."""
    import torch
    from torch.distributed.checkpoint.state_dict import get_state_dict
    from torch.distributed.fsdp import fully_shard

    from meshrun.training.snapshot.staging import Stager

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    fully_shard(model)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    stager = Stager()
    state = {"model": get_state_dict(model, opt)[0], "optim": get_state_dict(model, opt)[1]}
    first = stager.stage(state)
    w = first["model"]["0.weight"]
    kept = (type(w).__name__, w._local_tensor.clone(), w._local_tensor.data_ptr(), str(w.placements))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    unchanged = torch.equal(first["model"]["0.weight"]._local_tensor, kept[1])
    second = stager.stage({"model": get_state_dict(model, opt)[0], "optim": get_state_dict(model, opt)[1]})
    w2 = second["model"]["0.weight"]
    return (kept[0], kept[3], unchanged, w2._local_tensor.data_ptr() == kept[2],
            torch.equal(w2._local_tensor, kept[1] + 1.0), w2._local_tensor.device.type)


def test_staging_buffers_are_reused_and_hold_a_copy():
    require("torch")
    kind, placements, unchanged, reused, updated, device = meshrun.run(_stage_twice, nproc=2, timeout_s=120)
    assert kind == "DTensor" and "Shard(dim=0)" in placements  # DCP plans the write from the same layout
    assert unchanged and reused and updated and device == "cpu"


def _train_with_a_failing_disk(out):
    """Async snapshots on 2 ranks whose files may not exceed 64 KB (RLIMIT_FSIZE): the first
    background write fails for real (EFBIG), and the next save must say so on every rank."""
    import resource

    import torch

    from meshrun.config import TrainConfig
    from meshrun.errors import MeshrunError
    from meshrun.training import snapshot as checkpoint
    from meshrun.training.loader import RandomTokens
    from meshrun.training.models.gpt import gpt
    from meshrun.training.trainer import Trainer

    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an oversized write fails with EFBIG instead of killing
    torch.manual_seed(0)
    cfg = TrainConfig(model_size="gpt-tiny", seq_len=32, micro_batch=4, steps=4, save_every=2, async_save=True,
                      out=out, precision="fp32", log_every=2, strategy="fsdp")
    trainer = Trainer(gpt("gpt-tiny", 32, 256), RandomTokens(256, 32, 256), None, cfg)
    resource.setrlimit(resource.RLIMIT_FSIZE, (65536, resource.RLIM_INFINITY))
    message = None
    try:
        trainer.fit()
    except MeshrunError as exc:
        message = str(exc)
    resource.setrlimit(resource.RLIMIT_FSIZE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    with open(os.path.join(out, f"result-{torch.distributed.get_rank()}.json"), "w") as f:
        json.dump({"message": message, "committed": checkpoint.committed(os.path.join(out, "checkpoints"))}, f)


def test_failed_background_write_is_reported_and_not_committed(tmp_path):
    require("torch")
    meshrun.run(_train_with_a_failing_disk, str(tmp_path), nproc=2, timeout_s=180)
    for rank in (0, 1):
        result = json.loads((tmp_path / f"result-{rank}.json").read_text())
        assert "background write failed" in (result["message"] or ""), result
        assert "not committed" in result["message"] and result["committed"] == []
        assert "\n" not in result["message"] and "File too large" in result["message"]


def test_failed_synchronous_write_is_one_line_exit_2(tmp_path):
    """`meshrun train` whose files may not exceed 64 KB (ulimit -f, SIGXFSZ ignored): the
    first snapshot's write fails for real; one line naming it, exit 2, nothing committed."""
    require("torch")
    import subprocess
    import sys

    cmd = (f"ulimit -f 64; trap '' XFSZ; exec {sys.executable} -m meshrun train --model-size gpt-tiny "
           f"--seq-len 32 --micro-batch 4 --steps 4 --save-every 2 --strategy fsdp --nproc 2 --out {tmp_path}")
    res = subprocess.run(["bash", "-c", cmd], env=clean_env(), capture_output=True, text=True, timeout=300)
    last = res.stderr.strip().splitlines()[-1]
    assert res.returncode == 2, res.stderr[-3000:]
    assert "the write failed (OSError: [Errno 27] File too large); it is not committed" in last, last
    assert not any(n.startswith("step-") for n in os.listdir(tmp_path / "checkpoints"))


def test_resume_path_and_no_resume(snapshot, tmp_path):
    res = run_cli("train", "--example", "toy", "--steps", "6", "--out", str(tmp_path / "other"),
                  "--resume", str(snapshot))
    assert res.returncode == 0 and f"resumed from {snapshot} at step 4" in res.stdout
    res = run_cli("train", "--example", "toy", "--steps", "6", "--out", str(snapshot.parent.parent), "--no-resume")
    assert res.returncode == 2 and "--overwrite" in res.stderr.splitlines()[-1]  # a new run would mix with them
    res = run_cli("train", "--example", "toy", "--steps", "6", "--out", str(snapshot.parent.parent), "--overwrite")
    assert res.returncode == 0 and "resumed" not in res.stdout
    res = run_cli("train", "--example", "toy", "--steps", "6", "--resume", str(tmp_path / "nothing"))
    assert res.returncode == 2 and "not a committed snapshot" in res.stderr.splitlines()[-1]


def test_each_rank_reads_its_own_shards_and_rank_0s_on_resume(tmp_path):
    """FSDP2 on 4 ranks, saved and resumed on 4: the resume line's bytes per rank stay under
    the whole snapshot (each rank reads, hashing as it reads, its own shard file and rank 0's,
    which holds what all ranks hold alike), not every file of it."""
    require("torch")
    import re

    args = ["--model-size", "gpt-tiny", "--seq-len", "32", "--micro-batch", "1", "--strategy", "fsdp",
            "--nproc", "4", "--save-every", "2", "--log-every", "1", "--data", "random", "--out", str(tmp_path)]
    first = run_cli("train", *args, "--steps", "2")
    assert first.returncode == 0, first.stderr[-3000:]
    snap = tmp_path / "checkpoints" / "step-00000002"
    size_mb = sum(f.stat().st_size for f in snap.iterdir()) / 2**20
    again = run_cli("train", *args, "--steps", "3")
    assert again.returncode == 0, again.stderr[-3000:]
    # (each range one figure where the 4 ranks print alike)
    found = re.search(r"read in [0-9.]+(?:-[0-9.]+)? s a rank \([0-9.]+(?:-[0-9.]+)? s of CPU, "
                      r"([0-9.]+)(?:-([0-9.]+))? MB\)", again.stdout)
    assert found, again.stdout[-2000:]
    least, most = float(found.group(1)), float(found.group(2) or found.group(1))
    assert 0.2 * size_mb < least <= most < 0.85 * size_mb, (least, most, size_mb)
