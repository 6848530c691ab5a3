/*
 * The audit: price every precision shortcut against the float64 reference.
 *
 * Invariants:
 *  1. The reference is moe_block_run in MOE_PREC_REF on the layer as loaded
 *     (the checkpoint's own weights, usually BF16); every path is the same
 *     block with options changed, on weights quantized in memory from the
 *     same layer. Nothing re-implements the math (docs/architecture.md); a path
 *     with a runner (another device) is graded on the same quantized copy.
 *  2. Quantized copies of a layer are made once per (format, rounding, scale
 *     rule, shared format) and reused by every path that needs them.
 *  3. An ISA row names its ISA in the run options (moe_run_opts.isa): no
 *     global kernel choice is touched, so audits may run concurrently.
 *  4. Every precision path is a list of patches of the one patch table
 *     (moeaudit_patch.h, shared with `bisect`): its settings are what the
 *     table says those patches do to the MoE block, and its row names them.
 */
#include "audit/tolerances.h"
#include "core/core.h"
#include "experts/experts.h"
#include "moeaudit_patch.h"

#include <math.h>
#include <string.h>
#include <time.h>

static const char *const grade_names[] = {"PASS", "MARGINAL", "FAIL"};

const char *moe_grade_name(moe_grade g) { return (unsigned)g < 3 ? grade_names[g] : "?"; }

moe_grade moe_grade_of(double nmse, double flips) {
    double sqnr = nmse > 0 ? -10.0 * log10(nmse) : INFINITY;
    if (isnan(nmse)) return MOE_GRADE_FAIL;
    moe_grade a = sqnr >= MOE_GRADE_PASS_SQNR_DB ? MOE_GRADE_PASS
                : sqnr >= MOE_GRADE_MARGINAL_SQNR_DB ? MOE_GRADE_MARGINAL : MOE_GRADE_FAIL;
    moe_grade b = flips <= MOE_GRADE_PASS_FLIPS ? MOE_GRADE_PASS
                : flips <= MOE_GRADE_MARGINAL_FLIPS ? MOE_GRADE_MARGINAL : MOE_GRADE_FAIL;
    return a > b ? a : b;
}

static moe_audit_path base_path(const char *id, const char *name, const char *group) {
    moe_audit_path p;
    memset(&p, 0, sizeof p);
    snprintf(p.name, sizeof p.name, "%s", name);
    p.id = id;
    p.group = group;
    p.precision = MOE_PREC_F32;
    p.act = MOE_ACT_EXACT;
    p.router = MOE_ROUTER_PATH;
    p.weights = MOE_Q_NONE;
    p.shared = MOE_Q_NONE;
    p.owner = MOE_SCALE_ROUTER;
    return p;
}

/* A path whose precision is a list of patches of the one patch table
 * (moeaudit_patch.h): the MoE block's settings those patches give. */
static moe_audit_path patch_path(const char *id, const char *name, const char *group, const char *patches) {
    moe_audit_path p = base_path(id, name, group);
    snprintf(p.patches, sizeof p.patches, "%s", patches);
    moe_patch_set *s = NULL;
    moe_error err;
    moe_status st = moe_patch_set_parse(patches, NULL, &s, &err);
    MOE_ASSERT(st == MOE_OK); /* the table below names only MoE patches that exist */
    moe_layer_patch lp;
    moe_patch_layer(s, MOE_PATCH_ALL, 0, MOE_PHASE_ALL, &lp);
    moe_patch_set_free(s);
    MOE_ASSERT(lp.moe.fault == MOE_FAULT_NONE);
    p.weights = lp.moe.experts;
    p.shared = lp.moe.shared;
    p.e2m1_round = lp.moe.e2m1_round;
    p.mx_scale_rule = lp.moe.mx_scale_rule;
    p.act = lp.moe.act;
    p.router = lp.moe.router;
    return p;
}

