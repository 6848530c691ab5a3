/* Untrusted input and outputs (issue #12): error messages that keep their
 * cause, files that are not regular refused without blocking, read errors
 * never taken for absent tensors, config limits checked before allocation,
 * the atomic writer (exclusive temporary files, planted symlinks, no partial
 * file) and the streaming safetensors writer. Each defect's test names it. */
#include "core/core.h"
#include "harness.h"
#include "moeaudit_indexer.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

/* ---------------------------------------------------------------- helpers */

static void put_text(const char *path, const char *text) {
    FILE *f = fopen(path, "wb");
    if (!f) { perror(path); return; }
    fputs(text, f);
    fclose(f);
}

static void put_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) { perror(path); return; }
    if (n && fwrite(p, 1, n, f) != n) perror(path);
    fclose(f);
}

static char *slurp(const char *path, size_t *n) {
    struct stat sb;
    if (stat(path, &sb) != 0 || !S_ISREG(sb.st_mode)) return NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *b = malloc((size_t)sb.st_size + 1);
    *n = fread(b, 1, (size_t)sb.st_size, f);
    b[*n] = 0;
    fclose(f);
    return b;
}

static const char *mkdir_in(char *buf, size_t cap, const char *name) {
    moe_t_tmp_path(buf, cap, name);
    mkdir(buf, 0755);
    return buf;
}

/* Copy tests/data/<rel> to dst. */
static void copy_data(const char *rel, const char *dst) {
    size_t n = 0;
    char *b = slurp(moe_t_data(rel), &n);
    if (!b) { fprintf(stderr, "cannot read %s\n", moe_t_data(rel)); return; }
    put_bytes(dst, b, n);
    free(b);
}

/* Run fn(arg) in a child that is killed after `seconds`; 0 when it returned
 * in time, 1 when it was still blocked. fn's checks are not counted (the
 * child's counters die with it): it exits with its own verdict. */
static int within(int seconds, int (*fn)(const char *), const char *arg) {
    pid_t p = fork();
    if (p == 0) {
        alarm((unsigned)seconds);
        _exit(fn(arg));
    }
    int ws = 0;
    waitpid(p, &ws, 0);
    if (WIFSIGNALED(ws) && WTERMSIG(ws) == SIGALRM) return -1;
    return WIFEXITED(ws) ? WEXITSTATUS(ws) : -2;
}

/* ------------------------------------------------- #13 messages never cut */

static void test_err_fit(void) {
    /* a 4000-byte path: the start, the file name and the cause survive */
    char *path = malloc(4100);
    strcpy(path, "/very");
    for (int i = 0; i < 398; i++) strcat(path, "/deepdir.x");
    strcat(path, "/config.json");
    moe_error err;
    moe_errf(&err, MOE_ERR_IO, "%s: cannot open: %s", path, strerror(ENOENT));
    CHECK(strlen(err.msg) < sizeof err.msg, "fits");
    CHECK(strncmp(err.msg, "/very/deepdir", 13) == 0, "head kept: %s", err.msg);
    CHECK(strstr(err.msg, "config.json: cannot open: No such file or directory") != NULL, "cause kept: %s", err.msg);
    CHECK(strstr(err.msg, "...") != NULL, "elision marked: %s", err.msg);
    /* two long paths: both shortened, both file names and the words between kept */
    moe_errf(&err, MOE_ERR_IO, "output %s/out.json is the input %s/in.json: refusing", path, path);
    CHECK(strstr(err.msg, "out.json is the input") && strstr(err.msg, "in.json: refusing") &&
              strncmp(err.msg, "output /very", 12) == 0, "two paths: %s", err.msg);
    /* many short words: the head and the tail of the message */
    char *words = malloc(8000);
    words[0] = 0;
    for (int i = 0; i < 700; i++) strcat(words, "word ");
    moe_errf(&err, MOE_ERR_IO, "start %s end-of-message", words);
    CHECK(strncmp(err.msg, "start word", 10) == 0 && strstr(err.msg, "end-of-message") && strlen(err.msg) < 512,
          "words: %.60s", err.msg);
    /* a message built from the previous one (ck_map's pattern) */
    moe_errf(&err, MOE_ERR_IO, "%s: cannot open: %s", path, strerror(ENOENT));
    char prev[sizeof err.msg];
    memcpy(prev, err.msg, sizeof prev);
    moe_errf(&err, MOE_ERR_IO, "%s (shard \"model.safetensors\", needed for tensor \"layers.3.ffn.gate.weight\")", prev);
    CHECK(strstr(err.msg, "No such file or directory") && strstr(err.msg, "layers.3.ffn.gate.weight\")"), "extended: %s",
          err.msg);
    /* short messages untouched */
    moe_errf(&err, MOE_ERR_IO, "%s", "short");
    CHECK(strcmp(err.msg, "short") == 0, "%s", err.msg);
    free(words);
    free(path);
}

