/*
 * Every published layout of shared/design/layouts/ as shipped: tiny copies
 * written here with the library's safetensors writer (the names, dtypes,
 * shapes, config keys and quant config files of each release), loaded
 * through moe_model_open / moe_model_layer / moe_idx_load, and every weight
 * value checked against an independent decoder written below from the
 * format definitions (not the library's). Then the declarations: a
 * checkpoint that contradicts its own quantization declaration is refused
 * with a message naming both.
 *
 * The independent decoders (dec_*) use ldexp and tables only: E4M3 as
 * (1 + m/8) 2^(e-7) (subnormal m/8 2^-6), E2M1 by its eight magnitudes,
 * E8M0 as 2^(e-127), BF16 as the top half of a float.
 */
#include "harness.h"
#include "io/weights.h"
#include "moe_formats.h"
#include "moeaudit_indexer.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <regex.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

/* ------------------------------------------------------ independent decoders */

static double dec_e4m3(uint8_t b) {
    int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
    if (e == 15 && m == 7) return NAN;
    double v = e == 0 ? ldexp(m / 8.0, -6) : ldexp(1.0 + m / 8.0, e - 7);
    return s ? -v : v;
}
static double dec_e2m1(uint8_t c) {
    static const double mag[8] = {0, 0.5, 1, 1.5, 2, 3, 4, 6};
    return (c & 8) ? -mag[c & 7] : mag[c & 7];
}
static double dec_e8m0(uint8_t e) { return e == 255 ? NAN : ldexp(1.0, (int)e - 127); }
static double dec_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}
static float bf16_val(float x) { /* truncate to a bf16 value (exactly representable) */
    uint32_t u;
    memcpy(&u, &x, 4);
    u &= 0xFFFF0000u;
    memcpy(&x, &u, 4);
    return x;
}

/* ---------------------------------------------------------- a tiny writer */

#define TB_MAX 1024
typedef struct tb {
    moe_st_entry e[TB_MAX];
    char names[TB_MAX][128];
    void *bufs[TB_MAX];
    int n;
} tb;

static void *tb_add(tb *b, const char *name, moe_dtype dt, int ndim, int64_t d0, int64_t d1, int64_t d2) {
    MOE_ASSERT(b->n < TB_MAX);
    int i = b->n++;
    snprintf(b->names[i], sizeof b->names[i], "%s", name);
    moe_st_entry *e = &b->e[i];
    memset(e, 0, sizeof *e);
    e->name = b->names[i];
    e->dtype = dt;
    e->ndim = ndim;
    int64_t d[3] = {d0, d1, d2}, n = 1;
    for (int k = 0; k < ndim; k++) { e->shape[k] = d[k]; n *= d[k]; }
    b->bufs[i] = calloc((size_t)n * moe_dtype_size(dt) + 8, 1);
    e->data = b->bufs[i];
    return b->bufs[i];
}

static const void *tb_get(const tb *b, const char *name) {
    for (int i = 0; i < b->n; i++)
        if (!strcmp(b->names[i], name)) return b->bufs[i];
    return NULL;
}

static void tb_free(tb *b) {
    for (int i = 0; i < b->n; i++) free(b->bufs[i]);
    b->n = 0;
}

static void put_text(const char *dir, const char *file, const char *text) {
    char p[700];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    FILE *f = fopen(p, "w");
    if (!f) { CHECK(0, "cannot write %s", p); return; }
    fputs(text, f);
    fclose(f);
}

/* Write b into dir: one model.safetensors, or n_shards shards with an index. */
static void tb_write(tb *b, const char *dir, int n_shards) {
    mkdir(dir, 0755);
    moe_error err;
    char p[700];
    if (n_shards <= 1) {
        snprintf(p, sizeof p, "%s/model.safetensors", dir);
        CHECK_OK(moe_st_write(p, b->e, (size_t)b->n, NULL, &err), err);
        return;
    }
    size_t cap = 64 + (size_t)b->n * 200;
    char *idx = malloc(cap);
    size_t o = (size_t)snprintf(idx, cap, "{\"metadata\": {}, \"weight_map\": {");
    int per = (b->n + n_shards - 1) / n_shards;
    for (int s = 0; s < n_shards; s++) {
        int i0 = s * per, i1 = i0 + per < b->n ? i0 + per : b->n;
        char file[64];
        snprintf(file, sizeof file, "model-%05d-of-%05d.safetensors", s + 1, n_shards);
        snprintf(p, sizeof p, "%s/%s", dir, file);
        if (i1 > i0) CHECK_OK(moe_st_write(p, b->e + i0, (size_t)(i1 - i0), NULL, &err), err);
        for (int i = i0; i < i1; i++)
            o += (size_t)snprintf(idx + o, cap - o, "%s\"%s\": \"%s\"", o > 40 ? ", " : "", b->names[i], file);
    }
    snprintf(idx + o, cap - o, "}}");
    put_text(dir, "model.safetensors.index.json", idx);
    free(idx);
}

/* ------------------------------------------------------ linears by layout */

typedef enum wf {
    WF_BF16,
    WF_FP8_INV,     /* F8_E4M3 + weight_scale_inv F32 [R/128, C/128] (DeepSeek V3 HF) */
    WF_FP8_E8M0,    /* F8_E4M3 + .scale F8_E8M0 [R/128, C/128] (DeepSeek V4) */
    WF_FP8_B32,     /* F8_E4M3 + .scale F8_E8M0 [R/32, C/32] (V4.1 weight_block_size [32, 32]) */
    WF_FP8_TENSOR,  /* F8_E4M3 + weight_scale F32 [] + input_scale F32 [] (ModelOpt FP8) */
    WF_FP8_CT,      /* F8_E4M3 + weight_scale BF16 [R/128, C/128] (compressed-tensors FP8_BLOCK) */
    WF_MXFP4,       /* I8 [R, C/2] + .scale F8_E8M0 [R, C/32] (DeepSeek V4 experts) */
    WF_NVFP4_MO,    /* U8 [R, C/2] + weight_scale F8_E4M3 [R, C/16] + weight_scale_2 [] + input_scale [] */
    WF_NVFP4_CT     /* weight_packed U8 + weight_scale F8_E4M3 + weight_global_scale [1] + input_global_scale [1] */
} wf;

static uint8_t rnd_fp8(uint64_t *s) {
    for (;;) {
        uint8_t b = (uint8_t)moe_splitmix64(s);
        if ((b & 0x7F) != 0x7F) return b;
    }
}

static int64_t cdiv(int64_t a, int64_t b) { return (a + b - 1) / b; }

/* Write one linear [R, C] named base in layout f with random codes. */
static void add_linear(tb *b, const char *base, int64_t R, int64_t C, wf f, uint64_t *s) {
    char n[240]; /* base (< 200) + a suffix */
    int br = f == WF_FP8_B32 ? 32 : 128;
    switch (f) {
    case WF_BF16: {
        snprintf(n, sizeof n, "%s.weight", base);
        uint16_t *w = tb_add(b, n, MOE_DTYPE_BF16, 2, R, C, 0);
        for (int64_t i = 0; i < R * C; i++) {
            float v = bf16_val((float)(0.2 * moe_t_rng_normal(s)));
            uint32_t u;
            memcpy(&u, &v, 4);
            w[i] = (uint16_t)(u >> 16);
        }
        return;
    }
    case WF_FP8_INV: case WF_FP8_E8M0: case WF_FP8_B32: case WF_FP8_TENSOR: case WF_FP8_CT: {
        snprintf(n, sizeof n, "%s.weight", base);
        uint8_t *w = tb_add(b, n, MOE_DTYPE_F8_E4M3, 2, R, C, 0);
        for (int64_t i = 0; i < R * C; i++) w[i] = rnd_fp8(s);
        int64_t gr = cdiv(R, br), gc = cdiv(C, br);
        if (f == WF_FP8_INV) {
            snprintf(n, sizeof n, "%s.weight_scale_inv", base);
            float *sc = tb_add(b, n, MOE_DTYPE_F32, 2, gr, gc, 0);
            for (int64_t i = 0; i < gr * gc; i++) sc[i] = (float)(1e-3 * (1 + moe_t_rng_unif(s)));
        } else if (f == WF_FP8_E8M0 || f == WF_FP8_B32) {
            snprintf(n, sizeof n, "%s.scale", base);
            uint8_t *sc = tb_add(b, n, MOE_DTYPE_F8_E8M0, 2, gr, gc, 0);
            for (int64_t i = 0; i < gr * gc; i++) sc[i] = (uint8_t)(112 + moe_splitmix64(s) % 8);
        } else if (f == WF_FP8_TENSOR) {
            snprintf(n, sizeof n, "%s.weight_scale", base);
            float *sc = tb_add(b, n, MOE_DTYPE_F32, 0, 0, 0, 0);
            *sc = (float)(7e-4 * (1 + moe_t_rng_unif(s)));
            snprintf(n, sizeof n, "%s.input_scale", base);
            float *is = tb_add(b, n, MOE_DTYPE_F32, 0, 0, 0, 0);
            *is = 0.01f;
        } else {
            snprintf(n, sizeof n, "%s.weight_scale", base);
            uint16_t *sc = tb_add(b, n, MOE_DTYPE_BF16, 2, gr, gc, 0);
            for (int64_t i = 0; i < gr * gc; i++) {
                float v = bf16_val((float)(1e-3 * (1 + moe_t_rng_unif(s))));
                uint32_t u;
                memcpy(&u, &v, 4);
                sc[i] = (uint16_t)(u >> 16);
            }
        }
        return;
    }
    case WF_MXFP4: {
        snprintf(n, sizeof n, "%s.weight", base);
        uint8_t *w = tb_add(b, n, MOE_DTYPE_I8, 2, R, C / 2, 0);
        for (int64_t i = 0; i < R * C / 2; i++) w[i] = (uint8_t)moe_splitmix64(s);
        snprintf(n, sizeof n, "%s.scale", base);
        uint8_t *sc = tb_add(b, n, MOE_DTYPE_F8_E8M0, 2, R, C / 32, 0);
        for (int64_t i = 0; i < R * C / 32; i++) sc[i] = (uint8_t)(118 + moe_splitmix64(s) % 6);
        return;
    }
    case WF_NVFP4_MO: case WF_NVFP4_CT: {
        snprintf(n, sizeof n, f == WF_NVFP4_MO ? "%s.weight" : "%s.weight_packed", base);
        uint8_t *w = tb_add(b, n, MOE_DTYPE_U8, 2, R, C / 2, 0);
        for (int64_t i = 0; i < R * C / 2; i++) w[i] = (uint8_t)moe_splitmix64(s);
        snprintf(n, sizeof n, "%s.weight_scale", base);
        uint8_t *sc = tb_add(b, n, MOE_DTYPE_F8_E4M3, 2, R, C / 16, 0);
        for (int64_t i = 0; i < R * C / 16; i++) sc[i] = (uint8_t)(0x20 + moe_splitmix64(s) % 0x40);
        if (f == WF_NVFP4_MO) {
            snprintf(n, sizeof n, "%s.weight_scale_2", base);
            *(float *)tb_add(b, n, MOE_DTYPE_F32, 0, 0, 0, 0) = (float)(3e-4 * (1 + moe_t_rng_unif(s)));
            snprintf(n, sizeof n, "%s.input_scale", base);
            /* ModelOpt syncs experts' input amax in practice; these differ,
             * so that the per-layer and per-expert activation rules differ */
            *(float *)tb_add(b, n, MOE_DTYPE_F32, 0, 0, 0, 0) = 0.001f * (float)(1 + moe_splitmix64(s) % 4);
        } else {
            snprintf(n, sizeof n, "%s.weight_global_scale", base);
            *(float *)tb_add(b, n, MOE_DTYPE_F32, 1, 1, 0, 0) = (float)(3000 * (1 + moe_t_rng_unif(s)));
            snprintf(n, sizeof n, "%s.input_global_scale", base);
            *(float *)tb_add(b, n, MOE_DTYPE_F32, 1, 1, 0, 0) = 500.0f;
        }
        return;
    }
    }
}

/* The value of element (r, c) of linear base written as f, from the test's
 * own buffers; also the static input scale the layout carries (0: none). */
static double expect_at(const tb *b, const char *base, int64_t R, int64_t C, wf f, int64_t r, int64_t c,
                        double *in_scale) {
    char n[240]; /* base (< 200) + a suffix */
    int br = f == WF_FP8_B32 ? 32 : 128;
    int64_t gc = cdiv(C, br);
    *in_scale = 0;
    (void)R;
    switch (f) {
    case WF_BF16:
        snprintf(n, sizeof n, "%s.weight", base);
        return dec_bf16(((const uint16_t *)tb_get(b, n))[r * C + c]);
    case WF_FP8_INV: case WF_FP8_E8M0: case WF_FP8_B32: case WF_FP8_TENSOR: case WF_FP8_CT: {
        snprintf(n, sizeof n, "%s.weight", base);
        double v = dec_e4m3(((const uint8_t *)tb_get(b, n))[r * C + c]);
        size_t si = (size_t)((r / br) * gc + c / br);
        if (f == WF_FP8_INV) {
            snprintf(n, sizeof n, "%s.weight_scale_inv", base);
            return v * ((const float *)tb_get(b, n))[si];
        }
        if (f == WF_FP8_E8M0 || f == WF_FP8_B32) {
            snprintf(n, sizeof n, "%s.scale", base);
            return v * dec_e8m0(((const uint8_t *)tb_get(b, n))[si]);
        }
        if (f == WF_FP8_TENSOR) { /* its input_scale (static FP8 activations) is not an NVFP4 scale: unused */
            snprintf(n, sizeof n, "%s.weight_scale", base);
            return v * *(const float *)tb_get(b, n);
        }
        snprintf(n, sizeof n, "%s.weight_scale", base);
        return v * dec_bf16(((const uint16_t *)tb_get(b, n))[si]);
    }
    case WF_MXFP4: {
        snprintf(n, sizeof n, "%s.weight", base);
        uint8_t byte = ((const uint8_t *)tb_get(b, n))[r * (C / 2) + c / 2];
        uint8_t code = (c & 1) ? byte >> 4 : byte & 15; /* element 2j in the low nibble */
        snprintf(n, sizeof n, "%s.scale", base);
        return dec_e2m1(code) * dec_e8m0(((const uint8_t *)tb_get(b, n))[r * (C / 32) + c / 32]);
    }
    case WF_NVFP4_MO: case WF_NVFP4_CT: {
        snprintf(n, sizeof n, f == WF_NVFP4_MO ? "%s.weight" : "%s.weight_packed", base);
        uint8_t byte = ((const uint8_t *)tb_get(b, n))[r * (C / 2) + c / 2];
        uint8_t code = (c & 1) ? byte >> 4 : byte & 15;
        snprintf(n, sizeof n, "%s.weight_scale", base);
        double bs = dec_e4m3(((const uint8_t *)tb_get(b, n))[r * (C / 16) + c / 16]);
        if (f == WF_NVFP4_MO) {
            snprintf(n, sizeof n, "%s.input_scale", base);
            *in_scale = *(const float *)tb_get(b, n);
            snprintf(n, sizeof n, "%s.weight_scale_2", base);
            return dec_e2m1(code) * bs * *(const float *)tb_get(b, n);
        }
        /* compressed-tensors: x_q * (scale / global_scale) */
        snprintf(n, sizeof n, "%s.input_global_scale", base);
        *in_scale = (float)(1.0 / *(const float *)tb_get(b, n));
        snprintf(n, sizeof n, "%s.weight_global_scale", base);
        return dec_e2m1(code) * bs / *(const float *)tb_get(b, n);
    }
    }
    return NAN;
}

