/*
 * CPU kernel tables against a float64 reference, every weight format x every
 * ISA this CPU has; determinism (row splits, batch composition, threads);
 * adversarial activations (NaN/Inf per token, subnormals, huge values).
 *
 * Tolerances (u = 2^-24, float's unit roundoff):
 *   TOL_DOT(m, S) = (m + 2) * u * S + (m + 2) * 2^-149
 *     A float dot product of m terms, accumulated in any order with
 *     mul+add or fma, is within gamma_m * sum|x_k w_k| of the exact value
 *     (Higham, Accuracy and Stability, 3.1: gamma_m = m u / (1 - m u) <=
 *     (m + 1) u here). One more u covers the weight's own rounding to float
 *     (FP8 with fp32 scale and NVFP4 round once per element; the other
 *     formats are exact). The second term bounds underflow: each of the m
 *     products and sums can lose at most half a subnormal ulp (2^-150).
 *     m = cols for every ISA (the 8- and 16-lane SIMD orders are
 *     shallower, so the same bound holds).
 *   The expert test propagates these bounds through SwiGLU (see
 *   expert_ref64): |silu'| <= 1.1, and moe_expf_f32 (<= 1.03 ulp, so 2.1 u
 *   relative) plus the activation's three float operations after it add
 *   at most 8 u |a|.
 *   The swiglu entries are compared with moe_swiglu_f32 bit for bit (no
 *   tolerance: the same operations in the same order, formats/mathf.h).
 *   TOL_BF16ACT(m, S, F, s2): gemm_bf16act (vdpbf16ps) on bf16 activations.
 *     Where its error comes from (gemm_avx512.c states the sequence): the
 *     bf16 activations are the caller's values (no error); the weights are
 *     exact in bf16 (MXFP4, NVFP4 without scale2, BF16); each product
 *     x * w (<= 16 significant bits) is exact inside the fused multiply-add;
 *     a product reaches the output through at most d = 2 ceil(m / 32) fp32
 *     roundings in its lane, 4 in the 16-lane tree and (NVFP4) 1 for the
 *     scale2 multiply, so |err| <= gamma_d * S <= (d + 1) u S, S = sum |x w|
 *     (exact weights, scale2 included). Then the flushes: F = the sum of the
 *     |x_k w_k| whose x_k or w_k is below 2^-126 (read as zero), plus
 *     2^-126 for each of the 32 ceil(m / 32) multiply-adds whose result is
 *     flushed to zero (times |scale2| for NVFP4, applied after), plus
 *     2^-149 per rounding for the gradual underflow of the tree.
 *     The kernel is also compared bit for bit with bf16act_model, the same
 *     sequence in scalar code (fmaf, explicit flushes), on random data and
 *     on inputs built to land on rounding ties.
 *   The same bound for the amx table's tiles (gemm_amx.c, SDM TDPBF16PS),
 *     with its depth: a product passes at most 16 roundings in its even or
 *     odd chain, 1 for the chains' sum, ceil(m / 32) in the accumulator and
 *     (NVFP4) 1 for scale2, so d = 17 + ceil(m / 32) (+ 1); and 34 results
 *     per 32 columns that can be flushed (32 fmas, 2 adds). Compared bit
 *     for bit with amx_model (bf16_models.h) where the CPU has AMX, the
 *     model itself against float64 everywhere (test_amx_model).
 *   The bf16-activation expert test adds the bf16 rounding of the SwiGLU
 *   output a' (8 significant bits, unit roundoff 2^-8):
 *   |bf16(a') - a| <= da + 2^-8 (|a| + da); its dot products stay within
 *   the TOL_DOT-sized bound (the bf16 kernel's depth is smaller than m and
 *   the test data have no values near 2^-126, so nothing is flushed).
 */
#include "cpu/cpu_internal.h"
#include "experts/experts.h"
#include "experts/experts_fast.h"
#include "bf16_models.h"
#include "harness.h"
#include "core/core.h"
#include "moe_formats.h"
#include "formats/mathf.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define U24 0x1p-24
#define TOL_DOT(m, S) (((double)(m) + 2.0) * U24 * (S) + ((double)(m) + 2.0) * 0x1p-149)
#define BF16ACT_DEPTH(m, nv) (2.0 * (double)(((m) + 31) / 32) + 4.0 + ((nv) ? 1.0 : 0.0))
#define TOL_BF16ACT(m, S, F, s2, nv)                                                                    \
    ((BF16ACT_DEPTH(m, nv) + 1.0) * U24 * (S) + (F) +                                                   \
     32.0 * (double)(((m) + 31) / 32) * 0x1p-126 * fmax(1.0, fabs(s2)) + (BF16ACT_DEPTH(m, nv) + 1.0) * 0x1p-149)

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
    return moe_splitmix64(&rng_state);
}
static double rndu(void) { return moe_t_rng_unif(&rng_state) * 2.0 - 1.0; } /* [-1, 1) */

/* A weight with its own buffers. */
typedef struct test_weight {
    moe_weight w;
    void *data, *scale;
} test_weight;

static void tw_free(test_weight *t) {
    free(t->data);
    free(t->scale);
    memset(t, 0, sizeof *t);
}

/* Random weight of format fmt; fp8_e8m0 picks E8M0 tile scales for FP8. */
static void tw_make(test_weight *t, moe_wfmt fmt, bool fp8_e8m0, int64_t rows, int64_t cols) {
    memset(t, 0, sizeof *t);
    moe_weight *w = &t->w;
    w->fmt = fmt;
    w->rows = rows;
    w->cols = cols;
    w->scale2 = 1.0f;
    w->name = "test";
    size_t n = (size_t)(rows * cols);
    switch (fmt) {
    case MOE_WFMT_F64: {
        double *d = malloc(n * 8);
        for (size_t i = 0; i < n; i++) d[i] = rndu();
        t->data = d;
        break;
    }
    case MOE_WFMT_F32: {
        float *d = malloc(n * 4);
        for (size_t i = 0; i < n; i++) d[i] = (float)rndu();
        t->data = d;
        break;
    }
    case MOE_WFMT_F16: {
        uint16_t *d = malloc(n * 2);
        for (size_t i = 0; i < n; i++) {
            uint64_t r = rnd(); /* exponents 2^-15 .. 2^0, some subnormals */
            d[i] = (uint16_t)((r & 0x83FF) | ((r >> 16) % 16) << 10);
        }
        t->data = d;
        break;
    }
    case MOE_WFMT_BF16: {
        uint16_t *d = malloc(n * 2);
        for (size_t i = 0; i < n; i++) {
            uint64_t r = rnd();
            d[i] = (uint16_t)((r & 0x807F) | (118 + (r >> 16) % 12) << 7);
        }
        t->data = d;
        break;
    }
    case MOE_WFMT_FP8_BLOCK: {
        uint8_t *d = malloc(n);
        for (size_t i = 0; i < n; i++) {
            uint8_t b = (uint8_t)rnd();
            if ((b & 0x7F) == 0x7F) b ^= 1; /* no NaN codes */
            d[i] = b;
        }
        t->data = d;
        w->scale_rows = (rows + 127) / 128;
        w->scale_cols = (cols + 127) / 128;
        size_t ns = (size_t)(w->scale_rows * w->scale_cols);
        if (fp8_e8m0) {
            uint8_t *s = malloc(ns);
            for (size_t i = 0; i < ns; i++) s[i] = (uint8_t)(120 + rnd() % 15);
            w->scale_dtype = MOE_DTYPE_F8_E8M0;
            t->scale = s;
        } else {
            float *s = malloc(ns * 4);
            for (size_t i = 0; i < ns; i++) s[i] = (float)(fabs(rndu()) * 0.01 + 1e-4);
            w->scale_dtype = MOE_DTYPE_F32;
            t->scale = s;
        }
        break;
    }
    case MOE_WFMT_MXFP4:
    case MOE_WFMT_NVFP4: {
        uint8_t *d = malloc(n / 2);
        for (size_t i = 0; i < n / 2; i++) d[i] = (uint8_t)rnd();
        t->data = d;
        int64_t blk = fmt == MOE_WFMT_MXFP4 ? 32 : 16;
        w->scale_rows = rows;
        w->scale_cols = cols / blk;
        size_t ns = (size_t)(rows * (cols / blk));
        uint8_t *s = malloc(ns);
        for (size_t i = 0; i < ns; i++) {
            if (fmt == MOE_WFMT_MXFP4) {
                s[i] = (uint8_t)(120 + rnd() % 15);
            } else {
                uint8_t b = (uint8_t)(rnd() & 0x7F);
                s[i] = b == 0x7F ? 0x7E : b;
            }
        }
        t->scale = s;
        w->scale_dtype = fmt == MOE_WFMT_MXFP4 ? MOE_DTYPE_F8_E8M0 : MOE_DTYPE_F8_E4M3;
        if (fmt == MOE_WFMT_NVFP4) w->scale2 = 0.37f; /* (e2m1*ue4m3)*s2 != e2m1*(ue4m3*s2) for ~4% */
        break;
    }
    }
    w->data = t->data;
    w->scale = t->scale;
}

/* Row r as exact float64 values: the definition (src/formats/weights.c). */
static void row_f64(const moe_weight *w, int64_t r, double *out) { moe_weight_row_f64(w, r, out); }

/* The active-capable tables: ref always, avx2, avx512 and amx when the CPU
 * has them (the last one is the widest). */
static const moe_cpu_kernels *tables[4];
static int n_tables;

static void init_tables(void) {
    tables[n_tables++] = moe_cpu_ref();
    static const moe_isa simd[] = {MOE_ISA_AVX2, MOE_ISA_AVX512, MOE_ISA_AMX};
    for (int i = 0; i < 3; i++) {
        moe_error err;
        if (moe_cpu_table(simd[i], &tables[n_tables], &err) == MOE_OK) n_tables++;
        else fprintf(stderr, "note: %s: %s kernels not tested\n", err.msg, moe_isa_name(simd[i]));
    }
}

static const char *fmt_name(moe_wfmt f, bool e8) {
    switch (f) {
    case MOE_WFMT_F64: return "f64";
    case MOE_WFMT_F32: return "f32";
    case MOE_WFMT_F16: return "f16";
    case MOE_WFMT_BF16: return "bf16";
    case MOE_WFMT_FP8_BLOCK: return e8 ? "fp8-e8m0" : "fp8-f32";
    case MOE_WFMT_MXFP4: return "mxfp4";
    case MOE_WFMT_NVFP4: return "nvfp4";
    }
    return "?";
}

static void fill_x(float *X, int64_t n, int64_t ldx, int64_t cols, double mag) {
    for (int64_t t = 0; t < n; t++)
        for (int64_t k = 0; k < ldx; k++) X[t * ldx + k] = k < cols ? (float)(rndu() * mag) : NAN;
}

/* Check Y [n, ldy] = X . W[r0:r1]^T against float64; returns failures. */
static int check_vs_f64(const moe_weight *w, const float *X, int64_t ldx, int64_t n, const float *Y, int64_t ldy,
                        const char *what) {
    double *row = malloc((size_t)w->cols * 8);
    int bad = 0;
    double worst = 0;
    for (int64_t j = 0; j < w->rows; j++) {
        row_f64(w, j, row);
        for (int64_t t = 0; t < n; t++) {
            double s = 0, S = 0;
            for (int64_t k = 0; k < w->cols; k++) {
                double p = (double)X[t * ldx + k] * row[k];
                s += p;
                S += fabs(p);
            }
            double y = Y[t * ldy + j], e = fabs(y - s), tol = TOL_DOT(w->cols, S);
            if (!(e <= tol)) {
                if (bad++ < 3)
                    fprintf(stderr, "  %s: row %lld tok %lld: got %.9g want %.9g err %.3g tol %.3g\n", what,
                            (long long)j, (long long)t, y, s, e, tol);
            }
            if (tol > 0 && e / tol > worst) worst = e / tol;
        }
    }
    free(row);
    return bad;
}

static const moe_wfmt all_fmts[] = {MOE_WFMT_F64, MOE_WFMT_F32, MOE_WFMT_F16, MOE_WFMT_BF16,
                                    MOE_WFMT_FP8_BLOCK, MOE_WFMT_FP8_BLOCK, MOE_WFMT_MXFP4, MOE_WFMT_NVFP4};
static const bool all_e8[] = {0, 0, 0, 0, 0, 1, 0, 0};
#define N_FMTS 8

static void test_formats_vs_f64(void) {
    static const int64_t rows_s[] = {1, 3, 17, 130};
    static const int64_t ns[] = {1, 2, 3, 5, 17};
    for (int f = 0; f < N_FMTS; f++) {
        moe_wfmt fmt = all_fmts[f];
        bool fp4 = fmt == MOE_WFMT_MXFP4 || fmt == MOE_WFMT_NVFP4;
        /* fp4 formats need cols % 32 (NVFP4: % 16); the others take any cols */
        int64_t cols_s[4] = {96, 160, 4128, fp4 ? (fmt == MOE_WFMT_NVFP4 ? 112 : 224) : 101};
        for (int ci = 0; ci < 4; ci++)
            for (int ri = 0; ri < 4; ri++) {
                int64_t cols = cols_s[ci], rows = rows_s[ri];
                test_weight tw;
                tw_make(&tw, fmt, all_e8[f], rows, cols);
                int64_t ldx = cols + 3, ldy = rows + 2;
                float *X = malloc((size_t)(17 * ldx) * 4), *Y = malloc((size_t)(17 * ldy) * 4);
                fill_x(X, 17, ldx, cols, 2.0);
                for (int ni = 0; ni < 5; ni++)
                    for (int ti = 0; ti < n_tables; ti++) {
                        int64_t n = ns[ni];
                        if (cols == 4128 && rows == 130 && tables[ti] == moe_cpu_ref() && n > 3) continue;
                        tables[ti]->gemm(&tw.w, 0, rows, X, ldx, n, Y, ldy);
                        char what[96];
                        snprintf(what, sizeof what, "%s %s rows %lld cols %lld n %lld", tables[ti]->isa,
                                 fmt_name(fmt, all_e8[f]), (long long)rows, (long long)cols, (long long)n);
                        int bad = check_vs_f64(&tw.w, X, ldx, n, Y, ldy, what);
                        CHECK(bad == 0, "%s: %d outputs beyond TOL_DOT", what, bad);
                    }
                free(X);
                free(Y);
                tw_free(&tw);
            }
    }
}

