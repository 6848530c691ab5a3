/*
 * Diagnose another engine's dump of one MoE layer against the float64
 * reference: which contract (docs/semantics.md section 2) it breaks, and how sure
 * that is. The decision rule is docs/diagnose.md; in short:
 *
 *   router     router_logits vs the reference's: the router's precision, hence
 *              the tie margin within which the engine may pick other experts
 *   selection  topk_ids vs each hypothesis' expert sets (diagnose_hypo.c)
 *   weights    topk_weights vs c x each hypothesis' weights, c in {1, s, s^2}
 *   output     moe_out ~ a R_h + b S by least squares over the tokens whose
 *              sets agree with h; without ids, each token's set is chosen
 *              among the reference's near-tie alternatives (the flip search)
 *
 * Each stage adds findings {class, confidence, votes}. The verdict is the
 * voting non-OK finding of highest confidence, then specificity; OK needs
 * the output stage's vote; nothing voting is UNEXPLAINED ("not enough
 * evidence").
 *
 * Invariants:
 *  1. No state outlives a call: every buffer is allocated per call and freed
 *     on every path (the diagnosis holds no pointer but the static noise name).
 *  2. A fit over fewer than min(T, DIAG_MIN_TOKENS) tokens, or under a quarter
 *     of the dump, never votes.
 *  3. Tokens with a non-finite dump or reference value, and tokens whose
 *     reference branches are both zero (no evidence on any weight), are left
 *     out of every fit and counted.
 */
#include "audit/diagnose_internal.h"
#include "router/router.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ------------------------------------------------------------ tolerances */

/* A fit votes only over at least this many tokens (and a quarter of the dump). */
#define DIAG_MIN_TOKENS 8
/* a, b within 8% of a class value name that class: the classes are >= 33%
 * apart for DeepSeek's s (1.5, 2.5: s^2 / s = s, 1 / s), and fp4 engines move
 * the fitted a by < 3% (test-diagnose prints the fits). */
#define DIAG_SCALE_TOL 0.08
/* A routing hypothesis other than the specified one must at least halve the
 * output residual: under the true one the residual is the noise n, under a
 * false one sqrt(n^2 + e^2), so halving means a model error e > 1.7 n. */
#define DIAG_DISCRIMINATE 0.5
/* A token whose squared fit error is 64x the median (8x in norm) and above 2%
 * of its norm is unexplained (arithmetic noise is spread evenly over tokens;
 * a wrong expert set moves a token by a whole expert's output). */
#define DIAG_OUTLIER2 64.0
#define DIAG_OUTLIER_FLOOR 0.02
/* Candidate expert sets per token in the flip search (single and double swaps). */
#define DIAG_MAX_ALT 16

/* Relative rounding error of one value stored in dtype t (half an ulp). */
static double unit_roundoff(moe_dtype t) {
    switch (t) {
    case MOE_DTYPE_F64: return 0x1p-53;
    case MOE_DTYPE_F32: return 0x1p-24;
    case MOE_DTYPE_F16: return 0x1p-11;
    case MOE_DTYPE_BF16: return 0x1p-9;
    default: return 0x1p-24;
    }
}

/* Router precision levels: the tie margin on biased scores is
 * 4u (0.5 max|logit| + max|score|): two roundings (logit, score) of at most u
 * each side of the comparison; 0.5 bounds the slope of sigmoid, sqrtsoftplus
 * and softmax. */
static const struct { const char *name; double u; } router_levels[] = {{"float32", 0x1p-24}, {"bf16", 0x1p-9}};

/* Noise classes by relative residual. Bounds measured on the library's own
 * paths (tests/test-diagnose.c prints them): outputs rounded to bf16 leave
 * ~1e-3, bf16 activations ~3e-3, FP8 activations or weights ~3e-2, FP4
 * weights ~0.1 (RMS); each bound is about 3x above what its class produced. */
static const struct { const char *name; double bound; } noise_classes[] = {
    {"float32", 1e-5}, {"bf16", 1.5e-2}, {"fp8", 8e-2}, {"fp4", 0.3}};
enum { NOISE_F32, NOISE_BF16, NOISE_FP8, NOISE_FP4, NOISE_NONE };

static int noise_index(double res) {
    for (int i = 0; i < NOISE_NONE; i++)
        if (res <= noise_classes[i].bound) return i;
    return NOISE_NONE;
}

/* ------------------------------------------------------------ names */

static const char *const verdict_names[] = {"OK", "SCALE_DOUBLE", "SCALE_MISSING", "SHARED_WEIGHT",
                                            "NOT_RENORMALIZED", "BIASED_WEIGHTS", "WRONG_SCORE", "SELECTION",
                                            "UNEXPLAINED"};
const char *moe_verdict_name(moe_verdict v) { return (unsigned)v <= MOE_VERDICT_UNEXPLAINED ? verdict_names[v] : "?"; }

static const char *const conf_names[] = {"none", "weak", "strong", "exact"};
const char *moe_confidence_name(moe_confidence c) { return (unsigned)c <= MOE_CONF_EXACT ? conf_names[c] : "?"; }

static const char *const stage_names[] = {"router", "selection", "weights", "output"};
const char *moe_diag_stage_name(moe_diag_stage s) { return (unsigned)s < MOE_STAGE_COUNT ? stage_names[s] : "?"; }

/* ------------------------------------------------------------ context */

typedef struct diag {
    const moe_layer *L;
    const moe_dump *d;
    moe_diagnosis *g;
    int E, K, H;
    int64_t T;
    double s;
    diag_hypos hs;
    const double *S;        /* [T, H] reference shared branch, or NULL */
    double *tol;            /* [T] tie margin on the biased scores */
    int level;              /* router level the margins were built for (-1: measured from logits) */
    double router_rel;      /* measured max |logit error| / max |logit|, or -1 */
    int router_noise;       /* noise floor the router evidence implies (NOISE_*) */
    bool escalated;         /* margins widened to bf16 because float32 ones left tokens unexplained */
    int sel_winner;         /* hypothesis the selection stage proved (>= 0), or -1 */
    int w_winner;           /* hypothesis the weights stage proved, or -1 */
    moe_verdict w_cls;
} diag;

static moe_finding *add_finding(moe_diagnosis *g, moe_diag_stage stage, const char *cls, moe_confidence conf,
                                bool votes, int64_t tokens, const char *detail, const char *evidence) {
    if (g->n_findings >= MOE_DIAG_MAX_FINDINGS) return NULL;
    moe_finding *f = &g->findings[g->n_findings++];
    f->stage = stage;
    snprintf(f->stage_name, sizeof f->stage_name, "%s", stage_names[stage]);
    snprintf(f->cls, sizeof f->cls, "%s", cls);
    f->conf = conf;
    f->votes = votes;
    f->tokens = tokens;
    snprintf(f->detail, sizeof f->detail, "%s", detail);
    snprintf(f->evidence, sizeof f->evidence, "%s", evidence ? evidence : "");
    return f;
}

