/*
 * The seed corpora of the fuzzers (fuzz/corpus-<target>/seed-*), made from
 * real files: tiny synthetic checkpoints written by the library's own
 * writers in every layout and format (moe_synth_write, moe_quantize_checkpoint),
 * tensors of the bundled V4 fixture, dumps of real block runs (correct and
 * with each injected fault), the inputs of run / needle / run --block hc /
 * forward.
 *
 *     cmake --build build --target fuzz-seeds && ./build/fuzz-seeds fuzz
 *
 * writes fuzz/corpus-*\/seed-* (existing seeds of the same name are
 * replaced; other files, such as reproducers, are left alone).
 */
#include "fuzz.h"
#include "moeaudit_indexer.h"
#include "moeaudit_variant.h"

#include <dirent.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <sys/stat.h>
#include <unistd.h>

#ifndef MOE_TEST_DATA
#define MOE_TEST_DATA "tests/data"
#endif

static uint32_t bits(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    return u;
}

static const char *root;
static char scratch[256];

static void die(const char *what, const moe_error *err) {
    fprintf(stderr, "fuzz-seeds: %s: %s\n", what, err ? err->msg : strerror(errno));
    exit(1);
}

static uint8_t *slurp(const char *path, size_t *n) {
    struct stat sb;
    if (stat(path, &sb) != 0) die(path, NULL);
    FILE *f = fopen(path, "rb");
    if (!f) die(path, NULL);
    uint8_t *b = malloc((size_t)sb.st_size + 1);
    *n = fread(b, 1, (size_t)sb.st_size, f);
    fclose(f);
    return b;
}

/* corpus-<target>/seed-<name>: prefix [np] bytes, then data [n]. */
static void seed(const char *target, const char *name, const void *prefix, size_t np, const void *data, size_t n) {
    char dir[512], path[700];
    snprintf(dir, sizeof dir, "%s/corpus-%s", root, target);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/seed-%s", dir, name);
    uint8_t *b = malloc(np + n + 1);
    if (np) memcpy(b, prefix, np);
    if (n) memcpy(b + np, data, n);
    moe_error err;
    if (moe_write_file(path, b, np + n, &err) != MOE_OK) die(path, &err);
    free(b);
    printf("%-60s %zu bytes\n", path, np + n);
}

/* A safetensors file of entries [n] as bytes (written, read back). */
static uint8_t *st_bytes(const moe_st_entry *e, size_t n, size_t *len) {
    char path[300];
    snprintf(path, sizeof path, "%s/st.safetensors", scratch);
    moe_error err;
    if (moe_st_write(path, e, n, NULL, &err) != MOE_OK) die("st_bytes", &err);
    return slurp(path, len);
}

static int name_cmp(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

/* Pack every file of dir into a container; names in `only` (NULL: all but
 * oracle_* and hidden files). */
static uint8_t *pack_dir(const char *dir, size_t *len) {
    size_t cap = 1 << 20;
    uint8_t *b = malloc(cap);
    *len = 0;
    DIR *d = opendir(dir);
    if (!d) die(dir, NULL);
    /* config.json first, then the other files by name: readdir's order
     * depends on the file system (not on the loader, which takes files in
     * any order), and a seed must not change with it */
    char path[700];
    snprintf(path, sizeof path, "%s/config.json", dir);
    size_t n;
    uint8_t *c = slurp(path, &n);
    if (fuzz_pack(b, cap, len, "config.json", c, n)) die("pack config", NULL);
    free(c);
    char *names[64];
    size_t nn = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        if (de->d_name[0] == '.' || !strcmp(de->d_name, "config.json") || !strncmp(de->d_name, "oracle", 6)) continue;
        if (nn == sizeof names / sizeof names[0]) die("pack: too many files", NULL);
        names[nn++] = strdup(de->d_name);
    }
    closedir(d);
    qsort(names, nn, sizeof names[0], name_cmp);
    for (size_t i = 0; i < nn; i++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[i]);
        uint8_t *x = slurp(path, &n);
        if (fuzz_pack(b, cap, len, names[i], x, n)) die("pack: too large", NULL);
        free(x);
        free(names[i]);
    }
    return b;
}

