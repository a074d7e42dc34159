#!/usr/bin/env bash
# ropepool on a CUDA machine (H200, sm_90), one command from the repository root:
#
#   bash scripts/gpu_check.sh            # build, test, sanitize, benchmark; ~2-3 minutes
#   GPU_CHECK_BENCH=0 bash scripts/gpu_check.sh   # the same without the benchmark
#   GPU_CHECK_TESTS=0 bash scripts/gpu_check.sh   # builds and benchmarks only
#   GPU_CHECK_SANITIZE=0 ...                       # without the compute-sanitizer step
#   GPU_CHECK_QUICK=1 ...   # without the steps other steps cover: ctest -LE gpu (the CPU
#                           # tests, run by CI), the separate JAX step (its tests are in the
#                           # whole suite) and the decode example without a CUDA graph;
#                           # pytest runs only the GPU cases (-m gpu)
#   GPU_CHECK_PROFILE=1 ...                        # also Nsight Compute on the C++ benchmark
#   GPU_CHECK_PROFILE_TOKENS="1 256" ...           # its token counts (default 1 64 4096 65536)
#   GPU_CHECK_BENCHES="py mla" ...  # which benchmarks step 6 runs (default: cpp py mla host),
#                                   # so that the long ones can go in separate calls
#   GPU_BENCH_CPP_ARGS="--pools --tokens 1,4096" ...   # arguments of the C++ benchmark
#   GPU_CHECK_BASELINE_BENCH=path ...  # a ropepool_bench_cuda built from another tree (or a
#                               # .tar.xz holding one): the C++ benchmark then runs it and this
#                               # tree's in turn, GPU_CHECK_AB_ROUNDS times (default 2), with
#                               # the same arguments: before/after on one GPU in one call
#   GPU_BENCH_ARGS="--tokens 1 --cache-tokens ''" ...  # extra arguments of bench/gpu_bench.py
#   GPU_BENCH_MLA_ARGS="--heads 128" ...               # and of bench/gpu_bench_mla.py
#   GPU_CHECK_PREBUILT=dir ...  # the CUDA test, MLA test and benchmark binaries
#                               # (ropepool_test_cuda, ropepool_test_mla_cuda,
#                               # ropepool_bench_cuda) built elsewhere for sm_90 from the same
#                               # tree, in dir or in dir.tar.xz: step 2's CMake build is
#                               # skipped (the package is still built) and step 3 runs them
#                               # directly; ctest -LE gpu is skipped, the CLI is not built
#   GPU_CHECK_PYTHON=0 ...      # no package build, so none of the Python steps (pytest, the
#                               # decode example, the Python benchmarks): with
#                               # GPU_CHECK_PREBUILT, a call of the C++ tests and benchmark
#                               # alone, nothing compiled on the device
#
# Expects: nvcc, python3 with torch (CUDA), nanobind, scikit-build-core, pytest, cmake and
# ninja already installed; downloads nothing (pip runs with --no-build-isolation --no-deps).
# Highway and GoogleTest come from Debian packages in .deb/ (libhwy1, libhwy-dev,
# libgtest-dev), unpacked with `dpkg -x` into /tmp/ropepool-debs, unless they are installed.
# The test oracle (transformers 4.57.6 and the huggingface_hub/tokenizers it accepts) from
# wheels in .whl/, when there, installed to /tmp/ropepool-site. The benchmark peer FlashInfer
# from .whl-peers/ (README, "On a GPU"), when there, to /tmp/ropepool-peers.
#
# Steps (each runs even when an earlier one failed, unless it needs that one's output):
#   1. pip install the package with the CUDA backend (sm_90)
#   2. CMake build of the library with CUDA, the C++ tests (CUDA test included), the CUDA
#      benchmark and the CLI; ctest of everything but the GPU tests (`-LE gpu`)
#   3. the GPU tests (`ctest -L gpu`: tests/cuda/test_cuda.cu, test_mla_cuda.cu): every kernel path vs the
#      float64 reference, SPEC §3 slot errors, duplicates, a pool over 4 GiB, CUDA graphs
#   4. the whole pytest suite (CPU and GPU tests; with two GPUs also the two-device tests
#      and a two-rank tensor-parallel run over NCCL), then examples/decode.py on CUDA with
#      its decode step in a CUDA graph and without; where jax is installed, the JAX front
#      end is built (ROPEPOOL_WITH_JAX=ON) and its GPU tests (tests/python/test_jax.py -m
#      gpu: JAX on CUDA under jax.jit) are also a step of their own
#   5. compute-sanitizer on the CUDA test (small grid): memcheck, racecheck, initcheck and
#      synccheck
#   6. the C++ benchmark (bench/cuda: the kernel alone, with and without PDL) and
#      bench/gpu_bench.py (ropepool vs PyTorch eager, torch.compile, copy; then its SPEC §6
#      cache-format and SPEC §7 fusion sections at their default token counts), and
#      bench/gpu_bench_mla.py (mla_rope_pool_fused vs PyTorch eager, torch.compile, copy), and
#      bench/torch_overhead.py (host time per torch call at T = 1, by keyword set)
# Logs go to $OUT (or ./gpu-check-logs): at most 8 files. A summary table is printed last.
# Exit status: 0 when every step passed.
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off for the multi-GPU tests (NCCL, PyTorch symmetric memory,
# NVSHMEM): a program that uses it can take a shared host's GPUs out of service.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
ROOT=$PWD
LOGS=${OUT:-$ROOT/gpu-check-logs}
mkdir -p "$LOGS"
JOBS=${JOBS:-$(nproc)}
PY=${PYTHON:-python3}
BUILD=$ROOT/build-gpu
DEBS=/tmp/ropepool-debs
START=$SECONDS
export PYTHONUNBUFFERED=1
# JAX shares the GPU with torch in the test processes: no 75% preallocation.
export XLA_PYTHON_CLIENT_PREALLOCATE=false

declare -a NAMES STATUS TIMES NOTES
step() {  # name, seconds, status, note
  NAMES+=("$1"); TIMES+=("$2"); STATUS+=("$3"); NOTES+=("$4")
  printf '\n=== %s: %s (%ss) %s\n' "$1" "$3" "$2" "$4"
}
run_step() {  # name, log, timeout, command...
  local name=$1 log=$2 limit=$3; shift 3
  local t0=$SECONDS
  printf '\n=== %s\n' "$name" | tee -a "$log"
  timeout --signal=KILL "$limit" "$@" >>"$log" 2>&1
  local rc=$?
  local st=PASS
  if [ $rc -eq 137 ] || [ $rc -eq 124 ]; then st="TIMEOUT(${limit}s)"; elif [ $rc -ne 0 ]; then st="FAIL(rc=$rc)"; fi
  LAST_RC=$rc
  step "$name" $((SECONDS - t0)) "$st" ""
  [ $rc -eq 0 ] || tail -n 25 "$log"
  return $rc
}

# --- environment ------------------------------------------------------------------------
{
  echo "date: $(date -u +%FT%TZ)"; uname -a
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem --format=csv || true
  nvcc --version | tail -n 2
  cmake --version | head -n 1
  $PY -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.version.cuda, "gpu", torch.cuda.is_available())'
  $PY -c 'import jax, jaxlib; print("jax", jax.__version__, "jaxlib", jaxlib.__version__, "backend", jax.default_backend(), jax.devices())' 2>&1 | tail -n 1
  command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || echo "compute-sanitizer: not found"
  git log -1 --format='commit %h %s' 2>/dev/null || true
} 2>&1 | tee "$LOGS/summary.txt"

