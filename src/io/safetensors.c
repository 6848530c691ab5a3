/*
 * safetensors reader (mmap) and atomic writer.
 *
 * Layout: u64 little-endian N | N bytes of JSON header | data section.
 * The header maps tensor names to {"dtype", "shape", "data_offsets": [b, e]}
 * with offsets relative to the data section; "__metadata__" maps strings to
 * strings. The JSON may be padded with trailing spaces.
 *
 * Invariants of an open moe_st_file (hold after moe_st_open* returns MOE_OK):
 *  1. Every tensor's [data, data + nbytes) lies inside the mapping, and
 *     nbytes == product(shape) * dtype size, computed without overflow.
 *  2. No two tensors of non-zero size share a byte.
 *  3. Names are unique and non-empty; byname[] is sorted by strcmp.
 *  4. Tensor data has no alignment guarantee: read it with memcpy.
 *  5. A tensor whose dtype string is not a moe_dtype is kept aside (unknown[])
 *     with its shape and byte range: it is not a moe_st_tensor, but its name
 *     counts for uniqueness and its bytes for the overlap check, so one such
 *     tensor fails only its own lookups (moe_st_find_unknown says why).
 * This file assumes a little-endian host (data bytes are used as stored).
 */
#include "core/core.h"
#include "io/files.h"
#include "io/io_quote.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Largest integer a JSON double carries exactly. */
#define MOE_ST_MAX_INT 9007199254740992.0 /* 2^53 */

struct moe_st_file {
    char *path;              /* file path or buffer label, for messages */
    const unsigned char *base;
    size_t len;
    bool mapped;             /* base is our mmap (else caller's buffer) */
    size_t n;
    moe_st_tensor *tensors;  /* [n], header order */
    size_t *byname;          /* [n] indices into tensors, sorted by name */
    char *names;             /* arena holding every tensor name (unknown ones too) */
    size_t n_unknown;
    moe_st_unknown *unknown; /* [n_unknown], header order; dtype strings in dtypes */
    size_t *unk_byname;      /* [n_unknown] indices into unknown, sorted by name */
    char *dtypes;            /* arena of the unknown dtype strings */
    size_t n_meta;
    char **meta;             /* [2 * n_meta]: key, value, key, value, ... */
};

static char *st_strdup(const char *s) {
    size_t l = strlen(s) + 1;
    char *d = malloc(l);
    if (d) memcpy(d, s, l);
    return d;
}

static uint64_t st_le64(const unsigned char *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--) v = (v << 8) | p[i];
    return v;
}

static void st_put_le64(unsigned char *p, uint64_t v) {
    for (int i = 0; i < 8; i++) p[i] = (unsigned char)(v >> (8 * i));
}

void moe_st_close(moe_st_file *f) {
    if (!f) return;
    if (f->mapped && f->base) munmap((void *)f->base, f->len);
    if (f->meta) {
        for (size_t i = 0; i < 2 * f->n_meta; i++) free(f->meta[i]);
        free(f->meta);
    }
    free(f->tensors);
    free(f->byname);
    free(f->names);
    free(f->unknown);
    free(f->unk_byname);
    free(f->dtypes);
    free(f->path);
    free(f);
}

/* ------------------------------------------------------------ validation */

/* A JSON number that is an integer in [0, 2^53]. */
static bool st_json_uint(const cJSON *v, uint64_t *out) {
    if (!cJSON_IsNumber(v)) return false;
    double d = v->valuedouble;
    if (!(d >= 0.0) || d > MOE_ST_MAX_INT || d != floor(d)) return false;
    *out = (uint64_t)d;
    return true;
}

/* The JSON value as short text for messages (numbers, strings, else a type). */
static void st_json_text(const cJSON *v, char *buf, size_t cap) {
    if (cJSON_IsNumber(v)) snprintf(buf, cap, "%.17g", v->valuedouble);
    else if (cJSON_IsString(v)) snprintf(buf, cap, "\"%.60s\"", v->valuestring);
    else if (cJSON_IsArray(v)) snprintf(buf, cap, "an array of %d", cJSON_GetArraySize(v));
    else if (cJSON_IsObject(v)) snprintf(buf, cap, "an object");
    else if (cJSON_IsBool(v)) snprintf(buf, cap, cJSON_IsTrue(v) ? "true" : "false");
    else if (cJSON_IsNull(v)) snprintf(buf, cap, "null");
    else snprintf(buf, cap, "an invalid value");
}

static const cJSON *st_child(const cJSON *obj, const char *key) {
    /* Exact-case lookup; a key present twice is reported by the caller. */
    return cJSON_GetObjectItemCaseSensitive(obj, key);
}

typedef struct st_range {
    uint64_t begin, end;
    const char *name;
} st_range;

static int st_range_cmp(const void *a, const void *b) {
    const st_range *x = a, *y = b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    if (x->end != y->end) return x->end < y->end ? -1 : 1;
    return 0;
}

/* qsort has no context argument: sort pointers to names instead of indices. */
typedef struct st_name_ref {
    const char *name;
    size_t idx;
} st_name_ref;

static int st_name_cmp(const void *a, const void *b) {
    const st_name_ref *x = a, *y = b;
    int c = strcmp(x->name, y->name);
    if (c) return c;
    return x->idx < y->idx ? -1 : x->idx > y->idx;
}

