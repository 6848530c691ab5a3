/*
 * Routing hypotheses for moe_diagnose: the specified routing and each known
 * way engines break it (docs/semantics.md sections 1-2), every one a run of the
 * float64 reference block.
 *
 * Invariants:
 *  1. The block is never re-implemented: each hypothesis is
 *     moe_block_run_variant with a fault or what-if toggle of moe_variant
 *     (this is the one file of diagnose that sets them) or with a copy of the
 *     layer whose tid2eid is shifted by one.
 *  2. diag_set_weights reproduces the block's weights: moe_diagnose checks it
 *     against every hypothesis' own sets before the flip search uses it on
 *     other sets.
 */
#include "audit/diagnose_internal.h"
#include "moeaudit_variant.h"
#include "experts/experts.h"
#include "router/router.h"

#include <math.h>
#include <stdio.h>
#include <string.h>

static const char *const score_names[] = {"softmax", "sigmoid", "sqrtsoftplus"};

static diag_hypo *add(diag_hypos *hs, const moe_layer *L, moe_verdict cls, unsigned changes, const char *name) {
    MOE_ASSERT(hs->n < DIAG_MAX_HYP);
    diag_hypo *h = &hs->h[hs->n++];
    memset(h, 0, sizeof *h);
    snprintf(h->name, sizeof h->name, "%s", name);
    h->cls = cls;
    h->changes = changes;
    h->o = moe_run_opts_default();
    h->v = moe_variant_none();
    h->o.owner = MOE_SCALE_OUTPUT; /* routed_out = s * unit routed; weights emitted unscaled */
    h->layer = *L;
    h->score = L->cfg.score;
    h->renorm = L->cfg.renormalize;
    h->use_bias = L->bias != NULL && L->cfg.kind == MOE_LAYER_TOPK;
    return h;
}

/* A hash-table hypothesis: a copy of tid2eid with rows rolled by `rows`
 * (token t routed by row t - rows) and expert ids shifted by `ids` (mod E). */
static moe_status add_table(diag_hypos *hs, const moe_layer *L, int rows, int ids, const char *name, moe_error *err) {
    int V = L->cfg.vocab, K = L->cfg.top_k, E = L->cfg.n_experts;
    int32_t *tab = moe_malloc((size_t)V * (size_t)K, sizeof *tab);
    if (!tab) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    for (int t = 0; t < V; t++)
        for (int j = 0; j < K; j++) {
            int src = ((t - rows) % V + V) % V;
            tab[t * K + j] = (L->tid2eid[src * K + j] + ids + E) % E;
        }
    diag_hypo *h = add(hs, L, MOE_VERDICT_SELECTION, HY_SEL, name);
    h->table = tab;
    h->layer.tid2eid = tab;
    return MOE_OK;
}

void diag_hypos_free(diag_hypos *hs) {
    for (int i = 0; i < hs->n; i++) {
        if (hs->h[i].ran) moe_block_out_free(&hs->h[i].out);
        free(hs->h[i].table);
    }
    hs->n = 0;
}

