/*
 * moeaudit bench: the routed experts of one MoE block (gate, up, down for all
 * T x K assignments), timed against floors measured in the same run.
 *
 *   memory floor  = (stored bytes of every expert the iteration touches, incl.
 *                    scales, + X in [T, H] f32 + output [T, H] f32)
 *                   / streaming read bandwidth (1 GiB, all threads, best of 5 x 3
 *                   prefetch distances)
 *   compute floor = 2 T K 3 H I / peak of the arithmetic the row uses:
 *                   --act f32 rows: the fp32 FMA peak (a register-blocked
 *                   AVX-512 GEMM micro-kernel on L1-resident data, all
 *                   threads, best of 5; every weight format is computed with
 *                   fp32 FMAs under f32 activations);
 *                   --act bf16 rows: the vdpbf16ps peak, measured the same
 *                   way (bf16 pairs, fp32 accumulators), when the kernels
 *                   multiply that row with vdpbf16ps (a gemm_bf16act entry;
 *                   MXFP4, NVFP4, BF16 weights), else the fp32 peak (FP8, or
 *                   no AVX512_BF16: the rows then run fp32 FMAs)
 *
 * Each iteration draws fresh top-K expert ids (distinct per token) uniformly
 * over all materialised experts, gathers each expert's tokens and runs
 * moe_expert_fast on them (bf16 rows: X rounded to bf16 first, act bf16, so
 * the SwiGLU output is rounded to bf16 too). Weights are random bytes
 * restricted to valid, finite codes. Warm-up 2 iterations, then --iters
 * (default by T).
 */
#include "bench/bench.h"
#include "core/core.h"
#include "cpu/kernels.h"
#include "experts/experts_fast.h"
#include "formats/act.h"
#include "moe_formats.h"
#include "tools/cli.h"

#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#define BENCH_TGT __attribute__((target("avx512f,fma")))
#define BENCH_TGT_BF16 __attribute__((target("avx512f,avx512bw,avx512bf16")))

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int bench_threads(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}

/* ------------------------------------------------------------- floors */

/* Sum of p[0..n) (n % 128 == 0): 8 accumulators, software prefetch `pf`
 * bytes ahead (0: none). The kernels prefetch explicitly, so the floor must
 * too, or it would understate the bandwidth they can reach. */
BENCH_TGT static double read_sum_avx512(const float *p, size_t n, size_t pf) {
    __m512 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
    for (size_t i = 0; i + 128 <= n; i += 128) {
        if (pf) {
            _mm_prefetch((const char *)(p + i) + pf, _MM_HINT_T0);
            _mm_prefetch((const char *)(p + i) + pf + 64, _MM_HINT_T0);
            _mm_prefetch((const char *)(p + i) + pf + 128, _MM_HINT_T0);
            _mm_prefetch((const char *)(p + i) + pf + 192, _MM_HINT_T0);
            _mm_prefetch((const char *)(p + i) + pf + 256, _MM_HINT_T0);
            _mm_prefetch((const char *)(p + i) + pf + 320, _MM_HINT_T0);
            _mm_prefetch((const char *)(p + i) + pf + 384, _MM_HINT_T0);
            _mm_prefetch((const char *)(p + i) + pf + 448, _MM_HINT_T0);
        }
#pragma GCC unroll 8
        for (int j = 0; j < 8; j++) a[j] = _mm512_add_ps(a[j], _mm512_load_ps(p + i + 16 * j));
    }
    for (int j = 1; j < 8; j++) a[0] = _mm512_add_ps(a[0], a[j]);
    return _mm512_reduce_add_ps(a[0]);
}

static double read_sum_scalar(const float *p, size_t n) {
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i + 4 <= n; i += 4) {
        s0 += p[i];
        s1 += p[i + 1];
        s2 += p[i + 2];
        s3 += p[i + 3];
    }
    return (double)(s0 + s1 + s2 + s3);
}

/* Streaming read bandwidth in bytes/s: 1 GiB, every thread reads its part;
 * best of 5 repetitions x 3 prefetch distances (none, 1 KiB, 4 KiB). */
