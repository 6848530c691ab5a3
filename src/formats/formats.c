/*
 * Scalar reference encoders and block codecs of the number formats
 * (include/moe_formats.h, docs/formats.md). These are the definitions the
 * fast kernels are tested against: plain C, no fast-math, no dependence on
 * the FPU rounding mode.
 *
 * Invariants:
 *  1. Every rounding decision is made on an exact value: the magnitude to
 *     round is a double holding a float (or a float times a power of two),
 *     its significand scaled to an integer part and a fraction by ldexp,
 *     both exact, and the fraction compared with 0.5 exactly.
 *  2. Minifloat codes are monotone in magnitude: code = ((E - emin) << M) + n
 *     where n is the rounded significand in units of the quantum. A
 *     rounding that carries into the next binade gives the right code with
 *     no special case, and the code one past the largest finite value is the
 *     format's overflow (E4M3: 480, E5M2: 2^16, E2M1: 8).
 *  3. Scale exponents are found with frexp and exact comparisons against
 *     m * 2^e in double, never with log2.
 */
#include "moe_formats.h"

#include "core/core.h"

#include <float.h>
#include <math.h>

/* ------------------------------------------------------------- helpers */

typedef enum round_mode { ROUND_NEAREST_EVEN, ROUND_TIES_AWAY, ROUND_TOWARD_ZERO } round_mode;

/* Magnitude code of a >= 0 (finite) in a minifloat with M mantissa bits and
 * minimum normal exponent emin (unbiased), with no upper bound on the
 * exponent: codes past the format's largest value mean overflow. Values
 * whose binade lies above emax_cut return INT32_MAX. */
static int32_t round_magnitude(double a, int M, int emin, int emax_cut, round_mode rm) {
    if (a == 0.0) return 0;
    int k;
    (void)frexp(a, &k);
    int E = k - 1;                      /* a in [2^E, 2^(E+1)) */
    if (E > emax_cut) return INT32_MAX;
    int Eeff = E < emin ? emin : E;     /* subnormals share emin's quantum */
    double t = ldexp(a, M - Eeff);      /* a / quantum, exact */
    double n = floor(t);
    double frac = t - n;                /* exact: t has < 53 significant bits */
    switch (rm) {
    case ROUND_NEAREST_EVEN:
        if (frac > 0.5 || (frac == 0.5 && fmod(n, 2.0) != 0.0)) n += 1.0;
        break;
    case ROUND_TIES_AWAY:
        if (frac >= 0.5) n += 1.0;
        break;
    case ROUND_TOWARD_ZERO:
        break;
    }
    return (int32_t)(((int64_t)(Eeff - emin) << M) + (int64_t)n);
}

/* Smallest integer e with m * 2^e >= a, for finite a > 0 and m > 0; exact. */
static int ceil_exp_ratio(double a, double m) {
    int k;
    (void)frexp(a / m, &k);             /* estimate, off by at most one */
    int e = k;
    while (ldexp(m, e) < a) e++;
    while (ldexp(m, e - 1) >= a) e--;
    return e;
}

static int clamp_int(int v, int lo, int hi) { return v < lo ? lo : v > hi ? hi : v; }

/* E2M1 code of a double (exact input, e.g. a float times a power of two). */
static uint8_t e2m1_from_f64(double x, moe_e2m1_round r) {
    uint8_t s = signbit(x) ? 0x8u : 0x0u;
    if (isnan(x)) return 0x0;
    if (isinf(x)) return (uint8_t)(s | 0x7u);
    round_mode rm = ROUND_NEAREST_EVEN;
    switch (r) {
    case MOE_E2M1_RNE: rm = ROUND_NEAREST_EVEN; break;
    case MOE_E2M1_TIES_UP: rm = ROUND_TIES_AWAY; break;
    case MOE_E2M1_TOWARD_ZERO: rm = ROUND_TOWARD_ZERO; break;
    default: MOE_ASSERT(!"unknown moe_e2m1_round");
    }
    int32_t c = round_magnitude(fabs(x), 1, 0, 3, rm);
    if (c > 7) c = 7;
    return (uint8_t)(s | (uint8_t)c);
}

/* Largest magnitude of x [n]; *bad set when x holds a NaN or an Inf. */
static float block_amax(const float *x, int64_t n, int *bad) {
    float m = 0.0f;
    *bad = 0;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (!(a <= FLT_MAX)) *bad = 1;  /* NaN or Inf */
        else if (a > m) m = a;
    }
    return m;
}

