/* `moeaudit bench` on the CPU: routed-expert timing with its own floors
 * (docs/performance.md). The CLI (tools/cmd_bench.c) parses the options and
 * passes the default ISA, so the benchmark needs nothing of tools/. */
#ifndef MOE_BENCH_H
#define MOE_BENCH_H

#include "moeaudit.h"

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

typedef struct moe_bench_opts {
    const char *shape;        /* "v4flash" or "v3" */
    const char *weights;      /* comma list of bf16, fp8, mxfp4, nvfp4 */
    bool act_f32, act_bf16;   /* activation rows to time (at least one of these three) */
    bool act_nvfp4;           /* W4A4: NVFP4 activations with static input scales */
    int64_t tokens[16];       /* T values [ntok] */
    int ntok;
    int threads;              /* 0: OpenMP's default */
    int iters;                /* 0: by T */
    int64_t experts;          /* 0: all E, capped by max_gib */
    double max_gib;
    moe_isa isa;              /* the kernel table (the CLI's --isa, else MOE_ISA, else auto) */
} moe_bench_opts;

/* Run, print the progress and the table to text, and write the rows as
 * JSON to json when it is not NULL (the caller opens and closes both).
 * Returns a process exit code (0 ok, 1 failure, 2 usage). */
int moe_bench_cpu(const moe_bench_opts *o, FILE *text, FILE *json);

/* `moeaudit bench --linear` (bench/bench_linear.c): the dense linears of a
 * V4-Flash layer, float64 and float32, against floors of the same run. */
typedef struct moe_bench_linear_opts {
    bool f64, f32;            /* precisions to time (at least one) */
    int64_t tokens[16];       /* T values [ntok] */
    int ntok;
    const char *shapes;       /* comma list of row numbers or layer sets (all, csa, hca, model); NULL: every row */
    int threads;              /* 0: OpenMP's default */
    int iters;                /* 0: by T */
    double max_gflop;         /* skip rows whose one call exceeds this */
    bool cpu_clock;           /* time by process CPU time / threads instead of the wall clock */
    moe_isa isa;
} moe_bench_linear_opts;
int moe_bench_linear(const moe_bench_linear_opts *o);

/* `moeaudit bench --layer-cost` (bench/bench_linear.c): what one V4-Flash
 * layer costs on a T-token prompt, as measured unit costs times exact
 * counts. */
typedef struct moe_bench_layer_opts {
    int64_t tokens;           /* prompt length T (>= 128) */
    int threads;
    int reps;                 /* repetitions per unit cost (best or median, as each part says) */
    bool cpu_clock;
    moe_isa isa;
} moe_bench_layer_opts;
int moe_bench_layer_cost(const moe_bench_layer_opts *o);

/* `moeaudit bench --write-v4flash DIR` (bench/synth_v4flash.c): a synthetic
 * checkpoint in the V4-Flash release layout at full shapes, for timing the
 * whole-model forward. */
typedef struct moe_bench_synth_opts {
    const char *dir;
    const char *ratios;       /* comma list of 0, 4, 128: one layer each */
    int experts;              /* routed experts (>= 6) */
    int vocab;
    uint64_t seed;
} moe_bench_synth_opts;
int moe_bench_write_v4flash(const moe_bench_synth_opts *o);

/* The streaming read bandwidth in bytes/s (1 GiB, all threads, best of 5
 * repetitions x 3 prefetch distances; AVX-512 loads where the CPU has them). */
double moe_bench_read_bandwidth(void);

#endif