static void stage_note(moe_diagnosis *g, moe_diag_stage s, bool checked, const char *fmt, ...) MOE_PRINTF(4, 5);
static void stage_note(moe_diagnosis *g, moe_diag_stage s, bool checked, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    g->stages[s].checked = checked;
    vsnprintf(g->stages[s].note, sizeof g->stages[s].note, fmt, ap);
    va_end(ap);
}

static bool near(double x, double want, double tol) { return fabs(x - want) <= tol * fmax(fabs(want), 1e-12); }

static bool token_finite(const double *v, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (!isfinite(v[i])) return false;
    return true;
}

static bool token_nonzero(const double *v, int64_t n) {
    for (int64_t i = 0; i < n; i++)
        if (v[i] != 0.0) return true;
    return false;
}

static int64_t min_fit_tokens(int64_t T) {
    int64_t m = T < DIAG_MIN_TOKENS ? T : DIAG_MIN_TOKENS;
    return m > (T + 3) / 4 ? m : (T + 3) / 4;
}

/* Does token t's routed set in the dump equal ids [K]? */
static bool same_set(const moe_dump *d, int64_t t, const int32_t *ids, int K, int E) {
    int matched = 0, routed = 0;
    for (int c = 0; c < d->n_cols; c++) {
        int32_t v = d->topk_ids[t * d->n_cols + c];
        if (v >= E) continue;
        routed++;
        for (int j = 0; j < K; j++)
            if (ids[j] == v) { matched++; break; }
    }
    return routed == K && matched == K;
}

/* Biased selection scores pb [E] of hypothesis h for token t (dropped groups
 * not masked), and the group score cut: keep_min = the lowest kept group's
 * score (-inf when ungrouped). work [E]. */
static void biased_scores(const diag *x, const diag_hypo *h, int64_t t, double *pb) {
    const moe_layer *L = &h->layer;
    moe_router_scores(h->score, x->E, h->out.router_logits + t * x->E, pb);
    if (h->use_bias)
        for (int e = 0; e < x->E; e++) pb[e] += L->bias[e];
}

static double group_score(const double *pb, int g, int per) {
    double m1 = -INFINITY, m2 = -INFINITY;
    for (int i = 0; i < per; i++) {
        double v = pb[g * per + i];
        if (v > m1) { m2 = m1; m1 = v; } else if (v > m2) m2 = v;
    }
    return per < 2 ? m1 : m1 + m2;
}

/* May expert e (not in the set ids) replace a member of ids under a tie
 * margin tol? Its group must be kept, or within 2 tol of the kept cut. */
static bool group_allows(const diag *x, const double *pb, const int32_t *ids, int e, double tol) {
    const moe_block_config *c = &x->L->cfg;
    if (c->kind != MOE_LAYER_TOPK || c->n_group <= 1 || c->topk_group >= c->n_group) return true;
    int per = x->E / c->n_group, ge = e / per;
    for (int j = 0; j < x->K; j++)
        if (ids[j] / per == ge) return true;       /* a group the set already uses is kept */
    double gmin = INFINITY;
    for (int j = 0; j < x->K; j++) gmin = fmin(gmin, group_score(pb, ids[j] / per, per));
    return group_score(pb, ge, per) >= gmin - 2 * tol;
}

/* Is the dump's set for token t reachable from h's set by swaps whose
 * biased-score gaps are within tol? */
static bool near_tie(const diag *x, const diag_hypo *h, int64_t t, double tol, double *pb) {
    if (x->L->cfg.kind != MOE_LAYER_TOPK) return false;
    const int32_t *ids = h->out.topk_ids + t * h->out.n_cols;
    biased_scores(x, h, t, pb);
    double kth = INFINITY;
    for (int j = 0; j < x->K; j++) kth = fmin(kth, pb[ids[j]]);
    const moe_dump *d = x->d;
    for (int c = 0; c < d->n_cols; c++) {
        int32_t v = d->topk_ids[t * d->n_cols + c];
        if (v >= x->E) continue;
        bool in = false;
        for (int j = 0; j < x->K; j++) in |= ids[j] == v;
        if (in) continue;
        if (!(pb[v] >= kth - tol) || !group_allows(x, pb, ids, v, tol)) return false;
    }
    return true;
}

/* ------------------------------------------------------------ router stage */

/* Tie margins tol [T] for router level `lvl` from h0's logits. */
static void margins_at_level(diag *x, int lvl, double *pb) {
    const diag_hypo *h0 = &x->hs.h[0];
    double u4 = 4 * router_levels[lvl].u;
    for (int64_t t = 0; t < x->T; t++) {
        const double *lg = h0->out.router_logits + t * x->E;
        biased_scores(x, h0, t, pb);
        double ml = 0, mp = 0;
        for (int e = 0; e < x->E; e++) {
            if (isfinite(lg[e])) ml = fmax(ml, fabs(lg[e]));
            if (isfinite(pb[e])) mp = fmax(mp, fabs(pb[e]));
        }
        x->tol[t] = u4 * (0.5 * ml + mp);
    }
    x->level = lvl;
}

static void stage_router(diag *x, double *pb) {
    const moe_dump *d = x->d;
    moe_diagnosis *g = x->g;
    const diag_hypo *h0 = &x->hs.h[0];
    char det[320], ev[320];
    x->router_rel = -1;
    x->router_noise = NOISE_F32;
    if (!d->router_logits) {
        /* assume a float32 router; the flip search widens to bf16 when the outputs need it */
        margins_at_level(x, 0, pb);
        stage_note(g, MOE_STAGE_ROUTER, false, "not checked: the dump has no router_logits; tie margins assume a "
                   "float32 router until the outputs show otherwise");
        return;
    }
    double emax = 0, mmax = 0;
    double u_store = unit_roundoff(d->logits_dtype);
    for (int64_t t = 0; t < x->T; t++) {
        double et = 0, mp = 0, ml = 0;
        const double *lr = h0->out.router_logits + t * x->E, *ld = d->router_logits + t * x->E;
        biased_scores(x, h0, t, pb);
        for (int e = 0; e < x->E; e++) {
            if (isfinite(ld[e]) && isfinite(lr[e])) et = fmax(et, fabs(ld[e] - lr[e]));
            if (isfinite(lr[e])) ml = fmax(ml, fabs(lr[e]));
            if (isfinite(pb[e])) mp = fmax(mp, fabs(pb[e]));
        }
        emax = fmax(emax, et);
        mmax = fmax(mmax, ml);
        /* the measured logit error moves a score by at most 0.5x; the engine rounds scores
         * at most as finely as it stored the logits */
        x->tol[t] = 2 * (0.5 * et + 2 * u_store * mp) + 1e-300;
    }
    x->level = -1;
    double rel = mmax > 0 ? emax / mmax : emax;
    x->router_rel = rel;
    const char *lvl = rel < 1e-12 ? "float64" : rel < 2e-4 ? "float32" : rel < 2e-2 ? "bf16" : NULL;
    x->router_noise = rel < 2e-4 ? NOISE_F32 : NOISE_BF16;
    snprintf(det, sizeof det, "router logits differ from float64 by %.3g relative (%s)", rel,
             lvl ? lvl : "beyond bf16: the router's input or weights differ from the checkpoint's");
    snprintf(ev, sizeof ev, "max |dump - ref| = %.3g over %lld x %d logits, stored as %s", emax, (long long)x->T, x->E,
             moe_dtype_name(d->logits_dtype));
    add_finding(g, MOE_STAGE_ROUTER, lvl ? "INFO" : "NOISE", MOE_CONF_WEAK, false, x->T, det, ev);
    stage_note(g, MOE_STAGE_ROUTER, true, "router_logits checked on %lld tokens (%s level)", (long long)x->T,
               lvl ? lvl : "beyond bf16");
}

