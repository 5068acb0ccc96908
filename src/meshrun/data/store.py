"""Token shards on disk, as ``meshrun data prepare`` writes them and ``meshrun train --data``
reads them, and the flat token files other tools write (nanoGPT's ``train.bin``/``val.bin``).

A prepared corpus is a directory:

    meshrun-data.json          the index, written last: format, dtype, tokenizer (name, hash,
                               vocabulary, end-of-document id), per split its shards with their
                               token and document counts, and what the corpus was made from
    train-00000.tokens ...     token ids, little-endian uint16 or uint32, end to end
    train-00000.docs ...       where each document starts in its shard (little-endian int64)
    train-00000.mask ...       chat data (the index's "chat" record): a byte per token, 1 where
                               the loss trains on it (data/chat.py)
    val-00000.tokens ...

Each shard's index entry records its token and document counts and the largest token id in
it. A shard is written under a temporary name and renamed when complete; the index names only
complete shards, and a directory without it is not a corpus. Shards are memory-mapped, never
read whole. Opening a prepared corpus checks, without reading its tokens, the index's
structure and counts, every shard's byte length against its count, and every document table
(its length, starts increasing from 0 inside the shard); anything else is a one-line error
naming the file. ``check_ids`` checks the ids themselves against a model's vocabulary."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import bad_value
from . import FORMAT, INDEX
from .chat import KINDS as CHAT_KINDS
from .sources import check_regular

DTYPES = ("uint16", "uint32")

SPLITS = ("train", "val")


def shard_name(split: str, i: int) -> str:
    return f"{split}-{i:05d}"


@dataclass
class TokenSplit:
    """One split's shards as one token stream: ``window(start, n)`` reads across shards;
    ``doc_starts`` (global offsets, sorted) where documents begin, when known."""

    shards: list[np.ndarray]
    doc_starts: np.ndarray | None = None
    masks: list[np.ndarray] | None = None  # chat data: each shard's loss mask (1: trained)
    chat_kind: str | None = None  # chat data: their kind (chat.KINDS)
    offsets: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def window(self, start: int, n: int) -> np.ndarray:
        return self._window(self.shards, start, n)

    def mask_window(self, start: int, n: int) -> np.ndarray:
        """The loss mask of ``window(start, n)``'s tokens (chat data only)."""
        if self.masks is None:
            raise ValueError("a split without loss masks")
        return self._window(self.masks, start, n)

    def _window(self, arrays: list[np.ndarray], start: int, n: int) -> np.ndarray:
        end, out, i = start + n, [], int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < end:
            base = int(self.offsets[i])
            take = min(end, int(self.offsets[i + 1])) - start
            out.append(arrays[i][start - base:start - base + take])
            start, i = start + take, i + 1
        return out[0] if len(out) == 1 else np.concatenate(out)

    def doc_lengths(self) -> np.ndarray:
        """Each document's tokens (where the split records its documents' starts)."""
        if self.doc_starts is None:
            raise ValueError("a split without document boundaries")
        return np.diff(np.append(self.doc_starts, len(self))).astype(np.int64)

    def starts_in(self, start: int, n: int) -> np.ndarray:
        """Offsets (relative to ``start``) of the documents that begin in [start, start + n)."""
        if self.doc_starts is None:
            return np.zeros(0, dtype=np.int64)
        lo, hi = np.searchsorted(self.doc_starts, [start, start + n])
        return self.doc_starts[lo:hi] - start


@dataclass
class Corpus:
    """Token splits and what is known of them: ``vocab_size``/``eos_id`` from the tokenizer
    of a prepared corpus (None for flat token files)."""

    path: str
    dtype: str
    splits: dict[str, TokenSplit]
    tokenizer: dict[str, Any] | None = None
    chat: dict[str, Any] | None = None  # the index's chat record (data/prepare.py), None for text

    @property
    def vocab_size(self) -> int | None:
        return int(self.tokenizer["vocab_size"]) if self.tokenizer else None


