/*
 * Synthetic DeepSeek-style MoE layers, in memory (moe_synth_layer) or as a
 * real checkpoint directory (moe_synth_write: config.json +
 * model.safetensors, BF16, DeepSeek V4 or HF V3 names).
 *
 * Weights are drawn so that routing is realistic rather than uniform: router
 * rows have per-expert norms spread over a factor of 2 (popular and rare
 * experts), the correction bias is small, and expert weights are scaled
 * 1/sqrt(fan_in) so activations keep unit size. Values come from a
 * triangular distribution (sum of two uniforms, variance matched): cheap
 * enough to fill V4-Flash shapes (1.6 G weights a layer at 64 experts) in
 * seconds.
 *
 * Invariants:
 *  1. Deterministic in (seed, layer): every matrix has its own generator
 *     seeded from (seed, layer, matrix), so the thread count changes nothing.
 *  2. A written checkpoint loads back to the same values as the in-memory
 *     layer (the writer serialises the in-memory buffers).
 */
#include "core/core.h"
#include "io/layer_store.h"
#include "moe_formats.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>

moe_synth_opts moe_synth_opts_default(void) {
    moe_synth_opts o;
    memset(&o, 0, sizeof o);
    o.arch = MOE_ARCH_V4;
    o.hidden = 128;
    o.inter = 64;
    o.n_experts = 8;
    o.top_k = 2;
    o.n_layers = 2;
    o.n_hash_layers = 1;
    o.vocab = 64;
    o.n_group = 1;
    o.topk_group = 1;
    o.scaling = 1.5;
    o.swiglu_limit = 10.0;
    o.seed = 1;
    return o;
}

moe_synth_opts moe_synth_opts_v4flash(int n_experts) {
    moe_synth_opts o = moe_synth_opts_default();
    o.hidden = 4096;
    o.inter = 2048;
    o.n_experts = n_experts;
    o.top_k = 6;
    o.vocab = 129280;
    o.scaling = 1.5;
    o.swiglu_limit = 10.0;
    o.seed = 20261130;
    return o;
}


/* Triangular variate on (-1, 1) with variance 1/6, times sqrt(6): unit variance. */
static inline float tri(uint64_t r) {
    float u = (float)(uint32_t)r * 0x1p-32f, v = (float)(uint32_t)(r >> 32) * 0x1p-32f;
    return (u + v - 1.0f) * 2.4494897f;
}

static uint64_t seed_of(uint64_t seed, int layer, int matrix) {
    uint64_t s = seed ^ ((uint64_t)(layer + 1) * 0xD1B54A32D192ED03ull) ^ ((uint64_t)(matrix + 1) * 0x9E3779B97F4A7C15ull);
    moe_splitmix64(&s);
    return s;
}

/* BF16 [rows, cols]: unit variance times std * row_scale[r]. */
static uint16_t *bf16_matrix(uint64_t seed, int64_t rows, int64_t cols, double std, const double *row_scale) {
    uint16_t *m = moe_malloc((size_t)(rows * cols), sizeof *m);
    if (!m) return NULL;
    uint64_t s = seed;
    for (int64_t i = 0; i < rows; i++) {
        float k = (float)(std * (row_scale ? row_scale[i] : 1.0));
        for (int64_t j = 0; j < cols; j++) m[i * cols + j] = moe_bf16_from_f32(tri(moe_splitmix64(&s)) * k);
    }
    return m;
}

static void set_bf16(moe_weight *w, const uint16_t *data, int64_t rows, int64_t cols, const char *name) {
    memset(w, 0, sizeof *w);
    w->fmt = MOE_WFMT_BF16;
    w->rows = rows;
    w->cols = cols;
    w->data = data;
    w->scale2 = 1.0f;
    w->name = name;
}

static bool opts_ok(const moe_synth_opts *o) {
    return o->hidden >= 1 && o->inter >= 1 && o->n_experts >= 1 && o->top_k >= 1 && o->top_k <= o->n_experts &&
           o->n_layers >= 1 && o->n_hash_layers >= 0 && o->n_hash_layers <= o->n_layers &&
           (o->n_hash_layers == 0 || o->vocab >= 1) && o->n_group >= 1 && o->n_experts % o->n_group == 0 &&
           o->topk_group >= 1 && o->topk_group <= o->n_group && o->scaling > 0;
}

