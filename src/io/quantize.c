/*
 * moe_quantize_checkpoint: write a quantized copy of a BF16/F16/F32
 * checkpoint in the layouts real releases use (docs/formats.md, "Checkpoint layouts the quantizer writes"):
 *
 *   routed experts MXFP4: "<base>.weight" U8 [out, in/2] + "<base>.scale" F8_E8M0 [out, in/32]
 *                         (DeepSeek V4 native; config "expert_dtype": "fp4")
 *   routed experts NVFP4: "<base>.weight" U8 [out, in/2] + "<base>.weight_scale" F8_E4M3 [out, in/16]
 *                         + "<base>.weight_scale_2" F32 [] (ModelOpt; hf_quant_config.json)
 *   FP8 128x128:          "<base>.weight" F8_E4M3 + "<base>.scale" F8_E8M0 (V4 names, power-of-two)
 *                         or "<base>.weight_scale_inv" F32 (HF V3 names, amax / 448)
 *
 * Invariants:
 *  1. Shards keep their file names and their tensors' order; the index, when
 *     the input has one, is rewritten to name the new companion tensors.
 *  2. Tensors that are not linear weights (norms, embeddings, the router,
 *     biases, tid2eid, hyper-connection parameters) are copied byte for byte.
 *  3. Nothing is written before everything that can be checked is: the
 *     config.json of the copy is built (and the input's checked) first.
 *  4. Every file is written (atomically) into a staging directory beside
 *     out_dir; only a complete copy is moved into out_dir, config.json
 *     last. On failure the staging directory is removed: out_dir is as it
 *     was.
 */
#include "core/core.h"
#include "io/files.h"
#include "io/io_quote.h"
#include "io/layer_store.h"
#include "io/model_util.h"
#include "moe_formats.h"
#include "moe_quant_fast.h"

/* Encoders: the *_fast versions (src/formats/quant_fast.c) are bit-identical
 * to the scalar references on every input (tests/test-quant-fast.c), ~30x
 * faster; the references remain the definition. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

const char *moe_qfmt_name(moe_qfmt q) {
    switch (q) {
    case MOE_Q_NONE: return "none";
    case MOE_Q_FP8: return "fp8";
    case MOE_Q_MXFP4: return "mxfp4";
    case MOE_Q_NVFP4: return "nvfp4";
    }
    return "?";
}

bool moe_qfmt_parse(const char *s, moe_qfmt *q) {
    for (int i = 0; i <= MOE_Q_NVFP4; i++)
        if (!strcmp(s, moe_qfmt_name((moe_qfmt)i))) { *q = (moe_qfmt)i; return true; }
    return false;
}

static bool has_suffix(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

/* A routed expert projection: "...experts.<digits>.<proj>.weight". */
static bool is_routed_expert(const char *name) {
    const char *p = strstr(name, ".experts.");
    if (!p || strstr(name, "shared_experts")) return false;
    p += 9;
    if (*p < '0' || *p > '9') return false;
    while (*p >= '0' && *p <= '9') p++;
    static const char *const proj[] = {".w1.weight", ".w2.weight", ".w3.weight", ".gate_proj.weight",
                                       ".up_proj.weight", ".down_proj.weight"};
    for (int i = 0; i < 6; i++)
        if (!strcmp(p, proj[i])) return true;
    return false;
}

/* Another linear layer that releases store in FP8: a 2-D float ".weight"
 * that is not an embedding, output head, norm, router or hyper-connection. */
static bool is_other_linear(const moe_st_tensor *t) {
    const char *n = t->name;
    if (t->ndim != 2 || !moe_dtype_is_float(t->dtype) || !has_suffix(n, ".weight")) return false;
    static const char *const skip[] = {"embed", "lm_head", "norm", ".gate.weight", "hc_", "head.weight"};
    for (int i = 0; i < 6; i++)
        if (strstr(n, skip[i])) return false;
    return true;
}

/* Output tensors are collected per shard; buffers owned here. */
typedef struct qshard {
    moe_st_entry *e;
    char **names;
    void **bufs;
    size_t n, cap;
} qshard;

