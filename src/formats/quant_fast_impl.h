/*
 * Bodies of the fast block quantizers (include/moe_quant_fast.h), written as
 * plain branch-free C that GCC auto-vectorizes. Included by exactly two
 * translation units: src/formats/quant_fast.c (baseline ISA, the portable
 * path) and src/formats/avx512/quant_avx512.c (built with AVX-512 flags). Each
 * wraps these static functions in its own named entry points.
 *
 * Invariants (why each fast path equals the reference in formats.c bit for
 * bit, for every input and in every FPU rounding mode where the reference
 * itself is independent of it):
 *  1. Block amax is the integer max of |x| bit patterns: for non-negative
 *     floats integer order is float order, and a NaN or Inf makes the max
 *     >= 0x7F800000 (NaN alone: > 0x7F800000).
 *  2. Power-of-two scale exponents come from the amax's exponent field and
 *     one mantissa comparison (6 = 1.5 * 2^2, 448 = 1.75 * 2^8), the exact
 *     answer of the reference's frexp/ldexp search, clamped the same way.
 *  3. MXFP4: y = x * 2^(127-e) in float. 2^(127-e) is a float for every
 *     e in [0, 254]; the product is the exact value the reference forms in
 *     double, rounded once. It is exact unless |y| < 2^-126, and then both
 *     |y| and the exact value lie below every E2M1 threshold (>= 0.25), with
 *     the same sign: same code.
 *  4. FP8 POW2: w / 2^p == w * 2^-p (both the correctly rounded value of
 *     the same real, 2^-p a float for p in [-127, 127]). FP8 F32 scale and
 *     NVFP4 keep the reference's fp32 division, so their roundings (and the
 *     hardware NaN a 0/0 makes) are the reference's.
 *  5. E2M1 rounding is a count of thresholds passed, all tested with >=:
 *     a strict `a > t` (a tie that goes down) is `a >= nextafterf(t, inf)`.
 *     NaN gets code 0 with no sign, as the reference.
 *  6. E4M3: |v| >= 2^-6 rounds its 23-bit mantissa to 3 bits by the integer
 *     nearest-even add (a carry moves to the next binade: codes are
 *     monotone), then saturates at 0x7E; |v| < 2^-6 rounds its 24-bit
 *     significand to a multiple of 2^-9 by the same add with a per-lane
 *     shift (code 8 = 2^-6, again by monotonicity). Integer only: float
 *     operations under a condition block GCC's if-conversion (they may trap).
 */
#ifndef MOE_QUANT_FAST_IMPL_H
#define MOE_QUANT_FAST_IMPL_H

#include "moe_formats.h"

#include <stdint.h>
#include <string.h>

