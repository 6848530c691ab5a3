/*
 * moe_quantize_checkpoint: write a quantized copy of a BF16/F16/F32
 * checkpoint as the release it imitates writes it (docs/formats.md, "What
 * quantize writes"; the published layouts it follows are cited there):
 *
 *   V4 names, experts mxfp4  -> deepseek-ai/DeepSeek-V4-Flash: routed experts
 *     (mtp.K.ffn.experts too) I8 [out, in/2] + .scale F8_E8M0 [out, in/32];
 *     with --others fp8: attn.{wq_a,wq_b,wkv,wo_a,wo_b}, attn.indexer.wq_b,
 *     ffn.shared_experts.w1|w2|w3, mtp.K.{e_proj,h_proj} F8_E4M3 + .scale
 *     F8_E8M0 128x128 (power of two); compressors, indexer.weights_proj,
 *     router, norms, embed and head as they were. config.json:
 *     quantization_config {activation_scheme, fmt, quant_method, scale_fmt
 *     ue8m0, weight_block_size}, expert_dtype "fp4"; index metadata
 *     {"total_size": bytes}.
 *   V4 names, experts nvfp4  -> nvidia/DeepSeek-V4-Flash-NVFP4: the above with
 *     routed experts U8 + weight_scale F8_E4M3 [out, in/16] + weight_scale_2
 *     F32 [] (w1 and w3 share one) + input_scale F32 []; config.json keeps
 *     the FP8 quantization_config and adds moe_quant_algo "NVFP4";
 *     hf_quant_config.json MIXED_PRECISION with per-layer quantized_layers and
 *     NVIDIA's exclude_modules.
 *   V4 names, experts fp8    -> the V4 layout with expert_dtype "fp8".
 *   HF V3 names, fp8         -> deepseek-ai/DeepSeek-V3 / R1: every linear of
 *     attention, the experts, shared experts, dense MLPs and the MTP eh_proj
 *     F8_E4M3 + weight_scale_inv F32 (amax / 448); quantization_config
 *     {activation_scheme, fmt "e4m3", quant_method, weight_block_size} (no
 *     scale_fmt); with ue8m0: power-of-two scales and scale_fmt "ue8m0"
 *     (V3.1).
 *   HF V3 names, nvfp4       -> nvidia/DeepSeek-R1-FP4 (ModelOpt): routed and
 *     shared experts and dense MLPs NVFP4 (+ input_scale), attention, router
 *     and the MTP layer BF16; hf_quant_config.json NVFP4 with exclude_modules
 *     (lm_head, every self_attn, the MTP layer); index metadata {}.
 *   HF V3 names, mxfp4       -> no release: experts as DeepSeek V4 stores MXFP4.
 *
 * NVFP4 input scales are calibrated (ModelOpt's rule) on the block inputs in
 * o->calib, or on built-in N(0, 1) tokens, through the moe_quant_calibrator
 * the caller hands in (io/quantize.h): routing is above this floor, so the
 * public moe_quantize_checkpoint(_with) lives in src/block/calibrate.c.
 *
 * Invariants:
 *  1. Shards keep their file names; each shard's tensors are written sorted
 *     by name (as safetensors writes headers) with __metadata__ {"format":
 *     "pt"}; the index, when the input has one, lists every output tensor.
 *  2. Tensors that are not quantized are copied byte for byte.
 *  3. Nothing is written before everything that can be checked is: every
 *     shard readable and unquantized, config.json parsed, the release
 *     chosen, NVFP4 weight amaxes and input scales calibrated, and the
 *     copy's config.json and hf_quant_config.json built in memory.
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
#include "io/quantize.h"
#include "io/weights.h"
#include "moe_formats.h"
#include "moe_quant_fast.h"

/* Encoders: the *_fast versions (src/formats/quant_fast.c) are bit-identical
 * to the scalar references on every input (tests/test-quant-fast.c), ~30x
 * faster; the references remain the definition. */
#include <cjson/cJSON.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <regex.h>
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

/* ----------------------------------------------------------- the releases */

typedef enum q_release { REL_CUSTOM, REL_DS_V4, REL_NV_V4_NVFP4, REL_DS_V3, REL_DS_V31, REL_MO_V3_NVFP4 } q_release;

static const char *const release_names[] = {
    "no release (MXFP4 experts on HF V3 names, stored as DeepSeek V4 stores MXFP4)",
    "deepseek-ai/DeepSeek-V4-Flash",
    "nvidia/DeepSeek-V4-Flash-NVFP4 (ModelOpt)",
    "deepseek-ai/DeepSeek-V3 / R1 (FP8, fp32 scales)",
    "deepseek-ai/DeepSeek-V3.1 (FP8, ue8m0 scales)",
    "nvidia/DeepSeek-R1-FP4 (ModelOpt NVFP4)",
};

/* What happens to one tensor. */
typedef enum q_act { QA_KEEP, QA_EXPERT, QA_FP8, QA_NVFP4 } q_act;

typedef struct qctx {
    q_release rel;
    bool v4;
    moe_qfmt experts, others;
    int n_layers;             /* num_hidden_layers: HF V3's MTP layer is this index */
    regex_t re_v4_expert, re_v4_fp8, re_v3_expert, re_v3_shared, re_v3_dense, re_v3_attn, re_v3_mtp;
} qctx;

static bool rmatch(const regex_t *re, const char *s) { return regexec(re, s, 0, NULL, 0) == 0; }

/* The layer index of a "...layers.<n>...." name, or -1. */
static int layer_of(const char *name) {
    const char *p = strstr(name, "layers.");
    if (!p || (p != name && p[-1] != '.')) return -1;
    p += 7;
    if (*p < '0' || *p > '9') return -1;
    return (int)strtol(p, NULL, 10);
}

static q_act classify(const qctx *q, const moe_st_tensor *t) {
    const char *n = t->name;
    if (t->ndim != 2 || !moe_dtype_is_float(t->dtype)) return QA_KEEP;
    if (q->v4) {
        if (rmatch(&q->re_v4_expert, n)) return QA_EXPERT;
        if (q->others == MOE_Q_FP8 && rmatch(&q->re_v4_fp8, n)) return QA_FP8;
        return QA_KEEP;
    }
    bool mtp = layer_of(n) == q->n_layers;
    if (q->rel == REL_MO_V3_NVFP4) {
        if (mtp) return QA_KEEP; /* exclude_modules "model.layers.<n>*" */
        if (rmatch(&q->re_v3_expert, n)) return QA_EXPERT;
        if (rmatch(&q->re_v3_shared, n) || rmatch(&q->re_v3_dense, n)) return QA_NVFP4;
        return QA_KEEP;
    }
    if (rmatch(&q->re_v3_expert, n)) return QA_EXPERT;
    if (q->others == MOE_Q_FP8 && (rmatch(&q->re_v3_shared, n) || rmatch(&q->re_v3_dense, n) ||
                                   rmatch(&q->re_v3_attn, n) || rmatch(&q->re_v3_mtp, n)))
        return QA_FP8;
    return QA_KEEP;
}

