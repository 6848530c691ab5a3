/*
 * Expert parallelism over MPI: the routed experts are spread over the ranks
 * of a communicator; each rank is home for a slice of the tokens.
 *
 * One round (MOE_EP_ROUND home tokens per rank; every rank runs the same
 * number of rounds, with 0 tokens when it has run out):
 *   route    home rank: logits, top-k, weights under the contract (the exact
 *            code of moe_block_run: the router stage, src/router)
 *   dispatch pack, per destination rank d: one hidden row per token that has
 *            an expert on d, and one (row, expert) pair per (token, column)
 *            whose expert is on d; MPI_Alltoall of the two counts;
 *            allocate; agree on status; MPI_Alltoallv pairs, MPI_Alltoallv rows
 *   compute  holder: group the received pairs by expert, run each expert over
 *            its rows (moe_expert_ref / moe_expert_f32), one output row per
 *            pair, in arrival order; home: the shared expert
 *   combine  MPI_Alltoallv the output rows back (the reverse counts); home:
 *            per token, sum the K columns in column order, add shared, apply
 *            the contract (the exact code of moe_block_run's combine,
 *            src/experts/combine.c)
 *
 * Invariants:
 *  1. Each (token, column) output row is computed by the same kernel on the
 *     same rounded input as in moe_block_run, and the combine runs on the
 *     home rank in column order: outputs are bit-identical to moe_block_run
 *     for any N, placement and round size. Nothing is summed on the holders.
 *  2. Every rank calls the same collectives in the same order whatever
 *     fails locally; failures surface at the next moe_mpi_agree (once per
 *     round before the payload exchange, once at the end).
 *  3. Payload rows are in the path's precision: float rows for f32 (the
 *     f32 path rounds the input to float before anything else), double rows
 *     for the reference.
 */
#include "core/core.h"
#include "experts/experts.h"
#include "mpi/mpi_util.h"
#include "router/router.h"

#include <math.h>
#include <string.h>

/* Buffers of one round, kept by the layer across rounds and calls (grown on
 * demand, never shrunk): fresh pages cost more than the transfer itself. */
typedef struct round_bufs {
    /* fixed: */
    int *cnt_send, *cnt_recv;  /* [2 * N] (rows, pairs) per rank */
    int *rows_sd, *rows_sc, *rows_rd, *rows_rc; /* [N] displacements / counts in rows */
    int *pr_sd, *pr_sc, *pr_rd, *pr_rc;         /* [N] pairs sent / received */
    int *y_sd, *y_sc, *y_rd, *y_rc;             /* [N] output rows back */
    int *fill_rows, *fill_pairs;                /* [N] */
    int64_t *last_tok;                          /* [N] last token that claimed a row on rank d */
    int32_t *row_of;                            /* [N] that token's row index on d */
    int64_t *ecount, *estart;                   /* [E + 1] received pairs per expert */
    /* grown: */
    int32_t *pairs_out; size_t cap_pairs_out;   /* [A_out * 2] (row on dest, expert) */
    int32_t *slot_out;  size_t cap_slot_out;    /* [A_out] t * K + j, in send order */
    void *rows_out;     size_t cap_rows_out;    /* [R_out, H] */
    int32_t *pairs_in;  size_t cap_pairs_in;    /* [A_in * 2] */
    void *rows_in;      size_t cap_rows_in;     /* [R_in, H] */
    int64_t *grow_of;   size_t cap_grow;        /* [A_in] row index in rows_in */
    int64_t *order;     size_t cap_order;       /* [A_in] pair indices sorted by expert */
    void *y_back;       size_t cap_y_back;      /* [A_in, H] outputs to send back */
    void *y_home;       size_t cap_y_home;      /* [A_out, H] outputs received back */
    void *ysh;          size_t cap_ysh;         /* [n, H] shared expert */
    const void **yptr;  size_t cap_yptr;        /* [n * K] row of (t, j) in y_home */
} round_bufs;

struct moe_ep_layer {
    MPI_Comm comm;         /* duplicate of the caller's, errors returned */
    int rank, size;
    moe_ep_placement pl;   /* copy */
    moe_layer local;       /* cfg, router, shared from parts[0]; w1/w3/w2 -> w */
    moe_weight *w;         /* [3 * E]: w1, w3, w2 blocks; rows = 0 where not held */
    moe_layer **parts;     /* [n_parts]: parts[0] router + shared, then one per run of held experts */
    int n_parts;
    int32_t *held;         /* [n_held] held expert ids, ascending */
    int n_held;
    MPI_Datatype row_f64, row_f32; /* H doubles / floats */
    MPI_Datatype pair;             /* 2 ints: (row on the destination, expert) */
    int64_t round_tokens;  /* home tokens per rank per round */
    bool timing_barriers;  /* MPI_Barrier before each exchange (benchmarks) */
    round_bufs b;          /* workspace of moe_ep_block_run */
    bool b_ready;
    bool types_ok;
};

