/*
 * moeaudit bench --write-v4flash DIR: a synthetic checkpoint in the
 * DeepSeek-V4-Flash release layout at full V4-Flash shapes (hidden 4096, 64
 * heads x 512, q_lora 1024, o_groups 8 x o_lora 1024, index 64 x 128 top-512,
 * 256 routed MXFP4 experts of 2048 + one FP8 shared expert, mHC 4 x 24 mixes,
 * vocab 129280), one layer per entry of --ratios (default 0,4,128: one
 * sliding, one CSA and one HCA layer), for timing the whole-model forward end
 * to end (docs/performance.md). Not a test fixture: random weights, a few GiB.
 *
 * Tensor names, dtypes and shapes follow the release layout as
 * tests/oracle/v4layout.py lists it (no "model." prefix; FP8 E4M3 with E8M0
 * 128 x 128 tile scales on the attention linears, the indexer's wq_b and the
 * shared expert; packed E2M1 (I8) with E8M0 per-32 scales on the routed
 * experts; BF16 norms, compressors, weights_proj, gate, embed and head; F32
 * hc_*, ape, attn_sink, gate.bias; I64 tid2eid on hash layers, here layer 0).
 * Values: linears are random codes with one scale per tensor chosen so that a
 * unit-RMS input gives outputs of about unit RMS (E4M3 codes with exponent
 * field 1..8 and E8M0 2^(-3 - log2(sqrt(K))); E2M1 nibbles with E8M0
 * 2^-2 / sqrt(K); BF16 normals / sqrt(K)); norms 1 + 0.1 N(0,1); the rest
 * small normals. One shard per layer plus one for embed/head/norm, and
 * model.safetensors.index.json; each shard is written atomically.
 */
#include "bench.h"
#include "core/core.h"
#include "moe_formats.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

enum { SV_H = 4096, SV_NH = 64, SV_HD = 512, SV_QL = 1024, SV_OG = 8, SV_OL = 1024, SV_IH = 64, SV_ID = 128,
       SV_I = 2048, SV_K = 6, SV_HC = 4 };

typedef struct sv_buf {
    moe_st_entry *e;
    void **data;
    size_t n, cap;
} sv_buf;

static void *sv_add(sv_buf *b, const char *name, moe_dtype dt, int64_t d0, int64_t d1, size_t bytes) {
    if (b->n == b->cap) {
        size_t nc = b->cap ? 2 * b->cap : 64;
        moe_st_entry *ne = realloc(b->e, nc * sizeof *ne);
        if (ne) b->e = ne;
        void **nd = realloc(b->data, nc * sizeof *nd);
        if (nd) b->data = nd;
        if (!ne || !nd) return NULL;
        b->cap = nc;
    }
    void *p = malloc(bytes ? bytes : 1);
    char *nm = malloc(strlen(name) + 1);
    if (!p || !nm) {
        free(p);
        free(nm);
        return NULL;
    }
    strcpy(nm, name);
    moe_st_entry *e = &b->e[b->n];
    memset(e, 0, sizeof *e);
    e->name = nm;
    e->dtype = dt;
    e->ndim = d1 > 0 ? 2 : 1;
    e->shape[0] = d0;
    e->shape[1] = d1 > 0 ? d1 : 0;
    e->data = p;
    b->data[b->n++] = p;
    return p;
}

static void sv_free(sv_buf *b) {
    for (size_t i = 0; i < b->n; i++) {
        free(b->data[i]);
        free((void *)b->e[i].name);
    }
    free(b->e);
    free(b->data);
    memset(b, 0, sizeof *b);
}

static uint64_t sv_mix(uint64_t x) { return moe_splitmix64(&x); }

/* E8M0 code of 2^round(log2(s)) */
static uint8_t e8m0_of(double s) { return (uint8_t)(127 + (int)lround(log2(s))); }

/* An FP8 [rows, cols] weight and its E8M0 tile scales. */
static int sv_fp8(sv_buf *b, const char *base, int64_t rows, int64_t cols, uint64_t seed) {
    char n[320]; /* base (< 256) + a suffix */
    snprintf(n, sizeof n, "%s.weight", base);
    uint8_t *q = sv_add(b, n, MOE_DTYPE_F8_E4M3, rows, cols, (size_t)(rows * cols));
    snprintf(n, sizeof n, "%s.scale", base);
    int64_t gr = (rows + 127) / 128, gc = (cols + 127) / 128;
    uint8_t *s = sv_add(b, n, MOE_DTYPE_F8_E8M0, gr, gc, (size_t)(gr * gc));
    if (!q || !s) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < rows * cols; i++) {
        uint64_t r = sv_mix(seed + (uint64_t)i);
        /* sign, exponent field 1..8 (2^-6 .. 2^1), any mantissa: |v| in [2^-6, 3.75], rms ~1.4 */
        q[i] = (uint8_t)((r & 0x80) | ((1 + (r >> 8) % 8) << 3) | ((r >> 16) & 7));
    }
    memset(s, e8m0_of(1.0 / 1.4 / sqrt((double)cols)), (size_t)(gr * gc));
    return 0;
}

