/*
 * moeaudit quantize: write MXFP4 / NVFP4 / FP8 checkpoints from a synthetic
 * BF16 one, load them back through the normal loader, and check every weight
 * row against the original within the format's own rounding bound, the
 * untouched tensors bit for bit, and the block's outputs.
 */
#include "harness.h"

#include <dirent.h>
#include <sys/stat.h>
#include "moe_formats.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

static char bf16_dir[512];

static void make_bf16(void) {
    moe_synth_opts o = moe_synth_opts_default();
    moe_t_tmp_path(bf16_dir, sizeof bf16_dir, "bf16");
    moe_error err;
    CHECK_OK(moe_synth_write(bf16_dir, &o, &err), err);
}

/* Largest error a format's encoder may make on element x of a row, given the
 * decoded block scale S (element unit) and the block's amax:
 *   MXFP4 (ceil rule): the block maps into [-6, 6] without clipping; the
 *     widest E2M1 gap is 4..6, so the error is at most 1 x S.
 *   NVFP4: the UE4M3 block scale rounds (3 mantissa bits, 2^-4 relative) so
 *     the block may clip up to amax x 2^-4 beyond 6 x S; otherwise 1 x S.
 *   FP8 E4M3 tiles: 2^-4 relative (3 mantissa bits), plus half the smallest
 *     subnormal step (2^-10 x S) near zero. */
static double bound(moe_wfmt f, double x, double S, double amax) {
    S *= 1 + 1e-6; /* a tie (5 -> 4) sits exactly on the bound; S is recomputed here in double */
    switch (f) {
    case MOE_WFMT_MXFP4: return 1.0 * S;
    case MOE_WFMT_NVFP4: return fmax(1.0 * S, amax * 0x1p-4);
    case MOE_WFMT_FP8_BLOCK: return fabs(x) * 0x1p-4 + 0x1p-10 * S;
    default: return 0;
    }
}

static double block_scale(const moe_weight *w, int64_t r, int64_t c) {
    const uint8_t *s = w->scale;
    switch (w->fmt) {
    case MOE_WFMT_MXFP4: return moe_e8m0_to_f32(s[r * w->scale_cols + c / 32]);
    case MOE_WFMT_NVFP4: return (double)moe_ue4m3_to_f32(s[r * w->scale_cols + c / 16]) * w->scale2;
    case MOE_WFMT_FP8_BLOCK: {
        size_t i = (size_t)((r / 128) * w->scale_cols + c / 128);
        if (w->scale_dtype == MOE_DTYPE_F8_E8M0) return moe_e8m0_to_f32(s[i]);
        float f;
        memcpy(&f, s + 4 * i, 4);
        return f;
    }
    default: return 1;
    }
}

/* Every row of q within the format's bound of the same row of ref. */
static int check_weight(const moe_weight *ref, const moe_weight *q, moe_wfmt want) {
    if (q->fmt != want) return 1;
    int64_t cols = ref->cols;
    double *a = malloc((size_t)cols * sizeof *a), *b = malloc((size_t)cols * sizeof *b);
    int bad = 0;
    int blk = want == MOE_WFMT_MXFP4 ? 32 : want == MOE_WFMT_NVFP4 ? 16 : 128;
    for (int64_t r = 0; r < ref->rows && !bad; r++) {
        moe_weight_row_f64(ref, r, a);
        moe_weight_row_f64(q, r, b);
        for (int64_t c0 = 0; c0 < cols; c0 += blk) {
            double amax = 0;
            for (int64_t c = c0; c < c0 + blk && c < cols; c++) amax = fmax(amax, fabs(a[c]));
            for (int64_t c = c0; c < c0 + blk && c < cols; c++)
                if (!(fabs(a[c] - b[c]) <= bound(want, a[c], block_scale(q, r, c), amax))) {
                    fprintf(stderr, "  %s[%lld][%lld]: %.9g -> %.9g (bound %.3g)\n", q->name, (long long)r,
                            (long long)c, a[c], b[c], bound(want, a[c], block_scale(q, r, c), amax));
                    bad = 1;
                    break;
                }
        }
    }
    free(a);
    free(b);
    return bad;
}

