/*
 * The declared quantization of a checkpoint (quant_decl.h): parsing of the
 * quantization keys of config.json and of hf_quant_config.json, and what
 * they require of each linear module.
 *
 * Invariants:
 *  1. Every string kept is bounded (truncated to its field) and every list
 *     is owned by the moe_qdecl; moe_qdecl_free releases all of it.
 *  2. Name matching follows the engines that read these files: ModelOpt
 *     exclude_modules are fnmatch wildcards (vLLM ModelOptQuantConfigBase,
 *     also tried as a module prefix), compressed-tensors targets and ignore
 *     entries are exact names or "re:" regular expressions anchored at the
 *     start (Python re.match), tried with and without the "model." prefix.
 */
#include "io/quant_decl.h"
#include "core/core.h"
#include "io/files.h"
#include "io/io_quote.h"
#include "io/model_util.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fnmatch.h>
#include <regex.h>
#include <stdio.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>

static const char *const qexp_names[] = {"any",  "unquantized", "not ModelOpt", "FP8",
                                         "FP8 per-tensor", "FP4 (MXFP4 or NVFP4)", "MXFP4", "NVFP4"};

const char *moe_qexp_name(moe_qexp e) { return (unsigned)e <= MOE_QEXP_NVFP4 ? qexp_names[e] : "?"; }

bool moe_qexp_allows(moe_qexp e, moe_qkind k) {
    switch (e) {
    case MOE_QEXP_ANY: return true;
    case MOE_QEXP_PLAIN: return k == MOE_QK_PLAIN;
    case MOE_QEXP_NOT_MODELOPT: return k != MOE_QK_NVFP4 && k != MOE_QK_FP8_TENSOR;
    case MOE_QEXP_FP8: return k == MOE_QK_FP8 || k == MOE_QK_FP8_TENSOR;
    case MOE_QEXP_FP8_TENSOR: return k == MOE_QK_FP8_TENSOR;
    case MOE_QEXP_FP4: return k == MOE_QK_MXFP4 || k == MOE_QK_NVFP4 || k == MOE_QK_NVFP4_CT;
    case MOE_QEXP_MXFP4: return k == MOE_QK_MXFP4;
    case MOE_QEXP_NVFP4: return k == MOE_QK_NVFP4 || k == MOE_QK_NVFP4_CT;
    }
    return false;
}

static const cJSON *item(const cJSON *o, const char *k) { return cJSON_GetObjectItemCaseSensitive(o, k); }
static bool is_set(const cJSON *v) { return v && !cJSON_IsNull(v); }

static char *dup_str(const char *s) {
    size_t l = strlen(s) + 1;
    char *d = malloc(l);
    if (d) memcpy(d, s, l);
    return d;
}

/* A string key into dst[cap] ("" when absent or null); MOE_ERR_CONFIG when it is not a string. */
static moe_status get_str(const cJSON *o, const char *path, const char *obj, const char *key, char *dst, size_t cap,
                          moe_error *err) {
    const cJSON *v = item(o, key);
    dst[0] = 0;
    if (!is_set(v)) return MOE_OK;
    if (!cJSON_IsString(v))
        return moe_errf(err, MOE_ERR_CONFIG, "%s: %s%s\"%s\" must be a string", path, obj, *obj ? "." : "", key);
    snprintf(dst, cap, "%s", v->valuestring);
    return MOE_OK;
}

/* A positive integer key (0 when absent). */
static moe_status get_pos_int(const cJSON *o, const char *path, const char *obj, const char *key, int *dst,
                              moe_error *err) {
    const cJSON *v = item(o, key);
    *dst = 0;
    if (!is_set(v)) return MOE_OK;
    /* range first, in a form NaN fails too: the cast is defined only inside int's range */
    if (!cJSON_IsNumber(v) || !(v->valuedouble >= 1 && v->valuedouble <= (1 << 20)) ||
        v->valuedouble != (double)(int)v->valuedouble)
        return moe_errf(err, MOE_ERR_CONFIG, "%s: %s%s\"%s\" must be a positive integer", path, obj, *obj ? "." : "",
                        key);
    *dst = (int)v->valuedouble;
    return MOE_OK;
}

