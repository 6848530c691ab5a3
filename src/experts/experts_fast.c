/*
 * The fast float32 SwiGLU expert over the tokens of one expert.
 *
 *   G [n, I] = X . w1^T     U [n, I] = X . w3^T      (k->gemm, rows split over threads;
 *                                                     k->gemm_bf16act when act is bf16 and
 *                                                     the table has it)
 *   G <- act_round(silu(min(G, L)) * clamp(U, -L, L)) (each thread on its own rows)
 *   Y [n, H] = G . w2^T                               (after one barrier)
 *
 * Invariants:
 *  1. Never allocates: G and U live in the caller's scratch.
 *  2. Every output element is computed by one kernel call whose operation
 *     sequence does not depend on the row range it got (kernel contract 2),
 *     and the activation is elementwise, so results are bit-identical for
 *     any thread count and any batch composition.
 *  3. The activation is moe_expert_f32's, operation for operation
 *     (g / (1 + expf(-g)) * u, NaN-propagating clamps, then moe_act_round_f32
 *     over whole 128-blocks: thread cuts of I fall on multiples of 128).
 */
#include "experts/experts_fast.h"
#include "core/core.h"
#include "formats/act.h"
#include "moe_formats.h"

#include <math.h>
#ifdef _OPENMP
#include <omp.h>
#endif

size_t moe_expert_fast_scratch(int64_t H, int64_t I, int64_t n) {
    (void)H;
    return (size_t)(2 * n * I);
}

static inline float clamp_hi_f(float g, float L) { return g > L ? L : g; }
static inline float clamp_both_f(float u, float L) { return u > L ? L : (u < -L ? -L : u); }

/* Rows [*a, *b) of `rows` for thread `tid` of `nth`, cut at multiples of `al`. */
static void split_rows(int64_t rows, int64_t al, int tid, int nth, int64_t *a, int64_t *b) {
    int64_t blocks = (rows + al - 1) / al;
    int64_t lo = blocks * tid / nth, hi = blocks * (tid + 1) / nth;
    *a = lo * al < rows ? lo * al : rows;
    *b = hi * al < rows ? hi * al : rows;
}

static void expert_part(const moe_cpu_kernels *k, const moe_weight *w1, const moe_weight *w3, const moe_weight *w2,
                        float L, moe_act_prec act, const float *X, int64_t n, float *Y, float *G, float *U, int tid,
                        int nth) {
    int64_t H = w1->cols, I = w1->rows;
    int64_t a, b;
    /* bf16 activations (X rounded by the caller, G by moe_act_round_f32
     * below): the table's bf16 kernel when it has one */
    moe_gemm_fn gemm = act == MOE_ACT_BF16 && k->gemm_bf16act ? k->gemm_bf16act : k->gemm;
    /* cuts at multiples of 128 keep each FP8 activation block in one thread */
    split_rows(I, MOE_FP8_ACT_BLOCK, tid, nth, &a, &b);
    if (a < b) {
        gemm(w1, a, b, X, H, n, G + a, I);
        gemm(w3, a, b, X, H, n, U + a, I);
        for (int64_t t = 0; t < n; t++) {
            float *g = G + t * I, *u = U + t * I;
            for (int64_t i = a; i < b; i++) {
                float gv = g[i], uv = u[i];
                if (L > 0) {
                    gv = clamp_hi_f(gv, L);
                    uv = clamp_both_f(uv, L);
                }
                g[i] = gv / (1.0f + expf(-gv)) * uv;
            }
            moe_act_round_f32(act, g + a, b - a);
        }
    }
#ifdef _OPENMP
    /* only inside our own team: an orphaned barrier would bind to a caller's
     * enclosing parallel region */
    if (nth > 1) {
#pragma omp barrier
    }
#endif
    split_rows(H, 8, tid, nth, &a, &b);
    if (a < b) gemm(w2, a, b, G, I, n, Y + a, H);
}

void moe_expert_fast(const moe_cpu_kernels *k, const moe_weight *w1, const moe_weight *w3, const moe_weight *w2,
                     double limit, moe_act_prec act, const float *X, int64_t n, float *Y, float *scratch) {
    MOE_ASSERT(k && w1 && w3 && w2 && n >= 0);
    int64_t H = w1->cols, I = w1->rows;
    MOE_ASSERT(w3->rows == I && w3->cols == H && w2->rows == H && w2->cols == I);
    if (n == 0) return;
    float *G = scratch, *U = scratch + n * I;
    float L = (float)limit;
#ifdef _OPENMP
    if (omp_get_max_threads() > 1 && !omp_in_parallel()) {
#pragma omp parallel
        expert_part(k, w1, w3, w2, L, act, X, n, Y, G, U, omp_get_thread_num(), omp_get_num_threads());
        return;
    }
#endif
    expert_part(k, w1, w3, w2, L, act, X, n, Y, G, U, 0, 1);
}
