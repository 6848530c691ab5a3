/*
 * The whole DeepSeek-V4 forward (src/model, src/attn): against the fixture's
 * transformers logits, chunked against one shot, float32 against float64,
 * both config schemas and namings, and bad input.
 */
#include "harness.h"
#include "moeaudit.h"
#include "moe_formats.h"

#include <unistd.h>

/* Everything a run streams, gathered per (layer, what) into [T, row] buffers. */
#define MAXL 8
typedef struct collect {
    int64_t T;
    int n_layers;
    int64_t elems[MAXL + 1][8];  /* row elements seen per layer / what */
    double *d[MAXL + 1][8];      /* [T, elems] (index n_layers+... unused); logits at [MAXL][LOGITS] */
    int32_t *topk[MAXL];
    int64_t rows_seen[MAXL + 1][8];
} collect;

static moe_status sink(void *ctx, const moe_fwd_tensor *t, moe_error *err) {
    collect *c = ctx;
    int l = t->layer < 0 ? MAXL : t->layer;
    if (l > MAXL) return moe_errf(err, MOE_ERR_ARG, "layer %d beyond the test's table", t->layer);
    if (!c->elems[l][t->what]) {
        c->elems[l][t->what] = t->row_elems;
        if (t->what == MOE_FWD_INDEX_TOPK) c->topk[l] = calloc((size_t)(c->T * t->row_elems), sizeof(int32_t));
        else c->d[l][t->what] = calloc((size_t)(c->T * t->row_elems), sizeof(double));
    }
    if (c->elems[l][t->what] != t->row_elems || t->row0 + t->rows > c->T)
        return moe_errf(err, MOE_ERR_ARG, "inconsistent rows for layer %d %s", t->layer, moe_fwd_what_name(t->what));
    if (t->what == MOE_FWD_INDEX_TOPK)
        memcpy(c->topk[l] + t->row0 * t->row_elems, t->idata, (size_t)(t->rows * t->row_elems) * sizeof(int32_t));
    else
        memcpy(c->d[l][t->what] + t->row0 * t->row_elems, t->data, (size_t)(t->rows * t->row_elems) * sizeof(double));
    c->rows_seen[l][t->what] += t->rows;
    return MOE_OK;
}

static void collect_free(collect *c) {
    for (int l = 0; l <= MAXL; l++) {
        for (int w = 0; w < 8; w++) free(c->d[l][w]);
        if (l < MAXL) free(c->topk[l]);
    }
    memset(c, 0, sizeof *c);
}

/* Run the model on ids [T] in chunks (sizes [n_chunks], summing to T). */
static moe_status run_chunks(moe_fwd *f, const moe_fwd_opts *base, const int64_t *ids, int64_t T,
                             const int64_t *chunks, int n_chunks, collect *c, moe_error *err) {
    memset(c, 0, sizeof *c);
    c->T = T;
    moe_fwd_opts o = *base;
    o.sink = sink;
    o.sink_ctx = c;
    moe_fwd_state *s = NULL;
    moe_status st = moe_fwd_state_init(f, &o, &s, err);
    int64_t at = 0;
    for (int i = 0; st == MOE_OK && i < n_chunks; i++) {
        st = moe_fwd_run(f, s, ids + at, chunks[i], NULL, err);
        at += chunks[i];
    }
    moe_fwd_state_free(s);
    return st;
}

static double max_rel(const double *a, const double *b, int64_t n) {
    double num = 0, den = 0;
    for (int64_t i = 0; i < n; i++) {
        num = fmax(num, fabs(a[i] - b[i]));
        den = fmax(den, fabs(b[i]));
        if (isnan(a[i]) != isnan(b[i])) return INFINITY;
    }
    return den > 0 ? num / den : num;
}

/* Replays picks [T, K] of one layer (test oracle) through moe_fwd_opts.index. */
typedef struct replay {
    int layer, K;
    const int32_t *picks;
} replay;

static moe_status replay_fn(void *ctx, int layer, int64_t row0, int64_t rows, int topk, int32_t *sel, moe_error *err) {
    const replay *r = ctx;
    if (layer != r->layer) return MOE_OK;
    if (topk != r->K) return moe_errf(err, MOE_ERR_ARG, "replay has %d picks per row, the layer %d", r->K, topk);
    memcpy(sel, r->picks + row0 * topk, (size_t)(rows * topk) * sizeof(int32_t));
    return MOE_OK;
}

typedef struct oracle {
    moe_st_file *f;
    int64_t T;
    int64_t *ids;
    int32_t *picks3;   /* layers.3.index_topk */
    double *scores3;   /* layers.3.index_scores [T, S] */
    int64_t S3;
} oracle;