/* A [r, c] pair of positive integers (0, 0 when absent). */
static moe_status get_pair(const cJSON *o, const char *path, const char *obj, const char *key, int out[2],
                           moe_error *err) {
    const cJSON *v = item(o, key);
    out[0] = out[1] = 0;
    if (!is_set(v)) return MOE_OK;
    bool ok = cJSON_IsArray(v) && cJSON_GetArraySize(v) == 2;
    for (int i = 0; ok && i < 2; i++) {
        const cJSON *x = cJSON_GetArrayItem(v, i);
        ok = cJSON_IsNumber(x) && x->valuedouble >= 1 && x->valuedouble <= (1 << 20) &&
             x->valuedouble == (double)(int)x->valuedouble;
        if (ok) out[i] = (int)x->valuedouble;
    }
    if (!ok) {
        out[0] = out[1] = 0;
        return moe_errf(err, MOE_ERR_CONFIG, "%s: %s.\"%s\" must be [rows, cols], two positive integers", path, obj,
                        key);
    }
    return MOE_OK;
}

/* A list of strings into a new array (*n, *out); MOE_ERR_CONFIG naming the key otherwise. */
static moe_status get_list(const cJSON *o, const char *path, const char *obj, const char *key, int *n, char ***out,
                           moe_error *err) {
    const cJSON *v = item(o, key);
    *n = 0;
    *out = NULL;
    if (!is_set(v)) return MOE_OK;
    if (!cJSON_IsArray(v))
        return moe_errf(err, MOE_ERR_CONFIG, "%s: %s.\"%s\" must be a list of strings", path, obj, key);
    int k = cJSON_GetArraySize(v);
    char **l = moe_calloc((size_t)k + 1, sizeof *l);
    if (!l) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    *out = l;
    for (int i = 0; i < k; i++) {
        const cJSON *x = cJSON_GetArrayItem(v, i);
        if (!cJSON_IsString(x))
            return moe_errf(err, MOE_ERR_CONFIG, "%s: %s.\"%s\"[%d] must be a string", path, obj, key, i);
        if (!(l[i] = dup_str(x->valuestring))) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
        *n = i + 1;
    }
    return MOE_OK;
}

#define TRY(x) do { moe_status st_ = (x); if (st_ != MOE_OK) return st_; } while (0)

/* The limits on a "re:" pattern of a config: glibc's regcomp copies the
 * subtree under each '+' once and under each {m,n} max(m, n) times, so a
 * pattern such as "((((a+)+)+)+..." asks for 2^40 nodes (fuzz-config:
 * 1.8 GB of regcomp's allocations from 430 bytes, fuzz/regress-config/
 * regex-nested-plus-oom). The product of those factors over the pattern
 * bounds the copies whatever the nesting. Real configs' patterns (".*mlp.
 * experts.*", "re:.*\\.(q|k|v)_proj$") have a product of 1 to 4. */
#define RE_MAX_LEN 256
#define RE_MAX_COPIES 4096

/* NULL when py may be compiled, else why not (static text). */
static const char *re_refusal(const char *py) {
    size_t n = strlen(py);
    if (n > RE_MAX_LEN) return "it is longer than 256 characters";
    double copies = 1;
    bool in_class = false;
    for (size_t i = 0; i < n; i++) {
        char c = py[i];
        if (c == '\\') {
            i++; /* the escaped character is literal */
            continue;
        }
        if (in_class) {
            in_class = c != ']';
            continue;
        }
        if (c == '[') {
            in_class = true;
            if (py[i + 1] == '^') i++;
            if (py[i + 1] == ']') i++; /* a leading ']' is a member */
        } else if (c == '+') {
            copies *= 2;
        } else if (c == '{') {
            double bound = 0, cur = 0;
            size_t j = i + 1;
            for (; j < n && ((py[j] >= '0' && py[j] <= '9') || py[j] == ','); j++) {
                if (py[j] == ',') { bound = bound > cur ? bound : cur; cur = 0; }
                else cur = cur * 10 + (py[j] - '0');
                if (cur > 1e6) break;
            }
            bound = bound > cur ? bound : cur;
            if (j < n && py[j] == '}' && bound > 1) copies *= bound;
        }
        if (copies > RE_MAX_COPIES) return "its repetitions ('+', '{m,n}') would copy it more than 4096 times";
    }
    return NULL;
}

