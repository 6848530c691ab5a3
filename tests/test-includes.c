/*
 * The include rule of docs/architecture.md, checked on every source file of
 * the tree (src/, tools/, bench/, fuzz/):
 *
 *   1. A room of src/ includes the public headers (include/), its own files,
 *      and the non-private headers of rooms on LOWER floors (the table
 *      below, the same as the document's). core/core.h is floor 0.
 *   2. No room includes another room's private header (*_internal.h,
 *      *_internal.cuh, *_impl.h).
 *   3. The CLI (tools/) and the fuzzers (fuzz/) see include/ only, and
 *      their own headers (fuzz/fuzz.h: the shared in-memory fixtures);
 *      tools/ also bench/bench.h. bench/ sees include/, its
 *      own files and the rooms' non-private headers (not tools/).
 *   4. Every quoted include names a file of the tree; every room of src/
 *      has a floor.
 *
 * The checker first runs on a small tree written here with one breach of
 * each kind and must find exactly those (so this test can fail), then on the
 * real tree, where it must find none.
 */
#define _XOPEN_SOURCE 700 /* realpath */
#include "harness.h"

#include <dirent.h>
#include <limits.h>
#include <sys/stat.h>
#include <unistd.h>

/* The floors (docs/architecture.md, "Rooms and floors"). A room includes
 * only rooms on lower floors. attn, model and bisect are the rooms the
 * whole-model work adds (attention stage, model driver, bisect driver);
 * patch holds the table of precision patches that stages read. */
static const struct {
    const char *room;
    int floor;
} floors[] = {
    {"core", 0},   {"formats", 1}, {"patch", 2},  {"io", 2},     {"cpu", 2},   {"linalg", 3}, {"router", 3},
    {"hc", 3},     {"indexer", 3}, {"attn", 4},   {"experts", 4}, {"block", 5}, {"mpi", 5},
    {"cuda", 5},   {"model", 5},   {"audit", 6},  {"bisect", 6},
};

static int floor_of(const char *room) {
    for (size_t i = 0; i < sizeof floors / sizeof floors[0]; i++)
        if (!strcmp(floors[i].room, room)) return floors[i].floor;
    return -1;
}

typedef struct scan {
    char root[PATH_MAX];
    int breaches, files, includes;
    char first[4096]; /* the breaches found, one per line (truncated) */
} scan;

static void breach(scan *s, const char *file, int line, const char *fmt, const char *a, const char *b) {
    char what[6144], msg[sizeof what + PATH_MAX + 32];
    snprintf(what, sizeof what, fmt, a, b);
    snprintf(msg, sizeof msg, "%s:%d: %s\n", file + strlen(s->root) + 1, line, what);
    size_t used = strlen(s->first);
    if (used + strlen(msg) < sizeof s->first) strcat(s->first, msg);
    s->breaches++;
}

static bool ends_with(const char *s, const char *suffix) {
    size_t n = strlen(s), m = strlen(suffix);
    return n >= m && !strcmp(s + n - m, suffix);
}

static bool is_private(const char *path) {
    return ends_with(path, "_internal.h") || ends_with(path, "_internal.cuh") || ends_with(path, "_impl.h");
}

/* The part of `path` (absolute, normalised) under root: "src/cpu/x.c". */
static const char *rel(const scan *s, const char *path) {
    size_t n = strlen(s->root);
    return !strncmp(path, s->root, n) && path[n] == '/' ? path + n + 1 : NULL;
}

/* The room of a path under src/ ("src/cpu/avx512/x.c" -> "cpu"), or "". */
static void room_of(const char *r, char *room, size_t cap) {
    room[0] = 0;
    if (strncmp(r, "src/", 4)) return;
    const char *a = r + 4, *b = strchr(a, '/');
    if (!b) return;
    snprintf(room, cap, "%.*s", (int)(b - a), a);
}

/* Resolve a quoted include as the build does: the including file's folder,
 * then include/, src/, bench/, tools/. out: the normalised absolute path. */
static bool resolve(const scan *s, const char *file, const char *name, char *out) {
    char dir[PATH_MAX], cand[PATH_MAX * 2];
    snprintf(dir, sizeof dir, "%s", file);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = 0;
    const char *bases[] = {dir, "include", "src", "bench", "tools"};
    for (int i = 0; i < 5; i++) {
        if (i == 0) snprintf(cand, sizeof cand, "%s/%s", dir, name);
        else snprintf(cand, sizeof cand, "%s/%s/%s", s->root, bases[i], name);
        if (realpath(cand, out)) return true;
    }
    return false;
}