/* ------------------------------------------------------------ open/free */

static void bufs_free(round_bufs *b);

void moe_ep_layer_free(moe_ep_layer *l) {
    if (!l) return;
    if (l->b_ready) bufs_free(&l->b);
    for (int i = 0; i < l->n_parts; i++) moe_layer_free(l->parts[i]);
    free(l->parts);
    free(l->w);
    free(l->held);
    moe_ep_placement_free(&l->pl);
    if (l->types_ok) {
        MPI_Type_free(&l->row_f64);
        MPI_Type_free(&l->row_f32);
        MPI_Type_free(&l->pair);
    }
    if (l->comm != MPI_COMM_NULL) MPI_Comm_free(&l->comm);
    free(l);
}

const moe_layer *moe_ep_layer_local(const moe_ep_layer *l) { return &l->local; }
const moe_ep_placement *moe_ep_layer_placement(const moe_ep_layer *l) { return &l->pl; }

void moe_ep_layer_set_round(moe_ep_layer *l, int64_t tokens) {
    MOE_ASSERT(l && tokens >= 1);
    l->round_tokens = tokens;
}

void moe_ep_layer_set_timing_barriers(moe_ep_layer *l, bool on) {
    MOE_ASSERT(l);
    l->timing_barriers = on;
}

static uint64_t placement_hash(const moe_ep_placement *pl) {
    uint64_t h = 1469598103934665603ull; /* FNV-1a */
    h = (h ^ (uint64_t)pl->n_experts) * 1099511628211ull;
    h = (h ^ (uint64_t)pl->n_ranks) * 1099511628211ull;
    for (int e = 0; e < pl->n_experts; e++) h = (h ^ (uint64_t)(uint32_t)pl->owner[e]) * 1099511628211ull;
    return h;
}

/* Layer `layer` with routed experts [e0, e1): an ordinary layer, or MTP
 * block k at index n_layers + k. */
static moe_status load_part(moe_model *m, int layer, int e0, int e1, moe_layer **out, moe_error *err) {
    const int nl = moe_model_get_info(m)->n_layers;
    if (layer >= nl) return moe_model_mtp_layer_experts(m, layer - nl, e0, e1, out, err);
    return moe_model_layer_experts(m, layer, e0, e1, out, err);
}

/* "layer L[, experts A..B of E]: " before a loader's message, so that the
 * agreed message says what the failing rank was loading. */
static moe_status in_part(moe_status st, moe_model *m, int layer, int e0, int e1, int E, moe_error *err) {
    if (st == MOE_OK || !err) return st;
    char what[96], msg[sizeof err->msg];
    const int nl = moe_model_get_info(m)->n_layers;
    if (layer >= nl) snprintf(what, sizeof what, "MTP block %d (layer %d)", layer - nl, layer);
    else snprintf(what, sizeof what, "layer %d", layer);
    char part[160];
    if (e1 == e0 + 1) snprintf(part, sizeof part, "%s, expert %d of %d: ", what, e0, E);
    else if (e1 > e0) snprintf(part, sizeof part, "%s, experts %d..%d of %d: ", what, e0, e1 - 1, E);
    else snprintf(part, sizeof part, "%s, router and shared expert: ", what);
    size_t n = strlen(part);
    memcpy(msg, part, n);
    snprintf(msg + n, sizeof msg - n, "%s", err->msg); /* cut at the end, never the prefix */
    memcpy(err->msg, msg, sizeof msg);
    return st;
}

