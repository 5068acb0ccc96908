"""meshrun train against its peers, same model, same data, same card, same call.

Launch one configuration per torchrun run (all GPUs of the node), e.g.

    torchrun --standalone --nproc_per_node=4 bench/train_bench.py --mode meshrun --size gpt-124m --micro 0 \
        --global-tokens 524288
    torchrun --standalone --nproc_per_node=4 bench/train_bench.py --mode accelerate --size gpt-124m --micro 16

Modes: ddp (plain DDP, autocast bf16), ddp_compile (plain DDP + torch.compile: the
hand-tuned peer), accelerate (Accelerator(mixed_precision="bf16")), fabric (Lightning Fabric
strategy="ddp", precision="bf16-mixed"), fsdp2 (fully_shard per block + root, bf16 params,
fp32 reduce; --compile compiles per block), meshrun (meshrun's Trainer with its defaults:
compiled on GPUs, --strategy, --micro 0 for the planner's micro-batch).
The model is the common GPT-2-style benchmark model (learned positions, LayerNorm, GELU 4x,
tied embeddings, vocab 50304, SDPA causal), random tokens, fused AdamW. Rank 0 prints one line
`BENCH {json}` with tokens/s per GPU, MFU (6N + 12 L d T per token over the bf16 peak) and
peak memory, and appends it to --jsonl.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.distributed as dist

from meshrun.config import TrainConfig
from meshrun.training.metrics import peak_flops
from meshrun.training.models.gpt import GPT, GPTConfig
from meshrun.vocab import GPT_PRESETS


def random_batch(micro: int, seq: int, vocab: int, device: torch.device, step: int, rank: int):
    g = torch.Generator(device=device).manual_seed(step * 1000 + rank)
    t = torch.randint(0, vocab, (micro, seq + 1), device=device, generator=g)
    return t[:, :-1], t[:, 1:]


# --mlp: GPTConfig's default ("auto": cuBLASLt's epilogues where nvmath-python is), the plain
# MLP, or the epilogues everywhere (their ops' torch path where cuBLASLt cannot run)
MLPS = {"default": GPTConfig.fused_mlp, "plain": False, "cublaslt": True}


def make_model(size: str, seq: int, vocab: int, experts: int = 0, fp32_residual: bool = False,
               loss: str = "default", mlp: str = "default", peer: bool = False) -> GPT:
    """The benchmark's GPT. ``peer``: for the peers' modes, whose "default" is the plain model
    (Linear-GELU-Linear, F.cross_entropy), not meshrun's kernels."""
    torch.manual_seed(0)
    if peer:
        loss, mlp = ("plain" if loss == "default" else loss), ("plain" if mlp == "default" else mlp)
    fused = GPTConfig.fused_loss if loss == "default" else loss == "fused"
    head = GPTConfig.head_loss if loss == "default" else loss == "head"
    p = GPT_PRESETS[size]
    return GPT(GPTConfig(vocab=vocab, seq_len=seq, n_experts=experts, low_precision_residual=not fp32_residual,
                         fused_loss=fused, head_loss=head, fused_mlp=MLPS[mlp], d_model=p.d_model,
                         n_layers=p.n_layers, n_heads=p.n_heads))


def pick_sdpa(backend: str) -> None:
    """Leave only one SDPA backend on (and math, the fallback), for every mode alike."""
    if backend == "default":
        return
    b = torch.backends.cuda
    b.enable_flash_sdp(backend == "flash")
    b.enable_cudnn_sdp(backend == "cudnn")
    b.enable_mem_efficient_sdp(backend == "efficient")


WARMUP_S = [0.0]  # the warm-up steps' wall time (compilation included)


