"""``meshrun data prepare``: a text corpus tokenized once, in parallel, into token shards
(``store.py``'s format), each document followed by the end-of-document token.

Documents go to the validation split by their index in the corpus (the first, then one in
every 1/f for the fraction f): the same documents on every run.
Work is done in chunks of documents, tokenized by a pool of worker processes and written in
order. After each full training shard both splits' open shards are closed and
``progress.json`` records how many chunks are done: a run interrupted there and started again
with the same inputs, tokenizer and settings resumes from it and writes the very files an
uninterrupted run writes; with anything changed it starts clean. The index is written last."""

from __future__ import annotations

import hashlib
import json
import multiprocessing as mp
import os
import sys
import time
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Iterator

import numpy as np

from ..errors import MeshrunError, bad_value
from .sources import Source, documents
from . import FORMAT, INDEX
from .store import SPLITS, read_index, shard_name
from .tokenizer import Tokenizer, load_tokenizer

PROGRESS = "progress.json"
CHUNK_DOCS = 256  # documents per unit of work
CHUNK_CHARS = 4 << 20  # or this many characters, whichever comes first
SHARD_TOKENS = 1 << 27  # tokens per training shard (256 MiB in uint16)


@dataclass(frozen=True)
class PrepareSpec:
    source: Source
    tokenizer: str
    out: str
    val_fraction: float = 0.01
    workers: int = 1
    eos_token: str | None = None
    shard_tokens: int = SHARD_TOKENS


def is_val(i: int, fraction: float) -> bool:
    """Whether document ``i`` is held out: the first document and then one in every 1/fraction
    (exactly a fraction of any prefix of the corpus, rounded up, so a small corpus holds out one)."""
    f = Fraction(fraction).limit_denominator(10**6)
    if f == 0:
        return False
    shift = f.denominator - f.numerator
    return ((i + 1) * f.numerator + shift) // f.denominator > (i * f.numerator + shift) // f.denominator


def _chunks(source: Source) -> Iterator[tuple[int, list[str], int]]:
    """(index of the chunk's first document, its documents, their UTF-8 bytes)."""
    first, docs, chars, size = 0, [], 0, 0
    for text in documents(source):
        docs.append(text)
        chars += len(text)
        if len(docs) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            size = sum(len(t.encode()) for t in docs)
            yield first, docs, size
            first, docs, chars = first + len(docs), [], 0
    if docs:
        yield first, docs, sum(len(t.encode()) for t in docs)


_WORKER: dict[str, Any] = {}


def _init_worker(spec: str, eos_token: str | None) -> None:
    # one thread per worker process: the tokenizers library would otherwise start a thread per
    # CPU in each of them
    os.environ["RAYON_NUM_THREADS"] = "1"
    _WORKER["tok"] = load_tokenizer(spec, eos_token=eos_token)


def _encode(tok: Tokenizer, first: int, docs: list[str], fraction: float, dtype: str) -> dict[str, tuple]:
    """Each split's tokens of a chunk (documents end to end, each with the end-of-document
    token) and its documents' lengths."""
    kind = np.dtype(dtype).newbyteorder("<")
    arrays = [np.asarray(d, dtype=kind) for d in tok.encode_batch(docs)]
    eos = np.array([tok.eos_id], dtype=kind)
    out: dict[str, tuple] = {}
    for split in SPLITS:
        mine = [a for k, a in enumerate(arrays) if is_val(first + k, fraction) == (split == "val")]
        flat = np.concatenate([part for a in mine for part in (a, eos)]) if mine else np.zeros(0, dtype=kind)
        out[split] = (flat, np.array([len(a) + 1 for a in mine], dtype=np.int64))
    return out


def _encode_in_worker(job: tuple[int, list[str], int, float, str]) -> tuple[dict[str, tuple], int, int]:
    first, docs, size, fraction, dtype = job
    return _encode(_WORKER["tok"], first, docs, fraction, dtype), size, len(docs)