/* The rank-local part of opening: load router + shared, then each run. */
static moe_status open_local(moe_ep_layer *l, moe_model *m, int layer, const moe_ep_placement *pl, moe_error *err) {
    if (pl->n_ranks != l->size)
        return moe_errf(err, MOE_ERR_ARG, "the placement is for %d ranks but the communicator has %d", pl->n_ranks,
                        l->size);
    l->pl.owner = moe_malloc((size_t)pl->n_experts, sizeof *l->pl.owner);
    l->parts = moe_calloc((size_t)pl->n_experts + 1, sizeof *l->parts);
    l->held = moe_calloc((size_t)pl->n_experts, sizeof *l->held);
    if (!l->pl.owner || !l->parts || !l->held) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    memcpy(l->pl.owner, pl->owner, (size_t)pl->n_experts * sizeof *pl->owner);
    l->pl.n_experts = pl->n_experts;
    l->pl.n_ranks = pl->n_ranks;

    moe_status st = in_part(load_part(m, layer, 0, 0, &l->parts[0], err), m, layer, 0, 0, 0, err);
    if (st != MOE_OK) return st;
    l->n_parts = 1;
    int E = l->parts[0]->cfg.n_experts, H = l->parts[0]->cfg.hidden;
    if (E != pl->n_experts)
        return moe_errf(err, MOE_ERR_ARG, "the placement places %d experts but layer %d has %d", pl->n_experts,
                        layer, E);
    l->local = *l->parts[0];
    l->w = moe_calloc((size_t)3 * (size_t)E, sizeof *l->w);
    if (!l->w) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    l->local.w1 = l->w;
    l->local.w3 = l->w + E;
    l->local.w2 = l->w + 2 * (size_t)E;
    for (int e = 0; e < E;) {
        if (pl->owner[e] != l->rank) { e++; continue; }
        int e1 = e;
        while (e1 < E && pl->owner[e1] == l->rank) e1++;
        moe_layer *part = NULL;
        st = in_part(load_part(m, layer, e, e1, &part, err), m, layer, e, e1, E, err);
        if (st != MOE_OK) return st;
        l->parts[l->n_parts++] = part;
        for (int k = e; k < e1; k++) {
            l->w[k] = part->w1[k];
            l->w[E + k] = part->w3[k];
            l->w[2 * (size_t)E + k] = part->w2[k];
            l->held[l->n_held++] = k;
        }
        e = e1;
    }
    if (MPI_Type_contiguous(H, MPI_DOUBLE, &l->row_f64) != MPI_SUCCESS)
        return moe_errf(err, MOE_ERR_IO, "MPI_Type_contiguous failed");
    if (MPI_Type_contiguous(H, MPI_FLOAT, &l->row_f32) != MPI_SUCCESS) {
        MPI_Type_free(&l->row_f64);
        return moe_errf(err, MOE_ERR_IO, "MPI_Type_contiguous failed");
    }
    if (MPI_Type_contiguous(2, MPI_INT, &l->pair) != MPI_SUCCESS) {
        MPI_Type_free(&l->row_f64);
        MPI_Type_free(&l->row_f32);
        return moe_errf(err, MOE_ERR_IO, "MPI_Type_contiguous failed");
    }
    MPI_Type_commit(&l->row_f64);
    MPI_Type_commit(&l->row_f32);
    MPI_Type_commit(&l->pair);
    l->types_ok = true;
    return MOE_OK;
}

moe_status moe_ep_layer_open(moe_model *m, int layer, MPI_Comm comm, const moe_ep_placement *pl,
                             moe_ep_layer **out, moe_error *err) {
    MOE_ASSERT(m && pl && out);
    moe_error e = {""};
    moe_ep_layer *l = moe_calloc(1, sizeof *l);
    if (!l) return moe_errf(err, MOE_ERR_NOMEM, "out of memory"); /* before any collective: see below */
    l->comm = MPI_COMM_NULL;
    l->round_tokens = MOE_EP_ROUND;
    int rc = MPI_Comm_dup(comm, &l->comm);
    if (rc != MPI_SUCCESS) {
        free(l);
        return moe_mpi_fail(err, rc, "MPI_Comm_dup");
    }
    MPI_Comm_set_errhandler(l->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(l->comm, &l->rank);
    MPI_Comm_size(l->comm, &l->size);

    bool same = false;
    moe_status st = moe_mpi_same_u64(l->comm, placement_hash(pl), &same, &e);
    if (st == MOE_OK && !same)
        st = moe_errf(&e, MOE_ERR_ARG, "the ranks were given different placements");
    if (st == MOE_OK) st = open_local(l, m, layer, pl, &e);
    st = moe_mpi_agree(l->comm, st, &e);
    if (st != MOE_OK) {
        moe_ep_layer_free(l);
        if (err) *err = e;
        return st;
    }
    *out = l;
    return MOE_OK;
}

/* Routing (router/router.h), the expert rows, the contract and the combine
 * (experts/experts.h) are the stages moe_block_run calls: one
 * implementation, bit-identical results. */

/* ------------------------------------------------------------- one run */


static bool grow(void *pp, size_t *cap, size_t n, size_t size) {
    void **p = pp;
    if (n <= *cap && *p) return true;
    size_t want = n > *cap * 2 ? n : *cap * 2;
    if (want == 0) want = 1;
    void *q = moe_malloc(want, size);
    if (!q) return false;
    free(*p);
    *p = q;
    *cap = want;
    return true;
}

static void bufs_free(round_bufs *b) {
    int **ints[] = {&b->cnt_send, &b->cnt_recv, &b->rows_sd, &b->rows_sc, &b->rows_rd, &b->rows_rc, &b->pr_sd,
                    &b->pr_sc, &b->pr_rd, &b->pr_rc, &b->y_sd, &b->y_sc, &b->y_rd, &b->y_rc, &b->fill_rows,
                    &b->fill_pairs};
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) free(*ints[i]);
    free(b->last_tok);
    free(b->row_of);
    free(b->ecount);
    free(b->estart);
    free(b->pairs_out);
    free(b->slot_out);
    free(b->rows_out);
    free(b->pairs_in);
    free(b->rows_in);
    free(b->grow_of);
    free(b->order);
    free(b->y_back);
    free(b->y_home);
    free(b->ysh);
    free((void *)b->yptr);
    memset(b, 0, sizeof *b);
}

