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

enum { WITH_IDS = 1, WITH_WEIGHTS = 2, WITH_LOGITS = 4, AS_BF16 = 8 };

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

int main(void) {
    RUN(test_classes_v4);
    RUN(test_classes_v3);
    RUN(test_no_false_alarm_on_noise);
    RUN(test_cli_and_json);
    return moe_t_finish();
}
