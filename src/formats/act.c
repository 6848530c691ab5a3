/*
 * Activation formats: the values that enter a GEMM when an engine feeds it
 * bf16 or FP8 activations (docs/formats.md, "FP8 activations").
 *
 * Invariants:
 *  1. The arithmetic of the path is untouched: values are rounded, then
 *     carried in float or double, so every rounded value is exact there.
 *  2. FP8 modes quantize per block of MOE_FP8_ACT_BLOCK consecutive values
 *     with moe_fp8_act_quant_row (the last block may be partial).
 *  3. NVFP4 modes quantize per block of 16 with the GEMM's static input scale
 *     (moe_nvfp4_act_quant_row); a GEMM without one keeps its activations.
 *     Blocks of 16 never straddle the 128-value chunks processed here.
 */
#include "formats/act.h"
#include "core/core.h"
#include "moe_formats.h"

#include <string.h>

static const char *const act_names[] = {"exact", "bf16", "fp8", "fp8-f32scale", "nvfp4", "nvfp4-expert"};
#define N_ACT ((int)(sizeof act_names / sizeof act_names[0]))

const char *moe_act_prec_name(moe_act_prec a) { return (unsigned)a < (unsigned)N_ACT ? act_names[a] : "?"; }

bool moe_act_prec_parse(const char *s, moe_act_prec *a) {
    for (int i = 0; i < N_ACT; i++)
        if (!strcmp(s, act_names[i])) { *a = (moe_act_prec)i; return true; }
    if (!strcmp(s, "f32")) { *a = MOE_ACT_EXACT; return true; }
    return false;
}

void moe_act_round_f32(moe_act_prec a, float *x, int64_t n) { moe_act_round_scaled_f32(a, 0.0f, x, n); }

void moe_act_round_f64(moe_act_prec a, double *x, int64_t n) { moe_act_round_scaled_f64(a, 0.0f, x, n); }

static float w_scale(moe_act_prec a, const moe_weight *w) {
    if (!w) return 0.0f;
    if (a == MOE_ACT_NVFP4 && w->act_scale > 0) return w->act_scale;
    return w->input_scale;
}

float moe_act_static_scale(moe_act_prec a, const moe_weight *wa, const moe_weight *wb) {
    if (a != MOE_ACT_NVFP4 && a != MOE_ACT_NVFP4_EXPERT) return 0.0f;
    float x = w_scale(a, wa), y = w_scale(a, wb);
    return x > y ? x : y;
}

/* NVFP4 blocks of x [n] (float): the values the GEMM sees, into out32 or out64. */
static void nvfp4_round(float scale, const float *x, int64_t n, float *out32, double *out64) {
    uint8_t codes[MOE_FP8_ACT_BLOCK], sf[MOE_FP8_ACT_BLOCK / MOE_NVFP4_BLOCK];
    for (int64_t b = 0; b < n; b += MOE_FP8_ACT_BLOCK) {
        int64_t m = n - b < MOE_FP8_ACT_BLOCK ? n - b : MOE_FP8_ACT_BLOCK;
        moe_nvfp4_act_quant_row(x + b, m, scale, codes, sf);
        for (int64_t i = 0; i < m; i++) {
            /* e2m1 * ue4m3 is exact in float; the static scale rounds once
             * in float (exact in double) */
            float v = moe_e2m1_to_f32(codes[i]) * moe_ue4m3_to_f32(sf[i / MOE_NVFP4_BLOCK]);
            if (out32) out32[b + i] = v * scale;
            else out64[b + i] = (double)v * (double)scale;
        }
    }
}

/* x[i] = moe_bf16_round(x[i]) (moe_formats.h) without its call per
 * element (~2-3 ns each on the machines of docs/performance.md: 50 M
 * elements per T = 4096 V4-Flash step): nearest even on the upper 16 bits,
 * a NaN becomes the quiet NaN of its sign; 4 lanes at a time in generic
 * vector arithmetic (every x86-64 has 128-bit integer vectors); the tail
 * (n % 4) calls moe_bf16_round. tests/test-formats.c (test_bf16_act)
 * compares the vector lanes with moe_bf16_round bit for bit. */
