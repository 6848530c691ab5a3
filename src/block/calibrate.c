/*
 * Static activation scales for NVFP4 (W4A4) as ModelOpt calibrates them
 * (NVIDIA Model-Optimizer examples/deepseek, quantize_to_nvfp4.py):
 *
 *   input amax of an expert GEMM = max |x| over the tokens the router sends
 *     to that expert (GEMM1: the block input; GEMM2: the SwiGLU output);
 *     w1 and w3 share one input amax (one x, one fused GEMM1);
 *   input_scale = amax / (6 * 448);
 *   an expert no calibration token reached takes the largest amax of the
 *     calibrated experts for the same projection.
 *
 * The amaxes come from the layer being calibrated (ModelOpt calibrates the
 * unquantized model: pass the BF16 layer), routed in float64 by the layer's
 * own router, with float32 expert GEMMs through the kernel table (an amax
 * needs no float64).
 *
 * Invariants:
 *  1. The result depends on (layer, hidden, ids) only: tokens are visited in
 *     order, maxima are order-free, the kernels are deterministic.
 *  2. Nothing is written to the layer by moe_layer_calib_amax; only
 *     moe_layer_calibrate_nvfp4 writes input scales (into a caller-owned
 *     layer) and then the derived act_scale fields.
 */
#include "block/calibrate.h"
#include "core/core.h"
#include "cpu/kernels.h"
#include "moe_formats.h"
#include "router/router.h"

#include <math.h>
#include <string.h>

static float amax_of(const float *x, int64_t n) {
    float m = 0.0f;
    for (int64_t i = 0; i < n; i++) {
        float a = fabsf(x[i]);
        if (a > m) m = a; /* NaN never wins */
    }
    return m;
}

moe_status moe_swiglu_amax(const moe_weight *w1, const moe_weight *w3, double limit, const float *X, int64_t n,
                           float *amax_in, float *amax_mid, moe_error *err) {
    *amax_in = *amax_mid = 0.0f;
    if (n == 0) return MOE_OK;
    int64_t H = w1->cols, I = w1->rows;
    const moe_cpu_kernels *k = NULL;
    moe_status st = moe_cpu_table(MOE_ISA_AUTO, &k, err);
    if (st != MOE_OK) return st;
    float *G = moe_malloc((size_t)(2 * n * I), sizeof(float));
    if (!G) return moe_errf(err, MOE_ERR_NOMEM, "out of memory calibrating %s", w1->name ? w1->name : "?");
    float *U = G + n * I, L = (float)limit;
    k->gemm(w1, 0, I, X, H, n, G, I);
    k->gemm(w3, 0, I, X, H, n, U, I);
    moe_cpu_swiglu(k)(G, U, n * I, L); /* moe_swiglu_f32's bits, as moe_expert_f32 */
    *amax_in = amax_of(X, n * H);
    *amax_mid = amax_of(G, n * I);
    free(G);
    return MOE_OK;
}

moe_status moe_layer_calib_amax(const moe_layer *L, const double *hidden, const int64_t *ids, int64_t T,
                                moe_calib_amax *out, moe_error *err) {
    const moe_block_config *c = &L->cfg;
    int E = c->n_experts, H = c->hidden, K = c->top_k;
    memset(out, 0, sizeof *out);
    moe_status st = moe_router_check_ids(c, L->index, ids, T, 0, err);
    if (st != MOE_OK) return st;
    out->E = E;
    out->in13 = moe_calloc((size_t)E, sizeof(float));
    out->in2 = moe_calloc((size_t)E, sizeof(float));
    out->tokens = moe_calloc((size_t)E, sizeof(int64_t));
    double *logits = moe_malloc((size_t)(T > 0 ? T : 1) * (size_t)E, sizeof(double));
    double *work = moe_malloc((size_t)(2 * E + 2 * K), sizeof(double));
    int32_t *sel = moe_malloc((size_t)(T > 0 ? T : 1) * (size_t)K, sizeof(int32_t));
    float *X = moe_malloc((size_t)(T > 0 ? T : 1) * (size_t)H, sizeof(float));
    int64_t *rows = moe_malloc((size_t)(T > 0 ? T : 1), sizeof(int64_t));
    if (!out->in13 || !out->in2 || !out->tokens || !logits || !work || !sel || !X || !rows) {
        st = moe_errf(err, MOE_ERR_NOMEM, "out of memory calibrating layer %d", L->index);
        goto done;
    }
    if ((st = moe_router_logits(L, false, MOE_ROUTER_PATH, hidden, T, logits, err)) != MOE_OK) goto done;
    for (int64_t t = 0; t < T; t++)
        moe_route_token(L, logits + t * E, ids ? ids[t] : 0, NULL, sel + t * K, work + 2 * E, work);
    for (int e = 0; e < E; e++) {
        int64_t n = 0;
        for (int64_t t = 0; t < T; t++)
            for (int j = 0; j < K; j++)
                if (sel[t * K + j] == e) { rows[n++] = t; break; }
        out->tokens[e] = n;
        if (n == 0 || L->w1[e].rows == 0) continue;
        for (int64_t q = 0; q < n; q++)
            for (int h = 0; h < H; h++) X[q * H + h] = (float)hidden[rows[q] * H + h];
        st = moe_swiglu_amax(&L->w1[e], &L->w3[e], c->swiglu_limit, X, n, &out->in13[e], &out->in2[e], err);
        if (st != MOE_OK) goto done;
    }
    if (c->shared_inter > 0) {
        for (int64_t i = 0; i < T * H; i++) X[i] = (float)hidden[i];
        st = moe_swiglu_amax(&L->sw1, &L->sw3, c->swiglu_limit, X, T, &out->shared_in13, &out->shared_in2, err);
    }
done:
    free(logits);
    free(work);
    free(sel);
    free(X);
    free(rows);
    if (st != MOE_OK) moe_calib_amax_free(out);
    return st;
}