static double measure_bandwidth(bool avx512) {
    size_t bytes = (size_t)1 << 30, n = bytes / 4;
    float *buf = aligned_alloc(64, bytes);
    if (!buf) return 0;
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) buf[i] = (float)(i & 1023) * 1e-3f;
    double best = 0;
    volatile double sink = 0;
    static const size_t pfs[3] = {0, 1024, 4096};
    for (int rep = 0; rep < 15; rep++) {
        size_t pf = pfs[rep % 3];
        double t0 = now_s(), tot = 0;
#pragma omp parallel reduction(+ : tot)
        {
            int tid = 0, nth = 1;
#ifdef _OPENMP
            tid = omp_get_thread_num();
            nth = omp_get_num_threads();
#endif
            size_t per = (n / (size_t)nth) & ~(size_t)127;
            const float *p = buf + per * (size_t)tid;
            tot += avx512 ? read_sum_avx512(p, per, pf) : read_sum_scalar(p, per);
        }
        double dt = now_s() - t0;
        sink += tot;
        if (bytes / dt > best) best = bytes / dt;
    }
    (void)sink;
    free(buf);
    return best;
}

/* C[8, 32] += A[8, K] . B[K, 32]: 16 accumulators, 2 loads + 8 broadcasts
 * per 16 FMAs. A and B stay in L1. Returns flops done. */
BENCH_TGT static double gemm_micro(const float *A, const float *B, float *C, int K, int reps) {
    for (int r = 0; r < reps; r++) {
        __m512 c[8][2];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) c[i][0] = c[i][1] = _mm512_setzero_ps();
        for (int k = 0; k < K; k++) {
            __m512 b0 = _mm512_load_ps(B + k * 32), b1 = _mm512_load_ps(B + k * 32 + 16);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                __m512 a = _mm512_set1_ps(A[i * K + k]);
                c[i][0] = _mm512_fmadd_ps(a, b0, c[i][0]);
                c[i][1] = _mm512_fmadd_ps(a, b1, c[i][1]);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            _mm512_store_ps(C + i * 32, _mm512_add_ps(_mm512_load_ps(C + i * 32), c[i][0]));
            _mm512_store_ps(C + i * 32 + 16, _mm512_add_ps(_mm512_load_ps(C + i * 32 + 16), c[i][1]));
        }
    }
    return 2.0 * 8 * 32 * K * (double)reps;
}

/* C[8, 32] += A[8, K] . B[K, 32] in bf16 pairs with fp32 accumulation (K
 * even): per pair of k, 2 loads of 32 bf16 of B (16 columns x 2 k each), 8
 * broadcasts of an A pair, 16 vdpbf16ps into 16 accumulators, the layout of
 * gemm_micro with two k per instruction. Returns flops done (2 per
 * multiply-add). */
BENCH_TGT_BF16 static double gemm_micro_bf16(const uint16_t *A, const uint16_t *B, float *C, int K, int reps) {
    for (int r = 0; r < reps; r++) {
        __m512 c[8][2];
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) c[i][0] = c[i][1] = _mm512_setzero_ps();
        for (int k = 0; k < K; k += 2) {
            __m512bh b0 = (__m512bh)_mm512_load_si512(B + k * 32), b1 = (__m512bh)_mm512_load_si512(B + k * 32 + 32);
#pragma GCC unroll 8
            for (int i = 0; i < 8; i++) {
                uint32_t pair;
                memcpy(&pair, A + i * K + k, 4);
                __m512bh a = (__m512bh)_mm512_set1_epi32((int)pair);
                c[i][0] = _mm512_dpbf16_ps(c[i][0], a, b0);
                c[i][1] = _mm512_dpbf16_ps(c[i][1], a, b1);
            }
        }
#pragma GCC unroll 8
        for (int i = 0; i < 8; i++) {
            _mm512_store_ps(C + i * 32, _mm512_add_ps(_mm512_load_ps(C + i * 32), c[i][0]));
            _mm512_store_ps(C + i * 32 + 16, _mm512_add_ps(_mm512_load_ps(C + i * 32 + 16), c[i][1]));
        }
    }
    return 2.0 * 8 * 32 * K * (double)reps;
}

/* One thread's micro-kernel run on L1-resident data (fp32 FMAs, or bf16
 * pairs through vdpbf16ps: twice the reps, each instruction does two
 * multiply-adds): flops done. */
