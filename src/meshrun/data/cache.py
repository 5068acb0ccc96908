"""Text given to ``meshrun train --data`` is tokenized once, into a cache directory keyed by
the corpus (paths, sizes, modification times), the extensions read as text (--ext), the
tokenizer's hash and the text field (chat data: also their kind and the chat template's
hash); a later run with the same inputs finds it ready; runs tokenizing the same corpus at
once take turns (the first tokenizes, the others wait for it)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping

from .chat import load_template, needs_template
from .prepare import PrepareSpec, prepare
from .sources import Source, find_source
from .tokenizer import load_tokenizer

VAL_FRACTION = 0.01


def cache_root(env: Mapping[str, str]) -> str:
    """MESHRUN_CACHE, else $XDG_CACHE_HOME/meshrun, else ~/.cache/meshrun."""
    if env.get("MESHRUN_CACHE"):
        return env["MESHRUN_CACHE"]
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "meshrun")


def cache_key(source: Source, tokenizer_sha256: str, template_sha256: str | None = None) -> str:
    """The name of a text corpus' cache directory: the corpus' files and how they are read (the
    extensions --ext added, the text field), the tokenizer and the validation fraction; for chat
    data also its kind and the chat template it is rendered with."""
    parts: list[object] = [source.fingerprint(), source.dataset, source.text_field, tokenizer_sha256, VAL_FRACTION,
                           list(source.extensions)]
    if source.chat is not None:
        parts += [source.chat, template_sha256]
    return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:20]


def tokens_for_text(path: str, tokenizer: str, text_field: str, env: Mapping[str, str], workers: int,
                    where: str = "--data", extensions: tuple[str, ...] = (),
                    tokenizer_where: str = "--tokenizer") -> str:
    """The prepared directory of the text corpus at ``path`` (made now if it is not ready);
    ``extensions``: files read as text besides the default ones (--ext)."""
    source = find_source(path, text_field, where, extensions)
    tok = load_tokenizer(tokenizer, tokenizer_where)
    template = load_template(tokenizer, tokenizer_where) if needs_template(source.chat) else None
    out = os.path.join(cache_root(env), "tokens",
                       cache_key(source, tok.sha256, template.sha256 if template is not None else None))
    # another run tokenizing the same corpus (another node on a shared cache): wait for it, then find it ready
    prepare(PrepareSpec(source=source, tokenizer=tokenizer, out=out, val_fraction=VAL_FRACTION, workers=workers,
                        out_name="cache directory", tokenizer_name=tokenizer_where), wait=True)
    return out