/* Y [n, w->rows] = gemm of all of X [n, w->cols] in one call; the same
 * bits from rows [0, r) and [r, rows) in two calls for several r, and from
 * each token alone. Y2: [n, w->rows] scratch. */
static void check_splits_and_alone(moe_gemm_fn gemm, const moe_weight *w, const float *X, int64_t n,
                                   const float *Y, float *Y2, const char *isa, const char *what) {
    int64_t rows = w->rows, cols = w->cols;
    static const int64_t splits[] = {1, 4, 8, 13, 36};
    for (int s = 0; s < 5; s++) {
        int64_t r = splits[s];
        memset(Y2, 0xFF, (size_t)(n * rows) * 4);
        gemm(w, 0, r, X, cols, n, Y2, rows);
        gemm(w, r, rows, X, cols, n, Y2 + r, rows);
        CHECK(memcmp(Y, Y2, (size_t)(n * rows) * 4) == 0, "%s %s: split at row %lld differs", isa, what,
              (long long)r);
    }
    memset(Y2, 0xFF, (size_t)(n * rows) * 4);
    for (int64_t t = 0; t < n; t++) gemm(w, 0, rows, X + t * cols, cols, 1, Y2 + t * rows, rows);
    CHECK(memcmp(Y, Y2, (size_t)(n * rows) * 4) == 0, "%s %s: token-alone differs", isa, what);
}

/* Row splits and batch composition give bit-identical outputs. */
static void test_determinism(void) {
    for (int f = 0; f < N_FMTS; f++)
        for (int ti = 0; ti < n_tables; ti++) {
            const moe_cpu_kernels *k = tables[ti];
            int64_t rows = 37, cols = all_fmts[f] == MOE_WFMT_MXFP4 || all_fmts[f] == MOE_WFMT_NVFP4 ? 288 : 301;
            int64_t n = 11;
            test_weight tw;
            tw_make(&tw, all_fmts[f], all_e8[f], rows, cols);
            float *X = malloc((size_t)(n * cols) * 4);
            float *Y = malloc((size_t)(n * rows) * 4), *Y2 = malloc((size_t)(n * rows) * 4);
            fill_x(X, n, cols, cols, 1.0);
            k->gemm(&tw.w, 0, rows, X, cols, n, Y, rows);
            /* row splits, each token alone, and tokens in groups of 3 starting at 1 */
            check_splits_and_alone(k->gemm, &tw.w, X, n, Y, Y2, k->isa, fmt_name(all_fmts[f], all_e8[f]));
            memset(Y2, 0xFF, (size_t)(n * rows) * 4);
            k->gemm(&tw.w, 0, rows, X, cols, 1, Y2, rows);
            for (int64_t t = 1; t < n; t += 3) {
                int64_t m = n - t < 3 ? n - t : 3;
                k->gemm(&tw.w, 0, rows, X + t * cols, cols, m, Y2 + t * rows, rows);
            }
            CHECK(memcmp(Y, Y2, (size_t)(n * rows) * 4) == 0, "%s %s: token groups differ", k->isa,
                  fmt_name(all_fmts[f], all_e8[f]));
            free(X);
            free(Y);
            free(Y2);
            tw_free(&tw);
        }
}

/* NaN/Inf in one token stay in that token; subnormal and huge X are accurate. */
/* X [n >= 4, w->cols] finite: a NaN in token 1 and an Inf in token 3 reach
 * all (NaN) / some non-finite (Inf) outputs of their own token and change
 * no bit of the others'. Y, Y0: [n, w->rows]. */
static void check_nan_inf_tokens(moe_gemm_fn gemm, const moe_weight *w, float *X, int64_t n, float *Y, float *Y0,
                                 const char *isa, const char *what) {
    int64_t rows = w->rows, cols = w->cols;
    gemm(w, 0, rows, X, cols, n, Y0, rows);
    X[1 * cols + 77] = NAN;
    X[3 * cols + 5] = INFINITY;
    gemm(w, 0, rows, X, cols, n, Y, rows);
    int nan_ok = 1, inf_ok = 1, others_ok = 1;
    for (int64_t j = 0; j < rows; j++) {
        nan_ok &= isnan(Y[1 * rows + j]);
        inf_ok &= !isfinite(Y[3 * rows + j]);
        for (int64_t t = 0; t < n; t++)
            if (t != 1 && t != 3) others_ok &= memcmp(&Y[t * rows + j], &Y0[t * rows + j], 4) == 0;
    }
    CHECK(nan_ok, "%s %s: NaN in token 1 not propagated to all its outputs", isa, what);
    CHECK(inf_ok, "%s %s: Inf in token 3 not propagated", isa, what);
    CHECK(others_ok, "%s %s: other tokens changed by a NaN/Inf neighbour", isa, what);
}

static void test_adversarial(void) {
    for (int f = 0; f < N_FMTS; f++)
        for (int ti = 0; ti < n_tables; ti++) {
            const moe_cpu_kernels *k = tables[ti];
            const char *fn = fmt_name(all_fmts[f], all_e8[f]);
            int64_t rows = 19, cols = 160, n = 5;
            test_weight tw;
            tw_make(&tw, all_fmts[f], all_e8[f], rows, cols);
            float *X = malloc((size_t)(n * cols) * 4);
            float *Y = malloc((size_t)(n * rows) * 4), *Y0 = malloc((size_t)(n * rows) * 4);
            fill_x(X, n, cols, cols, 1.0);
            check_nan_inf_tokens(k->gemm, &tw.w, X, n, Y, Y0, k->isa, fn);

            fill_x(X, n, cols, cols, 1e-39); /* subnormal activations */
            k->gemm(&tw.w, 0, rows, X, cols, n, Y, rows);
            char what[64];
            snprintf(what, sizeof what, "%s %s subnormal X", k->isa, fn);
            CHECK(check_vs_f64(&tw.w, X, cols, n, Y, rows, what) == 0, "%s", what);
            fill_x(X, n, cols, cols, 1e30); /* huge activations, sums stay finite */
            k->gemm(&tw.w, 0, rows, X, cols, n, Y, rows);
            snprintf(what, sizeof what, "%s %s huge X", k->isa, fn);
            CHECK(check_vs_f64(&tw.w, X, cols, n, Y, rows, what) == 0, "%s", what);
            free(X);
            free(Y);
            free(Y0);
            tw_free(&tw);
        }
}

/*
 * E2M1 weights (MXFP4, NVFP4) with every code and the scales' extremes,
 * against float64 sums of the decoded values (moe_weight_at_f32, the
 * kernels' contract 3) for T = 1, 3, 17, 129 (none a multiple of a tile:
 * register blocks hold <= 4 tokens, the AVX2 decode-once panels run from 5,
 * token tiles hold 32). Rows cycle through scale classes:
 *   MXFP4 E8M0: tiny (0, 1, 2: weights down to 2^-128, products subnormal),
 *     normal (118 .. 133), huge (240, 241, 253, 254: 254 makes weights of
 *     magnitude >= 2 overflow to Inf, as the reference's float product
 *     does), NaN (255 in one block: every output of the row is NaN);
 *   NVFP4 UE4M3: 0 (zero), 1 (subnormal 2^-9), 0x7E (448), normal, and a
 *     NaN code (0x7F, and 0x80: the sign bit, NaN for an unsigned scale).
 * Nibbles run over all 16 codes (both zeros, both signs) at every position
 * parity. X ~ U(-1, 1) * 2^-20 keeps finite sums finite in fp32. Expected:
 * NaN where the float64 sum is NaN, the same infinity where it is infinite,
 * else within TOL_DOT(cols, S). Then each token alone (n = 1: the register
 * path) gives the same bits as the batch (n = 129: the panels on AVX2).
 */
static void e2m1_adversarial_weight(test_weight *tw, moe_wfmt fmt, int64_t rows, int64_t cols) {
    tw_make(tw, fmt, false, rows, cols);
    uint8_t *q = tw->data, *sc = tw->scale;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t k = 0; k < cols; k += 2) {
            uint8_t lo = (uint8_t)((k / 2 + 5 * r) & 15), hi = (uint8_t)((k / 2 * 7 + 3 * r + 1) & 15);
            if (r % 5 == 4) lo = (uint8_t)(rnd() & 15), hi = (uint8_t)(rnd() & 15);
            q[(r * cols + k) / 2] = (uint8_t)(lo | hi << 4);
        }
    int64_t nb = tw->w.scale_cols;
    for (int64_t r = 0; r < rows; r++)
        for (int64_t b = 0; b < nb; b++) {
            uint8_t v;
            if (fmt == MOE_WFMT_MXFP4) {
                static const uint8_t tiny[] = {0, 1, 2}, huge[] = {240, 241, 253, 254};
                switch (r % 4) {
                case 0: v = tiny[(b + r) % 3]; break;
                case 1: v = (uint8_t)(118 + (b * 5 + r) % 16); break;
                case 2: v = huge[(b + r) % 4]; break;
                default: v = b == (r % nb) ? 255 : (uint8_t)(120 + b % 8); break;
                }
            } else {
                static const uint8_t ext[] = {0x00, 0x01, 0x7E, 0x38, 0x08, 0x77};
                switch (r % 3) {
                case 0: v = ext[(b + r) % 6]; break;
                case 1: v = (uint8_t)(0x30 + (b * 3 + r) % 16); break;
                default: v = b == (r % nb) ? ((r / 3) % 2 ? 0x80 : 0x7F) : (uint8_t)(0x30 + b % 8); break;
                }
            }
            sc[r * nb + b] = v;
        }
    /* MXFP4 rows 6, 14, ...: one infinite weight (2 * 2^127) in a block of
     * finite ones (magnitudes <= 1.5 * 2^127), normal scales elsewhere: the
     * row's outputs are +-Inf, not NaN */
    for (int64_t r = 6; fmt == MOE_WFMT_MXFP4 && r < rows; r += 8) {
        for (int64_t b = 0; b < nb; b++) sc[r * nb + b] = b == 0 ? 254 : 127;
        for (int64_t k = 0; k < 32; k += 2) {
            uint8_t *byte = &q[(r * cols + k) / 2];
            *byte = (uint8_t)(*byte & 0xBB); /* magnitudes 0 .. 1.5 (codes 0-3, 8-11) */
        }
        q[(r * cols) / 2] = (uint8_t)((q[(r * cols) / 2] & 0xF0) | 0x4); /* column 0: +2 */
    }
}

static void test_e2m1_every_code(void) {
    static const moe_wfmt fmts2[] = {MOE_WFMT_MXFP4, MOE_WFMT_NVFP4};
    /* MXFP4: 19 chunks (one 16-chunk panel + 3); NVFP4: 624 = 19 chunks + a 16-column edge */
    static const int64_t colss[] = {608, 624};
    static const int64_t ns[] = {1, 3, 17, 129};
    const int64_t rows = 41; /* 4-row and 3-row blocks and single leftover rows */
    for (int f = 0; f < 2; f++) {
        int64_t cols = colss[f];
        test_weight tw;
        e2m1_adversarial_weight(&tw, fmts2[f], rows, cols);
        double *Wd = malloc((size_t)(rows * cols) * 8);
        for (int64_t j = 0; j < rows; j++)
            for (int64_t k = 0; k < cols; k++) Wd[j * cols + k] = moe_weight_at_f32(&tw.w, j, k);
        int64_t nmax = 129;
        float *X = malloc((size_t)(nmax * cols) * 4), *Y = malloc((size_t)(nmax * rows) * 4),
              *Y1 = malloc((size_t)(nmax * rows) * 4);
        for (int64_t i = 0; i < nmax * cols; i++) X[i] = (float)(rndu() * 0x1p-20);
        int n_nan = 0, n_inf = 0;
        for (int ni = 0; ni < 4; ni++)
            for (int ti = 0; ti < n_tables; ti++) {
                const moe_cpu_kernels *k = tables[ti];
                int64_t n = ns[ni];
                memset(Y, 0xFF, (size_t)(n * rows) * 4);
                k->gemm(&tw.w, 0, rows, X, cols, n, Y, rows);
                int bad = 0;
                for (int64_t t = 0; t < n; t++)
                    for (int64_t j = 0; j < rows; j++) {
                        double sum = 0, S = 0;
                        for (int64_t c = 0; c < cols; c++) {
                            double p = (double)X[t * cols + c] * Wd[j * cols + c];
                            sum += p;
                            S += fabs(p);
                        }
                        double y = Y[t * rows + j];
                        bool ok = isnan(sum) ? isnan(y) : isinf(sum) ? y == sum : fabs(y - sum) <= TOL_DOT(cols, S);
                        n_nan += ni == 0 && ti == 0 && isnan(sum);
                        n_inf += ni == 0 && ti == 0 && isinf(sum);
                        if (!ok && bad++ < 3)
                            fprintf(stderr, "  %s %s n %lld row %lld tok %lld: got %.9g want %.9g\n", k->isa,
                                    fmt_name(fmts2[f], false), (long long)n, (long long)j, (long long)t, y, sum);
                    }
                CHECK(bad == 0, "%s %s every code, n %lld: %d outputs off the float64 sums", k->isa,
                      fmt_name(fmts2[f], false), (long long)n, bad);
                /* each token alone: the same bits as in the batch */
                memset(Y1, 0xFF, (size_t)(n * rows) * 4);
                for (int64_t t = 0; t < n; t++) k->gemm(&tw.w, 0, rows, X + t * cols, cols, 1, Y1 + t * rows, rows);
                CHECK(memcmp(Y, Y1, (size_t)(n * rows) * 4) == 0, "%s %s every code, n %lld: token-alone differs",
                      k->isa, fmt_name(fmts2[f], false), (long long)n);
            }
        /* the data really hold the cases the header names */
        /* (NVFP4's largest weight, 6 * 448 * scale2, stays finite: no Inf rows) */
        CHECK(n_nan > 0 && (n_inf > 0 || fmts2[f] == MOE_WFMT_NVFP4), "%s: adversarial data lost its NaN (%d) or Inf (%d) rows",
              fmt_name(fmts2[f], false), n_nan, n_inf);
        free(Wd);
        free(X);
        free(Y);
        free(Y1);
        tw_free(&tw);
    }
}

