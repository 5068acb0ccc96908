"""Hugging Face causal LMs in meshrun's trainer, on the CPU, with tiny configs built here
(nothing is downloaded): built on the meta device and filled after sharding, trained by every
layout that applies to the same losses as one process, read from `save_pretrained`'s sharded
files slice by slice, exported back to a directory transformers loads, and bad input refused
in one line."""

from __future__ import annotations

import json
import os

import pytest
from helpers import clean_env, meshrun_here, require
from helpers import meshrun as run_cli

import meshrun

pytestmark = pytest.mark.framework
STEPS = 4
VOCAB = 128


def tiny_config(family: str):
    """A two-layer model of each family the trainer is held to: Llama (grouped-query attention,
    untied), Qwen2 (biases on q/k/v, tied embeddings), Mistral (a sliding window), GPT-2 (Conv1D,
    learned positions; dropout off, as random masks differ between layouts) and Mixtral (experts)."""
    import transformers as T

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4)
    if family == "llama":
        return T.LlamaConfig(intermediate_size=176, num_key_value_heads=2, **common)
    if family == "qwen2":
        return T.Qwen2Config(intermediate_size=176, num_key_value_heads=2, tie_word_embeddings=True, **common)
    if family == "mistral":
        return T.MistralConfig(intermediate_size=176, num_key_value_heads=2, sliding_window=8, **common)
    if family == "gpt2":
        return T.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64, resid_pdrop=0.0,
                            embd_pdrop=0.0, attn_pdrop=0.0)
    if family == "mixtral":
        return T.MixtralConfig(intermediate_size=96, num_key_value_heads=2, num_local_experts=4,
                               num_experts_per_tok=2, **common)
    raise AssertionError(family)


def _train(family: str, overrides: dict) -> list[tuple[float, float]]:
    from meshrun.config import TrainConfig
    from meshrun.modelinfo.hf import build_on_meta
    from meshrun.training.loader import RandomTokens
    from meshrun.training.trainer import Trainer

    model = build_on_meta(tiny_config(family))
    cfg = TrainConfig(steps=STEPS, seq_len=16, lr=3e-3, warmup=1, log_every=1, precision="fp32", **overrides)
    records = Trainer(model, RandomTokens(256, 16, VOCAB), None, cfg).fit()
    return [(r["loss"], r["grad_norm"]) for r in records]


def run(family: str, nproc: int, **overrides) -> list[tuple[float, float]]:
    return meshrun.run(_train, family, overrides, nproc=nproc, timeout_s=300)


def close(a, b, rtol=2e-4):
    assert len(a) == len(b) == STEPS
    for (la, na), (lb, nb) in zip(a, b):
        assert la == pytest.approx(lb, rel=rtol) and na == pytest.approx(nb, rel=rtol)


FAMILIES = ["llama", "qwen2", "mistral", "gpt2", "mixtral"]
TP_FAMILIES = {"llama", "qwen2", "mistral"}  # the q/k/v/o_proj, gate/up/down_proj projection names


@pytest.fixture(scope="module")
def references():
    require("transformers")
    return {}


@pytest.mark.parametrize("family", FAMILIES)
def test_every_layout_trains_a_family_as_one_process(references, family):
    """2-process DDP, FSDP2 full shard and grad_op, and TP2 where the family has a plan: the
    losses and gradient norms of one process over the same global batch of 8 (fp32; the sums
    run in another order: 2e-4, as for meshrun's GPT). The initial weights come out the same in
    every layout: each module is drawn whole from a seed of its name and sliced."""
    one = run(family, 1, strategy="single", micro_batch=8)
    assert 4.0 < one[0][0] < 6.0  # about ln(128): a fresh model's loss
    for strategy in ("ddp", "fsdp-full", "fsdp-grad-op"):
        close(run(family, 2, strategy=strategy, micro_batch=4), one)
    if family in TP_FAMILIES:
        close(run(family, 2, strategy="fsdp-full", tp=2, micro_batch=8), one)


@pytest.mark.parametrize("family,layouts", [
    ("llama", [(2, {"cp": 2}), (4, {"pp": 2, "micro_batch": 4})]),  # dp2 x pp2: FSDP2 per stage
    ("qwen2", [(2, {"cp": 2}), (2, {"pp": 2})]),  # tied: the head's copy from the first stage
    ("gpt2", [(2, {"cp": 2})]),  # learned positions read from position_ids
    ("mixtral", [(2, {"pp": 2})]),
])
def test_context_and_pipeline_parallel_train_a_family_as_one_process(references, family, layouts):
    """Context parallel 2 (zig-zag shards through transformers' attention interface, the
    true positions as position_ids) and pipeline parallel 2 (stages built on the meta device,
    each filled on its own rank): the losses and norms of one process."""
    one = run(family, 1, strategy="single", micro_batch=8)
    for nproc, overrides in layouts:
        close(run(family, nproc, **{"strategy": "fsdp-full", "micro_batch": 8, **overrides}), one)


