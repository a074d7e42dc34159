#!/usr/bin/env bash
# The benchmark peers (FlashInfer) packed for a GPU machine without network access.
#
#   bash scripts/peer_site.sh        # from the repository root, on a machine with nvcc 13
#
# Reads the pinned wheels in .whl-peers/ (README, "On a GPU": flashinfer-python and the
# apache-tvm-ffi build for CPython 3.12), installs them into a scratch folder, builds
# FlashInfer's two JIT modules the benchmarks call (rope, page) for sm_90 with this machine's
# nvcc through FlashInfer's own JIT, puts the two .so files where FlashInfer looks for
# ahead-of-time builds (flashinfer/data/aot/NAME/NAME.so), leaves out the sources and headers
# of every other kernel (the whole wheel is 62 MB packed, too much to travel), and writes
# .whl-peers/offline/ropepool-peers-sm90.tar.xz. scripts/gpu_check.sh unpacks that into
# /tmp/ropepool-peers and puts it on PYTHONPATH. Never a runtime dependency of ropepool:
# bench/gpu_bench.py and bench/gpu_bench_mla.py time FlashInfer beside ropepool when it
# imports, and say so when it does not.
#
# Kept for a JIT fallback on the GPU machine: the rope and page sources, FlashInfer's headers
# and CCCL (what those two modules include). Needs nvcc, ninja and a Python with torch
# (.venv/bin/python, else python3; PYTHON= chooses), into which nothing is installed: the
# build imports FlashInfer from a scratch folder, with the tvm-ffi build for that Python and
# the few packages FlashInfer imports, fetched by pip (the JIT modules link no Python).
set -euo pipefail
cd "$(dirname "$0")/.."
FI=$(ls .whl-peers/flashinfer_python-*.whl)
TVM=$(ls .whl-peers/apache_tvm_ffi-*-cp312-*.whl)
TVM_VERSION=$(basename "$TVM" | cut -d- -f2)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
PY=${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3)}

# the site that travels (CPython 3.12) and one to build with (this python3)
$PY -m pip install -q --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --target "$WORK/site" "$FI" "$TVM"
$PY -m pip install -q --no-deps --no-compile --target "$WORK/build" "$FI" "apache-tvm-ffi==$TVM_VERSION" \
  einops nvidia-ml-py tabulate click
FLASHINFER_CUDA_ARCH_LIST="9.0" FLASHINFER_WORKSPACE_BASE="$WORK/ws" PYTHONPATH="$WORK/build" \
  $PY - "$WORK/site/flashinfer/data/aot" <<'EOF'
import shutil, sys, pathlib
from flashinfer.jit.page import gen_page_module
from flashinfer.jit.rope import gen_rope_module
for gen in (gen_rope_module, gen_page_module):
    spec = gen()
    spec.build()
    dst = pathlib.Path(sys.argv[1]) / spec.name
    dst.mkdir(parents=True, exist_ok=True)
    shutil.copy(spec.jit_library_path, dst / f"{spec.name}.so")
    print("built", dst / f"{spec.name}.so")
EOF

data=$WORK/site/flashinfer/data
rm -rf "$data/cutlass" "$data/spdlog"
mkdir "$WORK/csrc"
for f in rope.cu flashinfer_rope_binding.cu page.cu flashinfer_page_binding.cu tvm_ffi_utils.h; do
  [ -e "$data/csrc/$f" ] && mv "$data/csrc/$f" "$WORK/csrc/"
done
rm -rf "$data/csrc" && mv "$WORK/csrc" "$data/csrc"
mkdir -p .whl-peers/offline
tar -C "$WORK/site" -cJf .whl-peers/offline/ropepool-peers-sm90.tar.xz .
ls -la .whl-peers/offline