static void qshard_free(qshard *q) {
    for (size_t i = 0; i < q->n; i++) { free(q->names[i]); free(q->bufs[i]); }
    free(q->e);
    free(q->names);
    free(q->bufs);
    memset(q, 0, sizeof *q);
}

/* Append an entry; `buf` (may be NULL when data points into the input map)
 * becomes owned by q. */
static moe_status qshard_add(qshard *q, const char *name, moe_dtype dt, int ndim, const int64_t *shape,
                             const void *data, void *buf, moe_error *err) {
    if (q->n == q->cap) {
        size_t cap = q->cap ? 2 * q->cap : 256;
        moe_st_entry *e = realloc(q->e, cap * sizeof *e);
        if (e) q->e = e;
        char **nm = realloc(q->names, cap * sizeof *nm);
        if (nm) q->names = nm;
        void **b = realloc(q->bufs, cap * sizeof *b);
        if (b) q->bufs = b;
        if (!e || !nm || !b) { free(buf); return moe_errf(err, MOE_ERR_NOMEM, "out of memory"); }
        q->cap = cap;
    }
    size_t len = strlen(name) + 1;
    char *nm = malloc(len);
    if (!nm) { free(buf); return moe_errf(err, MOE_ERR_NOMEM, "out of memory"); }
    memcpy(nm, name, len);
    moe_st_entry *e = &q->e[q->n];
    memset(e, 0, sizeof *e);
    e->name = nm;
    e->dtype = dt;
    e->ndim = ndim;
    for (int d = 0; d < ndim; d++) e->shape[d] = shape[d];
    e->data = data;
    q->names[q->n] = nm;
    q->bufs[q->n] = buf;
    q->n++;
    return MOE_OK;
}

static moe_status quantize_weight(layer_store *s, const moe_weight *src, moe_qfmt f, bool v4_scales,
                                  const moe_quant_opts *o, moe_weight *dst, moe_error *err);

/* One linear weight [rows, cols] of a file quantized to `f` (through
 * quantize_weight, the same code as in-memory quantization); companion
 * tensors are named from its base name as the release layouts name them. */
static moe_status quantize_linear(qshard *q, const moe_st_tensor *t, moe_qfmt f, const moe_quant_opts *o,
                                  moe_quant_report *rep, const char *file, moe_error *err) {
    int64_t rows = t->shape[0], cols = t->shape[1];
    char base[512], name[600];
    size_t bl = strlen(t->name) - strlen(".weight");
    if (bl >= sizeof base) return moe_errf(err, MOE_ERR_ARG, "%s: tensor name too long: %s", file, t->name);
    memcpy(base, t->name, bl);
    base[bl] = 0;
    for (int64_t i = 0; i < rows * cols; i++) {
        double v = moe_load_f64(t->data, t->dtype, (size_t)i);
        if (!isfinite(v))
            return moe_errf(err, MOE_ERR_INPUT, "%s: tensor %s[%lld][%lld] = %g is not finite: refusing to quantize",
                            file, t->name, (long long)(i / cols), (long long)(i % cols), v);
    }
    moe_weight src = {.fmt = t->dtype == MOE_DTYPE_F64 ? MOE_WFMT_F64 : t->dtype == MOE_DTYPE_F32 ? MOE_WFMT_F32
                             : t->dtype == MOE_DTYPE_F16 ? MOE_WFMT_F16 : MOE_WFMT_BF16,
                      .rows = rows, .cols = cols, .data = t->data, .scale2 = 1.0f, .name = t->name};
    bool v4_names = strstr(t->name, ".ffn.") != NULL || strstr(t->name, ".attn.") != NULL;
    layer_store tmp;
    memset(&tmp, 0, sizeof tmp);
    moe_weight w;
    moe_status st = quantize_weight(&tmp, &src, f, v4_names, o, &w, err);
    if (st != MOE_OK) {
        for (int i = 0; i < tmp.n_owned; i++) free(tmp.owned[i]);
        free(tmp.owned);
        char msg[sizeof err->msg];
        snprintf(msg, sizeof msg, "%s", err ? err->msg : "");
        return moe_errf(err, st, "%s: %s", file, msg);
    }
    /* tmp.owned = {data, scales}: hand them to the shard's entries */
    void *data = tmp.owned[0], *scales = tmp.owned[1];
    free(tmp.owned);
    int64_t shape[2] = {rows, f == MOE_Q_FP8 ? cols : cols / 2};
    st = qshard_add(q, t->name, f == MOE_Q_FP8 ? MOE_DTYPE_F8_E4M3 : MOE_DTYPE_U8, 2, shape, data, data, err);
    shape[0] = w.scale_rows;
    shape[1] = w.scale_cols;
    if (f == MOE_Q_MXFP4) {
        snprintf(name, sizeof name, "%s.scale", base);
        if (st == MOE_OK) st = qshard_add(q, name, MOE_DTYPE_F8_E8M0, 2, shape, scales, scales, err);
        else free(scales);
    } else if (f == MOE_Q_NVFP4) {
        snprintf(name, sizeof name, "%s.weight_scale", base);
        if (st == MOE_OK) st = qshard_add(q, name, MOE_DTYPE_F8_E4M3, 2, shape, scales, scales, err);
        else free(scales);
        float *s2 = malloc(sizeof *s2);
        if (s2) *s2 = w.scale2;
        snprintf(name, sizeof name, "%s.weight_scale_2", base);
        if (st == MOE_OK) st = s2 ? qshard_add(q, name, MOE_DTYPE_F32, 0, shape, s2, s2, err)
                                  : moe_errf(err, MOE_ERR_NOMEM, "out of memory");
        else free(s2);
    } else {
        snprintf(name, sizeof name, v4_names ? "%s.scale" : "%s.weight_scale_inv", base);
        if (st == MOE_OK)
            st = qshard_add(q, name, v4_names ? MOE_DTYPE_F8_E8M0 : MOE_DTYPE_F32, 2, shape, scales, scales, err);
        else free(scales);
    }
    if (st == MOE_OK) {
        rep->n_quantized++;
        rep->bytes_in += t->nbytes;
        rep->n_weights += (uint64_t)(rows * cols);
    }
    return st;
}

