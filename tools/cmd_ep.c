/*
 * `moeaudit run --ep N`, `moeaudit bench --ep N` and `moeaudit forward --ep N`:
 * expert parallelism over MPI (mpirun -np N). run: rank 0 reads the input
 * and scatters token slices, every rank runs the block with its share of the
 * experts, rank 0 gathers the outputs, prints and writes the file, which is
 * byte-identical to the single-process `moeaudit run` output. forward: the
 * command's own body (handed in by cmd_forward.c) runs on every rank with the library's
 * moe_ep_forward plugged into the model's MoE call (the hooks of
 * moe_cli_fwd_par); rank 0 writes the one file, the same bytes as one
 * process, and prints what each rank mapped.
 */
#include "cli.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef MOE_HAVE_MPI

static int no_mpi(const char *cmd) {
    fprintf(stderr, "moeaudit %s: --ep needs MPI support, which this build lacks "
                    "(install libopenmpi-dev and openmpi-bin, then rebuild)\n", cmd);
    return EXIT_USAGE;
}
int moe_run_ep(const moe_cli_run_args *a) { (void)a; return no_mpi("run"); }
int moe_bench_ep(const moe_cli_bench_args *a) { (void)a; return no_mpi("bench"); }
int moe_forward_ep(const moe_cli_fwd_args *a, moe_cli_fwd_body body) {
    (void)a;
    (void)body;
    return no_mpi("forward");
}

#else

#include "moeaudit_mpi.h"

#include <limits.h>
#include <math.h>
#include <sys/stat.h>

/* ------------------------------------------------------------ helpers */

static moe_status oom(moe_error *err) {
    snprintf(err->msg, sizeof err->msg, "out of memory");
    return MOE_ERR_NOMEM;
}

/* Rows per rank of a T-token split, for Scatterv/Gatherv. */
static void split_counts(int64_t T, int N, int *counts, int *displs) {
    for (int r = 0; r < N; r++) {
        int64_t b, c;
        moe_mpi_split(T, N, r, &b, &c);
        counts[r] = (int)c;
        displs[r] = (int)b;
    }
}

/* Gather rows of `width` elements of `base` (this rank's n_local rows) into
 * dst on rank 0 (the T-token split). */
static int gather_rows(const void *src, int width, MPI_Datatype base, void *dst, const int *counts,
                       const int *displs, int rank, MPI_Comm comm) {
    MPI_Datatype row;
    MPI_Type_contiguous(width, base, &row);
    MPI_Type_commit(&row);
    int rc = MPI_Gatherv(src, counts[rank], row, dst, counts, displs, row, 0, comm);
    MPI_Type_free(&row);
    return rc;
}

/* Every rank leaves with rank 0's exit code. */
static int finish(int rc, bool inited) {
    /* rank 0's words out first: mpirun kills the other processes once one exits non-zero */
    fflush(stdout);
    fflush(stderr);
    MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
    if (inited) MPI_Finalize();
    return rc;
}

static int fail_all(moe_status st, const moe_error *err, int rank) {
    if (rank == 0) return moe_cli_fail(st, err);
    return moe_cli_exit_code(st);
}

/* Start MPI unless the caller did; check --ep against the process count. */
static int start_mpi(const char *cmd, long ep, bool *inited, int *rank, int *size) {
    int already = 0;
    MPI_Initialized(&already);
    *inited = false;
    if (!already) {
        if (MPI_Init(NULL, NULL) != MPI_SUCCESS) {
            fprintf(stderr, "moeaudit %s: MPI_Init failed\n", cmd);
            return EXIT_FAIL;
        }
        *inited = true;
    }
    MPI_Comm_rank(MPI_COMM_WORLD, rank);
    MPI_Comm_size(MPI_COMM_WORLD, size);
    if (ep != *size) {
        if (*rank == 0)
            fprintf(stderr, "moeaudit %s: --ep %ld but MPI started %d process%s: run it as "
                            "mpirun -np %ld moeaudit %s --ep %ld ...\n", cmd, ep, *size, *size == 1 ? "" : "es",
                    ep, cmd, ep);
        return EXIT_USAGE;
    }
    return EXIT_OKAY;
}

/* The placement for a layer of E experts: contiguous, or rank 0 reads the
 * file and broadcasts it. */
