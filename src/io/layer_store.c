#include "io/layer_store.h"
#include "core/core.h"

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
