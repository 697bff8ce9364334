#!/usr/bin/env bash
# Everything a GPU call of bench/run_gpu.sh carries, made from scratch in a new checkout (about 6 minutes on two
# cores, most of it xz): the pinned wheels of flash-attn-4 and what it imports, packed by bench/pack_fa4.sh into
# .whl/xz/fa4.tar.xz (57 MB); liger-kernel's wheel in .whl/liger (HF+PEFT+Liger, the peer); the shared mix's lengths
# and the peers' script in .carry/; the Llama 3 tokenizer and the shared messages in .carry/carry.tar.xz (5.4 MB).
# 63.7 MB in all, under a call's 64 MiB. The folders are ignored through .git/info/exclude. Versions: those every
# GPU round since the eleventh ran (bench/RESULTS.md); cutlass-dsl's libs for CUDA 13, the GPU machine's.
#
#   bash bench/make_carry.sh     then carry [".whl/xz", ".whl/liger", ".carry/lengths_shared_mix.txt",
#                                ".carry/carry.tar.xz"] (device tool, needs_h200 for the H200)
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared}
mkdir -p .git/info
for path in /.whl/ /.carry/ /bench/models/; do
  grep -qxF "$path" .git/info/exclude 2>/dev/null || echo "$path" >> .git/info/exclude
done
# the GPU machine's Python is 3.12 (device/README.md: pip download's flags for it)
PLATFORMS=""
for n in 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do PLATFORMS+=" --platform manylinux_${n}_x86_64"; done
fetch() {
  local dest=$1; shift
  mkdir -p "$dest"
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux2014_x86_64 $PLATFORMS -d "$dest" "$@" 2>&1 | grep -v "^WARNING: Location" || true
}
fetch .whl/liger liger-kernel==0.8.5
fetch .whl/dl flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
  nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 apache-tvm-ffi==0.1.15.post2 \
  quack-kernels==0.6.5
if [[ ! -f .whl/xz/fa4.tar.xz ]]; then bash bench/pack_fa4.sh; fi
mkdir -p .carry/tokenizers
cp "$SHARED/peers/lengths_shared_mix.txt" "$SHARED/peers/hf_peft_bench.py" .carry/
rm -rf .carry/tokenizers/llama3 .carry/messages
cp -r "$SHARED/tokenizers/llama3" .carry/tokenizers/
cp -r "$SHARED/data/messages" .carry/messages
chmod -R u+w .carry
tar -cJf .carry/carry.tar.xz -C .carry tokenizers messages
du -cb .whl/xz .whl/liger .carry/lengths_shared_mix.txt .carry/carry.tar.xz | tail -1
