/*
 * `moeaudit bisect`: which of a deployment's precision patches loses the
 * needle (include/moeaudit_bisect.h, docs/bisect.md).
 *
 * The options are the command's one table (bisect_opts below, the CLI's
 * grammar: tools/args.c); the same table prints --help, `moeaudit help
 * bisect` and the man page. Under mpirun the runs (or the grid's cells) are
 * spread over the ranks; rank 0 writes the one report.
 */
#include "cli.h"
#include "moeaudit.h"
#include "moeaudit_bisect.h"

#include <math.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define MAX_LIST 256

typedef struct bisect_args {
    moe_cli_common c;
    const char *prompt, *patches, *needle_s, *answer_s, *chunks_s, *sweep_s, *depths_s;
    long length, query, needle_len, key_len, seed;
    double depth;
    bool prefill_query, list, length_given;
    const char *model; /* resolved checkpoint directory */
} bisect_args;

typedef bisect_args A;

static const moe_opt bisect_opts[] = {
    MOE_OPT_MODEL(A, "checkpoint directory or a bundled checkpoint's name (default dsv4-tiny)"),
    {"patches", "LIST", MOE_OPT_STR, offsetof(A, patches), 0, 0, NULL, 0,
     "the deployment's patches, comma-separated: NAME[=N][@A..B][:all|prefill|decode]\n"
     "(--list-patches shows the table)", NULL},
    {"prompt", "FILE", MOE_OPT_STR, offsetof(A, prompt), 0, 0, NULL, 0,
     "safetensors with input_ids [T] (I32/I64); without it a haystack of --length tokens is built", NULL},
    {"needle", "START:END", MOE_OPT_STR, offsetof(A, needle_s), 0, 0, NULL, 0,
     "the needle span [START, END) of the prompt (required with --prompt)", NULL},
    {"query", "POS", MOE_OPT_INT, offsetof(A, query), 0, 1L << 30, NULL, 0,
     "the position whose next token is read (default: the prompt's last; later tokens are dropped)", NULL},
    {"answer", "IDS", MOE_OPT_STR, offsetof(A, answer_s), 0, 0, NULL, 0,
     "the expected continuation, comma-separated token ids (haystack: the needle's rest)", NULL},
    {"length", "N", MOE_OPT_INT, offsetof(A, length), 8, 1L << 24, NULL, 0, "haystack length in tokens (default 4096)",
     NULL},
    {"depth", "D", MOE_OPT_NUM, offsetof(A, depth), 0, 0, NULL, 0, "haystack needle depth in [0, 1] (default 0.5)", NULL},
    {"needle-len", "N", MOE_OPT_INT, offsetof(A, needle_len), 2, 256, NULL, 0, "haystack needle tokens (default 8)", NULL},
    {"key-len", "N", MOE_OPT_INT, offsetof(A, key_len), 1, 255, NULL, 0,
     "haystack: the needle's first N tokens repeat as the query (default 4)", NULL},
    {"seed", "S", MOE_OPT_INT, offsetof(A, seed), 0, 2147483647L, NULL, 0, "haystack seed (default 20261201)", NULL},
    {"chunks", "N1,N2,...", MOE_OPT_STR, offsetof(A, chunks_s), 0, 0, NULL, 0,
     "prefill chunk sizes (the last repeats); the query and answer run as decode steps", NULL},
    {"prefill-query", NULL, MOE_OPT_FLAG, offsetof(A, prefill_query), 0, 0, NULL, 0,
     "the query is the prefill's last position (a disaggregated prefill's first token), not a decode step", NULL},
    {"sweep-length", "A..B[:S]", MOE_OPT_STR, offsetof(A, sweep_s), 0, 0, NULL, 0,
     "needle-in-a-haystack grid over prompt lengths A..B (step S) x --depths: reference vs deployment", NULL},
    {"depths", "D1,D2,...", MOE_OPT_STR, offsetof(A, depths_s), 0, 0, NULL, 0, "grid needle depths (default 0.1,0.5,0.9)",
     NULL},
    MOE_OPT_JSON(A, "the report as one JSON document, byte-identical for identical inputs ('-': stdout)"),
    MOE_OPT_HTML(A, "the report as one self-contained HTML page ('-': stdout)"),
    MOE_OPT_THREADS(A),
    MOE_OPT_QUIET(A, "no report on stdout"),
    {"list-patches", NULL, MOE_OPT_FLAG, offsetof(A, list), 0, 0, NULL, 0, "list the patch table and exit", NULL},
};

