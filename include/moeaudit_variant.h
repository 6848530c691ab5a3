/*
 * moeaudit_variant.h: deliberate contract breaks (faults) and hypothetical
 * engine divergences (what-if toggles), for the tests, `diagnose` and the
 * patches `bisect` applies (moeaudit_patch.h names the faults). Production
 * code never includes this header: moe_block_run is
 * moe_block_run_variant with v = NULL, the semantics of docs/semantics.md.
 *
 *     moe_variant v = moe_variant_none();
 *     v.fault = MOE_FAULT_SCALE_DOUBLE;          // what an engine that scales
 *     moe_block_run_variant(L, hidden, ids, T,    // twice would output
 *                           &opts, &v, &out, &err);
 *
 * Only the router (src/router), the contract (src/experts/contract.c) and
 * the GPU routing kernel read a variant; every other stage is unchanged by
 * it. A variant is read, never kept: the caller owns it.
 */
#ifndef MOEAUDIT_VARIANT_H
#define MOEAUDIT_VARIANT_H

#include "moeaudit.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Deliberate contract breaks, for tests and for making dumps of each failure
 * class that the audit must recognise (docs/semantics.md section 2). */
typedef enum moe_fault {
    MOE_FAULT_NONE,
    MOE_FAULT_SCALE_DOUBLE,    /* runner multiplies by s although the router folded it */
    MOE_FAULT_SCALE_MISSING,   /* nobody multiplies by s */
    MOE_FAULT_SHARED_WEIGHT,   /* fused shared column weighted 1/s under the router owner */
    MOE_FAULT_NOT_RENORMALIZED,/* renormalization skipped */
    MOE_FAULT_BIASED_WEIGHTS   /* weights gathered from biased scores */
} moe_fault;

/* A hypothetical block: one fault and the divergences of public engines
 * (docs/semantics.md section 1, "Divergences"). */
typedef struct moe_variant {
    moe_fault fault;           /* MOE_FAULT_NONE */
    bool group_mask_zero;      /* HF V3: dropped groups get 0.0, not -inf */
    bool ignore_bias;          /* select without the correction bias */
    int score_override;        /* -1, or a moe_score_func used instead of the config's */
    double renorm_eps;         /* added to sum(w) when renormalizing: MOE_RENORM_EPS; the official code uses 0 */
} moe_variant;

/* The specified semantics, field by field: what v = NULL means everywhere
 * (fault NONE, no toggle, score_override -1, renorm_eps MOE_RENORM_EPS). */
moe_variant moe_variant_none(void);

/* moe_block_run (include/moeaudit.h, same contract) under variant v (NULL:
 * moe_variant_none). MOE_ERR_ARG for a fault the options cannot carry
 * (SHARED_WEIGHT without fused shared experts) or an unknown score_override. */
moe_status moe_block_run_variant(const moe_layer *L, const double *hidden, const int64_t *input_ids, int64_t T,
                                 const moe_run_opts *opts, const moe_variant *v, moe_block_out *out,
                                 moe_error *err);

/* moe_block_check with the variant's scoring function and renorm_eps: the
 * check a run of moe_block_run_variant(v) passes unless v breaks the
 * contract. v NULL: moe_block_check. */
moe_status moe_block_check_variant(const moe_layer *L, const moe_block_out *out, const moe_run_opts *opts,
                                   const moe_variant *v, moe_error *err);

#ifdef __cplusplus
}
#endif
#endif /* MOEAUDIT_VARIANT_H */
