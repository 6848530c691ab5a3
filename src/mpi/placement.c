/*
 * Expert placement: which rank holds each routed expert (contiguous ranges,
 * or a file). Pure bookkeeping, no MPI calls.
 */
#include "core/core.h"
#include "io/files.h"
#include "mpi/mpi_util.h"

#include <cjson/cJSON.h>
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <string.h>

static moe_status placement_alloc(int E, int N, moe_ep_placement *pl, moe_error *err) {
    memset(pl, 0, sizeof *pl);
    if (E < 1 || N < 1)
        return moe_errf(err, MOE_ERR_ARG, "placement of %d experts over %d ranks: both must be positive", E, N);
    pl->owner = moe_malloc((size_t)E, sizeof *pl->owner);
    if (!pl->owner) return moe_errf(err, MOE_ERR_NOMEM, "out of memory for a placement of %d experts", E);
    for (int e = 0; e < E; e++) pl->owner[e] = -1;
    pl->n_experts = E;
    pl->n_ranks = N;
    return MOE_OK;
}

moe_status moe_ep_placement_contiguous(int n_experts, int n_ranks, moe_ep_placement *pl, moe_error *err) {
    moe_status st = placement_alloc(n_experts, n_ranks, pl, err);
    if (st != MOE_OK) return st;
    for (int r = 0; r < n_ranks; r++) {
        int64_t b, c;
        moe_mpi_split(n_experts, n_ranks, r, &b, &c);
        for (int64_t e = b; e < b + c; e++) pl->owner[e] = r;
    }
    return MOE_OK;
}

void moe_ep_placement_free(moe_ep_placement *pl) {
    if (!pl) return;
    free(pl->owner);
    memset(pl, 0, sizeof *pl);
}

int moe_ep_placement_count(const moe_ep_placement *pl, int rank) {
    int n = 0;
    for (int e = 0; e < pl->n_experts; e++) n += pl->owner[e] == rank;
    return n;
}

/* Set owner[e] = r once, with range checks. `where` names the line or index. */
static moe_status place(moe_ep_placement *pl, const char *path, const char *where, long e, long r,
                        moe_error *err) {
    if (e < 0 || e >= pl->n_experts)
        return moe_errf(err, MOE_ERR_FORMAT, "%s: %s: expert %ld is outside [0, %d)", path, where, e, pl->n_experts);
    if (r < 0 || r >= pl->n_ranks)
        return moe_errf(err, MOE_ERR_FORMAT, "%s: %s: rank %ld is outside [0, %d) (the job has %d ranks)", path,
                        where, r, pl->n_ranks, pl->n_ranks);
    if (pl->owner[e] >= 0)
        return moe_errf(err, MOE_ERR_FORMAT, "%s: %s: expert %ld is placed twice (ranks %d and %ld)", path, where,
                        e, pl->owner[e], r);
    pl->owner[e] = (int32_t)r;
    return MOE_OK;
}

static moe_status parse_json(moe_ep_placement *pl, const char *path, const char *text, moe_error *err) {
    cJSON *root = cJSON_Parse(text);
    if (!root) return moe_errf(err, MOE_ERR_FORMAT, "%s: not valid JSON", path);
    const cJSON *arr = root;
    if (cJSON_IsObject(root)) arr = cJSON_GetObjectItemCaseSensitive(root, "expert_to_rank");
    moe_status st = MOE_OK;
    if (!cJSON_IsArray(arr)) {
        st = moe_errf(err, MOE_ERR_FORMAT, "%s: expected an array of ranks or {\"expert_to_rank\": [...]}", path);
    } else if (cJSON_GetArraySize(arr) != pl->n_experts) {
        st = moe_errf(err, MOE_ERR_FORMAT, "%s: %d entries for %d experts", path, cJSON_GetArraySize(arr),
                      pl->n_experts);
    } else {
        int e = 0;
        const cJSON *v;
        cJSON_ArrayForEach(v, arr) {
            char where[32];
            snprintf(where, sizeof where, "entry %d", e);
            /* Range first: a cast of a double outside long's range is
             * undefined behaviour (the old check cast before testing). */
            double d = cJSON_IsNumber(v) ? v->valuedouble : NAN;
            if (!(d >= -2147483648.0 && d <= 2147483647.0) || d != floor(d)) {
                char vb[40];
                if (cJSON_IsNumber(v)) snprintf(vb, sizeof vb, " (%.17g)", d);
                else vb[0] = '\0';
                st = moe_errf(err, MOE_ERR_FORMAT, "%s: %s%s is not an integer rank", path, where, vb);
                break;
            }
            st = place(pl, path, where, e, (long)d, err);
            if (st != MOE_OK) break;
            e++;
        }
    }
    cJSON_Delete(root);
    return st;
}

