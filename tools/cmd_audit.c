/* moeaudit audit: price every precision shortcut on a checkpoint or on a
 * synthetic DeepSeek-V4-Flash-shaped model. */
#include "cli.h"

#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* Progress on stderr: a live line with an ETA when it is a terminal (on),
 * else one line per finished layer (lines). */
typedef struct progress {
    bool on, lines;
    double t0;
    int layer, n_layers;
} progress;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (double)t.tv_sec + 1e-9 * (double)t.tv_nsec;
}

static void on_progress(void *ctx, int done, int total, const char *what) {
    progress *p = ctx;
    if (!p->on) return;
    double frac = ((double)p->layer + (double)done / total) / p->n_layers, el = now_s() - p->t0;
    double eta = frac > 0.02 ? el / frac - el : NAN;
    fprintf(stderr, "\r\033[K[%3.0f%%] layer %d/%d: %-44.44s elapsed %4.0fs, ETA %s", 100 * frac, p->layer + 1,
            p->n_layers, what, el, isnan(eta) ? "--" : "");
    if (!isnan(eta)) fprintf(stderr, "%.0fs", eta);
    fflush(stderr);
}

/* One line per finished layer (stderr not a terminal: logs, CI). */
static void layer_done(const progress *p, int layer, const moe_audit_row *rows, int n) {
    if (!p->lines) return;
    moe_audit_summary s;
    moe_audit_summarize(rows, n, &s);
    double el = now_s() - p->t0, eta = el / (p->layer + 1) * (p->n_layers - p->layer - 1);
    fprintf(stderr, "moeaudit audit: layer %d done (%d/%d): %d FAIL, %d MARGINAL, %d PASS%s; elapsed %.0f s, ETA %.0f s\n",
            layer, p->layer + 1, p->n_layers, s.n_grade[MOE_GRADE_FAIL], s.n_grade[MOE_GRADE_MARGINAL],
            s.n_grade[MOE_GRADE_PASS], s.n_not_run ? ", some not run" : "", el, eta);
    fflush(stderr);
}

/* Tokens: unit-RMS hidden states with 4 outlier channels (x8), the shape of a
 * normalised residual stream; ids uniform over the vocabulary. */
static void make_tokens(uint64_t seed, int64_t T, int H, int vocab, double *hidden, int64_t *ids) {
    uint64_t s = seed ^ 0xA5A5A5A5ull;
    for (int64_t i = 0; i < T * H; i++) {
        uint64_t z = moe_cli_mix(&s);
        double u = (double)(uint32_t)z * 0x1p-32, v = (double)(uint32_t)(z >> 32) * 0x1p-32;
        int h = (int)(i % H);
        double amp = (h == 7 || h == H / 3 || h == H / 2 + 5 || h == H - 11) ? 8.0 : 1.0;
        hidden[i] = (u + v - 1.0) * 2.449489742783178 * amp;
    }
    for (int64_t t = 0; t < T; t++) ids[t] = vocab > 0 ? (int64_t)(moe_cli_mix(&s) % (uint64_t)vocab) : 0;
}

static int parse_layers(const char *s, int n_layers, int *out, int max) {
    if (!strcmp(s, "all")) return -1;
    int n = 0;
    char buf[1024];
    snprintf(buf, sizeof buf, "%s", s);
    for (char *tok = strtok(buf, ","); tok; tok = strtok(NULL, ",")) {
        long v;
        if (!moe_cli_parse_int(tok, 0, n_layers - 1, &v) || n == max) return -2;
        out[n++] = (int)v;
    }
    return n;
}

#ifdef MOE_HAVE_CUDA
#include "moeaudit_cuda.h"

/* GPU paths of the audit (moe_audit_path.runner): each path's layer (the
 * checkpoint's, or the audit's quantized copy) is uploaded once and kept for
 * every GPU path of the same layer variant; gpu_reset frees the uploads
 * after each layer. The key is the layer's address and the path's weight
 * variant, so a copy freed and another allocated at the same address (the
 * audit trims its cache of quantized copies) is never mistaken for it. */
