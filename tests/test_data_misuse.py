"""Misuse of `meshrun data prepare` and of the data it writes: two preparations of one
directory at once, a prepared corpus altered after the fact (its document tables, its index,
its shards, token ids past the vocabulary where a sample does not look), a corpus of one
document, and an output that is a file, read-only or full, an input that is not UTF-8 or is
deleted while it is read. Real processes; each refusal is exit code 2 and one line."""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import clean_env, meshrun_here, require, with_faults
from helpers import meshrun as run_cli
from test_data import train_tokenizer, write_corpus

pytestmark = pytest.mark.framework
GPT = ["--model-size", "gpt-tiny", "--seq-len", "16", "--micro-batch", "2", "--nproc", "1", "--steps", "1",
       "--log-every", "1"]
AGAIN = "(hint: run meshrun data prepare again)"


def error_line(res: subprocess.CompletedProcess) -> str:
    """The refusal: exit 2, no traceback, the last stderr line an error; returns that line."""
    assert res.returncode == 2, (res.returncode, res.stderr[-3000:])
    assert "Traceback" not in res.stderr, res.stderr[-3000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("meshrun: error: "), res.stderr[-3000:]
    return last


def no_temporary_files(out: str) -> bool:
    return not any(n.endswith(".tmp") for n in os.listdir(out))


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A small corpus, a tokenizer trained on it, and the corpus prepared (one chunk: one
    shard per split)."""
    require("tokenizers")
    root = tmp_path_factory.mktemp("misuse")
    corpus = str(root / "corpus")
    write_corpus(corpus, n_files=6, n_records=40)
    tok = train_tokenizer(corpus, str(root / "tok"))
    out = str(root / "prepared")
    res = run_cli("data", "prepare", corpus, "--tokenizer", tok, "--out", out, "--val-fraction", "0.2",
                  "--workers", "1")
    assert res.returncode == 0, res.stderr[-2000:]
    return {"root": root, "corpus": corpus, "tok": tok, "prepared": out}


def _two_chunk_corpus(root: str) -> str:
    """A corpus read in two chunks: a.jsonl's 300 documents (256 a chunk), then b.txt."""
    os.makedirs(root)
    with open(os.path.join(root, "a.jsonl"), "w") as f:
        for i in range(300):
            f.write(json.dumps({"text": f"the quick brown fox {i} jumps over the lazy dog"}) + "\n")
    with open(os.path.join(root, "b.txt"), "w") as f:
        f.write("the last document\n")
    return root


def _start_paused(corpus: str, tok: str, out: str) -> subprocess.Popen:
    """A preparation that pauses 3 s after each chunk (a complete shard each), once it has paused."""
    proc = subprocess.Popen([sys.executable, "-m", "meshrun", "data", "prepare", corpus, "--tokenizer", tok, "--out",
                             out, "--workers", "1", "--shard-tokens", "1"],
                            env=with_faults(clean_env(), prepare_pause=3), stderr=subprocess.PIPE, text=True)
    end = time.monotonic() + 60
    while not os.path.exists(os.path.join(out, "progress.json")):
        if proc.poll() is not None or time.monotonic() > end:
            proc.kill()
            pytest.fail(f"the first preparation did not reach its pause: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)
    return proc


def test_a_second_prepare_of_one_directory_is_refused_naming_the_first(tmp_path, made):
    """While one preparation writes OUT, another on OUT (here through a symlink to it) is
    refused in one line naming the first's pid and the directory; the first completes."""
    corpus = _two_chunk_corpus(str(tmp_path / "corpus"))
    out = str(tmp_path / "out")
    os.symlink(out, str(tmp_path / "link"))
    first = _start_paused(corpus, made["tok"], out)
    try:
        second = run_cli("data", "prepare", corpus, "--tokenizer", made["tok"], "--out", str(tmp_path / "link"),
                         "--workers", "1", timeout=60)
        still_running = first.poll() is None
        _, stderr = first.communicate(timeout=60)
    finally:
        if first.poll() is None:
            first.kill()
    line = error_line(second)
    assert still_running, "the first preparation ended before the second was refused"
    assert f"pid {first.pid}" in line and repr(os.path.realpath(out)) in line and "another meshrun data prepare" \
        in line, line
    assert first.returncode == 0, stderr[-2000:]
    res = run_cli("data", "prepare", corpus, "--tokenizer", made["tok"], "--out", out, "--workers", "1",
                  "--shard-tokens", "1")
    assert res.returncode == 0 and "up to date" in res.stderr, res.stderr[-2000:]


def _set_doc(value: int):
    def change(out: str) -> None:
        path = os.path.join(out, "train-00000.docs")
        docs = np.fromfile(path, dtype="<i8")
        docs[3] = value
        docs.tofile(path)
    return change


def _cut(name: str, nbytes: int):
    def change(out: str) -> None:
        path = os.path.join(out, name)
        with open(path, "rb") as f:
            data = f.read()
        with open(path, "wb") as f:
            f.write(data[:-nbytes])
    return change


def _edit_index(edit):
    def change(out: str) -> None:
        path = os.path.join(out, "meshrun-data.json")
        with open(path) as f:
            index = json.load(f)
        with open(path, "w") as f:
            json.dump(edit(index), f)
    return change


def _shard_field(index, key, value):
    index["splits"]["train"]["shards"][0][key] = value
    return index


def _big_shard_with_an_id_past_the_vocabulary(out: str) -> None:
    """The training shard replaced by 2 Mi valid tokens (the index made to match) with one id
    of 40000 at token 65613: between the blocks a sampled check reads."""
    n = 1 << 21
    tokens = np.random.default_rng(0).integers(1, 320, n, dtype=np.uint16)
    tokens[65536 + 77] = 40000
    docs = np.arange(0, n, 1000, dtype="<i8")
    tokens.astype("<u2").tofile(os.path.join(out, "train-00000.tokens"))
    docs.tofile(os.path.join(out, "train-00000.docs"))

    def edit(index):
        index["splits"]["train"] = {"shards": [{"file": "train-00000", "tokens": n, "documents": len(docs),
                                                "max_id": 319}], "tokens": n, "documents": len(docs)}
        return index
    _edit_index(edit)(out)


CORRUPTIONS = {
    "a document start of 1e12": (_set_doc(10**12), "train-00000.docs: document 3 starts at token 1000000000000"),
    "a document start of -5": (_set_doc(-5), "train-00000.docs: document 3 starts at token -5"),
    "a truncated .docs": (_cut("train-00000.docs", 12), "train-00000.docs: "),
    "a missing .docs": (lambda out: os.remove(os.path.join(out, "val-00000.docs")), "val-00000.docs is missing"),
    "a truncated .tokens": (_cut("train-00000.tokens", 4), "train-00000.tokens: "),
    "an index that is a list": (_edit_index(lambda index: [index]), "meshrun-data.json: a JSON list"),
    "a count of the wrong type": (_edit_index(lambda index: _shard_field(index, "tokens", "12")),
                                  "meshrun-data.json: split 'train': shard train-00000"),
    "splits of the wrong type": (_edit_index(lambda index: {**index, "splits": ["train"]}),
                                 "meshrun-data.json: its splits are not an object"),
    "a token id past the vocabulary, unsampled": (_big_shard_with_an_id_past_the_vocabulary,
                                                  "token id 40000 at token 65613 of "),
}


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_altered_prepared_data_is_refused_before_training_in_one_line(tmp_path, made, case):
    """`meshrun train --data` on a prepared directory altered after the fact: refused before
    any rank starts, in one line naming the file and what is wrong, with the hint to prepare
    it again; `meshrun data prepare` again as the hint says rewrites it (it is not "up to date")."""
    change, said = CORRUPTIONS[case]
    out = str(tmp_path / "prepared")
    shutil.copytree(made["prepared"], out)
    change(out)
    line = error_line(run_cli("train", "--data", out, *GPT, timeout=120))
    assert said in line and line.endswith(")") and "run meshrun data prepare again" in line, line
    assert not os.path.isdir(os.path.join(out, "logs")), "ranks were started"
    if f"remove {out} and" in line:  # (altered where only reading every token tells)
        shutil.rmtree(out)
    res = run_cli("data", "prepare", made["corpus"], "--tokenizer", made["tok"], "--out", out, "--val-fraction", "0.2",
                  "--workers", "1")
    assert res.returncode == 0 and "meshrun data: wrote" in res.stderr, res.stderr[-2000:]


def test_a_corpus_of_one_document_trains_without_validation(tmp_path, made):
    """One document: no validation split (said in one line), the document is the training
    split; `meshrun train` on it as text (tokenized into the cache) trains."""
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(os.path.join(made["corpus"], "doc000.txt"), one / "doc000.txt")
    res = run_cli("data", "prepare", str(one), "--tokenizer", made["tok"], "--out", str(tmp_path / "out"))
    assert res.returncode == 0, res.stderr[-2000:]
    assert "meshrun data: 1 document: no validation split (validation needs at least 2 documents)" in res.stderr
    with open(tmp_path / "out" / "meshrun-data.json") as f:
        splits = json.load(f)["splits"]
    assert splits["train"]["documents"] == 1 and splits["val"]["documents"] == 0
    res = run_cli("train", "--data", str(one), "--tokenizer", made["tok"], *GPT,
                  env=clean_env(MESHRUN_CACHE=str(tmp_path / "cache")), timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "no validation split" in res.stderr and "step 1" in res.stdout, res.stdout[-1000:]


def test_an_output_that_is_a_file_or_read_only_is_one_line(tmp_path, made):
    """--out onto a regular file, or onto a directory that cannot be written (a read-only
    mount as root, a mode-0555 directory otherwise)."""
    afile = tmp_path / "afile"
    afile.write_text("x")
    line = error_line(run_cli("data", "prepare", made["corpus"], "--tokenizer", made["tok"], "--out", str(afile)))
    assert "--out=" in line and "exists and is not a directory" in line, line
    ro = tmp_path / "ro"
    ro.mkdir()
    mounted = _mount(str(ro), "ro,size=64k")
    if not mounted:
        ro.chmod(0o555)
    try:
        for out in (ro, ro / "sub"):
            line = error_line(run_cli("data", "prepare", made["corpus"], "--tokenizer", made["tok"], "--out", str(out)))
            assert f"--out='{out}'" in line and "not writable" in line, line
    finally:
        if mounted:
            subprocess.run(["umount", str(ro)], check=True)
        else:
            ro.chmod(0o755)


def _mount(path: str, options: str) -> bool:
    """A tmpfs at ``path`` (root only); False where it cannot be mounted."""
    if os.geteuid() != 0:
        return False
    return subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", path], capture_output=True,
                          check=False).returncode == 0


def _no_bigger_than(limit: int):
    def preexec() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return preexec


@pytest.mark.parametrize("how", ["full tmpfs", "file size limit"])
def test_a_full_disk_is_one_line_and_leaves_no_half_written_shard(tmp_path, made, how):
    """A write that fails for want of space (a 16 KiB tmpfs: ENOSPC; RLIMIT_FSIZE: EFBIG) ends
    the preparation in one line naming --out and "no space left", with no temporary file and
    no index left (the directory it made removed where no shard was complete); run again with
    room, it writes the corpus."""
    out = tmp_path / "small"
    out.mkdir()
    preexec = None
    if how == "full tmpfs":
        if not _mount(str(out), "size=16k"):
            if os.environ.get("MESHRUN_TEST_STRICT") == "1":
                pytest.fail("cannot mount a tmpfs (not root) but MESHRUN_TEST_STRICT=1")
            pytest.skip("mounting a tmpfs needs root")
    else:
        preexec = _no_bigger_than(4096)
    try:
        res = subprocess.run([sys.executable, "-m", "meshrun", "data", "prepare", made["corpus"], "--tokenizer",
                              made["tok"], "--out", str(out / "o"), "--workers", "1"], env=clean_env(),
                             capture_output=True, text=True, timeout=60, preexec_fn=preexec, check=False)
        line = error_line(res)
        assert f"--out='{out / 'o'}'" in line and "no space left" in line, line
        o = out / "o"  # new: removed where no shard was completed, else kept with its complete shards
        assert not o.exists() or (no_temporary_files(str(o)) and not (o / "meshrun-data.json").exists())
    finally:
        if how == "full tmpfs":
            subprocess.run(["umount", str(out)], check=True)
    if how == "file size limit":
        res = run_cli("data", "prepare", made["corpus"], "--tokenizer", made["tok"], "--out", str(out / "o"),
                      "--workers", "1")
        assert res.returncode == 0 and "meshrun data: wrote" in res.stderr, res.stderr[-2000:]


@pytest.mark.parametrize("workers", ["1", "2"])
def test_a_jsonl_line_that_is_not_utf8_is_named_by_file_and_line(tmp_path, made, workers):
    path = tmp_path / "docs.jsonl"
    path.write_bytes(b'{"text": "fine"}\n\n{"text": "caf\xe9 latin-1"}\n')
    line = error_line(run_cli("data", "prepare", str(path), "--tokenizer", made["tok"], "--out", str(tmp_path / "o"),
                              "--workers", workers))
    assert f"{path}:3: not UTF-8 text" in line, line


def test_an_input_deleted_while_prepare_runs_is_one_line_naming_it(tmp_path, made):
    """b.txt, listed when the preparation started, deleted before it is read."""
    corpus = _two_chunk_corpus(str(tmp_path / "corpus"))
    out = str(tmp_path / "out")
    proc = _start_paused(corpus, made["tok"], out)
    try:
        os.remove(os.path.join(corpus, "b.txt"))
        _, stderr = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    line = error_line(subprocess.CompletedProcess(proc.args, proc.returncode, "", stderr))
    assert f"{os.path.join(corpus, 'b.txt')}: no longer there" in line, line
    assert no_temporary_files(out) and not os.path.exists(os.path.join(out, "meshrun-data.json"))


def test_a_corpus_too_large_to_read_first_checks_each_sample_as_it_is_read(tmp_path):
    """Past FULL_CHECK_TOKENS the parent samples the ids; each training sample is then checked
    when a rank reads it, and an id past the vocabulary is one line naming where it is."""
    require("torch")
    from meshrun.data.store import open_tokens
    from meshrun.errors import MeshrunError
    from meshrun.training.loader import PackedTokens

    tokens = np.arange(1000, dtype=np.uint16) % 50
    tokens[613] = 70
    tokens.tofile(tmp_path / "train.bin")
    split = open_tokens(str(tmp_path / "train.bin")).splits["train"]
    assert int(PackedTokens(split, 16)[38][0].max()) == 70  # without the model's vocabulary nothing is checked
    checked = PackedTokens(split, 16, vocab=64)
    assert checked[37][0].max() < 64
    with pytest.raises(MeshrunError, match="token id 70 at token 613 of the corpus is not below the model's "
                                           "vocabulary of 64"):
        checked[38]


def _damaged_inputs(root) -> dict[str, str]:
    """Saved datasets and parquet files cut or overwritten as a failed copy leaves them."""
    datasets = pytest.importorskip("datasets")
    import pyarrow as pa
    import pyarrow.parquet as pq

    def saved(name: str, damage) -> str:
        path = root / name
        datasets.Dataset.from_dict({"text": [f"document {i}" for i in range(200)]}).save_to_disk(str(path))
        damage(path)
        return str(path)

    def cut(path) -> None:
        arrow = next(path.glob("*.arrow"))
        arrow.write_bytes(arrow.read_bytes()[:-600])

    table = pa.table({"text": [f"document {i}" for i in range(3000)]})
    pq.write_table(table, str(root / "whole.parquet"))
    whole = (root / "whole.parquet").read_bytes()
    (root / "cut.parquet").write_bytes(whole[: len(whole) // 2])
    (root / "zeroed.parquet").write_bytes(whole[:4] + bytes(len(whole) // 2) + whole[4 + len(whole) // 2:])
    return {
        "cut arrow file": saved("cut", cut),
        "broken state.json": saved("state", lambda p: (p / "state.json").write_text("{broken")),
        "dataset_info.json of another shape": saved("info", lambda p: (p / "dataset_info.json").write_text("[]")),
        "cut parquet": str(root / "cut.parquet"),
        "zeroed parquet": str(root / "zeroed.parquet"),
    }


def test_a_damaged_saved_dataset_or_parquet_file_is_named_as_the_input(tmp_path, made):
    """A saved dataset or parquet file its library cannot read is one line naming that input,
    whatever the library raised (never blamed on --out), and OUT, new, is not left behind."""
    for what, path in _damaged_inputs(tmp_path).items():
        out = tmp_path / f"out-{what.replace(' ', '-')}"
        line = error_line(meshrun_here("data", "prepare", path, "--tokenizer", made["tok"], "--out", str(out),
                                       "--workers", "1"))
        kind = "parquet" if path.endswith(".parquet") else "a saved dataset"
        assert line.startswith(f"meshrun: error: {path}: cannot read it as {kind}: "), (what, line)
        assert "--out" not in line and not out.exists(), (what, list(out.iterdir()) if out.exists() else None)


def test_a_long_document_is_tokenized_in_pieces_to_the_same_tokens(tmp_path, made, monkeypatch):
    """A document longer than PIECE_CHARS is tokenized in pieces cut before a space or line break
    that follows a word: its tokens are those of the whole document, with pieces of 1 KiB or of
    the default size alike, and each piece is at most that long."""
    from meshrun.data import prepare as prep

    words = (open(os.path.join(made["corpus"], name)).read() for name in sorted(os.listdir(made["corpus"])))
    text = " ".join(w for w in words).replace("\n", "  \n ")[:40_000]
    corpus = tmp_path / "long.txt"
    corpus.write_text(text)
    assert "".join(prep.pieces(text, 1024)) == text and max(map(len, prep.pieces(text, 1024))) <= 1024
    outs = []
    for size in (prep.PIECE_CHARS, 1024):
        monkeypatch.setattr(prep, "PIECE_CHARS", size)
        out = tmp_path / f"out-{size}"
        res = meshrun_here("data", "prepare", str(corpus), "--tokenizer", made["tok"], "--out", str(out),
                           "--workers", "1", "--val-fraction", "0")
        assert res.returncode == 0, res.stderr
        outs.append((out / "train-00000.tokens").read_bytes())
    assert len(outs[0]) > 4000 and outs[0] == outs[1]


def test_a_jsonl_line_past_the_bound_is_one_line_naming_it(tmp_path, made, monkeypatch):
    """A JSON line is read whole, so its length is bounded (MAX_LINE_BYTES, 256 MiB): a longer
    one is refused naming the file and line, before it is parsed."""
    from meshrun.data import sources

    monkeypatch.setattr(sources, "MAX_LINE_BYTES", 100)
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "short"}\n' + json.dumps({"text": "x" * 200}) + "\n")
    line = error_line(meshrun_here("data", "prepare", str(path), "--tokenizer", made["tok"], "--out",
                                   str(tmp_path / "o"), "--workers", "1"))
    assert f"{path}:2: a line of more than 0 MiB" in line, line
