/*
 * Expert parallelism under mpirun (1 to 4 ranks): every output of
 * moe_ep_block_run must equal moe_block_run's bit for bit (memcmp), on the
 * fixtures, on a V4-Flash-shaped synthetic layer, with contiguous and
 * scattered placements, with ranks that have no tokens or no experts; a
 * missing shard and bad inputs must fail on every rank without hanging; the
 * layer-parallel gather keeps the results of the ranks that did not fail.
 *
 *   test-mpi-ep --make-synth DIR    write the synthetic checkpoint (no MPI)
 *   mpirun -np N test-mpi-ep [--synth DIR]
 */
#include "harness.h"
#include "core/core.h"
#include "moeaudit_mpi.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

static int g_rank, g_size;
static const char *g_synth; /* --synth DIR, or NULL */
static int64_t g_round;     /* dispatch round size for ep_case, 0: default */

/* ------------------------------------------------------------- helpers */

/* The same full input on every rank: hidden [T, H], ids [T]. */
static void make_input(uint64_t seed, int64_t T, int H, int vocab, double **hid, int64_t **ids) {
    *hid = malloc((size_t)(T * H) * sizeof(double) + 8);
    *ids = malloc((size_t)T * sizeof(int64_t) + 8);
    for (int64_t i = 0; i < T * H; i++) (*hid)[i] = moe_splitmix64_gauss4(&seed) * 1.5;
    for (int64_t t = 0; t < T; t++) (*ids)[t] = (int64_t)(moe_splitmix64(&seed) % (uint64_t)(vocab > 0 ? vocab : 1));
}

/* Gather rows of `width` items of `size` bytes from every rank's slice to
 * rank 0 (slices in rank order, counts from Tl). */
static void gather(const void *src, int64_t Tl, size_t row_bytes, void *dst) {
    int n = (int)Tl, *counts = calloc((size_t)g_size, sizeof(int)), *displs = calloc((size_t)g_size, sizeof(int));
    MPI_Gather(&n, 1, MPI_INT, counts, 1, MPI_INT, 0, MPI_COMM_WORLD);
    for (int r = 1; r < g_size; r++) displs[r] = displs[r - 1] + counts[r - 1];
    MPI_Datatype row;
    MPI_Type_contiguous((int)row_bytes, MPI_BYTE, &row);
    MPI_Type_commit(&row);
    MPI_Gatherv(src, n, row, dst, counts, displs, row, 0, MPI_COMM_WORLD);
    MPI_Type_free(&row);
    free(counts);
    free(displs);
}

/* Compare every array of `got` (gathered on rank 0) with `want`. */
static int compare_out(const moe_block_out *want, const moe_block_out *got, const char *what) {
    int64_t T = want->T;
    size_t H = (size_t)want->H, E = (size_t)want->E, C = (size_t)want->n_cols;
    struct { const char *name; const void *a, *b; size_t n; } arr[] = {
        {"router_logits", want->router_logits, got->router_logits, E * sizeof(double)},
        {"topk_ids", want->topk_ids, got->topk_ids, C * sizeof(int32_t)},
        {"topk_weights", want->topk_weights, got->topk_weights, C * sizeof(double)},
        {"eff_weights", want->eff_weights, got->eff_weights, C * sizeof(double)},
        {"routed_out", want->routed_out, got->routed_out, H * sizeof(double)},
        {"shared_out", want->shared_out, got->shared_out, H * sizeof(double)},
        {"moe_out", want->moe_out, got->moe_out, H * sizeof(double)},
    };
    int bad = 0;
    for (size_t i = 0; i < sizeof arr / sizeof arr[0]; i++) {
        bool same = memcmp(arr[i].a, arr[i].b, arr[i].n * (size_t)T) == 0;
        CHECK(same, "%s: %s differs from moe_block_run (N = %d)", what, arr[i].name, g_size);
        bad += !same;
    }
    return bad;
}

/* Scattered placement: expert e on rank (5 e + 1) mod N. */
static void scattered(int E, moe_ep_placement *pl) {
    moe_error err;
    moe_ep_placement_contiguous(E, g_size, pl, &err);
    for (int e = 0; e < E; e++) pl->owner[e] = (5 * e + 1) % g_size;
}

typedef enum { SPLIT_EVEN, SPLIT_ALL_ON_0, SPLIT_LAST_EMPTY } split_mode;

