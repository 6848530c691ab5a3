/*
 * moeaudit bench --linear: the dense linears of one DeepSeek-V4-Flash layer
 * (src/linalg/linear.h, float64 and float32) against floors measured in the
 * same run.
 *
 *   memory floor  = (stored weight bytes incl. scales + X + Y) / streaming
 *                   read bandwidth (bench.c's probe: 1 GiB, all threads)
 *   compute floor = 2 T K N / the FMA peak of the ISA the row runs:
 *                   float64 rows: a float64 FMA GEMM micro-kernel with the
 *                   library tile's shape (AVX-512 8 x 24, AVX2 6 x 8), L1-
 *                   resident data, all threads, best of 5, measured back to
 *                   back with the rows; float32 rows: the same for float32
 *                   (AVX-512 8 x 32, AVX2 6 x 16)
 *   ratio         = median / max(floors); 1.0 is the physical limit
 *
 * Weights are random valid codes (E4M3 without NaN codes, E8M0 scales
 * 120..127, bf16 in +-[0.5, 1), f32 normal-ish); each row rotates over
 * enough copies of its weight that the working set exceeds 128 MiB (so a
 * T = 1 row reads from DRAM, not from the 32 MiB L3). One warm-up call,
 * then --iters timed calls (default by T); median, min and max reported.
 */
#include "bench/bench.h"
#include "core/core.h"
#include "cpu/kernels.h"
#include "linalg/linear.h"

#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

static double lin_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int lin_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* ------------------------------------------------------------ peaks */

#define TGT512 __attribute__((target("avx512f,fma")))
#define TGT2 __attribute__((target("avx2,fma")))

/* C[8, 24] += A[8, K] B[K, 24], float64: the avx512 tile's shape. */
TGT512 static double probe_f64_avx512(const double *A, const double *B, double *C, int K, int reps) {
    for (int r = 0; r < reps; r++) {
        __m512d c[8][3];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) c[i][0] = c[i][1] = c[i][2] = _mm512_setzero_pd();
        for (int k = 0; k < K; k++) {
            __m512d b0 = _mm512_load_pd(B + 24 * k), b1 = _mm512_load_pd(B + 24 * k + 8),
                    b2 = _mm512_load_pd(B + 24 * k + 16);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                __m512d a = _mm512_set1_pd(A[i * K + k]);
                c[i][0] = _mm512_fmadd_pd(a, b0, c[i][0]);
                c[i][1] = _mm512_fmadd_pd(a, b1, c[i][1]);
                c[i][2] = _mm512_fmadd_pd(a, b2, c[i][2]);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
#pragma GCC unroll 3
            for (int v = 0; v < 3; v++)
                _mm512_store_pd(C + 24 * i + 8 * v, _mm512_add_pd(_mm512_load_pd(C + 24 * i + 8 * v), c[i][v]));
    }
    return 2.0 * 8 * 24 * K * (double)reps;
}

/* C[6, 8] += A[6, K] B[K, 8], float64: the avx2 tile's shape. */
TGT2 static double probe_f64_avx2(const double *A, const double *B, double *C, int K, int reps) {
    for (int r = 0; r < reps; r++) {
        __m256d c[6][2];
#pragma GCC unroll 6
        for (int i = 0; i < 6; i++) c[i][0] = c[i][1] = _mm256_setzero_pd();
        for (int k = 0; k < K; k++) {
            __m256d b0 = _mm256_load_pd(B + 8 * k), b1 = _mm256_load_pd(B + 8 * k + 4);
#pragma GCC unroll 6
            for (int i = 0; i < 6; i++) {
                __m256d a = _mm256_broadcast_sd(A + i * K + k);
                c[i][0] = _mm256_fmadd_pd(a, b0, c[i][0]);
                c[i][1] = _mm256_fmadd_pd(a, b1, c[i][1]);
            }
        }
#pragma GCC unroll 6
        for (int i = 0; i < 6; i++)
#pragma GCC unroll 2
            for (int v = 0; v < 2; v++)
                _mm256_store_pd(C + 8 * i + 4 * v, _mm256_add_pd(_mm256_load_pd(C + 8 * i + 4 * v), c[i][v]));
    }
    return 2.0 * 6 * 8 * K * (double)reps;
}

