/*
 * moe_linear_f64 / moe_linear_f32 (src/linalg/linear.h): every weight format
 * built with the library's quantizers, shapes that are a multiple of no tile,
 * adversarial inputs, thread-count, batch-composition and ISA invariance.
 *
 * Oracles:
 *   exact   a float64 dot product in long double (64-bit significand) of the
 *           values moe_weight_row_f64 decodes (float32 rows: moe_weight_row_f32's
 *           values widened), written here, independent of the library's loops.
 *   model   the summation order linear.h promises, written here in scalar
 *           code: float64 s = fma(x, w, s) over k in index order from +0.0
 *           (bit for bit on every ISA); float32: the kernel table's gemm
 *           called once over all rows and tokens (bit for bit whatever the
 *           split into items and threads).
 *
 * Tolerances (S = sum_k |x_k w_k|, m = cols):
 *   TOL64(m, S) = (m + 1) * 2^-53 * S + (m + 1) * 2^-1074 + (m + 2) * 2^-63 * S
 *     The fma chain rounds once per term: |fl - exact| <= gamma_m S with
 *     gamma_m = m u / (1 - m u) <= (m + 1) u, u = 2^-53 (Higham, Accuracy and
 *     Stability, 3.1, with one rounding per step). Gradual underflow loses
 *     at most half a subnormal ulp (2^-1075) per rounding. The long-double
 *     oracle itself is within (m + 1) 2^-64 S (products and sums each round
 *     to 64 bits) of the exact value: counted with margin as (m + 2) 2^-63 S.
 *   TOL32(m, S) = (m + 2) * 2^-24 * S + (m + 2) * 2^-149
 *     A float32 dot product in any order with mul+add or fma (test-kernels.c
 *     TOL_DOT); the float32 weights are the oracle's too, so their own
 *     rounding (F64, FP8 with fp32 scales, NVFP4) is not counted.
 */
#include "harness.h"
#include "linalg/linalg_internal.h"
#include "linalg/gemm.h"
#include "linalg/linear.h"
#include "moe_formats.h"

#include <float.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define TOL64(m, S) \
    (((double)(m) + 1.0) * 0x1p-53 * (S) + ((double)(m) + 1.0) * 0x1p-1074 + ((double)(m) + 2.0) * 0x1p-63 * (S))
#define TOL32(m, S) (((double)(m) + 2.0) * 0x1p-24 * (S) + ((double)(m) + 2.0) * 0x1p-149)

static uint64_t rng = 0x5EED1234ABCDull;
static double rn(void) { return moe_t_rng_normal(&rng); }

/* ------------------------------------------------------------- weights */

typedef enum wkind { K_F64, K_F32, K_F16, K_BF16, K_FP8_F32, K_FP8_E8M0, K_MXFP4, K_NVFP4, K_COUNT } wkind;
static const char *const kind_name[K_COUNT] = {"f64", "f32", "f16", "bf16", "fp8-f32", "fp8-e8m0", "mxfp4", "nvfp4"};

/* Columns a format accepts: FP4 codes come in blocks (MXFP4 32, NVFP4 16). */
static bool kind_cols_ok(wkind k, int64_t cols) {
    if (k == K_MXFP4) return cols % 32 == 0;
    if (k == K_NVFP4) return cols % 16 == 0;
    return true;
}

typedef struct tw {
    moe_weight w;
    void *data, *scale;
} tw;

static void tw_free(tw *t) {
    free(t->data);
    free(t->scale);
    memset(t, 0, sizeof *t);
}

/* Source values: normal draws with a per-row magnitude 2^(r mod 9 - 4), so
 * that block scales differ between rows and tiles. */
static float *source_values(int64_t rows, int64_t cols) {
    float *v = malloc((size_t)(rows * cols) * sizeof *v + 4);
    for (int64_t r = 0; r < rows; r++)
        for (int64_t c = 0; c < cols; c++) v[r * cols + c] = (float)ldexp(rn(), (int)(r % 9) - 4);
    return v;
}

/* A [rows, cols] weight of kind k, quantized from source_values by the
 * library's encoders (src/formats). */
