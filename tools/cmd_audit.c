/* moeaudit audit: price every precision shortcut on a checkpoint or on a
 * synthetic DeepSeek-V4-Flash-shaped model. */
#include "cli.h"
#include "cpu/kernels.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char audit_help[] =
    "usage: moeaudit audit [--model DIR --layers LIST|all] [--experts N] [--tokens T] [--seed S]\n"
    "                      [--json FILE] [--html FILE] [--quiet]\n"
    "\n"
    "Run every precision path (f32 kernels and ISAs, bf16 / FP8 activations, bf16 router, FP8 /\n"
    "MXFP4 / NVFP4 experts with E2M1 rounding and scale-rule variants, each scale owner, fused\n"
    "shared experts, and the combined V3/V4 recipes) against the float64 reference on the same\n"
    "weights, and grade each PASS / MARGINAL / FAIL by output SQNR and routing flips, sorted by harm.\n"
    "\n"
    "  --model DIR      a checkpoint (BF16/F16/F32 weights are quantized in memory per path);\n"
    "                   default: a synthetic DeepSeek-V4-Flash-shaped model (hidden 4096,\n"
    "                   moe_intermediate 2048, top-6, sqrtsoftplus, s 1.5, swiglu_limit 10; one hash\n"
    "                   and one top-k layer; fixed seed; realistic, non-uniform routing)\n"
    "  --layers LIST    comma-separated layer indices, or all (default: all MoE layers)\n"
    "  --experts N      routed experts of the synthetic model (default 64; 256 is full size)\n"
    "  --tokens T       tokens per layer (default 64): hidden states with unit RMS and a few\n"
    "                   outlier channels, as a normalised residual stream has\n"
    "  --seed S         seed of the synthetic model and tokens (default 20261130)\n"
    "  --json FILE      rows as JSON;  --html FILE  a self-contained page with SVG charts\n"
    "  --quiet          no table on stdout\n"
    "Progress with an ETA goes to stderr when it is a terminal.\n"
    "Exit status: 0 when every path ran (whatever the grades), 1 on failure, 2 on usage errors.\n";

typedef struct progress {
    bool on;
    double t0;
    int layer, n_layers;
} progress;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void on_progress(void *ctx, int done, int total, const char *what) {
    progress *p = ctx;
    if (!p->on) return;
    double frac = ((double)p->layer + (double)done / total) / p->n_layers, el = now_s() - p->t0;
    double eta = frac > 0.02 ? el / frac - el : NAN;
    fprintf(stderr, "\r\033[K[%3.0f%%] layer %d/%d: %-44.44s elapsed %4.0fs, ETA %s", 100 * frac, p->layer + 1,
            p->n_layers, what, el, isnan(eta) ? "--" : "");
    if (!isnan(eta)) fprintf(stderr, "%.0fs", eta);
    fflush(stderr);
}

/* Tokens: unit-RMS hidden states with 4 outlier channels (x8), the shape of a
 * normalised residual stream; ids uniform over the vocabulary. */
static void make_tokens(uint64_t seed, int64_t T, int H, int vocab, double *hidden, int64_t *ids) {
    uint64_t s = seed ^ 0xA5A5A5A5ull;
    for (int64_t i = 0; i < T * H; i++) {
        s += 0x9E3779B97F4A7C15ull;
        uint64_t z = s;
        z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
        z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
        z ^= z >> 31;
        double u = (double)(uint32_t)z * 0x1p-32, v = (double)(uint32_t)(z >> 32) * 0x1p-32;
        int h = (int)(i % H);
        double amp = (h == 7 || h == H / 3 || h == H / 2 + 5 || h == H - 11) ? 8.0 : 1.0;
        hidden[i] = (u + v - 1.0) * 2.449489742783178 * amp;
    }
    for (int64_t t = 0; t < T; t++) {
        s += 0x9E3779B97F4A7C15ull;
        uint64_t z = (s ^ (s >> 31)) * 0xBF58476D1CE4E5B9ull;
        ids[t] = vocab > 0 ? (int64_t)((z ^ (z >> 29)) % (uint64_t)vocab) : 0;
    }
}

static int parse_layers(const char *s, int n_layers, int *out, int max) {
    if (!strcmp(s, "all")) return -1;
    int n = 0;
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        long v;
        if (!moe_cli_parse_int(tok, 0, n_layers - 1, &v) || n == max) return -2;
        out[n++] = (int)v;
    }
    return n;
}