def _memmap(path: str, dtype: str, where: str) -> np.ndarray:
    check_regular(path, where, "token files are regular files")
    size = os.path.getsize(path)
    item = np.dtype(dtype).itemsize
    if size % item:
        raise bad_value(where, path, f"{size} bytes, not a whole number of {dtype} tokens ({item} bytes each)",
                        "a truncated file, or --data-dtype uint32/uint16")
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")


AGAIN = "run meshrun data prepare again"


def read_index(path: str, where: str = "--data") -> dict[str, Any]:
    """The index of the prepared corpus at ``path``, its structure checked (types, names,
    counts that add up); a one-line error naming the index otherwise."""
    name = os.path.join(path, INDEX)
    try:
        with open(name, "rb") as f:
            index = json.loads(f.read())
    except OSError as exc:
        raise bad_value(where, path, f"{name}: cannot be read ({exc.strerror})", "check its permissions") from None
    except (ValueError, RecursionError):
        raise bad_value(where, path, f"{name}: not a valid index (truncated or edited)", AGAIN) from None
    if not isinstance(index, dict):
        raise bad_value(where, path, f"{name}: a JSON {type(index).__name__}, not an index object", AGAIN)
    if index.get("format") != FORMAT:
        raise bad_value(where, path, f"{name}: format {index.get('format')!r}, this meshrun reads {FORMAT}", AGAIN)
    problem = _index_problem(index)
    if problem:
        raise bad_value(where, path, f"{name}: {problem} (truncated or edited)", AGAIN)
    return index


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _index_problem(index: dict[str, Any]) -> str | None:
    """What is wrong with an index's structure, or None."""
    if index.get("dtype") not in DTYPES:
        return f"dtype {index.get('dtype')!r}, not one of {', '.join(DTYPES)}"
    tok = index.get("tokenizer")
    if not isinstance(tok, dict) or not _count(tok.get("vocab_size")) or not tok["vocab_size"] \
            or not isinstance(tok.get("name"), str):
        return "its tokenizer is not a record with a name and a positive vocab_size"
    info = index.get("chat")
    if info is not None and (not isinstance(info, dict) or info.get("kind") not in CHAT_KINDS
                             or not isinstance(info.get("trained"), dict)):
        return f"its chat record is not one of {', '.join(CHAT_KINDS)} with its trained tokens"
    splits = index.get("splits")
    if not isinstance(splits, dict) or "train" not in splits or set(splits) - set(SPLITS):
        return f"its splits are not an object of {' and '.join(SPLITS)}"
    for split, info in splits.items():
        problem = _split_problem(split, info)
        if problem:
            return f"split {split!r}: {problem}"
    return None


def shards_problem(split: str, shards: object) -> str | None:
    """What is wrong with a split's list of shard entries (names in order, positive counts), or None."""
    if not isinstance(shards, list):
        return "its shards are not a list"
    for k, shard in enumerate(shards):
        if not isinstance(shard, dict) or shard.get("file") != shard_name(split, k):
            return f"shard {k} is not named {shard_name(split, k)!r}"
        if not all(_count(shard.get(key)) and shard[key] for key in ("tokens", "documents")):
            return f"shard {shard['file']}: its tokens and documents are not positive counts"
        if "max_id" in shard and not _count(shard["max_id"]):
            return f"shard {shard['file']}: its max_id is not a token id"
    return None


def _split_problem(split: str, info: object) -> str | None:
    if not isinstance(info, dict):
        return "not an object with a list of shards"
    problem = shards_problem(split, info.get("shards"))
    if problem:
        return problem
    for key in ("tokens", "documents"):
        if info.get(key) != sum(shard[key] for shard in info["shards"]):
            return f"{key} {info.get(key)!r}, not the sum of its shards'"
    return None


