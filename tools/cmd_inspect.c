/* moeaudit inspect: what a checkpoint is, before a long run (headers only). */
#include "cli.h"

#include <cjson/cJSON.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

typedef struct inspect_args {
    moe_cli_common c;
} inspect_args;

typedef inspect_args A;

static const moe_opt inspect_opts[] = {
    MOE_OPT_MODEL(A, "checkpoint directory, or a bundled checkpoint's name: dsv4-tiny (default),\n"
                     "dsv3-tiny, dsv3-tiny-fp8"),
    MOE_OPT_JSON(A, "also write the report as JSON to FILE ('-': standard output, the text then\n"
                    "goes to stderr; docs/schemas/inspect.schema.json)"),
    MOE_OPT_QUIET(A, "no text report (with --json FILE: the JSON only)"),
};

static int inspect_main(int argc, char **argv);

const moe_cli_cmd moe_cli_inspect = {
    "inspect",
    "what a checkpoint is and what moeaudit can run in it (headers only, fast)",
    "moeaudit inspect [--model DIR] [--json FILE] [--quiet]",
    "Describe the checkpoint DIR from its config.json, quant config files and safetensors headers\n"
    "(no tensor data is read): architecture and naming, layers by type (dense / top-k / hash MoE,\n"
    "MTP blocks) with their attention, the storage format of every tensor family, shards, the\n"
    "declared quantization and any tensor that contradicts it, tensors of unknown dtype, and what\n"
    "moeaudit can and cannot run in it, and why.",
    inspect_opts,
    (int)(sizeof inspect_opts / sizeof inspect_opts[0]),
    NULL,
    "Exit status: 0 the checkpoint was described (contradictions and unknown dtypes are reported,\n"
    "not failed), 1 the report could not be written, 2 the checkpoint could not be read (config or\n"
    "index) or a usage error.",
    inspect_main,
};

/* The library's report under the header every CLI report carries
 * (docs/schemas/). NULL when out of memory. */
static char *inspect_doc(const moe_inspect *r, const char *model) {
    cJSON *j = moe_cli_report_head("inspect");
    if (j) cJSON_AddStringToObject(j, "model", model);
    return moe_cli_report_print(j, moe_inspect_json(r));
}

static int inspect_main(int argc, char **argv) {
    inspect_args a;
    memset(&a, 0, sizeof a);
    a.c = moe_cli_common_default();
    int rc = moe_cli_parse(&moe_cli_inspect, argc, argv, &a, NULL);
    if (rc >= 0) return rc;
    char path[PATH_MAX];
    const char *model = moe_cli_model_path(a.c.model, path, sizeof path);
    if (!model) return EXIT_USAGE;
    const char *outs[1] = {a.c.json};
    if ((rc = moe_cli_check_outputs("inspect", outs, 1, NULL, 0, model)) >= 0) return rc;
    moe_inspect r;
    moe_error err;
    moe_status st = moe_inspect_dir(model, &r, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    rc = EXIT_OKAY;
    const char *json = a.c.json;
    FILE *text = moe_cli_text(a.c.quiet, json && !strcmp(json, "-"));
    if (text && moe_inspect_report_text(text, &r) != MOE_OK) {
        fprintf(stderr, "moeaudit inspect: cannot write the text report\n");
        rc = EXIT_FAIL;
    }
    if (json && rc == EXIT_OKAY) {
        char *doc = inspect_doc(&r, model);
        moe_out_file *h = NULL;
        FILE *f = doc ? moe_cli_open_out(json, &h) : NULL;
        if (!doc) fprintf(stderr, "moeaudit: out of memory\n");
        if (!f) {
            rc = EXIT_FAIL;
        } else {
            bool ok = fputs(doc, f) >= 0 && fputc('\n', f) != EOF;
            if (!ok) moe_out_abort(h); /* the old report stays */
            if (!ok || !moe_cli_close_out(f, h, json)) rc = EXIT_FAIL;
            else if (strcmp(json, "-") && text) fprintf(text, "wrote %s\n", json);
        }
        free(doc);
    }
    moe_inspect_free(&r);
    return rc;
}
