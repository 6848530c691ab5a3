/* `moeaudit needle`: the retrieval probe at the lightning indexer. */
#include "cli.h"
#include "moeaudit_indexer.h"

#include <cjson/cJSON.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct needle_args {
    moe_cli_common c;
    const char *len, *depths, *topk, *precisions, *accum, *tensors;
    bool full, no_rope, no_hadamard;
    double margin;
    long trials, heads, dim, ratio, seed;
} needle_args;

#define MAXL 64

static const char *prec_label(const moe_idx_opts *o, char *buf, size_t n) {
    if (o->q_quant == o->k_quant) snprintf(buf, n, "%s", moe_idx_quant_name(o->k_quant));
    else snprintf(buf, n, "q %s / k %s", moe_idx_quant_name(o->q_quant), moe_idx_quant_name(o->k_quant));
    if (o->accum == MOE_IDX_ACC_BF16) snprintf(buf + strlen(buf), n - strlen(buf), " (bf16 acc)");
    return buf;
}

/* ------------------------------------------------------------- HTML */

static void color(double r, char *buf) {
    /* recall 1: green, 0.5: amber, 0: red */
    double x = r < 0 ? 0 : (r > 1 ? 1 : r);
    int R = (int)(x < 0.5 ? 220 : 220 - (x - 0.5) * 2 * 180);
    int G = (int)(x < 0.5 ? 60 + x * 2 * 140 : 200);
    sprintf(buf, "rgb(%d,%d,70)", R, G);
}

static int write_html(const char *path, const moe_needle_config *c, const moe_needle_cell *cells) {
    moe_out_file *h = NULL;
    FILE *f = moe_cli_open_out(path, &h);
    if (!f) return EXIT_USAGE;
    fprintf(f, "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>moeaudit needle</title>\n"
               "<style>body{font-family:sans-serif;margin:2em}h2{margin-top:1.5em}table{border-collapse:collapse}"
               "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}.g{display:inline-block;margin:0 1.5em 1.5em 0;"
               "vertical-align:top}</style></head><body>\n");
    fprintf(f, "<h1>Needle recall at the lightning indexer</h1>\n<p>%d heads x %d dims, compression ratio %d, "
               "margin %.3g sigma over the float64 cut-off, %d trials per length, Hadamard rotation; rows: context "
               "length (tokens), columns: needle depth (0 = oldest). Cell: fraction of trials whose needle is in the "
               "selected set. Grey rows: not sparse (visible entries &le; index_topk).</p>\n",
            c->heads, c->dim, c->ratio, c->margin, c->trials);
    const int cw = 44, ch = 22, left = 70, top = 24;
    for (int ki = 0; ki < c->n_topks; ki++) {
        fprintf(f, "<h2>index_topk %d (sparsity from %lld tokens)</h2>\n", c->topks[ki],
                (long long)c->topks[ki] * c->ratio);
        for (int pi = -1; pi < c->n_prec; pi++) {
            char lab[64];
            if (pi < 0) snprintf(lab, sizeof lab, "float64");
            else prec_label(&c->precs[pi], lab, sizeof lab);
            int W = left + cw * c->n_depths + 10, Hh = top + ch * c->n_lens + 30;
            fprintf(f, "<div class=\"g\"><b>%s</b><br><svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" "
                       "font-size=\"10\">\n", lab, W, Hh);
            for (int di = 0; di < c->n_depths; di++)
                fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">%.0f%%</text>\n", left + cw * di + cw / 2,
                        top - 8, c->depths[di] * 100);
            for (int li = 0; li < c->n_lens; li++) {
                fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"end\">%lldk</text>\n", left - 6,
                        top + ch * li + ch / 2 + 4, (long long)(c->lens[li] / 1024));
                for (int di = 0; di < c->n_depths; di++) {
                    size_t idx = (((size_t)li * c->n_depths + di) * c->n_topks + ki) * (size_t)(c->n_prec + 1) + (size_t)(pi + 1);
                    const moe_needle_cell *cell = &cells[idx];
                    char col[32];
                    if (!cell->sparse) strcpy(col, "rgb(200,200,200)");
                    else color(cell->recall, col);
                    fprintf(f, "<rect x=\"%d\" y=\"%d\" width=\"%d\" height=\"%d\" fill=\"%s\" stroke=\"#fff\">"
                               "<title>%lld tokens, depth %.2f: recall %.2f, mean rank %.1f, worst rank %.0f, min margin %.3g</title></rect>\n",
                            left + cw * di, top + ch * li, cw, ch, col, (long long)cell->len, cell->depth, cell->recall,
                            cell->mean_rank, cell->worst_rank, cell->min_margin);
                    fprintf(f, "<text x=\"%d\" y=\"%d\" text-anchor=\"middle\">%.2f</text>\n", left + cw * di + cw / 2,
                            top + ch * li + ch / 2 + 4, cell->recall);
                }
            }
            fprintf(f, "</svg></div>\n");
        }
    }
    /* summary table: recall averaged over depths */
    fprintf(f, "<h2>Recall averaged over depths</h2>\n<table><tr><th>index_topk</th><th>tokens</th>");
    for (int pi = -1; pi < c->n_prec; pi++) {
        char lab[64];
        fprintf(f, "<th>%s</th>", pi < 0 ? "float64" : prec_label(&c->precs[pi], lab, sizeof lab));
    }
    fprintf(f, "</tr>\n");
    for (int ki = 0; ki < c->n_topks; ki++)
        for (int li = 0; li < c->n_lens; li++) {
            fprintf(f, "<tr><td>%d</td><td>%lld</td>", c->topks[ki], (long long)c->lens[li]);
            for (int pi = -1; pi < c->n_prec; pi++) {
                double r = 0;
                for (int di = 0; di < c->n_depths; di++)
                    r += cells[(((size_t)li * c->n_depths + di) * c->n_topks + ki) * (size_t)(c->n_prec + 1) + (size_t)(pi + 1)].recall;
                fprintf(f, "<td>%.3f</td>", r / c->n_depths);
            }
            fprintf(f, "</tr>\n");
        }
    fprintf(f, "</table>\n<p>Model and reading guide: docs/indexer.md. Made by %s.</p></body></html>\n", MOE_CLI_TOOL);
    return moe_cli_close_out(f, h, path) ? EXIT_OKAY : EXIT_FAIL;
}

