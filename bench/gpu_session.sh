#!/usr/bin/env bash
# meshrun's GPU benchmarks as named suites, one suite per call, on the GPUs of one host (NG: the
# number found; every suite scales its runs to it). bench/README.md describes each suite and what
# it prints; docs/benchmarks.md holds the results.
#
#   bash bench/gpu_session.sh SUITE [OUT]
#
#   throughput  meshrun's defaults on 1 and NG GPUs (GPT 124M and 1.3B, global batch NG x 128K
#               tokens) and the peers in the same call: hand-tuned DDP + compile, hand-tuned FSDP2,
#               Accelerate, Lightning Fabric; then a summary with scaling and ratios
#   memory      the planner's grid: measured peaks, one configuration per process, then
#               `plan_accuracy.py report` (predicted against measured)
#   snapshots   GPT 1.3B with AdamW under FSDP2: asynchronous snapshots every 50 steps, steady state
#   layouts     GPT 1.3B under FSDP2, TP, PP, FSDP2 x TP, ZeRO-2, ZeRO-3, FSDP2 x CP; a 350M MoE
#               under EP and replicated (LONG_SEQ: the longest-sequence steps instead)
#   defaults    `meshrun train` exactly as the README runs it (no batch, sequence or compile flag),
#               GPT 124M and 1.3B on NG GPUs, timed from its log lines (bench/cli_train.py); with
#               PREV_SRC=DIR also another meshrun source tree with hand-set flags, in the same call
#   hf          Hugging Face models through `meshrun train --model DIR`: a Llama-3-8B shape from its
#               config (random init, FSDP2 + full AC at 8192 tokens) on NG GPUs and, with PEERBENCH set,
#               the plain FSDP2 peer on the same shape; then the same shape with random bf16 weights
#               written as save_pretrained does, loaded (the rank-0 reading line); HF_LAYOUTS=1: an
#               8-layer cut of it under CP and PP over 2 GPUs and FSDP2 at 32K tokens beside
#   precision   float8 and document masks: a Llama-3-8B shape (FSDP2 full shard, full AC, seq 8192)
#               and Llama-3.2-1B (seq 8192) in bf16 and --precision fp8; 200 steps of each on real
#               text (bench/corpus.py) from one seed, for the loss curves; fp8 snapshots written,
#               resumed and written again under FSDP2; 1B packed with and without --document-mask.
#               PARTS picks some of: speed8b speed1b parity1b parity8b control8b resume
#               docmask (default all)
#   checks      the GPU correctness scripts: tests/scripts/head_loss_check.py (the head loss's
#               Triton kernel), tests/scripts/fused_mlp_check.py (the GELU epilogues; needs
#               nvmath-python) and tests/scripts/liger_check.py (Liger Kernel on a Llama)
#
# Options (environment):
#   DEADLINE_S=540      a suite starts no run after this many seconds (each run has its own limit too)
#   BASE_ALL_CARDS=1    throughput: the GPT 124M 1-GPU base on every card side by side
#   SMI=1               throughput: sample every card's SM clock and power (bench/smi_summary.py)
#   MEM_ROWS="..."      memory: torch rows of the grid on NG GPUs (indices; default the 12 without AC)
#   MEM_DS_ROWS="..."   memory: DeepSpeed rows on NG GPUs (e.g. "0 4 5 8 12 13 16 20 21"; default none)
#   MEM_ONE_ROWS="..."  memory: rows on one GPU (e.g. "0 1 2 3 4 5 6 7"; default none)
#   MEM_GRID=gpu        memory: the grid (gpu | quick | full: bench/plan_accuracy.py GRIDS)
#   MEM_COMPILE=1       memory: compiled rows (default eager)
#   SNAP_FULL=1         snapshots: also sync save, verified load, torch.save on rank 0 (0.53-s steps)
#   SNAP_FAST=1         snapshots: also the steady state at 0.53-s steps (the disk falls behind)
#   LONG_SEQ="fsdp:262144 cp:524288"  layouts: one step of GPT 1.3B per LAYOUT:TOKENS (fsdp: FSDP2
#                       alone; cp: FSDP2 x CP over NG GPUs), activation checkpointing, chunked loss
#   LONG_SEQ_LIM=540    layouts: the time limit of each such step
#   DEFAULTS_SIZES="gpt-124m gpt-1.3b"  defaults: the models
#   PREV_SRC=DIR        defaults: also run meshrun from DIR (another version's src/) with PREV_ARGS
#   PREV_ARGS="--seq-len 1024 --global-batch 512 --compile"  defaults: that version's flags
#   PEERBENCH=FILE      hf: the plain peer script (peerbench.py: --mode fsdp2 --arch llama3-8b)
#   HF_LAYOUTS=1        hf: the CP / PP / FSDP2 rows of the 8-layer cut instead
#   PARTS="speed8b ..." precision: its parts, in the order given
#   PACK=1              every log and result file of OUT packed into OUT/results.tgz at the end
#
# Wheels in .whl/ (run's carry) are installed first: nvmath-python for the GELU epilogues (throughput,
# checks), DeepSpeed and its pure-Python dependencies for ZeRO (layouts, memory).
# Results: OUT/results.jsonl (train_bench rows), OUT/memory.jsonl (memory rows), OUT/summary.txt
# (every result line), OUT/*.log (each run's output).
set -uo pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1 OMP_NUM_THREADS=8
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
SUITE=${1:-}; OUT=${2:-/tmp/meshrun-gpu}; mkdir -p "$OUT"
DEADLINE_S=${DEADLINE_S:-540}
T0=$SECONDS
S="$OUT/summary.txt"
case "$SUITE" in throughput|memory|snapshots|layouts|defaults|hf|precision|checks) ;;
  *) echo "usage: bash bench/gpu_session.sh throughput|memory|snapshots|layouts|defaults|hf|precision|checks [OUT]" >&2; exit 2 ;;