/* The output config.json (and hf_quant_config.json for NVFP4) as text,
 * built from the input's config before anything is written: *cfg_out and
 * *hf_out (NULL when not needed) are cJSON_Print strings the caller frees. */
static moe_status make_configs(const char *in_dir, const moe_quant_opts *o, bool v4, char **cfg_out, char **hf_out,
                               moe_error *err) {
    *cfg_out = *hf_out = NULL;
    char *path = moe_path_join(in_dir, "config.json");
    if (!path) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    char *text = NULL;
    size_t len = 0;
    moe_status st = moe_io_read_file(path, NULL, (size_t)64 << 20, &text, &len, err);
    if (st != MOE_OK) { free(path); return st; }
    cJSON *cfg = cJSON_ParseWithLength(text, len);
    free(text);
    if (!cJSON_IsObject(cfg)) {
        cJSON_Delete(cfg);
        st = moe_errf(err, MOE_ERR_FORMAT, "%s: not a JSON object", path);
        free(path);
        return st;
    }
    const char *dup = moe_json_dup_key(cfg);
    if (dup) {
        char q[160];
        st = moe_errf(err, MOE_ERR_FORMAT, "%s: key \"%s\" appears twice in one object", path,
                      moe_io_quote(dup, q, sizeof q));
        cJSON_Delete(cfg);
        free(path);
        return st;
    }
    free(path);
    cJSON_DeleteItemFromObjectCaseSensitive(cfg, "quantization_config");
    cJSON *qc = cJSON_CreateObject();
    bool fp8 = o->experts == MOE_Q_FP8 || o->others == MOE_Q_FP8;
    if (o->experts == MOE_Q_NVFP4) {
        cJSON_AddStringToObject(qc, "quant_method", "modelopt");
        cJSON_AddStringToObject(qc, "quant_algo", o->others == MOE_Q_FP8 ? "MIXED_PRECISION" : "NVFP4");
        cJSON_AddNumberToObject(qc, "group_size", 16);
    } else if (fp8 || o->experts == MOE_Q_MXFP4) {
        cJSON_AddStringToObject(qc, "quant_method", "fp8");
        if (v4) cJSON_AddStringToObject(qc, "fmt", "e4m3");
        cJSON_AddStringToObject(qc, "scale_fmt", v4 ? "ue8m0" : "float");
        cJSON_AddStringToObject(qc, "activation_scheme", "dynamic");
        cJSON *bs = cJSON_AddArrayToObject(qc, "weight_block_size");
        cJSON_AddItemToArray(bs, cJSON_CreateNumber(128));
        cJSON_AddItemToArray(bs, cJSON_CreateNumber(128));
    }
    cJSON_AddItemToObject(cfg, "quantization_config", qc);
    cJSON_DeleteItemFromObjectCaseSensitive(cfg, "expert_dtype");
    if (o->experts == MOE_Q_MXFP4) cJSON_AddStringToObject(cfg, "expert_dtype", "fp4");
    *cfg_out = cJSON_Print(cfg);
    cJSON_Delete(cfg);
    if (!*cfg_out) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    if (o->experts != MOE_Q_NVFP4) return MOE_OK;
    /* ModelOpt's own description of the quantization */
    cJSON *h = cJSON_CreateObject(), *qq = cJSON_AddObjectToObject(h, "quantization");
    cJSON_AddStringToObject(qq, "quant_algo", o->others == MOE_Q_FP8 ? "MIXED_PRECISION" : "NVFP4");
    cJSON_AddNumberToObject(qq, "group_size", 16);
    cJSON *ex = cJSON_AddArrayToObject(qq, "exclude_modules");
    cJSON_AddItemToArray(ex, cJSON_CreateString("lm_head"));
    cJSON_AddItemToArray(ex, cJSON_CreateString("*.gate"));
    *hf_out = cJSON_Print(h);
    cJSON_Delete(h);
    if (!*hf_out) {
        free(*cfg_out);
        *cfg_out = NULL;
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    }
    return MOE_OK;
}

