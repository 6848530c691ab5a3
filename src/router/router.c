/*
 * The router, float64 reference (docs/semantics.md section 1): scores and
 * the (grouped) biased top-k or hash selection of one token.
 *
 * Invariants:
 *  1. The correction bias only selects: weights are gathered from the
 *     unbiased scores p (the BIASED_WEIGHTS fault of moe_variant exists to
 *     break this).
 *  2. Selection is deterministic: a strict total order (score desc, id asc)
 *     in which NaN never wins, so ties and NaN give reproducible ids.
 *  3. routed_scaling_factor never appears here: route.c applies the
 *     contract's router_mult to what this file returns.
 */
#include "router/router.h"
#include "core/core.h"

#include <math.h>
#include <string.h>

static double sqrtsoftplus(double l) {
    double sp = l > 20.0 ? l : log1p(exp(l));
    return sqrt(sp);
}

void moe_router_scores(moe_score_func f, int E, const double *logits, double *p) {
    switch (f) {
    case MOE_SCORE_SIGMOID:
        for (int e = 0; e < E; e++) p[e] = 1.0 / (1.0 + exp(-logits[e]));
        return;
    case MOE_SCORE_SQRTSOFTPLUS:
        for (int e = 0; e < E; e++) p[e] = sqrtsoftplus(logits[e]);
        return;
    case MOE_SCORE_SOFTMAX: {
        double mx = -INFINITY;
        for (int e = 0; e < E; e++) mx = logits[e] > mx ? logits[e] : mx;
        if (isnan(mx) || isinf(mx)) mx = 0.0; /* all -inf or NaN: let the NaN/Inf propagate */
        double sum = 0.0;
        for (int e = 0; e < E; e++) { p[e] = exp(logits[e] - mx); sum += p[e]; }
        for (int e = 0; e < E; e++) p[e] /= sum;
        return;
    }
    }
    MOE_ASSERT(!"unknown score function");
}

/* a (id ia) ranks before b (id ib): larger value, then lower id; NaN ranks
 * after every number (and NaNs among themselves by id). */
static inline bool ranks_before(double a, int ia, double b, int ib) {
    if (isnan(a) || isnan(b)) return isnan(a) == isnan(b) ? ia < ib : isnan(b);
    return a > b || (a == b && ia < ib);
}

/* Top-k of v[0..n) (entries with keep[i] == 0 skipped) into out[k]. n is
 * small (E <= 2^16, K <= a few dozen): k passes of a linear scan. */
static void topk(const double *v, const unsigned char *keep, int n, int k, int32_t *out) {
    for (int j = 0; j < k; j++) {
        int best = -1;
        for (int i = 0; i < n; i++) {
            if (keep && !keep[i]) continue;
            bool taken = false;
            for (int q = 0; q < j; q++) if (out[q] == i) { taken = true; break; }
            if (taken) continue;
            if (best < 0 || ranks_before(v[i], i, v[best], best)) best = i;
        }
        MOE_ASSERT(best >= 0);
        out[j] = best;
    }
}

/* The specified routing: what a NULL variant means. */
void moe_router_group_keep(const moe_block_config *c, const double *pb, unsigned char *keep) {
    int G = c->n_group, per = c->n_experts / G;
    double gscore[1024];
    int32_t gsel[1024];
    MOE_ASSERT(G <= 1024);
    for (int g = 0; g < G; g++) {
        /* sum of the two largest biased scores in the group */
        int32_t top2[2];
        int m = per < 2 ? per : 2;
        topk(pb + g * per, NULL, per, m, top2);
        double s = 0.0;
        for (int q = 0; q < m; q++) s += pb[g * per + top2[q]];
        gscore[g] = s;
    }
    topk(gscore, NULL, G, c->topk_group, gsel);
    memset(keep, 0, (size_t)G);
    for (int q = 0; q < c->topk_group; q++) keep[gsel[q]] = 1;
}

static const moe_variant k_spec = {MOE_FAULT_NONE, false, false, -1, MOE_RENORM_EPS};

moe_variant moe_variant_none(void) { return k_spec; }

void moe_route_token(const moe_layer *L, const double *logits, int64_t token_id, const moe_variant *v,
                     int32_t *ids, double *w, double *work) {
    const moe_block_config *c = &L->cfg;
    const moe_variant *var = v ? v : &k_spec;
    int E = c->n_experts, K = c->top_k;
    double *p = work, *pb = work + E;
    moe_score_func sf = var->score_override >= 0 ? (moe_score_func)var->score_override : c->score;
    moe_router_scores(sf, E, logits, p);

    if (c->kind == MOE_LAYER_HASH) {
        for (int j = 0; j < K; j++) ids[j] = L->tid2eid[token_id * K + j];
        for (int e = 0; e < E; e++) pb[e] = p[e];
    } else {
        const double *b = var->ignore_bias ? NULL : L->bias;
        for (int e = 0; e < E; e++) pb[e] = p[e] + (b ? b[e] : 0.0);
        if (c->n_group > 1 && c->topk_group < c->n_group) {
            unsigned char keepg[1024];
            moe_router_group_keep(c, pb, keepg);
            int per = E / c->n_group;
            for (int e = 0; e < E; e++)
                if (!keepg[e / per]) pb[e] = var->group_mask_zero ? 0.0 : -INFINITY;
        }
        topk(pb, NULL, E, K, ids);
    }

    const double *src = var->fault == MOE_FAULT_BIASED_WEIGHTS ? pb : p;
    double sum = 0.0;
    for (int j = 0; j < K; j++) { w[j] = src[ids[j]]; sum += w[j]; }
    if (c->renormalize && var->fault != MOE_FAULT_NOT_RENORMALIZED) {
        double d = sum + var->renorm_eps;
        for (int j = 0; j < K; j++) w[j] /= d;
    }
}
