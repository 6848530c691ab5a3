/* moeaudit diagnose: name the broken contract in another engine's dump. */
#include "cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char diagnose_help[] =
    "usage: moeaudit diagnose --model DIR --layer N --dump FILE [--json OUT]\n"
    "\n"
    "Recompute layer N's MoE block in float64 for the dump's tokens and explain how the dump\n"
    "differs: expert selection, routing weights, and a fit moe_out ~ a * routed + b * shared.\n"
    "\n"
    "The dump is a safetensors file (e.g. from safetensors.torch.save_file) with hidden [T, H]\n"
    "(the block input) and moe_out [T, H]; optional: input_ids [T] (needed on hash layers),\n"
    "router_logits [T, E], topk_ids [T, K(+shared)], topk_weights, routed_out, shared_out.\n"
    "Fused shared experts appear as topk_ids >= E.\n"
    "\n"
    "Verdicts: OK, SCALE_DOUBLE, SCALE_MISSING, SHARED_WEIGHT, NOT_RENORMALIZED, BIASED_WEIGHTS,\n"
    "WRONG_SCORE, SELECTION, UNEXPLAINED.\n"
    "Exit status: 0 for OK, 1 for any other verdict, 2 for usage or input errors.\n";

int moe_cmd_diagnose(int argc, char **argv) {
    const char *model = NULL, *dump = NULL, *json = NULL;
    long layer = -1;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(diagnose_help, stdout); return EXIT_OKAY; }
        if (i + 1 >= argc) return moe_cli_usage("diagnose", "option %s needs a value", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--dump")) dump = v;
        else if (!strcmp(a, "--json")) json = v;
        else if (!strcmp(a, "--layer")) {
            if (!moe_cli_parse_int(v, 0, 1000000, &layer)) return moe_cli_usage("diagnose", "--layer %s: not a layer index", v);
        } else return moe_cli_usage("diagnose", "unknown argument %s", a);
    }
    if (!model || !dump || layer < 0)
        return moe_cli_usage("diagnose", "%s", "--model, --layer and --dump are required");
    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(model, &m, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    const moe_layer *L = NULL;
    moe_dump d;
    memset(&d, 0, sizeof d);
    moe_diagnosis g;
    int rc = EXIT_OKAY;
    st = moe_model_layer(m, (int)layer, &L, &err);
    if (st == MOE_OK) st = moe_dump_load(dump, L->cfg.hidden, L->cfg.n_experts, &d, &err);
    if (st == MOE_OK) st = moe_diagnose(L, &d, &g, &err);
    if (st != MOE_OK) {
        rc = moe_cli_fail(st, &err);
    } else {
        printf("%s\n", g.sentence);
        for (int i = 0; i < g.n_findings; i++)
            printf("  %-9s %-17s %s%s%s\n", g.findings[i].stage, g.findings[i].cls, g.findings[i].detail,
                   g.findings[i].evidence[0] ? "; " : "", g.findings[i].evidence);
        if (json) {
            char *text = moe_diagnosis_json(&g);
            FILE *f = text ? fopen(json, "w") : NULL;
            if (!f || fputs(text, f) < 0 || fputc('\n', f) == EOF) {
                fprintf(stderr, "moeaudit: %s: cannot write the JSON report\n", json);
                rc = EXIT_USAGE;
            }
            if (f && fclose(f) != 0) rc = EXIT_USAGE;
            free(text);
        }
        if (rc == EXIT_OKAY && g.verdict != MOE_VERDICT_OK) rc = EXIT_FAIL;
    }
    moe_dump_free(&d);
    moe_model_free(m);
    return rc;
}
