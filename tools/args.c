/*
 * The CLI's one grammar: the option parser every command uses, the help and
 * man page printed from the same tables, the precision-name vocabulary, and
 * the output and data-file helpers every command shares.
 *
 * Invariants:
 *  1. An option is spelled `--name value` or `--name=value` (flags: `--name`
 *     alone); `-h`/`--help` print the table's help; nothing else is
 *     accepted: an unknown option, a flag given a value, a missing or empty
 *     value, a value out of range or not among the choices is a usage error
 *     that names the option and the value (exit 2), before any work.
 *  2. A separate value never starts with "--" (`--model --layer 3` is a
 *     missing value, not a model named "--layer"); `--name=--x` passes one.
 *  3. `-` is a value like any other; output options treat it as stdout.
 *  4. Help, `moeaudit help CMD` and the man page are printed from the
 *     option tables: every option of a table appears in all three.
 */
#define _XOPEN_SOURCE 700 /* realpath */
#include "cli.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#ifdef _OPENMP
#include <omp.h>
#endif

/* ---------------------------------------------------------------- errors */

static int usage_f(const char *cmd, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "moeaudit %s: ", cmd);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fprintf(stderr, "\nTry 'moeaudit %s --help'.\n", cmd);
    return EXIT_USAGE;
}

int moe_cli_usage(const char *cmd, const char *fmt, const char *arg) { return usage_f(cmd, fmt, arg); }

bool moe_cli_parse_int(const char *s, long lo, long hi, long *out) {
    char *end;
    errno = 0;
    long v = strtol(s, &end, 10);
    if (errno || end == s || *end || v < lo || v > hi) return false;
    *out = v;
    return true;
}

bool moe_cli_parse_double(const char *s, double *out) {
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || *end || !isfinite(v)) return false;
    *out = v;
    return true;
}

int moe_cli_split(char *s, char **parts, int max) {
    int n = 0;
    char *p = s;
    for (;;) {
        char *comma = strchr(p, ',');
        if (comma) *comma = '\0';
        if (!*p || n == max) return -1;
        parts[n++] = p;
        if (!comma) return n;
        p = comma + 1;
    }
}

/* ---------------------------------------------------------------- parser */

static bool name_is(const char *name, size_t len, const char *s) { return s && strlen(s) == len && !strncmp(name, s, len); }

int moe_cli_opt_index(const moe_cli_cmd *cmd, const char *name) {
    for (int k = 0; k < cmd->n_opts; k++)
        if (!strcmp(cmd->opts[k].name, name)) return k;
    return -1;
}

static void choice_list(const moe_cli_choice *c, char *buf, size_t n) {
    buf[0] = '\0';
    int count = 0;
    while (c[count].name) count++;
    for (int i = 0; i < count; i++) {
        size_t used = strlen(buf);
        snprintf(buf + used, n - used, "%s%s", i == 0 ? "" : i + 1 == count ? " or " : ", ", c[i].name);
    }
}

/* The closest option name to an unknown one: a shared prefix of 3 or more. */
static const char *suggest(const moe_cli_cmd *cmd, const char *name, size_t len) {
    const char *best = NULL;
    size_t best_n = 2;
    for (int k = 0; k < cmd->n_opts; k++) {
        const char *o = cmd->opts[k].name;
        size_t i = 0;
        while (i < len && o[i] && o[i] == name[i]) i++;
        if (i > best_n) { best_n = i; best = o; }
    }
    return best;
}

static int store(const moe_cli_cmd *cmd, const moe_opt *o, const char *val, void *args) {
    char *dst = (char *)args + o->off;
    switch (o->kind) {
    case MOE_OPT_FLAG:
        *(bool *)(void *)dst = true;
        return -1;
    case MOE_OPT_STR:
    case MOE_OPT_OUT:
        *(const char **)(void *)dst = val;
        return -1;
    case MOE_OPT_INT: {
        long v;
        if (!moe_cli_parse_int(val, o->lo, o->hi, &v))
            return usage_f(cmd->name, "--%s %s: expected an integer from %ld to %ld", o->name, val, o->lo, o->hi);
        *(long *)(void *)dst = v;
        return -1;
    }
    case MOE_OPT_NUM: {
        double v;
        if (!moe_cli_parse_double(val, &v)) return usage_f(cmd->name, "--%s %s: expected a finite number", o->name, val);
        *(double *)(void *)dst = v;
        return -1;
    }
    case MOE_OPT_CHOICE:
        for (const moe_cli_choice *c = o->choices; c->name; c++)
            if (!strcmp(c->name, val)) {
                *(int *)(void *)dst = c->value;
                return -1;
            }
        char list[512];
        choice_list(o->choices, list, sizeof list);
        return usage_f(cmd->name, "--%s %s: expected %s", o->name, val, list);
    }
    return -1;
}

