/*
 * What src/io keeps beside a checkpoint's mappings: the quantization it
 * declares (config.json, hf_quant_config.json: io/quant_decl.h), read once
 * by moe_ckpt_open, and small buffers derived from its tensors (scales
 * widened to F32, a per-tensor FP8 scale spread over its 128x128 tiles) that
 * weight descriptors point to. Both live until moe_ckpt_free, like the
 * mappings, so a moe_weight still owns nothing.
 */
#ifndef MOE_IO_CKPT_H
#define MOE_IO_CKPT_H

#include "io/quant_decl.h"
#include "moeaudit.h"

/* The checkpoint's declared quantization (never NULL; empty when none). */
const moe_qdecl *moe_ckpt_decl(const moe_ckpt *c);

/* A zeroed buffer of `bytes` owned by the checkpoint (freed by
 * moe_ckpt_free); NULL when out of memory. Not thread-safe (like lookups). */
void *moe_ckpt_keep(moe_ckpt *c, size_t bytes);

#endif
