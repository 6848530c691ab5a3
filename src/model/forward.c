/*
 * The whole DeepSeek-V4 forward (docs/model.md section 2): embedding, per
 * layer the mHC streams around the attention and MoE blocks, the hc head,
 * the final norm and the LM head, chunk by chunk with the caches carried.
 *
 * Invariants:
 *  1. The driver calls the stages through their headers only: src/attn
 *     (attention, compressors, indexer), src/hc (mHC), src/experts through
 *     moe_block_run (or the caller's replacement, which with
 *     moe_external_experts brings the routed experts: the driver then never
 *     looks one up), src/linalg for the head. It knows nothing of processes.
 *  2. Per chunk of S tokens the driver holds the streams twice
 *     [S, hc_mult, H] and one layer's activations; a layer's small weights
 *     are loaded before it runs and freed after; every output row goes to
 *     the sink as soon as it exists.
 *  3. Every computed value depends only on the token's own inputs and the
 *     sequence before it: chunking changes no arithmetic sequence (the
 *     linears are per-row fixed sequences, the attention per query).
 *  4. Patches (moeaudit_patch.h) reach the stages as data: per layer and
 *     chunk the driver resolves the set into a moe_layer_patch and hands each
 *     stage its part (the mHC precision to moe_hc_forward, the attention's
 *     to moe_attn_forward, the MoE block's to moe_patch_moe_run); it never
 *     tests which patch is on.
 */
#include "core/core.h"
#include "model/model_internal.h"
#include "moeaudit_patch.h"

#include <math.h>
#include <string.h>

#define HEAD_BLOCK 64
#define HC_BLOCK 32

struct moe_fwd_state {
    const moe_fwd *f;
    moe_fwd_opts o;
    const moe_cpu_kernels *kt;  /* o.isa's kernel table */
    int64_t pos;
    int start;                  /* first layer computed: 0, or first_layer from given streams */
    int started;                /* 0 before the first run, else 1 + (streams given) */
    int n_states;               /* n_layers (+ 1 with MTP) */
    moe_attn_state *attn;       /* [n_states] */
    bool *attn_ready;           /* [n_states] */
    bool broken;
    moe_phase phase;            /* of the chunks run now */
    /* MTP: the last position's final streams wait for the next token */
    double *mtp_pending;        /* [hc_mult, H] */
    bool has_pending;
    int64_t mtp_pos;            /* MTP rows done (= the next MTP row's position) */
};

static const char *const what_names[] = {"in",     "attn.in",      "attn.out",  "ffn.in",    "ffn.out",
                                         "out",    "index_topk",   "logits",    "index_scores", "attn_probs"};
static const char *const type_names[] = {"sliding", "csa", "hca"};

const char *moe_fwd_what_name(moe_fwd_what w) { return (unsigned)w <= MOE_FWD_ATTN_PROBS ? what_names[w] : "?"; }

const char *moe_attn_type_name(moe_attn_type t) { return (unsigned)t <= MOE_ATTN_HCA ? type_names[t] : "?"; }

/* ------------------------------------------------------------- open */

moe_status moe_fwd_open_model(moe_model *m, moe_fwd **out, moe_error *err) {
    *out = NULL;
    moe_fwd *f = moe_calloc(1, sizeof *f);
    if (!f) {
        moe_model_free(m);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    }
    f->m = m;
    f->ck = moe_model_ckpt(f->m);
    const char *dir = moe_ckpt_dir(f->ck);
    snprintf(f->dir, sizeof f->dir, "%s", dir);
    moe_status st = moe_fwd_parse_config(f, err);
    if (st == MOE_OK) {
        const moe_model_info *mi = moe_model_get_info(f->m);
        if (mi->arch != MOE_ARCH_V4)
            st = moe_errf(err, MOE_ERR_UNSUPPORTED, "%s/config.json: model_type \"%s\" is not DeepSeek-V4 (deepseek_v4)",
                          dir, mi->model_type);
    }
    if (st == MOE_OK) st = moe_fwd_load_root(f, err);
    /* the MTP block, if any (a shard that cannot be read is that error, not
     * "no MTP block") */
    const moe_st_tensor *mt = NULL;
    if (st == MOE_OK) st = moe_ckpt_lookup(f->ck, "mtp.0.e_proj.weight", &mt, err);
    if (st == MOE_OK && !mt) st = moe_ckpt_lookup(f->ck, "model.mtp.0.e_proj.weight", &mt, err);
    if (st != MOE_OK) {
        moe_fwd_free(f);
        return st;
    }
    f->cfg.n_mtp = mt != NULL;
    *out = f;
    return MOE_OK;
}