int moe_audit_default_paths(moe_audit_path *ps, int max) {
    moe_audit_path all[40];
    int n = 0;
    /* the f32 path and the contract: every owner and shared mode (the same
     * math: no patch names them) */
    all[n++] = base_path("contract.router", "f32, factor in router", "contract");
    all[n] = base_path("contract.runner", "f32, factor in runner", "contract"); all[n++].owner = MOE_SCALE_RUNNER;
    all[n] = base_path("contract.output", "f32, factor at output", "contract"); all[n++].owner = MOE_SCALE_OUTPUT;
    all[n] = base_path("contract.fused-router", "f32, fused shared (router)", "contract"); all[n++].fuse_shared = true;
    all[n] = base_path("contract.fused-runner", "f32, fused shared (runner)", "contract");
    all[n].fuse_shared = true; all[n++].owner = MOE_SCALE_RUNNER;
    /* kernels */
    all[n] = base_path("isa.ref", "f32, ISA ref", "isa"); all[n++].isa = MOE_ISA_REF;
    all[n] = base_path("isa.avx2", "f32, ISA avx2", "isa"); all[n++].isa = MOE_ISA_AVX2;
    all[n] = base_path("isa.avx512", "f32, ISA avx512", "isa"); all[n++].isa = MOE_ISA_AVX512;
    /* every precision shortcut is a patch list: `moeaudit bisect --patches` takes it as it is */
    static const struct { const char *id, *name, *group, *patches; } pp[] = {
        {"act.bf16", "bf16 activations", "activations", "act-bf16"},
        {"act.fp8", "fp8 activations (pow2 scale)", "activations", "act-fp8"},
        {"act.fp8-f32scale", "fp8 activations (fp32 scale)", "activations", "act-fp8-f32scale"},
        {"router.bf16-input", "router on bf16 input", "router", "router-bf16-input"},
        {"router.bf16-logits", "router in bf16 (logits bf16)", "router", "router-bf16"},
        {"weights.fp8", "fp8 experts (128x128)", "weights", "experts-fp8"},
        {"weights.mxfp4", "mxfp4 experts", "weights", "experts-mxfp4"},
        {"weights.mxfp4-ties-up", "mxfp4 experts, e2m1 ties up", "weights", "experts-mxfp4-ties-up"},
        {"weights.mxfp4-toward-zero", "mxfp4 experts, e2m1 toward zero", "weights", "experts-mxfp4-trunc"},
        {"weights.mxfp4-floor", "mxfp4 experts, floor scale (OCP)", "weights", "experts-mxfp4-floor-scale"},
        {"weights.nvfp4", "nvfp4 experts", "weights", "experts-nvfp4"},
        {"weights.fp8-shared", "fp8 shared expert", "weights", "shared-fp8"},
        {"recipe.v4", "V4 recipe: mxfp4 + fp8 act + fp8 shared", "combined", "experts-mxfp4,act-fp8,shared-fp8"},
        {"recipe.v4-bf16-router", "V4 recipe + bf16 router", "combined",
         "experts-mxfp4,act-fp8,shared-fp8,router-bf16"},
        {"recipe.v3", "V3 recipe: fp8 experts + fp8 act (fp32 scale)", "combined",
         "experts-fp8,act-fp8-f32scale,shared-fp8"},
        {"recipe.nvfp4", "nvfp4 + fp8 act + fp8 shared", "combined", "experts-nvfp4,act-fp8,shared-fp8"},
    };
    for (size_t i = 0; i < sizeof pp / sizeof pp[0]; i++) {
        all[n++] = patch_path(pp[i].id, pp[i].name, pp[i].group, pp[i].patches);
        if (!strcmp(pp[i].id, "act.fp8-f32scale")) {
            /* NVFP4 activations with static input scales (the checkpoint's,
             * or the calibration below): no bisect patch replays them yet,
             * so their rows set the fields and name no patches */
            all[n] = base_path("act.nvfp4", "nvfp4 activations (static input scale)", "activations");
            all[n++].act = MOE_ACT_NVFP4;
        }
    }
    /* W4A4 as TensorRT-LLM / FlashInfer run ModelOpt NVFP4 (one static input
     * scale per expert GEMM for the layer), and as vLLM's CUTLASS MoE does
     * (each expert's own); no patches, as act.nvfp4 */
    all[n] = base_path("recipe.nvfp4-w4a4", "NVFP4 W4A4: nvfp4 experts + shared + act (TRT-LLM)", "combined");
    all[n].weights = MOE_Q_NVFP4; all[n].act = MOE_ACT_NVFP4; all[n++].shared = MOE_Q_NVFP4;
    all[n] = base_path("recipe.nvfp4-w4a4-expert", "NVFP4 W4A4, per-expert input scales (vLLM)", "combined");
    all[n].weights = MOE_Q_NVFP4; all[n].act = MOE_ACT_NVFP4_EXPERT; all[n++].shared = MOE_Q_NVFP4;
    int m = n < max ? n : max;
    memcpy(ps, all, (size_t)m * sizeof *ps);
    return m;
}

