/*
 * Shared by the diagnose files of src/audit/ (not part of the API).
 *
 * diagnose_hypo.c  the routing hypotheses: each one a moe_block_run_variant of
 *                  the reference with a fault or what-if toggle (the only
 *                  diagnose file that sets them), plus the weights of an arbitrary expert set under a
 *                  hypothesis and the per-token expert outputs the flip search
 *                  needs
 * diagnose.c       the stages (router, selection, weights, output) and the
 *                  decision rule of docs/diagnose.md
 * diagnose_report.c JSON and HTML
 */
#ifndef MOE_DIAGNOSE_INTERNAL_H
#define MOE_DIAGNOSE_INTERNAL_H

#include "core/core.h"
#include "moeaudit_variant.h"

#define DIAG_MAX_HYP 12

enum { HY_SEL = 1, HY_W = 2 }; /* what a hypothesis changes: the expert sets, the weights */

typedef struct diag_hypo {
    char name[96];
    moe_verdict cls;          /* the verdict when this hypothesis explains the dump */
    unsigned changes;         /* HY_SEL | HY_W; 0 for the specified routing */
    moe_run_opts o;           /* reference run options (owner OUTPUT: unit weights) */
    moe_variant v;            /* the hypothesis' fault or what-if toggle */
    moe_layer layer;          /* the checkpoint's layer, or a copy with another tid2eid */
    int32_t *table;           /* that copy's tid2eid [vocab, K] (owned), or NULL */
    moe_score_func score;     /* weight rule: p = score(logits) */
    bool renorm, biased, use_bias; /* w = (biased ? p + b : p)[ids], / sum when renorm; selection with b */
    moe_block_out out;
    bool ran;
    int64_t agree;            /* tokens whose dump expert set equals this hypothesis' */
    /* output fit */
    double a, b, res;
    int64_t used, flips, unexplained;
    bool fitted;
} diag_hypo;

typedef struct diag_hypos {
    int n;
    diag_hypo h[DIAG_MAX_HYP];
} diag_hypos;

/* The hypotheses that apply to L (index 0: as specified), run on the dump's
 * tokens. On failure everything is freed. */
moe_status diag_hypos_run(const moe_layer *L, const moe_dump *d, diag_hypos *hs, moe_error *err);
void diag_hypos_free(diag_hypos *hs);

/* Unit weights w [K] (before routed_scaling_factor) that hypothesis h gives
 * the expert set ids [K] of a token with reference logits [E]; work [E]. */
void diag_set_weights(const diag_hypo *h, const double *logits, const int32_t *ids, int K, double *w, double *work);

/* y [H] = routed expert e of L on x [H] in float64; scratch: moe_expert_scratch(H, I, 1). */
void diag_expert(const moe_layer *L, int e, const double *x, double *y, double *scratch);
size_t diag_expert_scratch(const moe_layer *L);

#endif
