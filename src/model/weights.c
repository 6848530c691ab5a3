/*
 * The tensors of a DeepSeek-V4 checkpoint by part, in both namings
 * (docs/model.md section 1): DeepSeek's (layers.N.attn.kv_norm, embed,
 * head, hc_head_fn; the V4-Flash release) and what transformers 5.17's
 * save_pretrained writes (model.layers.N.attn.norm, model.embed_tokens,
 * model.hc_head.hc_fn); each with or without the "model." prefix.
 *
 * Invariants:
 *  1. Linears are descriptors into the mapped files (moe_weight_load: BF16,
 *     F16, F32, FP8 128x128 with E8M0 or fp32 scales, MXFP4, NVFP4); their
 *     shapes are those the config implies, else MOE_ERR_SHAPE naming them.
 *  2. Vectors (norms, sinks, ape, mHC) are float tensors widened to double,
 *     owned by the layer until moe_fwd_layer_free.
 *  3. wo_a's group g is rows [g * o_lora, (g + 1) * o_lora): a view when the
 *     format allows a row slice (plain, FP4 formats, FP8 tiles whose rows
 *     start on a 128 boundary), else those rows decoded to float64 once.
 */
#include "core/core.h"
#include "io/weights.h"
#include "model/model_internal.h"
#include "moe_formats.h"

#include <string.h>

/* Resolve one of cands [n] (printf patterns taking the prefix), trying
 * each as given and with "model." added or removed. `suffix` is appended to
 * the probe (".weight" for linears). On success base receives the name. */
static moe_status resolve(moe_fwd *f, const char *prefix, const char *const *cands, int n, const char *suffix,
                          char *base, size_t cap, bool *found, moe_error *err) {
    *found = false;
    for (int i = 0; i < n; i++) {
        char name[200], probe[240];
        snprintf(name, sizeof name, cands[i], prefix);
        for (int alt = 0; alt < 2; alt++) {
            char try[210];
            if (!alt) snprintf(try, sizeof try, "%s", name);
            else if (!strncmp(name, "model.", 6)) snprintf(try, sizeof try, "%s", name + 6);
            else snprintf(try, sizeof try, "model.%s", name);
            snprintf(probe, sizeof probe, "%s%s", try, suffix);
            /* a shard that cannot be read is that error, not a missing tensor */
            const moe_st_tensor *t = NULL;
            moe_status st = moe_ckpt_lookup(f->ck, probe, &t, err);
            if (st != MOE_OK) return st;
            if (t) {
                snprintf(base, cap, "%s", try);
                *found = true;
                return MOE_OK;
            }
        }
    }
    return MOE_OK;
}

static moe_status missing(moe_fwd *f, const char *prefix, const char *const *cands, int n, const char *suffix,
                          const char *what, moe_error *err) {
    char list[400] = "";
    for (int i = 0; i < n; i++) {
        char name[256];
        snprintf(name, sizeof name, cands[i], prefix);
        snprintf(list + strlen(list), sizeof list - strlen(list), "%s%s%s", i ? ", " : "", name, suffix);
    }
    return moe_errf(err, MOE_ERR_MISSING, "%s: no tensor %s (the %s%s%s; looked for with and without \"model.\")",
                    f->dir, list, what, *prefix ? " of " : "", prefix);
}

static const char *keep_name(fwd_layer *L, const char *s) {
    if (L->n_names == (int)(sizeof L->names / sizeof L->names[0])) return "(name)";
    char *d = moe_malloc(strlen(s) + 1, 1);
    if (!d) return "(name)";
    memcpy(d, s, strlen(s) + 1);
    L->names[L->n_names++] = d;
    return d;
}

static moe_status linear(moe_fwd *f, fwd_layer *L, const char *const *cands, int n, int64_t rows, int64_t cols,
                         const char *what, moe_weight *w, moe_error *err) {
    char base[260];
    bool found;
    moe_status st = resolve(f, L ? L->prefix : "", cands, n, ".weight", base, sizeof base, &found, err);
    if (st != MOE_OK) return st;
    if (!found) return missing(f, L ? L->prefix : "", cands, n, ".weight", what, err);
    return moe_weight_load(f->ck, base, rows, cols, w, L ? keep_name(L, base) : NULL, err);
}

