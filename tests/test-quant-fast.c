/*
 * Fast quantizers (include/moe_quant_fast.h) against the scalar references
 * (moe_formats.h): codes and scales must be bit-identical, on both builds
 * (portable, and AVX-512 where the CPU has it), for
 *  (a) millions of random blocks with scales spanning 2^-140..2^120,
 *      subnormal floats, and elements at exactly scale * (every E2M1 / E4M3
 *      midpoint and grid value) and +-1 ulp around them,
 *  (b) NaN (either sign), +-Inf and -0 inside blocks, all-zero blocks,
 *  (c) every MXFP4 scale rule, every E2M1 rounding, both FP8 scale kinds
 *      and the E8M0 variant, edge tiles of every shape class.
 * Prints ns/element of reference and fast paths (information, never
 * asserted). MOE_QF_TEST_SCALE=k multiplies the random counts by k.
 */
#include "harness.h"
#include "core/core.h"
#include "moe_formats.h"
#include "moe_quant_fast.h"
#include "formats/quant_fast_internal.h"

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ------------------------------------------------------------ utilities */

static uint32_t rng_below(uint64_t *s, uint32_t n) { return (uint32_t)(moe_splitmix64(s) % n); }

static int g_scale = 1;      /* MOE_QF_TEST_SCALE */
static int g_have_avx512;    /* the public functions take the AVX-512 build */

/* v moved by d ulps (d in -1..1) toward +-inf, staying finite. */
static float ulp_step(float v, int d) {
    if (d == 0) return v;
    float w = nextafterf(v, d > 0 ? INFINITY : -INFINITY);
    return isinf(w) ? v : w;
}

/* A special value: NaN of random sign and payload, +-Inf, -0, +0. */
static float special(uint64_t *s) {
    switch (rng_below(s, 5)) {
    case 0: return moe_fmt_f32_from_bits(0x7FC00000u | (uint32_t)(moe_splitmix64(s) & 0x803FFFFFu));
    case 1: return moe_fmt_f32_from_bits(0x7F800001u | (uint32_t)(moe_splitmix64(s) & 0x803FFFFEu)); /* sNaN */
    case 2: return rng_below(s, 2) ? INFINITY : -INFINITY;
    case 3: return -0.0f;
    default: return 0.0f;
    }
}

/* Random float of exponent near 2^k (k in [-149, 127]), random sign. */
static float near_pow2(uint64_t *s, int k) {
    double v = ldexp(1.0 + moe_t_rng_unif(s), k);
    float f = (float)v;
    if (isinf(f)) f = 3.0e38f;
    return rng_below(s, 2) ? -f : f;
}

/* Fill x [L] with one block: `unit` is the block's quantization step in
 * value units (scale), `grid` [ng] the values (in units) whose images and
 * +-1 ulp neighbours are wanted, A the block amax (placed once). */
static void fill_block(uint64_t *s, float *x, int L, float A, float unit, const float *grid,
                       int ng) {
    int kind = (int)rng_below(s, 8);
    for (int i = 0; i < L; i++) {
        float v;
        if (kind <= 3) {                       /* structured: at grid * unit, +-1 ulp */
            float g = grid[rng_below(s, (uint32_t)ng)];
            v = ulp_step(g * unit, (int)rng_below(s, 3) - 1);
            if (!(fabsf(v) <= A)) v = A;
            if (rng_below(s, 2)) v = -v;
        } else if (kind == 4) {                /* gaussian of amax's size */
            v = (float)(moe_t_rng_normal(s) * (double)A * 0.4);
            if (!(fabsf(v) <= A)) v = A;
        } else if (kind == 5) {                /* uniform bits over all finite floats */
            v = moe_fmt_f32_from_bits((uint32_t)moe_splitmix64(s) & 0xFF7FFFFFu);
        } else if (kind == 6) {                /* subnormal and tiny floats */
            v = moe_fmt_f32_from_bits((uint32_t)(moe_splitmix64(s) & (rng_below(s, 2) ? 0x807FFFFFu : 0x80FFFFFFu)));
        } else {                               /* every exponent, mixed */
            v = near_pow2(s, (int)rng_below(s, 277) - 149);
        }
        x[i] = v;
    }
    if (kind <= 4) x[rng_below(s, (uint32_t)L)] = rng_below(s, 2) ? -A : A;
    /* (b) specials and zero blocks */
    uint32_t z = rng_below(s, 64);
    if (z == 0) {
        for (int i = 0; i < L; i++) x[i] = rng_below(s, 2) ? -0.0f : 0.0f;
    } else if (z < 6) {
        int k = 1 + (int)rng_below(s, 3);
        for (int j = 0; j < k; j++) x[rng_below(s, (uint32_t)L)] = special(s);
    }
}

