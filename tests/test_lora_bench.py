"""bench/lora_bench.py's claims, without its runs: the peer's rows (transformers' chat template
and the bench's packing) are the sequences meshrun's loader serves from the same conversations,
in its order; given those rows transformers attends within each example only, as meshrun's
document masks do; and the figures and the table it reports. The bench's own end-to-end check
is `python bench/lora_bench.py --cpu-check` (two real launches each of meshrun and the peer)."""

from __future__ import annotations

import json

import pytest
from helpers import bench_module, meshrun_here, require

pytestmark = pytest.mark.framework


@pytest.fixture(scope="module")
def bench():
    """The bench's modules, siblings imported as the scripts import them."""
    for name in ("chat_corpus", "cli_train", "defaults_matrix", "lora_rows"):
        bench_module(name)
    return {name: bench_module(name) for name in ("chat_corpus", "lora_rows", "lora_bench")}


@pytest.fixture(scope="module")
def corpus(bench, tmp_path_factory):
    """120 conversations, a tokenizer with the chat template trained on them, and meshrun's
    prepared corpus of them (no validation split)."""
    require("tokenizers")
    require("jinja2")
    require("transformers")
    root = tmp_path_factory.mktemp("lora-bench")
    chat = str(root / "chat.jsonl")
    bench["chat_corpus"].write_corpus(chat, 120, seed=3)
    bench["chat_corpus"].write_tokenizer(str(root), chat, vocab=600, max_length=8192)
    res = meshrun_here("data", "prepare", chat, "--tokenizer", str(root), "--out", str(root / "data"),
                       "--workers", "1", "--val-fraction", "0")
    assert res.returncode == 0, res.stderr[-2000:]
    return root


@pytest.mark.parametrize("seq", [128, 1024])
def test_the_peers_rows_are_the_sequences_meshrun_trains_on(bench, corpus, seq):
    """At 128 tokens most conversations are cut, and those with nothing trained left are left
    out; at 1,024 several share a sequence. Either way the peer's rows, made with transformers'
    apply_chat_template and the bench's packing, hold meshrun's inputs, position ids and
    targets, row for row in the order meshrun's sampler reads them."""
    rows_mod = bench["lora_rows"]
    examples = rows_mod.hf_examples(str(corpus), str(corpus / "chat.jsonl"))
    groups = rows_mod.pack(examples, seq)
    if seq == 128:
        assert len(groups) < len(examples)  # some left out
    else:
        assert max(map(len, groups)) > 1  # some packed together
    from transformers import AutoTokenizer

    pad = AutoTokenizer.from_pretrained(str(corpus)).eos_token_id
    rows = rows_mod.build(str(corpus), str(corpus / "chat.jsonl"), seq, pad, min(12, len(groups)), seed=0)
    assert rows["index"].tolist() != sorted(rows["index"].tolist())  # the sampler's shuffle, not file order
    check = rows_mod.compare(rows, str(corpus / "data"), seq)
    assert check["same"], check
    assert rows["trained_tokens"] > 0
    # and a row that differs is found
    rows["labels"][3, (rows["labels"][3] != -100).argmax()] = -100
    assert rows_mod.compare(rows, str(corpus / "data"), seq)["rows_differing"] == {
        "input_ids": 0, "position_ids": 0, "labels": 1}


def test_a_corpus_too_small_for_the_run_is_refused(bench, corpus):
    rows_mod = bench["lora_rows"]
    with pytest.raises(ValueError, match="fewer than the 1000"):
        rows_mod.build(str(corpus), str(corpus / "chat.jsonl"), 1024, 0, 1000, seed=0)


def test_transformers_attends_within_each_example_of_a_peer_row(bench, corpus):
    """Position ids that restart and no attention mask: transformers' SDPA path gives each
    example of a packed row the logits it has alone (the document mask meshrun applies), and
    the same row without position ids does not."""
    import torch
    import transformers

    rows_mod = bench["lora_rows"]
    examples = rows_mod.hf_examples(str(corpus), str(corpus / "chat.jsonl"))
    seq = 1024
    group = max(rows_mod.pack(examples, seq), key=len)
    row = rows_mod.row(examples, group, seq, pad_id=0)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=600,
                                      max_position_embeddings=seq, attn_implementation="sdpa")
    model = transformers.LlamaForCausalLM(config).eval()
    model.config.use_cache = False  # (as the peer sets it: with a cache no document mask is built)
    ids, positions = (torch.from_numpy(row[k])[None] for k in ("input_ids", "position_ids"))
    starts = (positions[0] == 0).nonzero().flatten().tolist() + [seq]
    assert len(starts) - 1 == len(group) + 1  # the examples, then the padding
    with torch.no_grad():
        packed = model(input_ids=ids, position_ids=positions).logits
        alone = torch.cat([model(input_ids=ids[:, a:b]).logits for a, b in zip(starts, starts[1:])], dim=1)
        across = model(input_ids=ids).logits
    torch.testing.assert_close(packed, alone, rtol=1e-4, atol=1e-4)
    assert (across - alone).abs().max() > 1e-2