static double micro_thread(bool bf16) {
    enum { K = 256 };
    size_t es = bf16 ? 2 : 4;
    void *A = aligned_alloc(64, 8 * K * es), *B = aligned_alloc(64, K * 32 * es);
    float *C = aligned_alloc(64, 8 * 32 * 4);
    for (int i = 0; i < 8 * K; i++) {
        if (bf16) ((uint16_t *)A)[i] = (uint16_t)(0x3A80 + i % 7); /* ~1e-3, bf16 */
        else ((float *)A)[i] = 1e-3f * (float)(i % 7);
    }
    for (int i = 0; i < K * 32; i++) {
        if (bf16) ((uint16_t *)B)[i] = (uint16_t)(0x3A80 + i % 5);
        else ((float *)B)[i] = 1e-3f * (float)(i % 5);
    }
    for (int i = 0; i < 8 * 32; i++) C[i] = 0;
    double flops = bf16 ? gemm_micro_bf16(A, B, C, K, 8000) : gemm_micro(A, B, C, K, 4000);
    volatile float sink = C[5];
    (void)sink;
    free(A);
    free(B);
    free(C);
    return flops;
}
static double fma_thread(void) { return micro_thread(false); }
static double bf16_thread(void) { return micro_thread(true); }

/* Peak in flop/s of a per-thread micro-kernel run on all threads at once
 * (best of 5). */
static double measure_peak(double (*thread_run)(void)) {
    double best = 0;
    for (int rep = 0; rep < 5; rep++) {
        double flops = 0, t0 = now_s();
#pragma omp parallel reduction(+ : flops)
        flops += thread_run();
        double dt = now_s() - t0;
        if (flops / dt > best) best = flops / dt;
    }
    return best;
}

/* fp32 FMA peak in flop/s over all threads (best of 5). */
static double measure_fma_peak(bool avx512) { return avx512 ? measure_peak(fma_thread) : 0; }

/* vdpbf16ps peak in flop/s over all threads (best of 5), as measure_fma_peak. */
static double measure_bf16_peak(bool bf16) { return bf16 ? measure_peak(bf16_thread) : 0; }

/* ------------------------------------------------------------ experts */

typedef struct bench_shape {
    const char *name;
    int64_t H, I, E, K;
} bench_shape;

static const bench_shape shapes[] = {
    {"v4flash", 4096, 2048, 256, 6},
    {"v3", 7168, 2048, 256, 8},
};

typedef struct bench_fmt {
    const char *name;
    moe_wfmt fmt;
} bench_fmt;

static const bench_fmt fmts[] = {
    {"bf16", MOE_WFMT_BF16}, {"fp8", MOE_WFMT_FP8_BLOCK}, {"mxfp4", MOE_WFMT_MXFP4}, {"nvfp4", MOE_WFMT_NVFP4}};

/* Stored bytes of a [rows, cols] weight: data, scales. */
static void weight_bytes(moe_wfmt f, int64_t rows, int64_t cols, size_t *data, size_t *scale) {
    switch (f) {
    case MOE_WFMT_BF16: *data = (size_t)(rows * cols * 2); *scale = 0; return;
    case MOE_WFMT_FP8_BLOCK:
        *data = (size_t)(rows * cols);
        *scale = (size_t)(((rows + 127) / 128) * ((cols + 127) / 128) * 4);
        return;
    case MOE_WFMT_MXFP4: *data = (size_t)(rows * cols / 2); *scale = (size_t)(rows * cols / 32); return;
    case MOE_WFMT_NVFP4: *data = (size_t)(rows * cols / 2); *scale = (size_t)(rows * cols / 16); return;
    default: *data = *scale = 0; return;
    }
}

static size_t expert_bytes(moe_wfmt f, const bench_shape *s) {
    size_t d, sc, tot = 0;
    weight_bytes(f, s->I, s->H, &d, &sc);
    tot += 2 * (d + sc);
    weight_bytes(f, s->H, s->I, &d, &sc);
    return tot + d + sc;
}

static uint64_t mix64(uint64_t z) {
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

/* Fill p[0..n) with random bytes, each passed through `fix` (valid codes). */
static void fill_random(uint8_t *p, size_t n, uint64_t seed, int kind) {
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n / 8; i++) {
        uint64_t v = mix64(seed + i * 0x9E3779B97F4A7C15ull);
        switch (kind) {
        case 1: v &= 0xBFBFBFBFBFBFBFBFull; break;                         /* E4M3: no 0x7F/0xFF */
        case 2: v = (v & 0x807F807F807F807Full) | 0x3F003F003F003F00ull; break; /* bf16 in +-[0.5, 1) */
        case 3: v = (v & 0x0707070707070707ull) | 0x7878787878787878ull; break;   /* E8M0 120..127 */
        case 4: v = (v & 0x0F0F0F0F0F0F0F0Full) | 0x3030303030303030ull; break;   /* UE4M3 0.5 .. 2 */
        default: break;
        }
        memcpy(p + i * 8, &v, 8);
    }
    for (size_t i = n / 8 * 8; i < n; i++) p[i] = (uint8_t)(kind == 3 ? 127 : kind == 4 ? 0x38 : 0);
}