#define GPU_UPLOADS 8
typedef struct gpu_cache {
    const moe_layer *src[GPU_UPLOADS];
    int key[GPU_UPLOADS];
    moe_cuda_layer *g[GPU_UPLOADS];
    int n;
} gpu_cache;

typedef struct gpu_path {
    gpu_cache *c;
    int key; /* the path's weight variant */
} gpu_path;

static void gpu_reset(gpu_cache *c) {
    for (int i = 0; i < c->n; i++) moe_cuda_layer_free(c->g[i]);
    c->n = 0;
}

static moe_status gpu_run(void *ctx, const moe_layer *L, const double *hidden, const int64_t *ids, int64_t T,
                          const moe_run_opts *o, moe_block_out *out, moe_error *err) {
    gpu_path *gp = ctx;
    gpu_cache *c = gp->c;
    moe_cuda_layer *g = NULL;
    for (int i = 0; i < c->n && !g; i++)
        if (c->src[i] == L && c->key[i] == gp->key) g = c->g[i];
    if (!g) {
        if (c->n == GPU_UPLOADS) { /* drop the oldest */
            moe_cuda_layer_free(c->g[0]);
            memmove(c->src, c->src + 1, (GPU_UPLOADS - 1) * sizeof c->src[0]);
            memmove(c->key, c->key + 1, (GPU_UPLOADS - 1) * sizeof c->key[0]);
            memmove(c->g, c->g + 1, (GPU_UPLOADS - 1) * sizeof c->g[0]);
            c->n--;
        }
        moe_status st = moe_cuda_layer_upload(L, &g, err);
        if (st != MOE_OK) return st;
        c->src[c->n] = L;
        c->key[c->n] = gp->key;
        c->g[c->n++] = g;
    }
    return moe_cuda_block_run(g, hidden, ids, T, o, out, err);
}

/* Append the GPU paths (when a device is present) to paths [*np < max]. */
static void add_gpu_paths(moe_audit_path *paths, int *np, int max, gpu_cache *c, gpu_path *gp) {
    static const struct {
        const char *id, *name;
        moe_act_prec act;
        moe_qfmt weights, shared;
        moe_scale_owner owner;
        bool fuse;
    } v[] = {
        {"cuda.bf16", "cuda: bf16 act", MOE_ACT_BF16, MOE_Q_NONE, MOE_Q_NONE, MOE_SCALE_ROUTER, false},
        {"cuda.bf16-fused", "cuda: bf16 act, fused shared (runner)", MOE_ACT_BF16, MOE_Q_NONE, MOE_Q_NONE, MOE_SCALE_RUNNER, true},
        {"cuda.fp8", "cuda: fp8 act (pow2 scale)", MOE_ACT_FP8, MOE_Q_NONE, MOE_Q_NONE, MOE_SCALE_ROUTER, false},
        {"cuda.v3", "cuda: fp8 experts + fp8 act (fp32 scale)", MOE_ACT_FP8_F32SCALE, MOE_Q_FP8, MOE_Q_FP8, MOE_SCALE_ROUTER, false},
        {"cuda.v4", "cuda: mxfp4 experts + fp8 act", MOE_ACT_FP8, MOE_Q_MXFP4, MOE_Q_FP8, MOE_SCALE_ROUTER, false},
        {"cuda.nvfp4", "cuda: nvfp4 experts + fp8 act", MOE_ACT_FP8, MOE_Q_NVFP4, MOE_Q_FP8, MOE_SCALE_ROUTER, false},
    };
    if (moe_cuda_device_count() <= 0) return;
    for (size_t i = 0; i < sizeof v / sizeof v[0] && *np < max; i++) {
        moe_audit_path *p = &paths[*np];
        memset(p, 0, sizeof *p);
        snprintf(p->name, sizeof p->name, "%s", v[i].name);
        p->id = v[i].id;
        p->group = "cuda";
        p->precision = MOE_PREC_F32; /* ignored by the GPU */
        p->act = v[i].act;
        p->router = MOE_ROUTER_PATH;
        p->weights = v[i].weights;
        p->shared = v[i].shared;
        p->owner = v[i].owner;
        p->fuse_shared = v[i].fuse;
        gp[i].c = c;
        gp[i].key = (int)v[i].weights * 16 + (int)v[i].shared;
        p->runner = gpu_run;
        p->runner_ctx = &gp[i];
        (*np)++;
    }
}
#endif

