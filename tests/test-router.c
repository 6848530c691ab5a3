/*
 * The router against an independent implementation written here from
 * docs/semantics.md (sort-based, where the library scans), on random and
 * adversarial logits: ties, all-negative, -inf, NaN, grouped selection with
 * a negative bias, the group-mask-zero divergence, softmax scoring.
 */
#include "harness.h"
#include "moeaudit_variant.h"
#include "router/router.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static uint64_t rng = 0x1234567ull;
static double urand(void) {
    rng ^= rng << 13; rng ^= rng >> 7; rng ^= rng << 17;
    return (double)(rng >> 11) * 0x1.0p-53;
}

typedef struct { double v; int id; } scored;

/* descending value, ascending id; NaN after every number */
static int cmp_scored(const void *a, const void *b) {
    const scored *x = a, *y = b;
    int xn = isnan(x->v), yn = isnan(y->v);
    if (xn != yn) return xn - yn;
    if (!xn && x->v != y->v) return x->v > y->v ? -1 : 1;
    return x->id - y->id;
}

/* Independent oracle of moe_route_token. */
static void oracle_route(const moe_layer *L, const double *logits, int64_t tok, bool mask_zero, int32_t *ids,
                         double *w) {
    const moe_block_config *c = &L->cfg;
    int E = c->n_experts, K = c->top_k;
    double p[256], pb[256];
    if (c->score == MOE_SCORE_SOFTMAX) {
        double mx = -INFINITY, s = 0;
        for (int e = 0; e < E; e++) mx = fmax(mx, logits[e]);
        for (int e = 0; e < E; e++) s += exp(logits[e] - mx);
        for (int e = 0; e < E; e++) p[e] = exp(logits[e] - mx) / s;
    } else {
        for (int e = 0; e < E; e++)
            p[e] = c->score == MOE_SCORE_SIGMOID ? 1 / (1 + exp(-logits[e]))
                                                 : sqrt(logits[e] > 20 ? logits[e] : log1p(exp(logits[e])));
    }
    if (c->kind == MOE_LAYER_HASH) {
        for (int j = 0; j < K; j++) ids[j] = L->tid2eid[tok * K + j];
    } else {
        for (int e = 0; e < E; e++) pb[e] = p[e] + (L->bias ? L->bias[e] : 0);
        if (c->n_group > 1 && c->topk_group < c->n_group) {
            int G = c->n_group, per = E / G;
            scored gs[64];
            for (int g = 0; g < G; g++) {
                scored in[256];
                for (int i = 0; i < per; i++) in[i] = (scored){pb[g * per + i], i};
                qsort(in, (size_t)per, sizeof in[0], cmp_scored);
                gs[g] = (scored){in[0].v + (per > 1 ? in[1].v : 0), g};
            }
            qsort(gs, (size_t)G, sizeof gs[0], cmp_scored);
            for (int g = c->topk_group; g < G; g++)
                for (int i = 0; i < per; i++) pb[gs[g].id * per + i] = mask_zero ? 0.0 : -INFINITY;
        }
        scored all[256];
        for (int e = 0; e < E; e++) all[e] = (scored){pb[e], e};
        qsort(all, (size_t)E, sizeof all[0], cmp_scored);
        for (int j = 0; j < K; j++) ids[j] = all[j].id;
    }
    double s = 0;
    for (int j = 0; j < K; j++) s += p[ids[j]];
    for (int j = 0; j < K; j++) w[j] = c->renormalize ? p[ids[j]] / (s + 1e-20) : p[ids[j]];
}

static moe_layer make_layer(moe_layer_kind kind, moe_score_func score, int E, int K, int G, int TG, double *bias) {
    moe_layer L;
    memset(&L, 0, sizeof L);
    L.cfg.kind = kind;
    L.cfg.score = score;
    L.cfg.n_experts = E;
    L.cfg.top_k = K;
    L.cfg.n_group = G;
    L.cfg.topk_group = TG;
    L.cfg.renormalize = score != MOE_SCORE_SOFTMAX;
    L.cfg.scaling = 2.5;
    L.bias = bias;
    L.cfg.has_bias = bias != NULL;
    return L;
}

