#!/usr/bin/env bash
# The diagnosis commands on a GPU machine, for the README's real output (run from the repository root):
#
#   bash bench/doctor_gpu.sh        doctor, plan and compare-precision on Llama-3.2-1B (random weights written to
#                                   /tmp, the shared messages data), doctor --nccl, and the GPU tests of
#                                   tests/test_doctor.py and tests/test_nccl.py; on 2+ GPUs --nccl measures the link
#
# Needs .carry/: messages/ (the shared messages data) and llama3/ (its tokenizer), as bench/compare_gpu.sh.
# Everything it prints goes to $OUT (doctor.txt, doctor.json, plan.txt, precision/, nccl.txt, gpu-tests.log).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gapless-doctor-out}; mkdir -p "$OUT"
CKPT=/tmp/doctor-llama-3.2-1b
"$PY" - <<EOF
import sys, torch
from pathlib import Path
sys.path.insert(0, "bench")
from pipeline import write_random_checkpoint
write_random_checkpoint(Path("bench/models/llama-3.2-1b"), Path(".carry/llama3"), Path("$CKPT"), torch.device("cuda"))
EOF
CFG=(examples/llama-3.2-1b-lora.yaml "model.path=$CKPT" "data.sources.0.path=.carry/messages"
     "data.cache_dir=/tmp/doctor-cache" "output_dir=/tmp/doctor-run")
"$PY" -m gapless.cli doctor "${CFG[@]}" 2>&1 | tee "$OUT/doctor.txt"
"$PY" -m gapless.cli doctor "${CFG[@]}" --json > "$OUT/doctor.json" 2>/dev/null
"$PY" -m gapless.cli plan "${CFG[@]}" --gpus GB10,RTX5090,A100,H100,H200,H200x8,B200x8 2>&1 | tee "$OUT/plan.txt"
"$PY" -m gapless.cli plan examples/llama-3.2-3b-lora.yaml "${CFG[@]:1}" model.path=bench/models/llama-3.2-3b \
  data.tokenizer=.carry/llama3 --gpus H200,H200x2,H200x8 2>&1 | tee -a "$OUT/plan.txt"
timeout 330 "$PY" -m gapless.cli compare-precision "${CFG[@]}" --steps 20 --out "$OUT/precision" 2>&1 \
  | tee "$OUT/precision.txt"
timeout 60 "$PY" -m gapless.cli doctor --nccl 2>&1 | tee "$OUT/nccl.txt"
timeout 120 "$PY" -m pytest -q -m gpu tests/test_doctor.py tests/test_nccl.py 2>&1 | tee "$OUT/gpu-tests.log"