moe_status moe_fwd_open(const char *dir, moe_fwd **out, moe_error *err) {
    *out = NULL;
    moe_model *m = NULL;
    moe_status st = moe_model_open(dir, &m, err);
    if (st != MOE_OK) return st;
    return moe_fwd_open_model(m, out, err);
}

void moe_fwd_free(moe_fwd *f) {
    if (!f) return;
    moe_rope_free(&f->rope_main);
    moe_rope_free(&f->rope_compress);
    free(f->ratio);
    free(f->attn);
    free(f->norm);
    free(f->hc_head_fn);
    free(f->hc_head_base);
    moe_model_free(f->m); /* and its checkpoint, f->ck */
    free(f);
}

const moe_fwd_config *moe_fwd_get_config(const moe_fwd *f) { return &f->cfg; }
moe_model *moe_fwd_model(moe_fwd *f) { return f->m; }

moe_fwd_opts moe_fwd_opts_default(const moe_fwd *f) {
    moe_fwd_opts o;
    memset(&o, 0, sizeof o);
    o.precision = MOE_PREC_REF;
    o.first_layer = 0;
    o.last_layer = f->cfg.n_layers - 1;
    o.logits = true;
    o.patch_mask = MOE_PATCH_ALL;
    return o;
}

/* ------------------------------------------------------------ state */

moe_status moe_fwd_state_init(const moe_fwd *f, const moe_fwd_opts *o, moe_fwd_state **out, moe_error *err) {
    *out = NULL;
    const int nl = f->cfg.n_layers;
    if (o->first_layer < 0 || o->last_layer >= nl || o->first_layer > o->last_layer)
        return moe_errf(err, MOE_ERR_ARG, "layers %d..%d are out of range: the model has %d layers (0..%d)",
                        o->first_layer, o->last_layer, nl, nl - 1);
    if (o->logits && o->last_layer != nl - 1)
        return moe_errf(err, MOE_ERR_ARG, "logits need every layer: the run stops at layer %d of 0..%d", o->last_layer,
                        nl - 1);
    if (o->mtp && f->cfg.n_mtp < 1)
        return moe_errf(err, MOE_ERR_MISSING, "%s: the checkpoint has no MTP block (no tensor mtp.0.e_proj.weight)",
                        f->dir);
    if (o->mtp && o->last_layer != nl - 1)
        return moe_errf(err, MOE_ERR_ARG, "the MTP block needs every layer: the run stops at layer %d of 0..%d",
                        o->last_layer, nl - 1);
    if (o->moe_external_experts && !o->moe)
        return moe_errf(err, MOE_ERR_ARG, "moe_external_experts needs a MoE function (opts.moe) that brings the "
                        "routed experts");
    if (o->precision != MOE_PREC_REF && o->precision != MOE_PREC_F32)
        return moe_errf(err, MOE_ERR_ARG, "precision %d is neither ref nor f32", (int)o->precision);
    if (o->n_probe < 0 || (o->n_probe > 0 && !o->probe))
        return moe_errf(err, MOE_ERR_ARG, "%d probe positions given without an array", o->n_probe);
    const moe_cpu_kernels *kt = NULL;
    moe_status kst = moe_cpu_table(o->isa, &kt, err);
    if (kst != MOE_OK) return kst;
    if (o->moe) {
        for (int i = 0; i < moe_patch_set_count(o->patch); i++) {
            moe_layer_patch lp;
            for (int l = 0; l < nl; l++) {
                moe_patch_layer(o->patch, o->patch_mask & ((uint64_t)1 << i), l, MOE_PHASE_ALL, &lp);
                if (lp.moe_set)
                    return moe_errf(err, MOE_ERR_ARG, "patch %s changes the MoE block, which this run replaces "
                                    "(moe_fwd_opts.moe): the two cannot be combined", moe_patch_set_at(o->patch, i)->text);
            }
        }
    }
    moe_fwd_state *s = moe_calloc(1, sizeof *s);
    if (!s) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    s->f = f;
    s->o = *o;
    s->kt = kt;
    s->phase = MOE_PHASE_PREFILL;
    s->n_states = nl + (o->mtp ? 1 : 0);
    s->attn = moe_calloc((size_t)s->n_states, sizeof *s->attn);
    s->attn_ready = moe_calloc((size_t)s->n_states, sizeof *s->attn_ready);
    if (o->mtp) s->mtp_pending = moe_calloc((size_t)f->cfg.hc_mult * (size_t)f->cfg.hidden, sizeof(double));
    if (!s->attn || !s->attn_ready || (o->mtp && !s->mtp_pending)) {
        moe_fwd_state_free(s);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    }
    *out = s;
    return MOE_OK;
}

