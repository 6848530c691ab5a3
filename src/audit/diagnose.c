/*
 * Diagnose another engine's dump of one MoE layer against the float64
 * reference: which contract (SEMANTICS.md section 2) it breaks.
 *
 * Method. Routing hypotheses h (the correct one, weights not renormalized,
 * weights from biased scores, selection without the bias, HF's 0.0 group
 * mask, each other scoring function) are each run through the reference
 * block, giving a unit-scale routed branch R_h (sum of weights 1 where the
 * model renormalizes) and the shared branch S. For each h the dump's moe_out
 * M is fitted by least squares, M ~ a R_h + b S, over the tokens whose
 * expert sets agree with h (all tokens when the dump has no ids). The best
 * hypothesis names the routing class; a and b name the scaling class
 * (a = s correct, s^2 twice, 1 never; b = 1 correct); the residual says
 * whether what is left is arithmetic noise (float32, bf16, fp8, fp4) or not.
 *
 * Invariants:
 *  1. Nothing here re-implements the block: every hypothesis is a
 *     moe_block_run_variant with a toggle or fault of moe_variant.
 *  2. Tokens with a non-finite dump or reference value are left out of every
 *     fit and counted.
 */
#include "core/core.h"
#include "moeaudit_variant.h"
#include "router/router.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>

static const char *const verdict_names[] = {"OK", "SCALE_DOUBLE", "SCALE_MISSING", "SHARED_WEIGHT",
                                            "NOT_RENORMALIZED", "BIASED_WEIGHTS", "WRONG_SCORE", "SELECTION",
                                            "UNEXPLAINED"};

const char *moe_verdict_name(moe_verdict v) { return (unsigned)v <= MOE_VERDICT_UNEXPLAINED ? verdict_names[v] : "?"; }

/* ------------------------------------------------------------ dump load */

void moe_dump_free(moe_dump *d) {
    if (!d) return;
    free(d->hidden); free(d->moe_out); free(d->input_ids); free(d->router_logits);
    free(d->topk_ids); free(d->topk_weights); free(d->routed_out); free(d->shared_out);
    memset(d, 0, sizeof *d);
}

static moe_status load_float(moe_st_file *f, const char *path, const char *name, int64_t rows, int64_t cols,
                             bool required, double **out, moe_error *err) {
    const moe_st_tensor *t = moe_st_find(f, name);
    *out = NULL;
    if (!t) return required ? moe_errf(err, MOE_ERR_MISSING, "%s: dump has no tensor \"%s\"", path, name) : MOE_OK;
    if (!moe_dtype_is_float(t->dtype))
        return moe_errf(err, MOE_ERR_DTYPE, "%s: tensor %s has dtype %s; expected a float type", path, name,
                        moe_dtype_name(t->dtype));
    if (t->ndim != 2 || t->shape[0] != rows || (cols > 0 && t->shape[1] != cols))
        return moe_errf(err, MOE_ERR_SHAPE, "%s: tensor %s must have shape [%lld, %lld]", path, name,
                        (long long)rows, (long long)cols);
    int64_t n = t->shape[0] * t->shape[1];
    double *v = moe_malloc((size_t)n, sizeof *v);
    if (!v) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < n; i++) v[i] = moe_load_f64(t->data, t->dtype, (size_t)i);
    *out = v;
    return MOE_OK;
}

