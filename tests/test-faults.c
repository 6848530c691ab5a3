/* Fault injection into the writers (issue #12, scope 4): a full disk, a
 * failing fsync, close or rename, a directory that takes no new file, at
 * every call where each can happen. After each failure: the destination
 * holds its old bytes (or does not exist), no temporary or partial file is
 * left, and the error names the cause.
 *
 * The system calls are wrapped at link time (CMakeLists.txt links this test
 * with -Wl,--wrap=write,--wrap=pwrite,--wrap=fsync,--wrap=close,--wrap=rename,
 * --wrap=open),
 * so the library's own calls fail as the kernel's would. Two real kernel
 * failures are added: RLIMIT_FSIZE (EFBIG past a size, as a quota), and, when
 * this process may mount, a full tmpfs of 64 KiB and a read-only tmpfs (the
 * test says when it skips those). */
#include "harness.h"

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdarg.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <unistd.h>

/* ------------------------------------------------------------- the wraps */

typedef enum { F_WRITE, F_FSYNC, F_CLOSE, F_RENAME, F_CREATE, F_N } fault_kind;
static const char *const fault_names[F_N] = {"write", "fsync", "close", "rename", "open(O_CREAT)"};
static int fault_at[F_N];   /* fail the Nth call (1-based); 0: never */
static int fault_errno[F_N];
static int calls[F_N];

static void faults_reset(void) {
    memset(fault_at, 0, sizeof fault_at);
    memset(calls, 0, sizeof calls);
}

static bool hit(fault_kind k) {
    calls[k]++;
    if (fault_at[k] && calls[k] == fault_at[k]) {
        errno = fault_errno[k];
        return true;
    }
    return false;
}

ssize_t __real_write(int fd, const void *p, size_t n);
ssize_t __real_pwrite(int fd, const void *p, size_t n, off_t o);
int __real_fsync(int fd);
int __real_close(int fd);
int __real_rename(const char *a, const char *b);
int __real_open(const char *path, int flags, ...);

ssize_t __wrap_write(int fd, const void *p, size_t n);
ssize_t __wrap_pwrite(int fd, const void *p, size_t n, off_t o);
int __wrap_fsync(int fd);
int __wrap_close(int fd);
int __wrap_rename(const char *a, const char *b);
int __wrap_open(const char *path, int flags, ...);

/* Descriptors of files the writers created (open with O_CREAT): only calls
 * on those count, so that a fault always hits a step that matters. */
static bool created[4096];
static bool ours(int fd) { return fd >= 0 && fd < 4096 && created[fd]; }

ssize_t __wrap_write(int fd, const void *p, size_t n) {
    if (ours(fd) && hit(F_WRITE)) return -1;
    /* a short write, every third call: the writer must loop */
    if (ours(fd) && n > 1 && calls[F_WRITE] % 3 == 0) n = n / 2;
    return __real_write(fd, p, n);
}
ssize_t __wrap_pwrite(int fd, const void *p, size_t n, off_t o) {
    if (ours(fd) && hit(F_WRITE)) return -1;
    if (ours(fd) && n > 1 && calls[F_WRITE] % 3 == 0) n = n / 2;
    return __real_pwrite(fd, p, n, o);
}
int __wrap_fsync(int fd) { return ours(fd) && hit(F_FSYNC) ? -1 : __real_fsync(fd); }
int __wrap_close(int fd) {
    bool mine = ours(fd);
    if (mine) created[fd] = false;
    if (mine && hit(F_CLOSE)) {
        __real_close(fd); /* Linux: the descriptor is released even when close fails */
        errno = fault_errno[F_CLOSE];
        return -1;
    }
    return __real_close(fd);
}
int __wrap_rename(const char *a, const char *b) { return hit(F_RENAME) ? -1 : __real_rename(a, b); }
int __wrap_open(const char *path, int flags, ...) {
    mode_t mode = 0;
    if (flags & O_CREAT) {
        va_list ap;
        va_start(ap, flags);
        mode = (mode_t)va_arg(ap, int);
        va_end(ap);
        if (hit(F_CREATE)) return -1;
    }
    int fd = __real_open(path, flags, mode);
    if ((flags & O_CREAT) && fd >= 0 && fd < 4096) created[fd] = true;
    return fd;
}

