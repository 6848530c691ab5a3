/*
 * Names from files (tensor names, shard names, metadata keys) as they appear
 * in error messages: control bytes escaped as \xNN, at most `cap` - 1 bytes,
 * long names cut with "..." so that the rest of the message survives.
 */
#ifndef MOE_IO_QUOTE_H
#define MOE_IO_QUOTE_H

#include <stddef.h>
#include <stdio.h>

/* buf: [cap], cap >= 8. Returns buf. */
static inline const char *moe_io_quote(const char *s, char *buf, size_t cap) {
    size_t o = 0;
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        size_t need = (c < 0x20 || c == 0x7f) ? 4 : 1;
        if (o + need + 4 > cap) { /* keep room for "..." and NUL */
            buf[o++] = '.'; buf[o++] = '.'; buf[o++] = '.';
            break;
        }
        if (need == 4) {
            snprintf(buf + o, 5, "\\x%02x", c);
            o += 4;
        } else {
            buf[o++] = (char)c;
        }
    }
    buf[o] = '\0';
    return buf;
}

#endif
