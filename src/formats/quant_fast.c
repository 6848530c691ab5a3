/*
 * Fast block quantizers (include/moe_quant_fast.h): the portable build of
 * the bodies in quant_fast_impl.h, and the dispatch to their AVX-512 build.
 *
 * Invariants:
 *  1. Outputs equal the references of formats.c bit for bit on every path
 *     (quant_fast_impl.h says why); the path only changes speed.
 *  2. The path is chosen per call from the one CPU feature detector
 *     (moe_cpu_get_features, src/core/cpuid.c: facts detected once); no
 *     other state, no environment (outputs are the same on both paths).
 *  3. Arguments are checked as the references check them (MOE_ASSERT).
 */
#include "moe_quant_fast.h"

#include "core/core.h"
#include "formats/quant_fast_impl.h"
#include "formats/quant_fast_internal.h"

#include <float.h>

/* The AVX-512 build needs F, BW, VL, DQ and the OS's ZMM state. */
static int qf_use_avx512(void) {
    const moe_cpu_features *f = moe_cpu_get_features();
    return f->os_avx512 && f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq;
}

int moe_qf_uses_avx512(void) { return qf_use_avx512(); }

MOE_QF_DEFINE_ENTRY_POINTS(portable)

void moe_mxfp4_quant_row_fast(const float *x, int64_t n, moe_mx_scale_rule rule,
                              moe_e2m1_round r, uint8_t *packed, uint8_t *scales) {
    MOE_ASSERT(n >= 0 && n % MOE_MXFP4_BLOCK == 0);
    MOE_ASSERT(n == 0 || (x && packed && scales));
    MOE_ASSERT(rule == MOE_MX_SCALE_CEIL || rule == MOE_MX_SCALE_FLOOR);
    MOE_ASSERT(r == MOE_E2M1_RNE || r == MOE_E2M1_TIES_UP || r == MOE_E2M1_TOWARD_ZERO);
    if (qf_use_avx512()) moe_qf_mxfp4_row_avx512(x, n, rule, r, packed, scales);
    else moe_qf_mxfp4_row_portable(x, n, rule, r, packed, scales);
}

void moe_nvfp4_quant_row_fast(const float *x, int64_t n, float scale2, moe_e2m1_round r,
                              uint8_t *packed, uint8_t *scales) {
    MOE_ASSERT(n >= 0 && n % MOE_NVFP4_BLOCK == 0);
    MOE_ASSERT(n == 0 || (x && packed && scales));
    MOE_ASSERT(scale2 > 0.0f && scale2 <= FLT_MAX);
    MOE_ASSERT(r == MOE_E2M1_RNE || r == MOE_E2M1_TIES_UP || r == MOE_E2M1_TOWARD_ZERO);
    if (qf_use_avx512()) moe_qf_nvfp4_row_avx512(x, n, scale2, r, packed, scales);
    else moe_qf_nvfp4_row_portable(x, n, scale2, r, packed, scales);
}

void moe_fp8_block_quant_fast(const float *w, int64_t rows, int64_t cols, moe_fp8_scale kind,
                              uint8_t *q, float *scale) {
    MOE_ASSERT(rows >= 0 && cols >= 0);
    MOE_ASSERT(kind == MOE_FP8_SCALE_F32 || kind == MOE_FP8_SCALE_POW2);
    if (qf_use_avx512()) moe_qf_fp8_tiles_avx512(w, rows, cols, kind, q, scale, NULL);
    else moe_qf_fp8_tiles_portable(w, rows, cols, kind, q, scale, NULL);
}

void moe_fp8_block_quant_e8m0_fast(const float *w, int64_t rows, int64_t cols,
                                   uint8_t *q, uint8_t *scale_e8m0) {
    MOE_ASSERT(rows >= 0 && cols >= 0);
    if (qf_use_avx512()) moe_qf_fp8_tiles_avx512(w, rows, cols, MOE_FP8_SCALE_POW2, q, NULL, scale_e8m0);
    else moe_qf_fp8_tiles_portable(w, rows, cols, MOE_FP8_SCALE_POW2, q, NULL, scale_e8m0);
}

void moe_bf16_from_f32_row_fast(const float *x, int64_t n, uint16_t *out) {
    MOE_ASSERT(n >= 0 && (n == 0 || (x && out)));
    if (qf_use_avx512()) moe_qf_bf16_row_avx512(x, n, out);
    else moe_qf_bf16_row_portable(x, n, out);
}
