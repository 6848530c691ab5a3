/* `moeaudit run --block hc_ffn|hc_attn`: one layer's hyper-connection. */
#include "cli.h"
#include "cmd_extra.h"
#include "moeaudit_hc.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef MOE_DEFAULT_MODEL
#define MOE_DEFAULT_MODEL "tests/data/dsv4-tiny"
#endif

static const char hc_help[] =
    "usage: moeaudit run --block hc_ffn|hc_attn [--model DIR] [--layer N] [--input IN.safetensors]\n"
    "                    [--output OUT.safetensors] [--precision P] [--audit] [--json] [--tokens T]\n"
    "\n"
    "Run layer N's mHC hyper-connection (hc_ffn_* or hc_attn_* weights) on the streams of IN.\n"
    "\n"
    "  --block B        hc_ffn (before the MoE block) or hc_attn (before attention)\n"
    "  --model DIR      checkpoint directory; default: the bundled tiny DeepSeek V4 checkpoint\n"
    "  --layer N        layer index (default 0)\n"
    "  --input FILE     safetensors with streams [T, hc_mult, hidden] (F64, F32, BF16 or F16);\n"
    "                   default: --tokens T (8) random streams from a fixed seed\n"
    "  --output FILE    write pre [T, n], post [T, n], comb [T, n, n] (comb[t, j, k]: the new\n"
    "                   stream k takes comb[j, k] of old stream j) and collapsed [T, H], all F64\n"
    "  --precision P    the MHC linear: ref (float64 throughout, default), fp32, tf32, bf16,\n"
    "                   bf16-split (hi/lo bf16, three products); non-ref paths run the rest in fp32\n"
    "  --audit          compare every precision against ref: collapsed and post max relative\n"
    "                   error (per token, infinity norm), comb max abs error, and how far comb is\n"
    "                   from doubly stochastic (max |row or column sum - 1|)\n"
    "  --json           print the audit rows (or the run summary) as JSON\n"
    "\n"
    "Exit status: 0 success, 1 failure, 2 usage or input error.\n";


