/*
 * Layer-parallel results: every rank serialises what it produced for its
 * layers (opaque rows, or failures with their messages) and the root
 * gathers them into one report, keeping the failures as results.
 *
 * Blob of one rank (little-endian host order; the ranks share a host type):
 *   i32 rank_status, u32 len, rank message bytes,
 *   i32 n_layers, then per layer: i32 layer, i32 status, u32 len, message
 *   bytes, u64 row_len, row bytes.
 *
 * Invariants:
 *  1. Every rank calls the same collectives (agree, MPI_Gather, agree,
 *     MPI_Gatherv) whatever fails locally.
 *  2. The report owns copies of every row and message; entries are sorted by
 *     layer, then rank.
 */
#include "core/core.h"
#include "mpi/mpi_util.h"

#include <limits.h>
#include <string.h>

typedef struct blob {
    unsigned char *p;
    size_t len, cap;
    bool bad;
} blob;

static void put(blob *b, const void *src, size_t n) {
    if (b->bad || n == 0) return;
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? b->cap : 256;
        while (cap < b->len + n) cap *= 2;
        unsigned char *q = realloc(b->p, cap);
        if (!q) { b->bad = true; return; }
        b->p = q;
        b->cap = cap;
    }
    memcpy(b->p + b->len, src, n);
    b->len += n;
}

static void put_i32(blob *b, int32_t v) { put(b, &v, sizeof v); }

static void put_str(blob *b, const char *s) {
    uint32_t n = s ? (uint32_t)strnlen(s, 511) : 0;
    put(b, &n, sizeof n);
    put(b, s, n);
}

static moe_status serialise(const moe_lp_local *mine, blob *b, moe_error *err) {
    put_i32(b, (int32_t)mine->rank_status);
    put_str(b, mine->rank_msg);
    put_i32(b, mine->n_layers);
    for (int i = 0; i < mine->n_layers; i++) {
        moe_status s = mine->status ? mine->status[i] : mine->rank_status;
        put_i32(b, mine->layers[i]);
        put_i32(b, (int32_t)s);
        put_str(b, s != MOE_OK ? (mine->msgs && mine->msgs[i] && mine->msgs[i][0] ? mine->msgs[i] : mine->rank_msg)
                               : NULL);
        uint64_t n = s == MOE_OK && mine->rows ? (uint64_t)mine->row_lens[i] : 0;
        put(b, &n, sizeof n);
        if (n) put(b, mine->rows[i], (size_t)n);
    }
    if (b->bad) return moe_errf(err, MOE_ERR_NOMEM, "out of memory serialising %d layer results", mine->n_layers);
    if (b->len > (size_t)INT_MAX)
        return moe_errf(err, MOE_ERR_UNSUPPORTED, "the results of this rank take %zu bytes: over 2 GiB", b->len);
    return MOE_OK;
}

typedef struct reader {
    const unsigned char *p;
    size_t len, off;
    bool bad;
} reader;

static void get(reader *r, void *dst, size_t n) {
    if (r->bad || r->len - r->off < n) { r->bad = true; memset(dst, 0, n); return; }
    memcpy(dst, r->p + r->off, n);
    r->off += n;
}

static void get_str(reader *r, char *dst, size_t cap) {
    uint32_t n = 0;
    get(r, &n, sizeof n);
    if (r->bad || n >= cap || r->len - r->off < n) { r->bad = true; dst[0] = 0; return; }
    memcpy(dst, r->p + r->off, n);
    dst[n] = 0;
    r->off += n;
}

void moe_lp_report_free(moe_lp_report *rep) {
    if (!rep) return;
    for (int i = 0; i < rep->n_entries; i++) free(rep->entries[i].row);
    free(rep->entries);
    for (int i = 0; i < rep->n_ranks; i++) free(rep->ranks[i].layers);
    free(rep->ranks);
    memset(rep, 0, sizeof *rep);
}

static int entry_cmp(const void *a, const void *b) {
    const moe_lp_entry *x = a, *y = b;
    if (x->layer != y->layer) return x->layer < y->layer ? -1 : 1;
    return (x->rank > y->rank) - (x->rank < y->rank);
}

