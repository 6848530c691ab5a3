/*
 * moe_linear_f64 / moe_linear_f32: the dense linears of the whole model (see
 * linear.h).
 *
 * float64: a blocked GEMM with on-the-fly dequantization.
 *   The work is cut into items: a block of weight rows (at most 72, whole
 *   register panels) x a block of tokens (whole tiles; all T unless the
 *   weight has too few rows to feed every thread). OpenMP threads take items
 *   dynamically. Per item, for each K block of 1024 columns in order:
 *     1. decode that block of the item's rows to float64 into the thread's
 *        workspace, packed in panels of NR rows, k-major (pack.c: exactly
 *        moe_weight_row_f64's values);
 *     2. for each tile of MR tokens, for each panel: the ISA's register tile
 *        (linalg_internal.h) continues each output's fma chain over the block.
 *   Summation order: Y[t, r] = fma(X[t, cols-1], W[r, cols-1], ... fma(X[t, 1],
 *   W[r, 1], fma(X[t, 0], W[r, 0], +0.0))): one correctly rounded fused
 *   multiply-add per term, in index order, from +0.0. The partial sum is
 *   parked in Y between K blocks (exact), so neither the K blocking, nor the
 *   tile sizes, nor the item a row or token falls in, nor the ISA, nor the
 *   thread changes a bit. Cache use: the packed block (<= 576 KiB) stays in
 *   L2 across all tokens of the item; a tile's X rows (MR x 1024 doubles)
 *   are read from L2 by the block's panels.
 *
 * float32: the CPU kernel table's gemm (src/cpu/kernels.h) over the same
 * kind of items (rows in multiples of 16, balanced), each item calling it
 * on token sub-blocks whose activations fit 192 KiB; kernel contract 2 makes
 * the result independent of the split.
 *
 * Invariants:
 *  1. Every output element is written by exactly one item, through the
 *     sequence above; no reduction crosses threads.
 *  2. The workspace is allocated once per call, before Y is touched: an
 *     allocation failure returns MOE_ERR_NOMEM with Y unchanged.
 *  3. No global mutable state; the ISA comes from the table passed in.
 */
#include "linalg/linear.h"

#include "core/core.h"
#include "linalg/linalg_internal.h"

#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

enum {
    KC = MOE_DGEMM_KC,         /* columns per K block */
    ROWS_MAX = MOE_DGEMM_ROWS, /* weight rows per item at most (576 KiB packed) */
    F32_ROWS = 64              /* float32: target weight rows per item */
};

static int max_threads(void) {
#ifdef _OPENMP
    return omp_in_parallel() ? 1 : omp_get_max_threads();
#else
    return 1;
#endif
}

static int thread_id(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

const char *moe_linear_f64_isa(const moe_cpu_kernels *k) { return moe_dgemm_for(moe_dgemm_table(k))->isa; }

/*
 * The item grid: rows in n_rb blocks of whole units of `ru` rows (balanced:
 * block i holds units [i U / n_rb, (i+1) U / n_rb)), tokens in n_tb blocks of
 * whole units of `tu` tokens. Row blocks hold at most `rmax` rows; a multiple
 * of nth of them so that threads get equal shares; tokens are split only when
 * there are fewer than 2 nth row blocks.
 */
typedef struct grid {
    int64_t ru, tu, nru, ntu; /* unit sizes and counts */
    int64_t n_rb, n_tb;
} grid;

static grid make_grid(int64_t rows, int64_t T, int64_t ru, int64_t tu, int64_t rmax, int nth) {
    grid g = {ru, tu, cdiv(rows, ru), cdiv(T, tu), 0, 1};
    int64_t umax = rmax / ru > 0 ? rmax / ru : 1;
    g.n_rb = nth * cdiv(g.nru, (int64_t)nth * umax);
    if (g.n_rb > g.nru) g.n_rb = g.nru;
    if (g.n_rb < 2 * nth) {
        g.n_tb = cdiv(2 * nth, g.n_rb);
        if (g.n_tb > g.ntu) g.n_tb = g.ntu;
    }
    return g;
}

/* Item i's rows [*r0, *r1) and tokens [*t0, *t1). */
static void grid_item(const grid *g, int64_t i, int64_t rows, int64_t T, int64_t *r0, int64_t *r1, int64_t *t0,
                      int64_t *t1) {
    int64_t rb = i / g->n_tb, tb = i % g->n_tb;
    *r0 = rb * g->nru / g->n_rb * g->ru;
    *r1 = (rb + 1) * g->nru / g->n_rb * g->ru;
    if (*r1 > rows) *r1 = rows;
    *t0 = tb * g->ntu / g->n_tb * g->tu;
    *t1 = (tb + 1) * g->ntu / g->n_tb * g->tu;
    if (*t1 > T) *t1 = T;
}

/* The largest row count of any item of g. */
static int64_t grid_rows_max(const grid *g) { return cdiv(g->nru, g->n_rb) * g->ru; }

moe_status moe_linear_f64_with(const moe_cpu_kernels *k, const moe_weight *w, const double *X, int64_t ldx,
                               int64_t T, double *Y, int64_t ldy, moe_error *err) {
    MOE_ASSERT(w && (T == 0 || (X && Y)) && T >= 0 && ldx >= w->cols && ldy >= w->rows);
    if (T == 0 || w->rows == 0) return MOE_OK;
    const int64_t rows = w->rows, cols = w->cols;
    if (cols == 0) {
        for (int64_t t = 0; t < T; t++)
            for (int64_t r = 0; r < rows; r++) Y[t * ldy + r] = 0.0;
        return MOE_OK;
    }
    const moe_dgemm_kernel *kr = moe_dgemm_for(moe_dgemm_table(k));
    const int nth = max_threads();
    const grid g = make_grid(rows, T, kr->nr, kr->mr, ROWS_MAX, nth);
    const int64_t n_items = g.n_rb * g.n_tb;
    /* one packed block per thread, 64-byte aligned */
    size_t per = (size_t)(grid_rows_max(&g) * KC) * sizeof(double);
    per = (per + 63) & ~(size_t)63;
    uint64_t total;
    double *ws = NULL;
    if (moe_mul_ok(per, (uint64_t)nth, &total) && total <= SIZE_MAX) ws = aligned_alloc(64, (size_t)total);
    if (!ws)
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory for the decode workspace of weight %s (%d threads x %zu bytes)",
                        w->name ? w->name : "(unnamed)", nth, per);
    const moe_dgemm_src src = {w, NULL, false, cols};
#pragma omp parallel num_threads(nth)
    {
        double *Wp = (double *)((char *)ws + per * (size_t)thread_id());
#pragma omp for schedule(dynamic, 1)
        for (int64_t i = 0; i < n_items; i++) {
            int64_t r0, r1, t0, t1;
            grid_item(&g, i, rows, T, &r0, &r1, &t0, &t1);
            if (r0 < r1 && t0 < t1) moe_dgemm_block(kr, &src, r0, r1, t0, t1, X, ldx, Y, ldy, Wp);
        }
    }
    free(ws);
    return MOE_OK;
}

