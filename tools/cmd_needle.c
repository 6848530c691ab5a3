/* `moeaudit needle`: the retrieval probe at the lightning indexer. */
#include "cli.h"
#include "cmd_extra.h"
#include "moeaudit_indexer.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char needle_help[] =
    "usage: moeaudit needle [--len L,L,...] [--full] [--depths D,D,...] [--topk K,K,...]\n"
    "                       [--precisions P,P,...] [--accum fp32|bf16] [--margin M] [--trials N]\n"
    "                       [--heads H] [--dim D] [--ratio R] [--seed S] [--no-rope] [--no-hadamard]\n"
    "                       [--json] [--html FILE]\n"
    "       moeaudit needle --tensors FILE [--topk K] [--ratio R] [--precisions P,...] [--accum A] [--json]\n"
    "\n"
    "Would the lightning indexer keep a needle the query matches just above the index_topk cut-off?\n"
    "Synthetic contexts of L tokens (L / ratio key entries) hold a needle key at depth d (0 = oldest\n"
    "entry, 1 = newest) whose float64 score is the index_topk-th best other score plus M standard\n"
    "deviations of the distractor scores; distractors are Gaussian keys with a shared mean, a few\n"
    "outlier channels and RoPE (docs/indexer.md). For each precision of q and k the probe reports the\n"
    "needle's recall (fraction of trials in the selected set), its rank and its margin to the cut-off.\n"
    "\n"
    "  --len L,...       context lengths in tokens (default 1024,2048,4096,8192,16384,32768)\n"
    "  --full            lengths 1024 .. 131072 (minutes on two cores)\n"
    "  --depths D,...    needle depths in [0, 1] (default 0,0.1,...,1)\n"
    "  --topk K,...      index_topk values (default 512,1024,2048)\n"
    "  --precisions P,.. q/k rounding after the Hadamard rotation: fp32, bf16, fp8 (E4M3 per 128,\n"
    "                    fp32 scale), fp8-pow2 (power-of-two scale), fp4 (E2M1 per 32, E8M0 scale);\n"
    "                    default all five. bf16/fp8/fp4 round through bf16 first (the activation dtype)\n"
    "  --accum A         fp32 (default) or bf16 (dots, head terms and head sum rounded to bf16)\n"
    "  --margin M        the needle's float64 margin over the cut-off in sigmas (default 0.05)\n"
    "  --trials N        contexts per length (default 4)\n"
    "  --heads H --dim D index heads and head dim (default 64 x 128, V4-Flash); --ratio R (default 4;\n"
    "                    1 = V3.2 token-level indexer)\n"
    "  --seed S          random seed (default 20260501)\n"
    "  --json            one JSON object per (length, depth, topk, precision) cell\n"
    "  --html FILE       a self-contained HTML report with an L x depth recall heatmap per\n"
    "                    (topk, precision)\n"
    "  --tensors FILE    real tensors instead: q [T, heads, dim], k [S, dim], w [T, heads] (weights\n"
    "                    already scaled), optional pos [T] (I32/I64; default: the queries are the last\n"
    "                    T tokens of S * ratio); reports top-k set recall per precision vs float64\n"
    "\n"
    "Exit status: 0 success, 1 failure, 2 usage or input error.\n";

#define MAXL 64

static int split(char *s, char **parts, int max) {
    int n = 0;
    for (char *tok = strtok(s, ","); tok && n < max; tok = strtok(NULL, ",")) parts[n++] = tok;
    return n;
}

static bool parse_double(const char *s, double *out) {
    char *end;
    double v = strtod(s, &end);
    if (end == s || *end || !isfinite(v)) return false;
    *out = v;
    return true;
}

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
    FILE *f = fopen(path, "w");
    if (!f) { perror(path); return EXIT_USAGE; }
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
    fprintf(f, "</table>\n<p>Model and reading guide: docs/indexer.md.</p></body></html>\n");
    if (fclose(f) != 0) { perror(path); return EXIT_FAIL; }
    return EXIT_OKAY;
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

