/*
 * Model description: config.json (through cJSON) and the checkpoint name
 * maps of the DeepSeek V4 native layout and the HF DeepSeek V3 layout.
 *
 * Invariants:
 *  1. A loaded layer's shapes agree with the config: gate [E, H], every
 *     routed expert w1/w3 [I, H] and w2 [H, I], shared [Is, H] / [H, Is].
 *  2. tid2eid entries are validated once at load: every id in [0, E).
 *  3. Weights point into the checkpoint's mappings; the model owns only the
 *     descriptors, names, the bias (as double) and tid2eid (as int32).
 */
#include "core/core.h"
#include "io/files.h"
#include "io/io_quote.h"
#include "io/layer_store.h"
#include "io/model_util.h"
#include "io/weights.h"
#include "moe_formats.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <string.h>


struct moe_model {
    moe_ckpt *ckpt;
    moe_model_info info;
    char model_type[64];
    char *config_path;     /* <dir>/config.json */
    char *config_text;
    /* parsed config */
    int hidden, inter, n_experts, top_k, n_shared, n_group, topk_group, vocab;
    moe_score_func score;
    bool renormalize;
    double scaling, swiglu_limit;
    moe_layer_kind *kinds; /* [n_layers + n_mtp] */
    layer_store **layers;  /* [n_layers + n_mtp], loaded on demand */
};

/* ------------------------------------------------------------ config.json */

/* config.json is small: anything past this is not a config. */
#define MOE_CONFIG_MAX_BYTES ((size_t)64 << 20)

static moe_status cfg_bool(const cJSON *cfg, const char *path, const char *key, bool def,
                           bool *out, moe_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    if (!v || cJSON_IsNull(v)) { *out = def; return MOE_OK; }
    if (!cJSON_IsBool(v)) return moe_errf(err, MOE_ERR_CONFIG, "%s: \"%s\" must be true or false", path, key);
    *out = cJSON_IsTrue(v);
    return MOE_OK;
}

#define TRY(x) do { moe_status st_ = (x); if (st_ != MOE_OK) return st_; } while (0)