static moe_status qctx_init(qctx *q, moe_error *err) {
    static const char *const pats[] = {
        "(^|\\.)(layers|mtp)\\.[0-9]+\\.ffn\\.experts\\.[0-9]+\\.w[123]\\.weight$",
        "((^|\\.)(layers|mtp)\\.[0-9]+\\.attn\\.(wq_a|wq_b|wkv|wo_a|wo_b|indexer\\.wq_b)\\.weight$)|"
        "((^|\\.)(layers|mtp)\\.[0-9]+\\.ffn\\.(shared_experts\\.)?w[123]\\.weight$)|"
        "((^|\\.)mtp\\.[0-9]+\\.(e_proj|h_proj)\\.weight$)",
        "\\.mlp\\.experts\\.[0-9]+\\.(gate|up|down)_proj\\.weight$",
        "\\.mlp\\.shared_experts\\.(gate|up|down)_proj\\.weight$",
        "\\.layers\\.[0-9]+\\.mlp\\.(gate|up|down)_proj\\.weight$",
        "\\.self_attn\\.(q_proj|q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\\.wq_b|indexer\\.wk)\\.weight$",
        "\\.layers\\.[0-9]+\\.eh_proj\\.weight$",
    };
    regex_t *res[] = {&q->re_v4_expert, &q->re_v4_fp8, &q->re_v3_expert, &q->re_v3_shared, &q->re_v3_dense,
                      &q->re_v3_attn, &q->re_v3_mtp};
    for (int i = 0; i < 7; i++)
        if (regcomp(res[i], pats[i], REG_EXTENDED | REG_NOSUB) != 0) {
            for (int k = 0; k < i; k++) regfree(res[k]);
            return moe_errf(err, MOE_ERR_NOMEM, "quantize: cannot compile a name pattern");
        }
    return MOE_OK;
}

static void qctx_free(qctx *q) {
    regex_t *res[] = {&q->re_v4_expert, &q->re_v4_fp8, &q->re_v3_expert, &q->re_v3_shared, &q->re_v3_dense,
                      &q->re_v3_attn, &q->re_v3_mtp};
    for (int i = 0; i < 7; i++) regfree(res[i]);
}

/* ----------------------------------------------------- name -> value maps */

typedef struct fmap_ent {
    char *name;
    float v;
} fmap_ent;

typedef struct fmap {
    fmap_ent *e;
    size_t n, cap;
    bool sorted;
} fmap;

static int fmap_cmp(const void *a, const void *b) { return strcmp(((const fmap_ent *)a)->name, ((const fmap_ent *)b)->name); }

static bool fmap_put(fmap *m, const char *name, float v) {
    if (m->n == m->cap) {
        size_t c = m->cap ? 2 * m->cap : 256;
        fmap_ent *ne = realloc(m->e, c * sizeof *ne);
        if (!ne) return false;
        m->e = ne;
        m->cap = c;
    }
    size_t l = strlen(name) + 1;
    char *d = malloc(l);
    if (!d) return false;
    memcpy(d, name, l);
    m->e[m->n++] = (fmap_ent){d, v};
    m->sorted = false;
    return true;
}

static const float *fmap_get(fmap *m, const char *name) {
    if (!m->sorted) {
        qsort(m->e, m->n, sizeof *m->e, fmap_cmp);
        m->sorted = true;
    }
    fmap_ent key = {(char *)(uintptr_t)name, 0};
    fmap_ent *f = m->n ? bsearch(&key, m->e, m->n, sizeof *m->e, fmap_cmp) : NULL;
    return f ? &f->v : NULL;
}

static void fmap_free(fmap *m) {
    for (size_t i = 0; i < m->n; i++) free(m->e[i].name);
    free(m->e);
    memset(m, 0, sizeof *m);
}

/* The base name without ".weight" into buf. */
static void base_of(const char *wname, char *buf, size_t cap) {
    size_t l = strlen(wname);
    if (l > 7 && !strcmp(wname + l - 7, ".weight")) l -= 7;
    if (l >= cap) l = cap - 1;
    memcpy(buf, wname, l);
    buf[l] = 0;
}

/* The partner of a gate/up projection sharing its NVFP4 weight_scale_2 (w1
 * <-> w3, gate_proj <-> up_proj), or false. */
static bool partner_of(const char *base, char *buf, size_t cap) {
    size_t l = strlen(base);
    static const char *const pairs[][2] = {{".w1", ".w3"}, {".w3", ".w1"}, {".gate_proj", ".up_proj"},
                                           {".up_proj", ".gate_proj"}};
    for (int i = 0; i < 4; i++) {
        size_t k = strlen(pairs[i][0]);
        if (l > k && !strcmp(base + l - k, pairs[i][0])) {
            snprintf(buf, cap, "%.*s%s", (int)(l - k), base, pairs[i][1]);
            return true;
        }
    }
    return false;
}

/* ---------------------------------------------------------------- shards */

/* Output tensors of one shard; buffers owned here. */
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

/* Append an entry; `buf` (NULL when data points into the input map) becomes
 * owned by q, also on failure. */
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

static moe_status add_scalar(qshard *q, const char *name, float v, moe_error *err) {
    float *p = malloc(sizeof *p);
    if (!p) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    *p = v;
    int64_t none[1] = {0};
    return qshard_add(q, name, MOE_DTYPE_F32, 0, none, p, p, err);
}

static int entry_cmp(const void *a, const void *b) {
    return strcmp(((const moe_st_entry *)a)->name, ((const moe_st_entry *)b)->name);
}

static moe_status quantize_weight(layer_store *s, const moe_weight *src, moe_qfmt f, bool v4_scales, bool pow2,
                                  const moe_quant_opts *o, float scale2, moe_weight *dst, moe_error *err);