def timed_loop(step_fn, warmup: int, steps: int, device: torch.device) -> float:
    t0 = time.perf_counter()
    for i in range(warmup):
        step_fn(i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    dist.barrier()
    WARMUP_S[0] = time.perf_counter() - t0
    start = time.perf_counter()
    for i in range(steps):
        step_fn(warmup + i)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def inductor_settings(pairs: list[str]) -> dict:
    """Apply ``--inductor KEY=VALUE`` to torch._inductor.config; return them with the TORCHINDUCTOR_*
    variables of the environment, so that a result line says which compiler settings made it."""
    import torch._inductor.config as cfg

    applied: dict = {k: v for k, v in sorted(os.environ.items())
                     if k.startswith("TORCHINDUCTOR_") and k != "TORCHINDUCTOR_CACHE_DIR"}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        owner, _, leaf = key.rpartition(".")  # "triton.cudagraphs" lives in a sub-config
        target = getattr(cfg, owner, None) if owner else cfg
        if not sep or target is None or not hasattr(target, leaf):
            raise SystemExit(f"train_bench: --inductor {pair!r}: expected KEY=VALUE with KEY in torch._inductor.config")
        try:
            value = json.loads(raw)
        except ValueError:
            value = raw
        setattr(target, leaf, value)
        applied[key] = value
    return applied


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", required=True, choices=["ddp", "ddp_compile", "accelerate", "fabric", "fsdp2", "meshrun"])
    ap.add_argument("--size", default="gpt-124m")
    ap.add_argument("--micro", type=int, default=16, help="0 (meshrun only): the planner chooses, for --global-tokens")
    ap.add_argument("--global-tokens", type=int, default=None,
                    help="meshrun: tokens per optimizer step over all ranks (global batch x seq)")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50304)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--compile", action="store_true", help="the peers: torch.compile; meshrun: --compile on")
    ap.add_argument("--eager", action="store_true", help="meshrun: --compile off (its default compiles on GPUs)")
    ap.add_argument("--compile-tune", action="store_true", help="meshrun: --compile-tune (coordinate-descent tuning)")
    ap.add_argument("--ac", action="store_true", help="meshrun: activation checkpointing of every block")
    ap.add_argument("--fp32-residual", action="store_true",
                    help="keep the GPT's residual stream fp32 under autocast (GPTConfig.low_precision_residual off)")
    ap.add_argument("--loss", default="default", choices=["default", "plain", "fused", "head"],
                    help="the GPT's loss (default: meshrun's head, the peers' plain): F.cross_entropy over full "
                         "logits (plain), chunked (models/losses.py), or one Triton pass that writes the logits' "
                         "gradient in the forward (head: kernels/head_loss.py)")
    ap.add_argument("--sdpa", default="default", choices=["default", "flash", "cudnn", "efficient"])
    ap.add_argument("--mlp", default="default", choices=list(MLPS),
                    help="the GPT's MLP: the model's default (meshrun: cuBLASLt's epilogues where nvmath-python "
                         "is; the peers: plain), Linear, GELU, Linear (plain: Inductor fuses the GELU when "
                         "compiled), or the GELU in cuBLASLt's matmul epilogues (cublaslt: kernels/fused_mlp.py)")
    ap.add_argument("--strategy", default="auto", help="meshrun: a name of meshrun train --strategy")
    ap.add_argument("--bucket-mb", type=int, default=None, help="DDP buckets (default: the Trainer's choice)")
    ap.add_argument("--reduce-precision", default="fp32")
    ap.add_argument("--jsonl", default=None)
    # meshrun's other layouts
    for flag in ("--tp", "--pp", "--cp", "--ep", "--experts"):
        ap.add_argument(flag, type=int, default=None)
    ap.add_argument("--pp-schedule", default="1f1b")
    ap.add_argument("--inductor", action="append", default=[], metavar="KEY=VALUE",
                    help="set torch._inductor.config.KEY (repeatable; VALUE read as JSON, else a string), "
                         "for knobs without an environment variable, e.g. autotune_fallback_to_aten=true")
    args = ap.parse_args()
    inductor = inductor_settings(args.inductor)

    local = int(os.environ.get("LOCAL_RANK", 0))
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    bf16 = cuda
    pick_sdpa(args.sdpa)
    model = make_model(args.size, args.seq, args.vocab, args.experts or 0, args.fp32_residual, args.loss, args.mlp,
                       peer=args.mode != "meshrun")
    flops_per_token = model.flops_per_token()
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else torch.autocast("cpu", enabled=False)
    extra: dict = {}

    if args.mode == "meshrun":
        from meshrun.training.loader import BatchStream, RandomTokens
        from meshrun.training.trainer import Trainer

        global_batch = args.global_tokens // args.seq if args.global_tokens else None
        compile_ = "on" if args.compile else "off" if args.eager else "auto"
        cfg = TrainConfig(strategy=args.strategy, micro_batch=args.micro or None, global_batch=global_batch,
                          seq_len=args.seq, compile=compile_, compile_tune=args.compile_tune,
                          steps=args.warmup + args.steps, lr=3e-4, log_every=10**9, grad_clip=1.0,
                          ddp_bucket_mb=args.bucket_mb, reduce_precision=args.reduce_precision,
                          activation_checkpointing="full" if args.ac else "none",
                          **{k: v for k, v in dict(tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep,
                                                   pp_schedule=args.pp_schedule).items() if v is not None})
        trainer = Trainer(model, RandomTokens(1 << 20, args.seq, args.vocab), None, cfg)
        data = BatchStream(trainer.train_loader, trainer.cfg.micro, trainer.dp_size)
        ddp = getattr(trainer.layout, "ddp", None)
        extra.update(ac=trainer.choice.activation_checkpointing, seq=args.seq, layout=trainer.layout.description,
                     tp=args.tp, pp=args.pp, cp=args.cp, ep=args.ep, strategy=trainer.strategy,
                     bucket_mb=ddp.bucket_bytes_cap // 2**20 if ddp is not None else args.bucket_mb,
                     reduce_precision=args.reduce_precision, attention=cfg.attention,
                     compiled=trainer.cfg.compiles(cuda))
        step_fn = lambda i: trainer.train_step(data)  # noqa: E731
        rank, world = trainer.rt.rank, trainer.rt.world_size
        args.micro = trainer.cfg.micro  # the planner's choice under --micro 0
        extra.update(accumulation=trainer.accum)
    else:
        dist.init_process_group("nccl" if cuda else "gloo")
        rank, world = dist.get_rank(), dist.get_world_size()
        model.to(device)
        if args.mode in ("ddp", "ddp_compile"):
            from torch.nn.parallel import DistributedDataParallel as DDP

            net = DDP(model, device_ids=[local] if cuda else None)
            if args.mode == "ddp_compile":
                net = torch.compile(net)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda)

            def step_fn(i):
                x, y = random_batch(args.micro, args.seq, args.vocab, device, i, rank)
                with amp:
                    loss = net(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
        elif args.mode == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else None
            for block in model.blocks:
                if args.compile:
                    block.compile()
                fully_shard(block, **({"mp_policy": mp} if mp else {}))
            fully_shard(model, **({"mp_policy": mp} if mp else {}))
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda)

            def step_fn(i):
                x, y = random_batch(args.micro, args.seq, args.vocab, device, i, rank)
                loss = model(x, y)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
        elif args.mode == "accelerate":
            from accelerate import Accelerator

            acc = Accelerator(mixed_precision="bf16" if bf16 else "no", cpu=not cuda)
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda)
            net, opt = acc.prepare(model, opt)

            def step_fn(i):
                x, y = random_batch(args.micro, args.seq, args.vocab, device, i, rank)
                loss = net(x, y)
                acc.backward(loss)
                acc.clip_grad_norm_(net.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
        else:  # fabric
            from lightning.fabric import Fabric

            fabric = Fabric(accelerator="cuda" if cuda else "cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
                            num_nodes=int(os.environ.get("GROUP_WORLD_SIZE", 1)), strategy="ddp",
                            precision="bf16-mixed" if bf16 else "32-true")
            fabric.launch()
            opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda)
            net, opt = fabric.setup(model, opt)

            def step_fn(i):
                x, y = random_batch(args.micro, args.seq, args.vocab, device, i, rank)
                loss = net(x, y)
                fabric.backward(loss)
                fabric.clip_gradients(net, opt, max_norm=1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)

    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    elapsed = timed_loop(step_fn, args.warmup, args.steps, device)
    # TP/PP/CP ranks share their micro-batch: per GPU, the tokens divide by those degrees
    share = trainer.layout.token_share if args.mode == "meshrun" else 1
    accum = trainer.accum if args.mode == "meshrun" else 1
    tokens_per_gpu = args.micro * accum * args.seq * args.steps / elapsed / share
    peak = peak_flops(device)
    result = {
        "mode": args.mode, "size": args.size, "gpus": world, "micro": args.micro,
        "compile": args.compile or args.compile_tune, "compile_tune": args.compile_tune, **extra,
        "tokens_per_s_per_gpu": round(tokens_per_gpu), "mfu": round(tokens_per_gpu * flops_per_token / peak, 4)
        if peak else None, "peak_mem_gib": round(torch.cuda.max_memory_allocated(device) / 2**30, 2) if cuda else None,
        "card": torch.cuda.get_device_name(device) if cuda else "cpu", "torch": torch.__version__,
        "warmup_s": round(WARMUP_S[0], 1), "fp32_residual": args.fp32_residual,
        "fused_loss": model.cfg.fused_loss, "sdpa": args.sdpa, "inductor": inductor,
        "date": time.strftime("%Y-%m-%d"),
    }
    way = getattr(model.blocks[0], "fused_mlp", False)
    result.update(head_loss=model.cfg.head_loss, mlp=way or "plain")  # as resolved ("auto": by nvmath's presence)
    if way:  # which path ran, and why not cuBLASLt's if it did not
        from meshrun.kernels import fused_mlp

        result.update(mlp_paths=dict(fused_mlp.PATHS), mlp_fallback=list(fused_mlp.FALLBACK.values()),
                      mlp_calls=dict(fused_mlp.EXECUTED))
    if rank == 0:
        line = json.dumps(result)
        print("BENCH " + line, flush=True)
        if args.jsonl:
            with open(args.jsonl, "a") as f:
                f.write(line + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
