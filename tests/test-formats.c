/*
 * Number formats (include/moe_formats.h): every code of every 8-bit and 4-bit
 * format decodes to the value computed here from its bit fields, encoders
 * agree with a brute-force nearest search over the decoded code tables
 * (an oracle independent of the library's rounding code), and the block
 * codecs round-trip within their format's bound.
 */
#include "harness.h"
#include "moe_formats.h"
#include "core/core.h"
#include "formats/act.h"
#include "formats/mathf.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ utilities */

static uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }

/* Same value, NaN matching NaN, and the same sign (so -0 != +0). */
static int same_value(double got, double want) {
    if (isnan(want)) return isnan(got);
    return got == want && signbit(got) == signbit(want);
}

/* ------------------------------------------- independent decoders (ldexp) */

static double ref_e4m3(unsigned c) {
    unsigned s = c >> 7, e = (c >> 3) & 15, m = c & 7;
    double v;
    if (e == 15 && m == 7) return NAN;
    v = e == 0 ? ldexp((double)m, 1 - 7 - 3) : ldexp((double)(8 + m), (int)e - 7 - 3);
    return s ? -v : v;
}
static double ref_e5m2(unsigned c) {
    unsigned s = c >> 7, e = (c >> 2) & 31, m = c & 3;
    double v;
    if (e == 31) v = m ? NAN : INFINITY;
    else v = e == 0 ? ldexp((double)m, 1 - 15 - 2) : ldexp((double)(4 + m), (int)e - 15 - 2);
    return s ? -v : v;
}
static double ref_e2m1(unsigned c) {
    unsigned s = (c >> 3) & 1, e = (c >> 1) & 3, m = c & 1;
    double v = e == 0 ? ldexp((double)m, 1 - 1 - 1) : ldexp((double)(2 + m), (int)e - 1 - 1);
    return s ? -v : v;
}
static double ref_e8m0(unsigned c) { return c == 255 ? NAN : ldexp(1.0, (int)c - 127); }
static double ref_ue4m3(unsigned c) { return c & 0x80 ? NAN : ref_e4m3(c); }
static double ref_bf16(unsigned c) {
    unsigned s = c >> 15, e = (c >> 7) & 255, m = c & 127;
    double v;
    if (e == 255) v = m ? NAN : INFINITY;
    else v = e == 0 ? ldexp((double)m, 1 - 127 - 7) : ldexp((double)(128 + m), (int)e - 127 - 7);
    return s ? -v : v;
}

/* ------------------------------------------------ brute-force nearest oracle */

/* Non-negative values of a format in code order (codes are monotone), plus
 * one extra entry: the value the next code would have if the exponent range
 * were unbounded (E4M3 480, E5M2 2^16, E2M1 8). Rounding to that entry is
 * overflow. */
typedef struct table {
    int n;            /* finite entries; entry n is the overflow pseudo-value */
    double v[130];
} table;

static table make_table(double (*dec)(unsigned), unsigned maxcode, double over) {
    table t;
    t.n = (int)maxcode + 1;
    for (unsigned c = 0; c <= maxcode; c++) t.v[c] = dec(c);
    t.v[t.n] = over;
    return t;
}

enum { OR_RNE, OR_AWAY, OR_TRUNC };

/* Magnitude code (0..n; n = overflow) of a >= 0: scan the whole table for
 * the values bracketing a, then pick by exact distances (the bracketing
 * values are close to a, so both differences are exact in double). */
static int oracle(const table *t, double a, int mode) {
    int lo = 0;
    for (int i = 0; i <= t->n; i++)
        if (t->v[i] <= a) lo = i;
    if (lo == t->n || mode == OR_TRUNC) return lo;
    int hi = lo + 1;
    double dl = a - t->v[lo], dh = t->v[hi] - a;
    if (dl < dh) return lo;
    if (dh < dl) return hi;
    if (mode == OR_AWAY) return hi;
    return (lo & 1) ? hi : lo;   /* tie: the even code */
}

static uint8_t oracle_e4m3(const table *t, float x, moe_fp8_overflow mode) {
    uint8_t s = signbit(x) ? 0x80 : 0;
    if (isnan(x)) return s | 0x7F;
    int c = isinf(x) ? t->n : oracle(t, fabs((double)x), OR_RNE);
    if (c == t->n) return s | (mode == MOE_FP8_SATURATE ? 0x7E : 0x7F);
    return (uint8_t)(s | c);
}
static uint8_t oracle_e5m2(const table *t, float x, moe_fp8_overflow mode) {
    uint8_t s = signbit(x) ? 0x80 : 0;
    if (isnan(x)) return s | 0x7E;
    int c = isinf(x) ? t->n : oracle(t, fabs((double)x), OR_RNE);
    if (c == t->n) return s | (mode == MOE_FP8_SATURATE ? 0x7B : 0x7C);
    return (uint8_t)(s | c);
}
static uint8_t oracle_e2m1(const table *t, double x, moe_e2m1_round r) {
    uint8_t s = signbit(x) ? 0x8 : 0;
    if (isnan(x)) return 0;
    int mode = r == MOE_E2M1_RNE ? OR_RNE : r == MOE_E2M1_TIES_UP ? OR_AWAY : OR_TRUNC;
    int c = isinf(x) ? t->n : oracle(t, fabs(x), mode);
    if (c == t->n) c = 7;
    return (uint8_t)(s | c);
}
static uint16_t oracle_bf16(float x) {
    uint32_t u = f32_bits(x);
    if (isnan(x)) return (uint16_t)((u >> 16 & 0x8000) | 0x7FC0);
    if (isinf(x)) return (uint16_t)(u >> 16);
    unsigned lo = (u >> 16) & 0x7FFF, hi = lo + 1;
    double a = fabs((double)x), vl = ref_bf16(lo);
    double vh = hi == 0x7F80 ? ldexp(1.0, 128) : ref_bf16(hi);
    double dl = a - vl, dh = vh - a;
    unsigned c = dl < dh ? lo : dh < dl ? hi : (lo & 1 ? hi : lo);
    return (uint16_t)((u >> 16 & 0x8000) | c);
}

/* ----------------------------------------------------------- test inputs */

/* Floats to feed the encoders: fully random bit patterns, random values in
 * the binades from emin-4 to emax+2 (both signs), and a sweep of every
 * binade in that range over all 2^11 top mantissa bits combined with the low
 * bit patterns that decide ties (0, 1, just below and above the half). */
typedef void (*sample_fn)(float x, void *ctx);

static void for_samples(int elo, int ehi, uint64_t seed, sample_fn fn, void *ctx) {
    uint64_t s = seed;
    for (int i = 0; i < 100000; i++) fn(moe_fmt_f32_from_bits((uint32_t)moe_splitmix64(&s)), ctx);
    for (int i = 0; i < 100000; i++) {
        uint64_t r = moe_splitmix64(&s);
        int e = elo + (int)(r % (uint64_t)(ehi - elo + 1));
        uint32_t m = (uint32_t)(r >> 32) & 0x7FFFFF;
        uint32_t sign = (uint32_t)(r >> 8) & 0x80000000u;
        if (e + 127 < 1) continue;
        fn(moe_fmt_f32_from_bits(sign | ((uint32_t)(e + 127) << 23) | m), ctx);
    }
    static const uint32_t low[] = {0x000, 0x001, 0x7FF, 0x800, 0x801, 0xFFE, 0xFFF};
    for (int e = elo; e <= ehi; e++) {
        if (e + 127 < 1) continue;
        for (uint32_t hi = 0; hi < 2048; hi++)
            for (size_t k = 0; k < sizeof low / sizeof low[0]; k++) {
                uint32_t u = ((uint32_t)(e + 127) << 23) | (hi << 12) | low[k];
                fn(moe_fmt_f32_from_bits(u), ctx);
                fn(moe_fmt_f32_from_bits(u | 0x80000000u), ctx);
            }
    }
    static const float special[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, FLT_MAX,
                                    -FLT_MAX, FLT_MIN, 0x1p-149f, -0x1p-149f};
    for (size_t k = 0; k < sizeof special / sizeof special[0]; k++) fn(special[k], ctx);
}

typedef struct cmp_ctx {
    const table *t;
    int mode;       /* overflow or rounding mode under test */
    long n, bad;
    float first_bad;
    unsigned got, want;
} cmp_ctx;