/* ------------------------------------------------------------- checks */

static char *read_all(const char *path, size_t *n) {
    struct stat sb;
    if (stat(path, &sb) != 0) return NULL;
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    char *b = malloc((size_t)sb.st_size + 1);
    *n = fread(b, 1, (size_t)sb.st_size, f);
    fclose(f);
    return b;
}

/* The destination has exactly old [n_old] (NULL: does not exist) and dir
 * has no temporary file. */
static void expect_intact(const char *what, const char *dir, const char *path, const char *old, size_t n_old) {
    size_t n = 0;
    char *now = read_all(path, &n);
    if (old)
        CHECK(now && n == n_old && memcmp(now, old, n) == 0, "%s: the existing file was damaged (%zu -> %zu bytes)",
              what, n_old, now ? n : 0);
    else
        CHECK(now == NULL, "%s: a file appeared at the destination", what);
    free(now);
    CHECK(moe_t_count_temps(dir) == 0, "%s: %d temporary files left behind", what, moe_t_count_temps(dir));
}

/* A file of three tensors, ~100 KiB, and its bytes. */
static float big[3][8192];
static moe_st_entry entries[3];
static void make_entries(float salt) {
    static const char *const names[3] = {"a", "b", "c"};
    for (int t = 0; t < 3; t++) {
        for (int i = 0; i < 8192; i++) big[t][i] = salt + (float)(t * 8192 + i);
        entries[t] = (moe_st_entry){.name = names[t], .dtype = MOE_DTYPE_F32, .ndim = 2, .shape = {64, 128},
                                    .data = big[t]};
    }
}

typedef moe_status (*writer_fn)(const char *path, moe_error *err);

static moe_status w_safetensors(const char *path, moe_error *err) { return moe_st_write(path, entries, 3, NULL, err); }

static moe_status w_stream(const char *path, moe_error *err) {
    moe_st_stream *s = NULL;
    moe_status st = moe_st_stream_open(path, entries, 3, NULL, &s, err);
    for (int t = 2; st == MOE_OK && t >= 0; t--) /* out of order, in pieces */
        for (int piece = 0; st == MOE_OK && piece < 4; piece++)
            st = moe_st_stream_put(s, (size_t)t, (uint64_t)piece * 2048 * sizeof(float), big[t] + piece * 2048,
                                   2048 * sizeof(float), err);
    if (st == MOE_OK) return moe_st_stream_finish(s, err);
    moe_st_stream_abort(s);
    return st;
}

static moe_status w_report(const char *path, moe_error *err) {
    moe_out_file *f = NULL;
    moe_status st = moe_out_open(path, &f, err);
    if (st != MOE_OK) return st;
    FILE *s = moe_out_stream(f);
    for (int i = 0; s && i < 20000; i++) fprintf(s, "row %d: %.6f\n", i, big[0][i % 8192]);
    return moe_out_commit(f, err);
}

/* Every fault kind at every call the writer makes: the first fault-free run
 * counts them. */
