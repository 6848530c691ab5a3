/*
 * moe-kernel-loop: what one core's expert GEMM costs when memory is not in
 * the way (issue #18: is T = 1 bound by the decode or by the bandwidth?).
 *
 *   moe-kernel-loop [--rounds R] [--calls C] [--ops]
 *
 * Part 1, per kernel table this CPU has (avx2, avx512; amx runs the avx512
 * f32 entry) and weight format (mxfp4, nvfp4, fp8, bf16): the table's `gemm`
 * entry on one 256 x 4096 weight (random valid codes and scales; 0.53 MiB
 * of MXFP4, 2 MiB of BF16: L2-resident on current x86 cores) for n = 1, 2,
 * 3, 4, 8 f32 tokens, one thread. Each round times C calls and keeps the
 * fastest; the line gives the min, median and max of the R rounds' minima
 * (the spread on a shared machine), in ns per 32 weights per row, that per
 * token, and the weight bytes per second one core consumes at the min:
 * when cores x that rate is below the read probe of `moeaudit bench`, the
 * decode, not memory, bounds that format at that n.
 *
 * Part 3 (--stream THREADS): the same entries at n = 1 on MXFP4 weights
 * streamed from DRAM, as T = 1 reads them: 1 GiB of 2048 x 4096 weights
 * (gate / up) and of 4096 x 2048 (down), each pass calling every weight
 * once with its rows split evenly over THREADS OpenMP threads; the fastest
 * of 5 passes, in GB/s of codes and scales read. Set beside part 1's
 * L2-resident rate (times THREADS) and `moeaudit bench`'s read probe, it
 * says what the kernel's access pattern costs. The avx512 driver's row
 * spread is a compile-time choice (MOE_AVX512_ROW_SPREAD, gemm_avx512.c):
 * a second build with -DMOE_AVX512_ROW_SPREAD=0 gives its A/B.
 *
 * Part 2 (--ops): issue rates of the instructions the E2M1 decode is made
 * of, 24 independent chains each (12 for ymm: 16 registers without
 * EVEX), so that latency does not bind, in ops per
 * ns and per cycle; the clock is taken from a dependent fp32 FMA chain
 * whose latency is assumed 4 cycles (Intel since Skylake, AMD Zen 2-5). A
 * mix that reaches the sum of its parts' rates runs on separate pipes; one
 * that does not shares them.
 */
#include "cpu/kernels.h"
#include "moeaudit.h"