/* Sort refs[n] by name; the first name present twice, or NULL. */
static const char *st_sort_find_dup(st_name_ref *refs, size_t n) {
    qsort(refs, n, sizeof *refs, st_name_cmp);
    for (size_t k = 1; k < n; k++)
        if (strcmp(refs[k - 1].name, refs[k].name) == 0) return refs[k].name;
    return NULL;
}

/* Parse one tensor entry `e` named `name` into *t (name not set here). A
 * dtype string that is no moe_dtype sets *unknown (t->dtype is then
 * meaningless and t->nbytes is the byte range's length, not checked against
 * the shape); everything else is validated as for known dtypes. */
static moe_status st_parse_entry(const char *label, const cJSON *e, const char *raw_name,
                                 uint64_t data_len, moe_st_tensor *t, uint64_t *begin,
                                 uint64_t *end, bool *unknown, moe_error *err) {
    char vb[96], name[160];
    moe_io_quote(raw_name, name, sizeof name);
    if (!cJSON_IsObject(e)) {
        st_json_text(e, vb, sizeof vb);
        return moe_errf(err, MOE_ERR_FORMAT, "%s: tensor \"%s\": entry is %s, not an object",
                        label, name, vb);
    }
    const cJSON *dt = st_child(e, "dtype"), *sh = st_child(e, "shape"),
                *off = st_child(e, "data_offsets");
    if (!dt || !sh || !off)
        return moe_errf(err, MOE_ERR_FORMAT, "%s: tensor \"%s\": missing \"%s\"", label, name,
                        !dt ? "dtype" : !sh ? "shape" : "data_offsets");
    if (!cJSON_IsString(dt)) {
        st_json_text(dt, vb, sizeof vb);
        return moe_errf(err, MOE_ERR_FORMAT, "%s: tensor \"%s\": dtype is %s, not a string",
                        label, name, vb);
    }
    *unknown = !moe_dtype_from_name(dt->valuestring, &t->dtype);
    if (*unknown) {
        if (dt->valuestring[0] == '\0' || strlen(dt->valuestring) > MOE_ST_MAX_DTYPE_NAME)
            return moe_errf(err, MOE_ERR_FORMAT, "%s: tensor \"%s\": dtype \"%.60s\" is not a dtype name (1 to %d characters)",
                            label, name, dt->valuestring, MOE_ST_MAX_DTYPE_NAME);
        t->dtype = MOE_DTYPE_U8; /* placeholder: only the shape is parsed below */
    }

    if (!cJSON_IsArray(sh)) {
        st_json_text(sh, vb, sizeof vb);
        return moe_errf(err, MOE_ERR_FORMAT, "%s: tensor \"%s\": shape is %s, not an array",
                        label, name, vb);
    }
    int nd = cJSON_GetArraySize(sh);
    if (nd > MOE_MAX_DIMS)
        return moe_errf(err, MOE_ERR_FORMAT, "%s: tensor \"%s\": %d dimensions (at most %d)",
                        label, name, nd, MOE_MAX_DIMS);
    t->ndim = nd;
    uint64_t elems = 1;
    int d = 0;
    for (const cJSON *s = sh->child; s; s = s->next, d++) {
        uint64_t v;
        if (!st_json_uint(s, &v)) {
            st_json_text(s, vb, sizeof vb);
            return moe_errf(err, MOE_ERR_FORMAT,
                            "%s: tensor \"%s\": shape[%d] = %s is not a non-negative integer "
                            "<= 2^53", label, name, d, vb);
        }
        t->shape[d] = (int64_t)v;
        if (!moe_mul_ok(elems, v, &elems))
            return moe_errf(err, MOE_ERR_FORMAT,
                            "%s: tensor \"%s\": element count overflows at shape[%d] = %llu",
                            label, name, d, (unsigned long long)v);
    }
    if (*unknown) elems = 0; /* the element size is unknown: no byte count to derive */
    if (!moe_mul_ok(elems, moe_dtype_size(t->dtype), &t->nbytes))
        return moe_errf(err, MOE_ERR_FORMAT, "%s: tensor \"%s\": byte size overflows (%llu x %s)",
                        label, name, (unsigned long long)elems, moe_dtype_name(t->dtype));

    if (!cJSON_IsArray(off) || cJSON_GetArraySize(off) != 2) {
        st_json_text(off, vb, sizeof vb);
        return moe_errf(err, MOE_ERR_FORMAT,
                        "%s: tensor \"%s\": data_offsets is %s, not [begin, end]", label, name,
                        vb);
    }
    const cJSON *ob = off->child, *oe = off->child->next;
    if (!st_json_uint(ob, begin) || !st_json_uint(oe, end)) {
        st_json_text(!st_json_uint(ob, begin) ? ob : oe, vb, sizeof vb);
        return moe_errf(err, MOE_ERR_FORMAT,
                        "%s: tensor \"%s\": data offset %s is not a non-negative integer <= 2^53",
                        label, name, vb);
    }
    if (*begin > *end)
        return moe_errf(err, MOE_ERR_FORMAT,
                        "%s: tensor \"%s\": data_offsets begin %llu > end %llu", label, name,
                        (unsigned long long)*begin, (unsigned long long)*end);
    if (*end > data_len)
        return moe_errf(err, MOE_ERR_FORMAT,
                        "%s: tensor \"%s\": data_offsets end %llu is past the data section "
                        "(%llu bytes; file truncated?)", label, name, (unsigned long long)*end,
                        (unsigned long long)data_len);
    if (*unknown) {
        t->nbytes = *end - *begin;
        return MOE_OK;
    }
    if (*end - *begin != t->nbytes)
        return moe_errf(err, MOE_ERR_FORMAT,
                        "%s: tensor \"%s\": shape x %s needs %llu bytes but data_offsets "
                        "[%llu, %llu] hold %llu", label, name, moe_dtype_name(t->dtype),
                        (unsigned long long)t->nbytes, (unsigned long long)*begin,
                        (unsigned long long)*end, (unsigned long long)(*end - *begin));
    return MOE_OK;
}