static moe_status parse_config(moe_model *m, const cJSON *root, moe_error *err) {
    const char *path = m->config_path;
    if (!cJSON_IsObject(root)) return moe_errf(err, MOE_ERR_CONFIG, "%s: not a JSON object", path);
    /* Multimodal and newer configs (DeepSeek-V4.1: "DeepseekV41ForCausalLM")
     * nest the text model's keys under text_config. */
    const cJSON *cfg = root, *tc = cJSON_GetObjectItemCaseSensitive(root, "text_config");
    if (tc && !cJSON_IsNull(tc)) {
        if (!cJSON_IsObject(tc)) return moe_errf(err, MOE_ERR_CONFIG, "%s: \"text_config\" must be an object", path);
        cfg = tc;
        size_t l = strlen(m->config_path);
        if (l + 13 < sizeof m->config_path) memcpy(m->config_path + l, " text_config", 13);
    }
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(cfg, "model_type");
    if (!cJSON_IsString(mt)) mt = cJSON_GetObjectItemCaseSensitive(root, "model_type");
    snprintf(m->model_type, sizeof m->model_type, "%s", cJSON_IsString(mt) ? mt->valuestring : "");
    m->info.arch = strncmp(m->model_type, "deepseek_v4", 11) == 0 ? MOE_ARCH_V4 : MOE_ARCH_V3;
    m->info.model_type = m->model_type;

    /* the limits of moeaudit.h, before anything is sized from the config */
    TRY(moe_cfg_int(cfg, path, "hidden_size", true, 0, 1, MOE_MAX_HIDDEN, &m->hidden, err));
    TRY(moe_cfg_int(cfg, path, "num_hidden_layers", true, 0, 1, MOE_MAX_LAYERS, &m->info.n_layers, err));
    TRY(moe_cfg_int(cfg, path, "moe_intermediate_size", true, 0, 1, MOE_MAX_INTER, &m->inter, err));
    TRY(moe_cfg_int(cfg, path, "n_routed_experts", true, 0, 1, MOE_MAX_EXPERTS, &m->n_experts, err));
    TRY(moe_cfg_int(cfg, path, "num_experts_per_tok", true, 0, 1, MOE_MAX_TOPK, &m->top_k, err));
    TRY(moe_cfg_int(cfg, path, "n_shared_experts", false, 0, 0, MOE_MAX_SHARED, &m->n_shared, err));
    TRY(moe_cfg_int(cfg, path, "n_group", false, 1, 1, MOE_MAX_GROUPS, &m->n_group, err));
    TRY(moe_cfg_int(cfg, path, "topk_group", false, 1, 1, MOE_MAX_GROUPS, &m->topk_group, err));
    TRY(moe_cfg_int(cfg, path, "vocab_size", false, 0, 0, MOE_MAX_VOCAB, &m->vocab, err));
    TRY(moe_cfg_num(cfg, path, "routed_scaling_factor", false, 1.0, -INFINITY, &m->scaling, err));
    TRY(moe_cfg_num(cfg, path, "swiglu_limit", false, 0.0, -INFINITY, &m->swiglu_limit, err));
    TRY(moe_cfg_int(cfg, path, "num_nextn_predict_layers", false, 0, 0, 64, &m->info.n_mtp, err));
    m->info.hidden = m->hidden;
    m->info.vocab = m->vocab;

    if (m->top_k > m->n_experts)
        return moe_errf(err, MOE_ERR_CONFIG, "%s: num_experts_per_tok = %d exceeds n_routed_experts = %d",
                        path, m->top_k, m->n_experts);
    if (m->n_experts % m->n_group != 0)
        return moe_errf(err, MOE_ERR_CONFIG, "%s: n_routed_experts = %d is not a multiple of n_group = %d",
                        path, m->n_experts, m->n_group);
    if (m->topk_group > m->n_group)
        return moe_errf(err, MOE_ERR_CONFIG, "%s: topk_group = %d exceeds n_group = %d", path,
                        m->topk_group, m->n_group);
    if (m->top_k > m->topk_group * (m->n_experts / m->n_group))
        return moe_errf(err, MOE_ERR_CONFIG,
                        "%s: num_experts_per_tok = %d cannot be chosen from topk_group = %d groups of %d experts",
                        path, m->top_k, m->topk_group, m->n_experts / m->n_group);
    if (!(m->scaling > 0))
        return moe_errf(err, MOE_ERR_CONFIG, "%s: routed_scaling_factor = %.17g must be > 0", path, m->scaling);
    if (m->swiglu_limit < 0)
        return moe_errf(err, MOE_ERR_CONFIG, "%s: swiglu_limit = %.17g must be >= 0", path, m->swiglu_limit);

    const cJSON *sf = cJSON_GetObjectItemCaseSensitive(cfg, "scoring_func");
    const char *sname = cJSON_IsString(sf) ? sf->valuestring
                        : m->info.arch == MOE_ARCH_V4 ? "sqrtsoftplus" : "sigmoid";
    if (strcmp(sname, "sigmoid") == 0) m->score = MOE_SCORE_SIGMOID;
    else if (strcmp(sname, "sqrtsoftplus") == 0) m->score = MOE_SCORE_SQRTSOFTPLUS;
    else if (strcmp(sname, "softmax") == 0) m->score = MOE_SCORE_SOFTMAX;
    else return moe_errf(err, MOE_ERR_CONFIG, "%s: unknown scoring_func \"%s\"", path, sname);
    TRY(cfg_bool(cfg, path, "norm_topk_prob", m->score != MOE_SCORE_SOFTMAX, &m->renormalize, err));

    int nl = m->info.n_layers;
    m->kinds = moe_calloc((size_t)(nl + m->info.n_mtp), sizeof *m->kinds);
    m->layers = moe_calloc((size_t)(nl + m->info.n_mtp), sizeof *m->layers);
    if (!m->kinds || !m->layers) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    /* The MTP blocks (layers nl .. nl + n_mtp - 1) are learned-router MoE
     * blocks in V3 (model.layers.61.mlp) and V4 (mtp.0.ffn, with gate.bias):
     * neither dense (first_k_dense_replace counts from 0) nor hash-routed. */
    for (int i = nl; i < nl + m->info.n_mtp; i++) m->kinds[i] = MOE_LAYER_TOPK;

    const cJSON *types = cJSON_GetObjectItemCaseSensitive(cfg, "mlp_layer_types");
    if (types && !cJSON_IsNull(types)) {
        if (!cJSON_IsArray(types) || cJSON_GetArraySize(types) != nl)
            return moe_errf(err, MOE_ERR_CONFIG, "%s: \"mlp_layer_types\" must be an array of %d strings",
                            path, nl);
        for (int i = 0; i < nl; i++) {
            const cJSON *t = cJSON_GetArrayItem(types, i);
            const char *s = cJSON_IsString(t) ? t->valuestring : "";
            if (strcmp(s, "hash_moe") == 0) m->kinds[i] = MOE_LAYER_HASH;
            else if (strcmp(s, "moe") == 0) m->kinds[i] = MOE_LAYER_TOPK;
            else if (strcmp(s, "dense") == 0 || strcmp(s, "mlp") == 0) m->kinds[i] = MOE_LAYER_DENSE;
            else return moe_errf(err, MOE_ERR_CONFIG, "%s: mlp_layer_types[%d] = \"%s\" is not hash_moe, moe or dense",
                                 path, i, s);
        }
        return MOE_OK;
    }
    int first_dense = 0, freq = 1, n_hash = 0;
    TRY(moe_cfg_int(cfg, path, "first_k_dense_replace", false, 0, 0, nl, &first_dense, err));
    TRY(moe_cfg_int(cfg, path, "moe_layer_freq", false, 1, 1, nl, &freq, err));
    /* official V4 configs name the hash layer count n_hash_layers */
    TRY(moe_cfg_int(cfg, path, "n_hash_layers", false, 0, 0, nl, &n_hash, err));
    if (!n_hash) TRY(moe_cfg_int(cfg, path, "num_hash_layers", false, 0, 0, nl, &n_hash, err));
    for (int i = 0; i < nl; i++) {
        if (i < first_dense || i % freq != 0) m->kinds[i] = MOE_LAYER_DENSE;
        else m->kinds[i] = i < n_hash ? MOE_LAYER_HASH : MOE_LAYER_TOPK;
    }
    return MOE_OK;
}

