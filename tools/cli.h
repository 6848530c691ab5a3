/* The CLI's shared helpers and the commands' entry points. Each command
 * lives in tools/cmd_<name>.c (or moeaudit.c) and returns an exit code. */
#ifndef MOE_CLI_H
#define MOE_CLI_H

#include "moeaudit.h"

enum { EXIT_OKAY = 0, EXIT_FAIL = 1, EXIT_USAGE = 2 };

/* Exit code for a library status: 2 for statuses that mean the input (files,
 * flags) is wrong, 1 otherwise. */
int moe_cli_exit_code(moe_status s);
/* Print "moeaudit: <status>: <message>" and return its exit code. */
int moe_cli_fail(moe_status s, const moe_error *err);
/* Print a usage error for `cmd` (fmt takes one string) and return 2. */
int moe_cli_usage(const char *cmd, const char *fmt, const char *arg);
bool moe_cli_parse_int(const char *s, long lo, long hi, long *out);

/* Commands (tools/cmd_<name>.c). */
int moe_cmd_quantize(int argc, char **argv);
int moe_cmd_diagnose(int argc, char **argv);

#endif
