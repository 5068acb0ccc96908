"""What a `meshrun train` run prints, from the functions that word it: the first lines (the
model, the data, the steps and batch, the strategy), the bounded waits, the step line that
fits a terminal, a range of the ranks' figures, and metrics.jsonl after a resume. The real
runs' output is checked by tests/test_train_cli.py, test_data.py and test_trackers.py."""

from __future__ import annotations

import itertools
import json

import pytest
from helpers import require

from meshrun.job import waits_line
from meshrun.units import span

# A log step of the default job on 2 CPU processes, as report.record makes it
CPU_RECORD = {"step": 10, "loss": 4.772609710693359, "lr": 0.0006281416799501187, "grad_norm": 2.4611170291900635,
              "step_time_s": 0.059307923600135835, "data_time_s": 0.00149631460008095,
              "tokens_per_s": 69063.28448818967, "tokens_per_s_per_gpu": None, "mfu": None, "peak_mem_bytes": None,
              "peak_reserved_bytes": None, "epoch": 0}
# and one of 8 GPUs, at the last step of a long run, with its validation and snapshot
GPU_RECORD = {**CPU_RECORD, "step": 120000, "loss": 2.9871, "val_loss": 3.0215, "lr": 3e-05,
              "step_time_s": 0.4231, "tokens_per_s": 4616528.3, "tokens_per_s_per_gpu": 577066.0, "mfu": 0.502,
              "peak_mem_bytes": 50 * 2**30, "peak_reserved_bytes": 56.3 * 2**30, "snapshot_time_s": 12.5,
              "val_time_s": 3.2}


def test_a_range_of_the_ranks_figures_is_one_figure_when_its_ends_print_alike():
    assert span([0.281, 0.284], ".2f", "s") == "0.28 s"
    assert span([0.25, 0.31, 0.27], ".2f", "s") == "0.25-0.31 s"
    assert span([3, 5], "d") == "3-5" and span([7], "d") == "7"
    from meshrun.training.metrics import read_cost_line

    alike = [(0.281, 0.14, 40265318), (0.284, 0.141, 40265318)]
    assert read_cost_line(alike) == "0.28 s a rank (0.14 s of CPU, 38.4 MB)"
    apart = [(0.25, 0.14, 40265318), (0.31, 0.16, 50000000)]
    assert read_cost_line(apart) == "0.25-0.31 s a rank (0.14-0.16 s of CPU, 38.4-47.7 MB)"
    assert read_cost_line([(0.25, 0.14, None), (0.25, 0.14, 1)]) == "0.25 s a rank (0.14 s of CPU)"  # no /proc


def test_the_bounded_waits_read_as_sentences():
    assert waits_line(None, 300, 300) == (
        "meshrun train: a rank that stops answering for 300 s ends the job (--collective-timeout); ranks still "
        "running 300 s after another finished are stopped (--finish-timeout)")
    assert waits_line(600, 15, 300).startswith(
        "meshrun train: the other nodes have 600 s to join (--rdzv-timeout); a rank that stops answering for 15 s "
        "ends the job (--collective-timeout); ")


def test_the_step_line_keeps_what_a_person_follows_at_the_precision_it_is_read():
    from meshrun.training.stepline import step_line

    assert step_line(CPU_RECORD, 200, 1.2, 22.8) == (
        "step 10/200 | loss 4.773 | lr 6.28e-4 | 69,063 tok/s | 59.3 ms/step | elapsed 0:01 | left 0:23")
    last = {**CPU_RECORD, "step": 200, "val_loss": 4.32571, "lr": 0.0001, "step_time_s": 1.2345}
    assert step_line(last, 200, 95.0, None) == (
        "step 200/200 | loss 4.773 | val loss 4.326 | lr 1e-4 | 69,063 tok/s | 1.23 s/step | elapsed 1:35")
    gpu = step_line({**GPU_RECORD, "val_loss": None, "step": 120, "tokens_per_s": 577066.2}, 400, 50.0, 118.0)
    # on a GPU, MFU takes the step time's place: with both the line is 101 columns
    assert gpu == "step 120/400 | loss 2.987 | lr 3e-5 | 577,066 tok/s | mfu 50.2% | elapsed 0:50 | left 1:58"
    assert " | 69,063 samples/s | " in step_line(CPU_RECORD, 200, 1.2, 22.8, rate="samples/s")  # inputs not tokens
    # the rest of the record is metrics.jsonl's alone
    for line in (gpu, step_line(CPU_RECORD, 200, 1.2, 22.8)):
        assert not any(word in line for word in ("grad", "data_time", "epoch", "per_gpu", "GiB", "snapshot"))


