"""A real text corpus that ships with Python, prepared for `meshrun train --data`: every
module source of the running interpreter's standard library (one document per file), a
byte-level BPE tokenizer trained on them, and `meshrun data prepare`'s shards.

    python3 bench/corpus.py /tmp/corpus [--vocab 8192] [--workers 8]
    meshrun train --data /tmp/corpus/data --document-mask ...

Nothing is downloaded: the text is the interpreter's own, so the same Python gives the same
corpus. Prints one line ``CORPUS {json}``: documents, characters, the tokenizer's vocabulary
and the prepared directory. Real documents of uneven length (a few hundred to tens of
thousands of tokens) are what document masking and loss curves need; random tokens have no
documents and no structure to learn.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig


def stdlib_sources() -> list[str]:
    """The standard library's .py files, sorted, without site-packages and tests' data."""
    root = sysconfig.get_paths()["stdlib"]
    found = []
    for top, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d not in ("site-packages", "dist-packages", "__pycache__"))
        found += [os.path.join(top, f) for f in sorted(files) if f.endswith(".py")]
    return found


def write_documents(out: str) -> tuple[str, int, int]:
    """OUT/docs.jsonl, one {"text": source} per file; (path, documents, characters)."""
    path = os.path.join(out, "docs.jsonl")
    n = chars = 0
    with open(path, "w", encoding="utf-8") as f:
        for source in stdlib_sources():
            try:
                text = open(source, encoding="utf-8").read()
            except (UnicodeDecodeError, OSError):
                continue
            if text.strip():
                f.write(json.dumps({"text": text}) + "\n")
                n, chars = n + 1, chars + len(text)
    return path, n, chars


def train_tokenizer(docs: str, out: str, vocab: int) -> str:
    """A byte-level BPE tokenizer of ``vocab`` tokens with <|endoftext|>, trained on the documents."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())

    def texts():
        with open(docs, encoding="utf-8") as f:
            for line in f:
                yield json.loads(line)["text"]

    tok.train_from_iterator(texts(), trainer)
    path = os.path.join(out, "tokenizer")
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    return path


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="directory for docs.jsonl, tokenizer/ and data/")
    ap.add_argument("--vocab", type=int, default=8192, help="the tokenizer's vocabulary (default 8192)")
    ap.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1))
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)
    docs, n, chars = write_documents(a.out)
    tok = train_tokenizer(docs, a.out, a.vocab)
    data = os.path.join(a.out, "data")
    cmd = [sys.executable, "-m", "meshrun", "data", "prepare", docs, "--tokenizer", tok, "--out", data,
           "--workers", str(a.workers)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode:
        sys.stderr.write(res.stdout + res.stderr)
        return res.returncode
    index = json.load(open(os.path.join(data, "meshrun-data.json")))
    print("CORPUS " + json.dumps({"documents": n, "chars": chars, "vocab": a.vocab, "data": data,
                                  "python": sys.version.split()[0],
                                  **{k: v for k, v in index.items() if k in ("splits", "dtype")}}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
