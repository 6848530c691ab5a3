/*
 * Another engine's dump of MoE layers (safetensors), as moe_diagnose reads it.
 *
 * Names: unprefixed (hidden, moe_out, ...) for one layer, or "layers.N.<name>"
 * for many (what python/moeaudit_dump writes). Every float dtype is widened
 * to double; the storage dtype is kept, as evidence of the engine's precision.
 *
 * Invariants:
 *  1. A failed load leaves *d zeroed and owning nothing; messages name the
 *     file and the tensor (with its layer prefix).
 *  2. Shapes are checked against T (from hidden), H and E before any read.
 */
#include "core/core.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void moe_dump_free(moe_dump *d) {
    if (!d) return;
    free(d->hidden); free(d->moe_out); free(d->input_ids); free(d->router_logits);
    free(d->topk_ids); free(d->topk_weights); free(d->routed_out); free(d->shared_out);
    memset(d, 0, sizeof *d);
}

typedef struct dump_src {
    moe_st_file *f;
    const char *path;
    char prefix[32];       /* "" or "layers.N." */
} dump_src;

static const moe_st_tensor *find(const dump_src *s, const char *name, char *full, size_t cap) {
    snprintf(full, cap, "%s%s", s->prefix, name);
    return moe_st_find(s->f, full);
}

static moe_status load_float(const dump_src *s, const char *name, int64_t rows, int64_t cols, bool required,
                             double **out, moe_dtype *dt, moe_error *err) {
    char full[96];
    const moe_st_tensor *t = find(s, name, full, sizeof full);
    *out = NULL;
    if (dt) *dt = MOE_DTYPE_COUNT;
    if (!t) return required ? moe_errf(err, MOE_ERR_MISSING, "%s: dump has no tensor \"%s\"", s->path, full) : MOE_OK;
    if (!moe_dtype_is_float(t->dtype))
        return moe_errf(err, MOE_ERR_DTYPE, "%s: tensor %s has dtype %s; expected a float type", s->path, full,
                        moe_dtype_name(t->dtype));
    if (t->ndim != 2 || t->shape[0] != rows || (cols > 0 && t->shape[1] != cols))
        return moe_errf(err, MOE_ERR_SHAPE, "%s: tensor %s must have shape [%lld, %lld]", s->path, full,
                        (long long)rows, (long long)cols);
    int64_t n = t->shape[0] * t->shape[1];
    double *v = moe_malloc((size_t)n, sizeof *v);
    if (!v) return moe_errf(err, MOE_ERR_NOMEM, "out of memory reading %s", full);
    for (int64_t i = 0; i < n; i++) v[i] = moe_load_f64(t->data, t->dtype, (size_t)i);
    *out = v;
    if (dt) *dt = t->dtype;
    return MOE_OK;
}

static bool has_layers(const moe_st_file *f) {
    for (size_t i = 0; i < moe_st_count(f); i++)
        if (!strncmp(moe_st_at(f, i)->name, "layers.", 7)) return true;
    return false;
}

static moe_status load_ids(const dump_src *s, moe_dump *d, moe_error *err) {
    char full[96];
    int64_t T = d->T;
    int E = d->E;
    const moe_st_tensor *ids = find(s, "topk_ids", full, sizeof full);
    if (!ids) {
        if (find(s, "topk_weights", full, sizeof full))
            return moe_errf(err, MOE_ERR_MISSING, "%s: %s without %stopk_ids cannot be aligned to experts", s->path,
                            full, s->prefix);
        return MOE_OK;
    }
    if (!moe_dtype_is_int(ids->dtype) || ids->ndim != 2 || ids->shape[0] != T || ids->shape[1] < 1 ||
        ids->shape[1] > 1024)
        return moe_errf(err, MOE_ERR_SHAPE, "%s: tensor %s must be an integer tensor [%lld, K] (K <= 1024)", s->path,
                        full, (long long)T);
    d->n_cols = (int)ids->shape[1];
    d->topk_ids = moe_malloc((size_t)(T * d->n_cols), sizeof(int32_t));
    if (!d->topk_ids) return moe_errf(err, MOE_ERR_NOMEM, "out of memory reading %s", full);
    for (int64_t i = 0; i < T * d->n_cols; i++) {
        int64_t v = moe_load_i64(ids->data, ids->dtype, (size_t)i);
        if (v < 0 || v >= (int64_t)E + 64)
            return moe_errf(err, MOE_ERR_INPUT, "%s: %s[%lld][%lld] = %lld is not an expert id (E = %d)", s->path, full,
                            (long long)(i / d->n_cols), (long long)(i % d->n_cols), (long long)v, E);
        d->topk_ids[i] = (int32_t)v;
    }
    return load_float(s, "topk_weights", T, d->n_cols, false, &d->topk_weights, &d->weights_dtype, err);
}

static moe_status load_input_ids(const dump_src *s, moe_dump *d, moe_error *err) {
    char full[96];
    const moe_st_tensor *ti = find(s, "input_ids", full, sizeof full);
    if (!ti) return MOE_OK;
    int64_t n = ti->ndim == 1 ? ti->shape[0] : ti->ndim == 2 ? ti->shape[0] * ti->shape[1] : -1;
    if (!moe_dtype_is_int(ti->dtype) || n != d->T)
        return moe_errf(err, MOE_ERR_SHAPE, "%s: tensor %s must be an integer tensor [%lld]", s->path, full,
                        (long long)d->T);
    d->input_ids = moe_malloc((size_t)d->T, sizeof(int64_t));
    if (!d->input_ids) return moe_errf(err, MOE_ERR_NOMEM, "out of memory reading %s", full);
    for (int64_t t = 0; t < d->T; t++) d->input_ids[t] = moe_load_i64(ti->data, ti->dtype, (size_t)t);
    return MOE_OK;
}