static moe_status st_parse_metadata(moe_st_file *f, const cJSON *m, moe_error *err) {
    char vb[96], qk[160];
    if (!cJSON_IsObject(m)) {
        st_json_text(m, vb, sizeof vb);
        return moe_errf(err, MOE_ERR_FORMAT, "%s: __metadata__ is %s, not an object", f->path,
                        vb);
    }
    size_t n = 0;
    for (const cJSON *kv = m->child; kv; kv = kv->next, n++) {
        if (!cJSON_IsString(kv)) {
            st_json_text(kv, vb, sizeof vb);
            return moe_errf(err, MOE_ERR_FORMAT,
                            "%s: __metadata__ key \"%s\" is %s, not a string", f->path,
                            moe_io_quote(kv->string, qk, sizeof qk), vb);
        }
    }
    st_name_ref *refs = moe_calloc(n, sizeof *refs);
    if (!refs) return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory for metadata", f->path);
    size_t i = 0;
    for (const cJSON *kv = m->child; kv; kv = kv->next, i++) refs[i] = (st_name_ref){kv->string, i};
    const char *dup = st_sort_find_dup(refs, n);
    moe_status st = MOE_OK;
    if (dup)
        st = moe_errf(err, MOE_ERR_FORMAT, "%s: __metadata__ key \"%s\" appears twice", f->path,
                      moe_io_quote(dup, qk, sizeof qk));
    free(refs);
    if (st != MOE_OK) return st;
    f->meta = moe_calloc(2 * n, sizeof *f->meta);
    if (!f->meta) return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory for metadata", f->path);
    f->n_meta = n;
    i = 0;
    for (const cJSON *kv = m->child; kv; kv = kv->next, i++) {
        f->meta[2 * i] = st_strdup(kv->string);
        f->meta[2 * i + 1] = st_strdup(kv->valuestring);
        if (!f->meta[2 * i] || !f->meta[2 * i + 1])
            return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory for metadata", f->path);
    }
    return MOE_OK;
}