static bool bufs_init(round_bufs *b, int N, int E) {
    memset(b, 0, sizeof *b);
    int **ints[] = {&b->rows_sd, &b->rows_sc, &b->rows_rd, &b->rows_rc, &b->pr_sd, &b->pr_sc, &b->pr_rd,
                    &b->pr_rc, &b->y_sd, &b->y_sc, &b->y_rd, &b->y_rc, &b->fill_rows, &b->fill_pairs};
    bool ok = true;
    for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) ok = ok && (*ints[i] = moe_calloc((size_t)N, sizeof(int)));
    ok = ok && (b->cnt_send = moe_calloc(2 * (size_t)N, sizeof(int)));
    ok = ok && (b->cnt_recv = moe_calloc(2 * (size_t)N, sizeof(int)));
    ok = ok && (b->last_tok = moe_calloc((size_t)N, sizeof *b->last_tok));
    ok = ok && (b->row_of = moe_calloc((size_t)N, sizeof *b->row_of));
    ok = ok && (b->ecount = moe_calloc((size_t)E + 1, sizeof *b->ecount));
    ok = ok && (b->estart = moe_calloc((size_t)E + 2, sizeof *b->estart));
    return ok;
}

typedef struct run_ctx {
    moe_ep_layer *l;
    const moe_run_opts *o;
    const moe_cpu_kernels *kern; /* f32 path: the table of o->isa */
    moe_contract c;
    bool f32;
    size_t es;             /* element size of payload rows */
    MPI_Datatype row;      /* H elements of the payload type */
    int C, K, E, H, N;
} run_ctx;

/* Pack the round's (token, column) pairs per destination rank. Returns the
 * total pairs (n * K) and rows; fills counts and displacements. */
static moe_status pack(run_ctx *x, round_bufs *b, const moe_block_out *out, const double *hid, int64_t t0,
                       int64_t n, moe_error *err) {
    int N = x->N, K = x->K, C = x->C, H = x->H;
    const int32_t *owner = x->l->pl.owner;
    for (int d = 0; d < N; d++) { b->rows_sc[d] = 0; b->pr_sc[d] = 0; b->last_tok[d] = -1; }
    for (int64_t t = 0; t < n; t++)
        for (int j = 0; j < K; j++) {
            int d = owner[out->topk_ids[(t0 + t) * C + j]];
            b->pr_sc[d]++;
            if (b->last_tok[d] != t) { b->last_tok[d] = t; b->rows_sc[d]++; }
        }
    size_t A = 0, R = 0;
    for (int d = 0; d < N; d++) {
        b->rows_sd[d] = (int)R;
        b->pr_sd[d] = (int)A;
        R += (size_t)b->rows_sc[d];
        A += (size_t)b->pr_sc[d];
        b->cnt_send[2 * d] = b->rows_sc[d];
        b->cnt_send[2 * d + 1] = b->pr_sc[d];
    }
    if (!grow(&b->pairs_out, &b->cap_pairs_out, 2 * A, sizeof(int32_t)) ||
        !grow(&b->slot_out, &b->cap_slot_out, A, sizeof(int32_t)) ||
        !grow(&b->rows_out, &b->cap_rows_out, R * (size_t)H, x->es))
        return moe_errf(err, MOE_ERR_NOMEM, "out of memory packing %zu rows for dispatch", R);
    for (int d = 0; d < N; d++) { b->fill_rows[d] = 0; b->fill_pairs[d] = 0; b->last_tok[d] = -1; }
    for (int64_t t = 0; t < n; t++) {
        const double *src = hid + (t0 + t) * H;
        for (int j = 0; j < K; j++) {
            int32_t e = out->topk_ids[(t0 + t) * C + j];
            int d = owner[e];
            if (b->last_tok[d] != t) {
                b->last_tok[d] = t;
                b->row_of[d] = b->fill_rows[d]++;
                size_t r = (size_t)b->rows_sd[d] + (size_t)b->row_of[d];
                if (x->f32) {
                    float *dst = (float *)b->rows_out + r * (size_t)H;
                    for (int h = 0; h < H; h++) dst[h] = (float)src[h];
                } else {
                    memcpy((double *)b->rows_out + r * (size_t)H, src, (size_t)H * sizeof(double));
                }
            }
            size_t q = (size_t)b->pr_sd[d] + (size_t)b->fill_pairs[d]++;
            b->pairs_out[2 * q] = b->row_of[d];
            b->pairs_out[2 * q + 1] = e;
            b->slot_out[q] = (int32_t)(t * K + j);
        }
    }
    return MOE_OK;
}

