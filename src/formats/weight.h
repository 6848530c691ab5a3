/*
 * What a weight is, one element at a time: the scalar decoder that the
 * reference kernel table and the edge paths of the SIMD kernels (src/cpu)
 * use, so that every kernel decodes a weight as src/formats/weights.c does.
 *
 * Invariants:
 *  1. moe_weight_at_f32(w, r, k) equals moe_weight_row_f32(w, r, out)[k]
 *     bit for bit (same operations in the same order; NaN payloads aside):
 *       FP8_BLOCK  e4m3 * scale          (scale F32, or E8M0 decoded to float)
 *       MXFP4      e2m1 * e8m0
 *       NVFP4      (e2m1 * ue4m3) * scale2
 */
#ifndef MOE_FORMATS_WEIGHT_H
#define MOE_FORMATS_WEIGHT_H

#include "core/core.h"
#include "moe_formats.h"

#include <string.h>

/* FP8_BLOCK: rows and columns per scale (block_rows / block_cols; 0 is 128). */
static inline int64_t moe_weight_fp8_br(const moe_weight *w) {
    return w->block_rows > 0 ? w->block_rows : MOE_FP8_TILE;
}
static inline int64_t moe_weight_fp8_bc(const moe_weight *w) {
    return w->block_cols > 0 ? w->block_cols : MOE_FP8_TILE;
}
/* True unless w is FP8 with blocks other than 128 x 128: the layout every
 * fast kernel (src/cpu, src/cuda, src/linalg) is written for. */
static inline bool moe_weight_fast_layout(const moe_weight *w) {
    return w->fmt != MOE_WFMT_FP8_BLOCK || (moe_weight_fp8_br(w) == MOE_FP8_TILE && moe_weight_fp8_bc(w) == MOE_FP8_TILE);
}

/* Element (r, k) of w as float, equal to moe_weight_row_f32(w, r, out)[k]
 * bit for bit. No bounds checks: callers loop inside w. */
static inline float moe_weight_at_f32(const moe_weight *w, int64_t r, int64_t k) {
    const uint8_t *p = (const uint8_t *)w->data;
    int64_t cols = w->cols;
    switch (w->fmt) {
    case MOE_WFMT_F64: {
        double d;
        memcpy(&d, p + (size_t)(r * cols + k) * 8, 8);
        return (float)d;
    }
    case MOE_WFMT_F32: {
        float f;
        memcpy(&f, p + (size_t)(r * cols + k) * 4, 4);
        return f;
    }
    case MOE_WFMT_F16: {
        uint16_t h;
        memcpy(&h, p + (size_t)(r * cols + k) * 2, 2);
        return moe_f16_to_f32(h);
    }
    case MOE_WFMT_BF16: {
        uint16_t h;
        memcpy(&h, p + (size_t)(r * cols + k) * 2, 2);
        return moe_bf16_to_f32(h);
    }
    case MOE_WFMT_FP8_BLOCK: {
        float v = moe_fp8_e4m3_to_f32(p[(size_t)(r * cols + k)]);
        size_t si = (size_t)((r / moe_weight_fp8_br(w)) * w->scale_cols + k / moe_weight_fp8_bc(w));
        float s;
        if (w->scale_dtype == MOE_DTYPE_F8_E8M0) s = moe_e8m0_to_f32(((const uint8_t *)w->scale)[si]);
        else memcpy(&s, (const uint8_t *)w->scale + si * 4, 4);
        return v * s;
    }
    case MOE_WFMT_MXFP4: {
        uint8_t b = p[(size_t)(r * (cols / 2) + k / 2)];
        float v = moe_e2m1_to_f32((uint8_t)((k & 1) ? b >> 4 : b & 0xF));
        uint8_t e = ((const uint8_t *)w->scale)[(size_t)(r * w->scale_cols + k / MOE_MXFP4_BLOCK)];
        return v * moe_e8m0_to_f32(e);
    }
    case MOE_WFMT_NVFP4: {
        uint8_t b = p[(size_t)(r * (cols / 2) + k / 2)];
        float v = moe_e2m1_to_f32((uint8_t)((k & 1) ? b >> 4 : b & 0xF));
        uint8_t s = ((const uint8_t *)w->scale)[(size_t)(r * w->scale_cols + k / MOE_NVFP4_BLOCK)];
        float vs = v * moe_ue4m3_to_f32(s);
        return vs * w->scale2;
    }
    }
    MOE_ASSERT(!"unknown weight format");
    return 0.0f;
}

#endif