/* C[8, 32] += A[8, K] B[K, 32], float32 (bench.c's fp32 probe shape). */
TGT512 static double probe_f32_avx512(const float *A, const float *B, float *C, int K, int reps) {
    for (int r = 0; r < reps; r++) {
        __m512 c[8][2];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) c[i][0] = c[i][1] = _mm512_setzero_ps();
        for (int k = 0; k < K; k++) {
            __m512 b0 = _mm512_load_ps(B + 32 * k), b1 = _mm512_load_ps(B + 32 * k + 16);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                __m512 a = _mm512_set1_ps(A[i * K + k]);
                c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
                c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++)
#pragma GCC unroll 2
            for (int v = 0; v < 2; v++)
                _mm512_store_ps(C + 32 * i + 16 * v, _mm512_add_ps(_mm512_load_ps(C + 32 * i + 16 * v), c[i][v]));
    }
    return 2.0 * 8 * 32 * K * (double)reps;
}

/* C[6, 16] += A[6, K] B[K, 16], float32. */
TGT2 static double probe_f32_avx2(const float *A, const float *B, float *C, int K, int reps) {
    for (int r = 0; r < reps; r++) {
        __m256 c[6][2];
#pragma GCC unroll 6
        for (int i = 0; i < 6; i++) c[i][0] = c[i][1] = _mm256_setzero_ps();
        for (int k = 0; k < K; k++) {
            __m256 b0 = _mm256_load_ps(B + 16 * k), b1 = _mm256_load_ps(B + 16 * k + 8);
#pragma GCC unroll 6
            for (int i = 0; i < 6; i++) {
                __m256 a = _mm256_broadcast_ss(A + i * K + k);
                c[i][0] = _mm256_fmadd_ps(a, b0, c[i][0]);
                c[i][1] = _mm256_fmadd_ps(a, b1, c[i][1]);
            }
        }
#pragma GCC unroll 6
        for (int i = 0; i < 6; i++)
#pragma GCC unroll 2
            for (int v = 0; v < 2; v++)
                _mm256_store_ps(C + 16 * i + 8 * v, _mm256_add_ps(_mm256_load_ps(C + 16 * i + 8 * v), c[i][v]));
    }
    return 2.0 * 6 * 16 * K * (double)reps;
}

typedef enum probe_kind { P_F64_AVX512, P_F64_AVX2, P_F32_AVX512, P_F32_AVX2 } probe_kind;

/* One thread's probe run on its own L1-resident operands (K = 64: at most
 * 16 KiB): flops done. */
static double probe_thread(probe_kind p) {
    enum { K = 64 };
    double *A = aligned_alloc(64, 8 * K * 8), *B = aligned_alloc(64, K * 32 * 8), *C = aligned_alloc(64, 8 * 32 * 8);
    if (!A || !B || !C) {
        free(A); free(B); free(C);
        return 0;
    }
    for (int i = 0; i < 8 * K; i++) A[i] = 1e-3 * (i % 7);
    for (int i = 0; i < K * 32; i++) B[i] = 1e-3 * (i % 5);
    memset(C, 0, 8 * 32 * 8);
    float *Af = (float *)A, *Bf = (float *)B, *Cf = (float *)C;
    double fl = 0;
    switch (p) {
    case P_F64_AVX512: fl = probe_f64_avx512(A, B, C, K, 20000); break;
    case P_F64_AVX2: fl = probe_f64_avx2(A, B, C, K, 40000); break;
    case P_F32_AVX512: fl = probe_f32_avx512(Af, Bf, Cf, K, 20000); break;
    case P_F32_AVX2: fl = probe_f32_avx2(Af, Bf, Cf, K, 40000); break;
    }
    volatile double sink = C[3];
    (void)sink;
    free(A); free(B); free(C);
    return fl;
}

/* flop/s of probe p on all threads at once, best of 5. */
static double probe_peak(probe_kind p) {
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        double fl = 0, t0 = lin_now();
#pragma omp parallel reduction(+ : fl)
        fl += probe_thread(p);
        double dt = lin_now() - t0;
        if (fl / dt > best) best = fl / dt;
    }
    return best;
}

