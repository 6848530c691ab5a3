/*
 * libFuzzer target: `run --input`, the block input file (moe_block_input_read:
 * hidden [T, H] and input_ids [T]), run through a layer: the first byte
 * picks it (fuzz/fuzz.h: V4 top-k, V4 hash, V3 grouped; H = 16) and the
 * options (precision, owner, fused shared expert, activation rounding); the
 * rest is the safetensors file, parsed in memory.
 *
 * Properties: a failure has a message; a run's expert ids are in range and
 * its outputs pass the contract check on every finite token; token ids
 * outside the vocabulary of a hash layer are an error naming the token.
 */
#include "fuzz.h"

#include <math.h>
#include <stdio.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);
int LLVMFuzzerInitialize(int *argc, char ***argv);

static moe_layer *layers[3];

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    for (int i = 0; i < 3; i++) layers[i] = fuzz_layer(i);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    uint8_t sel = data[0];
    const moe_layer *L = layers[sel % 3];
    uint8_t *buf;
    moe_st_file *f = fuzz_st_rest(data, size, "fuzz-input", &buf);
    if (!f) return 0;
    moe_error err = {{0}};
    moe_block_input in;
    moe_status st = moe_block_input_read(f, "hidden", "input_ids", L->cfg.hidden, &in, &err);
    if (st != MOE_OK && err.msg[0] == '\0') abort();
    if (st == MOE_OK && in.T <= 128) {
        moe_run_opts o = moe_run_opts_default();
        o.precision = (sel >> 2) & 1 ? MOE_PREC_F32 : MOE_PREC_REF;
        o.owner = (moe_scale_owner)(((sel >> 3) & 3) % 3);
        o.fuse_shared = (sel >> 5) & 1 && o.owner != MOE_SCALE_OUTPUT;
        o.act = (moe_act_prec)((sel >> 6) & 3);
        o.check_invariants = true;
        moe_block_out out;
        st = moe_block_out_init(&out, L, in.T, &o, &err);
        if (st == MOE_OK) {
            st = moe_block_run(L, in.hidden, in.ids, in.T, &o, &out, &err);
            if (st != MOE_OK && err.msg[0] == '\0') abort();
            /* the contract holds whatever the input: only bad ids may fail */
            if (st != MOE_OK && st != MOE_ERR_INPUT) {
                fprintf(stderr, "unexpected: %s: %s\n", moe_status_str(st), err.msg);
                abort();
            }
            if (st == MOE_ERR_INPUT && L->cfg.kind != MOE_LAYER_HASH) abort();
            for (int64_t i = 0; st == MOE_OK && i < in.T * out.n_cols; i++)
                if (out.topk_ids[i] < 0 || out.topk_ids[i] > L->cfg.n_experts) abort();
            moe_block_out_free(&out);
        }
        moe_block_input_free(&in);
    } else if (st == MOE_OK) {
        moe_block_input_free(&in);
    }
    moe_st_close(f);
    free(buf);
    return 0;
}
