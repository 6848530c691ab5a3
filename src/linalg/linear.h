/*
 * Dense linear layers of the whole model (attention projections, compressors,
 * indexer, mHC, LM head): Y = X W^T with the weight decoded on the fly from its
 * stored format (BF16, FP8 blocks, MXFP4, NVFP4, ...), never materialised.
 *
 * Contract:
 *  1. Values: W[r, k] is exactly moe_weight_row_f64(w, r)[k] (float64) or
 *     moe_weight_row_f32(w, r)[k] (float32).
 *  2. Deterministic: every Y element is produced by one fixed sequence of
 *     floating-point operations, whatever T, the other rows of X and the
 *     thread count:
 *       float64  Y[t, r] = fma chain over k = 0 .. cols-1 in index order:
 *                s = +0.0; s = fma(X[t, k], W[r, k], s) (one rounding per
 *                term; correctly rounded fused multiply-add). The same bits
 *                on every ISA (ref, avx2, avx512): linear.c and
 *                linalg_internal.h say why.
 *       float32  the CPU kernel table's sequence (src/cpu/kernels.h,
 *                contract 2): index order s = s + x * w for the ref table,
 *                per-lane FMA chains over 32-column chunks and a fixed
 *                16-lane tree for avx512 (gemm_avx512.c), its 8-lane twin
 *                for avx2; so float32 bits depend on the ISA, never on T,
 *                the batch or the threads.
 *     The float64 order changed from the first version of this file (index
 *     order s = s + x * w, two roundings per term) to the fma chain: results
 *     moved by rounding only (|dY| <= 2 cols u sum|x w|, u = 2^-53), far
 *     inside the whole-model oracle's 1e-10 relative tolerance.
 *  3. Allocates only its per-call workspace (float64: one decoded weight
 *     block of at most 72 rows x 1024 columns per thread, 576 KiB; float32:
 *     none), before writing Y: MOE_ERR_NOMEM leaves Y untouched. Never prints.
 *  4. Threads: OpenMP over (row block, token block) items inside the call;
 *     calls from several threads at once are safe (no shared state). X, W
 *     Y must not overlap X or the weight.
 */
#ifndef MOE_LINALG_LINEAR_H
#define MOE_LINALG_LINEAR_H

#include "moeaudit.h"
#include "cpu/kernels.h"

/*
 * Y[t, r] = sum_k X[t, k] * W[r, k]   for t < T, r < w->rows
 *   X: [T, ldx] float64, the first w->cols columns used
 *   Y: [T, ldy] float64, the first w->rows columns written (+0.0 when
 *      w->cols == 0)
 * ISA: the best this CPU supports (MOE_ISA_AUTO); moe_linear_f64_with names one.
 * MOE_ERR_NOMEM when the decode workspace cannot be allocated.
 */
moe_status moe_linear_f64(const moe_weight *w, const double *X, int64_t ldx, int64_t T, double *Y, int64_t ldy,
                          moe_error *err);

/*
 * The same product in float32: X and Y float32, W decoded exactly to float
 * (moe_weight_row_f32), through the CPU kernel table's gemm with threads over
 * (row block, token block) items. ISA: MOE_ISA_AUTO's (see _with).
 */
moe_status moe_linear_f32(const moe_weight *w, const float *X, int64_t ldx, int64_t T, float *Y, int64_t ldy,
                          moe_error *err);

/*
 * The two products on the ISA of kernel table `k` (from moe_cpu_table, e.g.
 * for moe_run_opts.isa; NULL = the MOE_ISA_AUTO table). float64: table
 * "avx512" (and "amx") runs the AVX-512F tile, "avx2" the AVX2 tile, "ref"
 * the scalar fma() tile, all with the same bits; float32: k->gemm.
 */
moe_status moe_linear_f64_with(const moe_cpu_kernels *k, const moe_weight *w, const double *X, int64_t ldx,
                               int64_t T, double *Y, int64_t ldy, moe_error *err);
moe_status moe_linear_f32_with(const moe_cpu_kernels *k, const moe_weight *w, const float *X, int64_t ldx,
                               int64_t T, float *Y, int64_t ldy, moe_error *err);

/*
 * moe_linear_f64 on the calling thread alone, in the caller's workspace: no
 * allocation, no OpenMP (for callers that already run one task per thread,
 * e.g. the MoE block's experts). The same bits as moe_linear_f64.
 *   ws: moe_linear_f64_workspace_for(w->rows, w->cols) bytes (at most
 *   moe_linear_f64_workspace(), the size for any weight), any alignment,
 *   not shared with another thread during the call. k: as
 *   moe_linear_f64_with.
 */
size_t moe_linear_f64_workspace(void);
/* The workspace of moe_linear_f64_ws for a weight of at most rows x cols:
 * one packed block (rows rounded up to the widest tile, at most
 * MOE_DGEMM_ROWS, times min(cols, MOE_DGEMM_KC) doubles). Small weights
 * need far less than the 576 KiB of the general size. */
size_t moe_linear_f64_workspace_for(int64_t rows, int64_t cols);
void moe_linear_f64_ws(const moe_cpu_kernels *k, const moe_weight *w, const double *X, int64_t ldx, int64_t T,
                       double *Y, int64_t ldy, void *ws);

/* The float64 tile an ISA table selects ("ref", "avx2" or "avx512"), for
 * reports and benchmarks. */
const char *moe_linear_f64_isa(const moe_cpu_kernels *k);

#endif