static int bisect_main(int argc, char **argv);

const moe_cli_cmd moe_cli_bisect = {
    "bisect",
    "which of a deployment's precision patches loses the needle, through the whole model",
    "moeaudit bisect --patches LIST [--model DIR] [--prompt FILE --needle START:END] [--query POS]\n"
    "                [--answer IDS] [--length N] [--depth D] [--chunks N1,...] [--prefill-query]\n"
    "                [--sweep-length A..B[:S] --depths D1,...] [--json FILE] [--html FILE]\n"
    "                [--threads N] [--quiet]\n"
    "moeaudit bisect --list-patches",
    "Which of a deployment's precision patches loses the needle? Runs the float64 forward once, then\n"
    "every patch alone, all together and all but one, each as a serving engine runs the request (a\n"
    "prefill, then decode steps: the query's step retrieves the needle), and reports per CSA layer\n"
    "whether the needle's compressed entries are in the query's top-k (rank, margin), the attention\n"
    "weight on the needle, the stream error, the KL divergence of the next-token distribution, top-1\n"
    "and the answer's log-probability, then a verdict: which patch moves the needle out, which are\n"
    "harmless, which must come together (docs/bisect.md).",
    bisect_opts,
    (int)(sizeof bisect_opts / sizeof bisect_opts[0]),
    NULL,
    "Under mpirun -np N the runs are spread over the ranks and rank 0 writes the report (the same bytes).\n"
    "Exit status: 0 the deployment is harmless or marginal, 1 it is harmful (or a run failed), 2 usage or\n"
    "input error (the message names the file, value or patch).",
    bisect_main,
};

/* Parse argv into a: defaults, the table, then what the table cannot say. */
static int parse_args(int argc, char **argv, bisect_args *a) {
    memset(a, 0, sizeof *a);
    a->c = moe_cli_common_default();
    a->length = 4096;
    a->depth = 0.5;
    a->needle_len = 8;
    a->key_len = 4;
    a->seed = 20261201;
    a->query = -1;
    bool seen[MOE_CLI_MAX_OPTS];
    int rc = moe_cli_parse(&moe_cli_bisect, argc, argv, a, seen);
    if (rc >= 0) return rc;
    a->length_given = seen[moe_cli_opt_index(&moe_cli_bisect, "length")];
    if (!(a->depth >= 0 && a->depth <= 1)) {
        char v[64];
        snprintf(v, sizeof v, "%g", a->depth);
        return moe_cli_usage("bisect", "--depth %s: expected a number in [0, 1]", v);
    }
    return -1;
}

/* Comma-separated integers into out [cap] (count, or -1). */
static int parse_list(const char *s, long lo, long hi, int64_t *out, int cap) {
    char buf[4096];
    if (strlen(s) >= sizeof buf) return -1;
    snprintf(buf, sizeof buf, "%s", s);
    int n = 0;
    for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
        long v;
        if (n == cap || !moe_cli_parse_int(t, lo, hi, &v)) return -1;
        out[n++] = v;
    }
    return n;
}

static int parse_depths(const char *s, double *out, int cap) {
    char buf[1024];
    if (strlen(s) >= sizeof buf) return -1;
    snprintf(buf, sizeof buf, "%s", s);
    int n = 0;
    for (char *t = strtok(buf, ","); t; t = strtok(NULL, ",")) {
        char *end;
        double d = strtod(t, &end);
        if (n == cap || end == t || *end || !(d >= 0 && d <= 1)) return -1;
        out[n++] = d;
    }
    return n;
}

static void list_patches(void) {
    printf("%-28s %-6s %s\n", "patch", "phase", "what it models");
    for (int i = 0; i < moe_patch_table_size(); i++) {
        const moe_patch_info *p = moe_patch_table_at(i);
        char name[64];
        snprintf(name, sizeof name, "%s%s", p->name, p->takes_value ? "=N" : "");
        printf("%-28s %-6s %s\n", name, p->phase == MOE_PHASE_DECODE ? "decode" : "all", p->what);
    }
    printf("\nEach takes @A..B (layers) and :all|prefill|decode (phase). One value per component and layer.\n");
}