int moe_cli_parse(const moe_cli_cmd *cmd, int argc, char **argv, void *args, bool *seen) {
    if (cmd->n_opts > MOE_CLI_MAX_OPTS) { /* a table too long for the callers' seen[] */
        fprintf(stderr, "moeaudit %s: internal error: %d options, at most %d\n", cmd->name, cmd->n_opts, MOE_CLI_MAX_OPTS);
        return EXIT_FAIL;
    }
    if (seen) memset(seen, 0, (size_t)cmd->n_opts * sizeof *seen);
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "-h") || !strcmp(a, "--help")) {
            moe_cli_print_help(stdout, cmd);
            return EXIT_OKAY;
        }
        if (!strcmp(a, "--")) {
            if (i + 1 < argc) return usage_f(cmd->name, "unexpected argument '%s': this command takes options only", argv[i + 1]);
            break;
        }
        if (strncmp(a, "--", 2) != 0 || !a[2])
            return usage_f(cmd->name, "unexpected argument '%s': options start with --", a);
        const char *name = a + 2, *eq = strchr(name, '=');
        size_t len = eq ? (size_t)(eq - name) : strlen(name);
        int k = -1;
        for (int j = 0; j < cmd->n_opts && k < 0; j++)
            if (name_is(name, len, cmd->opts[j].name) || name_is(name, len, cmd->opts[j].alias)) k = j;
        if (k < 0) {
            const char *s = suggest(cmd, name, len);
            if (s) return usage_f(cmd->name, "unknown option '--%.*s' (did you mean --%s?)", (int)len, name, s);
            return usage_f(cmd->name, "unknown option '--%.*s'", (int)len, name);
        }
        const moe_opt *o = &cmd->opts[k];
        const char *val = NULL;
        if (o->kind == MOE_OPT_FLAG) {
            if (eq) return usage_f(cmd->name, "option --%s takes no value (got '%s')", o->name, eq + 1);
        } else if (eq) {
            val = eq + 1;
        } else if (i + 1 < argc && strncmp(argv[i + 1], "--", 2) != 0) {
            val = argv[++i];
        }
        if (o->kind != MOE_OPT_FLAG && (!val || !*val))
            return usage_f(cmd->name, "option --%s needs a value (%s)", o->name, o->meta ? o->meta : "a value");
        int rc = store(cmd, o, val, args);
        if (rc >= 0) return rc;
        if (seen) seen[k] = true;
    }
    return -1;
}

static void mode_list(const moe_cli_cmd *cmd, unsigned modes, char *buf, size_t n) {
    buf[0] = '\0';
    for (int m = 0; cmd->modes && cmd->modes[m]; m++)
        if (modes & (1u << m)) {
            size_t used = strlen(buf);
            snprintf(buf + used, n - used, "%s%s", used ? ", " : "", cmd->modes[m]);
        }
}

static unsigned all_modes(const moe_cli_cmd *cmd) {
    unsigned all = 0;
    for (int m = 0; cmd->modes && cmd->modes[m]; m++) all |= 1u << m;
    return all;
}

int moe_cli_check_modes(const moe_cli_cmd *cmd, const bool *seen, int mode) {
    for (int k = 0; k < cmd->n_opts; k++) {
        const moe_opt *o = &cmd->opts[k];
        if (!seen[k] || !o->modes || (o->modes & (1u << mode))) continue;
        char list[256];
        mode_list(cmd, o->modes, list, sizeof list);
        return usage_f(cmd->name, "--%s applies to %s only, not to %s", o->name, list, cmd->modes[mode]);
    }
    return -1;
}

/* ------------------------------------------------------------------ help */

#define HELP_WIDTH 100 /* columns of --help */