static int read_streams(const char *path, int n, int H, double **out, int64_t *T) {
    moe_error err;
    moe_st_file *f = NULL;
    moe_status st = moe_st_open(path, &f, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    int rc = EXIT_USAGE;
    const moe_st_tensor *t = moe_st_find(f, "streams");
    if (!t) fprintf(stderr, "moeaudit: %s: no tensor named \"streams\"\n", path);
    else if (!moe_dtype_is_float(t->dtype))
        fprintf(stderr, "moeaudit: %s: tensor streams has dtype %s; expected F64, F32, BF16 or F16\n", path,
                moe_dtype_name(t->dtype));
    else if (t->ndim != 3 || t->shape[1] != n || t->shape[2] != H || t->shape[0] < 1)
        fprintf(stderr, "moeaudit: %s: tensor streams must have shape [T >= 1, %d, %d] (hc_mult, hidden_size)\n", path,
                n, H);
    else {
        *T = t->shape[0];
        size_t cnt = (size_t)(*T) * n * H;
        *out = malloc(cnt * sizeof(double));
        if (!*out) { fprintf(stderr, "moeaudit: out of memory\n"); rc = EXIT_FAIL; }
        else {
            for (size_t i = 0; i < cnt; i++) (*out)[i] = moe_load_f64(t->data, t->dtype, i);
            rc = EXIT_OKAY;
        }
    }
    moe_st_close(f);
    return rc;
}

int moe_cmd_run_hc(int argc, char **argv) {
    const char *model_dir = MOE_DEFAULT_MODEL, *in_path = NULL, *out_path = NULL, *block = NULL;
    long layer = 0, tokens = 8;
    moe_hc_prec prec = MOE_HC_REF;
    bool audit = false, json = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has_val = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(hc_help, stdout); return EXIT_OKAY; }
        else if (!strcmp(a, "--audit")) audit = true;
        else if (!strcmp(a, "--json")) json = true;
        else if (!has_val && !strncmp(a, "--", 2)) return moe_cli_usage("run", "option %s needs a value", a);
        else if (!strcmp(a, "--block")) block = argv[++i];
        else if (!strcmp(a, "--model")) model_dir = argv[++i];
        else if (!strcmp(a, "--input")) in_path = argv[++i];
        else if (!strcmp(a, "--output")) out_path = argv[++i];
        else if (!strcmp(a, "--layer")) {
            if (!moe_cli_parse_int(argv[++i], 0, 1000000, &layer)) return moe_cli_usage("run", "--layer %s: not a layer index", argv[i]);
        } else if (!strcmp(a, "--tokens")) {
            if (!moe_cli_parse_int(argv[++i], 1, 1 << 20, &tokens)) return moe_cli_usage("run", "--tokens %s: not a positive count", argv[i]);
        } else if (!strcmp(a, "--precision")) {
            if (!moe_hc_prec_parse(argv[++i], &prec))
                return moe_cli_usage("run", "--precision %s: expected ref, fp32, tf32, bf16 or bf16-split", argv[i]);
        } else return moe_cli_usage("run", "unknown argument %s", a);
    }
    if (!block) return moe_cli_usage("run", "%s", "--block hc_ffn|hc_attn is required");
    moe_hc_site site;
    if (!strcmp(block, "hc_ffn")) site = MOE_HC_FFN;
    else if (!strcmp(block, "hc_attn")) site = MOE_HC_ATTN;
    else return moe_cli_usage("run", "--block %s: expected hc_ffn or hc_attn", block);

    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(model_dir, &m, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    moe_hc_weights *w = NULL;
    st = moe_hc_load(m, (int)layer, site, &w, &err);
    if (st != MOE_OK) { moe_model_free(m); return moe_cli_fail(st, &err); }
    const int n = w->cfg.n, H = w->cfg.H;
    double *streams = NULL;
    int64_t T = tokens;
    int rc = EXIT_OKAY;
    if (in_path) rc = read_streams(in_path, n, H, &streams, &T);
    else {
        streams = malloc((size_t)T * n * H * sizeof(double));
        if (!streams) rc = EXIT_FAIL;
        uint64_t seed = 20261130;
        for (size_t i = 0; streams && i < (size_t)T * n * H; i++) {
            double u = 0;
            for (int k = 0; k < 4; k++) u += (double)(moe_cli_mix(&seed) >> 11) * 0x1.0p-53;
            streams[i] = (u - 2.0) * sqrt(3.0);
        }
    }
    double *pre = NULL, *post = NULL, *comb = NULL, *col = NULL;
    void *ws = NULL;
    if (rc != EXIT_OKAY) goto out;
    pre = malloc((size_t)T * n * sizeof(double));
    post = malloc((size_t)T * n * sizeof(double));
    comb = malloc((size_t)T * n * n * sizeof(double));
    col = malloc((size_t)T * H * sizeof(double));
    ws = malloc(moe_hc_workspace_size(&w->cfg));
    if (!pre || !post || !comb || !col || !ws) { fprintf(stderr, "moeaudit: out of memory\n"); rc = EXIT_FAIL; goto out; }
    moe_hc_forward(w, prec, streams, T, pre, post, comb, col, ws);
    double ds = 0;
    for (int64_t t = 0; t < T; t++) ds = fmax(ds, moe_hc_ds_deviation(comb + t * n * n, n));
    if (out_path) {
        moe_st_entry e[4] = {
            {"pre", MOE_DTYPE_F64, 2, {T, n}, pre},
            {"post", MOE_DTYPE_F64, 2, {T, n}, post},
            {"comb", MOE_DTYPE_F64, 3, {T, n, n}, comb},
            {"collapsed", MOE_DTYPE_F64, 2, {T, H}, col},
        };
        const char *meta[] = {"block", block, "precision", moe_hc_prec_name(prec), NULL};
        st = moe_st_write(out_path, e, 4, meta, &err);
        if (st != MOE_OK) { rc = moe_cli_fail(st, &err); goto out; }
    }
    if (!audit) {
        if (json)
            printf("{\"block\": \"%s\", \"layer\": %ld, \"tokens\": %lld, \"precision\": \"%s\", \"comb_ds_dev\": %.6g}\n",
                   block, layer, (long long)T, moe_hc_prec_name(prec), ds);
        else
            printf("layer %ld %s: %lld tokens, hc_mult %d, %d Sinkhorn iterations, precision %s; first token post "
                   "[%.6f %.6f ...], comb deviation from doubly stochastic %.3g%s%s\n",
                   layer, block, (long long)T, n, w->cfg.iters, moe_hc_prec_name(prec), post[0], n > 1 ? post[1] : 0.0,
                   ds, out_path ? "; wrote " : "", out_path ? out_path : "");
        goto out;
    }
    moe_hc_prec precs[MOE_HC_PREC_COUNT - 1] = {MOE_HC_F32, MOE_HC_TF32, MOE_HC_BF16, MOE_HC_BF16_SPLIT};
    moe_hc_audit_row rows[MOE_HC_PREC_COUNT - 1];
    st = moe_hc_audit(w, streams, T, precs, MOE_HC_PREC_COUNT - 1, rows, &err);
    if (st != MOE_OK) { rc = moe_cli_fail(st, &err); goto out; }
    if (json) {
        for (int i = 0; i < MOE_HC_PREC_COUNT - 1; i++)
            printf("{\"block\": \"%s\", \"layer\": %ld, \"tokens\": %lld, \"precision\": \"%s\", "
                   "\"collapsed_rel_err\": %.6g, \"post_rel_err\": %.6g, \"pre_rel_err\": %.6g, "
                   "\"comb_max_abs_err\": %.6g, \"comb_ds_dev\": %.6g, \"comb_ds_dev_ref\": %.6g}\n",
                   block, layer, (long long)T, moe_hc_prec_name(rows[i].prec), rows[i].collapsed_rel_err,
                   rows[i].post_rel_err, rows[i].pre_rel_err, rows[i].comb_max_abs_err, rows[i].comb_ds_dev,
                   rows[i].comb_ds_dev_ref);
    } else {
        printf("layer %ld %s, %lld tokens: the MHC linear at each precision vs float64\n", layer, block, (long long)T);
        printf("  %-11s %14s %14s %14s %16s\n", "precision", "collapsed rel", "post rel", "comb abs", "comb ds dev");
        for (int i = 0; i < MOE_HC_PREC_COUNT - 1; i++)
            printf("  %-11s %14.3e %14.3e %14.3e %16.3e\n", moe_hc_prec_name(rows[i].prec), rows[i].collapsed_rel_err,
                   rows[i].post_rel_err, rows[i].comb_max_abs_err, rows[i].comb_ds_dev);
        printf("  (float64 comb deviation from doubly stochastic: %.3e)\n", rows[0].comb_ds_dev_ref);
    }
out:
    free(streams);
    free(pre);
    free(post);
    free(comb);
    free(col);
    free(ws);
    moe_hc_weights_free(w);
    moe_model_free(m);
    return rc;
}