/* Root: parse the gathered blobs into rep. */
static moe_status parse(const unsigned char *all, const int *sizes, const int *displs, int n_ranks,
                        moe_lp_report *rep, moe_error *err) {
    rep->n_ranks = n_ranks;
    rep->ranks = moe_calloc((size_t)n_ranks, sizeof *rep->ranks);
    if (!rep->ranks) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    int cap = 0;
    for (int s = 0; s < n_ranks; s++) {
        reader r = {all + displs[s], (size_t)sizes[s], 0, false};
        moe_lp_rank *rk = &rep->ranks[s];
        int32_t v = 0, nl = 0;
        get(&r, &v, sizeof v);
        rk->status = (moe_status)v;
        get_str(&r, rk->msg, sizeof rk->msg);
        get(&r, &nl, sizeof nl);
        if (r.bad || nl < 0) return moe_errf(err, MOE_ERR_FORMAT, "rank %d sent a malformed result blob", s);
        rk->n_layers = nl;
        rk->layers = moe_calloc((size_t)nl + 1, sizeof *rk->layers);
        if (!rk->layers) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
        if (rep->n_entries + nl > cap) {
            int nc = cap * 2 > rep->n_entries + nl ? cap * 2 : rep->n_entries + nl + 16;
            moe_lp_entry *ne = realloc(rep->entries, (size_t)nc * sizeof *ne);
            if (!ne) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
            rep->entries = ne;
            cap = nc;
        }
        for (int i = 0; i < nl; i++) {
            moe_lp_entry *en = &rep->entries[rep->n_entries];
            memset(en, 0, sizeof *en);
            int32_t layer = 0, stv = 0;
            uint64_t n = 0;
            get(&r, &layer, sizeof layer);
            get(&r, &stv, sizeof stv);
            get_str(&r, en->msg, sizeof en->msg);
            get(&r, &n, sizeof n);
            if (r.bad || n > r.len - r.off)
                return moe_errf(err, MOE_ERR_FORMAT, "rank %d sent a malformed result blob (layer entry %d)", s, i);
            en->layer = layer;
            en->rank = s;
            en->status = (moe_status)stv;
            rk->layers[i] = layer;
            if (en->status == MOE_OK) {
                en->row = moe_malloc((size_t)n + 1, 1);
                if (!en->row) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
                memcpy(en->row, r.p + r.off, (size_t)n);
                en->row_len = (size_t)n;
            } else {
                rep->n_failed_layers++;
                if (rk->status == MOE_OK) {
                    rk->status = en->status;
                    snprintf(rk->msg, sizeof rk->msg, "layer %d: %.480s", layer, en->msg);
                }
            }
            r.off += (size_t)n;
            rep->n_entries++;
        }
        if (rk->status != MOE_OK) rep->n_failed_ranks++;
    }
    if (rep->n_entries > 1) qsort(rep->entries, (size_t)rep->n_entries, sizeof *rep->entries, entry_cmp);
    return MOE_OK;
}

moe_status moe_lp_gather(MPI_Comm comm, int root, const moe_lp_local *mine, moe_lp_report *rep, moe_error *err) {
    MOE_ASSERT(mine && rep && (mine->n_layers == 0 || mine->layers));
    memset(rep, 0, sizeof *rep);
    int rank = 0, size = 1;
    MPI_Comm_rank(comm, &rank);
    MPI_Comm_size(comm, &size);
    moe_error e = {""};
    blob b = {NULL, 0, 0, false};
    int *sizes = NULL, *displs = NULL;
    unsigned char *all = NULL;
    moe_status st = serialise(mine, &b, &e);
    st = moe_mpi_agree(comm, st, &e);
    if (st != MOE_OK) goto done;
    int mylen = (int)b.len;
    if (rank == root) {
        sizes = moe_calloc((size_t)size, sizeof *sizes);
        displs = moe_calloc((size_t)size, sizeof *displs);
    }
    int rc = MPI_Gather(&mylen, 1, MPI_INT, sizes, 1, MPI_INT, root, comm);
    if (rc != MPI_SUCCESS) { st = moe_mpi_fail(&e, rc, "MPI_Gather (result sizes)"); goto done; }
    moe_status ls = MOE_OK;
    if (rank == root) {
        if (!sizes || !displs) ls = moe_errf(&e, MOE_ERR_NOMEM, "out of memory");
        long long total = 0;
        for (int s = 0; ls == MOE_OK && s < size; s++) {
            displs[s] = (int)total;
            total += sizes[s];
            if (total > INT_MAX)
                ls = moe_errf(&e, MOE_ERR_UNSUPPORTED, "the gathered results exceed 2 GiB (at rank %d)", s);
        }
        if (ls == MOE_OK && !(all = moe_malloc((size_t)total + 1, 1)))
            ls = moe_errf(&e, MOE_ERR_NOMEM, "out of memory for %lld bytes of results", total);
    }
    st = moe_mpi_agree(comm, ls, &e);
    if (st != MOE_OK) goto done;
    rc = MPI_Gatherv(b.p, mylen, MPI_BYTE, all, sizes, displs, MPI_BYTE, root, comm);
    if (rc != MPI_SUCCESS) { st = moe_mpi_fail(&e, rc, "MPI_Gatherv (results)"); goto done; }
    if (rank == root) {
        st = parse(all, sizes, displs, size, rep, &e);
        if (st != MOE_OK) moe_lp_report_free(rep);
    }
done:
    free(b.p);
    free(sizes);
    free(displs);
    free(all);
    if (st != MOE_OK && err) *err = e;
    return st;
}
