"""Text given to ``meshrun train --data`` is tokenized once, into a cache directory keyed by
the corpus (paths, sizes, modification times), the tokenizer's hash and the text field; a
later run with the same inputs finds it ready; runs tokenizing the same corpus at once take
turns (the first tokenizes, the others wait for it)."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Mapping

from .prepare import PrepareSpec, prepare
from .sources import find_source
from .tokenizer import load_tokenizer

VAL_FRACTION = 0.01


def cache_root(env: Mapping[str, str]) -> str:
    """MESHRUN_CACHE, else $XDG_CACHE_HOME/meshrun, else ~/.cache/meshrun."""
    if env.get("MESHRUN_CACHE"):
        return env["MESHRUN_CACHE"]
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "meshrun")


def tokens_for_text(path: str, tokenizer: str, text_field: str, env: Mapping[str, str], workers: int,
                    where: str = "--data") -> str:
    """The prepared directory of the text corpus at ``path`` (made now if it is not ready)."""
    source = find_source(path, text_field, where)
    tok = load_tokenizer(tokenizer)
    key = hashlib.sha256(json.dumps([source.fingerprint(), source.dataset, text_field, tok.sha256,
                                     VAL_FRACTION]).encode()).hexdigest()[:20]
    out = os.path.join(cache_root(env), "tokens", key)
    # another run tokenizing the same corpus (another node on a shared cache): wait for it, then find it ready
    prepare(PrepareSpec(source=source, tokenizer=tokenizer, out=out, val_fraction=VAL_FRACTION, workers=workers,
                        out_name="cache directory"), wait=True)
    return out