static int run_tensors(const char *path, int topk, int ratio, const moe_idx_opts *precs, int n_prec, bool json) {
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
    if (!json) printf("%s: %lld queries x %lld entries, %d heads x %d, index_topk %d: top-k set recall vs float64\n",
                      path, (long long)sh.T, (long long)sh.S, sh.heads, sh.dim, topk);
    for (int p = 0; p < n_prec; p++) {
        char lab[64];
        prec_label(&precs[p], lab, sizeof lab);
        if (json)
            printf("{\"mode\": \"tensors\", \"file\": \"%s\", \"index_topk\": %d, \"precision\": \"%s\", "
                   "\"mean_recall\": %.6f, \"min_recall\": %.6f, \"queries\": %lld}\n",
                   path, topk, lab, res[p].mean_recall, res[p].min_recall, (long long)res[p].queries);
        else
            printf("  %-22s mean %.4f  min %.4f  (%lld queries)\n", lab, res[p].mean_recall, res[p].min_recall,
                   (long long)res[p].queries);
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

int moe_cmd_needle(int argc, char **argv) {
    moe_needle_config c = moe_needle_config_default();
    int64_t lens[MAXL] = {1024, 2048, 4096, 8192, 16384, 32768};
    int n_lens = 6;
    double depths[MAXL] = {0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0};
    int n_depths = 11;
    int topks[MAXL] = {512, 1024, 2048};
    int n_topks = 3;
    moe_idx_quant quants[MAXL] = {MOE_IDX_Q_F32, MOE_IDX_Q_BF16, MOE_IDX_Q_FP8, MOE_IDX_Q_FP8_POW2, MOE_IDX_Q_FP4};
    int n_quants = 5;
    moe_idx_accum accum = MOE_IDX_ACC_F32;
    bool json = false, hadamard = true, topk_given = false;
    const char *html = NULL, *tensors = NULL;
    c.margin = 0.05;
    long v;
    char *parts[MAXL];
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        bool has_val = i + 1 < argc;
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(needle_help, stdout); return EXIT_OKAY; }
        else if (!strcmp(a, "--json")) json = true;
        else if (!strcmp(a, "--no-rope")) c.rope_theta = 0;
        else if (!strcmp(a, "--no-hadamard")) hadamard = false;
        else if (!strcmp(a, "--full")) {
            n_lens = 0;
            for (int64_t L = 1024; L <= 131072; L *= 2) lens[n_lens++] = L;
        } else if (!has_val && !strncmp(a, "--", 2)) return moe_cli_usage("needle", "option %s needs a value", a);
        else if (!strcmp(a, "--html")) html = argv[++i];
        else if (!strcmp(a, "--tensors")) tensors = argv[++i];
        else if (!strcmp(a, "--len")) {
            int n = split(argv[++i], parts, MAXL);
            for (int j = 0; j < n; j++) {
                if (!moe_cli_parse_int(parts[j], 2, 1L << 24, &v)) return moe_cli_usage("needle", "--len: %s is not a length", parts[j]);
                lens[j] = v;
            }
            n_lens = n;
        } else if (!strcmp(a, "--depths")) {
            int n = split(argv[++i], parts, MAXL);
            for (int j = 0; j < n; j++)
                if (!parse_double(parts[j], &depths[j]) || depths[j] < 0 || depths[j] > 1)
                    return moe_cli_usage("needle", "--depths: %s is not in [0, 1]", parts[j]);
            n_depths = n;
        } else if (!strcmp(a, "--topk")) {
            int n = split(argv[++i], parts, MAXL);
            for (int j = 0; j < n; j++) {
                if (!moe_cli_parse_int(parts[j], 1, 1L << 20, &v)) return moe_cli_usage("needle", "--topk: %s is not a count", parts[j]);
                topks[j] = (int)v;
            }
            n_topks = n;
            topk_given = true;
        } else if (!strcmp(a, "--precisions")) {
            int n = split(argv[++i], parts, MAXL);
            for (int j = 0; j < n; j++)
                if (!moe_idx_quant_parse(parts[j], &quants[j]))
                    return moe_cli_usage("needle", "--precisions: %s is not fp32, bf16, fp8, fp8-pow2 or fp4", parts[j]);
            n_quants = n;
        } else if (!strcmp(a, "--accum")) {
            const char *s = argv[++i];
            if (!strcmp(s, "fp32") || !strcmp(s, "f32")) accum = MOE_IDX_ACC_F32;
            else if (!strcmp(s, "bf16")) accum = MOE_IDX_ACC_BF16;
            else return moe_cli_usage("needle", "--accum %s: expected fp32 or bf16", s);
        } else if (!strcmp(a, "--margin")) {
            if (!parse_double(argv[++i], &c.margin)) return moe_cli_usage("needle", "--margin %s: not a number", argv[i]);
        } else if (!strcmp(a, "--trials")) {
            if (!moe_cli_parse_int(argv[++i], 1, 100000, &v)) return moe_cli_usage("needle", "--trials %s: not a count", argv[i]);
            c.trials = (int)v;
        } else if (!strcmp(a, "--heads")) {
            if (!moe_cli_parse_int(argv[++i], 1, 256, &v)) return moe_cli_usage("needle", "--heads %s: expected 1..256", argv[i]);
            c.heads = (int)v;
        } else if (!strcmp(a, "--dim")) {
            if (!moe_cli_parse_int(argv[++i], 2, 4096, &v) || (v & (v - 1)))
                return moe_cli_usage("needle", "--dim %s: expected a power of two in 2..4096", argv[i]);
            c.dim = (int)v;
        } else if (!strcmp(a, "--ratio")) {
            if (!moe_cli_parse_int(argv[++i], 1, 1024, &v)) return moe_cli_usage("needle", "--ratio %s: expected 1..1024", argv[i]);
            c.ratio = (int)v;
        } else if (!strcmp(a, "--seed")) {
            if (!moe_cli_parse_int(argv[++i], 0, 0x7FFFFFFFL, &v)) return moe_cli_usage("needle", "--seed %s: not a seed", argv[i]);
            c.seed = (uint64_t)v;
        } else return moe_cli_usage("needle", "unknown argument %s", a);
    }
    moe_idx_opts precs[MAXL];
    for (int j = 0; j < n_quants; j++) {
        precs[j].q_quant = precs[j].k_quant = quants[j];
        precs[j].accum = accum;
        precs[j].hadamard = hadamard;
    }
    if (tensors) return run_tensors(tensors, topk_given ? topks[0] : 512, c.ratio, precs, n_quants, json);
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
    int rc = EXIT_OKAY;
    if (json) {
        for (size_t i = 0; i < nc; i++) {
            const moe_needle_cell *e = &cells[i];
            char lab[64];
            printf("{\"len\": %lld, \"entries\": %lld, \"depth\": %.4g, \"index_topk\": %d, \"ratio\": %d, "
                   "\"precision\": \"%s\", \"sparse\": %s, \"trials\": %d, \"recall\": %.4f, \"mean_rank\": %.2f, "
                   "\"worst_rank\": %.0f, ",
                   (long long)e->len, (long long)(e->len / c.ratio), e->depth, e->topk, c.ratio,
                   e->prec < 0 ? "float64" : prec_label(&precs[e->prec], lab, sizeof lab), e->sparse ? "true" : "false",
                   e->trials, e->recall, e->mean_rank, e->worst_rank);
            if (e->sparse) printf("\"mean_margin_sigma\": %.5f, \"min_margin_sigma\": %.5f}\n", e->mean_margin, e->min_margin);
            else printf("\"mean_margin_sigma\": null, \"min_margin_sigma\": null}\n");
        }
    } else {
        printf("needle probe: %d heads x %d, ratio %d, margin %.3g sigma, %d trials x %d depths per cell; "
               "recall (fraction of needles selected), averaged over depths; min margin in sigmas\n",
               c.heads, c.dim, c.ratio, c.margin, c.trials, c.n_depths);
        for (int ki = 0; ki < n_topks; ki++) {
            printf("\nindex_topk %d (sparse from %lld tokens)\n  %8s", topks[ki], (long long)topks[ki] * c.ratio, "tokens");
            for (int pi = -1; pi < n_quants; pi++) {
                char lab[64];
                printf(" %20s", pi < 0 ? "float64" : prec_label(&precs[pi], lab, sizeof lab));
            }
            printf("\n");
            for (int li = 0; li < n_lens; li++) {
                printf("  %8lld", (long long)lens[li]);
                for (int pi = -1; pi < n_quants; pi++) {
                    double r = 0, mm = INFINITY;
                    bool sparse = false;
                    for (int di = 0; di < n_depths; di++) {
                        const moe_needle_cell *e = &cells[(((size_t)li * n_depths + di) * n_topks + ki) * (size_t)(n_quants + 1) + (size_t)(pi + 1)];
                        r += e->recall;
                        mm = fmin(mm, e->min_margin);
                        sparse = e->sparse;
                    }
                    if (sparse) printf("      %.3f (%+7.3f)", r / n_depths, mm);
                    else printf("      %.3f (  dense)", r / n_depths);
                }
                printf("\n");
            }
        }
    }
    if (html) {
        rc = write_html(html, &c, cells);
        if (rc == EXIT_OKAY && !json) printf("\nwrote %s\n", html);
    }
    free(cells);
    return rc;
}
