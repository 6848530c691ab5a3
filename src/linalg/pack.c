/*
 * Decode a block of weight rows to float64 and pack it for the GEMM tiles.
 *
 * Invariants:
 *  1. Every packed value equals moe_weight_row_f64's (io/weights.c through
 *     src/formats) bit for bit, NaN payloads aside. Each format's value is an
 *     exact product in float64, so the order of its factors cannot matter:
 *       F64, F32, F16, BF16   the stored value, widened (exact)
 *       FP8_BLOCK             e4m3 * m, m = (double)scale (F32 tiles) or
 *                             2^(e-127) (E8M0 tiles; NaN for e = 0xFF):
 *                             at most 4 x 24 significant bits, and
 *                             |e4m3 * 2^(e-127)| stays in [2^-136, 2^136]
 *       MXFP4                 e2m1 * m, m = 2^(e-127) (NaN for 0xFF)
 *       NVFP4                 e2m1 * m, m = ue4m3 * scale2 (2 x 4 x 24
 *                             significant bits; the reference multiplies
 *                             (e2m1 * ue4m3) * scale2, the same exact value,
 *                             the same sign of zero)
 *     so 2^(e-127) * v equals the reference's ldexp(v, e - 127) and
 *     NaN/Inf scales give NaN exactly where the reference does. FP8 blocks
 *     other than 128 x 128 (block_rows / block_cols: V4.1's 32 x 32) take
 *     the same products block by block; compressed-tensors NVFP4
 *     (global_scale G > 0) is (e2m1 * ue4m3) / G, as the reference divides.
 *     Only this scalar packer knows those two: moe_dgemm_block sends them
 *     here (moe_dgemm_pack_generic_only) whatever the ISA.
 *  2. Nothing is allocated: the 256-entry E4M3 table and one chunk of 32
 *     columns of the panel's rows (6 KiB) live on the stack. Rows are decoded
 *     chunk by chunk and transposed into the panel, so that the panel lines
 *     being written stay in L1 (writing one row's 256 columns at a time
 *     touched 256 lines 192 bytes apart and ran 3-4x slower).
 */
#include "linalg/linalg_internal.h"

#include "core/core.h"
#include "formats/weight.h"
#include "moe_formats.h"

#include <math.h>
#include <string.h>

enum { CHUNK = 32, NR_MAX = 24 };


/* Columns k0 .. k0+n-1 of row r into dst[0 .. n-1] (n <= CHUNK). */
static void decode_row(const moe_weight *w, int64_t r, int64_t k0, int64_t n, double *dst, const double *e4m3) {
    const uint8_t *d = (const uint8_t *)w->data;
    const uint8_t *s8 = (const uint8_t *)w->scale;
    int64_t cols = w->cols;
    switch (w->fmt) {
    case MOE_WFMT_F64:
        memcpy(dst, d + (size_t)(r * cols + k0) * 8, (size_t)n * 8);
        return;
    case MOE_WFMT_F32: {
        float f[CHUNK];
        memcpy(f, d + (size_t)(r * cols + k0) * 4, (size_t)n * 4);
        for (int64_t k = 0; k < n; k++) dst[k] = (double)f[k];
        return;
    }
    case MOE_WFMT_F16:
    case MOE_WFMT_BF16: {
        uint16_t h[CHUNK];
        memcpy(h, d + (size_t)(r * cols + k0) * 2, (size_t)n * 2);
        if (w->fmt == MOE_WFMT_F16)
            for (int64_t k = 0; k < n; k++) dst[k] = (double)moe_f16_to_f32(h[k]);
        else
            for (int64_t k = 0; k < n; k++) dst[k] = (double)moe_bf16_to_f32(h[k]);
        return;
    }
    case MOE_WFMT_FP8_BLOCK: {
        const uint8_t *q = d + (size_t)(r * cols + k0);
        const int64_t br = moe_weight_fp8_br(w), bc = moe_weight_fp8_bc(w);
        size_t srow = (size_t)((r / br) * w->scale_cols);
        for (int64_t k = 0; k < n;) {
            int64_t tc = (k0 + k) / bc, end = (tc + 1) * bc - k0;
            if (end > n) end = n;
            double m;
            if (w->scale_dtype == MOE_DTYPE_F8_E8M0) {
                m = moe_dgemm_e8m0(s8[srow + (size_t)tc]);
            } else {
                float f;
                memcpy(&f, s8 + (srow + (size_t)tc) * 4, 4);
                m = (double)f;
            }
            for (; k < end; k++) dst[k] = e4m3[q[k]] * m;
        }
        return;
    }
    case MOE_WFMT_MXFP4:
    case MOE_WFMT_NVFP4: {
        MOE_ASSERT(k0 % 2 == 0 && n % 2 == 0);
        static const double e2m1[16] = {0.0,  0.5,  1.0,  1.5,  2.0,  3.0,  4.0,  6.0,
                                        -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0};
        const bool mx = w->fmt == MOE_WFMT_MXFP4;
        const int64_t blk = mx ? MOE_MXFP4_BLOCK : MOE_NVFP4_BLOCK;
        const uint8_t *q = d + (size_t)(r * (cols / 2) + k0 / 2);
        const uint8_t *sr = s8 + (size_t)(r * w->scale_cols);
        for (int64_t k = 0; k < n;) {
            int64_t b = (k0 + k) / blk, end = (b + 1) * blk - k0;
            if (end > n) end = n;
            if (!mx && w->global_scale > 0) { /* compressed-tensors: (e2m1 * ue4m3) / G, one rounding */
                double u = (double)moe_ue4m3_to_f32(sr[b]);
                for (; k < end; k += 2) {
                    uint8_t byte = q[k / 2];
                    dst[k] = e2m1[byte & 0xF] * u / w->global_scale;
                    dst[k + 1] = e2m1[byte >> 4] * u / w->global_scale;
                }
                continue;
            }
            double m = mx ? moe_dgemm_e8m0(sr[b]) : (double)moe_ue4m3_to_f32(sr[b]) * (double)w->scale2;
            for (; k < end; k += 2) {
                uint8_t byte = q[k / 2];
                dst[k] = e2m1[byte & 0xF] * m;
                dst[k + 1] = e2m1[byte >> 4] * m;
            }
        }
        return;
    }
    }
    MOE_ASSERT(!"unknown weight format");
}

