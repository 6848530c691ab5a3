/*
 * moeaudit diagnose on dumps of every failure class, made by running the
 * library's own block with the corresponding fault or divergence toggle on
 * the fixtures (and on a synthetic model quantized to MXFP4 for fp4-level
 * noise), written to safetensors exactly as an engine's dump would be. The
 * diagnosis must name the class, and must not raise an alarm on precision
 * noise (bf16-rounded dumps, FP4 weights, FP8 activations).
 */
#include "harness.h"
#include "moeaudit_variant.h"
#include "moe_formats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

typedef struct model_in {
    moe_model *m;
    const moe_layer *L;
    double *hidden;
    int64_t *ids;
    int64_t T;
} model_in;

static int open_in(model_in *r, const char *dir, int layer, int64_t T_synth) {
    moe_error err;
    memset(r, 0, sizeof *r);
    moe_status st = moe_model_open(dir, &r->m, &err);
    CHECK_OK(st, err);
    if (st) return -1;
    st = moe_model_layer(r->m, layer, &r->L, &err);
    CHECK_OK(st, err);
    if (st) return -1;
    char path[1024];
    snprintf(path, sizeof path, "%s/oracle_io.safetensors", dir);
    moe_st_file *f = NULL;
    int H = r->L->cfg.hidden;
    if (T_synth == 0 && moe_st_open(path, &f, &err) == MOE_OK) {
        const moe_st_tensor *h = moe_st_find(f, "hidden"), *ids = moe_st_find(f, "input_ids");
        r->T = h->shape[0];
        r->hidden = malloc((size_t)(r->T * H) * sizeof(double));
        for (int64_t i = 0; i < r->T * H; i++) r->hidden[i] = moe_load_f64(h->data, h->dtype, (size_t)i);
        r->ids = malloc((size_t)r->T * sizeof(int64_t));
        for (int64_t t = 0; t < r->T; t++) r->ids[t] = ids ? moe_load_i64(ids->data, ids->dtype, (size_t)t) : 0;
        moe_st_close(f);
    } else {
        r->T = T_synth;
        r->hidden = malloc((size_t)(r->T * H) * sizeof(double));
        r->ids = malloc((size_t)r->T * sizeof(int64_t));
        for (int64_t i = 0; i < r->T * H; i++) r->hidden[i] = sin(1.3 * (double)i) + 0.3 * cos(0.17 * (double)i);
        for (int64_t t = 0; t < r->T; t++) r->ids[t] = (t * 13) % 64;
    }
    return 0;
}

static void close_in(model_in *r) {
    free(r->hidden);
    free(r->ids);
    moe_model_free(r->m);
}

enum { WITH_IDS = 1, WITH_WEIGHTS = 2, WITH_LOGITS = 4, AS_BF16 = 8, AS_F32 = 16 };

/* Run L (the "engine") with opts and write its dump; `hidden_of` is the block
 * input the engine reports. */
static void write_dump(const char *path, const moe_layer *L, const model_in *r, const moe_run_opts *o,
                       const moe_variant *v, int what) {
    moe_error err;
    moe_block_out out;
    CHECK_OK(moe_block_out_init(&out, L, r->T, o, &err), err);
    CHECK_OK(moe_block_run_variant(L, r->hidden, r->ids, r->T, o, v, &out, &err), err);
    int H = L->cfg.hidden, E = L->cfg.n_experts;
    moe_st_entry e[8];
    int n = 0;
    uint16_t *bf[4] = {0};
    const double *src[4] = {r->hidden, out.moe_out, out.router_logits, out.topk_weights};
    const char *names[4] = {"hidden", "moe_out", "router_logits", "topk_weights"};
    int64_t cols[4] = {H, H, E, out.n_cols};
    for (int k = 0; k < 4; k++) {
        if (k == 2 && !(what & WITH_LOGITS)) continue;
        if (k == 3 && !(what & WITH_WEIGHTS)) continue;
        e[n] = (moe_st_entry){.name = names[k], .ndim = 2, .shape = {r->T, cols[k]}};
        if (what & AS_BF16) {
            bf[k] = malloc((size_t)(r->T * cols[k]) * 2);
            for (int64_t i = 0; i < r->T * cols[k]; i++) bf[k][i] = moe_bf16_from_f32((float)src[k][i]);
            e[n].dtype = MOE_DTYPE_BF16;
            e[n].data = bf[k];
        } else if (what & AS_F32) {
            float *f = malloc((size_t)(r->T * cols[k]) * sizeof *f);
            for (int64_t i = 0; i < r->T * cols[k]; i++) f[i] = (float)src[k][i];
            bf[k] = (uint16_t *)(void *)f;
            e[n].dtype = MOE_DTYPE_F32;
            e[n].data = f;
        } else {
            e[n].dtype = MOE_DTYPE_F64;
            e[n].data = src[k];
        }
        n++;
    }
    e[n++] = (moe_st_entry){.name = "input_ids", .dtype = MOE_DTYPE_I64, .ndim = 1, .shape = {r->T}, .data = r->ids};
    if (what & WITH_IDS)
        e[n++] = (moe_st_entry){.name = "topk_ids", .dtype = MOE_DTYPE_I32, .ndim = 2, .shape = {r->T, out.n_cols},
                                .data = out.topk_ids};
    CHECK_OK(moe_st_write(path, e, (size_t)n, NULL, &err), err);
    for (int k = 0; k < 4; k++) free(bf[k]);
    moe_block_out_free(&out);
}

