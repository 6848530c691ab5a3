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
 *   expert_ref64): |silu'| <= 1.1, and expf plus the activation's four float
 *   operations add 8 u |a|.
 */
#include "cpu/cpu_internal.h"
#include "experts/experts.h"
#include "experts/experts_fast.h"
#include "harness.h"
#include "core/core.h"
#include "moe_formats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define U24 0x1p-24
#define TOL_DOT(m, S) (((double)(m) + 2.0) * U24 * (S) + ((double)(m) + 2.0) * 0x1p-149)

static uint64_t rng_state = 0x9E3779B97F4A7C15ull;
static uint64_t rnd(void) {
    return moe_splitmix64(&rng_state);
}
static double rndu(void) { return (double)(rnd() >> 11) * 0x1p-53 * 2.0 - 1.0; } /* [-1, 1) */

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

/* Row r as exact float64 values: the definition (io/weights.c). */
static void row_f64(const moe_weight *w, int64_t r, double *out) { moe_weight_row_f64(w, r, out); }

/* The active-capable tables: ref always, avx2 and avx512 when the CPU has
 * them (the last one is the widest). */
static const moe_cpu_kernels *tables[4];
static int n_tables;

static void init_tables(void) {
    tables[n_tables++] = moe_cpu_ref();
    static const char *const simd[] = {"avx2", "avx512"};
    for (int i = 0; i < 2; i++) {
        moe_error err;
        if (moe_cpu_select(simd[i], &err) == MOE_OK) tables[n_tables++] = moe_cpu_active();
        else fprintf(stderr, "note: %s: %s kernels not tested\n", err.msg, simd[i]);
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
            static const int64_t splits[] = {1, 4, 8, 13, 36};
            for (int s = 0; s < 5; s++) {
                int64_t r = splits[s];
                memset(Y2, 0xFF, (size_t)(n * rows) * 4);
                k->gemm(&tw.w, 0, r, X, cols, n, Y2, rows);
                k->gemm(&tw.w, r, rows, X, cols, n, Y2 + r, rows);
                CHECK(memcmp(Y, Y2, (size_t)(n * rows) * 4) == 0, "%s %s: split at row %lld differs", k->isa,
                      fmt_name(all_fmts[f], all_e8[f]), (long long)r);
            }
            /* each token alone, and tokens in groups of 3 starting at 1 */
            memset(Y2, 0xFF, (size_t)(n * rows) * 4);
            for (int64_t t = 0; t < n; t++) k->gemm(&tw.w, 0, rows, X + t * cols, cols, 1, Y2 + t * rows, rows);
            CHECK(memcmp(Y, Y2, (size_t)(n * rows) * 4) == 0, "%s %s: token-alone differs", k->isa,
                  fmt_name(all_fmts[f], all_e8[f]));
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
            k->gemm(&tw.w, 0, rows, X, cols, n, Y0, rows);
            X[1 * cols + 77] = NAN;
            X[3 * cols + 5] = INFINITY;
            k->gemm(&tw.w, 0, rows, X, cols, n, Y, rows);
            int nan_ok = 1, inf_ok = 1, others_ok = 1;
            for (int64_t j = 0; j < rows; j++) {
                nan_ok &= isnan(Y[1 * rows + j]);
                inf_ok &= !isfinite(Y[3 * rows + j]);
                for (int64_t t = 0; t < n; t++)
                    if (t != 1 && t != 3) others_ok &= memcmp(&Y[t * rows + j], &Y0[t * rows + j], 4) == 0;
            }
            CHECK(nan_ok, "%s %s: NaN in token 1 not propagated to all its outputs", k->isa, fn);
            CHECK(inf_ok, "%s %s: Inf in token 3 not propagated", k->isa, fn);
            CHECK(others_ok, "%s %s: other tokens changed by a NaN/Inf neighbour", k->isa, fn);

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

/* float64 expert with per-output error bounds (see the header comment).
 * W1, W3: [I, H], W2: [H, I] exact values. Y, B: [n, H]. */
static void expert_ref64(const double *W1, const double *W3, const double *W2, int64_t H, int64_t I, double L,
                         const float *X, int64_t n, double *Y, double *B) {
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

static void test_expert_fast(void) {
    static const moe_wfmt fmts[] = {MOE_WFMT_BF16, MOE_WFMT_FP8_BLOCK, MOE_WFMT_MXFP4, MOE_WFMT_NVFP4};
    int64_t H = 256, I = 96, n = 7;
    for (int f = 0; f < 4; f++)
        for (int li = 0; li < 2; li++) {
            double L = li ? 0.05 : 0.0;
            test_weight t1, t3, t2;
            tw_make(&t1, fmts[f], true, I, H);
            tw_make(&t3, fmts[f], true, I, H);
            tw_make(&t2, fmts[f], true, H, I);
            double *W1 = dense_f64(&t1.w), *W3 = dense_f64(&t3.w), *W2 = dense_f64(&t2.w);
            float *X = malloc((size_t)(n * H) * 4);
            fill_x(X, n, H, H, 1.0);
            X[2 * H + 9] = NAN;
            double *Yr = malloc((size_t)(n * H) * 8), *B = malloc((size_t)(n * H) * 8);
            expert_ref64(W1, W3, W2, H, I, L, X, n, Yr, B);
            float *scratch = malloc(moe_expert_fast_scratch(H, I, n) * 4);
            float *Y1 = malloc((size_t)(n * H) * 4), *Y2 = malloc((size_t)(n * H) * 4);
            for (int ti = 0; ti < n_tables; ti++) {
                const moe_cpu_kernels *k = tables[ti];
#ifdef _OPENMP
                omp_set_num_threads(1);
#endif
                moe_expert_fast(k, &t1.w, &t3.w, &t2.w, L, MOE_ACT_EXACT, X, n, Y1, scratch);
#ifdef _OPENMP
                omp_set_num_threads(2);
#endif
                moe_expert_fast(k, &t1.w, &t3.w, &t2.w, L, MOE_ACT_EXACT, X, n, Y2, scratch);
                CHECK(memcmp(Y1, Y2, (size_t)(n * H) * 4) == 0, "%s %s L=%g: 1 and 2 threads differ", k->isa,
                      fmt_name(fmts[f], true), L);
                int bad = 0, nan_ok = 1;
                for (int64_t t = 0; t < n; t++)
                    for (int64_t h = 0; h < H; h++) {
                        if (t == 2) {
                            nan_ok &= isnan(Y1[t * H + h]);
                            continue;
                        }
                        double e = fabs(Y1[t * H + h] - Yr[t * H + h]);
                        if (!(e <= B[t * H + h]) && bad++ < 3)
                            fprintf(stderr, "  expert %s %s: tok %lld h %lld got %.9g want %.9g bound %.3g\n",
                                    k->isa, fmt_name(fmts[f], true), (long long)t, (long long)h, Y1[t * H + h],
                                    Yr[t * H + h], B[t * H + h]);
                    }
                CHECK(bad == 0, "%s %s L=%g: %d expert outputs beyond the propagated bound", k->isa,
                      fmt_name(fmts[f], true), L, bad);
                CHECK(nan_ok, "%s %s: NaN token not NaN in every output", k->isa, fmt_name(fmts[f], true));
                /* batch composition: token 4 alone equals its row in the batch */
                moe_expert_fast(k, &t1.w, &t3.w, &t2.w, L, MOE_ACT_EXACT, X + 4 * H, 1, Y2, scratch);
                CHECK(memcmp(Y1 + 4 * H, Y2, (size_t)H * 4) == 0, "%s %s: token alone differs", k->isa,
                      fmt_name(fmts[f], true));
            }
            if (fmts[f] == MOE_WFMT_BF16) {
                /* the ref table reproduces moe_expert_f32 bit for bit (same order) */
                float *sc = malloc(moe_expert_scratch(H, I, n) * 4);
                moe_expert_f32(&t1.w, &t3.w, &t2.w, L, MOE_ACT_EXACT, X, n, Y2, sc);
                moe_expert_fast(moe_cpu_ref(), &t1.w, &t3.w, &t2.w, L, MOE_ACT_EXACT, X, n, Y1, scratch);
                CHECK(memcmp(Y1, Y2, (size_t)(n * H) * 4) == 0, "ref table differs from moe_expert_f32");
                free(sc);
            }
            free(Y1);
            free(Y2);
            free(scratch);
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
                float v = moe_cpu_weight_f32(&tw.w, r, k);
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
                    float v = moe_cpu_weight_f32(&tw.w, r, k);
                    /* x = 1 at k, 0 elsewhere: Y = w[k] unless another
                     * element of the row is NaN/Inf (0 * Inf = NaN) */
                    if (!isfinite(v)) continue;
                    bool row_finite = true;
                    for (int64_t q = 0; q < cols; q++) row_finite &= isfinite(moe_cpu_weight_f32(&tw.w, r, q));
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
    float *sc0 = malloc(moe_expert_fast_scratch(H, I, n) * 4);
    moe_expert_fast(k, &t1.w, &t3.w, &t2.w, 0.0, MOE_ACT_EXACT, X, n, Y0, sc0);
    int same[3] = {0, 0, 0};
#ifdef _OPENMP
#pragma omp parallel num_threads(2)
#endif
    {
        int tid = 0;
#ifdef _OPENMP
        tid = omp_get_thread_num();
#endif
        float *sc = malloc(moe_expert_fast_scratch(H, I, n) * 4), *Y = malloc((size_t)(n * H) * 4);
        for (int rep = 0; rep < (tid == 0 ? 2 : 1); rep++) {
            moe_expert_fast(k, &t1.w, &t3.w, &t2.w, 0.0, MOE_ACT_EXACT, X, n, Y, sc);
            if (memcmp(Y, Y0, (size_t)(n * H) * 4) == 0) {
#ifdef _OPENMP
#pragma omp atomic
#endif
                same[tid == 0 ? rep : 2]++;
            }
        }
        free(sc);
        free(Y);
    }
#ifdef _OPENMP
    CHECK(same[0] == 1 && same[1] == 1 && same[2] == 1, "nested calls differ: %d %d %d", same[0], same[1], same[2]);
#else
    CHECK(same[0] == 1 && same[1] == 1, "repeat calls differ");
#endif
    free(X);
    free(Y0);
    free(sc0);
    tw_free(&t1);
    tw_free(&t3);
    tw_free(&t2);
}

static void test_select(void) {
    moe_error err;
    CHECK(moe_cpu_select("ref", &err) == MOE_OK, "%s", err.msg);
    CHECK(strcmp(moe_cpu_active()->isa, "ref") == 0, "active is %s", moe_cpu_active()->isa);
    const moe_cpu_features *f = moe_cpu_get_features();
    bool avx2 = f->os_avx && f->avx2 && f->fma && f->f16c;
    moe_status st = moe_cpu_select("avx2", &err);
    CHECK(st == (avx2 ? MOE_OK : MOE_ERR_UNSUPPORTED), "avx2 select: %s", moe_status_str(st));
    if (avx2) CHECK(strcmp(moe_cpu_active()->isa, "avx2") == 0, "active is %s", moe_cpu_active()->isa);
    CHECK(moe_cpu_select("ref", &err) == MOE_OK, "%s", err.msg);
    CHECK(moe_cpu_select("amx", &err) == MOE_ERR_UNSUPPORTED, "amx select should be unsupported here");
    CHECK(moe_cpu_select("sse9", &err) == MOE_ERR_ARG, "unknown isa accepted");
    CHECK(strcmp(moe_cpu_active()->isa, "ref") == 0, "failed select changed the table");
}

int main(void) {
    init_tables();
    RUN(test_select);
    RUN(test_element_decoder);
    RUN(test_formats_vs_f64);
    RUN(test_determinism);
    RUN(test_adversarial);
    RUN(test_expert_fast);
    RUN(test_expert_nested);
    return moe_t_finish();
}