typedef struct expert_set {
    int64_t n;          /* experts materialised */
    uint8_t *mem;
    moe_weight *w;      /* [n, 3]: w1, w3, w2 */
} expert_set;

static void make_weight(moe_weight *w, moe_wfmt f, int64_t rows, int64_t cols, uint8_t **cursor, uint64_t seed,
                        bool fp8_e8m0) {
    size_t d, sc;
    weight_bytes(f, rows, cols, &d, &sc);
    memset(w, 0, sizeof *w);
    w->fmt = f;
    w->rows = rows;
    w->cols = cols;
    w->scale2 = 1.0f;
    w->name = "bench";
    w->data = *cursor;
    fill_random(*cursor, d, seed, f == MOE_WFMT_FP8_BLOCK ? 1 : f == MOE_WFMT_BF16 ? 2 : 0);
    *cursor += (d + 63) & ~(size_t)63;
    if (!sc) return;
    w->scale = *cursor;
    switch (f) {
    case MOE_WFMT_FP8_BLOCK:
        w->scale_rows = (rows + 127) / 128;
        w->scale_cols = (cols + 127) / 128;
        if (fp8_e8m0) {
            w->scale_dtype = MOE_DTYPE_F8_E8M0;
            fill_random(*cursor, sc / 4, seed ^ 0x55, 3);
        } else {
            w->scale_dtype = MOE_DTYPE_F32;
            float *s = (float *)*cursor;
            for (size_t i = 0; i < sc / 4; i++) s[i] = 1.0f / 448.0f;
        }
        break;
    case MOE_WFMT_MXFP4:
        w->scale_rows = rows;
        w->scale_cols = cols / 32;
        w->scale_dtype = MOE_DTYPE_F8_E8M0;
        fill_random(*cursor, sc, seed ^ 0x55, 3);
        break;
    case MOE_WFMT_NVFP4:
        w->scale_rows = rows;
        w->scale_cols = cols / 16;
        w->scale_dtype = MOE_DTYPE_F8_E4M3;
        w->scale2 = 1.0f / 2688.0f;
        fill_random(*cursor, sc, seed ^ 0x55, 4);
        break;
    default: break;
    }
    *cursor += (sc + 63) & ~(size_t)63;
}

static int expert_set_init(expert_set *es, moe_wfmt f, const bench_shape *s, int64_t n) {
    size_t per = expert_bytes(f, s) + 6 * 64;
    es->n = n;
    es->mem = aligned_alloc(64, per * (size_t)n);
    es->w = calloc((size_t)n * 3, sizeof(moe_weight));
    if (!es->mem || !es->w) return -1;
    uint8_t *cur = es->mem;
    bool e8 = strcmp(s->name, "v4flash") == 0;
    for (int64_t e = 0; e < n; e++) {
        make_weight(&es->w[e * 3 + 0], f, s->I, s->H, &cur, (uint64_t)e * 3 + 1, e8);
        make_weight(&es->w[e * 3 + 1], f, s->I, s->H, &cur, (uint64_t)e * 3 + 2, e8);
        make_weight(&es->w[e * 3 + 2], f, s->H, s->I, &cur, (uint64_t)e * 3 + 3, e8);
    }
    return 0;
}

static void expert_set_free(expert_set *es) {
    free(es->mem);
    free(es->w);
    memset(es, 0, sizeof *es);
}

/* ------------------------------------------------------------ one row */

typedef struct bench_row {
    const char *shape, *weights, *isa, *act; /* act: "f32" or "bf16" */
    const char *arith;                       /* "fp32-fma" or "vdpbf16ps": what the compute floor assumes */
    double peak_gflops;                      /* the peak of that arithmetic, measured in this run */
    int64_t tokens, experts;
    double median_ms, p90_ms, memory_floor_ms, compute_floor_ms, working_set_gib;
    int threads;
} bench_row;

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double p) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    int i = (int)ceil(p * n) - 1;
    return v[i < 0 ? 0 : i >= n ? n - 1 : i];
}

/* Does this row multiply with vdpbf16ps? bf16 activations, a table with
 * gemm_bf16act, and a format that entry decodes to bf16 (gemm_avx512.c:
 * MXFP4, NVFP4, BF16; FP8 runs fp32 FMAs there too). */