/* ---------------------------------------------------------- tensors */

static double *load_float(moe_st_file *f, const char *path, const char *name, int ndim, int64_t *shape, int *rc) {
    const moe_st_tensor *t = moe_st_find(f, name);
    if (!t) { fprintf(stderr, "moeaudit: %s: no tensor named \"%s\"\n", path, name); *rc = EXIT_USAGE; return NULL; }
    if (!moe_dtype_is_float(t->dtype) || t->ndim != ndim) {
        fprintf(stderr, "moeaudit: %s: tensor %s must be a %d-d float tensor (F64, F32, BF16, F16)\n", path, name, ndim);
        *rc = EXIT_USAGE;
        return NULL;
    }
    size_t n = 1;
    for (int i = 0; i < ndim; i++) { shape[i] = t->shape[i]; n *= (size_t)t->shape[i]; }
    double *d = malloc(n * sizeof(double) + 1);
    if (!d) { *rc = EXIT_FAIL; return NULL; }
    for (size_t i = 0; i < n; i++) d[i] = moe_load_f64(t->data, t->dtype, i);
    return d;
}

/* A number, or null where it is not finite (JSON has no NaN or Inf). */
static void add_num(cJSON *o, const char *key, double v) {
    if (isfinite(v)) cJSON_AddNumberToObject(o, key, v);
    else cJSON_AddNullToObject(o, key);
}

static cJSON *doc_head(const char *mode) {
    cJSON *j = moe_cli_report_head("needle");
    cJSON_AddStringToObject(j, "mode", mode);
    return j;
}

static int doc_write(cJSON *j, const char *path) {
    char *text = j ? cJSON_Print(j) : NULL;
    cJSON_Delete(j);
    if (!text) { fprintf(stderr, "moeaudit: out of memory\n"); return EXIT_FAIL; }
    moe_out_file *h = NULL;
    FILE *f = moe_cli_open_out(path, &h);
    bool ok = f && fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    if (f) ok = moe_cli_close_out(f, h, path) && ok; /* a failed write: dropped, named */
    free(text);
    return ok ? EXIT_OKAY : EXIT_FAIL;
}