/* Random block amax: scales spanning 2^-140..2^120, or a subnormal float. */
static float rand_amax(uint64_t *s) {
    if (rng_below(s, 16) == 0) return moe_fmt_f32_from_bits(1u + rng_below(s, 0x7FFFFFu));
    float a = fabsf(near_pow2(s, (int)rng_below(s, 261) - 140));
    if (rng_below(s, 4) == 0) {                /* amax at or beside a scale boundary */
        static const float m[] = {1.0f, 1.5f, 1.75f, 6.0f, 448.0f, 3.0f, 7.0f};
        a = ldexpf(m[rng_below(s, 7)], (int)rng_below(s, 240) - 130);
        if (a == 0.0f) a = 1.0f;
        a = fabsf(ulp_step(a, (int)rng_below(s, 3) - 1));
    }
    return a;
}

/* Index of the first differing byte of a [n] and b [n], or -1. */
static int64_t first_diff(const void *a, const void *b, int64_t n) {
    const uint8_t *p = a, *q = b;
    for (int64_t i = 0; i < n; i++)
        if (p[i] != q[i]) return i;
    return -1;
}

/* E2M1 grid in units of the block scale: midpoints, values, clip range. */
static const float k_e2m1_grid[] = {0.0f,  0.25f, 0.5f, 0.75f, 1.0f, 1.25f, 1.5f, 1.75f, 2.0f,
                                    2.5f,  3.0f,  3.5f, 4.0f,  5.0f, 6.0f,  6.5f, 7.0f,  7.99f};
#define N_E2M1_GRID ((int)(sizeof k_e2m1_grid / sizeof k_e2m1_grid[0]))

/* ---------------------------------------------------------------- MXFP4 */

enum { MX_ROW = 32 * 32 };   /* 32 blocks per random row */

typedef void (*mx_fn)(const float *, int64_t, moe_mx_scale_rule, moe_e2m1_round, uint8_t *, uint8_t *);

static void test_mxfp4_random(void) {
    static float x[MX_ROW + 1];
    static uint8_t p0[MX_ROW / 2], s0[MX_ROW / 32], p1[MX_ROW / 2], s1[MX_ROW / 32];
    mx_fn fns[2] = {moe_mxfp4_quant_row_fast, moe_qf_mxfp4_row_portable};
    const char *names[2] = {"fast", "portable"};
    long rows_per = 12000L * g_scale;
    long blocks = 0;
    for (int rule = 0; rule < 2; rule++)
        for (int r = 0; r < 3; r++) {
            uint64_t s = 1000u + (uint64_t)(rule * 3 + r);
            long bad[2] = {0, 0};
            for (long row = 0; row < rows_per; row++) {
                int off = (int)(row & 1);               /* misaligned input too */
                float *xr = x + off;
                for (int b = 0; b < MX_ROW / 32; b++) {
                    float A = rand_amax(&s);
                    uint8_t e = moe_mxfp4_scale_e8m0(A, (moe_mx_scale_rule)rule);
                    float unit = ldexpf(1.0f, (int)e - 127);
                    fill_block(&s, xr + 32 * b, 32, A, unit, k_e2m1_grid, N_E2M1_GRID);
                }
                int64_t n = 32 * (1 + (int64_t)rng_below(&s, MX_ROW / 32));
                if (row % 97 == 0) n = 0;
                moe_mxfp4_quant_row(xr, n, (moe_mx_scale_rule)rule, (moe_e2m1_round)r, p0, s0);
                for (int f = 0; f < 2; f++) {
                    memset(p1, 0xA5, sizeof p1);
                    memset(s1, 0xA5, sizeof s1);
                    fns[f](xr, n, (moe_mx_scale_rule)rule, (moe_e2m1_round)r, p1, s1);
                    int64_t dp = first_diff(p0, p1, n / 2), ds = first_diff(s0, s1, n / 32);
                    if (dp >= 0 || ds >= 0) {
                        if (bad[f]++ < 3) {
                            int64_t j = dp >= 0 ? 2 * dp : 32 * ds;
                            fprintf(stderr, "mxfp4 %s rule %d round %d: byte %lld differs; "
                                    "x[%lld] = %a, scale ref %u fast %u, codes ref %02x fast %02x\n",
                                    names[f], rule, r, (long long)(dp >= 0 ? dp : ds), (long long)j,
                                    (double)xr[j], s0[j / 32], s1[j / 32],
                                    dp >= 0 ? p0[dp] : 0, dp >= 0 ? p1[dp] : 0);
                        }
                    }
                }
                blocks += n / 32;
            }
            CHECK(bad[0] == 0 && bad[1] == 0, "mxfp4 rule %d round %d: %ld / %ld rows differ", rule, r,
                  bad[0], bad[1]);
        }
    printf("  mxfp4: %ld blocks x 2 builds compared (6 rule/rounding pairs)\n", blocks);
}

