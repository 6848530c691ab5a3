/* `moeaudit run --block hc_ffn|hc_attn`: one layer's hyper-connection. */
#include "cli.h"
#include "moeaudit_hc.h"

#include <cjson/cJSON.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Tensor streams [T >= 1, n, H] of path, through the library's typed reader
 * (moe_st_read_f64: the one fuzz-hc fuzzes); messages name file, tensor,
 * the shape found and the one needed. */
static int read_streams(const char *path, int n, int H, double **out, int64_t *T) {
    moe_error err;
    moe_st_file *f = NULL;
    moe_status st = moe_st_open(path, &f, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    int64_t sh[3] = {-1, n, H};
    double *v = NULL;
    st = moe_st_read_f64(f, "streams", 3, sh, &v, &err);
    moe_st_close(f);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    if (sh[0] < 1) {
        free(v);
        fprintf(stderr, "moeaudit: %s: tensor streams has 0 tokens\n", path);
        return EXIT_USAGE;
    }
    *T = sh[0];
    *out = v;
    return EXIT_OKAY;
}

/* One JSON document: the run summary, or the --audit rows. */
static cJSON *json_doc(const char *block, long layer, int64_t T, const char *model) {
    cJSON *j = moe_cli_report_head("hc");
    cJSON_AddStringToObject(j, "model", model);
    cJSON_AddStringToObject(j, "block", block);
    cJSON_AddNumberToObject(j, "layer", (double)layer);
    cJSON_AddNumberToObject(j, "tokens", (double)T);
    return j;
}

static bool json_write(cJSON *j, const char *path) {
    char *text = j ? cJSON_Print(j) : NULL;
    cJSON_Delete(j);
    moe_out_file *h = NULL;
    FILE *f = text ? moe_cli_open_out(path, &h) : NULL;
    bool ok = f && fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    if (f) ok = moe_cli_close_out(f, h, path) && ok; /* a failed write: dropped, named */
    else if (!text) fprintf(stderr, "moeaudit: out of memory\n");
    free(text);
    return ok;
}

/* A number, or null where it is not finite (JSON has no NaN). */
static void add_num(cJSON *o, const char *key, double v) {
    if (isfinite(v)) cJSON_AddNumberToObject(o, key, v);
    else cJSON_AddNullToObject(o, key);
}

int moe_run_hc(const moe_cli_run_args *a) {
    const char *model_dir = a->model, *in_path = a->c.input, *out_path = a->c.output, *json = a->c.json;
    const char *block = a->block == MOE_BLOCK_HC_ATTN ? "hc_attn" : "hc_ffn";
    long layer = a->c.layer, tokens = a->tokens;
    moe_hc_prec prec = (moe_hc_prec)a->hc_prec;
    bool audit = a->audit;
    moe_hc_site site = a->block == MOE_BLOCK_HC_ATTN ? MOE_HC_ATTN : MOE_HC_FFN;
    const char *outs[2] = {out_path, json}, *names[2] = {"output", "json"};
    int one = moe_cli_one_stdout("run", outs, names, 2);
    if (one >= 0) return one;
    FILE *text = moe_cli_text(a->c.quiet, moe_cli_any_stdout(outs, 2));

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
        const char *meta[] = {"producer", MOE_CLI_TOOL, "block", block, "precision", moe_hc_prec_name(prec), NULL};
        st = moe_cli_st_write(out_path, e, 4, meta, &err);
        if (st != MOE_OK) { rc = moe_cli_fail(st, &err); goto out; }
    }
    if (!audit) {
        if (json) {
            cJSON *j = json_doc(block, layer, T, model_dir);
            cJSON_AddStringToObject(j, "precision", moe_hc_prec_name(prec));
            add_num(j, "comb_ds_dev", ds);
            if (!json_write(j, json)) rc = EXIT_FAIL;
        }
        if (text)
            fprintf(text, "layer %ld %s: %lld tokens, hc_mult %d, %d Sinkhorn iterations, precision %s; first token post "
                          "[%.6f %.6f ...], comb deviation from doubly stochastic %.3g%s%s\n",
                    layer, block, (long long)T, n, w->cfg.iters, moe_hc_prec_name(prec), post[0], n > 1 ? post[1] : 0.0,
                    ds, out_path ? "; wrote " : "", out_path ? (strcmp(out_path, "-") ? out_path : "stdout") : "");
        goto out;
    }
    moe_hc_prec precs[MOE_HC_PREC_COUNT - 1] = {MOE_HC_F32, MOE_HC_TF32, MOE_HC_BF16, MOE_HC_BF16_SPLIT};
    moe_hc_audit_row rows[MOE_HC_PREC_COUNT - 1];
    st = moe_hc_audit(w, streams, T, precs, MOE_HC_PREC_COUNT - 1, rows, &err);
    if (st != MOE_OK) { rc = moe_cli_fail(st, &err); goto out; }
    if (json) {
        cJSON *j = json_doc(block, layer, T, model_dir);
        add_num(j, "comb_ds_dev_ref", rows[0].comb_ds_dev_ref);
        cJSON *arr = cJSON_AddArrayToObject(j, "rows");
        for (int i = 0; i < MOE_HC_PREC_COUNT - 1; i++) {
            cJSON *r = cJSON_CreateObject();
            cJSON_AddStringToObject(r, "precision", moe_hc_prec_name(rows[i].prec));
            add_num(r, "collapsed_rel_err", rows[i].collapsed_rel_err);
            add_num(r, "post_rel_err", rows[i].post_rel_err);
            add_num(r, "pre_rel_err", rows[i].pre_rel_err);
            add_num(r, "comb_max_abs_err", rows[i].comb_max_abs_err);
            add_num(r, "comb_ds_dev", rows[i].comb_ds_dev);
            cJSON_AddItemToArray(arr, r);
        }
        if (!json_write(j, json)) rc = EXIT_FAIL;
    }
    if (text) {
        fprintf(text, "layer %ld %s, %lld tokens: the MHC linear at each precision vs float64\n", layer, block, (long long)T);
        fprintf(text, "  %-11s %14s %14s %14s %16s\n", "precision", "collapsed rel", "post rel", "comb abs", "comb ds dev");
        for (int i = 0; i < MOE_HC_PREC_COUNT - 1; i++)
            fprintf(text, "  %-11s %14.3e %14.3e %14.3e %16.3e\n", moe_hc_prec_name(rows[i].prec), rows[i].collapsed_rel_err,
                    rows[i].post_rel_err, rows[i].comb_max_abs_err, rows[i].comb_ds_dev);
        fprintf(text, "  (float64 comb deviation from doubly stochastic: %.3e)\n", rows[0].comb_ds_dev_ref);
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
