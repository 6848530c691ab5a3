/*
 * moeaudit bench: the routed experts of one MoE block (gate, up, down for all
 * T x K assignments), timed against floors measured in the same run.
 *
 *   memory floor  = (stored bytes of every expert the iteration touches, incl.
 *                    scales, + X in [T, H] f32 + output [T, H] f32)
 *                   / streaming read bandwidth: 1 GiB, all threads, with the
 *                   widest loads this CPU has (AVX-512, else AVX2, else
 *                   scalar), best of 3 prefetch distances x 2 patterns (one
 *                   contiguous stream per thread; 8 interleaved streams per
 *                   thread, as a kernel's row tile reads); measured before the
 *                   first row (5 repetitions of the 6) and again before every
 *                   row (1), the floor using the highest reading so far
 *   compute floor = 2 T K 3 H I / peak of the arithmetic the row's kernels use,
 *                   each measured by a register-blocked GEMM micro-kernel on
 *                   L1-resident data on all threads at once, best of 5; the
 *                   peak is the sum of the threads' own rates (each timed
 *                   from a common start to its own end: measure_peak_spread,
 *                   which says why not total flops over the slowest):
 *                     f32 activations: fp32 FMA with the table's vector width
 *                     (avx2: 8 lanes, avx512 / amx: 16 lanes; ref: none, the
 *                     row shows no compute floor);
 *                     bf16 activations on a table with gemm_bf16act: vdpbf16ps
 *                     (avx512) or TDPBF16PS tiles (amx) for MXFP4, NVFP4, BF16
 *                     weights; the FMA peak for the formats those entries run
 *                     with fp32 FMAs (FP8)
 *                   measured before the first row (best of 5) and again
 *                   before every row (1), the floor using the highest
 *                   reading so far (as the bandwidth: on a shared machine a
 *                   single early reading can catch a busy moment)
 * A row whose median beats max(floors) (ratio < 1) is flagged: no kernel can
 * beat a true floor, so one of the readings was low (the machine was busy);
 * its ratio is then no measurement. The load average (/proc/loadavg) before
 * the floors and after the last row is printed and in the JSON.
 *
 * Each iteration draws fresh top-K expert ids (distinct per token) uniformly
 * over all materialised experts, gathers each expert's tokens and runs all of
 * them in one moe_experts_fast call (bf16 rows: X rounded to bf16 first, act
 * bf16, so the SwiGLU output is rounded to bf16 too). Weights are random
 * bytes restricted to valid, finite codes. Warm-up 2 iterations, then
 * --iters (default by T).
 */
#include "bench.h"
#include "core/core.h"
#include "cpu/kernels.h"
#include "experts/experts_fast.h"
#include "formats/act.h"
#include "moe_formats.h"

#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#ifdef _OPENMP
#include <omp.h>
#endif

#include "amx_micro.h"
#include "fma_micro.h"

#define BENCH_TGT __attribute__((target("avx512f,fma")))
#define BENCH_TGT_AVX2 __attribute__((target("avx2,fma")))
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

/* Load widths the read probe can use. */
typedef enum { BW_SCALAR, BW_AVX2, BW_AVX512 } bw_isa;

/* Sum of ns streams p + s * stride (s < ns), n floats each (n % 128 == 0),
 * read 512 bytes per stream in turn: 8 accumulators, software prefetch `pf`
 * bytes ahead (0: none). The kernels prefetch explicitly and read several
 * rows at once, so the probe does both, or it would understate the
 * bandwidth they can reach. */
BENCH_TGT static double read_sum_avx512(const float *p, size_t n, int ns, size_t stride, size_t pf) {
    __m512 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm512_setzero_ps();
    for (size_t i = 0; i + 128 <= n; i += 128)
        for (int s = 0; s < ns; s++) {
            const float *q = p + (size_t)s * stride + i;
            if (pf)
                for (int o = 0; o < 512; o += 64) _mm_prefetch((const char *)q + pf + o, _MM_HINT_T0);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++) a[j] = _mm512_add_ps(a[j], _mm512_load_ps(q + 16 * j));
        }
    for (int j = 1; j < 8; j++) a[0] = _mm512_add_ps(a[0], a[j]);
    return _mm512_reduce_add_ps(a[0]);
}

