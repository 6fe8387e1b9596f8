// Hot loops compiled for the wider vector units too and chosen at load time (GCC's
// target_clones: AVX-512, AVX2, and the baseline for other CPUs). The quantization sources are
// built with -ffp-contract=off, so every clone does the same IEEE operations in the same order
// (no fused multiply-adds) and writes the same bytes.
#pragma once

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define FASTOPT_VECTOR_CLONES __attribute__((target_clones("avx512f", "avx2", "default")))
#else
#define FASTOPT_VECTOR_CLONES
#endif

// For the helpers of those loops: inlined into each clone, so compiled for its vector unit (a
// helper left out of line is compiled once, for the baseline).
#if defined(__GNUC__)
#define FASTOPT_INLINE __attribute__((always_inline)) inline
#else
#define FASTOPT_INLINE inline
#endif