static float tensor_amax(const moe_st_tensor *t) {
    int64_t n = t->shape[0] * t->shape[1];
    float m = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float a = (float)fabs(moe_load_f64(t->data, t->dtype, (size_t)i));
        if (a > m) m = a;
    }
    return m;
}

/* One linear weight [rows, cols] of a file quantized to f (through
 * quantize_weight, the same code as in-memory quantization); companions
 * named as the release names them. scale2 (NVFP4) and in_scale (NVFP4
 * input_scale) come from the caller's maps; in_scale 0: none written. */
static moe_status quantize_linear(qshard *q, const qctx *c, const moe_st_tensor *t, moe_qfmt f,
                                  const moe_quant_opts *o, float scale2, float in_scale, moe_quant_report *rep,
                                  const char *file, moe_error *err) {
    int64_t rows = t->shape[0], cols = t->shape[1];
    char base[512], name[600];
    base_of(t->name, base, sizeof base);
    for (int64_t i = 0; i < rows * cols; i++) {
        double v = moe_load_f64(t->data, t->dtype, (size_t)i);
        if (!isfinite(v))
            return moe_errf(err, MOE_ERR_INPUT, "%s: tensor %s[%lld][%lld] = %g is not finite: refusing to quantize",
                            file, t->name, (long long)(i / cols), (long long)(i % cols), v);
    }
    moe_weight src = {.fmt = t->dtype == MOE_DTYPE_F64 ? MOE_WFMT_F64 : t->dtype == MOE_DTYPE_F32 ? MOE_WFMT_F32
                             : t->dtype == MOE_DTYPE_F16 ? MOE_WFMT_F16 : MOE_WFMT_BF16,
                      .rows = rows, .cols = cols, .data = t->data, .scale2 = 1.0f, .name = t->name};
    /* FP8 scales: E8M0 on V4 (and MXFP4 stays V4-style on V3 names);
     * fp32 weight_scale_inv on HF V3 (power-of-two values for V3.1) */
    bool e8m0 = c->v4;
    layer_store tmp;
    memset(&tmp, 0, sizeof tmp);
    moe_weight w;
    moe_status st = quantize_weight(&tmp, &src, f, e8m0, c->rel == REL_DS_V31, o, scale2, &w, err);
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
    /* packed FP4: I8 as DeepSeek writes MXFP4, U8 as ModelOpt writes NVFP4 */
    moe_dtype wdt = f == MOE_Q_FP8 ? MOE_DTYPE_F8_E4M3 : f == MOE_Q_MXFP4 ? MOE_DTYPE_I8 : MOE_DTYPE_U8;
    st = qshard_add(q, t->name, wdt, 2, shape, data, data, err);
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
        snprintf(name, sizeof name, "%s.weight_scale_2", base);
        if (st == MOE_OK) st = add_scalar(q, name, w.scale2, err);
        snprintf(name, sizeof name, "%s.input_scale", base);
        if (st == MOE_OK && in_scale > 0) st = add_scalar(q, name, in_scale, err);
    } else {
        snprintf(name, sizeof name, e8m0 ? "%s.scale" : "%s.weight_scale_inv", base);
        if (st == MOE_OK)
            st = qshard_add(q, name, e8m0 ? MOE_DTYPE_F8_E8M0 : MOE_DTYPE_F32, 2, shape, scales, scales, err);
        else free(scales);
    }
    if (st == MOE_OK) {
        rep->n_quantized++;
        rep->bytes_in += t->nbytes;
        rep->n_weights += (uint64_t)(rows * cols);
    }
    return st;
}

/* ------------------------------------------------------------ text files */

/* A JSON file of the input (config.json): through the FIFO-safe bounded
 * reader (io/files.h), a JSON object, no key twice in one object (parsers
 * disagree on which one wins: moe_json_dup_key). *out: caller deletes. */
static moe_status read_json(const char *path, cJSON **out, moe_error *err) {
    char *text = NULL;
    size_t len = 0;
    moe_status st = moe_io_read_file(path, NULL, (size_t)64 << 20, &text, &len, err);
    if (st != MOE_OK) return st;
    cJSON *j = cJSON_ParseWithLength(text, len);
    free(text);
    if (!cJSON_IsObject(j)) { cJSON_Delete(j); return moe_errf(err, MOE_ERR_FORMAT, "%s: not a JSON object", path); }
    const char *dup = moe_json_dup_key(j);
    if (dup) {
        char q[160];
        st = moe_errf(err, MOE_ERR_FORMAT, "%s: key \"%s\" appears twice in one object", path,
                      moe_io_quote(dup, q, sizeof q));
        cJSON_Delete(j);
        return st;
    }
    *out = j;
    return MOE_OK;
}

/* j printed as the releases' JSON files are (cJSON's tab-indented print and a
 * final newline) into *text (caller frees); deletes j. */
static moe_status json_text(cJSON *j, const char *file, char **text, moe_error *err) {
    char *s = j ? cJSON_Print(j) : NULL;
    cJSON_Delete(j);
    size_t l = s ? strlen(s) : 0;
    char *t = s ? realloc(s, l + 2) : NULL;
    if (!t) {
        free(s);
        *text = NULL;
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory building %s", file);
    }
    t[l] = '\n';
    t[l + 1] = 0;
    *text = t;
    return MOE_OK;
}

/* DeepSeek's FP8 quantization_config, keys in its (alphabetical) order. */
static cJSON *ds_fp8_qc(bool fmt, bool ue8m0) {
    cJSON *qc = cJSON_CreateObject();
    cJSON_AddStringToObject(qc, "activation_scheme", "dynamic");
    if (fmt) cJSON_AddStringToObject(qc, "fmt", "e4m3");
    cJSON_AddStringToObject(qc, "quant_method", "fp8");
    if (ue8m0) cJSON_AddStringToObject(qc, "scale_fmt", "ue8m0");
    cJSON *bs = cJSON_AddArrayToObject(qc, "weight_block_size");
    cJSON_AddItemToArray(bs, cJSON_CreateNumber(128));
    cJSON_AddItemToArray(bs, cJSON_CreateNumber(128));
    return qc;
}

/* The copy's config.json as text (*text, caller frees), built before
 * anything is written: the input's config `cfg` (taken: deleted here) with
 * the quantization keys the imitated release carries. */