static void note(cmp_ctx *c, float x, unsigned got, unsigned want) {
    c->n++;
    if (got != want && c->bad++ == 0) { c->first_bad = x; c->got = got; c->want = want; }
}
static void s_e4m3(float x, void *p) {
    cmp_ctx *c = p;
    note(c, x, moe_fp8_e4m3_from_f32(x, (moe_fp8_overflow)c->mode),
         oracle_e4m3(c->t, x, (moe_fp8_overflow)c->mode));
}
static void s_e5m2(float x, void *p) {
    cmp_ctx *c = p;
    note(c, x, moe_fp8_e5m2_from_f32(x, (moe_fp8_overflow)c->mode),
         oracle_e5m2(c->t, x, (moe_fp8_overflow)c->mode));
}
static void s_e2m1(float x, void *p) {
    cmp_ctx *c = p;
    note(c, x, moe_e2m1_from_f32(x, (moe_e2m1_round)c->mode),
         oracle_e2m1(c->t, x, (moe_e2m1_round)c->mode));
}
static void s_ue4m3(float x, void *p) {
    cmp_ctx *c = p;
    unsigned want = isnan(x) ? 0x7F : !(x > 0) ? 0 : oracle_e4m3(c->t, x, MOE_FP8_SATURATE);
    note(c, x, moe_ue4m3_from_f32(x), want);
}
static void s_bf16(float x, void *p) { note(p, x, moe_bf16_from_f32(x), oracle_bf16(x)); }

#define CHECK_CTX(c, what)                                                          \
    CHECK((c).bad == 0, "%s: %ld of %ld differ from the oracle; first x=%a got 0x%02X " \
          "want 0x%02X", what, (c).bad, (c).n, (double)(c).first_bad, (c).got, (c).want)

/* ------------------------------------------------------ exhaustive decoders */

static void test_decode_exhaustive(void) {
    for (unsigned c = 0; c < 256; c++) {
        uint8_t b = (uint8_t)c;
        CHECK(same_value(moe_fp8_e4m3_to_f32(b), ref_e4m3(c)), "e4m3 0x%02X -> %a want %a", c,
              (double)moe_fp8_e4m3_to_f32(b), ref_e4m3(c));
        CHECK(same_value(moe_fp8_e5m2_to_f32(b), ref_e5m2(c)), "e5m2 0x%02X -> %a want %a", c,
              (double)moe_fp8_e5m2_to_f32(b), ref_e5m2(c));
        CHECK(same_value(moe_e8m0_to_f32(b), ref_e8m0(c)), "e8m0 0x%02X -> %a want %a", c,
              (double)moe_e8m0_to_f32(b), ref_e8m0(c));
        CHECK(same_value(moe_ue4m3_to_f32(b), ref_ue4m3(c)), "ue4m3 0x%02X -> %a want %a", c,
              (double)moe_ue4m3_to_f32(b), ref_ue4m3(c));
    }
    for (unsigned c = 0; c < 16; c++)
        CHECK(same_value(moe_e2m1_to_f32((uint8_t)c), ref_e2m1(c)), "e2m1 0x%X -> %a", c,
              (double)moe_e2m1_to_f32((uint8_t)c));
    /* the high nibble is ignored */
    CHECK(moe_e2m1_to_f32(0xF7) == 6.0f, "high nibble ignored");
    /* spot values from the spec tables */
    CHECK(moe_fp8_e4m3_to_f32(0x7E) == 448.0f, "e4m3 max");
    CHECK(moe_fp8_e4m3_to_f32(0x08) == 0x1p-6f, "e4m3 min normal");
    CHECK(moe_fp8_e4m3_to_f32(0x01) == 0x1p-9f, "e4m3 min subnormal");
    CHECK(moe_fp8_e5m2_to_f32(0x7B) == 57344.0f, "e5m2 max");
    CHECK(isinf(moe_fp8_e5m2_to_f32(0x7C)) && moe_fp8_e5m2_to_f32(0xFC) < 0, "e5m2 inf");
    CHECK(moe_e8m0_to_f32(0) == 0x1p-127f && moe_e8m0_to_f32(0) > 0, "e8m0 0 = 2^-127 subnormal");
    CHECK(moe_e8m0_to_f32(254) == 0x1p127f, "e8m0 254");
    CHECK(moe_e8m0_to_f32(127) == 1.0f, "e8m0 127");
    CHECK(moe_ue4m3_to_f32(0x38) == 1.0f, "ue4m3 1.0");
    static const float e2m1_vals[8] = {0, 0.5f, 1, 1.5f, 2, 3, 4, 6};
    for (unsigned c = 0; c < 8; c++) CHECK(moe_e2m1_to_f32((uint8_t)c) == e2m1_vals[c], "e2m1 %u", c);
}

/* ------------------------------------------------- round trips of every code */

static void test_reencode_exhaustive(void) {
    for (unsigned c = 0; c < 256; c++) {
        uint8_t b = (uint8_t)c;
        float v = moe_fp8_e4m3_to_f32(b);
        if (isnan(v)) {
            CHECK(moe_fp8_e4m3_from_f32(v, MOE_FP8_SATURATE) == c, "e4m3 NaN 0x%02X keeps sign", c);
            CHECK(moe_fp8_e4m3_from_f32(v, MOE_FP8_OVERFLOW_NAN) == c, "e4m3 NaN 0x%02X", c);
        } else {
            CHECK(moe_fp8_e4m3_from_f32(v, MOE_FP8_SATURATE) == c, "e4m3 0x%02X sat", c);
            CHECK(moe_fp8_e4m3_from_f32(v, MOE_FP8_OVERFLOW_NAN) == c, "e4m3 0x%02X nonsat", c);
        }
        v = moe_fp8_e5m2_to_f32(b);
        if (isnan(v)) {
            uint8_t g = moe_fp8_e5m2_from_f32(v, MOE_FP8_OVERFLOW_INF);
            CHECK(isnan(moe_fp8_e5m2_to_f32(g)) && (g & 0x80) == (c & 0x80), "e5m2 NaN 0x%02X", c);
        } else if (isinf(v)) {
            CHECK(moe_fp8_e5m2_from_f32(v, MOE_FP8_OVERFLOW_INF) == c, "e5m2 inf 0x%02X", c);
            CHECK(moe_fp8_e5m2_from_f32(v, MOE_FP8_SATURATE) == ((c & 0x80) | 0x7B), "e5m2 inf sat");
        } else {
            CHECK(moe_fp8_e5m2_from_f32(v, MOE_FP8_OVERFLOW_INF) == c, "e5m2 0x%02X", c);
            CHECK(moe_fp8_e5m2_from_f32(v, MOE_FP8_SATURATE) == c, "e5m2 0x%02X sat", c);
        }
        v = moe_ue4m3_to_f32(b);
        if (c < 0x7F) CHECK(moe_ue4m3_from_f32(v) == (c == 0 ? 0 : c), "ue4m3 0x%02X", c);
        else CHECK(isnan(v) && moe_ue4m3_from_f32(v) == 0x7F, "ue4m3 0x%02X NaN", c);
        v = moe_e8m0_to_f32(b);
        if (c < 255) {
            CHECK(moe_e8m0_ceil_f32(v) == c, "e8m0 ceil 0x%02X", c);
            CHECK(moe_e8m0_floor_f32(v) == c, "e8m0 floor 0x%02X", c);
        } else {
            CHECK(moe_e8m0_ceil_f32(v) == 0xFF && moe_e8m0_floor_f32(v) == 0xFF, "e8m0 NaN");
        }
    }
    for (unsigned c = 0; c < 16; c++) {
        float v = moe_e2m1_to_f32((uint8_t)c);
        for (int r = 0; r < 3; r++)
            CHECK(moe_e2m1_from_f32(v, (moe_e2m1_round)r) == c, "e2m1 0x%X mode %d", c, r);
    }
    /* every bf16 code */
    long bad = 0;
    unsigned first = 0;
    for (unsigned c = 0; c < 65536; c++) {
        float v = moe_bf16_to_f32((uint16_t)c);
        uint16_t g = moe_bf16_from_f32(v);
        int ok;
        if (isnan(v)) ok = (g & 0x7FC0) == 0x7FC0 && (g & 0x8000) == (c & 0x8000);
        else ok = g == c;
        if (!ok && bad++ == 0) first = c;
        CHECK(same_value(v, ref_bf16(c)), "bf16 0x%04X decodes to %a", c, (double)v);
    }
    CHECK(bad == 0, "%ld bf16 codes do not round-trip; first 0x%04X", bad, first);
}

/* ------------------------------------------------ encoders against the oracle */