moe_status moe_synth_layer(const moe_synth_opts *o, int layer, moe_layer **out, moe_error *err) {
    *out = NULL;
    if (!opts_ok(o) || layer < 0 || layer >= o->n_layers)
        return moe_errf(err, MOE_ERR_ARG, "synthetic model options are inconsistent (layer %d)", layer);
    bool v4 = o->arch == MOE_ARCH_V4, hash = v4 && layer < o->n_hash_layers;
    int H = o->hidden, I = o->inter, E = o->n_experts, K = o->top_k;
    layer_store *s = moe_layer_store_new();
    if (!s || moe_layer_store_experts(s, E)) { moe_layer_store_free(s); return moe_errf(err, MOE_ERR_NOMEM, "out of memory"); }
    moe_layer *L = &s->pub;
    moe_block_config *c = &L->cfg;
    L->index = layer;
    c->kind = hash ? MOE_LAYER_HASH : MOE_LAYER_TOPK;
    c->hidden = H;
    c->inter = I;
    c->shared_inter = I;
    c->n_experts = E;
    c->top_k = K;
    c->n_shared = 1;
    c->n_group = v4 ? 1 : o->n_group;
    c->topk_group = v4 ? 1 : o->topk_group;
    c->vocab = o->vocab;
    c->score = v4 ? MOE_SCORE_SQRTSOFTPLUS : MOE_SCORE_SIGMOID;
    c->renormalize = true;
    c->has_bias = !hash;
    c->scaling = o->scaling;
    c->swiglu_limit = o->swiglu_limit;

    const char *ffn = v4 ? "ffn" : "mlp";
    const char *proj[3] = {v4 ? "w1" : "gate_proj", v4 ? "w3" : "up_proj", v4 ? "w2" : "down_proj"};
    char name[256];
    bool bad = false;
    /* router: expert popularity spread (row norms 0.7 .. 1.4) */
    uint64_t rs = seed_of(o->seed, layer, -1);
    double *row_scale = moe_malloc((size_t)E, sizeof(double));
    if (!row_scale) bad = true;
    for (int e = 0; !bad && e < E; e++) row_scale[e] = 0.7 + 0.7 * (double)(moe_splitmix64(&rs) >> 11) * 0x1p-53;
    snprintf(name, sizeof name, "model.layers.%d.%s.gate.weight", layer, ffn);
    uint16_t *g = bad ? NULL : moe_layer_store_adopt(s, bf16_matrix(seed_of(o->seed, layer, -2), E, H, 2.0 / sqrt((double)H), row_scale));
    free(row_scale);
    if (!g) bad = true;
    else set_bf16(&L->gate, g, E, H, moe_layer_store_name(s, name));
    if (!bad && hash) {
        s->tid2eid = moe_malloc((size_t)o->vocab * (size_t)K, sizeof(int32_t));
        if (!s->tid2eid) bad = true;
        for (int v = 0; !bad && v < o->vocab; v++)
            for (int j = 0; j < K; j++) {
                int32_t e;
                bool dup;
                do { /* distinct experts per token */
                    e = (int32_t)(moe_splitmix64(&rs) % (uint64_t)E);
                    dup = false;
                    for (int q = 0; q < j; q++) dup |= s->tid2eid[v * K + q] == e;
                } while (dup);
                s->tid2eid[v * K + j] = e;
            }
        L->tid2eid = s->tid2eid;
    } else if (!bad) {
        s->bias = moe_malloc((size_t)E, sizeof(double));
        if (!s->bias) bad = true;
        for (int e = 0; !bad && e < E; e++)
            s->bias[e] = moe_bf16_to_f32(moe_bf16_from_f32(0.05f * tri(moe_splitmix64(&rs))));
        L->bias = s->bias;
    }
    /* experts (index E: shared), each matrix from its own seed */
    uint16_t **bufs = moe_calloc((size_t)(E + 1) * 3, sizeof *bufs);
    if (!bufs) bad = true;
    if (!bad) {
#pragma omp parallel for schedule(dynamic, 1)
        for (int q = 0; q < (E + 1) * 3; q++) {
            int k = q % 3;
            int64_t rows = k == 2 ? H : I, cols = k == 2 ? I : H;
            bufs[q] = bf16_matrix(seed_of(o->seed, layer, q), rows, cols, 1.0 / sqrt((double)cols), NULL);
        }
        for (int q = 0; q < (E + 1) * 3; q++) {
            int e = q / 3, k = q % 3;
            int64_t rows = k == 2 ? H : I, cols = k == 2 ? I : H;
            uint16_t *b = moe_layer_store_adopt(s, bufs[q]);
            if (!b) { bad = true; for (int r = q + 1; r < (E + 1) * 3; r++) free(bufs[r]); break; }
            if (e < E) snprintf(name, sizeof name, "model.layers.%d.%s.experts.%d.%s.weight", layer, ffn, e, proj[k]);
            else snprintf(name, sizeof name, "model.layers.%d.%s.shared_experts.%s.weight", layer, ffn, proj[k]);
            moe_weight *w = e < E ? &s->experts[(size_t)k * (size_t)E + (size_t)e] : k == 0 ? &L->sw1 : k == 1 ? &L->sw3 : &L->sw2;
            set_bf16(w, b, rows, cols, moe_layer_store_name(s, name));
        }
    }
    free(bufs);
    if (bad) {
        moe_layer_store_free(s);
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory building synthetic layer %d (H %d, I %d, E %d)", layer, H, I, E);
    }
    *out = L;
    return MOE_OK;
}