def test_the_step_line_fits_100_columns_leaving_out_the_least_needed_first():
    from meshrun.training.stepline import WIDTH, step_line

    # the longest a run prints: a 6-digit step count, days elapsed and left, validation at a step that has a left
    wide = step_line({**GPU_RECORD, "val_loss": None, "step": 1200}, 20000, 507.0, 7944.0)
    assert wide == ("step 1200/20000 | loss 2.987 | lr 3e-5 | 4,616,528 tok/s | mfu 50.2% | elapsed 8:27 "
                    "| left 2:12:24")  # the step time first: the throughput says it too
    assert len(wide) <= WIDTH < len(wide) + len(" | 423 ms/step")
    widest = step_line({**GPU_RECORD, "step": 123456, "loss": 10.123456}, 999999, 3_600_000.0, 36_000_000.0)
    assert len(widest) <= WIDTH, widest
    assert widest == ("step 123456/999999 | loss 10.12 | val loss 3.022 | lr 3e-5 | 4,616,528 tok/s "
                      "| left 10000:00:00")
    figures = itertools.product((1, 9_999, 999_999), (0.001234, 12.3456), (None, 3.5), (1e-2, 6.28e-5),
                                (12.0, 98_765_432.1), (None, 0.5), (0.0001, 123.4), (5.0, 400_000.0))
    for step, loss, val, lr, tokens, mfu, took, left in figures:
        record = {**CPU_RECORD, "step": step, "loss": loss, "val_loss": val, "lr": lr, "tokens_per_s": tokens,
                  "mfu": mfu, "step_time_s": took}
        line = step_line(record, 999_999, left, left)
        assert len(line) <= WIDTH, line
        assert line.startswith(f"step {step}/999999 | loss ") and " tok/s" in line and "left " in line


def test_the_first_lines_name_the_model_the_data_and_what_was_resolved():
    from meshrun.training.about import STDLIB_WORDS, DataFacts, ModelFacts, data_line, model_line
    from meshrun.training.report import steps_line, strategy_line

    assert model_line(ModelFacts("gpt-tiny", "gpt-tiny (meshrun's GPT preset: 2 layers of width 64)"), 133_000) == (
        "model gpt-tiny (meshrun's GPT preset: 2 layers of width 64), 133K parameters")
    stdlib = DataFacts("stdlib", f"{STDLIB_WORDS} (the .py files under /usr/lib/python3.12)", 29_990_000, 1_580_000,
                       tokenizer="bytes", vocab=256)
    assert data_line(stdlib, 256) == (
        "data the Python standard library's source (the .py files under /usr/lib/python3.12): 30M tokens for "
        "training, 1.58M for validation; one token per byte (vocabulary 256); document masking off")
    corpus = DataFacts("/d/corpus", "/d/corpus (prepared from /d/texts)", 12_345_678, None, tokenizer="gpt2",
                       vocab=50257, document_mask=True, validation=False)
    assert data_line(corpus, 1024) == ("data /d/corpus (prepared from /d/texts): 12.3M tokens for training, "
                                       "no validation set; tokenizer gpt2 (vocabulary 50,257); document masking on")
    users = DataFacts("pkg.data:train", "pkg.data:train (your Regression)", train_samples=1024, val_samples=128,
                      tokens=False)
    assert data_line(users, 256) == ("data pkg.data:train (your Regression): 1,024 samples for training, 128 for "
                                     "validation")
    assert steps_line(0, 200, 8, 1, 2, 256, 1e-3, 20, 0.1) == (
        "200 steps, each a global batch of 16 sequences of 256 tokens (micro-batch 8 x 1 accumulation step x 2 "
        "data-parallel ranks); lr 0.001 after 20 warmup steps, cosine to 1e-4")
    assert steps_line(80, 200, 4, 8, 16, None, 3e-4, 0, 0.1) == (
        "steps 81-200 of 200, each a global batch of 512 samples (micro-batch 4 x 8 accumulation steps x 16 "
        "data-parallel ranks); lr 3e-4, cosine to 3e-5")
    assert strategy_line("ddp: DDP, buckets of 100 MB", 2, 2, False, "fp32") == (
        "strategy ddp: DDP, buckets of 100 MB, on 2 CPU processes, in fp32")
    assert strategy_line("fsdp-full: FSDP2 full over 16 ranks", 16, 8, True, "bf16") == (
        "strategy fsdp-full: FSDP2 full over 16 ranks, on 16 GPUs of 2 nodes, in bf16")