static void test_oracle(void) {
    table t43 = make_table(ref_e4m3, 0x7E, 480.0);
    table t52 = make_table(ref_e5m2, 0x7B, 65536.0);
    table t21 = make_table(ref_e2m1, 0x7, 8.0);
    cmp_ctx c;

    memset(&c, 0, sizeof c); c.t = &t43; c.mode = MOE_FP8_SATURATE;
    for_samples(-13, 10, 1, s_e4m3, &c); CHECK_CTX(c, "e4m3 saturate");
    memset(&c, 0, sizeof c); c.t = &t43; c.mode = MOE_FP8_OVERFLOW_NAN;
    for_samples(-13, 10, 2, s_e4m3, &c); CHECK_CTX(c, "e4m3 overflow->NaN");
    memset(&c, 0, sizeof c); c.t = &t43;
    for_samples(-13, 10, 3, s_ue4m3, &c); CHECK_CTX(c, "ue4m3");
    memset(&c, 0, sizeof c); c.t = &t52; c.mode = MOE_FP8_OVERFLOW_INF;
    for_samples(-20, 17, 4, s_e5m2, &c); CHECK_CTX(c, "e5m2 inf");
    memset(&c, 0, sizeof c); c.t = &t52; c.mode = MOE_FP8_SATURATE;
    for_samples(-20, 17, 5, s_e5m2, &c); CHECK_CTX(c, "e5m2 saturate");
    for (int r = 0; r < 3; r++) {
        memset(&c, 0, sizeof c); c.t = &t21; c.mode = r;
        for_samples(-5, 4, 6 + (uint64_t)r, s_e2m1, &c); CHECK_CTX(c, "e2m1");
    }
    memset(&c, 0, sizeof c);
    for_samples(-130, 127, 9, s_bf16, &c); CHECK_CTX(c, "bf16 sweep");
    /* bf16: every float whose low 12 bits are a tie-deciding pattern */
    memset(&c, 0, sizeof c);
    static const uint32_t low[] = {0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF};
    for (uint32_t hi = 0; hi < 65536; hi++)
        for (size_t k = 0; k < sizeof low / sizeof low[0]; k++) s_bf16(moe_fmt_f32_from_bits(hi << 16 | low[k]), &c);
    CHECK_CTX(c, "bf16 all ties");
}

/* Every midpoint between adjacent values, both signs: the tie goes to the
 * even code, one float ulp either side goes to the near side. */
static void check_midpoints(const table *t, const char *name,
                            unsigned (*enc)(float, int), int mode, int tie_rule,
                            unsigned over_code) {
    for (int i = 0; i < t->n; i++) {
        float lo = (float)t->v[i], hi = (float)t->v[i + 1];
        float mid = (float)((t->v[i] + t->v[i + 1]) / 2);
        CHECK((double)mid == (t->v[i] + t->v[i + 1]) / 2, "%s midpoint exact", name);
        unsigned clo = (unsigned)i, chi = i + 1 == t->n ? over_code : (unsigned)(i + 1);
        unsigned ctie = tie_rule == OR_RNE ? ((i & 1) ? chi : clo) : tie_rule == OR_AWAY ? chi : clo;
        unsigned cabove = tie_rule == OR_TRUNC ? clo : chi;
        for (int sg = 0; sg < 2; sg++) {
            float s = sg ? -1.0f : 1.0f;
            unsigned sb = sg ? (t->n > 8 ? 0x80u : 0x8u) : 0u;
            unsigned g = enc(s * mid, mode);
            CHECK(g == (sb | ctie), "%s tie %a (between %a and %a) -> 0x%02X want 0x%02X", name,
                  (double)(s * mid), (double)lo, (double)hi, g, sb | ctie);
            g = enc(s * nextafterf(mid, 0.0f), mode);
            CHECK(g == (sb | clo), "%s below tie %a -> 0x%02X", name, (double)mid, g);
            g = enc(s * nextafterf(mid, INFINITY), mode);
            CHECK(g == (sb | cabove), "%s above tie %a -> 0x%02X want 0x%02X", name, (double)mid,
                  g, sb | cabove);
        }
    }
}
static unsigned enc_e4m3(float x, int m) { return moe_fp8_e4m3_from_f32(x, (moe_fp8_overflow)m); }
static unsigned enc_e5m2(float x, int m) { return moe_fp8_e5m2_from_f32(x, (moe_fp8_overflow)m); }
static unsigned enc_e2m1(float x, int m) { return moe_e2m1_from_f32(x, (moe_e2m1_round)m); }

static void test_midpoints(void) {
    table t43 = make_table(ref_e4m3, 0x7E, 480.0);
    table t52 = make_table(ref_e5m2, 0x7B, 65536.0);
    table t21 = make_table(ref_e2m1, 0x7, 8.0);
    check_midpoints(&t43, "e4m3 sat", enc_e4m3, MOE_FP8_SATURATE, OR_RNE, 0x7E);
    check_midpoints(&t43, "e4m3 nan", enc_e4m3, MOE_FP8_OVERFLOW_NAN, OR_RNE, 0x7F);
    check_midpoints(&t52, "e5m2 inf", enc_e5m2, MOE_FP8_OVERFLOW_INF, OR_RNE, 0x7C);
    check_midpoints(&t52, "e5m2 sat", enc_e5m2, MOE_FP8_SATURATE, OR_RNE, 0x7B);
    check_midpoints(&t21, "e2m1 rne", enc_e2m1, MOE_E2M1_RNE, OR_RNE, 0x7);
    check_midpoints(&t21, "e2m1 away", enc_e2m1, MOE_E2M1_TIES_UP, OR_AWAY, 0x7);
    check_midpoints(&t21, "e2m1 trunc", enc_e2m1, MOE_E2M1_TOWARD_ZERO, OR_TRUNC, 0x7);
}

/* ------------------------------------------------------ boundary constants */

static void test_e4m3_boundaries(void) {
    const moe_fp8_overflow S = MOE_FP8_SATURATE, N = MOE_FP8_OVERFLOW_NAN;
    CHECK(moe_fp8_e4m3_from_f32(448.0f, S) == 0x7E && moe_fp8_e4m3_from_f32(448.0f, N) == 0x7E, "448");
    CHECK(moe_fp8_e4m3_from_f32(nextafterf(464.0f, 0), N) == 0x7E, "464 - ulp -> 448");
    /* 464 is the tie between 448 (mantissa 110, even) and 480 (111): RNE
     * keeps 448, as PyTorch's fp8e4m3fn_from_fp32_value does. */
    CHECK(moe_fp8_e4m3_from_f32(464.0f, N) == 0x7E, "464 -> 448 (tie to even)");
    CHECK(moe_fp8_e4m3_from_f32(464.0f, S) == 0x7E, "464 sat");
    CHECK(moe_fp8_e4m3_from_f32(nextafterf(464.0f, INFINITY), N) == 0x7F, "464 + ulp -> NaN");
    CHECK(moe_fp8_e4m3_from_f32(nextafterf(464.0f, INFINITY), S) == 0x7E, "464 + ulp sat");
    CHECK(moe_fp8_e4m3_from_f32(-nextafterf(464.0f, INFINITY), N) == 0xFF, "-(464+ulp) -> -NaN");
    CHECK(moe_fp8_e4m3_from_f32(480.0f, N) == 0x7F && moe_fp8_e4m3_from_f32(480.0f, S) == 0x7E, "480");
    CHECK(moe_fp8_e4m3_from_f32(1e30f, S) == 0x7E && moe_fp8_e4m3_from_f32(-1e30f, S) == 0xFE, "huge");
    CHECK(moe_fp8_e4m3_from_f32(FLT_MAX, N) == 0x7F, "FLT_MAX nonsat");
    CHECK(moe_fp8_e4m3_from_f32(INFINITY, S) == 0x7E && moe_fp8_e4m3_from_f32(-INFINITY, S) == 0xFE, "inf sat");
    CHECK(moe_fp8_e4m3_from_f32(INFINITY, N) == 0x7F && moe_fp8_e4m3_from_f32(-INFINITY, N) == 0xFF, "inf nonsat");
    CHECK(moe_fp8_e4m3_from_f32(NAN, S) == 0x7F && moe_fp8_e4m3_from_f32(-NAN, S) == 0xFF, "nan");
    CHECK(moe_fp8_e4m3_from_f32(0x1p-10f, S) == 0x00, "2^-10 tie -> 0 (even)");
    CHECK(moe_fp8_e4m3_from_f32(-0x1p-10f, S) == 0x80, "-2^-10 -> -0");
    CHECK(moe_fp8_e4m3_from_f32(nextafterf(0x1p-10f, 1), S) == 0x01, "2^-10 + ulp -> 2^-9");
    CHECK(moe_fp8_e4m3_from_f32(0x1p-9f, S) == 0x01, "2^-9 min subnormal");
    CHECK(moe_fp8_e4m3_from_f32(3 * 0x1p-10f, S) == 0x02, "1.5 * 2^-9 tie -> 2 (even)");
    CHECK(moe_fp8_e4m3_from_f32(0x1p-6f, S) == 0x08, "min normal");
    CHECK(moe_fp8_e4m3_from_f32(nextafterf(0x1p-6f, 0), S) == 0x08, "just below min normal");
    CHECK(moe_fp8_e4m3_from_f32(-0.0f, S) == 0x80 && moe_fp8_e4m3_from_f32(0.0f, S) == 0x00, "+-0");
    CHECK(moe_fp8_e4m3_from_f32(0x1p-149f, S) == 0x00, "float subnormal -> 0");
    /* E5M2 */
    CHECK(moe_fp8_e5m2_from_f32(57344.0f, MOE_FP8_OVERFLOW_INF) == 0x7B, "e5m2 max");
    CHECK(moe_fp8_e5m2_from_f32(nextafterf(61440.0f, 0), MOE_FP8_OVERFLOW_INF) == 0x7B, "e5m2 below tie");
    CHECK(moe_fp8_e5m2_from_f32(61440.0f, MOE_FP8_OVERFLOW_INF) == 0x7C, "e5m2 61440 tie -> inf (even)");
    CHECK(moe_fp8_e5m2_from_f32(61440.0f, MOE_FP8_SATURATE) == 0x7B, "e5m2 61440 sat");
    CHECK(moe_fp8_e5m2_from_f32(-INFINITY, MOE_FP8_SATURATE) == 0xFB, "e5m2 -inf sat");
    CHECK(moe_fp8_e5m2_from_f32(0x1p-17f, MOE_FP8_OVERFLOW_INF) == 0x00, "e5m2 2^-17 -> 0");
    CHECK(moe_fp8_e5m2_from_f32(0x1p-16f, MOE_FP8_OVERFLOW_INF) == 0x01, "e5m2 min subnormal");
    /* UE4M3 */
    CHECK(moe_ue4m3_from_f32(-1.0f) == 0 && moe_ue4m3_from_f32(-0.0f) == 0, "ue4m3 negative -> 0");
    CHECK(moe_ue4m3_from_f32(1000.0f) == 0x7E && moe_ue4m3_from_f32(INFINITY) == 0x7E, "ue4m3 sat");
    CHECK(moe_ue4m3_from_f32(NAN) == 0x7F, "ue4m3 nan");
    /* bf16 */
    CHECK(moe_bf16_from_f32(NAN) == 0x7FC0 && moe_bf16_from_f32(-NAN) == 0xFFC0, "bf16 nan");
    CHECK(moe_bf16_from_f32(moe_fmt_f32_from_bits(0x7F800001u)) == 0x7FC0, "bf16 sNaN -> qNaN");
    CHECK(moe_bf16_from_f32(moe_fmt_f32_from_bits(0xFF800001u)) == 0xFFC0, "bf16 -sNaN keeps sign");
    CHECK(moe_bf16_from_f32(FLT_MAX) == 0x7F80, "bf16 FLT_MAX -> inf");
    CHECK(moe_bf16_from_f32(moe_fmt_f32_from_bits(0x3F808000u)) == 0x3F80, "bf16 tie even down");
    CHECK(moe_bf16_from_f32(moe_fmt_f32_from_bits(0x3F818000u)) == 0x3F82, "bf16 tie even up");
}