/* ------------------------------------------------------------- writer */

static moe_status write_config(const char *dir, const moe_synth_opts *o, moe_error *err) {
    cJSON *c = cJSON_CreateObject();
    bool v4 = o->arch == MOE_ARCH_V4;
    cJSON_AddStringToObject(c, "model_type", v4 ? "deepseek_v4" : "deepseek_v3");
    cJSON_AddNumberToObject(c, "hidden_size", o->hidden);
    cJSON_AddNumberToObject(c, "moe_intermediate_size", o->inter);
    cJSON_AddNumberToObject(c, "n_routed_experts", o->n_experts);
    cJSON_AddNumberToObject(c, "num_experts_per_tok", o->top_k);
    cJSON_AddNumberToObject(c, "n_shared_experts", 1);
    cJSON_AddNumberToObject(c, "num_hidden_layers", o->n_layers);
    cJSON_AddNumberToObject(c, "vocab_size", o->vocab);
    cJSON_AddNumberToObject(c, "routed_scaling_factor", o->scaling);
    cJSON_AddBoolToObject(c, "norm_topk_prob", 1);
    if (o->swiglu_limit > 0) cJSON_AddNumberToObject(c, "swiglu_limit", o->swiglu_limit);
    if (v4) {
        cJSON_AddStringToObject(c, "scoring_func", "sqrtsoftplus");
        cJSON *types = cJSON_AddArrayToObject(c, "mlp_layer_types");
        for (int l = 0; l < o->n_layers; l++)
            cJSON_AddItemToArray(types, cJSON_CreateString(l < o->n_hash_layers ? "hash_moe" : "moe"));
    } else {
        cJSON_AddStringToObject(c, "scoring_func", "sigmoid");
        cJSON_AddNumberToObject(c, "n_group", o->n_group);
        cJSON_AddNumberToObject(c, "topk_group", o->topk_group);
        cJSON_AddNumberToObject(c, "first_k_dense_replace", 0);
    }
    char *text = cJSON_Print(c);
    cJSON_Delete(c);
    if (!text) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    char *path = moe_path_join(dir, "config.json");
    moe_status st = path ? moe_write_file(path, text, strlen(text), err) : moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    free(path);
    free(text);
    return st;
}

