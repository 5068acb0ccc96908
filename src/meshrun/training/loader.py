"""Data: the default corpus, token corpora (``meshrun.data``'s shards, flat token files) packed into
sequences, random tokens, pytorch/examples' toy set, and distributed loaders."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from ..data.sources import STDLIB_VAL_FRACTION, stdlib_files
from ..errors import MeshrunError


def stdlib_corpus_bytes(limit: int | None = None) -> bytes:
    """The running Python's standard library source, in sorted path order: a real text corpus
    (~10-30 MB) present on every machine with Python, so the default job downloads nothing.
    Every rank reads the same bytes, so no broadcast is needed."""
    parts: list[bytes] = []
    total = 0
    for path in stdlib_files():
        with open(path, "rb") as f:
            parts.append(f.read())
        total += len(parts[-1])
        if limit is not None and total >= limit:
            return b"\n".join(parts)[:limit]
    return b"\n".join(parts)


class TokenChunks(Dataset):
    """Non-overlapping windows of ``seq_len`` tokens; targets are inputs shifted by one."""

    def __init__(self, tokens: torch.Tensor, seq_len: int) -> None:
        self.tokens, self.seq_len = tokens, seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        start = i * self.seq_len
        window = self.tokens[start:start + self.seq_len + 1].long()
        return window[:-1], window[1:]


def stdlib_splits(seq_len: int) -> tuple[TokenChunks, TokenChunks]:
    """Byte-level training/validation splits (the last 5% of the corpus is held out)."""
    data = torch.frombuffer(bytearray(stdlib_corpus_bytes()), dtype=torch.uint8)
    cut = int(len(data) * (1 - STDLIB_VAL_FRACTION))
    return TokenChunks(data[:cut], seq_len), TokenChunks(data[cut:], seq_len)


class PackedTokens(Dataset):
    """Sequences of exactly ``seq_len`` tokens cut end to end from a token stream, across
    documents and shards (targets: the inputs shifted by one). With ``document_mask`` each
    sample also carries position ids that restart at every document's first token (and at the
    sample's first: a document begun earlier could pass the model's context), and the
    target of a document's last token (the next document's first) is ignored (-100): the
    model attends and predicts within documents only."""

    def __init__(self, split: Any, seq_len: int, document_mask: bool = False, vocab: int | None = None) -> None:
        self.split, self.seq_len, self.document_mask, self.vocab = split, seq_len, document_mask, vocab

    def __len__(self) -> int:
        return max(0, (len(self.split) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        start = i * self.seq_len
        window = torch.from_numpy(self.split.window(start, self.seq_len + 1).astype("int64"))
        if self.vocab is not None and int(window.max()) >= self.vocab:  # (a corpus too large to read whole first)
            bad = int(torch.nonzero(window >= self.vocab)[0])
            raise MeshrunError(f"token id {int(window[bad])} at token {start + bad} of the corpus is not below the "
                               f"model's vocabulary of {self.vocab} (hint: data made with another tokenizer, or "
                               "altered after it was prepared)")
        x, y = window[:-1], window[1:].clone()
        if not self.document_mask:
            return x, y
        starts = torch.from_numpy(self.split.starts_in(start, self.seq_len + 1))
        begins = torch.zeros(self.seq_len + 1, dtype=torch.bool)
        begins[starts] = True
        y[begins[1:]] = -100  # a target in the next document
        index = torch.arange(self.seq_len)
        last_start = torch.cummax(torch.where(begins[:-1], index, torch.zeros_like(index)), dim=0).values
        return x, y, index - last_start


class PackedExamples(PackedTokens):
    """Chat or instruction examples (a prepared corpus with loss masks) packed whole into
    sequences of ``seq_len`` tokens (data/packing.py's rule), padded with ``pad_id``. Each
    sample: the inputs, the targets (the next token where the loss mask trains it, else -100;
    never across an example's end) and position ids restarting at every example (and at the
    padding), so with document masking no example attends to another."""

    def __init__(self, split: Any, seq_len: int, pad_id: int, vocab: int | None = None) -> None:
        from ..data.packing import pack

        super().__init__(split, seq_len, document_mask=True, vocab=vocab)
        self.pad_id, self.packing = pad_id, pack(split, seq_len)
        self.starts, self.lengths = split.doc_starts, split.doc_lengths()

    def __len__(self) -> int:
        return len(self.packing)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, ...]:
        t = self.seq_len
        x = torch.full((t,), self.pad_id, dtype=torch.int64)
        y = torch.full((t,), -100, dtype=torch.int64)
        positions = torch.arange(t)
        at = 0
        lo, hi = int(self.packing.first[i]), int(self.packing.first[i + 1])
        for k in self.packing.kept[lo:hi].tolist():
            start, n = int(self.starts[k]), min(int(self.lengths[k]), t)
            ids = torch.from_numpy(self.split.window(start, n).astype("int64"))
            trained = torch.from_numpy(self.split.mask_window(start, n).astype(bool))
            x[at:at + n] = ids
            y[at:at + n - 1] = torch.where(trained[1:], ids[1:], -100)
            positions[at:at + n] = torch.arange(n)
            at += n
        positions[at:] = torch.arange(t - at)  # the padding: a document of its own
        if self.vocab is not None and int(x.max()) >= self.vocab:
            raise MeshrunError(f"token id {int(x.max())} in training sequence {i} is not below the model's "
                               f"vocabulary of {self.vocab} (hint: data made with another tokenizer)")
        return x, y, positions


def corpus_splits(path: str, seq_len: int, document_mask: bool, dtype: str = "uint16",
                  vocab: int | None = None) -> tuple[PackedTokens, PackedTokens | None]:
    """(train, validation) of a token corpus (a prepared directory or flat token files),
    checked against the model's vocabulary; validation None when the corpus has none. Chat
    data are packed by example (PackedExamples), with document masking whatever asked."""
    from ..data.store import check_ids, open_tokens

    corpus = open_tokens(path, dtype)
    if vocab is not None:
        check_ids(corpus, vocab)
    if corpus.chat is not None:
        pad = int(corpus.tokenizer["eos_id"]) if corpus.tokenizer else 0
        val_split = corpus.splits.get("val")
        val_set = PackedExamples(val_split, seq_len, pad, vocab) if val_split is not None and len(val_split) else None
        return PackedExamples(corpus.splits["train"], seq_len, pad, vocab), val_set if val_set else None
    if document_mask and corpus.splits["train"].doc_starts is None:
        raise MeshrunError(f"--document-mask: {path} records no document boundaries (flat token files) "
                           "(hint: prepare the corpus with meshrun data prepare)")
    val = corpus.splits.get("val")
    return (PackedTokens(corpus.splits["train"], seq_len, document_mask, vocab),
            PackedTokens(val, seq_len, document_mask, vocab) if val is not None and len(val) > seq_len else None)


class RandomTokens(Dataset):
    """Random tokens, the benchmarks' data (a fixed seed per index: same on every run)."""

    def __init__(self, n: int, seq_len: int, vocab: int) -> None:
        self.n, self.seq_len, self.vocab = n, seq_len, vocab

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(i)
        window = torch.randint(0, self.vocab, (self.seq_len + 1,), generator=g)
        return window[:-1], window[1:]


class ToyRegression(Dataset):
    """pytorch/examples' MyTrainDataset (distributed/ddp-tutorial-series): 20 features -> 1 target,
    a noisy linear function."""

    def __init__(self, n: int = 2048, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 20, generator=g)
        self.y = self.x @ torch.randn(20, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class ShardedIterable(IterableDataset):
    """Every ``world``-th item of an iterable dataset, so ranks never see the same item;
    ``skip`` items of this rank's share are passed over (a resumed run)."""

    def __init__(self, source: IterableDataset, rank: int, world: int, skip: int = 0) -> None:
        self.source, self.rank, self.world, self.skip = source, rank, world, skip

    def __iter__(self) -> Iterator:
        mine = (item for i, item in enumerate(self.source) if i % self.world == self.rank)
        for j, item in enumerate(mine):
            if j >= self.skip:
                yield item


class ResumableSampler(Sampler[int]):
    """DistributedSampler's split, resumable mid-epoch on any world size.

    One shuffled order per epoch (seeded by seed + epoch, the same on every rank); rank r
    takes every world-th index of it, starting ``start`` samples in. With start 0 this is
    exactly DistributedSampler(drop_last=True). Because the position is counted in global
    samples, a run saved on N ranks continues on M ranks with the very same sample order.
    """

    def __init__(self, n: int, rank: int, world: int, seed: int, shuffle: bool) -> None:
        self.n, self.rank, self.world, self.seed, self.shuffle = n, rank, world, seed, shuffle
        self.epoch, self.start = 0, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def set_start(self, samples: int) -> None:
        self.start = samples

    def _usable(self) -> int:
        remaining = max(0, self.n - self.start)
        return remaining - remaining % self.world

    def __iter__(self) -> Iterator[int]:
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.n, generator=g).tolist()
        else:
            order = list(range(self.n))
        return iter(order[self.start + self.rank:self.start + self._usable():self.world])

    def __len__(self) -> int:
        return self._usable() // self.world


@dataclass(frozen=True)
class LoaderSpec:
    micro_batch: int
    dp_rank: int
    dp_size: int
    seed: int
    pin_memory: bool
    shuffle: bool = True


def make_loader(dataset: Dataset, spec: LoaderSpec, skip: int = 0) -> DataLoader:
    """A DataLoader whose batches are this data-parallel rank's share (drop_last keeps every
    micro-batch the same size on every rank, which the global loss average relies on)."""
    if isinstance(dataset, IterableDataset):
        return DataLoader(ShardedIterable(dataset, spec.dp_rank, spec.dp_size, skip), batch_size=spec.micro_batch,
                          drop_last=True, pin_memory=spec.pin_memory)
    sampler = ResumableSampler(len(dataset), spec.dp_rank, spec.dp_size, spec.seed, spec.shuffle)  # type: ignore[arg-type]
    return DataLoader(dataset, batch_size=spec.micro_batch, sampler=sampler, drop_last=True,
                      pin_memory=spec.pin_memory)


class BatchStream:
    """Endless micro-batches that know their position: the epoch, and the global samples
    read in it (micro-batch x data-parallel size per micro-step, all ranks in lockstep).
    A new epoch (a new shuffle, the same on every rank) starts after each pass."""

    def __init__(self, loader: DataLoader, micro: int, world: int, epoch: int = 0, samples: int = 0) -> None:
        self.loader, self.micro, self.world = loader, micro, world
        self.epoch, self.samples = epoch, samples
        self._it: Iterator | None = None

    def _start_epoch(self) -> None:
        sampler = self.loader.sampler
        if isinstance(sampler, ResumableSampler):
            sampler.set_epoch(self.epoch)
            sampler.set_start(self.samples)
        self._it = iter(self.loader)

    def __iter__(self) -> BatchStream:
        return self

    def __next__(self) -> Any:
        if self._it is None:
            self._start_epoch()
        for _ in range(2):
            try:
                batch = next(self._it)  # type: ignore[arg-type]
            except StopIteration:
                self.epoch, self.samples = self.epoch + 1, 0
                self._start_epoch()
                continue
            self.samples += self.micro * self.world
            return batch
        raise RuntimeError("the data loader yielded no batch")  # guarded earlier by config checks