/* What every layer's audit needs. */
typedef struct audit_ctx {
    moe_model *m;               /* NULL: the synthetic model */
    const moe_synth_opts *so;
    int64_t tokens;
    uint64_t seed;
    int vocab;
    const char *input;          /* --input FILE, or NULL: the built-in tokens */
    const moe_audit_path *paths;
    int np;
    void *gpu;                  /* gpu_cache * (MOE_HAVE_CUDA), freed after each layer */
} audit_ctx;

/* Audit one layer into rows [np]. */
static moe_status audit_one(const audit_ctx *cx, int layer, moe_audit_row *rows, progress *pg, moe_error *err) {
    const moe_layer *L = NULL;
    moe_layer *owned = NULL;
    moe_status st;
    on_progress(pg, 0, cx->np + 1, cx->m ? "loading" : "building the synthetic layer");
    if (cx->m) st = moe_model_layer(cx->m, layer, &L, err);
    else { st = moe_synth_layer(cx->so, layer, &owned, err); L = owned; }
    if (st != MOE_OK) return st;
    int H = L->cfg.hidden;
    moe_cli_input in = {0};
    if (cx->input) {
        if (moe_cli_read_layer_input(cx->input, layer, H, &in) != EXIT_OKAY) {
            st = MOE_ERR_INPUT;
            snprintf(err->msg, sizeof err->msg, "%s: no usable input for layer %d (the reason is above)", cx->input, layer);
        } else if (L->cfg.kind == MOE_LAYER_HASH && !in.ids) {
            st = MOE_ERR_INPUT;
            snprintf(err->msg, sizeof err->msg, "%s: layer %d is hash-routed and needs tensor input_ids [T] "
                     "(or layer%d.input_ids)", cx->input, layer, layer);
        }
    } else {
        in.T = cx->tokens;
        in.hidden = malloc((size_t)(cx->tokens * H) * sizeof(double));
        in.ids = malloc((size_t)cx->tokens * sizeof(int64_t));
        if (!in.hidden || !in.ids) {
            st = MOE_ERR_NOMEM;
            snprintf(err->msg, sizeof err->msg, "out of memory for %lld tokens", (long long)cx->tokens);
        } else {
            make_tokens(cx->seed + (uint64_t)layer, cx->tokens, H, L->cfg.vocab > 0 ? L->cfg.vocab : cx->vocab,
                        in.hidden, in.ids);
        }
    }
    if (st == MOE_OK) {
        st = moe_audit_layer(L, in.hidden, in.ids, in.T, cx->paths, cx->np, rows, on_progress, pg, err);
#ifdef MOE_HAVE_CUDA
        if (cx->gpu) gpu_reset(cx->gpu);
#endif
    }
    moe_cli_input_free(&in);
    if (owned) moe_layer_free(owned);
    return st;
}

#ifdef MOE_HAVE_MPI
#include "moeaudit_mpi.h"

/* Started by mpirun with several processes? (Open MPI and PMI launchers.) */
static bool mpi_launched(void) {
    const char *v = getenv("OMPI_COMM_WORLD_SIZE");
    if (!v) v = getenv("PMI_SIZE");
    return v && atoi(v) > 1;
}

/* Layers split over ranks; every rank audits its share (mapping only the
 * shards those layers need), rank 0 gathers the rows and reports. A rank
 * that fails keeps the others' results: its layers are listed with its
 * message. Returns the exit code so far (rank 0's is the one that counts);
 * *root says whether this rank writes the report. MPI stays up: every rank
 * ends with audit_mpi_end once rank 0 has written the report. */