static void check_include(scan *s, const char *file, int line, const char *name) {
    char target[PATH_MAX];
    s->includes++;
    if (!resolve(s, file, name, target)) {
        breach(s, file, line, "#include \"%s\" names no file of the tree%s", name, "");
        return;
    }
    const char *from = rel(s, file), *to = rel(s, target);
    if (!to) {
        breach(s, file, line, "#include \"%s\" leaves the tree%s", name, "");
        return;
    }
    if (!strncmp(to, "include/", 8)) return; /* the public headers: everyone's */
    char room[64], troom[64];
    room_of(from, room, sizeof room);
    room_of(to, troom, sizeof troom);
    if (!strncmp(from, "tools/", 6)) {
        if (!strncmp(to, "tools/", 6) || !strcmp(to, "bench/bench.h")) return;
        breach(s, file, line, "the CLI includes %s: tools/ sees include/ only (and bench/bench.h)%s", to, "");
        return;
    }
    if (!strncmp(from, "fuzz/", 5)) {
        if (!strncmp(to, "fuzz/", 5)) return; /* fuzz/fuzz.h, itself on include/ only */
        breach(s, file, line, "a fuzzer includes %s: fuzz/ sees include/ only (and fuzz/*.h)%s", to, "");
        return;
    }
    if (!strncmp(from, "bench/", 6)) {
        if (!strncmp(to, "bench/", 6)) return;
        if (troom[0] && floor_of(troom) >= 0 && !is_private(to)) return;
        breach(s, file, line, "bench/ includes %s: include/ and the rooms' non-private headers only%s", to, "");
        return;
    }
    /* from a room of src/ */
    if (!troom[0]) {
        breach(s, file, line, "room %s includes %s, which is no room's", room, to);
        return;
    }
    if (!strcmp(room, troom)) return; /* its own files, private ones included */
    if (is_private(to)) {
        breach(s, file, line, "room %s includes %s, a private header of another room", room, to);
        return;
    }
    int f = floor_of(room), g = floor_of(troom);
    if (f < 0 || g < 0) return; /* a room without a floor is reported once per file */
    if (g >= f) {
        char what[256];
        snprintf(what, sizeof what, "%s (floor %d) includes %s (floor %d)", room, f, troom, g);
        breach(s, file, line, "%s: only lower floors (%s)", what, to);
    }
}

static void check_file(scan *s, const char *path) {
    const char *r = rel(s, path);
    char room[64];
    room_of(r, room, sizeof room);
    if (room[0] && floor_of(room) < 0)
        breach(s, path, 1, "room %s has no floor: add it to docs/architecture.md and tests/test-includes.c%s", room,
               "");
    FILE *f = fopen(path, "r");
    if (!f) {
        breach(s, path, 0, "cannot read %s%s", path, "");
        return;
    }
    s->files++;
    char line[4096];
    int n = 0;
    while (fgets(line, sizeof line, f)) {
        n++;
        const char *p = line;
        while (*p == ' ' || *p == '\t') p++;
        if (*p++ != '#') continue;
        while (*p == ' ' || *p == '\t') p++;
        if (strncmp(p, "include", 7)) continue;
        p += 7;
        while (*p == ' ' || *p == '\t') p++;
        if (*p != '"') continue; /* <...>: the system's */
        const char *q = strchr(p + 1, '"');
        if (!q) continue;
        char name[1024];
        snprintf(name, sizeof name, "%.*s", (int)(q - p - 1), p + 1);
        check_include(s, path, n, name);
    }
    fclose(f);
}

static bool source_file(const char *name) {
    return ends_with(name, ".c") || ends_with(name, ".h") || ends_with(name, ".cu") || ends_with(name, ".cuh");
}

static void walk(scan *s, const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return;
    struct dirent *e;
    while ((e = readdir(d))) {
        if (e->d_name[0] == '.') continue;
        char path[PATH_MAX];
        snprintf(path, sizeof path, "%s/%s", dir, e->d_name);
        struct stat st;
        if (stat(path, &st) != 0) continue;
        if (S_ISDIR(st.st_mode)) walk(s, path);
        else if (source_file(e->d_name)) check_file(s, path);
    }
    closedir(d);
}

