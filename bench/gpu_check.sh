#!/usr/bin/env bash
# The launch checks on a GPU host: GPU counting without torch, real NCCL launches for torch, JAX and
# Accelerate, meshrun.run on NCCL, and the launch overhead against torchrun.
#   bash bench/gpu_check.sh [OUTDIR]      (needs python3 with torch, jax, accelerate)
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${1:-${OUT:-/tmp/meshrun-gpu}}; mkdir -p "$OUT"
py=python3
nvidia-smi -L
$py -c "import os, torch; from meshrun.cluster.gpus import count_visible_gpus as c; print('GPUS meshrun', c(os.environ), 'torch', torch.cuda.device_count(), torch.__version__)"
$py -m meshrun env --json > "$OUT/env.json"; grep -E '"(nproc_per_node|platform)"' "$OUT/env.json"
echo "== torch NCCL all-reduce, all GPUs"; $py -m meshrun launch tests/scripts/torch_allreduce.py 2>&1 | grep -E "ALLREDUCE|rror"
echo "== JAX one process drives all GPUs"; $py -m meshrun launch -f jax examples/jax_train.py 2>&1 | grep -E "JAXTRAIN|rror"
echo "== JAX one process per GPU"; n=$($py -c "import torch; print(torch.cuda.device_count())")
$py -m meshrun launch -f jax --nproc "$n" examples/jax_train.py 2>&1 | grep -E "JAXTRAIN|rror"
echo "== accelerate, global process count"; $py -m meshrun launch -f accelerate examples/accelerate_train.py 2>&1 | grep -E "ACCEL|rror"
echo "== meshrun.run on NCCL"
$py - <<'PY'
import torch, torch.distributed as dist, meshrun
def f():
    t = torch.ones(1, device="cuda") * (dist.get_rank() + 1); dist.all_reduce(t)
    return dist.get_backend(), dist.get_world_size(), t.item()
print("RUN", meshrun.run(f, timeout_s=300))
PY
echo "== launch overhead (1 process and all GPUs)"
$py bench/launch_overhead.py --runs 10 --nproc 1 | tee "$OUT/overhead_1.txt"
$py bench/launch_overhead.py --runs 10 --nproc "$n" | tee "$OUT/overhead_n.txt"