/* Parse and validate the header of f->base[0, f->len). */
static moe_status st_parse(moe_st_file *f, moe_error *err) {
    const char *label = f->path;
    if (f->len < 8)
        return moe_errf(err, MOE_ERR_FORMAT,
                        "%s: %zu bytes is too short for a safetensors file (header length "
                        "needs 8)", label, f->len);
    uint64_t hlen = st_le64(f->base);
    if (hlen > MOE_ST_MAX_HEADER)
        return moe_errf(err, MOE_ERR_FORMAT,
                        "%s: header length %llu exceeds the limit of %u bytes", label,
                        (unsigned long long)hlen, MOE_ST_MAX_HEADER);
    if (hlen > (uint64_t)f->len - 8)
        return moe_errf(err, MOE_ERR_FORMAT,
                        "%s: header length %llu is past the end of the file (%zu bytes; "
                        "truncated?)", label, (unsigned long long)hlen, f->len);
    uint64_t data_len = (uint64_t)f->len - 8 - hlen;
    const unsigned char *data = f->base + 8 + hlen;

    /* cJSON needs a terminated string; the mapping has none. */
    char *text = malloc((size_t)hlen + 1);
    if (!text) return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory for the header", label);
    memcpy(text, f->base + 8, (size_t)hlen);
    text[hlen] = '\0';
    const char *end = NULL;
    cJSON *root = cJSON_ParseWithLengthOpts(text, (size_t)hlen, &end, 0);
    moe_status st = MOE_OK;
    st_range *ranges = NULL;
    st_name_ref *refs = NULL;
    if (!root) {
        size_t at = end && end >= text ? (size_t)(end - text) : 0;
        st = moe_errf(err, MOE_ERR_FORMAT, "%s: header is not valid JSON (near byte %zu of %llu)",
                      label, at, (unsigned long long)hlen);
        goto done;
    }
    for (const char *p = end; p < text + hlen; p++) {
        if (*p != ' ') {
            st = moe_errf(err, MOE_ERR_FORMAT,
                          "%s: header has byte 0x%02x after the JSON at offset %zu (only space "
                          "padding is allowed)", label, (unsigned)(unsigned char)*p,
                          (size_t)(p - text));
            goto done;
        }
    }
    if (!cJSON_IsObject(root)) {
        char vb[96];
        st_json_text(root, vb, sizeof vb);
        st = moe_errf(err, MOE_ERR_FORMAT, "%s: header is %s, not a JSON object", label, vb);
        goto done;
    }

    /* Count tensors and size the name and dtype arenas; find __metadata__. */
    size_t n = 0, name_bytes = 0, dtype_bytes = 0;
    const cJSON *meta = NULL;
    for (const cJSON *e = root->child; e; e = e->next) {
        if (strcmp(e->string, "__metadata__") == 0) {
            if (meta) {
                st = moe_errf(err, MOE_ERR_FORMAT, "%s: \"__metadata__\" appears twice", label);
                goto done;
            }
            meta = e;
            continue;
        }
        if (e->string[0] == '\0') {
            st = moe_errf(err, MOE_ERR_FORMAT, "%s: a tensor has an empty name", label);
            goto done;
        }
        n++;
        name_bytes += strlen(e->string) + 1;
        const cJSON *dt = cJSON_IsObject(e) ? st_child(e, "dtype") : NULL;
        if (cJSON_IsString(dt)) dtype_bytes += strnlen(dt->valuestring, MOE_ST_MAX_DTYPE_NAME + 1) + 1;
    }
    if (meta && (st = st_parse_metadata(f, meta, err)) != MOE_OK) goto done;

    f->tensors = moe_calloc(n, sizeof *f->tensors);
    f->byname = moe_calloc(n, sizeof *f->byname);
    f->unknown = moe_calloc(n, sizeof *f->unknown);
    f->names = moe_malloc(name_bytes, 1);
    f->dtypes = moe_malloc(dtype_bytes + 1, 1);
    ranges = moe_calloc(n, sizeof *ranges);
    refs = moe_calloc(n, sizeof *refs);
    if (!f->tensors || !f->byname || !f->unknown || !f->names || !f->dtypes || !ranges || !refs) {
        st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory for %zu tensors", label, n);
        goto done;
    }
    size_t i = 0, nu = 0, at = 0, dat = 0, nr = 0;
    for (const cJSON *e = root->child; e; e = e->next) {
        if (e == meta) continue;
        moe_st_tensor t;
        memset(&t, 0, sizeof t);
        uint64_t b = 0, en = 0;
        bool unknown = false;
        st = st_parse_entry(label, e, e->string, data_len, &t, &b, &en, &unknown, err);
        if (st != MOE_OK) goto done;
        size_t l = strlen(e->string) + 1;
        memcpy(f->names + at, e->string, l);
        const char *nm = f->names + at;
        at += l;
        if (unknown) {
            moe_st_unknown *u = &f->unknown[nu++];
            const char *ds = st_child(e, "dtype")->valuestring;
            size_t dl = strlen(ds) + 1;
            memcpy(f->dtypes + dat, ds, dl);
            u->name = nm;
            u->dtype = f->dtypes + dat;
            dat += dl;
            u->ndim = t.ndim;
            memcpy(u->shape, t.shape, sizeof u->shape);
            u->nbytes = t.nbytes;
        } else {
            t.name = nm;
            t.data = data + b;
            f->tensors[i++] = t;
        }
        if (en > b) ranges[nr++] = (st_range){b, en, nm};
        refs[i + nu - 1] = (st_name_ref){nm, i + nu - 1};
    }
    f->n = i;
    f->n_unknown = nu;

    /* Duplicate names (known and unknown dtypes alike): cJSON keeps every
     * copy of a repeated key. */
    const char *dup = st_sort_find_dup(refs, n);
    if (dup) {
        char qn[160];
        st = moe_errf(err, MOE_ERR_FORMAT, "%s: tensor \"%s\" appears twice in the header",
                      label, moe_io_quote(dup, qn, sizeof qn));
        goto done;
    }
    /* Lookup orders: refs is sorted by name; names are unique. */
    for (size_t k = 0; k < i; k++) refs[k] = (st_name_ref){f->tensors[k].name, k};
    qsort(refs, i, sizeof *refs, st_name_cmp);
    for (size_t k = 0; k < i; k++) f->byname[k] = refs[k].idx;
    if (nu) {
        f->unk_byname = moe_calloc(nu, sizeof *f->unk_byname);
        if (!f->unk_byname) {
            st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory for %zu tensors", label, n);
            goto done;
        }
        for (size_t k = 0; k < nu; k++) refs[k] = (st_name_ref){f->unknown[k].name, k};
        qsort(refs, nu, sizeof *refs, st_name_cmp);
        for (size_t k = 0; k < nu; k++) f->unk_byname[k] = refs[k].idx;
    }

    /* Overlap: sorted by begin, each range must start at or after the previous end. */
    qsort(ranges, nr, sizeof *ranges, st_range_cmp);
    for (size_t k = 1; k < nr; k++) {
        if (ranges[k].begin < ranges[k - 1].end) {
            const st_range *ra = &ranges[k - 1], *rb = &ranges[k];
            char qa[120], qb[120];
            st = moe_errf(err, MOE_ERR_FORMAT,
                          "%s: tensors \"%s\" [%llu, %llu] and \"%s\" [%llu, %llu] overlap",
                          label, moe_io_quote(ra->name, qa, sizeof qa),
                          (unsigned long long)ra->begin, (unsigned long long)ra->end,
                          moe_io_quote(rb->name, qb, sizeof qb),
                          (unsigned long long)rb->begin, (unsigned long long)rb->end);
            goto done;
        }
    }
done:
    free(refs);
    free(ranges);
    cJSON_Delete(root);
    free(text);
    return st;
}