static int audit_mpi(const audit_ctx *cx, const int *want, int nw, moe_audit_row *rows, int *nrows, progress *pg,
                     bool *root, bool *we_inited) {
    int inited = 0, rank = 0, N = 1;
    MPI_Initialized(&inited);
    if (!inited) MPI_Init(NULL, NULL);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &N);
    pg->on = pg->on && rank == 0;
    pg->lines = pg->lines && rank == 0;
    int64_t b, c;
    moe_mpi_split(nw, N, rank, &b, &c);
    int *layers = calloc((size_t)c + 1, sizeof *layers);
    moe_status *sts = calloc((size_t)c + 1, sizeof *sts);
    char (*msgs)[512] = calloc((size_t)c + 1, sizeof *msgs);
    const char **msgp = calloc((size_t)c + 1, sizeof *msgp);
    const void **rowp = calloc((size_t)c + 1, sizeof *rowp);
    size_t *lens = calloc((size_t)c + 1, sizeof *lens);
    moe_audit_row *mine = calloc((size_t)(c * cx->np) + 1, sizeof *mine);
    moe_status rank_st = (layers && sts && msgs && msgp && rowp && lens && mine) ? MOE_OK : MOE_ERR_NOMEM;
    pg->n_layers = (int)c;
    for (int64_t i = 0; rank_st == MOE_OK && i < c; i++) {
        moe_error err = {""};
        pg->layer = (int)i;
        layers[i] = want[b + i];
        sts[i] = audit_one(cx, layers[i], mine + i * cx->np, pg, &err);
        if (sts[i] == MOE_OK) layer_done(pg, layers[i], mine + i * cx->np, cx->np);
        snprintf(msgs[i], sizeof msgs[i], "%s", sts[i] == MOE_OK ? "" : err.msg);
        msgp[i] = msgs[i];
        rowp[i] = mine + i * cx->np;
        lens[i] = sts[i] == MOE_OK ? (size_t)cx->np * sizeof *mine : 0;
    }
    moe_lp_local loc = {rank_st, rank_st == MOE_OK ? "" : "out of memory", rank_st == MOE_OK ? (int)c : 0, layers,
                        sts, msgp, rowp, lens};
    moe_lp_report rep;
    moe_error err = {""};
    moe_status st = moe_lp_gather(MPI_COMM_WORLD, 0, &loc, &rep, &err);
    int rc = EXIT_OKAY;
    if (rank == 0) {
        if (pg->on) fputs("\r\033[K", stderr);
        if (st != MOE_OK) {
            rc = moe_cli_fail(st, &err);
        } else {
            for (int i = 0; i < rep.n_entries; i++) {
                const moe_lp_entry *e = &rep.entries[i];
                if (e->status != MOE_OK) {
                    fprintf(stderr, "moeaudit: layer %d (rank %d): %s: %s\n", e->layer, e->rank, moe_status_str(e->status),
                            e->msg);
                    rc = EXIT_FAIL;
                    continue;
                }
                /* rows travel as bytes; their path pointers are re-pointed at
                 * this rank's identical default path table */
                memcpy(rows + *nrows, e->row, e->row_len);
                for (int k = 0; k < cx->np; k++) rows[*nrows + k].path = cx->paths[k];
                *nrows += cx->np;
            }
            for (int r = 0; r < rep.n_ranks; r++)
                if (rep.ranks[r].status != MOE_OK) {
                    fprintf(stderr, "moeaudit: rank %d failed on its layers", r);
                    for (int k = 0; k < rep.ranks[r].n_layers; k++) fprintf(stderr, " %d", rep.ranks[r].layers[k]);
                    fprintf(stderr, ": %s\n", rep.ranks[r].msg);
                    rc = EXIT_FAIL;
                }
            moe_lp_report_free(&rep);
        }
    }
    free(layers); free(sts); free(msgs); free(msgp); free(rowp); free(lens); free(mine);
    *root = rank == 0;
    *we_inited = !inited;
    return rc;
}

/* Every rank leaves with rank 0's final exit code, and only after rank 0
 * wrote the report: Open MPI's mpirun kills the other processes as soon as
 * one exits non-zero, so a rank that left first with exit 1 (a failed
 * shard) used to take rank 0 down while it was still writing the JSON. */