/* The real thing: a 4000-character checkpoint path, through the library. */
static void test_long_path(void) {
    char *dir = malloc(4200);
    snprintf(dir, 4200, "%s", moe_t_tmpdir());
    while (strlen(dir) < 3990) {
        strcat(dir, "/d123456789012345678901234567890123456789012345678901234567890123456789");
        mkdir(dir, 0755);
    }
    CHECK(strlen(dir) >= 3990 && strlen(dir) < 4080, "path length %zu", strlen(dir));
    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(dir, &m, &err);
    CHECK(st == MOE_ERR_IO && strstr(err.msg, "config.json: cannot open: No such file or directory"),
          "missing config.json: %s", err.msg);
    CHECK(strlen(err.msg) < sizeof err.msg, "fits");
    char *file = moe_path_join(dir, "model.safetensors");
    moe_st_file *f = NULL;
    st = moe_st_open(file, &f, &err);
    CHECK(st == MOE_ERR_IO && strstr(err.msg, "model.safetensors: cannot open: No such file or directory"), "%s",
          err.msg);
    /* a real checkpoint at that depth opens (no fixed path buffer cuts it) */
    char *cfg = moe_path_join(dir, "config.json");
    copy_data("dsv4-tiny/config.json", cfg);
    copy_data("dsv4-tiny/model.safetensors", file);
    st = moe_model_open(dir, &m, &err);
    CHECK_OK(st, err);
    if (st == MOE_OK) {
        const moe_layer *L = NULL;
        st = moe_model_layer(m, 3, &L, &err);
        CHECK_OK(st, err);
        moe_model_free(m);
    }
    free(cfg);
    free(file);
    free(dir);
}

/* --------------------------------- #4 files that are not regular, refused */

static int open_model(const char *dir) {
    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(dir, &m, &err);
    if (st == MOE_OK) {
        const moe_layer *L = NULL;
        st = moe_model_layer(m, 3, &L, &err);
        moe_model_free(m);
    }
    /* verdict: 0 when refused with a message naming a named pipe */
    if (st == MOE_ERR_IO && strstr(err.msg, "named pipe")) return 0;
    fprintf(stderr, "open_model %s: %s: %s\n", dir, moe_status_str(st), err.msg);
    return 3;
}

static int open_st(const char *path) {
    moe_error err;
    moe_st_file *f = NULL;
    moe_status st = moe_st_open(path, &f, &err);
    if (st == MOE_OK) moe_st_close(f);
    if (st == MOE_ERR_IO && strstr(err.msg, "not a regular file")) return 0;
    fprintf(stderr, "open_st %s: %s: %s\n", path, moe_status_str(st), err.msg);
    return 3;
}

static void test_not_regular(void) {
    char dir[600], p[700];
    /* model.safetensors is a FIFO: before, the open waited for a writer */
    mkdir_in(dir, sizeof dir, "fifo-shard");
    snprintf(p, sizeof p, "%s/config.json", dir);
    copy_data("dsv4-tiny/config.json", p);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    CHECK(mkfifo(p, 0644) == 0, "mkfifo: %s", strerror(errno));
    CHECK(within(20, open_model, dir) == 0, "FIFO model.safetensors blocked or was not refused");
    CHECK(within(20, open_st, p) == 0, "FIFO as a safetensors file");
    /* config.json is a FIFO */
    mkdir_in(dir, sizeof dir, "fifo-config");
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    copy_data("dsv4-tiny/model.safetensors", p);
    snprintf(p, sizeof p, "%s/config.json", dir);
    CHECK(mkfifo(p, 0644) == 0, "mkfifo: %s", strerror(errno));
    CHECK(within(20, open_model, dir) == 0, "FIFO config.json blocked or was not refused");
    /* the index is a FIFO */
    mkdir_in(dir, sizeof dir, "fifo-index");
    snprintf(p, sizeof p, "%s/config.json", dir);
    copy_data("dsv4-tiny/config.json", p);
    snprintf(p, sizeof p, "%s/model.safetensors.index.json", dir);
    CHECK(mkfifo(p, 0644) == 0, "mkfifo: %s", strerror(errno));
    CHECK(within(20, open_model, dir) == 0, "FIFO index blocked or was not refused");

    /* a directory, a character device (through a symlink) as a shard */
    moe_error err;
    moe_st_file *f = NULL;
    mkdir_in(dir, sizeof dir, "dir.safetensors");
    moe_status st = moe_st_open(dir, &f, &err);
    CHECK(st == MOE_ERR_IO && strstr(err.msg, "a directory, not a regular file"), "%s", err.msg);
    moe_t_tmp_path(p, sizeof p, "zero.safetensors");
    CHECK(symlink("/dev/zero", p) == 0, "symlink");
    st = moe_st_open(p, &f, &err);
    CHECK(st == MOE_ERR_IO && strstr(err.msg, "a character device"), "%s", err.msg);
    /* config.json is a directory */
    mkdir_in(dir, sizeof dir, "dir-config");
    snprintf(p, sizeof p, "%s/config.json", dir);
    mkdir(p, 0755);
    moe_model *m = NULL;
    st = moe_model_open(dir, &m, &err);
    CHECK(st == MOE_ERR_IO && strstr(err.msg, "config.json") && strstr(err.msg, "a directory"), "%s", err.msg);
}

