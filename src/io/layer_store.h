/*
 * The storage behind a moe_layer: descriptors, names and (for layers built in
 * memory: synthetic or quantized) the weight buffers they point to.
 *
 * Invariants:
 *  1. pub is the first member, so a moe_layer * from a layer_store converts
 *     back (moe_layer_free).
 *  2. Everything listed in names and owned is freed with the store; data
 *     pointing into checkpoint mappings is not owned.
 */
#ifndef MOE_LAYER_STORE_H
#define MOE_LAYER_STORE_H

#include "moeaudit.h"

typedef struct layer_store {
    moe_layer pub;
    moe_weight *experts; /* [3 * E]: w1 block, w3 block, w2 block */
    double *bias;        /* [E] or NULL */
    int32_t *tid2eid;    /* [vocab, K] or NULL */
    char **names;
    int n_names, cap_names;
    void **owned;        /* buffers freed with the store */
    int n_owned, cap_owned;
} layer_store;

layer_store *moe_layer_store_new(void);
void moe_layer_store_free(layer_store *s);
/* A copy of name kept for the store's lifetime; NULL on allocation failure. */
const char *moe_layer_store_name(layer_store *s, const char *name);
/* Take ownership of buf (freed with the store). Returns buf, or NULL (and
 * frees buf) on allocation failure. NULL buf returns NULL. */
void *moe_layer_store_adopt(layer_store *s, void *buf);
/* Allocate experts [3 * E] and point pub.w1/w3/w2 at them. */
int moe_layer_store_experts(layer_store *s, int E);

/* Fill L->nvfp4_scale2_mismatch and nvfp4_reconcile_loss from its experts'
 * gate/up weights: every builder of a layer (loader, in-memory quantizer)
 * calls it once the weights are set. */
void moe_layer_nvfp4_reconcile(moe_layer *L);

#endif