/* Harm order: a broken contract first, then FAIL, MARGINAL, PASS, then
 * lower SQNR, then more flips; rows that could not run last. */
int moe_audit_harm_cmp(const moe_audit_row *x, const moe_audit_row *y) {
    bool xb = x->status == MOE_ERR_INVARIANT, yb = y->status == MOE_ERR_INVARIANT;
    bool xn = x->status != MOE_OK && !xb, yn = y->status != MOE_OK && !yb;
    if (xn != yn) return xn ? 1 : -1;
    if (xb != yb) return xb ? -1 : 1;
    if (xn || xb) return 0;
    if (x->grade != y->grade) return (int)y->grade - (int)x->grade;
    double sx = x->nmse, sy = y->nmse; /* higher NMSE = lower SQNR; NaN is the worst */
    if (isnan(sx) != isnan(sy)) return isnan(sx) ? -1 : 1;
    if (sx != sy && !isnan(sx)) return sx > sy ? -1 : 1;
    return x->flips > y->flips ? -1 : x->flips < y->flips ? 1 : 0;
}

moe_grade moe_audit_row_grade(const moe_audit_row *r, bool *ran) {
    if (ran) *ran = r->status == MOE_OK || r->status == MOE_ERR_INVARIANT;
    return r->status == MOE_OK ? r->grade : MOE_GRADE_FAIL;
}

void moe_audit_summarize(const moe_audit_row *rows, int n, moe_audit_summary *s) {
    memset(s, 0, sizeof *s);
    for (int i = 0; i < n; i++) {
        const moe_audit_row *r = &rows[i];
        bool ran;
        moe_grade g = moe_audit_row_grade(r, &ran);
        if (!ran) { s->n_not_run++; continue; }
        if (r->status == MOE_ERR_INVARIANT) s->n_broken++;
        s->n_grade[g]++;
        if (!s->worst || moe_audit_harm_cmp(r, s->worst) < 0) s->worst = r;
    }
}

/* Cache of quantized copies of the layer. */
#define MOE_QCACHE 16
typedef struct qcache {
    moe_quant_opts key[MOE_QCACHE];
    moe_layer *layer[MOE_QCACHE];
    moe_status st[MOE_QCACHE];
    bool used[MOE_QCACHE];
    char msg[MOE_QCACHE][512];
    int n;
} qcache;

static const moe_layer *layer_for(qcache *c, const moe_layer *L, const moe_audit_path *p, moe_status *st,
                                  char *note, size_t note_len) {
    if (p->weights == MOE_Q_NONE && p->shared == MOE_Q_NONE) return L;
    moe_quant_opts q = {p->weights, p->shared, p->e2m1_round, p->mx_scale_rule};
    for (int i = 0; i < c->n; i++)
        if (c->layer[i] && !memcmp(&c->key[i], &q, sizeof q)) {
            *st = c->st[i];
            if (*st != MOE_OK) snprintf(note, note_len, "%s", c->msg[i]);
            return c->layer[i];
        }
    /* experts and shared expert both quantized: reuse the experts-only copy
     * and quantize just the shared expert on top of it */
    const moe_layer *from = L;
    moe_quant_opts step = q;
    if (p->weights != MOE_Q_NONE && p->shared != MOE_Q_NONE) {
        moe_audit_path ex = *p;
        ex.shared = MOE_Q_NONE;
        from = layer_for(c, L, &ex, st, note, note_len);
        if (*st != MOE_OK) return NULL;
        step.experts = MOE_Q_NONE;
    }
    int i = -1;
    for (int k = 0; k < MOE_QCACHE; k++) if (!c->used[k]) { i = k; break; }
    if (i < 0) { *st = MOE_ERR_NOMEM; snprintf(note, note_len, "too many weight variants"); return NULL; }
    moe_error err;
    c->used[i] = true;
    if (i >= c->n) c->n = i + 1;
    c->key[i] = q;
    c->st[i] = moe_layer_quantize(from, &step, &c->layer[i], &err);
    if (c->st[i] != MOE_OK) snprintf(c->msg[i], sizeof c->msg[i], "%s", err.msg);
    *st = c->st[i];
    if (*st != MOE_OK) snprintf(note, note_len, "%s", c->msg[i]);
    return c->layer[i];
}

