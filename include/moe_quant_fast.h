/*
 * moe_quant_fast.h: fast block quantizers, bit-identical to the scalar
 * references of moe_formats.h (same codes, same scales, for every input:
 * ties, subnormals, NaN/Inf, -0, zero blocks, every rule and rounding).
 *
 * Each function has the signature, shapes, contract and thread safety of its
 * reference (see moe_formats.h): never allocates, never prints, no threads
 * inside (callers parallelise over rows or tiles); thread-safe on distinct
 * outputs. Internally an AVX-512 build of the same code is used when the CPU
 * has AVX-512 F/BW/VL/DQ; otherwise the portable build. Both are tested
 * against the reference (tests/test-quant-fast.c).
 */
#ifndef MOE_QUANT_FAST_H
#define MOE_QUANT_FAST_H

#include "moe_formats.h"

#ifdef __cplusplus
extern "C" {
#endif

/* = moe_mxfp4_quant_row: x [n] (n % 32 == 0) -> packed [n/2], scales [n/32]. */
void moe_mxfp4_quant_row_fast(const float *x, int64_t n, moe_mx_scale_rule rule,
                              moe_e2m1_round r, uint8_t *packed, uint8_t *scales);

/* = moe_nvfp4_quant_row: x [n] (n % 16 == 0), scale2 > 0 ->
 * packed [n/2], scales [n/16] (UE4M3). */
void moe_nvfp4_quant_row_fast(const float *x, int64_t n, float scale2, moe_e2m1_round r,
                              uint8_t *packed, uint8_t *scales);

/* = moe_fp8_block_quant: w [rows, cols] -> q [rows, cols],
 * scale [ceil(rows/128), ceil(cols/128)] fp32. */
void moe_fp8_block_quant_fast(const float *w, int64_t rows, int64_t cols, moe_fp8_scale kind,
                              uint8_t *q, float *scale);

/* = moe_fp8_block_quant_e8m0: w [rows, cols] -> q [rows, cols],
 * scale_e8m0 [ceil(rows/128), ceil(cols/128)]. */
void moe_fp8_block_quant_e8m0_fast(const float *w, int64_t rows, int64_t cols,
                                   uint8_t *q, uint8_t *scale_e8m0);

/* out[i] = moe_bf16_from_f32(x[i]) for x [n], out [n] (n >= 0). */
void moe_bf16_from_f32_row_fast(const float *x, int64_t n, uint16_t *out);

#ifdef __cplusplus
}
#endif
#endif /* MOE_QUANT_FAST_H */
