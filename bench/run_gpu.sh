#!/usr/bin/env bash
# gapless bench on one H200, in one call of at most 9 minutes (run it from the repository root):
#
#   bash bench/run_gpu.sh          the ladder on Llama-3.2-3B, best on Llama-3.2-1B and Llama-3.1-8B, HF+PEFT packed
#                                  beside them, and the flex rung last if time is left (its first compile: ~200 s)
#   bash bench/run_gpu.sh flex     packed_fused and packed_fused_flex on Llama-3.2-3B (a second call)
#   bash bench/run_gpu.sh methods  QLoRA, full and LoRA-with-dropout on Llama-3.2-3B, HF+PEFT+bitsandbytes QLoRA beside
#                                  (carry the bitsandbytes wheel in .whl/bnb/)
#   bash bench/run_gpu.sh methods2 Llama-3.1-8B QLoRA at 8,192 tokens, Gemma-3-4B LoRA, HF+PEFT+Liger packed
#   bash bench/run_gpu.sh methods3 QLoRA beside LoRA on Llama-3.2-3B, Llama-3.1-8B QLoRA with checkpointing at 8,192
#                                  tokens (the 24 GiB card), HF+PEFT+bitsandbytes QLoRA, the methods' GPU tests, and
#                                  Llama-3.2-1B LoRA/QLoRA/full for the memory model's check (bench/memory_check.py)
#   bash bench/run_gpu.sh methods4 QLoRA beside LoRA on Llama-3.2-3B, 8B QLoRA with checkpointing at 8,192 tokens, what
#                                  each recipe saves for backward per 8B layer, every GPU test
#   bash bench/run_gpu.sh gemma    Gemma-3-4B and Llama-3.2-3B default at the same tokens per step (GEMMA_TOKENS,
#                                  8,192), each beside HF+PEFT (+Liger) built from the same config.json
#                                  (bench/peers --model-config); the Gemma GPU tests if time is left. Needs the H200
#                                  (HF+PEFT without Liger on Gemma-3-4B: ~110 GiB at 8,192 tokens)
#   bash bench/run_gpu.sh startup  the example 3B config's start-up, cold and warm (bench/startup_gpu.py: random weights
#                                  written first; carry ../shared/data/messages as .carry/messages and
#                                  ../shared/tokenizers/llama3 as .carry/tokenizers/llama3), then the load time by
#                                  reading threads (bench/load_time.py) and the loading GPU test; STARTUP_CPROFILE=1: one more warm
#                                  run under cProfile, its stats in $OUT/warm.prof
#   bash bench/run_gpu.sh startup_ab  flash-attn-4's warm-up process (gapless.train.warm_attention) on and off, one
#                                  machine: the imports' bytecode primed first (so neither start compiles torch from
#                                  source), cold_pyc and warm with it (RUN_ID), then cold_pyc with
#                                  GAPLESS_WARM_ATTENTION=0 (RUN_ID-nowarm: second, so any bytecode the first left
#                                  favours it); carry .carry/carry.tar.xz and .whl/xz (or .whl/fa4b after a `stash`
#                                  call carried .whl/fa4a); the logs in $OUT/startup-logs.tgz (~200 s)
#   bash bench/run_gpu.sh peer     HF+PEFT+Liger packed on Llama-3.2-3B at PEER_TOKENS (16,384 where the GPU has over
#                                  100 GiB, else 8,192: 16,384 ran out of the H100's 79 GiB); the first of fast2's two
#                                  calls (with .whl/fa4a its part of flash-attn-4 is stashed, see below)
#   bash bench/run_gpu.sh default  fast2's targets, the second call (carry .whl/xz, or .whl/fa4b after .whl/fa4a:
#                                  flash-attn-4 installed, so `auto` runs fa4_op): `default` (LoRA inside the base
#                                  GEMMs), `default_concat` and `default_dropout` on Llama-3.2-3B (DEFAULT_CONFIGS
#                                  picks others), then `default` on Llama-3.1-8B (TOKENS_8B: 16,384 over 100 GiB, else
#                                  8,192) and Llama-3.2-1B (DEFAULT_CONFIGS=none: only those two)
#   bash bench/run_gpu.sh profile  where a `default` and a `default_concat` step go (bench/profile_step.py;
#                                  PROFILE_CONFIGS picks others, PROFILE_MODEL another model), on a machine where
#                                  flash-attn-4 is installed (a `default` call before)
#   bash bench/run_gpu.sh dropout  bench/dropout_gpu.py --apply (the fused dropout kernels tuned, the fastest 10-round
#                                  blocks and warps written into this machine's copy), then `default` and
#                                  `default_dropout` side by side (AB_CONFIGS picks others; none: the tuning alone,
#                                  its lora_dropout.py stashed for a later call's DROPOUT_TUNED=1 on this machine)
#   bash bench/run_gpu.sh ab       AB_CONFIGS (default: default,default_concat,default_dropout,
#                                  default_dropout_grouped) side by side on Llama-3.2-3B
#   bash bench/run_gpu.sh probes   the start-up probes: bench/data_probe.py --cprofile, bench/fa4_cache_probe.py (where
#                                  flash-attn-4 is installed), the start-up with TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK=0
#   bash bench/run_gpu.sh stash    only stash the carried wheels (.whl/fa4a) for the next call; an unknown mode is an
#                                  error (session 16 mistyped one and the old fallback ran the whole ladder)
#   bash bench/run_gpu.sh tests    every GPU equivalence test (pytest -m gpu; those needing flash-attn-4 skip
#                                  unless its wheels are on PYTHONPATH), the log in $OUT/gpu-tests.log
#
# In a new checkout, bench/make_carry.sh makes everything a call carries (.whl/xz, .whl/liger, .carry/).
# Needs .carry/ (lengths_shared_mix.txt, hf_peft_bench.py): the GPU machine has no ../shared. With .whl/liger/ (the
# liger-kernel wheel: `pip download --no-deps liger-kernel -d .whl/liger`, carried too) HF+PEFT+Liger runs beside. Every row goes to
# bench/results.jsonl (appended) and bench/RESULTS.md (regenerated), both copied to $OUT with the logs; copy them
# back over the repository's. RUN_ID=<id> puts a second call's rows into the same run (carry the first call's
# results.jsonl back into bench/ first, so RESULTS.md shows them all).
# Each step gets what is left of the budget minus a reserve for the steps after it; gapless bench skips a
# configuration (and records why) when its estimated time does not fit, and `timeout` stops one that overruns.
# A call carries 64 MiB: .carry/carry.tar.xz (`tar -cJf .carry/carry.tar.xz -C .carry tokenizers messages`: 5.4 MB for
# the 39 MB of the Llama 3 tokenizer and the shared messages) is unpacked into .carry/ first, so the second fast2 call
# can carry it beside .whl/fa4b (52 MB) and run `default` and `startup` in one call: `bash bench/run_gpu.sh default
# && bash bench/run_gpu.sh startup`
# .whl/xz/fa4.tar.xz (bench/pack_fa4.sh: flash-attn-4's wheels in one 57 MB file) replaces the two calls of
# .whl/fa4a and .whl/fa4b: any mode, one call, beside .whl/liger, the lengths and .carry/carry.tar.xz (63 MB in all)
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-all}
MODES="stash probes dropout all flex methods methods2 methods3 methods4 gemma startup startup_ab peer default"
MODES+=" profile ab tests"
# an unknown mode is an error before anything runs: session 16 typed one, and the old fallback ran the whole ladder
# (450 s of a 1,800 s device budget)
if [[ " $MODES " != *" $MODE "* ]]; then
  echo "[run_gpu] unknown mode '$MODE'; one of: $MODES" >&2
  exit 2