static bool bf16_dot_row(const moe_cpu_kernels *k, bool bf16act, moe_wfmt f) {
    return bf16act && k->gemm_bf16act && (f == MOE_WFMT_MXFP4 || f == MOE_WFMT_NVFP4 || f == MOE_WFMT_BF16);
}

static int run_row(const moe_cpu_kernels *k, const bench_shape *s, const bench_fmt *bf, const expert_set *es,
                   bool bf16act, int64_t T, int iters, double bw, double peak, uint64_t seed, bench_row *out) {
    int64_t H = s->H, I = s->I, K = s->K, E = es->n;
    size_t nassign = (size_t)(T * K);
    float *X = malloc((size_t)(T * H) * 4), *Xg = malloc(nassign * (size_t)H * 4), *Yg = malloc(nassign * (size_t)H * 4);
    float *scratch = malloc(moe_expert_fast_scratch(H, I, T) * 4);
    int32_t *ids = malloc(nassign * 4), *cnt = malloc((size_t)E * 4), *off = malloc((size_t)(E + 1) * 4),
            *pos = malloc((size_t)E * 4), *tok = malloc(nassign * 4);
    double *times = malloc((size_t)iters * 8), *floors = malloc((size_t)iters * 8);
    if (!X || !Xg || !Yg || !scratch || !ids || !cnt || !off || !pos || !tok || !times || !floors) return -1;
    for (int64_t i = 0; i < T * H; i++) X[i] = (float)((int)(mix64((uint64_t)i) % 2001) - 1000) * 1e-3f;
    moe_act_prec act = bf16act ? MOE_ACT_BF16 : MOE_ACT_EXACT;
    moe_act_round_f32(act, X, T * H); /* the caller's rounding (block.c does it per expert row) */
    size_t eb = expert_bytes(bf->fmt, s);
    uint64_t rs = seed;
    for (int it = -2; it < iters; it++) {
        /* routing: K distinct experts per token, fresh each iteration */
        for (int64_t t = 0; t < T; t++)
            for (int64_t j = 0; j < K; j++) {
                int32_t e;
                bool dup;
                do {
                    e = (int32_t)(mix64(rs++) % (uint64_t)E);
                    dup = false;
                    for (int64_t q = 0; q < j; q++) dup |= ids[t * K + q] == e;
                } while (dup);
                ids[t * K + j] = e;
            }
        double t0 = now_s();
        memset(cnt, 0, (size_t)E * 4);
        for (size_t a = 0; a < nassign; a++) cnt[ids[a]]++;
        off[0] = 0;
        int64_t touched = 0;
        for (int64_t e = 0; e < E; e++) {
            off[e + 1] = off[e] + cnt[e];
            pos[e] = off[e];
            touched += cnt[e] > 0;
        }
        for (size_t a = 0; a < nassign; a++) tok[pos[ids[a]]++] = (int32_t)(a / (size_t)K);
        for (size_t a = 0; a < nassign; a++) memcpy(Xg + a * (size_t)H, X + (size_t)tok[a] * (size_t)H, (size_t)H * 4);
        for (int64_t e = 0; e < E; e++) {
            if (!cnt[e]) continue;
            const moe_weight *w = &es->w[e * 3];
            moe_expert_fast(k, &w[0], &w[1], &w[2], 0.0, act, Xg + (size_t)off[e] * (size_t)H, cnt[e],
                            Yg + (size_t)off[e] * (size_t)H, scratch);
        }
        double dt = now_s() - t0;
        if (it >= 0) {
            times[it] = dt * 1e3;
            double bytes = (double)touched * (double)eb + 2.0 * (double)(T * H) * 4.0;
            floors[it] = bytes / bw * 1e3;
        }
    }
    out->shape = s->name;
    out->weights = bf->name;
    out->isa = k->isa;
    out->act = bf16act ? "bf16" : "f32";
    out->arith = bf16_dot_row(k, bf16act, bf->fmt) ? "vdpbf16ps" : "fp32-fma";
    out->peak_gflops = peak * 1e-9;
    out->tokens = T;
    out->experts = E;
    out->threads = bench_threads();
    out->median_ms = pct(times, iters, 0.5);
    out->p90_ms = pct(times, iters, 0.9);
    out->memory_floor_ms = pct(floors, iters, 0.5);
    out->compute_floor_ms = peak > 0 ? 2.0 * (double)(T * K) * 3.0 * (double)(H * I) / peak * 1e3 : 0;
    out->working_set_gib = (double)eb * (double)E / (double)(1u << 30);
    free(X); free(Xg); free(Yg); free(scratch); free(ids); free(cnt); free(off); free(pos); free(tok);
    free(times); free(floors);
    return 0;
}