/* The staging directory: every output file is written there first, and
 * only a complete set is moved to out_dir (published). */
typedef struct staging {
    char *dir;          /* "<parent of out>/.<name of out>.tmp.XXXXXX" */
    char **files;       /* [n] names written there, in publishing order */
    size_t n, cap;
} staging;

static moe_status staging_open(staging *g, const char *out_dir, moe_error *err) {
    memset(g, 0, sizeof *g);
    size_t l = strlen(out_dir);
    while (l > 1 && out_dir[l - 1] == '/') l--;
    const char *base = out_dir;
    for (size_t i = 0; i < l; i++)
        if (out_dir[i] == '/') base = out_dir + i + 1;
    size_t pl = (size_t)(base - out_dir), bl = l - pl;
    if (bl > 200) bl = 200;
    g->dir = malloc(pl + 1 + bl + 12 + 1);
    if (!g->dir) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    memcpy(g->dir, out_dir, pl);
    g->dir[pl] = '.';
    memcpy(g->dir + pl + 1, base, bl);
    memcpy(g->dir + pl + 1 + bl, ".tmp.XXXXXX", 12);
    if (!mkdtemp(g->dir)) {
        moe_status st = moe_errf(err, MOE_ERR_IO, "%s: cannot create a staging directory beside it: %s (nothing "
                                 "was written)", out_dir, strerror(errno));
        free(g->dir);
        g->dir = NULL;
        return st;
    }
    return MOE_OK;
}

/* Path of file `name` in the staging directory (caller frees); records it. */
static char *staging_path(staging *g, const char *name) {
    if (g->n == g->cap) {
        size_t nc = g->cap ? 2 * g->cap : 16;
        char **nf = realloc(g->files, nc * sizeof *nf);
        if (!nf) return NULL;
        g->files = nf;
        g->cap = nc;
    }
    char *copy = malloc(strlen(name) + 1);
    char *p = moe_path_join(g->dir, name);
    if (!copy || !p) { free(copy); free(p); return NULL; }
    strcpy(copy, name);
    g->files[g->n++] = copy;
    return p;
}