static moe_status get_placement(const char *path, int E, int N, int rank, moe_ep_placement *pl, moe_error *err) {
    if (!path) return moe_ep_placement_contiguous(E, N, pl, err);
    moe_status st = MOE_OK;
    if (rank == 0) st = moe_ep_placement_read(path, E, N, pl, err);
    else st = moe_ep_placement_contiguous(E, N, pl, err);
    st = moe_mpi_agree(MPI_COMM_WORLD, st, err);
    if (st != MOE_OK) { moe_ep_placement_free(pl); return st; }
    MPI_Bcast(pl->owner, E, MPI_INT32_T, 0, MPI_COMM_WORLD);
    return MOE_OK;
}

/* E of a MoE layer, from its router alone. */
static moe_status layer_experts(moe_model *m, int layer, int *E, moe_error *err) {
    moe_layer *L = NULL;
    moe_status st = moe_model_layer_experts(m, layer, 0, 0, &L, err);
    if (st == MOE_OK) *E = L->cfg.n_experts;
    moe_layer_free(L);
    return st;
}

/* ----------------------------------------------------------------- run */

/* Rank 0: one line per layer and the EP figures. */
static void print_layer(FILE *f, const moe_layer *L, const moe_block_out *o, const moe_ep_stats *mx, uint64_t bytes) {
    const moe_block_config *c = &L->cfg;
    double no = 0;
    for (int64_t i = 0; i < o->T * o->H; i++) no += o->moe_out[i] * o->moe_out[i];
    fprintf(f, "layer %d: %s routing, E=%d K=%d, s=%g; tokens %lld; moe_out RMS %.6g\n", L->index,
           c->kind == MOE_LAYER_HASH ? "hash" : "top-k", c->n_experts, c->top_k, c->scaling, (long long)o->T,
           sqrt(no / (double)(o->T * o->H)));
    fprintf(f, "  ep: route %.3f ms, dispatch %.3f ms, compute %.3f ms, combine %.3f ms (slowest rank); "
           "%.0f bytes between ranks per token\n", 1e3 * mx->route_s, 1e3 * mx->dispatch_s, 1e3 * mx->compute_s,
           1e3 * mx->combine_s, (double)bytes / (double)o->T);
}