/* Every element of the loaded w equals the independent decoding, bit for
 * bit in float64; the input scale too. Returns the number of mismatches. */
static int64_t check_linear(const tb *b, const moe_weight *w, const char *base, int64_t R, int64_t C, wf f) {
    if (w->rows != R || w->cols != C) {
        CHECK(0, "%s: shape [%lld, %lld]", base, (long long)w->rows, (long long)w->cols);
        return 1;
    }
    double *row = malloc((size_t)C * sizeof *row);
    int64_t bad = 0;
    double in = 0;
    for (int64_t r = 0; r < R; r++) {
        moe_weight_row_f64(w, r, row);
        for (int64_t c = 0; c < C; c++) {
            double want = expect_at(b, base, R, C, f, r, c, &in);
            if (!(row[c] == want || (isnan(row[c]) && isnan(want)))) {
                if (bad++ < 3) CHECK(0, "%s[%lld][%lld] = %.17g, independent decoder %.17g", base, (long long)r,
                                     (long long)c, row[c], want);
            }
        }
    }
    free(row);
    CHECK((double)w->input_scale == (double)(float)in, "%s: input_scale %g, layout %g", base, w->input_scale, in);
    CHECK(bad == 0, "%s: %lld mismatches", base, (long long)bad);
    return bad;
}

/* ---------------------------------------------------------- MoE layers */

enum { H = 64, I = 32, E = 4, K = 2, VOCAB = 16 };

typedef struct names {
    const char *ffn;          /* "layers.1.ffn" / "model.layers.1.mlp" / "mtp.0.ffn" */
    bool v4;                  /* w1/w2/w3 + gate.bias, else gate_proj/... + e_score_correction_bias */
} names;

static void proj_base(char *out, size_t cap, const names *nm, int e, int k) {
    static const char *const v4p[3] = {"w1", "w3", "w2"}, *const v3p[3] = {"gate_proj", "up_proj", "down_proj"};
    if (e >= 0) snprintf(out, cap, "%s.experts.%d.%s", nm->ffn, e, nm->v4 ? v4p[k] : v3p[k]);
    else snprintf(out, cap, "%s.shared_experts.%s", nm->ffn, nm->v4 ? v4p[k] : v3p[k]);
}

/* A MoE block: BF16 router, F32 bias (top-k) or I64 tid2eid (hash), experts
 * in fe, the shared expert in fs. */
static void add_moe(tb *b, const names *nm, bool hash, wf fe, wf fs, uint64_t *s) {
    char n[200];
    snprintf(n, sizeof n, "%s.gate", nm->ffn);
    add_linear(b, n, E, H, WF_BF16, s);
    if (hash) {
        snprintf(n, sizeof n, "%s.gate.tid2eid", nm->ffn);
        int64_t *t = tb_add(b, n, MOE_DTYPE_I64, 2, VOCAB, K, 0);
        for (int v = 0; v < VOCAB; v++)
            for (int k = 0; k < K; k++) t[v * K + k] = (v + k) % E;
    } else {
        snprintf(n, sizeof n, "%s.gate.%s", nm->ffn, nm->v4 ? "bias" : "e_score_correction_bias");
        float *bias = tb_add(b, n, MOE_DTYPE_F32, 1, E, 0, 0);
        for (int e = 0; e < E; e++) bias[e] = (float)(0.01 * e);
    }
    for (int e = -1; e < E; e++)
        for (int k = 0; k < 3; k++) {
            proj_base(n, sizeof n, nm, e, k);
            add_linear(b, n, k == 2 ? H : I, k == 2 ? I : H, e < 0 ? fs : fe, s);
        }
}

/* Every weight of a loaded layer against the test's buffers. */
static void check_moe(const tb *b, const moe_layer *L, const names *nm, wf fe, wf fs) {
    char n[200];
    CHECK(L->cfg.n_experts == E && L->cfg.hidden == H && L->cfg.inter == I, "config of %s", nm->ffn);
    snprintf(n, sizeof n, "%s.gate", nm->ffn);
    check_linear(b, &L->gate, n, E, H, WF_BF16);
    for (int e = -1; e < E; e++)
        for (int k = 0; k < 3; k++) {
            const moe_weight *w = e < 0 ? (k == 0 ? &L->sw1 : k == 1 ? &L->sw3 : &L->sw2)
                                        : (k == 0 ? &L->w1[e] : k == 1 ? &L->w3[e] : &L->w2[e]);
            proj_base(n, sizeof n, nm, e, k);
            check_linear(b, w, n, k == 2 ? H : I, k == 2 ? I : H, e < 0 ? fs : fe);
        }
}

/* The block on 9 tokens in float64 and float32: finite, and float32 within
 * a loose bound of float64 (the weights' values are what this file tests;
 * the block's arithmetic is test-block's). */
static void run_block(const moe_layer *L, const char *what) {
    enum { T = 9 };
    const int Hl = L->cfg.hidden; /* the dataset's layers are wider than this file's */
    double *hidden = malloc(sizeof(double) * T * (size_t)Hl);
    int64_t ids[T];
    uint64_t s = 77;
    for (int i = 0; i < T * Hl; i++) hidden[i] = moe_t_rng_normal(&s);
    for (int t = 0; t < T; t++) ids[t] = t % VOCAB;
    moe_error err;
    moe_run_opts o = moe_run_opts_default();
    o.check_invariants = true;
    moe_block_out ref, f32;
    CHECK_OK(moe_block_out_init(&ref, L, T, &o, &err), err);
    moe_status st = moe_block_run(L, hidden, ids, T, &o, &ref, &err);
    CHECK(st == MOE_OK, "%s: float64 run: %s", what, err.msg);
    o.precision = MOE_PREC_F32;
    CHECK_OK(moe_block_out_init(&f32, L, T, &o, &err), err);
    st = moe_block_run(L, hidden, ids, T, &o, &f32, &err);
    CHECK(st == MOE_OK, "%s: float32 run: %s", what, err.msg);
    double num = 0, den = 0;
    bool finite = true;
    for (int i = 0; i < T * Hl; i++) {
        finite = finite && isfinite(ref.moe_out[i]);
        num += (f32.moe_out[i] - ref.moe_out[i]) * (f32.moe_out[i] - ref.moe_out[i]);
        den += ref.moe_out[i] * ref.moe_out[i];
    }
    /* float32 dot products of length <= 64 over values < 1e2: relative
     * error ~ 64 * 2^-24, far inside 1e-5 */
    CHECK(finite && den > 0 && sqrt(num / den) < 1e-5, "%s: f32 vs f64 relative %.3g", what, sqrt(num / den));
    moe_block_out_free(&ref);
    moe_block_out_free(&f32);
    free(hidden);
}

static char *fresh_dir(const char *name) {
    static char buf[8][512];
    static int at;
    char *d = buf[at++ % 8];
    moe_t_tmp_path(d, 512, name);
    mkdir(d, 0755);
    return d;
}

/* config.json text for the synthetic layouts: V4 native keys (the key list
 * alone, to nest it under text_config) or HF V3 keys. */
static void v4_keys(char *out, size_t cap, const char *model_type, int n_layers, int n_hash, int n_mtp) {
    snprintf(out, cap,
             "\"model_type\": \"%s\", \"hidden_size\": %d, \"moe_intermediate_size\": %d, \"n_routed_experts\": %d,"
             " \"num_experts_per_tok\": %d, \"n_shared_experts\": 1, \"num_hidden_layers\": %d,"
             " \"num_hash_layers\": %d, \"num_nextn_predict_layers\": %d, \"vocab_size\": %d,"
             " \"scoring_func\": \"sqrtsoftplus\", \"routed_scaling_factor\": 1.5, \"swiglu_limit\": 10.0,"
             " \"norm_topk_prob\": true",
             model_type, H, I, E, K, n_layers, n_hash, n_mtp, VOCAB);
}

static void v4_config(char *out, size_t cap, int n_layers, int n_hash, int n_mtp, const char *extra) {
    char keys[1024];
    v4_keys(keys, sizeof keys, "deepseek_v4", n_layers, n_hash, n_mtp);
    snprintf(out, cap, "{\"architectures\": [\"DeepseekV4ForCausalLM\"], %s%s%s}", keys, extra ? ", " : "",
             extra ? extra : "");
}

static void v3_config(char *out, size_t cap, int n_layers, int n_mtp, const char *extra) {
    snprintf(out, cap,
             "{\"architectures\": [\"DeepseekV3ForCausalLM\"], \"model_type\": \"deepseek_v3\", \"hidden_size\": %d,"
             " \"intermediate_size\": 96, \"moe_intermediate_size\": %d, \"n_routed_experts\": %d,"
             " \"num_experts_per_tok\": %d, \"n_shared_experts\": 1, \"num_hidden_layers\": %d,"
             " \"first_k_dense_replace\": 1, \"n_group\": 2, \"topk_group\": 1, \"num_nextn_predict_layers\": %d,"
             " \"vocab_size\": %d, \"scoring_func\": \"sigmoid\", \"routed_scaling_factor\": 2.5,"
             " \"norm_topk_prob\": true, \"topk_method\": \"noaux_tc\"%s%s}",
             H, I, E, K, n_layers, n_mtp, VOCAB, extra ? ", " : "", extra ? extra : "");
}

static const char v4_fp8_qc[] =
    "\"expert_dtype\": \"fp4\", \"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\","
    " \"quant_method\": \"fp8\", \"scale_fmt\": \"ue8m0\", \"weight_block_size\": [128, 128]}";

/* ------------------------------------------------------------- the tests */

/* ------------------------------------------------------------- inspect */

/* moe_inspect_dir on dir: the routed experts' scheme of layer l contains
 * `experts`, its moeaudit column starts with `run`, and capability `what`
 * (when given) is `ok`. */
static void inspect_expect(const char *dir, int l, const char *experts, const char *run, const char *what, bool ok) {
    moe_inspect r;
    moe_error err;
    moe_status st = moe_inspect_dir(dir, &r, &err);
    CHECK(st == MOE_OK, "inspect %s: %s", dir, err.msg);
    if (st != MOE_OK) return;
    CHECK(l < r.n_layer_info, "inspect %s: %d layers", dir, r.n_layer_info);
    if (l < r.n_layer_info) {
        CHECK(!experts || strstr(r.layers[l].experts, experts), "inspect %s layer %d experts: %s", dir, l, r.layers[l].experts);
        CHECK(!run || !strncmp(r.layers[l].runnable, run, strlen(run)), "inspect %s layer %d: %s", dir, l, r.layers[l].runnable);
    }
    if (what) {
        int i = 0;
        while (i < r.n_runs && strncmp(r.runs[i].what, what, strlen(what))) i++;
        CHECK(i < r.n_runs && r.runs[i].ok == ok, "inspect %s: %s %s (%s)", dir, what, ok ? "yes" : "no",
              i < r.n_runs ? r.runs[i].why : "absent");
    }
    moe_inspect_free(&r);
}

/* V4-Flash as DeepSeek ships it, with its MTP block (mtp.0.*): I8 MXFP4
 * experts, FP8 + E8M0 shared experts and MTP projections, 3 shards. */
static void test_v4_flash(void) {
    tb b = {0};
    uint64_t s = 1;
    names l0 = {"layers.0.ffn", true}, l1 = {"layers.1.ffn", true}, mtp = {"mtp.0.ffn", true};
    add_moe(&b, &l0, true, WF_MXFP4, WF_FP8_E8M0, &s);
    add_moe(&b, &l1, false, WF_MXFP4, WF_FP8_E8M0, &s);
    add_moe(&b, &mtp, false, WF_MXFP4, WF_FP8_E8M0, &s);
    add_linear(&b, "mtp.0.e_proj", H, H, WF_FP8_E8M0, &s);
    add_linear(&b, "mtp.0.h_proj", H, H, WF_FP8_E8M0, &s);
    char *dir = fresh_dir("v4-flash");
    char cfg[2048];
    v4_config(cfg, sizeof cfg, 2, 1, 1, v4_fp8_qc);
    put_text(dir, "config.json", cfg);
    tb_write(&b, dir, 3);
    moe_model *m = NULL;
    moe_error err;
    moe_status st = moe_model_open(dir, &m, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) { tb_free(&b); return; }
    CHECK(moe_model_get_info(m)->n_mtp == 1 && moe_model_get_info(m)->n_layers == 2, "MTP counted");
    const moe_layer *L;
    moe_layer_kind kind;
    CHECK_OK(moe_model_layer_kind(m, 2, &kind, &err), err);
    CHECK(kind == MOE_LAYER_TOPK, "the MTP block is a top-k MoE block");
    names *nm[3] = {&l0, &l1, &mtp};
    for (int l = 0; l < 3; l++) {
        st = moe_model_layer(m, l, &L, &err);
        CHECK(st == MOE_OK, "layer %d: %s", l, err.msg);
        if (st != MOE_OK) continue;
        check_moe(&b, L, nm[l], WF_MXFP4, WF_FP8_E8M0);
        CHECK(L->w1[0].fmt == MOE_WFMT_MXFP4 && L->sw1.fmt == MOE_WFMT_FP8_BLOCK, "formats");
        run_block(L, nm[l]->ffn);
    }
    st = moe_model_layer(m, 3, &L, &err);
    CHECK(st == MOE_ERR_ARG && strstr(err.msg, "MTP"), "past the MTP block: %s", err.msg);
    moe_model_free(m);
    inspect_expect(dir, 2, "mxfp4 (I8 + .scale F8_E8M0)", "yes", "run / audit", true);
    inspect_expect(dir, 1, NULL, NULL, "--act nvfp4", false);
    /* the MTP projections through the weight loader (the whole-model forward's way in) */
    moe_ckpt *ck = NULL;
    CHECK_OK(moe_ckpt_open(dir, &ck, &err), err);
    moe_weight w;
    CHECK_OK(moe_weight_load(ck, "mtp.0.e_proj", H, H, &w, NULL, &err), err);
    check_linear(&b, &w, "mtp.0.e_proj", H, H, WF_FP8_E8M0);
    moe_ckpt_free(ck);
    tb_free(&b);
}

/* The committed V4-Flash-layout dataset (tests/data/dsv4-flash-layout,
 * written by numpy from the layout doc): its MTP block and the CSA layer's
 * FP8 indexer wq_b load, and their values match the independent decoder. */
