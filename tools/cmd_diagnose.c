/* moeaudit diagnose: name the broken contract in another engine's dump. */
#include "cli.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct diag_args {
    moe_cli_common c;
    const char *dump;
} diag_args;

typedef diag_args A;

static const moe_opt diag_opts[] = {
    MOE_OPT_MODEL(A, "checkpoint directory, or a bundled checkpoint's name (required)"),
    MOE_OPT_LAYER(A, "the layer the dump comes from (required)"),
    {"dump", "FILE", MOE_OPT_STR, offsetof(A, dump), 0, 0, NULL, 0,
     "safetensors with hidden [T, H] and moe_out [T, H]; optional input_ids [T],\n"
     "router_logits [T, E], topk_ids [T, K(+shared)], topk_weights, routed_out, shared_out\n"
     "(required)", NULL},
    MOE_OPT_JSON(A, "also write the diagnosis as JSON ('-': stdout, alone)"),
    MOE_OPT_QUIET(A, "no verdict on stdout (the exit status still says it)"),
};

static int diag_main(int argc, char **argv);

const moe_cli_cmd moe_cli_diagnose = {
    "diagnose",
    "name the broken contract in another engine's dump of one layer",
    "moeaudit diagnose --model DIR --layer N --dump FILE [--json FILE] [--quiet]",
    "Recompute layer N's MoE block in float64 for the dump's tokens and explain how the dump\n"
    "differs: expert selection, routing weights, and a fit moe_out ~ a * routed + b * shared\n"
    "under each routing hypothesis. The dump is a safetensors file (e.g. from\n"
    "safetensors.torch.save_file); fused shared experts appear as topk_ids >= E.\n"
    "\n"
    "Verdicts: OK, SCALE_DOUBLE, SCALE_MISSING, SHARED_WEIGHT, NOT_RENORMALIZED, BIASED_WEIGHTS,\n"
    "WRONG_SCORE, SELECTION, UNEXPLAINED.",
    diag_opts,
    (int)(sizeof diag_opts / sizeof diag_opts[0]),
    NULL,
    "Exit status: 0 for OK, 1 for any other verdict, 2 for usage or input errors.",
    diag_main,
};

/* The library's diagnosis JSON with the document header every CLI report
 * carries (docs/schemas/diagnose.schema.json). */
static char *diagnosis_doc(const moe_diagnosis *g, const char *model, const char *dump) {
    char *text = moe_diagnosis_json(g);
    cJSON *d = text ? cJSON_Parse(text) : NULL;
    free(text);
    if (!d) return NULL;
    cJSON *j = cJSON_CreateObject();
    cJSON_AddNumberToObject(j, "schema_version", MOE_CLI_SCHEMA_VERSION);
    cJSON_AddStringToObject(j, "tool", MOE_CLI_TOOL);
    cJSON_AddStringToObject(j, "report", "diagnose");
    cJSON_AddStringToObject(j, "model", model);
    cJSON_AddStringToObject(j, "dump", dump);
    for (cJSON *it = d->child; it;) {
        cJSON *next = it->next;
        if (!cJSON_GetObjectItemCaseSensitive(j, it->string))
            cJSON_AddItemToObject(j, it->string, cJSON_DetachItemViaPointer(d, it));
        it = next;
    }
    cJSON_Delete(d);
    text = cJSON_Print(j);
    cJSON_Delete(j);
    return text;
}

static int diag_main(int argc, char **argv) {
    diag_args a;
    memset(&a, 0, sizeof a);
    a.c = moe_cli_common_default();
    int rc = moe_cli_parse(&moe_cli_diagnose, argc, argv, &a, NULL);
    if (rc >= 0) return rc;
    if (!a.c.model || !a.dump || a.c.layer < 0)
        return moe_cli_usage("diagnose", "%s", "--model, --layer and --dump are required");
    char path[PATH_MAX];
    const char *model = moe_cli_model_path(a.c.model, path, sizeof path);
    if (!model) return EXIT_USAGE;
    FILE *text = moe_cli_text(a.c.quiet, a.c.json && !strcmp(a.c.json, "-"));
    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(model, &m, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    const moe_layer *L = NULL;
    moe_dump d;
    memset(&d, 0, sizeof d);
    moe_diagnosis g;
    rc = EXIT_OKAY;
    st = moe_model_layer(m, (int)a.c.layer, &L, &err);
    if (st == MOE_OK) st = moe_dump_load(a.dump, L->cfg.hidden, L->cfg.n_experts, &d, &err);
    if (st == MOE_OK) st = moe_diagnose(L, &d, &g, &err);
    if (st != MOE_OK) {
        rc = moe_cli_fail(st, &err);
    } else {
        if (text) {
            fprintf(text, "%s\n", g.sentence);
            for (int i = 0; i < g.n_findings; i++)
                fprintf(text, "  %-9s %-17s %s%s%s\n", g.findings[i].stage, g.findings[i].cls, g.findings[i].detail,
                        g.findings[i].evidence[0] ? "; " : "", g.findings[i].evidence);
        }
        if (a.c.json) {
            char *doc = diagnosis_doc(&g, model, a.dump);
            FILE *f = doc ? moe_cli_open_out(a.c.json) : NULL;
            bool ok = f && fputs(doc, f) >= 0 && fputc('\n', f) != EOF;
            if (f) ok = moe_cli_close_out(f, a.c.json) && ok;
            else if (!doc) fprintf(stderr, "moeaudit: out of memory\n");
            if (!ok) rc = EXIT_USAGE;
            free(doc);
        }
        if (rc == EXIT_OKAY && g.verdict != MOE_VERDICT_OK) rc = EXIT_FAIL;
    }
    moe_dump_free(&d);
    moe_model_free(m);
    return rc;
}