/* ------------------------------------------------------------ shapes */

typedef struct lin_shape {
    const char *name;   /* checkpoint tensor (per layer) */
    const char *where;  /* which layers: all, csa, hca, model */
    int64_t N, K;       /* rows (out), cols (in) of one weight */
    int groups;         /* distinct weights of this shape run back to back */
    bool xsplit;        /* group g reads X columns [g K, (g+1) K) (wo_a) */
    moe_wfmt fmt;
} lin_shape;

/* V4-Flash (layouts/deepseek-v4-flash.md): hidden 4096, q_lora 1024, 64
 * heads x 512, o_groups 8 x o_lora 1024, index 64 heads x 128, compressor
 * d 512 (CSA coff 2, HCA coff 1) and 128 (indexer, coff 2), mHC 24 x 4 x
 * 4096, vocab 129280. FP8 = E4M3 with E8M0 128 x 128 tile scales. */
static const lin_shape lin_shapes[] = {
    {"attn.wq_a", "all", 1024, 4096, 1, false, MOE_WFMT_FP8_BLOCK},
    {"attn.wq_b", "all", 32768, 1024, 1, false, MOE_WFMT_FP8_BLOCK},
    {"attn.wkv", "all", 512, 4096, 1, false, MOE_WFMT_FP8_BLOCK},
    {"attn.wo_a (8 groups)", "all", 1024, 4096, 8, true, MOE_WFMT_FP8_BLOCK},
    {"attn.wo_b", "all", 4096, 8192, 1, false, MOE_WFMT_FP8_BLOCK},
    {"hc_attn_fn + hc_ffn_fn", "all", 24, 16384, 2, false, MOE_WFMT_F32},
    {"ffn.gate", "all", 256, 4096, 1, false, MOE_WFMT_BF16},
    {"ffn.shared_experts.w1 + w3", "all", 2048, 4096, 2, false, MOE_WFMT_FP8_BLOCK},
    {"ffn.shared_experts.w2", "all", 4096, 2048, 1, false, MOE_WFMT_FP8_BLOCK},
    {"attn.compressor.wkv + wgate (CSA)", "csa", 1024, 4096, 2, false, MOE_WFMT_BF16},
    {"attn.indexer.wq_b", "csa", 8192, 1024, 1, false, MOE_WFMT_FP8_BLOCK},
    {"attn.indexer.weights_proj", "csa", 64, 4096, 1, false, MOE_WFMT_BF16},
    {"attn.indexer.compressor.wkv + wgate", "csa", 256, 4096, 2, false, MOE_WFMT_BF16},
    {"attn.compressor.wkv + wgate (HCA)", "hca", 512, 4096, 2, false, MOE_WFMT_BF16},
    {"head (LM head)", "model", 129280, 4096, 1, false, MOE_WFMT_BF16},
};
enum { N_SHAPES = sizeof lin_shapes / sizeof lin_shapes[0] };

static const char *fmt_str(moe_wfmt f) {
    switch (f) {
    case MOE_WFMT_FP8_BLOCK: return "fp8";
    case MOE_WFMT_BF16: return "bf16";
    case MOE_WFMT_F32: return "f32";
    default: return "?";
    }
}

/* Stored bytes of one [N, K] weight, scales included. */
static size_t stored_bytes(moe_wfmt f, int64_t N, int64_t K) {
    switch (f) {
    case MOE_WFMT_FP8_BLOCK: return (size_t)(N * K) + (size_t)(((N + 127) / 128) * ((K + 127) / 128));
    case MOE_WFMT_BF16: return (size_t)(N * K) * 2;
    case MOE_WFMT_F32: return (size_t)(N * K) * 4;
    default: return 0;
    }
}

