/* Loading a linear weight of any storage format into a moe_weight. */
#ifndef MOE_IO_WEIGHTS_H
#define MOE_IO_WEIGHTS_H

#include "moeaudit.h"

/* Load "<base>.weight" (and its scale companions) as a [rows, cols] linear.
 * Recognises BF16/F16/F32/F64 and the quantized layouts of docs/formats.md; a
 * shape or dtype that fits none of them is an error naming the tensor. `name`
 * (kept by the caller for the weight's lifetime) labels the weight. */
moe_status moe_weight_load(moe_ckpt *ck, const char *base, int64_t rows, int64_t cols,
                           moe_weight *w, const char *name, moe_error *err);

#endif
