"""Training data from disk: a corpus made here, `meshrun data prepare` (round trip, counts, an
interrupted run resumed, the tokenizer it trains on the corpus, the files it skips and the
extensions --ext adds), `meshrun train --data` on prepared shards, flat token files and text,
packing with document masks, sampling that survives a restart on another world size, and bad
input in one line each."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from helpers import clean_env, meshrun_here, require, with_faults
from helpers import meshrun as run_cli

import meshrun

pytestmark = pytest.mark.framework
WORDS = ("the quick brown fox jumps over the lazy dog; naïve café, Ünïcode 東京 données — «quotes» "
         "def f(x): return x + 1").split()


def write_corpus(root, n_files=12, seed=0, lines=(5, 40), n_records=20):
    """Text files with empty lines and non-ASCII text, and a .jsonl of more documents (an empty
    line between records); returns every document's text in the order prepare reads them."""
    import random

    rng = random.Random(seed)
    os.makedirs(root, exist_ok=True)
    docs = {}
    for i in range(n_files):
        body = "\n".join("" if rng.random() < 0.2 else " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 12)))
                         for _ in range(rng.randint(*lines))) + "\n"
        path = os.path.join(root, f"doc{i:03d}.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write(body)
        docs[path] = [body]
    records = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) for _ in range(n_records)]
    path = os.path.join(root, "more.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps({"text": r, "id": 1}) + "\n\n")
    docs[path] = records
    return [d for p in sorted(docs) for d in docs[p]]


def train_tokenizer(corpus_root, out, vocab=320):
    """A byte-level BPE tokenizer trained on the corpus' .txt files by the `tokenizers` library
    itself, with <|endoftext|>, saved as a Hugging Face tokenizer directory (tokenizer.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    files = sorted(os.path.join(corpus_root, f) for f in os.listdir(corpus_root) if f.endswith(".txt"))
    tok.train(files, trainer)
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """The corpus prepared with a tokenizer of 320 tokens that `meshrun data prepare` trains on
    it; the prepared directory, which holds that tokenizer.json, is the tokenizer directory the
    other tests name."""
    require("tokenizers")
    root = tmp_path_factory.mktemp("data")
    docs = write_corpus(str(root / "corpus"))
    out = str(root / "prepared")
    res = run_cli("data", "prepare", str(root / "corpus"), "--train-tokenizer", "320", "--out", out,
                  "--val-fraction", "0.2", "--workers", "2")
    assert res.returncode == 0, res.stderr[-2000:]
    return {"root": root, "docs": docs, "tok": out, "prepared": out}


def _documents(path):
    """Each split's documents as token lists, from the shards and their boundaries."""
    import numpy as np

    from meshrun.data.store import open_tokens

    corpus = open_tokens(path)
    out = {}
    for name, split in corpus.splits.items():
        tokens = np.asarray(split.window(0, len(split))) if len(split) else np.zeros(0, dtype=np.int64)
        bounds = list(split.doc_starts) + [len(split)]
        out[name] = [tokens[a:b].tolist() for a, b in zip(bounds, bounds[1:])]
    return corpus, out


def test_prepared_shards_decode_to_the_corpus(corpus):
    """Every document comes back exactly (non-ASCII included), each ends with the
    end-of-document token, the held-out ones are those the fraction picks by index, and the
    index's counts are the shards' own."""
    from meshrun.data.prepare import is_val
    from meshrun.data.store import read_index
    from meshrun.data.tokenizer import load_tokenizer

    tok = load_tokenizer(corpus["tok"])
    store, docs = _documents(corpus["prepared"])
    want = {"train": [], "val": []}
    for i, text in enumerate(d for d in corpus["docs"] if d):
        want["val" if is_val(i, 0.2) else "train"].append(text)
    for split in ("train", "val"):
        assert [tok.decode(d[:-1]) for d in docs[split]] == want[split]
        assert all(d[-1] == tok.eos_id for d in docs[split])
    index = read_index(corpus["prepared"])
    assert index["tokenizer"]["vocab_size"] == 320 and index["dtype"] == "uint16"
    for split in ("train", "val"):
        assert index["splits"][split]["documents"] == len(docs[split]) > 0
        assert index["splits"][split]["tokens"] == sum(map(len, docs[split])) == len(store.splits[split])
    assert index["documents"] == len(want["train"]) + len(want["val"]) == 12 + 20


def test_an_interrupted_prepare_resumes_to_the_same_files(tmp_path, corpus):
    """Killed (SIGKILL) after its first resumable point, run again: it says it resumes (with
    the tokenizer it trained before the kill, not a new one) and writes exactly the files an
    uninterrupted run writes, tokenizer.json included; at the kill no index existed and every
    complete shard on disk was one the progress file names."""
    root = str(tmp_path / "big")
    write_corpus(root, n_files=20, seed=1, n_records=3000)  # 12 chunks of 256 documents
    args = [root, "--train-tokenizer", "400", "--val-fraction", "0.1", "--workers", "1", "--shard-tokens", "5000"]
    whole = str(tmp_path / "whole")
    res = run_cli("data", "prepare", *args, "--out", whole)
    assert res.returncode == 0, res.stderr[-2000:]
    cut = str(tmp_path / "cut")
    proc = subprocess.Popen([sys.executable, "-m", "meshrun", "data", "prepare", *args, "--out", cut],
                            env=with_faults(clean_env(), prepare_pause=5), stderr=subprocess.PIPE, text=True)
    try:
        end = time.monotonic() + 120
        while not os.path.exists(os.path.join(cut, "progress.json")) and time.monotonic() < end:
            assert proc.poll() is None, proc.stderr.read()[-2000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.stderr.close()
    assert not os.path.exists(os.path.join(cut, "meshrun-data.json"))
    with open(os.path.join(cut, "progress.json")) as f:
        named = {e["file"] for s in json.load(f)["splits"].values() for e in s}
    assert named and {n.rsplit(".", 1)[0] for n in os.listdir(cut) if n.endswith(".tokens")} == named
    res = run_cli("data", "prepare", *args, "--out", cut)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "resuming" in res.stderr and "training a byte-level BPE" not in res.stderr, res.stderr[-2000:]
    files = sorted(os.listdir(whole))
    assert files == sorted(os.listdir(cut)) and len([f for f in files if f.endswith(".tokens")]) > 4
    for name in files:
        if name != "meshrun-data.json":
            with open(os.path.join(whole, name), "rb") as a, open(os.path.join(cut, name), "rb") as b:
                assert a.read() == b.read(), name
    res = run_cli("data", "prepare", *args, "--out", cut)
    assert res.returncode == 0 and "up to date" in res.stderr


def test_train_reads_prepared_flat_and_text_data(tmp_path, corpus):
    """`meshrun train --data` on the prepared directory (the GPT's vocabulary the tokenizer's,
    rounded up to 64), on nanoGPT's train.bin/val.bin, and on the text itself with --tokenizer
    (tokenized once into the cache: the second run finds it ready)."""
    import numpy as np

    from meshrun.config import TrainConfig, validate
    from meshrun.training.factories import build_model

    cfg = validate(TrainConfig(data=corpus["prepared"], model_size="gpt-tiny", seq_len=32))
    assert build_model(cfg).cfg.vocab == 320
    flat = tmp_path / "nano"
    flat.mkdir()
    rng = np.random.default_rng(0)
    for name, n in (("train.bin", 20000), ("val.bin", 2000)):
        rng.integers(0, 50000, n, dtype=np.uint16).tofile(flat / name)
    env = clean_env(MESHRUN_CACHE=str(tmp_path / "cache"))
    # one process: the formats are read alike at any world size (the ranks' split of a corpus is
    # the epoch tests' above, and the killed-and-resumed run's below)
    common = ["--model-size", "gpt-tiny", "--seq-len", "32", "--micro-batch", "4", "--steps", "3", "--log-every", "3",
              "--nproc", "1"]
    tok, root, cache = map(re.escape, (corpus["tok"], str(corpus["root"]), str(tmp_path / "cache")))
    # each run's first lines name its data: where it comes from, its tokens, the tokenizer and its vocabulary
    said = r"[\d.]+K? tokens for training, [\d.]+K? for validation; "
    for data, line in (
            ([corpus["prepared"]], rf"{root}/prepared \(prepared from 13 files in {root}/corpus\): {said}"
                                   rf"tokenizer {tok}\S* \(vocabulary 3\d\d\); document masking off"),
            ([str(flat / "train.bin")], rf"{re.escape(str(flat))}/train.bin \(token files\): 20K tokens for training, "
                                        r"2K for validation; no tokenizer recorded \(vocabulary 50,304\); "
                                        "document masking off"),
            ([str(corpus["root"] / "corpus"), "--tokenizer", corpus["tok"]],
             rf"{root}/corpus \(13 text files, tokenized into {cache}/tokens/[0-9a-f]{{20}}\): {said}"
             rf"tokenizer {tok}\S* \(vocabulary 3\d\d\); document masking off")):
        res = run_cli("train", "--data", *data, *common, env=env, timeout=300)
        assert res.returncode == 0, (data, res.stderr[-2000:])
        assert "val loss" in res.stdout, res.stdout[-1000:]
        first = [text for text in res.stdout.splitlines() if text.startswith("meshrun train: data ")]
        assert len(first) == 1 and re.fullmatch(f"meshrun train: data {line}", first[0]), first
    assert "meshrun data: wrote" in res.stderr
    res = run_cli("train", "--data", str(corpus["root"] / "corpus"), "--tokenizer", corpus["tok"], *common, env=env,
                  timeout=300)
    assert res.returncode == 0 and "up to date" in res.stderr, res.stderr[-2000:]


def test_saved_datasets_and_parquet_are_corpora_too(tmp_path, corpus):
    """A `datasets` save_to_disk directory (a DatasetDict: its train split) and a parquet file,
    each with its text in another column (--text-field), prepare to the same documents."""
    require("datasets")
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from meshrun.data.tokenizer import load_tokenizer

    texts = [d for d in corpus["docs"] if d][:15]
    saved = str(tmp_path / "saved")
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"body": texts, "n": list(range(15))}),
                          "test": datasets.Dataset.from_dict({"body": ["x"], "n": [0]})}).save_to_disk(saved)
    pq.write_table(pa.table({"body": texts, "n": list(range(15))}), str(tmp_path / "docs.parquet"))
    tok = load_tokenizer(corpus["tok"])
    for source in (saved, str(tmp_path / "docs.parquet")):
        out = str(tmp_path / ("p-" + os.path.basename(source)))
        res = run_cli("data", "prepare", source, "--tokenizer", corpus["tok"], "--out", out, "--text-field", "body",
                      "--val-fraction", "0")
        assert res.returncode == 0, res.stderr[-2000:]
        _, docs = _documents(out)
        assert [tok.decode(d[:-1]) for d in docs["train"]] == texts and not docs["val"]
        # a column of numbers is no text: one line, not a traceback from the tokenizer
        res = run_cli("data", "prepare", source, "--tokenizer", corpus["tok"], "--out", out + "-n", "--text-field", "n")
        assert res.returncode == 2 and res.stderr.count("\n") == 1, res.stderr[-2000:]
        assert "the 'n' column holds int64, not text" in res.stderr


