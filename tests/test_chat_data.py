"""Chat and instruction data: `messages` rendered with the tokenizer's chat template (with and
without {% generation %} tags) and prompt/completion records, the loss on the replies only,
examples packed whole with document masks (cut to the sequence when longer), the chat template
in the prepared identity and the cache key, one short `meshrun train`, and bad input in one
line each. Tokenizers are built here; nothing is downloaded."""

from __future__ import annotations

import json
import os
import re

import pytest
from helpers import clean_env, meshrun_here, require
from helpers import meshrun as run_cli

pytestmark = pytest.mark.framework

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# Turns one after another, each ending in <|im_end|> and a line break (the rendered prefix rule)
PLAIN = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# The same text, the assistant's content and its <|im_end|> in generation tags
TAGGED = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
          "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}"
          "{% else %}{{ m['content'] }}<|im_end|>{% endif %}{{ '\\n' }}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
WORDS = "hello there how are you the quick brown fox jumps over a lazy dog what is two and three five".split()


def make_tokenizer(out, template: str | None, jinja_file: bool = False) -> str:
    """A byte-level BPE with the chat special tokens as a tokenizer directory: tokenizer.json, and
    tokenizer_config.json naming the end-of-document token and ``template`` (or the template
    in chat_template.jinja, as newer transformers writes it)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainer)
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    config: dict = {"eos_token": "<|endoftext|>"}
    if template is not None and jinja_file:
        with open(os.path.join(out, "chat_template.jinja"), "w") as f:
            f.write(template)
    elif template is not None:
        config["chat_template"] = template
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    return str(out)


def conversation(i: int, user: str | None = None) -> dict:
    import random

    rng = random.Random(i)

    def say(n: int) -> str:
        return " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, n)))

    question = say(6)  # (drawn whatever ``user``: the other turns are the same either way)
    return {"messages": [{"role": "system", "content": "be brief"},
                         {"role": "user", "content": user if user is not None else question},
                         {"role": "assistant", "content": say(8)},
                         {"role": "user", "content": say(4)},
                         {"role": "assistant", "content": say(5)}]}


def write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        for r in records:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def toks(tmp_path_factory):
    require("tokenizers")
    require("jinja2")
    root = tmp_path_factory.mktemp("chat")
    return {"plain": make_tokenizer(root / "plain", PLAIN), "tagged": make_tokenizer(root / "tagged", TAGGED),
            "jinja": make_tokenizer(root / "jinja", PLAIN, jinja_file=True),
            "none": make_tokenizer(root / "none", None), "root": root}


def prepare(data, tok, out, *extra):
    res = meshrun_here("data", "prepare", str(data), "--tokenizer", tok, "--out", str(out), "--workers", "1",
                       "--val-fraction", "0", *extra)
    assert res.returncode == 0, res.stderr[-2000:]
    return res


def samples(out, seq):
    """The packed training samples of a prepared chat corpus, and its tokenizer."""
    from meshrun.data.store import open_tokens
    from meshrun.data.tokenizer import load_tokenizer
    from meshrun.training.loader import corpus_splits

    corpus = open_tokens(str(out))
    train, _ = corpus_splits(str(out), seq, document_mask=False)
    return [train[i] for i in range(len(train))], train, load_tokenizer(corpus.tokenizer["name"])


def trained_text(tok, y):
    """Each run of trained targets decoded, in order."""
    runs, run = [], []
    for t in y.tolist() + [-100]:
        if t == -100:
            if run:
                runs.append(tok.decode(run))
            run = []
        else:
            run.append(t)
    return runs


# ---- the loss mask --------------------------------------------------------------------------------

@pytest.mark.parametrize("kind,end", [("plain", "<|im_end|>\n"), ("tagged", "<|im_end|>"), ("jinja", "<|im_end|>\n")])
def test_only_the_assistant_turns_are_targets(toks, tmp_path, kind, end):
    """The targets that count are the assistant's tokens and what closes its turn: without
    generation tags the turn as rendered after the generation prompt (its text, <|im_end|> and
    the template's line break after it), with tags what they enclose; the same from a template
    in chat_template.jinja. Every other target is -100."""
    records = [conversation(i) for i in range(6)]
    prepare(write_jsonl(tmp_path / "c.jsonl", records), toks[kind], tmp_path / "out")
    got, train, tok = samples(tmp_path / "out", 512)
    assert train.document_mask and len(got) == 1  # six short conversations in one sequence
    x, y, positions = got[0]
    want = [m["content"] + end for r in records for m in r["messages"] if m["role"] == "assistant"]
    assert trained_text(tok, y) == want
    # the inputs are the rendered conversations, one after another, then padding
    text = tok.decode([t for t in x.tolist()])
    assert text.startswith("<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\n")
    assert text.count("<|im_start|>assistant\n") == 12


def test_a_default_system_prompt_is_not_trained(toks, tmp_path):
    """A template that opens every conversation with a system prompt of its own: a conversation
    that starts with the assistant trains its reply only, not the template's opening."""
    opening = "<|im_start|>system\nbe brief<|im_end|>\n" + PLAIN
    tok = make_tokenizer(tmp_path / "tok", opening)
    record = {"messages": [{"role": "assistant", "content": "hello there"}, {"role": "user", "content": "how"},
                           {"role": "assistant", "content": "the fox"}]}
    prepare(write_jsonl(tmp_path / "c.jsonl", [record]), tok, tmp_path / "out")
    got, _, tokenizer = samples(tmp_path / "out", 512)
    assert trained_text(tokenizer, got[0][1]) == ["hello there<|im_end|>\n", "the fox<|im_end|>\n"]


def test_a_user_turn_changes_no_target(toks, tmp_path):
    """Two corpora alike but for a user turn's words (a different number of tokens): the
    trained targets are the same tokens, in the same order."""
    first = [conversation(i) for i in range(4)]
    second = [conversation(i, user="what is two and three and five" if i == 1 else None) for i in range(4)]
    assert first != second
    targets = []
    for name, records in (("a", first), ("b", second)):
        prepare(write_jsonl(tmp_path / f"{name}.jsonl", records), toks["plain"], tmp_path / name)
        got, _, _ = samples(tmp_path / name, 512)
        x, y, _ = got[0]
        targets.append((x.tolist(), y[y != -100].tolist()))
    assert targets[0][0] != targets[1][0]  # the inputs differ
    assert targets[0][1] == targets[1][1] and targets[0][1]  # the targets do not


def test_prompt_completion_trains_the_completion_and_its_end(toks, tmp_path):
    """prompt/completion: the prompt's tokens, the completion's and the end-of-document token,
    the completion and <|endoftext|> the only targets; no template needed."""
    records = [{"prompt": "what is two and three", "completion": " five"},
               {"prompt": "hello", "completion": " there how are you"}]
    res = prepare(write_jsonl(tmp_path / "p.jsonl", records), toks["none"], tmp_path / "out")
    assert "train 2 examples, " in res.stderr and " tokens of which " in res.stderr
    got, _, tok = samples(tmp_path / "out", 64)
    (x, y, positions), = got
    assert trained_text(tok, y) == [" five<|endoftext|>", " there how are you<|endoftext|>"]
    n = len(tok.encode_batch(["what is two and three"])[0])
    assert tok.decode(x[:n].tolist()) == "what is two and three"


def test_worker_processes_prepare_the_same_files(toks, tmp_path):
    """Conversations over two chunks (256 records a chunk) prepared by two worker processes
    are byte for byte the files one process writes, loss masks included."""
    data = write_jsonl(tmp_path / "c.jsonl", [conversation(i) for i in range(300)])
    for workers in ("1", "2"):
        res = meshrun_here("data", "prepare", data, "--tokenizer", toks["tagged"], "--out", str(tmp_path / workers),
                           "--workers", workers)
        assert res.returncode == 0, res.stderr[-2000:]
    names = sorted(n for n in os.listdir(tmp_path / "1") if n.startswith(("train-", "val-")))
    assert {n.rsplit(".", 1)[1] for n in names} == {"tokens", "docs", "mask"}
    assert names == sorted(n for n in os.listdir(tmp_path / "2") if n.startswith(("train-", "val-")))
    for name in names:
        assert (tmp_path / "1" / name).read_bytes() == (tmp_path / "2" / name).read_bytes(), name


def test_one_conversation_trains_without_validation(toks, tmp_path):
    """A corpus of one conversation has no validation split: its shard, loss mask with it,
    becomes the training split."""
    res = meshrun_here("data", "prepare", write_jsonl(tmp_path / "c.jsonl", [conversation(0)]), "--tokenizer",
                       toks["plain"], "--out", str(tmp_path / "out"), "--workers", "1")
    assert res.returncode == 0 and "no validation split" in res.stderr, res.stderr
    got, train, tok = samples(tmp_path / "out", 512)
    assert len(got) == 1 and len(trained_text(tok, got[0][1])) == 2


# ---- packing ----------------------------------------------------------------------------------

def test_packed_examples_score_as_each_alone(toks, tmp_path):
    """A packed sequence's summed loss under meshrun's GPT with the sample's position ids (the
    dense document mask of the CPU) is the sum of its examples' losses each run alone with the
    same targets: no example attends to another, positions restart at each."""
    import torch
    import torch.nn.functional as F

    from meshrun.training.models.gpt import gpt

    prepare(write_jsonl(tmp_path / "c.jsonl", [conversation(i) for i in range(5)]), toks["plain"], tmp_path / "out")
    got, train, _ = samples(tmp_path / "out", 256)
    x, y, positions = got[0]
    starts = (positions == 0).nonzero().flatten().tolist()
    assert len(starts) >= 3  # at least two examples and the padding
    torch.manual_seed(0)
    model = gpt("gpt-tiny", seq_len=256, vocab=320, head_loss=False, fused_mlp=False).eval()
    with torch.no_grad():
        packed = F.cross_entropy(model(x[None], positions=positions[None])[0], y, ignore_index=-100,
                                 reduction="sum").item()
        alone = 0.0
        for a, b in zip(starts, starts[1:] + [256]):
            if (y[a:b] != -100).any():
                alone += F.cross_entropy(model(x[None, a:b])[0], y[a:b], ignore_index=-100, reduction="sum").item()
    assert packed == pytest.approx(alone, rel=1e-5)
    # each example whole in one sample, in order: the samples' runs of positions are the examples'
    # lengths, then padding (the end-of-document token, no target)
    runs = []
    for x, y, positions in got:
        starts = (positions == 0).nonzero().flatten().tolist()
        for a, b in zip(starts, starts[1:] + [len(positions)]):
            if int(x[a]) == train.pad_id:
                assert (x[a:b] == train.pad_id).all() and (y[a:b] == -100).all() and b == len(positions)
            else:
                runs.append(b - a)
    assert runs == train.lengths.tolist()


def test_an_example_longer_than_the_sequence_is_cut_or_left_out(toks, tmp_path):
    """An example longer than the sequence trains on its first seq_len tokens; one whose reply
    begins past them is left out; the first line's sentence counts both."""
    from meshrun.data.chat import EXAMPLE_WORDS
    from meshrun.data.packing import cut_line

    long_prompt = " ".join(["the quick brown fox"] * 30)
    records = [{"prompt": "hello", "completion": " there how are you"},
               {"prompt": "two and", "completion": " " + " ".join(["five"] * 40)},
               {"prompt": long_prompt, "completion": " five"}]
    prepare(write_jsonl(tmp_path / "p.jsonl", records), toks["none"], tmp_path / "out")
    got, train, tok = samples(tmp_path / "out", 24)
    assert (train.packing.cut, train.packing.dropped) == (2, 1)
    assert len(got) == 2  # the first example, then the cut one alone
    x, y, positions = got[1]
    assert positions.tolist() == list(range(24))
    n = len(tok.encode_batch(["two and"])[0])
    assert (y[:n - 1] == -100).all() and (y[n - 1:23] != -100).all() and y[23] == -100
    assert cut_line(train.packing, 24, EXAMPLE_WORDS["prompt-completion"]) == (
        "2 examples longer than --seq-len 24 cut to their first 24 tokens; 1 of them left out, with no trained "
        "token in those")


# ---- the template in the identity and the cache ------------------------------------------------

def test_a_changed_template_is_noticed(toks, tmp_path):
    """The chat template's hash is in the prepared identity and the cache key: prepared again
    with the same template the directory is up to date; with the template changed it is
    prepared again (the new template's text in its tokens), and the cache directory of
    `meshrun train` is another."""
    import shutil

    from meshrun.data.cache import cache_key
    from meshrun.data.sources import find_source
    from meshrun.data.store import read_index

    tok = str(tmp_path / "tok")
    shutil.copytree(toks["plain"], tok)
    data = write_jsonl(tmp_path / "c.jsonl", [conversation(i) for i in range(3)])
    prepare(data, tok, tmp_path / "out")
    before = read_index(str(tmp_path / "out"))["chat"]["template"]["sha256"]
    assert "is up to date" in prepare(data, tok, tmp_path / "out").stderr
    source = find_source(data)
    key = cache_key(source, "t", before)
    with open(os.path.join(tok, "tokenizer_config.json")) as f:
        config = json.load(f)
    config["chat_template"] = PLAIN.replace("<|im_end|>\n{% endfor %}", "<|im_end|>\n\n{% endfor %}")
    with open(os.path.join(tok, "tokenizer_config.json"), "w") as f:
        json.dump(config, f)
    res = prepare(data, tok, tmp_path / "out")
    assert "is up to date" not in res.stderr and "wrote" in res.stderr
    after = read_index(str(tmp_path / "out"))["chat"]["template"]["sha256"]
    assert after != before and cache_key(source, "t", after) != key
    got, _, tokenizer = samples(tmp_path / "out", 512)
    assert "<|im_end|>\n\n<|im_start|>user\n" in tokenizer.decode(got[0][0].tolist())


# ---- one run ------------------------------------------------------------------------------------

def test_train_on_a_chat_file(toks, tmp_path):
    """`meshrun train --data FILE.jsonl --tokenizer DIR` prepares the conversations into its
    cache before launch and trains on them with document masking, its first lines saying so."""
    data = write_jsonl(tmp_path / "c.jsonl", [conversation(i) for i in range(24)])
    env = clean_env(MESHRUN_CACHE=str(tmp_path / "cache"))
    res = run_cli("train", "--data", data, "--tokenizer", toks["plain"], "--model-size", "gpt-tiny", "--seq-len",
                  "128", "--micro-batch", "2", "--steps", "2", "--log-every", "2", "--nproc", "1", env=env,
                  timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert re.search(r"train \d+ conversations, [\d,]+ tokens of which [\d,]+ trained \(\d+%\)", res.stderr)
    line = next(t for t in res.stdout.splitlines() if t.startswith("meshrun train: data "))
    assert "(messages records, tokenized into" in line and "document masking on" in line
    assert re.search(r"; \d+ conversations packed into \d+ sequences, loss on the replies only$", line), line
    assert "val loss" in res.stdout


def _chat_run(prepared: str, overrides: dict) -> dict:
    """A rank of meshrun's GPT trained 3 steps on a prepared chat corpus (global batch 8, fp32):
    its losses and its weights after training."""
    import torch

    from meshrun.config import TrainConfig
    from meshrun.training.loader import corpus_splits
    from meshrun.training.models.gpt import gpt
    from meshrun.training.trainer import Trainer

    train, _ = corpus_splits(prepared, 64, True, vocab=320)
    cfg = TrainConfig(model_size="gpt-tiny", seq_len=64, steps=3, log_every=1, precision="fp32", global_batch=8,
                      lr=3e-3, warmup=1, deterministic=True, data=prepared, save_every=0, **overrides)
    torch.manual_seed(0)
    trainer = Trainer(gpt("gpt-tiny", seq_len=64, vocab=320, head_loss=False, fused_mlp=False), train, None, cfg)
    records = trainer.fit()
    weights = {n.removeprefix("module."): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
               for n, p in trainer.layout.model.named_parameters()}
    return {"losses": [r["loss"] for r in records], "weights": weights}


def test_the_loss_is_the_mean_over_the_step_s_replies_whatever_the_split(toks, tmp_path):
    """Sequences of chat data hold unequal numbers of reply tokens; the step's loss is the mean
    over all of them, so one process with micro-batch 8, one accumulating 4 micro-batches of 2
    two DDP ranks with micro-batch 2 and two context-parallel ranks
    (each half of every sequence; a half may hold no reply) train alike (fp32, to summation order: losses to 1e-5,
    weights to 1e-6 on average; AdamW's division by the root of a near-zero gradient's square
    makes a few weights differ by up to 1.3e-4, a twentieth of a 3e-3 step), where a mean
    of micro-batch means would weigh a short sequence's reply tokens above a long one's."""
    import meshrun
    from meshrun.training.loader import corpus_splits

    prepare(write_jsonl(tmp_path / "c.jsonl", [conversation(i) for i in range(60)]), toks["plain"], tmp_path / "out")
    train, _ = corpus_splits(str(tmp_path / "out"), 64, True, vocab=320)
    counts = {int(train[i][1].ne(-100).sum()) for i in range(8)}
    assert len(counts) > 2  # unequal reply tokens per sequence
    runs = [meshrun.run(_chat_run, str(tmp_path / "out"), overrides, nproc=nproc, timeout_s=300)
            for nproc, overrides in ((1, {"micro_batch": 8}), (1, {"micro_batch": 2}),
                                     (2, {"micro_batch": 2, "strategy": "ddp"}), (2, {"micro_batch": 4, "cp": 2}))]
    for other in runs[1:]:
        assert other["losses"] == pytest.approx(runs[0]["losses"], rel=1e-5)
        assert other["weights"].keys() == runs[0]["weights"].keys()
        for name, w in runs[0]["weights"].items():
            diff = other["weights"][name].sub(w).abs()
            assert diff.mean() < 1e-6 and diff.max() < 1e-3, name


def test_a_context_parallel_half_of_prompt_alone_adds_nothing(toks, tmp_path):
    """Conversations whose long first question fills a sequence's middle: under --cp 2 one
    rank's half (the 2nd and 3rd quarters) holds no reply token, so its mean loss is over
    nothing; it adds nothing and the run trains as one process does (not a nan loss)."""
    import meshrun

    question = " ".join(WORDS[i % len(WORDS)] for i in range(8))
    prepare(write_jsonl(tmp_path / "c.jsonl", [conversation(i, user=question) for i in range(24)]), toks["plain"],
            tmp_path / "out")
    one, split = (meshrun.run(_chat_run, str(tmp_path / "out"), overrides, nproc=nproc, timeout_s=300)
                  for nproc, overrides in ((1, {"micro_batch": 8}), (2, {"micro_batch": 8, "cp": 2})))
    assert split["losses"] == pytest.approx(one["losses"], rel=1e-5)


# ---- bad input -----------------------------------------------------------------------------------

def _bad_cases(toks, tmp):
    good = conversation(0)

    def file(name, *records):
        return write_jsonl(tmp / name, records)

    refuses = ("{% for m in messages %}{% if m['role'] == 'system' %}{{ raise_exception('no system turns') }}"
               "{% endif %}{{ m['content'] }}{% endfor %}")
    refusing = make_tokenizer(tmp / "refusing", refuses)
    # its generation prompt is not how it renders an assistant turn: the turn's span is not found
    unlike = make_tokenizer(tmp / "unlike", PLAIN.replace("<|im_start|>assistant\n{% endif %}",
                                                          "<|im_start|>bot\n{% endif %}"))
    gpt = ["--model-size", "gpt-tiny", "--seq-len", "64", "--micro-batch", "2", "--nproc", "1"]
    plain = toks["plain"]
    robot = {"messages": [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}]}
    unanswered = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "hi"}]}
    empty = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]}
    parts = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]},
                          {"role": "assistant", "content": "x"}]}
    return [
        (file("robot.jsonl", good, robot), plain,
         r":2: message 1's role='robot': unknown role \(hint: one of system, user, assistant, tool\)"),
        (file("unanswered.jsonl", good, good, unanswered), plain, r":3: a conversation without an assistant turn"),
        (file("neither.jsonl", good, {"question": "q", "answer": "a"}), plain,
         r":2: neither a conversation nor an instruction example \(it has answer, question\)"),
        (file("mixed.jsonl", good, good, {"prompt": "p", "completion": "c"}), plain,
         r":3: an instruction example \('prompt' and 'completion'\) in a file of conversations"),
        (file("text_then_chat.jsonl", {"text": "x"}, good), plain,
         r":2: a conversation in a corpus of text \(its first record has the 'text' field\)"),
        (file("first_neither.jsonl", {"question": "q"}), plain,
         r":1: no 'text' field \(it has question\) \(hint: --text-field NAME; chat data are records with "
         r"'messages', or with 'prompt' and 'completion'\)"),
        (file("empty.jsonl", good, empty), plain, r":2: message 1 \(assistant\) is empty: nothing to train on"),
        (file("parts.jsonl", parts), plain, r":1: message 0 \(user\): its content is list, not text"),
        (file("nolist.jsonl", {"messages": []}), plain, r":1: 'messages' is an empty list"),
        (file("nocompletion.jsonl", {"prompt": "p", "completion": ""}), plain, r":1: an empty completion"),
        (file("chat.jsonl", good), toks["none"],
         r"has no chat template \(tokenizer_config.json's chat_template or chat_template.jinja\), and the data are "
         r"conversations \('messages'\) \(hint: a tokenizer directory with a chat template, or the data as "
         r"prompt/completion records\)"),
        (file("sys.jsonl", good), refusing, r":1: the chat template \(\S+\) fails on it: no system turns"),
        (file("unlike.jsonl", good), unlike, r":1: the chat template does not render the conversation up to "
         r"message 2 as the start of the whole"),
    ], gpt


