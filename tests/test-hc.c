/*
 * mHC hyper-connections against the dsv4-tiny oracle (HF transformers 5.17
 * DeepseekV4HyperConnection on the hc_ffn_* weights), the precision paths
 * against the reference, and bad inputs.
 *
 * Tolerances:
 *  TOL_ORACLE = 1e-6 relative (per token, infinity norm). transformers casts
 *    the flattened streams and fn to fp32 (`.float()`) before the RMS norm
 *    and the linear, so the oracle's m = fn . v carries fp32 rounding: 384-term
 *    fp32 dots (error ~ sqrt(384) * 2^-24 * sum|f v| ~ 1e-6 of |m| at worst,
 *    observed 1e-7), amplified at most by scale[i] * sigmoid' <= scale / 4
 *    in pre/post and by the softmax/Sinkhorn Lipschitz constant (~1) in comb.
 *    Only collapsed = sum_j pre_j X_j is float64 in the oracle (fp32 pre times
 *    float64 streams). Our float64 path cannot match it to 1e-12; our fp32
 *    path reproduces the oracle's rounding order only approximately.
 *  TOL_F32 = 1e-5, TOL_BF16 = 5e-2: bounds on the audit rows of the engine
 *    paths (fp32: ~K * 2^-24 relative in m; bf16: operands rounded to 2^-9
 *    relative, m error ~ sqrt(K) * 2^-9 * rms(f v) * |r|, amplified by scale).
 *  TOL_DS = 1e-5: on the fixture's weights (scale ~ 1e-2 .. 1, a near-uniform
 *    softmax), 20 Sinkhorn rounds end within ~n * hc_eps of doubly stochastic:
 *    column sums are 1 - eps/(s + eps) ~ 1e-6 after the last column step and
 *    the rows converge geometrically. Peaked matrices converge slower (the
 *    random test below ends ~6e-3 away), which is why the audit reports the
 *    reference's own deviation beside each path's.
 */
#include "harness.h"
#include "core/core.h"
#include "moeaudit_hc.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#define TOL_ORACLE 1e-6
#define TOL_F32 1e-5
#define TOL_BF16 5e-2
#define TOL_DS 1e-5

static double rel_rows(const double *a, const double *b, int64_t T, int len) {
    double w = 0;
    for (int64_t t = 0; t < T; t++) {
        double num = 0, den = 0;
        for (int i = 0; i < len; i++) {
            num = fmax(num, fabs(a[t * len + i] - b[t * len + i]));
            den = fmax(den, fabs(b[t * len + i]));
        }
        w = fmax(w, den > 0 ? num / den : num);
    }
    return w;
}

