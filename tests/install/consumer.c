/*
 * An external program, built against an installed moeaudit (find_package:
 * shared and static; pkg-config: shared and static) or with moeaudit as a
 * subproject (add_subdirectory): the public header only. It opens the
 * checkpoint given, runs layer 3's MoE block on 4 tokens with the contract
 * checked, and prints one line that every build must print alike.
 */
#include <moeaudit.h>

#include <math.h>
#include <stdio.h>
#include <stdlib.h>

int main(int argc, char **argv) {
    if (argc != 2) {
        fprintf(stderr, "usage: consumer CHECKPOINT_DIR\n");
        return 2;
    }
    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(argv[1], &m, &err);
    if (st != MOE_OK) {
        fprintf(stderr, "consumer: %s: %s\n", moe_status_str(st), err.msg);
        return 1;
    }
    const moe_layer *L = NULL;
    st = moe_model_layer(m, 3, &L, &err);
    enum { T = 4 };
    int H = L ? L->cfg.hidden : 0;
    double *x = malloc(sizeof(double) * T * (size_t)(H + 1));
    int64_t ids[T] = {0, 1, 2, 3};
    for (int i = 0; x && i < T * H; i++) x[i] = sin(0.37 * i);
    moe_run_opts o = moe_run_opts_default();
    o.check_invariants = true;
    moe_block_out out;
    if (st == MOE_OK) st = moe_block_out_init(&out, L, T, &o, &err);
    if (st == MOE_OK) {
        st = moe_block_run(L, x, ids, T, &o, &out, &err);
        if (st == MOE_OK)
            printf("moeaudit %s: layer 3, %d tokens, expert %d first, moe_out[0] = %.17g\n", MOEAUDIT_VERSION, T,
                   out.topk_ids[0], out.moe_out[0]);
        moe_block_out_free(&out);
    }
    if (st != MOE_OK) fprintf(stderr, "consumer: %s: %s\n", moe_status_str(st), err.msg);
    free(x);
    moe_model_free(m);
    return st == MOE_OK ? 0 : 1;
}