/* The library's moe_errf for the CLI: fill err, return s. */
static moe_status fail_with(moe_error *err, moe_status s, const char *msg) {
    if (err) snprintf(err->msg, sizeof err->msg, "%s", msg);
    return s;
}

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

/* Write a report ("-": stdout) through the CLI's writer: a file is written
 * atomically (a failure leaves no partial report). */
static int write_report(const char *path, int html, const moe_bisect_report *r, const moe_bisect_grid *g, FILE *text) {
    moe_out_file *h = NULL;
    FILE *f = moe_cli_open_out(path, &h);
    if (!f) return EXIT_FAIL;
    moe_status st = html ? moe_bisect_report_html(f, r, g) : moe_bisect_report_json(f, r, g);
    if (st != MOE_OK) fprintf(stderr, "moeaudit: %s: cannot write the report (%s)\n", path, moe_status_str(st));
    bool ok = moe_cli_close_out(f, h, path) && st == MOE_OK;
    if (ok && text && strcmp(path, "-")) fprintf(text, "wrote %s\n", path);
    return ok ? EXIT_OKAY : EXIT_FAIL;
}

/* ------------------------------------------------------------- the prompt */

typedef struct prompt {
    int64_t *ids, *answer, *chunks;
    int64_t n_ids, needle_start, needle_end;
    int n_answer, n_chunks;
} prompt;

static void prompt_free(prompt *p) {
    free(p->ids);
    free(p->answer);
    free(p->chunks);
    memset(p, 0, sizeof *p);
}