/* An MXFP4 [rows, cols] weight (I8 packed E2M1) and its E8M0 block scales. */
static int sv_mxfp4(sv_buf *b, const char *base, int64_t rows, int64_t cols, uint64_t seed) {
    char n[320]; /* base (< 256) + a suffix */
    snprintf(n, sizeof n, "%s.weight", base);
    uint8_t *q = sv_add(b, n, MOE_DTYPE_I8, rows, cols / 2, (size_t)(rows * cols / 2));
    snprintf(n, sizeof n, "%s.scale", base);
    uint8_t *s = sv_add(b, n, MOE_DTYPE_F8_E8M0, rows, cols / 32, (size_t)(rows * cols / 32));
    if (!q || !s) return -1;
    size_t nb = (size_t)(rows * cols / 2);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < nb / 8; i++) {
        uint64_t v = sv_mix(seed + i);
        memcpy(q + 8 * i, &v, 8);
    }
    /* random E2M1 codes have rms ~2.9 */
    memset(s, e8m0_of(1.0 / 2.9 / sqrt((double)cols)), (size_t)(rows * cols / 32));
    return 0;
}

/* A float tensor: BF16 or F32, values mean + sd * N(0, 1) (sd: the standard
 * deviation; linears pass 1 / sqrt(cols)). */
static int sv_float(sv_buf *b, const char *name, moe_dtype dt, int64_t d0, int64_t d1, double mean, double sd,
                    uint64_t seed) {
    int64_t n = d0 * (d1 > 0 ? d1 : 1);
    void *p = sv_add(b, name, dt, d0, d1, (size_t)n * (dt == MOE_DTYPE_BF16 ? 2 : 4));
    if (!p) return -1;
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; i++) {
        uint64_t st = seed * 0x9E3779B97F4A7C15ull + (uint64_t)i;
        float v = (float)(mean + sd * moe_splitmix64_gauss4(&st));
        if (dt == MOE_DTYPE_BF16) ((uint16_t *)p)[i] = moe_bf16_from_f32(v);
        else ((float *)p)[i] = v;
    }
    return 0;
}

