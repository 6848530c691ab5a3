/*
 * The whole-model forward under expert parallelism (moe_ep_forward and
 * `moeaudit forward --ep N`), against the single-process forward.
 *
 *   test-forward-ep --make-sharded SRC DIR
 *       write DIR: checkpoint SRC re-sharded so that every routed expert of
 *       every block (layers and MTP) has a shard of its own,
 *       experts-<block>-<e>.safetensors, the rest in dense.safetensors, with
 *       model.safetensors.index.json (no MPI)
 *   mpirun -np N test-forward-ep --sharded DIR
 *       the library: every tensor of the forward equal, byte for byte, to
 *       the single process's (both fixtures, chunks, f32, MTP, two
 *       placements); each rank maps exactly the shards of its own experts;
 *       a rank missing its shard fails every rank naming rank, layer and
 *       experts; failures outside the MoE blocks and replicated layers that
 *       diverged are agreed without a hang
 *   test-forward-ep --cli MOEAUDIT MPIRUN NP DIR
 *       the command: `mpirun -np NP moeaudit forward --ep NP` writes the same
 *       bytes as `moeaudit forward` (cmp) on tests/data/dsv4-attn and
 *       dsv4-flash-layout, one shot and in chunks; the failing-rank case
 *       leaves no output file (no MPI in this process)
 */
#include "harness.h"
#include "moeaudit_model.h"
#include "moeaudit_mpi.h"

#include <stdbool.h>
#include <sys/stat.h>
#include <unistd.h>

static int g_rank, g_size;

/* ---------------------------------------------------- the sharded copy */

/* "layers.3" or "mtp.0" and the expert of a routed-expert tensor name;
 * false for any other tensor. */
static bool expert_of(const char *name, char *block, size_t cap, int *e) {
    const char *p = strstr(name, ".ffn.experts.");
    if (!p) return false;
    const char *b = name;
    if (!strncmp(b, "model.", 6)) b += 6;
    size_t n = (size_t)(p - b);
    if (n + 1 > cap) return false;
    memcpy(block, b, n);
    block[n] = 0;
    *e = atoi(p + strlen(".ffn.experts."));
    return true;
}

static int make_sharded(const char *src, const char *dir) {
    moe_error err;
    moe_ckpt *ck = NULL;
    if (moe_ckpt_open(src, &ck, &err) != MOE_OK) { fprintf(stderr, "%s\n", err.msg); return 1; }
    mkdir(dir, 0755);
    enum { MAXS = 256 };
    char names[MAXS][128];
    moe_st_entry *ent[MAXS];
    size_t cnt[MAXS], cap[MAXS];
    int n_sh = 1;
    snprintf(names[0], sizeof names[0], "dense.safetensors");
    ent[0] = NULL;
    cnt[0] = cap[0] = 0;
    char path[1024];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    FILE *idx = fopen(path, "w");
    if (!idx) { moe_ckpt_free(ck); return 1; }
    fputs("{\"metadata\": {}, \"weight_map\": {", idx);
    int first = 1;
    for (size_t s = 0; s < moe_ckpt_n_shards(ck); s++) {
        moe_st_file *f = NULL;
        if (moe_ckpt_shard(ck, s, &f, &err) != MOE_OK) { fprintf(stderr, "%s\n", err.msg); return 1; }
        for (size_t i = 0; i < moe_st_count(f); i++) {
            const moe_st_tensor *t = moe_st_at(f, i);
            char block[64], want[128];
            int e = 0, k = 0;
            if (expert_of(t->name, block, sizeof block, &e)) {
                snprintf(want, sizeof want, "experts-%s-%d.safetensors", block, e);
                for (k = 1; k < n_sh && strcmp(names[k], want); k++) {}
                if (k == n_sh) {
                    if (n_sh == MAXS) return 1;
                    snprintf(names[k], sizeof names[k], "%s", want);
                    ent[k] = NULL;
                    cnt[k] = cap[k] = 0;
                    n_sh++;
                }
            }
            if (cnt[k] == cap[k]) {
                cap[k] = cap[k] ? 2 * cap[k] : 16;
                ent[k] = realloc(ent[k], cap[k] * sizeof *ent[k]);
            }
            ent[k][cnt[k]++] = moe_t_st_entry(t);
            fprintf(idx, "%s\"%s\": \"%s\"", first ? "" : ", ", t->name, names[k]);
            first = 0;
        }
    }
    fputs("}}\n", idx);
    fclose(idx);
    int rc = 0;
    for (int k = 0; k < n_sh; k++) {
        snprintf(path, sizeof path, "%s/%s", dir, names[k]);
        if (moe_st_write(path, ent[k], cnt[k], NULL, &err) != MOE_OK) { fprintf(stderr, "%s\n", err.msg); rc = 1; }
        free(ent[k]);
    }
    char cmd[3000];
    snprintf(cmd, sizeof cmd, "cp '%s/config.json' '%s/config.json'", src, dir);
    if (system(cmd) != 0) rc = 1;
    moe_ckpt_free(ck);
    printf("wrote %d shards to %s\n", n_sh, dir);
    return rc;
}

