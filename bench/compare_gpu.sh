#!/usr/bin/env bash
# The same measurements on two trees in one GPU call: a change that must not cost speed (issue shape: within 1%).
#
#   bash bench/compare_gpu.sh BEFORE_DIR [bench|pipeline|both]
#
# BEFORE_DIR holds the previous commit (`git archive REV | tar -x -C .carry/before`), this tree the change.
#   bench     `gapless bench --config best` on Llama-3.2-3B (shared-mix lengths, 16,384 tokens a step), before then
#             after then before again, all rows in this tree's bench/results.jsonl under one run id
#   pipeline  bench/pipeline.py on Llama-3.2-3B: random weights written to a folder, the shared messages data through
#             the whole data path, train() as `gapless train` runs the example config (varlen, compiled, r16,
#             checkpoint every 500, eval every 1000), before and after
# Needs .carry/: lengths_shared_mix.txt, and for pipeline messages/ and llama3/ (the tokenizer).
set -uo pipefail
cd "$(dirname "$0")/.."
BEFORE=$1; MODE=${2:-both}
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gapless-compare-out}; mkdir -p "$OUT"
RUN_ID=${RUN_ID:-$(date -u +%Y%m%dT%H%M%SZ)-compare}
export PYTHONUNBUFFERED=1
HERE=$PWD
bench() {  # bench TREE LABEL: one gapless bench process of that tree, its rows into this tree's results
  (cd "$1" && PYTHONPATH="$1/src" "$PY" -m gapless.cli bench --model "$HERE/bench/models/llama-3.2-3b" \
     --lengths "$HERE/.carry/lengths_shared_mix.txt" --config best --steps 10 --warmup 3 --profile-steps 0 \
     --run-id "$RUN_ID-$2" --out "$HERE/bench/results.jsonl" 2>&1) | tee -a "$OUT/compare.log"
}
pipeline() {  # pipeline TREE LABEL STEPS
  (cd "$1" && PYTHONPATH="$1/src" "$PY" bench/pipeline.py --arch "$HERE/bench/models/llama-3.2-3b" \
     --tokenizer "$HERE/.carry/llama3" --data "$HERE/.carry/messages" --steps "$3" --pure-steps 40 \
     --work "/tmp/pipeline-$2" --run-id "$RUN_ID-$2" --out "$HERE/bench/results.jsonl" 2>&1) | tee -a "$OUT/compare.log"
}
if [[ $MODE == bench || $MODE == both ]]; then
  bench "$(realpath "$BEFORE")" before; bench "$HERE" after; bench "$(realpath "$BEFORE")" before2
fi
if [[ $MODE == pipeline || $MODE == both ]]; then
  pipeline "$(realpath "$BEFORE")" pipe-before "${STEPS:-166}"; pipeline "$HERE" pipe-after "${STEPS:-166}"
fi
cp bench/results.jsonl "$OUT"/
grep -h '"run_id": "'"$RUN_ID" bench/results.jsonl | "$PY" -c '
import json, sys
for line in sys.stdin:
    r = json.loads(line)
    print(r["run_id"], r["config"], r["real_tok_s"], r.get("peak_gib"), r.get("step_ms"), r.get("error"))'
