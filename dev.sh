#!/usr/bin/env bash
# ropepool developer entry point. Does all set-up on a fresh Debian 12 machine (apt packages,
# a virtual environment in .venv, CMake builds) and then:
#   ./dev.sh bench   build and run `ropepool bench` (the default workload)
#   ./dev.sh test    build everything and run every test (C++ with every Highway target,
#                    `ropepool verify`, the C++ example, C++ under ASan+UBSan and then 60 s
#                    of libFuzzer (FUZZ_SECONDS) from the same clang 14 build, the
#                    concurrency suite under TSan, Python (the tests with a transformers
#                    oracle twice: transformers 4.x and 5.x), a manylinux wheel tested with the
#                    system's Highway hidden; the CUDA kernel and its test are compiled
#                    wherever nvcc exists)
# Each step has its own build folder (build-bench, build, build-asan, build-tsan,
# build-cuda), so no step reconfigures another's. Tests labelled `gpu` need a GPU: built
# here, run by scripts/gpu_check.sh. The plain build compiles and tests the CPU kernel on
# every Highway target; the sanitizer and CUDA builds compile fewer (SANITIZE_HWY_OFF,
# NATIVE_HWY_OFF below); every folder builds with Ninja (configure): the whole run takes
# about 19 minutes on two otherwise idle cores, 28 beside other builds.
set -euo pipefail
cd "$(dirname "$0")"
ROOT=$PWD
JOBS=${JOBS:-$(nproc)}