static int audit_mpi_end(int rc, bool we_inited) {
    fflush(stdout);
    fflush(stderr);
    MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (we_inited) MPI_Finalize();
    return rc;
}
#endif

/* ------------------------------------------------------------- options */

enum { FAIL_ON_NEVER = -1 };

typedef struct audit_args {
    moe_cli_common c;
    long experts, tokens, seed;
    const char *paths;
    int fail_on; /* moe_grade, or FAIL_ON_NEVER */
} audit_args;

typedef audit_args A;

static const moe_cli_choice fail_choices[] = {{"MARGINAL", MOE_GRADE_MARGINAL}, {"FAIL", MOE_GRADE_FAIL},
                                              {"marginal", MOE_GRADE_MARGINAL}, {"fail", MOE_GRADE_FAIL},
                                              {"never", FAIL_ON_NEVER}, {NULL, 0}};

static const moe_opt audit_opts[] = {
    MOE_OPT_MODEL(A, "a checkpoint (BF16/F16/F32 weights are quantized in memory per path), or a\n"
                     "bundled checkpoint's name; default: a synthetic DeepSeek-V4-Flash-shaped model\n"
                     "(hidden 4096, moe_intermediate 2048, top-6, sqrtsoftplus, s 1.5, swiglu_limit 10;\n"
                     "one hash and one top-k layer; fixed seed; realistic, non-uniform routing)"),
    MOE_OPT_LAYERS(A, "comma-separated layer indices, or all (default: all MoE layers)"),
    {"paths", "LIST", MOE_OPT_STR, offsetof(A, paths), 0, 0, NULL, 0,
     "the rows to grade: comma list of path ids (weights.mxfp4), id prefixes (act) or\n"
     "groups (combined); default: every path. '--paths list' prints them and exits", NULL},
    MOE_OPT_INPUT(A, "real activations instead of the built-in tokens: safetensors with hidden [T, H]\n"
                     "and input_ids [T] (hash layers), or per layer layer<N>.hidden / layer<N>.input_ids"),
    {"experts", "N", MOE_OPT_INT, offsetof(A, experts), 6, 4096, NULL, 0,
     "routed experts of the synthetic model (default 32: every path graded within a\n"
     "minute on two cores; 256 is full size)", NULL},
    {"tokens", "T", MOE_OPT_INT, offsetof(A, tokens), 1, 1 << 20, NULL, 0,
     "built-in tokens per layer (default 64): hidden states with unit RMS and a few\n"
     "outlier channels, as a normalised residual stream has", NULL},
    {"seed", "S", MOE_OPT_INT, offsetof(A, seed), 0, 2147483647L, NULL, 0,
     "seed of the synthetic model and tokens (default 20261130)", NULL},
    {"fail-on", "G", MOE_OPT_CHOICE, offsetof(A, fail_on), 0, 0, fail_choices, 0,
     "exit 1 when a row grades G or worse: MARGINAL or FAIL (default never: exit 0\n"
     "whatever the grades; the summary says how many rows FAIL)", NULL},
    MOE_OPT_JSON(A, "the rows as JSON (docs/schemas/audit.schema.json; '-': stdout)"),
    MOE_OPT_HTML(A, "a self-contained page: headline, charts sorted by harm, a path x layer\n"
                    "heatmap, the tables ('-': stdout)"),
    MOE_OPT_THREADS(A),
    {"isa", "I", MOE_OPT_STR, offsetof(A, c.isa), 0, 0, NULL, 0,
     "CPU kernels of the f32 rows: ref, avx2 or avx512 (default: the best, or MOE_ISA);\n"
     "the isa.* rows use their own", NULL},
    MOE_OPT_QUIET(A, "no table on stdout (the summary line and progress still go to stderr)"),
};

static int audit_main(int argc, char **argv);

