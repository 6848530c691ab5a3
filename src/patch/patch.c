/*
 * The patch table and patch sets (include/moeaudit_patch.h, docs/bisect.md).
 *
 * Invariants:
 *  1. The table below is the one list of precision toggles: the bisect, the
 *     forward and the audit's MoE paths all read it. A patch is data: a
 *     list of (component, value) settings; no stage tests a patch's name.
 *  2. In a set, one component has one value per layer and phase: two
 *     enabled patches that disagree on a common layer and phase are refused
 *     when the set is parsed, so any mask of a valid set resolves without
 *     ambiguity (the order of the patches never matters).
 *  3. moe_patch_layer is a pure function of (set, mask, layer, phase).
 *  4. The only mutable part of a set is its cache of quantized MoE layers,
 *     filled by moe_patch_moe_run and freed with the set.
 */
#include "moeaudit_patch.h"
#include "core/core.h"
#include "moe_formats.h"

#include <ctype.h>
#include <limits.h>
#include <string.h>

/* Declared in moeaudit_model.h beside moe_phase; defined here, the lowest
 * room that names phases (patches carry one), so no room calls upward. */
const char *moe_phase_name(moe_phase p) {
    return p == MOE_PHASE_PREFILL ? "prefill" : p == MOE_PHASE_DECODE ? "decode" : p == MOE_PHASE_ALL ? "all" : "?";
}

/* ---------------------------------------------------------- components */

static const char *const comp_names[MOE_PC_COUNT] = {
    "hc", "index-q", "index-keys", "index-acc", "index-rotation", "index-topk", "kv", "attn", "compress",
    "experts", "shared", "act", "router", "fault"};

const char *moe_patch_comp_name(moe_patch_comp c) { return (unsigned)c < MOE_PC_COUNT ? comp_names[c] : "?"; }


/* Routed-expert formats of MOE_PC_EXPERTS (value = index). */
typedef struct expert_fmt {
    moe_qfmt q;
    int e2m1_round, mx_scale_rule;
} expert_fmt;
static const expert_fmt expert_fmts[] = {
    {MOE_Q_NONE, 0, 0},
    {MOE_Q_FP8, 0, 0},
    {MOE_Q_MXFP4, MOE_E2M1_RNE, MOE_MX_SCALE_CEIL},
    {MOE_Q_MXFP4, MOE_E2M1_TIES_UP, MOE_MX_SCALE_CEIL},
    {MOE_Q_MXFP4, MOE_E2M1_TOWARD_ZERO, MOE_MX_SCALE_CEIL},
    {MOE_Q_MXFP4, MOE_E2M1_RNE, MOE_MX_SCALE_FLOOR},
    {MOE_Q_NVFP4, MOE_E2M1_RNE, 0},
};
enum { XF_NONE, XF_FP8, XF_MXFP4, XF_MXFP4_UP, XF_MXFP4_TRUNC, XF_MXFP4_FLOOR, XF_NVFP4 };

/* ---------------------------------------------------------------- table */

#define ONE(c, v) 1, {c}, {v}
#define TWO(c1, v1, c2, v2) 2, {c1, c2}, {v1, v2}
#define THREE(c1, v1, c2, v2, c3, v3) 3, {c1, c2, c3}, {v1, v2, v3}
#define ALL MOE_PHASE_ALL
#define Q MOE_PC_INDEX_Q
#define K MOE_PC_INDEX_K
#define R MOE_PC_INDEX_ROT