/* Free cached copies no path from `next` on needs (nor builds on). */
static void qcache_trim(qcache *c, const moe_audit_path *paths, int next, int n) {
    for (int i = 0; i < c->n; i++) {
        if (!c->used[i]) continue;
        bool needed = false;
        for (int j = next; j < n && !needed; j++) {
            const moe_audit_path *p = &paths[j];
            moe_quant_opts q = {p->weights, p->shared, p->e2m1_round, p->mx_scale_rule};
            moe_quant_opts base = {p->weights, MOE_Q_NONE, p->e2m1_round, p->mx_scale_rule};
            needed = !memcmp(&c->key[i], &q, sizeof q) || (p->shared != MOE_Q_NONE && !memcmp(&c->key[i], &base, sizeof base));
        }
        /* a copy that shares weights with a kept one must go first: keep
         * experts-only copies while any derived copy lives */
        for (int k = 0; k < c->n && !needed; k++)
            needed = k != i && c->used[k] && c->key[k].others != MOE_Q_NONE && c->key[i].others == MOE_Q_NONE &&
                     c->key[k].experts == c->key[i].experts && c->key[k].e2m1_round == c->key[i].e2m1_round &&
                     c->key[k].mx_scale_rule == c->key[i].mx_scale_rule;
        if (!needed) {
            if (c->layer[i]) moe_layer_free(c->layer[i]);
            c->layer[i] = NULL;
            c->used[i] = false;
        }
    }
}

static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Expert sets of token t equal? (routed columns only) */
static bool same_set(const moe_block_out *a, const moe_block_out *b, int64_t t, int K) {
    for (int j = 0; j < K; j++) {
        bool found = false;
        for (int q = 0; q < K; q++) found |= a->topk_ids[t * a->n_cols + j] == b->topk_ids[t * b->n_cols + q];
        if (!found) return false;
    }
    return true;
}