static void fill_codes(uint8_t *p, size_t n, uint64_t seed, int kind) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n / 8; i++) {
        uint64_t s = seed + i * 0x9E3779B97F4A7C15ull;
        uint64_t v = moe_splitmix64(&s);
        switch (kind) {
        case 1: v &= 0xBFBFBFBFBFBFBFBFull; break;                                /* E4M3 without NaN codes */
        case 2: v = (v & 0x807F807F807F807Full) | 0x3F003F003F003F00ull; break;   /* bf16 in +-[0.5, 1) */
        case 3: v = (v & 0x0707070707070707ull) | 0x7878787878787878ull; break;   /* E8M0 120..127 */
        case 4: v = (v & 0x807FFFFF807FFFFFull) | 0x3F0000003F000000ull; break;   /* f32 in +-[0.5, 1) */
        default: break;
        }
        memcpy(p + i * 8, &v, 8);
    }
    for (size_t i = n / 8 * 8; i < n; i++) p[i] = kind == 3 ? 127 : 0x38;
}

/* A weight (one group member) in its own buffers. */
typedef struct lin_weight {
    moe_weight w;
    uint8_t *data, *scale;
} lin_weight;

static int lin_weight_make(lin_weight *lw, moe_wfmt f, int64_t N, int64_t K, uint64_t seed) {
    memset(lw, 0, sizeof *lw);
    moe_weight *w = &lw->w;
    w->fmt = f;
    w->rows = N;
    w->cols = K;
    w->scale2 = 1.0f;
    w->name = "bench";
    size_t es = f == MOE_WFMT_FP8_BLOCK ? 1 : f == MOE_WFMT_BF16 ? 2 : 4;
    size_t nb = (size_t)(N * K) * es;
    lw->data = aligned_alloc(64, (nb + 63) & ~(size_t)63);
    if (!lw->data) return -1;
    fill_codes(lw->data, nb, seed, f == MOE_WFMT_FP8_BLOCK ? 1 : f == MOE_WFMT_BF16 ? 2 : 4);
    w->data = lw->data;
    if (f == MOE_WFMT_FP8_BLOCK) {
        w->scale_rows = (N + 127) / 128;
        w->scale_cols = (K + 127) / 128;
        size_t ns = (size_t)(w->scale_rows * w->scale_cols);
        lw->scale = malloc(ns + 8);
        if (!lw->scale) return -1;
        fill_codes(lw->scale, ns, seed ^ 0x55, 3);
        w->scale = lw->scale;
        w->scale_dtype = MOE_DTYPE_F8_E8M0;
    }
    return 0;
}

static void lin_weight_free(lin_weight *lw) {
    free(lw->data);
    free(lw->scale);
    memset(lw, 0, sizeof *lw);
}

/* ------------------------------------------------------------ rows */

