"""``meshrun data prepare``: a text corpus tokenized once, in parallel, into token shards
(``store.py``'s format), each document followed by the end-of-document token.

Documents go to the validation split by their index in the corpus (the first, then one in
every 1/f for the fraction f): the same documents on every run. Of n >= 2 documents at most
n - 1 are held out; a corpus of one document has no validation split (it trains on it, and
says so).
Work is done in chunks of documents, tokenized by a pool of worker processes and written in
order. After each full training shard both splits' open shards are closed and
``progress.json`` records how many chunks are done: a run interrupted there and started again
with the same inputs, tokenizer and settings resumes from it and writes the very files an
uninterrupted run writes; with anything changed it starts clean. The index is written last.

With no tokenizer given, one is trained on the corpus first (``bpe.py``) and written into the
directory as ``tokenizer.json``, which the index names; a run resumed finds it there. The files
of a directory input that were not read are counted by extension in a line beside the summary.

One preparation per output directory at a time (``lock.py``). A write that fails (a full
disk, a file-size limit) ends it in one line naming the directory, with its half-written
(``.tmp``) files removed: what is left is complete shards, and no index."""

from __future__ import annotations

import errno
import hashlib
import itertools
import json
import multiprocessing as mp
import os
import re
import sys
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import TYPE_CHECKING, Any, TypedDict

import numpy as np

from ..errors import MeshrunError, bad_value
from ..paths import check_output_dir
from ..units import clock
from . import FORMAT, INDEX, bpe, chat
from .lock import LOCK_NAME, PrepareLock
from .sources import Source, chat_records, documents, skipped_hint, skipped_summary
from .store import SPLITS, check_prepared, shard_docs, shard_mask, shard_name, shard_tokens, shards_problem
from .tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from rich.progress import Progress

PROGRESS = "progress.json"
CHUNK_DOCS = 256  # documents per unit of work
CHUNK_CHARS = 4 << 20  # or this many characters, whichever comes first
SHARD_TOKENS = 1 << 27  # tokens per training shard (256 MiB in uint16)
NOT_UTF8_NAMED = 3  # of the files left out as not UTF-8, those the index and the line name


@dataclass(frozen=True)
class PrepareSpec:
    source: Source
    tokenizer: str | None  # the tokenizer to use (load_tokenizer's), or None with train_vocab
    out: str
    val_fraction: float = 0.01
    workers: int = 1
    eos_token: str | None = None
    shard_tokens: int = SHARD_TOKENS
    out_name: str = "--out"  # where ``out`` came from, for the one-line errors
    train_vocab: int | None = None  # train a tokenizer of this vocabulary size on the corpus (bpe.py)
    tokenizer_name: str = "--tokenizer"  # where ``tokenizer`` came from, for the one-line errors


def is_val(i: int, fraction: float) -> bool:
    """Whether document ``i`` is held out: the first document and then one in every 1/fraction
    (exactly a fraction of any prefix of the corpus, rounded up, so a small corpus holds out one)."""
    f = Fraction(fraction).limit_denominator(10**6)
    if f == 0:
        return False
    shift = f.denominator - f.numerator
    return ((i + 1) * f.numerator + shift) // f.denominator > (i * f.numerator + shift) // f.denominator


# A document: a text, or a chat record with where it was read (chat.py)
_Doc = str | tuple[str, dict[str, Any]]


def _doc_size(doc: _Doc) -> int:
    """A document's UTF-8 bytes (a chat record's: as JSON, about its line's)."""
    if isinstance(doc, str):
        return len(doc.encode())
    return len(json.dumps(doc[1], ensure_ascii=False).encode())


def _chunks(source: Source, not_utf8: list[str]) -> Iterator[tuple[int, list[_Doc], int]]:
    """(index of the chunk's first document, its documents, their UTF-8 bytes); the files left
    out as not UTF-8 are added to ``not_utf8`` (sources.documents). A chat corpus' documents
    are its records, checked as they are read (chat.py)."""
    docs_in: Iterator[_Doc] = chat_records(source) if source.chat else documents(source, not_utf8)
    first, docs, chars = 0, [], 0
    for doc in docs_in:
        docs.append(doc)
        chars += len(doc) if isinstance(doc, str) else _doc_size(doc)
        if len(docs) >= CHUNK_DOCS or chars >= CHUNK_CHARS:
            yield first, docs, sum(map(_doc_size, docs))
            first, docs, chars = first + len(docs), [], 0
    if docs:
        yield first, docs, sum(map(_doc_size, docs))