moe_status moe_synth_write(const char *dir, const moe_synth_opts *o, moe_error *err) {
    if (!opts_ok(o)) return moe_errf(err, MOE_ERR_ARG, "synthetic model options are inconsistent");
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return moe_errf(err, MOE_ERR_IO, "%s: cannot create: %s", dir, strerror(errno));
    int L = o->n_layers, E = o->n_experts, K = o->top_k;
    size_t per = 2 + 3 * ((size_t)E + 1);
    moe_st_entry *e = moe_calloc((size_t)L * per, sizeof *e);
    moe_layer **layers = moe_calloc((size_t)L, sizeof *layers);
    void **extra = moe_calloc((size_t)L, sizeof *extra);
    char (*names)[128] = moe_calloc((size_t)L * 2, sizeof *names);
    moe_status st = (e && layers && extra && names) ? MOE_OK : moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    size_t n = 0;
    const char *ffn = o->arch == MOE_ARCH_V4 ? "ffn" : "mlp";
    for (int l = 0; st == MOE_OK && l < L; l++) {
        st = moe_synth_layer(o, l, &layers[l], err);
        if (st != MOE_OK) break;
        const moe_layer *ly = layers[l];
        const moe_weight *ws[] = {&ly->gate};
        e[n++] = (moe_st_entry){.name = ws[0]->name, .dtype = MOE_DTYPE_BF16, .ndim = 2,
                                .shape = {ws[0]->rows, ws[0]->cols}, .data = ws[0]->data};
        if (ly->tid2eid) {
            int64_t *t = moe_malloc((size_t)ly->cfg.vocab * (size_t)K, sizeof *t);
            if (!t) { st = moe_errf(err, MOE_ERR_NOMEM, "out of memory"); break; }
            for (int64_t i = 0; i < (int64_t)ly->cfg.vocab * K; i++) t[i] = ly->tid2eid[i];
            extra[l] = t;
            snprintf(names[2 * l], sizeof names[0], "model.layers.%d.%s.gate.tid2eid", l, ffn);
            e[n++] = (moe_st_entry){.name = names[2 * l], .dtype = MOE_DTYPE_I64, .ndim = 2,
                                    .shape = {ly->cfg.vocab, K}, .data = t};
        } else {
            uint16_t *b = moe_malloc((size_t)E, sizeof *b);
            if (!b) { st = moe_errf(err, MOE_ERR_NOMEM, "out of memory"); break; }
            for (int x = 0; x < E; x++) b[x] = moe_bf16_from_f32((float)ly->bias[x]); /* exact: bias is bf16 */
            extra[l] = b;
            snprintf(names[2 * l], sizeof names[0], "model.layers.%d.%s.gate.%s", l, ffn,
                     o->arch == MOE_ARCH_V4 ? "bias" : "e_score_correction_bias");
            e[n++] = (moe_st_entry){.name = names[2 * l], .dtype = MOE_DTYPE_BF16, .ndim = 1, .shape = {E}, .data = b};
        }
        for (int x = 0; x <= E; x++)
            for (int k = 0; k < 3; k++) {
                const moe_weight *w = x < E ? (k == 0 ? &ly->w1[x] : k == 1 ? &ly->w3[x] : &ly->w2[x])
                                            : (k == 0 ? &ly->sw1 : k == 1 ? &ly->sw3 : &ly->sw2);
                e[n++] = (moe_st_entry){.name = w->name, .dtype = MOE_DTYPE_BF16, .ndim = 2,
                                        .shape = {w->rows, w->cols}, .data = w->data};
            }
    }
    if (st == MOE_OK) {
        char *path = moe_path_join(dir, "model.safetensors");
        static const char *const meta[] = {"format", "pt", "producer", "moeaudit synth", NULL};
        st = path ? moe_st_write(path, e, n, meta, err) : moe_errf(err, MOE_ERR_NOMEM, "out of memory");
        free(path);
    }
    for (int l = 0; layers && l < L; l++) { if (layers[l]) moe_layer_free(layers[l]); }
    for (int l = 0; extra && l < L; l++) free(extra[l]);
    free(e); free(layers); free(extra); free(names);
    if (st == MOE_OK) st = write_config(dir, o, err);
    return st;
}