/* Every "re:" entry of list [n] (key of obj) within the limits above, else
 * MOE_ERR_CONFIG naming the entry. */
static moe_status check_res(char *const *list, int n, const char *path, const char *obj, const char *key,
                            moe_error *err) {
    for (int i = 0; i < n; i++) {
        if (strncmp(list[i], "re:", 3) != 0) continue;
        const char *why = re_refusal(list[i] + 3);
        if (why)
            return moe_errf(err, MOE_ERR_CONFIG, "%s: %s.\"%s\"[%d] = \"%.80s%s\" is a regular expression moeaudit "
                            "does not compile: %s", path, obj, key, i, list[i], strlen(list[i]) > 80 ? "..." : "",
                            why);
    }
    return MOE_OK;
}

/* compressed-tensors quantization_config. */
static moe_status parse_ct(moe_qdecl *d, const cJSON *qc, const char *path, moe_error *err) {
    d->ct = true;
    TRY(get_str(qc, path, "quantization_config", "format", d->ct_format, sizeof d->ct_format, err));
    TRY(get_list(qc, path, "quantization_config", "ignore", &d->n_ignore, &d->ignore, err));
    TRY(check_res(d->ignore, d->n_ignore, path, "quantization_config", "ignore", err));
    const cJSON *g = item(qc, "config_groups");
    if (!is_set(g)) return MOE_OK;
    if (!cJSON_IsObject(g))
        return moe_errf(err, MOE_ERR_CONFIG, "%s: quantization_config.\"config_groups\" must be an object", path);
    int n = cJSON_GetArraySize(g);
    d->groups = moe_calloc((size_t)n + 1, sizeof *d->groups);
    if (!d->groups) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    for (const cJSON *e = g->child; e; e = e->next) {
        moe_qdecl_group *gr = &d->groups[d->n_groups++];
        snprintf(gr->name, sizeof gr->name, "%s", e->string);
        char obj[96];
        snprintf(obj, sizeof obj, "quantization_config.config_groups.%.48s", e->string);
        if (!cJSON_IsObject(e)) return moe_errf(err, MOE_ERR_CONFIG, "%s: %s must be an object", path, obj);
        TRY(get_list(e, path, obj, "targets", &gr->n_targets, &gr->targets, err));
        TRY(check_res(gr->targets, gr->n_targets, path, obj, "targets", err));
        TRY(get_str(e, path, obj, "format", gr->format, sizeof gr->format, err));
        if (!gr->format[0]) snprintf(gr->format, sizeof gr->format, "%s", d->ct_format);
        const cJSON *w = item(e, "weights");
        if (is_set(w)) {
            char wo[112];
            snprintf(wo, sizeof wo, "%s.weights", obj);
            if (!cJSON_IsObject(w)) return moe_errf(err, MOE_ERR_CONFIG, "%s: %s must be an object", path, wo);
            TRY(get_pos_int(w, path, wo, "num_bits", &gr->wbits, err));
            TRY(get_str(w, path, wo, "type", gr->wtype, sizeof gr->wtype, err));
            TRY(get_str(w, path, wo, "strategy", gr->wstrategy, sizeof gr->wstrategy, err));
            TRY(get_pos_int(w, path, wo, "group_size", &gr->wgroup, err));
            TRY(get_pair(w, path, wo, "block_structure", gr->wblock, err));
        }
        const cJSON *in = item(e, "input_activations");
        if (is_set(in) && cJSON_IsObject(in)) {
            gr->has_input = true;
            const cJSON *dy = item(in, "dynamic");
            gr->input_dynamic = cJSON_IsTrue(dy) || cJSON_IsString(dy);
        }
    }
    return MOE_OK;
}

/* ModelOpt's "quantization" object (hf_quant_config.json) or a config.json
 * quantization_config with quant_method "modelopt". */