static void test_e2m1_ties(void) {
    /* docs/formats.md tie table: input, RNE, ties up (away), toward zero */
    static const float tab[][4] = {
        {0.25f, 0.0f, 0.5f, 0.0f}, {0.75f, 1.0f, 1.0f, 0.5f}, {1.25f, 1.0f, 1.5f, 1.0f},
        {1.75f, 2.0f, 2.0f, 1.5f}, {2.5f, 2.0f, 3.0f, 2.0f}, {3.5f, 4.0f, 4.0f, 3.0f},
        {5.0f, 4.0f, 6.0f, 4.0f},
    };
    for (size_t i = 0; i < sizeof tab / sizeof tab[0]; i++)
        for (int r = 0; r < 3; r++)
            for (int sg = 0; sg < 2; sg++) {
                float s = sg ? -1.0f : 1.0f;
                float got = moe_e2m1_to_f32(moe_e2m1_from_f32(s * tab[i][0], (moe_e2m1_round)r));
                CHECK(got == s * tab[i][1 + r] && (signbit(got) != 0) == (sg == 1), "e2m1 %g mode %d -> %g want %g",
                      (double)(s * tab[i][0]), r, (double)got, (double)(s * tab[i][1 + r]));
            }
    for (int r = 0; r < 3; r++) {
        moe_e2m1_round m = (moe_e2m1_round)r;
        CHECK(moe_e2m1_from_f32(6.0f, m) == 0x7 && moe_e2m1_from_f32(7.0f, m) == 0x7, "sat 6/7");
        CHECK(moe_e2m1_from_f32(1e30f, m) == 0x7 && moe_e2m1_from_f32(-1e30f, m) == 0xF, "sat huge");
        CHECK(moe_e2m1_from_f32(INFINITY, m) == 0x7 && moe_e2m1_from_f32(-INFINITY, m) == 0xF, "inf");
        CHECK(moe_e2m1_from_f32(NAN, m) == 0x0 && moe_e2m1_from_f32(-NAN, m) == 0x0, "nan -> +0");
        CHECK(moe_e2m1_from_f32(-0.0f, m) == 0x8, "-0 -> 0x8");
        CHECK(moe_e2m1_from_f32(-0.1f, m) == 0x8, "small negative -> -0");
    }
    CHECK(moe_e2m1_from_f32(5.99f, MOE_E2M1_TOWARD_ZERO) == 0x6, "trunc 5.99 -> 4");
    CHECK(moe_e2m1_from_f32(0.49f, MOE_E2M1_TOWARD_ZERO) == 0x0, "trunc 0.49 -> 0");
}

/* -------------------------------------------------------------- E8M0 scales */

static void test_e8m0_scales(void) {
    const moe_mx_scale_rule C = MOE_MX_SCALE_CEIL, F = MOE_MX_SCALE_FLOOR;
    CHECK(moe_mxfp4_scale_e8m0(6.0f, C) == 127 && moe_mxfp4_scale_e8m0(6.0f, F) == 127, "amax 6");
    CHECK(moe_mxfp4_scale_e8m0(7.9f, C) == 128, "amax 7.9 ceil -> 2^1");
    CHECK(moe_mxfp4_scale_e8m0(7.9f, F) == 127, "amax 7.9 floor -> 2^0 (clips)");
    CHECK(moe_mxfp4_scale_e8m0(8.0f, C) == 128 && moe_mxfp4_scale_e8m0(8.0f, F) == 128, "amax 8");
    CHECK(moe_mxfp4_scale_e8m0(nextafterf(6.0f, 7), C) == 128, "amax 6 + ulp ceil");
    CHECK(moe_mxfp4_scale_e8m0(nextafterf(8.0f, 0), F) == 127, "amax 8 - ulp floor");
    CHECK(moe_mxfp4_scale_e8m0(0.0f, C) == 0 && moe_mxfp4_scale_e8m0(0.0f, F) == 0, "amax 0");
    CHECK(moe_mxfp4_scale_e8m0(0x1p-149f, C) == 0 && moe_mxfp4_scale_e8m0(0x1p-149f, F) == 0, "amax 2^-149");
    CHECK(moe_mxfp4_scale_e8m0(6 * 0x1p-127f, C) == 0, "amax 6*2^-127 ceil -> 0");
    CHECK(moe_mxfp4_scale_e8m0(nextafterf(6 * 0x1p-127f, 1), C) == 1, "just above -> 1");
    CHECK(moe_mxfp4_scale_e8m0(0x1p-120f, F) == 5, "floor 2^-120 -> -122");
    CHECK(moe_mxfp4_scale_e8m0(3 * 0x1p-130f, F) == 0, "floor clamps at 0");
    CHECK(moe_mxfp4_scale_e8m0(FLT_MAX, C) == 253 && moe_mxfp4_scale_e8m0(FLT_MAX, F) == 252, "FLT_MAX");
    CHECK(moe_mxfp4_scale_e8m0(NAN, C) == 0xFF && moe_mxfp4_scale_e8m0(INFINITY, F) == 0xFF, "nonfinite");
    CHECK(moe_e8m0_ceil_f32(0x1p-127f) == 0 && moe_e8m0_floor_f32(0x1p-127f) == 0, "2^-127 subnormal");
    CHECK(moe_e8m0_ceil_f32(0x1p-140f) == 0 && moe_e8m0_floor_f32(0x1p-140f) == 0, "clamp low");
    CHECK(moe_e8m0_ceil_f32(FLT_MAX) == 254 && moe_e8m0_floor_f32(FLT_MAX) == 254, "clamp high");
    CHECK(moe_e8m0_ceil_f32(0.0f) == 0 && moe_e8m0_ceil_f32(-1.0f) == 0, "nonpositive");
    for (int e = -126; e <= 126; e++) {
        float p = ldexpf(1.0f, e);
        CHECK(moe_e8m0_ceil_f32(nextafterf(p, INFINITY)) == e + 128, "ceil above 2^%d", e);
        CHECK(moe_e8m0_floor_f32(nextafterf(p, INFINITY)) == e + 127, "floor above 2^%d", e);
        CHECK(moe_e8m0_ceil_f32(nextafterf(p, 0)) == e + 127, "ceil below 2^%d", e);
        CHECK(moe_e8m0_floor_f32(nextafterf(p, 0)) == e + 126, "floor below 2^%d", e);
    }
    /* the rules against their definitions, on random amax over the range */
    uint64_t s = 42;
    long bad = 0, n = 0;
    for (int i = 0; i < 200000; i++) {
        float a = moe_fmt_f32_from_bits((uint32_t)moe_splitmix64(&s) & 0x7FFFFFFFu);
        if (!(a > 0) || isinf(a)) continue;
        n++;
        int ec = moe_mxfp4_scale_e8m0(a, C) - 127, ef = moe_mxfp4_scale_e8m0(a, F) - 127;
        int ok_c = (ec == -127 || ldexp(6.0, ec - 1) < a) && (ldexp(6.0, ec) >= a || ec == 127);
        int ok_f = ef == -127 ? a < ldexp(1.0, -124) /* floor(log2 a) - 2 <= -127 */
                              : (ldexp(4.0, ef) <= a && a < ldexp(8.0, ef));
        if (!(ok_c && ok_f) && bad++ < 3)
            fprintf(stderr, "  amax %a: ceil %d floor %d\n", (double)a, ec, ef);
    }
    CHECK(bad == 0, "%ld of %ld random amax break the scale rules", bad, n);
}