def test_checkpointing_and_deepspeed_train_a_llama_as_one_process():
    require("deepspeed")
    one = run("llama", 1, strategy="single", micro_batch=8)
    close(run("llama", 2, strategy="fsdp-full", activation_checkpointing="full", micro_batch=4), one)
    close(run("llama", 2, strategy="ddp", activation_checkpointing="selective", micro_batch=4), one)
    close(run("llama", 2, strategy="zero2", micro_batch=4), one)


def test_a_layout_that_does_not_apply_says_so_in_one_line():
    with pytest.raises(meshrun.api.RankError, match="--tp=2: no tensor-parallel plan for block MixtralDecoderLayer"):
        run("mixtral", 2, strategy="fsdp-full", tp=2, micro_batch=8)
    with pytest.raises(meshrun.api.RankError, match="--pp=2: pipeline stages are built for meshrun's GPT and the "
                       "llama/mistral/mixtral/qwen2/qwen3 families, not gpt2"):
        run("gpt2", 2, strategy="fsdp-full", pp=2, micro_batch=8)
    with pytest.raises(meshrun.api.RankError, match="--cp: this mistral model attends within a sliding window of 8 "
                       "tokens, shorter than --seq-len 16"):
        run("mistral", 2, strategy="fsdp-full", cp=2, micro_batch=8)


# ---- pretrained weights in -------------------------------------------------------------------

def _saved(tmp_path, family="llama", **sizes) -> str:
    """A model of the family saved by transformers itself, sharded into several files."""
    import torch
    import transformers

    config = tiny_config(family)
    for k, v in sizes.items():
        setattr(config, k, v)
    torch.manual_seed(1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    path = str(tmp_path / f"{family}-saved")
    model.save_pretrained(path, max_shard_size="40KB" if not sizes else "64MB")
    return path


def _logits_after_loading(path: str, overrides: dict, tokens: list[list[int]]) -> list:
    """The trained-0-steps model's logits (loaded under the layout) and the peak RSS growth
    while its weights were read."""
    import torch

    from meshrun.config import TrainConfig
    from meshrun.modelinfo import hf
    from meshrun.training.loader import RandomTokens
    from meshrun.training.trainer import Trainer
    from meshrun.training.weights import Pretrained

    source = hf.locate(path)
    model = hf.build_on_meta(hf.load_config(source))
    cfg = TrainConfig(steps=1, seq_len=16, precision="fp32", model=path, **overrides)
    t = Trainer(model, RandomTokens(64, 16, VOCAB), None, cfg,
                weights=Pretrained(source.directory, source.weight_files))
    with torch.no_grad():
        out = t.model(input_ids=torch.tensor(tokens))
    return out.logits.tolist()


@pytest.mark.parametrize("nproc,overrides", [(2, {"strategy": "fsdp-full"}), (2, {"strategy": "fsdp-full", "tp": 2}),
                                             (1, {"strategy": "single"})], ids=["fsdp2", "tp2", "single"])
def test_pretrained_weights_give_transformers_own_logits(tmp_path, nproc, overrides):
    require("transformers")
    import torch
    import transformers

    path = _saved(tmp_path)
    assert len([f for f in os.listdir(path) if f.endswith(".safetensors")]) > 2
    tokens = [[3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3]]
    got = meshrun.run(_logits_after_loading, path, overrides, tokens, nproc=nproc, timeout_s=300)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        want = ref(input_ids=torch.tensor(tokens)).logits
    torch.testing.assert_close(torch.tensor(got), want, rtol=1e-5, atol=1e-5)


def _peak_rss_growth_while_loading(path: str) -> tuple[int, int]:
    """(peak resident bytes added while this rank filled its FSDP2 shards from the files, the
    model's bytes): the peak counter is reset just before (Linux's clear_refs)."""
    import torch

    from meshrun.modelinfo import hf
    from meshrun.training.parallel.dims import make_dims
    from meshrun.training.parallel.fsdp import apply_fsdp
    from meshrun.training.weights import Pretrained, materialize

    source = hf.locate(path)
    model = hf.build_on_meta(hf.load_config(source))
    total = sum(p.numel() * 4 for p in model.parameters())
    meshes = make_dims(2).build("cpu")
    apply_fsdp(model, model.model.layers, meshes.fsdp(), "full", bf16=False)

    def rss(field: str) -> int:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))

    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    before = rss("VmRSS:")
    materialize(model, torch.device("cpu"), 0, Pretrained(source.directory, source.weight_files))
    return rss("VmHWM:") - before, total


