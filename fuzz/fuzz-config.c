/*
 * libFuzzer target for the other untrusted files a checkpoint directory
 * holds: config.json (moe_model_open, every layer's kind) and
 * model.safetensors.index.json (moe_ckpt_open, lookups), and the forward's
 * reading of config.json (moe_fwd_open). The first byte
 * chooses which file the rest of the input becomes; the other file is a
 * fixed valid one. Files live in one scratch directory per process.
 */
#include "moeaudit.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

static char dir[256];

static const char good_config[] =
    "{\"model_type\": \"deepseek_v4\", \"hidden_size\": 8, \"moe_intermediate_size\": 4,"
    " \"n_routed_experts\": 4, \"num_experts_per_tok\": 2, \"num_hidden_layers\": 2,"
    " \"mlp_layer_types\": [\"hash_moe\", \"moe\"], \"vocab_size\": 16}";

static void put(const char *name, const void *data, size_t n) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    FILE *f = fopen(path, "wb");
    if (!f) abort();
    if (n && fwrite(data, 1, n, f) != n) abort();
    fclose(f);
}

static void drop(const char *name) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    unlink(path);
}

int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    snprintf(dir, sizeof dir, "/tmp/moe-fuzz-config-XXXXXX");
    if (!mkdtemp(dir)) abort();
    /* a valid shard holding one small tensor */
    float v[8] = {0};
    moe_st_entry e = {.name = "model.layers.1.ffn.gate.bias", .dtype = MOE_DTYPE_F32, .ndim = 1, .shape = {4}, .data = v};
    char path[512];
    snprintf(path, sizeof path, "%s/shard.safetensors", dir);
    if (moe_st_write(path, &e, 1, NULL, NULL) != MOE_OK) abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    bool fuzz_index = data[0] & 1;
    if (fuzz_index) {
        put("config.json", good_config, sizeof good_config - 1);
        put("model.safetensors.index.json", data + 1, size - 1);
    } else {
        put("config.json", data + 1, size - 1);
        static const char index[] = "{\"weight_map\": {\"model.layers.1.ffn.gate.bias\": \"shard.safetensors\"}}";
        put("model.safetensors.index.json", index, sizeof index - 1);
    }
    moe_error err;
    moe_model *m = NULL;
    if (moe_model_open(dir, &m, &err) == MOE_OK) {
        const moe_model_info *info = moe_model_get_info(m);
        for (int l = 0; l < info->n_layers && l < 64; l++) {
            moe_layer_kind k;
            (void)moe_model_layer_kind(m, l, &k, &err);
            const moe_layer *L;
            (void)moe_model_layer(m, l, &L, &err); /* missing tensors: an error, never a crash */
        }
        const moe_st_tensor *t;
        (void)moe_model_find(m, "layers.1.ffn.gate.bias", &t, &err);
        moe_model_free(m);
        /* the whole-model forward's reading of the same config (both schemas, RoPE, per-layer
         * attention): an error naming the key or the first missing tensor, never a crash */
        moe_fwd *fw = NULL;
        if (moe_fwd_open(dir, &fw, &err) == MOE_OK) moe_fwd_free(fw);
        else if (!err.msg[0]) abort();
    }
    drop("model.safetensors.index.json");
    return 0;
}