/* After the counts arrive: displacements and receive buffers. */
static moe_status plan_recv(run_ctx *x, round_bufs *b, int64_t n, size_t *A_in, moe_error *err) {
    int N = x->N, H = x->H;
    size_t A = 0, R = 0, Aout = 0;
    for (int s = 0; s < N; s++) {
        b->rows_rc[s] = b->cnt_recv[2 * s];
        b->rows_rd[s] = (int)R;
        R += (size_t)b->rows_rc[s];
        b->y_sc[s] = b->cnt_recv[2 * s + 1]; /* outputs back = pairs received */
        b->y_sd[s] = (int)A;
        A += (size_t)b->y_sc[s];
        b->y_rc[s] = b->pr_sc[s];           /* outputs received back = pairs sent */
        b->y_rd[s] = b->pr_sd[s];
        Aout += (size_t)b->pr_sc[s];
    }
    if (A > (size_t)INT32_MAX || R > (size_t)INT32_MAX)
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "a round received %zu pairs: over the MPI count limit", A);
    for (int s = 0; s < N; s++) {
        b->pr_rc[s] = b->y_sc[s];
        b->pr_rd[s] = b->y_sd[s];
    }
    *A_in = A;
    bool ok = grow(&b->pairs_in, &b->cap_pairs_in, 2 * A, sizeof(int32_t)) &&
              grow(&b->rows_in, &b->cap_rows_in, R * (size_t)H, x->es) &&
              grow(&b->grow_of, &b->cap_grow, A, sizeof(int64_t)) &&
              grow(&b->order, &b->cap_order, A, sizeof(int64_t)) &&
              grow(&b->y_back, &b->cap_y_back, A * (size_t)H, x->es) &&
              grow(&b->y_home, &b->cap_y_home, Aout * (size_t)H, x->es) &&
              grow(&b->ysh, &b->cap_ysh, (size_t)n * (size_t)H, x->es) &&
              grow((void *)&b->yptr, &b->cap_yptr, (size_t)n * (size_t)x->K, sizeof(void *));
    if (!ok) return moe_errf(err, MOE_ERR_NOMEM, "out of memory receiving %zu rows and %zu pairs", R, A);
    return MOE_OK;
}

/* Expert w (held here, or the shared one) over rows gathered by `src_idx`. */
static moe_status run_one(run_ctx *x, const moe_weight *w1, const moe_weight *w3, const moe_weight *w2,
                          int64_t n, const void *src_rows, const int64_t *src_idx, void *dst_rows,
                          const int64_t *dst_idx, moe_error *err) {
    return moe_expert_rows(w1, w3, w2, x->l->local.cfg.swiglu_limit, x->f32, x->o->act, x->kern, x->H, n, src_rows, src_idx,
                                 dst_rows, dst_idx, err);
}

/* Held experts over the received pairs; then the shared expert over the
 * round's home tokens (rows of hid, converted for f32). */
static moe_status compute(run_ctx *x, round_bufs *b, size_t A_in, const double *hid_round, int64_t n,
                          moe_error *err) {
    moe_ep_layer *l = x->l;
    int N = x->N, E = x->E, H = x->H;
    /* pair q from source s: row rows_rd[s] + pair.row */
    memset(b->ecount, 0, (size_t)(E + 1) * sizeof *b->ecount);
    for (int s = 0; s < N; s++)
        for (int i = 0; i < b->y_sc[s]; i++) {
            size_t q = (size_t)b->y_sd[s] + (size_t)i;
            int32_t row = b->pairs_in[2 * q], e = b->pairs_in[2 * q + 1];
            if (e < 0 || e >= E || l->pl.owner[e] != l->rank || row < 0 || row >= b->rows_rc[s])
                return moe_errf(err, MOE_ERR_INVARIANT, "rank %d sent pair (row %d, expert %d) that rank %d cannot serve",
                                s, row, e, l->rank);
            b->grow_of[q] = b->rows_rd[s] + row;
            b->ecount[e]++;
        }
    b->estart[0] = 0;
    for (int e = 0; e < E; e++) b->estart[e + 1] = b->estart[e] + b->ecount[e];
    memset(b->ecount, 0, (size_t)(E + 1) * sizeof *b->ecount);
    for (size_t q = 0; q < A_in; q++) {
        int e = b->pairs_in[2 * q + 1];
        b->order[b->estart[e] + b->ecount[e]++] = (int64_t)q;
    }
    /* gather index per pair in expert order: reuse grow_of through order */
    moe_status first = MOE_OK;
    bool has_shared = l->local.cfg.shared_inter > 0;
    int n_jobs = l->n_held + 1;
#pragma omp parallel for schedule(dynamic, 1)
    for (int job = 0; job < n_jobs; job++) {
        moe_error local;
        moe_status s = MOE_OK;
        if (job < l->n_held) {
            int e = l->held[job];
            int64_t ne = b->estart[e + 1] - b->estart[e];
            if (ne > 0) {
                const int64_t *ord = b->order + b->estart[e];
                int64_t *src = moe_malloc((size_t)ne, sizeof *src);
                if (!src) s = moe_errf(&local, MOE_ERR_NOMEM, "out of memory");
                else {
                    for (int64_t q = 0; q < ne; q++) src[q] = b->grow_of[ord[q]];
                    s = run_one(x, &l->local.w1[e], &l->local.w3[e], &l->local.w2[e], ne, b->rows_in, src,
                                b->y_back, ord, &local);
                    free(src);
                }
            }
        } else if (has_shared && n > 0) {
            /* shared expert on the home tokens: rows in payload precision */
            void *rows = moe_malloc((size_t)n * (size_t)H, x->es);
            int64_t *idx = moe_malloc((size_t)n, sizeof *idx);
            if (!rows || !idx) s = moe_errf(&local, MOE_ERR_NOMEM, "out of memory");
            else {
                for (int64_t t = 0; t < n; t++) {
                    idx[t] = t;
                    if (x->f32)
                        for (int h = 0; h < H; h++) ((float *)rows)[t * H + h] = (float)hid_round[t * H + h];
                    else
                        memcpy((double *)rows + t * H, hid_round + t * H, (size_t)H * sizeof(double));
                }
                s = run_one(x, &l->local.sw1, &l->local.sw3, &l->local.sw2, n, rows, idx, b->ysh, NULL, &local);
            }
            free(rows);
            free(idx);
        }
        if (s != MOE_OK) {
#pragma omp critical
            {
                if (first == MOE_OK) { first = s; if (err) *err = local; }
            }
        }
    }
    return first;
}

