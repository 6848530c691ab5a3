/* safetensors reader/writer and checkpoint directory tests. */
#include "core/core.h"
#include "harness.h"

#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

/* ---------------------------------------------------------------- helpers */

static uint64_t rng_next(uint64_t *s) { /* xorshift64* */
    *s ^= *s >> 12;
    *s ^= *s << 25;
    *s ^= *s >> 27;
    return *s * 2685821657736338717ull;
}

static void write_bytes(const char *path, const void *p, size_t n) {
    FILE *fp = fopen(path, "wb");
    if (!fp) { perror(path); return; }
    if (n && fwrite(p, 1, n, fp) != n) perror(path);
    fclose(fp);
}

static unsigned char *read_bytes(const char *path, size_t *n) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return NULL;
    fseek(fp, 0, SEEK_END);
    long l = ftell(fp);
    fseek(fp, 0, SEEK_SET);
    unsigned char *b = malloc((size_t)l + 1);
    *n = fread(b, 1, (size_t)l, fp);
    fclose(fp);
    return b;
}

/* A file: 8-byte length `hlen` (as given, even if it lies), `json`, then
 * `data_len` bytes of 0xab. */
static void write_raw(const char *path, uint64_t hlen, const char *json, size_t data_len) {
    size_t jl = strlen(json);
    unsigned char *b = calloc(8 + jl + data_len + 1, 1);
    for (int i = 0; i < 8; i++) b[i] = (unsigned char)(hlen >> (8 * i));
    memcpy(b + 8, json, jl);
    memset(b + 8 + jl, 0xab, data_len);
    write_bytes(path, b, 8 + jl + data_len);
    free(b);
}

/* Open a file made of `json` + data_len bytes; expect status `want` and each
 * non-NULL needle in the message. */
static void expect_st(const char *name, const char *json, size_t data_len, moe_status want,
                      const char *n1, const char *n2) {
    char path[512];
    moe_t_tmp_path(path, sizeof path, name);
    write_raw(path, strlen(json), json, data_len);
    moe_st_file *f = NULL;
    moe_error err = {{0}};
    moe_status st = moe_st_open(path, &f, &err);
    CHECK(st == want, "%s: got %s want %s: %s", name, moe_status_str(st), moe_status_str(want),
          err.msg);
    if (want != MOE_OK) {
        CHECK(f == NULL, "%s: handle set on failure", name);
        CHECK(strstr(err.msg, name) != NULL, "%s: message lacks the file: %s", name, err.msg);
        if (n1) CHECK(strstr(err.msg, n1) != NULL, "%s: message lacks \"%s\": %s", name, n1, err.msg);
        if (n2) CHECK(strstr(err.msg, n2) != NULL, "%s: message lacks \"%s\": %s", name, n2, err.msg);
    }
    moe_st_close(f);
}

/* --------------------------------------------------------------- fixture */