fi
# the modes whose steps keep fixed reserves for the steps after them: under this budget their first steps get 20 s
# or less and are killed in their imports (session 17: startup at BUDGET_S=250 lost its warm run, probes at 290 its
# data and flash-attn-4 probes)
declare -A MIN_BUDGET=([startup]=330 [startup_ab]=220 [probes]=450 [default]=400 [dropout]=400)
# DEFAULT_CONFIGS=none: `default` runs only the 8B and 1B; AB_CONFIGS=none: `dropout` only tunes the kernels
if [[ ${DEFAULT_CONFIGS:-} == none ]]; then MIN_BUDGET[default]=200; fi
if [[ ${AB_CONFIGS:-} == none ]]; then MIN_BUDGET[dropout]=200; fi
if (( ${BUDGET_S:-530} < ${MIN_BUDGET[$MODE]:-0} )); then
  echo "[run_gpu] mode $MODE needs BUDGET_S >= ${MIN_BUDGET[$MODE]} (its steps' reserves), got ${BUDGET_S:-530}" >&2
  exit 2
fi
if [[ -f .carry/carry.tar.xz ]]; then tar -xJf .carry/carry.tar.xz -C .carry; fi
# DROPOUT_TUNED=1: the dropout kernels' blocks and warps that an earlier `dropout` call on this warm machine wrote
# (a call's copy of the repository replaces the last one's)
if [[ -n ${DROPOUT_TUNED:-} ]]; then
  if [[ -f /root/stash/lora_dropout.tuned.py ]]; then
    cp /root/stash/lora_dropout.tuned.py src/gapless/kernels/lora_dropout.py
    echo "[run_gpu] lora_dropout.py as tuned by an earlier call: $(grep -E '^(FWD|BWD|BACKWARD)_' \
      src/gapless/kernels/lora_dropout.py | tr '\n' ' ')"
  else
    echo "[run_gpu] DROPOUT_TUNED: no tuned lora_dropout.py stashed on this machine; the repository's" >&2
  fi
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
PEERS=packed_sdpa
if compgen -G ".whl/liger/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/liger/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" && PEERS=packed_sdpa,packed_liger
fi
# flash-attn-4 (what gapless[gpu] adds: `attn_backend: auto` then picks fa4_op), carried as wheels in .whl/fa4*/. Its
# 92 MB cu13 library wheel is more than one call carries: split it (`split -b 46m WHEEL WHEEL.part.`), carry the parts
# in calls back to back (the machine stays warm for 30 s); each call stashes what it carried in /root/stash, and the
# call that has every part joins them and installs the lot into /tmp/site (shared/peers/README.md)
if compgen -G ".whl/fa4*/*" > /dev/null; then
  mkdir -p /root/stash && cp .whl/fa4*/* /root/stash/
  if compgen -G "/root/stash/flash_attn_4-*.whl" > /dev/null && [[ -f /root/stash/parts ]] \
      && (( $(ls /root/stash/*.whl.part.* | wc -l) == $(cat /root/stash/parts) )); then
    for first in /root/stash/*.whl.part.aa; do cat "${first%.aa}".* > "${first%.part.aa}"; done
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /root/stash/*.whl
  fi
fi
# or in one call: .whl/xz/fa4.tar.xz, the same wheels unpacked and packed again with xz's x86 filter (57 MB against
# the wheels' 100; bench/pack_fa4.sh makes it), so flash-attn-4, liger, the lengths and .carry/carry.tar.xz fit one
# call's 64 MiB and no call depends on the one before
if [[ -f .whl/xz/fa4.tar.xz && ! -d /tmp/site/flash_attn ]]; then
  mkdir -p /tmp/site && tar -xJf .whl/xz/fa4.tar.xz -C /tmp/site
fi
# installed by an earlier call on this warm machine too: a later call needs no wheels carried
if [[ -d /tmp/site/flash_attn ]]; then
  export PYTHONPATH="$PYTHONPATH:/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages"
fi
QPEERS=""  # the seed's HF+PEFT+bitsandbytes QLoRA (bench/peers/hf_peft_bench.py) where the wheel was carried
if compgen -G ".whl/bnb/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/bnb/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site" && QPEERS=qlora_packed_ckpt
fi
# stash: the carried wheels stashed (and installed once every part is there), nothing run: the first of two calls
# whose second carries the rest (.whl/fa4a, then .whl/fa4b with any mode)
if [[ $MODE == stash ]]; then ls /root/stash 2>/dev/null; exit 0; fi
PY=${PYTHON:-python3}
OUT=${OUT:-/tmp/gapless-bench-out}
mkdir -p "$OUT"
RUN_ID=${RUN_ID:-$(date -u +%Y%m%dT%H%M%SZ)-h200}
LENGTHS=.carry/lengths_shared_mix.txt
BUDGET=${BUDGET_S:-530}  # seconds, under the 600 s of one call
START=$(date +%s)
left() { echo $(( BUDGET - ($(date +%s) - START) - $1 )); }  # seconds left, less a reserve of $1
at_least() { local s; s=$(left "$1"); echo $(( s > 20 ? s : 20 )); }  # `timeout 0` would mean no limit at all

startup_logs() {  # startup_logs DIR: bench/startup_gpu.py's logs, and gapless.train.warm_attention's per start
  mkdir -p "$1"
  cp /tmp/gapless-startup/*.log "$1"/ 2>/dev/null
  for f in /tmp/gapless-startup/runs/*/attention_warmup.log; do
    [[ -f $f ]] && cp "$f" "$1/attention_warmup-$(basename "$(dirname "$f")").log"
  done
}

