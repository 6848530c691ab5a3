/* moeaudit diagnose: name the broken contract in another engine's dump. */
#include "cli.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct diag_args {
    moe_cli_common c;
    const char *dump, *ignore;
    bool all;
} diag_args;

typedef diag_args A;

static const moe_opt diag_opts[] = {
    MOE_OPT_MODEL(A, "the checkpoint the engine ran: a directory, or a bundled checkpoint's name (required)"),
    {"dump", "FILE", MOE_OPT_STR, offsetof(A, dump), 0, 0, NULL, 0,
     "safetensors with, per layer, hidden [T, H] (the block input) and moe_out [T, H]; optional\n"
     "input_ids [T] (needed on hash layers), router_logits [T, E], topk_ids [T, K(+shared)],\n"
     "topk_weights, routed_out, shared_out; unprefixed names for one layer, layers.N.<name> for\n"
     "many (python/moeaudit_dump writes those); fused shared experts appear as topk_ids >= E\n"
     "(required)", NULL},
    MOE_OPT_LAYER(A, "diagnose layer N (layers.N.* or the unprefixed names)"),
    {"all", NULL, MOE_OPT_FLAG, offsetof(A, all), 0, 0, NULL, 0,
     "every layer the dump holds, one verdict each and a summary", NULL},
    {"ignore", "NAMES", MOE_OPT_STR, offsetof(A, ignore), 0, 0, NULL, 0,
     "diagnose without some optional tensors, e.g. topk_ids,router_logits", NULL},
    MOE_OPT_JSON(A, "the diagnosis as JSON (docs/schemas/diagnose.schema.json; --all: every layer and a\n"
                    "summary); '-': stdout, alone"),
    MOE_OPT_HTML(A, "a self-contained page: per-layer verdicts, noise classes and the fitted (a, b)\n"
                    "('-': stdout)"),
    MOE_OPT_QUIET(A, "print only the verdict sentences"),
};

static int diag_main(int argc, char **argv);

const moe_cli_cmd moe_cli_diagnose = {
    "diagnose",
    "name the broken contract in another engine's dump of one layer, or of every layer",
    "moeaudit diagnose --model DIR --dump FILE (--layer N | --all) [--ignore NAMES]\n"
    "                  [--json FILE] [--html FILE] [--quiet]",
    "Recompute the MoE block in float64 for the dump's tokens and explain how the dump differs,\n"
    "stage by stage: router logits, expert selection, routing weights, and a fit\n"
    "moe_out ~ a * routed + b * shared (without topk_ids, each token's expert set is chosen among\n"
    "the reference's near-tie alternatives). The decision rule is docs/diagnose.md.\n"
    "\n"
    "Verdicts: OK, SCALE_DOUBLE, SCALE_MISSING, SHARED_WEIGHT, NOT_RENORMALIZED, BIASED_WEIGHTS,\n"
    "WRONG_SCORE, SELECTION, UNEXPLAINED.",
    diag_opts,
    (int)(sizeof diag_opts / sizeof diag_opts[0]),
    NULL,
    "Exit status: 0 when every layer is OK, 1 for any other verdict, 2 for usage or input errors.",
    diag_main,
};

static moe_status nomem(moe_error *err) {
    snprintf(err->msg, sizeof err->msg, "out of memory");
    return MOE_ERR_NOMEM;
}

static void print_diagnosis(FILE *f, const moe_diagnosis *g, bool quiet) {
    fprintf(f, "%s\n", g->sentence);
    if (quiet) return;
    for (int i = 0; i < g->n_findings; i++) {
        const moe_finding *fd = &g->findings[i];
        fprintf(f, "  %-9s %-17s %-6s%s %s%s%s\n", fd->stage_name, fd->cls, moe_confidence_name(fd->conf),
                fd->votes ? "*" : " ", fd->detail, fd->evidence[0] ? "; " : "", fd->evidence);
    }
    if (g->noise_evidence[0]) fprintf(f, "  noise     %s: %s\n", g->noise ? g->noise : "beyond fp4", g->noise_evidence);
    for (int s = 0; s < MOE_STAGE_COUNT; s++)
        if (!g->stages[s].checked) fprintf(f, "  %-9s %s\n", moe_diag_stage_name((moe_diag_stage)s), g->stages[s].note);
}

/* The library's diagnosis JSON (one layer, or every layer with a summary)
 * under the header every CLI report carries (docs/schemas/). */
static char *diagnosis_doc(char *lib_json, const char *model, const char *dump) {
    cJSON *j = moe_cli_report_head("diagnose");
    if (j) {
        cJSON_AddStringToObject(j, "model", model);
        cJSON_AddStringToObject(j, "dump", dump);
    }
    return moe_cli_report_print(j, lib_json);
}

/* Write text (+ newline) to path atomically (moe_out_*: an exclusive random
 * temporary beside it, renamed over it; a failure keeps the old report and
 * names the cause), or to stdout. */
static int write_text(const char *path, const char *text) {
    if (!text) { fprintf(stderr, "moeaudit: out of memory\n"); return EXIT_FAIL; }
    moe_out_file *h = NULL;
    FILE *f = moe_cli_open_out(path, &h);
    if (!f) return EXIT_FAIL;
    bool ok = fputs(text, f) >= 0 && fputc('\n', f) != EOF;
    ok = moe_cli_close_out(f, h, path) && ok; /* a failed write: dropped, named */
    return ok ? EXIT_OKAY : EXIT_FAIL;
}

