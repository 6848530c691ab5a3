/*
 * The whole-model forward under expert parallelism: the forward driver's
 * MoE call (moe_fwd_opts.moe) becomes moe_ep_block_run on this rank's share
 * of each layer's routed experts. The driver itself stays unaware of MPI.
 *
 * Every rank runs the driver on all T tokens of a chunk (embedding,
 * attention, mHC, norms and head are replicated); at each MoE block:
 *   agree   the ranks' statuses (a rank that failed anywhere since the last
 *           agreement joins here from moe_ep_forward_settle)
 *   check   the block's input x [T, H], ids [T], T and the layer hash the
 *           same on every rank (replicated arithmetic must agree bit for bit)
 *   run     rank r is home for the rows moe_mpi_split(T, N, r) and runs
 *           moe_ep_block_run on them (route, dispatch, experts, combine)
 *   gather  MPI_Allgatherv of the output rows: every rank holds out [T, H]
 *
 * Invariants:
 *  1. out equals moe_block_run's moe_out bit for bit (moe_ep_block_run's
 *     invariant 1, row by row; the gather only moves bytes), so every tensor
 *     of the forward equals the single process's.
 *  2. The driver never looks up a routed expert (moe_external_experts): a
 *     rank maps the dense tensors and its own experts' tensors, nothing else.
 *  3. Agreement points are one per MoE call (entry) and one per moe_fwd_run
 *     (settle), all moe_mpi_agree on one communicator. A rank that fails
 *     outside a MoE call reaches its settle while the others reach their next
 *     entry or settle: the two match and every rank learns the failure there.
 *     A call that agreed a failure sets `agreed`, and settle then returns it
 *     without agreeing again (which no other rank would match).
 */
#include "core/core.h"
#include "moeaudit_model.h"
#include "moeaudit_mpi.h"
#include "mpi/mpi_util.h"

#include <string.h>

struct moe_ep_forward {
    MPI_Comm comm;           /* duplicate of the caller's */
    int rank, size;
    int n_slots;             /* n_layers + n_mtp */
    int H;
    moe_ep_layer **layer;    /* [n_slots]: this rank's share, NULL where not opened */
    MPI_Datatype row;        /* H doubles */
    bool row_ok;
    int *counts, *displs;    /* [size] rows per rank of the current gather */
    bool agreed;             /* the last MoE call's failure is known to every rank */
    moe_ep_forward_info info;
};

void moe_ep_forward_free(moe_ep_forward *x) {
    if (!x) return;
    if (x->layer)
        for (int i = 0; i < x->n_slots; i++) moe_ep_layer_free(x->layer[i]);
    free(x->layer);
    free(x->counts);
    free(x->displs);
    if (x->row_ok) MPI_Type_free(&x->row);
    if (x->comm != MPI_COMM_NULL) MPI_Comm_free(&x->comm);
    free(x);
}

/* Stored bytes of a weight (data and scales): what holding it costs. */
static uint64_t weight_bytes(const moe_weight *w) {
    if (w->rows <= 0 || w->cols <= 0) return 0;
    const uint64_t r = (uint64_t)w->rows, c = (uint64_t)w->cols;
    uint64_t b = 0;
    switch (w->fmt) {
    case MOE_WFMT_F64: b = 8 * r * c; break;
    case MOE_WFMT_F32: b = 4 * r * c; break;
    case MOE_WFMT_F16:
    case MOE_WFMT_BF16: b = 2 * r * c; break;
    case MOE_WFMT_FP8_BLOCK: b = r * c; break;
    case MOE_WFMT_MXFP4:
    case MOE_WFMT_NVFP4: b = r * ((c + 1) / 2); break;
    }
    if (w->scale) b += (uint64_t)w->scale_rows * (uint64_t)w->scale_cols * moe_dtype_size(w->scale_dtype);
    return b;
}

/* E of a block, from its router alone (no expert looked up). */
static moe_status block_experts(moe_model *m, int layer, int n_layers, int *E, moe_error *err) {
    moe_layer *L = NULL;
    moe_status st = layer >= n_layers ? moe_model_mtp_layer_experts(m, layer - n_layers, 0, 0, &L, err)
                                      : moe_model_layer_experts(m, layer, 0, 0, &L, err);
    if (st == MOE_OK) *E = L->cfg.n_experts;
    moe_layer_free(L);
    return st;
}

static void count_held(moe_ep_forward *x, const moe_ep_layer *l) {
    const moe_layer *L = moe_ep_layer_local(l);
    const int E = L->cfg.n_experts;
    x->info.n_blocks++;
    x->info.experts_total += E;
    for (int e = 0; e < E; e++) {
        if (L->w1[e].rows <= 0) continue;
        x->info.experts_held++;
        x->info.routed_bytes += weight_bytes(&L->w1[e]) + weight_bytes(&L->w3[e]) + weight_bytes(&L->w2[e]);
    }
}

