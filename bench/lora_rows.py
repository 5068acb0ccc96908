"""The peer's training rows for bench/lora_bench.py: the chat corpus encoded by transformers
and packed into sequences, in the order meshrun's trainer reads its own, and checked equal to
meshrun's.

Each conversation is rendered and tokenized by transformers' ``apply_chat_template`` with
``return_assistant_tokens_mask`` (the tokens inside the template's ``{% generation %}`` tags
train), then packed by the rule docs/guide.md states for chat data ("Packing"): examples whole
and in corpus order, the next joining the sequence if it fits in what is left, else starting the
next one; an example longer than the sequence cut to its first ``seq`` tokens and alone in its
sequence, left out if no trained token is left in it; the rest of a sequence padding (the
end-of-document token, no loss). A row holds ``input_ids``, ``labels`` (the token where it is
trained, else -100, the first token of each example never: Hugging Face models shift labels by
one themselves) and ``position_ids`` restarting at each example and at the padding (from which
transformers builds the document mask when no attention mask is given).

The rows are taken in the order of meshrun's sampler (``ResumableSampler``: one shuffle of the
sequences from the run's seed), so global step k of either trainer trains on rows
[k x B, (k + 1) x B) of B = the global batch, whatever the number of processes. ``compare``
checks them against what meshrun's loader serves from its prepared corpus of the same file."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

Example = tuple[np.ndarray, np.ndarray]  # (token ids, 1 where the token trains)


def hf_examples(tokenizer_dir: str, corpus: str) -> list[Example]:
    """Every conversation of ``corpus`` as transformers' chat template tokenizes and masks it."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    out = []
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            enc: Any = tok.apply_chat_template(json.loads(line)["messages"], tokenize=True, return_dict=True,
                                          return_assistant_tokens_mask=True)
            out.append((np.asarray(enc["input_ids"], dtype=np.int64), np.asarray(enc["assistant_masks"], dtype=bool)))
    return out


def pack(examples: list[Example], seq: int) -> list[list[int]]:
    """The examples of each sequence, by index (the module's rule)."""
    groups: list[list[int]] = []
    used = seq + 1  # no sequence open yet
    for k, (ids, mask) in enumerate(examples):
        if len(ids) > seq and not mask[1:seq].any():
            continue  # cut, nothing trained is left
        size = min(len(ids), seq)
        if used + size > seq:
            groups.append([])
            used = 0
        groups[-1].append(k)
        used += size
    return groups


def row(examples: list[Example], group: list[int], seq: int, pad_id: int) -> dict[str, np.ndarray]:
    """One packed sequence: input_ids, labels, position_ids."""
    ids = np.full(seq, pad_id, dtype=np.int64)
    labels = np.full(seq, -100, dtype=np.int64)
    positions = np.arange(seq, dtype=np.int64)
    at = 0
    for k in group:
        tokens, mask = examples[k]
        n = min(len(tokens), seq)
        ids[at:at + n] = tokens[:n]
        labels[at + 1:at + n] = np.where(mask[1:n], tokens[1:n], -100)
        positions[at:at + n] = np.arange(n)
        at += n
    positions[at:] = np.arange(seq - at)
    return {"input_ids": ids, "labels": labels, "position_ids": positions}


def meshrun_order(n: int, seed: int) -> list[int]:
    """The order meshrun's sampler reads ``n`` sequences in, in its first epoch."""
    from meshrun.training.loader import ResumableSampler

    return list(ResumableSampler(n, rank=0, world=1, seed=seed, shuffle=True))


def build(tokenizer_dir: str, corpus: str, seq: int, pad_id: int, count: int, seed: int) -> dict[str, Any]:
    """The first ``count`` rows in meshrun's order, as arrays of shape (count, seq), with the
    sequence indices they came from (``index``) and the corpus' count of sequences (``sequences``).
    Raises ValueError when the corpus packs into fewer than ``count`` sequences."""
    examples = hf_examples(tokenizer_dir, corpus)
    groups = pack(examples, seq)
    if len(groups) < count:
        raise ValueError(f"{corpus} packs into {len(groups)} sequences of {seq} tokens, fewer than the {count} "
                         "the run reads")
    order = meshrun_order(len(groups), seed)[:count]
    rows = [row(examples, groups[i], seq, pad_id) for i in order]
    trained = sum(int((r["labels"] != -100).sum()) for r in rows)
    return {**{key: np.stack([r[key] for r in rows]) for key in rows[0]}, "index": np.asarray(order),
            "sequences": len(groups), "examples": len(examples), "trained_tokens": trained}


def compare(rows: dict[str, Any], prepared: str, seq: int) -> dict[str, Any]:
    """``rows`` against meshrun's loader on its prepared corpus ``prepared``: the same count of
    sequences, and for each row the same inputs, positions and targets (meshrun's targets are
    already shifted: its target at t is the label at t + 1). Counts of the rows that differ."""
    import torch

    from meshrun.training.loader import corpus_splits

    train, _ = corpus_splits(prepared, seq, document_mask=True)
    differ = {"input_ids": 0, "position_ids": 0, "labels": 0}
    for i, k in enumerate(rows["index"].tolist()):
        x, y, positions = train[k]
        labels = torch.from_numpy(rows["labels"][i])
        differ["input_ids"] += not torch.equal(x, torch.from_numpy(rows["input_ids"][i]))
        differ["position_ids"] += not torch.equal(positions, torch.from_numpy(rows["position_ids"][i]))
        differ["labels"] += not (torch.equal(y[:-1], labels[1:]) and int(y[-1]) == -100)
    return {"meshrun_sequences": len(train), "peer_sequences": rows["sequences"], "rows": len(rows["index"]),
            "rows_differing": differ,
            "same": len(train) == rows["sequences"] and not any(differ.values())}