/* A float tensor of `count` elements with shape [count] (or shape dims). */
static moe_status vector(moe_fwd *f, const char *prefix, const char *const *cands, int n, int ndim,
                         const int64_t *shape, const char *what, double **out, moe_error *err) {
    char base[260];
    bool found;
    moe_status st = resolve(f, prefix, cands, n, "", base, sizeof base, &found, err);
    if (st != MOE_OK) return st;
    if (!found) return missing(f, prefix, cands, n, "", what, err);
    const moe_st_tensor *t = NULL;
    st = moe_ckpt_find(f->ck, base, &t, err);
    if (st != MOE_OK) return st;
    if (!moe_dtype_is_float(t->dtype))
        return moe_errf(err, MOE_ERR_DTYPE, "%s: tensor %s has dtype %s; expected F64, F32, F16 or BF16", f->dir, base,
                        moe_dtype_name(t->dtype));
    bool ok = t->ndim == ndim;
    size_t count = 1;
    for (int i = 0; i < ndim; i++) {
        ok = ok && t->shape[i] == shape[i];
        count *= (size_t)shape[i];
    }
    if (!ok) {
        char got[128] = "", want[128] = "";
        for (int i = 0; i < t->ndim; i++)
            snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", i ? ", " : "", (long long)t->shape[i]);
        for (int i = 0; i < ndim; i++)
            snprintf(want + strlen(want), sizeof want - strlen(want), "%s%lld", i ? ", " : "", (long long)shape[i]);
        return moe_errf(err, MOE_ERR_SHAPE, "%s: tensor %s has shape [%s]; the config implies [%s] (%s)", f->dir, base,
                        got, want, what);
    }
    double *d = moe_malloc(count ? count : 1, sizeof *d);
    if (!d) return moe_errf(err, MOE_ERR_NOMEM, "out of memory for tensor %s", base);
    for (size_t i = 0; i < count; i++) d[i] = moe_load_f64(t->data, t->dtype, i);
    *out = d;
    return MOE_OK;
}

static moe_status layer_vec(moe_fwd *f, fwd_layer *L, const char *const *cands, int n, int ndim, const int64_t *shape,
                            const char *what, const double **out, moe_error *err) {
    MOE_ASSERT(L->n_vec < (int)(sizeof L->vec / sizeof L->vec[0]));
    double *d = NULL;
    moe_status st = vector(f, L->prefix, cands, n, ndim, shape, what, &d, err);
    if (st != MOE_OK) return st;
    L->vec[L->n_vec++] = d;
    *out = d;
    return MOE_OK;
}

#define N(a) ((int)(sizeof(a) / sizeof((a)[0])))
#define TRY(x) do { st = (x); if (st != MOE_OK) goto fail; } while (0)

