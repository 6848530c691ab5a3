/*
 * moe_inspect_dir: what a checkpoint is, from config.json, the quant config
 * files and the safetensors headers alone (no tensor data is read): the
 * architecture, layers by type with their attention, the storage scheme of
 * every tensor family, the shards, the MTP blocks, the declared quantization
 * and whether the tensors agree with it, and what moeaudit can run in it.
 *
 * Invariants:
 *  1. Only headers are touched: shards are mapped (moe_ckpt), their JSON
 *     headers parsed; tensor bytes are never read.
 *  2. A linear's scheme is decided from its dtype and which companion
 *     tensors exist with which dtype and shape, as src/io/weights.c loads
 *     them; companions are counted with their linear, not as tensors of
 *     their own family.
 */
#include "core/core.h"
#include "io/ckpt.h"
#include "io/quant_decl.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

/* --------------------------------------------------------------- the table */

typedef struct itab {
    const moe_st_tensor **t; /* sorted by name */
    size_t n;
} itab;

static int tcmp(const void *a, const void *b) {
    return strcmp((*(const moe_st_tensor *const *)a)->name, (*(const moe_st_tensor *const *)b)->name);
}

static const moe_st_tensor *tfind(const itab *tb, const char *name) {
    size_t lo = 0, hi = tb->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(name, tb->t[mid]->name);
        if (!c) return tb->t[mid];
        if (c < 0) hi = mid;
        else lo = mid + 1;
    }
    return NULL;
}

/* Names of unknown-dtype tensors, sorted, with their dtype. */
typedef struct utab {
    const moe_st_unknown **u;
    size_t n;
} utab;

static int ucmp(const void *a, const void *b) {
    return strcmp((*(const moe_st_unknown *const *)a)->name, (*(const moe_st_unknown *const *)b)->name);
}

static const moe_st_unknown *ufind(const utab *ut, const char *name) {
    size_t lo = 0, hi = ut->n;
    while (lo < hi) {
        size_t mid = (lo + hi) / 2;
        int c = strcmp(name, ut->u[mid]->name);
        if (!c) return ut->u[mid];
        if (c < 0) hi = mid;
        else lo = mid + 1;
    }
    return NULL;
}

static const moe_st_tensor *tfind2(const itab *tb, const char *base, const char *suffix) {
    char n[432]; /* a 400-byte base and the longest companion suffix */
    snprintf(n, sizeof n, "%s%s", base, suffix);
    return tfind(tb, n);
}

static int64_t numel(const moe_st_tensor *t) {
    int64_t n = 1;
    for (int d = 0; d < t->ndim; d++) n *= t->shape[d];
    return n;
}

