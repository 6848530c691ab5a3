/*
 * The atomic writer (moeaudit.h, "output files"): every output of the
 * library and the CLI.
 *
 * Invariants:
 *  1. Bytes only ever go to a file this handle created: open(O_CREAT |
 *     O_EXCL | O_NOFOLLOW) of a fresh random name in the destination's
 *     directory. A planted symlink or file at that name makes the open fail
 *     (EEXIST) and another name is drawn; nothing is followed.
 *  2. The destination changes once, by rename(2), after the data is on disk
 *     (fsync). Before that it holds its old bytes; rename replaces a
 *     symlink at the destination itself, never its target.
 *  3. On every failure path the temporary file is unlinked before the call
 *     returns: no partial file is left behind.
 *  4. The temporary name starts with '.' and has ".tmp." in it: the
 *     checkpoint scanner skips hidden files, and .gitignore matches it.
 */
#include "core/core.h"
#include "io/files.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

struct moe_out_file {
    char *path;    /* destination */
    char *tmp;     /* the temporary file, in the destination's directory */
    char *dir;     /* that directory (fsync after rename) */
    int fd;
    moe_status failed; /* first failure of a write, MOE_OK while none */
    char *mem;     /* memory stream (moe_out_stream) */
    size_t mem_len;
    FILE *stream;
};

/* 64 unpredictable bits: /dev/urandom, else the clock, pid, a stack address
 * and the attempt mixed (O_EXCL keeps a guessed name harmless either way:
 * invariant 1). */