static moe_status parse_modelopt(moe_qdecl *d, const cJSON *q, const char *path, const char *obj, bool legacy,
                                 moe_error *err) {
    d->modelopt = true;
    snprintf(d->mo_where, sizeof d->mo_where, "%s", legacy ? "hf_quant_config.json" : "config.json quantization_config");
    TRY(get_str(q, path, obj, "quant_algo", d->mo_algo, sizeof d->mo_algo, err));
    TRY(get_pos_int(q, path, obj, "group_size", &d->mo_group, err));
    TRY(get_str(q, path, obj, "kv_cache_quant_algo", d->mo_kv, sizeof d->mo_kv, err));
    TRY(get_list(q, path, obj, legacy ? "exclude_modules" : "ignore", &d->n_exclude, &d->exclude, err));
    for (char *c = d->mo_algo; *c; c++)
        if (*c >= 'a' && *c <= 'z') *c = (char)(*c - 'a' + 'A');
    const cJSON *ql = item(q, "quantized_layers");
    if (!is_set(ql)) return MOE_OK;
    if (!cJSON_IsObject(ql))
        return moe_errf(err, MOE_ERR_CONFIG, "%s: %s.\"quantized_layers\" must be an object", path, obj);
    int n = cJSON_GetArraySize(ql);
    d->layer_names = moe_calloc((size_t)n + 1, sizeof *d->layer_names);
    d->layer_algos = moe_calloc((size_t)n + 1, sizeof *d->layer_algos);
    if (!d->layer_names || !d->layer_algos) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    for (const cJSON *e = ql->child; e; e = e->next) {
        char lo[160];
        snprintf(lo, sizeof lo, "%s.quantized_layers.%.100s", obj, e->string);
        if (!cJSON_IsObject(e)) return moe_errf(err, MOE_ERR_CONFIG, "%s: %s must be an object", path, lo);
        int i = d->n_layers;
        TRY(get_str(e, path, lo, "quant_algo", d->layer_algos[i], sizeof d->layer_algos[i], err));
        for (char *c = d->layer_algos[i]; *c; c++)
            if (*c >= 'a' && *c <= 'z') *c = (char)(*c - 'a' + 'A');
        if (!(d->layer_names[i] = dup_str(e->string))) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
        d->n_layers = i + 1;
    }
    return MOE_OK;
}

static moe_status parse_qc(moe_qdecl *d, const cJSON *qc, const char *path, moe_error *err) {
    if (!cJSON_IsObject(qc)) return moe_errf(err, MOE_ERR_CONFIG, "%s: \"quantization_config\" must be an object", path);
    d->has_qc = true;
    const char *o = "quantization_config";
    TRY(get_str(qc, path, o, "quant_method", d->quant_method, sizeof d->quant_method, err));
    TRY(get_str(qc, path, o, "fmt", d->fmt, sizeof d->fmt, err));
    TRY(get_str(qc, path, o, "scale_fmt", d->scale_fmt, sizeof d->scale_fmt, err));
    TRY(get_str(qc, path, o, "activation_scheme", d->activation_scheme, sizeof d->activation_scheme, err));
    TRY(get_str(qc, path, o, "moe_quant_algo", d->moe_quant_algo, sizeof d->moe_quant_algo, err));
    TRY(get_pair(qc, path, o, "weight_block_size", d->block, err));
    if (!strcmp(d->quant_method, "compressed-tensors")) TRY(parse_ct(d, qc, path, err));
    if (!strncmp(d->quant_method, "modelopt", 8)) {
        const cJSON *inner = item(qc, "quantization");
        if (cJSON_IsObject(inner)) TRY(parse_modelopt(d, inner, path, "quantization_config.quantization", false, err));
        else TRY(parse_modelopt(d, qc, path, o, false, err));
    }
    return MOE_OK;
}

