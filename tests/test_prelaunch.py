"""What the configuration alone decides is refused by `meshrun train` itself, before any rank
starts and before anything is written to --out: one line, exit code 2, within 2 s, in the words
the ranks use for it (job/prelaunch.py). Each case runs the real CLI in-process; some also as a
real process. The ranks are on the CPU here (no GPU visible), as in CI."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest
from helpers import clean_env, meshrun

from meshrun.cli import main

BOUND_S = 2.0  # the refusal comes before any process starts: no rank, no torch import
CPU = {"CUDA_VISIBLE_DEVICES": ""}  # the ranks would run on the CPU
TINY = ("--model-size", "gpt-tiny")  # 4 heads, 2 blocks, context 256

# (id, arguments, a substring of the error); {corpus} and {prepared}: token corpora of 1000 tokens
CASES = [
    ("single", ["--strategy", "single"], "--strategy='single': runs one process, but the world has 2"),
    ("ep-no-experts", ["--ep", "2"], "--ep=2: the model has no experts (hint: --experts E with meshrun's GPT)"),
    ("ep-toy", ["--example", "toy", "--ep", "2"], "--ep=2: the model has no experts"),
    ("ep-experts-split", ["--experts", "3", "--ep", "2", *TINY],
     "--ep=2: 3 experts do not split over 2 ranks (hint: an --ep that divides 3)"),
    ("ep-world", ["--experts", "4", "--ep", "4", *TINY], "--ep=4: does not divide the 2 data-parallel ranks"),
    ("tp-seq", ["--tp", "2", "--seq-len", "15", *TINY],
     "--seq-len=15: does not split over --tp 2 for sequence parallelism (hint: a multiple of 2, or "
     "--sequence-parallel off)"),
    ("tp-heads", ["--tp", "3", "--nproc", "3", *TINY],
     "--tp=3: the model's 4 attention heads do not split over 3 ranks (hint: a --tp that divides 4)"),
    ("tp-heads-pp", ["--tp", "3", "--pp", "2", "--nproc", "6", "--micro-batch", "2", *TINY],
     "--tp=3: the model's 4 attention heads do not split over 3 ranks"),
    ("pp-interleaved", ["--pp", "2", "--pp-schedule", "interleaved", *TINY],
     "--pp: the model has 2 blocks, fewer than the 4 pipeline stages"),
    ("pp-1f1b", ["--pp", "4", "--nproc", "4", "--micro-batch", "4", *TINY],
     "--pp: the model has 2 blocks, fewer than the 4 pipeline stages"),
    ("cp-seq", ["--cp", "2", "--seq-len", "30"],
     "--seq-len=30: context parallelism over 2 ranks cuts sequences into 4 equal chunks"),
    ("cp-toy-context", ["--example", "toy", "--cp", "3", "--nproc", "3"],
     "--seq-len (from the default for a model that states no context)=1024: context parallelism over 3 ranks "
     "cuts sequences into 6 equal chunks"),
    ("fp8-cpu", ["--precision", "fp8", "--nproc", "1", *TINY],
     "--precision='fp8': float8 matmuls need a GPU of compute capability 8.9 or newer (Ada, Hopper, Blackwell); "
     "this run is on the CPU (hint: --precision auto or fp32)"),
    ("fp8-rowwise-cpu", ["--precision", "fp8-rowwise"],
     "--precision='fp8-rowwise': float8 matmuls need a GPU of compute capability 8.9 or newer"),
    ("bf16-cpu", ["--precision", "bf16"],
     "--precision='bf16': this run is on CPU, where meshrun trains in fp32 (hint: use --precision auto or fp32)"),
    ("data-random", ["--data", "random", "--global-batch", "2097152", "--micro-batch", "8"],
     "the training data has 1048576 samples of 256 tokens: fewer than one global batch of 2097152 (micro-batch 8 "
     "x 131072 x 2 data-parallel ranks) (hint: a smaller --global-batch or --seq-len, or more data)"),
    ("data-toy", ["--example", "toy", "--global-batch", "4096"],
     "the training data has 2048 samples: fewer than one global batch of 4096 (micro-batch 32 x 64 x 2 "
     "data-parallel ranks)"),
    ("data-stdlib", ["--global-batch", "1000000", "--micro-batch", "10"],
     "samples of 256 tokens: fewer than one global batch of 1000000 (micro-batch 10 x 50000 x 2 data-parallel "
     "ranks)"),
    ("data-flat-corpus", ["--data", "{corpus}", "--seq-len", "16", "--micro-batch", "8", "--global-batch", "128"],
     "the training data has 62 samples of 16 tokens: fewer than one global batch of 128 (micro-batch 8 x 8 x 2 "
     "data-parallel ranks)"),
    ("data-prepared-corpus", ["--data", "{prepared}", "--seq-len", "16", "--micro-batch", "4", "--pp", "2",
                              "--global-batch", "64"],
     "the training data has 62 samples of 16 tokens: fewer than one global batch of 64 (micro-batch 4 x 16 x 1 "
     "data-parallel ranks)"),
]
SUBPROCESS = ("single", "ep-no-experts", "tp-heads", "pp-interleaved", "fp8-cpu", "data-random")

# A Hugging Face model's numbers come from its config: a Llama of 2 layers and a 64-token context
HF_CASES = [
    ("hf-ep", ["--ep", "2"], "--ep=2: expert parallelism is built for meshrun's GPT with --experts "
                             "(hint: an FSDP2 strategy for this model)"),
    ("hf-pp", ["--pp", "2", "--pp-schedule", "interleaved"],
     "--pp: the model has 2 blocks, fewer than the 4 pipeline stages"),
    ("hf-cp-context", ["--cp", "3", "--nproc", "3"],
     "--seq-len (from the model's context)=64: context parallelism over 3 ranks cuts sequences into 6 equal chunks"),
    ("hf-data", ["--global-batch", "2097152", "--micro-batch", "8"],
     "the training data has 1048576 samples of 64 tokens: fewer than one global batch of 2097152"),
]
LLAMA = {"model_type": "llama", "vocab_size": 128, "hidden_size": 64, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "intermediate_size": 176, "max_position_embeddings": 64}


def _corpora(root) -> dict[str, str]:
    """{corpus}: a flat token file; {prepared}: a prepared corpus (its index written by hand);
    1000 tokens each, so 62 samples of 16 tokens."""
    import numpy as np

    from meshrun.data import FORMAT, INDEX

    tokens = (np.arange(1000) % 200).astype("<u2")
    flat = root / "train.bin"
    tokens.tofile(flat)
    prepared = root / "prepared"
    prepared.mkdir()
    tokens.tofile(prepared / "train-00000.tokens")
    np.zeros(1, dtype="<i8").tofile(prepared / "train-00000.docs")
    shard = {"file": "train-00000", "tokens": 1000, "documents": 1, "max_id": 199}
    (prepared / INDEX).write_text(json.dumps({
        "format": FORMAT, "dtype": "uint16", "tokenizer": {"name": "test", "vocab_size": 256},
        "splits": {"train": {"tokens": 1000, "documents": 1, "shards": [shard]}}}))
    return {"{corpus}": str(flat), "{prepared}": str(prepared)}


def _argv(args: list[str], tmp_path) -> tuple[list[str], str]:
    places = _corpora(tmp_path) if any("{" in a for a in args) else {}
    out = str(tmp_path / "out")
    return ["train", *(places.get(a, a) for a in args), "--out", out], out


def _refused(code: int, err: str, said: str, took: float, out: str, bound: float | None = BOUND_S) -> None:
    assert code == 2, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert last.startswith("meshrun: error: ") and said in last, last
    assert "Traceback" not in err, err[-2000:]
    if bound is not None:
        assert took < bound, f"{took:.2f} s"
    assert not os.path.exists(out), os.listdir(out)


@pytest.mark.parametrize("args,said", [pytest.param(a, s, id=i) for i, a, s in CASES])
def test_refused_before_launch(args, said, tmp_path, capsys):
    argv, out = _argv(args, tmp_path)
    start = time.monotonic()
    code = main(argv, clean_env(**CPU))
    took = time.monotonic() - start
    captured = capsys.readouterr()
    assert "--collective-timeout" not in captured.out  # no launch line: nothing started
    _refused(code, captured.err, said, took, out)


@pytest.mark.parametrize("args,said", [pytest.param(a, s, id=i) for i, a, s in CASES if i in SUBPROCESS])
def test_refused_before_launch_real_cli(args, said, tmp_path):
    argv, out = _argv(args, tmp_path)
    start = time.monotonic()
    res = meshrun(*argv, env=clean_env(**CPU), timeout=60)
    took = time.monotonic() - start
    assert res.stdout == "", res.stdout
    _refused(res.returncode, res.stderr, said, took, out)


@pytest.mark.parametrize("args,said", [pytest.param(a, s, id=i) for i, a, s in HF_CASES])
def test_hugging_face_model_refused_before_launch(args, said, tmp_path, capsys):
    """Refused before any rank starts, from the model's config. Not within the 2 s: job.check
    reads and builds the model on the meta device first (transformers imports torch)."""
    pytest.importorskip("transformers")
    model = tmp_path / "llama"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA))
    argv, out = _argv(["--model", str(model), "--data", "random", *args], tmp_path)
    code = main(argv, clean_env(**CPU))
    captured = capsys.readouterr()
    _refused(code, captured.err, said, 0.0, out, bound=None)


TORCH_FREE = """
import sys
from meshrun.cluster.topology import Topology
from meshrun.errors import MeshrunError
from meshrun.config import build_config
from meshrun.job.prelaunch import check_layout