static void synth_dir(const char *name, const moe_synth_opts *o, char *dir, size_t cap) {
    snprintf(dir, cap, "%s/%s", scratch, name);
    moe_error err;
    if (moe_synth_write(dir, o, &err) != MOE_OK) die(name, &err);
}

/* Split dir/model.safetensors into two shards + an index, in place. */
static void shard_dir(const char *dir) {
    char path[700];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    moe_st_file *f = NULL;
    moe_error err;
    if (moe_st_open(path, &f, &err) != MOE_OK) die(path, &err);
    size_t n = moe_st_count(f), h = n / 2;
    moe_st_entry *e = calloc(n, sizeof *e);
    char *index = malloc(1 << 16);
    size_t o = (size_t)snprintf(index, 1 << 16, "{\"metadata\": {}, \"weight_map\": {");
    for (size_t i = 0; i < n; i++) {
        const moe_st_tensor *t = moe_st_at(f, i);
        e[i] = (moe_st_entry){.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .data = t->data};
        memcpy(e[i].shape, t->shape, sizeof t->shape);
        o += (size_t)snprintf(index + o, (1 << 16) - o, "%s\"%s\": \"model-0000%d-of-00002.safetensors\"", i ? ", " : "",
                              t->name, i < h ? 1 : 2);
    }
    o += (size_t)snprintf(index + o, (1 << 16) - o, "}}");
    snprintf(path, sizeof path, "%s/model-00001-of-00002.safetensors", dir);
    if (moe_st_write(path, e, h, NULL, &err) != MOE_OK) die(path, &err);
    snprintf(path, sizeof path, "%s/model-00002-of-00002.safetensors", dir);
    if (moe_st_write(path, e + h, n - h, NULL, &err) != MOE_OK) die(path, &err);
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    if (moe_write_file(path, index, o, &err) != MOE_OK) die(path, &err);
    moe_st_close(f);
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    unlink(path);
    free(e);
    free(index);
}

