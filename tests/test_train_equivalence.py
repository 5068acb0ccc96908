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

import os

import pytest
from helpers import require

import meshrun

pytestmark = pytest.mark.framework

STEPS = 6


def _train(overrides):
    import torch

    from meshrun.config import TrainConfig
    from meshrun.training.loader import RandomTokens
    from meshrun.training.models.gpt import GPT, GPTConfig
    from meshrun.training.trainer import Trainer

    overrides = dict(overrides)
    layers = overrides.pop("layers", 2)
    experts = overrides.pop("n_experts", 0)
    with_layout = overrides.pop("with_layout", False)  # also the layout's description and accumulation
    val = RandomTokens(64, 16, 64) if overrides.pop("val", False) else None
    data = _documents() if overrides.pop("documents", False) else RandomTokens(512, 16, 64)
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=layers, n_heads=4, n_experts=experts))
    cfg = TrainConfig(steps=STEPS, seq_len=16, lr=3e-3, warmup=2, log_every=1, precision="fp32", **overrides)
    trainer = Trainer(model, data, val, cfg)
    records = trainer.fit()
    out = [(r["loss"], r["grad_norm"]) for r in records]
    if val is not None and records:  # (rank 0's records: the result meshrun.run returns)
        out.append(("val_loss", records[-1]["val_loss"]))
    ddp = getattr(trainer.layout, "ddp", None)
    if ddp is not None and trainer.rt.rank == 0:  # what DDP was given: checked beside the losses
        out.append(("ddp_bucket_bytes", ddp.bucket_bytes_cap))
    if with_layout:
        out.append(("layout", (trainer.layout.description, trainer.state.accum)))
    return out


def _documents():
    """Packed sequences of 16 tokens from random documents of 1-20 tokens (seeded), with
    their document positions: --document-mask's data."""
    import numpy as np

    from meshrun.data.store import TokenSplit
    from meshrun.training.loader import PackedTokens

    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 64, 512 * 16 + 1, dtype=np.uint16)
    starts = np.unique(np.concatenate([[0], np.cumsum(rng.integers(1, 21, 800))]))
    return PackedTokens(TokenSplit([tokens], starts[starts < len(tokens)]), 16, document_mask=True)


def run(nproc, **overrides):
    return meshrun.run(_train, overrides, nproc=nproc, timeout_s=300)


@pytest.fixture(scope="module")
def reference():
    require("torch")
    return run(1, strategy="single", micro_batch=8)


def close(a, b, rtol=2e-4):
    a, b = ([r for r in rows if not isinstance(r[0], str)] for rows in (a, b))  # the losses and norms
    assert len(a) == len(b) == STEPS
    for (la, na), (lb, nb) in zip(a, b):
        assert la == pytest.approx(lb, rel=rtol)
        assert na == pytest.approx(nb, rel=rtol)


@pytest.mark.parametrize("nproc,overrides", [
    (2, {"strategy": "ddp"}),
    (2, {"strategy": "fsdp-full"}),
    (2, {"strategy": "fsdp-grad-op"}),
    (2, {"strategy": "fsdp-no-shard"}),
    (1, {"strategy": "fsdp", "global_batch": 8, "with_layout": True}),  # FSDP2 over one rank, 2 micro-batches
], ids=["ddp", "fsdp-full", "fsdp-grad_op", "fsdp-no_shard", "fsdp-one-rank"])
def test_layouts_match_one_process(reference, nproc, overrides):
    """Each layout over micro-batches of 4: two processes, or FSDP2 on one process (what one
    GPU trains a model too large for ``single`` with), which reduces its gradients into the
    shards at every micro-step rather than holding them back to the last."""
    rows = run(nproc, micro_batch=4, **overrides)
    close(rows, reference)
    if nproc == 1:
        assert ("layout", ("fsdp-full: FSDP2 full over 1 rank", 2)) in rows, rows


@pytest.mark.parametrize("nproc,micro,fsdp,sp", [(2, 8, "full", True), (2, 8, "full", False), (4, 4, "full", True),
                                                 (4, 4, "grad_op", True), (2, 8, "offload", True)],
                         ids=["tp2", "tp2-no-sp", "dp2xtp2-full", "dp2xtp2-grad_op", "tp2-offload"])