BENCH_TGT_AVX2 static double read_sum_avx2(const float *p, size_t n, int ns, size_t stride, size_t pf) {
    __m256 a[8];
    for (int j = 0; j < 8; j++) a[j] = _mm256_setzero_ps();
    for (size_t i = 0; i + 128 <= n; i += 128)
        for (int s = 0; s < ns; s++) {
            const float *q = p + (size_t)s * stride + i;
            if (pf)
                for (int o = 0; o < 512; o += 64) _mm_prefetch((const char *)q + pf + o, _MM_HINT_T0);
#pragma GCC unroll 8
            for (int j = 0; j < 8; j++)
                a[j] = _mm256_add_ps(a[j], _mm256_add_ps(_mm256_load_ps(q + 16 * j), _mm256_load_ps(q + 16 * j + 8)));
        }
    for (int j = 1; j < 8; j++) a[0] = _mm256_add_ps(a[0], a[j]);
    float v[8];
    _mm256_storeu_ps(v, a[0]);
    return (double)(v[0] + v[1] + v[2] + v[3] + v[4] + v[5] + v[6] + v[7]);
}

static double read_sum_scalar(const float *p, size_t n, int ns, size_t stride) {
    float s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i + 128 <= n; i += 128)
        for (int s = 0; s < ns; s++) {
            const float *q = p + (size_t)s * stride + i;
            for (int j = 0; j < 128; j += 4) {
                s0 += q[j];
                s1 += q[j + 1];
                s2 += q[j + 2];
                s3 += q[j + 3];
            }
        }
    return (double)(s0 + s1 + s2 + s3);
}

/* The probe's buffer: 1 GiB, filled once (first touch by all threads). */
static float *g_bw_buf;
static const size_t g_bw_bytes = (size_t)1 << 30;

/* Streaming read bandwidth in bytes/s over all threads, best of `reps`
 * repetitions of each of 3 prefetch distances (none, 1 KiB, 4 KiB) x 2
 * patterns (1 contiguous stream per thread; 8 streams per thread, each an
 * eighth of its part). */
static double measure_bandwidth(bw_isa isa, int reps) {
    size_t n = g_bw_bytes / 4;
    if (!g_bw_buf) {
        g_bw_buf = aligned_alloc(64, g_bw_bytes);
        if (!g_bw_buf) return 0;
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++) g_bw_buf[i] = (float)(i & 1023) * 1e-3f;
    }
    double best = 0;
    volatile double sink = 0;
    static const size_t pfs[3] = {0, 1024, 4096};
    for (int rep = 0; rep < reps * 6; rep++) {
        size_t pf = pfs[rep % 3];
        int ns = (rep / 3) % 2 ? 8 : 1;
        double t0 = now_s(), tot = 0;
#pragma omp parallel reduction(+ : tot)
        {
            int tid = 0, nth = 1;
#ifdef _OPENMP
            tid = omp_get_thread_num();
            nth = omp_get_num_threads();
#endif
            size_t per = (n / (size_t)nth) & ~(size_t)1023, len = per / (size_t)ns;
            const float *p = g_bw_buf + per * (size_t)tid;
            tot += isa == BW_AVX512 ? read_sum_avx512(p, len, ns, len, pf)
                   : isa == BW_AVX2 ? read_sum_avx2(p, len, ns, len, pf)
                                    : read_sum_scalar(p, len, ns, len);
        }
        double dt = now_s() - t0;
        sink += tot;
        if (g_bw_bytes / dt > best) best = g_bw_bytes / dt;
    }
    (void)sink;
    return best;
}

