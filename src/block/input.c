/*
 * A block's input from a file (moeaudit.h: moe_block_input_read): the one
 * reader `run --input` and the fuzzers use, so that what is fuzzed is what
 * runs.
 */
#include "core/core.h"

#include <math.h>
#include <string.h>

void moe_block_input_free(moe_block_input *in) {
    if (!in) return;
    free(in->hidden);
    free(in->ids);
    memset(in, 0, sizeof *in);
}

moe_status moe_block_input_read(const moe_st_file *f, const char *hidden_name, const char *ids_name, int H,
                                moe_block_input *in, moe_error *err) {
    MOE_ASSERT(f && hidden_name && in && H >= 1);
    memset(in, 0, sizeof *in);
    in->first_nonfinite = -1;
    int64_t sh[2] = {-1, H};
    moe_status st = moe_st_read_f64(f, hidden_name, 2, sh, &in->hidden, err);
    if (st != MOE_OK) return st;
    in->T = sh[0];
    in->H = H;
    if (in->T == 0) {
        moe_block_input_free(in);
        return moe_errf(err, MOE_ERR_INPUT, "%s: tensor \"%s\" has 0 tokens", moe_st_path(f), hidden_name);
    }
    for (int64_t t = 0; t < in->T; t++)
        for (int h = 0; h < H; h++)
            if (!isfinite(in->hidden[t * H + h])) {
                if (in->first_nonfinite < 0) in->first_nonfinite = t;
                in->n_nonfinite++;
                break;
            }
    const moe_st_tensor *it = ids_name ? moe_st_find(f, ids_name) : NULL;
    if (it) {
        if (it->dtype != MOE_DTYPE_I32 && it->dtype != MOE_DTYPE_I64) {
            st = moe_errf(err, MOE_ERR_DTYPE, "%s: tensor \"%s\" has dtype %s; expected I32 or I64", moe_st_path(f),
                          ids_name, moe_dtype_name(it->dtype));
        } else {
            int64_t si[1] = {in->T};
            st = moe_st_read_i64(f, ids_name, 1, si, &in->ids, err);
        }
    }
    if (st != MOE_OK) moe_block_input_free(in);
    return st;
}