/* Every float in [0, 8) * 2^k around the E2M1 grid, one block each way. */
static void test_mxfp4_sweep(void) {
    float x[32];
    uint8_t p0[16], s0[1], p1[16], s1[1], p2[16], s2[1];
    long bad = 0, n = 0;
    /* amax 6 * 2^k (ceil and floor both give unit 2^k * {1, 2^?}); the 31
     * other elements sweep consecutive floats */
    for (int rule = 0; rule < 2; rule++)
        for (int r = 0; r < 3; r++)
            for (int k = -3; k <= 3; k += 3) {
                float A = ldexpf(7.99f, k);
                for (uint32_t u = 0x3E000000u; u < 0x41000000u; u += 31 * 97) {  /* 0.125 .. 8 */
                    x[0] = A;
                    for (int i = 1; i < 32; i++) {
                        float v = ldexpf(moe_fmt_f32_from_bits(u + (uint32_t)i * 97), k);
                        x[i] = (i & 1) ? -v : v;
                    }
                    moe_mxfp4_quant_row(x, 32, (moe_mx_scale_rule)rule, (moe_e2m1_round)r, p0, s0);
                    moe_mxfp4_quant_row_fast(x, 32, (moe_mx_scale_rule)rule, (moe_e2m1_round)r, p1, s1);
                    moe_qf_mxfp4_row_portable(x, 32, (moe_mx_scale_rule)rule, (moe_e2m1_round)r, p2, s2);
                    bad += memcmp(p0, p1, 16) != 0 || s0[0] != s1[0] || memcmp(p0, p2, 16) != 0 ||
                           s0[0] != s2[0];
                    n++;
                }
            }
    CHECK(bad == 0, "mxfp4 sweep: %ld / %ld blocks differ", bad, n);
    /* every amax exponent (the scale rule alone), with mantissas at 1, 1.5, 1.5+ulp, 2-ulp */
    long sbad = 0;
    for (uint32_t bexp = 0; bexp < 255; bexp++) {
        const uint32_t man[] = {0, 1, 0x3FFFFF, 0x400000, 0x400001, 0x600000, 0x600001, 0x7FFFFF};
        for (int m = 0; m < 8; m++)
            for (int rule = 0; rule < 2; rule++) {
                memset(x, 0, sizeof x);
                x[7] = moe_fmt_f32_from_bits(bexp << 23 | man[m]);
                x[8] = -x[7] * 0.75f;
                moe_mxfp4_quant_row(x, 32, (moe_mx_scale_rule)rule, MOE_E2M1_RNE, p0, s0);
                moe_mxfp4_quant_row_fast(x, 32, (moe_mx_scale_rule)rule, MOE_E2M1_RNE, p1, s1);
                moe_qf_mxfp4_row_portable(x, 32, (moe_mx_scale_rule)rule, MOE_E2M1_RNE, p2, s2);
                sbad += memcmp(p0, p1, 16) != 0 || s0[0] != s1[0] || memcmp(p0, p2, 16) != 0 ||
                        s0[0] != s2[0];
            }
    }
    CHECK(sbad == 0, "mxfp4 scale of every amax exponent: %ld differ", sbad);
}

/* ---------------------------------------------------------------- NVFP4 */

enum { NV_ROW = 16 * 64 };

typedef void (*nv_fn)(const float *, int64_t, float, moe_e2m1_round, uint8_t *, uint8_t *);

/* The reference's block unit d for amax A (as moe_nvfp4_quant_row). */
static float nv_unit(float A, float scale2) {
    float sc = A / (MOE_E2M1_MAX * scale2);
    if (sc < 1.0f / 512.0f) sc = 1.0f / 512.0f;
    return moe_ue4m3_to_f32(moe_ue4m3_from_f32(sc)) * scale2;
}