static inline uint32_t qf_bits(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

static inline float qf_float(uint32_t u) {
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

/* Largest |x| bit pattern of x [n] (invariant 1). Loops here run in
 * chunks of constant length (QF_CHUNK) plus a scalar tail: GCC's -O2 cost
 * model vectorizes only loops with no epilogue. */
#define QF_CHUNK 64

static inline uint32_t qf_amax_bits(const float *x, int64_t n) {
    uint32_t m = 0;
    int64_t i = 0;
    for (; i + QF_CHUNK <= n; i += QF_CHUNK)
        for (int j = 0; j < QF_CHUNK; j++) {
            uint32_t a = qf_bits(x[i + j]) & 0x7FFFFFFFu;
            m = a > m ? a : m;
        }
    for (; i < n; i++) {
        uint32_t a = qf_bits(x[i]) & 0x7FFFFFFFu;
        m = a > m ? a : m;
    }
    return m;
}

/* The 7 E2M1 thresholds of rounding r, each passed with >= (invariant 5),
 * as bit patterns: on non-negative floats integer order is float order, and
 * integer compares vectorize where float compares (which may trap) do not. */
static inline void qf_e2m1_thresholds(moe_e2m1_round r, uint32_t t[7]) {
    static const float mid[7] = {0.25f, 0.75f, 1.25f, 1.75f, 2.5f, 3.5f, 5.0f};
    static const float val[7] = {0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    for (int k = 0; k < 7; k++) {
        if (r == MOE_E2M1_TOWARD_ZERO) {
            t[k] = qf_bits(val[k]);
        } else if (r == MOE_E2M1_RNE && (k & 1) == 0) {
            /* ties at 0.25, 1.25, 2.5, 5 go down to the even code: a > mid */
            t[k] = qf_bits(mid[k]) + 1u;
        } else {
            t[k] = qf_bits(mid[k]);
        }
    }
}

/* E2M1 code of y (any float) for thresholds t: sign | count, NaN -> 0. */
static inline uint8_t qf_e2m1_code(float y, const uint32_t t[7]) {
    uint32_t u = qf_bits(y);
    uint32_t a = u & 0x7FFFFFFFu;
    uint32_t c = (uint32_t)(a >= t[0]) + (uint32_t)(a >= t[1]) + (uint32_t)(a >= t[2]) +
                 (uint32_t)(a >= t[3]) + (uint32_t)(a >= t[4]) + (uint32_t)(a >= t[5]) +
                 (uint32_t)(a >= t[6]) + ((u >> 28) & 0x8u);
    return (uint8_t)(a > 0x7F800000u ? 0u : c);
}

/* E4M3 code of v, nearest even, saturating to +-448; NaN -> sign | 0x7F
 * (invariant 6). */
static inline uint8_t qf_e4m3_sat(float v) {
    uint32_t u = qf_bits(v);
    uint32_t a = u & 0x7FFFFFFFu;
    uint32_t s = (u >> 24) & 0x80u;
    /* normal E4M3 range: a >= 2^-6 (0x3C800000); 960 = (127 - 7) << 3 */
    int32_t cn = (int32_t)((a + 0x7FFFFu + ((a >> 20) & 1u)) >> 20) - 960;
    cn = cn > 0x7E ? 0x7E : cn;
    /* subnormal range, a < 2^-6: n = RNE(|v| * 2^9) = RNE(m * 2^-(141 - be)) with
     * m the 24-bit significand; shifts of 26 and more give 0, so cap at 31 */
    uint32_t be = a >> 23;
    uint32_t m = (a & 0x7FFFFFu) | (be ? 0x800000u : 0u);
    uint32_t sh = 141u - (be < 120u ? be : 120u);
    sh = sh > 31u ? 31u : sh;
    int32_t n = (int32_t)((m + ((1u << (sh - 1u)) - 1u) + ((m >> sh) & 1u)) >> sh);
    int32_t c = a < 0x3C800000u ? n : cn;
    c = a > 0x7F800000u ? 0x7F : c;
    return (uint8_t)(s | (uint32_t)c);
}

/* UE4M3 code of a scale, as moe_ue4m3_from_f32 (scalar, once per block). */
static inline uint8_t qf_ue4m3(float x) {
    if (x != x) return 0x7F;
    if (!(x > 0.0f)) return 0x00;
    return qf_e4m3_sat(x);
}

/* Pack 2k codes c [2k] into k bytes, element 2j in the low nibble. */
static inline void qf_pack(const uint8_t *restrict c, int k, uint8_t *restrict packed) {
    for (int j = 0; j < k; j++) packed[j] = (uint8_t)(c[2 * j] | (c[2 * j + 1] << 4));
}

/* ---------------------------------------------------------------- MXFP4 */

/* E8M0 code of an MXFP4 block from its amax bit pattern (invariant 2). */
static inline uint8_t qf_mx_scale(uint32_t m, moe_mx_scale_rule rule) {
    if (m >= 0x7F800000u) return 0xFF;
    int e = (int)(m >> 23) - 2;
    if (rule == MOE_MX_SCALE_CEIL) e += (m & 0x7FFFFFu) > 0x400000u; /* mantissa > 1.5 */
    return (uint8_t)(e < 0 ? 0 : e > 254 ? 254 : e);
}

static inline void qf_mxfp4_row(const float *restrict x, int64_t n, moe_mx_scale_rule rule,
                                moe_e2m1_round r, uint8_t *restrict packed,
                                uint8_t *restrict scales) {
    uint32_t t[7];
    qf_e2m1_thresholds(r, t);
    for (int64_t b = 0; b < n / MOE_MXFP4_BLOCK; b++) {
        const float *xb = x + b * MOE_MXFP4_BLOCK;
        uint8_t *pb = packed + b * (MOE_MXFP4_BLOCK / 2);
        uint8_t e = qf_mx_scale(qf_amax_bits(xb, MOE_MXFP4_BLOCK), rule);
        scales[b] = e;
        if (e == 0xFF) {
            memset(pb, 0, MOE_MXFP4_BLOCK / 2);
            continue;
        }
        /* 2^(127-e): biased exponent 254-e; e = 254 gives 2^-127 (subnormal) */
        float inv = qf_float(e == 254 ? 0x00400000u : (uint32_t)(254 - e) << 23);
        uint8_t c[MOE_MXFP4_BLOCK];
        for (int i = 0; i < MOE_MXFP4_BLOCK; i++) c[i] = qf_e2m1_code(xb[i] * inv, t);
        qf_pack(c, MOE_MXFP4_BLOCK / 2, pb);
    }
}

/* ---------------------------------------------------------------- NVFP4 */

static inline void qf_nvfp4_row(const float *restrict x, int64_t n, float scale2,
                                moe_e2m1_round r, uint8_t *restrict packed,
                                uint8_t *restrict scales) {
    uint32_t t[7];
    qf_e2m1_thresholds(r, t);
    const float min_scale = 1.0f / 512.0f;
    const float six_s2 = MOE_E2M1_MAX * scale2;            /* as the reference */
    for (int64_t b = 0; b < n / MOE_NVFP4_BLOCK; b++) {
        const float *xb = x + b * MOE_NVFP4_BLOCK;
        uint8_t *pb = packed + b * (MOE_NVFP4_BLOCK / 2);
        uint32_t m = qf_amax_bits(xb, MOE_NVFP4_BLOCK);
        uint8_t sc;
        if (m > 0x7F800000u) {                             /* a NaN */
            scales[b] = 0x7F;
            memset(pb, 0, MOE_NVFP4_BLOCK / 2);
            continue;
        } else if (m == 0) {
            sc = 0x38;
        } else {
            float s = qf_float(m) / six_s2;
            if (s < min_scale) s = min_scale;
            sc = qf_ue4m3(s);
        }
        scales[b] = sc;
        float d = moe_ue4m3_to_f32(sc) * scale2;
        uint8_t c[MOE_NVFP4_BLOCK];
        for (int i = 0; i < MOE_NVFP4_BLOCK; i++) c[i] = qf_e2m1_code(xb[i] / d, t);
        qf_pack(c, MOE_NVFP4_BLOCK / 2, pb);
    }
}

/* ------------------------------------------------------------------ FP8 */

/* E8M0 code of 2^ceil(log2(amax / 448)) from amax's bits (finite, > 0),
 * exponent clamped to [-127, 127] (invariant 2). */
static inline uint8_t qf_fp8_pow2_code(uint32_t m) {
    int e = (int)(m >> 23) - 8 + ((m & 0x7FFFFFu) > 0x600000u);  /* mantissa > 1.75 */
    return (uint8_t)(e < 0 ? 0 : e > 254 ? 254 : e);
}

static inline void qf_e4m3_div_row(const float *restrict w, int64_t n, float s,
                                   uint8_t *restrict q) {
    int64_t i = 0;
    for (; i + QF_CHUNK <= n; i += QF_CHUNK)
        for (int j = 0; j < QF_CHUNK; j++) q[i + j] = qf_e4m3_sat(w[i + j] / s);
    for (; i < n; i++) q[i] = qf_e4m3_sat(w[i] / s);
}

static inline void qf_e4m3_mul_row(const float *restrict w, int64_t n, float inv,
                                   uint8_t *restrict q) {
    int64_t i = 0;
    for (; i + QF_CHUNK <= n; i += QF_CHUNK)
        for (int j = 0; j < QF_CHUNK; j++) q[i + j] = qf_e4m3_sat(w[i + j] * inv);
    for (; i < n; i++) q[i] = qf_e4m3_sat(w[i] * inv);
}

/* Tile columns handled together: a 128 x 512 float panel (256 KiB) read
 * twice, once for the amaxes and once to encode, while it is in L2. */
#define QF_FP8_PANEL 4

static inline void qf_fp8_tiles(const float *w, int64_t rows, int64_t cols, moe_fp8_scale kind,
                                uint8_t *q, float *scale_f32, uint8_t *scale_e8m0) {
    const int64_t T = MOE_FP8_TILE;
    int64_t tr = (rows + T - 1) / T, tc = (cols + T - 1) / T;
    for (int64_t ti = 0; ti < tr; ti++) {
        int64_t r0 = ti * T, r1 = r0 + T < rows ? r0 + T : rows;
        for (int64_t tj0 = 0; tj0 < tc; tj0 += QF_FP8_PANEL) {
            int64_t np = tc - tj0 < QF_FP8_PANEL ? tc - tj0 : QF_FP8_PANEL;
            uint32_t m[QF_FP8_PANEL] = {0};
            float s[QF_FP8_PANEL], inv[QF_FP8_PANEL];
            int mul[QF_FP8_PANEL];
            for (int64_t r = r0; r < r1; r++)
                for (int64_t p = 0; p < np; p++) {
                    int64_t c0 = (tj0 + p) * T, c1 = c0 + T < cols ? c0 + T : cols;
                    uint32_t a = qf_amax_bits(w + r * cols + c0, c1 - c0);
                    m[p] = a > m[p] ? a : m[p];
                }
            for (int64_t p = 0; p < np; p++) {
                int64_t k = ti * tc + tj0 + p;
                int bad = m[p] >= 0x7F800000u;
                uint8_t code = bad ? 0xFF : m[p] == 0 ? 127 : qf_fp8_pow2_code(m[p]);
                mul[p] = 0;
                if (bad) {
                    s[p] = qf_float(0x7FC00000u);         /* the reference's NAN */
                } else if (m[p] == 0) {
                    s[p] = 1.0f;
                } else if (kind == MOE_FP8_SCALE_F32) {
                    s[p] = qf_float(m[p]) / MOE_FP8_E4M3_MAX;
                } else {
                    s[p] = moe_e8m0_to_f32(code);
                    /* 2^(127-code), code in [0, 247]: a normal float */
                    inv[p] = qf_float((uint32_t)(254 - code) << 23);
                    mul[p] = 1;
                }
                if (scale_f32) scale_f32[k] = s[p];
                if (scale_e8m0) scale_e8m0[k] = code;
            }
            for (int64_t r = r0; r < r1; r++)
                for (int64_t p = 0; p < np; p++) {
                    int64_t c0 = (tj0 + p) * T, c1 = c0 + T < cols ? c0 + T : cols;
                    if (mul[p]) qf_e4m3_mul_row(w + r * cols + c0, c1 - c0, inv[p], q + r * cols + c0);
                    else qf_e4m3_div_row(w + r * cols + c0, c1 - c0, s[p], q + r * cols + c0);
                }
        }
    }
}

/* ----------------------------------------------------------------- BF16 */

static inline uint16_t qf_bf16(float x) {
    uint32_t u = qf_bits(x);
    uint32_t rn = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
    uint32_t qn = ((u >> 16) & 0x8000u) | 0x7FC0u;
    return (uint16_t)((u & 0x7FFFFFFFu) > 0x7F800000u ? qn : rn);
}

static inline void qf_bf16_row(const float *restrict x, int64_t n, uint16_t *restrict out) {
    int64_t i = 0;
    for (; i + QF_CHUNK <= n; i += QF_CHUNK)
        for (int j = 0; j < QF_CHUNK; j++) out[i + j] = qf_bf16(x[i + j]);
    for (; i < n; i++) out[i] = qf_bf16(x[i]);
}

/* The entry points of one build (quant_fast_internal.h): each file that
 * compiles these bodies with its own flags expands this once. */
#define MOE_QF_DEFINE_ENTRY_POINTS(SUFFIX)                                                                     \
    void moe_qf_mxfp4_row_##SUFFIX(const float *x, int64_t n, moe_mx_scale_rule rule, moe_e2m1_round r,        \
                                   uint8_t *packed, uint8_t *scales) {                                          \
        qf_mxfp4_row(x, n, rule, r, packed, scales);                                                            \
    }                                                                                                           \
    void moe_qf_nvfp4_row_##SUFFIX(const float *x, int64_t n, float scale2, moe_e2m1_round r, uint8_t *packed, \
                                   uint8_t *scales) {                                                           \
        qf_nvfp4_row(x, n, scale2, r, packed, scales);                                                          \
    }                                                                                                           \
    void moe_qf_fp8_tiles_##SUFFIX(const float *w, int64_t rows, int64_t cols, moe_fp8_scale kind, uint8_t *q,  \
                                   float *scale_f32, uint8_t *scale_e8m0) {                                     \
        qf_fp8_tiles(w, rows, cols, kind, q, scale_f32, scale_e8m0);                                            \
    }                                                                                                           \
    void moe_qf_bf16_row_##SUFFIX(const float *x, int64_t n, uint16_t *out) { qf_bf16_row(x, n, out); }

#endif /* MOE_QUANT_FAST_IMPL_H */