static moe_status make_config(cJSON *cfg, const qctx *c, const moe_quant_opts *o, const moe_quant_file_opts *fo,
                              char **text, moe_error *err) {
    cJSON *tc = cJSON_GetObjectItemCaseSensitive(cfg, "text_config");
    static const char *const drop[] = {"quantization_config", "expert_dtype", "moe_quant_algo"};
    for (int i = 0; i < 3; i++) {
        cJSON_DeleteItemFromObjectCaseSensitive(cfg, drop[i]);
        if (cJSON_IsObject(tc)) cJSON_DeleteItemFromObjectCaseSensitive(tc, drop[i]);
    }
    bool any_fp8 = o->experts == MOE_Q_FP8 || o->others == MOE_Q_FP8;
    switch (c->rel) {
    case REL_DS_V4:
    case REL_NV_V4_NVFP4:
        if (any_fp8) {
            cJSON *qc = ds_fp8_qc(true, true);
            if (c->rel == REL_NV_V4_NVFP4) cJSON_AddStringToObject(qc, "moe_quant_algo", "NVFP4");
            cJSON_AddItemToObject(cfg, "quantization_config", qc);
        } else if (c->rel == REL_NV_V4_NVFP4) {
            cJSON *qc = cJSON_CreateObject();
            cJSON_AddStringToObject(qc, "moe_quant_algo", "NVFP4");
            cJSON_AddItemToObject(cfg, "quantization_config", qc);
        }
        cJSON_AddStringToObject(cfg, "expert_dtype", o->experts == MOE_Q_FP8 ? "fp8" : "fp4");
        break;
    case REL_DS_V3:
    case REL_DS_V31:
        cJSON_AddItemToObject(cfg, "quantization_config", ds_fp8_qc(true, c->rel == REL_DS_V31));
        break;
    case REL_MO_V3_NVFP4:
        break; /* ModelOpt's declaration is hf_quant_config.json */
    case REL_CUSTOM:
        if (any_fp8) cJSON_AddItemToObject(cfg, "quantization_config", ds_fp8_qc(true, fo->ue8m0));
        cJSON_AddStringToObject(cfg, "expert_dtype", "fp4");
        break;
    }
    return json_text(cfg, "config.json", text, err);
}

/* hf_quant_config.json as ModelOpt writes it for the two NVFP4 releases, as
 * text (*text, caller frees). expert_layers: the "<...>.ffn.experts" modules
 * quantized (V4). */
static moe_status make_hf_quant_config(const qctx *c, char **expert_layers, int n_el, char **text, moe_error *err) {
    cJSON *h = cJSON_CreateObject(), *pr = cJSON_AddObjectToObject(h, "producer");
    cJSON *q = cJSON_AddObjectToObject(h, "quantization");
    cJSON_AddStringToObject(pr, "name", "modelopt");
    if (c->rel == REL_NV_V4_NVFP4) {
        cJSON_AddStringToObject(pr, "version", "dsv4-nvfp4-experts");
        cJSON_AddStringToObject(q, "quant_algo", "MIXED_PRECISION");
        cJSON_AddNullToObject(q, "kv_cache_quant_algo");
        cJSON_AddNumberToObject(q, "group_size", 16);
        cJSON *ql = cJSON_AddObjectToObject(q, "quantized_layers");
        for (int i = 0; i < n_el; i++) {
            cJSON *e = cJSON_AddObjectToObject(ql, expert_layers[i]);
            cJSON_AddStringToObject(e, "quant_algo", "NVFP4");
            cJSON_AddNumberToObject(e, "group_size", 16);
        }
        static const char *const ex[] = {"*.attn.*", "*.attn_norm.*", "*.ffn.shared_experts.*", "*.ffn.gate.*",
                                         "*.ffn_norm.*", "embed.weight", "head.weight", "*.hc_*", "*.h_proj.*",
                                         "*.e_proj.*", "*.enorm.*", "*.hnorm.*", "mtp.*.norm.*", "norm.weight"};
        cJSON *xl = cJSON_AddArrayToObject(q, "exclude_modules");
        for (size_t i = 0; i < sizeof ex / sizeof ex[0]; i++) cJSON_AddItemToArray(xl, cJSON_CreateString(ex[i]));
    } else {
        cJSON_AddStringToObject(pr, "version", "0.23.0");
        cJSON_AddStringToObject(q, "quant_algo", "NVFP4");
        cJSON_AddNullToObject(q, "kv_cache_quant_algo");
        cJSON_AddNumberToObject(q, "group_size", 16);
        cJSON *xl = cJSON_AddArrayToObject(q, "exclude_modules");
        cJSON_AddItemToArray(xl, cJSON_CreateString("lm_head"));
        char s[64];
        for (int l = 0; l < c->n_layers; l++) {
            snprintf(s, sizeof s, "model.layers.%d.self_attn*", l);
            cJSON_AddItemToArray(xl, cJSON_CreateString(s));
        }
        snprintf(s, sizeof s, "model.layers.%d*", c->n_layers);
        cJSON_AddItemToArray(xl, cJSON_CreateString(s));
    }
    return json_text(h, "hf_quant_config.json", text, err);
}

/* -------------------------------------------------------------- staging */
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

/* Write `text` as file `name` of the staging directory (atomically). */
static moe_status stage_text(staging *g, const char *name, const char *text, moe_error *err) {
    char *path = staging_path(g, name);
    moe_status st = path ? moe_write_file(path, text, strlen(text), err) : moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    free(path);
    return st;
}

/* ------------------------------------------------------------ calibration */

/* The calibration tokens: o->calib's "hidden" [T, H] (+ "input_ids" [T]),
 * or T built-in N(0, 1) tokens (moe_splitmix64_gauss4, fixed seed) with
 * uniform ids below vocab. */