static void test_nvfp4_random(void) {
    static float x[NV_ROW + 1];
    static uint8_t p0[NV_ROW / 2], s0[NV_ROW / 16], p1[NV_ROW / 2], s1[NV_ROW / 16];
    nv_fn fns[2] = {moe_nvfp4_quant_row_fast, moe_qf_nvfp4_row_portable};
    const char *names[2] = {"fast", "portable"};
    long rows_per = 12000L * g_scale;
    long blocks = 0;
    for (int r = 0; r < 3; r++) {
        uint64_t s = 2000u + (uint64_t)r;
        long bad[2] = {0, 0};
        for (long row = 0; row < rows_per; row++) {
            float *xr = x + (row & 1);
            /* per-tensor scale: spans the float range, subnormal and huge too */
            float scale2;
            uint32_t sk = rng_below(&s, 16);
            if (sk == 0) scale2 = moe_fmt_f32_from_bits(1u + rng_below(&s, 0x7FFFFFu));
            else if (sk == 1) scale2 = moe_fmt_f32_from_bits(0x7F000000u + rng_below(&s, 0x7FFFFFu));
            else scale2 = fabsf(near_pow2(&s, (int)rng_below(&s, 240) - 130));
            /* amaxes near 2688 * scale2 (the tensor amax) and below it */
            for (int b = 0; b < NV_ROW / 16; b++) {
                float A;
                if (rng_below(&s, 2)) {
                    A = (float)((double)scale2 * 2688.0 * ldexp(moe_t_rng_unif(&s) + 0.001, -(int)rng_below(&s, 24)));
                    if (!(A > 0.0f) || isinf(A)) A = rand_amax(&s);
                } else {
                    A = rand_amax(&s);
                }
                float unit = nv_unit(A, scale2);
                if (!(unit > 0.0f) || isinf(unit)) unit = 1.0f;
                fill_block(&s, xr + 16 * b, 16, A, unit, k_e2m1_grid, N_E2M1_GRID);
            }
            int64_t n = 16 * (1 + (int64_t)rng_below(&s, NV_ROW / 16));
            if (row % 101 == 0) n = 0;
            moe_nvfp4_quant_row(xr, n, scale2, (moe_e2m1_round)r, p0, s0);
            for (int f = 0; f < 2; f++) {
                memset(p1, 0xA5, sizeof p1);
                memset(s1, 0xA5, sizeof s1);
                fns[f](xr, n, scale2, (moe_e2m1_round)r, p1, s1);
                int64_t dp = first_diff(p0, p1, n / 2), ds = first_diff(s0, s1, n / 16);
                if ((dp >= 0 || ds >= 0) && bad[f]++ < 3) {
                    int64_t j = dp >= 0 ? 2 * dp : 16 * ds;
                    fprintf(stderr, "nvfp4 %s round %d scale2 %a: x[%lld] = %a, scale ref %02x fast %02x, "
                            "codes ref %02x fast %02x\n", names[f], r, (double)scale2, (long long)j,
                            (double)xr[j], s0[j / 16], s1[j / 16], dp >= 0 ? p0[dp] : 0,
                            dp >= 0 ? p1[dp] : 0);
                }
            }
            blocks += n / 16;
        }
        CHECK(bad[0] == 0 && bad[1] == 0, "nvfp4 round %d: %ld / %ld rows differ", r, bad[0], bad[1]);
    }
    printf("  nvfp4: %ld blocks x 2 builds compared (3 roundings)\n", blocks);
}

/* ------------------------------------------------------------------ FP8 */

typedef void (*fp8_tiles_fn)(const float *, int64_t, int64_t, moe_fp8_scale, uint8_t *, float *, uint8_t *);

/* E4M3 grid in units of the tile scale: every value and every midpoint. */
static float g_e4m3_grid[2 * 127 + 2];
static int g_n_e4m3_grid;

static void make_e4m3_grid(void) {
    int n = 0;
    for (int c = 0; c <= 0x7E; c++) {
        g_e4m3_grid[n++] = moe_fp8_e4m3_to_f32((uint8_t)c);
        float next = c < 0x7E ? moe_fp8_e4m3_to_f32((uint8_t)(c + 1)) : 480.0f;
        g_e4m3_grid[n++] = 0.5f * (moe_fp8_e4m3_to_f32((uint8_t)c) + next);
    }
    g_n_e4m3_grid = n;
}

/* Compare reference and both builds on w [rows, cols]; returns 1 if equal. */
static int fp8_compare(const float *w, int64_t rows, int64_t cols, int kind_i, uint8_t *q0, uint8_t *q1,
                       float *sf0, float *sf1, uint8_t *se0, uint8_t *se1, const char *what) {
    int64_t ns = ((rows + 127) / 128) * ((cols + 127) / 128);
    int ok = 1;
    if (kind_i < 2) moe_fp8_block_quant(w, rows, cols, (moe_fp8_scale)kind_i, q0, sf0);
    else moe_fp8_block_quant_e8m0(w, rows, cols, q0, se0);
    for (int f = 0; f < 2; f++) {
        memset(q1, 0xA5, (size_t)(rows * cols));
        memset(sf1, 0xA5, (size_t)ns * 4);
        memset(se1, 0xA5, (size_t)ns);
        if (f == 0) {
            if (kind_i < 2) moe_fp8_block_quant_fast(w, rows, cols, (moe_fp8_scale)kind_i, q1, sf1);
            else moe_fp8_block_quant_e8m0_fast(w, rows, cols, q1, se1);
        } else {
            if (kind_i < 2) moe_qf_fp8_tiles_portable(w, rows, cols, (moe_fp8_scale)kind_i, q1, sf1, NULL);
            else moe_qf_fp8_tiles_portable(w, rows, cols, MOE_FP8_SCALE_POW2, q1, NULL, se1);
        }
        int64_t dq = first_diff(q0, q1, rows * cols);
        int64_t ds = kind_i < 2 ? first_diff(sf0, sf1, ns * 4) : first_diff(se0, se1, ns);
        if (dq >= 0 || ds >= 0) {
            if (ok)
                fprintf(stderr, "fp8 %s kind %d build %d [%lld x %lld]: q byte %lld (w %a: ref %02x fast %02x), "
                        "scale byte %lld\n", what, kind_i, f, (long long)rows, (long long)cols, (long long)dq,
                        dq >= 0 ? (double)w[dq] : 0.0, dq >= 0 ? q0[dq] : 0, dq >= 0 ? q1[dq] : 0,
                        (long long)ds);
            ok = 0;
        }
    }
    return ok;
}