/* ------------------------------------------------------------ selection stage */

static void stage_selection(diag *x, double *pb) {
    const moe_dump *d = x->d;
    moe_diagnosis *g = x->g;
    const moe_block_config *c = &x->L->cfg;
    char det[320], ev[320];
    x->sel_winner = -1;
    if (!d->topk_ids) {
        stage_note(g, MOE_STAGE_SELECTION, false, "not checked directly: the dump has no topk_ids; the output stage "
                   "infers each token's expert set from moe_out");
        return;
    }
    diag_hypos *hs = &x->hs;
    for (int i = 0; i < hs->n; i++) {
        hs->h[i].agree = 0;
        for (int64_t t = 0; t < x->T; t++)
            hs->h[i].agree += same_set(d, t, hs->h[i].out.topk_ids + t * hs->h[i].out.n_cols, x->K, x->E);
    }
    const diag_hypo *h0 = &hs->h[0];
    int64_t mism = x->T - h0->agree, near_n = 0;
    for (int64_t t = 0; t < x->T; t++)
        if (!same_set(d, t, h0->out.topk_ids + t * h0->out.n_cols, x->K, x->E) && near_tie(x, h0, t, x->tol[t], pb))
            near_n++;
    if (mism > near_n && x->level == 0) {
        /* no logits to measure the router by: mismatches all within bf16 margins are a bf16 router's */
        int64_t near_bf16 = 0;
        margins_at_level(x, 1, pb);
        for (int64_t t = 0; t < x->T; t++)
            if (!same_set(d, t, h0->out.topk_ids + t * h0->out.n_cols, x->K, x->E) && near_tie(x, h0, t, x->tol[t], pb))
                near_bf16++;
        if (near_bf16 > near_n) {
            near_n = near_bf16;
            x->escalated = true;
        } else margins_at_level(x, 0, pb);
    }
    int64_t hard = mism - near_n;
    g->selection_mismatch = mism;
    g->near_tie_flips = near_n;
    stage_note(g, MOE_STAGE_SELECTION, true, "topk_ids checked on %lld tokens against %d routing hypotheses",
               (long long)x->T, hs->n);
    if (mism == 0) {
        snprintf(det, sizeof det, "all %lld tokens chose the reference experts", (long long)x->T);
        add_finding(g, MOE_STAGE_SELECTION, "OK", MOE_CONF_EXACT, true, x->T, det, "");
        x->sel_winner = 0;
        return;
    }
    if (hard == 0) {
        snprintf(det, sizeof det, "%lld of %lld tokens chose other experts, all within the router's tie margin",
                 (long long)mism, (long long)x->T);
        snprintf(ev, sizeof ev, "tie margin %.3g on the biased scores (median over tokens)", x->g->tie_tolerance);
        add_finding(g, MOE_STAGE_SELECTION, "NOISE", MOE_CONF_WEAK, false, mism, det, ev);
        x->sel_winner = 0;
        return;
    }
    int best = 0;
    for (int i = 1; i < hs->n; i++)
        if ((hs->h[i].changes & HY_SEL) && hs->h[i].agree > hs->h[best].agree) best = i;
    const diag_hypo *hb = &hs->h[best];
    if (best != 0 && (hb->agree == x->T || (hb->agree * 10 >= x->T * 9 && hb->agree - h0->agree >= hard / 2 + 1))) {
        moe_confidence cf = hb->agree == x->T ? MOE_CONF_EXACT : MOE_CONF_STRONG;
        snprintf(det, sizeof det, "expert sets match %s on %lld of %lld tokens (the specified routing: %lld)", hb->name,
                 (long long)hb->agree, (long long)x->T, (long long)h0->agree);
        snprintf(ev, sizeof ev, "%lld tokens differ from the reference beyond the tie margin", (long long)hard);
        add_finding(g, MOE_STAGE_SELECTION, moe_verdict_name(hb->cls), cf, true, x->T, det, ev);
        x->sel_winner = best;
        return;
    }
    bool votes = hard >= 3 || hard * 20 >= x->T;
    snprintf(det, sizeof det, "expert sets differ on %lld of %lld tokens beyond the tie margin; no known variant "
             "explains them%s", (long long)hard, (long long)x->T,
             c->kind == MOE_LAYER_HASH ? " (hash layer: check tid2eid and input_ids)" : "");
    snprintf(ev, sizeof ev, "%lld of the %lld mismatches within the tie margin", (long long)near_n, (long long)mism);
    add_finding(g, MOE_STAGE_SELECTION, "SELECTION", votes ? MOE_CONF_STRONG : MOE_CONF_WEAK, votes, hard, det, ev);
    x->sel_winner = 0; /* fit the outputs of the agreeing tokens under the specified routing */
}

/* ------------------------------------------------------------ weights stage */

typedef struct wfit {
    double rms, worst, c;
    int64_t n;
} wfit;

static wfit weights_fit(const diag *x, const diag_hypo *h, double c) {
    const moe_dump *d = x->d;
    wfit r = {INFINITY, INFINITY, c, 0};
    double sq = 0, worst = 0;
    int64_t n = 0;
    for (int64_t t = 0; t < x->T; t++) {
        const int32_t *ids = h->out.topk_ids + t * h->out.n_cols;
        if (!same_set(d, t, ids, x->K, x->E)) continue;
        for (int cc = 0; cc < d->n_cols; cc++) {
            int32_t v = d->topk_ids[t * d->n_cols + cc];
            double w = d->topk_weights[t * d->n_cols + cc];
            if (v >= x->E) continue;
            for (int j = 0; j < x->K; j++)
                if (ids[j] == v) {
                    double want = c * h->out.topk_weights[t * h->out.n_cols + j];
                    if (!isfinite(w) || !isfinite(want)) break;
                    double e = fabs(w - want) / fmax(fabs(want), 1e-30);
                    sq += e * e;
                    worst = fmax(worst, e);
                    n++;
                    break;
                }
        }
    }
    if (n > 0) { r.rms = sqrt(sq / (double)n); r.worst = worst; r.n = n / x->K; }
    return r;
}