typedef uint32_t act_u32x4 __attribute__((vector_size(16)));

static void bf16_round(float *x, int64_t n) {
    int64_t i = 0;
    for (; i + 4 <= n; i += 4) {
        act_u32x4 u, r, q, nan;
        memcpy(&u, x + i, sizeof u);
        nan = (act_u32x4)((u & 0x7FFFFFFFu) > 0x7F800000u); /* all ones in a NaN lane */
        q = (u & 0x80000000u) | 0x7FC00000u;
        r = (u + 0x7FFFu + ((u >> 16) & 1u)) & 0xFFFF0000u;
        r = (q & nan) | (r & ~nan);
        memcpy(x + i, &r, sizeof r);
    }
    for (; i < n; i++) x[i] = moe_bf16_round(x[i]); /* the definition itself */
}

void moe_act_round_scaled_f32(moe_act_prec a, float scale, float *x, int64_t n) {
    switch (a) {
    case MOE_ACT_NVFP4:
    case MOE_ACT_NVFP4_EXPERT:
        if (scale > 0) nvfp4_round(scale, x, n, x, NULL);
        return;
    case MOE_ACT_EXACT:
        return;
    case MOE_ACT_BF16:
        bf16_round(x, n);
        return;
    case MOE_ACT_FP8:
    case MOE_ACT_FP8_F32SCALE: {
        moe_fp8_scale kind = a == MOE_ACT_FP8 ? MOE_FP8_SCALE_POW2 : MOE_FP8_SCALE_F32;
        for (int64_t b = 0; b < n; b += MOE_FP8_ACT_BLOCK) {
            int64_t m = n - b < MOE_FP8_ACT_BLOCK ? n - b : MOE_FP8_ACT_BLOCK;
            uint8_t q[MOE_FP8_ACT_BLOCK];
            float sc;
            moe_fp8_act_quant_row(x + b, m, kind, q, &sc);
            /* dequantize: code times the block scale (one rounding to float
             * for the fp32 scale; exact for the power of two) */
            for (int64_t i = 0; i < m; i++) x[b + i] = moe_fp8_e4m3_to_f32(q[i]) * sc;
        }
        return;
    }
    }
    MOE_ASSERT(!"unknown activation precision");
}

void moe_act_round_scaled_f64(moe_act_prec a, float scale, double *x, int64_t n) {
    if (a == MOE_ACT_EXACT) return;
    if ((a == MOE_ACT_NVFP4 || a == MOE_ACT_NVFP4_EXPERT) && !(scale > 0)) return;
    float buf[MOE_FP8_ACT_BLOCK];
    for (int64_t b = 0; b < n; b += MOE_FP8_ACT_BLOCK) {
        int64_t m = n - b < MOE_FP8_ACT_BLOCK ? n - b : MOE_FP8_ACT_BLOCK;
        for (int64_t i = 0; i < m; i++) buf[i] = (float)x[b + i];
        if (a == MOE_ACT_BF16) {
            for (int64_t i = 0; i < m; i++) x[b + i] = moe_bf16_to_f32(moe_bf16_from_f32(buf[i]));
            continue;
        }
        if (a == MOE_ACT_NVFP4 || a == MOE_ACT_NVFP4_EXPERT) {
            nvfp4_round(scale, buf, m, NULL, x + b);
            continue;
        }
        uint8_t q[MOE_FP8_ACT_BLOCK];
        float sc;
        moe_fp8_act_quant_row(buf, m, a == MOE_ACT_FP8 ? MOE_FP8_SCALE_POW2 : MOE_FP8_SCALE_F32, q, &sc);
        /* the value an FP8 activation stands for, exactly: code x scale */
        for (int64_t i = 0; i < m; i++) x[b + i] = (double)moe_fp8_e4m3_to_f32(q[i]) * (double)sc;
    }
}