typedef struct lin_row {
    const lin_shape *s;
    const char *prec, *isa;
    int64_t T;
    int copies;
    double med_ms, min_ms, max_ms, mem_ms, comp_ms, gflops, peak;
} lin_row;

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* Time shape s at T tokens in float64 (f64) or float32. */
static int run_linear(const lin_shape *s, const moe_cpu_kernels *k, bool f64, int64_t T, int iters, double bw,
                      double peak, lin_row *out) {
    size_t wb = stored_bytes(s->fmt, s->N, s->K) * (size_t)s->groups;
    int copies = (int)((128u << 20) / (wb ? wb : 1)) + 1;
    if (copies > 16) copies = 16;
    if (wb * (size_t)copies > ((size_t)3 << 30)) copies = 1;
    int nw = copies * s->groups;
    lin_weight *ws = calloc((size_t)nw, sizeof *ws);
    int64_t xcols = s->xsplit ? s->K * s->groups : s->K, ycols = s->N * s->groups;
    size_t es = f64 ? 8 : 4;
    void *X = aligned_alloc(64, ((size_t)(T * xcols) * es + 63) & ~(size_t)63);
    void *Y = aligned_alloc(64, ((size_t)(T * ycols) * es + 63) & ~(size_t)63);
    double *times = malloc((size_t)iters * sizeof *times);
    int rc = 0;
    if (!ws || !X || !Y || !times) rc = -1;
    for (int i = 0; i < nw && rc == 0; i++)
        if (lin_weight_make(&ws[i], s->fmt, s->N, s->K, 1000 + (uint64_t)i * 77) != 0) rc = -1;
    if (rc == 0) {
        uint64_t seed = 42;
        for (int64_t i = 0; i < T * xcols; i++) {
            double v = moe_splitmix64_gauss4(&seed);
            if (f64) ((double *)X)[i] = v;
            else ((float *)X)[i] = (float)v;
        }
        for (int it = -1; it < iters && rc == 0; it++) {
            int c = (it + 1) % copies;
            double t0 = lin_now();
            for (int g = 0; g < s->groups && rc == 0; g++) {
                const moe_weight *w = &ws[c * s->groups + g].w;
                int64_t xo = s->xsplit ? g * s->K : 0, yo = g * s->N;
                moe_error err;
                moe_status st = f64 ? moe_linear_f64_with(k, w, (double *)X + xo, xcols, T, (double *)Y + yo, ycols, &err)
                                    : moe_linear_f32_with(k, w, (float *)X + xo, xcols, T, (float *)Y + yo, ycols, &err);
                if (st != MOE_OK) {
                    fprintf(stderr, "bench --linear: %s\n", err.msg);
                    rc = -1;
                }
            }
            double dt = lin_now() - t0;
            if (it >= 0) times[it] = dt * 1e3;
        }
    }
    if (rc == 0) {
        qsort(times, (size_t)iters, sizeof *times, cmp_d);
        double flops = 2.0 * (double)T * (double)s->K * (double)s->N * s->groups;
        double bytes = (double)wb + (double)(T * xcols) * (double)es + (double)(T * ycols) * (double)es;
        out->s = s;
        out->prec = f64 ? "f64" : "f32";
        out->isa = f64 ? moe_linear_f64_isa(k) : k->isa;
        out->T = T;
        out->copies = copies;
        out->med_ms = times[iters / 2];
        out->min_ms = times[0];
        out->max_ms = times[iters - 1];
        out->mem_ms = bytes / bw * 1e3;
        out->comp_ms = peak > 0 ? flops / peak * 1e3 : 0;
        out->gflops = flops / (out->med_ms * 1e-3) * 1e-9;
        out->peak = peak;
    }
    for (int i = 0; i < nw && ws; i++) lin_weight_free(&ws[i]);
    free(ws); free(X); free(Y); free(times);
    return rc;
}

/* ------------------------------------------------------------ driver */

static const char lin_help[] =
    "usage: moeaudit bench --linear [--precision f64,f32] [--tokens LIST] [--shapes all|csa|hca|model|LIST]\n"
    "                      [--threads N] [--iters N] [--isa ref|avx2|avx512] [--max-gflop G]\n"
    "\n"
    "Time the dense linears of one DeepSeek-V4-Flash layer (moe_linear_f64 / moe_linear_f32, src/linalg)\n"
    "beside the memory floor (streaming read bandwidth) and the compute floor (the FMA peak of the ISA the\n"
    "row runs, float64 or float32), all measured in the same run.\n"
    "\n"
    "  --precision L  comma list of f64, f32 (default both)\n"
    "  --tokens L     comma list of T (default 1,16,256,4096)\n"
    "  --shapes S     comma list of row numbers (see the table) or a layer set: all (every layer), csa,\n"
    "                 hca (compressed layers' extras), model (the LM head); default: every row\n"
    "  --threads N    OpenMP threads (default: all)\n"
    "  --iters N      timed calls per row after one warm-up (default 15 for T=1, 9 for T<=16, 5 for\n"
    "                 T<=256, 3 above)\n"
    "  --isa I        kernel table (default: the best, or MOE_ISA)\n"
    "  --max-gflop G  skip rows whose one call exceeds G GFLOP (default 1500: the LM head at T=4096)\n";

static int lin_parse_list(const char *s, int64_t *out, int max) {
    int n = 0;
    while (*s && n < max) {
        char *end;
        long long v = strtoll(s, &end, 10);
        if (end == s || v <= 0 || (*end && *end != ',')) return -1;
        out[n++] = v;
        s = *end == ',' ? end + 1 : end;
    }
    return n;
}

static bool shape_selected(const char *sel, int idx) {
    if (!sel) return true;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", sel);
    for (char *save = NULL, *tk = strtok_r(buf, ",", &save); tk; tk = strtok_r(NULL, ",", &save)) {
        if (!strcmp(tk, lin_shapes[idx].where)) return true;
        char *end;
        long v = strtol(tk, &end, 10);
        if (!*end && v == idx) return true;
    }
    return false;
}

