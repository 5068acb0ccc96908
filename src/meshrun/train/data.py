"""Data: the default corpus, random tokens, the seeds' toy set, and distributed loaders."""

from __future__ import annotations

import os
import sysconfig
from dataclasses import dataclass
from typing import Iterator

import torch
from torch.utils.data import DataLoader, Dataset, DistributedSampler, IterableDataset

VAL_FRACTION = 0.05


def stdlib_corpus_bytes(limit: int | None = None) -> bytes:
    """The running Python's standard library source, in sorted path order: a real text corpus
    (~10-30 MB) present on every machine with Python, so the default job downloads nothing.
    Every rank reads the same bytes, so no broadcast is needed."""
    root = sysconfig.get_paths()["stdlib"]
    parts: list[bytes] = []
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        for name in sorted(filenames):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), "rb") as f:
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
    """Byte-level train/validation splits (the last 5% of the corpus is held out)."""
    data = torch.frombuffer(bytearray(stdlib_corpus_bytes()), dtype=torch.uint8)
    cut = int(len(data) * (1 - VAL_FRACTION))
    return TokenChunks(data[:cut], seq_len), TokenChunks(data[cut:], seq_len)


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
    """The seeds' MyTrainDataset: 20 features -> 1 target, a noisy linear function."""

    def __init__(self, n: int = 2048, seed: int = 1234) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 20, generator=g)
        self.y = self.x @ torch.randn(20, 1, generator=g) + 0.1 * torch.randn(n, 1, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


class ShardedIterable(IterableDataset):
    """Every ``world``-th item of an iterable dataset, so ranks never see the same item."""

    def __init__(self, source: IterableDataset, rank: int, world: int) -> None:
        self.source, self.rank, self.world = source, rank, world

    def __iter__(self) -> Iterator:
        for i, item in enumerate(self.source):
            if i % self.world == self.rank:
                yield item


@dataclass(frozen=True)
class LoaderSpec:
    micro_batch: int
    dp_rank: int
    dp_size: int
    seed: int
    pin_memory: bool
    shuffle: bool = True


def make_loader(dataset: Dataset, spec: LoaderSpec) -> DataLoader:
    """A DataLoader whose batches are this data-parallel rank's share.

    Map-style data goes through DistributedSampler (call ``sampler.set_epoch`` each epoch);
    drop_last keeps every micro-batch the same size on every rank, which the loss average
    over the global batch relies on."""
    if isinstance(dataset, IterableDataset):
        return DataLoader(ShardedIterable(dataset, spec.dp_rank, spec.dp_size), batch_size=spec.micro_batch,
                          drop_last=True, pin_memory=spec.pin_memory)
    sampler = DistributedSampler(dataset, num_replicas=spec.dp_size, rank=spec.dp_rank, shuffle=spec.shuffle,
                                 seed=spec.seed, drop_last=True)
    return DataLoader(dataset, batch_size=spec.micro_batch, sampler=sampler, drop_last=True,
                      pin_memory=spec.pin_memory)


def batches(loader: DataLoader) -> Iterator:
    """Endless batches: a new epoch (and a new shuffle, the same on every rank) after each pass."""
    epoch = 0
    while True:
        if isinstance(loader.sampler, DistributedSampler):
            loader.sampler.set_epoch(epoch)
        empty = True
        for batch in loader:
            empty = False
            yield batch
        if empty:
            raise RuntimeError("the data loader yielded no batch")  # guarded earlier by config checks
        epoch += 1