/* ------------------------------------------------------------------ open */

static moe_st_file *st_new(const char *label) {
    moe_st_file *f = calloc(1, sizeof *f);
    if (!f) return NULL;
    f->path = st_strdup(label);
    if (!f->path) { free(f); return NULL; }
    return f;
}

moe_status moe_st_open_buffer(const void *buf, size_t len, const char *label,
                              moe_st_file **out, moe_error *err) {
    MOE_ASSERT(out);
    MOE_ASSERT(buf || len == 0);
    if (!label) label = "<buffer>";
    moe_st_file *f = st_new(label);
    if (!f) return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", label);
    f->base = buf;
    f->len = len;
    moe_status st = st_parse(f, err);
    if (st != MOE_OK) { moe_st_close(f); return st; }
    *out = f;
    return MOE_OK;
}

moe_status moe_st_open(const char *path, moe_st_file **out, moe_error *err) {
    MOE_ASSERT(path && out);
    int fd = -1;
    uint64_t size = 0;
    moe_status st0 = moe_io_open_regular(path, NULL, &fd, &size, err); /* never blocks on a FIFO */
    if (st0 != MOE_OK) return st0;
    if (size < 8) {
        close(fd);
        return moe_errf(err, MOE_ERR_FORMAT,
                        "%s: %llu bytes is too short for a safetensors file (header length "
                        "needs 8)", path, (unsigned long long)size);
    }
    if (size > SIZE_MAX) {
        close(fd);
        return moe_errf(err, MOE_ERR_IO, "%s: %llu bytes do not fit in memory", path,
                        (unsigned long long)size);
    }
    size_t len = (size_t)size;
    void *map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    int e = errno;
    close(fd);
    if (map == MAP_FAILED)
        return moe_errf(err, MOE_ERR_IO, "%s: cannot mmap %zu bytes: %s", path, len, strerror(e));
    moe_st_file *f = st_new(path);
    if (!f) {
        munmap(map, len);
        return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", path);
    }
    f->base = map;
    f->len = len;
    f->mapped = true;
    moe_status st = st_parse(f, err);
    if (st != MOE_OK) { moe_st_close(f); return st; }
    *out = f;
    return MOE_OK;
}

/* --------------------------------------------------------------- queries */

size_t moe_st_count(const moe_st_file *f) {
    MOE_ASSERT(f);
    return f->n;
}

const moe_st_tensor *moe_st_at(const moe_st_file *f, size_t i) {
    MOE_ASSERT(f && i < f->n);
    return &f->tensors[i];
}

const moe_st_tensor *moe_st_find(const moe_st_file *f, const char *name) {
    MOE_ASSERT(f && name);
    size_t lo = 0, hi = f->n;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const moe_st_tensor *t = &f->tensors[f->byname[mid]];
        int c = strcmp(name, t->name);
        if (c == 0) return t;
        if (c < 0) hi = mid;
        else lo = mid + 1;
    }
    return NULL;
}

size_t moe_st_count_unknown(const moe_st_file *f) {
    MOE_ASSERT(f);
    return f->n_unknown;
}

const moe_st_unknown *moe_st_unknown_at(const moe_st_file *f, size_t i) {
    MOE_ASSERT(f && i < f->n_unknown);
    return &f->unknown[i];
}

const moe_st_unknown *moe_st_find_unknown(const moe_st_file *f, const char *name) {
    MOE_ASSERT(f && name);
    size_t lo = 0, hi = f->n_unknown;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        const moe_st_unknown *u = &f->unknown[f->unk_byname[mid]];
        int c = strcmp(name, u->name);
        if (c == 0) return u;
        if (c < 0) hi = mid;
        else lo = mid + 1;
    }
    return NULL;
}

const char *moe_st_path(const moe_st_file *f) {
    MOE_ASSERT(f);
    return f->path;
}

const char *moe_st_metadata(const moe_st_file *f, const char *key) {
    MOE_ASSERT(f && key);
    for (size_t i = 0; i < f->n_meta; i++)
        if (strcmp(f->meta[2 * i], key) == 0) return f->meta[2 * i + 1];
    return NULL;
}

/* Check t against ndim / shape (free dims: < 0, filled in); element count. */
static moe_status st_check_shape(const moe_st_file *f, const moe_st_tensor *t, int ndim, int64_t *shape,
                                 size_t *count, moe_error *err) {
    bool ok = t->ndim == ndim;
    for (int d = 0; ok && d < ndim; d++) ok = shape[d] < 0 || t->shape[d] == shape[d];
    if (!ok) {
        char got[200] = "", want[200] = "";
        for (int d = 0; d < t->ndim; d++)
            snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", d ? ", " : "", (long long)t->shape[d]);
        for (int d = 0; d < ndim; d++) {
            if (shape[d] < 0) snprintf(want + strlen(want), sizeof want - strlen(want), "%s*", d ? ", " : "");
            else snprintf(want + strlen(want), sizeof want - strlen(want), "%s%lld", d ? ", " : "", (long long)shape[d]);
        }
        char q[160];
        return moe_errf(err, MOE_ERR_SHAPE, "%s: tensor \"%s\" has shape [%s]; expected [%s]", f->path,
                        moe_io_quote(t->name, q, sizeof q), got, want);
    }
    /* the element count is at most the byte size (validated at open) */
    *count = (size_t)(t->nbytes / moe_dtype_size(t->dtype));
    return MOE_OK;
}