def test_bad_chat_data_is_one_line_each(toks, tmp_path):
    """Each bad input is refused in one line with exit code 2, by `meshrun data prepare` and by
    `meshrun train` before it starts anything (the file and line named)."""
    cases, gpt = _bad_cases(toks, tmp_path)
    env = clean_env(MESHRUN_CACHE=str(tmp_path / "cache"))
    for k, (data, tok, pattern) in enumerate(cases):
        for args in (["data", "prepare", data, "--tokenizer", tok, "--out", str(tmp_path / f"o{k}"), "--workers", "1"],
                     ["train", "--data", data, "--tokenizer", tok, *gpt]):
            res = meshrun_here(*args, env=env)
            assert res.returncode == 2, (args, res.stderr[-2000:])
            lines = res.stderr.strip().splitlines()
            assert len(lines) == 1 and lines[0].startswith("meshrun: error: "), (args, res.stderr)
            assert re.search(pattern, lines[0]), (args, lines[0])
        assert not os.path.exists(tmp_path / f"o{k}")  # a refused preparation leaves no directory


def test_chat_options_refused_in_one_line(toks, tmp_path):
    """Chat data are packed with document masks: turning them off, --pp and a tokenizer to train
    are refused before anything starts."""
    data = write_jsonl(tmp_path / "c.jsonl", [conversation(i) for i in range(3)])
    gpt = ["--model-size", "gpt-tiny", "--seq-len", "64", "--micro-batch", "2"]
    env = clean_env(MESHRUN_CACHE=str(tmp_path / "cache"))
    for args, extra, pattern in (
            (["train", "--data", data, "--tokenizer", toks["plain"], *gpt], {"MESHRUN_DOCUMENT_MASK": "0"},
             r"--document-mask \(from env MESHRUN_DOCUMENT_MASK\)=False: chat data are packed with document masks, "
             r"so that no example attends to another \(hint: drop it"),
            (["train", "--data", data, "--tokenizer", toks["plain"], *gpt, "--pp", "2", "--nproc", "2"], {},
             r"chat data \(messages\) are packed with document masks, which do not combine with --pp"),
            (["data", "prepare", data, "--train-tokenizer", "300", "--out", str(tmp_path / "o")], {},
             r"--train-tokenizer=300: trains a tokenizer on text; the corpus holds conversations")):
        res = meshrun_here(*args, env={**env, **extra})
        assert res.returncode == 2, (args, res.stderr[-2000:])
        lines = res.stderr.strip().splitlines()
        assert len(lines) == 1 and re.search(pattern, lines[0]), (args, res.stderr)


def test_an_altered_loss_mask_is_refused_before_training(toks, tmp_path):
    """A prepared chat corpus whose loss mask is cut short or missing is refused in one line
    naming the file, before anything starts."""
    prepare(write_jsonl(tmp_path / "c.jsonl", [conversation(i) for i in range(4)]), toks["plain"], tmp_path / "out")
    mask = tmp_path / "out" / "train-00000.mask"
    gpt = ["--model-size", "gpt-tiny", "--seq-len", "64", "--micro-batch", "2", "--nproc", "1"]
    for alter, pattern in ((lambda: mask.write_bytes(mask.read_bytes()[:-1]),
                            r"train-00000\.mask: \d+ bytes, a byte per token of the shard's \d+ \(truncated or "
                            r"altered\) \(hint: run meshrun data prepare again\)"),
                           (mask.unlink, r"train-00000\.mask is missing, a chat corpus' loss mask")):
        alter()
        res = meshrun_here("train", "--data", str(tmp_path / "out"), *gpt)
        lines = res.stderr.strip().splitlines()
        assert res.returncode == 2 and len(lines) == 1 and re.search(pattern, lines[0]), res.stderr
