"""Token shards on disk, as ``meshrun data prepare`` writes them and ``meshrun train --data``
reads them, and the flat token files other tools write (nanoGPT's ``train.bin``/``val.bin``).

A prepared corpus is a directory:

    meshrun-data.json          the index, written last: format, dtype, tokenizer (name, hash,
                               vocabulary, end-of-document id), per split its shards with their
                               token and document counts, and what the corpus was made from
    train-00000.tokens ...     token ids, little-endian uint16 or uint32, end to end
    train-00000.docs ...       where each document starts in its shard (little-endian int64)
    val-00000.tokens ...

A shard is written under a temporary name and renamed when complete; the index names only
complete shards, and a directory without it is not a corpus. Shards are memory-mapped, never
read whole."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import MeshrunError, bad_value
from . import FORMAT, INDEX
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
    offsets: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.offsets = np.cumsum([0] + [len(s) for s in self.shards])

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def window(self, start: int, n: int) -> np.ndarray:
        end, out, i = start + n, [], int(np.searchsorted(self.offsets, start, side="right")) - 1
        while start < end:
            base = int(self.offsets[i])
            take = min(end, int(self.offsets[i + 1])) - start
            out.append(self.shards[i][start - base:start - base + take])
            start, i = start + take, i + 1
        return out[0] if len(out) == 1 else np.concatenate(out)

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

    @property
    def vocab_size(self) -> int | None:
        return int(self.tokenizer["vocab_size"]) if self.tokenizer else None


def _memmap(path: str, dtype: str, where: str) -> np.ndarray:
    size = os.path.getsize(path)
    item = np.dtype(dtype).itemsize
    if size % item:
        raise bad_value(where, path, f"{size} bytes, not a whole number of {dtype} tokens ({item} bytes each)",
                        "a truncated file, or --data-dtype uint32/uint16")
    if size == 0:
        return np.zeros(0, dtype=dtype)
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r")


def read_index(path: str) -> dict[str, Any]:
    with open(os.path.join(path, INDEX)) as f:
        try:
            index = json.load(f)
        except ValueError:
            raise MeshrunError(f"{os.path.join(path, INDEX)}: not a valid index (truncated or edited; "
                               "hint: run meshrun data prepare again)") from None
    if index.get("format") != FORMAT:
        raise MeshrunError(f"{os.path.join(path, INDEX)}: format {index.get('format')!r}, this meshrun reads {FORMAT}")
    return index


def _prepared(path: str, where: str) -> Corpus:
    index = read_index(path)
    dtype = index["dtype"]
    splits = {}
    for split, info in index["splits"].items():
        shards, starts, base = [], [], 0
        for shard in info["shards"]:
            tokens_path = os.path.join(path, shard["file"] + ".tokens")
            if not os.path.isfile(tokens_path):
                raise MeshrunError(f"{tokens_path} is missing, named in {INDEX} (hint: run meshrun data prepare again)")
            tokens = _memmap(tokens_path, dtype, where)
            if len(tokens) != shard["tokens"]:
                raise MeshrunError(f"{tokens_path}: {len(tokens)} tokens, its index says {shard['tokens']} "
                                   "(truncated or altered; hint: run meshrun data prepare again)")
            docs = np.fromfile(os.path.join(path, shard["file"] + ".docs"), dtype="<i8")
            shards.append(tokens)
            starts.append(docs + base)
            base += len(tokens)
        splits[split] = TokenSplit(shards, np.concatenate(starts) if starts else np.zeros(0, dtype=np.int64))
    return Corpus(path, dtype, splits, index.get("tokenizer"))


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


SAMPLE_TOKENS = 1 << 20  # per shard, read when a corpus is opened to check its ids


def check_ids(corpus: Corpus, vocab: int, where: str = "--data") -> None:
    """The first token at or above the model's vocabulary, by file and offset, among a sample
    of every shard (its first and last tokens and some in between): a one-line error."""
    if corpus.vocab_size is not None and corpus.vocab_size > vocab:
        raise bad_value(where, corpus.path, f"its tokenizer ({corpus.tokenizer['name']}) has {corpus.vocab_size} "
                        f"tokens, more than the model's vocabulary of {vocab}",
                        "prepare the data with the model's own tokenizer")
    for split in corpus.splits.values():
        for shard in split.shards:
            n = len(shard)
            if not n:
                continue
            step = max(1, n // 16)
            for start in sorted({0, *range(0, n, step), max(0, n - SAMPLE_TOKENS // 16)}):
                block = np.asarray(shard[start:start + SAMPLE_TOKENS // 16])
                bad = np.flatnonzero(block >= vocab)
                if len(bad):
                    name = getattr(shard, "filename", None) or corpus.path
                    raise bad_value(where, corpus.path, f"token id {int(block[bad[0]])} at token {start + int(bad[0])} "
                                    f"of {name} is not below the model's vocabulary of {vocab}",
                                    "data made with another tokenizer, or --data-dtype uint16/uint32")


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
