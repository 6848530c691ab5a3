/*
 * AVX-512F float64 GEMM tile: up to 8 tokens x 24 weight rows.
 *
 * Layout: the 24 rows of a packed panel are three zmm vectors per k
 * (Wp[k, 0..23]); each token's X[t, k] is broadcast from memory (folded into
 * the FMA as {1to8}); 24 accumulators (8 tokens x 3 vectors), 3 weight
 * vectors: 27 of the 32 zmm registers. Per k: 3 vector loads, 8 broadcasts,
 * 24 FMAs.
 *
 * Invariants (dgemm_internal.h, invariant 1):
 *  1. Lane j of accumulator (t, v) holds output (t, 8v + j) alone and takes
 *     one vfmadd231pd per k in index order: the scalar fma chain, bit for bit
 *     (no reassociation, no horizontal sums). The tile's position, mr, nr,
 *     the K block and the thread change nothing.
 *  2. Rows past nr are masked on the load of Y's partial sums and on the
 *     store; their lanes compute with the panel's zero padding and are
 *     dropped. Tokens past mr are never read.
 *  3. No allocation.
 * Needs AVX-512F and FMA (the avx512 kernel table's CPU check covers both).
 */
#include "linalg/dgemm_internal.h"

#include <immintrin.h>

#define TGT __attribute__((target("avx512f,fma")))

enum { MR = 8, NR = 24, NV = NR / 8 };

static inline __attribute__((always_inline)) TGT void tile_body(const int mr, int64_t kc, const double *Wp,
                                                              const double *X, int64_t ldx, double *Y,
                                                              int64_t ldy, int nr, bool first) {
    __mmask8 m[NV];
    for (int v = 0; v < NV; v++) {
        int rem = nr - 8 * v;
        m[v] = (__mmask8)(rem >= 8 ? 0xFF : rem <= 0 ? 0 : (1u << rem) - 1u);
    }
    __m512d acc[MR][NV];
#pragma GCC unroll 8
    for (int t = 0; t < mr; t++)
#pragma GCC unroll 3
        for (int v = 0; v < NV; v++)
            acc[t][v] = first ? _mm512_setzero_pd() : _mm512_maskz_loadu_pd(m[v], Y + t * ldy + 8 * v);
    const double *xp[MR];
#pragma GCC unroll 8
    for (int t = 0; t < mr; t++) xp[t] = X + t * ldx;
    for (int64_t k = 0; k < kc; k++) {
        const double *wk = Wp + k * NR;
        __m512d w0 = _mm512_load_pd(wk), w1 = _mm512_load_pd(wk + 8), w2 = _mm512_load_pd(wk + 16);
#pragma GCC unroll 8
        for (int t = 0; t < mr; t++) {
            __m512d x = _mm512_set1_pd(xp[t][k]);
            acc[t][0] = _mm512_fmadd_pd(x, w0, acc[t][0]);
            acc[t][1] = _mm512_fmadd_pd(x, w1, acc[t][1]);
            acc[t][2] = _mm512_fmadd_pd(x, w2, acc[t][2]);
        }
    }
#pragma GCC unroll 8
    for (int t = 0; t < mr; t++)
#pragma GCC unroll 3
        for (int v = 0; v < NV; v++) _mm512_mask_storeu_pd(Y + t * ldy + 8 * v, m[v], acc[t][v]);
}

/* One function per token count: each gets its own register allocation. */
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
TILE_MR(7)
TILE_MR(8)

static void tile_avx512(int64_t kc, const double *Wp, const double *X, int64_t ldx, int mr, double *Y,
                        int64_t ldy, int nr, bool first) {
    switch (mr) {
    case 8: tile_8(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    case 7: tile_7(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    case 6: tile_6(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    case 5: tile_5(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    case 4: tile_4(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    case 3: tile_3(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    case 2: tile_2(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    default: tile_1(kc, Wp, X, ldx, Y, ldy, nr, first); return;
    }
}

static const moe_dgemm_kernel avx512_kernel = {"avx512", MR, NR, tile_avx512};

const moe_dgemm_kernel *moe_dgemm_avx512(void) { return &avx512_kernel; }