static void checkpoint_seeds(void) {
    char dir[512], qdir[512];
    size_t len;
    uint8_t *b;
    /* V4: hash layer, two top-k layers, shared expert; BF16 */
    moe_synth_opts o = moe_synth_opts_default();
    o.hidden = 16;
    o.inter = 8;
    o.n_experts = 4;
    o.top_k = 2;
    o.n_layers = 3;
    o.n_hash_layers = 1;
    o.vocab = 8;
    synth_dir("v4", &o, dir, sizeof dir);
    b = pack_dir(dir, &len);
    seed("checkpoint", "v4-bf16", NULL, 0, b, len);
    free(b);
    /* the same, sharded with an index */
    shard_dir(dir);
    b = pack_dir(dir, &len);
    seed("checkpoint", "v4-sharded", NULL, 0, b, len);
    free(b);
    /* V3 grouped (sigmoid, 2 groups of 2, bias) */
    moe_synth_opts v3 = o;
    v3.arch = MOE_ARCH_V3;
    v3.n_hash_layers = 0;
    v3.n_layers = 2;
    v3.n_group = 2;
    v3.topk_group = 1;
    synth_dir("v3", &v3, dir, sizeof dir);
    b = pack_dir(dir, &len);
    seed("checkpoint", "v3-grouped", NULL, 0, b, len);
    free(b);
    /* quantized: FP8 (V3 names: fp32 weight_scale_inv), MXFP4 and NVFP4 (V4
     * names, blocks of 32 need H = I = 32) */
    moe_quant_opts q = {MOE_Q_FP8, MOE_Q_FP8, 0, 0};
    moe_quant_report rep;
    moe_error err;
    snprintf(qdir, sizeof qdir, "%s/v3-fp8", scratch);
    if (moe_quantize_checkpoint(dir, qdir, &q, &rep, &err) != MOE_OK) die("fp8", &err);
    b = pack_dir(qdir, &len);
    seed("checkpoint", "v3-fp8", NULL, 0, b, len);
    free(b);
    moe_synth_opts v4q = o;
    v4q.hidden = 32;
    v4q.inter = 32;
    v4q.n_layers = 2;
    synth_dir("v4-32", &v4q, dir, sizeof dir);
    moe_qfmt fmts[2] = {MOE_Q_MXFP4, MOE_Q_NVFP4};
    for (int i = 0; i < 2; i++) {
        q = (moe_quant_opts){fmts[i], i == 0 ? MOE_Q_FP8 : MOE_Q_NONE, 0, 0};
        snprintf(qdir, sizeof qdir, "%s/v4-%s", scratch, moe_qfmt_name(fmts[i]));
        if (moe_quantize_checkpoint(dir, qdir, &q, &rep, &err) != MOE_OK) die("fp4", &err);
        b = pack_dir(qdir, &len);
        char name[64];
        snprintf(name, sizeof name, "v4-%s", moe_qfmt_name(fmts[i]));
        seed("checkpoint", name, NULL, 0, b, len);
        free(b);
    }
    /* the V4 fixture's config with layer 3's hyper-connection and indexer
     * tensors (moe_hc_load, moe_idx_load) */
    moe_st_file *f = NULL;
    if (moe_st_open(MOE_TEST_DATA "/dsv4-tiny/model.safetensors", &f, &err) != MOE_OK) die("dsv4-tiny", &err);
    moe_st_entry e[32];
    size_t ne = 0;
    for (size_t i = 0; i < moe_st_count(f) && ne < 32; i++) {
        const moe_st_tensor *t = moe_st_at(f, i);
        if (strncmp(t->name, "model.layers.3.", 15) != 0) continue;
        if (!strstr(t->name, ".hc_ffn_") && !strstr(t->name, ".indexer.wq_b") && !strstr(t->name, ".indexer.weights_proj") &&
            !strstr(t->name, ".ffn.gate."))
            continue;
        e[ne] = (moe_st_entry){.name = t->name, .dtype = t->dtype, .ndim = t->ndim, .data = t->data};
        memcpy(e[ne].shape, t->shape, sizeof t->shape);
        ne++;
    }
    size_t sl, cl;
    uint8_t *sb = st_bytes(e, ne, &sl), *cb = slurp(MOE_TEST_DATA "/dsv4-tiny/config.json", &cl);
    size_t cap = sl + cl + 1024;
    b = malloc(cap);
    len = 0;
    fuzz_pack(b, cap, &len, "config.json", cb, cl);
    fuzz_pack(b, cap, &len, "model.safetensors", sb, sl);
    seed("checkpoint", "v4-fixture-hc-indexer", NULL, 0, b, len);
    free(b);
    free(sb);
    moe_st_close(f);
    /* config seeds: byte 0 bit 0 = index, else bit 1 = hf_quant_config.json,
     * else config.json */
    uint8_t z = 0, one = 1, two = 2;
    seed("config", "v4-fixture", &z, 1, cb, cl);
    free(cb);
    cb = slurp(MOE_TEST_DATA "/dsv3-tiny/config.json", &cl);
    seed("config", "v3-fixture", &z, 1, cb, cl);
    free(cb);
    snprintf(qdir, sizeof qdir, "%s/v4/model.safetensors.index.json", scratch);
    cb = slurp(qdir, &cl);
    seed("config", "index-sharded", &one, 1, cb, cl);
    free(cb);
    /* ModelOpt's hf_quant_config.json as nvidia/DeepSeek-V4-Flash-NVFP4
     * writes it (docs/formats.md): quantized_layers and exclude_modules */
    static const char hfq[] =
        "{\"producer\": {\"name\": \"modelopt\", \"version\": \"dsv4-nvfp4-experts\"}, \"quantization\": "
        "{\"quant_algo\": \"MIXED_PRECISION\", \"kv_cache_quant_algo\": null, \"group_size\": 16, "
        "\"quantized_layers\": {\"layers.1.ffn.experts\": {\"quant_algo\": \"NVFP4\", \"group_size\": 16}}, "
        "\"exclude_modules\": [\"*.attn.*\", \"*.ffn.gate.*\", \"embed.weight\", \"head.weight\"]}}";
    seed("config", "hfq-modelopt-v4", &two, 1, hfq, sizeof hfq - 1);
}

