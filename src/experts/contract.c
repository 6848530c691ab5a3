/*
 * The routed-scaling contract, in one place (docs/semantics.md section 2,
 * docs/contract.md): who multiplies by routed_scaling_factor, as data that
 * the router (router_mult, fused_shared_w) and the combine (runner_mult,
 * output_mult) both read, and the check that a block's outputs keep it.
 *
 * Invariants:
 *  1. For every owner, router_mult * runner_mult * output_mult == s: the
 *     routed branch is scaled exactly once.
 *  2. The effective weight of the shared branch is 1: unfused it is added
 *     unweighted; fused its column weight times runner_mult is 1.
 *  3. OUTPUT ownership cannot carry a fused shared column (the output stage
 *     would scale the shared expert too), so it is refused.
 *  4. Only a moe_variant's fault changes the multipliers (test dumps of each
 *     failure class); production runs pass none.
 */
#include "experts/experts.h"
#include "core/core.h"
#include "router/router.h"

#include <float.h>
#include <math.h>

#include <string.h>

static const char *const owner_names[] = {"router", "runner", "output"};

const char *moe_scale_owner_name(moe_scale_owner o) {
    return (unsigned)o < 3 ? owner_names[o] : "?";
}

bool moe_scale_owner_parse(const char *s, moe_scale_owner *o) {
    for (int i = 0; i < 3; i++) {
        if (strcmp(s, owner_names[i]) == 0) { *o = (moe_scale_owner)i; return true; }
    }
    return false;
}

moe_status moe_contract_for(moe_scale_owner o, bool fuse_shared, double s, moe_contract *c,
                            moe_error *err) {
    c->router_mult = c->runner_mult = c->output_mult = 1.0;
    c->fused_shared_w = 1.0;
    switch (o) {
    case MOE_SCALE_ROUTER:
        c->router_mult = s;
        break;
    case MOE_SCALE_RUNNER:
        c->runner_mult = s;
        c->fused_shared_w = 1.0 / s; /* the runner scales every column, shared included */
        break;
    case MOE_SCALE_OUTPUT:
        if (fuse_shared)
            return moe_errf(err, MOE_ERR_ARG,
                            "scale owner 'output' cannot be combined with fused shared experts: "
                            "the output stage would scale the shared column too");
        c->output_mult = s;
        break;
    default:
        return moe_errf(err, MOE_ERR_ARG, "unknown scale owner %d", (int)o);
    }
    return MOE_OK;
}

moe_status moe_contract_applied(moe_scale_owner owner, bool fused, double s, const moe_variant *v, moe_contract *c,
                                moe_error *err) {
    moe_status st = moe_contract_for(owner, fused, s, c, err);
    if (st != MOE_OK) return st;
    switch (v ? v->fault : MOE_FAULT_NONE) {
    case MOE_FAULT_SCALE_DOUBLE:
        if (owner == MOE_SCALE_ROUTER) c->runner_mult = s;
        else if (owner == MOE_SCALE_RUNNER) c->output_mult = s;
        else c->router_mult = s;
        break;
    case MOE_FAULT_SCALE_MISSING:
        c->router_mult = c->runner_mult = c->output_mult = 1.0;
        break;
    case MOE_FAULT_SHARED_WEIGHT:
        if (!fused)
            return moe_errf(err, MOE_ERR_ARG, "the SHARED_WEIGHT fault needs fused shared experts");
        c->fused_shared_w = owner == MOE_SCALE_RUNNER ? 1.0 : 1.0 / s;
        break;
    default:
        break;
    }
    return MOE_OK;
}

