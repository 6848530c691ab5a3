/*
 * The whole-model driver's internals (src/model): the opened model, its
 * parsed config, and one layer's weights while it runs.
 */
#ifndef MOE_MODEL_INTERNAL_H
#define MOE_MODEL_INTERNAL_H

#include "moeaudit.h"
#include "moeaudit_hc.h"
#include "moeaudit_model.h"
#include "attn/attn.h"

struct moe_fwd {
    char dir[4096];
    moe_model *m;               /* config numbers, routers and experts (moe_block_run) */
    moe_ckpt *ck;               /* m's checkpoint (moe_model_ckpt): the attention and root tensors */
    moe_fwd_config cfg;
    int *ratio;                 /* [n_layers + n_mtp] */
    moe_attn_type *attn;        /* [n_layers + n_mtp] */
    moe_rope rope_main, rope_compress;
    /* root tensors */
    moe_weight embed;           /* [vocab, H] */
    moe_weight head;            /* [vocab, H] */
    double *norm;               /* [H] */
    double *hc_head_fn;         /* [hc_mult, hc_mult * H] */
    double *hc_head_base;       /* [hc_mult] */
    double hc_head_scale;
    char names[4][260];         /* storage for the root weights' names */
};

/* Parse config.json (m's text) into f->cfg, f->ratio, f->attn and the rope
 * configs. Messages name config.json and the key. */
moe_status moe_fwd_parse_config(moe_fwd *f, moe_error *err);

/* One layer's weights, loaded when the layer runs and freed after it. */
typedef struct fwd_layer {
    int index;                  /* layer, or n_layers + k for MTP block k */
    char prefix[32];            /* "layers.3" or "mtp.0" */
    moe_attn_w attn;
    moe_weight *wo_a;           /* [o_groups] views (or decoded copies) of wo_a's rows */
    double **wo_a_copy;         /* [o_groups] owned decoded rows, or NULL entries */
    double *vec[24];            /* owned float64 vectors (norms, sink, ape, ...) */
    int n_vec;
    moe_hc_weights *hc_attn, *hc_ffn;
    const double *attn_norm, *ffn_norm; /* [H] */
    const moe_layer *moe;       /* owned by the moe_model, or moe_owned */
    moe_layer *moe_owned;       /* MTP blocks, or blocks without routed experts: owned here */
    /* MTP blocks only (index >= n_layers): the input mix and the head */
    moe_weight e_proj, h_proj;  /* [H, H] */
    const double *enorm, *hnorm, *mtp_norm; /* [H] */
    const double *hc_head_fn;   /* [hc_mult, hc_mult * H] */
    const double *hc_head_base; /* [hc_mult] */
    double hc_head_scale;
    char *names[32];            /* weight names kept for messages */
    int n_names;
} fwd_layer;

/* Load layer `index`'s weights (every tensor checked against the config),
 * its MoE block with the routed experts when `routed`, else router, bias,
 * tid2eid and shared expert alone (the caller's MoE brings the experts).
 * MOE_ERR_MISSING names each name tried for an absent tensor. */
moe_status moe_fwd_layer_load(moe_fwd *f, int index, bool routed, fwd_layer *L, moe_error *err);
void moe_fwd_layer_free(fwd_layer *L);

/* Root tensors: embedding, head, final norm, hc head. */
moe_status moe_fwd_load_root(moe_fwd *f, moe_error *err);

#endif