static int run_tensors(const char *path, int topk, int ratio, const moe_idx_opts *precs, int n_prec, const char *json,
                       FILE *text) {
    moe_error err;
    moe_st_file *f = NULL;
    moe_status st = moe_st_open(path, &f, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    int rc = EXIT_OKAY;
    int64_t sq[3], sk[2], sw[2];
    double *q = load_float(f, path, "q", 3, sq, &rc);
    double *k = q ? load_float(f, path, "k", 2, sk, &rc) : NULL;
    double *w = k ? load_float(f, path, "w", 2, sw, &rc) : NULL;
    int64_t *pos = NULL;
    moe_idx_recall *res = NULL;
    if (!w) goto out;
    if (sk[1] != sq[2] || sw[0] != sq[0] || sw[1] != sq[1]) {
        fprintf(stderr, "moeaudit: %s: shapes disagree: q [%lld, %lld, %lld], k [%lld, %lld], w [%lld, %lld]; "
                        "need q [T, H, d], k [S, d], w [T, H]\n", path, (long long)sq[0], (long long)sq[1],
                (long long)sq[2], (long long)sk[0], (long long)sk[1], (long long)sw[0], (long long)sw[1]);
        rc = EXIT_USAGE;
        goto out;
    }
    moe_idx_shape sh = {sq[0], sk[0], (int)sq[1], (int)sq[2], ratio};
    pos = malloc((size_t)sh.T * sizeof(int64_t) + 1);
    if (!pos) { rc = EXIT_FAIL; goto out; }
    const moe_st_tensor *tp = moe_st_find(f, "pos");
    if (tp) {
        if (!moe_dtype_is_int(tp->dtype) || tp->ndim != 1 || tp->shape[0] != sh.T) {
            fprintf(stderr, "moeaudit: %s: tensor pos must be an integer vector [%lld]\n", path, (long long)sh.T);
            rc = EXIT_USAGE;
            goto out;
        }
        for (int64_t t = 0; t < sh.T; t++) pos[t] = moe_load_i64(tp->data, tp->dtype, (size_t)t);
    } else {
        for (int64_t t = 0; t < sh.T; t++) pos[t] = sh.S * ratio - sh.T + t;
    }
    res = calloc((size_t)n_prec + 1, sizeof *res);
    if (!res) { rc = EXIT_FAIL; goto out; }
    st = moe_idx_recall_run(&sh, q, k, w, pos, topk, precs, n_prec, res, &err);
    if (st != MOE_OK) { rc = moe_cli_fail(st, &err); goto out; }
    if (text)
        fprintf(text, "%s: %lld queries x %lld entries, %d heads x %d, index_topk %d: top-k set recall vs float64\n",
                path, (long long)sh.T, (long long)sh.S, sh.heads, sh.dim, topk);
    for (int p = 0; text && p < n_prec; p++) {
        char lab[64];
        fprintf(text, "  %-22s mean %.4f  min %.4f  (%lld queries)\n", prec_label(&precs[p], lab, sizeof lab),
                res[p].mean_recall, res[p].min_recall, (long long)res[p].queries);
    }
    if (json) {
        cJSON *j = doc_head("tensors");
        cJSON_AddStringToObject(j, "file", path);
        cJSON_AddNumberToObject(j, "queries", (double)sh.T);
        cJSON_AddNumberToObject(j, "entries", (double)sh.S);
        cJSON_AddNumberToObject(j, "heads", sh.heads);
        cJSON_AddNumberToObject(j, "dim", sh.dim);
        cJSON_AddNumberToObject(j, "ratio", ratio);
        cJSON_AddNumberToObject(j, "index_topk", topk);
        cJSON *arr = cJSON_AddArrayToObject(j, "rows");
        for (int p = 0; p < n_prec; p++) {
            char lab[64];
            cJSON *r = cJSON_CreateObject();
            cJSON_AddStringToObject(r, "precision", prec_label(&precs[p], lab, sizeof lab));
            add_num(r, "mean_recall", res[p].mean_recall);
            add_num(r, "min_recall", res[p].min_recall);
            cJSON_AddNumberToObject(r, "queries", (double)res[p].queries);
            cJSON_AddItemToArray(arr, r);
        }
        rc = doc_write(j, json);
    }
out:
    free(q);
    free(k);
    free(w);
    free(pos);
    free(res);
    moe_st_close(f);
    return rc;
}

/* -------------------------------------------------------------- main */

typedef needle_args A;

static const moe_opt needle_opts[] = {
    {"len", "L,...", MOE_OPT_STR, offsetof(A, len), 0, 0, NULL, 0,
     "context lengths in tokens (default 1024,2048,4096,8192,16384,32768)", NULL},
    {"full", NULL, MOE_OPT_FLAG, offsetof(A, full), 0, 0, NULL, 0, "lengths 1024 .. 131072 (minutes on two cores)", NULL},
    {"depths", "D,...", MOE_OPT_STR, offsetof(A, depths), 0, 0, NULL, 0,
     "needle depths in [0, 1], 0 = oldest entry (default 0,0.1,...,1)", NULL},
    {"topk", "K,...", MOE_OPT_STR, offsetof(A, topk), 0, 0, NULL, 0,
     "index_topk values (default 512,1024,2048; --tensors: one value, default 512)", NULL},
    {"precisions", "P,...", MOE_OPT_STR, offsetof(A, precisions), 0, 0, NULL, 0,
     "q/k rounding after the Hadamard rotation: f32, bf16, fp8 (E4M3 per 128,\n"
     "power-of-two scale), fp8-f32scale (fp32 scale amax/448), fp4 (E2M1 per 32, E8M0\n"
     "scale); default all five. bf16/fp8/fp4 round through bf16 first (the activation dtype)", NULL},
    {"accum", "A", MOE_OPT_STR, offsetof(A, accum), 0, 0, NULL, 0,
     "f32 (default) or bf16 (dots, head terms and head sum rounded to bf16)", NULL},
    {"margin", "M", MOE_OPT_NUM, offsetof(A, margin), 0, 0, NULL, 0,
     "the needle's float64 margin over the cut-off in sigmas (default 0.05)", NULL},
    {"trials", "N", MOE_OPT_INT, offsetof(A, trials), 1, 100000, NULL, 0, "contexts per length (default 4)", NULL},
    {"heads", "H", MOE_OPT_INT, offsetof(A, heads), 1, 256, NULL, 0, "index heads (default 64, V4-Flash)", NULL},
    {"dim", "D", MOE_OPT_INT, offsetof(A, dim), 2, 4096, NULL, 0, "head dim, a power of two (default 128)", NULL},
    {"ratio", "R", MOE_OPT_INT, offsetof(A, ratio), 1, 1024, NULL, 0,
     "compression ratio (default 4; 1 = the V3.2 token-level indexer)", NULL},
    {"seed", "S", MOE_OPT_INT, offsetof(A, seed), 0, 0x7FFFFFFFL, NULL, 0, "random seed (default 20260501)", NULL},
    {"no-rope", NULL, MOE_OPT_FLAG, offsetof(A, no_rope), 0, 0, NULL, 0, "distractor keys without RoPE", NULL},
    {"no-hadamard", NULL, MOE_OPT_FLAG, offsetof(A, no_hadamard), 0, 0, NULL, 0, "no Hadamard rotation before rounding", NULL},
    {"tensors", "FILE", MOE_OPT_STR, offsetof(A, tensors), 0, 0, NULL, 0,
     "real tensors instead: q [T, heads, dim], k [S, dim], w [T, heads] (weights already\n"
     "scaled), optional pos [T] (I32/I64; default: the queries are the last T tokens of\n"
     "S * ratio); reports top-k set recall per precision vs float64", NULL},
    MOE_OPT_JSON(A, "the cells (or --tensors rows) as one JSON document ('-': stdout)"),
    MOE_OPT_HTML(A, "a self-contained HTML report with an L x depth recall heatmap per\n"
                    "(topk, precision) ('-': stdout)"),
    MOE_OPT_THREADS(A),
    MOE_OPT_QUIET(A, "no table on stdout"),
};

static int needle_main(int argc, char **argv);

const moe_cli_cmd moe_cli_needle = {
    "needle",
    "would the lightning indexer keep a fact planted N tokens back? recall per precision",
    "moeaudit needle [--len L,...] [--full] [--depths D,...] [--topk K,...] [--precisions P,...]\n"
    "                [--accum f32|bf16] [--margin M] [--trials N] [--heads H] [--dim D]\n"
    "                [--ratio R] [--seed S] [--no-rope] [--no-hadamard] [--json FILE]\n"
    "                [--html FILE] [--threads N] [--quiet]\n"
    "moeaudit needle --tensors FILE [--topk K] [--ratio R] [--precisions P,...] [--accum A]\n"
    "                [--json FILE]",
    "Would the lightning indexer keep a needle the query matches just above the index_topk cut-off?\n"
    "Synthetic contexts of L tokens (L / ratio key entries) hold a needle key at depth d (0 = oldest\n"
    "entry, 1 = newest) whose float64 score is the index_topk-th best other score plus M standard\n"
    "deviations of the distractor scores; distractors are Gaussian keys with a shared mean, a few\n"
    "outlier channels and RoPE (docs/indexer.md). For each precision of q and k the probe reports the\n"
    "needle's recall (fraction of trials in the selected set), its rank and its margin to the cut-off.",
    needle_opts,
    (int)(sizeof needle_opts / sizeof needle_opts[0]),
    NULL,
    "Exit status: 0 success, 1 failure, 2 usage or input error.",
    needle_main,
};

/* Parse a comma list of option `opt` into parts; usage error (>= 0) or the count. */
static int list(const char *opt, const char *s, char *buf, size_t n, char **parts, int *count) {
    snprintf(buf, n, "%s", s);
    *count = moe_cli_split(buf, parts, MAXL);
    if (*count < 0) return moe_cli_usage("needle", "--%s: expected a comma list (at most 64 items, none empty)", opt);
    return -1;
}

static int needle_main(int argc, char **argv) {
    needle_args a;
    memset(&a, 0, sizeof a);
    a.c = moe_cli_common_default();
    moe_needle_config c = moe_needle_config_default();
    a.margin = 0.05;
    a.trials = c.trials;
    a.heads = c.heads;
    a.dim = c.dim;
    a.ratio = c.ratio;
    a.seed = (long)c.seed;
    int rc = moe_cli_parse(&moe_cli_needle, argc, argv, &a, NULL);
    if (rc >= 0) return rc;
    c.margin = a.margin;
    c.trials = (int)a.trials;
    c.heads = (int)a.heads;
    c.dim = (int)a.dim;
    c.ratio = (int)a.ratio;
    c.seed = (uint64_t)a.seed;
    if (a.no_rope) c.rope_theta = 0;
    if (c.dim & (c.dim - 1)) {
        char d[32];
        snprintf(d, sizeof d, "%d", c.dim);
        return moe_cli_usage("needle", "--dim %s: expected a power of two in 2..4096", d);
    }
    int64_t lens[MAXL] = {1024, 2048, 4096, 8192, 16384, 32768};
    int n_lens = 6;
    double depths[MAXL] = {0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0};
    int n_depths = 11;
    int topks[MAXL] = {512, 1024, 2048};
    int n_topks = 3;
    moe_idx_quant quants[MAXL] = {MOE_IDX_Q_F32, MOE_IDX_Q_BF16, MOE_IDX_Q_FP8_POW2, MOE_IDX_Q_FP8, MOE_IDX_Q_FP4};
    int n_quants = 5;
    moe_idx_accum accum = MOE_IDX_ACC_F32;
    char buf[4096];
    char *parts[MAXL];
    long v;
    int n;
    if (a.full) {
        n_lens = 0;
        for (int64_t L = 1024; L <= 131072; L *= 2) lens[n_lens++] = L;
    }
    if (a.len) {
        if ((rc = list("len", a.len, buf, sizeof buf, parts, &n)) >= 0) return rc;
        for (int j = 0; j < n; j++) {
            if (!moe_cli_parse_int(parts[j], 2, 1L << 24, &v)) return moe_cli_usage("needle", "--len: %s is not a length in 2..16777216", parts[j]);
            lens[j] = v;
        }
        n_lens = n;
    }
    if (a.depths) {
        if ((rc = list("depths", a.depths, buf, sizeof buf, parts, &n)) >= 0) return rc;
        for (int j = 0; j < n; j++)
            if (!moe_cli_parse_double(parts[j], &depths[j]) || depths[j] < 0 || depths[j] > 1)
                return moe_cli_usage("needle", "--depths: %s is not in [0, 1]", parts[j]);
        n_depths = n;
    }
    if (a.topk) {
        if ((rc = list("topk", a.topk, buf, sizeof buf, parts, &n)) >= 0) return rc;
        for (int j = 0; j < n; j++) {
            if (!moe_cli_parse_int(parts[j], 1, 1L << 20, &v)) return moe_cli_usage("needle", "--topk: %s is not a count in 1..1048576", parts[j]);
            topks[j] = (int)v;
        }
        n_topks = n;
    }
    if (a.precisions) {
        if ((rc = list("precisions", a.precisions, buf, sizeof buf, parts, &n)) >= 0) return rc;
        for (int j = 0; j < n; j++) {
            const moe_cli_prec *p = moe_cli_prec_find(parts[j], MOE_PU_IDX);
            if (!p || !moe_idx_quant_parse(p->name, &quants[j])) return moe_cli_prec_bad("needle", "precisions", parts[j], MOE_PU_IDX);
        }
        n_quants = n;
    }
    if (a.accum) {
        const moe_cli_prec *p = moe_cli_prec_find(a.accum, MOE_PU_IDX);
        if (p && !strcmp(p->name, "f32")) accum = MOE_IDX_ACC_F32;
        else if (p && !strcmp(p->name, "bf16")) accum = MOE_IDX_ACC_BF16;
        else return moe_cli_usage("needle", "--accum %s: expected f32 or bf16", a.accum);
    }
    const char *outs[2] = {a.c.json, a.c.html}, *names[2] = {"json", "html"};
    if ((rc = moe_cli_one_stdout("needle", outs, names, 2)) >= 0) return rc;
    if ((rc = moe_cli_apply_common("needle", &a.c, NULL)) >= 0) return rc;
    FILE *text = moe_cli_text(a.c.quiet, moe_cli_any_stdout(outs, 2));
    moe_idx_opts precs[MAXL];
    for (int j = 0; j < n_quants; j++) {
        precs[j].q_quant = precs[j].k_quant = quants[j];
        precs[j].accum = accum;
        precs[j].hadamard = !a.no_hadamard;
    }
    if (a.tensors) {
        const char *ins[1] = {a.tensors};
        if ((rc = moe_cli_check_outputs("needle", outs, 2, ins, 1, NULL)) >= 0) return rc;
        if (a.c.html) return moe_cli_usage("needle", "%s", "--html draws the synthetic sweep; --tensors reports rows (--json)");
        return run_tensors(a.tensors, a.topk ? topks[0] : 512, c.ratio, precs, n_quants, a.c.json, text);
    }
    if (c.rope_dim > c.dim) c.rope_dim = c.dim / 2 * 2;
    if (c.heads * c.dim > 16384) return moe_cli_usage("needle", "%s", "--heads x --dim must be <= 16384");
    for (int j = 0; j < n_lens; j++)
        if (lens[j] / c.ratio < 2) return moe_cli_usage("needle", "--len: %s gives fewer than 2 entries", "a length");
    c.lens = lens;
    c.n_lens = n_lens;
    c.depths = depths;
    c.n_depths = n_depths;
    c.topks = topks;
    c.n_topks = n_topks;
    c.precs = precs;
    c.n_prec = n_quants;
    size_t nc = moe_needle_cell_count(&c);
    moe_needle_cell *cells = calloc(nc, sizeof *cells);
    if (!cells) { fprintf(stderr, "moeaudit: out of memory\n"); return EXIT_FAIL; }
    moe_error err;
    moe_status st = moe_needle_probe(&c, cells, &err);
    if (st != MOE_OK) { free(cells); return moe_cli_fail(st, &err); }
    rc = EXIT_OKAY;
    if (a.c.json) {
        cJSON *j = doc_head("synthetic");
        cJSON *cfg = cJSON_AddObjectToObject(j, "config");
        cJSON_AddNumberToObject(cfg, "heads", c.heads);
        cJSON_AddNumberToObject(cfg, "dim", c.dim);
        cJSON_AddNumberToObject(cfg, "ratio", c.ratio);
        cJSON_AddNumberToObject(cfg, "margin_sigma", c.margin);
        cJSON_AddNumberToObject(cfg, "trials", c.trials);
        cJSON_AddNumberToObject(cfg, "seed", (double)c.seed);
        cJSON_AddBoolToObject(cfg, "rope", c.rope_theta > 0);
        cJSON_AddBoolToObject(cfg, "hadamard", !a.no_hadamard);
        cJSON_AddStringToObject(cfg, "accum", accum == MOE_IDX_ACC_BF16 ? "bf16" : "f32");
        cJSON *arr = cJSON_AddArrayToObject(j, "cells");
        for (size_t i = 0; i < nc; i++) {
            const moe_needle_cell *e = &cells[i];
            char lab[64];
            cJSON *o = cJSON_CreateObject();
            cJSON_AddNumberToObject(o, "len", (double)e->len);
            cJSON_AddNumberToObject(o, "entries", (double)(e->len / c.ratio));
            cJSON_AddNumberToObject(o, "depth", e->depth);
            cJSON_AddNumberToObject(o, "index_topk", e->topk);
            cJSON_AddStringToObject(o, "precision", e->prec < 0 ? "float64" : prec_label(&precs[e->prec], lab, sizeof lab));
            cJSON_AddBoolToObject(o, "sparse", e->sparse);
            cJSON_AddNumberToObject(o, "trials", e->trials);
            add_num(o, "recall", e->recall);
            add_num(o, "mean_rank", e->mean_rank);
            add_num(o, "worst_rank", e->worst_rank);
            if (e->sparse) {
                add_num(o, "mean_margin_sigma", e->mean_margin);
                add_num(o, "min_margin_sigma", e->min_margin);
            } else {
                cJSON_AddNullToObject(o, "mean_margin_sigma");
                cJSON_AddNullToObject(o, "min_margin_sigma");
            }
            cJSON_AddItemToArray(arr, o);
        }
        rc = doc_write(j, a.c.json);
    }
    if (text) {
        fprintf(text, "needle probe: %d heads x %d, ratio %d, margin %.3g sigma, %d trials x %d depths per cell; "
                      "recall (fraction of needles selected), averaged over depths; min margin in sigmas\n",
                c.heads, c.dim, c.ratio, c.margin, c.trials, c.n_depths);
        for (int ki = 0; ki < n_topks; ki++) {
            fprintf(text, "\nindex_topk %d (sparse from %lld tokens)\n  %8s", topks[ki], (long long)topks[ki] * c.ratio, "tokens");
            for (int pi = -1; pi < n_quants; pi++) {
                char lab[64];
                fprintf(text, " %20s", pi < 0 ? "float64" : prec_label(&precs[pi], lab, sizeof lab));
            }
            fprintf(text, "\n");
            for (int li = 0; li < n_lens; li++) {
                fprintf(text, "  %8lld", (long long)lens[li]);
                for (int pi = -1; pi < n_quants; pi++) {
                    double r = 0, mm = INFINITY;
                    bool sparse = false;
                    for (int di = 0; di < n_depths; di++) {
                        const moe_needle_cell *e = &cells[(((size_t)li * n_depths + di) * n_topks + ki) * (size_t)(n_quants + 1) + (size_t)(pi + 1)];
                        r += e->recall;
                        mm = fmin(mm, e->min_margin);
                        sparse = e->sparse;
                    }
                    if (sparse) fprintf(text, "      %.3f (%+7.3f)", r / n_depths, mm);
                    else fprintf(text, "      %.3f (  dense)", r / n_depths);
                }
                fprintf(text, "\n");
            }
        }
    }
    if (a.c.html && rc == EXIT_OKAY) {
        rc = write_html(a.c.html, &c, cells);
        if (rc == EXIT_OKAY && text && strcmp(a.c.html, "-")) fprintf(text, "\nwrote %s\n", a.c.html);
    }
    free(cells);
    return rc;
}