/* ----------------------------- #3 a read error is not an absent tensor */

static void test_probe_keeps_errors(void) {
    char dir[600], p[700];
    mkdir_in(dir, sizeof dir, "bad-single");
    snprintf(p, sizeof p, "%s/config.json", dir);
    copy_data("dsv4-tiny/config.json", p);
    /* a header length past the end of the file */
    static const char bad[] = "\xff\0\0\0\0\0\0\0{}";
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    put_bytes(p, bad, sizeof bad - 1);
    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(dir, &m, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    const moe_layer *L = NULL;
    st = moe_model_layer(m, 3, &L, &err);
    CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "header length 255 is past the end") &&
              strstr(err.msg, "model.safetensors") && !strstr(err.msg, "no router"),
          "malformed single file: %s: %s", moe_status_str(st), err.msg);
    moe_model_free(m);

    /* no index, two shards, the second corrupt: the bias and the shared
     * expert are probed, and a probe must not read "absent" */
    mkdir_in(dir, sizeof dir, "bad-second");
    snprintf(p, sizeof p, "%s/config.json", dir);
    copy_data("dsv4-tiny/config.json", p);
    /* a.safetensors: the fixture without layer 3's correction bias, which
     * the loader probes for (before, a corrupt b made it "absent": the layer
     * then routed without its bias, silently) */
    {
        moe_st_file *src = NULL;
        moe_status s0 = moe_st_open(moe_t_data("dsv4-tiny/model.safetensors"), &src, &err);
        CHECK_OK(s0, err);
        if (s0 != MOE_OK) return;
        size_t nt = moe_st_count(src), k = 0;
        moe_st_entry *es = calloc(nt, sizeof *es);
        for (size_t i = 0; i < nt; i++) {
            const moe_st_tensor *x = moe_st_at(src, i);
            if (strstr(x->name, "layers.3.ffn.gate.bias")) continue;
            es[k++] = moe_t_st_entry(x);
        }
        CHECK(k == nt - 1, "the fixture has layer 3's bias");
        snprintf(p, sizeof p, "%s/a.safetensors", dir);
        CHECK_OK(moe_st_write(p, es, k, NULL, &err), err);
        free(es);
        moe_st_close(src);
    }
    snprintf(p, sizeof p, "%s/b.safetensors", dir);
    put_bytes(p, bad, sizeof bad - 1);
    st = moe_model_open(dir, &m, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    st = moe_model_layer(m, 3, &L, &err);
    CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "b.safetensors"), "corrupt second shard: %s: %s",
          moe_status_str(st), err.msg);
    /* the indexer's probes: its naming (V4 or V3.2, with or without
     * "model."), its compressor; each looks for a name that a holds under
     * another spelling or not at all (the forward's MTP probe: test-model) */
    moe_idx_weights *iw = NULL;
    st = moe_idx_load(m, 3, &iw, &err);
    CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "b.safetensors"), "indexer probe on a corrupt shard: %s: %s",
          moe_status_str(st), err.msg);
    moe_idx_weights_free(iw);
    const moe_st_tensor *t = NULL;
    moe_ckpt *c = NULL;
    st = moe_ckpt_open(dir, &c, &err);
    CHECK_OK(st, err);
    if (st == MOE_OK) {
        st = moe_ckpt_lookup(c, "no.such.tensor", &t, &err);
        CHECK(st == MOE_ERR_FORMAT && strstr(err.msg, "b.safetensors"), "lookup: %s", err.msg);
        /* the refusal lasts (checkpoint.c invariant 2): the same status and
         * reader's message for the next name, without reading b again (b is
         * now a valid file, and is still refused) */
        char first[sizeof err.msg];
        snprintf(first, sizeof first, "%s", err.msg);
        char *cut = strstr(first, " (shard");
        if (cut) *cut = '\0';
        snprintf(p, sizeof p, "%s/b.safetensors", dir);
        float one = 1.0f;
        moe_st_entry ok = {.name = "x", .dtype = MOE_DTYPE_F32, .ndim = 1, .shape = {1}, .data = &one};
        CHECK_OK(moe_st_write(p, &ok, 1, NULL, &err), err);
        st = moe_ckpt_lookup(c, "another.tensor", &t, &err);
        CHECK(st == MOE_ERR_FORMAT && cut && !strncmp(err.msg, first, strlen(first)) &&
                  strstr(err.msg, "another.tensor"),
              "second lookup: %s (first: %s)", err.msg, first);
        CHECK(!moe_ckpt_has(c, "x"), "a refused shard holds nothing");
        moe_ckpt_free(c);
    }
    moe_model_free(m);
}