void moe_fwd_state_free(moe_fwd_state *s) {
    if (!s) return;
    if (s->attn)
        for (int i = 0; i < s->n_states; i++)
            if (s->attn_ready[i]) moe_attn_state_free(&s->attn[i]);
    free(s->attn);
    free(s->attn_ready);
    free(s->mtp_pending);
    free(s);
}

int64_t moe_fwd_state_pos(const moe_fwd_state *s) { return s->pos; }

void moe_fwd_state_set_phase(moe_fwd_state *s, moe_phase p) {
    MOE_ASSERT(p == MOE_PHASE_PREFILL || p == MOE_PHASE_DECODE);
    s->phase = p;
}

moe_status moe_fwd_state_clone(const moe_fwd_state *src, const moe_fwd_opts *o, moe_fwd_state **out, moe_error *err) {
    *out = NULL;
    if (src->broken) return moe_errf(err, MOE_ERR_ARG, "the forward state to copy failed earlier");
    if (o->first_layer != src->o.first_layer || o->last_layer != src->o.last_layer || o->mtp != src->o.mtp ||
        o->logits != src->o.logits)
        return moe_errf(err, MOE_ERR_ARG, "a copied state keeps its layers %d..%d%s%s: the new options ask for %d..%d%s%s",
                        src->o.first_layer, src->o.last_layer, src->o.logits ? ", logits" : "", src->o.mtp ? ", MTP" : "",
                        o->first_layer, o->last_layer, o->logits ? ", logits" : "", o->mtp ? ", MTP" : "");
    moe_fwd_state *s = NULL;
    moe_status st = moe_fwd_state_init(src->f, o, &s, err);
    if (st != MOE_OK) return st;
    s->pos = src->pos;
    s->start = src->start;
    s->started = src->started;
    s->phase = src->phase;
    s->has_pending = src->has_pending;
    s->mtp_pos = src->mtp_pos;
    if (src->mtp_pending)
        memcpy(s->mtp_pending, src->mtp_pending, (size_t)src->f->cfg.hc_mult * (size_t)src->f->cfg.hidden * sizeof(double));
    moe_fwd *f = (moe_fwd *)src->f;
    for (int i = 0; i < s->n_states && st == MOE_OK; i++) {
        if (!src->attn_ready[i]) continue;
        fwd_layer L;
        st = moe_fwd_layer_load(f, i, !s->o.moe_external_experts, &L, err);
        if (st != MOE_OK) break;
        st = moe_attn_state_copy(&s->attn[i], &src->attn[i], &L.attn, err);
        if (st == MOE_OK) s->attn_ready[i] = true;
        if (st == MOE_OK && o->patch && i < src->f->cfg.n_layers) st = moe_patch_check_layer(o->patch, L.moe, err);
        moe_fwd_layer_free(&L);
    }
    if (st != MOE_OK) {
        moe_fwd_state_free(s);
        return st;
    }
    *out = s;
    return MOE_OK;
}