/* One transformer block's tensors under prefix p ("layers.N."). */
static int sv_block(sv_buf *b, const char *p, int ratio, bool hashed, int E, int vocab, uint64_t seed) {
    char n[256];
    int rc = 0;
#define NAME(...) (snprintf(n, sizeof n, __VA_ARGS__), n)
    rc |= sv_float(b, NAME("%sattn_norm.weight", p), MOE_DTYPE_BF16, SV_H, 0, 1.0, 0.1, seed + 1);
    rc |= sv_float(b, NAME("%sffn_norm.weight", p), MOE_DTYPE_BF16, SV_H, 0, 1.0, 0.1, seed + 2);
    const int mix = (2 + SV_HC) * SV_HC;
    static const char *const site[2] = {"attn", "ffn"};
    for (int s = 0; s < 2; s++) {
        rc |= sv_float(b, NAME("%shc_%s_fn", p, site[s]), MOE_DTYPE_F32, mix, SV_HC * SV_H, 0.0,
                       1.0 / sqrt((double)(SV_HC * SV_H)), seed + 3 + (uint64_t)s);
        rc |= sv_float(b, NAME("%shc_%s_base", p, site[s]), MOE_DTYPE_F32, mix, 0, 0.0, 0.5, seed + 5 + (uint64_t)s);
        rc |= sv_float(b, NAME("%shc_%s_scale", p, site[s]), MOE_DTYPE_F32, 3, 0, 1.0, 0.2, seed + 7 + (uint64_t)s);
    }
    rc |= sv_fp8(b, NAME("%sattn.wq_a", p), SV_QL, SV_H, seed + 10);
    rc |= sv_float(b, NAME("%sattn.q_norm.weight", p), MOE_DTYPE_BF16, SV_QL, 0, 1.0, 0.1, seed + 11);
    rc |= sv_fp8(b, NAME("%sattn.wq_b", p), SV_NH * SV_HD, SV_QL, seed + 12);
    rc |= sv_fp8(b, NAME("%sattn.wkv", p), SV_HD, SV_H, seed + 13);
    rc |= sv_float(b, NAME("%sattn.kv_norm.weight", p), MOE_DTYPE_BF16, SV_HD, 0, 1.0, 0.1, seed + 14);
    rc |= sv_fp8(b, NAME("%sattn.wo_a", p), SV_OG * SV_OL, SV_NH * SV_HD / SV_OG, seed + 15);
    rc |= sv_fp8(b, NAME("%sattn.wo_b", p), SV_H, SV_OG * SV_OL, seed + 16);
    rc |= sv_float(b, NAME("%sattn.attn_sink", p), MOE_DTYPE_F32, SV_NH, 0, 0.0, 1.0, seed + 17);
    if (ratio) {
        int coff = ratio == 4 ? 2 : 1;
        rc |= sv_float(b, NAME("%sattn.compressor.ape", p), MOE_DTYPE_F32, ratio, coff * SV_HD, 0.0, 1.0, seed + 20);
        rc |= sv_float(b, NAME("%sattn.compressor.norm.weight", p), MOE_DTYPE_BF16, SV_HD, 0, 1.0, 0.1, seed + 21);
        rc |= sv_float(b, NAME("%sattn.compressor.wkv.weight", p), MOE_DTYPE_BF16, coff * SV_HD, SV_H, 0.0,
                       1.0 / sqrt((double)SV_H), seed + 22);
        rc |= sv_float(b, NAME("%sattn.compressor.wgate.weight", p), MOE_DTYPE_BF16, coff * SV_HD, SV_H, 0.0,
                       1.0 / sqrt((double)SV_H), seed + 23);
    }
    if (ratio == 4) {
        rc |= sv_fp8(b, NAME("%sattn.indexer.wq_b", p), SV_IH * SV_ID, SV_QL, seed + 30);
        rc |= sv_float(b, NAME("%sattn.indexer.weights_proj.weight", p), MOE_DTYPE_BF16, SV_IH, SV_H, 0.0,
                       1.0 / sqrt((double)SV_H), seed + 31);
        rc |= sv_float(b, NAME("%sattn.indexer.compressor.ape", p), MOE_DTYPE_F32, 4, 2 * SV_ID, 0.0, 1.0, seed + 32);
        rc |= sv_float(b, NAME("%sattn.indexer.compressor.norm.weight", p), MOE_DTYPE_BF16, SV_ID, 0, 1.0, 0.1,
                       seed + 33);
        rc |= sv_float(b, NAME("%sattn.indexer.compressor.wkv.weight", p), MOE_DTYPE_BF16, 2 * SV_ID, SV_H, 0.0,
                       1.0 / sqrt((double)SV_H), seed + 34);
        rc |= sv_float(b, NAME("%sattn.indexer.compressor.wgate.weight", p), MOE_DTYPE_BF16, 2 * SV_ID, SV_H, 0.0,
                       1.0 / sqrt((double)SV_H), seed + 35);
    }
    rc |= sv_float(b, NAME("%sffn.gate.weight", p), MOE_DTYPE_BF16, E, SV_H, 0.0, 1.0 / sqrt((double)SV_H), seed + 40);
    if (hashed) {
        int64_t *t = sv_add(b, NAME("%sffn.gate.tid2eid", p), MOE_DTYPE_I64, vocab, SV_K, (size_t)vocab * SV_K * 8);
        if (!t) return -1;
        for (int64_t v = 0; v < vocab; v++) /* SV_K distinct experts per token id (E >= SV_K) */
            for (int j = 0; j < SV_K; j++) t[v * SV_K + j] = (int64_t)((sv_mix(seed + (uint64_t)v) + (uint64_t)j) % (uint64_t)E);
    } else {
        rc |= sv_float(b, NAME("%sffn.gate.bias", p), MOE_DTYPE_F32, E, 0, 0.0, 0.3, seed + 41);
    }
    for (int e = 0; e < E && rc == 0; e++) {
        rc |= sv_mxfp4(b, NAME("%sffn.experts.%d.w1", p, e), SV_I, SV_H, seed + 1000 + 3 * (uint64_t)e);
        rc |= sv_mxfp4(b, NAME("%sffn.experts.%d.w2", p, e), SV_H, SV_I, seed + 1001 + 3 * (uint64_t)e);
        rc |= sv_mxfp4(b, NAME("%sffn.experts.%d.w3", p, e), SV_I, SV_H, seed + 1002 + 3 * (uint64_t)e);
    }
    rc |= sv_fp8(b, NAME("%sffn.shared_experts.w1", p), SV_I, SV_H, seed + 50);
    rc |= sv_fp8(b, NAME("%sffn.shared_experts.w2", p), SV_H, SV_I, seed + 51);
    rc |= sv_fp8(b, NAME("%sffn.shared_experts.w3", p), SV_I, SV_H, seed + 52);
#undef NAME
    return rc ? -1 : 0;
}

