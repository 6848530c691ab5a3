/* Helpers shared by the CLI's commands: the built-in and file inputs of
 * `run`, its output writer, and the map from a library status to the exit
 * status with its message. */
#include "cli.h"

#include <cjson/cJSON.h>

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>


int moe_cli_exit_code(moe_status s) {
    switch (s) {
    case MOE_OK: return EXIT_OKAY;
    case MOE_ERR_IO: case MOE_ERR_FORMAT: case MOE_ERR_MISSING: case MOE_ERR_SHAPE: case MOE_ERR_DTYPE:
    case MOE_ERR_CONFIG: case MOE_ERR_INPUT: case MOE_ERR_ARG: case MOE_ERR_UNSUPPORTED:
        return EXIT_USAGE;
    default:
        return EXIT_FAIL;
    }
}

int moe_cli_fail(moe_status s, const moe_error *err) {
    fprintf(stderr, "moeaudit: %s: %s\n", moe_status_str(s), err->msg);
    return moe_cli_exit_code(s);
}

int moe_cli_fail_out(moe_status s, const moe_error *err) {
    moe_cli_fail(s, err);
    return s == MOE_OK ? EXIT_OKAY : EXIT_FAIL;
}

int moe_cli_isa_default(moe_isa *isa) {
    const char *env = getenv("MOE_ISA");
    *isa = MOE_ISA_AUTO;
    if (!env || !*env) return EXIT_OKAY;
    moe_error err;
    moe_isa v, taken;
    moe_status st = moe_isa_parse(env, &v, &err);
    if (st == MOE_OK) st = moe_isa_resolve(v, &taken, &err);
    if (st != MOE_OK) {
        fprintf(stderr, "moeaudit: MOE_ISA=%s: %s\n", env, err.msg);
        return EXIT_USAGE;
    }
    *isa = v;
    return EXIT_OKAY;
}

/* ---------------------------------------------------------------- inputs */

uint64_t moe_cli_mix(uint64_t *s) { return moe_splitmix64(s); }

void moe_cli_fill_input(uint64_t seed, int64_t T, int H, int vocab, double *hidden, int64_t *ids) {
    for (int64_t i = 0; i < T * H; i++) hidden[i] = moe_splitmix64_gauss4(&seed);
    for (int64_t t = 0; t < T; t++) ids[t] = vocab > 0 ? (int64_t)(moe_cli_mix(&seed) % (uint64_t)vocab) : 0;
}

void moe_cli_input_free(moe_cli_input *in) {
    free(in->hidden);
    free(in->ids);
    memset(in, 0, sizeof *in);
}

int moe_cli_builtin_input(moe_cli_input *in, int64_t T, int H, int vocab) {
    in->T = T;
    in->H = H;
    in->hidden = calloc((size_t)(T * H) + 1, sizeof(double));
    in->ids = calloc((size_t)T + 1, sizeof(int64_t));
    if (!in->hidden || !in->ids) { fprintf(stderr, "moeaudit: out of memory\n"); return EXIT_FAIL; }
    moe_cli_fill_input(MOE_CLI_SEED, T, H, vocab, in->hidden, in->ids);
    return EXIT_OKAY;
}

/* hidden and input_ids of a file under the names hname, iname: through the
 * library's reader (moe_block_input_read), the one fuzz-input fuzzes. */