enum { FP8_MAXR = 300, FP8_MAXC = 300, FP8_MAXS = 9 };

static void test_fp8_random(void) {
    static float w[FP8_MAXR * FP8_MAXC];
    static uint8_t q0[FP8_MAXR * FP8_MAXC], q1[FP8_MAXR * FP8_MAXC];
    float sf0[FP8_MAXS], sf1[FP8_MAXS];
    uint8_t se0[FP8_MAXS], se1[FP8_MAXS];
    static const int64_t dims[] = {0, 1, 2, 17, 127, 128, 129, 200, 255, 256, 257, 300};
    long mats = 60L * g_scale, elems = 0;
    for (int kind_i = 0; kind_i < 3; kind_i++) {
        uint64_t s = 3000u + (uint64_t)kind_i;
        long bad = 0;
        for (long m = 0; m < mats; m++) {
            int64_t rows = dims[rng_below(&s, 12)], cols = dims[rng_below(&s, 12)];
            if (m < 4) rows = cols = 256;
            /* per tile: an amax; elements at scale * E4M3 grid +-1 ulp, or anything */
            int64_t tr = (rows + 127) / 128, tc = (cols + 127) / 128;
            for (int64_t ti = 0; ti < tr; ti++)
                for (int64_t tj = 0; tj < tc; tj++) {
                    float A = rand_amax(&s);
                    float unit;
                    if (kind_i == 0) unit = A / 448.0f;
                    else unit = ldexpf(1.0f, (int)ceil(log2((double)A / 448.0)));
                    if (!(unit > 0.0f) || isinf(unit)) unit = 1.0f;
                    for (int64_t r = ti * 128; r < rows && r < ti * 128 + 128; r++) {
                        int64_t c0 = tj * 128, c1 = c0 + 128 < cols ? c0 + 128 : cols;
                        fill_block(&s, w + r * cols + c0, (int)(c1 - c0), A, unit, g_e4m3_grid, g_n_e4m3_grid);
                    }
                    /* most tiles keep A as amax: drop the specials from fill_block mostly */
                    if (rng_below(&s, 4) != 0)
                        for (int64_t r = ti * 128; r < rows && r < ti * 128 + 128; r++)
                            for (int64_t c = tj * 128; c < cols && c < tj * 128 + 128; c++)
                                if (!(fabsf(w[r * cols + c]) <= A)) w[r * cols + c] = A;
                }
            bad += !fp8_compare(w, rows, cols, kind_i, q0, q1, sf0, sf1, se0, se1, "random");
            elems += rows * cols;
        }
        CHECK(bad == 0, "fp8 kind %d: %ld / %ld matrices differ", kind_i, bad, mats);
    }
    printf("  fp8: %ld elements x 2 builds compared (f32, pow2, e8m0)\n", elems);
}

/* The E4M3 encoder on (nearly) every float below 2^10: tiles whose amax is
 * 448 have scale 1 in every kind, so q = e4m3(w). */