topo = Topology("local", 1, 0, 2, "127.0.0.1", 29500)
said = []
for flags in ({"strategy": "single"}, {"ep": 2}, {"experts": 3, "ep": 2, "model_size": "gpt-tiny"},
              {"tp": 2, "seq_len": 15, "model_size": "gpt-tiny"}, {"pp": 2, "pp_schedule": "interleaved",
              "model_size": "gpt-tiny"}, {"precision": "fp8"}, {"precision": "bf16"},
              {"global_batch": 1000000, "micro_batch": 10}, {"data": sys.argv[1], "seq_len": 16, "global_batch": 128}):
    try:
        check_layout(build_config({}, flags), topo, 0)
    except MeshrunError as exc:
        said.append(str(exc))
# what the ranks take passes: the layouts test_train_cli trains end to end, the default job
for flags in ({"pp": 2}, {"tp": 2}, {"cp": 2}, {"experts": 4, "ep": 2}, {"strategy": "zero3"}, {}):
    check_layout(build_config({}, {"model_size": "gpt-tiny", "seq_len": 32, "micro_batch": 4, "data": "random",
                                   **flags}), topo, 0)
check_layout(build_config({}, {}), topo, 0)
check_layout(build_config({}, {"precision": "bf16"}), topo, 1)  # a GPU: bf16 is the ranks' to run
print(len(said))
assert "torch" not in sys.modules, "check_layout imported torch"
"""


def test_check_layout_imports_no_torch(tmp_path):
    corpus = _corpora(tmp_path)["{corpus}"]
    res = subprocess.run([sys.executable, "-c", TORCH_FREE, corpus], capture_output=True, text=True, timeout=60,
                         env=clean_env())
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["9"], res.stdout  # every bad one refused