/* --------------------------------- #2 #7 config limits, before allocation */

/* extra: the keys of the test, then the defaults for the keys it omits */
static const char *cfg_with(char *dir, size_t cap, const char *name, const char *extra) {
    mkdir_in(dir, cap, name);
    char p[700], text[2048];
    snprintf(text, sizeof text, "{\"model_type\": \"deepseek_v3\", %s%s%s%s}", extra,
             strstr(extra, "hidden_size") ? "" : ", \"hidden_size\": 8",
             strstr(extra, "moe_intermediate_size") ? "" : ", \"moe_intermediate_size\": 4",
             strstr(extra, "num_hidden_layers") ? "" : ", \"num_hidden_layers\": 1");
    snprintf(p, sizeof p, "%s/config.json", dir);
    put_text(p, text);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    copy_data("dsv3-tiny/model.safetensors", p);
    return dir;
}

static void expect_config(const char *name, const char *extra, const char *key, const char *limit) {
    char dir[600];
    cfg_with(dir, sizeof dir, name, extra);
    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(dir, &m, &err);
    CHECK(st == MOE_ERR_CONFIG && strstr(err.msg, key) && strstr(err.msg, limit), "%s: %s: %s", name,
          moe_status_str(st), err.msg);
    moe_model_free(m);
}

static void test_config_limits(void) {
    /* #2: n_group 2048 used to pass every check and abort in the router */
    expect_config("groups", "\"n_routed_experts\": 4096, \"num_experts_per_tok\": 8, \"n_group\": 2048, \"topk_group\": 4",
                  "\"n_group\" = 2048", "1024]");
    /* #7: top-k 300 was "out of memory" at the first run */
    expect_config("topk", "\"n_routed_experts\": 512, \"num_experts_per_tok\": 300", "\"num_experts_per_tok\" = 300",
                  "256]");
    expect_config("experts", "\"n_routed_experts\": 100000, \"num_experts_per_tok\": 8", "n_routed_experts", "16384]");
    expect_config("vocab", "\"n_routed_experts\": 8, \"num_experts_per_tok\": 2, \"vocab_size\": 1e9", "vocab_size",
                  "16777216]");
    expect_config("layers", "\"n_routed_experts\": 8, \"num_experts_per_tok\": 2, \"num_hidden_layers\": 5000",
                  "num_hidden_layers", "4096]");
    expect_config("shared", "\"n_routed_experts\": 8, \"num_experts_per_tok\": 2, \"n_shared_experts\": 1000",
                  "n_shared_experts", "64]");
    expect_config("hidden", "\"n_routed_experts\": 8, \"num_experts_per_tok\": 2, \"hidden_size\": 1e7", "hidden_size",
                  "65536]");
    /* a key given twice: cJSON would read the first, Python the last */
    {
        char d2[600];
        cfg_with(d2, sizeof d2, "dup-key", "\"n_routed_experts\": 8, \"num_experts_per_tok\": 2, \"n_group\": 1, \"n_group\": 4");
        moe_error e2;
        moe_model *m2 = NULL;
        moe_status s2 = moe_model_open(d2, &m2, &e2);
        CHECK(s2 == MOE_ERR_FORMAT && strstr(e2.msg, "\"n_group\" appears twice"), "dup: %s", e2.msg);
        moe_model_free(m2);
    }
    /* the V4 keys the hyper-connection and indexer loaders read */
    char dir[600], p[700];
    mkdir_in(dir, sizeof dir, "hc-mult");
    size_t n = 0;
    char *cfg = slurp(moe_t_data("dsv4-tiny/config.json"), &n);
    char *at = cfg ? strstr(cfg, "\"hc_mult\": 4") : NULL;
    CHECK(at != NULL, "fixture has hc_mult 4");
    if (!at) { free(cfg); return; }
    char *fixed = malloc(n + 64);
    size_t head = (size_t)(at - cfg);
    memcpy(fixed, cfg, head);
    strcpy(fixed + head, "\"hc_mult\": 100");
    strcat(fixed, at + strlen("\"hc_mult\": 4"));
    snprintf(p, sizeof p, "%s/config.json", dir);
    put_text(p, fixed);
    snprintf(p, sizeof p, "%s/model.safetensors", dir);
    copy_data("dsv4-tiny/model.safetensors", p);
    moe_error err;
    moe_model *m = NULL;
    moe_status st = moe_model_open(dir, &m, &err);
    CHECK_OK(st, err);
    if (st == MOE_OK) {
        moe_hc_weights *w = NULL;
        st = moe_hc_load(m, 3, MOE_HC_FFN, &w, &err);
        CHECK(st == MOE_ERR_CONFIG && strstr(err.msg, "\"hc_mult\" = 100") && strstr(err.msg, "64]"), "hc_mult: %s",
              err.msg);
        moe_hc_weights_free(w);
        moe_model_free(m);
    }
    free(fixed);
    free(cfg);
}