static bool oracle_open(oracle *o) {
    memset(o, 0, sizeof *o);
    moe_error err;
    moe_status st = moe_st_open(moe_t_data("dsv4-tiny/oracle_fwd.safetensors"), &o->f, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return false;
    const moe_st_tensor *ti = moe_st_find(o->f, "input_ids"), *tp = moe_st_find(o->f, "layers.3.index_topk"),
                        *ts = moe_st_find(o->f, "layers.3.index_scores");
    CHECK(ti && tp && ts, "oracle_fwd tensors");
    if (!ti || !tp || !ts) return false;
    o->T = ti->shape[0];
    o->ids = malloc((size_t)o->T * sizeof *o->ids);
    for (int64_t t = 0; t < o->T; t++) o->ids[t] = moe_load_i64(ti->data, ti->dtype, (size_t)t);
    o->picks3 = malloc((size_t)moe_t_numel(tp) * sizeof(int32_t));
    for (int64_t i = 0; i < moe_t_numel(tp); i++) o->picks3[i] = (int32_t)moe_load_i64(tp->data, tp->dtype, (size_t)i);
    o->scores3 = moe_t_tensor_f64(ts, NULL);
    o->S3 = ts->shape[1];
    return true;
}

static void oracle_close(oracle *o) {
    moe_st_close(o->f);
    free(o->ids);
    free(o->picks3);
    free(o->scores3);
}

/* Float64 against float64: the oracle (transformers 5.17 without its fp32
 * casts) sums in other orders (torch's matmul and reductions) than ours, so
 * the two differ by accumulated float64 rounding: 4e-15 relative measured
 * over 4 layers. The bar is 1e-10; the smallest semantic change seen
 * (transformers' own fp32 casts) moves the logits by 5.6e-7, so 1e-10 tells
 * rounding from any change of the math. */
#define TOL_ORACLE_F64 1e-10

static void test_oracle_every_tensor(void) {
    oracle o;
    if (!oracle_open(&o)) return;
    moe_error err;
    moe_fwd *f = NULL;
    moe_status st = moe_fwd_open(moe_t_data("dsv4-tiny"), &f, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) { oracle_close(&o); return; }
    const moe_fwd_config *c = moe_fwd_get_config(f);
    CHECK(c->n_layers == 4 && c->attn[0] == MOE_ATTN_HCA && c->attn[3] == MOE_ATTN_CSA && c->ratio[3] == 4 &&
          c->ratio[0] == 128 && c->rope_dim == 4 && c->window == 16, "dsv4-tiny config");
    /* replay transformers' picks: row 39 ties at the cut (ORACLE_FWD.md) */
    replay rp = {.layer = 3, .K = c->index_topk, .picks = o.picks3};
    moe_fwd_opts opts = moe_fwd_opts_default(f);
    opts.index = replay_fn;
    opts.index_ctx = &rp;
    collect col;
    st = run_chunks(f, &opts, o.ids, o.T, &o.T, 1, &col, &err);
    CHECK_OK(st, err);
    double worst = 0;
    for (int l = 0; st == MOE_OK && l < c->n_layers; l++)
        for (int w = MOE_FWD_IN; w <= MOE_FWD_OUT; w++) {
            char name[64];
            snprintf(name, sizeof name, "layers.%d.%s", l, moe_fwd_what_name((moe_fwd_what)w));
            const moe_st_tensor *t = moe_st_find(o.f, name);
            CHECK(t && col.d[l][w] && col.rows_seen[l][w] == o.T, "%s streamed and in the oracle", name);
            if (!t || !col.d[l][w]) continue;
            double *ref = moe_t_tensor_f64(t, NULL);
            double e = max_rel(col.d[l][w], ref, moe_t_numel(t));
            CHECK(e < TOL_ORACLE_F64, "%s: rel err %g", name, e);
            worst = fmax(worst, e);
            free(ref);
        }
    const moe_st_tensor *tl = moe_st_find(o.f, "logits");
    if (st == MOE_OK && tl && col.d[MAXL][MOE_FWD_LOGITS]) {
        double *ref = moe_t_tensor_f64(tl, NULL);
        double e = max_rel(col.d[MAXL][MOE_FWD_LOGITS], ref, moe_t_numel(tl));
        CHECK(e < TOL_ORACLE_F64, "logits: rel err %g", e);
        printf("  vs transformers float64 (no fp32 casts): streams/blocks max rel %.3g, logits %.3g\n", worst, e);
        free(ref);
        /* the second, independently made cast-free oracle of the same model (tests/oracle) */
        moe_st_file *nc = NULL;
        CHECK_OK(moe_st_open(moe_t_data("dsv4-tiny/oracle_nocast.safetensors"), &nc, &err), err);
        double *r2 = nc ? moe_t_load_f64(nc, "logits", NULL) : NULL;
        CHECK(r2 != NULL, "oracle_nocast logits");
        if (r2) {
            double e2 = max_rel(col.d[MAXL][MOE_FWD_LOGITS], r2, moe_t_numel(tl));
            CHECK(e2 < TOL_ORACLE_F64, "logits vs oracle_nocast: rel err %g", e2);
        }
        free(r2);
        moe_st_close(nc);
    }
    collect_free(&col);

    /* our own picks: equal to transformers' up to exact ties at the cut */
    opts.index = NULL;
    st = run_chunks(f, &opts, o.ids, o.T, &o.T, 1, &col, &err);
    CHECK_OK(st, err);
    const int K = c->index_topk;
    int tied_rows = 0;
    for (int64_t t = 0; st == MOE_OK && t < o.T && col.topk[3]; t++) {
        const int32_t *ours = col.topk[3] + t * K, *theirs = o.picks3 + t * K;
        const double *sc = o.scores3 + t * o.S3;
        int64_t vis = (t + 1) / c->ratio[3];
        /* the K-th largest visible oracle score: the cut */
        double cut = -INFINITY;
        if (vis > K) {
            int nbig = 0;
            for (int64_t j = 0; j < vis; j++) {
                int above = 0;
                for (int64_t i = 0; i < vis; i++) above += sc[i] > sc[j];
                if (above < K && (nbig == 0 || sc[j] < cut)) { cut = sc[j]; nbig = 1; }
            }
        }
        bool differs = false;
        for (int k = 0; k < K; k++) {
            bool in = false;
            for (int k2 = 0; k2 < K; k2++) in |= theirs[k2] == ours[k];
            if (!in) {
                differs = true;
                CHECK(ours[k] >= 0 && sc[ours[k]] == cut, "row %lld: pick %d (score %g) is not tied at the cut %g",
                      (long long)t, ours[k], ours[k] >= 0 ? sc[ours[k]] : NAN, cut);
            }
        }
        tied_rows += differs;
    }
    CHECK(tied_rows == 1, "exactly the known tie (row 39) differs: %d rows", tied_rows);
    collect_free(&col);

    /* transformers' chunked run (DynamicCache, chunks 37, 1, 1, 1) against ours */
    const moe_st_tensor *tc = moe_st_find(o.f, "chunked.logits"), *tz = moe_st_find(o.f, "chunked.sizes");
    CHECK(tc && tz, "chunked oracle");
    if (tc && tz) {
        int64_t sizes[16];
        int nz = (int)tz->shape[0];
        for (int i = 0; i < nz && i < 16; i++) sizes[i] = moe_load_i64(tz->data, tz->dtype, (size_t)i);
        opts.index = replay_fn;
        st = run_chunks(f, &opts, o.ids, o.T, sizes, nz, &col, &err);
        CHECK_OK(st, err);
        if (st == MOE_OK) {
            double *ref = moe_t_tensor_f64(tc, NULL);
            double e = max_rel(col.d[MAXL][MOE_FWD_LOGITS], ref, moe_t_numel(tc));
            CHECK(e < TOL_ORACLE_F64, "chunked logits: rel err %g", e);
            free(ref);
        }
        collect_free(&col);
    }
    moe_fwd_free(f);
    oracle_close(&o);
}

static double compare_runs(const collect *a, const collect *b, int n_layers, const char *what);

/* Index rows as sets: sorted ascending, -1 last (the oracles' convention). */
static void sort_row(int32_t *r, int K) {
    for (int i = 1; i < K; i++)
        for (int j = i; j > 0; j--) {
            int32_t a = r[j - 1], b = r[j];
            bool swap = (a == -1 && b != -1) || (a != -1 && b != -1 && a > b);
            if (!swap) break;
            r[j - 1] = b;
            r[j] = a;
        }
}

/* Rows of ours [T, K] whose set differs from the oracle's tensor `name`. */
static int64_t set_mismatches(moe_st_file *f, const char *name, const int32_t *ours, int64_t T, int K) {
    const moe_st_tensor *t = moe_st_find(f, name);
    CHECK(t && t->ndim == 2 && t->shape[0] == T && t->shape[1] == K, "%s in the oracle, [%lld, %d]", name, (long long)T, K);
    if (!t || !ours) return -1;
    int64_t bad = 0;
    int32_t a[256], b[256];
    for (int64_t r = 0; r < T; r++) {
        for (int k = 0; k < K; k++) {
            a[k] = ours[r * K + k];
            b[k] = (int32_t)moe_load_i64(t->data, t->dtype, (size_t)(r * K + k));
        }
        sort_row(a, K);
        sort_row(b, K);
        bad += memcmp(a, b, (size_t)K * sizeof *a) != 0;
    }
    return bad;
}

/* Everything a dataset of tests/oracle holds: one shot (every layer's
 * streams and blocks, the logits, the index sets) and transformers' chunked
 * runs (logits, index sets); our chunked runs equal our one shot bitwise. */
static void check_dataset(const char *name) {
    char path[512];
    snprintf(path, sizeof path, "%s/oracle.safetensors", name);
    moe_error err;
    moe_st_file *of = NULL;
    moe_status st = moe_st_open(moe_t_data(path), &of, &err);
    CHECK_OK(st, err);
    moe_fwd *f = NULL;
    if (st == MOE_OK) st = moe_fwd_open(moe_t_data(name), &f, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) { moe_st_close(of); return; }
    const moe_fwd_config *c = moe_fwd_get_config(f);
    const moe_st_tensor *ti = moe_st_find(of, "input_ids");
    int64_t T = ti->shape[0];
    int64_t *ids = moe_t_tensor_i64(ti);
    moe_fwd_opts o = moe_fwd_opts_default(f);
    collect one;
    st = run_chunks(f, &o, ids, T, &T, 1, &one, &err);
    CHECK_OK(st, err);
    double worst = 0, wl = 0;
    for (int l = 0; st == MOE_OK && l < c->n_layers; l++) {
        for (int w = MOE_FWD_IN; w <= MOE_FWD_OUT; w++) {
            char tn[64];
            snprintf(tn, sizeof tn, "layers.%d.%s", l, moe_fwd_what_name((moe_fwd_what)w));
            double *ref = moe_t_load_f64(of, tn, NULL);
            CHECK(ref && one.d[l][w], "%s: %s in the oracle and streamed", name, tn);
            if (!ref || !one.d[l][w]) { free(ref); continue; }
            double e = max_rel(one.d[l][w], ref, T * one.elems[l][w]);
            CHECK(e < TOL_ORACLE_F64, "%s: %s rel err %g", name, tn, e);
            worst = fmax(worst, e);
            free(ref);
        }
        if (c->attn[l] == MOE_ATTN_CSA) {
            char tn[64];
            snprintf(tn, sizeof tn, "layers.%d.index_topk", l);
            int64_t bad = set_mismatches(of, tn, one.topk[l], T, c->index_topk);
            CHECK(bad == 0, "%s: %s: %lld rows with another set", name, tn, (long long)bad);
        }
    }
    double *ref = moe_t_load_f64(of, "logits", NULL);
    if (st == MOE_OK && ref) {
        wl = max_rel(one.d[MAXL][MOE_FWD_LOGITS], ref, T * c->vocab);
        CHECK(wl < TOL_ORACLE_F64, "%s: logits rel err %g", name, wl);
    }
    free(ref);
    printf("  %s (T = %lld): streams and blocks max rel %.3g, logits %.3g, index sets identical\n", name, (long long)T,
           worst, wl);
    static const char *const runs[] = {"chunked", "chunked_mid"};
    for (int k = 0; st == MOE_OK && k < 2; k++) {
        char tn[64];
        snprintf(tn, sizeof tn, "%s.chunks", runs[k]);
        const moe_st_tensor *tc = moe_st_find(of, tn);
        CHECK(tc != NULL, "%s: %s", name, tn);
        if (!tc) continue;
        int64_t *chunks = moe_t_tensor_i64(tc);
        collect ch;
        st = run_chunks(f, &o, ids, T, chunks, (int)tc->shape[0], &ch, &err);
        CHECK_OK(st, err);
        snprintf(tn, sizeof tn, "%s.logits", runs[k]);
        double *cl = moe_t_load_f64(of, tn, NULL);
        if (st == MOE_OK && cl) {
            double e = max_rel(ch.d[MAXL][MOE_FWD_LOGITS], cl, T * c->vocab);
            CHECK(e < TOL_ORACLE_F64, "%s: %s rel err %g", name, tn, e);
            CHECK(compare_runs(&ch, &one, c->n_layers, runs[k]) == 0, "%s: %s differs from our one shot", name, runs[k]);
            for (int l = 0; l < c->n_layers; l++)
                if (c->attn[l] == MOE_ATTN_CSA) {
                    snprintf(tn, sizeof tn, "%s.layers.%d.index_topk", runs[k], l);
                    int64_t bad = set_mismatches(of, tn, ch.topk[l], T, c->index_topk);
                    CHECK(bad == 0, "%s: %s: %lld rows with another set", name, tn, (long long)bad);
                }
        }
        free(cl);
        free(chunks);
        collect_free(&ch);
    }
    collect_free(&one);
    free(ids);
    moe_fwd_free(f);
    moe_st_close(of);
}

static void test_oracle_datasets(void) {
    check_dataset("dsv4-attn");
    check_dataset("dsv4-flash-layout");
}

/* The fixture's model.logits (oracle_io.safetensors): an older transformers
 * float64 run with fp32 casts inside (norms, RoPE, mHC, indexer scores,
 * compressor softmax) and, per the fixture's README, an fp32 router.
 * transformers 5.17 itself lands 1.9e-5 (relative to the largest logit) from
 * those logits, with or without its casts (ORACLE_FWD.md), and ours equals
 * 5.17's to 4e-15: the bound is that measured transformers-to-transformers
 * distance with a margin of 2.5x. The tie of row 39 is replayed. */
#define TOL_FIXTURE_OLD_ORACLE 5e-5

static void test_fixture_logits(void) {
    oracle o;
    if (!oracle_open(&o)) return;
    moe_error err;
    moe_fwd *f = NULL;
    moe_status st = moe_fwd_open(moe_t_data("dsv4-tiny"), &f, &err);
    CHECK_OK(st, err);
    moe_st_file *fx = NULL;
    if (st == MOE_OK) st = moe_st_open(moe_t_data("dsv4-tiny/oracle_io.safetensors"), &fx, &err);
    CHECK_OK(st, err);
    const moe_st_tensor *tl = fx ? moe_st_find(fx, "model.logits") : NULL;
    CHECK(tl != NULL, "model.logits");
    if (st == MOE_OK && tl) {
        replay rp = {.layer = 3, .K = moe_fwd_get_config(f)->index_topk, .picks = o.picks3};
        moe_fwd_opts opts = moe_fwd_opts_default(f);
        opts.index = replay_fn;
        opts.index_ctx = &rp;
        collect c;
        st = run_chunks(f, &opts, o.ids, o.T, &o.T, 1, &c, &err);
        CHECK_OK(st, err);
        if (st == MOE_OK) {
            double *ref = moe_t_tensor_f64(tl, NULL);
            double e = max_rel(c.d[MAXL][MOE_FWD_LOGITS], ref, moe_t_numel(tl));
            printf("  vs the fixture's model.logits (older oracle, fp32 casts): %.3g\n", e);
            CHECK(e < TOL_FIXTURE_OLD_ORACLE, "logits rel err %g", e);
            free(ref);
        }
        collect_free(&c);
    }
    moe_st_close(fx);
    moe_fwd_free(f);
    oracle_close(&o);
}

/* ------------------------------------------------ synthetic checkpoints */

/* A small V4 checkpoint written here (random BF16/F32 weights): the shapes
 * and names of the release, with ratios small enough that every compressor
 * emits entries and the indexer discards some at a few dozen tokens. */
typedef struct synth {
    bool native_schema;        /* compress_ratios + rope_scaling, else layer_types + rope_parameters */
    bool hf_names;             /* transformers' save names (model. prefix, attn.norm, embed_tokens, hc_head.hc_fn) */
    int n_shards;              /* >1: model.safetensors.index.json + shards */
    int n_layers;
    int ratio[8];              /* per layer: 0, 4 (CSA) or another (HCA) */
    int hash_layers;
    uint64_t seed;
    const char *drop;          /* a tensor name to leave out (bad-input tests) */
    const char *config_extra;  /* appended to config.json's object (bad-input tests), or NULL */
    bool mtp;                  /* an MTP block mtp.0.* (attention ratio mtp_ratio, score-routed MoE) */
    int mtp_ratio;
    int mtp_mode;              /* 0: random e_proj / h_proj; 1: e_proj 0, h_proj identity; 2: e_proj identity, h_proj 0 */
    bool mtp_as_layer;         /* no MTP block: its block as layer n_layers, its head as the model's */
    int quant;                 /* 0: BF16; 1: the V4-Flash release layout (FP8 E4M3 + E8M0 128x128
                                  attention / indexer wq_b / shared experts, MXFP4 I8 + E8M0 experts);
                                  2: the values of 1 decoded, stored F32 */
} synth;

enum { SY_H = 64, SY_HEADS = 4, SY_HD = 32, SY_ROPE = 8, SY_QL = 24, SY_G = 2, SY_OL = 16, SY_WIN = 6,
       SY_IH = 2, SY_ID = 16, SY_TOPK = 3, SY_HC = 4, SY_V = 97, SY_E = 4, SY_K = 2, SY_I = 32 };

typedef struct tlist {
    moe_st_entry e[512];
    char names[512][128];
    void *bufs[512];
    int n;
} tlist;

static bool ends_with(const char *s, const char *suf) {
    size_t a = strlen(s), b = strlen(suf);
    return a >= b && !strcmp(s + a - b, suf);
}

/* Which release format a linear has there: 1 FP8 block, 2 MXFP4, 0 plain. */
static int release_fmt(const char *name) {
    static const char *const fp8[] = {".attn.wq_a.weight", ".attn.wq_b.weight", ".attn.wkv.weight", ".attn.wo_a.weight",
                                      ".attn.wo_b.weight", ".attn.indexer.wq_b.weight", ".shared_experts.w1.weight",
                                      ".shared_experts.w2.weight", ".shared_experts.w3.weight"};
    for (size_t i = 0; i < sizeof fp8 / sizeof fp8[0]; i++)
        if (ends_with(name, fp8[i])) return 1;
    return strstr(name, ".ffn.experts.") && ends_with(name, ".weight") ? 2 : 0;
}

static void t_push(tlist *l, const char *name, moe_dtype dt, int ndim, int64_t d0, int64_t d1, void *b) {
    MOE_ASSERT(l->n < 512);
    moe_st_entry *e = &l->e[l->n];
    snprintf(l->names[l->n], sizeof l->names[0], "%s", name);
    e->name = l->names[l->n];
    e->dtype = dt;
    e->ndim = ndim;
    e->shape[0] = d0;
    e->shape[1] = d1;
    e->data = b;
    l->bufs[l->n++] = b;
}

/* A 2-D float tensor in its release format (quant 1) or those values in F32 (quant 2). */
static void t_add_quant(tlist *l, const char *full, int fmt, int quant, const float *v, int64_t rows, int64_t cols) {
    if (fmt == 1) {
        int64_t gr = (rows + 127) / 128, gc = (cols + 127) / 128;
        uint8_t *q = malloc((size_t)(rows * cols)), *sc = malloc((size_t)(gr * gc));
        moe_fp8_block_quant_e8m0(v, rows, cols, q, sc);
        if (quant == 1) {
            char sname[128];
            snprintf(sname, sizeof sname, "%.*s.scale", (int)(strlen(full) - 7), full);
            t_push(l, full, MOE_DTYPE_F8_E4M3, 2, rows, cols, q);
            t_push(l, sname, MOE_DTYPE_F8_E8M0, 2, gr, gc, sc);
            return;
        }
        float *d = malloc((size_t)(rows * cols) * sizeof *d);
        for (int64_t r = 0; r < rows; r++) moe_fp8_block_dequant_row_e8m0(q + r * cols, sc + (r / 128) * gc, cols, d + r * cols);
        free(q);
        free(sc);
        t_push(l, full, MOE_DTYPE_F32, 2, rows, cols, d);
        return;
    }
    uint8_t *q = malloc((size_t)(rows * cols / 2)), *sc = malloc((size_t)(rows * cols / 32));
    for (int64_t r = 0; r < rows; r++)
        moe_mxfp4_quant_row(v + r * cols, cols, MOE_MX_SCALE_CEIL, MOE_E2M1_RNE, q + r * cols / 2, sc + r * cols / 32);
    if (quant == 1) {
        char sname[128];
        snprintf(sname, sizeof sname, "%.*s.scale", (int)(strlen(full) - 7), full);
        t_push(l, full, MOE_DTYPE_I8, 2, rows, cols / 2, q);
        t_push(l, sname, MOE_DTYPE_F8_E8M0, 2, rows, cols / 32, sc);
        return;
    }
    float *d = malloc((size_t)(rows * cols) * sizeof *d);
    for (int64_t r = 0; r < rows; r++) moe_mxfp4_dequant_row(q + r * cols / 2, sc + r * cols / 32, cols, d + r * cols);
    free(q);
    free(sc);
    t_push(l, full, MOE_DTYPE_F32, 2, rows, cols, d);
}

static void t_add(tlist *l, const synth *sy, const char *name, moe_dtype dt, int ndim, int64_t d0, int64_t d1,
                  double scale, double offset, uint64_t *rng) {
    char full[128];
    bool model_prefix = sy->hf_names && strcmp(name, "head.weight") != 0;
    snprintf(full, sizeof full, "%s%s", model_prefix ? "model." : "", name);
    if (sy->drop && !strcmp(sy->drop, full)) return;
    MOE_ASSERT(l->n < 512);
    moe_st_entry *e = &l->e[l->n];
    snprintf(l->names[l->n], sizeof l->names[0], "%s", full);
    e->name = l->names[l->n];
    e->dtype = dt;
    e->ndim = ndim;
    e->shape[0] = d0;
    e->shape[1] = d1;
    int64_t n = ndim == 1 ? d0 : d0 * d1;
    void *b = malloc((size_t)n * 8 + 8);
    for (int64_t i = 0; i < n; i++) {
        double v = offset + scale * moe_t_rng_normal(rng);
        if (dt == MOE_DTYPE_BF16) ((uint16_t *)b)[i] = moe_bf16_from_f32((float)v);
        else if (dt == MOE_DTYPE_F32) ((float *)b)[i] = (float)v;
        else ((int64_t *)b)[i] = 0;
    }
    e->data = b;
    l->bufs[l->n++] = b;
    const int fmt = sy->quant && ndim == 2 && dt == MOE_DTYPE_BF16 ? release_fmt(full) : 0;
    if (fmt) {
        /* the BF16 values just drawn, in the release's format */
        float *v = malloc((size_t)n * sizeof *v);
        for (int64_t i = 0; i < n; i++) v[i] = moe_bf16_to_f32(((uint16_t *)b)[i]);
        free(b);
        l->n--;
        t_add_quant(l, full, fmt, sy->quant, v, d0, d1);
        free(v);
    }
}

/* One block (attention + MoE + both mHC) under prefix pfx ("layers.3", "mtp.0"). */
static void write_block(tlist *l, const synth *sy, const char *pfx, int r, bool hash, uint64_t rng) {
    const moe_dtype B = MOE_DTYPE_BF16, F = MOE_DTYPE_F32;
    const double sH = 1.0 / sqrt((double)SY_H);
    char nm[96];
#define P(fmt) (snprintf(nm, sizeof nm, "%s." fmt, pfx), nm)
    t_add(l, sy, P("attn_norm.weight"), B, 1, SY_H, 0, 0.1, 1.0, &rng);
    t_add(l, sy, P("ffn_norm.weight"), B, 1, SY_H, 0, 0.1, 1.0, &rng);
    t_add(l, sy, P("attn.wq_a.weight"), B, 2, SY_QL, SY_H, sH, 0, &rng);
    t_add(l, sy, P("attn.q_norm.weight"), B, 1, SY_QL, 0, 0.1, 1.0, &rng);
    t_add(l, sy, P("attn.wq_b.weight"), B, 2, SY_HEADS * SY_HD, SY_QL, 1.0 / sqrt((double)SY_QL), 0, &rng);
    t_add(l, sy, P("attn.wkv.weight"), B, 2, SY_HD, SY_H, sH, 0, &rng);
    t_add(l, sy, sy->hf_names ? P("attn.norm.weight") : P("attn.kv_norm.weight"), B, 1, SY_HD, 0, 0.1, 1.0, &rng);
    t_add(l, sy, P("attn.wo_a.weight"), B, 2, SY_G * SY_OL, SY_HEADS * SY_HD / SY_G, 0.12, 0, &rng);
    t_add(l, sy, P("attn.wo_b.weight"), B, 2, SY_H, SY_G * SY_OL, 0.18, 0, &rng);
    t_add(l, sy, P("attn.attn_sink"), F, 1, SY_HEADS, 0, 1.0, 0, &rng);
    if (r) {
        int coff = r == 4 ? 2 : 1;
        t_add(l, sy, P("attn.compressor.wkv.weight"), B, 2, coff * SY_HD, SY_H, sH, 0, &rng);
        t_add(l, sy, P("attn.compressor.wgate.weight"), B, 2, coff * SY_HD, SY_H, sH, 0, &rng);
        t_add(l, sy, P("attn.compressor.ape"), F, 2, r, coff * SY_HD, 0.5, 0, &rng);
        t_add(l, sy, P("attn.compressor.norm.weight"), B, 1, SY_HD, 0, 0.1, 1.0, &rng);
    }
    if (r == 4) {
        t_add(l, sy, P("attn.indexer.wq_b.weight"), B, 2, SY_IH * SY_ID, SY_QL, 1.0 / sqrt((double)SY_QL), 0, &rng);
        t_add(l, sy, P("attn.indexer.weights_proj.weight"), B, 2, SY_IH, SY_H, sH, 0, &rng);
        t_add(l, sy, P("attn.indexer.compressor.wkv.weight"), B, 2, 2 * SY_ID, SY_H, sH, 0, &rng);
        t_add(l, sy, P("attn.indexer.compressor.wgate.weight"), B, 2, 2 * SY_ID, SY_H, sH, 0, &rng);
        t_add(l, sy, P("attn.indexer.compressor.ape"), F, 2, 4, 2 * SY_ID, 0.5, 0, &rng);
        t_add(l, sy, P("attn.indexer.compressor.norm.weight"), B, 1, SY_ID, 0, 0.1, 1.0, &rng);
    }
    for (int site = 0; site < 2; site++) {
        const char *sn = site ? "ffn" : "attn";
        snprintf(nm, sizeof nm, "%s.hc_%s_fn", pfx, sn);
        t_add(l, sy, nm, F, 2, (2 + SY_HC) * SY_HC, SY_HC * SY_H, 0.05, 0, &rng);
        snprintf(nm, sizeof nm, "%s.hc_%s_base", pfx, sn);
        t_add(l, sy, nm, F, 1, (2 + SY_HC) * SY_HC, 0, 0.5, 0, &rng);
        snprintf(nm, sizeof nm, "%s.hc_%s_scale", pfx, sn);
        t_add(l, sy, nm, F, 1, 3, 0, 0.2, 1.0, &rng);
    }
    t_add(l, sy, P("ffn.gate.weight"), B, 2, SY_E, SY_H, sH, 0, &rng);
    if (hash) {
        int before = l->n;
        t_add(l, sy, P("ffn.gate.tid2eid"), MOE_DTYPE_I64, 2, SY_V, SY_K, 0, 0, &rng);
        if (l->n > before) {
            int64_t *ids = (int64_t *)l->bufs[l->n - 1];
            for (int v = 0; v < SY_V; v++) {
                int64_t a = (int64_t)(moe_splitmix64(&rng) % SY_E),
                        b = (a + 1 + (int64_t)(moe_splitmix64(&rng) % (SY_E - 1))) % SY_E;
                ids[v * SY_K] = a;
                ids[v * SY_K + 1] = b;
            }
        }
    } else {
        t_add(l, sy, P("ffn.gate.bias"), F, 1, SY_E, 0, 0.1, 0, &rng);
    }
    for (int e = -1; e < SY_E; e++) {
        char base[64];
        if (e < 0) snprintf(base, sizeof base, "%s.ffn.shared_experts", pfx);
        else snprintf(base, sizeof base, "%s.ffn.experts.%d", pfx, e);
        snprintf(nm, sizeof nm, "%s.w1.weight", base);
        t_add(l, sy, nm, B, 2, SY_I, SY_H, sH, 0, &rng);
        snprintf(nm, sizeof nm, "%s.w3.weight", base);
        t_add(l, sy, nm, B, 2, SY_I, SY_H, sH, 0, &rng);
        snprintf(nm, sizeof nm, "%s.w2.weight", base);
        t_add(l, sy, nm, B, 2, SY_H, SY_I, 1.0 / sqrt((double)SY_I), 0, &rng);
    }
#undef P
}

/* A head (final norm + hc head) under the given names, drawn from rng. */
static void write_head(tlist *l, const synth *sy, const char *norm, const char *fn, const char *base, const char *scale,
                       uint64_t rng) {
    t_add(l, sy, norm, MOE_DTYPE_BF16, 1, SY_H, 0, 0.1, 1.0, &rng);
    t_add(l, sy, fn, MOE_DTYPE_F32, 2, SY_HC, SY_HC * SY_H, 0.05, 0, &rng);
    t_add(l, sy, base, MOE_DTYPE_F32, 1, SY_HC, 0, 0.5, 0, &rng);
    t_add(l, sy, scale, MOE_DTYPE_F32, 1, 1, 0, 0.2, 1.0, &rng);
}

/* [H, H]: 0 zero, 1 identity (exact in BF16). */
static void t_add_const(tlist *l, const char *name, int kind) {
    uint16_t *b = calloc((size_t)SY_H * SY_H, sizeof *b);
    for (int i = 0; kind == 1 && i < SY_H; i++) b[i * SY_H + i] = moe_bf16_from_f32(1.0f);
    t_push(l, name, MOE_DTYPE_BF16, 2, SY_H, SY_H, b);
}

static void write_synth(const char *dir, const synth *sy) {
    char path[4200];
    snprintf(path, sizeof path, "mkdir -p '%s'", dir);
    MOE_ASSERT(system(path) == 0);
    uint64_t rng = sy->seed;
    tlist *l = calloc(1, sizeof *l);
    const moe_dtype B = MOE_DTYPE_BF16;
    const double sH = 1.0 / sqrt((double)SY_H);
    t_add(l, sy, sy->hf_names ? "embed_tokens.weight" : "embed.weight", B, 2, SY_V, SY_H, 1.0, 0, &rng);
    t_add(l, sy, "head.weight", B, 2, SY_V, SY_H, sH, 0, &rng);
    /* the main head; the twin of an MTP model carries the MTP block's head instead */
    write_head(l, sy, "norm.weight", sy->hf_names ? "hc_head.hc_fn" : "hc_head_fn",
               sy->hf_names ? "hc_head.hc_base" : "hc_head_base", sy->hf_names ? "hc_head.hc_scale" : "hc_head_scale",
               sy->mtp_as_layer ? sy->seed + 6000 : sy->seed + 8000);
    const int nl = sy->n_layers + (sy->mtp_as_layer ? 1 : 0);
    for (int i = 0; i < nl; i++) {
        char pfx[32];
        snprintf(pfx, sizeof pfx, "layers.%d", i);
        bool twin = sy->mtp_as_layer && i == sy->n_layers;
        write_block(l, sy, pfx, twin ? sy->mtp_ratio : sy->ratio[i], i < sy->hash_layers,
                    twin ? sy->seed + 5000 : sy->seed + 1000 + (uint64_t)i);
    }
    if (sy->mtp) {
        write_block(l, sy, "mtp.0", sy->mtp_ratio, false, sy->seed + 5000);
        write_head(l, sy, "mtp.0.norm.weight", "mtp.0.hc_head_fn", "mtp.0.hc_head_base", "mtp.0.hc_head_scale",
                   sy->seed + 6000);
        uint64_t r2 = sy->seed + 7000;
        t_add(l, sy, "mtp.0.enorm.weight", B, 1, SY_H, 0, 0.1, 1.0, &r2);
        t_add(l, sy, "mtp.0.hnorm.weight", B, 1, SY_H, 0, 0.1, 1.0, &r2);
        if (sy->mtp_mode == 0) {
            t_add(l, sy, "mtp.0.e_proj.weight", B, 2, SY_H, SY_H, sH, 0, &r2);
            t_add(l, sy, "mtp.0.h_proj.weight", B, 2, SY_H, SY_H, sH, 0, &r2);
        } else {
            t_add_const(l, "mtp.0.e_proj.weight", sy->mtp_mode == 2);
            t_add_const(l, "mtp.0.h_proj.weight", sy->mtp_mode == 1);
        }
    }
    /* shards: contiguous runs of the tensor list */
    moe_error err;
    int ns = sy->n_shards > 1 ? sy->n_shards : 1;
    FILE *idx = NULL;
    if (ns > 1) {
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        idx = fopen(path, "w");
        fprintf(idx, "{\"metadata\": {}, \"weight_map\": {");
    }
    for (int k = 0; k < ns; k++) {
        int a = l->n * k / ns, b = l->n * (k + 1) / ns;
        char file[64];
        if (ns > 1) snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", k + 1, ns);
        else snprintf(file, sizeof file, "model.safetensors");
        snprintf(path, sizeof path, "%s/%s", dir, file);
        moe_status st = moe_st_write(path, l->e + a, (size_t)(b - a), NULL, &err);
        CHECK_OK(st, err);
        for (int i = a; idx && i < b; i++) fprintf(idx, "%s\"%s\": \"%s\"", i ? ", " : "", l->e[i].name, file);
    }
    if (idx) {
        fprintf(idx, "}}\n");
        fclose(idx);
    }
    for (int i = 0; i < l->n; i++) free(l->bufs[i]);
    free(l);

    snprintf(path, sizeof path, "%s/config.json", dir);
    FILE *c = fopen(path, "w");
    fprintf(c, "{\n  \"architectures\": [\"DeepseekV4ForCausalLM\"], \"model_type\": \"deepseek_v4\",\n");
    fprintf(c, "  \"hidden_size\": %d, \"vocab_size\": %d, \"num_hidden_layers\": %d, \"num_attention_heads\": %d,\n",
            SY_H, SY_V, sy->n_layers + (sy->mtp_as_layer ? 1 : 0), SY_HEADS);
    fprintf(c, "  \"num_key_value_heads\": 1, \"head_dim\": %d, \"q_lora_rank\": %d, \"o_groups\": %d, \"o_lora_rank\": %d,\n",
            SY_HD, SY_QL, SY_G, SY_OL);
    fprintf(c, "  \"sliding_window\": %d, \"index_n_heads\": %d, \"index_head_dim\": %d, \"index_topk\": %d,\n", SY_WIN,
            SY_IH, SY_ID, SY_TOPK);
    fprintf(c, "  \"hc_mult\": %d, \"hc_sinkhorn_iters\": 20, \"hc_eps\": 1e-06, \"rms_norm_eps\": 1e-06,\n", SY_HC);
    fprintf(c, "  \"moe_intermediate_size\": %d, \"n_routed_experts\": %d, \"n_shared_experts\": 1, \"num_experts_per_tok\": %d,\n",
            SY_I, SY_E, SY_K);
    fprintf(c, "  \"norm_topk_prob\": true, \"routed_scaling_factor\": 1.5, \"scoring_func\": \"sqrtsoftplus\", \"swiglu_limit\": 3.0,\n");
    fprintf(c, "  \"max_position_embeddings\": 1048576, \"rope_theta\": 10000.0, \"compress_rope_theta\": 160000.0,\n");
    if (sy->native_schema) {
        fprintf(c, "  \"qk_rope_head_dim\": %d, \"num_hash_layers\": %d,\n", SY_ROPE, sy->hash_layers);
        fprintf(c, "  \"rope_scaling\": {\"beta_fast\": 32, \"beta_slow\": 1, \"factor\": 16, "
                   "\"original_max_position_embeddings\": 65536, \"type\": \"yarn\"},\n");
        fprintf(c, "  \"compress_ratios\": [");
        for (int i = 0; i < sy->n_layers; i++) fprintf(c, "%d, ", sy->ratio[i]);
        if (sy->mtp_as_layer) fprintf(c, "%d, ", sy->mtp_ratio);
        fprintf(c, "%d]", sy->mtp ? sy->mtp_ratio : 0);
    } else {
        double prf = (double)SY_ROPE / SY_HD;
        int csa = 4, hca = 0;
        for (int i = 0; i < sy->n_layers; i++)
            if (sy->ratio[i] && sy->ratio[i] != 4) hca = sy->ratio[i];
        fprintf(c, "  \"partial_rotary_factor\": %.17g,\n", prf);
        fprintf(c, "  \"compress_rates\": {\"compressed_sparse_attention\": %d, \"heavily_compressed_attention\": %d},\n",
                csa, hca ? hca : 128);
        fprintf(c, "  \"layer_types\": [");
        for (int i = 0; i < sy->n_layers; i++)
            fprintf(c, "%s\"%s\"", i ? ", " : "",
                    sy->ratio[i] == 0 ? "sliding_attention" : sy->ratio[i] == 4 ? "compressed_sparse_attention"
                                                                             : "heavily_compressed_attention");
        fprintf(c, "],\n  \"mlp_layer_types\": [");
        for (int i = 0; i < sy->n_layers; i++) fprintf(c, "%s\"%s\"", i ? ", " : "", i < sy->hash_layers ? "hash_moe" : "moe");
        fprintf(c, "],\n  \"rope_parameters\": {\"main\": {\"rope_type\": \"default\", \"rope_theta\": 10000.0, "
                   "\"partial_rotary_factor\": %.17g},\n    \"compress\": {\"rope_type\": \"yarn\", \"rope_theta\": 160000.0, "
                   "\"factor\": 16, \"original_max_position_embeddings\": 65536, \"beta_fast\": 32, \"beta_slow\": 1, "
                   "\"attention_factor\": 1.0, \"partial_rotary_factor\": %.17g}}", prf, prf);
    }
    if (sy->config_extra) fprintf(c, ",\n  %s", sy->config_extra);
    fprintf(c, "\n}\n");
    fclose(c);
}

static synth synth_default(void) {
    synth s;
    memset(&s, 0, sizeof s);
    s.native_schema = true;
    s.n_layers = 4;
    s.ratio[0] = 0;  /* sliding */
    s.ratio[1] = 4;  /* CSA */
    s.ratio[2] = 8;  /* HCA, small enough to emit */
    s.ratio[3] = 4;  /* CSA */
    s.hash_layers = 1;
    s.seed = 7;
    return s;
}

static int64_t *synth_ids(int64_t T, uint64_t seed) {
    int64_t *ids = malloc((size_t)T * sizeof *ids);
    for (int64_t t = 0; t < T; t++) ids[t] = (int64_t)(moe_splitmix64(&seed) % SY_V);
    return ids;
}

/* Every streamed tensor of a and b equal (bitwise when tol = 0). */
static double compare_runs(const collect *a, const collect *b, int n_layers, const char *what) {
    double worst = 0;
    for (int l = 0; l <= MAXL; l++) {
        if (l >= n_layers && l != MAXL) continue;
        for (int w = 0; w < 8; w++) {
            if (w == MOE_FWD_INDEX_TOPK) {
                if (l < MAXL && (a->topk[l] || b->topk[l])) {
                    bool same = a->topk[l] && b->topk[l] && a->elems[l][w] == b->elems[l][w] &&
                                !memcmp(a->topk[l], b->topk[l], (size_t)(a->T * a->elems[l][w]) * sizeof(int32_t));
                    CHECK(same, "%s: layer %d index_topk differ", what, l);
                }
                continue;
            }
            if (!a->d[l][w] && !b->d[l][w]) continue;
            CHECK(a->d[l][w] && b->d[l][w] && a->elems[l][w] == b->elems[l][w], "%s: layer %d %s streamed by both",
                  what, l, moe_fwd_what_name((moe_fwd_what)w));
            if (!a->d[l][w] || !b->d[l][w]) continue;
            worst = fmax(worst, max_rel(a->d[l][w], b->d[l][w], a->T * a->elems[l][w]));
        }
    }
    return worst;
}

/* In float64 every split of a sequence into chunks gives the one-shot
 * outputs: prefill then decode, boundaries inside windows of 4 and 8, chunk
 * lengths = 1, 2, 3 mod 4, one token at a time. The per-token arithmetic is
 * the same sequence whatever the chunking (src/attn invariants), so the
 * outputs are bitwise equal; the index sets identical. */
static void test_chunks(void) {
    char dir[512];
    moe_t_tmp_path(dir, sizeof dir, "synth-native");
    synth sy = synth_default();
    write_synth(dir, &sy);
    moe_error err;
    moe_fwd *f = NULL;
    moe_status st = moe_fwd_open(dir, &f, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    const moe_fwd_config *c = moe_fwd_get_config(f);
    CHECK(c->attn[0] == MOE_ATTN_SLIDING && c->attn[1] == MOE_ATTN_CSA && c->attn[2] == MOE_ATTN_HCA && c->ratio[2] == 8 &&
          c->rope_compress.yarn && c->native_schema, "synthetic config");
    const int64_t T = 45;
    int64_t *ids = synth_ids(T, 11);
    moe_fwd_opts o = moe_fwd_opts_default(f);
    collect one, ch;
    int64_t all[1] = {T};
    st = run_chunks(f, &o, ids, T, all, 1, &one, &err);
    CHECK_OK(st, err);
    /* the indexer really discards entries: some query keeps index_topk of more visible */
    int kept_of_more = 0;
    for (int64_t t = 0; one.topk[1] && t < T; t++)
        kept_of_more += (t + 1) / 4 > SY_TOPK && one.topk[1][t * SY_TOPK + SY_TOPK - 1] >= 0;
    CHECK(kept_of_more > 20, "the indexer selects on %d queries", kept_of_more);
    static const int64_t splits[][12] = {
        {41, 1, 1, 1, 1},              /* prefill + decode */
        {13, 14, 18},                  /* 13 = 1 mod 4, 14 = 2 mod 4, boundaries inside windows */
        {3, 7, 11, 24},                /* 3 mod 4 each */
        {5, 6, 1, 2, 9, 22},
        {8, 8, 8, 8, 8, 5},            /* on the HCA window */
        {44, 1},
    };
    const int n_splits[] = {5, 3, 4, 6, 6, 2};
    for (int k = 0; st == MOE_OK && k < (int)(sizeof n_splits / sizeof n_splits[0]); k++) {
        st = run_chunks(f, &o, ids, T, splits[k], n_splits[k], &ch, &err);
        CHECK_OK(st, err);
        char what[32];
        snprintf(what, sizeof what, "split %d", k);
        double e = compare_runs(&ch, &one, c->n_layers, what);
        CHECK(e == 0, "%s: chunked differs from one shot by %g", what, e);
        collect_free(&ch);
    }
    /* one token at a time */
    int64_t ones[45];
    for (int i = 0; i < 45; i++) ones[i] = 1;
    st = run_chunks(f, &o, ids, T, ones, 45, &ch, &err);
    CHECK_OK(st, err);
    CHECK(compare_runs(&ch, &one, c->n_layers, "token by token") == 0, "token by token differs");
    collect_free(&ch);
    collect_free(&one);
    free(ids);
    moe_fwd_free(f);
}

/* Both config schemas (DeepSeek's compress_ratios / rope_scaling /
 * num_hash_layers; transformers' layer_types / compress_rates /
 * rope_parameters / mlp_layer_types) and both namings, sharded or not,
 * describe the same model: identical outputs. */
static void test_schemas_and_names(void) {
    char d1[512], d2[512];
    moe_t_tmp_path(d1, sizeof d1, "synth-a");
    moe_t_tmp_path(d2, sizeof d2, "synth-b");
    synth a = synth_default(), b = synth_default();
    b.native_schema = false;
    b.hf_names = true;
    b.n_shards = 3;
    write_synth(d1, &a);
    write_synth(d2, &b);
    moe_error err;
    moe_fwd *fa = NULL, *fb = NULL;
    CHECK_OK(moe_fwd_open(d1, &fa, &err), err);
    moe_status st = moe_fwd_open(d2, &fb, &err);
    CHECK_OK(st, err);
    if (!fa || !fb) { moe_fwd_free(fa); moe_fwd_free(fb); return; }
    const moe_fwd_config *ca = moe_fwd_get_config(fa), *cb = moe_fwd_get_config(fb);
    CHECK(!cb->native_schema && ca->native_schema, "schemas detected");
    CHECK(ca->rope_compress.yarn && cb->rope_compress.yarn && ca->rope_compress.factor == cb->rope_compress.factor &&
          ca->rope_compress.attention_factor == 1.0 && cb->rope_compress.attention_factor == 1.0 &&
          !ca->rope_main.yarn && !cb->rope_main.yarn && ca->rope_dim == cb->rope_dim, "rope configs agree");
    for (int i = 0; i < ca->n_layers; i++)
        CHECK(ca->attn[i] == cb->attn[i] && ca->ratio[i] == cb->ratio[i], "layer %d type", i);
    const int64_t T = 30;
    int64_t *ids = synth_ids(T, 5);
    moe_fwd_opts oa = moe_fwd_opts_default(fa), ob = moe_fwd_opts_default(fb);
    collect ra, rb;
    int64_t all[1] = {T};
    st = run_chunks(fa, &oa, ids, T, all, 1, &ra, &err);
    CHECK_OK(st, err);
    st = run_chunks(fb, &ob, ids, T, all, 1, &rb, &err);
    CHECK_OK(st, err);
    CHECK(compare_runs(&ra, &rb, ca->n_layers, "schemas") == 0, "the two schemas and namings differ");
    collect_free(&ra);
    collect_free(&rb);
    free(ids);
    moe_fwd_free(fa);
    moe_fwd_free(fb);
}

/* --precision f32 against the float64 reference. float32's unit roundoff
 * is u = 2^-24 = 6e-8. Along any dependency path of a 4-layer model a value
 * passes through at most a few thousand float32 roundings (sequential sums
 * of up to hc_mult * H = 384 products in the mHC linear, the norms, softmax
 * and 20 Sinkhorn rounds per sublayer); rounding errors that behave like a
 * random walk grow as sqrt(4000) u = 4e-6 (measured: 1.5e-6 on dsv4-tiny).
 * 2e-5 allows 5x that; a float64-only bug (a missed conversion, a path that
 * stays in double) shows as 0, and a wrong formula as 1e-2. Index sets must
 * agree: no score of these models lies within 1e-5 of its row's cut. */
#define TOL_F32_VS_REF 2e-5

static void f32_vs_ref(const char *dir, const int64_t *ids, int64_t T, const char *what) {
    moe_error err;
    moe_fwd *f = NULL;
    moe_status st = moe_fwd_open(dir, &f, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    moe_fwd_opts o = moe_fwd_opts_default(f);
    collect r, q;
    int64_t all[1] = {T};
    st = run_chunks(f, &o, ids, T, all, 1, &r, &err);
    CHECK_OK(st, err);
    o.precision = MOE_PREC_F32;
    st = run_chunks(f, &o, ids, T, all, 1, &q, &err);
    CHECK_OK(st, err);
    double e = compare_runs(&q, &r, moe_fwd_get_config(f)->n_layers, what);
    printf("  %s: f32 vs ref, max rel over every tensor %.3g\n", what, e);
    CHECK(e < TOL_F32_VS_REF && e > 0, "%s: f32 vs ref %g", what, e);
    /* the f32 values are floats */
    bool floats = true;
    for (int64_t i = 0; q.d[MAXL][MOE_FWD_LOGITS] && i < T * q.elems[MAXL][MOE_FWD_LOGITS]; i++)
        floats &= q.d[MAXL][MOE_FWD_LOGITS][i] == (double)(float)q.d[MAXL][MOE_FWD_LOGITS][i];
    CHECK(floats, "%s: f32 logits are float values", what);
    collect_free(&r);
    collect_free(&q);
    moe_fwd_free(f);
}

static void test_f32(void) {
    oracle o;
    if (oracle_open(&o)) {
        f32_vs_ref(moe_t_data("dsv4-tiny"), o.ids, o.T, "dsv4-tiny");
        oracle_close(&o);
    }
    char dir[512];
    moe_t_tmp_path(dir, sizeof dir, "synth-f32");
    synth sy = synth_default();
    write_synth(dir, &sy);
    int64_t *ids = synth_ids(45, 11);
    f32_vs_ref(dir, ids, 45, "synthetic");
    free(ids);
}

/* The V4-Flash release layout: FP8 E4M3 weights with E8M0 128x128 scales
 * (attention, the indexer's wq_b, the shared expert; wo_a's groups of 16
 * rows straddle a 128-row tile), MXFP4 I8 experts with E8M0 per 32, BF16
 * compressors / weights_proj / router, F32 ape / sink / mHC, native names,
 * sharded. Its forward must equal, bit for bit, the forward of a checkpoint
 * holding the same decoded values in F32: the weights stay mapped in their
 * formats and decode exactly, and the arithmetic does not depend on the
 * storage. */
static void test_release_layout(void) {
    char dq[512], dd[512];
    moe_t_tmp_path(dq, sizeof dq, "synth-release");
    moe_t_tmp_path(dd, sizeof dd, "synth-decoded");
    synth q = synth_default(), d = synth_default();
    q.quant = 1;
    q.n_shards = 4;
    d.quant = 2;
    write_synth(dq, &q);
    write_synth(dd, &d);
    moe_error err;
    moe_st_file *sh = NULL;
    char path[600];
    snprintf(path, sizeof path, "%s/model-00001-of-00004.safetensors", dq);
    CHECK_OK(moe_st_open(path, &sh, &err), err);
    const moe_st_tensor *t = sh ? moe_st_find(sh, "layers.0.attn.wq_a.scale") : NULL;
    CHECK(t && t->dtype == MOE_DTYPE_F8_E8M0, "the release layout has E8M0 scales");
    moe_st_close(sh);
    moe_fwd *fq = NULL, *fd = NULL;
    CHECK_OK(moe_fwd_open(dq, &fq, &err), err);
    CHECK_OK(moe_fwd_open(dd, &fd, &err), err);
    if (!fq || !fd) { moe_fwd_free(fq); moe_fwd_free(fd); return; }
    const int64_t T = 37;
    int64_t *ids = synth_ids(T, 3);
    collect a, b;
    int64_t all[1] = {T}, parts[3] = {20, 16, 1};
    moe_fwd_opts oq = moe_fwd_opts_default(fq), od = moe_fwd_opts_default(fd);
    CHECK_OK(run_chunks(fq, &oq, ids, T, parts, 3, &a, &err), err);
    CHECK_OK(run_chunks(fd, &od, ids, T, all, 1, &b, &err), err);
    CHECK(compare_runs(&a, &b, 4, "release layout") == 0, "release layout differs from its decoded values");
    collect_free(&a);
    collect_free(&b);
    free(ids);
    moe_fwd_free(fq);
    moe_fwd_free(fd);
}

/* The CPU kernel table (moe_fwd_opts.isa) on the release layout (FP8,
 * MXFP4, BF16 and F32 weights: every decoder and tile): in float64 every
 * table the CPU has gives the AUTO run's bits (the float64 tiles share one
 * summation order); in float32 each is within TOL_F32_VS_REF of float64. An
 * ISA this CPU lacks, or a value outside the enum, is refused before
 * anything runs. */
static void test_isa(void) {
    char dir[512];
    moe_t_tmp_path(dir, sizeof dir, "synth-isa");
    synth sy = synth_default();
    sy.quant = 1;
    write_synth(dir, &sy);
    moe_error err;
    moe_fwd *f = NULL;
    CHECK_OK(moe_fwd_open(dir, &f, &err), err);
    if (!f) return;
    const int nl = moe_fwd_get_config(f)->n_layers;
    const int64_t T = 29;
    int64_t *ids = synth_ids(T, 5);
    int64_t all[1] = {T};
    moe_fwd_opts o = moe_fwd_opts_default(f);
    collect auto64;
    CHECK_OK(run_chunks(f, &o, ids, T, all, 1, &auto64, &err), err);
    static const moe_isa isas[] = {MOE_ISA_REF, MOE_ISA_AVX2, MOE_ISA_AVX512, MOE_ISA_AMX};
    int ran = 0;
    for (int k = 0; k < (int)(sizeof isas / sizeof isas[0]); k++) {
        moe_isa taken;
        moe_error e2;
        o = moe_fwd_opts_default(f);
        o.isa = isas[k];
        collect c;
        if (moe_isa_resolve(isas[k], &taken, &e2) != MOE_OK) {
            moe_status st = run_chunks(f, &o, ids, T, all, 1, &c, &err);
            CHECK(st == MOE_ERR_UNSUPPORTED && strstr(err.msg, "avail"), "isa %s on a CPU without it: %s (%s)",
                  moe_isa_name(isas[k]), moe_status_str(st), err.msg);
            collect_free(&c);
            printf("  isa %s: not on this CPU (refused, as it must be)\n", moe_isa_name(isas[k]));
            continue;
        }
        ran++;
        CHECK_OK(run_chunks(f, &o, ids, T, all, 1, &c, &err), err);
        CHECK(compare_runs(&c, &auto64, nl, moe_isa_name(isas[k])) == 0, "isa %s: float64 differs from AUTO's",
              moe_isa_name(isas[k]));
        collect_free(&c);
        o.precision = MOE_PREC_F32;
        CHECK_OK(run_chunks(f, &o, ids, T, all, 1, &c, &err), err);
        double e = compare_runs(&c, &auto64, nl, moe_isa_name(isas[k]));
        printf("  isa %s: float64 = AUTO's bits; f32 vs float64 max rel %.3g\n", moe_isa_name(isas[k]), e);
        CHECK(e < TOL_F32_VS_REF && e > 0, "isa %s: f32 vs ref %g", moe_isa_name(isas[k]), e);
        collect_free(&c);
    }
    CHECK(ran >= 2, "at least ref and avx2 ran (%d tables)", ran);
    o = moe_fwd_opts_default(f);
    o.isa = (moe_isa)99;
    collect c;
    CHECK(run_chunks(f, &o, ids, T, all, 1, &c, &err) == MOE_ERR_ARG, "isa 99 refused: %s", err.msg);
    collect_free(&c);
    collect_free(&auto64);
    free(ids);
    moe_fwd_free(f);
}

/* Bad input: clear errors naming the tensor, file or value, nothing run. */
static void patch_file(const char *path, const char *from, const char *to) {
    static char buf[1 << 16], out[1 << 16];
    MOE_ASSERT(moe_t_read_file(path, buf, sizeof buf));
    char *at = strstr(buf, from);
    MOE_ASSERT(at);
    snprintf(out, sizeof out, "%.*s%s%s", (int)(at - buf), buf, to, at + strlen(from));
    FILE *f = fopen(path, "w");
    fputs(out, f);
    fclose(f);
}

static void test_bad_input(void) {
    char dir[512], cfg[600];
    moe_error err;
    moe_fwd *f = NULL;
    moe_t_tmp_path(dir, sizeof dir, "synth-bad");
    synth sy = synth_default();
    write_synth(dir, &sy);
    CHECK_OK(moe_fwd_open(dir, &f, &err), err);
    if (!f) return;
    moe_fwd_opts o = moe_fwd_opts_default(f);
    moe_fwd_state *s = NULL;
    CHECK_OK(moe_fwd_state_init(f, &o, &s, &err), err);
    int64_t ids[4] = {1, 2, 300, 4};
    moe_status st = moe_fwd_run(f, s, ids, 0, NULL, &err);
    CHECK(st == MOE_ERR_INPUT && strstr(err.msg, "0 tokens"), "T = 0: %s", err.msg);
    st = moe_fwd_run(f, s, ids, 4, NULL, &err);
    CHECK(st == MOE_ERR_INPUT && strstr(err.msg, "input_ids[2] = 300") && strstr(err.msg, "97"), "id >= vocab: %s",
          err.msg);
    moe_fwd_state_free(s);
    /* layer ranges */
    o.last_layer = 9;
    st = moe_fwd_state_init(f, &o, &s, &err);
    CHECK(st == MOE_ERR_ARG && strstr(err.msg, "0..9") && strstr(err.msg, "4 layers"), "range: %s", err.msg);
    o.last_layer = 2;
    st = moe_fwd_state_init(f, &o, &s, &err);
    CHECK(st == MOE_ERR_ARG && strstr(err.msg, "logits"), "logits without the last layer: %s", err.msg);
    o.logits = false;
    o.first_layer = 3;
    st = moe_fwd_state_init(f, &o, &s, &err);
    CHECK(st == MOE_ERR_ARG, "first > last: %s", err.msg);
    moe_fwd_free(f);
    /* no index, a second shard that cannot be read: the MTP probe (native
     * names, no MTP block, so every root tensor is found in the first shard
     * and only the probe reads the second) is that shard's error, never "no
     * MTP block" */
    {
        char a[700], b[700];
        snprintf(a, sizeof a, "%s/model.safetensors", dir);
        snprintf(b, sizeof b, "%s/a.safetensors", dir);
        CHECK(rename(a, b) == 0, "rename %s", a);
        snprintf(b, sizeof b, "%s/b.safetensors", dir);
        FILE *fb = fopen(b, "wb");
        if (fb) {
            fwrite("\xff\0\0\0\0\0\0\0{}", 1, 10, fb);
            fclose(fb);
        }
        moe_fwd *fc = NULL;
        st = moe_fwd_open(dir, &fc, &err);
        CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "b.safetensors") && strstr(err.msg, "mtp.0"),
              "MTP probe on a corrupt shard: %s: %s", moe_status_str(st), err.msg);
        moe_fwd_free(fc);
        unlink(b);
        snprintf(b, sizeof b, "%s/a.safetensors", dir);
        CHECK(rename(b, a) == 0, "rename back %s", b);
    }

    /* a missing attention tensor, named, before anything runs */
    moe_t_tmp_path(dir, sizeof dir, "synth-missing");
    sy.drop = "layers.2.attn.compressor.ape";
    write_synth(dir, &sy);
    CHECK_OK(moe_fwd_open(dir, &f, &err), err);
    if (f) {
        o = moe_fwd_opts_default(f);
        collect c;
        int64_t T = 8;
        int64_t *tid = synth_ids(T, 1);
        st = run_chunks(f, &o, tid, T, &T, 1, &c, &err);
        CHECK(st == MOE_ERR_MISSING && strstr(err.msg, "layers.2.attn.compressor.ape") && strstr(err.msg, dir),
              "missing tensor: %s", err.msg);
        CHECK(c.rows_seen[0][MOE_FWD_IN] == 0, "nothing ran before the error");
        collect_free(&c);
        free(tid);
        moe_fwd_free(f);
    }
    sy.drop = "head.weight";
    moe_t_tmp_path(dir, sizeof dir, "synth-nohead");
    write_synth(dir, &sy);
    st = moe_fwd_open(dir, &f, &err);
    CHECK(st == MOE_ERR_MISSING && strstr(err.msg, "head.weight") && strstr(err.msg, "LM head"), "no head: %s", err.msg);
    sy.drop = NULL;

    /* config and tensors disagree: q_lora_rank 20 for [24, 64] tensors */
    moe_t_tmp_path(dir, sizeof dir, "synth-disagree");
    write_synth(dir, &sy);
    snprintf(cfg, sizeof cfg, "%s/config.json", dir);
    patch_file(cfg, "\"q_lora_rank\": 24", "\"q_lora_rank\": 20");
    CHECK_OK(moe_fwd_open(dir, &f, &err), err);
    if (f) {
        o = moe_fwd_opts_default(f);
        CHECK_OK(moe_fwd_state_init(f, &o, &s, &err), err);
        int64_t one = 1;
        st = moe_fwd_run(f, s, &one, 1, NULL, &err);
        CHECK(st == MOE_ERR_SHAPE && strstr(err.msg, "layers.0.attn.wq_a.weight") && strstr(err.msg, "[20, 64]"),
              "config vs tensors: %s", err.msg);
        st = moe_fwd_run(f, s, &one, 1, NULL, &err);
        CHECK(st == MOE_ERR_ARG && strstr(err.msg, "failed earlier"), "a failed state stays failed: %s", err.msg);
        moe_fwd_state_free(s);
        moe_fwd_free(f);
    }
    /* the two schemas in one config, disagreeing */
    moe_t_tmp_path(dir, sizeof dir, "synth-twoschemas");
    sy.native_schema = false;
    sy.config_extra = "\"compress_ratios\": [0, 4, 128, 4, 0]";
    write_synth(dir, &sy);
    st = moe_fwd_open(dir, &f, &err);
    CHECK(st == MOE_ERR_CONFIG && strstr(err.msg, "layer_types[2]") && strstr(err.msg, "compress_ratios[2] = 128"),
          "layer_types vs compress_ratios: %s", err.msg);
    /* qk_rope_head_dim against partial_rotary_factor */
    moe_t_tmp_path(dir, sizeof dir, "synth-rope");
    sy.config_extra = "\"qk_rope_head_dim\": 16";
    write_synth(dir, &sy);
    st = moe_fwd_open(dir, &f, &err);
    CHECK(st == MOE_ERR_CONFIG && strstr(err.msg, "qk_rope_head_dim = 16"), "rope dims: %s", err.msg);
    /* a replacement pick that is not visible */
    moe_t_tmp_path(dir, sizeof dir, "synth-pick");
    sy = synth_default();
    write_synth(dir, &sy);
    CHECK_OK(moe_fwd_open(dir, &f, &err), err);
    if (f) {
        int32_t bad[64 * SY_TOPK];
        for (int i = 0; i < 64 * SY_TOPK; i++) bad[i] = -1;
        bad[5 * SY_TOPK] = 2; /* position 5 sees entry 0 only */
        replay rp = {.layer = 1, .K = SY_TOPK, .picks = bad};
        o = moe_fwd_opts_default(f);
        o.index = replay_fn;
        o.index_ctx = &rp;
        collect c;
        int64_t T = 12;
        int64_t *tid = synth_ids(T, 2);
        st = run_chunks(f, &o, tid, T, &T, 1, &c, &err);
        CHECK(st == MOE_ERR_INPUT && strstr(err.msg, "index_topk[5][0] = 2"), "invisible pick: %s", err.msg);
        collect_free(&c);
        free(tid);
        moe_fwd_free(f);
    }
}

/* The MTP block (DeepSeek's MTPBlock; transformers has none, so no oracle):
 *  - its input mix, against the definition: with e_proj = 0 and h_proj = I
 *    the streams entering it are rms(X_final[t, j], hnorm); with e_proj = I
 *    and h_proj = 0 they are rms(embed[id_{t+1}], enorm) on every stream;
 *  - its block and head, against the same weights run as an ordinary last
 *    layer and the model's head (a twin checkpoint), from its input streams:
 *    bitwise equal;
 *  - chunked equals one shot. */
static double rms_ref(const double *x, const double *w, int n, int i) {
    double ss = 0;
    for (int k = 0; k < n; k++) ss += x[k] * x[k];
    return w[i] * (x[i] / sqrt(ss / n + 1e-6));
}

static void test_mtp(void) {
    char da[512], db[512], path[600], tag[64];
    moe_error err;
    const int64_t T = 26;
    int64_t *ids = synth_ids(T, 21);
    int64_t all[1] = {T}, parts[4] = {9, 1, 1, 15};
    for (int mode = 1; mode <= 2; mode++) {
        snprintf(tag, sizeof tag, "synth-mtp-mix%d", mode);
        moe_t_tmp_path(da, sizeof da, tag);
        synth a = synth_default();
        a.mtp = true;
        a.mtp_ratio = 4;
        a.mtp_mode = mode;
        write_synth(da, &a);
        moe_fwd *f = NULL;
        CHECK_OK(moe_fwd_open(da, &f, &err), err);
        if (!f) continue;
        CHECK(moe_fwd_get_config(f)->n_mtp == 1 && moe_fwd_get_config(f)->attn[4] == MOE_ATTN_CSA, "MTP found, CSA");
        moe_fwd_opts o = moe_fwd_opts_default(f);
        o.mtp = true;
        collect c;
        moe_status st = run_chunks(f, &o, ids, T, all, 1, &c, &err);
        CHECK_OK(st, err);
        snprintf(path, sizeof path, "%s/model.safetensors", da);
        moe_st_file *w = NULL;
        CHECK_OK(moe_st_open(path, &w, &err), err);
        double *hn = w ? moe_t_load_f64(w, "mtp.0.hnorm.weight", NULL) : NULL;
        double *en = w ? moe_t_load_f64(w, "mtp.0.enorm.weight", NULL) : NULL;
        double *emb = w ? moe_t_load_f64(w, "embed.weight", NULL) : NULL;
        const double *Z = c.d[4][MOE_FWD_IN], *X = c.d[3][MOE_FWD_OUT];
        CHECK(st == MOE_OK && Z && X && hn && en && emb && c.rows_seen[4][MOE_FWD_IN] == T - 1 &&
              c.rows_seen[4][MOE_FWD_LOGITS] == T - 1, "MTP rows: %lld", (long long)c.rows_seen[4][MOE_FWD_IN]);
        double worst = 0;
        for (int64_t t = 0; Z && X && hn && en && emb && t < T - 1; t++)
            for (int j = 0; j < SY_HC; j++)
                for (int h = 0; h < SY_H; h++) {
                    double want = mode == 1 ? rms_ref(X + (t * SY_HC + j) * SY_H, hn, SY_H, h)
                                            : rms_ref(emb + ids[t + 1] * SY_H, en, SY_H, h);
                    worst = fmax(worst, fabs(Z[(t * SY_HC + j) * SY_H + h] - want) / fmax(1.0, fabs(want)));
                }
        CHECK(worst < 1e-14, "mode %d: the MTP input mix is off by %g", mode, worst);
        free(hn);
        free(en);
        free(emb);
        moe_st_close(w);
        collect_free(&c);
        moe_fwd_free(f);
    }

    moe_t_tmp_path(da, sizeof da, "synth-mtp");
    moe_t_tmp_path(db, sizeof db, "synth-mtp-twin");
    synth a = synth_default(), b = synth_default();
    a.mtp = true;
    a.mtp_ratio = 4;
    b.mtp_ratio = 4;
    b.mtp_as_layer = true;
    write_synth(da, &a);
    write_synth(db, &b);
    moe_fwd *fa = NULL, *fb = NULL;
    CHECK_OK(moe_fwd_open(da, &fa, &err), err);
    CHECK_OK(moe_fwd_open(db, &fb, &err), err);
    if (!fa || !fb) { moe_fwd_free(fa); moe_fwd_free(fb); free(ids); return; }
    moe_fwd_opts o = moe_fwd_opts_default(fa);
    o.mtp = true;
    collect ca, cc, cb;
    CHECK_OK(run_chunks(fa, &o, ids, T, all, 1, &ca, &err), err);
    CHECK_OK(run_chunks(fa, &o, ids, T, parts, 4, &cc, &err), err);
    CHECK(compare_runs(&cc, &ca, 5, "MTP chunked") == 0, "MTP: chunked differs from one shot");
    /* the twin: layer 4 = the MTP block, run from its input streams on the next tokens */
    moe_fwd_opts ob = moe_fwd_opts_default(fb);
    ob.first_layer = ob.last_layer = 4;
    memset(&cb, 0, sizeof cb);
    cb.T = T - 1;
    ob.sink = sink;
    ob.sink_ctx = &cb;
    moe_fwd_state *s = NULL;
    CHECK_OK(moe_fwd_state_init(fb, &ob, &s, &err), err);
    if (s && ca.d[4][MOE_FWD_IN]) CHECK_OK(moe_fwd_run(fb, s, ids + 1, T - 1, ca.d[4][MOE_FWD_IN], &err), err);
    moe_fwd_state_free(s);
    for (int w = MOE_FWD_IN; w <= MOE_FWD_INDEX_TOPK; w++) {
        bool same = false;
        if (w == MOE_FWD_INDEX_TOPK)
            same = ca.topk[4] && cb.topk[4] && !memcmp(ca.topk[4], cb.topk[4], (size_t)((T - 1) * SY_TOPK) * 4);
        else
            same = ca.d[4][w] && cb.d[4][w] && !memcmp(ca.d[4][w], cb.d[4][w], (size_t)((T - 1) * ca.elems[4][w]) * 8);
        CHECK(same, "MTP %s equals the twin's layer 4", moe_fwd_what_name((moe_fwd_what)w));
    }
    CHECK(ca.d[4][MOE_FWD_LOGITS] && cb.d[MAXL][MOE_FWD_LOGITS] &&
          !memcmp(ca.d[4][MOE_FWD_LOGITS], cb.d[MAXL][MOE_FWD_LOGITS], (size_t)((T - 1) * SY_V) * 8),
          "MTP logits equal the twin's");
    /* MTP without the last layer, and without a block */
    o.last_layer = 2;
    o.logits = false;
    CHECK(moe_fwd_state_init(fa, &o, &s, &err) == MOE_ERR_ARG, "MTP needs every layer");
    moe_fwd_opts on = moe_fwd_opts_default(fb);
    on.mtp = true;
    CHECK(moe_fwd_state_init(fb, &on, &s, &err) == MOE_ERR_MISSING && strstr(err.msg, "mtp.0.e_proj.weight"),
          "no MTP block: %s", err.msg);
    collect_free(&ca);
    collect_free(&cc);
    collect_free(&cb);
    moe_fwd_free(fa);
    moe_fwd_free(fb);
    free(ids);
}

/* ------------------------------------------------------------------ CLI */

static char cli_out[1 << 16];

static int cli(const char *args) {
    char cmd[4096];
    moe_t_fits(cmd, sizeof cmd, snprintf(cmd, sizeof cmd, "'%s' forward %s 2>&1", MOE_CLI, args));
    return moe_t_sh(cmd, cli_out, sizeof cli_out);
}

static void write_ids(const char *path, const int64_t *ids, int64_t T, moe_dtype dt) {
    int32_t *i32 = malloc((size_t)(T ? T : 1) * sizeof *i32);
    for (int64_t t = 0; t < T; t++) i32[t] = (int32_t)ids[t];
    moe_st_entry e = {.name = "input_ids", .dtype = dt, .ndim = 1, .shape = {T},
                      .data = dt == MOE_DTYPE_I32 ? (const void *)i32 : (const void *)ids};
    moe_error err;
    CHECK_OK(moe_st_write(path, &e, 1, NULL, &err), err);
    free(i32);
}

/* moeaudit forward writes exactly the names, F64 (ref) or F32 (f32),
 * the library's values; chunked runs write the same bytes; bad input exits 2
 * naming the file, tensor and value. */
static void test_cli(void) {
    char dir[512], in[600], out[600], out2[600], args[4096];
    moe_t_tmp_path(dir, sizeof dir, "synth-cli");
    synth sy = synth_default();
    write_synth(dir, &sy);
    const int64_t T = 29;
    int64_t *ids = synth_ids(T, 9);
    moe_t_tmp_path(in, sizeof in, "cli-in.safetensors");
    moe_t_tmp_path(out, sizeof out, "cli-out.safetensors");
    moe_t_tmp_path(out2, sizeof out2, "cli-out2.safetensors");
    write_ids(in, ids, T, MOE_DTYPE_I32);

    CHECK(cli("--help") == 0 && strstr(cli_out, "--chunks") && strstr(cli_out, "layers.{i}.index_topk"), "--help");
    CHECK(cli("--isa avx9") == 2 && strstr(cli_out, "avx9") && strstr(cli_out, "avx512"), "--isa avx9: %s", cli_out);
    snprintf(args, sizeof args, "--model '%s' --input '%s' --output '%s'", dir, in, out);
    CHECK(cli(args) == 0 && strstr(cli_out, "csa/4") && strstr(cli_out, "hca/8") && strstr(cli_out, "sliding"),
          "forward: %s", cli_out);
    moe_error err;
    moe_st_file *f = NULL;
    CHECK_OK(moe_st_open(out, &f, &err), err);
    /* the library's own run, to compare with */
    moe_fwd *fw = NULL;
    CHECK_OK(moe_fwd_open(dir, &fw, &err), err);
    collect c;
    moe_fwd_opts o = moe_fwd_opts_default(fw);
    int64_t all[1] = {T};
    CHECK_OK(run_chunks(fw, &o, ids, T, all, 1, &c, &err), err);
    if (f) {
        CHECK(moe_st_count(f) == 4 * 6 + 2 + 1, "26 + logits tensors: %zu", moe_st_count(f));
        for (int l = 0; l < 4; l++)
            for (int w = MOE_FWD_IN; w <= MOE_FWD_INDEX_TOPK; w++) {
                char tn[64];
                snprintf(tn, sizeof tn, "layers.%d.%s", l, moe_fwd_what_name((moe_fwd_what)w));
                const moe_st_tensor *t = moe_st_find(f, tn);
                bool want = w != MOE_FWD_INDEX_TOPK || l == 1 || l == 3;
                CHECK(!t == !want, "%s %s", tn, want ? "missing" : "unexpected");
                if (!t) continue;
                if (w == MOE_FWD_INDEX_TOPK) {
                    CHECK(t->dtype == MOE_DTYPE_I32 && t->shape[1] == SY_TOPK &&
                          !memcmp(t->data, c.topk[l], (size_t)(T * SY_TOPK) * 4), "%s values", tn);
                    continue;
                }
                bool streams = w == MOE_FWD_IN || w == MOE_FWD_OUT;
                CHECK(t->dtype == MOE_DTYPE_F64 && t->ndim == (streams ? 3 : 2) && t->shape[0] == T &&
                      (!streams || (t->shape[1] == SY_HC && t->shape[2] == SY_H)), "%s shape", tn);
                CHECK(!memcmp(t->data, c.d[l][w], (size_t)moe_t_numel(t) * 8), "%s: the library's values", tn);
            }
        const moe_st_tensor *lg = moe_st_find(f, "logits");
        CHECK(lg && lg->dtype == MOE_DTYPE_F64 && lg->shape[1] == SY_V &&
              !memcmp(lg->data, c.d[MAXL][MOE_FWD_LOGITS], (size_t)(T * SY_V) * 8), "logits");
    }
    /* chunked, on the scalar kernel table: the same bytes; I64 input */
    write_ids(in, ids, T, MOE_DTYPE_I64);
    snprintf(args, sizeof args, "--model '%s' --input '%s' --output '%s' --chunks 11,1,5 --threads 1 --isa ref", dir,
             in, out2);
    CHECK(cli(args) == 0 && strstr(cli_out, "in 6 chunks"), "chunked: %s", cli_out);
    moe_st_file *f2 = NULL;
    CHECK_OK(moe_st_open(out2, &f2, &err), err);
    for (size_t i = 0; f && f2 && i < moe_st_count(f); i++) {
        const moe_st_tensor *a = moe_st_at(f, i), *b = moe_st_find(f2, a->name);
        CHECK(b && b->nbytes == a->nbytes && !memcmp(a->data, b->data, a->nbytes), "chunked %s", a->name);
    }
    moe_st_close(f2);
    /* f32 */
    snprintf(args, sizeof args, "--model '%s' --input '%s' --output '%s' --precision f32 --layers 2..3", dir, in, out2);
    CHECK(cli(args) == 0, "f32: %s", cli_out);
    CHECK_OK(moe_st_open(out2, &f2, &err), err);
    if (f2) {
        const moe_st_tensor *t = moe_st_find(f2, "layers.2.out"), *lg = moe_st_find(f2, "logits");
        CHECK(t && t->dtype == MOE_DTYPE_F32 && lg && lg->dtype == MOE_DTYPE_F32 && !moe_st_find(f2, "layers.1.out") &&
              moe_st_count(f2) == 2 * 6 + 1 + 1, "f32 layers 2..3: %zu tensors", moe_st_count(f2));
        moe_st_close(f2);
    }
    /* start at layer 2 from the streams another run produced */
    if (f) {
        const moe_st_tensor *s2 = moe_st_find(f, "layers.2.in");
        moe_st_entry e[2] = {{.name = "input_ids", .dtype = MOE_DTYPE_I64, .ndim = 1, .shape = {T}, .data = ids},
                             moe_t_st_entry(s2)};
        char in2[600];
        moe_t_tmp_path(in2, sizeof in2, "cli-in-streams.safetensors");
        CHECK_OK(moe_st_write(in2, e, 2, NULL, &err), err);
        snprintf(args, sizeof args, "--model '%s' --input '%s' --output '%s' --layers 2..", dir, in2, out2);
        CHECK(cli(args) == 0 && strstr(cli_out, "streams given"), "from streams: %s", cli_out);
        CHECK_OK(moe_st_open(out2, &f2, &err), err);
        for (size_t i = 0; f2 && i < moe_st_count(f2); i++) {
            const moe_st_tensor *b = moe_st_at(f2, i), *a = moe_st_find(f, b->name);
            CHECK(a && a->nbytes == b->nbytes && !memcmp(a->data, b->data, a->nbytes), "from streams: %s", b->name);
        }
        moe_st_close(f2);
    }
    moe_st_close(f);
    collect_free(&c);
    moe_fwd_free(fw);

    /* --replay-index: transformers' picks on the fixture (row 39's tie) give its logits */
    char tiny[600], orf[600];
    snprintf(tiny, sizeof tiny, "%s", moe_t_data("dsv4-tiny"));
    snprintf(orf, sizeof orf, "%s", moe_t_data("dsv4-tiny/oracle_fwd.safetensors"));
    snprintf(args, sizeof args, "--model '%s' --input '%s' --replay-index '%s' --output '%s'", tiny, orf, orf, out2);
    CHECK(cli(args) == 0, "replay: %s", cli_out);
    {
        moe_st_file *r = NULL, *orc = NULL;
        CHECK_OK(moe_st_open(out2, &r, &err), err);
        CHECK_OK(moe_st_open(moe_t_data("dsv4-tiny/oracle_fwd.safetensors"), &orc, &err), err);
        double *got = r ? moe_t_load_f64(r, "logits", NULL) : NULL, *want = orc ? moe_t_load_f64(orc, "logits", NULL) : NULL;
        CHECK(got && want && max_rel(got, want, 40 * 300) < TOL_ORACLE_F64, "replayed logits");
        free(got);
        free(want);
        moe_st_close(r);
        moe_st_close(orc);
    }
    /* bad input */
    CHECK(cli("--tokens 12") == 0 && strstr(cli_out, "dsv4-tiny"), "default model and input: %s", cli_out);
    snprintf(args, sizeof args, "--model '%s' --layers 3..7", dir);
    CHECK(cli(args) == 2 && strstr(cli_out, "3..7") && strstr(cli_out, "4 layers"), "layers out of range: %s", cli_out);
    CHECK(cli("--layers 2-3") == 2 && strstr(cli_out, "--layers 2-3"), "bad --layers: %s", cli_out);
    CHECK(cli("--chunks 4,0") == 2 && strstr(cli_out, "--chunks"), "bad --chunks: %s", cli_out);
    CHECK(cli("--precision bf16") == 2, "bad --precision");
    write_ids(in, ids, 0, MOE_DTYPE_I64);
    snprintf(args, sizeof args, "--model '%s' --input '%s' --output '%s'", dir, in, out2);
    remove(out2);
    CHECK(cli(args) == 2 && strstr(cli_out, in) && strstr(cli_out, "input_ids") && strstr(cli_out, "0 tokens"),
          "T = 0: %s", cli_out);
    int64_t big[3] = {1, 97, 2};
    write_ids(in, big, 3, MOE_DTYPE_I64);
    CHECK(cli(args) == 2 && strstr(cli_out, in) && strstr(cli_out, "input_ids[1] = 97"), "id >= vocab: %s", cli_out);
    FILE *probe = fopen(out2, "rb");
    CHECK(!probe, "no output written on error");
    if (probe) fclose(probe);
    free(ids);
}

/* moe_st_stream: bytes in any order give the file moe_st_write writes; a
 * tensor left short fails naming it and leaves no file; abort leaves none. */
static void test_stream_writer(void) {
    char p1[600], p2[600];
    moe_t_tmp_path(p1, sizeof p1, "stream-a.safetensors");
    moe_t_tmp_path(p2, sizeof p2, "stream-b.safetensors");
    double a[6] = {1, 2, 3, 4, 5, 6};
    int32_t b[3] = {7, -1, 9};
    float c[1] = {0.5f};
    moe_st_entry e[3] = {{.name = "a", .dtype = MOE_DTYPE_F64, .ndim = 2, .shape = {3, 2}, .data = a},
                         {.name = "b", .dtype = MOE_DTYPE_I32, .ndim = 1, .shape = {3}, .data = b},
                         {.name = "c", .dtype = MOE_DTYPE_F32, .ndim = 0, .data = c}};
    static const char *const meta[] = {"k", "v", NULL};
    moe_error err;
    CHECK_OK(moe_st_write(p1, e, 3, meta, &err), err);
    moe_st_stream *s = NULL;
    CHECK_OK(moe_st_stream_open(p2, e, 3, meta, &s, &err), err);
    if (s) {
        CHECK_OK(moe_st_stream_put(s, 1, 4, b + 1, 8, &err), err);
        CHECK_OK(moe_st_stream_put(s, 0, 32, a + 4, 16, &err), err);
        CHECK_OK(moe_st_stream_put(s, 2, 0, c, 4, &err), err);
        CHECK_OK(moe_st_stream_put(s, 0, 0, a, 32, &err), err);
        CHECK(moe_st_stream_put(s, 1, 8, b, 8, &err) == MOE_ERR_ARG && strstr(err.msg, "tensor 1 (b)"), "past the end: %s",
              err.msg);
        CHECK_OK(moe_st_stream_put(s, 1, 0, b, 4, &err), err);
        CHECK_OK(moe_st_stream_finish(s, &err), err);
    }
    static char x1[4096], x2[4096];
    FILE *f1 = fopen(p1, "rb"), *f2 = fopen(p2, "rb");
    size_t n1 = f1 ? fread(x1, 1, sizeof x1, f1) : 0, n2 = f2 ? fread(x2, 1, sizeof x2, f2) : 0;
    CHECK(n1 > 0 && n1 == n2 && !memcmp(x1, x2, n1), "streamed file equals moe_st_write's (%zu, %zu bytes)", n1, n2);
    if (f1) fclose(f1);
    if (f2) fclose(f2);
    remove(p2);
    CHECK_OK(moe_st_stream_open(p2, e, 3, NULL, &s, &err), err);
    if (s) {
        CHECK_OK(moe_st_stream_put(s, 0, 0, a, 48, &err), err);
        CHECK_OK(moe_st_stream_put(s, 2, 0, c, 4, &err), err);
        moe_status st = moe_st_stream_finish(s, &err);
        CHECK(st == MOE_ERR_ARG && strstr(err.msg, "tensor b received 0 of its 12 bytes"), "short tensor: %s", err.msg);
    }
    CHECK(!fopen(p2, "rb"), "no file after a failed finish");
    CHECK_OK(moe_st_stream_open(p2, e, 3, NULL, &s, &err), err);
    moe_st_stream_abort(s);
    CHECK(!fopen(p2, "rb"), "no file after abort");
    char dirbuf[640];
    snprintf(dirbuf, sizeof dirbuf, "%s/no/such/dir/x.safetensors", moe_t_tmpdir());
    CHECK(moe_st_stream_open(dirbuf, e, 3, NULL, &s, &err) == MOE_ERR_IO && strstr(err.msg, "no/such/dir"),
          "unwritable path: %s", err.msg);
}

/* moe_external_experts: the driver hands the MoE call blocks without routed
 * experts (what an expert-parallel caller builds on), and a caller that
 * brings the experts itself gets the default run's tensors, bit for bit. */
typedef struct ext_ctx {
    moe_fwd *f;
    int calls, with_experts, wrong_index;
} ext_ctx;

static moe_status ext_moe(void *ctx, const moe_layer *L, const double *x, const int64_t *ids, int64_t T,
                          const moe_run_opts *o, double *out, moe_error *err) {
    ext_ctx *c = ctx;
    c->calls++;
    for (int e = 0; e < L->cfg.n_experts; e++) c->with_experts += L->w1[e].rows || L->w3[e].rows || L->w2[e].rows;
    moe_model *m = moe_fwd_model(c->f);
    const int nl = moe_fwd_get_config(c->f)->n_layers;
    c->wrong_index += L->index < 0 || L->index > nl;
    moe_layer *own = NULL;
    const moe_layer *full = NULL;
    moe_status st = L->index < nl ? moe_model_layer(m, L->index, &full, err)
                                  : moe_model_mtp_layer(m, L->index - nl, &own, err);
    if (own) full = own;
    moe_block_out bo;
    if (st == MOE_OK) st = moe_block_out_init(&bo, full, T, o, err);
    if (st == MOE_OK) {
        st = moe_block_run(full, x, ids, T, o, &bo, err);
        if (st == MOE_OK) memcpy(out, bo.moe_out, (size_t)(T * full->cfg.hidden) * sizeof(double));
        moe_block_out_free(&bo);
    }
    moe_layer_free(own);
    return st;
}

static void test_external_experts(void) {
    moe_error err;
    moe_fwd *f = NULL, *g = NULL;
    CHECK_OK(moe_fwd_open(moe_t_data("dsv4-flash-layout"), &f, &err), err);
    CHECK_OK(moe_fwd_open(moe_t_data("dsv4-flash-layout"), &g, &err), err);
    if (!f || !g) { moe_fwd_free(f); moe_fwd_free(g); return; }
    const moe_fwd_config *cf = moe_fwd_get_config(f);
    int64_t ids[37], chunks[3] = {20, 1, 16};
    for (int i = 0; i < 37; i++) ids[i] = (i * 37 + 11) % cf->vocab;
    for (int mtp = 0; mtp < 2; mtp++) {
        moe_fwd_opts o = moe_fwd_opts_default(f);
        if (mtp) { o.mtp = true; o.logits = false; }
        collect a, b;
        CHECK_OK(run_chunks(f, &o, ids, 37, chunks, 3, &a, &err), err);
        ext_ctx c = {.f = g};
        o.moe = ext_moe;
        o.moe_ctx = &c;
        o.moe_external_experts = true;
        CHECK_OK(run_chunks(g, &o, ids, 37, chunks, 3, &b, &err), err);
        CHECK(c.calls == 3 * (cf->n_layers + mtp), "a MoE call per block and chunk: %d", c.calls);
        CHECK(c.with_experts == 0 && c.wrong_index == 0, "the blocks handed over hold no routed expert (%d) and "
              "name their layer (%d wrong)", c.with_experts, c.wrong_index);
        double w = compare_runs(&a, &b, cf->n_layers + mtp, "external experts");
        CHECK(w == 0, "%s: the caller's experts give the default run's tensors bit for bit (max rel %g)",
              mtp ? "with MTP" : "layers and logits", w);
        collect_free(&a);
        collect_free(&b);
    }
    moe_fwd_opts o = moe_fwd_opts_default(f);
    o.moe_external_experts = true;
    moe_fwd_state *s = NULL;
    moe_status st = moe_fwd_state_init(f, &o, &s, &err);
    CHECK(st == MOE_ERR_ARG && strstr(err.msg, "moe_external_experts"), "external experts need opts.moe: %s",
          err.msg);
    moe_fwd_free(f);
    moe_fwd_free(g);
}

/* forward --input / --replay-index through the library's readers
 * (moe_fwd_input_read, moe_fwd_replay_init/_pick) on the V4 fixture's config
 * (layer 3 CSA at ratio 4, index_topk 8; layers 0-2 HCA; vocabulary 300). */
static moe_st_file *st_of(const char *name, const moe_st_entry *e, size_t n) {
    char path[600];
    moe_t_tmp_path(path, sizeof path, name);
    moe_error err;
    moe_st_file *f = NULL;
    CHECK_OK(moe_st_write(path, e, n, NULL, &err), err);
    CHECK_OK(moe_st_open(path, &f, &err), err);
    return f;
}

static void test_forward_input_files(void) {
    moe_error err;
    moe_fwd *fw = NULL;
    CHECK_OK(moe_fwd_open(moe_t_data("dsv4-tiny"), &fw, &err), err);
    if (!fw) return;
    const moe_fwd_config *c = moe_fwd_get_config(fw);
    CHECK(c->vocab == 300 && c->attn[3] == MOE_ATTN_CSA && c->ratio[3] == 4 && c->index_topk == 8 &&
              c->attn[0] == MOE_ATTN_HCA,
          "the fixture's config is the one these cases are written for");
    /* the oracle's own file: ids, and layer 3's picks replayed as stored */
    moe_st_file *o = NULL;
    CHECK_OK(moe_st_open(moe_t_data("dsv4-tiny/oracle_fwd.safetensors"), &o, &err), err);
    if (!o) { moe_fwd_free(fw); return; }
    moe_fwd_input in;
    CHECK_OK(moe_fwd_input_read(o, c, 0, &in, &err), err);
    const moe_st_tensor *ids = moe_st_find(o, "input_ids"), *top = moe_st_find(o, "layers.3.index_topk");
    CHECK(in.T == 40 && in.ids && !in.streams && ids && top, "oracle input: T %lld", (long long)in.T);
    for (int64_t i = 0; in.ids && i < in.T; i++)
        CHECK(in.ids[i] == moe_load_i64(ids->data, ids->dtype, (size_t)i), "id %lld", (long long)i);
    moe_fwd_replay r;
    CHECK_OK(moe_fwd_replay_init(o, c, in.T, &r, &err), err);
    int32_t sel[40 * 8];
    for (int i = 0; i < 40 * 8; i++) sel[i] = -7;
    CHECK_OK(moe_fwd_replay_pick(&r, 0, 0, 40, 8, sel, &err), err);
    CHECK(sel[0] == -7 && sel[319] == -7, "a layer without a tensor keeps the indexer's picks");
    CHECK_OK(moe_fwd_replay_pick(&r, 3, 8, 32, 8, sel, &err), err);
    for (int i = 0; i < 32 * 8; i++)
        CHECK(sel[i] == moe_load_i64(top->data, top->dtype, (size_t)(8 * 8 + i)), "pick %d as stored", i);
    moe_status st = moe_fwd_replay_pick(&r, 3, 0, 1, 4, sel, &err);
    CHECK(st == MOE_ERR_SHAPE && strstr(err.msg, "layers.3.index_topk") && strstr(err.msg, "[40, 4]"),
          "K other than the run's: %s", err.msg);
    st = moe_fwd_replay_pick(&r, 3, 39, 2, 8, sel, &err);
    CHECK(st == MOE_ERR_INPUT && strstr(err.msg, "40 rows"), "rows past T: %s", err.msg);
    /* a replay for another token count */
    st = moe_fwd_replay_init(o, c, 39, &r, &err);
    CHECK(st == MOE_ERR_SHAPE && strstr(err.msg, "layers.3.index_topk") && strstr(err.msg, "[39, K]"),
          "rows other than T: %s", err.msg);
    moe_fwd_input_free(&in);

    /* bad inputs: each an error naming the file, the tensor and the value; *in zeroed */
    int64_t good[3] = {1, 2, 3}, bad_hi[3] = {1, 300, 3}, bad_neg[3] = {1, 2, -1};
    float fids[3] = {1, 2, 3};
    struct { const char *what; moe_st_entry e; moe_status st; const char *msg; } cases[] = {
        {"no ids", {.name = "ids", .dtype = MOE_DTYPE_I64, .ndim = 1, .shape = {3}, .data = good}, MOE_ERR_MISSING,
         "no tensor named \"input_ids\""},
        {"float ids", {.name = "input_ids", .dtype = MOE_DTYPE_F32, .ndim = 1, .shape = {3}, .data = fids},
         MOE_ERR_DTYPE, "dtype F32"},
        {"2-D ids", {.name = "input_ids", .dtype = MOE_DTYPE_I64, .ndim = 2, .shape = {1, 3}, .data = good},
         MOE_ERR_SHAPE, "2 dimensions"},
        {"0 tokens", {.name = "input_ids", .dtype = MOE_DTYPE_I64, .ndim = 1, .shape = {0}, .data = good},
         MOE_ERR_INPUT, "0 tokens"},
        {"id = vocab", {.name = "input_ids", .dtype = MOE_DTYPE_I64, .ndim = 1, .shape = {3}, .data = bad_hi},
         MOE_ERR_INPUT, "input_ids[1] = 300 is not a token id: the vocabulary has 300"},
        {"id < 0", {.name = "input_ids", .dtype = MOE_DTYPE_I64, .ndim = 1, .shape = {3}, .data = bad_neg},
         MOE_ERR_INPUT, "input_ids[2] = -1"},
    };
    for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
        moe_st_file *f = st_of("fwd-in.safetensors", &cases[k].e, 1);
        if (!f) continue;
        memset(&in, 0xA5, sizeof in);
        st = moe_fwd_input_read(f, c, 0, &in, &err);
        CHECK(st == cases[k].st && strstr(err.msg, cases[k].msg) && strstr(err.msg, "fwd-in.safetensors") &&
                  !in.ids && !in.streams && in.T == 0,
              "%s: %s: %s", cases[k].what, moe_status_str(st), err.msg);
        moe_st_close(f);
    }
    /* streams entering layer 1: read only when asked for, [T, hc_mult, hidden] */
    static float sf[3 * 4 * 96];
    for (int i = 0; i < 3 * 4 * 96; i++) sf[i] = (float)i * 0.25f - 100.0f;
    sf[5] = NAN;
    moe_st_entry es[2] = {{.name = "input_ids", .dtype = MOE_DTYPE_I64, .ndim = 1, .shape = {3}, .data = good},
                          {.name = "layers.1.in", .dtype = MOE_DTYPE_F32, .ndim = 3, .shape = {3, 4, 96}, .data = sf}};
    moe_st_file *f = st_of("fwd-streams.safetensors", es, 2);
    if (f) {
        CHECK_OK(moe_fwd_input_read(f, c, 0, &in, &err), err);
        CHECK(!in.streams, "first layer 0: no streams read");
        moe_fwd_input_free(&in);
        CHECK_OK(moe_fwd_input_read(f, c, 1, &in, &err), err);
        CHECK(in.streams && in.streams[7] == (double)sf[7] && isnan(in.streams[5]), "streams as stored, NaN too");
        moe_fwd_input_free(&in);
        CHECK_OK(moe_fwd_input_read(f, c, 2, &in, &err), err);
        CHECK(!in.streams, "no layers.2.in: start from the embedding");
        moe_fwd_input_free(&in);
        moe_st_close(f);
    }
    es[1].shape[1] = 2;
    es[1].shape[2] = 192;
    f = st_of("fwd-streams.safetensors", es, 2);
    if (f) {
        st = moe_fwd_input_read(f, c, 1, &in, &err);
        CHECK(st == MOE_ERR_SHAPE && strstr(err.msg, "layers.1.in") && strstr(err.msg, "[3, 4, 96]"),
              "streams of another shape: %s", err.msg);
        moe_st_close(f);
    }

    /* bad replays: a layer without an indexer, out of range, a float tensor,
     * a value not visible to its row, a repeat, a value past int32 */
    int32_t picks[8 * 8];
    for (int i = 0; i < 64; i++) picks[i] = -1;
    int64_t huge[8 * 8];
    for (int i = 0; i < 64; i++) huge[i] = -1;
    huge[7 * 8 + 3] = (int64_t)1 << 40;
    float fp[64] = {0};
    struct { const char *what; moe_st_entry e; moe_status st; const char *msg; } rcases[] = {
        {"HCA layer", {.name = "layers.0.index_topk", .dtype = MOE_DTYPE_I32, .ndim = 2, .shape = {8, 8}, .data = picks},
         MOE_ERR_INPUT, "layer 0 has hca attention"},
        {"past the layers", {.name = "layers.9.index_topk", .dtype = MOE_DTYPE_I32, .ndim = 2, .shape = {8, 8},
                             .data = picks}, MOE_ERR_INPUT, "names layer 9; the model has layers 0..3"},
        {"float picks", {.name = "layers.3.index_topk", .dtype = MOE_DTYPE_F32, .ndim = 2, .shape = {8, 8}, .data = fp},
         MOE_ERR_DTYPE, "dtype F32"},
        {"1-D picks", {.name = "layers.3.index_topk", .dtype = MOE_DTYPE_I32, .ndim = 1, .shape = {64}, .data = picks},
         MOE_ERR_SHAPE, "1 dimensions"},
        {"value past int32", {.name = "layers.3.index_topk", .dtype = MOE_DTYPE_I64, .ndim = 2, .shape = {8, 8},
                              .data = huge}, MOE_ERR_INPUT, "[7][3] = 1099511627776 is not -1 or an entry visible"},
    };
    for (size_t k = 0; k < sizeof rcases / sizeof rcases[0]; k++) {
        f = st_of("fwd-replay.safetensors", &rcases[k].e, 1);
        if (!f) continue;
        memset(&r, 0xA5, sizeof r);
        st = moe_fwd_replay_init(f, c, 8, &r, &err);
        CHECK(st == rcases[k].st && strstr(err.msg, rcases[k].msg) && strstr(err.msg, "fwd-replay.safetensors") &&
                  !r.f && r.T == 0,
              "%s: %s: %s", rcases[k].what, moe_status_str(st), err.msg);
        moe_st_close(f);
    }
    moe_st_entry re = {.name = "layers.3.index_topk", .dtype = MOE_DTYPE_I32, .ndim = 2, .shape = {8, 8}, .data = picks};
    /* row 3 sees entry 0 only ((3 + 1) / 4 = 1); row 7 sees 0 and 1 */
    picks[3 * 8] = 0;
    picks[7 * 8] = 1;
    picks[7 * 8 + 1] = 0;
    f = st_of("fwd-replay.safetensors", &re, 1);
    if (f) {
        CHECK_OK(moe_fwd_replay_init(f, c, 8, &r, &err), err);
        moe_st_close(f);
    }
    picks[2 * 8 + 5] = 0; /* row 2 sees nothing */
    f = st_of("fwd-replay.safetensors", &re, 1);
    if (f) {
        st = moe_fwd_replay_init(f, c, 8, &r, &err);
        CHECK(st == MOE_ERR_INPUT && strstr(err.msg, "index_topk[2][5] = 0 is not -1") &&
                  strstr(err.msg, "no entry yet"), "not visible: %s", err.msg);
        moe_st_close(f);
    }
    picks[2 * 8 + 5] = -1;
    picks[7 * 8 + 6] = 1; /* twice in row 7 */
    f = st_of("fwd-replay.safetensors", &re, 1);
    if (f) {
        st = moe_fwd_replay_init(f, c, 8, &r, &err);
        CHECK(st == MOE_ERR_INPUT && strstr(err.msg, "index_topk[7][6] = 1 repeats"), "repeat: %s", err.msg);
        moe_st_close(f);
    }
    moe_st_close(o);
    moe_fwd_free(fw);
}

int main(void) {
    RUN(test_oracle_every_tensor);
    RUN(test_oracle_datasets);
    RUN(test_fixture_logits);
    RUN(test_chunks);
    RUN(test_schemas_and_names);
    RUN(test_f32);
    RUN(test_release_layout);
    RUN(test_isa);
    RUN(test_bad_input);
    RUN(test_forward_input_files);
    RUN(test_mtp);
    RUN(test_external_experts);
    RUN(test_cli);
    RUN(test_stream_writer);
    return moe_t_finish();
}
