/*
 * Checkpoint directory: one or more safetensors shards found through, in
 * order of preference,
 *   1. model.safetensors (one shard);
 *   2. model.safetensors.index.json: {"weight_map": {tensor: shard-file}};
 *   3. every *.safetensors in the directory except oracle_io*.safetensors
 *      and hidden files, sorted by name (the first shard holding a name wins).
 * config.json is not read here: moe_model_open does that.
 *
 * Invariants:
 *  1. Shard file names are plain names inside the directory: no "/", no "..".
 *  2. A shard is mapped at most once, on the first lookup that needs it, and
 *     stays mapped until moe_ckpt_free; a failed mapping is retried next time.
 *  3. With an index, index[] is sorted by tensor name and names are unique.
 */
#include "core/core.h"
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
} ckpt_shard;

typedef struct ckpt_entry {
    char *name;        /* tensor name (owned) */
    size_t shard;
} ckpt_entry;

struct moe_ckpt {
    char *dir;
    size_t n_shards;
    ckpt_shard *shards;
    bool indexed;      /* index[] names the shard of every tensor */
    size_t n_index;
    ckpt_entry *index; /* [n_index] sorted by name */
};

static char *ck_strdup(const char *s) {
    size_t l = strlen(s) + 1;
    char *d = malloc(l);
    if (d) memcpy(d, s, l);
    return d;
}

static char *ck_join(const char *dir, const char *file) {
    size_t dl = strlen(dir), fl = strlen(file);
    while (dl > 1 && dir[dl - 1] == '/') dl--;
    char *p = malloc(dl + 1 + fl + 1);
    if (!p) return NULL;
    memcpy(p, dir, dl);
    p[dl] = '/';
    memcpy(p + dl + 1, file, fl + 1);
    return p;
}

static bool ck_is_file(const char *path) {
    struct stat sb;
    return stat(path, &sb) == 0 && S_ISREG(sb.st_mode);
}