static void stage_weights(diag *x) {
    const moe_dump *d = x->d;
    moe_diagnosis *g = x->g;
    char det[320], ev[320];
    x->w_winner = -1;
    if (!d->topk_ids || !d->topk_weights) {
        stage_note(g, MOE_STAGE_WEIGHTS, false, "not checked: the dump has no %s", d->topk_ids ? "topk_weights" : "topk_ids/topk_weights");
        return;
    }
    diag_hypos *hs = &x->hs;
    double s = x->s, cands[3] = {1.0, s, s * s};
    wfit best = {INFINITY, INFINITY, 1, 0}, spec = best;
    int bi = -1;
    for (int i = 0; i < hs->n; i++) {
        const diag_hypo *h = &hs->h[i];
        /* selection-only hypotheses share the specified weight rule: only the one the selection
         * stage proved is checked, on its own expert sets */
        if (h->changes != 0 && !(h->changes & HY_W) && i != x->sel_winner) continue;
        for (int ci = 0; ci < 3; ci++) {
            wfit f = weights_fit(x, h, cands[ci]);
            if (f.n < min_fit_tokens(x->T)) continue;
            if (i == 0 && f.rms < spec.rms) spec = f;
            if (f.rms < best.rms) { best = f; bi = i; }
        }
    }
    if (bi < 0) {
        stage_note(g, MOE_STAGE_WEIGHTS, false, "not checked: too few tokens whose expert sets match a hypothesis");
        return;
    }
    double u_w = unit_roundoff(d->weights_dtype);
    /* within the weights' storage precision and the router's: 8 roundings of the
     * stored value, 4x the measured logit error (a score moves at most 0.5x it, and
     * renormalization divides by a sum of K such scores) */
    double tol = 8 * u_w + (x->router_rel > 0 ? 4 * x->router_rel : 0);
    stage_note(g, MOE_STAGE_WEIGHTS, true, "topk_weights (%s) checked on %lld tokens against %d weight rules x {1, s, s^2}",
               moe_dtype_name(d->weights_dtype), (long long)best.n, hs->n);
    const diag_hypo *hb = &hs->h[bi];
    bool rule_ok = bi == 0 || !(hb->changes & HY_W); /* the specified weight rule, maybe on other sets */
    bool decisive = best.rms <= tol && (rule_ok || !(spec.rms <= 8 * fmax(best.rms, u_w)));
    const char *fold = best.c == 1.0 ? "they sum to 1: the factor is left to the runner or the output stage"
                     : best.c == s ? "they sum to s: the router folds the factor in"
                                   : "they sum to s^2: the router applies the factor twice";
    if (decisive) {
        moe_confidence cf = best.worst <= 32 * u_w ? MOE_CONF_EXACT : MOE_CONF_STRONG;
        const char *cls = rule_ok ? "OK" : moe_verdict_name(hb->cls);
        snprintf(det, sizeof det, "weights match %s%s; %s", bi == 0 ? "the specified routing" : hb->name,
                 rule_ok && bi != 0 ? " (the specified weight rule on those sets)" : "", fold);
        snprintf(ev, sizeof ev, "relative difference rms %.3g, max %.3g over %lld tokens (stored as %s)%s", best.rms,
                 best.worst, (long long)best.n, moe_dtype_name(d->weights_dtype), rule_ok ? "" : "; the specified routing's rms");
        if (!rule_ok) {
            size_t len = strlen(ev);
            snprintf(ev + len, sizeof ev - len, " %.3g", spec.rms);
        }
        add_finding(g, MOE_STAGE_WEIGHTS, cls, cf, true, best.n, det, ev);
        x->w_winner = rule_ok ? (bi == 0 ? 0 : -1) : bi;
        x->w_cls = rule_ok ? MOE_VERDICT_OK : hb->cls;
    } else {
        snprintf(det, sizeof det, "weights match no weight rule within their precision (closest: %s, %s)", hb->name, fold);
        snprintf(ev, sizeof ev, "relative difference rms %.3g (tolerance %.3g), the specified routing's %.3g", best.rms, tol,
                 spec.rms);
        add_finding(g, MOE_STAGE_WEIGHTS, "UNEXPLAINED", MOE_CONF_WEAK, false, best.n, det, ev);
    }
    /* a fused shared column's weight says which contract the engine meant */
    for (int64_t t = 0; t < x->T; t++)
        for (int cc = 0; cc < d->n_cols; cc++)
            if (d->topk_ids[t * d->n_cols + cc] >= x->E) {
                double w = d->topk_weights[t * d->n_cols + cc];
                snprintf(det, sizeof det, "fused shared column weighted %.6g (1 when the router folds s, 1/s = %.6g "
                         "when the runner multiplies every column)", w, 1 / s);
                add_finding(g, MOE_STAGE_WEIGHTS, "INFO", MOE_CONF_WEAK, false, 1, det, "");
                return;
            }
}

/* ------------------------------------------------------------ output stage */

/* Least squares M ~ a R + b S over the tokens in use (b = 0 without S). */
static void fit(const diag *x, const double *R, const unsigned char *use, double *a, double *b, double *res,
                int64_t *used) {
    int H = x->H;
    const double *S = x->S, *M = x->d->moe_out;
    double rr = 0, rs = 0, ss = 0, rm = 0, sm = 0, mm = 0;
    int64_t n = 0;
    for (int64_t t = 0; t < x->T; t++) {
        if (!use[t]) continue;
        n++;
        for (int h = 0; h < H; h++) {
            double r = R[t * H + h], s = S ? S[t * H + h] : 0, m = M[t * H + h];
            rr += r * r; rs += r * s; ss += s * s; rm += r * m; sm += s * m; mm += m * m;
        }
    }
    *used = n;
    double det = rr * ss - rs * rs;
    if (S && ss > 0 && fabs(det) > 1e-12 * rr * ss) {
        *a = (rm * ss - sm * rs) / det;
        *b = (sm * rr - rm * rs) / det;
    } else {
        *a = rr > 0 ? rm / rr : 0;
        *b = 0;
    }
    double e = mm - 2 * (*a) * rm - 2 * (*b) * sm + (*a) * (*a) * rr + 2 * (*a) * (*b) * rs + (*b) * (*b) * ss;
    *res = mm > 0 ? sqrt(fmax(e, 0) / mm) : 0;
}

static double token_err2(const diag *x, const double *Rt, int64_t t, double a, double b) {
    double e = 0;
    const double *M = x->d->moe_out + t * x->H, *S = x->S ? x->S + t * x->H : NULL;
    for (int h = 0; h < x->H; h++) {
        double r = M[h] - a * Rt[h] - (S ? b * S[h] : 0);
        e += r * r;
    }
    return e;
}

static double token_norm2(const diag *x, int64_t t) {
    double e = 0;
    const double *M = x->d->moe_out + t * x->H;
    for (int h = 0; h < x->H; h++) e += M[h] * M[h];
    return e;
}

static int cmp_double(const void *p, const void *q) {
    double a = *(const double *)p, b = *(const double *)q;
    return a < b ? -1 : a > b;
}

