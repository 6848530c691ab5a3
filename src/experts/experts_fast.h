/* The fast float32 SwiGLU experts: SIMD kernels from a moe_cpu_kernels table,
 * the work of many experts split over threads by (expert, row range) of
 * balanced cost. */
#ifndef MOE_EXPERTS_FAST_H
#define MOE_EXPERTS_FAST_H

#include "cpu/kernels.h"
#include "moeaudit.h"

/* One expert's share of a call: its weights and its tokens. */
typedef struct moe_expert_job {
    const moe_weight *w1, *w3; /* [I, H] */
    const moe_weight *w2;      /* [H, I] */
    const float *X;            /* [n, H] activations, rounded to act by the caller */
    float *Y;                  /* [n, H] output */
    int64_t n;                 /* tokens (0: nothing to do) */
} moe_expert_job;

/* Threads moe_experts_fast should use from here: 1 inside an OpenMP
 * parallel region (or without OpenMP), else omp_get_max_threads(). */
int moe_experts_fast_threads(void);

/* Bytes of scratch moe_experts_fast needs for these jobs on nthreads
 * threads: the SwiGLU operands of every job (2 n I floats each) and one
 * kernel workspace per thread (cpu/kernels.h: bf16act_ws, for MOE_ACT_BF16
 * on a table with gemm_bf16act). */
size_t moe_experts_fast_scratch(const moe_cpu_kernels *k, moe_act_prec act, const moe_expert_job *jobs, int njobs,
                                int nthreads);

/*
 * For every job: Y [n, H] = w2 . ( silu(min(w1.x, L)) * clamp(w3.x, -L, L) )
 * for each token x of X; limit L = 0: no clamp; act: rounding of the SwiGLU
 * output before w2 (X arrives rounded by the caller). Same semantics as
 * moe_expert_f32 (NaN propagates through the clamps; a non-finite token
 * poisons only its own row of Y), with the GEMMs done by k->gemm, or by
 * k->gemm_bf16act when act is MOE_ACT_BF16 and the table has one (X must
 * then hold bf16 values).
 *   k         kernel table (moe_cpu_table's for the run, or moe_cpu_ref())
 *   jobs      [njobs]; the weights of one job may be any moe_wfmt; jobs may
 *             share X but not Y
 *   scratch   moe_experts_fast_scratch(k, act, jobs, njobs, nthreads) bytes,
 *             64-byte aligned, caller-owned
 *   nthreads  >= 1: an OpenMP team of that size when > 1 (1: this thread)
 * Work: phase 1 = (job, rows of I): gate and up GEMMs and the SwiGLU of
 * those columns; one barrier; phase 2 = (job, rows of H): the down GEMM.
 * Each phase's rows, job after job, are cut into units (128 rows of I, 64 of
 * H) weighted by an estimate of their cost (the weight's bytes and decode
 * plus the tokens' arithmetic, so an expert of 1 token is not half the work
 * of one of 2); each thread takes one contiguous run of equal cost (within
 * one unit): few experts per thread, one kernel call per expert it touches,
 * and every thread busy even when only a few experts are (T = 1). Where
 * moe_experts_fast_claims says so (the amx table with bf16 activations and
 * at least 4 jobs per thread, or any table from 4 threads), threads instead
 * draw chunks (a whole job each, the last 2 nthreads jobs in pieces of whole
 * units, finer with fewer than 4 jobs per thread) from an atomic counter
 * per phase, so that a thread on a slower core takes less (experts_fast.c
 * invariant 5).
 * Results are bit-identical for any nthreads, any grouping of jobs and any
 * batch composition: every output element comes from one kernel call whose
 * operations do not depend on its row range, and the activation is
 * elementwise. Never allocates. Safe to call concurrently on distinct Y and
 * scratch.
 */
void moe_experts_fast(const moe_cpu_kernels *k, double limit, moe_act_prec act, const moe_expert_job *jobs, int njobs,
                      void *scratch, int nthreads);

/* Whether moe_experts_fast with this table, act and nthreads, on jobs of
 * which `active` have tokens, draws claimed chunks (experts_fast.c
 * invariant 5) rather than the static split (invariant 4). */
bool moe_experts_fast_claims(const moe_cpu_kernels *k, moe_act_prec act, int active, int nthreads);

#endif
