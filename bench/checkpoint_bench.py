"""Snapshot cost: meshrun's sharded save/load (sync and async) against the plain
recipe (full state dict gathered to rank 0, then torch.save), and the step-time overhead of
asynchronous saving.

    torchrun --standalone --nproc_per_node=N bench/checkpoint_bench.py --size gpt-1.3b --dir /tmp/ckb
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import time

import torch
import torch.distributed as dist

from meshrun.config import TrainConfig
from meshrun.training import snapshot as checkpoint
from meshrun.training.loader import BatchStream, RandomTokens
from meshrun.training.models.gpt import gpt
from meshrun.training.snapshot import Position
from meshrun.training.trainer import Trainer


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def timed(fn) -> float:
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    start = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    dist.barrier()
    return time.perf_counter() - start


def sync_phases(args, t, data, root: str, pos, res: dict, rank: int) -> None:
    """meshrun's synchronous save and verified load, then the plain recipe (torch.save of a full
    state dict on rank 0)."""
    cfg = t.cfg
    res["sync_save_s"] = timed(lambda: checkpoint.save(root, pos, t.model, t.optimizer, cfg.to_json(), 1))
    snap = checkpoint.latest(root)
    res["snapshot_gb"] = dir_bytes(snap) / 1e9
    res["sync_save_gb_s"] = res["snapshot_gb"] / res["sync_save_s"]
    res["load_s"] = timed(lambda: checkpoint.load(snap, t.model, t.optimizer))
    res["load_gb_s"] = res["snapshot_gb"] / res["load_s"]
    if rank == 0:
        shutil.rmtree(root, ignore_errors=True)  # keep the disk for the next phases

    def seeds_recipe() -> None:  # gather everything on rank 0, one torch.save
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        msd, osd = get_state_dict(t.model, t.optimizer, options=StateDictOptions(full_state_dict=True,
                                                                                  cpu_offload=True))
        if rank == 0:
            torch.save({"model": msd, "optim": osd}, os.path.join(args.dir, "full.pt"))
    res["torch_save_rank0_s"] = timed(seeds_recipe)
    if rank == 0:
        res["torch_save_gb"] = os.path.getsize(os.path.join(args.dir, "full.pt")) / 1e9
        os.unlink(os.path.join(args.dir, "full.pt"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--size", default="gpt-1.3b")
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--global-batch", type=int, default=None,
                    help="samples per optimizer step over all ranks (a multiple of micro x ranks: accumulation)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--strategy", default="auto")
    ap.add_argument("--compile", action="store_true", help="compiled steps (default eager, as the results were taken)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--save-every", type=int, default=20)
    ap.add_argument("--dir", default="/tmp/meshrun-ckpt-bench")
    ap.add_argument("--phases", choices=("all", "async"), default="all",
                    help="async: only the training-with-async-snapshots phases (and their check)")
    ap.add_argument("--prestage", action="store_true",
                    help="one asynchronous save before the timed phases: they then measure the steady state "
                         "(the first save's buffer allocation is reported apart)")
    args = ap.parse_args()
    model = gpt(args.size, seq_len=args.seq, vocab=50304)
    cfg = TrainConfig(strategy=args.strategy, micro_batch=args.micro, global_batch=args.global_batch,
                      seq_len=args.seq, steps=10**6, compile="on" if args.compile else "off",
                      log_every=10**9, keep_last=1)
    t = Trainer(model, RandomTokens(1 << 20, args.seq, 50304), None, cfg)
    data = BatchStream(t.train_loader, cfg.micro, t.rt.world_size)
    rank = t.rt.rank
    if rank == 0:
        shutil.rmtree(args.dir, ignore_errors=True)
    for _ in range(3):
        t.train_step(data)
    res: dict = {"size": args.size, "world": t.rt.world_size, "strategy": t.strategy,
                 "card": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    root = os.path.join(args.dir, "meshrun")
    pos = Position(t.step, data.epoch, data.samples)
    if args.phases == "all":
        sync_phases(args, t, data, root, pos, res, rank)

    def drain() -> None:  # the last snapshot's background write, which training did not wait for
        if t.snapshots.pending is not None:
            checkpoint.commit(t.snapshots.pending)
            t.snapshots.pending = None

    def steps(n: int, save_async: bool) -> None:
        for i in range(n):
            t.train_step(data)
            if save_async and (i + 1) % args.save_every == 0:
                t.cfg = t.cfg.replace(out=os.path.join(args.dir, "async"), async_save=True)
                start = time.perf_counter()
                pending = t.snapshots.pending
                t.save(data)  # training waits for: the previous snapshot's commit, then staging this one
                res["async_blocking_s"] = res.get("async_blocking_s", 0.0) + time.perf_counter() - start
                if pending is not None:  # the commit t.save did first, and its wait for the writer
                    res["commit_s"] = res.get("commit_s", 0.0) + pending.commit_s
                    res["commit_wait_s"] = res.get("commit_wait_s", 0.0) + pending.wait_s
                for k, v in t.snapshots.pending.timings.items():  # this save's own parts
                    res[k] = res.get(k, 0.0) + v
        if torch.cuda.is_available():
            torch.cuda.synchronize()

    if args.prestage:  # the first asynchronous save allocates (and pins) the staging buffers: apart
        t.cfg = t.cfg.replace(out=os.path.join(args.dir, "async"), async_save=True)
        res["first_async_blocking_s"] = timed(lambda: t.save(data))
        res["first_async_drain_s"] = timed(drain)
    res["steps_plain_s"] = timed(lambda: steps(args.steps, False))
    res["steps_async_s"] = timed(lambda: steps(args.steps, True))
    res["async_drain_s"] = timed(drain)
    # the last async snapshot was taken after the last step: loading it must change no weight
    before = [_local(p).detach().clone() for p in t.model.parameters()]
    checkpoint.load(checkpoint.latest(os.path.join(args.dir, "async", "checkpoints")), t.model, t.optimizer)
    same = torch.tensor([float(all(torch.equal(a, _local(p)) for a, p in zip(before, t.model.parameters())))],
                        device=t.rt.device)
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    res["async_snapshot_exact"] = bool(same.item())
    res["async_overhead"] = res["steps_async_s"] / res["steps_plain_s"] - 1
    res["async_saves"] = args.steps // args.save_every
    if rank == 0:
        print("CKPT " + json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in res.items()}), flush=True)
        shutil.rmtree(args.dir, ignore_errors=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