def test_a_model_directorys_tokenizer_is_the_default_for_text(tmp_path, corpus):
    """`meshrun train --model DIR --data TEXT` tokenizes with the model directory's own
    tokenizer.json."""
    require("transformers")
    import shutil

    import transformers

    model = tmp_path / "model"
    transformers.LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1).save_pretrained(str(model))
    shutil.copy(os.path.join(corpus["tok"], "tokenizer.json"), model / "tokenizer.json")
    res = run_cli("train", "--model", str(model), "--data", str(corpus["root"] / "corpus"), "--seq-len", "16",
                  "--micro-batch", "2", "--steps", "2", "--log-every", "2",
                  env=clean_env(MESHRUN_CACHE=str(tmp_path / "cache")), timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"tokenizer {model}/tokenizer.json" in res.stderr and "val loss" in res.stdout


def test_a_tiktoken_encoding_not_in_the_cache_is_one_line(tmp_path, corpus):
    require("tiktoken")
    res = run_cli("data", "prepare", str(corpus["root"] / "corpus"), "--tokenizer", "gpt2", "--out",
                  str(tmp_path / "o"), env=clean_env(TIKTOKEN_CACHE_DIR=str(tmp_path / "empty-cache")), timeout=60)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    last = res.stderr.strip().splitlines()[-1]
    assert "tiktoken's file for it is not in its cache and meshrun never downloads" in last


def _tokenizer_file(path):
    return os.path.join(path, "tokenizer.json")


def test_a_trained_tokenizer_is_recorded_and_the_same_on_every_run(tmp_path, corpus):
    """--train-tokenizer 320: OUT/tokenizer.json is the tokenizer the index names (its path and
    hash), of the 320 tokens asked; trained again in this process with one worker it is the
    same file, byte for byte, as the fixture's (another process, two workers), and so are the
    shards."""
    import hashlib

    from tokenizers import Tokenizer

    from meshrun.data.store import read_index

    path = _tokenizer_file(corpus["prepared"])
    with open(path, "rb") as f:
        data = f.read()
    recorded = read_index(corpus["prepared"])["tokenizer"]
    assert recorded["name"] == path and recorded["sha256"] == hashlib.sha256(data).hexdigest()
    assert recorded["vocab_size"] == Tokenizer.from_file(path).get_vocab_size() == 320
    again = str(tmp_path / "again")
    res = meshrun_here("data", "prepare", str(corpus["root"] / "corpus"), "--train-tokenizer", "320", "--out", again,
                       "--val-fraction", "0.2", "--workers", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"meshrun data: trained a byte-level BPE of 320 tokens: {_tokenizer_file(again)}" in res.stderr
    names = sorted(os.listdir(corpus["prepared"]))
    assert names == sorted(os.listdir(again)) and "tokenizer.json" in names
    for name in names:
        if name != "meshrun-data.json":  # (it names its own directory)
            with open(os.path.join(corpus["prepared"], name), "rb") as a, open(os.path.join(again, name), "rb") as b:
                assert a.read() == b.read(), name


def _repeated_pairs(path, docs):
    """How many times each pair of adjacent tokens occurs inside the words of ``docs`` (the
    pieces the tokenizer's pre-tokenizer cuts), as the tokenizer at ``path`` splits them: the
    counts a BPE trainer merges by."""
    from collections import Counter

    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(path)
    pairs = Counter()
    for doc in docs:
        for word, _ in tok.pre_tokenizer.pre_tokenize_str(doc):
            ids = [t.id for t in tok.model.tokenize(word)]
            pairs.update(zip(ids, ids[1:]))
    return max(pairs.values())


def test_a_trained_vocabulary_is_smaller_only_when_no_pair_repeats(tmp_path, corpus):
    """Asked for more tokens than the corpus has repeated pairs for, training stops when no pair
    of tokens occurs twice inside the corpus' words: the line says so, and the index records
    the size reached. Of the 320 tokens asked, where it stopped at the size, pairs still repeat."""
    from meshrun.data.store import read_index

    out = str(tmp_path / "big-vocab")
    res = meshrun_here("data", "prepare", str(corpus["root"] / "corpus"), "--train-tokenizer", "4000", "--out", out,
                       "--workers", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    size = read_index(out)["tokenizer"]["vocab_size"]
    assert 320 < size < 4000, size
    assert (f"meshrun data: trained a byte-level BPE of {size:,} tokens (fewer than the 4,000 asked: no pair of tokens "
            f"is left that the corpus holds at least 2 times): {_tokenizer_file(out)}") in res.stderr
    assert _repeated_pairs(_tokenizer_file(out), corpus["docs"]) == 1
    assert _repeated_pairs(_tokenizer_file(corpus["prepared"]), corpus["docs"]) >= 2


def test_training_a_tokenizer_without_the_library_is_one_line(tmp_path, monkeypatch):
    # Python's own way to make a module absent: None in sys.modules (find_spec then finds nothing)
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    (tmp_path / "a.txt").write_text("some text\n")
    res = meshrun_here("data", "prepare", str(tmp_path / "a.txt"), "--train-tokenizer", "300", "--out",
                       str(tmp_path / "o"))
    assert res.returncode == 2 and res.stderr.strip().splitlines() == [
        "meshrun: error: --train-tokenizer=300: training a tokenizer needs the tokenizers library, not installed here "
        "(hint: pip install 'meshrun[data]')"]
    assert not (tmp_path / "o").exists()


SOURCES = {"README.txt": "a corpus of source files\n", "a.py": "def a():\n    return 1\n",
           "pkg/b.py": "import a\n\nprint(a.a() + 2)\n", "pkg/c.py": "class C:\n    x = 'naïve café'\n",
           "lib.c": "int main(void) { return 0; }\n", "notes.rst": "Notes\n=====\n", "Makefile": "all:\n\ttrue\n"}


def _write_sources(root):
    """SOURCES, and four compiled files (binary: the commonest extension, never suggested)."""
    for name, text in SOURCES.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
    (root / "__pycache__").mkdir()
    for i in range(4):
        (root / "__pycache__" / f"m{i}.pyc").write_bytes(b"\xa7\r\r\n\0\0\0\0" + bytes(range(256)))


def test_a_directory_says_what_it_skipped_and_ext_reads_it(tmp_path, corpus):
    """A directory of mixed files: the line beside the summary counts the files not read by
    extension, most first, and names the --ext that reads the commonest one of text (not the
    binary .pyc); with --ext (repeated,
    with or without its dot) those files are documents too, each its tokens and the
    end-of-document token; the same choice as a comma list finds the corpus up to date, and a
    changed choice prepares it again."""
    from meshrun.data.store import read_index
    from meshrun.data.tokenizer import load_tokenizer

    _write_sources(tmp_path / "src")
    tok = load_tokenizer(corpus["tok"])
    out = str(tmp_path / "out")
    common = [str(tmp_path / "src"), "--tokenizer", corpus["tok"], "--out", out, "--workers", "1",
              "--val-fraction", "0"]

    def tokens(*names):
        return sum(len(ids) + 1 for ids in tok.encode_batch([SOURCES[n] for n in names]))

    res = meshrun_here("data", "prepare", *common)
    assert res.returncode == 0, res.stderr
    assert res.stderr.splitlines()[-2].startswith(f"meshrun data: wrote {out} (")
    assert res.stderr.splitlines()[-1] == ("meshrun data: skipped 10 files: .pyc 4, .py 3, .c 1, .rst 1, "
                                           "no extension 1 (hint: --ext .py reads .py files as text too, one "
                                           "document each)")
    index = read_index(out)
    assert index["documents"] == 1 and index["splits"]["train"]["tokens"] == tokens("README.txt")

    res = meshrun_here("data", "prepare", *common, "--ext", "py", "--ext", ".c")
    assert res.returncode == 0 and f"meshrun data: wrote {out} (" in res.stderr, res.stderr
    assert res.stderr.splitlines()[-1] == ("meshrun data: skipped 6 files: .pyc 4, .rst 1, no extension 1 "
                                           "(hint: --ext .rst reads .rst files as text too, one document each)")
    index = read_index(out)
    assert index["documents"] == 5 and index["identity"]["extensions"] == [".c", ".py"]
    assert index["splits"]["train"]["tokens"] == tokens("README.txt", "a.py", "pkg/b.py", "pkg/c.py", "lib.c")
    res = meshrun_here("data", "prepare", *common, "--ext", ".c, py")
    assert res.returncode == 0 and f"meshrun data: {out} is up to date" in res.stderr, res.stderr
    res = meshrun_here("data", "prepare", *common, "--ext", "py")
    assert res.returncode == 0 and read_index(out)["documents"] == 4, res.stderr


def test_a_file_of_a_directory_that_is_not_utf8_is_left_out_and_said(tmp_path, corpus):
    """A source tree holds a few files in older encodings (CPython's own tests do): in a
    directory each is left out and named on a line of its own, in the index too, and the rest is
    prepared; said again when the corpus is up to date. A file named alone stays an error."""
    from meshrun.data.store import read_index
    from meshrun.data.tokenizer import load_tokenizer

    src = tmp_path / "src"
    src.mkdir()
    (src / "a.py").write_text("def a():\n    return 1\n")
    (src / "b.py").write_text("print('b')\n" * 3)
    (src / "latin.py").write_bytes("# -*- coding: latin-1 -*-\nname = 'caf\u00e9'\n".encode("latin-1"))
    out = str(tmp_path / "out")
    args = [str(src), "--ext", ".py", "--tokenizer", corpus["tok"], "--out", out, "--workers", "1",
            "--val-fraction", "0"]
    left = (f"meshrun data: left out 1 file that is not UTF-8 text: {src / 'latin.py'} "
            "(hint: convert it to train on it, e.g. with iconv -t utf-8)")
    for said in ("wrote", "is up to date"):
        res = meshrun_here("data", "prepare", *args)
        assert res.returncode == 0, res.stderr
        assert said in res.stderr.splitlines()[-2] and res.stderr.splitlines()[-1] == left, res.stderr
    index = read_index(out)
    tok = load_tokenizer(corpus["tok"])
    expected = sum(len(ids) + 1 for ids in tok.encode_batch([(src / n).read_text() for n in ("a.py", "b.py")]))
    assert index["documents"] == 2 and index["splits"]["train"]["tokens"] == expected
    assert index["not_utf8"] == {"files": 1, "first": [str(src / "latin.py")]}
    alone = meshrun_here("data", "prepare", str(src / "latin.py"), "--ext", ".py", "--tokenizer", corpus["tok"],
                         "--out", str(tmp_path / "alone"))
    assert alone.returncode == 2 and alone.stderr.strip() == (
        f"meshrun: error: {src / 'latin.py'}: not UTF-8 text at byte 37 (hint: convert it, e.g. iconv -t utf-8)")


def test_the_skipped_line_names_the_commonest_extensions_and_sums_the_rest(tmp_path):
    """A directory's files not read, by extension: most first (alike counts by name), the six
    commonest named and the rest summed; of those six, the ones whose first file reads as text
    are the hint's candidates (two FIFOs among them are looked at without being opened)."""
    from meshrun.data.sources import find_source, skipped_summary

    (tmp_path / "doc.txt").write_text("text\n")
    counts = {".b": 3, ".a": 3, ".c": 5, ".d": 1, ".e": 2, ".f": 4, ".g": 1, ".h": 1}
    for ext, n in counts.items():
        for i in range(n):
            (tmp_path / f"f{i}{ext}").write_text("x")
    for i in range(2):
        os.mkfifo(tmp_path / f"p{i}.fifo")
    source = find_source(str(tmp_path))
    assert source.paths == (str(tmp_path / "doc.txt"),)
    assert source.skipped == ((".c", 5), (".f", 4), (".a", 3), (".b", 3), (".e", 2), (".fifo", 2), (".d", 1),
                              (".g", 1), (".h", 1))
    assert source.skipped_text == (".c", ".f", ".a", ".b", ".e")
    assert skipped_summary(source.skipped) == ("22 files: .c 5, .f 4, .a 3, .b 3, .e 2, .fifo 2, "
                                               "3 more of 3 other extensions")


def test_text_given_to_train_is_cached_by_the_extensions_it_reads(tmp_path, corpus):
    """`meshrun train --data DIR --ext .py` reads through the cache as `data prepare` does: the
    .py files are documents, in a cache directory of their own (not the one without --ext),
    found ready the next time; the config then points at the tokens, --ext spent."""
    from meshrun.config import TrainConfig, validate
    from meshrun.data.store import read_index
    from meshrun.job import corpus_ready

    _write_sources(tmp_path / "src")
    env = {"MESHRUN_CACHE": str(tmp_path / "cache")}
    plain = TrainConfig(data=str(tmp_path / "src"), tokenizer=corpus["tok"], model_size="gpt-tiny", seq_len=8)
    with_py = validate(plain.replace(ext="py"))
    first = corpus_ready(validate(plain), env, 1)
    second = corpus_ready(with_py, env, 1)
    assert first.data != second.data and second.ext is None
    assert read_index(first.data)["documents"] == 1 and read_index(second.data)["documents"] == 4
    assert corpus_ready(with_py, env, 1).data == second.data
    assert sorted(os.listdir(tmp_path / "cache" / "tokens")) == sorted(
        os.path.basename(c.data) for c in (first, second))


# ---- packing with document masks ---------------------------------------------------------------

def _packed_against_alone(prepared: str, model_kind: str, flex: bool) -> tuple[float, float]:
    """(sum of token losses of a packed sequence under the document mask, the sum of each of
    its documents' losses computed alone): a sequence starting at a document's beginning.
    ``flex``: the mask is FlexAttention's block mask, as on a GPU, else the dense one."""
    import torch
    import torch.nn.functional as F

    from meshrun.data.store import open_tokens
    from meshrun.training.loader import PackedTokens

    torch.manual_seed(0)
    split = open_tokens(prepared).splits["train"]
    starts = [int(s) for s in split.doc_starts]
    assert starts[0] == 0  # sample 0 begins with a document
    seq = starts[4] - 3  # four documents, the last one cut short
    x, y, pos = PackedTokens(split, seq, document_mask=True)[0]
    if model_kind == "gpt":
        from meshrun.training.models.gpt import gpt

        model = gpt("gpt-tiny", seq_len=seq + 1, vocab=320, head_loss=False, fused_mlp=False).eval()

        def logits(ids, positions=None):
            return model(ids[None], positions=None if positions is None else positions[None])
    else:
        import transformers

        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attn_implementation="sdpa")).eval()
        if flex:  # as meshrun sets it on a GPU
            from meshrun.training.models.masks import use_flex_in_transformers

            use_flex_in_transformers(model)
            assert model.config._attn_implementation == "meshrun_flex"

        def logits(ids, positions=None):
            return model(input_ids=ids[None], position_ids=None if positions is None else positions[None],
                         use_cache=False).logits  # (with a cache transformers does not read packed documents)
    with torch.no_grad():
        out = logits(x, pos)[0]
        packed_sum = F.cross_entropy(out.float(), y, ignore_index=-100, reduction="sum").item()
        alone = 0.0
        bounds = [s for s in starts if s < seq] + [seq + 1]
        for a, b in zip(bounds, bounds[1:]):
            doc = torch.from_numpy(split.window(a, b - a).astype("int64"))
            out = logits(doc[:-1])[0]
            alone += F.cross_entropy(out.float(), doc[1:], reduction="sum").item()
    return packed_sum, alone


@pytest.mark.parametrize("flex", [False, True], ids=["dense", "flex"])
@pytest.mark.parametrize("model_kind", ["gpt", "llama"])
def test_a_packed_sequence_scores_as_its_documents_alone(corpus, model_kind, flex, monkeypatch):
    """Under --document-mask a packed sequence's loss (summed over tokens) is the sum of its
    documents' losses computed one document at a time (meshrun's GPT: its mask; a Hugging
    Face Llama: transformers' own from the restarting position ids), with the dense mask of
    the CPU and FlexAttention's block mask of a GPU (its forward, which runs on the CPU)."""
    if model_kind == "llama":
        require("transformers")
    from meshrun.training.models import masks

    monkeypatch.setattr(masks, "uses_flex", lambda device: flex)
    packed, alone = _packed_against_alone(corpus["prepared"], model_kind, flex)
    assert packed == pytest.approx(alone, rel=1e-5)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_block_masks_attend_as_the_dense_masks(kv_heads, monkeypatch):
    """FlexAttention under the block mask gives the dense mask's attention: whole sequences,
    and the two zig-zag chunks of a context-parallel rank (its queries at their true positions
    against the keys before them), with as many key heads as query heads and with fewer."""
    import torch

    from meshrun.training.models import masks

    torch.manual_seed(0)
    t = 64
    positions = torch.stack([torch.cat([torch.arange(n) for n in lengths])
                             for lengths in ([20, 1, 30, 13], [64], [5, 59])])
    docs = masks.document_ids(positions)
    q = torch.randn(3, 4, t, 16)
    k, v = torch.randn(3, kv_heads, t, 16), torch.randn(3, kv_heads, t, 16)
    for start, length, end in [(0, t, t), (0, 16, 16), (48, 16, 64), (16, 16, 32)]:
        queries = q[:, :, start:start + length]
        dense = masks.attend(queries, k[:, :, :end], v[:, :, :end], masks.build(docs, start, length, end))
        monkeypatch.setattr(masks, "uses_flex", lambda device: True)
        mask = masks.build(docs, start, length, end)
        monkeypatch.undo()
        assert not isinstance(mask, torch.Tensor)  # a BlockMask
        flex = masks.attend(queries, k[:, :, :end], v[:, :, :end], mask)
        torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-6)
    # a document of one token sees itself alone
    one = masks.build(docs)[0, 0]
    assert one[20].tolist() == [j == 20 for j in range(t)]