/* text's lines, each wrapped at word boundaries to fit HELP_WIDTH after
 * `indent` columns (the first line's indent already printed unless
 * first_indented). */
static void print_lines(FILE *f, const char *text, int indent, bool first_indented) {
    const char *p = text;
    bool first = true;
    int room = HELP_WIDTH - indent;
    while (*p) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        const char *q = p, *end = p + len;
        do {
            size_t take = (size_t)(end - q);
            if ((int)take > room) { /* break at the last space that fits */
                take = (size_t)room;
                while (take > 0 && q[take] != ' ') take--;
                if (take == 0) take = (size_t)room;
            }
            if (!first || first_indented) fprintf(f, "%*s", indent, "");
            fprintf(f, "%.*s\n", (int)take, q);
            first = false;
            q += take;
            while (q < end && *q == ' ') q++;
        } while (q < end);
        p += len + (nl ? 1 : 0);
    }
}

void moe_cli_print_help(FILE *f, const moe_cli_cmd *cmd) {
    const char *p = cmd->synopsis;
    bool first = true;
    while (*p) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        fprintf(f, "%s%.*s\n", first ? "usage: " : "       ", (int)len, p);
        first = false;
        p += len + (nl ? 1 : 0);
    }
    fputc('\n', f);
    print_lines(f, cmd->about, 0, false);
    fputs("\noptions:\n", f);
    const int col = 24;
    unsigned all = all_modes(cmd);
    for (int k = 0; k < cmd->n_opts; k++) {
        const moe_opt *o = &cmd->opts[k];
        char head[96];
        snprintf(head, sizeof head, "  --%s%s%s", o->name, o->meta ? " " : "", o->meta ? o->meta : "");
        if ((int)strlen(head) < col - 1) fprintf(f, "%-*s", col, head);
        else fprintf(f, "%s\n%*s", head, col, "");
        char joined[2048]; /* an option's help is prose, wrapped anew; lines that start with a space are kept */
        snprintf(joined, sizeof joined, "%s", o->help);
        for (char *c = joined; *c; c++)
            if (*c == '\n' && c[1] != ' ') *c = ' ';
        print_lines(f, joined, col, false);
        if (o->alias) fprintf(f, "%*s(also --%s)\n", col, "", o->alias);
        if (o->modes && o->modes != all) {
            char list[256];
            mode_list(cmd, o->modes, list, sizeof list);
            fprintf(f, "%*s[%s only]\n", col, "", list);
        }
    }
    fprintf(f, "%-*s%s\n", col, "  -h, --help", "this help (also: moeaudit help CMD)");
    if (cmd->footer && *cmd->footer) {
        fputc('\n', f);
        print_lines(f, cmd->footer, 0, false);
    }
}

/* ------------------------------------------------------------- man page */

/* roff-escaped text: backslashes, hyphens as minus signs (option names
 * copy-paste right), a leading '.' or '\'' protected. */
static void roff(FILE *f, const char *s, size_t len) {
    bool bol = true;
    for (size_t i = 0; i < len; i++) {
        char ch = s[i];
        if (bol && (ch == '.' || ch == '\'')) fputs("\\&", f);
        bol = false;
        if (ch == '\\') fputs("\\e", f);
        else if (ch == '-') fputs("\\-", f);
        else if (ch == '\n') { fputc('\n', f); bol = true; }
        else fputc(ch, f);
    }
}

static void roff_s(FILE *f, const char *s) { roff(f, s, strlen(s)); }

/* Paragraph text: a blank line starts a new .PP; indented lines (lists,
 * examples) are kept as written. */
static void roff_text(FILE *f, const char *text) {
    const char *p = text;
    bool in_nf = false;
    while (*p) {
        const char *nl = strchr(p, '\n');
        size_t len = nl ? (size_t)(nl - p) : strlen(p);
        bool blank = len == 0, indented = len > 0 && p[0] == ' ';
        if (blank) {
            if (in_nf) { fputs(".fi\n", f); in_nf = false; }
            fputs(".PP\n", f);
        } else {
            if (indented && !in_nf) { fputs(".nf\n", f); in_nf = true; }
            if (!indented && in_nf) { fputs(".fi\n", f); in_nf = false; }
            roff(f, p, len);
            fputc('\n', f);
        }
        p += len + (nl ? 1 : 0);
    }
    if (in_nf) fputs(".fi\n", f);
}