/* ------------------------------------------------ bf16 activations */


/* X [n, ldx] with bf16 values in the first cols columns (NaN past them). */
static void fill_x_bf16(float *X, int64_t n, int64_t ldx, int64_t cols, double mag) {
    fill_x(X, n, ldx, cols, mag);
    for (int64_t t = 0; t < n; t++)
        for (int64_t k = 0; k < cols; k++) X[t * ldx + k] = moe_bf16_round(X[t * ldx + k]);
}

/* The formats gemm_bf16act multiplies in bf16 (the others run gemm's code). */
static bool bf16act_fmt(moe_wfmt f) { return f == MOE_WFMT_MXFP4 || f == MOE_WFMT_NVFP4 || f == MOE_WFMT_BF16; }

/* Tables that have a bf16-activation kernel. */
static const moe_cpu_kernels *bf_tables[4];
static int n_bf_tables;

static void init_bf_tables(void) {
    for (int i = 0; i < n_tables; i++)
        if (tables[i]->gemm_bf16act) bf_tables[n_bf_tables++] = tables[i];
    if (!n_bf_tables) fprintf(stderr, "note: no table with gemm_bf16act (no AVX512_BF16): bf16act tests skipped\n");
}

/* The bf16 table under test: bf_gemm calls its gemm_bf16act, and
 * check_bf16act compares with its model (amx: amx_model, else
 * bf16act_model). */
static const moe_cpu_kernels *g_bk;
static bool is_amx_table(const moe_cpu_kernels *k) { return strcmp(k->isa, "amx") == 0; }

/* g_bk->gemm_bf16act with a workspace of the size the table asks for, filled
 * with garbage first (its contents on entry must not matter). */
static void bf_gemm(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx, int64_t n, float *Y,
                    int64_t ldy) {
    size_t b = g_bk->bf16act_ws(w, n);
    void *ws = b ? aligned_alloc(64, (b + 63) & ~(size_t)63) : NULL;
    if (ws) memset(ws, 0xA5, b);
    g_bk->gemm_bf16act(w, r0, r1, X, ldx, n, Y, ldy, ws);
    free(ws);
}


/* Roundings a product passes through in each table's sequence (the bound
 * gamma_d of the header), and results that can be flushed per 32 columns. */
static double bf16act_depth(const moe_weight *w) {
    bool nv = w->fmt == MOE_WFMT_NVFP4;
    double steps = (double)((w->cols + 31) / 32);
    return is_amx_table(g_bk) ? 16.0 + 1.0 + steps + (nv ? 1.0 : 0.0) : BF16ACT_DEPTH(w->cols, nv);
}
static double bf16act_flushes_per_step(void) { return is_amx_table(g_bk) ? 34.0 : 32.0; }

/* Y [n, ldy] from gemm_bf16act against float64 (TOL_BF16ACT) and, bf16
 * formats, against bf16act_model (equal values); returns failures. */
static int check_bf16act(const moe_weight *w, const float *X, int64_t ldx, int64_t n, const float *Y, int64_t ldy,
                         const char *what) {
    double *row = malloc((size_t)w->cols * 8);
    int bad = 0;
    bool nv = w->fmt == MOE_WFMT_NVFP4;
    for (int64_t j = 0; j < w->rows; j++) {
        row_f64(w, j, row);
        for (int64_t t = 0; t < n; t++) {
            const float *x = X + t * ldx;
            double s = 0, S = 0, F = 0;
            for (int64_t k = 0; k < w->cols; k++) {
                double p = (double)x[k] * row[k];
                s += p;
                S += fabs(p);
                if (fabs(x[k]) < 0x1p-126 || fabs(row[k] / (nv ? w->scale2 : 1.0)) < 0x1p-126) F += fabs(p);
            }
            double d = bf16act_depth(w), steps = (double)((w->cols + 31) / 32);
            double tol = (d + 1.0) * U24 * S + F + bf16act_flushes_per_step() * steps * 0x1p-126 * fmax(1.0, fabs(w->scale2)) +
                         (d + 1.0) * 0x1p-149;
            double y = Y[t * ldy + j], e = fabs(y - s);
            bool ok = isnan(s) ? isnan(y) : e <= tol;
            float m = is_amx_table(g_bk) ? amx_model(w, j, x) : bf16act_model(w, j, x);
            bool same = isnan(m) ? isnan(y) : (float)y == m;
            if ((!ok || !same) && bad++ < 3)
                fprintf(stderr, "  %s: row %lld tok %lld: got %.9g want %.9g (model %.9g) err %.3g tol %.3g\n", what,
                        (long long)j, (long long)t, y, s, m, e, tol);
        }
    }
    free(row);
    return bad;
}

/* Random weights and bf16 activations, every shape class: rows not multiples
 * of 4, cols with a partial chunk, token counts across token tiles. Formats
 * without a bf16 kernel must give gemm's bits. */
static void test_bf16act_vs_f64(void) {
    static const int64_t rows_s[] = {1, 3, 17, 130};
    static const int64_t ns[] = {1, 2, 3, 5, 17, 40};
    for (int ti = 0; ti < n_bf_tables; ti++)
        for (int f = 0; f < N_FMTS; f++) {
            moe_wfmt fmt = all_fmts[f];
            int64_t cols_s[4] = {96, 160, 4128,
                                 fmt == MOE_WFMT_NVFP4 ? 112 : fmt == MOE_WFMT_MXFP4 ? 224 : 101};
            for (int ci = 0; ci < 4; ci++)
                for (int ri = 0; ri < 4; ri++) {
                    int64_t cols = cols_s[ci], rows = rows_s[ri];
                    if (cols == 4128 && rows == 130 && !bf16act_fmt(fmt)) continue;
                    test_weight tw;
                    tw_make(&tw, fmt, all_e8[f], rows, cols);
                    int64_t ldx = cols + 3, ldy = rows + 2;
                    float *X = malloc((size_t)(40 * ldx) * 4), *Y = malloc((size_t)(40 * ldy) * 4),
                          *Y2 = malloc((size_t)(40 * ldy) * 4);
                    fill_x_bf16(X, 40, ldx, cols, 2.0);
                    for (int ni = 0; ni < 6; ni++) {
                        int64_t n = ns[ni];
                        g_bk = bf_tables[ti], bf_gemm(&tw.w, 0, rows, X, ldx, n, Y, ldy);
                        char what[112];
                        snprintf(what, sizeof what, "%s bf16act %s rows %lld cols %lld n %lld", bf_tables[ti]->isa,
                                 fmt_name(fmt, all_e8[f]), (long long)rows, (long long)cols, (long long)n);
                        if (bf16act_fmt(fmt)) {
                            int bad = check_bf16act(&tw.w, X, ldx, n, Y, ldy, what);
                            CHECK(bad == 0, "%s: %d outputs beyond TOL_BF16ACT or off the model", what, bad);
                        } else {
                            bf_tables[ti]->gemm(&tw.w, 0, rows, X, ldx, n, Y2, ldy);
                            bool same = true;
                            for (int64_t t = 0; t < n; t++)
                                same &= !memcmp(Y + t * ldy, Y2 + t * ldy, (size_t)rows * 4);
                            CHECK(same, "%s: differs from gemm (no bf16 kernel for this format)", what);
                        }
                    }
                    free(X);
                    free(Y);
                    free(Y2);
                    tw_free(&tw);
                }
        }
}

/* Row splits, batch composition and token tiles give bit-identical outputs. */
static void test_bf16act_determinism(void) {
    static const moe_wfmt fmts[] = {MOE_WFMT_MXFP4, MOE_WFMT_NVFP4, MOE_WFMT_BF16};
    for (int ti = 0; ti < n_bf_tables; ti++)
        for (int f = 0; f < 3; f++) {
            const moe_cpu_kernels *k = bf_tables[ti];
            g_bk = k;
            /* cols 4128: 6 tokens per packed tile, so 40 tokens span 7 tiles */
            int64_t rows = 37, cols = fmts[f] == MOE_WFMT_BF16 ? 4127 : 4128, n = 40;
            test_weight tw;
            tw_make(&tw, fmts[f], true, rows, cols);
            float *X = malloc((size_t)(n * cols) * 4);
            float *Y = malloc((size_t)(n * rows) * 4), *Y2 = malloc((size_t)(n * rows) * 4);
            fill_x_bf16(X, n, cols, cols, 1.0);
            bf_gemm(&tw.w, 0, rows, X, cols, n, Y, rows);
            char what[64];
            snprintf(what, sizeof what, "bf16act %s", fmt_name(fmts[f], true));
            check_splits_and_alone(bf_gemm, &tw.w, X, n, Y, Y2, k->isa, what);
            memset(Y2, 0xFF, (size_t)(n * rows) * 4);
            /* groups of 1 .. 14 tokens: token blocks of 1 .. 6, tiles cut anywhere */
            static const int64_t groups[] = {1, 6, 5, 2, 9, 3, 14};
            for (int64_t t = 0, g = 0; t < n; t += groups[g++])
                bf_gemm(&tw.w, 0, rows, X + t * cols, cols, groups[g], Y2 + t * rows, rows);
            CHECK(memcmp(Y, Y2, (size_t)(n * rows) * 4) == 0, "%s bf16act %s: token groups differ", k->isa,
                  fmt_name(fmts[f], true));
            free(X);
            free(Y);
            free(Y2);
            tw_free(&tw);
        }
}

/* The avx512 drivers give a register tile's 4 rows rs = 4096 / (row bytes)
 * rows apart, 1 <= rs <= 8 (row_spread, gemm_avx512.c), then adjacent rows
 * for the remainder. Shapes whose rows take each spread: MXFP4 / NVFP4 rows
 * of 8192 columns (4 KiB of codes: rs 1), 4096 (2), 2720 (3), 2048 (4),
 * 1632 (5) and 1024 (8); BF16 rows of 1024 columns (2 KiB: rs 2). Rows:
 * two groups of 4 rs and 7 more; each call starts at row 3 (r0 odd), and
 * each output must be the bits of that row computed alone (gemm of [j, j +
 * 1)) and within TOL_DOT (the bf16-activation entry: the same bits as
 * alone), for every table: a tile that read one row and wrote another, or
 * skipped or repeated one, fails here. */
static void test_row_spread(void) {
    static const struct {
        moe_wfmt fmt;
        int64_t cols;
        int rs; /* the spread those rows take: 4096 / row bytes, at most 8 */
    } cases[] = {{MOE_WFMT_MXFP4, 8192, 1}, {MOE_WFMT_MXFP4, 4096, 2}, {MOE_WFMT_MXFP4, 2720, 3},
                 {MOE_WFMT_MXFP4, 2048, 4}, {MOE_WFMT_MXFP4, 1632, 5}, {MOE_WFMT_MXFP4, 1024, 8},
                 {MOE_WFMT_NVFP4, 8192, 1}, {MOE_WFMT_NVFP4, 4096, 2}, {MOE_WFMT_NVFP4, 2720, 3},
                 {MOE_WFMT_NVFP4, 2048, 4}, {MOE_WFMT_NVFP4, 1632, 5}, {MOE_WFMT_NVFP4, 1024, 8},
                 {MOE_WFMT_BF16, 1024, 2}};
    static const int64_t ns[] = {1, 2, 3, 5};
    for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
        const moe_wfmt fmt = cases[ci].fmt;
        const int64_t cols = cases[ci].cols, r0 = 3, rows = r0 + 8 * cases[ci].rs + 7;
        test_weight tw;
        tw_make(&tw, fmt, true, rows, cols);
        float *X = malloc((size_t)(5 * cols) * 4), *Xb = malloc((size_t)(5 * cols) * 4);
        float *Y = malloc((size_t)(5 * rows) * 4), *Y1 = malloc((size_t)(5 * rows) * 4);
        fill_x(X, 5, cols, cols, 1.0);
        fill_x_bf16(Xb, 5, cols, cols, 1.0);
        for (int ni = 0; ni < 4; ni++)
            for (int ti = 0; ti < n_tables + n_bf_tables; ti++) {
                bool bf = ti >= n_tables;
                const moe_cpu_kernels *k = bf ? bf_tables[ti - n_tables] : tables[ti];
                if (k == moe_cpu_ref() && cols > 2048) continue; /* the scalar table: time */
                int64_t n = ns[ni];
                g_bk = k;
                moe_gemm_fn gemm = bf ? bf_gemm : k->gemm;
                const float *x = bf ? Xb : X;
                memset(Y, 0xFF, (size_t)(n * rows) * 4);
                memset(Y1, 0xEE, (size_t)(n * rows) * 4);
                gemm(&tw.w, r0, rows, x, cols, n, Y + r0, rows);
                for (int64_t j = r0; j < rows; j++) gemm(&tw.w, j, j + 1, x, cols, n, Y1 + j, rows);
                int same = 1;
                for (int64_t t = 0; t < n; t++)
                    same &= memcmp(Y + t * rows + r0, Y1 + t * rows + r0, (size_t)(rows - r0) * 4) == 0;
                char what[96];
                snprintf(what, sizeof what, "%s%s %s cols %lld (spread %d) n %lld", k->isa, bf ? " bf16act" : "",
                         fmt_name(fmt, true), (long long)cols, cases[ci].rs, (long long)n);
                CHECK(same, "%s: rows [%lld, %lld) in one call differ from each row alone", what, (long long)r0,
                      (long long)rows);
                if (!bf) { /* the f32 entry against float64: rows [0, r0) from a call of their own */
                    gemm(&tw.w, 0, r0, x, cols, n, Y, rows);
                    int bad = check_vs_f64(&tw.w, x, cols, n, Y, rows, what);
                    CHECK(bad == 0, "%s: %d outputs beyond TOL_DOT", what, bad);
                }
            }
        free(X);
        free(Xb);
        free(Y);
        free(Y1);
        tw_free(&tw);
    }
}

