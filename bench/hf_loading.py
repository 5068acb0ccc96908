"""CPU memory and time of reading a Hugging Face model's weights into FSDP2 shards: each rank
builds the model on the meta device, shards it, and fills its shards from the safetensors
files (``meshrun.training.weights.materialize``, as ``meshrun train --model DIR`` does). Reports,
per rank, the peak resident memory added while reading, against the model's bf16 size.

    python3 bench/hf_config.py llama3-8b /tmp/l8-2 --layers 2 --weights
    python3 bench/hf_loading.py /tmp/l8-2 --nproc 2
"""

from __future__ import annotations

import argparse
import json
import time


def _rss(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field))


def _load(path: str) -> dict:
    import torch
    import torch.distributed as dist

    from meshrun.modelinfo import hf
    from meshrun.training.parallel.dims import make_dims
    from meshrun.training.parallel.fsdp import apply_fsdp
    from meshrun.training.weights import Pretrained, materialize

    source = hf.locate(path)
    model = hf.build_on_meta(hf.load_config(source))
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    meshes = make_dims(dist.get_world_size()).build(device.type)
    apply_fsdp(model, model.model.layers, meshes.fsdp(), "full", bf16=True)
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the peak counter from here
    before, start = _rss("VmRSS:"), time.perf_counter()
    materialize(model, device, 0, Pretrained(source.directory, source.weight_files))
    seconds = time.perf_counter() - start
    mine = {"rank": dist.get_rank(), "peak_growth_bytes": _rss("VmHWM:") - before, "seconds": round(seconds, 2)}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    largest = max(p.numel() for p in model.parameters()) * 2
    total = sum(p.numel() for p in model.parameters()) * 2
    return {"model_bf16_bytes": total, "largest_tensor_bf16_bytes": largest, "ranks": everyone}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", help="a model directory with config.json and safetensors files")
    ap.add_argument("--nproc", type=int, default=2)
    a = ap.parse_args()
    import meshrun

    out = meshrun.run(_load, a.model, nproc=a.nproc, timeout_s=1800)
    gib = 2**30
    print(f"model {out['model_bf16_bytes'] / gib:.2f} GiB bf16 (1/{a.nproc}: "
          f"{out['model_bf16_bytes'] / a.nproc / gib:.2f} GiB), "
          f"largest tensor {out['largest_tensor_bf16_bytes'] / gib:.2f} GiB")
    for r in out["ranks"]:
        print(f"rank {r['rank']}: peak resident growth {r['peak_growth_bytes'] / gib:.2f} GiB in {r['seconds']} s")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