/* ------------------------------------------------------------- run */

static moe_status emit(moe_fwd_state *s, int layer, moe_fwd_what what, int64_t row0, int64_t rows, int64_t row_elems,
                       const double *d, const int32_t *id, moe_error *err) {
    if (!s->o.sink) return MOE_OK;
    const int nl = s->f->cfg.n_layers;
    if (layer >= 0 && layer < nl && (layer < s->o.first_layer || layer > s->o.last_layer)) return MOE_OK;
    moe_fwd_tensor t = {.layer = layer, .what = what, .row0 = row0, .rows = rows, .row_elems = row_elems,
                        .data = d, .idata = id};
    return s->o.sink(s->o.sink_ctx, &t, err);
}

static moe_status default_moe(void *ctx, const moe_layer *L, const double *x, const int64_t *ids, int64_t T,
                              const moe_run_opts *ro, double *out, moe_error *err) {
    (void)ctx;
    moe_block_out bo;
    moe_status st = moe_block_out_init(&bo, L, T, ro, err);
    if (st != MOE_OK) return st;
    st = moe_block_run(L, x, ids, T, ro, &bo, err);
    if (st == MOE_OK) memcpy(out, bo.moe_out, (size_t)T * (size_t)L->cfg.hidden * sizeof(double));
    moe_block_out_free(&bo);
    return st;
}

/* mHC collapse of the streams X [S, n, H] with hc (pre/post/comb) at
 * precision prec, then the sublayer's RMSNorm: post [S, n], comb [S, n, n],
 * y [S, H]. */
static moe_status collapse(const moe_fwd *f, const moe_hc_weights *hc, const double *norm, const double *X, int64_t S,
                           bool f32, moe_hc_prec prec, double *post, double *comb, double *y, moe_error *err) {
    const moe_fwd_config *c = &f->cfg;
    const int n = c->hc_mult, H = c->hidden;
    const size_t wsz = moe_hc_workspace_size(&hc->cfg);
    int failed = 0;
#pragma omp parallel
    {
        void *ws = moe_malloc(wsz, 1);
        if (!ws) {
#pragma omp atomic write
            failed = 1;
        }
        /* blocks of tokens per call: a path that rounds fn rounds it once per block */
#pragma omp for schedule(static)
        for (int64_t t0 = 0; t0 < S; t0 += HC_BLOCK) {
            if (!ws) continue;
            const int64_t nt = S - t0 < HC_BLOCK ? S - t0 : HC_BLOCK;
            moe_hc_forward(hc, prec, X + (size_t)t0 * n * H, nt, NULL, post + (size_t)t0 * n,
                           comb + (size_t)t0 * n * n, y + (size_t)t0 * H, ws);
            for (int64_t t = t0; t < t0 + nt; t++) moe_attn_rmsnorm(y + (size_t)t * H, H, norm, c->rms_eps, f32);
        }
        free(ws);
    }
    if (failed) return moe_errf(err, MOE_ERR_NOMEM, "out of memory for the mHC workspace");
    return MOE_OK;
}

/* The attention's probe callbacks: rows to the sink. */
typedef struct probe_ctx {
    moe_fwd_state *s;
    int layer;
    int heads;
} probe_ctx;

static moe_status probe_scores(void *ctx, int64_t pos, const double *sc, int64_t n, moe_error *err) {
    probe_ctx *c = ctx;
    return emit(c->s, c->layer, MOE_FWD_INDEX_SCORES, pos, 1, n, sc, NULL, err);
}