/* Scratch of the flip search, allocated once per diagnosis. Expert outputs
 * depend on the token and the expert only (every hypothesis shares the
 * layer's experts: diagnose_hypo.c changes routing alone), so they are kept
 * across hypotheses and passes: for every token when T x E x H doubles fit
 * DIAG_YCACHE_MAX (the fits then evaluate each (token, expert) once), else
 * for the token last seen. */
#define DIAG_YCACHE_MAX ((int64_t)1 << 22) /* doubles: 32 MiB */
typedef struct flip_ws {
    double *y;      /* [slots, E, H] expert outputs */
    unsigned char *have; /* [slots, E] */
    int64_t slots;  /* T (every token) or 1 (the token last seen) */
    int64_t last_t; /* slots == 1: the token whose outputs y holds, -1 none */
    double *scratch, *pb, *w, *cand_R, *e2;
    int32_t *cand;  /* [DIAG_MAX_ALT, K] */
    unsigned char *flag; /* [2 T] */
} flip_ws;

/* Candidate sets for token t under h: single and double swaps of a member
 * with a non-member whose biased score is within tol below it. Returns the
 * count written to cand (at most DIAG_MAX_ALT). */
static int candidates(const diag *x, const diag_hypo *h, int64_t t, double tol, flip_ws *ws) {
    int K = x->K, E = x->E, n = 0;
    const int32_t *ids = h->out.topk_ids + t * h->out.n_cols;
    double *pb = ws->pb;
    biased_scores(x, h, t, pb);
    int sw_i[DIAG_MAX_ALT], sw_e[DIAG_MAX_ALT], ns = 0;
    for (int j = 0; j < K && ns < DIAG_MAX_ALT; j++)
        for (int e = 0; e < E && ns < DIAG_MAX_ALT; e++) {
            bool in = false;
            for (int q = 0; q < K; q++) in |= ids[q] == e;
            if (in || !(pb[ids[j]] - pb[e] <= tol) || !group_allows(x, pb, ids, e, tol)) continue;
            sw_i[ns] = j;
            sw_e[ns] = e;
            ns++;
        }
    for (int a = 0; a < ns && n < DIAG_MAX_ALT; a++) {
        memcpy(ws->cand + n * K, ids, (size_t)K * sizeof *ids);
        ws->cand[n * K + sw_i[a]] = sw_e[a];
        n++;
    }
    for (int a = 0; a < ns; a++)
        for (int b = a + 1; b < ns && n < DIAG_MAX_ALT; b++) {
            if (sw_i[a] == sw_i[b] || sw_e[a] == sw_e[b]) continue;
            memcpy(ws->cand + n * K, ids, (size_t)K * sizeof *ids);
            ws->cand[n * K + sw_i[a]] = sw_e[a];
            ws->cand[n * K + sw_i[b]] = sw_e[b];
            n++;
        }
    return n;
}

/* Unit routed output Rt [H] of token t for the set ids under h. */
static void routed_for(const diag *x, const diag_hypo *h, int64_t t, const int32_t *ids, flip_ws *ws, double *Rt) {
    int H = x->H, K = x->K;
    diag_set_weights(h, h->out.router_logits + t * x->E, ids, K, ws->w, ws->pb);
    memset(Rt, 0, (size_t)H * sizeof *Rt);
    int64_t slot = ws->slots > 1 ? t : 0;
    if (ws->slots == 1 && ws->last_t != t) {
        memset(ws->have, 0, (size_t)x->E);
        ws->last_t = t;
    }
    unsigned char *have = ws->have + (size_t)slot * (size_t)x->E;
    double *y = ws->y + (size_t)slot * (size_t)x->E * (size_t)H;
    for (int j = 0; j < K; j++) {
        int e = ids[j];
        if (!have[e]) {
            diag_expert(&h->layer, e, x->d->hidden + t * H, y + (size_t)e * H, ws->scratch);
            have[e] = 1;
        }
        for (int q = 0; q < H; q++) Rt[q] += ws->w[j] * y[(size_t)e * H + q];
    }
}

/* Fit the outputs under h: R [T, H] starts as h's unit routed output; without
 * ids, each token at a near-tie takes the candidate set that explains its
 * moe_out best, when that at least halves its error (twice: fit on the
 * tokens without alternatives, choose, refit on all, choose again, refit). */
static void fit_hypo(diag *x, diag_hypo *h, double *R, unsigned char *use, flip_ws *ws, double *e2, bool search) {
    const moe_dump *d = x->d;
    int H = x->H;
    int64_t T = x->T;
    for (int64_t i = 0; i < T * H; i++) R[i] = h->out.routed_out[i] / x->s;
    for (int64_t t = 0; t < T; t++) {
        bool ok = token_finite(d->moe_out + t * H, H) && token_finite(R + t * H, H) &&
                  (!x->S || token_finite(x->S + t * H, H));
        /* a token whose reference branches are both exactly zero (a zero
         * hidden state) satisfies moe_out = a * 0 + b * 0 for every a and b:
         * it carries no evidence, and a fit over such tokens alone must not
         * vote (issue #12: an all-zero dump was judged SHARED_WEIGHT) */
        if (ok && !token_nonzero(R + t * H, H) && (!x->S || !token_nonzero(x->S + t * H, H))) ok = false;
        if (ok && d->topk_ids) ok = same_set(d, t, h->out.topk_ids + t * h->out.n_cols, x->K, x->E);
        use[t] = ok;
    }
    h->flips = 0;
    fit(x, R, use, &h->a, &h->b, &h->res, &h->used);
    if (search && h->used > 0) {
        unsigned char *alt = ws->flag, *took = ws->flag + T;
        int64_t n_clean = 0;
        for (int64_t t = 0; t < T; t++) {
            alt[t] = use[t] && candidates(x, h, t, x->tol[t], ws) > 0;
            took[t] = 0;
            n_clean += use[t] && !alt[t];
        }
        if (n_clean >= min_fit_tokens(T)) {
            for (int64_t t = 0; t < T; t++) took[t] = use[t] && !alt[t]; /* borrowed as the clean mask */
            fit(x, R, took, &h->a, &h->b, &h->res, &h->used);
            memset(took, 0, (size_t)T);
        }
        double *cur = ws->cand_R, *best_R = ws->cand_R + H;
        for (int pass = 0; pass < 2; pass++) {
            for (int64_t t = 0; t < T; t++) {
                if (!alt[t]) continue;
                routed_for(x, h, t, h->out.topk_ids + t * h->out.n_cols, ws, best_R);
                double e_ref = token_err2(x, best_R, t, h->a, h->b), e_best = e_ref;
                int na = candidates(x, h, t, x->tol[t], ws), pick = -1;
                for (int k = 0; k < na; k++) {
                    routed_for(x, h, t, ws->cand + k * x->K, ws, cur);
                    double e = token_err2(x, cur, t, h->a, h->b);
                    if (e < e_best) { e_best = e; pick = k; memcpy(R + t * H, cur, (size_t)H * sizeof *cur); }
                }
                took[t] = pick >= 0 && e_best < DIAG_DISCRIMINATE * DIAG_DISCRIMINATE * e_ref;
                if (!took[t]) memcpy(R + t * H, best_R, (size_t)H * sizeof *best_R);
            }
            fit(x, R, use, &h->a, &h->b, &h->res, &h->used);
        }
        for (int64_t t = 0; t < T; t++) h->flips += took[t];
    }
    /* per-token errors: the unexplained tokens */
    int64_t n = 0;
    for (int64_t t = 0; t < T; t++)
        if (use[t]) e2[n++] = token_err2(x, R + t * H, t, h->a, h->b);
    h->unexplained = 0;
    if (n > 0) {
        double *sorted = ws->e2;
        memcpy(sorted, e2, (size_t)n * sizeof *e2);
        qsort(sorted, (size_t)n, sizeof *sorted, cmp_double);
        double med = sorted[n / 2];
        n = 0;
        for (int64_t t = 0; t < T; t++)
            if (use[t]) {
                double e = e2[n++];
                if (e > DIAG_OUTLIER2 * med && e > DIAG_OUTLIER_FLOOR * DIAG_OUTLIER_FLOOR * token_norm2(x, t))
                    h->unexplained++;
            }
    }
    h->fitted = true;
}

