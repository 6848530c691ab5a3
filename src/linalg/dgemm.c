/*
 * The float64 GEMM's block driver (linalg_internal.h): pack a block of the
 * packed operand K block by K block and run every register tile over it.
 *
 * Invariants:
 *  1. Each output's fma chain runs over K blocks in index order, the partial
 *     sum parked in Y between blocks (first block from +0.0): the sequence
 *     of linalg_internal.h, invariant 1, whatever the block and tile bounds.
 *  2. No allocation: the caller passes the packed block's storage.
 */
#include "linalg/linalg_internal.h"

#include "core/core.h"

#include <string.h>

const moe_dgemm_kernel *moe_dgemm_for(const moe_cpu_kernels *k) {
    if (!strcmp(k->isa, "avx512") || !strcmp(k->isa, "amx")) return moe_dgemm_avx512();
    if (!strcmp(k->isa, "avx2")) return moe_dgemm_avx2();
    return moe_dgemm_ref();
}

const moe_cpu_kernels *moe_dgemm_table(const moe_cpu_kernels *k) {
    if (k) return k;
    const moe_cpu_kernels *t = moe_cpu_ref();
    (void)moe_cpu_table(MOE_ISA_AUTO, &t, NULL); /* AUTO always resolves (ref at worst) */
    return t;
}

void moe_dgemm_block(const moe_dgemm_kernel *kr, const moe_dgemm_src *src, int64_t r0, int64_t r1, int64_t t0,
                     int64_t t1, const double *X, int64_t ldx, double *Y, int64_t ldy, double *Wp) {
    const int MR = kr->mr, NR = kr->nr;
    const int64_t nrows = r1 - r0, npan = (nrows + NR - 1) / NR, K = src->K;
    MOE_ASSERT(nrows >= 0 && nrows <= MOE_DGEMM_ROWS && t0 <= t1);
    for (int64_t k0 = 0; k0 < K; k0 += MOE_DGEMM_KC) {
        int64_t kc = K - k0 < MOE_DGEMM_KC ? K - k0 : MOE_DGEMM_KC;
        if (src->w && moe_dgemm_pack_generic_only(src->w)) moe_dgemm_pack(src->w, r0, nrows, k0, kc, NR, Wp);
        else if (src->w) kr->pack(src->w, r0, nrows, k0, kc, NR, Wp);
        else kr->pack_ptrs(src->v, src->by_cols, r0, nrows, k0, kc, NR, Wp);
        for (int64_t t = t0; t < t1; t += MR) {
            int mr = (int)(t1 - t < MR ? t1 - t : MR);
            for (int64_t p = 0; p < npan; p++) {
                int nr = (int)(nrows - p * NR < NR ? nrows - p * NR : NR);
                kr->tile(kc, Wp + p * kc * NR, X + t * ldx + k0, ldx, mr, Y + t * ldy + r0 + p * NR, ldy, nr,
                         k0 == 0);
            }
        }
    }
}
