/*
 * moe-swiglu-bench: ns per element of the f32 experts' SwiGLU, one thread,
 * L1-resident (2 x 2048 floats), min over many repetitions:
 *   libm     the loop before issue #18: g / (1 + expf(-g)) * u with libm's
 *            expf, clamps as moe_swiglu_f32 (a floor of the old cost)
 *   scalar   moe_swiglu_f32 in a loop (the project's exp, inlined call)
 *   <isa>    each kernel table's swiglu entry this CPU has
 * Each timed call first copies the gate row back (the entry works in place);
 * the copy alone is timed in the same run and subtracted. Prints one line
 * per variant: min, median and max of the per-sample minima (the spread on
 * a shared machine).
 *
 *   moe-swiglu-bench [samples]   (default 21 samples of 400 calls)
 */
#include "cpu/kernels.h"
#include "formats/mathf.h"
#include "moeaudit.h"

#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { N = 2048, CALLS = 400, MAXS = 201 };

static double now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec * 1e9 + (double)ts.tv_nsec;
}

static void swiglu_libm(float *g, const float *u, int64_t n, float L) {
    for (int64_t i = 0; i < n; i++) {
        float gv = g[i], uv = u[i];
        if (L > 0) {
            gv = gv > L ? L : gv;
            uv = uv > L ? L : (uv < -L ? -L : uv);
        }
        g[i] = gv / (1.0f + expf(-gv)) * uv;
    }
}

static void swiglu_scalar(float *g, const float *u, int64_t n, float L) {
    for (int64_t i = 0; i < n; i++) g[i] = moe_swiglu_f32(g[i], u[i], L);
}

static void swiglu_none(float *g, const float *u, int64_t n, float L) { (void)g, (void)u, (void)n, (void)L; }

static int cmp_d(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* per-sample minimum of one call's time (ns), over `samples` samples */
static void time_fn(moe_swiglu_fn f, const float *g0, float *g, const float *u, int samples, double *out) {
    for (int s = 0; s < samples; s++) {
        double best = 1e30;
        for (int c = 0; c < CALLS; c++) {
            double t0 = now_ns();
            memcpy(g, g0, N * sizeof(float));
            f(g, u, N, 10.0f);
            double t = now_ns() - t0;
            if (t < best) best = t;
        }
        out[s] = best;
    }
}

int main(int argc, char **argv) {
    int samples = argc > 1 ? atoi(argv[1]) : 21;
    if (samples < 1 || samples > MAXS) {
        fprintf(stderr, "moe-swiglu-bench: samples must be 1..%d\n", MAXS);
        return 2;
    }
    static float g0[N], g[N], u[N];
    uint64_t s = 0x243F6A8885A308D3ull;
    for (int i = 0; i < N; i++) { /* gate and up values of a typical spread (|g| up to ~12, clamp at 10) */
        double a = (double)(moe_splitmix64(&s) >> 11) * 0x1p-53, b = (double)(moe_splitmix64(&s) >> 11) * 0x1p-53;
        g0[i] = (float)((a * 2 - 1) * 12.0);
        u[i] = (float)((b * 2 - 1) * 12.0);
    }
    struct { const char *name; moe_swiglu_fn f; } v[8];
    int nv = 0;
    v[nv].name = "libm expf loop";
    v[nv++].f = swiglu_libm;
    v[nv].name = "moe_swiglu_f32 loop";
    v[nv++].f = swiglu_scalar;
    static const moe_isa isas[] = {MOE_ISA_REF, MOE_ISA_AVX2, MOE_ISA_AVX512};
    for (int i = 0; i < 3; i++) {
        const moe_cpu_kernels *k;
        moe_error err;
        if (moe_cpu_table(isas[i], &k, &err) != MOE_OK) {
            printf("# %s: %s\n", moe_isa_name(isas[i]), err.msg);
            continue;
        }
        v[nv].name = moe_isa_name(isas[i]);
        v[nv++].f = moe_cpu_swiglu(k);
    }
    double copy[MAXS], t[MAXS];
    time_fn(swiglu_none, g0, g, u, samples, copy);
    qsort(copy, (size_t)samples, sizeof(double), cmp_d);
    double c = copy[0];
    printf("# SwiGLU, %d elements per call (L1), 1 thread, %d samples x %d calls; the copy (%.0f ns) subtracted\n", N,
           samples, CALLS, c);
    printf("%-22s %10s %10s %10s\n", "variant", "min ns/el", "median", "max");
    for (int i = 0; i < nv; i++) {
        time_fn(v[i].f, g0, g, u, samples, t);
        qsort(t, (size_t)samples, sizeof(double), cmp_d);
        printf("%-22s %10.3f %10.3f %10.3f\n", v[i].name, (t[0] - c) / N, (t[samples / 2] - c) / N,
               (t[samples - 1] - c) / N);
    }
    return 0;
}