def test_document_positions_and_targets():
    """Positions restart at each document's first token, and at the sequence's start (a
    document begun earlier: its true position could pass the model's context); the target of a
    document's last token (the next document's first) is ignored."""
    import numpy as np

    from meshrun.data.store import TokenSplit
    from meshrun.training.loader import PackedTokens

    tokens = np.arange(100, 120, dtype=np.uint16)
    split = TokenSplit([tokens[:7], tokens[7:]], np.array([0, 3, 9, 10, 16]))
    x, y, pos = PackedTokens(split, 8, document_mask=True)[1]  # tokens 8..16, documents start at 9, 10, 16
    assert x.tolist() == list(range(108, 116))
    assert pos.tolist() == [0, 0, 0, 1, 2, 3, 4, 5]  # token 8 continues the document begun at 3
    assert y.tolist() == [-100, -100, 111, 112, 113, 114, 115, -100]


# ---- sampling ------------------------------------------------------------------------------------

def _sample_ids(prepared, out, overrides, record):
    """Train with a dataset that writes each sample id it serves to ``record``.<rank>."""
    import torch.distributed as dist

    from meshrun.config import TrainConfig
    from meshrun.training.loader import corpus_splits
    from meshrun.training.trainer import Trainer

    train, val = corpus_splits(prepared, 8, False, vocab=320)

    class Recorded(type(train)):
        def __getitem__(self, i):
            with open(f"{record}.{dist.get_rank()}", "a") as f:
                f.write(f"{i}\n")
            return super().__getitem__(i)

    data = Recorded(train.split, 8)
    cfg = TrainConfig(model_size="gpt-tiny", seq_len=8, steps=8, log_every=1, precision="fp32", out=out,
                      save_every=4, strategy="ddp", **overrides)
    from meshrun.training.models.gpt import gpt

    Trainer(gpt("gpt-tiny", seq_len=8, vocab=320), data, None, cfg).fit()