/* Parse config text [len] (m->config_path names it) into m: duplicate keys
 * refused, then parse_config. */
static moe_status model_config(moe_model *m, const char *text, size_t len, moe_error *err) {
    /* other readers (hc, indexer) parse the NUL-terminated text again */
    const char *nul = memchr(text, 0, len);
    if (nul)
        return moe_errf(err, MOE_ERR_FORMAT, "%s: a NUL byte at offset %zu: not a JSON text", m->config_path,
                        (size_t)(nul - text));
    cJSON *cfg = cJSON_ParseWithLength(text, len);
    if (!cfg) return moe_errf(err, MOE_ERR_FORMAT, "%s: not valid JSON", m->config_path);
    moe_status st;
    const char *dup = moe_json_dup_key(cfg);
    if (dup) {
        char q[160];
        st = moe_errf(err, MOE_ERR_FORMAT, "%s: key \"%s\" appears twice in one object (which value holds is "
                      "parser-dependent)", m->config_path, moe_io_quote(dup, q, sizeof q));
    } else {
        st = parse_config(m, cfg, err);
    }
    cJSON_Delete(cfg);
    return st;
}

moe_status moe_model_open(const char *dir, moe_model **out, moe_error *err) {
    *out = NULL;
    moe_model *m = moe_calloc(1, sizeof *m);
    if (!m || !(m->config_path = moe_path_join(dir, "config.json"))) {
        free(m);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    }
    size_t len = 0;
    moe_status st = moe_io_read_file(m->config_path, NULL, MOE_CONFIG_MAX_BYTES, &m->config_text, &len, err);
    if (st == MOE_OK) st = model_config(m, m->config_text, len, err);
    if (st == MOE_OK) st = moe_ckpt_open(dir, &m->ckpt, err);
    if (st != MOE_OK) { moe_model_free(m); return st; }
    *out = m;
    return MOE_OK;
}

moe_status moe_model_open_mem(const char *label, const moe_mem_file *files, size_t n, moe_model **out,
                              moe_error *err) {
    *out = NULL;
    if (!label) label = "<memory>";
    const moe_mem_file *cf = NULL;
    for (size_t i = 0; i < n && !cf; i++)
        if (files[i].name && strcmp(files[i].name, "config.json") == 0) cf = &files[i];
    moe_model *m = moe_calloc(1, sizeof *m);
    if (!m || !(m->config_path = moe_path_join(label, "config.json"))) {
        free(m);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    }
    moe_status st = MOE_OK;
    if (!cf) st = moe_errf(err, MOE_ERR_IO, "%s: cannot open: no such file", m->config_path);
    else if (cf->len > MOE_CONFIG_MAX_BYTES)
        st = moe_errf(err, MOE_ERR_FORMAT, "%s: %zu bytes exceed the limit of %zu bytes", m->config_path, cf->len,
                      MOE_CONFIG_MAX_BYTES);
    else if (!(m->config_text = malloc(cf->len + 1))) st = moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    if (st == MOE_OK) { /* a NUL-terminated copy: moe_model_config_json hands it out */
        if (cf->len) memcpy(m->config_text, cf->data, cf->len);
        m->config_text[cf->len] = '\0';
        st = model_config(m, m->config_text, cf->len, err);
    }
    if (st == MOE_OK) st = moe_ckpt_open_mem(label, files, n, &m->ckpt, err);
    if (st != MOE_OK) { moe_model_free(m); return st; }
    *out = m;
    return MOE_OK;
}

void moe_model_free(moe_model *m) {
    if (!m) return;
    if (m->layers)
        for (int i = 0; i < m->info.n_layers + m->info.n_mtp; i++) moe_layer_store_free(m->layers[i]);
    free(m->layers);
    free(m->kinds);
    free(m->config_text);
    free(m->config_path);
    moe_ckpt_free(m->ckpt);
    free(m);
}