/* Slowest rank's times and the total bytes sent. */
static void reduce_stats(const moe_ep_stats *s, moe_ep_stats *mx, uint64_t *bytes, uint64_t *disp_bytes) {
    double t[5] = {s->route_s, s->dispatch_s, s->compute_s, s->combine_s, s->total_s}, m[5];
    uint64_t b[2] = {s->bytes_sent, s->dispatch_bytes_sent}, sb[2];
    MPI_Allreduce(t, m, 5, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
    MPI_Allreduce(b, sb, 2, MPI_UINT64_T, MPI_SUM, MPI_COMM_WORLD);
    *mx = *s;
    mx->route_s = m[0];
    mx->dispatch_s = m[1];
    mx->compute_s = m[2];
    mx->combine_s = m[3];
    mx->total_s = m[4];
    *bytes = sb[0];
    if (disp_bytes) *disp_bytes = sb[1];
}

int moe_run_ep(const moe_cli_run_args *a) {
    int rc;
    FILE *text = moe_cli_text(a->c.quiet, a->c.output && !strcmp(a->c.output, "-"));
    bool inited;
    int rank, N;
    rc = start_mpi("run", a->ep, &inited, &rank, &N);
    if (rc != EXIT_OKAY) return finish(rc, inited);

    moe_error err = {""};
    moe_model *m = NULL;
    moe_status st = moe_model_open(a->model, &m, &err);
    st = moe_mpi_agree(MPI_COMM_WORLD, st, &err);
    if (st != MOE_OK) { moe_model_free(m); return finish(fail_all(st, &err, rank), inited); }
    const moe_model_info *info = moe_model_get_info(m);
    int H = info->hidden;

    /* rank 0 reads or draws the input; the others get their slices */
    int64_t T = 0;
    double *hid_all = NULL;
    int64_t *ids_all = NULL;
    if (rank == 0) {
        if (a->c.input) {
            moe_cli_input in = {0};
            int r = moe_cli_read_input(a->c.input, H, &in); /* says what is wrong on stderr */
            if (r != EXIT_OKAY) {
                st = r == EXIT_FAIL ? MOE_ERR_NOMEM : MOE_ERR_INPUT;
                snprintf(err.msg, sizeof err.msg, "%s: unusable input", a->c.input);
            }
            T = in.T;
            hid_all = in.hidden;
            ids_all = in.ids;
        } else {
            T = a->tokens;
            hid_all = malloc((size_t)(T * H) * sizeof(double) + 1);
            ids_all = malloc((size_t)T * sizeof(int64_t) + 1);
            if (!hid_all || !ids_all) st = oom(&err);
            else moe_cli_fill_input(MOE_CLI_SEED, T, H, info->vocab, hid_all, ids_all);
        }
    }
    st = moe_mpi_agree(MPI_COMM_WORLD, st, &err);
    long long hdr[2] = {(long long)T, ids_all != NULL};
    MPI_Bcast(hdr, 2, MPI_LONG_LONG, 0, MPI_COMM_WORLD);
    T = hdr[0];
    bool has_ids = hdr[1] != 0;
    int *counts = calloc((size_t)N, sizeof(int)), *displs = calloc((size_t)N, sizeof(int));
    int64_t t0 = 0, Tl = 0;
    moe_mpi_split(T, N, rank, &t0, &Tl);
    double *hid = malloc((size_t)(Tl * H) * sizeof(double) + 1);
    int64_t *ids = has_ids ? malloc((size_t)Tl * sizeof(int64_t) + 1) : NULL;
    moe_status ls = (!counts || !displs || !hid || (has_ids && !ids)) ? oom(&err) : MOE_OK;
    if (st == MOE_OK) st = moe_mpi_agree(MPI_COMM_WORLD, ls, &err);
    if (st != MOE_OK) {
        rc = fail_all(st, &err, rank);
        goto out;
    }
    if (rank == 0 && text)
        fprintf(text, "model %s (%s, %d layers), %lld tokens over %d ranks, precision %s, activations %s\n", a->model,
               info->model_type, info->n_layers, (long long)T, N,
               a->o.precision == MOE_PREC_REF ? "ref (float64)" : "f32", moe_act_prec_name(a->o.act));
    split_counts(T, N, counts, displs);
    {
        MPI_Datatype row;
        MPI_Type_contiguous(H, MPI_DOUBLE, &row);
        MPI_Type_commit(&row);
        MPI_Scatterv(hid_all, counts, displs, row, hid, (int)Tl, row, 0, MPI_COMM_WORLD);
        MPI_Type_free(&row);
        if (has_ids) MPI_Scatterv(ids_all, counts, displs, MPI_INT64_T, ids, (int)Tl, MPI_INT64_T, 0, MPI_COMM_WORLD);
    }

    int first = a->c.layer >= 0 ? (int)a->c.layer : 0, last = a->c.layer >= 0 ? (int)a->c.layer : info->n_layers - 1;
    moe_cli_writer w = {.n = 0};
    moe_block_out all[64];
    int n_all = 0;
    bool f32 = a->o.precision == MOE_PREC_F32;
    for (int li = first; li <= last && rc == EXIT_OKAY; li++) {
        moe_layer_kind kind = MOE_LAYER_DENSE;
        st = moe_model_layer_kind(m, li, &kind, &err);
        if (st != MOE_OK) { rc = fail_all(st, &err, rank); break; }
        if (kind == MOE_LAYER_DENSE) {
            if (a->c.layer >= 0) {
                snprintf(err.msg, sizeof err.msg, "layer %d is dense: it has no MoE block", li);
                rc = fail_all(MOE_ERR_ARG, &err, rank);
                break;
            }
            continue;
        }
        if (kind == MOE_LAYER_HASH && !has_ids) {
            if (rank == 0)
                fprintf(stderr, "moeaudit: %s: layer %d is hash-routed and needs tensor input_ids [T]\n",
                        a->c.input ? a->c.input : "(built-in input)", li);
            rc = EXIT_USAGE;
            break;
        }
        int E = 0;
        st = layer_experts(m, li, &E, &err);
        st = moe_mpi_agree(MPI_COMM_WORLD, st, &err);
        moe_ep_placement pl = {0, 0, NULL};
        if (st == MOE_OK) st = get_placement(a->placement, E, N, rank, &pl, &err);
        moe_ep_layer *l = NULL;
        if (st == MOE_OK) st = moe_ep_layer_open(m, li, MPI_COMM_WORLD, &pl, &l, &err);
        moe_ep_placement_free(&pl);
        if (st != MOE_OK) { rc = fail_all(st, &err, rank); break; }
        moe_block_out o, *g = &all[n_all];
        memset(g, 0, sizeof *g);
        ls = moe_block_out_init(&o, moe_ep_layer_local(l), Tl, &a->o, &err);
        if (ls == MOE_OK && rank == 0 && n_all < 64) ls = moe_block_out_init(g, moe_ep_layer_local(l), T, &a->o, &err);
        else if (ls == MOE_OK && rank == 0) ls = oom(&err);
        st = moe_mpi_agree(MPI_COMM_WORLD, ls, &err);
        moe_ep_stats stats;
        if (st == MOE_OK) st = moe_ep_block_run(l, hid, ids, Tl, &a->o, &o, &stats, &err);
        if (st != MOE_OK) {
            rc = fail_all(st, &err, rank);
            moe_block_out_free(&o);
            moe_block_out_free(g);
            moe_ep_layer_free(l);
            break;
        }
        if (rank == 0) n_all++;
        int C = o.n_cols;
        gather_rows(o.router_logits, E, MPI_DOUBLE, g->router_logits, counts, displs, rank, MPI_COMM_WORLD);
        gather_rows(o.topk_ids, C, MPI_INT32_T, g->topk_ids, counts, displs, rank, MPI_COMM_WORLD);
        gather_rows(o.topk_weights, C, MPI_DOUBLE, g->topk_weights, counts, displs, rank, MPI_COMM_WORLD);
        gather_rows(o.eff_weights, C, MPI_DOUBLE, g->eff_weights, counts, displs, rank, MPI_COMM_WORLD);
        gather_rows(o.routed_out, H, MPI_DOUBLE, g->routed_out, counts, displs, rank, MPI_COMM_WORLD);
        gather_rows(o.shared_out, H, MPI_DOUBLE, g->shared_out, counts, displs, rank, MPI_COMM_WORLD);
        gather_rows(o.moe_out, H, MPI_DOUBLE, g->moe_out, counts, displs, rank, MPI_COMM_WORLD);
        moe_ep_stats mx;
        uint64_t bytes = 0;
        reduce_stats(&stats, &mx, &bytes, NULL);
        if (rank == 0) {
            if (text) print_layer(text, moe_ep_layer_local(l), g, &mx, bytes);
            if (text && a->o.check_invariants) fprintf(text, "  contract check: ok (effective routed weights = s * w, shared weight 1)\n");
            if (a->c.output) {
                char prefix[32] = "";
                if (a->c.layer < 0) snprintf(prefix, sizeof prefix, "layer%d.", li);
                int e = moe_cli_writer_add_block(&w, prefix, g, f32);
                if (e) { fprintf(stderr, "moeaudit: out of memory\n"); rc = EXIT_FAIL; }
            }
        }
        moe_block_out_free(&o);
        moe_ep_layer_free(l);
        MPI_Bcast(&rc, 1, MPI_INT, 0, MPI_COMM_WORLD);
    }
    if (rank == 0) rc = moe_cli_writer_finish(&w, a->c.output, rc, a->c.quiet);
    else moe_cli_writer_free(&w);
    for (int i = 0; i < n_all; i++) moe_block_out_free(&all[i]);
out:
    free(hid_all);
    free(ids_all);
    free(hid);
    free(ids);
    free(counts);
    free(displs);
    moe_model_free(m);
    return finish(rc, inited);
}

/* --------------------------------------------------------------- bench */

static int dbl_cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Bytes per token the model predicts under uniform independent routing:
 * rows to the D ranks other than home that hold one of the token's experts,
 * 8 B per remote (row, expert) pair, K output rows back of which (N-1)/N
 * remote, and the count exchange (8 B per ordered rank pair per round). */
static double model_bytes(const moe_ep_placement *pl, int K, int H, size_t es, int64_t T, int rounds,
                          double *disp) {
    int N = pl->n_ranks, E = pl->n_experts;
    double sum_p = 0.0, remote = 0.0;
    for (int r = 0; r < N; r++) {
        int nr = moe_ep_placement_count(pl, r);
        double q = 1.0; /* P(none of K distinct uniform experts on r) = C(E - nr, K) / C(E, K) */
        for (int i = 0; i < K; i++) q *= (double)(E - nr - i) > 0 ? (double)(E - nr - i) / (double)(E - i) : 0.0;
        sum_p += 1.0 - q;
        remote += (1.0 - (double)nr / E) / N; /* home uniform over ranks */
    }
    double D = (double)(N - 1) / N * sum_p;
    double counts = 8.0 * N * (N - 1) * rounds / (double)T;
    double d = D * (double)H * (double)es + 8.0 * K * remote + counts;
    if (disp) *disp = d;
    return d + (double)K * remote * (double)H * (double)es;
}

int moe_bench_ep(const moe_cli_bench_args *a) {
    const char *model = a->model, *synth = a->synth, *placement = a->placement;
    long ep = a->ep, layer = a->c.layer, iters = a->iters > 0 ? a->iters : 5, synth_e = a->synth_experts,
         synth_i = a->synth_inter, round = a->round;
    moe_run_opts o = moe_run_opts_default();
    o.precision = a->precision;
    o.isa = a->isa;
    static const long default_tokens[] = {1, 16, 128, 1024};
    long toks[16];
    int n_tok = a->ntok > 0 ? a->ntok : 4;
    for (int i = 0; i < n_tok; i++) toks[i] = a->ntok > 0 ? (long)a->tok[i] : default_tokens[i];
    bool inited;
    int rank, N;
    int rc = start_mpi("bench", ep, &inited, &rank, &N);
    if (rc != EXIT_OKAY) return finish(rc, inited);
    moe_error err = {""};
    moe_status st = MOE_OK;
    if (synth) {
        model = synth;
        if (rank == 0) {
            char cfg[4096];
            snprintf(cfg, sizeof cfg, "%s/config.json", synth);
            FILE *f = fopen(cfg, "r");
            if (f) fclose(f);
            else {
                moe_synth_opts so = moe_synth_opts_default();
                so.hidden = 4096;
                so.inter = (int)synth_i;
                so.n_experts = (int)synth_e;
                so.top_k = 6;
                so.n_layers = 2;
                so.n_hash_layers = 1;
                so.vocab = 1024;
                printf("writing a V4-Flash-shaped checkpoint (H 4096, I %ld, E %ld, K 6) to %s\n", synth_i, synth_e,
                       synth);
                fflush(stdout);
                st = moe_synth_write(synth, &so, &err);
            }
        }
        st = moe_mpi_agree(MPI_COMM_WORLD, st, &err);
        if (st != MOE_OK) return finish(fail_all(st, &err, rank), inited);
    }
    moe_model *m = NULL;
    st = moe_model_open(model, &m, &err);
    st = moe_mpi_agree(MPI_COMM_WORLD, st, &err);
    if (st != MOE_OK) { moe_model_free(m); return finish(fail_all(st, &err, rank), inited); }
    const moe_model_info *info = moe_model_get_info(m);
    if (layer < 0) layer = info->n_layers - 1; /* the last layer: top-k routed on V4 */
    int E = 0;
    st = layer_experts(m, (int)layer, &E, &err);
    st = moe_mpi_agree(MPI_COMM_WORLD, st, &err);
    moe_ep_placement pl = {0, 0, NULL};
    if (st == MOE_OK) st = get_placement(placement, E, N, rank, &pl, &err);
    moe_ep_layer *l = NULL;
    if (st == MOE_OK) st = moe_ep_layer_open(m, (int)layer, MPI_COMM_WORLD, &pl, &l, &err);
    if (st != MOE_OK) {
        moe_ep_placement_free(&pl);
        moe_model_free(m);
        return finish(fail_all(st, &err, rank), inited);
    }
    const moe_layer *L = moe_ep_layer_local(l);
    int H = L->cfg.hidden, K = L->cfg.top_k;
    size_t es = o.precision == MOE_PREC_F32 ? 4 : 8;
    if (rank == 0) {
        printf("bench ep: model %s layer %d (%s routing), H %d, I %d, E %d, K %d, %d ranks (%d experts on rank 0), "
               "precision %s, %ld iterations (median; spread = min..max of total)\n",
               model, (int)layer, L->cfg.kind == MOE_LAYER_HASH ? "hash" : "top-k", H, L->cfg.inter, E, K, N,
               moe_ep_placement_count(&pl, 0), o.precision == MOE_PREC_F32 ? "f32" : "ref", iters);
        printf("%7s %6s %9s %9s %9s %9s %9s %9s %17s %8s %8s %9s %8s\n", "T", "rounds", "route_ms", "disp_ms",
               "comp_ms", "comb_ms", "wait_ms", "total_ms", "spread_ms", "B/tok", "model", "dispB/tok", "model");
    }
    for (int ti = 0; ti < n_tok && st == MOE_OK; ti++) {
        int64_t T = toks[ti], t0, Tl;
        moe_mpi_split(T, N, rank, &t0, &Tl);
        moe_ep_layer_set_round(l, round > 0 ? round : (T + N - 1) / N);
        moe_ep_layer_set_timing_barriers(l, true);
        double *hid = malloc((size_t)(Tl * H) * sizeof(double) + 1);
        int64_t *ids = malloc((size_t)Tl * sizeof(int64_t) + 1);
        double *ph[6];
        for (int k = 0; k < 6; k++) ph[k] = calloc((size_t)iters, sizeof(double));
        moe_block_out out;
        moe_status ls = moe_block_out_init(&out, L, Tl, &o, &err);
        if (ls == MOE_OK && (!hid || !ids || !ph[0] || !ph[1] || !ph[2] || !ph[3] || !ph[4] || !ph[5])) ls = oom(&err);
        st = moe_mpi_agree(MPI_COMM_WORLD, ls, &err);
        uint64_t bytes = 0, dbytes = 0;
        int rounds = 0;
        for (long it = -1; it < iters && st == MOE_OK; it++) { /* it = -1: warm-up */
            moe_cli_fill_input(0x5EEDull + (uint64_t)T * 1000003u + (uint64_t)(it + 1) * 7919u + (uint64_t)rank * 104729u, Tl, H,
                       L->cfg.vocab, hid, ids);
            moe_ep_stats s, mx;
            MPI_Barrier(MPI_COMM_WORLD);
            st = moe_ep_block_run(l, hid, ids, Tl, &o, &out, &s, &err);
            if (st != MOE_OK) break;
            uint64_t b = 0, db = 0;
            reduce_stats(&s, &mx, &b, &db);
            double wt = 0;
            MPI_Allreduce(&s.wait_s, &wt, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (it < 0) continue;
            ph[0][it] = mx.route_s;
            ph[1][it] = mx.dispatch_s;
            ph[2][it] = mx.compute_s;
            ph[3][it] = mx.combine_s;
            ph[5][it] = wt;
            ph[4][it] = mx.total_s;
            bytes += b;
            dbytes += db;
            rounds = s.rounds;
        }
        if (st == MOE_OK && rank == 0) {
            double lo = ph[4][0], hi = ph[4][0];
            for (long i = 0; i < iters; i++) { lo = fmin(lo, ph[4][i]); hi = fmax(hi, ph[4][i]); }
            for (int k = 0; k < 6; k++) qsort(ph[k], (size_t)iters, sizeof(double), dbl_cmp);
            double md = 0, mb = model_bytes(&pl, K, H, es, T, rounds, &md);
            char spread[40];
            snprintf(spread, sizeof spread, "%.3f..%.3f", 1e3 * lo, 1e3 * hi);
            printf("%7lld %6d %9.3f %9.3f %9.3f %9.3f %9.3f %9.3f %17s %8.0f %8.0f %9.0f %8.0f\n", (long long)T, rounds,
                   1e3 * ph[0][iters / 2], 1e3 * ph[1][iters / 2], 1e3 * ph[2][iters / 2], 1e3 * ph[3][iters / 2],
                   1e3 * ph[5][iters / 2], 1e3 * ph[4][iters / 2], spread, (double)bytes / (double)iters / (double)T, mb,
                   (double)dbytes / (double)iters / (double)T, md);
            fflush(stdout);
        }
        moe_block_out_free(&out);
        for (int k = 0; k < 6; k++) free(ph[k]);
        free(hid);
        free(ids);
    }
    if (st != MOE_OK) rc = fail_all(st, &err, rank);
    moe_ep_layer_free(l);
    moe_ep_placement_free(&pl);
    moe_model_free(m);
    return finish(rc, inited);
}

/* ------------------------------------------------ forward: the hooks */

typedef struct fwd_ep {
    const char *placement;   /* --placement FILE or NULL */
    moe_ep_forward *x;       /* after attach */
    int rank, size;
    int first;               /* first block opened */
} fwd_ep;

static moe_status h_agree(void *ctx, moe_status st, moe_error *err) {
    (void)ctx;
    return moe_mpi_agree(MPI_COMM_WORLD, st, err);
}

static moe_status h_bcast(void *ctx, void *buf, size_t n, moe_error *err) {
    (void)ctx;
    if (n > INT_MAX) {
        snprintf(err->msg, sizeof err->msg, "a broadcast of %zu bytes is over the MPI count limit", n);
        return MOE_ERR_UNSUPPORTED;
    }
    if (MPI_Bcast(buf, (int)n, MPI_BYTE, 0, MPI_COMM_WORLD) != MPI_SUCCESS) {
        snprintf(err->msg, sizeof err->msg, "MPI_Bcast of the input failed");
        return MOE_ERR_IO;
    }
    return MOE_OK;
}

/* E of block `layer`, from its router alone. */
static moe_status block_experts(moe_fwd *f, int layer, int *E, moe_error *err) {
    moe_layer *L = NULL;
    moe_status st = moe_model_layer_experts(moe_fwd_model(f), layer, 0, 0, &L, err);
    if (st == MOE_OK) *E = L->cfg.n_experts;
    moe_layer_free(L);
    return st;
}

static moe_status h_attach(void *ctx, moe_fwd *f, moe_fwd_opts *o, int first, moe_error *err) {
    fwd_ep *p = ctx;
    int E = 0;
    moe_status st = moe_mpi_agree(MPI_COMM_WORLD, block_experts(f, first, &E, err), err);
    moe_ep_placement pl = {0, 0, NULL};
    if (st == MOE_OK) st = moe_mpi_agree(MPI_COMM_WORLD, get_placement(p->placement, E, p->size, p->rank, &pl, err), err);
    if (st == MOE_OK) st = moe_ep_forward_open(f, first, o->last_layer, o->mtp, MPI_COMM_WORLD, &pl, &p->x, err);
    moe_ep_placement_free(&pl);
    if (st == MOE_OK) {
        moe_ep_forward_attach(p->x, o);
        p->first = first;
    }
    return st;
}

static moe_status h_settle(void *ctx, moe_status st, moe_error *err) {
    fwd_ep *p = ctx;
    return moe_ep_forward_settle(p->x, st, err);
}

static void h_release(void *ctx) {
    fwd_ep *p = ctx;
    moe_ep_forward_free(p->x);
    p->x = NULL;
}

/* ------------------------------------------------------- memory report */

/* Bytes of the checkpoint's shard files resident in this process: the Rss
 * of their mappings in /proc/self/smaps (found by inode and file name), or
 * -1 where smaps is unreadable. */
static double resident_bytes(moe_ckpt *ck) {
    FILE *fp = fopen("/proc/self/smaps", "r");
    if (!fp) return -1;
    const size_t n = moe_ckpt_n_shards(ck);
    unsigned long *ino = calloc(n ? n : 1, sizeof *ino);
    if (!ino) {
        fclose(fp);
        return -1;
    }
    for (size_t i = 0; i < n; i++) {
        char path[8192];
        struct stat sb;
        snprintf(path, sizeof path, "%s/%s", moe_ckpt_dir(ck), moe_ckpt_shard_file(ck, i));
        ino[i] = stat(path, &sb) == 0 ? (unsigned long)sb.st_ino : 0;
    }
    double sum = 0;
    bool ours = false;
    char line[8192];
    while (fgets(line, sizeof line, fp)) {
        unsigned long lo, hi, inode;
        int used = 0;
        /* a mapping: "lo-hi perms offset dev inode   path" */
        if (sscanf(line, "%lx-%lx %*s %*s %*s %lu %n", &lo, &hi, &inode, &used) == 3 && used > 0) {
            char *name = line + used;
            name[strcspn(name, "\n")] = 0;
            const char *base = strrchr(name, '/');
            base = base ? base + 1 : name;
            ours = false;
            for (size_t i = 0; i < n && !ours; i++)
                ours = ino[i] && inode == ino[i] && !strcmp(base, moe_ckpt_shard_file(ck, i));
            continue;
        }
        double kb;
        if (ours && sscanf(line, "Rss: %lf kB", &kb) == 1) sum += kb * 1024.0;
    }
    fclose(fp);
    free(ino);
    return sum;
}

/* Shards of the checkpoint this process has mapped, and their file bytes. */
static void mapped_shards(moe_ckpt *ck, double *count, double *bytes) {
    *count = 0;
    *bytes = 0;
    for (size_t i = 0; i < moe_ckpt_n_shards(ck); i++) {
        if (!moe_ckpt_shard_mapped(ck, i)) continue;
        char path[8192];
        struct stat sb;
        (*count)++;
        snprintf(path, sizeof path, "%s/%s", moe_ckpt_dir(ck), moe_ckpt_shard_file(ck, i));
        if (stat(path, &sb) == 0) *bytes += (double)sb.st_size;
    }
}

/* "0..3" or "0..1,4..5": the experts of block `layer` on `rank` (truncated). */
static void held_ranges(const moe_ep_placement *pl, int rank, char *buf, size_t cap) {
    size_t at = 0;
    buf[0] = 0;
    for (int e = 0; e < pl->n_experts && at + 1 < cap;) {
        if (pl->owner[e] != rank) { e++; continue; }
        int e1 = e;
        while (e1 + 1 < pl->n_experts && pl->owner[e1 + 1] == rank) e1++;
        int w = e1 > e ? snprintf(buf + at, cap - at, "%s%d..%d", at ? "," : "", e, e1)
                       : snprintf(buf + at, cap - at, "%s%d", at ? "," : "", e);
        if (w < 0 || (size_t)w >= cap - at) break;
        at += (size_t)w;
        e = e1 + 1;
    }
    if (!buf[0]) snprintf(buf, cap, "none");
}

enum { R_HELD, R_TOTAL, R_BYTES, R_SHARDS, R_SHARD_BYTES, R_RESIDENT, R_MOE_S, R_SENT, R_TOKENS, R_N };

static void h_report(void *ctx, moe_fwd *f, FILE *text) {
    fwd_ep *p = ctx;
    moe_ep_forward_info info;
    moe_ep_forward_get_info(p->x, &info);
    moe_ckpt *ck = moe_model_ckpt(moe_fwd_model(f));
    double mine[R_N];
    mine[R_HELD] = (double)info.experts_held;
    mine[R_TOTAL] = (double)info.experts_total;
    mine[R_BYTES] = (double)info.routed_bytes;
    mapped_shards(ck, &mine[R_SHARDS], &mine[R_SHARD_BYTES]);
    mine[R_RESIDENT] = resident_bytes(ck);
    mine[R_MOE_S] = info.sum.total_s;
    mine[R_SENT] = (double)info.sum.bytes_sent;
    mine[R_TOKENS] = (double)info.sum.tokens;
    double *all = p->rank == 0 ? calloc((size_t)p->size * R_N, sizeof *all) : NULL;
    MPI_Gather(mine, R_N, MPI_DOUBLE, all, R_N, MPI_DOUBLE, 0, MPI_COMM_WORLD);
    if (p->rank != 0 || !all || !text) {
        free(all);
        return;
    }
    const moe_ep_layer *l = moe_ep_forward_layer(p->x, p->first);
    const moe_ep_placement *pl = l ? moe_ep_layer_placement(l) : NULL;
    double sent = 0, toks = 0;
    for (int r = 0; r < p->size; r++) {
        sent += all[r * R_N + R_SENT];
        toks += all[r * R_N + R_TOKENS];
    }
    fprintf(text, "expert parallelism: %d ranks, %d MoE blocks, %s placement; %.0f bytes between ranks per token and "
           "block\n", p->size, info.n_blocks, p->placement ? p->placement : "contiguous",
           toks > 0 ? sent / toks : 0.0);
    fprintf(text, "rank  experts (block %d)  held of all   routed-expert bytes  shards mapped    shard bytes   resident "
           "from shards   MoE s\n", p->first);
    for (int r = 0; r < p->size; r++) {
        const double *v = all + r * R_N;
        char ranges[64] = "?", res[32];
        if (pl) held_ranges(pl, r, ranges, sizeof ranges);
        if (v[R_RESIDENT] < 0) snprintf(res, sizeof res, "n/a");
        else snprintf(res, sizeof res, "%.0f", v[R_RESIDENT]);
        fprintf(text, "%4d  %-18s  %5.0f / %-5.0f %19.0f  %6.0f of %-4zu %13.0f  %20s  %6.3f\n", r, ranges, v[R_HELD],
               v[R_TOTAL], v[R_BYTES], v[R_SHARDS], moe_ckpt_n_shards(ck), v[R_SHARD_BYTES], res, v[R_MOE_S]);
    }
    fflush(text);
    free(all);
}

/* ------------------------------------------------------------- forward */

int moe_forward_ep(const moe_cli_fwd_args *a, moe_cli_fwd_body body) {
    fwd_ep p = {.placement = a->placement};
    bool inited;
    int rc = start_mpi("forward", a->ep, &inited, &p.rank, &p.size);
    if (rc != EXIT_OKAY) return finish(rc, inited);
    moe_cli_fwd_par par = {.rank = p.rank, .size = p.size, .ctx = &p, .agree = h_agree, .bcast = h_bcast,
                           .attach = h_attach, .settle = h_settle, .report = h_report, .release = h_release};
    rc = body(a, &par);
    return finish(rc, inited);
}

#endif /* MOE_HAVE_MPI */