def test_the_data_facts_come_from_the_datasets_the_ranks_built(tmp_path):
    require("torch")
    import numpy as np
    import torch

    from meshrun.config import TrainConfig
    from meshrun.training.about import data_facts, model_facts
    from meshrun.training.loader import RandomTokens, TokenChunks, corpus_splits
    from meshrun.training.models.gpt import gpt

    cfg = TrainConfig(model_size="gpt-tiny")
    facts = data_facts(TokenChunks(torch.zeros(1000, dtype=torch.uint8), 8), TokenChunks(torch.zeros(50), 8), 256,
                       cfg)
    assert (facts.name, facts.train_tokens, facts.val_tokens, facts.tokenizer, facts.vocab) == \
        ("stdlib", 1000, 50, "bytes", 256)
    facts = data_facts(RandomTokens(64, 16, 320), None, 320, cfg.replace(data="random"))
    assert (facts.name, facts.train_samples, facts.vocab, facts.validation) == ("random", 64, 320, False)
    np.arange(5000, dtype=np.uint16).tofile(tmp_path / "train.bin")
    np.arange(600, dtype=np.uint16).tofile(tmp_path / "val.bin")
    path = str(tmp_path / "train.bin")
    train, val = corpus_splits(path, 32, False)
    facts = data_facts(train, val, 50304, cfg.replace(data=path))
    assert (facts.name, facts.words, facts.train_tokens, facts.val_tokens, facts.tokenizer, facts.vocab) == \
        (path, f"{path} (token files)", 5000, 600, None, 50304)
    # a user's dataset: token ids or not, by its first sample (the trainer counts tokens or samples alike)
    ids, floats = torch.utils.data.TensorDataset(torch.zeros(10, 8, dtype=torch.long)), \
        torch.utils.data.TensorDataset(torch.zeros(10, 8))
    facts = data_facts(ids, None, 64, cfg.replace(data="pkg.data:ids"))
    assert (facts.name, facts.words, facts.tokens, facts.train_samples, facts.validation) == \
        ("pkg.data:ids", "pkg.data:ids (your TensorDataset)", True, 10, False)
    assert not data_facts(floats, floats, None).tokens and data_facts(floats, floats, None).words == \
        "TensorDataset (the dataset given to Trainer)"
    model = model_facts(cfg, gpt("gpt-tiny", 16, 64), pretrained=False)
    assert (model.name, model.words) == ("gpt-tiny", "gpt-tiny (meshrun's GPT preset: 2 layers of width 64)")


def test_a_resume_leaves_one_record_a_step_through_its_snapshot_and_none_after(tmp_path):
    """Resuming from step 4: the interrupted start's steps 5 and 6 (one cut short by a kill)
    go, a step an older meshrun logged twice keeps its later record; the file is replaced
    whole, and left as it is when already so."""
    require("torch")
    from meshrun.training.metrics import keep_through

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 2, "loss": 3.0}\n{"step": 2, "loss": 2.9}\n{"step": 4, "loss": 2.5}\n'
                    '{"step": 6, "loss": 2.2}\n{"step": 8, "lo')
    assert keep_through(str(path), 4) == 3
    assert [json.loads(line) for line in path.read_text().splitlines()] == [{"step": 2, "loss": 2.9},
                                                                            {"step": 4, "loss": 2.5}]
    before = path.stat().st_mtime_ns, path.stat().st_ino
    assert keep_through(str(path), 4) == 0 and (path.stat().st_mtime_ns, path.stat().st_ino) == before
    assert keep_through(str(tmp_path / "none.jsonl"), 4) == 0 and not (tmp_path / "none.jsonl").exists()
    assert keep_through(str(path), 0) == 2 and path.read_text() == ""  # a fresh start over an earlier attempt's


def test_tensorboard_hides_the_steps_an_interrupted_start_logged_after_the_resumed_step(tmp_path):
    require("torch")
    require("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from meshrun.training.tracking import TensorBoard

    first = TensorBoard(str(tmp_path), {})
    for step in (1, 2, 3, 4):
        first.log({"loss": float(10 - step)}, step)
    first.close(False)
    resumed = TensorBoard(str(tmp_path), {}, done=2)
    for step in (3, 4):
        resumed.log({"loss": float(step)}, step)
    resumed.close(True)
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 9.0), (2, 8.0), (3, 3.0), (4, 4.0)]


@pytest.mark.parametrize("starts, command", [
    (1, "offline: wandb sync {parent}/offline-run-20261202_100000-abc"),
    (2, "offline: wandb sync {parent}/offline-run-*-abc"),
])
def test_an_offline_wandb_run_is_synced_by_its_directories(tmp_path, starts, command):
    from meshrun.training.tracking import sync_command

    parent = tmp_path / "wandb"
    for i in range(starts):
        (parent / f"offline-run-2026120{2 - i}_100000-abc").mkdir(parents=True)
    (parent / "offline-run-20261201_090000-other").mkdir()
    assert sync_command(str(parent / "offline-run-20261202_100000-abc"), "abc") == command.format(parent=parent)
