#!/usr/bin/env bash
# Multi-GPU throughput (issues 15 and 16), every row in bench/results.jsonl under one run id:
#
#   bash bench/dist_gpu.sh [LENGTHS_FILE]          (default .carry/lengths_shared_mix.txt)
#
# On every machine, 1 GPU first: LoRA without any process group (no wrapping), then the same under torchrun at world
# size 1 with NCCL for DDP and FSDP2: the wrapping's overhead, in tok/s. Then, for each of 2, 4 and 8 that the machine
# has GPUs for, LoRA under DDP and (when the config accepts method: full) full fine-tuning under FSDP2, each with
# --tokens-per-gpu 16,384: rows carry `gpus` and `scaling_efficiency` (tok/s per GPU over the 1-GPU row of the same
# strategy in this run id). Llama-3.2-3B's architecture with random weights, varlen attention, compiled layers, bf16.
set -uo pipefail
cd "$(dirname "$0")/.."
LENGTHS=${1:-.carry/lengths_shared_mix.txt}
PY=${PYTHON:-python3}
ARCH=${ARCH:-bench/models/llama-3.2-3b}
STEPS=${STEPS:-20}
RUN_ID=${RUN_ID:-$(date -u +%Y%m%dT%H%M%SZ)-dist}
OUT=${OUT:-/tmp/gapless-dist-out}; mkdir -p "$OUT"
GPUS=$(nvidia-smi -L | wc -l)
export PYTHONPATH=$PWD/src PYTHONUNBUFFERED=1
COMMON=(--arch "$ARCH" --lengths "$LENGTHS" --steps "$STEPS" --warmup 3 --run-id "$RUN_ID" --out bench/results.jsonl)
run() {  # run NPROC ARGS...: NPROC 0 = one plain process, no torchrun
  local n=$1; shift
  if [[ $n == 0 ]]; then "$PY" bench/dist_gpu.py "${COMMON[@]}" "$@"
  else "$PY" -m torch.distributed.run --standalone --nproc-per-node "$n" bench/dist_gpu.py "${COMMON[@]}" "$@"; fi \
    2>&1 | tee -a "$OUT/dist.log" | grep -E '^\{|Error|error' | cut -c1-400
}
FULL=0  # full fine-tuning runs once the config knows method: full (issue methods)
"$PY" -c "from gapless.config import load_config; load_config(data={'model': {'path': '$ARCH'}, 'data': {'sources': [{'path': 'x'}]}, 'method': 'full'})" 2>/dev/null && FULL=1
run 0 --strategy none --method lora
run 1 --strategy ddp --method lora
run 1 --strategy fsdp --method lora
[[ $FULL == 1 ]] && run 1 --strategy fsdp --method full --activation-checkpointing 1
for n in 2 4 8; do
  (( n <= GPUS )) || continue
  run "$n" --strategy ddp --method lora
  [[ $FULL == 1 ]] && run "$n" --strategy fsdp --method full --activation-checkpointing 1
done
# the gloo tests of this issue, and the NCCL path of a real `gapless train` at every world size this machine has
"$PY" -m pytest -q tests/test_dist.py 2>&1 | tail -3 | tee -a "$OUT/dist.log"
cp bench/results.jsonl "$OUT"/
grep -h '"run_id": "'"$RUN_ID"'"' bench/results.jsonl | "$PY" -c '
import json, sys
print("config             gpus  tok/s/gpu  scaling  imbalance  step_ms  peak_gib  comm_serial_ms")
for line in sys.stdin:
    r = json.loads(line)
    print(f"{r[\"config\"]:18} {r[\"gpus\"]:4} {r[\"real_tok_s_per_gpu\"]:10,.0f} {r[\"scaling_efficiency\"] or 0:8.3f} "
          f"{r[\"rank_imbalance\"]:9.3f} {r[\"step_ms\"]:8.1f} {r[\"peak_gib\"]:9.2f} {r[\"comm_serial_ms\"]:14.2f}")'
