/*
 * The AMX kernel (src/cpu/amx/gemm_amx.c, compiled here against the software
 * tiles of amx_emulate.h) against the scalar model of its operation sequence
 * (bf16_models.h: amx_model), bit for bit: every format it multiplies in
 * bf16, row counts around the 16- and 32-row tile blocks, columns with a
 * partial last step and several 256-column K blocks, token counts around the
 * 16-token tile width, row sub-ranges, a garbage-filled workspace of exactly
 * the size the table asks for, NaN/Inf tokens. This checks the kernel's
 * packing, panels, blocking and staging on a CPU without AMX; whether the
 * hardware follows the SDM text that amx_emulate.h and amx_model encode is
 * checked by test-kernels on an AMX CPU (test_amx_probe and the bf16act
 * tests). Needs AVX-512 with BF16 (the kernel's decode and packing run for
 * real): skipped, and said so, elsewhere.
 */
#include "bf16_models.h"
#include "experts/experts_fast.h"
#include "formats/mathf.h"
#include "harness.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

const moe_cpu_kernels *moe_cpu_amx_emulated_table(void);
const moe_cpu_kernels *moe_cpu_amx_emulated_p16_table(void);
const moe_cpu_kernels *moe_cpu_amx_emulated_p128_table(void);
extern long amx_emu_fault_count(void);
extern long amx_emu_fault_count_p16(void);
extern long amx_emu_fault_count_p128(void);

/* The builds of the kernel under test: the defaults (tests/amx_emu_kernel.c)
 * and the decode pipelined across row blocks (MOE_AMX_DSPLIT 3) with B tiles
 * by TILELOADDT1 (MOE_AMX_BSTREAM 1) and K blocks of 16 and of 128 steps
 * (tests/amx_emu_kernel_p*.c); the shape tests run on each in turn (g_build). */
static const struct {
    const char *name;
    const moe_cpu_kernels *(*table)(void);
    long (*faults)(void);
} builds[] = {{"defaults", moe_cpu_amx_emulated_table, amx_emu_fault_count},
              {"dsplit 3, bstream, kb 16", moe_cpu_amx_emulated_p16_table, amx_emu_fault_count_p16},
              {"dsplit 3, bstream, kb 128", moe_cpu_amx_emulated_p128_table, amx_emu_fault_count_p128}};
static int g_build;
static const moe_cpu_kernels *g_tab(void) { return builds[g_build].table(); }

static uint64_t rng = 0x2545F4914F6CDD1Dull;
static double urand(void) { return moe_t_rng_unif(&rng) * 2.0 - 1.0; }

typedef struct tweight {
    moe_weight w;
    void *data, *scale;
} tweight;

static void make(tweight *t, moe_wfmt fmt, int64_t rows, int64_t cols) {
    memset(t, 0, sizeof *t);
    moe_weight *w = &t->w;
    w->fmt = fmt;
    w->rows = rows;
    w->cols = cols;
    w->scale2 = 1.0f;
    w->name = "emu";
    if (fmt == MOE_WFMT_BF16) {
        uint16_t *d = malloc((size_t)(rows * cols) * 2);
        for (int64_t i = 0; i < rows * cols; i++) {
            uint64_t r = moe_splitmix64(&rng);
            d[i] = (uint16_t)((r & 0x807F) | (118 + (r >> 16) % 12) << 7);
        }
        t->data = d;
    } else {
        int64_t blk = fmt == MOE_WFMT_MXFP4 ? 32 : 16;
        uint8_t *d = malloc((size_t)(rows * cols / 2)), *s = malloc((size_t)(rows * cols / blk));
        for (int64_t i = 0; i < rows * cols / 2; i++) d[i] = (uint8_t)moe_splitmix64(&rng);
        for (int64_t i = 0; i < rows * cols / blk; i++) {
            uint8_t b = (uint8_t)moe_splitmix64(&rng);
            s[i] = fmt == MOE_WFMT_MXFP4 ? (uint8_t)(120 + b % 15) : (uint8_t)((b & 0x7F) == 0x7F ? 0x7E : b & 0x7F);
        }
        t->data = d;
        t->scale = s;
        w->scale_rows = rows;
        w->scale_cols = cols / blk;
        w->scale_dtype = fmt == MOE_WFMT_MXFP4 ? MOE_DTYPE_F8_E8M0 : MOE_DTYPE_F8_E4M3;
        if (fmt == MOE_WFMT_NVFP4) w->scale2 = 0.37f;
    }
    w->data = t->data;
    w->scale = t->scale;
}