static const char *shared_what(double b, double s) {
    return near(b, 1 / s, DIAG_SCALE_TOL) ? " = 1/s (a fused shared column weighted for a runner that does not scale)"
         : near(b, s, DIAG_SCALE_TOL)     ? " = s (the factor applied to the shared expert too)"
         : near(b, 2, DIAG_SCALE_TOL)     ? " (the shared expert added twice)"
         : fabs(b) < DIAG_SCALE_TOL       ? " (the shared expert is missing)" : "";
}

/* Fit every competing hypothesis (only >= 0: that one alone) and return the
 * best that votes, or -1; widens the tie margins to bf16 and refits once when
 * float32 margins leave tokens unexplained. */
static int compete(diag *x, flip_ws *ws, double *R, unsigned char *use, double *e2, int only, bool search) {
    const moe_dump *d = x->d;
    diag_hypos *hs = &x->hs;
    int64_t T = x->T;
    int best = -1;
    for (int pass = 0; pass < 2; pass++) {
        best = -1;
        for (int i = 0; i < hs->n; i++) {
            if (only >= 0 && i != only) continue;
            if (d->topk_ids && (hs->h[i].changes & HY_SEL) && only < 0 && hs->h[i].agree * 4 < T) continue;
            fit_hypo(x, &hs->h[i], R, use, ws, e2, search);
            if (hs->h[i].used < min_fit_tokens(T)) continue; /* too few tokens never vote */
            if (best < 0 || hs->h[i].res < hs->h[best].res) best = i;
        }
        /* the specified routing holds unless another clearly fits better */
        if (best > 0 && only < 0 && hs->h[0].fitted && hs->h[0].used >= min_fit_tokens(T) &&
            !(hs->h[best].res < DIAG_DISCRIMINATE * hs->h[0].res))
            best = 0;
        /* unexplained tokens at a float32 tie margin: the router may run in bf16 */
        bool any_unexplained = false;
        for (int i = 0; i < hs->n; i++) any_unexplained |= hs->h[i].fitted && hs->h[i].unexplained > 0;
        if (pass == 0 && search && best >= 0 && x->level == 0 && any_unexplained) {
            margins_at_level(x, 1, ws->pb);
            x->escalated = true;
            continue;
        }
        break;
    }
    return best;
}

/* The fit of the winning hypothesis into the diagnosis, and the noise class:
 * the residual's, floored by what the dump's storage and router show.
 * Returns the class index (NOISE_NONE: beyond fp4). */
static int fit_and_noise(diag *x, const diag_hypo *bh) {
    moe_diagnosis *g = x->g;
    const moe_dump *d = x->d;
    g->fit_a = bh->a;
    g->fit_b = bh->b;
    g->residual = bh->res;
    g->tokens_used = bh->used;
    g->flips_resolved = bh->flips;
    g->tokens_unexplained = bh->unexplained;
    snprintf(g->hypothesis, sizeof g->hypothesis, "%s", bh->name);
    if (x->escalated && bh->flips > 0 && x->router_noise < NOISE_BF16) x->router_noise = NOISE_BF16;
    int ni = noise_index(bh->res), floor_i = NOISE_F32;
    const char *floor_why = "";
    if (d->moe_out_dtype == MOE_DTYPE_BF16 || d->moe_out_dtype == MOE_DTYPE_F16) { floor_i = NOISE_BF16; floor_why = "moe_out stored as 16-bit floats"; }
    if (x->router_noise > floor_i) { floor_i = x->router_noise; floor_why = x->router_rel >= 0 ? "router logits at bf16 level" : "flips resolved only at bf16 tie margins"; }
    int cls_i = ni == NOISE_NONE ? NOISE_NONE : (ni > floor_i ? ni : floor_i);
    g->noise = cls_i == NOISE_NONE ? NULL : noise_classes[cls_i].name;
    snprintf(g->noise_evidence, sizeof g->noise_evidence, "residual %.3g over %lld tokens (%s level)%s%s%s", bh->res,
             (long long)bh->used, ni == NOISE_NONE ? "beyond fp4" : noise_classes[ni].name, floor_why[0] ? "; " : "",
             floor_why, ni != NOISE_NONE && floor_i > ni ? " (raises the class)" : "");
    return cls_i;
}