/* ------------------------------------ #14 the atomic writer's temp file */

static void test_planted_symlink(void) {
    char victim[600], out[600], planted[700];
    moe_t_tmp_path(victim, sizeof victim, "victim.txt");
    put_text(victim, "precious");
    moe_t_tmp_path(out, sizeof out, "out.safetensors");
    /* the old writer's name, <path>.tmp.<pid>, planted as a symlink */
    snprintf(planted, sizeof planted, "%s.tmp.%ld", out, (long)getpid());
    CHECK(symlink(victim, planted) == 0, "symlink: %s", strerror(errno));
    float v[4] = {1, 2, 3, 4};
    moe_st_entry e = {.name = "x", .dtype = MOE_DTYPE_F32, .ndim = 1, .shape = {4}, .data = v};
    moe_error err;
    moe_status st = moe_st_write(out, &e, 1, NULL, &err);
    CHECK_OK(st, err);
    size_t n = 0;
    char *got = slurp(victim, &n);
    CHECK(got && strcmp(got, "precious") == 0, "the symlink's target was overwritten");
    free(got);
    struct stat sb;
    CHECK(lstat(planted, &sb) == 0 && S_ISLNK(sb.st_mode), "planted link untouched");
    unlink(planted);

    /* the destination itself a symlink to the victim: replaced, not written through */
    moe_t_tmp_path(out, sizeof out, "link-out.safetensors");
    CHECK(symlink(victim, out) == 0, "symlink");
    st = moe_st_write(out, &e, 1, NULL, &err);
    CHECK_OK(st, err);
    got = slurp(victim, &n);
    CHECK(got && strcmp(got, "precious") == 0, "written through the destination symlink");
    free(got);
    CHECK(lstat(out, &sb) == 0 && S_ISREG(sb.st_mode), "destination is now a regular file");

    /* a FIFO at the destination: refused, without blocking */
    moe_t_tmp_path(out, sizeof out, "fifo-out");
    mkfifo(out, 0644);
    st = moe_st_write(out, &e, 1, NULL, &err);
    CHECK(st == MOE_ERR_ARG && strstr(err.msg, "named pipe"), "%s", err.msg);
    CHECK(moe_t_count_temps(moe_t_tmpdir()) == 0, "temporary files left: %d", moe_t_count_temps(moe_t_tmpdir()));
}

