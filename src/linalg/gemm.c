/*
 * moe_gemm_f64_rows / _cols (gemm.h): the block driver of dgemm.c over
 * vectors given by pointer, one thread, the caller's workspace.
 *
 * Invariants:
 *  1. Outputs are cut into blocks of MOE_DGEMM_ROWS in order; each block
 *     runs every K block in order (dgemm.c), so every output is the fma
 *     chain of gemm.h whatever N, T or the block it falls in.
 *  2. No allocation, no threads, no global state.
 */
#include "linalg/gemm.h"

#include "core/core.h"
#include "linalg/linalg_internal.h"

size_t moe_gemm_f64_workspace(void) { return (size_t)MOE_DGEMM_ROWS * MOE_DGEMM_KC * sizeof(double); }

static void run(const moe_cpu_kernels *k, const double *X, int64_t ldx, int64_t T, const double *const *v,
                bool by_cols, int64_t N, int64_t K, double *Y, int64_t ldy, void *ws) {
    MOE_ASSERT(T >= 0 && N >= 0 && K >= 0 && ldx >= K && ldy >= N);
    MOE_ASSERT(((uintptr_t)ws & 63) == 0);
    if (T == 0 || N == 0) return;
    if (K == 0) {
        for (int64_t t = 0; t < T; t++)
            for (int64_t n = 0; n < N; n++) Y[t * ldy + n] = 0.0;
        return;
    }
    const moe_dgemm_kernel *kr = moe_dgemm_for(moe_dgemm_table(k));
    const moe_dgemm_src src = {NULL, v, by_cols, K};
    for (int64_t r0 = 0; r0 < N; r0 += MOE_DGEMM_ROWS) {
        int64_t r1 = N - r0 < MOE_DGEMM_ROWS ? N : r0 + MOE_DGEMM_ROWS;
        moe_dgemm_block(kr, &src, r0, r1, 0, T, X, ldx, Y, ldy, (double *)ws);
    }
}

void moe_gemm_f64_rows(const moe_cpu_kernels *k, const double *X, int64_t ldx, int64_t T,
                       const double *const *rows, int64_t N, int64_t K, double *Y, int64_t ldy, void *ws) {
    run(k, X, ldx, T, rows, false, N, K, Y, ldy, ws);
}

void moe_gemm_f64_cols(const moe_cpu_kernels *k, const double *X, int64_t ldx, int64_t T,
                       const double *const *cols, int64_t K, int64_t N, double *Y, int64_t ldy, void *ws) {
    run(k, X, ldx, T, cols, true, N, K, Y, ldy, ws);
}
