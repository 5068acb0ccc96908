"""`meshrun plan` and `meshrun train --dry-run` say the same of a run: its strategy, micro-batch,
compile, kernels and precision, over a grid of models and options.

Both commands ask the one run policy (meshrun.config.policy.resolve), each through its own
front-end: plan from its flags, a preset's or config's shape and the GPUs it is told of;
train's dry run from the train config, the model built on the meta device as the ranks build
it, and parallel/auto.decide, the ranks' own call. What is compared is what those front-ends
make of the same options on the same cluster. The cluster is explicit: plan's
``--gpus-per-node N --gpu-mem M`` against train's ``--nproc N --gpu-mem M`` (this machine has no
GPU; without ``--gpu-mem`` the dry run decides for CPU processes, checked at the end). Train runs
with ``--data random``, whose GPT vocabulary is the one plan assumes for a GPT preset (GPT-2's);
the default data, the standard library's bytes, trains a 256-token vocabulary plan does not
know of. Plan's JSON also carries its table's recommendation: where the run's strategy is left
to meshrun, it must be the run's strategy too.

Tracing a model for the planner costs 0.1-0.5 s eager and 1-2 s compiled, and both commands
trace: the traces are memoized here (``traces``) by everything a trace depends on (the model's
class, its config and parameter shapes, the sequence length, the precision modes, compile and
Liger), so the grid pays once for each distinct model, however many options it is run with.
Most cases run eager (``--compile off``).
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import clean_env

from meshrun.cli import main

pytest.importorskip("torch")
pytest.importorskip("transformers")

COMPARED = ("strategy", "micro_batch", "global_batch", "accumulation", "compile", "kernels", "precision",
            "activation_checkpointing", "strategy_from", "micro_batch_from")
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
         "max_position_embeddings": 256, "tie_word_embeddings": False}
MOE = {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
       "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
       "max_position_embeddings": 256, "num_local_experts": 4, "num_experts_per_tok": 2}
# GPT-2: a model Liger Kernel does not know, with gelu_new and a plain tied head
GPT2 = {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": 64, "n_layer": 2, "n_head": 4,
        "vocab_size": 256, "n_positions": 256, "bos_token_id": 0, "eos_token_id": 0}
EAGER = ("--compile", "off")

# (model, processes, GPU memory, options both commands take)
GRID = [
    ("gpt-tiny", 2, "80GiB", ()),  # compiled, meshrun's kernels, the planner's batch
    ("gpt-small", 2, "80GiB", EAGER),
    ("gpt-tiny", 2, "80GiB", EAGER),
    ("gpt-tiny", 1, "80GiB", EAGER),
    ("gpt-tiny", 8, "80GiB", EAGER),
    ("gpt-small", 4, "24GiB", (*EAGER, "--seq-len", "128")),
    ("gpt-tiny", 2, "80GiB", (*EAGER, "--precision", "fp32")),
    ("gpt-tiny", 2, "80GiB", ("--precision", "fp8")),  # float8 compiles
    ("gpt-tiny", 2, "80GiB", (*EAGER, "--precision", "fp8-rowwise")),
    ("gpt-tiny", 2, "80GiB", (*EAGER, "--kernels", "plain")),
    ("gpt-tiny", 2, "80GiB", (*EAGER, "--micro-batch", "4")),
    ("gpt-tiny", 2, "80GiB", (*EAGER, "--global-batch", "64")),
    ("gpt-tiny", 2, "80GiB", (*EAGER, "--micro-batch", "4", "--global-batch", "64")),
    ("gpt-tiny", 2, "80GiB", (*EAGER, "--strategy", "fsdp-full")),
    ("gpt-tiny", 4, "80GiB", (*EAGER, "--strategy", "fsdp-grad-op", "--micro-batch", "2")),
    ("gpt-tiny", 2, "80GiB", (*EAGER, "--strategy", "zero2")),
    ("gpt-tiny", 1, "80GiB", (*EAGER, "--strategy", "single")),
    ("gpt-tiny", 2, "80GiB", (*EAGER, "--activation-checkpointing", "full")),
    ("gpt-small", 2, "2GiB", EAGER),  # nothing fits: both refuse, in the same words
    ("gpt-1.3b", 1, "28GiB", EAGER),  # one GPU single does not fit: FSDP2 over its one rank
    ("llama", 2, "80GiB", ()),  # Liger's kernels, eager
    ("llama", 2, "80GiB", ("--compile", "on")),  # torch.compile's kernels instead, block by block
    ("llama", 2, "80GiB", (*EAGER, "--kernels", "plain", "--precision", "fp32")),
    ("llama", 2, "80GiB", ("--strategy", "zero3",)),  # ZeRO-3 takes the plain paths
    ("llama", 2, "80GiB", ("--precision", "fp8", "--micro-batch", "2")),
    ("moe", 2, "80GiB", ()),
    ("gpt2", 2, "80GiB", ()),  # meshrun's tanh GELU and head loss, compiled block by block
    ("gpt2", 2, "80GiB", ("--kernels", "plain")),
    ("moe", 4, "80GiB", (*EAGER, "--strategy", "fsdp-full", "--global-batch", "32")),
]


_TRACED: dict[tuple, tuple] = {}


def _fingerprint(model) -> tuple:
    config = getattr(model, "config", None)
    described = config.to_json_string() if hasattr(config, "to_json_string") else repr(getattr(model, "cfg", None))
    return (type(model).__qualname__, described, tuple((n, tuple(p.shape)) for n, p in model.named_parameters()))


@pytest.fixture(autouse=True)
def traces(monkeypatch):
    """meshrun's own with_trace, run once per distinct input."""
    import dataclasses

    from meshrun.plan import trace

    real = trace.with_trace

    def with_trace(spec, model, seq, modes, blocks_path=None, compiled=True, liger=False, liger_loss=False,
                   hf_kernels=False):
        key = (_fingerprint(model), seq, tuple(modes), blocks_path, compiled, liger, liger_loss, hf_kernels)
        if key not in _TRACED:
            _TRACED[key] = real(spec, model, seq, modes, blocks_path, compiled, liger, liger_loss, hf_kernels).traced
        return dataclasses.replace(spec, traced=_TRACED[key]) if _TRACED[key] else spec

    monkeypatch.setattr(trace, "with_trace", with_trace)