/* ------------------------------------------------ collected forward runs */

#define N_WHAT 8

typedef struct tens {
    int layer;
    moe_fwd_what what;
    int64_t rows, row_elems;
    size_t esz;
    char *bytes;
} tens;

typedef struct collect {
    tens t[128];
    int n;
    bool bad;                 /* rows arrived out of order */
    /* an injected failure: this rank, this tensor */
    int fail_rank, fail_layer;
    moe_fwd_what fail_what;
} collect;

static moe_status sink(void *ctx, const moe_fwd_tensor *x, moe_error *err) {
    collect *c = ctx;
    if (c->fail_rank == g_rank && x->layer == c->fail_layer && x->what == c->fail_what) {
        snprintf(err->msg, sizeof err->msg, "injected sink failure at layer %d %s", x->layer,
                 moe_fwd_what_name(x->what));
        return MOE_ERR_IO;
    }
    tens *t = NULL;
    for (int i = 0; i < c->n && !t; i++)
        if (c->t[i].layer == x->layer && c->t[i].what == x->what) t = &c->t[i];
    if (!t) {
        if (c->n == 128) return MOE_ERR_NOMEM;
        t = &c->t[c->n++];
        memset(t, 0, sizeof *t);
        t->layer = x->layer;
        t->what = x->what;
        t->row_elems = x->row_elems;
        t->esz = x->idata ? 4 : 8;
    }
    if (x->row0 != t->rows || x->row_elems != t->row_elems) c->bad = true;
    size_t nb = (size_t)(x->rows * x->row_elems) * t->esz, at = (size_t)(t->rows * t->row_elems) * t->esz;
    t->bytes = realloc(t->bytes, at + nb + 1);
    memcpy(t->bytes + at, x->idata ? (const void *)x->idata : (const void *)x->data, nb);
    t->rows += x->rows;
    return MOE_OK;
}

static void collect_init(collect *c) {
    memset(c, 0, sizeof *c);
    c->fail_rank = -1;
}

static void collect_free(collect *c) {
    for (int i = 0; i < c->n; i++) free(c->t[i].bytes);
    collect_init(c);
}

typedef struct run_cfg {
    moe_precision prec;
    bool mtp;
    int64_t chunks[4];      /* 0-terminated; the last repeats; {0}: one shot */
    int placement;          /* 0 contiguous, 1 scattered */
    int (*index)(int layer); /* non-NULL: rank 1 replaces that layer's picks by -1 (divergence) */
} run_cfg;

static int64_t *read_ids(const char *model, int64_t *T) {
    char p[1024];
    snprintf(p, sizeof p, "%s/oracle.safetensors", model);
    moe_st_file *f = NULL;
    moe_error err;
    if (moe_st_open(p, &f, &err) != MOE_OK) {
        /* the sharded copy has none: its source's */
        snprintf(p, sizeof p, "%s", moe_t_data("dsv4-flash-layout/oracle.safetensors"));
        if (moe_st_open(p, &f, &err) != MOE_OK) return NULL;
    }
    const moe_st_tensor *t = moe_st_find(f, "input_ids");
    int64_t *ids = t ? moe_t_tensor_i64(t) : NULL;
    *T = t ? t->shape[0] : 0;
    moe_st_close(f);
    return ids;
}