/* The HTML page to path, or through a temporary file to stdout. */
static moe_status write_html(const char *path, const moe_diagnosis *g, int n, const char *dump, const char *model,
                             moe_error *err) {
    if (strcmp(path, "-")) return moe_diagnoses_html(path, g, n, dump, model, err);
    char tmp[PATH_MAX];
    if (!moe_cli_private_tmp(tmp, sizeof tmp, "diagnose.html")) {
        snprintf(err->msg, sizeof err->msg, "stdout: no temporary file for the HTML page");
        return MOE_ERR_IO;
    }
    moe_status st = moe_diagnoses_html(tmp, g, n, dump, model, err);
    if (st != MOE_OK) { moe_cli_private_tmp_done(tmp); return st; }
    FILE *in = fopen(tmp, "rb");
    char buf[1 << 16];
    size_t got;
    bool ok = in != NULL;
    while (ok && (got = fread(buf, 1, sizeof buf, in)) > 0) ok = fwrite(buf, 1, got, stdout) == got;
    if (in) fclose(in);
    moe_cli_private_tmp_done(tmp);
    if (!ok || fflush(stdout) != 0) {
        snprintf(err->msg, sizeof err->msg, "stdout: writing the HTML page failed");
        return MOE_ERR_IO;
    }
    return MOE_OK;
}

static int diag_main(int argc, char **argv) {
    diag_args a;
    memset(&a, 0, sizeof a);
    a.c = moe_cli_common_default();
    int rc = moe_cli_parse(&moe_cli_diagnose, argc, argv, &a, NULL);
    if (rc >= 0) return rc;
    if (!a.c.model || !a.dump || (a.c.layer < 0 && !a.all))
        return moe_cli_usage("diagnose", "%s", "--model, --dump and one of --layer N / --all are required");
    if (a.c.layer >= 0 && a.all) return moe_cli_usage("diagnose", "%s", "--layer and --all exclude each other");
    const char *outs[2] = {a.c.json, a.c.html}, *names[2] = {"json", "html"};
    if ((rc = moe_cli_one_stdout("diagnose", outs, names, 2)) >= 0) return rc;
    char path[PATH_MAX];
    const char *model = moe_cli_model_path(a.c.model, path, sizeof path);
    if (!model) return EXIT_USAGE;
    {
        const char *ins[1] = {a.dump};
        if ((rc = moe_cli_check_outputs("diagnose", outs, 2, ins, 1, model)) >= 0) return rc;
    }
    /* the verdicts are printed even with --quiet (its meaning here: sentences only) */
    FILE *text = moe_cli_any_stdout(outs, 2) ? stderr : stdout;
    const char *dump = a.dump;
    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(model, &m, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    int n = 0, *layers = NULL;
    if (a.all) {
        st = moe_dump_layers(dump, NULL, 0, &n, &err);
        if (st == MOE_OK && n == 0) {
            moe_model_free(m);
            fprintf(stderr, "moeaudit: %s holds no layers.N.hidden tensor: use --layer N for a one-layer dump\n", dump);
            return EXIT_USAGE;
        }
        layers = st == MOE_OK ? malloc((size_t)n * sizeof *layers) : NULL;
        if (st == MOE_OK && !layers) st = nomem(&err);
        if (st == MOE_OK) st = moe_dump_layers(dump, layers, n, &n, &err);
    } else {
        n = 1;
        layers = malloc(sizeof *layers);
        if (layers) layers[0] = (int)a.c.layer;
        else st = nomem(&err);
    }
    moe_diagnosis *g = st == MOE_OK ? calloc((size_t)n, sizeof *g) : NULL;
    if (st == MOE_OK && !g) st = nomem(&err);
    int done = 0;
    rc = EXIT_OKAY;
    for (int i = 0; st == MOE_OK && i < n; i++) {
        const moe_layer *L = NULL;
        moe_dump d;
        memset(&d, 0, sizeof d);
        st = moe_model_layer(m, layers[i], &L, &err);
        if (st == MOE_OK) st = moe_dump_load_layer(dump, layers[i], L->cfg.hidden, L->cfg.n_experts, &d, &err);
        if (st == MOE_OK && a.ignore) st = moe_dump_drop(&d, a.ignore, &err);
        if (st == MOE_OK) st = moe_diagnose(L, &d, &g[done], &err);
        moe_dump_free(&d);
        if (st != MOE_OK) break;
        print_diagnosis(text, &g[done], a.c.quiet);
        if (g[done].verdict != MOE_VERDICT_OK) rc = EXIT_FAIL;
        done++;
    }
    if (st != MOE_OK) {
        rc = moe_cli_fail(st, &err);
    } else {
        if (a.all) {
            int ok = 0;
            for (int i = 0; i < done; i++) ok += g[i].verdict == MOE_VERDICT_OK;
            fprintf(text, "summary: %d of %d layers OK", ok, done);
            for (int v = 1; v <= MOE_VERDICT_UNEXPLAINED; v++) {
                int c = 0;
                for (int i = 0; i < done; i++) c += (int)g[i].verdict == v;
                if (c) fprintf(text, "; %s: %d", moe_verdict_name((moe_verdict)v), c);
            }
            fprintf(text, "\n");
        }
        if (a.c.json) {
            char *doc = diagnosis_doc(a.all ? moe_diagnoses_json(g, done, dump, model) : moe_diagnosis_json(&g[0]),
                                      model, dump);
            int wr = write_text(a.c.json, doc);
            if (wr != EXIT_OKAY) rc = wr;
            free(doc);
        }
        if (a.c.html) {
            st = write_html(a.c.html, g, done, dump, model, &err);
            if (st != MOE_OK) rc = moe_cli_fail_out(st, &err);
            else if (!a.c.quiet && strcmp(a.c.html, "-")) fprintf(text, "wrote %s\n", a.c.html);
        }
    }
    free(g);
    free(layers);
    moe_model_free(m);
    return rc;
}