static moe_status probe_probs(void *ctx, int64_t pos, const double *p, const int64_t *keys, int64_t nk, moe_error *err) {
    probe_ctx *c = ctx;
    moe_fwd_state *s = c->s;
    if (!s->o.sink || c->layer < s->o.first_layer || c->layer > s->o.last_layer) return MOE_OK;
    moe_fwd_tensor t = {.layer = c->layer, .what = MOE_FWD_ATTN_PROBS, .row0 = pos, .rows = 1,
                        .row_elems = (int64_t)c->heads * nk, .data = p, .keys = keys, .n_keys = nk};
    return s->o.sink(s->o.sink_ctx, &t, err);
}

/* One layer on the chunk: the streams X [S, n, H] in and out (Y: scratch of the same size). */
static moe_status run_layer(moe_fwd *f, moe_fwd_state *s, fwd_layer *Lp, int li, const int64_t *ids, int64_t S,
                            int64_t row0, double *X, double *Y, moe_error *err) {
    const moe_fwd_config *c = &f->cfg;
    const int n = c->hc_mult, H = c->hidden;
    const bool f32 = s->o.precision == MOE_PREC_F32;
    fwd_layer L0, *Lw = Lp ? Lp : &L0;
    moe_status st = Lp ? MOE_OK : moe_fwd_layer_load(f, li, !s->o.moe_external_experts, &L0, err);
    if (st != MOE_OK) return st;
    if (!s->attn_ready[li]) {
        st = moe_attn_state_init(&s->attn[li], &Lw->attn, err);
        if (st != MOE_OK) {
            if (!Lp) moe_fwd_layer_free(&L0);
            return st;
        }
        s->attn_ready[li] = true;
    }
    moe_layer_patch lp;
    moe_patch_layer(s->o.patch, s->o.patch_mask, li, s->phase, &lp);
    const moe_hc_prec hcp = lp.hc_set ? lp.hc : f32 ? MOE_HC_F32 : MOE_HC_REF;
    const int K = moe_attn_topk(&Lw->attn, &lp.attn);
    double *post = moe_malloc((size_t)S * n, sizeof *post);
    double *comb = moe_malloc((size_t)S * n * n, sizeof *comb);
    double *a_in = moe_malloc((size_t)S * H, sizeof *a_in);
    double *a_out = moe_malloc((size_t)S * H, sizeof *a_out);
    int32_t *topk = K ? moe_malloc((size_t)S * (size_t)K, sizeof *topk) : NULL;
    if (!post || !comb || !a_in || !a_out || (K && !topk)) {
        st = moe_errf(err, MOE_ERR_NOMEM, "out of memory for layer %d on %lld tokens", li, (long long)S);
        goto out;
    }
    st = emit(s, li, MOE_FWD_IN, row0, S, (int64_t)n * H, X, NULL, err);
    /* attention block */
    if (st == MOE_OK) st = collapse(f, Lw->hc_attn, Lw->attn_norm, X, S, f32, hcp, post, comb, a_in, err);
    if (st == MOE_OK) st = emit(s, li, MOE_FWD_ATTN_IN, row0, S, H, a_in, NULL, err);
    moe_attn_stats as;
    moe_attn_pick pick = {.fn = s->o.index, .ctx = s->o.index_ctx, .layer = li};
    probe_ctx pc = {.s = s, .layer = li, .heads = Lw->attn.heads};
    moe_attn_probe probe = {.pos = s->o.probe, .n = s->o.n_probe, .ctx = &pc, .index_scores = probe_scores,
                            .probs = probe_probs};
    if (st == MOE_OK)
        st = moe_attn_forward(&Lw->attn, &s->attn[li], a_in, S, f32, s->kt, &lp.attn, &pick,
                              s->o.n_probe ? &probe : NULL, a_out, topk, &as, err);
    if (st == MOE_OK) st = emit(s, li, MOE_FWD_ATTN_OUT, row0, S, H, a_out, NULL, err);
    if (st == MOE_OK && K) st = emit(s, li, MOE_FWD_INDEX_TOPK, row0, S, K, NULL, topk, err);
    if (st != MOE_OK) goto out;
    moe_hc_expand(n, H, S, post, comb, a_out, X, Y, f32);
    /* MoE block */
    st = collapse(f, Lw->hc_ffn, Lw->ffn_norm, Y, S, f32, hcp, post, comb, a_in, err);
    if (st == MOE_OK) st = emit(s, li, MOE_FWD_FFN_IN, row0, S, H, a_in, NULL, err);
    if (st == MOE_OK) {
        moe_run_opts ro = moe_run_opts_default();
        ro.precision = s->o.precision;
        ro.isa = s->o.isa;
        if (lp.moe_set) {
            st = moe_patch_moe_run(s->o.patch, Lw->moe, &lp.moe, a_in, ids, S, &ro, a_out, err);
        } else {
            moe_fwd_moe_fn fn = s->o.moe ? s->o.moe : default_moe;
            st = fn(s->o.moe_ctx, Lw->moe, a_in, ids, S, &ro, a_out, err);
        }
    }
    if (st == MOE_OK) st = emit(s, li, MOE_FWD_FFN_OUT, row0, S, H, a_out, NULL, err);
    if (st != MOE_OK) goto out;
    moe_hc_expand(n, H, S, post, comb, a_out, Y, X, f32);
    st = emit(s, li, MOE_FWD_OUT, row0, S, (int64_t)n * H, X, NULL, err);
out:
    free(post);
    free(comb);
    free(a_in);
    free(a_out);
    free(topk);
    if (!Lp) moe_fwd_layer_free(&L0);
    return st;
}