/* The per-token combine of block.c, from the rows received back. */
static void combine(run_ctx *x, round_bufs *b, int64_t t0, int64_t n, moe_block_out *out) {
    int K = x->K, C = x->C, H = x->H;
    bool has_shared = x->l->local.cfg.shared_inter > 0;
    size_t A = (size_t)n * (size_t)K;
    for (size_t q = 0; q < A; q++) b->yptr[b->slot_out[q]] = (const char *)b->y_home + q * (size_t)H * x->es;
    for (int64_t t = 0; t < n; t++)
        moe_combine_token(&x->c, x->f32, K, C, H, out->topk_weights + (t0 + t) * C, b->yptr + t * K,
                          has_shared ? (const char *)b->ysh + (size_t)t * (size_t)H * x->es : NULL,
                          out->routed_out + (t0 + t) * H, out->shared_out + (t0 + t) * H, out->moe_out + (t0 + t) * H);
}

static uint64_t opts_hash(const moe_run_opts *o) {
    uint64_t v[8];
    memset(v, 0, sizeof v);
    v[0] = (uint64_t)o->precision;
    v[1] = (uint64_t)o->act;
    v[2] = (uint64_t)o->owner;
    v[3] = (uint64_t)o->fuse_shared | (uint64_t)o->check_invariants << 1;
    v[5] = (uint64_t)o->router << 8 | (uint64_t)o->isa << 16;
    uint64_t h = 1469598103934665603ull;
    for (int i = 0; i < 6; i++) h = (h ^ v[i]) * 1099511628211ull;
    return h;
}

static moe_status check_local(run_ctx *x, const int64_t *ids, int64_t T, int64_t offset, const moe_block_out *out,
                              moe_error *err) {
    const moe_layer *L = &x->l->local;
    if (T < 0) return moe_errf(err, MOE_ERR_ARG, "token count %lld is negative", (long long)T);
    if (out->T != T || out->H != x->H || out->E != x->E || out->n_cols != x->C)
        return moe_errf(err, MOE_ERR_ARG, "output buffers were sized for another layer, T or shared mode");
    moe_status st = moe_router_check_ids(&L->cfg, L->index, ids, T, offset, err);
    if (st != MOE_OK) return st;
    /* NVFP4 activations: this rank's experts need their static input scales */
    if ((st = moe_act_check_layer(L, x->o->act, err)) != MOE_OK) return st;
    if (x->K > 256) return moe_errf(err, MOE_ERR_UNSUPPORTED, "top_k %d is over 256", x->K);
    if (x->f32 && (st = moe_cpu_table(x->o->isa, &x->kern, err)) != MOE_OK) return st;
    return moe_contract_applied(x->o->owner, x->o->fuse_shared && L->cfg.shared_inter > 0, L->cfg.scaling, NULL, &x->c,
                                err);
}

