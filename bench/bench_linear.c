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
#include "bench.h"
#include "core/core.h"
#include "cpu/kernels.h"
#include "experts/experts.h"
#include "experts/experts_fast.h"
#include "linalg/gemm.h"
#include "linalg/linear.h"
#include "moeaudit_hc.h"
#include "moeaudit_indexer.h"

#include "fma_micro.h"

#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* The kernel table of isa (the CLI resolved --isa / MOE_ISA): 0, or an exit code. */
static int lin_table(moe_isa isa, const char *who, const moe_cpu_kernels **k) {
    moe_error err;
    if (moe_cpu_table(isa, k, &err) != MOE_OK) {
        fprintf(stderr, "%s: %s\n", who, err.msg);
        return 2;
    }
    return 0;
}

static int lin_threads(void);

/* --clock cpu: time by the process's CPU time divided by the thread count
 * (what the work takes when every thread runs uncontended; OpenMP threads
 * spinning at barriers count, so it errs slow), for a machine shared with
 * other work. Default: wall clock. Set once by the driver before timing. */
static int g_cpu_clock;

static double lin_now(void) {
    struct timespec ts;
    clock_gettime(g_cpu_clock ? CLOCK_PROCESS_CPUTIME_ID : CLOCK_MONOTONIC, &ts);
    double s = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    return g_cpu_clock ? s / lin_threads() : s;
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
    case P_F32_AVX512: fl = bench_micro_f32_avx512(Af, Bf, Cf, K, 20000); break;
    case P_F32_AVX2: fl = bench_micro_f32_avx2(Af, Bf, Cf, K, 40000); break;
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

/* bench.h: the options come checked from the CLI (tools/cmd_bench.c). */
int moe_bench_linear(const moe_bench_linear_opts *o) {
    const char *sel = o->shapes;
    const int64_t *tokens = o->tokens;
    int ntok = o->ntok, threads = o->threads, iters = o->iters;
    double max_gflop = o->max_gflop;
    bool do64 = o->f64, do32 = o->f32;
    g_cpu_clock = o->cpu_clock;
    if (sel) { /* every item names a row or a layer set */
        char buf[256];
        snprintf(buf, sizeof buf, "%s", sel);
        for (char *save = NULL, *tk = strtok_r(buf, ",", &save); tk; tk = strtok_r(NULL, ",", &save)) {
            char *end;
            long v = strtol(tk, &end, 10);
            bool ok = (!*end && end != tk && v >= 0 && v < N_SHAPES) || !strcmp(tk, "all") || !strcmp(tk, "csa") ||
                      !strcmp(tk, "hca") || !strcmp(tk, "model");
            if (!ok) {
                fprintf(stderr, "moeaudit bench: --shapes: '%s' is neither a row number 0..%d nor all, csa, hca, model\n",
                        tk, N_SHAPES - 1);
                return 2;
            }
        }
    }
#ifdef _OPENMP
    if (threads > 0) omp_set_num_threads(threads);
#endif
    const moe_cpu_kernels *k = NULL;
    int trc = lin_table(o->isa, "bench --linear", &k);
    if (trc) return trc;
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
    if (g_cpu_clock) printf("clock: process CPU time / %d threads\n", lin_threads());
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

/* ======================================================================
 * moeaudit bench --layer-cost: the other parts of a V4-Flash layer, as unit
 * costs measured here times their exact counts for a T-token prompt
 * ====================================================================== */

/* V4-Flash attention shapes */
enum { A_HEADS = 64, A_DIM = 512, A_WIN = 128, A_TOPK = 512, A_IHEADS = 64, A_IDIM = 128 };

/* Entries a query at position t reads (window + compressed), summed over a
 * one-shot prompt of T tokens, per layer type. */
static void entry_counts(int64_t T, double *win, double *csa, double *hca, double *idx_vis) {
    *win = *csa = *hca = *idx_vis = 0;
    for (int64_t t = 0; t < T; t++) {
        *win += (double)(t + 1 < A_WIN ? t + 1 : A_WIN);
        int64_t v4 = (t + 1) / 4;
        *csa += (double)(v4 < A_TOPK ? v4 : A_TOPK);
        *hca += (double)((t + 1) / 128);
        *idx_vis += (double)v4;
    }
}

/* The attention of one query as the reference loop is written (per head:
 * dot products in channel order, s = s + q k; sink in the normaliser;
 * weighted sum p k), float64 or float32 arithmetic emulated in double with a
 * rounding after every operation (the whole-model reference's f32 mode). */
static void attend_scalar(const double *q, const double *const *ent, int64_t n, const double *sink, double *sc,
                          double *o, bool f32) {
#define FL(x) (f32 ? (double)(float)(x) : (x))
    const double scale = FL(1.0 / sqrt((double)A_DIM));
    for (int h = 0; h < A_HEADS; h++) {
        const double *qh = q + (size_t)h * A_DIM;
        double m = sink[h];
        for (int64_t k = 0; k < n; k++) {
            double dot = 0;
            for (int i = 0; i < A_DIM; i++) dot = FL(dot + FL(qh[i] * ent[k][i]));
            sc[k] = FL(dot * scale);
            if (sc[k] > m) m = sc[k];
        }
        double z = FL(exp(FL(sink[h] - m)));
        for (int64_t k = 0; k < n; k++) {
            sc[k] = FL(exp(FL(sc[k] - m)));
            z = FL(z + sc[k]);
        }
        double *oh = o + (size_t)h * A_DIM;
        for (int i = 0; i < A_DIM; i++) oh[i] = 0;
        for (int64_t k = 0; k < n; k++) {
            double p = FL(sc[k] / z);
            for (int i = 0; i < A_DIM; i++) oh[i] = FL(oh[i] + FL(p * ent[k][i]));
        }
    }
#undef FL
}

/* The same attention through moe_gemm_f64_rows (scores of all heads), a
 * float64 softmax with the sink, and moe_gemm_f64_cols (weighted sum).
 * S: [heads, n] scratch. */
static void attend_gemm(const moe_cpu_kernels *k, const double *q, const double *const *ent, int64_t n,
                        const double *sink, double *S, double *o, void *ws) {
    moe_gemm_f64_rows(k, q, A_DIM, A_HEADS, ent, n, A_DIM, S, n, ws);
    const double scale = 1.0 / sqrt((double)A_DIM);
    for (int h = 0; h < A_HEADS; h++) {
        double *s = S + (size_t)h * n, m = sink[h];
        for (int64_t j = 0; j < n; j++) {
            s[j] *= scale;
            if (s[j] > m) m = s[j];
        }
        double z = exp(sink[h] - m);
        for (int64_t j = 0; j < n; j++) {
            s[j] = exp(s[j] - m);
            z += s[j];
        }
        for (int64_t j = 0; j < n; j++) s[j] /= z;
    }
    moe_gemm_f64_cols(k, S, n, A_HEADS, ent, n, A_DIM, o, A_DIM, ws);
}

/* float32 through the CPU kernel table: the entries gathered into an F32
 * weight (scores) and its transpose (weighted sum), k->gemm, a float
 * softmax. E: [n, dim], Et: [dim, n], S: [heads, n] float scratch. */
static void attend_f32_table(const moe_cpu_kernels *k, const float *q, const float *const *ent, int64_t n,
                             const float *sink, float *E, float *Et, float *S, float *o) {
    for (int64_t j = 0; j < n; j++) memcpy(E + (size_t)j * A_DIM, ent[j], A_DIM * sizeof(float));
    for (int64_t j = 0; j < n; j++)
        for (int i = 0; i < A_DIM; i++) Et[(size_t)i * n + j] = E[(size_t)j * A_DIM + i];
    moe_weight we = {.fmt = MOE_WFMT_F32, .rows = n, .cols = A_DIM, .data = E,
                      .scale_dtype = MOE_DTYPE_F32, .scale2 = 1.0f, .name = "entries"};
    moe_weight wt = {.fmt = MOE_WFMT_F32, .rows = A_DIM, .cols = n, .data = Et,
                      .scale_dtype = MOE_DTYPE_F32, .scale2 = 1.0f, .name = "entries^T"};
    k->gemm(&we, 0, n, q, A_DIM, A_HEADS, S, n);
    const float scale = 1.0f / sqrtf((float)A_DIM);
    for (int h = 0; h < A_HEADS; h++) {
        float *s = S + (size_t)h * n, m = sink[h];
        for (int64_t j = 0; j < n; j++) {
            s[j] *= scale;
            if (s[j] > m) m = s[j];
        }
        float z = expf(sink[h] - m);
        for (int64_t j = 0; j < n; j++) {
            s[j] = expf(s[j] - m);
            z += s[j];
        }
        for (int64_t j = 0; j < n; j++) s[j] /= z;
    }
    k->gemm(&wt, 0, A_DIM, S, n, A_HEADS, o, A_DIM);
}

/* Seconds per (query, entry) of one attention variant: nq queries of n
 * entries each, threaded over queries; best of `reps`. variant: 0 scalar
 * f64, 1 scalar f32 (emulated), 2 gemm f64, 3 table f32. */
static double attn_unit(const moe_cpu_kernels *k, int variant, int64_t n, int nq, int reps) {
    const int64_t pool = n + 64;
    double *P = malloc((size_t)(pool * A_DIM) * 8), *Q = malloc((size_t)nq * A_HEADS * A_DIM * 8);
    float *Pf = malloc((size_t)(pool * A_DIM) * 4), *Qf = malloc((size_t)nq * A_HEADS * A_DIM * 4);
    double sink[A_HEADS];
    float sinkf[A_HEADS];
    uint64_t seed = 7;
    for (int64_t i = 0; i < pool * A_DIM; i++) Pf[i] = (float)(P[i] = moe_splitmix64_gauss4(&seed));
    for (int64_t i = 0; i < (int64_t)nq * A_HEADS * A_DIM; i++) Qf[i] = (float)(Q[i] = 0.05 * moe_splitmix64_gauss4(&seed));
    for (int h = 0; h < A_HEADS; h++) sinkf[h] = (float)(sink[h] = 0.1 * h);
    double best = 1e30;
    for (int rep = 0; rep < reps; rep++) {
        double t0 = lin_now();
#pragma omp parallel
        {
            const double **ent = malloc((size_t)n * sizeof *ent);
            const float **entf = malloc((size_t)n * sizeof *entf);
            double *S = malloc((size_t)(A_HEADS * n + n) * 8), *o = malloc(A_HEADS * A_DIM * 8);
            float *E = malloc((size_t)(n * A_DIM) * 4), *Et = malloc((size_t)(n * A_DIM) * 4);
            float *Sf = malloc((size_t)(A_HEADS * n) * 4), *of = malloc(A_HEADS * A_DIM * 4);
            void *ws = aligned_alloc(64, moe_gemm_f64_workspace());
#pragma omp for schedule(dynamic, 1)
            for (int qi = 0; qi < nq; qi++) {
                /* a window run then scattered entries, as a CSA query reads them */
                for (int64_t j = 0; j < n; j++) {
                    int64_t id = j < A_WIN ? j : A_WIN + (int64_t)((uint64_t)(j * 2654435761u + (uint64_t)qi) % (uint64_t)(pool - A_WIN));
                    ent[j] = P + id * A_DIM;
                    entf[j] = Pf + id * A_DIM;
                }
                const double *q = Q + (size_t)qi * A_HEADS * A_DIM;
                switch (variant) {
                case 0: attend_scalar(q, ent, n, sink, S, o, false); break;
                case 1: attend_scalar(q, ent, n, sink, S, o, true); break;
                case 2: attend_gemm(k, q, ent, n, sink, S, o, ws); break;
                default: attend_f32_table(k, Qf + (size_t)qi * A_HEADS * A_DIM, entf, n, sinkf, E, Et, Sf, of); break;
                }
            }
            free(ent); free(entf); free(S); free(o); free(E); free(Et); free(Sf); free(of); free(ws);
        }
        double dt = lin_now() - t0;
        if (dt < best) best = dt;
    }
    free(P); free(Q); free(Pf); free(Qf);
    return best / ((double)nq * (double)n);
}

/* Seconds per (query, visible entry) of the indexer scores: 64 queries at
 * the end of a T-token prompt against its T / 4 entries. mode 0: float64
 * moe_idx_scores_ref, one query per call, threaded over queries (as the
 * whole-model reference calls it); 1: float32 moe_idx_scores, one call for
 * the block; 2: float64 through moe_gemm_f64_rows (a proposal: the same
 * scores up to the summation order). Also the top-k of the block (*topk_s,
 * seconds per query). */
static double idx_unit(const moe_cpu_kernels *kt, int64_t T, int mode, int reps, double *topk_s) {
    const int B = 64;
    const int64_t S = T / 4;
    double *q = malloc((size_t)B * A_IHEADS * A_IDIM * 8), *k = malloc((size_t)S * A_IDIM * 8);
    double *w = malloc((size_t)B * A_IHEADS * 8), *sc = malloc((size_t)(B * S) * 8);
    int64_t pos[64];
    int32_t *sel = malloc((size_t)B * A_TOPK * 4);
    uint64_t seed = 11;
    for (int64_t i = 0; i < (int64_t)B * A_IHEADS * A_IDIM; i++) q[i] = moe_splitmix64_gauss4(&seed);
    for (int64_t i = 0; i < S * A_IDIM; i++) k[i] = moe_splitmix64_gauss4(&seed);
    for (int64_t i = 0; i < (int64_t)B * A_IHEADS; i++) w[i] = 0.01 * moe_splitmix64_gauss4(&seed);
    for (int t = 0; t < B; t++) pos[t] = T - B + t;
    moe_idx_shape sh = {.T = B, .S = S, .heads = A_IHEADS, .dim = A_IDIM, .ratio = 4};
    double vis = 0;
    for (int t = 0; t < B; t++) vis += (double)((pos[t] + 1) / 4 < S ? (pos[t] + 1) / 4 : S);
    double best = 1e30, best_tk = 1e30;
    void *ws = malloc(moe_idx_workspace_size(&sh));
    const double **kp = malloc((size_t)S * sizeof *kp);
    for (int64_t s = 0; s < S; s++) kp[s] = k + s * A_IDIM;
    for (int rep = 0; rep < reps; rep++) {
        double t0 = lin_now();
        if (mode == 2) {
            /* float64 through moe_gemm_f64_rows: the heads' dot products with
             * every visible key as one product, then ReLU and the weighted
             * head sum */
#pragma omp parallel
            {
                void *gw = aligned_alloc(64, moe_gemm_f64_workspace());
                double *D = malloc((size_t)(A_IHEADS * S) * 8);
#pragma omp for schedule(dynamic, 1)
                for (int t = 0; t < B; t++) {
                    int64_t nv = (pos[t] + 1) / 4 < S ? (pos[t] + 1) / 4 : S;
                    moe_gemm_f64_rows(kt, q + (size_t)t * A_IHEADS * A_IDIM, A_IDIM, A_IHEADS, kp, nv, A_IDIM, D, nv, gw);
                    double *row = sc + (size_t)t * S;
                    for (int64_t s2 = 0; s2 < nv; s2++) {
                        double acc = 0;
                        for (int h = 0; h < A_IHEADS; h++) acc += w[(size_t)t * A_IHEADS + h] * fmax(D[(size_t)h * nv + s2], 0.0);
                        row[s2] = acc;
                    }
                    for (int64_t s2 = nv; s2 < S; s2++) row[s2] = -INFINITY;
                }
                free(gw);
                free(D);
            }
        } else if (mode == 0) {
#pragma omp parallel for schedule(dynamic, 1)
            for (int t = 0; t < B; t++) {
                moe_idx_shape one = sh;
                one.T = 1;
                moe_idx_scores_ref(&one, q + (size_t)t * A_IHEADS * A_IDIM, k, w + (size_t)t * A_IHEADS, pos + t,
                                   false, sc + (size_t)t * S);
            }
        } else {
            moe_idx_opts io = moe_idx_opts_default();
            io.hadamard = false;
            moe_idx_scores(&sh, &io, q, k, w, pos, sc, ws);
        }
        double t1 = lin_now();
        moe_error err;
        if (moe_idx_topk(&sh, sc, pos, A_TOPK, sel, &err) != MOE_OK) fprintf(stderr, "bench --layer-cost: %s\n", err.msg);
        double t2 = lin_now();
        if (t1 - t0 < best) best = t1 - t0;
        if (t2 - t1 < best_tk) best_tk = t2 - t1;
    }
    *topk_s = best_tk / B;
    free(q); free(k); free(w); free(sc); free(sel); free(ws); free(kp);
    return best / vis;
}

/* Seconds per (entry, channel, slot) of the compressors' gated pooling:
 * softmax over `slots` per channel of the gate plus the weighted sum of the
 * projections (float64, libm exp), threaded over entries. */
static double pool_unit(int slots, int dim, int entries, int reps) {
    double *g = malloc((size_t)entries * slots * dim * 8), *v = malloc((size_t)entries * slots * dim * 8);
    double *out = malloc((size_t)entries * dim * 8);
    uint64_t seed = 5;
    for (int64_t i = 0; i < (int64_t)entries * slots * dim; i++) {
        g[i] = moe_splitmix64_gauss4(&seed);
        v[i] = moe_splitmix64_gauss4(&seed);
    }
    double best = 1e30;
    for (int rep = 0; rep < reps; rep++) {
        double t0 = lin_now();
#pragma omp parallel for schedule(static)
        for (int e = 0; e < entries; e++) {
            const double *ge = g + (size_t)e * slots * dim, *ve = v + (size_t)e * slots * dim;
            for (int c = 0; c < dim; c++) {
                double m = -INFINITY, z = 0, acc = 0;
                for (int s = 0; s < slots; s++) m = fmax(m, ge[s * dim + c]);
                for (int s = 0; s < slots; s++) {
                    double p = exp(ge[s * dim + c] - m);
                    z += p;
                    acc += p * ve[s * dim + c];
                }
                out[(size_t)e * dim + c] = acc / z;
            }
        }
        double dt = lin_now() - t0;
        if (dt < best) best = dt;
    }
    volatile double sink = out[3];
    (void)sink;
    free(g); free(v); free(out);
    return best / ((double)entries * slots * dim);
}

/* mHC (moe_hc_forward: the 24 x 16384 mix linear, Sinkhorn, collapse) on T
 * tokens at V4-Flash shapes, seconds per call, threaded over token blocks. */
static double hc_call(int64_t T, moe_hc_prec prec, int reps) {
    moe_hc_config cfg = {4, 4096, 20, 1e-6, 1e-6};
    const int64_t mix = 24, nH = 4 * 4096;
    double *fn = malloc((size_t)(mix * nH) * 8), base[24], scale[3] = {0.5, 0.5, 0.5};
    uint64_t seed = 3;
    for (int64_t i = 0; i < mix * nH; i++) fn[i] = 0.01 * moe_splitmix64_gauss4(&seed);
    for (int i = 0; i < 24; i++) base[i] = 0.1 * moe_splitmix64_gauss4(&seed);
    moe_hc_weights *w = NULL;
    moe_error err;
    if (moe_hc_weights_init(&cfg, fn, base, scale, &w, &err) != MOE_OK) {
        fprintf(stderr, "bench --layer-cost: %s\n", err.msg);
        free(fn);
        return 0;
    }
    double *st = malloc((size_t)(T * nH) * 8), *pre = malloc((size_t)T * 4 * 8), *post = malloc((size_t)T * 4 * 8);
    double *comb = malloc((size_t)T * 16 * 8), *col = malloc((size_t)(T * 4096) * 8);
    for (int64_t i = 0; i < T * nH; i++) st[i] = moe_splitmix64_gauss4(&seed);
    double best = 1e30;
    for (int rep = 0; rep < reps; rep++) {
        double t0 = lin_now();
#pragma omp parallel
        {
            void *ws = malloc(moe_hc_workspace_size(&cfg));
#pragma omp for schedule(dynamic, 1)
            for (int64_t b = 0; b < T; b += 64) {
                int64_t n = T - b < 64 ? T - b : 64;
                moe_hc_forward(w, prec, st + b * nH, n, pre + b * 4, post + b * 4, comb + b * 16, col + b * 4096, ws);
            }
            free(ws);
        }
        double dt = lin_now() - t0;
        if (dt < best) best = dt;
    }
    moe_hc_weights_free(w);
    free(fn); free(st); free(pre); free(post); free(comb); free(col);
    return best;
}

/* The float64 expert as src/experts wrote it before it moved onto
 * src/linalg (a copy, for the before/after row): each weight row decoded by
 * moe_weight_row_f64, dot products s = s + x w in index order, four tokens
 * interleaved. scratch: max(H, I) + 2 n I doubles. */
static void expert_scalar_f64(const moe_weight *w1, const moe_weight *w3, const moe_weight *w2, double L,
                              const double *X, int64_t n, double *Y, double *scratch) {
    const int64_t H = w1->cols, I = w1->rows;
    double *row = scratch, *A = row + (H > I ? H : I), *U = A + n * I;
    for (int pass = 0; pass < 3; pass++) {
        const moe_weight *w = pass == 0 ? w1 : pass == 1 ? w3 : w2;
        const double *in = pass < 2 ? X : A;
        double *out = pass == 0 ? A : pass == 1 ? U : Y;
        const int64_t len = w->cols, nout = w->rows;
        if (pass == 2)
            for (int64_t i = 0; i < n * I; i++) {
                double g = A[i] > L ? L : A[i], u = U[i] > L ? L : U[i] < -L ? -L : U[i];
                A[i] = g / (1.0 + exp(-g)) * u;
            }
        for (int64_t r = 0; r < nout; r++) {
            moe_weight_row_f64(w, r, row);
            for (int64_t t = 0; t < n; t++) {
                const double *x = in + t * len;
                double acc = 0.0;
                for (int64_t h = 0; h < len; h++) acc += x[h] * row[h];
                out[t * nout + r] = acc;
            }
        }
    }
}

/* Routed MXFP4 experts (w1, w3 [2048, 4096], w2 [4096, 2048]) on n tokens
 * each: seconds per expert with all threads busy, best of reps over `ne`
 * distinct experts. how: 0 the float64 expert before this branch
 * (expert_scalar_f64), 1 moe_expert_ref (the MoE block's float64 path, now
 * through moe_linear_f64_ws), both one expert per thread as block.c runs
 * them; 2 moe_experts_fast (float32 kernel table: all `ne` experts in one
 * call, split over threads by (expert, row range), as block.c). */
static double expert_call(const moe_cpu_kernels *k, int how, int64_t n, int ne, int reps) {
    const int64_t H = 4096, I = 2048;
    lin_weight *ws = calloc((size_t)ne * 3, sizeof *ws);
    double best = 1e30;
    double *X = malloc((size_t)(n * H) * 8), *Y = malloc((size_t)(n * H) * 8);
    float *Xf = malloc((size_t)(n * H) * 4), *Yf = malloc((size_t)(ne * n * H) * 4); /* one Y per job */
    moe_expert_job *jobs = calloc((size_t)ne, sizeof *jobs);
    uint64_t seed = 9;
    for (int64_t i = 0; i < n * H; i++) Xf[i] = (float)(X[i] = moe_splitmix64_gauss4(&seed));
    for (int e = 0; e < ne; e++) {
        /* MXFP4: random codes, E8M0 scales 120..127 */
        for (int p = 0; p < 3; p++) {
            lin_weight *lw = &ws[e * 3 + p];
            int64_t r = p == 2 ? H : I, c = p == 2 ? I : H;
            lw->w.fmt = MOE_WFMT_MXFP4;
            lw->w.rows = r;
            lw->w.cols = c;
            lw->w.scale2 = 1.0f;
            lw->w.name = "expert";
            lw->data = aligned_alloc(64, (size_t)(r * c / 2));
            lw->scale = malloc((size_t)(r * c / 32));
            fill_codes(lw->data, (size_t)(r * c / 2), 100 + (uint64_t)(e * 3 + p), 0);
            fill_codes(lw->scale, (size_t)(r * c / 32), 200 + (uint64_t)(e * 3 + p), 3);
            lw->w.data = lw->data;
            lw->w.scale = lw->scale;
            lw->w.scale_dtype = MOE_DTYPE_F8_E8M0;
            lw->w.scale_rows = r;
            lw->w.scale_cols = c / 32;
        }
    }
    for (int rep = 0; rep < reps; rep++) {
        double t0 = lin_now();
        if (how < 2) {
            /* as the MoE block runs its float64 experts: one expert per thread */
#pragma omp parallel
            {
                size_t ss = moe_expert_scratch(H, I, n), so = (size_t)((H > I ? H : I) + 2 * n * I);
                double *Yt = malloc((size_t)(n * H) * 8), *st = malloc((ss > so ? ss : so) * 8);
#pragma omp for schedule(dynamic, 1)
                for (int e = 0; e < ne; e++) {
                    if (how == 0) expert_scalar_f64(&ws[e * 3].w, &ws[e * 3 + 1].w, &ws[e * 3 + 2].w, 10.0, X, n, Yt, st);
                    else moe_expert_ref(&ws[e * 3].w, &ws[e * 3 + 1].w, &ws[e * 3 + 2].w, 10.0, MOE_ACT_EXACT, X, n, Yt, st);
                }
                free(Yt);
                free(st);
            }
        } else {
            /* as block.c runs them: all experts of the call in one moe_experts_fast */
            for (int e = 0; e < ne; e++)
                jobs[e] = (moe_expert_job){&ws[e * 3].w, &ws[e * 3 + 1].w, &ws[e * 3 + 2].w, Xf, Yf + (size_t)e * (size_t)(n * H), n};
            int nth = moe_experts_fast_threads();
            size_t sb = moe_experts_fast_scratch(k, MOE_ACT_EXACT, jobs, ne, nth);
            void *scr = aligned_alloc(64, (sb + 63) & ~(size_t)63);
            if (scr) moe_experts_fast(k, 10.0, MOE_ACT_EXACT, jobs, ne, scr, nth);
            free(scr);
        }
        double dt = (lin_now() - t0) / ne;
        if (dt < best) best = dt;
    }
    for (int i = 0; i < ne * 3; i++) lin_weight_free(&ws[i]);
    free(ws); free(X); free(Y); free(Xf); free(Yf); free(jobs);
    return best;
}

/* bench.h: the options come checked from the CLI (tools/cmd_bench.c). */
int moe_bench_layer_cost(const moe_bench_layer_opts *o) {
    int64_t T = o->tokens;
    int threads = o->threads, reps = o->reps;
    g_cpu_clock = o->cpu_clock;
    if (T < 128 || reps < 1) {
        fprintf(stderr, "bench --layer-cost: --tokens must be >= 128 and --iters >= 1\n");
        return 2;
    }
#ifdef _OPENMP
    if (threads > 0) omp_set_num_threads(threads);
#endif
    const moe_cpu_kernels *k = NULL;
    int trc = lin_table(o->isa, "bench --layer-cost", &k);
    if (trc) return trc;
    double win, csa, hca, ivis;
    entry_counts(T, &win, &csa, &hca, &ivis);
    printf("V4-Flash layer, T = %lld prompt tokens, %d threads, kernels %s (float64 tile %s), clock %s\n",
           (long long)T, lin_threads(), k->isa, moe_linear_f64_isa(k), g_cpu_clock ? "CPU time / threads" : "wall");
    printf("entries read by the attention, summed over queries: window %.0f, CSA compressed %.0f, HCA compressed "
           "%.0f; indexer (query, visible entry) pairs %.0f\n\n",
           win, csa, hca, ivis);
    fflush(stdout);

    /* 1. dense linears, one call of T tokens each */
    double lin64[3] = {0}, lin32[3] = {0}, sh64 = 0, sh32 = 0; /* all, csa, hca; shared expert */
    for (int si = 0; si < N_SHAPES; si++) {
        const lin_shape *s = &lin_shapes[si];
        if (!strcmp(s->where, "model")) continue;
        bool shared = strstr(s->name, "shared_experts") != NULL;
        for (int pi = 0; pi < 2; pi++) {
            lin_row r;
            if (run_linear(s, k, pi == 0, T, reps, 1e12, 1e12, &r) != 0) return 1;
            double sec = r.med_ms * 1e-3;
            int where = !strcmp(s->where, "all") ? 0 : !strcmp(s->where, "csa") ? 1 : 2;
            if (shared) *(pi == 0 ? &sh64 : &sh32) += sec;
            else (pi == 0 ? lin64 : lin32)[where] += sec;
            printf("  linear %-36s %s %8.3f s\n", s->name, pi == 0 ? "f64" : "f32", sec);
            fflush(stdout);
        }
    }

    /* 2. attention core: unit cost per (query, entry) at the entry counts
     * each layer type reads at the end of the prompt */
    static const int64_t ns[3] = {A_WIN, A_WIN + A_TOPK, A_WIN + 32}; /* sliding, CSA, HCA */
    double au[3][4];
    static const char *const vname[4] = {"scalar f64", "scalar f32 (emulated)", "gemm f64", "table f32"};
    for (int li = 0; li < 3; li++)
        for (int v = 0; v < 4; v++) {
            int nq = v < 2 ? 4 * lin_threads() : 16 * lin_threads();
            au[li][v] = attn_unit(k, v, ns[li], nq, reps);
            printf("  attention core, %4lld entries per query, %-22s %8.1f ns per (query, entry)\n",
                   (long long)ns[li], vname[v], au[li][v] * 1e9);
            fflush(stdout);
        }
    double att[3][4];
    for (int v = 0; v < 4; v++) {
        att[0][v] = win * au[0][v];
        att[1][v] = (win + csa) * au[1][v];
        att[2][v] = (win + hca) * au[2][v];
    }

    /* 3. indexer scores and top-k (CSA) */
    double tk64, tk32, tkg;
    double iu64 = idx_unit(k, T, 0, reps, &tk64), iu32 = idx_unit(k, T, 1, reps, &tk32),
           iug = idx_unit(k, T, 2, reps, &tkg);
    double idx64 = iu64 * ivis + tk64 * (double)T, idx32 = iu32 * ivis + tk32 * (double)T,
           idxg = iug * ivis + tk64 * (double)T;
    printf("  indexer scores f64 %.1f ns, f32 %.1f ns, f64 through moe_gemm_f64_rows %.1f ns per (query, visible "
           "entry); top-%d %.1f / %.1f us per query\n",
           iu64 * 1e9, iu32 * 1e9, iug * 1e9, A_TOPK, tk64 * 1e6, tk32 * 1e6);

    /* 4. compressors' pooling */
    double pu8 = pool_unit(8, 512, 256, reps), pu128 = pool_unit(128, 512, 8, reps);
    double ncsa = (double)(T / 4);
    double pool_csa = ncsa * (512.0 * 8) * pu8 + ncsa * (128.0 * 8) * pu8;
    double pool_hca = (double)(T / 128) * 512.0 * 128 * pu128;
    printf("  compressor pooling %.1f ns (8 slots) / %.1f ns (128 slots) per (entry, channel, slot)\n", pu8 * 1e9,
           pu128 * 1e9);

    /* 5. mHC, two sites per layer */
    double hc64 = 2 * hc_call(T, MOE_HC_REF, reps), hc32 = 2 * hc_call(T, MOE_HC_F32, reps);
    printf("  mHC (2 sites) f64 %.3f s, f32 %.3f s\n", hc64, hc32);
    fflush(stdout);

    /* 6. MoE block: routed experts at T K / E tokens each, the shared one at T */
    const int64_t per = T * 6 / 256;
    int ne = 2 * lin_threads();
    double e_old = expert_call(k, 0, per, ne, 1), e_ref = expert_call(k, 1, per, ne, reps),
           e_f32 = expert_call(k, 2, per, ne, reps);
    /* the shared expert: the old loop's cost is linear in the tokens; the
     * new one is the linear rows' (one call of T tokens) */
    double moe_old = 256 * e_old + e_old * (double)T / (double)per;
    double moe_ref = 256 * e_ref + sh64, moe_f32 = 256 * e_f32 + sh32;
    printf("  MoE expert at %lld tokens: before (scalar rows) %.3f s, moe_expert_ref (moe_linear_f64_ws) %.3f s, "
           "moe_experts_fast (f32) %.3f s per expert\n\n",
           (long long)per, e_old, e_ref, e_f32);

    printf("| part | sliding f64 | CSA f64 | HCA f64 | sliding f32 | CSA f32 | HCA f32 |\n|---|---|---|---|---|---|---|\n");
    printf("| dense linears (attention, compressors, indexer, mHC mixes, router; one call of T tokens) | %.2f | %.2f | "
           "%.2f | %.2f | %.2f | %.2f |\n",
           lin64[0], lin64[0] + lin64[1], lin64[0] + lin64[2], lin32[0], lin32[0] + lin32[1], lin32[0] + lin32[2]);
    printf("| attention core, scalar loops (f64: before this branch; f32: emulated, as the model runs it) | %.2f | "
           "%.2f | %.2f | %.2f | %.2f | %.2f |\n",
           att[0][0], att[1][0], att[2][0], att[0][1], att[1][1], att[2][1]);
    printf("| attention core, GEMM tiles (f64: as the model runs it) / kernel table (f32: proposal) | %.2f | %.2f | "
           "%.2f | %.2f | %.2f | %.2f |\n",
           att[0][2], att[1][2], att[2][2], att[0][3], att[1][3], att[2][3]);
    printf("| indexer scores + top-k (moe_idx_scores_ref / moe_idx_scores) | - | %.2f | - | - | %.2f | - |\n", idx64,
           idx32);
    printf("| indexer scores through moe_gemm_f64_rows (proposal) + top-k | - | %.2f | - | - | - | - |\n", idxg);
    printf("| compressor pooling | - | %.2f | %.2f | - | %.2f | %.2f |\n", pool_csa, pool_hca, pool_csa, pool_hca);
    printf("| mHC (2 sites, incl. its 24 x 16384 mix) | %.2f | %.2f | %.2f | %.2f | %.2f | %.2f |\n", hc64, hc64, hc64,
           hc32, hc32, hc32);
    printf("| MoE block, experts before this branch (f64 scalar rows) | %.2f | %.2f | %.2f | - | - | - |\n", moe_old,
           moe_old, moe_old);
    printf("| MoE block (f64: moe_expert_ref through moe_linear_f64_ws; f32: moe_experts_fast) | %.2f | %.2f | %.2f | "
           "%.2f | %.2f | %.2f |\n",
           moe_ref, moe_ref, moe_ref, moe_f32, moe_f32, moe_f32);
    double base64[3] = {lin64[0] + hc64, lin64[0] + lin64[1] + idx64 + pool_csa + hc64,
                        lin64[0] + lin64[2] + pool_hca + hc64};
    double base32[3] = {lin32[0] + hc32, lin32[0] + lin32[1] + idx32 + pool_csa + hc32,
                        lin32[0] + lin32[2] + pool_hca + hc32};
    printf("| **total, as the code runs now** | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f |\n",
           base64[0] + att[0][2] + moe_ref, base64[1] + att[1][2] + moe_ref, base64[2] + att[2][2] + moe_ref,
           base32[0] + att[0][1] + moe_f32, base32[1] + att[1][1] + moe_f32, base32[2] + att[2][1] + moe_f32);
    printf("| **total with the proposals (f64 indexer via gemm; f32 attention via the kernel table)** | %.1f | %.1f | "
           "%.1f | %.1f | %.1f | %.1f |\n",
           base64[0] + att[0][2] + moe_ref, base64[1] - idx64 + idxg + att[1][2] + moe_ref,
           base64[2] + att[2][2] + moe_ref, base32[0] + att[0][3] + moe_f32, base32[1] + att[1][3] + moe_f32,
           base32[2] + att[2][3] + moe_f32);
    printf("(seconds per layer; norms, RoPE, routing and the residual arithmetic are not counted)\n");
    return 0;
}