static moe_status run_head(moe_fwd *f, moe_fwd_state *s, const double *X, int64_t S, int64_t pos0, int layer,
                           const double *hfn, const double *hbase, double hscale, const double *norm, moe_error *err) {
    const moe_fwd_config *c = &f->cfg;
    const int n = c->hc_mult, H = c->hidden, V = c->vocab;
    const bool f32 = s->o.precision == MOE_PREC_F32;
    const int64_t B = S < HEAD_BLOCK ? S : HEAD_BLOCK;
    double *y = moe_malloc((size_t)B * H, sizeof *y);
    double *lg = moe_malloc((size_t)B * (size_t)V, sizeof *lg);
    moe_status st = MOE_OK;
    if (!y || !lg) {
        st = moe_errf(err, MOE_ERR_NOMEM, "out of memory for the logits [%lld, %d]", (long long)B, V);
        goto out;
    }
    for (int64_t b0 = 0; b0 < S && st == MOE_OK; b0 += HEAD_BLOCK) {
        const int64_t nb = S - b0 < HEAD_BLOCK ? S - b0 : HEAD_BLOCK;
        moe_hc_head_forward(n, H, nb, hfn, hbase, hscale, c->rms_eps, c->hc_eps, X + (size_t)b0 * n * H, y, f32);
        for (int64_t t = 0; t < nb; t++) moe_attn_rmsnorm(y + (size_t)t * H, H, norm, c->rms_eps, f32);
        st = moe_attn_linear(&f->head, y, H, nb, lg, V, f32, s->kt, err);
        if (st == MOE_OK && s->o.sink) {
            moe_fwd_tensor t = {.layer = layer, .what = MOE_FWD_LOGITS, .row0 = pos0 + b0, .rows = nb, .row_elems = V,
                                .data = lg};
            st = s->o.sink(s->o.sink_ctx, &t, err);
        }
    }
out:
    free(y);
    free(lg);
    return st;
}