/* ---------------------------------------------------------------- MXFP4 */

/* Half the distance between the two E2M1 values around |y| (y <= 6). */
static double e2m1_half_gap(double y) {
    y = fabs(y);
    return y < 2 ? 0.25 : y < 4 ? 0.5 : 1.0;
}

static void test_mxfp4_blocks(void) {
    enum { N = 32 * 48 };
    float x[N];
    uint8_t packed[N / 2], sc[N / MOE_MXFP4_BLOCK];
    float out[N];
    double out64[N];
    uint64_t s = 7;
    for (int b = 0; b < N / 32; b++) {
        double mag = ldexp(1.0, (int)(moe_splitmix64(&s) % 40) - 20);
        for (int i = 0; i < 32; i++) x[b * 32 + i] = (float)(moe_t_rng_normal(&s) * mag);
    }
    x[5] = 0.0f;
    x[6] = -0.0f;
    for (int rule = 0; rule < 2; rule++)
        for (int r = 0; r < 3; r++) {
            moe_mxfp4_quant_row(x, N, (moe_mx_scale_rule)rule, (moe_e2m1_round)r, packed, sc);
            moe_mxfp4_dequant_row(packed, sc, N, out);
            moe_mxfp4_dequant_row_f64(packed, sc, N, out64);
            long bad = 0, inexact = 0;
            for (int j = 0; j < N; j++) {
                double S = ldexp(1.0, sc[j / 32] - 127);
                double y = (double)x[j] / S;
                uint8_t code = (uint8_t)(j & 1 ? packed[j / 2] >> 4 : packed[j / 2] & 15);
                double want = ref_e2m1(code) * S;
                if ((double)out[j] != want || out64[j] != want) inexact++;
                double err = fabs((double)x[j] - out64[j]);
                double bound = (r == MOE_E2M1_TOWARD_ZERO ? 2 : 1) * e2m1_half_gap(fabs(y) > 6 ? 6 : y) * S;
                if (fabs(y) > 6) bound += (fabs(y) - 6) * S; /* FLOOR clipping */
                if (rule == MOE_MX_SCALE_CEIL && fabs(y) > 6) bad++;
                if (err > bound) bad++;
            }
            CHECK(bad == 0, "mxfp4 rule %d round %d: %ld elements out of bound", rule, r, bad);
            CHECK(inexact == 0, "mxfp4 dequant not exact: %ld", inexact);
        }
    /* RNE codes equal the oracle on x / scale */
    table t21 = make_table(ref_e2m1, 0x7, 8.0);
    moe_mxfp4_quant_row(x, N, MOE_MX_SCALE_CEIL, MOE_E2M1_RNE, packed, sc);
    long bad = 0;
    for (int j = 0; j < N; j++) {
        uint8_t code = (uint8_t)(j & 1 ? packed[j / 2] >> 4 : packed[j / 2] & 15);
        if (code != oracle_e2m1(&t21, ldexp((double)x[j], 127 - sc[j / 32]), MOE_E2M1_RNE)) bad++;
    }
    CHECK(bad == 0, "mxfp4 codes differ from the oracle: %ld", bad);
    CHECK((packed[2] >> 4) == 0 && (packed[3] & 15) == 0x8, "+0 and -0 codes (elements 5, 6)");

    /* the documented clipping difference, block with amax 7 and 7.9 */
    float blk[32];
    for (int i = 0; i < 32; i++) blk[i] = (float)(i % 7) * 0.5f - 1.5f;
    uint8_t p1[16], s1[1];
    float o1[32];
    blk[9] = 7.0f;
    moe_mxfp4_quant_row(blk, 32, MOE_MX_SCALE_CEIL, MOE_E2M1_RNE, p1, s1);
    moe_mxfp4_dequant_row(p1, s1, 32, o1);
    CHECK(s1[0] == 128 && o1[9] == 8.0f, "ceil: scale 2, 7 -> 3.5 -> 4 (tie even) -> 8; got %g", (double)o1[9]);
    moe_mxfp4_quant_row(blk, 32, MOE_MX_SCALE_FLOOR, MOE_E2M1_RNE, p1, s1);
    moe_mxfp4_dequant_row(p1, s1, 32, o1);
    CHECK(s1[0] == 127 && o1[9] == 6.0f, "floor: scale 1, 7 clips to 6; got %g", (double)o1[9]);
    CHECK(o1[0] == -1.5f && o1[1] == -1.0f, "floor keeps small values exact");
    blk[9] = 7.9f;
    moe_mxfp4_quant_row(blk, 32, MOE_MX_SCALE_CEIL, MOE_E2M1_RNE, p1, s1);
    moe_mxfp4_dequant_row(p1, s1, 32, o1);
    CHECK(o1[9] == 8.0f, "ceil: 7.9 -> 8");
    moe_mxfp4_quant_row(blk, 32, MOE_MX_SCALE_FLOOR, MOE_E2M1_RNE, p1, s1);
    moe_mxfp4_dequant_row(p1, s1, 32, o1);
    CHECK(o1[9] == 6.0f, "floor: 7.9 clips to 6 (error 1.9 > half gap 1)");
    /* all-zero block, NaN block */
    memset(blk, 0, sizeof blk);
    moe_mxfp4_quant_row(blk, 32, MOE_MX_SCALE_CEIL, MOE_E2M1_RNE, p1, s1);
    moe_mxfp4_dequant_row(p1, s1, 32, o1);
    CHECK(s1[0] == 0 && o1[0] == 0.0f && o1[31] == 0.0f, "zero block: scale code 0");
    blk[3] = NAN;
    moe_mxfp4_quant_row(blk, 32, MOE_MX_SCALE_CEIL, MOE_E2M1_RNE, p1, s1);
    moe_mxfp4_dequant_row(p1, s1, 32, o1);
    moe_mxfp4_dequant_row_f64(p1, s1, 32, out64);
    CHECK(s1[0] == 0xFF && isnan(o1[0]) && isnan(out64[7]), "NaN block decodes to NaN");
    /* nibble order: element 2j low, 2j+1 high */
    uint8_t pk[16] = {0x21}, es[1] = {127};
    moe_mxfp4_dequant_row(pk, es, 32, o1);
    CHECK(o1[0] == 0.5f && o1[1] == 1.0f, "low nibble first: %g %g", (double)o1[0], (double)o1[1]);
    /* float overflow at the top scales; f64 stays exact */
    uint8_t pk7[16];
    memset(pk7, 0x77, sizeof pk7);
    es[0] = 253;
    moe_mxfp4_dequant_row(pk7, es, 32, o1);
    moe_mxfp4_dequant_row_f64(pk7, es, 32, out64);
    CHECK(isinf(o1[0]) && out64[0] == ldexp(6.0, 126), "6 * 2^126: float Inf, f64 exact");
}

/* ---------------------------------------------------------------- NVFP4 */