static void add_bytes(run_ctx *x, moe_ep_stats *s, const round_bufs *b) {
    int me = x->l->rank;
    uint64_t row = (uint64_t)x->H * x->es;
    for (int d = 0; d < x->N; d++) {
        if (d == me) continue;
        uint64_t disp_out = 8 + 8 * (uint64_t)b->pr_sc[d] + row * (uint64_t)b->rows_sc[d];
        uint64_t disp_in = 8 + 8 * (uint64_t)b->y_sc[d] + row * (uint64_t)b->rows_rc[d];
        s->dispatch_bytes_sent += disp_out;
        s->bytes_sent += disp_out + row * (uint64_t)b->y_sc[d];
        s->bytes_recv += disp_in + row * (uint64_t)b->pr_sc[d];
        s->assign_remote += b->pr_sc[d];
        s->rows_remote += b->rows_sc[d];
    }
    for (int d = 0; d < x->N; d++) s->assign_in += b->y_sc[d];
}

moe_status moe_ep_block_run(moe_ep_layer *l, const double *hidden, const int64_t *input_ids, int64_t T_local,
                            const moe_run_opts *o, moe_block_out *out, moe_ep_stats *stats, moe_error *err) {
    MOE_ASSERT(l && o && out);
    double t_begin = MPI_Wtime();
    moe_ep_stats st_local;
    moe_ep_stats *S = stats ? stats : &st_local;
    memset(S, 0, sizeof *S);
    S->tokens = T_local;
    moe_error e = {""};
    run_ctx x;
    memset(&x, 0, sizeof x);
    x.l = l;
    x.o = o;
    x.f32 = o->precision == MOE_PREC_F32;
    x.es = x.f32 ? sizeof(float) : sizeof(double);
    x.row = x.f32 ? l->row_f32 : l->row_f64;
    x.K = l->local.cfg.top_k;
    x.E = l->local.cfg.n_experts;
    x.H = l->local.cfg.hidden;
    x.C = x.K + (o->fuse_shared && l->local.cfg.shared_inter > 0 ? 1 : 0);
    x.N = l->size;

    /* the global index of this rank's first token, for messages */
    long long Tl = T_local > 0 ? T_local : 0, offset = 0;
    int rc = MPI_Exscan(&Tl, &offset, 1, MPI_LONG_LONG, MPI_SUM, l->comm);
    if (rc != MPI_SUCCESS) return moe_mpi_fail(err, rc, "MPI_Exscan");
    if (l->rank == 0) offset = 0; /* undefined on rank 0 */
    bool same = false;
    moe_status st = moe_mpi_same_u64(l->comm, opts_hash(o), &same, &e);
    if (st != MOE_OK) { if (err) *err = e; return st; }
    if (!same) st = moe_errf(&e, MOE_ERR_ARG, "the ranks were given different run options");
    if (st == MOE_OK) st = check_local(&x, input_ids, T_local, offset, out, &e);
    int64_t RT = l->round_tokens;
    long long rr[2] = {(Tl + RT - 1) / RT, RT}, rmax[2] = {0, 0};
    int rounds = 0;
    rc = MPI_Allreduce(rr, rmax, 2, MPI_LONG_LONG, MPI_MAX, l->comm);
    if (rc != MPI_SUCCESS) return moe_mpi_fail(err, rc, "MPI_Allreduce (round count)");
    rounds = (int)rmax[0];
    if (rmax[1] != RT && st == MOE_OK) st = moe_errf(&e, MOE_ERR_ARG, "the ranks were given different round sizes");
    S->rounds = rounds;
    if (!l->b_ready) {
        l->b_ready = bufs_init(&l->b, x.N, x.E);
        if (!l->b_ready) bufs_free(&l->b);
    }
    if (!l->b_ready && st == MOE_OK) st = moe_errf(&e, MOE_ERR_NOMEM, "out of memory");
    round_bufs *bp = &l->b;
    st = moe_mpi_agree(l->comm, st, &e);

    /* A compute failure of round r is carried to round r + 1's agreement
     * (or the final one): every rank calls the same collectives until then. */
    moe_status pending = MOE_OK;
    for (int r = 0; r < rounds && st == MOE_OK; r++) {
        int64_t t0 = (int64_t)r * RT;
        int64_t n = T_local - t0 < 0 ? 0 : (T_local - t0 < RT ? T_local - t0 : RT);
        const double *hid = n > 0 ? hidden : NULL;
        moe_status ls = pending; /* this rank's status in this round */
        double t = MPI_Wtime();
        if (ls == MOE_OK && n > 0) {
            ls = moe_router_logits(&l->local, x.f32, o->router, hid + t0 * x.H, n, out->router_logits + t0 * x.E, &e);
            if (ls == MOE_OK) ls = moe_router_route(&l->local, x.f32, &x.c, NULL, input_ids, t0, n, out, &e);
        }
        double t_routed = MPI_Wtime();
        S->route_s += t_routed - t;
        if (ls == MOE_OK) ls = pack(&x, bp, out, hid, t0, n, &e);
        if (ls != MOE_OK) /* take part in the count exchange with nothing to send */
            for (int d = 0; d < x.N; d++) bp->cnt_send[2 * d] = bp->cnt_send[2 * d + 1] = 0;
        if (l->timing_barriers) {
            double tw = MPI_Wtime();
            MPI_Barrier(l->comm);
            S->wait_s += MPI_Wtime() - tw;
            t_routed += MPI_Wtime() - tw;
        }
        rc = MPI_Alltoall(bp->cnt_send, 2, MPI_INT, bp->cnt_recv, 2, MPI_INT, l->comm);
        if (rc != MPI_SUCCESS) { st = moe_mpi_fail(&e, rc, "MPI_Alltoall (dispatch counts)"); break; }
        size_t A_in = 0;
        if (ls == MOE_OK) ls = plan_recv(&x, bp, n, &A_in, &e);
        st = moe_mpi_agree(l->comm, ls, &e);
        if (st != MOE_OK) break;
        rc = MPI_Alltoallv(bp->pairs_out, bp->pr_sc, bp->pr_sd, l->pair, bp->pairs_in, bp->pr_rc, bp->pr_rd, l->pair, l->comm);
        if (rc != MPI_SUCCESS) { st = moe_mpi_fail(&e, rc, "MPI_Alltoallv (dispatch pairs)"); break; }
        rc = MPI_Alltoallv(bp->rows_out, bp->rows_sc, bp->rows_sd, x.row, bp->rows_in, bp->rows_rc, bp->rows_rd, x.row, l->comm);
        if (rc != MPI_SUCCESS) { st = moe_mpi_fail(&e, rc, "MPI_Alltoallv (dispatch rows)"); break; }
        double t_disp = MPI_Wtime();
        S->dispatch_s += t_disp - t_routed;

        ls = compute(&x, bp, A_in, n > 0 ? hid + t0 * x.H : NULL, n, &e);
        if (ls != MOE_OK) memset(bp->y_back, 0, A_in * (size_t)x.H * x.es); /* defined bytes on the wire */
        double t_comp = MPI_Wtime();
        S->compute_s += t_comp - t_disp;
        if (l->timing_barriers) {
            MPI_Barrier(l->comm);
            S->wait_s += MPI_Wtime() - t_comp;
            t_comp = MPI_Wtime();
        }

        rc = MPI_Alltoallv(bp->y_back, bp->y_sc, bp->y_sd, x.row, bp->y_home, bp->y_rc, bp->y_rd, x.row, l->comm);
        if (rc != MPI_SUCCESS) { st = moe_mpi_fail(&e, rc, "MPI_Alltoallv (combine rows)"); break; }
        add_bytes(&x, S, bp);
        if (ls == MOE_OK && n > 0) combine(&x, bp, t0, n, out);
        S->combine_s += MPI_Wtime() - t_comp;
        pending = ls;
    }
    if (st == MOE_OK) {
        moe_status cs = pending;
        if (cs == MOE_OK && o->check_invariants) cs = moe_block_check(&l->local, out, o, &e);
        st = moe_mpi_agree(l->comm, cs, &e);
    }
    S->total_s = MPI_Wtime() - t_begin;
    if (st != MOE_OK && err) *err = e;
    return st;
}

