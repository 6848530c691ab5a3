/*
 * Activation formats: the values that enter a GEMM when an engine feeds it
 * bf16 or FP8 activations (docs/formats.md, "FP8 activations").
 *
 * Invariants:
 *  1. The arithmetic of the path is untouched: values are rounded, then
 *     carried in float or double, so every rounded value is exact there.
 *  2. FP8 modes quantize per block of MOE_FP8_ACT_BLOCK consecutive values
 *     with moe_fp8_act_quant_row (the last block may be partial).
 */
#include "formats/act.h"
#include "core/core.h"
#include "moe_formats.h"

#include <string.h>

static const char *const act_names[] = {"exact", "bf16", "fp8", "fp8-f32scale"};

const char *moe_act_prec_name(moe_act_prec a) { return (unsigned)a < 4 ? act_names[a] : "?"; }

bool moe_act_prec_parse(const char *s, moe_act_prec *a) {
    for (int i = 0; i < 4; i++)
        if (!strcmp(s, act_names[i])) { *a = (moe_act_prec)i; return true; }
    if (!strcmp(s, "f32")) { *a = MOE_ACT_EXACT; return true; }
    return false;
}

void moe_act_round_f32(moe_act_prec a, float *x, int64_t n) {
    switch (a) {
    case MOE_ACT_EXACT:
        return;
    case MOE_ACT_BF16:
        for (int64_t i = 0; i < n; i++) x[i] = moe_bf16_to_f32(moe_bf16_from_f32(x[i]));
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

void moe_act_round_f64(moe_act_prec a, double *x, int64_t n) {
    if (a == MOE_ACT_EXACT) return;
    float buf[MOE_FP8_ACT_BLOCK];
    for (int64_t b = 0; b < n; b += MOE_FP8_ACT_BLOCK) {
        int64_t m = n - b < MOE_FP8_ACT_BLOCK ? n - b : MOE_FP8_ACT_BLOCK;
        for (int64_t i = 0; i < m; i++) buf[i] = (float)x[b + i];
        if (a == MOE_ACT_BF16) {
            for (int64_t i = 0; i < m; i++) x[b + i] = moe_bf16_to_f32(moe_bf16_from_f32(buf[i]));
            continue;
        }
        uint8_t q[MOE_FP8_ACT_BLOCK];
        float sc;
        moe_fp8_act_quant_row(buf, m, a == MOE_ACT_FP8 ? MOE_FP8_SCALE_POW2 : MOE_FP8_SCALE_F32, q, &sc);
        /* the value an FP8 activation stands for, exactly: code x scale */
        for (int64_t i = 0; i < m; i++) x[b + i] = (double)moe_fp8_e4m3_to_f32(q[i]) * (double)sc;
    }
}