static void test_nvfp4(void) {
    enum { R = 16, C = 256 };
    static float w[R * C];
    uint8_t packed[C / 2], sc[C / 16];
    float out[C];
    double out64[C];
    uint64_t s = 11;
    for (int r = 0; r < R; r++) {
        double mag = ldexp(1.0, (int)(moe_splitmix64(&s) % 6) - 3);
        for (int c = 0; c < C; c++) w[r * C + c] = (float)(moe_t_rng_normal(&s) * mag);
    }
    float amax = 0;
    for (int i = 0; i < R * C; i++) amax = fabsf(w[i]) > amax ? fabsf(w[i]) : amax;
    float s2 = moe_nvfp4_scale2(w, R * C);
    CHECK(s2 == amax / 2688.0f, "scale2 = amax / (6 * 448)");
    table t43 = make_table(ref_e4m3, 0x7E, 480.0);
    table t21 = make_table(ref_e2m1, 0x7, 8.0);
    long bad_scale = 0, bad_code = 0, bad_deq = 0, bad_err = 0, max_scale = 0;
    for (int r = 0; r < R; r++) {
        const float *x = w + r * C;
        moe_nvfp4_quant_row(x, C, s2, MOE_E2M1_RNE, packed, sc);
        moe_nvfp4_dequant_row(packed, sc, s2, C, out);
        moe_nvfp4_dequant_row_f64(packed, sc, s2, C, out64);
        for (int b = 0; b < C / 16; b++) {
            float bamax = 0;
            for (int i = 0; i < 16; i++) bamax = fabsf(x[b * 16 + i]) > bamax ? fabsf(x[b * 16 + i]) : bamax;
            float want = bamax / (6.0f * s2);
            if (want < 0x1p-9f) want = 0x1p-9f;
            if (sc[b] != (unsigned)oracle(&t43, want, OR_RNE) && !(sc[b] == 0x7E && want >= 448.0f)) bad_scale++;
            if (sc[b] == 0x7E) max_scale++;
            float d = moe_ue4m3_to_f32(sc[b]) * s2;
            for (int i = 0; i < 16; i++) {
                int j = b * 16 + i;
                uint8_t code = (uint8_t)(j & 1 ? packed[j / 2] >> 4 : packed[j / 2] & 15);
                if (code != oracle_e2m1(&t21, x[j] / d, MOE_E2M1_RNE)) bad_code++;
                double exact = ref_e2m1(code) * ref_e4m3(sc[b]) * (double)s2;
                if (out64[j] != exact || out[j] != (float)exact) bad_deq++;
                /* normal-range block scales: error <= half an E2M1 gap (at most
                 * 1 unit) times the decoded scale, with slack for the scale's
                 * own rounding which can push the top element above 6 */
                if (fabs((double)x[j] - exact) > 1.0 * (double)d * (1 + 1e-6)) bad_err++;
            }
        }
    }
    CHECK(bad_scale == 0, "nvfp4 block scales differ from the nearest UE4M3: %ld", bad_scale);
    CHECK(bad_code == 0, "nvfp4 codes differ from the oracle: %ld", bad_code);
    CHECK(bad_deq == 0, "nvfp4 dequant: f64 exact and float correctly rounded: %ld", bad_deq);
    CHECK(bad_err == 0, "nvfp4 elements out of bound: %ld", bad_err);
    CHECK(max_scale >= 1, "the block holding the tensor amax gets scale 448");
    /* special blocks */
    float blk[32] = {0};
    uint8_t p[16], s3[2];
    for (int i = 16; i < 32; i++) blk[i] = 1e-30f;
    moe_nvfp4_quant_row(blk, 32, 1.0f, MOE_E2M1_RNE, p, s3);
    CHECK(s3[0] == 0x38, "all-zero block -> scale 1.0");
    CHECK(s3[1] == 0x01, "tiny block -> scale clamped to 2^-9");
    blk[4] = NAN;
    moe_nvfp4_quant_row(blk, 32, 1.0f, MOE_E2M1_RNE, p, s3);
    moe_nvfp4_dequant_row(p, s3, 1.0f, 32, out);
    CHECK(s3[0] == 0x7F && isnan(out[0]), "NaN block -> scale NaN");
    float z[16] = {0};
    CHECK(moe_nvfp4_scale2(z, 16) == 1.0f, "zero tensor scale2 = 1");
    CHECK(isnan(moe_nvfp4_scale2(blk, 32)), "NaN tensor scale2 = NaN");
    /* a sign-bit scale byte is not UE4M3: the block decodes to NaN */
    uint8_t bad_sc[1] = {0xB8}, p8[8] = {0x22};
    moe_nvfp4_dequant_row(p8, bad_sc, 1.0f, 16, out);
    CHECK(isnan(out[0]), "scale 0xB8 -> NaN");
}

/* ------------------------------------------------------------------ FP8 */

static void test_fp8_blocks(void) {
    enum { R = 200, C = 300, TR = 2, TC = 3 };
    static float w[R * C];
    static uint8_t q[R * C];
    float sc[TR * TC];
    uint8_t se[TR * TC];
    float out[C];
    double out64[C];
    uint64_t s = 13;
    for (int i = 0; i < R * C; i++) w[i] = (float)(moe_t_rng_normal(&s) * 0.02);
    for (int r = 128; r < R; r++)   /* tile (1, 2) all zero */
        for (int c = 256; c < C; c++) w[r * C + c] = 0.0f;
    w[130 * C + 5] = 3.0f;          /* an outlier in tile (1, 0) */
    table t43 = make_table(ref_e4m3, 0x7E, 480.0);

    for (int kind = 0; kind < 2; kind++) {
        moe_fp8_block_quant(w, R, C, (moe_fp8_scale)kind, q, sc);
        long bad_scale = 0, bad_code = 0, bad_deq = 0;
        for (int ti = 0; ti < TR; ti++)
            for (int tj = 0; tj < TC; tj++) {
                float amax = 0;
                for (int r = ti * 128; r < R && r < ti * 128 + 128; r++)
                    for (int c = tj * 128; c < C && c < tj * 128 + 128; c++)
                        amax = fabsf(w[r * C + c]) > amax ? fabsf(w[r * C + c]) : amax;
                float want;
                if (amax == 0) want = 1.0f;
                else if (kind == MOE_FP8_SCALE_F32) want = amax / 448.0f;
                else {
                    int e = -127;
                    while (ldexp(448.0, e) < amax) e++;
                    want = ldexpf(1.0f, e);
                }
                if (sc[ti * TC + tj] != want) bad_scale++;
            }
        for (int r = 0; r < R; r++) {
            const float *srow = sc + (r / 128) * TC;
            for (int c = 0; c < C; c++)
                if (q[r * C + c] != oracle_e4m3(&t43, w[r * C + c] / srow[c / 128], MOE_FP8_SATURATE)) bad_code++;
            moe_fp8_block_dequant_row(q + r * C, srow, C, out);
            moe_fp8_block_dequant_row_f64(q + r * C, srow, C, out64);
            for (int c = 0; c < C; c++) {
                double exact = ref_e4m3(q[r * C + c]) * (double)srow[c / 128];
                if (out64[c] != exact || out[c] != (float)exact) bad_deq++;
                if (kind == MOE_FP8_SCALE_POW2 && (double)out[c] != exact) bad_deq++;
            }
        }
        CHECK(bad_scale == 0, "fp8 kind %d tile scales: %ld wrong", kind, bad_scale);
        CHECK(bad_code == 0, "fp8 kind %d codes differ from the oracle: %ld", kind, bad_code);
        CHECK(bad_deq == 0, "fp8 kind %d dequant: %ld", kind, bad_deq);
        CHECK(sc[1 * TC + 2] == 1.0f, "zero tile -> scale 1");
        CHECK(q[130 * C + 5] == 0x7E || kind == MOE_FP8_SCALE_POW2, "outlier maps to 448 with fp32 scale");
    }
    /* E8M0 variant equals the pow2 fp32 scales */
    static uint8_t q2[R * C];
    moe_fp8_block_quant(w, R, C, MOE_FP8_SCALE_POW2, q, sc);
    moe_fp8_block_quant_e8m0(w, R, C, q2, se);
    long diff = 0;
    for (int i = 0; i < TR * TC; i++) diff += moe_e8m0_to_f32(se[i]) != sc[i];
    CHECK(diff == 0 && memcmp(q, q2, sizeof q2) == 0, "e8m0 and pow2 fp32 agree");
    CHECK(se[1 * TC + 2] == 127, "zero tile -> e8m0 127");
    for (int r = 0; r < R; r += 37) {
        moe_fp8_block_dequant_row_e8m0(q2 + r * C, se + (r / 128) * TC, C, out);
        moe_fp8_block_dequant_row_e8m0_f64(q2 + r * C, se + (r / 128) * TC, C, out64);
        long bad = 0;
        for (int c = 0; c < C; c++) {
            double exact = ref_e4m3(q2[r * C + c]) * ldexp(1.0, se[(r / 128) * TC + c / 128] - 127);
            bad += (double)out[c] != exact || out64[c] != exact;
        }
        CHECK(bad == 0, "e8m0 dequant row %d exact: %ld", r, bad);
    }
    /* fp32 scale is not exact in float: the f64 twin is, and float is its rounding */
    uint8_t one = 0x7E;
    float s3 = 0.1f;
    double d64;
    float d32;
    moe_fp8_block_dequant_row(&one, &s3, 1, &d32);
    moe_fp8_block_dequant_row_f64(&one, &s3, 1, &d64);
    CHECK(d64 == 448.0 * (double)0.1f && d32 == (float)d64 && (double)d32 != d64, "448 * 0.1f");
    /* zero-size and tiny shapes */
    moe_fp8_block_quant(w, 0, 0, MOE_FP8_SCALE_F32, q, sc);
    float w1[3] = {1.0f, -2.0f, 0.5f};
    moe_fp8_block_quant(w1, 1, 3, MOE_FP8_SCALE_F32, q, sc);
    CHECK(sc[0] == 2.0f / 448.0f && q[1] == 0xFE, "1 x 3 tensor");
}