static void tw_make(tw *t, wkind k, int64_t rows, int64_t cols) {
    memset(t, 0, sizeof *t);
    moe_weight *w = &t->w;
    w->rows = rows;
    w->cols = cols;
    w->scale2 = 1.0f;
    w->name = kind_name[k];
    size_t n = (size_t)(rows * cols);
    float *src = source_values(rows, cols);
    switch (k) {
    case K_F64: {
        double *d = malloc(n * 8 + 8);
        for (size_t i = 0; i < n; i++) d[i] = (double)src[i] * (1.0 + 0x1p-40 * rn()); /* not float values */
        t->data = d;
        w->fmt = MOE_WFMT_F64;
        break;
    }
    case K_F32:
        t->data = src;
        src = NULL;
        w->fmt = MOE_WFMT_F32;
        break;
    case K_F16: {
        /* random finite halves: exponents 2^-14 .. 2^1 and subnormals */
        uint16_t *d = malloc(n * 2 + 2);
        for (size_t i = 0; i < n; i++) {
            uint64_t r = moe_splitmix64(&rng);
            d[i] = (uint16_t)((r & 0x83FF) | ((r >> 16) % 17) << 10);
        }
        t->data = d;
        w->fmt = MOE_WFMT_F16;
        break;
    }
    case K_BF16: {
        uint16_t *d = malloc(n * 2 + 2);
        for (size_t i = 0; i < n; i++) d[i] = moe_bf16_from_f32(src[i]);
        t->data = d;
        w->fmt = MOE_WFMT_BF16;
        break;
    }
    case K_FP8_F32:
    case K_FP8_E8M0: {
        uint8_t *q = malloc(n + 1);
        int64_t gr = (rows + 127) / 128, gc = (cols + 127) / 128;
        if (k == K_FP8_F32) {
            float *s = malloc((size_t)(gr * gc) * 4);
            moe_fp8_block_quant(src, rows, cols, MOE_FP8_SCALE_F32, q, s);
            t->scale = s;
            w->scale_dtype = MOE_DTYPE_F32;
        } else {
            uint8_t *s = malloc((size_t)(gr * gc));
            moe_fp8_block_quant_e8m0(src, rows, cols, q, s);
            t->scale = s;
            w->scale_dtype = MOE_DTYPE_F8_E8M0;
        }
        t->data = q;
        w->fmt = MOE_WFMT_FP8_BLOCK;
        w->scale_rows = gr;
        w->scale_cols = gc;
        break;
    }
    case K_MXFP4:
    case K_NVFP4: {
        bool mx = k == K_MXFP4;
        int64_t blk = mx ? 32 : 16;
        uint8_t *q = malloc(n / 2 + 1), *s = malloc(n / (size_t)blk + 1);
        float s2 = mx ? 1.0f : moe_nvfp4_scale2(src, (int64_t)n);
        for (int64_t r = 0; r < rows; r++) {
            if (mx)
                moe_mxfp4_quant_row(src + r * cols, cols, MOE_MX_SCALE_CEIL, MOE_E2M1_RNE, q + r * (cols / 2),
                                    s + r * (cols / 32));
            else
                moe_nvfp4_quant_row(src + r * cols, cols, s2, MOE_E2M1_RNE, q + r * (cols / 2), s + r * (cols / 16));
        }
        t->data = q;
        t->scale = s;
        w->fmt = mx ? MOE_WFMT_MXFP4 : MOE_WFMT_NVFP4;
        w->scale_dtype = mx ? MOE_DTYPE_F8_E8M0 : MOE_DTYPE_F8_E4M3;
        w->scale_rows = rows;
        w->scale_cols = cols / blk;
        w->scale2 = s2;
        break;
    }
    default: MOE_ASSERT(!"kind");
    }
    free(src);
    w->data = t->data;
    w->scale = t->scale;
}

/* ------------------------------------------------------------- oracles */

/* The decoded weight [rows, cols] as float64 (moe_weight_row_f64) and as
 * float32 widened (moe_weight_row_f32). */
static double *decoded_f64(const moe_weight *w) {
    double *d = malloc((size_t)(w->rows * w->cols) * 8 + 8);
    for (int64_t r = 0; r < w->rows; r++) moe_weight_row_f64(w, r, d + r * w->cols);
    return d;
}

static float *decoded_f32(const moe_weight *w) {
    float *d = malloc((size_t)(w->rows * w->cols) * 4 + 4);
    for (int64_t r = 0; r < w->rows; r++) moe_weight_row_f32(w, r, d + r * w->cols);
    return d;
}

/* exact oracle: E[t, r] and S[t, r] = sum |x w| in long double */
static void oracle_exact(const double *Wd, int64_t rows, int64_t cols, const double *X, int64_t ldx, int64_t T,
                         long double *E, long double *S) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t r = 0; r < rows; r++) {
            long double e = 0, s = 0;
            for (int64_t k = 0; k < cols; k++) {
                long double p = (long double)X[t * ldx + k] * (long double)Wd[r * cols + k];
                e += p;
                s += fabsl(p);
            }
            E[t * rows + r] = e;
            S[t * rows + r] = s;
        }
}

/* float64 model: the fma chain, Y [T, rows] */
static void model_f64(const double *Wd, int64_t rows, int64_t cols, const double *X, int64_t ldx, int64_t T,
                      double *Y) {
    for (int64_t t = 0; t < T; t++)
        for (int64_t r = 0; r < rows; r++) {
            double s = 0.0;
            for (int64_t k = 0; k < cols; k++) s = fma(X[t * ldx + k], Wd[r * cols + k], s);
            Y[t * rows + r] = s;
        }
}

/* The rounding bound applies: finite exact value and sum of magnitudes well
 * inside the format's range (no product or partial sum can overflow). */
static bool in_range(long double e, long double s, double max) {
    return isfinite(e) && isfinite(s) && s <= (long double)max / 4;
}

/* Same bits, or both NaN (NaN payloads are not part of the contract). */
static bool same64(double a, double b) { return (isnan(a) && isnan(b)) || memcmp(&a, &b, 8) == 0; }
static bool same32(float a, float b) { return (isnan(a) && isnan(b)) || memcmp(&a, &b, 4) == 0; }

/* --------------------------------------------------------------- ISAs */

static const moe_cpu_kernels *isas[3];
static int n_isas;

static void init_isas(void) {
    isas[n_isas++] = moe_cpu_ref();
    static const moe_isa simd[] = {MOE_ISA_AVX2, MOE_ISA_AVX512};
    for (int i = 0; i < 2; i++) {
        moe_error err;
        const moe_cpu_kernels *k = NULL;
        if (moe_cpu_table(simd[i], &k, &err) == MOE_OK) isas[n_isas++] = k;
        else fprintf(stderr, "note: %s: the %s paths are not tested on this machine\n", err.msg, moe_isa_name(simd[i]));
    }
}