static void quantize_and_check(moe_qfmt experts, moe_qfmt others, moe_wfmt want, double out_bound) {
    char dir[600];
    snprintf(dir, sizeof dir, "%s/q-%s-%s", moe_t_tmpdir(), moe_qfmt_name(experts), moe_qfmt_name(others));
    moe_quant_opts o = {experts, others, 0, 0};
    moe_quant_report rep;
    moe_error err;
    moe_status st = moe_quantize_checkpoint(bf16_dir, dir, &o, &rep, &err);
    CHECK_OK(st, err);
    if (st) return;
    moe_model *mr = NULL, *mq = NULL;
    CHECK_OK(moe_model_open(bf16_dir, &mr, &err), err);
    st = moe_model_open(dir, &mq, &err);
    CHECK_OK(st, err);
    if (st) { moe_model_free(mr); return; }
    for (int l = 0; l < 2; l++) {
        const moe_layer *A, *B;
        CHECK_OK(moe_model_layer(mr, l, &A, &err), err);
        st = moe_model_layer(mq, l, &B, &err);
        CHECK_OK(st, err);
        if (st) continue;
        int bad = 0;
        for (int e = 0; e < A->cfg.n_experts; e++) {
            bad += check_weight(&A->w1[e], &B->w1[e], want);
            bad += check_weight(&A->w3[e], &B->w3[e], want);
            bad += check_weight(&A->w2[e], &B->w2[e], want);
        }
        CHECK(bad == 0, "%s layer %d: %d expert weights outside the %s bound", dir, l, bad, moe_qfmt_name(experts));
        moe_wfmt sw = others == MOE_Q_FP8 ? MOE_WFMT_FP8_BLOCK : MOE_WFMT_BF16;
        if (others == MOE_Q_FP8) {
            CHECK(check_weight(&A->sw1, &B->sw1, sw) == 0 && check_weight(&A->sw2, &B->sw2, sw) == 0,
                  "shared expert FP8 within bound");
        } else {
            CHECK(B->sw1.fmt == MOE_WFMT_BF16, "shared expert kept BF16");
        }
        CHECK(B->gate.fmt == MOE_WFMT_BF16, "router kept BF16");
        if (want == MOE_WFMT_NVFP4) {
            /* gate and up share one weight_scale_2 (the larger amax), as
             * ModelOpt exports them for a fused GEMM1: nothing to reconcile;
             * every expert carries a calibrated input_scale, and act_scale
             * is the layer's largest */
            int same = 0, scaled = 0;
            float m13 = 0;
            for (int e = 0; e < B->cfg.n_experts; e++) {
                same += B->w1[e].scale2 == B->w3[e].scale2;
                scaled += B->w1[e].input_scale > 0 && B->w3[e].input_scale == B->w1[e].input_scale &&
                          B->w2[e].input_scale > 0;
                m13 = fmaxf(m13, B->w1[e].input_scale);
            }
            CHECK(same == B->cfg.n_experts && B->nvfp4_scale2_mismatch == 0, "w1/w3 share weight_scale_2 (%d of %d)",
                  same, B->cfg.n_experts);
            CHECK(scaled == B->cfg.n_experts && B->w1[0].act_scale == m13 && B->w3[1].act_scale == m13,
                  "input scales: %d of %d, act_scale %g vs max %g", scaled, B->cfg.n_experts, B->w1[0].act_scale, m13);
            /* the in-memory quantizer makes the same weights */
            moe_layer *Q = NULL;
            CHECK_OK(moe_layer_quantize(A, &o, &Q, &err), err);
            int eq = 0;
            for (int e = 0; Q && e < A->cfg.n_experts; e++)
                eq += Q->w1[e].scale2 == B->w1[e].scale2 && Q->w2[e].scale2 == B->w2[e].scale2 &&
                      !memcmp(Q->w1[e].data, B->w1[e].data, (size_t)(B->w1[e].rows * B->w1[e].cols / 2));
            CHECK(Q && eq == A->cfg.n_experts && Q->nvfp4_scale2_mismatch == 0,
                  "in-memory NVFP4 equals the written checkpoint (%d of %d experts)", eq, A->cfg.n_experts);
            if (Q) moe_layer_free(Q);
        } else {
            CHECK(B->nvfp4_scale2_mismatch == 0, "no NVFP4, no mismatch");
        }
        /* the same tokens: the router is untouched, so routing is identical
         * and only the experts' values move */
        int64_t T = 24;
        int H = A->cfg.hidden;
        double *x = malloc((size_t)(T * H) * sizeof *x);
        int64_t ids[24];
        for (int64_t i = 0; i < T * H; i++) x[i] = sin(0.7 * (double)i + l);
        for (int t = 0; t < T; t++) ids[t] = (t * 7) % 64;
        moe_run_opts ro = moe_run_opts_default();
        moe_block_out oa, ob;
        CHECK_OK(moe_block_out_init(&oa, A, T, &ro, &err), err);
        CHECK_OK(moe_block_out_init(&ob, B, T, &ro, &err), err);
        CHECK_OK(moe_block_run(A, x, ids, T, &ro, &oa, &err), err);
        CHECK_OK(moe_block_run(B, x, ids, T, &ro, &ob, &err), err);
        CHECK(!memcmp(oa.topk_ids, ob.topk_ids, (size_t)(T * oa.n_cols) * sizeof(int32_t)), "same routing");
        double e = 0, m = 0;
        for (int64_t i = 0; i < T * H; i++) {
            e = fmax(e, fabs(oa.moe_out[i] - ob.moe_out[i]));
            m = fmax(m, fabs(oa.moe_out[i]));
        }
        CHECK(e > 0 && e / m <= out_bound, "%s layer %d: moe_out rel err %.3g not in (0, %g]", dir, l, e / m,
              out_bound);
        fprintf(stderr, "  experts %-5s others %-4s layer %d: moe_out rel err %.3g\n", moe_qfmt_name(experts),
                moe_qfmt_name(others), l, e / m);
        moe_block_out_free(&oa);
        moe_block_out_free(&ob);
        free(x);
    }
    moe_model_free(mr);
    moe_model_free(mq);
}