def test_each_rank_reads_only_its_half_of_the_weights(tmp_path):
    """A 207-MB model in four files, FSDP2 full shard on 2 ranks: a rank's resident memory
    grows by its half of the model and half of the largest tensor (the slice in flight) at
    most, plus 40 MB: well under the whole model a rank that read everything would hold."""
    require("transformers")
    path = _saved(tmp_path, vocab_size=32000, hidden_size=512, intermediate_size=1376, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=8)
    growth, total = meshrun.run(_peak_rss_growth_while_loading, path, nproc=2, timeout_s=300)
    largest = 32000 * 512 * 4
    assert total > 190 * 2**20
    print(f"peak resident growth {growth / 2**20:.1f} MiB of a {total / 2**20:.1f}-MiB model")
    assert growth < total / 2 + largest / 2 + 40 * 2**20 < total, (growth, total)


# ---- round trip through the CLI ------------------------------------------------------------------

def test_save_pretrained_train_export_from_pretrained_round_trip(tmp_path):
    """save_pretrained -> `meshrun train --model DIR` (FSDP2, 2 processes, 5 steps) ->
    `meshrun export` -> from_pretrained: exactly the snapshot's weights (bit for bit), the
    tokenizer's files copied, and the step-1 loss equal to transformers' own on that batch."""
    require("transformers")
    import torch
    import transformers
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    path = _saved(tmp_path)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"model_max_length": 64}, f)
    out, target = tmp_path / "run", tmp_path / "exported"
    res = run_cli("train", "--model", path, "--data", "random", "--strategy", "fsdp-full", "--steps", "5",
                  "--seq-len", "16", "--micro-batch", "2", "--log-every", "1", "--precision", "fp32",
                  "--out", str(out), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "pretrained weights read" in res.stdout
    # the first lines name the model: its directory, family, and where its weights come from
    assert (f"meshrun train: model llama-saved (a Hugging Face llama model in {path}, its pretrained weights), "
            in res.stdout), res.stdout[:2000]
    res = run_cli("export", str(out / "checkpoints"), "--to", str(target))
    assert res.returncode == 0, res.stderr[-2000:]
    assert {"config.json", "generation_config.json", "tokenizer_config.json"} <= set(os.listdir(target))
    exported = transformers.AutoModelForCausalLM.from_pretrained(str(target))
    snapshot = str(out / "checkpoints" / "step-00000005")
    saved = _load_state_dict_from_keys(storage_reader=FileSystemReader(snapshot))
    weights = {k[len("model."):]: v for k, v in saved.items() if k.startswith("model.")}
    mine = exported.state_dict()
    assert set(weights) <= set(mine)
    for name, tensor in weights.items():
        assert torch.equal(mine[name], tensor), name
    original = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert not torch.equal(original.model.layers[0].mlp.up_proj.weight, exported.model.layers[0].mlp.up_proj.weight)


def _losses(out) -> dict[int, float]:
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_a_run_resumes_from_its_snapshot_on_another_layout(tmp_path):
    """`meshrun train --model DIR --out X` snapshots at step 3 of 6; a run resumed from that
    snapshot as a 2-stage pipeline (the stages keep the model's own names; the last stage's
    tied head takes the embedding's optimizer state) continues with the losses of the run
    that never stopped."""
    require("transformers")
    path = _saved(tmp_path, "qwen2")
    common = ["train", "--model", path, "--data", "random", "--seq-len", "16", "--micro-batch", "4",
              "--global-batch", "8", "--log-every", "1", "--precision", "fp32", "--nproc", "2", "--steps", "6"]
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    res = run_cli(*common, "--strategy", "fsdp-full", "--save-every", "3", "--out", str(whole), timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    snapshot = whole / "checkpoints" / "step-00000003"
    res = run_cli(*common, "--strategy", "fsdp-full", "--pp", "2", "--resume", str(snapshot), "--out", str(resumed),
                  timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    want, got = _losses(whole), _losses(resumed)
    assert sorted(got) == [4, 5, 6]
    for step in (4, 5, 6):
        assert got[step] == pytest.approx(want[step], rel=2e-4), step


@pytest.mark.parametrize("family,overrides", [("llama", {}), ("qwen2", {"cp": 2}), ("qwen2", {"pp": 2})],
                         ids=["fsdp2", "cp2-tied", "pp2-tied"])
def test_the_first_step_loss_is_transformers_own(tmp_path, family, overrides):
    """Every sample the same sequence: the first logged loss (before any update) is
    `model(input_ids, labels=input_ids).loss` of the saved model, computed by transformers,
    also where the sequence or the layers are split over ranks (the tied head's weights are
    not in the files: the last pipeline stage takes the first's)."""
    require("transformers")
    import torch
    import transformers

    path = _saved(tmp_path, family)
    seq = [7, 3, 9, 1, 4, 4, 2, 8, 6, 5, 3, 1, 0, 2, 9, 7, 5]
    got = meshrun.run(_first_loss, path, seq, overrides, nproc=2, timeout_s=300)
    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    with torch.no_grad():
        want = model(input_ids=torch.tensor([seq[:-1]]), labels=torch.tensor([seq[:-1]])).loss.item()
    assert got == pytest.approx(want, rel=1e-5)


def _first_loss(path: str, seq: list[int], overrides: dict) -> float:
    import torch
    from torch.utils.data import Dataset

    from meshrun.config import TrainConfig
    from meshrun.modelinfo import hf
    from meshrun.training.trainer import Trainer
    from meshrun.training.weights import Pretrained

    class Same(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int):
            t = torch.tensor(seq)
            return t[:-1], t[1:]

    source = hf.locate(path)
    model = hf.build_on_meta(hf.load_config(source))
    cfg = TrainConfig(steps=1, seq_len=16, micro_batch=2, precision="fp32", strategy="fsdp-full", log_every=1,
                      model=path, **overrides)
    records = Trainer(model, Same(), None, cfg, weights=Pretrained(source.directory, source.weight_files)).fit()
    return records[0]["loss"] if records else None  # (rank 0 keeps the records)


# ---- your own module -------------------------------------------------------------------------------

FACTORIES = """
import torch
import torch.nn as nn
from transformers import LlamaConfig, LlamaForCausalLM


def tiny_llama():
    return LlamaForCausalLM(LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=344,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2))


class Plain(nn.Module):  # a vocabulary of 1000, logits out
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(1000, 32)
        self.out = nn.Linear(32, 1000)

    def forward(self, x):
        return self.out(self.emb(x))


def plain():
    return Plain()
"""


def test_your_own_module_trains_whatever_it_returns(tmp_path):
    """A factory that returns transformers' LlamaForCausalLM (its output a ModelOutput) trains on
    the default data; a plain module with a vocabulary of 1000 trains on `--data random`, whose
    tokens come from its input embeddings' size."""
    require("transformers")
    (tmp_path / "mymodels.py").write_text(FACTORIES)
    env = {**clean_env(), "PYTHONPATH": f"{tmp_path}{os.pathsep}{clean_env().get('PYTHONPATH', '')}"}
    for args in (["--model", "mymodels:tiny_llama"], ["--model", "mymodels:plain", "--data", "random"]):
        out = tmp_path / args[1].split(":")[1]
        res = run_cli("train", *args, "--nproc", "1", "--steps", "4", "--log-every", "2", "--seq-len", "32",
                      "--out", str(out), env=env, timeout=300)
        assert res.returncode == 0, (args, res.stderr[-2000:])
        losses = _losses(out)
        assert sorted(losses) == [2, 4] and all(0 < v < 8 for v in losses.values()), losses


# ---- bad input, one line each ----------------------------------------------------------------------

def _bad_inputs(tmp_path):
    import transformers

    empty = tmp_path / "empty"
    empty.mkdir()
    bert = tmp_path / "bert"
    transformers.BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=64).save_pretrained(str(bert))
    t5 = tmp_path / "t5"
    transformers.T5Config(vocab_size=64, d_model=32, num_layers=1, num_heads=2, d_ff=64).save_pretrained(str(t5))
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(json.dumps({"model_type": "no-such-architecture", "hidden_size": 8}))
    broken = tmp_path / "broken"  # 32 wide, 3 heads: GPT-2's attention refuses to be built
    (broken).mkdir()
    (broken / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 32, "n_head": 3, "n_layer": 1,
                                                    "vocab_size": 64}))
    truncated = _saved(tmp_path)
    shard = sorted(f for f in os.listdir(truncated) if f.endswith(".safetensors"))[1]
    with open(os.path.join(truncated, shard), "r+b") as f:
        f.truncate(os.path.getsize(os.path.join(truncated, shard)) // 2)
    foreign = tmp_path / "foreign"  # a pickle (or anything else) saved under the safetensors name
    transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2).save_pretrained(str(foreign))
    (foreign / "model.safetensors").write_bytes(b"\x80\x04\x95" + bytes(range(256)) * 4)
    return [
        (["--model", "meta-llama/Llama-3.2-1B"], "looks like a Hugging Face Hub id; meshrun never downloads"),
        (["--model", str(foreign)], "model.safetensors: cannot read it as safetensors (no header"),
        (["--model", str(empty)], "a directory without config.json"),
        (["--model", str(bert)], "an encoder (bert)"),
        (["--model", str(t5)], "an encoder-decoder model (t5)"),
        (["--model", str(unknown)], "transformers cannot read it"),
        (["--model", str(broken)], "transformers cannot build it"),
        (["--model", str(truncated)], f"{shard}: cannot read it as safetensors"),
        (["--model", str(empty), "--init", "random"], "a directory without config.json"),
        (["--init", "pretrained"], "--init='pretrained': chooses the weights of a Hugging Face model directory"),
        (["--model", truncated, "--data", None], "--data='stdlib': the default data is the standard library's source "
                                                  "as bytes"),
    ]


