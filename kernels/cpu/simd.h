// Run-time choice of vector instructions for the CPU's hot loops.
#ifndef PSTRAIN_KERNELS_CPU_SIMD_H_
#define PSTRAIN_KERNELS_CPU_SIMD_H_

// On x86-64 a function so marked is compiled for x86-64-v3 (AVX2, FMA:
// Intel since Haswell, AMD since Zen) and for the baseline, and the dynamic
// loader binds the one the CPU supports (GCC target_clones). The level is
// chosen by the CPU's features: "arch=haswell" would be chosen by its model,
// and an AMD CPU would run the baseline. Elsewhere: compiled once.
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define PSTRAIN_SIMD_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define PSTRAIN_SIMD_CLONES
#endif

// For a loop body shared by cloned functions: GCC inlines a function into
// a clone of another architecture only when told to, and a call out of the
// AVX2 clone would run the baseline code.
#if defined(__GNUC__)
#define PSTRAIN_INLINE_LOOP inline __attribute__((always_inline))
#else
#define PSTRAIN_INLINE_LOOP inline
#endif

#endif  // PSTRAIN_KERNELS_CPU_SIMD_H_