static int read_prompt(const char *path, int vocab, prompt *p) {
    moe_error err;
    moe_st_file *f = NULL;
    moe_status st = moe_st_open(path, &f, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    const moe_st_tensor *t = moe_st_find(f, "input_ids");
    int rc = EXIT_USAGE;
    if (!t) fprintf(stderr, "moeaudit: %s: no tensor named \"input_ids\"\n", path);
    else if ((t->dtype != MOE_DTYPE_I32 && t->dtype != MOE_DTYPE_I64) || t->ndim != 1 || t->shape[0] < 1)
        fprintf(stderr, "moeaudit: %s: tensor input_ids must be I32 or I64 [T] with T >= 1\n", path);
    else {
        p->n_ids = t->shape[0];
        p->ids = malloc((size_t)p->n_ids * sizeof *p->ids);
        if (!p->ids) {
            fputs("moeaudit: out of memory\n", stderr);
            rc = EXIT_FAIL;
        } else {
            rc = EXIT_OKAY;
            for (int64_t i = 0; i < p->n_ids && rc == EXIT_OKAY; i++) {
                p->ids[i] = moe_load_i64(t->data, t->dtype, (size_t)i);
                if (p->ids[i] < 0 || p->ids[i] >= vocab) {
                    fprintf(stderr, "moeaudit: %s: input_ids[%lld] = %lld is not a token id: the vocabulary has %d entries\n",
                            path, (long long)i, (long long)p->ids[i], vocab);
                    rc = EXIT_USAGE;
                }
            }
        }
    }
    moe_st_close(f);
    return rc;
}

/* The spec's prompt from the arguments: --prompt or a haystack of `length` at `depth`. */
static int make_prompt(const bisect_args *a, const moe_fwd_config *c, int64_t length, double depth, prompt *p) {
    memset(p, 0, sizeof *p);
    int rc = EXIT_OKAY;
    if (a->prompt) {
        rc = read_prompt(a->prompt, c->vocab, p);
        if (rc != EXIT_OKAY) return rc;
        if (!a->needle_s) {
            fprintf(stderr, "moeaudit bisect: --prompt needs --needle START:END\n");
            return EXIT_USAGE;
        }
    } else {
        p->n_ids = length;
        p->ids = malloc((size_t)length * sizeof *p->ids);
        p->answer = malloc((size_t)a->needle_len * sizeof *p->answer);
        if (!p->ids || !p->answer) {
            fputs("moeaudit: out of memory\n", stderr);
            return EXIT_FAIL;
        }
        moe_error err;
        moe_status st = moe_haystack(c->vocab, length, depth, (int)a->needle_len, (int)a->key_len, (uint64_t)a->seed,
                                     p->ids, &p->needle_start, p->answer, &err);
        if (st != MOE_OK) return moe_cli_fail(st, &err);
        p->needle_end = p->needle_start + a->needle_len;
        p->n_answer = (int)(a->needle_len - a->key_len);
    }
    if (a->needle_s) {
        long s0, s1;
        char buf[64];
        snprintf(buf, sizeof buf, "%s", a->needle_s);
        char *colon = strchr(buf, ':');
        if (!colon) return moe_cli_usage("bisect", "--needle %s: expected START:END", a->needle_s);
        *colon = 0;
        if (!moe_cli_parse_int(buf, 0, 1L << 30, &s0) || !moe_cli_parse_int(colon + 1, 0, 1L << 30, &s1))
            return moe_cli_usage("bisect", "--needle %s: expected START:END (token positions)", a->needle_s);
        p->needle_start = s0;
        p->needle_end = s1;
    }
    if (a->query >= 0) {
        if (a->query >= p->n_ids) {
            fprintf(stderr, "moeaudit bisect: --query %ld is past the prompt's last position %lld\n", a->query,
                    (long long)p->n_ids - 1);
            return EXIT_USAGE;
        }
        p->n_ids = a->query + 1;
    }
    if (a->answer_s) {
        free(p->answer);
        p->answer = malloc(MAX_LIST * sizeof *p->answer);
        if (!p->answer) return EXIT_FAIL;
        p->n_answer = parse_list(a->answer_s, 0, c->vocab - 1, p->answer, MAX_LIST);
        if (p->n_answer < 0) {
            fprintf(stderr, "moeaudit bisect: --answer %s: expected token ids in 0..%d, comma-separated\n", a->answer_s,
                    c->vocab - 1);
            return EXIT_USAGE;
        }
    }
    if (a->chunks_s) {
        p->chunks = malloc(64 * sizeof *p->chunks);
        if (!p->chunks) return EXIT_FAIL;
        p->n_chunks = parse_list(a->chunks_s, 1, 1L << 30, p->chunks, 64);
        if (p->n_chunks <= 0) return moe_cli_usage("bisect", "--chunks %s: expected positive token counts N1,N2,...", a->chunks_s);
    }
    return rc;
}

static moe_bisect_spec spec_of(const bisect_args *a, const prompt *p) {
    moe_bisect_spec s = moe_bisect_spec_default();
    s.ids = p->ids;
    s.n_ids = p->n_ids;
    s.needle_start = p->needle_start;
    s.needle_end = p->needle_end;
    s.answer = p->answer;
    s.n_answer = p->n_answer;
    s.chunks = p->chunks;
    s.n_chunks = p->n_chunks;
    s.query_in_prefill = a->prefill_query;
    s.patches = a->patches;
    return s;
}

/* --------------------------------------------------------------- spreading */

/* Deterministic longest-first assignment of n jobs of cost[n] to N ranks:
 * owner[n]. */
static void assign(const double *cost, int n, int N, int *owner) {
    double load[4096];
    int order[4096];
    for (int r = 0; r < N && r < 4096; r++) load[r] = 0;
    for (int i = 0; i < n; i++) order[i] = i;
    for (int i = 1; i < n; i++) /* stable insertion sort by cost, descending */
        for (int k = i; k > 0 && cost[order[k]] > cost[order[k - 1]]; k--) {
            int t = order[k];
            order[k] = order[k - 1];
            order[k - 1] = t;
        }
    for (int i = 0; i < n; i++) {
        int best = 0;
        for (int r = 1; r < N; r++)
            if (load[r] < load[best]) best = r;
        owner[order[i]] = best;
        load[best] += cost[order[i]];
    }
}

typedef struct progress {
    bool on;
    double t0;
} progress;

static void note(progress *pg, const char *fmt, int i, int n, const char *what) {
    if (!pg->on) return;
    fprintf(stderr, "\r\033[K");
    fprintf(stderr, fmt, i, n, what);
    fprintf(stderr, " (%.0f s)", now_s() - pg->t0);
}

#ifdef MOE_HAVE_MPI
#include "moeaudit_mpi.h"
#include <mpi.h>

static bool mpi_launched(void) {
    const char *v = getenv("OMPI_COMM_WORLD_SIZE");
    if (!v) v = getenv("PMI_SIZE");
    return v && atoi(v) > 1;
}
#endif

/* Every job (a run or a cell) through `work` on the ranks that own it,
 * gathered to rank 0 into out (bytes of size each, statuses and messages).
 * Single process: all jobs here. `mine_st`/`mine_msg`: this rank's failure
 * before any job (its jobs then fail with it). Returns false on an MPI
 * failure (printed). */
typedef moe_status (*job_fn)(void *ctx, int i, void *out, moe_error *err);

static bool spread(int n, const double *cost, size_t size, job_fn work, void *ctx, moe_status mine_st, const char *mine_msg,
                   void *out, moe_status *sts, char (*msgs)[512], bool *root, progress *pg, const char *what) {
    int rank = 0, N = 1;
    *root = true;
#ifdef MOE_HAVE_MPI
    bool mpi = mpi_launched();
    if (mpi) {
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        MPI_Comm_size(MPI_COMM_WORLD, &N);
        *root = rank == 0;
        if (rank != 0) pg->on = false;
    }
#endif
    int *owner = calloc((size_t)n + 1, sizeof *owner);
    if (!owner) return false;
    if (N > 1) assign(cost, n, N, owner);
    int done = 0, mine = 0;
    for (int i = 0; i < n; i++) mine += owner[i] == rank;
    for (int i = 0; i < n; i++) {
        if (owner[i] != rank) continue;
        moe_error e = {""};
        note(pg, "run %d/%d: %s", ++done, mine, what ? what : "");
        if (mine_st != MOE_OK) {
            sts[i] = mine_st;
            snprintf(msgs[i], 512, "%s", mine_msg);
            continue;
        }
        sts[i] = work(ctx, i, (char *)out + (size_t)i * size, &e);
        snprintf(msgs[i], 512, "%s", sts[i] == MOE_OK ? "" : e.msg);
    }
#ifdef MOE_HAVE_MPI
    if (mpi) {
        int *idx = calloc((size_t)mine + 1, sizeof *idx);
        const void **rows = calloc((size_t)mine + 1, sizeof *rows);
        size_t *lens = calloc((size_t)mine + 1, sizeof *lens);
        moe_status *ls = calloc((size_t)mine + 1, sizeof *ls);
        const char **lm = calloc((size_t)mine + 1, sizeof *lm);
        int k = 0;
        for (int i = 0; idx && rows && lens && ls && lm && i < n; i++)
            if (owner[i] == rank) {
                idx[k] = i;
                ls[k] = sts[i];
                lm[k] = msgs[i];
                rows[k] = (char *)out + (size_t)i * size;
                lens[k] = sts[i] == MOE_OK ? size : 0;
                k++;
            }
        moe_status rs = idx && rows && lens && ls && lm ? mine_st : MOE_ERR_NOMEM;
        moe_lp_local loc = {rs, rs == MOE_OK ? "" : mine_msg, k, idx, ls, lm, rows, lens};
        moe_lp_report rep;
        moe_error e = {""};
        moe_status st = moe_lp_gather(MPI_COMM_WORLD, 0, &loc, &rep, &e);
        free(idx);
        free(rows);
        free(lens);
        free(ls);
        free(lm);
        if (st != MOE_OK) {
            if (rank == 0) moe_cli_fail(st, &e);
            free(owner);
            return false;
        }
        if (rank == 0) {
            for (int i = 0; i < n; i++) {
                sts[i] = MOE_ERR_IO;
                snprintf(msgs[i], 512, "rank %d sent no result", owner[i]);
            }
            for (int i = 0; i < rep.n_entries; i++) {
                const moe_lp_entry *en = &rep.entries[i];
                if (en->layer < 0 || en->layer >= n) continue;
                sts[en->layer] = en->status;
                if (en->status == MOE_OK && en->row_len == size) {
                    memcpy((char *)out + (size_t)en->layer * size, en->row, size);
                    msgs[en->layer][0] = 0;
                } else {
                    if (en->status == MOE_OK) sts[en->layer] = MOE_ERR_FORMAT;
                    snprintf(msgs[en->layer], 512, "rank %d: %.490s", en->rank, en->msg);
                }
            }
            for (int r = 0; r < rep.n_ranks; r++)
                if (rep.ranks[r].status != MOE_OK)
                    fprintf(stderr, "moeaudit: rank %d failed (%d of its jobs): %s\n", r, rep.ranks[r].n_layers,
                            rep.ranks[r].msg);
            moe_lp_report_free(&rep);
        }
    }
#endif
    free(owner);
    return true;
}

/* ---------------------------------------------------------------- command */

typedef struct run_ctx {
    moe_bisect *b;
} run_ctx;

static moe_status run_job(void *ctx, int i, void *out, moe_error *err) {
    run_ctx *c = ctx;
    return moe_bisect_run(c->b, i, out, err);
}

typedef struct cell_ctx {
    moe_fwd *f;
    const bisect_args *a;
    const moe_fwd_config *cfg;
    const int64_t *lens;
    const double *deps;
    int nlen;
} cell_ctx;

static moe_status cell_job(void *ctx, int i, void *out, moe_error *err) {
    cell_ctx *c = ctx;
    moe_bisect_cell *cell = out;
    memset(cell, 0, sizeof *cell);
    cell->depth = c->deps[i / c->nlen];
    cell->length = c->lens[i % c->nlen];
    prompt p;
    int rc = make_prompt(c->a, c->cfg, cell->length, cell->depth, &p);
    moe_status st = MOE_OK;
    if (rc != EXIT_OKAY) st = fail_with(err, MOE_ERR_ARG, "cannot build the haystack (the message above)");
    else {
        moe_bisect_spec sp = spec_of(c->a, &p);
        st = moe_bisect_cell_run(c->f, &sp, cell, err);
    }
    prompt_free(&p);
    cell->status = st;
    return st;
}

static int bisect_main(int argc, char **argv) {
    bisect_args a;
    int rc = parse_args(argc, argv, &a);
    if (rc >= 0) return rc;
    if (a.list) {
        list_patches();
        return EXIT_OKAY;
    }
    if (!a.patches) return moe_cli_usage("bisect", "%s", "--patches LIST is required (--list-patches shows the table)");
    if (a.sweep_s && a.prompt) return moe_cli_usage("bisect", "%s", "--sweep-length builds haystacks: it cannot take --prompt");
    const char *outs[2] = {a.c.json, a.c.html}, *onames[2] = {"json", "html"};
    if ((rc = moe_cli_one_stdout("bisect", outs, onames, 2)) >= 0) return rc;
    if ((rc = moe_cli_apply_common("bisect", &a.c, NULL)) >= 0) return rc;
    char model_path[4096];
    if (!(a.model = moe_cli_model_path(a.c.model, model_path, sizeof model_path))) return EXIT_USAGE;
    const char *ins[1] = {a.prompt};
    if ((rc = moe_cli_check_outputs("bisect", outs, 2, ins, 1, a.model)) >= 0) return rc;
    FILE *text = moe_cli_text(a.c.quiet, moe_cli_any_stdout(outs, 2));
    int64_t lens[MAX_LIST];
    double deps[64] = {0.1, 0.5, 0.9};
    int nlen = 0, ndep = 3;
    if (a.sweep_s) {
        long x, y, step = 0;
        char buf[128];
        snprintf(buf, sizeof buf, "%s", a.sweep_s);
        char *dots = strstr(buf, ".."), *colon = strchr(buf, ':');
        if (colon) *colon = 0;
        if (!dots) return moe_cli_usage("bisect", "--sweep-length %s: expected A..B or A..B:STEP", a.sweep_s);
        *dots = 0;
        if (!moe_cli_parse_int(buf, 8, 1L << 24, &x) || !moe_cli_parse_int(dots + 2, x, 1L << 24, &y) ||
            (colon && !moe_cli_parse_int(colon + 1, 1, 1L << 24, &step)))
            return moe_cli_usage("bisect", "--sweep-length %s: expected A..B or A..B:STEP with 8 <= A <= B", a.sweep_s);
        if (!step) step = (y - x) / 7 > 0 ? (y - x) / 7 : 1;
        for (long L = x; L <= y && nlen < MAX_LIST; L += step) lens[nlen++] = L;
        if (a.depths_s && (ndep = parse_depths(a.depths_s, deps, 64)) <= 0)
            return moe_cli_usage("bisect", "--depths %s: expected numbers in [0, 1], comma-separated", a.depths_s);
    }
#ifdef MOE_HAVE_MPI
    bool mpi = mpi_launched();
    int inited = 0;
    if (mpi) {
        MPI_Initialized(&inited);
        if (!inited) MPI_Init(NULL, NULL);
    }
#endif
    progress pg = {.on = isatty(2) != 0 && !a.c.quiet, .t0 = now_s()};
    moe_error err = {""};
    moe_fwd *f = NULL;
    moe_bisect *b = NULL;
    moe_bisect_report *rep = NULL;
    moe_bisect_result *results = NULL;
    moe_bisect_cell *cells = NULL;
    moe_status *sts = NULL;
    char (*msgs)[512] = NULL;
    prompt p = {0};
    bool root = true;
    double t_ref = 0;
    moe_status st = moe_fwd_open(a.model, &f, &err);
    const moe_fwd_config *cfg = st == MOE_OK ? moe_fwd_get_config(f) : NULL;
    bool single = !a.sweep_s || a.length_given;
    int prc = EXIT_OKAY;
    if (st == MOE_OK && single) {
        prc = make_prompt(&a, cfg, a.length, a.depth, &p);
        if (prc == EXIT_OKAY) {
            moe_bisect_spec sp = spec_of(&a, &p);
            st = moe_bisect_init(f, &sp, &b, &err);
        } else {
            st = fail_with(&err, MOE_ERR_INPUT, "this rank could not build the prompt (the message above)");
        }
    }
    /* Alone, a bad model, prompt or patch list stops here with its message.
     * Under mpirun rank 0's outcome decides for everyone (the plan is rank
     * 0's); another rank that fails is reported with its jobs. */
    int rank0 = 1;
#ifdef MOE_HAVE_MPI
    if (mpi) {
        int rank;
        MPI_Comm_rank(MPI_COMM_WORLD, &rank);
        rank0 = rank == 0;
    }
#endif
    if (st != MOE_OK && rank0) {
#ifdef MOE_HAVE_MPI
        if (mpi) {
            int want = prc != EXIT_OKAY ? prc : moe_cli_exit_code(st);
            int n = -1 - want; /* what the others wait for: the plan's size */
            if (want != EXIT_OKAY && prc == EXIT_OKAY) moe_cli_fail(st, &err);
            if (single) MPI_Bcast(&n, 1, MPI_INT, 0, MPI_COMM_WORLD);
            rc = want;
            if (single) goto out;
        } else
#endif
        if (single || moe_cli_exit_code(st) == EXIT_USAGE) {
            rc = prc != EXIT_OKAY ? prc : moe_cli_fail(st, &err);
            goto out;
        }
    }
    rc = EXIT_OKAY;
    moe_bisect_grid grid = {0};
    /* the single bisect: reference on every rank, runs spread */
    if (single) {
        int n = 0;
        double cost[2 * MOE_PATCH_MAX + 2];
#ifdef MOE_HAVE_MPI
        if (mpi) { /* rank 0's plan is the plan */
            n = b ? moe_bisect_n_runs(b) : -1;
            MPI_Bcast(&n, 1, MPI_INT, 0, MPI_COMM_WORLD);
            if (n < 0) {
                rc = -1 - n; /* rank 0 failed to plan: its exit code */
                goto out;
            }
            for (int i = 0; i < n; i++) cost[i] = b && i < moe_bisect_n_runs(b) ? moe_bisect_run_at(b, i)->cost : 0;
            MPI_Bcast(cost, n, MPI_DOUBLE, 0, MPI_COMM_WORLD);
        } else
#endif
        {
            n = moe_bisect_n_runs(b);
            for (int i = 0; i < n; i++) cost[i] = moe_bisect_run_at(b, i)->cost;
        }
        note(&pg, "reference %d/%d%s", 1, 1, "");
        double t0 = now_s();
        moe_status ref_st = b ? moe_bisect_reference(b, &err) : st;
        t_ref = now_s() - t0;
        if (b && ref_st == MOE_OK && moe_bisect_n_runs(b) != n)
            ref_st = fail_with(&err, MOE_ERR_ARG, "this rank planned other runs than rank 0 (different arguments?)");
        results = calloc((size_t)n + 1, sizeof *results);
        sts = calloc((size_t)n + 1, sizeof *sts);
        msgs = calloc((size_t)n + 1, sizeof *msgs);
        if (!results || !sts || !msgs) {
            fputs("moeaudit: out of memory\n", stderr);
            rc = EXIT_FAIL;
            goto out;
        }
        run_ctx rx = {b};
        if (!spread(n, cost, sizeof *results, run_job, &rx, ref_st, err.msg, results, sts, msgs, &root, &pg, "runs")) {
            rc = EXIT_FAIL;
            goto out;
        }
        if (root) {
            if (ref_st != MOE_OK) {
                rc = moe_cli_fail(ref_st, &err);
                goto out;
            }
            for (int i = 0; i < n; i++)
                if (sts[i] != MOE_OK) {
                    memset(&results[i], 0, sizeof results[i]);
                    results[i].status = sts[i];
                    snprintf(results[i].msg, sizeof results[i].msg, "%s", msgs[i]);
                    fprintf(stderr, "moeaudit: run %s failed: %s\n", moe_bisect_run_at(b, i)->name, msgs[i]);
                    rc = EXIT_FAIL;
                }
            st = moe_bisect_conclude(b, results, &rep, &err);
            if (st != MOE_OK) {
                rc = moe_cli_fail(st, &err);
                goto out;
            }
        }
    }
    /* the grid: cells spread */
    if (a.sweep_s) {
        int n = nlen * ndep;
        cells = calloc((size_t)n + 1, sizeof *cells);
        moe_status *cst = calloc((size_t)n + 1, sizeof *cst);
        char (*cmsg)[512] = calloc((size_t)n + 1, sizeof *cmsg);
        double *cost = calloc((size_t)n + 1, sizeof *cost);
        if (!cells || !cst || !cmsg || !cost) {
            free(cst);
            free(cmsg);
            free(cost);
            fputs("moeaudit: out of memory\n", stderr);
            rc = EXIT_FAIL;
            goto out;
        }
        for (int i = 0; i < n; i++) cost[i] = (double)lens[i % nlen];
        cell_ctx cx = {f, &a, cfg, lens, deps, nlen};
        bool ok = spread(n, cost, sizeof *cells, cell_job, &cx, f ? MOE_OK : st, err.msg, cells, cst, cmsg, &root, &pg,
                         "cells");
        for (int i = 0; ok && root && i < n; i++) {
            cells[i].depth = deps[i / nlen];
            cells[i].length = lens[i % nlen];
            if (cst[i] != MOE_OK) {
                cells[i].status = cst[i];
                snprintf(cells[i].msg, sizeof cells[i].msg, "%.250s", cmsg[i]);
                rc = EXIT_FAIL;
            }
        }
        free(cst);
        free(cmsg);
        free(cost);
        if (!ok) {
            rc = EXIT_FAIL;
            goto out;
        }
        grid.n_cells = n;
        grid.cells = cells;
        grid.ratio = 4;
        grid.onset = 0;
        for (int l = 0; cfg && l < cfg->n_layers; l++)
            if (cfg->attn[l] == MOE_ATTN_CSA) {
                grid.ratio = cfg->ratio[l];
                grid.onset = (int64_t)cfg->index_topk * cfg->ratio[l];
                break;
            }
    }
    if (pg.on) fputs("\r\033[K", stderr);
    if (root) {
        const moe_bisect_grid *g = a.sweep_s ? &grid : NULL;
        if (text) moe_bisect_report_text(text, rep, g);
        if (a.c.json && write_report(a.c.json, 0, rep, g, text) != EXIT_OKAY) rc = EXIT_FAIL;
        if (a.c.html && write_report(a.c.html, 1, rep, g, text) != EXIT_OKAY) rc = EXIT_FAIL;
        if (text)
            fprintf(text, "bisect took %.1f s (reference %.1f s, %d runs%s)\n", now_s() - pg.t0, t_ref,
                    rep ? rep->n_runs : 0, a.sweep_s ? ", grid" : "");
        if (rc == EXIT_OKAY && rep && rep->n_runs) {
            for (int i = 0; i < rep->n_runs; i++)
                if (rep->runs[i].mask == (((uint64_t)1 << moe_patch_set_count(rep->patches)) - 1) &&
                    rep->results[i].status == MOE_OK && rep->results[i].grade == MOE_BISECT_HARMFUL)
                    rc = EXIT_FAIL;
        }
    }
out:
#ifdef MOE_HAVE_MPI
    if (mpi) {
        MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
        if (!inited) MPI_Finalize();
    }
#endif
    prompt_free(&p);
    moe_bisect_report_free(rep);
    moe_bisect_free(b);
    moe_fwd_free(f);
    free(results);
    free(cells);
    free(sts);
    free(msgs);
    return rc;
}