static int compare_one(const moe_layer *L, const double *logits, int64_t tok, bool mask_zero) {
    moe_variant o = moe_variant_none();
    o.group_mask_zero = mask_zero;
    int32_t ids[64], want_ids[64];
    double w[64], want_w[64], work[512];
    moe_route_token(L, logits, tok, &o, ids, w, work);
    oracle_route(L, logits, tok, mask_zero, want_ids, want_w);
    int K = L->cfg.top_k, bad = 0;
    for (int j = 0; j < K; j++) {
        if (ids[j] != want_ids[j]) bad = 1;
        bool both_nan = isnan(w[j]) && isnan(want_w[j]);
        /* the two implementations sum and divide the same numbers in the same
         * order: equal to the last bit */
        if (!both_nan && w[j] != want_w[j]) bad = 1;
    }
    return bad;
}

static void test_random(void) {
    static const struct { moe_score_func s; int E, K, G, TG; bool bias; } cfgs[] = {
        {MOE_SCORE_SIGMOID, 12, 3, 4, 2, true},  {MOE_SCORE_SIGMOID, 256, 8, 8, 4, true},
        {MOE_SCORE_SIGMOID, 8, 2, 2, 1, true},   {MOE_SCORE_SQRTSOFTPLUS, 12, 3, 1, 1, true},
        {MOE_SCORE_SQRTSOFTPLUS, 256, 6, 1, 1, true}, {MOE_SCORE_SOFTMAX, 64, 6, 1, 1, false},
        {MOE_SCORE_SOFTMAX, 160, 6, 8, 3, false},
    };
    for (size_t c = 0; c < sizeof cfgs / sizeof cfgs[0]; c++) {
        double bias[256];
        for (int e = 0; e < 256; e++) bias[e] = (urand() - 0.5) * 0.2;
        moe_layer L = make_layer(MOE_LAYER_TOPK, cfgs[c].s, cfgs[c].E, cfgs[c].K, cfgs[c].G, cfgs[c].TG,
                                 cfgs[c].bias ? bias : NULL);
        int bad = 0;
        for (int trial = 0; trial < 2000; trial++) {
            double lg[256];
            int mode = trial % 6;
            for (int e = 0; e < cfgs[c].E; e++) {
                double u = urand();
                lg[e] = mode == 0 ? (u - 0.5) * 8                /* ordinary */
                      : mode == 1 ? -5 - 30 * u                  /* all negative, deep */
                      : mode == 2 ? (double)(int)(u * 4) - 2     /* many exact ties */
                      : mode == 3 ? (u < 0.1 ? 40 + u : u - 0.5) /* softplus linear region */
                      : mode == 4 ? 0.0                          /* everything tied */
                                  : (u < 0.3 ? NAN : u);          /* NaN among numbers */
            }
            bad += compare_one(&L, lg, 0, false);
            bad += compare_one(&L, lg, 0, true);
        }
        CHECK(bad == 0, "config %zu: %d of 4000 routings differ from the oracle", c, bad);
    }
}

/* Ties resolve to the lower id, and the output order is score desc, id asc. */
static void test_ties(void) {
    moe_layer L = make_layer(MOE_LAYER_TOPK, MOE_SCORE_SIGMOID, 8, 3, 1, 1, NULL);
    double lg[8] = {0, 1, 1, 0, 1, 0, 1, 0};
    moe_variant o = moe_variant_none();
    int32_t ids[3];
    double w[3], work[16];
    moe_route_token(&L, lg, 0, &o, ids, w, work);
    CHECK(ids[0] == 1 && ids[1] == 2 && ids[2] == 4, "ties go to the lower ids: %d %d %d", ids[0], ids[1], ids[2]);
    CHECK(fabs(w[0] + w[1] + w[2] - 1) < 1e-15, "renormalized");
}

