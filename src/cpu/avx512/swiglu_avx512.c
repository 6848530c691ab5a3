/*
 * The f32 experts' SwiGLU in AVX-512F: moe_swiglu_f32 (formats/mathf.h),
 * 16 lanes at a time, the tail through masked loads and stores.
 *
 * Invariants:
 *  1. Lane by lane the operations of moe_expf_f32 and moe_swiglu_f32 in
 *     their order, each one IEEE binary32 rounding (vmulps, vaddps, vsubps,
 *     vdivps; no FMA) or exact (integer adds and shifts, compares, blends):
 *     the same bits as the scalar definition for every input. The scalar
 *     early returns (NaN, above MOE_EXPF_HI, below MOE_EXPF_LO) become
 *     blends after computing on x clamped into [LO, HI] (vmaxps / vminps
 *     return the constant for a NaN lane), so no lane computes on garbage.
 *  2. The clamp: g > L ? L : g and u > L ? L : (u < -L ? -L : u) as ordered
 *     compares (false on NaN), so a NaN operand passes, as the scalar code.
 *  3. Never allocates; no state.
 */
#include "cpu/cpu_internal.h"
#include "formats/mathf.h"

#include <immintrin.h>

#define MOE_TGT __attribute__((target("avx512f")))
#define MOE_INL static inline __attribute__((always_inline)) MOE_TGT

/* moe_expf_f32 on 16 lanes (invariant 1). */
MOE_INL __m512 expf16(__m512 x) {
    __m512 xc = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(MOE_EXPF_LO)), _mm512_set1_ps(MOE_EXPF_HI));
    __m512 k = _mm512_add_ps(_mm512_mul_ps(xc, _mm512_set1_ps(MOE_EXPF_LOG2E)), _mm512_set1_ps(MOE_EXPF_SHIFT));
    __m512i n = _mm512_sub_epi32(_mm512_castps_si512(k), _mm512_castps_si512(_mm512_set1_ps(MOE_EXPF_SHIFT)));
    __m512 nf = _mm512_sub_ps(k, _mm512_set1_ps(MOE_EXPF_SHIFT));
    __m512 r = _mm512_sub_ps(_mm512_sub_ps(xc, _mm512_mul_ps(nf, _mm512_set1_ps(MOE_EXPF_LN2_HI))),
                             _mm512_mul_ps(nf, _mm512_set1_ps(MOE_EXPF_LN2_LO)));
    __m512 p = _mm512_set1_ps(MOE_EXPF_C7);
    p = _mm512_add_ps(_mm512_set1_ps(MOE_EXPF_C6), _mm512_mul_ps(r, p));
    p = _mm512_add_ps(_mm512_set1_ps(MOE_EXPF_C5), _mm512_mul_ps(r, p));
    p = _mm512_add_ps(_mm512_set1_ps(MOE_EXPF_C4), _mm512_mul_ps(r, p));
    p = _mm512_add_ps(_mm512_set1_ps(MOE_EXPF_C3), _mm512_mul_ps(r, p));
    p = _mm512_add_ps(_mm512_set1_ps(MOE_EXPF_C2), _mm512_mul_ps(r, p));
    __m512 y = _mm512_add_ps(_mm512_set1_ps(1.0f), _mm512_add_ps(r, _mm512_mul_ps(_mm512_mul_ps(r, r), p)));
    __m512i e1 = _mm512_srai_epi32(n, 1); /* floor(n / 2) */
    __m512i e2 = _mm512_sub_epi32(n, e1);
    __m512i bias = _mm512_set1_epi32(127);
    __m512 s1 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e1, bias), 23));
    __m512 s2 = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_add_epi32(e2, bias), 23));
    __m512 res = _mm512_mul_ps(_mm512_mul_ps(y, s1), s2);
    res = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(MOE_EXPF_HI), _CMP_GT_OQ), res,
                               _mm512_castsi512_ps(_mm512_set1_epi32(0x7f800000)));
    res = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, _mm512_set1_ps(MOE_EXPF_LO), _CMP_LT_OQ), res,
                               _mm512_setzero_ps());
    return _mm512_mask_blend_ps(_mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q), res, _mm512_add_ps(x, x));
}

MOE_INL __m512 swiglu16(__m512 g, __m512 u, bool clamp, __m512 L, __m512 nL) {
    if (clamp) {
        g = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(g, L, _CMP_GT_OQ), g, L);
        __m512 lo = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(u, nL, _CMP_LT_OQ), u, nL);
        u = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(u, L, _CMP_GT_OQ), lo, L);
    }
    __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(g), _mm512_set1_epi32((int)0x80000000u)));
    __m512 e = expf16(neg);
    return _mm512_mul_ps(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.0f), e)), u);
}

MOE_TGT void moe_cpu_avx512_swiglu(float *g, const float *u, int64_t n, float limit) {
    MOE_ASSERT(n >= 0);
    bool clamp = limit > 0;
    __m512 L = _mm512_set1_ps(limit), nL = _mm512_set1_ps(-limit);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16)
        _mm512_storeu_ps(g + i, swiglu16(_mm512_loadu_ps(g + i), _mm512_loadu_ps(u + i), clamp, L, nL));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        __m512 v = swiglu16(_mm512_maskz_loadu_ps(m, g + i), _mm512_maskz_loadu_ps(m, u + i), clamp, L, nL);
        _mm512_mask_storeu_ps(g + i, m, v);
    }
}

MOE_TGT void moe_cpu_avx512_expf(const float *x, float *y, int64_t n) {
    MOE_ASSERT(n >= 0);
    int64_t i = 0;
    for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, expf16(_mm512_loadu_ps(x + i)));
    if (i < n) {
        __mmask16 m = (__mmask16)((1u << (n - i)) - 1u);
        _mm512_mask_storeu_ps(y + i, m, expf16(_mm512_maskz_loadu_ps(m, x + i)));
    }
}