moe_status moe_dump_load(const char *path, int H, int E, moe_dump *d, moe_error *err) {
    memset(d, 0, sizeof *d);
    moe_st_file *f = NULL;
    moe_status st = moe_st_open(path, &f, err);
    if (st != MOE_OK) return st;
    const moe_st_tensor *h = moe_st_find(f, "hidden");
    if (!h || h->ndim != 2) {
        moe_st_close(f);
        return moe_errf(err, h ? MOE_ERR_SHAPE : MOE_ERR_MISSING, "%s: dump needs tensor \"hidden\" [T, %d]", path, H);
    }
    d->T = h->shape[0];
    d->H = H;
    d->E = E;
    int64_t T = d->T;
    if (T == 0) { moe_st_close(f); return moe_errf(err, MOE_ERR_INPUT, "%s: tensor hidden has 0 tokens", path); }
    st = load_float(f, path, "hidden", T, H, true, &d->hidden, err);
    if (st == MOE_OK) st = load_float(f, path, "moe_out", T, H, true, &d->moe_out, err);
    if (st == MOE_OK) st = load_float(f, path, "router_logits", T, E, false, &d->router_logits, err);
    if (st == MOE_OK) st = load_float(f, path, "routed_out", T, H, false, &d->routed_out, err);
    if (st == MOE_OK) st = load_float(f, path, "shared_out", T, H, false, &d->shared_out, err);
    const moe_st_tensor *ids = moe_st_find(f, "topk_ids");
    if (st == MOE_OK && ids) {
        if (!moe_dtype_is_int(ids->dtype) || ids->ndim != 2 || ids->shape[0] != T || ids->shape[1] < 1 ||
            ids->shape[1] > 1024)
            st = moe_errf(err, MOE_ERR_SHAPE, "%s: tensor topk_ids must be an integer tensor [%lld, K]", path,
                          (long long)T);
        else {
            d->n_cols = (int)ids->shape[1];
            d->topk_ids = moe_malloc((size_t)(T * d->n_cols), sizeof(int32_t));
            if (!d->topk_ids) st = moe_errf(err, MOE_ERR_NOMEM, "out of memory");
            for (int64_t i = 0; st == MOE_OK && i < T * d->n_cols; i++) {
                int64_t v = moe_load_i64(ids->data, ids->dtype, (size_t)i);
                if (v < 0 || v > (int64_t)E + 64)
                    st = moe_errf(err, MOE_ERR_INPUT, "%s: topk_ids[%lld][%lld] = %lld is not an expert id (E = %d)",
                                  path, (long long)(i / d->n_cols), (long long)(i % d->n_cols), (long long)v, E);
                else d->topk_ids[i] = (int32_t)v;
            }
        }
        if (st == MOE_OK) st = load_float(f, path, "topk_weights", T, d->n_cols, false, &d->topk_weights, err);
    } else if (st == MOE_OK && moe_st_find(f, "topk_weights")) {
        st = moe_errf(err, MOE_ERR_MISSING, "%s: topk_weights without topk_ids cannot be aligned to experts", path);
    }
    const moe_st_tensor *ti = moe_st_find(f, "input_ids");
    if (st == MOE_OK && ti) {
        if (!moe_dtype_is_int(ti->dtype) || ti->ndim != 1 || ti->shape[0] != T)
            st = moe_errf(err, MOE_ERR_SHAPE, "%s: tensor input_ids must be an integer tensor [%lld]", path, (long long)T);
        else {
            d->input_ids = moe_malloc((size_t)T, sizeof(int64_t));
            if (!d->input_ids) st = moe_errf(err, MOE_ERR_NOMEM, "out of memory");
            for (int64_t t = 0; st == MOE_OK && t < T; t++) d->input_ids[t] = moe_load_i64(ti->data, ti->dtype, (size_t)t);
        }
    }
    moe_st_close(f);
    if (st != MOE_OK) moe_dump_free(d);
    return st;
}

/* ------------------------------------------------------------ hypotheses */

typedef struct hypo {
    const char *name;      /* shown in findings */
    moe_verdict cls;       /* verdict when this hypothesis wins */
    moe_run_opts o;
    moe_variant v;         /* the hypothesis's fault or toggle */
    moe_block_out out;     /* reference run under the hypothesis */
    bool ran;
    int64_t agree;         /* tokens whose set equals the dump's */
    double a, b, res;      /* fit */
    int64_t used;
} hypo;

static void add_finding(moe_diagnosis *g, const char *stage, const char *cls, const char *detail,
                        const char *evidence) {
    if (g->n_findings >= MOE_DIAG_MAX_FINDINGS) return;
    moe_finding *f = &g->findings[g->n_findings++];
    snprintf(f->stage, sizeof f->stage, "%s", stage);
    snprintf(f->cls, sizeof f->cls, "%s", cls);
    snprintf(f->detail, sizeof f->detail, "%s", detail);
    snprintf(f->evidence, sizeof f->evidence, "%s", evidence);
}

