/*
 * moe-amx-parts: where the time of the AMX bf16 routed experts goes, and the
 * AMX kernel's compile-time variants side by side (issue #18; the figures
 * and the commands are in docs/performance.md).
 *
 *   moe-amx-parts [--experts E] [--tokens T] [--iters N] [--quick] [--peaks-only | --block-only | --loops]
 *                 [--builds v0,v5,...]   (default: every build below)
 *                 [--drivers static,claim] (default: both; timed in that
 *                 order, each named at most twice: claim,static,claim)
 *
 * V4-Flash shapes (H 4096, I 2048, top-6), MXFP4 weights (random valid codes,
 * E8M0 scales 120..127), bf16 activations. It prints, with OMP_NUM_THREADS
 * threads (OMP_PLACES / OMP_PROC_BIND as the caller set them):
 *  1. peaks by thread count (1, 2, 4, ... up to the team): the bench's
 *     TDPBF16PS micro-kernel (2 x 2 tiles from L1, bench/bench.c), each
 *     thread timed alone between barriers, so that a machine whose vCPUs
 *     share execution units shows falling or scattered per-thread rates
 *     while a probe that loses time to thread start-up does not;
 *  2. the kernel's parts on one thread, one expert of n = T K / E tokens
 *     (96 at T 4096): the activations' packing (as one call packs them),
 *     the decode alone (the kernel's own loops into its panels, no tiles),
 *     the whole call and the call without the decode's arithmetic, with the
 *     weight L2-resident (256 rows, repeated) and streaming from memory (all
 *     2048 rows of a different expert each call); then the whole call on
 *     every thread at once (each on its own experts);
 *  3. the block at T tokens on the team (as `moeaudit bench` times it:
 *     uniform top-K routing over E experts): the gather, the experts driver
 *     (src/experts/experts_fast.c built with each split: static, claim;
 *     bench/amx_parts_drv_*.c) with each build's table, and for each the
 *     step's split per thread (its start, gate/up calls, SwiGLU, the rest
 *     of phase 1, the wait at the barrier, down calls, the rest of phase 2,
 *     the wait at the end: a table that times the build's calls), with a
 *     table whose kernels do nothing (what the driver and the SwiGLU cost),
 *     and the weighted combine back to [T, H].
 * --loops instead: the tile loop alone, with its operands in L1 or L2 as a
 * kernel of each blocking would find them (section "loops" below), on one
 * thread and on the team, each mode after the peaks.
 * Each build is src/cpu/amx/gemm_amx.c compiled again (bench/amx_parts_*.c):
 * v0 is the kernel before this breakdown, v5 the library's default from run
 * E to run H, v8 (K blocks of 16) from then to the fourteenth session, v16
 * (v8 with the B tiles by TILELOADDT1) briefly in it, v18 (v16 with K blocks
 * of 8) since,
 * and every build gives the same bits (the variants
 * move the packing, the blocking and the decode, never the operations on an
 * output; checked here against v0 on the block's outputs).
 * On a CPU without AMX only the packing and the decode run; it says so.
 */
#include "amx_parts.h"
#include "amx_micro.h"
#include "core/core.h"
#include "experts/experts_fast.h"
#include "formats/act.h"
#include "moe_formats.h"

#include <immintrin.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
#else
#include <time.h>
#endif

enum { H = 4096, I = 2048, K = 6, MAXT = 64 };