moe_status diag_hypos_run(const moe_layer *L, const moe_dump *d, diag_hypos *hs, moe_error *err) {
    const moe_block_config *c = &L->cfg;
    hs->n = 0;
    add(hs, L, MOE_VERDICT_OK, 0, "as specified");
    diag_hypo *h;
    if (c->renormalize) {
        h = add(hs, L, MOE_VERDICT_NOT_RENORMALIZED, HY_W, "weights not renormalized");
        h->v.fault = MOE_FAULT_NOT_RENORMALIZED;
        h->renorm = false;
    }
    if (L->bias && c->kind == MOE_LAYER_TOPK) {
        h = add(hs, L, MOE_VERDICT_BIASED_WEIGHTS, HY_W, "weights gathered from biased scores");
        h->v.fault = MOE_FAULT_BIASED_WEIGHTS;
        h->biased = true;
        h = add(hs, L, MOE_VERDICT_SELECTION, HY_SEL, "experts selected without the correction bias");
        h->v.ignore_bias = true;
        h->use_bias = false;
    }
    if (c->kind == MOE_LAYER_TOPK && c->n_group > 1 && c->topk_group < c->n_group) {
        h = add(hs, L, MOE_VERDICT_SELECTION, HY_SEL, "dropped groups masked with 0.0 instead of -inf");
        h->v.group_mask_zero = true;
    }
    for (int sf = 0; sf < 3; sf++) {
        if (sf == (int)c->score) continue;
        char name[96];
        snprintf(name, sizeof name, "%s scores instead of %s", score_names[sf], score_names[c->score]);
        h = add(hs, L, MOE_VERDICT_WRONG_SCORE, c->kind == MOE_LAYER_HASH ? HY_W : HY_W | HY_SEL, name);
        h->v.score_override = sf;
        h->score = (moe_score_func)sf;
    }
    moe_status st = MOE_OK;
    if (c->kind == MOE_LAYER_HASH && L->tid2eid && c->vocab > 1) {
        st = add_table(hs, L, 1, 0, "tid2eid off by one row (token t routed by row t-1)", err);
        if (st == MOE_OK) st = add_table(hs, L, -1, 0, "tid2eid off by one row (token t routed by row t+1)", err);
        if (st == MOE_OK) st = add_table(hs, L, 0, 1, "tid2eid expert ids off by one (e+1)", err);
    }
    for (int i = 0; i < hs->n && st == MOE_OK; i++) {
        h = &hs->h[i];
        st = moe_block_out_init(&h->out, &h->layer, d->T, &h->o, err);
        if (st != MOE_OK) break;
        h->ran = true;
        st = moe_block_run_variant(&h->layer, d->hidden, d->input_ids, d->T, &h->o, &h->v, &h->out, err);
    }
    if (st != MOE_OK) diag_hypos_free(hs);
    return st;
}

void diag_set_weights(const diag_hypo *h, const double *logits, const int32_t *ids, int K, double *w, double *work) {
    const moe_layer *L = &h->layer;
    const moe_block_config *c = &L->cfg;
    int E = c->n_experts;
    moe_router_scores(h->score, E, logits, work);
    const bool biased = h->biased && L->bias;
    /* weights gathered from the biased scores after the group mask, as the
     * block gathers them: an expert of a dropped group weighs -inf (0 under
     * group_mask_zero). Only a token whose kept experts score NaN selects
     * one, so the mask changes nothing for finite logits. */
    const bool masked = biased && c->kind == MOE_LAYER_TOPK && c->n_group > 1 && c->topk_group < c->n_group;
    unsigned char keep[1024];
    int per = 1;
    if (masked) {
        for (int e = 0; e < E; e++) work[e] = work[e] + L->bias[e];
        moe_router_group_keep(c, work, keep);
        per = E / c->n_group;
    }
    double sum = 0;
    for (int j = 0; j < K; j++) {
        double v = masked ? (keep[ids[j] / per] ? work[ids[j]] : h->v.group_mask_zero ? 0.0 : -INFINITY)
                          : work[ids[j]] + (biased ? L->bias[ids[j]] : 0.0);
        w[j] = v;
        sum += v;
    }
    if (h->renorm) {
        double den = sum + h->v.renorm_eps;
        for (int j = 0; j < K; j++) w[j] /= den;
    }
}

size_t diag_expert_scratch(const moe_layer *L) { return moe_expert_scratch(L->cfg.hidden, L->cfg.inter, 1); }

void diag_expert(const moe_layer *L, int e, const double *x, double *y, double *scratch) {
    moe_expert_ref(&L->w1[e], &L->w3[e], &L->w2[e], L->cfg.swiglu_limit, MOE_ACT_EXACT, x, 1, y, scratch);
}
