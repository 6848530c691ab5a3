/*
 * Synthetic checkpoints: a real directory (config.json + model.safetensors,
 * BF16, DeepSeek V4 or HF V3 names) with random weights drawn so that routing
 * is realistic rather than uniform: router rows have per-expert norms spread
 * over a factor of ~2, the correction bias is small, expert weights are
 * scaled 1/sqrt(fan_in) so activations keep unit size. Deterministic in seed.
 */
#include "core/core.h"
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

typedef struct rng { uint64_t s; } rng;

static uint64_t next(rng *r) {
    uint64_t z = (r->s += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static double uniform(rng *r) { return ((double)(next(r) >> 11) + 0.5) * 0x1.0p-53; }

static double normal(rng *r) {
    double u = uniform(r), v = uniform(r);
    return sqrt(-2.0 * log(u)) * cos(6.283185307179586 * v);
}

typedef struct tensors {
    moe_st_entry *e;
    void **bufs;
    char **names;
    size_t n, cap;
} tensors;

static void tensors_free(tensors *t) {
    for (size_t i = 0; i < t->n; i++) { free(t->bufs[i]); free(t->names[i]); }
    free(t->e);
    free(t->bufs);
    free(t->names);
}

/* Append a tensor whose buffer (malloc'd) becomes owned by t. */
static int add(tensors *t, const char *name, moe_dtype dt, int ndim, int64_t d0, int64_t d1, void *buf) {
    if (!buf) return -1;
    if (t->n == t->cap) {
        size_t cap = t->cap ? 2 * t->cap : 128;
        moe_st_entry *e = realloc(t->e, cap * sizeof *e);
        if (e) t->e = e;
        void **b = realloc(t->bufs, cap * sizeof *b);
        if (b) t->bufs = b;
        char **n = realloc(t->names, cap * sizeof *n);
        if (n) t->names = n;
        if (!e || !b || !n) { free(buf); return -1; }
        t->cap = cap;
    }
    size_t len = strlen(name) + 1;
    char *nm = malloc(len);
    if (!nm) { free(buf); return -1; }
    memcpy(nm, name, len);
    moe_st_entry *e = &t->e[t->n];
    memset(e, 0, sizeof *e);
    e->name = nm;
    e->dtype = dt;
    e->ndim = ndim;
    e->shape[0] = d0;
    e->shape[1] = d1;
    e->data = buf;
    t->bufs[t->n] = buf;
    t->names[t->n] = nm;
    t->n++;
    return 0;
}

/* BF16 [rows, cols] with entries N(0, 1) * row_scale(r) * std. */
static uint16_t *bf16_matrix(rng *r, int64_t rows, int64_t cols, double std, const double *row_scale) {
    uint16_t *m = moe_malloc((size_t)(rows * cols), sizeof *m);
    if (!m) return NULL;
    for (int64_t i = 0; i < rows; i++) {
        double s = std * (row_scale ? row_scale[i] : 1.0);
        for (int64_t j = 0; j < cols; j++) m[i * cols + j] = moe_bf16_from_f32((float)(normal(r) * s));
    }
    return m;
}

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
    char path[4200];
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *f = fopen(path, "w");
    if (!f) { free(text); return moe_errf(err, MOE_ERR_IO, "%s: cannot create: %s", path, strerror(errno)); }
    int ok = fputs(text, f) >= 0;
    ok = fclose(f) == 0 && ok;
    free(text);
    return ok ? MOE_OK : moe_errf(err, MOE_ERR_IO, "%s: write failed", path);
}

moe_status moe_synth_write(const char *dir, const moe_synth_opts *o, moe_error *err) {
    if (o->hidden < 1 || o->inter < 1 || o->n_experts < 1 || o->top_k < 1 || o->top_k > o->n_experts ||
        o->n_layers < 1 || o->n_hash_layers < 0 || o->n_hash_layers > o->n_layers ||
        (o->n_hash_layers > 0 && o->vocab < 1) || o->n_group < 1 || o->n_experts % o->n_group)
        return moe_errf(err, MOE_ERR_ARG, "synthetic model options are inconsistent");
    if (mkdir(dir, 0755) != 0 && errno != EEXIST)
        return moe_errf(err, MOE_ERR_IO, "%s: cannot create: %s", dir, strerror(errno));
    rng r = {o->seed};
    tensors t = {0};
    bool v4 = o->arch == MOE_ARCH_V4;
    int H = o->hidden, I = o->inter, E = o->n_experts, K = o->top_k;
    const char *pfx = v4 ? "model.layers" : "model.layers";
    const char *ffn = v4 ? "ffn" : "mlp";
    const char *proj[3] = {v4 ? "w1" : "gate_proj", v4 ? "w3" : "up_proj", v4 ? "w2" : "down_proj"};
    char name[256];
    int bad = 0;
    double *row_scale = moe_malloc((size_t)E, sizeof(double));
    if (!row_scale) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    for (int l = 0; l < o->n_layers && !bad; l++) {
        bool hash = v4 && l < o->n_hash_layers;
        /* router: expert popularity spread (row norms from 0.7 to 1.4) */
        for (int e = 0; e < E; e++) row_scale[e] = 0.7 + 0.7 * uniform(&r);
        snprintf(name, sizeof name, "%s.%d.%s.gate.weight", pfx, l, ffn);
        bad |= add(&t, name, MOE_DTYPE_BF16, 2, E, H, bf16_matrix(&r, E, H, 2.0 / sqrt((double)H), row_scale));
        if (hash) {
            int64_t *tid = moe_malloc((size_t)o->vocab * (size_t)K, sizeof *tid);
            for (int v = 0; tid && v < o->vocab; v++)
                for (int j = 0; j < K; j++) {
                    int64_t e;
                    bool dup;
                    do { /* distinct experts per token */
                        e = (int64_t)(next(&r) % (uint64_t)E);
                        dup = false;
                        for (int q = 0; q < j; q++) dup |= tid[v * K + q] == e;
                    } while (dup);
                    tid[v * K + j] = e;
                }
            snprintf(name, sizeof name, "%s.%d.%s.gate.tid2eid", pfx, l, ffn);
            bad |= add(&t, name, MOE_DTYPE_I64, 2, o->vocab, K, tid);
        } else {
            uint16_t *b = moe_malloc((size_t)E, sizeof *b);
            for (int e = 0; b && e < E; e++) b[e] = moe_bf16_from_f32((float)(0.05 * normal(&r)));
            snprintf(name, sizeof name, "%s.%d.%s.gate.%s", pfx, l, ffn, v4 ? "bias" : "e_score_correction_bias");
            bad |= add(&t, name, MOE_DTYPE_BF16, 1, E, 0, b);
        }
        for (int e = 0; e <= E && !bad; e++) {
            for (int k = 0; k < 3; k++) {
                bool down = k == 2;
                if (e < E) snprintf(name, sizeof name, "%s.%d.%s.experts.%d.%s.weight", pfx, l, ffn, e, proj[k]);
                else snprintf(name, sizeof name, "%s.%d.%s.shared_experts.%s.weight", pfx, l, ffn, proj[k]);
                int64_t rows = down ? H : I, cols = down ? I : H;
                bad |= add(&t, name, MOE_DTYPE_BF16, 2, rows, cols,
                           bf16_matrix(&r, rows, cols, 1.0 / sqrt((double)cols), NULL));
            }
        }
    }
    free(row_scale);
    moe_status st = MOE_OK;
    if (bad) st = moe_errf(err, MOE_ERR_NOMEM, "out of memory building the synthetic model");
    if (st == MOE_OK) {
        char path[4200];
        snprintf(path, sizeof path, "%s/model.safetensors", dir);
        static const char *const meta[] = {"format", "pt", "producer", "moeaudit synth", NULL};
        st = moe_st_write(path, t.e, t.n, meta, err);
    }
    tensors_free(&t);
    if (st == MOE_OK) st = write_config(dir, o, err);
    return st;
}