/* ------------------------------------------------------------- driver */

static const char bench_help[] =
    "usage: moeaudit bench [--shape v4flash|v3] [--weights LIST] [--act LIST] [--tokens LIST] [--threads N]\n"
    "                      [--experts N] [--iters N] [--isa ref|avx2|avx512] [--max-gib G] [--json FILE]\n"
    "\n"
    "Time the routed experts of one MoE block (gate, up, down for all T x K assignments) and\n"
    "print each row beside its memory and compute floors measured in the same run.\n"
    "\n"
    "  --shape S      v4flash (H 4096, I 2048, E 256, K 6; default) or v3 (H 7168, I 2048, E 256, K 8)\n"
    "  --weights L    comma list of bf16, fp8, mxfp4, nvfp4 (default: mxfp4,nvfp4,fp8,bf16)\n"
    "  --act L        comma list of f32, bf16 (default f32): activations as given, or rounded to\n"
    "                 bf16 (the kernels' vdpbf16ps path where the CPU has AVX512_BF16; its compute\n"
    "                 floor uses the measured vdpbf16ps peak)\n"
    "  --tokens L     comma list of T (default 1,16,128; full sweep: 1,16,128,1024,4096)\n"
    "  --threads N    OpenMP threads (default: all)\n"
    "  --experts N    experts to materialise (default: all E, capped by --max-gib)\n"
    "  --max-gib G    cap on the materialised working set (default 8)\n"
    "  --iters N      timed iterations per row (default: 40 for T=1, 15 for T<=16, 6 for\n"
    "                 T<=128, 3 above), after 2 warm-up iterations\n"
    "  --isa I        force the kernel table (default: the best, or MOE_ISA)\n"
    "  --json FILE    also write the rows as JSON\n"
    "\n"
    "moeaudit bench --linear [...]: the dense linears of a V4-Flash layer instead (--linear --help).\n"
    "moeaudit bench --layer [...]: what a V4-Flash layer costs on a prompt, by part (--layer --help).\n"
    "moeaudit bench --write-v4flash DIR [...]: a synthetic V4-Flash-shaped checkpoint for timing forward.\n";

static int parse_list(const char *s, int64_t *out, int max) {
    int n = 0;
    while (*s && n < max) {
        char *end;
        long long v = strtoll(s, &end, 10);
        if (end == s || v <= 0) return -1;
        out[n++] = v;
        s = *end == ',' ? end + 1 : end;
        if (*end && *end != ',') return -1;
    }
    return n;
}

double moe_bench_read_bandwidth(void) {
    const moe_cpu_features *cf = moe_cpu_get_features();
    return measure_bandwidth(cf->os_avx512 && cf->avx512f && cf->fma);
}

int moe_bench_main(int argc, char **argv) {
    for (int i = 1; i < argc; i++)
        if (!strcmp(argv[i], "--linear")) return moe_bench_linear_main(argc, argv);
        else if (!strcmp(argv[i], "--layer")) return moe_bench_layer_main(argc, argv);
        else if (!strcmp(argv[i], "--write-v4flash")) return moe_bench_write_v4flash_main(argc, argv);
    const char *shape_name = "v4flash", *weights = "mxfp4,nvfp4,fp8,bf16", *json = NULL, *isa = NULL,
               *acts = "f32";
    int64_t tokens[16] = {1, 16, 128};
    int ntok = 3, threads = 0, iters = 0;
    int64_t experts = 0;
    double max_gib = 8.0;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
            fputs(bench_help, stdout);
            return 0;
        }
        if (!v) {
            fprintf(stderr, "bench: %s needs a value\n%s", a, bench_help);
            return 2;
        }
        i++;
        if (!strcmp(a, "--shape")) shape_name = v;
        else if (!strcmp(a, "--weights")) weights = v;
        else if (!strcmp(a, "--act")) acts = v;
        else if (!strcmp(a, "--tokens")) {
            ntok = parse_list(v, tokens, 16);
            if (ntok <= 0) {
                fprintf(stderr, "bench: bad --tokens %s\n", v);
                return 2;
            }
        } else if (!strcmp(a, "--threads")) threads = atoi(v);
        else if (!strcmp(a, "--experts")) experts = atoll(v);
        else if (!strcmp(a, "--iters")) iters = atoi(v);
        else if (!strcmp(a, "--max-gib")) max_gib = atof(v);
        else if (!strcmp(a, "--isa")) isa = v;
        else if (!strcmp(a, "--json")) json = v;
        else {
            fprintf(stderr, "bench: unknown option %s\n%s", a, bench_help);
            return 2;
        }
    }
    const bench_shape *s = NULL;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        if (!strcmp(shapes[i].name, shape_name)) s = &shapes[i];
    if (!s) {
        fprintf(stderr, "bench: unknown shape %s (v4flash, v3)\n", shape_name);
        return 2;
    }
    bool act_f32 = false, act_bf16 = false;
    {
        char al[64];
        snprintf(al, sizeof al, "%s", acts);
        for (char *save = NULL, *tk = strtok_r(al, ",", &save); tk; tk = strtok_r(NULL, ",", &save)) {
            if (!strcmp(tk, "f32")) act_f32 = true;
            else if (!strcmp(tk, "bf16")) act_bf16 = true;
            else {
                fprintf(stderr, "bench: unknown --act %s (f32, bf16)\n", tk);
                return 2;
            }
        }
        if (!act_f32 && !act_bf16) {
            fprintf(stderr, "bench: empty --act\n");
            return 2;
        }
    }