static moe_status drop_picks(void *ctx, int layer, int64_t row0, int64_t rows, int topk, int32_t *sel,
                             moe_error *err) {
    (void)ctx;
    (void)row0;
    (void)err;
    if (g_rank == 1 && layer == 1)
        for (int64_t i = 0; i < rows * topk; i++) sel[i] = -1;
    return MOE_OK;
}

/* Placement `kind` of E experts over the ranks: contiguous, or expert e on
 * rank (5e + 1) mod N (every rank's experts scattered). */
static void placement(int kind, int E, moe_ep_placement *pl) {
    moe_error err;
    moe_ep_placement_contiguous(E, g_size, pl, &err);
    if (kind == 1)
        for (int e = 0; e < E; e++) pl->owner[e] = (5 * e + 1) % g_size;
}

/* One forward of model over its oracle's input_ids: single process
 * (x == NULL) or through the EP share x (opened here when *x is NULL and ep). */
static moe_status run(moe_fwd *f, const run_cfg *rc, bool ep, collect *c, moe_ep_forward **xo, moe_error *err) {
    int64_t T = 0;
    int64_t *ids = NULL;
    moe_status st = MOE_OK;
    moe_fwd_opts o = moe_fwd_opts_default(f);
    o.precision = rc->prec;
    if (rc->mtp) {
        o.mtp = true;
        o.logits = false;
    }
    o.sink = sink;
    o.sink_ctx = c;
    if (rc->index) {
        o.index = drop_picks;
    }
    const moe_fwd_config *cf = moe_fwd_get_config(f);
    moe_ep_forward *x = NULL;
    if (ep) {
        moe_layer *L0 = NULL; /* E from layer 0's router */
        st = moe_model_layer_experts(moe_fwd_model(f), 0, 0, 0, &L0, err);
        int E = st == MOE_OK ? L0->cfg.n_experts : 0;
        moe_layer_free(L0);
        if (st != MOE_OK) return st;
        moe_ep_placement pl;
        placement(rc->placement, E, &pl);
        st = moe_ep_forward_open(f, 0, cf->n_layers - 1, rc->mtp, MPI_COMM_WORLD, &pl, &x, err);
        moe_ep_placement_free(&pl);
        if (st != MOE_OK) return st;
        moe_ep_forward_attach(x, &o);
    }
    moe_fwd_state *s = NULL;
    ids = read_ids(moe_ckpt_dir(moe_model_ckpt(moe_fwd_model(f))), &T);
    if (!ids) st = moe_errf(err, MOE_ERR_IO, "no input_ids");
    if (st == MOE_OK) st = moe_fwd_state_init(f, &o, &s, err);
    int nc = 0;
    while (nc < 4 && rc->chunks[nc]) nc++;
    for (int64_t at = 0, k = 0; st == MOE_OK && at < T; k++) {
        int64_t n = nc ? rc->chunks[k < nc ? k : nc - 1] : T; /* the last size repeats */
        if (n > T - at) n = T - at;
        st = moe_fwd_run(f, s, ids + at, n, NULL, err);
        if (x) st = moe_ep_forward_settle(x, st, err);
        at += n;
    }
    moe_fwd_state_free(s);
    free(ids);
    if (xo) *xo = x;
    else moe_ep_forward_free(x);
    return st;
}

/* Every tensor of b equals a's, byte for byte. */
static void same(const collect *a, const collect *b, const char *what) {
    CHECK(!a->bad && !b->bad, "%s: rows in order", what);
    CHECK(a->n == b->n && a->n > 0, "%s: %d tensors vs %d", what, a->n, b->n);
    int diff = 0;
    for (int i = 0; i < a->n && i < b->n; i++) {
        const tens *x = &a->t[i], *y = &b->t[i];
        bool eq = x->layer == y->layer && x->what == y->what && x->rows == y->rows && x->row_elems == y->row_elems &&
                  !memcmp(x->bytes, y->bytes, (size_t)(x->rows * x->row_elems) * x->esz);
        if (!eq && diff++ < 3)
            fprintf(stderr, "rank %d: %s: layer %d %s differs\n", g_rank, what, x->layer, moe_fwd_what_name(x->what));
    }
    CHECK(diff == 0, "%s: %d tensors differ from the single process's", what, diff);
}