static moe_status calib_tokens(const moe_quant_file_opts *o, int H, int vocab, double **hid, int64_t **ids, int64_t *T,
                               moe_quant_report *rep, moe_error *err) {
    *hid = NULL;
    *ids = NULL;
    if (o->calib) {
        moe_st_file *f = NULL;
        moe_status st = moe_st_open(o->calib, &f, err);
        if (st != MOE_OK) return st;
        const moe_st_tensor *h = moe_st_find(f, "hidden"), *id = moe_st_find(f, "input_ids");
        if (!h || !moe_dtype_is_float(h->dtype) || h->ndim != 2 || h->shape[1] != H || h->shape[0] < 1) {
            moe_st_close(f);
            return moe_errf(err, MOE_ERR_INPUT, "%s: calibration needs a float tensor \"hidden\" [T, %d] (the MoE block "
                            "inputs)", o->calib, H);
        }
        *T = h->shape[0];
        *hid = moe_malloc((size_t)(*T * H), sizeof(double));
        *ids = moe_calloc((size_t)*T, sizeof(int64_t));
        if (!*hid || !*ids) { moe_st_close(f); return moe_errf(err, MOE_ERR_NOMEM, "out of memory"); }
        for (int64_t i = 0; i < *T * H; i++) (*hid)[i] = moe_load_f64(h->data, h->dtype, (size_t)i);
        if (id && moe_dtype_is_int(id->dtype) && id->ndim == 1 && id->shape[0] == *T)
            for (int64_t t = 0; t < *T; t++) (*ids)[t] = moe_load_i64(id->data, id->dtype, (size_t)t);
        else
            for (int64_t t = 0; t < *T; t++) (*ids)[t] = vocab > 0 ? t % vocab : 0;
        moe_st_close(f);
        snprintf(rep->calib, sizeof rep->calib, "%lld tokens of %s", (long long)*T, o->calib);
        return MOE_OK;
    }
    *T = o->calib_tokens > 0 ? o->calib_tokens : 256;
    *hid = moe_malloc((size_t)(*T * H), sizeof(double));
    *ids = moe_calloc((size_t)*T, sizeof(int64_t));
    if (!*hid || !*ids) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    uint64_t seed = 0x6d6f6563616c6962ull; /* "moecalib" */
    for (int64_t i = 0; i < *T * H; i++) (*hid)[i] = moe_splitmix64_gauss4(&seed);
    for (int64_t t = 0; t < *T; t++) (*ids)[t] = vocab > 0 ? (int64_t)(moe_splitmix64(&seed) % (uint64_t)vocab) : 0;
    snprintf(rep->calib, sizeof rep->calib, "%lld built-in N(0, 1) tokens (pass a calibration file for real block "
             "inputs)", (long long)*T);
    return MOE_OK;
}

/* Input amaxes of every NVFP4-bound linear, by base name: routed experts
 * through their layer's router, shared experts and dense MLPs over every
 * token (moe_layer_calib_amax, moe_swiglu_amax). */
static moe_status calibrate(const char *in_dir, moe_ckpt *ck, const qctx *c, const moe_quant_file_opts *o,
                            const moe_quant_calibrator *cal, fmap *in_amax, moe_quant_report *rep, moe_error *err) {
    moe_model *m = NULL;
    moe_status st = moe_model_open(in_dir, &m, err);
    if (st != MOE_OK) return st;
    const moe_model_info *info = moe_model_get_info(m);
    double *hid = NULL;
    int64_t *ids = NULL, T = 0;
    st = calib_tokens(o, info->hidden, info->vocab, &hid, &ids, &T, rep, err);
    float *X = st == MOE_OK ? moe_malloc((size_t)(T * info->hidden), sizeof(float)) : NULL;
    if (st == MOE_OK && !X) st = moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    for (int64_t i = 0; st == MOE_OK && i < T * info->hidden; i++) X[i] = (float)hid[i];
    int last = c->rel == REL_MO_V3_NVFP4 ? info->n_layers : info->n_layers + info->n_mtp;
    for (int l = 0; st == MOE_OK && l < last; l++) {
        moe_layer_kind kind;
        if ((st = moe_model_layer_kind(m, l, &kind, err)) != MOE_OK) break;
        if (kind == MOE_LAYER_DENSE) {
            if (c->rel != REL_MO_V3_NVFP4) continue;
            char base[3][96];
            static const char *const p[3] = {"gate_proj", "up_proj", "down_proj"};
            for (int k = 0; k < 3; k++) snprintf(base[k], sizeof base[k], "model.layers.%d.mlp.%s", l, p[k]);
            char wn[128];
            snprintf(wn, sizeof wn, "%s.weight", base[0]);
            const moe_st_tensor *t; /* a probe that keeps a shard's read error (moe_ckpt_lookup) */
            if ((st = moe_ckpt_lookup(ck, wn, &t, err)) != MOE_OK) break;
            if (!t) continue;
            moe_weight g, u;
            int64_t Id = t->shape[0];
            if ((st = moe_weight_load(ck, base[0], Id, info->hidden, &g, NULL, err)) != MOE_OK) break;
            if ((st = moe_weight_load(ck, base[1], Id, info->hidden, &u, NULL, err)) != MOE_OK) break;
            float a13, a2;
            if ((st = cal->swiglu_amax(&g, &u, 0.0, X, T, &a13, &a2, err)) != MOE_OK) break;
            if (!fmap_put(in_amax, base[0], a13) || !fmap_put(in_amax, base[1], a13) || !fmap_put(in_amax, base[2], a2))
                st = moe_errf(err, MOE_ERR_NOMEM, "out of memory");
            continue;
        }
        const moe_layer *L;
        if ((st = moe_model_layer(m, l, &L, err)) != MOE_OK) break;
        moe_calib_amax a;
        if ((st = cal->layer_amax(L, hid, ids, T, &a, err)) != MOE_OK) break;
        for (int e = 0; e < a.E; e++) rep->n_uncalibrated += a.tokens[e] == 0;
        cal->fill_uncalibrated(&a);
        bool ok = true;
        for (int e = 0; e < a.E && ok; e++) {
            char b[300];
            base_of(L->w1[e].name, b, sizeof b);
            ok = fmap_put(in_amax, b, a.in13[e]);
            base_of(L->w3[e].name, b, sizeof b);
            ok = ok && fmap_put(in_amax, b, a.in13[e]);
            base_of(L->w2[e].name, b, sizeof b);
            ok = ok && fmap_put(in_amax, b, a.in2[e]);
        }
        if (ok && L->cfg.shared_inter > 0) {
            ok = fmap_put(in_amax, L->sw1.name, a.shared_in13) && fmap_put(in_amax, L->sw3.name, a.shared_in13) &&
                 fmap_put(in_amax, L->sw2.name, a.shared_in2);
        }
        cal->amax_free(&a);
        if (!ok) st = moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    }
    free(X);
    free(hid);
    free(ids);
    moe_model_free(m);
    return st;
}

/* ---------------------------------------------------------------- driver */

/* Whether config `cfg` (or its text_config) names a V4 model; *n_layers its
 * num_hidden_layers (-1 when absent). */