def test_tensor_parallel_matches_one(reference, nproc, micro, fsdp, sp):
    """TP=2 alone (each TP pair reads the same micro-batch of 8) and FSDP2 x TP on a 2 x 2
    mesh (2 data-parallel pairs, 4 each): the same global batch of 8 as the reference, with
    sequence parallelism (the default) and without; and TP=2 with AdamW's moments in host
    memory, stepped on each rank's tensor-parallel shards."""
    close(run(nproc, micro_batch=micro, strategy=f"fsdp-{fsdp.replace('_', '-')}", tp=2, sequence_parallel=sp),
          reference)


def _first_step_gradients(overrides):
    """Every parameter's whole gradient after the first step's micro-batches (before the
    optimizer step), by its name in the unsharded model: tensor-parallel shards and FSDP2's
    shards gathered, the q/k/v Linears tensor parallelism splits the fused one into joined.
    Then the gradient norm as the layout takes it, the collectives that took, and whether
    each forward returned a view."""
    import torch
    from torch.distributed.tensor.debug import CommDebugMode

    from meshrun.config import TrainConfig
    from meshrun.training.loader import BatchStream, RandomTokens
    from meshrun.training.models.gpt import GPT, GPTConfig
    from meshrun.training.parallel.gradnorm import clip_grad_norm
    from meshrun.training.trainer import Trainer

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=2, n_heads=4))
    cfg = TrainConfig(steps=1, seq_len=16, log_every=1, precision="fp32", **overrides)
    t = Trainer(model, RandomTokens(512, 16, 64), None, cfg)
    views = []  # whether each forward returned a view (FSDP2 hooks its backward on the output)
    t.layout.model.register_forward_hook(lambda m, a, out: views.append(out._base is not None))
    data = BatchStream(t.train_loader, cfg.micro, t.dp_size)
    for micro in range(t.state.accum):
        x, y, positions = t.to_device(next(data))
        t.layout.micro_step(x, y, last=micro == t.state.accum - 1, positions=positions)
    with CommDebugMode() as comms:
        norm = float(clip_grad_norm(t.layout.model.parameters(), float("inf")))
    grads = {}
    for name, p in t.layout.model.named_parameters():
        assert p.grad is not None, f"{name}: no gradient"
        grads[name] = p.grad.full_tensor() if hasattr(p.grad, "full_tensor") else p.grad.clone()
    for name in [n for n in grads if ".qkv.q." in n]:
        fused = name.replace(".qkv.q.", ".qkv.")
        grads[fused] = torch.cat([grads.pop(name.replace(".qkv.q.", f".qkv.{part}.")) for part in "qkv"])
    return grads, norm, comms.get_total_counts(), views


def _reduced_by_the_first_micro_step(overrides):
    """Whether every parameter holds its gradient (FSDP2: its reduced shard) after the first of
    the step's micro-steps, before the last."""
    import torch

    from meshrun.config import TrainConfig
    from meshrun.training.loader import BatchStream, RandomTokens
    from meshrun.training.models.gpt import GPT, GPTConfig
    from meshrun.training.trainer import Trainer

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=2, n_heads=4))
    t = Trainer(model, RandomTokens(512, 16, 64), None, TrainConfig(steps=1, seq_len=16, precision="fp32", **overrides))
    x, y, positions = t.to_device(next(BatchStream(t.train_loader, t.cfg.micro, t.dp_size)))
    t.layout.micro_step(x, y, last=False, positions=positions)
    return t.state.accum, [n for n, p in t.layout.model.named_parameters() if p.grad is None]


def test_fsdp2_on_one_rank_reduces_at_every_micro_step():
    """FSDP2 over one rank has nothing to gain from holding the gradients back to the step's
    last micro-step (its reduce-scatter is a copy), and holding them back would keep whole fp32
    gradients of its own beside the shards: it reduces each micro-step's into the shards."""
    accum, missing = meshrun.run(_reduced_by_the_first_micro_step,
                                 {"strategy": "fsdp-full", "micro_batch": 4, "global_batch": 8}, nproc=1, timeout_s=300)
    assert accum == 2 and missing == []


