"""The trainer's parallel strategies compute the same training as one process.

Every case trains the same tiny GPT (fp32, CPU, gloo) on the same random tokens for a few
steps and compares the per-step loss over the whole global batch with a single process
that sees the same global batch in one micro-batch. Why these match: DistributedSampler
with one seed gives every world size the same permutation, and rank r takes every
world-th index of it, so the union over ranks of step s's micro-batches is exactly the
single process's batch s; gradients are averaged over equal-sized micro-batches.

Tolerance: rtol 2e-4. The only differences are the order of fp32 additions in the
all-reduce / reduce-scatter and in the micro-batch sums (relative error ~1e-7 per step);
Adam's update divides by sqrt(v), which amplifies such differences over a few steps to
~1e-5 at most, measured here; a real bug (a missing average, a skipped sync, a wrong
shard) changes the loss at the first or second step by far more than 1e-2.
"""

import pytest

import meshrun
from helpers import require

pytestmark = pytest.mark.framework

STEPS = 6


def _train(overrides):
    from meshrun.train.config import TrainConfig
    from meshrun.train.data import RandomTokens
    from meshrun.train.models import GPT, GPTConfig
    from meshrun.train.trainer import Trainer
    import torch

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=2, n_heads=4))
    cfg = TrainConfig(steps=STEPS, seq_len=16, lr=3e-3, warmup=2, log_every=1, precision="fp32", **overrides)
    records = Trainer(model, RandomTokens(512, 16, 64), None, cfg).fit()
    return [(r["loss"], r["grad_norm"]) for r in records]


def run(nproc, **overrides):
    return meshrun.run(_train, overrides, nproc=nproc, timeout_s=300)


@pytest.fixture(scope="module")
def reference():
    require("torch")
    return run(1, strategy="single", micro_batch=8)


def close(a, b, rtol=2e-4):
    assert len(a) == len(b) == STEPS
    for (la, na), (lb, nb) in zip(a, b):
        assert la == pytest.approx(lb, rel=rtol)
        assert na == pytest.approx(nb, rel=rtol)


@pytest.mark.parametrize("overrides", [
    {"strategy": "ddp"},
    {"strategy": "fsdp", "fsdp": "full"},
    {"strategy": "fsdp", "fsdp": "grad_op"},
    {"strategy": "fsdp", "fsdp": "no_shard"},
], ids=["ddp", "fsdp-full", "fsdp-grad_op", "fsdp-no_shard"])
def test_two_processes_match_one(reference, overrides):
    close(run(2, micro_batch=4, **overrides), reference)


def test_hybrid_shard_on_four_processes_matches_one(reference):
    close(run(4, micro_batch=2, strategy="fsdp", fsdp="hybrid", fsdp_shard_size=2), reference)


@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp"])
def test_accumulation_equals_a_larger_batch(reference, strategy):
    nproc = 1 if strategy == "single" else 2
    micro = 8 // (2 * nproc)  # two micro-steps per optimizer step
    close(run(nproc, strategy=strategy, micro_batch=micro, global_batch=8), reference)


def test_clipping_matches_single_process():
    require("torch")
    one = run(1, strategy="single", micro_batch=8, grad_clip=0.05)
    for strategy in ("ddp", "fsdp"):
        close(run(2, strategy=strategy, micro_batch=4, grad_clip=0.05), one)
    # The clip was active at every step (the reported norm is the pre-clip global norm), and
    # a per-shard norm would be smaller by about sqrt(2) than the single process's: the
    # equal norms above show the norm is taken over all shards.
    assert all(norm > 0.05 * 5 for _, norm in one)


@pytest.mark.parametrize("nproc,overrides", [
    (1, {"strategy": "single", "micro_batch": 8}),
    (2, {"strategy": "ddp", "micro_batch": 4}),
    (2, {"strategy": "fsdp", "micro_batch": 4}),
], ids=["single", "ddp", "fsdp"])
def test_activation_checkpointing_recomputes_the_same_training(reference, nproc, overrides):
    close(run(nproc, activation_checkpointing="full", **overrides), reference)


@pytest.mark.parametrize("nproc,overrides", [
    (1, {"strategy": "single", "micro_batch": 8}),
    (2, {"strategy": "fsdp", "micro_batch": 4}),
], ids=["single", "fsdp-per-block"])
def test_compiled_training_matches_eager(reference, nproc, overrides):
    # Inductor fuses and reorders fp32 arithmetic: allow 1e-3 (a wrong graph is off by >1e-2).
    close(run(nproc, compile=True, **overrides), reference, rtol=1e-3)


def _train_iterable():
    import torch
    from torch.utils.data import IterableDataset

    from meshrun.train.config import TrainConfig
    from meshrun.train.trainer import Trainer

    class Stream(IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            for _ in range(400):
                x = torch.randn(20, generator=g)
                yield x, x.sum(dim=0, keepdim=True)

    torch.manual_seed(0)
    model = torch.nn.Linear(20, 1)
    cfg = TrainConfig(strategy="ddp", steps=40, micro_batch=8, lr=0.05, log_every=20, precision="fp32")
    return [r["loss"] for r in Trainer(model, Stream(), None, cfg).fit()]


def test_iterable_dataset_is_sharded_and_trains():
    require("torch")
    first, last = meshrun.run(_train_iterable, nproc=2, timeout_s=300)
    assert last < first / 3  # it learns (13.1 -> 3.0 in 40 steps here)
