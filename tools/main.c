/*
 * moeaudit: the command-line tool. main() picks the command; each command
 * (tools/cmd_<name>.c) parses its argv with its option table (tools/args.c),
 * calls the library and prints. The only place in the project where exit
 * codes and printing live.
 *
 *   moeaudit CMD [options]        run a command
 *   moeaudit help [CMD]           the command list, or CMD --help
 *   moeaudit help --man           the man page (roff), from the option tables
 *   moeaudit help --options CMD   CMD's option names, one per line (scripts, tests)
 *   moeaudit --version
 *
 * Exit codes: 0 success, 1 failure, 2 usage or input error.
 */
#include "cli.h"

#include <stdio.h>
#include <string.h>

static const moe_cli_cmd *const commands[] = {
    &moe_cli_run, &moe_cli_forward, &moe_cli_audit, &moe_cli_bench, &moe_cli_diagnose, &moe_cli_needle,
    &moe_cli_bisect, &moe_cli_quantize, &moe_cli_inspect,
};
enum { N_COMMANDS = (int)(sizeof commands / sizeof commands[0]) };

static const moe_cli_cmd *find(const char *name) {
    for (int i = 0; i < N_COMMANDS; i++)
        if (!strcmp(commands[i]->name, name)) return commands[i];
    return NULL;
}

static void main_help(FILE *f) {
    fputs("usage: moeaudit <command> [options]\n"
          "       moeaudit help [<command>]\n"
          "\n"
          "Run and audit DeepSeek V3/V4 Mixture-of-Experts blocks.\n"
          "\n"
          "commands:\n", f);
    for (int i = 0; i < N_COMMANDS; i++) fprintf(f, "  %-10s %s\n", commands[i]->name, commands[i]->summary);
    fputs("\n"
          "'moeaudit help <command>' or 'moeaudit <command> --help' describes a command; options are\n"
          "--name value or --name=value, and '-' is stdout for every option that writes a file.\n"
          "'moeaudit help --man' prints the man page. Exit status: 0 success, 1 failure, 2 usage or\n"
          "input error.\n", f);
}

static int unknown(const char *what) {
    fprintf(stderr, "moeaudit: unknown command '%s'\n", what);
    main_help(stderr);
    return EXIT_USAGE;
}

static int help(int argc, char **argv) {
    if (argc < 2) { main_help(stdout); return EXIT_OKAY; }
    if (!strcmp(argv[1], "--man")) {
        moe_cli_print_man(stdout, commands, N_COMMANDS);
        return EXIT_OKAY;
    }
    if (!strcmp(argv[1], "--options")) {
        const moe_cli_cmd *c = argc > 2 ? find(argv[2]) : NULL;
        if (!c) return unknown(argc > 2 ? argv[2] : "");
        for (int k = 0; k < c->n_opts; k++) printf("--%s\n", c->opts[k].name);
        return EXIT_OKAY;
    }
    const moe_cli_cmd *c = find(argv[1]);
    if (!c) return unknown(argv[1]);
    moe_cli_print_help(stdout, c);
    return EXIT_OKAY;
}

int main(int argc, char **argv) {
    if (argc < 2) { main_help(stderr); return EXIT_USAGE; }
    const char *cmd = argv[1];
    if (!strcmp(cmd, "--help") || !strcmp(cmd, "-h")) { main_help(stdout); return EXIT_OKAY; }
    if (!strcmp(cmd, "help")) return help(argc - 1, argv + 1);
    if (!strcmp(cmd, "--version")) { printf("%s\n", MOE_CLI_TOOL); return EXIT_OKAY; }
    const moe_cli_cmd *c = find(cmd);
    if (!c) return unknown(cmd);
    return c->main(argc - 1, argv + 1);
}