moe_status moe_block_run_ep(moe_model *m, int layer, const double *hidden, const int64_t *input_ids,
                            int64_t T_local, const moe_run_opts *o, moe_block_out *out, MPI_Comm comm,
                            const moe_ep_placement *pl, moe_ep_stats *stats, moe_error *err) {
    MOE_ASSERT(m && o && out);
    memset(out, 0, sizeof *out);
    moe_ep_placement own = {0, 0, NULL};
    moe_status st = MOE_OK;
    moe_error e = {""};
    if (!pl) {
        int size = 1;
        MPI_Comm_size(comm, &size);
        moe_layer *part = NULL;
        /* E from the router alone (no experts mapped) */
        st = moe_model_layer_experts(m, layer, 0, 0, &part, &e);
        if (st == MOE_OK) st = moe_ep_placement_contiguous(part->cfg.n_experts, size, &own, &e);
        moe_layer_free(part);
        pl = &own;
        st = moe_mpi_agree(comm, st, &e);
        if (st != MOE_OK) { if (err) *err = e; moe_ep_placement_free(&own); return st; }
    }
    moe_ep_layer *l = NULL;
    st = moe_ep_layer_open(m, layer, comm, pl, &l, err);
    moe_ep_placement_free(&own);
    if (st != MOE_OK) return st;
    moe_status ls = moe_block_out_init(out, &l->local, T_local, o, &e);
    st = moe_mpi_agree(l->comm, ls, &e);
    if (st == MOE_OK) st = moe_ep_block_run(l, hidden, input_ids, T_local, o, out, stats, &e);
    if (st != MOE_OK) {
        moe_block_out_free(out);
        if (err) *err = e;
    }
    moe_ep_layer_free(l);
    return st;
}