_WORKER: dict[str, Any] = {}


def _init_worker(spec: str, eos_token: str | None, kind: chat.ChatKind | None) -> None:
    # one thread per worker process: the tokenizers library would otherwise start a thread per
    # CPU in each of them
    os.environ["RAYON_NUM_THREADS"] = "1"
    _WORKER["tok"] = load_tokenizer(spec, eos_token=eos_token)
    _WORKER["chat"] = _chat_encoder(spec, kind)


# Each split's part of a chunk: its tokens end to end, its documents' lengths, and (chat data)
# its tokens' loss mask (1: trained).
_Encoded = dict[str, tuple[np.ndarray, np.ndarray, np.ndarray | None]]


@dataclass(frozen=True)
class _ChatEncoder:
    """How a chat corpus' records become tokens: their kind and the template's renderer."""

    kind: chat.ChatKind
    renderer: chat.Renderer | None


def _chat_encoder(tokenizer: str, kind: chat.ChatKind | None) -> _ChatEncoder | None:
    if kind is None:
        return None
    template = chat.load_template(tokenizer) if chat.needs_template(kind) else None
    return _ChatEncoder(kind, chat.Renderer(template) if template is not None else None)


# The text a tokenizer is given at once: a longer document is tokenized in pieces of at most
# this many characters, and its tokens joined. Each piece ends before a space or line break that
# follows a word, where pre-tokenizers (byte-level BPE, tiktoken's) split anyway, so the joined
# tokens are the whole document's. Tokenized whole, a 49 MB one-line document peaked at 9.7 GB
# of memory (tokenizers' working state is about 200 bytes a character); in pieces, at 0.6 GB.
PIECE_CHARS = 1 << 20
_CUT = re.compile(r"\S(?=\s)")


def pieces(text: str, size: int = PIECE_CHARS) -> list[str]:
    """``text`` cut into pieces of at most ``size`` characters; joined they are ``text``."""
    out, start = [], 0
    while len(text) - start > size:
        end = start + size
        window = text[max(start, end - 4096):end]  # (a cut is found in the last 4 KiB of text, or made anywhere)
        ends = [m.end() for m in _CUT.finditer(window)]
        cut = end - len(window) + ends[-1] if ends else end
        out.append(text[start:cut])
        start = cut
    out.append(text[start:])
    return out


def _encode_documents(tok: Tokenizer, docs: list[str], kind: np.dtype[Any]) -> list[np.ndarray]:
    """Each document's tokens, a long one tokenized in pieces (PIECE_CHARS)."""
    if all(len(d) <= PIECE_CHARS for d in docs):
        return [np.asarray(d, dtype=kind) for d in tok.encode_batch(docs)]
    arrays = []
    for d in docs:
        parts = [np.asarray(ids, dtype=kind) for part in pieces(d) for ids in tok.encode_batch([part])]
        arrays.append(np.concatenate(parts) if len(parts) > 1 else parts[0])
    return arrays


def _encode(tok: Tokenizer, first: int, docs: list[Any], fraction: float, dtype: str,
            encoder: _ChatEncoder | None = None) -> _Encoded:
    """Each split's tokens of a chunk (documents end to end, each text with the end-of-document
    token; chat records as chat.py makes them, with their loss masks) and its documents' lengths."""
    kind = np.dtype(dtype).newbyteorder("<")
    masks: list[np.ndarray] | None = None
    if encoder is not None:
        pairs = [chat.encode_example(tok.encode_batch, tok.eos_id, encoder.renderer, encoder.kind, record, where)
                 for where, record in docs]
        arrays = [np.asarray(ids, dtype=kind) for ids, _ in pairs]
        masks = [mask for _, mask in pairs]
    else:
        eos = np.array([tok.eos_id], dtype=kind)
        arrays = [np.concatenate([a, eos]) for a in _encode_documents(tok, docs, kind)]
    out: _Encoded = {}
    for split in SPLITS:
        mine = [k for k in range(len(arrays)) if is_val(first + k, fraction) == (split == "val")]
        flat = np.concatenate([arrays[k] for k in mine]) if mine else np.zeros(0, dtype=kind)
        mask = None if masks is None else (np.concatenate([masks[k] for k in mine]) if mine
                                           else np.zeros(0, dtype=np.uint8))
        out[split] = (flat, np.array([len(arrays[k]) for k in mine], dtype=np.int64), mask)
    return out