@pytest.fixture(scope="module")
def reference_gradients():
    require("torch")
    return meshrun.run(_first_step_gradients, {"strategy": "single", "micro_batch": 8}, nproc=1, timeout_s=300)


@pytest.mark.parametrize("nproc,micro,fsdp", [(2, 4, "full"), (4, 2, "full"), (4, 2, "grad-op")],
                         ids=["tp2-full", "dp2xtp2-full", "dp2xtp2-grad_op"])
def test_tensor_parallel_gradients_match_one(reference_gradients, nproc, micro, fsdp):
    """FSDP2 x TP=2 (sequence and loss parallel), two micro-batches a step: every parameter's
    gradient equals the single process's. FSDP2 hooks each wrapped module's backward on its
    output: without the blocks' hooks, full shard's backward finds their parameters resharded
    and fails; without all of them, grad_op's root gradients go unreduced. The per-step loss
    and norm above would show a wrong gradient only mixed into the update or the total. The
    loss the model returns is a tensor of its own, not a view (FSDP2 warns on a view: an
    in-place op on one would lose the hook).

    The norm over the two meshes (the TP parameters' (dp_shard, tp) and the data-parallel
    one) is the single process's, in one all-reduce per mesh on torch 2.13 and 2.15 (three
    without the flattened (dp_shard, tp) mesh: one per dimension of the first; three on torch
    2.7, whose DTensor reduces each dimension of a flattened mesh's parent on its own)."""
    grads, norm, _, _ = reference_gradients
    many, many_norm, all_reduces, views = meshrun.run(
        _first_step_gradients, {"strategy": f"fsdp-{fsdp}", "tp": 2, "micro_batch": micro, "global_batch": 8},
        nproc=nproc, timeout_s=300)
    assert views == [False, False]  # the loss is no view, where an in-place op would lose the hook
    assert sorted(many) == sorted(grads)
    for name, ref in grads.items():
        assert float((many[name] - ref).norm()) <= 1e-5 * float(ref.norm()), name
    assert many_norm == pytest.approx(norm, rel=1e-5)
    import torch

    assert all_reduces <= (2 if tuple(map(int, torch.__version__.split(".")[:2])) >= (2, 13) else 3), all_reduces


def _local_shape(t):
    return tuple(t.to_local().shape) if hasattr(t, "to_local") else tuple(t.shape)


def _sequence_parallel_shapes(sequence_parallel):
    """What each LayerNorm gets under TP=2 (its local tensor), and the head's local logits."""
    import torch

    from meshrun.config import TrainConfig
    from meshrun.training.loader import BatchStream, RandomTokens
    from meshrun.training.models.gpt import GPT, GPTConfig
    from meshrun.training.trainer import Trainer

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=2, n_heads=4))
    seen = {"blocks": set(), "ln_f": set(), "logits": set()}
    for block in model.blocks:
        for ln in (block.ln1, block.ln2):
            ln.register_forward_hook(lambda m, i, o: seen["blocks"].add(_local_shape(i[0])))
    model.ln_f.register_forward_hook(lambda m, i, o: seen["ln_f"].add(_local_shape(i[0])))
    model.head.register_forward_hook(lambda m, i, o: seen["logits"].add(_local_shape(o)))
    cfg = TrainConfig(strategy="fsdp", tp=2, micro_batch=4, seq_len=16, steps=1, precision="fp32", log_every=1,
                      sequence_parallel=sequence_parallel)
    t = Trainer(model, RandomTokens(64, 16, 64), None, cfg)
    t.train_step(BatchStream(t.train_loader, 4, t.dp_size))
    shapes = {k: sorted(v) for k, v in seen.items()}
    full = t.model(torch.zeros(2, 16, dtype=torch.long))  # logits asked for: gathered
    return t.layout.description, shapes, tuple(full.shape)


@pytest.mark.parametrize("sp", [True, False], ids=["sp", "no-sp"])
def test_sequence_and_loss_parallel_shard_what_they_should(sp):
    """TP=2 on meshrun's GPT: with sequence parallelism every LayerNorm gets half of the 16
    tokens; with loss parallelism (both cases) the head writes half of the 64-entry
    vocabulary per token, and logits asked for come back whole."""
    require("torch")
    reason, seen, full = meshrun.run(_sequence_parallel_shapes, sp, nproc=2, timeout_s=300)
    assert ("sequence parallel" in reason) == sp and "loss parallel" in reason
    tokens = 8 if sp else 16
    assert seen["blocks"] == [(4, tokens, 32)] and seen["ln_f"] == [(4, tokens, 32)]
    assert seen["logits"] == [(4, 16, 32)] and full == (2, 16, 64)