/* ---------------------------------------------------- element encoders */

uint16_t moe_bf16_from_f32(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)(((u >> 16) & 0x8000u) | 0x7FC0u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

uint8_t moe_fp8_e4m3_from_f32(float x, moe_fp8_overflow mode) {
    MOE_ASSERT(mode == MOE_FP8_SATURATE || mode == MOE_FP8_OVERFLOW_NAN);
    uint8_t s = signbit(x) ? 0x80u : 0x00u;
    uint8_t over = mode == MOE_FP8_SATURATE ? 0x7Eu : 0x7Fu;
    if (isnan(x)) return (uint8_t)(s | 0x7Fu);
    if (isinf(x)) return (uint8_t)(s | over);
    int32_t c = round_magnitude(fabs((double)x), 3, -6, 9, ROUND_NEAREST_EVEN);
    if (c > 0x7E) return (uint8_t)(s | over);
    return (uint8_t)(s | (uint8_t)c);
}

uint8_t moe_fp8_e5m2_from_f32(float x, moe_fp8_overflow mode) {
    MOE_ASSERT(mode == MOE_FP8_SATURATE || mode == MOE_FP8_OVERFLOW_INF);
    uint8_t s = signbit(x) ? 0x80u : 0x00u;
    uint8_t over = mode == MOE_FP8_SATURATE ? 0x7Bu : 0x7Cu;
    if (isnan(x)) return (uint8_t)(s | 0x7Eu);
    if (isinf(x)) return (uint8_t)(s | over);
    int32_t c = round_magnitude(fabs((double)x), 2, -14, 16, ROUND_NEAREST_EVEN);
    if (c > 0x7B) return (uint8_t)(s | over);
    return (uint8_t)(s | (uint8_t)c);
}

uint8_t moe_ue4m3_from_f32(float x) {
    if (isnan(x)) return 0x7F;
    if (!(x > 0.0f)) return 0x00;
    return moe_fp8_e4m3_from_f32(x, MOE_FP8_SATURATE);
}

uint8_t moe_e2m1_from_f32(float x, moe_e2m1_round r) {
    return e2m1_from_f64((double)x, r);
}

uint8_t moe_e8m0_ceil_f32(float x) {
    if (isnan(x) || isinf(x)) return 0xFF;
    if (!(x > 0.0f)) return 0;
    return (uint8_t)clamp_int(ceil_exp_ratio((double)x, 1.0) + 127, 0, 254);
}

uint8_t moe_e8m0_floor_f32(float x) {
    if (isnan(x) || isinf(x)) return 0xFF;
    if (!(x > 0.0f)) return 0;
    int k;
    (void)frexp((double)x, &k);          /* x in [2^(k-1), 2^k) */
    return (uint8_t)clamp_int(k - 1 + 127, 0, 254);
}

uint8_t moe_mxfp4_scale_e8m0(float amax, moe_mx_scale_rule rule) {
    if (isnan(amax) || isinf(amax)) return 0xFF;
    MOE_ASSERT(amax >= 0.0f);
    if (amax == 0.0f) return 0;
    int e = 0;
    switch (rule) {
    case MOE_MX_SCALE_CEIL:
        e = ceil_exp_ratio((double)amax, (double)MOE_E2M1_MAX);
        break;
    case MOE_MX_SCALE_FLOOR: {
        int k;
        (void)frexp((double)amax, &k);   /* floor(log2 amax) = k - 1 */
        e = k - 1 - 2;                   /* 2 = emax of E2M1 (4 = 2^2) */
        break;
    }
    default: MOE_ASSERT(!"unknown moe_mx_scale_rule");
    }
    return (uint8_t)clamp_int(e + 127, 0, 254);
}

/* ---------------------------------------------------------------- MXFP4 */

static void put_nibble(uint8_t *packed, int64_t j, uint8_t code) {
    if (j & 1) packed[j >> 1] = (uint8_t)((packed[j >> 1] & 0x0Fu) | (code << 4));
    else packed[j >> 1] = (uint8_t)((packed[j >> 1] & 0xF0u) | (code & 0x0Fu));
}

static uint8_t get_nibble(const uint8_t *packed, int64_t j) {
    return (uint8_t)((j & 1) ? packed[j >> 1] >> 4 : packed[j >> 1] & 0x0Fu);
}

void moe_mxfp4_quant_row(const float *x, int64_t n, moe_mx_scale_rule rule,
                         moe_e2m1_round r, uint8_t *packed, uint8_t *scales) {
    MOE_ASSERT(n >= 0 && n % MOE_MXFP4_BLOCK == 0);
    MOE_ASSERT(n == 0 || (x && packed && scales));
    for (int64_t b = 0; b < n / MOE_MXFP4_BLOCK; b++) {
        const float *xb = x + b * MOE_MXFP4_BLOCK;
        int bad;
        float amax = block_amax(xb, MOE_MXFP4_BLOCK, &bad);
        uint8_t e = bad ? 0xFF : moe_mxfp4_scale_e8m0(amax, rule);
        scales[b] = e;
        for (int i = 0; i < MOE_MXFP4_BLOCK; i++) {
            /* x / 2^(e-127), exact in double */
            uint8_t c = e == 0xFF ? 0 : e2m1_from_f64(ldexp((double)xb[i], 127 - (int)e), r);
            put_nibble(packed, b * MOE_MXFP4_BLOCK + i, c);
        }
    }
}

void moe_mxfp4_dequant_row(const uint8_t *packed, const uint8_t *scales, int64_t cols,
                           float *out) {
    MOE_ASSERT(cols >= 0 && cols % MOE_MXFP4_BLOCK == 0);
    for (int64_t j = 0; j < cols; j++)
        out[j] = moe_e2m1_to_f32(get_nibble(packed, j)) * moe_e8m0_to_f32(scales[j / MOE_MXFP4_BLOCK]);
}

void moe_mxfp4_dequant_row_f64(const uint8_t *packed, const uint8_t *scales, int64_t cols,
                               double *out) {
    MOE_ASSERT(cols >= 0 && cols % MOE_MXFP4_BLOCK == 0);
    for (int64_t j = 0; j < cols; j++) {
        uint8_t e = scales[j / MOE_MXFP4_BLOCK];
        double v = (double)moe_e2m1_to_f32(get_nibble(packed, j));
        out[j] = e == 0xFF ? (double)NAN : ldexp(v, (int)e - 127);
    }
}

/* ---------------------------------------------------------------- NVFP4 */

float moe_nvfp4_scale2(const float *x, int64_t n) {
    MOE_ASSERT(n >= 0 && (n == 0 || x));
    float amax = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (isnan(a)) return NAN;
        if (a > amax) amax = a;
    }
    if (amax == 0.0f) return 1.0f;
    return amax / (MOE_E2M1_MAX * MOE_FP8_E4M3_MAX);   /* 2688, exact */
}