void moe_ckpt_free(moe_ckpt *c) {
    if (!c) return;
    for (size_t i = 0; i < c->n_shards; i++) {
        moe_st_close(c->shards[i].st);
        free(c->shards[i].file);
        free(c->shards[i].path);
    }
    free(c->shards);
    for (size_t i = 0; i < c->n_index; i++) free(c->index[i].name);
    free(c->index);
    free(c->dir);
    free(c);
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
    s->path = ck_join(c->dir, file);
    s->st = NULL;
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

/* Read a whole small file into a NUL-terminated buffer. */
static moe_status ck_read_file(const char *path, char **out, size_t *len, moe_error *err) {
    FILE *fp = fopen(path, "rb");
    if (!fp) return moe_errf(err, MOE_ERR_IO, "%s: cannot open: %s", path, strerror(errno));
    size_t cap = 1 << 16, n = 0;
    char *buf = malloc(cap);
    moe_status st = MOE_OK;
    while (buf) {
        if (n + 1 == cap) {
            if (cap >= MOE_ST_MAX_HEADER) {
                st = moe_errf(err, MOE_ERR_FORMAT, "%s: larger than %u bytes", path,
                              MOE_ST_MAX_HEADER);
                break;
            }
            char *nb = realloc(buf, 2 * cap);
            if (!nb) break;
            buf = nb;
            cap *= 2;
        }
        size_t r = fread(buf + n, 1, cap - 1 - n, fp);
        n += r;
        if (r == 0) {
            if (ferror(fp)) st = moe_errf(err, MOE_ERR_IO, "%s: read failed", path);
            else {
                buf[n] = '\0';
                *out = buf;
                *len = n;
                fclose(fp);
                return MOE_OK;
            }
            break;
        }
    }
    fclose(fp);
    if (st == MOE_OK) st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", path);
    free(buf);
    return st;
}

/* A shard name from an index: a plain file name in the checkpoint directory. */
static bool ck_shard_name_ok(const char *s) {
    return s[0] != '\0' && strchr(s, '/') == NULL && strstr(s, "..") == NULL &&
           strcmp(s, ".") != 0;
}

static moe_status ck_load_index(moe_ckpt *c, const char *ipath, moe_error *err) {
    char *text = NULL;
    size_t len = 0;
    moe_status st = ck_read_file(ipath, &text, &len, err);
    if (st != MOE_OK) return st;
    cJSON *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (!root) return moe_errf(err, MOE_ERR_FORMAT, "%s: not valid JSON", ipath);
    const cJSON *wm = cJSON_GetObjectItemCaseSensitive(root, "weight_map");
    size_t cap = 0, n = 0;
    if (!cJSON_IsObject(root) || !cJSON_IsObject(wm)) {
        st = moe_errf(err, MOE_ERR_FORMAT, "%s: no \"weight_map\" object", ipath);
        goto done;
    }
    for (const cJSON *e = wm->child; e; e = e->next) n++;
    c->index = moe_calloc(n, sizeof *c->index);
    if (!c->index) {
        st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory for %zu names", ipath, n);
        goto done;
    }
    char qn[160], qs[160];
    for (const cJSON *e = wm->child; e; e = e->next) {
        if (!cJSON_IsString(e)) {
            st = moe_errf(err, MOE_ERR_FORMAT, "%s: tensor \"%s\": shard is not a string", ipath,
                          moe_io_quote(e->string, qn, sizeof qn));
            goto done;
        }
        const char *file = e->valuestring;
        if (!ck_shard_name_ok(file)) {
            st = moe_errf(err, MOE_ERR_FORMAT,
                          "%s: tensor \"%s\": shard \"%s\" is not a plain file name in the "
                          "checkpoint directory", ipath, moe_io_quote(e->string, qn, sizeof qn),
                          moe_io_quote(file, qs, sizeof qs));
            goto done;
        }
        /* Shards are few (under 200 in the largest checkpoints): scan them. */
        size_t s = SIZE_MAX;
        for (size_t k = c->n_shards; k-- > 0;)
            if (strcmp(c->shards[k].file, file) == 0) { s = k; break; }
        if (s == SIZE_MAX && (s = ck_add_shard(c, file, &cap)) == SIZE_MAX) {
            st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", ipath);
            goto done;
        }
        ckpt_entry *ent = &c->index[c->n_index];
        ent->name = ck_strdup(e->string);
        if (!ent->name) {
            st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", ipath);
            goto done;
        }
        ent->shard = s;
        c->n_index++;
    }
    qsort(c->index, c->n_index, sizeof *c->index, ck_entry_cmp);
    for (size_t k = 1; k < c->n_index; k++)
        if (strcmp(c->index[k - 1].name, c->index[k].name) == 0) {
            st = moe_errf(err, MOE_ERR_FORMAT, "%s: tensor \"%s\" appears twice in weight_map",
                          ipath, moe_io_quote(c->index[k].name, qn, sizeof qn));
            goto done;
        }
    c->indexed = true;
done:
    cJSON_Delete(root);
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
    char *single = ck_join(dir, "model.safetensors");
    char *ipath = ck_join(dir, "model.safetensors.index.json");
    moe_status st = MOE_OK;
    size_t cap = 0;
    if (!single || !ipath) {
        st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", dir);
    } else if (ck_is_file(single)) {
        if (ck_add_shard(c, "model.safetensors", &cap) == SIZE_MAX)
            st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", dir);
    } else if (ck_is_file(ipath)) {
        st = ck_load_index(c, ipath, err);
    } else {
        st = ck_scan_dir(c, err);
    }
    free(single);
    free(ipath);
    if (st != MOE_OK) {
        moe_ckpt_free(c);
        return st;
    }
    *out = c;
    return MOE_OK;
}

/* Map shard s if not yet mapped. */
static moe_status ck_map(moe_ckpt *c, size_t s, const char *tensor, moe_error *err) {
    ckpt_shard *sh = &c->shards[s];
    if (sh->st) return MOE_OK;
    moe_status st = moe_st_open(sh->path, &sh->st, err);
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
    }
    return moe_errf(err, MOE_ERR_MISSING, "%s: no tensor \"%s\" in %s%s", c->dir, name,
                    c->shards[0].file, c->n_shards > 1 ? " or the other shards" : "");
}

bool moe_ckpt_has(moe_ckpt *c, const char *name) {
    MOE_ASSERT(c && name);
    if (c->indexed) return ck_index_find(c, name) != NULL;
    for (size_t s = 0; s < c->n_shards; s++) {
        if (ck_map(c, s, NULL, NULL) != MOE_OK) continue;
        if (moe_st_find(c->shards[s].st, name)) return true;
    }
    return false;
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