/* wo_a's rows of group g as a weight of its own (invariant 3). */
static moe_status group_rows(fwd_layer *L, const moe_weight *w, int g, int64_t nr, moe_weight *out, moe_error *err) {
    const int64_t r0 = (int64_t)g * nr, cols = w->cols;
    *out = *w;
    out->rows = nr;
    const unsigned char *d = w->data, *sc = w->scale;
    switch (w->fmt) {
    case MOE_WFMT_F64: out->data = d + (size_t)(r0 * cols) * 8; return MOE_OK;
    case MOE_WFMT_F32: out->data = d + (size_t)(r0 * cols) * 4; return MOE_OK;
    case MOE_WFMT_F16:
    case MOE_WFMT_BF16: out->data = d + (size_t)(r0 * cols) * 2; return MOE_OK;
    case MOE_WFMT_MXFP4:
        out->data = d + (size_t)(r0 * (cols / 2));
        out->scale = sc + (size_t)(r0 * (cols / 32));
        out->scale_rows = nr;
        return MOE_OK;
    case MOE_WFMT_NVFP4:
        out->data = d + (size_t)(r0 * (cols / 2));
        out->scale = sc + (size_t)(r0 * (cols / 16));
        out->scale_rows = nr;
        return MOE_OK;
    case MOE_WFMT_FP8_BLOCK: {
        /* rows per scale: 128, or the declared block (V4.1: 32) */
        int64_t br = w->block_rows > 0 ? w->block_rows : 128;
        if (r0 % br == 0) {
            size_t esz = w->scale_dtype == MOE_DTYPE_F8_E8M0 ? 1 : 4;
            out->data = d + (size_t)(r0 * cols);
            out->scale = sc + (size_t)(r0 / br) * (size_t)w->scale_cols * esz;
            out->scale_rows = (nr + br - 1) / br;
            return MOE_OK;
        }
        break;
    }
    }
    /* decode the group's rows once (FP8 tiles straddling the group boundary) */
    double *m = moe_malloc((size_t)(nr * cols), sizeof *m);
    if (!m) return moe_errf(err, MOE_ERR_NOMEM, "out of memory decoding %s", w->name);
    for (int64_t r = 0; r < nr; r++) moe_weight_row_f64(w, r0 + r, m + (size_t)(r * cols));
    L->wo_a_copy[g] = m;
    memset(out, 0, sizeof *out);
    out->fmt = MOE_WFMT_F64;
    out->rows = nr;
    out->cols = cols;
    out->data = m;
    out->scale2 = 1.0f;
    out->name = w->name;
    return MOE_OK;
}

static moe_status compressor(moe_fwd *f, fwd_layer *L, const char *sub, int ratio, int dim, bool overlap,
                             moe_compressor_w *c, moe_error *err) {
    const moe_fwd_config *cf = &f->cfg;
    moe_status st = MOE_OK;
    char p_wkv[96], p_wg[96], p_ape[96], p_norm[96];
    snprintf(p_wkv, sizeof p_wkv, "%%s.%s.wkv", sub);
    snprintf(p_wg, sizeof p_wg, "%%s.%s.wgate", sub);
    snprintf(p_ape, sizeof p_ape, "%%s.%s.ape", sub);
    snprintf(p_norm, sizeof p_norm, "%%s.%s.norm.weight", sub);
    const char *c_wkv[] = {p_wkv}, *c_wg[] = {p_wg}, *c_ape[] = {p_ape}, *c_norm[] = {p_norm};
    const int C = (overlap ? 2 : 1) * dim;
    c->ratio = ratio;
    c->dim = dim;
    c->overlap = overlap;
    c->rms_eps = cf->rms_eps;
    c->rope = &f->rope_compress;
    int64_t s_ape[2] = {ratio, C}, s_norm[1] = {dim};
    TRY(linear(f, L, c_wkv, 1, C, cf->hidden, "compressor kv projection", &c->wkv, err));
    TRY(linear(f, L, c_wg, 1, C, cf->hidden, "compressor gate projection", &c->wgate, err));
    TRY(layer_vec(f, L, c_ape, 1, 2, s_ape, "compressor position bias [ratio, (1 + overlap) * dim]", &c->ape, err));
    TRY(layer_vec(f, L, c_norm, 1, 1, s_norm, "compressor norm", &c->norm, err));
fail:
    return st;
}

