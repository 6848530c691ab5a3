/* Activation formats: rounding activations to the precision that enters a
 * GEMM (the router's bf16 input, the experts' bf16 / FP8 / NVFP4 inputs). */
#ifndef MOE_FORMATS_ACT_H
#define MOE_FORMATS_ACT_H

#include "moeaudit.h"

/* Round x [n] in place to `a` (MOE_ACT_EXACT: unchanged). FP8 modes take one
 * scale per 128 consecutive values (the last block may be partial) and leave
 * the dequantized values, exactly representable in float. NVFP4 modes need
 * the GEMM's static input scale: use moe_act_round_scaled_*. */
void moe_act_round_f32(moe_act_prec a, float *x, int64_t n);
/* The same on doubles: values are first rounded to float (no engine feeds
 * float64 activations to a bf16/fp8 GEMM), then as above. */
void moe_act_round_f64(moe_act_prec a, double *x, int64_t n);

/* The static input scale an NVFP4 activation mode applies to the input of a
 * GEMM with weight wa (and wb, a second weight reading the same input, or
 * NULL): MOE_ACT_NVFP4 the layer's (act_scale, else input_scale),
 * MOE_ACT_NVFP4_EXPERT the weight's own input_scale; the larger of the
 * two weights'. 0 for other modes, or when the weights carry none. */
float moe_act_static_scale(moe_act_prec a, const moe_weight *wa, const moe_weight *wb);

/* moe_act_round_* with the GEMM's static input scale `scale` (from
 * moe_act_static_scale). NVFP4 modes: moe_nvfp4_act_quant_row, then the
 * value the GEMM sees, code * ue4m3 * scale; scale 0 (the GEMM has none)
 * leaves x unchanged. Other modes ignore scale. */
void moe_act_round_scaled_f32(moe_act_prec a, float scale, float *x, int64_t n);
void moe_act_round_scaled_f64(moe_act_prec a, float scale, double *x, int64_t n);

#endif