/* Remove the staging directory and what is left in it. */
static void staging_drop(staging *g) {
    if (!g->dir) return;
    for (size_t i = 0; i < g->n; i++) {
        char *p = moe_path_join(g->dir, g->files[i]);
        if (p) unlink(p);
        free(p);
        free(g->files[i]);
    }
    rmdir(g->dir);
    free(g->files);
    free(g->dir);
    memset(g, 0, sizeof *g);
}

/* Move the staged files into out_dir: one rename of the directory when
 * out_dir does not exist (or is empty), else file by file, config.json last
 * (each rename atomic: a reader never sees a partial file, and never a new
 * config.json before the shards it describes). */
static moe_status staging_publish(staging *g, const char *out_dir, bool out_exists, moe_error *err) {
    if (!out_exists || rmdir(out_dir) == 0) {
        if (rename(g->dir, out_dir) == 0) {
            for (size_t i = 0; i < g->n; i++) free(g->files[i]);
            free(g->files);
            free(g->dir);
            memset(g, 0, sizeof *g);
            return MOE_OK;
        }
        if (out_exists) mkdir(out_dir, 0755); /* put the empty directory back */
        if (errno != EEXIST && errno != ENOTEMPTY)
            return moe_errf(err, MOE_ERR_IO, "%s: cannot move the finished copy into place: %s (nothing was written)",
                            out_dir, strerror(errno));
    }
    for (size_t i = 0; i < g->n; i++) {
        char *from = moe_path_join(g->dir, g->files[i]), *to = moe_path_join(out_dir, g->files[i]);
        int rc = from && to ? rename(from, to) : -1;
        int e = from && to ? errno : ENOMEM;
        free(from);
        free(to);
        if (rc != 0)
            return moe_errf(err, MOE_ERR_IO, "%s/%s: cannot move into place: %s (%zu of %zu files were moved)",
                            out_dir, g->files[i], strerror(e), i, g->n);
    }
    staging_drop(g); /* files moved: only the directory is left */
    return MOE_OK;
}