static void unmake(tweight *t) {
    free(t->data);
    free(t->scale);
}

static const char *fname(moe_wfmt f) { return f == MOE_WFMT_MXFP4 ? "mxfp4" : f == MOE_WFMT_NVFP4 ? "nvfp4" : "bf16"; }

/* Y [n, ldy] of rows [r0, r1) through the emulated table, workspace filled with garbage. */
static void run(const moe_cpu_kernels *k, const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t n,
                float *Y, int64_t ldy) {
    size_t b = k->bf16act_ws(w, n);
    void *ws = aligned_alloc(64, (b + 63) & ~(size_t)63);
    memset(ws, 0x5A, b);
    k->gemm_bf16act(w, r0, r1, X, w->cols, n, Y, ldy, ws);
    free(ws);
}

/* Outputs of rows [r0, r1) that differ from amx_model (NaN equals NaN). */
static int mismatches(const moe_weight *w, int64_t r0, int64_t r1, const float *X, int64_t n, const float *Y,
                      int64_t ldy, const char *what) {
    int bad = 0;
    for (int64_t j = r0; j < r1; j++)
        for (int64_t t = 0; t < n; t++) {
            float m = amx_model(w, j, X + t * w->cols), y = Y[t * ldy + (j - r0)];
            bool same = isnan(m) ? isnan(y) : memcmp(&m, &y, 4) == 0;
            if (!same && bad++ < 3)
                fprintf(stderr, "  %s: row %lld tok %lld: kernel %.9g model %.9g\n", what, (long long)j, (long long)t,
                        y, m);
        }
    return bad;
}

static void test_shapes(void) {
    const moe_cpu_kernels *k = g_tab();
    static const moe_wfmt fmts[] = {MOE_WFMT_MXFP4, MOE_WFMT_NVFP4, MOE_WFMT_BF16};
    static const int64_t rows_s[] = {1, 15, 16, 17, 32, 33, 70};
    /* 33: two token-block pairs, the last one single; 65: three (the split
     * of the next K block's decode over pairs, MOE_AMX_DSPLIT) */
    static const int64_t ns[] = {1, 2, 15, 16, 17, 33, 65};
    for (int f = 0; f < 3; f++) {
        int64_t cols_s[4] = {96, 544, 1056,
                             fmts[f] == MOE_WFMT_BF16 ? 1061 : fmts[f] == MOE_WFMT_NVFP4 ? 1040 : 4128};
        for (int ci = 0; ci < 4; ci++)
            for (int ri = 0; ri < 7; ri++) {
                int64_t cols = cols_s[ci], rows = rows_s[ri];
                if (cols == 4128 && rows > 33) continue;
                tweight tw;
                make(&tw, fmts[f], rows, cols);
                float *X = malloc((size_t)(65 * cols) * 4), *Y = malloc((size_t)(65 * rows) * 4);
                for (int64_t i = 0; i < 65 * cols; i++) X[i] = moe_bf16_round((float)(2.0 * urand()));
                for (int ni = 0; ni < 7; ni++) {
                    int64_t n = ns[ni];
                    if (cols == 4128 && n > 17) continue;
                    char what[96];
                    snprintf(what, sizeof what, "%s rows %lld cols %lld n %lld", fname(fmts[f]), (long long)rows,
                             (long long)cols, (long long)n);
                    memset(Y, 0xFF, (size_t)(n * rows) * 4);
                    run(k, &tw.w, 0, rows, X, n, Y, rows);
                    CHECK(mismatches(&tw.w, 0, rows, X, n, Y, rows, what) == 0, "%s: differs from amx_model", what);
                    if (rows > 5) { /* a sub-range that starts inside a tile block */
                        memset(Y, 0xFF, (size_t)(n * rows) * 4);
                        run(k, &tw.w, 5, rows, X, n, Y, rows);
                        CHECK(mismatches(&tw.w, 5, rows, X, n, Y, rows, what) == 0, "%s rows 5..: differs", what);
                    }
                }
                free(X);
                free(Y);
                unmake(&tw);
            }
    }
}

