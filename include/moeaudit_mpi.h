/*
 * moeaudit over MPI: expert parallelism (EP) and layer-parallel gathering.
 *
 * Worked example: N ranks run layer 3 with the routed experts spread over
 * them; each rank passes its own slice of the tokens.
 *
 *     MPI_Init(&argc, &argv);                       // the caller's job
 *     int rank, n; MPI_Comm_rank(MPI_COMM_WORLD, &rank); MPI_Comm_size(MPI_COMM_WORLD, &n);
 *     moe_model *m; moe_model_open(dir, &m, &err);  // every rank opens the model
 *     moe_ep_placement pl;
 *     moe_ep_placement_contiguous(E, n, &pl, &err); // or moe_ep_placement_read
 *     moe_ep_layer *l;                              // collective: maps only this
 *     moe_ep_layer_open(m, 3, MPI_COMM_WORLD, &pl, &l, &err); // rank's experts
 *     int64_t t0, Tl; moe_mpi_split(T, n, rank, &t0, &Tl);
 *     moe_block_out out;
 *     moe_block_out_init(&out, moe_ep_layer_local(l), Tl, &o, &err);
 *     moe_ep_block_run(l, hidden + t0 * H, ids + t0, Tl, &o, &out, &stats, &err);
 *     // out holds this rank's tokens, bit-identical to moe_block_run's rows
 *     moe_ep_layer_free(l); moe_ep_placement_free(&pl); moe_model_free(m);
 *     MPI_Finalize();
 *
 * Conventions (those of moeaudit.h): moe_status + a message; the library
 * never prints, exits, or calls MPI_Init/MPI_Finalize. Functions marked
 * COLLECTIVE must be called by every rank of the communicator with the same
 * layer, placement and options. They never hang on a local failure: each
 * rank's status is agreed (MPI_Allreduce) before any collective that could
 * block, and every rank then returns the same status and the message of the
 * lowest failing rank, prefixed "rank R: ".
 *
 * Build: this header and the functions below exist when the project was
 * built with MPI (CMake defines MOE_HAVE_MPI for targets that link
 * moeaudit_mpi).
 */
#ifndef MOEAUDIT_MPI_H
#define MOEAUDIT_MPI_H

#include "moeaudit.h"
#include "moeaudit_model.h"

#include <mpi.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Contiguous split of n items over `parts` parts: part p gets [*begin,
 * *begin + *count); the first n % parts parts get one item more. Used for
 * tokens (each rank is home for a slice), experts and layers. A part may be
 * empty (n < parts). */
void moe_mpi_split(int64_t n, int parts, int part, int64_t *begin, int64_t *count);

/* COLLECTIVE. Agree on a status: every rank passes its own (st, *err) and
 * every rank returns the status of the lowest failing rank, err->msg becoming
 * that rank's message prefixed "rank R: " (the failing rank's too). Returns
 * MOE_OK with err untouched when every rank passed MOE_OK. Call it before
 * any collective that a failed rank could not take part in. */
moe_status moe_mpi_agree(MPI_Comm comm, moe_status st, moe_error *err);

/* ------------------------------------------------------------- placement */

/* Which rank holds each routed expert. */
typedef struct moe_ep_placement {
    int n_experts;   /* E */
    int n_ranks;     /* N: the size of the communicator it is used with */
    int32_t *owner;  /* [E] rank of expert e, in [0, N) */
} moe_ep_placement;

/* Contiguous ranges: rank r holds moe_mpi_split(E, N, r). N may exceed E
 * (ranks without experts still route, dispatch and combine their tokens). */
moe_status moe_ep_placement_contiguous(int n_experts, int n_ranks, moe_ep_placement *pl, moe_error *err);

/* Read a placement file, either
 *   text: one "EXPERT RANK" pair per line ('#' starts a comment), or
 *   JSON: an array [rank of expert 0, rank of expert 1, ...], or an object
 *         {"expert_to_rank": [...]}.
 * Every expert in [0, n_experts) must appear exactly once with a rank in
 * [0, n_ranks) (MOE_ERR_FORMAT naming the file and line or index otherwise;
 * MOE_ERR_IO when unreadable). */
moe_status moe_ep_placement_read(const char *path, int n_experts, int n_ranks, moe_ep_placement *pl,
                                 moe_error *err);
/* The same parse over text [len] held in memory (`label` names it in
 * messages; NULL: "<placement>"); a NUL byte in it is MOE_ERR_FORMAT. The
 * file is read through the library's untrusted-file rules (a FIFO or
 * directory is refused before any read; at most 64 MiB). */
