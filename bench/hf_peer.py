"""The plain peer on the Hugging Face model meshrun trains: the same config.json, trained as a
torch user would without meshrun: DDP, ``torch.compile`` of the whole model, bf16 autocast,
fused AdamW, random tokens, the model's own loss (``labels=``).

    python3 bench/hf_config.py gpt2 /tmp/gpt2
    torchrun --standalone --nproc_per_node=1 bench/hf_peer.py --model /tmp/gpt2 --batch 64 --compile

Prints one line ``RESULT {...}`` from rank 0: tokens/s per GPU, MFU by meshrun's count
(training/metrics.flops_per_token: 6N + 12·L·d·T) over the card's bf16 peak, peak memory.
It runs beside ``meshrun train --model DIR`` in the same call, so the two rows share the card.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="a directory with a Hugging Face config.json")
    ap.add_argument("--batch", type=int, default=16, help="sequences per GPU per step")
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="torch.compile the whole model")
    a = ap.parse_args()

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoConfig, AutoModelForCausalLM

    from meshrun.training.metrics import flops_per_token, peak_flops

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", 0))
    dev = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group("nccl" if cuda else "gloo")
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(a.model)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").to(dev)
    fpt = flops_per_token(model, a.seq)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, fused=cuda)
    run = torch.compile(model) if a.compile else model
    run = DDP(run, device_ids=[local] if cuda else None, gradient_as_bucket_view=True)
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = [torch.randint(0, config.vocab_size, (a.batch, a.seq), generator=g) for _ in range(4)]

    def step(i: int) -> None:
        x = batches[i % 4].to(dev, non_blocking=True)
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            loss = run(input_ids=x, labels=x).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for i in range(a.warmup):
        step(i)
    if cuda:
        torch.cuda.synchronize()
    start = time.perf_counter()
    for i in range(a.steps):
        step(i)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    tokens = a.batch * a.seq * a.steps / seconds
    peak = peak_flops(dev)
    if dist.get_rank() == 0:
        print("RESULT " + json.dumps({
            "model": config.model_type, "world": dist.get_world_size(), "batch": a.batch, "seq": a.seq,
            "compile": a.compile, "tokens_per_s_per_gpu": round(tokens),
            "mfu": round(tokens * fpt / peak, 4) if fpt and peak else None,
            "peak_gib": round(torch.cuda.max_memory_reserved(dev) / 2**30, 1) if cuda else None}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