/* HF's 0.0 group mask lets a negative bias pick from a dropped group. */
static void test_group_mask_divergence(void) {
    double bias[8] = {-2, -2, -2, -2, -0.1, -0.1, -0.1, -0.1};
    moe_layer L = make_layer(MOE_LAYER_TOPK, MOE_SCORE_SIGMOID, 8, 4, 2, 1, bias);
    /* group 1 wins (pb ~ 0.4 vs ~ -1.5); K = 4 == group size: with -inf all 4
     * come from group 1; with 0.0 the masked group (pb 0) beats group 1's
     * negative... construct group 1 with pb < 0 so 0.0 wins */
    double lg[8] = {0, 0, 0, 0, -5, -5, -5, -5};
    /* p(-5) = 0.0067: pb(group 1) = -0.093 > pb(group 0) = -1.5: group 1 kept */
    moe_variant o = moe_variant_none();
    int32_t ids[4];
    double w[4], work[16];
    moe_route_token(&L, lg, 0, &o, ids, w, work);
    int from1 = 0;
    for (int j = 0; j < 4; j++) from1 += ids[j] >= 4;
    CHECK(from1 == 4, "with -inf masking all experts come from the kept group (%d)", from1);
    o.group_mask_zero = true;
    moe_route_token(&L, lg, 0, &o, ids, w, work);
    from1 = 0;
    for (int j = 0; j < 4; j++) from1 += ids[j] >= 4;
    CHECK(from1 == 0, "with HF's 0.0 mask the dropped group wins (%d from the kept group)", from1);
    CHECK(compare_one(&L, lg, 0, true) == 0 && compare_one(&L, lg, 0, false) == 0, "oracle agrees");
}

/* NaN logits: K distinct valid ids, NaN weights, no crash. */
static void test_nan(void) {
    double bias[12] = {0};
    moe_layer L = make_layer(MOE_LAYER_TOPK, MOE_SCORE_SIGMOID, 12, 3, 4, 2, bias);
    double lg[12];
    for (int e = 0; e < 12; e++) lg[e] = NAN;
    moe_variant o = moe_variant_none();
    int32_t ids[3];
    double w[3], work[24];
    moe_route_token(&L, lg, 0, &o, ids, w, work);
    CHECK(ids[0] != ids[1] && ids[1] != ids[2] && ids[0] != ids[2], "distinct ids");
    for (int j = 0; j < 3; j++) CHECK(ids[j] >= 0 && ids[j] < 12 && isnan(w[j]), "valid id, NaN weight");
    lg[1] = 0.5;
    for (int e = 0; e < 12; e++) if (e != 1) lg[e] = (e % 5 == 0) ? NAN : -1.0;
    L.cfg.n_group = 1;
    L.cfg.topk_group = 1;
    moe_route_token(&L, lg, 0, &o, ids, w, work);
    CHECK(ids[0] == 1 && ids[1] == 2, "numbers beat NaN, even a NaN at a lower id: %d %d", ids[0], ids[1]);
}

/* sqrtsoftplus stays accurate where log(1 + exp(l)) underflows in fp32. */
static void test_sqrtsoftplus(void) {
    double lg[3] = {-30, 25, 0}, p[3];
    moe_router_scores(MOE_SCORE_SQRTSOFTPLUS, 3, lg, p);
    CHECK(fabs(p[0] / sqrt(exp(-30)) - 1) < 1e-12, "log1p path at l = -30: %.17g", p[0]);
    CHECK(p[1] == sqrt(25.0), "linear above 20");
    CHECK(fabs(p[2] - sqrt(log(2.0))) < 1e-15, "l = 0");
}

static void test_hash(void) {
    int32_t table[5 * 3] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 11, 0, 5};
    moe_layer L = make_layer(MOE_LAYER_HASH, MOE_SCORE_SQRTSOFTPLUS, 12, 3, 1, 1, NULL);
    L.tid2eid = table;
    L.cfg.vocab = 5;
    double lg[12];
    for (int e = 0; e < 12; e++) lg[e] = (urand() - 0.5) * 4;
    int bad = 0;
    for (int64_t t = 0; t < 5; t++) bad += compare_one(&L, lg, t, false);
    CHECK(bad == 0, "hash routing matches the oracle");
    moe_variant o = moe_variant_none();
    int32_t ids[3];
    double w[3], work[24];
    moe_route_token(&L, lg, 4, &o, ids, w, work);
    CHECK(ids[0] == 11 && ids[1] == 0 && ids[2] == 5, "ids in table order");
}

int main(void) {
    RUN(test_random);
    RUN(test_ties);
    RUN(test_group_mask_divergence);
    RUN(test_nan);
    RUN(test_sqrtsoftplus);
    RUN(test_hash);
    return moe_t_finish();
}
