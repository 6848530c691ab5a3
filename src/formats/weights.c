/*
 * What a weight is: the row decoders of every moe_wfmt (include/moeaudit.h,
 * moe_weight_row_f64 / _f32), through the scalar references of
 * include/moe_formats.h and src/formats/formats.c.
 *
 * Invariants:
 *  1. moe_weight_row_f64 is the definition of a weight's values; every fast
 *     path must agree with it (exactly for formats whose values are floats).
 *     moe_weight_at_f32 (formats/weight.h) is the same value one element at
 *     a time.
 *  2. Decoding never allocates and never fails: the loader (src/io) or the
 *     in-memory quantizer made the descriptor consistent.
 */
#include "core/core.h"
#include "formats/weight.h"
#include "moe_formats.h"

#include <math.h>
#include <string.h>

/* Row r of a quantized weight into out64 (double) or out32 (float), through
 * the scalar reference decoders of src/formats. */
static void quant_row(const moe_weight *w, int64_t r, double *out64, float *out32) {
    const uint8_t *d = w->data, *sc = w->scale;
    int64_t n = w->cols;
    switch (w->fmt) {
    case MOE_WFMT_FP8_BLOCK: {
        const uint8_t *row = d + r * n;
        int64_t br = moe_weight_fp8_br(w), bc = moe_weight_fp8_bc(w);
        int64_t tr = r / br, gc = w->scale_cols;
        if (bc != MOE_FP8_TILE) {
            /* other blocks (V4.1's 32 x 32, per channel): the same products
             * as the 128-column row decoders, scale by scale */
            for (int64_t j = 0; j < n; j++) {
                size_t si = (size_t)(tr * gc + j / bc);
                float v = moe_fp8_e4m3_to_f32(row[j]);
                if (w->scale_dtype == MOE_DTYPE_F8_E8M0) {
                    uint8_t e = sc[si];
                    if (out64) out64[j] = e == 0xFF ? (double)NAN : ldexp((double)v, (int)e - 127);
                    else out32[j] = v * moe_e8m0_to_f32(e);
                } else {
                    float s;
                    memcpy(&s, sc + 4 * si, 4);
                    if (out64) out64[j] = (double)v * (double)s;
                    else out32[j] = v * s;
                }
            }
            return;
        }
        if (w->scale_dtype == MOE_DTYPE_F8_E8M0) {
            const uint8_t *srow = sc + tr * gc;
            if (out64) moe_fp8_block_dequant_row_e8m0_f64(row, srow, n, out64);
            else moe_fp8_block_dequant_row_e8m0(row, srow, n, out32);
        } else {
            float srow[1024];
            MOE_ASSERT(gc <= 1024);
            for (int64_t c = 0; c < gc; c++) memcpy(&srow[c], sc + 4 * (tr * gc + c), 4);
            if (out64) moe_fp8_block_dequant_row_f64(row, srow, n, out64);
            else moe_fp8_block_dequant_row(row, srow, n, out32);
        }
        return;
    }
    case MOE_WFMT_MXFP4:
        if (out64) moe_mxfp4_dequant_row_f64(d + r * (n / 2), sc + r * (n / 32), n, out64);
        else moe_mxfp4_dequant_row(d + r * (n / 2), sc + r * (n / 32), n, out32);
        return;
    case MOE_WFMT_NVFP4:
        if (out64 && w->global_scale > 0) {
            /* compressed-tensors: e2m1 * (ue4m3 / G) (its dequantize divides
             * the block scale by the global scale); e2m1 * ue4m3 is exact, so
             * one division rounds */
            moe_nvfp4_dequant_row_f64(d + r * (n / 2), sc + r * (n / 16), 1.0f, n, out64);
            for (int64_t j = 0; j < n; j++) out64[j] /= w->global_scale;
        } else if (out64) moe_nvfp4_dequant_row_f64(d + r * (n / 2), sc + r * (n / 16), w->scale2, n, out64);
        else moe_nvfp4_dequant_row(d + r * (n / 2), sc + r * (n / 16), w->scale2, n, out32);
        return;
    default:
        MOE_ASSERT(!"not a quantized format");
    }
}

/* n BF16 codes at p (unaligned) into o32 or o64: one memcpy per 256 codes. */
static void bf16_row(const unsigned char *p, int64_t n, float *o32, double *o64) {
    uint16_t buf[256];
    for (int64_t i0 = 0; i0 < n; i0 += 256) {
        int64_t m = n - i0 < 256 ? n - i0 : 256;
        memcpy(buf, p + (size_t)i0 * 2, (size_t)m * 2);
        if (o32) for (int64_t i = 0; i < m; i++) o32[i0 + i] = moe_bf16_to_f32(buf[i]);
        else for (int64_t i = 0; i < m; i++) o64[i0 + i] = moe_bf16_to_f32(buf[i]);
    }
}

void moe_weight_row_f64(const moe_weight *w, int64_t r, double *out) {
    MOE_ASSERT(r >= 0 && r < w->rows);
    int64_t n = w->cols;
    const unsigned char *p = w->data;
    switch (w->fmt) {
    case MOE_WFMT_F64:
        memcpy(out, p + (size_t)(r * n) * 8, (size_t)n * 8);
        return;
    case MOE_WFMT_F32:
        for (int64_t i = 0; i < n; i++) out[i] = moe_load_f64(p, MOE_DTYPE_F32, (size_t)(r * n + i));
        return;
    case MOE_WFMT_F16:
        for (int64_t i = 0; i < n; i++) out[i] = moe_load_f64(p, MOE_DTYPE_F16, (size_t)(r * n + i));
        return;
    case MOE_WFMT_BF16:
        bf16_row(p + (size_t)(r * n) * 2, n, NULL, out);
        return;
    case MOE_WFMT_FP8_BLOCK:
    case MOE_WFMT_MXFP4:
    case MOE_WFMT_NVFP4:
        quant_row(w, r, out, NULL);
        return;
    }
    MOE_ASSERT(!"unknown weight format");
}

void moe_weight_row_f32(const moe_weight *w, int64_t r, float *out) {
    MOE_ASSERT(r >= 0 && r < w->rows);
    int64_t n = w->cols;
    const unsigned char *p = w->data;
    switch (w->fmt) {
    case MOE_WFMT_F64:
        for (int64_t i = 0; i < n; i++) out[i] = (float)moe_load_f64(p, MOE_DTYPE_F64, (size_t)(r * n + i));
        return;
    case MOE_WFMT_F32:
        memcpy(out, p + (size_t)(r * n) * 4, (size_t)n * 4);
        return;
    case MOE_WFMT_F16:
        for (int64_t i = 0; i < n; i++) {
            uint16_t h;
            memcpy(&h, p + (size_t)(r * n + i) * 2, 2);
            out[i] = moe_f16_to_f32(h);
        }
        return;
    case MOE_WFMT_BF16:
        bf16_row(p + (size_t)(r * n) * 2, n, out, NULL);
        return;
    case MOE_WFMT_FP8_BLOCK:
    case MOE_WFMT_MXFP4:
    case MOE_WFMT_NVFP4:
        quant_row(w, r, NULL, out);
        return;
    }
    MOE_ASSERT(!"unknown weight format");
}