const moe_model_info *moe_model_get_info(const moe_model *m) { return &m->info; }

const char *moe_model_config_json(const moe_model *m) { return m->config_text; }

moe_ckpt *moe_model_ckpt(moe_model *m) { return m->ckpt; }

moe_status moe_model_find(moe_model *m, const char *name, const moe_st_tensor **t, moe_error *err) {
    char alt[512];
    if (strncmp(name, "model.", 6) == 0) snprintf(alt, sizeof alt, "%s", name + 6);
    else snprintf(alt, sizeof alt, "model.%s", name);
    const moe_st_tensor *x = NULL;
    TRY(moe_ckpt_lookup(m->ckpt, name, &x, err));
    if (!x) TRY(moe_ckpt_lookup(m->ckpt, alt, &x, err));
    if (!x) return moe_ckpt_find(m->ckpt, name, t, err); /* the missing-tensor message */
    *t = x;
    return MOE_OK;
}

/* ------------------------------------------------- float tensors as double */

/* Find `name`, check it is a float tensor of shape [ndim]; *n = its elements. */
static moe_status find_float(moe_model *m, const char *name, int ndim, const int64_t *shape,
                             const moe_st_tensor **out, size_t *n, moe_error *err) {
    const moe_st_tensor *t = NULL;
    TRY(moe_model_find(m, name, &t, err));
    const char *dir = moe_ckpt_dir(m->ckpt);
    if (!moe_dtype_is_float(t->dtype))
        return moe_errf(err, MOE_ERR_DTYPE, "%s: tensor %s has dtype %s; expected F64, F32, F16 or BF16", dir, name,
                        moe_dtype_name(t->dtype));
    bool ok = t->ndim == ndim;
    for (int i = 0; ok && i < ndim; i++) ok = t->shape[i] == shape[i];
    if (!ok) {
        char got[192] = "", want[192] = "";
        for (int i = 0; i < t->ndim; i++)
            snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", i ? ", " : "", (long long)t->shape[i]);
        for (int i = 0; i < ndim; i++)
            snprintf(want + strlen(want), sizeof want - strlen(want), "%s%lld", i ? ", " : "", (long long)shape[i]);
        return moe_errf(err, MOE_ERR_SHAPE, "%s: tensor %s has shape [%s]; the config implies [%s]", dir, name, got,
                        want);
    }
    size_t count = 1;
    for (int i = 0; i < ndim; i++) count *= (size_t)shape[i];
    *out = t;
    *n = count;
    return MOE_OK;
}

moe_status moe_model_load_f64(moe_model *m, const char *name, int ndim, const int64_t *shape, double *dst,
                              moe_error *err) {
    const moe_st_tensor *t;
    size_t n;
    TRY(find_float(m, name, ndim, shape, &t, &n, err));
    for (size_t i = 0; i < n; i++) dst[i] = moe_load_f64(t->data, t->dtype, i);
    return MOE_OK;
}

moe_status moe_model_load_f64_alloc(moe_model *m, const char *name, int ndim, const int64_t *shape,
                                    double **out, moe_error *err) {
    const moe_st_tensor *t;
    size_t n;
    TRY(find_float(m, name, ndim, shape, &t, &n, err));
    double *d = moe_malloc(n, sizeof *d);
    if (!d) return moe_errf(err, MOE_ERR_NOMEM, "out of memory for tensor %s [%zu]", name, n);
    for (size_t i = 0; i < n; i++) d[i] = moe_load_f64(t->data, t->dtype, i);
    *out = d;
    return MOE_OK;
}

/* *has = whether the checkpoint holds `name`; a read error is the error. */
static moe_status probe1(moe_model *m, const char *name, bool *has, moe_error *err) {
    const moe_st_tensor *t = NULL;
    *has = false;
    TRY(moe_ckpt_lookup(m->ckpt, name, &t, err));
    *has = t != NULL;
    return MOE_OK;
}

moe_status moe_model_probe(moe_model *m, const char *name, bool *has, moe_error *err) {
    char alt[512];
    if (strncmp(name, "model.", 6) == 0) snprintf(alt, sizeof alt, "%s", name + 6);
    else snprintf(alt, sizeof alt, "model.%s", name);
    TRY(probe1(m, name, has, err));
    if (!*has) TRY(probe1(m, alt, has, err));
    return MOE_OK;
}

