/*
 * The experts stage: SwiGLU experts over the tokens of one expert, the
 * combine, and the routed-scaling contract, behind one header that every
 * driver (CPU block, MPI, CUDA host) includes.
 *
 *   moe_expert_ref / _f32   the expert kernels, float64 and float32 (experts.c)
 *   moe_expert_rows         one expert over gathered rows, any path (rows.c)
 *   moe_experts_rows_f32    many experts' rows in one fast f32 call (rows.c)
 *   moe_combine_token       one token's columns + shared (combine.c)
 *   moe_contract_applied    the multipliers of a run (contract.c)
 *   moe_contract_check      the contract on finished outputs (contract.c)
 * (the fast float32 kernel behind moe_expert_rows: experts_fast.h)
 */
#ifndef MOE_EXPERTS_H
#define MOE_EXPERTS_H

#include "cpu/kernels.h"
#include "moeaudit.h"
#include "moeaudit_variant.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Elements of scratch that moe_expert_ref / _f32 need for n tokens. */
size_t moe_expert_scratch(int64_t H, int64_t I, int64_t n);

/* Y [n, H] = expert(X [n, H]) in float64. limit: swiglu_limit, 0 = none.
 * act: rounding of the SwiGLU output before w2 (X arrives rounded).
 * scratch: moe_expert_scratch(H, I, n) doubles. */
void moe_expert_ref(const moe_weight *w1, const moe_weight *w3, const moe_weight *w2, double limit,
                    moe_act_prec act, const double *X, int64_t n, double *Y, double *scratch);

/* The same in float32 arithmetic (weights decoded to float, exact for BF16);
 * the SwiGLU is moe_swiglu_f32 (formats/mathf.h): the project's exp,
 * moe_expf_f32 (at most MOE_EXPF_MAX_ULP ulps, the same bits on every
 * x86-64), not libm's expf. */
void moe_expert_f32(const moe_weight *w1, const moe_weight *w3, const moe_weight *w2, double limit,
                    moe_act_prec act, const float *X, int64_t n, float *Y, float *scratch);

/* One expert over n rows in the path's precision (float rows when f32, else
 * double): row q is src[src_idx[q]] (or src[q]), rounded to `act`, and its
 * output goes to dst[dst_idx[q]] (or dst[q]); H columns each. f32 rows run
 * moe_experts_fast on kernel table k (moe_cpu_table's choice for the run);
 * double rows run moe_expert_ref (k unused). Allocates its scratch:
 * MOE_ERR_NOMEM names the expert. Safe to call concurrently on distinct dst
 * rows. */
moe_status moe_expert_rows(const moe_weight *w1, const moe_weight *w3, const moe_weight *w2, double limit, bool f32,
                           moe_act_prec act, const moe_cpu_kernels *k, int H, int64_t n, const void *src,
                           const int64_t *src_idx, void *dst, const int64_t *dst_idx, moe_error *err);

/* An NVFP4 activation mode needs every routed expert's static input scales
 * (moe_act_static_scale > 0 for GEMM1 and GEMM2): MOE_ERR_MISSING naming
 * the first expert without, and what provides them. MOE_OK for other modes
 * and for experts not loaded (rows 0). */
moe_status moe_act_check_layer(const moe_layer *L, moe_act_prec act, moe_error *err);

/* One expert's rows in moe_experts_rows_f32: row q of the job is row
 * src_idx[q] of src (NULL: q), its output goes to row dst_idx[q] of dst
 * (NULL: q); [.., H] float rows each. */
typedef struct moe_rows_job {
    const moe_weight *w1, *w3, *w2;
    int64_t n;
    const int64_t *src_idx; /* [n] or NULL */
    float *dst;
    const int64_t *dst_idx; /* [n] or NULL */
} moe_rows_job;

/* moe_expert_rows's f32 path for many experts at once: gathers every job's
 * rows (rounded to act), runs all of them in one moe_experts_fast call on
 * table k (work split by (expert, row range) of balanced cost over the
 * threads) and scatters the outputs. Each row gets the bits moe_expert_rows would give it. src:
 * [.., H] float rows. Jobs may share src rows, not dst rows. MOE_ERR_NOMEM
 * (nothing written) when the buffers cannot be had. Thread-safe on distinct
 * dst rows. */
moe_status moe_experts_rows_f32(const moe_rows_job *jobs, int njobs, double limit, moe_act_prec act,
                                const moe_cpu_kernels *k, int H, const float *src, moe_error *err);

/* Combine one token: ys[j] is column j's expert output row [H] (float or
 * double per f32), sh_row the shared expert's row or NULL; tw [C] the
 * emitted weights (C > K: column K is the fused shared one). Writes the
 * routed_out, shared_out and moe_out rows ro, so, mo [H] under c. */
void moe_combine_token(const moe_contract *c, bool f32, int K, int C, int H, const double *tw, const void *const *ys,
                       const void *sh_row, double *ro, double *so, double *mo);

/* The contract a run applies: moe_contract_for(owner, fused, s) with v's
 * deliberate break on top (v NULL: none). fused: the run fuses a shared
 * expert that the layer has. MOE_ERR_ARG for impossible combinations (OUTPUT
 * with fused shared experts; the SHARED_WEIGHT fault unfused). */
moe_status moe_contract_applied(moe_scale_owner owner, bool fused, double s, const moe_variant *v, moe_contract *c,
                                moe_error *err);

/* The contract on a block's finished outputs (layer `index` with config c):
 * per finite token, the effective routed weights equal s times the router's
 * unscaled weights (recomputed from router_logits, with v's scoring function
 * and renorm_eps), the effective shared weight is 1, moe_out = routed_out +
 * shared_out; tolerances of the f32 or the float64 path. MOE_ERR_INVARIANT
 * names the first bad token and says whether the factor is applied twice,
 * never or wrongly. */
moe_status moe_contract_check(const moe_block_config *c, int index, const moe_block_out *out, bool f32,
                              const moe_variant *v, moe_error *err);

#ifdef __cplusplus
}
#endif
#endif