static const moe_patch_info table[] = {
    /* mHC linear (ATTENTION.md 3.4; src/hc) */
    {"mhc-fp32", ONE(MOE_PC_HC, MOE_HC_F32), ALL, false,
     "mHC linear, gates and Sinkhorn in fp32 (DeepSeek's reference code; torch fallbacks)"},
    {"mhc-tf32", ONE(MOE_PC_HC, MOE_HC_TF32), ALL, false,
     "mHC linear in TF32, the rest fp32 (SGLang's DeepGEMM tf32_hc_prenorm_gemm)"},
    {"mhc-bf16", ONE(MOE_PC_HC, MOE_HC_BF16), ALL, false,
     "mHC linear on bf16 streams and bf16 fn, fp32 accumulation (AITER bf16 mHC, Mirage MPK)"},
    {"mhc-bf16-split", ONE(MOE_PC_HC, MOE_HC_BF16_SPLIT), ALL, false,
     "mHC linear with fn split into bf16 hi/lo halves (AITER packed-BF16 mHC)"},
    /* lightning indexer (ATTENTION.md 2.5-2.6, 6.1; src/indexer) */
    {"index-fp32", ONE(Q, MOE_IDX_Q_F32), ALL, false,
     "indexer scores in fp32 with the Hadamard rotation, no rounding (the engines' scorer, exact inputs)"},
    {"index-norot", ONE(R, 0), ALL, false,
     "indexer without the Hadamard rotation of q and k (fp32 scorer; exact alone, it changes what rounding does)"},
    {"index-acc-bf16", ONE(MOE_PC_INDEX_ACC, MOE_IDX_ACC_BF16), ALL, false,
     "indexer dot products rounded to bf16, head sum in bf16 (DeepSeek V4 reference's bf16 einsum)"},
    {"index-q-bf16", ONE(Q, MOE_IDX_Q_BF16), ALL, false, "indexer queries in bf16"},
    {"index-q-fp8", ONE(Q, MOE_IDX_Q_FP8), ALL, false,
     "indexer queries FP8 E4M3 per 128, fp32 scale amax/448 (V3.2 act_quant without scale_fmt)"},
    {"index-q-fp8-pow2", ONE(Q, MOE_IDX_Q_FP8_POW2), ALL, false,
     "indexer queries FP8 E4M3 per 128, power-of-two scale (SGLang / vLLM fused q quant)"},
    {"index-q-fp4", ONE(Q, MOE_IDX_Q_FP4), ALL, false,
     "indexer queries FP4 E2M1 per 32 with E8M0 scales (DeepSeek V4 reference; SGLang --enable-deepseek-v4-fp4-indexer)"},
    {"index-keys-bf16", ONE(K, MOE_IDX_Q_BF16), ALL, false, "indexer keys cached in bf16 (DeepSeek V4 reference's cache dtype)"},
    {"index-keys-fp8", ONE(K, MOE_IDX_Q_FP8), ALL, false,
     "indexer keys FP8 E4M3 + fp32 scale per entry (SGLang's default 132-byte index-K cache)"},
    {"index-keys-fp8-pow2", ONE(K, MOE_IDX_Q_FP8_POW2), ALL, false,
     "indexer keys FP8 E4M3, power-of-two scale (V3.2 scale_fmt ue8m0)"},
    {"index-keys-fp4", ONE(K, MOE_IDX_Q_FP4), ALL, false,
     "indexer keys FP4 E2M1 + E8M0 per 32 (DeepSeek V4's FP4 simulation; vLLM MXFP4 index cache)"},
    {"index-qk-bf16", TWO(Q, MOE_IDX_Q_BF16, K, MOE_IDX_Q_BF16), ALL, false, "indexer queries and keys in bf16"},
    {"index-qk-fp8", TWO(Q, MOE_IDX_Q_FP8, K, MOE_IDX_Q_FP8), ALL, false,
     "indexer queries and keys FP8 with fp32 scales (DeepGEMM fp8_mqa_logits)"},
    {"index-qk-fp8-pow2", TWO(Q, MOE_IDX_Q_FP8_POW2, K, MOE_IDX_Q_FP8_POW2), ALL, false,
     "indexer queries and keys FP8 with power-of-two scales"},
    {"index-qk-fp4", TWO(Q, MOE_IDX_Q_FP4, K, MOE_IDX_Q_FP4), ALL, false,
     "indexer queries and keys FP4 (DeepSeek V4 reference, DeepGEMM fp8_fp4_mqa_logits)"},
    {"index-q-bf16-norot", TWO(Q, MOE_IDX_Q_BF16, R, 0), ALL, false, "indexer queries in bf16, no rotation"},
    {"index-q-fp8-norot", TWO(Q, MOE_IDX_Q_FP8, R, 0), ALL, false, "indexer queries FP8 (fp32 scale), no rotation"},
    {"index-q-fp8-pow2-norot", TWO(Q, MOE_IDX_Q_FP8_POW2, R, 0), ALL, false,
     "indexer queries FP8 (power-of-two scale), no rotation"},
    {"index-q-fp4-norot", TWO(Q, MOE_IDX_Q_FP4, R, 0), ALL, false, "indexer queries FP4, no rotation"},
    {"index-keys-bf16-norot", TWO(K, MOE_IDX_Q_BF16, R, 0), ALL, false, "indexer keys in bf16, no rotation"},
    {"index-keys-fp8-norot", TWO(K, MOE_IDX_Q_FP8, R, 0), ALL, false,
     "indexer keys FP8 (fp32 scale) without the Hadamard rotation"},
    {"index-keys-fp8-pow2-norot", TWO(K, MOE_IDX_Q_FP8_POW2, R, 0), ALL, false,
     "indexer keys FP8 (power-of-two scale), no rotation"},
    {"index-keys-fp4-norot", TWO(K, MOE_IDX_Q_FP4, R, 0), ALL, false,
     "indexer keys FP4 without the Hadamard rotation: an outlier channel sets each 32-block's scale"},
    {"index-qk-bf16-norot", THREE(Q, MOE_IDX_Q_BF16, K, MOE_IDX_Q_BF16, R, 0), ALL, false,
     "indexer queries and keys bf16, no rotation"},
    {"index-qk-fp8-norot", THREE(Q, MOE_IDX_Q_FP8, K, MOE_IDX_Q_FP8, R, 0), ALL, false,
     "indexer queries and keys FP8 (fp32 scales), no rotation"},
    {"index-qk-fp8-pow2-norot", THREE(Q, MOE_IDX_Q_FP8_POW2, K, MOE_IDX_Q_FP8_POW2, R, 0), ALL, false,
     "indexer queries and keys FP8 (power-of-two scales), no rotation"},
    {"index-qk-fp4-norot", THREE(Q, MOE_IDX_Q_FP4, K, MOE_IDX_Q_FP4, R, 0), ALL, false,
     "indexer queries and keys FP4, no rotation"},
    {"index-topk", ONE(MOE_PC_INDEX_TOPK, 0), ALL, true,
     "index_topk=N compressed entries kept per query instead of the config's (V4-Pro 1024 vs Flash 512)"},
    /* attention (ATTENTION.md 2.3-2.4, 2.6; src/attn) */
    {"kv-bf16", ONE(MOE_PC_KV, MOE_KV_BF16), ALL, false, "KV cache (window rows and compressed entries) in bf16"},
    {"kv-fp8", ONE(MOE_PC_KV, MOE_KV_FP8), ALL, false,
     "KV cache as FlashMLA stores V4's: NoPE dims E4M3 in tiles of 64 with ue8m0 scales, RoPE dims bf16"},
    {"attn-bf16", ONE(MOE_PC_ATTN, MOE_ATTN_ARITH_BF16), MOE_PHASE_DECODE, false,
     "attention score, softmax and PV as a bf16 MMA sparse-decode kernel computes them (decode steps)"},
    {"compress-state-bf16", ONE(MOE_PC_COMPRESS, 1), ALL, false,
     "compressors' open-window and overlap state in bf16 (SGLANG_DSV4_COMPRESS_STATE_DTYPE=bf16)"},
    /* MoE block (SEMANTICS.md 1-2; src/experts, src/router) */
    {"experts-fp8", ONE(MOE_PC_EXPERTS, XF_FP8), ALL, false, "routed experts FP8 E4M3 in 128x128 tiles (V3 release)"},
    {"experts-mxfp4", ONE(MOE_PC_EXPERTS, XF_MXFP4), ALL, false,
     "routed experts MXFP4: E2M1 nearest-even + E8M0 ceil scale per 32 (V4 release)"},
    {"experts-mxfp4-ties-up", ONE(MOE_PC_EXPERTS, XF_MXFP4_UP), ALL, false,
     "routed experts MXFP4 with E2M1 ties away from zero (software fallbacks)"},
    {"experts-mxfp4-trunc", ONE(MOE_PC_EXPERTS, XF_MXFP4_TRUNC), ALL, false,
     "routed experts MXFP4 with E2M1 toward zero (ggml-style truncation)"},
    {"experts-mxfp4-floor-scale", ONE(MOE_PC_EXPERTS, XF_MXFP4_FLOOR), ALL, false,
     "routed experts MXFP4 with the OCP floor scale rule (clips (6, 8) x 2^e)"},
    {"experts-nvfp4", ONE(MOE_PC_EXPERTS, XF_NVFP4), ALL, false,
     "routed experts NVFP4: E2M1 + UE4M3 per 16 + fp32 per tensor (ModelOpt)"},
    {"shared-fp8", ONE(MOE_PC_SHARED, MOE_Q_FP8), ALL, false, "shared expert FP8 E4M3 in 128x128 tiles"},
    {"act-bf16", ONE(MOE_PC_ACT, MOE_ACT_BF16), ALL, false, "expert GEMM activations in bf16"},
    {"act-fp8", ONE(MOE_PC_ACT, MOE_ACT_FP8), ALL, false,
     "expert GEMM activations FP8 E4M3 per 128, power-of-two scale (V3.1+, V4)"},
    {"act-fp8-f32scale", ONE(MOE_PC_ACT, MOE_ACT_FP8_F32SCALE), ALL, false,
     "expert GEMM activations FP8 E4M3 per 128, fp32 scale (V3)"},
    {"router-bf16", ONE(MOE_PC_ROUTER, MOE_ROUTER_BF16_LOGITS), ALL, false,
     "router GEMM in bf16: bf16 input, logits rounded to bf16 (a bf16 F.linear)"},
    {"router-bf16-input", ONE(MOE_PC_ROUTER, MOE_ROUTER_BF16_INPUT), ALL, false,
     "router GEMM on bf16-rounded input, fp32 accumulation"},
    /* contract faults (SEMANTICS.md 2; moeaudit_variant.h) */
    {"scale-double", ONE(MOE_PC_FAULT, MOE_FAULT_SCALE_DOUBLE), ALL, false,
     "routed_scaling_factor applied twice (router and runner: the scale fused into HashTopK and kept in the runner)"},
    {"scale-missing", ONE(MOE_PC_FAULT, MOE_FAULT_SCALE_MISSING), ALL, false, "routed_scaling_factor never applied"},
    {"shared-weight", ONE(MOE_PC_FAULT, MOE_FAULT_SHARED_WEIGHT), ALL, false,
     "fused shared expert column weighted 1/s under the router owner"},
    {"not-renormalized", ONE(MOE_PC_FAULT, MOE_FAULT_NOT_RENORMALIZED), ALL, false, "top-k weights not renormalized"},
    {"biased-weights", ONE(MOE_PC_FAULT, MOE_FAULT_BIASED_WEIGHTS), ALL, false,
     "routing weights gathered from the bias-corrected scores"},
};