moe_status moe_quantize_checkpoint(const char *in_dir, const char *out_dir, const moe_quant_opts *o,
                                   moe_quant_report *rep, moe_error *err) {
    memset(rep, 0, sizeof *rep);
    if (o->others != MOE_Q_NONE && o->others != MOE_Q_FP8)
        return moe_errf(err, MOE_ERR_ARG, "--others takes fp8 or none, not %s", moe_qfmt_name(o->others));
    struct stat a, b;
    if (stat(in_dir, &a) != 0) return moe_errf(err, MOE_ERR_IO, "%s: %s", in_dir, strerror(errno));
    bool out_exists = stat(out_dir, &b) == 0;
    if (out_exists && !S_ISDIR(b.st_mode))
        return moe_errf(err, MOE_ERR_ARG, "output %s exists and is not a directory", out_dir);
    if (out_exists && a.st_dev == b.st_dev && a.st_ino == b.st_ino)
        return moe_errf(err, MOE_ERR_ARG, "output directory %s is the input directory", out_dir);
    /* everything that can be checked is checked before the first byte is
     * written (#12: a bad config.json used to fail after the shards were
     * written): every shard readable and unquantized, the config parsed */
    moe_ckpt *ck = NULL;
    moe_status st = moe_ckpt_open(in_dir, &ck, err);
    if (st != MOE_OK) return st;
    bool v4 = false;
    for (size_t s = 0; s < moe_ckpt_n_shards(ck) && st == MOE_OK; s++) {
        moe_st_file *in = NULL;
        st = moe_ckpt_shard(ck, s, &in, err);
        for (size_t i = 0; st == MOE_OK && i < moe_st_count(in); i++) {
            const moe_st_tensor *t = moe_st_at(in, i);
            if (strstr(t->name, ".ffn.")) v4 = true;
            if (t->dtype == MOE_DTYPE_F8_E4M3 || t->dtype == MOE_DTYPE_F8_E8M0)
                st = moe_errf(err, MOE_ERR_DTYPE, "%s/%s: tensor %s is already quantized (%s): quantize takes a "
                              "BF16, F16 or F32 checkpoint", in_dir, moe_ckpt_shard_file(ck, s), t->name,
                              moe_dtype_name(t->dtype));
        }
    }
    char *cfg_text = NULL, *hf_text = NULL;
    if (st == MOE_OK) st = make_configs(in_dir, o, v4, &cfg_text, &hf_text, err);
    if (st != MOE_OK) { moe_ckpt_free(ck); return st; }
    staging g;
    st = staging_open(&g, out_dir, err);
    if (st != MOE_OK) { moe_ckpt_free(ck); free(cfg_text); free(hf_text); return st; }
    cJSON *index_map = moe_ckpt_has_index(ck) ? cJSON_CreateObject() : NULL;
    for (size_t s = 0; s < moe_ckpt_n_shards(ck) && st == MOE_OK; s++) {
        moe_st_file *in = NULL;
        const char *file = moe_ckpt_shard_file(ck, s);
        st = moe_ckpt_shard(ck, s, &in, err);
        if (st != MOE_OK) break;
        qshard q = {0};
        for (size_t i = 0; i < moe_st_count(in) && st == MOE_OK; i++) {
            const moe_st_tensor *t = moe_st_at(in, i);
            moe_qfmt f = MOE_Q_NONE;
            if (t->ndim == 2 && moe_dtype_is_float(t->dtype) && is_routed_expert(t->name)) f = o->experts;
            else if (is_other_linear(t)) f = o->others;
            size_t before = q.n;
            rep->n_tensors++;
            if (f == MOE_Q_NONE)
                st = qshard_add(&q, t->name, t->dtype, t->ndim, t->shape, t->data, NULL, err);
            else
                st = quantize_linear(&q, t, f, o, rep, file, err);
            if (index_map)
                for (size_t k = before; k < q.n; k++) cJSON_AddStringToObject(index_map, q.e[k].name, file);
        }
        if (st == MOE_OK) {
            char *path = staging_path(&g, file);
            static const char *const meta[] = {"format", "pt", "producer", "moeaudit quantize", NULL};
            st = path ? moe_st_write(path, q.e, q.n, meta, err) : moe_errf(err, MOE_ERR_NOMEM, "out of memory");
            free(path);
            for (size_t k = 0; k < q.n; k++) {
                uint64_t bytes = moe_dtype_size(q.e[k].dtype);
                for (int d = 0; d < q.e[k].ndim; d++) bytes *= (uint64_t)q.e[k].shape[d];
                if (q.bufs[k]) rep->bytes_out += bytes;
            }
        }
        qshard_free(&q);
    }
    if (st == MOE_OK && index_map) {
        cJSON *root = cJSON_CreateObject();
        cJSON_AddItemToObject(root, "metadata", cJSON_CreateObject());
        cJSON_AddItemToObject(root, "weight_map", index_map);
        index_map = NULL;
        char *text = cJSON_Print(root);
        cJSON_Delete(root);
        char *path = staging_path(&g, "model.safetensors.index.json");
        st = text && path ? moe_write_file(path, text, strlen(text), err) : moe_errf(err, MOE_ERR_NOMEM, "out of memory");
        free(path);
        free(text);
    }
    cJSON_Delete(index_map);
    moe_ckpt_free(ck);
    if (st == MOE_OK && hf_text) {
        char *path = staging_path(&g, "hf_quant_config.json");
        st = path ? moe_write_file(path, hf_text, strlen(hf_text), err) : moe_errf(err, MOE_ERR_NOMEM, "out of memory");
        free(path);
    }
    if (st == MOE_OK) { /* config.json last: published last */
        char *path = staging_path(&g, "config.json");
        st = path ? moe_write_file(path, cfg_text, strlen(cfg_text), err) : moe_errf(err, MOE_ERR_NOMEM, "out of memory");
        free(path);
    }
    free(cfg_text);
    free(hf_text);
    if (st == MOE_OK) st = staging_publish(&g, out_dir, out_exists, err);
    staging_drop(&g); /* on failure: nothing of the copy is left */
    return st;
}

/* ------------------------------------------------- in-memory quantization */

/* Quantize one weight into buffers owned by s; dst describes them. The
 * source is decoded in strips of 128 rows (one FP8 tile row) into a reused
 * buffer: never a whole float copy of the matrix. */
