"""A tokenizer trained on the corpus being prepared (``meshrun data prepare --train-tokenizer
VOCAB``), for a corpus with no tokenizer at hand: a byte-level BPE, trained here by the
``tokenizers`` library, nothing downloaded.

Its vocabulary is the 256 bytes, the end-of-document token ``<|endoftext|>`` and then the
merges of the pairs of tokens most frequent in the corpus (inside the words GPT-2's
pre-tokenizer cuts), up to VOCAB tokens in all. Training stops sooner when no pair is left that
appears at least MIN_PAIR_COUNT times: a small corpus gets a smaller vocabulary, which the
preparation's line and the index give. The same corpus and VOCAB give the same file, byte for
byte, with one version of the library (the index records it)."""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator
from typing import Any

from ..errors import bad_value

EOS = "<|endoftext|>"
MIN_VOCAB = 257  # the 256 bytes and the end-of-document token: a byte-level tokenizer with no merge
MAX_VOCAB = 1 << 16  # token ids stay uint16: 2 bytes a token in the shards
MIN_PAIR_COUNT = 2  # a pair seen once is one word's spelling, not a pattern of the corpus
KIND = "byte-level BPE"
FILE = "tokenizer.json"  # written into the prepared directory


def check_vocab(vocab: int, where: str = "--train-tokenizer") -> None:
    """``vocab`` is a vocabulary size this trains, and the library to train it is installed."""
    if not MIN_VOCAB <= vocab <= MAX_VOCAB:
        raise bad_value(where, vocab, f"must be between {MIN_VOCAB} and {MAX_VOCAB}",
                        f"the vocabulary size in tokens: {MIN_VOCAB} is the 256 bytes and the end-of-document token, "
                        f"{MAX_VOCAB} keeps token ids 2 bytes; e.g. 8192")
    if importlib.util.find_spec("tokenizers") is None:
        raise bad_value(where, vocab, "training a tokenizer needs the tokenizers library, not installed here",
                        "pip install 'meshrun[data]'")


def identity(vocab: int) -> dict[str, Any]:
    """What a trained tokenizer is made from, besides the corpus: how it is trained and by
    which version of the library."""
    import tokenizers

    return {"train": KIND, "vocab_size": vocab, "min_pair_count": MIN_PAIR_COUNT, "eos": EOS,
            "tokenizers": tokenizers.__version__}


def train(texts: Iterator[str], vocab: int) -> str:
    """A byte-level BPE of at most ``vocab`` tokens trained on ``texts``: its tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, min_frequency=MIN_PAIR_COUNT, special_tokens=[EOS],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    return str(tok.to_str(pretty=True))