def _steps(record, world, per_rank, steps):
    """step -> the set of sample ids the ranks read in it."""
    ids = [open(f"{record}.{r}").read().split() for r in range(world)]
    return {s: {int(i) for r in ids for i in r[(s - steps[0]) * per_rank:(s - steps[0] + 1) * per_rank]}
            for s in steps}


def test_a_resumed_run_reads_the_same_global_samples_on_any_world_size(tmp_path, corpus):
    """A global batch of 12 samples: 8 steps on 2 ranks, snapshots every 4; resumed from step 4
    on 1 rank and on 3 ranks, steps 5-8 read exactly the samples the 2-rank run read; within a
    step the ranks' samples are disjoint."""
    base = str(tmp_path / "two")
    meshrun.run(_sample_ids, corpus["prepared"], base, {"micro_batch": 6}, str(tmp_path / "ids2"), nproc=2,
                timeout_s=300)
    want = _steps(str(tmp_path / "ids2"), 2, 6, range(1, 9))
    assert all(len(v) == 12 for v in want.values())
    snapshot = os.path.join(base, "checkpoints", "step-00000004")
    for nproc, micro in ((1, 12), (3, 4)):
        record = str(tmp_path / f"ids{nproc}")
        meshrun.run(_sample_ids, corpus["prepared"], str(tmp_path / f"out{nproc}"),
                    {"micro_batch": micro, "resume": snapshot}, record, nproc=nproc, timeout_s=300)
        got = _steps(record, nproc, micro, range(5, 9))
        assert got == {s: want[s] for s in range(5, 9)}, nproc