static moe_status parse_config(moe_qdecl *d, const cJSON *cfg, const char *path, moe_error *err) {
    if (!cJSON_IsObject(cfg)) return MOE_OK; /* moe_model_open reports a non-object config */
    const cJSON *tc = item(cfg, "text_config");
    if (is_set(tc) && !cJSON_IsObject(tc))
        return moe_errf(err, MOE_ERR_CONFIG, "%s: \"text_config\" must be an object", path);
    const cJSON *qc = item(cfg, "quantization_config");
    const char *where = "config.json quantization_config";
    if (!is_set(qc) && tc) {
        qc = item(tc, "quantization_config");
        where = "config.json text_config.quantization_config";
    }
    if (is_set(qc)) {
        TRY(parse_qc(d, qc, path, err));
        snprintf(d->cfg_where, sizeof d->cfg_where, "%s", where);
    }
    TRY(get_str(cfg, path, "", "expert_dtype", d->expert_dtype, sizeof d->expert_dtype, err));
    if (!d->expert_dtype[0] && tc) TRY(get_str(tc, path, "text_config", "expert_dtype", d->expert_dtype, sizeof d->expert_dtype, err));
    return MOE_OK;
}

/* Parse one JSON file of text [len] named path; NULL on failure (*st set). */
static cJSON *parse_json(const char *path, const char *text, size_t len, moe_status *st, moe_error *err) {
    cJSON *j = cJSON_ParseWithLength(text, len);
    if (!j) {
        *st = moe_errf(err, MOE_ERR_FORMAT, "%s: not valid JSON", path);
        return NULL;
    }
    const char *dup = moe_json_dup_key(j); /* parsers disagree on which value wins */
    if (dup) {
        char q[160];
        *st = moe_errf(err, MOE_ERR_FORMAT, "%s: key \"%s\" appears twice in one object", path,
                       moe_io_quote(dup, q, sizeof q));
        cJSON_Delete(j);
        return NULL;
    }
    *st = MOE_OK;
    return j;
}

moe_status moe_qdecl_parse(moe_qdecl *d, const char *cfg_path, const char *cfg, size_t cfg_len, const char *hfq_path,
                           const char *hfq, size_t hfq_len, moe_error *err) {
    memset(d, 0, sizeof *d);
    moe_status st = MOE_OK;
    if (cfg) {
        cJSON *c = parse_json(cfg_path, cfg, cfg_len, &st, err);
        if (!c) return st;
        st = parse_config(d, c, cfg_path, err);
        cJSON_Delete(c);
        if (st != MOE_OK) return st;
    }
    if (hfq) {
        cJSON *h = parse_json(hfq_path, hfq, hfq_len, &st, err);
        if (!h) return st;
        const cJSON *q = cJSON_IsObject(h) ? item(h, "quantization") : NULL;
        if (!cJSON_IsObject(q)) st = moe_errf(err, MOE_ERR_CONFIG, "%s: no \"quantization\" object", hfq_path);
        else {
            const cJSON *pr = item(h, "producer");
            if (cJSON_IsObject(pr)) {
                char nm[32] = "", ver[32] = "";
                st = get_str(pr, hfq_path, "producer", "name", nm, sizeof nm, err);
                if (st == MOE_OK) st = get_str(pr, hfq_path, "producer", "version", ver, sizeof ver, err);
                snprintf(d->mo_producer, sizeof d->mo_producer, "%s%s%s", nm, *ver ? " " : "", ver);
            }
            if (st == MOE_OK) st = parse_modelopt(d, q, hfq_path, "quantization", true, err);
        }
        cJSON_Delete(h);
    }
    return st;
}

/* the limit moe_model_open puts on config.json (src/io/model.c) */
#define QDECL_MAX_BYTES ((size_t)64 << 20)

/* Present in any form (a FIFO or directory named config.json is still the
 * file the user meant: its reader then says what is wrong with it). */
static bool present(const char *p) {
    struct stat sb;
    return stat(p, &sb) == 0;
}