static void test_fixture(void) {
    moe_error err = {{0}};
    moe_st_file *f = NULL;
    const char *path = moe_t_data("dsv4-tiny/model.safetensors");
    moe_status st = moe_st_open(path, &f, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    CHECK(moe_st_count(f) == 256, "count %zu", moe_st_count(f));
    CHECK(strcmp(moe_st_path(f), path) == 0, "path %s", moe_st_path(f));
    const char *fmt = moe_st_metadata(f, "format");
    CHECK(fmt && strcmp(fmt, "pt") == 0, "metadata format %s", fmt ? fmt : "(null)");
    CHECK(moe_st_metadata(f, "nope") == NULL, "unexpected metadata");

    const moe_st_tensor *t = moe_st_find(f, "model.layers.0.ffn.gate.tid2eid");
    CHECK(t != NULL, "tid2eid missing");
    if (t) {
        CHECK(t->dtype == MOE_DTYPE_I64 && t->ndim == 2 && t->shape[0] == 300 &&
                  t->shape[1] == 3 && t->nbytes == 7200,
              "tid2eid %s ndim %d", moe_dtype_name(t->dtype), t->ndim);
        /* Known values (first row [3, 2, 4]); all in [0, 12). */
        CHECK(moe_load_i64(t->data, t->dtype, 0) == 3 && moe_load_i64(t->data, t->dtype, 1) == 2 &&
                  moe_load_i64(t->data, t->dtype, 2) == 4, "tid2eid row 0");
        int bad = 0;
        for (size_t i = 0; i < 900; i++) {
            int64_t v = moe_load_i64(t->data, t->dtype, i);
            bad += v < 0 || v >= 12;
        }
        CHECK(bad == 0, "%d tid2eid values outside [0, 12)", bad);
    }
    t = moe_st_find(f, "model.layers.3.ffn.gate.bias");
    CHECK(t != NULL, "bias missing");
    if (t) {
        CHECK(t->dtype == MOE_DTYPE_BF16 && t->ndim == 1 && t->shape[0] == 12 && t->nbytes == 24,
              "bias %s ndim %d", moe_dtype_name(t->dtype), t->ndim);
        /* First element bytes bb 3d: bf16 0x3dbb. */
        CHECK(moe_load_f64(t->data, t->dtype, 0) == (double)moe_bf16_to_f32(0x3dbb), "bias[0]");
    }
    CHECK(moe_st_find(f, "model.layers.3.ffn.gate.nope") == NULL, "found a missing tensor");
    CHECK(moe_st_find(f, "") == NULL, "found the empty name");
    /* find agrees with at for every tensor. */
    int mism = 0;
    for (size_t i = 0; i < moe_st_count(f); i++)
        mism += moe_st_find(f, moe_st_at(f, i)->name) != moe_st_at(f, i);
    CHECK(mism == 0, "%d tensors not found by name", mism);
    moe_st_close(f);
    moe_st_close(NULL);
}

/* ------------------------------------------------------------ round trip */

static void test_roundtrip(void) {
    uint64_t rs = 0x9e3779b97f4a7c15ull;
    enum { N = MOE_DTYPE_COUNT + 2 };
    moe_st_entry e[N];
    void *bufs[N];
    char names[N][32];
    memset(e, 0, sizeof e);
    for (int i = 0; i < N; i++) {
        moe_dtype dt = (moe_dtype)(i % MOE_DTYPE_COUNT);
        snprintf(names[i], sizeof names[i], "t%02d.%s", i, moe_dtype_name(dt));
        e[i].name = names[i];
        e[i].dtype = dt;
        e[i].ndim = i % 4; /* scalars too */
        size_t elems = 1;
        for (int d = 0; d < e[i].ndim; d++) {
            e[i].shape[d] = 1 + (int64_t)(rng_next(&rs) % 5);
            elems *= (size_t)e[i].shape[d];
        }
        if (i == N - 1) { e[i].ndim = 2; e[i].shape[0] = 3; e[i].shape[1] = 0; elems = 0; }
        size_t nb = elems * moe_dtype_size(dt);
        unsigned char *b = malloc(nb + 1);
        for (size_t k = 0; k < nb; k++) b[k] = (unsigned char)rng_next(&rs);
        bufs[i] = b;
        e[i].data = elems ? b : NULL;
    }
    const char *meta[] = {"format", "pt", "note", "round \"trip\" \xc3\xa9", NULL};
    char path[512];
    moe_t_tmp_path(path, sizeof path, "roundtrip.safetensors");
    moe_error err = {{0}};
    moe_status st = moe_st_write(path, e, N, meta, &err);
    CHECK_OK(st, err);

    /* Layout: header length a multiple of 8, data contiguous, no temp left. */
    size_t flen = 0;
    unsigned char *raw = read_bytes(path, &flen);
    CHECK(raw != NULL, "cannot read back");
    if (raw) {
        uint64_t hlen = 0;
        for (int k = 7; k >= 0; k--) hlen = (hlen << 8) | raw[k];
        CHECK(hlen % 8 == 0, "header length %llu", (unsigned long long)hlen);
        CHECK(raw[8] == '{', "header starts with %c", raw[8]);
        CHECK(memcmp(raw + 8, "{\"__metadata__\"", 15) == 0, "metadata not first");
    }
    char tmp[600];
    snprintf(tmp, sizeof tmp, "%s.tmp.%ld", path, (long)getpid());
    CHECK(access(tmp, F_OK) != 0, "temp file left behind");

    for (int pass = 0; pass < 2; pass++) {
        moe_st_file *f = NULL;
        st = pass == 0 ? moe_st_open(path, &f, &err)
                       : moe_st_open_buffer(raw, flen, "roundtrip-buffer", &f, &err);
        CHECK_OK(st, err);
        if (st != MOE_OK) continue;
        CHECK(moe_st_count(f) == N, "count %zu", moe_st_count(f));
        const char *v = moe_st_metadata(f, "note");
        CHECK(v && strcmp(v, meta[3]) == 0, "metadata note %s", v ? v : "(null)");
        v = moe_st_metadata(f, "format");
        CHECK(v && strcmp(v, "pt") == 0, "metadata format");
        uint64_t expect_off = 0;
        const unsigned char *data0 = NULL;
        for (int i = 0; i < N && (size_t)i < moe_st_count(f); i++) {
            const moe_st_tensor *t = moe_st_at(f, i);
            CHECK(strcmp(t->name, e[i].name) == 0, "order: %s vs %s", t->name, e[i].name);
            CHECK(t->dtype == e[i].dtype && t->ndim == e[i].ndim, "%s dtype/ndim", t->name);
            int same = 1;
            for (int d = 0; d < t->ndim; d++) same &= t->shape[d] == e[i].shape[d];
            CHECK(same, "%s shape", t->name);
            size_t elems = 1;
            for (int d = 0; d < e[i].ndim; d++) elems *= (size_t)e[i].shape[d];
            CHECK(t->nbytes == elems * moe_dtype_size(e[i].dtype), "%s nbytes", t->name);
            CHECK(t->nbytes == 0 || memcmp(t->data, bufs[i], t->nbytes) == 0, "%s data", t->name);
            if (i == 0) data0 = t->data;
            CHECK((const unsigned char *)t->data == data0 + expect_off, "%s not contiguous",
                  t->name);
            expect_off += t->nbytes;
            CHECK(moe_st_find(f, e[i].name) == t, "find %s", e[i].name);
        }
        if (pass == 1 && data0)
            CHECK((size_t)(data0 - raw) + expect_off == flen, "data section size");
        moe_st_close(f);
    }
    free(raw);

    /* No metadata, no tensors: "{}" padded. */
    st = moe_st_write(path, NULL, 0, NULL, &err);
    CHECK_OK(st, err);
    moe_st_file *f = NULL;
    st = moe_st_open(path, &f, &err);
    CHECK_OK(st, err);
    if (f) {
        CHECK(moe_st_count(f) == 0 && moe_st_metadata(f, "format") == NULL, "empty file");
        moe_st_close(f);
    }
    for (int i = 0; i < N; i++) free(bufs[i]);
}

static void test_write_errors(void) {
    char path[512], tmp[600];
    moe_t_tmp_path(path, sizeof path, "keep.safetensors");
    float x[4] = {1, 2, 3, 4};
    moe_st_entry good = {.name = "keep.me", .dtype = MOE_DTYPE_F32, .ndim = 1, .shape = {4},
                         .data = x};
    moe_error err = {{0}};
    CHECK_OK(moe_st_write(path, &good, 1, NULL, &err), err);
    size_t n0 = 0;
    unsigned char *before = read_bytes(path, &n0);

    moe_st_entry bad[2] = {good, good};
    bad[1].name = "dup.name";
    bad[0].name = "dup.name";
    moe_status st = moe_st_write(path, bad, 2, NULL, &err);
    CHECK(st == MOE_ERR_ARG && strstr(err.msg, "dup.name"), "dup: %s", err.msg);

    bad[0] = good;
    bad[0].name = "too.many.dims";
    bad[0].ndim = MOE_MAX_DIMS + 1;
    st = moe_st_write(path, bad, 1, NULL, &err);
    CHECK(st == MOE_ERR_ARG && strstr(err.msg, "too.many.dims"), "ndim: %s", err.msg);

    bad[0] = good;
    bad[0].name = "neg.shape";
    bad[0].shape[0] = -4;
    st = moe_st_write(path, bad, 1, NULL, &err);
    CHECK(st == MOE_ERR_ARG && strstr(err.msg, "neg.shape") && strstr(err.msg, "-4"),
          "neg: %s", err.msg);

    bad[0] = good;
    bad[0].name = "__metadata__";
    st = moe_st_write(path, bad, 1, NULL, &err);
    CHECK(st == MOE_ERR_ARG && strstr(err.msg, "__metadata__"), "meta name: %s", err.msg);

    const char *meta[] = {"k", "v", "k", "w", NULL};
    st = moe_st_write(path, &good, 1, meta, &err);
    CHECK(st == MOE_ERR_ARG && strstr(err.msg, "\"k\""), "meta dup: %s", err.msg);

    /* Destination untouched by the failures. */
    size_t n1 = 0;
    unsigned char *after = read_bytes(path, &n1);
    CHECK(before && after && n0 == n1 && memcmp(before, after, n0) == 0, "destination changed");
    free(before);
    free(after);

    /* A directory that does not exist: MOE_ERR_IO, nothing left behind. */
    moe_t_tmp_path(path, sizeof path, "no-such-dir/x.safetensors");
    st = moe_st_write(path, &good, 1, NULL, &err);
    CHECK(st == MOE_ERR_IO && strstr(err.msg, "no-such-dir"), "io: %s", err.msg);
    /* Destination is a directory: refused before anything is written. */
    moe_t_tmp_path(path, sizeof path, "a-directory");
    mkdir(path, 0755);
    st = moe_st_write(path, &good, 1, NULL, &err);
    CHECK(st == MOE_ERR_ARG && strstr(err.msg, "a directory"), "directory: %s", err.msg);
    CHECK(moe_t_count_temps(moe_t_tmpdir()) == 0, "temp file left behind");
    (void)tmp;
}

/* ------------------------------------------------------------- malformed */

static void test_truncated(void) {
    char path[512];
    moe_t_tmp_path(path, sizeof path, "whole.safetensors");
    int32_t a[6] = {1, 2, 3, 4, 5, 6};
    double b[3] = {0.5, 1.5, 2.5};
    moe_st_entry e[2] = {
        {.name = "first.a", .dtype = MOE_DTYPE_I32, .ndim = 2, .shape = {2, 3}, .data = a},
        {.name = "second.b", .dtype = MOE_DTYPE_F64, .ndim = 1, .shape = {3}, .data = b},
    };
    moe_error err = {{0}};
    CHECK_OK(moe_st_write(path, e, 2, NULL, &err), err);
    size_t len = 0;
    unsigned char *raw = read_bytes(path, &len);
    if (!raw) { CHECK(0, "read back"); return; }
    uint64_t hlen = 0;
    for (int k = 7; k >= 0; k--) hlen = (hlen << 8) | raw[k];
    struct { size_t cut; const char *needle; } cuts[] = {
        {0, "too short"},  {4, "too short"},  {7, "too short"},
        {8, "past the end"}, {8 + (size_t)hlen / 2, "past the end"},
        {8 + (size_t)hlen - 1, "past the end"},
        {8 + (size_t)hlen, "first.a"},           /* header only */
        {8 + (size_t)hlen + 10, "first.a"},      /* inside the first tensor */
        {8 + (size_t)hlen + 24, "second.b"},     /* between: a complete, b absent */
        {len - 1, "second.b"},                   /* last byte missing */
    };
    for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
        char name[64], p[512];
        snprintf(name, sizeof name, "trunc-%zu.safetensors", cuts[i].cut);
        moe_t_tmp_path(p, sizeof p, name);
        write_bytes(p, raw, cuts[i].cut);
        moe_st_file *f = NULL;
        moe_status st = moe_st_open(p, &f, &err);
        CHECK(st == MOE_ERR_FORMAT && f == NULL, "cut %zu: %s", cuts[i].cut, moe_status_str(st));
        CHECK(strstr(err.msg, name) && strstr(err.msg, cuts[i].needle), "cut %zu: %s",
              cuts[i].cut, err.msg);
        moe_st_close(f);
        /* Same through the buffer entry point. */
        st = moe_st_open_buffer(raw, cuts[i].cut, "buf-label", &f, &err);
        CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "buf-label") &&
                  strstr(err.msg, cuts[i].needle), "buffer cut %zu: %s", cuts[i].cut, err.msg);
        moe_st_close(f);
    }
    free(raw);
}