static void test_fp8_encoder_sweep(void) {
    enum { R = 128, C = 128 };
    static float w[R * C];
    static uint8_t q0[R * C], q1[R * C];
    float sf0[1], sf1[1];
    uint8_t se0[1], se1[1];
    long bad = 0, n = 0;
    uint32_t stride = 61;                              /* ~1/61 of all patterns */
    uint32_t u = 0;
    while (u < 0x44800000u) {                          /* |w| < 1024, subnormals, all */
        for (int i = 0; i < R * C; i++) {
            float v = moe_fmt_f32_from_bits(u < 0x44800000u ? u : 0u);
            w[i] = (i & 1) ? -v : v;
            u += stride;
        }
        w[0] = 448.0f;
        for (int i = 1; i < R * C; i++)
            if (fabsf(w[i]) > 448.0f) w[i] = ulp_step(464.0f, (int)(i % 3) - 1);
        for (int kind_i = 0; kind_i < 3; kind_i++)
            bad += !fp8_compare(w, R, C, kind_i, q0, q1, sf0, sf1, se0, se1, "sweep");
        n += R * C;
    }
    /* every E4M3 value and midpoint +-1 ulp, both signs */
    int k = 0;
    memset(w, 0, sizeof w);
    w[k++] = 448.0f;
    for (int g = 0; g < g_n_e4m3_grid; g++)
        for (int d = -1; d <= 1; d++) {
            w[k++] = ulp_step(g_e4m3_grid[g], d);
            w[k++] = -ulp_step(g_e4m3_grid[g], d);
        }
    w[k++] = NAN;  /* the last rows: a NaN tile is compared too */
    for (int kind_i = 0; kind_i < 3; kind_i++) {
        bad += !fp8_compare(w, R, C, kind_i, q0, q1, sf0, sf1, se0, se1, "grid");
        w[k - 1] = 0.0f;
        bad += !fp8_compare(w, R, C, kind_i, q0, q1, sf0, sf1, se0, se1, "grid");
        w[k - 1] = NAN;
    }
    CHECK(bad == 0, "fp8 encoder sweep: %ld tiles differ (%ld values)", bad, n);
    printf("  e4m3 sweep: %ld values x 3 kinds x 2 builds\n", n);
}

/* Special tiles: NaN / Inf / -0 / all zero / subnormal-only / amax huge. */
static void test_fp8_special(void) {
    enum { R = 130, C = 260 };
    static float w[R * C];
    static uint8_t q0[R * C], q1[R * C];
    float sf0[6], sf1[6];
    uint8_t se0[6], se1[6];
    uint64_t s = 77;
    long bad = 0;
    for (int t = 0; t < 12; t++) {
        for (int i = 0; i < R * C; i++) w[i] = (float)moe_t_rng_normal(&s);
        switch (t) {
        case 0: memset(w, 0, sizeof w); break;
        case 1: for (int i = 0; i < R * C; i++) w[i] = (i & 1) ? -0.0f : 0.0f; break;
        case 2: w[5] = NAN; w[200 * 1 + 140] = -INFINITY; w[129 * C + 259] = -NAN; break;
        case 3: w[3] = INFINITY; break;
        case 4: for (int i = 0; i < R * C; i++) w[i] = moe_fmt_f32_from_bits((uint32_t)moe_splitmix64(&s) & 0x807FFFFFu); break;
        case 5: for (int i = 0; i < R * C; i++) w[i] = moe_fmt_f32_from_bits(0x7F000000u | ((uint32_t)moe_splitmix64(&s) & 0x807FFFFFu)); break;
        case 6: for (int i = 0; i < R * C; i++) w[i] = moe_fmt_f32_from_bits((uint32_t)moe_splitmix64(&s) & 0x80FFFFFFu); w[9] = 1.4e-45f; break;
        case 7: for (int i = 0; i < R * C; i++) w[i] = (i % 7) ? 0.0f : 1.4e-45f; break; /* amax/448 = 0 */
        case 8: for (int i = 0; i < R * C; i++) w[i] = moe_fmt_f32_from_bits((uint32_t)moe_splitmix64(&s) & 0xFF7FFFFFu); break;
        case 9: w[0] = FLT_MAX; break;
        case 10: for (int i = 0; i < R * C; i++) w[i] *= 1e-38f; break;
        default: for (int i = 0; i < R * C; i++) w[i] = (rng_below(&s, 3) == 0) ? special(&s) : w[i]; break;
        }
        for (int kind_i = 0; kind_i < 3; kind_i++)
            bad += !fp8_compare(w, R, C, kind_i, q0, q1, sf0, sf1, se0, se1, "special");
    }
    CHECK(bad == 0, "fp8 special tiles: %ld differ", bad);
}