#undef ONE
#undef TWO
#undef THREE
#undef ALL
#undef Q
#undef K
#undef R

int moe_patch_table_size(void) { return (int)(sizeof table / sizeof table[0]); }
const moe_patch_info *moe_patch_table_at(int i) { return i >= 0 && i < moe_patch_table_size() ? &table[i] : NULL; }

const moe_patch_info *moe_patch_find(const char *name) {
    for (int i = 0; i < moe_patch_table_size(); i++)
        if (!strcmp(table[i].name, name)) return &table[i];
    return NULL;
}

/* ------------------------------------------------------------ defaults */

moe_layer_patch moe_layer_patch_none(void) {
    moe_layer_patch p;
    memset(&p, 0, sizeof p);
    p.hc_set = false;
    p.hc = MOE_HC_REF;
    p.attn.kv = MOE_KV_EXACT;
    p.attn.arith = MOE_ATTN_ARITH_PATH;
    p.attn.compress_bf16 = false;
    p.attn.index_engine = false;
    p.attn.idx = moe_idx_opts_default();
    p.attn.index_topk = 0;
    p.moe.experts = MOE_Q_NONE;
    p.moe.e2m1_round = MOE_E2M1_RNE;
    p.moe.mx_scale_rule = MOE_MX_SCALE_CEIL;
    p.moe.shared = MOE_Q_NONE;
    p.moe.act = MOE_ACT_EXACT;
    p.moe.router = MOE_ROUTER_PATH;
    p.moe.fault = MOE_FAULT_NONE;
    p.moe_set = false;
    return p;
}

