/*
 * libFuzzer target: MPI expert placement files (moe_ep_placement_parse, the
 * parser behind `run --ep N --placement FILE`; text "EXPERT RANK" lines or
 * JSON). The first two bytes pick the expert count (1..64) and the rank
 * count (1..8); the rest is the file.
 *
 * Properties: a failure has a message; a placement puts every expert on
 * exactly one rank in range, and the per-rank counts sum to the experts.
 */
#include "moeaudit_mpi.h"

#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 2) return 0;
    int E = 1 + (data[0] & 63), N = 1 + (data[1] & 7);
    char *text = malloc(size - 2 + 1); /* exact size (+1 unused): ASan bounds */
    if (!text) return 0;
    memcpy(text, data + 2, size - 2);
    moe_ep_placement pl;
    moe_error err = {{0}};
    moe_status st = moe_ep_placement_parse(text, size - 2, "fuzz", E, N, &pl, &err);
    if (st != MOE_OK) {
        if (err.msg[0] == '\0') abort();
    } else {
        if (pl.n_experts != E || pl.n_ranks != N) abort();
        int total = 0;
        for (int e = 0; e < E; e++)
            if (pl.owner[e] < 0 || pl.owner[e] >= N) abort();
        for (int r = 0; r < N; r++) total += moe_ep_placement_count(&pl, r);
        if (total != E) abort();
        moe_ep_placement_free(&pl);
    }
    free(text);
    return 0;
}