static void test_v4_flash_dataset(void) {
    moe_model *m = NULL;
    moe_error err;
    const char *dir = moe_t_data("dsv4-flash-layout");
    char d[1024];
    snprintf(d, sizeof d, "%s", dir);
    moe_status st = moe_model_open(d, &m, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    const moe_model_info *info = moe_model_get_info(m);
    CHECK(info->n_layers == 3 && info->n_mtp == 1, "3 layers + 1 MTP block");
    const moe_layer *L;
    st = moe_model_layer(m, 3, &L, &err);
    CHECK(st == MOE_OK, "the MTP block: %s", err.msg);
    if (st == MOE_OK) {
        /* mtp.0.ffn.experts.3.w2 [128, 192] MXFP4 I8 and shared w1 [192, 128] FP8 (partial 128x128 tile) */
        moe_ckpt *ck = NULL;
        CHECK_OK(moe_ckpt_open(d, &ck, &err), err);
        const moe_st_tensor *q = NULL, *sc = NULL;
        CHECK_OK(moe_ckpt_find(ck, "mtp.0.ffn.experts.3.w2.weight", &q, &err), err);
        CHECK_OK(moe_ckpt_find(ck, "mtp.0.ffn.experts.3.w2.scale", &sc, &err), err);
        CHECK(q->dtype == MOE_DTYPE_I8 && sc->dtype == MOE_DTYPE_F8_E8M0, "release dtypes");
        const moe_weight *w = &L->w2[3];
        int64_t R = w->rows, C = w->cols, bad = 0;
        double *row = malloc((size_t)C * sizeof *row);
        for (int64_t r = 0; r < R; r++) {
            moe_weight_row_f64(w, r, row);
            for (int64_t c = 0; c < C; c++) {
                uint8_t byte = ((const uint8_t *)q->data)[r * (C / 2) + c / 2];
                double want = dec_e2m1((c & 1) ? byte >> 4 : byte & 15) *
                              dec_e8m0(((const uint8_t *)sc->data)[r * (C / 32) + c / 32]);
                bad += row[c] != want;
            }
        }
        CHECK(bad == 0, "MTP expert 3 w2: %lld mismatches", (long long)bad);
        CHECK_OK(moe_ckpt_find(ck, "mtp.0.ffn.shared_experts.w1.weight", &q, &err), err);
        CHECK_OK(moe_ckpt_find(ck, "mtp.0.ffn.shared_experts.w1.scale", &sc, &err), err);
        w = &L->sw1;
        R = w->rows;
        C = w->cols;
        bad = 0;
        free(row);
        row = malloc((size_t)C * sizeof *row);
        for (int64_t r = 0; r < R; r++) {
            moe_weight_row_f64(w, r, row);
            for (int64_t c = 0; c < C; c++)
                bad += row[c] != dec_e4m3(((const uint8_t *)q->data)[r * C + c]) *
                                     dec_e8m0(((const uint8_t *)sc->data)[(r / 128) * cdiv(C, 128) + c / 128]);
        }
        CHECK(bad == 0 && R == 192, "MTP shared w1 (partial tile rows 128..191): %lld mismatches", (long long)bad);
        free(row);
        run_block(L, "dsv4-flash-layout MTP");
        /* the CSA layer's indexer: wq_b F8_E4M3 + E8M0 .scale, weights_proj BF16 */
        moe_idx_weights *iw = NULL;
        st = moe_idx_load(m, 1, &iw, &err);
        CHECK(st == MOE_OK, "indexer of layer 1: %s", err.msg);
        if (st == MOE_OK) {
            CHECK_OK(moe_ckpt_find(ck, "layers.1.attn.indexer.wq_b.weight", &q, &err), err);
            CHECK_OK(moe_ckpt_find(ck, "layers.1.attn.indexer.wq_b.scale", &sc, &err), err);
            CHECK(q->dtype == MOE_DTYPE_F8_E4M3 && sc->dtype == MOE_DTYPE_F8_E8M0, "indexer wq_b dtypes");
            R = q->shape[0];
            C = q->shape[1];
            bad = 0;
            for (int64_t r = 0; r < R; r++)
                for (int64_t c = 0; c < C; c++)
                    bad += iw->wq_b[r * C + c] != dec_e4m3(((const uint8_t *)q->data)[r * C + c]) *
                                                      dec_e8m0(((const uint8_t *)sc->data)[(r / 128) * cdiv(C, 128) + c / 128]);
            CHECK(bad == 0 && R == (int64_t)iw->heads * iw->dim, "indexer wq_b: %lld mismatches", (long long)bad);
            CHECK(iw->has_compressor && !iw->v32 && !iw->wk, "V4 indexer with its compressor");
            moe_idx_weights_free(iw);
        }
        moe_ckpt_free(ck);
    }
    moe_model_free(m);
}

/* DeepSeek V3 / R1 in HF naming with its MTP layer model.layers.<n>: FP8
 * with fp32 weight_scale_inv; V3.2-Exp's indexer tensors. */
static void test_v3_family(void) {
    tb b = {0};
    uint64_t s = 2;
    names l1 = {"model.layers.1.mlp", false}, l2 = {"model.layers.2.mlp", false};
    add_linear(&b, "model.layers.0.mlp.gate_proj", 96, H, WF_FP8_INV, &s);
    add_moe(&b, &l1, false, WF_FP8_INV, WF_FP8_INV, &s);
    add_moe(&b, &l2, false, WF_FP8_INV, WF_FP8_INV, &s); /* MTP: layer 2 of a 2-layer model */
    add_linear(&b, "model.layers.2.eh_proj", H, 2 * H, WF_BF16, &s);
    /* V3.2-Exp indexer, layer 1: heads 2 x dim 32, q_lora 48 */
    add_linear(&b, "model.layers.1.self_attn.indexer.wq_b", 64, 48, WF_FP8_INV, &s);
    add_linear(&b, "model.layers.1.self_attn.indexer.wk", 32, H, WF_FP8_INV, &s);
    add_linear(&b, "model.layers.1.self_attn.indexer.weights_proj", 2, H, WF_BF16, &s);
    float *kw = tb_add(&b, "model.layers.1.self_attn.indexer.k_norm.weight", MOE_DTYPE_F32, 1, 32, 0, 0);
    float *kb = tb_add(&b, "model.layers.1.self_attn.indexer.k_norm.bias", MOE_DTYPE_F32, 1, 32, 0, 0);
    for (int i = 0; i < 32; i++) { kw[i] = 1.0f + 0.01f * (float)i; kb[i] = -0.5f * (float)i; }
    char *dir = fresh_dir("v32-exp");
    char cfg[2048];
    v3_config(cfg, sizeof cfg, 2, 1,
              "\"index_n_heads\": 2, \"index_head_dim\": 32, \"index_topk\": 4, \"q_lora_rank\": 48,"
              " \"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\": \"e4m3\","
              " \"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]}");
    put_text(dir, "config.json", cfg);
    tb_write(&b, dir, 2);
    moe_model *m = NULL;
    moe_error err;
    moe_status st = moe_model_open(dir, &m, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) { tb_free(&b); return; }
    const moe_layer *L;
    for (int l = 1; l <= 2; l++) {
        st = moe_model_layer(m, l, &L, &err);
        CHECK(st == MOE_OK, "layer %d: %s", l, err.msg);
        if (st == MOE_OK) {
            check_moe(&b, L, l == 1 ? &l1 : &l2, WF_FP8_INV, WF_FP8_INV);
            run_block(L, l == 1 ? "V3 layer 1" : "V3 MTP layer 2");
        }
    }
    moe_idx_weights *iw = NULL;
    st = moe_idx_load(m, 1, &iw, &err);
    CHECK(st == MOE_OK, "V3.2 indexer: %s", err.msg);
    if (st == MOE_OK) {
        CHECK(iw->v32 && iw->wk && iw->k_norm_w && iw->k_norm_b && !iw->has_compressor, "V3.2 parts");
        double in;
        int64_t bad = 0;
        for (int r = 0; r < 64; r++)
            for (int c = 0; c < 48; c++)
                bad += iw->wq_b[r * 48 + c] != expect_at(&b, "model.layers.1.self_attn.indexer.wq_b", 64, 48, WF_FP8_INV, r, c, &in);
        for (int r = 0; r < 32; r++)
            for (int c = 0; c < H; c++)
                bad += iw->wk[r * H + c] != expect_at(&b, "model.layers.1.self_attn.indexer.wk", 32, H, WF_FP8_INV, r, c, &in);
        for (int r = 0; r < 2; r++)
            for (int c = 0; c < H; c++)
                bad += iw->weights_proj[r * H + c] !=
                       expect_at(&b, "model.layers.1.self_attn.indexer.weights_proj", 2, H, WF_BF16, r, c, &in);
        for (int i = 0; i < 32; i++) bad += iw->k_norm_w[i] != kw[i] || iw->k_norm_b[i] != kb[i];
        CHECK(bad == 0, "V3.2 indexer values: %lld mismatches", (long long)bad);
        moe_idx_weights_free(iw);
    }
    moe_model_free(m);
    tb_free(&b);
}

/* nvidia/DeepSeek-R1-FP4 (ModelOpt NVFP4 on HF V3 names): experts, shared
 * experts and dense MLPs NVFP4 with input_scale, the MTP layer excluded
 * (BF16), hf_quant_config.json NVFP4. */
static void test_modelopt_r1_fp4(void) {
    tb b = {0};
    uint64_t s = 3;
    names l1 = {"model.layers.1.mlp", false}, l2 = {"model.layers.2.mlp", false};
    add_moe(&b, &l1, false, WF_NVFP4_MO, WF_NVFP4_MO, &s);
    add_moe(&b, &l2, false, WF_BF16, WF_BF16, &s);
    char *dir = fresh_dir("r1-fp4");
    char cfg[2048];
    v3_config(cfg, sizeof cfg, 2, 1, NULL);
    put_text(dir, "config.json", cfg);
    put_text(dir, "hf_quant_config.json",
             "{\"producer\": {\"name\": \"modelopt\", \"version\": \"0.23.0\"}, \"quantization\": {\"quant_algo\":"
             " \"NVFP4\", \"kv_cache_quant_algo\": null, \"group_size\": 16, \"exclude_modules\": [\"lm_head\","
             " \"model.layers.0.self_attn*\", \"model.layers.1.self_attn*\", \"model.layers.2*\"]}}");
    tb_write(&b, dir, 1);
    moe_model *m = NULL;
    moe_error err;
    moe_status st = moe_model_open(dir, &m, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) { tb_free(&b); return; }
    const moe_layer *L;
    st = moe_model_layer(m, 1, &L, &err);
    CHECK(st == MOE_OK, "NVFP4 layer: %s", err.msg);
    if (st == MOE_OK) {
        check_moe(&b, L, &l1, WF_NVFP4_MO, WF_NVFP4_MO);
        CHECK(L->w1[1].fmt == MOE_WFMT_NVFP4 && L->w1[1].input_scale > 0, "NVFP4 + input_scale");
        /* this copy's gate and up have their own weight_scale_2 (random):
         * the loader reports what one fused GEMM1 scale would cost, at most
         * one UE4M3 rounding (2^-4 relative) */
        CHECK(L->nvfp4_scale2_mismatch == E && L->nvfp4_reconcile_loss > 0 && L->nvfp4_reconcile_loss <= 0x1p-4,
              "reconcile report: %d experts, loss %.3g", L->nvfp4_scale2_mismatch, L->nvfp4_reconcile_loss);
        float m13 = 0, m2 = 0;
        for (int e = 0; e < E; e++) {
            m13 = fmaxf(m13, fmaxf(L->w1[e].input_scale, L->w3[e].input_scale));
            m2 = fmaxf(m2, L->w2[e].input_scale);
        }
        CHECK(L->w1[0].act_scale == m13 && L->w3[E - 1].act_scale == m13 && L->w2[1].act_scale == m2 &&
                  L->sw2.act_scale == L->sw2.input_scale && L->sw1.act_scale == fmaxf(L->sw1.input_scale, L->sw3.input_scale),
              "act scales: the layer's largest for routed experts, the shared expert's own");
        run_block(L, "R1-FP4 layer 1");
    }
    st = moe_model_layer(m, 2, &L, &err);
    CHECK(st == MOE_OK, "excluded MTP layer (BF16): %s", err.msg);
    if (st == MOE_OK) check_moe(&b, L, &l2, WF_BF16, WF_BF16);
    moe_model_free(m);
    tb_free(&b);
}

/* nvidia/DeepSeek-V4-Flash-NVFP4: V4 names, routed experts (MTP included)
 * NVFP4, the rest as DeepSeek ships it; config.json keeps the FP8
 * quantization_config and adds moe_quant_algo; hf_quant_config.json
 * MIXED_PRECISION with per-layer quantized_layers. */
static void test_nvidia_v4_nvfp4(void) {
    tb b = {0};
    uint64_t s = 4;
    names l0 = {"layers.0.ffn", true}, l1 = {"layers.1.ffn", true}, mtp = {"mtp.0.ffn", true};
    add_moe(&b, &l0, true, WF_NVFP4_MO, WF_FP8_E8M0, &s);
    add_moe(&b, &l1, false, WF_NVFP4_MO, WF_FP8_E8M0, &s);
    add_moe(&b, &mtp, false, WF_NVFP4_MO, WF_FP8_E8M0, &s);
    char *dir = fresh_dir("v4-nvfp4");
    char cfg[2048];
    v4_config(cfg, sizeof cfg, 2, 1, 1,
              "\"expert_dtype\": \"fp4\", \"quantization_config\": {\"activation_scheme\": \"dynamic\", \"fmt\":"
              " \"e4m3\", \"quant_method\": \"fp8\", \"scale_fmt\": \"ue8m0\", \"weight_block_size\": [128, 128],"
              " \"moe_quant_algo\": \"NVFP4\"}");
    put_text(dir, "config.json", cfg);
    put_text(dir, "hf_quant_config.json",
             "{\"producer\": {\"name\": \"modelopt\", \"version\": \"dsv4-nvfp4-experts\"}, \"quantization\":"
             " {\"quant_algo\": \"MIXED_PRECISION\", \"kv_cache_quant_algo\": null, \"group_size\": 16,"
             " \"quantized_layers\": {\"layers.0.ffn.experts\": {\"quant_algo\": \"NVFP4\", \"group_size\": 16},"
             " \"layers.1.ffn.experts\": {\"quant_algo\": \"NVFP4\", \"group_size\": 16},"
             " \"mtp.0.ffn.experts\": {\"quant_algo\": \"NVFP4\", \"group_size\": 16}},"
             " \"exclude_modules\": [\"*.attn.*\", \"*.attn_norm.*\", \"*.ffn.shared_experts.*\", \"*.ffn.gate.*\","
             " \"*.ffn_norm.*\", \"embed.weight\", \"head.weight\", \"*.hc_*\", \"*.h_proj.*\", \"*.e_proj.*\","
             " \"*.enorm.*\", \"*.hnorm.*\", \"mtp.*.norm.*\", \"norm.weight\"]}}");
    tb_write(&b, dir, 2);
    moe_model *m = NULL;
    moe_error err;
    moe_status st = moe_model_open(dir, &m, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) { tb_free(&b); return; }
    names *nm[3] = {&l0, &l1, &mtp};
    for (int l = 0; l < 3; l++) {
        const moe_layer *L;
        st = moe_model_layer(m, l, &L, &err);
        CHECK(st == MOE_OK, "layer %d: %s", l, err.msg);
        if (st == MOE_OK) {
            check_moe(&b, L, nm[l], WF_NVFP4_MO, WF_FP8_E8M0);
            if (l == 1) run_block(L, "V4 NVFP4 layer 1");
        }
    }
    moe_model_free(m);
    inspect_expect(dir, 2, "nvfp4 (ModelOpt: U8 + weight_scale + weight_scale_2 + input_scale)", "yes", "--act nvfp4", true);
    tb_free(&b);
}

/* RedHatAI/DeepSeek-V4-Flash-NVFP4-FP8 (compressed-tensors): NVFP4 experts
 * as weight_packed + weight_global_scale (= 1 / weight_scale_2), FP8_BLOCK
 * shared experts with BF16 weight_scale; no MTP. */
static void test_compressed_tensors(void) {
    tb b = {0};
    uint64_t s = 5;
    names l1 = {"layers.1.ffn", true};
    add_moe(&b, &l1, false, WF_NVFP4_CT, WF_FP8_CT, &s);
    char *dir = fresh_dir("v4-ct");
    char cfg[4096];
    v4_config(cfg, sizeof cfg, 2, 1, 0,
              "\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"format\": \"mixed-precision\","
              " \"config_groups\": {\"group_0\": {\"targets\": [\"re:.*experts\\\\.\\\\d+\\\\.w[123]$\"],"
              " \"format\": \"nvfp4-pack-quantized\", \"weights\": {\"num_bits\": 4, \"type\": \"float\","
              " \"strategy\": \"tensor_group\", \"group_size\": 16}, \"input_activations\": {\"num_bits\": 4,"
              " \"type\": \"float\", \"strategy\": \"tensor_group\", \"group_size\": 16, \"dynamic\": \"local\"}},"
              " \"group_1\": {\"targets\": [\"re:.*shared_experts.*\"], \"format\": \"float-quantized\","
              " \"weights\": {\"num_bits\": 8, \"type\": \"float\", \"strategy\": \"block\","
              " \"block_structure\": [128, 128]}}}, \"ignore\": [\"re:.*gate$\", \"head\"]}");
    put_text(dir, "config.json", cfg);
    tb_write(&b, dir, 1);
    moe_model *m = NULL;
    moe_error err;
    moe_status st = moe_model_open(dir, &m, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) { tb_free(&b); return; }
    const moe_layer *L;
    st = moe_model_layer(m, 1, &L, &err);
    CHECK(st == MOE_OK, "compressed-tensors layer: %s", err.msg);
    if (st == MOE_OK) {
        check_moe(&b, L, &l1, WF_NVFP4_CT, WF_FP8_CT);
        CHECK(L->w1[0].fmt == MOE_WFMT_NVFP4 && L->w1[0].global_scale > 0 &&
                  L->w1[0].scale2 == (float)(1.0 / L->w1[0].global_scale), "scale2 = fp32(1 / G)");
        run_block(L, "compressed-tensors layer 1");
    }
    st = moe_model_layer(m, 2, &L, &err);
    CHECK(st == MOE_ERR_ARG, "no MTP declared here: %s", err.msg);
    moe_model_free(m);
    inspect_expect(dir, 1, "nvfp4 (compressed-tensors", "yes", "--act nvfp4", true);
    tb_free(&b);
}

/* ModelOpt per-tensor FP8 (MIXED_PRECISION FP8 layers): weight F8_E4M3,
 * weight_scale F32 [], input_scale F32 []. */
static void test_modelopt_fp8_tensor(void) {
    tb b = {0};
    uint64_t s = 6;
    names l1 = {"model.layers.1.mlp", false};
    add_moe(&b, &l1, false, WF_FP8_TENSOR, WF_FP8_TENSOR, &s);
    char *dir = fresh_dir("modelopt-fp8");
    char cfg[2048];
    v3_config(cfg, sizeof cfg, 2, 0, NULL);
    put_text(dir, "config.json", cfg);
    put_text(dir, "hf_quant_config.json",
             "{\"producer\": {\"name\": \"modelopt\"}, \"quantization\": {\"quant_algo\": \"FP8\","
             " \"kv_cache_quant_algo\": \"FP8\", \"exclude_modules\": [\"lm_head\"]}}");
    tb_write(&b, dir, 1);
    moe_model *m = NULL;
    moe_error err;
    moe_status st = moe_model_open(dir, &m, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) { tb_free(&b); return; }
    const moe_layer *L;
    st = moe_model_layer(m, 1, &L, &err);
    CHECK(st == MOE_OK, "per-tensor FP8: %s", err.msg);
    if (st == MOE_OK) {
        check_moe(&b, L, &l1, WF_FP8_TENSOR, WF_FP8_TENSOR);
        run_block(L, "ModelOpt FP8 layer 1");
    }
    moe_model_free(m);
    tb_free(&b);
}

/* DeepSeek-V4.1: text_config nesting and FP8 blocks of 32 x 32; the float32
 * path takes the reference kernel for such blocks, bit-identical across
 * ISAs. */
static void test_v41_blocks(void) {
    tb b = {0};
    uint64_t s = 7;
    names l1 = {"layers.1.ffn", true};
    add_moe(&b, &l1, false, WF_FP8_B32, WF_FP8_B32, &s);
    char *dir = fresh_dir("v41");
    char inner[2048], cfg[4096];
    v4_keys(inner, sizeof inner, "deepseek_v41_text", 2, 1, 0);
    snprintf(cfg, sizeof cfg,
             "{\"architectures\": [\"DeepseekV41ForCausalLM\"], \"model_type\": \"deepseek_v41\", \"text_config\":"
             " {%s}, \"quantization_config\": {\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", \"scale_fmt\":"
             " \"ue8m0\", \"weight_block_size\": [32, 32]}}", inner);
    put_text(dir, "config.json", cfg);
    tb_write(&b, dir, 1);
    moe_model *m = NULL;
    moe_error err;
    moe_status st = moe_model_open(dir, &m, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) { tb_free(&b); return; }
    CHECK(moe_model_get_info(m)->arch == MOE_ARCH_V4 && !strcmp(moe_model_get_info(m)->model_type, "deepseek_v41_text"),
          "text_config read: %s", moe_model_get_info(m)->model_type);
    const moe_layer *L;
    st = moe_model_layer(m, 1, &L, &err);
    CHECK(st == MOE_OK, "32x32 blocks: %s", err.msg);
    if (st == MOE_OK) {
        check_moe(&b, L, &l1, WF_FP8_B32, WF_FP8_B32);
        CHECK(L->w1[0].block_rows == 32 && L->w1[0].block_cols == 32 && L->w1[0].scale_rows == 1 &&
                  L->w1[0].scale_cols == 2, "block fields");
        run_block(L, "V4.1 32x32 layer 1");
        /* f32 outputs equal across ISAs: every ISA falls back to the reference kernel */
        enum { T = 5 };
        double hidden[T * H];
        uint64_t r = 9;
        for (int i = 0; i < T * H; i++) hidden[i] = moe_t_rng_normal(&r);
        moe_block_out o1, o2;
        moe_run_opts o = moe_run_opts_default();
        o.precision = MOE_PREC_F32;
        o.isa = MOE_ISA_REF;
        CHECK_OK(moe_block_out_init(&o1, L, T, &o, &err), err);
        CHECK_OK(moe_block_run(L, hidden, NULL, T, &o, &o1, &err), err);
        o.isa = MOE_ISA_AUTO;
        CHECK_OK(moe_block_out_init(&o2, L, T, &o, &err), err);
        CHECK_OK(moe_block_run(L, hidden, NULL, T, &o, &o2, &err), err);
        CHECK(!memcmp(o1.moe_out, o2.moe_out, sizeof(double) * T * H), "ref and auto ISA agree bit for bit");
        moe_block_out_free(&o1);
        moe_block_out_free(&o2);
    }
    moe_model_free(m);
    inspect_expect(dir, 1, "fp8 32x32 blocks (.scale F8_E8M0)", "yes (reference kernels", "--precision f32", false);
    inspect_expect(dir, 1, NULL, NULL, "--device cuda", false);
    tb_free(&b);
}

/* Stacked experts as ports write transformers' parameters: the same block
 * as the per-expert checkpoint, bit for bit. */
static void test_stacked_experts(void) {
    tb per = {0}, st3 = {0};
    uint64_t s = 8;
    names l1 = {"model.layers.1.mlp", false};
    add_moe(&per, &l1, false, WF_BF16, WF_BF16, &s);
    /* the same values stacked: gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I] */
    uint16_t *gu = tb_add(&st3, "model.layers.1.mlp.experts.gate_up_proj", MOE_DTYPE_BF16, 3, E, 2 * I, H);
    uint16_t *dn = tb_add(&st3, "model.layers.1.mlp.experts.down_proj", MOE_DTYPE_BF16, 3, E, H, I);
    char n[200];
    for (int e = 0; e < E; e++) {
        snprintf(n, sizeof n, "model.layers.1.mlp.experts.%d.gate_proj.weight", e);
        memcpy(gu + (size_t)e * 2 * I * H, tb_get(&per, n), (size_t)I * H * 2);
        snprintf(n, sizeof n, "model.layers.1.mlp.experts.%d.up_proj.weight", e);
        memcpy(gu + (size_t)e * 2 * I * H + (size_t)I * H, tb_get(&per, n), (size_t)I * H * 2);
        snprintf(n, sizeof n, "model.layers.1.mlp.experts.%d.down_proj.weight", e);
        memcpy(dn + (size_t)e * H * I, tb_get(&per, n), (size_t)H * I * 2);
    }
    for (int i = 0; i < per.n; i++) {
        if (strstr(per.names[i], ".experts.") && !strstr(per.names[i], "shared")) continue;
        moe_st_entry *e = &per.e[i];
        void *d = tb_add(&st3, e->name, e->dtype, e->ndim, e->shape[0], e->ndim > 1 ? e->shape[1] : 0, 0);
        int64_t cnt = 1;
        for (int k = 0; k < e->ndim; k++) cnt *= e->shape[k];
        memcpy(d, per.bufs[i], (size_t)cnt * moe_dtype_size(e->dtype));
    }
    char *d1 = fresh_dir("per-expert"), *d2 = fresh_dir("stacked");
    char cfg[2048];
    v3_config(cfg, sizeof cfg, 2, 0, NULL);
    put_text(d1, "config.json", cfg);
    put_text(d2, "config.json", cfg);
    tb_write(&per, d1, 1);
    tb_write(&st3, d2, 1);
    moe_model *m1 = NULL, *m2 = NULL;
    moe_error err;
    CHECK_OK(moe_model_open(d1, &m1, &err), err);
    CHECK_OK(moe_model_open(d2, &m2, &err), err);
    const moe_layer *L1 = NULL, *L2 = NULL;
    moe_status a = m1 ? moe_model_layer(m1, 1, &L1, &err) : MOE_ERR_IO;
    CHECK(a == MOE_OK, "per expert: %s", err.msg);
    moe_status c = m2 ? moe_model_layer(m2, 1, &L2, &err) : MOE_ERR_IO;
    CHECK(c == MOE_OK, "stacked: %s", err.msg);
    if (a == MOE_OK && c == MOE_OK) {
        check_moe(&per, L2, &l1, WF_BF16, WF_BF16);
        enum { T = 7 };
        double hidden[T * H];
        uint64_t r = 3;
        for (int i = 0; i < T * H; i++) hidden[i] = moe_t_rng_normal(&r);
        moe_run_opts o = moe_run_opts_default();
        moe_block_out o1, o2;
        CHECK_OK(moe_block_out_init(&o1, L1, T, &o, &err), err);
        CHECK_OK(moe_block_out_init(&o2, L2, T, &o, &err), err);
        CHECK_OK(moe_block_run(L1, hidden, NULL, T, &o, &o1, &err), err);
        CHECK_OK(moe_block_run(L2, hidden, NULL, T, &o, &o2, &err), err);
        CHECK(!memcmp(o1.moe_out, o2.moe_out, sizeof(double) * T * H), "stacked = per expert, bit for bit");
        moe_block_out_free(&o1);
        moe_block_out_free(&o2);
    }
    moe_model_free(m1);
    moe_model_free(m2);
    tb_free(&per);
    tb_free(&st3);
}

/* A shard holding one tensor of a dtype the reader does not know: the layer
 * that does not need it loads; the tensor that is needed fails naming it.
 * The tensor is written as U8 and its header entry retyped "F4" in place
 * (same length: the offsets hold; F4's sub-byte size is not checked). */
static void test_unknown_dtype_shard(void) {
    for (int needed = 0; needed < 2; needed++) {
        tb b = {0};
        uint64_t s = 10;
        names l1 = {"layers.1.ffn", true};
        add_moe(&b, &l1, false, WF_BF16, WF_BF16, &s);
        const char *victim = needed ? "layers.1.ffn.experts.2.w2.weight" : "layers.1.attn.extra.weight";
        if (!needed) tb_add(&b, victim, MOE_DTYPE_U8, 2, 4, 8, 0);
        for (int i = 0; i < b.n; i++)
            if (!strcmp(b.names[i], victim)) b.e[i].dtype = MOE_DTYPE_U8; /* the BF16 buffer is larger: fine */
        char *dir = fresh_dir(needed ? "unknown-needed" : "unknown-other");
        char cfg[2048];
        v4_config(cfg, sizeof cfg, 2, 1, 0, NULL);
        put_text(dir, "config.json", cfg);
        tb_write(&b, dir, 1);
        char p[700];
        snprintf(p, sizeof p, "%s/model.safetensors", dir);
        FILE *f = fopen(p, "r+b");
        unsigned char h8[8];
        bool patched = false;
        if (f && fread(h8, 1, 8, f) == 8) {
            uint64_t hl = 0;
            for (int k = 7; k >= 0; k--) hl = (hl << 8) | h8[k];
            char *hdr = calloc(hl + 1, 1);
            if (fread(hdr, 1, hl, f) == hl) {
                char key[200];
                snprintf(key, sizeof key, "\"%s\":{\"dtype\":\"U8\"", victim);
                char *at = strstr(hdr, key);
                if (at) {
                    memcpy(at + strlen(key) - 3, "F4", 2);
                    fseek(f, 8, SEEK_SET);
                    patched = fwrite(hdr, 1, hl, f) == hl;
                }
            }
            free(hdr);
        }
        if (f) fclose(f);
        CHECK(patched, "retyped %s", victim);
        moe_model *m = NULL;
        moe_error err;
        moe_status st = moe_model_open(dir, &m, &err);
        CHECK_OK(st, err);
        if (st == MOE_OK) {
            const moe_layer *L;
            st = moe_model_layer(m, 1, &L, &err);
            if (!needed) {
                CHECK(st == MOE_OK, "a shard with an unknown-dtype attention tensor serves the MoE block: %s", err.msg);
                if (st == MOE_OK) check_moe(&b, L, &l1, WF_BF16, WF_BF16);
            } else {
                CHECK(st == MOE_ERR_DTYPE && strstr(err.msg, victim) && strstr(err.msg, "\"F4\""),
                      "the needed tensor fails, named with its dtype: %s", err.msg);
            }
        }
        /* inspect names it and still describes the rest */
        inspect_expect(dir, 1, needed ? NULL : "BF16", needed ? "no" : "yes", "tensors of unknown dtype", false);
        moe_model_free(m);
        tb_free(&b);
    }
}

/* A checkpoint that contradicts its own declaration is refused, the message
 * naming the declaration and the tensor. */
static void expect_contradiction(const char *what, const char *dir, int layer, moe_status want, const char *n1,
                                 const char *n2) {
    moe_model *m = NULL;
    moe_error err;
    moe_status st = moe_model_open(dir, &m, &err);
    if (st == MOE_OK) {
        const moe_layer *L;
        st = moe_model_layer(m, layer, &L, &err);
    }
    CHECK(st == want && strstr(err.msg, n1) && (!n2 || strstr(err.msg, n2)), "%s: %s: %s", what, moe_status_str(st),
          err.msg);
    moe_model_free(m);
    /* inspect describes it, naming the contradiction, without failing
     * (not a value check such as ue8m0's powers of two: inspect reads no
     * tensor data) */
    if (want == MOE_ERR_FORMAT && !strstr(n2 ? n2 : "", "power of two")) {
        moe_inspect r;
        st = moe_inspect_dir(dir, &r, &err);
        CHECK(st == MOE_OK && r.n_contradictions > 0 && strstr(r.contradictions[0], n1) &&
                  !strncmp(r.layers[layer].runnable, "no: contradicts", 15),
              "%s: inspect reports %d contradictions: %s / %s", what, st == MOE_OK ? r.n_contradictions : -1,
              st == MOE_OK && r.n_contradictions ? r.contradictions[0] : err.msg,
              st == MOE_OK && layer < r.n_layer_info ? r.layers[layer].runnable : "");
        if (st == MOE_OK) moe_inspect_free(&r);
    }
}

/* What the merge with hardening (#12) added to these readers: a scalar scale
 * must fit a float (weight_scale_2 = 1e39 made the cast undefined), an
 * inverted one (compressed-tensors weight_global_scale) must have a float
 * inverse, and an in-memory checkpoint reads its declared quantization
 * (hf_quant_config.json, duplicate keys refused) and can be inspected, as a
 * directory is. */
static void test_scale_bounds_and_memory(void) {
    static uint8_t packed[4 * 16], sc[4 * 2]; /* [4, 32] weights: 16 bytes a row, 2 block scales */
    for (int i = 0; i < 8; i++) sc[i] = 0x38; /* E4M3 1.0 */
    for (int bad = 0; bad < 2; bad++) {
        double big = bad ? 1e39 : 0.5, tiny = bad ? 1e-300 : 2.0;
        moe_st_entry e[6] = {
            {.name = "x.weight", .dtype = MOE_DTYPE_U8, .ndim = 2, .shape = {4, 16}, .data = packed},
            {.name = "x.weight_scale", .dtype = MOE_DTYPE_F8_E4M3, .ndim = 2, .shape = {4, 2}, .data = sc},
            {.name = "x.weight_scale_2", .dtype = MOE_DTYPE_F64, .ndim = 0, .data = &big},
            {.name = "y.weight_packed", .dtype = MOE_DTYPE_U8, .ndim = 2, .shape = {4, 16}, .data = packed},
            {.name = "y.weight_scale", .dtype = MOE_DTYPE_F8_E4M3, .ndim = 2, .shape = {4, 2}, .data = sc},
            {.name = "y.weight_global_scale", .dtype = MOE_DTYPE_F64, .ndim = 0, .data = &tiny},
        };
        char *dir = fresh_dir(bad ? "scale-bounds-bad" : "scale-bounds-ok");
        char p[700];
        snprintf(p, sizeof p, "%s/model.safetensors", dir);
        moe_error err = {{0}};
        CHECK_OK(moe_st_write(p, e, 6, NULL, &err), err);
        moe_ckpt *ck = NULL;
        CHECK_OK(moe_ckpt_open(dir, &ck, &err), err);
        if (!ck) continue;
        moe_weight w;
        moe_status st = moe_weight_load(ck, "x", 4, 32, &w, NULL, &err);
        if (bad)
            CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "x.weight_scale_2") && strstr(err.msg, "finite float"),
                  "weight_scale_2 = 1e39 refused: %s", err.msg);
        else
            CHECK(st == MOE_OK && w.fmt == MOE_WFMT_NVFP4 && w.scale2 == 0.5f, "weight_scale_2 = 0.5: %s", err.msg);
        st = moe_weight_load(ck, "y", 4, 32, &w, NULL, &err);
        if (bad)
            CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "y.weight_global_scale") && strstr(err.msg, "inverse"),
                  "weight_global_scale = 1e-300 refused: %s", err.msg);
        else
            CHECK(st == MOE_OK && w.scale2 == 0.5f, "weight_global_scale = 2: scale2 = 0.5: %s", err.msg);
        moe_ckpt_free(ck);
    }
    /* in memory: the shard of the good case and a config, + an
     * hf_quant_config.json that declares NVFP4 (or says a key twice) */
    char p[700];
    snprintf(p, sizeof p, "%s/model.safetensors", fresh_dir("scale-bounds-ok"));
    static char shard[1 << 14];
    FILE *f = fopen(p, "rb");
    size_t n = f ? fread(shard, 1, sizeof shard, f) : 0;
    if (f) fclose(f);
    CHECK(n > 0 && n < sizeof shard, "read back %s", p);
    char cfg[2048];
    v3_config(cfg, sizeof cfg, 2, 0, NULL);
    static const char hfq[] = "{\"producer\": {\"name\": \"modelopt\"}, \"quantization\": {\"quant_algo\": \"NVFP4\","
                              " \"group_size\": 16, \"exclude_modules\": [\"lm_head\"]}}";
    static const char dup[] = "{\"quantization\": {\"quant_algo\": \"NVFP4\", \"quant_algo\": \"FP8\"}}";
    for (int twice = 0; twice < 2; twice++) {
        moe_mem_file files[3] = {{"config.json", cfg, strlen(cfg)},
                                 {"model.safetensors", shard, n},
                                 {"hf_quant_config.json", twice ? dup : hfq, twice ? sizeof dup - 1 : sizeof hfq - 1}};
        moe_ckpt *ck = NULL;
        moe_error err = {{0}};
        moe_status st = moe_ckpt_open_mem("mem", files, 3, &ck, &err);
        if (twice) {
            CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "hf_quant_config.json") && strstr(err.msg, "quant_algo"),
                  "a key twice in hf_quant_config.json refused in memory: %s", err.msg);
        } else {
            CHECK_OK(st, err);
            moe_weight w;
            if (ck) CHECK_OK(moe_weight_load(ck, "x", 4, 32, &w, NULL, &err), err);
            moe_inspect r;
            st = moe_inspect_mem("mem", files, 3, &r, &err);
            CHECK_OK(st, err);
            if (st == MOE_OK) {
                CHECK(!strcmp(r.dir, "mem") && r.n_shards == 1 && strstr(r.declared, "NVFP4"),
                      "inspect in memory: dir %s, %d shards, declared \"%s\"", r.dir, r.n_shards, r.declared);
                moe_inspect_free(&r);
            }
        }
        moe_ckpt_free(ck);
    }
}