int moe_bench_linear_main(int argc, char **argv) {
    const char *precs = "f64,f32", *isa = NULL, *sel = NULL;
    int64_t tokens[16] = {1, 16, 256, 4096};
    int ntok = 4, threads = 0, iters = 0;
    double max_gflop = 1500;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--linear")) continue;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(lin_help, stdout);
            return 0;
        }
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!v) {
            fprintf(stderr, "bench --linear: %s needs a value\n%s", a, lin_help);
            return 2;
        }
        i++;
        if (!strcmp(a, "--precision")) precs = v;
        else if (!strcmp(a, "--tokens")) {
            if ((ntok = lin_parse_list(v, tokens, 16)) <= 0) {
                fprintf(stderr, "bench --linear: bad --tokens %s\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--shapes")) sel = v;
        else if (!strcmp(a, "--threads")) threads = atoi(v);
        else if (!strcmp(a, "--iters")) iters = atoi(v);
        else if (!strcmp(a, "--isa")) isa = v;
        else if (!strcmp(a, "--max-gflop")) max_gflop = atof(v);
        else {
            fprintf(stderr, "bench --linear: unknown option %s\n%s", a, lin_help);
            return 2;
        }
    }
    bool do64 = strstr(precs, "f64") != NULL, do32 = strstr(precs, "f32") != NULL;
    if (!do64 && !do32) {
        fprintf(stderr, "bench --linear: --precision takes f64, f32\n");
        return 2;
    }
#ifdef _OPENMP
    if (threads > 0) omp_set_num_threads(threads);