/* Output bounds: the element bounds above are ~1/12 (E2M1 near its top) and
 * 1/16 (E4M3) relative; a dot product of random-signed errors grows as
 * sqrt(n) against a sum growing as sqrt(n) too, so the output stays within
 * the same order: 0.25 for the FP4 formats, 0.1 for FP8. */
static void test_roundtrip(void) {
    make_bf16();
    quantize_and_check(MOE_Q_MXFP4, MOE_Q_NONE, MOE_WFMT_MXFP4, 0.25);
    quantize_and_check(MOE_Q_MXFP4, MOE_Q_FP8, MOE_WFMT_MXFP4, 0.25);
    quantize_and_check(MOE_Q_NVFP4, MOE_Q_NONE, MOE_WFMT_NVFP4, 0.25);
    quantize_and_check(MOE_Q_FP8, MOE_Q_FP8, MOE_WFMT_FP8_BLOCK, 0.1);
}

static void test_refusals(void) {
    moe_quant_opts o = {MOE_Q_MXFP4, MOE_Q_NONE, 0, 0};
    moe_quant_report rep;
    moe_error err = {{0}};
    char dir[600];
    moe_t_tmp_path(dir, sizeof dir, "q-bad");
    /* I = 40 is not a multiple of the MXFP4 block: name the tensor */
    moe_status st = moe_quantize_checkpoint(moe_t_data("dsv4-tiny"), dir, &o, &rep, &err);
    CHECK(st == MOE_ERR_SHAPE && strstr(err.msg, ".w2.weight") != NULL, "I = 40 with MXFP4: %s", err.msg);
    /* an already quantized checkpoint */
    st = moe_quantize_checkpoint(moe_t_data("dsv3-tiny-fp8"), dir, &o, &rep, &err);
    CHECK(st == MOE_ERR_DTYPE && strstr(err.msg, "already quantized") != NULL, "FP8 input: %s", err.msg);
    /* FP8 works on any shape (edge tiles) */
    o.experts = MOE_Q_FP8;
    moe_t_tmp_path(dir, sizeof dir, "q-v3-fp8");
    CHECK_OK(moe_quantize_checkpoint(moe_t_data("dsv3-tiny"), dir, &o, &rep, &err), err);
    moe_model *m = NULL;
    CHECK_OK(moe_model_open(dir, &m, &err), err);
    const moe_layer *L = NULL;
    if (m) CHECK_OK(moe_model_layer(m, 1, &L, &err), err);
    if (L) {
        CHECK(L->w1[0].fmt == MOE_WFMT_FP8_BLOCK && L->w1[0].scale_dtype == MOE_DTYPE_F32,
              "HF V3 names get fp32 weight_scale_inv");
    }
    moe_model_free(m);
    /* in place is refused */
    st = moe_quantize_checkpoint(bf16_dir, bf16_dir, &o, &rep, &err);
    CHECK(st == MOE_ERR_ARG, "in-place quantize refused: %s", moe_status_str(st));
}

