/*
 * The scalar reference kernel table: the definition the SIMD tables are
 * tested against.
 *
 * Invariants:
 *  1. Weights are decoded element by element with moe_weight_at_f32, which
 *     equals moe_weight_row_f32 exactly; nothing is allocated (a fixed stack
 *     chunk holds decoded values).
 *  2. Y[t, j] is summed in index order k = 0, 1, ..., cols-1 as
 *     s = s + x * w (two roundings; the build uses -ffp-contract=off), the
 *     same order as moe_expert_f32. Partial sums are parked in Y between
 *     chunks, which is exact. Tokens go four at a time (independent sums;
 *     the order of each is unchanged, so are its bits).
 *  3. swiglu is moe_swiglu_f32 (formats/mathf.h) element by element: the
 *     definition the SIMD swiglu entries repeat bit for bit.
 */
#include "cpu/cpu_internal.h"
#include "formats/mathf.h"

#define MOE_REF_CHUNK 256

static void gemm_ref(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx, int64_t n,
                     float *Y, int64_t ldy) {
    MOE_ASSERT(r0 >= 0 && r0 <= r1 && r1 <= w->rows && n >= 0);
    float buf[MOE_REF_CHUNK]; /* decoded chunk of one row */
    int64_t cols = w->cols;
    for (int64_t j = r0; j < r1; j++) {
        for (int64_t t = 0; t < n; t++) Y[t * ldy + (j - r0)] = 0.0f;
        for (int64_t k0 = 0; k0 < cols; k0 += MOE_REF_CHUNK) {
            int64_t m = cols - k0 < MOE_REF_CHUNK ? cols - k0 : MOE_REF_CHUNK;
            for (int64_t k = 0; k < m; k++) buf[k] = moe_weight_at_f32(w, j, k0 + k);
            int64_t t = 0;
            /* four tokens at a time: four independent sums, each still in
             * index order (invariant 2: the same bits as one at a time), so
             * the chain of dependent adds is not the only work in flight */
            for (; t + 4 <= n; t += 4) {
                const float *x0 = X + t * ldx + k0, *x1 = x0 + ldx, *x2 = x1 + ldx, *x3 = x2 + ldx;
                float *y = Y + t * ldy + (j - r0);
                float s0 = y[0], s1 = y[ldy], s2 = y[2 * ldy], s3 = y[3 * ldy];
                for (int64_t k = 0; k < m; k++) {
                    s0 += x0[k] * buf[k];
                    s1 += x1[k] * buf[k];
                    s2 += x2[k] * buf[k];
                    s3 += x3[k] * buf[k];
                }
                y[0] = s0;
                y[ldy] = s1;
                y[2 * ldy] = s2;
                y[3 * ldy] = s3;
            }
            for (; t < n; t++) {
                const float *x = X + t * ldx + k0;
                float s = Y[t * ldy + (j - r0)];
                for (int64_t k = 0; k < m; k++) s += x[k] * buf[k];
                Y[t * ldy + (j - r0)] = s;
            }
        }
    }
}

static void swiglu_ref(float *g, const float *u, int64_t n, float limit) {
    MOE_ASSERT(n >= 0);
    for (int64_t i = 0; i < n; i++) g[i] = moe_swiglu_f32(g[i], u[i], limit);
}

static const moe_cpu_kernels moe_ref_table = {
    .isa = "ref",
    .gemm = gemm_ref,
    .gemm_bf16act = NULL,
    .swiglu = swiglu_ref,
};

const moe_cpu_kernels *moe_cpu_ref(void) { return &moe_ref_table; }
