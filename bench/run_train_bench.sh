#!/usr/bin/env bash
# Run bench/train_bench.py configurations one after another on this node's GPUs.
#   bash bench/run_train_bench.sh OUTDIR SET      SET: 124m | 1.3b | all
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
OUT=${1:-/tmp/meshrun-bench}; SET=${2:-all}; mkdir -p "$OUT"
N=$(python3 -c "import torch; print(torch.cuda.device_count())")
run() {  # run NPROC ARGS...
  local n=$1; shift
  local devs; devs=$(seq -s, 0 $((n - 1)))
  CUDA_VISIBLE_DEVICES=$devs timeout 300 python3 -m torch.distributed.run --standalone --nproc_per_node="$n" \
    bench/train_bench.py --jsonl "$OUT/results.jsonl" "$@" > "$OUT/last.log" 2>&1
  local rc=$?
  grep -h "^BENCH" "$OUT/last.log" || { echo "FAILED rc=$rc: $*"; grep -iE "error|Error" "$OUT/last.log" | tail -3; }
}
if [ "$SET" = 124m ] || [ "$SET" = all ]; then
  run "$N" --mode ddp --size gpt-124m --micro 16
  run "$N" --mode accelerate --size gpt-124m --micro 16
  run "$N" --mode fabric --size gpt-124m --micro 16
  run "$N" --mode ddp_compile --size gpt-124m --micro 64
  run "$N" --mode meshrun --size gpt-124m --micro 64 --compile
  run 1 --mode meshrun --size gpt-124m --micro 64 --compile
fi
if [ "$SET" = tune ]; then  # knobs tried after the first runs (docs/benchmarks.md)
  run "$N" --mode meshrun --size gpt-124m --micro 64 --compile --bucket-mb 100
  run "$N" --mode meshrun --size gpt-124m --micro 64 --compile --reduce-precision bf16
  run "$N" --mode meshrun --size gpt-124m --micro 128 --compile
  run "$N" --mode meshrun --size gpt-124m --micro 64 --compile --strategy fsdp --fsdp grad_op
  run "$N" --mode meshrun --size gpt-1.3b --micro 32 --compile --strategy fsdp
  run "$N" --mode meshrun --size gpt-1.3b --micro 16 --compile --strategy fsdp --fsdp grad_op
fi
if [ "$SET" = final ]; then  # meshrun's defaults after tuning, plus the CLI's default job
  run "$N" --mode meshrun --size gpt-124m --micro 64 --compile
  run 1 --mode meshrun --size gpt-124m --micro 64 --compile
  run "$N" --mode meshrun --size gpt-1.3b --micro 32 --compile
  run 1 --mode meshrun --size gpt-1.3b --micro 32 --compile
  timeout 200 python3 -m meshrun train --steps 60 --log-every 20 --out "$OUT/default-job" 2>&1 | grep -E "^meshrun|^step|rror" | tail -5
fi
if [ "$SET" = 1.3b ] || [ "$SET" = all ]; then
  run "$N" --mode fsdp2 --size gpt-1.3b --micro 16 --compile
  run "$N" --mode meshrun --size gpt-1.3b --micro 16 --compile
  run "$N" --mode meshrun --size gpt-1.3b --micro 16 --compile --strategy fsdp
  run 1 --mode meshrun --size gpt-1.3b --micro 16 --compile
fi