static moe_status st_find_typed(const moe_st_file *f, const char *name, bool want_float, const moe_st_tensor **out,
                                moe_error *err) {
    MOE_ASSERT(f && name && out);
    char q[160];
    const moe_st_tensor *t = moe_st_find(f, name);
    if (!t) return moe_errf(err, MOE_ERR_MISSING, "%s: no tensor \"%s\"", f->path, moe_io_quote(name, q, sizeof q));
    if (want_float ? !moe_dtype_is_float(t->dtype) : !moe_dtype_is_int(t->dtype))
        return moe_errf(err, MOE_ERR_DTYPE, "%s: tensor \"%s\" has dtype %s; expected %s", f->path,
                        moe_io_quote(name, q, sizeof q), moe_dtype_name(t->dtype),
                        want_float ? "F64, F32, F16 or BF16" : "an integer type");
    *out = t;
    return MOE_OK;
}

moe_status moe_st_read_f64(const moe_st_file *f, const char *name, int ndim, int64_t *shape, double **out,
                           moe_error *err) {
    MOE_ASSERT(out && (shape || ndim == 0) && ndim >= 0 && ndim <= MOE_MAX_DIMS);
    const moe_st_tensor *t = NULL;
    size_t n = 0;
    moe_status st = st_find_typed(f, name, true, &t, err);
    int64_t sh[MOE_MAX_DIMS];
    if (ndim) memcpy(sh, shape, (size_t)ndim * sizeof *sh);
    if (st == MOE_OK) st = st_check_shape(f, t, ndim, sh, &n, err);
    if (st != MOE_OK) return st;
    double *v = moe_malloc(n, sizeof *v);
    if (!v) return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory for tensor \"%s\" (%zu values)", f->path, name, n);
    for (size_t i = 0; i < n; i++) v[i] = moe_load_f64(t->data, t->dtype, i);
    for (int d = 0; d < ndim; d++) shape[d] = t->shape[d];
    *out = v;
    return MOE_OK;
}

moe_status moe_st_read_i64(const moe_st_file *f, const char *name, int ndim, int64_t *shape, int64_t **out,
                           moe_error *err) {
    MOE_ASSERT(out && (shape || ndim == 0) && ndim >= 0 && ndim <= MOE_MAX_DIMS);
    const moe_st_tensor *t = NULL;
    size_t n = 0;
    moe_status st = st_find_typed(f, name, false, &t, err);
    int64_t sh[MOE_MAX_DIMS];
    if (ndim) memcpy(sh, shape, (size_t)ndim * sizeof *sh);
    if (st == MOE_OK) st = st_check_shape(f, t, ndim, sh, &n, err);
    if (st != MOE_OK) return st;
    int64_t *v = moe_malloc(n, sizeof *v);
    if (!v) return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory for tensor \"%s\" (%zu values)", f->path, name, n);
    for (size_t i = 0; i < n; i++) v[i] = moe_load_i64(t->data, t->dtype, i);
    for (int d = 0; d < ndim; d++) shape[d] = t->shape[d];
    *out = v;
    return MOE_OK;
}

/* ---------------------------------------------------------------- writer */

static moe_status st_check_entries(const char *path, const moe_st_entry *entries, size_t n,
                                   const char *const *metadata, uint64_t *data_len, bool need_data,
                                   moe_error *err) {
    uint64_t total = 0;
    for (size_t i = 0; i < n; i++) {
        const moe_st_entry *e = &entries[i];
        if (!e->name || !e->name[0])
            return moe_errf(err, MOE_ERR_ARG, "%s: entry %zu has no name", path, i);
        if (strcmp(e->name, "__metadata__") == 0)
            return moe_errf(err, MOE_ERR_ARG, "%s: entry %zu is named \"__metadata__\"", path, i);
        if ((unsigned)e->dtype >= MOE_DTYPE_COUNT)
            return moe_errf(err, MOE_ERR_ARG, "%s: tensor \"%s\": invalid dtype %d", path,
                            e->name, (int)e->dtype);
        if (e->ndim < 0 || e->ndim > MOE_MAX_DIMS)
            return moe_errf(err, MOE_ERR_ARG, "%s: tensor \"%s\": ndim %d outside [0, %d]", path,
                            e->name, e->ndim, MOE_MAX_DIMS);
        uint64_t elems = 1, nb = 0;
        for (int d = 0; d < e->ndim; d++) {
            if (e->shape[d] < 0 || (double)e->shape[d] > MOE_ST_MAX_INT)
                return moe_errf(err, MOE_ERR_ARG, "%s: tensor \"%s\": shape[%d] = %lld", path,
                                e->name, d, (long long)e->shape[d]);
            if (!moe_mul_ok(elems, (uint64_t)e->shape[d], &elems))
                return moe_errf(err, MOE_ERR_ARG, "%s: tensor \"%s\": element count overflows",
                                path, e->name);
        }
        if (!moe_mul_ok(elems, moe_dtype_size(e->dtype), &nb) || total + nb < total ||
            (double)(total + nb) > MOE_ST_MAX_INT)
            return moe_errf(err, MOE_ERR_ARG, "%s: tensor \"%s\": byte size overflows", path,
                            e->name);
        if (need_data && nb > 0 && !e->data)
            return moe_errf(err, MOE_ERR_ARG, "%s: tensor \"%s\": data is NULL", path, e->name);
        total += nb;
    }
    size_t nm = 0;
    for (size_t i = 0; metadata && metadata[i]; i += 2, nm++)
        if (!metadata[i + 1])
            return moe_errf(err, MOE_ERR_ARG, "%s: metadata key \"%s\" has no value", path,
                            metadata[i]);
    st_name_ref *refs = moe_calloc(n > nm ? n : nm, sizeof *refs);
    if (!refs) return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", path);
    for (size_t i = 0; i < n; i++) refs[i] = (st_name_ref){entries[i].name, i};
    const char *dup = st_sort_find_dup(refs, n);
    moe_status st = MOE_OK;
    if (dup) {
        st = moe_errf(err, MOE_ERR_ARG, "%s: tensor \"%s\" given twice", path, dup);
    } else {
        for (size_t i = 0; i < nm; i++) refs[i] = (st_name_ref){metadata[2 * i], i};
        dup = st_sort_find_dup(refs, nm);
        if (dup) st = moe_errf(err, MOE_ERR_ARG, "%s: metadata key \"%s\" given twice", path, dup);
    }
    free(refs);
    if (st != MOE_OK) return st;
    *data_len = total;
    return MOE_OK;
}