static moe_verdict diagnose(const char *path, const moe_layer *L, moe_diagnosis *g) {
    moe_error err;
    moe_dump d;
    moe_status st = moe_dump_load(path, L->cfg.hidden, L->cfg.n_experts, &d, &err);
    CHECK_OK(st, err);
    if (st) return MOE_VERDICT_UNEXPLAINED;
    st = moe_diagnose(L, &d, g, &err);
    CHECK_OK(st, err);
    moe_dump_free(&d);
    return g->verdict;
}

typedef struct dcase {
    const char *name;
    moe_fault fault;
    moe_scale_owner owner;
    bool fused, ignore_bias;
    int score;
    moe_verdict want;
} dcase;

static void run_cases(const char *model, int layer, const dcase *cs, size_t n) {
    model_in r;
    if (open_in(&r, moe_t_data(model), layer, 0)) { close_in(&r); return; }
    static const int whats[] = {WITH_IDS | WITH_WEIGHTS | WITH_LOGITS, WITH_IDS | WITH_WEIGHTS | WITH_LOGITS | AS_BF16, 0};
    for (size_t i = 0; i < n; i++)
        for (int w = 0; w < 3; w++) {
            moe_run_opts o = moe_run_opts_default();
            moe_variant var = moe_variant_none();
            var.fault = cs[i].fault;
            o.owner = cs[i].owner;
            o.fuse_shared = cs[i].fused;
            var.ignore_bias = cs[i].ignore_bias;
            var.score_override = cs[i].score;
            char path[1024];
            snprintf(path, sizeof path, "%s/dump-%s-%d-%zu-%d.safetensors", moe_t_tmpdir(), model, layer, i, w);
            write_dump(path, r.L, &r, &o, &var, whats[w]);
            moe_diagnosis g;
            moe_verdict v = diagnose(path, r.L, &g);
            CHECK(v == cs[i].want, "%s layer %d %s (dump %s%s): verdict %s, want %s: %s", model, layer, cs[i].name,
                  whats[w] ? "with ids/weights/logits" : "output only", whats[w] & AS_BF16 ? ", bf16" : "",
                  moe_verdict_name(v), moe_verdict_name(cs[i].want), g.sentence);
            if (w == 1)
                fprintf(stderr, "  %-10s %-26s -> %-16s a=%.4f b=%.4f res=%.2e %s\n", model, cs[i].name,
                        moe_verdict_name(v), g.fit_a, g.fit_b, g.residual, g.noise ? g.noise : "-");
        }
    close_in(&r);
}

