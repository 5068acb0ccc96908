"""The per-rank program that `meshrun train` launches: `python -m meshrun.train.worker`.

It reads the validated TrainConfig from MESHRUN_TRAIN_CONFIG. A MeshrunError (bad factory,
out of memory at step 1, ...) is written to MESHRUN_ERROR_FILE for the launching
`meshrun train`, which prints it as its one-line error, and the rank exits with code 2.
SIGTERM and SIGUSR1 stop the run after a step all ranks agree on, with a snapshot
(preempt.py): the rank exits with PREEMPTED (75), and the local rank 0 writes the one-line
account to MESHRUN_PREEMPT_FILE for `meshrun train` to print.
"""

from __future__ import annotations

import os
import sys

from ..errors import PREEMPTED, MeshrunError
from . import preempt


def _report(exc: MeshrunError) -> None:
    path = os.environ.get("MESHRUN_ERROR_FILE")
    if path:  # `meshrun train` prints it once, as its last line
        with open(path, "a") as f:
            f.write(f"{exc}\n")
    else:
        print(f"meshrun: error: {exc}", file=sys.stderr, flush=True)


def _report_preempted(stop: preempt.Preempted) -> None:
    if os.environ.get("LOCAL_RANK", "0") != "0":
        return
    path = os.environ.get("MESHRUN_PREEMPT_FILE")
    if path:  # whole or not at all: `meshrun train` reads it as soon as it exists
        with open(path + ".tmp", "w") as f:
            f.write(f"{stop.message()}\n")
        os.replace(path + ".tmp", path)
    elif os.environ.get("RANK", "0") == "0":
        print(f"meshrun: {stop.message()}", file=sys.stderr, flush=True)


def main() -> int:
    preempt.install()  # first: from here on a preemption signal stops the run at a step boundary
    from ..modelinfo.read import context_of
    from .config import TrainConfig, resolve_seq_len
    from .factories import build_data, build_model, pretrained_weights, vocab_size
    from .runtime import init_runtime, teardown
    from .trainer import Trainer

    cfg = TrainConfig.from_json(os.environ["MESHRUN_TRAIN_CONFIG"])
    try:
        rt = init_runtime()
        if cfg.out:  # OUT stays locked while this process may write there (runlock.py)
            from .runlock import share

            # After the rendezvous: it needs rank 0, whose launcher holds OUT by now. (With one
            # process per task, Slurm's or mpirun's, other ranks may start before it locks.)
            share(cfg.out)
        model = build_model(cfg)
        cfg = resolve_seq_len(cfg, context_of(model))  # (a user's model states its own context)
        train, val = build_data(cfg, vocab_size(model))
        Trainer(model, train, val, cfg, rt, weights=pretrained_weights(cfg)).fit()
    except MeshrunError as exc:
        _report(exc)
        return 2  # no teardown barrier: the peers may be stuck elsewhere; the launcher stops them
    except preempt.Preempted as stop:  # every rank stopped at the same step, past the snapshot's commit
        _report_preempted(stop)
        teardown()
        return PREEMPTED
    teardown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