def test_bad_models_are_one_line_each(tmp_path):
    require("transformers")
    for args, said in _bad_inputs(tmp_path):
        if "--data" in args:  # left out: the default
            args = args[:args.index("--data")]
        else:
            args = [*args, "--data", "random"]
        # refused in meshrun train's own process, before it starts a rank: run here, where
        # transformers is imported once for the ten
        res = meshrun_here("train", *args, "--steps", "1", "--seq-len", "16")
        last = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ""
        assert res.returncode == 2 and last.startswith("meshrun: error: ") and said in last, (args, res.stderr[-1500:])
        assert "Traceback" not in res.stderr, res.stderr[-1500:]


def test_plan_reads_the_model_train_reads(tmp_path):
    """`meshrun plan --model DIR` builds the model as `meshrun train` does (the same counts,
    the same refusals)."""
    require("transformers")
    path = _saved(tmp_path)
    res = run_cli("plan", "--model", path, "--gpu-mem", "80GiB", "--json")
    assert res.returncode == 0, res.stderr
    d = json.loads(res.stdout)
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path)
    assert d["model"]["params"] == sum(p.numel() for p in model.parameters())
    bad = run_cli("plan", "--model", "org/model", "--gpu-mem", "80GiB")
    assert bad.returncode == 2 and "Hugging Face Hub id" in bad.stderr


