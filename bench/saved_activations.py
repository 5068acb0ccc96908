"""What one block keeps for backward on the GPU, eager and under torch.compile, against what
the planner's trace says (plan/trace.py): the trace checked directly, not through a
whole run's nvidia-smi peak.

For each model, built twice with different numbers of blocks (a Hugging Face shape of
bench/hf_config.py, or meshrun's GPT), fp32 parameters under bf16 autocast as single-GPU/DDP
training runs them, the bytes allocated after the loss's forward less those before it; their
difference over the difference in blocks is one block's saved bytes (embeddings and the loss
cancel). Five ways to run it: eager; ``liger``, eager with Liger Kernel's fused kernels patched
in as meshrun patches a Hugging Face model Liger knows; the whole model compiled (torch.compile, as meshrun
compiles single-GPU training); compiled inside DDP (one process: Dynamo then cuts the graph at
DDP's 1000 MB buckets, as meshrun's compiled DDP on one host); and ``blocks-bf16``, bf16
parameters with each block compiled on its own, as under FSDP2. Measured at the third step:
DDP allocates its gradient buckets again at the second, inside the forward.

The eager bytes include the blocks' bf16 weight copies autocast makes (the planner counts them
with the parameters, the trace leaves them out).

    python3 bench/saved_activations.py [--models hf-llama3.2-1b,hf-gpt2-medium] [--out FILE]

Prints a table (GPU MiB per block against the trace's eager and compiled bytes) and writes one
JSON line per model and way to --out.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from typing import Any

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)

# name -> (hf_config shape or meshrun GPT preset, sequence length, micro-batch, (fewer, more) blocks)
MODELS: dict[str, tuple[str, int, int, tuple[int, int]]] = {
    "hf-llama3.2-1b": ("llama3.2-1b", 2048, 2, (1, 3)),
    "hf-qwen2.5-1.5b": ("qwen2.5-1.5b", 2048, 2, (1, 3)),
    "hf-gemma-2-2b": ("gemma-2-2b", 2048, 1, (1, 3)),
    "hf-mixtral-small": ("mixtral-small", 2048, 4, (1, 3)),
    "hf-gpt2-medium": ("gpt2-medium", 1024, 8, (1, 3)),
    "hf-mistral-7b": ("mistral-7b", 2048, 2, (1, 3)),
    "gpt-1.3b": ("gpt-1.3b", 1024, 4, (1, 3)),
    "user-llama-1b": ("user-llama-1b", 2048, 4, (1, 3)),  # bench/usermodels.py's llama_1b: its loss outside
}
WAYS = ("eager", "compiled", "compiled-ddp", "blocks-bf16", "liger")
MIB = 2**20


def build(shape: str, layers: int, seq: int, where: str) -> Any:
    import torch

    if shape.startswith("gpt-"):
        return gpt_model(shape, layers, seq)
    if shape == "user-llama-1b":
        return user_llama(layers)
    from hf_config import write_config

    from meshrun.modelinfo import hf

    path = os.path.join(where, f"{shape}-{layers}")
    with contextlib.redirect_stdout(io.StringIO()):
        write_config(shape, path, layers=layers)
    model = hf.build_on_meta(hf.load_config(hf.locate(path, "--model"), "--model"), "--model", path)
    model = model.to_empty(device="cpu")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02)
        if hasattr(model, "model") and hasattr(model.model, "rotary_emb"):  # its inv_freq, recomputed
            rotary = model.model.rotary_emb
            inv, _ = rotary.rope_init_fn(rotary.config, None) if hasattr(rotary, "rope_init_fn") else (None, None)
            if inv is not None:
                rotary.inv_freq.copy_(inv)
    return model


def user_llama(layers: int) -> Any:
    import usermodels

    return usermodels.ScratchLlama(50304, 2048, layers, 32, 8, 5632, 4096)


def gpt_model(preset: str, layers: int, seq: int) -> Any:
    """meshrun's GPT preset with ``layers`` blocks, its plain PyTorch path (no Triton kernels)."""
    from meshrun.training.models.gpt import GPT, GPTConfig
    from meshrun.vocab import GPT_PRESETS

    p = GPT_PRESETS[preset]
    return GPT(GPTConfig(vocab=50304, seq_len=seq, d_model=p.d_model, n_layers=layers, n_heads=p.n_heads,
                         fused_mlp=False, head_loss=False))