# --- Highway / GoogleTest from .deb ---------------------------------------------------------
CMAKE_DEPS=()
if ls .deb/*.deb >/dev/null 2>&1; then
  mkdir -p "$DEBS"
  for f in .deb/*.deb; do dpkg -x "$f" "$DEBS"; done
  LIBDIR=$DEBS/usr/lib/x86_64-linux-gnu
  [ -d "$LIBDIR/cmake/hwy" ] && CMAKE_DEPS+=("-Dhwy_DIR=$LIBDIR/cmake/hwy")
  [ -d "$LIBDIR/cmake/GTest" ] && CMAKE_DEPS+=("-DGTest_DIR=$LIBDIR/cmake/GTest")
  CMAKE_DEPS+=("-DCMAKE_PREFIX_PATH=$DEBS/usr")
  export LD_LIBRARY_PATH=$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
  echo "unpacked $(ls .deb/*.deb | wc -l) .deb files into $DEBS" | tee -a "$LOGS/summary.txt"
fi
# --- the pinned test oracle from .whl ----------------------------------------------------------
# tests/python/test_rope_variants.py compares against transformers 4.57.6 (requirements-dev.txt);
# a GPU image with another major version skips those tests unless the pinned wheels travel in
# .whl/ (README, "On a GPU"). They go to a private path, first on PYTHONPATH.
if ls .whl/*.whl >/dev/null 2>&1; then
  if $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/ropepool-site .whl/*.whl >>"$LOGS/summary.txt" 2>&1; then
    export PYTHONPATH=/tmp/ropepool-site${PYTHONPATH:+:$PYTHONPATH}
    echo "test oracle: $(ls .whl/*.whl | xargs -n1 basename | cut -d- -f1,2 | tr '\n' ' ')on PYTHONPATH" | tee -a "$LOGS/summary.txt"
  else
    echo "test oracle: installing .whl/*.whl failed" | tee -a "$LOGS/summary.txt"
  fi
fi
# --- the benchmark peers (FlashInfer), optional -------------------------------------------------
# bench/gpu_bench.py and bench/gpu_bench_mla.py time FlashInfer beside ropepool where it
# imports. .whl-peers/offline/*.tar.xz (scripts/peer_site.sh: FlashInfer with its rope and
# page modules built for sm_90) is unpacked, else the wheels in .whl-peers/ are installed, into
# /tmp/ropepool-peers, last on PYTHONPATH; neither folder, and the benchmarks say FlashInfer
# is not importable.
PEERS=/tmp/ropepool-peers
if ls .whl-peers/offline/*.tar.xz >/dev/null 2>&1; then
  mkdir -p $PEERS && for f in .whl-peers/offline/*.tar.xz; do tar -C $PEERS -xJf "$f" || PEERS=; done
elif ls .whl-peers/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target $PEERS .whl-peers/*.whl >>"$LOGS/summary.txt" 2>&1 || PEERS=
else
  PEERS=
fi
if [ -n "$PEERS" ]; then
  export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PEERS
  echo "benchmark peers: $(ls $PEERS | grep -E '^[a-z_]+-[0-9].*dist-info$' | sed 's/.dist-info//' | tr '\n' ' ')on PYTHONPATH" | tee -a "$LOGS/summary.txt"
fi
# CMake < 3.26 knows no C++20 flag for nvcc (src/cuda/cuda.cmake has the same fix).
CUDA_STD=(-DCMAKE_CUDA20_STANDARD_COMPILE_OPTION=-std=c++20 -DCMAKE_CUDA20_EXTENSION_COMPILE_OPTION=-std=c++20)
CUDA_OPTS=(-DROPEPOOL_WITH_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 "${CUDA_STD[@]}")

# --- 1 + 2: the two builds, side by side ----------------------------------------------------
PIP_ARGS=(--no-build-isolation --no-deps --no-cache-dir -v)
for d in "${CUDA_OPTS[@]}" "${CMAKE_DEPS[@]}"; do PIP_ARGS+=("-Ccmake.define.${d#-D}"); done
PIP_ARGS+=("-Cbuild-dir=$BUILD/python")
# The JAX front end is required where jax is installed (a missing header fails the build).
if $PY -c 'import jax' >/dev/null 2>&1; then HAS_JAX=1; PIP_ARGS+=("-Ccmake.define.ROPEPOOL_WITH_JAX=ON"); else HAS_JAX=0; fi
t0=$SECONDS
mkdir -p "$BUILD"
rm -f "$BUILD/pip.rc"
PYTHON_STEPS=${GPU_CHECK_PYTHON:-1}
if [ "$PYTHON_STEPS" = 0 ]; then
  ( : >"$LOGS/build.log.pip"; echo skipped >"$BUILD/pip.rc" ) &
else
  ( CMAKE_BUILD_PARALLEL_LEVEL=$JOBS ROPEPOOL_WITH_CUDA=ON timeout --signal=KILL 420 \
      $PY -m pip install "${PIP_ARGS[@]}" . >"$LOGS/build.log.pip" 2>&1; echo $? >"$BUILD/pip.rc" ) &
fi
PIP_PID=$!
PREBUILT=${GPU_CHECK_PREBUILT:-}
if [ -n "$PREBUILT" ] && [ ! -d "$PREBUILT" ] && [ -f "$PREBUILT.tar.xz" ]; then
  mkdir -p "$BUILD/prebuilt" && tar -C "$BUILD/prebuilt" -xJf "$PREBUILT.tar.xz" &&
    PREBUILT=$BUILD/prebuilt/$(basename "$PREBUILT")
fi
if [ -n "$PREBUILT" ]; then
  {
    echo "=== prebuilt binaries from ${GPU_CHECK_PREBUILT}: no CMake build"
    ls -l "$PREBUILT"/ropepool_test_cuda "$PREBUILT"/ropepool_test_mla_cuda \
      "$PREBUILT"/ropepool_bench_cuda
  } >"$LOGS/build.log" 2>&1
else {
  echo "=== cmake configure"
  # -Xptxas -v: the register/spill report of every kernel lands in this log.
  cmake -S . -B "$BUILD/cpp" -G Ninja -DCMAKE_BUILD_TYPE=Release -DROPEPOOL_BUILD_TESTS=ON \
    -DROPEPOOL_BUILD_BENCH=ON -DROPEPOOL_BUILD_CLI=ON "${CUDA_OPTS[@]}" "${CMAKE_DEPS[@]}" \
    "-DCMAKE_CUDA_FLAGS=-Xptxas -v" &&
  echo "=== cmake build" && timeout --signal=KILL 420 cmake --build "$BUILD/cpp" -j "$JOBS"
} >"$LOGS/build.log" 2>&1
fi
CPP_RC=$?
wait $PIP_PID
PIP_RC=$(cat "$BUILD/pip.rc" 2>/dev/null || echo 1)
cat "$LOGS/build.log.pip" >>"$LOGS/build.log"; rm -f "$LOGS/build.log.pip"
# Register/spill summary of the CUDA kernels (counts of "N regs, S bytes spilled").
REGS=$(grep -E "Used [0-9]+ registers|spill stores" "$LOGS/build.log" | grep -B1 "Used" |
  grep -oE "[0-9]+ bytes spill stores|Used [0-9]+ registers" | paste -d' ' - - |
  awk '{print $6 "r/" $1 "B"}' | sort | uniq -c | awk '{printf "%sx%s ", $1, $2}')
echo "ptxas: $REGS" >>"$LOGS/build.log"
if [ "$PIP_RC" = skipped ]; then
  step "pip install (CUDA) and the Python steps" 0 "SKIPPED" "GPU_CHECK_PYTHON=0"
else
  step "pip install (CUDA)" $((SECONDS - t0)) "$([ "$PIP_RC" = 0 ] && echo PASS || echo "FAIL(rc=$PIP_RC)")" ""
fi
if [ -n "$PREBUILT" ]; then
  step "prebuilt CUDA binaries" 0 "$([ $CPP_RC = 0 ] && echo PASS || echo "FAIL(missing)")" "$GPU_CHECK_PREBUILT"
else
  step "cmake build (CUDA, tests, CLI)" $((SECONDS - t0)) "$([ $CPP_RC = 0 ] && echo PASS || echo "FAIL(rc=$CPP_RC)")" "ptxas: ${REGS:0:80}"
fi
{ [ "$PIP_RC" = 0 ] || [ "$PIP_RC" = skipped ]; } && [ $CPP_RC = 0 ] || tail -n 40 "$LOGS/build.log"

# GPU_CHECK_TESTS=0 skips steps 2b-5 (a benchmark-only rerun of code already tested).
TESTS=${GPU_CHECK_TESTS:-1}
QUICK=${GPU_CHECK_QUICK:-0}
[ "$TESTS" = 0 ] && step "tests (steps 2b-5)" 0 "SKIPPED" "GPU_CHECK_TESTS=0"

# --- 2b: ctest (everything but the GPU tests) --------------------------------------------------
if [ $CPP_RC = 0 ] && [ "$TESTS" != 0 ] && [ "$QUICK" != 1 ] && [ -z "$PREBUILT" ]; then
  run_step "ctest -LE gpu" "$LOGS/ctest.log" 300 \
    ctest --test-dir "$BUILD/cpp" --output-on-failure --no-tests=error -LE gpu -j "$JOBS"
  NOTES[-1]="$(grep -E 'tests passed|tests failed' "$LOGS/ctest.log" | tail -n 1)"
fi

# --- 3: the GPU tests (tests/cuda) ---------------------------------------------------------------
CUDA_TEST=$BUILD/cpp/tests/cuda/ropepool_test_cuda
MLA_TEST=$BUILD/cpp/tests/cuda/ropepool_test_mla_cuda
CUDA_BENCH=$BUILD/cpp/bench/cuda/ropepool_bench_cuda
if [ -n "$PREBUILT" ]; then
  CUDA_TEST=$PREBUILT/ropepool_test_cuda MLA_TEST=$PREBUILT/ropepool_test_mla_cuda
  CUDA_BENCH=$PREBUILT/ropepool_bench_cuda
fi
if [ $CPP_RC = 0 ] && [ "$TESTS" != 0 ] && [ -n "$PREBUILT" ]; then
  run_step "CUDA tests (prebuilt: test_cuda, test_mla_cuda)" "$LOGS/selftest.log" 300 \
    bash -c "'$CUDA_TEST' && '$MLA_TEST'"
  NOTES[-1]="$(grep -oE 'tests: [0-9]+ checks, [0-9]+ failures|[0-9]+ cases, [0-9]+ failures' "$LOGS/selftest.log" | paste -sd' ')"
elif [ $CPP_RC = 0 ] && [ "$TESTS" != 0 ]; then
  run_step "ctest -L gpu (CUDA test)" "$LOGS/selftest.log" 300 \
    ctest --test-dir "$BUILD/cpp" --output-on-failure --no-tests=error -L gpu -V
  NOTES[-1]="$(grep -oE 'tests: [0-9]+ checks, [0-9]+ failures' "$LOGS/selftest.log" | tail -n 1)"
fi

# --- 4: pytest ---------------------------------------------------------------------------------
if [ "$PIP_RC" = 0 ] && [ "$TESTS" != 0 ]; then
  # From a directory without the source package, so the installed one is imported.
  # (quick: only the GPU cases, `-m gpu`; CI runs the CPU ones)
  select=(); name="pytest (whole suite, GPU included)"
  [ "$QUICK" = 1 ] && select=(-m gpu) && name="pytest -m gpu (the GPU cases)"
  run_step "$name" "$LOGS/pytest.log" 420 \
    bash -c "cd /tmp && $PY -m pytest '$ROOT/tests/python' -q -p no:cacheprovider -rs ${select[*]:-} --rootdir '$ROOT' -c '$ROOT/pyproject.toml'"
  NOTES[-1]="$(grep -E '[0-9]+ (passed|failed)' "$LOGS/pytest.log" | tail -n 1)"
  if [ "$QUICK" = 1 ]; then
    :
  elif [ "$HAS_JAX" = 1 ]; then
    run_step "JAX front end on CUDA (test_jax.py -m gpu)" "$LOGS/pytest.log" 300 \
      bash -c "cd /tmp && $PY -m pytest '$ROOT/tests/python/test_jax.py' -q -p no:cacheprovider -rs -m gpu --rootdir '$ROOT' -c '$ROOT/pyproject.toml'"
    NOTES[-1]="$(grep -E '[0-9]+ (passed|failed|skipped)' "$LOGS/pytest.log" | tail -n 1)"
  else
    step "JAX front end on CUDA" 0 "SKIPPED" "jax is not installed"
  fi
  modes=(graph no-graph); [ "$QUICK" = 1 ] && modes=(graph)
  for mode in "${modes[@]}"; do
    extra=(); [ $mode = no-graph ] && extra=(--no-graph)
    run_step "examples/decode.py --device cuda ($mode)" "$LOGS/pytest.log" 300 \
      bash -c "cd /tmp && $PY '$ROOT/examples/decode.py' --device cuda ${extra[*]:-}"
    NOTES[-1]="$(grep -iE 'match|differ' "$LOGS/pytest.log" | tail -n 1 | cut -c1-60)"
  done
fi

# --- 5: compute-sanitizer ----------------------------------------------------------------------
SAN=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
if [ "$TESTS" = 0 ]; then
  :
elif [ "${GPU_CHECK_SANITIZE:-1}" = 0 ]; then
  step "compute-sanitizer" 0 "SKIPPED" "GPU_CHECK_SANITIZE=0"
elif [ -x "$CUDA_TEST" ] && [ -x "$SAN" ]; then
  for tool in memcheck racecheck initcheck synccheck; do
    extra=(); [ $tool = memcheck ] && extra=(--leak-check no)
    run_step "compute-sanitizer $tool (CUDA test, small grid)" "$LOGS/sanitizer.log" 300 \
      "$SAN" --tool $tool "${extra[@]}" --error-exitcode 99 "$CUDA_TEST" --sanitize
    NOTES[-1]="$(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY' "$LOGS/sanitizer.log" | tail -n 1)"
  done
else
  step "compute-sanitizer" 0 "SKIPPED" "no CUDA test binary or no compute-sanitizer"
fi
if [ "$TESTS" != 0 ] && [ "${GPU_CHECK_SANITIZE:-1}" != 0 ] && [ -x "$MLA_TEST" ] && [ -x "$SAN" ]; then
  run_step "compute-sanitizer memcheck (MLA CUDA test)" "$LOGS/sanitizer.log" 300 \
    "$SAN" --tool memcheck --leak-check no --error-exitcode 99 "$MLA_TEST"
  NOTES[-1]="$(grep -E 'ERROR SUMMARY' "$LOGS/sanitizer.log" | tail -n 1)"
fi

# --- 6: benchmarks --------------------------------------------------------------------------
if [ "${GPU_CHECK_BENCH:-1}" = 0 ]; then
  step "benchmarks" 0 "SKIPPED" "GPU_CHECK_BENCH=0"
else
  BENCHES=" ${GPU_CHECK_BENCHES:-cpp py mla host} "
  BASELINE=${GPU_CHECK_BASELINE_BENCH:-}
  if [[ $BASELINE == *.tar.xz ]] && [ -f "$BASELINE" ]; then
    mkdir -p "$BUILD/baseline" && tar -C "$BUILD/baseline" -xJf "$BASELINE" &&
      BASELINE=$(find "$BUILD/baseline" -name ropepool_bench_cuda -type f | head -n 1)
  fi
  if [ -n "${GPU_CHECK_BASELINE_BENCH:-}" ] && [ ! -x "$BASELINE" ]; then
    step "CUDA C++ bench, baseline" 0 "FAIL(missing)" "$GPU_CHECK_BASELINE_BENCH: no ropepool_bench_cuda"
  elif [ -x "$CUDA_BENCH" ] && [[ $BENCHES == *" cpp "* ]]; then
    # The kernel alone from C++ (no Python), with and without PDL; with a baseline, the two
    # binaries in turn.
    ROUNDS=1
    [ -n "$BASELINE" ] && ROUNDS=${GPU_CHECK_AB_ROUNDS:-2}
    for r in $(seq 1 "$ROUNDS"); do
      [ -n "$BASELINE" ] &&
        run_step "CUDA C++ bench, baseline, round $r" "$LOGS/selftest.log" 420 "$BASELINE" ${GPU_BENCH_CPP_ARGS:-}
      run_step "CUDA C++ bench (bench/cuda)${BASELINE:+, round $r}" "$LOGS/selftest.log" 420 \
        "$CUDA_BENCH" ${GPU_BENCH_CPP_ARGS:-}
    done
  fi
  if [ "$PIP_RC" = 0 ]; then
    # The main table, the cache formats (§6) and the fusions (§7, with a torch.compile build
    # of its own), one JSON. The watchdog stays below the step's kill, so a hang prints every
    # thread's stack.
    [[ $BENCHES == *" py "* ]] && run_step "bench/gpu_bench.py" "$LOGS/bench.log" 540 \
      bash -c "cd /tmp && OUT='$LOGS' ROPEPOOL_BENCH_WATCHDOG_S=${ROPEPOOL_BENCH_WATCHDOG_S:-480} \
        $PY '$ROOT/bench/gpu_bench.py' --json '$LOGS/gpu_bench.json' ${GPU_BENCH_ARGS:-}"
    # SPEC §8 (MLA): its full results are the JSON lines in bench.log, no file of their own
    # (8 log files at most).
    [[ $BENCHES == *" mla "* ]] && run_step "bench/gpu_bench_mla.py" "$LOGS/bench.log" 360 \
      bash -c "cd /tmp && ROPEPOOL_BENCH_WATCHDOG_S=${ROPEPOOL_BENCH_MLA_WATCHDOG_S:-330} \
        $PY '$ROOT/bench/gpu_bench_mla.py' --json '' ${GPU_BENCH_MLA_ARGS:-}"
    # Host µs per torch call at T = 1 by keyword set (and FlashInfer's, where it imports).
    [[ $BENCHES == *" host "* ]] && run_step "bench/torch_overhead.py" "$LOGS/bench.log" 120 \
      bash -c "cd /tmp && $PY '$ROOT/bench/torch_overhead.py' --device cuda"
  fi
fi

# --- 7 (GPU_CHECK_PROFILE=1): Nsight Compute on the default kernel ---------------------------------
# One launch each at T = 1, 64, 4096 and 65536 (GPU_CHECK_PROFILE_TOKENS) of the C++
# benchmark's cold workload (ncu flushes the caches before each replay and fixes the clocks at
# base, so its durations read longer than the benchmark's): speed of light, occupancy, launch
# statistics, warp states, memory workload.
if [ "${GPU_CHECK_PROFILE:-0}" = 1 ] && [ -x "$CUDA_BENCH" ]; then
  NCU=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
  for T in ${GPU_CHECK_PROFILE_TOKENS:-1 64 4096 65536}; do
    run_step "ncu (T=$T)" "$LOGS/ncu.log" 200 \
      "$NCU" --kernel-name regex:rope_pool --launch-skip 300 --launch-count 1 \
        --section SpeedOfLight --section LaunchStats --section Occupancy \
        --section MemoryWorkloadAnalysis --section SchedulerStats --section WarpStateStats \
        "$CUDA_BENCH" --tokens $T
    NOTES[-1]="$(grep -E '^ +(Duration|DRAM Throughput|Achieved Occupancy)' "$LOGS/ncu.log" |
      tail -n 3 | awk '{print $1, $(NF)}' | paste -sd' ')"
  done
fi

# --- summary ------------------------------------------------------------------------------------
FAILED=0
for st in "${STATUS[@]}"; do case "$st" in PASS|SKIPPED) ;; *) FAILED=1 ;; esac; done
{
  echo
  echo "ropepool gpu_check: $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -n 1), $((SECONDS - START)) s total, logs in $LOGS"
  [ -f "$LOGS/selftest.log" ] && sed -n '/^=== CUDA C++ bench/,$p' "$LOGS/selftest.log" |
    grep -E '^(device-to-device|graph replay|host time| +(T|[0-9]+) )'
  # from the first table on (gpu_bench.py's, else gpu_bench_mla.py's), without the JSON lines
  [ -f "$LOGS/bench.log" ] && sed -n '/^ropepool GPU bench/,$p' "$LOGS/bench.log" | grep -v '^{'
  echo
  printf '%-52s %-14s %6s  %s\n' "step" "status" "sec" "note"
  for i in "${!NAMES[@]}"; do
    printf '%-52s %-14s %6s  %s\n' "${NAMES[$i]}" "${STATUS[$i]}" "${TIMES[$i]}" "${NOTES[$i]}"
  done
  [ $FAILED = 0 ] && echo "ALL PASSED" || echo "SOME STEPS FAILED"
} | tee -a "$LOGS/summary.txt"
exit $FAILED