/* --------------------------------------------------------------- a set */

typedef struct qentry {
    int layer;
    moe_quant_opts q;
    moe_layer *L;
} qentry;

struct moe_patch_set {
    int n;
    moe_patch p[MOE_PATCH_MAX];
    int n_layers;               /* of the model (0 when parsed without a config) */
    qentry *cache;
    int n_cache, cap_cache;
};

int moe_patch_set_count(const moe_patch_set *s) { return s ? s->n : 0; }
const moe_patch *moe_patch_set_at(const moe_patch_set *s, int i) { return s && i >= 0 && i < s->n ? &s->p[i] : NULL; }

void moe_patch_set_free(moe_patch_set *s) {
    if (!s) return;
    for (int i = 0; i < s->n_cache; i++) moe_layer_free(s->cache[i].L);
    free(s->cache);
    free(s);
}

static bool is_index_comp(moe_patch_comp c) {
    return c == MOE_PC_INDEX_Q || c == MOE_PC_INDEX_K || c == MOE_PC_INDEX_ACC || c == MOE_PC_INDEX_ROT ||
           c == MOE_PC_INDEX_TOPK;
}
static bool is_moe_comp(moe_patch_comp c) {
    return c == MOE_PC_EXPERTS || c == MOE_PC_SHARED || c == MOE_PC_ACT || c == MOE_PC_ROUTER || c == MOE_PC_FAULT;
}

