"""Every bad input is one line, ``meshrun: error: <option>=<value>: <problem> (hint: ...)``,
with exit code 2: never a traceback, never accepted without a word.

Each case is (argv, extra environment, a substring of the error). Most run ``meshrun.cli.main``
in-process (they fail during validation, before any process starts); the cases that used to
end in a traceback also run the real CLI in a subprocess. ``{fix}`` in an argument stands for
a directory of fixtures outside the working directory, which must stay empty."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from helpers import clean_env, meshrun, require, script

from meshrun.cli import main

SCRIPT = script("sleeper.py")
GPU80 = ("--gpu-mem", "80GiB")

TOPOLOGY_BAD: list[tuple[list[str], dict[str, str], str]] = [
    (["--nnodes", "x"], {}, "--nnodes='x'"),
    (["--nnodes", "0"], {}, "--nnodes='0'"),
    (["--nnodes", "3:1"], {}, "'3:1'"),
    (["--nnodes", "1:x"], {}, "x'"),  # (a command with no node range says so first)
    (["--node-rank=-1"], {}, "--node-rank=-1: must be at least 0"),
    (["--node-rank", "r"], {}, "--node-rank='r'"),
    (["--nnodes", "2", "--node-rank", "2", "--master-addr", "h"], {}, "=2"),
    (["--nnodes", "2", "--node-rank", "1"], {}, "master address"),
    (["--nproc", "0"], {}, "--nproc-per-node=0: must be at least 1"),
    (["--nproc", "two"], {}, "'two'"),
    (["--master-port", "0"], {}, "--master-port=0: must be between 1 and 65535"),
    (["--master-port", "70000"], {}, "70000"),
    (["--master-port", "p"], {}, "'p'"),
    (["--platform", "bogus"], {}, "--platform='bogus'"),
    (["--platform", "slurm"], {}, "--platform='slurm'"),
    (["--nnodes", "2", "--hosts", "a,b,c"], {}, "a,b,c"),
    ([], {"MESHRUN_NNODES": "x"}, "--nnodes (from env MESHRUN_NNODES)='x'"),
    ([], {"MESHRUN_MASTER_PORT": "99999"}, "99999"),
    ([], {"NNODES": "2", "NODE_RANK": "1"}, "master address"),
    ([], {"NNODES": "x"}, "NNODES='x'"),
    ([], {"PET_NNODES": "2:x"}, "PET_NNODES='2:x'"),
    ([], {"SLURM_JOB_ID": "1", "SLURM_NNODES": "two"}, "'two'"),
]

COMMAND_PREFIXES = {
    "env": ["env"],
    "launch": ["launch", "--dry-run"],
    "train": ["train", "--dry-run"],
    "bench": ["bench", "comm"],
}


def _topology_cases() -> list:
    cases = []
    for name, prefix in COMMAND_PREFIXES.items():
        for argv, env, expected in TOPOLOGY_BAD:
            tail = [SCRIPT] if name == "launch" else []
            cases.append(pytest.param(prefix + argv + tail, env, expected, id=f"{name}:{' '.join(argv)}{env}"))
    return cases


CASES = [
    # the command line itself
    (["bogus"], {}, "'bogus'"),
    (["env", "--bogus"], {}, "--bogus"),
    (["train", "--steps", "x"], {}, "'x'"),
    (["train", "--example", "bogus"], {}, "'bogus'"),
    # train: numbers
    (["train", "--dry-run", "--lr", "nan"], {}, "--lr=nan"),
    (["train", "--dry-run", "--lr", "inf"], {}, "--lr=inf"),
    (["train", "--dry-run", "--lr", "0"], {}, "--lr=0"),
    (["train", "--dry-run", "--lr=-1e-3"], {}, "--lr=-0.001"),
    (["train", "--dry-run"], {"MESHRUN_LR": "nan"}, "MESHRUN_LR"),
    (["train", "--dry-run"], {"MESHRUN_LR": "abc"}, "'abc'"),
    (["train", "--dry-run", "--weight-decay=-0.1"], {}, "--weight-decay=-0.1"),
    (["train", "--dry-run", "--weight-decay", "nan"], {}, "--weight-decay=nan"),
    (["train", "--dry-run", "--grad-clip", "nan"], {}, "--grad-clip=nan"),
    (["train", "--dry-run", "--grad-clip=-1"], {}, "--grad-clip=-1"),
    (["train", "--dry-run", "--min-lr-ratio", "2"], {}, "--min-lr-ratio=2"),
    (["train", "--dry-run", "--min-lr-ratio", "nan"], {}, "--min-lr-ratio=nan"),
    (["train", "--dry-run", "--steps", "0"], {}, "--steps=0"),
    (["train", "--dry-run"], {"MESHRUN_STEPS": "x"}, "(from env MESHRUN_STEPS)='x': expected int"),
    (["train", "--dry-run"], {"MESHRUN_STEPS": "0"}, "MESHRUN_STEPS"),
    (["train", "--dry-run", "--micro-batch", "0"], {}, "--micro-batch=0"),
    (["train", "--dry-run", "--global-batch", "7"], {}, "--global-batch=7"),
    (["train", "--dry-run", "--seq-len", "0"], {}, "--seq-len=0"),
    (["train", "--dry-run", "--warmup=-1"], {}, "--warmup=-1"),
    (["train", "--dry-run", "--save-every=-1"], {}, "--save-every=-1"),
    (["train", "--dry-run", "--keep-last=-1"], {}, "--keep-last=-1"),
    (["train", "--dry-run", "--log-every", "0"], {}, "--log-every=0"),
    (["train", "--dry-run", "--eval-batches", "0"], {}, "--eval-batches=0"),
    (["train", "--dry-run", "--tp", "0"], {}, "--tp=0"),
    (["train", "--dry-run", "--experts=-1"], {}, "--experts=-1"),
    (["train", "--dry-run", "--max-restarts=-1"], {}, "--max-restarts=-1"),
    (["train", "--dry-run", "--max-restarts", "1"], {}, "--max-restarts"),
    (["train", "--dry-run", "--nnodes", "1:2"], {}, "--nnodes"),
    # train: choices
    (["train", "--dry-run", "--strategy", "bogus"], {}, "--strategy='bogus'"),
    (["train", "--dry-run", "--precision", "fp7"], {}, "--precision='fp7'"),
    (["train", "--dry-run", "--precision", "fp8-rowwise", "--strategy", "zero2"], {},
     "--precision='fp8-rowwise': does not combine with DeepSpeed's engine (--strategy zero2)"),
    (["train", "--dry-run", "--precision", "fp8", "--tp", "2", "--nproc", "2"], {},
     "--precision='fp8': does not combine with --tp"),
    (["train", "--dry-run", "--document-mask", "--pp", "2", "--nproc", "2", "--data", "{fix}/afile"], {},
     "--document-mask=True: does not combine with --pp"),
    (["train", "--dry-run", "--model-size", "gpt-huge"], {}, "--model-size='gpt-huge'"),
    (["train", "--dry-run", "--attention", "fast"], {}, "--attention='fast'"),
    (["train", "--dry-run", "--kernels", "fast"], {}, "--kernels='fast'"),
    (["train", "--dry-run", "--compile", "maybe"], {}, "--compile='maybe'"),
    (["train", "--dry-run", "--activation-checkpointing", "half"], {}, "'half'"),
    (["train", "--dry-run", "--pp-schedule", "zigzag"], {}, "'zigzag'"),
    (["train", "--dry-run", "--reduce-precision", "fp8"], {}, "'fp8'"),
    (["train", "--dry-run", "--data-dtype", "int8"], {}, "'int8'"),
    (["train", "--dry-run", "--init", "random"], {}, "--init='random'"),
    (["train", "--dry-run", "--data", "/nonexistent/corpus"], {}, "/nonexistent/corpus"),
    (["train", "--dry-run", "--data", "{fix}/doc.txt", "--ext", ""], {}, "--ext='': an empty extension"),
    (["train", "--dry-run", "--data", "{fix}/doc.txt"], {"MESHRUN_EXT": "a\\b"},
     "--ext (from env MESHRUN_EXT)='a\\\\b': 'a\\\\b' holds a path separator"),
    (["train", "--dry-run", "--ext", "py"], {}, "--ext='py': chooses the files of a text corpus that are read"),
    (["train", "--dry-run", "--data", "random", "--ext", "py"], {}, "--ext='py': chooses the files of a text corpus"),
    (["train", "--dry-run", "--example", "toy", "--fused-loss"], {}, "--fused-loss"),
    (["train", "--dry-run", "--sequence-parallel", "maybe"], {}, "'maybe'"),
    (["train", "--dry-run"], {"MESHRUN_EXAMPLE": "bogus"},
     "--example (from env MESHRUN_EXAMPLE)='bogus': unknown value"),
    (["train"], {"MESHRUN_DRY_RUN": "maybe"}, "--dry-run (from env MESHRUN_DRY_RUN)='maybe': expected bool"),
    (["train", "--dry-run", "--model", "no_such_module_xyz:build"], {}, "no_such_module_xyz:build"),
    # train: where it writes
    (["train", "--dry-run", "--out", "{fix}/afile"], {}, "afile"),
    (["train", "--dry-run", "--out", "{fix}/afile/sub"], {}, "afile/sub"),
    (["train", "--dry-run"], {"MESHRUN_OUT": "{fix}/afile"}, "MESHRUN_OUT"),
    # train: config files
    (["train", "--dry-run", "--config", "{fix}/missing.yaml"], {}, "missing.yaml"),
    (["train", "--dry-run", "--config", "{fix}/dup.yaml"], {}, "'steps'"),
    (["train", "--dry-run", "--config", "{fix}/dup_spelling.yaml"], {}, "micro_batch"),
    (["train", "--dry-run", "--config", "{fix}/dup.toml"], {}, "dup.toml"),
    (["train", "--dry-run", "--config", "{fix}/unknown.yaml"], {}, "'stepz'"),
    (["train", "--dry-run", "--config", "{fix}/inf.yaml"], {}, "inf"),
    (["train", "--dry-run", "--config", "{fix}/nan.yaml"], {}, "nan"),
    (["train", "--dry-run", "--config", "{fix}/list.yaml"], {}, "list.yaml"),
    (["train", "--dry-run", "--config", "{fix}/broken.yaml"], {}, "broken.yaml"),
    # launch
    (["launch", "--dry-run", "/nonexistent/script.py"], {}, "/nonexistent/script.py"),
    (["launch", "--dry-run", "--framework", "bogus", SCRIPT], {}, "'bogus'"),
    (["launch", "--dry-run", "--rdzv", "etcd", SCRIPT], {}, "'etcd'"),
    (["launch", "--dry-run", "--max-restarts", "x", SCRIPT], {}, "'x'"),
    (["launch", "--dry-run", SCRIPT], {"MESHRUN_FRAMEWORK": "bogus"}, "'bogus'"),
    (["launch", "--dry-run", SCRIPT], {"MESHRUN_RDZV": "etcd"}, "MESHRUN_RDZV='etcd'"),
    (["launch", "--dry-run", SCRIPT], {"MESHRUN_MAX_RESTARTS": "x"}, "MESHRUN_MAX_RESTARTS='x'"),
    (["launch", "--dry-run", "--mixed-precision", "fp4", SCRIPT], {}, "'fp4'"),
    # plan
    (["plan", *GPU80, "--margin", "x"], {}, "--margin='x'"),
    (["plan", *GPU80, "--margin", "1"], {}, "--margin='1'"),
    (["plan", *GPU80], {"MESHRUN_MARGIN": "-1"}, "'-1'"),
    (["plan", "--gpu-mem", "lots"], {}, "'lots'"),
    (["plan"], {}, "--gpu-mem"),
    (["plan", *GPU80, "--cpu-mem", "lots"], {}, "'lots'"),
    (["plan", *GPU80, "--nodes", "x"], {}, "'x'"),
    (["plan", *GPU80, "--nodes", "0"], {}, "'0'"),
    (["plan", *GPU80, "--gpus-per-node", "0"], {}, "'0'"),
    (["plan", *GPU80, "--model", "llama3-8b", "--lora", "0"], {}, "--lora='0': must be >= 1"),
    (["plan", *GPU80, "--model", "llama3-8b", "--lora", "x"], {}, "--lora='x'"),
    (["plan", *GPU80, "--model", "llama3-8b", "--lora", "16", "--quantize", "xyz"], {}, "'xyz'"),
    (["plan", *GPU80, "--model", "llama3-8b", "--quantize", "nf4"], {}, "--quantize='nf4': quantizes the frozen"),
    (["plan", *GPU80, "--model", "llama3-8b", "--lora-targets", "q,v"], {}, "--lora-targets='q,v': configures"),
    (["plan", *GPU80, "--model", "llama3-8b", "--lora", "16", "--lora-targets", "q,nope"], {},
     "--lora-targets='nope': matches no linear layer of llama3-8b"),
    (["plan", *GPU80, "--model", "gpt-small", "--lora", "16", "--lora-targets", "q"], {},
     "--lora-targets='q': matches no linear layer"),
    (["plan", *GPU80, "--model", "llama3-8b", "--lora", "16", "--lora-targets", "q,,v"], {}, "has an empty name"),
    (["plan", *GPU80, "--model", "llama3-8b", "--lora", "16", "--lora-dropout", "1"], {}, "--lora-dropout='1'"),
    (["plan", *GPU80, "--model", "llama3-8b", "--lora", "16", "--lora-alpha", "-2"], {}, "--lora-alpha='-2'"),
    (["plan", *GPU80, "--model", "llama3-8b", "--lora", "16", "--lora-alpha", "nan"], {}, "--lora-alpha='nan'"),
    (["plan", *GPU80, "--seq-len", "x"], {}, "'x'"),
    (["plan", *GPU80, "--micro-batch", "0"], {}, "'0'"),
    (["plan", *GPU80, "--global-batch=-4"], {}, "'-4'"),
    (["plan", *GPU80, "--precision", "fp7"], {}, "'fp7'"),
    (["plan", *GPU80, "--optimizer", "lion"], {}, "'lion'"),
    (["plan", *GPU80, "--framework", "jax"], {}, "'jax'"),
    (["plan", *GPU80, "--compile", "maybe"], {}, "'maybe'"),
    (["plan", *GPU80, "--intra", "carrier-pigeon"], {}, "'carrier-pigeon'"),
    (["plan", *GPU80, "--inter", "0"], {}, "--inter='0'"),
    (["plan", *GPU80, "--model", "gpt-huge"], {}, "'gpt-huge'"),
    (["plan", *GPU80, "--model", "os:system"], {}, "'os:system'"),
    (["plan", *GPU80, "--model", "os:getcwd"], {}, "'os:getcwd'"),
    (["plan", *GPU80, "--strategy", "bogus"], {}, "--strategy='bogus'"),
    (["plan", *GPU80, "--write", "{fix}/afile"], {}, "afile"),
    (["plan", *GPU80], {"MESHRUN_PRECISION": "fp7"}, "MESHRUN_PRECISION='fp7'"),
    (["plan", "--gpu", "a10g"], {}, "--gpu='a10g'"),
    (["plan"], {"MESHRUN_GPU": "b300"}, "MESHRUN_GPU='b300'"),
    (["plan", "--gpu", "a100", "--precision", "fp8"], {}, "--precision='fp8'"),
    # data prepare
    (["data", "prepare", "/nonexistent/corpus", "--tokenizer", "gpt2", "--out", "out"], {}, "/nonexistent/corpus"),
    (["data", "prepare", "x", "--tokenizer", "gpt2", "--out", "out", "--workers", "x"], {}, "'x'"),
    (["data", "prepare", "x", "--tokenizer", "gpt2", "--out", "out", "--val-fraction", "x"], {}, "'x'"),
    (["data", "prepare", "x", "--tokenizer", "gpt2", "--out", "out", "--shard-tokens", "0"], {}, "--shard-tokens=0"),
    (["data", "bogus"], {}, "'bogus'"),
    (["data", "prepare", "{fix}/doc.txt", "--out", "out"], {},
     "--tokenizer is not given: the corpus needs a tokenizer"),
    (["data", "prepare", "{fix}/doc.txt", "--tokenizer", "gpt2", "--out", "out", "--ext", ""], {},
     "--ext='': an empty extension"),
    (["data", "prepare", "{fix}/doc.txt", "--tokenizer", "gpt2", "--out", "out", "--ext", "py", "--ext", "."], {},
     "--ext='py,.': an empty extension"),
    (["data", "prepare", "{fix}/doc.txt", "--tokenizer", "gpt2", "--out", "out", "--ext", "src/py"], {},
     "--ext='src/py': 'src/py' holds a path separator"),
    (["data", "prepare", "{fix}/doc.txt", "--tokenizer", "gpt2", "--out", "out", "--ext", "*.py"], {},
     "'*.py' is not a file extension"),
    (["data", "prepare", "{fix}/doc.txt", "--tokenizer", "gpt2", "--out", "out", "--ext", "jsonl"], {},
     "--ext='jsonl': .jsonl files are read by their format already"),
    (["data", "prepare", "{fix}/doc.txt", "--tokenizer", "gpt2", "--out", "out"], {"MESHRUN_EXT": "py,"},
     "--ext (from env MESHRUN_EXT)='py,': an empty extension"),
    (["data", "prepare", "{fix}/doc.txt", "--train-tokenizer", "256", "--out", "out"], {},
     "--train-tokenizer=256: must be between 257 and 65536"),
    (["data", "prepare", "{fix}/doc.txt", "--train-tokenizer", "65537", "--out", "out"], {},
     "--train-tokenizer=65537: must be between 257 and 65536"),
    (["data", "prepare", "{fix}/doc.txt", "--train-tokenizer", "8k", "--out", "out"], {}, "'8k'"),
    (["data", "prepare", "{fix}/doc.txt", "--train-tokenizer", "300", "--tokenizer", "gpt2", "--out", "out"], {},
     "--train-tokenizer=300: trains a tokenizer, and --tokenizer names one (gpt2)"),
    (["data", "prepare", "{fix}/doc.txt", "--train-tokenizer", "300", "--eos-token", "</s>", "--out", "out"], {},
     "--eos-token='</s>': names the end-of-document token of a tokenizer given"),
    (["data", "prepare", "{fix}/afile", "--tokenizer", "gpt2", "--out", "out"], {},
     "not a text corpus file (hint: one of .txt, .md, .text, .jsonl, .parquet, or a directory)"),
    (["data", "prepare", "{fix}/adir.safetensors", "--tokenizer", "gpt2", "--out", "out"], {},
     "a directory with no .txt, .md, .text, .jsonl, .parquet file in it (hint: point at"),
    (["data", "prepare", "{fix}/code", "--tokenizer", "gpt2", "--out", "out"], {},
     "a directory with no .txt, .md, .text, .jsonl, .parquet file in it (it holds 3 files: .py 2, no extension 1) "
     "(hint: --ext .py reads .py files as text too, one document each, or point at"),
    (["data", "prepare", "{fix}/code/a.py", "--tokenizer", "gpt2", "--out", "out"], {},
     "or a directory; --ext .py reads .py files as text)"),
    # render
    (["render", "bogus", "--", "meshrun", "train"], {}, "bogus"),
    (["render", "slurm", "--nodes", "1", "-o", "{fix}/adir.safetensors", "--", "echo"], {}, "adir.safetensors"),
    (["render", "slurm", "--nodes", "1", "-o", "{fix}/afile/job.sbatch", "--", "echo"], {}, "afile/job.sbatch"),
    # doctor
    (["doctor", "--nnodes", "x"], {}, "'x'"),
    (["doctor", "--platform", "bogus"], {}, "'bogus'"),
    (["doctor"], {"MESHRUN_JSON": "maybe"}, "MESHRUN_JSON='maybe'"),
    # bench
    (["bench", "bogus"], {}, "'bogus'"),
    (["bench", "comm", "--min-time", "x"], {}, "--min-time='x'"),
    (["bench", "comm", "--min-time", "0"], {}, "--min-time='0'"),
    (["bench", "comm", "--ops", "all_to_nowhere"], {}, "all_to_nowhere"),
    (["bench", "comm", "--sizes", "1GiB:1KiB"], {}, "1GiB:1KiB"),
    (["bench", "comm", "--sizes", "big"], {}, "'big'"),
    (["bench", "matmul", "--n", "0"], {}, "--n='0'"),
    (["bench", "train", "--model", "gpt-huge"], {}, "'gpt-huge'"),
    (["bench", "train", "--steps", "x"], {}, "--steps='x'"),
    (["bench", "train", "--seq-len", "0"], {}, "--seq-len='0'"),
    (["bench", "comm", "--nnodes", "1:2"], {}, "--nnodes"),
    (["bench", "comm"], {"MESHRUN_MIN_TIME": "soon"}, "'soon'"),
    # export
    (["export", "/nonexistent/snapshot", "--to", "out"], {}, "/nonexistent/snapshot"),
    (["export", "/nonexistent/snapshot", "--to", "out", "--format", "onnx"], {}, "'onnx'"),
    (["export", "/nonexistent/snapshot"], {}, "--to"),
    (["export", "snap", "--to", "{fix}/adir.safetensors"], {}, "adir.safetensors"),
    (["export", "snap", "--to", "{fix}", "--format", "safetensors"], {}, "--to="),
    (["export", "snap", "--to", "{fix}/afile/model.safetensors"], {}, "afile/model.safetensors"),
    (["export", "snap", "--to", "{fix}/afile"], {}, "afile"),
    # paths as text: the same rule for every path a command names
    (["export", "snap ", "--to", "out"], {}, "SNAPSHOT='snap ': starts or ends with a space"),
    (["export", "snap", "--to", "out\n"], {}, "--to='out\\n': contains the control character"),
    (["train", "--dry-run", "--config", " run.yaml"], {}, "--config=' run.yaml': starts or ends with a space"),
    (["data", "prepare", "{fix}", "--tokenizer", "gpt2", "--out", "a\x7fb"], {}, "control character"),
    (["plan", "--model", "gpt-124m", "--write", "w\tx"], {}, "--write='w\\tx': contains the control character"),
    # bounds the runtime sets, checked before any process starts
    (["bench", "matmul", "--n", "10000000"], {}, "--n='10000000': three 10000000 x 10000000 matrices need"),
    (["bench", "comm", "--sizes", "1KiB:64TiB"], {}, "64 TiB is more than a quarter of"),
    (["train", "--dry-run", "--nproc", "5000"], {}, "--nproc=5000: more than 4 processes per core"),
    (["train", "--dry-run", "--nproc", "2"], {"MESHRUN_SAVE_THREADS": "abc"}, "env MESHRUN_SAVE_THREADS='abc'"),
    (["train", "--dry-run", "--nproc", "2"], {"MESHRUN_SAVE_THREADS": "0"}, "must be between 1 and 64"),
    (["train", "--dry-run", "--steps", str(2**63)], {}, "must be at most 9223372036854775807 (a 64-bit integer)"),
    (["train", "--dry-run", "--collective-timeout", str(10**15)], {}, "must be between 1 and 604800"),
    # a job's shape past any cluster or machine built, from a flag or the platform's variables
    (["launch", "--dry-run", "--nproc", "5000", "x.py"], {}, "--nproc=5000: more than 4 processes per core"),
    (["launch", "--dry-run", "--nnodes", "200000", "--node-rank", "0", "--master-addr", "h", "x.py"], {},
     "flag --nnodes=200000: more than 100,000 nodes"),
    (["train", "--dry-run"], {"NNODES": "10000000", "NODE_RANK": "1", "MASTER_ADDR": "h"},
     "env NNODES=10000000: more than 100,000 nodes"),
    (["env", "--nnodes", str(10**12), "--node-rank", "0", "--master-addr", "h"], {}, "more than 100,000 nodes"),
    (["plan", *GPU80, "--nodes", "1000000"], {}, "--nnodes='1000000': must be at most 100,000"),
    (["plan", *GPU80, "--gpus-per-node", "100000000"], {}, "--gpus-per-node='100000000': must be at most 64"),
    (["render", "slurm", "--nodes", str(10**11), "--", "x"], {}, "--nodes=100000000000: must be in 1..100,000"),
    (["render", "slurm", "--gpus-per-node", "1000", "--", "x"], {}, "--gpus-per-node=1000: must be in 0..64"),
]

# The ones that ended in a traceback: also run as the real CLI, in a subprocess.
SUBPROCESS_CASES = [
    (["train", "--out", "{fix}/afile"], {}, "afile"),
    (["plan", *GPU80, "--model", "os:system"], {}, "'os:system'"),
    (["plan", *GPU80, "--write", "{fix}/afile"], {}, "afile"),
    (["export", "snap", "--to", "{fix}/adir.safetensors"], {}, "adir.safetensors"),
    (["train", "--dry-run", "--config", "{fix}/inf.yaml"], {}, "inf"),
    (["render", "slurm", "--nodes", "1", "-o", "{fix}/adir.safetensors", "--", "echo"], {}, "adir.safetensors"),
]

FIXTURES = {
    "dup.yaml": "steps: 5\nlr: 0.1\nsteps: 6\n",
    "dup_spelling.yaml": "micro-batch: 4\nmicro_batch: 8\n",
    "dup.toml": "steps = 5\nsteps = 6\n",
    "unknown.yaml": "stepz: 5\n",
    "inf.yaml": "steps: .inf\n",
    "nan.yaml": "lr: .nan\n",
    "list.yaml": "- steps\n- 5\n",
    "broken.yaml": "steps: [5\n",
    "afile": "not a directory\n",
    "doc.txt": "a document\n",
    "code/a.py": "x = 1\n",
    "code/b.py": "y = 2\n",
    "code/Makefile": "all:\n",
}


@pytest.fixture
def dirs(tmp_path, monkeypatch):
    return make_dirs(tmp_path, monkeypatch)


def make_dirs(tmp_path, monkeypatch):
    """The fixtures' directory (its path for ``{fix}``) and an empty working directory, entered."""
    fix, cwd = tmp_path / "fix", tmp_path / "cwd"
    fix.mkdir()
    cwd.mkdir()
    (fix / "adir.safetensors").mkdir()
    for name, text in FIXTURES.items():
        (fix / name).parent.mkdir(exist_ok=True)
        (fix / name).write_text(text)
    monkeypatch.chdir(cwd)
    return str(fix), cwd


