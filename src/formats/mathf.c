/*
 * moe_expf_f32: the scalar definition (formats/mathf.h states the method,
 * the bound and invariant 1: every operation below is one IEEE binary32
 * rounding or exact integer arithmetic, in the order the SIMD versions
 * repeat).
 */
#include "formats/mathf.h"

#include <stdint.h>
#include <string.h>

static inline uint32_t bits_of(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static inline float float_of(uint32_t u) {
    float f;
    memcpy(&f, &u, 4);
    return f;
}

float moe_expf_f32(float x) {
    if (x != x) return x + x;                 /* NaN: quiet */
    if (x > MOE_EXPF_HI) return float_of(0x7f800000u);
    if (x < MOE_EXPF_LO) return 0.0f;
    /* n = round(x * log2e), nearest even: |x * log2e| < 151, so t + SHIFT
     * has its integer in the low mantissa bits */
    float k = x * MOE_EXPF_LOG2E + MOE_EXPF_SHIFT;
    int32_t n = (int32_t)bits_of(k) - (int32_t)bits_of(MOE_EXPF_SHIFT);
    float nf = k - MOE_EXPF_SHIFT;            /* exact: n as a float */
    float r = (x - nf * MOE_EXPF_LN2_HI) - nf * MOE_EXPF_LN2_LO;
    float p = MOE_EXPF_C7;
    p = MOE_EXPF_C6 + r * p;
    p = MOE_EXPF_C5 + r * p;
    p = MOE_EXPF_C4 + r * p;
    p = MOE_EXPF_C3 + r * p;
    p = MOE_EXPF_C2 + r * p;
    float y = 1.0f + (r + (r * r) * p);       /* exp(r), in [0.70, 1.42] */
    /* y * 2^n as (y * 2^e1) * 2^e2, e1 = floor(n / 2) (n in [-150, 128]:
     * e1, e2 in [-75, 64], both powers normal, y * 2^e1 exact and normal):
     * one rounding, correct through the subnormals */
    int32_t e1 = (n + 256) / 2 - 128;         /* floor(n / 2), an arithmetic shift in the SIMD versions */
    int32_t e2 = n - e1;
    float s1 = float_of((uint32_t)(e1 + 127) << 23), s2 = float_of((uint32_t)(e2 + 127) << 23);
    return (y * s1) * s2;
}