static void test_classes_v4(void) {
    static const dcase cs[] = {
        {"ok router owner", MOE_FAULT_NONE, MOE_SCALE_ROUTER, false, false, -1, MOE_VERDICT_OK},
        {"ok runner owner fused", MOE_FAULT_NONE, MOE_SCALE_RUNNER, true, false, -1, MOE_VERDICT_OK},
        {"ok output owner", MOE_FAULT_NONE, MOE_SCALE_OUTPUT, false, false, -1, MOE_VERDICT_OK},
        {"double (router+runner)", MOE_FAULT_SCALE_DOUBLE, MOE_SCALE_ROUTER, false, false, -1, MOE_VERDICT_SCALE_DOUBLE},
        {"double (runner+output)", MOE_FAULT_SCALE_DOUBLE, MOE_SCALE_RUNNER, false, false, -1, MOE_VERDICT_SCALE_DOUBLE},
        {"missing", MOE_FAULT_SCALE_MISSING, MOE_SCALE_ROUTER, false, false, -1, MOE_VERDICT_SCALE_MISSING},
        {"shared 1/s", MOE_FAULT_SHARED_WEIGHT, MOE_SCALE_ROUTER, true, false, -1, MOE_VERDICT_SHARED_WEIGHT},
        {"shared s", MOE_FAULT_SHARED_WEIGHT, MOE_SCALE_RUNNER, true, false, -1, MOE_VERDICT_SHARED_WEIGHT},
        {"not renormalized", MOE_FAULT_NOT_RENORMALIZED, MOE_SCALE_ROUTER, false, false, -1, MOE_VERDICT_NOT_RENORMALIZED},
        {"biased weights", MOE_FAULT_BIASED_WEIGHTS, MOE_SCALE_ROUTER, false, false, -1, MOE_VERDICT_BIASED_WEIGHTS},
        {"sigmoid scores", MOE_FAULT_NONE, MOE_SCALE_ROUTER, false, false, MOE_SCORE_SIGMOID, MOE_VERDICT_WRONG_SCORE},
        {"bias ignored", MOE_FAULT_NONE, MOE_SCALE_ROUTER, false, true, -1, MOE_VERDICT_SELECTION},
    };
    run_cases("dsv4-tiny", 3, cs, sizeof cs / sizeof cs[0]);
    /* a hash layer: no bias, selection by table */
    static const dcase hs[] = {
        {"ok hash", MOE_FAULT_NONE, MOE_SCALE_ROUTER, false, false, -1, MOE_VERDICT_OK},
        {"double hash", MOE_FAULT_SCALE_DOUBLE, MOE_SCALE_ROUTER, false, false, -1, MOE_VERDICT_SCALE_DOUBLE},
        {"softmax on hash", MOE_FAULT_NONE, MOE_SCALE_ROUTER, false, false, MOE_SCORE_SOFTMAX, MOE_VERDICT_WRONG_SCORE},
        {"not renormalized hash", MOE_FAULT_NOT_RENORMALIZED, MOE_SCALE_ROUTER, false, false, -1, MOE_VERDICT_NOT_RENORMALIZED},
    };
    run_cases("dsv4-tiny", 0, hs, sizeof hs / sizeof hs[0]);
}

static void test_classes_v3(void) {
    static const dcase cs[] = {
        {"ok", MOE_FAULT_NONE, MOE_SCALE_ROUTER, false, false, -1, MOE_VERDICT_OK},
        {"double", MOE_FAULT_SCALE_DOUBLE, MOE_SCALE_OUTPUT, false, false, -1, MOE_VERDICT_SCALE_DOUBLE},
        {"missing", MOE_FAULT_SCALE_MISSING, MOE_SCALE_RUNNER, false, false, -1, MOE_VERDICT_SCALE_MISSING},
        {"shared 1/s", MOE_FAULT_SHARED_WEIGHT, MOE_SCALE_ROUTER, true, false, -1, MOE_VERDICT_SHARED_WEIGHT},
        {"biased weights", MOE_FAULT_BIASED_WEIGHTS, MOE_SCALE_ROUTER, false, false, -1, MOE_VERDICT_BIASED_WEIGHTS},
        {"softmax scores", MOE_FAULT_NONE, MOE_SCALE_ROUTER, false, false, MOE_SCORE_SOFTMAX, MOE_VERDICT_WRONG_SCORE},
        {"bias ignored", MOE_FAULT_NONE, MOE_SCALE_ROUTER, false, true, -1, MOE_VERDICT_SELECTION},
    };
    run_cases("dsv3-tiny", 1, cs, sizeof cs / sizeof cs[0]);
}

/* Precision noise is not an alarm: an engine with MXFP4 experts, or FP8
 * activations on the f32 path, is diagnosed OK with the right noise class. */
