#include "io/layer_store.h"
#include "core/core.h"
#include "moe_formats.h"

#include <math.h>

#include <string.h>

layer_store *moe_layer_store_new(void) { return moe_calloc(1, sizeof(layer_store)); }

void moe_layer_store_free(layer_store *s) {
    if (!s) return;
    free(s->experts);
    free(s->bias);
    free(s->tid2eid);
    for (int i = 0; i < s->n_names; i++) free(s->names[i]);
    free(s->names);
    for (int i = 0; i < s->n_owned; i++) free(s->owned[i]);
    free(s->owned);
    free(s);
}

void moe_layer_free(moe_layer *L) { moe_layer_store_free((layer_store *)(void *)L); }

static int grow(void ***arr, int *cap, int n) {
    if (n < *cap) return 0;
    int c = *cap ? 2 * *cap : 64;
    void **a = realloc(*arr, (size_t)c * sizeof *a);
    if (!a) return -1;
    *arr = a;
    *cap = c;
    return 0;
}

const char *moe_layer_store_name(layer_store *s, const char *name) {
    if (grow((void ***)&s->names, &s->cap_names, s->n_names)) return NULL;
    size_t len = strlen(name) + 1;
    char *c = malloc(len);
    if (!c) return NULL;
    memcpy(c, name, len);
    s->names[s->n_names++] = c;
    return c;
}

void *moe_layer_store_adopt(layer_store *s, void *buf) {
    if (!buf) return NULL;
    if (grow(&s->owned, &s->cap_owned, s->n_owned)) { free(buf); return NULL; }
    s->owned[s->n_owned++] = buf;
    return buf;
}

int moe_layer_store_experts(layer_store *s, int E) {
    s->experts = moe_calloc((size_t)3 * (size_t)E, sizeof *s->experts);
    if (!s->experts) return -1;
    s->pub.w1 = s->experts;
    s->pub.w3 = s->experts + E;
    s->pub.w2 = s->experts + 2 * (size_t)E;
    return 0;
}

/* What fusing gate and up into one NVFP4 GEMM would cost (see moe_layer):
 * the projection with the smaller weight_scale_2 has its UE4M3 block scales
 * re-encoded for the larger one. */
void moe_layer_act_scales(moe_layer *L) {
    int E = L->cfg.n_experts;
    moe_weight *w1 = (moe_weight *)(void *)L->w1, *w3 = (moe_weight *)(void *)L->w3, *w2 = (moe_weight *)(void *)L->w2;
    float m13 = 0.0f, m2 = 0.0f;
    for (int e = 0; w1 && e < E; e++) {
        if (w1[e].input_scale > m13) m13 = w1[e].input_scale;
        if (w3[e].input_scale > m13) m13 = w3[e].input_scale;
        if (w2[e].input_scale > m2) m2 = w2[e].input_scale;
    }
    for (int e = 0; w1 && e < E; e++) {
        w1[e].act_scale = w3[e].act_scale = m13;
        w2[e].act_scale = m2;
    }
    /* the shared expert is a linear of its own: gate and up merged (vLLM's
     * merged column linear takes the larger of the two) */
    float s13 = L->sw1.input_scale > L->sw3.input_scale ? L->sw1.input_scale : L->sw3.input_scale;
    L->sw1.act_scale = L->sw3.act_scale = s13;
    L->sw2.act_scale = L->sw2.input_scale;
}

void moe_layer_nvfp4_reconcile(moe_layer *L) {
    moe_layer_act_scales(L);
    L->nvfp4_scale2_mismatch = 0;
    L->nvfp4_reconcile_loss = 0;
    for (int e = 0; e < L->cfg.n_experts; e++) {
        const moe_weight *g = &L->w1[e], *u = &L->w3[e];
        if (g->fmt != MOE_WFMT_NVFP4 || u->fmt != MOE_WFMT_NVFP4 || g->scale2 == u->scale2) continue;
        L->nvfp4_scale2_mismatch++;
        const moe_weight *lo = g->scale2 < u->scale2 ? g : u;
        float hi = g->scale2 < u->scale2 ? u->scale2 : g->scale2;
        const uint8_t *sc = lo->scale;
        for (int64_t i = 0; i < lo->scale_rows * lo->scale_cols; i++) {
            double b = moe_ue4m3_to_f32(sc[i]);
            if (!(b > 0)) continue;
            double b2 = moe_ue4m3_to_f32(moe_ue4m3_from_f32((float)(b * lo->scale2 / hi)));
            double rel = fabs(b2 * hi - b * lo->scale2) / (b * lo->scale2);
            if (rel > L->nvfp4_reconcile_loss) L->nvfp4_reconcile_loss = rel;
        }
    }
}