#endif
    if (isa) {
        moe_error err;
        if (moe_cpu_select(isa, &err) != MOE_OK) {
            fprintf(stderr, "bench --linear: %s\n", err.msg);
            return 2;
        }
    }
    const moe_cpu_kernels *k = moe_cpu_active();
    bool has512 = __builtin_cpu_supports("avx512f"), has2 = __builtin_cpu_supports("avx2") &&
                                                              __builtin_cpu_supports("fma");
    printf("measuring floors: streaming read of 1 GiB x15, float64 and float32 FMA micro-kernels x5 (%d threads)\n",
           lin_threads());
    fflush(stdout);
    double bw = moe_bench_read_bandwidth();
    double p64_512 = has512 ? probe_peak(P_F64_AVX512) : 0, p64_2 = has2 ? probe_peak(P_F64_AVX2) : 0;
    double p32_512 = has512 ? probe_peak(P_F32_AVX512) : 0, p32_2 = has2 ? probe_peak(P_F32_AVX2) : 0;
    const char *isa64 = moe_linear_f64_isa(k);
    double peak64 = !strcmp(isa64, "avx512") ? p64_512 : !strcmp(isa64, "avx2") ? p64_2 : fmax(p64_512, p64_2);
    double peak32 = !strcmp(k->isa, "avx512") ? p32_512 : !strcmp(k->isa, "avx2") ? p32_2 : fmax(p32_512, p32_2);
    printf("read bandwidth %.1f GB/s; float64 FMA peak avx512 %.1f, avx2 %.1f GFLOP/s; float32 FMA peak avx512 "
           "%.1f, avx2 %.1f GFLOP/s\nkernels: float64 tile %s (held to %.1f GFLOP/s), float32 table %s (held to "
           "%.1f GFLOP/s)\n\n",
           bw * 1e-9, p64_512 * 1e-9, p64_2 * 1e-9, p32_512 * 1e-9, p32_2 * 1e-9, isa64, peak64 * 1e-9, k->isa,
           peak32 * 1e-9);
    fflush(stdout);

    enum { MAXROWS = 2 * N_SHAPES * 16 };
    lin_row *rows = calloc(MAXROWS, sizeof *rows);
    if (!rows) return 1;
    int nrows = 0;
    for (int pi = 0; pi < 2; pi++) {
        bool f64 = pi == 0;
        if (f64 ? !do64 : !do32) continue;
        for (int si = 0; si < N_SHAPES; si++) {
            if (!shape_selected(sel, si)) continue;
            const lin_shape *s = &lin_shapes[si];
            for (int ti = 0; ti < ntok; ti++) {
                int64_t T = tokens[ti];
                double gf = 2.0 * (double)T * (double)s->K * (double)s->N * s->groups * 1e-9;
                if (gf > max_gflop) {
                    printf("  %-3s #%-2d %-36s T=%-5lld skipped: %.0f GFLOP per call > --max-gflop %.0f\n",
                           f64 ? "f64" : "f32", si, s->name, (long long)T, gf, max_gflop);
                    continue;
                }
                int n_it = iters > 0 ? iters : T <= 1 ? 15 : T <= 16 ? 9 : T <= 256 ? 5 : 3;
                lin_row *r = &rows[nrows];
                if (run_linear(s, k, f64, T, n_it, bw, f64 ? peak64 : peak32, r) != 0) {
                    fprintf(stderr, "bench --linear: out of memory for %s at T=%lld\n", s->name, (long long)T);
                    free(rows);
                    return 1;
                }
                nrows++;
                double fl = fmax(r->mem_ms, r->comp_ms);
                printf("  %-3s #%-2d %-36s T=%-5lld median %10.3f ms (min %.3f, max %.3f)  %6.1f GFLOP/s  %5.1f%% "
                       "of peak  floors mem %.3f / compute %.3f  ratio %.2f\n",
                       r->prec, si, s->name, (long long)T, r->med_ms, r->min_ms, r->max_ms, r->gflops,
                       100.0 * r->gflops * 1e9 / r->peak, r->mem_ms, r->comp_ms, r->med_ms / fl);
                fflush(stdout);
            }
        }
    }

    printf("\n| # | linear | layers | N x K (x groups) | weights | prec | isa | T | median ms | min ms | max ms | "
           "GFLOP/s | %% of peak | memory floor ms | compute floor ms | time / max(floors) |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < nrows; i++) {
        lin_row *r = &rows[i];
        double fl = fmax(r->mem_ms, r->comp_ms);
        char nk[64];
        snprintf(nk, sizeof nk, "%lld x %lld%s", (long long)r->s->N, (long long)r->s->K,
                 r->s->groups > 1 ? (r->s->groups == 8 ? " (x8)" : " (x2)") : "");
        printf("| %d | %s | %s | %s | %s | %s | %s | %lld | %.3f | %.3f | %.3f | %.1f | %.1f | %.3f | %.3f | %.2f |\n",
               (int)(r->s - lin_shapes), r->s->name, r->s->where, nk, fmt_str(r->s->fmt), r->prec, r->isa,
               (long long)r->T, r->med_ms, r->min_ms, r->max_ms, r->gflops, 100.0 * r->gflops * 1e9 / r->peak,
               r->mem_ms, r->comp_ms, r->med_ms / fl);
    }

    /* per-layer sums of the medians: every layer's linears, plus the
     * compressed layers' extras (the LM head is per model) */
    printf("\nsum of the linears' medians per layer (ms):\n| prec | T | sliding | CSA | HCA |\n|---|---|---|---|---|\n");
    for (int pi = 0; pi < 2; pi++)
        for (int ti = 0; ti < ntok; ti++) {
            double all = 0, csa = 0, hca = 0;
            int n_all = 0, n_csa = 0, n_hca = 0;
            for (int i = 0; i < nrows; i++) {
                lin_row *r = &rows[i];
                if (strcmp(r->prec, pi == 0 ? "f64" : "f32") || r->T != tokens[ti]) continue;
                if (!strcmp(r->s->where, "all")) all += r->med_ms, n_all++;
                if (!strcmp(r->s->where, "csa")) csa += r->med_ms, n_csa++;
                if (!strcmp(r->s->where, "hca")) hca += r->med_ms, n_hca++;
            }
            if (!n_all) continue;
            const char *pa = n_all == 9 ? "" : "(partial) ";
            printf("| %s | %lld | %s%.2f | %s%.2f | %s%.2f |\n", pi == 0 ? "f64" : "f32", (long long)tokens[ti], pa,
                   all, n_csa == 4 && !*pa ? "" : "(partial) ", all + csa, n_hca == 1 && !*pa ? "" : "(partial) ",
                   all + hca);
        }
    free(rows);
    return 0;
}
