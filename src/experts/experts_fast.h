/* The fast float32 SwiGLU expert: SIMD kernels from a moe_cpu_kernels table,
 * rows split across OpenMP threads. */
#ifndef MOE_EXPERTS_FAST_H
#define MOE_EXPERTS_FAST_H

#include "cpu/kernels.h"
#include "moeaudit.h"

/* Floats of scratch moe_expert_fast needs for n tokens: 2 * n * I. */
size_t moe_expert_fast_scratch(int64_t H, int64_t I, int64_t n);

/*
 * Y [n, H] = w2 . ( silu(min(w1.x, L)) * clamp(w3.x, -L, L) ) for each token
 * x of X [n, H]; limit L = 0: no clamp; act: rounding of the SwiGLU output
 * before w2 (X arrives rounded by the caller). Same semantics as moe_expert_f32
 * (NaN propagates through the clamps; a non-finite token poisons only its own
 * row of Y), with the GEMMs done by k->gemm, or by k->gemm_bf16act when act
 * is MOE_ACT_BF16 and the table has one (X must then hold bf16 values).
 *   k        kernel table (moe_cpu_table's for the run, or moe_cpu_ref())
 *   w1, w3   [I, H]; w2 [H, I]; any moe_wfmt
 *   scratch  moe_expert_fast_scratch(H, I, n) floats, caller-owned
 * Opens an OpenMP parallel region (when built with OpenMP) splitting the
 * rows of each projection; results are bit-identical for any thread count
 * and any batch composition. Never allocates. Safe to call concurrently on
 * distinct Y and scratch.
 */
void moe_expert_fast(const moe_cpu_kernels *k, const moe_weight *w1, const moe_weight *w3, const moe_weight *w2,
                     double limit, moe_act_prec act, const float *X, int64_t n, float *Y, float *scratch);

#endif