log() { printf '\n=== [%dm%02ds] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*"; }

apt_deps() {
  local need=()
  # clang-14 + libclang-rt-14-dev (libclang_rt.fuzzer): the ASan+UBSan and libFuzzer step of
  # ./dev.sh test;
  # ninja-build: every build folder uses Ninja (configure below)
  for pkg in cmake g++ ninja-build libhwy-dev libgtest-dev python3-venv clang-14 libclang-rt-14-dev; do
    dpkg -s "$pkg" >/dev/null 2>&1 || need+=("$pkg")
  done
  if ((${#need[@]})); then
    log "installing Debian packages: ${need[*]}"
    local sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}"
  fi
}

venv() {
  local stamp=.venv/.requirements
  if [ ! -x .venv/bin/python ] || ! cmp -s requirements-dev.txt "$stamp"; then
    log "creating .venv with requirements-dev.txt (PyTorch pulls in large CUDA wheels once)"
    python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q -r requirements-dev.txt
    cp requirements-dev.txt "$stamp"
  fi
}

# transformers 5.x for the oracle tests' second run (requirements-transformers5.txt), with no
# dependencies of its own resolved: into .venv/transformers5, first on PYTHONPATH for that
# step only, over .venv's packages.
transformers5() {
  local dir=.venv/transformers5 stamp=.venv/transformers5/.requirements
  if ! cmp -s requirements-transformers5.txt "$stamp"; then
    log "installing requirements-transformers5.txt into $dir"
    rm -rf "$dir"
    .venv/bin/python -m pip install -q --no-deps --target "$dir" -r requirements-transformers5.txt
    cp requirements-transformers5.txt "$stamp"
  fi
}

# Every build folder uses Ninja: unlike Makefiles, it compiles a target's objects while the
# libraries it links are still compiling, so both cores stay busy while the CPU kernel's
# Highway targets (src/cpu/kernel_hwy_part*.cpp) compile. A folder configured with another
# generator, or (where CXX is set) with another C++ compiler, is started afresh: CMake keeps
# the compiler of an existing folder whatever CXX says.
configure() {  # source dir, build dir, extra cmake args...
  local src=$1 dir=$2; shift 2
  local cache=$dir/CMakeCache.txt
  if [ -f "$cache" ]; then
    local cached_cxx; cached_cxx=$(sed -n 's/^CMAKE_CXX_COMPILER:[A-Z]*=//p' "$cache")
    if ! grep -q '^CMAKE_GENERATOR:INTERNAL=Ninja$' "$cache" || { [ -n "${CXX:-}" ] &&
         [ "$(realpath -m "$cached_cxx")" != "$(realpath -m "$(command -v "$CXX" || echo "$CXX")")" ]; }; then
      rm -rf "$dir"
    fi
  fi
  cmake -S "$src" -B "$dir" -G Ninja "$@" >/dev/null
}

cmake_build() {  # dir, extra cmake args...
  local dir=$1; shift
  configure . "$dir" -DCMAKE_BUILD_TYPE=Release "$@"
  cmake --build "$dir" -j "$JOBS"
}

run_ctest() {  # dir, extra ctest args...: every test but the GPU ones; none found is an error
  local dir=$1; shift
  ctest --test-dir "$dir" --output-on-failure --no-tests=error -LE gpu -j "$JOBS" "$@"
}

# The CUDA backend (and its test target) is compiled wherever nvcc exists, even though no
# GPU is here to run it. The Python package in .venv gets the CUDA backend only where a GPU
# is present too (its GPU tests then run in pytest); elsewhere the CUDA build folder compiles
# the extension modules with CUDA instead, so that nvcc's ~3 minutes are not spent twice.
if command -v nvcc >/dev/null 2>&1; then cuda=ON; else cuda=OFF; fi
if [ "$cuda" = ON ] && nvidia-smi -L >/dev/null 2>&1; then cuda_py=ON; else cuda_py=OFF; fi

# Highway targets (ROPEPOOL_HWY_DISABLED_TARGETS) the builds below leave out: the CPU kernel
# compiles once per target, 1-1.5 minutes each under a sanitizer. ASan+UBSan (its ctest run and
# libFuzzer) keeps AVX3 and AVX2 (and the static baseline); TSan and the CUDA compile check
# keep AVX3 and the baseline (what runs on this machine).
SANITIZE_HWY_OFF="HWY_SSE4|HWY_SSSE3"
NATIVE_HWY_OFF="HWY_AVX2|HWY_SSE4|HWY_SSSE3"

# The concurrency suite (tests/cpp/test_concurrency.cpp) under ThreadSanitizer: only that
# suite, so the step stays short; any race report fails it.
test_tsan() {
  log "concurrency tests under ThreadSanitizer"
  configure . build-tsan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DROPEPOOL_WITH_CUDA=OFF \
    -DROPEPOOL_SANITIZE=thread -DROPEPOOL_BUILD_CLI=OFF "-DROPEPOOL_HWY_DISABLED_TARGETS=$NATIVE_HWY_OFF"
  cmake --build build-tsan -j "$JOBS" --target ropepool_test_concurrency
  TSAN_OPTIONS="halt_on_error=1 second_deadlock_stack=1" ./build-tsan/tests/cpp/ropepool_test_concurrency
}

# One clang 14 build folder (build-asan) serves the C++ tests under ASan+UBSan and libFuzzer:
# one `cmake --build` compiles the tests and the fuzzer (the library carries libFuzzer's
# coverage instrumentation, ROPEPOOL_FUZZ), ctest runs every test, then libFuzzer runs over
# rope_pool_fused (tests/fuzz) for FUZZ_SECONDS (60) from the seed corpus (copied: the run's
# finds stay in build-asan). A crash fails the step and leaves its input in build-asan/
# (crash-*): replay it with build-asan/tests/fuzz/ropepool_fuzz <file>, keep it under
# tests/fuzz/regressions/.
test_asan_fuzz() {
  log "C++ tests under AddressSanitizer + UndefinedBehaviorSanitizer (clang 14)"
  CC=clang-14 CXX=clang++-14 configure . build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo \
    -DROPEPOOL_WITH_CUDA=OFF -DROPEPOOL_SANITIZE=ON -DROPEPOOL_FUZZ=ON -DROPEPOOL_BUILD_CLI=OFF \
    "-DROPEPOOL_HWY_DISABLED_TARGETS=$SANITIZE_HWY_OFF"
  cmake --build build-asan -j "$JOBS"
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 run_ctest build-asan
  log "libFuzzer on rope_pool_fused, ${FUZZ_SECONDS:-60} s (ASan+UBSan, build-asan)"
  rm -rf build-asan/corpus && mkdir -p build-asan/corpus && cp tests/fuzz/corpus/* build-asan/corpus/
  ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1 \
    ./build-asan/tests/fuzz/ropepool_fuzz -max_total_time="${FUZZ_SECONDS:-60}" -timeout=30 \
      -rss_limit_mb=4096 -print_final_stats=1 -artifact_prefix=build-asan/ build-asan/corpus
}

case "${1:-}" in
  bench)
    shift
    apt_deps
    log "building (Release)"
    cmake_build build-bench -DROPEPOOL_WITH_CUDA=OFF -DROPEPOOL_BUILD_TESTS=OFF
    log "ropepool bench $*"
    ./build-bench/ropepool bench "$@"
    ;;
  test)
    apt_deps
    venv
    log "C++ build + ctest (GoogleTest suites, every Highway target)"
    cmake_build build -DROPEPOOL_WITH_CUDA=OFF
    run_ctest build
    log "ropepool verify"
    ./build/ropepool verify
    log "install + the C++ example as a downstream find_package(ropepool) project"
    cmake --install build --prefix build/install >/dev/null
    configure examples/cpp build/example -DCMAKE_PREFIX_PATH="$ROOT/build/install"
    cmake --build build/example -j "$JOBS"
    ./build/example/example
    test_asan_fuzz
    test_tsan
    if [ "$cuda" = ON ]; then
      log "CUDA backend, its test and benchmark, the Python extensions with CUDA: compiled only (sm_90)"
      configure . build-cuda -DCMAKE_BUILD_TYPE=Release -DROPEPOOL_WITH_CUDA=ON \
        -DROPEPOOL_BUILD_PYTHON=ON "-DPython_EXECUTABLE=$ROOT/.venv/bin/python" \
        -DROPEPOOL_WITH_JAX=ON -DROPEPOOL_WITH_MLX=ON "-DROPEPOOL_HWY_DISABLED_TARGETS=$NATIVE_HWY_OFF"
      cmake --build build-cuda -j "$JOBS" --target ropepool_test_cuda ropepool_bench_cuda _ropepool _ropepool_mlx
    fi
    log "Python package (CUDA backend: $cuda_py) + pytest"
    ROPEPOOL_WITH_CUDA=$cuda_py CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
      .venv/bin/python -m pip install -q --no-build-isolation --no-deps .
    .venv/bin/python -m pytest tests/python -q
    log "the tests with a transformers oracle again, against transformers 5.x"
    transformers5
    PYTHONPATH=.venv/transformers5 .venv/bin/python -c \
      'import sys, transformers; v = transformers.__version__; print("transformers", v); sys.exit(not v.startswith("5."))'
    PYTHONPATH=.venv/transformers5 .venv/bin/python -m pytest -q $(grep -l transformers tests/python/test_*.py)
    log "manylinux wheel (CPU backend): built, then tested in a fresh venv with libhwy hidden"
    rm -rf build-wheel/dist
    JOBS=$JOBS scripts/build_wheels.sh --cuda off --out build-wheel/dist
    scripts/check_wheel.sh build-wheel/dist/ropepool-*-manylinux_*.whl
    # the negative control: the same build before auditwheel repair must not import there
    scripts/check_wheel.sh --expect-import-failure build-wheel/raw-*-cudaOFF/ropepool-*.whl
    ;;
  *)
    echo "usage: ./dev.sh bench [ropepool bench options] | ./dev.sh test" >&2
    exit 2
    ;;
esac