def _train_steps(overrides):
    """Like _train, but {step: loss} of the steps this run logged (after a resume: only those)."""
    import torch

    from meshrun.config import TrainConfig
    from meshrun.training.loader import RandomTokens
    from meshrun.training.models.gpt import GPT, GPTConfig
    from meshrun.training.trainer import Trainer

    overrides = dict(overrides)
    layers = overrides.pop("layers", 2)
    experts = overrides.pop("n_experts", 0)
    with_layout = overrides.pop("with_layout", False)  # also the layout's description, as "layout"
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=layers, n_heads=4, n_experts=experts))
    cfg = TrainConfig(steps=STEPS, seq_len=16, lr=3e-3, warmup=2, log_every=1, precision="fp32", **overrides)
    trainer = Trainer(model, RandomTokens(512, 16, 64), None, cfg)
    out = {r["step"]: r["loss"] for r in trainer.fit()}
    return {**out, "layout": trainer.layout.description} if with_layout else out


def test_tensor_parallel_snapshot_resumes_on_another_layout(reference, tmp_path):
    """Saved on a 2 x 2 (FSDP x TP) mesh at step 3, resumed with TP alone on 2 processes:
    DCP reshards the DTensors; steps 4-6 continue the reference training."""
    out = str(tmp_path / "run")
    first = meshrun.run(_train_steps, {"strategy": "fsdp", "tp": 2, "micro_batch": 4, "out": out, "save_every": 3},
                        nproc=4, timeout_s=300)
    assert sorted(first) == list(range(1, STEPS + 1))
    resume = os.path.join(out, "checkpoints", "step-00000003")
    resumed = meshrun.run(_train_steps, {"strategy": "fsdp", "tp": 2, "micro_batch": 8, "out": out, "resume": resume},
                          nproc=2, timeout_s=300)
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(reference[step - 1][0], rel=2e-4)


def test_moments_on_the_host_train_the_same_and_resume_across_layouts(reference, tmp_path):
    """FSDP2 with AdamW's moments in host memory (fsdp-offload) trains as one process does.
    Its snapshot at step 3, the moments saved from host memory, resumes into steps 4-6 of the
    same training both with the moments loaded back into host memory and under fsdp-full."""
    out = str(tmp_path / "run")
    first = meshrun.run(_train_steps, {"strategy": "fsdp-offload", "micro_batch": 4, "out": out, "save_every": 3,
                                       "with_layout": True}, nproc=2, timeout_s=300)
    assert first.pop("layout") == "fsdp-offload: FSDP2 full over 2 ranks -> AdamW's moments in host memory"
    assert [first[s] for s in range(1, STEPS + 1)] == pytest.approx([r[0] for r in reference], rel=2e-4)
    snap = os.path.join(out, "checkpoints", "step-00000003")
    for strategy in ("fsdp-offload", "fsdp-full"):
        resumed = meshrun.run(_train_steps, {"strategy": strategy, "micro_batch": 4, "out": out, "resume": snap},
                              nproc=2, timeout_s=300)
        assert sorted(resumed) == [4, 5, 6]
        for step in (4, 5, 6):
            assert resumed[step] == pytest.approx(reference[step - 1][0], rel=2e-4), strategy


@pytest.fixture(scope="module")
def reference4():
    require("torch")
    return run(1, strategy="single", micro_batch=8, layers=4)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved"])
def test_pipeline_matches_one(reference4, schedule):
    """Two stages (four with interleaved), the micro-batch of 8 cut into 2 (4) pieces."""
    n = 4 if schedule == "interleaved" else 2
    close(run(2, micro_batch=8, strategy="auto", pp=2, pp_schedule=schedule, pp_microbatches=n, layers=4),
          reference4)