/* The widest rows the bf16 kernel packs on its stack (32768 columns: one
 * token per tile) against the model; wider rows run gemm's arithmetic. */
static void test_bf16act_wide(void) {
    for (int ti = 0; ti < n_bf_tables; ti++)
        for (int wide = 0; wide < 2; wide++) {
            const moe_cpu_kernels *k = bf_tables[ti];
            g_bk = k;
            int64_t rows = 5, cols = wide ? 32800 : 32768, n = 3;
            test_weight tw;
            tw_make(&tw, MOE_WFMT_MXFP4, true, rows, cols);
            float *X = malloc((size_t)(n * cols) * 4), *Y = malloc((size_t)(n * rows) * 4),
                  *Y2 = malloc((size_t)(n * rows) * 4);
            fill_x_bf16(X, n, cols, cols, 1.0);
            bf_gemm(&tw.w, 0, rows, X, cols, n, Y, rows);
            if (wide && !is_amx_table(k)) {
                k->gemm(&tw.w, 0, rows, X, cols, n, Y2, rows);
                CHECK(!memcmp(Y, Y2, (size_t)(n * rows) * 4), "%s bf16act cols %lld: not gemm's result", k->isa,
                      (long long)cols);
            } else {
                char what[64];
                snprintf(what, sizeof what, "%s bf16act mxfp4 cols %lld", k->isa, (long long)cols);
                CHECK(check_bf16act(&tw.w, X, cols, n, Y, rows, what) == 0, "%s", what);
            }
            free(X);
            free(Y);
            free(Y2);
            tw_free(&tw);
        }
}

/* Set weight (r, k) to e2m1 code `nib` (MXFP4 / NVFP4). */
static void set_nibble(moe_weight *w, int64_t r, int64_t k, uint8_t nib) {
    uint8_t *b = (uint8_t *)w->data + (size_t)(r * (w->cols / 2) + k / 2);
    *b = (k & 1) ? (uint8_t)((*b & 0x0F) | (nib << 4)) : (uint8_t)((*b & 0xF0) | nib);
}

/* NaN/Inf per token, subnormal weights and activations, huge activations,
 * and rounding ties: against float64 and bit for bit against the model. */
static void test_bf16act_adversarial(void) {
    static const moe_wfmt fmts[] = {MOE_WFMT_MXFP4, MOE_WFMT_NVFP4, MOE_WFMT_BF16};
    for (int ti = 0; ti < n_bf_tables; ti++)
        for (int f = 0; f < 3; f++) {
            const moe_cpu_kernels *k = bf_tables[ti];
            g_bk = k;
            const char *fn = fmt_name(fmts[f], true);
            int64_t rows = 19, cols = fmts[f] == MOE_WFMT_MXFP4 ? 160 : 176, n = 5;
            test_weight tw;
            tw_make(&tw, fmts[f], true, rows, cols);
            float *X = malloc((size_t)(n * cols) * 4);
            float *Y = malloc((size_t)(n * rows) * 4), *Y0 = malloc((size_t)(n * rows) * 4);
            char what[80];

            fill_x_bf16(X, n, cols, cols, 1.0);
            snprintf(what, sizeof what, "bf16act %s", fn);
            check_nan_inf_tokens(bf_gemm, &tw.w, X, n, Y, Y0, k->isa, what);

            /* subnormal bf16 activations (read as zero) and huge ones */
            fill_x_bf16(X, n, cols, cols, 1e-38);
            bf_gemm(&tw.w, 0, rows, X, cols, n, Y, rows);
            snprintf(what, sizeof what, "%s bf16act %s subnormal X", k->isa, fn);
            CHECK(check_bf16act(&tw.w, X, cols, n, Y, rows, what) == 0, "%s", what);
            fill_x_bf16(X, n, cols, cols, 1e30);
            bf_gemm(&tw.w, 0, rows, X, cols, n, Y, rows);
            snprintf(what, sizeof what, "%s bf16act %s huge X", k->isa, fn);
            CHECK(check_bf16act(&tw.w, X, cols, n, Y, rows, what) == 0, "%s", what);

            /* subnormal weights: MXFP4 scale codes 0 and 1 (e2m1 * 2^-127,
             * 2^-126), BF16 subnormal words, beside normal ones; tiny
             * activations so that partial sums also fall below 2^-126 */
            if (fmts[f] == MOE_WFMT_MXFP4) {
                uint8_t *sc = tw.scale;
                for (int64_t i = 0; i < rows * (cols / 32); i++) sc[i] = (uint8_t)(i % 3 == 2 ? 120 : i % 3);
            } else if (fmts[f] == MOE_WFMT_BF16) {
                uint16_t *d = tw.data;
                for (int64_t i = 0; i < rows * cols; i += 3) d[i] = (uint16_t)((d[i] & 0x807F) | (i % 2 ? 0 : 0x0080));
            } else {
                uint8_t *sc = tw.scale; /* NVFP4: the smallest UE4M3 codes (subnormal e4m3, normal bf16) */
                for (int64_t i = 0; i < rows * (cols / 16); i += 2) sc[i] = (uint8_t)(1 + i % 7);
            }
            for (int mag = 0; mag < 2; mag++) {
                fill_x_bf16(X, n, cols, cols, mag ? 1.0 : 1e-3);
                bf_gemm(&tw.w, 0, rows, X, cols, n, Y, rows);
                snprintf(what, sizeof what, "%s bf16act %s subnormal W (|x| %s)", k->isa, fn, mag ? "1" : "1e-3");
                CHECK(check_bf16act(&tw.w, X, cols, n, Y, rows, what) == 0, "%s", what);
            }

            /* ties: every weight 1 (or -1); activations from {+-1, +-2^-24,
             * +-2^-23, +-3 2^-24}, so the lane sums keep landing halfway
             * between floats near 1: only nearest-even in this exact order
             * (odd column first, one rounding per product) matches the model */
            if (fmts[f] == MOE_WFMT_BF16) {
                uint16_t *d = tw.data;
                for (int64_t i = 0; i < rows * cols; i++) d[i] = (uint16_t)(rnd() % 5 ? 0x3F80 : 0xBF80);
            } else {
                for (int64_t r = 0; r < rows; r++)
                    for (int64_t c = 0; c < cols; c++) set_nibble(&tw.w, r, c, (uint8_t)(rnd() % 5 ? 0x2 : 0xA));
                uint8_t *sc = tw.scale;
                int64_t nsc = rows * tw.w.scale_cols;
                for (int64_t i = 0; i < nsc; i++) sc[i] = fmts[f] == MOE_WFMT_MXFP4 ? 127 : 0x38;
            }
            static const float tie_vals[] = {0x1p-24f, 0x1p-23f, 0x3p-24f, 0x1p-25f};
            for (int64_t i = 0; i < n * cols; i++) {
                float v = rnd() % 3 ? tie_vals[rnd() % 4] : 1.0f;
                X[i] = v == 1.0f ? (rnd() % 2 ? v : -v) : (rnd() % 7 ? v : -v);
            }
            bf_gemm(&tw.w, 0, rows, X, cols, n, Y, rows);
            snprintf(what, sizeof what, "%s bf16act %s ties", k->isa, fn);
            model_ties = 0;
            CHECK(check_bf16act(&tw.w, X, cols, n, Y, rows, what) == 0, "%s", what);
            long ties_seen = model_ties;
            CHECK(ties_seen > 100, "%s bf16act %s: the tie data produced only %ld ties", k->isa, fn, ties_seen);
            fprintf(stderr, "  %s bf16act %s: %ld rounding ties, all as the model\n", k->isa, fn, ties_seen);
            free(X);
            free(Y);
            free(Y0);
            tw_free(&tw);
        }
}

/* One expert through moe_experts_fast (one job; the scratch it asks for;
 * the threads moe_experts_fast_threads gives). */
static void expert_fast(const moe_cpu_kernels *k, const moe_weight *w1, const moe_weight *w3, const moe_weight *w2,
                        double L, moe_act_prec act, const float *X, int64_t n, float *Y) {
    moe_expert_job job = {w1, w3, w2, X, Y, n};
    int nth = moe_experts_fast_threads();
    size_t b = moe_experts_fast_scratch(k, act, &job, 1, nth);
    void *scr = aligned_alloc(64, (b + 63) & ~(size_t)63);
    moe_experts_fast(k, L, act, &job, 1, scr, nth);
    free(scr);
}

/* float64 expert with per-output error bounds (see the header comment).
 * W1, W3: [I, H], W2: [H, I] exact values. Y, B: [n, H]. */
static void expert_ref64(const double *W1, const double *W3, const double *W2, int64_t H, int64_t I, double L,
                         bool bf16, const float *X, int64_t n, double *Y, double *B) {
    double *a = malloc((size_t)I * 8), *da = malloc((size_t)I * 8);
    double gH = (H + 2) * U24, gI = (I + 2) * U24;
    for (int64_t t = 0; t < n; t++) {
        const float *x = X + t * H;
        for (int64_t i = 0; i < I; i++) {
            double g = 0, u = 0, Sg = 0, Su = 0;
            for (int64_t h = 0; h < H; h++) {
                g += x[h] * W1[i * H + h];
                Sg += fabs(x[h] * W1[i * H + h]);
                u += x[h] * W3[i * H + h];
                Su += fabs(x[h] * W3[i * H + h]);
            }
            if (L > 0) {
                g = g > L ? L : g;
                u = u > L ? L : (u < -L ? -L : u);
            }
            double sg = g / (1 + exp(-g));
            a[i] = sg * u;
            double dg = gH * Sg, du = gH * Su;
            da[i] = 1.1 * dg * (fabs(u) + du) + fabs(sg) * du + 8 * U24 * fabs(a[i]);
            if (bf16) da[i] += 0x1p-8 * (fabs(a[i]) + da[i]); /* the SwiGLU output rounded to bf16 */
        }
        for (int64_t h = 0; h < H; h++) {
            double s = 0, b = 0;
            for (int64_t i = 0; i < I; i++) {
                s += a[i] * W2[h * I + i];
                b += (gI * fabs(a[i]) + da[i] * (1 + gI)) * fabs(W2[h * I + i]);
            }
            Y[t * H + h] = s;
            B[t * H + h] = b + (I + 2) * 0x1p-149;
        }
    }
    free(a);
    free(da);
}

static double *dense_f64(const moe_weight *w) {
    double *d = malloc((size_t)(w->rows * w->cols) * 8);
    for (int64_t r = 0; r < w->rows; r++) row_f64(w, r, d + r * w->cols);
    return d;
}

/* One expert through table k in format f against float64 (expert_ref64's
 * bound; with bf16 activations X is bf16 and the SwiGLU output is rounded
 * to bf16 too): bit for bit across 1 and 2 threads and batch composition
 * (token 4 alone, tokens 3..6), a NaN token (2) NaN everywhere and nowhere
 * else. With `ref_check` (BF16 weights, exact activations) the ref table
 * must also reproduce moe_expert_f32 bit for bit. */
static void check_expert(const moe_cpu_kernels *k, moe_wfmt f, double L, moe_act_prec act, bool ref_check) {
    int64_t H = 256, I = 96, n = 7;
    bool bf16 = act == MOE_ACT_BF16;
    const char *fn = fmt_name(f, true), *an = bf16 ? "bf16act " : "";
    test_weight t1, t3, t2;
    tw_make(&t1, f, true, I, H);
    tw_make(&t3, f, true, I, H);
    tw_make(&t2, f, true, H, I);
    double *W1 = dense_f64(&t1.w), *W3 = dense_f64(&t3.w), *W2 = dense_f64(&t2.w);
    float *X = malloc((size_t)(n * H) * 4);
    if (bf16) fill_x_bf16(X, n, H, H, 1.0);
    else fill_x(X, n, H, H, 1.0);
    X[2 * H + 9] = NAN;
    double *Yr = malloc((size_t)(n * H) * 8), *B = malloc((size_t)(n * H) * 8);
    expert_ref64(W1, W3, W2, H, I, L, bf16, X, n, Yr, B);
    float *Y1 = malloc((size_t)(n * H) * 4), *Y2 = malloc((size_t)(n * H) * 4);
#ifdef _OPENMP
    omp_set_num_threads(1);
#endif
    expert_fast(k, &t1.w, &t3.w, &t2.w, L, act, X, n, Y1);
#ifdef _OPENMP
    omp_set_num_threads(2);
#endif
    expert_fast(k, &t1.w, &t3.w, &t2.w, L, act, X, n, Y2);
    CHECK(memcmp(Y1, Y2, (size_t)(n * H) * 4) == 0, "%s %s%s L=%g: 1 and 2 threads differ", k->isa, an, fn, L);
    int bad = 0, nan_ok = 1;
    for (int64_t t = 0; t < n; t++)
        for (int64_t h = 0; h < H; h++) {
            if (t == 2) {
                nan_ok &= isnan(Y1[t * H + h]);
                continue;
            }
            double e = fabs(Y1[t * H + h] - Yr[t * H + h]);
            if (!(e <= B[t * H + h]) && bad++ < 3)
                fprintf(stderr, "  expert %s %s%s: tok %lld h %lld got %.9g want %.9g bound %.3g\n", k->isa, an, fn,
                        (long long)t, (long long)h, Y1[t * H + h], Yr[t * H + h], B[t * H + h]);
        }
    CHECK(bad == 0, "%s %s%s L=%g: %d expert outputs beyond the propagated bound", k->isa, an, fn, L, bad);
    CHECK(nan_ok, "%s %s%s: NaN token not NaN in every output", k->isa, an, fn);
    /* batch composition: token 4 alone, tokens 3..6, equal their rows in the batch */
    expert_fast(k, &t1.w, &t3.w, &t2.w, L, act, X + 4 * H, 1, Y2);
    CHECK(memcmp(Y1 + 4 * H, Y2, (size_t)H * 4) == 0, "%s %s%s: token alone differs", k->isa, an, fn);
    expert_fast(k, &t1.w, &t3.w, &t2.w, L, act, X + 3 * H, 4, Y2);
    CHECK(memcmp(Y1 + 3 * H, Y2, (size_t)(4 * H) * 4) == 0, "%s %s%s: tokens 3..6 differ", k->isa, an, fn);
    if (ref_check) {
        /* the ref table reproduces moe_expert_f32 bit for bit (same order) */
        float *sc = malloc(moe_expert_scratch(H, I, n) * 4);
        moe_expert_f32(&t1.w, &t3.w, &t2.w, L, act, X, n, Y2, sc);
        expert_fast(moe_cpu_ref(), &t1.w, &t3.w, &t2.w, L, act, X, n, Y1);
        CHECK(memcmp(Y1, Y2, (size_t)(n * H) * 4) == 0, "ref table differs from moe_expert_f32");
        free(sc);
    }
    free(Y1);
    free(Y2);
    free(Yr);
    free(B);
    free(X);
    free(W1);
    free(W3);
    free(W2);
    tw_free(&t1);
    tw_free(&t3);
    tw_free(&t2);
}