static void test_fixture(void) {
    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(moe_t_data("dsv4-tiny"), &m, &err);
    CHECK_OK(st, err);
    if (st) return;
    moe_st_file *f = NULL;
    st = moe_st_open(moe_t_data("dsv4-tiny/oracle_io.safetensors"), &f, &err);
    CHECK_OK(st, err);
    if (st) { moe_model_free(m); return; }
    double worst[3] = {0, 0, 0}, worst32[3] = {0, 0, 0};
    for (int layer = 0; layer < 4; layer++) {
        moe_hc_weights *w = NULL;
        st = moe_hc_load(m, layer, MOE_HC_FFN, &w, &err);
        CHECK_OK(st, err);
        if (st) continue;
        CHECK(w->cfg.n == 4 && w->cfg.H == 96 && w->cfg.iters == 20 && w->cfg.hc_eps == 1e-6,
              "config n=%d H=%d iters=%d eps=%g", w->cfg.n, w->cfg.H, w->cfg.iters, w->cfg.hc_eps);
        char name[64];
        int64_t ns = 0;
        snprintf(name, sizeof name, "layer%d.hc_streams", layer);
        double *streams = moe_t_load_f64(f, name, &ns);
        snprintf(name, sizeof name, "layer%d.hc_post", layer);
        double *o_post = moe_t_load_f64(f, name, NULL);
        snprintf(name, sizeof name, "layer%d.hc_comb", layer);
        double *o_comb = moe_t_load_f64(f, name, NULL);
        snprintf(name, sizeof name, "layer%d.hc_collapsed", layer);
        double *o_col = moe_t_load_f64(f, name, NULL);
        CHECK(streams && o_post && o_comb && o_col, "oracle lacks layer %d hc tensors", layer);
        if (streams && o_post && o_comb && o_col) {
            int64_t T = ns / (4 * 96);
            double *post = malloc((size_t)T * 4 * sizeof(double)), *comb = malloc((size_t)T * 16 * sizeof(double));
            double *col = malloc((size_t)T * 96 * sizeof(double));
            void *ws = malloc(moe_hc_workspace_size(&w->cfg));
            for (int p = 0; p < 2; p++) {
                moe_hc_forward(w, p ? MOE_HC_F32 : MOE_HC_REF, streams, T, NULL, post, comb, col, ws);
                double e_post = rel_rows(post, o_post, T, 4), e_comb = rel_rows(comb, o_comb, T, 16),
                       e_col = rel_rows(col, o_col, T, 96);
                double *wr = p ? worst32 : worst;
                wr[0] = fmax(wr[0], e_post);
                wr[1] = fmax(wr[1], e_comb);
                wr[2] = fmax(wr[2], e_col);
                for (int64_t t = 0; t < T; t++)
                    CHECK(moe_hc_ds_deviation(comb + t * 16, 4) <= TOL_DS, "layer %d token %lld: comb ds deviation %.3g",
                          layer, (long long)t, moe_hc_ds_deviation(comb + t * 16, 4));
                CHECK(e_post <= TOL_ORACLE && e_comb <= TOL_ORACLE && e_col <= TOL_ORACLE,
                      "layer %d %s: post %.3g comb %.3g collapsed %.3g", layer, p ? "fp32" : "ref", e_post, e_comb,
                      e_col);
            }
            free(post);
            free(comb);
            free(col);
            free(ws);
        }
        free(streams);
        free(o_post);
        free(o_comb);
        free(o_col);
        moe_hc_weights_free(w);
    }
    fprintf(stderr, "  fixture match (max rel, 4 layers): ref post %.3g comb %.3g collapsed %.3g; "
                    "fp32 post %.3g comb %.3g collapsed %.3g\n",
            worst[0], worst[1], worst[2], worst32[0], worst32[1], worst32[2]);
    /* the attention site loads too */
    moe_hc_weights *wa = NULL;
    st = moe_hc_load(m, 3, MOE_HC_ATTN, &wa, &err);
    CHECK_OK(st, err);
    moe_hc_weights_free(wa);
    /* bad layer */
    st = moe_hc_load(m, 4, MOE_HC_FFN, &wa, &err);
    CHECK(st == MOE_ERR_ARG, "layer 4 of 4: %s", moe_status_str(st));
    moe_st_close(f);
    moe_model_free(m);
}

/* splitmix64 -> approx N(0,1) */
static uint64_t rng_state = 12345;
static double gauss(void) { return moe_splitmix64_gauss4(&rng_state); }

static moe_hc_weights *random_weights(int n, int H) {
    moe_hc_config cfg = {n, H, 20, 1e-6, 1e-6};
    int rows = (2 + n) * n, K = n * H;
    double *fn = malloc((size_t)rows * K * sizeof(double)), base[64 * 66], scale[3] = {0.5, 0.5, 2.0};
    for (int i = 0; i < rows * K; i++) fn[i] = gauss() / sqrt((double)K);
    for (int i = 0; i < rows; i++) base[i] = 0.3 * gauss();
    moe_hc_weights *w = NULL;
    moe_error err;
    moe_status st = moe_hc_weights_init(&cfg, fn, base, scale, &w, &err);
    CHECK_OK(st, err);
    free(fn);
    return w;
}