bool moe_dgemm_pack_generic_only(const moe_weight *w) {
    return !moe_weight_fast_layout(w) || (w->fmt == MOE_WFMT_NVFP4 && w->global_scale > 0);
}

/* E4M3 codes as float64 (exact). */
static void e4m3_table(double *t) {
    for (int c = 0; c < 256; c++) t[c] = (double)moe_fp8_e4m3_to_f32((uint8_t)c);
}

void moe_dgemm_decode_row(const moe_weight *w, int64_t r, int64_t k0, int64_t n, double *dst) {
    MOE_ASSERT(n >= 0 && n <= CHUNK);
    double e4m3[256];
    if (w->fmt == MOE_WFMT_FP8_BLOCK) e4m3_table(e4m3);
    decode_row(w, r, k0, n, dst, e4m3);
}

void moe_dgemm_pack(const moe_weight *w, int64_t r0, int64_t nrows, int64_t k0, int64_t kc, int nr, double *Wp) {
    MOE_ASSERT(r0 >= 0 && nrows >= 0 && r0 + nrows <= w->rows && k0 >= 0 && kc >= 0 && k0 + kc <= w->cols);
    MOE_ASSERT(nr >= 1 && nr <= NR_MAX);
    double e4m3[256];
    if (w->fmt == MOE_WFMT_FP8_BLOCK) e4m3_table(e4m3);
    double tmp[NR_MAX][CHUNK]; /* one chunk of the panel's rows, row-major */
    int64_t npan = (nrows + nr - 1) / nr;
    for (int64_t p = 0; p < npan; p++) {
        double *panel = Wp + p * kc * nr;
        int live = (int)(nrows - p * nr < nr ? nrows - p * nr : nr);
        /* chunk by chunk, so that the panel's lines being written stay in L1 */
        for (int64_t c0 = 0; c0 < kc; c0 += CHUNK) {
            int64_t n = kc - c0 < CHUNK ? kc - c0 : CHUNK;
            for (int j = 0; j < live; j++) decode_row(w, r0 + p * nr + j, k0 + c0, n, tmp[j], e4m3);
            for (int j = live; j < nr; j++)
                for (int64_t k = 0; k < n; k++) tmp[j][k] = 0.0;
            for (int64_t k = 0; k < n; k++)
                for (int j = 0; j < nr; j++) panel[(c0 + k) * nr + j] = tmp[j][k];
        }
    }
}

void moe_dgemm_pack_ptrs(const double *const *v, bool by_cols, int64_t r0, int64_t nrows, int64_t k0, int64_t kc,
                         int nr, double *Wp) {
    MOE_ASSERT(nrows >= 0 && kc >= 0 && nr >= 1);
    int64_t npan = (nrows + nr - 1) / nr;
    for (int64_t p = 0; p < npan; p++) {
        double *panel = Wp + p * kc * nr;
        for (int64_t k = 0; k < kc; k++)
            for (int j = 0; j < nr; j++) {
                int64_t r = p * nr + j;
                panel[k * nr + j] = r >= nrows ? 0.0 : by_cols ? v[k0 + k][r0 + r] : v[r0 + r][k0 + k];
            }
    }
}