moe_status moe_audit_layer(const moe_layer *L, const double *hidden, const int64_t *ids, int64_t T,
                           const moe_audit_path *paths, int n, moe_audit_row *rows, moe_audit_progress cb, void *ctx,
                           moe_error *err) {
    moe_run_opts ro = moe_run_opts_default();
    moe_block_out ref;
    if (cb) cb(ctx, 0, n + 1, "float64 reference");
    moe_status st = moe_block_out_init(&ref, L, T, &ro, err);
    if (st == MOE_OK) st = moe_block_run(L, hidden, ids, T, &ro, &ref, err);
    if (st != MOE_OK) { moe_block_out_free(&ref); return st; }
    int H = L->cfg.hidden, K = L->cfg.top_k;
    double ref_max = 0, ref_ss = 0;
    for (int64_t i = 0; i < T * H; i++) {
        ref_max = fmax(ref_max, fabs(ref.moe_out[i]));
        ref_ss += ref.moe_out[i] * ref.moe_out[i];
    }
    qcache qc;
    memset(&qc, 0, sizeof qc);
    for (int i = 0; i < n; i++) {
        const moe_audit_path *p = &paths[i];
        moe_audit_row *r = &rows[i];
        memset(r, 0, sizeof *r);
        r->layer = L->index;
        r->kind = L->cfg.kind;
        r->path = *p;
        r->tokens = T;
        if (cb) cb(ctx, i + 1, n + 1, p->name);
        qcache_trim(&qc, paths, i, n);
        moe_error perr;
        const moe_layer *PL = layer_for(&qc, L, p, &r->status, r->note, sizeof r->note);
        moe_isa taken = MOE_ISA_REF;
        if (r->status == MOE_OK && moe_isa_resolve(p->isa, &taken, &perr) != MOE_OK) {
            r->status = MOE_ERR_UNSUPPORTED;
            snprintf(r->note, sizeof r->note, "%s", perr.msg);
        }
        if (r->status != MOE_OK) { r->grade = MOE_GRADE_FAIL; continue; }
        /* NVFP4 activations need static input scales: the checkpoint's, or
         * calibrated here as ModelOpt does (on the audited tokens: the best
         * case, no activation beyond its calibrated amax) */
        moe_layer *own = NULL;
        bool nvact = p->act == MOE_ACT_NVFP4 || p->act == MOE_ACT_NVFP4_EXPERT;
        bool ckpt_scales = nvact && moe_act_check_layer(L, p->act, NULL) == MOE_OK;
        if (nvact && ckpt_scales)
            snprintf(r->note, sizeof r->note, "the checkpoint's static input_scale");
        if (nvact && !ckpt_scales) {
            moe_quant_opts none = {MOE_Q_NONE, MOE_Q_NONE, 0, 0};
            if (PL == L && (r->status = moe_layer_quantize(L, &none, &own, &perr)) == MOE_OK) PL = own;
            /* a cached copy an earlier row calibrated on these tokens keeps its scales */
            if (r->status == MOE_OK && moe_act_check_layer(PL, p->act, NULL) != MOE_OK)
                r->status = moe_layer_calibrate_nvfp4((moe_layer *)(uintptr_t)PL, L, hidden, ids, T, &perr);
            if (r->status != MOE_OK) {
                snprintf(r->note, sizeof r->note, "calibration: %.480s", perr.msg);
                r->grade = MOE_GRADE_FAIL;
                if (own) moe_layer_free(own);
                continue;
            }
            snprintf(r->note, sizeof r->note,
                     "input_scale calibrated on these %lld tokens (ModelOpt: amax / (6 * 448) per expert GEMM input): "
                     "the best case, tokens beyond a calibrated amax clip", (long long)T);
        }
        moe_run_opts o = moe_run_opts_default();
        o.precision = p->precision;
        o.isa = p->isa;
        o.act = p->act;
        o.router = p->router;
        o.owner = p->owner;
        o.fuse_shared = p->fuse_shared;
        o.check_invariants = true; /* a path that breaks the contract FAILs whatever its SQNR */
        moe_block_out out;
        double t0 = now();
        r->status = moe_block_out_init(&out, PL, T, &o, &perr);
        if (r->status == MOE_OK)
            r->status = p->runner ? p->runner(p->runner_ctx, PL, hidden, ids, T, &o, &out, &perr)
                                  : moe_block_run(PL, hidden, ids, T, &o, &out, &perr);
        r->seconds = now() - t0;
        if (own) moe_layer_free(own);
        if (r->status != MOE_OK) {
            snprintf(r->note, sizeof r->note, "%s%.480s", r->status == MOE_ERR_INVARIANT ? "contract violated: " : "",
                     perr.msg);
            r->grade = MOE_GRADE_FAIL;
            moe_block_out_free(&out);
            continue;
        }
        double ss = 0, mx = 0;
        for (int64_t k = 0; k < T * H; k++) {
            double d = out.moe_out[k] - ref.moe_out[k];
            ss += d * d;
            mx = fmax(mx, fabs(d));
            if (isnan(d)) mx = NAN;
        }
        for (int64_t t = 0; t < T; t++) r->flips += !same_set(&out, &ref, t, K);
        r->max_abs = mx;
        r->max_rel = ref_max > 0 ? mx / ref_max : mx;
        r->nmse = ref_ss > 0 ? ss / ref_ss : ss;
        r->grade = moe_grade_of(r->nmse, T > 0 ? (double)r->flips / (double)T : 0);
        moe_block_out_free(&out);
    }
    qcache_trim(&qc, paths, n, n); /* frees derived copies before their bases */
    qcache_trim(&qc, paths, n, n);
    moe_block_out_free(&ref);
    return MOE_OK;
}