/* Run `layer` of `dir` on T tokens with EP and compare with moe_block_run
 * (computed on rank 0). Returns the number of differing arrays. */
static int ep_case(const char *dir, int layer, int64_t T, const moe_run_opts *o, bool scatter, split_mode split,
                   uint64_t seed, const char *what) {
    moe_error err = {""};
    moe_model *m = NULL;
    moe_status st = moe_model_open(dir, &m, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return 1;
    int H = moe_model_get_info(m)->hidden;
    moe_layer *probe = NULL;
    st = moe_model_layer_experts(m, layer, 0, 0, &probe, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) { moe_model_free(m); return 1; }
    int E = probe->cfg.n_experts, vocab = probe->cfg.vocab;
    moe_layer_free(probe);
    double *hid;
    int64_t *ids;
    make_input(seed, T, H, vocab, &hid, &ids);
    int64_t t0 = 0, Tl = 0;
    if (split == SPLIT_EVEN) moe_mpi_split(T, g_size, g_rank, &t0, &Tl);
    else if (split == SPLIT_ALL_ON_0) { t0 = 0; Tl = g_rank == 0 ? T : 0; }
    else { /* the last rank gets none: the others share T */
        int parts = g_size > 1 ? g_size - 1 : 1;
        if (g_rank < parts) moe_mpi_split(T, parts, g_rank, &t0, &Tl);
        else { t0 = T; Tl = 0; }
    }
    moe_ep_placement pl;
    if (scatter) scattered(E, &pl);
    else moe_ep_placement_contiguous(E, g_size, &pl, &err);
    moe_ep_layer *l = NULL;
    st = moe_ep_layer_open(m, layer, MPI_COMM_WORLD, &pl, &l, &err);
    CHECK_OK(st, err);
    int bad = 1;
    if (st == MOE_OK) {
        if (g_round > 0) moe_ep_layer_set_round(l, g_round);
        moe_block_out out;
        st = moe_block_out_init(&out, moe_ep_layer_local(l), Tl, o, &err);
        CHECK_OK(st, err);
        moe_ep_stats stats;
        st = moe_ep_block_run(l, hid + t0 * H, ids + t0, Tl, o, &out, &stats, &err);
        CHECK_OK(st, err);
        CHECK(stats.tokens == Tl, "stats.tokens %lld", (long long)stats.tokens);
        if (g_size == 1) CHECK(stats.bytes_sent == 0 && stats.bytes_recv == 0, "one rank moved bytes");
        /* every rank's data sent is some rank's data received */
        unsigned long long sr[2] = {stats.bytes_sent, stats.bytes_recv}, tot[2];
        MPI_Allreduce(sr, tot, 2, MPI_UNSIGNED_LONG_LONG, MPI_SUM, MPI_COMM_WORLD);
        CHECK(tot[0] == tot[1], "bytes sent %llu != received %llu", tot[0], tot[1]);
        moe_block_out all, want;
        memset(&all, 0, sizeof all);
        memset(&want, 0, sizeof want);
        if (g_rank == 0) {
            const moe_layer *L = NULL;
            CHECK_OK(moe_model_layer(m, layer, &L, &err), err);
            CHECK_OK(moe_block_out_init(&want, L, T, o, &err), err);
            CHECK_OK(moe_block_out_init(&all, L, T, o, &err), err);
            CHECK_OK(moe_block_run(L, hid, ids, T, o, &want, &err), err);
        }
        size_t H8 = (size_t)H * 8, C = (size_t)out.n_cols;
        gather(out.router_logits, Tl, (size_t)E * 8, all.router_logits);
        gather(out.topk_ids, Tl, C * 4, all.topk_ids);
        gather(out.topk_weights, Tl, C * 8, all.topk_weights);
        gather(out.eff_weights, Tl, C * 8, all.eff_weights);
        gather(out.routed_out, Tl, H8, all.routed_out);
        gather(out.shared_out, Tl, H8, all.shared_out);
        gather(out.moe_out, Tl, H8, all.moe_out);
        bad = g_rank == 0 ? compare_out(&want, &all, what) : 0;
        MPI_Bcast(&bad, 1, MPI_INT, 0, MPI_COMM_WORLD);
        moe_block_out_free(&out);
        moe_block_out_free(&all);
        moe_block_out_free(&want);
    }
    moe_ep_layer_free(l);
    moe_ep_placement_free(&pl);
    free(hid);
    free(ids);
    moe_model_free(m);
    return bad;
}

/* --------------------------------------------------------------- tests */

static void test_fixtures(void) {
    char what[160];
    const char *v4 = moe_t_data("dsv4-tiny");
    char v4dir[4096];
    snprintf(v4dir, sizeof v4dir, "%s", v4);
    for (int prec = 0; prec < 2; prec++)
        for (int layer = 0; layer < 4; layer++)
            for (int scatter = 0; scatter < 2; scatter++) {
                moe_run_opts o = moe_run_opts_default();
                o.precision = prec ? MOE_PREC_F32 : MOE_PREC_REF;
                o.check_invariants = true;
                snprintf(what, sizeof what, "dsv4-tiny layer %d %s %s", layer, prec ? "f32" : "ref",
                         scatter ? "scattered" : "contiguous");
                ep_case(v4dir, layer, 37, &o, scatter, SPLIT_EVEN, 11 + (uint64_t)layer, what);
            }
    /* every contract owner, fused shared, activation rounding */
    moe_scale_owner owners[3] = {MOE_SCALE_ROUTER, MOE_SCALE_RUNNER, MOE_SCALE_OUTPUT};
    for (int oi = 0; oi < 3; oi++)
        for (int prec = 0; prec < 2; prec++) {
            moe_run_opts o = moe_run_opts_default();
            o.precision = prec ? MOE_PREC_F32 : MOE_PREC_REF;
            o.owner = owners[oi];
            o.fuse_shared = owners[oi] != MOE_SCALE_OUTPUT;
            o.act = oi == 1 ? MOE_ACT_FP8 : (oi == 2 ? MOE_ACT_BF16 : MOE_ACT_EXACT);
            snprintf(what, sizeof what, "dsv4-tiny layer 3 owner %s fused %d %s", moe_scale_owner_name(o.owner),
                     o.fuse_shared, prec ? "f32" : "ref");
            ep_case(v4dir, 3, 29, &o, true, SPLIT_EVEN, 5, what);
        }
    /* router GEMM precision toggles */
    for (int rp = 1; rp < 3; rp++) {
        moe_run_opts o = moe_run_opts_default();
        o.router = (moe_router_prec)rp;
        snprintf(what, sizeof what, "dsv4-tiny layer 3 router precision %d", rp);
        ep_case(v4dir, 3, 23, &o, false, SPLIT_EVEN, 6, what);
    }
    char v3dir[4096];
    snprintf(v3dir, sizeof v3dir, "%s", moe_t_data("dsv3-tiny"));
    for (int prec = 0; prec < 2; prec++)
        for (int scatter = 0; scatter < 2; scatter++) {
            moe_run_opts o = moe_run_opts_default();
            o.precision = prec ? MOE_PREC_F32 : MOE_PREC_REF;
            o.fuse_shared = scatter;
            o.check_invariants = true;
            snprintf(what, sizeof what, "dsv3-tiny layer 1 %s %s", prec ? "f32" : "ref", scatter ? "scattered" : "contiguous");
            ep_case(v3dir, 1, 41, &o, scatter, SPLIT_EVEN, 3, what);
        }
    /* more than one dispatch round (MOE_EP_ROUND home tokens per rank) */
    moe_run_opts o = moe_run_opts_default();
    o.precision = MOE_PREC_F32;
    ep_case(v4dir, 3, (int64_t)MOE_EP_ROUND * g_size + 77, &o, true, SPLIT_EVEN, 99, "dsv4-tiny layer 3, 2 rounds");
    ep_case(v4dir, 0, (int64_t)MOE_EP_ROUND + 5, &o, false, SPLIT_ALL_ON_0, 98, "dsv4-tiny layer 0, all tokens on rank 0");
    /* small rounds: ranks run out of tokens at different rounds */
    g_round = 3;
    o.precision = MOE_PREC_REF;
    o.fuse_shared = true;
    ep_case(v4dir, 3, 31, &o, true, SPLIT_EVEN, 97, "dsv4-tiny layer 3, rounds of 3 tokens");
    ep_case(v4dir, 1, 17, &o, false, SPLIT_LAST_EMPTY, 96, "dsv4-tiny layer 1, rounds of 3 tokens, last rank empty");
    g_round = 0;
}

static void test_empty_ranks(void) {
    moe_run_opts o = moe_run_opts_default();
    char v4dir[4096];
    snprintf(v4dir, sizeof v4dir, "%s", moe_t_data("dsv4-tiny"));
    ep_case(v4dir, 3, 13, &o, false, SPLIT_LAST_EMPTY, 7, "last rank without tokens");
    ep_case(v4dir, 1, 9, &o, true, SPLIT_ALL_ON_0, 8, "only rank 0 has tokens");
    ep_case(v4dir, 2, 0, &o, false, SPLIT_EVEN, 9, "no tokens at all");
    /* fewer tokens than ranks: the split leaves ranks empty */
    ep_case(v4dir, 3, 1, &o, false, SPLIT_EVEN, 10, "one token");
    /* a rank without experts: everything on rank 0 */
    moe_error err = {""};
    moe_model *m = NULL;
    CHECK_OK(moe_model_open(v4dir, &m, &err), err);
    moe_ep_placement pl;
    moe_ep_placement_contiguous(12, g_size, &pl, &err);
    for (int e = 0; e < 12; e++) pl.owner[e] = 0;
    double *hid;
    int64_t *ids;
    make_input(21, 10, 96, 300, &hid, &ids);
    int64_t t0, Tl;
    moe_mpi_split(10, g_size, g_rank, &t0, &Tl);
    moe_block_out out;
    moe_status st = moe_block_run_ep(m, 3, hid + t0 * 96, ids + t0, Tl, &o, &out, MPI_COMM_WORLD, &pl, NULL, &err);
    CHECK_OK(st, err);
    if (st == MOE_OK) {
        const moe_layer *L;
        moe_block_out want;
        CHECK_OK(moe_model_layer(m, 3, &L, &err), err);
        CHECK_OK(moe_block_out_init(&want, L, 10, &o, &err), err);
        CHECK_OK(moe_block_run(L, hid, ids, 10, &o, &want, &err), err);
        CHECK(memcmp(out.moe_out, want.moe_out + t0 * 96, (size_t)Tl * 96 * sizeof(double)) == 0,
              "experts all on rank 0: moe_out differs");
        moe_block_out_free(&want);
    }
    moe_block_out_free(&out);
    moe_ep_placement_free(&pl);
    free(hid);
    free(ids);
    moe_model_free(m);
}

static void test_synth(void) {
    const char *dir = g_synth;
    if (!dir) {
        if (g_rank == 0) fprintf(stderr, "  (no --synth DIR: V4-Flash-shaped layer skipped)\n");
        return;
    }
    moe_run_opts o = moe_run_opts_default();
    o.precision = MOE_PREC_F32;
    ep_case(dir, 1, 24, &o, false, SPLIT_EVEN, 1, "V4-Flash-shaped top-k layer f32");
    ep_case(dir, 0, 10, &o, true, SPLIT_EVEN, 2, "V4-Flash-shaped hash layer f32 scattered");
    o.precision = MOE_PREC_REF;
    o.fuse_shared = true;
    o.owner = MOE_SCALE_RUNNER;
    ep_case(dir, 1, 5, &o, true, SPLIT_LAST_EMPTY, 3, "V4-Flash-shaped top-k layer ref fused");
}

/* Rank 0 writes a copy of dsv4-tiny whose experts 6..11 live in a second
 * shard, then deletes that shard. */
static void make_broken_sharded(char *dir, size_t cap) {
    if (g_rank == 0) {
        moe_t_tmp_path(dir, cap, "sharded");
        char cmd[8192], path[4096];
        snprintf(cmd, sizeof cmd, "mkdir -p '%s' && cp '%s/config.json' '%s/'", dir, moe_t_data("dsv4-tiny"), dir);
        CHECK(system(cmd) == 0, "%s", cmd);
        moe_error err;
        moe_st_file *f = NULL;
        snprintf(path, sizeof path, "%s", moe_t_data("dsv4-tiny/model.safetensors"));
        CHECK_OK(moe_st_open(path, &f, &err), err);
        size_t n = moe_st_count(f), na = 0, nb = 0;
        moe_st_entry *a = calloc(n, sizeof *a), *b = calloc(n, sizeof *b);
        snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
        FILE *ix = fopen(path, "w");
        fprintf(ix, "{\"metadata\": {}, \"weight_map\": {");
        for (size_t i = 0; i < n; i++) {
            const moe_st_tensor *t = moe_st_at(f, i);
            const char *ex = strstr(t->name, ".experts.");
            bool second = ex && atoi(ex + 9) >= 6;
            moe_st_entry *en = second ? &b[nb++] : &a[na++];
            *en = moe_t_st_entry(t);
            fprintf(ix, "%s\"%s\": \"%s\"", i ? ", " : "", t->name,
                    second ? "model-00002-of-00002.safetensors" : "model-00001-of-00002.safetensors");
        }
        fprintf(ix, "}}\n");
        fclose(ix);
        snprintf(path, sizeof path, "%s/model-00001-of-00002.safetensors", dir);
        CHECK_OK(moe_st_write(path, a, na, NULL, &err), err);
        snprintf(path, sizeof path, "%s/model-00002-of-00002.safetensors", dir);
        CHECK_OK(moe_st_write(path, b, nb, NULL, &err), err);
        CHECK(nb > 0 && unlink(path) == 0, "could not remove %s", path);
        free(a);
        free(b);
        moe_st_close(f);
    }
    MPI_Bcast(dir, (int)cap, MPI_CHAR, 0, MPI_COMM_WORLD);
}

static void test_missing_shard(void) {
    char dir[1024] = "";
    make_broken_sharded(dir, sizeof dir);
    moe_error err = {""};
    moe_model *m = NULL;
    moe_status st = moe_model_open(dir, &m, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    moe_ep_placement pl;
    moe_ep_placement_contiguous(12, g_size, &pl, &err);
    moe_ep_layer *l = NULL;
    st = moe_ep_layer_open(m, 3, MPI_COMM_WORLD, &pl, &l, &err);
    CHECK(st != MOE_OK && l == NULL, "a missing shard must fail on every rank (rank %d got %s)", g_rank,
          moe_status_str(st));
    CHECK(strstr(err.msg, "model-00002-of-00002.safetensors") != NULL, "message names the shard: %s", err.msg);
    CHECK(strncmp(err.msg, "rank ", 5) == 0, "message names the rank: %s", err.msg);
    /* the lowest rank that holds an expert of the missing shard (experts 6..11) */
    int want_rank = g_size;
    for (int e = 6; e < 12; e++) want_rank = pl.owner[e] < want_rank ? pl.owner[e] : want_rank;
    char prefix[32];
    snprintf(prefix, sizeof prefix, "rank %d: ", want_rank);
    CHECK(strncmp(err.msg, prefix, strlen(prefix)) == 0, "expected \"%s...\", got %s", prefix, err.msg);
    if (g_rank == 0) fprintf(stderr, "  missing shard reported as: %s\n", err.msg);
    /* the one-shot form, and ranks that would not need the shard still fail */
    double hid[96 * 4] = {0};
    int64_t ids[4] = {1, 2, 3, 4};
    moe_block_out out;
    moe_run_opts o = moe_run_opts_default();
    st = moe_block_run_ep(m, 3, hid, ids, 4, &o, &out, MPI_COMM_WORLD, NULL, NULL, &err);
    CHECK(st != MOE_OK && out.moe_out == NULL, "one-shot form must fail and leave out zeroed");
    /* a placement that keeps the missing experts off every rank is not
     * possible; but a layer whose experts all sit in the first shard works:
     * layer 3 with ranks holding only experts 0..5 is not expressible either,
     * so check that the model still serves the router of layer 3 */
    moe_layer *part = NULL;
    CHECK_OK(moe_model_layer_experts(m, 3, 0, 6, &part, &err), err);
    moe_layer_free(part);
    moe_ep_placement_free(&pl);
    moe_model_free(m);
}

static void test_bad_inputs(void) {
    char v4dir[4096];
    snprintf(v4dir, sizeof v4dir, "%s", moe_t_data("dsv4-tiny"));
    moe_error err = {""};
    moe_model *m = NULL;
    CHECK_OK(moe_model_open(v4dir, &m, &err), err);
    moe_ep_placement pl;
    moe_ep_placement_contiguous(12, g_size, &pl, &err);
    moe_ep_layer *l = NULL;
    CHECK_OK(moe_ep_layer_open(m, 0, MPI_COMM_WORLD, &pl, &l, &err), err);
    moe_run_opts o = moe_run_opts_default();
    double *hid;
    int64_t *ids;
    make_input(4, 20, 96, 300, &hid, &ids);
    int64_t t0, Tl;
    moe_mpi_split(20, g_size, g_rank, &t0, &Tl);
    if (g_rank == g_size - 1) ids[19] = 300; /* the last token's id is outside the vocabulary */
    moe_block_out out;
    CHECK_OK(moe_block_out_init(&out, moe_ep_layer_local(l), Tl, &o, &err), err);
    moe_status st = moe_ep_block_run(l, hid + t0 * 96, ids + t0, Tl, &o, &out, NULL, &err);
    CHECK(st == MOE_ERR_INPUT, "bad token id: got %s on rank %d", moe_status_str(st), g_rank);
    CHECK(strstr(err.msg, "input_ids[19] = 300") != NULL, "message names the global token: %s", err.msg);
    ids[19] = 5;
    /* options that differ between ranks */
    if (g_size > 1) {
        moe_run_opts o2 = o;
        if (g_rank == 1) o2.act = MOE_ACT_BF16;
        st = moe_ep_block_run(l, hid + t0 * 96, ids + t0, Tl, &o2, &out, NULL, &err);
        CHECK(st == MOE_ERR_ARG && strstr(err.msg, "different run options"), "options mismatch: %s: %s",
              moe_status_str(st), err.msg);
    }
    /* and the layer still works afterwards */
    st = moe_ep_block_run(l, hid + t0 * 96, ids + t0, Tl, &o, &out, NULL, &err);
    CHECK_OK(st, err);
    moe_block_out_free(&out);
    moe_ep_layer_free(l);
    /* a placement for another rank count */
    moe_ep_placement wrong;
    moe_ep_placement_contiguous(12, g_size + 1, &wrong, &err);
    st = moe_ep_layer_open(m, 0, MPI_COMM_WORLD, &wrong, &l, &err);
    CHECK(st == MOE_ERR_ARG && strstr(err.msg, "communicator has"), "wrong placement size: %s", err.msg);
    moe_ep_placement_free(&wrong);
    /* a placement for another expert count */
    moe_ep_placement_contiguous(13, g_size, &wrong, &err);
    st = moe_ep_layer_open(m, 0, MPI_COMM_WORLD, &wrong, &l, &err);
    CHECK(st == MOE_ERR_ARG && strstr(err.msg, "has 12"), "wrong expert count: %s", err.msg);
    moe_ep_placement_free(&wrong);
    moe_ep_placement_free(&pl);
    free(hid);
    free(ids);
    moe_model_free(m);
}

static void test_placement_files(void) {
    if (g_rank != 0) return; /* local parsing: one rank is enough */
    char path[1024];
    moe_error err;
    moe_ep_placement pl;
    moe_t_tmp_path(path, sizeof path, "pl.txt");
    FILE *f = fopen(path, "w");
    fprintf(f, "# expert rank\n0 1\n1 0\n  2 1  # comment\n\n3 0\n");
    fclose(f);
    CHECK_OK(moe_ep_placement_read(path, 4, 2, &pl, &err), err);
    CHECK(pl.owner[0] == 1 && pl.owner[1] == 0 && pl.owner[2] == 1 && pl.owner[3] == 0, "text placement");
    CHECK(moe_ep_placement_count(&pl, 1) == 2, "count");
    moe_ep_placement_free(&pl);
    CHECK(moe_ep_placement_read(path, 5, 2, &pl, &err) == MOE_ERR_FORMAT && strstr(err.msg, "expert 4 has no rank"),
          "missing expert: %s", err.msg);
    CHECK(moe_ep_placement_read(path, 4, 1, &pl, &err) == MOE_ERR_FORMAT && strstr(err.msg, "line 2"),
          "rank out of range: %s", err.msg);
    f = fopen(path, "w");
    fprintf(f, "0 0\n0 1\n");
    fclose(f);
    CHECK(moe_ep_placement_read(path, 2, 2, &pl, &err) == MOE_ERR_FORMAT && strstr(err.msg, "placed twice"),
          "duplicate: %s", err.msg);
    moe_t_tmp_path(path, sizeof path, "pl.json");
    f = fopen(path, "w");
    fprintf(f, "{\"expert_to_rank\": [2, 1, 0, 2]}\n");
    fclose(f);
    CHECK_OK(moe_ep_placement_read(path, 4, 3, &pl, &err), err);
    CHECK(pl.owner[0] == 2 && pl.owner[3] == 2 && pl.owner[2] == 0, "json placement");
    moe_ep_placement_free(&pl);
    f = fopen(path, "w");
    fprintf(f, "[0, 1, 1.5]\n");
    fclose(f);
    CHECK(moe_ep_placement_read(path, 3, 2, &pl, &err) == MOE_ERR_FORMAT && strstr(err.msg, "entry 2"),
          "json non-integer: %s", err.msg);
    CHECK(moe_ep_placement_read("/nonexistent/pl", 3, 2, &pl, &err) == MOE_ERR_IO, "missing file");
    /* #11: ranks outside long's range (the old check cast the double first:
     * undefined behaviour, a crash under UBSan) */
    static const char *const huge[] = {"[0, 1e300]", "[0, -1e19]", "[0, 9.3e18]", "[0, 2147483648]"};
    for (size_t i = 0; i < sizeof huge / sizeof huge[0]; i++) {
        CHECK(moe_ep_placement_parse(huge[i], strlen(huge[i]), "huge", 2, 2, &pl, &err) == MOE_ERR_FORMAT &&
                  strstr(err.msg, "entry 1") && strstr(err.msg, "not an integer rank"),
              "%s: %s", huge[i], err.msg);
    }
    CHECK(moe_ep_placement_parse("0 0\n1 0\0junk", 13, "nul", 2, 1, &pl, &err) == MOE_ERR_FORMAT &&
              strstr(err.msg, "NUL byte at offset 7"), "nul: %s", err.msg);
    CHECK(moe_ep_placement_parse("0 99999999999999999999\n", 24, "erange", 1, 1, &pl, &err) == MOE_ERR_FORMAT,
          "erange: %s", err.msg);
    /* #4: a FIFO as the placement file is refused, not waited on */
    moe_t_tmp_path(path, sizeof path, "pl.fifo");
    CHECK(mkfifo(path, 0644) == 0, "mkfifo");
    CHECK(moe_ep_placement_read(path, 3, 2, &pl, &err) == MOE_ERR_IO && strstr(err.msg, "named pipe"), "fifo: %s",
          err.msg);
    /* contiguous: remainder spread over the first ranks; more ranks than experts */
    CHECK_OK(moe_ep_placement_contiguous(10, 4, &pl, &err), err);
    CHECK(moe_ep_placement_count(&pl, 0) == 3 && moe_ep_placement_count(&pl, 1) == 3 &&
          moe_ep_placement_count(&pl, 2) == 2 && moe_ep_placement_count(&pl, 3) == 2 && pl.owner[3] == 1,
          "10 experts over 4 ranks");
    moe_ep_placement_free(&pl);
    CHECK_OK(moe_ep_placement_contiguous(2, 3, &pl, &err), err);
    CHECK(moe_ep_placement_count(&pl, 2) == 0, "3 ranks, 2 experts");
    moe_ep_placement_free(&pl);
}

/* Layer-parallel gather: 10 layers split over the ranks; the last rank
 * (when N > 1) fails as a whole, rank 0 fails one layer. */
static void test_lp_gather(void) {
    int64_t b, c;
    moe_mpi_split(10, g_size, g_rank, &b, &c);
    int layers[10];
    moe_status sts[10];
    const char *msgs[10];
    const void *rows[10];
    size_t lens[10];
    char text[10][64];
    bool whole_fail = g_size > 1 && g_rank == g_size - 1;
    for (int i = 0; i < (int)c; i++) {
        layers[i] = (int)b + i;
        snprintf(text[i], sizeof text[i], "row of layer %d from rank %d", layers[i], g_rank);
        rows[i] = text[i];
        lens[i] = strlen(text[i]) + 1;
        sts[i] = MOE_OK;
        msgs[i] = NULL;
        if (g_rank == 0 && i == 0) { sts[i] = MOE_ERR_FORMAT; msgs[i] = "shard x.safetensors: bad header"; }
        if (whole_fail) sts[i] = MOE_ERR_NOMEM;
    }
    moe_lp_local mine = {whole_fail ? MOE_ERR_NOMEM : MOE_OK, whole_fail ? "out of memory mapping layers" : NULL,
                         (int)c, layers, sts, msgs, rows, lens};
    moe_lp_report rep;
    moe_error err = {""};
    moe_status st = moe_lp_gather(MPI_COMM_WORLD, 0, &mine, &rep, &err);
    CHECK_OK(st, err);
    if (g_rank == 0 && st == MOE_OK) {
        CHECK(rep.n_entries == 10 && rep.n_ranks == g_size, "%d entries, %d ranks", rep.n_entries, rep.n_ranks);
        int64_t lb, lc;
        moe_mpi_split(10, g_size, g_size - 1, &lb, &lc);
        int want_failed = 1 + (g_size > 1 ? (int)lc : 0);
        CHECK(rep.n_failed_layers == want_failed, "failed layers %d, want %d", rep.n_failed_layers, want_failed);
        CHECK(rep.n_failed_ranks == (g_size > 1 ? 2 : 1), "failed ranks %d", rep.n_failed_ranks);
        for (int i = 0; i < rep.n_entries; i++) {
            const moe_lp_entry *e = &rep.entries[i];
            CHECK(e->layer == i, "entries sorted by layer (%d at %d)", e->layer, i);
            int64_t rb, rc2;
            moe_mpi_split(10, g_size, e->rank, &rb, &rc2);
            CHECK(e->layer >= rb && e->layer < rb + rc2, "layer %d from rank %d", e->layer, e->rank);
            if (e->status == MOE_OK) {
                char want[64];
                snprintf(want, sizeof want, "row of layer %d from rank %d", e->layer, e->rank);
                CHECK(e->row_len == strlen(want) + 1 && !strcmp(e->row, want), "row kept: %s", (char *)e->row);
            } else if (e->rank == 0) {
                CHECK(e->status == MOE_ERR_FORMAT && strstr(e->msg, "bad header"), "layer failure: %s", e->msg);
            } else {
                CHECK(e->status == MOE_ERR_NOMEM && strstr(e->msg, "mapping layers"), "rank failure: %s", e->msg);
            }
        }
        CHECK(rep.ranks[0].status == MOE_ERR_FORMAT && strstr(rep.ranks[0].msg, "layer 0:"), "rank 0: %s",
              rep.ranks[0].msg);
        if (g_size > 1) {
            const moe_lp_rank *rk = &rep.ranks[g_size - 1];
            CHECK(rk->status == MOE_ERR_NOMEM && rk->n_layers == (int)lc && (lc == 0 || rk->layers[0] == lb),
                  "failed rank reported with its layers: %s", rk->msg);
        }
        moe_lp_report_free(&rep);
    } else {
        CHECK(rep.n_entries == 0 && rep.entries == NULL, "non-root report is empty");
    }
}

int main(int argc, char **argv) {
    if (argc == 3 && !strcmp(argv[1], "--make-synth")) {
        moe_synth_opts so = moe_synth_opts_v4flash(16); /* two layers: one hash, one top-k */
        so.vocab = 512;
        so.seed = 7;
        moe_error err;
        moe_status st = moe_synth_write(argv[2], &so, &err);
        if (st != MOE_OK) { fprintf(stderr, "%s\n", err.msg); return 1; }
        printf("wrote %s\n", argv[2]);
        return 0;
    }
    if (argc == 3 && !strcmp(argv[1], "--synth")) g_synth = argv[2];
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    RUN(test_placement_files);
    RUN(test_fixtures);
    RUN(test_empty_ranks);
    RUN(test_bad_inputs);
    RUN(test_missing_shard);
    RUN(test_lp_gather);
    RUN(test_synth);
    int counts[2] = {moe_t_pass, moe_t_fail}, tot[2];
    MPI_Reduce(counts, tot, 2, MPI_INT, MPI_SUM, 0, MPI_COMM_WORLD);
    int rc = moe_t_finish();
    if (g_rank == 0) printf("all %d ranks: %d passed, %d failed\n", g_size, tot[0], tot[1]);
    int any = tot[1];
    MPI_Bcast(&any, 1, MPI_INT, 0, MPI_COMM_WORLD);
    MPI_Finalize();
    return rc || any ? 1 : 0;
}