static void test_fp8_act(void) {
    enum { N = 300 };
    float x[N];
    uint8_t q[N];
    float sc[3], out[N];
    uint64_t s = 17;
    for (int i = 0; i < N; i++) x[i] = (float)moe_t_rng_normal(&s);
    for (int i = 128; i < 256; i++) x[i] = 0.0f;   /* block 1 all zero: amax floor */
    table t43 = make_table(ref_e4m3, 0x7E, 480.0);
    for (int kind = 0; kind < 2; kind++) {
        moe_fp8_act_quant_row(x, N, (moe_fp8_scale)kind, q, sc);
        long bad = 0;
        for (int b = 0; b < 3; b++) {
            float amax = 0;
            for (int i = b * 128; i < N && i < b * 128 + 128; i++) amax = fabsf(x[i]) > amax ? fabsf(x[i]) : amax;
            if (amax < 1e-4f) amax = 1e-4f;
            float want;
            if (kind == MOE_FP8_SCALE_F32) want = amax / 448.0f;
            else {
                int e = -127;
                while (ldexp(448.0, e) < amax) e++;
                want = ldexpf(1.0f, e);
            }
            CHECK(sc[b] == want, "act kind %d block %d scale %a want %a", kind, b, (double)sc[b], (double)want);
        }
        for (int i = 0; i < N; i++) bad += q[i] != oracle_e4m3(&t43, x[i] / sc[i / 128], MOE_FP8_SATURATE);
        CHECK(bad == 0, "act codes differ from the oracle: %ld", bad);
        moe_fp8_block_dequant_row(q, sc, N, out);
        long out_of_bound = 0;
        for (int i = 0; i < N; i++)
            out_of_bound += fabs((double)out[i] - x[i]) > fabs((double)x[i]) * 0x1p-4 + 0x1p-10 * sc[i / 128];
        CHECK(out_of_bound == 0, "act round trip within half an E4M3 ulp: %ld", out_of_bound);
    }
    CHECK(sc[1] == ldexpf(1.0f, -22), "zero block pow2 scale = 2^ceil(log2(1e-4/448)) = 2^-22: %a", (double)sc[1]);
    x[3] = NAN;
    moe_fp8_act_quant_row(x, N, MOE_FP8_SCALE_POW2, q, sc);
    CHECK(isnan(sc[0]) && !isnan(sc[2]), "NaN poisons only its block");
}

/* NVFP4 activations against vLLM's reference (tests/kernels/quantization
 * nvfp4_utils ref_nvfp4_quant), re-derived here with independent roundings:
 * E4M3 by nearest search over the 127 finite positive codes (ties to the
 * even code), E2M1 by vLLM's threshold table (cast_to_fp4). Every fp32
 * operation in the reference's order. */
static float ind_e4m3_round(float s) { /* s >= 0, <= 448 */
    float best = 0.0f;
    int bc = 0;
    for (int c = 0; c < 127; c++) {
        float v = moe_fp8_e4m3_to_f32((uint8_t)c);
        float d = fabsf(v - s), db = fabsf(best - s);
        if (d < db || (d == db && (c & 1) == 0 && (bc & 1))) { best = v; bc = c; }
    }
    return best;
}
static float ind_cast_to_fp4(float x) {
    float a = fabsf(x), r;
    if (a <= 0.25f) r = 0.0f;
    else if (a < 0.75f) r = 0.5f;
    else if (a <= 1.25f) r = 1.0f;
    else if (a < 1.75f) r = 1.5f;
    else if (a <= 2.5f) r = 2.0f;
    else if (a < 3.5f) r = 3.0f;
    else if (a <= 5.0f) r = 4.0f;
    else r = 6.0f;
    return x < 0 ? -r : r;
}

static void test_nvfp4_act(void) {
    uint64_t s = 404;
    enum { N = 16 * 40 + 7 }; /* 40 whole blocks and a partial one */
    float x[N];
    uint8_t codes[N], sf[(N + 15) / 16];
    int bad = 0, checked = 0;
    for (int round = 0; round < 60; round++) {
        float input_scale = round % 3 == 0 ? 1.0f / (6 * 448) : (float)(0.5 + moe_t_rng_unif(&s)) * 1e-3f;
        for (int i = 0; i < N; i++) {
            double g = moe_t_rng_normal(&s);
            x[i] = (float)(g * (round % 5 == 0 ? 8.0 : 1.0));
        }
        /* adversarial blocks: zeros, a tie pattern, a huge block (scale clamps at 448), a tiny one (scale 0) */
        for (int i = 0; i < 16; i++) { x[i] = 0.0f; x[16 + i] = (i % 8) * 0.25f * (i & 1 ? -1.0f : 1.0f); }
        for (int i = 32; i < 48; i++) x[i] = 1e6f * (float)(i - 40);
        for (int i = 48; i < 64; i++) x[i] = 1e-12f * (float)(i - 55);
        moe_nvfp4_act_quant_row(x, N, input_scale, codes, sf);
        float gs = 1.0f / input_scale, inv_gs = 1.0f / gs, rcp6 = 1.0f / 6.0f;
        for (int b = 0; b * 16 < N; b++) {
            int c0 = b * 16, c1 = c0 + 16 < N ? c0 + 16 : N;
            float vmax = 0;
            for (int i = c0; i < c1; i++) vmax = fmaxf(vmax, fabsf(x[i]));
            float scale = gs * (vmax * rcp6);
            scale = fminf(scale, 448.0f);
            float sfv = ind_e4m3_round(scale);
            float os = sfv == 0 ? 0.0f : 1.0f / (sfv * inv_gs);
            bad += moe_ue4m3_to_f32(sf[b]) != sfv;
            for (int i = c0; i < c1; i++) {
                float y = fminf(fmaxf(x[i] * os, -6.0f), 6.0f);
                float want = ind_cast_to_fp4(y), got = moe_e2m1_to_f32(codes[i]);
                bad += !(got == want || (got == 0 && want == 0));
                checked++;
            }
        }
    }
    CHECK(bad == 0, "%d of %d NVFP4 activation codes / block scales differ from the reference rule", bad, checked);
    /* a NaN poisons its block's scale only */
    for (int i = 0; i < 32; i++) x[i] = 1.0f;
    x[3] = NAN;
    moe_nvfp4_act_quant_row(x, 32, 0.01f, codes, sf);
    CHECK(sf[0] == 0x7F && isnan(moe_ue4m3_to_f32(sf[0])) && sf[1] != 0x7F, "NaN block: sf %02x %02x", sf[0], sf[1]);
}

/*
 * moe_expf_f32 against the exact e^x.
 *
 * Oracle: glibc's double exp, whose error is below 1 ulp of double
 * (2^-52 relative); one float ulp is at least 2^-24 of the value, so the
 * oracle moves a measured error by less than 2^-28 float ulps (and the
 * float's subnormal ulp, 2^-149, is far above a double ulp of a value
 * >= 2^-150). The error is |y - e| / ulp(e), ulp(e) = 2^(floor(log2 e) -
 * 23), at least 2^-149: the distance to the exact value in units of the
 * float grid there, so 0.5 is correct rounding's worst case.
 * Inputs: every float whose exp is finite and nonzero at a stride of 61
 * (MOE_EXPF_EXHAUSTIVE=1: every float, all 2^32 bit patterns; the result
 * is recorded in docs/formats.md), then the special values and both
 * thresholds exactly.
 */
static double expf_ulp_err(float x, float y) {
    double e = exp((double)x);
    int k;
    (void)frexp(e, &k); /* e = m 2^k, m in [0.5, 1): floor(log2 e) = k - 1 */
    double ulp = ldexp(1.0, k - 24 > -149 ? k - 24 : -149);
    return fabs((double)y - e) / ulp;
}

/* moe_act_round_f32's BF16 case (inline, branch-free) against the two
 * reference calls, bit for bit: every upper half (signs, exponents, NaN and
 * Inf patterns, subnormals) with lower halves at and around the rounding
 * tie (0x8000), the extremes, and random ones; in a buffer whose length is
 * no multiple of any vector width. */
static void test_bf16_act(void) {
    static const uint32_t lows[] = {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu, 0x4000u, 0xC000u};
    enum { NL = sizeof lows / sizeof lows[0], N = 65536 * (NL + 1) + 3 };
    uint32_t *in = malloc((size_t)N * 4);
    float *x = malloc((size_t)N * 4);
    CHECK(in && x, "allocation");
    if (!in || !x) return;
    uint64_t s = 41;
    size_t m = 0;
    for (uint32_t hi = 0; hi < 65536; hi++) {
        for (int l = 0; l < NL; l++) in[m++] = hi << 16 | lows[l];
        in[m++] = hi << 16 | (uint32_t)(moe_splitmix64(&s) & 0xFFFFu);
    }
    while (m < (size_t)N) in[m++] = (uint32_t)moe_splitmix64(&s);
    memcpy(x, in, (size_t)N * 4);
    moe_act_round_f32(MOE_ACT_BF16, x, N);
    long bad = 0;
    for (size_t i = 0; i < (size_t)N; i++) {
        float v, want;
        memcpy(&v, &in[i], 4);
        want = moe_bf16_to_f32(moe_bf16_from_f32(v));
        if (memcmp(&want, &x[i], 4) && bad++ < 5) {
            uint32_t g;
            memcpy(&g, &x[i], 4);
            fprintf(stderr, "bf16 act: 0x%08x -> 0x%08x, want the reference's\n", in[i], g);
        }
    }
    CHECK(bad == 0, "%ld of %d values differ from moe_bf16_from_f32's rounding", bad, N);
    free(in);
    free(x);
}