moe_status moe_ep_forward_open(moe_fwd *f, int first, int last, bool mtp, MPI_Comm comm, const moe_ep_placement *pl,
                               moe_ep_forward **out, moe_error *err) {
    MOE_ASSERT(f && out);
    *out = NULL;
    const moe_fwd_config *c = moe_fwd_get_config(f);
    moe_model *m = moe_fwd_model(f);
    moe_ep_forward *x = moe_calloc(1, sizeof *x);
    if (!x) return moe_errf(err, MOE_ERR_NOMEM, "out of memory"); /* before any collective, as moe_ep_layer_open */
    x->comm = MPI_COMM_NULL;
    int rc = MPI_Comm_dup(comm, &x->comm);
    if (rc != MPI_SUCCESS) {
        free(x);
        return moe_mpi_fail(err, rc, "MPI_Comm_dup");
    }
    MPI_Comm_set_errhandler(x->comm, MPI_ERRORS_RETURN);
    MPI_Comm_rank(x->comm, &x->rank);
    MPI_Comm_size(x->comm, &x->size);
    x->n_slots = c->n_layers + c->n_mtp;
    x->H = c->hidden;

    moe_error e = {""};
    moe_status st = MOE_OK;
    if (first < 0 || last >= c->n_layers || first > last)
        st = moe_errf(&e, MOE_ERR_ARG, "layers %d..%d are out of range: the model has %d layers (0..%d)", first, last,
                      c->n_layers, c->n_layers - 1);
    else if (mtp && c->n_mtp < 1)
        st = moe_errf(&e, MOE_ERR_MISSING, "the checkpoint has no MTP block (no tensor mtp.0.e_proj.weight)");
    if (st == MOE_OK) {
        x->layer = moe_calloc((size_t)x->n_slots, sizeof *x->layer);
        x->counts = moe_calloc((size_t)x->size, sizeof *x->counts);
        x->displs = moe_calloc((size_t)x->size, sizeof *x->displs);
        if (!x->layer || !x->counts || !x->displs) st = moe_errf(&e, MOE_ERR_NOMEM, "out of memory");
    }
    if (st == MOE_OK) {
        if (MPI_Type_contiguous(x->H, MPI_DOUBLE, &x->row) != MPI_SUCCESS)
            st = moe_errf(&e, MOE_ERR_IO, "MPI_Type_contiguous failed");
        else {
            MPI_Type_commit(&x->row);
            x->row_ok = true;
        }
    }
    /* E from the first block; the placement is every block's */
    int E = 0;
    if (st == MOE_OK) st = block_experts(m, first, c->n_layers, &E, &e);
    st = moe_mpi_agree(x->comm, st, &e);
    moe_ep_placement own = {0, 0, NULL};
    if (st == MOE_OK && !pl) {
        st = moe_mpi_agree(x->comm, moe_ep_placement_contiguous(E, x->size, &own, &e), &e);
        pl = &own;
    }
    for (int li = first; st == MOE_OK && li <= last + (mtp ? 1 : 0); li++) {
        const int slot = li > last ? c->n_layers : li; /* MTP block 0 after the last layer */
        moe_layer_kind kind = MOE_LAYER_TOPK;
        if (slot < c->n_layers) st = moe_mpi_agree(x->comm, moe_model_layer_kind(m, slot, &kind, &e), &e);
        if (st != MOE_OK || kind == MOE_LAYER_DENSE) continue;
        st = moe_ep_layer_open(m, slot, x->comm, pl, &x->layer[slot], &e);
        if (st == MOE_OK) count_held(x, x->layer[slot]);
    }
    moe_ep_placement_free(&own);
    if (st != MOE_OK) {
        moe_ep_forward_free(x);
        if (err) *err = e;
        return st;
    }
    *out = x;
    return MOE_OK;
}

/* FNV-1a over 64-bit words: the block's input as this rank computed it. */
static uint64_t input_hash(int layer, const double *x, const int64_t *ids, int64_t T, int H, const moe_run_opts *o) {
    uint64_t h = 1469598103934665603ull;
    const uint64_t p = 1099511628211ull;
    h = (h ^ (uint64_t)layer) * p;
    h = (h ^ (uint64_t)T) * p;
    h = (h ^ ((uint64_t)o->precision | (uint64_t)o->act << 8 | (uint64_t)o->owner << 16)) * p;
    for (int64_t i = 0; i < T * (int64_t)H; i++) {
        uint64_t w;
        memcpy(&w, &x[i], sizeof w);
        h = (h ^ w) * p;
    }
    for (int64_t t = 0; ids && t < T; t++) h = (h ^ (uint64_t)ids[t]) * p;
    return h;
}

