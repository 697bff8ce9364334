#!/usr/bin/env bash
# The diagnosis commands on a GPU machine, for the README's real output (run from the repository root):
#
#   bash bench/doctor_gpu.sh        doctor (table and --json), plan (1B and 3B over GPU choices), compare-precision
#                                   (fp32, TF32, bf16, fp16 with its loss scaler; 20 steps, capped at 240 s), doctor
#                                   --nccl, and the GPU tests of tests/test_doctor.py, test_nccl.py and test_plan.py
#
# On Llama-3.2-1B with random weights (written to /tmp) and the shared messages data. Under 540 s on one H200: each
# stage gets min(its cap, what is left of a 530 s budget), so a slow stage cuts the next ones short, never the whole.
# Needs .carry/: messages/ (the shared messages data) and llama3/ (its tokenizer), as bench/compare_gpu.sh.
# Writes into $OUT: doctor.txt, doctor.json, plan.txt, precision.txt (+ precision.html, precision.json),
# nccl.txt, gpu-tests.log, and timings.txt (seconds per stage).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gapless-doctor-out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-530}
CKPT=/tmp/doctor-llama-3.2-1b
: > "$OUT/timings.txt"

stage() {  # stage NAME CAP_S COMMAND...: the command under timeout min(CAP_S, budget left), its seconds recorded
  local name=$1 cap=$2; shift 2
  local left=$((BUDGET - SECONDS)) start=$SECONDS
  ((left < cap)) && cap=$left
  if ((cap < 5)); then echo "$name: skipped, the ${BUDGET} s budget is spent" | tee -a "$OUT/timings.txt"; return; fi
  timeout "$cap" "$@"
  local rc=$?
  echo "$name: $((SECONDS - start)) s (cap $cap s, exit $rc)" >> "$OUT/timings.txt"
}

stage checkpoint 90 "$PY" - <<EOF
import sys, torch
from pathlib import Path
sys.path.insert(0, "bench")
from pipeline import write_random_checkpoint
write_random_checkpoint(Path("bench/models/llama-3.2-1b"), Path(".carry/llama3"), Path("$CKPT"), torch.device("cuda"))
EOF
DATA=("data.sources.0.path=.carry/messages" "data.tokenizer=.carry/llama3" "data.cache_dir=/tmp/doctor-cache")
CFG=(examples/llama-3.2-1b-lora.yaml "model.path=$CKPT" "${DATA[@]}" "output_dir=/tmp/doctor-run")
stage doctor 150 bash -c '"$0" -m gapless.cli doctor "$@" 2>&1 | tee "'"$OUT"'/doctor.txt"' "$PY" "${CFG[@]}"
stage doctor-json 60 bash -c '"$0" -m gapless.cli doctor "$@" --json > "'"$OUT"'/doctor.json" 2>/dev/null' \
  "$PY" "${CFG[@]}"
stage plan-1b 90 bash -c '"$0" -m gapless.cli plan "$@" --gpus GB10,RTX5090,A100,H100,H200,H200x8,B200x8 2>&1 \
  | tee "'"$OUT"'/plan.txt"' "$PY" "${CFG[@]}"
stage plan-3b 60 bash -c '"$0" -m gapless.cli plan "$@" --gpus RTX4090,H200,H200x2,H200x8 2>&1 \
  | tee -a "'"$OUT"'/plan.txt"' "$PY" examples/llama-3.2-3b-lora.yaml model.path=bench/models/llama-3.2-3b \
  "${DATA[@]}" output_dir=/tmp/doctor-run-3b
# eager (compile off: four compiles would not fit the cap) at 4,096 tokens a step; the runs' folders stay in /tmp
# (each holds a 1B LoRA adapter), the page and its numbers come back
stage precision 240 bash -c '"$0" -m gapless.cli compare-precision "$@" model.compile=false \
  data.tokens_per_batch=4096 --steps 20 --out /tmp/doctor-precision 2>&1 | tee "'"$OUT"'/precision.txt"' \
  "$PY" "${CFG[@]}"
cp /tmp/doctor-precision/precision.html /tmp/doctor-precision/precision.json "$OUT"/ 2>/dev/null
stage nccl 60 bash -c '"$0" -m gapless.cli doctor --nccl 2>&1 | tee "'"$OUT"'/nccl.txt"' "$PY"
stage gpu-tests 120 bash -c '"$0" -m pytest -q -m gpu tests/test_doctor.py tests/test_nccl.py tests/test_plan.py 2>&1 \
  | tee "'"$OUT"'/gpu-tests.log"' "$PY"
echo "total: $SECONDS s" >> "$OUT/timings.txt"
cat "$OUT/timings.txt"