static moe_status quantize_weight(layer_store *s, const moe_weight *src, moe_qfmt f, bool v4_scales,
                                  const moe_quant_opts *o, moe_weight *dst, moe_error *err) {
    int64_t rows = src->rows, cols = src->cols;
    *dst = *src;
    if (f == MOE_Q_NONE || rows == 0) return MOE_OK;
    int blk = f == MOE_Q_MXFP4 ? 32 : f == MOE_Q_NVFP4 ? 16 : 1;
    if (cols % blk)
        return moe_errf(err, MOE_ERR_SHAPE, "weight %s has %lld input columns, not a multiple of the %s block %d",
                        src->name, (long long)cols, moe_qfmt_name(f), blk);
    const int64_t strip = 128;
    float *x = moe_malloc((size_t)(strip * cols), sizeof(float));
    if (!x) return moe_errf(err, MOE_ERR_NOMEM, "out of memory quantizing %s", src->name);
    int64_t gr = (rows + 127) / 128, gc = (cols + 127) / 128;
    bool fp4 = f == MOE_Q_MXFP4 || f == MOE_Q_NVFP4;
    uint8_t *data = moe_layer_store_adopt(s, moe_malloc((size_t)(fp4 ? rows * cols / 2 : rows * cols), 1));
    void *scales = moe_layer_store_adopt(s, fp4 ? moe_malloc((size_t)(rows * (cols / blk)), 1)
                                                : moe_malloc((size_t)(gr * gc), v4_scales ? 1 : sizeof(float)));
    if (!data || !scales) { free(x); return moe_errf(err, MOE_ERR_NOMEM, "out of memory quantizing %s", src->name); }
    if (f == MOE_Q_NVFP4) {
        /* weight_scale_2 depends on the tensor's amax alone: find it, then let
         * the reference helper compute the scale from {amax}. The amax is the
         * integer max of the |x| bit patterns (for non-negative floats integer
         * order is float order; a NaN, and only a NaN, makes it exceed
         * 0x7F800000): branch-free, so it vectorizes, and the same value as a
         * float max that lets a NaN win. */
        uint32_t amax_bits = 0;
        if (src->fmt == MOE_WFMT_BF16) {
            /* BF16 [rows, cols] widens to f32 by a 16-bit shift: the same
             * order, so the max of the stored bits is the amax, no decode */
            const uint16_t *d = src->data;
            uint32_t m16 = 0;
            for (int64_t i = 0; i < rows * cols; i++) {
                uint32_t a = d[i] & 0x7FFFu;
                m16 = a > m16 ? a : m16;
            }
            amax_bits = m16 << 16;
        } else {
            for (int64_t r0 = 0; r0 < rows; r0 += strip) {
                int64_t m = rows - r0 < strip ? rows - r0 : strip;
                for (int64_t r = 0; r < m; r++) moe_weight_row_f32(src, r0 + r, x + r * cols);
                for (int64_t i = 0; i < m * cols; i++) {
                    uint32_t a;
                    memcpy(&a, &x[i], sizeof a);
                    a &= 0x7FFFFFFFu;
                    amax_bits = a > amax_bits ? a : amax_bits;
                }
            }
        }
        float probe;
        memcpy(&probe, &amax_bits, sizeof probe);
        if (amax_bits > 0x7F800000u) probe = NAN;
        dst->scale2 = moe_nvfp4_scale2(&probe, 1);
    }
    for (int64_t r0 = 0; r0 < rows; r0 += strip) {
        int64_t m = rows - r0 < strip ? rows - r0 : strip;
        for (int64_t r = 0; r < m; r++) moe_weight_row_f32(src, r0 + r, x + r * cols);
        if (f == MOE_Q_MXFP4) {
            for (int64_t r = 0; r < m; r++)
                moe_mxfp4_quant_row_fast(x + r * cols, cols, (moe_mx_scale_rule)o->mx_scale_rule,
                                         (moe_e2m1_round)o->e2m1_round, data + (r0 + r) * (cols / 2),
                                         (uint8_t *)scales + (r0 + r) * (cols / 32));
        } else if (f == MOE_Q_NVFP4) {
            for (int64_t r = 0; r < m; r++)
                moe_nvfp4_quant_row_fast(x + r * cols, cols, dst->scale2, (moe_e2m1_round)o->e2m1_round,
                                         data + (r0 + r) * (cols / 2), (uint8_t *)scales + (r0 + r) * (cols / 16));
        } else if (v4_scales) {
            moe_fp8_block_quant_e8m0_fast(x, m, cols, data + r0 * cols, (uint8_t *)scales + (r0 / 128) * gc);
        } else {
            moe_fp8_block_quant_fast(x, m, cols, MOE_FP8_SCALE_F32, data + r0 * cols, (float *)scales + (r0 / 128) * gc);
        }
    }
    free(x);
    dst->data = data;
    dst->scale = scales;
    if (fp4) {
        dst->fmt = f == MOE_Q_MXFP4 ? MOE_WFMT_MXFP4 : MOE_WFMT_NVFP4;
        dst->scale_dtype = f == MOE_Q_MXFP4 ? MOE_DTYPE_F8_E8M0 : MOE_DTYPE_F8_E4M3;
        dst->scale_rows = rows;
        dst->scale_cols = cols / blk;
    } else {
        dst->fmt = MOE_WFMT_FP8_BLOCK;
        dst->scale_dtype = v4_scales ? MOE_DTYPE_F8_E8M0 : MOE_DTYPE_F32;
        dst->scale_rows = gr;
        dst->scale_cols = gc;
    }
    return MOE_OK;
}