static moe_status hc(moe_fwd *f, fwd_layer *L, const char *site, moe_hc_weights **out, moe_error *err) {
    const moe_fwd_config *cf = &f->cfg;
    moe_hc_config hcfg = {.n = cf->hc_mult, .H = cf->hidden, .iters = cf->hc_iters, .hc_eps = cf->hc_eps,
                          .rms_eps = cf->rms_eps};
    moe_hc_weights *w = NULL;
    moe_status st = moe_hc_weights_init(&hcfg, NULL, NULL, NULL, &w, err);
    if (st != MOE_OK) return st;
    char pf[64], pb[64], ps[64];
    snprintf(pf, sizeof pf, "%%s.hc_%s_fn", site);
    snprintf(pb, sizeof pb, "%%s.hc_%s_base", site);
    snprintf(ps, sizeof ps, "%%s.hc_%s_scale", site);
    const char *cf_[] = {pf}, *cb[] = {pb}, *cs[] = {ps};
    const int64_t rows = (int64_t)(2 + cf->hc_mult) * cf->hc_mult;
    int64_t s_fn[2] = {rows, (int64_t)cf->hc_mult * cf->hidden}, s_b[1] = {rows}, s_s[1] = {3};
    double *fn = NULL, *base = NULL, *scale = NULL;
    st = vector(f, L->prefix, cf_, 1, 2, s_fn, "mHC linear", &fn, err);
    if (st == MOE_OK) st = vector(f, L->prefix, cb, 1, 1, s_b, "mHC bias", &base, err);
    if (st == MOE_OK) st = vector(f, L->prefix, cs, 1, 1, s_s, "mHC scales", &scale, err);
    if (st == MOE_OK) {
        memcpy(w->fn, fn, (size_t)(s_fn[0] * s_fn[1]) * sizeof(double));
        memcpy(w->base, base, (size_t)rows * sizeof(double));
        memcpy(w->scale, scale, 3 * sizeof(double));
        *out = w;
    } else {
        moe_hc_weights_free(w);
    }
    free(fn);
    free(base);
    free(scale);
    return st;
}