static moe_status parse_text(moe_ep_placement *pl, const char *path, char *text, moe_error *err) {
    int line = 0;
    for (char *s = text; s && *s;) {
        char *nl = strchr(s, '\n');
        if (nl) *nl = 0;
        line++;
        char *hash = strchr(s, '#');
        if (hash) *hash = 0;
        char where[32];
        snprintf(where, sizeof where, "line %d", line);
        char *p = s, *end;
        while (isspace((unsigned char)*p)) p++;
        if (*p) {
            errno = 0;
            long e = strtol(p, &end, 10);
            if (end == p || errno) return moe_errf(err, MOE_ERR_FORMAT, "%s: %s: expected \"EXPERT RANK\"", path, where);
            p = end;
            long r = strtol(p, &end, 10);
            if (end == p || errno) return moe_errf(err, MOE_ERR_FORMAT, "%s: %s: expected \"EXPERT RANK\"", path, where);
            for (p = end; isspace((unsigned char)*p); p++) {}
            if (*p) return moe_errf(err, MOE_ERR_FORMAT, "%s: %s: trailing text after \"EXPERT RANK\"", path, where);
            moe_status st = place(pl, path, where, e, r, err);
            if (st != MOE_OK) return st;
        }
        s = nl ? nl + 1 : NULL;
    }
    return MOE_OK;
}

/* Placement files are small: E lines of two numbers. */
#define MOE_PLACEMENT_MAX_BYTES ((size_t)64 << 20)

moe_status moe_ep_placement_parse(const char *text, size_t len, const char *label, int n_experts, int n_ranks,
                                  moe_ep_placement *pl, moe_error *err) {
    MOE_ASSERT(text || len == 0);
    if (!label) label = "<placement>";
    const char *nul = memchr(text, 0, len);
    if (nul)
        return moe_errf(err, MOE_ERR_FORMAT, "%s: a NUL byte at offset %zu: not a placement file", label,
                        (size_t)(nul - text));
    moe_ep_placement tmp;
    moe_status st = placement_alloc(n_experts, n_ranks, &tmp, err);
    if (st != MOE_OK) return st;
    char *copy = malloc(len + 1); /* the text parser cuts lines in place */
    if (!copy) {
        moe_ep_placement_free(&tmp);
        return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", label);
    }
    if (len) memcpy(copy, text, len);
    copy[len] = 0;
    const char *p = copy;
    while (isspace((unsigned char)*p)) p++;
    st = (*p == '[' || *p == '{') ? parse_json(&tmp, label, copy, err) : parse_text(&tmp, label, copy, err);
    free(copy);
    for (int e = 0; st == MOE_OK && e < n_experts; e++)
        if (tmp.owner[e] < 0) st = moe_errf(err, MOE_ERR_FORMAT, "%s: expert %d has no rank", label, e);
    if (st != MOE_OK) { moe_ep_placement_free(&tmp); return st; }
    *pl = tmp;
    return MOE_OK;
}

moe_status moe_ep_placement_read(const char *path, int n_experts, int n_ranks, moe_ep_placement *pl,
                                 moe_error *err) {
    char *text = NULL;
    size_t len = 0;
    moe_status st = moe_io_read_file(path, "the placement file", MOE_PLACEMENT_MAX_BYTES, &text, &len, err);
    if (st != MOE_OK) return st;
    st = moe_ep_placement_parse(text, len, path, n_experts, n_ranks, pl, err);
    free(text);
    return st;
}
