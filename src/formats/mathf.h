/*
 * Elementwise float32 math of our own: the exp and the SwiGLU of the f32
 * expert path. Their bits are fixed here, not by the C library: glibc picks
 * an expf by CPU (FMA or not, ifunc), so libm's expf could give one machine
 * other SwiGLU bits than another, and an audit's verdicts must compare
 * across machines.
 *
 * Invariants:
 *  1. moe_expf_f32 is a fixed sequence of IEEE binary32 operations (add,
 *     sub, mul rounded to nearest even, no fused multiply-add: the build's
 *     -ffp-contract=off) and exact integer operations, in one order that the
 *     SIMD versions (src/cpu/avx2/swiglu_avx2.c, src/cpu/avx512/
 *     swiglu_avx512.c) repeat lane by lane: scalar, AVX2 and AVX-512 give
 *     the same bits for every input (tests/test-kernels.c checks it on
 *     adversarial inputs, tests/test-formats.c on a dense sweep).
 *  2. Results under the default floating-point environment (round to
 *     nearest, no flush-to-zero or denormals-are-zero in MXCSR); the library
 *     never changes it.
 */
#ifndef MOE_FORMATS_MATHF_H
#define MOE_FORMATS_MATHF_H

/* The algorithm's constants (the SIMD versions use these same values). */
#define MOE_EXPF_HI 0x1.62e42ep+6f     /* largest x whose exp rounds below +Inf (88.7228317) */
#define MOE_EXPF_LO (-0x1.9fe368p+6f)  /* smallest x whose exp rounds above +0 (-103.972076) */
#define MOE_EXPF_LOG2E 0x1.715476p+0f  /* 1/ln 2 rounded to float */
#define MOE_EXPF_SHIFT 0x1.8p+23f      /* t + 1.5 * 2^23 rounds t to an integer (|t| < 2^22) */
#define MOE_EXPF_LN2_HI 0x1.62e4p-1f   /* ln 2 to 15 bits: n * LN2_HI is exact for |n| <= 256 */
#define MOE_EXPF_LN2_LO 0x1.7f7d1cp-20f /* ln 2 - LN2_HI rounded to float */
/* exp(r) ~ 1 + r + r^2 (C2 + r (C3 + r (C4 + r (C5 + r (C6 + r C7))))): the
 * Taylor coefficients 1/k! rounded to float. |r| <= ln2/2 + 1e-5 (n comes
 * from the rounded x * LOG2E), where the truncation r^8/8! < 5.3e-9
 * relative (0.09 ulp). */
#define MOE_EXPF_C2 0x1p-1f
#define MOE_EXPF_C3 0x1.555556p-3f
#define MOE_EXPF_C4 0x1.555556p-5f
#define MOE_EXPF_C5 0x1.111112p-7f
#define MOE_EXPF_C6 0x1.6c16c2p-10f
#define MOE_EXPF_C7 0x1.a01a02p-13f

/*
 * e^x in float32, the same bits on every x86-64 (invariant 1).
 *
 *   NaN -> NaN (quiet: x + x), +Inf -> +Inf, -Inf -> +0;
 *   x > MOE_EXPF_HI -> +Inf and x < MOE_EXPF_LO -> +0, the thresholds of
 *   the correctly rounded exp; subnormal results by gradual underflow, one
 *   rounding (the power of two is applied in two exact-then-one-rounding
 *   steps).
 *   Error: at most MOE_EXPF_MAX_ULP ulps against the exact e^x, measured
 *   (tests/test-formats.c, docs/formats.md "exp").
 *
 * Method: n = round(x / ln 2) (the 1.5 * 2^23 shift), r = (x - n LN2_HI) -
 * n LN2_LO (the first difference exact: n LN2_HI is exact and within a
 * factor 2 of x, Sterbenz), exp(r) by the degree-7 polynomial above, then
 * times 2^floor(n/2) (exact) and 2^(n - floor(n/2)) (the one rounding).
 * Pure, thread-safe, no errors.
 */
float moe_expf_f32(float x);

/* The documented bound of moe_expf_f32 in ulps of the exact result (ulp of
 * a subnormal: 2^-149): the sweep of all 2^32 floats measured 1.0226 ulp
 * for normal results (x = 0x1.da2aap+5) and 0.7494 for subnormal ones
 * (MOE_EXPF_EXHAUSTIVE=1 ./build/test-formats, docs/formats.md "exp");
 * 99.19% of results are the correctly rounded float. */
#define MOE_EXPF_MAX_ULP 1.03

/*
 * The SwiGLU of one element of the f32 experts:
 *   L > 0:  g = min(g, L), u = clamp(u, -L, L), NaN-propagating (a NaN
 *           operand is returned, as torch.clamp does);
 *   then    g / (1 + moe_expf_f32(-g)) * u, each operation one IEEE float
 *           rounding (the division correctly rounded).
 * L <= 0 (or NaN): no clamp. The kernel tables' swiglu entries
 * (cpu/kernels.h) give these bits element for element.
 */
static inline float moe_swiglu_f32(float g, float u, float L) {
    if (L > 0) {
        g = g > L ? L : g;
        u = u > L ? L : (u < -L ? -L : u);
    }
    return g / (1.0f + moe_expf_f32(-g)) * u;
}

#endif