static void set_threads(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

static double *random_x(int64_t T, int64_t ldx) {
    double *X = malloc((size_t)(T * ldx) * 8 + 8);
    for (int64_t i = 0; i < T * ldx; i++) X[i] = rn();
    return X;
}

/* ------------------------------------------------------------- tests */

/* One (weight, X) case through every ISA, float64 and float32: model bits
 * and oracle tolerance. */
static void check_case(const tw *t, const double *X, int64_t ldx, int64_t T, const char *what) {
    const moe_weight *w = &t->w;
    int64_t rows = w->rows, cols = w->cols, ny = T * rows;
    double *Wd = decoded_f64(w);
    float *Wf = decoded_f32(w);
    double *Wfd = malloc((size_t)(rows * cols) * 8 + 8);
    for (int64_t i = 0; i < rows * cols; i++) Wfd[i] = (double)Wf[i];
    long double *E = malloc((size_t)ny * sizeof *E + 16), *S = malloc((size_t)ny * sizeof *S + 16);
    double *M = malloc((size_t)ny * 8 + 8), *Y = malloc((size_t)ny * 8 + 8);
    float *Xf = malloc((size_t)(T * ldx) * 4 + 4), *Yf = malloc((size_t)ny * 4 + 4), *Mf = malloc((size_t)ny * 4 + 4);
    for (int64_t i = 0; i < T * ldx; i++) Xf[i] = (float)X[i];
    double *Xfd = malloc((size_t)(T * ldx) * 8 + 8);
    for (int64_t i = 0; i < T * ldx; i++) Xfd[i] = (double)Xf[i];

    oracle_exact(Wd, rows, cols, X, ldx, T, E, S);
    model_f64(Wd, rows, cols, X, ldx, T, M);
    for (int i = 0; i < n_isas; i++) {
        moe_error err;
        for (int64_t j = 0; j < ny; j++) Y[j] = -777.0;
        moe_status st = moe_linear_f64_with(isas[i], w, X, ldx, T, Y, rows, &err);
        CHECK_OK(st, err);
        int64_t bad_bits = 0, bad_tol = 0, first = -1;
        double worst = 0;
        for (int64_t j = 0; j < ny; j++) {
            if (!same64(Y[j], M[j])) {
                bad_bits++;
                if (first < 0) first = j;
            }
            if (!in_range(E[j], S[j], DBL_MAX)) continue; /* overflow or non-finite input: the model decides */
            double d = fabs((double)((long double)Y[j] - E[j])), tol = TOL64(cols, (double)S[j]);
            if (!(d <= tol)) bad_tol++;
            if (tol > 0 && d / tol > worst) worst = d / tol;
        }
        CHECK(bad_bits == 0, "%s %s f64 isa %s: %lld of %lld outputs differ from the fma chain (first [%lld, %lld]: %.17g vs %.17g)",
              what, w->name, isas[i]->isa, (long long)bad_bits, (long long)ny,
              (long long)(first < 0 ? 0 : first / rows), (long long)(first < 0 ? 0 : first % rows),
              first < 0 ? 0.0 : Y[first], first < 0 ? 0.0 : M[first]);
        CHECK(bad_tol == 0, "%s %s f64 isa %s: %lld outputs outside TOL64 (worst %.3g x tol)", what, w->name,
              isas[i]->isa, (long long)bad_tol, worst);
        /* the single-threaded entry in a caller workspace (misaligned on
         * purpose) of exactly the size moe_linear_f64_workspace_for gives
         * this weight (ASan sees a byte past it): the same bits */
        CHECK(moe_linear_f64_workspace_for(rows, cols) <= moe_linear_f64_workspace(), "workspace_for <= the general size");
        char *wsb = malloc(moe_linear_f64_workspace_for(rows, cols) + 8);
        for (int64_t j = 0; j < ny; j++) Y[j] = -777.0;
        moe_linear_f64_ws(isas[i], w, X, ldx, T, Y, rows, wsb + 8);
        int64_t bad_ws = 0;
        for (int64_t j = 0; j < ny; j++) bad_ws += !same64(Y[j], M[j]);
        CHECK(bad_ws == 0, "%s %s moe_linear_f64_ws isa %s: %lld outputs differ from the fma chain", what, w->name,
              isas[i]->isa, (long long)bad_ws);
        free(wsb);
    }

    /* float32: the kernel table's gemm in one call is the model; the oracle
     * uses the float32 weights and activations widened */
    oracle_exact(Wfd, rows, cols, Xfd, ldx, T, E, S);
    for (int i = 0; i < n_isas; i++) {
        moe_error err;
        for (int64_t j = 0; j < ny; j++) Mf[j] = Yf[j] = -777.0f;
        isas[i]->gemm(w, 0, rows, Xf, ldx, T, Mf, rows);
        moe_status st = moe_linear_f32_with(isas[i], w, Xf, ldx, T, Yf, rows, &err);
        CHECK_OK(st, err);
        int64_t bad_bits = 0, bad_tol = 0;
        double worst = 0;
        for (int64_t j = 0; j < ny; j++) {
            if (!same32(Yf[j], Mf[j])) bad_bits++;
            if (!in_range(E[j], S[j], FLT_MAX)) continue;
            double d = fabs((double)((long double)Yf[j] - E[j])), tol = TOL32(cols, (double)S[j]);
            if (!(d <= tol)) bad_tol++;
            if (tol > 0 && d / tol > worst) worst = d / tol;
        }
        CHECK(bad_bits == 0, "%s %s f32 isa %s: %lld of %lld outputs differ from one whole gemm call", what, w->name,
              isas[i]->isa, (long long)bad_bits, (long long)ny);
        CHECK(bad_tol == 0, "%s %s f32 isa %s: %lld outputs outside TOL32 (worst %.3g x tol)", what, w->name,
              isas[i]->isa, (long long)bad_tol, worst);
    }
    free(Wd); free(Wf); free(Wfd); free(E); free(S); free(M); free(Y); free(Xf); free(Yf); free(Mf); free(Xfd);
}

/* Every format x shapes that are a multiple of no tile (T 1, 3, 17, 255, 257;
 * odd rows, some past one 240-row item; columns odd, past one 256-column K
 * block, not a multiple of 32 or 128 where the format allows). */
static void test_formats_shapes(void) {
    static const int64_t shapes[][3] = {
        /* T, rows, cols (non-FP4); FP4 columns are rounded up below */
        {1, 1, 1}, {3, 23, 7}, {17, 25, 129}, {1, 97, 300}, {255, 31, 257}, {257, 263, 513}, {17, 5, 600},
        {9, 75, 2100}, /* three K blocks of 1024, the last partial; two row blocks of 72 */
    };
    for (int k = 0; k < K_COUNT; k++) {
        for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
            int64_t T = shapes[s][0], rows = shapes[s][1], cols = shapes[s][2];
            if (k == K_MXFP4) cols = (cols + 31) / 32 * 32 + (cols > 300 ? 32 : 0);   /* 32, 160, 320, 544, 640, 2144 */
            if (k == K_NVFP4) cols = (cols + 15) / 16 * 16 + (cols > 300 ? 16 : 0);   /* 16, 144, 304, 544, 624, 2128 */
            if (!kind_cols_ok((wkind)k, cols)) continue;
            /* the large shape on a few formats only (the scalar oracles are slow) */
            if (rows > 200 && !(k == K_BF16 || k == K_FP8_E8M0 || k == K_MXFP4 || k == K_NVFP4)) continue;
            tw t;
            tw_make(&t, (wkind)k, rows, cols);
            int64_t ldx = cols + 3;
            double *X = random_x(T, ldx);
            char what[64];
            snprintf(what, sizeof what, "T=%lld rows=%lld cols=%lld", (long long)T, (long long)rows, (long long)cols);
            check_case(&t, X, ldx, T, what);
            free(X);
            tw_free(&t);
        }
    }
}