def _encode_in_worker(job: tuple[int, list[Any], int, float, str]) -> tuple[_Encoded, int, int]:
    first, docs, size, fraction, dtype = job
    return _encode(_WORKER["tok"], first, docs, fraction, dtype, _WORKER["chat"]), size, len(docs)


class _Entry(TypedDict):
    file: str
    tokens: int
    documents: int
    max_id: int


class ShardEntry(_Entry, total=False):
    """A complete shard as the index (and the progress record) lists it."""

    trained: int  # chat data: the tokens its loss mask trains


class _Shard:
    """An open shard of one split, under a temporary name until closed."""

    def __init__(self, out: str, split: str, number: int) -> None:
        self.out, self.name = out, shard_name(split, number)
        self.tokens = open(os.path.join(out, self.name + ".tokens.tmp"), "wb")
        self.starts: list[np.ndarray] = []
        self.masks: list[np.ndarray] | None = None
        self.count = 0
        self.documents = 0
        self.max_id = -1

    def add(self, flat: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None = None) -> None:
        if not len(lengths):
            return
        if mask is not None:
            self.masks = [*(self.masks or []), mask]
        self.starts.append(self.count + np.concatenate([[0], np.cumsum(lengths)[:-1]]))
        try:
            self.tokens.write(np.ascontiguousarray(flat).data.cast("B"))  # (an OSError with its errno)
        except OSError as exc:
            exc.filename = self.tokens.name
            raise
        self.count += len(flat)
        self.documents += len(lengths)
        self.max_id = max(self.max_id, int(flat.max()))

    def close(self) -> ShardEntry | None:
        """Make the shard complete (fsync, then renamed); its index entry, None if empty."""
        try:
            self.tokens.flush()
            os.fsync(self.tokens.fileno())
            self.tokens.close()
        except OSError as exc:
            exc.filename = self.tokens.name
            raise
        base = os.path.join(self.out, self.name)
        if not self.count:
            os.remove(base + ".tokens.tmp")
            return None
        starts = np.concatenate(self.starts).astype("<i8")
        _write_bytes(base + ".docs", starts.data.cast("B"))
        entry: ShardEntry = {"file": self.name, "tokens": self.count, "documents": self.documents,
                             "max_id": self.max_id}
        if self.masks is not None:
            mask = np.concatenate(self.masks).astype(np.uint8)
            _write_bytes(base + ".mask", mask.data.cast("B"))
            entry["trained"] = int(mask.sum())
        os.replace(base + ".tokens.tmp", base + ".tokens")
        return entry

    def discard(self) -> None:
        """Close without completing (the temporary file is removed by the caller)."""
        try:
            self.tokens.close()
        except OSError:  # (its buffer could not be written: a full disk)
            pass


def _write_bytes(path: str, data: memoryview) -> None:
    """``data`` into ``path``, complete (written under a temporary name, synced, renamed)."""
    with open(path + ".tmp", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _write_json(path: str, data: dict[str, Any]) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)


def _ours(name: str) -> bool:
    return name in (INDEX, PROGRESS, INDEX + ".tmp", PROGRESS + ".tmp", LOCK_NAME, bpe.FILE, bpe.FILE + ".tmp") \
        or name.startswith(tuple(f"{s}-" for s in SPLITS))