static void test_no_false_alarm_on_noise(void) {
    char bf16[600], q[600];
    moe_t_tmp_path(bf16, sizeof bf16, "synth-bf16");
    moe_t_tmp_path(q, sizeof q, "synth-mxfp4");
    moe_error err;
    moe_synth_opts so = moe_synth_opts_default();
    CHECK_OK(moe_synth_write(bf16, &so, &err), err);
    moe_quant_opts qo = {MOE_Q_MXFP4, MOE_Q_FP8, 0, 0};
    moe_quant_report rep;
    CHECK_OK(moe_quantize_checkpoint(bf16, q, &qo, &rep, &err), err);
    for (int layer = 0; layer < 2; layer++) {
        model_in ref, eng;
        if (open_in(&ref, bf16, layer, 64) || open_in(&eng, q, layer, 64)) { close_in(&ref); close_in(&eng); return; }
        char path[1024];
        moe_diagnosis g;
        /* engine: MXFP4 experts + FP8 shared, f32 arithmetic, FP8 activations */
        moe_run_opts o = moe_run_opts_default();
        o.precision = MOE_PREC_F32;
        o.act = MOE_ACT_FP8;
        snprintf(path, sizeof path, "%s/dump-fp4-%d.safetensors", moe_t_tmpdir(), layer);
        write_dump(path, eng.L, &eng, &o, NULL, WITH_IDS | WITH_WEIGHTS | AS_BF16);
        moe_verdict v = diagnose(path, ref.L, &g);
        CHECK(v == MOE_VERDICT_OK && g.noise && !strcmp(g.noise, "fp4"), "MXFP4 engine layer %d: %s (%s)", layer,
              moe_verdict_name(v), g.sentence);
        fprintf(stderr, "  mxfp4+fp8 engine layer %d -> %s a=%.4f b=%.4f res=%.3g %s\n", layer, moe_verdict_name(v),
                g.fit_a, g.fit_b, g.residual, g.noise ? g.noise : "-");
        /* the same engine with the factor applied twice is still caught */
        moe_variant dbl = moe_variant_none();
        dbl.fault = MOE_FAULT_SCALE_DOUBLE;
        snprintf(path, sizeof path, "%s/dump-fp4-double-%d.safetensors", moe_t_tmpdir(), layer);
        write_dump(path, eng.L, &eng, &o, &dbl, WITH_IDS | AS_BF16);
        v = diagnose(path, ref.L, &g);
        CHECK(v == MOE_VERDICT_SCALE_DOUBLE, "MXFP4 engine, double scale, layer %d: %s", layer, g.sentence);
        /* bf16 activations on the exact weights: bf16 noise */
        o = moe_run_opts_default();
        o.precision = MOE_PREC_F32;
        o.act = MOE_ACT_BF16;
        snprintf(path, sizeof path, "%s/dump-bf16-%d.safetensors", moe_t_tmpdir(), layer);
        write_dump(path, ref.L, &ref, &o, NULL, AS_BF16);
        v = diagnose(path, ref.L, &g);
        CHECK(v == MOE_VERDICT_OK && g.noise && !strcmp(g.noise, "bf16"), "bf16 engine layer %d: %s", layer, g.sentence);
        fprintf(stderr, "  bf16 engine layer %d -> %s res=%.3g %s\n", layer, moe_verdict_name(v), g.residual,
                g.noise ? g.noise : "-");
        close_in(&ref);
        close_in(&eng);
    }
}

static void test_cli_and_json(void) {
    model_in r;
    if (open_in(&r, moe_t_data("dsv4-tiny"), 3, 0)) { close_in(&r); return; }
    char path[1024], json[1024], cmd[4096];
    moe_t_tmp_path(path, sizeof path, "cli-double.safetensors");
    moe_t_tmp_path(json, sizeof json, "cli-double.json");
    moe_run_opts o = moe_run_opts_default();
    moe_variant v = moe_variant_none();
    v.fault = MOE_FAULT_SCALE_DOUBLE;
    write_dump(path, r.L, &r, &o, &v, WITH_IDS);
    snprintf(cmd, sizeof cmd, "'%s' diagnose --model '%s' --layer 3 --dump '%s' --json '%s' > /dev/null", MOE_CLI,
             moe_t_data("dsv4-tiny"), path, json);
    int rc = system(cmd);
    CHECK(WIFEXITED(rc) && WEXITSTATUS(rc) == 1, "non-OK verdict exits 1 (got %d)", rc);
    char buf[8192] = {0};
    moe_t_read_file(json, buf, sizeof buf);
    CHECK(strstr(buf, "\"verdict\":\t\"SCALE_DOUBLE\"") != NULL || strstr(buf, "\"verdict\": \"SCALE_DOUBLE\"") != NULL,
          "JSON verdict: %.200s", buf);
    CHECK(strstr(buf, "\"findings\"") != NULL && strstr(buf, "\"evidence\"") != NULL, "JSON findings");
    v.fault = MOE_FAULT_NONE;
    write_dump(path, r.L, &r, &o, &v, 0);
    snprintf(cmd, sizeof cmd, "'%s' diagnose --model '%s' --layer 3 --dump '%s' > /dev/null", MOE_CLI,
             moe_t_data("dsv4-tiny"), path);
    rc = system(cmd);
    CHECK(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "OK exits 0 (got %d)", rc);
    snprintf(cmd, sizeof cmd, "'%s' diagnose --model '%s' --layer 3 --dump /nonexistent 2>/dev/null", MOE_CLI,
             moe_t_data("dsv4-tiny"));
    rc = system(cmd);
    CHECK(WIFEXITED(rc) && WEXITSTATUS(rc) == 2, "missing dump exits 2 (got %d)", rc);
    close_in(&r);
}