/* The first layer of [first, last] whose computation patch p changes, or -1. */
static int first_changed(const moe_patch *p, const moe_fwd_config *cfg) {
    bool index = false, compress = false;
    for (int k = 0; k < p->info->n_set; k++) {
        index |= is_index_comp(p->info->comp[k]);
        compress |= p->info->comp[k] == MOE_PC_COMPRESS;
    }
    for (int l = p->first; l <= p->last; l++) {
        if (index && cfg->attn[l] != MOE_ATTN_CSA) continue;
        if (compress && cfg->attn[l] == MOE_ATTN_SLIDING) continue;
        return l;
    }
    return -1;
}

/* Edit distance (for "did you mean"), capped small strings. */
static int edit_distance(const char *a, const char *b) {
    int la = (int)strlen(a), lb = (int)strlen(b);
    if (la > 63 || lb > 63) return 99;
    int d[64][64];
    for (int i = 0; i <= la; i++) d[i][0] = i;
    for (int j = 0; j <= lb; j++) d[0][j] = j;
    for (int i = 1; i <= la; i++)
        for (int j = 1; j <= lb; j++) {
            int c = d[i - 1][j - 1] + (a[i - 1] != b[j - 1]);
            if (d[i - 1][j] + 1 < c) c = d[i - 1][j] + 1;
            if (d[i][j - 1] + 1 < c) c = d[i][j - 1] + 1;
            d[i][j] = c;
        }
    return d[la][lb];
}

static moe_status unknown(const char *name, moe_error *err) {
    char near[256] = "";
    size_t len = 0;
    int best = 99;
    for (int i = 0; i < moe_patch_table_size(); i++) {
        int dist = edit_distance(name, table[i].name);
        if (dist < best) best = dist;
    }
    for (int i = 0; i < moe_patch_table_size() && best <= 4; i++)
        if (edit_distance(name, table[i].name) == best && len + strlen(table[i].name) + 3 < sizeof near)
            len += (size_t)snprintf(near + len, sizeof near - len, "%s%s", len ? ", " : "", table[i].name);
    if (best <= 4)
        return moe_errf(err, MOE_ERR_ARG, "unknown patch \"%s\" (closest: %s; `moeaudit bisect --list-patches` lists them)",
                        name, near);
    return moe_errf(err, MOE_ERR_ARG, "unknown patch \"%s\" (`moeaudit bisect --list-patches` lists them)", name);
}

static bool parse_int(const char *s, long lo, long hi, long *out) {
    if (!*s) return false;
    long v = 0;
    for (const char *c = s; *c; c++) {
        if (!isdigit((unsigned char)*c)) return false;
        v = v * 10 + (*c - '0');
        if (v > hi) return false;
    }
    if (v < lo) return false;
    *out = v;
    return true;
}