static void test_contradictions(void) {
    uint64_t s = 11;
    char cfg[4096];
    names l1 = {"layers.1.ffn", true}, v3 = {"model.layers.1.mlp", false};
    {   /* expert_dtype fp4, experts FP8 */
        tb b = {0};
        add_moe(&b, &l1, false, WF_FP8_E8M0, WF_FP8_E8M0, &s);
        char *dir = fresh_dir("c-expert-dtype");
        v4_config(cfg, sizeof cfg, 2, 1, 0, v4_fp8_qc);
        put_text(dir, "config.json", cfg);
        tb_write(&b, dir, 1);
        expect_contradiction("expert_dtype fp4 vs FP8 experts", dir, 1, MOE_ERR_FORMAT, "expert_dtype \"fp4\"",
                             "layers.1.ffn.experts.0.w1");
        tb_free(&b);
    }
    {   /* moe_quant_algo NVFP4, experts MXFP4 */
        tb b = {0};
        add_moe(&b, &l1, false, WF_MXFP4, WF_FP8_E8M0, &s);
        char *dir = fresh_dir("c-moe-quant-algo");
        v4_config(cfg, sizeof cfg, 2, 1, 0,
                  "\"expert_dtype\": \"fp4\", \"quantization_config\": {\"quant_method\": \"fp8\", \"scale_fmt\":"
                  " \"ue8m0\", \"weight_block_size\": [128, 128], \"moe_quant_algo\": \"NVFP4\"}");
        put_text(dir, "config.json", cfg);
        tb_write(&b, dir, 1);
        expect_contradiction("moe_quant_algo NVFP4 vs MXFP4", dir, 1, MOE_ERR_FORMAT, "moe_quant_algo", "mxfp4");
        tb_free(&b);
    }
    {   /* weight_block_size [128, 128] declared, scales of 32 x 32 blocks */
        tb b = {0};
        add_moe(&b, &l1, false, WF_FP8_B32, WF_FP8_B32, &s);
        char *dir = fresh_dir("c-block");
        v4_config(cfg, sizeof cfg, 2, 1, 0,
                  "\"quantization_config\": {\"quant_method\": \"fp8\", \"weight_block_size\": [128, 128]}");
        put_text(dir, "config.json", cfg);
        tb_write(&b, dir, 1);
        expect_contradiction("block 128 declared vs 32", dir, 1, MOE_ERR_SHAPE, "weight_block_size", "[32, 32]");
        /* and undeclared: the message says a declaration would settle it */
        v4_config(cfg, sizeof cfg, 2, 1, 0, NULL);
        put_text(dir, "config.json", cfg);
        expect_contradiction("block 32 undeclared", dir, 1, MOE_ERR_SHAPE, "no weight_block_size is declared", "[32, 32]");
        tb_free(&b);
    }
    {   /* scale_fmt ue8m0 with fp32 scales that are not powers of two */
        tb b = {0};
        add_moe(&b, &v3, false, WF_FP8_INV, WF_FP8_INV, &s);
        char *dir = fresh_dir("c-ue8m0");
        v3_config(cfg, sizeof cfg, 2, 0,
                  "\"quantization_config\": {\"quant_method\": \"fp8\", \"fmt\": \"e4m3\", \"scale_fmt\": \"ue8m0\","
                  " \"weight_block_size\": [128, 128]}");
        put_text(dir, "config.json", cfg);
        tb_write(&b, dir, 1);
        expect_contradiction("ue8m0 vs non-pow2 scales", dir, 1, MOE_ERR_FORMAT, "scale_fmt \"ue8m0\"", "not a power of two");
        tb_free(&b);
    }
    {   /* hf_quant_config excludes the MTP layer, which is NVFP4 */
        tb b = {0};
        names mtp = {"model.layers.2.mlp", false};
        add_moe(&b, &mtp, false, WF_NVFP4_MO, WF_NVFP4_MO, &s);
        char *dir = fresh_dir("c-excluded");
        v3_config(cfg, sizeof cfg, 2, 1, NULL);
        put_text(dir, "config.json", cfg);
        put_text(dir, "hf_quant_config.json",
                 "{\"quantization\": {\"quant_algo\": \"NVFP4\", \"group_size\": 16, \"exclude_modules\":"
                 " [\"lm_head\", \"model.layers.2*\"]}}");
        tb_write(&b, dir, 1);
        expect_contradiction("excluded but NVFP4", dir, 2, MOE_ERR_FORMAT, "exclude_modules entry \"model.layers.2*\"",
                             "nvfp4");
        tb_free(&b);
    }
    {   /* ModelOpt NVFP4 declared, routed experts BF16 */
        tb b = {0};
        add_moe(&b, &v3, false, WF_BF16, WF_BF16, &s);
        char *dir = fresh_dir("c-modelopt-bf16");
        v3_config(cfg, sizeof cfg, 2, 0, NULL);
        put_text(dir, "config.json", cfg);
        put_text(dir, "hf_quant_config.json", "{\"quantization\": {\"quant_algo\": \"NVFP4\", \"group_size\": 16}}");
        tb_write(&b, dir, 1);
        expect_contradiction("NVFP4 declared, BF16 stored", dir, 1, MOE_ERR_FORMAT, "hf_quant_config.json", "bf16");
        /* a group size other than 16 */
        put_text(dir, "hf_quant_config.json", "{\"quantization\": {\"quant_algo\": \"NVFP4\", \"group_size\": 32}}");
        tb_free(&b);
        tb b2 = {0};
        add_moe(&b2, &v3, false, WF_NVFP4_MO, WF_NVFP4_MO, &s);
        tb_write(&b2, dir, 1);
        expect_contradiction("NVFP4 group 32", dir, 1, MOE_ERR_UNSUPPORTED, "group_size 32", NULL);
        tb_free(&b2);
    }
    {   /* compressed-tensors ignores the experts, which are packed */
        tb b = {0};
        add_moe(&b, &l1, false, WF_NVFP4_CT, WF_BF16, &s);
        char *dir = fresh_dir("c-ct-ignore");
        v4_config(cfg, sizeof cfg, 2, 1, 0,
                  "\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"config_groups\": {},"
                  " \"ignore\": [\"re:.*experts.*\"]}");
        put_text(dir, "config.json", cfg);
        tb_write(&b, dir, 1);
        expect_contradiction("ignored but packed", dir, 1, MOE_ERR_FORMAT, "ignore entry \"re:.*experts.*\"",
                             "compressed-tensors");
        tb_free(&b);
    }
    {   /* a "re:" pattern whose nested '+' would make regcomp copy it 2^24 times
         * (fuzz-config's OOM: fuzz/regress-config/regex-nested-plus-oom) is a
         * config error naming the entry, never compiled; ordinary ones pass */
        tb b = {0};
        add_moe(&b, &l1, false, WF_BF16, WF_BF16, &s);
        char *dir = fresh_dir("c-ct-regex");
        v4_config(cfg, sizeof cfg, 2, 1, 0,
                  "\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"config_groups\": {\"g\":"
                  " {\"targets\": [\"re:.*nothing\", \"re:((((((((((((((((((((((((x+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+)+"
                  ")+)+)+)+)+\"], \"format\": \"nvfp4-pack-quantized\"}}}");
        put_text(dir, "config.json", cfg);
        tb_write(&b, dir, 1);
        expect_contradiction("nested repetitions", dir, 1, MOE_ERR_CONFIG,
                             "config_groups.g.\"targets\"[1] = \"re:((((", "more than 4096 times");
        v4_config(cfg, sizeof cfg, 2, 1, 0,
                  "\"quantization_config\": {\"quant_method\": \"compressed-tensors\", \"config_groups\": {},"
                  " \"ignore\": [\"re:x{5000}\"]}");
        put_text(dir, "config.json", cfg);
        expect_contradiction("a repetition count of 5000", dir, 1, MOE_ERR_CONFIG, "ignore\"[0] = \"re:x{5000}\"",
                             "more than 4096 times");
        tb_free(&b);
    }
    {   /* a malformed declaration names its key */
        tb b = {0};
        add_moe(&b, &l1, false, WF_BF16, WF_BF16, &s);
        char *dir = fresh_dir("c-bad-key");
        v4_config(cfg, sizeof cfg, 2, 1, 0, "\"quantization_config\": {\"weight_block_size\": \"128\"}");
        put_text(dir, "config.json", cfg);
        tb_write(&b, dir, 1);
        expect_contradiction("weight_block_size a string", dir, 1, MOE_ERR_CONFIG, "weight_block_size", "config.json");
        v4_config(cfg, sizeof cfg, 2, 1, 0, NULL);
        put_text(dir, "config.json", cfg);
        put_text(dir, "hf_quant_config.json", "{\"quantization\": [1]}");
        expect_contradiction("hf_quant_config without quantization object", dir, 1, MOE_ERR_CONFIG,
                             "hf_quant_config.json", "quantization");
        tb_free(&b);
    }
}

