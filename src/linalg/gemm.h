/*
 * Float64 products of plain vectors given by pointer, for the inner loops of
 * attention: scores of queries against gathered keys, and the weighted sum
 * of gathered values. The same register tiles and the same summation order
 * as moe_linear_f64 (linear.h, contract 2): each output is one fma chain over
 * k in index order from +0.0, the same bits on every ISA and whatever T or
 * the other rows of X.
 *
 * Single-threaded and allocation-free: callers thread over queries (each
 * thread its own workspace) and size the workspace with
 * moe_gemm_f64_workspace(). Thread safety: reentrant.
 */
#ifndef MOE_LINALG_GEMM_H
#define MOE_LINALG_GEMM_H

#include "moeaudit.h"
#include "cpu/kernels.h"

/* Bytes of workspace the functions below need (one packed block). */
size_t moe_gemm_f64_workspace(void);

/*
 * "rows": Y[t, n] = sum_{k < K} X[t, k] * rows[n][k]     t < T, n < N
 *   X: [T, ldx], rows: N pointers to K doubles each (keys), Y: [T, ldy]
 * e.g. scores of the heads of one query (X = q [heads, head_dim]) against
 * the window rows and the selected compressed entries.
 *   k: ISA table (moe_cpu_table; NULL = MOE_ISA_AUTO's); ws: moe_gemm_f64_workspace()
 *   bytes, 64-byte aligned, not shared with another thread during the call.
 */
void moe_gemm_f64_rows(const moe_cpu_kernels *k, const double *X, int64_t ldx, int64_t T,
                       const double *const *rows, int64_t N, int64_t K, double *Y, int64_t ldy, void *ws);

/*
 * "cols": Y[t, n] = sum_{k < K} X[t, k] * cols[k][n]     t < T, n < N
 *   X: [T, ldx], cols: K pointers to N doubles each (values), Y: [T, ldy]
 * e.g. the attention output of each head (X = probabilities [heads, K
 * entries]) as the weighted sum of the entries' vectors.
 */
void moe_gemm_f64_cols(const moe_cpu_kernels *k, const double *X, int64_t ldx, int64_t T,
                       const double *const *cols, int64_t K, int64_t N, double *Y, int64_t ldy, void *ws);

#endif