/* Non-finite and extreme values: in X a row's NaN or Inf reaches only that
 * row of Y; NaN codes and NaN scales in W only their rows of W (columns of
 * Y); subnormal and huge activations follow the model bit for bit. */
static void test_adversarial(void) {
    const int64_t T = 19, rows = 37, cols = 320, ldx = cols;
    for (int k = 0; k < K_COUNT; k++) {
        tw t;
        tw_make(&t, (wkind)k, rows, cols);
        double *X = random_x(T, ldx);
        /* token 0: subnormals (products underflow), token 1: huge values
         * (products overflow to Inf), token 2: a NaN, token 3: +Inf and -Inf
         * (Inf - Inf = NaN), token 4: tiny and huge mixed */
        for (int64_t c = 0; c < cols; c++) {
            X[0 * ldx + c] = ldexp(rn(), -1060);
            X[1 * ldx + c] = 1e300 * rn();
            X[4 * ldx + c] = (c % 2) ? 1e-300 * rn() : 1e200 * rn();
        }
        X[2 * ldx + 77] = NAN;
        X[3 * ldx + 5] = INFINITY;
        X[3 * ldx + 250] = -INFINITY;
        X[5 * ldx + 300] = INFINITY;
        check_case(&t, X, ldx, T, "adversarial X");

        /* isolation: the same call with the non-finite tokens replaced by
         * finite ones gives the same bits on every other token */
        double *X2 = malloc((size_t)(T * ldx) * 8);
        memcpy(X2, X, (size_t)(T * ldx) * 8);
        X2[2 * ldx + 77] = 1.0;
        X2[3 * ldx + 5] = 1.0;
        X2[3 * ldx + 250] = 1.0;
        X2[5 * ldx + 300] = 1.0;
        double *Y = malloc((size_t)(T * rows) * 8), *Y2 = malloc((size_t)(T * rows) * 8);
        moe_error err;
        CHECK_OK(moe_linear_f64(&t.w, X, ldx, T, Y, rows, &err), err);
        CHECK_OK(moe_linear_f64(&t.w, X2, ldx, T, Y2, rows, &err), err);
        int leaks = 0, nan_row = 0;
        for (int64_t tt = 0; tt < T; tt++)
            for (int64_t r = 0; r < rows; r++) {
                bool special = tt == 2 || tt == 3 || tt == 5;
                if (!special && !same64(Y[tt * rows + r], Y2[tt * rows + r])) leaks++;
                if (tt == 2 && !isnan(Y[tt * rows + r])) nan_row++;
            }
        CHECK(leaks == 0, "%s: a non-finite token changed %d outputs of other tokens", t.w.name, leaks);
        CHECK(nan_row == 0, "%s: %d outputs of the NaN token are not NaN", t.w.name, nan_row);
        free(X2); free(Y); free(Y2); free(X);
        tw_free(&t);
    }

    /* NaN inside W: an E4M3 NaN code, an E8M0 NaN scale (a whole tile), an
     * NVFP4 NaN block scale, an MXFP4 NaN block scale, a BF16 NaN, an F32 Inf */
    for (int k = 0; k < K_COUNT; k++) {
        tw t;
        tw_make(&t, (wkind)k, rows, cols);
        uint8_t *d = t.data, *s = t.scale;
        int64_t bad_row = 3;
        switch ((wkind)k) {
        case K_FP8_F32: d[bad_row * cols + 11] = 0x7F; break;
        case K_FP8_E8M0: s[0] = 0xFF; break; /* rows 0..36 of tile column 0 */
        case K_MXFP4: s[bad_row * (cols / 32) + 2] = 0xFF; break;
        case K_NVFP4: s[bad_row * (cols / 16) + 5] = 0x7F; break;
        case K_BF16: ((uint16_t *)d)[bad_row * cols + 9] = 0x7FC1; break;
        case K_F32: ((float *)d)[bad_row * cols + 9] = INFINITY; break;
        case K_F64: ((double *)d)[bad_row * cols + 9] = NAN; break;
        case K_F16: ((uint16_t *)d)[bad_row * cols + 9] = 0x7C00; break; /* +Inf */
        default: break;
        }
        double *X = random_x(T, ldx);
        check_case(&t, X, ldx, T, "non-finite W");
        double *Y = malloc((size_t)(T * rows) * 8);
        moe_error err;
        CHECK_OK(moe_linear_f64(&t.w, X, ldx, T, Y, rows, &err), err);
        int wrong = 0;
        for (int64_t tt = 0; tt < T; tt++)
            for (int64_t r = 0; r < rows; r++) {
                bool poisoned = k == K_FP8_E8M0 || r == bad_row;
                if (!poisoned && !isfinite(Y[tt * rows + r])) wrong++;
                if (poisoned && isfinite(Y[tt * rows + r])) wrong++;
            }
        CHECK(wrong == 0, "%s: %d outputs disagree with the poisoned rows of W", t.w.name, wrong);
        free(X); free(Y);
        tw_free(&t);
    }
}