static uint64_t out_random(int attempt) {
    uint64_t v = 0;
    int fd = open("/dev/urandom", O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t r = read(fd, &v, sizeof v);
        close(fd);
        if (r == (ssize_t)sizeof v) return v;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    uint64_t s = (uint64_t)ts.tv_nsec ^ ((uint64_t)ts.tv_sec << 30) ^ ((uint64_t)getpid() << 16) ^
                 (uint64_t)(uintptr_t)&v ^ ((uint64_t)attempt << 56);
    return moe_splitmix64(&s);
}

static void out_free(moe_out_file *f) {
    if (f->stream) fclose(f->stream);
    free(f->mem);
    free(f->path);
    free(f->tmp);
    free(f->dir);
    free(f);
}

const char *moe_out_path(const moe_out_file *f) {
    MOE_ASSERT(f);
    return f->path;
}

moe_status moe_out_open(const char *path, moe_out_file **out, moe_error *err) {
    MOE_ASSERT(path && out);
    if (!path[0]) return moe_errf(err, MOE_ERR_ARG, "an output path is empty");
    size_t pl = strlen(path);
    if (path[pl - 1] == '/') return moe_errf(err, MOE_ERR_ARG, "%s: an output file name cannot end in '/'", path);
    struct stat sb, tb;
    bool exists = lstat(path, &sb) == 0;
    if (exists && !S_ISREG(sb.st_mode) && !S_ISLNK(sb.st_mode))
        return moe_errf(err, MOE_ERR_ARG, "%s: is %s, not a regular file: refusing to replace it", path,
                        moe_io_kind(sb.st_mode));
    if (exists && S_ISLNK(sb.st_mode) && stat(path, &tb) == 0 && S_ISDIR(tb.st_mode))
        return moe_errf(err, MOE_ERR_ARG, "%s: is a symbolic link to a directory: refusing to replace it", path);
    moe_out_file *f = calloc(1, sizeof *f);
    if (!f) return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", path);
    f->fd = -1;
    const char *slash = strrchr(path, '/');
    const char *base = slash ? slash + 1 : path;
    size_t dl = slash ? (size_t)(slash - path) : 1;
    f->path = malloc(pl + 1);
    f->dir = malloc(dl + 2);
    /* ".<base>.tmp.<16 hex>": the base cut to 200 bytes keeps the name under NAME_MAX */
    size_t bl = strlen(base) > 200 ? 200 : strlen(base);
    f->tmp = malloc(dl + 1 + 1 + bl + 5 + 16 + 1);
    if (!f->path || !f->dir || !f->tmp) {
        out_free(f);
        return moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory", path);
    }
    memcpy(f->path, path, pl + 1);
    if (slash) {
        memcpy(f->dir, path, dl);
        if (dl == 0) f->dir[dl++] = '/'; /* "/name" */
        f->dir[dl] = '\0';
    } else {
        strcpy(f->dir, ".");
    }
    int e = 0;
    for (int attempt = 0; attempt < 32; attempt++) {
        size_t o = 0;
        if (slash) {
            memcpy(f->tmp, path, (size_t)(slash - path) + 1);
            o = (size_t)(slash - path) + 1;
        }
        f->tmp[o++] = '.';
        memcpy(f->tmp + o, base, bl);
        o += bl;
        snprintf(f->tmp + o, 5 + 16 + 1, ".tmp.%016llx", (unsigned long long)out_random(attempt));
        f->fd = open(f->tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC | O_NOCTTY, 0666);
        if (f->fd >= 0) break;
        e = errno;
        if (e != EEXIST) break;
    }
    if (f->fd < 0) {
        moe_status st = moe_errf(err, MOE_ERR_IO, "%s: cannot create a file in %s: %s (nothing was written)", path,
                                 f->dir, strerror(e));
        out_free(f);
        return st;
    }
    /* a file that is replaced keeps its permissions (a private file stays
     * private); a new one gets 0666 minus the umask */
    if (exists && S_ISREG(sb.st_mode)) (void)fchmod(f->fd, sb.st_mode & 07777);
    *out = f;
    return MOE_OK;
}

static bool out_write_all(int fd, const void *p, size_t n, int *e) {
    const unsigned char *b = p;
    while (n > 0) {
        /* bounded chunks: Linux caps one write near 2 GiB */
        size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
        ssize_t w = write(fd, b, chunk);
        if (w < 0) {
            if (errno == EINTR) continue;
            *e = errno;
            return false;
        }
        if (w == 0) { *e = ENOSPC; return false; }
        b += w;
        n -= (size_t)w;
    }
    return true;
}

moe_status moe_out_write(moe_out_file *f, const void *data, size_t n, moe_error *err) {
    MOE_ASSERT(f && (data || n == 0));
    if (f->failed != MOE_OK)
        return moe_errf(err, f->failed, "%s: an earlier write failed (nothing will be written)", f->path);
    int e = 0;
    if (!out_write_all(f->fd, data, n, &e)) {
        f->failed = MOE_ERR_IO;
        return moe_errf(err, MOE_ERR_IO, "%s: write failed: %s (the file is not written)", f->path, strerror(e));
    }
    return MOE_OK;
}

moe_status moe_out_pwrite(moe_out_file *f, const void *data, size_t n, uint64_t offset, moe_error *err) {
    MOE_ASSERT(f && (data || n == 0));
    if (f->failed != MOE_OK)
        return moe_errf(err, f->failed, "%s: an earlier write failed (nothing will be written)", f->path);
    const unsigned char *b = data;
    while (n > 0) {
        size_t chunk = n > ((size_t)1 << 30) ? ((size_t)1 << 30) : n;
        if (offset > (uint64_t)INT64_MAX - chunk) {
            f->failed = MOE_ERR_ARG;
            return moe_errf(err, MOE_ERR_ARG, "%s: offset %llu is past what a file can hold", f->path,
                            (unsigned long long)offset);
        }
        ssize_t w = pwrite(f->fd, b, chunk, (off_t)offset);
        if (w < 0 && errno == EINTR) continue;
        if (w <= 0) {
            int e = w < 0 ? errno : ENOSPC;
            f->failed = MOE_ERR_IO;
            return moe_errf(err, MOE_ERR_IO, "%s: write failed: %s (the file is not written)", f->path, strerror(e));
        }
        b += w;
        n -= (size_t)w;
        offset += (uint64_t)w;
    }
    return MOE_OK;
}

FILE *moe_out_stream(moe_out_file *f) {
    MOE_ASSERT(f);
    if (!f->stream) {
        f->stream = open_memstream(&f->mem, &f->mem_len);
        if (!f->stream && f->failed == MOE_OK) f->failed = MOE_ERR_NOMEM;
    }
    return f->stream;
}

void moe_out_abort(moe_out_file *f) {
    if (!f) return;
    if (f->fd >= 0) close(f->fd);
    unlink(f->tmp);
    out_free(f);
}

moe_status moe_out_commit(moe_out_file *f, moe_error *err) {
    MOE_ASSERT(f);
    const char *what = NULL;
    int e = 0;
    moe_status st = MOE_OK;
    if (f->failed != MOE_OK) {
        st = moe_errf(err, f->failed, "%s: %s (the file is not written)", f->path,
                      f->failed == MOE_ERR_NOMEM ? "out of memory for the text stream" : "an earlier write failed");
        moe_out_abort(f);
        return st;
    }
    if (f->stream) {
        bool ok = fflush(f->stream) == 0 && !ferror(f->stream);
        fclose(f->stream); /* mem, mem_len now final */
        f->stream = NULL;
        if (!ok) { what = "format"; e = ENOMEM; }
        else if (!out_write_all(f->fd, f->mem, f->mem_len, &e)) what = "write";
    }
    if (!what && fsync(f->fd) != 0) { what = "fsync"; e = errno; }
    if (close(f->fd) != 0 && !what) { what = "close"; e = errno; }
    f->fd = -1;
    if (!what && rename(f->tmp, f->path) != 0) { what = "rename"; e = errno; }
    if (what) {
        st = moe_errf(err, MOE_ERR_IO, "%s: %s failed: %s (nothing was written: the file is as it was)", f->path, what,
                      strerror(e));
        moe_out_abort(f);
        return st;
    }
    /* the rename itself durable: fsync the directory (where the FS allows it) */
    int dfd = open(f->dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd >= 0) {
        (void)fsync(dfd);
        close(dfd);
    }
    out_free(f);
    return MOE_OK;
}

moe_status moe_write_file(const char *path, const void *data, size_t n, moe_error *err) {
    moe_out_file *f = NULL;
    moe_status st = moe_out_open(path, &f, err);
    if (st != MOE_OK) return st;
    st = moe_out_write(f, data, n, err);
    if (st != MOE_OK) {
        moe_out_abort(f);
        return st;
    }
    return moe_out_commit(f, err);
}

moe_status moe_out_check_inputs(const char *out, const char *const *inputs, size_t n, moe_error *err) {
    MOE_ASSERT(out && (inputs || n == 0));
    struct stat so, si;
    if (stat(out, &so) != 0) return MOE_OK; /* absent: cannot be an input */
    for (size_t i = 0; i < n; i++) {
        if (!inputs[i] || stat(inputs[i], &si) != 0) continue;
        if (so.st_dev == si.st_dev && so.st_ino == si.st_ino)
            return moe_errf(err, MOE_ERR_ARG, "output %s is the input %s: refusing to overwrite an input", out,
                            inputs[i]);
    }
    return MOE_OK;
}