const moe_cli_cmd moe_cli_audit = {
    "audit",
    "grade every precision path against float64 (synthetic V4-Flash model by default)",
    "moeaudit audit [--model DIR] [--layers LIST|all] [--paths LIST|list] [--input FILE]\n"
    "               [--experts N] [--tokens T] [--seed S] [--fail-on MARGINAL|FAIL]\n"
    "               [--json FILE] [--html FILE] [--threads N] [--isa I] [--quiet]\n"
    "mpirun -np N moeaudit audit --model DIR [options]",
    "Run every precision path (f32 kernels and ISAs, bf16 / FP8 activations, bf16 router, FP8 /\n"
    "MXFP4 / NVFP4 experts with E2M1 rounding and scale-rule variants, each scale owner, fused\n"
    "shared experts, and the combined V3/V4 recipes) against the float64 reference on the same\n"
    "weights, and grade each PASS / MARGINAL / FAIL by output SQNR and routing flips, sorted by harm.\n"
    "Built with CUDA and with a GPU present, the GPU block (bf16 / FP8 activations, FP8 / MXFP4 /\n"
    "NVFP4 experts) is graded beside the CPU paths (group cuda).\n"
    "\n"
    "Progress goes to stderr: a line with an ETA when it is a terminal, one line per finished layer\n"
    "otherwise. Under mpirun the layers are split over the ranks, each maps only the shards its\n"
    "layers need, and rank 0 writes the one report; a failing rank is reported with its layers,\n"
    "the others' results are kept.",
    audit_opts,
    (int)(sizeof audit_opts / sizeof audit_opts[0]),
    NULL,
    "Exit status: 0 when every layer was audited (whatever the grades, unless --fail-on), 1 when a\n"
    "row grades at or above --fail-on or a layer or rank failed (the report keeps the rest), 2 on\n"
    "usage or input errors.",
    audit_main,
};

/* Does item select path p: its id, the id's prefix before the dot
 * ("weights" for weights.mxfp4), or its group ("combined")? */
static bool selects(const char *item, const moe_audit_path *p) {
    size_t n = strlen(item);
    if (p->id && (!strcmp(item, p->id) || (!strncmp(item, p->id, n) && p->id[n] == '.'))) return true;
    return p->group && !strcmp(item, p->group);
}

static void list_paths(const moe_audit_path *paths, int np) {
    printf("%-28s %-12s %s\n", "id", "group", "path");
    for (int i = 0; i < np; i++)
        printf("%-28s %-12s %s\n", paths[i].id ? paths[i].id : "", paths[i].group ? paths[i].group : "", paths[i].name);
    printf("\n--paths takes a comma list of ids, id prefixes and groups (e.g. --paths weights,act,recipe.v4).\n");
}

/* Keep the paths [*np] that LIST selects, in table order. */
static int select_paths(const char *list, moe_audit_path *paths, int *np) {
    char buf[1024];
    char *parts[64];
    snprintf(buf, sizeof buf, "%s", list);
    int n = moe_cli_split(buf, parts, 64);
    if (n < 0) return moe_cli_usage("audit", "--paths %s: expected a comma list of path ids and groups", list);
    for (int k = 0; k < n; k++) {
        bool any = false;
        for (int i = 0; i < *np && !any; i++) any = selects(parts[k], &paths[i]);
        if (!any)
            return moe_cli_usage("audit", "--paths: '%s' is neither a path id nor a group ('moeaudit audit --paths "
                                          "list' lists them)", parts[k]);
    }
    int m = 0;
    for (int i = 0; i < *np; i++) {
        bool keep = false;
        for (int k = 0; k < n && !keep; k++) keep = selects(parts[k], &paths[i]);
        if (keep) paths[m++] = paths[i];
    }
    *np = m;
    return -1;
}

