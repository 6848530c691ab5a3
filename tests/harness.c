#include "harness.h"

#include <dirent.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

int moe_t_pass, moe_t_fail;

void moe_t_run(const char *name, moe_test_fn fn) {
    int f0 = moe_t_fail, p0 = moe_t_pass;
    fn();
    fprintf(stderr, "%-44s %s (%d checks)\n", name, moe_t_fail == f0 ? "ok" : "FAILED",
            (moe_t_pass - p0) + (moe_t_fail - f0));
}

int moe_t_finish(void) {
    printf("%d passed, %d failed\n", moe_t_pass, moe_t_fail);
    return moe_t_fail ? 1 : 0;
}

const char *moe_t_data(const char *rel) {
    static char buf[4096];
    snprintf(buf, sizeof buf, "%s/%s", MOE_TEST_DATA, rel);
    return buf;
}

const char *moe_t_tmpdir(void) {
    static char dir[256];
    if (!dir[0]) {
        const char *base = getenv("TMPDIR");
        snprintf(dir, sizeof dir, "%s/moe-test-XXXXXX", base ? base : "/tmp");
        if (!mkdtemp(dir)) { perror("mkdtemp"); exit(2); }
    }
    return dir;
}

int moe_t_count_temps(const char *dir) {
    DIR *d = opendir(dir);
    if (!d) return -1;
    int n = 0;
    struct dirent *de;
    while ((de = readdir(d)) != NULL)
        if (de->d_name[0] == '.' && strstr(de->d_name, ".tmp.")) n++;
    closedir(d);
    return n;
}
