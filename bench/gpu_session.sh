#!/usr/bin/env bash
# One lent 4-GPU machine, one part per call (each part ends inside a 10-minute call):
#   bash bench/gpu_session.sh train   OUT   issue 3: meshrun's auto settings vs the hand-tuned peers,
#                                           1-GPU baselines and compiler knobs run side by side
#   bash bench/gpu_session.sh systems OUT   issues 7, 4, 5: bench vs direct, snapshots, planner grid
#   bash bench/gpu_session.sh layouts OUT   issues 8, 9: the 1.3B model laid out seven ways
#   bash bench/gpu_session.sh seqlen  OUT   issue 9: the longest sequence, FSDP2 alone vs FSDP2 x CP4 (1.3B, AC)
# Results: OUT/results.jsonl (train_bench rows), OUT/summary.txt (every other result line).
# Every run has its own time limit, and a part starts nothing after its deadline (DEADLINE_S).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
PART=$1; OUT=${2:-/tmp/meshrun-gpu}; mkdir -p "$OUT"
DEADLINE_S=${DEADLINE_S:-540}
T0=$SECONDS
S="$OUT/summary.txt"
late() { [ $((SECONDS - T0)) -gt "$1" ] && { echo "SKIPPED (deadline) $2" | tee -a "$S"; return 0; }; return 1; }
tb() {  # tb LIMIT_S GPUS ARGS... : one bench/train_bench.py run on the first GPUS cards
  local lim=$1 n=$2; shift 2
  late $((DEADLINE_S - lim / 2)) "$*" && return
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout "$lim" python3 -m torch.distributed.run --standalone \
    --nproc_per_node="$n" bench/train_bench.py --jsonl "$OUT/results.jsonl" "$@" > "$OUT/last.log" 2>&1
  local rc=$?
  grep -h "^BENCH" "$OUT/last.log" | tee -a "$S" || { echo "FAILED rc=$rc: $*" | tee -a "$S"; grep -E "Error|error:" "$OUT/last.log" | tail -3 | tee -a "$S"; }
}
one() {  # one GPU LIMIT_S TAG ENV... -- ARGS : a 1-GPU run in the background on card GPU
  local gpu=$1 lim=$2 tag=$3; shift 3
  local envs=(); while [ "$1" != "--" ]; do envs+=("$1"); shift; done; shift
  {
    env "${envs[@]}" CUDA_VISIBLE_DEVICES="$gpu" TORCHINDUCTOR_CACHE_DIR="/tmp/inductor-$gpu" timeout "$lim" \
      python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
      bench/train_bench.py "$@" > "$OUT/one-$gpu.log" 2>&1
    local rc=$?
    grep -h "^BENCH" "$OUT/one-$gpu.log" | sed "s/^BENCH /BENCH [$tag] /" >> "$S"
    grep -q "^BENCH" "$OUT/one-$gpu.log" || echo "FAILED [$tag] rc=$rc" >> "$S"
  } &
}
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c | tee -a "$S"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$S"

case "$PART" in
train)
  G=524288  # the issue's global batch: 512K tokens per optimizer step
  # 1-GPU baselines (scaling) and compiler knobs, one card each, side by side
  one 0 240 124m-1gpu -- --mode meshrun --size gpt-124m --micro 128 --compile
  one 1 240 124m-1gpu-coord TORCHINDUCTOR_COORDINATE_DESCENT_TUNING=1 -- --mode meshrun --size gpt-124m --micro 128 --compile
  one 2 240 124m-1gpu-autotune TORCHINDUCTOR_MAX_AUTOTUNE=1 -- --mode meshrun --size gpt-124m --micro 128 --compile
  one 3 240 1.3b-1gpu -- --mode meshrun --size gpt-1.3b --micro 32 --compile --warmup 6 --steps 12
  wait
  # 4 GPUs, one after another: meshrun's auto choices first, then the hand-tuned peers
  tb 150 4 --mode meshrun --size gpt-124m --micro 0 --global-tokens $G --compile
  tb 170 4 --mode meshrun --size gpt-1.3b --micro 0 --global-tokens $G --compile --warmup 3 --steps 8
  tb 120 4 --mode ddp_compile --size gpt-124m --micro 64
  tb 150 4 --mode fsdp2 --size gpt-1.3b --micro 16 --compile
  tb 100 4 --mode meshrun --size gpt-124m --micro 0 --global-tokens $G --compile --bucket-mb 1000
  ;;