/* Special NVFP4 / MXFP4 blocks, named. */
static void test_fp4_special(void) {
    float x[64];
    uint8_t p0[32], s0[4], p1[32], s1[4], p2[32], s2[4];
    const float scale2s[] = {1.0f, 1.4e-45f, 3.0e38f, FLT_MAX, 1e-30f, 0.001f};
    long bad = 0;
    for (int t = 0; t < 10; t++) {
        for (int i = 0; i < 64; i++) x[i] = (float)(i - 32) * 0.37f;
        switch (t) {
        case 0: memset(x, 0, sizeof x); break;
        case 1: for (int i = 0; i < 64; i++) x[i] = -0.0f; break;
        case 2: x[3] = NAN; x[40] = -NAN; break;
        case 3: x[3] = INFINITY; x[17] = -INFINITY; x[33] = INFINITY; break;
        case 4: x[0] = FLT_MAX; x[20] = -FLT_MAX; break;
        case 5: for (int i = 0; i < 64; i++) x[i] = moe_fmt_f32_from_bits((uint32_t)i * 12345u); break;
        case 6: x[5] = INFINITY; x[6] = NAN; break;
        case 7: for (int i = 0; i < 64; i++) x[i] = ldexpf((float)i, -140); break;
        case 8: for (int i = 0; i < 64; i++) x[i] = (i & 1) ? -0.0f : 1.4e-45f; break;
        default: x[0] = 0.0f; x[1] = -0.0f; x[2] = INFINITY; break;
        }
        for (int r = 0; r < 3; r++) {
            for (int rule = 0; rule < 2; rule++) {
                moe_mxfp4_quant_row(x, 64, (moe_mx_scale_rule)rule, (moe_e2m1_round)r, p0, s0);
                moe_mxfp4_quant_row_fast(x, 64, (moe_mx_scale_rule)rule, (moe_e2m1_round)r, p1, s1);
                moe_qf_mxfp4_row_portable(x, 64, (moe_mx_scale_rule)rule, (moe_e2m1_round)r, p2, s2);
                bad += memcmp(p0, p1, 32) || memcmp(s0, s1, 2) || memcmp(p0, p2, 32) || memcmp(s0, s2, 2);
            }
            for (int k = 0; k < 6; k++) {
                moe_nvfp4_quant_row(x, 64, scale2s[k], (moe_e2m1_round)r, p0, s0);
                moe_nvfp4_quant_row_fast(x, 64, scale2s[k], (moe_e2m1_round)r, p1, s1);
                moe_qf_nvfp4_row_portable(x, 64, scale2s[k], (moe_e2m1_round)r, p2, s2);
                bad += memcmp(p0, p1, 32) || memcmp(s0, s1, 4) || memcmp(p0, p2, 32) || memcmp(s0, s2, 4);
            }
        }
    }
    CHECK(bad == 0, "fp4 special blocks: %ld differ", bad);
}

/* ----------------------------------------------------------------- BF16 */

static void test_bf16(void) {
    enum { N = 4096 };
    static float x[N];
    static uint16_t o1[N], o2[N];
    long bad = 0;
    uint64_t s = 5;
    for (int it = 0; it < 400 * g_scale; it++) {
        for (int i = 0; i < N; i++) {
            uint32_t u = (uint32_t)moe_splitmix64(&s);
            if (i % 5 == 0) u = (u & 0xFFFF0000u) | 0x8000u;  /* exact ties */
            if (i % 11 == 0) u |= 0x7F800000u;                /* Inf / NaN */
            x[i] = moe_fmt_f32_from_bits(u);
        }
        int n = it == 0 ? 0 : N - (int)rng_below(&s, 17);
        moe_bf16_from_f32_row_fast(x, n, o1);
        moe_qf_bf16_row_portable(x, n, o2);
        for (int i = 0; i < n; i++) {
            uint16_t want = moe_bf16_from_f32(x[i]);
            bad += o1[i] != want || o2[i] != want;
        }
    }
    CHECK(bad == 0, "bf16 row: %ld values differ", bad);
}

/* --------------------------------------------------------------- timing */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Best of `reps` runs of the call, in ns per element. */
#define TIME_NS(out, reps, nelem, call)                                   \
    do {                                                                  \
        double best_ = 1e30;                                              \
        for (int rep_ = 0; rep_ < (reps); rep_++) {                       \
            double t0_ = now_s();                                         \
            call;                                                         \
            double t_ = now_s() - t0_;                                    \
            if (t_ < best_) best_ = t_;                                   \
        }                                                                 \
        (out) = best_ * 1e9 / (double)(nelem);                            \
    } while (0)

