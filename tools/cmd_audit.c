/* moeaudit audit: price every precision shortcut on a checkpoint or on a
 * synthetic DeepSeek-V4-Flash-shaped model. */
#include "cli.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static const char audit_help[] =
    "usage: moeaudit audit [--model DIR --layers LIST|all] [--experts N] [--tokens T] [--seed S]\n"
    "                      [--json FILE] [--html FILE] [--quiet]\n"
    "\n"
    "Run every precision path (f32 kernels and ISAs, bf16 / FP8 activations, bf16 router, FP8 /\n"
    "MXFP4 / NVFP4 experts with E2M1 rounding and scale-rule variants, each scale owner, fused\n"
    "shared experts, and the combined V3/V4 recipes) against the float64 reference on the same\n"
    "weights, and grade each PASS / MARGINAL / FAIL by output SQNR and routing flips, sorted by harm.\n"
    "Built with CUDA and with a GPU present, the GPU block (bf16 / FP8 activations, FP8 / MXFP4 /\n"
    "NVFP4 experts) is graded beside the CPU paths (group cuda).\n"
    "\n"
    "  --model DIR      a checkpoint (BF16/F16/F32 weights are quantized in memory per path);\n"
    "                   default: a synthetic DeepSeek-V4-Flash-shaped model (hidden 4096,\n"
    "                   moe_intermediate 2048, top-6, sqrtsoftplus, s 1.5, swiglu_limit 10; one hash\n"
    "                   and one top-k layer; fixed seed; realistic, non-uniform routing)\n"
    "  --layers LIST    comma-separated layer indices, or all (default: all MoE layers)\n"
    "  --experts N      routed experts of the synthetic model (default 64; 256 is full size)\n"
    "  --tokens T       tokens per layer (default 64): hidden states with unit RMS and a few\n"
    "                   outlier channels, as a normalised residual stream has\n"
    "  --seed S         seed of the synthetic model and tokens (default 20261130)\n"
    "  --json FILE      rows as JSON;  --html FILE  a self-contained page with SVG charts\n"
    "  --quiet          no table on stdout\n"
    "Progress with an ETA goes to stderr when it is a terminal.\n"
    "Under mpirun (mpirun -np N moeaudit audit --model DIR --layers all) the layers are split over\n"
    "the ranks, each maps only the shards its layers need, and rank 0 writes the one report; a\n"
    "failing rank is reported with its layers, the others' results are kept.\n"
    "Exit status: 0 when every layer was audited (whatever the grades), 1 when a layer or rank\n"
    "failed (the report keeps the rest), 2 on usage errors.\n";