/* The output stage's findings for the fit of hypothesis `best`. */
static void output_findings(diag *x, int best, int only, bool search, int cls_i) {
    moe_diagnosis *g = x->g;
    const moe_dump *d = x->d;
    diag_hypos *hs = &x->hs;
    const diag_hypo *bh = &hs->h[best];
    int64_t T = x->T;
    int H = x->H;
    char det[320], ev[320];
    stage_note(g, MOE_STAGE_OUTPUT, true, "moe_out fitted on %lld of %lld tokens under \"%s\"%s", (long long)bh->used,
               (long long)T, bh->name, search ? "; expert sets chosen among near-tie alternatives (no topk_ids)" : "");
    if (search) {
        snprintf(det, sizeof det, "%lld of %lld tokens are explained by another expert set within the router's tie "
                 "margin (%s level)", (long long)bh->flips, (long long)T, x->level == 1 ? "bf16" : x->level == 0 ? "float32" : "measured");
        snprintf(ev, sizeof ev, "%lld tokens left unexplained", (long long)bh->unexplained);
        add_finding(g, MOE_STAGE_OUTPUT, "NOISE", MOE_CONF_WEAK, false, bh->flips, det, ev);
    }
    double s = x->s, a = bh->a, b = bh->b;
    bool votes = bh->used >= min_fit_tokens(T);
    bool scale_ok = near(a, s, DIAG_SCALE_TOL), shared_ok = !x->S || near(b, 1.0, DIAG_SCALE_TOL);
    moe_confidence cf = g->noise ? (cls_i == NOISE_F32 ? MOE_CONF_EXACT : MOE_CONF_STRONG) : MOE_CONF_WEAK;
    snprintf(ev, sizeof ev, "moe_out ~ %.6g * routed + %.6g * shared over %lld tokens, residual %.3g (%s)", a, b,
             (long long)bh->used, bh->res, g->noise ? g->noise : "beyond fp4 noise");
    const char *cls = "OK";
    if (best != 0 && only < 0) {
        cls = moe_verdict_name(bh->cls);
        snprintf(det, sizeof det, "outputs fit %s (residual %.3g; the specified routing leaves %.3g)", bh->name, bh->res,
                 hs->h[0].fitted ? hs->h[0].res : NAN);
        add_finding(g, MOE_STAGE_OUTPUT, cls, hs->h[0].fitted && bh->res < DIAG_DISCRIMINATE * hs->h[0].res ? MOE_CONF_STRONG : MOE_CONF_WEAK,
                    votes, bh->used, det, ev);
    }
    cls = "OK";
    if (!scale_ok && s != 1.0 && near(a, s * s, DIAG_SCALE_TOL)) {
        cls = "SCALE_DOUBLE";
        snprintf(det, sizeof det, "the routed branch is scaled by %.4g = s^2 (s = %g): routed_scaling_factor is applied twice", a, s);
    } else if (!scale_ok && s != 1.0 && near(a, 1.0, DIAG_SCALE_TOL)) {
        cls = "SCALE_MISSING";
        snprintf(det, sizeof det, "the routed branch is scaled by %.4g, not s = %g: routed_scaling_factor is never applied", a, s);
    } else if (!shared_ok) {
        cls = "SHARED_WEIGHT";
        snprintf(det, sizeof det, "the shared expert is weighted %.4g%s, not 1", b, shared_what(b, s));
    } else if (!scale_ok) {
        cls = "UNEXPLAINED";
        snprintf(det, sizeof det, "the routed branch is scaled by %.4g; expected s = %g", a, s);
        cf = MOE_CONF_STRONG;
    } else if (!g->noise) {
        cls = "UNEXPLAINED";
        snprintf(det, sizeof det, "scales are right but the residual %.3g exceeds fp4 arithmetic noise", bh->res);
        cf = MOE_CONF_STRONG;
    } else {
        snprintf(det, sizeof det, "routed x %.4g (s = %g) + shared x %.4g; the difference is %s-level arithmetic noise",
                 a, s, b, g->noise);
    }
    if (strcmp(cls, "OK") != 0 && strcmp(cls, "UNEXPLAINED") != 0 && cf == MOE_CONF_WEAK) cf = MOE_CONF_STRONG;
    add_finding(g, MOE_STAGE_OUTPUT, cls, cf, votes, bh->used, det, ev);
    /* tokens no expert set explains */
    if (search && bh->unexplained >= 3 && bh->unexplained * 20 >= T) {
        snprintf(det, sizeof det, "%lld of %lld tokens' moe_out fits no near-tie expert set of %s", (long long)bh->unexplained,
                 (long long)T, bh->name);
        add_finding(g, MOE_STAGE_OUTPUT, "SELECTION", MOE_CONF_STRONG, votes, bh->unexplained, det,
                    "their fit error is over 8x the median token's");
    }
    /* what the dump's own branch outputs say (not voting: engines name these differently) */
    if (d->routed_out && d->shared_out) {
        double num = 0, den = 0;
        for (int64_t i = 0; i < T * H; i++)
            if (isfinite(d->moe_out[i]) && isfinite(d->routed_out[i]) && isfinite(d->shared_out[i])) {
                double r = d->moe_out[i] - d->routed_out[i] - d->shared_out[i];
                num += r * r;
                den += d->moe_out[i] * d->moe_out[i];
            }
        snprintf(det, sizeof det, "the dump's moe_out %s routed_out + shared_out (relative difference %.3g)",
                 num <= 1e-4 * den ? "equals" : "differs from", den > 0 ? sqrt(num / den) : 0.0);
        add_finding(g, MOE_STAGE_OUTPUT, "INFO", MOE_CONF_WEAK, false, T, det, "");
    }
}

static moe_status stage_output(diag *x, moe_error *err) {
    moe_diagnosis *g = x->g;
    const moe_dump *d = x->d;
    int64_t T = x->T;
    int H = x->H;
    moe_status st = MOE_OK;
    char det[320];
    double *R = moe_malloc((size_t)(T * H), sizeof *R);
    double *e2 = moe_malloc((size_t)T + 1, sizeof *e2);
    unsigned char *use = moe_calloc((size_t)T + 1, 1);
    flip_ws ws = {0};
    ws.slots = T * x->E * H <= DIAG_YCACHE_MAX && T > 1 ? T : 1;
    ws.last_t = -1;
    ws.y = moe_malloc((size_t)ws.slots * (size_t)x->E * (size_t)H, sizeof *ws.y);
    ws.have = moe_calloc((size_t)ws.slots * (size_t)x->E + 1, 1);
    ws.flag = moe_calloc(2 * (size_t)T + 1, 1);
    ws.scratch = moe_malloc(diag_expert_scratch(x->L) + 1, sizeof *ws.scratch);
    ws.pb = moe_malloc((size_t)x->E, sizeof *ws.pb);
    ws.w = moe_malloc((size_t)x->K, sizeof *ws.w);
    ws.cand_R = moe_malloc(2 * (size_t)H, sizeof *ws.cand_R);
    ws.e2 = moe_malloc((size_t)T + 1, sizeof *ws.e2);
    ws.cand = moe_malloc((size_t)DIAG_MAX_ALT * (size_t)x->K, sizeof *ws.cand);
    if (!R || !e2 || !use || !ws.y || !ws.have || !ws.scratch || !ws.pb || !ws.w || !ws.cand_R || !ws.e2 ||
        !ws.cand || !ws.flag) {
        st = moe_errf(err, MOE_ERR_NOMEM, "out of memory");
        goto done;
    }
    /* which hypotheses compete: the one the selection or weights stage proved, else all */
    int only = x->sel_winner > 0 ? x->sel_winner : x->w_winner;
    bool search = !d->topk_ids && x->L->cfg.kind == MOE_LAYER_TOPK;
    int best = compete(x, &ws, R, use, e2, only, search);
    if (best < 0) {
        snprintf(det, sizeof det, "no routing hypothesis leaves %lld tokens to fit (of %lld)",
                 (long long)min_fit_tokens(T), (long long)T);
        add_finding(g, MOE_STAGE_OUTPUT, "UNEXPLAINED", MOE_CONF_NONE, false, 0, det,
                    d->topk_ids ? "the dump's expert sets match no hypothesis on enough tokens" : "");
        stage_note(g, MOE_STAGE_OUTPUT, false, "not fitted: too few tokens agree with any routing hypothesis");
        goto done;
    }
    output_findings(x, best, only, search, fit_and_noise(x, &x->hs.h[best]));
done:
    free(R); free(e2); free(use);
    free(ws.y); free(ws.have); free(ws.scratch); free(ws.pb); free(ws.w); free(ws.cand_R); free(ws.e2); free(ws.cand); free(ws.flag);
    return st;
}