moe_status moe_dump_load_layer(const char *path, int layer, int H, int E, moe_dump *d, moe_error *err) {
    memset(d, 0, sizeof *d);
    d->hidden_dtype = d->moe_out_dtype = d->logits_dtype = d->weights_dtype = MOE_DTYPE_COUNT;
    dump_src s = {.path = path};
    moe_status st = moe_st_open(path, &s.f, err);
    if (st != MOE_OK) return st;
    if (layer >= 0 && has_layers(s.f)) snprintf(s.prefix, sizeof s.prefix, "layers.%d.", layer);
    char full[96];
    const moe_st_tensor *h = find(&s, "hidden", full, sizeof full);
    if (!h || h->ndim != 2) {
        st = moe_errf(err, h ? MOE_ERR_SHAPE : MOE_ERR_MISSING, "%s: dump needs tensor \"%s\" [T, %d]%s", path, full, H,
                      layer >= 0 && s.prefix[0] ? " (is the layer in the dump? moeaudit diagnose --all lists them)" : "");
        moe_st_close(s.f);
        return st;
    }
    d->T = h->shape[0];
    d->H = H;
    d->E = E;
    d->layer = s.prefix[0] ? layer : -1;
    if (d->T == 0) {
        moe_st_close(s.f);
        memset(d, 0, sizeof *d);
        return moe_errf(err, MOE_ERR_INPUT, "%s: tensor %s has 0 tokens", path, full);
    }
    int64_t T = d->T;
    st = load_float(&s, "hidden", T, H, true, &d->hidden, &d->hidden_dtype, err);
    if (st == MOE_OK) st = load_float(&s, "moe_out", T, H, true, &d->moe_out, &d->moe_out_dtype, err);
    if (st == MOE_OK) st = load_float(&s, "router_logits", T, E, false, &d->router_logits, &d->logits_dtype, err);
    if (st == MOE_OK) st = load_float(&s, "routed_out", T, H, false, &d->routed_out, NULL, err);
    if (st == MOE_OK) st = load_float(&s, "shared_out", T, H, false, &d->shared_out, NULL, err);
    if (st == MOE_OK) st = load_ids(&s, d, err);
    if (st == MOE_OK) st = load_input_ids(&s, d, err);
    moe_st_close(s.f);
    if (st != MOE_OK) moe_dump_free(d);
    return st;
}

moe_status moe_dump_load(const char *path, int H, int E, moe_dump *d, moe_error *err) {
    return moe_dump_load_layer(path, -1, H, E, d, err);
}

moe_status moe_dump_layers(const char *path, int *layers, int cap, int *n, moe_error *err) {
    *n = 0;
    moe_st_file *f = NULL;
    moe_status st = moe_st_open(path, &f, err);
    if (st != MOE_OK) return st;
    /* collect, then sort ascending (insertion: dumps hold at most a few hundred layers) */
    int count = 0;
    for (size_t i = 0; i < moe_st_count(f); i++) {
        const char *name = moe_st_at(f, i)->name;
        int N = -1, used = 0;
        if (sscanf(name, "layers.%d.%n", &N, &used) < 1 || used == 0 || N < 0 || strcmp(name + used, "hidden") != 0)
            continue;
        if (count < cap) {
            int j = count;
            while (j > 0 && layers[j - 1] > N) { layers[j] = layers[j - 1]; j--; }
            layers[j] = N;
        }
        count++;
    }
    moe_st_close(f);
    *n = count;
    return MOE_OK;
}

moe_status moe_dump_drop(moe_dump *d, const char *names, moe_error *err) {
    const char *p = names;
    while (p && *p) {
        size_t len = strcspn(p, ",");
        char name[32];
        if (len == 0 || len >= sizeof name) return moe_errf(err, MOE_ERR_ARG, "cannot ignore \"%.*s\"", (int)len, p);
        memcpy(name, p, len);
        name[len] = 0;
        if (!strcmp(name, "input_ids")) { free(d->input_ids); d->input_ids = NULL; }
        else if (!strcmp(name, "router_logits")) { free(d->router_logits); d->router_logits = NULL; d->logits_dtype = MOE_DTYPE_COUNT; }
        else if (!strcmp(name, "topk_ids")) {
            free(d->topk_ids); free(d->topk_weights);
            d->topk_ids = NULL; d->topk_weights = NULL; d->n_cols = 0; d->weights_dtype = MOE_DTYPE_COUNT;
        } else if (!strcmp(name, "topk_weights")) { free(d->topk_weights); d->topk_weights = NULL; d->weights_dtype = MOE_DTYPE_COUNT; }
        else if (!strcmp(name, "routed_out")) { free(d->routed_out); d->routed_out = NULL; }
        else if (!strcmp(name, "shared_out")) { free(d->shared_out); d->shared_out = NULL; }
        else
            return moe_errf(err, MOE_ERR_ARG, "cannot ignore \"%s\": the optional tensors are input_ids, router_logits, "
                            "topk_ids, topk_weights, routed_out, shared_out", name);
        p += len;
        if (*p == ',') p++;
    }
    return MOE_OK;
}
