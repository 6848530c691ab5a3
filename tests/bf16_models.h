/*
 * Scalar models of the bf16-activation kernels' exact operation sequences
 * (src/cpu/avx512/gemm_avx512.c: vdpbf16ps; src/cpu/amx/gemm_amx.c: AMX
 * TDPBF16PS), shared by test-kernels and test-amx-emu. Every fma and add
 * reads inputs below 2^-126 as zero and flushes such results, as both
 * instructions define.
 */
#ifndef MOE_TEST_BF16_MODELS_H
#define MOE_TEST_BF16_MODELS_H

#include "cpu/cpu_internal.h"
#include "formats/weight.h"
#include "core/core.h"
#include "moe_formats.h"

#include <math.h>

/* vdpbf16ps's arithmetic: inputs below 2^-126 read as zero, one fp32 fma
 * rounded to nearest even, a result below 2^-126 flushed to zero. */
static inline float daz(float v) { return fabsf(v) < 0x1p-126f ? copysignf(0.0f, v) : v; }
static long model_ties; /* fmas of the model whose exact result was halfway between two floats */
static inline float fma_ftz(float x, float w, float acc) {
    x = daz(x);
    w = daz(w);
    acc = daz(acc);
    float r = fmaf(x, w, acc);
    /* x * w is exact in double, and a halfway sum needs <= 25 bits: exact too */
    double ex = (double)acc + (double)x * (double)w;
    if (isfinite(r) && (double)r != ex) {
        float o = nextafterf(r, ex > (double)r ? INFINITY : -INFINITY);
        model_ties += fabs((double)o - ex) == fabs((double)r - ex);
    }
    return daz(r);
}

/* The value the bf16 kernel multiplies for weight (r, k): the decoded
 * weight, NVFP4 without scale2. */
static inline float bf16act_weight(const moe_weight *w, int64_t r, int64_t k) {
    if (w->fmt != MOE_WFMT_NVFP4) return moe_weight_at_f32(w, r, k);
    uint8_t b = ((const uint8_t *)w->data)[(size_t)(r * (w->cols / 2) + k / 2)];
    uint8_t sc = ((const uint8_t *)w->scale)[(size_t)(r * w->scale_cols + k / MOE_NVFP4_BLOCK)];
    return moe_e2m1_to_f32((uint8_t)((k & 1) ? b >> 4 : b & 0xF)) * moe_ue4m3_to_f32(sc);
}

/* Column of word p of a decoded 32-column chunk (gemm_avx512.c): FP4 words
 * come out in the order e2m1_perm(p) = 4 (p mod 8) + p / 8, BF16 in order. */
static inline int64_t bf16act_col(const moe_weight *w, int p) {
    return w->fmt == MOE_WFMT_BF16 ? p : 4 * (p % 8) + p / 8;
}

/* gemm_bf16act's operation sequence for (token x, row r), in scalar code:
 * 16 lanes, chunk by chunk, the pair's high word (2i + 1) first; the hsum16
 * tree; scale2. */
static inline float bf16act_model(const moe_weight *w, int64_t r, const float *x) {
    float acc[16] = {0};
    int64_t cols = w->cols;
    for (int64_t c = 0; c < (cols + 31) / 32; c++)
        for (int i = 0; i < 16; i++)
            for (int hi = 1; hi >= 0; hi--) {
                int64_t k = 32 * c + bf16act_col(w, 2 * i + hi);
                if (k < cols) acc[i] = fma_ftz(moe_bf16_round(x[k]), bf16act_weight(w, r, k), acc[i]);
                else acc[i] = fma_ftz(0.0f, 0.0f, acc[i]);
            }
    float a[8], b[4];
    for (int i = 0; i < 8; i++) a[i] = acc[i] + acc[i + 8];
    for (int i = 0; i < 4; i++) b[i] = a[i] + a[i + 4];
    float y = (b[0] + b[2]) + (b[1] + b[3]);
    return w->fmt == MOE_WFMT_NVFP4 ? y * w->scale2 : y;
}

static inline float add_ftz(float a, float b) { return daz(daz(a) + daz(b)); }

/* The AMX table's operation sequence for (token x, row r) (gemm_amx.c,
 * Intel SDM TDPBF16PS): per 32-column step, the even- and odd-position
 * products in two chains from zero (one fma each, DAZ/FTZ), their sum added
 * to the accumulator; scale2 last. */
static inline float amx_model(const moe_weight *w, int64_t r, const float *x) {
    int64_t cols = w->cols;
    float c = 0.0f;
    for (int64_t s = 0; s < (cols + 31) / 32; s++) {
        float e = 0.0f, o = 0.0f;
        for (int kp = 0; kp < 16; kp++) {
            int64_t k0 = 32 * s + bf16act_col(w, 2 * kp), k1 = 32 * s + bf16act_col(w, 2 * kp + 1);
            e = fma_ftz(k0 < cols ? moe_bf16_round(x[k0]) : 0.0f, k0 < cols ? bf16act_weight(w, r, k0) : 0.0f, e);
            o = fma_ftz(k1 < cols ? moe_bf16_round(x[k1]) : 0.0f, k1 < cols ? bf16act_weight(w, r, k1) : 0.0f, o);
        }
        c = add_ftz(c, add_ftz(e, o));
    }
    return w->fmt == MOE_WFMT_NVFP4 ? c * w->scale2 : c;
}

#endif