moe_status moe_ep_placement_parse(const char *text, size_t len, const char *label, int n_experts, int n_ranks,
                                  moe_ep_placement *pl, moe_error *err);
void moe_ep_placement_free(moe_ep_placement *pl); /* NULL and zeroed are no-ops */
/* Number of experts placed on `rank`. */
int moe_ep_placement_count(const moe_ep_placement *pl, int rank);

/* ------------------------------------------------- expert-parallel layer */

/* One rank's share of one MoE layer: router, correction bias, tid2eid and
 * shared expert (every rank), and the routed experts the placement gives it
 * (each maximal contiguous run of owned experts is mapped with
 * moe_model_layer_experts; nothing else is touched). Holds a duplicate of
 * the communicator. */
typedef struct moe_ep_layer moe_ep_layer;

/* COLLECTIVE. Load this rank's share of `layer` (0 .. n_layers - 1, or
 * n_layers + k for DeepSeek V4's MTP block k). The placement must have
 * n_ranks == size of comm and n_experts == the layer's E (MOE_ERR_ARG).
 * A rank whose shard is missing or invalid fails with the reader's message
 * (naming the shard file and tensor) after what it was loading ("layer 2,
 * experts 4..7 of 8: "), and every rank returns that status.
 * `m` stays owned by the caller and must outlive *out. */
moe_status moe_ep_layer_open(moe_model *m, int layer, MPI_Comm comm, const moe_ep_placement *pl,
                             moe_ep_layer **out, moe_error *err);
/* Not collective (frees the duplicated communicator with MPI_Comm_free,
 * which is collective in MPI terms: call it on every rank). NULL: no-op. */
void moe_ep_layer_free(moe_ep_layer *l);
/* The rank-local layer descriptor: its cfg is the full layer's; w1/w3/w2
 * entries of experts held elsewhere have rows = 0. Use it for
 * moe_block_out_init and moe_block_check, never for moe_block_run. Owned by l. */
const moe_layer *moe_ep_layer_local(const moe_ep_layer *l);
const moe_ep_placement *moe_ep_layer_placement(const moe_ep_layer *l); /* a copy owned by l */
/* Home tokens per rank per dispatch round (default MOE_EP_ROUND); the same
 * on every rank (moe_ep_block_run fails with MOE_ERR_ARG otherwise). Outputs
 * do not depend on it; memory and message sizes do. */
void moe_ep_layer_set_round(moe_ep_layer *l, int64_t tokens);
/* Benchmarks: an MPI_Barrier before each exchange, so that dispatch_s and
 * combine_s time the transfers alone and load imbalance goes to wait_s.
 * Off by default. */
void moe_ep_layer_set_timing_barriers(moe_ep_layer *l, bool on);

/* Time and traffic of one moe_ep_block_run on one rank. Times are wall
 * seconds (MPI_Wtime); a rank waiting for slower ones accrues the wait in
 * the collective's phase. Bytes count what crosses between ranks (payloads
 * to and from this rank itself excluded). */
typedef struct moe_ep_stats {
    double route_s;        /* router logits + top-k of the home tokens */
    double dispatch_s;     /* pack, MPI_Alltoall counts, agree, MPI_Alltoallv ids + hidden rows */
    double compute_s;      /* routed experts held here (for every rank's tokens) + shared expert */
    double combine_s;      /* MPI_Alltoallv of expert outputs back + the per-token combine */
    double wait_s;         /* in timing barriers (moe_ep_layer_set_timing_barriers), else 0 */
    double total_s;
    uint64_t bytes_sent;   /* to other ranks: dispatch (8 B per assignment + hidden rows) + outputs back */
    uint64_t bytes_recv;
    uint64_t dispatch_bytes_sent; /* the dispatch part of bytes_sent */
    int64_t tokens;        /* home tokens of this rank */
    int64_t assign_remote; /* (token, column) pairs of home tokens computed on other ranks */
    int64_t assign_in;     /* (token, column) pairs computed here, from any rank */
    int64_t rows_remote;   /* hidden rows sent to other ranks (one per token and destination rank) */
    int rounds;            /* dispatch rounds (moe_ep_layer_set_round tokens per rank each) */
} moe_ep_stats;

/* Home tokens per rank per dispatch round: bounds the receive buffers at
 * N * MOE_EP_ROUND * K rows of H whatever T is. */
#define MOE_EP_ROUND 256

