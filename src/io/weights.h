/* Loading a linear weight of any storage format into a moe_weight. */
#ifndef MOE_IO_WEIGHTS_H
#define MOE_IO_WEIGHTS_H

#include "moeaudit.h"

/* Load "<base>.weight" (and its scale companions), or compressed-tensors'
 * "<base>.weight_packed", as a [rows, cols] linear. Recognises
 * BF16/F16/F32/F64 and the quantized layouts of src/io/weights.c's table; a
 * shape or dtype that fits none of them is an error naming the tensor, and a
 * format that contradicts the checkpoint's declared quantization
 * (io/quant_decl.h) is MOE_ERR_FORMAT naming both. `name` (kept by the
 * caller for the weight's lifetime) labels the weight. */
moe_status moe_weight_load(moe_ckpt *ck, const char *base, int64_t rows, int64_t cols,
                           moe_weight *w, const char *name, moe_error *err);

/* A view of expert e's rows [row0, row0 + rows) of a stacked plain-float
 * tensor `tname` [E, R, cols] (transformers' gate_up_proj [E, 2I, H] and
 * down_proj [E, H, I]); base names the module for the declaration check.
 * Quantized stacked tensors are MOE_ERR_UNSUPPORTED. */
moe_status moe_weight_view_stacked(moe_ckpt *ck, const char *tname, const char *base, int64_t e, int64_t row0,
                                   int64_t rows, int64_t cols, moe_weight *w, const char *name, moe_error *err);

/* The check moe_weight_load ends with: w's format against what the
 * checkpoint declares for module `base`. */
moe_status moe_weight_check_declared(moe_ckpt *ck, const char *base, const moe_weight *w, moe_error *err);

#endif