/* ------------------------------------------ quantize: the release conventions */

static cJSON *read_json_file(const char *dir, const char *file) {
    char p[800];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    static char buf[1 << 20];
    if (!moe_t_read_file(p, buf, sizeof buf)) return NULL;
    return cJSON_Parse(buf);
}

static const char *jstr(const cJSON *o, const char *k) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(o, k);
    return cJSON_IsString(v) ? v->valuestring : NULL;
}

/* quantization_config is exactly DeepSeek's FP8 declaration (key order as
 * DeepSeek writes it), plus moe_quant_algo when given; scale_fmt absent
 * when NULL. */
static bool ds_qc_is(const cJSON *cfg, const char *scale_fmt, const char *moe_quant_algo) {
    const cJSON *qc = cJSON_GetObjectItemCaseSensitive(cfg, "quantization_config");
    if (!cJSON_IsObject(qc)) return false;
    const char *want[6] = {"activation_scheme", "fmt", "quant_method", scale_fmt ? "scale_fmt" : NULL,
                           "weight_block_size", moe_quant_algo ? "moe_quant_algo" : NULL};
    const cJSON *e = qc->child;
    for (int i = 0; i < 6; i++) {
        if (!want[i]) continue;
        if (!e || strcmp(e->string, want[i])) return false;
        e = e->next;
    }
    const cJSON *bs = cJSON_GetObjectItemCaseSensitive(qc, "weight_block_size");
    return !e && !strcmp(jstr(qc, "activation_scheme"), "dynamic") && !strcmp(jstr(qc, "fmt"), "e4m3") &&
           !strcmp(jstr(qc, "quant_method"), "fp8") && (!scale_fmt || !strcmp(jstr(qc, "scale_fmt"), scale_fmt)) &&
           (!moe_quant_algo || !strcmp(jstr(qc, "moe_quant_algo"), moe_quant_algo)) && cJSON_GetArraySize(bs) == 2 &&
           cJSON_GetArrayItem(bs, 0)->valueint == 128 && cJSON_GetArrayItem(bs, 1)->valueint == 128;
}