/* Dumps: the block's own outputs (correct, and with each fault), in F32 and
 * BF16, with and without the optional tensors; all-NaN and all-zero. */
static void dump_seeds(void) {
    for (int which = 0; which < 3; which++) {
        moe_layer *L = fuzz_layer(which);
        int H = L->cfg.hidden, T = 4;
        double x[4 * FUZZ_H];
        uint64_t s = 5 + (uint64_t)which;
        for (int i = 0; i < T * H; i++) x[i] = fuzz_gauss(&s);
        int64_t ids[4] = {1, 5, 7, 30};
        moe_fault faults[3] = {MOE_FAULT_NONE, MOE_FAULT_SCALE_DOUBLE, MOE_FAULT_NOT_RENORMALIZED};
        for (int fi = 0; fi < 3; fi++) {
            moe_run_opts o = moe_run_opts_default();
            moe_variant v = moe_variant_none();
            v.fault = faults[fi];
            moe_block_out out;
            moe_error err;
            if (moe_block_out_init(&out, L, T, &o, &err) != MOE_OK ||
                moe_block_run_variant(L, x, ids, T, &o, &v, &out, &err) != MOE_OK)
                die("dump run", &err);
            float hf[4 * FUZZ_H], of[4 * FUZZ_H];
            for (int i = 0; i < T * H; i++) { hf[i] = (float)x[i]; of[i] = (float)out.moe_out[i]; }
            moe_st_entry e[8] = {
                {.name = "hidden", .dtype = MOE_DTYPE_F32, .ndim = 2, .shape = {T, H}, .data = hf},
                {.name = "moe_out", .dtype = MOE_DTYPE_F32, .ndim = 2, .shape = {T, H}, .data = of},
                {.name = "router_logits", .dtype = MOE_DTYPE_F64, .ndim = 2, .shape = {T, out.E}, .data = out.router_logits},
                {.name = "topk_ids", .dtype = MOE_DTYPE_I32, .ndim = 2, .shape = {T, out.n_cols}, .data = out.topk_ids},
                {.name = "topk_weights", .dtype = MOE_DTYPE_F64, .ndim = 2, .shape = {T, out.n_cols}, .data = out.topk_weights},
                {.name = "routed_out", .dtype = MOE_DTYPE_F64, .ndim = 2, .shape = {T, H}, .data = out.routed_out},
                {.name = "shared_out", .dtype = MOE_DTYPE_F64, .ndim = 2, .shape = {T, H}, .data = out.shared_out},
                {.name = "input_ids", .dtype = MOE_DTYPE_I64, .ndim = 1, .shape = {T}, .data = ids},
            };
            size_t len;
            uint8_t *b = st_bytes(e, fi == 0 ? 8 : 2, &len);
            uint8_t sel = (uint8_t)which;
            char name[64];
            snprintf(name, sizeof name, "layer%d-fault%d", which, fi);
            seed("dump", name, &sel, 1, b, len);
            free(b);
            if (fi == 0) {
                /* input seeds from the same tensors: hidden + input_ids */
                moe_st_entry in[2] = {e[0], e[7]};
                b = st_bytes(in, 2, &len);
                snprintf(name, sizeof name, "layer%d-f32", which);
                seed("input", name, &sel, 1, b, len);
                free(b);
                uint16_t hb[4 * FUZZ_H];
                for (int i = 0; i < T * H; i++) hb[i] = (uint16_t)(bits(hf[i]) >> 16);
                in[0] = (moe_st_entry){.name = "hidden", .dtype = MOE_DTYPE_BF16, .ndim = 2, .shape = {T, H}, .data = hb};
                int32_t ids32[4] = {31, 0, 2, 3};
                in[1] = (moe_st_entry){.name = "input_ids", .dtype = MOE_DTYPE_I32, .ndim = 1, .shape = {T}, .data = ids32};
                b = st_bytes(in, 2, &len);
                snprintf(name, sizeof name, "layer%d-bf16", which);
                uint8_t sel2 = (uint8_t)(which | 4 | 32); /* f32 path, fused shared */
                seed("input", name, &sel2, 1, b, len);
                free(b);
            }
            moe_block_out_free(&out);
        }
        /* all NaN, all zero (issue #12 item 5's dumps) */
        for (int k = 0; k < 2; k++) {
            float v[4 * FUZZ_H];
            for (int i = 0; i < T * H; i++) v[i] = k ? 0.0f : NAN;
            moe_st_entry e[2] = {{.name = "hidden", .dtype = MOE_DTYPE_F32, .ndim = 2, .shape = {T, H}, .data = v},
                                 {.name = "moe_out", .dtype = MOE_DTYPE_F32, .ndim = 2, .shape = {T, H}, .data = v}};
            size_t len;
            uint8_t *b = st_bytes(e, 2, &len);
            uint8_t sel = (uint8_t)which;
            char name[64];
            snprintf(name, sizeof name, "layer%d-%s", which, k ? "zero" : "nan");
            seed("dump", name, &sel, 1, b, len);
            free(b);
        }
        moe_layer_free(L);
    }
}