typedef struct progress {
    bool on;
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
        const char *name;
        moe_act_prec act;
        moe_qfmt weights, shared;
        moe_scale_owner owner;
        bool fuse;
    } v[] = {
        {"cuda: bf16 act", MOE_ACT_BF16, MOE_Q_NONE, MOE_Q_NONE, MOE_SCALE_ROUTER, false},
        {"cuda: bf16 act, fused shared (runner)", MOE_ACT_BF16, MOE_Q_NONE, MOE_Q_NONE, MOE_SCALE_RUNNER, true},
        {"cuda: fp8 act (pow2 scale)", MOE_ACT_FP8, MOE_Q_NONE, MOE_Q_NONE, MOE_SCALE_ROUTER, false},
        {"cuda: fp8 experts + fp8 act (fp32 scale)", MOE_ACT_FP8_F32SCALE, MOE_Q_FP8, MOE_Q_FP8, MOE_SCALE_ROUTER, false},
        {"cuda: mxfp4 experts + fp8 act", MOE_ACT_FP8, MOE_Q_MXFP4, MOE_Q_FP8, MOE_SCALE_ROUTER, false},
        {"cuda: nvfp4 experts + fp8 act", MOE_ACT_FP8, MOE_Q_NVFP4, MOE_Q_FP8, MOE_SCALE_ROUTER, false},
    };
    if (moe_cuda_device_count() <= 0) return;
    for (size_t i = 0; i < sizeof v / sizeof v[0] && *np < max; i++) {
        moe_audit_path *p = &paths[*np];
        memset(p, 0, sizeof *p);
        snprintf(p->name, sizeof p->name, "%s", v[i].name);
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
    double *hidden = malloc((size_t)(cx->tokens * H) * sizeof(double));
    int64_t *ids = malloc((size_t)cx->tokens * sizeof(int64_t));
    if (!hidden || !ids) st = MOE_ERR_NOMEM;
    if (st == MOE_OK) {
        make_tokens(cx->seed + (uint64_t)layer, cx->tokens, H, L->cfg.vocab > 0 ? L->cfg.vocab : cx->vocab, hidden, ids);
        st = moe_audit_layer(L, hidden, ids, cx->tokens, cx->paths, cx->np, rows, on_progress, pg, err);
#ifdef MOE_HAVE_CUDA
        if (cx->gpu) gpu_reset(cx->gpu);
#endif
    } else if (err) {
        snprintf(err->msg, sizeof err->msg, "out of memory for %lld tokens", (long long)cx->tokens);
    }
    free(hidden);
    free(ids);
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
 * message. Returns rank 0's exit code on every rank; *root says whether
 * this rank writes the report. */
static int audit_mpi(const audit_ctx *cx, const int *want, int nw, moe_audit_row *rows, int *nrows, progress *pg,
                     bool *root) {
    int inited = 0, rank = 0, N = 1;
    MPI_Initialized(&inited);
    if (!inited) MPI_Init(NULL, NULL);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &N);
    pg->on = pg->on && rank == 0;
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
    MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (!inited) MPI_Finalize();
    *root = rank == 0;
    return rc;
}
#endif

int moe_cmd_audit(int argc, char **argv) {
    const char *model = NULL, *layers_s = "all", *json = NULL, *html = NULL;
    long experts = 64, tokens = 64, seed = 20261130;
    bool quiet = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        if (!strcmp(a, "--help") || !strcmp(a, "-h")) { fputs(audit_help, stdout); return EXIT_OKAY; }
        if (!strcmp(a, "--quiet")) { quiet = true; continue; }
        if (i + 1 >= argc) return moe_cli_usage("audit", "option %s needs a value", a);
        const char *v = argv[++i];
        if (!strcmp(a, "--model")) model = v;
        else if (!strcmp(a, "--layers")) layers_s = v;
        else if (!strcmp(a, "--json")) json = v;
        else if (!strcmp(a, "--html")) html = v;
        else if (!strcmp(a, "--experts")) {
            if (!moe_cli_parse_int(v, 6, 4096, &experts)) return moe_cli_usage("audit", "--experts %s: expected 6..4096", v);
        } else if (!strcmp(a, "--tokens")) {
            if (!moe_cli_parse_int(v, 1, 1 << 20, &tokens)) return moe_cli_usage("audit", "--tokens %s: expected a positive count", v);
        } else if (!strcmp(a, "--seed")) {
            if (!moe_cli_parse_int(v, 0, 2147483647L, &seed)) return moe_cli_usage("audit", "--seed %s: expected a number", v);
        } else return moe_cli_usage("audit", "unknown argument %s", a);
    }
    moe_error err;
    moe_model *m = NULL;
    moe_synth_opts so = moe_synth_opts_v4flash((int)experts);
    so.seed = (uint64_t)seed;
    int n_layers = so.n_layers, vocab = so.vocab;
    char desc[512];
    if (model) {
        moe_status st = moe_model_open(model, &m, &err);
        if (st != MOE_OK) return moe_cli_fail(st, &err);
        n_layers = moe_model_get_info(m)->n_layers;
        vocab = moe_model_get_info(m)->vocab;
        snprintf(desc, sizeof desc, "%s", model);
    } else {
        snprintf(desc, sizeof desc, "synthetic DeepSeek-V4-Flash-shaped model (H %d, I %d, E %d, K %d, seed %ld)",
                 so.hidden, so.inter, so.n_experts, so.top_k, seed);
    }
    int want[256], nw = parse_layers(layers_s, n_layers, want, 256);
    if (nw == -2) { moe_model_free(m); return moe_cli_usage("audit", "--layers %s: expected all or indices like 0,3", layers_s); }
    if (nw == -1) {
        nw = 0;
        for (int l = 0; l < n_layers && nw < 256; l++) {
            moe_layer_kind k = MOE_LAYER_TOPK;
            if (m && moe_model_layer_kind(m, l, &k, &err) != MOE_OK) continue;
            if (k != MOE_LAYER_DENSE) want[nw++] = l;
        }
    }
    moe_isa isa = MOE_ISA_AUTO, isa_taken = MOE_ISA_REF;
    int isa_rc = moe_cli_isa_default(&isa);
    if (isa_rc != EXIT_OKAY) { moe_model_free(m); return isa_rc; }
    moe_isa_resolve(isa, &isa_taken, NULL);
    moe_audit_path paths[64];
    int np = moe_audit_default_paths(paths, 64);
    audit_ctx cx = {.m = m, .so = &so, .tokens = tokens, .seed = (uint64_t)seed, .vocab = vocab, .paths = paths};