/* Write shard `file` of dir from b and add its names to the index text. */
static int sv_flush(const char *dir, const char *file, sv_buf *b, FILE *index, bool *first) {
    char path[1024];
    snprintf(path, sizeof path, "%s/%s", dir, file);
    moe_error err;
    if (moe_st_write(path, b->e, b->n, NULL, &err) != MOE_OK) {
        fprintf(stderr, "bench --write-v4flash: %s\n", err.msg);
        return -1;
    }
    for (size_t i = 0; i < b->n; i++) {
        fprintf(index, "%s\n    \"%s\": \"%s\"", *first ? "" : ",", b->e[i].name, file);
        *first = false;
    }
    sv_free(b);
    return 0;
}

/* bench.h: the options come from the CLI (tools/cmd_bench.c); the ratio list
 * and the sizes are checked here. */
int moe_bench_write_v4flash(const moe_bench_synth_opts *o) {
    const char *dir = o->dir, *ratios_s = o->ratios ? o->ratios : "0,4,128";
    int E = o->experts, vocab = o->vocab;
    uint64_t seed = o->seed;
    int ratios[64], L = 0;
    for (const char *s = ratios_s; *s && L < 64;) {
        char *end;
        long r = strtol(s, &end, 10);
        if (end == s || (r != 0 && r != 4 && r != 128)) {
            fprintf(stderr, "bench --write-v4flash: --ratios takes 0, 4 or 128 per layer, not \"%s\"\n", ratios_s);
            return 2;
        }
        ratios[L++] = (int)r;
        s = *end == ',' ? end + 1 : end;
    }
    if (!dir || L == 0 || E < SV_K || vocab < 1) {
        fprintf(stderr, "bench --write-v4flash: needs DIR, at least one layer, --experts >= %d, --vocab >= 1\n", SV_K);
        return 2;
    }
    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        fprintf(stderr, "bench --write-v4flash: cannot create %s: %s\n", dir, strerror(errno));
        return 1;
    }
    char path[1024];
    snprintf(path, sizeof path, "%s/config.json", dir);
    /* config.json and the index go through the atomic writer and are
     * committed last, after every shard: a failed run leaves no config.json
     * that would make the directory look like a whole checkpoint */
    moe_error werr;
    moe_out_file *cf = NULL, *xf = NULL;
    if (moe_out_open(path, &cf, &werr) != MOE_OK) {
        fprintf(stderr, "bench --write-v4flash: %s\n", werr.msg);
        return 1;
    }
    FILE *c = moe_out_stream(cf);
    if (!c) {
        moe_out_abort(cf);
        fprintf(stderr, "bench --write-v4flash: out of memory\n");
        return 1;
    }
    fprintf(c,
            "{\n  \"architectures\": [\"DeepseekV4ForCausalLM\"],\n  \"model_type\": \"deepseek_v4\",\n"
            "  \"expert_dtype\": \"fp4\", \"hc_eps\": 1e-06, \"hc_mult\": %d, \"hc_sinkhorn_iters\": 20,\n"
            "  \"head_dim\": %d, \"hidden_act\": \"silu\", \"hidden_size\": %d,\n"
            "  \"index_head_dim\": %d, \"index_n_heads\": %d, \"index_topk\": 512,\n"
            "  \"max_position_embeddings\": 1048576, \"moe_intermediate_size\": %d,\n"
            "  \"n_routed_experts\": %d, \"n_shared_experts\": 1, \"norm_topk_prob\": true,\n"
            "  \"num_attention_heads\": %d, \"num_experts_per_tok\": %d, \"num_hidden_layers\": %d,\n"
            "  \"num_hash_layers\": 1, \"num_key_value_heads\": 1, \"num_nextn_predict_layers\": 0,\n"
            "  \"o_groups\": %d, \"o_lora_rank\": %d, \"q_lora_rank\": %d, \"qk_rope_head_dim\": 64,\n"
            "  \"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\", \"quant_method\": "
            "\"fp8\", \"scale_fmt\": \"ue8m0\", \"weight_block_size\": [128, 128]},\n"
            "  \"rms_norm_eps\": 1e-06,\n"
            "  \"rope_scaling\": {\"beta_fast\": 32, \"beta_slow\": 1, \"factor\": 16, "
            "\"original_max_position_embeddings\": 65536, \"type\": \"yarn\"},\n"
            "  \"rope_theta\": 10000, \"routed_scaling_factor\": 1.5, \"scoring_func\": \"sqrtsoftplus\",\n"
            "  \"sliding_window\": 128, \"swiglu_limit\": 10.0, \"tie_word_embeddings\": false,\n"
            "  \"topk_method\": \"noaux_tc\", \"torch_dtype\": \"bfloat16\", \"vocab_size\": %d,\n"
            "  \"compress_rope_theta\": 160000,\n  \"compress_ratios\": [",
            SV_HC, SV_HD, SV_H, SV_ID, SV_IH, SV_I, E, SV_NH, SV_K, L, SV_OG, SV_OL, SV_QL, vocab);
    for (int i = 0; i < L; i++) fprintf(c, "%s%d", i ? ", " : "", ratios[i]);
    fprintf(c, "]\n}\n");

    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    FILE *idx = NULL;
    if (moe_out_open(path, &xf, &werr) != MOE_OK || !(idx = moe_out_stream(xf))) {
        fprintf(stderr, "bench --write-v4flash: %s\n", xf ? "out of memory" : werr.msg);
        moe_out_abort(xf);
        moe_out_abort(cf);
        return 1;
    }
    fprintf(idx, "{\n  \"metadata\": {},\n  \"weight_map\": {");
    bool first = true;
    sv_buf b = {0};
    int rc = 0;
    char file[128];
    /* shard 0: embed, head, final norm, hc_head */
    rc |= sv_float(&b, "embed.weight", MOE_DTYPE_BF16, vocab, SV_H, 0.0, 1.0, seed + 90);
    rc |= sv_float(&b, "head.weight", MOE_DTYPE_BF16, vocab, SV_H, 0.0, 1.0 / sqrt((double)SV_H), seed + 91);
    rc |= sv_float(&b, "norm.weight", MOE_DTYPE_BF16, SV_H, 0, 1.0, 0.1, seed + 92);
    rc |= sv_float(&b, "hc_head_fn", MOE_DTYPE_F32, SV_HC, SV_HC * SV_H, 0.0, 1.0 / sqrt((double)(SV_HC * SV_H)), seed + 93);
    rc |= sv_float(&b, "hc_head_base", MOE_DTYPE_F32, SV_HC, 0, 0.0, 0.5, seed + 94);
    rc |= sv_float(&b, "hc_head_scale", MOE_DTYPE_F32, 1, 0, 1.0, 0.2, seed + 95);
    snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", 1, L + 1);
    if (rc == 0) rc = sv_flush(dir, file, &b, idx, &first);
    for (int l = 0; l < L && rc == 0; l++) {
        char p[32];
        snprintf(p, sizeof p, "layers.%d.", l);
        printf("layer %d (compress ratio %d): generating\n", l, ratios[l]);
        fflush(stdout);
        rc = sv_block(&b, p, ratios[l], l == 0, E, vocab, seed + 10000 * (uint64_t)(l + 1));
        snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", l + 2, L + 1);
        if (rc == 0) rc = sv_flush(dir, file, &b, idx, &first);
    }
    sv_free(&b);
    fprintf(idx, "\n  }\n}\n");
    if (rc != 0) {
        moe_out_abort(xf);
        moe_out_abort(cf);
        fprintf(stderr, "bench --write-v4flash: out of memory or write failure under %s\n", dir);
        return 1;
    }
    if (moe_out_commit(xf, &werr) != MOE_OK) {
        moe_out_abort(cf);
        fprintf(stderr, "bench --write-v4flash: %s\n", werr.msg);
        return 1;
    }
    if (moe_out_commit(cf, &werr) != MOE_OK) {
        fprintf(stderr, "bench --write-v4flash: %s\n", werr.msg);
        return 1;
    }
    printf("wrote %s: %d layers (ratios %s), %d experts, vocab %d\n", dir, L, ratios_s, E, vocab);
    return 0;
}