bench() {  # bench RESERVE_S ARGS...: one gapless bench process with the time left after RESERVE_S
  local reserve=$1; shift
  local limit; limit=$(left "$reserve")
  if (( limit < 20 )); then echo "[run_gpu] skipped (only ${limit}s left): $*" | tee -a "$OUT/bench.log"; return; fi
  echo "[run_gpu] +$(( $(date +%s) - START ))s, ${limit}s for: $*" | tee -a "$OUT/bench.log"
  timeout -k 10 $(( limit + 15 )) "$PY" -m gapless.cli bench --lengths "$LENGTHS" --run-id "$RUN_ID" \
    --steps 8 --warmup 3 --profile-steps 2 --time-limit-s "$limit" "$@" 2>&1 | tee -a "$OUT/bench.log"
  local rc=${PIPESTATUS[0]}
  if (( rc == 124 || rc == 137 )); then
    echo "[run_gpu] killed after $(( limit + 15 ))s: $*" | tee -a "$OUT/bench.log"
  fi
}

{ nvidia-smi --query-gpu=name,clocks.sm,clocks.max.sm,power.draw,power.limit,temperature.gpu,memory.used \
    --format=csv; "$PY" -c "import torch, triton, transformers, peft; print('torch', torch.__version__, 'cuda',
torch.version.cuda, 'triton', triton.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__)"
} 2>&1 | tee "$OUT/env.txt"