/* Entries of dir other than "." and "..", or -1 when it does not exist. */
static int n_entries(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL)
        if (strcmp(de->d_name, ".") && strcmp(de->d_name, "..")) n++;
    closedir(d);
    return n;
}

/* #10: quantize wrote every shard before reading config.json, so a bad
 * config.json (or any late failure) left a half-written output directory.
 * Now nothing reaches out_dir unless the whole copy was made. */
static void test_nothing_on_failure(void) {
    moe_quant_opts o = {MOE_Q_FP8, MOE_Q_NONE, 0, 0};
    moe_quant_report rep;
    moe_error err = {{0}};
    char in[600], out[600], p[700];
    moe_t_tmp_path(in, sizeof in, "q-in-badcfg");
    mkdir(in, 0755);
    snprintf(p, sizeof p, "%s/model.safetensors", in);
    FILE *src = fopen(moe_t_data("dsv3-tiny/model.safetensors"), "rb"), *dst = fopen(p, "wb");
    char buf[65536];
    size_t k;
    while (src && dst && (k = fread(buf, 1, sizeof buf, src)) > 0) fwrite(buf, 1, k, dst);
    if (src) fclose(src);
    if (dst) fclose(dst);
    snprintf(p, sizeof p, "%s/config.json", in);
    FILE *c = fopen(p, "w");
    fputs("[\"not an object\"]", c);
    fclose(c);
    moe_t_tmp_path(out, sizeof out, "q-out-new");
    moe_status st = moe_quantize_checkpoint(in, out, &o, &rep, &err);
    CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "config.json"), "bad config: %s: %s", moe_status_str(st), err.msg);
    CHECK(n_entries(out) == -1, "output directory created on failure (%d entries)", n_entries(out));
    /* an existing output directory keeps what it had */
    moe_t_tmp_path(out, sizeof out, "q-out-old");
    mkdir(out, 0755);
    snprintf(p, sizeof p, "%s/model.safetensors", out);
    c = fopen(p, "w");
    fputs("previous", c);
    fclose(c);
    st = moe_quantize_checkpoint(in, out, &o, &rep, &err);
    CHECK(st == MOE_ERR_FORMAT, "bad config again: %s", err.msg);
    CHECK(n_entries(out) == 1, "files added to the old output: %d", n_entries(out));
    char got[64] = "";
    moe_t_read_file(p, got, sizeof got);
    CHECK(strcmp(got, "previous") == 0, "old output file damaged: %s", got);
    /* a late failure (the MXFP4 block does not divide I = 40 in dsv4-tiny:
     * found while quantizing, after other tensors were done) */
    o.experts = MOE_Q_MXFP4;
    moe_t_tmp_path(out, sizeof out, "q-out-late");
    st = moe_quantize_checkpoint(moe_t_data("dsv4-tiny"), out, &o, &rep, &err);
    CHECK(st == MOE_ERR_SHAPE, "late failure: %s", err.msg);
    CHECK(n_entries(out) == -1, "output directory after a late failure (%d entries)", n_entries(out));
    CHECK(n_entries(moe_t_tmpdir()) > 0 && moe_t_count_temps(moe_t_tmpdir()) == 0, "staging left behind: %d",
          moe_t_count_temps(moe_t_tmpdir()));
    /* success into the existing directory replaces its files, adds the rest */
    o.experts = MOE_Q_FP8;
    moe_t_tmp_path(out, sizeof out, "q-out-old");
    CHECK_OK(moe_quantize_checkpoint(moe_t_data("dsv3-tiny"), out, &o, &rep, &err), err);
    moe_model *m = NULL;
    CHECK_OK(moe_model_open(out, &m, &err), err);
    moe_model_free(m);
    CHECK(moe_t_count_temps(moe_t_tmpdir()) == 0, "staging left behind after success");
}