/* One patch from its text. */
static moe_status parse_one(const char *text, const moe_fwd_config *cfg, moe_patch *p, moe_error *err) {
    char buf[96], *phase = NULL, *layers = NULL, *value = NULL;
    if (strlen(text) >= sizeof buf) return moe_errf(err, MOE_ERR_ARG, "patch \"%.40s...\" is too long", text);
    snprintf(buf, sizeof buf, "%s", text);
    memset(p, 0, sizeof *p);
    if ((phase = strchr(buf, ':'))) *phase++ = 0;
    if ((layers = strchr(buf, '@'))) *layers++ = 0;
    if ((value = strchr(buf, '='))) *value++ = 0;
    p->info = moe_patch_find(buf);
    if (!p->info) return unknown(buf, err);
    if (p->info->takes_value) {
        long v;
        if (!value || !parse_int(value, 1, 1L << 20, &v))
            return moe_errf(err, MOE_ERR_ARG, "patch \"%s\": %s takes a positive count (e.g. %s=256)", text,
                            p->info->name, p->info->name);
        p->value = (int)v;
    } else if (value) {
        return moe_errf(err, MOE_ERR_ARG, "patch \"%s\": %s takes no value", text, p->info->name);
    }
    p->phase = p->info->phase;
    if (phase) {
        if (!strcmp(phase, "all")) p->phase = MOE_PHASE_ALL;
        else if (!strcmp(phase, "prefill")) p->phase = MOE_PHASE_PREFILL;
        else if (!strcmp(phase, "decode")) p->phase = MOE_PHASE_DECODE;
        else return moe_errf(err, MOE_ERR_ARG, "patch \"%s\": phase \"%s\" is not all, prefill or decode", text, phase);
    }
    int nl = cfg ? cfg->n_layers : 0;
    p->first = 0;
    p->last = nl > 0 ? nl - 1 : INT_MAX;
    if (layers) {
        if (!cfg)
            return moe_errf(err, MOE_ERR_ARG, "patch \"%s\": a layer range needs the whole model (here patches apply to one block)", text);
        long a, b;
        char *dots = strstr(layers, "..");
        if (dots) {
            *dots = 0;
            if (!parse_int(layers, 0, nl - 1, &a))
                return moe_errf(err, MOE_ERR_ARG, "patch \"%s\": layer %s is not in 0..%d", text, layers, nl - 1);
            b = nl - 1;
            if (dots[2] && !parse_int(dots + 2, a, nl - 1, &b))
                return moe_errf(err, MOE_ERR_ARG, "patch \"%s\": layer range end %s is not in %ld..%d", text, dots + 2, a,
                                nl - 1);
        } else {
            if (!parse_int(layers, 0, nl - 1, &a))
                return moe_errf(err, MOE_ERR_ARG, "patch \"%s\": layer %s is not in 0..%d", text, layers, nl - 1);
            b = a;
        }
        p->first = (int)a;
        p->last = (int)b;
    }
    /* canonical text */
    int len = snprintf(p->text, sizeof p->text, "%s", p->info->name);
    if (p->info->takes_value) len += snprintf(p->text + len, sizeof p->text - (size_t)len, "=%d", p->value);
    if (layers) {
        if (p->first == p->last) len += snprintf(p->text + len, sizeof p->text - (size_t)len, "@%d", p->first);
        else if (p->last == nl - 1) len += snprintf(p->text + len, sizeof p->text - (size_t)len, "@%d..", p->first);
        else len += snprintf(p->text + len, sizeof p->text - (size_t)len, "@%d..%d", p->first, p->last);
    }
    if (p->phase != p->info->phase) snprintf(p->text + len, sizeof p->text - (size_t)len, ":%s", moe_phase_name(p->phase));
    p->first_changed = 0;
    if (cfg) {
        p->first_changed = first_changed(p, cfg);
        if (p->first_changed < 0)
            return moe_errf(err, MOE_ERR_ARG, "patch \"%s\" changes nothing on this model: layers %d..%d have no %s layer",
                            text, p->first, p->last,
                            is_index_comp(p->info->comp[0]) ? "compressed sparse (CSA)" : "compressed (CSA or HCA)");
    }
    return MOE_OK;
}

/* Do patches a and b set one component to different values on a common layer and phase? */
static bool conflict(const moe_patch *a, const moe_patch *b, moe_patch_comp *which) {
    if (a->last < b->first || b->last < a->first || !(a->phase & b->phase)) return false;
    for (int i = 0; i < a->info->n_set; i++)
        for (int j = 0; j < b->info->n_set; j++)
            if (a->info->comp[i] == b->info->comp[j]) {
                int va = a->info->comp[i] == MOE_PC_INDEX_TOPK ? a->value : a->info->value[i];
                int vb = b->info->comp[j] == MOE_PC_INDEX_TOPK ? b->value : b->info->value[j];
                if (va != vb) {
                    *which = a->info->comp[i];
                    return true;
                }
            }
    return false;
}