/* ---- the four failures of issue #15, each reproduced on the library's own paths ---- */

/* A wrong score function that the weights prove exactly (fp32 weights, identical expert
 * sets on a hash layer) must not be overruled by an output fit that sits in fp4/fp8 noise. */
static void test_exact_weights_beat_noisy_fit(void) {
    char bf16[600], q[600];
    moe_t_tmp_path(bf16, sizeof bf16, "synth-bf16-ws");
    moe_t_tmp_path(q, sizeof q, "synth-mxfp4-ws");
    moe_error err;
    moe_synth_opts so = moe_synth_opts_default();
    CHECK_OK(moe_synth_write(bf16, &so, &err), err);
    moe_quant_opts qo = {MOE_Q_MXFP4, MOE_Q_FP8, 0, 0};
    moe_quant_report rep;
    CHECK_OK(moe_quantize_checkpoint(bf16, q, &qo, &rep, &err), err);
    model_in ref, eng;
    if (open_in(&ref, bf16, 0, 64) || open_in(&eng, q, 0, 64)) { close_in(&ref); close_in(&eng); return; }
    CHECK(ref.L->cfg.kind == MOE_LAYER_HASH, "synth layer 0 is hash-routed");
    moe_run_opts o = moe_run_opts_default();
    o.precision = MOE_PREC_F32;
    o.act = MOE_ACT_FP8;
    moe_variant sig = moe_variant_none();
    sig.score_override = MOE_SCORE_SIGMOID;
    char path[1024];
    snprintf(path, sizeof path, "%s/dump-ws.safetensors", moe_t_tmpdir());
    write_dump(path, eng.L, &eng, &o, &sig, WITH_IDS | WITH_WEIGHTS | WITH_LOGITS | AS_F32);
    moe_diagnosis g;
    moe_verdict v = diagnose(path, ref.L, &g);
    CHECK(v == MOE_VERDICT_WRONG_SCORE, "sigmoid scores on an MXFP4+FP8 engine, fp32 weights: %s (%s)",
          moe_verdict_name(v), g.sentence);
    close_in(&ref);
    close_in(&eng);
}

/* A hash table off by one row: every token's expert set differs. The output fit of the
 * specified routing runs over no token and must not vote ("shared expert weighted 0"). */
static void test_hash_off_by_one(void) {
    model_in r;
    if (open_in(&r, moe_t_data("dsv4-tiny"), 0, 0)) { close_in(&r); return; }
    const moe_layer *L = r.L;
    int K = L->cfg.top_k, V = L->cfg.vocab;
    int32_t *tab = malloc((size_t)V * K * sizeof *tab);
    for (int t = 0; t < V; t++)
        for (int j = 0; j < K; j++) tab[t * K + j] = L->tid2eid[((t + V - 1) % V) * K + j];
    moe_layer eng = *L;
    eng.tid2eid = tab;
    static const int whats[] = {WITH_IDS | WITH_WEIGHTS | WITH_LOGITS, WITH_IDS | AS_BF16, 0};
    for (int w = 0; w < 3; w++) {
        char path[1024];
        snprintf(path, sizeof path, "%s/dump-hash1-%d.safetensors", moe_t_tmpdir(), w);
        moe_run_opts o = moe_run_opts_default();
        write_dump(path, &eng, &r, &o, NULL, whats[w]);
        moe_diagnosis g;
        moe_verdict v = diagnose(path, L, &g);
        CHECK(v == MOE_VERDICT_SELECTION, "tid2eid off by one (%s): %s (%s)", w < 2 ? "with ids" : "output only",
              moe_verdict_name(v), g.sentence);
        CHECK(strstr(g.sentence, "tid2eid") != NULL, "the sentence names the hash table: %s", g.sentence);
    }
    free(tab);
    close_in(&r);
}

