"""`meshrun train` end to end: the default job, the toy, user factories, outputs, errors."""

import json
import os
import re

import pytest
from helpers import clean_env, meshrun, require, with_faults

from meshrun.cli import main

pytestmark = pytest.mark.framework
HERE = os.path.dirname(__file__)


def records(path):
    with open(path) as f:
        return [json.loads(line) for line in f]


def test_default_job_short_form_loss_falls(tmp_path):
    require("torch")
    # Python's ResourceWarnings shown: the launcher closes what it opens (its ranks' stderr pipes)
    out = meshrun("train", "--steps", "12", "--log-every", "4", "--out", str(tmp_path), timeout=600,
                  env=clean_env(PYTHONWARNINGS="always::ResourceWarning"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "ResourceWarning" not in out.stderr, out.stderr[-3000:]
    # the first lines say what trains on what, and what was resolved, as sentences
    said = [line for line in out.stdout.splitlines() if line.startswith("meshrun train: ")]
    assert said[0] == ("meshrun train: a rank that stops answering for 300 s ends the job (--collective-timeout); "
                       "ranks still running 300 s after another finished are stopped (--finish-timeout)")
    assert said[1] == "meshrun train: model gpt-small (meshrun's GPT preset: 4 layers of width 256), 3.29M parameters"
    assert re.fullmatch(r"meshrun train: data the Python standard library's source \(the \.py files under \S+\): "
                        r"[\d.]+M tokens for training, [\d.]+M for validation; one token per byte \(vocabulary 256\); "
                        r"document masking off", said[2]), said[2]
    assert said[3] == ("meshrun train: 12 steps, each a global batch of 16 sequences of 256 tokens (micro-batch 8 x 1 "
                       "accumulation step x 2 data-parallel ranks); lr 0.001 after 1 warmup step, cosine to 1e-4")
    assert said[4] == "meshrun train: strategy ddp: DDP, buckets of 100 MB, on 2 CPU processes, in fp32"
    rows = records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [4, 8, 12]
    for key in ("step", "loss", "tokens_per_s", "mfu", "peak_mem_bytes"):
        assert key in rows[0]
    assert rows[0]["mfu"] is None  # CPU: no peak to compare with
    assert rows[-1]["loss"] < rows[0]["loss"] - 0.5  # bytes of Python source are learnable
    assert rows[-1]["val_loss"] is not None and rows[-1]["val_loss"] < 4.0
    assert (tmp_path / "loss.png").stat().st_size > 1000
    # a person reads where the run is, how long it has taken and has left, and where it wrote
    # each step line fits 100 columns; the full record is metrics.jsonl's
    lines = [line for line in out.stdout.splitlines() if line.startswith("step ")]
    figures = r"loss [\d.]+ \| lr [\d.e-]+ \| [\d,]+ tok/s \| [\d.]+ (s|ms)/step \| elapsed \d+:\d\d"
    assert all(re.fullmatch(rf"step {s}/12 \| {figures} \| left \d+:\d\d", line)
               for s, line in zip((4, 8), lines[:-1])), lines
    assert re.fullmatch(r"step 12/12 \| loss [\d.]+ \| val loss [\d.]+ \| lr 1e-4 \| [\d,]+ tok/s \| "
                        r"[\d.]+ (s|ms)/step \| elapsed \d+:\d\d", lines[-1]), lines[-1]
    assert all(len(line) <= 100 for line in lines) and "mfu" not in out.stdout  # 2 CPU processes are no GPUs
    closing = out.stdout.splitlines()[-1]
    assert re.fullmatch(rf"meshrun train: finished step 12/12 in \d+:\d\d \(loss [\d.]+, val loss [\d.]+\); "
                        rf"in {re.escape(str(tmp_path))}: metrics.jsonl, loss.png(, tensorboard)?, "
                        r"snapshot checkpoints/step-00000012", closing), closing


def test_toy_example_and_config_file_with_flag_override(tmp_path):
    require("torch")
    cfg = tmp_path / "train.yaml"
    cfg.write_text("example: toy\nsteps: 100\nlr: 0.01\nlog-every: 50\n")
    out = meshrun("train", "--config", str(cfg), "--steps", "60", "--log-every", "20", "--out", str(tmp_path))
    assert out.returncode == 0, out.stderr[-3000:]
    rows = records(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [20, 40, 60]  # the flags won over the file
    assert rows[-1]["loss"] < rows[0]["loss"]


def test_user_model_and_data_factories(tmp_path):
    require("torch")
    env = clean_env(PYTHONPATH=HERE)
    out = meshrun("train", "--model", "userpkg.factories:mlp", "--data", "userpkg.factories:regression",
                  "--steps", "30", "--lr", "0.01", "--log-every", "10", "--global-batch", "64",
                  "--micro-batch", "16", "--out", str(tmp_path), env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "meshrun train: model userpkg.factories:mlp (your Sequential), " in out.stdout
    assert ("meshrun train: data userpkg.factories:regression (your TensorDataset): 1,024 samples for training, "
            "128 for validation\n") in out.stdout
    assert ("meshrun train: 30 steps, each a global batch of 64 samples (micro-batch 16 x 2 accumulation steps x 2 "
            "data-parallel ranks)") in out.stdout
    rows = records(tmp_path / "metrics.jsonl")
    assert rows[-1]["loss"] < rows[0]["loss"] and rows[-1]["val_loss"] is not None


def test_dry_run_starts_each_rank_of_one_node_itself():
    """One node: a process per rank, no torchrun between (its import of torch bought nothing
    meshrun's launcher does not do)."""
    out = meshrun("train", "--dry-run", "--json", "--steps", "5")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["argv"][1:] == ["-u", "-m", "meshrun.training.worker"]
    assert not any("torchrun" in arg for p in data["processes"] for arg in p["argv"])
    ranks = [(p["env"]["RANK"], p["env"]["LOCAL_RANK"], p["env"]["WORLD_SIZE"]) for p in data["processes"]]
    assert ranks == [("0", "0", "2"), ("1", "1", "2")]
    assert len({p["env"]["MASTER_PORT"] for p in data["processes"]}) == 1
    assert json.loads(data["env"]["MESHRUN_TRAIN_CONFIG"])["steps"] == 5


def test_dry_run_of_a_multi_node_job_launches_torchrun():
    out = meshrun("train", "--dry-run", "--json", "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1",
                  "--master-port", "29999")
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    assert data["argv"][0].endswith("torchrun") and data["argv"][-2:] == ["-m", "meshrun.training.worker"]


ERRORS = [
    (["--example", "toy", "--fused-loss"], "--fused-loss=True: is a loss of meshrun's built-in GPT"),
    (["--fused-loss", "--tp", "2"], "--fused-loss=True: does not combine with --tp/--pp"),
    (["--attention", "fast"],
     "--attention='fast': unknown value (hint: choose one of auto, cudnn, flash, efficient, math)"),
    (["--kernels", "fast"], "--kernels='fast': unknown value (hint: choose one of auto, plain)"),
    (["--example", "toy", "--kernels", "plain"], "--kernels='plain': chooses the kernels of meshrun's built-in GPT"),
    (["--strategy", "zero4"],
     "--strategy='zero4': unknown value (hint: choose one of auto, fsdp, single, ddp, "
     "fsdp-grad-op, fsdp-full, fsdp-offload, fsdp-hybrid, fsdp-no-shard, zero1, zero2, zero3, zero2-offload"),
    (["--strategy", "deepspeed"], "--strategy='deepspeed': unknown value"),
    (["--gpu-mem", "80GiB"], "--gpu-mem='80GiB': sets the GPUs a dry run decides for; the ranks read their own "
     "(hint: add --dry-run, or drop it)"),
    (["--cpu-mem", "32GiB"], "--cpu-mem='32GiB': sets the host memory a dry run decides for; the ranks read their "
     "own (hint: add --dry-run, or drop it)"),
    (["--cpu-mem", "lots", "--dry-run"], "--cpu-mem='lots': is not a size"),
    (["--global-batch", "100", "--micro-batch", "8"],
     "--global-batch=100: is not a multiple of micro-batch 8 x data-parallel size 2 = 16 "
     "(hint: use a multiple of 16, e.g. 96 or 112)"),
    (["--global-batch", "5"], "--global-batch=5: does not split over 2 data-parallel ranks "
     "(hint: use a multiple of 2, e.g. 4 or 6)"),
    (["--model", "nosuchpkg.models:build"],
     "--model='nosuchpkg.models:build': cannot import module 'nosuchpkg.models'"),
    (["--model", "userpkg.factories:nothing"], "module 'userpkg.factories' has no callable 'nothing'"),
    (["--model-size", "gpt-9t"], "--model-size='gpt-9t': unknown GPT preset"),
    (["--steps", "0"], "--steps=0: must be at least 1"),
    (["--data", "wikipedia"], "--data='wikipedia': no such file or directory, and not module:factory"),
    (["--strategy", "single"], "--strategy='single': runs one process, but the world has 2"),
    (["--tp", "3"], "dp_replicate(1) * dp_shard(?) * tp(3) * pp(1) cannot equal WORLD_SIZE(2)"),
    (["--tp", "0"], "--tp=0: must be at least 1"),
    (["--tp", "2", "--strategy", "ddp"], "--strategy='ddp': does not compose with --tp=2: tensor, pipeline and "
                                         "context parallelism run with FSDP2"),
    (["--cp", "2", "--strategy", "zero2"], "--strategy='zero2': does not compose with --cp=2"),
    (["--compile", "maybe"], "--compile='maybe': unknown value (hint: choose one of auto, on, off)"),
    (["--compile", "off", "--compile-tune"], "--compile-tune=True: tunes compiled kernels, but --compile is off"),
    (["--tp", "3", "--nproc", "3", "--model-size", "gpt-tiny"],
     "--tp=3: the model's 4 attention heads do not split over 3 ranks"),
    (["--tp", "2", "--seq-len", "15", "--model-size", "gpt-tiny"],
     "--seq-len=15: does not split over --tp 2 for sequence parallelism"),
    (["--sequence-parallel", "maybe"], "--sequence-parallel='maybe': expected bool (hint: true or false"),
    (["--pp", "3", "--micro-batch", "6"], "dp_replicate(1) * dp_shard(?) * tp(1) * pp(3) cannot equal WORLD_SIZE(2)"),
    (["--pp", "2", "--micro-batch", "3"], "--micro-batch=3: does not split into 2 pipeline micro-batches"),
    (["--pp", "2", "--pp-schedule", "interleaved", "--model-size", "gpt-tiny"],
     "--pp: the model has 2 blocks, fewer than the 4 pipeline stages"),
    (["--pp", "2", "--pp-schedule", "zb"], "--pp-schedule='zb': unknown value"),
    (["--cp", "2", "--seq-len", "30"], "--seq-len=30: context parallelism over 2 ranks cuts sequences into 4"),
    (["--ep", "2"], "--ep=2: the model has no experts"),
    (["--experts", "3", "--ep", "2", "--model-size", "gpt-tiny"], "--ep=2: 3 experts do not split over 2 ranks"),
    (["--zero", "3"], "unrecognized arguments: --zero 3"),
    (["--precision", "fp8", "--nproc", "1", "--model-size", "gpt-tiny"],
     "--precision='fp8': float8 matmuls need a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
     "this run is on the CPU (hint: --precision auto or fp32)"),
]


@pytest.mark.parametrize("flags,said", [(["--pp", "2"], "pipeline 2 (1f1b)"), (["--tp", "2"], "tensor parallel 2"),
                                        (["--cp", "2"], "context parallel 2"),
                                        (["--experts", "4", "--ep", "2"], "expert parallel 2"),
                                        (["--strategy", "zero3"], "DeepSpeed ZeRO-3")],
                         ids=["pp", "tp", "cp", "ep", "zero3"])
def test_parallel_layouts_from_the_cli(tmp_path, flags, said):
    """Each layout end to end through `meshrun train`: launched, trained, snapshot committed."""
    out = meshrun("train", *flags, "--model-size", "gpt-tiny", "--seq-len", "32", "--micro-batch", "4",
                  "--steps", "4", "--log-every", "2", "--data", "random", "--out", str(tmp_path / "run"), timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert said in out.stdout
    assert (tmp_path / "run" / "checkpoints" / "step-00000004" / "COMMITTED.json").is_file()


@pytest.mark.parametrize("args,message", ERRORS)
def test_bad_input_is_one_line_exit_2(args, message, capsys):
    """Each is refused before any process starts: through the CLI in-process (the real
    subprocess path of such refusals: tests/test_prelaunch.py, tests/test_bad_input.py)."""
    code = main(["train", *args], clean_env(PYTHONPATH=HERE))
    err = capsys.readouterr().err
    assert code == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("meshrun: error: ") and message in last


def test_config_file_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("stepz: 3\n")
    out = meshrun("train", "--config", str(bad))
    assert out.returncode == 2 and "unknown key" in out.stderr and "stepz" in out.stderr
    typed = tmp_path / "typed.toml"
    typed.write_text('steps = "many"\n')
    out = meshrun("train", "--config", str(typed))
    assert out.returncode == 2 and "--steps (from config" in out.stderr and "'many'" in out.stderr


@pytest.mark.parametrize("var,value,said", [
    ("MESHRUN_COMPILE", "maybe",
     "--compile (from env MESHRUN_COMPILE)='maybe': unknown value (hint: choose one of auto, on, off"),
    ("MESHRUN_COMPILE_TUNE", "sure", "--compile-tune (from env MESHRUN_COMPILE_TUNE)='sure': expected bool"),
    ("MESHRUN_STEPS", "0", "--steps (from env MESHRUN_STEPS)=0: must be at least 1"),
], ids=["bool", "compile-tune", "validated"])
def test_errors_about_a_variable_name_it(var, value, said):
    """A bad value from the environment is reported with the variable it came from, before
    anything launches (the type check and validate() both see where it came from)."""
    out = meshrun("train", "--dry-run", env=clean_env(**{var: value}))
    assert out.returncode == 2 and said in out.stderr.strip().splitlines()[-1], out.stderr[-2000:]


def test_compile_tune_from_the_environment_asks_for_compile():
    out = meshrun("train", "--dry-run", "--json", env=clean_env(MESHRUN_COMPILE_TUNE="1"))
    cfg = json.loads(json.loads(out.stdout)["env"]["MESHRUN_TRAIN_CONFIG"])
    assert cfg["compile"] and cfg["compile_tune"] and cfg["sources"]["compile_tune"] == "env MESHRUN_COMPILE_TUNE"


def test_factory_that_raises_inside_the_ranks_is_reported_in_one_line():
    out = meshrun("train", "--data", "userpkg.factories:broken", "--steps", "2", env=clean_env(PYTHONPATH=HERE))
    assert out.returncode == 2
    last = out.stderr.strip().splitlines()[-1]
    assert last == ("meshrun: error: --data='userpkg.factories:broken': the factory raised "
                    "RuntimeError: database unreachable")
    assert "Traceback" not in out.stderr  # torchrun's failure report is not relayed


def test_trainer_importable_from_meshrun():
    require("torch")
    import meshrun

    assert meshrun.Trainer.__name__ == "Trainer" and meshrun.TrainConfig().strategy == "auto"


def test_out_of_memory_even_at_micro_batch_1_suggests_another_strategy():
    out = meshrun("train", "--example", "toy", "--model", "userpkg.factories:oom_model", "--steps", "3",
                  env=with_faults(clean_env(PYTHONPATH=HERE), device_memory=1))  # the try runs as on a GPU
    assert out.returncode == 2
    halvings = [line for line in out.stdout.splitlines() if "out of GPU memory at micro-batch" in line]
    assert len(halvings) == 5  # 32, 16, 8, 4, 2: each halved, then micro-batch 1 does not fit either
    last = out.stderr.strip().splitlines()[-1]
    assert last.startswith("meshrun: error: out of GPU memory in a first micro-step with strategy ddp, micro-batch 1")
    assert "--activation-checkpointing full, or an FSDP2 --strategy" in last
    assert "Traceback" not in out.stderr


# Writes an error file and a preemption file at guessable per-pid paths in the shared temp
# directory (/tmp/meshrun-train-PID.err, .preempted), then runs meshrun as this very process
# (exec keeps the pid): meshrun must read neither.
PLANT_THEN_EXEC = """
import os, sys, tempfile
for suffix, text in ((".err", "planted error"), (".preempted", "planted preemption")):
    with open(os.path.join(tempfile.gettempdir(), f"meshrun-train-{os.getpid()}{suffix}"), "w") as f:
        f.write(text + "\\n")
os.execv(sys.executable, [sys.executable, "-m", "meshrun", *sys.argv[1:]])
"""


def test_planted_report_files_are_not_read_and_the_run_leaves_none(tmp_path):
    import subprocess
    import sys

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    out = subprocess.run([sys.executable, "-c", PLANT_THEN_EXEC, "train", "--data", "userpkg.factories:broken",
                          "--steps", "2"], env=clean_env(PYTHONPATH=HERE, TMPDIR=str(tmp)),
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 2, out.stderr
    assert out.stderr.strip().splitlines()[-1] == (
        "meshrun: error: --data='userpkg.factories:broken': the factory raised RuntimeError: database unreachable")
    assert "planted" not in out.stderr
    assert not [p.name for p in tmp.iterdir() if p.is_dir() and p.name.startswith("meshrun-train-")]