#include <immintrin.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { ROWS = 256, COLS = 4096, MAXR = 99 };

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static uint64_t rng = 0x9E3779B97F4A7C15ull;
static uint32_t rnd(void) {
    rng ^= rng << 13;
    rng ^= rng >> 7;
    rng ^= rng << 17;
    return (uint32_t)(rng >> 16);
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* One weight of `fmt`, ROWS x COLS; storage in *data, *scale (caller frees).
 * Bytes per weight (codes and scales) in *bpw. */
static moe_weight make_weight(moe_wfmt fmt, void **data, void **scale, double *bpw) {
    moe_weight w;
    memset(&w, 0, sizeof w);
    w.fmt = fmt;
    w.rows = ROWS;
    w.cols = COLS;
    w.scale2 = 1.0f;
    w.name = "kernel-loop";
    size_t nd = 0, ns = 0;
    switch (fmt) {
    case MOE_WFMT_MXFP4:
        nd = (size_t)ROWS * COLS / 2;
        ns = (size_t)ROWS * COLS / 32;
        w.scale_dtype = MOE_DTYPE_F8_E8M0;
        w.scale_rows = ROWS;
        w.scale_cols = COLS / 32;
        break;
    case MOE_WFMT_NVFP4:
        nd = (size_t)ROWS * COLS / 2;
        ns = (size_t)ROWS * COLS / 16;
        w.scale_dtype = MOE_DTYPE_F8_E4M3;
        w.scale_rows = ROWS;
        w.scale_cols = COLS / 16;
        break;
    case MOE_WFMT_FP8_BLOCK:
        nd = (size_t)ROWS * COLS;
        ns = (size_t)(ROWS / 128) * (COLS / 128) * 4;
        w.scale_dtype = MOE_DTYPE_F32;
        w.scale_rows = ROWS / 128;
        w.scale_cols = COLS / 128;
        w.block_rows = w.block_cols = 128;
        break;
    default: /* BF16 */
        nd = (size_t)ROWS * COLS * 2;
        break;
    }
    uint8_t *d = aligned_alloc(64, (nd + 63) / 64 * 64), *s = ns ? aligned_alloc(64, (ns + 63) / 64 * 64) : NULL;
    if (!d || (ns && !s)) {
        fprintf(stderr, "moe-kernel-loop: out of memory\n");
        exit(1);
    }
    for (size_t i = 0; i < nd; i++) {
        uint8_t b = (uint8_t)rnd();
        if (fmt == MOE_WFMT_FP8_BLOCK && (b & 0x7F) == 0x7F) b ^= 1; /* no NaN codes */
        if (fmt == MOE_WFMT_BF16 && (i & 1)) b = (uint8_t)(0x3C + (b & 3)); /* bf16 high byte: |v| in [2^-7, 2^1) */
        d[i] = b;
    }
    if (fmt == MOE_WFMT_MXFP4)
        for (size_t i = 0; i < ns; i++) s[i] = (uint8_t)(120 + rnd() % 10);
    else if (fmt == MOE_WFMT_NVFP4)
        for (size_t i = 0; i < ns; i++) s[i] = (uint8_t)(0x30 + rnd() % 16);
    else if (fmt == MOE_WFMT_FP8_BLOCK)
        for (size_t i = 0; i < ns / 4; i++) {
            float v = 1.0f / 448.0f * (float)(1 + rnd() % 4);
            memcpy(s + 4 * i, &v, 4);
        }
    w.data = d;
    w.scale = s;
    *data = d;
    *scale = s;
    *bpw = (double)(nd + ns) / ((double)ROWS * COLS);
    return w;
}

static void part1(int rounds, int calls) {
    static const moe_isa isas[] = {MOE_ISA_AVX2, MOE_ISA_AVX512};
    static const moe_wfmt fmts[] = {MOE_WFMT_MXFP4, MOE_WFMT_NVFP4, MOE_WFMT_FP8_BLOCK, MOE_WFMT_BF16};
    static const char *const fnames[] = {"mxfp4", "nvfp4", "fp8", "bf16"};
    static const int ns[] = {1, 2, 3, 4, 8};
    float *X = aligned_alloc(64, sizeof(float) * 8 * COLS), *Y = aligned_alloc(64, sizeof(float) * 8 * ROWS);
    if (!X || !Y) {
        fprintf(stderr, "moe-kernel-loop: out of memory\n");
        exit(1);
    }
    for (int i = 0; i < 8 * COLS; i++) X[i] = (float)(rnd() % 2001) / 1000.0f - 1.0f;
    printf("| table | weights | n | ns per 32 weights per row: min (median, max) | per token | bytes/s one core consumes (GB/s) |\n");
    printf("|---|---|---|---|---|---|\n");
    for (size_t ii = 0; ii < sizeof isas / sizeof isas[0]; ii++) {
        const moe_cpu_kernels *k = NULL;
        moe_error err;
        if (moe_cpu_table(isas[ii], &k, &err) != MOE_OK) {
            printf("(%s: not on this CPU, skipped)\n", isas[ii] == MOE_ISA_AVX2 ? "avx2" : "avx512");
            continue;
        }
        for (size_t fi = 0; fi < sizeof fmts / sizeof fmts[0]; fi++) {
            void *d, *s;
            double bpw;
            moe_weight w = make_weight(fmts[fi], &d, &s, &bpw);
            for (size_t ni = 0; ni < sizeof ns / sizeof ns[0]; ni++) {
                int n = ns[ni];
                double best[MAXR];
                k->gemm(&w, 0, ROWS, X, COLS, n, Y, ROWS); /* warm: L2, tables */
                for (int r = 0; r < rounds; r++) {
                    double b = 1e300;
                    for (int c = 0; c < calls; c++) {
                        double t0 = now_ns();
                        k->gemm(&w, 0, ROWS, X, COLS, n, Y, ROWS);
                        double t = now_ns() - t0;
                        if (t < b) b = t;
                    }
                    best[r] = b;
                }
                qsort(best, (size_t)rounds, sizeof best[0], cmp_d);
                const double units = (double)ROWS * (COLS / 32.0);
                double mn = best[0] / units, md = best[rounds / 2] / units, mx = best[rounds - 1] / units;
                printf("| %s | %s | %d | %.3f (%.3f, %.3f) | %.3f | %.1f |\n", k->isa, fnames[fi], n, mn, md, mx,
                       mn / n, 32.0 * bpw / mn);
            }
            free(d);
            free(s);
        }
    }
    free(X);
    free(Y);
}

/* ---------------------------------------------------------------- part 2 */

#define OPS_N 20000000L
#define R16(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7) X(8) X(9) X(10) X(11) X(12) X(13) X(14) X(15)
#define R8(X) X(0) X(1) X(2) X(3) X(4) X(5) X(6) X(7)
#define R12(X) R8(X) X(8) X(9) X(10) X(11)
#define R24(X) R16(X) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)
#define R12B(X) X(12) X(13) X(14) X(15) X(16) X(17) X(18) X(19) X(20) X(21) X(22) X(23)
#define T512 __attribute__((target("avx512f,avx512bw,avx512vbmi,fma"), noinline))
#define T256 __attribute__((target("avx2,fma"), noinline))
#define DF(i) __m512 a##i = _mm512_set1_ps(1.0f + (float)(i) / 64.0f);
#define DI(i) __m512i b##i = _mm512_set1_epi32((i + 1) << 20);
#define UA(i) __asm__ volatile("" ::"v"(a##i));
#define UB(i) __asm__ volatile("" ::"v"(b##i));
#define Y_DF(i) __m256 a##i = _mm256_set1_ps(1.0f + (float)(i) / 64.0f);
#define Y_DI(i) __m256i b##i = _mm256_set1_epi32((i + 1) << 20);
#define Y_UA(i) __asm__ volatile("" ::"x"(a##i));
#define Y_UB(i) __asm__ volatile("" ::"x"(b##i));

static volatile int shift_count = 1;

/* Each loop below returns ns per op: per trip one op on each of 24 zmm
 * chains (12 ymm), or 12 + 12 for the mixes; z_fma_lat: one dependent chain */
T512 static double z_fma_lat(void) {
    __m512 a = _mm512_set1_ps(1.0f), m = _mm512_set1_ps(1.0f), c = _mm512_setzero_ps();
    double t = now_ns();
    for (long k = 0; k < OPS_N; k++) {
        for (int j = 0; j < 16; j++) a = _mm512_fmadd_ps(a, m, c);
        __asm__ volatile("" ::"v"(a));
    }
    return (now_ns() - t) / (OPS_N * 16.0);
}
#define Z_PERMPS(i) a##i = _mm512_permutexvar_ps(ix, a##i);
#define Z_FMA(i) a##i = _mm512_fmadd_ps(a##i, m, c);
#define Z_SRL(i) b##i = _mm512_srli_epi32(b##i, 1);
#define Z_SRLV(i) b##i = _mm512_srlv_epi32(b##i, cnt);
#define Z_PERMB(i) b##i = _mm512_permutexvar_epi8(bx, b##i);
#define Z_PERMPS_M(i) a##i = _mm512_permutexvar_ps(ix, a##i);
#define Z_FMA_M(i) f##i = _mm512_fmadd_ps(f##i, m, c);
#define Z_DF_M(i) __m512 f##i = _mm512_set1_ps(2.0f + (float)(i) / 64.0f);
#define Z_UF_M(i) __asm__ volatile("" ::"v"(f##i));
T512 static double z_permps(void) {
    R24(DF) __m512i ix = _mm512_set1_epi32(3);
    double t = now_ns();
    for (long k = 0; k < OPS_N; k++) { R24(Z_PERMPS) R24(UA) }
    return (now_ns() - t) / (OPS_N * 24.0);
}
T512 static double z_fma(void) {
    R24(DF) __m512 m = _mm512_set1_ps(1.0f), c = _mm512_setzero_ps();
    double t = now_ns();
    for (long k = 0; k < OPS_N; k++) { R24(Z_FMA) R24(UA) }
    return (now_ns() - t) / (OPS_N * 24.0);
}
T512 static double z_srl(void) {
    R24(DI) double t = now_ns();
    for (long k = 0; k < OPS_N; k++) { R24(Z_SRL) R24(UB) }
    return (now_ns() - t) / (OPS_N * 24.0);
}
T512 static double z_srlv(void) {
    R24(DI) __m512i cnt = _mm512_set1_epi32(shift_count);
    double t = now_ns();
    for (long k = 0; k < OPS_N; k++) { R24(Z_SRLV) R24(UB) }
    return (now_ns() - t) / (OPS_N * 24.0);
}
T512 static double z_permb(void) {
    R24(DI) __m512i bx = _mm512_set1_epi8(1);
    double t = now_ns();
    for (long k = 0; k < OPS_N; k++) { R24(Z_PERMB) R24(UB) }
    return (now_ns() - t) / (OPS_N * 24.0);
}
T512 static double z_permps_fma(void) {
    R12(DF) R12(Z_DF_M) __m512i ix = _mm512_set1_epi32(3);
    __m512 m = _mm512_set1_ps(1.0f), c = _mm512_setzero_ps();
    double t = now_ns();
    for (long k = 0; k < OPS_N; k++) { R12(Z_PERMPS_M) R12(Z_FMA_M) R12(UA) R12(Z_UF_M) }
    return (now_ns() - t) / (OPS_N * 24.0);
}
T512 static double z_permps_srl(void) {
    R12(DF) R12B(DI) __m512i ix = _mm512_set1_epi32(3);
    double t = now_ns();
    for (long k = 0; k < OPS_N; k++) { R12(Z_PERMPS_M) R12B(Z_SRL) R12(UA) R12B(UB) }
    return (now_ns() - t) / (OPS_N * 24.0);
}
#define Y_PERMPS(i) a##i = _mm256_permutevar8x32_ps(a##i, ix);
#define Y_FMA(i) a##i = _mm256_fmadd_ps(a##i, m, c);
#define Y_SRLV(i) b##i = _mm256_srlv_epi32(b##i, cnt);
T256 static double y_permps(void) {
    R12(Y_DF) __m256i ix = _mm256_set1_epi32(3);
    double t = now_ns();
    for (long k = 0; k < OPS_N; k++) { R12(Y_PERMPS) R12(Y_UA) }
    return (now_ns() - t) / (OPS_N * 12.0);
}
T256 static double y_fma(void) {
    R12(Y_DF) __m256 m = _mm256_set1_ps(1.0f), c = _mm256_setzero_ps();
    double t = now_ns();
    for (long k = 0; k < OPS_N; k++) { R12(Y_FMA) R12(Y_UA) }
    return (now_ns() - t) / (OPS_N * 12.0);
}
T256 static double y_srlv(void) {
    R12(Y_DI) __m256i cnt = _mm256_set1_epi32(shift_count);
    double t = now_ns();
    for (long k = 0; k < OPS_N; k++) { R12(Y_SRLV) R12(Y_UB) }
    return (now_ns() - t) / (OPS_N * 12.0);
}

static void part2(void) {
    __builtin_cpu_init();
    const int z = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                  __builtin_cpu_supports("avx512vbmi");
    const int y = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
    if (!z) printf("(AVX-512 VBMI: not on this CPU, its rows skipped)\n");
    if (!y) {
        printf("(AVX2 + FMA: not on this CPU, part 2 skipped)\n");
        return;
    }
    struct {
        const char *name;
        double (*fn)(void);
        int zmm;
    } L[] = {{"vpermps zmm", z_permps, 1},       {"vpermb zmm", z_permb, 1},
             {"vpsrld zmm (imm)", z_srl, 1},     {"vpsrlvd zmm", z_srlv, 1},
             {"vfmadd zmm", z_fma, 1},           {"12 vpermps + 12 vfmadd zmm", z_permps_fma, 1},
             {"12 vpermps + 12 vpsrld zmm", z_permps_srl, 1}, {"vpermps ymm", y_permps, 0},
             {"vpsrlvd ymm", y_srlv, 0},         {"vfmadd ymm", y_fma, 0}};
    /* the clock: a dependent FMA chain (zmm where there is AVX-512) */
    double lat = z ? z_fma_lat() : 0.0;
    printf("\n| instructions (24 independent zmm chains, 12 ymm) | ops per ns | ops per cycle (fp32 FMA latency = 4 cycles: %s) |\n",
           z ? "the clock read below" : "no zmm chain to read it from");
    printf("|---|---|---|\n");
    const double cyc = z ? lat / 4.0 : 0.0;
    for (size_t i = 0; i < sizeof L / sizeof L[0]; i++) {
        if (L[i].zmm && !z) continue;
        double t = L[i].fn();
        if (z) printf("| %s | %.2f | %.2f |\n", L[i].name, 1.0 / t, cyc / t);
        else printf("| %s | %.2f | - |\n", L[i].name, 1.0 / t);
    }
    if (z) printf("(clock from the FMA chain: %.2f GHz)\n", 1.0 / cyc);
}

/* ---------------------------------------------------------------- part 3 */

static void part3(int nthreads) {
    static const moe_isa isas[] = {MOE_ISA_AVX2, MOE_ISA_AVX512};
    static const int shapes[2][2] = {{2048, 4096}, {4096, 2048}};
    printf("\n| table | weights (n = 1, from DRAM) | threads | fastest of 5 passes, ms | GB/s read |\n");
    printf("|---|---|---|---|---|\n");
    for (int si = 0; si < 2; si++) {
        const int rows = shapes[si][0], cols = shapes[si][1];
        const size_t nd = (size_t)rows * cols / 2, ns = (size_t)rows * cols / 32;
        const int nw = (int)((1ull << 30) / (nd + ns));
        moe_weight *w = calloc((size_t)nw, sizeof *w);
        float *X = aligned_alloc(64, sizeof(float) * (size_t)cols);
        float *Y = aligned_alloc(64, sizeof(float) * (size_t)rows);
        if (!w || !X || !Y) {
            fprintf(stderr, "moe-kernel-loop: out of memory\n");
            exit(1);
        }
        for (int i = 0; i < cols; i++) X[i] = (float)(rnd() % 2001) / 1000.0f - 1.0f;
        for (int i = 0; i < nw; i++) {
            uint8_t *d = aligned_alloc(4096, nd), *sc = aligned_alloc(4096, ns);
            if (!d || !sc) {
                fprintf(stderr, "moe-kernel-loop: out of memory\n");
                exit(1);
            }
            for (size_t b = 0; b < nd; b += 4) {
                uint32_t v = rnd();
                memcpy(d + b, &v, 4);
            }
            for (size_t b = 0; b < ns; b++) sc[b] = (uint8_t)(120 + rnd() % 10);
            w[i] = (moe_weight){.fmt = MOE_WFMT_MXFP4, .rows = rows, .cols = cols, .scale2 = 1.0f, .name = "stream",
                                .scale_dtype = MOE_DTYPE_F8_E8M0, .scale_rows = rows, .scale_cols = cols / 32,
                                .data = d, .scale = sc};
        }
        for (size_t ii = 0; ii < sizeof isas / sizeof isas[0]; ii++) {
            const moe_cpu_kernels *k = NULL;
            moe_error err;
            if (moe_cpu_table(isas[ii], &k, &err) != MOE_OK) continue;
            double best = 1e300;
            for (int p = 0; p < 5; p++) {
                double t0 = now_ns();
#pragma omp parallel num_threads(nthreads)
                {
                    int id = 0, nt = 1;
#ifdef _OPENMP
                    id = omp_get_thread_num();
                    nt = omp_get_num_threads();
#endif
                    int64_t r0 = (int64_t)rows * id / nt, r1 = (int64_t)rows * (id + 1) / nt;
                    for (int i = 0; i < nw; i++) k->gemm(&w[i], r0, r1, X, cols, 1, Y + r0, rows);
                }
                double t = now_ns() - t0;
                if (t < best) best = t;
            }
            printf("| %s | mxfp4 %d x %d, %d weights | %d | %.2f | %.1f |\n", k->isa, rows, cols, nw, nthreads,
                   best / 1e6, (double)nw * (double)(nd + ns) / best);
        }
        for (int i = 0; i < nw; i++) {
            free((void *)w[i].data);
            free((void *)w[i].scale);
        }
        free(w);
        free(X);
        free(Y);
    }
}

int main(int argc, char **argv) {
    int rounds = 5, calls = 200, ops = 0, stream = 0;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--calls") && i + 1 < argc) calls = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--ops")) ops = 1;
        else if (!strcmp(argv[i], "--stream") && i + 1 < argc) stream = atoi(argv[++i]);
        else {
            fprintf(stderr, "usage: moe-kernel-loop [--rounds R (1-%d)] [--calls C (>= 1)] [--ops] [--stream THREADS]\n",
                    MAXR);
            return 2;
        }
    }
    if (rounds < 1 || rounds > MAXR || calls < 1 || stream < 0 || stream > 1024) {
        fprintf(stderr, "moe-kernel-loop: --rounds must be 1-%d, --calls at least 1, --stream 1-1024\n", MAXR);
        return 2;
    }
    printf("moe-kernel-loop: one thread, a %d x %d weight, min of %d calls per round, %d rounds\n\n", ROWS, COLS,
           calls, rounds);
    part1(rounds, calls);
    if (ops) part2();
    if (stream) part3(stream);
    return 0;
}