def _epoch_ids(prepared, overrides, record, steps):
    """As _sample_ids, without snapshots, over ``steps`` steps: also each rank's model-parallel
    coordinates are in its file name."""
    import torch.distributed as dist

    from meshrun.config import TrainConfig
    from meshrun.training.loader import corpus_splits
    from meshrun.training.models.gpt import gpt
    from meshrun.training.trainer import Trainer

    train, _ = corpus_splits(prepared, 8, False, vocab=320)

    class Recorded(type(train)):
        def __getitem__(self, i):
            with open(f"{record}.{dist.get_rank()}", "a") as f:
                f.write(f"{i}\n")
            return super().__getitem__(i)

    cfg = TrainConfig(model_size="gpt-tiny", seq_len=8, steps=steps, log_every=steps, precision="fp32", **overrides)
    Trainer(gpt("gpt-tiny", seq_len=8, vocab=320), Recorded(train.split, 8), None, cfg).fit()


def test_ranks_split_an_epoch_and_model_parallel_ranks_share_samples(tmp_path, corpus):
    """Over one epoch two data-parallel ranks read disjoint samples whose union is every
    sample of the epoch (the last partial global batch left out); the two tensor-parallel ranks
    of one replica read the very same samples."""
    from meshrun.training.loader import corpus_splits

    record = str(tmp_path / "dp")
    n = len(corpus_splits(corpus["prepared"], 8, False)[0])
    steps = n // 8
    meshrun.run(_epoch_ids, corpus["prepared"], {"micro_batch": 4, "strategy": "ddp"}, record, steps, nproc=2,
                timeout_s=300)
    ranks = [[int(i) for i in open(f"{record}.{r}").read().split()] for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == steps * 4
    assert not set(ranks[0]) & set(ranks[1]) and len(set(ranks[0]) | set(ranks[1])) == steps * 8 == n - n % 8
    record = str(tmp_path / "tp")
    meshrun.run(_epoch_ids, corpus["prepared"], {"micro_batch": 4, "strategy": "fsdp-full", "tp": 2}, record, 3,
                nproc=2, timeout_s=300)
    assert open(record + ".0").read() == open(record + ".1").read() != ""


def test_killed_and_resumed_training_on_a_corpus_is_bit_for_bit(tmp_path, corpus):
    """2 processes, 40 steps, a snapshot every 10; a worker SIGKILLed after step 22 restarts the
    job, which resumes from step 20: every loss from there is the uninterrupted run's."""
    from test_checkpoint import kill_when, losses, reached

    job = ["--data", corpus["prepared"], "--model-size", "gpt-tiny", "--seq-len", "16", "--micro-batch", "2",
           "--steps", "40", "--save-every", "10", "--log-every", "1", "--deterministic", "--eval-every", "0"]
    whole = str(tmp_path / "whole")
    res = run_cli("train", *job, "--out", whole, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    out = str(tmp_path / "killed")
    watcher, killed = kill_when(reached(out, 22), out)
    res = run_cli("train", *job, "--out", out, "--max-restarts", "1", timeout=600)
    watcher.join(timeout=1)
    assert killed and res.returncode == 0, res.stderr[-2000:]
    assert "at step 20" in res.stdout
    want, got = losses(whole), losses(out)
    assert sorted(got) == list(range(1, 41))
    for step in range(21, 41):
        assert got[step] == want[step], step


# ---- bad input, one line each ----------------------------------------------------------------------

def _bad(tmp_path, corpus):
    import numpy as np

    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    big = tmp_path / "big"
    big.mkdir()
    np.array([5, 70000 % 65536, 60000], dtype=np.uint16).repeat(200).tofile(big / "train.bin")
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    tiny = tmp_path / "tiny"
    tiny.mkdir()
    np.arange(40, dtype=np.uint16).tofile(tiny / "train.bin")
    nofield = tmp_path / "nofield.jsonl"
    nofield.write_text(json.dumps({"body": "x"}) + "\n")
    small_model = tmp_path / "small"
    import transformers

    transformers.LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                             num_attention_heads=2).save_pretrained(str(small_model))
    gpt = ["--model-size", "gpt-tiny", "--seq-len", "16", "--micro-batch", "4"]
    return [
        (["train", "--data", str(odd), *gpt], "3 bytes, not a whole number of uint16 tokens"),
        (["train", "--data", str(big / "train.bin"), *gpt], "token id 60000 at token 400 of"),
        (["train", "--data", str(empty), "--tokenizer", corpus["tok"], *gpt], "an empty corpus"),
        (["train", "--data", str(tiny / "train.bin"), *gpt, "--global-batch", "8"],
         "fewer than one global batch of 8"),
        (["train", "--data", corpus["prepared"], "--model", str(small_model), "--seq-len", "16"],
         "has 320 tokens, more than the model's vocabulary of 100"),
        (["train", "--data", str(nofield), "--tokenizer", corpus["tok"], *gpt], "no 'text' field (it has body)"),
        (["data", "prepare", str(nofield), "--tokenizer", corpus["tok"], "--out", str(tmp_path / "o")],
         "no 'text' field (it has body)"),
        (["data", "prepare", str(empty), "--tokenizer", str(tmp_path), "--out", str(tmp_path / "o2")],
         "a directory without tokenizer.json"),
        (["train", "--data", str(tmp_path / "missing"), *gpt], "no such file or directory, and not module:factory"),
        (["train", "--data", str(corpus["root"] / "corpus"), *gpt], "text needs a tokenizer"),
        (["train", "--data", str(tiny / "train.bin"), "--document-mask", *gpt], "records no document boundaries"),
    ]


def test_bad_data_is_one_line_each(tmp_path, corpus):
    require("transformers")
    env = clean_env(MESHRUN_CACHE=str(tmp_path / "cache"))
    for args, said in _bad(tmp_path, corpus):
        res = run_cli(*args, "--steps", "1", env=env, timeout=300) if args[0] == "train" else run_cli(*args, env=env)
        last = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ""
        assert res.returncode == 2 and last.startswith("meshrun: error: ") and said in last, (args, res.stderr[-1500:])
        assert "Traceback" not in res.stderr, res.stderr[-1500:]


def test_prepare_progress_moves_without_a_terminal(capsys, monkeypatch):
    """Without a terminal, `data prepare` prints a line every few seconds (not one stale line
    at the first chunk): what is done of the corpus, the rates and the time left."""
    from meshrun.data import prepare as prep

    now = [0.0]
    monkeypatch.setattr(prep.time, "monotonic", lambda: now[0])
    progress = prep._Progress(4 * 2**20, enabled=True)  # pytest's stderr is no terminal
    for at in (1.0, 6.0, 13.0):  # 1 s in: too soon for a line; 6 s in: a line; 13 s in: another
        now[0] = at
        progress.update(2**20, 1000, 10)
    lines = [line for line in capsys.readouterr().err.splitlines() if line]
    assert lines == [
        "meshrun data: 2.0 of 4.0 MiB (50%), 2,000 tokens, 0.3 MiB/s, 333 tokens/s, elapsed 0:06, left 0:06",
        "meshrun data: 3.0 of 4.0 MiB (75%), 3,000 tokens, 0.2 MiB/s, 231 tokens/s, elapsed 0:13, left 0:04",
    ]
