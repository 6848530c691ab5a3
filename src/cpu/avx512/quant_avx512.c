/*
 * AVX-512 build of the fast quantizers: the bodies in
 * src/formats/quant_fast_impl.h compiled with this directory's AVX-512 flags
 * (GCC vectorizes them 16 lanes wide). Reached only through
 * src/formats/quant_fast.c after __builtin_cpu_supports checks.
 *
 * Invariants: see quant_fast_impl.h; nothing here but the entry points.
 */
#include "formats/quant_fast_impl.h"
#include "formats/quant_fast_internal.h"

void moe_qf_mxfp4_row_avx512(const float *x, int64_t n, moe_mx_scale_rule rule,
                             moe_e2m1_round r, uint8_t *packed, uint8_t *scales) {
    qf_mxfp4_row(x, n, rule, r, packed, scales);
}

void moe_qf_nvfp4_row_avx512(const float *x, int64_t n, float scale2, moe_e2m1_round r,
                             uint8_t *packed, uint8_t *scales) {
    qf_nvfp4_row(x, n, scale2, r, packed, scales);
}

void moe_qf_fp8_tiles_avx512(const float *w, int64_t rows, int64_t cols, moe_fp8_scale kind,
                             uint8_t *q, float *scale_f32, uint8_t *scale_e8m0) {
    qf_fp8_tiles(w, rows, cols, kind, q, scale_f32, scale_e8m0);
}

void moe_qf_bf16_row_avx512(const float *x, int64_t n, uint16_t *out) {
    qf_bf16_row(x, n, out);
}