static int audit_main(int argc, char **argv) {
    audit_args a;
    memset(&a, 0, sizeof a);
    a.c = moe_cli_common_default();
    a.experts = 32;
    a.tokens = 64;
    a.seed = 20261130;
    a.fail_on = FAIL_ON_NEVER;
    bool seen[MOE_CLI_MAX_OPTS];
    int rc = moe_cli_parse(&moe_cli_audit, argc, argv, &a, seen);
    if (rc >= 0) return rc;
    const char *layers_s = a.c.layers ? a.c.layers : "all", *json = a.c.json, *html = a.c.html;
    moe_audit_path paths[64];
    int np = moe_audit_default_paths(paths, 64);
    if (a.paths && !strcmp(a.paths, "list")) { list_paths(paths, np); return EXIT_OKAY; }
    if (a.c.input && seen[moe_cli_opt_index(&moe_cli_audit, "tokens")])
        return moe_cli_usage("audit", "%s", "--tokens sizes the built-in tokens; with --input the file says T");
    const char *outs[2] = {json, html}, *names[2] = {"json", "html"};
    if ((rc = moe_cli_one_stdout("audit", outs, names, 2)) >= 0) return rc;
    moe_isa isa = MOE_ISA_AUTO, isa_taken = MOE_ISA_REF;
    if ((rc = moe_cli_apply_common("audit", &a.c, &isa)) >= 0) return rc;
    moe_isa_resolve(isa, &isa_taken, NULL);
    FILE *text = moe_cli_text(a.c.quiet, moe_cli_any_stdout(outs, 2));

    moe_error err;
    moe_model *m = NULL;
    moe_synth_opts so = moe_synth_opts_v4flash((int)a.experts);
    so.seed = (uint64_t)a.seed;
    int n_layers = so.n_layers, vocab = so.vocab;
    char desc[PATH_MAX + 64], model[PATH_MAX];
    if (a.c.model) {
        if (!moe_cli_model_path(a.c.model, model, sizeof model)) return EXIT_USAGE;
        const char *ins[1] = {a.c.input};
        if ((rc = moe_cli_check_outputs("audit", outs, 2, ins, 1, model)) >= 0) return rc;
        moe_status st = moe_model_open(model, &m, &err);
        if (st != MOE_OK) return moe_cli_fail(st, &err);
        n_layers = moe_model_get_info(m)->n_layers;
        vocab = moe_model_get_info(m)->vocab;
        snprintf(desc, sizeof desc, "%s", model);
    } else {
        const char *ins[1] = {a.c.input};
        if ((rc = moe_cli_check_outputs("audit", outs, 2, ins, 1, NULL)) >= 0) return rc;
        snprintf(desc, sizeof desc, "synthetic DeepSeek-V4-Flash-shaped model (H %d, I %d, E %d, K %d, seed %ld)",
                 so.hidden, so.inter, so.n_experts, so.top_k, a.seed);
    }
    int want[256], nw = parse_layers(layers_s, n_layers, want, 256);
    if (nw == -2) {
        moe_model_free(m);
        return moe_cli_usage("audit", "--layers %s: expected all or layer indices like 0,3", layers_s);
    }
    if (nw == -1) {
        nw = 0;
        for (int l = 0; l < n_layers && nw < 256; l++) {
            moe_layer_kind k = MOE_LAYER_TOPK;
            if (m && moe_model_layer_kind(m, l, &k, &err) != MOE_OK) continue;
            if (k != MOE_LAYER_DENSE) want[nw++] = l;
        }
    }
    audit_ctx cx = {.m = m, .so = &so, .tokens = a.tokens, .seed = (uint64_t)a.seed, .vocab = vocab,
                    .input = a.c.input, .paths = paths};
#ifdef MOE_HAVE_CUDA
    gpu_cache gc = {.n = 0};
    gpu_path gp[16];
    add_gpu_paths(paths, &np, 64, &gc, gp);
    cx.gpu = &gc;
#endif
    if (a.paths && (rc = select_paths(a.paths, paths, &np)) >= 0) { moe_model_free(m); return rc; }
    for (int i = 0; i < np; i++) /* paths that name no ISA take the CLI's (--isa, else MOE_ISA) */
        if (paths[i].isa == MOE_ISA_AUTO) paths[i].isa = isa;
    cx.np = np;
    moe_audit_row *rows = calloc((size_t)(nw * np) + 1, sizeof *rows);
    if (!rows) { moe_model_free(m); fputs("moeaudit: out of memory\n", stderr); return EXIT_FAIL; }
    bool tty = isatty(2) != 0;
    progress pg = {.on = tty, .lines = !tty, .t0 = now_s(), .n_layers = nw};
    int nrows = 0;
    rc = EXIT_OKAY;
#ifdef MOE_HAVE_MPI
    bool lp = mpi_launched(), lp_inited = false;
    if (lp) {
        bool root = true;
        rc = audit_mpi(&cx, want, nw, rows, &nrows, &pg, &root, &lp_inited);
        if (!root) { free(rows); moe_model_free(m); return audit_mpi_end(rc, lp_inited); } /* rank 0 reports */
    } else
#endif
    for (int li = 0; li < nw; li++) {
        pg.layer = li;
        moe_status st = audit_one(&cx, want[li], rows + nrows, &pg, &err);
        if (st != MOE_OK) {
            if (pg.on) fputs("\r\033[K", stderr);
            fprintf(stderr, "moeaudit: layer %d: %s: %s (the other layers go on)\n", want[li], moe_status_str(st), err.msg);
            rc = EXIT_FAIL;
        } else {
            layer_done(&pg, want[li], rows + nrows, np);
            nrows += np;
        }
    }
    if (pg.on) fputs("\r\033[K", stderr);
    moe_audit_meta meta = {desc, a.c.input ? 0 : a.tokens, moe_isa_name(isa_taken), now_s() - pg.t0};
    if (a.c.input && nrows > 0) meta.tokens = rows[0].tokens;
    if (nrows > 0) {
        if (text) moe_audit_report_text(text, &meta, rows, nrows);
        for (int k = 0; k < 2; k++) {
            if (!outs[k]) continue;
            moe_out_file *h = NULL;
            FILE *f = moe_cli_open_out(outs[k], &h);
            moe_status st = !f ? MOE_ERR_IO
                          : k == 0 ? moe_audit_report_json(f, &meta, rows, nrows)
                                   : moe_audit_report_html(f, &meta, rows, nrows);
            if (f && st != MOE_OK) moe_out_abort(h);
            else if (f && !moe_cli_close_out(f, h, outs[k])) st = MOE_ERR_IO;
            if (st != MOE_OK) { fprintf(stderr, "moeaudit: %s: cannot write the report\n", outs[k]); rc = EXIT_FAIL; }
            else if (text && strcmp(outs[k], "-")) fprintf(text, "wrote %s\n", outs[k]);
        }
        moe_audit_summary sum;
        moe_audit_summarize(rows, nrows, &sum);
        int nl = nrows / (np ? np : 1);
        fprintf(text ? text : stderr, "audit: %d rows on %d layer%s in %.1f s: %d FAIL, %d MARGINAL, %d PASS, %d not run\n",
                nrows, nl, nl == 1 ? "" : "s", meta.seconds, sum.n_grade[MOE_GRADE_FAIL],
                sum.n_grade[MOE_GRADE_MARGINAL], sum.n_grade[MOE_GRADE_PASS], sum.n_not_run);
        if (a.fail_on != FAIL_ON_NEVER) {
            int bad = 0;
            for (int i = 0; i < nrows; i++) {
                bool ran;
                moe_grade g = moe_audit_row_grade(&rows[i], &ran);
                if (!ran || (int)g < a.fail_on) continue;
                if (bad++ < 8)
                    fprintf(stderr, "moeaudit audit: --fail-on %s: layer %d %s (%s): %s\n",
                            moe_grade_name((moe_grade)a.fail_on), rows[i].layer, rows[i].path.name,
                            rows[i].path.id ? rows[i].path.id : "", moe_grade_name(g));
            }
            if (bad > 8) fprintf(stderr, "moeaudit audit: ... and %d more rows\n", bad - 8);
            if (bad && rc == EXIT_OKAY) rc = EXIT_FAIL;
        }
    }
    free(rows);
    moe_model_free(m);
#ifdef MOE_HAVE_MPI
    if (lp) return audit_mpi_end(rc, lp_inited);
#endif
    return rc;
}
