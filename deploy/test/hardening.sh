#!/bin/bash
# deploy/test/hardening.sh [--if-ci] [--fuzz-only] [--all-tests] [--fuzz-runs N] [--fuzz-seconds S]
#
# The hardening runs, in one clang build in build-hardening/ (PSTRAIN_CUDA=OFF):
#   build   clang 14 with AddressSanitizer + UndefinedBehaviorSanitizer over
#           everything built here, libFuzzer coverage, and the thread-safety
#           analysis of the ABSL_GUARDED_BY annotations as errors (-Werror=
#           thread-safety): a lock annotation broken anywhere fails the build;
#   fuzz    each libFuzzer target of tests/fuzz over its seed corpus
#           (tests/fuzz/corpus/TARGET), deterministically: -seed=1 and a
#           fixed -runs per target, so a CI run does what the last one did;
#           new inputs go to a scratch directory, not the repository;
#   tests   the unit, cluster and integration suites under the sanitizers
#           (ctest in build-hardening), but for the long tests (labels
#           cluster_long, integration_long), which the ordinary build runs.
# Any sanitizer report, fuzz crash, hang (-timeout) or test failure fails the
# run. Prints each fuzz target's executions and coverage (libFuzzer's final
# stats) at the end.
#
# --if-ci          skips (77) unless CI=true (how ctest runs it).
# --fuzz-only      builds the fuzz targets alone and runs only them.
# --all-tests      runs every test under the sanitizers, the long ones too.
# --fuzz-runs N    executions per target instead of each target's own count.
# --fuzz-seconds S a longer, random search: -max_total_time=S per target with
#                  a random seed (not for CI); crashes are written to
#                  build-hardening/fuzz-crashes/ — add each one to the
#                  target's corpus once fixed, as a regression input.
#
# Installs clang-14, libclang-rt-14-dev and llvm-14 (the symbolizer) if
# missing (root or sudo).
set -euo pipefail
cd "$(dirname "$0")/../.."
readonly SKIP=77

if_ci=false fuzz_only=false all_tests=false fuzz_runs="" fuzz_seconds=""
while [ $# -gt 0 ]; do
  case "$1" in
    --if-ci) if_ci=true ;;
    --fuzz-only) fuzz_only=true ;;
    --all-tests) all_tests=true ;;
    --fuzz-runs) fuzz_runs=$2; shift ;;
    --fuzz-seconds) fuzz_seconds=$2; shift ;;
    -h | --help) sed -n '2,/^[^#]/{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
    *) echo "hardening.sh: unknown argument $1" >&2; exit 2 ;;
  esac
  shift
done

started=$(date +%s)
log() { echo "[hardening $(($(date +%s) - started))s] $*"; }
if $if_ci && [ "${CI:-}" != true ]; then
  echo "hardening.sh: SKIPPED: runs in CI (CI=true), or as deploy/test/hardening.sh"
  exit $SKIP
fi

need=()
for package in clang-14 libclang-rt-14-dev llvm-14; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "install ok installed" ||
    need+=("$package")