/*
 * COLLECTIVE. Run the block on this rank's home tokens with the routed
 * experts spread over the ranks.
 *   hidden  double [T_local, H]; input_ids int64 [T_local] (hash layers) or NULL
 *   out     initialised with moe_block_out_init(out, moe_ep_layer_local(l), T_local, o)
 *   stats   may be NULL
 * Each rank routes its own tokens (the same code as moe_block_run), sends each
 * token's hidden row once to every rank that holds one of its experts
 * (MPI_Alltoall counts, MPI_Alltoallv payloads: (row, expert) pairs and
 * rows), the holders run their experts grouped by expert and send each
 * (token, column) output back unreduced; the home rank combines the K
 * columns in column order, adds the shared expert and applies the scaling
 * contract once. Every output row equals, bit for bit, the row
 * moe_block_run gives for that token (any N, any placement, either
 * precision). T_local may be 0 on some or all ranks. The options must be
 * the same on every rank (MOE_ERR_ARG otherwise); input errors name the
 * global token index (ranks' slices taken in rank order). The layer keeps
 * its round buffers between calls (freed by moe_ep_layer_free). Thread
 * safety: one call at a time per layer (it is a collective on its
 * communicator).
 */
moe_status moe_ep_block_run(moe_ep_layer *l, const double *hidden, const int64_t *input_ids, int64_t T_local,
                            const moe_run_opts *o, moe_block_out *out, moe_ep_stats *stats, moe_error *err);

/* COLLECTIVE. One-shot form: open the layer share, initialise *out for
 * T_local tokens (free it with moe_block_out_free, also after a failure:
 * it is zeroed then), run, free the share. pl NULL: contiguous ranges. */
moe_status moe_block_run_ep(moe_model *m, int layer, const double *hidden, const int64_t *input_ids,
                            int64_t T_local, const moe_run_opts *o, moe_block_out *out, MPI_Comm comm,
                            const moe_ep_placement *pl, moe_ep_stats *stats, moe_error *err);

/* -------------------------------- the whole-model forward, expert-parallel */

/*
 * Worked example: `mpirun -np N` processes run one DeepSeek-V4 forward with
 * every layer's routed experts spread over them.
 *
 *     moe_fwd *f; moe_fwd_open(dir, &f, &err);         // every rank
 *     moe_fwd_opts o = moe_fwd_opts_default(f);
 *     moe_ep_forward *x;                               // collective: this rank's
 *     moe_ep_forward_open(f, 0, n_layers - 1, false, MPI_COMM_WORLD, NULL, &x, &err);
 *     moe_ep_forward_attach(x, &o);                    // o.moe = the EP block
 *     moe_fwd_state *s; moe_fwd_state_init(f, &o, &s, &err);
 *     st = moe_fwd_run(f, s, ids, T, NULL, &err);      // every rank, all T tokens
 *     st = moe_ep_forward_settle(x, st, &err);         // after every run
 *     // every rank's sink saw the single process's tensors, bit for bit
 *     moe_fwd_state_free(s); moe_ep_forward_free(x); moe_fwd_free(f);
 *
 * Every rank runs the dense parts (embedding, attention, mHC, norms, head)
 * on all tokens, identically; at each MoE block rank r is home for the rows
 * moe_mpi_split(T, N, r), which moe_ep_block_run routes, dispatches to the
 * experts' holders and combines, and the output rows are then gathered on
 * every rank (MPI_Allgatherv). Before each block the ranks check that they
 * computed the same input (a hash of x, ids and T): replicated arithmetic
 * that diverged (different builds or CPU kernels) fails with
 * MOE_ERR_INVARIANT instead of mixing two forwards.
 *
 * Memory per rank: the dense tensors (mapped as the single process maps
 * them), each opened block's router, bias, tid2eid and shared expert, and
 * the routed experts the placement gives it; the forward driver never looks
 * up another rank's expert (moe_fwd_opts.moe_external_experts), so their
 * pages are never touched (docs/performance-mpi.md has the bytes at
 * V4-Flash shapes).
 */
typedef struct moe_ep_forward moe_ep_forward;

/* COLLECTIVE. Open this rank's share of the MoE blocks of layers [first,
 * last] and, with mtp, of MTP block 0 (layer index n_layers): one
 * moe_ep_layer_open per block with placement pl (NULL: contiguous ranges of
 * the blocks' E experts). A rank that cannot load its share (a missing
 * shard of its experts) makes every rank fail with "rank R: layer L,
 * experts A..B of E: <the reader's message naming shard and tensor>" ("expert A
 * of E" for one).
 * MOE_ERR_ARG for a layer range outside the model; MOE_ERR_MISSING for mtp
 * without an MTP block. f must outlive *out; *out is caller-owned. */
moe_status moe_ep_forward_open(moe_fwd *f, int first, int last, bool mtp, MPI_Comm comm, const moe_ep_placement *pl,
                               moe_ep_forward **out, moe_error *err);