moe_status moe_layer_quantize(const moe_layer *src, const moe_quant_opts *o, moe_layer **out, moe_error *err) {
    *out = NULL;
    const moe_block_config *c = &src->cfg;
    int E = c->n_experts;
    layer_store *s = moe_layer_store_new();
    if (!s || moe_layer_store_experts(s, E)) { moe_layer_store_free(s); return moe_errf(err, MOE_ERR_NOMEM, "out of memory"); }
    moe_layer *L = &s->pub;
    const moe_weight *w1 = L->w1, *w3 = L->w3, *w2 = L->w2;
    *L = *src; /* config, router, bias and tid2eid are shared with src */
    L->w1 = w1;
    L->w3 = w3;
    L->w2 = w2;
    bool v4_scales = c->score == MOE_SCORE_SQRTSOFTPLUS; /* V4 uses E8M0 FP8 scales */
    moe_status st = MOE_OK;
    int first_bad = INT_MAX; /* the error reported is the lowest matrix's: deterministic */
    /* the 3E routed matrices and the 3 shared ones, in parallel; buffers are
     * adopted under a critical section (the store's lists are not shared-safe) */
    int n = 3 * E + 3;
#pragma omp parallel for schedule(dynamic, 1)
    for (int q = 0; q < n; q++) {
        int k = q < 3 * E ? q / E : q - 3 * E, e = q < 3 * E ? q % E : -1;
        const moe_weight *from = e >= 0 ? (k == 0 ? &src->w1[e] : k == 1 ? &src->w3[e] : &src->w2[e])
                                        : (k == 0 ? &src->sw1 : k == 1 ? &src->sw3 : &src->sw2);
        moe_weight *to = e >= 0 ? &s->experts[(size_t)k * (size_t)E + (size_t)e] : (k == 0 ? &L->sw1 : k == 1 ? &L->sw3 : &L->sw2);
        layer_store tmp;
        memset(&tmp, 0, sizeof tmp);
        moe_error local;
        moe_status qs = quantize_weight(&tmp, from, e >= 0 ? o->experts : o->others, v4_scales, o, to, &local);
#pragma omp critical(moe_quant_adopt)
        {
            for (int i = 0; i < tmp.n_owned; i++)
                if (!moe_layer_store_adopt(s, tmp.owned[i]) && qs == MOE_OK)
                    qs = moe_errf(&local, MOE_ERR_NOMEM, "out of memory");
            if (qs != MOE_OK && q < first_bad) { first_bad = q; st = qs; if (err) *err = local; }
        }
        free(tmp.owned);
    }
    if (st != MOE_OK) { moe_layer_store_free(s); return st; }
    moe_layer_nvfp4_reconcile(L);
    *out = L;
    return MOE_OK;
}
