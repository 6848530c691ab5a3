/* `moeaudit forward` (tools/cmd_forward.c): the whole DeepSeek-V4 model. */
#ifndef MOE_CMD_FORWARD_H
#define MOE_CMD_FORWARD_H

#include "moeaudit_model.h"

/* argv[0] = "forward". Returns an exit code: 0 ok, 1 failure, 2 usage or input error. */
int moe_cmd_forward(int argc, char **argv);

/* A parallel driver's part in `forward` (`forward --ep N`: tools/cmd_forward_ep.c),
 * so that the command itself knows nothing of MPI. Rank 0 reads the input,
 * prints and writes --output; every rank opens the model and runs the
 * forward. The collective hooks are called by every rank at the same points. */
typedef struct moe_fwd_par {
    int rank, size;
    void *ctx;
    /* Every rank's status agreed: the lowest failing rank's, with its message. */
    moe_status (*agree)(void *ctx, moe_status st, moe_error *err);
    /* n bytes of rank 0's buf to every rank. */
    moe_status (*bcast)(void *ctx, void *buf, size_t n, moe_error *err);
    /* Before the first run: plug the parallel MoE into *o for the blocks of
     * layers first .. o->last_layer (and o->mtp's). Status agreed. */
    moe_status (*attach)(void *ctx, moe_fwd *f, moe_fwd_opts *o, int first, moe_error *err);
    /* After every moe_fwd_run, with its status: returns the agreed one. */
    moe_status (*settle)(void *ctx, moe_status st, moe_error *err);
    /* After a successful run: the parallel summary (rank 0 prints). */
    void (*report)(void *ctx, moe_fwd *f);
    /* Before the model is freed: drop what attach opened (every rank). */
    void (*release)(void *ctx);
} moe_fwd_par;

/* moe_cmd_forward with a parallel driver (NULL: one process). */
int moe_cmd_forward_par(int argc, char **argv, const moe_fwd_par *par);

#endif