static void test_precisions(void) {
    moe_hc_weights *w = random_weights(4, 256);
    if (!w) return;
    int64_t T = 32;
    double *streams = malloc((size_t)T * 4 * 256 * sizeof(double));
    for (int64_t i = 0; i < T * 4 * 256; i++) streams[i] = gauss() * 3.0;
    moe_hc_prec precs[] = {MOE_HC_REF, MOE_HC_F32, MOE_HC_TF32, MOE_HC_BF16, MOE_HC_BF16_SPLIT};
    moe_hc_audit_row rows[5];
    moe_error err;
    moe_status st = moe_hc_audit(w, streams, T, precs, 5, rows, &err);
    CHECK_OK(st, err);
    CHECK(rows[0].collapsed_rel_err == 0 && rows[0].post_rel_err == 0 && rows[0].comb_max_abs_err == 0,
          "ref vs ref must be exact");
    CHECK(rows[1].collapsed_rel_err <= TOL_F32 && rows[1].post_rel_err <= TOL_F32, "fp32: %.3g %.3g",
          rows[1].collapsed_rel_err, rows[1].post_rel_err);
    CHECK(rows[4].collapsed_rel_err <= TOL_F32 * 10, "bf16 split: %.3g", rows[4].collapsed_rel_err);
    CHECK(rows[3].collapsed_rel_err <= TOL_BF16 && rows[3].post_rel_err <= TOL_BF16, "bf16: %.3g %.3g",
          rows[3].collapsed_rel_err, rows[3].post_rel_err);
    /* ordering: bf16 is worse than tf32, which is worse than the split and fp32 */
    CHECK(rows[3].post_rel_err > rows[2].post_rel_err, "bf16 %.3g vs tf32 %.3g", rows[3].post_rel_err,
          rows[2].post_rel_err);
    CHECK(rows[2].post_rel_err > rows[4].post_rel_err, "tf32 %.3g vs split %.3g", rows[2].post_rel_err,
          rows[4].post_rel_err);
    for (int i = 0; i < 5; i++) {
        /* deviation is 1-Lipschitz in each of the n entries of a row or column sum */
        CHECK(fabs(rows[i].comb_ds_dev - rows[i].comb_ds_dev_ref) <= 4 * rows[i].comb_max_abs_err + 1e-12,
              "%s ds dev %.3g vs ref %.3g", moe_hc_prec_name(precs[i]), rows[i].comb_ds_dev, rows[i].comb_ds_dev_ref);
        fprintf(stderr, "  %-10s collapsed %.3e post %.3e pre %.3e comb %.3e ds %.3e\n", moe_hc_prec_name(precs[i]),
                rows[i].collapsed_rel_err, rows[i].post_rel_err, rows[i].pre_rel_err, rows[i].comb_max_abs_err,
                rows[i].comb_ds_dev);
    }
    /* a NaN token poisons only itself */
    streams[5 * 1024 + 7] = NAN;
    double post[32 * 4];
    void *ws = malloc(moe_hc_workspace_size(&w->cfg));
    moe_hc_forward(w, MOE_HC_REF, streams, T, NULL, post, NULL, NULL, ws);
    CHECK(isnan(post[5 * 4]) && !isnan(post[4 * 4]) && !isnan(post[6 * 4]), "NaN containment");
    free(ws);
    free(streams);
    moe_hc_weights_free(w);
}

static void test_parse_and_args(void) {
    moe_hc_prec p;
    CHECK(moe_hc_prec_parse("bf16-split", &p) && p == MOE_HC_BF16_SPLIT, "parse bf16-split");
    CHECK(moe_hc_prec_parse("tf32", &p) && p == MOE_HC_TF32, "parse tf32");
    CHECK(!moe_hc_prec_parse("fp16", &p), "fp16 is not a precision");
    moe_hc_config bad = {0, 4, 20, 1e-6, 1e-6};
    moe_hc_weights *w = NULL;
    moe_error err;
    CHECK(moe_hc_weights_init(&bad, NULL, NULL, NULL, &w, &err) == MOE_ERR_ARG, "n = 0 rejected");
    double dsm[4] = {0.5, 0.5, 0.5, 0.5}, off[4] = {1, 0, 0.5, 0.5};
    CHECK(moe_hc_ds_deviation(dsm, 2) == 0, "doubly stochastic");
    CHECK(fabs(moe_hc_ds_deviation(off, 2) - 0.5) < 1e-15, "deviation 0.5");
}

int main(void) {
    RUN(test_fixture);
    RUN(test_precisions);
    RUN(test_parse_and_args);
    return moe_t_finish();
}