def shard_tokens(path: str, shard: dict[str, Any], dtype: str, vocab: int, where: str) -> np.ndarray:
    """A shard's tokens, memory-mapped: its byte length is the index's count exactly, and the
    largest id the index records for it is below the tokenizer's vocabulary."""
    name = os.path.join(path, shard["file"] + ".tokens")
    if not os.path.isfile(name):
        raise bad_value(where, path, f"{name} is missing, named in {INDEX}", AGAIN)
    size, item = os.path.getsize(name), np.dtype(dtype).itemsize
    if size != shard["tokens"] * item:
        raise bad_value(where, path, f"{name}: {size / item:g} tokens, its index says {shard['tokens']} "
                        "(truncated or altered)", AGAIN)
    if shard.get("max_id", -1) >= vocab:
        raise bad_value(where, path, f"{name}: its index records token id {shard['max_id']}, not below its "
                        f"tokenizer's vocabulary of {vocab}", AGAIN)
    return _memmap(name, dtype, where)


def shard_docs(path: str, shard: dict[str, Any], where: str) -> np.ndarray:
    """A shard's document starts: the index's count of them, the first 0, each after the one
    before, the last inside the shard (one vectorised pass)."""
    name = os.path.join(path, shard["file"] + ".docs")
    if not os.path.isfile(name):
        raise bad_value(where, path, f"{name} is missing, named in {INDEX}", AGAIN)
    size = os.path.getsize(name)
    if size != shard["documents"] * 8:
        raise bad_value(where, path, f"{name}: {size} bytes, its index says {shard['documents']} documents "
                        f"({shard['documents'] * 8} bytes; truncated or altered)", AGAIN)
    docs = np.fromfile(name, dtype="<i8")
    wrong = (docs < 0) | (docs >= shard["tokens"])
    wrong[0] |= docs[0] != 0
    wrong[1:] |= np.diff(docs) <= 0
    if wrong.any():
        bad = int(np.flatnonzero(wrong)[0])
        raise bad_value(where, path, f"{name}: document {bad} starts at token {int(docs[bad])}, not "
                        f"{'0' if bad == 0 else 'after the one before'} and inside the shard's {shard['tokens']} "
                        "tokens (altered)", AGAIN)
    return docs.astype(np.int64)


def shard_mask(path: str, shard: dict[str, Any], where: str) -> np.ndarray:
    """A chat shard's loss mask, memory-mapped: a byte per token of the shard."""
    name = os.path.join(path, shard["file"] + ".mask")
    if not os.path.isfile(name):
        raise bad_value(where, path, f"{name} is missing, a chat corpus' loss mask", AGAIN)
    size = os.path.getsize(name)
    if size != shard["tokens"]:
        raise bad_value(where, path, f"{name}: {size} bytes, a byte per token of the shard's {shard['tokens']} "
                        "(truncated or altered)", AGAIN)
    return np.memmap(name, dtype=np.uint8, mode="r")


def _prepared(path: str, where: str) -> Corpus:
    """The prepared corpus at ``path``, checked without reading its tokens: the index's
    structure and counts, every shard's length, every document table."""
    index = read_index(path, where)
    dtype, vocab = index["dtype"], index["tokenizer"]["vocab_size"]
    splits, chat = {}, index.get("chat")
    for split, info in index["splits"].items():
        shards, starts, masks, base = [], [], [], 0
        for shard in info["shards"]:
            tokens = shard_tokens(path, shard, dtype, vocab, where)
            starts.append(shard_docs(path, shard, where) + base)
            if chat is not None:
                masks.append(shard_mask(path, shard, where))
            shards.append(tokens)
            base += len(tokens)
        splits[split] = TokenSplit(shards, np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64),
                                   masks if chat is not None else None, chat["kind"] if chat is not None else None)
    return Corpus(path, dtype, splits, index["tokenizer"], chat)


def check_prepared(path: str, where: str = "--data") -> dict[str, Any]:
    """The index of the prepared corpus at ``path``, after every check ``open_tokens`` makes."""
    _prepared(path, where)
    return read_index(path, where)