int moe_cmd_audit(int argc, char **argv) {
    const char *model = NULL, *layers_s = "all", *json = NULL, *html = NULL;
    long experts = 64, tokens = 64, seed = 20261130;
    bool quiet = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(audit_help, stdout); return EXIT_OKAY; }
        if (!strcmp(a, "--quiet")) { quiet = true; continue; }
        if (i + 1 >= argc) return moe_cli_usage("audit", "option %s needs a value", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--layers")) layers_s = v;
        else if (!strcmp(a, "--json")) json = v;
        else if (!strcmp(a, "--html")) html = v;
        else if (!strcmp(a, "--experts")) {
            if (!moe_cli_parse_int(v, 6, 4096, &experts)) return moe_cli_usage("audit", "--experts %s: expected 6..4096", v);
        } else if (!strcmp(a, "--tokens")) {
            if (!moe_cli_parse_int(v, 1, 1 << 20, &tokens)) return moe_cli_usage("audit", "--tokens %s: expected a positive count", v);
        } else if (!strcmp(a, "--seed")) {
            if (!moe_cli_parse_int(v, 0, 2147483647L, &seed)) return moe_cli_usage("audit", "--seed %s: expected a number", v);
        } else return moe_cli_usage("audit", "unknown argument %s", a);
    }
    moe_error err;
    moe_model *m = NULL;
    moe_synth_opts so = moe_synth_opts_v4flash((int)experts);
    so.seed = (uint64_t)seed;
    int n_layers = so.n_layers, vocab = so.vocab;
    char desc[512];
    if (model) {
        moe_status st = moe_model_open(model, &m, &err);
        if (st != MOE_OK) return moe_cli_fail(st, &err);
        n_layers = moe_model_get_info(m)->n_layers;
        vocab = moe_model_get_info(m)->vocab;
        snprintf(desc, sizeof desc, "%s", model);
    } else {
        snprintf(desc, sizeof desc, "synthetic DeepSeek-V4-Flash-shaped model (H %d, I %d, E %d, K %d, seed %ld)",
                 so.hidden, so.inter, so.n_experts, so.top_k, seed);
    }
    int want[256], nw = parse_layers(layers_s, n_layers, want, 256);
    if (nw == -2) { moe_model_free(m); return moe_cli_usage("audit", "--layers %s: expected all or indices like 0,3", layers_s); }
    if (nw == -1) {
        nw = 0;
        for (int l = 0; l < n_layers && nw < 256; l++) {
            moe_layer_kind k = MOE_LAYER_TOPK;
            if (m && moe_model_layer_kind(m, l, &k, &err) != MOE_OK) continue;
            if (k != MOE_LAYER_DENSE) want[nw++] = l;
        }
    }
    moe_audit_path paths[64];
    int np = moe_audit_default_paths(paths, 64);
    moe_audit_row *rows = calloc((size_t)(nw * np) + 1, sizeof *rows);
    if (!rows) { moe_model_free(m); fputs("moeaudit: out of memory\n", stderr); return EXIT_FAIL; }
    progress pg = {.on = isatty(2) != 0, .t0 = now_s(), .n_layers = nw};
    int rc = EXIT_OKAY, nrows = 0;
    for (int li = 0; li < nw && rc == EXIT_OKAY; li++) {
        pg.layer = li;
        const moe_layer *L = NULL;
        moe_layer *owned = NULL;
        moe_status st;
        on_progress(&pg, 0, np + 1, model ? "loading" : "building the synthetic layer");
        if (m) st = moe_model_layer(m, want[li], &L, &err);
        else { st = moe_synth_layer(&so, want[li], &owned, &err); L = owned; }
        if (st != MOE_OK) { rc = moe_cli_fail(st, &err); break; }
        int H = L->cfg.hidden;
        double *hidden = malloc((size_t)(tokens * H) * sizeof(double));
        int64_t *ids = malloc((size_t)tokens * sizeof(int64_t));
        if (!hidden || !ids) { free(hidden); free(ids); moe_layer_free(owned); rc = EXIT_FAIL; break; }
        make_tokens((uint64_t)seed + (uint64_t)want[li], tokens, H, L->cfg.vocab > 0 ? L->cfg.vocab : vocab, hidden, ids);
        st = moe_audit_layer(L, hidden, ids, tokens, paths, np, rows + nrows, on_progress, &pg, &err);
        if (st != MOE_OK) rc = moe_cli_fail(st, &err);
        else nrows += np;
        free(hidden);
        free(ids);
        if (owned) moe_layer_free(owned);
    }
    if (pg.on) fputs("\r\033[K", stderr);
    moe_audit_meta meta = {desc, tokens, NULL, now_s() - pg.t0};
    meta.isa = moe_cpu_active()->isa;
    if (rc == EXIT_OKAY && nrows > 0) {
        if (!quiet) moe_audit_report_text(stdout, &meta, rows, nrows);
        const char *outs[2] = {json, html};
        for (int k = 0; k < 2; k++) {
            if (!outs[k]) continue;
            FILE *f = fopen(outs[k], "w");
            moe_status st = !f ? MOE_ERR_IO
                          : k == 0 ? moe_audit_report_json(f, &meta, rows, nrows)
                                   : moe_audit_report_html(f, &meta, rows, nrows);
            if (f && fclose(f) != 0) st = MOE_ERR_IO;
            if (st != MOE_OK) { fprintf(stderr, "moeaudit: %s: cannot write the report\n", outs[k]); rc = EXIT_FAIL; }
            else if (!quiet) printf("wrote %s\n", outs[k]);
        }
        if (!quiet) printf("audit took %.1f s\n", meta.seconds);
    }
    free(rows);
    moe_model_free(m);
    return rc;
}