void moe_nvfp4_quant_row(const float *x, int64_t n, float scale2, moe_e2m1_round r,
                         uint8_t *packed, uint8_t *scales) {
    MOE_ASSERT(n >= 0 && n % MOE_NVFP4_BLOCK == 0);
    MOE_ASSERT(n == 0 || (x && packed && scales));
    MOE_ASSERT(scale2 > 0.0f && scale2 <= FLT_MAX);
    const float min_scale = 1.0f / 512.0f;              /* 2^-9, smallest UE4M3 */
    for (int64_t b = 0; b < n / MOE_NVFP4_BLOCK; b++) {
        const float *xb = x + b * MOE_NVFP4_BLOCK;
        int has_nan = 0;
        float bamax = 0.0f;
        for (int i = 0; i < MOE_NVFP4_BLOCK; i++) {
            float a = fabsf(xb[i]);
            if (isnan(a)) has_nan = 1;
            else if (a > bamax) bamax = a;
        }
        uint8_t sc;
        if (has_nan) {
            sc = 0x7F;
        } else if (bamax == 0.0f) {
            sc = 0x38;                                   /* 1.0 */
        } else {
            float s = bamax / (MOE_E2M1_MAX * scale2);  /* fp32, as ModelOpt */
            if (s < min_scale) s = min_scale;
            sc = moe_ue4m3_from_f32(s);
        }
        scales[b] = sc;
        float d = moe_ue4m3_to_f32(sc) * scale2;
        for (int i = 0; i < MOE_NVFP4_BLOCK; i++) {
            uint8_t c = has_nan ? 0 : moe_e2m1_from_f32(xb[i] / d, r);
            put_nibble(packed, b * MOE_NVFP4_BLOCK + i, c);
        }
    }
}