/* Build the header JSON (unpadded); NULL when out of memory. */
static char *st_build_header(const moe_st_entry *entries, size_t n,
                             const char *const *metadata) {
    cJSON *root = cJSON_CreateObject();
    if (!root) return NULL;
    char num[32];
    bool ok = true;
    if (metadata) {
        cJSON *m = cJSON_AddObjectToObject(root, "__metadata__");
        ok = m != NULL;
        for (size_t i = 0; ok && metadata[i]; i += 2)
            ok = cJSON_AddStringToObject(m, metadata[i], metadata[i + 1]) != NULL;
    }
    uint64_t at = 0;
    for (size_t i = 0; ok && i < n; i++) {
        const moe_st_entry *e = &entries[i];
        cJSON *o = cJSON_AddObjectToObject(root, e->name);
        cJSON *sh = o ? cJSON_CreateArray() : NULL;
        cJSON *off = sh ? cJSON_CreateArray() : NULL;
        ok = o && sh && off;
        /* Integers as raw text: cJSON's %g printing would write 1e+15. */
        uint64_t elems = 1;
        ok = ok && cJSON_AddStringToObject(o, "dtype", moe_dtype_name(e->dtype)) != NULL;
        for (int d = 0; ok && d < e->ndim; d++) {
            snprintf(num, sizeof num, "%lld", (long long)e->shape[d]);
            cJSON *v = cJSON_CreateRaw(num);
            ok = v && cJSON_AddItemToArray(sh, v);
            elems *= (uint64_t)e->shape[d];
        }
        uint64_t nb = elems * moe_dtype_size(e->dtype);
        snprintf(num, sizeof num, "%llu", (unsigned long long)at);
        cJSON *vb = ok ? cJSON_CreateRaw(num) : NULL;
        ok = vb && cJSON_AddItemToArray(off, vb);
        snprintf(num, sizeof num, "%llu", (unsigned long long)(at + nb));
        cJSON *ve = ok ? cJSON_CreateRaw(num) : NULL;
        ok = ve && cJSON_AddItemToArray(off, ve);
        at += nb;
        /* Attach last so that a failure above frees what was made. */
        if (ok) {
            ok = cJSON_AddItemToObject(o, "shape", sh);
            if (ok) sh = NULL;
            ok = ok && cJSON_AddItemToObject(o, "data_offsets", off);
            if (ok) off = NULL;
        }
        cJSON_Delete(sh);
        cJSON_Delete(off);
    }
    char *s = ok ? cJSON_PrintUnformatted(root) : NULL;
    cJSON_Delete(root);
    return s;
}

/* The header of a file of entries [n]: 8-byte length + JSON padded with
 * spaces to a multiple of 8. *head (caller frees) [*head_len]; *data_len the
 * bytes of data that follow. */
static moe_status st_make_header(const char *path, const moe_st_entry *entries, size_t n,
                                 const char *const *metadata, bool need_data, unsigned char **head,
                                 size_t *head_len, uint64_t *data_len, moe_error *err) {
    moe_status st = st_check_entries(path, entries, n, metadata, data_len, need_data, err);
    if (st != MOE_OK) return st;
    char *json = st_build_header(entries, n, metadata);
    if (!json) return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory building the header", path);
    size_t jl = strlen(json);
    size_t hlen = (jl + 7) / 8 * 8; /* 8 + hlen keeps the data section 8-aligned */
    if (hlen > MOE_ST_MAX_HEADER) {
        cJSON_free(json);
        return moe_errf(err, MOE_ERR_ARG, "%s: header of %zu bytes exceeds the limit of %u",
                        path, hlen, MOE_ST_MAX_HEADER);
    }
    unsigned char *h = malloc(8 + hlen);
    if (!h) {
        cJSON_free(json);
        return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory for the header", path);
    }
    st_put_le64(h, hlen);
    memcpy(h + 8, json, jl);
    memset(h + 8 + jl, ' ', hlen - jl);
    cJSON_free(json);
    *head = h;
    *head_len = 8 + hlen;
    return MOE_OK;
}

