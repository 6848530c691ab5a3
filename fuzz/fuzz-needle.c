/*
 * libFuzzer target: `needle --tensors`, the indexer tensors file
 * (moe_idx_tensors_read: q [T, heads, dim], k [S, dim], w [T, heads], pos
 * [T]) and the recall run over it (moe_idx_recall_run: float64 scores,
 * engine scores per precision, top-k selection). The first byte picks the
 * compression ratio (1..8) and index_topk (1..16); the rest is the
 * safetensors file, parsed in memory.
 *
 * Properties: a failure has a message; recall is in [0, 1] (or NaN where no
 * query counted) for every precision.
 */
#include "fuzz.h"
#include "moeaudit_indexer.h"

#include <math.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    int ratio = 1 + (data[0] & 7), topk = 1 + (data[0] >> 4);
    uint8_t *buf = malloc(size);
    if (!buf) return 0;
    memcpy(buf, data + 1, size - 1);
    moe_st_file *f = NULL;
    moe_error err = {{0}};
    moe_status st = moe_st_open_buffer(buf, size - 1, "fuzz-needle", &f, &err);
    if (st == MOE_OK) {
        moe_idx_tensors it;
        st = moe_idx_tensors_read(f, ratio, &it, &err);
        if (st != MOE_OK && err.msg[0] == '\0') abort();
        /* bounded work per input */
        if (st == MOE_OK && it.sh.T * it.sh.S <= 4096 && it.sh.T * it.sh.heads * it.sh.dim <= 65536) {
            moe_idx_opts precs[3];
            precs[0] = moe_idx_opts_default();
            precs[1] = moe_idx_opts_default();
            precs[1].q_quant = precs[1].k_quant = MOE_IDX_Q_FP8;
            precs[1].accum = MOE_IDX_ACC_BF16;
            precs[2] = moe_idx_opts_default();
            precs[2].q_quant = precs[2].k_quant = MOE_IDX_Q_FP4;
            precs[2].hadamard = false;
            moe_idx_recall res[3];
            st = moe_idx_recall_run(&it.sh, it.q, it.k, it.w, it.pos, topk, precs, 3, res, &err);
            if (st != MOE_OK && err.msg[0] == '\0') abort();
            for (int p = 0; st == MOE_OK && p < 3; p++) {
                double r = res[p].mean_recall, m = res[p].min_recall;
                if (!(isnan(r) || (r >= 0 && r <= 1)) || !(isnan(m) || (m >= 0 && m <= 1 && m <= r + 1e-12))) abort();
            }
        }
        if (st == MOE_OK || it.q) moe_idx_tensors_free(&it);
        moe_st_close(f);
    } else if (err.msg[0] == '\0') {
        abort();
    }
    free(buf);
    return 0;
}