/* C[8, 32] += A[8, K] . B[K, 32] in bf16 pairs with fp32 accumulation (K
 * even): per pair of k, 2 loads of 32 bf16 of B (16 columns x 2 k each), 8
 * broadcasts of an A pair, 16 vdpbf16ps into 16 accumulators, the layout of
 * bench_micro_f32_avx512 with two k per instruction. Returns flops done (2 per
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

/* The kernel paths this CPU and build have, for the header line. */
static const char *isas_here(char *buf, size_t cap) {
    static const moe_isa all[] = {MOE_ISA_REF, MOE_ISA_AVX2, MOE_ISA_AVX512, MOE_ISA_AMX};
    buf[0] = 0;
    for (int i = 0; i < 4; i++) {
        moe_isa got;
        if (moe_isa_resolve(all[i], &got, NULL) == MOE_OK)
            snprintf(buf + strlen(buf), cap - strlen(buf), "%s%s", buf[0] ? " " : "", moe_isa_name(all[i]));
    }
    return buf;
}

/* The arithmetic a peak is measured for. */
typedef enum { PK_FMA_AVX2, PK_FMA_AVX512, PK_VDPBF16PS, PK_AMX_BF16 } peak_kind;
static const char *const peak_names[] = {"fp32-fma-avx2", "fp32-fma-avx512", "vdpbf16ps", "amx-bf16"};

/* One thread's micro-kernel on L1-resident data: the buffers are set up and
 * the loop run once untimed, then all threads start together (barrier) and
 * each times its own loop. Returns this thread's flop/s. */
static double micro_thread(peak_kind kind) {
    enum { K = 256, STEPS = 8 };
    size_t bytes = 64 * 1024;
    void *A = aligned_alloc(64, bytes), *B = aligned_alloc(64, bytes);
    float *C = aligned_alloc(64, 4096 * 4);
    for (size_t i = 0; i < bytes / 2; i++) {
        ((uint16_t *)A)[i] = (uint16_t)(0x3A80 + i % 7); /* ~1e-3, bf16 */
        ((uint16_t *)B)[i] = (uint16_t)(0x3A80 + i % 5);
    }
    if (kind == PK_FMA_AVX2 || kind == PK_FMA_AVX512)
        for (size_t i = 0; i < bytes / 4; i++) {
            ((float *)A)[i] = 1e-3f * (float)(i % 7);
            ((float *)B)[i] = 1e-3f * (float)(i % 5);
        }
    for (int i = 0; i < 4096; i++) C[i] = 0;
    double rate = 0;
    for (int pass = 0; pass < 2; pass++) { /* pass 0: warm-up, 1/20 of the loop */
        int d = pass ? 1 : 20;
#pragma omp barrier
        double t0 = now_s(), flops = 0;
        switch (kind) {
        case PK_FMA_AVX2: flops = bench_micro_f32_avx2(A, B, C, K, 6000 / d); break;
        case PK_FMA_AVX512: flops = bench_micro_f32_avx512(A, B, C, K, 4000 / d); break;
        case PK_VDPBF16PS: flops = gemm_micro_bf16(A, B, C, K, 8000 / d); break;
        case PK_AMX_BF16: flops = bench_micro_amx(A, B, C, STEPS, 20000 / d); break;
        }
        rate = flops / (now_s() - t0);
    }
    volatile float sink = C[5];
    (void)sink;
    free(A);
    free(B);
    free(C);
    return rate;
}

/* Peak in flop/s of the micro-kernel on all threads at once (best of reps):
 * the sum of the threads' own rates, each timed from the common start to
 * its own end. The work is L1-resident, so the threads share no resource
 * but the cores: the sum is what they deliver together, and what a driver
 * that hands work to whichever thread is free (experts_fast.c invariant 5)
 * can reach. Total flops over the slowest thread's time, as this probe read
 * until 2026-12-07, is bound by one slow vCPU instead: on the Xeon guest of
 * docs/performance.md one of 16 ran the AMX loop at 0.53 TFLOP/s where the
 * others ran 2.2-2.3, and that reading was 8.5 TFLOP/s against a sum of
 * about 35. The spread (slowest and fastest thread of the best rep) goes
 * to *lo and *hi when they are not NULL. */