def _flat(path: str, dtype: str, where: str) -> Corpus:
    """nanoGPT's layout: ``train.bin`` (and ``val.bin`` beside it), a single ``.bin`` file,
    or a directory of ``.bin`` shards (``val*.bin`` the validation split)."""
    if os.path.isfile(path):
        val = os.path.join(os.path.dirname(path), "val.bin")
        files = {"train": [path], "val": [val] if os.path.basename(path) == "train.bin" and os.path.isfile(val)
                 else []}
    else:
        bins = sorted(f for f in os.listdir(path) if f.endswith(".bin"))
        files = {"train": [os.path.join(path, f) for f in bins if not f.startswith("val")],
                 "val": [os.path.join(path, f) for f in bins if f.startswith("val")]}
    splits = {name: TokenSplit([_memmap(f, dtype, where) for f in fs]) for name, fs in files.items() if fs}
    return Corpus(path, dtype, splits)


SAMPLE_TOKENS = 1 << 20  # per shard, read by the sampled check of token ids
SCAN_TOKENS = 1 << 24  # tokens per block of the full scan of token ids


# The largest corpus `meshrun train` reads whole before starting to check its ids: 2 Gi tokens
# (4-8 GiB) read fast from the page cache, at the disk's read speed otherwise
# (docs/decisions.md#token-ids); past that a sample is read and every training sample is checked
# as it is read (training/loader.py).
FULL_CHECK_TOKENS = 2**31


def _blocks(n: int, full: bool) -> list[tuple[int, int]]:
    """(start, length) of the blocks of a shard of ``n`` tokens to check: all of it, or a
    sample (its first and last tokens and some in between)."""
    if full:
        return [(start, SCAN_TOKENS) for start in range(0, n, SCAN_TOKENS)]
    step, size = max(1, n // 16), SAMPLE_TOKENS // 16
    return [(start, size) for start in sorted({0, *range(0, n, step), max(0, n - size)})]


def check_ids(corpus: Corpus, vocab: int | None, where: str = "--data", full: bool = False) -> None:
    """Every token id below the model's vocabulary ``vocab`` (None: unknown) and below a
    prepared corpus' own tokenizer's, or a one-line error naming the first that is not, by file
    and offset. ``full``: every token of every shard is read (a vectorised max per block of the
    memory-mapped shards, at page-cache or disk speed: docs/decisions.md#token-ids); else a
    sample of each shard."""
    if vocab is not None and corpus.tokenizer and corpus.vocab_size is not None and corpus.vocab_size > vocab:
        raise bad_value(where, corpus.path, f"its tokenizer ({corpus.tokenizer['name']}) has {corpus.vocab_size} "
                        f"tokens, more than the model's vocabulary of {vocab}",
                        "prepare the data with the model's own tokenizer")
    if corpus.vocab_size is not None:  # (no larger than the model's: checked above)
        bound, what = corpus.vocab_size, "its tokenizer's vocabulary"
        hint = f"the shard was altered after its index was written: remove {corpus.path} and {AGAIN}"
    elif vocab is not None:
        bound, what = vocab, "the model's vocabulary"
        hint = "data made with another tokenizer, or --data-dtype uint16/uint32"
    else:
        return
    for split in corpus.splits.values():
        for shard in split.shards:
            for start, size in _blocks(len(shard), full):
                block = np.asarray(shard[start:start + size])
                if not len(block) or block.max() < bound:
                    continue
                bad = int(np.flatnonzero(block >= bound)[0])
                name = getattr(shard, "filename", None) or corpus.path
                raise bad_value(where, corpus.path, f"token id {int(block[bad])} at token {start + bad} of {name} "
                                f"is not below {what} of {bound}", hint)


def open_tokens(path: str, dtype: str = "uint16", where: str = "--data") -> Corpus:
    """The token corpus at ``path`` (``dtype``: of flat files; a prepared corpus says its own)."""
    if dtype not in DTYPES:
        raise bad_value("--data-dtype", dtype, "unknown token type", f"one of {', '.join(DTYPES)}")
    if os.path.isdir(path) and os.path.isfile(os.path.join(path, INDEX)):
        corpus = _prepared(path, where)
    else:
        corpus = _flat(path, dtype, where)
    if "train" not in corpus.splits or len(corpus.splits["train"]) < 2:
        raise bad_value(where, path, "an empty corpus: no training tokens", "prepare it from a corpus with text in it")
    return corpus