/* MTP block 0 on the positions whose next token this chunk brings: the
 * previous chunk's last position (pending) and this chunk's all but last.
 * Row of position t: streams rms(X_final[t], hnorm) h_projᵀ + rms(embed[id_{t+1}], enorm) e_projᵀ
 * (the embedding term added to every stream), then the block, its hc head,
 * its norm and the shared LM head (DeepSeek's MTPBlock). */
static moe_status run_mtp(moe_fwd *f, moe_fwd_state *s, const int64_t *ids, int64_t T, const double *X, moe_error *err) {
    const moe_fwd_config *c = &f->cfg;
    const int n = c->hc_mult, H = c->hidden, li = c->n_layers;
    const bool f32 = s->o.precision == MOE_PREC_F32;
    const int64_t M = T - 1 + (s->has_pending ? 1 : 0);
    moe_status st = MOE_OK;
    if (M > 0) {
        fwd_layer L;
        st = moe_fwd_layer_load(f, li, !s->o.moe_external_experts, &L, err);
        if (st != MOE_OK) return st;
        double *Z = moe_malloc((size_t)M * n * H, sizeof *Z), *Y = moe_malloc((size_t)M * n * H, sizeof *Y);
        double *e = moe_malloc((size_t)M * H, sizeof *e), *pe = moe_malloc((size_t)M * H, sizeof *pe);
        double *hx = moe_malloc((size_t)M * n * H, sizeof *hx);
        int64_t *nid = moe_malloc((size_t)M, sizeof *nid);
        if (!Z || !Y || !e || !pe || !hx || !nid) st = moe_errf(err, MOE_ERR_NOMEM, "out of memory for the MTP block");
        for (int64_t r = 0; st == MOE_OK && r < M; r++) {
            const int64_t at = s->has_pending ? r - 1 : r; /* chunk row of position t; -1: pending */
            nid[r] = ids[at + 1];
            memcpy(hx + (size_t)r * n * H, at < 0 ? s->mtp_pending : X + (size_t)at * n * H, (size_t)n * H * sizeof(double));
            for (int j = 0; j < n; j++) moe_attn_rmsnorm(hx + ((size_t)r * n + j) * H, H, L.hnorm, c->rms_eps, f32);
            moe_weight_row_f64(&f->embed, nid[r], e + (size_t)r * H);
            for (int h = 0; h < H; h++) e[(size_t)r * H + h] = moe_fl(e[(size_t)r * H + h], f32);
            moe_attn_rmsnorm(e + (size_t)r * H, H, L.enorm, c->rms_eps, f32);
        }
        if (st == MOE_OK) st = moe_attn_linear(&L.e_proj, e, H, M, pe, H, f32, s->kt, err);
        if (st == MOE_OK) st = moe_attn_linear(&L.h_proj, hx, H, M * n, Z, H, f32, s->kt, err);
        for (int64_t r = 0; st == MOE_OK && r < M; r++)
            for (int j = 0; j < n; j++)
                for (int h = 0; h < H; h++) {
                    double *z = Z + ((size_t)r * n + j) * H + h;
                    *z = moe_fl(pe[(size_t)r * H + h] + *z, f32);
                }
        if (st == MOE_OK) st = run_layer(f, s, &L, li, nid, M, s->mtp_pos, Z, Y, err);
        if (st == MOE_OK)
            st = run_head(f, s, Z, M, s->mtp_pos, li, L.hc_head_fn, L.hc_head_base, L.hc_head_scale, L.mtp_norm, err);
        free(Z);
        free(Y);
        free(e);
        free(pe);
        free(hx);
        free(nid);
        moe_fwd_layer_free(&L);
    }
    if (st == MOE_OK) {
        memcpy(s->mtp_pending, X + (size_t)(T - 1) * n * H, (size_t)n * H * sizeof(double));
        s->has_pending = true;
        s->mtp_pos += M;
    }
    return st;
}

