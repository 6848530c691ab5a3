/*
 * config.json of a DeepSeek-V4 checkpoint, both schemas (docs/model.md
 * section 1).
 *
 * Invariants:
 *  1. Layer attention: transformers' layer_types (with compress_rates, and
 *     the legacy compress_rate_csa / compress_rate_hca keys folded in), else
 *     DeepSeek's compress_ratios (0: sliding, 4: CSA with overlap and
 *     indexer, any other: HCA, as DeepSeek's code decides), else
 *     transformers' default (2 HCA, then CSA on odd, HCA on even layers).
 *     When both layer_types and compress_ratios are present they must agree.
 *  2. RoPE: nested rope_parameters {main, compress} are taken as written
 *     (transformers then derives YaRN's attention factor from `factor` when
 *     none is given); otherwise main = rope_theta plain, compress =
 *     compress_rope_theta with the YaRN keys of rope_scaling (or a flat
 *     rope_parameters) and attention factor 1, as transformers' config does.
 *  3. The rotary dimension: qk_rope_head_dim and head_dim *
 *     partial_rotary_factor must agree when both are present.
 */
#include "core/core.h"
#include "io/model_util.h"
#include "model/model_internal.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <string.h>

#define TRY(x) do { moe_status st_ = (x); if (st_ != MOE_OK) { st = st_; goto out; } } while (0)

static const cJSON *item(const cJSON *o, const char *k) { return cJSON_GetObjectItemCaseSensitive(o, k); }

static bool is_set(const cJSON *v) { return v && !cJSON_IsNull(v); }

/* A nested or flat rope spec; `main` selects the defaults of invariant 2. */
static moe_status parse_rope(const cJSON *spec, const char *path, const char *what, double max_pos,
                             bool nested, moe_rope_config *rc, moe_error *err) {
    moe_status st = MOE_OK;
    const cJSON *ty = item(spec, "rope_type");
    if (!is_set(ty)) ty = item(spec, "type");
    const char *type = cJSON_IsString(ty) ? ty->valuestring : "default";
    if (strcmp(type, "default") && strcmp(type, "yarn"))
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "%s: %s rope type \"%s\" is not supported (default or yarn)", path,
                        what, type);
    rc->yarn = !strcmp(type, "yarn");
    rc->truncate = true; /* transformers 5.17 reads `truncate` from the outer dict: always true for V4 */
    rc->attention_factor = 1.0;
    if (!rc->yarn) return MOE_OK;
    double factor = 0, orig = 0;
    const cJSON *fv = item(spec, "factor");
    TRY(moe_cfg_num(spec, path, "original_max_position_embeddings", false, max_pos, 1.0, &orig, err));
    if (is_set(fv)) TRY(moe_cfg_num(spec, path, "factor", true, 0, 1e-300, &factor, err));
    else factor = max_pos / orig;
    double bf = 0, bs = 0;
    TRY(moe_cfg_num(spec, path, "beta_fast", false, 32, 0, &bf, err));
    TRY(moe_cfg_num(spec, path, "beta_slow", false, 1, 0, &bs, err));
    rc->factor = factor;
    rc->original_max_pos = orig;
    rc->beta_fast = bf > 0 ? bf : 32; /* transformers: `or 32` */
    rc->beta_slow = bs > 0 ? bs : 1;
    const cJSON *af = item(spec, "attention_factor");
    if (is_set(af)) {
        TRY(moe_cfg_num(spec, path, "attention_factor", true, 0, 0, &rc->attention_factor, err));
    } else if (nested) {
        /* transformers' _compute_yarn_parameters: 0.1 * mscale * ln(factor) + 1 (ratio with mscale_all_dim) */
        double ms = 0, msa = 0;
        TRY(moe_cfg_num(spec, path, "mscale", false, 0, -INFINITY, &ms, err));
        TRY(moe_cfg_num(spec, path, "mscale_all_dim", false, 0, -INFINITY, &msa, err));
        if (factor <= 1) rc->attention_factor = 1.0;
        else if (ms != 0 && msa != 0) rc->attention_factor = (0.1 * ms * log(factor) + 1.0) / (0.1 * msa * log(factor) + 1.0);
        else rc->attention_factor = 0.1 * log(factor) + 1.0;
    }
out:
    return st;
}