static double now_s(void) {
#ifdef _OPENMP
    return omp_get_wtime();
#else
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
#endif
}
static int team(void) {
#ifdef _OPENMP
    return omp_get_max_threads();
#else
    return 1;
#endif
}
static int tid(void) {
#ifdef _OPENMP
    return omp_get_thread_num();
#else
    return 0;
#endif
}

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}
static double median(double *v, int n) {
    qsort(v, (size_t)n, sizeof *v, cmp_d);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

/* ------------------------------------------------------------ builds */

typedef struct build {
    const char *name, *what;
    const moe_cpu_kernels *(*table)(void);
    void (*pack)(const float *, int64_t, int64_t, int64_t, void *);
    void (*decode)(const moe_weight *, int64_t, int64_t, void *);
} build;

#define B_(v, what) {#v, what, amx_parts_table_##v, amx_parts_pack_##v, amx_parts_decode_##v}
static const build builds[] = {
    B_(v0, "before: KB 8, scatter packing, decode after each K block"),
    B_(v1, "transpose packing"),
    B_(v2, "transpose packing + decode split over token-block pairs"),
    B_(v3, "v2 + KB 16"),
    B_(v4, "transpose packing + KB 16"),
    B_(v5, "transpose packing + decode spread over each pair's steps"),
    B_(v6, "v5 + the 2 x 2 products B-major, next tiles loaded as freed"),
    B_(v7, "v6 + B tiles two steps ahead prefetched into L1"),
    B_(v8, "v5 + KB 16 (the default from run H to the fourteenth session)"),
    B_(v9, "v6 + KB 16"),
    B_(v10, "v5 + KB 32 (panels in L2)"),
    B_(v11, "v6 + KB 32"),
    B_(v12, "v8 + the weights' prefetch into L2 (T1)"),
    B_(v13, "v8 without the weights' software prefetch"),
    B_(v14, "v8 + the next panel's decode in chunk runs, pipelined across row blocks"),
    B_(v15, "v14 + KB 128 (C never staged at 4096 columns; panels in L2)"),
    B_(v16, "v8 + the B tiles by TILELOADDT1"),
    B_(v17, "v15 + the B tiles by TILELOADDT1"),
    B_(v18, "v16 + KB 8 (the default since the fourteenth session)"),
    B_(v19, "v16 + KB 32"),
    B_(v20, "v16 + the weights' prefetch into L2 (T1)"),
    B_(v21, "v18 + the weights' prefetch into L2 (T1)"),
    B_(nd, "v2 without the decode arithmetic (the rest of the call)"),
};
enum { NB = sizeof builds / sizeof builds[0] };
static bool sel[NB]; /* --builds */

/* The experts drivers (--drivers; default: static only) */
static const struct {
    const char *name;
    amx_parts_driver run;
} drivers[] = {{"static", amx_parts_experts_static}, {"claim", amx_parts_experts_claim}};
enum { ND = sizeof drivers / sizeof drivers[0] };
static int dorder[2 * ND], ndorder; /* the drivers in the order --drivers names them (repeats allowed) */

/* ------------------------------------------------------------ peaks */

/* Peaks on nt threads: each thread times its own loop between barriers.
 * out: aggregate (sum of flops / span of the slowest) and per-thread
 * min / median / max, GFLOP/s. */
static void peak_on(int nt, double out[4]) {
    double rate[MAXT] = {0}, t0s[MAXT] = {0}, t1s[MAXT] = {0}, fl[MAXT] = {0};
#pragma omp parallel num_threads(nt)
    {
        int t = tid();
        uint16_t *A = aligned_alloc(64, 64 * 1024), *B = aligned_alloc(64, 64 * 1024);
        float *C = aligned_alloc(64, 4096 * 4);
        for (int i = 0; i < 32 * 1024; i++) {
            A[i] = (uint16_t)(0x3A80 + i % 7);
            B[i] = (uint16_t)(0x3A80 + i % 5);
        }
        bench_micro_amx(A, B, C, 8, 200); /* warm-up */
#pragma omp barrier
        double t0 = now_s();
        double f = bench_micro_amx(A, B, C, 8, 40000);
        double t1 = now_s();
        if (t < MAXT) {
            t0s[t] = t0;
            t1s[t] = t1;
            fl[t] = f;
            rate[t] = f / (t1 - t0);
        }
        volatile float sink = C[3];
        (void)sink;
        free(A);
        free(B);
        free(C);
    }
    double lo = t0s[0], hi = t1s[0], sum = 0;
    for (int t = 0; t < nt; t++) {
        lo = t0s[t] < lo ? t0s[t] : lo;
        hi = t1s[t] > hi ? t1s[t] : hi;
        sum += fl[t];
    }
    out[0] = sum / (hi - lo) * 1e-9;
    double r[MAXT];
    memcpy(r, rate, sizeof r);
    qsort(r, (size_t)nt, sizeof *r, cmp_d);
    out[1] = r[0] * 1e-9;
    out[2] = (nt % 2 ? r[nt / 2] : 0.5 * (r[nt / 2 - 1] + r[nt / 2])) * 1e-9;
    out[3] = r[nt - 1] * 1e-9;
}

/* ------------------------------------------------------------ loops */

/* --loops: the tile loop alone (no decode, no packing, no output), with
 * its operands where a kernel of each blocking finds them at n = 96 tokens
 * (T 4096): what the tiles can reach before anything else is added.
 *   l1      2 x 2 (the bench's peak loop): A and B cycled through 16 KiB each
 *   b-l2    2 x 2 as the kernel: A cycled through a 32 KiB panel (32 rows x
 *           16 steps), B (2 tiles a step) streamed from 768 KiB (the packed
 *           activations of 96 tokens x 4096 columns, L2-resident), the 4 C
 *           tiles stored to and loaded from a 12 KiB staging (32 rows x 96
 *           tokens) every 16 steps, as the kernel's K blocks do
 *   b-l2pf  b-l2 with the next step's B (32 lines) prefetched into L1
 *   4x1     4 row tiles x 1 token tile: A cycled through 32 KiB (64 rows x 8
 *           steps) into 3 rotating A registers, B (1 tile a step) from 768
 *           KiB, C through a 24 KiB staging (64 rows x 96 tokens) every 8 steps
 *   4x1pf   4x1 with the next step's B (16 lines) prefetched into L1
 *   b-l2t1  b-l2 with B loaded by TILELOADDT1 (the hint that it will not be
 *           reused: MOE_AMX_BSTREAM in the kernel)
 *   4x1t1   4x1 with B loaded by TILELOADDT1
 *   ab-l2   2 x 2 with both streamed and C kept in the tiles (a K-outer loop
 *           over a whole row): A from 256 KiB (a 32-row panel of the whole
 *           K), B from 768 KiB */
enum { LOOP_L1, LOOP_BL2, LOOP_BL2PF, LOOP_41, LOOP_41PF, LOOP_ABL2, LOOP_BL2T1, LOOP_41T1, NLOOP };
static const char *const loop_name[NLOOP] = {"l1", "b-l2", "b-l2pf", "4x1", "4x1pf", "ab-l2", "b-l2t1", "4x1t1"};

/* The C tiles 0-3 out to c (16 x 16 fp32 each, 1 KiB apart), then in from c1. */
__attribute__((target("amx-tile"), always_inline)) static inline void loop_swap_c(float *c, const float *c1) {
    _tile_stored(0, c, 64);
    _tile_stored(1, c + 256, 64);
    _tile_stored(2, c + 512, 64);
    _tile_stored(3, c + 768, 64);
    __asm__ volatile("" ::: "memory");
    _tile_loadd(0, c1, 64);
    _tile_loadd(1, c1 + 256, 64);
    _tile_loadd(2, c1 + 512, 64);
    _tile_loadd(3, c1 + 768, 64);
}

__attribute__((target("amx-tile,amx-bf16"))) static double loop_run(int mode, const uint16_t *A, const uint16_t *B,
                                                                     float *C, float *Cs, long steps) {
    bench_amx_begin();
    /* tile = 512 words; steps of each operand cycled: as (A), bs (B) */
    bool m41 = mode == LOOP_41 || mode == LOOP_41PF || mode == LOOP_41T1;
    long as = mode == LOOP_L1 ? 8 : mode == LOOP_ABL2 ? 128 : m41 ? 8 : 16;
    long bs = mode == LOOP_L1 ? 8 : m41 ? 768 : 384;
    if (m41) {
        for (long s = 0; s < steps; s++) {
            const uint16_t *a = A + (s % as) * 4 * 512, *b = B + (s % bs) * 512;
            if (mode == LOOP_41PF) {
                const char *nb = (const char *)(B + ((s + 1) % bs) * 512);
                for (int o = 0; o < 1024; o += 64) _mm_prefetch(nb + o, _MM_HINT_T0);
            }
            if (mode == LOOP_41T1) _tile_stream_loadd(6, b, 64);
            else _tile_loadd(6, b, 64);
            _tile_loadd(4, a, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_loadd(5, a + 512, 64);
            _tile_dpbf16ps(1, 5, 6);
            _tile_loadd(7, a + 1024, 64);
            _tile_dpbf16ps(2, 7, 6);
            _tile_loadd(4, a + 1536, 64);
            _tile_dpbf16ps(3, 4, 6);
            if (s % 8 == 7) /* the K block's end: this token block's C out, the next one's in */
                loop_swap_c(Cs + (s / 8 % 6) * 1024, Cs + ((s / 8 + 1) % 6) * 1024);
        }
    } else {
        for (long s = 0; s < steps; s++) {
            const uint16_t *a = A + (s % as) * 2 * 512, *b = B + (s % bs) * 2 * 512;
            if (mode == LOOP_BL2PF) {
                const char *nb = (const char *)(B + ((s + 1) % bs) * 2 * 512);
                for (int o = 0; o < 2048; o += 64) _mm_prefetch(nb + o, _MM_HINT_T0);
            }
            bench_amx_step22(a, b, mode == LOOP_BL2T1);
            if (mode != LOOP_L1 && mode != LOOP_ABL2 && s % 16 == 15) /* as the kernel's K blocks */
                loop_swap_c(Cs + (s / 16 % 3) * 1024, Cs + ((s / 16 + 1) % 3) * 1024);
        }
    }
    bench_amx_end(C);
    return 4.0 * 2 * 16 * 16 * 32 * (double)steps;
}

/* Mode m on nt threads, each on its own buffers, each timing its own loop
 * from a common start: out = sum of the threads' rates, min, median, max
 * (GFLOP/s). */
static void loop_on(int m, int nt, long steps, double out[4]) {
    double rate[MAXT] = {0};
#pragma omp parallel num_threads(nt)
    {
        int t = tid();
        uint16_t *A = aligned_alloc(64, 256 * 1024), *B = aligned_alloc(64, 1024 * 1024);
        float *C = aligned_alloc(64, 4096 * 4), *Cs = aligned_alloc(64, 6 * 4096);
        for (int i = 0; i < 128 * 1024; i++) A[i] = (uint16_t)(0x3A80 + i % 7);
        for (int i = 0; i < 512 * 1024; i++) B[i] = (uint16_t)(0x3A80 + i % 5);
        memset(Cs, 0, 6 * 4096);
        loop_run(m, A, B, C, Cs, 1536); /* every operand line touched, the unit warm */
#pragma omp barrier
        double t0 = now_s();
        double f = loop_run(m, A, B, C, Cs, steps);
        double t1 = now_s();
        if (t < MAXT) rate[t] = f / (t1 - t0);
        volatile float sink = C[3];
        (void)sink;
        free(A);
        free(B);
        free(C);
        free(Cs);
    }
    out[0] = 0;
    for (int t = 0; t < nt; t++) out[0] += rate[t] * 1e-9;
    qsort(rate, (size_t)nt, sizeof *rate, cmp_d);
    out[1] = rate[0] * 1e-9;
    out[2] = (nt % 2 ? rate[nt / 2] : 0.5 * (rate[nt / 2 - 1] + rate[nt / 2])) * 1e-9;
    out[3] = rate[nt - 1] * 1e-9;
}

static void loops(int rounds) {
    int nt = team();
    long steps = 1L << 20; /* 69 GFLOP a thread: 30 ms at a unit's 2.2 TFLOP/s */
    printf("\n--loops: the tile loop alone, operands placed as a kernel of each blocking at n = 96 finds them;\n"
           "GFLOP/s: sum of the threads' own rates (per thread min / median / max), %% of l1 in the same round\n");
    int counts[2] = {1, nt};
    for (int r = 0; r < rounds; r++)
        for (int c = 0; c < (nt > 1 ? 2 : 1); c++) {
            double l1 = 0;
            for (int m = 0; m < NLOOP; m++) {
                double o[4];
                loop_on(m, counts[c], steps, o);
                if (m == LOOP_L1) l1 = o[0];
                printf("  round %d, %2d threads, %-6s %8.0f (%6.0f / %6.0f / %6.0f)  %5.1f%%\n", r + 1, counts[c],
                       loop_name[m], o[0], o[1], o[2], o[3], l1 > 0 ? 100 * o[0] / l1 : 0);
            }
        }
}

/* ------------------------------------------------------------ experts */

static uint64_t mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

typedef struct experts {
    int64_t n;
    uint8_t *mem;
    moe_weight *w; /* [n][3]: w1, w3 [I, H], w2 [H, I] */
} experts;

static size_t wbytes(int64_t rows, int64_t cols) {
    return (((size_t)(rows * cols / 2) + 63) & ~(size_t)63) + (((size_t)(rows * cols / 32) + 63) & ~(size_t)63);
}

/* MXFP4 weights of random codes, E8M0 scales in 120..127 (as bench/bench.c) */
static int experts_init(experts *es, int64_t n) {
    size_t per = 2 * wbytes(I, H) + wbytes(H, I);
    es->n = n;
    es->mem = aligned_alloc(64, per * (size_t)n);
    es->w = calloc((size_t)(3 * n), sizeof *es->w);
    if (!es->mem || !es->w) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t e = 0; e < n; e++) {
        uint8_t *p = es->mem + per * (size_t)e;
        for (int m = 0; m < 3; m++) {
            int64_t rows = m < 2 ? I : H, cols = m < 2 ? H : I;
            moe_weight *w = &es->w[3 * e + m];
            size_t d = (size_t)(rows * cols / 2), s = (size_t)(rows * cols / 32);
            w->fmt = MOE_WFMT_MXFP4;
            w->rows = rows;
            w->cols = cols;
            w->scale2 = 1.0f;
            w->name = "parts";
            w->data = p;
            uint64_t seed = (uint64_t)(3 * e + m) << 40;
            for (size_t i = 0; i < d; i += 8) {
                uint64_t r = mix64(seed + i);
                memcpy(p + i, &r, d - i < 8 ? d - i : 8);
            }
            p += (d + 63) & ~(size_t)63;
            w->scale = p;
            w->scale_rows = rows;
            w->scale_cols = cols / 32;
            w->scale_dtype = MOE_DTYPE_F8_E8M0;
            for (size_t i = 0; i < s; i++) p[i] = (uint8_t)(120 + mix64(~seed + i) % 8);
            p += (s + 63) & ~(size_t)63;
        }
    }
    return 0;
}

/* ------------------------------------------------------------ parts */

static void nothing(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx, int64_t n, float *Y,
                    int64_t ldy, void *ws) {
    (void)w, (void)r0, (void)r1, (void)X, (void)ldx, (void)n, (void)Y, (void)ldy, (void)ws;
}
static size_t no_ws(const moe_weight *w, int64_t n) { return (void)w, (void)n, 0; }
/* the driver with kernels that do nothing: its split, the SwiGLU and the
 * activation rounding of phase 1, the barrier */
/* (its swiglu: the amx table's, set in block) */

static float *bf16_rows(int64_t rows, int64_t cols, uint64_t seed) {
    float *X = aligned_alloc(64, (size_t)(rows * cols) * 4);
    if (!X) return NULL;
    for (int64_t i = 0; i < rows * cols; i++) X[i] = (float)((int)(mix64(seed + (uint64_t)i) % 2001) - 1000) * 1e-3f;
    moe_act_round_f32(MOE_ACT_BF16, X, rows * cols);
    return X;
}

/* time of one call, min over reps */
#define MIN_TIME(reps, stmt)                                                                                   \
    ({                                                                                                          \
        double best_ = 1e30;                                                                                    \
        for (int r_ = 0; r_ < (reps); r_++) {                                                                   \
            double t0_ = now_s();                                                                               \
            stmt;                                                                                               \
            double dt_ = now_s() - t0_;                                                                         \
            if (dt_ < best_) best_ = dt_;                                                                       \
        }                                                                                                       \
        best_;                                                                                                  \
    })

static void parts(const experts *es, int64_t n, bool amx, double peak1, bool quick) {
    const moe_weight *w0 = &es->w[0];
    float *X = bf16_rows(n, H, 7), *Y = aligned_alloc(64, (size_t)(n * I) * 4);
    size_t wsb = 0; /* the largest any build asks for, for n tokens and for the decode's 32 */
    for (int b = 0; b < NB; b++) {
        const moe_cpu_kernels *k = builds[b].table();
        size_t s1 = k->bf16act_ws(w0, n), s2 = k->bf16act_ws(w0, 32);
        wsb = s1 > wsb ? s1 : wsb;
        wsb = s2 > wsb ? s2 : wsb;
    }
    void *ws = aligned_alloc(64, wsb);
    if (!X || !Y || !ws) return;
    memset(ws, 0, wsb);
    const int reps = quick ? 3 : 20;
    printf("\n2. parts on one thread, n = %lld tokens, MXFP4 [%d, %d]:\n", (long long)n, I, H);
    /* packing: steps x tokens of 32 columns */
    double steps = (double)n * (H / 32);
    for (int b = 0; b < 2; b++) {
        double t = MIN_TIME(reps, builds[b].pack(X, H, n, H, ws));
        printf("  pack (%s, %s): %.1f us per call of %lld x %d, %.2f ns per token-step of 32\n", builds[b].name,
               b ? "transpose" : "scatter", t * 1e6, (long long)n, H, t * 1e9 / steps);
    }
    /* decode alone: L2-resident rows, then streaming */
    double chunks256 = 256.0 * (H / 32), chunks_all = (double)I * (H / 32);
    double tdl2 = MIN_TIME(reps, builds[0].decode(w0, 0, 256, ws));
    int64_t ne = es->n < 64 ? es->n : 64, e = 0;
    double tds = MIN_TIME(quick ? 4 : ne, (builds[0].decode(&es->w[3 * (e % ne)], 0, I, ws), e++));
    printf("  decode alone: L2 %.3f ns per 32 weights (256 rows), streaming %.3f ns (%.1f GB/s of MXFP4)\n",
           tdl2 * 1e9 / chunks256, tds * 1e9 / chunks_all, (double)wbytes(I, H) / tds * 1e-9);
    if (!amx) {
        printf("  (no AMX here: the tile calls, the block and the AMX peaks were not run)\n");
        free(X), free(Y), free(ws);
        return;
    }
    double fl256 = 2.0 * (double)n * 256 * H, flall = 2.0 * (double)n * I * H;
    for (int b = 0; b < NB; b++) {
        if (!sel[b]) continue;
        const moe_cpu_kernels *k = builds[b].table();
        double tl2 = MIN_TIME(reps, k->gemm_bf16act(w0, 0, 256, X, H, n, Y, I, ws));
        e = 1;
        double tst = MIN_TIME(quick ? 4 : ne, (k->gemm_bf16act(&es->w[3 * (e % ne)], 0, I, X, H, n, Y, I, ws), e++));
        printf("  call %-3s L2 %7.1f us %5.2f TFLOP/s (%4.1f%% of 1-thread peak), streaming %7.1f us %5.2f TFLOP/s "
               "(%4.1f%%)  [%s]\n",
               builds[b].name, tl2 * 1e6, fl256 / tl2 * 1e-12, 100 * fl256 / tl2 / (peak1 * 1e9), tst * 1e6,
               flall / tst * 1e-12, 100 * flall / tst / (peak1 * 1e9), builds[b].what);
    }
    free(X), free(Y), free(ws);
}

/* every thread its own experts, the whole call streaming: per-thread TFLOP/s */
static void parts_all(const experts *es, int64_t n, bool quick) {
    int nt = team();
    printf("\n   the whole call on all %d threads at once (each on its own experts' w1, streaming):\n", nt);
    for (int b = 0; b < NB; b++) {
        if (!sel[b]) continue;
        const moe_cpu_kernels *k = builds[b].table();
        double rate[MAXT] = {0};
#pragma omp parallel
        {
            int t = tid();
            float *X = bf16_rows(n, H, 11 + (uint64_t)t), *Y = aligned_alloc(64, (size_t)(n * I) * 4);
            void *ws = aligned_alloc(64, k->bf16act_ws(&es->w[0], n));
            int64_t calls = quick ? 2 : 6;
            k->gemm_bf16act(&es->w[0], 0, 64, X, H, n, Y, I, ws);
#pragma omp barrier
            double t0 = now_s();
            for (int64_t c = 0; c < calls; c++) {
                int64_t e = (t + c * nt) % es->n;
                k->gemm_bf16act(&es->w[3 * e], 0, I, X, H, n, Y, I, ws);
            }
            double dt = now_s() - t0;
            if (t < MAXT) rate[t] = 2.0 * (double)n * I * H * (double)calls / dt;
            free(X), free(Y), free(ws);
        }
        double sum = 0;
        for (int t = 0; t < nt && t < MAXT; t++) sum += rate[t];
        printf("  call %-3s %.2f TFLOP/s per thread (mean), %.2f all threads\n", builds[b].name, sum / nt * 1e-12,
               sum * 1e-12);
    }
}

/* ------------------------------------------------------------ phase split */

/* A table that times the calls of another (the build under test) per
 * thread: the GEMM calls by phase (gate / up: w of I rows; down: w of H
 * rows) and the SwiGLU calls, with the first start and the last end of each
 * phase, so that each thread's span of moe_experts_fast splits into: its
 * start, phase 1 (gate/up calls, SwiGLU, the rest: the activation rounding
 * and the split's loop), the wait at the barrier, phase 2 (down calls, the
 * rest) and the wait at the region's end. Two clock reads per call; the
 * calls' own times are unchanged (bench-only state: this program is one
 * thread of control outside the region). */
typedef struct phase_rec {
    double gemm[2], swiglu, first[2], last[2], flops[2];
    int64_t calls[2];
    char pad[64];
} phase_rec;
static phase_rec recs[MAXT];
static const moe_cpu_kernels *inner; /* the build being timed */

static void timed_gemm(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t ldx, int64_t n, float *Y,
                       int64_t ldy, void *ws) {
    double t0 = now_s();
    inner->gemm_bf16act(w, r0, r1, X, ldx, n, Y, ldy, ws);
    double t1 = now_s();
    phase_rec *r = &recs[tid()];
    int ph = w->rows == I ? 0 : 1;
    r->gemm[ph] += t1 - t0;
    r->calls[ph]++;
    r->flops[ph] += 2.0 * (double)(r1 - r0) * (double)n * (double)w->cols;
    if (r->first[ph] == 0) r->first[ph] = t0;
    r->last[ph] = t1;
}
static size_t timed_ws(const moe_weight *w, int64_t n) { return inner->bf16act_ws(w, n); }
static void timed_swiglu(float *g, const float *u, int64_t n, float limit) {
    double t0 = now_s();
    moe_cpu_swiglu(inner)(g, u, n, limit);
    double t1 = now_s();
    phase_rec *r = &recs[tid()];
    r->swiglu += t1 - t0;
    r->last[0] = t1;
}
static const moe_cpu_kernels timed_table = {"amx", NULL, timed_gemm, timed_ws, timed_swiglu};

/* Per-thread parts, summed over iterations: [thread][part] */
enum { P_START, P_GU, P_SW, P_P1REST, P_BARRIER, P_DOWN, P_P2REST, P_END, NPART, F_GU = NPART, F_DN, NACC };
static const char *const part_names[NPART] = {"start",   "gate/up calls", "SwiGLU",   "phase-1 rest",
                                              "barrier", "down calls",    "p2 rest", "end wait"};

static void split_add(double acc[][NACC], int nt, double t0, double t1) {
    for (int t = 0; t < nt; t++) {
        const phase_rec *r = &recs[t];
        double f0 = r->first[0] ? r->first[0] : t0, l0 = r->last[0] ? r->last[0] : f0;
        double f1 = r->first[1] ? r->first[1] : l0, l1 = r->last[1] ? r->last[1] : f1;
        acc[t][P_START] += f0 - t0;
        acc[t][P_GU] += r->gemm[0];
        acc[t][P_SW] += r->swiglu;
        acc[t][P_P1REST] += (l0 - f0) - r->gemm[0] - r->swiglu;
        acc[t][P_BARRIER] += f1 - l0;
        acc[t][P_DOWN] += r->gemm[1];
        acc[t][P_P2REST] += (l1 - f1) - r->gemm[1];
        acc[t][P_END] += t1 - l1;
        acc[t][F_GU] += r->flops[0];
        acc[t][F_DN] += r->flops[1];
    }
}

/* mean / min / max over threads of each part (ms per step), and each
 * thread's gate/up and down rate while in its calls (TFLOP/s) */
static void split_print(double acc[][NACC], int nt, int iters) {
    printf("     per step, ms, mean (min-max) over %d threads; the parts of a thread sum to the step:\n", nt);
    for (int p = 0; p < NPART; p++) {
        double sum = 0, lo = 1e30, hi = -1e30;
        for (int t = 0; t < nt; t++) {
            double v = acc[t][p] / iters * 1e3;
            sum += v;
            lo = v < lo ? v : lo;
            hi = v > hi ? v : hi;
        }
        printf("       %-14s %8.2f (%.2f-%.2f)\n", part_names[p], sum / nt, lo, hi);
    }
    double fg = 0, fd = 0, tg = 0, td = 0;
    printf("     per thread, TFLOP/s in its gate/up | down calls:");
    for (int t = 0; t < nt; t++) {
        printf(" %.2f|%.2f", acc[t][P_GU] > 0 ? acc[t][F_GU] / acc[t][P_GU] * 1e-12 : 0,
               acc[t][P_DOWN] > 0 ? acc[t][F_DN] / acc[t][P_DOWN] * 1e-12 : 0);
        fg += acc[t][F_GU], fd += acc[t][F_DN], tg += acc[t][P_GU], td += acc[t][P_DOWN];
    }
    printf("\n     all calls: gate/up %.2f, down %.2f TFLOP/s per thread in its calls\n", tg > 0 ? fg / tg * 1e-12 : 0,
           td > 0 ? fd / td * 1e-12 : 0);
}

/* ------------------------------------------------------------ block */

/* fallback: when not NULL (no AMX here), the block runs with that table
 * alone (the avx512 bf16 one), to check the drivers and the split. */
static void block(const experts *es, int64_t T, int iters, double peak_team, const moe_cpu_kernels *fallback) {
    int nt = team();
    int64_t E = es->n, na = T * K;
    float *X = bf16_rows(T, H, 3), *Xg = aligned_alloc(64, (size_t)(na * H) * 4),
          *Yg = aligned_alloc(64, (size_t)(na * H) * 4), *Yref = aligned_alloc(64, (size_t)(na * H) * 4),
          *Yo = aligned_alloc(64, (size_t)(T * H) * 4);
    int32_t *ids = malloc((size_t)na * 4), *cnt = calloc((size_t)E, 4), *off = malloc((size_t)(E + 1) * 4),
            *pos = malloc((size_t)E * 4), *tok = malloc((size_t)na * 4), *where = malloc((size_t)na * 4);
    moe_expert_job *jobs = malloc((size_t)E * sizeof *jobs);
    if (!X || !Xg || !Yg || !Yref || !Yo || !ids || !cnt || !off || !pos || !tok || !where || !jobs) return;
    uint64_t rs = 99;
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
    for (int64_t a = 0; a < na; a++) cnt[ids[a]]++;
    off[0] = 0;
    for (int64_t e = 0; e < E; e++) {
        off[e + 1] = off[e] + cnt[e];
        pos[e] = off[e];
    }
    for (int64_t a = 0; a < na; a++) {
        where[a] = pos[ids[a]];
        tok[pos[ids[a]]++] = (int32_t)(a / K);
    }
    int nj = 0;
    for (int64_t e = 0; e < E; e++)
        if (cnt[e])
            jobs[nj++] = (moe_expert_job){&es->w[3 * e], &es->w[3 * e + 1], &es->w[3 * e + 2],
                                          Xg + (size_t)off[e] * H, Yg + (size_t)off[e] * H, cnt[e]};
    size_t scr = 0;
    for (int b = 0; b <= NB; b++) {
        const moe_cpu_kernels *k = b < NB ? builds[b].table() : fallback;
        size_t s = k ? moe_experts_fast_scratch(k, MOE_ACT_BF16, jobs, nj, nt) : 0;
        scr = s > scr ? s : scr;
    }
    void *scratch = aligned_alloc(64, (scr + 63) & ~(size_t)63);
    if (!scratch) return;
    for (size_t i = 0; i < scr / 4; i++) ((float *)scratch)[i] = 0.37f;
    double flops = 2.0 * (double)na * 3.0 * H * I;
    printf("\n3. the block, T = %lld, top-%d over %lld experts (%d with tokens), %d threads, median of %d:\n",
           (long long)T, K, (long long)E, nj, nt, iters);
    double tv[64];
    const moe_cpu_kernels stub_table = {"amx", NULL, nothing, no_ws, builds[0].table()->swiglu};
    for (int it = 0; it < iters; it++) {
        double t0 = now_s();
#pragma omp parallel for schedule(static)
        for (int64_t a = 0; a < na; a++) memcpy(Xg + a * H, X + (size_t)tok[a] * H, (size_t)H * 4);
        tv[it] = now_s() - t0;
    }
    double tg = median(tv, iters);
    printf("  gather  %8.2f ms (%.1f GB/s read + written)\n", tg * 1e3, 2.0 * (double)na * H * 4 / tg * 1e-9);
    for (int it = 0; it < iters; it++) {
        double t0 = now_s();
        moe_experts_fast(&stub_table, 0.0, MOE_ACT_BF16, jobs, nj, scratch, nt); /* the library's driver */
        tv[it] = now_s() - t0;
    }
    double ts = median(tv, iters);
    printf("  driver + SwiGLU (kernels doing nothing) %8.2f ms (%.2f ns per SwiGLU element per thread)\n", ts * 1e3,
           ts * 1e9 * nt / ((double)na * I));
    int ref = -1; /* the first build timed: the others' outputs are compared with its */
    for (int di = 0; di < ndorder; di++) {
        int d = dorder[di];
        for (int b = 0; b < NB; b++) {
            if (fallback ? b > 0 : !sel[b]) continue;
            inner = fallback ? fallback : builds[b].table();
            const char *bname = fallback ? fallback->isa : builds[b].name;
            if (ref < 0) drivers[d].run(inner, 0.0, MOE_ACT_BF16, jobs, nj, scratch, nt); /* warm-up, once */
            static double acc[MAXT][NACC];
            memset(acc, 0, sizeof acc);
            /* NaN in every output first (outside the timing), so that rows a
             * driver or build leaves unwritten fail the comparison below
             * instead of keeping the previous configuration's values */
            memset(Yg, 0xFF, (size_t)(na * H) * 4);
            for (int it = 0; it < iters; it++) {
                memset(recs, 0, sizeof recs);
                double t0 = now_s();
                drivers[d].run(&timed_table, 0.0, MOE_ACT_BF16, jobs, nj, scratch, nt);
                double t1 = now_s();
                tv[it] = t1 - t0;
                split_add(acc, nt, t0, t1);
            }
            double tm = median(tv, iters), lo = tv[0], hi = tv[iters - 1];
            /* the calls' own flops, all threads and iterations: every row of
             * every weight once per iteration */
            double fcount = 0;
            for (int t = 0; t < nt; t++) fcount += acc[t][F_GU] + acc[t][F_DN];
            bool all_rows = fabs(fcount / iters - flops) <= 1e-9 * flops;
            bool same = true;
            if (strcmp(bname, "nd")) {
                if (ref < 0) {
                    ref = b;
                    memcpy(Yref, Yg, (size_t)(na * H) * 4);
                } else same = memcmp(Yref, Yg, (size_t)(na * H) * 4) == 0;
            }
            printf("  experts %-3s %-6s %8.2f ms (%.2f-%.2f) %5.2f TFLOP/s = %4.1f%% of the AMX peak "
                   "(%.0f GFLOP/s)%s\n",
                   bname, drivers[d].name, tm * 1e3, lo * 1e3, hi * 1e3, flops / tm * 1e-12,
                   peak_team > 0 ? 100 * flops / tm / (peak_team * 1e9) : 0.0, peak_team,
                   !strcmp(bname, "nd") ? " (no decode: not the product)"
                   : same                        ? ""
                                                 : " OUTPUT DIFFERS FROM THE FIRST BUILD'S");
            if (!all_rows)
                printf("  CALLS DID %.6g GFLOP PER STEP, NOT %.6g: rows missed or repeated\n", fcount / iters * 1e-9,
                       flops * 1e-9);
            split_print(acc, nt, iters);
        }
    }
    for (int it = 0; it < iters; it++) {
        double t0 = now_s();
#pragma omp parallel for schedule(static)
        for (int64_t t = 0; t < T; t++) {
            float *y = Yo + t * H;
            const float *r0 = Yg + (size_t)where[t * K] * H;
            for (int64_t h = 0; h < H; h++) y[h] = 0.125f * r0[h];
            for (int64_t j = 1; j < K; j++) {
                const float *r = Yg + (size_t)where[t * K + j] * H;
                for (int64_t h = 0; h < H; h++) y[h] += 0.125f * r[h];
            }
        }
        tv[it] = now_s() - t0;
    }
    printf("  combine %8.2f ms (weighted sum of the K rows per token)\n", median(tv, iters) * 1e3);
    free(X), free(Xg), free(Yg), free(Yref), free(Yo), free(ids), free(cnt), free(off), free(pos), free(tok);
    free(where), free(jobs), free(scratch);
}

int main(int argc, char **argv) {
    int64_t E = 256, T = 4096;
    int iters = 5;
    bool quick = false, peaks_only = false, loops_only = false, block_only = false, any_sel = false, any_dsel = false;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--experts") && i + 1 < argc) E = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) T = atoll(argv[++i]);
        else if (!strcmp(argv[i], "--iters") && i + 1 < argc) iters = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--quick")) quick = true;
        else if (!strcmp(argv[i], "--peaks-only")) peaks_only = true;
        else if (!strcmp(argv[i], "--block-only")) block_only = true;
        else if (!strcmp(argv[i], "--loops")) loops_only = true;
        else if (!strcmp(argv[i], "--drivers") && i + 1 < argc) {
            for (const char *q = argv[++i]; *q;) {
                size_t l = strcspn(q, ",");
                int d = 0;
                while (d < ND && (strlen(drivers[d].name) != l || strncmp(q, drivers[d].name, l))) d++;
                if (d == ND) {
                    fprintf(stderr, "moe-amx-parts: no driver '%.*s' (static, claim)\n", (int)l, q);
                    return 2;
                }
                if (ndorder < 2 * ND) dorder[ndorder++] = d;
                any_dsel = true;
                q += l + (q[l] == ',');
            }
        }
        else if (!strcmp(argv[i], "--builds") && i + 1 < argc) {
            for (const char *q = argv[++i]; *q;) {
                size_t l = strcspn(q, ",");
                int b = 0;
                while (b < NB && (strlen(builds[b].name) != l || strncmp(q, builds[b].name, l))) b++;
                if (b == NB) {
                    fprintf(stderr, "moe-amx-parts: no build '%.*s' (v0-v21, nd)\n", (int)l, q);
                    return 2;
                }
                sel[b] = any_sel = true;
                q += l + (q[l] == ',');
            }
        }
        else {
            fprintf(stderr, "usage: moe-amx-parts [--experts E (>= 6)] [--tokens T] [--iters N (1-64)] [--quick]\n"
                            "                     [--peaks-only | --block-only | --loops] [--builds v0,v5,...]\n"
                            "                     [--drivers static,claim,...]\n");
            return 2;
        }
    }
    if (!any_sel)
        for (int b = 0; b < NB; b++) sel[b] = true;
    if (!any_dsel)
        for (int d = 0; d < ND; d++) dorder[ndorder++] = d;
    if (E < K || T < 1 || iters < 1 || iters > 64 || team() > MAXT) {
        fprintf(stderr, "moe-amx-parts: --experts >= %d, --tokens >= 1, --iters 1..64, at most %d threads\n", K, MAXT);
        return 2;
    }
    const moe_cpu_kernels *ka = NULL, *k5 = NULL;
    moe_error err;
    bool amx = moe_cpu_table(MOE_ISA_AMX, &ka, &err) == MOE_OK;
    bool bf = moe_cpu_table(MOE_ISA_AVX512, &k5, NULL) == MOE_OK && k5->gemm_bf16act;
    printf("moe-amx-parts: %d threads, E %lld, T %lld; amx: %s\n", team(), (long long)E, (long long)T,
           amx ? "yes" : err.msg);
    if (!bf) {
        printf("no AVX-512 BF16 here: nothing to time\n");
        return 0;
    }
    double peak1 = 0, peak_team = 0;
    if (amx) {
        printf("\n1. peaks by thread count: aggregate GFLOP/s, per thread min / median / max\n");
        int nt = team();
        for (int n = 1; n <= nt; n = n * 2 > nt && n < nt ? nt : n * 2) {
            double a[4];
            peak_on(n, a);
            printf("  %2d threads: TDPBF16PS %8.0f (%6.0f / %6.0f / %6.0f)\n", n, a[0], a[1], a[2], a[3]);
            if (n == 1) peak1 = a[0];
            if (n == nt) peak_team = a[0];
        }
    }
    if (loops_only) {
        if (amx) loops(iters < 3 ? iters : 3);
        else printf("--loops: no AMX here: nothing to time\n");
        return 0;
    }
    if (peaks_only) return 0;
    experts es;
    if (experts_init(&es, E)) {
        fprintf(stderr, "moe-amx-parts: out of memory for %lld experts\n", (long long)E);
        return 1;
    }
    int64_t n = (T * K + E / 2) / E;
    if (!block_only) parts(&es, n < 1 ? 1 : n, amx, peak1, quick);
    if (amx) {
        if (!block_only) parts_all(&es, n < 1 ? 1 : n, quick);
        block(&es, T, iters, peak_team, NULL);
    } else {
        printf("\n(no AMX: the block with the avx512 bf16 table, to check the drivers and the split)\n");
        block(&es, T, iters, 0, k5);
    }
    free(es.mem);
    free(es.w);
    return 0;
}
