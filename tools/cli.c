/* Helpers shared by the CLI's commands. */
#include "cli.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>


/* Library statuses that mean "the input (files, flags) is wrong". */
int moe_cli_exit_code(moe_status s) {
    switch (s) {
    case MOE_OK: return EXIT_OKAY;
    case MOE_ERR_IO: case MOE_ERR_FORMAT: case MOE_ERR_MISSING: case MOE_ERR_SHAPE: case MOE_ERR_DTYPE:
    case MOE_ERR_CONFIG: case MOE_ERR_INPUT: case MOE_ERR_ARG: case MOE_ERR_UNSUPPORTED:
        return EXIT_USAGE;
    default:
        return EXIT_FAIL;
    }
}

int moe_cli_fail(moe_status s, const moe_error *err) {
    fprintf(stderr, "moeaudit: %s: %s\n", moe_status_str(s), err->msg);
    return moe_cli_exit_code(s);
}

int moe_cli_usage(const char *cmd, const char *fmt, const char *arg) {
    fprintf(stderr, "moeaudit %s: ", cmd);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\nTry 'moeaudit %s --help'.\n", cmd);
    return EXIT_USAGE;
}

bool moe_cli_parse_int(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