void moe_nvfp4_dequant_row(const uint8_t *packed, const uint8_t *scales, float scale2,
                           int64_t cols, float *out) {
    MOE_ASSERT(cols >= 0 && cols % MOE_NVFP4_BLOCK == 0);
    for (int64_t j = 0; j < cols; j++) {
        float v = moe_e2m1_to_f32(get_nibble(packed, j)) * moe_ue4m3_to_f32(scales[j / MOE_NVFP4_BLOCK]);
        out[j] = v * scale2;
    }
}

void moe_nvfp4_dequant_row_f64(const uint8_t *packed, const uint8_t *scales, float scale2,
                               int64_t cols, double *out) {
    MOE_ASSERT(cols >= 0 && cols % MOE_NVFP4_BLOCK == 0);
    for (int64_t j = 0; j < cols; j++)
        out[j] = (double)moe_e2m1_to_f32(get_nibble(packed, j)) *
                 (double)moe_ue4m3_to_f32(scales[j / MOE_NVFP4_BLOCK]) * (double)scale2;
}

/* ------------------------------------------------------------------ FP8 */

/* Power-of-two FP8 scale exponent: smallest e with 448 * 2^e >= amax,
 * clamped to the E8M0 range [-127, 127]. amax finite and > 0. */
static int fp8_pow2_exp(float amax) {
    return clamp_int(ceil_exp_ratio((double)amax, (double)MOE_FP8_E4M3_MAX), -127, 127);
}

/* Scale of one FP8 block from its amax (>= 0; `bad` when it held NaN/Inf). */
static float fp8_scale(float amax, int bad, moe_fp8_scale kind) {
    if (bad) return NAN;
    if (amax == 0.0f) return 1.0f;
    switch (kind) {
    case MOE_FP8_SCALE_F32: return amax / MOE_FP8_E4M3_MAX;
    case MOE_FP8_SCALE_POW2: return moe_e8m0_to_f32((uint8_t)(fp8_pow2_exp(amax) + 127));
    }
    MOE_ASSERT(!"unknown moe_fp8_scale");
    return NAN;
}

/* amax of the tile rows [r0, r1) x cols [c0, c1) of w [*, cols]. */
static float tile_amax(const float *w, int64_t cols, int64_t r0, int64_t r1, int64_t c0,
                       int64_t c1, int *bad) {
    float m = 0.0f;
    int b = 0;
    for (int64_t r = r0; r < r1; r++) {
        int rb;
        float a = block_amax(w + r * cols + c0, c1 - c0, &rb);
        b |= rb;
        if (a > m) m = a;
    }
    *bad = b;
    return m;
}

static void fp8_tiles(const float *w, int64_t rows, int64_t cols, moe_fp8_scale kind,
                      uint8_t *q, float *scale_f32, uint8_t *scale_e8m0) {
    MOE_ASSERT(rows >= 0 && cols >= 0);
    int64_t tr = (rows + MOE_FP8_TILE - 1) / MOE_FP8_TILE;
    int64_t tc = (cols + MOE_FP8_TILE - 1) / MOE_FP8_TILE;
    for (int64_t ti = 0; ti < tr; ti++) {
        int64_t r0 = ti * MOE_FP8_TILE, r1 = r0 + MOE_FP8_TILE < rows ? r0 + MOE_FP8_TILE : rows;
        for (int64_t tj = 0; tj < tc; tj++) {
            int64_t c0 = tj * MOE_FP8_TILE, c1 = c0 + MOE_FP8_TILE < cols ? c0 + MOE_FP8_TILE : cols;
            int bad;
            float amax = tile_amax(w, cols, r0, r1, c0, c1, &bad);
            float s = fp8_scale(amax, bad, kind);
            if (scale_f32) scale_f32[ti * tc + tj] = s;
            if (scale_e8m0)
                scale_e8m0[ti * tc + tj] = bad ? 0xFF : amax == 0.0f ? 127
                                                   : (uint8_t)(fp8_pow2_exp(amax) + 127);
            for (int64_t r = r0; r < r1; r++)
                for (int64_t c = c0; c < c1; c++)
                    q[r * cols + c] = moe_fp8_e4m3_from_f32(w[r * cols + c] / s, MOE_FP8_SATURATE);
        }
    }
}

void moe_fp8_block_quant(const float *w, int64_t rows, int64_t cols, moe_fp8_scale kind,
                         uint8_t *q, float *scale) {
    fp8_tiles(w, rows, cols, kind, q, scale, NULL);
}

void moe_fp8_block_quant_e8m0(const float *w, int64_t rows, int64_t cols, uint8_t *q,
                              uint8_t *scale_e8m0) {
    fp8_tiles(w, rows, cols, MOE_FP8_SCALE_POW2, q, NULL, scale_e8m0);
}