moe_status moe_fwd_layer_load(moe_fwd *f, int index, bool routed, fwd_layer *L, moe_error *err) {
    memset(L, 0, sizeof *L);
    const moe_fwd_config *cf = &f->cfg;
    moe_status st = MOE_OK;
    L->index = index;
    if (index < cf->n_layers) snprintf(L->prefix, sizeof L->prefix, "layers.%d", index);
    else snprintf(L->prefix, sizeof L->prefix, "mtp.%d", index - cf->n_layers);
    moe_attn_w *a = &L->attn;
    const int H = cf->hidden, hd = cf->head_dim, nh = cf->heads, G = cf->o_groups;
    a->type = f->attn[index];
    a->ratio = f->ratio[index];
    a->hidden = H;
    a->heads = nh;
    a->head_dim = hd;
    a->rope_dim = cf->rope_dim;
    a->q_lora = cf->q_lora_rank;
    a->o_groups = G;
    a->o_lora = cf->o_lora_rank;
    a->window = cf->window;
    a->rms_eps = cf->rms_eps;
    a->rope = a->type == MOE_ATTN_SLIDING ? &f->rope_main : &f->rope_compress;

    static const char *const c_wq_a[] = {"%s.attn.wq_a"}, *const c_wq_b[] = {"%s.attn.wq_b"},
                             *const c_wkv[] = {"%s.attn.wkv"}, *const c_wo_a[] = {"%s.attn.wo_a"},
                             *const c_wo_b[] = {"%s.attn.wo_b"}, *const c_qn[] = {"%s.attn.q_norm.weight"},
                             *const c_kvn[] = {"%s.attn.kv_norm.weight", "%s.attn.norm.weight"},
                             *const c_sink[] = {"%s.attn.attn_sink", "%s.attn.sinks"},
                             *const c_an[] = {"%s.attn_norm.weight"}, *const c_fn[] = {"%s.ffn_norm.weight"},
                             *const c_iq[] = {"%s.attn.indexer.wq_b"},
                             *const c_iw[] = {"%s.attn.indexer.weights_proj"};
    const int64_t QH = (int64_t)nh * hd;
    int64_t s_q[1] = {cf->q_lora_rank}, s_kv[1] = {hd}, s_h[1] = {nh}, s_H[1] = {H};
    TRY(linear(f, L, c_wq_a, N(c_wq_a), cf->q_lora_rank, H, "attention q down-projection", &a->wq_a, err));
    TRY(linear(f, L, c_wq_b, N(c_wq_b), QH, cf->q_lora_rank, "attention q up-projection", &a->wq_b, err));
    TRY(linear(f, L, c_wkv, N(c_wkv), hd, H, "attention kv projection", &a->wkv, err));
    moe_weight wo_a_full;
    TRY(linear(f, L, c_wo_a, N(c_wo_a), (int64_t)G * cf->o_lora_rank, QH / G, "grouped output projection", &wo_a_full,
               err));
    TRY(linear(f, L, c_wo_b, N(c_wo_b), H, (int64_t)G * cf->o_lora_rank, "output projection", &a->wo_b, err));
    L->wo_a = moe_calloc((size_t)G, sizeof *L->wo_a);
    L->wo_a_copy = moe_calloc((size_t)G, sizeof *L->wo_a_copy);
    if (!L->wo_a || !L->wo_a_copy) TRY(moe_errf(err, MOE_ERR_NOMEM, "out of memory"));
    for (int g = 0; g < G; g++) TRY(group_rows(L, &wo_a_full, g, cf->o_lora_rank, &L->wo_a[g], err));
    a->wo_a = L->wo_a;
    TRY(layer_vec(f, L, c_qn, N(c_qn), 1, s_q, "q norm", &a->q_norm, err));
    TRY(layer_vec(f, L, c_kvn, N(c_kvn), 1, s_kv, "kv norm", &a->kv_norm, err));
    TRY(layer_vec(f, L, c_sink, N(c_sink), 1, s_h, "attention sink", &a->sink, err));
    TRY(layer_vec(f, L, c_an, N(c_an), 1, s_H, "attention norm", &L->attn_norm, err));
    TRY(layer_vec(f, L, c_fn, N(c_fn), 1, s_H, "ffn norm", &L->ffn_norm, err));
    if (a->type != MOE_ATTN_SLIDING)
        TRY(compressor(f, L, "attn.compressor", a->ratio, hd, a->type == MOE_ATTN_CSA, &a->comp, err));
    if (a->type == MOE_ATTN_CSA) {
        a->index_heads = cf->index_heads;
        a->index_dim = cf->index_dim;
        a->index_topk = cf->index_topk;
        TRY(linear(f, L, c_iq, N(c_iq), (int64_t)cf->index_heads * cf->index_dim, cf->q_lora_rank,
                   "indexer q projection", &a->idx_wq_b, err));
        TRY(linear(f, L, c_iw, N(c_iw), cf->index_heads, H, "indexer head weights", &a->idx_wproj, err));
        TRY(compressor(f, L, "attn.indexer.compressor", a->ratio, cf->index_dim, true, &a->idx_comp, err));
    }
    TRY(hc(f, L, "attn", &L->hc_attn, err));
    TRY(hc(f, L, "ffn", &L->hc_ffn, err));
    if (index < cf->n_layers) {
        if (routed) {
            TRY(moe_model_layer(f->m, index, &L->moe, err));
        } else {
            TRY(moe_model_layer_experts(f->m, index, 0, 0, &L->moe_owned, err));
            L->moe = L->moe_owned;
        }
        if (L->moe->cfg.hidden != H)
            TRY(moe_errf(err, MOE_ERR_CONFIG, "%s: layer %d's MoE block has hidden size %d, not %d", f->dir, index,
                         L->moe->cfg.hidden, H));
    } else {
        if (routed) TRY(moe_model_mtp_layer(f->m, index - cf->n_layers, &L->moe_owned, err));
        else TRY(moe_model_mtp_layer_experts(f->m, index - cf->n_layers, 0, 0, &L->moe_owned, err));
        L->moe = L->moe_owned;
        static const char *const c_e[] = {"%s.e_proj"}, *const c_h[] = {"%s.h_proj"},
                                 *const c_en[] = {"%s.enorm.weight"}, *const c_hn[] = {"%s.hnorm.weight"},
                                 *const c_n[] = {"%s.norm.weight"}, *const c_hf[] = {"%s.hc_head_fn"},
                                 *const c_hb[] = {"%s.hc_head_base"}, *const c_hs[] = {"%s.hc_head_scale"};
        int64_t s_fn[2] = {cf->hc_mult, (int64_t)cf->hc_mult * H}, s_n[1] = {cf->hc_mult}, s_1[1] = {1};
        const double *scale = NULL;
        TRY(linear(f, L, c_e, N(c_e), H, H, "MTP embedding projection", &L->e_proj, err));
        TRY(linear(f, L, c_h, N(c_h), H, H, "MTP hidden projection", &L->h_proj, err));
        TRY(layer_vec(f, L, c_en, N(c_en), 1, s_H, "MTP embedding norm", &L->enorm, err));
        TRY(layer_vec(f, L, c_hn, N(c_hn), 1, s_H, "MTP hidden norm", &L->hnorm, err));
        TRY(layer_vec(f, L, c_n, N(c_n), 1, s_H, "MTP final norm", &L->mtp_norm, err));
        TRY(layer_vec(f, L, c_hf, N(c_hf), 2, s_fn, "MTP hc head linear", &L->hc_head_fn, err));
        TRY(layer_vec(f, L, c_hb, N(c_hb), 1, s_n, "MTP hc head bias", &L->hc_head_base, err));
        TRY(layer_vec(f, L, c_hs, N(c_hs), 1, s_1, "MTP hc head scale", &scale, err));
        L->hc_head_scale = scale[0];
    }
    return MOE_OK;
fail:
    moe_fwd_layer_free(L);
    return st;
}

