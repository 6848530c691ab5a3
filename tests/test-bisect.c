/*
 * moeaudit bisect (src/bisect/bisect.c, src/patch, the forward's patches):
 *  - the patch table and its grammar (names, closest names, values, layer
 *    ranges, phases, conflicts, patches that change nothing);
 *  - the stages' roundings against their definitions (the FP8 KV cache);
 *  - a constructed model whose lightning indexer keeps a needle in float64
 *    and loses it under FP4 keys without the Hadamard rotation (an outlier
 *    channel sets each block's scale), so the bisect must name that patch;
 *    with the rotation the FP4 keys keep it, and without rounding the lack
 *    of rotation is exact: two harmless patches that lose it together;
 *  - a contract fault (routed scale applied twice) found through the output
 *    metrics, cross-checked by running the same fault through the forward's
 *    replaceable MoE block;
 *  - shared starts (reference streams, reference prefix caches) give the
 *    bits of full runs; phases; the whole report byte-identical across runs,
 *    thread counts and (under MPI) processes; bad input.
 */
#include "harness.h"
#include "attn/attn.h"
#include "moe_formats.h"
#include "moeaudit_bisect.h"
#include "moeaudit_patch.h"
#include "moeaudit_variant.h"

#include <sys/stat.h>

/* ------------------------------------------------------------ the table */

static void test_patch_table(void) {
    int n = moe_patch_table_size();
    CHECK(n >= 40, "%d patches", n);
    for (int i = 0; i < n; i++) {
        const moe_patch_info *p = moe_patch_table_at(i);
        CHECK(moe_patch_find(p->name) == p, "%s found by name", p->name);
        for (int k = i + 1; k < n; k++) CHECK(strcmp(p->name, moe_patch_table_at(k)->name), "duplicate %s", p->name);
        CHECK(p->n_set >= 1 && p->n_set <= 3 && p->what && strlen(p->what) > 10, "%s described", p->name);
    }
    /* the issue's names */
    const char *issue[] = {"mhc-bf16", "index-keys-fp8", "index-keys-fp4", "kv-fp8", "attn-bf16", "experts-mxfp4",
                           "scale-double", "index-topk", "mhc-tf32", "mhc-bf16-split", "mhc-fp32", "index-acc-bf16",
                           "compress-state-bf16", "router-bf16", "experts-nvfp4", "experts-fp8", "act-fp8"};
    for (size_t i = 0; i < sizeof issue / sizeof issue[0]; i++) CHECK(moe_patch_find(issue[i]), "%s", issue[i]);
    CHECK(moe_patch_find("attn-bf16")->phase == MOE_PHASE_DECODE, "attn-bf16 models a decode kernel");
}