static void add_stats(moe_ep_stats *a, const moe_ep_stats *s) {
    a->route_s += s->route_s;
    a->dispatch_s += s->dispatch_s;
    a->compute_s += s->compute_s;
    a->combine_s += s->combine_s;
    a->wait_s += s->wait_s;
    a->total_s += s->total_s;
    a->bytes_sent += s->bytes_sent;
    a->bytes_recv += s->bytes_recv;
    a->dispatch_bytes_sent += s->dispatch_bytes_sent;
    a->tokens += s->tokens;
    a->assign_remote += s->assign_remote;
    a->assign_in += s->assign_in;
    a->rows_remote += s->rows_remote;
    a->rounds += s->rounds;
}

/* moe_fwd_moe_fn: one MoE block of the forward, expert-parallel. */
static moe_status ep_moe(void *ctx, const moe_layer *L, const double *x, const int64_t *ids, int64_t T,
                         const moe_run_opts *o, double *out, moe_error *err) {
    moe_ep_forward *F = ctx;
    moe_error e = {""};
    moe_status ls = MOE_OK;
    const int li = L->index;
    moe_ep_layer *l = li >= 0 && li < F->n_slots ? F->layer[li] : NULL;
    if (!l)
        ls = moe_errf(&e, MOE_ERR_ARG, "layer %d: its experts were not opened for expert parallelism "
                      "(outside moe_ep_forward_open's layers)", li);
    int64_t t0 = 0, Tl = 0;
    moe_mpi_split(T, F->size, F->rank, &t0, &Tl);
    if (ls == MOE_OK && T > (int64_t)INT32_MAX)
        ls = moe_errf(&e, MOE_ERR_UNSUPPORTED, "layer %d: a chunk of %lld tokens is over the MPI count limit", li,
                      (long long)T);
    moe_block_out bo;
    memset(&bo, 0, sizeof bo);
    if (ls == MOE_OK) ls = moe_block_out_init(&bo, moe_ep_layer_local(l), Tl, o, &e);
    moe_status st = moe_mpi_agree(F->comm, ls, &e);
    if (st == MOE_OK) {
        bool same = false;
        st = moe_mpi_same_u64(F->comm, input_hash(li, x, ids, T, F->H, o), &same, &e);
        if (st == MOE_OK && !same)
            st = moe_errf(&e, MOE_ERR_INVARIANT, "layer %d: the ranks computed different MoE inputs (%lld tokens): "
                          "the replicated dense layers must agree bit for bit (the same build, CPU kernels and "
                          "options on every rank)", li, (long long)T);
    }
    moe_ep_stats s;
    memset(&s, 0, sizeof s);
    if (st == MOE_OK) st = moe_ep_block_run(l, x + t0 * F->H, ids ? ids + t0 : NULL, Tl, o, &bo, &s, &e);
    if (st == MOE_OK) {
        for (int r = 0; r < F->size; r++) {
            int64_t b, n;
            moe_mpi_split(T, F->size, r, &b, &n);
            F->counts[r] = (int)n;
            F->displs[r] = (int)b;
        }
        int rc = MPI_Allgatherv(bo.moe_out, (int)Tl, F->row, out, F->counts, F->displs, F->row, F->comm);
        if (rc != MPI_SUCCESS) st = moe_mpi_fail(&e, rc, "MPI_Allgatherv (MoE output rows)");
    }
    if (st == MOE_OK) {
        add_stats(&F->info.sum, &s);
        F->info.calls++;
    }
    F->agreed = st != MOE_OK; /* every step above ends the same way on every rank */
    moe_block_out_free(&bo);
    if (st != MOE_OK && err) *err = e;
    return st;
}

void moe_ep_forward_attach(moe_ep_forward *x, moe_fwd_opts *o) {
    MOE_ASSERT(x && o);
    o->moe = ep_moe;
    o->moe_ctx = x;
    o->moe_external_experts = true;
}

moe_status moe_ep_forward_settle(moe_ep_forward *x, moe_status st, moe_error *err) {
    MOE_ASSERT(x);
    if (st != MOE_OK && x->agreed) {
        x->agreed = false;
        return st;
    }
    x->agreed = false;
    return moe_mpi_agree(x->comm, st, err);
}

void moe_ep_forward_get_info(const moe_ep_forward *x, moe_ep_forward_info *info) {
    MOE_ASSERT(x && info);
    *info = x->info;
}

const moe_ep_layer *moe_ep_forward_layer(const moe_ep_forward *x, int layer) {
    MOE_ASSERT(x);
    return layer >= 0 && layer < x->n_slots ? x->layer[layer] : NULL;
}