moe_status moe_qdecl_read(const char *dir, moe_qdecl *d, moe_error *err) {
    memset(d, 0, sizeof *d);
    char *cpath = moe_path_join(dir, "config.json"), *hpath = moe_path_join(dir, "hf_quant_config.json");
    char *ctext = NULL, *htext = NULL;
    size_t clen = 0, hlen = 0;
    moe_status st = cpath && hpath ? MOE_OK : moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", dir);
    /* through the one FIFO-safe, bounded reader (io/files.h) */
    if (st == MOE_OK && present(cpath)) st = moe_io_read_file(cpath, NULL, QDECL_MAX_BYTES, &ctext, &clen, err);
    if (st == MOE_OK && present(hpath)) st = moe_io_read_file(hpath, NULL, QDECL_MAX_BYTES, &htext, &hlen, err);
    if (st == MOE_OK) st = moe_qdecl_parse(d, cpath, ctext, clen, hpath, htext, hlen, err);
    free(ctext);
    free(htext);
    free(cpath);
    free(hpath);
    return st;
}

static void free_list(char **l, int n) {
    for (int i = 0; l && i < n; i++) free(l[i]);
    free(l);
}

void moe_qdecl_free(moe_qdecl *d) {
    if (!d) return;
    free_list(d->exclude, d->n_exclude);
    free_list(d->layer_names, d->n_layers);
    free(d->layer_algos);
    for (int i = 0; i < d->n_groups; i++) free_list(d->groups[i].targets, d->groups[i].n_targets);
    free(d->groups);
    free_list(d->ignore, d->n_ignore);
    memset(d, 0, sizeof *d);
}

bool moe_qdecl_present(const moe_qdecl *d) {
    return d->has_qc || d->modelopt || d->ct || d->expert_dtype[0];
}

bool moe_qdecl_fp8_block(const moe_qdecl *d, int *br, int *bc, const char **where) {
    if (d->block[0] > 0) {
        *br = d->block[0];
        *bc = d->block[1];
        if (where) *where = "weight_block_size";
        return true;
    }
    for (int i = 0; i < d->n_groups; i++)
        if (d->groups[i].wbits == 8 && !strcmp(d->groups[i].wstrategy, "block") && d->groups[i].wblock[0] > 0) {
            *br = d->groups[i].wblock[0];
            *bc = d->groups[i].wblock[1];
            if (where) *where = "config_groups weights.block_structure";
            return true;
        }
    return false;
}

/* ------------------------------------------------------------ name matching */

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

moe_qfamily moe_qfamily_of(const char *base) {
    const char *e = strstr(base, ".experts.");
    if (strstr(base, ".shared_experts.")) return MOE_QFAM_SHARED;
    if (e) return MOE_QFAM_ROUTED;
    if (ends_with(base, ".mlp.gate") || ends_with(base, ".ffn.gate")) return MOE_QFAM_ROUTER;
    if (strstr(base, ".mlp.") && (ends_with(base, "gate_proj") || ends_with(base, "up_proj") || ends_with(base, "down_proj")))
        return MOE_QFAM_DENSE;
    if (strstr(base, ".ffn.") && (ends_with(base, ".w1") || ends_with(base, ".w2") || ends_with(base, ".w3")))
        return MOE_QFAM_DENSE;
    return MOE_QFAM_OTHER;
}

/* The name as given and with "model." added or removed: [2]. */
static void name_forms(const char *base, char forms[2][320]) {
    snprintf(forms[0], sizeof forms[0], "%s", base);
    if (!strncmp(base, "model.", 6)) snprintf(forms[1], sizeof forms[1], "%s", base + 6);
    else snprintf(forms[1], sizeof forms[1], "model.%s", base);
}

/* A ModelOpt wildcard: fnmatch on the module name (and on "<name>.weight"),
 * or the pattern names the module or a parent of it. */
static bool mo_match(const char *pat, const char *base) {
    char forms[2][320];
    name_forms(base, forms);
    size_t pl = strlen(pat);
    for (int i = 0; i < 2; i++) {
        char wname[340];
        snprintf(wname, sizeof wname, "%.320s.weight", forms[i]);
        if (!fnmatch(pat, forms[i], 0) || !fnmatch(pat, wname, 0)) return true;
        if (!strncmp(forms[i], pat, pl) && (forms[i][pl] == 0 || forms[i][pl] == '.')) return true;
    }
    return false;
}

