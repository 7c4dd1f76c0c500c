#!/usr/bin/env bash
# Builds TensorFerry under sanitizers and runs the tests; no GPU needed (CUDA is off).
#   1. ASan + UBSan (preset "asan", build-asan): the whole ctest suite. Every report is fatal.
#   2. TSan (preset "tsan", build-tsan): the multithreaded tests: the loader's host pipeline,
#      the writer's block pipeline and staging pool, the concurrent-reader and
#      truncation-race tests, and the remote sources and S3 sink against their test servers.
# Exits non-zero on the first failure.
#   tests/run_sanitizers.sh [asan|tsan|all]     (default: all)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"
JOBS="$(nproc)"
WHAT="${1:-all}"
# Death tests and aborting sanitizers must not leave core files behind.
ulimit -c 0

section() { printf '\n==== %s (%s)\n' "$1" "$(date -u +%H:%M:%S)"; }

run_asan() {
  section "ASan+UBSan: configure and build"
  cmake --preset asan >/dev/null
  cmake --build build-asan -j "$JOBS"
  section "ASan+UBSan: ctest"
  export ASAN_OPTIONS="abort_on_error=1:detect_leaks=1:detect_stack_use_after_return=1:strict_string_checks=1:check_initialization_order=1"
  export UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1"
  # find_package_consumer builds a separate project against the installed, instrumented
  # library; CMake takes these for that project's first configure, so it links the runtime.
  export CXXFLAGS="-fsanitize=address,undefined" LDFLAGS="-fsanitize=address,undefined"
  (cd build-asan && ctest --output-on-failure -j "$JOBS" --timeout 1500)
  unset CXXFLAGS LDFLAGS
}

run_tsan() {
  section "TSan: configure and build"
  cmake --preset tsan >/dev/null
  cmake --build build-tsan -j "$JOBS" --target loader_test fault_test format_test save_test \
    remote_test
  section "TSan: multithreaded tests"
  export TSAN_OPTIONS="halt_on_error=1:second_deadlock_stack=1:suppressions=$ROOT/tests/tsan.supp"
  build-tsan/tests/loader_test --gtest_filter='LoaderTest.*'
  # Forking tests are left out: TSan does not support fork() from a multithreaded process.
  build-tsan/tests/fault_test \
    --gtest_filter='FaultTest.ManyThreads*:FaultTest.*SignalStorm*:TruncationTest.ConcurrentTruncationRace:TruncationTest.Every*'
  build-tsan/tests/format_test
  # The writer's block pipeline: encode workers, in-order writes, staging pool, progress calls.
  build-tsan/tests/save_test --gtest_filter='SaveTest.*:StagingPoolTest.*'
  # Remote sources and the S3 sink: the libcurl thread, concurrent readers, the upload thread
  # (the binary starts its own servers; the forking test is left out).
  build-tsan/tests/remote_test --gtest_filter='-S3SinkTest.AKilledSaveLeavesThePreviousObject'
}

start=$SECONDS
# Same packages as the normal build (gcc brings libasan, libubsan and libtsan with it).
bash "$ROOT/tests/install_deps.sh"
case "$WHAT" in
  asan) run_asan ;;
  tsan) run_tsan ;;
  all) run_asan; run_tsan ;;
  *) echo "usage: $0 [asan|tsan|all]" >&2; exit 2 ;;
esac
section "sanitizers passed in $((SECONDS - start)) s"