static bool ends(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

/* ------------------------------------------------------------- the scheme */

/* Block of a scale grid s for a [R, C] weight: the declared one if it fits,
 * else the first of 128, 64, 32, 16, 256 that does; 0 when none does. */
static int block_of(const moe_st_tensor *s, int64_t R, int64_t C, int decl_r, int decl_c, int *bc) {
    int64_t a, b;
    if (s->ndim == 2) { a = s->shape[0]; b = s->shape[1]; }
    else return *bc = 128, 128; /* squeezed grid (transformers): 128 as the loader assumes */
    if (decl_r > 0 && (R + decl_r - 1) / decl_r == a && (C + decl_c - 1) / decl_c == b) return *bc = decl_c, decl_r;
    static const int cand[] = {128, 64, 32, 16, 256};
    for (int i = 0; i < 5; i++)
        if ((R + cand[i] - 1) / cand[i] == a && (C + cand[i] - 1) / cand[i] == b) return *bc = cand[i], cand[i];
    *bc = 0;
    return 0;
}

/* The storage scheme of linear `base` into buf; *kind for the declaration
 * check; false when base is no linear (no .weight / .weight_packed of rank 2). */
static bool scheme_of(const itab *tb, const moe_qdecl *d, const char *base, char *buf, size_t cap, moe_qkind *kind,
                      bool *readable, bool *fast, bool *has_in) {
    const moe_st_tensor *w = tfind2(tb, base, ".weight"), *p = tfind2(tb, base, ".weight_packed");
    *readable = true;
    *fast = true;
    *has_in = false;
    *kind = MOE_QK_PLAIN;
    if (!w && p && p->ndim == 2) {
        *kind = MOE_QK_NVFP4_CT;
        *has_in = tfind2(tb, base, ".input_global_scale") != NULL;
        bool ok = tfind2(tb, base, ".weight_scale") && tfind2(tb, base, ".weight_global_scale");
        *readable = ok;
        snprintf(buf, cap, "nvfp4 (compressed-tensors: weight_packed, weight_global_scale%.22s)%.16s",
                 *has_in ? ", input_global_scale" : "", ok ? "" : ", scales missing");
        return true;
    }
    if (!w || w->ndim != 2) return false;
    int64_t R = w->shape[0], C = w->shape[1];
    switch (w->dtype) {
    case MOE_DTYPE_BF16: snprintf(buf, cap, "BF16"); return true;
    case MOE_DTYPE_F16: snprintf(buf, cap, "F16"); return true;
    case MOE_DTYPE_F32: snprintf(buf, cap, "F32"); return true;
    case MOE_DTYPE_F64: snprintf(buf, cap, "F64"); return true;
    case MOE_DTYPE_F8_E4M3: {
        *kind = MOE_QK_FP8;
        const moe_st_tensor *s;
        const char *key;
        if ((s = tfind2(tb, base, ".weight_scale_inv"))) key = "weight_scale_inv";
        else if ((s = tfind2(tb, base, ".scale"))) key = ".scale";
        else if ((s = tfind2(tb, base, ".weight_scale"))) key = "weight_scale";
        else {
            *readable = false;
            snprintf(buf, cap, "fp8 without a scale tensor");
            return true;
        }
        if (!strcmp(key, "weight_scale") && numel(s) == 1 && s->ndim <= 1) {
            *kind = MOE_QK_FP8_TENSOR; /* its input_scale is FP8's (amax / 448): not an NVFP4 scale */
            snprintf(buf, cap, "fp8 per-tensor (weight_scale []%s)", tfind2(tb, base, ".input_scale") ? " + input_scale" : "");
            return true;
        }
        if (!strcmp(key, "weight_scale") && s->ndim == 2 && s->shape[0] == R && s->shape[1] == 1) {
            *fast = false;
            snprintf(buf, cap, "fp8 per-channel (weight_scale [rows, 1] %s)", moe_dtype_name(s->dtype));
            return true;
        }
        int dr = 0, dc = 0;
        moe_qdecl_fp8_block(d, &dr, &dc, NULL);
        int bc, br = block_of(s, R, C, dr, dc, &bc);
        if (!br) {
            *readable = false;
            snprintf(buf, cap, "fp8 + %s %s of no block size that fits", key, moe_dtype_name(s->dtype));
            return true;
        }
        *fast = br == 128 && bc == 128;
        snprintf(buf, cap, "fp8 %dx%d blocks (%s %s)", br, bc, key, moe_dtype_name(s->dtype));
        return true;
    }
    case MOE_DTYPE_U8:
    case MOE_DTYPE_I8: {
        const moe_st_tensor *s = tfind2(tb, base, ".scale");
        if (s) {
            *kind = MOE_QK_MXFP4;
            snprintf(buf, cap, "mxfp4 (%s + .scale %s)", moe_dtype_name(w->dtype), moe_dtype_name(s->dtype));
            return true;
        }
        if (tfind2(tb, base, ".weight_scale") && tfind2(tb, base, ".weight_scale_2")) {
            *kind = MOE_QK_NVFP4;
            *has_in = tfind2(tb, base, ".input_scale") != NULL;
            snprintf(buf, cap, "nvfp4 (ModelOpt: %s + weight_scale + weight_scale_2%s)", moe_dtype_name(w->dtype),
                     *has_in ? " + input_scale" : "");
            return true;
        }
        *readable = false;
        snprintf(buf, cap, "packed %s without .scale or weight_scale", moe_dtype_name(w->dtype));
        return true;
    }
    default:
        *readable = false;
        snprintf(buf, cap, "%s (no weight format)", moe_dtype_name(w->dtype));
        return true;
    }
}

static const char *const companions[] = {".scale", ".weight_scale_inv", ".weight_scale", ".weight_scale_2",
                                         ".input_scale", ".weight_global_scale", ".input_global_scale"};

/* True when name is the companion of a linear present in the table. */
static bool is_companion(const itab *tb, const char *name) {
    for (int i = 0; i < 7; i++)
        if (ends(name, companions[i])) {
            char base[400];
            snprintf(base, sizeof base, "%.*s", (int)(strlen(name) - strlen(companions[i])), name);
            if (tfind2(tb, base, ".weight") || tfind2(tb, base, ".weight_packed")) return true;
        }
    return false;
}

/* The family of a tensor by its name. */
static const char *family_of(const char *n, bool linear) {
    if (linear) {
        if (strstr(n, ".shared_experts.")) return "shared experts";
        if (strstr(n, ".experts.")) return "routed experts";
        if (ends(n, ".mlp.gate.weight") || ends(n, ".ffn.gate.weight")) return "router";
        if (strstr(n, ".indexer.compressor.") || strstr(n, ".compressor.")) return "compressors";
        if (strstr(n, ".indexer.")) return "indexer";
        if (strstr(n, ".attn.") || strstr(n, ".self_attn.")) return "attention";
        if (strstr(n, ".e_proj.") || strstr(n, ".h_proj.") || strstr(n, ".eh_proj.")) return "MTP projections";
        if (strstr(n, ".mlp.") || strstr(n, ".ffn.")) return "dense MLP";
        if (strstr(n, "embed")) return "embedding";
        if (strstr(n, "head")) return "output head";
        return "other linears";
    }
    if (strstr(n, "tid2eid")) return "hash routing table";
    if (ends(n, "gate.bias") || ends(n, "e_score_correction_bias")) return "router bias";
    if (strstr(n, "hc_")) return "hyper-connections";
    if (strstr(n, "norm")) return "norms";
    if (strstr(n, "ape") || strstr(n, "attn_sink")) return "attention sinks and ape";
    if (strstr(n, "embed")) return "embedding";
    return "other tensors";
}

/* ------------------------------------------------------------------ driver */

static void add_family(moe_inspect *r, const char *fam, const char *scheme, const char *example) {
    for (int i = 0; i < r->n_families; i++)
        if (!strcmp(r->families[i].family, fam) && !strcmp(r->families[i].scheme, scheme)) {
            r->families[i].count++;
            return;
        }
    if (r->n_families == MOE_INSPECT_MAX_FAMILIES) return;
    moe_inspect_family *f = &r->families[r->n_families++];
    snprintf(f->family, sizeof f->family, "%s", fam);
    snprintf(f->scheme, sizeof f->scheme, "%s", scheme);
    snprintf(f->example, sizeof f->example, "%s", example);
    f->count = 1;
}

static void add_run(moe_inspect *r, const char *what, bool ok, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void add_run(moe_inspect *r, const char *what, bool ok, const char *fmt, ...) {
    if (r->n_runs == MOE_INSPECT_MAX_RUNS) return;
    moe_inspect_run *x = &r->runs[r->n_runs++];
    snprintf(x->what, sizeof x->what, "%s", what);
    x->ok = ok;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(x->why, sizeof x->why, fmt, ap);
    va_end(ap);
}

static const cJSON *citem(const cJSON *o, const char *k) { return cJSON_GetObjectItemCaseSensitive(o, k); }

/* The attention of layer l (V4: compress_ratios / layer_types / tensors;
 * V3: MLA, with the V3.2 indexer when present). */
static void attention_of(const itab *tb, const cJSON *cfg, bool v4, const char *pre, int l, char *buf, size_t cap) {
    char probe[300];
    if (!v4) {
        snprintf(probe, sizeof probe, "%sself_attn.indexer.wq_b.weight", pre);
        bool idx = tfind(tb, probe) != NULL;
        snprintf(probe, sizeof probe, "%sself_attn.kv_a_proj_with_mqa.weight", pre);
        bool mla = tfind(tb, probe) != NULL;
        snprintf(buf, cap, "%s%s", mla ? "MLA" : "none found", idx ? " + DSA indexer (V3.2)" : "");
        return;
    }
    const cJSON *lt = citem(cfg, "layer_types"), *cr = citem(cfg, "compress_ratios");
    if (cJSON_IsArray(lt) && l < cJSON_GetArraySize(lt) && cJSON_IsString(cJSON_GetArrayItem(lt, l))) {
        const char *t = cJSON_GetArrayItem(lt, l)->valuestring;
        const cJSON *rt = citem(citem(cfg, "compress_rates"), t);
        char ratio[24] = "";
        if (cJSON_IsNumber(rt)) snprintf(ratio, sizeof ratio, " (ratio %d)", rt->valueint);
        snprintf(buf, cap, "%s%s%s", !strcmp(t, "sliding_attention") ? "sliding window"
                                     : !strcmp(t, "compressed_sparse_attention") ? "CSA"
                                     : !strcmp(t, "heavily_compressed_attention") ? "HCA" : t,
                 ratio, !strcmp(t, "compressed_sparse_attention") ? " + indexer" : "");
        return;
    }
    if (cJSON_IsArray(cr) && l < cJSON_GetArraySize(cr) && cJSON_IsNumber(cJSON_GetArrayItem(cr, l))) {
        int ratio = cJSON_GetArrayItem(cr, l)->valueint;
        if (ratio == 0) snprintf(buf, cap, "sliding window");
        else if (ratio == 4) snprintf(buf, cap, "CSA (ratio 4) + indexer");
        else snprintf(buf, cap, "HCA (ratio %d)", ratio);
        return;
    }
    snprintf(probe, sizeof probe, "%sattn.indexer.wq_b.weight", pre);
    bool idx = tfind(tb, probe) != NULL;
    snprintf(probe, sizeof probe, "%sattn.compressor.wkv.weight", pre);
    bool comp = tfind(tb, probe) != NULL;
    snprintf(probe, sizeof probe, "%sattn.wq_a.weight", pre);
    bool any = tfind(tb, probe) != NULL;
    snprintf(buf, cap, "%s", idx ? "CSA + indexer" : comp ? "HCA" : any ? "sliding window" : "none found");
}

/* The prefix of layer l's tensors (with or without "model."), V4 MTP
 * blocks as mtp.K. */
static bool layer_prefix(const itab *tb, bool v4, int l, int n_layers, char *pre, size_t cap) {
    static const char *const pfx[] = {"", "model."};
    for (int p = 0; p < 2; p++) {
        if (v4 && l >= n_layers) snprintf(pre, cap, "%smtp.%d.", pfx[p], l - n_layers);
        else snprintf(pre, cap, "%slayers.%d.", pfx[p], l);
        /* any tensor under the prefix: the table is sorted, look for the first >= prefix */
        size_t lo = 0, hi = tb->n;
        while (lo < hi) {
            size_t mid = (lo + hi) / 2;
            if (strcmp(tb->t[mid]->name, pre) < 0) lo = mid + 1;
            else hi = mid;
        }
        if (lo < tb->n && !strncmp(tb->t[lo]->name, pre, strlen(pre))) return true;
    }
    if (v4 && l >= n_layers) snprintf(pre, cap, "mtp.%d.", l - n_layers);
    else snprintf(pre, cap, "%slayers.%d.", v4 ? "" : "model.", l);
    return false;
}

/* The report over a model and checkpoint its caller opened (on the same
 * files); both are freed here. */
static moe_status inspect_opened(const char *dir, moe_model *m, moe_ckpt *ck, moe_inspect *r, moe_error *err) {
    memset(r, 0, sizeof *r);
    snprintf(r->dir, sizeof r->dir, "%s", dir);
    moe_status st = MOE_OK;
    cJSON *root = NULL;
    itab tb = {0};
    utab ut = {0};
    size_t ucap = 0;
    const moe_model_info *info = moe_model_get_info(m);
    root = cJSON_Parse(moe_model_config_json(m));
    const cJSON *cfg = root, *tc = citem(root, "text_config");
    if (cJSON_IsObject(tc)) cfg = tc;
    const cJSON *ar = citem(root, "architectures");
    snprintf(r->architecture, sizeof r->architecture, "%s",
             cJSON_IsArray(ar) && cJSON_IsString(cJSON_GetArrayItem(ar, 0)) ? cJSON_GetArrayItem(ar, 0)->valuestring : "?");
    snprintf(r->model_type, sizeof r->model_type, "%s", info->model_type);
    r->arch = info->arch;
    r->nested_config = cJSON_IsObject(tc);
    r->n_layers = info->n_layers;
    r->n_mtp = info->n_mtp;
    r->hidden = info->hidden;
    r->vocab = info->vocab;
    const cJSON *v;
#define CINT(key, dst) do { v = citem(cfg, key); if (cJSON_IsNumber(v)) dst = v->valueint; } while (0)
    CINT("moe_intermediate_size", r->moe_inter);
    CINT("n_routed_experts", r->n_experts);
    CINT("num_experts_per_tok", r->top_k);
    CINT("n_shared_experts", r->n_shared);
    CINT("num_hash_layers", r->n_hash);
    if (!r->n_hash) CINT("n_hash_layers", r->n_hash);
#undef CINT
    v = citem(cfg, "routed_scaling_factor");
    r->scaling = cJSON_IsNumber(v) ? v->valuedouble : 1.0;
    v = citem(cfg, "scoring_func");
    snprintf(r->scoring, sizeof r->scoring, "%s", cJSON_IsString(v) ? v->valuestring : info->arch == MOE_ARCH_V4 ? "sqrtsoftplus" : "sigmoid");

    /* every header */
    r->n_shards = (int)moe_ckpt_n_shards(ck);
    r->indexed = moe_ckpt_has_index(ck);
    size_t cap = 0;
    for (size_t s = 0; s < moe_ckpt_n_shards(ck); s++) {
        moe_st_file *f = NULL;
        moe_error e2;
        if (moe_ckpt_shard(ck, s, &f, &e2) != MOE_OK) {
            if (r->n_bad_shards < MOE_INSPECT_MAX_NOTES)
                snprintf(r->bad_shards[r->n_bad_shards], sizeof r->bad_shards[0], "%s", e2.msg);
            r->n_bad_shards++;
            continue;
        }
        for (size_t i = 0; i < moe_st_count(f); i++) {
            if (tb.n == cap) {
                cap = cap ? 2 * cap : 4096;
                const moe_st_tensor **nt = realloc(tb.t, cap * sizeof *nt);
                if (!nt) { st = moe_errf(err, MOE_ERR_NOMEM, "out of memory listing tensors"); goto done; }
                tb.t = nt;
            }
            tb.t[tb.n++] = moe_st_at(f, i);
            r->bytes += moe_st_at(f, i)->nbytes;
        }
        for (size_t i = 0; i < moe_st_count_unknown(f); i++) {
            const moe_st_unknown *u = moe_st_unknown_at(f, i);
            if (ut.n == ucap) {
                ucap = ucap ? 2 * ucap : 16;
                const moe_st_unknown **nu = realloc(ut.u, ucap * sizeof *nu);
                if (!nu) { st = moe_errf(err, MOE_ERR_NOMEM, "out of memory listing tensors"); goto done; }
                ut.u = nu;
            }
            ut.u[ut.n++] = u;
            if (r->n_unknown < MOE_INSPECT_MAX_NOTES)
                snprintf(r->unknown[r->n_unknown], sizeof r->unknown[0], "%.120s (dtype \"%.32s\", shard %.60s)", u->name,
                         u->dtype, moe_ckpt_shard_file(ck, s));
            r->n_unknown++;
        }
    }
    r->n_tensors = (int64_t)tb.n;
    if (tb.n) qsort(tb.t, tb.n, sizeof *tb.t, tcmp); /* no shard readable: tb.t is NULL */
    if (ut.n) qsort(ut.u, ut.n, sizeof *ut.u, ucmp);
    const moe_qdecl *d = moe_ckpt_decl(ck);
    moe_qdecl_describe(d, r->declared, sizeof r->declared);

    /* linears and the other tensors, by family; the declaration check */
    bool any_plain_linear = false, any_quant = false, nonfast = false;
    for (size_t i = 0; i < tb.n; i++) {
        const char *n = tb.t[i]->name;
        if (is_companion(&tb, n)) continue;
        char base[400], scheme[128];
        bool linear = false, readable, fast, has_in;
        moe_qkind kind = MOE_QK_PLAIN;
        if (ends(n, ".weight") || ends(n, ".weight_packed")) {
            snprintf(base, sizeof base, "%.*s", (int)(strlen(n) - (ends(n, ".weight") ? 7 : 14)), n);
            linear = scheme_of(&tb, d, base, scheme, sizeof scheme, &kind, &readable, &fast, &has_in);
        }
        if (!linear) {
            add_family(r, family_of(n, false), moe_dtype_name(tb.t[i]->dtype), n);
            continue;
        }
        const char *fam = family_of(n, true);
        add_family(r, fam, scheme, n);
        if (kind == MOE_QK_PLAIN && strcmp(fam, "norms")) any_plain_linear = true;
        if (kind != MOE_QK_PLAIN) any_quant = true;
        if (!fast) nonfast = true;
        char why[400];
        moe_qexp e = moe_qdecl_expect(d, base, why, sizeof why);
        if (!moe_qexp_allows(e, kind)) {
            if (r->n_contradictions < MOE_INSPECT_MAX_NOTES)
                snprintf(r->contradictions[r->n_contradictions], sizeof r->contradictions[0],
                         "%.160s requires %.24s for %.100s, stored as %.100s", why, moe_qexp_name(e), base, scheme);
            r->n_contradictions++;
        }
    }

    /* families in a fixed order: the MoE first, then attention, then the rest */
    static const char *const order[] = {"routed experts", "shared experts", "router", "router bias",
                                        "hash routing table", "dense MLP", "attention", "indexer", "compressors",
                                        "attention sinks and ape", "MTP projections", "hyper-connections", "norms",
                                        "embedding", "output head", "other linears", "other tensors"};
    for (int i = 1; i < r->n_families; i++)
        for (int j = i; j > 0; j--) {
            int a = 0, b = 0;
            while (a < 17 && strcmp(order[a], r->families[j - 1].family)) a++;
            while (b < 17 && strcmp(order[b], r->families[j].family)) b++;
            if (a <= b) break;
            moe_inspect_family t = r->families[j];
            r->families[j] = r->families[j - 1];
            r->families[j - 1] = t;
        }

    /* layers */
    int nl = r->n_layers + r->n_mtp;
    r->layers = moe_calloc((size_t)(nl > 0 ? nl : 1), sizeof *r->layers);
    if (!r->layers) { st = moe_errf(err, MOE_ERR_NOMEM, "out of memory"); goto done; }
    r->n_layer_info = nl;
    int n_moe = 0, n_runnable = 0, n_with_input = 0, n_hc = 0, n_idx = 0;
    bool v4 = info->arch == MOE_ARCH_V4;
    char notrun[512] = "";
    for (int l = 0; l < nl; l++) {
        moe_inspect_layer *L = &r->layers[l];
        L->index = l;
        L->mtp = l >= r->n_layers;
        moe_error e2;
        moe_model_layer_kind(m, l, &L->kind, &e2);
        char pre[96];
        L->present = layer_prefix(&tb, v4, l, r->n_layers, pre, sizeof pre);
        attention_of(&tb, cfg, v4, pre, l, L->attention, sizeof L->attention);
        char probe[300];
        snprintf(probe, sizeof probe, "%s%s", pre, v4 ? "hc_ffn_fn" : "");
        if (v4 && tfind(&tb, probe)) n_hc++;
        snprintf(probe, sizeof probe, "%s%s.indexer.wq_b.weight", pre, v4 ? "attn" : "self_attn");
        if (tfind(&tb, probe)) n_idx++;
        if (L->kind == MOE_LAYER_DENSE) {
            snprintf(L->runnable, sizeof L->runnable, "dense layer (no MoE block)");
            continue;
        }
        n_moe++;
        const char *ffn = v4 ? "ffn" : "mlp";
        snprintf(probe, sizeof probe, "%s%s.gate.weight", pre, ffn);
        if (!tfind(&tb, probe)) {
            snprintf(L->runnable, sizeof L->runnable, "no: the checkpoint lacks %.120s%s", probe,
                     L->mtp ? " (this copy drops the MTP block)" : "");
            snprintf(notrun + strlen(notrun), sizeof notrun - strlen(notrun), "%s%d", *notrun ? ", " : "", l);
            continue;
        }
        /* the routed experts: every projection's scheme */
        static const char *const v4p[3] = {"w1", "w3", "w2"}, *const v3p[3] = {"gate_proj", "up_proj", "down_proj"};
        bool ok = true, all_fast = true, all_in = true;
        char first[128] = "", bad[360] = "";
        snprintf(probe, sizeof probe, "%s%s.experts.gate_up_proj", pre, ffn);
        bool stacked = tfind(&tb, probe) || tfind2(&tb, probe, ".weight");
        if (stacked) {
            const moe_st_tensor *t = tfind(&tb, probe) ? tfind(&tb, probe) : tfind2(&tb, probe, ".weight");
            snprintf(first, sizeof first, "stacked gate_up_proj / down_proj %s", moe_dtype_name(t->dtype));
            if (!moe_dtype_is_float(t->dtype)) { ok = false; snprintf(bad, sizeof bad, "quantized stacked experts"); }
            all_in = false;
        }
        for (int e = 0; !stacked && e < r->n_experts && ok; e++)
            for (int k = 0; k < 3 && ok; k++) {
                char b[200], sc[128];
                snprintf(b, sizeof b, "%s%s.experts.%d.%s", pre, ffn, e, v4 ? v4p[k] : v3p[k]);
                bool readable, fast, has_in;
                moe_qkind kind;
                if (!scheme_of(&tb, d, b, sc, sizeof sc, &kind, &readable, &fast, &has_in)) {
                    ok = false;
                    char wn[220];
                    snprintf(wn, sizeof wn, "%.200s.weight", b);
                    const moe_st_unknown *u = ufind(&ut, wn);
                    if (u) snprintf(bad, sizeof bad, "%.200s has dtype \"%.32s\", which moeaudit cannot read", wn, u->dtype);
                    else snprintf(bad, sizeof bad, "%.200s is missing", wn);
                    break;
                }
                if (!first[0]) snprintf(first, sizeof first, "%s", sc);
                else if (strcmp(first, sc)) snprintf(first, sizeof first, "mixed");
                if (!readable) { ok = false; snprintf(bad, sizeof bad, "%.200s: %.128s", b, sc); }
                all_fast = all_fast && fast;
                all_in = all_in && has_in;
                char why[400];
                moe_qexp ex = moe_qdecl_expect(d, b, why, sizeof why);
                if (!moe_qexp_allows(ex, kind)) { ok = false; snprintf(bad, sizeof bad, "contradicts %.150s", why); }
            }
        snprintf(L->experts, sizeof L->experts, "%s", first);
        if (ok) {
            n_runnable++;
            n_with_input += all_in;
            snprintf(L->runnable, sizeof L->runnable, "%s", all_fast ? "yes" : "yes (reference kernels: FP8 blocks other than 128x128)");
        } else {
            snprintf(L->runnable, sizeof L->runnable, "no: %.180s", bad);
            snprintf(notrun + strlen(notrun), sizeof notrun - strlen(notrun), "%s%d", *notrun ? ", " : "", l);
        }
    }

    r->n_hash = 0;
    for (int l = 0; l < nl; l++) r->n_hash += r->layers[l].kind == MOE_LAYER_HASH;

    /* what moeaudit can run */
    add_run(r, "run / audit / diagnose", n_runnable > 0, "%d of %d MoE blocks%s%s%s", n_runnable, n_moe,
            *notrun ? " (not: layer " : "", notrun, *notrun ? "; see layers)" : "");
    add_run(r, "--precision f32 (fast kernels)", n_runnable > 0 && !nonfast, "%s",
            !n_runnable ? "no MoE block can run"
            : nonfast   ? "FP8 blocks other than 128x128 run the reference kernel (correct, slower)"
                        : "every linear in a layout the AVX2/AVX-512 kernels take");
    if (n_with_input)
        add_run(r, "--act nvfp4 (static input scales)", true, "%d MoE block(s) carry the checkpoint's input_scale (the CPU paths; the GPU path has no NVFP4-activation "
                "kernel yet)", n_with_input);
    else
        add_run(r, "--act nvfp4 (static input scales)", false, "%s",
                "no expert carries a static input_scale (ModelOpt NVFP4 checkpoints do); audit calibrates one");
    add_run(r, "--device cuda", n_runnable > 0 && !nonfast, "%s",
            !n_runnable ? "no MoE block can run"
            : nonfast   ? "the GPU path takes FP8 in 128x128 blocks only"
                        : "BF16 / FP8 128x128 / MXFP4 / NVFP4 experts have GPU decoders");
    if (n_hc) add_run(r, "--block hc_ffn / hc_attn (mHC)", true, "%d layer%s with hyper-connections", n_hc, n_hc == 1 ? "" : "s");
    else add_run(r, "--block hc_ffn / hc_attn (mHC)", false, "%s", "no hc_ffn_* tensors (not a DeepSeek V4 checkpoint)");
    if (n_idx) add_run(r, "needle (lightning indexer)", true, "%d layer%s with an indexer", n_idx, n_idx == 1 ? "" : "s");
    else add_run(r, "needle (lightning indexer)", false, "%s", "no indexer tensors");
    /* the whole-model forward (src/model): DeepSeek V4, root tensors and
     * every layer's attention present (headers only: moe_fwd_open would read
     * the norms) */
    {
        static const char *const roots[][2] = {{"embed.weight", "model.embed_tokens.weight"},
                                               {"head.weight", "lm_head.weight"},
                                               {"norm.weight", "model.norm.weight"},
                                               {"hc_head_fn", "model.hc_head.hc_fn"}};
        char miss[160] = "";
        for (int i = 0; i < 4 && !miss[0]; i++) {
            char alt[80];
            snprintf(alt, sizeof alt, "model.%s", roots[i][0]);
            if (!tfind(&tb, roots[i][0]) && !tfind(&tb, roots[i][1]) && !tfind(&tb, alt))
                snprintf(miss, sizeof miss, "no %s (or %s)", roots[i][0], roots[i][1]);
        }
        int no_attn = 0;
        for (int l = 0; l < r->n_layers; l++) no_attn += !strcmp(r->layers[l].attention, "none found");
        if (!v4) add_run(r, "forward (whole model)", false, "%s", "moeaudit forward runs DeepSeek V4 checkpoints only");
        else if (miss[0]) add_run(r, "forward (whole model)", false, "%s", miss);
        else if (no_attn) add_run(r, "forward (whole model)", false, "%d layer(s) without attention tensors", no_attn);
        else add_run(r, "forward (whole model)", true, "%d layers%s", r->n_layers,
                     r->n_mtp && r->layers[r->n_layers].present ? " and the MTP block (--layers mtp)" : "");
    }
    add_run(r, "quantize (release layouts)", !any_quant, "%s",
            any_quant ? "already quantized: quantize takes a BF16, F16 or F32 checkpoint"
                      : any_plain_linear ? "BF16 weights: quantize writes the DeepSeek / NVIDIA release layouts"
                                         : "no linear weights found");
    if (r->n_unknown)
        add_run(r, "tensors of unknown dtype", false, "%d tensor(s) cannot be read (the rest of their shards can): %s",
                r->n_unknown, r->unknown[0]);
    if (r->n_contradictions)
        add_run(r, "declared quantization", false, "%d linear(s) contradict it: %s", r->n_contradictions, r->contradictions[0]);
done:
    free(tb.t);
    free(ut.u);
    cJSON_Delete(root);
    moe_ckpt_free(ck);
    moe_model_free(m);
    if (st != MOE_OK) moe_inspect_free(r);
    return st;
}

moe_status moe_inspect_dir(const char *dir, moe_inspect *r, moe_error *err) {
    memset(r, 0, sizeof *r);
    moe_model *m = NULL;
    moe_ckpt *ck = NULL;
    moe_status st = moe_model_open(dir, &m, err);
    if (st == MOE_OK) st = moe_ckpt_open(dir, &ck, err);
    if (st != MOE_OK) {
        moe_model_free(m);
        return st;
    }
    return inspect_opened(dir, m, ck, r, err);
}

moe_status moe_inspect_mem(const char *label, const moe_mem_file *files, size_t n, moe_inspect *r, moe_error *err) {
    memset(r, 0, sizeof *r);
    if (!label) label = "<memory>";
    moe_model *m = NULL;
    moe_ckpt *ck = NULL;
    moe_status st = moe_model_open_mem(label, files, n, &m, err);
    if (st == MOE_OK) st = moe_ckpt_open_mem(label, files, n, &ck, err);
    if (st != MOE_OK) {
        moe_model_free(m);
        return st;
    }
    return inspect_opened(label, m, ck, r, err);
}

void moe_inspect_free(moe_inspect *r) {
    if (!r) return;
    free(r->layers);
    r->layers = NULL;
    r->n_layer_info = 0;
}

static const char *kind_name(moe_layer_kind k) {
    return k == MOE_LAYER_DENSE ? "dense" : k == MOE_LAYER_HASH ? "hash" : "top-k";
}

char *moe_inspect_json(const moe_inspect *r) {
    cJSON *j = cJSON_CreateObject();
    cJSON_AddStringToObject(j, "dir", r->dir);
    cJSON_AddStringToObject(j, "architecture", r->architecture);
    cJSON_AddStringToObject(j, "model_type", r->model_type);
    cJSON_AddStringToObject(j, "naming", r->arch == MOE_ARCH_V4 ? "deepseek-v4" : "hf-v3");
    cJSON_AddBoolToObject(j, "text_config", r->nested_config);
    cJSON_AddNumberToObject(j, "layers", r->n_layers);
    cJSON_AddNumberToObject(j, "mtp_blocks", r->n_mtp);
    cJSON_AddNumberToObject(j, "hash_layers", r->n_hash);
    cJSON_AddNumberToObject(j, "hidden_size", r->hidden);
    cJSON_AddNumberToObject(j, "moe_intermediate_size", r->moe_inter);
    cJSON_AddNumberToObject(j, "routed_experts", r->n_experts);
    cJSON_AddNumberToObject(j, "experts_per_token", r->top_k);
    cJSON_AddNumberToObject(j, "shared_experts", r->n_shared);
    cJSON_AddNumberToObject(j, "vocab_size", r->vocab);
    cJSON_AddStringToObject(j, "scoring_func", r->scoring);
    cJSON_AddNumberToObject(j, "routed_scaling_factor", r->scaling);
    cJSON_AddNumberToObject(j, "shards", r->n_shards);
    cJSON_AddBoolToObject(j, "indexed", r->indexed);
    cJSON_AddNumberToObject(j, "tensors", (double)r->n_tensors);
    cJSON_AddNumberToObject(j, "bytes", (double)r->bytes);
    cJSON_AddStringToObject(j, "declared_quantization", r->declared);
    cJSON *a = cJSON_AddArrayToObject(j, "contradictions");
    for (int i = 0; i < r->n_contradictions && i < MOE_INSPECT_MAX_NOTES; i++)
        cJSON_AddItemToArray(a, cJSON_CreateString(r->contradictions[i]));
    a = cJSON_AddArrayToObject(j, "unknown_dtype_tensors");
    for (int i = 0; i < r->n_unknown && i < MOE_INSPECT_MAX_NOTES; i++)
        cJSON_AddItemToArray(a, cJSON_CreateString(r->unknown[i]));
    a = cJSON_AddArrayToObject(j, "unreadable_shards");
    for (int i = 0; i < r->n_bad_shards && i < MOE_INSPECT_MAX_NOTES; i++)
        cJSON_AddItemToArray(a, cJSON_CreateString(r->bad_shards[i]));
    a = cJSON_AddArrayToObject(j, "layer_list");
    for (int i = 0; i < r->n_layer_info; i++) {
        const moe_inspect_layer *L = &r->layers[i];
        cJSON *o = cJSON_CreateObject();
        cJSON_AddNumberToObject(o, "layer", L->index);
        cJSON_AddBoolToObject(o, "mtp", L->mtp);
        cJSON_AddStringToObject(o, "mlp", kind_name(L->kind));
        cJSON_AddBoolToObject(o, "present", L->present);
        cJSON_AddStringToObject(o, "attention", L->attention);
        cJSON_AddStringToObject(o, "experts", L->experts);
        cJSON_AddStringToObject(o, "moeaudit", L->runnable);
        cJSON_AddItemToArray(a, o);
    }
    a = cJSON_AddArrayToObject(j, "formats");
    for (int i = 0; i < r->n_families; i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "family", r->families[i].family);
        cJSON_AddStringToObject(o, "scheme", r->families[i].scheme);
        cJSON_AddNumberToObject(o, "count", r->families[i].count);
        cJSON_AddStringToObject(o, "example", r->families[i].example);
        cJSON_AddItemToArray(a, o);
    }
    a = cJSON_AddArrayToObject(j, "can_run");
    for (int i = 0; i < r->n_runs; i++) {
        cJSON *o = cJSON_CreateObject();
        cJSON_AddStringToObject(o, "what", r->runs[i].what);
        cJSON_AddBoolToObject(o, "ok", r->runs[i].ok);
        cJSON_AddStringToObject(o, "why", r->runs[i].why);
        cJSON_AddItemToArray(a, o);
    }
    char *s = cJSON_Print(j);
    cJSON_Delete(j);
    return s;
}

moe_status moe_inspect_report_text(FILE *f, const moe_inspect *r) {
    fprintf(f, "checkpoint  %s\n", r->dir);
    fprintf(f, "model       %s (model_type %s%s), %s names\n", r->architecture, r->model_type,
            r->nested_config ? ", under text_config" : "",
            r->arch == MOE_ARCH_V4 ? "DeepSeek V4 (layers.N.ffn, mtp.K)" : "HF DeepSeek V3 (model.layers.N.mlp)");
    fprintf(f, "shape       hidden %d, %d layers + %d MTP block%s, %d routed experts (top-%d) + %d shared, "
               "moe_intermediate %d, vocab %d\n", r->hidden, r->n_layers, r->n_mtp, r->n_mtp == 1 ? "" : "s",
            r->n_experts, r->top_k, r->n_shared, r->moe_inter, r->vocab);
    fprintf(f, "routing     %s, routed_scaling_factor %g%s", r->scoring, r->scaling, r->n_hash ? ", " : "\n");
    if (r->n_hash) fprintf(f, "%d hash-routed layer%s\n", r->n_hash, r->n_hash == 1 ? "" : "s");
    fprintf(f, "files       %d shard%s%s, %lld tensors, %.3f MB\n", r->n_shards, r->n_shards == 1 ? "" : "s",
            r->indexed ? " (model.safetensors.index.json)" : "", (long long)r->n_tensors, (double)r->bytes / 1e6);
    fprintf(f, "declared    %s\n", r->declared);
    for (int i = 0; i < r->n_contradictions && i < MOE_INSPECT_MAX_NOTES; i++)
        fprintf(f, "  CONTRADICTION %s\n", r->contradictions[i]);
    for (int i = 0; i < r->n_unknown && i < MOE_INSPECT_MAX_NOTES; i++) fprintf(f, "  UNKNOWN DTYPE %s\n", r->unknown[i]);
    for (int i = 0; i < r->n_bad_shards && i < MOE_INSPECT_MAX_NOTES; i++) fprintf(f, "  UNREADABLE %s\n", r->bad_shards[i]);
    fprintf(f, "\nlayers\n  %-7s %-6s %-26s %-46s %s\n", "layer", "mlp", "attention", "routed experts", "moeaudit");
    for (int i = 0; i < r->n_layer_info; i++) {
        const moe_inspect_layer *L = &r->layers[i];
        char id[16];
        snprintf(id, sizeof id, "%d%s", L->index, L->mtp ? " MTP" : "");
        fprintf(f, "  %-7s %-6s %-26s %-46s %s\n", id, kind_name(L->kind), L->attention, L->experts[0] ? L->experts : "-",
                L->runnable);
    }
    fprintf(f, "\nformats by tensor family\n");
    for (int i = 0; i < r->n_families; i++)
        fprintf(f, "  %-24s %5d x %-60s e.g. %s\n", r->families[i].family, r->families[i].count, r->families[i].scheme,
                r->families[i].example);
    fprintf(f, "\nwhat moeaudit can run\n");
    for (int i = 0; i < r->n_runs; i++)
        fprintf(f, "  %-3s %-34s %s\n", r->runs[i].ok ? "yes" : "no", r->runs[i].what, r->runs[i].why);
    return ferror(f) ? MOE_ERR_IO : MOE_OK;
}