/* A NaN in token 1 and an Inf in token 3: as the model (NaN everywhere in
 * token 1, the others unchanged). */
static void test_nonfinite(void) {
    const moe_cpu_kernels *k = g_tab();
    int64_t rows = 20, cols = 544, n = 5;
    tweight tw;
    make(&tw, MOE_WFMT_MXFP4, rows, cols);
    float *X = malloc((size_t)(n * cols) * 4), *Y = malloc((size_t)(n * rows) * 4);
    for (int64_t i = 0; i < n * cols; i++) X[i] = moe_bf16_round((float)urand());
    X[1 * cols + 77] = NAN;
    X[3 * cols + 5] = INFINITY;
    run(k, &tw.w, 0, rows, X, n, Y, rows);
    CHECK(mismatches(&tw.w, 0, rows, X, n, Y, rows, "nonfinite") == 0, "NaN/Inf tokens differ from the model");
    int nan_ok = 1;
    for (int64_t j = 0; j < rows; j++) nan_ok &= isnan(Y[rows + j]);
    CHECK(nan_ok, "NaN token not NaN everywhere");
    free(X);
    free(Y);
    unmake(&tw);
}

/* The workspace the table asks for: grows with n, never with the rows asked
 * for, and 0 for the formats the tiles do not take. */
static void test_workspace(void) {
    const moe_cpu_kernels *k = g_tab();
    tweight tw;
    make(&tw, MOE_WFMT_MXFP4, 64, 4096);
    size_t a = k->bf16act_ws(&tw.w, 1), b = k->bf16act_ws(&tw.w, 96);
    CHECK(a > 0 && b > a, "ws(1) %zu, ws(96) %zu", a, b);
    fprintf(stderr, "  amx workspace at 4096 columns: n=1 %zu bytes, n=96 %zu bytes\n", a, b);
    unmake(&tw);
    moe_weight f32w = {0};
    f32w.fmt = MOE_WFMT_F32;
    f32w.rows = 4;
    f32w.cols = 64;
    CHECK(k->bf16act_ws(&f32w, 10) == 0, "f32 weights need no AMX workspace");
}

/*
 * The experts driver on the amx table (src/experts/experts_fast.c with the
 * emulated tiles: the table's name is "amx", so at 4 or more jobs per thread
 * the phases run as claimed chunks, invariant 5): 48 MXFP4 experts of 0-24
 * tokens (H 256, I 128: the down phase's tail jobs cut into 4 pieces), 1, 2,
 * 3 and 8 threads (claimed chunks from 2 threads on), against the scalar
 * chain per token: amx_model for gate and up, moe_swiglu_f32, the bf16
 * rounding, amx_model for down. Bit for bit, every output (NaN-filled
 * before), at every thread count.
 */