static void test_expert_fast(void) {
    static const moe_wfmt fmts[] = {MOE_WFMT_BF16, MOE_WFMT_FP8_BLOCK, MOE_WFMT_MXFP4, MOE_WFMT_NVFP4};
    for (int f = 0; f < 4; f++)
        for (int li = 0; li < 2; li++)
            for (int ti = 0; ti < n_tables; ti++)
                check_expert(tables[ti], fmts[f], li ? 0.05 : 0.0, MOE_ACT_EXACT,
                             ti == 0 && fmts[f] == MOE_WFMT_BF16);
#ifdef _OPENMP
    omp_set_num_threads(omp_get_num_procs());
#endif
}

/* Which kernel moe_expert_fast calls: gemm_bf16act for bf16 activations
 * when the table has one, gemm otherwise. */
static int calls_f32, calls_bf16;
static void count_f32(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx, int64_t n, float *Y,
                      int64_t ldy) {
#ifdef _OPENMP
#pragma omp atomic
#endif
    calls_f32++;
    moe_cpu_ref()->gemm(w, r0, r1, X, ldx, n, Y, ldy);
}
static void count_bf16(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx, int64_t n, float *Y,
                       int64_t ldy, void *ws) {
    (void)ws;
#ifdef _OPENMP
#pragma omp atomic
#endif
    calls_bf16++;
    moe_cpu_ref()->gemm(w, r0, r1, X, ldx, n, Y, ldy);
}
static size_t count_ws(const moe_weight *w, int64_t n) {
    (void)w;
    return (size_t)n * 64;
}

/* moe_experts_fast with bf16 activations: the bf16 kernels against float64
 * (bound of expert_ref64 with the bf16 rounding of the SwiGLU output), bit
 * for bit across thread counts and batch composition. */
static void test_expert_fast_bf16act(void) {
    int64_t H = 256, I = 96, n = 7;
    {
        test_weight t1, t3, t2;
        tw_make(&t1, MOE_WFMT_MXFP4, true, I, H);
        tw_make(&t3, MOE_WFMT_MXFP4, true, I, H);
        tw_make(&t2, MOE_WFMT_MXFP4, true, H, I);
        float *X = malloc((size_t)(n * H) * 4), *Y = malloc((size_t)(n * H) * 4);
            fill_x_bf16(X, n, H, H, 1.0);
        moe_cpu_kernels both = {"test", count_f32, count_bf16, count_ws, NULL},
                        f32only = {"test", count_f32, NULL, NULL, NULL};
        calls_f32 = calls_bf16 = 0;
        expert_fast(&both, &t1.w, &t3.w, &t2.w, 0.0, MOE_ACT_BF16, X, n, Y);
        CHECK(calls_bf16 > 0 && calls_f32 == 0, "act bf16: gemm_bf16act %d calls, gemm %d", calls_bf16, calls_f32);
        calls_f32 = calls_bf16 = 0;
        expert_fast(&both, &t1.w, &t3.w, &t2.w, 0.0, MOE_ACT_EXACT, X, n, Y);
        CHECK(calls_bf16 == 0 && calls_f32 > 0, "act exact: gemm_bf16act %d calls, gemm %d", calls_bf16, calls_f32);
        calls_f32 = calls_bf16 = 0;
        expert_fast(&f32only, &t1.w, &t3.w, &t2.w, 0.0, MOE_ACT_BF16, X, n, Y);
        CHECK(calls_bf16 == 0 && calls_f32 > 0, "no bf16 kernel: gemm %d calls", calls_f32);
        free(X);
        free(Y);
        tw_free(&t1);
        tw_free(&t3);
        tw_free(&t2);
    }
    static const moe_wfmt fmts[] = {MOE_WFMT_BF16, MOE_WFMT_MXFP4, MOE_WFMT_NVFP4};
    for (int ti = 0; ti < n_bf_tables; ti++)
        for (int f = 0; f < 3; f++)
            for (int li = 0; li < 2; li++) check_expert(bf_tables[ti], fmts[f], li ? 0.05 : 0.0, MOE_ACT_BF16, false);
#ifdef _OPENMP
    omp_set_num_threads(omp_get_num_procs());
#endif
}

/* The kernels' scalar element decoder equals moe_weight_row_f32 bit for bit
 * (cpu_internal.h invariant 1), edge scales included: E8M0 0 and 0xFF, UE4M3
 * 0x7F and sign-bit codes, FP8 NaN codes and huge/NaN fp32 tile scales. */
static void test_element_decoder(void) {
    for (int f = 0; f < N_FMTS; f++) {
        int64_t rows = 130, cols = 288;
        test_weight tw;
        tw_make(&tw, all_fmts[f], all_e8[f], rows, cols);
        if (all_fmts[f] == MOE_WFMT_MXFP4 || all_fmts[f] == MOE_WFMT_NVFP4 ||
            (all_fmts[f] == MOE_WFMT_FP8_BLOCK && all_e8[f])) {
            uint8_t *s = tw.scale;
            s[0] = 0;
            s[1] = 0xFF;
            s[2] = 0x7F;
            s[3] = 0x80;
        }
        if (all_fmts[f] == MOE_WFMT_FP8_BLOCK) {
            uint8_t *d = tw.data;
            d[5] = 0x7F;
            d[cols + 7] = 0xFF;
            d[9] = 0x80;
            if (!all_e8[f]) {
                float *s = tw.scale;
                s[1] = 3e38f;
                s[2] = NAN;
            }
        }
        float *row = malloc((size_t)cols * 4);
        int bad = 0;
        for (int64_t r = 0; r < rows; r++) {
            moe_weight_row_f32(&tw.w, r, row);
            for (int64_t k = 0; k < cols; k++) {
                float v = moe_weight_at_f32(&tw.w, r, k);
                bool same = isnan(v) ? isnan(row[k]) : memcmp(&v, &row[k], 4) == 0;
                bad += !same;
            }
        }
        CHECK(bad == 0, "%s: %d elements differ from moe_weight_row_f32", fmt_name(all_fmts[f], all_e8[f]), bad);
        /* and the SIMD kernels decode the same values: one-hot activations */
        for (int ti = 0; ti < n_tables; ti++) {
            float *X = calloc((size_t)cols, 4), *Y = malloc((size_t)rows * 4);
            int bad2 = 0;
            for (int64_t k = 0; k < cols; k += 37) {
                X[k] = 1.0f;
                tables[ti]->gemm(&tw.w, 0, rows, X, cols, 1, Y, rows);
                for (int64_t r = 0; r < rows; r++) {
                    float v = moe_weight_at_f32(&tw.w, r, k);
                    /* x = 1 at k, 0 elsewhere: Y = w[k] unless another
                     * element of the row is NaN/Inf (0 * Inf = NaN) */
                    if (!isfinite(v)) continue;
                    bool row_finite = true;
                    for (int64_t q = 0; q < cols; q++) row_finite &= isfinite(moe_weight_at_f32(&tw.w, r, q));
                    if (row_finite && memcmp(&v, &Y[r], 4) != 0 && !(v == 0 && Y[r] == 0)) bad2++;
                }
                X[k] = 0.0f;
            }
            CHECK(bad2 == 0, "%s %s: %d one-hot outputs differ from the decoded weight", tables[ti]->isa,
                  fmt_name(all_fmts[f], all_e8[f]), bad2);
            free(X);
            free(Y);
        }
        free(row);
        tw_free(&tw);
    }
}

/* Called from inside a caller's parallel region (experts spread over
 * threads, unequal counts per thread): runs serially, no orphaned barrier
 * deadlock, same bits. */
static void test_expert_nested(void) {
    int64_t H = 128, I = 64, n = 3;
    test_weight t1, t3, t2;
    tw_make(&t1, MOE_WFMT_MXFP4, true, I, H);
    tw_make(&t3, MOE_WFMT_MXFP4, true, I, H);
    tw_make(&t2, MOE_WFMT_MXFP4, true, H, I);
    float *X = malloc((size_t)(n * H) * 4), *Y0 = malloc((size_t)(n * H) * 4);
    fill_x(X, n, H, H, 1.0);
    const moe_cpu_kernels *k = tables[n_tables - 1];
    expert_fast(k, &t1.w, &t3.w, &t2.w, 0.0, MOE_ACT_EXACT, X, n, Y0);
    int same[3] = {0, 0, 0};
#ifdef _OPENMP
#pragma omp parallel num_threads(2)
#endif
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *Y = malloc((size_t)(n * H) * 4);
        for (int rep = 0; rep < (tid == 0 ? 2 : 1); rep++) {
            expert_fast(k, &t1.w, &t3.w, &t2.w, 0.0, MOE_ACT_EXACT, X, n, Y);
            if (memcmp(Y, Y0, (size_t)(n * H) * 4) == 0) {
#ifdef _OPENMP
#pragma omp atomic
#endif
                same[tid == 0 ? rep : 2]++;
            }
        }
        free(Y);
    }
#ifdef _OPENMP
    CHECK(same[0] == 1 && same[1] == 1 && same[2] == 1, "nested calls differ: %d %d %d", same[0], same[1], same[2]);
#else
    CHECK(same[0] == 1 && same[1] == 1, "repeat calls differ");
#endif
    free(X);
    free(Y0);
    tw_free(&t1);
    tw_free(&t3);
    tw_free(&t2);
}

static void test_select(void) {
    moe_error err;
    const moe_cpu_kernels *k = NULL;
    CHECK(moe_cpu_table(MOE_ISA_REF, &k, &err) == MOE_OK, "%s", err.msg);
    CHECK(k && strcmp(k->isa, "ref") == 0, "ref table is %s", k ? k->isa : "NULL");
    const moe_cpu_features *f = moe_cpu_get_features();
    bool avx2 = f->os_avx && f->avx2 && f->fma && f->f16c;
    moe_status st = moe_cpu_table(MOE_ISA_AVX2, &k, &err);
    CHECK(st == (avx2 ? MOE_OK : MOE_ERR_UNSUPPORTED), "avx2 select: %s", moe_status_str(st));
    if (avx2) CHECK(strcmp(k->isa, "avx2") == 0, "avx2 table is %s", k->isa);
    CHECK(moe_cpu_ref()->gemm_bf16act == NULL && moe_cpu_ref()->bf16act_ws == NULL, "ref table has a bf16 kernel");
    if (avx2) CHECK(k->gemm_bf16act == NULL, "avx2 table has a bf16 kernel");
    if (moe_cpu_table(MOE_ISA_AVX512, &k, &err) == MOE_OK)
        CHECK((k->gemm_bf16act != NULL) == f->avx512bf16 && (k->bf16act_ws != NULL) == f->avx512bf16,
              "avx512 table: bf16 kernel %s, AVX512_BF16 %s",
              k->gemm_bf16act ? "set" : "NULL", f->avx512bf16 ? "present" : "absent");
    CHECK(moe_cpu_table(MOE_ISA_REF, &k, &err) == MOE_OK, "%s", err.msg);
    /* amx: exactly when the CPU, Linux and the build have it; otherwise an
     * error that says what is missing and what is available */
    bool amx_here = avx2 && f->avx512bf16 && f->amx_tile && f->amx_bf16 && moe_cpu_amx_table() &&
                    moe_cpu_table(MOE_ISA_AVX512, &k, &err) == MOE_OK;
    st = moe_cpu_table(MOE_ISA_AMX, &k, &err);
    CHECK(st == (amx_here ? MOE_OK : MOE_ERR_UNSUPPORTED), "amx: %s (%s)", moe_status_str(st), err.msg);
    if (st == MOE_OK) CHECK(strcmp(k->isa, "amx") == 0 && k->gemm_bf16act && k->bf16act_ws, "amx table: %s", k->isa);
    else CHECK(strstr(err.msg, "available: ref") != NULL, "the error says what is available: %s", err.msg);
    fprintf(stderr, "  amx: %s\n", st == MOE_OK ? "available" : err.msg);
    CHECK(moe_cpu_table(MOE_ISA_REF, &k, &err) == MOE_OK, "%s", err.msg);
    moe_isa parsed = MOE_ISA_REF;
    CHECK(moe_isa_parse("sse9", &parsed, &err) == MOE_ERR_ARG, "unknown isa accepted");
    CHECK(moe_cpu_table((moe_isa)99, &k, &err) == MOE_ERR_ARG, "an ISA value outside the enum is accepted");
    CHECK(strcmp(k->isa, "ref") == 0, "a failed lookup changed the table it returned");
    /* AUTO is the widest table this CPU has short of amx (amx comes by name
     * only: dispatch.c) */
    const moe_cpu_kernels *widest = tables[n_tables - 1];
    if (strcmp(widest->isa, "amx") == 0) widest = tables[n_tables - 2];
    CHECK(moe_cpu_table(MOE_ISA_AUTO, &k, &err) == MOE_OK && k == widest, "auto is %s, not %s", k->isa, widest->isa);
    for (int i = MOE_ISA_AUTO; i <= MOE_ISA_AMX; i++) {
        CHECK(moe_isa_parse(moe_isa_name((moe_isa)i), &parsed, &err) == MOE_OK && parsed == (moe_isa)i,
              "name %s does not parse back", moe_isa_name((moe_isa)i));
    }
}

