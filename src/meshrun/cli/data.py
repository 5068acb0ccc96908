"""``meshrun data prepare``: tokenize a corpus once into the shards ``meshrun train --data``
reads."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

from ..config.sections import DataOptions
from ..data.bpe import MAX_VOCAB, MIN_VOCAB
from ..errors import require_packages
from .options import add_declared, add_option, read_one

PREPARE_HELP = f"""\
Tokenize a text corpus once, in parallel, into token shards that meshrun train --data DIR
memory-maps: each document followed by the tokenizer's end-of-document token, a held-out
validation split, and an index (meshrun-data.json: dtype, tokenizer name and hash, counts)
written last. Interrupted and run again with the same inputs and settings, it resumes from
its last complete shard; with anything changed it starts clean.

input (a file or a directory of them, read in sorted order; empty documents are skipped):
  .txt .md .text     one document per file; --ext .py reads .py files so too
  .jsonl             one document per line, its "text" field (--text-field NAME); or chat data:
                     {{"messages": [...]}} rendered with the tokenizer's chat template, or
                     {{"prompt": ..., "completion": ...}}, the loss on the replies only
  .parquet           one document per row, its text column (pyarrow)
  a saved dataset    a directory written by datasets' save_to_disk: one document per row
A directory's other files are skipped, and a line beside the summary counts them by extension.

tokenizer (local files only, nothing is downloaded):
  --tokenizer        a Hugging Face tokenizer or model directory with tokenizer.json, a
                     tokenizer.json file (a directory prepared with --train-tokenizer is one),
                     or a tiktoken encoding name (gpt2, cl100k_base, ...) in tiktoken's cache
  --train-tokenizer  a byte-level BPE of VOCAB tokens ({MIN_VOCAB} to {MAX_VOCAB}) trained on the corpus,
                     written to OUT/tokenizer.json: the same corpus gives the same tokenizer;
                     a small corpus may give fewer tokens (no pair is left that appears twice)

examples:
  meshrun data prepare corpus/ --tokenizer ~/models/Llama-3.2-1B --out data/corpus
  meshrun data prepare docs.jsonl --tokenizer tokenizer.json --text-field body --out data/docs --workers 8
  meshrun data prepare src/ --ext .py --train-tokenizer 8192 --out data/src
  meshrun train --data data/corpus --model ~/models/Llama-3.2-1B
"""


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("data", help="prepare training data: tokenize a corpus into token shards",
                       description="Training data for meshrun train. Commands: prepare.")
    dsub = p.add_subparsers(dest="data_command", metavar="prepare", required=True)
    q = dsub.add_parser("prepare", help="tokenize a corpus into token shards", description=PREPARE_HELP,
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    q.add_argument("input", help="a corpus file or directory, or a saved dataset directory")
    add_option(q, "--tokenizer", metavar="DIR|FILE|NAME", from_env=False,
               help="tokenizer directory, tokenizer.json, or tiktoken encoding name")
    add_option(q, "--train-tokenizer", type=int, metavar="VOCAB", from_env=False,
               help="with no tokenizer: train a byte-level BPE of VOCAB tokens on the corpus, into OUT/tokenizer.json")
    add_option(q, "--out", required=True, metavar="DIR", from_env=False, help="the directory to write the shards to")
    add_option(q, "--val-fraction", type=float, default=0.01, metavar="F", from_env=False,
               help="share of documents held out for validation (default 0.01)")
    add_option(q, "--workers", type=int, default=None, metavar="N", from_env=False,
               help="tokenizing processes (default: the CPUs here)")
    add_option(q, "--text-field", default="text", metavar="NAME", from_env=False,
               help="the text field of .jsonl, .parquet and saved datasets (default text)")
    add_declared(q, DataOptions, only=("ext",))
    add_option(q, "--eos-token", default=None, metavar="TOKEN", from_env=False,
               help="the end-of-document token (default: the tokenizer's own)")
    add_option(q, "--shard-tokens", type=int, default=None, metavar="N", from_env=False,
               help="tokens per training shard (default 134217728: 256 MiB in uint16)")
    q.set_defaults(func=cmd_prepare)


def cmd_prepare(ns: argparse.Namespace, env: Mapping[str, str]) -> int:
    require_packages("data prepare", ("numpy",), "data")
    from ..data.prepare import SHARD_TOKENS, PrepareSpec, prepare
    from ..data.sources import find_source, text_extensions
    from ..errors import bad_value
    from ..paths import check_path_text

    check_path_text(ns.input, "input")
    check_path_text(ns.out, "--out")
    if ns.shard_tokens is not None and ns.shard_tokens < 1:
        raise bad_value("--shard-tokens", ns.shard_tokens, "must be at least 1")
    ext, ext_source = read_one(DataOptions, "ext", ns, env)
    spec = PrepareSpec(source=find_source(ns.input, ns.text_field, "input", text_extensions(ext, ext_source)),
                       tokenizer=ns.tokenizer, out=ns.out, val_fraction=ns.val_fraction,
                       workers=ns.workers or os.cpu_count() or 1, eos_token=ns.eos_token,
                       shard_tokens=ns.shard_tokens or SHARD_TOKENS, train_vocab=ns.train_tokenizer)
    prepare(spec)
    return 0