def _start_clean(out: str, where: str, keep: str | None = None) -> None:
    """Empty ``out`` of what an earlier preparation wrote (all but the lock, and ``keep``: the
    tokenizer in use, when it is the one a preparation trained there)."""
    strangers = [n for n in os.listdir(out) if not _ours(n)]
    if strangers:
        raise bad_value(where, out, f"holds files meshrun did not write ({', '.join(sorted(strangers)[:3])})",
                        "an empty or new directory, or one meshrun data prepare wrote")
    for name in os.listdir(out):
        path = os.path.join(out, name)
        if name != LOCK_NAME and not (keep is not None and os.path.realpath(path) == os.path.realpath(keep)):
            os.remove(path)


def _remove_temporary(out: str) -> None:
    """Remove the half-written files (``*.tmp``) of a preparation that failed."""
    for name in os.listdir(out):
        if name.endswith(".tmp"):
            try:
                os.remove(os.path.join(out, name))
            except OSError:
                pass


def _os_error(exc: OSError, spec: PrepareSpec) -> MeshrunError:
    """The one line for a file operation that failed: a write into the output (a full disk or a
    file-size limit named as such), or anything else by its file."""
    name = exc.filename if isinstance(exc.filename, str) else None
    ours = name is None or os.path.realpath(name).startswith(os.path.realpath(spec.out) + os.sep)
    what = f"writing {name}" if name else "writing into it"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
        return bad_value(spec.out_name, spec.out, f"no space left while {what} ({exc.strerror}); "
                         "the half-written files are removed",
                         "free space, or give a directory on a larger disk, and run it again")
    if ours:
        return bad_value(spec.out_name, spec.out, f"cannot write there: {exc.strerror or exc} while {what}",
                         "give a directory you can write to")
    return MeshrunError(f"{name}: {exc.strerror or exc} (hint: check the file and its permissions)")


def _identity(spec: PrepareSpec, tokenizer: Mapping[str, Any]) -> dict[str, Any]:
    """What a preparation is made from: the inputs and how they are read, the tokenizer (its
    record, or how it is trained), a chat corpus' kind and chat template, and the settings."""
    files = spec.source.fingerprint()
    identity = {"format": FORMAT, "files": len(files),
                "inputs": hashlib.sha256(json.dumps(files).encode()).hexdigest(),
                "paths": list(spec.source.paths[:4]), "dataset": spec.source.dataset,
                "extensions": list(spec.source.extensions), "text_field": spec.source.text_field,
                "tokenizer": dict(tokenizer), "val_fraction": spec.val_fraction, "shard_tokens": spec.shard_tokens}
    if spec.source.chat is not None:
        identity["chat"] = chat_record(spec)
    return identity


def chat_record(spec: PrepareSpec) -> dict[str, Any]:
    """A chat corpus' kind and the chat template it is rendered with (None for prompt/completion)."""
    template = (chat.load_template(spec.tokenizer) if spec.tokenizer is not None and spec.source.chat is not None
                and chat.needs_template(spec.source.chat) else None)
    return {"kind": spec.source.chat, "template": None if template is None else
            {"source": template.source, "sha256": template.sha256}}