static void needle_hc_placement_seeds(void) {
    /* needle: q [4, 2, 8], k [16, 8], w [4, 2], with and without pos */
    enum { T = 4, S = 16, NH = 2, D = 8 };
    static double q[T * NH * D], k[S * D], w[T * NH];
    uint64_t s = 9;
    for (int i = 0; i < T * NH * D; i++) q[i] = fuzz_gauss(&s);
    for (int i = 0; i < S * D; i++) k[i] = fuzz_gauss(&s);
    for (int i = 0; i < T * NH; i++) w[i] = fabs(fuzz_gauss(&s));
    int64_t pos[T] = {60, 61, 62, 63};
    float qf[T * NH * D];
    for (int i = 0; i < T * NH * D; i++) qf[i] = (float)q[i];
    moe_st_entry e[4] = {
        {.name = "q", .dtype = MOE_DTYPE_F32, .ndim = 3, .shape = {T, NH, D}, .data = qf},
        {.name = "k", .dtype = MOE_DTYPE_F64, .ndim = 2, .shape = {S, D}, .data = k},
        {.name = "w", .dtype = MOE_DTYPE_F64, .ndim = 2, .shape = {T, NH}, .data = w},
        {.name = "pos", .dtype = MOE_DTYPE_I64, .ndim = 1, .shape = {T}, .data = pos},
    };
    size_t len;
    uint8_t sel = 3 | (3 << 4); /* ratio 4, top-k 4 */
    uint8_t *b = st_bytes(e, 4, &len);
    seed("needle", "pos", &sel, 1, b, len);
    free(b);
    b = st_bytes(e, 3, &len);
    seed("needle", "no-pos", &sel, 1, b, len);
    free(b);
    /* hc: streams [2, 4, 96] of the V4 fixture's shape, F32 and BF16 */
    enum { HT = 2, HN = 4, HH = 96 };
    static float st[HT * HN * HH];
    static uint16_t sb[HT * HN * HH];
    for (int i = 0; i < HT * HN * HH; i++) {
        st[i] = (float)fuzz_gauss(&s);
        sb[i] = (uint16_t)(bits(st[i]) >> 16);
    }
    moe_st_entry h = {.name = "streams", .dtype = MOE_DTYPE_F32, .ndim = 3, .shape = {HT, HN, HH}, .data = st};
    b = st_bytes(&h, 1, &len);
    seed("hc", "f32", NULL, 0, b, len);
    free(b);
    h.dtype = MOE_DTYPE_BF16;
    h.data = sb;
    b = st_bytes(&h, 1, &len);
    seed("hc", "bf16", NULL, 0, b, len);
    free(b);
    /* placement: 8 experts over 3 ranks, text and JSON */
    uint8_t en[2] = {7, 2};
    static const char text[] = "# expert rank\n0 0\n1 1\n2 2\n3 0\n4 1  # comment\n5 2\n6 0\n7 1\n";
    static const char json[] = "{\"expert_to_rank\": [0, 1, 2, 0, 1, 2, 0, 1]}";
    static const char arr[] = "[2, 2, 1, 1, 0, 0, 1, 2]";
    seed("placement", "text", en, 2, text, sizeof text - 1);
    seed("placement", "json-object", en, 2, json, sizeof json - 1);
    seed("placement", "json-array", en, 2, arr, sizeof arr - 1);
}