static void test_patch_parse(void) {
    moe_error err;
    moe_fwd *f = NULL;
    CHECK_OK(moe_fwd_open(moe_t_data("dsv4-tiny"), &f, &err), err);
    if (!f) return;
    const moe_fwd_config *c = moe_fwd_get_config(f); /* hca hca hca csa */
    moe_patch_set *s = NULL;
    CHECK_OK(moe_patch_set_parse("mhc-bf16,index-keys-fp8@3,kv-fp8@1..2:prefill,index-topk=16,attn-bf16", c, &s, &err), err);
    if (s) {
        CHECK(moe_patch_set_count(s) == 5, "%d", moe_patch_set_count(s));
        CHECK(!strcmp(moe_patch_set_at(s, 1)->text, "index-keys-fp8@3"), "%s", moe_patch_set_at(s, 1)->text);
        CHECK(!strcmp(moe_patch_set_at(s, 2)->text, "kv-fp8@1..2:prefill"), "%s", moe_patch_set_at(s, 2)->text);
        CHECK(moe_patch_set_at(s, 3)->value == 16, "topk value");
        CHECK(moe_patch_set_at(s, 1)->first_changed == 3 && moe_patch_set_at(s, 0)->first_changed == 0, "first changed");
        /* resolution per layer and phase */
        moe_layer_patch lp;
        moe_patch_layer(s, MOE_PATCH_ALL, 3, MOE_PHASE_DECODE, &lp);
        CHECK(lp.hc_set && lp.hc == MOE_HC_BF16, "mhc on every layer");
        CHECK(lp.attn.index_engine && lp.attn.idx.k_quant == MOE_IDX_Q_FP8 && lp.attn.idx.q_quant == MOE_IDX_Q_F32 &&
                  lp.attn.idx.hadamard, "index keys fp8 with the rotation");
        CHECK(lp.attn.index_topk == 16 && lp.attn.arith == MOE_ATTN_ARITH_BF16 && lp.attn.kv == MOE_KV_EXACT, "layer 3 decode");
        moe_patch_layer(s, MOE_PATCH_ALL, 1, MOE_PHASE_PREFILL, &lp);
        CHECK(lp.attn.kv == MOE_KV_FP8 && lp.attn.arith == MOE_ATTN_ARITH_PATH && !lp.attn.index_engine, "layer 1 prefill");
        moe_patch_layer(s, MOE_PATCH_ALL, 1, MOE_PHASE_DECODE, &lp);
        CHECK(lp.attn.kv == MOE_KV_EXACT, "kv-fp8:prefill is off in decode");
        moe_patch_layer(s, (uint64_t)1 << 1, 3, MOE_PHASE_DECODE, &lp);
        CHECK(!lp.hc_set && lp.attn.index_engine && lp.attn.arith == MOE_ATTN_ARITH_PATH, "masks enable patches");
        CHECK(moe_patch_first_changed(s, (uint64_t)1 << 1, MOE_PHASE_ALL) == 3, "first changed by mask");
        CHECK(!moe_patch_any_in(s, (uint64_t)1 << 4, MOE_PHASE_PREFILL) && moe_patch_any_in(s, (uint64_t)1 << 4, MOE_PHASE_DECODE),
              "phases");
        char buf[256];
        CHECK(!strcmp(moe_patch_set_text(s, 3, buf, sizeof buf), "mhc-bf16,index-keys-fp8@3"), "%s", buf);
        moe_patch_set_free(s);
    }
    struct { const char *list, *needle; } bad[] = {
        {"mhc-bf61", "closest: mhc-bf16"},
        {"index-keys-fp8,index-keys-fp4", "both set the index-keys component"},
        {"index-keys-fp8@0..2", "changes nothing"},
        {"kv-fp8@4", "not in 0..3"},
        {"kv-fp8@2..1", "range end"},
        {"kv-fp8:later", "phase"},
        {"index-topk", "takes a positive count"},
        {"index-topk=0", "takes a positive count"},
        {"mhc-bf16=3", "takes no value"},
        {"mhc-bf16,,kv-fp8", "empty patch"},
        {"mhc-bf16,", "empty patch"},
        {"mhc-bf16,mhc-bf16", "listed twice"},
        {"mhc-bf16,mhc-tf32@2", "both set the hc component"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        s = NULL;
        moe_status st = moe_patch_set_parse(bad[i].list, c, &s, &err);
        CHECK(st == MOE_ERR_ARG && !s && strstr(err.msg, bad[i].needle), "%s: %s", bad[i].list, err.msg);
    }
    /* disjoint ranges and phases do not conflict */
    CHECK_OK(moe_patch_set_parse("mhc-bf16@0..1,mhc-tf32@2..,kv-fp8:prefill,kv-bf16:decode", c, &s, &err), err);
    moe_patch_set_free(s);
    /* without a model: MoE-only lists (the audit), no ranges */
    CHECK_OK(moe_patch_set_parse("experts-mxfp4,act-fp8,shared-fp8", NULL, &s, &err), err);
    if (s) {
        moe_layer_patch lp;
        moe_patch_layer(s, MOE_PATCH_ALL, 0, MOE_PHASE_PREFILL, &lp);
        CHECK(lp.moe_set && lp.moe.experts == MOE_Q_MXFP4 && lp.moe.act == MOE_ACT_FP8 && lp.moe.shared == MOE_Q_FP8, "moe");
        moe_patch_set_free(s);
    }
    CHECK(moe_patch_set_parse("kv-fp8@1", NULL, &s, &err) == MOE_ERR_ARG, "range without a model");
    /* more than MOE_PATCH_MAX */
    char big[8192] = "";
    for (int i = 0; i <= MOE_PATCH_MAX; i++) {
        char one[32];
        snprintf(one, sizeof one, "%smhc-bf16@%d", i ? "," : "", i % 4);
        strcat(big, one);
    }
    CHECK(moe_patch_set_parse(big, c, &s, &err) == MOE_ERR_ARG, "too many: %s", err.msg);
    moe_fwd_free(f);
}

/* ------------------------------------------------------------ the FP8 KV cache */

static void test_kv_round(void) {
    uint64_t rng = 11;
    const int d = 512, rd = 64; /* V4: 448 NoPE + 64 RoPE */
    double x[512], y[512];
    int bad = 0, bad_rope = 0, bad_scale = 0;
    for (int trial = 0; trial < 50; trial++) {
        for (int i = 0; i < d; i++) x[i] = moe_t_rng_normal(&rng) * (i % 97 == 3 ? 40.0 : 1.0) * (trial == 7 ? 1e-9 : 1.0);
        memcpy(y, x, sizeof x);
        moe_attn_kv_round(y, d, rd, MOE_KV_FP8);
        for (int t0 = 0; t0 < d - rd; t0 += 64) {
            /* the tile's scale: 2^ceil(log2(max(amax, 1e-4) / 448)) of the bf16 values */
            double amax = 1e-4;
            for (int i = t0; i < t0 + 64; i++) amax = fmax(amax, fabs((double)moe_bf16_round((float)x[i])));
            double s = ldexp(1.0, (int)ceil(log2(amax / 448.0)));
            if (s * 448 < amax || s * 224 >= amax) bad_scale++;
            for (int i = t0; i < t0 + 64; i++) {
                double b = moe_bf16_round((float)x[i]), q = y[i] / s;
                /* q must be an E4M3 value, the nearest to b / s */
                uint8_t code = moe_fp8_e4m3_from_f32((float)(b / s), MOE_FP8_SATURATE);
                float back;
                moe_fp8_block_dequant_row(&code, &(float){1.0f}, 1, &back);
                if (q != (double)back) bad++;
            }
        }
        for (int i = d - rd; i < d; i++) bad_rope += y[i] != (double)moe_bf16_round((float)x[i]);
    }
    CHECK(bad == 0 && bad_scale == 0, "%d values, %d scales off the E4M3 / ue8m0 definition", bad, bad_scale);
    CHECK(bad_rope == 0, "%d RoPE dims not bf16", bad_rope);
    /* a partial last tile (head_dim - rope_dim not a multiple of 64) and bf16 mode */
    double z[40];
    for (int i = 0; i < 40; i++) z[i] = 0.1 * i - 1.7;
    double zz[40];
    memcpy(zz, z, sizeof z);
    moe_attn_kv_round(zz, 40, 8, MOE_KV_BF16);
    int nb = 0;
    for (int i = 0; i < 40; i++) nb += zz[i] != (double)moe_bf16_round((float)z[i]);
    CHECK(nb == 0, "bf16 mode");
    memcpy(zz, z, sizeof z);
    moe_attn_kv_round(zz, 40, 8, MOE_KV_EXACT);
    CHECK(!memcmp(zz, z, sizeof z), "exact mode is the identity");
}

/* ------------------------------------------------- the constructed needle model */

/*
 * Two layers (CSA ratio 4, HCA ratio 8), H 64, 64 tokens. Everything is
 * random except what decides layer 0's indexer picks at the query:
 *  - layer 0's input is the normed embedding (identical streams; attn_norm
 *    1), so its channels are the token's embedding up to one factor;
 *  - the indexer compressor copies channels 1..28 into its 32-channel keys
 *    (both CSA halves, gates and ape zero: each entry is the mean of its 8
 *    slots' keys, then RMS-normed; the 4 RoPE channels stay zero);
 *  - the query token's indexer q copies channels 2..15 (the "pattern");
 *    weights_proj reads channel 0, constant 1: one head, weight > 0.
 * Tokens: NEEDLE (id 1) has an outlier 5.56 on channel 1 and the pattern at
 * +-0.2 on channels 2..15 (so its entry's normed key is [5.61, +-0.2 x 14, 0
 * ...]); QUERY (id 2) the pattern at +-1; fillers pattern components of the
 * opposite signs (|0.3 N(0,1)|) and N(0,1) on channels 16..28. So in float64
 * the needle's entries score > 0 and every filler's ReLU gives 0: the needle
 * ranks first. FP4 E2M1 keys without the rotation take their block scale
 * from the outlier (2^ceil(log2(5.61/6)) = 1), which rounds every |x| <
 * 0.25 to 0: the needle's entries score 0 too, tie with the fillers and lose
 * the tie to the lower entries (index order): out of the top 4. With the
 * rotation the outlier is spread over the 32 channels and FP4's error (~0.5
 * of the needle's ~2.8 score units) keeps it first; without rounding the
 * rotation changes nothing but fp32 roundoff.
 */
enum { NM_H = 64, NM_V = 64, NM_HEADS = 2, NM_HD = 16, NM_ROPE = 4, NM_QL = 16, NM_G = 2, NM_OL = 8, NM_WIN = 8,
       NM_ID = 32, NM_TOPK = 4, NM_HC = 4, NM_E = 4, NM_K = 2, NM_I = 32 };
enum { TOK_NEEDLE = 1, TOK_QUERY = 2 };

typedef struct tl {
    moe_st_entry e[256];
    char names[256][96];
    void *bufs[256];
    int n;
} tl;

/* A float tensor [d0(, d1)]: values v (owned by the list). */
static void put(tl *l, const char *name, int ndim, int64_t d0, int64_t d1, float *v) {
    MOE_ASSERT(l->n < 256);
    moe_st_entry *e = &l->e[l->n];
    snprintf(l->names[l->n], sizeof l->names[0], "%s", name);
    e->name = l->names[l->n];
    e->dtype = MOE_DTYPE_F32;
    e->ndim = ndim;
    e->shape[0] = d0;
    e->shape[1] = d1;
    e->data = v;
    l->bufs[l->n++] = v;
}

static float *rnd(int64_t n, double scale, double offset, uint64_t *rng) {
    float *v = malloc((size_t)n * sizeof *v + 4);
    for (int64_t i = 0; i < n; i++) v[i] = (float)(offset + scale * moe_t_rng_normal(rng));
    return v;
}

static float *zeros(int64_t n) { return calloc((size_t)n + 1, sizeof(float)); }

static void put_rnd(tl *l, const char *name, int ndim, int64_t d0, int64_t d1, double scale, double offset, uint64_t *rng) {
    put(l, name, ndim, d0, d1, rnd(ndim == 1 ? d0 : d0 * d1, scale, offset, rng));
}

static const int pattern_sign[14] = {1, -1, 1, 1, -1, 1, -1, -1, 1, -1, 1, 1, -1, 1};

static void write_needle_model(const char *dir) {
    mkdir(dir, 0755);
    tl *l = calloc(1, sizeof *l);
    uint64_t rng = 2026;
    const double sH = 1.0 / sqrt((double)NM_H);
    /* embedding */
    float *emb = zeros((int64_t)NM_V * NM_H);
    for (int v = 0; v < NM_V; v++) {
        float *e = emb + (size_t)v * NM_H;
        e[0] = 1.0f;
        for (int c = 29; c < NM_H; c++) e[c] = (float)moe_t_rng_normal(&rng);
        if (v == TOK_NEEDLE) {
            e[1] = 5.56f;
            for (int i = 0; i < 14; i++) e[2 + i] = 0.2f * (float)pattern_sign[i];
        } else if (v == TOK_QUERY) {
            for (int i = 0; i < 14; i++) e[2 + i] = (float)pattern_sign[i];
        } else {
            for (int i = 0; i < 14; i++) e[2 + i] = -(float)pattern_sign[i] * (float)fabs(0.3 * moe_t_rng_normal(&rng));
            for (int c = 16; c <= 28; c++) e[c] = (float)moe_t_rng_normal(&rng);
        }
    }
    put(l, "embed.weight", 2, NM_V, NM_H, emb);
    put_rnd(l, "head.weight", 2, NM_V, NM_H, sH, 0, &rng);
    put_rnd(l, "norm.weight", 1, NM_H, 0, 0.1, 1.0, &rng);
    put_rnd(l, "hc_head_fn", 2, NM_HC, NM_HC * NM_H, 0.05, 0, &rng);
    put_rnd(l, "hc_head_base", 1, NM_HC, 0, 0.5, 0, &rng);
    put_rnd(l, "hc_head_scale", 1, 1, 0, 0.2, 1.0, &rng);
    const int ratio[2] = {4, 8};
    char nm[96];
    for (int li = 0; li < 2; li++) {
#define P(s) (snprintf(nm, sizeof nm, "layers.%d.%s", li, s), nm)
        const int r = ratio[li];
        if (li == 0) {
            float *one = zeros(NM_H);
            for (int c = 0; c < NM_H; c++) one[c] = 1.0f;
            put(l, P("attn_norm.weight"), 1, NM_H, 0, one);
        } else {
            put_rnd(l, P("attn_norm.weight"), 1, NM_H, 0, 0.1, 1.0, &rng);
        }
        put_rnd(l, P("ffn_norm.weight"), 1, NM_H, 0, 0.1, 1.0, &rng);
        if (li == 0) { /* wq_a reads the pattern channels 2..15 */
            float *w = zeros((int64_t)NM_QL * NM_H);
            for (int i = 0; i < 14; i++) w[(size_t)i * NM_H + 2 + i] = 1.0f;
            put(l, P("attn.wq_a.weight"), 2, NM_QL, NM_H, w);
            float *one = zeros(NM_QL);
            for (int c = 0; c < NM_QL; c++) one[c] = 1.0f;
            put(l, P("attn.q_norm.weight"), 1, NM_QL, 0, one);
        } else {
            put_rnd(l, P("attn.wq_a.weight"), 2, NM_QL, NM_H, sH, 0, &rng);
            put_rnd(l, P("attn.q_norm.weight"), 1, NM_QL, 0, 0.1, 1.0, &rng);
        }
        put_rnd(l, P("attn.wq_b.weight"), 2, NM_HEADS * NM_HD, NM_QL, 1.0 / sqrt((double)NM_QL), 0, &rng);
        put_rnd(l, P("attn.wkv.weight"), 2, NM_HD, NM_H, sH, 0, &rng);
        put_rnd(l, P("attn.kv_norm.weight"), 1, NM_HD, 0, 0.1, 1.0, &rng);
        put_rnd(l, P("attn.wo_a.weight"), 2, NM_G * NM_OL, NM_HEADS * NM_HD / NM_G, 0.2, 0, &rng);
        put_rnd(l, P("attn.wo_b.weight"), 2, NM_H, NM_G * NM_OL, 0.3, 0, &rng);
        put_rnd(l, P("attn.attn_sink"), 1, NM_HEADS, 0, 1.0, 0, &rng);
        const int coff = r == 4 ? 2 : 1;
        put_rnd(l, P("attn.compressor.wkv.weight"), 2, coff * NM_HD, NM_H, sH, 0, &rng);
        put_rnd(l, P("attn.compressor.wgate.weight"), 2, coff * NM_HD, NM_H, sH, 0, &rng);
        put_rnd(l, P("attn.compressor.ape"), 2, r, coff * NM_HD, 0.5, 0, &rng);
        put_rnd(l, P("attn.compressor.norm.weight"), 1, NM_HD, 0, 0.1, 1.0, &rng);
        if (r == 4) {
            float *qb = zeros((int64_t)NM_ID * NM_QL); /* q channel 1 + i = qr channel i */
            for (int i = 0; i < 14; i++) qb[(size_t)(1 + i) * NM_QL + i] = 1.0f;
            put(l, P("attn.indexer.wq_b.weight"), 2, NM_ID, NM_QL, qb);
            float *wp = zeros(NM_H);
            wp[0] = 1.0f;
            put(l, P("attn.indexer.weights_proj.weight"), 2, 1, NM_H, wp);
            float *kv = zeros((int64_t)2 * NM_ID * NM_H); /* key channel c = x channel 1 + c, c < 28 */
            for (int half = 0; half < 2; half++)
                for (int c = 0; c < 28; c++) kv[(size_t)(half * NM_ID + c) * NM_H + 1 + c] = 1.0f;
            put(l, P("attn.indexer.compressor.wkv.weight"), 2, 2 * NM_ID, NM_H, kv);
            put(l, P("attn.indexer.compressor.wgate.weight"), 2, 2 * NM_ID, NM_H, zeros((int64_t)2 * NM_ID * NM_H));
            put(l, P("attn.indexer.compressor.ape"), 2, 4, 2 * NM_ID, zeros((int64_t)4 * 2 * NM_ID));
            float *one = zeros(NM_ID);
            for (int c = 0; c < NM_ID; c++) one[c] = 1.0f;
            put(l, P("attn.indexer.compressor.norm.weight"), 1, NM_ID, 0, one);
        }
        for (int site = 0; site < 2; site++) {
            snprintf(nm, sizeof nm, "layers.%d.hc_%s_fn", li, site ? "ffn" : "attn");
            put_rnd(l, nm, 2, (2 + NM_HC) * NM_HC, NM_HC * NM_H, 0.05, 0, &rng);
            snprintf(nm, sizeof nm, "layers.%d.hc_%s_base", li, site ? "ffn" : "attn");
            put_rnd(l, nm, 1, (2 + NM_HC) * NM_HC, 0, 0.5, 0, &rng);
            snprintf(nm, sizeof nm, "layers.%d.hc_%s_scale", li, site ? "ffn" : "attn");
            put_rnd(l, nm, 1, 3, 0, 0.2, 1.0, &rng);
        }
        put_rnd(l, P("ffn.gate.weight"), 2, NM_E, NM_H, sH, 0, &rng);
        put_rnd(l, P("ffn.gate.bias"), 1, NM_E, 0, 0.1, 0, &rng);
        for (int e = -1; e < NM_E; e++) {
            char base[64], w[96];
            if (e < 0) snprintf(base, sizeof base, "layers.%d.ffn.shared_experts", li);
            else snprintf(base, sizeof base, "layers.%d.ffn.experts.%d", li, e);
            snprintf(w, sizeof w, "%s.w1.weight", base);
            put_rnd(l, w, 2, NM_I, NM_H, sH, 0, &rng);
            snprintf(w, sizeof w, "%s.w3.weight", base);
            put_rnd(l, w, 2, NM_I, NM_H, sH, 0, &rng);
            snprintf(w, sizeof w, "%s.w2.weight", base);
            put_rnd(l, w, 2, NM_H, NM_I, 1.0 / sqrt((double)NM_I), 0, &rng);
        }
#undef P
    }
    char path[4200];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    moe_error err;
    CHECK_OK(moe_st_write(path, l->e, (size_t)l->n, NULL, &err), err);
    for (int i = 0; i < l->n; i++) free(l->bufs[i]);
    free(l);
    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *c = fopen(path, "w");
    fprintf(c, "{\"architectures\": [\"DeepseekV4ForCausalLM\"], \"model_type\": \"deepseek_v4\",\n"
               " \"hidden_size\": %d, \"vocab_size\": %d, \"num_hidden_layers\": 2, \"num_attention_heads\": %d,\n"
               " \"num_key_value_heads\": 1, \"head_dim\": %d, \"q_lora_rank\": %d, \"o_groups\": %d, \"o_lora_rank\": %d,\n"
               " \"sliding_window\": %d, \"index_n_heads\": 1, \"index_head_dim\": %d, \"index_topk\": %d,\n"
               " \"hc_mult\": %d, \"hc_sinkhorn_iters\": 20, \"hc_eps\": 1e-06, \"rms_norm_eps\": 1e-06,\n"
               " \"moe_intermediate_size\": %d, \"n_routed_experts\": %d, \"n_shared_experts\": 1, \"num_experts_per_tok\": %d,\n"
               " \"norm_topk_prob\": true, \"routed_scaling_factor\": 1.5, \"scoring_func\": \"sqrtsoftplus\", \"swiglu_limit\": 3.0,\n"
               " \"max_position_embeddings\": 1048576, \"rope_theta\": 10000.0, \"compress_rope_theta\": 160000.0,\n"
               " \"qk_rope_head_dim\": %d, \"num_hash_layers\": 0,\n"
               " \"rope_scaling\": {\"beta_fast\": 32, \"beta_slow\": 1, \"factor\": 16, \"original_max_position_embeddings\": 65536, \"type\": \"yarn\"},\n"
               " \"compress_ratios\": [4, 8, 0]}\n",
            NM_H, NM_V, NM_HEADS, NM_HD, NM_QL, NM_G, NM_OL, NM_WIN, NM_ID, NM_TOPK, NM_HC, NM_I, NM_E, NM_K, NM_ROPE);
    fclose(c);
}

/* The needle model's prompt: fillers, 8 needle tokens at 4 * 24 = 96, the query last. */
#define NP_T 256
#define NP_NEEDLE 96
static void needle_prompt(int64_t *ids) {
    uint64_t s = 99;
    for (int t = 0; t < NP_T; t++) {
        int64_t v;
        do v = (int64_t)(moe_splitmix64(&s) % NM_V);
        while (v == TOK_NEEDLE || v == TOK_QUERY);
        ids[t] = v;
    }
    for (int t = NP_NEEDLE; t < NP_NEEDLE + 8; t++) ids[t] = TOK_NEEDLE;
    ids[NP_T - 1] = TOK_QUERY;
}

static const char *needle_dir(void) {
    static char dir[512];
    if (!dir[0]) {
        moe_t_tmp_path(dir, sizeof dir, "needle-model");
        write_needle_model(dir);
    }
    return dir;
}

/* A whole bisect in one process: report (caller frees it and *bp). */
static moe_bisect_report *bisect(moe_fwd *f, const moe_bisect_spec *sp, moe_bisect **bp) {
    moe_error err;
    moe_bisect *b = NULL;
    moe_bisect_report *r = NULL;
    *bp = NULL;
    moe_status st = moe_bisect_init(f, sp, &b, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return NULL;
    st = moe_bisect_reference(b, &err);
    CHECK_OK(st, err);
    int n = moe_bisect_n_runs(b);
    moe_bisect_result *res = calloc((size_t)n + 1, sizeof *res);
    for (int i = 0; st == MOE_OK && i < n; i++) {
        moe_status rs = moe_bisect_run(b, i, &res[i], &err);
        CHECK_OK(rs, err);
    }
    if (st == MOE_OK) {
        st = moe_bisect_conclude(b, res, &r, &err);
        CHECK_OK(st, err);
    }
    free(res);
    *bp = b;
    return r;
}

static const moe_bisect_result *run_named(const moe_bisect_report *r, const char *name) {
    for (int i = 0; i < r->n_runs; i++)
        if (!strcmp(r->runs[i].name, name)) return &r->results[i];
    return NULL;
}

static uint64_t mask_of(const moe_bisect_report *r, const char *names) {
    uint64_t m = 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", names);
    for (char *t = strtok(buf, ","); t; t = strtok(NULL, ","))
        for (int i = 0; i < moe_patch_set_count(r->patches); i++)
            if (!strcmp(moe_patch_set_at(r->patches, i)->text, t)) m |= (uint64_t)1 << i;
    return m;
}

static void test_needle_fp4(void) {
    moe_error err;
    moe_fwd *f = NULL;
    CHECK_OK(moe_fwd_open(needle_dir(), &f, &err), err);
    if (!f) return;
    int64_t ids[NP_T];
    needle_prompt(ids);
    moe_bisect_spec sp = moe_bisect_spec_default();
    sp.ids = ids;
    sp.n_ids = NP_T;
    sp.needle_start = NP_NEEDLE;
    sp.needle_end = NP_NEEDLE + 8;
    sp.patches = "index-keys-fp4-norot,index-q-fp8,mhc-bf16,kv-fp8,attn-bf16";
    moe_bisect *b = NULL;
    moe_bisect_report *r = bisect(f, &sp, &b);
    if (r) {
        const moe_bisect_layer *R = &r->reference.layers[0];
        CHECK(R->type == MOE_ATTN_CSA && !R->dense && R->visible == 64 && R->needle_entries == 3, "layer 0: %lld visible, %d entries",
              (long long)R->visible, R->needle_entries);
        CHECK(R->kept >= 1 && R->best_rank == 1 && R->margin > 1.0, "float64 keeps the needle: kept %d, rank %lld, margin %g",
              R->kept, (long long)R->best_rank, R->margin);
        const moe_bisect_result *fp4 = run_named(r, "index-keys-fp4-norot");
        CHECK(fp4 && fp4->needle_lost && fp4->lost_layer == 0 && fp4->layers[0].kept == 0 && fp4->layers[0].margin <= 0,
              "FP4 keys without rotation lose it: kept %d, rank %lld", fp4 ? fp4->layers[0].kept : -1,
              fp4 ? (long long)fp4->layers[0].best_rank : -1);
        CHECK(fp4 && fp4->layers[0].best_score == 0, "the needle's FP4 scores are ReLU(0): %g", fp4 ? fp4->layers[0].best_score : -1);
        const char *harmless[] = {"index-q-fp8", "mhc-bf16", "kv-fp8", "attn-bf16"};
        for (int i = 0; i < 4; i++) {
            const moe_bisect_result *x = run_named(r, harmless[i]);
            CHECK(x && !x->needle_lost && x->layers[0].kept == R->kept, "%s keeps the needle", harmless[i]);
        }
        const moe_bisect_result *dep = run_named(r, "all"), *lo = run_named(r, "all but index-keys-fp4-norot");
        CHECK(dep && dep->needle_lost, "the deployment loses it");
        CHECK(lo && !lo->needle_lost, "reverting the FP4 keys restores it");
        CHECK(r->culprits == mask_of(r, "index-keys-fp4-norot"), "culprits %llx", (unsigned long long)r->culprits);
        CHECK(strstr(r->verdict, "index-keys-fp4-norot alone loses the needle too") &&
                  strstr(r->verdict, "Reverting index-keys-fp4-norot restores the needle"),
              "verdict: %s", r->verdict);
        printf("  needle verdict: %s\n", r->verdict);
    }
    moe_bisect_report_free(r);
    moe_bisect_free(b);
    /* FP8 keys (no rotation either) keep it: 0.2 / (5.61 / 448) is 16, exact in E4M3 */
    sp.patches = "index-keys-fp8-norot";
    r = bisect(f, &sp, &b);
    if (r) CHECK(!r->results[0].needle_lost && r->results[0].layers[0].kept == r->reference.layers[0].kept, "fp8 keeps it");
    moe_bisect_report_free(r);
    moe_bisect_free(b);
    moe_fwd_free(f);
}

static void test_interaction(void) {
    moe_error err;
    moe_fwd *f = NULL;
    CHECK_OK(moe_fwd_open(needle_dir(), &f, &err), err);
    if (!f) return;
    int64_t ids[NP_T];
    needle_prompt(ids);
    moe_bisect_spec sp = moe_bisect_spec_default();
    sp.ids = ids;
    sp.n_ids = NP_T;
    sp.needle_start = NP_NEEDLE;
    sp.needle_end = NP_NEEDLE + 8;
    sp.patches = "index-keys-fp4,index-norot,mhc-bf16";
    moe_bisect *b = NULL;
    moe_bisect_report *r = bisect(f, &sp, &b);
    if (r) {
        const char *alone[] = {"index-keys-fp4", "index-norot", "mhc-bf16"};
        for (int i = 0; i < 3; i++) {
            const moe_bisect_result *x = run_named(r, alone[i]);
            CHECK(x && !x->needle_lost, "%s alone keeps the needle", alone[i]);
        }
        const moe_bisect_result *dep = run_named(r, "all");
        CHECK(dep && dep->needle_lost, "together they lose it");
        CHECK(r->culprits == mask_of(r, "index-keys-fp4,index-norot"), "culprits %llx", (unsigned long long)r->culprits);
        CHECK(strstr(r->verdict, "index-keys-fp4 and index-norot do it only together") &&
                  strstr(r->verdict, "Reverting index-keys-fp4 or index-norot restores the needle"),
              "verdict: %s", r->verdict);
        printf("  interaction verdict: %s\n", r->verdict);
    }
    moe_bisect_report_free(r);
    moe_bisect_free(b);
    moe_fwd_free(f);
}

/* ------------------------------------------------------------- a contract fault */

typedef struct qlogits {
    int64_t q;
    int V;
    double *z;
} qlogits;

static moe_status qsink(void *ctx, const moe_fwd_tensor *t, moe_error *err) {
    qlogits *c = ctx;
    (void)err;
    if (t->what == MOE_FWD_LOGITS && t->layer < 0 && t->row0 <= c->q && c->q < t->row0 + t->rows)
        memcpy(c->z, t->data + (size_t)(c->q - t->row0) * (size_t)c->V, (size_t)c->V * sizeof(double));
    return MOE_OK;
}

static moe_status double_scale(void *ctx, const moe_layer *L, const double *x, const int64_t *ids, int64_t T,
                               const moe_run_opts *o, double *out, moe_error *err) {
    (void)ctx;
    moe_variant v = moe_variant_none();
    v.fault = MOE_FAULT_SCALE_DOUBLE;
    moe_block_out bo;
    moe_status st = moe_block_out_init(&bo, L, T, o, err);
    if (st == MOE_OK) st = moe_block_run_variant(L, x, ids, T, o, &v, &bo, err);
    if (st == MOE_OK) memcpy(out, bo.moe_out, (size_t)T * (size_t)L->cfg.hidden * sizeof(double));
    moe_block_out_free(&bo);
    return st;
}

/* Logits at the query of a prefill [0, q) then a decode step at q, optionally with a replaced MoE block. */
static void logits_at(moe_fwd *f, const int64_t *ids, int64_t q, moe_fwd_moe_fn moe, double *z) {
    moe_error err;
    qlogits c = {q, moe_fwd_get_config(f)->vocab, z};
    moe_fwd_opts o = moe_fwd_opts_default(f);
    o.sink = qsink;
    o.sink_ctx = &c;
    o.moe = moe;
    moe_fwd_state *s = NULL;
    CHECK_OK(moe_fwd_state_init(f, &o, &s, &err), err);
    if (s) {
        CHECK_OK(moe_fwd_run(f, s, ids, q, NULL, &err), err);
        moe_fwd_state_set_phase(s, MOE_PHASE_DECODE);
        CHECK_OK(moe_fwd_run(f, s, ids + q, 1, NULL, &err), err);
    }
    moe_fwd_state_free(s);
}

static void test_fault(void) {
    moe_error err;
    moe_fwd *f = NULL;
    CHECK_OK(moe_fwd_open(moe_t_data("dsv4-tiny"), &f, &err), err);
    if (!f) return;
    const int T = 512, V = moe_fwd_get_config(f)->vocab;
    int64_t ids[512], start, answer[4];
    CHECK_OK(moe_haystack(V, T, 0.5, 8, 4, 20261201, ids, &start, answer, &err), err);
    moe_bisect_spec sp = moe_bisect_spec_default();
    sp.ids = ids;
    sp.n_ids = T;
    sp.needle_start = start;
    sp.needle_end = start + 8;
    sp.answer = answer;
    sp.n_answer = 4;
    sp.patches = "scale-double,mhc-bf16,attn-bf16";
    moe_bisect *b = NULL;
    moe_bisect_report *r = bisect(f, &sp, &b);
    if (r) {
        const moe_bisect_result *sd = run_named(r, "scale-double");
        CHECK(sd && sd->grade == MOE_BISECT_HARMFUL && sd->output_changed && !sd->needle_lost,
              "scale-double harms through the output");
        for (int k = 0; sd && k < sd->n_layers; k++)
            CHECK(sd->layers[k].stream_err > 1e-3, "the doubled routed branch moves layer %d's streams: %g", k,
                  sd->layers[k].stream_err);
        CHECK(r->culprits == mask_of(r, "scale-double"), "culprits %llx", (unsigned long long)r->culprits);
        const moe_bisect_result *m = run_named(r, "mhc-bf16"), *a = run_named(r, "attn-bf16");
        CHECK(m && a && m->grade != MOE_BISECT_HARMFUL && a->grade != MOE_BISECT_HARMFUL, "mhc-bf16, attn-bf16 do not harm");
        CHECK(strstr(r->verdict, "scale-double alone changes the answer too") &&
                  strstr(r->verdict, "Reverting scale-double restores the answer"),
              "verdict: %s", r->verdict);
        printf("  fault verdict: %s\n", r->verdict);
        /* the same fault through the forward's replaceable MoE block */
        double *zr = malloc((size_t)V * sizeof *zr), *zf = malloc((size_t)V * sizeof *zf);
        logits_at(f, ids, T - 1, NULL, zr);
        logits_at(f, ids, T - 1, double_scale, zf);
        int top = 0, topr = 0;
        double mr = -INFINITY, mf = -INFINITY, sr = 0, sf = 0, kl = 0;
        for (int v = 0; v < V; v++) {
            if (zf[v] > zf[top]) top = v;
            if (zr[v] > zr[topr]) topr = v;
            mr = fmax(mr, zr[v]);
            mf = fmax(mf, zf[v]);
        }
        for (int v = 0; v < V; v++) {
            sr += exp(zr[v] - mr);
            sf += exp(zf[v] - mf);
        }
        for (int v = 0; v < V; v++) {
            double a1 = zr[v] - mr - log(sr), b1 = zf[v] - mf - log(sf);
            kl += exp(a1) * (a1 - b1);
        }
        CHECK(sd && sd->top1 == top && (sd->top1_agrees == (top == topr)), "top-1 %d, independent %d", sd ? sd->top1 : -1, top);
        CHECK(sd && fabs(sd->kl - kl) <= 1e-12 * fmax(kl, 1e-30), "KL %.17g, independent %.17g", sd ? sd->kl : 0, kl);
        free(zr);
        free(zf);
    }
    moe_bisect_report_free(r);
    moe_bisect_free(b);
    moe_fwd_free(f);
}

/* ------------------------------------------------------------ shared starts */

/* Every run with and without sharing the reference's work: the same bits. */
static void test_sharing(void) {
    moe_error err;
    moe_fwd *f = NULL;
    CHECK_OK(moe_fwd_open(moe_t_data("dsv4-attn"), &f, &err), err); /* sliding, csa, hca, csa */
    if (!f) return;
    const int T = 150, V = moe_fwd_get_config(f)->vocab;
    int64_t ids[150], start, answer[3];
    CHECK_OK(moe_haystack(V, T, 0.3, 6, 3, 5, ids, &start, answer, &err), err);
    int64_t chunks[2] = {37, 20};
    moe_bisect_spec sp = moe_bisect_spec_default();
    sp.ids = ids;
    sp.n_ids = T;
    sp.needle_start = start;
    sp.needle_end = start + 6;
    sp.answer = answer;
    sp.n_answer = 3;
    sp.chunks = chunks;
    sp.n_chunks = 2;
    sp.patches = "index-qk-fp8@3,attn-bf16,kv-fp8@2..,experts-fp8@1,index-topk=3";
    moe_bisect *b = NULL;
    moe_bisect_report *r = bisect(f, &sp, &b);
    bool some_start = false, some_prefix = false;
    moe_bisect *b2 = NULL;
    moe_bisect_report *r2 = NULL;
    if (r) {
        for (int i = 0; i < r->n_runs; i++) {
            some_start |= r->runs[i].start_layer > 0;
            some_prefix |= r->runs[i].prefix_shared;
        }
        CHECK(some_start && some_prefix, "the plan shares: start %d prefix %d", some_start, some_prefix);
        CHECK(run_named(r, "index-qk-fp8@3")->status == MOE_OK && r->runs[0].start_layer == 3, "starts at layer 3");
        CHECK(r->runs[1].prefix_shared, "attn-bf16 (decode) continues the reference's prefill");
        sp.no_sharing = true;
        r2 = bisect(f, &sp, &b2);
    }
    if (r && r2) {
        CHECK(r2->n_runs == r->n_runs, "same plan");
        for (int i = 0; i < r->n_runs && i < r2->n_runs; i++) {
            CHECK(!r2->runs[i].prefix_shared && r2->runs[i].start_layer == 0, "no sharing");
            CHECK(!memcmp(&r->results[i], &r2->results[i], sizeof r->results[i]), "run %s: shared start changed bits",
                  r->runs[i].name);
        }
        CHECK(!strcmp(r->verdict, r2->verdict), "verdicts");
    }
    moe_bisect_report_free(r);
    moe_bisect_free(b);
    moe_bisect_report_free(r2);
    moe_bisect_free(b2);
    moe_fwd_free(f);
}

/* A decode-only patch leaves the prefill's outputs untouched, bit for bit. */
typedef struct rows_at {
    int64_t from;
    double ss;          /* sum of squares of every streamed out row of the last layer before `from` */
    double last[4096];  /* the last layer's out row at `from` */
    int layer, nx;
} rows_at;

static moe_status rsink(void *ctx, const moe_fwd_tensor *t, moe_error *err) {
    rows_at *c = ctx;
    (void)err;
    if (t->what != MOE_FWD_OUT || t->layer != c->layer) return MOE_OK;
    for (int64_t r = 0; r < t->rows; r++) {
        const double *x = t->data + (size_t)r * (size_t)t->row_elems;
        if (t->row0 + r < c->from)
            for (int i = 0; i < c->nx; i++) c->ss += x[i] * x[i] * (double)(t->row0 + r + 1);
        else if (t->row0 + r == c->from)
            memcpy(c->last, x, (size_t)c->nx * sizeof(double));
    }
    return MOE_OK;
}

static void test_phase(void) {
    moe_error err;
    moe_fwd *f = NULL;
    CHECK_OK(moe_fwd_open(moe_t_data("dsv4-tiny"), &f, &err), err);
    if (!f) return;
    const moe_fwd_config *c = moe_fwd_get_config(f);
    int64_t ids[70];
    for (int i = 0; i < 70; i++) ids[i] = (i * 37 + 5) % c->vocab;
    moe_patch_set *ps = NULL;
    CHECK_OK(moe_patch_set_parse("attn-bf16", c, &ps, &err), err);
    rows_at a, b;
    for (int k = 0; k < 2; k++) {
        rows_at *x = k ? &b : &a;
        memset(x, 0, sizeof *x);
        x->from = 69;
        x->layer = c->n_layers - 1;
        x->nx = c->hc_mult * c->hidden;
        moe_fwd_opts o = moe_fwd_opts_default(f);
        o.sink = rsink;
        o.sink_ctx = x;
        o.patch = k ? ps : NULL;
        moe_fwd_state *s = NULL;
        CHECK_OK(moe_fwd_state_init(f, &o, &s, &err), err);
        CHECK_OK(moe_fwd_run(f, s, ids, 69, NULL, &err), err);
        moe_fwd_state_set_phase(s, MOE_PHASE_DECODE);
        CHECK_OK(moe_fwd_run(f, s, ids + 69, 1, NULL, &err), err);
        moe_fwd_state_free(s);
    }
    CHECK(a.ss == b.ss, "the prefill is untouched by a decode patch");
    double d = 0, n = 0;
    for (int i = 0; i < a.nx; i++) {
        d += (a.last[i] - b.last[i]) * (a.last[i] - b.last[i]);
        n += a.last[i] * a.last[i];
    }
    /* bf16 attention arithmetic (8-bit mantissas) moves the decode step by ~2^-9 relative */
    CHECK(d > 0 && sqrt(d / n) < 0.05, "the decode step moves by %g", sqrt(d / n));
    moe_patch_set_free(ps);
    moe_fwd_free(f);
}

/* ---------------------------------------------------------------- the CLI */

static char out[1 << 16];

static int cli(const char *args) {
    char cmd[8192];
    snprintf(cmd, sizeof cmd, "%s %s 2>&1", MOE_CLI, args);
    return moe_t_sh(cmd, out, sizeof out);
}

static bool same_file(const char *a, const char *b) {
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "cmp -s '%s' '%s'", a, b);
    return system(cmd) == 0;
}

static void write_prompt(const char *path, const int64_t *ids, int64_t T) {
    moe_st_entry e;
    memset(&e, 0, sizeof e);
    e.name = "input_ids";
    e.dtype = MOE_DTYPE_I64;
    e.ndim = 1;
    e.shape[0] = T;
    e.data = ids;
    moe_error err;
    CHECK_OK(moe_st_write(path, &e, 1, NULL, &err), err);
}

static void test_cli(void) {
    char j1[512], j2[512], j3[512], h1[512], pr[512], args[4096];
    moe_t_tmp_path(j1, sizeof j1, "b1.json");
    moe_t_tmp_path(j2, sizeof j2, "b2.json");
    moe_t_tmp_path(j3, sizeof j3, "b3.json");
    moe_t_tmp_path(h1, sizeof h1, "b1.html");
    moe_t_tmp_path(pr, sizeof pr, "prompt.safetensors");
    int64_t ids[NP_T];
    needle_prompt(ids);
    write_prompt(pr, ids, NP_T);
    /* the constructed needle through the CLI: exit 1 (harmful), verdict on stdout */
    snprintf(args, sizeof args, "bisect --model %s --prompt %s --needle %d:%d --patches index-keys-fp4-norot,kv-fp8 "
             "--json %s --html %s --threads 1", needle_dir(), pr, NP_NEEDLE, NP_NEEDLE + 8, j1, h1);
    int rc = cli(args);
    CHECK(rc == 1 && strstr(out, "verdict: The deployment (all 2 patches) loses the needle") &&
              strstr(out, "Reverting index-keys-fp4-norot restores the needle"), "rc %d: %s", rc, out);
    snprintf(args, sizeof args, "bisect --model %s --prompt %s --needle %d:%d --patches index-keys-fp4-norot,kv-fp8 "
             "--json %s --threads 2 --quiet", needle_dir(), pr, NP_NEEDLE, NP_NEEDLE + 8, j2);
    rc = cli(args);
    CHECK(rc == 1 && same_file(j1, j2), "JSON byte-identical across thread counts (rc %d)", rc);
    static char js[1 << 20];
    CHECK(moe_t_read_file(j1, js, sizeof js) && strstr(js, "\"culprits\":\t[\"index-keys-fp4-norot\"]") &&
              strstr(js, "\"needle_lost\":\ttrue"), "JSON content");
    CHECK(moe_t_read_file(h1, js, sizeof js) && strstr(js, "<svg") && strstr(js, "Verdict") && !strstr(js, "<script"),
          "HTML self-contained");
    /* a haystack on the bundled checkpoint, chunked prefill, the grid */
    snprintf(args, sizeof args, "bisect --model %s --length 300 --patches mhc-bf16,kv-fp8 --chunks 100,64 --json %s --quiet",
             moe_t_data("dsv4-attn"), j3);
    rc = cli(args);
    CHECK(rc == 0 || rc == 1, "haystack bisect rc %d: %s", rc, out);
    CHECK(moe_t_read_file(j3, js, sizeof js) && strstr(js, "\"prefill_chunks\":\t[100, 64]") && strstr(js, "\"answer\":\t["),
          "chunks and answer in the JSON");
    snprintf(args, sizeof args, "bisect --model %s --sweep-length 40..88:24 --depths 0.2,0.8 --patches index-keys-fp4-norot "
             "--json %s --quiet", moe_t_data("dsv4-attn"), j3);
    rc = cli(args);
    CHECK((rc == 0 || rc == 1) && moe_t_read_file(j3, js, sizeof js) && strstr(js, "\"onset_tokens\":\t24") &&
              strstr(js, "\"length_mod_ratio\"") && strstr(js, "\"length\":\t88"), "grid rc %d: %s", rc, out);
    /* bad input: exit 2, a message naming the value, no report written */
    char nj[512];
    moe_t_tmp_path(nj, sizeof nj, "never.json");
    struct { const char *args, *needle; } bad[] = {
        {"--patches mhc-bf61", "closest: mhc-bf16"},
        {"--patches index-keys-fp8,index-keys-fp4", "both set the index-keys component"},
        {"--patches experts-mxfp4", "blocks of 32"},
        {"--patches mhc-bf16 --length 4", "--length 4: expected an integer from 8"},
        {"--patches mhc-bf16 --needle 10:5", "needle 10:5"},
        {"--patches mhc-bf16 --length 64 --needle 3:70", "needle 3:70"},
        {"--patches mhc-bf16 --answer 1,999", "--answer 1,999"},
        {"--patches mhc-bf16 --prompt /nonexistent.safetensors --needle 1:2", "nonexistent"},
        {"--patches mhc-bf16 --chunks 0", "--chunks 0"},
        {"--patches mhc-bf16 --depth 2", "--depth 2"},
        {"", "--patches LIST is required"},
        {"--patches mhc-bf16 --frobnicate 1", "unknown option '--frobnicate'"},
    };
    for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
        snprintf(args, sizeof args, "bisect --model %s --length 64 %s --json %s", moe_t_data("dsv4-tiny"), bad[i].args, nj);
        rc = cli(args);
        struct stat sb;
        CHECK(rc == 2 && strstr(out, bad[i].needle) && stat(nj, &sb) != 0, "%s: rc %d: %s", bad[i].args, rc, out);
    }
    /* a report never replaces an input (#12): the checkpoint's config.json, the prompt */
    char cfgp[1024];
    snprintf(cfgp, sizeof cfgp, "%s/config.json", moe_t_data("dsv4-tiny"));
    snprintf(args, sizeof args, "bisect --model %s --length 64 --patches mhc-bf16 --html %s", moe_t_data("dsv4-tiny"), cfgp);
    rc = cli(args);
    CHECK(rc == 2 && strstr(out, "refusing to overwrite an input"), "--html over config.json: rc %d: %s", rc, out);
    snprintf(args, sizeof args, "bisect --model %s --prompt %s --needle 1:3 --patches mhc-bf16 --json %s",
             moe_t_data("dsv4-tiny"), pr, pr);
    rc = cli(args);
    CHECK(rc == 2 && strstr(out, "refusing to overwrite an input"), "--json over --prompt: rc %d: %s", rc, out);
    rc = cli("bisect --list-patches");
    CHECK(rc == 0 && strstr(out, "index-keys-fp4-norot") && strstr(out, "scale-double"), "list");
    rc = cli("bisect --help");
    CHECK(rc == 0 && strstr(out, "--sweep-length"), "help");
#ifdef MOE_MPIEXEC
    /* two ranks write the single-process report, byte for byte */
    snprintf(args, sizeof args,
             "%s --oversubscribe --allow-run-as-root -np 2 %s bisect --model %s --prompt %s --needle %d:%d "
             "--patches index-keys-fp4-norot,kv-fp8 --json %s --threads 1 --quiet 2>&1",
             MOE_MPIEXEC, MOE_CLI, needle_dir(), pr, NP_NEEDLE, NP_NEEDLE + 8, j3);
    rc = moe_t_sh(args, out, sizeof out);
    CHECK(rc == 1 && same_file(j1, j3), "mpirun -np 2: the same report (rc %d): %s", rc, out);
    /* a rank whose checkpoint copy lacks a shard: its runs are reported failed, the others kept */
    char broken[512], cmd[4096];
    moe_t_tmp_path(broken, sizeof broken, "needle-broken");
    snprintf(cmd, sizeof cmd, "mkdir -p %s && cp %s/config.json %s/", broken, needle_dir(), broken);
    CHECK(system(cmd) == 0, "copy");
    {
        /* the copy holds every tensor but layer 1's */
        moe_st_file *src = NULL;
        moe_error err;
        char p[1024];
        snprintf(p, sizeof p, "%s/model.safetensors", needle_dir());
        CHECK_OK(moe_st_open(p, &src, &err), err);
        if (src) {
            size_t n = moe_st_count(src), k = 0;
            moe_st_entry *e = calloc(n, sizeof *e);
            for (size_t i = 0; i < n; i++) {
                const moe_st_tensor *t = moe_st_at(src, i);
                if (!strncmp(t->name, "layers.1.", 9)) continue;
                e[k++] = moe_t_st_entry(t);
            }
            snprintf(p, sizeof p, "%s/model.safetensors", broken);
            CHECK_OK(moe_st_write(p, e, k, NULL, &err), err);
            free(e);
            moe_st_close(src);
        }
    }
    snprintf(args, sizeof args,
             "%s --oversubscribe --allow-run-as-root -np 1 %s bisect --model %s --prompt %s --needle %d:%d "
             "--patches index-keys-fp4-norot,kv-fp8,mhc-bf16 --json %s --quiet : -np 1 %s bisect --model %s --prompt %s "
             "--needle %d:%d --patches index-keys-fp4-norot,kv-fp8,mhc-bf16 --json %s --quiet 2>&1",
             MOE_MPIEXEC, MOE_CLI, needle_dir(), pr, NP_NEEDLE, NP_NEEDLE + 8, j3, MOE_CLI, broken, pr, NP_NEEDLE,
             NP_NEEDLE + 8, j3);
    rc = moe_t_sh(args, out, sizeof out);
    CHECK(rc == 1 && strstr(out, "rank 1 failed") && strstr(out, "layers.1."), "a failing rank: rc %d: %s", rc, out);
    CHECK(moe_t_read_file(j3, js, sizeof js) && strstr(js, "\"status\":\t\"ok\"") && strstr(js, "rank 1"),
          "the report keeps rank 0's runs and names rank 1's");
#else
    printf("  (MPI not built: the two-rank checks are skipped)\n");
#endif
}

int main(void) {
    RUN(test_patch_table);
    RUN(test_patch_parse);
    RUN(test_kv_round);
    RUN(test_needle_fp4);
    RUN(test_interaction);
    RUN(test_fault);
    RUN(test_sharing);
    RUN(test_phase);
    RUN(test_cli);
    return moe_t_finish();
}