static void sweep(const char *name, writer_fn fn) {
    char dir[600], path[700];
    snprintf(dir, sizeof dir, "%s/%s", moe_t_tmpdir(), name);
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/out.bin", dir);
    moe_error err;
    make_entries(1.0f);
    faults_reset();
    CHECK_OK(fn(path, &err), err); /* the old file */
    size_t n_old = 0;
    char *old = read_all(path, &n_old);
    int total[F_N];
    make_entries(2.0f);
    faults_reset();
    moe_status st = fn(path, &err); /* counting run, with new content */
    CHECK_OK(st, err);
    memcpy(total, calls, sizeof total);
    CHECK(total[F_WRITE] >= 1 && total[F_FSYNC] >= 1 && total[F_RENAME] == 1 && total[F_CREATE] >= 1,
          "%s: calls write %d fsync %d rename %d create %d", name, total[F_WRITE], total[F_FSYNC], total[F_RENAME],
          total[F_CREATE]);
    /* put the old file back for the failure runs */
    make_entries(1.0f);
    faults_reset();
    CHECK_OK(fn(path, &err), err);
    make_entries(3.0f);
    static const int errs[F_N] = {ENOSPC, EIO, EIO, EXDEV, EROFS};
    int runs = 0;
    for (int k = 0; k < F_N; k++) {
        for (int at = 1; at <= total[k]; at++) {
            faults_reset();
            fault_at[k] = at;
            fault_errno[k] = errs[k];
            memset(&err, 0, sizeof err);
            st = fn(path, &err);
            char what[96];
            snprintf(what, sizeof what, "%s: %s fails at call %d", name, fault_names[k], at);
            CHECK(st == MOE_ERR_IO, "%s: status %s", what, moe_status_str(st));
            CHECK(strstr(err.msg, strerror(errs[k])) && strstr(err.msg, "out.bin"), "%s: message %s", what, err.msg);
            expect_intact(what, dir, path, old, n_old);
            runs++;
        }
    }
    fprintf(stderr, "  %s: %d injected failures (write x%d, fsync x%d, close x%d, rename x%d, create x%d)\n", name,
            runs, total[F_WRITE], total[F_FSYNC], total[F_CLOSE], total[F_RENAME], total[F_CREATE]);
    /* a fresh destination: nothing appears */
    snprintf(path, sizeof path, "%s/fresh.bin", dir);
    faults_reset();
    fault_at[F_WRITE] = total[F_WRITE]; /* the last write */
    fault_errno[F_WRITE] = ENOSPC;
    st = fn(path, &err);
    CHECK(st == MOE_ERR_IO, "fresh: %s", moe_status_str(st));
    expect_intact("fresh destination, disk full", dir, path, NULL, 0);
    faults_reset();
    free(old);
}

static void test_injected(void) {
    sweep("safetensors", w_safetensors);
    sweep("stream", w_stream);
    sweep("report", w_report);
}

/* quantize: a failure at any write leaves out_dir as it was (absent here). */
static void test_quantize_faults(void) {
    moe_quant_opts o = {MOE_Q_FP8, MOE_Q_NONE, 0, 0};
    moe_quant_report rep;
    moe_error err;
    char out[600];
    moe_t_tmp_path(out, sizeof out, "q-count");
    faults_reset();
    CHECK_OK(moe_quantize_checkpoint(moe_t_data("dsv3-tiny"), out, &o, &rep, &err), err);
    int total = calls[F_WRITE], renames = calls[F_RENAME];
    for (int at = 1; at <= total + renames; at++) {
        moe_t_tmp_path(out, sizeof out, "q-fault");
        faults_reset();
        if (at <= total) { fault_at[F_WRITE] = at; fault_errno[F_WRITE] = ENOSPC; }
        else { fault_at[F_RENAME] = at - total; fault_errno[F_RENAME] = EIO; }
        moe_status st = moe_quantize_checkpoint(moe_t_data("dsv3-tiny"), out, &o, &rep, &err);
        CHECK(st == MOE_ERR_IO, "quantize with call %d failing: %s", at, moe_status_str(st));
        struct stat sb;
        CHECK(stat(out, &sb) != 0, "quantize failure %d left %s", at, out);
        CHECK(moe_t_count_temps(moe_t_tmpdir()) == 0, "quantize failure %d left staging", at);
    }
    faults_reset();
    fprintf(stderr, "  quantize: %d injected failures\n", total + renames);
}