/* A top-k layer in bf16 (bf16 router logits, bf16 activations) without topk_ids: tokens at
 * near-ties choose other experts. They must be found, not absorbed into the fit, so that a
 * missing renormalization is named and the noise class is bf16 (not fp4). */
static void test_flips_without_ids(void) {
    /* a V4-like top-k layer with 64 experts, top-6: near-ties are common */
    char dir[600];
    moe_t_tmp_path(dir, sizeof dir, "synth-e64");
    moe_synth_opts so = moe_synth_opts_default();
    so.n_experts = 64;
    so.top_k = 6;
    so.seed = 5;
    moe_error err0;
    CHECK_OK(moe_synth_write(dir, &so, &err0), err0);
    model_in r;
    if (open_in(&r, dir, 1, 256)) { close_in(&r); return; }
    uint64_t seed = 99;
    for (int64_t i = 0; i < r.T * r.L->cfg.hidden; i++) r.hidden[i] = moe_t_rng_normal(&seed);
    moe_error err;
    for (int fault = 0; fault < 2; fault++) {
        moe_run_opts o = moe_run_opts_default();
        o.precision = MOE_PREC_F32;
        o.act = MOE_ACT_BF16;
        o.router = MOE_ROUTER_BF16_LOGITS;
        moe_variant var = moe_variant_none();
        var.fault = fault ? MOE_FAULT_NOT_RENORMALIZED : MOE_FAULT_NONE;
        /* how many tokens the engine routes differently from float64 */
        moe_block_out eo, ro;
        moe_run_opts ref_o = moe_run_opts_default();
        CHECK_OK(moe_block_out_init(&eo, r.L, r.T, &o, &err), err);
        CHECK_OK(moe_block_run_variant(r.L, r.hidden, r.ids, r.T, &o, &var, &eo, &err), err);
        CHECK_OK(moe_block_out_init(&ro, r.L, r.T, &ref_o, &err), err);
        CHECK_OK(moe_block_run(r.L, r.hidden, r.ids, r.T, &ref_o, &ro, &err), err);
        int64_t flips = 0;
        for (int64_t t = 0; t < r.T; t++) {
            int K = r.L->cfg.top_k, same = 0;
            for (int a = 0; a < K; a++)
                for (int b = 0; b < K; b++) same += eo.topk_ids[t * eo.n_cols + a] == ro.topk_ids[t * ro.n_cols + b];
            flips += same != K;
        }
        moe_block_out_free(&eo);
        moe_block_out_free(&ro);
        CHECK(flips > 0, "the bf16 engine flips some tokens (%lld of %lld)", (long long)flips, (long long)r.T);
        char path[1024];
        snprintf(path, sizeof path, "%s/dump-flips-%d.safetensors", moe_t_tmpdir(), fault);
        write_dump(path, r.L, &r, &o, &var, AS_BF16);
        moe_diagnosis g;
        moe_verdict v = diagnose(path, r.L, &g);
        moe_verdict want = fault ? MOE_VERDICT_NOT_RENORMALIZED : MOE_VERDICT_OK;
        CHECK(v == want, "bf16 engine%s, %lld flips, no ids: %s, want %s (%s)", fault ? " not renormalizing" : "",
              (long long)flips, moe_verdict_name(v), moe_verdict_name(want), g.sentence);
        CHECK(g.noise && !strcmp(g.noise, "bf16"), "noise class of a bf16 engine: %s (residual %.3g)",
              g.noise ? g.noise : "none", g.residual);
        fprintf(stderr, "  bf16 flips%s: %lld flipped, verdict %s, residual %.3g %s: %s\n", fault ? " + not renorm" : "",
                (long long)flips, moe_verdict_name(v), g.residual, g.noise ? g.noise : "-", g.sentence);
    }
    close_in(&r);
}