class _Progress:
    """Bytes read of the corpus, tokens written, their rates and the time left: a rich bar on a
    terminal, else a line every LINE_EVERY_S seconds; and a closing line."""

    LINE_EVERY_S = 5.0

    def __init__(self, total_bytes: int | None, enabled: bool) -> None:
        self.total, self.enabled, self.start = total_bytes, enabled, time.monotonic()
        self.last = self.start
        self.bytes = self.tokens = self.docs = 0
        self.bar: Progress | None = None
        if enabled and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, Progress, TextColumn

            self.bar = Progress(TextColumn("tokenizing"), BarColumn(), TextColumn("{task.fields[info]}"),
                                console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task("", total=total_bytes, info="")

    def info(self) -> str:
        """What is done, at what rate, and (the corpus's size known) its share and the time left."""
        elapsed = max(time.monotonic() - self.start, 1e-9)
        rate = self.bytes / elapsed
        done = f"{self.bytes / 2**20:,.1f}"
        if self.total:
            done += f" of {self.total / 2**20:,.1f} MiB ({min(1.0, self.bytes / self.total):.0%})"
        else:
            done += " MiB"
        line = (f"{done}, {self.tokens:,} tokens, {rate / 2**20:,.1f} MiB/s, {self.tokens / elapsed:,.0f} tokens/s, "
                f"elapsed {clock(elapsed)}")
        if self.total and rate > 0 and self.bytes < self.total:
            line += f", left {clock((self.total - self.bytes) / rate)}"
        return line

    def update(self, size: int, tokens: int, docs: int) -> None:
        self.bytes, self.tokens, self.docs = self.bytes + size, self.tokens + tokens, self.docs + docs
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.update(self.task, completed=self.bytes, info=self.info())
        elif time.monotonic() - self.last >= self.LINE_EVERY_S:
            self.last = time.monotonic()
            print(f"meshrun data: {self.info()}", file=sys.stderr, flush=True)

    def stop(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def prepare(spec: PrepareSpec, log: bool = True, wait: bool = False) -> dict[str, Any]:
    """Tokenize ``spec.source`` into ``spec.out``; returns the index (see the module's
    docstring). The directory is locked meanwhile: another preparation of it is refused in
    one line, or with ``wait`` waited for."""
    if not 0 <= spec.val_fraction < 1:
        raise bad_value("--val-fraction", spec.val_fraction, "must be in [0, 1)", "e.g. 0.01")
    if spec.workers < 1:
        raise bad_value("--workers", spec.workers, "must be at least 1")
    tok = _given_tokenizer(spec)
    check_output_dir(spec.out, spec.out_name)
    created = not os.path.lexists(spec.out)
    try:
        with PrepareLock(spec.out, spec.out_name, wait):
            return _prepare_locked(spec, tok, log)
    except BaseException:
        if created:  # a preparation refused (an input it could not read) leaves no directory behind
            _remove_if_empty(spec.out)
        raise


def _given_tokenizer(spec: PrepareSpec) -> Tokenizer | None:
    """The tokenizer ``spec`` names, loaded; None when it asks for one to be trained (its
    vocabulary size checked). One line for neither or both, for conversations and a tokenizer
    without a chat template, and for chat data and a tokenizer to train."""
    kind = spec.source.chat
    if spec.train_vocab is None:
        if spec.tokenizer is None:
            raise bad_value("--tokenizer", None, "the corpus needs a tokenizer",
                            "--tokenizer DIR|FILE|NAME" + ("" if kind else ", or --train-tokenizer VOCAB to train a "
                                                           "byte-level BPE on the corpus"))
        tok = load_tokenizer(spec.tokenizer, spec.tokenizer_name, eos_token=spec.eos_token)
        if chat.needs_template(kind):
            template = chat.load_template(spec.tokenizer, spec.tokenizer_name)
            if template is None:
                raise chat.no_template(spec.tokenizer, spec.tokenizer_name)
            chat.Renderer(template)  # (one that does not parse: refused here)
        return tok
    if kind is not None:
        raise bad_value("--train-tokenizer", spec.train_vocab, f"trains a tokenizer on text; the corpus holds "
                        f"{chat.EXAMPLE_WORDS[kind][1]}", "--tokenizer the model's own tokenizer directory")
    if spec.tokenizer is not None:
        raise bad_value("--train-tokenizer", spec.train_vocab, f"trains a tokenizer, and --tokenizer names one "
                        f"({spec.tokenizer})", "give one of them")
    if spec.eos_token is not None:
        raise bad_value("--eos-token", spec.eos_token, "names the end-of-document token of a tokenizer given; the "
                        f"one --train-tokenizer trains ends documents with {bpe.EOS}", "drop --eos-token")
    bpe.check_vocab(spec.train_vocab)
    return None


def _remove_if_empty(out: str) -> None:
    """Remove OUT if it holds nothing but the lock and a tokenizer trained there (no shard was completed)."""
    try:
        names = os.listdir(out)
        if LOCK_NAME in names and set(names) <= {LOCK_NAME, bpe.FILE}:
            for name in names:
                os.remove(os.path.join(out, name))
            os.rmdir(out)
    except OSError:
        pass


def _file_sha256(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()
    except OSError:
        return None


def _up_to_date(spec: PrepareSpec, identity: dict[str, Any], trained: str | None) -> dict[str, Any] | None:
    """The index of a complete preparation of these very inputs and settings, if ``spec.out``
    holds one (and the tokenizer it trained, ``trained``, is still the one its index records)."""
    if not os.path.isfile(os.path.join(spec.out, INDEX)):
        return None
    try:
        index = check_prepared(spec.out, spec.out_name)
    except MeshrunError:
        return None
    if index.get("identity") != identity:
        return None
    if trained is not None and _file_sha256(trained) != index["tokenizer"].get("sha256"):
        return None
    return index


def _trained_before(path: str) -> Tokenizer | None:
    """The tokenizer an interrupted preparation trained into its directory, if it is there and reads."""
    if not os.path.isfile(path):
        return None
    try:
        return load_tokenizer(path)
    except MeshrunError:
        return None


def _saved_state(spec: PrepareSpec, tok: Tokenizer | None, identity: dict[str, Any]) -> dict[str, Any]:
    """Where an interrupted preparation of the same inputs and settings stopped (with ``tok``,
    its tokenizer), else a clean start."""
    state: dict[str, Any] = {"identity": identity, "chunks": 0, "documents": 0, "splits": {s: [] for s in SPLITS}}
    progress_path = os.path.join(spec.out, PROGRESS)
    if tok is not None and os.path.isfile(progress_path):
        with open(progress_path) as f:
            try:
                saved = json.load(f)
            except (ValueError, RecursionError):
                saved = {}
        if _resumable(saved, identity, spec.out, tok):
            state = saved
            _remove_temporary(spec.out)  # an open shard of the interrupted run
    return state


def _resumable(saved: object, identity: dict[str, Any], out: str, tok: Tokenizer) -> bool:
    """Whether a progress record is this preparation's and whole: its counts, and the complete
    shards it names on disk at their lengths (else the preparation starts clean)."""
    if not isinstance(saved, dict) or saved.get("identity") != identity:
        return False
    splits = saved.get("splits")
    if not all(isinstance(saved.get(k), int) and saved[k] >= 0 for k in ("chunks", "documents")) \
            or not isinstance(splits, dict) or set(splits) != set(SPLITS) \
            or any(shards_problem(split, splits[split]) for split in SPLITS):
        return False
    try:
        for split in SPLITS:
            for entry in splits[split]:
                shard_tokens(out, entry, tok.dtype, tok.vocab_size, "progress")
                shard_docs(out, entry, "progress")
                if "chat" in identity:
                    shard_mask(out, entry, "progress")
    except MeshrunError:
        return False
    return True


def _prepare_locked(spec: PrepareSpec, given: Tokenizer | None, log: bool) -> dict[str, Any]:
    """``given``: the tokenizer named, or None to train one into OUT/tokenizer.json."""
    trained = os.path.join(spec.out, bpe.FILE)
    if given is not None:
        identity = _identity(spec, given.record())
    else:
        identity = _identity(spec, bpe.identity(spec.train_vocab or 0))
    index = _up_to_date(spec, identity, trained if given is None else None)
    if index is not None:
        _say(log, f"{spec.out} is up to date ({_summary(index)})")
        _say_skipped(spec.source, index, log)
        return index
    tok = given if given is not None else _trained_before(trained)
    state = _saved_state(spec, tok, identity)
    if state["chunks"] == 0:
        _start_clean(spec.out, spec.out_name, keep=given.name if given is not None else None)
    else:
        _say(log, f"resuming {spec.out} after {state['documents']:,} documents")
    try:
        if tok is None or (given is None and state["chunks"] == 0):
            tok = _train_tokenizer(spec, trained, log)
        # (the workers load the tokenizer named, or the one trained)
        not_utf8 = _tokenize(spec, tok, spec.tokenizer or trained, state, log)
        index = _finish(spec, tok, state, log, not_utf8)
    except BaseException as exc:
        _remove_temporary(spec.out)
        if isinstance(exc, OSError):
            raise _os_error(exc, spec) from None
        raise
    _say(log, f"wrote {spec.out} ({_summary(index)})")
    _say_skipped(spec.source, index, log)
    return index


def _say(log: bool, line: str) -> None:
    if log:
        print(f"meshrun data: {line}", file=sys.stderr, flush=True)


def _say_skipped(source: Source, index: dict[str, Any], log: bool) -> None:
    """The lines of the files a directory input held that were not read: by extension, and
    those of the extensions read that are not UTF-8 (an index written before this count was
    kept has none)."""
    if source.skipped:
        _say(log, f"skipped {skipped_summary(source.skipped)} (hint: {skipped_hint(source.skipped_text)})")
    left = index.get("not_utf8") or {"files": 0, "first": []}
    if left["files"]:
        n = left["files"]
        named = ", ".join(left["first"]) + (", ..." if n > len(left["first"]) else "")
        files, are, them = ("file", "is", "it") if n == 1 else ("files", "are", "them")
        _say(log, f"left out {n:,} {files} that {are} not UTF-8 text: {named} "
                  f"(hint: convert {them} to train on {them}, e.g. with iconv -t utf-8)")


def _train_tokenizer(spec: PrepareSpec, path: str, log: bool) -> Tokenizer:
    """Train a tokenizer on the corpus (bpe.py), write it to ``path`` and load it."""
    vocab = spec.train_vocab or 0
    _say(log, f"training a {bpe.KIND} tokenizer of {vocab:,} tokens on the corpus")
    # (the files left out as not UTF-8 are said once, by _tokenize's pass)
    texts = (piece for text in documents(spec.source, []) for piece in pieces(text))
    data = bpe.train(texts, vocab)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(path + ".tmp", path)
    tok = load_tokenizer(path, spec.out_name)
    fewer = (f" (fewer than the {vocab:,} asked: no pair of tokens is left that the corpus holds at least "
             f"{bpe.MIN_PAIR_COUNT} times)" if tok.vocab_size < vocab else "")
    _say(log, f"trained a {bpe.KIND} of {tok.vocab_size:,} tokens{fewer}: {path}")
    return tok


def _tokenize(spec: PrepareSpec, tok: Tokenizer, tok_spec: str, state: dict[str, Any], log: bool) -> list[str]:
    """Tokenize the chunks ``state`` has not done into complete shards, ``state`` kept up to date
    (the worker processes load the tokenizer from ``tok_spec``). Returns the files left out as
    not UTF-8 (all of them: a resumed run reads the documents done before too, to skip them)."""
    progress_path = os.path.join(spec.out, PROGRESS)
    dtype = tok.dtype
    not_utf8: list[str] = []
    jobs: Iterator[tuple[int, list[_Doc], int, float, str]] = (
        (first, docs, size, spec.val_fraction, dtype)
        for n, (first, docs, size) in enumerate(_chunks(spec.source, not_utf8)) if n >= state["chunks"])
    total = sum(size for _, size, _ in spec.source.inputs()) if not spec.source.dataset else None
    progress = _Progress(total, log)
    shards = {s: _Shard(spec.out, s, len(state["splits"][s])) for s in SPLITS}
    pool = None
    try:
        # What is left of a corpus in one chunk is tokenized here: worker processes would start
        # (each importing meshrun and the tokenizer) to share nothing. On 2 CPUs a 3 KB chat
        # file prepared in 2.8 s with one process, 6.0 s with --workers 2.
        ahead = list(itertools.islice(jobs, 2)) if spec.workers > 1 else []
        jobs = itertools.chain(ahead, jobs)
        if len(ahead) > 1:
            pool = mp.get_context("spawn").Pool(spec.workers, _init_worker, (tok_spec, spec.eos_token,
                                                                              spec.source.chat))
            results: Iterator[tuple[_Encoded, int, int]] = pool.imap(_encode_in_worker, jobs)
        else:
            encoder = _chat_encoder(tok_spec, spec.source.chat)
            results = ((_encode(tok, j[0], j[1], j[3], j[4], encoder), j[2], len(j[1])) for j in jobs)
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
        for split in SPLITS:
            entry = shards[split].close()
            if entry:
                state["splits"][split].append(entry)
        return not_utf8
    except BaseException:
        for shard in shards.values():
            shard.discard()
        raise
    finally:
        progress.stop()
        if pool is not None:
            pool.terminate()


def _no_validation(spec: PrepareSpec, state: dict[str, Any], log: bool) -> None:
    """A corpus whose every document went to validation trains on them all instead: its one
    validation shard (no training shard was ever closed, so there is no other) becomes the
    training shard. The validation rule holds out at most n - 1 of n >= 2 documents, so this
    is a corpus of one document."""
    (entry,) = state["splits"]["val"]
    name = shard_name("train", 0)
    for suffix in (".tokens", ".docs", ".mask"):
        if suffix != ".mask" or "trained" in entry:  # (a chat shard's loss mask)
            os.replace(os.path.join(spec.out, entry["file"] + suffix), os.path.join(spec.out, name + suffix))
    state["splits"] = {"train": [{**entry, "file": name}], "val": []}
    n = entry["documents"]
    _say(log, f"{n} document{'s' if n != 1 else ''}: no validation split (validation needs at least 2 documents)")


def _finish(spec: PrepareSpec, tok: Tokenizer, state: dict[str, Any], log: bool,
            not_utf8: list[str]) -> dict[str, Any]:
    """Write the index (last: it makes the directory a corpus) and drop the progress file."""
    if not state["splits"]["train"] and state["splits"]["val"]:
        _no_validation(spec, state, log)
    index: dict[str, Any] = {
        "format": FORMAT, "dtype": tok.dtype, "tokenizer": tok.record(), "identity": state["identity"],
        "documents": state["documents"],
        "not_utf8": {"files": len(not_utf8), "first": not_utf8[:NOT_UTF8_NAMED]},
        "splits": {s: {"shards": state["splits"][s], "tokens": sum(e["tokens"] for e in state["splits"][s]),
                       "documents": sum(e["documents"] for e in state["splits"][s])} for s in SPLITS}}
    if spec.source.chat is not None:
        index["chat"] = {**state["identity"]["chat"], "longest": _longest(spec.out, state["splits"]),
                         "trained": {s: sum(e.get("trained", 0) for e in state["splits"][s]) for s in SPLITS}}
    if not index["splits"]["train"]["tokens"]:
        raise MeshrunError(f"{', '.join(spec.source.paths[:2])}: an empty corpus, no text in it "
                           "(hint: check the path and --text-field)")
    _write_json(os.path.join(spec.out, INDEX), index)
    progress_path = os.path.join(spec.out, PROGRESS)
    if os.path.exists(progress_path):
        os.remove(progress_path)
    return index


def _longest(out: str, splits: dict[str, list[ShardEntry]]) -> int:
    """The tokens of the longest document of the shards written."""
    longest = 0
    for entries in splits.values():
        for entry in entries:
            starts = np.fromfile(os.path.join(out, entry["file"] + ".docs"), dtype="<i8")
            longest = max(longest, int(np.diff(np.append(starts, entry["tokens"])).max()))
    return longest


def _summary(index: dict[str, Any]) -> str:
    s = index["splits"]
    info = index.get("chat")
    if isinstance(info, dict):
        one, many = chat.EXAMPLE_WORDS[info["kind"]]
        parts = []
        for split in SPLITS:
            n, tokens, trained = s[split]["documents"], s[split]["tokens"], info["trained"][split]
            share = f" ({trained / tokens:.0%})" if tokens else ""
            parts.append(f"{split} {n:,} {one if n == 1 else many}, {tokens:,} tokens of which {trained:,} trained"
                         f"{share}")
        template = info.get("template")
        return (f"{'; '.join(parts)}; the longest {info['longest']:,} tokens; {index['dtype']}, tokenizer "
                f"{index['tokenizer']['name']}" + (f", chat template {template['source']}" if template else ""))
    docs = s["train"]["documents"]
    return (f"{s['train']['tokens']:,} training tokens in {docs:,} document{'s' if docs != 1 else ''}, "
            f"{s['val']['tokens']:,} validation tokens in {s['val']['documents']:,}, {index['dtype']}, "
            f"tokenizer {index['tokenizer']['name']}")