static void test_timing(void) {
    enum { ROWS = 512, COLS = 2048, N = ROWS * COLS };
    float *w = malloc(sizeof(float) * N);
    uint8_t *q = malloc(N), *sc = malloc(N / 16);
    float *sf = malloc(sizeof(float) * N / 16);
    uint16_t *b16 = malloc(2 * (size_t)N);
    CHECK(w && q && sc && sf && b16, "timing buffers");
    if (!(w && q && sc && sf && b16)) return;
    uint64_t s = 9;
    for (int i = 0; i < N; i++) w[i] = (float)(moe_t_rng_normal(&s) * 0.02);
    float s2 = moe_nvfp4_scale2(w, N);
    double ref, fast, port;
    printf("  timing, %d x %d weights, ns/element (reference / fast%s / portable):\n", ROWS, COLS,
           g_have_avx512 ? " avx512" : "");
    TIME_NS(ref, 1, N, for (int r = 0; r < ROWS; r++) moe_mxfp4_quant_row(w + (int64_t)r * COLS, COLS, MOE_MX_SCALE_CEIL, MOE_E2M1_RNE, q + r * COLS / 2, sc + r * COLS / 32));
    TIME_NS(fast, 5, N, for (int r = 0; r < ROWS; r++) moe_mxfp4_quant_row_fast(w + (int64_t)r * COLS, COLS, MOE_MX_SCALE_CEIL, MOE_E2M1_RNE, q + r * COLS / 2, sc + r * COLS / 32));
    TIME_NS(port, 5, N, for (int r = 0; r < ROWS; r++) moe_qf_mxfp4_row_portable(w + (int64_t)r * COLS, COLS, MOE_MX_SCALE_CEIL, MOE_E2M1_RNE, q + r * COLS / 2, sc + r * COLS / 32));
    printf("    mxfp4_quant_row        %7.2f  %6.2f  %6.2f\n", ref, fast, port);
    TIME_NS(ref, 1, N, for (int r = 0; r < ROWS; r++) moe_nvfp4_quant_row(w + (int64_t)r * COLS, COLS, s2, MOE_E2M1_RNE, q + r * COLS / 2, sc + r * COLS / 16));
    TIME_NS(fast, 5, N, for (int r = 0; r < ROWS; r++) moe_nvfp4_quant_row_fast(w + (int64_t)r * COLS, COLS, s2, MOE_E2M1_RNE, q + r * COLS / 2, sc + r * COLS / 16));
    TIME_NS(port, 5, N, for (int r = 0; r < ROWS; r++) moe_qf_nvfp4_row_portable(w + (int64_t)r * COLS, COLS, s2, MOE_E2M1_RNE, q + r * COLS / 2, sc + r * COLS / 16));
    printf("    nvfp4_quant_row        %7.2f  %6.2f  %6.2f\n", ref, fast, port);
    TIME_NS(ref, 1, N, moe_fp8_block_quant(w, ROWS, COLS, MOE_FP8_SCALE_F32, q, sf));
    TIME_NS(fast, 5, N, moe_fp8_block_quant_fast(w, ROWS, COLS, MOE_FP8_SCALE_F32, q, sf));
    TIME_NS(port, 5, N, moe_qf_fp8_tiles_portable(w, ROWS, COLS, MOE_FP8_SCALE_F32, q, sf, NULL));
    printf("    fp8_block_quant f32    %7.2f  %6.2f  %6.2f\n", ref, fast, port);
    TIME_NS(ref, 1, N, moe_fp8_block_quant(w, ROWS, COLS, MOE_FP8_SCALE_POW2, q, sf));
    TIME_NS(fast, 5, N, moe_fp8_block_quant_fast(w, ROWS, COLS, MOE_FP8_SCALE_POW2, q, sf));
    TIME_NS(port, 5, N, moe_qf_fp8_tiles_portable(w, ROWS, COLS, MOE_FP8_SCALE_POW2, q, sf, NULL));
    printf("    fp8_block_quant pow2   %7.2f  %6.2f  %6.2f\n", ref, fast, port);
    TIME_NS(ref, 1, N, moe_fp8_block_quant_e8m0(w, ROWS, COLS, q, sc));
    TIME_NS(fast, 5, N, moe_fp8_block_quant_e8m0_fast(w, ROWS, COLS, q, sc));
    TIME_NS(port, 5, N, moe_qf_fp8_tiles_portable(w, ROWS, COLS, MOE_FP8_SCALE_POW2, q, NULL, sc));
    printf("    fp8_block_quant_e8m0   %7.2f  %6.2f  %6.2f\n", ref, fast, port);
    TIME_NS(ref, 3, N, for (int i = 0; i < N; i++) b16[i] = moe_bf16_from_f32(w[i]));
    TIME_NS(fast, 5, N, moe_bf16_from_f32_row_fast(w, N, b16));
    TIME_NS(port, 5, N, moe_qf_bf16_row_portable(w, N, b16));
    printf("    bf16_from_f32 (row)    %7.2f  %6.2f  %6.2f\n", ref, fast, port);
    free(w);
    free(q);
    free(sc);
    free(sf);
    free(b16);
}

int main(void) {
    setvbuf(stdout, NULL, _IONBF, 0);
    const char *sc = getenv("MOE_QF_TEST_SCALE");
    if (sc && atoi(sc) > 0) g_scale = atoi(sc);
    g_have_avx512 = moe_qf_uses_avx512();
    printf("  public functions use the %s build\n", g_have_avx512 ? "AVX-512" : "portable");
    make_e4m3_grid();
    RUN(test_fp4_special);
    RUN(test_fp8_special);
    RUN(test_bf16);
    RUN(test_mxfp4_sweep);
    RUN(test_mxfp4_random);
    RUN(test_nvfp4_random);
    RUN(test_fp8_encoder_sweep);
    RUN(test_fp8_random);
    RUN(test_timing);
    return moe_t_finish();
}
