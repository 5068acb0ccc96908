"""What a training rank imports: the modules of what its layout and options use, no more.
Checked in a fresh interpreter, where nothing else has imported them first."""

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

from helpers import clean_env  # noqa: E402

# Imported where they are used: snapshots (torch.distributed.checkpoint, --out or --resume),
# the loss plot and TensorBoard (--out), the compiler and the sharded layouts.
HEAVY = ("torch.distributed.checkpoint", "torch.distributed.tensor", "torch.distributed.fsdp", "torch._dynamo",
         "matplotlib", "torch.utils.tensorboard")

RANK = """
import json, sys
HEAVY = {heavy!r}
loaded = lambda: [m for m in HEAVY if m in sys.modules]
# worker.main's imports
import meshrun.training.worker
from meshrun.modelinfo.read import context_of
from meshrun.config import TrainConfig, resolve_seq_len
from meshrun.training.factories import build_data, build_model, pretrained_weights, vocab_size
from meshrun.training.runtime import init_runtime, teardown
from meshrun.training.trainer import Trainer
imported = loaded()
# a plain CPU run's objects and its one step, without --out
from meshrun.training.loader import RandomTokens
from meshrun.training.models.gpt import gpt
cfg = TrainConfig(model_size="gpt-tiny", seq_len=16, micro_batch=2, steps=1, precision="fp32", strategy="single")
Trainer(gpt("gpt-tiny", 16, 64), RandomTokens(64, 16, 64), RandomTokens(8, 16, 64), cfg).fit()
print(json.dumps({{"imported": imported, "trained": loaded()}}))
"""


def test_a_plain_rank_imports_no_snapshot_plot_tracker_nor_compiler_module():
    """Importing the worker's modules loads none of HEAVY: with them the import took 2.3-2.9 s
    on top of torch's 2 s, without them 0.2-0.3 s (-X importtime, 2-core box, torch 2.13). Nor
    does a single-process CPU run without --out, built, validated and trained one step: not
    its optimizer (torch's AdamW imports torch._dynamo), its model's forward (DTensor) nor its
    validation (torch.compiler.set_stance)."""
    proc = subprocess.run([sys.executable, "-c", RANK.format(heavy=HEAVY)], capture_output=True, text=True,
                          env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.strip().splitlines()[-1])
    assert found["imported"] == [], found
    assert found["trained"] == [], found


ADAMW = """
import copy, json, sys
import torch
from meshrun.training.models.gpt import GPT, GPTConfig
from meshrun.training.optim import build_optimizer, create_state
torch.manual_seed(0)
mine = GPT(GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=2, n_heads=2))
ref = copy.deepcopy(mine)
idx = torch.randint(0, 64, (4, 17))

def steps(model, opt, n):
    for _ in range(n):
        model(idx[:, :-1], idx[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

ours = build_optimizer(mine, 1e-2, 0.1, fused={fused})
create_state(ours)
steps(mine, ours, 2)
again = build_optimizer(mine, 1e-2, 0.1, fused={fused})  # a resume: state saved, loaded
again.load_state_dict(ours.state_dict())
steps(mine, again, 1)
without = "torch._dynamo" in sys.modules
groups = [{{"params": [p for p in ref.parameters() if p.dim() >= 2], "weight_decay": 0.1}},
          {{"params": [p for p in ref.parameters() if p.dim() < 2], "weight_decay": 0.0}}]
theirs = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, fused={fused})
steps(ref, theirs, 3)
with_dynamo = "torch._dynamo" in sys.modules
same = lambda: all(torch.equal(p, q) for p, q in zip(mine.parameters(), ref.parameters()))
after3 = same()
steps(mine, again, 1)  # torch's own methods, now that torch._dynamo is loaded
steps(ref, theirs, 1)
a, b = again.state_dict(), theirs.state_dict()
states = all(torch.equal(a["state"][i][k], b["state"][i][k]) for i in b["state"] for k in b["state"][i])
print(json.dumps([without, with_dynamo, after3, same(), states, a["param_groups"] == b["param_groups"]]))
"""


@pytest.mark.parametrize("fused", [True, False])
def test_meshruns_adamw_steps_saves_and_loads_as_torchs_without_importing_the_compiler(fused):
    """meshrun's AdamW skips torch's wrappers that import torch._dynamo (1.3 s of CPU) while it
    is not loaded, and is torch's own once it is: its steps, zeroed gradients, state dict and
    a load of it give parameters and moments bit for bit those of torch.optim.AdamW, before and
    after the compiler is loaded."""
    proc = subprocess.run([sys.executable, "-c", ADAMW.format(fused=fused)], capture_output=True, text=True,
                          env=clean_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [False, True, True, True, True, True]


EXITS = """
import atexit, sys, threading, time
from concurrent.futures import ThreadPoolExecutor
from meshrun.training.worker import exit_now
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


EAGER_DDP = """
import copy, json, sys
import torch, torch.distributed as dist
rank = int(sys.argv[1])
dist.init_process_group("gloo", init_method="file://" + sys.argv[2], rank=rank, world_size=2)
from meshrun.training.models.gpt import GPT, GPTConfig
from meshrun.training.optim import build_optimizer
from meshrun.training.parallel.ddp import DEFAULT_OPTIMIZE_DDP_MODE, EagerDDP, ddp_class
torch.manual_seed(0)
mine = GPT(GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=2, n_heads=2))
ref = copy.deepcopy(mine)
idx = torch.randint(0, 64, (4, 17), generator=torch.Generator().manual_seed(rank))  # each rank's own batch

def steps(model, opt, n):
    for _ in range(n):
        model(idx[:, :-1], idx[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

eager = ddp_class(compiled=False)
ours = eager(mine, gradient_as_bucket_view=True, bucket_cap_mb=1)
a = build_optimizer(ours, 1e-2, 0.1, fused=False)
steps(ours, a, 3)
without = "torch._dynamo" in sys.modules
theirs = torch.nn.parallel.DistributedDataParallel(ref, gradient_as_bucket_view=True, bucket_cap_mb=1)
b = build_optimizer(theirs, 1e-2, 0.1, fused=False)
steps(theirs, b, 3)
same = lambda: all(torch.equal(p, q) for p, q in zip(ours.parameters(), theirs.parameters()))
same3 = same()
import torch._dynamo.utils
steps(ours, a, 1)  # torch's own forward now that torch._dynamo is loaded
steps(theirs, b, 1)
print(json.dumps([eager is EagerDDP, ddp_class(compiled=True) is EagerDDP, without, same3, same(),
                  ours._use_python_reducer == theirs._use_python_reducer,
                  torch._dynamo.utils.get_optimize_ddp_mode() == DEFAULT_OPTIMIZE_DDP_MODE]))
dist.destroy_process_group()
"""


def test_ddp_trains_as_torchs_without_importing_the_compiler(tmp_path):
    """Two gloo ranks: meshrun's DDP for a run that compiles nothing trains three steps without
    importing torch._dynamo (1.9 s of CPU a rank), to parameters bit for bit those of torch's
    DDP, and one more step alike once torch._dynamo is loaded; the constructor's stand-in
    answer is the one torch._dynamo gives, and a compiled run gets torch's own class."""
    store = tmp_path / "store"
    procs = [subprocess.Popen([sys.executable, "-c", EAGER_DDP, str(rank), str(store)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=clean_env()) for rank in (0, 1)]
    try:
        results = [proc.communicate(timeout=240) for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    for proc, (out, err) in zip(procs, results):
        assert proc.returncode == 0, err[-3000:]
        assert json.loads(out.strip().splitlines()[-1]) == [True, False, False, True, True, True, True]