static void test_malformed(void) {
    char big[128];
    /* Header length field lies. */
    char path[512];
    moe_error err = {{0}};
    moe_st_file *f = NULL;
    moe_t_tmp_path(path, sizeof path, "hlen-past-end.safetensors");
    write_raw(path, 4096, "{}", 0);
    moe_status st = moe_st_open(path, &f, &err);
    CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "hlen-past-end") && strstr(err.msg, "4096"),
          "%s", err.msg);
    moe_t_tmp_path(path, sizeof path, "hlen-over-limit.safetensors");
    write_raw(path, (uint64_t)MOE_ST_MAX_HEADER + 1, "{}", 0);
    st = moe_st_open(path, &f, &err);
    snprintf(big, sizeof big, "%llu", (unsigned long long)MOE_ST_MAX_HEADER + 1);
    CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "hlen-over-limit") && strstr(err.msg, big),
          "%s", err.msg);
    moe_t_tmp_path(path, sizeof path, "hlen-huge.safetensors");
    write_raw(path, UINT64_MAX, "{}", 0);
    st = moe_st_open(path, &f, &err);
    CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "18446744073709551615"), "%s", err.msg);

    /* Missing file and a directory. */
    moe_t_tmp_path(path, sizeof path, "does-not-exist.safetensors");
    st = moe_st_open(path, &f, &err);
    CHECK(st == MOE_ERR_IO && strstr(err.msg, "does-not-exist.safetensors"), "%s", err.msg);
    st = moe_st_open(moe_t_tmpdir(), &f, &err);
    CHECK(st == MOE_ERR_IO && strstr(err.msg, moe_t_tmpdir()), "%s", err.msg);

    /* JSON-level. */
    expect_st("bad-json.st", "{\"a\": ", 0, MOE_ERR_FORMAT, "JSON", NULL);
    expect_st("not-object.st", "[1, 2]", 0, MOE_ERR_FORMAT, "not a JSON object", NULL);
    expect_st("string-root.st", "\"x\"", 0, MOE_ERR_FORMAT, "not a JSON object", NULL);
    expect_st("trailing.st", "{} x", 0, MOE_ERR_FORMAT, "after the JSON", NULL);
    expect_st("padded.st", "{}        ", 0, MOE_OK, NULL, NULL);
    expect_st("empty-header.st", "", 0, MOE_ERR_FORMAT, "JSON", NULL);

    /* Entries. */
    /* An unknown dtype fails only its tensor (test_unknown_dtype); a dtype
     * string that is no name at all fails the file. */
    expect_st("unknown-dtype.st",
              "{\"tensor.alpha\":{\"dtype\":\"Q4_K\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2,
              MOE_OK, NULL, NULL);
    expect_st("empty-dtype.st",
              "{\"tensor.alpha\":{\"dtype\":\"\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2,
              MOE_ERR_FORMAT, "tensor.alpha", "not a dtype name");
    expect_st("long-dtype.st",
              "{\"tensor.alpha\":{\"dtype\":\"F8_E4M3_WITH_A_VERY_LONG_SUFFIX_XYZ\",\"shape\":[2],"
              "\"data_offsets\":[0,2]}}", 2, MOE_ERR_FORMAT, "tensor.alpha", "not a dtype name");
    expect_st("unknown-dtype-bad-shape.st",
              "{\"tensor.alpha\":{\"dtype\":\"F4\",\"shape\":[2.5],\"data_offsets\":[0,2]}}", 2,
              MOE_ERR_FORMAT, "tensor.alpha", "shape[0]");
    expect_st("unknown-dtype-past-end.st",
              "{\"tensor.alpha\":{\"dtype\":\"F4\",\"shape\":[2],\"data_offsets\":[0,9]}}", 2,
              MOE_ERR_FORMAT, "tensor.alpha", "past the data section");
    expect_st("unknown-dtype-overlap.st",
              "{\"a\":{\"dtype\":\"F4\",\"shape\":[2],\"data_offsets\":[0,2]},"
              "\"b\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[1,3]}}", 3,
              MOE_ERR_FORMAT, "overlap", NULL);
    expect_st("unknown-dtype-dup.st",
              "{\"a\":{\"dtype\":\"F4\",\"shape\":[2],\"data_offsets\":[0,1]},"
              "\"a\":{\"dtype\":\"U8\",\"shape\":[1],\"data_offsets\":[1,2]}}", 2,
              MOE_ERR_FORMAT, "appears twice", NULL);
    expect_st("dtype-number.st",
              "{\"tensor.alpha\":{\"dtype\":7,\"shape\":[2],\"data_offsets\":[0,2]}}", 2,
              MOE_ERR_FORMAT, "tensor.alpha", "dtype");
    expect_st("entry-not-object.st", "{\"tensor.beta\": [1,2]}", 0, MOE_ERR_FORMAT,
              "tensor.beta", NULL);
    expect_st("no-shape.st", "{\"tensor.beta\":{\"dtype\":\"F32\",\"data_offsets\":[0,4]}}", 4,
              MOE_ERR_FORMAT, "tensor.beta", "shape");
    expect_st("no-offsets.st", "{\"tensor.beta\":{\"dtype\":\"F32\",\"shape\":[1]}}", 4,
              MOE_ERR_FORMAT, "tensor.beta", "data_offsets");
    expect_st("size-mismatch.st",
              "{\"tensor.gamma\":{\"dtype\":\"F32\",\"shape\":[3],\"data_offsets\":[0,8]}}", 16,
              MOE_ERR_FORMAT, "tensor.gamma", "12");
    expect_st("offset-oob.st",
              "{\"tensor.delta\":{\"dtype\":\"F32\",\"shape\":[4],\"data_offsets\":[8,24]}}", 16,
              MOE_ERR_FORMAT, "tensor.delta", "24");
    expect_st("begin-gt-end.st",
              "{\"tensor.eps\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[8,4]}}", 16,
              MOE_ERR_FORMAT, "tensor.eps", "begin 8");
    expect_st("offsets-three.st",
              "{\"tensor.eps\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[0,4,8]}}", 16,
              MOE_ERR_FORMAT, "tensor.eps", "data_offsets");
    expect_st("offset-negative.st",
              "{\"tensor.eps\":{\"dtype\":\"U8\",\"shape\":[4],\"data_offsets\":[-4,0]}}", 16,
              MOE_ERR_FORMAT, "tensor.eps", "-4");
    expect_st("overlap.st",
              "{\"tensor.one\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
              "\"tensor.two\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[4,12]}}",
              16, MOE_ERR_FORMAT, "tensor.one", "tensor.two");
    expect_st("overlap-contained.st",
              "{\"tensor.outer\":{\"dtype\":\"U8\",\"shape\":[16],\"data_offsets\":[0,16]},"
              "\"tensor.mid\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[10,12]},"
              "\"tensor.inner\":{\"dtype\":\"U8\",\"shape\":[2],\"data_offsets\":[4,6]}}",
              16, MOE_ERR_FORMAT, "tensor.outer", "tensor.inner");
    /* Zero-size tensors never overlap; touching ranges do not either. */
    expect_st("zero-size-ok.st",
              "{\"tensor.one\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
              "\"tensor.empty\":{\"dtype\":\"F32\",\"shape\":[0, 5],\"data_offsets\":[4,4]},"
              "\"tensor.two\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
              16, MOE_OK, NULL, NULL);
    expect_st("duplicate.st",
              "{\"tensor.same\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
              "\"tensor.same\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[8,16]}}",
              16, MOE_ERR_FORMAT, "tensor.same", "twice");
    expect_st("neg-shape.st",
              "{\"tensor.zeta\":{\"dtype\":\"U8\",\"shape\":[-2],\"data_offsets\":[0,0]}}", 0,
              MOE_ERR_FORMAT, "tensor.zeta", "-2");
    expect_st("frac-shape.st",
              "{\"tensor.zeta\":{\"dtype\":\"U8\",\"shape\":[2.5],\"data_offsets\":[0,2]}}", 4,
              MOE_ERR_FORMAT, "tensor.zeta", "2.5");
    expect_st("str-shape.st",
              "{\"tensor.zeta\":{\"dtype\":\"U8\",\"shape\":[\"2\"],\"data_offsets\":[0,2]}}", 4,
              MOE_ERR_FORMAT, "tensor.zeta", "\"2\"");
    expect_st("huge-shape.st",
              "{\"tensor.zeta\":{\"dtype\":\"U8\",\"shape\":[18014398509481984],"
              "\"data_offsets\":[0,2]}}", 4, MOE_ERR_FORMAT, "tensor.zeta", "18014398509481984");
    expect_st("inf-shape.st",
              "{\"tensor.zeta\":{\"dtype\":\"U8\",\"shape\":[1e999],\"data_offsets\":[0,2]}}", 4,
              MOE_ERR_FORMAT, "tensor.zeta", "shape");
    expect_st("overflow-shape.st",
              "{\"tensor.eta\":{\"dtype\":\"F64\",\"shape\":[4294967296,4294967296,4294967296],"
              "\"data_offsets\":[0,0]}}", 0, MOE_ERR_FORMAT, "tensor.eta", "overflow");
    expect_st("too-many-dims.st",
              "{\"tensor.theta\":{\"dtype\":\"U8\",\"shape\":[1,1,1,1,1,1,1,1,1],"
              "\"data_offsets\":[0,1]}}", 1, MOE_ERR_FORMAT, "tensor.theta", "9");
    expect_st("scalar-ok.st",
              "{\"tensor.scalar\":{\"dtype\":\"F32\",\"shape\":[],\"data_offsets\":[0,4]}}", 4,
              MOE_OK, NULL, NULL);
    expect_st("meta-not-object.st", "{\"__metadata__\": 3}", 0, MOE_ERR_FORMAT, "__metadata__",
              NULL);
    expect_st("meta-not-string.st", "{\"__metadata__\": {\"key.k\": 1}}", 0, MOE_ERR_FORMAT,
              "key.k", NULL);
    expect_st("meta-twice.st", "{\"__metadata__\": {}, \"__metadata__\": {}}", 0, MOE_ERR_FORMAT,
              "__metadata__", NULL);
    expect_st("empty-name.st", "{\"\":{\"dtype\":\"U8\",\"shape\":[0],\"data_offsets\":[0,0]}}",
              0, MOE_ERR_FORMAT, "empty name", NULL);
    expect_st("alias-e8m0.st",
              "{\"tensor.scale\":{\"dtype\":\"E8M0\",\"shape\":[2],\"data_offsets\":[0,2]}}", 2,
              MOE_OK, NULL, NULL);

    /* Names in messages: control bytes escaped, long names cut. */
    expect_st("ctrl-name.st",
              "{\"bad\\u0001name\":{\"dtype\":7,\"shape\":[2],\"data_offsets\":[0,2]}}",
              2, MOE_ERR_FORMAT, "bad\\x01name", "dtype");
    {
        size_t L = 5000;
        char *json = malloc(L + 200), *p = json;
        p += sprintf(p, "{\"");
        for (size_t i = 0; i < L; i++) *p++ = 'n';
        sprintf(p, "\":{\"dtype\":7,\"shape\":[2],\"data_offsets\":[0,2]}}");
        expect_st("long-name.st", json, 2, MOE_ERR_FORMAT, "nnn...\"", "dtype");
        free(json);
    }

    /* A NUL inside the header's padding is not a space. */
    static const char nul_pad[] = "\x08\0\0\0\0\0\0\0{}\0     ";
    st = moe_st_open_buffer(nul_pad, sizeof nul_pad - 1, "nul-pad", &f, &err);
    CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "nul-pad") && strstr(err.msg, "0x00"), "%s",
          err.msg);
    /* A tab is not space padding either; spaces are. */
    static const char tab_pad[] = "\x08\0\0\0\0\0\0\0{}\t     ";
    st = moe_st_open_buffer(tab_pad, sizeof tab_pad - 1, "tab-pad", &f, &err);
    CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "0x09"), "%s", err.msg);

    /* Buffer label in messages; a too-short buffer. */
    st = moe_st_open_buffer("1234", 4, "my-buffer", &f, &err);
    CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "my-buffer"), "%s", err.msg);
    st = moe_st_open_buffer(NULL, 0, NULL, &f, &err);
    CHECK(st == MOE_ERR_FORMAT, "%s", err.msg);
}

