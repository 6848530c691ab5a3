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
    bool act_f32, act_bf16;   /* activation rows to time (at least one) */
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

#endif