/* The same bits whatever the thread count and whatever else is in the batch. */
static void test_determinism(void) {
    const int64_t T = 61, rows = 301, cols = 1088, ldx = cols + 1; /* two K blocks, five row blocks */
    static const wkind kinds[] = {K_FP8_E8M0, K_MXFP4, K_BF16, K_NVFP4};
    for (size_t ki = 0; ki < sizeof kinds / sizeof kinds[0]; ki++) {
        tw t;
        tw_make(&t, kinds[ki], rows, cols);
        double *X = random_x(T, ldx);
        float *Xf = malloc((size_t)(T * ldx) * 4);
        for (int64_t i = 0; i < T * ldx; i++) Xf[i] = (float)X[i];
        size_t ny = (size_t)(T * rows);
        double *Y1 = malloc(ny * 8), *Yn = malloc(ny * 8);
        float *F1 = malloc(ny * 4), *Fn = malloc(ny * 4);
        for (int i = 0; i < n_isas; i++) {
            moe_error err;
            set_threads(1);
            CHECK_OK(moe_linear_f64_with(isas[i], &t.w, X, ldx, T, Y1, rows, &err), err);
            CHECK_OK(moe_linear_f32_with(isas[i], &t.w, Xf, ldx, T, F1, rows, &err), err);
            static const int nths[] = {2, 3, 4, 7};
            for (int n = 0; n < 4; n++) {
                set_threads(nths[n]);
                CHECK_OK(moe_linear_f64_with(isas[i], &t.w, X, ldx, T, Yn, rows, &err), err);
                CHECK_OK(moe_linear_f32_with(isas[i], &t.w, Xf, ldx, T, Fn, rows, &err), err);
                CHECK(memcmp(Y1, Yn, ny * 8) == 0, "%s f64 isa %s: %d threads changed bits", t.w.name, isas[i]->isa,
                      nths[n]);
                CHECK(memcmp(F1, Fn, ny * 4) == 0, "%s f32 isa %s: %d threads changed bits", t.w.name, isas[i]->isa,
                      nths[n]);
            }
            set_threads(2);
            /* sub-batches: tokens [a, a + n) alone, and with the other tokens
             * replaced by different values, give the rows of the full call */
            static const int64_t sub[][2] = {{0, 1}, {5, 3}, {17, 17}, {40, 21}, {60, 1}};
            for (int q = 0; q < 5; q++) {
                int64_t a = sub[q][0], n = sub[q][1];
                double *Ys = malloc((size_t)(n * rows) * 8);
                float *Fs = malloc((size_t)(n * rows) * 4);
                CHECK_OK(moe_linear_f64_with(isas[i], &t.w, X + a * ldx, ldx, n, Ys, rows, &err), err);
                CHECK_OK(moe_linear_f32_with(isas[i], &t.w, Xf + a * ldx, ldx, n, Fs, rows, &err), err);
                CHECK(memcmp(Ys, Y1 + a * rows, (size_t)(n * rows) * 8) == 0,
                      "%s f64 isa %s: tokens [%lld, +%lld) alone differ from the full batch", t.w.name, isas[i]->isa,
                      (long long)a, (long long)n);
                CHECK(memcmp(Fs, F1 + a * rows, (size_t)(n * rows) * 4) == 0,
                      "%s f32 isa %s: tokens [%lld, +%lld) alone differ from the full batch", t.w.name, isas[i]->isa,
                      (long long)a, (long long)n);
                free(Ys);
                free(Fs);
            }
            double *X3 = random_x(T, ldx);
            float *X3f = malloc((size_t)(T * ldx) * 4);
            memcpy(X3 + 17 * ldx, X + 17 * ldx, (size_t)(9 * ldx) * 8); /* tokens 17..25 shared */
            for (int64_t j = 0; j < T * ldx; j++) X3f[j] = (float)X3[j];
            CHECK_OK(moe_linear_f64_with(isas[i], &t.w, X3, ldx, T, Yn, rows, &err), err);
            CHECK_OK(moe_linear_f32_with(isas[i], &t.w, X3f, ldx, T, Fn, rows, &err), err);
            CHECK(memcmp(Yn + 17 * rows, Y1 + 17 * rows, (size_t)(9 * rows) * 8) == 0,
                  "%s f64 isa %s: other tokens in the batch changed bits", t.w.name, isas[i]->isa);
            CHECK(memcmp(Fn + 17 * rows, F1 + 17 * rows, (size_t)(9 * rows) * 4) == 0,
                  "%s f32 isa %s: other tokens in the batch changed bits", t.w.name, isas[i]->isa);
            free(X3);
            free(X3f);
        }
        /* float64: one sequence, so every ISA gives the same bits */
        double *Yi = malloc(ny * 8);
        set_threads(2);
        moe_error err;
        CHECK_OK(moe_linear_f64_with(moe_cpu_ref(), &t.w, X, ldx, T, Y1, rows, &err), err);
        for (int i = 1; i < n_isas; i++) {
            CHECK_OK(moe_linear_f64_with(isas[i], &t.w, X, ldx, T, Yi, rows, &err), err);
            CHECK(memcmp(Y1, Yi, ny * 8) == 0, "%s f64: isa %s differs from ref", t.w.name, isas[i]->isa);
        }
        free(Yi); free(X); free(Xf); free(Y1); free(Yn); free(F1); free(Fn);
        tw_free(&t);
    }
}

