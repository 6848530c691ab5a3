/* SwiGLU expert kernels over the tokens of one expert. */
#ifndef MOE_EXPERTS_H
#define MOE_EXPERTS_H

#include "moeaudit.h"

/* Elements of scratch that moe_expert_ref / _f32 need for n tokens. */
size_t moe_expert_scratch(int64_t H, int64_t I, int64_t n);

/* Y [n, H] = expert(X [n, H]) in float64. limit: swiglu_limit, 0 = none.
 * act: rounding of the SwiGLU output before w2 (X arrives rounded).
 * scratch: moe_expert_scratch(H, I, n) doubles. */
void moe_expert_ref(const moe_weight *w1, const moe_weight *w3, const moe_weight *w2, double limit,
                    moe_act_prec act, const double *X, int64_t n, double *Y, double *scratch);

/* The same in float32 arithmetic (weights decoded to float, exact for BF16). */
void moe_expert_f32(const moe_weight *w1, const moe_weight *w3, const moe_weight *w2, double limit,
                    moe_act_prec act, const float *X, int64_t n, float *Y, float *scratch);

#endif