/* A Python regex of the simple kind configs use, as a POSIX ERE anchored at
 * the start (re.match): \d \w \s become classes, (?: becomes (. */
static bool re_match(const char *py, const char *name) {
    if (re_refusal(py)) return false; /* refused when the config was read: never compiled */
    char ere[600];
    size_t o = 0;
    ere[o++] = '^';
    for (const char *p = py; *p && o + 16 < sizeof ere; p++) {
        if (p[0] == '\\' && p[1] == 'd') { memcpy(ere + o, "[0-9]", 5); o += 5; p++; }
        else if (p[0] == '\\' && p[1] == 'w') { memcpy(ere + o, "[A-Za-z0-9_]", 12); o += 12; p++; }
        else if (p[0] == '\\' && p[1] == 's') { memcpy(ere + o, "[[:space:]]", 11); o += 11; p++; }
        else if (p[0] == '(' && p[1] == '?' && p[2] == ':') { ere[o++] = '('; p += 2; }
        else ere[o++] = *p;
    }
    ere[o] = 0;
    regex_t re;
    if (regcomp(&re, ere, REG_EXTENDED | REG_NOSUB) != 0) return false;
    bool m = regexec(&re, name, 0, NULL, 0) == 0;
    regfree(&re);
    return m;
}

/* A compressed-tensors target or ignore entry against a module. "Linear"
 * matches any linear that is not the router. */
static bool ct_match(const char *target, const char *base) {
    char forms[2][320];
    name_forms(base, forms);
    if (!strcmp(target, "Linear")) return moe_qfamily_of(base) != MOE_QFAM_ROUTER;
    for (int i = 0; i < 2; i++) {
        if (!strncmp(target, "re:", 3)) {
            if (re_match(target + 3, forms[i])) return true;
        } else if (!strcmp(target, forms[i])) {
            return true;
        }
    }
    return false;
}

static moe_qexp algo_exp(const char *algo) {
    if (strstr(algo, "NVFP4")) return MOE_QEXP_NVFP4;
    if (!strcmp(algo, "FP8")) return MOE_QEXP_FP8_TENSOR;
    if (!strncmp(algo, "FP8", 3)) return MOE_QEXP_FP8;
    return MOE_QEXP_ANY;
}

moe_qexp moe_qdecl_expect(const moe_qdecl *d, const char *base, char *why, size_t cap) {
    moe_qfamily fam = moe_qfamily_of(base);
    why[0] = 0;
    if (d->ct) {
        for (int i = 0; i < d->n_ignore; i++)
            if (ct_match(d->ignore[i], base)) {
                snprintf(why, cap, "%s.ignore entry \"%s\"", d->cfg_where, d->ignore[i]);
                return MOE_QEXP_PLAIN;
            }
        for (int g = 0; g < d->n_groups; g++) {
            const moe_qdecl_group *gr = &d->groups[g];
            for (int t = 0; t < gr->n_targets; t++) {
                if (!ct_match(gr->targets[t], base)) continue;
                snprintf(why, cap, "%s.config_groups.%s (targets \"%s\", format \"%s\")", d->cfg_where, gr->name,
                         gr->targets[t], gr->format);
                if (strstr(gr->format, "nvfp4") || (gr->wbits == 4 && !strcmp(gr->wtype, "float")))
                    return MOE_QEXP_NVFP4;
                if (gr->wbits == 8 && !strcmp(gr->wtype, "float"))
                    return !strcmp(gr->wstrategy, "tensor") ? MOE_QEXP_FP8_TENSOR : MOE_QEXP_FP8;
                return MOE_QEXP_ANY;
            }
        }
    }
    if (d->modelopt) {
        for (int i = 0; i < d->n_exclude; i++)
            if (mo_match(d->exclude[i], base)) {
                snprintf(why, cap, "%s exclude_modules entry \"%s\"", d->mo_where, d->exclude[i]);
                return MOE_QEXP_NOT_MODELOPT;
            }
        for (int i = 0; i < d->n_layers; i++) {
            size_t l = strlen(d->layer_names[i]);
            char forms[2][320];
            name_forms(base, forms);
            for (int f = 0; f < 2; f++)
                if (!strncmp(forms[f], d->layer_names[i], l) && (forms[f][l] == 0 || forms[f][l] == '.')) {
                    snprintf(why, cap, "%s quantized_layers[\"%s\"] quant_algo \"%s\"", d->mo_where, d->layer_names[i],
                             d->layer_algos[i]);
                    return algo_exp(d->layer_algos[i]);
                }
        }
        if (strcmp(d->mo_algo, "MIXED_PRECISION") != 0 &&
            (fam == MOE_QFAM_ROUTED || fam == MOE_QFAM_SHARED || fam == MOE_QFAM_DENSE) && algo_exp(d->mo_algo) != MOE_QEXP_ANY) {
            snprintf(why, cap, "%s quant_algo \"%s\" (not excluded)", d->mo_where, d->mo_algo);
            return algo_exp(d->mo_algo);
        }
    }
    if (fam == MOE_QFAM_ROUTED) {
        if (!strcasecmp(d->moe_quant_algo, "NVFP4")) {
            snprintf(why, cap, "%s moe_quant_algo \"%s\"", d->cfg_where, d->moe_quant_algo);
            return MOE_QEXP_NVFP4;
        }
        if (!strcmp(d->expert_dtype, "fp4")) {
            snprintf(why, cap, "config.json expert_dtype \"fp4\"%s", d->moe_quant_algo[0] ? "" : " (no moe_quant_algo: DeepSeek's MXFP4)");
            return d->moe_quant_algo[0] ? MOE_QEXP_FP4 : MOE_QEXP_MXFP4;
        }
        if (!strcmp(d->expert_dtype, "fp8")) {
            snprintf(why, cap, "config.json expert_dtype \"fp8\"");
            return MOE_QEXP_FP8;
        }
    }
    return MOE_QEXP_ANY;
}

