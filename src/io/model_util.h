/*
 * Internal helpers shared by the model loader (src/io/model.c) and the
 * modules that read their own keys and tensors from a model (src/hc,
 * src/indexer): config.json numbers and float tensors widened to double.
 *
 * Status codes, the same for every caller:
 *   MOE_ERR_MISSING  a required config key is absent (or null); a tensor
 *                    that is not in the checkpoint (moe_model_find's code)
 *   MOE_ERR_CONFIG   a config key is present but not a number of the
 *                    accepted kind and range
 *   MOE_ERR_DTYPE    a tensor whose dtype is not F64, F32, F16 or BF16
 *   MOE_ERR_SHAPE    a tensor whose shape is not the expected one
 *   MOE_ERR_NOMEM    allocation failed (the _alloc variant only)
 * Messages name the file (`path`, or the checkpoint directory), the key or
 * tensor, and the value at fault.
 */
#ifndef MOE_IO_MODEL_UTIL_H
#define MOE_IO_MODEL_UTIL_H

#include "moeaudit.h"

#include <cjson/cJSON.h>
#include <stdbool.h>
#include <stdint.h>

/* Integer key `key` of the config object `cfg` (read from `path`, which
 * labels messages: a file path or "config.json") into *out.
 * Absent or null: MOE_ERR_MISSING when `required`, else *out = def. Present:
 * an integral number in [lo, hi], else MOE_ERR_CONFIG. *out is untouched on
 * error. Defined in src/io/model_util.c. */
moe_status moe_cfg_int(const cJSON *cfg, const char *path, const char *key, bool required, int def, int lo,
                       int hi, int *out, moe_error *err);

/* Number key, as moe_cfg_int: a present value must be a finite number >= lo
 * (lo = -INFINITY: any finite number), else MOE_ERR_CONFIG. */
moe_status moe_cfg_num(const cJSON *cfg, const char *path, const char *key, bool required, double def,
                       double lo, double *out, moe_error *err);

/* Find tensor `name` through moe_model_find (so with or without the "model."
 * prefix), check that its dtype is a float type and its shape is exactly
 * shape [ndim], and widen it into dst [product(shape)] (row-major), which
 * the caller owns. On error dst is untouched. Defined in src/io/model.c. */
moe_status moe_model_load_f64(moe_model *m, const char *name, int ndim, const int64_t *shape, double *dst,
                              moe_error *err);

/* The same into a new buffer: *out (caller frees) on MOE_OK, untouched on
 * error. The tensor is found and checked before anything is allocated. */
moe_status moe_model_load_f64_alloc(moe_model *m, const char *name, int ndim, const int64_t *shape,
                                    double **out, moe_error *err);

/* Linear "<base>.weight" of any storage format (moe_weight_load: BF16, FP8
 * blocks, NVFP4, ...; found with or without the "model." prefix) decoded to
 * float64 into a new buffer *out [rows * cols] (caller frees), exactly as
 * moe_weight_row_f64 defines it. Defined in src/io/model.c. */
moe_status moe_model_load_linear_f64_alloc(moe_model *m, const char *base, int64_t rows, int64_t cols, double **out,
                                           moe_error *err);

/* *has = whether "<name>" exists with or without the "model." prefix. A
 * shard that cannot be read (without an index every shard might hold it) is
 * that shard's error (moe_ckpt_lookup), never "absent"; *has is then false. */
moe_status moe_model_probe(moe_model *m, const char *name, bool *has, moe_error *err);

/* The first key that appears twice in one object of the JSON tree `v`
 * (depth-first, objects inside arrays included), or NULL. Parsers disagree
 * on such files (cJSON keeps the first value, Python's json the last), so a
 * config that says two things is refused rather than read one way.
 * Defined in src/io/model_util.c. */
const char *moe_json_dup_key(const cJSON *v);

#endif
