/*
 * libFuzzer target: another engine's dump, as `moeaudit diagnose --dump`
 * reads and judges it: moe_dump_layers, moe_dump_load_layer for every layer
 * listed and for the unprefixed names, moe_dump_drop, then moe_diagnose of
 * what loaded. The first byte picks the layer the dump claims to come from
 * (fuzz/fuzz.h: V4 top-k, V4 hash, V3 grouped, H = 16; 3: a V4 top-k layer
 * with H = 8 and 4 experts; bits 0-1) and whether the optional tensors are
 * dropped first (bit 2); the rest is the dump file. The loaders take a
 * path: the bytes go to one file in /dev/shm (memory) rewritten per input.
 *
 * Properties: a failure has a message; a diagnosis has a verdict in range,
 * tokens_used <= tokens and a sentence; its JSON is valid.
 */
#include "fuzz.h"

#include <cjson/cJSON.h>
#include <fcntl.h>
#include <stdio.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

static moe_layer *layers[4];
static char path[64];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    for (int i = 0; i < 3; i++) layers[i] = fuzz_layer(i);
    moe_synth_opts o = fuzz_synth(0);
    o.hidden = 8;
    o.n_experts = 4;
    moe_error err;
    if (moe_synth_layer(&o, 1, &layers[3], &err) != MOE_OK) abort();
    snprintf(path, sizeof path, "%s/moe-fuzz-dump-%ld.safetensors", access("/dev/shm", W_OK) == 0 ? "/dev/shm" : "/tmp",
             (long)getpid());
    return 0;
}

static void diagnose(const moe_layer *L, const moe_dump *d) {
    moe_error err = {{0}};
    moe_diagnosis g;
    moe_status st = moe_diagnose(L, d, &g, &err);
    if (st != MOE_OK && err.msg[0] == '\0') abort();
    if (st != MOE_OK) return;
    if ((unsigned)g.verdict > MOE_VERDICT_UNEXPLAINED || g.tokens_used > g.tokens || g.tokens_used < 0 ||
        !memchr(g.sentence, 0, sizeof g.sentence) || g.sentence[0] == '\0' || g.n_findings > MOE_DIAG_MAX_FINDINGS)
        abort();
    char *j = moe_diagnosis_json(&g);
    if (j) {
        cJSON *p = cJSON_Parse(j);
        if (!p) abort(); /* the library's JSON must parse */
        cJSON_Delete(p);
        free(j);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    const moe_layer *L = layers[data[0] % 4];
    int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) abort();
    if (size > 1 && write(fd, data + 1, size - 1) != (ssize_t)(size - 1)) abort();
    close(fd);
    moe_error err = {{0}};
    int listed[8], n = 0;
    if (moe_dump_layers(path, listed, 8, &n, &err) != MOE_OK) n = 0;
    if (n > 8) n = 8;
    for (int i = -1; i < n; i++) {
        moe_dump d;
        moe_status st = moe_dump_load_layer(path, i < 0 ? -1 : listed[i], L->cfg.hidden, L->cfg.n_experts, &d, &err);
        if (st != MOE_OK) {
            if (err.msg[0] == '\0') abort();
            continue;
        }
        if (d.T < 1 || !d.hidden || !d.moe_out) abort(); /* a loaded dump holds its required tensors */
        /* bit 2 of the first byte: judge it without ids and logits (the
         * --ignore path); one diagnosis per input, of at most 9 tokens,
         * keeps the work per input bounded: one past DIAG_MIN_TOKENS (8),
         * so a fit may drop a token and still vote (the branch of
         * min_fit_tokens that more tokens reach); each token costs the
         * fits of every hypothesis */
        if (data[0] & 4) (void)moe_dump_drop(&d, "topk_ids,router_logits,bogus", &err);
        if (d.T <= 9 && i == (n > 0 ? 0 : -1)) diagnose(L, &d);
        moe_dump_free(&d);
    }
    return 0;
}
