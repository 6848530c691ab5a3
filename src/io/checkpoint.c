/*
 * Checkpoint directory: one or more safetensors shards found through, in
 * order of preference,
 *   1. model.safetensors (one shard);
 *   2. model.safetensors.index.json: {"weight_map": {tensor: shard-file}};
 *   3. every *.safetensors in the directory except oracle_io*.safetensors
 *      and hidden files, sorted by name (the first shard holding a name wins).
 * Of config.json only the quantization keys are read here (with
 * hf_quant_config.json: io/quant_decl.h); moe_model_open reads the rest.
 *
 * Invariants:
 *  1. Shard file names are plain names inside the directory: no "/", no "..".
 *  2. A shard is mapped at most once, on the first lookup that needs it, and
 *     stays mapped until moe_ckpt_free. A shard whose bytes the reader
 *     refused (any status but MOE_ERR_IO and MOE_ERR_NOMEM; in memory, any
 *     but MOE_ERR_NOMEM: a missing in-memory file stays missing) is refused
 *     again by every later lookup with the same status and message, without
 *     being read again (the bytes cannot parse differently; a corrupt
 *     shard's header was parsed once per probed tensor before); an I/O or
 *     memory failure is retried next time.
 *  3. With an index, index[] is sorted by tensor name and names are unique.
 */
#include "core/core.h"
#include "io/ckpt.h"
#include "io/files.h"
#include "io/io_quote.h"

#include <cjson/cJSON.h>
#include <dirent.h>
#include <errno.h>
#include <string.h>
#include <sys/stat.h>

typedef struct ckpt_shard {
    char *file;        /* name inside the directory */
    char *path;        /* dir/file */
    moe_st_file *st;   /* NULL until first needed */
    moe_status bad;    /* MOE_OK, or the reader's lasting refusal (invariant 2) */
    char *bad_msg;     /* its message (owned), when bad != MOE_OK */
} ckpt_shard;

typedef struct ckpt_entry {
    char *name;        /* tensor name (owned) */
    size_t shard;
} ckpt_entry;

struct moe_ckpt {
    char *dir;         /* the directory, or the label of an in-memory checkpoint */
    const moe_mem_file *mem; /* [n_mem] in-memory files (moe_ckpt_open_mem), else NULL */
    size_t n_mem;
    size_t n_shards;
    ckpt_shard *shards;
    bool indexed;      /* index[] names the shard of every tensor */
    size_t n_index;
    ckpt_entry *index; /* [n_index] sorted by name */
    moe_qdecl decl;    /* declared quantization */
    void **kept;       /* [n_kept] buffers derived from tensors (io/ckpt.h) */
    size_t n_kept, cap_kept;
};

static char *ck_strdup(const char *s) {
    size_t l = strlen(s) + 1;
    char *d = malloc(l);
    if (d) memcpy(d, s, l);
    return d;
}

/* Present in any form: a FIFO or directory named model.safetensors is still
 * the file the user meant, and its reader then says what is wrong with it
 * (io/files.h) instead of the scan silently looking elsewhere. */
static bool ck_present(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0;
}

void moe_ckpt_free(moe_ckpt *c) {
    if (!c) return;
    for (size_t i = 0; i < c->n_shards; i++) {
        moe_st_close(c->shards[i].st);
        free(c->shards[i].bad_msg);
        free(c->shards[i].file);
        free(c->shards[i].path);
    }
    free(c->shards);
    for (size_t i = 0; i < c->n_index; i++) free(c->index[i].name);
    free(c->index);
    moe_qdecl_free(&c->decl);
    for (size_t i = 0; i < c->n_kept; i++) free(c->kept[i]);
    free(c->kept);
    free(c->dir);
    free(c);
}

const moe_qdecl *moe_ckpt_decl(const moe_ckpt *c) {
    MOE_ASSERT(c);
    return &c->decl;
}

void *moe_ckpt_keep(moe_ckpt *c, size_t bytes) {
    MOE_ASSERT(c);
    if (c->n_kept == c->cap_kept) {
        size_t nc = c->cap_kept ? 2 * c->cap_kept : 16;
        void **nk = realloc(c->kept, nc * sizeof *nk);
        if (!nk) return NULL;
        c->kept = nk;
        c->cap_kept = nc;
    }
    void *b = calloc(bytes ? bytes : 1, 1);
    if (b) c->kept[c->n_kept++] = b;
    return b;
}