/* --------------------------------------------------------- AMX tiles */

/* The AMX sequence (amx_model) against float64 on every CPU: shapes with a
 * partial last step, several K blocks (256 columns each), NVFP4's scale2 and
 * the tie data; the bound is that of check_bf16act with the AMX depth. */
static void test_amx_model(void) {
    static const moe_cpu_kernels amx_model_table = {"amx", NULL, NULL, NULL, NULL};
    const moe_cpu_kernels *saved = g_bk;
    g_bk = &amx_model_table; /* check_bf16act's model and bound: the AMX ones */
    static const moe_wfmt fmts[] = {MOE_WFMT_MXFP4, MOE_WFMT_NVFP4, MOE_WFMT_BF16};
    for (int f = 0; f < 3; f++) {
        int64_t cols_s[3] = {96, 1056, fmts[f] == MOE_WFMT_BF16 ? 1061 : fmts[f] == MOE_WFMT_NVFP4 ? 1040 : 4128};
        for (int ci = 0; ci < 3; ci++) {
            int64_t rows = 7, cols = cols_s[ci], n = 3;
            test_weight tw;
            tw_make(&tw, fmts[f], true, rows, cols);
            float *X = malloc((size_t)(n * cols) * 4), *Y = malloc((size_t)(n * rows) * 4);
            fill_x_bf16(X, n, cols, cols, 2.0);
            for (int64_t j = 0; j < rows; j++)
                for (int64_t t = 0; t < n; t++) Y[t * rows + j] = amx_model(&tw.w, j, X + t * cols);
            char what[80];
            snprintf(what, sizeof what, "amx model %s cols %lld", fmt_name(fmts[f], true), (long long)cols);
            CHECK(check_bf16act(&tw.w, X, cols, n, Y, rows, what) == 0, "%s", what);
            free(X);
            free(Y);
            tw_free(&tw);
        }
    }
    g_bk = saved;
}

/* Candidate readings of TDPBF16PS for one output, to name the one the
 * hardware follows when it is not the SDM's (printed, not asserted):
 * 1 the SDM (amx_model); 2 one fma chain through the accumulator, even
 * element first (the Intrinsics Guide's pseudocode); 3 each pair summed
 * first, then added; 4 each step's 32 products summed exactly, one rounding. */
static float amx_candidate(int which, const moe_weight *w, int64_t r, const float *x) {
    if (which == 1) return amx_model(w, r, x);
    int64_t cols = w->cols;
    float c = 0.0f;
    for (int64_t s = 0; s < (cols + 31) / 32; s++) {
        double exact = 0;
        for (int kp = 0; kp < 16; kp++) {
            int64_t k0 = 32 * s + bf16act_col(w, 2 * kp), k1 = 32 * s + bf16act_col(w, 2 * kp + 1);
            float a0 = k0 < cols ? daz(bf16act_weight(w, r, k0)) : 0.0f, b0 = k0 < cols ? daz(moe_bf16_round(x[k0])) : 0.0f;
            float a1 = k1 < cols ? daz(bf16act_weight(w, r, k1)) : 0.0f, b1 = k1 < cols ? daz(moe_bf16_round(x[k1])) : 0.0f;
            if (which == 2) {
                c = fma_ftz(a0, b0, c);
                c = fma_ftz(a1, b1, c);
            } else if (which == 3) {
                c = add_ftz(c, daz((float)((double)a0 * b0 + (double)a1 * b1)));
            } else {
                exact += (double)a0 * b0 + (double)a1 * b1;
            }
        }
        if (which == 4) c = add_ftz(c, daz((float)exact));
    }
    return w->fmt == MOE_WFMT_NVFP4 ? c * w->scale2 : c;
}

static const moe_cpu_kernels *amx_table(void) {
    for (int i = 0; i < n_bf_tables; i++)
        if (is_amx_table(bf_tables[i])) return bf_tables[i];
    return NULL;
}

/* On AMX hardware: which candidate reading the tiles follow, over random and
 * tie data (the bit-exact checks against amx_model run in the bf16act tests,
 * which include the amx table). */
static void test_amx_probe(void) {
    const moe_cpu_kernels *k = amx_table();
    if (!k) {
        fprintf(stderr, "note: no amx table here: the AMX kernel was not run, its model was\n");
        return;
    }
    g_bk = k;
    static const moe_wfmt fmts[] = {MOE_WFMT_MXFP4, MOE_WFMT_BF16};
    for (int f = 0; f < 2; f++)
        for (int ties = 0; ties < 2; ties++) {
            int64_t rows = 33, cols = 1056, n = 17;
            test_weight tw;
            tw_make(&tw, fmts[f], true, rows, cols);
            float *X = malloc((size_t)(n * cols) * 4), *Y = malloc((size_t)(n * rows) * 4);
            fill_x_bf16(X, n, cols, cols, 1.0);
            if (ties) {
                static const float tv[] = {0x1p-24f, 0x1p-23f, 0x3p-24f, 1.0f};
                for (int64_t i = 0; i < n * cols; i++) X[i] = (rnd() % 2 ? 1 : -1) * tv[rnd() % 4];
            }
            bf_gemm(&tw.w, 0, rows, X, cols, n, Y, rows);
            long match[5] = {0};
            for (int64_t j = 0; j < rows; j++)
                for (int64_t t = 0; t < n; t++)
                    for (int c = 1; c <= 4; c++) {
                        float m = amx_candidate(c, &tw.w, j, X + t * cols), y = Y[t * rows + j];
                        match[c] += memcmp(&m, &y, 4) == 0;
                    }
            fprintf(stderr, "  amx probe %s%s: %lld outputs; equal to: SDM %ld, fma chain %ld, pair-first %ld, exact step %ld\n",
                    fmt_name(fmts[f], true), ties ? " ties" : "", (long long)(rows * n), match[1], match[2], match[3],
                    match[4]);
            CHECK(match[1] == rows * n, "amx %s: %ld of %lld outputs follow the SDM sequence", fmt_name(fmts[f], true),
                  match[1], (long long)(rows * n));
            free(X);
            free(Y);
            tw_free(&tw);
        }
}

/* ------------------------------------------------ the experts' driver */

/* moe_experts_fast over many experts at once: the same bits for 1, 2, 3, 5,
 * 8 and 16 threads, for all jobs in one call and for each job alone, and
 * against the one-expert path; f32 and (where a table has it) bf16
 * activations; experts with 0, 1 and many tokens; I not a multiple of the
 * 128-row tiles. */
static void test_experts_threads(void) {
    enum { NJ = 6 };
    int64_t H = 256, I = 320, ns[NJ] = {1, 0, 7, 2, 19, 1};
    test_weight w[NJ][3];
    float *X[NJ], *Y0[NJ], *Y[NJ];
    for (int e = 0; e < NJ; e++) {
        moe_wfmt f = e % 3 == 0 ? MOE_WFMT_MXFP4 : e % 3 == 1 ? MOE_WFMT_NVFP4 : MOE_WFMT_BF16;
        tw_make(&w[e][0], f, true, I, H);
        tw_make(&w[e][1], f, true, I, H);
        tw_make(&w[e][2], f, true, H, I);
        X[e] = malloc((size_t)(ns[e] * H + 1) * 4);
        Y0[e] = malloc((size_t)(ns[e] * H + 1) * 4);
        Y[e] = malloc((size_t)(ns[e] * H + 1) * 4);
        fill_x_bf16(X[e], ns[e], H, H, 1.0);
    }
    for (int ti = 0; ti < n_tables; ti++)
        for (int a = 0; a < 2; a++) {
            const moe_cpu_kernels *k = tables[ti];
            moe_act_prec act = a ? MOE_ACT_BF16 : MOE_ACT_EXACT;
            if (a && !k->gemm_bf16act) continue;
            moe_expert_job jobs[NJ];
            for (int e = 0; e < NJ; e++) jobs[e] = (moe_expert_job){&w[e][0].w, &w[e][1].w, &w[e][2].w, X[e], Y0[e], ns[e]};
            size_t b = moe_experts_fast_scratch(k, act, jobs, NJ, 1);
            void *scr = aligned_alloc(64, (b + 63) & ~(size_t)63);
            moe_experts_fast(k, 0.05, act, jobs, NJ, scr, 1);
            free(scr);
            static const int nths[] = {2, 3, 5, 8, 16};
            for (int q = 0; q < 5; q++) {
                for (int e = 0; e < NJ; e++) jobs[e].Y = Y[e];
                b = moe_experts_fast_scratch(k, act, jobs, NJ, nths[q]);
                scr = aligned_alloc(64, (b + 63) & ~(size_t)63);
                moe_experts_fast(k, 0.05, act, jobs, NJ, scr, nths[q]);
                free(scr);
                int same = 1;
                for (int e = 0; e < NJ; e++) same &= memcmp(Y[e], Y0[e], (size_t)(ns[e] * H) * 4) == 0;
                CHECK(same, "%s act %s: %d threads differ from 1", k->isa, a ? "bf16" : "f32", nths[q]);
            }
            for (int e = 0; e < NJ; e++) {
                if (!ns[e]) continue;
                memset(Y[e], 0xFF, (size_t)(ns[e] * H) * 4);
                expert_fast(k, &w[e][0].w, &w[e][1].w, &w[e][2].w, 0.05, act, X[e], ns[e], Y[e]);
                CHECK(!memcmp(Y[e], Y0[e], (size_t)(ns[e] * H) * 4), "%s act %s: job %d alone differs", k->isa,
                      a ? "bf16" : "f32", e);
            }
        }
    for (int e = 0; e < NJ; e++) {
        for (int m = 0; m < 3; m++) tw_free(&w[e][m]);
        free(X[e]);
        free(Y0[e]);
        free(Y[e]);
    }
}

/* The AVX-512 f32 kernels' paired E2M1 decode (gemm_avx512.c, pair_step)
 * against the same file built with single steps (avx512_single_kernel.c):
 * bit for bit, MXFP4 and NVFP4, 1 to 9 tokens (paired tiles of 1-2 tokens
 * beside single ones of 3-4), an odd chunk count and (NVFP4) a 16-column
 * edge chunk, row ranges starting at an odd row (1-row tiles), E8M0 scale
 * codes 0, 1, 254, 255 and UE4M3 0 and subnormal among random ones,
 * activations with huge, subnormal, Inf and NaN values. */
const moe_cpu_kernels *moe_cpu_avx512_single_table(bool bf16);
static void test_avx512_pairs(void) {
    moe_error err;
    const moe_cpu_kernels *k;
    if (moe_cpu_table(MOE_ISA_AVX512, &k, &err) != MOE_OK) {
        fprintf(stderr, "note: %s: the paired E2M1 decode not compared\n", err.msg);
        return;
    }
    const moe_cpu_kernels *k1 = moe_cpu_avx512_single_table(false);
    for (int f = 0; f < 2; f++) {
        moe_wfmt fmt = f ? MOE_WFMT_NVFP4 : MOE_WFMT_MXFP4;
        int64_t rows = 37, cols = f ? 32 * 67 + 16 : 32 * 67;
        test_weight tw;
        tw_make(&tw, fmt, true, rows, cols);
        uint8_t *sc = tw.scale;
        static const uint8_t mx_edge[] = {0, 1, 254, 255}, nv_edge[] = {0, 1, 0x7E, 0x80};
        for (int i = 0; i < 4; i++) sc[(size_t)(i * 7 + 3) * (size_t)tw.w.scale_cols + (size_t)i] = f ? nv_edge[i] : mx_edge[i];
        for (int64_t n = 1; n <= 9; n++) {
            float *X = malloc((size_t)(n * cols) * 4), *Y = malloc((size_t)(n * rows) * 4),
                  *Y1 = malloc((size_t)(n * rows) * 4);
            fill_x(X, n, cols, cols, 1.0);
            X[5] = 1e30f;
            X[(n - 1) * cols + 7] = 1e-42f; /* subnormal */
            if (n > 2) X[2 * cols + 40] = INFINITY;
            if (n > 3) X[3 * cols + 99] = NAN;
            memset(Y, 0, (size_t)(n * rows) * 4);
            memset(Y1, 0, (size_t)(n * rows) * 4);
            k->gemm(&tw.w, 1, rows, X, cols, n, Y, rows);
            k1->gemm(&tw.w, 1, rows, X, cols, n, Y1, rows);
            CHECK(memcmp(Y, Y1, (size_t)(n * rows) * 4) == 0, "%s n=%lld: paired E2M1 tiles differ from single steps",
                  fmt_name(fmt, true), (long long)n);
            free(X);
            free(Y);
            free(Y1);
        }
        tw_free(&tw);
    }
}

/* A routed block through moe_experts_fast: T tokens, each to K distinct
 * experts of E drawn with a skew (expert e about 1 / (e + 1) as likely: a
 * few experts hold many tokens, most one or none, as at T <= 128 in
 * V4-Flash), MXFP4 weights; every job's outputs against the float64 expert
 * (expert_ref64's propagated bound), and the same bits on 2, 3 and 16
 * threads as on 1; every output written (Y poisoned first). T = 1, 3, 17,
 * 129: 1 to 129 tokens per call, none a multiple of the kernels' tiles. */
