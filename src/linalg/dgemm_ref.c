/*
 * The scalar float64 GEMM tile: the definition the SIMD tiles match bit for
 * bit (linalg_internal.h, invariant 1).
 *
 * Invariants:
 *  1. Each output is one fma() chain over k in index order, from +0.0 on the
 *     first K block and from Y's partial sum after; fma() is C99's correctly
 *     rounded fused multiply-add (libm; exact whatever the hardware).
 *  2. No allocation; tiles of up to 4 tokens x 4 rows.
 */
#include "linalg/linalg_internal.h"

#include <math.h>

enum { REF_MR = 4, REF_NR = 4 };
_Static_assert(MOE_DGEMM_NR_MAX % REF_NR == 0, "moe_linear_f64_workspace_for sizes by the widest tile");

static void tile_ref(int64_t kc, const double *Wp, const double *X, int64_t ldx, int mr, double *Y, int64_t ldy,
                     int nr, bool first) {
    for (int t = 0; t < mr; t++) {
        const double *x = X + t * ldx;
        for (int j = 0; j < nr; j++) {
            double acc = first ? 0.0 : Y[t * ldy + j];
            for (int64_t k = 0; k < kc; k++) acc = fma(x[k], Wp[k * REF_NR + j], acc);
            Y[t * ldy + j] = acc;
        }
    }
}

static const moe_dgemm_kernel ref_kernel = {"ref", REF_MR, REF_NR, tile_ref, moe_dgemm_pack, moe_dgemm_pack_ptrs};

const moe_dgemm_kernel *moe_dgemm_ref(void) { return &ref_kernel; }