static void one(const char *model, const run_cfg *rc, const char *what) {
    moe_error err = {""};
    moe_fwd *f1 = NULL, *f2 = NULL;
    collect a, b;
    collect_init(&a);
    collect_init(&b);
    CHECK_OK(moe_fwd_open(model, &f1, &err), err);
    CHECK_OK(moe_fwd_open(model, &f2, &err), err);
    if (f1 && f2) {
        moe_status st = run(f1, rc, false, &a, NULL, &err);
        CHECK_OK(st, err);
        st = run(f2, rc, true, &b, NULL, &err);
        CHECK_OK(st, err);
        char w[200];
        snprintf(w, sizeof w, "%s, %d ranks, %s", what, g_size, model);
        same(&a, &b, w);
    }
    collect_free(&a);
    collect_free(&b);
    moe_fwd_free(f1);
    moe_fwd_free(f2);
}

static const char *g_sharded;

static void test_bitwise(void) {
    const char *attn = moe_t_data("dsv4-attn");
    char a[1024];
    snprintf(a, sizeof a, "%s", attn);
    const char *flash = moe_t_data("dsv4-flash-layout");
    char fl[1024];
    snprintf(fl, sizeof fl, "%s", flash);
    run_cfg ref = {.prec = MOE_PREC_REF};
    run_cfg chunked = {.prec = MOE_PREC_REF, .chunks = {17, 1, 5, 0}, .placement = 1};
    run_cfg f32 = {.prec = MOE_PREC_F32, .chunks = {40, 3, 0}};
    run_cfg mtp = {.prec = MOE_PREC_REF, .mtp = true, .chunks = {9, 1, 0}, .placement = 1};
    one(a, &ref, "dsv4-attn ref one shot, contiguous");
    one(a, &chunked, "dsv4-attn ref chunks 17,1,5.., scattered");
    one(a, &f32, "dsv4-attn f32 chunks 40,3..");
    one(fl, &ref, "dsv4-flash-layout ref one shot");
    one(fl, &chunked, "dsv4-flash-layout ref chunks, scattered");
    one(fl, &f32, "dsv4-flash-layout f32 chunks");
    one(fl, &mtp, "dsv4-flash-layout MTP block, chunks 9,1.., scattered");
    one(g_sharded, &ref, "expert-sharded copy, ref one shot");
}

/* The shards a rank maps are the dense one and those of its own experts. */
static void test_maps_own_experts(void) {
    for (int kind = 0; kind < 2; kind++) {
        moe_error err = {""};
        moe_fwd *f = NULL;
        CHECK_OK(moe_fwd_open(g_sharded, &f, &err), err);
        if (!f) return;
        collect c;
        collect_init(&c);
        run_cfg rc = {.prec = MOE_PREC_REF, .mtp = true, .placement = kind};
        moe_ep_forward *x = NULL;
        CHECK_OK(run(f, &rc, true, &c, &x, &err), err);
        moe_ckpt *ck = moe_model_ckpt(moe_fwd_model(f));
        int wrong = 0, mine = 0, n_exp = 0;
        for (size_t i = 0; i < moe_ckpt_n_shards(ck) && x; i++) {
            const char *file = moe_ckpt_shard_file(ck, i);
            bool mapped = moe_ckpt_shard_mapped(ck, i);
            char block[64];
            int e = -1, layer = -1;
            if (sscanf(file, "experts-%63[^-]-%d.safetensors", block, &e) != 2) {
                CHECK(mapped, "rank %d: the dense shard %s is mapped", g_rank, file);
                continue;
            }
            n_exp++;
            if (!strncmp(block, "layers.", 7)) layer = atoi(block + 7);
            else layer = moe_fwd_get_config(f)->n_layers + atoi(block + 4); /* mtp.K */
            const moe_ep_layer *l = moe_ep_forward_layer(x, layer);
            bool held = l && moe_ep_layer_placement(l)->owner[e] == g_rank;
            mine += held;
            if (held != mapped && wrong++ < 3)
                fprintf(stderr, "rank %d: %s is %smapped but the rank %s expert %d\n", g_rank, file, mapped ? "" : "not ",
                        held ? "holds" : "does not hold", e);
        }
        CHECK(n_exp == 4 * 8, "32 expert shards (3 layers + MTP, 8 experts): %d", n_exp);
        CHECK(wrong == 0, "rank %d (%s placement): %d expert shards mapped or not against the rank's share", g_rank,
              kind ? "scattered" : "contiguous", wrong);
        CHECK(mine > 0, "rank %d holds some experts", g_rank);
        moe_ep_forward_info info;
        if (x) {
            moe_ep_forward_get_info(x, &info);
            CHECK(info.experts_held == mine && info.experts_total == 32 && info.n_blocks == 4,
                  "info: %lld held (%d shards), %lld total, %d blocks", (long long)info.experts_held, mine,
                  (long long)info.experts_total, info.n_blocks);
        }
        moe_ep_forward_free(x);
        collect_free(&c);
        moe_fwd_free(f);
    }
    /* the check can fail: one process maps every expert shard */
    moe_error err = {""};
    moe_fwd *f = NULL;
    CHECK_OK(moe_fwd_open(g_sharded, &f, &err), err);
    if (!f) return;
    collect c;
    collect_init(&c);
    run_cfg rc = {.prec = MOE_PREC_REF, .mtp = true};
    CHECK_OK(run(f, &rc, false, &c, NULL, &err), err);
    moe_ckpt *ck = moe_model_ckpt(moe_fwd_model(f));
    size_t mapped = 0;
    for (size_t i = 0; i < moe_ckpt_n_shards(ck); i++) mapped += moe_ckpt_shard_mapped(ck, i);
    CHECK(mapped == moe_ckpt_n_shards(ck), "the single process maps all %zu shards (%zu)", moe_ckpt_n_shards(ck),
          mapped);
    collect_free(&c);
    moe_fwd_free(f);
}