static double measure_peak_spread(peak_kind kind, int reps, double *lo, double *hi) {
    double best = 0;
    for (int rep = 0; rep < reps; rep++) {
        double sum = 0, mn = INFINITY, mx = 0;
#pragma omp parallel reduction(+ : sum) reduction(min : mn) reduction(max : mx)
        {
            double r = micro_thread(kind);
            sum += r;
            mn = r;
            mx = r;
        }
        if (sum > best) {
            best = sum;
            if (lo) *lo = mn;
            if (hi) *hi = mx;
        }
    }
    return best;
}
static double measure_peak_reps(peak_kind kind, int reps) { return measure_peak_spread(kind, reps, NULL, NULL); }
static double measure_peak(peak_kind kind, double *lo, double *hi) { return measure_peak_spread(kind, 5, lo, hi); }

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
    const char *shape, *weights, *isa, *act; /* act: "f32", "bf16" or "nvfp4" */
    const char *arith;                       /* peak_names[]: what the compute floor assumes, or "none" */
    double peak_gflops;                      /* the peak of that arithmetic, measured in this run */
    double bw_gbs;                           /* the read bandwidth the memory floor used */
    int64_t tokens, experts;
    double median_ms, p90_ms, min_ms, max_ms, memory_floor_ms, compute_floor_ms, working_set_gib;
    int threads;
    bool floor_beaten; /* median < max(floors): a floor reading was low (see the header) */
} bench_row;