/* ------------------------------------------------------------ checkpoint */

static void make_dir(char *out, size_t cap, const char *name) {
    moe_t_tmp_path(out, cap, name);
    mkdir(out, 0755);
}

static void put_file(const char *dir, const char *name, const char *text) {
    char p[600];
    snprintf(p, sizeof p, "%s/%s", dir, name);
    write_bytes(p, text, strlen(text));
}

static void put_shard(const char *dir, const char *file, const char *const *names, size_t n,
                      const float *vals) {
    char p[600];
    snprintf(p, sizeof p, "%s/%s", dir, file);
    moe_st_entry e[8];
    memset(e, 0, sizeof e);
    for (size_t i = 0; i < n; i++) {
        e[i] = (moe_st_entry){.name = names[i], .dtype = MOE_DTYPE_F32, .ndim = 1,
                              .shape = {1}, .data = &vals[i]};
    }
    moe_error err = {{0}};
    CHECK_OK(moe_st_write(p, e, n, NULL, &err), err);
}

static float value_of(const moe_st_tensor *t) {
    float v;
    memcpy(&v, t->data, sizeof v);
    return v;
}

static void test_ckpt_fixture(void) {
    moe_ckpt *c = NULL;
    moe_error err = {{0}};
    const char *dir = moe_t_data("dsv4-tiny");
    char dircopy[4096];
    snprintf(dircopy, sizeof dircopy, "%s", dir);
    moe_status st = moe_ckpt_open(dircopy, &c, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    CHECK(strcmp(moe_ckpt_dir(c), dircopy) == 0, "dir %s", moe_ckpt_dir(c));
    const moe_st_tensor *t = NULL;
    st = moe_ckpt_find(c, "model.layers.3.ffn.gate.bias", &t, &err);
    CHECK_OK(st, err);
    CHECK(t && t->dtype == MOE_DTYPE_BF16 && t->shape[0] == 12, "bias");
    CHECK(moe_ckpt_has(c, "model.layers.0.ffn.gate.tid2eid"), "has tid2eid");
    CHECK(!moe_ckpt_has(c, "model.layers.9.nope"), "has nope");
    CHECK(!moe_ckpt_has_index(c) && moe_ckpt_n_shards(c) == 1 &&
              strcmp(moe_ckpt_shard_file(c, 0), "model.safetensors") == 0, "single shard");
    st = moe_ckpt_find(c, "model.layers.9.nope", &t, &err);
    CHECK(st == MOE_ERR_MISSING && strstr(err.msg, "model.layers.9.nope") &&
              strstr(err.msg, "dsv4-tiny"), "%s", err.msg);
    moe_ckpt_free(c);
    moe_ckpt_free(NULL);
}

static void test_ckpt_sharded(void) {
    char dir[512];
    make_dir(dir, sizeof dir, "sharded");
    put_file(dir, "config.json", "{\"model_type\": \"test\"}");
    const char *n1[] = {"w.a", "w.b"}, *n2[] = {"w.c"};
    const float v1[] = {1.0f, 2.0f}, v2[] = {3.0f};
    put_shard(dir, "model-00001-of-00002.safetensors", n1, 2, v1);
    put_shard(dir, "model-00002-of-00002.safetensors", n2, 1, v2);
    put_file(dir, "model.safetensors.index.json",
             "{\"metadata\": {\"total_size\": 12}, \"weight_map\": {"
             "\"w.a\": \"model-00001-of-00002.safetensors\","
             "\"w.c\": \"model-00002-of-00002.safetensors\","
             "\"w.b\": \"model-00001-of-00002.safetensors\","
             "\"w.gone\": \"model-00002-of-00002.safetensors\","
             "\"w.noshard\": \"model-00003-of-00002.safetensors\"}}");
    moe_ckpt *c = NULL;
    moe_error err = {{0}};
    moe_status st = moe_ckpt_open(dir, &c, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    const moe_st_tensor *t = NULL;
    const char *names[] = {"w.a", "w.b", "w.c"};
    const float want[] = {1, 2, 3};
    for (int i = 0; i < 3; i++) {
        st = moe_ckpt_find(c, names[i], &t, &err);
        CHECK_OK(st, err);
        CHECK(st != MOE_OK || value_of(t) == want[i], "%s value", names[i]);
    }
    /* Listed in the index but absent from its shard. */
    st = moe_ckpt_find(c, "w.gone", &t, &err);
    CHECK(st == MOE_ERR_MISSING && strstr(err.msg, "w.gone") &&
              strstr(err.msg, "model-00002-of-00002.safetensors"), "%s", err.msg);
    /* Listed, but its shard file does not exist: the shard is named. */
    CHECK(moe_ckpt_has(c, "w.noshard"), "has w.noshard (index names it)");
    st = moe_ckpt_find(c, "w.noshard", &t, &err);
    CHECK(st == MOE_ERR_IO && strstr(err.msg, "model-00003-of-00002.safetensors") &&
              strstr(err.msg, "w.noshard"), "%s", err.msg);
    /* Shard listing: index order of first mention; owned handles. */
    CHECK(moe_ckpt_has_index(c), "has_index");
    CHECK(moe_ckpt_n_shards(c) == 3, "n_shards %zu", moe_ckpt_n_shards(c));
    if (moe_ckpt_n_shards(c) == 3) {
        CHECK(strcmp(moe_ckpt_shard_file(c, 0), "model-00001-of-00002.safetensors") == 0 &&
                  strcmp(moe_ckpt_shard_file(c, 1), "model-00002-of-00002.safetensors") == 0 &&
                  strcmp(moe_ckpt_shard_file(c, 2), "model-00003-of-00002.safetensors") == 0,
              "shard order");
        moe_st_file *sf = NULL;
        st = moe_ckpt_shard(c, 0, &sf, &err);
        CHECK(st == MOE_OK && sf && moe_st_count(sf) == 2 && moe_st_find(sf, "w.b"), "%s",
              err.msg);
        st = moe_ckpt_shard(c, 2, &sf, &err);
        CHECK(st == MOE_ERR_IO && strstr(err.msg, "model-00003-of-00002.safetensors"), "%s",
              err.msg);
    }
    /* Not listed at all. */
    CHECK(!moe_ckpt_has(c, "w.z"), "has w.z");
    st = moe_ckpt_find(c, "w.z", &t, &err);
    CHECK(st == MOE_ERR_MISSING && strstr(err.msg, "w.z"), "%s", err.msg);
    moe_ckpt_free(c);
}

static void expect_ckpt_fail(const char *dirname, const char *index, moe_status want,
                             const char *needle) {
    char dir[512];
    make_dir(dir, sizeof dir, dirname);
    put_file(dir, "config.json", "{}");
    put_file(dir, "model.safetensors.index.json", index);
    moe_ckpt *c = NULL;
    moe_error err = {{0}};
    moe_status st = moe_ckpt_open(dir, &c, &err);
    CHECK(st == want && c == NULL, "%s: %s: %s", dirname, moe_status_str(st), err.msg);
    CHECK(strstr(err.msg, needle) != NULL, "%s: message lacks \"%s\": %s", dirname, needle,
          err.msg);
    moe_ckpt_free(c);
}

static void test_ckpt_bad_index(void) {
    expect_ckpt_fail("idx-dotdot", "{\"weight_map\": {\"w.x\": \"../x\"}}", MOE_ERR_FORMAT,
                     "../x");
    expect_ckpt_fail("idx-slash", "{\"weight_map\": {\"w.x\": \"sub/x.safetensors\"}}",
                     MOE_ERR_FORMAT, "sub/x.safetensors");
    expect_ckpt_fail("idx-abs", "{\"weight_map\": {\"w.x\": \"/etc/passwd\"}}", MOE_ERR_FORMAT,
                     "/etc/passwd");
    expect_ckpt_fail("idx-empty-name", "{\"weight_map\": {\"w.x\": \"\"}}", MOE_ERR_FORMAT,
                     "w.x");
    expect_ckpt_fail("idx-not-string", "{\"weight_map\": {\"w.x\": 5}}", MOE_ERR_FORMAT, "w.x");
    expect_ckpt_fail("idx-no-map", "{\"metadata\": {}}", MOE_ERR_FORMAT, "weight_map");
    expect_ckpt_fail("idx-bad-json", "{\"weight_map\": ", MOE_ERR_FORMAT,
                     "model.safetensors.index.json");
    expect_ckpt_fail("idx-dup",
                     "{\"weight_map\": {\"w.x\": \"a.safetensors\", \"w.x\": \"b.safetensors\"}}",
                     MOE_ERR_FORMAT, "w.x");
}

static void test_ckpt_fallback(void) {
    char dir[512];
    make_dir(dir, sizeof dir, "fallback");
    put_file(dir, "config.json", "{}");
    const char *nb[] = {"b.only", "both"}, *na[] = {"a.only", "both"}, *no[] = {"oracle.only"};
    const float vb[] = {2, 20}, va[] = {1, 10}, vo[] = {9};
    put_shard(dir, "zz-b.safetensors", nb, 2, vb);
    put_shard(dir, "aa-a.safetensors", na, 2, va);
    put_shard(dir, "oracle_io.safetensors", no, 1, vo);
    moe_ckpt *c = NULL;
    moe_error err = {{0}};
    moe_status st = moe_ckpt_open(dir, &c, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    const moe_st_tensor *t = NULL;
    st = moe_ckpt_find(c, "b.only", &t, &err);
    CHECK(st == MOE_OK && value_of(t) == 2, "b.only: %s", err.msg);
    st = moe_ckpt_find(c, "a.only", &t, &err);
    CHECK(st == MOE_OK && value_of(t) == 1, "a.only: %s", err.msg);
    st = moe_ckpt_find(c, "both", &t, &err); /* sorted by name: aa-a first */
    CHECK(st == MOE_OK && value_of(t) == 10, "both: %s", err.msg);
    CHECK(!moe_ckpt_has(c, "oracle.only"), "oracle_io shard used");
    CHECK(!moe_ckpt_has_index(c) && moe_ckpt_n_shards(c) == 2 &&
              strcmp(moe_ckpt_shard_file(c, 0), "aa-a.safetensors") == 0 &&
              strcmp(moe_ckpt_shard_file(c, 1), "zz-b.safetensors") == 0, "fallback shards");
    st = moe_ckpt_find(c, "oracle.only", &t, &err);
    CHECK(st == MOE_ERR_MISSING && strstr(err.msg, "oracle.only"), "%s", err.msg);
    moe_ckpt_free(c);

    /* Nothing to load; not a directory. */
    make_dir(dir, sizeof dir, "empty-ckpt");
    put_file(dir, "config.json", "{}");
    st = moe_ckpt_open(dir, &c, &err);
    CHECK(st == MOE_ERR_MISSING && strstr(err.msg, "empty-ckpt"), "%s", err.msg);
    st = moe_ckpt_open(moe_t_data("dsv4-tiny/config.json"), &c, &err);
    CHECK(st == MOE_ERR_IO && strstr(err.msg, "config.json"), "%s", err.msg);
    moe_t_tmp_path(dir, sizeof dir, "no-such-ckpt");
    st = moe_ckpt_open(dir, &c, &err);
    CHECK(st == MOE_ERR_IO && strstr(err.msg, "no-such-ckpt"), "%s", err.msg);

    /* A corrupt single-file checkpoint: opening is lazy, the lookup reports it. */
    make_dir(dir, sizeof dir, "corrupt-ckpt");
    static const char corrupt[] = "\x02\0\0\0\0\0\0\0{";
    char cp[600];
    snprintf(cp, sizeof cp, "%s/model.safetensors", dir);
    write_bytes(cp, corrupt, sizeof corrupt - 1);
    st = moe_ckpt_open(dir, &c, &err);
    CHECK_OK(st, err);
    if (st == MOE_OK) {
        st = moe_ckpt_find(c, "w.any", &t, &err);
        CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "model.safetensors") &&
                  strstr(err.msg, "w.any"), "%s", err.msg);
        CHECK(!moe_ckpt_has(c, "w.any"), "has on a corrupt shard");
        moe_ckpt_free(c);
    }
}

/* Seed corpus for fuzz/fuzz-safetensors.c: MOE_ST_WRITE_CORPUS=dir writes it. */
static void write_corpus(const char *dir) {
    moe_error err = {{0}};
    char p[600];
    uint64_t rs = 42;
    unsigned char bytes[512];
    for (size_t i = 0; i < sizeof bytes; i++) bytes[i] = (unsigned char)rng_next(&rs);
    moe_st_entry e[] = {
        {.name = "layers.0.ffn.gate.weight", .dtype = MOE_DTYPE_BF16, .ndim = 2, .shape = {4, 8},
         .data = bytes},
        {.name = "layers.0.ffn.gate.bias", .dtype = MOE_DTYPE_F32, .ndim = 1, .shape = {4},
         .data = bytes + 64},
        {.name = "layers.0.ffn.gate.tid2eid", .dtype = MOE_DTYPE_I64, .ndim = 2, .shape = {5, 2},
         .data = bytes + 80},
        {.name = "scalar", .dtype = MOE_DTYPE_F64, .ndim = 0, .data = bytes + 160},
        {.name = "empty", .dtype = MOE_DTYPE_U8, .ndim = 2, .shape = {0, 3}, .data = NULL},
        {.name = "w.fp8", .dtype = MOE_DTYPE_F8_E4M3, .ndim = 3, .shape = {2, 2, 4},
         .data = bytes + 200},
        {.name = "w.scale", .dtype = MOE_DTYPE_F8_E8M0, .ndim = 2, .shape = {1, 1},
         .data = bytes + 300},
    };
    const char *meta[] = {"format", "pt", NULL};
    snprintf(p, sizeof p, "%s/seed-mixed.safetensors", dir);
    CHECK_OK(moe_st_write(p, e, sizeof e / sizeof e[0], meta, &err), err);
    snprintf(p, sizeof p, "%s/seed-empty.safetensors", dir);
    CHECK_OK(moe_st_write(p, NULL, 0, NULL, &err), err);
    snprintf(p, sizeof p, "%s/seed-one.safetensors", dir);
    CHECK_OK(moe_st_write(p, e + 1, 1, NULL, &err), err);
    /* Every dtype, one element each. */
    moe_st_entry all[MOE_DTYPE_COUNT];
    char names[MOE_DTYPE_COUNT][16];
    for (int i = 0; i < MOE_DTYPE_COUNT; i++) {
        snprintf(names[i], sizeof names[i], "d.%s", moe_dtype_name((moe_dtype)i));
        all[i] = (moe_st_entry){.name = names[i], .dtype = (moe_dtype)i, .ndim = 1, .shape = {1},
                                .data = bytes + 8 * i};
    }
    snprintf(p, sizeof p, "%s/seed-dtypes.safetensors", dir);
    CHECK_OK(moe_st_write(p, all, MOE_DTYPE_COUNT, meta, &err), err);
}

static void test_corpus(void) {
    const char *dir = getenv("MOE_ST_WRITE_CORPUS");
    char tmp[512];
    if (!dir) {
        make_dir(tmp, sizeof tmp, "corpus");
        dir = tmp;
    }
    write_corpus(dir);
    /* Each seed reads back. */
    const char *seeds[] = {"seed-mixed", "seed-empty", "seed-one", "seed-dtypes"};
    for (size_t i = 0; i < 4; i++) {
        char p[600];
        snprintf(p, sizeof p, "%s/%s.safetensors", dir, seeds[i]);
        moe_st_file *f = NULL;
        moe_error err = {{0}};
        CHECK_OK(moe_st_open(p, &f, &err), err);
        moe_st_close(f);
    }
}

/* A shard holding one tensor of a dtype the reader does not know: only that
 * tensor fails, with a message naming it and its dtype; its neighbours (in
 * the same shard, before and after it in the data) read as written. */
static void test_unknown_dtype(void) {
    char dir[512];
    make_dir(dir, sizeof dir, "unknown-dtype");
    uint16_t a[4] = {0x3f80, 0x4000, 0x4040, 0x4080}; /* BF16 1, 2, 3, 4 */
    uint8_t mid[6] = {1, 2, 3, 4, 5, 6};
    float c[2] = {0.25f, -8.0f};
    moe_st_entry e[3] = {
        {.name = "layers.0.first.weight", .dtype = MOE_DTYPE_BF16, .ndim = 2, .shape = {2, 2}, .data = a},
        {.name = "layers.0.mid.weight", .dtype = MOE_DTYPE_U8, .ndim = 2, .shape = {2, 3}, .data = mid},
        {.name = "layers.0.last.bias", .dtype = MOE_DTYPE_F32, .ndim = 1, .shape = {2}, .data = c},
    };
    char path[600];
    snprintf(path, sizeof path, "%s/model.safetensors", dir);
    moe_error err = {{0}};
    CHECK_OK(moe_st_write(path, e, 3, NULL, &err), err);
    /* Retype the middle tensor as "F4" (a safetensors dtype moeaudit does not
     * read: sub-byte elements) in place: same length, so offsets hold. */
    size_t len = 0;
    unsigned char *raw = read_bytes(path, &len);
    if (!raw) { CHECK(0, "read back"); return; }
    char *hit = strstr((char *)raw + 8, "\"dtype\":\"U8\"");
    CHECK(hit != NULL, "header has the U8 dtype");
    if (hit) memcpy(hit, "\"dtype\":\"F4\"", 12);
    write_bytes(path, raw, len);
    free(raw);

    moe_st_file *f = NULL;
    moe_status st = moe_st_open(path, &f, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    CHECK(moe_st_count(f) == 2 && moe_st_count_unknown(f) == 1, "%zu known, %zu unknown", moe_st_count(f),
          moe_st_count_unknown(f));
    const moe_st_unknown *u = moe_st_unknown_at(f, 0);
    CHECK(!strcmp(u->name, "layers.0.mid.weight") && !strcmp(u->dtype, "F4") && u->ndim == 2 && u->shape[0] == 2 &&
              u->shape[1] == 3 && u->nbytes == 6, "unknown entry %s %s", u->name, u->dtype);
    CHECK(moe_st_find_unknown(f, "layers.0.mid.weight") == u && !moe_st_find_unknown(f, "layers.0.first.weight"),
          "find_unknown");
    CHECK(moe_st_find(f, "layers.0.mid.weight") == NULL, "unknown tensor is not a moe_st_tensor");
    const moe_st_tensor *t = moe_st_find(f, "layers.0.last.bias");
    CHECK(t && t->dtype == MOE_DTYPE_F32 && value_of(t) == 0.25f, "neighbour after it");
    moe_st_close(f);

    moe_ckpt *ck = NULL;
    st = moe_ckpt_open(dir, &ck, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    CHECK(moe_ckpt_has(ck, "layers.0.mid.weight"), "the name exists");
    st = moe_ckpt_find(ck, "layers.0.first.weight", &t, &err);
    CHECK(st == MOE_OK && t->dtype == MOE_DTYPE_BF16, "neighbour before it: %s", err.msg);
    st = moe_ckpt_find(ck, "layers.0.mid.weight", &t, &err);
    CHECK(st == MOE_ERR_DTYPE && strstr(err.msg, "layers.0.mid.weight") && strstr(err.msg, "\"F4\"") &&
              strstr(err.msg, "model.safetensors"), "%s", err.msg);
    st = moe_ckpt_find(ck, "layers.0.last.bias", &t, &err);
    CHECK(st == MOE_OK, "neighbour after it: %s", err.msg);
    moe_ckpt_free(ck);

    /* The same through an index (the shard named by weight_map). */
    char idx[600];
    snprintf(idx, sizeof idx, "%s/model.safetensors", dir);
    char moved[700];
    snprintf(moved, sizeof moved, "%s/model-00001-of-00001.safetensors", dir);
    CHECK(rename(idx, moved) == 0, "rename");
    put_file(dir, "model.safetensors.index.json",
             "{\"metadata\": {}, \"weight_map\": {\"layers.0.first.weight\": \"model-00001-of-00001.safetensors\","
             " \"layers.0.mid.weight\": \"model-00001-of-00001.safetensors\","
             " \"layers.0.last.bias\": \"model-00001-of-00001.safetensors\"}}");
    st = moe_ckpt_open(dir, &ck, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    st = moe_ckpt_find(ck, "layers.0.mid.weight", &t, &err);
    CHECK(st == MOE_ERR_DTYPE && strstr(err.msg, "\"F4\"") && strstr(err.msg, "model-00001-of-00001"), "%s",
          err.msg);
    st = moe_ckpt_find(ck, "layers.0.last.bias", &t, &err);
    CHECK(st == MOE_OK, "indexed neighbour: %s", err.msg);
    moe_ckpt_free(ck);
}

int main(void) {
    RUN(test_fixture);
    RUN(test_unknown_dtype);
    RUN(test_roundtrip);
    RUN(test_write_errors);
    RUN(test_truncated);
    RUN(test_malformed);
    RUN(test_ckpt_fixture);
    RUN(test_ckpt_sharded);
    RUN(test_ckpt_bad_index);
    RUN(test_ckpt_fallback);
    RUN(test_corpus);
    return moe_t_finish();
}