static void test_expf(void) {
    const char *ex = getenv("MOE_EXPF_EXHAUSTIVE");
    uint32_t stride = ex && ex[0] == '1' ? 1 : 61;
    double worst = 0, worst_sub = 0;
    float worst_x = 0, worst_sub_x = 0;
    uint64_t count = 0, not_cr = 0, bad_special = 0;
    for (uint64_t b = 0; b < (1ull << 32); b += stride) {
        uint32_t bits = (uint32_t)b;
        float x;
        memcpy(&x, &bits, 4);
        float y = moe_expf_f32(x);
        if (isnan(x)) {
            uint32_t yb;
            memcpy(&yb, &y, 4);
            bad_special += !(isnan(y) && (yb & 0x00400000u)); /* quiet */
            continue;
        }
        if (x > MOE_EXPF_HI || x < MOE_EXPF_LO) {
            bad_special += !(x > MOE_EXPF_HI ? y == INFINITY : (y == 0.0f && !signbit(y)));
            continue;
        }
        count++;
        double err = expf_ulp_err(x, y);
        if (y != (float)exp((double)x)) not_cr++;
        if (y < 0x1p-126f) {
            if (err > worst_sub) { worst_sub = err; worst_sub_x = x; }
        } else if (err > worst) {
            worst = err;
            worst_x = x;
        }
    }
    fprintf(stderr, "note: moe_expf_f32 over %llu floats (stride %u): max %.4f ulp at x = %a (normal results), "
            "%.4f ulp at x = %a (subnormal results); %.3f%% not the correctly rounded float\n",
            (unsigned long long)count, stride, worst, (double)worst_x, worst_sub, (double)worst_sub_x,
            100.0 * (double)not_cr / (double)count);
    CHECK(worst <= MOE_EXPF_MAX_ULP && worst_sub <= MOE_EXPF_MAX_ULP, "moe_expf_f32 within %.2f ulp: %.4f, %.4f",
          MOE_EXPF_MAX_ULP, worst, worst_sub);
    CHECK(bad_special == 0, "NaN / overflow / underflow inputs: %llu wrong", (unsigned long long)bad_special);
    /* the thresholds are the correctly rounded exp's: exp(HI) < FLT_MAX + ulp/2
     * <= exp(next float up), exp(LO) > 2^-150 >= exp(next float down) */
    double hi = (double)MOE_EXPF_HI, hin = (double)nextafterf(MOE_EXPF_HI, INFINITY);
    double lo = (double)MOE_EXPF_LO, lon = (double)nextafterf(MOE_EXPF_LO, -INFINITY);
    double ovf = log(0x1.ffffffp127); /* ln(FLT_MAX + ulp/2), exact enough: 2^-53 relative */
    CHECK(hi < ovf && hin > ovf, "overflow threshold: %a < %a < %a", hi, ovf, hin);
    CHECK(lo > -150.0 * 0.69314718055994531 && lon < -150.0 * 0.69314718055994531, "underflow threshold: %a > %a > %a", lo, -150.0 * 0.69314718055994531, lon);
    CHECK(moe_expf_f32(MOE_EXPF_HI) <= FLT_MAX && moe_expf_f32(nextafterf(MOE_EXPF_HI, INFINITY)) == INFINITY,
          "exp overflows above MOE_EXPF_HI only");
    CHECK(moe_expf_f32(MOE_EXPF_LO) == 0x1p-149f && moe_expf_f32(nextafterf(MOE_EXPF_LO, -INFINITY)) == 0.0f,
          "exp(MOE_EXPF_LO) = 2^-149, below it +0");
    CHECK(moe_expf_f32(INFINITY) == INFINITY && moe_expf_f32(-INFINITY) == 0.0f && !signbit(moe_expf_f32(-INFINITY)),
          "exp(+-Inf)");
    CHECK(moe_expf_f32(0.0f) == 1.0f && moe_expf_f32(-0.0f) == 1.0f && moe_expf_f32(0x1p-149f) == 1.0f &&
          moe_expf_f32(-0x1p-149f) == 1.0f, "exp(+-0) = exp(+-2^-149) = 1");
    CHECK(isnan(moe_expf_f32(NAN)), "exp(NaN) is NaN");
}

/* MXFP4 as E4M3 with a tile exponent (moe_e2m1_to_e4m3_pow2,
 * moe_mx_tile_exponent; the GPU's FP8 x FP8 path transcodes MXFP4 weights
 * with them). Every E2M1 code x every d of the window: the E4M3 code
 * decodes (independent ldexp decoder) to exactly e2m1 x 2^d, sign of zero
 * included. The window is tight: just outside it some code's value is no
 * E4M3 value (d = DMAX + 1: 6 x 2^7 = 768 > 448; d = DMIN - 1: 0.5 x 2^-9
 * below the smallest subnormal), checked against the set of all E4M3
 * values. The tile rule at its edges. */
static void test_mx_e4m3(void) {
    int wrong = 0;
    for (int d = MOE_MX_E4M3_DMIN; d <= MOE_MX_E4M3_DMAX; d++)
        for (unsigned c = 0; c < 16; c++) {
            const uint8_t q = moe_e2m1_to_e4m3_pow2((uint8_t)c, d);
            const double want = ldexp(ref_e2m1(c), d), got = ref_e4m3(q);
            if (!same_value(got, want) && wrong++ < 5)
                fprintf(stderr, "  e2m1 0x%x x 2^%d: E4M3 0x%02x = %g, want %g\n", c, d, q, got, want);
        }
    CHECK(wrong == 0, "%d of %d (code, d) pairs transcode wrongly", wrong,
          16 * (MOE_MX_E4M3_DMAX - MOE_MX_E4M3_DMIN + 1));
    CHECK(MOE_MX_E4M3_DMAX - MOE_MX_E4M3_DMIN == 14, "the window spans 14 exponents");
    /* tightness: a value outside the window is no E4M3 value */
    const int edge[2] = {MOE_MX_E4M3_DMIN - 1, MOE_MX_E4M3_DMAX + 1};
    for (int k = 0; k < 2; k++) {
        int missing = 0;
        for (unsigned c = 1; c < 8; c++) {
            const double v = ldexp(ref_e2m1(c), edge[k]);
            int found = 0;
            for (unsigned q = 0; q < 0x7F; q++) found |= ref_e4m3(q) == v;
            missing += !found;
        }
        CHECK(missing > 0, "d = %d: every E2M1 value x 2^d is an E4M3 value (the window is not tight)", edge[k]);
    }
    /* the tile rule */
    CHECK(moe_mx_tile_exponent(1, 0) == 127, "no nonzero block: R = 127 (scale 1)");
    CHECK(moe_mx_tile_exponent(120, 127) == 121, "codes 120..127 (the bench's): R = 121");
    CHECK(moe_mx_tile_exponent(106, 120) == 114, "a spread of 14 fits, at both edges (d -8 and 6)");
    CHECK(moe_mx_tile_exponent(105, 120) == -1, "a spread of 15 does not fit");
    CHECK(moe_mx_tile_exponent(0, 0) == 1, "codes 0 (2^-127): R clamped to 1 (an fp32 normal tile scale)");
    CHECK(moe_mx_tile_exponent(0, 8) == 2 && moe_mx_tile_exponent(0, 9) == 3 && moe_mx_tile_exponent(0, 14) == 8,
          "low codes: R = max(hi - 6, 1)");
    CHECK(moe_mx_tile_exponent(0, 15) == -1, "codes 0 .. 15 do not fit");
    CHECK(moe_mx_tile_exponent(240, 254) == 248, "codes 240 .. 254 (2^127) fit");
    /* every (lo, hi): valid R means every code of the range lands in the window */
    int bad = 0;
    for (int lo = 0; lo <= 254; lo++)
        for (int hi = lo; hi <= 254; hi++) {
            const int R = moe_mx_tile_exponent(lo, hi);
            const bool fits = R >= 0;
            if (fits != (hi - lo <= 14)) bad++;
            if (fits && (R < 1 || lo - R < MOE_MX_E4M3_DMIN || hi - R > MOE_MX_E4M3_DMAX)) bad++;
        }
    CHECK(bad == 0, "moe_mx_tile_exponent: %d (lo, hi) pairs wrong", bad);
}

int main(void) {
    RUN(test_expf);
    RUN(test_bf16_act);
    RUN(test_decode_exhaustive);
    RUN(test_reencode_exhaustive);
    RUN(test_oracle);
    RUN(test_midpoints);
    RUN(test_e4m3_boundaries);
    RUN(test_e2m1_ties);
    RUN(test_e8m0_scales);
    RUN(test_mxfp4_blocks);
    RUN(test_mx_e4m3);
    RUN(test_nvfp4);
    RUN(test_fp8_blocks);
    RUN(test_fp8_act);
    RUN(test_nvfp4_act);
    return moe_t_finish();
}
