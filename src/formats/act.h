/* Activation formats: rounding activations to the precision that enters a
 * GEMM (the router's bf16 input, the experts' bf16 / FP8 inputs). */
#ifndef MOE_FORMATS_ACT_H
#define MOE_FORMATS_ACT_H

#include "moeaudit.h"

/* Round x [n] in place to `a` (MOE_ACT_EXACT: unchanged). FP8 modes take one
 * scale per 128 consecutive values (the last block may be partial) and leave
 * the dequantized values, exactly representable in float. */
void moe_act_round_f32(moe_act_prec a, float *x, int64_t n);
/* The same on doubles: values are first rounded to float (no engine feeds
 * float64 activations to a bf16/fp8 GEMM), then as above. */
void moe_act_round_f64(moe_act_prec a, double *x, int64_t n);

#endif
