"""Chat data made here, for fine-tuning benchmarks that need conversations and a tokenizer with
a chat template but may download nothing.

    python3 bench/chat_corpus.py OUT [--conversations 4000] [--vocab 4096] [--seed 0]

Writes OUT/chat.jsonl (``messages`` records) and OUT/tokenizer.json with OUT/tokenizer_config.json
(a byte-level BPE trained on the conversations, Llama-3's header tokens, and a chat template in
Llama-3's layout whose assistant turns are in ``{% generation %}`` tags), a tokenizer directory
that both `meshrun data prepare` and transformers' ``AutoTokenizer`` read.

The conversations come from a seed alone (no word list is read from the machine), so every
host makes the same corpus: a system prompt, then one to four exchanges, each a small task on a
list of made-up words or numbers (sort them, reverse them, count them, their first letters, a
sum) and its exact answer. The lists' lengths are drawn log-uniformly from 3 to 240 items, so
conversations run from a few dozen to well over a thousand tokens; the answers follow from the
questions, so a model can learn them and the loss falls."""

from __future__ import annotations

import argparse
import json
import math
import os
import random
from collections.abc import Iterator
from typing import Any

BOS, EOS, EOT = "<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"
HEADER_START, HEADER_END = "<|start_header_id|>", "<|end_header_id|>"
SPECIAL = [BOS, EOS, HEADER_START, HEADER_END, EOT]
# Llama-3's layout: each turn a header and its content ending in <|eot_id|>; the assistant's
# content and its <|eot_id|> in generation tags, the part the loss trains
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")

SYSTEMS = ("You are a careful assistant. Answer exactly.", "Be brief.",
           "You answer questions about lists of words and numbers.",
           "Reply with the answer only, in one line where you can.")
_ONSETS = ("b", "d", "f", "g", "k", "l", "m", "n", "p", "r", "s", "t", "v", "z", "br", "st", "tr", "pl", "gr", "sh")
_VOWELS = ("a", "e", "i", "o", "u", "ai", "ou", "ea")
_CODAS = ("", "", "", "n", "r", "s", "l", "m", "k", "nd", "st")
TASKS = ("sort", "reverse", "count", "initials", "sum")
MIN_ITEMS, MAX_ITEMS = 3, 240


def words(seed: int, n: int = 1200) -> list[str]:
    """``n`` distinct made-up words of one to three syllables, drawn from ``seed``."""
    rng = random.Random(f"words-{seed}")
    out: dict[str, None] = {}
    while len(out) < n:
        syllables = rng.choice((1, 2, 2, 3))
        out["".join(rng.choice(_ONSETS) + rng.choice(_VOWELS) + rng.choice(_CODAS) for _ in range(syllables))] = None
    return list(out)


def _items(rng: random.Random) -> int:
    return int(math.exp(rng.uniform(math.log(MIN_ITEMS), math.log(MAX_ITEMS))))


def exchange(rng: random.Random, vocabulary: list[str]) -> tuple[str, str]:
    """One task and its exact answer."""
    task = rng.choice(TASKS)
    n = _items(rng)
    if task == "sum":
        numbers = [rng.randint(1, 999) for _ in range(min(n, 60))]
        return f"What is {' + '.join(map(str, numbers))}?", f"{' + '.join(map(str, numbers))} = {sum(numbers)}."
    chosen = [rng.choice(vocabulary) for _ in range(n)]
    listed = " ".join(chosen)
    if task == "sort":
        return f"Sort these words alphabetically: {listed}", " ".join(sorted(chosen))
    if task == "reverse":
        return f"Write these words in reverse order: {listed}", " ".join(reversed(chosen))
    if task == "count":
        return f"How many words are in this list? {listed}", f"There are {n} words."
    return f"Give the first letter of each word: {listed}", " ".join(w[0] for w in chosen)


def conversations(n: int, seed: int) -> Iterator[dict[str, Any]]:
    """``n`` ``messages`` records, the same for the same seed on any host."""
    vocabulary = words(seed)
    rng = random.Random(f"conversations-{seed}")
    for _ in range(n):
        messages = [{"role": "system", "content": rng.choice(SYSTEMS)}]
        for _ in range(rng.choice((1, 1, 2, 3, 4))):
            question, answer = exchange(rng, vocabulary)
            messages += [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
        yield {"messages": messages}


def write_corpus(path: str, n: int, seed: int) -> int:
    """``n`` conversations into ``path`` (JSON lines); the characters of their contents."""
    chars = 0
    with open(path, "w", encoding="utf-8") as f:
        for record in conversations(n, seed):
            f.write(json.dumps(record) + "\n")
            chars += sum(len(m["content"]) for m in record["messages"])
    return chars


def write_tokenizer(out: str, corpus: str, vocab: int, max_length: int) -> None:
    """A byte-level BPE of at most ``vocab`` tokens trained on the corpus' contents, with the
    special tokens and the chat template, into ``out`` (tokenizer.json, tokenizer_config.json).
    No post-processor: nothing is added to encoded text, the template writes <|begin_of_text|>."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts() -> Iterator[str]:
        with open(corpus, encoding="utf-8") as f:
            for line in f:
                yield from (m["content"] for m in json.loads(line)["messages"])

    tok.train_from_iterator(texts(), trainer)
    os.makedirs(out, exist_ok=True)
    tok.save(os.path.join(out, "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": EOT, "pad_token": EOS,
              "model_max_length": max_length, "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="directory for chat.jsonl and the tokenizer's files")
    ap.add_argument("--conversations", type=int, default=4000)
    ap.add_argument("--vocab", type=int, default=4096, help="the tokenizer's vocabulary, at most (default 4096)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--max-length", type=int, default=4096, help="tokenizer_config.json's model_max_length")
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    corpus = os.path.join(a.out, "chat.jsonl")
    chars = write_corpus(corpus, a.conversations, a.seed)
    write_tokenizer(a.out, corpus, a.vocab, a.max_length)
    print(f"wrote {corpus} ({a.conversations} conversations, {chars:,} characters) and a tokenizer of at most "
          f"{a.vocab} tokens in {a.out}")


if __name__ == "__main__":
    main()