static int read_named(const char *path, const char *hname, const char *iname, int H, moe_cli_input *in) {
    moe_error err;
    moe_st_file *f = NULL;
    moe_status st = moe_st_open(path, &f, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    moe_block_input b;
    st = moe_block_input_read(f, hname, iname, H, &b, &err);
    moe_st_close(f);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    if (b.n_nonfinite > 0) {
        int64_t t = b.first_nonfinite;
        int k = 0;
        while (k < H - 1 && isfinite(b.hidden[t * H + k])) k++;
        fprintf(stderr, "moeaudit: warning: %s: %s[%lld][%d] = %g: %lld token(s) with NaN or Inf, whose outputs "
                "will be NaN\n", path, hname, (long long)t, k, b.hidden[t * H + k], (long long)b.n_nonfinite);
    }
    in->T = b.T;
    in->H = b.H;
    in->hidden = b.hidden;
    in->ids = b.ids;
    return EXIT_OKAY;
}

int moe_cli_read_input(const char *path, int H, moe_cli_input *in) { return read_named(path, "hidden", "input_ids", H, in); }

int moe_cli_read_layer_input(const char *path, int layer, int H, moe_cli_input *in) {
    moe_error err;
    moe_st_file *f = NULL;
    moe_status st = moe_st_open(path, &f, &err);
    if (st != MOE_OK) return moe_cli_fail(st, &err);
    char hname[64], iname[64];
    snprintf(hname, sizeof hname, "layer%d.hidden", layer);
    snprintf(iname, sizeof iname, "layer%d.input_ids", layer);
    bool own = moe_st_find(f, hname) != NULL;
    moe_st_close(f);
    return own ? read_named(path, hname, iname, H, in) : read_named(path, "hidden", "input_ids", H, in);
}

/* --------------------------------------------------------------- outputs */

int moe_cli_writer_add(moe_cli_writer *w, const char *prefix, const char *name, bool f32, const double *src,
                       const int32_t *isrc, int64_t d0, int64_t d1) {
    if (w->n == MOE_CLI_MAX_TENSORS) return -1;
    moe_st_entry *e = &w->e[w->n];
    snprintf(w->names[w->n], sizeof w->names[0], "%s%s", prefix, name);
    e->name = w->names[w->n];
    e->ndim = 2;
    e->shape[0] = d0;
    e->shape[1] = d1;
    size_t n = (size_t)(d0 * d1);
    w->bufs[w->n] = NULL;
    if (isrc) {
        e->dtype = MOE_DTYPE_I32;
        e->data = isrc;
    } else if (f32) {
        float *b = malloc(n * sizeof(float) + 1);
        if (!b) return -1;
        for (size_t i = 0; i < n; i++) b[i] = (float)src[i];
        e->dtype = MOE_DTYPE_F32;
        e->data = b;
        w->bufs[w->n] = b;
    } else {
        e->dtype = MOE_DTYPE_F64;
        e->data = src;
    }
    w->n++;
    return 0;
}

int moe_cli_writer_add_block(moe_cli_writer *w, const char *prefix, const moe_block_out *o, bool f32) {
    int e = 0;
    e |= moe_cli_writer_add(w, prefix, "router_logits", f32, o->router_logits, NULL, o->T, o->E);
    e |= moe_cli_writer_add(w, prefix, "topk_ids", f32, NULL, o->topk_ids, o->T, o->n_cols);
    e |= moe_cli_writer_add(w, prefix, "topk_weights", f32, o->topk_weights, NULL, o->T, o->n_cols);
    e |= moe_cli_writer_add(w, prefix, "eff_weights", f32, o->eff_weights, NULL, o->T, o->n_cols);
    e |= moe_cli_writer_add(w, prefix, "routed_out", f32, o->routed_out, NULL, o->T, o->H);
    e |= moe_cli_writer_add(w, prefix, "shared_out", f32, o->shared_out, NULL, o->T, o->H);
    e |= moe_cli_writer_add(w, prefix, "moe_out", f32, o->moe_out, NULL, o->T, o->H);
    return e;
}

bool moe_cli_private_tmp(char *buf, size_t n, const char *name) {
    const char *dir = getenv("TMPDIR");
    int k = snprintf(buf, n, "%s/moeaudit-XXXXXX", dir && *dir ? dir : "/tmp");
    if (k < 0 || (size_t)k >= n || !mkdtemp(buf)) {
        fprintf(stderr, "moeaudit: cannot make a private temporary directory in %s: %s\n", dir && *dir ? dir : "/tmp",
                k < 0 || (size_t)k >= n ? "path too long" : strerror(errno));
        buf[0] = '\0';
        return false;
    }
    size_t used = strlen(buf);
    k = snprintf(buf + used, n - used, "/%s", name);
    if (k < 0 || (size_t)k >= n - used) {
        buf[used] = '\0';
        rmdir(buf);
        buf[0] = '\0';
        fprintf(stderr, "moeaudit: temporary path too long\n");
        return false;
    }
    return true;
}

void moe_cli_private_tmp_done(const char *path) {
    if (!path || !path[0]) return;
    remove(path);
    char dir[4096];
    snprintf(dir, sizeof dir, "%s", path);
    char *slash = strrchr(dir, '/');
    if (slash) { *slash = '\0'; rmdir(dir); }
}

moe_status moe_cli_st_write(const char *path, const moe_st_entry *e, size_t n, const char *const *meta,
                            moe_error *err) {
    if (strcmp(path, "-")) return moe_st_write(path, e, n, meta, err);
    /* stdout: the whole file first (a failure writes nothing), then its bytes */
    char tmp[4096];
    if (!moe_cli_private_tmp(tmp, sizeof tmp, "out.safetensors")) {
        snprintf(err->msg, sizeof err->msg, "stdout: no temporary file for the safetensors bytes");
        return MOE_ERR_IO;
    }
    moe_status st = moe_st_write(tmp, e, n, meta, err);
    if (st != MOE_OK) { moe_cli_private_tmp_done(tmp); return st; }
    FILE *f = fopen(tmp, "rb");
    bool ok = f != NULL;
    char buf[1 << 16];
    size_t got;
    while (ok && (got = fread(buf, 1, sizeof buf, f)) > 0) ok = fwrite(buf, 1, got, stdout) == got;
    if (f) { ok = ok && !ferror(f); fclose(f); }
    ok = fflush(stdout) == 0 && ok;
    moe_cli_private_tmp_done(tmp);
    if (!ok) {
        snprintf(err->msg, sizeof err->msg, "stdout: writing the safetensors bytes failed");
        return MOE_ERR_IO;
    }
    return MOE_OK;
}

int moe_cli_writer_finish(moe_cli_writer *w, const char *path, int rc, bool quiet) {
    static const char *const meta[] = {"producer", MOE_CLI_TOOL, NULL};
    if (rc == EXIT_OKAY && path) {
        moe_error err;
        moe_status st = moe_cli_st_write(path, w->e, (size_t)w->n, meta, &err);
        if (st != MOE_OK) rc = moe_cli_fail_out(st, &err);
        else if (!quiet && strcmp(path, "-")) printf("wrote %d tensors to %s\n", w->n, path);
    }
    moe_cli_writer_free(w);
    return rc;
}

void moe_cli_writer_free(moe_cli_writer *w) {
    for (int i = 0; i < w->n; i++) free(w->bufs[i]);
    w->n = 0;
}

/* ---------------------------------------------------------------- reports */

cJSON *moe_cli_report_head(const char *report) {
    cJSON *j = cJSON_CreateObject();
    if (!j) return NULL;
    cJSON_AddNumberToObject(j, "schema_version", MOE_CLI_SCHEMA_VERSION);
    cJSON_AddStringToObject(j, "tool", MOE_CLI_TOOL);
    cJSON_AddStringToObject(j, "report", report);
    return j;
}

char *moe_cli_report_print(cJSON *head, char *lib_json) {
    cJSON *d = lib_json ? cJSON_Parse(lib_json) : NULL;
    free(lib_json);
    char *text = NULL;
    if (head && d) {
        for (cJSON *it = d->child; it;) {
            cJSON *next = it->next;
            if (!cJSON_GetObjectItemCaseSensitive(head, it->string))
                cJSON_AddItemToObject(head, it->string, cJSON_DetachItemViaPointer(d, it));
            it = next;
        }
        text = cJSON_Print(head);
    }
    cJSON_Delete(d);
    cJSON_Delete(head);
    return text;
}