static int scan_tree(const char *root, scan *s) {
    memset(s, 0, sizeof *s);
    if (!realpath(root, s->root)) return -1;
    static const char *const parts[] = {"src", "tools", "bench", "fuzz"};
    for (int i = 0; i < 4; i++) {
        char dir[PATH_MAX + 16];
        snprintf(dir, sizeof dir, "%s/%s", s->root, parts[i]);
        walk(s, dir);
    }
    return s->breaches;
}

static void put(const char *root, const char *rel_path, const char *text) {
    char path[PATH_MAX], dir[PATH_MAX];
    snprintf(path, sizeof path, "%s/%s", root, rel_path);
    snprintf(dir, sizeof dir, "%s", path);
    for (char *p = dir + strlen(root) + 1; *p; p++)
        if (*p == '/') {
            *p = 0;
            mkdir(dir, 0755);
            *p = '/';
        }
    FILE *f = fopen(path, "w");
    CHECK(f != NULL, "cannot write %s", path);
    if (!f) return;
    fputs(text, f);
    fclose(f);
}

/* A tree with one breach of each kind: the checker must find exactly these. */
static void test_checker_finds_breaches(void) {
    char root[PATH_MAX];
    moe_t_tmp_path(root, sizeof root, "include-rule-tree");
    mkdir(root, 0755);
    put(root, "include/moeaudit.h", "/* public */\n");
    put(root, "src/core/core.h", "#include \"moeaudit.h\"\n");
    put(root, "src/cpu/cpu_internal.h", "#include \"core/core.h\"\n");
    put(root, "src/cpu/kernels.h", "#include \"moeaudit.h\"\n");
    put(root, "src/experts/experts.h", "#include \"cpu/kernels.h\"\n");       /* fine: 4 -> 2 */
    put(root, "src/cpu/up.c", "#include \"experts/experts.h\"\n");           /* 1: cpu (2) -> experts (4) */
    put(root, "src/block/drv.c", "#include \"cpu/cpu_internal.h\"\n");       /* 2: another room's private */
    put(root, "tools/cmd.c", "#include \"moeaudit.h\"\n#include \"core/core.h\"\n"); /* 3: CLI beyond include/ */
    put(root, "tools/rel.c", "#include \"../src/cpu/kernels.h\"\n");         /* 4: the same, by a relative path */
    put(root, "src/newroom/x.c", "#include \"core/core.h\"\n");              /* 5: a room with no floor */
    put(root, "src/router/r.c", "#include \"router/gone.h\"\n");             /* 6: names no file */
    put(root, "fuzz/fz.c", "#include <stdio.h>\n#include \"cpu/kernels.h\"\n"); /* 7: fuzzer beyond include/ */
    put(root, "src/hc/hc.c", "#include \"hc/own_internal.h\"\n#include \"io/io.h\"\n"); /* fine */
    put(root, "src/hc/own_internal.h", "\n");
    put(root, "src/io/io.h", "#include \"core/core.h\"\n");
    scan s;
    int n = scan_tree(root, &s);
    CHECK(n == 7, "the planted tree has 7 breaches; the checker found %d:\n%s", n, s.first);
    static const char *const want[] = {"src/cpu/up.c:1", "src/block/drv.c:1", "tools/cmd.c:2", "tools/rel.c:1",
                                       "src/newroom/x.c:1", "src/router/r.c:1", "fuzz/fz.c:2"};
    for (int i = 0; i < 7; i++) CHECK(strstr(s.first, want[i]) != NULL, "breach at %s not reported:\n%s", want[i], s.first);
    fprintf(stderr, "  planted tree, as reported:\n%s", s.first);
}

static void test_tree_keeps_the_rule(void) {
    char root[PATH_MAX];
    snprintf(root, sizeof root, "%s", MOE_TEST_DATA);
    char *t = strstr(root, "/tests/data");
    CHECK(t != NULL, "MOE_TEST_DATA %s is not <root>/tests/data", MOE_TEST_DATA);
    if (!t) return;
    *t = 0;
    scan s;
    int n = scan_tree(root, &s);
    CHECK(n == 0, "%d breaches of the include rule (docs/architecture.md):\n%s", n, s.first);
    CHECK(s.files > 50 && s.includes > 150, "only %d files and %d includes read from %s", s.files, s.includes, root);
    fprintf(stderr, "  %d files, %d quoted includes checked\n", s.files, s.includes);
}

int main(void) {
    RUN(test_checker_finds_breaches);
    RUN(test_tree_keeps_the_rule);
    return moe_t_finish();
}