def saved_bytes(model: Any, way: str, seq: int, micro: int) -> dict[str, int]:
    """On cuda:0 at the third step (the first compiles; DDP allocates its buckets again at the
    second): ``after``, the bytes allocated after the loss's forward less those before it;
    ``forward_peak``, the most allocated during the forward, and ``peak``, during its backward,
    less those before the forward."""
    import torch

    from meshrun.modelinfo.blocks import find_blocks
    from meshrun.modelinfo.loss import loss_mode, model_loss

    torch._dynamo.reset()
    model = model.cuda()
    run = model
    if way == "blocks-bf16":  # bf16 parameters, each block compiled on its own: as under FSDP2
        model = run = model.to(torch.bfloat16)
        for block in find_blocks(model, None)[1]:
            block.compile()
    if way == "compiled-ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        run = DDP(model, device_ids=[0], bucket_cap_mb=1000, gradient_as_bucket_view=True)
    if way in ("compiled", "compiled-ddp"):
        run.compile()
    if way == "liger":
        from meshrun.kernels.liger import apply_liger

        apply_liger(model)
    mode = loss_mode(model)
    x = torch.randint(0, 1000, (micro, seq), device="cuda")
    for _ in range(3):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", torch.bfloat16, enabled=way != "blocks-bf16"):
            loss = model_loss(run, mode, x, x)
        torch.cuda.synchronize()
        after = torch.cuda.memory_allocated()
        forward_peak = torch.cuda.max_memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        model.zero_grad(set_to_none=True)
        del loss
    del run
    model.cpu()
    torch.cuda.empty_cache()
    return {"after": after - before, "forward_peak": forward_peak - before, "peak": peak - before}


def meta_model(shape: str, layers: int, seq: int, where: str) -> Any:
    """The row's model with ``layers`` blocks on the meta device (a Hugging Face shape from the
    config.json ``build`` wrote)."""
    import torch

    if shape.startswith("gpt-") or shape.startswith("user-"):
        with torch.device("meta"):
            return gpt_model(shape, layers, seq) if shape.startswith("gpt-") else user_llama(layers)
    from meshrun.modelinfo import hf

    path = os.path.join(where, f"{shape}-{layers}")
    return hf.build_on_meta(hf.load_config(hf.locate(path, "--model"), "--model"), "--model", path)


def traced_per_block(shape: str, layers: int, seq: int, micro: int, where: str,
                     mode: str, liger: bool = False) -> tuple[float, float | None]:
    """The trace's bytes per block at ``micro`` sequences: eager (with Liger's kernels when
    ``liger``), and Inductor's partition."""
    from meshrun.plan.trace import trace

    tr = trace(meta_model(shape, layers, seq, where), mode, seq, liger=liger)
    if tr is None:
        return float("nan"), None
    eager = tr.at("blocks", micro) / layers
    compiled = None if tr.blocks_compiled is None else tr.at("blocks_compiled", micro) / layers
    return eager, compiled


def trace_terms(shape: str, layers: int, seq: int, micro: int, where: str, mode: str,
                liger: bool = False) -> dict[str, float]:
    """The trace's terms for the model with ``layers`` blocks at ``micro`` sequences."""
    from meshrun.plan.trace import trace

    tr = trace(meta_model(shape, layers, seq, where), mode, seq, liger=liger)
    if tr is None:
        return {}
    return {k: tr.at(k, micro) for k in ("embed", "blocks", "block_max", "block_input", "tail", "blocks_compiled")
            if getattr(tr, k) is not None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--ways", default=",".join(WAYS))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    import torch
    import torch.distributed as dist

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    where = tempfile.mkdtemp(prefix="saved-activations-")
    print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}")
    print("| model | seq x micro | way | GPU MiB per block | trace eager | trace compiled | GPU / trace |")
    print("|---|---|---|---|---|---|---|")
    for name in a.models.split(","):
        shape, seq, micro, (few, many) = MODELS[name]
        for way in a.ways.split(","):
            t0 = time.time()
            try:
                got = [saved_bytes(build(shape, n, seq, where), way, seq, micro) for n in (few, many)]
            except Exception as exc:  # one model failing leaves the others to measure
                print(f"| {name} | {seq} x {micro} | {way} | failed: {type(exc).__name__}: {str(exc)[:200]} |")
                continue
            per_block = (got[1]["after"] - got[0]["after"]) / (many - few)
            mode = "bf16" if way == "blocks-bf16" else "autocast"
            eager, compiled = traced_per_block(shape, many, seq, micro, where, mode, liger=way == "liger")
            ref = eager if way in ("eager", "liger") else compiled
            ratio = f"{per_block / ref:.3f}" if ref else "-"
            print(f"| {name} | {seq} x {micro} | {way} | {per_block / MIB:.1f} | {eager / MIB:.1f} | "
                  f"{'-' if compiled is None else f'{compiled / MIB:.1f}'} | {ratio} |", flush=True)
            if a.out:
                with open(a.out, "a") as f:
                    f.write(json.dumps({"model": name, "shape": shape, "seq": seq, "micro": micro, "way": way,
                                        "blocks": [few, many], "gpu_bytes": got, "gpu_per_block": per_block,
                                        "trace_eager_per_block": eager, "trace_compiled_per_block": compiled,
                                        "trace": trace_terms(shape, few, seq, micro, where, mode,
                                                             liger=way == "liger"),
                                        "card": torch.cuda.get_device_name(0), "torch": torch.__version__,
                                        "wall_s": round(time.time() - t0, 1)}) + "\n")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
