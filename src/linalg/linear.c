/*
 * moe_linear_f64: the float64 dense linear (see linear.h).
 *
 * Invariants:
 *  1. Each output Y[t, r] is summed in index order k = 0 .. cols-1 as
 *     s = s + x * w (two roundings; -ffp-contract=off), starting from 0.
 *     moe_linear_f32 does the same in float32 on moe_weight_row_f32's values.
 *  2. Rows of W are decoded once per call by moe_weight_row_f64 (the value
 *     definition) into a per-thread buffer; the split over threads is by
 *     output row, so no thread count changes a bit.
 */
#include "core/core.h"
#include "linalg/linear.h"

#include <stdlib.h>

moe_status moe_linear_f64(const moe_weight *w, const double *X, int64_t ldx, int64_t T, double *Y, int64_t ldy,
                          moe_error *err) {
    MOE_ASSERT(w && (T == 0 || (X && Y)) && T >= 0 && ldx >= w->cols && ldy >= w->rows);
    if (T == 0 || w->rows == 0) return MOE_OK;
    const int64_t rows = w->rows, cols = w->cols;
    int failed = 0;
#pragma omp parallel
    {
        double *row = moe_malloc((size_t)(cols > 0 ? cols : 1), sizeof *row);
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!row) continue;
            moe_weight_row_f64(w, r, row);
            for (int64_t t = 0; t < T; t++) {
                const double *x = X + t * ldx;
                double s = 0.0;
                for (int64_t k = 0; k < cols; k++) s += x[k] * row[k];
                Y[t * ldy + r] = s;
            }
        }
        free(row);
    }
    if (failed)
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory decoding weight %s (%lld columns)",
                        w->name ? w->name : "(unnamed)", (long long)cols);
    return MOE_OK;
}

moe_status moe_linear_f32(const moe_weight *w, const float *X, int64_t ldx, int64_t T, float *Y, int64_t ldy,
                          moe_error *err) {
    MOE_ASSERT(w && (T == 0 || (X && Y)) && T >= 0 && ldx >= w->cols && ldy >= w->rows);
    if (T == 0 || w->rows == 0) return MOE_OK;
    const int64_t rows = w->rows, cols = w->cols;
    int failed = 0;
#pragma omp parallel
    {
        float *row = moe_malloc((size_t)(cols > 0 ? cols : 1), sizeof *row);
        if (!row) {
#pragma omp atomic write
            failed = 1;
        }
#pragma omp for schedule(static)
        for (int64_t r = 0; r < rows; r++) {
            if (!row) continue;
            moe_weight_row_f32(w, r, row);
            for (int64_t t = 0; t < T; t++) {
                const float *x = X + t * ldx;
                float s = 0.0f;
                for (int64_t k = 0; k < cols; k++) s += x[k] * row[k];
                Y[t * ldy + r] = s;
            }
        }
        free(row);
    }
    if (failed)
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory decoding weight %s (%lld columns)",
                        w->name ? w->name : "(unnamed)", (long long)cols);
    return MOE_OK;
}