#ifdef MOE_HAVE_CUDA
    gpu_cache gc = {.n = 0};
    gpu_path gp[16];
    add_gpu_paths(paths, &np, 64, &gc, gp);
    cx.gpu = &gc;
#endif
    for (int i = 0; i < np; i++) /* paths that name no ISA take the CLI's default (MOE_ISA) */
        if (paths[i].isa == MOE_ISA_AUTO) paths[i].isa = isa;
    cx.np = np;
    moe_audit_row *rows = calloc((size_t)(nw * np) + 1, sizeof *rows);
    if (!rows) { moe_model_free(m); fputs("moeaudit: out of memory\n", stderr); return EXIT_FAIL; }
    progress pg = {.on = isatty(2) != 0, .t0 = now_s(), .n_layers = nw};
    int rc = EXIT_OKAY, nrows = 0;
#ifdef MOE_HAVE_MPI
    if (mpi_launched()) {
        bool root = true;
        rc = audit_mpi(&cx, want, nw, rows, &nrows, &pg, &root);
        if (!root) { free(rows); moe_model_free(m); return rc; } /* rank 0 reports */
    } else
#endif
    for (int li = 0; li < nw; li++) {
        pg.layer = li;
        moe_status st = audit_one(&cx, want[li], rows + nrows, &pg, &err);
        if (st != MOE_OK) {
            if (pg.on) fputs("\r\033[K", stderr);
            fprintf(stderr, "moeaudit: layer %d: %s: %s (the other layers go on)\n", want[li], moe_status_str(st), err.msg);
            rc = EXIT_FAIL;
        } else nrows += np;
    }
    if (pg.on) fputs("\r\033[K", stderr);
    moe_audit_meta meta = {desc, tokens, NULL, now_s() - pg.t0};
    meta.isa = moe_isa_name(isa_taken);
    if (nrows > 0) {
        if (!quiet) moe_audit_report_text(stdout, &meta, rows, nrows);
        const char *outs[2] = {json, html};
        for (int k = 0; k < 2; k++) {
            if (!outs[k]) continue;
            FILE *f = fopen(outs[k], "w");
            moe_status st = !f ? MOE_ERR_IO
                          : k == 0 ? moe_audit_report_json(f, &meta, rows, nrows)
                                   : moe_audit_report_html(f, &meta, rows, nrows);
            if (f && fclose(f) != 0) st = MOE_ERR_IO;
            if (st != MOE_OK) { fprintf(stderr, "moeaudit: %s: cannot write the report\n", outs[k]); rc = EXIT_FAIL; }
            else if (!quiet) printf("wrote %s\n", outs[k]);
        }
        if (!quiet) printf("audit took %.1f s\n", meta.seconds);
    }
    free(rows);
    moe_model_free(m);
    return rc;
}