def test_an_architecture_without_sdpa_is_built_with_its_own_attention():
    """Gemma-2 refuses SDPA (its logit soft-capping): the refused attempt must not stay in the
    config, or the fallback asks for SDPA again."""
    import transformers

    from meshrun.modelinfo.hf import build_on_meta

    config = transformers.Gemma2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256,
                                       attn_logit_softcapping=50.0, final_logit_softcapping=30.0)
    model = build_on_meta(config)
    assert type(model).__name__ == "Gemma2ForCausalLM"
    assert model.config._attn_implementation in ("eager", "sdpa")  # (newer transformers refuse SDPA for it)
    assert all(p.is_meta for p in model.parameters())


def test_weight_files_are_checked_from_their_headers_alone(tmp_path):
    """A whole safetensors file passes; a cut one, a header that is not an object of tensors
    with offsets, and a file too short for a header are each named, before any rank reads them."""
    import struct

    import torch
    from safetensors.torch import save_file

    from meshrun.errors import MeshrunError
    from meshrun.modelinfo.hf import check_weight_files

    whole = tmp_path / "whole.safetensors"
    save_file({"w": torch.zeros(4, 4), "b": torch.ones(3)}, str(whole), metadata={"format": "pt"})
    check_weight_files((str(whole),))
    data = whole.read_bytes()
    header = json.dumps({"w": {"dtype": "F32", "shape": [1], "data_offsets": []}}).encode()
    cases = {"cut": (data[:-5], f"truncated: {len(data) - 5} bytes, its header places tensors up to byte {len(data)}"),
             "offsets": (struct.pack("<Q", len(header)) + header, "its header's entry 'w' has no data offsets"),
             "list": (struct.pack("<Q", 5) + b"[1,2]", "its header is not a JSON object"),
             "short": (b"\x01\x02", "no header: 2 bytes")}
    for name, (content, said) in cases.items():
        path = tmp_path / f"{name}.safetensors"
        path.write_bytes(content)
        with pytest.raises(MeshrunError, match="cannot read it as safetensors") as err:
            check_weight_files((str(whole), str(path)))
        assert str(err.value).startswith(f"{path}: ") and said in str(err.value), str(err.value)
