#!/bin/bash
# The GPU check: build kernels/ alone with CUDA (no other dependency), run
# the GPU tests against their CPU twins and the GPU benchmark.
#
# Where the GPU is (nvcc, CMake, ninja; no Debian packages needed):
#   bench/gpu_check.sh [OUT_DIR]            (default: $OUT, else /tmp/gpu-check)
# Before, on a machine with Debian's libgtest-dev, to carry GoogleTest along:
#   bench/gpu_check.sh --prepare            (copies it to third_party/googletest)
# Results: OUT_DIR/tests.txt, tests.xml, bench.txt (one JSON line a row).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "${1:-}" = "--prepare" ]; then
  rm -rf third_party/googletest
  mkdir -p third_party
  cp -r /usr/src/googletest third_party/googletest
  exit 0
fi
out=${1:-${OUT:-/tmp/gpu-check}}
mkdir -p "$out"
[ -d third_party/googletest ] || { echo "third_party/googletest is missing: run --prepare first" >&2; exit 2; }
export PATH=/usr/local/cuda/bin:$PATH
nvidia-smi > "$out/nvidia-smi.txt" 2>&1 || true
arch=${CUDA_ARCH:-90}
cmake -S . -B build-gpu -G Ninja -DCMAKE_BUILD_TYPE=Release -DPSTRAIN_KERNELS_ONLY=ON \
  -DPSTRAIN_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="$arch" > "$out/configure.log" 2>&1 ||
  { tail -30 "$out/configure.log"; exit 1; }
cmake --build build-gpu -j"$(nproc)" > "$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
status=0
build-gpu/bin/pstrain_kernel_tests --gtest_output=xml:"$out/tests.xml" > "$out/tests.txt" 2>&1 || status=1
grep -E "^\[ *(OK|FAILED|SKIPPED|PASSED) *\]" "$out/tests.txt" || true
build-gpu/bin/pstrain-gpu-bench 2>&1 | tee "$out/bench.txt" || status=1
exit $status
