/*
 * Dense linear layers of the whole model (attention projections, compressors,
 * indexer, mHC, LM head): Y = X W^T with the weight decoded on the fly from its
 * stored format (BF16, FP8 blocks, MXFP4, NVFP4, ...), never materialised.
 *
 * Contract:
 *  1. Values: W[r, k] is exactly moe_weight_row_f64(w, r)[k].
 *  2. Deterministic: every Y element is produced by one fixed sequence of
 *     float64 operations, whatever T, the other rows of X and the thread count
 *     (the header of linear.c states the order).
 *  3. Never allocates more than a per-call workspace of its own; never prints.
 */
#ifndef MOE_LINALG_LINEAR_H
#define MOE_LINALG_LINEAR_H

#include "moeaudit.h"

/*
 * Y[t, r] = sum_k X[t, k] * W[r, k]   for t < T, r < w->rows
 *   X: [T, ldx] float64, the first w->cols columns used
 *   Y: [T, ldy] float64, the first w->rows columns written
 * MOE_ERR_NOMEM when the decode workspace cannot be allocated.
 */
moe_status moe_linear_f64(const moe_weight *w, const double *X, int64_t ldx, int64_t T, double *Y, int64_t ldy,
                          moe_error *err);

/*
 * The same product in float32: X and Y float32, W decoded exactly to float
 * (moe_weight_row_f32), each Y element summed in index order in float32.
 * The float32 fast path of the whole model; the CPU kernels replace the loop.
 */
moe_status moe_linear_f32(const moe_weight *w, const float *X, int64_t ldx, int64_t T, float *Y, int64_t ldy,
                          moe_error *err);

#endif