static bool config_v4(const cJSON *cfg, int *n_layers) {
    const cJSON *src = cfg, *tc = cJSON_GetObjectItemCaseSensitive(cfg, "text_config");
    if (cJSON_IsObject(tc)) src = tc;
    const cJSON *mt = cJSON_GetObjectItemCaseSensitive(src, "model_type");
    const cJSON *nl = cJSON_GetObjectItemCaseSensitive(src, "num_hidden_layers");
    *n_layers = -1;
    if (cJSON_IsNumber(nl) && nl->valuedouble >= 0 && nl->valuedouble <= MOE_MAX_LAYERS) *n_layers = (int)nl->valuedouble;
    return cJSON_IsString(mt) && !strncmp(mt->valuestring, "deepseek_v4", 11);
}

float moe_nvfp4_input_scale(float amax) {
    if (!(amax > 0) || !isfinite(amax)) amax = 1.0f;
    return amax / (MOE_E2M1_MAX * MOE_FP8_E4M3_MAX);
}

/* Add the "<...>.experts" module of expert weight base `bn` to the list, once. */
static bool note_expert_layer(const char *bn, char ***list, int *n) {
    const char *ex = strstr(bn, ".experts.");
    if (!ex) return true;
    size_t l = (size_t)(ex - bn) + 8;
    for (int k = 0; k < *n; k++)
        if (strlen((*list)[k]) == l && !strncmp((*list)[k], bn, l)) return true;
    char **ne = realloc(*list, (size_t)(*n + 1) * sizeof *ne);
    if (!ne) return false;
    *list = ne;
    char *d = malloc(l + 1);
    if (!d) return false;
    memcpy(d, bn, l);
    d[l] = 0;
    (*list)[(*n)++] = d;
    return true;
}

