#!/usr/bin/env bash
# Shows which vector instructions the hot loops were compiled to: for each
# function of the CPU kernels' element-wise files, how many instructions use
# 256-bit (ymm) registers, fused multiply-adds and packed square roots.
# The AVX2 clones ([clone .arch_x86_64_v3]) should have all three where the
# loop multiplies and adds; the baseline clones ([clone .default]) use SSE.
#   bench/check_simd.sh [BUILD_DIR]   (default: build)
set -euo pipefail
build=${1:-build}
for file in optimizers sums casts; do
  object=$(find "$build/kernels" -name "$file.cc.o" | head -n 1)
  if [[ -z "$object" ]]; then
    echo "check_simd: no $file.cc.o under $build/kernels (build pstrain_kernels first)" >&2
    exit 2
  fi
  echo "== kernels/cpu/$file.cc"
  objdump -d -C --no-show-raw-insn "$object" | awk '
    /^[0-9a-f]+ <.*>:$/ {
      name = $0
      sub(/^[0-9a-f]+ <(pstrain::kernels::)?(\(anonymous namespace\)::)?/, "", name)
      sub(/\(.*\) \[clone/, " [clone", name)
      sub(/>:$/, "", name)
      seen[name] = 1
    }
    /ymm/ { ymm[name]++ }
    /vfn?m(add|sub)/ { fma[name]++ }
    /sqrtps/ { roots[name]++ }
    END {
      for (n in seen) if (n ~ /clone \.(arch_x86_64_v3|default)\]/)
        printf "  %-44s ymm %4d  fma %4d  sqrtps %3d\n", n, ymm[n], fma[n], roots[n]
    }' | sort
done