/* The kernel's own EFBIG: a file-size limit below the new file's size. */
static void test_rlimit_fsize(void) {
    char dir[600], path[700];
    snprintf(dir, sizeof dir, "%s/rlimit", moe_t_tmpdir());
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/out.bin", dir);
    moe_error err;
    make_entries(1.0f);
    CHECK_OK(w_safetensors(path, &err), err);
    size_t n_old = 0;
    char *old = read_all(path, &n_old);
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit was, lim;
    getrlimit(RLIMIT_FSIZE, &was);
    lim = was;
    lim.rlim_cur = 50000; /* the file is ~98 KiB */
    CHECK(setrlimit(RLIMIT_FSIZE, &lim) == 0, "setrlimit");
    make_entries(5.0f);
    moe_status st = w_safetensors(path, &err);
    moe_status st2 = w_report(path, &err);
    setrlimit(RLIMIT_FSIZE, &was);
    CHECK(st == MOE_ERR_IO && st2 == MOE_ERR_IO && strstr(err.msg, strerror(EFBIG)), "EFBIG: %s", err.msg);
    expect_intact("RLIMIT_FSIZE", dir, path, old, n_old);
    free(old);
}

/* Real full and read-only file systems, where this process may mount. */
static void test_tmpfs(void) {
    char mnt[600], path[700];
    snprintf(mnt, sizeof mnt, "%s/small-fs", moe_t_tmpdir());
    mkdir(mnt, 0755);
    if (mount("tmpfs", mnt, "tmpfs", 0, "size=64k") != 0) {
        fprintf(stderr, "  skipped: cannot mount a tmpfs here (%s): the full-disk case ran by injection only\n",
                strerror(errno));
        return;
    }
    snprintf(path, sizeof path, "%s/out.bin", mnt);
    moe_error err;
    /* a small old file, then a new one too large for the 64 KiB */
    float small[16] = {1, 2, 3};
    moe_st_entry e = {.name = "s", .dtype = MOE_DTYPE_F32, .ndim = 1, .shape = {16}, .data = small};
    CHECK_OK(moe_st_write(path, &e, 1, NULL, &err), err);
    size_t n_old = 0;
    char *old = read_all(path, &n_old);
    make_entries(7.0f);
    moe_status st = w_safetensors(path, &err);
    CHECK(st == MOE_ERR_IO && strstr(err.msg, strerror(ENOSPC)), "full tmpfs: %s", err.msg);
    expect_intact("full tmpfs", mnt, path, old, n_old);
    st = w_stream(path, &err);
    CHECK(st == MOE_ERR_IO && strstr(err.msg, strerror(ENOSPC)), "full tmpfs, stream: %s", err.msg);
    expect_intact("full tmpfs, stream", mnt, path, old, n_old);
    /* read-only: remount */
    if (mount("tmpfs", mnt, "tmpfs", MS_REMOUNT | MS_RDONLY, "size=64k") == 0) {
        st = moe_st_write(path, &e, 1, NULL, &err);
        CHECK(st == MOE_ERR_IO && strstr(err.msg, strerror(EROFS)), "read-only: %s", err.msg);
        expect_intact("read-only tmpfs", mnt, path, old, n_old);
    } else {
        fprintf(stderr, "  skipped: read-only remount failed (%s)\n", strerror(errno));
    }
    free(old);
    umount(mnt);
}

/* A read-only directory by permissions (root bypasses them: skipped). */
static void test_readonly_dir(void) {
    if (geteuid() == 0) {
        fprintf(stderr, "  skipped: running as root, permissions do not stop writes (the read-only tmpfs and the "
                        "injected EROFS cover it)\n");
        return;
    }
    char dir[600], path[700];
    snprintf(dir, sizeof dir, "%s/ro", moe_t_tmpdir());
    mkdir(dir, 0755);
    snprintf(path, sizeof path, "%s/out.bin", dir);
    moe_error err;
    make_entries(1.0f);
    CHECK_OK(w_safetensors(path, &err), err);
    size_t n_old = 0;
    char *old = read_all(path, &n_old);
    chmod(dir, 0555);
    make_entries(2.0f);
    moe_status st = w_safetensors(path, &err);
    chmod(dir, 0755);
    CHECK(st == MOE_ERR_IO && strstr(err.msg, strerror(EACCES)), "read-only dir: %s", err.msg);
    expect_intact("read-only directory", dir, path, old, n_old);
    free(old);
}

int main(void) {
    RUN(test_injected);
    RUN(test_quantize_faults);
    RUN(test_rlimit_fsize);
    RUN(test_tmpfs);
    RUN(test_readonly_dir);
    return moe_t_finish();
}