/* forward: the input and replay files of `forward`, from the V4 fixture's
 * transformers oracle (its input_ids and layer 3's index_topk, the picks
 * test-model replays) and its streams entering layer 1. */
static void forward_seeds(void) {
    moe_error err;
    moe_st_file *o = NULL;
    if (moe_st_open(MOE_TEST_DATA "/dsv4-tiny/oracle_fwd.safetensors", &o, &err) != MOE_OK) die("oracle_fwd", &err);
    const moe_st_tensor *ids = moe_st_find(o, "input_ids"), *top = moe_st_find(o, "layers.3.index_topk"),
                        *in1 = moe_st_find(o, "layers.1.in");
    if (!ids || !top || !in1 || ids->dtype != MOE_DTYPE_I64 || top->dtype != MOE_DTYPE_I32 || in1->dtype != MOE_DTYPE_F64)
        die("oracle_fwd: input_ids I64, layers.3.index_topk I32, layers.1.in F64 expected", NULL);
    const int64_t T = ids->shape[0];
    moe_st_entry e[2] = {
        {.name = "input_ids", .dtype = MOE_DTYPE_I64, .ndim = 1, .shape = {T}, .data = ids->data},
        {.name = "layers.3.index_topk", .dtype = MOE_DTYPE_I32, .ndim = 2, .shape = {T, top->shape[1]},
         .data = top->data},
    };
    size_t len;
    uint8_t *b = st_bytes(e, 2, &len);
    uint8_t sel = 4; /* first layer 0, replay, picks asked one row at a time */
    seed("forward", "oracle-replay", &sel, 1, b, len);
    sel = 4 | 7 << 3; /* in chunks of 8 rows */
    seed("forward", "oracle-replay-chunks", &sel, 1, b, len);
    free(b);
    /* the ids alone, as I32 */
    int32_t id32[64];
    for (int64_t i = 0; i < T && i < 64; i++) id32[i] = (int32_t)moe_load_i64(ids->data, ids->dtype, (size_t)i);
    moe_st_entry e32 = {.name = "input_ids", .dtype = MOE_DTYPE_I32, .ndim = 1, .shape = {T < 64 ? T : 64},
                        .data = id32};
    b = st_bytes(&e32, 1, &len);
    sel = 0;
    seed("forward", "ids-i32", &sel, 1, b, len);
    free(b);
    /* two tokens starting at layer 1 from their streams (F32) */
    enum { NT = 2, NS = NT * 4 * 96 };
    static float sf[NS];
    if (in1->shape[1] != 4 || in1->shape[2] != 96) die("oracle_fwd: layers.1.in is not [T, 4, 96]", NULL);
    for (int i = 0; i < NS; i++) sf[i] = (float)moe_load_f64(in1->data, in1->dtype, (size_t)i);
    moe_st_entry es[2] = {
        {.name = "input_ids", .dtype = MOE_DTYPE_I64, .ndim = 1, .shape = {NT}, .data = ids->data},
        {.name = "layers.1.in", .dtype = MOE_DTYPE_F32, .ndim = 3, .shape = {NT, 4, 96}, .data = sf},
    };
    b = st_bytes(es, 2, &len);
    sel = 1;
    seed("forward", "streams-layer1", &sel, 1, b, len);
    free(b);
    moe_st_close(o);
}

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: fuzz-seeds FUZZ_DIR (the repository's fuzz/)\n");
        return 2;
    }
    root = argv[1];
    snprintf(scratch, sizeof scratch, "/tmp/moe-fuzz-seeds-XXXXXX");
    if (!mkdtemp(scratch)) die("mkdtemp", NULL);
    checkpoint_seeds();
    dump_seeds();
    needle_hc_placement_seeds();
    forward_seeds();
    printf("scratch files in %s (remove at will)\n", scratch);
    return 0;
}
