/* libFuzzer target for the safetensors header parser.
 *
 * Any input must either be rejected with a status and a message, or yield a
 * handle whose every tensor range lies inside the input (ASan checks the
 * reads below), whose names all resolve through moe_st_find, and whose
 * nbytes agree with shape x dtype size. */
#include "moeaudit.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    /* An exact-size heap copy, so that ASan catches a read one byte past it. */
    uint8_t *buf = malloc(size ? size : 1);
    if (!buf) return 0;
    if (size) memcpy(buf, data, size);
    moe_st_file *f = NULL;
    moe_error err;
    if (moe_st_open_buffer(buf, size, "fuzz", &f, &err) != MOE_OK) {
        if (f != NULL || strlen(err.msg) == 0) abort(); /* failure must explain itself */
        free(buf);
        return 0;
    }
    volatile uint8_t sink = 0;
    for (size_t i = 0; i < moe_st_count(f); i++) {
        const moe_st_tensor *t = moe_st_at(f, i);
        const uint8_t *p = t->data;
        if (p < buf || (size_t)(p - buf) > size || t->nbytes > size - (size_t)(p - buf)) abort();
        for (uint64_t k = 0; k < t->nbytes; k++) sink ^= p[k];
        if (moe_st_find(f, t->name) != t) abort();
        if (t->ndim < 0 || t->ndim > MOE_MAX_DIMS) abort();
        uint64_t elems = 1;
        for (int d = 0; d < t->ndim; d++) {
            if (t->shape[d] < 0) abort();
            elems *= (uint64_t)t->shape[d];
        }
        if (elems * moe_dtype_size(t->dtype) != t->nbytes) abort();
    }
    (void)moe_st_metadata(f, "format");
    (void)moe_st_find(f, "");
    (void)sink;
    moe_st_close(f);
    free(buf);
    return 0;
}