void moe_calib_amax_free(moe_calib_amax *a) {
    if (!a) return;
    free(a->in13);
    free(a->in2);
    free(a->tokens);
    memset(a, 0, sizeof *a);
}

void moe_calib_fill_uncalibrated(moe_calib_amax *a) {
    float m13 = 0.0f, m2 = 0.0f;
    for (int e = 0; e < a->E; e++)
        if (a->tokens[e] > 0) {
            if (a->in13[e] > m13) m13 = a->in13[e];
            if (a->in2[e] > m2) m2 = a->in2[e];
        }
    for (int e = 0; e < a->E; e++)
        if (a->tokens[e] == 0) {
            a->in13[e] = m13;
            a->in2[e] = m2;
        }
}


moe_status moe_layer_calibrate_nvfp4(moe_layer *L, const moe_layer *ref, const double *hidden, const int64_t *ids,
                                     int64_t T, moe_error *err) {
    if (!ref) ref = L;
    if (ref->cfg.n_experts != L->cfg.n_experts || ref->cfg.hidden != L->cfg.hidden)
        return moe_errf(err, MOE_ERR_ARG, "calibration: layer %d and its reference differ in shape", L->index);
    moe_calib_amax a;
    moe_status st = moe_layer_calib_amax(ref, hidden, ids, T, &a, err);
    if (st != MOE_OK) return st;
    int64_t hit = 0;
    for (int e = 0; e < a.E; e++) hit += a.tokens[e] > 0;
    if (hit == 0) {
        moe_calib_amax_free(&a);
        return moe_errf(err, MOE_ERR_INPUT, "calibration: no token of %lld reached any expert of layer %d",
                        (long long)T, L->index);
    }
    moe_calib_fill_uncalibrated(&a);
    /* the experts live in the layer's store, which the caller owns */
    moe_weight *w1 = (moe_weight *)(void *)L->w1, *w3 = (moe_weight *)(void *)L->w3, *w2 = (moe_weight *)(void *)L->w2;
    for (int e = 0; e < a.E; e++) {
        w1[e].input_scale = w3[e].input_scale = moe_nvfp4_input_scale(a.in13[e]);
        w2[e].input_scale = moe_nvfp4_input_scale(a.in2[e]);
    }
    if (L->cfg.shared_inter > 0) {
        L->sw1.input_scale = L->sw3.input_scale = moe_nvfp4_input_scale(a.shared_in13);
        L->sw2.input_scale = moe_nvfp4_input_scale(a.shared_in2);
    }
    moe_calib_amax_free(&a);
    moe_layer_act_scales(L);
    return MOE_OK;
}

/* The checkpoint writer (src/io/quantize.c) with this room's calibration. */
static const moe_quant_calibrator calibrator = {moe_swiglu_amax, moe_layer_calib_amax, moe_calib_fill_uncalibrated,
                                                moe_calib_amax_free};

moe_status moe_quantize_checkpoint_with(const char *in_dir, const char *out_dir, const moe_quant_opts *o,
                                        const moe_quant_file_opts *fo, moe_quant_report *rep, moe_error *err) {
    return moe_quantize_checkpoint_calib(in_dir, out_dir, o, fo, &calibrator, rep, err);
}

moe_status moe_quantize_checkpoint(const char *in_dir, const char *out_dir, const moe_quant_opts *o,
                                   moe_quant_report *rep, moe_error *err) {
    return moe_quantize_checkpoint_calib(in_dir, out_dir, o, NULL, &calibrator, rep, err);
}