/* Strides and degenerate shapes: X columns past cols are never read (NaN
 * there), Y columns past rows are never written, T = 0 writes nothing,
 * cols = 0 writes +0.0. */
static void test_strides_and_empty(void) {
    const int64_t T = 9, rows = 29, cols = 130, ldx = 141, ldy = 40;
    tw t;
    tw_make(&t, K_FP8_F32, rows, cols);
    double *X = random_x(T, ldx);
    for (int64_t tt = 0; tt < T; tt++)
        for (int64_t c = cols; c < ldx; c++) X[tt * ldx + c] = NAN;
    double *Y = malloc((size_t)(T * ldy) * 8);
    float *Xf = malloc((size_t)(T * ldx) * 4), *Yf = malloc((size_t)(T * ldy) * 4);
    for (int64_t i = 0; i < T * ldx; i++) Xf[i] = (float)X[i];
    for (int i = 0; i < n_isas; i++) {
        moe_error err;
        for (int64_t j = 0; j < T * ldy; j++) {
            Y[j] = -5.0;
            Yf[j] = -5.0f;
        }
        CHECK_OK(moe_linear_f64_with(isas[i], &t.w, X, ldx, T, Y, ldy, &err), err);
        CHECK_OK(moe_linear_f32_with(isas[i], &t.w, Xf, ldx, T, Yf, ldy, &err), err);
        int bad = 0;
        for (int64_t tt = 0; tt < T; tt++)
            for (int64_t r = 0; r < ldy; r++) {
                if (r < rows && (!isfinite(Y[tt * ldy + r]) || !isfinite(Yf[tt * ldy + r]))) bad++;
                if (r >= rows && (Y[tt * ldy + r] != -5.0 || Yf[tt * ldy + r] != -5.0f)) bad++;
            }
        CHECK(bad == 0, "isa %s: %d outputs wrong with ldx %lld, ldy %lld", isas[i]->isa, bad, (long long)ldx,
              (long long)ldy);
    }
    /* T = 0: Y untouched */
    double sentinel = -9.0;
    moe_error err;
    CHECK_OK(moe_linear_f64(&t.w, X, ldx, 0, &sentinel, ldy, &err), err);
    CHECK(sentinel == -9.0, "T = 0 wrote Y");
    /* cols = 0: +0.0 everywhere */
    moe_weight w0 = t.w;
    w0.cols = 0;
    w0.fmt = MOE_WFMT_F32;
    for (int64_t j = 0; j < T * ldy; j++) Y[j] = -1.0;
    CHECK_OK(moe_linear_f64(&w0, X, ldx, T, Y, ldy, &err), err);
    int nz = 0;
    for (int64_t tt = 0; tt < T; tt++)
        for (int64_t r = 0; r < rows; r++) nz += !(Y[tt * ldy + r] == 0.0 && !signbit(Y[tt * ldy + r]));
    CHECK(nz == 0, "cols = 0: %d outputs are not +0.0", nz);
    free(X); free(Y); free(Xf); free(Yf);
    tw_free(&t);
}

/* The SIMD decode-and-pack twins give pack.c's bits on raw random codes
 * (every E4M3, E2M1, E8M0, UE4M3, BF16 and F16 code: NaN, Inf, subnormal,
 * sign bits set in UE4M3 scales), row counts that are not a multiple of 8,
 * column blocks that are not a multiple of 8, blocks that start inside a
 * scale block. */