M3=bench/models/llama-3.2-3b
# 16,384 tokens a step where the GPU has over 100 GiB (the H200), else 8,192 (the H100's 79 GiB: HF+PEFT+Liger and
# Llama-3.1-8B ran out of it at 16,384, run s11-default)
GPU_MIB=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -1)
BIG_TOKENS=$(( ${GPU_MIB:-0} > 102400 ? 16384 : 8192 ))
if [[ $MODE == tests ]]; then
  # the failures and skips listed at the end, one line each (the log capture's DEBUG lines and the warnings off:
  # session 14's tail was all of those)
  timeout -k 10 "$BUDGET" "$PY" -m pytest -q -m gpu -p no:logging -p no:warnings -rfs --tb=line tests/ 2>&1 \
    | tail -60 | tee "$OUT/gpu-tests.log"
  exit "${PIPESTATUS[0]}"
elif [[ $MODE == flex ]]; then
  bench 0 --model $M3 --config packed_fused,packed_fused_flex
elif [[ $MODE == startup ]]; then
  # STARTUP_RUNS: startup_gpu.py's --runs (an A/B's two starts fit where three would overrun); STARTUP_ONLY=1: no
  # load-time probe or loading test after it
  timeout -k 10 "$(left $([[ -n ${STARTUP_ONLY:-} ]] && echo 0 || echo 120))" "$PY" bench/startup_gpu.py \
    --work /tmp/gapless-startup --run-id "$RUN_ID" ${STARTUP_RUNS:+--runs "$STARTUP_RUNS"} \
    ${STARTUP_CPROFILE:+--cprofile "$OUT/warm.prof"} 2>&1 | tee "$OUT/startup.log"
  startup_logs "$OUT"
  if [[ -z ${STARTUP_ONLY:-} ]]; then
    # the staged reader against safetensors' memory map, from the disk (--cold) and from the page cache
    { timeout -k 10 "$(left 90)" "$PY" bench/load_time.py /tmp/gapless-startup/model --threads 8 --repeats 2 --cold
      timeout -k 10 "$(left 60)" "$PY" bench/load_time.py /tmp/gapless-startup/model --threads 8 --repeats 2
    } 2>&1 | tee "$OUT/load_time.log"
    timeout -k 10 "$(left 0)" "$PY" -m pytest -q -m gpu tests/test_loading.py 2>&1 | tail -5 | tee "$OUT/gpu-tests.log"
  fi