static const char man_head[] =
    "moeaudit runs the MoE blocks of DeepSeek V3/V4 checkpoints exactly (float64, the reference)\n"
    "and fast (f32 kernels for AVX2 and AVX-512, CUDA on Hopper, MPI expert parallelism), and\n"
    "audits numerics: it grades every precision shortcut against float64 (audit), names the\n"
    "broken routed-scaling contract in another engine's dump (diagnose), and probes what the\n"
    "lightning indexer's precisions lose (needle).\n"
    "\n"
    "Every command takes its options as --name value or --name=value; - names stdout for every\n"
    "option that writes a file. moeaudit help CMD prints what moeaudit CMD --help prints.\n";

void moe_cli_print_man(FILE *f, const moe_cli_cmd *const *cmds, int n) {
    fputs(".\\\" Generated by 'moeaudit help --man' from the CLI's option tables: edit tools/, not this file.\n", f);
    fprintf(f, ".TH MOEAUDIT 1 \"\" \"moeaudit %s\" \"User Commands\"\n", MOEAUDIT_VERSION);
    fputs(".SH NAME\nmoeaudit \\- run and audit DeepSeek V3/V4 Mixture\\-of\\-Experts blocks\n", f);
    fputs(".SH SYNOPSIS\n.B moeaudit\n.I command\n.RI [ options ]\n.br\n.B moeaudit help\n.RI [ command ]\n", f);
    fputs(".SH DESCRIPTION\n", f);
    roff_text(f, man_head);
    fputs(".SH COMMANDS\n", f);
    for (int i = 0; i < n; i++) {
        const moe_cli_cmd *c = cmds[i];
        fprintf(f, ".SS \"moeaudit %s\"\n", c->name);
        roff_s(f, c->summary);
        fputs("\n.PP\n.nf\n", f);
        roff_s(f, c->synopsis);
        fputs("\n.fi\n.PP\n", f);
        roff_text(f, c->about);
        unsigned all = all_modes(c);
        for (int k = 0; k < c->n_opts; k++) {
            const moe_opt *o = &c->opts[k];
            fputs(".TP\n\\fB\\-\\-", f);
            roff_s(f, o->name);
            fputs("\\fR", f);
            if (o->meta) { fputs(" \\fI", f); roff_s(f, o->meta); fputs("\\fR", f); }
            fputc('\n', f);
            roff_text(f, o->help); /* prose filled, indented lines (tables) kept */
            if (o->alias) { fputs("(Also \\-\\-", f); roff_s(f, o->alias); fputs(".)\n", f); }
            if (o->modes && o->modes != all) {
                char list[256];
                mode_list(c, o->modes, list, sizeof list);
                fputs("[", f);
                roff_s(f, list);
                fputs(" only]\n", f);
            }
        }
        if (c->footer && *c->footer) { fputs(".PP\n", f); roff_text(f, c->footer); }
    }
    fputs(".SH PRECISION NAMES\nThe same names everywhere; each command accepts those its arithmetic has.\n", f);
    for (const moe_cli_prec *p = moe_cli_precs; p->name; p++) {
        fputs(".TP\n.B ", f);
        roff_s(f, p->name);
        fputc('\n', f);
        roff_s(f, p->meaning);
        if (p->aliases[0]) { fputs(" (Also: ", f); roff_s(f, p->aliases); fputs(".)", f); }
        fputc('\n', f);
    }
    fputs(".SH EXIT STATUS\n.TP\n.B 0\nsuccess\n.TP\n.B 1\nfailure: a contract violation, a diagnosis other than OK, "
          "an audit row at or above \\-\\-fail\\-on, a layer or rank that failed\n.TP\n.B 2\nusage or input error: "
          "the message names the option, file, tensor and value\n", f);
    fputs(".SH ENVIRONMENT\n.TP\n.B MOE_ISA\nref, avx2 or avx512: the CPU kernel table (\\-\\-isa overrides)\n"
          ".TP\n.B OMP_NUM_THREADS\nOpenMP threads (\\-\\-threads overrides)\n"
          ".TP\n.B MOEAUDIT_DATA\nthe directory holding the bundled checkpoints (default: "
          "\\fIPREFIX\\fR/share/moeaudit beside the installed executable)\n"
          ".TP\n.B MOE_CUDA_SMALLT_LAUNCH\npdl (default), pdl\\-l2, l2 or plain: how \\-\\-device cuda launches the "
          "small\\-T GEMV chain: programmatic dependent launches, the L2 prefetch of the FP4 GEMVs (plain: "
          "neither, the earlier launches; same results)\n"
          ".TP\n.B MOE_CUDA_WG_TOKENS\nauto (default), 128 or 256: token rows per tile of \\-\\-device cuda's wgmma "
          "GEMMs with bf16 operands (auto: 256 where the positions average at least 128 per expert; same results)\n"
          ".TP\n.B MOEAUDIT_TORCH_PEER\nthe torch peer script of bench \\-\\-device cuda (bench/cuda/torch_peer.py; "
          "default: the copy in the source tree the build was configured from)\n"
          ".TP\n.B MOE_CUDA_QG_CLUSTER\n1: \\-\\-device cuda runs the FP8 x FP8 GEMMs as 2\\-CTA clusters "
          "multicasting the weight tile (same results; measured no faster, kept for the A/B)\n", f);
    fputs(".SH FILES\n.TP\n.I PREFIX/share/moeaudit/dsv4\\-tiny, dsv3\\-tiny, dsv3\\-tiny\\-fp8\n"
          "tiny DeepSeek V4 and V3 checkpoints (HF layout) with their transformers float64 oracle outputs; "
          "\\-\\-model takes these names\n", f);
    fputs(".SH SEE ALSO\nThe user guide, docs/guide.md, and the JSON schemas of the reports, docs/schemas/, in the "
          "source tree (installed under \\fIPREFIX\\fR/share/doc/moeaudit).\n", f);
}

