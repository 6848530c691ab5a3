/*
 * Untrusted files, opened safely (every room that reads a file a user or
 * another engine handed us goes through here).
 *
 * Rules, the same for every reader:
 *  1. The open never blocks: O_NONBLOCK, so a named pipe planted as
 *     config.json or model.safetensors cannot hang the open; a file that is
 *     not regular (FIFO, device, directory, socket) is refused by fstat
 *     before any read, with a message naming the path and what it is.
 *  2. Reads are bounded: a caller-chosen maximum, checked against the size
 *     and again while reading (a file that grows is still cut off).
 *  3. Messages name the path and the cause; moe_errf keeps both however long
 *     the path is.
 */
#ifndef MOE_IO_FILES_H
#define MOE_IO_FILES_H

#include "moeaudit.h"

#include <stdint.h>
#include <sys/types.h>

/* "a directory", "a named pipe (FIFO)", "a character device", "a block
 * device", "a socket", "a symbolic link", "a regular file" or "a special
 * file": what a stat mode describes, for messages. */
const char *moe_io_kind(mode_t mode);

/* Open `path` read-only as rule 1 says. On MOE_OK *fd is an open descriptor
 * (blocking mode, close-on-exec; the caller closes it) and *size the file's
 * size. MOE_ERR_IO when it cannot be opened or is not a regular file; *fd
 * untouched on failure. `what` (may be NULL) names the file's role in
 * messages ("config.json", "the placement file"). */
moe_status moe_io_open_regular(const char *path, const char *what, int *fd, uint64_t *size, moe_error *err);

/* The whole regular file `path` into a new NUL-terminated buffer *out (caller
 * frees; *len bytes before the NUL). More than `max` bytes: MOE_ERR_FORMAT
 * naming the limit. MOE_ERR_IO (open, not regular, read), MOE_ERR_NOMEM.
 * Outputs untouched on failure. */
moe_status moe_io_read_file(const char *path, const char *what, size_t max, char **out, size_t *len,
                            moe_error *err);

#endif