class _Shard:
    """An open shard of one split, under a temporary name until closed."""

    def __init__(self, out: str, split: str, number: int) -> None:
        self.out, self.name = out, shard_name(split, number)
        self.tokens = open(os.path.join(out, self.name + ".tokens.tmp"), "wb")
        self.starts: list[np.ndarray] = []
        self.count = 0
        self.documents = 0

    def add(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        if not len(lengths):
            return
        self.starts.append(self.count + np.concatenate([[0], np.cumsum(lengths)[:-1]]))
        flat.tofile(self.tokens)
        self.count += len(flat)
        self.documents += len(lengths)

    def close(self) -> dict[str, Any] | None:
        """Make the shard complete (fsync, then renamed); its index entry, None if empty."""
        self.tokens.flush()
        os.fsync(self.tokens.fileno())
        self.tokens.close()
        base = os.path.join(self.out, self.name)
        if not self.count:
            os.remove(base + ".tokens.tmp")
            return None
        starts = np.concatenate(self.starts).astype("<i8")
        with open(base + ".docs.tmp", "wb") as f:
            starts.tofile(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(base + ".docs.tmp", base + ".docs")
        os.replace(base + ".tokens.tmp", base + ".tokens")
        return {"file": self.name, "tokens": self.count, "documents": self.documents}


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _ours(name: str) -> bool:
    return name in (INDEX, PROGRESS, INDEX + ".tmp", PROGRESS + ".tmp") or name.startswith(
        tuple(f"{s}-" for s in SPLITS))


def _start_clean(out: str) -> None:
    strangers = [n for n in os.listdir(out) if not _ours(n)]
    if strangers:
        raise bad_value("--out", out, f"holds files meshrun did not write ({', '.join(sorted(strangers)[:3])})",
                        "an empty or new directory, or one meshrun data prepare wrote")
    for name in os.listdir(out):
        os.remove(os.path.join(out, name))


def _identity(spec: PrepareSpec, tok: Tokenizer) -> dict[str, Any]:
    files = spec.source.fingerprint()
    return {"format": FORMAT, "files": len(files), "inputs": hashlib.sha256(json.dumps(files).encode()).hexdigest(),
            "paths": list(spec.source.paths[:4]), "dataset": spec.source.dataset,
            "text_field": spec.source.text_field, "tokenizer": tok.record(), "val_fraction": spec.val_fraction,
            "shard_tokens": spec.shard_tokens}


class _Progress:
    """Bytes read of the corpus, tokens written, their rates and the time left (rich, on a
    terminal; a line every 30 s otherwise)."""

    def __init__(self, total_bytes: int | None, enabled: bool) -> None:
        self.total, self.enabled, self.start, self.last = total_bytes, enabled, time.monotonic(), 0.0
        self.bytes = self.tokens = self.docs = 0
        self.bar: Any = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn, TimeRemainingColumn

            self.bar = Progress(TextColumn("tokenizing"), BarColumn(), TextColumn("{task.fields[info]}"),
                                TimeRemainingColumn(), console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("", total=total_bytes, info="")

    def update(self, size: int, tokens: int, docs: int) -> None:
        self.bytes, self.tokens, self.docs = self.bytes + size, self.tokens + tokens, self.docs + docs
        if not self.enabled:
            return
        elapsed = max(time.monotonic() - self.start, 1e-9)
        info = (f"{self.bytes / 2**20:,.1f} MiB, {self.tokens:,} tokens, {self.bytes / elapsed / 2**20:,.1f} MiB/s, "
                f"{self.tokens / elapsed:,.0f} tokens/s")
        if self.bar is not None:
            self.bar.update(self.task, completed=self.bytes, info=info)
        elif time.monotonic() - self.last > 30:
            self.last = time.monotonic()
            print(f"meshrun data: {info}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def prepare(spec: PrepareSpec, log: bool = True) -> dict[str, Any]:
    """Tokenize ``spec.source`` into ``spec.out``; returns the index (see the module's docstring)."""
    if not 0 <= spec.val_fraction < 1:
        raise bad_value("--val-fraction", spec.val_fraction, "must be in [0, 1)", "e.g. 0.01")
    if spec.workers < 1:
        raise bad_value("--workers", spec.workers, "must be at least 1")
    tok = load_tokenizer(spec.tokenizer, eos_token=spec.eos_token)
    identity = _identity(spec, tok)
    os.makedirs(spec.out, exist_ok=True)
    index_path, progress_path = os.path.join(spec.out, INDEX), os.path.join(spec.out, PROGRESS)
    if os.path.isfile(index_path):
        try:
            index = read_index(spec.out)
        except MeshrunError:
            index = {}
        if index.get("identity") == identity:
            if log:
                print(f"meshrun data: {spec.out} is up to date ({_summary(index)})", file=sys.stderr, flush=True)
            return index
    state: dict[str, Any] = {"identity": identity, "chunks": 0, "documents": 0,
                             "splits": {s: [] for s in SPLITS}}
    if os.path.isfile(progress_path):
        with open(progress_path) as f:
            try:
                saved = json.load(f)
            except ValueError:
                saved = {}
        if saved.get("identity") == identity:
            state = saved
            for name in os.listdir(spec.out):  # an open shard of the interrupted run
                if name.endswith(".tmp"):
                    os.remove(os.path.join(spec.out, name))
    if state["chunks"] == 0:
        _start_clean(spec.out)
    elif log:
        print(f"meshrun data: resuming {spec.out} after {state['documents']:,} documents", file=sys.stderr, flush=True)

    dtype = tok.dtype
    jobs = ((first, docs, size, spec.val_fraction, dtype) for n, (first, docs, size) in enumerate(_chunks(spec.source))
            if n >= state["chunks"])
    total = sum(size for _, size, _ in spec.source.fingerprint()) if not spec.source.dataset else None
    progress = _Progress(total, log)
    shards = {s: _Shard(spec.out, s, len(state["splits"][s])) for s in SPLITS}
    pause = float(os.environ.get("MESHRUN_PREPARE_PAUSE_S") or 0)
    pool = None
    try:
        if spec.workers > 1:
            pool = mp.get_context("spawn").Pool(spec.workers, _init_worker, (spec.tokenizer, spec.eos_token))
            results: Iterator = pool.imap(_encode_in_worker, jobs)
        else:
            results = ((_encode(tok, j[0], j[1], j[3], j[4]), j[2], len(j[1])) for j in jobs)
        for parts, size, n_docs in results:
            for split in SPLITS:
                shards[split].add(*parts[split])
            state["chunks"] += 1
            state["documents"] += n_docs
            progress.update(size, sum(len(parts[s][0]) for s in SPLITS), n_docs)
            if shards["train"].count >= spec.shard_tokens:
                for split in SPLITS:  # a resumable point: both splits' shards complete
                    entry = shards[split].close()
                    if entry:
                        state["splits"][split].append(entry)
                    shards[split] = _Shard(spec.out, split, len(state["splits"][split]))
                _write_json(progress_path, state)
                if pause:  # tests: a window in which to interrupt the run here
                    time.sleep(pause)
        for split in SPLITS:
            entry = shards[split].close()
            if entry:
                state["splits"][split].append(entry)
    finally:
        progress.stop()
        if pool is not None:
            pool.terminate()
    index = {"format": FORMAT, "dtype": dtype, "tokenizer": tok.record(), "identity": identity,
             "documents": state["documents"],
             "splits": {s: {"shards": state["splits"][s], "tokens": sum(e["tokens"] for e in state["splits"][s]),
                            "documents": sum(e["documents"] for e in state["splits"][s])} for s in SPLITS}}
    if not index["splits"]["train"]["tokens"]:
        raise MeshrunError(f"{', '.join(spec.source.paths[:2])}: an empty corpus, no text in it "
                           "(hint: check the path and --text-field)")
    _write_json(index_path, index)
    if os.path.exists(progress_path):
        os.remove(progress_path)
    if log:
        print(f"meshrun data: wrote {spec.out} ({_summary(index)})", file=sys.stderr, flush=True)
    return index


def _summary(index: dict[str, Any]) -> str:
    s = index["splits"]
    return (f"{s['train']['tokens']:,} training tokens in {s['train']['documents']:,} documents, "
            f"{s['val']['tokens']:,} validation tokens in {s['val']['documents']:,}, {index['dtype']}, "
            f"tokenizer {index['tokenizer']['name']}")