/* ------------------------------------------------------------ common */

moe_cli_common moe_cli_common_default(void) {
    moe_cli_common c;
    memset(&c, 0, sizeof c);
    c.layer = -1;
    return c;
}

/* ------------------------------------------------------ precision names */

const moe_cli_prec moe_cli_precs[] = {
    {"ref", "f64", MOE_PU_BLOCK | MOE_PU_HC, "float64 throughout: the reference every other precision is graded against"},
    {"f32", "fp32", MOE_PU_BLOCK | MOE_PU_HC | MOE_PU_IDX | MOE_PU_CPU_BENCH,
     "float32 arithmetic; values kept in float32, nothing rounded further"},
    {"exact", "none", MOE_PU_ACT | MOE_PU_CPU_BENCH,
     "activations as the arithmetic holds them (float64 under ref, float32 under f32): no extra rounding"},
    {"tf32", "", MOE_PU_HC, "TF32 products (inputs rounded to a 10-bit mantissa), fp32 accumulation"},
    {"bf16", "", MOE_PU_ACT | MOE_PU_GPU_ACT | MOE_PU_CPU_BENCH | MOE_PU_HC | MOE_PU_IDX,
     "bfloat16 (8-bit mantissa), round to nearest even"},
    {"bf16-split", "", MOE_PU_HC, "each value as a hi + lo bf16 pair, three bf16 products (near-fp32 on bf16 units)"},
    {"fp8", "fp8-pow2", MOE_PU_ACT | MOE_PU_GPU_ACT | MOE_PU_IDX,
     "E4M3 per 128 values with a power-of-two scale (UE8M0): DeepSeek V3.1+ and V4"},
    {"fp8-f32scale", "e4m3", MOE_PU_ACT | MOE_PU_GPU_ACT | MOE_PU_IDX,
     "E4M3 per 128 values with an fp32 scale amax/448: DeepSeek V3"},
    {"nvfp4", "", MOE_PU_ACT | MOE_PU_CPU_BENCH,
     "W4A4: E2M1 per 16 values with a UE4M3 scale from the block amax and the checkpoint's static "
     "input_scale, one per expert GEMM for the layer (TensorRT-LLM, FlashInfer)"},
    {"nvfp4-expert", "", MOE_PU_ACT,
     "as nvfp4 with each expert's own input_scale (vLLM's CUTLASS MoE)"},
    {"fp4", "mxfp4 e2m1", MOE_PU_IDX, "E2M1 per 32 values with an E8M0 scale (MXFP4; the V4 indexer's simulation)"},
    {NULL, NULL, 0, NULL},
};

