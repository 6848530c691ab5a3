/*
 * SwiGLU experts over a group of tokens: the float64 reference and the
 * float32 path. Both take the tokens of ONE expert as a contiguous [n, H]
 * block. float64: the three products through moe_linear_f64_ws (src/linalg:
 * the blocked float64 GEMM with on-the-fly dequant, on the calling thread,
 * in the caller's scratch); float32 here: row decode + dot products (the
 * SIMD kernels are experts_fast.c).
 *
 *   expert(x) = w2 . ( silu(min(w1.x, L)) * clamp(w3.x, -L, L) )   (L = 0: no clamp)
 *
 * The caller rounds X to the activation precision; the kernels round the
 * SwiGLU output to it before the down projection.
 *
 * Invariants:
 *  1. Kernels never allocate: the caller passes the scratch.
 *  2. Each output element is a dot product summed in index order (float64:
 *     one fma chain per output, linear.h contract 2, the same bits on every
 *     ISA; float32: s = s + x * w), so results do not depend on n, on the
 *     other tokens, or on threads.
 *  3. NaN propagates through the clamp (comparisons are written so that a
 *     NaN operand is returned, as torch.clamp does).
 *  4. The float32 SwiGLU is moe_swiglu_f32 (formats/mathf.h): the exp is the
 *     project's moe_expf_f32 (at most MOE_EXPF_MAX_ULP ulps from the exact
 *     e^x, the same bits on every x86-64), never libm's expf, whose bits
 *     depend on the glibc variant a CPU selects. The kernel tables' swiglu
 *     entries repeat it bit for bit (experts_fast.c invariant 3).
 */
#include "experts/experts.h"
#include "core/core.h"
#include "linalg/linear.h"
#include "formats/act.h"
#include "formats/mathf.h"

#include <math.h>

static inline double clamp_hi(double g, double L) { return g > L ? L : g; }
static inline double clamp_both(double u, double L) { return u > L ? L : (u < -L ? -L : u); }

void moe_expert_ref(const moe_weight *w1, const moe_weight *w3, const moe_weight *w2, double limit,
                    moe_act_prec act, const double *X, int64_t n, double *Y, double *scratch) {
    int64_t H = w1->cols, I = w1->rows;
    double *A = scratch;          /* [n, I] gate, then activation */
    double *U = A + n * I;        /* [n, I] up */
    void *ws = U + n * I;         /* moe_linear_f64_workspace_for(max(H, I), max(H, I)) bytes */
    moe_linear_f64_ws(NULL, w1, X, H, n, A, I, ws);
    moe_linear_f64_ws(NULL, w3, X, H, n, U, I, ws);
    for (int64_t k = 0; k < n * I; k++) {
        double g = A[k], u = U[k];
        if (limit > 0) { g = clamp_hi(g, limit); u = clamp_both(u, limit); }
        A[k] = g / (1.0 + exp(-g)) * u;
    }
    float s2 = moe_act_static_scale(act, w2, NULL); /* NVFP4: GEMM2's static input scale */
    for (int64_t t = 0; t < n; t++) moe_act_round_scaled_f64(act, s2, A + t * I, I);
    moe_linear_f64_ws(NULL, w2, A, I, n, Y, H, ws);
}

void moe_expert_f32(const moe_weight *w1, const moe_weight *w3, const moe_weight *w2, double limit,
                    moe_act_prec act, const float *X, int64_t n, float *Y, float *scratch) {
    int64_t H = w1->cols, I = w1->rows;
    float *row = scratch;
    float *A = row + (H > I ? H : I);
    float *U = A + n * I;
    float L = (float)limit;
    for (int64_t i = 0; i < I; i++) {
        moe_weight_row_f32(w1, i, row);
        for (int64_t t = 0; t < n; t++) {
            const float *x = X + t * H;
            float s = 0.0f;
            for (int64_t h = 0; h < H; h++) s += x[h] * row[h];
            A[t * I + i] = s;
        }
        moe_weight_row_f32(w3, i, row);
        for (int64_t t = 0; t < n; t++) {
            const float *x = X + t * H;
            float s = 0.0f;
            for (int64_t h = 0; h < H; h++) s += x[h] * row[h];
            U[t * I + i] = s;
        }
    }
    for (int64_t k = 0; k < n * I; k++) A[k] = moe_swiglu_f32(A[k], U[k], L); /* invariant 4 */
    float s2 = moe_act_static_scale(act, w2, NULL);
    for (int64_t t = 0; t < n; t++) moe_act_round_scaled_f32(act, s2, A + t * I, I);
    for (int64_t h = 0; h < H; h++) {
        moe_weight_row_f32(w2, h, row);
        for (int64_t t = 0; t < n; t++) {
            const float *a = A + t * I;
            float s = 0.0f;
            for (int64_t i = 0; i < I; i++) s += a[i] * row[i];
            Y[t * H + h] = s;
        }
    }
}

size_t moe_expert_scratch(int64_t H, int64_t I, int64_t n) {
    /* float32: a decoded row + gate + up; float64: gate + up + the linear's workspace */
    size_t f32 = (size_t)((H > I ? H : I) + 2 * n * I);
    /* w1, w3 are [I, H] and w2 [H, I]: one workspace fits all three */
    int64_t side = H > I ? H : I;
    size_t f64 = (size_t)(2 * n * I) + (moe_linear_f64_workspace_for(side, side) + sizeof(double) - 1) / sizeof(double);
    return f32 > f64 ? f32 : f64;
}
