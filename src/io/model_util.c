/*
 * config.json numbers, one parser for every module (io/model_util.h).
 */
#include "io/model_util.h"
#include "core/core.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

moe_status moe_cfg_int(const cJSON *cfg, const char *path, const char *key, bool required, int def, int lo,
                       int hi, int *out, moe_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    if (!v || cJSON_IsNull(v)) {
        if (required) return moe_errf(err, MOE_ERR_MISSING, "%s: required key \"%s\" is missing", path, key);
        *out = def;
        return MOE_OK;
    }
    if (!cJSON_IsNumber(v)) return moe_errf(err, MOE_ERR_CONFIG, "%s: \"%s\" must be an integer", path, key);
    double x = v->valuedouble;
    if (x != floor(x))
        return moe_errf(err, MOE_ERR_CONFIG, "%s: \"%s\" = %.17g must be an integer", path, key, x);
    if (x < lo || x > hi)
        return moe_errf(err, MOE_ERR_CONFIG, "%s: \"%s\" = %.17g is outside [%d, %d]", path, key, x, lo, hi);
    *out = (int)x;
    return MOE_OK;
}

moe_status moe_cfg_num(const cJSON *cfg, const char *path, const char *key, bool required, double def,
                       double lo, double *out, moe_error *err) {
    const cJSON *v = cJSON_GetObjectItemCaseSensitive(cfg, key);
    if (!v || cJSON_IsNull(v)) {
        if (required) return moe_errf(err, MOE_ERR_MISSING, "%s: required key \"%s\" is missing", path, key);
        *out = def;
        return MOE_OK;
    }
    if (!cJSON_IsNumber(v)) return moe_errf(err, MOE_ERR_CONFIG, "%s: \"%s\" must be a number", path, key);
    double x = v->valuedouble;
    if (!isfinite(x) || x < lo) {
        if (lo == -INFINITY)
            return moe_errf(err, MOE_ERR_CONFIG, "%s: \"%s\" = %.17g must be a finite number", path, key, x);
        return moe_errf(err, MOE_ERR_CONFIG, "%s: \"%s\" = %.17g must be finite and >= %.17g", path, key, x, lo);
    }
    *out = x;
    return MOE_OK;
}

static int key_cmp(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

const char *moe_json_dup_key(const cJSON *v) {
    if (!v || (!cJSON_IsObject(v) && !cJSON_IsArray(v))) return NULL;
    size_t n = 0;
    for (const cJSON *c = v->child; c; c = c->next) n++;
    if (cJSON_IsObject(v) && n > 1) {
        const char **keys = malloc(n * sizeof *keys);
        if (keys) { /* out of memory: no verdict on this object */
            size_t i = 0;
            for (const cJSON *c = v->child; c; c = c->next) keys[i++] = c->string ? c->string : "";
            qsort(keys, n, sizeof *keys, key_cmp);
            const char *dup = NULL;
            for (i = 1; i < n && !dup; i++)
                if (strcmp(keys[i - 1], keys[i]) == 0) dup = keys[i];
            free(keys);
            if (dup) return dup;
        }
    }
    for (const cJSON *c = v->child; c; c = c->next) {
        const char *d = moe_json_dup_key(c);
        if (d) return d;
    }
    return NULL;
}