/* Every tensor of a checkpoint: name, dtype, shape, from the index or the shards. */
typedef struct tlist {
    int n;
    char name[2048][128];
    moe_dtype dt[2048];
    int nd[2048];
    int64_t sh[2048][3];
    uint64_t bytes;
} tlist;

static void list_tensors(const char *dir, tlist *l, bool written) {
    l->n = 0;
    l->bytes = 0;
    moe_ckpt *ck = NULL;
    moe_error err;
    if (moe_ckpt_open(dir, &ck, &err) != MOE_OK) { CHECK(0, "%s", err.msg); return; }
    for (size_t s = 0; s < moe_ckpt_n_shards(ck); s++) {
        moe_st_file *f;
        if (moe_ckpt_shard(ck, s, &f, &err) != MOE_OK) { CHECK(0, "%s", err.msg); break; }
        if (written)
            CHECK(moe_st_metadata(f, "format") && !strcmp(moe_st_metadata(f, "format"), "pt"),
                  "%s: shard metadata {\"format\": \"pt\"}", moe_ckpt_shard_file(ck, s));
        for (size_t i = 0; i < moe_st_count(f) && l->n < 2048; i++) {
            const moe_st_tensor *t = moe_st_at(f, i);
            if (i && written) CHECK(strcmp(moe_st_at(f, i - 1)->name, t->name) < 0, "shard tensors sorted: %s", t->name);
            snprintf(l->name[l->n], 128, "%s", t->name);
            l->dt[l->n] = t->dtype;
            l->nd[l->n] = t->ndim;
            for (int d = 0; d < 3; d++) l->sh[l->n][d] = d < t->ndim ? t->shape[d] : 0;
            l->bytes += t->nbytes;
            l->n++;
        }
    }
    moe_ckpt_free(ck);
}

static int tl_find(const tlist *l, const char *name) {
    for (int i = 0; i < l->n; i++)
        if (!strcmp(l->name[i], name)) return i;
    return -1;
}

static bool tl_is(const tlist *l, const char *name, moe_dtype dt, int nd, int64_t d0, int64_t d1) {
    int i = tl_find(l, name);
    return i >= 0 && l->dt[i] == dt && l->nd[i] == nd && (nd < 1 || l->sh[i][0] == d0) && (nd < 2 || l->sh[i][1] == d1);
}

/* A BF16 copy of a quantized checkpoint: each quantized linear decoded
 * (exactly: FP8 x E8M0 and E2M1 x E8M0 values are BF16 numbers) and stored
 * BF16 under its own name, its scale dropped; other tensors copied; the same
 * shards; config.json without its quantization declaration. */
static void bf16_copy(const char *src, const char *dst) {
    moe_ckpt *ck = NULL;
    moe_error err;
    CHECK_OK(moe_ckpt_open(src, &ck, &err), err);
    if (!ck) return;
    mkdir(dst, 0755);
    size_t cap = 1 << 20, o = 0;
    char *idx = malloc(cap);
    o += (size_t)snprintf(idx + o, cap - o, "{\"metadata\": {}, \"weight_map\": {");
    bool first = true;
    for (size_t s = 0; s < moe_ckpt_n_shards(ck); s++) {
        moe_st_file *f;
        CHECK_OK(moe_ckpt_shard(ck, s, &f, &err), err);
        tb b = {0};
        for (size_t i = 0; i < moe_st_count(f); i++) {
            const moe_st_tensor *t = moe_st_at(f, i);
            size_t l = strlen(t->name);
            if (l > 6 && !strcmp(t->name + l - 6, ".scale")) continue;
            void *d;
            if (t->dtype == MOE_DTYPE_F8_E4M3 || t->dtype == MOE_DTYPE_I8) {
                char base[200];
                snprintf(base, sizeof base, "%.*s", (int)(l - 7), t->name);
                int64_t R = t->shape[0], C = t->dtype == MOE_DTYPE_I8 ? 2 * t->shape[1] : t->shape[1];
                moe_weight w;
                CHECK_OK(moe_weight_load(ck, base, R, C, &w, NULL, &err), err);
                uint16_t *q = tb_add(&b, t->name, MOE_DTYPE_BF16, 2, R, C, 0);
                float *row = malloc((size_t)C * sizeof *row);
                int64_t inexact = 0;
                for (int64_t r = 0; r < R; r++) {
                    moe_weight_row_f32(&w, r, row);
                    for (int64_t c = 0; c < C; c++) {
                        uint32_t u;
                        memcpy(&u, &row[c], 4);
                        inexact += (u & 0xFFFF) != 0;
                        q[r * C + c] = (uint16_t)(u >> 16);
                    }
                }
                CHECK(inexact == 0, "%s: %lld values are not BF16 numbers", t->name, (long long)inexact);
                free(row);
            } else {
                d = tb_add(&b, t->name, t->dtype, t->ndim, t->ndim > 0 ? t->shape[0] : 0, t->ndim > 1 ? t->shape[1] : 0,
                           t->ndim > 2 ? t->shape[2] : 0);
                memcpy(d, t->data, t->nbytes);
            }
            o += (size_t)snprintf(idx + o, cap - o, "%s\"%s\": \"%s\"", first ? "" : ", ", t->name,
                                  moe_ckpt_shard_file(ck, s));
            first = false;
        }
        char p[800];
        snprintf(p, sizeof p, "%s/%s", dst, moe_ckpt_shard_file(ck, s));
        CHECK_OK(moe_st_write(p, b.e, (size_t)b.n, NULL, &err), err);
        tb_free(&b);
    }
    snprintf(idx + o, cap - o, "}}");
    put_text(dst, "model.safetensors.index.json", idx);
    free(idx);
    moe_ckpt_free(ck);
    cJSON *cfg = read_json_file(src, "config.json");
    cJSON_DeleteItemFromObjectCaseSensitive(cfg, "quantization_config");
    cJSON_DeleteItemFromObjectCaseSensitive(cfg, "expert_dtype");
    char *text = cJSON_Print(cfg);
    put_text(dst, "config.json", text);
    free(text);
    cJSON_Delete(cfg);
}

/* Both checkpoints' layer l decode to the same values, bit for bit. */
static void same_values(const char *d1, const char *d2, int l, const char *what) {
    moe_model *a = NULL, *b = NULL;
    moe_error err;
    CHECK_OK(moe_model_open(d1, &a, &err), err);
    CHECK_OK(moe_model_open(d2, &b, &err), err);
    const moe_layer *A = NULL, *B = NULL;
    if (a) CHECK_OK(moe_model_layer(a, l, &A, &err), err);
    if (b) CHECK_OK(moe_model_layer(b, l, &B, &err), err);
    int64_t bad = 0;
    for (int e = -1; A && B && e < A->cfg.n_experts; e++)
        for (int k = 0; k < 3; k++) {
            const moe_weight *x = e < 0 ? (k == 0 ? &A->sw1 : k == 1 ? &A->sw3 : &A->sw2) : (k == 0 ? &A->w1[e] : k == 1 ? &A->w3[e] : &A->w2[e]);
            const moe_weight *y = e < 0 ? (k == 0 ? &B->sw1 : k == 1 ? &B->sw3 : &B->sw2) : (k == 0 ? &B->w1[e] : k == 1 ? &B->w3[e] : &B->w2[e]);
            double *r1 = malloc((size_t)x->cols * 8), *r2 = malloc((size_t)x->cols * 8);
            for (int64_t r = 0; r < x->rows; r++) {
                moe_weight_row_f64(x, r, r1);
                moe_weight_row_f64(y, r, r2);
                bad += memcmp(r1, r2, (size_t)x->cols * 8) != 0;
            }
            free(r1);
            free(r2);
        }
    CHECK(A && B && bad == 0, "%s layer %d: %lld rows differ", what, l, (long long)bad);
    moe_model_free(a);
    moe_model_free(b);
}

/* V4-Flash: a BF16 copy of the committed release-layout dataset quantized
 * back with mxfp4 experts and fp8 others is that dataset again: the same
 * tensor names, dtypes and shapes (I8 experts, E8M0 .scale everywhere,
 * compressors and indexer.weights_proj BF16, .scale on the MTP projections),
 * the same values, DeepSeek's config keys; then NVIDIA's NVFP4 copy of it. */