systems)
  echo "== issue 7: meshrun bench vs direct" | tee -a "$S"
  timeout 120 python3 -m torch.distributed.run --standalone --nproc_per_node=4 bench/bench_vs_direct.py \
    --size 1GiB --matmul-n 8192 2>&1 | grep -E "^RESULT|Error" | tee -a "$S"
  echo "== issue 4: snapshots, GPT 1.3B, 4 ranks" | tee -a "$S"
  timeout 200 python3 -m torch.distributed.run --standalone --nproc_per_node=4 bench/checkpoint_bench.py \
    --size gpt-1.3b --micro 8 --steps 150 --save-every 50 --dir /tmp/ckb 2>&1 | grep -E "^CKPT|Error" | tee -a "$S"
  echo "== issue 5: planner grid, 4 GPUs then 1 (eager)" | tee -a "$S"
  rem=$((DEADLINE_S - (SECONDS - T0) - 90))
  [ $rem -gt 30 ] && timeout $((rem + 60)) python3 -m torch.distributed.run --standalone --nproc_per_node=4 \
    bench/plan_accuracy.py measure --grid gpu --eager --budget-s $rem --out "$OUT/plan4.jsonl" 2>&1 | grep -E "MEM budget|Error" | tee -a "$S"
  rem=$((DEADLINE_S - (SECONDS - T0) - 20))
  [ $rem -gt 20 ] && CUDA_VISIBLE_DEVICES=0 timeout $((rem + 30)) python3 -m torch.distributed.run --standalone \
    --nproc_per_node=1 bench/plan_accuracy.py measure --grid gpu --eager --budget-s $rem --out "$OUT/plan1.jsonl" 2>&1 | grep -E "MEM budget|Error" | tee -a "$S"
  ;;
layouts)
  B="--mode meshrun --size gpt-1.3b --micro 16 --warmup 4 --steps 10"
  tb 100 4 $B --compile --strategy fsdp
  tb 100 4 $B --compile --strategy fsdp --tp 4
  tb 100 4 $B --compile --strategy fsdp --tp 2
  tb 100 4 $B --strategy fsdp --pp 4 --pp-schedule 1f1b
  tb 90 4 $B --strategy deepspeed --zero 2
  tb 90 4 $B --strategy deepspeed --zero 3
  tb 100 4 --mode meshrun --size gpt-1.3b --micro 4 --seq 8192 --warmup 4 --steps 10 --compile --strategy fsdp --cp 4
  tb 70 4 --mode meshrun --size gpt-350m --micro 16 --warmup 4 --steps 10 --experts 8 --ep 4
  tb 70 4 --mode meshrun --size gpt-350m --micro 16 --warmup 4 --steps 10 --experts 8 --strategy ddp
  ;;
seqlen)
  # doubling until a length fails (out of memory, or over its time limit); 1 warm-up + 1 timed step
  for mode in "--strategy fsdp" "--strategy fsdp --cp 4"; do
    for T in 16384 32768 65536 131072 262144 524288; do
      before=$(grep -c "^BENCH" "$S" 2>/dev/null || echo 0)
      tb 150 4 --mode meshrun --size gpt-1.3b --micro 1 --seq $T --warmup 1 --steps 1 --ac $mode
      [ "$(grep -c "^BENCH" "$S")" -gt "$before" ] || { grep -m1 -o "OutOfMemoryError[^.]*" "$OUT/last.log" | tee -a "$S"; break; }
    done
  done
  ;;
*) echo "unknown part $PART (train | systems | layouts | seqlen)"; exit 2 ;;
esac
echo "part $PART done in $((SECONDS - T0)) s" | tee -a "$S"