moe_status moe_quantize_checkpoint_calib(const char *in_dir, const char *out_dir, const moe_quant_opts *o,
                                         const moe_quant_file_opts *fo, const moe_quant_calibrator *cal,
                                         moe_quant_report *rep, moe_error *err) {
    static const moe_quant_file_opts none;
    if (!fo) fo = &none;
    memset(rep, 0, sizeof *rep);
    if (o->experts == MOE_Q_NONE)
        return moe_errf(err, MOE_ERR_ARG, "quantize needs an experts format (fp8, mxfp4 or nvfp4)");
    if (o->others != MOE_Q_NONE && o->others != MOE_Q_FP8)
        return moe_errf(err, MOE_ERR_ARG, "--others takes fp8 or none, not %s", moe_qfmt_name(o->others));
    struct stat a, b;
    if (stat(in_dir, &a) != 0) return moe_errf(err, MOE_ERR_IO, "%s: %s", in_dir, strerror(errno));
    bool out_exists = stat(out_dir, &b) == 0;
    if (out_exists && !S_ISDIR(b.st_mode))
        return moe_errf(err, MOE_ERR_ARG, "output %s exists and is not a directory", out_dir);
    if (out_exists && a.st_dev == b.st_dev && a.st_ino == b.st_ino)
        return moe_errf(err, MOE_ERR_ARG, "output directory %s is the input directory", out_dir);
    /* everything that can be checked is checked, and every file but the
     * shards built, before the first byte is written (#12: a bad config.json
     * used to fail after the shards were written): every shard readable and
     * unquantized, the config parsed, the release chosen, NVFP4 calibrated,
     * config.json and hf_quant_config.json made */
    moe_ckpt *ck = NULL;
    moe_status st = moe_ckpt_open(in_dir, &ck, err);
    if (st != MOE_OK) return st;
    qctx c;
    memset(&c, 0, sizeof c);
    if ((st = qctx_init(&c, err)) != MOE_OK) { moe_ckpt_free(ck); return st; }
    c.experts = o->experts;
    c.others = o->others;
    bool names_v4 = false; /* V4 native names (".ffn.") decide when the config does not */
    for (size_t s = 0; s < moe_ckpt_n_shards(ck) && st == MOE_OK; s++) {
        moe_st_file *in = NULL;
        st = moe_ckpt_shard(ck, s, &in, err);
        for (size_t i = 0; st == MOE_OK && i < moe_st_count(in); i++) {
            const moe_st_tensor *t = moe_st_at(in, i);
            if (strstr(t->name, ".ffn.")) names_v4 = true;
            if (t->dtype == MOE_DTYPE_F8_E4M3 || t->dtype == MOE_DTYPE_F8_E8M0)
                st = moe_errf(err, MOE_ERR_DTYPE, "%s/%s: tensor %s is already quantized (%s): quantize takes a "
                              "BF16, F16 or F32 checkpoint", in_dir, moe_ckpt_shard_file(ck, s), t->name,
                              moe_dtype_name(t->dtype));
        }
    }
    cJSON *cfg = NULL;
    char *cfg_path = st == MOE_OK ? moe_path_join(in_dir, "config.json") : NULL;
    if (st == MOE_OK && !cfg_path) st = moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    if (st == MOE_OK) st = read_json(cfg_path, &cfg, err);
    free(cfg_path);
    if (st == MOE_OK) c.v4 = config_v4(cfg, &c.n_layers) || names_v4;
    if (c.v4) c.rel = o->experts == MOE_Q_NVFP4 ? REL_NV_V4_NVFP4 : REL_DS_V4;
    else if (o->experts == MOE_Q_NVFP4) c.rel = REL_MO_V3_NVFP4;
    else if (o->experts == MOE_Q_FP8) c.rel = fo->ue8m0 ? REL_DS_V31 : REL_DS_V3;
    else c.rel = REL_CUSTOM;
    if (st == MOE_OK && c.rel == REL_MO_V3_NVFP4 && o->others == MOE_Q_FP8)
        st = moe_errf(err, MOE_ERR_ARG, "--others fp8 with NVFP4 experts on HF V3 names: the ModelOpt NVFP4 release "
                      "(nvidia/DeepSeek-R1-FP4) quantizes shared experts and dense MLPs to NVFP4 and keeps attention "
                      "BF16; use --others none");
    rep->release = release_names[c.rel];

    bool nvfp4 = c.rel == REL_NV_V4_NVFP4 || c.rel == REL_MO_V3_NVFP4;
    fmap w_amax = {0}, in_amax = {0};
    char **expert_layers = NULL;
    int n_el = 0;
    /* pass 1 (NVFP4): weight amaxes (w1 / w3 share one weight_scale_2), the
     * quantized expert modules (the V4 release lists them per layer), and
     * input amaxes from calibration */
    for (size_t s = 0; nvfp4 && st == MOE_OK && s < moe_ckpt_n_shards(ck); s++) {
        moe_st_file *in = NULL;
        if ((st = moe_ckpt_shard(ck, s, &in, err)) != MOE_OK) break;
        for (size_t i = 0; i < moe_st_count(in) && st == MOE_OK; i++) {
            const moe_st_tensor *t = moe_st_at(in, i);
            q_act qa = classify(&c, t);
            if (!(qa == QA_NVFP4 || (qa == QA_EXPERT && o->experts == MOE_Q_NVFP4))) continue;
            char bn[512];
            base_of(t->name, bn, sizeof bn);
            if (!fmap_put(&w_amax, bn, tensor_amax(t)) ||
                (c.rel == REL_NV_V4_NVFP4 && qa == QA_EXPERT && !note_expert_layer(bn, &expert_layers, &n_el)))
                st = moe_errf(err, MOE_ERR_NOMEM, "out of memory");
        }
    }
    if (nvfp4 && st == MOE_OK && !cal)
        st = moe_errf(err, MOE_ERR_ARG, "an NVFP4 copy needs input_scale calibration, and no calibrator was given");
    if (nvfp4 && st == MOE_OK) st = calibrate(in_dir, ck, &c, fo, cal, &in_amax, rep, err);
    char *cfg_text = NULL, *hf_text = NULL;
    if (st == MOE_OK) {
        st = make_config(cfg, &c, o, fo, &cfg_text, err);
        cfg = NULL; /* taken by make_config */
    }
    if (st == MOE_OK && nvfp4) st = make_hf_quant_config(&c, expert_layers, n_el, &hf_text, err);
    cJSON_Delete(cfg);

    staging g;
    memset(&g, 0, sizeof g);
    if (st == MOE_OK) st = staging_open(&g, out_dir, err);
    cJSON *index_map = st == MOE_OK && moe_ckpt_has_index(ck) ? cJSON_CreateObject() : NULL;
    uint64_t total = 0;
    for (size_t s = 0; s < moe_ckpt_n_shards(ck) && st == MOE_OK; s++) {
        moe_st_file *in = NULL;
        const char *file = moe_ckpt_shard_file(ck, s);
        st = moe_ckpt_shard(ck, s, &in, err);
        if (st != MOE_OK) break;
        qshard q = {0};
        for (size_t i = 0; i < moe_st_count(in) && st == MOE_OK; i++) {
            const moe_st_tensor *t = moe_st_at(in, i);
            q_act qa = classify(&c, t);
            moe_qfmt f = qa == QA_EXPERT ? o->experts : qa == QA_FP8 ? MOE_Q_FP8 : qa == QA_NVFP4 ? MOE_Q_NVFP4
                                                                                                    : MOE_Q_NONE;
            rep->n_tensors++;
            if (f == MOE_Q_NONE) {
                st = qshard_add(&q, t->name, t->dtype, t->ndim, t->shape, t->data, NULL, err);
                continue;
            }
            float scale2 = NAN, in_scale = 0.0f;
            if (f == MOE_Q_NVFP4) {
                char bn[512], pn[520];
                base_of(t->name, bn, sizeof bn);
                const float *wa = fmap_get(&w_amax, bn), *pa = partner_of(bn, pn, sizeof pn) ? fmap_get(&w_amax, pn) : NULL;
                float amax = wa ? *wa : 0.0f;
                if (pa && *pa > amax) amax = *pa;
                scale2 = moe_nvfp4_scale2(&amax, 1);
                const float *ia = fmap_get(&in_amax, bn);
                in_scale = moe_nvfp4_input_scale(ia ? *ia : 0.0f);
                if (!ia) rep->n_uncalibrated++;
            }
            st = quantize_linear(&q, &c, t, f, o, scale2, in_scale, rep, file, err);
        }
        if (st == MOE_OK) {
            qsort(q.e, q.n, sizeof *q.e, entry_cmp);
            char *path = staging_path(&g, file);
            static const char *const meta[] = {"format", "pt", NULL};
            st = path ? moe_st_write(path, q.e, q.n, meta, err) : moe_errf(err, MOE_ERR_NOMEM, "out of memory");
            free(path);
            for (size_t k = 0; k < q.n; k++) {
                uint64_t bytes = moe_dtype_size(q.e[k].dtype);
                for (int d = 0; d < q.e[k].ndim; d++) bytes *= (uint64_t)q.e[k].shape[d];
                total += bytes;
                if (q.bufs[k]) rep->bytes_out += bytes;
                if (index_map) cJSON_AddStringToObject(index_map, q.e[k].name, file);
            }
        }
        qshard_free(&q);
    }
    if (st == MOE_OK && index_map) {
        /* weight_map sorted by name, as the releases' indexes are */
        int n = cJSON_GetArraySize(index_map);
        const cJSON **items = moe_calloc((size_t)n + 1, sizeof *items);
        cJSON *root = cJSON_CreateObject(), *meta = cJSON_AddObjectToObject(root, "metadata");
        if (c.rel != REL_MO_V3_NVFP4) cJSON_AddNumberToObject(meta, "total_size", (double)total);
        cJSON *wm = cJSON_AddObjectToObject(root, "weight_map");
        char *text = NULL;
        if (!items) {
            st = moe_errf(err, MOE_ERR_NOMEM, "out of memory");
            cJSON_Delete(root);
        } else {
            int k = 0;
            for (const cJSON *e = index_map->child; e; e = e->next) items[k++] = e;
            for (int i = 1; i < n; i++) /* insertion sort: shards are written nearly in order */
                for (int j = i; j > 0 && strcmp(items[j - 1]->string, items[j]->string) > 0; j--) {
                    const cJSON *tmp = items[j];
                    items[j] = items[j - 1];
                    items[j - 1] = tmp;
                }
            for (int i = 0; i < n; i++) cJSON_AddStringToObject(wm, items[i]->string, items[i]->valuestring);
            st = json_text(root, "model.safetensors.index.json", &text, err);
        }
        free(items);
        if (st == MOE_OK) st = stage_text(&g, "model.safetensors.index.json", text, err);
        free(text);
    }
    cJSON_Delete(index_map);
    if (st == MOE_OK && hf_text) st = stage_text(&g, "hf_quant_config.json", hf_text, err);
    if (st == MOE_OK) st = stage_text(&g, "config.json", cfg_text, err); /* config.json last: published last */
    if (st == MOE_OK) st = staging_publish(&g, out_dir, out_exists, err);
    staging_drop(&g); /* on failure: nothing of the copy is left */
    free(cfg_text);
    free(hf_text);
    for (int k = 0; k < n_el; k++) free(expert_layers[k]);
    free(expert_layers);
    fmap_free(&w_amax);
    fmap_free(&in_amax);
    qctx_free(&c);
    moe_ckpt_free(ck);
    return st;
}
/* ------------------------------------------------- in-memory quantization */