static void test_experts_block(void) {
    enum { E = 12, K = 4, NT = 4 };
    static const int64_t Ts[NT] = {1, 3, 17, 129};
    static const int nths[] = {1, 2, 3, 16};
    const int64_t H = 256, I = 384;
    test_weight w[E][3];
    double *W[E][3];
    for (int e = 0; e < E; e++)
        for (int m = 0; m < 3; m++) {
            tw_make(&w[e][m], MOE_WFMT_MXFP4, true, m < 2 ? I : H, m < 2 ? H : I);
            W[e][m] = dense_f64(&w[e][m].w);
        }
    for (int ti = 0; ti < NT; ti++) {
        int64_t T = Ts[ti];
        double L = ti % 2 ? 0.05 : 0.0;
        /* routing: K distinct experts per token, P(e) ~ 1 / (e + 1) */
        int64_t cnt[E] = {0};
        int32_t *ids = malloc((size_t)(T * K) * 4);
        for (int64_t t = 0; t < T; t++)
            for (int j = 0; j < K; j++) {
                int32_t e;
                bool dup;
                do {
                    double u = moe_t_rng_unif(&rng_state), acc = 0, tot = 0;
                    for (int q = 0; q < E; q++) tot += 1.0 / (q + 1);
                    for (e = 0; e < E - 1; e++) {
                        acc += 1.0 / (e + 1) / tot;
                        if (u < acc) break;
                    }
                    dup = false;
                    for (int q = 0; q < j; q++) dup |= ids[t * K + q] == e;
                } while (dup);
                ids[t * K + j] = e;
                cnt[e]++;
            }
        for (int a = 0; a < 2; a++) {
            bool bf16 = a == 1;
            moe_act_prec act = bf16 ? MOE_ACT_BF16 : MOE_ACT_EXACT;
            /* each expert's gathered rows: token t's activations, in token order */
            float *X[E], *Y[E], *Y1[E];
            double *Yr[E], *B[E];
            for (int e = 0; e < E; e++) {
                size_t n = (size_t)(cnt[e] * H) + 1;
                X[e] = malloc(n * 4);
                Y[e] = malloc(n * 4);
                Y1[e] = malloc(n * 4);
                Yr[e] = malloc(n * 8);
                B[e] = malloc(n * 8);
            }
            float *Xt = malloc((size_t)(T * H) * 4);
            if (bf16) fill_x_bf16(Xt, T, H, H, 1.0);
            else fill_x(Xt, T, H, H, 1.0);
            int64_t at[E] = {0};
            for (int64_t q = 0; q < T * K; q++) {
                int e = ids[q];
                memcpy(X[e] + at[e]++ * H, Xt + (q / K) * H, (size_t)H * 4);
            }
            for (int e = 0; e < E; e++)
                if (cnt[e]) expert_ref64(W[e][0], W[e][1], W[e][2], H, I, L, bf16, X[e], cnt[e], Yr[e], B[e]);
            for (int tb = 0; tb < n_tables; tb++) {
                const moe_cpu_kernels *k = tables[tb];
                if (bf16 && !k->gemm_bf16act) continue;
                if (!strcmp(k->isa, "ref") && T > 17) continue; /* the scalar kernels: the split is the same code */
                moe_expert_job jobs[E];
                for (int q = 0; q < 4; q++) {
                    for (int e = 0; e < E; e++) {
                        float *y = q ? Y[e] : Y1[e];
                        memset(y, 0xFF, (size_t)(cnt[e] * H) * 4); /* NaN: an output never written stays NaN */
                        jobs[e] = (moe_expert_job){&w[e][0].w, &w[e][1].w, &w[e][2].w, X[e], y, cnt[e]};
                    }
                    size_t b = moe_experts_fast_scratch(k, act, jobs, E, nths[q]);
                    void *scr = aligned_alloc(64, (b + 63) & ~(size_t)63);
                    moe_experts_fast(k, L, act, jobs, E, scr, nths[q]);
                    free(scr);
                    if (q == 0) {
                        int bad = 0;
                        for (int e = 0; e < E; e++)
                            for (int64_t i = 0; i < cnt[e] * H; i++) {
                                double err = fabs(Y1[e][i] - Yr[e][i]);
                                if (!(err <= B[e][i]) && bad++ < 3)
                                    fprintf(stderr, "  block %s act %s T=%lld: expert %d out %lld got %.9g want %.9g bound %.3g\n",
                                            k->isa, bf16 ? "bf16" : "f32", (long long)T, e, (long long)i, Y1[e][i],
                                            Yr[e][i], B[e][i]);
                            }
                        CHECK(bad == 0, "block %s act %s T=%lld: %d outputs beyond the float64 bound", k->isa,
                              bf16 ? "bf16" : "f32", (long long)T, bad);
                    } else {
                        int same = 1;
                        for (int e = 0; e < E; e++) same &= memcmp(Y[e], Y1[e], (size_t)(cnt[e] * H) * 4) == 0;
                        CHECK(same, "block %s act %s T=%lld: %d threads differ from 1", k->isa, bf16 ? "bf16" : "f32",
                              (long long)T, nths[q]);
                    }
                }
            }
            for (int e = 0; e < E; e++) {
                free(X[e]);
                free(Y[e]);
                free(Y1[e]);
                free(Yr[e]);
                free(B[e]);
            }
            free(Xt);
        }
        free(ids);
    }
    for (int e = 0; e < E; e++)
        for (int m = 0; m < 3; m++) {
            tw_free(&w[e][m]);
            free(W[e][m]);
        }
}

/* The split itself (experts_fast.c invariant 4), seen through a table whose
 * kernels only record who ran which rows (no arithmetic: the weights are
 * bare descriptors, so V4-Flash's shapes cost nothing): every row of every
 * weight run exactly once, by one call per (thread, weight); at T = 1 (6
 * experts of one token) 16 threads get equal rows, exactly 768 of gate and
 * of up and 1536 of down each; with skewed token counts (T = 16 and 128
 * drawn as in V4-Flash) every thread works in both phases, and no thread's
 * streamed weight rows fall below half or rise above twice the mean. */
enum { SPLIT_MAXTH = 16, SPLIT_MAXCALLS = 4096 };
typedef struct split_call {
    const moe_weight *w;
    int64_t r0, r1;
} split_call;
static split_call split_calls[SPLIT_MAXTH][SPLIT_MAXCALLS];
static int split_ncalls[SPLIT_MAXTH];

static void split_record(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx, int64_t n,
                         float *Y, int64_t ldy) {
    (void)X;
    (void)ldx;
    int t = 0;
#ifdef _OPENMP
    t = omp_get_thread_num();
#endif
    MOE_ASSERT(t < SPLIT_MAXTH && split_ncalls[t] < SPLIT_MAXCALLS);
    split_calls[t][split_ncalls[t]++] = (split_call){w, r0, r1};
    for (int64_t i = 0; i < n; i++)
        for (int64_t j = 0; j < r1 - r0; j++) Y[i * ldy + j] = 0.0f;
}

/* cnt [E]: tokens per expert when each of T tokens picks K (<= 6) distinct
 * uniform experts, as the bench draws them. */
static void draw_counts(int64_t *cnt, int64_t E, int64_t T, int64_t K) {
    memset(cnt, 0, (size_t)E * sizeof *cnt);
    int64_t got[6];
    for (int64_t t = 0; t < T; t++)
        for (int64_t j = 0; j < K; j++) {
            int64_t e;
            bool dup;
            do {
                e = (int64_t)(rnd() % (uint64_t)E);
                dup = false;
                for (int64_t z = 0; z < j; z++) dup |= got[z] == e;
            } while (dup);
            got[j] = e;
            cnt[e]++;
        }
}

static void test_experts_split(void) {
#ifndef _OPENMP
    fprintf(stderr, "note: no OpenMP: the split test needs threads, skipped\n");
#else
    const int64_t H = 4096, I = 2048, E = 256, K = 6;
    moe_weight *ws = calloc((size_t)(3 * E), sizeof *ws);
    for (int64_t e = 0; e < 3 * E; e++) {
        ws[e].fmt = MOE_WFMT_MXFP4;
        ws[e].rows = e % 3 < 2 ? I : H;
        ws[e].cols = e % 3 < 2 ? H : I;
        ws[e].name = "split";
    }
    moe_cpu_kernels rec = {"test", split_record, NULL, NULL, NULL};
    static const int64_t Ts[] = {1, 16, 128};
    static const int nths[] = {2, 3, 16};
    int64_t *cnt = calloc((size_t)E, sizeof *cnt);
    moe_expert_job *jobs = calloc((size_t)E, sizeof *jobs);
    float *X = calloc((size_t)(128 * K * H), 4), *Yb = calloc((size_t)(128 * K * H), 4);
    int64_t *covered = calloc((size_t)(3 * E), sizeof *covered);
    int n_static = 0, n_claimed = 0;
    for (int ti = 0; ti < 3; ti++)
        for (int q = 0; q < 3; q++) {
            int64_t T = Ts[ti];
            int nth = nths[q];
            draw_counts(cnt, E, T, K);
            int nj = 0;
            int64_t off = 0;
            for (int64_t e = 0; e < E; e++)
                if (cnt[e]) {
                    jobs[nj++] = (moe_expert_job){&ws[3 * e], &ws[3 * e + 1], &ws[3 * e + 2], X + off * H, Yb + off * H,
                                                  cnt[e]};
                    off += cnt[e];
                }
            memset(split_ncalls, 0, sizeof split_ncalls);
            size_t b = moe_experts_fast_scratch(&rec, MOE_ACT_EXACT, jobs, nj, nth);
            void *scr = aligned_alloc(64, (b + 63) & ~(size_t)63);
            moe_experts_fast(&rec, 0.0, MOE_ACT_EXACT, jobs, nj, scr, nth);
            free(scr);
            /* coverage: each weight's rows exactly once, one call per (thread, weight) */
            memset(covered, 0, (size_t)(3 * E) * sizeof *covered);
            int dup_calls = 0, overlap = 0, idle = 0;
            double rows_th[2][SPLIT_MAXTH] = {{0}};
            for (int t = 0; t < nth; t++) {
                bool ph[2] = {false, false};
                for (int c = 0; c < split_ncalls[t]; c++) {
                    const split_call *sc = &split_calls[t][c];
                    int64_t wi = sc->w - ws;
                    covered[wi] += sc->r1 - sc->r0;
                    for (int d = 0; d < c; d++) {
                        const split_call *o = &split_calls[t][d];
                        dup_calls += o->w == sc->w;
                    }
                    for (int u = 0; u < nth; u++) /* no other thread's call overlaps this one */
                        for (int d = 0; d < (u == t ? 0 : split_ncalls[u]); d++) {
                            const split_call *o = &split_calls[u][d];
                            overlap += o->w == sc->w && o->r0 < sc->r1 && sc->r0 < o->r1;
                        }
                    int p = wi % 3 == 2;
                    ph[p] = true;
                    rows_th[p][t] += (double)(sc->r1 - sc->r0) * (double)sc->w->cols;
                }
                idle += !ph[0] || !ph[1];
            }
            int wrong = 0;
            for (int64_t wi = 0; wi < 3 * E; wi++) wrong += covered[wi] != (cnt[wi / 3] ? ws[wi].rows : 0);
            CHECK(wrong == 0 && overlap == 0, "split T=%lld %d threads: %d weights not covered exactly once, %d overlaps",
                  (long long)T, nth, wrong, overlap);
            /* from 4 threads the default policy draws claimed chunks
             * (invariant 5): which thread takes what then depends on
             * timing, and test_experts_claim_split checks the chunks; the
             * static split's own properties below (2 and 3 threads) */
            const bool claimed = moe_experts_fast_claims(&rec, MOE_ACT_EXACT, nj, nth);
            CHECK(nth >= 4 || !claimed, "split T=%lld %d threads: claimed chunks below 4 threads", (long long)T, nth);
            if (claimed) {
                n_claimed++;
                continue;
            }
            n_static++;
            CHECK(dup_calls == 0, "split T=%lld %d threads: %d repeated calls on one weight by one thread", (long long)T,
                  nth, dup_calls);
            CHECK(idle == 0, "split T=%lld %d threads: %d threads idle in a phase", (long long)T, nth, idle);
            for (int p = 0; p < 2; p++) {
                double mean = 0, mx = 0, mn = 1e300;
                for (int t = 0; t < nth; t++) {
                    mean += rows_th[p][t] / nth;
                    mx = fmax(mx, rows_th[p][t]);
                    mn = fmin(mn, rows_th[p][t]);
                }
                CHECK(mx <= 2 * mean && mn >= 0.5 * mean, "split T=%lld %d threads phase %d: weights per thread %.3g .. %.3g, mean %.3g",
                      (long long)T, nth, p + 1, mn, mx, mean);
            }
        }
    fprintf(stderr, "note: split: %d cases on the static split, %d on claimed chunks (coverage only)\n", n_static,
            n_claimed);
    free(ws);
    free(cnt);
    free(jobs);
    free(X);
    free(Yb);
    free(covered);
    omp_set_num_threads(omp_get_num_procs());
#endif
}

/* The claimed chunks (experts_fast.c invariant 5) through a recording table
 * named "amx" with a bf16-activation entry: V4-Flash shapes, T = 128 and
 * 1024 drawn as in the bench (about 250-256 experts with tokens), 2, 3 and
 * 16 threads. Every row of every weight is run exactly once; each of the
 * jobs before the last 2 nthreads is one call per weight covering all its
 * rows (the static split would cut some at thread boundaries: the test
 * fails on it), and each of the last ones at most 4 calls per weight. */
static void split_record_ws(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx, int64_t n,
                            float *Y, int64_t ldy, void *ws) {
    (void)ws;
    split_record(w, r0, r1, X, ldx, n, Y, ldy);
}
static size_t split_no_ws(const moe_weight *w, int64_t n) { return (void)w, (void)n, 0; }