/* Append a shard named `file`; returns its index or SIZE_MAX when out of memory. */
static size_t ck_add_shard(moe_ckpt *c, const char *file, size_t *cap) {
    if (c->n_shards == *cap) {
        size_t nc = *cap ? 2 * *cap : 8;
        ckpt_shard *ns = realloc(c->shards, nc * sizeof *ns);
        if (!ns) return SIZE_MAX;
        c->shards = ns;
        *cap = nc;
    }
    ckpt_shard *s = &c->shards[c->n_shards];
    s->file = ck_strdup(file);
    s->path = moe_path_join(c->dir, file);
    s->st = NULL;
    s->bad = MOE_OK;
    s->bad_msg = NULL;
    if (!s->file || !s->path) {
        free(s->file);
        free(s->path);
        return SIZE_MAX;
    }
    return c->n_shards++;
}

static int ck_entry_cmp(const void *a, const void *b) {
    return strcmp(((const ckpt_entry *)a)->name, ((const ckpt_entry *)b)->name);
}

static int ck_str_cmp(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

static bool ck_has_suffix(const char *s, const char *suf) {
    size_t l = strlen(s), k = strlen(suf);
    return l >= k && strcmp(s + l - k, suf) == 0;
}

/* A shard name from an index: a plain file name in the checkpoint directory. */
static bool ck_shard_name_ok(const char *s) {
    return s[0] != '\0' && strchr(s, '/') == NULL && strstr(s, "..") == NULL &&
           strcmp(s, ".") != 0;
}

typedef struct ck_ref {
    const char *file;  /* shard named by entry `entry` of weight_map */
    size_t entry;
} ck_ref;

static int ck_ref_cmp(const void *a, const void *b) {
    const ck_ref *x = a, *y = b;
    int c = strcmp(x->file, y->file);
    if (c) return c;
    return x->entry < y->entry ? -1 : x->entry > y->entry;
}

typedef struct ck_group {
    const char *file;
    size_t first;      /* weight_map entry of its first mention */
    size_t shard;
} ck_group;

static int ck_group_cmp(const void *a, const void *b) {
    const ck_group *x = a, *y = b;
    return x->first < y->first ? -1 : x->first > y->first;
}

/* The index's text: weight_map {tensor: shard file}. Shards are numbered in
 * order of first mention; everything is sorted, never scanned per entry,
 * so a hostile index of 10^6 names costs n log n. */
static moe_status ck_parse_index(moe_ckpt *c, const char *ipath, const char *text, size_t len, moe_error *err) {
    cJSON *root = cJSON_ParseWithLength(text, len);
    if (!root) return moe_errf(err, MOE_ERR_FORMAT, "%s: not valid JSON", ipath);
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    size_t cap = 0, n = 0;
    moe_status st = MOE_OK;
    ck_ref *refs = NULL;
    ck_group *groups = NULL;
    size_t *group_of = NULL;
    if (!cJSON_IsObject(root) || !cJSON_IsObject(wm)) {
        st = moe_errf(err, MOE_ERR_FORMAT, "%s: no \"weight_map\" object", ipath);
        goto done;
    }
    for (const cJSON *e = wm->child; e; e = e->next) n++;
    c->index = moe_calloc(n, sizeof *c->index);
    refs = moe_calloc(n, sizeof *refs);
    groups = moe_calloc(n, sizeof *groups);
    group_of = moe_calloc(n, sizeof *group_of);
    if (!c->index || !refs || !groups || !group_of) {
        st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory for %zu names", ipath, n);
        goto done;
    }
    char qn[160], qs[160];
    size_t i = 0;
    for (const cJSON *e = wm->child; e; e = e->next, i++) {
        if (!cJSON_IsString(e)) {
            st = moe_errf(err, MOE_ERR_FORMAT, "%s: tensor \"%s\": shard is not a string", ipath,
                          moe_io_quote(e->string, qn, sizeof qn));
            goto done;
        }
        if (!ck_shard_name_ok(e->valuestring)) {
            st = moe_errf(err, MOE_ERR_FORMAT,
                          "%s: tensor \"%s\": shard \"%s\" is not a plain file name in the "
                          "checkpoint directory", ipath, moe_io_quote(e->string, qn, sizeof qn),
                          moe_io_quote(e->valuestring, qs, sizeof qs));
            goto done;
        }
        refs[i] = (ck_ref){e->valuestring, i};
    }
    qsort(refs, n, sizeof *refs, ck_ref_cmp);
    size_t ng = 0;
    for (size_t k = 0; k < n; k++) {
        if (k == 0 || strcmp(refs[k - 1].file, refs[k].file) != 0) groups[ng++] = (ck_group){refs[k].file, refs[k].entry, 0};
        group_of[refs[k].entry] = ng - 1;
    }
    /* groups in order of first mention: the shard order */
    size_t *rank = moe_calloc(ng, sizeof *rank);
    if (!rank) { st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", ipath); goto done; }
    for (size_t g = 0; g < ng; g++) groups[g].shard = g; /* remember the group id */
    qsort(groups, ng, sizeof *groups, ck_group_cmp);
    for (size_t g = 0; g < ng && st == MOE_OK; g++) {
        size_t s = ck_add_shard(c, groups[g].file, &cap);
        if (s == SIZE_MAX) st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", ipath);
        else rank[groups[g].shard] = s;
    }
    i = 0;
    for (const cJSON *e = wm->child; e && st == MOE_OK; e = e->next, i++) {
        ckpt_entry *ent = &c->index[c->n_index];
        ent->name = ck_strdup(e->string);
        if (!ent->name) {
            st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", ipath);
            break;
        }
        ent->shard = rank[group_of[i]];
        c->n_index++;
    }
    free(rank);
    if (st != MOE_OK) goto done;
    qsort(c->index, c->n_index, sizeof *c->index, ck_entry_cmp);
    for (size_t k = 1; k < c->n_index; k++)
        if (strcmp(c->index[k - 1].name, c->index[k].name) == 0) {
            st = moe_errf(err, MOE_ERR_FORMAT, "%s: tensor \"%s\" appears twice in weight_map",
                          ipath, moe_io_quote(c->index[k].name, qn, sizeof qn));
            goto done;
        }
    c->indexed = true;
done:
    free(refs);
    free(groups);
    free(group_of);
    cJSON_Delete(root);
    return st;
}

static moe_status ck_load_index(moe_ckpt *c, const char *ipath, moe_error *err) {
    char *text = NULL;
    size_t len = 0;
    moe_status st = moe_io_read_file(ipath, NULL, MOE_ST_MAX_HEADER, &text, &len, err);
    if (st != MOE_OK) return st;
    st = ck_parse_index(c, ipath, text, len, err);
    free(text);
    return st;
}

static moe_status ck_scan_dir(moe_ckpt *c, moe_error *err) {
    DIR *d = opendir(c->dir);
    if (!d) return moe_errf(err, MOE_ERR_IO, "%s: cannot list: %s", c->dir, strerror(errno));
    size_t n = 0, cap = 0;
    char **names = NULL;
    moe_status st = MOE_OK;
    struct dirent *de;
    while ((de = readdir(d)) != NULL) {
        const char *nm = de->d_name;
        if (nm[0] == '.' || !ck_has_suffix(nm, ".safetensors") ||
            strncmp(nm, "oracle_io", 9) == 0)
            continue;
        if (n == cap) {
            size_t nc = cap ? 2 * cap : 8;
            char **nn = realloc(names, nc * sizeof *nn);
            if (!nn) { st = MOE_ERR_NOMEM; break; }
            names = nn;
            cap = nc;
        }
        if (!(names[n] = ck_strdup(nm))) { st = MOE_ERR_NOMEM; break; }
        n++;
    }
    closedir(d);
    if (st == MOE_OK && n == 0)
        st = moe_errf(err, MOE_ERR_MISSING,
                      "%s: no model.safetensors, model.safetensors.index.json or other "
                      "*.safetensors file", c->dir);
    else if (st == MOE_ERR_NOMEM)
        moe_errf(err, st, "%s: out of memory listing the directory", c->dir);
    if (st == MOE_OK) {
        qsort(names, n, sizeof *names, ck_str_cmp);
        size_t scap = 0;
        for (size_t i = 0; i < n && st == MOE_OK; i++)
            if (ck_add_shard(c, names[i], &scap) == SIZE_MAX)
                st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", c->dir);
    }
    for (size_t i = 0; i < n; i++) free(names[i]);
    free(names);
    return st;
}

moe_status moe_ckpt_open(const char *dir, moe_ckpt **out, moe_error *err) {
    MOE_ASSERT(dir && out);
    struct stat sb;
    if (stat(dir, &sb) != 0)
        return moe_errf(err, MOE_ERR_IO, "%s: cannot open checkpoint directory: %s", dir,
                        strerror(errno));
    if (!S_ISDIR(sb.st_mode))
        return moe_errf(err, MOE_ERR_IO, "%s: not a directory", dir);
    moe_ckpt *c = calloc(1, sizeof *c);
    if (!c || !(c->dir = ck_strdup(dir))) {
        free(c);
        return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", dir);
    }
    char *single = moe_path_join(dir, "model.safetensors");
    char *ipath = moe_path_join(dir, "model.safetensors.index.json");
    moe_status st = MOE_OK;
    size_t cap = 0;
    if (!single || !ipath) {
        st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", dir);
    } else if (ck_present(single)) {
        if (ck_add_shard(c, "model.safetensors", &cap) == SIZE_MAX)
            st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", dir);
    } else if (ck_present(ipath)) {
        st = ck_load_index(c, ipath, err);
    } else {
        st = ck_scan_dir(c, err);
    }
    free(single);
    free(ipath);
    if (st == MOE_OK) st = moe_qdecl_read(dir, &c->decl, err);
    if (st != MOE_OK) {
        moe_ckpt_free(c);
        return st;
    }
    *out = c;
    return MOE_OK;
}

static const moe_mem_file *ck_mem_find(const moe_ckpt *c, const char *name) {
    for (size_t i = 0; i < c->n_mem; i++)
        if (c->mem[i].name && strcmp(c->mem[i].name, name) == 0) return &c->mem[i];
    return NULL;
}

/* Map shard s if not yet mapped. */
static moe_status ck_map(moe_ckpt *c, size_t s, const char *tensor, moe_error *err) {
    ckpt_shard *sh = &c->shards[s];
    if (sh->st) return MOE_OK;
    moe_status st;
    moe_error own = {{0}}; /* the reader's message even when the caller passes no err: kept for the next lookup */
    if (sh->bad != MOE_OK) {
        st = sh->bad;
        if (err) snprintf(err->msg, sizeof err->msg, "%s", sh->bad_msg);
    } else {
        if (c->mem) {
            const moe_mem_file *mf = ck_mem_find(c, sh->file);
            st = mf ? moe_st_open_buffer(mf->data, mf->len, sh->path, &sh->st, &own)
                    : moe_errf(&own, MOE_ERR_IO, "%s: cannot open: no such file", sh->path);
        } else {
            st = moe_st_open(sh->path, &sh->st, &own);
        }
        /* in memory, a missing file stays missing: that refusal lasts too */
        if (st != MOE_OK && st != MOE_ERR_NOMEM && (st != MOE_ERR_IO || c->mem)) {
            sh->bad_msg = ck_strdup(own.msg);
            if (sh->bad_msg) sh->bad = st; /* else: read again next time, as after an I/O failure */
        }
        if (st != MOE_OK && err) memcpy(err->msg, own.msg, sizeof err->msg);
    }
    if (st != MOE_OK && err && tensor) {
        /* Keep the reader's message (it names the file) and add the tensor. */
        char msg[sizeof err->msg], qs[160];
        memcpy(msg, err->msg, sizeof msg);
        moe_errf(err, st, "%s (shard \"%s\", needed for tensor \"%s\")", msg,
                 moe_io_quote(sh->file, qs, sizeof qs), tensor);
    }
    return st;
}

static const ckpt_entry *ck_index_find(const moe_ckpt *c, const char *name) {
    size_t lo = 0, hi = c->n_index;
    while (lo < hi) {
        size_t mid = lo + (hi - lo) / 2;
        int r = strcmp(name, c->index[mid].name);
        if (r == 0) return &c->index[mid];
        if (r < 0) hi = mid;
        else lo = mid + 1;
    }
    return NULL;
}

/* A lookup of a tensor whose dtype the reader does not know. */
static moe_status ck_unknown_dtype(const moe_ckpt *c, size_t s, const char *name, moe_error *err) {
    const moe_st_unknown *u = moe_st_find_unknown(c->shards[s].st, name);
    char qs[160], qd[80];
    return moe_errf(err, MOE_ERR_DTYPE,
                    "%s: tensor \"%s\" in shard \"%s\" has dtype \"%s\", which moeaudit cannot read (known: "
                    "BOOL, U8..U64, I8..I64, F16, BF16, F32, F64, F8_E4M3, F8_E5M2, F8_E8M0); the shard's other "
                    "tensors are readable", c->dir, name, moe_io_quote(c->shards[s].file, qs, sizeof qs),
                    moe_io_quote(u->dtype, qd, sizeof qd));
}

moe_status moe_ckpt_find(moe_ckpt *c, const char *name, const moe_st_tensor **t,
                         moe_error *err) {
    MOE_ASSERT(c && name && t);
    if (c->indexed) {
        const ckpt_entry *e = ck_index_find(c, name);
        if (!e)
            return moe_errf(err, MOE_ERR_MISSING,
                            "%s: tensor \"%s\" is not in model.safetensors.index.json", c->dir,
                            name);
        moe_status st = ck_map(c, e->shard, name, err);
        if (st != MOE_OK) return st;
        const moe_st_tensor *x = moe_st_find(c->shards[e->shard].st, name);
        if (!x && moe_st_find_unknown(c->shards[e->shard].st, name))
            return ck_unknown_dtype(c, e->shard, name, err);
        if (!x) {
            char qs[160];
            return moe_errf(err, MOE_ERR_MISSING,
                            "%s: tensor \"%s\" is listed in the index under shard \"%s\" but "
                            "that shard does not hold it", c->dir, name,
                            moe_io_quote(c->shards[e->shard].file, qs, sizeof qs));
        }
        *t = x;
        return MOE_OK;
    }
    for (size_t s = 0; s < c->n_shards; s++) {
        moe_status st = ck_map(c, s, name, err);
        if (st != MOE_OK) return st;
        const moe_st_tensor *x = moe_st_find(c->shards[s].st, name);
        if (x) {
            *t = x;
            return MOE_OK;
        }
        if (moe_st_find_unknown(c->shards[s].st, name)) return ck_unknown_dtype(c, s, name, err);
    }
    return moe_errf(err, MOE_ERR_MISSING, "%s: no tensor \"%s\" in %s%s", c->dir, name,
                    c->shards[0].file, c->n_shards > 1 ? " or the other shards" : "");
}

bool moe_ckpt_has(moe_ckpt *c, const char *name) {
    MOE_ASSERT(c && name);
    if (c->indexed) return ck_index_find(c, name) != NULL;
    for (size_t s = 0; s < c->n_shards; s++) {
        if (ck_map(c, s, NULL, NULL) != MOE_OK) continue;
        if (moe_st_find(c->shards[s].st, name) || moe_st_find_unknown(c->shards[s].st, name)) return true;
    }
    return false;
}

moe_status moe_ckpt_lookup(moe_ckpt *c, const char *name, const moe_st_tensor **t, moe_error *err) {
    MOE_ASSERT(c && name && t);
    if (c->indexed && !ck_index_find(c, name)) {
        *t = NULL;
        return MOE_OK;
    }
    if (c->indexed) return moe_ckpt_find(c, name, t, err);
    /* No index: every shard might hold it, so every shard must be readable
     * before "absent" can be said (else a probe would turn a corrupt shard
     * into a missing tensor: a bias silently dropped, a layout not found). */
    for (size_t s = 0; s < c->n_shards; s++) {
        moe_status st = ck_map(c, s, name, err);
        if (st != MOE_OK) return st;
        const moe_st_tensor *x = moe_st_find(c->shards[s].st, name);
        if (x) {
            *t = x;
            return MOE_OK;
        }
        /* present but of a dtype the reader does not know: that tensor's error */
        if (moe_st_find_unknown(c->shards[s].st, name)) return ck_unknown_dtype(c, s, name, err);
    }
    *t = NULL;
    return MOE_OK;
}

const char *moe_ckpt_dir(const moe_ckpt *c) {
    MOE_ASSERT(c);
    return c->dir;
}

size_t moe_ckpt_n_shards(const moe_ckpt *c) {
    MOE_ASSERT(c);
    return c->n_shards;
}

const char *moe_ckpt_shard_file(const moe_ckpt *c, size_t i) {
    MOE_ASSERT(c && i < c->n_shards);
    return c->shards[i].file;
}

moe_status moe_ckpt_shard(moe_ckpt *c, size_t i, moe_st_file **f, moe_error *err) {
    MOE_ASSERT(c && f && i < c->n_shards);
    moe_status st = ck_map(c, i, NULL, err);
    if (st == MOE_OK) *f = c->shards[i].st;
    return st;
}

bool moe_ckpt_shard_mapped(const moe_ckpt *c, size_t i) {
    MOE_ASSERT(c && i < c->n_shards);
    return c->shards[i].st != NULL;
}

bool moe_ckpt_has_index(const moe_ckpt *c) {
    MOE_ASSERT(c);
    return c->indexed;
}

moe_status moe_ckpt_open_mem(const char *label, const moe_mem_file *files, size_t n, moe_ckpt **out,
                             moe_error *err) {
    MOE_ASSERT(out && (files || n == 0));
    if (!label) label = "<memory>";
    moe_ckpt *c = calloc(1, sizeof *c);
    if (!c || !(c->dir = ck_strdup(label))) {
        free(c);
        return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", label);
    }
    c->mem = files;
    c->n_mem = n;
    moe_status st = MOE_OK;
    size_t cap = 0;
    const moe_mem_file *index = ck_mem_find(c, "model.safetensors.index.json");
    if (ck_mem_find(c, "model.safetensors")) {
        if (ck_add_shard(c, "model.safetensors", &cap) == SIZE_MAX)
            st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", label);
    } else if (index) {
        char *ipath = moe_path_join(label, "model.safetensors.index.json");
        st = ipath ? ck_parse_index(c, ipath, index->data, index->len, err)
                   : moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", label);
        free(ipath);
    } else {
        /* the directory scan's rule over the names given, sorted */
        const char **names = moe_calloc(n, sizeof *names);
        size_t k = 0;
        if (!names) st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", label);
        for (size_t i = 0; names && i < n; i++) {
            const char *nm = files[i].name;
            if (!nm || nm[0] == '.' || !ck_has_suffix(nm, ".safetensors") || strncmp(nm, "oracle_io", 9) == 0 ||
                !ck_shard_name_ok(nm))
                continue;
            names[k++] = nm;
        }
        if (st == MOE_OK && k == 0)
            st = moe_errf(err, MOE_ERR_MISSING, "%s: no model.safetensors, model.safetensors.index.json or other "
                          "*.safetensors file", label);
        if (st == MOE_OK) qsort(names, k, sizeof *names, ck_str_cmp);
        for (size_t i = 0; st == MOE_OK && i < k; i++)
            if (i == 0 || strcmp(names[i - 1], names[i]) != 0)
                if (ck_add_shard(c, names[i], &cap) == SIZE_MAX)
                    st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", label);
        free(names);
    }
    if (st == MOE_OK) { /* the declared quantization, as moe_ckpt_open reads it */
        const moe_mem_file *cf = ck_mem_find(c, "config.json"), *hf = ck_mem_find(c, "hf_quant_config.json");
        char *cpath = moe_path_join(label, "config.json"), *hpath = moe_path_join(label, "hf_quant_config.json");
        st = cpath && hpath ? moe_qdecl_parse(&c->decl, cpath, cf ? (const char *)cf->data : NULL, cf ? cf->len : 0, hpath,
                                              hf ? (const char *)hf->data : NULL, hf ? hf->len : 0, err)
                            : moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", label);
        free(cpath);
        free(hpath);
    }
    if (st != MOE_OK) {
        moe_ckpt_free(c);
        return st;
    }
    *out = c;
    return MOE_OK;
}