void moe_qdecl_describe(const moe_qdecl *d, char *buf, size_t cap) {
    buf[0] = 0;
    size_t o = 0;
#define PUT(...) do { if (o < cap) o += (size_t)snprintf(buf + o, cap - o, __VA_ARGS__); } while (0)
    if (!moe_qdecl_present(d)) { PUT("none declared"); return; }
    if (d->has_qc && !d->ct && strncmp(d->quant_method, "modelopt", 8) != 0) {
        PUT("%s", d->quant_method[0] ? d->quant_method : "quantization_config");
        if (d->fmt[0]) PUT(" %s", d->fmt);
        if (d->block[0]) PUT(" %dx%d", d->block[0], d->block[1]);
        if (d->scale_fmt[0]) PUT(" scale_fmt %s", d->scale_fmt);
        if (d->activation_scheme[0]) PUT(", %s activations", d->activation_scheme);
        if (d->moe_quant_algo[0]) PUT("; moe_quant_algo %s", d->moe_quant_algo);
    }
    if (d->expert_dtype[0]) PUT("%sexpert_dtype %s", o ? "; " : "", d->expert_dtype);
    if (d->modelopt) {
        PUT("%sModelOpt %s (%s)", o ? "; " : "", d->mo_algo[0] ? d->mo_algo : "?", d->mo_where);
        if (d->mo_group) PUT(" group %d", d->mo_group);
        if (d->mo_kv[0]) PUT(", kv cache %s", d->mo_kv);
        if (d->n_layers) PUT(", %d quantized_layers", d->n_layers);
        if (d->n_exclude) PUT(", %d excluded", d->n_exclude);
    }
    if (d->ct) {
        PUT("%scompressed-tensors %s, %d group%s", o ? "; " : "", d->ct_format[0] ? d->ct_format : "", d->n_groups,
            d->n_groups == 1 ? "" : "s");
        for (int g = 0; g < d->n_groups; g++)
            PUT(" [%s: %s %d-bit %s %s]", d->groups[g].name, d->groups[g].format, d->groups[g].wbits,
                d->groups[g].wtype, d->groups[g].wstrategy);
        if (d->n_ignore) PUT(", %d ignored", d->n_ignore);
    }
#undef PUT
}