/* A correct dump with fp32 topk_weights: no finding may say SELECTION. */
static void test_fp32_weights_no_spurious_selection(void) {
    static const char *const models[] = {"dsv4-tiny", "dsv3-tiny"};
    static const int layers[] = {3, 1};
    for (int m = 0; m < 2; m++) {
        model_in r;
        if (open_in(&r, moe_t_data(models[m]), layers[m], 0)) { close_in(&r); return; }
        moe_run_opts o = moe_run_opts_default();
        o.precision = MOE_PREC_F32;
        char path[1024];
        snprintf(path, sizeof path, "%s/dump-f32w-%d.safetensors", moe_t_tmpdir(), m);
        write_dump(path, r.L, &r, &o, NULL, WITH_IDS | WITH_WEIGHTS | WITH_LOGITS | AS_F32);
        moe_diagnosis g;
        moe_verdict v = diagnose(path, r.L, &g);
        CHECK(v == MOE_VERDICT_OK, "%s fp32 engine: %s", models[m], g.sentence);
        for (int i = 0; i < g.n_findings; i++)
            CHECK(strcmp(g.findings[i].cls, "SELECTION") != 0, "%s: spurious finding %s %s: %s", models[m],
                  g.findings[i].stage_name, g.findings[i].cls, g.findings[i].detail);
        close_in(&r);
    }
}

/* Issue #12 item 5: an all-NaN or all-zero dump has no evidence, so no
 * verdict: it used to get SHARED_WEIGHT ("weighted 0, exact") from a fit over
 * zero-signal tokens. Both fixtures, every hash / top-k kind. */
static void test_no_evidence_dumps(void) {
    static const struct { const char *model; int layer; } cases[] = {
        {"dsv4-tiny", 3}, {"dsv4-tiny", 0}, {"dsv3-tiny", 1}};
    for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
        moe_error err;
        moe_model *m = NULL;
        CHECK_OK(moe_model_open(moe_t_data(cases[c].model), &m, &err), err);
        if (!m) continue;
        const moe_layer *L = NULL;
        CHECK_OK(moe_model_layer(m, cases[c].layer, &L, &err), err);
        for (int k = 0; L && k < 2; k++) {
            int64_t T = 16;
            int H = L->cfg.hidden;
            float *v = malloc((size_t)(T * H) * sizeof *v);
            for (int64_t i = 0; i < T * H; i++) v[i] = k ? 0.0f : NAN;
            int64_t ids[16];
            for (int t = 0; t < 16; t++) ids[t] = t % (L->cfg.vocab > 0 ? L->cfg.vocab : 1);
            moe_st_entry e[3] = {{.name = "hidden", .dtype = MOE_DTYPE_F32, .ndim = 2, .shape = {T, H}, .data = v},
                                 {.name = "moe_out", .dtype = MOE_DTYPE_F32, .ndim = 2, .shape = {T, H}, .data = v},
                                 {.name = "input_ids", .dtype = MOE_DTYPE_I64, .ndim = 1, .shape = {T}, .data = ids}};
            char path[600];
            moe_t_tmp_path(path, sizeof path, k ? "dump-zero.safetensors" : "dump-nan.safetensors");
            CHECK_OK(moe_st_write(path, e, 3, NULL, &err), err);
            moe_dump d;
            moe_status st = moe_dump_load(path, H, L->cfg.n_experts, &d, &err);
            CHECK_OK(st, err);
            if (st == MOE_OK) {
                moe_diagnosis g;
                st = moe_diagnose(L, &d, &g, &err);
                CHECK_OK(st, err);
                CHECK(st != MOE_OK || (g.verdict == MOE_VERDICT_UNEXPLAINED && g.tokens_used == 0),
                      "%s layer %d, all %s: verdict %s from %lld tokens: %s", cases[c].model, cases[c].layer,
                      k ? "zero" : "NaN", moe_verdict_name(g.verdict), (long long)g.tokens_used, g.sentence);
                moe_dump_free(&d);
            }
            free(v);
        }
        moe_model_free(m);
    }
}

int main(void) {
    RUN(test_no_evidence_dumps);
    RUN(test_exact_weights_beat_noisy_fit);
    RUN(test_hash_off_by_one);
    RUN(test_flips_without_ids);
    RUN(test_fp32_weights_no_spurious_selection);
    RUN(test_classes_v4);
    RUN(test_classes_v3);
    RUN(test_no_false_alarm_on_noise);
    RUN(test_cli_and_json);
    return moe_t_finish();
}