/* Frees the duplicated communicators (collective in MPI terms: call it on
 * every rank). NULL: no-op. */
void moe_ep_forward_free(moe_ep_forward *x);

/* Set o->moe, o->moe_ctx and o->moe_external_experts: the forward then runs
 * its MoE blocks through x and never maps a routed expert itself. Runs of
 * layers outside x's range fail with MOE_ERR_ARG (on every rank). */
void moe_ep_forward_attach(moe_ep_forward *x, moe_fwd_opts *o);

/* COLLECTIVE. Call after every moe_fwd_run whose options x is attached to,
 * with its status: every rank returns the same status and, on failure, the
 * message of the lowest failing rank ("rank R: ..."). A rank that failed
 * outside a MoE block (its sink, its dense tensors, memory) is learned by
 * the others here or at their next MoE block, never waited for. */
moe_status moe_ep_forward_settle(moe_ep_forward *x, moe_status st, moe_error *err);

/* This rank's share and work so far. */
typedef struct moe_ep_forward_info {
    int n_blocks;             /* MoE blocks opened */
    int64_t experts_total;    /* (block, expert) pairs of those blocks */
    int64_t experts_held;     /* (block, expert) pairs whose tensors this rank holds */
    uint64_t routed_bytes;    /* their stored bytes (weights and scales) */
    int64_t calls;            /* MoE calls run (blocks x chunks) */
    moe_ep_stats sum;         /* moe_ep_block_run's stats summed over the calls */
} moe_ep_forward_info;
void moe_ep_forward_get_info(const moe_ep_forward *x, moe_ep_forward_info *info);
/* The share of block `layer` (n_layers: MTP block 0), or NULL when not opened. Owned by x. */
const moe_ep_layer *moe_ep_forward_layer(const moe_ep_forward *x, int layer);

/* ------------------------------------------ layer-parallel result gather */

/* One layer's result as produced on some rank: an opaque row (the audit's
 * serialized report row), or a failure. */
typedef struct moe_lp_entry {
    int layer;
    int rank;              /* the rank that produced it */
    moe_status status;     /* MOE_OK: row is valid */
    char msg[512];         /* failure message ("" when ok) */
    void *row;             /* [row_len] bytes, owned by the report; NULL when failed */
    size_t row_len;
} moe_lp_entry;

/* A rank's overall state: status != MOE_OK when the rank failed as a whole
 * (could not open the model, out of memory) or any of its layers failed; msg
 * is its first failure. */
typedef struct moe_lp_rank {
    moe_status status;
    char msg[512];
    int n_layers;
    int *layers;           /* [n_layers] the layers it was given, ascending as given */
} moe_lp_rank;

typedef struct moe_lp_report {
    int n_entries;
    moe_lp_entry *entries; /* [n_entries] sorted by layer (then rank) */
    int n_ranks;
    moe_lp_rank *ranks;    /* [n_ranks] */
    int n_failed_layers;   /* entries with status != MOE_OK */
    int n_failed_ranks;
} moe_lp_report;

/* What one rank contributes: its layers and, for each, a status, a message
 * and a row (ignored unless ok). rank_status != MOE_OK marks the whole rank
 * failed (then n_layers entries may all be failures with rank_msg). */
typedef struct moe_lp_local {
    moe_status rank_status;
    const char *rank_msg;         /* NULL or "" when ok */
    int n_layers;
    const int *layers;            /* [n_layers] */
    const moe_status *status;     /* [n_layers] */
    const char *const *msgs;      /* [n_layers] NULL or "" when ok; may be NULL when all ok */
    const void *const *rows;      /* [n_layers] */
    const size_t *row_lens;       /* [n_layers] */
} moe_lp_local;

/* COLLECTIVE. Gather every rank's layer results to `root` (MPI_Gather of
 * sizes, MPI_Gatherv of a serialised blob per rank). On root, *rep is
 * filled (free with moe_lp_report_free); elsewhere it is zeroed. A rank's
 * failures are results, not errors: the call fails only for MPI or memory
 * errors, or results over 2 GiB (MOE_ERR_UNSUPPORTED), on every rank; except
 * that a failure while the root parses (out of memory, a malformed blob) is
 * returned by the root alone, after the last collective. */
moe_status moe_lp_gather(MPI_Comm comm, int root, const moe_lp_local *mine, moe_lp_report *rep, moe_error *err);
void moe_lp_report_free(moe_lp_report *rep);

#ifdef __cplusplus
}
#endif
#endif /* MOEAUDIT_MPI_H */