static void test_experts_claim(void) {
    const moe_cpu_kernels *k = moe_cpu_amx_emulated_table();
    enum { E = 48, H = 256, I = 128, MAXN = 24 };
    const float L = 7.0f;
    tweight w[E][3];
    moe_expert_job jobs[E];
    float *X[E], *Y[E], *R[E];
    for (int e = 0; e < E; e++) {
        make(&w[e][0], MOE_WFMT_MXFP4, I, H);
        make(&w[e][1], MOE_WFMT_MXFP4, I, H);
        make(&w[e][2], MOE_WFMT_MXFP4, H, I);
        int64_t n = e % 7 == 3 ? 0 : (int64_t)(moe_splitmix64(&rng) % MAXN) + 1;
        X[e] = malloc((size_t)((n ? n : 1) * H) * 4);
        Y[e] = malloc((size_t)((n ? n : 1) * H) * 4);
        R[e] = malloc((size_t)((n ? n : 1) * H) * 4);
        for (int64_t i = 0; i < n * H; i++) X[e][i] = moe_bf16_round((float)(3.0 * urand()));
        float g[I], h[I];
        for (int64_t t = 0; t < n; t++) {
            for (int64_t i = 0; i < I; i++) {
                g[i] = amx_model(&w[e][0].w, i, X[e] + t * H);
                h[i] = moe_bf16_round(moe_swiglu_f32(g[i], amx_model(&w[e][1].w, i, X[e] + t * H), L));
            }
            for (int64_t j = 0; j < H; j++) R[e][t * H + j] = amx_model(&w[e][2].w, j, h);
        }
        jobs[e] = (moe_expert_job){&w[e][0].w, &w[e][1].w, &w[e][2].w, X[e], Y[e], n};
    }
    static const int nths[] = {1, 2, 3, 8};
    for (int q = 0; q < 4; q++) {
        for (int e = 0; e < E; e++) memset(Y[e], 0xFF, (size_t)(jobs[e].n * H) * 4);
        size_t b = moe_experts_fast_scratch(k, MOE_ACT_BF16, jobs, E, nths[q]);
        void *scr = aligned_alloc(64, (b + 63) & ~(size_t)63);
        moe_experts_fast(k, L, MOE_ACT_BF16, jobs, E, scr, nths[q]);
        free(scr);
        long bad = 0;
        for (int e = 0; e < E; e++)
            for (int64_t i = 0; i < jobs[e].n * H; i++)
                if (memcmp(&Y[e][i], &R[e][i], 4) && bad++ < 3)
                    fprintf(stderr, "  experts %d threads: expert %d out %lld: %.9g, chain %.9g\n", nths[q], e,
                            (long long)i, Y[e][i], R[e][i]);
        CHECK(bad == 0, "experts driver on %d threads: %ld outputs differ from the scalar chain", nths[q], bad);
    }
    for (int e = 0; e < E; e++) {
        for (int m = 0; m < 3; m++) unmake(&w[e][m]);
        free(X[e]);
        free(Y[e]);
        free(R[e]);
    }
}

int main(void) {
    const moe_cpu_features *f = moe_cpu_get_features();
    if (!(f->os_avx512 && f->avx512f && f->avx512bw && f->avx512vl && f->avx512dq && f->avx512vbmi && f->avx512bf16)) {
        fprintf(stderr, "note: this CPU lacks AVX-512 with BF16 (the AMX kernel's decode and packing): skipped\n");
        return moe_t_finish();
    }
    for (g_build = 0; g_build < (int)(sizeof builds / sizeof builds[0]); g_build++) {
        fprintf(stderr, "build: %s\n", builds[g_build].name);
        RUN(test_shapes);
        RUN(test_nonfinite);
        RUN(test_workspace);
        CHECK(builds[g_build].faults() == 0, "%s: %ld tile instructions with shapes the hardware would fault on",
              builds[g_build].name, builds[g_build].faults());
    }
    g_build = 0;
    RUN(test_experts_claim);
    CHECK(amx_emu_fault_count() == 0, "%ld tile instructions with shapes the hardware would fault on",
          amx_emu_fault_count());
    return moe_t_finish();
}