static void test_experts_claim_split(void) {
#ifndef _OPENMP
    fprintf(stderr, "note: no OpenMP: the claimed-chunk test needs threads, skipped\n");
#else
    const int64_t H = 4096, I = 2048, E = 256, K = 6;
    moe_weight *ws = calloc((size_t)(3 * E), sizeof *ws);
    for (int64_t e = 0; e < 3 * E; e++) {
        ws[e].fmt = MOE_WFMT_MXFP4;
        ws[e].rows = e % 3 < 2 ? I : H;
        ws[e].cols = e % 3 < 2 ? H : I;
        ws[e].name = "claim";
    }
    /* the amx table with bf16 activations (claims from 2 threads), then a
     * table without a bf16 entry, f32 activations (from 4 threads) */
    const moe_cpu_kernels recs[2] = {{"amx", split_record, split_record_ws, split_no_ws, NULL},
                                     {"test", split_record, NULL, NULL, NULL}};
    const moe_act_prec acts[2] = {MOE_ACT_BF16, MOE_ACT_EXACT};
    /* the f32 table also at few tokens: T = 1 (6 jobs) and 16 */
    static const int64_t Ts[2][4] = {{128, 1024, 0, 0}, {1, 16, 128, 1024}};
    static const int nts[2] = {2, 4};
    static const int nths[] = {2, 3, 16};
    int64_t *cnt = calloc((size_t)E, sizeof *cnt), *covered = calloc((size_t)(3 * E), sizeof *covered);
    int *calls = calloc((size_t)(3 * E), sizeof *calls);
    moe_expert_job *jobs = calloc((size_t)E, sizeof *jobs);
    float *X = calloc((size_t)(128 * K * H), 4), *Yb = calloc((size_t)(128 * K * H), 4);
    for (int tb = 0; tb < 2; tb++)
    for (int ti = 0; ti < nts[tb]; ti++)
        for (int q = 0; q < 3; q++) {
            const moe_cpu_kernels rec = recs[tb];
            const moe_act_prec act = acts[tb];
            int64_t T = Ts[tb][ti];
            int nth = nths[q];
            if (tb == 1 && nth < 4) continue; /* the static split: test_experts_split */
            draw_counts(cnt, E, T, K);
            /* the kernels write nothing: every job may share one X and Y
             * (the recording kernel zeroes Y rows of at most n tokens) */
            int nj = 0;
            int64_t nmax = 0;
            for (int64_t e = 0; e < E; e++)
                if (cnt[e]) {
                    jobs[nj++] = (moe_expert_job){&ws[3 * e], &ws[3 * e + 1], &ws[3 * e + 2], X, Yb, cnt[e]};
                    nmax = cnt[e] > nmax ? cnt[e] : nmax;
                }
            CHECK(nmax <= 128 * K && (T < 128 || nj >= 4 * nth), "claim T=%lld: %d jobs, at most %lld tokens",
                  (long long)T, nj, (long long)nmax);
            CHECK(moe_experts_fast_claims(&rec, act, nj, nth), "claim %s T=%lld %d threads: the static split runs",
                  rec.isa, (long long)T, nth);
            /* pieces of a tail job: 4, or more when there are fewer than 4
             * jobs per thread (about 4 chunks per thread), at most its units */
            const int few = (4 * nth + nj - 1) / nj, tailp = few > 4 ? few : 4;
            memset(split_ncalls, 0, sizeof split_ncalls);
            size_t b = moe_experts_fast_scratch(&rec, act, jobs, nj, nth);
            void *scr = aligned_alloc(64, (b + 63) & ~(size_t)63);
            moe_experts_fast(&rec, 0.0, act, jobs, nj, scr, nth);
            free(scr);
            memset(covered, 0, (size_t)(3 * E) * sizeof *covered);
            memset(calls, 0, (size_t)(3 * E) * sizeof *calls);
            int overlap = 0;
            for (int t = 0; t < nth; t++)
                for (int c = 0; c < split_ncalls[t]; c++) {
                    const split_call *sc = &split_calls[t][c];
                    int64_t wi = sc->w - ws;
                    covered[wi] += sc->r1 - sc->r0;
                    calls[wi]++;
                    for (int u = 0; u < nth; u++)
                        for (int d = 0; d < split_ncalls[u]; d++) {
                            const split_call *o = &split_calls[u][d];
                            overlap += (u != t || d != c) && o->w == sc->w && o->r0 < sc->r1 && sc->r0 < o->r1;
                        }
                }
            int wrong = 0, split_head = 0, split_tail = 0;
            for (int64_t wi = 0, qj = -1; wi < 3 * E; wi++) {
                if (wi % 3 == 0 && cnt[wi / 3]) qj++;
                wrong += covered[wi] != (cnt[wi / 3] ? ws[wi].rows : 0);
                if (!cnt[wi / 3]) continue;
                const int units = (int)(wi % 3 < 2 ? I / 128 : H / 64);
                if (qj < nj - 2 * nth) split_head += calls[wi] != 1;
                else split_tail += calls[wi] != (units < tailp ? units : tailp);
            }
            CHECK(wrong == 0 && overlap == 0, "claim %s T=%lld %d threads: %d weights not covered exactly once, %d overlaps",
                  rec.isa, (long long)T, nth, wrong, overlap);
            CHECK(split_head == 0 && split_tail == 0,
                  "claim %s T=%lld %d threads: %d head weights not in one call, %d tail weights not in %d pieces",
                  rec.isa, (long long)T, nth, split_head, split_tail, tailp);
        }
    free(ws);
    free(cnt);
    free(covered);
    free(calls);
    free(jobs);
    free(X);
    free(Yb);
#endif
}

/* Same bits, or both NaN (the NaN payload of two NaN operands is not part
 * of the contract, cpu/kernels.h). */
static bool same_f32(float a, float b) {
    uint32_t x, y;
    memcpy(&x, &a, 4);
    memcpy(&y, &b, 4);
    return x == y || (isnan(a) && isnan(b));
}

/* Adversarial SwiGLU operands: specials, subnormals, the clamp limit and its
 * neighbours, the exp's overflow / underflow boundaries (in -g), huge |g|,
 * values near the Cody-Waite rounding cuts ((k + 1/2) ln 2), random. */
static float swiglu_operand(uint64_t r, float L) {
    static const float fixed[] = {0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 0x1p-149f, -0x1p-149f, 0x1.fffffcp-127f,
                                  -0x1p-126f, 1.0f, -1.0f, 0x1.fffffep127f, -0x1.fffffep127f, 1e30f, -1e30f,
                                  MOE_EXPF_HI, -MOE_EXPF_HI, MOE_EXPF_LO, -MOE_EXPF_LO, 88.7228394f, -88.7228394f,
                                  103.972084f, -103.972084f, 87.3365479f, -87.3365479f, 100.0f, -100.0f, 0.3465736f,
                                  -0.3465736f, 1.0397208f, 20.0f, -20.0f};
    int nf = (int)(sizeof fixed / sizeof fixed[0]);
    int which = (int)(r % 8);
    r >>= 3;
    float v;
    switch (which) {
    case 0: return fixed[r % (uint64_t)nf];
    case 1: v = L; break; /* the clamp limit and its neighbours */
    case 2: {            /* around (k + 1/2) ln 2: n's rounding cut */
        int k = (int)(r % 300) - 150;
        v = (float)(((double)k + 0.5) * 0.69314718055994531);
        break;
    }
    case 3: { /* any bit pattern */
        uint32_t b = (uint32_t)(r >> 7);
        memcpy(&v, &b, 4);
        return v;
    }
    case 4: v = (float)((moe_t_rng_unif(&rng_state) * 2.0 - 1.0) * 110.0); break; /* the exp's finite range */
    default: return (float)(moe_t_rng_normal(&rng_state) * 4.0);                   /* typical gate values */
    }
    /* a few ulps either side, either sign */
    uint32_t b;
    memcpy(&b, &v, 4);
    b += (uint32_t)((int)(r % 7) - 3);
    memcpy(&v, &b, 4);
    return (r >> 20) & 1 ? -v : v;
}

/* Every table's swiglu gives moe_swiglu_f32's bits element for element, for
 * every n (tails of 1..15 and 1..7) and offset, with and without the clamp;
 * moe_swiglu_f32 itself is checked against the clamp's NaN rule. */
static void test_swiglu_tables(void) {
    enum { N = 4096 + 37 };
    float *g = malloc(N * 4), *u = malloc(N * 4), *want = malloc(N * 4), *got = malloc(N * 4);
    static const float limits[] = {0.0f, 7.0f, 0x1p-140f, NAN, -1.0f};
    for (int li = 0; li < 5; li++) {
        float L = limits[li];
        for (int i = 0; i < N; i++) {
            g[i] = swiglu_operand(rnd(), L);
            u[i] = swiglu_operand(rnd(), L);
        }
        for (int i = 0; i < N; i++) want[i] = moe_swiglu_f32(g[i], u[i], L);
        for (int ti = 0; ti < n_tables; ti++) {
            moe_swiglu_fn f = moe_cpu_swiglu(tables[ti]);
            CHECK(tables[ti]->swiglu != NULL, "%s table has a swiglu entry", tables[ti]->isa);
            /* the whole row, then short rows at every offset (T not a multiple of 8 / 16) */
            memcpy(got, g, N * 4);
            f(got, u, N, L);
            int bad = 0;
            for (int i = 0; i < N; i++)
                if (!same_f32(got[i], want[i]) && bad++ < 3)
                    fprintf(stderr, "  swiglu %s L=%a: g=%a u=%a got %a want %a\n", tables[ti]->isa, (double)L,
                            (double)g[i], (double)u[i], (double)got[i], (double)want[i]);
            for (int n = 0; n <= 40; n++)
                for (int off = 0; off < 17; off += 3) {
                    memcpy(got, g, N * 4);
                    f(got + off, u + off, n, L);
                    for (int i = 0; i < 64; i++) {
                        float w = i >= off && i < off + n ? want[i] : g[i]; /* nothing outside [off, off + n) written */
                        if (!same_f32(got[i], w) && bad++ < 3)
                            fprintf(stderr, "  swiglu %s n=%d off=%d i=%d: got %a want %a\n", tables[ti]->isa, n, off,
                                    i, (double)got[i], (double)w);
                    }
                }
            CHECK(bad == 0, "%s swiglu L=%a: %d elements differ from moe_swiglu_f32", tables[ti]->isa, (double)L, bad);
        }
    }
    /* the definition's special cases */
    CHECK(isnan(moe_swiglu_f32(NAN, 1.0f, 7.0f)) && isnan(moe_swiglu_f32(1.0f, NAN, 7.0f)), "NaN passes the clamp");
    CHECK(moe_swiglu_f32(100.0f, 100.0f, 7.0f) == 7.0f / (1.0f + moe_expf_f32(-7.0f)) * 7.0f, "clamp at L");
    CHECK(moe_swiglu_f32(1.0f, -100.0f, 7.0f) == 1.0f / (1.0f + moe_expf_f32(-1.0f)) * -7.0f, "clamp at -L");
    CHECK(moe_swiglu_f32(-100.0f, 1.0f, 7.0f) == -100.0f / (1.0f + moe_expf_f32(100.0f)), "gate not clamped below");
    float z = moe_swiglu_f32(-200.0f, 1.0f, 0.0f);
    CHECK(z == 0.0f && signbit(z), "silu(-200) = -0 (exp overflows to Inf): %a", (double)z);
    CHECK(moe_swiglu_f32(INFINITY, 2.0f, 0.0f) == INFINITY, "silu(+Inf) * 2 = +Inf");
    CHECK(isnan(moe_swiglu_f32(-INFINITY, 2.0f, 0.0f)), "silu(-Inf) = -Inf / Inf = NaN");
    free(g);
    free(u);
    free(want);
    free(got);
}

/* The SIMD exps against moe_expf_f32, bit for bit, over every float at a
 * stride (MOE_EXPF_EXHAUSTIVE=1 in the environment: all 2^32 of them;
 * docs/formats.md records that run). */
static void test_expf_simd_sweep(void) {
    const moe_cpu_features *f = moe_cpu_get_features();
    const char *ex = getenv("MOE_EXPF_EXHAUSTIVE");
    uint64_t stride = ex && ex[0] == '1' ? 1 : 251;
    enum { B = 4096 };
    float *x = malloc(B * 4), *want = malloc(B * 4), *y = malloc(B * 4);
    bool have2 = f->os_avx && f->avx2, have512 = f->os_avx512 && f->avx512f;
    if (!have2) fprintf(stderr, "note: no AVX2: the avx2 exp is not swept\n");
    if (!have512) fprintf(stderr, "note: no AVX-512F: the avx512 exp is not swept\n");
    uint64_t bad2 = 0, bad512 = 0, count = 0;
    for (uint64_t b0 = 0; b0 < (1ull << 32); b0 += stride * B) {
        int m = 0;
        for (uint64_t b = b0; m < B && b < (1ull << 32); b += stride, m++) {
            uint32_t bits = (uint32_t)b;
            memcpy(&x[m], &bits, 4);
            want[m] = moe_expf_f32(x[m]);
        }
        count += (uint64_t)m;
        if (have2) {
            moe_cpu_avx2_expf(x, y, m);
            for (int i = 0; i < m; i++)
                if (!same_f32(y[i], want[i]) && bad2++ < 3)
                    fprintf(stderr, "  avx2 exp(%a) = %a, scalar %a\n", (double)x[i], (double)y[i], (double)want[i]);
        }
        if (have512) {
            moe_cpu_avx512_expf(x, y, m);
            for (int i = 0; i < m; i++)
                if (!same_f32(y[i], want[i]) && bad512++ < 3)
                    fprintf(stderr, "  avx512 exp(%a) = %a, scalar %a\n", (double)x[i], (double)y[i], (double)want[i]);
        }
    }
    if (stride == 1) fprintf(stderr, "note: exhaustive exp sweep: %llu floats\n", (unsigned long long)count);
    CHECK(bad2 == 0, "avx2 exp differs from moe_expf_f32 on %llu of %llu floats", (unsigned long long)bad2,
          (unsigned long long)count);
    CHECK(bad512 == 0, "avx512 exp differs from moe_expf_f32 on %llu of %llu floats", (unsigned long long)bad512,
          (unsigned long long)count);
    free(x);
    free(want);
    free(y);
}

int main(void) {
    init_tables();
    init_bf_tables();
    RUN(test_select);
    RUN(test_element_decoder);
    RUN(test_formats_vs_f64);
    RUN(test_determinism);
    RUN(test_adversarial);
    RUN(test_e2m1_every_code);
    RUN(test_bf16act_vs_f64);
    RUN(test_bf16act_determinism);
    RUN(test_row_spread);
    RUN(test_bf16act_adversarial);
    RUN(test_bf16act_wide);
    RUN(test_amx_model);
    RUN(test_amx_probe);
    RUN(test_swiglu_tables);
    RUN(test_expf_simd_sweep);
    RUN(test_expert_fast);
    RUN(test_expert_fast_bf16act);
    RUN(test_expert_nested);
    RUN(test_experts_threads);
    RUN(test_avx512_pairs);
    RUN(test_experts_block);
    RUN(test_experts_split);
    RUN(test_experts_claim_split);
    return moe_t_finish();
}