moe_status moe_contract_check(const moe_block_config *c, int index, const moe_block_out *out, bool f32,
                              const moe_variant *v, moe_error *err) {
    int score_override = v ? v->score_override : -1;
    double renorm_eps = v ? v->renorm_eps : MOE_RENORM_EPS;
    int E = c->n_experts, K = c->top_k, H = c->hidden, C = out->n_cols;
    double s = c->scaling;
    /* Tolerances: the reference rounds each weight a handful of times in
     * float64 (eps 1.1e-16); the f32 path rounds emitted weights and the
     * combine to float (eps 6e-8) a few times per step. */
    double tol = f32 ? 1e-5 : 1e-12;
    /* An absolute floor under the relative tolerance: the f32 path stores
     * weights as floats, and a weight below float's smallest normal 2^-126
     * (1.2e-38) keeps only a subnormal's few bits or underflows to 0 (found
     * by fuzz-input: s * w = 1.9e-150 emitted as 0, fuzz/regress-input/
     * f32-weight-underflow). That is float rounding, not a broken contract;
     * float64 keeps its own floor far below any weight that matters. */
    double floor_abs = f32 ? 0x1p-125 : 1e-300;
    /* The same for the outputs: where routed_out and shared_out are
     * subnormal floats (|x| < 2^-126), float's spacing is 2^-149 absolute
     * and the relative tol means nothing; the combine rounds each of its at
     * most four steps to float (up to half that spacing each) and multiplies
     * by runner_mult and output_mult (at most max(s, 1)): 8 * max(s, 1) *
     * 2^-149 bounds it (found by fuzz-input: moe_out = -2 * 2^-149 against
     * routed_out + shared_out = -2^-149, fuzz/regress-input/
     * f32-subnormal-outputs-check). A contract broken by a factor s != 1 on
     * any output above 2^-140 still fails. */
    double floor_out = f32 ? 0x1p-146 * fmax(s, 1.0) : 1e-300;
    double *p = moe_malloc((size_t)E, sizeof *p);
    if (!p) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    moe_status st = MOE_OK;
    for (int64_t t = 0; t < out->T && st == MOE_OK; t++) {
        const double *lg = out->router_logits + t * E;
        bool finite = true;
        for (int e = 0; e < E; e++) finite = finite && isfinite(lg[e]);
        if (!finite) continue; /* a NaN token's weights are NaN by definition */
        moe_router_scores(score_override >= 0 ? (moe_score_func)score_override : c->score, E, lg, p);
        const int32_t *id = out->topk_ids + t * C;
        const double *ew = out->eff_weights + t * C;
        double sum = 0.0, esum = 0.0;
        for (int j = 0; j < K; j++) sum += p[id[j]];
        for (int j = 0; j < K; j++) {
            double want = s * (c->renormalize ? p[id[j]] / (sum + renorm_eps) : p[id[j]]);
            esum += ew[j];
            if (!(fabs(ew[j] - want) <= tol * fabs(want) + floor_abs)) {
                st = moe_errf(err, MOE_ERR_INVARIANT,
                              "layer %d token %lld column %d (expert %d): effective routed weight %.17g, "
                              "expected s * w = %.17g (s = %g): the factor is applied %s",
                              index, (long long)t, j, id[j], ew[j], want, s,
                              fabs(ew[j] - s * want) <= tol * fabs(s * want) ? "twice"
                              : fabs(ew[j] * s - want) <= tol * fabs(want) ? "never" : "wrongly");
                break;
            }
        }
        if (st != MOE_OK) break;
        /* renormalized weights sum to sum / (sum + eps): s to within tol
         * unless the selected scores are as small as eps (logits near -800
         * underflow every score to 0: the weights, and the routed branch,
         * are then 0 by the definition; moe_block_vanishing reports them) */
        double want_sum = c->renormalize ? s * (sum / (sum + renorm_eps)) : esum;
        if (c->renormalize && !(fabs(esum - want_sum) <= tol * s * K)) {
            st = moe_errf(err, MOE_ERR_INVARIANT,
                          "layer %d token %lld: effective routed weights sum to %.17g, not s * sum / (sum + eps) = %.17g "
                          "(s = %g)", index, (long long)t, esum, want_sum, s);
            break;
        }
        for (int j = K; j < C; j++)
            if (!(fabs(ew[j] - 1.0) <= tol)) {
                st = moe_errf(err, MOE_ERR_INVARIANT,
                              "layer %d token %lld: effective shared-expert weight is %.17g, not 1", index,
                              (long long)t, ew[j]);
                break;
            }
        if (st != MOE_OK) break;
        const double *ro = out->routed_out + t * H, *so = out->shared_out + t * H, *mo = out->moe_out + t * H;
        double mag = 0.0;
        for (int h = 0; h < H; h++) mag = fmax(mag, fabs(ro[h]) + fabs(so[h]));
        for (int h = 0; h < H; h++) {
            /* finite logits can still overflow the experts (hidden values
             * near 1e30): NaN = NaN + x is the identity holding, not a
             * broken contract (fuzz/regress-input/overflow-nan-outputs-check) */
            double want = ro[h] + so[h];
            if (isnan(want) && isnan(mo[h])) continue;
            if (f32 && isinf(mo[h]) && fabs(want) > FLT_MAX && signbit(mo[h]) == signbit(want)) continue; /* float overflow */
            if (!(fabs(mo[h] - want) <= tol * mag + floor_out) && mo[h] != want) {
                st = moe_errf(err, MOE_ERR_INVARIANT,
                              "layer %d token %lld: moe_out[%d] = %.17g is not routed_out + shared_out = %.17g",
                              index, (long long)t, h, mo[h], ro[h] + so[h]);
                break;
            }
        }
    }
    free(p);
    return st;
}

int64_t moe_block_vanishing(const moe_layer *L, const moe_block_out *out, int64_t *first) {
    MOE_ASSERT(L && out);
    const moe_block_config *c = &L->cfg;
    if (first) *first = -1;
    if (!c->renormalize) return 0;
    int E = c->n_experts, K = c->top_k, C = out->n_cols;
    double *p = moe_malloc((size_t)E, sizeof *p);
    if (!p) return -1;
    int64_t n = 0;
    for (int64_t t = 0; t < out->T; t++) {
        moe_router_scores(c->score, E, out->router_logits + t * E, p);
        double sum = 0.0;
        for (int j = 0; j < K; j++) {
            int32_t id = out->topk_ids[t * C + j];
            if (id >= 0 && id < E) sum += p[id];
        }
        if (sum < MOE_VANISH_SUM) { /* NaN sums are NaN tokens, not vanishing ones */
            if (n == 0 && first) *first = t;
            n++;
        }
    }
    free(p);
    return n;
}
