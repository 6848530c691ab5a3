/*
 * Layer-parallel audit under mpirun: the rows equal the single-process audit
 * (timings aside), and a rank whose shard is missing is reported with its
 * layers while the other rank's rows are kept.
 *
 * Not an MPI program itself: it builds a sharded copy of dsv4-tiny (layers
 * 0-1 in one shard, 2-3 in another, with model.safetensors.index.json) and
 * runs `mpirun -np 2 moeaudit audit` on it. argv: moeaudit binary, mpirun.
 */
#include "harness.h"

#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char *cli, *mpirun;
static char out_buf[1 << 16];

static int sh(const char *cmd) { return moe_t_sh(cmd, out_buf, sizeof out_buf); }

/* The file at path (one static buffer), or NULL. */
static char *slurp(const char *path) {
    static char buf[1 << 20];
    return moe_t_read_file(path, buf, sizeof buf);
}

/* Count rows of a layer in an audit JSON ("layer":<tab>N). */
static int rows_of(const char *json, int layer) {
    char key[64];
    snprintf(key, sizeof key, "\"layer\":\t%d,", layer);
    int n = 0;
    for (const char *p = json; (p = strstr(p, key)); p++) n++;
    return n;
}

static void make_sharded(const char *dir) {
    mkdir(dir, 0755);
    moe_error err;
    moe_st_file *src = NULL;
    CHECK_OK(moe_st_open(moe_t_data("dsv4-tiny/model.safetensors"), &src, &err), err);
    if (!src) return;
    size_t n = moe_st_count(src), na = 0, nb = 0;
    moe_st_entry *a = calloc(n, sizeof *a), *b = calloc(n, sizeof *b);
    char path[1024];
    snprintf(path, sizeof path, "%s/model.safetensors.index.json", dir);
    FILE *idx = fopen(path, "w");
    fputs("{\"metadata\": {}, \"weight_map\": {", idx);
    for (size_t i = 0; i < n; i++) {
        const moe_st_tensor *t = moe_st_at(src, i);
        bool late = strstr(t->name, "layers.2.") || strstr(t->name, "layers.3.");
        moe_st_entry *e = late ? &b[nb++] : &a[na++];
        *e = moe_t_st_entry(t);
        fprintf(idx, "%s\"%s\": \"%s\"", i ? ", " : "", t->name, late ? "model-00002.safetensors" : "model-00001.safetensors");
    }
    fputs("}}\n", idx);
    fclose(idx);
    snprintf(path, sizeof path, "%s/model-00001.safetensors", dir);
    CHECK_OK(moe_st_write(path, a, na, NULL, &err), err);
    snprintf(path, sizeof path, "%s/model-00002.safetensors", dir);
    CHECK_OK(moe_st_write(path, b, nb, NULL, &err), err);
    snprintf(path, sizeof path, "cp '%s' '%s/config.json'", moe_t_data("dsv4-tiny/config.json"), dir);
    CHECK(system(path) == 0, "config copied");
    free(a);
    free(b);
    moe_st_close(src);
}

static void test_layer_parallel(void) {
    char dir[600], cmd[4096], j1[700], j2[700];
    moe_t_tmp_path(dir, sizeof dir, "sharded");
    moe_t_tmp_path(j1, sizeof j1, "lp.json");
    moe_t_tmp_path(j2, sizeof j2, "sp.json");
    make_sharded(dir);
    /* the same rows, rank 0 writing one report */
    snprintf(cmd, sizeof cmd, "'%s' --oversubscribe --allow-run-as-root -np 2 '%s' audit --model '%s' --tokens 8 "
             "--quiet --json '%s' 2>&1", mpirun, cli, dir, j1);
    CHECK(sh(cmd) == 0, "layer-parallel audit: %s", out_buf);
    snprintf(cmd, sizeof cmd, "'%s' audit --model '%s' --tokens 8 --quiet --json '%s' 2>&1", cli, dir, j2);
    CHECK(sh(cmd) == 0, "single-process audit: %s", out_buf);
    static char lp[1 << 20];
    const char *s = slurp(j1);
    snprintf(lp, sizeof lp, "%s", s ? s : "");
    const char *sp = slurp(j2);
    for (int l = 0; l < 4; l++)
        CHECK(rows_of(lp, l) > 20 && rows_of(lp, l) == rows_of(sp ? sp : "", l), "layer %d rows: %d vs %d", l,
              rows_of(lp, l), rows_of(sp ? sp : "", l));
    /* rows equal but for timings: compare with the "seconds" lines removed */
    snprintf(cmd, sizeof cmd, "diff <(grep -v seconds '%s') <(grep -v seconds '%s') >/dev/null && echo same", j1, j2);
    char bash[4300];
    snprintf(bash, sizeof bash, "bash -c \"%s\"", cmd);
    CHECK(sh(bash) == 0 && strstr(out_buf, "same"), "reports equal apart from times");

    /* rank 1's shard gone: its layers fail, rank 0's rows stay */
    char shard[700];
    snprintf(shard, sizeof shard, "%s/model-00002.safetensors", dir);
    remove(shard);
    remove(j1);
    snprintf(cmd, sizeof cmd, "'%s' --oversubscribe --allow-run-as-root -np 2 '%s' audit --model '%s' --tokens 8 "
             "--quiet --json '%s' 2>&1", mpirun, cli, dir, j1);
    int rc = sh(cmd);
    CHECK(rc == 1, "a failed rank makes exit 1 (got %d): %s", rc, out_buf);
    CHECK(strstr(out_buf, "rank 1") && strstr(out_buf, "model-00002.safetensors"), "names the rank and shard: %s",
          out_buf);
    CHECK(strstr(out_buf, "layer 2") && strstr(out_buf, "layer 3"), "names the lost layers: %s", out_buf);
    s = slurp(j1);
    CHECK(s && rows_of(s, 0) > 20 && rows_of(s, 1) > 20 && rows_of(s, 2) == 0, "the other rank's rows are kept");
    /* The check above was seen failing under load: Open MPI's mpirun kills
     * every process once one exits non-zero, and rank 1, done first with
     * exit 1, took rank 0 down while it still wrote the report after
     * MPI_Finalize. Every rank now waits for rank 0's report (audit_mpi_end in
     * tools/cmd_audit.c). A --json FIFO read 2 s late forced the race before
     * reports became atomic (a temporary renamed over the FIFO no longer
     * blocks), so no test here slows rank 0 down. */
}

int main(int argc, char **argv) {
    if (argc < 3) { fprintf(stderr, "usage: test-lp-audit MOEAUDIT MPIRUN\n"); return 2; }
    cli = argv[1];
    mpirun = argv[2];
    RUN(test_layer_parallel);
    return moe_t_finish();
}