elif [[ $MODE == startup_ab ]]; then
  "$PY" -c "from gapless.bytecode import cache_bytecode; cache_bytecode(); import gapless.cli, gapless.train.loop, \
gapless.train.warm_attention, torch._inductor.compile_fx, torch._inductor.codegen.triton, transformers; \
import flash_attn.cute.interface" 2>&1 | tail -3
  for variant in on off; do
    if [[ $variant == on ]]; then runs=cold_pyc,warm id=$RUN_ID warm=1; else runs=cold_pyc id=$RUN_ID-nowarm warm=0; fi
    GAPLESS_WARM_ATTENTION=$warm timeout -k 10 "$(at_least 0)" "$PY" \
      bench/startup_gpu.py --work /tmp/gapless-startup --run-id "$id" --runs "$runs" 2>&1 \
      | tee -a "$OUT/startup.log" | grep "^\[startup\]"
    startup_logs "/tmp/startup-logs/$variant"
  done
  tar czf "$OUT/startup-logs.tgz" -C /tmp/startup-logs .
elif [[ $MODE == profile ]]; then
  # where one step of `default` (and `default_concat`) goes, by kernel kind and aten op (bench/profile_step.py)
  PROFILE_CONFIGS=${PROFILE_CONFIGS:-default,default_concat}
  for c in ${PROFILE_CONFIGS//,/ }; do
    timeout -k 10 "$(left 0)" "$PY" bench/profile_step.py --model "${PROFILE_MODEL:-$M3}" --config "$c" \
      --lengths "$LENGTHS" --json "$OUT/profile-$c.json" 2>&1 | tee "$OUT/profile-$c.txt"
  done
elif [[ $MODE == probes ]]; then
  # session 16's open start-up questions, in one call (carry .carry/carry.tar.xz; flash-attn-4 installed by an
  # earlier call for the second): where the cold data's seconds go (the parent's and the workers' CPU seconds, the
  # parent's cProfile, the cgroup quota), whether flash-attn-4's kernels load from its disk cache in a second
  # process, and the start-up with inductor's dynamic RBLOCK scaling off (its two reductions were benchmarked again in
  # every warm start: bench/RESULTS.md, thirteenth round)
  timeout -k 10 "$(at_least 330)" "$PY" bench/data_probe.py --cprofile --modes plain,cuda 2>&1 \
    | tee "$OUT/data_probe.log"
  if "$PY" -c "import flash_attn.cute" 2>/dev/null; then
    timeout -k 10 "$(at_least 280)" "$PY" bench/fa4_cache_probe.py 2>&1 | tee "$OUT/fa4_cache_probe.log"
  fi
  # the weights of an earlier `startup` call on this machine are reused (its caches are emptied first: cold)
  TORCHINDUCTOR_DYNAMIC_SCALE_RBLOCK=0 timeout -k 10 "$(at_least 0)" "$PY" bench/startup_gpu.py \
    --work /tmp/gapless-startup --run-id "$RUN_ID-norblock" 2>&1 | tee "$OUT/startup-norblock.log"
elif [[ $MODE == dropout ]]; then
  # the fused dropout kernels tuned (bench/dropout_gpu.py: rounds, blocks, warps, programs; --apply writes the fastest
  # 10-round blocks and warps into this machine's copy of gapless.kernels.lora_dropout, the diff in the log), then
  # `default` and `default_dropout` side by side with them: the dropout target. Carry .whl/fa4b after a `stash`
  # call carried .whl/fa4a, so `auto` runs fa4_op as `default` does
  # (AB_CONFIGS=none: the tuning alone, its file stashed for a later call's DROPOUT_TUNED=1)
  AB=${AB_CONFIGS:-default,default_dropout}
  timeout -k 10 "$(at_least $([[ $AB == none ]] && echo 0 || echo 250))" "$PY" bench/dropout_gpu.py --apply \
    --out "$OUT/dropout_gpu.jsonl" 2>&1 | tee "$OUT/dropout_gpu.log"
  mkdir -p /root/stash && cp src/gapless/kernels/lora_dropout.py /root/stash/lora_dropout.tuned.py
  if [[ $AB != none ]]; then bench 0 --model $M3 --config "$AB"; fi
elif [[ $MODE == ab ]]; then
  # two (or more) configurations side by side on Llama-3.2-3B in one process (AB_CONFIGS), on a machine where an
  # earlier call stashed .whl/fa4a when this one carries .whl/fa4b (so `auto` runs fa4_op as `default` does)
  bench 0 --model $M3 --config "${AB_CONFIGS:-default,default_concat,default_dropout,default_dropout_grouped}"
elif [[ $MODE == peer ]]; then
  bench 0 --model $M3 --peers --peers-dir bench/peers --peers-configs "${PEERS#packed_sdpa,}" \
    --tokens-per-batch "${PEER_TOKENS:-$BIG_TOKENS}"
elif [[ $MODE == default ]]; then
  # issue fast2's targets: `default`, what a default config resolves to here (fa4_op where flash-attn-4 was carried,
  # the row's attn says), beside LoRA inside the base GEMMs and LoRA dropout 0.05, on Llama-3.2-3B; then Llama-3.1-8B
  # and Llama-3.2-1B. Reserves: 8B ~130 s, 1B ~70 s (the H100's calls: a 3B config ~75 s after the first's compile)
  DC=${DEFAULT_CONFIGS:-default,default_concat,default_dropout}
  if [[ $DC != none ]]; then bench 200 --model $M3 --config "$DC"; fi
  bench 75 --model bench/models/llama-3.1-8b --config default --tokens-per-batch "${TOKENS_8B:-$BIG_TOKENS}"
  bench 0 --model bench/models/llama-3.2-1b --config default
elif [[ $MODE == methods ]]; then
  # issue methods: QLoRA and full fine-tuning on best's path, the seed's HF QLoRA stack beside; best_dropout (fast2)
  bench 120 --model $M3 --config qlora_best,full_best,best_dropout,best
  if [[ -n $QPEERS ]]; then bench 0 --model $M3 --peers --peers-dir bench/peers --peers-configs $QPEERS; fi
elif [[ $MODE == methods3 ]]; then
  bench 420 --model $M3 --config qlora_best,best
  bench 330 --model bench/models/llama-3.1-8b --config qlora_ckpt --tokens-per-batch 8192
  if [[ -n $QPEERS ]]; then bench 230 --model $M3 --peers --peers-dir bench/peers --peers-configs $QPEERS; fi
  timeout -k 10 $(( $(left 90) > 20 ? $(left 90) : 20 )) "$PY" -m pytest -q -m gpu tests/test_nf4.py tests/test_qlora.py \
    tests/test_kernels_lora.py tests/test_generate.py 2>&1 | tail -25 | tee "$OUT/gpu-tests.log"
  bench 0 --model bench/models/llama-3.2-1b --config best,qlora_best,full_best
  "$PY" bench/memory_check.py --run-id "$RUN_ID" 2>&1 | tee "$OUT/memory_check.txt"
elif [[ $MODE == methods4 ]]; then
  # after the QLoRA custom ops (c254780): QLoRA beside LoRA on Llama-3.2-3B, Llama-3.1-8B QLoRA with checkpointing at
  # 8,192 tokens (the 24 GiB card), what each recipe keeps for backward per 8B layer (bench/saved_bytes.py), GPU tests
  bench 400 --model $M3 --config qlora_best,best
  bench 300 --model bench/models/llama-3.1-8b --config qlora_ckpt --tokens-per-batch 8192
  timeout -k 10 $(( $(left 220) > 20 ? $(left 220) : 20 )) "$PY" bench/saved_bytes.py --model bench/models/llama-3.1-8b \
    --tokens 8192 --lengths "$LENGTHS" --config best,best_ckpt,qlora_best,qlora_ckpt 2>&1 | tee "$OUT/saved_bytes.txt"
  timeout -k 10 $(( $(left 0) > 20 ? $(left 0) : 20 )) "$PY" -m pytest -q -m gpu tests/ --durations=12 2>&1 \
    | tee "$OUT/gpu-tests.log" | tail -60
elif [[ $MODE == gemma ]]; then
  # issue 19: Gemma-3-4B's ratio to HF+PEFT(+Liger) beside Llama-3.2-3B's, in one call. 8,192 tokens a step: HF+PEFT
  # packed at 16,384 needs ~158 GiB of activations on Gemma-3-4B (bytes saved per token per layer, counted on the
  # CPU, x 34 layers) and its isolated packed mask makes sdpa run a [T, T] bias. Reserves: gapless default ~70 s
  # (compile ~60 s), each HF+PEFT peer ~60 s
  G4=bench/models/gemma-3-4b
  TOK=${GEMMA_TOKENS:-8192}
  # GEMMA_PEERS: packed_liger alone where Liger was carried (the stronger peer; HF+PEFT without it needs ~110 GiB)
  GP=${GEMMA_PEERS:-${PEERS#packed_sdpa,}}
  bench 170 --model $G4 --config default --tokens-per-batch "$TOK" --profile-steps 0
  bench 110 --model $G4 --tokens-per-batch "$TOK" --peers --peers-dir bench/peers --peers-configs "$GP" \
    --peers-args="--model-config $G4"
  bench 55 --model $M3 --config default --tokens-per-batch "$TOK" --profile-steps 0
  bench 0 --model $M3 --tokens-per-batch "$TOK" --peers --peers-dir bench/peers --peers-configs "$GP" \
    --peers-args="--model-config $M3"
  if (( $(left 0) > 60 )); then
    timeout -k 10 "$(left 0)" "$PY" -m pytest -q -m gpu tests/test_gemma.py tests/test_gemma_kernels.py \
      tests/test_hf_peer.py 2>&1 | tail -25 | tee "$OUT/gpu-tests.log"
  fi
elif [[ $MODE == methods2 ]]; then
  # Llama-3.1-8B QLoRA at max_seq_len 4096 with 8,192 tokens per micro-batch (the 24 GiB card question),
  # Gemma-3-4B LoRA beside Llama-3.2-3B's, and HF+PEFT+Liger packed
  bench 300 --model bench/models/llama-3.1-8b --config qlora_best,qlora_ckpt --tokens-per-batch 8192
  bench 120 --model bench/models/gemma-3-4b --config best
  bench 0 --model $M3 --peers --peers-dir bench/peers --peers-configs $PEERS
else  # all
  # reserves: 1B best ~70 s, 8B best ~120 s, HF+PEFT packed ~60 s (and Liger ~60 s)
  bench 310 --model $M3 --config pad_to_max_ckpt,dyn_pad,packed,packed_fused,packed_fused_compile,best
  # flash-attn-4 where it is importable (its wheels on PYTHONPATH, shared/peers/README.md): the fastest measured
  if "$PY" -c "import flash_attn.cute" 2>/dev/null; then bench 310 --model $M3 --config best_fa4; fi
  bench 240 --model bench/models/llama-3.2-1b --config best
  bench 120 --model bench/models/llama-3.1-8b --config best
  bench 0 --model $M3 --peers --peers-dir bench/peers --peers-configs $PEERS
  if (( $(left 0) > 260 )); then bench 0 --model $M3 --config packed_fused_flex; fi
fi

cp bench/results.jsonl bench/RESULTS.md "$OUT"/ 2>/dev/null
echo; echo "== run $RUN_ID ($(( $(date +%s) - START )) s) =="
"$PY" -m gapless.cli bench --show --run-id "$RUN_ID" | tee "$OUT/table.md"