static bool in_aliases(const char *aliases, const char *s) {
    size_t n = strlen(s);
    for (const char *p = aliases; *p;) {
        const char *sp = strchr(p, ' ');
        size_t len = sp ? (size_t)(sp - p) : strlen(p);
        if (len == n && !strncmp(p, s, n)) return true;
        p += len + (sp ? 1 : 0);
    }
    return false;
}

const moe_cli_prec *moe_cli_prec_find(const char *s, moe_cli_prec_use use) {
    for (const moe_cli_prec *p = moe_cli_precs; p->name; p++)
        if ((p->uses & (unsigned)use) && (!strcmp(p->name, s) || in_aliases(p->aliases, s))) return p;
    return NULL;
}

const char *moe_cli_prec_list(moe_cli_prec_use use, char *buf, size_t n) {
    int count = 0, i = 0;
    for (const moe_cli_prec *p = moe_cli_precs; p->name; p++) count += (p->uses & (unsigned)use) != 0;
    buf[0] = '\0';
    for (const moe_cli_prec *p = moe_cli_precs; p->name; p++) {
        if (!(p->uses & (unsigned)use)) continue;
        size_t used = strlen(buf);
        snprintf(buf + used, n - used, "%s%s", i == 0 ? "" : i + 1 == count ? " or " : ", ", p->name);
        i++;
    }
    return buf;
}

int moe_cli_prec_bad(const char *cmd, const char *opt, const char *value, moe_cli_prec_use use) {
    char list[256];
    return usage_f(cmd, "--%s %s: expected %s", opt, value, moe_cli_prec_list(use, list, sizeof list));
}

/* ------------------------------------------------------------ outputs */

FILE *moe_cli_open_out(const char *path, moe_out_file **h) {
    *h = NULL;
    if (!strcmp(path, "-")) return stdout;
    moe_error err;
    moe_status st = moe_out_open(path, h, &err);
    if (st != MOE_OK) {
        moe_cli_fail(st, &err);
        return NULL;
    }
    FILE *f = moe_out_stream(*h);
    if (!f) {
        moe_out_abort(*h);
        *h = NULL;
        fprintf(stderr, "moeaudit: %s: out of memory\n", path);
    }
    return f;
}

int moe_cli_check_outputs(const char *cmd, const char *const *outs, int n_out, const char *const *inputs, int n_in,
                          const char *model_dir) {
    int rc = -1;
    size_t cap = (size_t)n_in + 16, n = 0;
    char **list = malloc(cap * sizeof *list);
    if (!list) { fprintf(stderr, "moeaudit %s: out of memory\n", cmd); return EXIT_FAIL; }
    for (int i = 0; i < n_in; i++)
        if (inputs[i]) list[n++] = strdup(inputs[i]);
    DIR *d = model_dir ? opendir(model_dir) : NULL;
    struct dirent *de;
    while (d && (de = readdir(d)) != NULL) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, "..")) continue;
        if (n == cap) {
            char **grown = realloc(list, 2 * cap * sizeof *list);
            if (!grown) break;
            list = grown;
            cap *= 2;
        }
        size_t len = strlen(model_dir) + strlen(de->d_name) + 2;
        char *p = malloc(len);
        if (p) snprintf(p, len, "%s/%s", model_dir, de->d_name);
        list[n++] = p;
    }
    if (d) closedir(d);
    for (int k = 0; k < n_out && rc < 0; k++) {
        if (!outs[k] || !strcmp(outs[k], "-")) continue;
        moe_error err;
        if (moe_out_check_inputs(outs[k], (const char *const *)list, n, &err) != MOE_OK) {
            fprintf(stderr, "moeaudit %s: %s\n", cmd, err.msg);
            rc = EXIT_USAGE;
        }
    }
    for (size_t i = 0; i < n; i++) free(list[i]);
    free(list);
    return rc;
}

bool moe_cli_close_out(FILE *f, moe_out_file *h, const char *path) {
    if (!h) {
        bool ok = !ferror(f) && fflush(f) == 0;
        if (!ok) fprintf(stderr, "moeaudit: stdout: write failed\n");
        return ok;
    }
    if (ferror(f)) {
        moe_out_abort(h);
        fprintf(stderr, "moeaudit: %s: out of memory while writing the report: nothing written\n", path);
        return false;
    }
    moe_error err;
    moe_status st = moe_out_commit(h, &err);
    if (st != MOE_OK) moe_cli_fail(st, &err);
    return st == MOE_OK;
}