/* The 1-minute load average (Linux /proc/loadavg), or -1 where unknown. */
static double load_avg(void) {
    FILE *f = fopen("/proc/loadavg", "r");
    double l = -1;
    if (f) {
        if (fscanf(f, "%lf", &l) != 1) l = -1;
        fclose(f);
    }
    return l;
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double pct(double *v, int n, double p) {
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    int i = (int)ceil(p * n) - 1;
    return v[i < 0 ? 0 : i >= n ? n - 1 : i];
}

/* The arithmetic a row's kernels use (see the header): -1 = no peak (ref). */
static int row_peak(const moe_cpu_kernels *k, bool bf16act, moe_wfmt f) {
    bool tiles = f == MOE_WFMT_MXFP4 || f == MOE_WFMT_NVFP4 || f == MOE_WFMT_BF16;
    if (!strcmp(k->isa, "ref")) return -1;
    if (!strcmp(k->isa, "avx2")) return PK_FMA_AVX2;
    if (bf16act && k->gemm_bf16act && tiles) return !strcmp(k->isa, "amx") ? PK_AMX_BF16 : PK_VDPBF16PS;
    return PK_FMA_AVX512;
}

/* act: 0 f32, 1 bf16, 2 nvfp4 (W4A4 with static input scales: the block
 * input and the SwiGLU output each quantized to E2M1 + UE4M3 per 16 before
 * its GEMM, as TensorRT-LLM runs ModelOpt NVFP4; the scale values do not
 * change the cost: amax / (6 * 448) of the input, 1 / (6 * 448) for GEMM2) */
static int run_row(const moe_cpu_kernels *k, const bench_shape *s, const bench_fmt *bf, const expert_set *es,
                   int acti, int64_t T, int iters, double bw, int pk, double peak, uint64_t seed, bench_row *out) {
    bool bf16act = acti == 1;
    int64_t H = s->H, K = s->K, E = es->n;
    size_t nassign = (size_t)(T * K);
    int nth = bench_threads();
    moe_act_prec act = bf16act ? MOE_ACT_BF16 : acti == 2 ? MOE_ACT_NVFP4 : MOE_ACT_EXACT;
    float *X = malloc((size_t)(T * H) * 4), *Xg = malloc(nassign * (size_t)H * 4), *Yg = malloc(nassign * (size_t)H * 4);
    int32_t *ids = malloc(nassign * 4), *cnt = malloc((size_t)E * 4), *off = malloc((size_t)(E + 1) * 4),
            *pos = malloc((size_t)E * 4), *tok = malloc(nassign * 4);
    moe_expert_job *jobs = malloc((size_t)E * sizeof *jobs);
    double *times = malloc((size_t)iters * 8), *floors = malloc((size_t)iters * 8);
    /* scratch: grown (outside the timed region) to what an iteration's jobs need */
    void *scratch = NULL;
    size_t scr_bytes = 0;
    if (!X || !Xg || !Yg || !ids || !cnt || !off || !pos || !tok || !jobs || !times || !floors) return -1;
    for (int64_t i = 0; i < T * H; i++) X[i] = (float)((int)(mix64((uint64_t)i) % 2001) - 1000) * 1e-3f;
    float s13 = 1.0f / (6.0f * 448.0f), s2 = s13; /* X lies in [-1, 1] */
    for (int64_t e = 0; acti == 2 && e < es->n; e++) {
        moe_weight *w = &es->w[e * 3];
        w[0].act_scale = w[1].act_scale = s13;
        w[2].act_scale = s2;
    }
    if (acti != 2) moe_act_round_f32(act, X, T * H); /* the caller's rounding (block.c does it per expert row) */
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
        /* this iteration's jobs, outside the timing, only to size the scratch */
        memset(cnt, 0, (size_t)E * 4);
        for (size_t a = 0; a < nassign; a++) cnt[ids[a]]++;
        int64_t touched = 0;
        for (int64_t e = 0; e < E; e++)
            if (cnt[e])
                jobs[touched++] = (moe_expert_job){&es->w[e * 3], &es->w[e * 3 + 1], &es->w[e * 3 + 2], NULL, NULL, cnt[e]};
        size_t need = moe_experts_fast_scratch(k, act, jobs, (int)touched, nth);
        if (need > scr_bytes) {
            free(scratch);
            scr_bytes = (need + need / 4 + 63) & ~(size_t)63;
            scratch = aligned_alloc(64, scr_bytes);
            if (!scratch) return -1;
            memset(scratch, 0, scr_bytes); /* first touch outside the timing */
        }
        double t0 = now_s();
        memset(cnt, 0, (size_t)E * 4);
        for (size_t a = 0; a < nassign; a++) cnt[ids[a]]++;
        off[0] = 0;
        touched = 0;
        for (int64_t e = 0; e < E; e++) {
            off[e + 1] = off[e] + cnt[e];
            pos[e] = off[e];
        }
        for (size_t a = 0; a < nassign; a++) tok[pos[ids[a]]++] = (int32_t)(a / (size_t)K);
        /* the gather, over all threads (a block driver does the same) */
#pragma omp parallel for schedule(static)
        for (size_t a = 0; a < nassign; a++) memcpy(Xg + a * (size_t)H, X + (size_t)tok[a] * (size_t)H, (size_t)H * 4);
        /* NVFP4: each gathered row quantized with GEMM1's static scale (as moe_expert_rows does), inside the timing */
        if (acti == 2) moe_act_round_scaled_f32(act, s13, Xg, (int64_t)nassign * H);
        for (int64_t e = 0; e < E; e++) {
            if (!cnt[e]) continue;
            const moe_weight *w = &es->w[e * 3];
            jobs[touched++] = (moe_expert_job){&w[0], &w[1], &w[2], Xg + (size_t)off[e] * (size_t)H,
                                               Yg + (size_t)off[e] * (size_t)H, cnt[e]};
        }
        moe_experts_fast(k, 0.0, act, jobs, (int)touched, scratch, nth);
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
    out->act = bf16act ? "bf16" : acti == 2 ? "nvfp4" : "f32";
    out->arith = pk < 0 ? "none" : peak_names[pk];
    out->peak_gflops = peak * 1e-9;
    out->bw_gbs = bw * 1e-9;
    out->tokens = T;
    out->experts = E;
    out->threads = nth;
    out->median_ms = pct(times, iters, 0.5); /* sorts times */
    out->p90_ms = pct(times, iters, 0.9);
    out->min_ms = times[0];
    out->max_ms = times[iters - 1];
    out->memory_floor_ms = pct(floors, iters, 0.5);
    out->compute_floor_ms = peak > 0 ? 2.0 * (double)(T * K) * 3.0 * (double)(s->H * s->I) / peak * 1e3 : 0;
    out->working_set_gib = (double)eb * (double)E / (double)(1u << 30);
    free(X); free(Xg); free(Yg); free(scratch); free(ids); free(cnt); free(off); free(pos); free(tok); free(jobs);
    free(times); free(floors);
    return 0;
}

/* ------------------------------------------------------------- driver */

/* bench.h: moe_bench_read_bandwidth. */
double moe_bench_read_bandwidth(void) {
    const moe_cpu_features *cf = moe_cpu_get_features();
    bool avx512 = cf->os_avx512 && cf->avx512f && cf->fma, avx2 = cf->os_avx && cf->avx2 && cf->fma;
    return measure_bandwidth(avx512 ? BW_AVX512 : avx2 ? BW_AVX2 : BW_SCALAR, 5);
}

int moe_bench_cpu(const moe_bench_opts *o, FILE *text, FILE *json) {
    const char *shape_name = o->shape, *weights = o->weights;
    const int64_t *tokens = o->tokens;
    int ntok = o->ntok, threads = o->threads, iters = o->iters;
    int64_t experts = o->experts;
    double max_gib = o->max_gib;
    bool act_f32 = o->act_f32, act_bf16 = o->act_bf16, act_nv = o->act_nvfp4;
    const bench_shape *s = NULL;
    for (size_t i = 0; i < sizeof shapes / sizeof shapes[0]; i++)
        if (!strcmp(shapes[i].name, shape_name)) s = &shapes[i];
    if (!s) {
        fprintf(stderr, "moeaudit bench: unknown shape %s (v4flash, v3)\n", shape_name);
        return 2;
    }
#ifdef _OPENMP
    if (threads > 0) omp_set_num_threads(threads);
#endif
    moe_isa isa_e = o->isa;
    moe_error err;
    const moe_cpu_kernels *k = NULL;
    if (moe_cpu_table(isa_e, &k, &err) != MOE_OK) {
        fprintf(stderr, "moeaudit bench: %s\n", err.msg);
        return 2;
    }
    const moe_cpu_features *cf = moe_cpu_get_features();
    bool avx512 = cf->os_avx512 && cf->avx512f && cf->fma, avx2 = cf->os_avx && cf->avx2 && cf->fma;
    /* the read probe with the widest loads this CPU has: the kernels' loads
     * are no wider, so no kernel can read faster than the probe */
    bw_isa bwi = avx512 ? BW_AVX512 : avx2 ? BW_AVX2 : BW_SCALAR;
    /* the peaks of the arithmetic this table's rows use */
    double peaks[4] = {0, 0, 0, 0};
    char have[64];
    isas_here(have, sizeof have);
    bool is_avx2 = !strcmp(k->isa, "avx2"), is_ref = !strcmp(k->isa, "ref"), is_amx = !strcmp(k->isa, "amx");
    double load0 = load_avg();
    fprintf(text, "load average before the floors: %.2f\n", load0);
    fprintf(text, "measuring floors: streaming read of 1 GiB x5 x3 prefetch distances x2 patterns (%s loads), GEMM "
           "micro-kernel peaks x5 (%d threads)\n",
           bwi == BW_AVX512 ? "AVX-512" : bwi == BW_AVX2 ? "AVX2" : "scalar", bench_threads());
    fflush(text);
    double bw = measure_bandwidth(bwi, 5);
    /* per thread, slowest and fastest, of each peak's best repetition */
    double plo[4] = {0, 0, 0, 0}, phi[4] = {0, 0, 0, 0};
    if (is_avx2) peaks[PK_FMA_AVX2] = measure_peak(PK_FMA_AVX2, &plo[PK_FMA_AVX2], &phi[PK_FMA_AVX2]);
    else if (!is_ref) {
        peaks[PK_FMA_AVX512] = measure_peak(PK_FMA_AVX512, &plo[PK_FMA_AVX512], &phi[PK_FMA_AVX512]);
        if (act_bf16 && k->gemm_bf16act) {
            peak_kind pk = is_amx ? PK_AMX_BF16 : PK_VDPBF16PS;
            peaks[pk] = measure_peak(pk, &plo[pk], &phi[pk]);
        }
    }
    fprintf(text, "read bandwidth %.1f GB/s; peaks GFLOP/s: fp32 FMA avx2 %.1f, fp32 FMA avx512 %.1f, vdpbf16ps %.1f, "
           "AMX bf16 %.1f (0: not this table's arithmetic); kernels: %s (bf16 activations: %s); CPU has: %s\n",
           bw * 1e-9, peaks[0] * 1e-9, peaks[1] * 1e-9, peaks[2] * 1e-9, peaks[3] * 1e-9, k->isa,
           !k->gemm_bf16act ? "fp32 FMA" : is_amx ? "AMX tiles" : "vdpbf16ps", isas_here(have, sizeof have));
    for (int pk = 0; pk < 4; pk++)
        if (peaks[pk] > 0)
            fprintf(text, "peak %s: %d threads, each timing its own loop, summed; per thread %.1f-%.1f GFLOP/s\n", peak_names[pk],
                    bench_threads(), plo[pk] * 1e-9, phi[pk] * 1e-9);
    fputc('\n', text);

    bench_row rows[64];
    int nrows = 0;
    char wl[128];
    snprintf(wl, sizeof wl, "%s", weights);
    for (char *save = NULL, *tokn = strtok_r(wl, ",", &save); tokn; tokn = strtok_r(NULL, ",", &save)) {
        const bench_fmt *bf = NULL;
        for (size_t i = 0; i < sizeof fmts / sizeof fmts[0]; i++)
            if (!strcmp(fmts[i].name, tokn)) bf = &fmts[i];
        if (!bf) {
            fprintf(stderr, "moeaudit bench: unknown weights %s (bf16, fp8, mxfp4, nvfp4)\n", tokn);
            return 2;
        }
        size_t eb = expert_bytes(bf->fmt, s);
        int64_t ne = experts > 0 ? experts : s->E;
        int64_t cap = (int64_t)(max_gib * (double)(1u << 30) / (double)eb);
        if (experts <= 0 && ne > cap) ne = cap;
        if (ne > s->E) ne = s->E;
        if (ne < s->K) ne = s->K;
        fprintf(text, "%s %s: materialising %lld experts x %.1f MiB = %.2f GiB working set\n", s->name, bf->name,
               (long long)ne, (double)eb / (1 << 20), (double)eb * (double)ne / (double)(1u << 30));
        fflush(text);
        expert_set es;
        if (expert_set_init(&es, bf->fmt, s, ne) != 0) {
            fprintf(stderr, "moeaudit bench: out of memory materialising %lld experts\n", (long long)ne);
            expert_set_free(&es);
            return 1;
        }
        for (int ai = 0; ai < 3; ai++) {
            bool bfa = ai == 1;
            if (ai == 0 ? !act_f32 : ai == 1 ? !act_bf16 : !act_nv) continue;
            for (int ti = 0; ti < ntok && nrows < 64; ti++) {
                int64_t T = tokens[ti];
                int n_it = iters > 0 ? iters : T <= 1 ? 40 : T <= 16 ? 15 : T <= 128 ? 6 : 3;
                /* the probe again, right before the row: the floor uses the
                 * highest reading so far (the host's memory speed moves) */
                double bw_now = measure_bandwidth(bwi, 1);
                if (bw_now > bw) bw = bw_now;
                int pk = row_peak(k, bfa, bf->fmt);
                if (pk >= 0) { /* the peak again, the same way */
                    double pk_now = measure_peak_reps((peak_kind)pk, 1);
                    if (pk_now > peaks[pk]) peaks[pk] = pk_now;
                }
                double rpeak = pk < 0 ? 0 : peaks[pk];
                if (run_row(k, s, bf, &es, ai, T, n_it, bw, pk, rpeak, 1234 + (uint64_t)T, &rows[nrows]) != 0) {
                    fprintf(stderr, "moeaudit bench: out of memory for T=%lld\n", (long long)T);
                    expert_set_free(&es);
                    return 1;
                }
                bench_row *r = &rows[nrows++];
                double fl = r->memory_floor_ms > r->compute_floor_ms ? r->memory_floor_ms : r->compute_floor_ms;
                r->floor_beaten = r->median_ms < fl;
                fprintf(text, "  act %-4s T=%-5lld median %9.2f ms  (min %.2f, max %.2f)  mem floor %8.2f (%.1f GB/s)  "
                       "compute floor %8.2f (%s)  ratio %5.2f%s\n",
                       r->act, (long long)T, r->median_ms, r->min_ms, r->max_ms, r->memory_floor_ms, r->bw_gbs,
                       r->compute_floor_ms, r->arith, r->median_ms / fl,
                       r->floor_beaten ? "  FLOOR BEATEN: a floor reading was low (machine busy?), no ratio" : "");
                fflush(text);
            }
        }
        expert_set_free(&es);
    }

    double load1 = load_avg();
    fprintf(text, "load average after the last row: %.2f\n", load1);
    fprintf(text, "\n| shape | weights | act | T | median ms | min-max ms | memory floor ms (GB/s) | compute floor ms "
           "(arithmetic, GFLOP/s) | time / max(floors) | threads | isa | experts (working set) |\n");
    fprintf(text, "|---|---|---|---|---|---|---|---|---|---|---|---|\n");
    for (int i = 0; i < nrows; i++) {
        bench_row *r = &rows[i];
        double fl = r->memory_floor_ms > r->compute_floor_ms ? r->memory_floor_ms : r->compute_floor_ms;
        fprintf(text, "| %s | %s | %s | %lld | %.2f | %.2f-%.2f | %.2f (%.1f) | %.2f (%s, %.0f) | %.2f%s | %d | %s | %lld (%.2f GiB) |\n",
               r->shape, r->weights, r->act, (long long)r->tokens, r->median_ms, r->min_ms, r->max_ms,
               r->memory_floor_ms, r->bw_gbs, r->compute_floor_ms, r->arith, r->peak_gflops, r->median_ms / fl,
               r->floor_beaten ? " (floor beaten: no ratio)" : "",
               r->threads, r->isa, (long long)r->experts, r->working_set_gib);
    }
    free(g_bw_buf);
    g_bw_buf = NULL;
    if (json) {
        FILE *f = json;
        fprintf(f,
                "{\n  \"schema_version\": 1,\n  \"tool\": \"moeaudit " MOEAUDIT_VERSION "\",\n  \"report\": \"bench\",\n"
                "  \"bandwidth_gbs\": %.3f,\n  \"fma_avx2_peak_gflops\": %.3f,\n  \"fma_peak_gflops\": %.3f,\n"
                "  \"bf16_dot_peak_gflops\": %.3f,\n  \"amx_bf16_peak_gflops\": %.3f,\n  \"cpu_has\": \"%s\",\n"
                "  \"load_before\": %.2f,\n  \"load_after\": %.2f,\n  \"rows\": [\n",
                bw * 1e-9, peaks[0] * 1e-9, peaks[1] * 1e-9, peaks[2] * 1e-9, peaks[3] * 1e-9, have, load0, load1);
        for (int i = 0; i < nrows; i++) {
            bench_row *r = &rows[i];
            fprintf(f,
                    "    {\"shape\": \"%s\", \"weights\": \"%s\", \"activations\": \"%s\", \"tokens\": %lld, "
                    "\"median_ms\": %.4f, \"p90_ms\": %.4f, \"min_ms\": %.4f, \"max_ms\": %.4f, "
                    "\"memory_floor_ms\": %.4f, \"bandwidth_gbs\": %.3f, \"compute_floor_ms\": %.4f, "
                    "\"arithmetic\": \"%s\", \"peak_gflops\": %.3f, \"threads\": %d, \"isa\": \"%s\", "
                    "\"floor_beaten\": %s}%s\n",
                    r->shape, r->weights, r->act, (long long)r->tokens, r->median_ms, r->p90_ms, r->min_ms, r->max_ms,
                    r->memory_floor_ms, r->bw_gbs, r->compute_floor_ms, r->arith, r->peak_gflops, r->threads, r->isa,
                    r->floor_beaten ? "true" : "false",
                    i + 1 < nrows ? "," : "");
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
    }
    return 0;
}
