/* moeaudit inspect: what a checkpoint is, before a long run (headers only). */
#include "cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static const char inspect_help[] =
    "usage: moeaudit inspect --model DIR [--json FILE]\n"
    "\n"
    "Describe the checkpoint DIR from its config.json, quant config files and safetensors headers\n"
    "(no tensor data is read): architecture and naming, layers by type (dense / top-k / hash MoE,\n"
    "MTP blocks) with their attention, the storage format of every tensor family, shards, the\n"
    "declared quantization and any tensor that contradicts it, tensors of unknown dtype, and what\n"
    "moeaudit can and cannot run in it, and why.\n"
    "\n"
    "  --model DIR     checkpoint directory (required)\n"
    "  --json FILE     also write the report as JSON to FILE ('-': standard output, instead of text)\n"
    "\n"
    "Exit status: 0 the checkpoint was described, 2 it could not be read (config or index).\n";

int moe_cmd_inspect(int argc, char **argv) {
    const char *model = NULL, *json = NULL;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(inspect_help, stdout); return EXIT_OKAY; }
        const char *v = NULL;
        size_t l = strlen(a);
        const char *eq = strchr(a, '=');
        if (eq) l = (size_t)(eq - a), v = eq + 1;
        else if (i + 1 < argc) v = argv[i + 1];
        if (l == 7 && !strncmp(a, "--model", 7)) model = v;
        else if (l == 6 && !strncmp(a, "--json", 6)) json = v;
        else return moe_cli_usage("inspect", "unknown argument %s", a);
        if (!v) return moe_cli_usage("inspect", "option %s needs a value", a);
        if (!eq) i++;
    }
    if (!model) return moe_cli_usage("inspect", "%s", "--model DIR is required");
    moe_inspect r;
    moe_error err;
    moe_status st = moe_inspect_dir(model, &r, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    int rc = EXIT_OKAY;
    bool json_stdout = json && !strcmp(json, "-");
    if (!json_stdout) moe_inspect_report_text(stdout, &r);
    if (json) {
        char *text = moe_inspect_json(&r);
        FILE *f = json_stdout ? stdout : fopen(json, "w");
        if (!text || !f) {
            fprintf(stderr, "moeaudit: %s: cannot write the JSON report\n", json);
            rc = EXIT_FAIL;
        } else {
            fputs(text, f);
            fputc('\n', f);
            if (!json_stdout && fclose(f) != 0) {
                fprintf(stderr, "moeaudit: %s: write failed\n", json);
                rc = EXIT_FAIL;
            } else if (!json_stdout) {
                printf("wrote %s\n", json);
            }
        }
        free(text);
    }
    moe_inspect_free(&r);
    return rc;
}