moe_status moe_patch_set_parse(const char *list, const moe_fwd_config *cfg, moe_patch_set **out, moe_error *err) {
    *out = NULL;
    moe_patch_set *s = moe_calloc(1, sizeof *s);
    if (!s) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
    s->n_layers = cfg ? cfg->n_layers : 0;
    const char *c = list ? list : "";
    moe_status st = MOE_OK;
    while (*c && st == MOE_OK) {
        const char *e = strchr(c, ',');
        size_t len = e ? (size_t)(e - c) : strlen(c);
        char one[128];
        if (len == 0) {
            st = moe_errf(err, MOE_ERR_ARG, "empty patch in the list \"%s\"", list);
            break;
        }
        if (len >= sizeof one) {
            st = moe_errf(err, MOE_ERR_ARG, "patch \"%.40s...\" is too long", c);
            break;
        }
        memcpy(one, c, len);
        one[len] = 0;
        if (s->n == MOE_PATCH_MAX) {
            st = moe_errf(err, MOE_ERR_ARG, "more than %d patches in one list", MOE_PATCH_MAX);
            break;
        }
        st = parse_one(one, cfg, &s->p[s->n], err);
        if (st != MOE_OK) break;
        for (int i = 0; i < s->n && st == MOE_OK; i++) {
            moe_patch_comp which;
            if (!strcmp(s->p[i].text, s->p[s->n].text))
                st = moe_errf(err, MOE_ERR_ARG, "patch \"%s\" is listed twice", s->p[i].text);
            else if (conflict(&s->p[i], &s->p[s->n], &which))
                st = moe_errf(err, MOE_ERR_ARG,
                              "patches \"%s\" and \"%s\" both set the %s component on a common layer: a deployment "
                              "has one; give them disjoint layer ranges (NAME@A..B) or bisect them separately",
                              s->p[i].text, s->p[s->n].text, moe_patch_comp_name(which));
        }
        s->n++;
        c = e ? e + 1 : c + len;
        if (e && !*c) st = moe_errf(err, MOE_ERR_ARG, "empty patch at the end of the list \"%s\"", list);
    }
    if (st != MOE_OK) {
        moe_patch_set_free(s);
        return st;
    }
    *out = s;
    return MOE_OK;
}

static void apply(const moe_patch *p, moe_layer_patch *o) {
    for (int k = 0; k < p->info->n_set; k++) {
        int v = p->info->value[k];
        switch (p->info->comp[k]) {
        case MOE_PC_HC: o->hc_set = true; o->hc = (moe_hc_prec)v; break;
        case MOE_PC_INDEX_Q: o->attn.index_engine = true; o->attn.idx.q_quant = (moe_idx_quant)v; break;
        case MOE_PC_INDEX_K: o->attn.index_engine = true; o->attn.idx.k_quant = (moe_idx_quant)v; break;
        case MOE_PC_INDEX_ACC: o->attn.index_engine = true; o->attn.idx.accum = (moe_idx_accum)v; break;
        case MOE_PC_INDEX_ROT: o->attn.index_engine = true; o->attn.idx.hadamard = v != 0; break;
        case MOE_PC_INDEX_TOPK: o->attn.index_topk = p->value; break;
        case MOE_PC_KV: o->attn.kv = (moe_kv_round)v; break;
        case MOE_PC_ATTN: o->attn.arith = (moe_attn_arith)v; break;
        case MOE_PC_COMPRESS: o->attn.compress_bf16 = v != 0; break;
        case MOE_PC_EXPERTS:
            o->moe.experts = expert_fmts[v].q;
            o->moe.e2m1_round = expert_fmts[v].e2m1_round;
            o->moe.mx_scale_rule = expert_fmts[v].mx_scale_rule;
            break;
        case MOE_PC_SHARED: o->moe.shared = (moe_qfmt)v; break;
        case MOE_PC_ACT: o->moe.act = (moe_act_prec)v; break;
        case MOE_PC_ROUTER: o->moe.router = (moe_router_prec)v; break;
        case MOE_PC_FAULT: o->moe.fault = (moe_fault)v; break;
        case MOE_PC_COUNT: MOE_ASSERT(0); break;
        }
        if (is_moe_comp(p->info->comp[k])) o->moe_set = true;
    }
}

void moe_patch_layer(const moe_patch_set *s, uint64_t mask, int layer, moe_phase phase, moe_layer_patch *out) {
    *out = moe_layer_patch_none();
    if (!s) return;
    for (int i = 0; i < s->n; i++) {
        const moe_patch *p = &s->p[i];
        if (!(mask >> i & 1) || layer < p->first || layer > p->last || !(p->phase & phase)) continue;
        apply(p, out);
    }
}

int moe_patch_first_changed(const moe_patch_set *s, uint64_t mask, moe_phase phases) {
    int f = INT32_MAX;
    for (int i = 0; s && i < s->n; i++)
        if ((mask >> i & 1) && (s->p[i].phase & phases) && s->p[i].first_changed < f) f = s->p[i].first_changed;
    return f;
}

bool moe_patch_any_in(const moe_patch_set *s, uint64_t mask, moe_phase phase) {
    for (int i = 0; s && i < s->n; i++)
        if ((mask >> i & 1) && (s->p[i].phase & phase)) return true;
    return false;
}

