/* moeaudit diagnose: name the broken contract in another engine's dump. */
#include "cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static const char diagnose_help[] =
    "usage: moeaudit diagnose --model DIR --dump FILE (--layer N | --all)\n"
    "                         [--ignore NAMES] [--json OUT] [--html OUT] [--quiet]\n"
    "\n"
    "Recompute the MoE block in float64 for the dump's tokens and explain how the dump differs,\n"
    "stage by stage: router logits, expert selection, routing weights, and a fit\n"
    "moe_out ~ a * routed + b * shared (without topk_ids, each token's expert set is chosen among\n"
    "the reference's near-tie alternatives). The decision rule is docs/diagnose.md.\n"
    "\n"
    "The dump is a safetensors file with, per layer, hidden [T, H] (the block input) and\n"
    "moe_out [T, H]; optional: input_ids [T] (needed on hash layers), router_logits [T, E],\n"
    "topk_ids [T, K(+shared)], topk_weights, routed_out, shared_out. Names are unprefixed for\n"
    "one layer, or layers.N.<name> for many (python/moeaudit_dump writes those).\n"
    "Fused shared experts appear as topk_ids >= E.\n"
    "\n"
    "  --layer N       diagnose layer N (layers.N.* or the unprefixed names)\n"
    "  --all           every layer the dump holds, one verdict each and a summary\n"
    "  --ignore NAMES  diagnose without some optional tensors, e.g. topk_ids,router_logits\n"
    "  --json OUT      the diagnosis as JSON (--all: {\"layers\": [...], \"summary\": {...}})\n"
    "  --html OUT      a self-contained page: per-layer verdicts and fitted (a, b)\n"
    "  --quiet         print only the verdict sentences\n"
    "\n"
    "Verdicts: OK, SCALE_DOUBLE, SCALE_MISSING, SHARED_WEIGHT, NOT_RENORMALIZED, BIASED_WEIGHTS,\n"
    "WRONG_SCORE, SELECTION, UNEXPLAINED.\n"
    "Exit status: 0 when every layer is OK, 1 for any other verdict, 2 for usage or input errors.\n";

/* Write text to path atomically (temp file, rename). */
static int write_text(const char *path, const char *text) {
    char tmp[4200];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    FILE *f = text ? fopen(tmp, "w") : NULL;
    int bad = !f || fputs(text, f) < 0 || fputc('\n', f) == EOF;
    if (f && fclose(f) != 0) bad = 1;
    if (bad || rename(tmp, path) != 0) {
        if (f) remove(tmp);
        fprintf(stderr, "moeaudit: %s: cannot write the JSON report\n", path);
        return EXIT_USAGE;
    }
    return EXIT_OKAY;
}

static moe_status nomem(moe_error *err) {
    snprintf(err->msg, sizeof err->msg, "out of memory");
    return MOE_ERR_NOMEM;
}

static void print_diagnosis(const moe_diagnosis *g, bool quiet) {
    printf("%s\n", g->sentence);
    if (quiet) return;
    for (int i = 0; i < g->n_findings; i++) {
        const moe_finding *f = &g->findings[i];
        printf("  %-9s %-17s %-6s%s %s%s%s\n", f->stage_name, f->cls, moe_confidence_name(f->conf), f->votes ? "*" : " ",
               f->detail, f->evidence[0] ? "; " : "", f->evidence);
    }
    if (g->noise_evidence[0]) printf("  noise     %s: %s\n", g->noise ? g->noise : "beyond fp4", g->noise_evidence);
    for (int s = 0; s < MOE_STAGE_COUNT; s++)
        if (!g->stages[s].checked) printf("  %-9s %s\n", moe_diag_stage_name((moe_diag_stage)s), g->stages[s].note);
}

int moe_cmd_diagnose(int argc, char **argv) {
    const char *model = NULL, *dump = NULL, *json = NULL, *html = NULL, *ignore = NULL;
    long layer = -1;
    bool all = false, quiet = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(diagnose_help, stdout); return EXIT_OKAY; }
        if (!strcmp(a, "--all")) { all = true; continue; }
        if (!strcmp(a, "--quiet")) { quiet = true; continue; }
        if (i + 1 >= argc) return moe_cli_usage("diagnose", "option %s needs a value", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--dump")) dump = v;
        else if (!strcmp(a, "--json")) json = v;
        else if (!strcmp(a, "--html")) html = v;
        else if (!strcmp(a, "--ignore")) ignore = v;
        else if (!strcmp(a, "--layer")) {
            if (!moe_cli_parse_int(v, 0, 1000000, &layer)) return moe_cli_usage("diagnose", "--layer %s: not a layer index", v);
        } else return moe_cli_usage("diagnose", "unknown argument %s", a);
    }
    if (!model || !dump || (layer < 0 && !all))
        return moe_cli_usage("diagnose", "%s", "--model, --dump and one of --layer N / --all are required");
    if (layer >= 0 && all) return moe_cli_usage("diagnose", "%s", "--layer and --all exclude each other");
    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(model, &m, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    int n = 0, *layers = NULL;
    if (all) {
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
        if (layers) layers[0] = (int)layer;
        else st = nomem(&err);
    }
    moe_diagnosis *g = st == MOE_OK ? calloc((size_t)n, sizeof *g) : NULL;
    if (st == MOE_OK && !g) st = nomem(&err);
    int rc = EXIT_OKAY, done = 0;
    for (int i = 0; st == MOE_OK && i < n; i++) {
        const moe_layer *L = NULL;
        moe_dump d;
        memset(&d, 0, sizeof d);
        st = moe_model_layer(m, layers[i], &L, &err);
        if (st == MOE_OK) st = moe_dump_load_layer(dump, layers[i], L->cfg.hidden, L->cfg.n_experts, &d, &err);
        if (st == MOE_OK && ignore) st = moe_dump_drop(&d, ignore, &err);
        if (st == MOE_OK) st = moe_diagnose(L, &d, &g[done], &err);
        moe_dump_free(&d);
        if (st != MOE_OK) break;
        print_diagnosis(&g[done], quiet);
        if (g[done].verdict != MOE_VERDICT_OK) rc = EXIT_FAIL;
        done++;
    }
    if (st != MOE_OK) {
        rc = moe_cli_fail(st, &err);
    } else {
        if (all) {
            int ok = 0;
            for (int i = 0; i < done; i++) ok += g[i].verdict == MOE_VERDICT_OK;
            printf("summary: %d of %d layers OK", ok, done);
            for (int v = 1; v <= MOE_VERDICT_UNEXPLAINED; v++) {
                int c = 0;
                for (int i = 0; i < done; i++) c += (int)g[i].verdict == v;
                if (c) printf("; %s: %d", moe_verdict_name((moe_verdict)v), c);
            }
            printf("\n");
        }
        if (json) {
            char *text = all ? moe_diagnoses_json(g, done, dump, model) : moe_diagnosis_json(&g[0]);
            int wr = write_text(json, text);
            if (wr != EXIT_OKAY) rc = wr;
            free(text);
        }
        if (html) {
            st = moe_diagnoses_html(html, g, done, dump, model, &err);
            if (st != MOE_OK) rc = moe_cli_fail(st, &err);
            else if (!quiet) printf("wrote %s\n", html);
        }
    }
    free(g);
    free(layers);
    moe_model_free(m);
    return rc;
}