static void test_out_file(void) {
    char path[600];
    moe_t_tmp_path(path, sizeof path, "report.txt");
    put_text(path, "old report\n");
    chmod(path, 0600);
    moe_error err;
    moe_out_file *f = NULL;
    moe_status st = moe_out_open(path, &f, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    CHECK(moe_t_count_temps(moe_t_tmpdir()) == 1, "one temporary file while writing");
    FILE *s = moe_out_stream(f);
    CHECK(s != NULL, "stream");
    fprintf(s, "new %s %d\n", "report", 42);
    size_t n = 0;
    char *got = slurp(path, &n);
    CHECK(got && strcmp(got, "old report\n") == 0, "destination unchanged before commit");
    free(got);
    st = moe_out_commit(f, &err);
    CHECK_OK(st, err);
    got = slurp(path, &n);
    CHECK(got && strcmp(got, "new report 42\n") == 0, "committed: %s", got ? got : "(none)");
    free(got);
    struct stat sb;
    CHECK(stat(path, &sb) == 0 && (sb.st_mode & 0777) == 0600, "permissions kept: %o", (unsigned)(sb.st_mode & 0777));
    /* abort: nothing changes, nothing left */
    st = moe_out_open(path, &f, &err);
    CHECK_OK(st, err);
    if (st == MOE_OK) {
        moe_out_write(f, "garbage", 7, &err);
        moe_out_abort(f);
    }
    got = slurp(path, &n);
    CHECK(got && strcmp(got, "new report 42\n") == 0, "abort changed the file");
    free(got);
    CHECK(moe_t_count_temps(moe_t_tmpdir()) == 0, "temporary file left after abort");
    /* a missing directory: MOE_ERR_IO naming it */
    moe_t_tmp_path(path, sizeof path, "no-such-dir/report.txt");
    st = moe_out_open(path, &f, &err);
    CHECK(st == MOE_ERR_IO && strstr(err.msg, "no-such-dir") && strstr(err.msg, "No such file"), "%s", err.msg);

    /* the same file under another name (hard link, symlink) is an input */
    char in[600], hard[600], soft[600];
    moe_t_tmp_path(in, sizeof in, "input.safetensors");
    put_text(in, "x");
    moe_t_tmp_path(hard, sizeof hard, "hard.safetensors");
    moe_t_tmp_path(soft, sizeof soft, "soft.safetensors");
    CHECK(link(in, hard) == 0 && symlink(in, soft) == 0, "links");
    const char *inputs[] = {NULL, in};
    st = moe_out_check_inputs(hard, inputs, 2, &err);
    CHECK(st == MOE_ERR_ARG && strstr(err.msg, "refusing to overwrite an input"), "hard link: %s", err.msg);
    st = moe_out_check_inputs(soft, inputs, 2, &err);
    CHECK(st == MOE_ERR_ARG, "symlink: %s", err.msg);
    moe_t_tmp_path(path, sizeof path, "fresh.safetensors");
    CHECK(moe_out_check_inputs(path, inputs, 2, &err) == MOE_OK, "a new file is no input");
}

/* ------------------------------------------------ #6 the streaming writer */

static void test_stream(void) {
    char path[600], ref[600];
    moe_t_tmp_path(path, sizeof path, "stream.safetensors");
    moe_t_tmp_path(ref, sizeof ref, "whole.safetensors");
    double a[6] = {1, 2, 3, 4, 5, 6};
    int32_t b[4] = {7, 8, 9, 10};
    moe_st_entry e[3] = {
        {.name = "layer0.a", .dtype = MOE_DTYPE_F64, .ndim = 2, .shape = {2, 3}, .data = a},
        {.name = "layer0.empty", .dtype = MOE_DTYPE_F32, .ndim = 2, .shape = {0, 3}, .data = NULL},
        {.name = "layer1.b", .dtype = MOE_DTYPE_I32, .ndim = 1, .shape = {4}, .data = b},
    };
    static const char *const meta[] = {"producer", "test", NULL};
    moe_error err;
    CHECK_OK(moe_st_write(ref, e, 3, meta, &err), err);
    moe_st_stream *s = NULL;
    moe_status st = moe_st_stream_open(path, e, 3, meta, &s, &err);
    CHECK_OK(st, err);
    if (st != MOE_OK) return;
    CHECK(moe_t_count_temps(moe_t_tmpdir()) == 1, "one temporary file while streaming");
    /* bytes out of order and in uneven pieces */
    const unsigned char *pa = (const unsigned char *)a;
    CHECK_OK(moe_st_stream_put(s, 2, 8, b + 2, 8, &err), err);
    CHECK_OK(moe_st_stream_put(s, 0, 10, pa + 10, 38, &err), err);
    CHECK_OK(moe_st_stream_put(s, 2, 0, b, 8, &err), err);
    CHECK_OK(moe_st_stream_put(s, 0, 0, pa, 10, &err), err);
    st = moe_st_stream_put(s, 2, 12, b, 8, &err);
    CHECK(st == MOE_ERR_ARG && strstr(err.msg, "outside its 16 bytes"), "%s", err.msg);
    CHECK_OK(moe_st_stream_finish(s, &err), err);
    size_t n1 = 0, n2 = 0;
    char *x = slurp(path, &n1), *y = slurp(ref, &n2);
    CHECK(x && y && n1 == n2 && memcmp(x, y, n1) == 0, "stream = whole file (%zu vs %zu bytes)", n1, n2);
    free(x);
    free(y);
    /* a short stream makes no file, and keeps the old one */
    st = moe_st_stream_open(path, e, 3, meta, &s, &err);
    CHECK_OK(st, err);
    if (st == MOE_OK) {
        CHECK_OK(moe_st_stream_put(s, 0, 0, a, 48, &err), err);
        st = moe_st_stream_finish(s, &err);
        CHECK(st == MOE_ERR_ARG && strstr(err.msg, "layer1.b received 0 of its 16 bytes"), "%s", err.msg);
    }
    x = slurp(path, &n1);
    y = slurp(ref, &n2);
    CHECK(x && y && n1 == n2 && memcmp(x, y, n1) == 0, "old file kept");
    free(x);
    free(y);
    CHECK(moe_t_count_temps(moe_t_tmpdir()) == 0, "temporary file left");
}

/* The in-memory checkpoint runs exactly what the directory runs. */
static void test_mem_checkpoint(void) {
    size_t nc = 0, nm = 0;
    char *cfg = slurp(moe_t_data("dsv4-tiny/config.json"), &nc);
    char *st_bytes = slurp(moe_t_data("dsv4-tiny/model.safetensors"), &nm);
    if (!cfg || !st_bytes) { CHECK(0, "fixture"); return; }
    moe_mem_file files[2] = {{"config.json", cfg, nc}, {"model.safetensors", st_bytes, nm}};
    moe_error err;
    moe_model *a = NULL, *b = NULL;
    CHECK_OK(moe_model_open_mem("mem:dsv4-tiny", files, 2, &a, &err), err);
    CHECK_OK(moe_model_open(moe_t_data("dsv4-tiny"), &b, &err), err);
    if (a && b) {
        const moe_layer *La = NULL, *Lb = NULL;
        CHECK_OK(moe_model_layer(a, 3, &La, &err), err);
        CHECK_OK(moe_model_layer(b, 3, &Lb, &err), err);
        if (La && Lb) {
            int64_t T = 5;
            int H = La->cfg.hidden;
            double *x = malloc((size_t)(T * H) * sizeof *x);
            uint64_t seed = 7;
            for (int64_t i = 0; i < T * H; i++) x[i] = moe_t_rng_normal(&seed);
            moe_run_opts o = moe_run_opts_default();
            moe_block_out oa, ob;
            CHECK_OK(moe_block_out_init(&oa, La, T, &o, &err), err);
            CHECK_OK(moe_block_out_init(&ob, Lb, T, &o, &err), err);
            CHECK_OK(moe_block_run(La, x, NULL, T, &o, &oa, &err), err);
            CHECK_OK(moe_block_run(Lb, x, NULL, T, &o, &ob, &err), err);
            CHECK(memcmp(oa.moe_out, ob.moe_out, (size_t)(T * H) * sizeof(double)) == 0, "memory = directory");
            moe_block_out_free(&oa);
            moe_block_out_free(&ob);
            free(x);
        }
    }
    moe_model_free(a);
    moe_model_free(b);
    /* a missing shard of an in-memory index; a missing config */
    static const char idx[] = "{\"weight_map\": {\"layers.3.ffn.gate.weight\": \"gone.safetensors\"}}";
    moe_mem_file f2[2] = {{"config.json", cfg, nc}, {"model.safetensors.index.json", idx, sizeof idx - 1}};
    CHECK_OK(moe_model_open_mem("mem", f2, 2, &a, &err), err);
    if (a) {
        const moe_layer *L = NULL;
        moe_status st = moe_model_layer(a, 3, &L, &err);
        CHECK(st == MOE_ERR_IO && strstr(err.msg, "mem/gone.safetensors: cannot open"), "%s", err.msg);
        moe_model_free(a);
    }
    CHECK(moe_model_open_mem("mem", f2 + 1, 1, &a, &err) == MOE_ERR_IO && strstr(err.msg, "mem/config.json"), "%s",
          err.msg);
    free(cfg);
    free(st_bytes);
}

/* An index naming many shards is sorted, not scanned per entry: shards keep
 * the order of first mention. */
static void test_index_order(void) {
    size_t cap = 1 << 22;
    char *idx = malloc(cap);
    size_t o = (size_t)snprintf(idx, cap, "{\"weight_map\": {");
    int n = 20000;
    for (int i = 0; i < n; i++)
        o += (size_t)snprintf(idx + o, cap - o, "%s\"t%d\": \"s%05d.safetensors\"", i ? ", " : "", i, (n - i) % 5000);
    o += (size_t)snprintf(idx + o, cap - o, "}}");
    moe_mem_file f = {"model.safetensors.index.json", idx, o};
    moe_ckpt *c = NULL;
    moe_error err;
    CHECK_OK(moe_ckpt_open_mem("big-index", &f, 1, &c, &err), err);
    if (c) {
        CHECK(moe_ckpt_n_shards(c) == 5000, "shards %zu", moe_ckpt_n_shards(c));
        CHECK(strcmp(moe_ckpt_shard_file(c, 0), "s00000.safetensors") == 0 &&
                  strcmp(moe_ckpt_shard_file(c, 1), "s04999.safetensors") == 0, "first mention order: %s %s",
              moe_ckpt_shard_file(c, 0), moe_ckpt_shard_file(c, 1));
        moe_ckpt_free(c);
    }
    free(idx);
}

/* The readers behind run --input and needle --tensors. */
static void test_input_readers(void) {
    char path[600];
    moe_t_tmp_path(path, sizeof path, "input.safetensors");
    float h[12] = {1, 2, 3, 4, 5, 6, NAN, 8, 9, 10, 11, 12};
    int32_t ids[3] = {1, 2, 3};
    moe_st_entry e[2] = {{.name = "hidden", .dtype = MOE_DTYPE_F32, .ndim = 2, .shape = {3, 4}, .data = h},
                         {.name = "input_ids", .dtype = MOE_DTYPE_I32, .ndim = 1, .shape = {3}, .data = ids}};
    moe_error err;
    CHECK_OK(moe_st_write(path, e, 2, NULL, &err), err);
    moe_st_file *f = NULL;
    CHECK_OK(moe_st_open(path, &f, &err), err);
    if (!f) return;
    moe_block_input in;
    CHECK_OK(moe_block_input_read(f, "hidden", "input_ids", 4, &in, &err), err);
    CHECK(in.T == 3 && in.ids && in.ids[2] == 3 && in.hidden[5] == 6 && in.n_nonfinite == 1 && in.first_nonfinite == 1,
          "input T %lld", (long long)in.T);
    moe_block_input_free(&in);
    moe_status st = moe_block_input_read(f, "hidden", "input_ids", 5, &in, &err);
    CHECK(st == MOE_ERR_SHAPE && strstr(err.msg, "has shape [3, 4]; expected [*, 5]"), "%s", err.msg);
    st = moe_block_input_read(f, "input_ids", NULL, 4, &in, &err);
    CHECK(st == MOE_ERR_DTYPE, "%s", err.msg);
    moe_idx_tensors it;
    st = moe_idx_tensors_read(f, 4, &it, &err);
    CHECK(st == MOE_ERR_MISSING && strstr(err.msg, "no tensor \"q\""), "%s", err.msg);
    moe_st_close(f);
    /* needle tensors without pos, ratio huge: the default positions overflow */
    double q[2 * 1 * 4] = {1, 0, 0, 0, 0, 1, 0, 0}, k[3 * 4] = {1, 0, 0, 0, 0, 1, 0, 0, 0, 0, 1, 0}, w[2] = {1, 1};
    moe_st_entry ne[3] = {{.name = "q", .dtype = MOE_DTYPE_F64, .ndim = 3, .shape = {2, 1, 4}, .data = q},
                          {.name = "k", .dtype = MOE_DTYPE_F64, .ndim = 2, .shape = {3, 4}, .data = k},
                          {.name = "w", .dtype = MOE_DTYPE_F64, .ndim = 2, .shape = {2, 1}, .data = w}};
    CHECK_OK(moe_st_write(path, ne, 3, NULL, &err), err);
    CHECK_OK(moe_st_open(path, &f, &err), err);
    if (!f) return;
    CHECK_OK(moe_idx_tensors_read(f, 4, &it, &err), err);
    CHECK(it.sh.T == 2 && it.sh.S == 3 && it.sh.heads == 1 && it.sh.dim == 4 && it.pos[0] == 10 && it.pos[1] == 11,
          "needle tensors");
    moe_idx_tensors_free(&it);
    st = moe_idx_tensors_read(f, INT32_MAX, &it, &err);
    CHECK(st == MOE_OK && it.pos[1] == 3LL * INT32_MAX - 1, "ratio INT32_MAX: %s", err.msg);
    moe_idx_tensors_free(&it);
    moe_st_close(f);
}

int main(void) {
    signal(SIGPIPE, SIG_IGN);
    RUN(test_err_fit);
    RUN(test_long_path);
    RUN(test_not_regular);
    RUN(test_probe_keeps_errors);
    RUN(test_config_limits);
    RUN(test_planted_symlink);
    RUN(test_out_file);
    RUN(test_stream);
    RUN(test_mem_checkpoint);
    RUN(test_index_order);
    RUN(test_input_readers);
    return moe_t_finish();
}
