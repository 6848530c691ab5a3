/*
 * AVX2 + FMA float64 GEMM tile: up to 6 tokens x 8 weight rows.
 *
 * Layout: the 8 rows of a packed panel are two ymm vectors per k; each
 * token's X[t, k] is broadcast (vbroadcastsd); 12 accumulators (6 tokens x
 * 2 vectors), 2 weight vectors and 1 broadcast: 15 of the 16 ymm registers.
 * Per k: 2 vector loads, 6 broadcasts, 12 FMAs.
 *
 * Invariants (dgemm_internal.h, invariant 1):
 *  1. Lane j of accumulator (t, v) holds output (t, 4v + j) alone and takes
 *     one vfmadd231pd per k in index order: the scalar fma chain, bit for bit.
 *  2. Rows past nr are masked (vmaskmovpd) on the load of Y's partial sums
 *     and on the store; tokens past mr are never read.
 *  3. No allocation.
 * Needs AVX2 and FMA (the avx2 kernel table's CPU check covers both).
 */
#include "linalg/dgemm_internal.h"

#include <immintrin.h>

#define TGT __attribute__((target("avx2,fma")))

enum { MR = 6, NR = 8, NV = NR / 4 };

static inline __attribute__((always_inline)) TGT void tile_body(const int mr, int64_t kc, const double *Wp,
                                                              const double *X, int64_t ldx, double *Y,
                                                              int64_t ldy, int nr, bool first) {
    __m256i m[NV];
    for (int v = 0; v < NV; v++) {
        int rem = nr - 4 * v;
        m[v] = _mm256_set_epi64x(rem > 3 ? -1 : 0, rem > 2 ? -1 : 0, rem > 1 ? -1 : 0, rem > 0 ? -1 : 0);
    }
    __m256d acc[MR][NV];
#pragma GCC unroll 6
    for (int t = 0; t < mr; t++)
#pragma GCC unroll 2
        for (int v = 0; v < NV; v++)
            acc[t][v] = first ? _mm256_setzero_pd() : _mm256_maskload_pd(Y + t * ldy + 4 * v, m[v]);
    const double *xp[MR];
#pragma GCC unroll 6
    for (int t = 0; t < mr; t++) xp[t] = X + t * ldx;
    for (int64_t k = 0; k < kc; k++) {
        const double *wk = Wp + k * NR;
        __m256d w0 = _mm256_load_pd(wk), w1 = _mm256_load_pd(wk + 4);
#pragma GCC unroll 6
        for (int t = 0; t < mr; t++) {
            __m256d x = _mm256_broadcast_sd(xp[t] + k);
            acc[t][0] = _mm256_fmadd_pd(x, w0, acc[t][0]);
            acc[t][1] = _mm256_fmadd_pd(x, w1, acc[t][1]);
        }
    }
#pragma GCC unroll 6
    for (int t = 0; t < mr; t++)
#pragma GCC unroll 2
        for (int v = 0; v < NV; v++) _mm256_maskstore_pd(Y + t * ldy + 4 * v, m[v], acc[t][v]);
}

#define TILE_MR(n)                                                                                              \
    static TGT __attribute__((noinline)) void tile_##n(int64_t kc, const double *Wp, const double *X,           \
                                                       int64_t ldx, double *Y, int64_t ldy, int nr, bool first) { \
        tile_body(n, kc, Wp, X, ldx, Y, ldy, nr, first);                                                        \
    }
TILE_MR(1)
TILE_MR(2)
TILE_MR(3)
TILE_MR(4)
TILE_MR(5)
TILE_MR(6)

static void tile_avx2(int64_t kc, const double *Wp, const double *X, int64_t ldx, int mr, double *Y, int64_t ldy,
                      int nr, bool first) {
    switch (mr) {
    case 6: tile_6(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    case 5: tile_5(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    case 4: tile_4(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    case 3: tile_3(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    case 2: tile_2(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    default: tile_1(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    }
}

static const moe_dgemm_kernel avx2_kernel = {"avx2", MR, NR, tile_avx2, moe_dgemm_pack, moe_dgemm_pack_ptrs};

const moe_dgemm_kernel *moe_dgemm_avx2(void) { return &avx2_kernel; }