moe_status moe_model_load_linear_f64_alloc(moe_model *m, const char *base, int64_t rows, int64_t cols, double **out,
                                           moe_error *err) {
    char b[400], probe[420];
    snprintf(b, sizeof b, "%s", base);
    snprintf(probe, sizeof probe, "%s.weight", b);
    bool has;
    TRY(probe1(m, probe, &has, err));
    if (!has) {
        char alt[400];
        if (strncmp(base, "model.", 6) == 0) snprintf(alt, sizeof alt, "%s", base + 6);
        else snprintf(alt, sizeof alt, "model.%s", base);
        snprintf(probe, sizeof probe, "%s.weight", alt);
        TRY(probe1(m, probe, &has, err));
        if (has) snprintf(b, sizeof b, "%s", alt);
    }
    moe_weight w;
    TRY(moe_weight_load(m->ckpt, b, rows, cols, &w, b, err));
    double *d = moe_malloc((size_t)(rows * cols), sizeof *d);
    if (!d) return moe_errf(err, MOE_ERR_NOMEM, "out of memory for %s [%lld, %lld]", b, (long long)rows, (long long)cols);
    for (int64_t r = 0; r < rows; r++) moe_weight_row_f64(&w, r, d + r * cols);
    *out = d;
    return MOE_OK;
}

moe_status moe_model_layer_kind(const moe_model *m, int layer, moe_layer_kind *kind, moe_error *err) {
    int nl = m->info.n_layers, nm = m->info.n_mtp;
    if (layer < 0 || layer >= nl + nm) {
        if (nm)
            return moe_errf(err, MOE_ERR_ARG,
                            "layer %d is out of range: the model has %d layers (0..%d) and %d MTP block%s (%d..%d)",
                            layer, nl, nl - 1, nm, nm == 1 ? "" : "s", nl, nl + nm - 1);
        return moe_errf(err, MOE_ERR_ARG, "layer %d is out of range: the model has %d layers (0..%d)", layer, nl,
                        nl - 1);
    }
    *kind = m->kinds[layer];
    return MOE_OK;
}

/* ------------------------------------------------------------ name maps */

typedef struct name_map {
    char ffn[96];        /* "model.layers.3.ffn" / "model.layers.1.mlp" / "mtp.0.ffn" */
    const char *bias;    /* correction bias tensor under <ffn>.gate. */
    const char *proj[3]; /* gate (w1), up (w3), down (w2) */
    /* stacked experts (ports that keep transformers' parameters):
     * "<ffn>.experts.gate_up_proj[.weight]" [E, 2I, H] (gate rows first) and
     * "<ffn>.experts.down_proj[.weight]" [E, H, I]; "" when per expert */
    char gate_up[128], down[128];
} name_map;

static const char *const v4_proj[3] = {"w1", "w3", "w2"};
static const char *const v3_proj[3] = {"gate_proj", "up_proj", "down_proj"};

/* Stacked expert tensors under nm->ffn, if the checkpoint has them (a
 * shard read error is that error). */
static moe_status find_stacked(moe_model *m, name_map *nm, moe_error *err) {
    nm->gate_up[0] = nm->down[0] = 0;
    static const char *const sfx[] = {"", ".weight"};
    for (int i = 0; i < 2 && !nm->gate_up[0]; i++) {
        char gu[128], dn[128];
        snprintf(gu, sizeof gu, "%s.experts.gate_up_proj%s", nm->ffn, sfx[i]);
        snprintf(dn, sizeof dn, "%s.experts.down_proj%s", nm->ffn, sfx[i]);
        bool hg, hd = false;
        TRY(probe1(m, gu, &hg, err));
        if (hg) TRY(probe1(m, dn, &hd, err));
        if (hg && hd) {
            snprintf(nm->gate_up, sizeof nm->gate_up, "%s", gu);
            snprintf(nm->down, sizeof nm->down, "%s", dn);
        }
    }
    return MOE_OK;
}

/* Find the layout that holds this layer's router: V4 names (layers.N.ffn,
 * the MTP blocks as mtp.K.ffn), HF V3 names (model.layers.N.mlp, the MTP
 * block as layer num_hidden_layers), each with or without "model.". */