/* Rank 0 copies DIR to a fresh directory without `drop` (a shard file); every rank gets the path. */
static void copy_without(const char *dir, const char *drop, char *out, size_t cap) {
    if (g_rank == 0) {
        static int k;
        char cmd[5000];
        snprintf(out, cap, "%s/copy%d", moe_t_tmpdir(), k++);
        snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s' && rm -f '%s/%s'", out, dir, out, out, drop);
        CHECK(system(cmd) == 0, "%s", cmd);
    }
    MPI_Bcast(out, (int)cap, MPI_CHAR, 0, MPI_COMM_WORLD);
}

static void test_missing_shard(void) {
    for (int kind = 0; kind < 2; kind++) {
        /* expert 7 of layer 1: on the last rank (contiguous) or on rank (36 mod N) */
        const int holder = kind ? (5 * 7 + 1) % g_size : g_size - 1;
        char dir[1024];
        copy_without(g_sharded, "experts-layers.1-7.safetensors", dir, sizeof dir);
        moe_error err = {""};
        moe_fwd *f = NULL;
        CHECK_OK(moe_fwd_open(dir, &f, &err), err); /* the dense shard is there: every rank opens */
        if (!f) return;
        moe_ep_placement pl;
        placement(kind, 8, &pl);
        moe_ep_forward *x = NULL;
        moe_status st = moe_ep_forward_open(f, 0, 2, true, MPI_COMM_WORLD, &pl, &x, &err);
        moe_ep_placement_free(&pl);
        int sts[2] = {(int)st, -(int)st}, mx[2];
        MPI_Allreduce(sts, mx, 2, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
        CHECK(st != MOE_OK && x == NULL, "rank %d: the open fails (%s)", g_rank, moe_status_str(st));
        CHECK(mx[0] == -mx[1], "every rank returns the same status");
        char want[96];
        if (kind == 0) {
            int64_t b, n;
            moe_mpi_split(8, g_size, holder, &b, &n);
            snprintf(want, sizeof want, "rank %d: layer 1, experts %lld..%lld of 8: ", holder, (long long)b,
                     (long long)(b + n - 1));
        } else {
            snprintf(want, sizeof want, "rank %d: layer 1, expert 7 of 8: ", holder); /* a run of one */
        }
        CHECK(!strncmp(err.msg, want, strlen(want)) && strstr(err.msg, "experts-layers.1-7.safetensors"),
              "rank %d: names the failing rank, its layer and experts, and the shard: \"%s\" (want \"%s...\")",
              g_rank, err.msg, want);
        moe_fwd_free(f);
    }
}

/* A rank that fails outside the MoE blocks (its sink) is learned by the
 * others at their next block or at the settle, with its message. */
static void test_local_failures(void) {
    const char *attn = moe_t_data("dsv4-attn");
    char model[1024];
    snprintf(model, sizeof model, "%s", attn);
    struct { int rank, layer; moe_fwd_what what; } cases[] = {
        {g_size - 1, 1, MOE_FWD_ATTN_OUT}, /* before layer 1's block: the others wait in its agreement */
        {0, -1, MOE_FWD_LOGITS},           /* after the last block: met at the settle */
        {g_size - 1, 3, MOE_FWD_FFN_OUT},  /* right after a block */
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
        moe_error err = {""};
        moe_fwd *f = NULL;
        CHECK_OK(moe_fwd_open(model, &f, &err), err);
        if (!f) return;
        collect c;
        collect_init(&c);
        c.fail_rank = cases[i].rank;
        c.fail_layer = cases[i].layer;
        c.fail_what = cases[i].what;
        run_cfg rc = {.prec = MOE_PREC_REF, .chunks = {100, 0}};
        moe_status st = run(f, &rc, true, &c, NULL, &err);
        char want[64];
        snprintf(want, sizeof want, "rank %d: injected sink failure", cases[i].rank);
        CHECK(st == MOE_ERR_IO && !strncmp(err.msg, want, strlen(want)),
              "case %zu, rank %d: %s \"%s\" (want MOE_ERR_IO \"%s...\")", i, g_rank, moe_status_str(st), err.msg, want);
        collect_free(&c);
        moe_fwd_free(f);
    }
}

static int layer_one(int layer) { return layer == 1; }

/* Replicated layers that computed differently on one rank stop the run at
 * the next block, on every rank, instead of mixing two forwards. */
static void test_divergence(void) {
    if (g_size < 2) return;
    const char *attn = moe_t_data("dsv4-attn");
    char model[1024];
    snprintf(model, sizeof model, "%s", attn);
    moe_error err = {""};
    moe_fwd *f = NULL;
    CHECK_OK(moe_fwd_open(model, &f, &err), err);
    if (!f) return;
    collect c;
    collect_init(&c);
    run_cfg rc = {.prec = MOE_PREC_REF, .index = layer_one};
    moe_status st = run(f, &rc, true, &c, NULL, &err);
    CHECK(st == MOE_ERR_INVARIANT && strstr(err.msg, "layer 1: the ranks computed different MoE inputs"),
          "rank %d: %s \"%s\"", g_rank, moe_status_str(st), err.msg);
    collect_free(&c);
    moe_fwd_free(f);
}

/* ---------------------------------------------------------- the command */

static char out_buf[1 << 16];

static int sh(const char *cmd) { return moe_t_sh(cmd, out_buf, sizeof out_buf); }

static void cli_same(const char *cli, const char *mpirun, int np, const char *model, const char *args) {
    char a[700], b[700], cmd[4096];
    static int k;
    snprintf(a, sizeof a, "%s/one%d.safetensors", moe_t_tmpdir(), k);
    snprintf(b, sizeof b, "%s/ep%d.safetensors", moe_t_tmpdir(), k++);
    snprintf(cmd, sizeof cmd, "'%s' forward --model '%s' --input '%s/oracle.safetensors' --output '%s' --threads 1 %s 2>&1",
             cli, model, model, a, args);
    CHECK(sh(cmd) == 0, "single process: %s", out_buf);
    snprintf(cmd, sizeof cmd, "'%s' --oversubscribe --allow-run-as-root -np %d '%s' forward --ep %d --model '%s' "
             "--input '%s/oracle.safetensors' --output '%s' --threads 1 %s 2>&1", mpirun, np, cli, np, model, model, b,
             args);
    int rc = sh(cmd);
    CHECK(rc == 0 && strstr(out_buf, "expert parallelism:"), "forward --ep %d %s (rc %d): %s", np, args, rc, out_buf);
    snprintf(cmd, sizeof cmd, "cmp '%s' '%s' 2>&1", a, b);
    CHECK(sh(cmd) == 0, "forward --ep %d %s on %s: the same bytes as one process: %s", np, args, model, out_buf);
    remove(a);
    remove(b);
}

static int cli_main(const char *cli, const char *mpirun, int np, const char *sharded) {
    char attn[1024], flash[1024];
    snprintf(attn, sizeof attn, "%s", moe_t_data("dsv4-attn"));
    snprintf(flash, sizeof flash, "%s", moe_t_data("dsv4-flash-layout"));
    cli_same(cli, mpirun, np, attn, "");
    cli_same(cli, mpirun, np, attn, "--chunks 50,1,3");
    cli_same(cli, mpirun, np, flash, "");
    cli_same(cli, mpirun, np, flash, "--chunks 20,1,1,7");
    cli_same(cli, mpirun, np, flash, "--precision f32 --chunks 30,2");
    cli_same(cli, mpirun, np, flash, "--layers mtp --chunks 40,1");

    /* a rank whose experts' shard is missing: named with its layer and experts, no output file */
    char dir[700], out[800], cmd[4096];
    snprintf(dir, sizeof dir, "%s/broken", moe_t_tmpdir());
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -r '%s' '%s' && rm '%s/experts-layers.1-7.safetensors'", dir, sharded,
             dir, dir);
    CHECK(system(cmd) == 0, "%s", cmd);
    snprintf(out, sizeof out, "%s/never.safetensors", moe_t_tmpdir());
    snprintf(cmd, sizeof cmd, "'%s' --oversubscribe --allow-run-as-root -np %d '%s' forward --ep %d --model '%s' "
             "--input '%s/oracle.safetensors' --output '%s' --threads 1 2>&1", mpirun, np, cli, np, dir, flash, out);
    int rc = sh(cmd);
    int64_t b, n;
    moe_mpi_split(8, np, np - 1, &b, &n);
    char want[128];
    snprintf(want, sizeof want, "rank %d: layer 1, experts %lld..%lld of 8: ", np - 1, (long long)b,
             (long long)(b + n - 1));
    CHECK(rc != 0 && strstr(out_buf, want) && strstr(out_buf, "experts-layers.1-7.safetensors"),
          "the failing rank is named with its layer and experts (rc %d, want \"%s\"): %s", rc, want, out_buf);
    struct stat sb;
    CHECK(stat(out, &sb) != 0, "no output file is left");
    /* every rank says it once: rank 0 */
    const char *p = strstr(out_buf, want);
    CHECK(p && !strstr(p + 1, want), "the message is printed once: %s", out_buf);

    /* the rank count must match */
    snprintf(cmd, sizeof cmd, "'%s' --oversubscribe --allow-run-as-root -np %d '%s' forward --ep %d --model '%s' 2>&1",
             mpirun, np, cli, np + 1, attn);
    rc = sh(cmd);
    CHECK(rc == 2 && strstr(out_buf, "MPI started"), "--ep N must equal the process count (rc %d): %s", rc, out_buf);
    /* --placement belongs to --ep: refused without it, never ignored */
    snprintf(cmd, sizeof cmd, "'%s' forward --model '%s' --placement x.txt 2>&1", cli, attn);
    rc = sh(cmd);
    CHECK(rc == 2 && strstr(out_buf, "--placement applies to --ep N only"), "--placement without --ep (rc %d): %s", rc,
          out_buf);
    return moe_t_finish();
}

int main(int argc, char **argv) {
    if (argc == 4 && !strcmp(argv[1], "--make-sharded")) return make_sharded(argv[2], argv[3]);
    if (argc == 6 && !strcmp(argv[1], "--cli")) return cli_main(argv[2], argv[3], atoi(argv[4]), argv[5]);
    if (argc != 3 || strcmp(argv[1], "--sharded")) {
        fprintf(stderr, "usage: test-forward-ep --make-sharded SRC DIR | --sharded DIR (under mpirun) | "
                        "--cli MOEAUDIT MPIRUN NP DIR\n");
        return 2;
    }
    g_sharded = argv[2];
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &g_rank);
    MPI_Comm_size(MPI_COMM_WORLD, &g_size);
    if (g_rank != 0) setenv("TMPDIR", "/tmp", 0);
    RUN(test_bitwise);
    RUN(test_maps_own_experts);
    RUN(test_missing_shard);
    RUN(test_local_failures);
    RUN(test_divergence);
    /* every rank's verdict counts */
    int fails = moe_t_fail, all = 0;
    MPI_Allreduce(&fails, &all, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (all && !fails) moe_t_fail = 1; /* another rank failed: so does this one */
    int rc = moe_t_finish();
    MPI_Finalize();
    return rc;
}
