/*
 * The f32 experts' SwiGLU in AVX2: moe_swiglu_f32 (formats/mathf.h), 8
 * lanes at a time; the last n % 8 elements through moe_swiglu_f32 itself.
 *
 * Invariants:
 *  1. Lane by lane the operations of moe_expf_f32 and moe_swiglu_f32 in
 *     their order, each one IEEE binary32 rounding (vmulps, vaddps, vsubps,
 *     vdivps; no FMA) or exact (integer adds and shifts, compares, blends):
 *     the same bits as the scalar definition for every input. The scalar
 *     early returns (NaN, above MOE_EXPF_HI, below MOE_EXPF_LO) become
 *     blends after computing on x clamped into [LO, HI] (vmaxps / vminps
 *     return their second operand, the constant, for a NaN lane).
 *  2. The clamp: g > L ? L : g and u > L ? L : (u < -L ? -L : u) as ordered
 *     compares (false on NaN), so a NaN operand passes, as the scalar code.
 *  3. Never allocates; no state.
 */
#include "cpu/cpu_internal.h"
#include "formats/mathf.h"

#include <immintrin.h>

#define MOE_TGT __attribute__((target("avx2")))
#define MOE_INL static inline __attribute__((always_inline)) MOE_TGT

/* moe_expf_f32 on 8 lanes (invariant 1). */
MOE_INL __m256 expf8(__m256 x) {
    __m256 xc = _mm256_min_ps(_mm256_max_ps(x, _mm256_set1_ps(MOE_EXPF_LO)), _mm256_set1_ps(MOE_EXPF_HI));
    __m256 k = _mm256_add_ps(_mm256_mul_ps(xc, _mm256_set1_ps(MOE_EXPF_LOG2E)), _mm256_set1_ps(MOE_EXPF_SHIFT));
    __m256i n = _mm256_sub_epi32(_mm256_castps_si256(k), _mm256_castps_si256(_mm256_set1_ps(MOE_EXPF_SHIFT)));
    __m256 nf = _mm256_sub_ps(k, _mm256_set1_ps(MOE_EXPF_SHIFT));
    __m256 r = _mm256_sub_ps(_mm256_sub_ps(xc, _mm256_mul_ps(nf, _mm256_set1_ps(MOE_EXPF_LN2_HI))),
                             _mm256_mul_ps(nf, _mm256_set1_ps(MOE_EXPF_LN2_LO)));
    __m256 p = _mm256_set1_ps(MOE_EXPF_C7);
    p = _mm256_add_ps(_mm256_set1_ps(MOE_EXPF_C6), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(_mm256_set1_ps(MOE_EXPF_C5), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(_mm256_set1_ps(MOE_EXPF_C4), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(_mm256_set1_ps(MOE_EXPF_C3), _mm256_mul_ps(r, p));
    p = _mm256_add_ps(_mm256_set1_ps(MOE_EXPF_C2), _mm256_mul_ps(r, p));
    __m256 y = _mm256_add_ps(_mm256_set1_ps(1.0f), _mm256_add_ps(r, _mm256_mul_ps(_mm256_mul_ps(r, r), p)));
    __m256i e1 = _mm256_srai_epi32(n, 1); /* floor(n / 2) */
    __m256i e2 = _mm256_sub_epi32(n, e1);
    __m256i bias = _mm256_set1_epi32(127);
    __m256 s1 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e1, bias), 23));
    __m256 s2 = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e2, bias), 23));
    __m256 res = _mm256_mul_ps(_mm256_mul_ps(y, s1), s2);
    res = _mm256_blendv_ps(res, _mm256_castsi256_ps(_mm256_set1_epi32(0x7f800000)),
                           _mm256_cmp_ps(x, _mm256_set1_ps(MOE_EXPF_HI), _CMP_GT_OQ));
    res = _mm256_blendv_ps(res, _mm256_setzero_ps(), _mm256_cmp_ps(x, _mm256_set1_ps(MOE_EXPF_LO), _CMP_LT_OQ));
    return _mm256_blendv_ps(res, _mm256_add_ps(x, x), _mm256_cmp_ps(x, x, _CMP_UNORD_Q));
}

MOE_TGT void moe_cpu_avx2_swiglu(float *g, const float *u, int64_t n, float limit) {
    MOE_ASSERT(n >= 0);
    bool clamp = limit > 0;
    __m256 L = _mm256_set1_ps(limit), nL = _mm256_set1_ps(-limit), one = _mm256_set1_ps(1.0f);
    __m256 sign = _mm256_castsi256_ps(_mm256_set1_epi32((int)0x80000000u));
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        __m256 gv = _mm256_loadu_ps(g + i), uv = _mm256_loadu_ps(u + i);
        if (clamp) {
            gv = _mm256_blendv_ps(gv, L, _mm256_cmp_ps(gv, L, _CMP_GT_OQ));
            __m256 lo = _mm256_blendv_ps(uv, nL, _mm256_cmp_ps(uv, nL, _CMP_LT_OQ));
            uv = _mm256_blendv_ps(lo, L, _mm256_cmp_ps(uv, L, _CMP_GT_OQ));
        }
        __m256 e = expf8(_mm256_xor_ps(gv, sign));
        _mm256_storeu_ps(g + i, _mm256_mul_ps(_mm256_div_ps(gv, _mm256_add_ps(one, e)), uv));
    }
    for (; i < n; i++) g[i] = moe_swiglu_f32(g[i], u[i], limit);
}

MOE_TGT void moe_cpu_avx2_expf(const float *x, float *y, int64_t n) {
    MOE_ASSERT(n >= 0);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, expf8(_mm256_loadu_ps(x + i)));
    for (; i < n; i++) y[i] = moe_expf_f32(x[i]);
}
