"""What a training rank imports: the modules of what its layout and options use, no more.
Checked in a fresh interpreter, where nothing else has imported them first."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from helpers import clean_env  # noqa: E402

# Imported where they are used: snapshots (torch.distributed.checkpoint, --out or --resume),
# the loss plot and TensorBoard (--out), the compiler and the sharded layouts. torch's own
# AdamW imports torch._dynamo, and with it DTensor and FSDP, when it is built (torch 2.13:
# Optimizer.add_param_group is torch._disable_dynamo's), so a built Trainer has those three.
HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp", "torch._dynamo",
         "matplotlib", "torch.utils.tensorboard")
BUILT_BY_TORCH = ("torch.distributed.tensor", "torch.distributed.fsdp", "torch._dynamo")

RANK = """
import json, sys
HEAVY = {heavy!r}
loaded = lambda: [m for m in HEAVY if m in sys.modules]
# worker.main's imports
import meshrun.train.worker
from meshrun.modelinfo.read import context_of
from meshrun.train.config import TrainConfig, resolve_seq_len
from meshrun.train.factories import build_data, build_model, pretrained_weights, vocab_size
from meshrun.train.runtime import init_runtime, teardown
from meshrun.train.trainer import Trainer
imported = loaded()
# a plain CPU run's objects and its one step, without --out
from meshrun.train.data import RandomTokens
from meshrun.train.models.gpt import gpt
cfg = TrainConfig(model_size="gpt-tiny", seq_len=16, micro_batch=2, steps=1, precision="fp32", strategy="single")
Trainer(gpt("gpt-tiny", 16, 64), RandomTokens(64, 16, 64), RandomTokens(8, 16, 64), cfg).fit()
print(json.dumps({{"imported": imported, "trained": loaded()}}))
"""


def test_a_plain_rank_imports_no_snapshot_plot_tracker_nor_compiler_module():
    """Importing the worker's modules loads none of HEAVY: with them the import took 2.3-2.9 s
    on top of torch's 2 s, without them 0.2-0.3 s (-X importtime, 2-core box, torch 2.13). A
    single-process CPU run without --out, built and trained one step, loads no more than
    torch's AdamW does."""
    proc = subprocess.run([sys.executable, "-c", RANK.format(heavy=HEAVY)], capture_output=True, text=True,
                          env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["imported"] == [], found
    assert set(found["trained"]) <= set(BUILT_BY_TORCH), found


EXITS = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from meshrun.train.worker import exit_now
pool = ThreadPoolExecutor(2)  # idle workers, as Inductor's compile pool leaves them
assert pool.submit(lambda: 1).result() == 1
late = threading.Thread(target=lambda: (time.sleep(0.3), print("thread finished", flush=True)))
late.start()
atexit.register(lambda: sys.stdout.write("exit handler ran, unflushed"))
exit_now(3)
"""


def test_a_rank_exits_past_idle_thread_pools_after_its_threads_and_exit_handlers():
    """exit_now ends as Python's exit would: a thread pool's idle workers told to stop (joining
    them before that waited forever after any compiled run), other threads finished, exit
    handlers run, output flushed, and the rank's own exit code."""
    out = subprocess.run([sys.executable, "-c", EXITS], capture_output=True, text=True, timeout=30, env=clean_env())
    assert out.returncode == 3, out.stderr
    assert out.stdout.splitlines() == ["thread finished", "exit handler ran, unflushed"], out.stdout