size_t moe_linear_f64_workspace(void) { return (size_t)ROWS_MAX * KC * sizeof(double) + 64; }

size_t moe_linear_f64_workspace_for(int64_t rows, int64_t cols) {
    MOE_ASSERT(rows >= 0 && cols >= 0);
    int64_t r = (rows + MOE_DGEMM_NR_MAX - 1) / MOE_DGEMM_NR_MAX * MOE_DGEMM_NR_MAX;
    if (r > ROWS_MAX) r = ROWS_MAX;
    int64_t c = cols < KC ? cols : KC;
    return (size_t)(r * c) * sizeof(double) + 64; /* + 64: the alignment of Wp */
}

void moe_linear_f64_ws(const moe_cpu_kernels *k, const moe_weight *w, const double *X, int64_t ldx, int64_t T,
                       double *Y, int64_t ldy, void *ws) {
    MOE_ASSERT(w && (T == 0 || (X && Y)) && T >= 0 && ldx >= w->cols && ldy >= w->rows && ws);
    if (T == 0 || w->rows == 0) return;
    const int64_t rows = w->rows;
    if (w->cols == 0) {
        for (int64_t t = 0; t < T; t++)
            for (int64_t r = 0; r < rows; r++) Y[t * ldy + r] = 0.0;
        return;
    }
    const moe_dgemm_kernel *kr = moe_dgemm_for(moe_dgemm_table(k));
    double *Wp = (double *)(((uintptr_t)ws + 63) & ~(uintptr_t)63);
    const moe_dgemm_src src = {w, NULL, false, w->cols};
    for (int64_t r0 = 0; r0 < rows; r0 += ROWS_MAX)
        moe_dgemm_block(kr, &src, r0, rows - r0 < ROWS_MAX ? rows : r0 + ROWS_MAX, 0, T, X, ldx, Y, ldy, Wp);
}

moe_status moe_linear_f64(const moe_weight *w, const double *X, int64_t ldx, int64_t T, double *Y, int64_t ldy,
                          moe_error *err) {
    return moe_linear_f64_with(NULL, w, X, ldx, T, Y, ldy, err);
}

moe_status moe_linear_f32_with(const moe_cpu_kernels *k, const moe_weight *w, const float *X, int64_t ldx,
                               int64_t T, float *Y, int64_t ldy, moe_error *err) {
    MOE_ASSERT(w && (T == 0 || (X && Y)) && T >= 0 && ldx >= w->cols && ldy >= w->rows);
    (void)err;
    if (T == 0 || w->rows == 0) return MOE_OK;
    const moe_cpu_kernels *kt = moe_dgemm_table(k);
    const int64_t rows = w->rows;
    const int nth = max_threads();
    /* token units of 32: the kernels' token tile, so a split never adds a pass */
    const grid g = make_grid(rows, T, 16, 32, F32_ROWS, nth);
    const int64_t n_items = g.n_rb * g.n_tb;
    /* tokens per kernel call: the call's activations (nsub x cols floats)
     * stay within 192 KiB of L2 while its rows pass over them */
    int64_t nsub = (int64_t)(192 * 1024 / 4) / (w->cols > 0 ? w->cols : 1);
    nsub = nsub < 4 ? 4 : nsub > 32 ? 32 : nsub / 4 * 4;
#pragma omp parallel for num_threads(nth) schedule(dynamic, 1)
    for (int64_t i = 0; i < n_items; i++) {
        int64_t r0, r1, t0, t1;
        grid_item(&g, i, rows, T, &r0, &r1, &t0, &t1);
        for (int64_t t = t0; t < t1 && r0 < r1; t += nsub) {
            int64_t n = t1 - t < nsub ? t1 - t : nsub;
            kt->gemm(w, r0, r1, X + t * ldx, ldx, n, Y + t * ldy + r0, ldy);
        }
    }
    return MOE_OK;
}

moe_status moe_linear_f32(const moe_weight *w, const float *X, int64_t ldx, int64_t T, float *Y, int64_t ldy,
                          moe_error *err) {
    return moe_linear_f32_with(NULL, w, X, ldx, T, Y, ldy, err);
}
