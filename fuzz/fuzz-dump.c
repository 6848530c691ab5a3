/*
 * libFuzzer target for another engine's dump as moeaudit diagnose reads it
 * (moe_dump_layers, moe_dump_load_layer for every listed layer and for the
 * unprefixed names, moe_dump_drop): the input becomes a file in a scratch
 * directory, read for a layer of hidden size 8 and 4 experts. Errors are
 * fine; crashes, leaks and undefined behaviour are not.
 */
#include "moeaudit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char path[300];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    char dir[256];
    snprintf(dir, sizeof dir, "/tmp/moe-fuzz-dump-XXXXXX");
    if (!mkdtemp(dir)) abort();
    snprintf(path, sizeof path, "%s/dump.safetensors", dir);
    return 0;
}

int LLVMFuzzerTestOneInput(const unsigned char *data, size_t size) {
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    if (size && fwrite(data, 1, size, f) != size) abort();
    fclose(f);
    moe_error err;
    int layers[8], n = 0;
    if (moe_dump_layers(path, layers, 8, &n, &err) != MOE_OK) n = 0;
    int m = n < 8 ? n : 8;
    for (int i = -1; i < m; i++) {
        moe_dump d;
        if (moe_dump_load_layer(path, i < 0 ? -1 : layers[i], 8, 4, &d, &err) != MOE_OK) continue;
        if (d.T <= 0 || !d.hidden || !d.moe_out) abort();           /* a loaded dump holds its required tensors */
        (void)moe_dump_drop(&d, "topk_ids,router_logits,bogus", &err);
        moe_dump_free(&d);
    }
    return 0;
}