@pytest.mark.parametrize("schedule", ["1f1b", "interleaved"])
def test_a_pipeline_validates_as_one_process(schedule):
    """Validation through the pipeline (the schedule's forward-only pass; on torch 2.7, whose
    schedules have none, meshrun's own) gives the single process's loss on the same samples."""
    require("torch")
    n = 4 if schedule == "interleaved" else 2
    one = run(1, strategy="single", micro_batch=8, layers=4, val=True)
    piped = run(2, micro_batch=8, strategy="auto", pp=2, pp_schedule=schedule, pp_microbatches=n, layers=4, val=True)
    close(piped, one)
    assert one[-1][0] == piped[-1][0] == "val_loss"
    assert piped[-1][1] == pytest.approx(one[-1][1], rel=2e-4)


@pytest.mark.parametrize("overrides", [{"pp": 2}, {"pp": 2, "tp": 2}], ids=["dp2xpp2", "pp2xtp2"])
def test_pipeline_composes_with_fsdp_and_tp(reference4, overrides):
    micro = 4 if "tp" not in overrides else 8  # dp2 x pp2: 2 data-parallel pipelines of 4 each
    close(run(4, micro_batch=micro, strategy="fsdp", layers=4, **overrides), reference4)


def test_pipeline_snapshot_resumes_on_another_layout(reference4, tmp_path):
    """Stages keep the unsplit model's parameter names: a snapshot of FSDP2 x PP on 4
    processes resumes as a plain 2-stage pipeline; steps 4-6 continue the reference."""
    out = str(tmp_path / "pp")
    first = meshrun.run(_train_steps, {"strategy": "fsdp", "pp": 2, "micro_batch": 4, "out": out, "save_every": 3,
                                       "layers": 4}, nproc=4, timeout_s=300)
    assert sorted(first) == list(range(1, STEPS + 1))
    resumed = meshrun.run(_train_steps, {"strategy": "auto", "pp": 2, "micro_batch": 8, "out": out, "layers": 4,
                                         "resume": os.path.join(out, "checkpoints", "step-00000003")},
                          nproc=2, timeout_s=300)
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(reference4[step - 1][0], rel=2e-4)


def test_pipeline_clips_on_the_whole_model_norm():
    """The norm spans every stage, the tied embedding/head weight counted once: clipping at
    0.05 then gives the single process's training (a per-stage norm would not)."""
    one = run(1, strategy="single", micro_batch=8, grad_clip=0.05, layers=4)
    close(run(2, strategy="auto", pp=2, micro_batch=8, grad_clip=0.05, layers=4), one)
    assert all(norm > 0.05 * 5 for _, norm in one)


@pytest.mark.parametrize("zero", [1, 2, 3])
def test_deepspeed_zero_matches_one(reference, zero):
    """DeepSpeed's engine with meshrun's AdamW: its flat fp32 partitions, its all-reduce or
    reduce-scatter, its clipping; the same training."""
    require("deepspeed")
    close(run(2, micro_batch=4, strategy=f"zero{zero}"), reference)


def test_deepspeed_offload_and_snapshot_resume(reference, tmp_path):
    """ZeRO-3 with the optimizer on the CPU trains the same; its snapshot (DeepSpeed's files
    inside meshrun's committed, hashed directory) resumes at step 3 into the same steps 4-6."""
    require("deepspeed")
    close(run(2, micro_batch=4, strategy="zero3-offload"), reference)
    out = str(tmp_path / "ds")
    first = meshrun.run(_train_steps, {"strategy": "zero2", "micro_batch": 4, "out": out,
                                       "save_every": 3}, nproc=2, timeout_s=300)
    assert sorted(first) == list(range(1, STEPS + 1))
    snap = os.path.join(out, "checkpoints", "step-00000003")
    assert os.path.isfile(os.path.join(snap, "COMMITTED.json")) and os.path.isdir(os.path.join(snap, "deepspeed"))
    resumed = meshrun.run(_train_steps, {"strategy": "zero2", "micro_batch": 4, "out": out,
                                         "resume": snap}, nproc=2, timeout_s=300)
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(reference[step - 1][0], rel=2e-4)


@pytest.mark.parametrize("nproc,micro", [(2, 8), (4, 4)], ids=["cp2", "dp2xcp2"])
def test_context_parallel_matches_one(reference, nproc, micro):
    """Each sequence of 16 tokens cut into 4 zig-zag chunks over 2 ranks; the same training."""
    close(run(nproc, micro_batch=micro, strategy="fsdp", cp=2), reference)


