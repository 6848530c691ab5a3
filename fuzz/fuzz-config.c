/*
 * libFuzzer target: config.json, model.safetensors.index.json and
 * hf_quant_config.json (ModelOpt's declared quantization), the JSON files of
 * a checkpoint directory, in memory (moe_model_open_mem: no disk). The first
 * byte chooses which file the rest becomes (bit 0: the index; else bit 1:
 * hf_quant_config.json; else config.json); the others are fixed valid files
 * (no hf_quant_config.json unless it is the one fuzzed). Every layer's kind
 * is read, every MoE layer loaded
 * (missing tensors are errors, never crashes), and the keys the
 * hyper-connection and indexer loaders read (hc_mult, hc_sinkhorn_iters,
 * index_n_heads, index_head_dim, compress_rates, ...) are parsed through
 * moe_hc_load / moe_idx_load, and the whole-model forward's reading of the
 * same config (both schemas, RoPE, per-layer attention: moe_fwd_open_model)
 * runs over it, and moe_inspect_mem describes the whole checkpoint.
 *
 * Properties: a failure has a message; an opened model's numbers are inside
 * the limits of moeaudit.h; a loaded layer agrees with the model's config.
 */
#include "fuzz.h"
#include "moeaudit_indexer.h"
#include "moeaudit_model.h"

#include <stdio.h>
#include <unistd.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static const char good_config[] =
    "{\"model_type\": \"deepseek_v4\", \"hidden_size\": 8, \"moe_intermediate_size\": 4,"
    " \"n_routed_experts\": 4, \"num_experts_per_tok\": 2, \"num_hidden_layers\": 2,"
    " \"mlp_layer_types\": [\"hash_moe\", \"moe\"], \"vocab_size\": 16, \"hc_mult\": 2,"
    " \"hc_sinkhorn_iters\": 3, \"hc_eps\": 1e-6, \"rms_norm_eps\": 1e-6, \"index_n_heads\": 2,"
    " \"index_head_dim\": 4, \"index_topk\": 2, \"q_lora_rank\": 4,"
    " \"compress_rates\": {\"compressed_sparse_attention\": 4}}";
static const char good_index[] =
    "{\"weight_map\": {\"layers.1.ffn.gate.weight\": \"a.safetensors\", \"layers.1.ffn.gate.bias\": "
    "\"a.safetensors\", \"layers.0.ffn.gate.tid2eid\": \"b.safetensors\"}}";

/* Two small shards the index points at (made once). */
static uint8_t *shard_a, *shard_b;
static size_t len_a, len_b;

static uint8_t *make_shard(const moe_st_entry *e, size_t n, size_t *len) {
    char path[] = "/tmp/moe-fuzz-config-XXXXXX";
    int fd = mkstemp(path);
    if (fd < 0) abort();
    close(fd);
    moe_error err;
    if (moe_st_write(path, e, n, NULL, &err) != MOE_OK) abort();
    FILE *f = fopen(path, "rb");
    uint8_t *b = malloc(1 << 16);
    *len = fread(b, 1, 1 << 16, f);
    fclose(f);
    unlink(path);
    return b;
}

int LLVMFuzzerInitialize(int *argc, char ***argv);
int LLVMFuzzerInitialize(int *argc, char ***argv) {
    (void)argc;
    (void)argv;
    static uint16_t gate[4 * 8];
    static float bias[4];
    static int32_t tid[16 * 2];
    for (int i = 0; i < 32; i++) { gate[i] = 0x3f80; tid[i] = i % 4; }
    moe_st_entry a[2] = {
        {.name = "layers.1.ffn.gate.weight", .dtype = MOE_DTYPE_BF16, .ndim = 2, .shape = {4, 8}, .data = gate},
        {.name = "layers.1.ffn.gate.bias", .dtype = MOE_DTYPE_F32, .ndim = 1, .shape = {4}, .data = bias}};
    moe_st_entry b = {.name = "layers.0.ffn.gate.tid2eid", .dtype = MOE_DTYPE_I32, .ndim = 2, .shape = {16, 2},
                      .data = tid};
    shard_a = make_shard(a, 2, &len_a);
    shard_b = make_shard(&b, 1, &len_b);
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size < 1) return 0;
    bool fuzz_index = data[0] & 1, fuzz_hfq = !fuzz_index && (data[0] & 2), fuzz_cfg = !fuzz_index && !fuzz_hfq;
    moe_mem_file files[5] = {
        {"config.json", fuzz_cfg ? data + 1 : (const void *)good_config, fuzz_cfg ? size - 1 : sizeof good_config - 1},
        {"model.safetensors.index.json", fuzz_index ? data + 1 : (const void *)good_index,
         fuzz_index ? size - 1 : sizeof good_index - 1},
        {"a.safetensors", shard_a, len_a},
        {"b.safetensors", shard_b, len_b},
        {"hf_quant_config.json", data + 1, size - 1},
    };
    size_t nf = fuzz_hfq ? 5 : 4;
    moe_error err = {{0}};
    moe_model *m = NULL;
    moe_status st = moe_model_open_mem("fuzz", files, nf, &m, &err);
    if (st != MOE_OK) {
        if (err.msg[0] == '\0') abort();
        return 0;
    }
    const moe_model_info *info = moe_model_get_info(m);
    if (info->n_layers < 1 || info->n_layers > MOE_MAX_LAYERS || info->hidden < 1 || info->hidden > MOE_MAX_HIDDEN ||
        info->vocab < 0 || info->vocab > MOE_MAX_VOCAB)
        abort();
    for (int l = 0; l < info->n_layers && l < 64; l++) {
        moe_layer_kind k;
        if (moe_model_layer_kind(m, l, &k, &err) != MOE_OK) abort();
        const moe_layer *L;
        st = moe_model_layer(m, l, &L, &err);
        if (st != MOE_OK && err.msg[0] == '\0') abort();
        if (st == MOE_OK && (L->cfg.hidden != info->hidden || L->cfg.top_k > MOE_MAX_TOPK ||
                             L->cfg.n_group > MOE_MAX_GROUPS || L->cfg.n_experts > MOE_MAX_EXPERTS))
            abort();
        if (l < 4) {
            moe_hc_weights *hw = NULL;
            if (moe_hc_load(m, l, MOE_HC_ATTN, &hw, &err) == MOE_OK) moe_hc_weights_free(hw);
            moe_idx_weights *iw = NULL;
            if (moe_idx_load(m, l, &iw, &err) == MOE_OK) moe_idx_weights_free(iw);
        }
    }
    const moe_st_tensor *t;
    (void)moe_model_find(m, "layers.1.ffn.gate.bias", &t, &err);
    moe_model_free(m);
    /* the forward's reading of the same config: an error naming the key or
     * the first missing tensor, never a crash */
    if (moe_model_open_mem("fuzz", files, nf, &m, &err) == MOE_OK) {
        moe_fwd *fw = NULL;
        if (moe_fwd_open_model(m, &fw, &err) == MOE_OK) moe_fwd_free(fw);
        else if (!err.msg[0]) abort();
    }
    /* inspect reads the same files and every header */
    moe_inspect r;
    if (moe_inspect_mem("fuzz", files, nf, &r, &err) == MOE_OK) {
        char *j = moe_inspect_json(&r);
        free(j);
        moe_inspect_free(&r);
    } else if (!err.msg[0]) {
        abort();
    }
    return 0;
}
