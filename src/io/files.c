/*
 * Untrusted files, opened safely (io/files.h).
 */
#include "io/files.h"
#include "core/core.h"

#include <errno.h>
#include <fcntl.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

const char *moe_io_kind(mode_t mode) {
    if (S_ISREG(mode)) return "a regular file";
    if (S_ISDIR(mode)) return "a directory";
    if (S_ISFIFO(mode)) return "a named pipe (FIFO)";
    if (S_ISCHR(mode)) return "a character device";
    if (S_ISBLK(mode)) return "a block device";
    if (S_ISSOCK(mode)) return "a socket";
    if (S_ISLNK(mode)) return "a symbolic link";
    return "a special file";
}

/* "path" or "path (what)" for messages: [cap]. */
static const char *label(const char *path, const char *what, char *buf, size_t cap) {
    if (!what) return path;
    /* no fixed buffer may cut the path: the caller's buffer fits both */
    snprintf(buf, cap, "%s (%s)", path, what);
    return buf;
}

moe_status moe_io_open_regular(const char *path, const char *what, int *fd, uint64_t *size, moe_error *err) {
    MOE_ASSERT(path && fd && size);
    size_t lc = strlen(path) + (what ? strlen(what) : 0) + 4;
    char *lb = malloc(lc);
    const char *lab = lb ? label(path, what, lb, lc) : path;
    moe_status st = MOE_OK;
    /* O_NONBLOCK: opening a FIFO for reading would otherwise wait for a
     * writer forever; O_NOCTTY: a terminal device never becomes ours. */
    int d = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | O_NOCTTY);
    struct stat sb;
    if (d < 0) {
        st = moe_errf(err, MOE_ERR_IO, "%s: cannot open: %s", lab, strerror(errno));
    } else if (fstat(d, &sb) != 0) {
        st = moe_errf(err, MOE_ERR_IO, "%s: cannot stat: %s", lab, strerror(errno));
    } else if (!S_ISREG(sb.st_mode)) {
        st = moe_errf(err, MOE_ERR_IO, "%s: is %s, not a regular file: refusing to read it", lab,
                      moe_io_kind(sb.st_mode));
    } else {
        int fl = fcntl(d, F_GETFL);
        if (fl < 0 || fcntl(d, F_SETFL, fl & ~O_NONBLOCK) != 0)
            st = moe_errf(err, MOE_ERR_IO, "%s: fcntl: %s", lab, strerror(errno));
    }
    free(lb);
    if (st != MOE_OK) {
        if (d >= 0) close(d);
        return st;
    }
    *fd = d;
    *size = sb.st_size > 0 ? (uint64_t)sb.st_size : 0;
    return MOE_OK;
}

moe_status moe_io_read_file(const char *path, const char *what, size_t max, char **out, size_t *len,
                            moe_error *err) {
    MOE_ASSERT(path && out && len && max < SIZE_MAX / 2);
    int fd = -1;
    uint64_t size = 0;
    moe_status st = moe_io_open_regular(path, what, &fd, &size, err);
    if (st != MOE_OK) return st;
    if (size > max) {
        close(fd);
        return moe_errf(err, MOE_ERR_FORMAT, "%s: %llu bytes exceed the limit of %zu bytes for %s", path,
                        (unsigned long long)size, max, what ? what : "this file");
    }
    /* one spare byte for the NUL and one to see a file that grew past max */
    size_t cap = (size_t)size + 2, n = 0;
    char *buf = malloc(cap);
    if (!buf) st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory for %zu bytes", path, cap);
    while (st == MOE_OK) {
        if (n == cap - 1) { /* full: grow, unless past max already */
            if (n > max) break;
            size_t nc = cap - 1 > max / 2 ? max + 2 : 2 * cap;
            char *nb = realloc(buf, nc);
            if (!nb) { st = moe_errf(err, MOE_ERR_NOMEM, "%s: out of memory for %zu bytes", path, nc); break; }
            buf = nb;
            cap = nc;
        }
        ssize_t r = read(fd, buf + n, cap - 1 - n);
        if (r < 0 && errno == EINTR) continue;
        if (r < 0) st = moe_errf(err, MOE_ERR_IO, "%s: read failed: %s", path, strerror(errno));
        if (r <= 0) break;
        n += (size_t)r;
    }
    close(fd);
    if (st == MOE_OK && n > max)
        st = moe_errf(err, MOE_ERR_FORMAT, "%s: grew past the limit of %zu bytes for %s while being read", path,
                      max, what ? what : "this file");
    if (st != MOE_OK) {
        free(buf);
        return st;
    }
    buf[n] = '\0';
    *out = buf;
    *len = n;
    return MOE_OK;
}