def _run(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = main(argv, env=clean_env())
    out, err = capsys.readouterr()
    return code, out, err


def _model_args(model: str, tmp_path) -> tuple[list[str], list[str]]:
    """(plan's model flags, train's) for a preset or a tiny Hugging Face config written here."""
    if model in ("llama", "moe", "gpt2"):
        path = tmp_path / model / "config.json"
        path.parent.mkdir()
        path.write_text(json.dumps({"llama": LLAMA, "moe": MOE, "gpt2": GPT2}[model]))
        return ["--model", str(path)], ["--model", str(path), "--data", "random"]
    return ["--model", model], ["--model-size", model, "--data", "random"]


@pytest.mark.parametrize("model,nproc,mem,options", GRID,
                         ids=[f"{m}-{n}x{g}-{'-'.join(o).replace('--', '') or 'defaults'}" for m, n, g, o in GRID])
def test_plan_and_the_dry_run_decide_alike(model, nproc, mem, options, tmp_path, capsys):
    plan_model, train_model = _model_args(model, tmp_path)
    code, out, err = _run(["plan", *plan_model, "--gpus-per-node", str(nproc), "--gpu-mem", mem, *options, "--json"],
                          capsys)
    assert code == 0, err
    plan = json.loads(out)
    run = plan["run"]
    code, out, err = _run(["train", *train_model, "--nproc", str(nproc), "--gpu-mem", mem, *options, "--dry-run",
                           "--json"], capsys)
    if "refused" in run:
        assert code == 2 and err.strip().splitlines()[-1] == f"meshrun: error: {run['refused']}", (err, run)
        return
    assert code == 0, err
    dry = json.loads(out)
    assert {k: dry[k] for k in COMPARED} == {k: run[k] for k in COMPARED}
    if model == "gpt2":
        assert run["kernels"] == ("plain" if "--kernels" in options else "meshrun"), run
    assert dry["decided_for"].startswith(f"{nproc} GPU(s)")
    if run["strategy_from"] == "planner":
        pick = plan["recommended"]  # (its label names checkpointing too: ddp+ac)
        assert (pick["strategy"].split("+")[0], pick["activation_checkpointing"]) == (
            run["strategy"], run["activation_checkpointing"]), plan["reasons"]
        if run["micro_batch_from"] == "planner":
            assert plan["recommended"]["micro_batch"] == run["micro_batch"]


def test_what_the_grid_covers():
    """Each decision takes more than one value over the grid (a grid where every case compiled,
    say, would compare nothing of the compile rule)."""
    flags = {o for _, _, _, opts in GRID for o in opts if o.startswith("--")}
    assert {"--precision", "--compile", "--kernels", "--micro-batch", "--global-batch", "--strategy",
            "--seq-len", "--activation-checkpointing"} <= flags
    assert {m for m, *_ in GRID} == {"gpt-tiny", "gpt-small", "gpt-1.3b", "llama", "moe", "gpt2"} and len(GRID) >= 20


def test_a_dry_run_on_the_cpu_decides_as_the_ranks_do_and_imports_no_torch():
    """Without GPUs and without --gpu-mem the dry run decides for CPU processes, torch-free:
    DDP over the processes, micro-batch 8, eager, torch's kernels, fp32."""
    code = ("import json, sys\nfrom meshrun.cli import main\n"
            "code = main(['train', '--dry-run', '--json', '--nproc', '2'])\n"
            "print('torch' in sys.modules)\nsys.exit(code)\n")
    res = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    *text, torch_loaded = res.stdout.strip().splitlines()
    assert torch_loaded == "False"
    dry = json.loads("\n".join(text))
    assert dry["decided_for"] == "CPU processes"
    assert {k: dry[k] for k in COMPARED} == {"strategy": "ddp", "micro_batch": 8, "global_batch": None,
                                             "accumulation": 1, "compile": "off", "kernels": "plain",
                                             "precision": "fp32", "activation_checkpointing": "none",
                                             "strategy_from": "rules", "micro_batch_from": "rules"}


def test_the_dry_run_prints_its_decisions_before_the_commands(capsys):
    code, out, _ = _run(["train", "--dry-run", "--nproc", "1", "--micro-batch", "4"], capsys)
    assert code == 0
    lines = out.splitlines()
    assert lines[:4] == ["# decided for CPU processes:", "# strategy: single (rules)", "# micro-batch: 4 (user)",
                         "# global batch: micro-batch x data-parallel ranks"]
    assert "# compile: off" in lines and "# kernels: plain" in lines and "# precision: fp32" in lines
    assert lines[-1].endswith("-m meshrun.training.worker")


def test_one_gpu_runs_fsdp2_on_its_rank_where_single_does_not_fit(capsys):
    """GPT 1.3B on one GPU of 28 GiB: single's fp32 states and autocast's bf16 weight copies do
    not fit its 25 GiB usable at any micro-batch; FSDP2 full shard over the one rank does (with
    checkpointing). With 40 GiB single fits, and stays the choice. ``--strategy fsdp`` on one GPU
    takes full shard whatever the model's size."""
    code, out, err = _run(["train", "--model-size", "gpt-1.3b", "--data", "random", "--nproc", "1", "--gpu-mem",
                           "28GiB", *EAGER, "--dry-run", "--json"], capsys)
    assert code == 0, err
    dry = json.loads(out)
    assert (dry["strategy"], dry["strategy_from"], dry["activation_checkpointing"]) == ("fsdp-full", "planner", "full")
    assert dry["reasons"][0].startswith("planner: fsdp-full predicted"), dry["reasons"]
    code, out, err = _run(["train", "--model-size", "gpt-1.3b", "--data", "random", "--nproc", "1", "--gpu-mem",
                           "40GiB", *EAGER, "--dry-run", "--json"], capsys)
    assert code == 0 and json.loads(out)["strategy"] == "single", err
    code, out, err = _run(["train", "--model-size", "gpt-tiny", "--data", "random", "--nproc", "1", "--gpu-mem",
                           "80GiB", *EAGER, "--strategy", "fsdp", "--dry-run", "--json"], capsys)
    assert code == 0, err
    dry = json.loads(out)
    assert dry["strategy"] == "fsdp-full" and dry["reasons"][1].startswith("--strategy fsdp: fsdp-full (one GPU"), dry


def test_gpu_mem_is_for_dry_runs(capsys):
    code, _, err = _run(["train", "--gpu-mem", "80GiB", "--steps", "1"], capsys)
    assert code == 2
    assert err.strip().splitlines()[-1].startswith("meshrun: error: --gpu-mem=")