int moe_cli_one_stdout(const char *cmd, const char *const *paths, const char *const *names, int n) {
    int first = -1;
    for (int i = 0; i < n; i++) {
        if (!paths[i] || strcmp(paths[i], "-")) continue;
        if (first >= 0)
            return usage_f(cmd, "--%s - and --%s - both write to stdout: give one of them a file", names[first], names[i]);
        first = i;
    }
    return -1;
}

bool moe_cli_any_stdout(const char *const *paths, int n) {
    for (int i = 0; i < n; i++)
        if (paths[i] && !strcmp(paths[i], "-")) return true;
    return false;
}

FILE *moe_cli_text(bool quiet, bool report_on_stdout) { return quiet ? NULL : report_on_stdout ? stderr : stdout; }

/* --------------------------------------------------------------- data */

#ifndef MOE_REL_DATADIR
#define MOE_REL_DATADIR "../share/moeaudit"
#endif

static bool is_dir(const char *p) {
    struct stat st;
    return stat(p, &st) == 0 && S_ISDIR(st.st_mode);
}

/* The directory of the running executable (Linux: /proc/self/exe). */
static bool exe_dir(char *buf, size_t n) {
    ssize_t len = readlink("/proc/self/exe", buf, n - 1);
    if (len <= 0) return false;
    buf[len] = '\0';
    char *slash = strrchr(buf, '/');
    if (!slash) return false;
    *slash = '\0';
    return true;
}

bool moe_cli_data_dir(char *buf, size_t n) {
    const char *env = getenv("MOEAUDIT_DATA");
    if (env && *env) {
        snprintf(buf, n, "%s", env);
        return is_dir(buf);
    }
    char dir[PATH_MAX];
    if (!exe_dir(dir, sizeof dir)) return false;
    static const char *const rel[] = {MOE_REL_DATADIR, "share/moeaudit"};
    for (size_t i = 0; i < sizeof rel / sizeof rel[0]; i++) {
        char p[PATH_MAX + 64], real[PATH_MAX];
        snprintf(p, sizeof p, "%s/%s", dir, rel[i]);
        if (!is_dir(p)) continue;
        snprintf(buf, n, "%s", realpath(p, real) ? real : p); /* as messages should name it */
        return true;
    }
    return false;
}

const char *moe_cli_model_path(const char *model, char *buf, size_t n) {
    const char *name = model ? model : MOE_CLI_DEFAULT_MODEL;
    if (model && (strchr(model, '/') || is_dir(model))) {
        snprintf(buf, n, "%s", model);
        return buf;
    }
    char data[PATH_MAX];
    if (moe_cli_data_dir(data, sizeof data)) {
        snprintf(buf, n, "%s/%s", data, name);
        if (is_dir(buf)) return buf;
    }
    if (model) { /* not a bundled name either: let the loader name the path */
        snprintf(buf, n, "%s", model);
        return buf;
    }
    char exe[PATH_MAX] = "?";
    if (!exe_dir(exe, sizeof exe)) snprintf(exe, sizeof exe, "?");
    fprintf(stderr, "moeaudit: the bundled checkpoint %s was not found: looked in $MOEAUDIT_DATA, %s/%s and "
                    "%s/share/moeaudit; pass --model DIR\n", name, exe, MOE_REL_DATADIR, exe);
    return NULL;
}

/* ------------------------------------------------------- threads, ISA */

int moe_cli_apply_common(const char *cmd, const moe_cli_common *c, moe_isa *isa) {
#ifdef _OPENMP
    if (c->threads > 0) omp_set_num_threads((int)c->threads);
#endif
    if (!isa) return -1;
    if (!c->isa) return moe_cli_isa_default(isa) == EXIT_OKAY ? -1 : EXIT_USAGE;
    moe_error err;
    moe_isa v, taken;
    moe_status st = moe_isa_parse(c->isa, &v, &err);
    if (st == MOE_OK) st = moe_isa_resolve(v, &taken, &err);
    if (st != MOE_OK) return usage_f(cmd, "--isa %s: %s", c->isa, err.msg);
    *isa = v;
    return -1;
}