@pytest.mark.parametrize("nproc,micro", [(2, 8), (4, 4)], ids=["cp2", "dp2xcp2"])
def test_context_parallel_with_document_masks_matches_no_cp(nproc, micro):
    """Packed documents under --document-mask, each sequence cut into 4 zig-zag chunks over 2
    ranks: each chunk's mask comes from the whole sequence's documents, and each rank's loss
    is its share of the whole sequences' mean (a document's last token has no target, so the
    shards hold unequal numbers of them): the same training as without context parallelism
    (one process; 2 data-parallel ranks, each the mean of its own micro-batch)."""
    require("torch")
    reference = run(nproc // 2, micro_batch=micro, strategy="single" if nproc == 2 else "fsdp", documents=True)
    close(run(nproc, micro_batch=micro, strategy="fsdp", cp=2, documents=True), reference)


@pytest.fixture(scope="module")
def reference_moe():
    require("torch")
    return run(1, strategy="single", micro_batch=8, n_experts=4)


@pytest.mark.parametrize("nproc,overrides", [(2, {"strategy": "ddp"}), (2, {"ep": 2}), (4, {"ep": 2}),
                                             (4, {"ep": 4}), (2, {"ep": 2, "strategy": "fsdp"}),
                                             (4, {"ep": 2, "strategy": "fsdp-grad-op"})],
                         ids=["ddp", "ep2", "dp2xep2", "ep4", "ep2-fsdp", "dp2xep2-fsdp"])
def test_mixture_of_experts_matches_one(reference_moe, nproc, overrides):
    """4 experts, top-2, load balancing over the global batch: replicated experts (DDP) and
    experts sharded over 2 or 4 ranks, the rest replicated or sharded by FSDP2, train exactly
    like one process."""
    close(run(nproc, micro_batch=8 // nproc, n_experts=4, **overrides), reference_moe)


@pytest.mark.parametrize("saved_with,nproc,resume_with", [
    ({}, 2, {"ep": 2}), ({}, 2, {"strategy": "ddp"}), ({}, 4, {"ep": 4}), ({}, 4, {"ep": 2, "strategy": "fsdp"}),
    ({"strategy": "fsdp"}, 2, {"ep": 2}),
], ids=["ep2", "replicated", "ep4", "dp2xep2-fsdp", "from-ep2-fsdp"])
def test_expert_parallel_snapshot_keeps_every_ranks_experts(reference_moe, tmp_path, saved_with, nproc, resume_with):
    """Saved under EP=2 on 2 processes at step 3 (each rank holds 2 of the 4 experts; the rest
    replicated or sharded by FSDP2), resumed under EP=2, with the experts replicated, under
    EP=4, and under EP=2 x FSDP2 on 4 processes: steps 4-6 continue the reference training.
    (Saved as plain tensors, the experts would be taken by DCP for replicas, one rank's part
    kept: snapshot/parts.py wraps them.)"""
    out = str(tmp_path / "run")
    meshrun.run(_train_steps, {"ep": 2, "micro_batch": 4, "n_experts": 4, "out": out, "save_every": 3, **saved_with},
                nproc=2, timeout_s=300)
    resumed = meshrun.run(_train_steps, {**resume_with, "micro_batch": 8 // nproc, "n_experts": 4, "out": out,
                                         "resume": os.path.join(out, "checkpoints", "step-00000003")},
                          nproc=nproc, timeout_s=300)
    assert sorted(resumed) == [4, 5, 6]
    for step in (4, 5, 6):
        assert resumed[step] == pytest.approx(reference_moe[step - 1][0], rel=2e-4)


def test_hybrid_shard_on_four_processes_matches_one(reference):
    close(run(4, micro_batch=2, strategy="fsdp-hybrid", fsdp_shard_size=2), reference)


@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp"])
def test_accumulation_equals_a_larger_batch(reference, strategy):
    nproc = 1 if strategy == "single" else 2
    micro = 8 // (2 * nproc)  # two micro-steps per optimizer step
    close(run(nproc, strategy=strategy, micro_batch=micro, global_batch=8), reference)


def test_grad_op_accumulation_keeps_parameters_gathered(reference):
    """FSDP2 grad_op over four micro-steps: the same training as one process, and the
    parameters are all-gathered once per optimizer step, not once per micro-step (they are
    kept gathered from one micro-step's backward to the next one's forward)."""
    close(run(2, strategy="fsdp-grad-op", micro_batch=1, global_batch=8), reference)
    once, four = (meshrun.run(_all_gathers_in_a_step, g, nproc=2, timeout_s=300) for g in (2, 8))
    assert once == four > 0, (once, four)


def _all_gathers_in_a_step(global_batch):
    """All-gather calls in the second optimizer step of FSDP2 grad_op, micro-batch 1 on 2
    ranks (counted at torch.distributed, whichever all-gather this torch's FSDP2 calls)."""
    import torch
    import torch.distributed as dist

    from meshrun.config import TrainConfig
    from meshrun.training.loader import BatchStream, RandomTokens
    from meshrun.training.models.gpt import GPT, GPTConfig
    from meshrun.training.trainer import Trainer

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab=64, seq_len=16, d_model=32, n_layers=2, n_heads=4))
    cfg = TrainConfig(strategy="fsdp-grad-op", micro_batch=1, global_batch=global_batch, seq_len=16,
                      steps=2, precision="fp32", log_every=1)
    t = Trainer(model, RandomTokens(64, 16, 64), None, cfg)
    data = BatchStream(t.train_loader, 1, t.dp_size)
    t.train_step(data)
    calls = []
    names = [n for n in ("all_gather_single", "all_gather_into_tensor", "_all_gather_base") if hasattr(dist, n)]
    real = {n: getattr(dist, n) for n in names}
    for n in names:
        setattr(dist, n, lambda *a, _f=real[n], **k: (calls.append(1), _f(*a, **k))[1])
    try:
        t.train_step(data)
    finally:
        for n in names:
            setattr(dist, n, real[n])
    return len(calls)


def test_clipping_matches_single_process():
    require("torch")
    one = run(1, strategy="single", micro_batch=8, grad_clip=0.05)
    for strategy in ("ddp", "fsdp"):
        close(run(2, strategy=strategy, micro_batch=4, grad_clip=0.05), one)
    # FSDP2 x TP on a 2 x 2 mesh: the norm summed over both meshes, every shard scaled alike
    close(run(4, strategy="fsdp", tp=2, micro_batch=4, grad_clip=0.05), one)
    # The clip was active at every step (the reported norm is the pre-clip global norm), and
    # a per-shard norm would be smaller by about sqrt(2) than the single process's: the
    # equal norms above show the norm is taken over all shards.
    assert all(norm > 0.05 * 5 for _, norm in one)


@pytest.mark.parametrize("nproc,overrides", [
    (1, {"strategy": "single", "micro_batch": 8}),
    (2, {"strategy": "ddp", "micro_batch": 4}),
    (2, {"strategy": "fsdp", "micro_batch": 4}),
    (2, {"strategy": "fsdp", "micro_batch": 4, "activation_checkpointing": "selective"}),
], ids=["single", "ddp", "fsdp", "fsdp-selective"])
def test_activation_checkpointing_recomputes_the_same_training(reference, nproc, overrides):
    close(run(nproc, **{"activation_checkpointing": "full", **overrides}), reference)


@pytest.mark.parametrize("nproc,overrides", [
    (1, {"strategy": "single", "micro_batch": 8}),
    (2, {"strategy": "fsdp", "micro_batch": 4}),
], ids=["single", "fsdp-per-block"])
def test_compiled_training_matches_eager(reference, nproc, overrides):
    # Inductor fuses and reorders fp32 arithmetic: allow 1e-3 (a wrong graph is off by >1e-2).
    close(run(nproc, compile=True, **overrides), reference, rtol=1e-3)


def test_compiled_ddp_on_one_host_takes_large_buckets_and_trains_the_same(reference):
    # Both ranks on this host and compiled: 1000-MB buckets (Dynamo's graph is not cut at 100 MB);
    # eager: 100 MB, the overlap of the all-reduce with the backward kept
    compiled = run(2, strategy="ddp", micro_batch=4, compile=True)
    close(compiled, reference, rtol=1e-3)
    assert ("ddp_bucket_bytes", 1000 * 2**20) in compiled
    assert ("ddp_bucket_bytes", 100 * 2**20) in run(2, strategy="ddp", micro_batch=4)


def _train_iterable():
    import torch
    from torch.utils.data import IterableDataset

    from meshrun.config import TrainConfig
    from meshrun.training.trainer import Trainer

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


def _llama_tp_logits_match(sequence_parallel):
    import torch
    import transformers
    from torch.distributed.device_mesh import init_device_mesh

    from meshrun.training.parallel.tp import apply_tp

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    full = transformers.LlamaForCausalLM(cfg)
    sharded = transformers.LlamaForCausalLM(cfg)
    sharded.load_state_dict(full.state_dict())
    sp = apply_tp(sharded.model.layers, init_device_mesh("cpu", (2,), mesh_dim_names=("tp",)),
                  sequence_parallel=sequence_parallel)
    views = []  # whether the last block's output, gathered, is a view (as FSDP2's hook would see it)
    sharded.model.layers[-1].register_forward_hook(
        lambda m, a, out: views.append((out[0] if isinstance(out, tuple) else out)._base is not None))
    x = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    a, b = full(x).logits, sharded(x).logits
    # backward through the shards too: the embedding's gradient (replicated) must agree
    (a.square().mean()).backward()
    (b.square().mean()).backward()
    ga, gb = full.model.embed_tokens.weight.grad, sharded.model.embed_tokens.weight.grad
    return (sp, float((a - b).abs().max()), float(a.abs().max()), float((ga - gb).abs().max()), float(ga.abs().max()),
            views)


@pytest.mark.parametrize("sp", [False, True], ids=["tp", "tp-sp"])
def test_llama_blocks_tensor_parallel_plan(sp):
    """HF Llama blocks under the TP plan (with and without sequence parallelism) compute the
    same logits and input gradients as the unsharded model. The last block returns the whole
    sequence as a tensor of its own, not a view (FSDP2 hooks its backward on a block's output
    and warns on a view: an in-place op on one would lose the hook)."""
    require("transformers")
    applied, diff, scale, gdiff, gscale, views = meshrun.run(_llama_tp_logits_match, sp, nproc=2, timeout_s=300)
    assert applied == sp
    assert diff <= 1e-5 * max(1.0, scale), (diff, scale)
    assert gdiff <= 1e-5 * max(1.0, gscale), (gdiff, gscale)
    assert views == [False]


def _cp_attention_matches():
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F

    from meshrun.training.parallel.context import ContextAttention

    g = torch.Generator().manual_seed(7)
    b, h, t, d = 2, 3, 16, 8
    q, k, v, w = (torch.randn(b, h, t, d, generator=g) for _ in range(4))
    ref = [x.clone().requires_grad_() for x in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=True)
    (out * w).sum().backward()
    attn = ContextAttention(dist.group.WORLD, dist.get_world_size(), dist.get_rank(), t, torch.device("cpu"))
    idx = attn.local
    mine = [x[:, :, idx].clone().requires_grad_() for x in (q, k, v)]
    local_out = attn(*mine)
    (local_out * w[:, :, idx]).sum().backward()
    errs = [float((local_out - out[:, :, idx]).abs().max())]
    errs += [float((m.grad - r.grad[:, :, idx]).abs().max()) for m, r in zip(mine, ref)]
    worst = torch.tensor([max(errs)])
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)  # every rank's shard, not only rank 0's
    return float(worst)


@pytest.mark.parametrize("nproc", [2, 4])
def test_context_parallel_attention_outputs_and_gradients(nproc):
    """Zig-zag shards, gathered K/V, each chunk causal over its key prefix: the same outputs
    and q/k/v gradients as causal attention over the whole sequence (fp32), on every rank."""
    require("torch")
    assert meshrun.run(_cp_attention_matches, nproc=nproc, timeout_s=120) < 1e-5


def test_compile_tune_trains_the_same(reference):
    # Inductor's tuned kernels compute the same training; --compile-tune implies --compile
    close(run(2, strategy="ddp", micro_batch=4, compile_tune=True), reference, rtol=1e-3)
