"""Chat and instruction examples packed into training sequences of ``seq_len`` tokens.

Examples go into sequences whole and in corpus order: the next example joins the current
sequence if it fits in what is left, else it starts the next one (the rest of a sequence is
padding, which trains nothing). An example longer than ``seq_len`` is cut to its first
``seq_len`` tokens (its prompt kept, the end of its reply dropped) and fills a sequence alone;
one with no trained token left in them is left out. Torch-free: the launcher counts the
sequences before any rank starts, the ranks' loader (training/loader.py) reads them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .store import TokenSplit


@dataclass(frozen=True)
class Packing:
    """The sequences of a split: ``first[i]`` is the first example of sequence i, ``first[-1]``
    one past the last (so sequence i holds ``kept[first[i]:first[i + 1]]``); ``kept``: the
    examples used, by index; ``cut``: those longer than the sequence; ``dropped``: those of
    them left out, no trained token within it."""

    first: np.ndarray
    kept: np.ndarray
    cut: int
    dropped: int

    def __len__(self) -> int:
        return len(self.first) - 1


def pack(split: TokenSplit, seq_len: int) -> Packing:
    """``split``'s examples packed into sequences of ``seq_len`` tokens (the module's rule)."""
    lengths = split.doc_lengths()
    starts = split.doc_starts if split.doc_starts is not None else np.zeros(0, dtype=np.int64)
    long = np.flatnonzero(lengths > seq_len)
    # a cut example trains the tokens at 1 .. seq_len - 1 (the first is never a target)
    dropped = [int(k) for k in long if seq_len < 2 or not split.mask_window(int(starts[k]) + 1, seq_len - 1).any()]
    kept = np.setdiff1d(np.arange(len(lengths)), np.asarray(dropped, dtype=np.int64))
    sizes = np.minimum(lengths[kept], seq_len)
    first, used = [0], 0
    for k, size in enumerate(sizes.tolist()):
        if used + size > seq_len:
            first.append(k)
            used = 0
        used += size
    if len(sizes):
        first.append(len(sizes))
    return Packing(np.asarray(first, dtype=np.int64), kept, len(long), len(dropped))


def cut_line(packing: Packing, seq_len: int, words: tuple[str, str]) -> str | None:
    """The sentence about the examples cut to the sequence, None when none was."""
    if not packing.cut:
        return None
    one, many = words
    line = (f"{packing.cut:,} {one if packing.cut == 1 else many} longer than --seq-len {seq_len} cut to their first "
            f"{seq_len} tokens")
    if packing.dropped:
        line += f"; {packing.dropped:,} of them left out, with no trained token in those"
    return line