/* The in-memory NVFP4 quantizer's per-tensor weight_scale_2 is the reference
 * helper's over the whole decoded weight (its amax, found branch-free by bit
 * pattern): equal to the bit, for every routed matrix. Gate and up share one
 * (ModelOpt's export, one fused GEMM1): the helper's over both. */
static void test_nvfp4_scale2(void) {
    moe_synth_opts so = moe_synth_opts_default();
    moe_error err;
    moe_layer *L = NULL, *Q = NULL;
    CHECK_OK(moe_synth_layer(&so, 1, &L, &err), err);
    if (!L) return;
    moe_quant_opts o = {MOE_Q_NVFP4, MOE_Q_NONE, 0, 0};
    CHECK_OK(moe_layer_quantize(L, &o, &Q, &err), err);
    int bad = 0, n = 0;
    for (int e = 0; Q && e < L->cfg.n_experts; e++) {
        const moe_weight *src[3] = {&L->w1[e], &L->w3[e], &L->w2[e]}, *dst[3] = {&Q->w1[e], &Q->w3[e], &Q->w2[e]};
        for (int k = 0; k < 3; k++) {
            int64_t rows = src[k]->rows, cols = src[k]->cols;
            /* w1 and w3: both matrices, one after the other */
            const moe_weight *part[2] = {k < 2 ? src[0] : src[2], k < 2 ? src[1] : NULL};
            float *x = malloc((size_t)(2 * rows * cols) * sizeof *x);
            int64_t m = 0;
            for (int p = 0; p < 2 && part[p]; p++)
                for (int64_t r = 0; r < rows; r++, m += cols) moe_weight_row_f32(part[p], r, x + m);
            float want = moe_nvfp4_scale2(x, m);
            bad += dst[k]->fmt != MOE_WFMT_NVFP4 || memcmp(&want, &dst[k]->scale2, sizeof want) != 0;
            n++;
            free(x);
        }
    }
    CHECK(n > 0 && bad == 0, "%d of %d NVFP4 weight_scale_2 differ from moe_nvfp4_scale2", bad, n);
    if (Q) moe_layer_free(Q);
    moe_layer_free(L);
}

int main(void) {
    RUN(test_roundtrip);
    RUN(test_nvfp4_scale2);
    RUN(test_refusals);
    RUN(test_nothing_on_failure);
    return moe_t_finish();
}