static void test_quantize_v4_releases(void) {
    const char *ds = moe_t_data("dsv4-flash-layout");
    char dsd[1024];
    snprintf(dsd, sizeof dsd, "%s", ds);
    char *bf = fresh_dir("v4-bf16"), *out = fresh_dir("v4-requant"), *nv = fresh_dir("v4-nvfp4-out");
    bf16_copy(dsd, bf);
    /* the BF16 copy without declarations loads; with DeepSeek's config it would contradict it */
    moe_quant_opts o = {MOE_Q_MXFP4, MOE_Q_FP8, 0, 0};
    moe_quant_report rep;
    moe_error err;
    moe_status st = moe_quantize_checkpoint(bf, out, &o, &rep, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    CHECK(!strcmp(rep.release, "deepseek-ai/DeepSeek-V4-Flash"), "release %s", rep.release);
    static tlist want, got;
    list_tensors(dsd, &want, false);
    list_tensors(out, &got, true);
    CHECK(want.n == got.n && want.n == 339, "%d tensors written, the release layout has %d", got.n, want.n);
    int diff = 0;
    for (int i = 0; i < want.n; i++) {
        int j = tl_find(&got, want.name[i]);
        bool ok = j >= 0 && got.dt[j] == want.dt[i] && got.nd[j] == want.nd[i] &&
                  !memcmp(got.sh[j], want.sh[i], sizeof got.sh[j]);
        if (!ok && diff++ < 5)
            CHECK(0, "%s: %s in the release, %s written", want.name[i], moe_dtype_name(want.dt[i]),
                  j >= 0 ? moe_dtype_name(got.dt[j]) : "nothing");
    }
    CHECK(diff == 0, "%d tensors differ from the release layout", diff);
    cJSON *cfg = read_json_file(out, "config.json"), *ix = read_json_file(out, "model.safetensors.index.json");
    CHECK(ds_qc_is(cfg, "ue8m0", NULL) && jstr(cfg, "expert_dtype") && !strcmp(jstr(cfg, "expert_dtype"), "fp4"),
          "DeepSeek V4 quantization_config and expert_dtype");
    const cJSON *ts = cJSON_GetObjectItemCaseSensitive(cJSON_GetObjectItemCaseSensitive(ix, "metadata"), "total_size");
    CHECK(cJSON_IsNumber(ts) && (uint64_t)ts->valuedouble == got.bytes, "index metadata total_size %g = %llu bytes",
          cJSON_IsNumber(ts) ? ts->valuedouble : -1, (unsigned long long)got.bytes);
    CHECK(cJSON_GetArraySize(cJSON_GetObjectItemCaseSensitive(ix, "weight_map")) == got.n, "weight_map lists all");
    cJSON_Delete(cfg);
    cJSON_Delete(ix);
    for (int l = 0; l < 4; l++) same_values(dsd, out, l, "requantized V4-Flash");

    /* nvidia/DeepSeek-V4-Flash-NVFP4 from the same BF16 copy */
    o.experts = MOE_Q_NVFP4;
    st = moe_quantize_checkpoint(bf, nv, &o, &rep, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    CHECK(strstr(rep.release, "nvidia/DeepSeek-V4-Flash-NVFP4") && strstr(rep.calib, "built-in"), "%s, %s",
          rep.release, rep.calib);
    list_tensors(nv, &got, true);
    regex_t ex;
    regcomp(&ex, "^(layers|mtp)\\.[0-9]+\\.ffn\\.experts\\.[0-9]+\\.w[123]\\.(weight|scale)$", REG_EXTENDED | REG_NOSUB);
    diff = 0;
    int n_experts = 0;
    for (int i = 0; i < want.n; i++) {
        const char *n = want.name[i];
        size_t l = strlen(n);
        bool ok;
        if (!regexec(&ex, n, 0, NULL, 0)) {
            if (!strcmp(n + l - 6, ".scale")) { ok = tl_find(&got, n) < 0; goto next; } /* MXFP4 scale dropped */
            char b[160], c2[200];
            snprintf(b, sizeof b, "%.*s", (int)(l - 7), n);
            int64_t R = want.sh[i][0], C = 2 * want.sh[i][1];
            snprintf(c2, sizeof c2, "%s.weight_scale", b);
            ok = tl_is(&got, n, MOE_DTYPE_U8, 2, R, C / 2) && tl_is(&got, c2, MOE_DTYPE_F8_E4M3, 2, R, C / 16);
            snprintf(c2, sizeof c2, "%s.weight_scale_2", b);
            ok = ok && tl_is(&got, c2, MOE_DTYPE_F32, 0, 0, 0);
            snprintf(c2, sizeof c2, "%s.input_scale", b);
            ok = ok && tl_is(&got, c2, MOE_DTYPE_F32, 0, 0, 0);
            n_experts++;
        } else {
            ok = tl_is(&got, n, want.dt[i], want.nd[i], want.sh[i][0], want.sh[i][1]);
        }
    next:
        if (!ok && diff++ < 5) CHECK(0, "NVIDIA layout: %s", n);
    }
    regfree(&ex);
    CHECK(diff == 0 && n_experts == 4 * 8 * 3 && got.n == want.n + 2 * n_experts, "%d differ; %d expert weights, %d tensors",
          diff, n_experts, got.n);
    cfg = read_json_file(nv, "config.json");
    CHECK(ds_qc_is(cfg, "ue8m0", "NVFP4") && !strcmp(jstr(cfg, "expert_dtype"), "fp4"),
          "NVIDIA keeps DeepSeek's FP8 quantization_config and adds moe_quant_algo");
    cJSON_Delete(cfg);
    cJSON *h = read_json_file(nv, "hf_quant_config.json");
    const cJSON *q = cJSON_GetObjectItemCaseSensitive(h, "quantization");
    const cJSON *ql = cJSON_GetObjectItemCaseSensitive(q, "quantized_layers"), *xl = cJSON_GetObjectItemCaseSensitive(q, "exclude_modules");
    CHECK(!strcmp(jstr(cJSON_GetObjectItemCaseSensitive(h, "producer"), "name"), "modelopt") &&
              !strcmp(jstr(q, "quant_algo"), "MIXED_PRECISION") && cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(q, "kv_cache_quant_algo")) &&
              cJSON_GetObjectItemCaseSensitive(q, "group_size")->valueint == 16,
          "hf_quant_config.json MIXED_PRECISION, group 16, no KV cache quantization");
    static const char *const layers[] = {"layers.0.ffn.experts", "layers.1.ffn.experts", "layers.2.ffn.experts", "mtp.0.ffn.experts"};
    int lk = 0;
    for (int i = 0; i < 4; i++) {
        const cJSON *e = cJSON_GetObjectItemCaseSensitive(ql, layers[i]);
        lk += e && !strcmp(jstr(e, "quant_algo"), "NVFP4") && cJSON_GetObjectItemCaseSensitive(e, "group_size")->valueint == 16;
    }
    CHECK(lk == 4 && cJSON_GetArraySize(ql) == 4, "quantized_layers per layer, MTP included (%d)", lk);
    static const char *const doc_ex[] = {"*.attn.*", "*.attn_norm.*", "*.ffn.shared_experts.*", "*.ffn.gate.*",
                                         "*.ffn_norm.*", "embed.weight", "head.weight", "*.hc_*", "*.h_proj.*",
                                         "*.e_proj.*", "*.enorm.*", "*.hnorm.*", "mtp.*.norm.*", "norm.weight"};
    int xk = cJSON_GetArraySize(xl) == 14;
    for (int i = 0; xk && i < 14; i++) xk = !strcmp(cJSON_GetArrayItem(xl, i)->valuestring, doc_ex[i]);
    CHECK(xk, "exclude_modules as the layout doc lists them");
    cJSON_Delete(h);
    /* it loads under its own declaration, gate and up sharing weight_scale_2 */
    moe_model *m = NULL;
    CHECK_OK(moe_model_open(nv, &m, &err), err);
    for (int l = 0; m && l < 4; l++) {
        const moe_layer *L;
        st = moe_model_layer(m, l, &L, &err);
        CHECK(st == MOE_OK, "NVFP4 layer %d: %s", l, err.msg);
        if (st != MOE_OK) continue;
        int sh = 0;
        for (int e = 0; e < L->cfg.n_experts; e++)
            sh += L->w1[e].scale2 == L->w3[e].scale2 && L->w1[e].input_scale > 0 && L->w2[e].input_scale > 0;
        CHECK(sh == L->cfg.n_experts && L->sw1.fmt == MOE_WFMT_FP8_BLOCK, "layer %d: %d experts with shared scale2", l, sh);
    }
    moe_model_free(m);
}

/* DeepSeek V3 / R1 (and V3.1's ue8m0) from the transformers BF16 fixture:
 * every linear of attention, experts, shared experts and the dense MLP
 * F8_E4M3 + weight_scale_inv F32 [ceil(out/128), ceil(in/128)]; router,
 * norms, embeddings and head untouched; DeepSeek's quantization_config. */
static void test_quantize_v3_releases(void) {
    const char *src = moe_t_data("dsv3-tiny");
    char sd[1024];
    snprintf(sd, sizeof sd, "%s", src);
    static tlist in, got;
    list_tensors(sd, &in, false);
    regex_t lin;
    regcomp(&lin, "(self_attn\\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj)|mlp\\.(experts\\.[0-9]+\\.|shared_experts\\.)?(gate|up|down)_proj)\\.weight$",
            REG_EXTENDED | REG_NOSUB);
    for (int v31 = 0; v31 < 2; v31++) {
        char *out = fresh_dir(v31 ? "v31-fp8" : "v3-fp8");
        moe_quant_opts o = {MOE_Q_FP8, MOE_Q_FP8, 0, 0};
        moe_quant_file_opts fo = {.ue8m0 = v31 != 0};
        moe_quant_report rep;
        moe_error err;
        moe_status st = moe_quantize_checkpoint_with(sd, out, &o, &fo, &rep, &err);
        CHECK_OK(st, err);
        if (st != MOE_OK) continue;
        CHECK(strstr(rep.release, v31 ? "V3.1" : "DeepSeek-V3 / R1") != NULL, "%s", rep.release);
        list_tensors(out, &got, true);
        int diff = 0, nq = 0;
        for (int i = 0; i < in.n; i++) {
            const char *n = in.name[i];
            bool ok;
            if (!regexec(&lin, n, 0, NULL, 0)) {
                char s2[200];
                snprintf(s2, sizeof s2, "%.*s.weight_scale_inv", (int)(strlen(n) - 7), n);
                ok = tl_is(&got, n, MOE_DTYPE_F8_E4M3, 2, in.sh[i][0], in.sh[i][1]) &&
                     tl_is(&got, s2, MOE_DTYPE_F32, 2, cdiv(in.sh[i][0], 128), cdiv(in.sh[i][1], 128));
                nq++;
            } else {
                ok = tl_is(&got, n, in.dt[i], in.nd[i], in.sh[i][0], in.sh[i][1]);
            }
            if (!ok && diff++ < 5) CHECK(0, "V3 layout: %s", n);
        }
        CHECK(diff == 0 && got.n == in.n + nq && nq == 10 + 3 + 3 * 12 + 3, "%d differ, %d linears, %d tensors", diff, nq, got.n);
        cJSON *cfg = read_json_file(out, "config.json");
        CHECK(ds_qc_is(cfg, v31 ? "ue8m0" : NULL, NULL) && !cJSON_GetObjectItemCaseSensitive(cfg, "expert_dtype"),
              "V3%s quantization_config (scale_fmt %s)", v31 ? ".1" : "", v31 ? "ue8m0" : "absent");
        cJSON_Delete(cfg);
        /* it loads under its declaration (V3.1: scale_fmt ue8m0 is checked, every scale a power of two) */
        moe_model *m = NULL;
        CHECK_OK(moe_model_open(out, &m, &err), err);
        const moe_layer *L = NULL;
        if (m) {
            st = moe_model_layer(m, 1, &L, &err);
            CHECK(st == MOE_OK, "V3 FP8 loads under its declaration: %s", err.msg);
        }
        if (L) CHECK(L->w1[0].fmt == MOE_WFMT_FP8_BLOCK && L->w1[0].scale_dtype == MOE_DTYPE_F32, "weight_scale_inv F32");
        moe_model_free(m);
    }
    regfree(&lin);
}

/* nvidia/DeepSeek-R1-FP4 (ModelOpt NVFP4 on HF V3 names) from a BF16 V3
 * with a dense layer, a MoE layer and the MTP layer, in 2 shards: routed
 * and shared experts and the dense MLP NVFP4 (gate and up sharing
 * weight_scale_2), attention, router and the whole MTP layer BF16,
 * hf_quant_config.json NVFP4 with ModelOpt's exclude_modules, index metadata {}. */
static void test_quantize_r1_fp4(void) {
    tb b = {0};
    uint64_t s = 21;
    names l1 = {"model.layers.1.mlp", false}, l2 = {"model.layers.2.mlp", false};
    for (int l = 0; l < 3; l++) {
        char n[160];
        static const char *const at[] = {"q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"};
        for (int k = 0; k < 5; k++) {
            snprintf(n, sizeof n, "model.layers.%d.self_attn.%s", l, at[k]);
            add_linear(&b, n, 32, H, WF_BF16, &s);
        }
        snprintf(n, sizeof n, "model.layers.%d.input_layernorm.weight", l);
        tb_add(&b, n, MOE_DTYPE_BF16, 1, H, 0, 0);
    }
    add_linear(&b, "model.layers.0.mlp.gate_proj", 96, H, WF_BF16, &s);
    add_linear(&b, "model.layers.0.mlp.up_proj", 96, H, WF_BF16, &s);
    add_linear(&b, "model.layers.0.mlp.down_proj", H, 96, WF_BF16, &s);
    add_moe(&b, &l1, false, WF_BF16, WF_BF16, &s);
    add_moe(&b, &l2, false, WF_BF16, WF_BF16, &s);
    add_linear(&b, "model.layers.2.eh_proj", H, 2 * H, WF_BF16, &s);
    add_linear(&b, "model.embed_tokens", VOCAB, H, WF_BF16, &s);
    add_linear(&b, "lm_head", VOCAB, H, WF_BF16, &s);
    char *in = fresh_dir("r1-bf16"), *out = fresh_dir("r1-fp4-out");
    char cfg[2048];
    v3_config(cfg, sizeof cfg, 2, 1, NULL);
    put_text(in, "config.json", cfg);
    tb_write(&b, in, 2);
    moe_quant_opts o = {MOE_Q_NVFP4, MOE_Q_NONE, 0, 0};
    moe_quant_report rep;
    moe_error err;
    moe_status st = moe_quantize_checkpoint(in, out, &o, &rep, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) { tb_free(&b); return; }
    CHECK(strstr(rep.release, "R1-FP4") != NULL, "%s", rep.release);
    static tlist want, got;
    list_tensors(in, &want, false);
    list_tensors(out, &got, true);
    regex_t q;
    regcomp(&q, "^model\\.layers\\.[01]\\.mlp\\.(experts\\.[0-9]+\\.|shared_experts\\.)?(gate|up|down)_proj\\.weight$",
            REG_EXTENDED | REG_NOSUB);
    int diff = 0, nq = 0;
    for (int i = 0; i < want.n; i++) {
        const char *n = want.name[i];
        bool ok;
        if (!regexec(&q, n, 0, NULL, 0)) {
            char bn[160], c2[200];
            snprintf(bn, sizeof bn, "%.*s", (int)(strlen(n) - 7), n);
            int64_t R = want.sh[i][0], C = want.sh[i][1];
            snprintf(c2, sizeof c2, "%s.weight_scale", bn);
            ok = tl_is(&got, n, MOE_DTYPE_U8, 2, R, C / 2) && tl_is(&got, c2, MOE_DTYPE_F8_E4M3, 2, R, C / 16);
            snprintf(c2, sizeof c2, "%s.weight_scale_2", bn);
            ok = ok && tl_is(&got, c2, MOE_DTYPE_F32, 0, 0, 0);
            snprintf(c2, sizeof c2, "%s.input_scale", bn);
            ok = ok && tl_is(&got, c2, MOE_DTYPE_F32, 0, 0, 0);
            nq++;
        } else {
            ok = tl_is(&got, n, want.dt[i], want.nd[i], want.sh[i][0], want.sh[i][1]);
        }
        if (!ok && diff++ < 5) CHECK(0, "R1-FP4 layout: %s", n);
    }
    regfree(&q);
    CHECK(diff == 0 && nq == 3 + 3 * (E + 1) && got.n == want.n + 3 * nq, "%d differ, %d NVFP4 linears, %d tensors", diff,
          nq, got.n);
    cJSON *c = read_json_file(out, "config.json"), *h = read_json_file(out, "hf_quant_config.json");
    cJSON *ix = read_json_file(out, "model.safetensors.index.json");
    CHECK(!cJSON_GetObjectItemCaseSensitive(c, "quantization_config"), "ModelOpt declares in hf_quant_config.json only");
    const cJSON *qq = cJSON_GetObjectItemCaseSensitive(h, "quantization"), *xl = cJSON_GetObjectItemCaseSensitive(qq, "exclude_modules");
    static const char *const doc_ex[] = {"lm_head", "model.layers.0.self_attn*", "model.layers.1.self_attn*", "model.layers.2*"};
    int xk = cJSON_GetArraySize(xl) == 4;
    for (int i = 0; xk && i < 4; i++) xk = !strcmp(cJSON_GetArrayItem(xl, i)->valuestring, doc_ex[i]);
    CHECK(!strcmp(jstr(qq, "quant_algo"), "NVFP4") && cJSON_GetObjectItemCaseSensitive(qq, "group_size")->valueint == 16 &&
              cJSON_IsNull(cJSON_GetObjectItemCaseSensitive(qq, "kv_cache_quant_algo")) && xk &&
              !strcmp(jstr(cJSON_GetObjectItemCaseSensitive(h, "producer"), "name"), "modelopt"),
          "hf_quant_config.json as ModelOpt writes R1-FP4's");
    const cJSON *md = cJSON_GetObjectItemCaseSensitive(ix, "metadata");
    CHECK(cJSON_IsObject(md) && md->child == NULL, "index metadata {}");
    cJSON_Delete(c);
    cJSON_Delete(h);
    cJSON_Delete(ix);
    moe_model *m = NULL;
    CHECK_OK(moe_model_open(out, &m, &err), err);
    const moe_layer *L = NULL;
    if (m) {
        st = moe_model_layer(m, 1, &L, &err);
        CHECK(st == MOE_OK, "R1-FP4 loads under its declaration: %s", err.msg);
        if (L) CHECK(L->w1[0].fmt == MOE_WFMT_NVFP4 && L->w1[0].scale2 == L->w3[0].scale2 && L->sw1.scale2 == L->sw3.scale2 &&
                         L->nvfp4_scale2_mismatch == 0, "gate and up share weight_scale_2");
        st = moe_model_layer(m, 2, &L, &err);
        CHECK(st == MOE_OK && L->w1[0].fmt == MOE_WFMT_BF16, "the excluded MTP layer stays BF16: %s", err.msg);
    }
    moe_model_free(m);
    /* the dense MLP's gate and up share one weight_scale_2 too */
    moe_ckpt *ck = NULL;
    CHECK_OK(moe_ckpt_open(out, &ck, &err), err);
    const moe_st_tensor *g2 = NULL, *u2 = NULL;
    if (ck) {
        CHECK_OK(moe_ckpt_find(ck, "model.layers.0.mlp.gate_proj.weight_scale_2", &g2, &err), err);
        CHECK_OK(moe_ckpt_find(ck, "model.layers.0.mlp.up_proj.weight_scale_2", &u2, &err), err);
        if (g2 && u2) CHECK(!memcmp(g2->data, u2->data, 4), "dense gate/up weight_scale_2 equal");
        moe_ckpt_free(ck);
    }
    /* attention with FP8 has no ModelOpt NVFP4 release */
    o.others = MOE_Q_FP8;
    st = moe_quantize_checkpoint(in, fresh_dir("r1-fp4-bad"), &o, &rep, &err);
    CHECK(st == MOE_ERR_ARG && strstr(err.msg, "R1-FP4"), "--others fp8 refused: %s", err.msg);
    tb_free(&b);
}

/* ------------------------------------------------------ NVFP4 activations */

/* vLLM's ref_nvfp4_quant, independently: E4M3 by nearest search (ties to
 * the even code), E2M1 by its threshold table; x[n] (float) -> the values
 * the GEMM sees, code * sf * input_scale, in double. */
static float ind_e4m3(float v) {
    float best = 0.0f;
    int bc = 0;
    for (int c = 0; c < 127; c++) {
        float w = moe_fp8_e4m3_to_f32((uint8_t)c), d = fabsf(w - v), db = fabsf(best - v);
        if (d < db || (d == db && !(c & 1) && (bc & 1))) { best = w; bc = c; }
    }
    return best;
}
static float ind_fp4(float x) {
    float a = fabsf(x), r = a <= 0.25f ? 0 : a < 0.75f ? 0.5f : a <= 1.25f ? 1 : a < 1.75f ? 1.5f : a <= 2.5f ? 2
                          : a < 3.5f ? 3 : a <= 5.0f ? 4 : 6;
    return x < 0 ? -r : r;
}
static void ind_nvfp4_act(const double *x, int n, float in_scale, double *out) {
    float gs = 1.0f / in_scale, inv = 1.0f / gs, r6 = 1.0f / 6.0f;
    for (int b = 0; b < n; b += 16) {
        int m = n - b < 16 ? n - b : 16;
        float xf[16], vmax = 0;
        for (int i = 0; i < m; i++) { xf[i] = (float)x[b + i]; vmax = fmaxf(vmax, fabsf(xf[i])); }
        float sfv = ind_e4m3(fminf(gs * (vmax * r6), 448.0f));
        float os = sfv == 0 ? 0.0f : 1.0f / (sfv * inv);
        for (int i = 0; i < m; i++) out[b + i] = (double)(ind_fp4(fminf(fmaxf(xf[i] * os, -6.0f), 6.0f)) * sfv) * in_scale;
    }
}

/* One expert on one token with NVFP4 activations of static scales s13, s2. */
static void ind_expert(const moe_weight *w1, const moe_weight *w3, const moe_weight *w2, const double *x, float s13,
                       float s2, double *y) {
    double xq[H], row[H > I ? H : I], a[I], aq[I];
    ind_nvfp4_act(x, H, s13, xq);
    for (int i = 0; i < I; i++) {
        double g = 0, u = 0;
        moe_weight_row_f64(w1, i, row);
        for (int h = 0; h < H; h++) g += row[h] * xq[h];
        moe_weight_row_f64(w3, i, row);
        for (int h = 0; h < H; h++) u += row[h] * xq[h];
        a[i] = g / (1.0 + exp(-g)) * u;
    }
    ind_nvfp4_act(a, I, s2, aq);
    for (int h = 0; h < H; h++) {
        moe_weight_row_f64(w2, h, row);
        double acc = 0;
        for (int i = 0; i < I; i++) acc += row[i] * aq[i];
        y[h] = acc;
    }
}

/* W4A4 on a ModelOpt NVFP4 layer (experts and shared expert with their own
 * input_scale): the block's float64 output equals an independent NVFP4
 * forward for both rules (TensorRT-LLM's per-layer scale, vLLM's per
 * expert); float32 follows float64; a layer without input scales refuses. */
static void test_nvfp4_activations(void) {
    tb b = {0};
    uint64_t s = 31;
    names l1 = {"model.layers.1.mlp", false};
    add_moe(&b, &l1, false, WF_NVFP4_MO, WF_NVFP4_MO, &s);
    char *dir = fresh_dir("w4a4");
    char cfg[2048];
    v3_config(cfg, sizeof cfg, 2, 0, NULL);
    put_text(dir, "config.json", cfg);
    put_text(dir, "hf_quant_config.json", "{\"quantization\": {\"quant_algo\": \"NVFP4\", \"group_size\": 16}}");
    tb_write(&b, dir, 1);
    moe_model *m = NULL;
    moe_error err;
    CHECK_OK(moe_model_open(dir, &m, &err), err);
    const moe_layer *L = NULL;
    if (m) CHECK_OK(moe_model_layer(m, 1, &L, &err), err);
    if (!L) { moe_model_free(m); tb_free(&b); return; }
    enum { T = 11 };
    double hidden[T * H];
    uint64_t r = 5;
    for (int i = 0; i < T * H; i++) hidden[i] = 3.0 * moe_t_rng_normal(&r);
    float m13 = 0, m2 = 0;
    for (int e = 0; e < E; e++) {
        m13 = fmaxf(m13, fmaxf(L->w1[e].input_scale, L->w3[e].input_scale));
        m2 = fmaxf(m2, L->w2[e].input_scale);
    }
    double *prev = NULL;
    for (int rule = 0; rule < 2; rule++) {
        moe_run_opts o = moe_run_opts_default();
        o.act = rule ? MOE_ACT_NVFP4_EXPERT : MOE_ACT_NVFP4;
        moe_block_out out;
        CHECK_OK(moe_block_out_init(&out, L, T, &o, &err), err);
        moe_status st = moe_block_run(L, hidden, NULL, T, &o, &out, &err);
        CHECK(st == MOE_OK, "%s: %s", moe_act_prec_name(o.act), err.msg);
        double worst = 0;
        for (int t = 0; st == MOE_OK && t < T; t++) {
            double want[H], y[H];
            float ss13 = fmaxf(L->sw1.input_scale, L->sw3.input_scale);
            ind_expert(&L->sw1, &L->sw3, &L->sw2, hidden + t * H, ss13, L->sw2.input_scale, want);
            for (int j = 0; j < K; j++) {
                int e = out.topk_ids[t * K + j];
                float s13 = rule ? fmaxf(L->w1[e].input_scale, L->w3[e].input_scale) : m13;
                float s2 = rule ? L->w2[e].input_scale : m2;
                ind_expert(&L->w1[e], &L->w3[e], &L->w2[e], hidden + t * H, s13, s2, y);
                for (int h = 0; h < H; h++) want[h] += out.eff_weights[t * K + j] * y[h];
            }
            double num = 0, den = 0;
            for (int h = 0; h < H; h++) {
                num += (out.moe_out[t * H + h] - want[h]) * (out.moe_out[t * H + h] - want[h]);
                den += want[h] * want[h];
            }
            worst = fmax(worst, sqrt(num / den));
        }
        /* float64 sums in another order: ~1e-15; a float-rounded activation
         * landing on an E2M1 boundary would show as ~1e-2 */
        CHECK(worst < 1e-12, "%s: block vs independent NVFP4 forward, relative %.3g", moe_act_prec_name(o.act), worst);
        if (rule == 0) {
            prev = malloc(sizeof(double) * T * H);
            memcpy(prev, out.moe_out, sizeof(double) * T * H);
        } else {
            double d = 0;
            for (int i = 0; i < T * H; i++) d = fmax(d, fabs(prev[i] - out.moe_out[i]));
            CHECK(d > 0, "the two scale rules differ when the experts' input scales do");
        }
        /* float32 */
        o.precision = MOE_PREC_F32;
        moe_block_out o32;
        CHECK_OK(moe_block_out_init(&o32, L, T, &o, &err), err);
        CHECK_OK(moe_block_run(L, hidden, NULL, T, &o, &o32, &err), err);
        double num = 0, den = 0;
        for (int i = 0; i < T * H; i++) {
            num += (o32.moe_out[i] - out.moe_out[i]) * (o32.moe_out[i] - out.moe_out[i]);
            den += out.moe_out[i] * out.moe_out[i];
        }
        /* float32 may move an activation across an E2M1 boundary (one code
         * step, <= 1/3 of a block's scale on that element): well under 1e-2 */
        CHECK(sqrt(num / den) < 1e-2, "%s f32 vs f64: %.3g", moe_act_prec_name(o.act), sqrt(num / den));
        moe_block_out_free(&o32);
        moe_block_out_free(&out);
    }
    free(prev);
    /* an expert-parallel share (experts [0, 2)) keeps the layer-wide scale */
    moe_layer *part = NULL;
    CHECK_OK(moe_model_layer_experts(m, 1, 0, 2, &part, &err), err);
    if (part) {
        CHECK(part->w1[0].act_scale == m13 && part->w2[1].act_scale == m2 && part->w1[3].rows == 0,
              "partial layer act_scale %g / %g, the layer's %g / %g", part->w1[0].act_scale, part->w2[1].act_scale, m13, m2);
        moe_layer_free(part);
    }
    moe_model_free(m);
    tb_free(&b);

    /* BF16 layer: refused without scales; calibrated, it runs */
    tb c = {0};
    add_moe(&c, &l1, false, WF_BF16, WF_BF16, &s);
    char *d2 = fresh_dir("w4a4-bf16");
    put_text(d2, "config.json", cfg);
    tb_write(&c, d2, 1);
    CHECK_OK(moe_model_open(d2, &m, &err), err);
    L = NULL;
    if (m) CHECK_OK(moe_model_layer(m, 1, &L, &err), err);
    if (L) {
        moe_run_opts o = moe_run_opts_default();
        o.act = MOE_ACT_NVFP4;
        moe_block_out out;
        CHECK_OK(moe_block_out_init(&out, L, 1, &o, &err), err);
        moe_status st = moe_block_run(L, hidden, NULL, 1, &o, &out, &err);
        CHECK(st == MOE_ERR_MISSING && strstr(err.msg, "input scales") && strstr(err.msg, "experts.0.gate_proj"),
              "no input scales: %s", err.msg);
        moe_block_out_free(&out);
        /* ModelOpt's calibration on one token: its two experts get amax / (6 * 448) of that token, the
         * others the largest calibrated amax */
        moe_quant_opts q = {MOE_Q_NVFP4, MOE_Q_NVFP4, 0, 0};
        moe_layer *Q = NULL;
        CHECK_OK(moe_layer_quantize(L, &q, &Q, &err), err);
        moe_run_opts ro = moe_run_opts_default();
        moe_block_out ref;
        CHECK_OK(moe_block_out_init(&ref, L, 1, &ro, &err), err);
        CHECK_OK(moe_block_run(L, hidden, NULL, 1, &ro, &ref, &err), err);
        if (Q) {
            CHECK_OK(moe_layer_calibrate_nvfp4(Q, L, hidden, NULL, 1, &err), err);
            double amax = 0;
            for (int h = 0; h < H; h++) amax = fmax(amax, fabs((double)(float)hidden[h]));
            float want = (float)amax / (6.0f * 448.0f);
            int hit = 0, ok = 0;
            for (int e = 0; e < E; e++) {
                bool routed = ref.topk_ids[0] == e || ref.topk_ids[1] == e;
                hit += routed;
                ok += Q->w1[e].input_scale == want && Q->w3[e].input_scale == want && Q->w2[e].input_scale > 0;
            }
            CHECK(hit == K && ok == E && Q->sw1.input_scale == want && Q->w1[0].act_scale == want,
                  "calibrated input scales (%d of %d as expected)", ok, E);
            /* and the W4A4 block runs */
            moe_block_out o2;
            CHECK_OK(moe_block_out_init(&o2, Q, T, &o, &err), err);
            CHECK_OK(moe_block_run(Q, hidden, NULL, T, &o, &o2, &err), err);
            moe_block_out_free(&o2);
            moe_layer_free(Q);
        }
        moe_block_out_free(&ref);
        /* the audit's NVFP4 rows calibrate on the audited tokens and grade */
        moe_audit_path ps[40];
        int np = moe_audit_default_paths(ps, 40), k = 0;
        moe_audit_path sel[3];
        for (int i = 0; i < np; i++)
            if ((ps[i].act == MOE_ACT_NVFP4 || ps[i].act == MOE_ACT_NVFP4_EXPERT) && k < 3) sel[k++] = ps[i];
        CHECK(k == 3, "3 NVFP4 activation rows in the default audit (%d)", k);
        moe_audit_row rows[3];
        CHECK_OK(moe_audit_layer(L, hidden, NULL, T, sel, k, rows, NULL, NULL, &err), err);
        for (int i = 0; i < k; i++)
            CHECK(rows[i].status == MOE_OK && strstr(rows[i].note, "calibrated") && rows[i].nmse > 0 &&
                      isfinite(rows[i].nmse) && rows[i].nmse < 0.1,
                  "%s: %s nmse %.3g (%s)", rows[i].path.name, moe_status_str(rows[i].status), rows[i].nmse, rows[i].note);
    }
    moe_model_free(m);
    tb_free(&c);
}

/* `moeaudit inspect --json -` on the committed V4-Flash-layout dataset:
 * its layers, MTP block, attention per layer and formats, as JSON. */
static void test_inspect_cli(void) {
    static char out[1 << 18];
    char cmd[2048];
    snprintf(cmd, sizeof cmd, "%s inspect --model %s --json -", MOE_CLI, moe_t_data("dsv4-flash-layout"));
    int rc = moe_t_sh(cmd, out, sizeof out);
    CHECK(rc == 0, "inspect exit %d", rc);
    cJSON *j = cJSON_Parse(out);
    CHECK(j != NULL, "inspect --json - prints JSON");
    if (!j) return;
    const cJSON *ll = cJSON_GetObjectItemCaseSensitive(j, "layer_list");
    CHECK(cJSON_GetArraySize(ll) == 4 && cJSON_GetObjectItemCaseSensitive(j, "mtp_blocks")->valueint == 1 &&
              cJSON_GetObjectItemCaseSensitive(j, "hash_layers")->valueint == 1 &&
              cJSON_GetObjectItemCaseSensitive(j, "shards")->valueint == 3 &&
              cJSON_GetObjectItemCaseSensitive(j, "tensors")->valueint == 339,
          "layers, MTP, hash layers, shards, tensors");
    static const char *const att[4] = {"sliding window", "CSA (ratio 4) + indexer", "HCA (ratio 16)", "sliding window"};
    static const char *const mlp[4] = {"hash", "top-k", "top-k", "top-k"};
    for (int l = 0; l < 4 && cJSON_GetArraySize(ll) == 4; l++) {
        const cJSON *o = cJSON_GetArrayItem(ll, l);
        CHECK(!strcmp(jstr(o, "attention"), att[l]) && !strcmp(jstr(o, "mlp"), mlp[l]) &&
                  cJSON_IsTrue(cJSON_GetObjectItemCaseSensitive(o, "mtp")) == (l == 3) && !strcmp(jstr(o, "moeaudit"), "yes"),
              "layer %d: %s, %s, %s", l, jstr(o, "attention"), jstr(o, "mlp"), jstr(o, "moeaudit"));
    }
    int seen = 0;
    const cJSON *fm = cJSON_GetObjectItemCaseSensitive(j, "formats");
    for (int i = 0; i < cJSON_GetArraySize(fm); i++) {
        const cJSON *o = cJSON_GetArrayItem(fm, i);
        const char *f = jstr(o, "family"), *sc = jstr(o, "scheme");
        int n = cJSON_GetObjectItemCaseSensitive(o, "count")->valueint;
        seen += !strcmp(f, "routed experts") && !strcmp(sc, "mxfp4 (I8 + .scale F8_E8M0)") && n == 96;
        seen += !strcmp(f, "compressors") && !strcmp(sc, "BF16") && n == 6;
        seen += !strcmp(f, "indexer") && strstr(sc, "fp8 128x128 blocks (.scale F8_E8M0)") && n == 1;
        seen += !strcmp(f, "MTP projections") && strstr(sc, "fp8 128x128") && n == 2;
    }
    CHECK(seen == 4, "formats by family as released (%d of 4)", seen);
    cJSON_Delete(j);
    /* text, and a refusal for a directory without config */
    snprintf(cmd, sizeof cmd, "%s inspect --model %s", MOE_CLI, moe_t_data("dsv3-tiny-fp8"));
    rc = moe_t_sh(cmd, out, sizeof out);
    CHECK(rc == 0 && strstr(out, "fp8 128x128 blocks (weight_scale_inv F32)") && strstr(out, "dense layer"), "text: %s", out);
    snprintf(cmd, sizeof cmd, "%s inspect --model %s 2>/dev/null", MOE_CLI, moe_t_tmpdir());
    rc = moe_t_sh(cmd, out, sizeof out);
    CHECK(rc == 2, "no config.json: exit %d", rc);
}

int main(void) {
    RUN(test_v4_flash);
    RUN(test_v4_flash_dataset);
    RUN(test_v3_family);
    RUN(test_modelopt_r1_fp4);
    RUN(test_nvidia_v4_nvfp4);
    RUN(test_compressed_tensors);
    RUN(test_modelopt_fp8_tensor);
    RUN(test_v41_blocks);
    RUN(test_stacked_experts);
    RUN(test_unknown_dtype_shard);
    RUN(test_contradictions);
    RUN(test_scale_bounds_and_memory);
    RUN(test_quantize_v4_releases);
    RUN(test_quantize_v3_releases);
    RUN(test_quantize_r1_fp4);
    RUN(test_nvfp4_activations);
    RUN(test_inspect_cli);
    return moe_t_finish();
}