/* ------------------------------------------------------------ decision */

static int specificity(const char *cls) {
    if (!strcmp(cls, "UNEXPLAINED")) return 1;
    if (!strcmp(cls, "SELECTION")) return 2;
    if (!strcmp(cls, "OK") || !strcmp(cls, "INFO") || !strcmp(cls, "NOISE")) return 0;
    return 3;
}

static moe_verdict verdict_of(const char *cls) {
    for (int v = 0; v <= MOE_VERDICT_UNEXPLAINED; v++)
        if (!strcmp(cls, verdict_names[v])) return (moe_verdict)v;
    return MOE_VERDICT_UNEXPLAINED;
}

static double median_of(double *v, int64_t n) {
    if (n <= 0) return 0;
    qsort(v, (size_t)n, sizeof *v, cmp_double);
    return v[n / 2];
}

/* The voting non-OK finding of highest confidence, then specificity, then
 * earliest stage; else OK when the output stage voted OK; else UNEXPLAINED. */
static void decide(moe_diagnosis *g) {
    int win = -1;
    for (int i = 0; i < g->n_findings; i++) {
        const moe_finding *f = &g->findings[i];
        if (!f->votes || specificity(f->cls) == 0) continue;
        if (win < 0) { win = i; continue; }
        const moe_finding *w = &g->findings[win];
        if (f->conf > w->conf || (f->conf == w->conf && specificity(f->cls) > specificity(w->cls))) win = i;
    }
    int ok = -1;
    for (int i = 0; i < g->n_findings; i++)
        if (g->findings[i].votes && g->findings[i].stage == MOE_STAGE_OUTPUT && !strcmp(g->findings[i].cls, "OK")) ok = i;
    char checked[96] = "";
    for (int s = 0; s < MOE_STAGE_COUNT; s++)
        if (g->stages[s].checked) {
            size_t len = strlen(checked);
            snprintf(checked + len, sizeof checked - len, "%s%s", len ? ", " : "", stage_names[s]);
        }
    if (win >= 0) {
        const moe_finding *f = &g->findings[win];
        g->verdict = verdict_of(f->cls);
        g->confidence = f->conf;
        snprintf(g->sentence, sizeof g->sentence, "layer %d: %s: %s (%s evidence from the %s stage; stages checked: %s).",
                 g->layer, f->cls, f->detail, moe_confidence_name(f->conf), f->stage_name, checked);
    } else if (ok >= 0) {
        g->verdict = MOE_VERDICT_OK;
        g->confidence = g->findings[ok].conf;
        snprintf(g->sentence, sizeof g->sentence, "layer %d: OK: the scaling contract holds (routed x %.4g, shared x %.4g); "
                 "differences are %s-level noise%s%s (stages checked: %s).", g->layer, g->fit_a, g->fit_b,
                 g->noise ? g->noise : "?", g->near_tie_flips + g->flips_resolved > 0 ? "; near-tie flips: " : "",
                 g->near_tie_flips + g->flips_resolved > 0 ? "counted in the findings" : "", checked);
    } else {
        g->verdict = MOE_VERDICT_UNEXPLAINED;
        g->confidence = MOE_CONF_NONE;
        snprintf(g->sentence, sizeof g->sentence, "layer %d: UNEXPLAINED: not enough evidence: no stage could vote "
                 "(stages checked: %s).", g->layer, checked[0] ? checked : "none");
    }
}

moe_status moe_diagnose(const moe_layer *L, const moe_dump *d, moe_diagnosis *g, moe_error *err) {
    memset(g, 0, sizeof *g);
    const moe_block_config *c = &L->cfg;
    g->layer = L->index;
    g->s = c->scaling;
    g->tokens = d->T;
    if (d->H != c->hidden) return moe_errf(err, MOE_ERR_SHAPE, "dump hidden size %d != layer %d's %d", d->H, L->index, c->hidden);
    if (d->E != c->n_experts)
        return moe_errf(err, MOE_ERR_SHAPE, "dump loaded for %d experts; layer %d has %d", d->E, L->index, c->n_experts);
    if (c->kind == MOE_LAYER_HASH && !d->input_ids)
        return moe_errf(err, MOE_ERR_INPUT, "layer %d is hash-routed: the dump needs input_ids", L->index);
    diag x;
    memset(&x, 0, sizeof x);
    x.L = L;
    x.d = d;
    x.g = g;
    x.E = c->n_experts;
    x.K = c->top_k;
    x.H = c->hidden;
    x.T = d->T;
    x.s = c->scaling;
    x.sel_winner = x.w_winner = -1;
    moe_status st = diag_hypos_run(L, d, &x.hs, err);
    if (st != MOE_OK) return st;
    x.S = c->shared_inter > 0 ? x.hs.h[0].out.shared_out : NULL;
    x.tol = moe_malloc((size_t)x.T, sizeof *x.tol);
    double *pb = moe_malloc((size_t)x.E + (size_t)x.T, sizeof *pb);
    if (!x.tol || !pb) { st = moe_errf(err, MOE_ERR_NOMEM, "out of memory"); goto done; }
    /* invariant 2 of diagnose_hypo.c: the flip search's weights are the block's */
    for (int i = 0; i < x.hs.n; i++) {
        const diag_hypo *h = &x.hs.h[i];
        double w[1024];
        MOE_ASSERT(x.K <= 1024);
        for (int64_t t = 0; t < x.T; t++) {
            diag_set_weights(h, h->out.router_logits + t * x.E, h->out.topk_ids + t * h->out.n_cols, x.K, w, pb);
            for (int j = 0; j < x.K; j++) {
                double want = h->out.topk_weights[t * h->out.n_cols + j];
                MOE_ASSERT(!isfinite(want) || fabs(w[j] - want) <= 1e-12 * fmax(fabs(want), 1e-300));
            }
        }
    }
    stage_router(&x, pb);
    memcpy(pb, x.tol, (size_t)x.T * sizeof *pb);
    g->tie_tolerance = median_of(pb, x.T);
    stage_selection(&x, pb);
    stage_weights(&x);
    st = stage_output(&x, err);
    if (st != MOE_OK) goto done;
    memcpy(pb, x.tol, (size_t)x.T * sizeof *pb);
    g->tie_tolerance = median_of(pb, x.T);
    if (x.escalated) {
        char det[320];
        snprintf(det, sizeof det, "tie margins widened to a bf16 router's (median %.3g): at float32 margins tokens were "
                 "left unexplained", g->tie_tolerance);
        add_finding(g, MOE_STAGE_ROUTER, "INFO", MOE_CONF_WEAK, false, x.T, det, "");
    }
    decide(g);
done:
    free(x.tol);
    free(pb);
    diag_hypos_free(&x.hs);
    return st;
}