#ifdef _OPENMP
    if (threads > 0) omp_set_num_threads(threads);
#endif
    moe_isa isa_e = MOE_ISA_AUTO;
    moe_error err;
    if (isa && moe_isa_parse(isa, &isa_e, &err) != MOE_OK) {
        fprintf(stderr, "bench: %s\n", err.msg);
        return 2;
    }
    if (!isa) {
        int rc = moe_cli_isa_default(&isa_e);
        if (rc != 0) return rc;
    }
    const moe_cpu_kernels *k = NULL;
    if (moe_cpu_table(isa_e, &k, &err) != MOE_OK) {
        fprintf(stderr, "bench: %s\n", err.msg);
        return 2;
    }
    const moe_cpu_features *cf = moe_cpu_get_features();
    bool avx512 = cf->os_avx512 && cf->avx512f && cf->fma;

    bool bf16 = avx512 && cf->avx512bw && cf->avx512bf16;
    printf("measuring floors: streaming read of 1 GiB x15, fp32 FMA and vdpbf16ps GEMM micro-kernels x5 (%d "
           "threads)\n",
           bench_threads());
    fflush(stdout);
    double bw = measure_bandwidth(avx512), peak = measure_fma_peak(avx512), peak_bf = measure_bf16_peak(bf16);
    printf("read bandwidth %.1f GB/s, fp32 FMA peak %.1f GFLOP/s, vdpbf16ps peak %.1f GFLOP/s%s, kernels: %s "
           "(bf16 activations: %s)\n\n",
           bw * 1e-9, peak * 1e-9, peak_bf * 1e-9, bf16 ? "" : " (no AVX512_BF16)", k->isa,
           k->gemm_bf16act ? "vdpbf16ps" : "fp32 FMA");

    bench_row rows[64];
    int nrows = 0;
    char wl[128];
    snprintf(wl, sizeof wl, "%s", weights);
    for (char *save = NULL, *tokn = strtok_r(wl, ",", &save); tokn; tokn = strtok_r(NULL, ",", &save)) {
        const bench_fmt *bf = NULL;
        for (size_t i = 0; i < sizeof fmts / sizeof fmts[0]; i++)
            if (!strcmp(fmts[i].name, tokn)) bf = &fmts[i];
        if (!bf) {
            fprintf(stderr, "bench: unknown weights %s (bf16, fp8, mxfp4, nvfp4)\n", tokn);
            return 2;
        }
        size_t eb = expert_bytes(bf->fmt, s);
        int64_t ne = experts > 0 ? experts : s->E;
        int64_t cap = (int64_t)(max_gib * (double)(1u << 30) / (double)eb);
        if (experts <= 0 && ne > cap) ne = cap;
        if (ne > s->E) ne = s->E;
        if (ne < s->K) ne = s->K;
        printf("%s %s: materialising %lld experts x %.1f MiB = %.2f GiB working set\n", s->name, bf->name,
               (long long)ne, (double)eb / (1 << 20), (double)eb * (double)ne / (double)(1u << 30));
        fflush(stdout);
        expert_set es;
        if (expert_set_init(&es, bf->fmt, s, ne) != 0) {
            fprintf(stderr, "bench: out of memory materialising %lld experts\n", (long long)ne);
            expert_set_free(&es);
            return 1;
        }
        for (int ai = 0; ai < 2; ai++) {
            bool bfa = ai == 1;
            if (bfa ? !act_bf16 : !act_f32) continue;
            for (int ti = 0; ti < ntok && nrows < 64; ti++) {
                int64_t T = tokens[ti];
                int n_it = iters > 0 ? iters : T <= 1 ? 40 : T <= 16 ? 15 : T <= 128 ? 6 : 3;
                /* the peak the row is held to: that of the arithmetic its kernels use */
                double rpeak = bf16_dot_row(k, bfa, bf->fmt) && peak_bf > 0 ? peak_bf : peak;
                if (run_row(k, s, bf, &es, bfa, T, n_it, bw, rpeak, 1234 + (uint64_t)T, &rows[nrows]) != 0) {
                    fprintf(stderr, "bench: out of memory for T=%lld\n", (long long)T);
                    expert_set_free(&es);
                    return 1;
                }
                bench_row *r = &rows[nrows++];
                double fl = r->memory_floor_ms > r->compute_floor_ms ? r->memory_floor_ms : r->compute_floor_ms;
                printf("  act %-4s T=%-5lld median %9.2f ms  p90 %9.2f ms  mem floor %8.2f  compute floor %8.2f  "
                       "ratio %5.2f\n",
                       r->act, (long long)T, r->median_ms, r->p90_ms, r->memory_floor_ms, r->compute_floor_ms,
                       r->median_ms / fl);
                fflush(stdout);
            }
        }
        expert_set_free(&es);
    }

    printf("\n| shape | weights | act | T | median ms | p90 ms | memory floor ms | compute floor ms | time / max(floors) | threads | isa | experts (working set) |\n");
    printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < nrows; i++) {
        bench_row *r = &rows[i];
        double fl = r->memory_floor_ms > r->compute_floor_ms ? r->memory_floor_ms : r->compute_floor_ms;
        printf("| %s | %s | %s | %lld | %.2f | %.2f | %.2f | %.2f | %.2f | %d | %s | %lld (%.2f GiB) |\n", r->shape,
               r->weights, r->act, (long long)r->tokens, r->median_ms, r->p90_ms, r->memory_floor_ms,
               r->compute_floor_ms, r->median_ms / fl, r->threads, r->isa, (long long)r->experts, r->working_set_gib);
    }
    if (json) {
        FILE *f = fopen(json, "w");
        if (!f) {
            fprintf(stderr, "bench: cannot write %s\n", json);
            return 1;
        }
        fprintf(f,
                "{\n  \"bandwidth_gbs\": %.3f,\n  \"fma_peak_gflops\": %.3f,\n  \"bf16_dot_peak_gflops\": %.3f,\n"
                "  \"rows\": [\n",
                bw * 1e-9, peak * 1e-9, peak_bf * 1e-9);
        for (int i = 0; i < nrows; i++) {
            bench_row *r = &rows[i];
            fprintf(f,
                    "    {\"shape\": \"%s\", \"weights\": \"%s\", \"activations\": \"%s\", \"tokens\": %lld, "
                    "\"median_ms\": %.4f, \"p90_ms\": %.4f, \"memory_floor_ms\": %.4f, \"compute_floor_ms\": %.4f, "
                    "\"arithmetic\": \"%s\", \"peak_gflops\": %.3f, \"threads\": %d, \"isa\": \"%s\"}%s\n",
                    r->shape, r->weights, r->act, (long long)r->tokens, r->median_ms, r->p90_ms, r->memory_floor_ms,
                    r->compute_floor_ms, r->arith, r->peak_gflops, r->threads, r->isa, i + 1 < nrows ? "," : "");
        }
        fprintf(f, "  ],\n  \"working_sets\": [\n");
        for (int i = 0; i < nrows; i++)
            fprintf(f,
                    "    {\"weights\": \"%s\", \"activations\": \"%s\", \"tokens\": %lld, \"experts\": %lld, "
                    "\"gib\": %.3f}%s\n",
                    rows[i].weights, rows[i].act, (long long)rows[i].tokens, (long long)rows[i].experts,
                    rows[i].working_set_gib,
                    i + 1 < nrows ? "," : "");
        fprintf(f, "  ]\n}\n");
        fclose(f);
    }
    return 0;
}
