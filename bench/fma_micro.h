/*
 * The fp32 FMA micro-kernels of the bench's compute peaks: the MoE bench's
 * (bench/bench.c, the experts' fp32 floor) and the dense linears' (bench/
 * bench_linear.c): one definition, so both floors measure the same loops.
 * A and B stay in L1; each returns the flops it did (2 per multiply-add).
 */
#ifndef MOE_BENCH_FMA_MICRO_H
#define MOE_BENCH_FMA_MICRO_H

#include <immintrin.h>

/* C[8, 32] += A[8, K] . B[K, 32]: 16 accumulators, 2 loads + 8 broadcasts
 * per 16 FMAs. A and B stay in L1. Returns flops done. */
__attribute__((target("avx512f,fma"))) static inline double bench_micro_f32_avx512(const float *A, const float *B,
                                                                                  float *C, int K, int reps) {
    for (int r = 0; r < reps; r++) {
        __m512 c[8][2];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) c[i][0] = c[i][1] = _mm512_setzero_ps();
        for (int k = 0; k < K; k++) {
            __m512 b0 = _mm512_load_ps(B + k * 32), b1 = _mm512_load_ps(B + k * 32 + 16);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                __m512 a = _mm512_set1_ps(A[i * K + k]);
                c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
                c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            _mm512_store_ps(C + i * 32, _mm512_add_ps(_mm512_load_ps(C + i * 32), c[i][0]));
            _mm512_store_ps(C + i * 32 + 16, _mm512_add_ps(_mm512_load_ps(C + i * 32 + 16), c[i][1]));
        }
    }
    return 2.0 * 8 * 32 * K * (double)reps;
}

/* C[6, 16] += A[6, K] . B[K, 16] with 8-lane FMAs: 12 accumulators (the most
 * 16 YMM registers leave room for: 2 B vectors, 1 broadcast), 2 loads + 6
 * broadcasts per 12 FMAs; A and B in L1. Returns flops done. */
__attribute__((target("avx2,fma"))) static inline double bench_micro_f32_avx2(const float *A, const float *B, float *C,
                                                                             int K, int reps) {
    for (int r = 0; r < reps; r++) {
        __m256 c[6][2];
#pragma GCC unroll 6
        for (int i = 0; i < 6; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
        for (int k = 0; k < K; k++) {
            __m256 b0 = _mm256_load_ps(B + k * 16), b1 = _mm256_load_ps(B + k * 16 + 8);
#pragma GCC unroll 6
            for (int i = 0; i < 6; i++) {
                __m256 a = _mm256_broadcast_ss(A + i * K + k);
                c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
                c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
            }
        }
#pragma GCC unroll 6
        for (int i = 0; i < 6; i++) {
            _mm256_store_ps(C + i * 16, _mm256_add_ps(_mm256_load_ps(C + i * 16), c[i][0]));
            _mm256_store_ps(C + i * 16 + 8, _mm256_add_ps(_mm256_load_ps(C + i * 16 + 8), c[i][1]));
        }
    }
    return 2.0 * 6 * 16 * K * (double)reps;
}

#endif