static float weight_amax(const moe_weight *w, float *row) {
    /* the integer max of the |x| bit patterns: for non-negative floats
     * integer order is float order, and a NaN, and only a NaN, makes it
     * exceed 0x7F800000; branch-free, so it vectorizes */
    uint32_t amax_bits = 0;
    if (w->fmt == MOE_WFMT_BF16) {
        /* BF16 widens to f32 by a 16-bit shift: the same order, so the max
         * of the stored bits is the amax, no decode */
        const uint16_t *d = w->data;
        uint32_t m16 = 0;
        for (int64_t i = 0; i < w->rows * w->cols; i++) {
            uint32_t a = d[i] & 0x7FFFu;
            m16 = a > m16 ? a : m16;
        }
        amax_bits = m16 << 16;
    } else {
        for (int64_t r = 0; r < w->rows; r++) {
            moe_weight_row_f32(w, r, row);
            for (int64_t i = 0; i < w->cols; i++) {
                uint32_t a;
                memcpy(&a, &row[i], sizeof a);
                a &= 0x7FFFFFFFu;
                amax_bits = a > amax_bits ? a : amax_bits;
            }
        }
    }
    if (amax_bits > 0x7F800000u) return NAN;
    float m;
    memcpy(&m, &amax_bits, sizeof m);
    return m;
}

/* Quantize one weight into buffers owned by s; dst describes them. The
 * source is decoded in strips of 128 rows (one FP8 tile row) into a reused
 * buffer: never a whole float copy of the matrix. scale2 (NVFP4): the
 * per-tensor scale to use, NAN for the weight's own amax / (6 * 448). */
static moe_status quantize_weight(layer_store *s, const moe_weight *src, moe_qfmt f, bool v4_scales, bool pow2,
                                  const moe_quant_opts *o, float scale2, moe_weight *dst, moe_error *err) {
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
        /* weight_scale_2 from an amax: the reference helper over {amax} */
        float amax = isnan(scale2) ? weight_amax(src, x) : 0.0f;
        dst->scale2 = isnan(scale2) ? moe_nvfp4_scale2(&amax, 1) : scale2;
    }
    moe_fp8_scale fp8_kind = pow2 ? MOE_FP8_SCALE_POW2 : MOE_FP8_SCALE_F32;
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
            moe_fp8_block_quant_fast(x, m, cols, fp8_kind, data + r0 * cols, (float *)scales + (r0 / 128) * gc);
        }
    }
    free(x);
    dst->data = data;
    dst->scale = scales;
    /* the input scale belongs to the linear's input, whatever its weights'
     * format: kept (act_scale is the layer builder's to recompute) */
    dst->act_scale = 0.0f;
    dst->global_scale = 0.0;
    if (fp4) {
        dst->fmt = f == MOE_Q_MXFP4 ? MOE_WFMT_MXFP4 : MOE_WFMT_NVFP4;
        dst->scale_dtype = f == MOE_Q_MXFP4 ? MOE_DTYPE_F8_E8M0 : MOE_DTYPE_F8_E4M3;
        dst->scale_rows = rows;
        dst->scale_cols = cols / blk;
        dst->scheme = f == MOE_Q_MXFP4 ? "mxfp4 (quantized in memory)" : "nvfp4 (quantized in memory)";
    } else {
        dst->fmt = MOE_WFMT_FP8_BLOCK;
        dst->scale_dtype = v4_scales ? MOE_DTYPE_F8_E8M0 : MOE_DTYPE_F32;
        dst->scale_rows = gr;
        dst->scale_cols = gc;
        dst->block_rows = dst->block_cols = MOE_FP8_TILE;
        dst->scheme = "fp8 blocks (quantized in memory)";
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
    /* NVFP4: gate and up of one expert share weight_scale_2 (max of their
     * amaxes), as ModelOpt exports them for one fused GEMM1 */
    float *s13 = NULL;
    int n13 = E + 1;
    if (o->experts == MOE_Q_NVFP4 || o->others == MOE_Q_NVFP4) {
        s13 = moe_malloc((size_t)n13, sizeof *s13);
        if (!s13) { moe_layer_store_free(s); return moe_errf(err, MOE_ERR_NOMEM, "out of memory"); }
        for (int q = 0; q < n13; q++) s13[q] = NAN;
    }
#pragma omp parallel for schedule(dynamic, 1)
    for (int q = 0; q < n13; q++) {
        bool routed = q < E;
        moe_qfmt f = routed ? o->experts : o->others;
        const moe_weight *g = routed ? &src->w1[q] : &src->sw1, *u = routed ? &src->w3[q] : &src->sw3;
        if (!s13 || f != MOE_Q_NVFP4 || g->rows == 0) continue;
        size_t cols = (size_t)(g->cols > 0 ? g->cols : 1);
        float *row = moe_malloc(cols, sizeof(float));
        if (!row) continue; /* NAN stays: each projection then takes its own amax */
        float a = weight_amax(g, row), b = weight_amax(u, row);
        float amax = a > b || isnan(a) ? a : b;
        s13[q] = moe_nvfp4_scale2(&amax, 1);
        free(row);
    }
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
        float sc2 = s13 && k < 2 ? s13[e >= 0 ? e : E] : NAN;
        moe_status qs = quantize_weight(&tmp, from, e >= 0 ? o->experts : o->others, v4_scales, false, o, sc2, to, &local);
#pragma omp critical(moe_quant_adopt)
        {
            for (int i = 0; i < tmp.n_owned; i++)
                if (!moe_layer_store_adopt(s, tmp.owned[i]) && qs == MOE_OK)
                    qs = moe_errf(&local, MOE_ERR_NOMEM, "out of memory");
            if (qs != MOE_OK && q < first_bad) { first_bad = q; st = qs; if (err) *err = local; }
        }
        free(tmp.owned);
    }
    free(s13);
    if (st != MOE_OK) { moe_layer_store_free(s); return st; }
    moe_layer_nvfp4_reconcile(L);
    *out = L;
    return MOE_OK;
}
