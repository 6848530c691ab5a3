/*
 * The quantization a checkpoint declares about itself, read from the files
 * the releases write (shared/design/layouts/, docs/formats.md "Declared
 * quantization"):
 *
 *   config.json quantization_config (or text_config.quantization_config)
 *     quant_method "fp8": fmt, scale_fmt ("ue8m0" | "float" | absent),
 *       weight_block_size [r, c], activation_scheme; NVIDIA's V4 NVFP4 copy
 *       adds moe_quant_algo "NVFP4" (routed experts NVFP4, the rest FP8).
 *     quant_method "modelopt": quant_algo, group_size, ignore (the ModelOpt
 *       export written into config.json).
 *     quant_method "compressed-tensors": config_groups {targets, weights
 *       {num_bits, type, strategy, group_size, block_structure},
 *       input_activations, format}, ignore.
 *   config.json expert_dtype ("fp4" | "fp8"; DeepSeek V4)
 *   hf_quant_config.json {"quantization": {quant_algo, group_size,
 *     kv_cache_quant_algo, exclude_modules, quantized_layers}} (ModelOpt)
 *
 * Invariants:
 *  1. Parsing never guesses: a key of the wrong type is MOE_ERR_CONFIG
 *     naming the file and key; an absent key leaves its field empty.
 *  2. moe_qdecl_expect is a pure function of the declaration and a module
 *     name: what the declaration says that module must be, and which
 *     declaration says it (for messages that name both sides).
 */
#ifndef MOE_IO_QUANT_DECL_H
#define MOE_IO_QUANT_DECL_H

#include "moeaudit.h"

#include <stdbool.h>

/* What a declaration requires of one linear module. */
typedef enum moe_qexp {
    MOE_QEXP_ANY,        /* nothing declared about it */
    MOE_QEXP_PLAIN,      /* unquantized (excluded / ignored by a quantizer that would write its format) */
    MOE_QEXP_NOT_MODELOPT, /* excluded from ModelOpt: no ModelOpt tensors (FP8 blocks of another declaration allowed) */
    MOE_QEXP_FP8,        /* FP8 E4M3 (any scale layout) */
    MOE_QEXP_FP8_TENSOR, /* FP8 E4M3, one scale per tensor */
    MOE_QEXP_FP4,        /* packed E2M1, MXFP4 or NVFP4 (expert_dtype "fp4") */
    MOE_QEXP_MXFP4,
    MOE_QEXP_NVFP4
} moe_qexp;

const char *moe_qexp_name(moe_qexp e);

/* What a linear is stored as, coarsely (for the declaration check). */
typedef enum moe_qkind { MOE_QK_PLAIN, MOE_QK_FP8, MOE_QK_FP8_TENSOR, MOE_QK_MXFP4, MOE_QK_NVFP4, MOE_QK_NVFP4_CT } moe_qkind;

/* True when a linear stored as k satisfies the expectation e. */
bool moe_qexp_allows(moe_qexp e, moe_qkind k);

typedef struct moe_qdecl_group {
    char name[48];
    int n_targets;
    char **targets;          /* "Linear" or "re:<regex>" or names */
    char format[40];         /* "nvfp4-pack-quantized", "float-quantized", ... */
    int wbits;               /* weights.num_bits */
    char wtype[12];          /* "float" | "int" */
    char wstrategy[16];      /* "tensor_group", "block", "tensor", "channel", "group" */
    int wgroup;              /* weights.group_size */
    int wblock[2];           /* weights.block_structure, 0 when absent */
    bool has_input;          /* input_activations present */
    bool input_dynamic;
} moe_qdecl_group;

typedef struct moe_qdecl {
    /* config.json quantization_config (cfg_where: where it was found) */
    bool has_qc;
    char cfg_where[48];      /* "config.json quantization_config" or "... text_config.quantization_config" */
    char quant_method[32];
    char fmt[16], scale_fmt[16], activation_scheme[16], moe_quant_algo[16];
    int block[2];            /* weight_block_size; 0 when absent */
    char expert_dtype[16];   /* config.json expert_dtype (root or text_config) */
    /* ModelOpt */
    bool modelopt;
    char mo_where[48];       /* "hf_quant_config.json" or "config.json quantization_config" */
    char mo_producer[64];
    char mo_algo[32];        /* quant_algo: "NVFP4", "FP8", "MIXED_PRECISION", ... */
    int mo_group;            /* group_size, 0 when absent */
    char mo_kv[16];          /* kv_cache_quant_algo, "" when null/absent */
    int n_exclude;
    char **exclude;          /* exclude_modules (hf_quant_config) or ignore (config.json) */
    int n_layers;
    char **layer_names;      /* quantized_layers keys (MIXED_PRECISION) */
    char (*layer_algos)[32]; /* [n_layers] their quant_algo */
    /* compressed-tensors */
    bool ct;
    char ct_format[40];
    int n_groups;
    moe_qdecl_group *groups;
    int n_ignore;
    char **ignore;
} moe_qdecl;

/* Read the declaration of checkpoint directory dir (config.json and
 * hf_quant_config.json; either may be absent). *d is zeroed first and owns
 * what it holds afterwards (moe_qdecl_free), also on failure. */
moe_status moe_qdecl_read(const char *dir, moe_qdecl *d, moe_error *err);
/* The same from texts already in memory: cfg [cfg_len] (config.json) and
 * hfq [hfq_len] (hf_quant_config.json), each NULL when absent; the paths
 * name them in messages. A key twice in one object is MOE_ERR_FORMAT. */
moe_status moe_qdecl_parse(moe_qdecl *d, const char *cfg_path, const char *cfg, size_t cfg_len, const char *hfq_path,
                           const char *hfq, size_t hfq_len, moe_error *err);
void moe_qdecl_free(moe_qdecl *d);

/* True when anything is declared. */
bool moe_qdecl_present(const moe_qdecl *d);

/* The FP8 block the declaration states (weight_block_size, or a
 * compressed-tensors block strategy): *br, *bc and true; else false. */
bool moe_qdecl_fp8_block(const moe_qdecl *d, int *br, int *bc, const char **where);

/* Family of a linear module by its name (base, without ".weight"). */
typedef enum moe_qfamily {
    MOE_QFAM_OTHER,          /* attention, compressors, MTP projections, heads, ... */
    MOE_QFAM_ROUTED,         /* routed experts: ...experts.<e>.<proj> or stacked ...experts.<proj> */
    MOE_QFAM_SHARED,         /* ...shared_experts.<proj> */
    MOE_QFAM_DENSE,          /* a dense MLP's projection: ...mlp.{gate,up,down}_proj (no experts) */
    MOE_QFAM_ROUTER          /* ...{mlp,ffn}.gate */
} moe_qfamily;
moe_qfamily moe_qfamily_of(const char *base);

/* What the declaration requires of module `base` (a weight's name without
 * ".weight"); *why (static or d-owned text) names the declaration that says
 * so ("config.json expert_dtype \"fp4\"", "hf_quant_config.json
 * quantized_layers[layers.0.ffn.experts] NVFP4", ...) or "" for ANY. */
moe_qexp moe_qdecl_expect(const moe_qdecl *d, const char *base, char *why, size_t why_cap);

/* One line describing the declaration ("fp8 128x128 ue8m0; experts fp4",
 * "ModelOpt NVFP4 group 16, 3 excluded", ...) into buf. */
void moe_qdecl_describe(const moe_qdecl *d, char *buf, size_t cap);

#endif