char *moe_patch_set_text(const moe_patch_set *s, uint64_t mask, char *buf, size_t cap) {
    size_t len = 0;
    if (cap) buf[0] = 0;
    for (int i = 0; s && i < s->n; i++) {
        if (!(mask >> i & 1)) continue;
        int w = snprintf(buf + len, cap > len ? cap - len : 0, "%s%s", len ? "," : "", s->p[i].text);
        if (w < 0 || len + (size_t)w >= cap) break;
        len += (size_t)w;
    }
    return buf;
}

/* ------------------------------------------------------------- MoE block */

moe_status moe_patch_check_layer(const moe_patch_set *s, const moe_layer *L, moe_error *err) {
    for (int i = 0; s && i < s->n; i++) {
        const moe_patch *p = &s->p[i];
        if (L->index < p->first || L->index > p->last) continue;
        moe_layer_patch lp = moe_layer_patch_none();
        apply(p, &lp);
        const moe_moe_patch *m = &lp.moe;
        int blk = m->experts == MOE_Q_MXFP4 ? 32 : m->experts == MOE_Q_NVFP4 ? 16 : 1;
        if (L->cfg.hidden % blk || L->cfg.inter % blk)
            return moe_errf(err, MOE_ERR_SHAPE,
                            "patch %s cannot apply to layer %d: its experts are [%d, %d] and [%d, %d] (w1/w3, w2), "
                            "and %s needs input columns in blocks of %d",
                            p->text, L->index, L->cfg.inter, L->cfg.hidden, L->cfg.hidden, L->cfg.inter,
                            moe_qfmt_name(m->experts), blk);
        if ((m->shared != MOE_Q_NONE || m->fault == MOE_FAULT_SHARED_WEIGHT) && L->cfg.shared_inter == 0)
            return moe_errf(err, MOE_ERR_ARG, "patch %s cannot apply to layer %d: it has no shared expert", p->text,
                            L->index);
    }
    return MOE_OK;
}

static moe_status quantized(moe_patch_set *s, const moe_layer *L, const moe_moe_patch *mp, const moe_layer **out,
                            moe_error *err) {
    *out = L;
    if (mp->experts == MOE_Q_NONE && mp->shared == MOE_Q_NONE) return MOE_OK;
    moe_quant_opts q;
    memset(&q, 0, sizeof q);
    q.experts = mp->experts;
    q.others = mp->shared;
    q.e2m1_round = mp->e2m1_round;
    q.mx_scale_rule = mp->mx_scale_rule;
    for (int i = 0; i < s->n_cache; i++)
        if (s->cache[i].layer == L->index && !memcmp(&s->cache[i].q, &q, sizeof q)) {
            *out = s->cache[i].L;
            return MOE_OK;
        }
    if (s->n_cache == s->cap_cache) {
        int cap = s->cap_cache ? 2 * s->cap_cache : 8;
        qentry *c = realloc(s->cache, (size_t)cap * sizeof *c);
        if (!c) return moe_errf(err, MOE_ERR_NOMEM, "out of memory");
        s->cache = c;
        s->cap_cache = cap;
    }
    moe_layer *Q = NULL;
    moe_status st = moe_layer_quantize(L, &q, &Q, err);
    if (st != MOE_OK) return st;
    s->cache[s->n_cache].layer = L->index;
    s->cache[s->n_cache].q = q;
    s->cache[s->n_cache].L = Q;
    s->n_cache++;
    *out = Q;
    return MOE_OK;
}

moe_status moe_patch_moe_run(moe_patch_set *s, const moe_layer *L, const moe_moe_patch *mp, const double *x,
                             const int64_t *ids, int64_t T, const moe_run_opts *o, double *out, moe_error *err) {
    MOE_ASSERT(s && L && mp && o);
    const moe_layer *QL = NULL;
    moe_status st = quantized(s, L, mp, &QL, err);
    if (st != MOE_OK) return st;
    moe_run_opts ro = *o;
    if (mp->act != MOE_ACT_EXACT) ro.act = mp->act;
    if (mp->router != MOE_ROUTER_PATH) ro.router = mp->router;
    moe_variant v = moe_variant_none();
    v.fault = mp->fault;
    if (mp->fault == MOE_FAULT_SHARED_WEIGHT) ro.fuse_shared = true;
    moe_block_out bo;
    st = moe_block_out_init(&bo, QL, T, &ro, err);
    if (st == MOE_OK) st = moe_block_run_variant(QL, x, ids, T, &ro, &v, &bo, err);
    if (st == MOE_OK) memcpy(out, bo.moe_out, (size_t)T * (size_t)QL->cfg.hidden * sizeof(double));
    moe_block_out_free(&bo);
    return st;
}