void moe_fp8_block_dequant_row(const uint8_t *w_row, const float *scale_row, int64_t cols,
                               float *out) {
    MOE_ASSERT(cols >= 0);
    for (int64_t j = 0; j < cols; j++)
        out[j] = moe_fp8_e4m3_to_f32(w_row[j]) * scale_row[j / MOE_FP8_TILE];
}

void moe_fp8_block_dequant_row_f64(const uint8_t *w_row, const float *scale_row,
                                   int64_t cols, double *out) {
    MOE_ASSERT(cols >= 0);
    for (int64_t j = 0; j < cols; j++)
        out[j] = (double)moe_fp8_e4m3_to_f32(w_row[j]) * (double)scale_row[j / MOE_FP8_TILE];
}

void moe_fp8_block_dequant_row_e8m0(const uint8_t *w_row, const uint8_t *scale_row,
                                    int64_t cols, float *out) {
    MOE_ASSERT(cols >= 0);
    for (int64_t j = 0; j < cols; j++)
        out[j] = moe_fp8_e4m3_to_f32(w_row[j]) * moe_e8m0_to_f32(scale_row[j / MOE_FP8_TILE]);
}

void moe_fp8_block_dequant_row_e8m0_f64(const uint8_t *w_row, const uint8_t *scale_row,
                                        int64_t cols, double *out) {
    MOE_ASSERT(cols >= 0);
    for (int64_t j = 0; j < cols; j++) {
        uint8_t e = scale_row[j / MOE_FP8_TILE];
        double v = (double)moe_fp8_e4m3_to_f32(w_row[j]);
        out[j] = e == 0xFF ? (double)NAN : ldexp(v, (int)e - 127);
    }
}

void moe_fp8_act_quant_row(const float *x, int64_t n, moe_fp8_scale kind, uint8_t *q,
                           float *scales) {
    MOE_ASSERT(n >= 0 && (n == 0 || (x && q && scales)));
    const float amax_floor = 1e-4f;
    for (int64_t b = 0; b * MOE_FP8_ACT_BLOCK < n; b++) {
        int64_t c0 = b * MOE_FP8_ACT_BLOCK;
        int64_t c1 = c0 + MOE_FP8_ACT_BLOCK < n ? c0 + MOE_FP8_ACT_BLOCK : n;
        int bad;
        float amax = block_amax(x + c0, c1 - c0, &bad);
        if (amax < amax_floor) amax = amax_floor;
        float s = fp8_scale(amax, bad, kind);
        scales[b] = s;
        for (int64_t j = c0; j < c1; j++) q[j] = moe_fp8_e4m3_from_f32(x[j] / s, MOE_FP8_SATURATE);
    }
}

void moe_nvfp4_act_quant_row(const float *x, int64_t n, float input_scale, uint8_t *codes, uint8_t *sf) {
    MOE_ASSERT(n >= 0 && input_scale > 0);
    const float gs = 1.0f / input_scale, inv_gs = 1.0f / gs, rcp6 = 1.0f / MOE_E2M1_MAX;
    for (int64_t b = 0; b * MOE_NVFP4_BLOCK < n; b++) {
        int64_t c0 = b * MOE_NVFP4_BLOCK, c1 = c0 + MOE_NVFP4_BLOCK < n ? c0 + MOE_NVFP4_BLOCK : n;
        int bad;
        float vmax = block_amax(x + c0, c1 - c0, &bad);
        if (bad) {
            sf[b] = 0x7F;
            for (int64_t j = c0; j < c1; j++) codes[j] = 0;
            continue;
        }
        float t = vmax * rcp6;
        float s = gs * t;
        if (s > MOE_FP8_E4M3_MAX) s = MOE_FP8_E4M3_MAX;
        uint8_t code = moe_ue4m3_from_f32(s);
        float sv = moe_ue4m3_to_f32(code);
        float p = sv * inv_gs;
        float os = sv == 0.0f ? 0.0f : 1.0f / p;
        sf[b] = code;
        for (int64_t j = c0; j < c1; j++) {
            float y = x[j] * os;
            y = y > MOE_E2M1_MAX ? MOE_E2M1_MAX : y < -MOE_E2M1_MAX ? -MOE_E2M1_MAX : y;
            codes[j] = moe_e2m1_from_f32(y, MOE_E2M1_RNE);
        }
    }
}
