"""A tokenizer named on the command line, loaded from local files only: a Hugging Face
tokenizer directory (or a model directory) holding ``tokenizer.json``, a ``tokenizer.json``
file (both through the ``tokenizers`` library), or a tiktoken encoding name whose file is
already in tiktoken's cache (tiktoken would otherwise download it)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypedDict

from ..errors import MeshrunError, bad_value, first_line

# End-of-document tokens by the names tokenizers give them, tried in this order when the
# tokenizer's own config names none.
EOS_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eot_id|>", "<|im_end|>")
TIKTOKEN_NAMES = ("gpt2", "r50k_base", "p50k_base", "p50k_edit", "cl100k_base", "o200k_base")


class TokenizerRecord(TypedDict):
    """A tokenizer as a prepared corpus' index records it."""

    name: str
    sha256: str
    vocab_size: int
    eos_id: int


@dataclass(frozen=True)
class Tokenizer:
    """What the data needs of a tokenizer: its name and content hash (recorded with the
    tokens), its vocabulary size, its end-of-document id, and batch encode/decode."""

    name: str
    sha256: str
    vocab_size: int
    eos_id: int
    encode_batch: Callable[[list[str]], list[list[int]]]
    decode: Callable[[list[int]], str]

    @property
    def dtype(self) -> str:
        return "uint16" if self.vocab_size <= 1 << 16 else "uint32"

    def record(self) -> TokenizerRecord:
        return {"name": self.name, "sha256": self.sha256, "vocab_size": self.vocab_size, "eos_id": self.eos_id}


def _eos_from_config(directory: str) -> str | None:
    path = os.path.join(directory, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            eos = json.load(f).get("eos_token")
    except (OSError, ValueError, RecursionError):
        return None
    if isinstance(eos, dict):
        eos = eos.get("content")
    return eos if isinstance(eos, str) else None


def _from_tokenizer_json(path: str, where: str, eos_token: str | None) -> Tokenizer:
    try:
        from tokenizers import Tokenizer as HFTokenizer
    except ImportError:
        raise bad_value(where, path, "reading a tokenizer.json needs the tokenizers library, not installed here",
                        "pip install 'meshrun[data]'") from None
    try:
        tok = HFTokenizer.from_file(path)
    except Exception as exc:  # the library's own words: an unreadable or foreign file
        raise bad_value(where, path, f"not a tokenizers file ({first_line(str(exc), 120)})",
                        "give a Hugging Face tokenizer directory or its tokenizer.json") from None
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()
    names = [eos_token] if eos_token else [n for n in (_eos_from_config(os.path.dirname(path)), *EOS_NAMES) if n]
    eos = next((i for i in (tok.token_to_id(n) for n in names) if i is not None), None)
    if eos is None:
        raise bad_value(where, path, f"no end-of-document token among {', '.join(names)}",
                        "name it with --eos-token")
    return Tokenizer(name=os.path.abspath(path), sha256=digest, vocab_size=tok.get_vocab_size(with_added_tokens=True),
                     eos_id=eos,
                     encode_batch=lambda texts: [e.ids for e in tok.encode_batch(texts, add_special_tokens=False)],
                     decode=lambda ids: tok.decode(ids, skip_special_tokens=False))


def _from_tiktoken(name: str, where: str) -> Tokenizer:
    try:
        import tiktoken
        import tiktoken.load as tiktoken_load
    except ImportError:
        raise bad_value(where, name, "a tiktoken encoding needs tiktoken, not installed here",
                        "pip install tiktoken, or give a tokenizer.json") from None

    def no_download(blobpath: str) -> bytes:
        raise MeshrunError(f"{where}={name!r}: tiktoken's file for it is not in its cache and meshrun never "
                           f"downloads (hint: fetch it once where there is a network, e.g. python -c \"import "
                           f"tiktoken; tiktoken.get_encoding('{name}')\", and point TIKTOKEN_CACHE_DIR at the cache)")

    fetch = tiktoken_load.read_file
    tiktoken_load.read_file = no_download  # read_file_cached calls it only for what its cache lacks
    try:
        enc = tiktoken.get_encoding(name)
    finally:
        tiktoken_load.read_file = fetch
    ranks = getattr(enc, "_mergeable_ranks", {})
    digest = hashlib.sha256(b"".join(sorted(ranks)) + name.encode()).hexdigest()
    return Tokenizer(name=f"tiktoken:{name}", sha256=digest, vocab_size=enc.n_vocab, eos_id=enc.eot_token,
                     encode_batch=lambda texts: enc.encode_ordinary_batch(texts), decode=enc.decode)


def load_tokenizer(spec: str, where: str = "--tokenizer", eos_token: str | None = None) -> Tokenizer:
    """The tokenizer ``spec`` names (see the module's docstring); one-line errors otherwise."""
    path = os.path.expanduser(spec)
    if os.path.isdir(path):
        file = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(file):
            raise bad_value(where, spec, "a directory without tokenizer.json",
                            "a Hugging Face tokenizer directory (save_pretrained writes tokenizer.json)")
        return _from_tokenizer_json(file, where, eos_token)
    if os.path.isfile(path):
        return _from_tokenizer_json(path, where, eos_token)
    if spec in TIKTOKEN_NAMES:
        return _from_tiktoken(spec, where)
    raise bad_value(where, spec, "neither a tokenizer directory or file nor a tiktoken encoding",
                    f"a directory with tokenizer.json, a tokenizer.json, or one of {', '.join(TIKTOKEN_NAMES)}")