static moe_status type_of_name(const char *s, const char *path, int i, moe_attn_type *t, moe_error *err) {
    if (!strcmp(s, "sliding_attention")) *t = MOE_ATTN_SLIDING;
    else if (!strcmp(s, "compressed_sparse_attention")) *t = MOE_ATTN_CSA;
    else if (!strcmp(s, "heavily_compressed_attention")) *t = MOE_ATTN_HCA;
    else
        return moe_errf(err, MOE_ERR_CONFIG,
                        "%s: layer_types[%d] = \"%s\" is not sliding_attention, compressed_sparse_attention or "
                        "heavily_compressed_attention", path, i, s);
    return MOE_OK;
}

static moe_attn_type type_of_ratio(int r) { return r == 0 ? MOE_ATTN_SLIDING : r == 4 ? MOE_ATTN_CSA : MOE_ATTN_HCA; }

moe_status moe_fwd_parse_config(moe_fwd *f, moe_error *err) {
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", f->dir);
    cJSON *root = cJSON_Parse(moe_model_config_json(f->m));
    if (!root) return moe_errf(err, MOE_ERR_FORMAT, "%s: not valid JSON", path);
    moe_fwd_config *c = &f->cfg;
    moe_status st = MOE_OK;
    const int BIG = 1 << 24;
    TRY(moe_cfg_int(root, path, "hidden_size", true, 0, 1, BIG, &c->hidden, err));
    TRY(moe_cfg_int(root, path, "vocab_size", true, 0, 1, 1 << 30, &c->vocab, err));
    TRY(moe_cfg_int(root, path, "num_hidden_layers", true, 0, 1, 100000, &c->n_layers, err));
    TRY(moe_cfg_int(root, path, "num_attention_heads", true, 0, 1, 1 << 16, &c->heads, err));
    TRY(moe_cfg_int(root, path, "head_dim", true, 0, 2, 1 << 16, &c->head_dim, err));
    TRY(moe_cfg_int(root, path, "q_lora_rank", true, 0, 1, BIG, &c->q_lora_rank, err));
    TRY(moe_cfg_int(root, path, "o_groups", true, 0, 1, 1 << 16, &c->o_groups, err));
    TRY(moe_cfg_int(root, path, "o_lora_rank", true, 0, 1, BIG, &c->o_lora_rank, err));
    TRY(moe_cfg_int(root, path, "sliding_window", true, 0, 1, BIG, &c->window, err));
    TRY(moe_cfg_int(root, path, "hc_mult", true, 0, 1, 64, &c->hc_mult, err));
    TRY(moe_cfg_int(root, path, "hc_sinkhorn_iters", true, 0, 1, 1000000, &c->hc_iters, err));
    TRY(moe_cfg_num(root, path, "hc_eps", true, 0, 0, &c->hc_eps, err));
    TRY(moe_cfg_num(root, path, "rms_norm_eps", true, 0, 0, &c->rms_eps, err));
    const int nl = c->n_layers;
    if ((c->heads * (int64_t)c->head_dim) % c->o_groups != 0)
        TRY(moe_errf(err, MOE_ERR_CONFIG, "%s: num_attention_heads * head_dim = %lld is not a multiple of o_groups = %d",
                     path, (long long)c->heads * c->head_dim, c->o_groups));
    if (c->heads % c->o_groups != 0)
        TRY(moe_errf(err, MOE_ERR_CONFIG, "%s: num_attention_heads = %d is not a multiple of o_groups = %d", path,
                     c->heads, c->o_groups));

    /* rotary dimension */
    int qk_rope = -1;
    double prf = -1;
    if (is_set(item(root, "qk_rope_head_dim")))
        TRY(moe_cfg_int(root, path, "qk_rope_head_dim", true, 0, 2, c->head_dim, &qk_rope, err));
    if (is_set(item(root, "partial_rotary_factor")))
        TRY(moe_cfg_num(root, path, "partial_rotary_factor", true, 0, 0, &prf, err));
    if (prf > 1)
        TRY(moe_errf(err, MOE_ERR_CONFIG, "%s: partial_rotary_factor = %g must be in [0, 1]", path, prf));
    int from_prf = prf >= 0 ? (int)((double)c->head_dim * prf) : -1;
    if (qk_rope >= 0 && from_prf >= 0 && qk_rope != from_prf)
        TRY(moe_errf(err, MOE_ERR_CONFIG,
                     "%s: qk_rope_head_dim = %d disagrees with head_dim * partial_rotary_factor = %d * %g = %d", path,
                     qk_rope, c->head_dim, prf, from_prf));
    c->rope_dim = qk_rope >= 0 ? qk_rope : from_prf >= 0 ? from_prf : c->head_dim * 64 / 512;
    if (c->rope_dim < 2 || c->rope_dim % 2 || c->rope_dim > c->head_dim || c->rope_dim > MOE_ATTN_MAX_ROPE)
        TRY(moe_errf(err, MOE_ERR_CONFIG, "%s: the rotary dimension %d must be even, in [2, min(head_dim = %d, %d)]",
                     path, c->rope_dim, c->head_dim, MOE_ATTN_MAX_ROPE));

    /* per-layer attention */
    f->ratio = moe_calloc((size_t)nl + 1, sizeof *f->ratio);
    f->attn = moe_calloc((size_t)nl + 1, sizeof *f->attn);
    if (!f->ratio || !f->attn) TRY(moe_errf(err, MOE_ERR_NOMEM, "out of memory"));
    int rate_csa = 4, rate_hca = 128;
    const cJSON *rates = item(root, "compress_rates");
    if (is_set(rates)) {
        if (!cJSON_IsObject(rates)) TRY(moe_errf(err, MOE_ERR_CONFIG, "%s: \"compress_rates\" must be an object", path));
        TRY(moe_cfg_int(rates, path, "compressed_sparse_attention", false, 4, 1, MOE_ATTN_MAX_RATIO, &rate_csa, err));
        TRY(moe_cfg_int(rates, path, "heavily_compressed_attention", false, 128, 1, MOE_ATTN_MAX_RATIO, &rate_hca, err));
    }
    TRY(moe_cfg_int(root, path, "compress_rate_csa", false, rate_csa, 1, MOE_ATTN_MAX_RATIO, &rate_csa, err));
    TRY(moe_cfg_int(root, path, "compress_rate_hca", false, rate_hca, 1, MOE_ATTN_MAX_RATIO, &rate_hca, err));
    const cJSON *lt = item(root, "layer_types"), *cr = item(root, "compress_ratios");
    if (is_set(cr) && (!cJSON_IsArray(cr) || cJSON_GetArraySize(cr) < nl))
        TRY(moe_errf(err, MOE_ERR_CONFIG, "%s: \"compress_ratios\" must be an array of at least num_hidden_layers = %d "
                     "integers (one per layer, then the MTP blocks')", path, nl));
    int n_cr = is_set(cr) ? cJSON_GetArraySize(cr) : 0;
    int *crv = n_cr ? moe_calloc((size_t)n_cr, sizeof *crv) : NULL;
    for (int i = 0; i < n_cr; i++) {
        const cJSON *v = cJSON_GetArrayItem(cr, i);
        if (!cJSON_IsNumber(v) || v->valuedouble != floor(v->valuedouble) || v->valuedouble < 0 ||
            v->valuedouble > MOE_ATTN_MAX_RATIO) {
            free(crv);
            TRY(moe_errf(err, MOE_ERR_CONFIG, "%s: compress_ratios[%d] must be an integer in [0, %d]", path, i,
                         MOE_ATTN_MAX_RATIO));
        }
        crv[i] = (int)v->valuedouble;
    }
    if (is_set(lt)) {
        if (!cJSON_IsArray(lt) || cJSON_GetArraySize(lt) != nl) {
            free(crv);
            TRY(moe_errf(err, MOE_ERR_CONFIG, "%s: \"layer_types\" must be an array of num_hidden_layers = %d strings",
                         path, nl));
        }
        for (int i = 0; i < nl; i++) {
            const cJSON *v = cJSON_GetArrayItem(lt, i);
            moe_attn_type t = MOE_ATTN_SLIDING; /* set by type_of_name on MOE_OK; gcc 13 cannot see it */
            st = type_of_name(cJSON_IsString(v) ? v->valuestring : "", path, i, &t, err);
            if (st != MOE_OK) { free(crv); goto out; }
            f->attn[i] = t;
            f->ratio[i] = t == MOE_ATTN_SLIDING ? 0 : t == MOE_ATTN_CSA ? rate_csa : rate_hca;
            if (crv && crv[i] != f->ratio[i]) {
                int got = crv[i];
                free(crv);
                TRY(moe_errf(err, MOE_ERR_CONFIG, "%s: layer_types[%d] = \"%s\" (ratio %d) disagrees with "
                             "compress_ratios[%d] = %d", path, i, v->valuestring, f->ratio[i], i, got));
            }
        }
    } else if (crv) {
        for (int i = 0; i < nl; i++) {
            f->ratio[i] = crv[i];
            f->attn[i] = type_of_ratio(crv[i]);
        }
        c->native_schema = true;
    } else {
        for (int i = 0; i < nl; i++) {
            f->attn[i] = i < 2 ? MOE_ATTN_HCA : (i - 2) % 2 ? MOE_ATTN_CSA : MOE_ATTN_HCA;
            f->ratio[i] = f->attn[i] == MOE_ATTN_CSA ? rate_csa : rate_hca;
        }
    }
    /* the MTP block's attention: compress_ratios[n_layers] when given, else sliding */
    f->ratio[nl] = n_cr > nl ? crv[nl] : 0;
    f->attn[nl] = type_of_ratio(f->ratio[nl]);
    free(crv);
    c->ratio = f->ratio;
    c->attn = f->attn;

    bool any_csa = false;
    for (int i = 0; i <= nl; i++) any_csa |= f->attn[i] == MOE_ATTN_CSA;
    if (any_csa) {
        TRY(moe_cfg_int(root, path, "index_n_heads", true, 0, 1, 256, &c->index_heads, err));
        TRY(moe_cfg_int(root, path, "index_head_dim", true, 0, 2, 4096, &c->index_dim, err));
        TRY(moe_cfg_int(root, path, "index_topk", true, 0, 1, 1 << 24, &c->index_topk, err));
        if ((int64_t)c->index_heads * c->index_dim > 16384 || c->index_dim < c->rope_dim)
            TRY(moe_errf(err, MOE_ERR_CONFIG, "%s: index_n_heads x index_head_dim = %d x %d: need at most 16384 values "
                         "and index_head_dim >= the rotary dimension %d", path, c->index_heads, c->index_dim, c->rope_dim));
    }

    /* RoPE */
    double max_pos = 0, theta = 0, ctheta = 0;
    TRY(moe_cfg_num(root, path, "max_position_embeddings", false, 1048576, 1, &max_pos, err));
    TRY(moe_cfg_num(root, path, "rope_theta", false, 10000, 0, &theta, err));
    TRY(moe_cfg_num(root, path, "compress_rope_theta", false, 160000, 0, &ctheta, err));
    const cJSON *rp = item(root, "rope_parameters"), *rs = item(root, "rope_scaling");
    const cJSON *rmain = is_set(rp) ? item(rp, "main") : NULL, *rcomp = is_set(rp) ? item(rp, "compress") : NULL;
    if (cJSON_IsObject(rmain) && cJSON_IsObject(rcomp)) {
        TRY(moe_cfg_num(rmain, path, "rope_theta", true, 0, 0, &c->rope_main.theta, err));
        TRY(moe_cfg_num(rcomp, path, "rope_theta", true, 0, 0, &c->rope_compress.theta, err));
        TRY(parse_rope(rmain, path, "rope_parameters.main", max_pos, true, &c->rope_main, err));
        TRY(parse_rope(rcomp, path, "rope_parameters.compress", max_pos, true, &c->rope_compress, err));
        const cJSON *prfs[2] = {item(rmain, "partial_rotary_factor"), item(rcomp, "partial_rotary_factor")};
        for (int k = 0; k < 2; k++)
            if (cJSON_IsNumber(prfs[k]) && !(prfs[k]->valuedouble >= 0 && prfs[k]->valuedouble <= 1 &&
                                             (int)((double)c->head_dim * prfs[k]->valuedouble) == c->rope_dim))
                TRY(moe_errf(err, MOE_ERR_CONFIG, "%s: rope_parameters.%s.partial_rotary_factor = %g gives a rotary "
                             "dimension other than %d", path, k ? "compress" : "main", prfs[k]->valuedouble, c->rope_dim));
    } else {
        const cJSON *flat = is_set(rs) ? rs : is_set(rp) ? rp : NULL;
        c->rope_main.theta = theta;
        c->rope_main.attention_factor = 1.0;
        c->rope_main.truncate = true;
        c->rope_compress.theta = ctheta;
        if (flat) {
            if (!cJSON_IsObject(flat))
                TRY(moe_errf(err, MOE_ERR_CONFIG, "%s: \"%s\" must be an object", path, is_set(rs) ? "rope_scaling" : "rope_parameters"));
            TRY(parse_rope(flat, path, is_set(rs) ? "rope_scaling" : "rope_parameters", max_pos, false,
                           &c->rope_compress, err));
        } else {
            c->rope_compress.attention_factor = 1.0;
            c->rope_compress.truncate = true;
        }
    }
    TRY(moe_rope_init(&f->rope_main, &c->rope_main, c->rope_dim, err));
    TRY(moe_rope_init(&f->rope_compress, &c->rope_compress, c->rope_dim, err));
out:
    cJSON_Delete(root);
    return st;
}