static void test_pack_twins(void) {
    const moe_dgemm_kernel *ks[3];
    int nk = 0;
    for (int i = 0; i < n_isas; i++) {
        const char *f = moe_linear_f64_isa(isas[i]);
        ks[nk++] = !strcmp(f, "avx512") ? moe_dgemm_avx512() : !strcmp(f, "avx2") ? moe_dgemm_avx2() : moe_dgemm_ref();
    }
    static const moe_wfmt fmts[] = {MOE_WFMT_F64, MOE_WFMT_F32, MOE_WFMT_F16, MOE_WFMT_BF16, MOE_WFMT_FP8_BLOCK,
                                    MOE_WFMT_FP8_BLOCK, MOE_WFMT_MXFP4, MOE_WFMT_NVFP4};
    const int64_t rows = 157, cols = 416;
    for (size_t fi = 0; fi < sizeof fmts / sizeof fmts[0]; fi++) {
        moe_wfmt f = fmts[fi];
        moe_weight w;
        memset(&w, 0, sizeof w);
        w.fmt = f;
        w.rows = rows;
        w.cols = cols;
        w.scale2 = f == MOE_WFMT_NVFP4 ? 0.37f : 1.0f;
        w.name = "raw codes";
        size_t es = f == MOE_WFMT_F64 ? 8 : f == MOE_WFMT_F32 ? 4 : f == MOE_WFMT_F16 || f == MOE_WFMT_BF16 ? 2 : 1;
        size_t nb = f == MOE_WFMT_MXFP4 || f == MOE_WFMT_NVFP4 ? (size_t)(rows * cols / 2) : (size_t)(rows * cols) * es;
        uint8_t *d = malloc(nb), *sc = malloc((size_t)(rows * cols) + 64);
        for (size_t i = 0; i < nb; i++) d[i] = (uint8_t)moe_splitmix64(&rng);
        if (f == MOE_WFMT_F64 || f == MOE_WFMT_F32)
            for (size_t i = 0; i < nb / es; i++) { /* finite random values, some NaN / Inf / subnormal */
                double v = rn() * ldexp(1.0, (int)(moe_splitmix64(&rng) % 40) - 20);
                uint64_t pick = moe_splitmix64(&rng) % 64;
                if (pick == 0) v = NAN;
                if (pick == 1) v = -INFINITY;
                if (pick == 2) v = f == MOE_WFMT_F64 ? 0x1p-1070 : (double)0x1p-140f;
                if (f == MOE_WFMT_F64) memcpy(d + i * 8, &v, 8);
                else {
                    float x = (float)v;
                    memcpy(d + i * 4, &x, 4);
                }
            }
        for (size_t i = 0; i < (size_t)(rows * cols); i++) sc[i] = (uint8_t)moe_splitmix64(&rng);
        w.data = d;
        w.scale = sc;
        if (f == MOE_WFMT_FP8_BLOCK) {
            w.scale_rows = (rows + 127) / 128;
            w.scale_cols = (cols + 127) / 128;
            w.scale_dtype = fi == 4 ? MOE_DTYPE_F32 : MOE_DTYPE_F8_E8M0;
            if (fi == 4) /* fp32 tile scales: finite, Inf, NaN, huge */
                for (int64_t i = 0; i < w.scale_rows * w.scale_cols; i++) {
                    float v = i == 1 ? INFINITY : i == 2 ? NAN : i == 3 ? 3e38f : (float)fabs(rn()) * 1e-2f;
                    memcpy(sc + 4 * i, &v, 4);
                }
        } else if (f == MOE_WFMT_MXFP4 || f == MOE_WFMT_NVFP4) {
            w.scale_rows = rows;
            w.scale_cols = cols / (f == MOE_WFMT_MXFP4 ? 32 : 16);
            w.scale_dtype = f == MOE_WFMT_MXFP4 ? MOE_DTYPE_F8_E8M0 : MOE_DTYPE_F8_E4M3;
        }
        /* blocks: (r0, nrows, k0, kc) with ragged edges */
        static const int64_t blocks[][4] = {{0, 157, 0, 256}, {3, 61, 256, 160}, {150, 7, 8, 136}, {20, 100, 0, 2},
                                            {0, 1, 64, 14}, {100, 57, 32, 384}};
        for (size_t b = 0; b < sizeof blocks / sizeof blocks[0]; b++) {
            int64_t r0 = blocks[b][0], nrows = blocks[b][1], k0 = blocks[b][2], kc = blocks[b][3];
            for (int i = 0; i < nk; i++) {
                int nr = ks[i]->nr;
                size_t n = (size_t)(((nrows + nr - 1) / nr) * kc * nr);
                double *a = aligned_alloc(64, n * 8 + 64), *bb = aligned_alloc(64, n * 8 + 64);
                moe_dgemm_pack(&w, r0, nrows, k0, kc, nr, a);
                ks[i]->pack(&w, r0, nrows, k0, kc, nr, bb);
                size_t bad = 0;
                for (size_t j = 0; j < n; j++) bad += !same64(a[j], bb[j]);
                CHECK(bad == 0, "pack %s fmt %d block %zu: %zu of %zu values differ from pack.c", ks[i]->isa, (int)f,
                      b, bad, n);
                /* and pack.c against the definition, row by row */
                double *row = malloc((size_t)cols * 8);
                size_t bad_def = 0;
                for (int64_t r = 0; r < nrows; r++) {
                    moe_weight_row_f64(&w, r0 + r, row);
                    for (int64_t k = 0; k < kc; k++) {
                        double v = a[(size_t)((r / nr) * kc * nr + k * nr + r % nr)];
                        bad_def += !same64(v, row[k0 + k]);
                    }
                }
                CHECK(bad_def == 0, "pack.c fmt %d block %zu: %zu values differ from moe_weight_row_f64", (int)f, b,
                      bad_def);
                free(row);
                free(a);
                free(bb);
            }
        }
        free(d);
        free(sc);
    }
}

/* The layouts only the scalar packer knows (pack.c: moe_dgemm_pack_generic_only),
 * through every ISA: FP8 blocks other than 128 x 128 (V4.1's 32 x 32, with
 * F32 and E8M0 scales; a 1 x 64 grid) and compressed-tensors NVFP4, whose
 * value is (e2m1 * ue4m3) / G (G = 3: not fp32(1/3)'s product). Each is held
 * to moe_weight_row_f64 bit for bit like every other format. */
static void test_layout_variants(void) {
    static const int64_t shapes[][3] = {{3, 23, 7}, {17, 70, 300}, {9, 75, 2100}, {1, 33, 129}};
    for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
        int64_t T = shapes[s][0], rows = shapes[s][1], cols = shapes[s][2];
        for (int v = 0; v < 3; v++) {
            int br = v == 2 ? 1 : 32, bc = v == 2 ? 64 : 32;
            int64_t gr = (rows + br - 1) / br, gc = (cols + bc - 1) / bc;
            tw t;
            memset(&t, 0, sizeof t);
            uint8_t *q = malloc((size_t)(rows * cols) + 1);
            for (int64_t i = 0; i < rows * cols; i++) {
                uint8_t c = (uint8_t)moe_splitmix64(&rng);
                q[i] = (c & 0x7F) == 0x7F ? (uint8_t)(c - 1) : c; /* no NaN codes */
            }
            bool e8 = v == 1;
            void *sc = malloc((size_t)(gr * gc) * (e8 ? 1 : 4) + 4);
            for (int64_t i = 0; i < gr * gc; i++) {
                if (e8) ((uint8_t *)sc)[i] = (uint8_t)(118 + moe_splitmix64(&rng) % 16);
                else ((float *)sc)[i] = (float)(0.001 + 0.01 * fabs(rn()));
            }
            t.data = q;
            t.scale = sc;
            t.w = (moe_weight){.fmt = MOE_WFMT_FP8_BLOCK, .rows = rows, .cols = cols, .data = q, .scale = sc,
                               .scale_dtype = e8 ? MOE_DTYPE_F8_E8M0 : MOE_DTYPE_F32, .scale_rows = gr,
                               .scale_cols = gc, .scale2 = 1.0f, .block_rows = br, .block_cols = bc,
                               .name = v == 0 ? "fp8 32x32 f32" : v == 1 ? "fp8 32x32 e8m0" : "fp8 1x64 f32"};
            double *X = random_x(T, cols + 1);
            char what[64];
            snprintf(what, sizeof what, "T=%lld rows=%lld cols=%lld", (long long)T, (long long)rows, (long long)cols);
            check_case(&t, X, cols + 1, T, what);
            free(X);
            tw_free(&t);
        }
        int64_t c16 = (cols + 15) / 16 * 16;
        tw t;
        tw_make(&t, K_NVFP4, rows, c16);
        t.w.global_scale = 3.0;
        t.w.scale2 = (float)(1.0 / 3.0);
        t.w.name = "nvfp4 compressed-tensors";
        double *X = random_x(T, c16);
        check_case(&t, X, c16, T, "compressed-tensors");
        free(X);
        tw_free(&t);
    }
}