def _fill(items, fix: str):
    return [a.replace("{fix}", fix) for a in items]


def _check(code: int, out: str, err: str, expected: str, cwd) -> None:
    assert "Traceback" not in out + err, err
    assert code == 2, (code, err)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("meshrun: error: "), lines[0]
    assert expected in lines[0], lines[0]
    assert os.listdir(cwd) == [], os.listdir(cwd)


@pytest.mark.parametrize("argv,env,expected", _topology_cases() + [
    pytest.param(argv, env, expected, id=" ".join(argv) + (str(env) if env else "")) for argv, env, expected in CASES])
def test_bad_input_in_process(argv, env, expected, dirs, capsys):
    fix, cwd = dirs
    environ = clean_env(**{k: v.replace("{fix}", fix) for k, v in env.items()})
    code = main(_fill(argv, fix), environ)
    captured = capsys.readouterr()
    _check(code, captured.out, captured.err, expected.replace("{fix}", fix), cwd)


@pytest.mark.parametrize("argv,env,expected", SUBPROCESS_CASES,
                         ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_bad_input_real_cli(argv, env, expected, dirs):
    fix, cwd = dirs
    out = meshrun(*_fill(argv, fix), env=clean_env(**env), cwd=str(cwd), timeout=120)
    _check(out.returncode, out.stdout, out.stderr, expected, cwd)


def test_closed_stdout_is_quiet(dirs):
    """A reader that goes away (`meshrun env --json | head -2`): no traceback, exit code 1."""
    _, cwd = dirs
    proc = subprocess.Popen([sys.executable, "-m", "meshrun", "env", "--json"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, env=clean_env(), cwd=str(cwd))
    proc.stdout.close()  # before the command writes anything
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) == 1, err
    assert err == ""


def test_unknown_meshrun_variable_warns_once(dirs, capsys):
    fix, cwd = dirs
    code = main(["env", "--json"], clean_env(MESHRUN_NPROC="3", MESHRUN_TEST_STRICT="1", MESHRUN_CACHE=fix))
    captured = capsys.readouterr()
    assert code == 0
    lines = [line for line in captured.err.splitlines() if line.strip()]
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("meshrun: warning: MESHRUN_NPROC ") and "MESHRUN_NPROC_PER_NODE" in lines[0]


def test_unknown_meshrun_variable_keeps_the_exit_status(dirs, capsys):
    code = main(["train", "--dry-run", "--steps", "0"], clean_env(MESHRUN_STEP="5"))
    err = capsys.readouterr().err
    assert code == 2
    assert "meshrun: warning: MESHRUN_STEP " in err and "MESHRUN_STEPS?" in err
    assert sum(line.startswith("meshrun: error: ") for line in err.splitlines()) == 1


def test_doctor_names_a_missing_out_directory(dirs):
    _, cwd = dirs
    out = meshrun("doctor", "--json", "--out", "/nonexistent/runs", env=clean_env(), cwd=str(cwd), timeout=120)
    assert "Traceback" not in out.stderr
    assert "/nonexistent/runs does not exist" in out.stdout


UNWRITABLE = [
    (["train", "--dry-run", "--out", "{ro}/run"], "--out="),
    (["render", "slurm", "--nodes", "1", "-o", "{ro}/job.sbatch", "--", "echo"], "-o="),
    (["plan", *GPU80, "--write", "{ro}/configs"], "--write="),
    (["export", "snap", "--to", "{ro}/model.safetensors"], "--to="),
]


@pytest.mark.parametrize("argv,expected", UNWRITABLE, ids=lambda x: " ".join(x) if isinstance(x, list) else None)
def test_a_directory_nobody_may_write(argv, expected, request):
    """The real CLI as an unprivileged user (root may write anywhere) into a read-only
    directory: one line naming the path, exit 2, nothing created."""
    import shutil

    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("needs root and setpriv to run the CLI as another user")
    import tempfile
    from pathlib import Path

    top = Path(tempfile.mkdtemp(prefix="meshrun-ro-"))  # pytest's own tmp_path is root's alone
    request.addfinalizer(lambda: shutil.rmtree(top, ignore_errors=True))
    top.chmod(0o755)
    ro = top / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    as_nobody = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
    probe = subprocess.run([*as_nobody, sys.executable, "-c", "import meshrun"], capture_output=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip("this venv is not readable by an unprivileged user")
    args = [a.replace("{ro}", str(ro)) for a in argv]
    res = subprocess.run([*as_nobody, sys.executable, "-m", "meshrun", *args], capture_output=True, text=True,
                         env=clean_env(), cwd=str(ro), timeout=120)
    _check(res.returncode, res.stdout, res.stderr, expected, ro)
    assert "not writable" in res.stderr, res.stderr


@pytest.mark.parametrize("redirect,code,stream,line", [
    (">&-", 2, "stderr", "meshrun: error: its standard output stream is closed"),
    ("2>&-", 2, "stdout", "meshrun: error: its standard error stream is closed"),
    (">/dev/full", 1, "stderr", "meshrun: error: a write failed: No space left on device"),
    ("2>/dev/full", 1, "stdout", "meshrun: error: a write failed: No space left on device"),
])
def test_a_closed_or_full_output_stream_is_one_line_on_the_other(redirect, code, stream, line):
    """`meshrun ... >&-` or onto a full disk: one line on whichever stream works, no traceback;
    exit 2 for a closed stream (nothing ran), 1 for a write that failed (what ran is not known)."""
    args = "env --json" if "2>" not in redirect else "env --bogus"  # (the second writes its error to stderr)
    res = subprocess.run(["sh", "-c", f'exec "$0" -m meshrun {args} {redirect}', sys.executable], env=clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == code, (res.stdout, res.stderr)
    shown = (res.stdout if stream == "stdout" else res.stderr).strip().splitlines()
    assert shown and shown[-1].startswith(line), (res.stdout, res.stderr)
    assert "Traceback" not in res.stdout + res.stderr


@pytest.mark.parametrize("command", ["prepare", "train", "train-file"])
def test_a_fifo_in_a_corpus_is_refused_before_anything_reads_it(command, tmp_path, capsys):
    """A FIFO among a corpus' files (or given as the corpus) would block the first read forever:
    refused in one line naming it, before anything is read or written."""
    from meshrun.cli import main

    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("some text\n")
    os.mkfifo(corpus / "b.txt")
    argv = {"prepare": ["data", "prepare", str(corpus), "--tokenizer", "gpt2", "--out", str(tmp_path / "prep")],
            "train": ["train", "--data", str(corpus), "--tokenizer", "gpt2", "--nproc", "1"],
            "train-file": ["train", "--data", str(corpus / "b.txt"), "--tokenizer", "gpt2", "--nproc", "1"]}[command]
    code = main(argv, clean_env())
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert f"{corpus / 'b.txt'}': is a FIFO, not a regular file" in err[0]
    assert sorted(os.listdir(tmp_path)) == ["corpus"]


@pytest.mark.parametrize("size,value", [("num_hidden_layers", 10**6), ("hidden_size", 2**20), ("vocab_size", 2**30)])
def test_a_model_config_past_any_real_size_is_refused_before_it_is_built(size, value, tmp_path, capsys):
    """A config.json with a million layers kept transformers building for minutes: a size past
    its bound is one line naming the bound, from `plan` and `train` alike."""
    require("transformers")
    from meshrun.cli import main

    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 2,
              "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 4,
              "vocab_size": 256, "max_position_embeddings": 128, size: value}
    (tmp_path / "config.json").write_text(json.dumps(config))
    for argv in (["plan", "--model", str(tmp_path)], ["train", "--dry-run", "--model", str(tmp_path), "--data",
                                                       "random", "--nproc", "1"]):
        assert main(argv, clean_env()) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"{size} is {value}, past meshrun's bound of" in err[0], err