def _records(path, losses, per_s, mfu=0.4, peak=40 * 2**30):
    with open(path, "w") as f:
        for step, (loss, rate) in enumerate(zip(losses, per_s), 1):
            f.write(json.dumps({"step": step, "loss": loss, "lr": 1e-4, "tokens_per_s": rate, "mfu": mfu,
                                "peak_mem_bytes": peak + step, "peak_reserved_bytes": peak + 2**30}) + "\n")


def test_meshruns_figures_come_from_its_metrics_records(bench, tmp_path):
    """The median of the steps after --skip, per GPU; every step's loss; process 0's peaks."""
    lb = bench["lora_bench"]
    s = lb.Settings(gpus=(2,), steps=6, seq=4096, micro=2, lora_r=16, lr=1e-4, warmup=5, skip=2, cpu=False,
                    params=8e9)
    _records(tmp_path / "metrics.jsonl", [11.9, 11.5, 11.2, 10.8, 10.1, 9.7], [100, 500, 4000, 4200, 4100, 3000])
    lines = ["meshrun train: strategy fsdp-full: LoRA rank 16 on 224 layers -> pretrained weights read -> full "
             "activation checkpointing -> FSDP2 full shard over 2 ranks, on 2 GPUs, in bf16",
             "meshrun train: 6 steps, each a global batch of 4 sequences of 4,096 tokens (micro-batch 2 x 1 "
             "accumulation step x 2 data-parallel ranks); lr 1e-4 after 5 warmup steps, cosine to 1e-4"]
    got = lb.meshrun_figures(lines, str(tmp_path), s, 2)
    assert got["tokens_per_s_per_process"] == 2025  # median of 2000, 2100, 2050, 1500
    assert got["losses"][0] == 11.9 and got["losses"][-1] == 9.7
    assert (got["strategy"], got["micro"], got["accum"], got["ac"]) == ("fsdp-full", 2, 1, "full")
    assert got["peak_allocated_gib"] == round((40 * 2**30 + 6) / 2**30, 2) and got["peak_reserved_gib"] == 41.0


def test_the_table_sets_each_gpu_counts_runs_side_by_side(bench, tmp_path):
    """Two calls' lora.jsonl merged: a run that ran replaces the same run skipped in the other
    call; the ratio is meshrun's tokens/s per GPU over the peer's."""
    lb = bench["lora_bench"]
    base = {"cpu": False, "same_rows": True, "micro_batch_per_gpu": 2}
    g1 = [{**base, "who": "meshrun", "gpus": 1, "status": "ran", "ran": True, "tokens_per_s_per_process": 6000,
           "strategy": "single", "micro": 2, "accum": 1, "compiled": False, "loss_first": 11.9, "loss_last": 9.5},
          {**base, "who": "peer", "gpus": 1, "status": "ran", "ran": True, "tokens_per_s_per_process": 4000,
           "layout": "single", "attn": "sdpa"},
          {**base, "who": "meshrun", "gpus": 2, "status": "skipped", "ran": False, "skipped": "past --deadline-s"}]
    g2 = [{**base, "who": "meshrun", "gpus": 2, "status": "ran", "ran": True, "tokens_per_s_per_process": 5000,
           "strategy": "fsdp-full", "micro": 2, "accum": 1, "ac": "full"},
          {**base, "who": "peer", "gpus": 2, "status": "failed", "ran": False, "rc": 1, "log": "peer-g2.log",
           "tail": ["RuntimeError: boom"]}]
    for name, rows in (("a.jsonl", g1), ("b.jsonl", g2)):
        with open(tmp_path / name, "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
    text = lb.table(lb.read_rows(f"{tmp_path / 'a.jsonl'},{tmp_path / 'b.jsonl'}"))
    assert "| 1 | 6,000 | 4,000 | 1.50x | yes |" in text
    assert "| 2 | 5,000 | - | - | yes |" in text
    assert "| 2 | meshrun | yes | fsdp-full, micro 2 x 1, eager, AC full | 5,000 |" in text
    assert "SKIPPED" not in text and "peer on 2: no (rc 1), peer-g2.log:\n    RuntimeError: boom" in text


def test_a_skipped_part_is_given_its_own_command(bench):
    lb = bench["lora_bench"]
    assert lb.rerun(["--gpus", "1,2", "--steps", "50", "--out=/tmp/x"], 2, "/tmp/x") == \
        "python3 bench/lora_bench.py --steps 50 --gpus 2 --out /tmp/x-g2"