static moe_status resolve_names(moe_model *m, int layer, name_map *nm, moe_error *err) {
    static const char *const prefixes[] = {"model.", ""};
    char probe[160];
    bool mtp = layer >= m->info.n_layers;
    for (int arch = 0; arch < 2; arch++) {
        bool v4 = (arch == 0) == (m->info.arch == MOE_ARCH_V4);
        for (int p = 0; p < 2; p++) {
            if (mtp && v4)
                snprintf(nm->ffn, sizeof nm->ffn, "%smtp.%d.ffn", prefixes[p], layer - m->info.n_layers);
            else
                snprintf(nm->ffn, sizeof nm->ffn, "%slayers.%d.%s", prefixes[p], layer, v4 ? "ffn" : "mlp");
            snprintf(probe, sizeof probe, "%s.gate.weight", nm->ffn);
            /* a shard that cannot be read is that error, not "no router" */
            const moe_st_tensor *t = NULL;
            TRY(moe_ckpt_lookup(m->ckpt, probe, &t, err));
            if (t) {
                nm->bias = v4 ? "bias" : "e_score_correction_bias";
                for (int k = 0; k < 3; k++) nm->proj[k] = v4 ? v4_proj[k] : v3_proj[k];
                return find_stacked(m, nm, err);
            }
        }
    }
    if (mtp)
        return moe_errf(err, MOE_ERR_MISSING,
                        "%s: no router for MTP block %d (layer %d; config.json num_nextn_predict_layers = %d): looked for "
                        "mtp.%d.ffn.gate.weight (DeepSeek V4) and model.layers.%d.mlp.gate.weight (HF V3), with and "
                        "without \"model.\"; some copies drop the MTP block",
                        moe_ckpt_dir(m->ckpt), layer - m->info.n_layers, layer, m->info.n_mtp,
                        layer - m->info.n_layers, layer);
    return moe_errf(err, MOE_ERR_MISSING,
                    "%s: no router for layer %d (looked for model.layers.%d.ffn.gate.weight, "
                    "layers.%d.ffn.gate.weight and model.layers.%d.mlp.gate.weight)",
                    moe_ckpt_dir(m->ckpt), layer, layer, layer, layer);
}

static moe_status load_tid2eid(moe_model *m, layer_store *s, const char *name, moe_error *err) {
    const moe_st_tensor *t;
    TRY(moe_ckpt_find(m->ckpt, name, &t, err));
    const char *dir = moe_ckpt_dir(m->ckpt);
    int K = m->top_k, E = m->n_experts;
    if (!moe_dtype_is_int(t->dtype))
        return moe_errf(err, MOE_ERR_DTYPE, "%s: tensor %s has dtype %s, expected an integer type", dir, name,
                        moe_dtype_name(t->dtype));
    if (t->ndim != 2 || t->shape[1] != K || t->shape[0] < 1 || t->shape[0] > MOE_MAX_VOCAB)
        return moe_errf(err, MOE_ERR_SHAPE, "%s: tensor %s must have shape [vocab, %d] with 1 <= vocab <= %d", dir,
                        name, K, MOE_MAX_VOCAB);
    int64_t vocab = t->shape[0];
    int32_t *ids = moe_malloc((size_t)(vocab * K), sizeof *ids);
    if (!ids) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; i < vocab * K; i++) {
        int64_t e = moe_load_i64(t->data, t->dtype, (size_t)i);
        if (e < 0 || e >= E) {
            free(ids);
            return moe_errf(err, MOE_ERR_FORMAT, "%s: tensor %s[%lld][%lld] = %lld is not an expert id in [0, %d)",
                            dir, name, (long long)(i / K), (long long)(i % K), (long long)e, E);
        }
        ids[i] = (int32_t)e;
    }
    s->tid2eid = ids;
    s->pub.tid2eid = ids;
    s->pub.cfg.vocab = (int)vocab;
    return MOE_OK;
}

/* Load layer `layer` with routed experts [e0, e1) (others left as empty
 * descriptors: rows = cols = 0, data NULL). */