/* moe_gemm_f64_rows / _cols (the attention's products) against the fma-chain
 * model and the long-double oracle, every ISA, with gathered (repeated,
 * out-of-order) vectors; a NaN in one vector reaches only its outputs. */
static void test_gemm_ptrs(void) {
    const int64_t pool = 900, D = 1031; /* vectors of D doubles; D past one K block of 1024, odd */
    double *P = malloc((size_t)(pool * D) * 8);
    for (int64_t i = 0; i < pool * D; i++) P[i] = rn();
    P[17 * D + 400] = NAN; /* vector 17 */
    void *ws = aligned_alloc(64, moe_gemm_f64_workspace());
    static const int64_t cases[][2] = {{64, 641}, {1, 5}, {3, 72}, {9, 1025}, {64, 128}}; /* T, N */
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        int64_t T = cases[c][0], N = cases[c][1];
        /* rows: N vectors of D (K = D); cols: N = D outputs from K = N' vectors */
        const double **sel = malloc((size_t)N * sizeof *sel);
        int has17 = -1;
        for (int64_t n = 0; n < N; n++) {
            int64_t id = n % 7 == 3 ? 17 : (int64_t)(moe_splitmix64(&rng) % (uint64_t)pool);
            if (id == 17 && has17 < 0) has17 = (int)n;
            sel[n] = P + id * D;
        }
        int64_t ldx = (N > D ? N : D) + 2;
        double *X = random_x(T, ldx);
        for (int form = 0; form < 2; form++) {
            bool by_cols = form == 1;
            int64_t K = by_cols ? N : D, NO = by_cols ? D : N; /* reduction length, outputs */
            double *M = malloc((size_t)(T * NO) * 8), *Y = malloc((size_t)(T * NO) * 8);
            long double *E = malloc((size_t)(T * NO) * sizeof *E), *S = malloc((size_t)(T * NO) * sizeof *S);
            for (int64_t t = 0; t < T; t++)
                for (int64_t n = 0; n < NO; n++) {
                    double m = 0.0;
                    long double e = 0, sa = 0;
                    for (int64_t k = 0; k < K; k++) {
                        double wv = by_cols ? sel[k][n] : sel[n][k];
                        m = fma(X[t * ldx + k], wv, m);
                        long double pr = (long double)X[t * ldx + k] * (long double)wv;
                        e += pr;
                        sa += fabsl(pr);
                    }
                    M[t * NO + n] = m;
                    E[t * NO + n] = e;
                    S[t * NO + n] = sa;
                }
            for (int i = 0; i < n_isas; i++) {
                for (int64_t j = 0; j < T * NO; j++) Y[j] = -3.0;
                if (by_cols) moe_gemm_f64_cols(isas[i], X, ldx, T, sel, K, NO, Y, NO, ws);
                else moe_gemm_f64_rows(isas[i], X, ldx, T, sel, NO, K, Y, NO, ws);
                int64_t bad = 0, badtol = 0, leak = 0;
                for (int64_t t = 0; t < T; t++)
                    for (int64_t n = 0; n < NO; n++) {
                        int64_t j = t * NO + n;
                        bad += !same64(Y[j], M[j]);
                        if (in_range(E[j], S[j], DBL_MAX) &&
                            !(fabs((double)((long double)Y[j] - E[j])) <= TOL64(K, (double)S[j])))
                            badtol++;
                        /* rows: output n is NaN iff vector n is vector 17; cols: output 400 is NaN iff
                         * some selected vector is 17 */
                        bool expect_nan = by_cols ? (n == 400 && has17 >= 0) : sel[n] == P + 17 * D;
                        /* (cols with K = N > 1024 spans K blocks too) */
                        leak += isnan(Y[j]) != expect_nan;
                    }
                CHECK(bad == 0, "gemm %s T=%lld N=%lld isa %s: %lld outputs differ from the fma chain",
                      by_cols ? "cols" : "rows", (long long)T, (long long)NO, isas[i]->isa, (long long)bad);
                CHECK(badtol == 0, "gemm %s T=%lld isa %s: %lld outputs outside TOL64", by_cols ? "cols" : "rows",
                      (long long)T, isas[i]->isa, (long long)badtol);
                CHECK(leak == 0, "gemm %s T=%lld isa %s: %lld outputs with the wrong NaN-ness",
                      by_cols ? "cols" : "rows", (long long)T, isas[i]->isa, (long long)leak);
            }
            free(M); free(Y); free(E); free(S);
        }
        free(X);
        free(sel);
    }
    free(P);
    free(ws);
}

int main(void) {
    init_isas();
    fprintf(stderr, "isas tested:");
    for (int i = 0; i < n_isas; i++) fprintf(stderr, " %s (f64 tile %s)", isas[i]->isa, moe_linear_f64_isa(isas[i]));
    fprintf(stderr, "\n");
    RUN(test_pack_twins);
    RUN(test_formats_shapes);
    RUN(test_adversarial);
    RUN(test_determinism);
    RUN(test_strides_and_empty);
    RUN(test_gemm_ptrs);
    RUN(test_layout_variants);
    return moe_t_finish();
}