moe_status moe_fwd_run(moe_fwd *f, moe_fwd_state *s, const int64_t *ids, int64_t T, const double *streams,
                       moe_error *err) {
    const moe_fwd_config *c = &f->cfg;
    if (s->broken) return moe_errf(err, MOE_ERR_ARG, "this forward state failed earlier: start a new one");
    if (T <= 0) return moe_errf(err, MOE_ERR_INPUT, "input_ids has %lld tokens: a chunk needs at least one", (long long)T);
    for (int64_t t = 0; t < T; t++)
        if (ids[t] < 0 || ids[t] >= c->vocab)
            return moe_errf(err, MOE_ERR_INPUT, "input_ids[%lld] = %lld is not a token id: the vocabulary has %d entries",
                            (long long)(s->pos + t), (long long)ids[t], c->vocab);
    const int given = streams ? 2 : 1;
    if (s->started && s->started != given)
        return moe_errf(err, MOE_ERR_ARG, "every chunk of a sequence must start the same way (%s)",
                        s->started == 2 ? "from given streams" : "from the embedding");
    if (!s->started) {
        /* every weight the run needs is found and checked before anything runs */
        for (int li = streams ? s->o.first_layer : 0; li <= s->o.last_layer; li++) {
            fwd_layer L;
            moe_status st = moe_fwd_layer_load(f, li, !s->o.moe_external_experts, &L, err);
            if (st != MOE_OK) {
                s->broken = true;
                return st;
            }
            if (s->o.patch) st = moe_patch_check_layer(s->o.patch, L.moe, err);
            moe_fwd_layer_free(&L);
            if (st != MOE_OK) {
                s->broken = true;
                return st;
            }
        }
        if (s->o.mtp) {
            fwd_layer L;
            moe_status st = moe_fwd_layer_load(f, c->n_layers, !s->o.moe_external_experts, &L, err);
            if (st != MOE_OK) {
                s->broken = true;
                return st;
            }
            moe_fwd_layer_free(&L);
        }
    }
    s->started = given;
    s->start = streams ? s->o.first_layer : 0;
    const int n = c->hc_mult, H = c->hidden;
    const size_t sz = (size_t)T * n * H;
    double *X = moe_malloc(sz, sizeof *X), *Y = moe_malloc(sz, sizeof *Y);
    moe_status st = MOE_OK;
    if (!X || !Y) {
        st = moe_errf(err, MOE_ERR_NOMEM, "out of memory for the streams of %lld tokens", (long long)T);
        goto out;
    }
    const bool f32 = s->o.precision == MOE_PREC_F32;
    if (streams) {
        for (size_t i = 0; i < sz; i++) X[i] = moe_fl(streams[i], f32);
    } else {
        double *row = moe_malloc((size_t)H, sizeof *row);
        if (!row) {
            st = moe_errf(err, MOE_ERR_NOMEM, "out of memory");
            goto out;
        }
        for (int64_t t = 0; t < T; t++) {
            moe_weight_row_f64(&f->embed, ids[t], row);
            for (int h = 0; h < H; h++) row[h] = moe_fl(row[h], f32);
            for (int j = 0; j < n; j++) memcpy(X + ((size_t)t * n + j) * H, row, (size_t)H * sizeof(double));
        }
        free(row);
    }
    for (int li = s->start; li <= s->o.last_layer && st == MOE_OK; li++) {
        st = run_layer(f, s, NULL, li, ids, T, s->pos, X, Y, err);
    }
    if (st == MOE_OK && s->o.logits)
        st = run_head(f, s, X, T, s->pos, -1, f->hc_head_fn, f->hc_head_base, f->hc_head_scale, f->norm, err);
    if (st == MOE_OK && s->o.mtp) st = run_mtp(f, s, ids, T, X, err);
    if (st == MOE_OK) {
        for (int li = s->start; li <= s->o.last_layer; li++)
            MOE_ASSERT(s->attn[li].pos == s->pos + T);
        s->pos += T;
    }
out:
    if (st != MOE_OK) s->broken = true;
    free(X);
    free(Y);
    return st;
}