static moe_status load_block(moe_model *m, int layer, moe_layer_kind kind, const name_map *nm, int e0, int e1,
                             layer_store **out, moe_error *err) {
    layer_store *s = moe_layer_store_new();
    if (!s) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    moe_layer *L = &s->pub;
    moe_block_config *c = &L->cfg;
    L->index = layer;
    c->kind = kind;
    c->hidden = m->hidden;
    c->inter = m->inter;
    c->n_experts = m->n_experts;
    c->top_k = m->top_k;
    c->n_shared = m->n_shared;
    c->n_group = kind == MOE_LAYER_HASH ? 1 : m->n_group;
    c->topk_group = kind == MOE_LAYER_HASH ? 1 : m->topk_group;
    c->vocab = m->vocab;
    c->score = m->score;
    c->renormalize = m->renormalize;
    c->scaling = m->scaling;
    c->swiglu_limit = m->swiglu_limit;

    int E = c->n_experts, H = c->hidden, I = c->inter;
    moe_status st = MOE_OK;
    char name[256];
    const moe_ckpt *ck = m->ckpt;
    (void)ck;

    snprintf(name, sizeof name, "%s.gate", nm->ffn);
    st = moe_weight_load(m->ckpt, name, E, H, &L->gate, moe_layer_store_name(s, name), err);
    if (st != MOE_OK) goto fail;

    snprintf(name, sizeof name, "%s.gate.%s", nm->ffn, nm->bias);
    const moe_st_tensor *probe = NULL;
    if (kind == MOE_LAYER_TOPK && (st = moe_ckpt_lookup(m->ckpt, name, &probe, err)) != MOE_OK) goto fail;
    if (kind == MOE_LAYER_TOPK && probe) {
        int64_t shape_e[1] = {E};
        st = moe_model_load_f64_alloc(m, name, 1, shape_e, &s->bias, err);
        if (st != MOE_OK) goto fail;
        L->bias = s->bias;
        c->has_bias = true;
    }
    if (kind == MOE_LAYER_HASH) {
        snprintf(name, sizeof name, "%s.gate.tid2eid", nm->ffn);
        st = load_tid2eid(m, s, name, err);
        if (st != MOE_OK) goto fail;
    }

    if (moe_layer_store_experts(s, E)) { st = moe_errf(err, MOE_ERR_NOMEM, "out of memory"); goto fail; }
    snprintf(name, sizeof name, "%s.experts.0.%s.weight", nm->ffn, nm->proj[0]);
    bool stacked = false;
    if (nm->gate_up[0]) {
        bool per_expert;
        st = probe1(m, name, &per_expert, err);
        if (st != MOE_OK) goto fail;
        stacked = !per_expert;
    }
    for (int e = e0; e < e1; e++) {
        for (int k = 0; k < 3; k++) {
            snprintf(name, sizeof name, "%s.experts.%d.%s", nm->ffn, e, nm->proj[k]);
            int rows = k == 2 ? H : I, cols = k == 2 ? I : H;
            moe_weight *w = &s->experts[(size_t)k * (size_t)E + (size_t)e];
            if (stacked) /* gate_up_proj rows [0, I) are w1 (gate), [I, 2I) w3 (up) */
                st = moe_weight_view_stacked(m->ckpt, k == 2 ? nm->down : nm->gate_up, name, e, k == 1 ? I : 0, rows,
                                             cols, w, moe_layer_store_name(s, name), err);
            else
                st = moe_weight_load(m->ckpt, name, rows, cols, w, moe_layer_store_name(s, name), err);
            if (st != MOE_OK) goto fail;
        }
    }

    /* Shared expert(s): one MLP whose width is n_shared * I (HF and V4 both
     * store the shared experts as one module). Presence decides, the config
     * count only cross-checks. */
    snprintf(name, sizeof name, "%s.shared_experts.%s.weight", nm->ffn, nm->proj[0]);
    const moe_st_tensor *t = NULL;
    if ((st = moe_ckpt_lookup(m->ckpt, name, &t, err)) != MOE_OK) goto fail;
    if (t) {
        if (t->ndim != 2 || t->shape[0] < 1 || t->shape[0] > MOE_MAX_SHARED * MOE_MAX_INTER) {
            st = moe_errf(err, MOE_ERR_SHAPE, "%s: tensor %s must have shape [n_shared * I, %d] with 1 <= rows <= %d",
                          moe_ckpt_dir(m->ckpt), name, H, MOE_MAX_SHARED * MOE_MAX_INTER);
            goto fail;
        }
        int Is = (int)t->shape[0];
        if (m->n_shared > 0 && Is != m->n_shared * I) {
            st = moe_errf(err, MOE_ERR_SHAPE, "%s: tensor %s has %d rows, expected n_shared_experts * "
                          "moe_intermediate_size = %d", moe_ckpt_dir(m->ckpt), name, Is, m->n_shared * I);
            goto fail;
        }
        moe_weight *sw[3] = {&L->sw1, &L->sw3, &L->sw2};
        for (int k = 0; k < 3; k++) {
            snprintf(name, sizeof name, "%s.shared_experts.%s", nm->ffn, nm->proj[k]);
            st = moe_weight_load(m->ckpt, name, k == 2 ? H : Is, k == 2 ? Is : H, sw[k], moe_layer_store_name(s, name), err);
            if (st != MOE_OK) goto fail;
        }
        c->shared_inter = Is;
        if (c->n_shared == 0) c->n_shared = 1;
    } else if (m->n_shared > 0) {
        st = moe_errf(err, MOE_ERR_MISSING, "%s: config says n_shared_experts = %d but tensor %s is missing",
                      moe_ckpt_dir(m->ckpt), m->n_shared, name);
        goto fail;
    }
    moe_layer_nvfp4_reconcile(L);
    /* a partial copy (expert parallelism): the layer-wide NVFP4 activation
     * scale is the largest over every expert, loaded here or not (the
     * input_scale scalars are read for that, nothing else) */
    if (e0 > 0 || e1 < E) {
        float m13 = 0.0f, m2 = 0.0f;
        for (int e = 0; e < E; e++)
            for (int k = 0; k < 3; k++) {
                const moe_st_tensor *is = NULL;
                snprintf(name, sizeof name, "%s.experts.%d.%s.input_scale", nm->ffn, e, nm->proj[k]);
                /* a probe that keeps a shard's read error (moe_ckpt_lookup) */
                if ((st = moe_ckpt_lookup(m->ckpt, name, &is, err)) != MOE_OK) goto fail;
                if (!is || !moe_dtype_is_float(is->dtype) || is->nbytes == 0) continue;
                double dv = moe_load_f64(is->data, is->dtype, 0);
                if (!(dv > 0) || !(dv <= FLT_MAX)) { /* a float: a larger double's cast is undefined */
                    st = moe_errf(err, MOE_ERR_FORMAT, "%s: %s = %g must be a positive finite float",
                                  moe_ckpt_dir(m->ckpt), name, dv);
                    goto fail;
                }
                float v = (float)dv;
                if (k < 2 && v > m13) m13 = v;
                if (k == 2 && v > m2) m2 = v;
            }
        for (int e = e0; e < e1; e++) {
            if (m13 > 0) s->experts[e].act_scale = s->experts[(size_t)E + (size_t)e].act_scale = m13;
            if (m2 > 0) s->experts[2 * (size_t)E + (size_t)e].act_scale = m2;
        }
    }
    *out = s;
    return MOE_OK;
fail:
    moe_layer_store_free(s);
    return st;
}