void moe_fwd_layer_free(fwd_layer *L) {
    if (!L) return;
    for (int i = 0; i < L->n_vec; i++) free(L->vec[i]);
    if (L->wo_a_copy)
        for (int g = 0; g < L->attn.o_groups; g++) free(L->wo_a_copy[g]);
    free(L->wo_a_copy);
    free(L->wo_a);
    moe_layer_free(L->moe_owned);
    moe_hc_weights_free(L->hc_attn);
    moe_hc_weights_free(L->hc_ffn);
    for (int i = 0; i < L->n_names; i++) free(L->names[i]);
    memset(L, 0, sizeof *L);
}

moe_status moe_fwd_load_root(moe_fwd *f, moe_error *err) {
    const moe_fwd_config *cf = &f->cfg;
    moe_status st = MOE_OK;
    static const char *const c_emb[] = {"embed", "embed_tokens"}, *const c_head[] = {"head", "lm_head"},
                             *const c_norm[] = {"norm.weight"}, *const c_fn[] = {"hc_head_fn", "hc_head.hc_fn"},
                             *const c_base[] = {"hc_head_base", "hc_head.hc_base"},
                             *const c_scale[] = {"hc_head_scale", "hc_head.hc_scale"};
    char base[260];
    bool found;
    TRY(resolve(f, "", c_emb, N(c_emb), ".weight", base, sizeof base, &found, err));
    if (!found) return missing(f, "", c_emb, N(c_emb), ".weight", "token embedding", err);
    snprintf(f->names[0], sizeof f->names[0], "%s", base);
    TRY(moe_weight_load(f->ck, base, cf->vocab, cf->hidden, &f->embed, f->names[0], err));
    TRY(resolve(f, "", c_head, N(c_head), ".weight", base, sizeof base, &found, err));
    if (!found) return missing(f, "", c_head, N(c_head), ".weight", "LM head", err);
    snprintf(f->names[1], sizeof f->names[1], "%s", base);
    TRY(moe_weight_load(f->ck, base, cf->vocab, cf->hidden, &f->head, f->names[1], err));
    int64_t s_H[1] = {cf->hidden}, s_fn[2] = {cf->hc_mult, (int64_t)cf->hc_mult * cf->hidden}, s_n[1] = {cf->hc_mult},
            s_1[1] = {1};
    double *scale = NULL;
    TRY(vector(f, "", c_norm, N(c_norm), 1, s_H, "final norm", &f->norm, err));
    TRY(vector(f, "", c_fn, N(c_fn), 2, s_fn, "hc head linear", &f->hc_head_fn, err));
    TRY(vector(f, "", c_base, N(c_base), 1, s_n, "hc head bias", &f->hc_head_base, err));
    TRY(vector(f, "", c_scale, N(c_scale), 1, s_1, "hc head scale", &scale, err));
    f->hc_head_scale = scale[0];
    free(scale);
fail:
    return st;
}
