"""How fast meshrun's loader serves packed sequences to one rank: a token corpus memory-mapped,
cut into sequences, shuffled, collated into micro-batches (``meshrun.training.loader``: PackedTokens,
make_loader), timed on the host. Compare with a training step: the loader keeps up when a
micro-batch takes far less than the device's step.

    python3 bench/loader_bench.py                          # a random 128M-token corpus in /tmp
    python3 bench/loader_bench.py --data DIR --document-mask --micro 128 --seq 1024

Prints one ``RESULT {json}`` line: tokens/s, milliseconds per micro-batch (median).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", default=None, help="a prepared corpus or token file (default: random tokens)")
    ap.add_argument("--tokens", type=int, default=1 << 27, help="size of the random corpus (default 128M)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=128)
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--document-mask", action="store_true")
    ap.add_argument("--doc-tokens", type=int, default=600, help="random corpus: mean document length")
    a = ap.parse_args()
    import numpy as np

    from meshrun.data.store import TokenSplit, open_tokens
    from meshrun.training.loader import BatchStream, LoaderSpec, PackedTokens, make_loader

    if a.data:
        split = open_tokens(a.data).splits["train"]
    else:
        path = os.path.join(tempfile.gettempdir(), f"meshrun-loader-{a.tokens}.bin")
        if not os.path.exists(path):
            np.random.default_rng(0).integers(0, 50257, a.tokens, dtype=np.uint16).tofile(path)
        starts = np.cumsum(np.random.default_rng(1).integers(1, 2 * a.doc_tokens, a.tokens // a.doc_tokens))
        split = TokenSplit([np.memmap(path, dtype="<u2", mode="r")], np.concatenate([[0], starts[starts < a.tokens]]))
    data = PackedTokens(split, a.seq, a.document_mask)
    loader = make_loader(data, LoaderSpec(a.micro, 0, 1, seed=0, pin_memory=False))
    stream = BatchStream(loader, a.micro, 1)  # as the trainer reads it: a new epoch after each pass
    times = []
    for _ in range(a.batches):
        t0 = time.perf_counter()
        next(stream)
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times[5:]) * 1e3
    print("RESULT " + json.dumps({"bench": "loader", "seq": a.seq, "micro": a.micro, "document_mask": a.document_mask,
                                  "ms_per_micro_batch": round(ms, 2),
                                  "tokens_per_s": round(a.micro * a.seq / ms * 1e3)}))


if __name__ == "__main__":
    main()