/* Does token t's routed set in the dump equal `ids` (K routed ids)? */
static bool same_set(const moe_dump *d, int64_t t, const int32_t *ids, int K, int E) {
    int matched = 0, routed = 0;
    for (int c = 0; c < d->n_cols; c++) {
        int32_t v = d->topk_ids[t * d->n_cols + c];
        if (v >= E) continue;
        routed++;
        for (int j = 0; j < K; j++) if (ids[j] == v) { matched++; break; }
    }
    return routed == K && matched == K;
}

static bool token_finite(const double *v, int64_t n) {
    for (int64_t i = 0; i < n; i++) if (!isfinite(v[i])) return false;
    return true;
}

/* Least squares M ~ a R + b S over the tokens in `use`. With no shared
 * branch b is 0 and only a is fitted. */
static void fit(const moe_dump *d, const double *R, const double *S, const unsigned char *use, double *a,
                double *b, double *res, int64_t *used) {
    int H = d->H;
    double rr = 0, rs = 0, ss = 0, rm = 0, sm = 0, mm = 0;
    int64_t n = 0;
    for (int64_t t = 0; t < d->T; t++) {
        if (!use[t]) continue;
        n++;
        for (int h = 0; h < H; h++) {
            double r = R[t * H + h], s = S ? S[t * H + h] : 0, m = d->moe_out[t * H + h];
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

/* Noise classes by relative residual. Bounds measured on the library's own
 * paths (tests/test-diagnose.c prints them): outputs rounded to bf16 leave
 * ~1e-3, bf16 activations ~3e-3, FP8 activations or weights ~3e-2, FP4
 * weights ~0.1 (RMS); each bound is about 3x above what its class produced. */
static const struct { const char *name; double bound; } noise_classes[] = {
    {"float32", 1e-5}, {"bf16", 1.5e-2}, {"fp8", 8e-2}, {"fp4", 0.3}};

static const char *noise_of(double res) {
    for (size_t i = 0; i < sizeof noise_classes / sizeof noise_classes[0]; i++)
        if (res <= noise_classes[i].bound) return noise_classes[i].name;
    return NULL;
}

static bool near(double x, double want, double tol) { return fabs(x - want) <= tol * fmax(fabs(want), 1e-12); }

moe_status moe_diagnose(const moe_layer *L, const moe_dump *d, moe_diagnosis *g, moe_error *err) {
    memset(g, 0, sizeof *g);
    const moe_block_config *c = &L->cfg;
    int E = c->n_experts, K = c->top_k, H = c->hidden;
    int64_t T = d->T;
    double s = c->scaling;
    g->layer = L->index;
    g->s = s;
    g->tokens = T;
    if (d->H != H) return moe_errf(err, MOE_ERR_SHAPE, "dump hidden size %d != layer's %d", d->H, H);
    if (c->kind == MOE_LAYER_HASH && !d->input_ids)
        return moe_errf(err, MOE_ERR_INPUT, "layer %d is hash-routed: the dump needs input_ids", L->index);

    /* the hypotheses that apply to this layer */
    hypo hy[8];
    int nh = 0;
    moe_run_opts base = moe_run_opts_default();
    base.owner = MOE_SCALE_OUTPUT; /* routed_out = s * unit; unit = routed_out / s */
    moe_variant spec = moe_variant_none();
    hy[nh++] = (hypo){.name = "as specified", .cls = MOE_VERDICT_OK, .o = base, .v = spec};
    if (c->renormalize) {
        hy[nh] = (hypo){.name = "weights not renormalized", .cls = MOE_VERDICT_NOT_RENORMALIZED, .o = base, .v = spec};
        hy[nh++].v.fault = MOE_FAULT_NOT_RENORMALIZED;
    }
    if (L->bias) {
        hy[nh] = (hypo){.name = "weights gathered from biased scores", .cls = MOE_VERDICT_BIASED_WEIGHTS, .o = base, .v = spec};
        hy[nh++].v.fault = MOE_FAULT_BIASED_WEIGHTS;
        hy[nh] = (hypo){.name = "experts selected without the correction bias", .cls = MOE_VERDICT_SELECTION, .o = base, .v = spec};
        hy[nh++].v.ignore_bias = true;
    }
    if (c->kind == MOE_LAYER_TOPK && c->n_group > 1 && c->topk_group < c->n_group) {
        hy[nh] = (hypo){.name = "dropped groups masked with 0.0 instead of -inf", .cls = MOE_VERDICT_SELECTION, .o = base, .v = spec};
        hy[nh++].v.group_mask_zero = true;
    }
    static const char *const score_names[] = {"softmax", "sigmoid", "sqrtsoftplus"};
    static char score_hyp[3][64];
    for (int sf = 0; sf < 3; sf++) {
        if (sf == (int)c->score) continue;
        snprintf(score_hyp[sf], sizeof score_hyp[sf], "%s scores instead of %s", score_names[sf], score_names[c->score]);
        hy[nh] = (hypo){.name = score_hyp[sf], .cls = MOE_VERDICT_WRONG_SCORE, .o = base, .v = spec};
        hy[nh++].v.score_override = sf;
    }

    moe_status st = MOE_OK;
    unsigned char *use = moe_calloc((size_t)T, 1);
    double *R = moe_malloc((size_t)(T * H), sizeof *R);
    if (!use || !R) { st = moe_errf(err, MOE_ERR_NOMEM, "out of memory"); goto done; }
    for (int i = 0; i < nh && st == MOE_OK; i++) {
        st = moe_block_out_init(&hy[i].out, L, T, &hy[i].o, err);
        if (st == MOE_OK) st = moe_block_run_variant(L, d->hidden, d->input_ids, T, &hy[i].o, &hy[i].v, &hy[i].out, err);
        hy[i].ran = st == MOE_OK;
    }
    if (st != MOE_OK) goto done;
    const double *S = L->cfg.shared_inter > 0 ? hy[0].out.shared_out : NULL;

    /* selection: agreement of each hypothesis with the dump's ids */
    int best_sel = 0;
    if (d->topk_ids) {
        for (int i = 0; i < nh; i++) {
            for (int64_t t = 0; t < T; t++)
                hy[i].agree += same_set(d, t, hy[i].out.topk_ids + t * hy[i].out.n_cols, K, E);
            if (hy[i].agree > hy[best_sel].agree) best_sel = i;
        }
        g->selection_mismatch = T - hy[0].agree;
    }

    /* near-tie flips: a mismatch whose reference margin between the K-th
     * and (K+1)-th biased score is within what the dump's router precision
     * moves scores (from its logits when given, else bf16's 2^-8). */
    double tie_tol = 0x1p-8;
    if (d->router_logits) {
        double e = 0, m = 0;
        for (int64_t i = 0; i < T * E; i++)
            if (isfinite(d->router_logits[i]) && isfinite(hy[0].out.router_logits[i])) {
                e = fmax(e, fabs(d->router_logits[i] - hy[0].out.router_logits[i]));
                m = fmax(m, fabs(hy[0].out.router_logits[i]));
            }
        double rel = m > 0 ? e / m : e;
        tie_tol = fmax(4 * e, 1e-12);
        char det[320], ev[320];
        snprintf(det, sizeof det, "router logits differ from float64 by %.3g relative (%s)", rel,
                 rel < 1e-12 ? "float64" : rel < 1e-6 ? "float32 level" : rel < 2e-2 ? "bf16 level" : "beyond bf16");
        snprintf(ev, sizeof ev, "max |dump - ref| = %.3g over %lld x %d logits", e, (long long)T, E);
        add_finding(g, "router", rel < 2e-2 ? "INFO" : "NOISE", det, ev);
    }
    if (d->topk_ids && g->selection_mismatch > 0 && c->kind == MOE_LAYER_TOPK) {
        double *p = moe_malloc((size_t)E, sizeof *p);
        for (int64_t t = 0; p && t < T; t++) {
            const int32_t *ids = hy[0].out.topk_ids + t * hy[0].out.n_cols;
            if (same_set(d, t, ids, K, E)) continue;
            moe_router_scores(c->score, E, hy[0].out.router_logits + t * E, p);
            double kth = INFINITY, next = -INFINITY;
            for (int j = 0; j < K; j++) kth = fmin(kth, p[ids[j]] + (L->bias ? L->bias[ids[j]] : 0));
            for (int e = 0; e < E; e++) {
                bool in = false;
                for (int j = 0; j < K; j++) in |= ids[j] == e;
                if (!in) next = fmax(next, p[e] + (L->bias ? L->bias[e] : 0));
            }
            if (kth - next <= tie_tol * fmax(1.0, fabs(kth))) g->near_tie_flips++;
        }
        free(p);
    }

    /* output fits per hypothesis, on tokens that agree with it */
    int best = 0;
    for (int i = 0; i < nh; i++) {
        const moe_block_out *o = &hy[i].out;
        for (int64_t t = 0; t < T * H; t++) R[t] = o->routed_out[t] / s;
        for (int64_t t = 0; t < T; t++) {
            bool ok = token_finite(d->moe_out + t * H, H) && token_finite(R + t * H, H) &&
                      (!S || token_finite(S + t * H, H));
            if (ok && d->topk_ids) ok = same_set(d, t, o->topk_ids + t * o->n_cols, K, E);
            use[t] = ok;
        }
        fit(d, R, S, use, &hy[i].a, &hy[i].b, &hy[i].res, &hy[i].used);
        /* a hypothesis must explain most tokens to compete */
        if (hy[i].used * 2 < T) hy[i].res = INFINITY;
        if (hy[i].res < hy[best].res) best = i;
    }
    /* prefer the specified routing unless another fits clearly better */
    if (best != 0 && !(hy[best].res < 0.5 * hy[0].res)) best = 0;
    hypo *bh = &hy[best];
    g->fit_a = bh->a;
    g->fit_b = bh->b;
    g->residual = bh->res;
    g->tokens_used = bh->used;
    g->hypothesis = bh->name;
    g->noise = noise_of(bh->res);

    char det[320], ev[320];
    /* selection finding */
    if (d->topk_ids) {
        int64_t hard = g->selection_mismatch - g->near_tie_flips;
        if (g->selection_mismatch == 0) {
            snprintf(det, sizeof det, "all %lld tokens chose the reference experts", (long long)T);
            add_finding(g, "selection", "OK", det, "");
        } else if (hard <= 0) {
            snprintf(det, sizeof det, "%lld of %lld tokens chose other experts, all at near-ties of the reference",
                     (long long)g->selection_mismatch, (long long)T);
            snprintf(ev, sizeof ev, "tie tolerance %.3g on the biased scores", tie_tol);
            add_finding(g, "selection", "NOISE", det, ev);
        } else {
            hypo *sh = &hy[best_sel];
            if (best_sel != 0 && sh->agree > hy[0].agree && (sh->cls == MOE_VERDICT_SELECTION || sh->cls == MOE_VERDICT_WRONG_SCORE)) {
                snprintf(det, sizeof det, "expert sets match the reference on %lld of %lld tokens; %s matches %lld",
                         (long long)hy[0].agree, (long long)T, sh->name, (long long)sh->agree);
                add_finding(g, "selection", moe_verdict_name(sh->cls), det, "");
            } else {
                snprintf(det, sizeof det, "expert sets differ on %lld of %lld tokens beyond near-ties; no known variant "
                         "explains them", (long long)hard, (long long)T);
                add_finding(g, "selection", "SELECTION", det, c->kind == MOE_LAYER_HASH ? "hash layer: check tid2eid and input_ids" : "");
            }
        }
    }
    /* weights finding: dump weights against c x (hypothesis weights) */
    if (d->topk_weights) {
        double best_err = INFINITY, best_c = 0;
        int best_h = 0;
        double cands[3] = {1.0, s, s * s};
        double fused_w = NAN;
        for (int i = 0; i < nh; i++) {
            const moe_block_out *o = &hy[i].out;
            for (int ci = 0; ci < 3; ci++) {
                double worst = 0;
                int64_t n = 0;
                for (int64_t t = 0; t < T; t++) {
                    const int32_t *ids = o->topk_ids + t * o->n_cols;
                    if (!same_set(d, t, ids, K, E)) continue;
                    for (int cc = 0; cc < d->n_cols; cc++) {
                        int32_t v = d->topk_ids[t * d->n_cols + cc];
                        double w = d->topk_weights[t * d->n_cols + cc];
                        if (v >= E) { fused_w = w; continue; }
                        for (int j = 0; j < K; j++)
                            if (ids[j] == v) {
                                /* OUTPUT-owner runs emit unscaled weights */
                                double want = cands[ci] * o->topk_weights[t * o->n_cols + j];
                                if (isfinite(w) && isfinite(want)) worst = fmax(worst, fabs(w - want) / fmax(fabs(want), 1e-30));
                                n++;
                            }
                    }
                }
                if (n > 0 && worst < best_err) { best_err = worst; best_h = i; best_c = cands[ci]; }
            }
        }
        if (isfinite(best_err)) {
            const char *fold = best_c == 1.0 ? "sum to 1: the factor is left to the runner or the output stage"
                             : best_c == s ? "sum to s: the router folds the factor in"
                                           : "sum to s^2: the router applies the factor twice";
            snprintf(det, sizeof det, "weights match %s (%s); %s", hy[best_h].name,
                     hy[best_h].cls == MOE_VERDICT_OK ? "correct" : moe_verdict_name(hy[best_h].cls), fold);
            snprintf(ev, sizeof ev, "max relative difference %.3g", best_err);
            add_finding(g, "weights", best_err < 0.1 ? moe_verdict_name(hy[best_h].cls) : "UNEXPLAINED", det, ev);
        }
        if (!isnan(fused_w)) {
            snprintf(det, sizeof det, "fused shared column weighted %.6g (1 when the router folds s, 1/s = %.6g "
                     "when the runner multiplies every column)", fused_w, 1 / s);
            add_finding(g, "weights", "INFO", det, "");
        }
    }
    /* output finding */
    snprintf(ev, sizeof ev, "moe_out ~ %.6g * routed + %.6g * shared over %lld tokens, residual %.3g (%s)", bh->a,
             bh->b, (long long)bh->used, bh->res, g->noise ? g->noise : "beyond fp4 noise");
    moe_verdict v = MOE_VERDICT_OK;
    bool scale_ok = near(bh->a, s, 0.08), shared_ok = !S || near(bh->b, 1.0, 0.08);
    if (bh->cls != MOE_VERDICT_OK) {
        v = bh->cls;
        snprintf(det, sizeof det, "outputs fit %s", bh->name);
    } else if (!scale_ok && s != 1.0 && near(bh->a, s * s, 0.08)) {
        v = MOE_VERDICT_SCALE_DOUBLE;
        snprintf(det, sizeof det, "the routed branch is scaled by %.4g = s^2 (s = %g): routed_scaling_factor is applied twice",
                 bh->a, s);
    } else if (!scale_ok && s != 1.0 && near(bh->a, 1.0, 0.08)) {
        v = MOE_VERDICT_SCALE_MISSING;
        snprintf(det, sizeof det, "the routed branch is scaled by %.4g, not s = %g: routed_scaling_factor is never applied",
                 bh->a, s);
    } else if (!shared_ok) {
        v = MOE_VERDICT_SHARED_WEIGHT;
        const char *what = near(bh->b, 1 / s, 0.08) ? " = 1/s (a fused shared column weighted for a runner that does not scale)"
                         : near(bh->b, s, 0.08)     ? " = s (the factor applied to the shared expert too)"
                         : near(bh->b, 2, 0.08)     ? " (the shared expert added twice)"
                         : fabs(bh->b) < 0.08       ? " (the shared expert is missing)" : "";
        snprintf(det, sizeof det, "the shared expert is weighted %.4g%s, not 1", bh->b, what);
    } else if (!scale_ok) {
        v = MOE_VERDICT_UNEXPLAINED;
        snprintf(det, sizeof det, "the routed branch is scaled by %.4g; expected s = %g", bh->a, s);
    } else if (!g->noise) {
        v = MOE_VERDICT_UNEXPLAINED;
        snprintf(det, sizeof det, "scales are right but the residual %.3g exceeds fp4 arithmetic noise", bh->res);
    } else {
        snprintf(det, sizeof det, "routed x %.4g (s = %g) + shared x %.4g; the difference is %s-level arithmetic noise",
                 bh->a, s, bh->b, g->noise);
    }
    /* a selection problem beyond near-ties outranks the output fit */
    if (d->topk_ids && g->selection_mismatch - g->near_tie_flips > 0 && v == MOE_VERDICT_OK) {
        hypo *sh = &hy[best_sel];
        v = best_sel != 0 && sh->agree > hy[0].agree ? sh->cls : MOE_VERDICT_SELECTION;
        if (v == MOE_VERDICT_OK) v = MOE_VERDICT_SELECTION;
    }
    add_finding(g, "output", moe_verdict_name(v), det, ev);
    g->verdict = v;
    if (v == MOE_VERDICT_OK)
        snprintf(g->sentence, sizeof g->sentence, "layer %d: OK: the scaling contract holds (routed x %.4g, shared x %.4g); "
                 "differences are %s-level noise.", L->index, bh->a, bh->b, g->noise);
    else
        snprintf(g->sentence, sizeof g->sentence, "layer %d: %s: %s.", L->index, moe_verdict_name(v),
                 g->findings[g->n_findings - 1].detail);
done:
    for (int i = 0; i < nh; i++) moe_block_out_free(&hy[i].out);
    free(use);
    free(R);
    return st;
}

char *moe_diagnosis_json(const moe_diagnosis *g) {
    cJSON *j = cJSON_CreateObject();
    if (!j) return NULL;
    cJSON_AddStringToObject(j, "verdict", moe_verdict_name(g->verdict));
    cJSON_AddStringToObject(j, "sentence", g->sentence);
    cJSON_AddNumberToObject(j, "layer", g->layer);
    cJSON_AddNumberToObject(j, "routed_scaling_factor", g->s);
    cJSON_AddNumberToObject(j, "tokens", (double)g->tokens);
    cJSON_AddNumberToObject(j, "tokens_fitted", (double)g->tokens_used);
    cJSON_AddNumberToObject(j, "selection_mismatch", (double)g->selection_mismatch);
    cJSON_AddNumberToObject(j, "near_tie_flips", (double)g->near_tie_flips);
    cJSON *fitj = cJSON_AddObjectToObject(j, "fit");
    cJSON_AddNumberToObject(fitj, "a", g->fit_a);
    cJSON_AddNumberToObject(fitj, "b", g->fit_b);
    cJSON_AddNumberToObject(fitj, "expected_a", g->s);
    cJSON_AddNumberToObject(fitj, "expected_b", 1.0);
    cJSON_AddNumberToObject(fitj, "residual", g->residual);
    if (g->noise) cJSON_AddStringToObject(fitj, "noise", g->noise);
    else cJSON_AddNullToObject(fitj, "noise");
    cJSON_AddStringToObject(fitj, "routing_hypothesis", g->hypothesis ? g->hypothesis : "");
    cJSON *fs = cJSON_AddArrayToObject(j, "findings");
    for (int i = 0; i < g->n_findings; i++) {
        cJSON *f = cJSON_CreateObject();
        cJSON_AddStringToObject(f, "stage", g->findings[i].stage);
        cJSON_AddStringToObject(f, "class", g->findings[i].cls);
        cJSON_AddStringToObject(f, "detail", g->findings[i].detail);
        cJSON_AddStringToObject(f, "evidence", g->findings[i].evidence);
        cJSON_AddItemToArray(fs, f);
    }
    char *s = cJSON_Print(j);
    cJSON_Delete(j);
    return s;
}