done
if [ ${#need[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  log "installing ${need[*]}"
  export DEBIAN_FRONTEND=noninteractive
  $sudo apt-get update -qq
  $sudo apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi

build=build-hardening
# ccache and precompiled headers: the sloppiness ccache needs to cache files
# built with a PCH.
export CCACHE_BASEDIR=$PWD CCACHE_NOHASHDIR=1
export CCACHE_SLOPPINESS=pch_defines,time_macros,include_file_mtime,include_file_ctime
# -O1 for pstrain's code: fast enough to run the suites and the fuzz targets,
# quick enough to compile on 2 cores; -O0 for the tests' own files (half
# their compile time) and precompiled headers.
CC=clang-14 CXX=clang++-14 cmake -S . -B $build -G Ninja -DCMAKE_BUILD_TYPE=Debug \
  "-DCMAKE_CXX_FLAGS_DEBUG=-O1 -gline-tables-only" -DPSTRAIN_CUDA=OFF \
  -DPSTRAIN_SANITIZE=ON -DPSTRAIN_FUZZ=ON -DPSTRAIN_PCH=ON -DPSTRAIN_TEST_CXX_FLAGS=-O0 >/dev/null
targets=(pstrain_fuzz_targets)
$fuzz_only || targets+=(pstrain_unit_tests pstrain_cluster_tests pstrain_integration_tests)
log "building ${targets[*]}"
cmake --build $build -j"$(nproc)" --target "${targets[@]}"

export ASAN_OPTIONS=${ASAN_OPTIONS:-abort_on_error=1:detect_leaks=1:strict_string_checks=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
export LSAN_OPTIONS=${LSAN_OPTIONS:-suppressions=$PWD/deploy/test/lsan.supp:print_suppressions=0}
export ASAN_SYMBOLIZER_PATH=/usr/bin/llvm-symbolizer-14

# Executions per target in CI: about a minute each on one core of a 2-core
# machine. The targets run side by side, one per core (each is one process
# with its fixed -runs, so running beside another changes nothing but the
# time): about 4 minutes for the seven on 2 cores.
# click_file writes and reads a file for each input (~80 a second): 5000.
declare -A runs=(
  [checkpoint]=40000 [chunk_frame]=2100000 [click_file]=5000 [control_requests]=14500 [job_log]=120000
  [job_spec]=360000 [model_file]=1300000 [parameter_requests]=42000
  [sparse_requests]=60000
)
mkdir -p $build/fuzz-crashes

# fuzz TARGET: runs it into $build/fuzz-TARGET.log and, if it ran clean (no
# crash, sanitizer report, leak or hang), writes its line of stats to
# $build/fuzz-TARGET.stats.
fuzz() {
  local target=$1 scratch t0 execs cov
  scratch=$(mktemp -d)
  local args=(-timeout=60 -rss_limit_mb=4096 -print_final_stats=1
              -artifact_prefix=$build/fuzz-crashes/$target-)
  if [ -n "$fuzz_seconds" ]; then
    args+=(-max_total_time="$fuzz_seconds")
  else
    args+=(-seed=1 -runs="${fuzz_runs:-${runs[$target]}}")
  fi
  # The seeds as a list in a fixed order: libFuzzer reads a corpus directory
  # in the file system's order, which differs between machines, and so
  # would the whole run from the same seed.
  # (no newline after the last name: libFuzzer would take it as part of it).
  printf '%s' "$(find tests/fuzz/corpus/$target -type f | LC_ALL=C sort | paste -sd,)" \
    > $build/fuzz-$target.seeds
  args+=(-seed_inputs=@$build/fuzz-$target.seeds)
  log "fuzz $target: ${args[*]}"
  t0=$(date +%s)
  local status=0
  $build/bin/pstrain_fuzz_$target "${args[@]}" "$scratch" > $build/fuzz-$target.log 2>&1 || status=$?
  rm -rf "$scratch"
  if [ $status -ne 0 ]; then
    tail -50 $build/fuzz-$target.log
    echo "hardening.sh: FAILED: fuzz target $target (log: $build/fuzz-$target.log)" >&2
    return 1
  fi
  execs=$(sed -n 's/^stat::number_of_executed_units: *//p' $build/fuzz-$target.log)
  cov=$(grep -o 'cov: [0-9]*' $build/fuzz-$target.log | tail -1 | cut -d' ' -f2)
  printf '%-20s %9s execs %6s edges %4ss\n' "$target" "$execs" "$cov" $(($(date +%s) - t0)) \
    > $build/fuzz-$target.stats
}

targets=($(printf '%s\n' "${!runs[@]}" | sort))
for target in "${targets[@]}"; do
  while [ "$(jobs -rp | wc -l)" -ge "$(nproc)" ]; do sleep 1; done
  rm -f $build/fuzz-$target.stats
  fuzz "$target" &
done
wait
for target in "${targets[@]}"; do
  [ -f $build/fuzz-$target.stats ] || exit 1  # its failure is printed above
done
log "fuzz targets clean"
for target in "${targets[@]}"; do sed 's/^/  /' $build/fuzz-$target.stats; done

# The long tests (labels cluster_long and integration_long, listed in
# tests/CMakeLists.txt) are left out here, to keep CI within its time: the
# tests kept cover their code paths, and the ordinary build runs them;
# `--all-tests` runs them here too.
if ! $fuzz_only; then
  log "unit, cluster and integration suites under ASan+UBSan"
  labels='^(unit|cluster|integration)$'
  $all_tests && labels='^(unit|cluster|integration)(_long)?$'
  ctest --test-dir $build --output-on-failure -j"$(nproc)" -L "$labels"
fi
log "done"