static moe_status load_layer(moe_model *m, int layer, int e0, int e1, layer_store **out, moe_error *err) {
    moe_layer_kind kind = MOE_LAYER_DENSE;
    TRY(moe_model_layer_kind(m, layer, &kind, err));
    if (kind == MOE_LAYER_DENSE)
        return moe_errf(err, MOE_ERR_ARG, "layer %d of %s is a dense layer: it has no MoE block", layer,
                        moe_ckpt_dir(m->ckpt));
    name_map nm;
    TRY(resolve_names(m, layer, &nm, err));
    return load_block(m, layer, kind, &nm, e0, e1, out, err);
}

moe_status moe_model_mtp_layer(moe_model *m, int k, moe_layer **out, moe_error *err) {
    return moe_model_mtp_layer_experts(m, k, 0, m->n_experts, out, err);
}

moe_status moe_model_mtp_layer_experts(moe_model *m, int k, int e_begin, int e_end, moe_layer **out,
                                       moe_error *err) {
    if (e_begin < 0 || e_end > m->n_experts || e_begin > e_end)
        return moe_errf(err, MOE_ERR_ARG, "expert range [%d, %d) is outside [0, %d)", e_begin, e_end, m->n_experts);
    if (m->info.arch != MOE_ARCH_V4)
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "%s: MTP blocks are read from DeepSeek V4 checkpoints only",
                        moe_ckpt_dir(m->ckpt));
    name_map nm;
    static const char *const prefixes[] = {"", "model."};
    for (int p = 0; p < 2; p++) {
        char probe[160];
        snprintf(nm.ffn, sizeof nm.ffn, "%smtp.%d.ffn", prefixes[p], k);
        snprintf(probe, sizeof probe, "%s.gate.weight", nm.ffn);
        const moe_st_tensor *t = NULL;
        TRY(moe_ckpt_lookup(m->ckpt, probe, &t, err)); /* a shard read error is that error */
        if (!t) continue;
        nm.bias = "bias";
        for (int i = 0; i < 3; i++) nm.proj[i] = v4_proj[i];
        TRY(find_stacked(m, &nm, err));
        layer_store *s = NULL;
        TRY(load_block(m, m->info.n_layers + k, MOE_LAYER_TOPK, &nm, e_begin, e_end, &s, err));
        *out = &s->pub;
        return MOE_OK;
    }
    return moe_errf(err, MOE_ERR_MISSING, "%s: no MTP block %d (looked for mtp.%d.ffn.gate.weight, with and without "
                    "\"model.\")", moe_ckpt_dir(m->ckpt), k, k);
}

moe_status moe_model_layer(moe_model *m, int layer, const moe_layer **out, moe_error *err) {
    moe_layer_kind kind = MOE_LAYER_DENSE;
    TRY(moe_model_layer_kind(m, layer, &kind, err));
    if (!m->layers[layer]) TRY(load_layer(m, layer, 0, m->n_experts, &m->layers[layer], err));
    *out = &m->layers[layer]->pub;
    return MOE_OK;
}

moe_status moe_model_layer_experts(moe_model *m, int layer, int e_begin, int e_end, moe_layer **out,
                                   moe_error *err) {
    if (e_begin < 0 || e_end > m->n_experts || e_begin > e_end)
        return moe_errf(err, MOE_ERR_ARG, "expert range [%d, %d) is outside [0, %d)", e_begin, e_end, m->n_experts);
    moe_layer_kind kind = MOE_LAYER_DENSE;
    TRY(moe_model_layer_kind(m, layer, &kind, err));
    layer_store *s = NULL;
    TRY(load_layer(m, layer, e_begin, e_end, &s, err));
    *out = &s->pub;
    return MOE_OK;
}

void moe_moe_layer_store_free(moe_layer *L) {
    /* pub is the first member of layer_store */
    moe_layer_store_free((layer_store *)(void *)L);
}
