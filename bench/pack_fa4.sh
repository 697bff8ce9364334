#!/usr/bin/env bash
# Pack flash-attn-4 and what it needs for one device call: the wheels in WHEELS (default .whl/dl: flash_attn_4,
# nvidia_cutlass_dsl and its libs_base, libs_core and libs_cu13, apache_tvm_ffi, quack_kernels, which
# flash_attn.cute.interface imports: session 22's first pack left it out and `auto` fell back to varlen)
# unpacked as `pip install --target` would lay them out, then tarred and compressed by xz with its x86 filter into
# .whl/xz/fa4.tar.xz (57 MB against the wheels' 100 MB, so it fits a call's 64 MiB beside the data). bench/run_gpu.sh
# unpacks it into /tmp/site. About 4 minutes on two cores.
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=${WHEELS:-.whl/dl}
site=$(mktemp -d)
trap 'rm -rf "$site"' EXIT
for w in "$WHEELS"/{apache_tvm_ffi,flash_attn_4,nvidia_cutlass_dsl,quack_kernels}*.whl; do python3 -m zipfile -e "$w" "$site"; done
mkdir -p .whl/xz
tar -cf - -C "$site" . | xz -T1 --x86 --lzma2=preset=9e,dict=192MiB > .whl/xz/fa4.tar.xz
ls -l .whl/xz/fa4.tar.xz