esac
NG=$(nvidia-smi -L | wc -l)
if [ -d .whl ]; then  # wheels carried for this call: every suite sees them
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH="/tmp/site:$PYTHONPATH"
  if [ -d .whl/extra ] && ! python3 -c "import nvmath.linalg.advanced" 2>/dev/null; then
    echo "nvmath did not import with the image's cuda-core/cuda-pathfinder: the carried ones" | tee -a "$S"
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/extra/*.whl
  fi
fi

late() {  # late SECONDS WHAT : true (and says so) once the suite has run longer than SECONDS
  [ $((SECONDS - T0)) -gt "$1" ] && { echo "SKIPPED (deadline) $2" | tee -a "$S"; return 0; }; return 1
}
tb() {  # tb LIMIT_S GPUS ARGS... : one bench/train_bench.py run on the first GPUS cards
  local lim=$1 n=$2; shift 2
  late $((DEADLINE_S - lim / 2)) "$*" && return
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout "$lim" python3 -m torch.distributed.run --standalone \
    --nproc_per_node="$n" bench/train_bench.py --jsonl "$OUT/results.jsonl" "$@" > "$OUT/last.log" 2>&1
  local rc=$?
  grep -h "^BENCH" "$OUT/last.log" | tee -a "$S" || { echo "FAILED rc=$rc: $*" | tee -a "$S"
    grep -E "Error|error:" "$OUT/last.log" | tail -3 | cut -c1-300 | tee -a "$S"; }
}
one() {  # one GPU LIMIT_S TAG -- ARGS : a 1-GPU train_bench.py run in the background on card GPU
  local gpu=$1 lim=$2 tag=$3; shift 4
  {
    CUDA_VISIBLE_DEVICES="$gpu" TORCHINDUCTOR_CACHE_DIR="/tmp/inductor-$gpu" timeout "$lim" \
      python3 -m torch.distributed.run --standalone --nproc_per_node=1 \
      bench/train_bench.py --jsonl "$OUT/results.jsonl" "$@" > "$OUT/one-$gpu.log" 2>&1
    local rc=$?
    grep -h "^BENCH" "$OUT/one-$gpu.log" | sed "s/^BENCH /BENCH [$tag] /" >> "$S"
    grep -q "^BENCH" "$OUT/one-$gpu.log" || { echo "FAILED [$tag] rc=$rc" >> "$S"
      grep -E "Error|error:" "$OUT/one-$gpu.log" | tail -2 | cut -c1-300 >> "$S"; }
  } &
}
bases() {  # bases : GPT 124M, meshrun's defaults at global 128K, 1 GPU on every card side by side
  for card in $(seq 0 $((NG - 1))); do
    one "$card" 200 "124m-1gpu-card$card" -- --mode meshrun --size gpt-124m --micro 0 --compile --global-tokens 131072
  done
  wait
}
check() {  # check LIMIT_S SCRIPT LOG PATTERN : a tests/scripts check on card 0; its rc and the lines
  # matching PATTERN to the summary; true only if the script printed ALL OK
  local lim=$1 script=$2 log=$3 pat=$4
  CUDA_VISIBLE_DEVICES=0 timeout "$lim" python3 "$script" > "$log" 2>&1
  echo "$(basename "$script") rc=$?" | tee -a "$S"
  grep -E "$pat" "$log" | tail -"${CHECK_LINES:-20}" | cut -c1-420 | tee -a "$S"
  grep -q "^ALL OK" "$log"
}
cl() {  # cl LIMIT_S LABEL [--src DIR] -- TRAIN_ARGS... : one `meshrun train` timed by bench/cli_train.py
  local lim=$1 label=$2; shift 2
  late $((DEADLINE_S - lim / 2)) "$label" && return
  python3 bench/cli_train.py --label "$label" --log "$OUT/$label.log" --jsonl "$OUT/cli.jsonl" --timeout "$lim" "$@" \
    | tee -a "$S"
}
pair() {  # pair LIMIT_S LABEL_A LABEL_B ARGS... -- ARGS_A... -- ARGS_B... : two 1-GPU `meshrun train` runs at
  # once, A on card 0 and B on card 1 (one after the other on a 1-GPU host), ARGS common to both
  local lim=$1 a=$2 b=$3; shift 3
  local common=() one=() two=()
  while [ $# -gt 0 ] && [ "$1" != -- ]; do common+=("$1"); shift; done; shift
  while [ $# -gt 0 ] && [ "$1" != -- ]; do one+=("$1"); shift; done; shift
  two=("$@")
  late $((DEADLINE_S - lim / 2)) "$a / $b" && return
  if [ "$NG" -ge 2 ]; then
    CUDA_VISIBLE_DEVICES=0 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-0 python3 bench/cli_train.py --label "$a" \
      --log "$OUT/$a.log" --jsonl "$OUT/cli.jsonl" --timeout "$lim" -- "${common[@]}" "${one[@]}" > "$OUT/$a.cli" &
    CUDA_VISIBLE_DEVICES=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-1 python3 bench/cli_train.py --label "$b" \
      --log "$OUT/$b.log" --jsonl "$OUT/cli.jsonl" --timeout "$lim" -- "${common[@]}" "${two[@]}" > "$OUT/$b.cli"
    wait
    cat "$OUT/$a.cli" "$OUT/$b.cli" | tee -a "$S"
  else
    CUDA_VISIBLE_DEVICES=0 cl "$lim" "$a" -- "${common[@]}" "${one[@]}"
    CUDA_VISIBLE_DEVICES=0 cl "$lim" "$b" -- "${common[@]}" "${two[@]}"
  fi
}
smi_start() {  # smi_start FILE : every card's clock, power and clock-event reasons once a second
  local q=index,utilization.gpu,clocks.sm,clocks.max.sm,power.draw,power.limit,clocks_event_reasons.active
  nvidia-smi --query-gpu=$q --format=csv -i 0 > /dev/null 2>&1 || q=${q/clocks_event/clocks_throttle}  # drivers < 535
  nvidia-smi --query-gpu=$q --format=csv,noheader,nounits -lms 1000 > "$1" 2>&1 & SMI_PID=$!
}
summarize() {  # summarize : the throughput suite's rows as a table, with scaling and meshrun's ratios
  [ -f "$OUT/results.jsonl" ] || return
  python3 - "$OUT/results.jsonl" "$NG" <<'PY' | tee -a "$S"
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1]) if line.strip()]
ng = int(sys.argv[2])
print(f"{'mode':12s} {'size':9s} {'GPUs':>4s} {'micro x acc':>11s} {'tokens/s/GPU':>12s} {'MFU':>6s} {'peak GiB':>8s}")
for r in rows:
    acc = f"{r['micro']} x {r.get('accumulation', 1)}"
    mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") is not None else "-"
    print(f"{r['mode']:12s} {r['size']:9s} {r['gpus']:4d} {acc:>11s} {r['tokens_per_s_per_gpu']:12,d} {mfu:>6s} "
          f"{r.get('peak_mem_gib') or 0:8.2f}")
def rate(mode, size, gpus):
    xs = [r["tokens_per_s_per_gpu"] for r in rows if r["mode"] == mode and r["size"] == size and r["gpus"] == gpus]
    return statistics.mean(xs) if xs else None
for size, peers in (("gpt-124m", ("ddp_compile", "accelerate", "fabric")), ("gpt-1.3b", ("fsdp2",))):
    one, many = rate("meshrun", size, 1), rate("meshrun", size, ng)
    if one and many and ng > 1:
        print(f"{size}: scaling 1 -> {ng} GPUs {many / one:.1%} (means of the meshrun rows)")
    for peer in peers:
        other = rate(peer, size, ng)
        if many and other:
            print(f"{size}: meshrun {many / other:.2f}x {peer} on {ng} GPUs")
PY
}
mrow() {  # mrow ENGINES NPROC INDEX : one row of the planner's grid, first in its own torchrun; the row is
  # appended to OUT/memory.jsonl and its peaks go to the summary
  local eng=$1 n=$2 i=$3 eager=--eager
  [ "${MEM_COMPILE:-0}" = 1 ] && eager=
  late $((DEADLINE_S - 60)) "memory row $i ($eng, $n GPUs)" && return
  CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((n - 1))) timeout 150 python3 -m torch.distributed.run --standalone \
    --nproc_per_node="$n" bench/plan_accuracy.py measure --grid "${MEM_GRID:-gpu}" --engines "$eng" --select "$i" \
    $eager --out "$OUT/memory.jsonl" > "$OUT/last.log" 2>&1
  local line; line=$(grep -ho '"model".*' "$OUT/last.log" | tail -1)
  [ -n "$line" ] || { echo "memory row $i ($eng, $n GPUs): no row ($(grep -m1 -oE '[A-Za-z]*Error[^,]{0,120}' \
    "$OUT/last.log" || echo 'see last.log'))" | tee -a "$S"; return; }
  echo "$line" | python3 -c "import json, sys
d = json.loads('{' + sys.stdin.read())
print('MEM', d['model'], d['strategy'], 'ac' if d['ac'] else 'no-ac', 'compiled' if d['compile'] else 'eager',
      'micro', d['micro'], 'gpus', d['gpus'], 'reserved', d.get('reserved_gib'), 'allocated', d.get('allocated_gib'),
      'GiB', 'OOM' if d.get('oom') else '')" | tee -a "$S"
}
sl() {  # sl LIMIT_S TOKENS ARGS... : one training step of GPT 1.3B at TOKENS per sequence (full AC) on NG GPUs;
  # a failure's cause (out of memory, or no step within the limit) goes to the summary
  local lim=$1 T=$2; shift 2
  local before; before=$(grep -c "^BENCH" "$S" 2>/dev/null)
  tb "$lim" "$NG" --mode meshrun --size gpt-1.3b --micro 1 --seq "$T" --warmup 0 --steps 1 --ac "$@"
  local after; after=$(grep -c "^BENCH" "$S" 2>/dev/null)
  [ "${after:-0}" -gt "${before:-0}" ] && return 0
  { grep -m1 -o "OutOfMemoryError[^.]*" "$OUT/last.log" || echo "no step within ${lim} s"; } | sed "s/^/seq $T $*: /" | tee -a "$S"
  return 1
}

nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | sort | uniq -c | tee -a "$S"
python3 -c "import torch; print('torch', torch.__version__)" | tee -a "$S"

case "$SUITE" in
throughput)
  # meshrun at global NG x 128K tokens (128K per GPU, 512K on 4), micro-batch and accumulation
  # the planner's (--micro 0); the peers at their tuned micro-batches, the plain model
  G=$((NG * 131072)); N="--mode meshrun --micro 0 --compile"
  S1="--size gpt-124m"; S13="--size gpt-1.3b --warmup 3 --steps 8"
  [ "${SMI:-0}" = 1 ] && smi_start "$OUT/smi.csv"
  # the 1-GPU base (the same 128K tokens per GPU as the NG-GPU runs), side by side
  if [ "${BASE_ALL_CARDS:-0}" = 1 ]; then
    bases
    one 0 200 1.3b-1gpu -- $N $S13 --global-tokens 131072
  else
    one 0 200 124m-1gpu -- $N $S1 --global-tokens 131072
    [ "$NG" -ge 2 ] && one 1 200 1.3b-1gpu -- $N $S13 --global-tokens 131072
  fi
  wait
  tb 150 "$NG" $N $S1 --global-tokens $G
  tb 170 "$NG" $N $S13 --global-tokens $G
  tb 120 "$NG" --mode ddp_compile $S1 --micro 64
  tb 150 "$NG" --mode fsdp2 --size gpt-1.3b --micro 16 --compile --warmup 4 --steps 10
  tb 90 "$NG" --mode accelerate $S1 --micro 16
  tb 90 "$NG" --mode fabric $S1 --micro 16
  if [ -n "${SMI_PID:-}" ]; then kill "$SMI_PID"; python3 bench/smi_summary.py "$OUT/smi.csv" | tee -a "$S"; fi
  summarize
  ;;
memory)
  # Each row first in its own process, as a job starts (a row measured after another in the same
  # process reserves more for the same allocations). Grid "gpu", on NG > 1 GPUs: torch rows 0-7 DDP,
  # 8-15 FSDP2 grad_op, 16-23 FSDP2 full; DeepSpeed rows 0-7 ZeRO-1, 8-15 ZeRO-2, 16-23 ZeRO-3; within
  # each: GPT 124M micro 8, 32 without AC, the same with AC, then GPT 1.3B micro 4, 16 likewise.
  # On 1 GPU: rows 0-7 single.
  echo "== memory: grid ${MEM_GRID:-gpu}, one configuration per process" | tee -a "$S"
  for i in ${MEM_ROWS-0 1 4 5 8 9 12 13 16 17 20 21}; do mrow torch "$NG" "$i"; done
  if [ -n "${MEM_DS_ROWS:-}" ]; then
    if python3 -c "import deepspeed" 2>/dev/null; then
      for i in $MEM_DS_ROWS; do mrow deepspeed "$NG" "$i"; done
    else
      echo "memory: no DeepSpeed here: carry its wheels in .whl/ for MEM_DS_ROWS" | tee -a "$S"
    fi
  fi
  for i in ${MEM_ONE_ROWS:-}; do mrow torch 1 "$i"; done
  [ -f "$OUT/memory.jsonl" ] && python3 bench/plan_accuracy.py report "$OUT/memory.jsonl" 2>&1 | tee -a "$S"
  ;;
snapshots)
  CK="python3 -m torch.distributed.run --standalone --nproc_per_node=$NG bench/checkpoint_bench.py --size gpt-1.3b --strategy fsdp --dir /tmp/ckb"
  if [ "${SNAP_FULL:-0}" = 1 ]; then
    echo "== snapshots: sync save, verified load, torch.save on rank 0; async every 50 steps at micro-batch 32" | tee -a "$S"
    timeout 240 $CK --micro 32 --steps 100 --save-every 50 2>&1 | grep -E "^CKPT|Error" | tee -a "$S"
  fi
  if [ "${SNAP_FAST:-0}" = 1 ]; then
    echo "== snapshots: steady state at micro-batch 32, no accumulation (0.53-s steps on 4 x H200)" | tee -a "$S"
    timeout 240 $CK --phases async --prestage --micro 32 --steps 100 --save-every 50 2>&1 | grep -E "^CKPT|Error" | tee -a "$S"
  fi
  # the throughput benchmark's GPT 1.3B batch: 32 x 4 per rank (~2-s steps), global 128 x NG sequences
  echo "== snapshots: steady state, global batch $((128 * NG)) (32 x 4 per rank, $NG ranks), async every 50 steps" | tee -a "$S"
  late $((DEADLINE_S - 260)) "snapshots at the benchmark's batch" || timeout 520 $CK --phases async --prestage --micro 32 \
    --global-batch $((128 * NG)) --steps 100 --save-every 50 2>&1 | grep -E "^CKPT|Error" | tee -a "$S"
  ;;
layouts)
  if [ -n "${LONG_SEQ:-}" ]; then
    # the longest sequence: one step per LAYOUT:TOKENS, the chunked loss (no token's logits held whole)
    for spec in $LONG_SEQ; do
      T=${spec#*:}
      case "${spec%%:*}" in
        fsdp) sl "${LONG_SEQ_LIM:-540}" "$T" --strategy fsdp --loss fused ;;
        cp) sl "${LONG_SEQ_LIM:-540}" "$T" --strategy fsdp --cp "$NG" --loss fused ;;
        *) echo "LONG_SEQ: $spec: expected fsdp:TOKENS or cp:TOKENS" | tee -a "$S" ;;
      esac
    done
  else
    # the model-parallel degrees are NG (the benchmark's table: 4)
    B="--mode meshrun --size gpt-1.3b --micro 16 --warmup 4 --steps 10"
    tb 100 "$NG" $B --compile --strategy fsdp
    tb 100 "$NG" $B --compile --strategy fsdp --tp "$NG"
    [ "$NG" -ge 4 ] && tb 100 "$NG" $B --compile --strategy fsdp --tp 2
    tb 100 "$NG" $B --strategy fsdp --pp "$NG" --pp-schedule 1f1b
    tb 90 "$NG" $B --strategy zero2
    tb 90 "$NG" $B --strategy zero3
    tb 100 "$NG" --mode meshrun --size gpt-1.3b --micro 4 --seq 8192 --warmup 4 --steps 10 --compile --strategy fsdp --cp "$NG"
    tb 70 "$NG" --mode meshrun --size gpt-350m --micro 16 --warmup 4 --steps 10 --experts 8 --ep "$NG"
    tb 70 "$NG" --mode meshrun --size gpt-350m --micro 16 --warmup 4 --steps 10 --experts 8 --strategy ddp
  fi
  ;;
defaults)
  for size in ${DEFAULTS_SIZES:-gpt-124m gpt-1.3b}; do
    case $size in gpt-1.3b) st="--steps 30 --log-every 5" ;; *) st="--steps 60 --log-every 10" ;; esac
    cl 420 "defaults-$size" -- --model-size "$size" --data random $st
    if [ -n "${PREV_SRC:-}" ]; then
      cl 420 "prev-$size" --src "$PREV_SRC" -- --model-size "$size" --data random \
        ${PREV_ARGS:---seq-len 1024 --global-batch 512 --compile} $st
    fi
  done
  ;;
hf)
  if [ -n "${HF_LAYOUTS:-}" ]; then
    python3 bench/hf_config.py llama3-8b /tmp/meshrun-l8x8 --layers 8 --seq 32768 | tee -a "$S"
    long="--activation-checkpointing full --seq-len 32768 --micro-batch 1 --steps 8 --log-every 4"
    CUDA_VISIBLE_DEVICES=0,1 cl 150 hf-cp2 -- --model /tmp/meshrun-l8x8 --data random --strategy fsdp-full --cp 2 \
      --global-batch 1 $long
    CUDA_VISIBLE_DEVICES=0,1 cl 150 hf-fsdp-32k -- --model /tmp/meshrun-l8x8 --data random --strategy fsdp-full \
      --global-batch 2 $long
    CUDA_VISIBLE_DEVICES=0,1 cl 150 hf-pp2 -- --model /tmp/meshrun-l8x8 --data random --strategy fsdp-full --pp 2 \
      --seq-len 4096 --micro-batch 4 --global-batch 4 --steps 8 --log-every 4
  else
    python3 bench/hf_config.py llama3-8b /tmp/meshrun-l8 | tee -a "$S"
    eightk="--strategy fsdp-full --activation-checkpointing full --seq-len 8192 --micro-batch 2 --global-batch $((2 * NG))"
    cl 300 hf-8b -- --model /tmp/meshrun-l8 --data random $eightk --steps 15 --log-every 3
    if [ -n "${PEERBENCH:-}" ]; then
      timeout 200 torchrun --standalone --nproc_per_node="$NG" "$PEERBENCH" --mode fsdp2 --arch llama3-8b --seq 8192 \
        --batch 2 --ac --steps 10 --warmup 5 > "$OUT/peer-8b.log" 2>&1
      grep -E "^\{" "$OUT/peer-8b.log" | tail -1 | tee -a "$S"
    fi
    late 300 "hf-8b-pretrained" || {
      python3 bench/hf_config.py llama3-8b /tmp/meshrun-l8w --weights | tee -a "$S"
      cl 300 hf-8b-pretrained -- --model /tmp/meshrun-l8w --data random $eightk --steps 9 --log-every 3
      grep -E "rank 0 read" "$OUT/hf-8b-pretrained.log" | tee -a "$S"
    }
  fi
  ;;
precision)
  python3 bench/hf_config.py llama3-8b /tmp/meshrun-l8 | tee -a "$S"
  python3 bench/hf_config.py llama3.2-1b /tmp/meshrun-l1b --seq 8192 | tee -a "$S"
  case " ${PARTS:-parity1b docmask} " in *" parity"*|*" control8b "*|*" docmask "*)
    python3 bench/corpus.py /tmp/meshrun-corpus --workers 8 | tee -a "$S" ;; esac
  eightk="--strategy fsdp-full --activation-checkpointing full --seq-len 8192 --micro-batch 2 --global-batch $((2 * NG))"
  text="--data /tmp/meshrun-corpus/data --seed 0 --seq-len 2048 --steps 200 --log-every 5 --eval-every 50"
  for part in ${PARTS:-speed8b speed1b parity1b parity8b control8b resume docmask}; do
    case $part in
    speed8b)
      cl 240 bf16-8b -- --model /tmp/meshrun-l8 --data random $eightk --steps 10 --log-every 2
      cl 300 fp8-8b -- --model /tmp/meshrun-l8 --data random $eightk --steps 10 --log-every 2 --precision fp8 ;;
    speed1b)
      pair 200 bf16-1b fp8-1b --model /tmp/meshrun-l1b --data random --nproc 1 --seq-len 8192 --micro-batch 2 \
        --global-batch 8 --steps 12 --log-every 1 -- -- --precision fp8 ;;
    parity1b)
      pair 300 parity-bf16-1b parity-fp8-1b --model /tmp/meshrun-l1b $text --nproc 1 --micro-batch 6 --global-batch 6 -- \
        -- --precision fp8 ;;
    parity8b)
      cl 300 parity-bf16-8b -- --model /tmp/meshrun-l8 $text --strategy fsdp-full --micro-batch 2 --global-batch $((2 * NG))
      cl 300 parity-fp8-8b -- --model /tmp/meshrun-l8 $text --strategy fsdp-full --micro-batch 2 --global-batch $((2 * NG)) \
        --precision fp8 ;;
    control8b)  # the bf16 curve once more, compiled (other kernels, the same precision): the spread of 8B curves
      cl 300 parity-bf16-compiled-8b -- --model /tmp/meshrun-l8 $text --strategy fsdp-full --micro-batch 2 \
        --global-batch $((2 * NG)) --compile on ;;
    resume)
      # float8 weights all-gathered by FSDP2: written, resumed from, written again
      python3 bench/hf_config.py llama3.2-1b /tmp/meshrun-l1b4 --layers 4 | tee -a "$S"
      rm -rf /tmp/meshrun-fp8-out
      small="--model /tmp/meshrun-l1b4 --data random --strategy fsdp-full --seq-len 2048 --micro-batch 2 --precision fp8"
      cl 200 fp8-resume-a -- $small --global-batch $((2 * NG)) --out /tmp/meshrun-fp8-out --steps 6 --save-every 3 --log-every 1
      cl 200 fp8-resume-b -- $small --global-batch $((2 * NG)) --out /tmp/meshrun-fp8-out --steps 12 --save-every 3 --log-every 1
      grep -hE "resum|snapshot|error" "$OUT/fp8-resume-a.log" "$OUT/fp8-resume-b.log" | cut -c1-300 | tee -a "$S"
      ls /tmp/meshrun-fp8-out/checkpoints | tee -a "$S"
      rm -rf /tmp/meshrun-fp8-out ;;
    docmask)
      pair 200 docmask-1b nomask-1b --model /tmp/meshrun-l1b --data /tmp/meshrun-corpus/data --seq-len 8192 --steps 12 \
        --log-every 1 --nproc 1 --micro-batch 2 --global-batch 8 -- --document-mask --eval-batches 8 -- ;;
    *) echo "precision: unknown part $part (speed8b speed1b parity1b parity8b control8b resume docmask)" | tee -a "$S" ;;
    esac
  done
  ;;
checks)
  ok=0
  check 200 tests/scripts/head_loss_check.py "$OUT/head_loss_check.log" "^ok|Error|^ALL OK" || ok=1
  check 240 tests/scripts/fused_mlp_check.py "$OUT/fused_mlp_check.log" \
    "relative error|bitwise|ms, peak|against Inductor|256 tokens|Error|fused_mlp_check|^ALL OK" || ok=1
  check 120 tests/scripts/liger_check.py "$OUT/liger_check.log" "applied|loss plain|Error|liger_check|^ALL OK" || ok=1
  [ "$ok" = 0 ] && echo "checks: ALL OK" | tee -a "$S" || echo "checks: FAILED (logs in $OUT)" | tee -a "$S"
  ;;
esac
echo "suite $SUITE done in $((SECONDS - T0)) s" | tee -a "$S"
[ "${PACK:-0}" = 1 ] && (cd "$OUT" && tar czf results.tgz --remove-files -- *.log *.cli *.jsonl 2>/dev/null)  # hosts that return few files