/* Bytes of entry e (checked by st_check_entries). */
static uint64_t st_entry_bytes(const moe_st_entry *e) {
    uint64_t elems = 1;
    for (int d = 0; d < e->ndim; d++) elems *= (uint64_t)e->shape[d];
    return elems * moe_dtype_size(e->dtype);
}

moe_status moe_st_write(const char *path, const moe_st_entry *entries, size_t n,
                        const char *const *metadata, moe_error *err) {
    MOE_ASSERT(path && (entries || n == 0));
    uint64_t data_len = 0;
    unsigned char *head = NULL;
    size_t head_len = 0;
    moe_status st = st_make_header(path, entries, n, metadata, true, &head, &head_len, &data_len, err);
    if (st != MOE_OK) return st;
    moe_out_file *out = NULL;
    st = moe_out_open(path, &out, err);
    if (st == MOE_OK) st = moe_out_write(out, head, head_len, err);
    for (size_t i = 0; st == MOE_OK && i < n; i++)
        st = moe_out_write(out, entries[i].data, (size_t)st_entry_bytes(&entries[i]), err);
    if (st == MOE_OK) st = moe_out_commit(out, err);
    else moe_out_abort(out);
    free(head);
    return st;
}

/* ------------------------------------------------------- streamed writer */

struct moe_st_stream {
    moe_out_file *out;        /* the atomic writer: exclusive temporary file, rename at finish */
    uint64_t data0;           /* file offset of the data section */
    size_t n;
    uint64_t *begin, *size;   /* [n] each tensor's offset in the data section and byte size */
    uint64_t *written;        /* [n] bytes put so far */
    char **names;             /* [n] */
};

void moe_st_stream_abort(moe_st_stream *s) {
    if (!s) return;
    moe_out_abort(s->out);
    for (size_t i = 0; s->names && i < s->n; i++) free(s->names[i]);
    free(s->names);
    free(s->begin);
    free(s->size);
    free(s->written);
    free(s);
}

moe_status moe_st_stream_open(const char *path, const moe_st_entry *entries, size_t n,
                              const char *const *metadata, moe_st_stream **out, moe_error *err) {
    MOE_ASSERT(path && out && (entries || n == 0));
    *out = NULL;
    uint64_t data_len = 0;
    unsigned char *head = NULL;
    size_t head_len = 0;
    moe_status st = st_make_header(path, entries, n, metadata, false, &head, &head_len, &data_len, err);
    if (st != MOE_OK) return st;
    moe_st_stream *s = calloc(1, sizeof *s);
    if (s) {
        s->n = n;
        s->begin = moe_calloc(n, sizeof *s->begin);
        s->size = moe_calloc(n, sizeof *s->size);
        s->written = moe_calloc(n, sizeof *s->written);
        s->names = moe_calloc(n, sizeof *s->names);
    }
    bool ok = s && s->begin && s->size && s->written && s->names;
    uint64_t at = 0;
    for (size_t i = 0; ok && i < n; i++) {
        s->begin[i] = at;
        s->size[i] = st_entry_bytes(&entries[i]);
        at += s->size[i];
        ok = (s->names[i] = st_strdup(entries[i].name)) != NULL;
    }
    if (!ok) {
        free(head);
        moe_st_stream_abort(s);
        return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", path);
    }
    s->data0 = head_len;
    st = moe_out_open(path, &s->out, err);
    if (st == MOE_OK) st = moe_out_write(s->out, head, head_len, err);
    free(head);
    if (st != MOE_OK) {
        moe_st_stream_abort(s);
        return st;
    }
    *out = s;
    return MOE_OK;
}

moe_status moe_st_stream_put(moe_st_stream *s, size_t i, uint64_t offset, const void *data, size_t nbytes,
                             moe_error *err) {
    MOE_ASSERT(s && (data || nbytes == 0));
    if (i >= s->n || offset > s->size[i] || nbytes > s->size[i] - offset)
        return moe_errf(err, MOE_ERR_ARG, "%s: bytes [%llu, %llu) of tensor %zu (%s) are outside its %llu bytes",
                        moe_out_path(s->out), (unsigned long long)offset, (unsigned long long)(offset + nbytes), i,
                        i < s->n ? s->names[i] : "?", i < s->n ? (unsigned long long)s->size[i] : 0ull);
    moe_status st = moe_out_pwrite(s->out, data, nbytes, s->data0 + s->begin[i] + offset, err);
    if (st == MOE_OK) s->written[i] += nbytes;
    return st;
}

moe_status moe_st_stream_finish(moe_st_stream *s, moe_error *err) {
    MOE_ASSERT(s);
    for (size_t i = 0; i < s->n; i++)
        if (s->written[i] != s->size[i]) {
            moe_status st = moe_errf(err, MOE_ERR_ARG, "%s: tensor %s received %llu of its %llu bytes: the file is "
                                     "not written", moe_out_path(s->out), s->names[i],
                                     (unsigned long long)s->written[i], (unsigned long long)s->size[i]);
            moe_st_stream_abort(s);
            return st;
        }
    moe_status st = moe_out_commit(s->out, err);
    s->out = NULL;
    moe_st_stream_abort(s); /* frees the rest: out is already freed */
    return st;
}
